//! The memory pre-flight of `braid train`: before the model is
//! allocated, its footprint (`braid_model::footprint`) against the host's
//! available memory and the GPU's capacity; a run that would not fit is
//! refused with the estimate, the capacity and what would fit.

use braid_core::env;
use braid_model::footprint::{Footprint, Sharding};
use braid_model::GptConfig;

/// What the run asked for, as the messages name it.
pub struct Shape<'a> {
    /// `--model` as given.
    pub model: &'a str,
    /// `--seq`.
    pub seq: usize,
    /// `--checkpointing`.
    pub checkpointing: bool,
    /// `--zero` over the shard group.
    pub sharding: Sharding,
    /// Data-parallel ranks in the run (the world over `tensor`; a run over
    /// several is told which ZeRO stage would fit).
    pub ranks: usize,
    /// Workers on this host: they share its memory.
    pub local_workers: usize,
    /// `--offload optimizer`: master weights and AdamW state in host
    /// memory.
    pub offload: bool,
    /// `--accum`: micro-batches per step.
    pub accum: usize,
    /// `--tp`: ranks per tensor group (1: none).
    pub tensor: usize,
    /// Sequence parallelism in the tensor groups.
    pub sequence: bool,
    /// `--grad-comm plain`: data parallelism reduces the f32 gradients as
    /// they are.
    pub plain_grads: bool,
    /// `--gpu-memory`, in bytes: what the estimate must fit besides the
    /// GPU's free memory.
    pub gpu_memory: Option<u128>,
    /// Which products run in FP8 (`--precision fp8`, `BRAID_FP8`): their
    /// operand rooms count beside the model's own memory.
    pub fp8: braid_model::cuda::model_mixed::Fp8Use,
}

impl Shape<'_> {
    /// Device bytes of the copy-engine all-reduce's landing buffer (an
    /// f32 for each gradient element, `params`, that the other N − 1
    /// ranks own: (N − 1)/N of them, to a bucket's rounding): what plain
    /// data parallelism over 2 to 8 GPUs of one host holds beside the
    /// gradients (`BRAID_GPU_ALLREDUCE` auto or ce), under `sharding`.
    fn landing_bytes(&self, sharding: Sharding, params: u128) -> u128 {
        use braid_train::collective::{copy_engine_landing_bytes, copy_engines_by_default};
        let one_host = self.local_workers >= self.ranks * self.tensor.max(1);
        match sharding.stage == 0
            && self.plain_grads
            && copy_engines_by_default(self.ranks, one_host)
        {
            true => copy_engine_landing_bytes(self.ranks, params),
            false => 0,
        }
    }

    /// `f` with the landing buffer ([`landing_bytes`](Self::landing_bytes))
    /// and the FP8 products' rooms (`b` sequences a micro-batch, the MLP's
    /// `widest` columns on this rank) as parts of their own where there
    /// are any.
    fn with_extras(
        &self,
        mut f: Footprint,
        sharding: Sharding,
        params: u128,
        (b, widest): (usize, usize),
    ) -> Footprint {
        let extras = [
            (
                "copy-engine landing buffer",
                self.landing_bytes(sharding, params),
            ),
            (
                "FP8 operands",
                self.fp8.room_bytes(b * self.seq, widest, self.tensor > 1),
            ),
        ];
        for (name, bytes) in extras {
            if bytes > 0 {
                f.parts.push(braid_model::footprint::Part { name, bytes });
            }
        }
        f
    }
}

impl Shape<'_> {
    /// The ZeRO stages that are not this run's and could shard it: none
    /// for one process or an already sharded run.
    fn other_stages(&self) -> Vec<Sharding> {
        match (self.sharding.stage, self.ranks) {
            (0, n) if n > 1 => (1..=3).map(|stage| Sharding { stage, ranks: n }).collect(),
            _ => Vec::new(),
        }
    }
}

