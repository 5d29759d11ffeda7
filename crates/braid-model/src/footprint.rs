//! Memory pre-flight: the bytes a training run will allocate, part by
//! part, computed from the model's shapes before anything is allocated,
//! and the check of that estimate against what the machine has — so a
//! model that will not fit is refused at the start, with the figures and
//! what would fit, instead of dying midway with an out-of-memory abort.
//!
//! Sizes are `u128` so that no configuration, however absurd, overflows
//! the arithmetic that is meant to refuse it.

use crate::config::GptConfig;
use crate::model::Widths;

/// One part of a footprint.
#[derive(Debug, Clone, PartialEq)]
pub struct Part {
    /// What it is ("parameters", "activations", …).
    pub name: &'static str,
    /// Bytes.
    pub bytes: u128,
}

/// What a run will allocate in one memory (host or one GPU).
#[derive(Debug, Clone, PartialEq)]
pub struct Footprint {
    /// The parts, largest first as built.
    pub parts: Vec<Part>,
}

/// Bytes in GiB, for messages.
pub fn gib(bytes: u128) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

impl Footprint {
    /// The sum of the parts.
    pub fn total(&self) -> u128 {
        self.parts.iter().map(|p| p.bytes).sum()
    }

    /// The bytes of part `name` (0 if absent).
    pub fn part(&self, name: &str) -> u128 {
        self.parts
            .iter()
            .filter(|p| p.name == name)
            .map(|p| p.bytes)
            .sum()
    }

    /// `"parameters 1.00 GiB + gradients … = 9.00 GiB"`.
    pub fn breakdown(&self) -> String {
        let parts: Vec<String> = self
            .parts
            .iter()
            .filter(|p| p.bytes > 0)
            .map(|p| format!("{} {:.2} GiB", p.name, gib(p.bytes)))
            .collect();
        format!("{} = {:.2} GiB", parts.join(" + "), gib(self.total()))
    }
}

/// Elements of the CPU model's [`Activations`](crate::Activations) for
/// batches of `b × t` (see `Activations::new`, which this mirrors; a test
/// holds the two together).
pub fn cpu_activation_elements(cfg: &GptConfig, b: usize, t: usize, checkpointing: bool) -> u128 {
    cpu_activation_elements_split(cfg, b, t, checkpointing, TensorSplit::NONE)
}

/// How a run splits each layer over tensor-parallel ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorSplit {
    /// Ranks in a tensor group (1: none).
    pub ranks: usize,
    /// Sequence parallelism: the residual stream's rows split too.
    pub sequence: bool,
}

impl TensorSplit {
    /// No tensor parallelism.
    pub const NONE: TensorSplit = TensorSplit {
        ranks: 1,
        sequence: false,
    };

    /// Rows of the residual stream split this many ways.
    fn rows(&self) -> u128 {
        match self.sequence {
            true => self.ranks as u128,
            false => 1,
        }
    }
}

/// [`cpu_activation_elements`] of a tensor-parallel rank (its heads, MLP
/// columns and vocabulary rows; under sequence parallelism its rows of
/// the residual stream), as `Gpt::activations` allocates them (the rank
/// holding the most vocabulary rows).
pub fn cpu_activation_elements_split(
    cfg: &GptConfig,
    b: usize,
    t: usize,
    checkpointing: bool,
    tp: TensorSplit,
) -> u128 {
    let ranks = tp.ranks.max(1);
    let widths = Widths {
        c: cfg.n_embd,
        heads: cfg.n_head / ranks,
        attn: cfg.n_embd / ranks,
        mlp: 4 * cfg.n_embd / ranks,
        vocab: cfg.vocab_size.div_ceil(ranks),
        vocab_start: 0,
    };
    let tensors = crate::block::inside_elements(&widths, b * t, b * t / tp.rows() as usize);
    let (b, t) = (b as u128, t as u128);
    let (c, l) = (cfg.n_embd as u128, cfg.n_layer as u128);
    let (heads, vocab) = (widths.heads as u128, widths.vocab as u128);
    let n = b * t;
    let nl = n / tp.rows();
    // The block's tensors, the attention's probabilities and the two
    // norms' statistics (this rank's rows).
    let layer = tensors + b * heads * t * t + 4 * nl;
    let kept = if checkpointing { 1 } else { l };
    let residual = (l + 1) * nl * c;
    let final_norm = n * c + 2 * nl;
    let losses = n;
    // The block's tensors' gradients, then the residual stream's.
    let grads = tensors + nl * c;
    let scratch = match tp.rows() {
        1 => 0,
        _ => n * c + nl * c,
    };
    // The classifier's logits, one chunk of rows at a time.
    let logits = (crate::cpu::classifier::CHUNK_ROWS as u128).min(n.max(1)) * vocab;
    residual + kept * layer + final_norm + losses + grads + scratch + logits
}

/// What the CPU engine (f32) allocates to train `cfg` on batches of
/// `b × t`: parameters, gradients, `optimizer_states` buffers of the
/// parameters' size (AdamW 2, SGD with momentum 1) and activations.
pub fn cpu_training(
    cfg: &GptConfig,
    b: usize,
    t: usize,
    checkpointing: bool,
    optimizer_states: u32,
    sharding: Sharding,
) -> Footprint {
    cpu_training_split(
        cfg,
        b,
        t,
        checkpointing,
        optimizer_states,
        sharding,
        TensorSplit::NONE,
    )
}

/// [`cpu_training`] for a rank of tensor groups of `tp.ranks`: its share
/// of the parameters (the rank holding the most) and its activations.
pub fn cpu_training_split(
    cfg: &GptConfig,
    b: usize,
    t: usize,
    checkpointing: bool,
    optimizer_states: u32,
    sharding: Sharding,
    tp: TensorSplit,
) -> Footprint {
    let p = 4 * share_params(cfg, tp);
    // Stage 3 trains with the shard's master weights only (and no whole
    // gradient buffer; whole blocks exist while a unit runs), but a worker
    // builds the whole model before sharding it and gathers it back at the
    // end to save it: the whole parameters count once.
    let grads = match sharding.stage {
        3 => 0,
        2 => 4 * stage2_grad_elements(cfg),
        _ => p,
    };
    let mut f = Footprint {
        parts: vec![
            Part {
                name: "parameters",
                bytes: p,
            },
            Part {
                name: "gradients",
                bytes: grads,
            },
            Part {
                name: "optimizer state",
                bytes: sharding.shard(optimizer_states as u128 * p),
            },
            Part {
                name: "activations",
                bytes: 4 * cpu_activation_elements_split(cfg, b, t, checkpointing, tp),
            },
        ],
    };
    sharding.add_grad_shard(&mut f, p);
    if sharding.stage == 3 {
        f.parts.push(Part {
            name: "master weights shard",
            bytes: sharding.shard(p),
        });
        f.parts.push(Part {
            name: "gathered units",
            bytes: 4 * stage3_unit_elements(cfg),
        });
    }
    f
}

/// Elements of whole parameter blocks and block gradients a ZeRO-3 rank
/// holds at most at once, on the CPU and on a GPU: the embeddings'
/// parameters and gradients (the tied LM head keeps them from the head's
/// backward to the end), two layers' parameters (the one running and the
/// one prefetched) and two layers' gradients (one being written, one being
/// reduced), the final norm's. (The buffers freed and kept for reuse are
/// among these: a unit takes them back before anything new is allocated.)
pub fn stage3_unit_elements(cfg: &GptConfig) -> u128 {
    let (c, v, t) = (
        cfg.n_embd as u128,
        cfg.vocab_size as u128,
        cfg.context as u128,
    );
    let emb = (v + t) * c;
    let layer = 12 * c * c + 13 * c;
    2 * emb + 4 * layer + 4 * c
}

