//! The planner's cost model: one layout's step time on a machine
//! ([`predict`]), from the products and attention of each stage's
//! micro-batches (their sizes after tensor parallelism, at the rate the
//! hardware description gives such products), the tensor groups'
//! all-reduces in the passes, the pipeline's schedule simulated with the
//! schedule module's own [`simulate`](crate::schedule::check::simulate),
//! the data dimension's gradient reduction (and ZeRO-3's gathers) hidden
//! under the backward pass as far as it lasts, and the optimizer's
//! memory-bound update.

use super::hardware::{Hardware, Link};
use crate::pipeline::assign::{assign, head_cost};
use crate::plan::calibrate::attention_forward_flops;
use crate::schedule::build::ScheduleKind;
use crate::schedule::check::simulate_actions;
use crate::schedule::Schedule;
use crate::schedule::{Action, Op};
use braid_model::{GptConfig, Stage};
use serde::Serialize;

/// What is trained: the model's shape, the sequence and the global batch.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Workload {
    pub layers: usize,
    pub width: usize,
    pub heads: usize,
    pub vocab: usize,
    pub seq: usize,
    /// Sequences per step over every replica.
    pub global_batch: usize,
    /// Whether attention runs fused (braid's flash attention: no scores in
    /// memory) or as two batched products around a softmax over the
    /// whole score matrix (Megatron-LM's 2021 runs).
    pub fused_attention: bool,
}

impl Workload {
    /// `cfg`'s model over sequences of `seq` tokens, `global_batch` of
    /// them a step, with braid's fused attention.
    pub fn of(cfg: &GptConfig, seq: usize, global_batch: usize) -> Workload {
        Workload {
            layers: cfg.n_layer,
            width: cfg.n_embd,
            heads: cfg.n_head,
            vocab: cfg.vocab_size,
            seq,
            global_batch,
            fused_attention: true,
        }
    }

    /// The model, with a context of the workload's sequence.
    pub fn config(&self) -> GptConfig {
        GptConfig {
            n_layer: self.layers,
            n_head: self.heads,
            n_embd: self.width,
            vocab_size: self.vocab,
            context: self.seq,
        }
    }

    /// Parameters (GPT-2's layout: 12 L C² + 13 L C + (V + T) C).
    pub fn params(&self) -> f64 {
        let (l, c) = (self.layers as f64, self.width as f64);
        12.0 * l * c * c + 13.0 * l * c + (self.vocab + self.seq) as f64 * c
    }

    /// FLOPs of one step as Megatron-LM counts them (its paper's eq.: 96
    /// B s l h² (1 + s / 6h + V / 16 l h), activation recomputation
    /// included): the figure its TFLOP/s per GPU divide.
    pub fn megatron_flops(&self) -> f64 {
        let (b, s, l, h, v) = (
            self.global_batch as f64,
            self.seq as f64,
            self.layers as f64,
            self.width as f64,
            self.vocab as f64,
        );
        96.0 * b * s * l * h * h * (1.0 + s / (6.0 * h) + v / (16.0 * l * h))
    }

    /// FLOPs of one step without recomputation: 6 N + 12 L C T per token.
    pub fn model_flops(&self) -> f64 {
        let tokens = (self.global_batch * self.seq) as f64;
        tokens * (6.0 * self.params() + 12.0 * (self.layers * self.width * self.seq) as f64)
    }
}

/// One way to lay the work out over the GPUs.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Layout {
    /// Data-parallel replicas, tensor-parallel and pipeline degrees.
    pub dp: usize,
    pub tp: usize,
    pub pp: usize,
    /// ZeRO stage over the data dimension (0: plain data parallelism).
    pub zero: u8,
    /// Sequences per micro-batch, and micro-batches per step per replica.
    pub micro_batch: usize,
    pub micro_batches: usize,
    /// The pipeline's schedule (with `pp` > 1).
    #[serde(skip)]
    pub schedule: Option<ScheduleKind>,
    /// Activation checkpointing (each block's forward pass again in the
    /// backward).
    pub checkpointing: bool,
    /// Whether the data dimension's reduction runs under the backward
    /// pass (braid's buckets; Megatron-LM's 2021 runs reduced after it).
    pub overlap_data: bool,
    /// Hybrid sharding (HSDP, `--shard-group S`): the ZeRO stage shards
    /// over groups of S replicas and the groups replicate; `None`: over
    /// the whole data dimension.
    pub shard_group: Option<usize>,
    /// The optimizer (master weights, moments, update) in host memory
    /// (`--offload optimizer`).
    pub offload: bool,
    /// The sequence split over the tensor group (`--sp`; braid's default
    /// wherever `--tp` runs outside a pipeline,
    /// [`Layout::braid_sequence_parallel`]; Megatron-LM's 2021 runs had
    /// none).
    pub sequence_parallel: bool,
}