/// [`device`] for a tensor-parallel rank: its share of the model states
/// and of the activations (`footprint::gpu_training` with the rank's
/// widths), in the fast forms — in bf16 a whole bf16 copy of the rank's
/// share, or where only that does not fit (or `BRAID_BF16_WEIGHTS` says
/// so) its weights cast layer by layer (ZeRO-3 always casts its layers
/// as they run); refused with what would fit when no form fits the GPU's
/// free memory or `--gpu-memory`.
fn tensor_parallel(
    a: &Shape<'_>,
    cfg: &GptConfig,
    space: Option<Room>,
    (mixed, fused, forced): (bool, bool, Option<bool>),
    batch: usize,
    deferred: usize,
) -> Result<DevicePlan, String> {
    use braid_model::footprint::{gib, gpu_training, largest_batch, GpuRun, TensorSplit};
    let stage3 = a.sharding.stage == 3;
    let plan = |estimate, streamed_weights| DevicePlan {
        estimate,
        streamed_weights,
        fused_attention: fused,
        stored_score_grads: fused,
        kept_attention: match fused && a.checkpointing {
            true => cfg.n_layer,
            false => 0,
        },
        recompute_attention_output: false,
        saved_in_grads: false,
        half_gathers: false,
        split_embeddings: false,
        per_ranks: Vec::new(),
    };
    let p = plan(0, false);
    // The bf16 weights' forms to try, fastest first.
    let weights = match forced {
        Some(streamed) => vec![streamed],
        None if mixed && !stage3 => vec![false, true],
        None => vec![mixed && stage3],
    };
    let tensor = TensorSplit {
        ranks: a.tensor,
        sequence: a.sequence,
    };
    let share = braid_model::footprint::share_params(cfg, tensor);
    let need_with = |b: usize, checkpointing: bool, sharding: Sharding, streamed: bool| {
        let f = gpu_training(
            cfg,
            &GpuRun {
                b,
                t: a.seq,
                mixed,
                fused_attention: fused,
                deferred,
                checkpointing,
                streamed_weights: streamed || (mixed && sharding.stage == 3),
                stored_score_grads: p.stored_score_grads,
                kept_attention: match fused && checkpointing {
                    true => cfg.n_layer,
                    false => 0,
                },
                recompute_attention_output: false,
                sharding,
                offload: false,
                saved_in_grads: false,
                half_gathers: false,
                split_embeddings: false,
                tensor,
            },
        );
        a.with_extras(f, sharding, share, (b, 4 * cfg.n_embd / a.tensor.max(1)))
    };
    let Some(space) = space else {
        let f = need_with(batch, a.checkpointing, a.sharding, weights[0]);
        return Ok(plan(f.total(), weights[0]));
    };
    if let Some((f, streamed)) = first_fit(&weights, &space, |streamed| {
        need_with(batch, a.checkpointing, a.sharding, streamed)
    }) {
        return Ok(plan(f.total(), streamed));
    }
    // The hints' run: the leanest form.
    let lean = *weights.last().unwrap_or(&false);
    let need = |b: usize, checkpointing: bool, sharding: Sharding| {
        need_with(b, checkpointing, sharding, lean)
    };
    let f = need(batch, a.checkpointing, a.sharding);
    let room = space.room();
    let mut fits = Vec::new();
    if let Some(b) = largest_batch(room, batch, |b| need(b, a.checkpointing, a.sharding)) {
        fits.push(format!("--batch {b}"));
    }
    if mixed && !a.checkpointing && need(batch, true, a.sharding).total() <= room {
        fits.push("--checkpointing".into());
    }
    let zero3 = Sharding {
        stage: 3,
        ranks: a.ranks,
    };
    if !stage3 && a.ranks > 1 && need(batch, a.checkpointing, zero3).total() <= room {
        fits.push("--zero 3 (over the data dimension)".into());
    }
    let hint = match fits.is_empty() {
        false => format!("what would fit: {}", fits.join(" or ")),
        true => format!(
            "even batch 1 does not fit: a larger --tp (a share of 1/{} of the model is {:.2e} \
             parameters), --zero 3 over more data-parallel ranks, or a smaller model",
            a.tensor, share as f64
        ),
    };
    let form = match lean && mixed && !stage3 {
        true => " with the bf16 weights cast layer by layer",
        false => "",
    };
    Err(format!(
        "{} at batch {batch} x {} under --tp {}{form} needs about {:.2} GiB per GPU ({} + \
         workspace {:.2} GiB), but there is {}; {hint}",
        a.model,
        a.seq,
        a.tensor,
        gib(f.total() + DEVICE_MARGIN),
        f.breakdown(),
        gib(DEVICE_MARGIN),
        space.said()
    ))
}

/// The bf16 engine's memory-for-speed forms to try, fastest first: each
/// of `weights` (streamed or not), then `keeps` (layers keeping the
/// attention's state), then `scores` (stored or not), and — where
/// `inputs_alone` is `None` (the choice left to the pre-flight) — last
/// the layers saving their inputs alone (no layer keeping the state);
/// with `Some(true)` only those, with `Some(false)` none of them.
fn forms_fastest_first(
    weights: &[bool],
    keeps: &[usize],
    scores: &[bool],
    inputs_alone: Option<bool>,
) -> Vec<(bool, usize, bool, bool)> {
    let mut forms = Vec::new();
    if inputs_alone != Some(true) {
        for &w in weights {
            for &k in keeps {
                forms.extend(scores.iter().map(|&s| (w, k, s, false)));
            }
        }
    }
    if inputs_alone != Some(false) {
        for &w in weights {
            forms.extend(scores.iter().map(|&s| (w, 0, s, true)));
        }
    }
    forms
}

/// The first of `forms` (fastest first) whose footprint `need(form)` fits
/// `space`, with that footprint.
fn first_fit<F: Copy>(
    forms: &[F],
    space: &Room,
    need: impl Fn(F) -> Footprint,
) -> Option<(Footprint, F)> {
    forms.iter().find_map(|&form| {
        let f = need(form);
        space.fits(f.total()).then_some((f, form))
    })
}

/// `--zero S` for a hint.
fn zero_flag(s: Sharding) -> String {
    format!("--zero {}", s.stage)
}
use braid_train::engines::Precision;

