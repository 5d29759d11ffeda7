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
    /// The strategy's collectives per step (gradient reductions,
    /// parameter gathers).
    pub collectives: u32,
    /// The loop's all-reduces of the step's loss per step (see
    /// [`LOSS_ALL_REDUCES`]): besides [`Summary::collectives`].
    pub loss_all_reduces: u32,
    /// What carried them ("" where unknown).
    pub via: &'static str,
    /// Seconds the same reductions take per step with nothing to overlap.
    pub unoverlapped_comm: Option<f64>,
    /// The tensor groups' collectives per step (tensor parallelism; the
    /// mesh's other dimension).
    pub tensor: crate::strategy::TensorStep,
}

/// All-reduces of the step's loss per step: the training loop averages
/// each step's loss over the ranks once the optimizer is done
/// ([`crate::Strategy::mean`]), one all-reduce of 8 bytes wherever the
/// strategy communicates (a single process averages nothing).
pub const LOSS_ALL_REDUCES: u32 = 1;

/// Bytes of the loss's all-reduce (one f64).
const LOSS_BYTES: u64 = 8;

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
        loss_all_reduces: if last.collectives > 0 {
            LOSS_ALL_REDUCES
        } else {
            0
        },
        via: last.via,
        unoverlapped_comm: run.unoverlapped_comm,
        tensor: last.tensor,
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
            "tensor_collectives_per_step": self.tensor.collectives,
            "tensor_payload_bytes_per_step": self.tensor.payload_bytes,
            "tensor_wire_bytes_per_step": self.tensor.wire_bytes,
        })
    }

    /// The breakdown as text lines.
    pub fn lines(&self) -> Vec<String> {
        let ms = |s: f64| format!("{:.2} ms", s * 1e3);
        let pct = |s: f64| 100.0 * s / self.mean_step.max(1e-12);
        let mut out = vec![format!(
            "median step {} over {} (first {} not counted) | {:.0} tokens/s",
            ms(self.median_step),
            braid_core::words::count(self.steps, "step"),
            self.warmup,
            self.tokens_per_s
        )];
        out.push(format!(
            "an average step of this rank ({}): compute {} ({:.1}%) | exposed communication {} ({:.1}%) | optimizer {} ({:.1}%) | data {} ({:.1}%)",
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
            // (The strategy's path: the loss's all-reduce takes the
            // run's communicator whatever the strategy's path.)
            let via = if self.via.is_empty() {
                String::new()
            } else {
                format!(" over {}", self.via)
            };
            let total = self.collectives + self.loss_all_reduces;
            let loss = match self.loss_all_reduces {
                0 => String::new(),
                k => format!(
                    " + {k} all-reduce{} of the step's loss ({} bytes)",
                    if k == 1 { "" } else { "s" },
                    k as u64 * LOSS_BYTES
                ),
            };
            out.push(format!(
                "communication per step: {total} collective{} = {} of the training strategy{via} ({:.2} MB reduced or gathered, {:.2} MB sent per rank){loss}",
                if total == 1 { "" } else { "s" },
                self.collectives,
                self.payload_bytes as f64 / 1e6,
                self.wire_bytes as f64 / 1e6
            ));
        }
        let t = self.tensor;
        if t.collectives > 0 {
            out.push(format!(
                "communication per step in the tensor groups (inside the passes): {} collectives, \
                 {:.2} MB of activations reduced or gathered, {:.2} MB sent per rank",
                t.collectives,
                t.payload_bytes as f64 / 1e6,
                t.wire_bytes as f64 / 1e6
            ));
        }
        if let Some(u) = self.unoverlapped_comm {
            out.push(self.overlap_line(u));
        }
        out
    }

    /// The overlap line, against `u` seconds (the strategy's reductions
    /// run alone after the backward pass): the share of `u` that
    /// computation hid, as `braid report` states it (`X% hidden`, 0 to
    /// 100), and the exposed communication beyond `u` named as what it
    /// is: waiting for slower ranks.
    fn overlap_line(&self, u: f64) -> String {
        let ms = |s: f64| format!("{:.2} ms", s * 1e3);
        let e = self.exposed_comm;
        let hidden = if u > 0.0 {
            (100.0 * (u - e) / u).clamp(0.0, 100.0)
        } else {
            0.0
        };
        let mut s = format!(
            "overlap: {hidden:.1}% of the strategy's reduction time hidden by computation (run alone after the backward pass, its reductions take {}; this rank's exposed communication was {}",
            ms(u),
            ms(e)
        );
        if e > u {
            s.push_str(&format!(
                ", {} of it beyond the reductions' own time: waiting for slower ranks, the loss's all-reduce included)",
                ms(e - u)
            ));
        } else {
            s.push(')');
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn summary(exposed_comm: f64, unoverlapped: f64) -> Summary {
        Summary {
            steps: 35,
            warmup: 5,
            median_step: 0.04,
            tokens_per_s: 1e5,
            mean_step: 0.04,
            compute: 0.03,
            exposed_comm,
            optimizer: 0.001,
            data: 0.0,
            payload_bytes: 482_304,
            wire_bytes: 723_456,
            collectives: 1,
            loss_all_reduces: LOSS_ALL_REDUCES,
            via: "",
            unoverlapped_comm: Some(unoverlapped),
            tensor: Default::default(),
        }
    }

    /// The percentages of `line`.
    fn percents(line: &str) -> Vec<f64> {
        line.split('%')
            .filter_map(|before| {
                let digits: String = before
                    .chars()
                    .rev()
                    .take_while(|c| c.is_ascii_digit() || *c == '.')
                    .collect();
                digits.chars().rev().collect::<String>().parse().ok()
            })
            .collect()
    }

    #[test]
    fn the_overlap_line_states_a_hidden_share_between_0_and_100_percent() {
        // A wait 9 times the reductions' own time: none of it hidden, the
        // rest named as waiting (it was "900.0% of that").
        let lines = summary(0.0025, 0.00025).lines();
        let overlap = lines.iter().find(|l| l.starts_with("overlap:")).unwrap();
        assert_eq!(percents(overlap), [0.0], "{overlap}");
        assert!(
            overlap.contains(
                "2.25 ms of it beyond the reductions' own time: waiting for slower ranks"
            ),
            "{overlap}"
        );
        // A wait of a quarter of their time: three quarters hidden.
        let lines = summary(0.0001, 0.0004).lines();
        let overlap = lines.iter().find(|l| l.starts_with("overlap:")).unwrap();
        assert_eq!(percents(overlap), [75.0], "{overlap}");
        assert!(!overlap.contains("waiting"), "{overlap}");
    }

    #[test]
    fn the_communication_line_counts_the_loss_all_reduce_too() {
        let lines = summary(0.001, 0.001).lines();
        let comm = lines
            .iter()
            .find(|l| l.starts_with("communication per step:"))
            .unwrap();
        assert!(
            comm.starts_with("communication per step: 2 collectives = 1 of the training strategy (0.48 MB reduced or gathered, 0.72 MB sent per rank) + 1 all-reduce of the step's loss (8 bytes)"),
            "{comm}"
        );
    }
}