impl Layout {
    /// Whether `braid train` splits the sequence over the tensor group by
    /// default for `tp` and `pp`: with `--tp` above 1 outside a pipeline.
    pub fn braid_sequence_parallel(tp: usize, pp: usize) -> bool {
        tp > 1 && pp == 1
    }

    /// Ranks a ZeRO stage shards the model states over: the shard group,
    /// or every replica.
    pub fn shard_ranks(&self) -> usize {
        match (self.zero, self.shard_group) {
            (0, _) => 1,
            (_, Some(s)) => s,
            (_, None) => self.dp,
        }
    }
}

/// Where one step's time goes, and what it comes to.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct Prediction {
    /// The step, seconds.
    pub step_s: f64,
    /// Computation of the rank's stages (every micro-batch), tensor
    /// groups' all-reduces apart.
    pub compute_s: f64,
    /// The tensor groups' all-reduces inside the passes (not hidden).
    pub tensor_comm_s: f64,
    /// The pipeline's idle time (its bubble) and its sends.
    pub bubble_s: f64,
    /// The data dimension's reduction (and ZeRO-3's gathers): in all, and
    /// what the backward pass did not hide.
    pub data_comm_s: f64,
    pub data_exposed_s: f64,
    /// The optimizer's update.
    pub optimizer_s: f64,
    /// One micro-batch's forward and backward pass on the rank's stages
    /// (tensor all-reduces included): what communication hides under.
    pub forward_s: f64,
    pub backward_s: f64,
}

/// Bytes of a bf16 activation of `tokens` × `width`.
fn act_bytes(tokens: f64, width: f64) -> f64 {
    2.0 * tokens * width
}

/// The payload of one tensor-group all-reduce (a sublayer's output, one
/// micro-batch, bf16), and how many run per micro-batch per layer: two
/// forward, two in the backward pass, two more with recomputation, and
/// under sequence parallelism one more's worth in the backward pass
/// ([`sequence_parallel_extra`]).
pub(super) fn tensor_all_reduce(w: &Workload, l: &Layout) -> (f64, f64) {
    let tokens = (l.micro_batch * w.seq) as f64;
    let per_layer =
        2.0 * (2.0 + if l.checkpointing { 1.0 } else { 0.0 }) + 2.0 * sequence_parallel_extra(l);
    (act_bytes(tokens, w.width as f64), per_layer)
}

/// The backward pass's tensor communication beyond the forward pass's
/// under sequence parallelism, as a fraction of the forward's: a layer's
/// backward pass gathers the two column-parallel products' inputs again
/// for their weight gradients — six all-gathers and reduce-scatters against the
/// forward pass's four (counted in a 2.65B `--tp 4` run on 4 H100s: 10.2
/// activations' worth a layer, 20.6 GB sent a rank a step).
pub(super) fn sequence_parallel_extra(l: &Layout) -> f64 {
    match l.tp > 1 && l.sequence_parallel {
        true => 0.5,
        false => 0.0,
    }
}

/// The payload of one pipeline send (a micro-batch's activation or its
/// gradient, split over the tensor group).
pub(super) fn pipeline_send(w: &Workload, l: &Layout) -> f64 {
    act_bytes((l.micro_batch * w.seq) as f64, w.width as f64) / l.tp as f64
}

/// One kind of collective the data dimension runs in a step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct DataCollective {
    /// `data` (over the replicas, or a hybrid shard group), `replicas`
    /// (hybrid sharding's sum across the groups).
    pub dimension: &'static str,
    /// Bytes in one collective, ranks it runs over, and the span of
    /// consecutive ranks its group covers (which link it takes).
    pub payload: f64,
    pub ranks: usize,
    pub span: usize,
    /// An all-gather (else an all-reduce), and how many run.
    pub gather: bool,
    pub count: f64,
}