/// Elements of block gradients a ZeRO stage 2 rank holds at most at once
/// (it has no whole gradient buffer): the embeddings' (the tied LM head
/// writes them first, the embedding last), two layers' (one being
/// written, one being reduced) and the final norm's.
pub fn stage2_grad_elements(cfg: &GptConfig) -> u128 {
    let (c, v, t) = (
        cfg.n_embd as u128,
        cfg.vocab_size as u128,
        cfg.context as u128,
    );
    (v + t) * c + 2 * (12 * c * c + 13 * c) + 2 * c
}

/// Bytes of whole blocks a ZeRO-3 rank of a GPU engine holds at most at
/// once ([`stage3_unit_elements`] in f32). With `cast_head` (the bf16
/// engine streaming its weights: the head's backward pass reads the bf16
/// token embeddings its forward pass cast) the f32 embeddings are freed
/// after the forward pass and their memory takes their gradients: one
/// embeddings' block fewer. With `half_layers` (the layers gathered in
/// bf16): the two layers' parameters in half the bytes, plus the layers'
/// f32 tensors kept whole (the engine's packed copy and the exchange that
/// refreshes it). With `one_grad_block` (the bf16 engine under
/// checkpointing: a layer's gradients are reduce-scattered while the next
/// layer recomputes, before it writes its own) one layer's gradients
/// instead of two. With `split_embeddings` as well (the tied embeddings'
/// gradients reduce-scattered in two parts, [`splits_embedding_grads`])
/// no buffer holds the embeddings' gradients through the layers: the one
/// layer's gradient buffer holds them before and after.
pub fn stage3_unit_bytes(
    cfg: &GptConfig,
    cast_head: bool,
    half_layers: bool,
    one_grad_block: bool,
    split_embeddings: bool,
) -> u128 {
    let (c, v, t, l) = (
        cfg.n_embd as u128,
        cfg.vocab_size as u128,
        cfg.context as u128,
        cfg.n_layer as u128,
    );
    let mut bytes = 4 * stage3_unit_elements(cfg);
    if cast_head {
        bytes -= 4 * (v + t) * c;
    }
    let layer = 12 * c * c + 13 * c;
    if half_layers {
        bytes = bytes - 2 * 2 * layer + 2 * 4 * 13 * c * l;
    }
    if one_grad_block {
        bytes -= 4 * layer;
        if cast_head && split_embeddings && embeddings_fit_a_layer_buffer(cfg) {
            bytes -= 4 * (v + t) * c;
        }
    }
    bytes
}

/// Whether a ZeRO-3 rank's buffer for a layer's f32 block can hold the
/// embeddings' block in turn: no shorter, and at most 1.5 times as long
/// (the strategy's rule for sharing buffers).
pub fn embeddings_fit_a_layer_buffer(cfg: &GptConfig) -> bool {
    let (c, v, t) = (
        cfg.n_embd as u128,
        cfg.vocab_size as u128,
        cfg.context as u128,
    );
    let (emb, layer) = ((v + t) * c, 12 * c * c + 13 * c);
    emb <= layer && 2 * layer <= 3 * emb
}

/// Whether a ZeRO-3 run reduce-scatters the tied embeddings' gradients in
/// two parts by default (the head's, then the embedding unit's): under
/// activation checkpointing (a run short of memory), where one layer's
/// gradient buffer can hold them, so that none holds them through the
/// layers' backward units.
pub fn splits_embedding_grads(cfg: &GptConfig, checkpointing: bool) -> bool {
    checkpointing && embeddings_fit_a_layer_buffer(cfg)
}

/// How a run shards its model states over ranks (ZeRO), as the footprint
/// counts them: stage 1 and up keep `1/ranks` of the optimizer state;
/// stage 2 also keeps the shard's reduced gradients in a buffer of their
/// own and no whole gradient buffer (block gradients while a unit runs,
/// [`stage2_grad_elements`]); stage 3 keeps only its shard of the
/// parameters too.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sharding {
    /// 0: not sharded (one process, or data parallelism).
    pub stage: u8,
    /// The ranks the state is sharded over (the shard group).
    pub ranks: usize,
}

impl Sharding {
    /// Nothing sharded.
    pub const NONE: Sharding = Sharding { stage: 0, ranks: 1 };

    /// This rank's bytes of optimizer state of `bytes` in all.
    pub fn shard(&self, bytes: u128) -> u128 {
        match self.stage {
            0 => bytes,
            _ => bytes.div_ceil(self.ranks.max(1) as u128),
        }
    }

    /// Adds stage 2's (and 3's) reduced-gradient shard of `grad_bytes` to
    /// `f`.
    fn add_grad_shard(&self, f: &mut Footprint, grad_bytes: u128) {
        if self.stage >= 2 {
            f.parts.push(Part {
                name: "reduced gradient shard",
                bytes: grad_bytes.div_ceil(self.ranks.max(1) as u128),
            });
        }
    }
}

/// Bytes of the mixed-precision GPU engine's activations and scratch
/// (`cuda::model_mixed::GpuGptMixed` at batch `b × t`, with
/// `deferred` layers deferring their weight gradients), as it allocates
/// them: per layer the LayerNorm statistics, the attention's output and
/// the block's other activations — the attention's saved tensors (`qkv`
/// and the log-sum-exp when `fused`, else per-head q, k, v and the T×T
/// probabilities), the f32 residual after attention and the MLP's
/// pre-activation (its GELU and the LayerNorm outputs are recomputed) —
/// which `checkpointing` keeps for one block only (plus each fused
/// layer's log-sum-exp, or in the last `kept_attention` layers the whole
/// attention state); the f32 residual stream; the logits; and the
/// scratch the layers share (with the fused attention's score gradients
/// when `stored_score_grads`).
pub fn gpu_mixed_activation_bytes(cfg: &GptConfig, run: &GpuRun) -> u128 {
    let p = mixed_parts(cfg, run);
    let l = cfg.n_layer as u128;
    // Layers that leave their attention output to the recomputation keep
    // their statistics alone; the recomputation's one output is shared.
    let (layer, shared_atty) = match run.shares_atty() {
        true => (p.layer_stats, p.atty),
        false => (p.layer, 0),
    };
    l * layer
        + shared_atty
        + run.kept_attention.min(cfg.n_layer) as u128 * p.kept_extra
        + (l + 1) * p.stream
        + p.head
        + p.pad
        + p.shared
        + p.batch
        + p.deferred * run.deferred as u128
}

/// The mixed engine's activation memory in parts (bytes), which
/// [`gpu_mixed_activation_bytes`] (the whole model) and
/// [`gpu_mixed_stage_bytes`] (a pipeline stage's micro-batches) add up
/// differently.
struct MixedParts {
    /// What each layer keeps for its backward pass (a layer that keeps
    /// its attention's state under checkpointing: `kept_extra` more).
    layer: u128,
    /// What a layer keeping its attention's state keeps beyond `layer`.
    kept_extra: u128,
    /// Each layer's LayerNorm statistics alone (f32).
    layer_stats: u128,
    /// One attention output (bf16).
    atty: u128,
    /// One f32 residual stream (a layer's input or output).
    stream: u128,
    /// The head's: the final norm's output and statistics, the logits,
    /// the losses.
    head: u128,
    /// The padded classifier's copies, where the vocabulary is padded.
    pad: u128,
    /// Shared by the layers: checkpointing's one block, the attention's
    /// shared buffers, the scratch, the partial sums, a tensor group's.
    shared: u128,
    /// Tokens, targets and the embedding backward's bucket order.
    batch: u128,
    /// Per layer whose weight gradients wait.
    deferred: u128,
}