/// Refuses, before anything is allocated, a run whose host memory
/// (the CPU engine's parameters, gradients, optimizer state and
/// activations; the GPU engine's host copy of the parameters, or its
/// offloaded optimizer's master weights, moments and transfer buffers) exceeds
/// what this machine has available, naming the estimate and what would fit.
pub fn host(
    a: &Shape<'_>,
    cfg: &GptConfig,
    batch: usize,
    cuda: bool,
    precision: Precision,
    adamw: bool,
) -> Result<(), String> {
    use braid_model::footprint::{self, gib, Part};
    let Some(host_avail) = footprint::host_available() else {
        return Ok(());
    };
    // Every worker on this host trains its own copy.
    let workers = a.local_workers.max(1);
    let avail = host_avail / workers as u128;
    let params = cfg.num_params() as u128;
    // AdamW keeps two moments, SGD with momentum one.
    let states = if adamw { 2 } else { 1 };
    let need_with = |b: usize, ckpt: bool, sharding: Sharding| {
        if cuda && a.offload {
            let mixed = precision.mixed();
            footprint::offloaded_optimizer(cfg, mixed, braid_train::engines::offload::CHUNK)
        } else if cuda {
            Footprint {
                parts: vec![Part {
                    name: "parameters (host copy)",
                    bytes: 4 * params,
                }],
            }
        } else {
            footprint::cpu_training(cfg, b, a.seq, ckpt, states, sharding)
        }
    };
    let need = |b: usize, ckpt: bool| need_with(b, ckpt, a.sharding);
    let f = need(batch, a.checkpointing);
    if f.total() <= avail {
        return Ok(());
    }
    let model = format!("model {} ({:.3e} parameters)", a.model, params as f64);
    let mut fits = Vec::new();
    if !cuda {
        if let Some(b) = footprint::largest_batch(avail, batch, |b| need(b, a.checkpointing)) {
            fits.push(format!("--batch {b}"));
        }
        if !a.checkpointing {
            match footprint::largest_batch(avail, batch, |b| need(b, true)) {
                Some(b) if b == batch => fits.push("--checkpointing".into()),
                Some(b) => fits.push(format!("--checkpointing --batch {b}")),
                None => {}
            }
        }
        if let Some(s) = a
            .other_stages()
            .into_iter()
            .find(|&s| need_with(batch, a.checkpointing, s).total() <= avail)
        {
            fits.push(zero_flag(s));
        }
    }
    // Bytes per parameter of the model's state under this run's sharding
    // (batch 1 with checkpointing: activations as small as they get).
    let per = match cuda {
        true => f.total() as f64 / params.max(1) as f64,
        false => need(1, true).total() as f64 / params.max(1) as f64,
    };
    let hint = if per * params as f64 > avail as f64 && fits.is_empty() {
        format!(
            "the model alone needs about {per:.1} bytes per parameter here; \
             a model of at most about {:.2e} parameters would fit",
            avail as f64 / per
        )
    } else if fits.is_empty() {
        let one = need(1, true).total();
        format!(
            "even batch 1 with --checkpointing needs {:.2} GiB: shorten --seq or pick a smaller model",
            gib(one)
        )
    } else {
        format!("what would fit: {}", fits.join(" or "))
    };
    Err(format!(
        "{model} needs about {:.2} GiB of host memory{} ({}), but {:.2} GiB is available{}; {hint}",
        gib(f.total()),
        if cuda && a.offload {
            " for its offloaded optimizer".to_string()
        } else if cuda {
            String::new()
        } else {
            format!(" to train on the CPU at batch {batch} x {}", a.seq)
        },
        f.breakdown(),
        gib(host_avail),
        match workers {
            1 => String::new(),
            n => format!(
                " ({:.2} GiB for each of the {n} workers on this host)",
                gib(avail)
            ),
        }
    ))
}

/// `BRAID_TEST_GPU_FREE` (tests and experiments only): the free memory
/// the pre-flight counts with instead of the GPU's, in bytes (`K`, `M`,
/// `G` suffixes), so that a run the pre-flight would refuse is
/// started and shown to run out of memory (`bench/device/one.sh memory`
/// checks `braid plan`'s refusals so). A malformed value is reported and
/// ignored.
fn test_free_memory() -> Option<u128> {
    let v = std::env::var(env::BRAID_TEST_GPU_FREE).ok()?;
    match super::bench::parse_size(&v) {
        Ok(bytes) => Some(bytes as u128),
        Err(e) => {
            eprintln!(
                "braid: warning: ignoring {}={v}: {e}",
                env::BRAID_TEST_GPU_FREE
            );
            None
        }
    }
}

/// Where a run's GPU memory must fit: the GPU's free memory less
/// [`DEVICE_MARGIN`], and the estimate (the allocator's peak) within
/// `--gpu-memory` where given.
pub(super) struct Room {
    free: u128,
    budget: Option<u128>,
    /// The GPU's ordinal, for errors.
    gpu: usize,
}

impl Room {
    /// `dev`'s free memory and `budget` (`--gpu-memory`); `None` where
    /// neither is known (the free memory cannot be read and no budget was
    /// given).
    pub(super) fn new(dev: &braid_cuda::Device, budget: Option<u128>) -> Option<Room> {
        let free = match (test_free_memory(), dev.free_memory(), budget) {
            (Some(free), _, _) => free,
            (None, Ok(free), _) => free as u128,
            (None, Err(_), Some(_)) => u128::MAX,
            (None, Err(_), None) => return None,
        };
        Some(Room {
            free,
            budget,
            gpu: dev.ordinal(),
        })
    }

    /// A budget alone, the free memory unknown (as a run with
    /// `--gpu-memory` whose GPU cannot say what is free).
    #[cfg(test)]
    pub(super) fn budget_only(budget: u128) -> Room {
        Room {
            free: u128::MAX,
            budget: Some(budget),
            gpu: 0,
        }
    }

    /// Whether an estimate of `total` bytes fits.
    pub(super) fn fits(&self, total: u128) -> bool {
        total.saturating_add(DEVICE_MARGIN) <= self.free && self.budget.is_none_or(|b| total <= b)
    }

    /// The most an estimate may be.
    fn room(&self) -> u128 {
        let room = self.free.saturating_sub(DEVICE_MARGIN);
        self.budget.map_or(room, |b| room.min(b))
    }

    /// What bounds the run, for an error: the free memory, or the budget.
    pub(super) fn said(&self) -> String {
        let free = match self.free {
            u128::MAX => "the free memory unknown".to_string(),
            f => format!("{:.2} GiB free", braid_model::footprint::gib(f)),
        };
        match self.budget {
            Some(b) if b < self.free.saturating_sub(DEVICE_MARGIN) => format!(
                "--gpu-memory allows {:.2} GiB ({free} on GPU {})",
                braid_model::footprint::gib(b),
                self.gpu
            ),
            _ => format!("{free} on GPU {}", self.gpu),
        }
    }
}

/// `BRAID_CKPT_ATTENTION`: how many layers of `layers` keep the
/// attention's state under checkpointing — `kept` (all), `recomputed`
/// (none), a number of layers (the last ones), or `auto`/unset (`None`:
/// the pre-flight keeps it in as many as fit).
pub fn kept_attention_choice(layers: usize) -> Result<Option<usize>, String> {
    parse_kept_attention(
        std::env::var(env::BRAID_CKPT_ATTENTION).ok().as_deref(),
        layers,
    )
}

