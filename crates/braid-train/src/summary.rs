//! [`Summary`]: a run's steady-state figures — the median step, throughput,
//! and where an average step's time went (computation, communication the
//! computation did not hide, optimizer, data), with the bytes communicated.

use crate::trainer::RunReport;

/// Steady-state figures of a run (steps after the warm-up).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Summary {
    /// Steps counted.
    pub steps: usize,
    /// Warm-up steps not counted.
    pub warmup: usize,
    /// Median step, seconds.
    pub median_step: f64,
    /// Tokens (or samples) per second over all ranks, at the median step.
    pub tokens_per_s: f64,
    /// Mean seconds per step of: the whole step, computation, exposed
    /// communication, optimizer, data.
    pub mean_step: f64,
    /// See [`Summary::mean_step`].
    pub compute: f64,
    /// See [`Summary::mean_step`].
    pub exposed_comm: f64,
    /// See [`Summary::mean_step`].
    pub optimizer: f64,
    /// See [`Summary::mean_step`].
    pub data: f64,
    /// Gradient bytes handed to collectives per step.
    pub payload_bytes: u64,
    /// Bytes each rank sends per step for them.
    pub wire_bytes: u64,
    /// Collectives per step.
    pub collectives: u32,
    /// What carried them ("" where unknown).
    pub via: &'static str,
    /// Seconds the same reductions take per step with nothing to overlap.
    pub unoverlapped_comm: Option<f64>,
}

/// The summary of `run`, not counting the first `warmup` steps (fewer if
/// the run is short); `items_per_step` is the global batch's tokens.
pub fn summarize(run: &RunReport, warmup: usize, items_per_step: f64) -> Option<Summary> {
    let n = run.steps.len();
    if n == 0 {
        return None;
    }
    let warm = warmup.min(n.saturating_sub(1));
    let counted = &run.steps[warm..];
    let k = counted.len() as f64;
    let mean =
        |f: &dyn Fn(&crate::trainer::StepReport) -> f64| counted.iter().map(f).sum::<f64>() / k;
    let mut totals: Vec<f64> = counted.iter().map(|r| r.times.total).collect();
    totals.sort_by(|a, b| a.partial_cmp(b).expect("finite"));
    let median_step = totals[totals.len() / 2];
    let last = counted.last().expect("not empty").comm;
    Some(Summary {
        steps: counted.len(),
        warmup: warm,
        median_step,
        tokens_per_s: items_per_step / median_step,
        mean_step: mean(&|r| r.times.total),
        compute: mean(&|r| r.times.compute),
        exposed_comm: mean(&|r| r.times.exposed_comm),
        optimizer: mean(&|r| r.times.optimizer),
        data: mean(&|r| r.times.data),
        payload_bytes: last.payload_bytes,
        wire_bytes: last.wire_bytes,
        collectives: last.collectives,
        via: last.via,
        unoverlapped_comm: run.unoverlapped_comm,
    })
}

impl Summary {
    /// As JSON.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "steps_counted": self.steps,
            "warmup_steps": self.warmup,
            "median_step_s": self.median_step,
            "tokens_per_s": self.tokens_per_s,
            "mean_step_s": self.mean_step,
            "compute_s": self.compute,
            "exposed_comm_s": self.exposed_comm,
            "optimizer_s": self.optimizer,
            "data_s": self.data,
            "payload_bytes_per_step": self.payload_bytes,
            "wire_bytes_per_step": self.wire_bytes,
            "collectives_per_step": self.collectives,
            "collectives_via": self.via,
            "unoverlapped_comm_s": self.unoverlapped_comm,
        })
    }

    /// The breakdown as text lines.
    pub fn lines(&self) -> Vec<String> {
        let ms = |s: f64| format!("{:.2} ms", s * 1e3);
        let pct = |s: f64| 100.0 * s / self.mean_step.max(1e-12);
        let mut out = vec![format!(
            "median step {} over {} steps (first {} not counted) | {:.0} tokens/s",
            ms(self.median_step),
            self.steps,
            self.warmup,
            self.tokens_per_s
        )];
        out.push(format!(
            "an average step ({}): compute {} ({:.1}%) | exposed communication {} ({:.1}%) | optimizer {} ({:.1}%) | data {} ({:.1}%)",
            ms(self.mean_step),
            ms(self.compute),
            pct(self.compute),
            ms(self.exposed_comm),
            pct(self.exposed_comm),
            ms(self.optimizer),
            pct(self.optimizer),
            ms(self.data),
            pct(self.data)
        ));
        if self.collectives > 0 {
            let via = if self.via.is_empty() {
                String::new()
            } else {
                format!(" over {}", self.via)
            };
            out.push(format!(
                "communication per step: {} collectives{via}, {:.2} MB reduced or gathered, {:.2} MB sent per rank",
                self.collectives,
                self.payload_bytes as f64 / 1e6,
                self.wire_bytes as f64 / 1e6
            ));
        }
        if let Some(u) = self.unoverlapped_comm {
            out.push(format!(
                "overlap: the same reductions take {} when run after the backward pass; the wait after it was {} ({:.1}% of that; the wait also holds any lag of slower ranks)",
                ms(u),
                ms(self.exposed_comm),
                100.0 * self.exposed_comm / u.max(1e-12)
            ));
        }
        out
    }
}
