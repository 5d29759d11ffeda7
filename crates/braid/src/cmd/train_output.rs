//! What `braid train` prints and writes: the progress line (lead rank),
//! the end-of-run summary (time breakdown, communication, GPU figures)
//! and the JSON record of every step.

use braid_model::footprint::gib;
use braid_model::GptConfig;
use braid_train::engines::Precision;
use braid_train::memory_phase::{self, Phase};
use braid_train::summary::{summarize, Summary};
use braid_train::zero::paper_bytes;
use braid_train::{RunReport, StepReport};
use std::time::Instant;

/// Steps not counted in the summary (warm-up).
pub const WARMUP: usize = 5;

use super::progress::fmt_duration;

/// The progress line, about once a second (or every `--log-every`
/// steps), on the lead rank only.
pub struct Progress {
    /// Live metrics to update at every step (every rank).
    pub metrics: Option<super::train_trace::LiveMetrics>,
    /// Said once, after a progress line whose ETA is past an hour.
    pub slow_hint: Option<String>,
    lead: bool,
    every: Option<usize>,
    steps: usize,
    last: Instant,
    /// The first step this run took (after a resume, not 0): the ETA
    /// counts only the steps this run has timed.
    first: Option<usize>,
}

impl Progress {
    /// Progress of a run of `steps`, printed when `lead`.
    pub fn new(lead: bool, every: Option<usize>, steps: usize) -> Progress {
        Progress {
            metrics: None,
            slow_hint: None,
            lead,
            every,
            steps,
            last: Instant::now() - std::time::Duration::from_secs(10),
            first: None,
        }
    }

    /// Sees step `r`.
    pub fn step(&mut self, r: &StepReport) {
        if let Some(m) = &self.metrics {
            m.step(r);
        }
        let first = *self.first.get_or_insert(r.step);
        if !self.lead {
            return;
        }
        let due = match self.every {
            Some(k) => (r.step + 1) % k.max(1) == 0,
            None => self.last.elapsed().as_secs_f64() >= 1.0,
        };
        let last = r.step + 1 == self.steps;
        if !(due || last || r.step == first || r.eval_loss.is_some()) {
            return;
        }
        self.last = Instant::now();
        let eta = eta_seconds(r.elapsed, r.step + 1 - first, self.steps - r.step - 1);
        let eval = r
            .eval_loss
            .map(|e| format!(" | eval {e:.4}"))
            .unwrap_or_default();
        println!(
            "step {:>5}/{} | loss {:.4}{eval} | lr {:.2e} | norm {:.2} | {:.1}k tok/s | {} elapsed, eta {}",
            r.step + 1,
            self.steps,
            r.loss,
            r.lr,
            r.grad_norm,
            r.tokens_per_s / 1e3,
            fmt_duration(r.elapsed),
            fmt_duration(eta)
        );
        if eta > 3600.0 {
            if let Some(hint) = self.slow_hint.take() {
                println!("hint: {hint}");
            }
        }
    }
}

/// Seconds left for `left` more steps at the pace of the `done` steps
/// this run took in `elapsed` seconds.
fn eta_seconds(elapsed: f64, done: usize, left: usize) -> f64 {
    elapsed / done.max(1) as f64 * left as f64
}