impl DataCollective {
    /// Seconds they take on `hw`.
    pub fn seconds(&self, hw: &Hardware) -> f64 {
        let link = link_for(hw, self.span);
        self.count
            * match self.gather {
                true => link.all_gather_s(self.payload, self.ranks),
                false => link.all_reduce_s(self.payload, self.ranks),
            }
    }

    /// Bytes one GPU sends for them (a ring's).
    pub fn wire_bytes(&self) -> f64 {
        let n = self.ranks as f64;
        let share = match self.gather {
            true => (n - 1.0) / n,
            false => 2.0 * (n - 1.0) / n,
        };
        self.count * share * self.payload
    }
}

/// The data dimension's collectives in a step: the f32 gradients summed
/// over the replicas (under hybrid sharding: within the shard group, then
/// the group's share across the groups), and under ZeRO-3 the bf16
/// parameters gathered twice over the ranks that shard them.
pub(super) fn data_collectives(w: &Workload, l: &Layout) -> Vec<DataCollective> {
    let per_gpu = w.params() / (l.tp * l.pp) as f64;
    let model = l.tp * l.pp;
    let s = l.shard_ranks().max(1);
    let grads = 4.0 * per_gpu;
    let mut out = Vec::new();
    let mut add = |dimension, payload, ranks: usize, span, gather, count| {
        if ranks > 1 {
            out.push(DataCollective {
                dimension,
                payload,
                ranks,
                span,
                gather,
                count,
            });
        }
    };
    match l.shard_group.filter(|&g| l.zero > 0 && g < l.dp) {
        None => add("data", grads, l.dp, model * l.dp, false, 1.0),
        Some(g) => {
            add("data", grads, g, model * g, false, 1.0);
            add(
                "replicas",
                grads / g as f64,
                l.dp / g,
                model * l.dp,
                false,
                1.0,
            );
        }
    }
    if l.zero == 3 {
        add("data", 2.0 * per_gpu, s, model * s, true, 2.0);
    }
    out
}

/// The link a group of `n` consecutive-stride ranks uses: inside a node
/// when the group fits in one, else across nodes.
pub(super) fn link_for(hw: &Hardware, span: usize) -> Link {
    match span <= hw.gpus_per_node {
        true => hw.intra,
        false => hw.inter,
    }
}

/// Seconds of one micro-batch's forward pass through `layers` layers on
/// one GPU of a tensor group of `tp` (its products, attention and
/// elementwise work), and of its tensor all-reduces.
fn forward_s(w: &Workload, l: &Layout, hw: &Hardware, layers: f64) -> (f64, f64) {
    let (h, t) = (w.width as f64, l.tp as f64);
    let tokens = (l.micro_batch * w.seq) as f64;
    let gemm = |m: f64, k: f64, n: f64| hw.product_s(m, k, n);
    let products = gemm(tokens, h, 3.0 * h / t)
        + gemm(tokens, h / t, h)
        + gemm(tokens, h, 4.0 * h / t)
        + gemm(tokens, 4.0 * h / t, h);
    let (b, s) = (l.micro_batch as f64, w.seq as f64);
    let heads = w.heads as f64 / t;
    let attention = match w.fused_attention {
        // Causal: half of 4 b s² h (as calibration counts it), split over
        // the heads.
        true => {
            let flops = attention_forward_flops(l.micro_batch, w.seq, w.width) / t;
            let efficiency = hw.attention_efficiency_at(w.width, w.heads);
            flops / (hw.peak_tflops * 1e12 * efficiency)
        }
        // Q Kᵀ and P V per head, then four passes over the scores (the
        // fused scale-mask-softmax's read and write, dropout's) in bf16.
        false => {
            let per_head = hw.gemm_s(2.0 * s * s * h / w.heads as f64);
            2.0 * b * heads * per_head + 4.0 * 2.0 * b * heads * s * s / (hw.hbm_gbps * 1e9)
        }
    };
    // LayerNorms, GELU, residuals and their f32 copies: about sixteen
    // passes over the activation (sequence parallel: its share; else the
    // LayerNorms and residuals run whole on every rank of the group, the
    // GELU on its share: about twelve passes whole, four shared).
    let passes = match l.sequence_parallel {
        true => 16.0 / t,
        false => 12.0 + 4.0 / t,
    };
    let elementwise = passes * act_bytes(tokens, h) / (hw.hbm_gbps * 1e9);
    let tensor = match l.tp {
        1 => 0.0,
        _ => 2.0 * link_for(hw, l.tp).all_reduce_s(tensor_all_reduce(w, l).0, l.tp),
    };
    (
        layers * (products + attention + elementwise),
        layers * tensor,
    )
}