fn mixed_parts(cfg: &GptConfig, run: &GpuRun) -> MixedParts {
    use crate::cuda::flash::FlashKernels;
    use crate::cuda::mixed::MixedKernels;
    let GpuRun {
        b,
        t,
        fused_attention: fused,
        checkpointing,
        stored_score_grads,
        kept_attention,
        ..
    } = *run;
    // Every layer keeps the attention's state: no recomputation needs
    // the shared block's.
    let keep_all = checkpointing && fused && kept_attention >= cfg.n_layer;
    let (bu, tu) = (b as u128, t as u128);
    // A tensor-parallel rank's widths: its heads (attention width `a`),
    // MLP columns `f` and vocabulary rows; the residual stream and the
    // LayerNorms' statistics over its rows `nl` under sequence
    // parallelism, else every row.
    let ranks = run.tensor.ranks.max(1);
    let (c, nh, v) = (
        cfg.n_embd as u128,
        (cfg.n_head / ranks) as u128,
        (cfg.vocab_size as u128).div_ceil(ranks as u128),
    );
    let (a, f) = (c / ranks as u128, 4 * c / ranks as u128);
    let n = bu * tu;
    let nc = n * c;
    let sequence = run.tensor.sequence && ranks > 1;
    let nl = match sequence {
        true => n.div_ceil(ranks as u128),
        false => n,
    };
    let vp = v.div_ceil(64) * 64;
    let rows = bu * nh * tu;
    let (attn_saved, attn_shared) = if fused {
        let shape = crate::cpu::attention::AttnShape {
            b,
            t,
            c: cfg.n_embd / ranks,
            nh: cfg.n_head / ranks,
        };
        // Stored in each block's idle resid2 and fch where they fit (one
        // process's blocks only: a tensor-parallel rank keeps them apart).
        let own = stored_score_grads
            && (ranks > 1 || !crate::cuda::model_mixed::score_grads_fit_in_block(shape));
        let score_grads = match own {
            true => 2 * FlashKernels::score_grads_len(shape),
            false => 0,
        };
        (6 * n * a + 4 * rows, 4 * rows + score_grads)
    } else {
        (6 * n * a + 2 * rows * tu, 4 * rows * tu + 8 * n * a)
    };
    // The block's recomputable activations: the attention's, resid2
    // (f32, the rank's rows), fch (bf16, the MLP's width).
    let block = attn_saved + 4 * nl * c + 2 * n * f;
    // Every layer: atty (bf16), two pairs of f32 LayerNorm statistics.
    let layer = 2 * n * a
        + 16 * nl
        + match (checkpointing, fused) {
            (false, _) => block,
            (true, true) => 4 * rows,
            (true, false) => 0,
        };
    let kept_extra = match checkpointing && fused {
        true => attn_saved - 4 * rows,
        false => 0,
    };
    let work = match (checkpointing, keep_all) {
        (false, _) => 0,
        (true, false) => block,
        (true, true) => block - attn_saved,
    };
    // The final norm's output over every row (gathered), its statistics
    // over the rank's, the logits, the losses.
    let head = 2 * nc + 8 * nl + 2 * n * vp + 4 * n;
    let pad = if vp == v { 0 } else { 6 * vp * c };
    // ln, the wide scratch (qkv or GELU or their gradients, with datty),
    // dresid (f32), dresid_bf, dln.
    let scratch = 2 * nc + 2 * n * (4 * a).max(f) + 4 * nc + 2 * nc + 2 * nc;
    let (nn, cc, aa, ff) = (n as usize, c as usize, a as usize, f as usize);
    let partial = MixedKernels::partial_len(nn, ff.max(3 * aa), 1)
        .max(MixedKernels::partial_len(nn, cc, 3))
        .max(MixedKernels::gelu_partial_len(nn, ff)) as u128
        * 4;
    // A rank's group: the cross-entropy's row maxima and sums (and under
    // sequence parallelism the LayerNorms' gradients, 6c).
    let group = match (ranks > 1, sequence) {
        (false, _) => 0,
        (true, false) => 12 * n,
        (true, true) => 12 * n + 24 * c,
    };
    // Tokens, targets and the embedding backward's bucket order (i32).
    let batch = 4 * (3 * n + v + 1);
    MixedParts {
        layer,
        kept_extra,
        layer_stats: 16 * nl,
        atty: 2 * n * a,
        stream: 4 * nl * c,
        head,
        pad,
        shared: work + attn_shared + scratch + partial + group,
        batch,
        // Each deferred layer's output gradients and recomputed inputs,
        // bf16: the GELU, ln2, ln1, the two projections' gradients, the
        // wide scratch's and qkv's (15 · n · c in one process).
        deferred: 2 * n * (f + 4 * c + (4 * a).max(f) + 3 * a),
    }
}

/// A pipeline stage of the mixed engine, as [`gpu_mixed_stage_bytes`]
/// needs it: the run's shape and choices (`b`: a micro-batch's rows), the
/// stage's layers, whether it is the last (the head, no output gradient
/// received), and whether its backward passes are split (its layers keep
/// their output gradients for the weight half); whether under
/// checkpointing its layers leave their attention output to the
/// recomputation is the run's (`GpuRun::recompute_attention_output`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StageRun {
    pub run: GpuRun,
    pub layers: usize,
    pub last: bool,
    pub split: bool,
}

/// A pipeline stage's activation memory in the mixed engine (bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StageBytes {
    /// One micro-batch in flight: its layers' saved tensors, their input
    /// and output streams, the output's gradient (a stage other than the
    /// last) or the head's (the last), its tokens.
    pub per_micro_batch: u128,
    /// Once per model, whatever is in flight: the scratch the layers
    /// share (and the padded classifier's copies on the last stage).
    pub shared: u128,
}

/// [`StageBytes`] of stage `s` (`MicroPlan::make` in
/// `cuda::model_mixed::stage` allocates these). A pipeline's layers keep
/// the attention's state all (`kept_attention` of the model's layers or
/// more) or none.
pub fn gpu_mixed_stage_bytes(cfg: &GptConfig, s: &StageRun) -> StageBytes {
    let p = mixed_parts(cfg, &s.run);
    let l = s.layers as u128;
    let keeps_all = s.run.kept_attention >= cfg.n_layer && s.run.fused_attention;
    // (A pipeline keeps all layers' state or none: the engine's rule.)
    let keeps_output = !s.run.shares_atty() || s.split;
    let layer = match keeps_output {
        true if keeps_all && s.run.checkpointing => p.layer + p.kept_extra,
        true => p.layer,
        false => p.layer_stats,
    };
    let (head, pad) = match s.last {
        true => (p.head, p.pad),
        // The gradient of the stage's output, received (f32).
        false => (p.stream, 0),
    };
    let deferred = if s.split { p.deferred * l } else { 0 };
    // Where the layers keep none, the recomputation's one attention output.
    let atty = if keeps_output { 0 } else { p.atty };
    StageBytes {
        per_micro_batch: l * layer + (l + 1) * p.stream + head + p.batch + deferred,
        shared: p.shared + pad + atty,
    }
}

/// Whether layer `layer` of `layers` keeps the attention's state under
/// checkpointing when `kept` layers do: the last `kept`.
pub fn keeps_attention(layer: usize, layers: usize, kept: usize) -> bool {
    layer + kept.min(layers) >= layers
}