/// [`kept_attention_choice`] of the variable's value.
fn parse_kept_attention(value: Option<&str>, layers: usize) -> Result<Option<usize>, String> {
    match value {
        None | Some("") | Some("auto") => Ok(None),
        Some("kept") => Ok(Some(layers)),
        Some("recomputed") => Ok(Some(0)),
        Some(v) => match v.parse::<usize>() {
            Ok(k) if k <= layers => Ok(Some(k)),
            _ => Err(format!(
                "BRAID_CKPT_ATTENTION={v}: expected kept, recomputed, auto or a number of layers \
                 from 0 to {layers}"
            )),
        },
    }
}

pub use braid_model::footprint::DEVICE_MARGIN;

/// Whether the bf16 engine runs the fused attention for `cfg` on `dev`: a
/// head size the flash kernels take, compute capability 8 or newer, and
/// not `BRAID_ATTENTION=batched`.
pub fn fused_attention(cfg: &GptConfig, dev: &braid_cuda::Device) -> bool {
    let hs = cfg.n_embd.checked_div(cfg.n_head).unwrap_or(0);
    braid_model::cuda::flash::FlashKernels::HEAD_SIZES.contains(&hs)
        && dev.compute_capability().is_ok_and(|(major, _)| major >= 8)
        && std::env::var(env::BRAID_ATTENTION).as_deref() != Ok("batched")
}

/// What the GPU pre-flight decided.
pub struct DevicePlan {
    /// The estimate's bytes (0 where the free memory cannot be read).
    pub estimate: u128,
    /// Stream the bf16 weights layer by layer instead of keeping a copy.
    pub streamed_weights: bool,
    /// The fused attention is planned for (else the batched products).
    pub fused_attention: bool,
    /// Keep the fused attention's score gradients for its dQ kernel.
    pub stored_score_grads: bool,
    /// Under checkpointing, how many layers (the last ones) keep the fused
    /// attention's state.
    pub kept_attention: usize,
    /// Under checkpointing with no layer keeping that state: the layers
    /// leave their attention output to the recomputation too
    /// (`BRAID_CKPT_ATTENTION_OUTPUT`).
    pub recompute_attention_output: bool,
    /// The saved activations live in gradient memory until the backward
    /// pass writes it: ZeRO-3's gradient shard, or one process's gradient
    /// buffer (one micro-batch per step; `BRAID_SAVED_IN_GRADS`).
    pub saved_in_grads: bool,
    /// ZeRO-3 in bf16: the layers gathered in bf16 (`BRAID_ZERO3_GATHER`).
    pub half_gathers: bool,
    /// ZeRO-3: the tied embeddings' gradients reduce-scattered in two parts
    /// ([`split_embedding_grads`]).
    pub split_embeddings: bool,
    /// ZeRO-3: the estimate of the chosen form at 2, 4 and 8 ranks (how
    /// the per-rank memory falls with N, for the scaling tables beside
    /// FSDP2's measured peaks).
    pub per_ranks: Vec<(usize, u128)>,
}

/// A memory-for-speed choice the pre-flight makes unless the environment
/// variable `var` names it: `Some(true)` for `yes`, `Some(false)` for
/// `no`, `None` for `auto` or unset. The choices (all results the same
/// bits either way):
/// - `BRAID_BF16_WEIGHTS`: `streamed` (cast layer by layer) or `resident`
///   (a full bf16 copy);
/// - `BRAID_SCORE_GRADS`: `stored` (scratch for the fused attention's
///   score gradients, so its dQ kernel need not recompute them) or
///   `recomputed`;
/// - `BRAID_CKPT_ATTENTION`: under checkpointing with the fused attention,
///   `kept` (each layer keeps the attention's state, and the
///   recomputation starts at its output) or `recomputed`;
/// - `BRAID_CKPT_ATTENTION_OUTPUT`: under checkpointing in bf16 where no
///   layer keeps the attention's state, `kept` (each layer keeps the
///   attention's output and log-sum-exp) or `recomputed` (each keeps its
///   input and LayerNorm statistics alone; the leanest form, tried last);
/// - `BRAID_SAVED_IN_GRADS`: in bf16 with one micro-batch per step, under
///   ZeRO-3 or in one process without `--offload`, `on` (the activations
///   saved for the backward pass live in gradient memory that is idle
///   until the backward pass writes it: the gradient shard, or the
///   gradient buffer; the default) or `off`;
/// - `BRAID_ZERO3_GATHER`: under ZeRO-3 in bf16, `bf16` (each rank rounds
///   its slice of a layer and the layer is gathered as the bf16 weights
///   its products read; the default) or `f32` (gathered in f32 and cast
///   as it runs).
///
/// One more, `BRAID_SPLIT_REDUCE`, changes the order of a sum: see
/// [`split_embedding_grads`].
pub fn env_choice(var: &str, yes: &str, no: &str) -> Result<Option<bool>, String> {
    match std::env::var(var).as_deref() {
        Err(_) | Ok("") | Ok("auto") => Ok(None),
        Ok(v) if v == yes => Ok(Some(true)),
        Ok(v) if v == no => Ok(Some(false)),
        Ok(other) => Err(format!("{var}={other}: expected {yes}, {no} or auto")),
    }
}