/// Prints the end of a run: the final loss, the time breakdown and, on a
/// GPU, the median step's throughput, MFU (against the H100/H200 bf16
/// dense peak of 989 TFLOP/s per GPU, counting 6 · parameters + 12 ·
/// layers · width · sequence FLOPs per token) and peak device memory.
pub fn print_summary(
    run: &RunReport,
    cfg: &GptConfig,
    seq: usize,
    tokens_per_step: f64,
    gpu: Option<Precision>,
    ranks: usize,
) -> Option<Summary> {
    let last = run.steps.last()?;
    println!(
        "done: final loss {:.4} (ln(vocab)/2 = {:.3}) in {:.1} s",
        last.loss,
        (cfg.vocab_size as f64).ln() / 2.0,
        last.elapsed
    );
    let s = summarize(run, WARMUP, tokens_per_step)?;
    for line in s.lines() {
        println!("summary: {line}");
    }
    if let Some(precision) = gpu {
        let flops_per_tok =
            6.0 * cfg.num_params() as f64 + 12.0 * (cfg.n_layer * cfg.n_embd * seq) as f64;
        let mfu = s.tokens_per_s * flops_per_tok / (989e12 * ranks as f64) * 100.0;
        println!(
            "gpu summary: {} | {} GPU(s) | median step {:.1} ms over {} (first {} not counted) | {:.0} tokens/s | MFU {:.1}% (of 989 TFLOP/s per GPU) | peak device memory {:.2} GiB",
            precision.name(),
            ranks,
            s.median_step * 1e3,
            braid_core::words::count(s.steps, "step"),
            s.warmup,
            s.tokens_per_s,
            mfu,
            braid_cuda::pool::peak_allocated_bytes() as f64 / (1u64 << 30) as f64
        );
        if let Some(line) = memory_parts_line(run, cfg.n_layer) {
            println!("{line}");
        }
    }
    Some(s)
}

/// How many of the last step's parts the memory line names.
const PARTS_NAMED: usize = 4;

/// `"device memory: peak in backward layer 0; the last step's fullest
/// parts: …"`, when device memory was used.
fn memory_parts_line(run: &RunReport, n_layer: usize) -> Option<String> {
    let peak = memory_phase::peak()?;
    if braid_cuda::pool::peak_allocated_bytes() == 0 {
        return None;
    }
    let mut parts: Vec<&(Phase, u64)> = run.memory_phases.iter().collect();
    parts.sort_by_key(|p| std::cmp::Reverse(p.1));
    let named: Vec<String> = parts
        .iter()
        .take(PARTS_NAMED)
        .map(|(p, bytes)| format!("{} {:.2} GiB", p.name(n_layer), gib(*bytes as u128)))
        .collect();
    Some(format!(
        "device memory: peak reached in {}; the last step's fullest parts: {}",
        peak.name(n_layer),
        named.join(", ")
    ))
}

/// Prints the model state this rank held beside ZeRO's formula for
/// `stage` (0: data parallel or one process) sharded over `ranks` (the
/// shard group), in mixed precision where there are master weights; Ψ is
/// the model's parameters, or `held` (a pipeline rank's stages', a
/// tensor-parallel rank's share).
pub fn print_state(run: &RunReport, cfg: &GptConfig, held: Option<u64>, stage: u8, ranks: usize) {
    let st = run.state;
    if st.total() == 0 {
        return;
    }
    // A pipeline rank's parameters are its stages', a tensor-parallel
    // rank's its share (`held`).
    let psi = held.unwrap_or(cfg.num_params() as u64);
    let per = |b: u64| b as f64 / psi as f64;
    let mb = |b: u64| b as f64 / 1e6;
    let (formula, name) = paper_bytes(psi, stage, ranks as u64, st.master > 0);
    let master = match st.master {
        0 => String::new(),
        m => format!(" + f32 master weights {:.1} MB", mb(m)),
    };
    println!(
        "model states per rank: parameters {:.1} MB{master} | gradients {:.1} MB | optimizer state \
         {:.1} MB = {:.1} MB, {:.2} bytes per parameter",
        mb(st.params),
        mb(st.grads),
        mb(st.optimizer),
        mb(st.total()),
        per(st.total()),
    );
    println!(
        "model states by ZeRO's formula{} ({name}, Ψ = {psi}, N = {ranks}): {:.2} bytes per \
         parameter (measured / formula {:.2})",
        match stage {
            0 => String::new(),
            s => format!(" for stage {s}"),
        },
        per(formula),
        st.total() as f64 / formula as f64,
    );
    let sh = run.sharded;
    if sh.units_peak > 0 {
        let line = format!(
            "ZeRO-{stage} besides model states: whole blocks held at once, at most, {:.1} MB \
             ({}block gradients, buffers kept for reuse){}",
            mb(sh.units_peak),
            match stage {
                3 => "gathered parameters, ",
                _ => "",
            },
            match stage {
                3 => format!(
                    "; saved activations in the gradient shard's memory {:.1} MB",
                    mb(sh.saved_in_grads)
                ),
                _ => String::new(),
            },
        );
        println!("{}", braid_core::words::clauses(&line, "  "));
        println!(
            "ZeRO-{stage} block buffers made: {} in the last step, {} in the steps before",
            sh.buffers_made.0, sh.buffers_made.1
        );
    }
    if run.saved_in_grads > 0 {
        println!(
            "saved activations in the gradient buffer's memory until the backward pass wrote it: \
             {:.1} MB",
            mb(run.saved_in_grads)
        );
    }
    if st.offloaded > 0 && braid_cuda::pool::peak_allocated_bytes() == 0 {
        println!(
            "optimizer offloaded: {:.1} MB (f32 master weights, AdamW moments) updated apart \
             from the model's weights; on the CPU all of it is host memory, so nothing is saved",
            mb(st.offloaded)
        );
    } else if st.offloaded > 0 {
        println!(
            "offloaded to host memory: {:.1} MB (f32 master weights, AdamW moments, pinned \
             transfer buffers); on the GPU: {:.1} MB, {:.2} bytes per parameter",
            mb(st.offloaded),
            mb(st.total() - st.offloaded),
            per(st.total() - st.offloaded),
        );
    }
}