/// Device memory a GPU run's estimate leaves aside for what it does not
/// count: cuBLAS and cuBLASLt workspaces, the kernel modules, the pool's
/// rounding of each buffer up to its size class. `braid train`'s
/// pre-flight fits the estimate in the free memory less this.
pub const DEVICE_MARGIN: u128 = 768 << 20;

/// Layers of `layers` whose weight gradients the bf16 engine defers by
/// default over `ranks` data-parallel ranks without ZeRO (`braid train`
/// without `--defer-layers`): two, so that the embeddings' reduction
/// overlaps them; none in one process.
pub fn deferred_by_default(ranks: usize, layers: usize) -> usize {
    match ranks {
        0 | 1 => 0,
        _ => 2.min(layers),
    }
}

/// A GPU training run's shape and choices, as the footprint needs them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuRun {
    /// Sequences per step (on this GPU).
    pub b: usize,
    /// Tokens per sequence.
    pub t: usize,
    /// bf16 (the mixed-precision engine) rather than f32.
    pub mixed: bool,
    /// The fused attention rather than the batched products.
    pub fused_attention: bool,
    /// Layers deferring their weight gradients.
    pub deferred: usize,
    /// Activation checkpointing.
    pub checkpointing: bool,
    /// No full bf16 copy of the parameters: one layer's, cast as needed,
    /// and the token embeddings'.
    pub streamed_weights: bool,
    /// The fused attention's score gradients kept for its dQ kernel.
    pub stored_score_grads: bool,
    /// Under checkpointing, how many layers (the last ones: their state is
    /// read first, and lent gradient memory can hold it longest) keep the
    /// fused attention's state; 0 none, the model's layers or more all
    /// ([`keeps_attention`]).
    pub kept_attention: usize,
    /// Under checkpointing where no layer keeps the attention's state:
    /// the layers save their input and LayerNorm statistics alone, and the
    /// recomputation runs the attention again into one shared output
    /// (`MixedOptions::recompute_attention_output`; [`GpuRun::shares_atty`]).
    pub recompute_attention_output: bool,
    /// How the model states are sharded over ranks.
    pub sharding: Sharding,
    /// The optimizer offloaded to host memory: no f32 master weights or
    /// moments on the GPU (bf16: only the f32 tensors the passes read,
    /// [`side_params`]).
    pub offload: bool,
    /// One micro-batch per step, under stage 3 or in one process: the
    /// activations saved for the backward pass live in gradient memory
    /// where it is idle ([`gpu_saved_in_grads`]).
    pub saved_in_grads: bool,
    /// Stage 3 in bf16: the layers are gathered in bf16 and read as such
    /// (no layer cast, [`stage3_unit_bytes`]).
    pub half_gathers: bool,
    /// Stage 3: the tied embeddings' gradients reduce-scattered in two
    /// parts ([`splits_embedding_grads`]).
    pub split_embeddings: bool,
    /// A tensor-parallel rank's share of each layer (its heads, MLP
    /// columns and vocabulary rows; under sequence parallelism its rows of
    /// the residual stream).
    pub tensor: TensorSplit,
}

impl GpuRun {
    /// Whether the layers leave their attention output (and log-sum-exp)
    /// to the recomputation, which writes one output all layers share:
    /// the engine's rule (`model_mixed`'s `MicroPlan::shared_atty`), where
    /// a run without the fused attention keeps no layer's state.
    pub fn shares_atty(&self) -> bool {
        let kept = match self.fused_attention {
            true => self.kept_attention,
            false => 0,
        };
        self.checkpointing && kept == 0 && self.recompute_attention_output
    }

    /// The bf16 engine's run of a layout as a planner sees it — `b × t`
    /// per GPU, `micro_batches` per step, its ZeRO `sharding`, the
    /// optimizer offloaded or not, `checkpointing`, a `tensor` share, over
    /// `ranks` data-parallel ranks — in the form `braid train`'s pre-flight
    /// tries first, where memory allows (no environment override): the
    /// fused attention, the weights' bf16 copy kept whole (under ZeRO-3
    /// each gathered layer cast as it runs, gathered in bf16, the tied
    /// embeddings' gradients reduce-scattered in two parts where
    /// [`splits_embedding_grads`] says), the fused attention's score
    /// gradients stored, under checkpointing every layer keeping the
    /// attention's state, and with one micro-batch the saved activations
    /// in gradient memory where the engine lends it (ZeRO-3's shard, or
    /// one process's whole buffer without the offload). A tensor-parallel
    /// rank keeps its form as the pre-flight's tensor-parallel branch
    /// counts it (nothing lent, gathers and embeddings whole).
    #[allow(clippy::too_many_arguments)]
    pub fn fastest(
        cfg: &GptConfig,
        b: usize,
        t: usize,
        micro_batches: usize,
        sharding: Sharding,
        offload: bool,
        checkpointing: bool,
        tensor: TensorSplit,
        ranks: usize,
    ) -> GpuRun {
        let stage3 = sharding.stage == 3;
        let whole = tensor.ranks <= 1;
        let lends = stage3 || (sharding.stage == 0 && ranks == 1 && !offload);
        GpuRun {
            b,
            t,
            mixed: true,
            fused_attention: true,
            deferred: match sharding.stage {
                0 => deferred_by_default(ranks, cfg.n_layer),
                _ => 0,
            },
            checkpointing,
            streamed_weights: stage3,
            stored_score_grads: true,
            kept_attention: match checkpointing {
                true => cfg.n_layer,
                false => 0,
            },
            recompute_attention_output: false,
            sharding,
            offload,
            saved_in_grads: whole && micro_batches == 1 && lends,
            half_gathers: whole && stage3,
            split_embeddings: whole && stage3 && splits_embedding_grads(cfg, checkpointing),
            tensor,
        }
    }

    /// The same run in the pre-flight's leanest form, what it tries last:
    /// the weights cast layer by layer (kept whole when the optimizer is
    /// offloaded), no score gradients stored, and under checkpointing no
    /// layer keeping the attention's state, each saving its input alone.
    /// (A tensor-parallel rank's leanest form only casts its weights layer
    /// by layer, as the pre-flight's tensor-parallel branch tries.)
    pub fn leanest(self) -> GpuRun {
        let streamed_weights = self.streamed_weights || !self.offload;
        if self.tensor.ranks > 1 {
            return GpuRun {
                streamed_weights,
                ..self
            };
        }
        GpuRun {
            streamed_weights,
            stored_score_grads: false,
            kept_attention: 0,
            recompute_attention_output: self.checkpointing,
            ..self
        }
    }
}