/// Whether ZeRO-3 (`stage`) reduce-scatters the tied embeddings'
/// gradients in two parts — the head's as soon as it is done, the
/// embedding unit's at the end, added to it — so that no buffer holds
/// them through the layers' backward units, for one more reduce-scatter
/// of the embeddings per micro-batch: `BRAID_SPLIT_REDUCE` `on` or `off`,
/// or by default under `checkpointing` where a layer's gradient buffer
/// can hold them (`braid_model::footprint::splits_embedding_grads`).
/// Over several ranks the embeddings' sum then adds the ranks' head parts
/// and embedding parts apart: the same within rounding, not the same
/// bits.
pub fn split_embedding_grads(
    cfg: &GptConfig,
    stage: u8,
    checkpointing: bool,
) -> Result<bool, String> {
    match (env_choice(env::BRAID_SPLIT_REDUCE, "on", "off")?, stage) {
        (Some(true), s) if s != 3 => Err(
            "BRAID_SPLIT_REDUCE=on: only --zero 3 reduce-scatters the embeddings' gradients in \
             parts"
                .into(),
        ),
        (Some(on), _) => Ok(on),
        (None, s) => {
            Ok(s == 3 && braid_model::footprint::splits_embedding_grads(cfg, checkpointing))
        }
    }
}

/// Refuses, before anything is allocated, a run whose GPU memory (model
/// states, the bf16 weights in mixed precision, activations and scratch:
/// `braid_model::footprint::gpu_training`) exceeds the memory free on the
/// GPU, naming the estimate and what would fit. In bf16 what only buys
/// speed is dropped where that makes the difference, in this order: under
/// checkpointing each layer's kept attention state, the attention's
/// score-gradient scratch, then the weights' full bf16 copy (for weights
/// cast layer by layer), and last under checkpointing the layers' saved
/// attention output (each keeping its input alone); `BRAID_CKPT_ATTENTION`,
/// `BRAID_SCORE_GRADS`, `BRAID_BF16_WEIGHTS` and
/// `BRAID_CKPT_ATTENTION_OUTPUT` decide instead.
pub fn device(
    a: &Shape<'_>,
    cfg: &GptConfig,
    dev: &braid_cuda::Device,
    precision: Precision,
    batch: usize,
    deferred: usize,
) -> Result<DevicePlan, String> {
    let fused = precision.mixed() && fused_attention(cfg, dev);
    let space = Room::new(dev, a.gpu_memory);
    device_in(a, cfg, (space, fused), precision, batch, deferred)
}