/// The head's product (vocabulary split over the tensor group) of one
/// micro-batch, forward, and its share of the loss: the f32 logits
/// written, read by the softmax and cross-entropy, their gradient written
/// and read by the backward products (about six passes, a third of them
/// counted here, in the forward pass's unit).
fn head_s(w: &Workload, l: &Layout, hw: &Hardware) -> f64 {
    let tokens = (l.micro_batch * w.seq) as f64;
    let logits = tokens * w.vocab as f64 / l.tp as f64;
    let vocab = w.vocab as f64 / l.tp as f64;
    hw.product_s(tokens, w.width as f64, vocab) + 2.0 * 4.0 * logits / (hw.hbm_gbps * 1e9)
}

/// The compute the data dimension's reduction hides under: the last
/// micro-batch's backward pass (`bwd`; with ZeRO-3's gathers, its forward
/// `fwd` too), all but the last bucket's share.
pub(super) fn data_window(l: &Layout, fwd: f64, bwd: f64) -> f64 {
    match l.zero {
        3 => 0.9 * (fwd + bwd),
        _ => 0.9 * bwd,
    }
}

/// Predicts `layout`'s step for `w` on `hw`. Errors where the layout
/// does not divide the work.
pub fn predict(w: &Workload, l: &Layout, hw: &Hardware) -> Result<Prediction, String> {
    predict_with(w, l, hw, None)
}