/// Bytes of the bf16 engine's saved activations that live in gradient
/// memory (`run.saved_in_grads`), by [`crate::placement::place`] over the
/// buffers the engine saves (`saved_wants`) and the memory idle while
/// they live: under ZeRO-3 the slices of the gradient shard's blocks (the
/// embeddings' idle through the whole backward pass, layer `l`'s through
/// its own backward unit, the final norm's through the head's); in one
/// process the whole gradient buffer written unit by unit (each run idle
/// until the unit that writes it first,
/// [`crate::cuda::model_mixed::first_writes`]). 0 when the run does not
/// lend.
pub fn gpu_saved_in_grads(cfg: &GptConfig, run: &GpuRun) -> u128 {
    use crate::placement::{placed_bytes, regions_before_first_writes, Region};
    if !(run.saved_in_grads && run.mixed) {
        return 0;
    }
    let l = cfg.n_layer;
    let regions: Vec<Region> = match run.sharding.stage {
        3 => {
            let ranks = run.sharding.ranks.max(1);
            let layout = crate::Layout::padded(cfg, 64 * ranks);
            let mut at = 0u64;
            layout
                .blocks
                .iter()
                .map(|(block, r)| {
                    let len = 4 * (r.len() / ranks) as u64;
                    let region = Region {
                        start: at,
                        end: at + len,
                        free_through: match block {
                            // Split: the head's part arrives after unit 0.
                            crate::Block::Embedding if run.split_embeddings => 0,
                            crate::Block::Embedding => l + 1,
                            crate::Block::Layer(i) => l - i,
                            crate::Block::FinalNorm => 0,
                        },
                    };
                    at += len;
                    region
                })
                .collect()
        }
        0 => regions_before_first_writes(&crate::cuda::model_mixed::first_writes(
            &crate::Layout::new(cfg),
        )),
        _ => return 0,
    };
    placed_bytes(&saved_wants(cfg, run), &regions) as u128
}

/// Elements of the token embeddings the bf16 engine streaming its weights
/// casts for the classifier each step (in bf16).
fn cast_embeddings(cfg: &GptConfig) -> u64 {
    cfg.vocab_size as u64 * cfg.n_embd as u64
}

/// The buffers the bf16 engine saves for the backward pass, each with the
/// backward unit that reads it last (unit 0 the head, `l - i` layer `i`,
/// `l + 1` the embeddings): each layer's input, LayerNorm statistics,
/// attention output and what checkpointing keeps; the head's input, final
/// LayerNorm and logits (and with streamed weights the token embeddings
/// it cast); the layers' shared scratch, checkpointing's one
/// block and the fused attention's scratch, which hold nothing between
/// steps either (`cuda::model_mixed`'s `saved.rs` lists the same).
fn saved_wants(cfg: &GptConfig, run: &GpuRun) -> Vec<crate::placement::Want> {
    use crate::placement::Want;
    let (n, c, l) = ((run.b * run.t) as u64, cfg.n_embd as u64, cfg.n_layer);
    let (nc, rows) = (n * c, (run.b * cfg.n_head * run.t) as u64);
    let fused = run.fused_attention;
    let attn = |w: &mut Vec<u64>| match fused {
        true => w.extend([6 * nc, 4 * rows]),
        false => w.extend([2 * nc, 2 * nc, 2 * nc, 2 * rows * run.t as u64]),
    };
    let keep_all = run.checkpointing && fused && run.kept_attention >= l;
    let shared_atty = run.shares_atty();
    let mut wants = Vec::new();
    for layer in 0..l {
        let mut w = vec![4 * nc, 4 * n, 4 * n, 4 * n, 4 * n];
        if !shared_atty {
            w.push(2 * nc);
        }
        let keep = run.checkpointing && fused && keeps_attention(layer, l, run.kept_attention);
        match (run.checkpointing, keep) {
            (true, true) => attn(&mut w),
            (true, false) if fused && !shared_atty => w.push(4 * rows),
            (true, false) => {}
            (false, _) => {
                attn(&mut w);
                w.extend([4 * nc, 8 * nc]);
            }
        }
        wants.extend(w.into_iter().map(|bytes| Want {
            bytes,
            last_read: l - layer,
        }));
    }
    // The head's input, the final LayerNorm's output and statistics, the
    // logits (over the vocabulary padded to 64).
    let vp = (cfg.vocab_size as u64).div_ceil(64) * 64;
    wants.extend(
        [4 * nc, 2 * nc, 4 * n, 4 * n, 2 * n * vp].map(|bytes| Want {
            bytes,
            last_read: 0,
        }),
    );
    // With streamed weights, the token embeddings the head casts to bf16.
    if run.streamed_weights {
        wants.push(Want {
            bytes: 2 * cast_embeddings(cfg),
            last_read: 0,
        });
    }
    // The layers' shared scratch (the embeddings' backward pass reads
    // dresid): the wide scratch, dresid, ln, dresid_bf, dln.
    let scratch = [8 * nc, 4 * nc, 2 * nc, 2 * nc, 2 * nc];
    wants.extend(scratch.map(|bytes| Want {
        bytes,
        last_read: l + 1,
    }));
    // Checkpointing's one block (its attention state where the layers do
    // not keep theirs, resid2, fch) and the fused attention's scratch (the
    // row sums, the score gradients where stored): read last by layer 0.
    let mut w = Vec::new();
    if run.checkpointing {
        if !keep_all {
            attn(&mut w);
        }
        w.extend([4 * nc, 8 * nc]);
        if shared_atty {
            w.push(2 * nc);
        }
    }
    if fused {
        w.push(4 * rows);
        let shape = crate::cpu::attention::AttnShape {
            b: run.b,
            t: run.t,
            c: cfg.n_embd,
            nh: cfg.n_head,
        };
        if run.stored_score_grads && !crate::cuda::model_mixed::score_grads_fit_in_block(shape) {
            w.push(2 * crate::cuda::flash::FlashKernels::score_grads_len(shape) as u64);
        }
    }
    wants.extend(w.into_iter().map(|bytes| Want {
        bytes,
        last_read: l,
    }));
    wants
}

/// Parameters the bf16 engine reads in f32 (all but the layers' four
/// weight matrices: embeddings, LayerNorms, biases).
pub fn side_params(cfg: &GptConfig) -> u128 {
    let c = cfg.n_embd as u128;
    cfg.num_params() as u128 - cfg.n_layer as u128 * 12 * c * c
}

/// Host memory of an optimizer offloaded from a GPU, by part: f32 master
/// weights, AdamW's two moments, and the pinned transfer buffers (two
/// chunks of `chunk` elements each way, the packed f32 tensors in bf16).
pub fn offloaded_optimizer(cfg: &GptConfig, mixed: bool, chunk: usize) -> Footprint {
    let params = cfg.num_params() as u128;
    let chunk = (chunk as u128).min(params);
    let staging =
        2 * chunk * (4 + if mixed { 2 } else { 4 }) + if mixed { 4 * side_params(cfg) } else { 0 };
    Footprint {
        parts: vec![
            Part {
                name: "f32 master weights",
                bytes: 4 * params,
            },
            Part {
                name: "AdamW moments",
                bytes: 8 * params,
            },
            Part {
                name: "pinned transfer buffers",
                bytes: staging,
            },
        ],
    }
}