/// [`device`] in `space` (`None`: the free memory unknown and no budget
/// given), with the fused attention where `fused` (bf16 only).
pub(super) fn device_in(
    a: &Shape<'_>,
    cfg: &GptConfig,
    (space, fused): (Option<Room>, bool),
    precision: Precision,
    batch: usize,
    deferred: usize,
) -> Result<DevicePlan, String> {
    use braid_model::footprint::{gib, gpu_training, largest_batch, GpuRun};
    let mixed = precision.mixed();
    let forced = env_choice(env::BRAID_BF16_WEIGHTS, "streamed", "resident")?;
    if forced == Some(true) && !mixed {
        return Err("BRAID_BF16_WEIGHTS=streamed: the f32 engine has no bf16 weights".into());
    }
    let fused = mixed && fused;
    // Under checkpointing, the layers may leave their attention output to
    // the recomputation too (each saves its input and statistics alone):
    // the leanest form, tried last, or forced.
    let forced_output = env_choice(env::BRAID_CKPT_ATTENTION_OUTPUT, "recomputed", "kept")?;
    if a.tensor > 1 {
        if forced_output == Some(true) {
            return Err(
                "BRAID_CKPT_ATTENTION_OUTPUT=recomputed: a tensor-parallel rank keeps its layers' \
                 attention output (not yet under --tp; pipelines and ZeRO-3 take it)"
                    .into(),
            );
        }
        return tensor_parallel(a, cfg, space, (mixed, fused, forced), batch, deferred);
    }
    let forced_scores = env_choice(env::BRAID_SCORE_GRADS, "stored", "recomputed")?;
    if forced_scores == Some(true) && !fused {
        return Err(
            "BRAID_SCORE_GRADS=stored: only the fused attention (bf16, head sizes with fused \
             kernels) stores score gradients"
                .into(),
        );
    }
    let layers = cfg.n_layer;
    let forced_keep = kept_attention_choice(layers)?;
    if forced_keep.is_some_and(|k| k > 0) && !(fused && a.checkpointing) {
        return Err(
            "BRAID_CKPT_ATTENTION: only --checkpointing with the fused attention keeps the \
             attention's state"
                .into(),
        );
    }
    if forced_output == Some(true) && !(mixed && a.checkpointing) {
        return Err(
            "BRAID_CKPT_ATTENTION_OUTPUT=recomputed: only --checkpointing in bf16 recomputes the \
             attention's output"
                .into(),
        );
    }
    if forced_output == Some(true) && forced_keep.is_some_and(|k| k > 0) {
        return Err(
            "BRAID_CKPT_ATTENTION_OUTPUT=recomputed with BRAID_CKPT_ATTENTION keeping layers' \
             state: a layer that keeps the attention's state keeps its output too"
                .into(),
        );
    }
    // All layers keeping it, then one layer fewer at a time (the first
    // ones first: the last layers' state is read first).
    let keeps: Vec<usize> = match forced_keep {
        Some(keep) => vec![keep],
        None if fused && a.checkpointing => (0..=layers).rev().collect(),
        None => vec![0],
    };
    if forced == Some(true) && a.offload {
        return Err(
            "BRAID_BF16_WEIGHTS=streamed: an offloaded optimizer keeps the bf16 weights whole \
             on the GPU"
                .into(),
        );
    }
    let stage3 = a.sharding.stage == 3;
    // Where the saved activations may live in gradient memory: ZeRO-3's
    // gradient shard, or the whole gradient buffer of one process that
    // writes it unit by unit.
    let lends_in = |sharding: Sharding, offload: bool| {
        sharding.stage == 3 || (sharding.stage == 0 && a.ranks == 1 && !offload && deferred == 0)
    };
    let saved_in_grads = match env_choice(env::BRAID_SAVED_IN_GRADS, "on", "off")? {
        Some(true) if !(mixed && a.accum == 1 && lends_in(a.sharding, a.offload)) => {
            return Err(
                "BRAID_SAVED_IN_GRADS=on: only bf16 runs with one micro-batch per step (no \
                 --accum) keep saved activations in gradient memory: ZeRO-3's gradient shard, \
                 or the gradient buffer of one process without --offload"
                    .into(),
            )
        }
        Some(on) => on,
        None => mixed && a.accum == 1 && lends_in(a.sharding, a.offload),
    };
    let half_gathers = match env_choice(env::BRAID_ZERO3_GATHER, "bf16", "f32")? {
        Some(true) if !(stage3 && mixed) => {
            return Err(
                "BRAID_ZERO3_GATHER=bf16: only ZeRO-3 in bf16 gathers layers in bf16".into(),
            )
        }
        Some(half) => half,
        None => stage3 && mixed,
    };
    if forced == Some(false) && stage3 {
        return Err(
            "BRAID_BF16_WEIGHTS=resident: under ZeRO-3 each gathered layer is cast to bf16 as \
             it runs (there is no whole bf16 copy to keep)"
                .into(),
        );
    }
    let split = split_embedding_grads(cfg, a.sharding.stage, a.checkpointing)?;
    // What the hints' other setups would choose (a forced `on` that a
    // setup refuses: not split).
    let split_in = |sharding: Sharding, checkpointing: bool| {
        split_embedding_grads(cfg, sharding.stage, checkpointing).unwrap_or(false)
    };
    let weights = match forced {
        Some(streamed) => vec![streamed],
        // ZeRO-3 casts each gathered layer as it runs.
        None if mixed && stage3 => vec![true],
        None if mixed && !a.offload => vec![false, true],
        None => vec![false],
    };
    let scores = match forced_scores {
        Some(stored) => vec![stored],
        None if fused => vec![true, false],
        None => vec![false],
    };
    // (The layers' inputs alone: under checkpointing in bf16, and not
    // where BRAID_CKPT_ATTENTION keeps some layers' state.)
    let inputs_alone = match mixed && a.checkpointing && forced_keep.is_none_or(|k| k == 0) {
        true => forced_output,
        false => Some(false),
    };
    let forms = forms_fastest_first(&weights, &keeps, &scores, inputs_alone);
    let plan = |estimate,
                (
        streamed_weights,
        kept_attention,
        stored_score_grads,
        recompute_attention_output,
    )| {
        DevicePlan {
            estimate,
            streamed_weights,
            fused_attention: fused,
            stored_score_grads,
            kept_attention,
            recompute_attention_output,
            saved_in_grads,
            half_gathers,
            split_embeddings: split,
            per_ranks: Vec::new(),
        }
    };
    let Some(space) = space else {
        return Ok(plan(0, forms[0]));
    };
    let need_with = |b: usize,
                     checkpointing: bool,
                     (streamed_weights, kept_attention, stored_score_grads, recompute_output),
                     sharding: Sharding,
                     offload: bool| {
        let run = GpuRun {
            b,
            t: a.seq,
            mixed,
            fused_attention: fused,
            deferred,
            checkpointing,
            streamed_weights,
            stored_score_grads,
            kept_attention,
            recompute_attention_output: recompute_output,
            sharding,
            offload,
            saved_in_grads: saved_in_grads && lends_in(sharding, offload),
            half_gathers: half_gathers && sharding.stage == 3,
            split_embeddings: split_in(sharding, checkpointing),
            tensor: braid_model::footprint::TensorSplit::NONE,
        };
        let params = cfg.num_params() as u128;
        a.with_extras(
            gpu_training(cfg, &run),
            sharding,
            params,
            (b, 4 * cfg.n_embd),
        )
    };
    let need = |b: usize, checkpointing: bool, form| {
        need_with(b, checkpointing, form, a.sharding, a.offload)
    };
    if let Some((f, form)) = first_fit(&forms, &space, |form| need(batch, a.checkpointing, form)) {
        let mut chosen = plan(f.total(), form);
        if a.sharding.stage == 3 && !a.offload {
            chosen.per_ranks = [2, 4, 8]
                .into_iter()
                .map(|ranks| {
                    let s = Sharding { stage: 3, ranks };
                    (
                        ranks,
                        need_with(batch, a.checkpointing, form, s, false).total(),
                    )
                })
                .collect();
        }
        return Ok(chosen);
    }
    let form = *forms.last().expect("one form at least");
    let streamed = form.0;
    let f = need(batch, a.checkpointing, form);
    let room = space.room();
    let mut fits = Vec::new();
    if let Some(b) = largest_batch(room, batch, |b| need(b, a.checkpointing, form)) {
        fits.push(format!("--batch {b}"));
    }
    if mixed && !a.checkpointing {
        match largest_batch(room, batch, |b| need(b, true, form)) {
            Some(b) if b == batch => fits.push("--checkpointing".into()),
            Some(b) => fits.push(format!("--checkpointing --batch {b}")),
            None => {}
        }
    }
    for s in a.other_stages() {
        // ZeRO-3 casts each gathered layer: no whole bf16 copy.
        let form = match s.stage == 3 && mixed {
            true => (true, form.1, form.2, form.3),
            false => form,
        };
        if need_with(batch, a.checkpointing, form, s, false).total() <= room {
            fits.push(zero_flag(s));
            break;
        }
    }
    if !a.offload && a.sharding.stage == 0 {
        // Offloaded, the bf16 weights stay whole (not streamed).
        let whole = (false, form.1, form.2, form.3);
        let ckpts: &[bool] = match a.checkpointing {
            true => &[true],
            false => &[false, true],
        };
        for &ckpt in ckpts {
            if need_with(batch, ckpt, whole, a.sharding, true).total() <= room {
                fits.push(match ckpt && !a.checkpointing {
                    false => "--offload optimizer".into(),
                    true => "--offload optimizer --checkpointing".into(),
                });
                break;
            }
        }
    }
    let hint = match fits.is_empty() {
        false => format!("what would fit: {}", fits.join(" or ")),
        true => {
            // Model states per parameter: f32 weights and gradients, the
            // (sharded) moments and reduced-gradient shard, bf16 weights.
            let sh = a.sharding;
            let bf16 = if mixed && !streamed { 2.0 } else { 0.0 };
            let per = match a.offload {
                true if mixed => 4.0 + bf16,
                true => 8.0,
                false => 8.0 + sh.shard(8 << 20) as f64 / (1 << 20) as f64 + bf16,
            };
            let per = per
                + if sh.stage >= 2 {
                    4.0 / sh.ranks as f64
                } else {
                    0.0
                };
            format!(
                "even batch 1 does not fit: pick a model of at most about {:.2e} parameters \
                 (model states take {per:.1} bytes per parameter before activations)",
                room as f64 / per
            )
        }
    };
    Err(format!(
        "{} at batch {batch} x {} needs about {:.2} GiB on GPU {} ({} + workspace {:.2} GiB), \
         but there is {}; {hint}",
        a.model,
        a.seq,
        gib(f.total() + DEVICE_MARGIN),
        space.gpu,
        f.breakdown(),
        gib(DEVICE_MARGIN),
        space.said()
    ))
}