/// Writes every step and the summary as JSON where `out` says.
pub fn write_json(
    out: &super::json_out::JsonOut,
    run: &RunReport,
    summary: Option<&Summary>,
    n_layer: usize,
    pipeline: Option<serde_json::Value>,
    plan: Option<serde_json::Value>,
) -> Result<(), String> {
    let rows: Vec<serde_json::Value> = run
        .steps
        .iter()
        .map(|r| {
            serde_json::json!({"step": r.step + 1, "loss": r.loss, "eval_loss": r.eval_loss, "lr": r.lr,
                "grad_norm": r.grad_norm, "tokens_per_s": r.tokens_per_s, "elapsed_s": r.elapsed,
                "step_s": r.times.total, "compute_s": r.times.compute,
                "exposed_comm_s": r.times.exposed_comm, "optimizer_s": r.times.optimizer,
                "data_s": r.times.data, "comm_payload_bytes": r.comm.payload_bytes,
                "comm_wire_bytes": r.comm.wire_bytes})
        })
        .collect();
    let st = run.state;
    let mut doc = serde_json::json!({
        "steps": rows,
        "summary": summary.map(|s| s.to_json()),
        "model_state_bytes": {"params": st.params, "master": st.master, "grads": st.grads,
            "optimizer": st.optimizer, "offloaded": st.offloaded, "total": st.total()},
        "zero3_bytes": {"units_peak": run.sharded.units_peak,
            "saved_in_grads": run.sharded.saved_in_grads,
            "buffers_made_last_step": run.sharded.buffers_made.0,
            "buffers_made_before": run.sharded.buffers_made.1},
        "saved_in_grads_bytes": run.saved_in_grads,
    });
    if let Some(p) = plan {
        // braid plan's prediction for this layout beside the measurement.
        doc["plan"] = p;
    }
    if let Some(p) = pipeline {
        // The pipeline's timeline and bubble (`--pp`).
        doc["pipeline"] = p;
    }
    if braid_cuda::pool::peak_allocated_bytes() > 0 {
        // Where the device memory went: the peak's part, and the last
        // step part by part.
        let parts: Vec<serde_json::Value> = run
            .memory_phases
            .iter()
            .map(|(p, bytes)| serde_json::json!({"part": p.name(n_layer), "most_bytes": bytes}))
            .collect();
        doc["peak_device_bytes"] = braid_cuda::pool::peak_allocated_bytes().into();
        doc["model_buffer_bytes"] = run.model_buffer_bytes.into();
        doc["peak_device_part"] = memory_phase::peak().map(|p| p.name(n_layer)).into();
        doc["device_memory_by_part"] = parts.into();
    }
    out.write(&serde_json::to_string_pretty(&doc).expect("json"))
}