/// The GPU engine's memory by part: model states (f32 parameters,
/// gradients and AdamW's two moments, plus the bf16 weights when `mixed`:
/// a full copy, or one layer's and the token embeddings' when streamed)
/// and activations. f32 runs (`mixed` false) take the CPU engine's
/// activation count in f32 as their estimate.
pub fn gpu_training(cfg: &GptConfig, run: &GpuRun) -> Footprint {
    let GpuRun {
        b,
        t,
        mixed,
        streamed_weights,
        sharding,
        offload,
        ..
    } = *run;
    // A tensor-parallel rank holds its share (the first rank's: the most
    // vocabulary rows).
    let ranks = run.tensor.ranks.max(1) as u128;
    let params = share_params(cfg, run.tensor);
    let stage3 = sharding.stage == 3;
    let half_layers = stage3 && mixed && run.half_gathers;
    let units = stage3_unit_bytes(
        cfg,
        mixed && streamed_weights,
        half_layers,
        mixed && run.checkpointing,
        stage3 && run.split_embeddings,
    ) / ranks;
    let lent = gpu_saved_in_grads(cfg, run);
    // With streamed weights the token embeddings cast for the classifier
    // are saved for its backward pass like an activation (and may be lent
    // memory like one): they count here.
    let cast = match mixed && streamed_weights {
        true => 2 * cast_embeddings(cfg) as u128 / ranks,
        false => 0,
    };
    let acts = match mixed {
        true => gpu_mixed_activation_bytes(cfg, run) + cast,
        false => 4 * cpu_activation_elements_split(cfg, b, t, false, run.tensor),
    };
    let mut parts = vec![
        Part {
            name: "parameters",
            bytes: match (offload, mixed) {
                (true, true) => 4 * side_params(cfg),
                // The shard's master weights: a rank uploads only its
                // shard at the start, and gathers the model back at the
                // end block by block into host memory (to save it).
                _ if stage3 => sharding.shard(4 * params),
                _ => 4 * params,
            },
        },
        Part {
            name: "gradients",
            bytes: match sharding.stage {
                3 => 0,
                2 => 4 * stage2_grad_elements(cfg),
                _ => 4 * params,
            },
        },
        Part {
            name: "optimizer state",
            bytes: match offload {
                true => 0,
                false => sharding.shard(8 * params),
            },
        },
    ];
    let mut grads = Footprint { parts: Vec::new() };
    sharding.add_grad_shard(&mut grads, 4 * params);
    parts.extend(grads.parts);
    if mixed {
        parts.push(Part {
            name: "bf16 weights",
            bytes: match (streamed_weights, half_layers) {
                (false, _) => 2 * params,
                // Layers arrive in bf16: none is cast (the token
                // embeddings' cast counts with the activations).
                (true, true) => 0,
                (true, false) => 2 * cfg.block_params_u128() / ranks,
            },
        });
    }
    if stage3 {
        parts.push(Part {
            name: "gathered units",
            bytes: units,
        });
    }
    parts.push(Part {
        name: "activations",
        bytes: acts - lent,
    });
    Footprint { parts }
}

/// The parameters a tensor-parallel rank holds: the first rank's share
/// (the most vocabulary rows), or the whole model's.
pub fn share_params(cfg: &GptConfig, tp: TensorSplit) -> u128 {
    match tp.ranks {
        0 | 1 => cfg.num_params() as u128,
        n => crate::layout::Layout::tensor_parallel(
            cfg,
            crate::layout::TensorShard { rank: 0, size: n },
            1,
        )
        .map_or(cfg.num_params(), |l| l.len) as u128,
    }
}