#[cfg(test)]
mod tests {
    use super::{Room, Shape};
    use braid_model::footprint::Sharding;
    use braid_model::GptConfig;

    /// Under `--tp` in bf16 the whole bf16 copy of the rank's share where
    /// it fits, else the weights cast layer by layer, else a refusal
    /// naming the leaner form; `BRAID_BF16_WEIGHTS` (`forced`) keeps its
    /// form or is refused. The 12.85B model at `--tp 4`, batch 8 with
    /// checkpointing: 64.92 GiB whole, 59.20 GiB cast (the estimates 4
    /// H100s printed, and peaked within 0.04 GiB of).
    /// The FP8 products' rooms count in the estimate: two operands of
    /// tokens × the MLP's width a GPU (or a tensor rank's share of it).
    #[test]
    fn the_fp8_products_rooms_are_counted() {
        use braid_model::cuda::model_mixed::Fp8Use;
        use braid_train::engines::Precision;
        let cfg = GptConfig::parse("L32-H32-C2560-V50304-T1024").unwrap();
        let (b, mlp) = (8usize, 4 * 2560usize);
        let est = |fp8, tensor| {
            let a = Shape {
                model: "L32-H32-C2560-V50304-T1024",
                tensor,
                fp8,
                ..shape(1, tensor, 0, true)
            };
            let room = || {
                Some(Room {
                    free: 1 << 40,
                    budget: None,
                    gpu: 0,
                })
            };
            match tensor {
                1 => super::device_in(&a, &cfg, (room(), true), Precision::Bf16, b, 0),
                _ => super::tensor_parallel(&a, &cfg, room(), (true, true, None), b, 0),
            }
            .unwrap()
            .estimate
        };
        for (tensor, widest) in [(1, mlp), (2, mlp / 2)] {
            let tp = tensor > 1;
            for fp8 in [Fp8Use::Forward, Fp8Use::All] {
                let rooms = fp8.room_bytes(b * 1024, widest, tp);
                assert_eq!(est(fp8, tensor) - est(Fp8Use::Off, tensor), rooms);
            }
            // Under tensor parallelism the backward pass stays bf16: no
            // third room.
            assert_eq!(
                est(Fp8Use::Forward, tensor) == est(Fp8Use::All, tensor),
                tp,
                "tensor {tensor}"
            );
        }
        // At 2.65B, 8 x 1024 tokens: rooms of 84 MB, two for the forward
        // pass, a third for the backward pass's `dy` transposed.
        let room = Fp8Use::Forward.room_bytes(b * 1024, mlp, false);
        assert!(
            room > 2 * 83_000_000 && room < 2 * 84_000_000 + 100_000,
            "{room}"
        );
        let all = Fp8Use::All.room_bytes(b * 1024, mlp, false);
        assert!(
            all > 3 * 83_000_000 && all < 3 * 84_000_000 + 100_000,
            "{all}"
        );
        assert_eq!(Fp8Use::Off.room_bytes(b * 1024, mlp, false), 0);
    }

    #[test]
    fn a_tensor_parallel_rank_casts_its_weights_only_where_the_copy_does_not_fit() {
        let cfg = GptConfig::parse("L40-H40-C5120-V50304-T1024").unwrap();
        let a = Shape {
            model: "L40-H40-C5120-V50304-T1024",
            checkpointing: true,
            tensor: 4,
            ..shape(1, 4, 0, true)
        };
        let gib = |g: f64| (g * (1u128 << 30) as f64) as u128;
        let room = |budget: Option<f64>| {
            Some(Room {
                free: gib(79.0),
                budget: budget.map(gib),
                gpu: 2,
            })
        };
        let plan =
            |space, forced| super::tensor_parallel(&a, &cfg, space, (true, true, forced), 8, 0);
        let whole = plan(room(None), None).unwrap();
        assert!(!whole.streamed_weights);
        let est = |p: &super::DevicePlan| braid_model::footprint::gib(p.estimate);
        assert!((est(&whole) - 64.92).abs() < 0.01, "{}", est(&whole));
        let cast = plan(room(Some(62.0)), None).unwrap();
        assert!(cast.streamed_weights);
        assert!((est(&cast) - 59.20).abs() < 0.01, "{}", est(&cast));
        // No free memory known: the fast form.
        assert!(!plan(None, None).unwrap().streamed_weights);
        assert!(plan(room(None), Some(true)).unwrap().streamed_weights);
        let e = plan(room(Some(62.0)), Some(false)).err().unwrap();
        assert!(
            e.contains("under --tp 4 needs about") && e.contains("--gpu-memory allows 62.00 GiB"),
            "{e}"
        );
        let e = plan(room(Some(50.0)), None).err().unwrap();
        assert!(
            e.contains("with the bf16 weights cast layer by layer needs about"),
            "{e}"
        );
        assert!(e.contains("on GPU 2"), "{e}");
    }