/// [`predict`], with `l`'s pipeline schedule already `built` (`None`:
/// built here).
pub fn predict_with(
    w: &Workload,
    l: &Layout,
    hw: &Hardware,
    built: Option<&Schedule>,
) -> Result<Prediction, String> {
    if l.dp * l.micro_batch * l.micro_batches != w.global_batch {
        return Err(format!(
            "{} replicas x {} micro-batches of {} is not the global batch {}",
            l.dp, l.micro_batches, l.micro_batch, w.global_batch
        ));
    }
    let layers = (w.layers as f64 / l.pp as f64).ceil();
    let (f_layers, f_tensor) = forward_s(w, l, hw, layers);
    // The last stage's head (forward and backward: 3 products).
    let head = head_s(w, l, hw);
    let recompute = if l.checkpointing { 1.0 } else { 0.0 };
    // Forward, backward (twice the forward's products), recomputation.
    let fwd = f_layers + f_tensor + head / l.pp as f64;
    // (The backward pass all-reduces as often as the forward: its input
    // gradients.)
    let sp = sequence_parallel_extra(l);
    let bwd =
        (2.0 + recompute) * f_layers + (1.0 + recompute + sp) * f_tensor + 2.0 * head / l.pp as f64;
    let m = l.micro_batches;
    let compute_one = f_layers * (3.0 + recompute) + 3.0 * head / l.pp as f64;
    let tensor_one = f_tensor * (2.0 + recompute + sp);
    let (pipeline_s, bubble_s) = match (l.pp, l.schedule) {
        (1, _) | (_, None) => (m as f64 * (fwd + bwd), 0.0),
        (p, Some(kind)) => {
            let owned;
            let sched = match built {
                Some(s) => s,
                None => {
                    owned = kind.build(p, m)?;
                    &owned
                }
            };
            let v = kind.virtual_stages().max(1);
            // The stages as braid train splits them by default: by time,
            // the head's counted on the last stage, which runs it (the
            // embedding lookup on the first is negligible).
            let stages = assign(w.layers, p * v, None, head_cost(w.width, w.vocab, w.seq))?;
            let (layer_f, layer_t) = forward_s(w, l, hw, 1.0);
            let fwd_of = |st: &Stage| {
                st.layers.len() as f64 * (layer_f + layer_t) + if st.last { head } else { 0.0 }
            };
            let bwd_of = |st: &Stage| {
                st.layers.len() as f64
                    * ((2.0 + recompute) * layer_f + (1.0 + recompute + sp) * layer_t)
                    + if st.last { 2.0 * head } else { 0.0 }
            };
            let send = link_for(hw, l.tp * l.pp).send_s(pipeline_send(w, l));
            let cost = |a: &Action| match a.op {
                Op::Forward => fwd_of(&stages[a.stage]),
                Op::Backward => bwd_of(&stages[a.stage]),
                Op::BackwardInput | Op::BackwardWeight => bwd_of(&stages[a.stage]) / 2.0,
                _ => send,
            };
            let sim = simulate_actions(sched, &cost)?;
            // The bubble: the busiest rank's idle time.
            let busy = sim.ranks.iter().map(|r| r.busy).fold(0.0, f64::max);
            (sim.makespan, (sim.makespan - busy).max(0.0))
        }
    };
    // The data dimension: gradients (f32) reduced over the replicas, the
    // parameters gathered twice more under ZeRO-3 (bf16).
    let per_gpu = w.params() / (l.tp * l.pp) as f64;
    let data_comm = data_collectives(w, l)
        .iter()
        .fold(0.0, |t, c| t + c.seconds(hw));
    let window = data_window(l, fwd, bwd);
    let data_exposed = match l.overlap_data {
        true => (data_comm - window).max(0.0),
        false => data_comm,
    };
    // AdamW: about 36 bytes of memory traffic per parameter it owns, in
    // the GPU's memory or, offloaded, the host's (after the backward
    // pass: the update waits for the gradients' norm).
    let owned = per_gpu / l.shard_ranks() as f64;
    let rate = match l.offload {
        true => hw.host_update_gbps,
        false => hw.hbm_gbps,
    };
    let optimizer = 36.0 * owned / (rate * 1e9);
    let step = pipeline_s + data_exposed + optimizer;
    Ok(Prediction {
        step_s: step,
        compute_s: m as f64 * compute_one,
        tensor_comm_s: m as f64 * tensor_one,
        bubble_s,
        data_comm_s: data_comm,
        data_exposed_s: data_exposed,
        optimizer_s: optimizer,
        forward_s: fwd,
        backward_s: bwd,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::testing::{gpt, plain};

    /// Megatron-LM's Table 1 (Narayanan et al. 2021, A100s, V 51,200, s
    /// 2,048, activation recomputation, micro-batch 1 — as the paper ran
    /// them): heads, width, layers, TP, PP, GPUs, global batch, achieved
    /// TFLOP/s per GPU.
    /// heads, width, layers, TP, PP, GPUs, global batch, TFLOP/s.
    type Row = (usize, usize, usize, usize, usize, usize, usize, f64);

    const TABLE_1: [Row; 10] = [
        (24, 2304, 24, 1, 1, 32, 512, 137.0),
        (32, 3072, 30, 2, 1, 64, 512, 138.0),
        (32, 4096, 36, 4, 1, 128, 512, 142.0),
        (48, 6144, 40, 8, 1, 256, 1024, 135.0),
        (64, 8192, 48, 8, 2, 512, 1536, 138.0),
        (80, 10240, 60, 8, 4, 1024, 1792, 140.0),
        (96, 12288, 80, 8, 8, 1536, 2304, 148.0),
        (128, 16384, 96, 8, 16, 1920, 2160, 155.0),
        (128, 20480, 105, 8, 35, 2520, 2520, 163.0),
        (160, 25600, 128, 8, 64, 3072, 3072, 163.0),
    ];

    /// The predicted TFLOP/s per GPU of each Table 1 row, and the
    /// paper's.
    pub(crate) fn megatron_rows() -> Vec<(String, f64, f64)> {
        let hw = Hardware::builtin("a100").unwrap();
        TABLE_1
            .iter()
            .map(|&(heads, width, layers, tp, pp, gpus, batch, paper)| {
                let w = Workload {
                    layers,
                    width,
                    heads,
                    vocab: 51200,
                    seq: 2048,
                    global_batch: batch,
                    fused_attention: false,
                };
                let dp = gpus / (tp * pp);
                let l = Layout {
                    dp,
                    tp,
                    pp,
                    zero: 0,
                    micro_batch: 1,
                    micro_batches: batch / dp,
                    schedule: (pp > 1).then_some(ScheduleKind::OneFOneB),
                    checkpointing: true,
                    overlap_data: false,
                    shard_group: None,
                    offload: false,
                    sequence_parallel: false,
                };
                let p = predict(&w, &l, &hw).unwrap();
                let tflops = w.megatron_flops() / p.step_s / gpus as f64 / 1e12;
                (format!("{:.1}B", w.params() / 1e9), tflops, paper)
            })
            .collect()
    }

    #[test]
    fn megatrons_table_1_is_predicted_within_15_percent_for_8_of_10() {
        let rows = megatron_rows();
        let within = rows
            .iter()
            .filter(|(_, got, paper)| (got / paper - 1.0).abs() <= 0.15)
            .count();
        let table: Vec<String> = rows
            .iter()
            .map(|(n, got, paper)| {
                format!(
                    "{n}: {got:.0} against {paper:.0} ({:+.0} %)",
                    100.0 * (got / paper - 1.0)
                )
            })
            .collect();
        eprintln!("{}", table.join("\n"));
        assert!(
            within >= 8,
            "{within} of 10 within 15 %:\n{}",
            table.join("\n")
        );
    }

    #[test]
    fn a_layout_that_does_not_divide_the_batch_is_refused() {
        let (w, l) = (gpt(12, 12, 768, 64), plain(3, 1, 1, 8, 2));
        assert!(predict(&w, &l, &Hardware::builtin("h100").unwrap())
            .unwrap_err()
            .contains("global batch"));
    }
}

#[cfg(test)]
mod one_gpu {
    use super::*;
    use crate::plan::testing::{gpt, plain};

    /// braid's own one-H100 figures (BENCHMARKS.md, issue 69's table:
    /// bf16, T 1024): model (layers, heads, width), batch, tokens/s.
    const MEASURED: [(usize, usize, usize, usize, f64); 3] = [
        (12, 12, 768, 16, 462_500.0),
        (48, 25, 1600, 8, 43_100.0),
        (32, 32, 2560, 8, 29_550.0),
    ];

    #[test]
    fn braids_one_h100_figures_are_predicted_within_15_percent() {
        let hw = Hardware::builtin("h100").unwrap();
        let mut lines = Vec::new();
        let mut worst: f64 = 0.0;
        for (layers, heads, width, batch, measured) in MEASURED {
            let w = gpt(layers, heads, width, batch);
            let l = plain(1, 1, 1, batch, 1);
            let p = predict(&w, &l, &hw).unwrap();
            let got = (batch * 1024) as f64 / p.step_s;
            worst = worst.max((got / measured - 1.0).abs());
            lines.push(format!(
                "L{layers}-C{width} B{batch}: {got:.0} against {measured:.0} ({:+.1} %)",
                100.0 * (got / measured - 1.0)
            ));
        }
        eprintln!("{}", lines.join("\n"));
        assert!(worst <= 0.15, "{}", lines.join("\n"));
    }

    /// braid's offloaded optimizer on one H100 (BENCHMARKS.md, 2026-11-23:
    /// batch 8 x 1024, checkpointing): 2.65B's step 1.33 s, 6.35B's
    /// 3.00 s, most of it the host's update; predicted within 15 %.
    #[test]
    fn the_offloaded_optimizers_steps_are_predicted_within_15_percent() {
        let hw = Hardware::builtin("h100").unwrap();
        for (layers, heads, width, measured) in [(32, 20, 2560, 1.33), (40, 28, 3584, 3.00)] {
            let w = gpt(layers, heads, width, 8);
            let l = Layout {
                checkpointing: true,
                offload: true,
                ..plain(1, 1, 1, 8, 1)
            };
            let p = predict(&w, &l, &hw).unwrap();
            let off = p.step_s / measured - 1.0;
            eprintln!(
                "L{layers}-C{width} offloaded: {:.2} s against {measured:.2} s ({:+.1} %)",
                p.step_s,
                100.0 * off
            );
            assert!(off.abs() <= 0.15, "{:.2} s against {measured}", p.step_s);
            assert!(
                p.optimizer_s > 0.5 * p.step_s,
                "the host's update dominates: {p:?}"
            );
        }
    }
}