/// Bytes of host memory available to a new allocation (Linux's
/// `MemAvailable`), or `None` where that is unknown.
pub fn host_available() -> Option<u128> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u128 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The largest batch (sequences per rank) whose `footprint(batch)` fits in
/// `capacity` bytes, if any does (searched from 1 up to `max`).
pub fn largest_batch(
    capacity: u128,
    max: usize,
    footprint: impl Fn(usize) -> Footprint,
) -> Option<usize> {
    if footprint(1).total() > capacity {
        return None;
    }
    // The footprint grows with the batch: bisect.
    let (mut lo, mut hi) = (1usize, max.max(1));
    if footprint(hi).total() <= capacity {
        return Some(hi);
    }
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if footprint(mid).total() <= capacity {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Some(lo)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Activations, Layout};

    #[test]
    fn cpu_activation_estimate_is_what_the_model_allocates() {
        for name in ["L2-H2-C8-V32-T16", "L3-H4-C16-V300-T32"] {
            let cfg = GptConfig::parse(name).unwrap();
            let layout = Layout::new(&cfg);
            for (b, t, ckpt) in [(2, 16, false), (3, 8, true), (1, 1, false)] {
                let acts = Activations::<f32>::new(&layout, b, t, ckpt);
                // The classifier sizes its chunk of logits at the first
                // forward pass; count it as the estimate does.
                let allocated = acts.elements() as u128
                    + (crate::cpu::classifier::CHUNK_ROWS.min(b * t) * cfg.vocab_size) as u128;
                assert_eq!(
                    cpu_activation_elements(&cfg, b, t, ckpt),
                    allocated,
                    "{name} b {b} t {t} checkpointing {ckpt}"
                );
                // A tensor-parallel rank 0 (the most vocabulary rows), with
                // and without sequence parallelism.
                for (ranks, sequence) in [(2, false), (2, true), (4, true)] {
                    if cfg.n_head % ranks != 0 || (b * t) % ranks != 0 {
                        continue;
                    }
                    let shard = crate::layout::TensorShard {
                        rank: 0,
                        size: ranks,
                    };
                    let l = std::sync::Arc::new(Layout::tensor_parallel(&cfg, shard, 1).unwrap());
                    let g = crate::tensor_comm::LocalGroup::new(ranks).swap_remove(0);
                    let m =
                        crate::Gpt::tensor_parallel(l, std::sync::Arc::new(g), sequence).unwrap();
                    let acts = m.activations::<f32>(b, t, ckpt).unwrap();
                    let vocab = cfg.vocab_size.div_ceil(ranks);
                    let allocated = acts.elements() as u128
                        + (crate::cpu::classifier::CHUNK_ROWS.min(b * t) * vocab) as u128;
                    let tp = TensorSplit { ranks, sequence };
                    assert_eq!(
                        cpu_activation_elements_split(&cfg, b, t, ckpt, tp),
                        allocated,
                        "{name} b {b} t {t} checkpointing {ckpt}, {ranks} ranks, sequence {sequence}"
                    );
                }
            }
        }
    }

    /// A bf16 ZeRO-3 run over `ranks` at B 8 × 1024 with checkpointing
    /// and streamed weights, nothing lent, stored or kept.
    fn stage3_run(ranks: usize) -> GpuRun {
        GpuRun {
            b: 8,
            t: 1024,
            mixed: true,
            fused_attention: true,
            deferred: 0,
            checkpointing: true,
            streamed_weights: true,
            stored_score_grads: false,
            kept_attention: 0,
            recompute_attention_output: false,
            sharding: Sharding { stage: 3, ranks },
            offload: false,
            saved_in_grads: false,
            half_gathers: false,
            split_embeddings: false,
            tensor: TensorSplit::NONE,
        }
    }

    /// A tensor-parallel rank's estimate: its share of the model states
    /// (the vocabulary and every layer's products split, the norms and
    /// biases whole), activations between one GPU's / N and one GPU's
    /// (the residual stream whole without sequence parallelism), and with
    /// sequence parallelism less than without, in f32 and bf16.
    #[test]
    fn gpu_tensor_parallel_rank_holds_its_share() {
        let cfg = GptConfig::parse("L32-H32-C2560-V50304-T1024").unwrap();
        let run = |ranks, sequence, mixed| GpuRun {
            b: 16,
            mixed,
            checkpointing: false,
            streamed_weights: false,
            kept_attention: 0,
            sharding: Sharding::NONE,
            tensor: TensorSplit { ranks, sequence },
            ..stage3_run(1)
        };
        let part = |f: &Footprint, name: &str| {
            f.parts
                .iter()
                .filter(|p| p.name == name)
                .map(|p| p.bytes)
                .sum::<u128>()
        };
        let one = gpu_training(&cfg, &run(1, false, true));
        for n in [2u128, 4] {
            let tp = gpu_training(&cfg, &run(n as usize, false, true));
            let (p1, pn) = (part(&one, "parameters"), part(&tp, "parameters"));
            assert!(
                pn > p1 / n && pn < p1 / n + p1 / 100,
                "parameters {pn} of {p1} over {n}"
            );
            let (a1, an) = (part(&one, "activations"), part(&tp, "activations"));
            assert!(an > a1 / n && an < a1, "activations {an} of {a1} over {n}");
            for mixed in [false, true] {
                let whole = gpu_training(&cfg, &run(n as usize, false, mixed)).total();
                let sp = gpu_training(&cfg, &run(n as usize, true, mixed)).total();
                assert!(
                    sp < whole,
                    "sequence parallelism saved nothing at {n}, bf16 {mixed}"
                );
            }
        }
    }

    #[test]
    fn gpu_stage_3_counts_the_shard_never_the_whole_model() {
        let cfg = GptConfig::parse("1558M").unwrap();
        let p = cfg.num_params() as u128;
        let run = stage3_run;
        let plain = GpuRun {
            sharding: Sharding::NONE,
            ..run(1)
        };
        let others = gpu_training(&cfg, &plain).total() - 16 * p;
        // The bf16 engine streaming its weights frees the f32 embeddings
        // after the forward pass, and under checkpointing holds one
        // layer's gradients at a time.
        let (c, v, t) = (
            cfg.n_embd as u128,
            cfg.vocab_size as u128,
            cfg.context as u128,
        );
        let emb = 4 * (v + t) * c;
        let layer = 4 * (12 * c * c + 13 * c);
        let units = 4 * stage3_unit_elements(&cfg) - emb - layer;
        // Training holds 16Ψ/N and the units (within the rounding of the
        // shards); the start uploads only the shard and the end gathers
        // block by block into host memory, so nothing more counts, at any
        // number of ranks.
        for n in [1u128, 2, 8] {
            let f = gpu_training(&cfg, &run(n as usize));
            let training = 2 * (4 * p).div_ceil(n) + (8 * p).div_ceil(n) + units;
            let got = f.total() - others;
            assert!(
                got.abs_diff(training) <= 1,
                "N = {n}: {got} against {training}"
            );
        }
        // The saved activations lent to the gradient shard hold no memory
        // of their own.
        let lending = GpuRun {
            saved_in_grads: true,
            ..run(8)
        };
        let lent = gpu_saved_in_grads(&cfg, &lending);
        assert!(lent > 0);
        assert_eq!(
            gpu_training(&cfg, &lending).total() + lent,
            gpu_training(&cfg, &run(8)).total()
        );
    }

    #[test]
    fn embeddings_reduced_in_two_parts_hold_no_buffer_where_a_layer_buffer_takes_them() {
        let run = |split, lend| GpuRun {
            split_embeddings: split,
            saved_in_grads: lend,
            half_gathers: true,
            ..stage3_run(2)
        };
        for (name, fits) in [
            ("L40-H40-C5120-V50304-T1024", true),
            ("1558M", false),
            ("124M", false),
        ] {
            let cfg = GptConfig::parse(name).unwrap();
            assert_eq!(embeddings_fit_a_layer_buffer(&cfg), fits, "{name}");
            assert_eq!(splits_embedding_grads(&cfg, true), fits, "{name}");
            assert!(!splits_embedding_grads(&cfg, false), "{name}");
            let (c, v, t) = (
                cfg.n_embd as u128,
                cfg.vocab_size as u128,
                cfg.context as u128,
            );
            // Through the layers' backward units: one embeddings' f32
            // block less, where a layer's buffer holds them.
            let units = |split| stage3_unit_bytes(&cfg, true, true, true, split);
            let saved = if fits { 4 * (v + t) * c } else { 0 };
            assert_eq!(units(false) - units(true), saved, "{name}");
            // The embeddings' slice of the gradient shard takes the head's
            // part after unit 0: it lends no more than before.
            let lent = |split| gpu_saved_in_grads(&cfg, &run(split, true));
            assert!(lent(true) <= lent(false), "{name}");
            let total = |split| gpu_training(&cfg, &run(split, true)).total();
            if fits {
                assert!(total(true) < total(false), "{name}");
            }
        }
    }

    /// Some layers keeping the attention's state: the activations grow by
    /// the state (the biased qkv, 6 bytes per token and width) per layer
    /// kept, all of them keeping is the old all-or-none `kept`, and with
    /// the saved activations lent gradient memory (ZeRO-3 over 4, the
    /// 12.85B model) the peak never falls as layers are added.
    #[test]
    fn kept_attention_by_the_last_layers_lies_between_none_and_all() {
        let cfg = GptConfig::parse("L40-H40-C5120-V50304-T1024").unwrap();
        let l = cfg.n_layer;
        assert!(!keeps_attention(0, l, l - 1) && keeps_attention(1, l, l - 1));
        assert!(keeps_attention(l - 1, l, 1) && !keeps_attention(l - 2, l, 1));
        assert!((0..l).all(|i| keeps_attention(i, l, usize::MAX) && !keeps_attention(i, l, 0)));
        let run = |kept, lent| GpuRun {
            kept_attention: kept,
            saved_in_grads: lent,
            half_gathers: true,
            ..stage3_run(4)
        };
        let acts = |kept| gpu_mixed_activation_bytes(&cfg, &run(kept, false));
        let per_layer = 6 * 8 * 1024 * cfg.n_embd as u128;
        for k in 1..l {
            assert_eq!(acts(k) - acts(k - 1), per_layer, "{k} layers");
        }
        // All of them: the shared block needs no attention state of its own.
        assert!(acts(l) < acts(l - 1) + per_layer);
        assert_eq!(acts(l), acts(usize::MAX));
        let total = |kept| gpu_training(&cfg, &run(kept, true)).total();
        let mut last = total(0);
        for k in 1..l {
            let now = total(k);
            assert!(now >= last, "{k} layers: {now} < {last}");
            last = now;
        }
        assert!(total(0) < total(l / 2) && total(l / 2) < total(l));
    }

    /// The 12.85B model under ZeRO-3 over 4 ranks, B 8 × 1024 with
    /// checkpointing, the attention's state kept in the last 8 layers:
    /// in the default order the head's buffers find no gap for the token
    /// embeddings' bf16 cast (515 MB), which then needs its own memory;
    /// placed first, from the embeddings' slice into layer 0's, it lends
    /// (layer 0's own buffers move out), and the estimate falls from 52.91
    /// to 52.62 GiB — under FSDP2's measured 52.72 on 4 H100s, where
    /// keeping 9 layers (52.74) is not.
    #[test]
    fn the_cast_embeddings_first_lend_more() {
        let cfg = GptConfig::parse("L40-H40-C5120-V50304-T1024").unwrap();
        let run = |kept| GpuRun {
            kept_attention: kept,
            saved_in_grads: true,
            half_gathers: true,
            stored_score_grads: true,
            split_embeddings: true,
            ..stage3_run(4)
        };
        let est = |kept| gib(gpu_training(&cfg, &run(kept)).total());
        assert!((est(7) - 52.43).abs() < 0.01, "{}", est(7));
        assert!((est(8) - 52.62).abs() < 0.01, "{}", est(8));
        assert!((est(9) - 52.74).abs() < 0.01, "{}", est(9));
    }

    /// Under checkpointing with no layer keeping the attention's state,
    /// layers that leave their output to the recomputation save their
    /// input and statistics alone: each layer's output (bf16) and
    /// log-sum-exp fewer, one shared output more — with the fused
    /// attention and without (which keeps no log-sum-exp); the form needs
    /// checkpointing and no kept layer (`shares_atty`). With the 12.85B
    /// model's saved activations lent the shard of 8 ranks, 3.1 GiB less.
    #[test]
    fn layers_saving_their_input_alone_drop_their_attention_output() {
        let cfg = GptConfig::parse("L40-H40-C5120-V50304-T1024").unwrap();
        let (l, nc, rows) = (40u128, 8 * 1024 * 5120u128, 8 * 40 * 1024u128);
        for fused in [true, false] {
            let run = |inputs| GpuRun {
                fused_attention: fused,
                recompute_attention_output: inputs,
                ..stage3_run(4)
            };
            let (a, b) = (
                gpu_mixed_activation_bytes(&cfg, &run(false)),
                gpu_mixed_activation_bytes(&cfg, &run(true)),
            );
            let lse = if fused { 4 * rows } else { 0 };
            assert_eq!(a - b, l * (2 * nc + lse) - 2 * nc, "fused {fused}");
        }
        assert!(GpuRun {
            recompute_attention_output: true,
            ..stage3_run(4)
        }
        .shares_atty());
        let not = |r: GpuRun| !r.shares_atty();
        assert!(not(GpuRun {
            checkpointing: false,
            recompute_attention_output: true,
            ..stage3_run(4)
        }));
        assert!(not(GpuRun {
            kept_attention: 1,
            recompute_attention_output: true,
            ..stage3_run(4)
        }));
        let lent = |inputs| {
            let run = GpuRun {
                recompute_attention_output: inputs,
                saved_in_grads: true,
                half_gathers: true,
                split_embeddings: true,
                stored_score_grads: true,
                ..stage3_run(8)
            };
            gib(gpu_training(&cfg, &run).total())
        };
        let (kept, inputs) = (lent(false), lent(true));
        assert!((kept - 32.67).abs() < 0.01, "{kept}");
        assert!(kept - inputs > 3.0, "{kept} against {inputs}");
    }

    #[test]
    fn stored_score_gradients_cost_nothing_where_a_block_holds_them() {
        use crate::cuda::flash::FlashKernels;
        use crate::cuda::model_mixed::score_grads_fit_in_block;
        let run = |stored| GpuRun {
            stored_score_grads: stored,
            kept_attention: usize::MAX,
            saved_in_grads: true,
            half_gathers: true,
            ..stage3_run(2)
        };
        // Head size 128 (the 12.85B model): the block's resid2 and fch
        // take them; head size 64 (1558M): they keep their own scratch.
        for (name, fits) in [("L40-H40-C5120-V50304-T1024", true), ("1558M", false)] {
            let cfg = GptConfig::parse(name).unwrap();
            let shape = crate::cpu::attention::AttnShape {
                b: 8,
                t: 1024,
                c: cfg.n_embd,
                nh: cfg.n_head,
            };
            assert_eq!(score_grads_fit_in_block(shape), fits, "{name}");
            let extra = gpu_mixed_activation_bytes(&cfg, &run(true))
                - gpu_mixed_activation_bytes(&cfg, &run(false));
            let own = 2 * FlashKernels::score_grads_len(shape);
            assert_eq!(extra, if fits { 0 } else { own }, "{name}");
        }
        // Whole heads only: a first piece one element short of a head
        // moves that head to the second.
        let shape = crate::cpu::attention::AttnShape {
            b: 2,
            t: 128,
            c: 64,
            nh: 2,
        };
        let per = (FlashKernels::score_grads_len(shape) / 4) as usize;
        assert_eq!(
            FlashKernels::score_grads_split(shape, 2 * per, 2 * per),
            (2, true)
        );
        assert_eq!(
            FlashKernels::score_grads_split(shape, 2 * per - 1, 2 * per),
            (1, false)
        );
        assert_eq!(
            FlashKernels::score_grads_split(shape, 2 * per - 1, 3 * per),
            (1, true)
        );
        assert_eq!(
            FlashKernels::score_grads_split(shape, 9 * per, 0),
            (4, true)
        );
    }

    #[test]
    fn breakdown_names_every_part_and_the_total() {
        let cfg = GptConfig::parse("124M").unwrap();
        let f = cpu_training(&cfg, 4, 64, false, 2, Sharding::NONE);
        let text = f.breakdown();
        for part in [
            "parameters",
            "gradients",
            "optimizer state",
            "activations",
            "= ",
        ] {
            assert!(text.contains(part), "{text}");
        }
        assert_eq!(f.part("parameters"), 4 * 124_439_808);
        assert_eq!(f.part("optimizer state"), 8 * 124_439_808);
    }

    #[test]
    fn largest_batch_bisects_to_the_last_that_fits() {
        let f = |b: usize| Footprint {
            parts: vec![Part {
                name: "x",
                bytes: 100 + 10 * b as u128,
            }],
        };
        assert_eq!(largest_batch(100 + 10 * 37, 1000, f), Some(37));
        assert_eq!(largest_batch(100 + 10 * 37 + 9, 1000, f), Some(37));
        assert_eq!(largest_batch(105, 1000, f), None);
        assert_eq!(largest_batch(1_000_000, 64, f), Some(64));
    }

    /// A pipeline stage's bytes per micro-batch in flight, against what
    /// the first stage's buffers measured on 4 H100s (the "held at once"
    /// line, MB of 10^6 bytes; `bench/results/2026-11-27-pp-split-h100x4/`
    /// and `2026-11-27-pp-mem-h100x4/`): 2.65B micro-batches of 2 × 1024
    /// through 8 layers (1F1B), 4 (interleaved), 8 split (ZB-H1); 12.85B
    /// through 10 layers with checkpointing, the attention output kept and
    /// recomputed.
    #[test]
    fn stage_estimate_is_what_the_first_stage_measured() {
        let small = GptConfig::parse("L32-H32-C2560-V50304-T1024").unwrap();
        let big = GptConfig::parse("L40-H40-C5120-V50304-T1024").unwrap();
        let run = |checkpointing| GpuRun {
            b: 2,
            streamed_weights: false,
            stored_score_grads: true,
            checkpointing,
            sharding: Sharding::NONE,
            ..stage3_run(1)
        };
        let stage = |checkpointing, layers, split, recompute| StageRun {
            run: GpuRun {
                recompute_attention_output: recompute,
                ..run(checkpointing)
            },
            layers,
            last: false,
            split,
        };
        for (what, cfg, s, measured_mb) in [
            ("2.65B 1F1B", &small, stage(false, 8, false, true), 1051.2),
            (
                "2.65B interleaved",
                &small,
                stage(false, 4, false, true),
                546.7,
            ),
            ("2.65B ZB-H1", &small, stage(false, 8, true, true), 2309.5),
            ("12.85B kept", &big, stage(true, 10, false, false), 716.9),
            (
                "12.85B recomputed",
                &big,
                stage(true, 10, false, true),
                503.9,
            ),
        ] {
            let mb = gpu_mixed_stage_bytes(cfg, &s).per_micro_batch as f64 / 1e6;
            assert!(
                (mb - measured_mb).abs() < 0.1,
                "{what}: {mb:.2} MB, measured {measured_mb}"
            );
        }
        // The last stage keeps the head's logits instead of an output
        // gradient, and the padded classifier's copies are shared.
        let last = StageRun {
            last: true,
            ..stage(false, 8, false, true)
        };
        let (l, f) = (
            gpu_mixed_stage_bytes(&small, &last),
            gpu_mixed_stage_bytes(&small, &stage(false, 8, false, true)),
        );
        let n = 2 * 1024u128;
        assert_eq!(
            l.per_micro_batch - f.per_micro_batch,
            2 * n * 2560 + 8 * n + 2 * n * 50304 + 4 * n - 4 * n * 2560
        );
    }
}