    fn shape(ranks: usize, local_workers: usize, stage: u8, plain_grads: bool) -> Shape<'static> {
        Shape {
            model: "124M",
            seq: 1024,
            checkpointing: false,
            sharding: Sharding { stage, ranks },
            ranks,
            local_workers,
            offload: false,
            accum: 1,
            tensor: 1,
            sequence: false,
            plain_grads,
            gpu_memory: None,
            fp8: braid_model::cuda::model_mixed::Fp8Use::Off,
        }
    }

    #[test]
    fn the_attention_is_kept_in_all_layers_none_or_a_number_of_them() {
        use super::parse_kept_attention as parse;
        assert_eq!(parse(None, 40), Ok(None));
        assert_eq!(parse(Some("auto"), 40), Ok(None));
        assert_eq!(parse(Some("kept"), 40), Ok(Some(40)));
        assert_eq!(parse(Some("recomputed"), 40), Ok(Some(0)));
        assert_eq!(parse(Some("7"), 40), Ok(Some(7)));
        assert_eq!(parse(Some("40"), 40), Ok(Some(40)));
        for bad in ["41", "-1", "some"] {
            let e = parse(Some(bad), 40).unwrap_err();
            assert!(e.contains("a number of layers from 0 to 40"), "{bad}: {e}");
        }
    }

    /// A budget bounds the estimate alone; the free memory bounds it with
    /// the workspace margin; the room is the tighter of the two.
    /// The forms run from the fastest to the leanest: the whole bf16 copy
    /// before streamed weights, more kept layers before fewer, stored
    /// score gradients before recomputed, and the layers' inputs alone
    /// last (or alone, or never, as the variable says).
    #[test]
    fn the_memory_forms_run_from_fastest_to_leanest() {
        use super::forms_fastest_first as forms;
        let all = forms(&[false, true], &[2, 0], &[true, false], None);
        assert_eq!(all.len(), 8 + 4);
        assert_eq!(all[0], (false, 2, true, false));
        assert_eq!(all[1], (false, 2, false, false));
        assert_eq!(all[2], (false, 0, true, false));
        assert_eq!(all[4], (true, 2, true, false));
        assert_eq!(
            &all[8..],
            &[
                (false, 0, true, true),
                (false, 0, false, true),
                (true, 0, true, true),
                (true, 0, false, true)
            ]
        );
        let only = forms(&[true], &[5], &[false], Some(true));
        assert_eq!(only, vec![(true, 0, false, true)]);
        let never = forms(&[true], &[5, 0], &[false], Some(false));
        assert!(never.iter().all(|f| !f.3) && never.len() == 2);
    }

    #[test]
    fn a_gpu_memory_budget_bounds_the_estimate() {
        use super::{Room, DEVICE_MARGIN};
        let gib = 1u128 << 30;
        let free = Room {
            free: 80 * gib,
            budget: None,
            gpu: 0,
        };
        assert!(free.fits(80 * gib - DEVICE_MARGIN));
        assert!(!free.fits(80 * gib - DEVICE_MARGIN + 1));
        assert_eq!(free.room(), 80 * gib - DEVICE_MARGIN);
        let budget = Room {
            budget: Some(52 * gib),
            ..free
        };
        assert!(budget.fits(52 * gib) && !budget.fits(52 * gib + 1));
        assert_eq!(budget.room(), 52 * gib);
        let unknown = Room {
            free: u128::MAX,
            budget: Some(52 * gib),
            gpu: 0,
        };
        assert!(unknown.fits(52 * gib) && !unknown.fits(53 * gib));
    }

    /// The copy-engine landing buffer: (N − 1)/N of an f32 per gradient
    /// element over 2 to 8 ranks of one host with plain gradients, none
    /// otherwise.
    #[test]
    fn the_landing_buffer_holds_what_the_other_ranks_send() {
        if std::env::var_os("BRAID_GPU_ALLREDUCE").is_some() {
            return; // (the choice decides; this test checks the default)
        }
        let params = 1_000_000u128;
        let none = Sharding { stage: 0, ranks: 1 };
        for n in 2..=8usize {
            let s = shape(n, n, 0, true);
            let want = 4 * (n as u128 - 1) * params.div_ceil(n as u128);
            assert_eq!(s.landing_bytes(none, params), want, "{n} ranks");
        }
        assert_eq!(shape(9, 9, 0, true).landing_bytes(none, params), 0);
        // Two hosts, ZeRO, a gradient hook: NCCL, no landing buffer.
        assert_eq!(shape(4, 2, 0, true).landing_bytes(none, params), 0);
        let z1 = Sharding { stage: 1, ranks: 4 };
        assert_eq!(shape(4, 4, 1, true).landing_bytes(z1, params), 0);
        assert_eq!(shape(4, 4, 0, false).landing_bytes(none, params), 0);
    }

    /// `BRAID_TEST_GPU_FREE`: a size read, a malformed one ignored (the
    /// one test that sets it; only runs on a GPU read it otherwise).
    #[test]
    fn the_test_free_memory_override_is_read_or_ignored() {
        let name = braid_core::env::BRAID_TEST_GPU_FREE;
        std::env::remove_var(name);
        assert_eq!(super::test_free_memory(), None);
        std::env::set_var(name, "8G");
        assert_eq!(super::test_free_memory(), Some(8u128 << 30));
        std::env::set_var(name, "lots");
        assert_eq!(super::test_free_memory(), None);
        std::env::remove_var(name);
    }
}
