//! `braid train`: braid-train's one training loop over the CPU or GPU
//! engine — in one process, or over several ranks, data-parallel or with
//! ZeRO's sharded optimizer (`train_strategy`; `--nproc N` starts them
//! here through the launcher; under `braid launch`, torchrun or SLURM
//! each process is one rank).

use super::train_output::{print_state, print_summary, write_json, Progress};
use super::train_strategy::{zero_stage, ShardChoice, ZeroFlags, ZERO_ALIGN};
use braid_comm::CommOptions;
use braid_core::env;
use braid_data::loader::WindowSource;
use braid_data::token_beton::BetonTokens;
use braid_data::tokens::{Dataset, Source, Tokenizer};
use braid_model::checkpoint;
use braid_model::config::GPT2_VOCAB;
use braid_model::footprint::Sharding;
use braid_model::optim::Schedule;
use braid_model::{GptConfig, Layout, Params};
use braid_train::checkpoint::load::resolve;
use braid_train::collective::GradComm;
use braid_train::ddp::DdpOptions;
use braid_train::engines::{CpuOptimizer, Precision, TokenBatch};
use braid_train::loader::{check_fits, TokenWindows};
use braid_train::{Checkpointable, Checkpoints, LoopOptions, RunReport, StepReport, Strategy};
use clap::Args;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

/// The training loop's run, given the progress printer, the loader and
/// the batch (each path wraps its engine and strategy in one).
/// `--bucket-mb`'s default (PyTorch DDP's).
const BUCKET_MB: f64 = 25.0;
/// `--first-bucket-mb`'s default (PyTorch DDP's).
const FIRST_BUCKET_MB: f64 = 1.0;

/// Option groups of `braid train --help`.
const H_MODEL: &str = "Model and data";
const H_RUN: &str = "Steps, batch and optimizer";
const H_DEVICE: &str = "Devices and processes";
const H_PARALLEL: &str = "Parallelism and communication";
const H_CKPT: &str = "Checkpoints";
const H_OUTPUT: &str = "Output and tracing";

/// Train a GPT model.
#[derive(Args)]
#[command(
    about = "Train a GPT-2 family model on CPUs or GPUs, in one process or distributed",
    long_about = "Train a GPT-2 family model on CPUs or GPUs: in one process, data-parallel over \
                  several (--nproc-per-node, or under braid launch, torchrun or SLURM), or \
                  sharded with ZeRO (--zero).",
    after_help = "Examples:
  braid train                                 # tiny model, built-in corpus, one process
  braid train --nproc-per-node 2              # data parallel over 2 local workers
(-h: the common options; --help: every option, by group)",
    after_long_help = "Examples:
  braid train                                   # tiny model, built-in corpus, one process
  braid train --nproc-per-node 2 --ckpt-dir ck --save-every 100 --resume auto
  braid data write --tokens text.txt d.beton && braid train --data d.beton
  braid train --nproc-per-node 4 --tp 2 --zero 1     # a mesh: data 2 x tensor 2
  braid train --model L4-H4-C128 --steps 1000 --save tiny.safetensors
  braid train --model 124M --data shards/ --batch 4 --seq 256
  braid train --model 124M --device cuda --nproc-per-node gpu --batch 16 --seq 1024 --data random
  braid launch --nnodes 2 ... -- braid train --device cuda --grad-comm bf16   # multi-node

Environment (for experiments; the defaults are chosen by the memory pre-flight):
  BRAID_SAVED_IN_GRADS=on|off       keep saved activations in idle gradient memory
  BRAID_CKPT_ATTENTION=kept|recomputed|auto|N
                                    with --checkpointing: keep or recompute the attention's state
                                    (N: kept in the last N layers)
  BRAID_SPLIT_REDUCE=on|off|auto    ZeRO-3: reduce-scatter the tied embeddings' gradients in two
                                    parts (under --checkpointing)
  BRAID_ZERO3_SPARES=kept|capped|auto
                                    ZeRO-3: keep every freed block buffer for reuse, or at most 4
                                    (auto: capped; copy-engine gathers always keep them)
  BRAID_ZERO3_GATHER_VIA=auto|ce|nccl
                                    ZeRO-3 on GPUs: gather the layers with NCCL's copy engines
                                    (NCCL 2.28, one host), or its kernels (auto: the copy engines
                                    where every rank can have them)
  BRAID_FLASH_FORWARD=auto|mma|wgmma|wgmma2, BRAID_FLASH_BACKWARD=auto|mma|wgmma
                                    the attention's forward or backward kernels on mma.sync tiles,
                                    or Hopper's warpgroup products (compute capability 9.0 only)
                                    (auto: wgmma2 and wgmma on 9.0, mma elsewhere)
  BRAID_TP_SUMS=bf16|f32            --tp, bf16 on GPUs: the dtype of the row-split products' sums
  BRAID_TP_GRAD_OVERLAP=on|off      --tp, bf16 on GPUs: sum input gradients beside the weight
                                    gradients (on)
  BRAID_TIMEOUT=SECONDS             how long any collective or device wait may take"
)]
pub struct TrainArgs {
    /// tiny, gpt2 (124M) to gpt2-xl (1558M), or L-H-C[-V][-T].
    ///
    /// Named sizes: tiny (2 layers, width 64, vocabulary 256), 124M, 350M, 774M and 1558M (GPT-2
    /// small to XL; also called gpt2, gpt2-medium, gpt2-large, gpt2-xl). Custom:
    /// L<layers>-H<heads>-C<width>[-V<vocab>][-T<context>], e.g. L4-H4-C128. A model that names
    /// no vocabulary (no -V) takes the data's when the data's is larger.
    ///
    /// Default: tiny; with --resume, the checkpoint's model.
    #[arg(long, help_heading = H_MODEL)]
    model: Option<String>,
    /// synthetic, random, a text file, token shards or a .beton.
    ///
    /// synthetic: a built-in corpus (the same for a seed as `braid data write --tokens
    /// synthetic`); random: uniform tokens, for throughput; a UTF-8 text file; u16 token shards
    /// (.bin file or directory); or a .beton file of token windows (braid data write --tokens).
    #[arg(long, default_value = "synthetic", help_heading = H_MODEL)]
    data: String,
    /// bytes or gpt2 (default: the data's, else bytes for a 256-token vocabulary, else gpt2).
    #[arg(long, hide_short_help = true, help_heading = H_MODEL)]
    tokenizer: Option<String>,
    /// Tokens per sequence (default: a .beton's windows, else 64).
    ///
    /// At most the model's context; a .beton file's windows, capped at the context, by default.
    #[arg(long, help_heading = H_MODEL)]
    seq: Option<usize>,
    /// Seed of initialisation, data order and sampling (one default across braid's commands).
    #[arg(long, default_value_t = super::DEFAULT_SEED, hide_short_help = true,
          help_heading = H_MODEL)]
    seed: u64,

    /// Training steps.
    #[arg(long, default_value_t = 400, help_heading = H_RUN)]
    steps: usize,
    /// Sequences per micro-batch on each rank.
    #[arg(long, default_value_t = 16, help_heading = H_RUN)]
    batch: usize,
    /// Sequences per step over all ranks and micro-batches, instead of --batch.
    ///
    /// Must divide by ranks x --accum.
    #[arg(long, hide_short_help = true, help_heading = H_RUN)]
    global_batch: Option<usize>,
    /// Micro-batches per step (gradient accumulation: only the last one communicates).
    #[arg(long, default_value_t = 1, hide_short_help = true, help_heading = H_RUN)]
    accum: usize,
    /// Peak learning rate (default: by model size).
    ///
    /// Default: 3e-3 below 50M parameters, then GPT-3's choices: 6e-4 for 124M, 3e-4 for 350M,
    /// 2.5e-4 for 774M, 2e-4 above.
    #[arg(long, help_heading = H_RUN)]
    lr: Option<f32>,
    /// Warmup steps.
    #[arg(long, default_value_t = 20, hide_short_help = true, help_heading = H_RUN)]
    warmup: usize,
    /// Weight decay on matrices and embeddings.
    #[arg(long, default_value_t = 0.1, hide_short_help = true, help_heading = H_RUN)]
    weight_decay: f32,
    /// Clip the gradients' global norm (0: off).
    #[arg(long, default_value_t = 1.0, hide_short_help = true, help_heading = H_RUN)]
    grad_clip: f64,
    /// adamw or sgd.
    #[arg(long, default_value = "adamw", hide_short_help = true, help_heading = H_RUN)]
    optimizer: String,
    /// Time forward + backward only, no optimizer step (a benchmark).
    #[arg(long, hide_short_help = true, help_heading = H_RUN)]
    fwd_bwd_only: bool,

    /// auto (a GPU if there is one), cpu, or cuda.
    ///
    /// auto trains on the GPUs when this machine has enough of them for its workers (one GPU
    /// per process, LOCAL_RANK picks it) and says so at start; cpu and cuda choose.
    #[arg(long, default_value = "auto", help_heading = H_DEVICE)]
    device: String,
    /// Local workers (data parallel): N, auto, gpu or cpu.
    ///
    /// The worker processes are started through braid launch; under braid launch, torchrun or
    /// SLURM each process is one rank already. auto: one per GPU if there are GPUs, else one
    /// per core.
    #[arg(long = "nproc-per-node", visible_alias = "nproc",
          aliases = ["nproc_per_node", "np"], value_name = "N", value_parser = super::parse_nproc,
          help_heading = H_DEVICE)]
    nproc: Option<super::Nproc>,
    /// GPU arithmetic: bf16 (mixed precision, the default) or f32.
    ///
    /// bf16: bf16 products and activations, f32 master weights. The CPU engine is f32.
    #[arg(long, hide_short_help = true, help_heading = H_DEVICE)]
    precision: Option<String>,
    /// Recompute activations in the backward pass instead of keeping them.
    ///
    /// Less memory, more compute. On a GPU (bf16) layers keep their input, attention output
    /// and, where it fits, the attention's state; each block's backward pass runs two of its
    /// four products and a LayerNorm again.
    #[arg(long, help_heading = H_DEVICE)]
    checkpointing: bool,
    /// Move model state to host memory: optimizer or none.
    ///
    /// optimizer keeps the f32 master weights and AdamW's moments in host memory and runs the
    /// update on the CPU's cores (ZeRO-Offload's split: 12 bytes per parameter leave the GPU).
    /// GPU only, one process or data-parallel.
    #[arg(long, default_value = "none", value_name = "WHAT", hide_short_help = true,
          help_heading = H_DEVICE)]
    offload: String,
    /// Fit each GPU's training memory within this many GiB (default: what is free).
    ///
    /// The memory pre-flight drops what only buys speed until its estimate of the peak (model
    /// states, activations, scratch: what the run's summary reports as peak device memory)
    /// fits: under --checkpointing the attention's kept state layer by layer, the stored score
    /// gradients, a full bf16 weight copy (under --tp a rank's share of it; under --pp each
    /// rank for its own stages), and last under --checkpointing each layer's saved attention
    /// output (the layers then save their input alone). A run that cannot fit is refused at
    /// start with what would.
    #[arg(long, value_name = "GIB", hide_short_help = true, help_heading = H_DEVICE)]
    gpu_memory: Option<f64>,

    /// Shard model states over the ranks: ZeRO stage 1, 2 or 3.
    ///
    /// 1: optimizer state sharded (gradients reduce-scattered after the backward pass,
    /// parameters all-gathered after every update); 2: gradients reduce-scattered bucket by
    /// bucket during the backward pass too; 3: parameters sharded as well, each block gathered
    /// just before it runs and freed after.
    #[arg(long, value_name = "STAGE", help_heading = H_PARALLEL)]
    zero: Option<u8>,
    /// FSDP: an alias of --zero 3.
    #[arg(long, hide_short_help = true, help_heading = H_PARALLEL)]
    fsdp: bool,
    /// With --zero 3: keep gathered parameters from forward to backward.
    ///
    /// FSDP2's reshard_after_forward=False: one gather per block and step instead of two, the
    /// whole model's parameters held at the peak.
    #[arg(long, hide_short_help = true, help_heading = H_PARALLEL)]
    no_reshard_after_forward: bool,
    /// With --zero: shard within groups of N ranks, replicate across them (HSDP).
    #[arg(long, value_name = "N", hide_short_help = true, help_heading = H_PARALLEL)]
    shard_group: Option<usize>,
    /// Tensor parallelism: every layer split over groups of N ranks.
    ///
    /// Megatron's split: attention heads and MLP columns over the group, the vocabulary too;
    /// the rest of the world is data parallel over the groups (with --zero over the data
    /// dimension). N must divide the heads and the workers of a node.
    #[arg(long, value_name = "N", default_value_t = 1, help_heading = H_PARALLEL)]
    tp: usize,
    /// With --tp: no sequence parallelism (LayerNorms on every row on every rank).
    ///
    /// Sequence parallelism (the default with --tp, except in a pipeline's GPU stages) runs the
    /// LayerNorms, residual adds and position embedding on a slice of the rows: those
    /// activations shrink by N. Without it the bf16 GPU engine gathers no LayerNorm output in
    /// its backward pass (2 % faster at 2.65B --tp 4 on 4 H100s, 7.6 GiB more per GPU).
    #[arg(long, hide_short_help = true, conflicts_with = "sp", help_heading = H_PARALLEL)]
    no_sp: bool,
    /// With --tp: sequence parallelism (the default, except in a pipeline's GPU stages: there
    /// bf16 takes it on this flag, f32 refuses it).
    #[arg(long, hide_short_help = true, help_heading = H_PARALLEL)]
    sp: bool,
    /// Pipeline parallelism: the layers cut into stages over N ranks.
    ///
    /// Micro-batches flow through the stages as --schedule says; the rest of the world is
    /// data parallel over whole pipelines.
    #[arg(long, value_name = "N", default_value_t = 1, help_heading = H_PARALLEL)]
    pp: usize,
    /// With --pp: micro-batches per step (the batch per rank splits into them; default 2 x --pp).
    #[arg(long, value_name = "M", hide_short_help = true, help_heading = H_PARALLEL)]
    micro_batches: Option<usize>,
    /// With --pp: gpipe, 1f1b, interleaved[:V], zb (ZB-H1), zb-h2, interleaved-zb[:V], or a
    /// schedule file.
    ///
    /// Default: 1f1b.
    #[arg(long, value_name = "S", hide_short_help = true, help_heading = H_PARALLEL)]
    schedule: Option<String>,
    /// With --pp: each stage's layer count, e.g. 3,5,5,3 (default: balanced).
    #[arg(long, value_name = "N,N,..", hide_short_help = true, help_heading = H_PARALLEL)]
    stage_layers: Option<String>,
    /// Gradients on the wire: plain (f32), bf16, fp16, or powersgd[:RANK[:START]].
    ///
    /// powersgd takes PyTorch's defaults: rank 1, from step 1000.
    #[arg(long, default_value = "plain", hide_short_help = true, help_heading = H_PARALLEL)]
    grad_comm: String,
    /// Gradient bucket size in MiB (data parallelism and --zero 1).
    #[arg(long, default_value_t = BUCKET_MB, hide_short_help = true, help_heading = H_PARALLEL)]
    bucket_mb: f64,
    /// First bucket's size in MiB.
    #[arg(long, default_value_t = FIRST_BUCKET_MB, hide_short_help = true,
          help_heading = H_PARALLEL)]
    first_bucket_mb: f64,
    /// Reduce gradients after the backward pass, not during it (to measure the overlap).
    #[arg(long, hide_short_help = true, help_heading = H_PARALLEL)]
    no_overlap: bool,
    /// GPU, bf16: run the first N layers' weight gradients after the embeddings' backward.
    ///
    /// So that the embeddings' gradient reduction (the largest, final only at the end)
    /// overlaps them. Default: 2 when data-parallel, else 0.
    #[arg(long, value_name = "N", hide_short_help = true, help_heading = H_PARALLEL)]
    defer_layers: Option<usize>,

    /// Start from this model file (safetensors) instead of a fresh initialisation.
    #[arg(long, value_name = "FILE", hide_short_help = true, help_heading = H_CKPT)]
    load: Option<PathBuf>,
    /// Save the trained model (safetensors, Hugging Face GPT-2 names) here.
    #[arg(long, value_name = "FILE", help_heading = H_CKPT)]
    save: Option<PathBuf>,
    /// Element type of --save: f32 or bf16.
    #[arg(long, default_value = "f32", hide_short_help = true, help_heading = H_CKPT)]
    save_dtype: String,
    /// Sharded checkpoints go here (at the end; see --save-every).
    ///
    /// One step-NNNNNNNN directory per save: every rank's parameters and optimizer state, the
    /// trainer's state, a manifest.
    #[arg(long, value_name = "DIR", help_heading = H_CKPT)]
    ckpt_dir: Option<PathBuf>,
    /// Save a checkpoint into --ckpt-dir every K steps (in the background).
    #[arg(long, value_name = "K", default_value_t = 0, hide_short_help = true,
          help_heading = H_CKPT)]
    save_every: usize,
    /// Keep only the N newest checkpoints in --ckpt-dir (0: all).
    #[arg(long, value_name = "N", default_value_t = 0, hide_short_help = true,
          help_heading = H_CKPT)]
    keep: usize,
    /// Resume from a checkpoint directory, a --ckpt-dir (its newest), or auto.
    ///
    /// auto: --ckpt-dir's newest if there is one, else start afresh. Any world size and
    /// strategy: the state is resharded.
    #[arg(long, value_name = "DIR|auto", help_heading = H_CKPT)]
    resume: Option<String>,
    /// Write each checkpoint before training goes on, not in the background.
    #[arg(long, hide_short_help = true, help_heading = H_CKPT)]
    ckpt_sync: bool,

    /// Print a progress line every K steps (default: about once a second).
    #[arg(long, value_name = "K", hide_short_help = true, help_heading = H_OUTPUT)]
    log_every: Option<usize>,
    /// Evaluate on held-out data every K steps and at the end (0: never).
    #[arg(long, value_name = "K", default_value_t = 100, hide_short_help = true,
          help_heading = H_OUTPUT)]
    eval_every: usize,
    /// Every step and the run's summary as JSON (see --json in braid --help).
    #[arg(long, value_name = "FILE", num_args = 0..=1, default_missing_value = "-",
          value_parser = super::json_out::parse, help = super::json_out::HELP,
          help_heading = H_OUTPUT)]
    json: Option<super::json_out::JsonOut>,
    /// Trace every rank into DIR; `braid report DIR` analyses it.
    ///
    /// Chrome/Perfetto traces.
    ///
    /// Steps, data, forward and backward per block, collectives, optimizer, checkpoint copies,
    /// idle gaps; GPU work timed with CUDA events; clocks aligned through the store; merged into
    /// DIR/trace.json.
    #[arg(long, value_name = "DIR", help_heading = H_OUTPUT)]
    trace: Option<PathBuf>,
    /// Serve live Prometheus metrics at HOST:PORT (each local rank on PORT + its rank).
    #[arg(long, value_name = "HOST:PORT", hide_short_help = true, help_heading = H_OUTPUT)]
    metrics_addr: Option<String>,
}

/// The tokenizer: the one asked for, else the one the checkpoint names,
/// else bytes for vocabularies of up to 256 and GPT-2's above.
pub(super) fn tokenizer_for(
    explicit: Option<&str>,
    saved: Option<&String>,
    vocab: usize,
) -> Result<Tokenizer, String> {
    match explicit.or(saved.map(|s| s.as_str())) {
        Some(t) => Tokenizer::parse(t),
        None if vocab <= 256 => Ok(Tokenizer::Bytes),
        None => Ok(Tokenizer::Gpt2),
    }
}

/// The CPU engine's optimizer for `--optimizer` with `weight_decay`.
pub(super) fn cpu_optimizer(kind: OptimizerKind, weight_decay: f32) -> CpuOptimizer {
    match kind {
        OptimizerKind::AdamW => CpuOptimizer::AdamW { weight_decay },
        OptimizerKind::Sgd => CpuOptimizer::Sgd { weight_decay },
    }
}

/// `BRAID_UPDATE_BESIDE` is gone: ZeRO-3's update queued beside the next
/// forward pass measured no faster on 4 H100s at 12.85B (the forward
/// pass's products leave AdamW no idle SMs; `BENCHMARKS.md`) and was
/// removed. `off`, what it did by default, is still accepted; anything
/// else is refused rather than silently ignored.
fn update_beside_removed() -> Result<(), String> {
    match std::env::var(env::BRAID_UPDATE_BESIDE)
        .as_deref()
        .map(str::trim)
    {
        Err(_) | Ok("" | "off") => Ok(()),
        Ok(v) => Err(format!(
            "BRAID_UPDATE_BESIDE={v}: ZeRO-3's update beside the forward pass was removed \
             (measured no faster; BENCHMARKS.md); unset the variable"
        )),
    }
}

/// `BRAID_ZERO3_GATHER_VIA` checked at start: a known value, and `ce`
/// only for ZeRO-3 on GPUs with no other `NCCL_CTA_POLICY` in its way
/// (the workers check the rest: their NCCL, and that all ranks can).
fn gather_via_checked(zero: Option<u8>, cuda: bool) -> Result<(), String> {
    use braid_train::collective::zero_cta;
    gather_via_checked_given(
        std::env::var(zero_cta::GATHER_VIA_VAR).ok().as_deref(),
        zero_cta::policy_from_env().as_deref(),
        zero,
        cuda,
    )
}

fn gather_via_checked_given(
    via: Option<&str>,
    policy: Option<&str>,
    zero: Option<u8>,
    cuda: bool,
) -> Result<(), String> {
    use braid_train::collective::zero_cta::{self, GatherVia};
    if GatherVia::parse(via)? != GatherVia::CopyEngines {
        return Ok(());
    }
    if zero != Some(3) || !cuda {
        return Err(
            "BRAID_ZERO3_GATHER_VIA=ce: copy-engine gathers are ZeRO-3's on GPUs (--zero 3 or \
             --fsdp, with --device cuda); drop the variable or add them"
                .into(),
        );
    }
    match zero_cta::copy_engines_refused(policy) {
        Some(refusal) => Err(refusal),
        None => Ok(()),
    }
}

/// `--gpu-memory GIB` in bytes: GPU runs only, a positive size.
fn gpu_memory_budget(a: &TrainArgs, cuda: bool) -> Result<Option<u128>, String> {
    let Some(g) = a.gpu_memory else {
        return Ok(None);
    };
    if !cuda {
        return Err(format!(
            "--gpu-memory {g}: a budget for GPU memory (add --device cuda, or drop it)"
        ));
    }
    if !(g.is_finite() && g > 0.0) {
        return Err(format!(
            "--gpu-memory {g}: expected a positive number of GiB"
        ));
    }
    Ok(Some((g * (1u64 << 30) as f64) as u128))
}

/// Whether a `--tp` run splits its sequence over the tensor group, and a
/// note where the default is off. Sequence parallelism is the default
/// with `--tp`, except in a pipeline's GPU stages: in bf16 it is there on
/// `--sp` only (a micro-batch's rows are few, and its extra collectives
/// measured 15 % slower at 2.65B `--tp 2 --pp 2` on 4 H100s, for 0.7 GiB);
/// the f32 stages do not have it (`--sp` refused). Where the default is
/// off the run says so.
fn sequence_parallel(
    a: &TrainArgs,
    cuda: bool,
    precision: Precision,
) -> Result<(bool, Option<String>), String> {
    if a.tp <= 1 && a.sp {
        return Err(
            "--sp: sequence parallelism splits each tensor group's rows; it needs --tp N with N \
             above 1"
                .into(),
        );
    }
    if a.tp <= 1 || a.no_sp {
        return Ok((false, None));
    }
    let run = format!("--tp {} --pp {}", a.tp, a.pp);
    match (cuda && a.pp > 1, precision, a.sp) {
        (false, _, _) | (true, Precision::Bf16, true) => Ok((true, None)),
        (true, Precision::F32, true) => Err(format!(
            "--sp with {run} --precision f32: a pipeline's f32 GPU stages run their \
             tensor-parallel passes without it (drop --sp, or train in bf16)"
        )),
        (true, Precision::F32, false) => Ok((
            false,
            Some(format!(
                "sequence parallelism: off for {run} --precision f32 (a pipeline's f32 GPU \
                 stages run their tensor-parallel passes without it; --no-sp says so and \
                 silences this)"
            )),
        )),
        (true, Precision::Bf16, false) => Ok((
            false,
            Some(format!(
                "sequence parallelism: off for {run} by default (a micro-batch's rows are few: \
                 its extra collectives measured 15 % slower at 2.65B --tp 2 --pp 2 on 4 H100s; \
                 --sp turns it on, --no-sp silences this)"
            )),
        )),
    }
}

/// How many layers defer their weight gradients (`--defer-layers`; by
/// default 2 in bf16 when data-parallel, so the embeddings' reduction
/// overlaps them, else none).
fn defer_layers(asked: Option<usize>, precision: Precision, ranks: usize, layers: usize) -> usize {
    match (asked, precision) {
        (Some(n), _) => n,
        (None, Precision::Bf16) if ranks > 1 => 2.min(layers),
        (None, _) => 0,
    }
}

/// The default peak learning rate for a model of `params` parameters: the
/// small models' 3e-3 below 50M, then the GPT-3 paper's rates for the
/// GPT-2 sizes (Brown et al. 2020, table 2.1), which keep 124M and larger
/// stable with AdamW.
pub fn default_lr(params: usize) -> f32 {
    match params {
        p if p < 50_000_000 => 3e-3,
        p if p < 200_000_000 => 6e-4,
        p if p < 500_000_000 => 3e-4,
        p if p < 1_000_000_000 => 2.5e-4,
        _ => 2e-4,
    }
}

/// Which optimizer to train with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OptimizerKind {
    AdamW,
    Sgd,
}

/// This process's place in a distributed run, when it is one.
fn world() -> Result<Option<braid_core::WorldInfo>, String> {
    if std::env::var_os(env::WORLD_SIZE).is_none() {
        return Ok(None);
    }
    braid_core::WorldInfo::from_env()
        .map(Some)
        .map_err(|e| e.to_string())
}

/// Shares this machine's cores between the workers on it (unless
/// `RAYON_NUM_THREADS` says otherwise): the CPU engine's thread pool gets
/// cores / local workers threads.
fn share_cores(local_workers: usize) {
    if local_workers <= 1 || std::env::var_os(env::RAYON_NUM_THREADS).is_some() {
        return;
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = (cores / local_workers).max(1);
    // Fails only if the pool already exists; then it keeps its size.
    let _ = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_global();
}

/// The model a run trains: `--model`, else with `--resume` (and no
/// `--load`) the checkpoint's, else tiny; and, when it came from the
/// checkpoint, a note saying so.
fn model_of(a: &TrainArgs) -> Result<ModelChoice, String> {
    let dir = match (a.resume.as_deref(), &a.ckpt_dir, &a.load) {
        (Some(_), _, Some(_)) | (None, _, _) => None,
        (Some("auto"), Some(dir), None) => resolve(dir)?,
        (Some("auto"), None, None) => None,
        (Some(path), _, None) => resolve(Path::new(path))?,
    };
    let resumed = match &dir {
        Some(dir) => Some((
            dir.clone(),
            braid_train::checkpoint::CheckpointReader::open(dir)?
                .manifest()
                .run
                .clone(),
        )),
        None => None,
    };
    let saved = resumed
        .as_ref()
        .and_then(|(_, run)| run.get("model").and_then(|m| m.as_str()));
    let (name, note) = match (&a.model, saved, &resumed) {
        (Some(m), _, _) => (m.clone(), None),
        (None, Some(m), Some((dir, _))) => (
            m.to_string(),
            Some(format!(
                "model {m} from the checkpoint {} (--model chooses another)",
                dir.display()
            )),
        ),
        _ => (DEFAULT_MODEL.to_string(), None),
    };
    Ok(ModelChoice {
        name,
        note,
        resumed,
    })
}

/// The model a run trains, and the checkpoint it resumes (its directory
/// and its run's description), when it resumes one.
struct ModelChoice {
    name: String,
    note: Option<String>,
    resumed: Option<(PathBuf, serde_json::Value)>,
}

/// Refuses to resume a checkpoint of another model than `cfg`, naming
/// the checkpoint's (before the first step, rather than at the first
/// tensor that differs).
fn same_model_as_checkpoint(
    cfg: &GptConfig,
    model: &str,
    resumed: Option<&(PathBuf, serde_json::Value)>,
) -> Result<(), String> {
    let Some((dir, run)) = resumed else {
        return Ok(());
    };
    let saved: Option<GptConfig> = run
        .get("config")
        .and_then(|c| serde_json::from_value(c.clone()).ok());
    match saved {
        Some(saved) if saved != *cfg => Err(format!(
            "--resume {}: a checkpoint of a different model ({} layers, {} heads, width {}, vocab \
             {}, context {}: --model {}), not {model}'s ({} layers, {} heads, width {}, vocab \
             {}, context {}): leave --model out to train the checkpoint's",
            dir.display(),
            saved.n_layer,
            saved.n_head,
            saved.n_embd,
            saved.vocab_size,
            saved.context,
            run.get("model").and_then(|m| m.as_str()).unwrap_or("?"),
            cfg.n_layer,
            cfg.n_head,
            cfg.n_embd,
            cfg.vocab_size,
            cfg.context,
        )),
        _ => Ok(()),
    }
}

/// `--model`'s default.
const DEFAULT_MODEL: &str = "tiny";

/// Refuses paths of the wrong kind before anything else is read or
/// printed: `--load` a file that is there, `--trace` and `--ckpt-dir`
/// directories (or not there yet).
fn paths_checked(a: &TrainArgs) -> Result<(), String> {
    if let Some(load) = &a.load {
        if load.is_dir() {
            return Err(format!(
                "--load {}: a directory; --load takes a safetensors file (`braid train --save`, \
                 `braid ckpt consolidate`, a Hugging Face model.safetensors). A --ckpt-dir goes \
                 on with --resume {}",
                load.display(),
                load.display()
            ));
        }
        if !load.exists() {
            return Err(format!(
                "--load {}: no such file (--load takes a safetensors file: `braid train --save`, \
                 `braid ckpt consolidate`, a Hugging Face model.safetensors)",
                load.display()
            ));
        }
    }
    for (flag, dir) in [("--trace", &a.trace), ("--ckpt-dir", &a.ckpt_dir)] {
        if let Some(d) = dir.as_deref().filter(|d| d.exists() && !d.is_dir()) {
            return Err(format!(
                "{flag} {}: could not be created: a file is there ({flag} names a directory)",
                d.display()
            ));
        }
    }
    Ok(())
}

/// Runs `braid train`.
pub fn run_train(a: TrainArgs) -> Result<i32, String> {
    paths_checked(&a)?;
    let ModelChoice {
        name: model,
        note: model_note,
        resumed,
    } = model_of(&a)?;
    let optimizer = match a.optimizer.as_str() {
        "adamw" => OptimizerKind::AdamW,
        "sgd" => OptimizerKind::Sgd,
        o => return Err(format!("--optimizer {o:?}: expected adamw or sgd")),
    };
    for (flag, value) in [
        ("--batch", a.batch),
        ("--seq", a.seq.unwrap_or(1)),
        ("--steps", a.steps),
        ("--accum", a.accum),
    ] {
        if value == 0 {
            return Err(format!(
                "{flag} 0: use 1 or more (--batch, --seq, --steps and --accum must be positive)"
            ));
        }
    }
    if a.global_batch == Some(0) {
        return Err("--global-batch 0: use 1 or more sequences per step".into());
    }
    // Non-negative, finite numbers (0: no learning, no decay, no clipping).
    for (flag, value) in [
        ("--lr", a.lr.map_or(0.0, f64::from)),
        ("--weight-decay", f64::from(a.weight_decay)),
        ("--grad-clip", a.grad_clip),
    ] {
        if !(value.is_finite() && value >= 0.0) {
            return Err(format!(
                "{flag} {value}: expected a finite number >= 0 (0 turns it off)"
            ));
        }
    }
    match (braid_core::DType::parse(&a.save_dtype), &a.save) {
        (Ok(braid_core::DType::F32), _) => {}
        (Ok(braid_core::DType::BF16), Some(_)) => {}
        (Ok(braid_core::DType::BF16), None) => {
            return Err(format!(
                "--save-dtype {}: the element type of --save FILE, and this run saves no model \
                 file: add --save FILE, or drop --save-dtype",
                a.save_dtype
            ))
        }
        _ => {
            return Err(format!(
                "--save-dtype {:?}: expected f32 or bf16 (what a checkpoint stores)",
                a.save_dtype
            ))
        }
    }
    if a.resume.as_deref() == Some("auto") && a.ckpt_dir.is_none() {
        return Err(
            "--resume auto resumes from --ckpt-dir's newest checkpoint: give --ckpt-dir DIR too \
             (or --resume DIR for one checkpoint)"
                .into(),
        );
    }
    if a.ckpt_dir.is_none() && (a.save_every > 0 || a.keep > 0) {
        // (Said before the run starts, not after its data is read.)
        return Err(
            "--save-every and --keep need --ckpt-dir DIR (where the checkpoints go)".into(),
        );
    }
    let world = world()?;
    // A tensor-parallel run started alone starts its group.
    let nproc = match (a.nproc, a.tp * a.pp, &world) {
        (None, model, None) if model > 1 => Some(model),
        (n, _, _) => n.map(|n| n.count()).transpose()?,
    };
    // Workers on this node: the launcher's, or those --nproc-per-node starts.
    let local_workers = match &world {
        Some(w) => w.local_world_size,
        None => nproc.unwrap_or(1),
    };
    let device = super::Device::resolve(&a.device, local_workers)?;
    let cuda = device.cuda;
    if a.pp > 1 {
        let not_yet = |what: &str| {
            Err(format!(
                "--pp {} with {what}: not built yet (pipelines compose with data parallelism, \
                 ZeRO, --tp and checkpoints)",
                a.pp
            ))
        };
        if let (Some(z @ (2 | 3)), true) = (a.zero.or(a.fsdp.then_some(3)), cuda) {
            return Err(format!(
                "--pp {} with --zero {z} on GPUs: not built yet (the CPU stages take it). --zero \
                 1 shards the optimizer state over the data dimension of a GPU pipeline",
                a.pp
            ));
        }
        if a.offload != "none" {
            return not_yet("--offload");
        }
        if a.accum > 1 {
            return Err(format!(
                "--accum {} with --pp {}: a pipeline's step is its --micro-batches already (use \
                 --micro-batches for more of them)",
                a.accum, a.pp
            ));
        }
    }
    if a.pp <= 1 {
        for (flag, given) in [
            ("--schedule", a.schedule.clone()),
            ("--micro-batches", a.micro_batches.map(|m| m.to_string())),
            ("--stage-layers", a.stage_layers.clone()),
        ] {
            if let Some(v) = given {
                return Err(format!(
                    "{flag} {v}: a pipeline's setting, and this run has no pipeline: add --pp N \
                     (N stages, at least 2), or drop {flag}"
                ));
            }
        }
    }
    if a.tp > 1 && a.offload != "none" {
        return Err(format!(
            "--tp {} with --offload {}: the offloaded optimizer is not built for tensor \
             parallelism (drop one of them)",
            a.tp, a.offload
        ));
    }
    let precision = match (cuda, a.precision.as_deref()) {
        (true, p) => Precision::parse(p.unwrap_or("bf16"))?,
        (false, Some(p)) if Precision::parse(p) != Ok(Precision::F32) => {
            return Err(format!(
                "--precision {p}: the CPU engine trains in f32 (use --device cuda for bf16)"
            ))
        }
        (false, _) => Precision::F32,
    };
    let (sequence, sequence_note) = sequence_parallel(&a, cuda, precision)?;
    let gpu_memory = gpu_memory_budget(&a, cuda)?;
    if cuda && a.checkpointing && precision != Precision::Bf16 {
        return Err(format!(
            "--checkpointing: the GPU engine recomputes blocks in bf16 only (drop \
             --precision {} or the flag)",
            precision.name()
        ));
    }
    if cuda && optimizer != OptimizerKind::AdamW {
        return Err("--device cuda trains with adamw only (so far)".into());
    }
    let grad_comm = GradComm::parse(&a.grad_comm)?;
    super::train_ckpt::check_outputs(&[
        ("--save", a.save.as_deref()),
        ("--json", a.json.as_ref().and_then(|j| j.path())),
    ])?;
    let zero = zero_stage(&ZeroFlags {
        zero: a.zero,
        fsdp: a.fsdp,
        shard_group: a.shard_group,
        keep_params: a.no_reshard_after_forward,
        grad_comm: (&a.grad_comm, grad_comm),
        defer_layers: a.defer_layers,
        buckets: a.bucket_mb != BUCKET_MB || a.first_bucket_mb != FIRST_BUCKET_MB,
    })?;
    let offload =
        match a.offload.as_str() {
            "none" => false,
            "optimizer" => true,
            "params" => return Err(
                "--offload params (the weights in host memory too, streamed to the GPU block by \
                 block) is not built yet: it comes with ZeRO-3 on the GPU; --offload optimizer \
                 moves 12 of the 18 bytes per parameter off the GPU"
                    .into(),
            ),
            other => return Err(format!("--offload {other:?}: expected none or optimizer")),
        };
    if offload && !cuda {
        return Err(
            "--offload optimizer moves model state from the GPU to host memory; with --device cpu \
             it is all in host memory already (drop the flag)"
                .into(),
        );
    }
    if let (true, Some(stage)) = (offload, zero) {
        return Err(format!(
            "--offload optimizer with --zero {stage} is not built yet (the sharded stages gather \
             parameters that live on the GPU): train data-parallel with the offload, or sharded \
             without it"
        ));
    }
    if let (Some(n), None) = (nproc, &world) {
        // What --tp cannot do, said once here rather than by every worker.
        if a.tp > 1 || a.pp > 1 {
            super::train_mesh::Place {
                world: n,
                rank: 0,
                tensor: a.tp,
                pipe: a.pp,
                sequence,
                shard_group: a.shard_group,
            }
            .check(n)?;
            if a.tp > 1 {
                super::train_mesh::tensor_overlap_blocks()?;
                super::train_mesh::tensor_sums_in_bf16()?;
                super::train_mesh::tensor_grad_sums_beside()?;
                super::train_mesh::sequence_knobs(
                    sequence && cuda && precision == Precision::Bf16,
                )?;
            }
            if a.pp > 1 {
                // The schedule and the stages, checked once here.
                let flags = pipe_flags(&a);
                // A rank's batch: --batch, or its share of --global-batch
                // (a share that does not divide is refused below).
                let data = n / (a.tp * a.pp);
                let batch = match a.global_batch {
                    Some(g) if g % (data * a.accum) == 0 => Some(g / (data * a.accum)),
                    Some(_) => None,
                    None => Some(a.batch),
                };
                let cfg = match &a.load {
                    None => Some(GptConfig::parse(&model)?),
                    Some(_) => None,
                };
                super::train_pipeline::checked(&flags, cfg.as_ref(), &model, batch)?;
                // The pipeline's environment choices, once here too.
                for (var, yes, no) in [
                    (env::BRAID_PP_EMBEDDINGS, "last", "first"),
                    (env::BRAID_CKPT_ATTENTION_OUTPUT, "recomputed", "kept"),
                ] {
                    super::preflight::env_choice(var, yes, no)?;
                }
            }
            if a.load.is_none() {
                let cfg = GptConfig::parse(&model)?;
                braid_model::layout::TensorShard {
                    rank: 0,
                    size: a.tp,
                }
                .check(&cfg)?;
            }
        }
        if cuda {
            braid_model::cuda::flash::FlashKernels::check_env().map_err(|e| e.to_string())?;
            let gpus = super::gpus_for(&a.device)?;
            if n > gpus {
                return Err(format!(
                    "--nproc-per-node {n} with --device cuda needs {n} GPUs, but this machine has \
                     {gpus} (one GPU per process: use --nproc-per-node {gpus} or fewer)"
                ));
            }
        }
        // Said once here too, not by every worker.
        update_beside_removed()?;
        gather_via_checked(zero, cuda)?;
        // `--zero S --nproc 1`: a world of one rank, sharded over itself.
        if n > 1 || zero.is_some() {
            // JSON on stdout reaches it unprefixed.
            let json_stdout = a.json.as_ref().is_some_and(|j| j.is_stdout());
            return super::workers::relaunch_locally(n, !json_stdout);
        }
    }
    let world_size = world.as_ref().map_or(1, |w| w.world_size);
    let rank = world.as_ref().map_or(0, |w| w.rank);
    let place = super::train_mesh::Place {
        world: world_size,
        rank,
        tensor: a.tp,
        pipe: a.pp,
        sequence,
        shard_group: a.shard_group,
    };
    place.check(world.as_ref().map_or(world_size, |w| w.local_world_size))?;
    // Data-parallel replicas: what gradients are averaged over and what
    // the batch is dealt to (every rank of a tensor group sees one batch).
    let ranks = place.data();
    // A launched world of one rank may run a stage (over itself: what the
    // sharding machinery costs on one GPU); a lone process is told.
    if let (Some(stage), 1, None) = (zero, ranks, &world) {
        return Err(format!(
            "--zero {stage} shards over the ranks, and this run has one: start several \
             (--nproc N, or braid launch; --nproc 1 runs the stage over one rank)"
        ));
    }
    let shard_group = a.shard_group.unwrap_or(ranks);
    if zero.is_some() && (shard_group == 0 || ranks % shard_group != 0) {
        return Err(format!(
            "--shard-group {shard_group} does not divide the {ranks} {}ranks: pick a divisor of \
             {ranks} (the ranks form groups of that many, each holding one copy of the sharded \
             state)",
            if a.tp > 1 { "data-parallel " } else { "" }
        ));
    }

    let lead = rank == 0;
    let tensor = place.shard();
    if let (true, Some(j)) = (lead, &a.json) {
        j.claim_stdout()?;
    }
    if let Some(w) = &world {
        if cuda {
            let gpus = braid_cuda::device_count()
                .map_err(|e| format!("rank {rank}: --device cuda: {e}"))?;
            if w.local_world_size > gpus {
                return Err(format!(
                    "rank {rank}: {} workers on this node but only {gpus} GPU(s): one GPU per process \
                     (start at most {gpus} workers per node)",
                    w.local_world_size
                ));
            }
        }
        if !cuda || offload {
            // The CPU engine's passes, or the offloaded optimizers' updates.
            share_cores(w.local_world_size);
        }
    }
    let batch = match a.global_batch {
        None => a.batch,
        Some(g) => {
            let per = ranks * a.accum;
            if g == 0 || g % per != 0 {
                return Err(format!(
                    "--global-batch {g} does not divide into {ranks} rank(s) x {} micro-batch(es): \
                     pick a multiple of {per}",
                    a.accum
                ));
            }
            g / per
        }
    };
    let pipe_flags = pipe_flags(&a);
    // ZeRO's buckets hold whole layers: no deferred weight gradients.
    let defer_for = |layers| match zero {
        Some(_) => 0,
        None => defer_layers(a.defer_layers, precision, ranks, layers),
    };
    // A loaded model is named by its file in the pre-flight's messages.
    let model_name = match &a.load {
        Some(path) => path.display().to_string(),
        None => model.clone(),
    };
    // The model's configuration before anything is allocated: a loaded
    // file's, or the named one, whose vocabulary grows to the data's
    // where the name sets none (as nanoGPT takes its data's).
    let (mut cfg, saved_tok) = match &a.load {
        Some(path) => {
            let (cfg, meta) = checkpoint::header_of(path).map_err(|e| e.to_string())?;
            (cfg, meta.get("braid.tokenizer").cloned())
        }
        None => (GptConfig::parse(&model)?, None),
    };
    let mut tokenizer = tokenizer_for(a.tokenizer.as_deref(), saved_tok.as_ref(), cfg.vocab_size)?;
    let data = open_data(&a.data, tokenizer, a.seed)?;
    let data_vocab = data.source.max_token() as usize + 1;
    let mut vocab_note = None;
    if a.load.is_none() && !GptConfig::names_vocab(&model) && data_vocab > cfg.vocab_size {
        let vocab = match data_vocab <= GPT2_VOCAB {
            true => GPT2_VOCAB,
            false => data_vocab,
        };
        vocab_note = Some(format!(
            "vocabulary {vocab} from the data (it holds tokens up to {}; the model {} has {}: \
             name one with -V to choose)",
            data_vocab - 1,
            model,
            cfg.vocab_size
        ));
        cfg.vocab_size = vocab;
        cfg.validate()?;
        tokenizer = tokenizer_for(a.tokenizer.as_deref(), None, vocab)?;
    }
    let seq = match (a.seq, data.window) {
        (Some(s), _) => s,
        (None, Some(w)) => w.min(cfg.context),
        (None, None) => 64.min(cfg.context),
    };
    // A custom model that names no context (-T) takes the run's.
    let mut context_note = None;
    if a.load.is_none() && seq > cfg.context && !GptConfig::names_context(&model) {
        context_note = Some(format!(
            "context {seq} from --seq (the model {} names none; -T<context> in its name sets it)",
            model
        ));
        cfg.context = seq;
    }
    // Under --pp: the schedule and the stages, checked (the most basic
    // first), and the micro-batches' rows.
    let pipe_schedule = match a.pp {
        1 => None,
        _ => Some(super::train_pipeline::checked(
            &pipe_flags,
            Some(&cfg),
            &model_name,
            Some(batch),
        )?),
    };
    if let (Some(s), true) = (&pipe_schedule, sequence) {
        let rows = batch / s.micro_batches;
        if (rows * seq) % a.tp != 0 {
            return Err(format!(
                "sequence parallelism splits a micro-batch's {rows} x {seq} tokens over the {} \
                 ranks of a tensor group: pick a --batch, --micro-batches or --seq whose \
                 micro-batch divides by {} (or --no-sp)",
                a.tp, a.tp
            ));
        }
    }
    if place.sequence && (batch * seq) % a.tp != 0 {
        return Err(format!(
            "sequence parallelism splits a batch's {batch} x {seq} tokens over the {} ranks of a \
             tensor group: pick a --batch or --seq whose product divides by {} (or --no-sp)",
            a.tp, a.tp
        ));
    }
    // A tensor-parallel rank's share of the parameters (what its model
    // states are measured against); heads that do not split are refused
    // here, before any memory.
    same_model_as_checkpoint(&cfg, &model, resumed.as_ref())?;
    let tensor_share = match a.tp {
        1 => None,
        _ => Some(braid_model::layout::Layout::tensor_parallel(&cfg, tensor, 1)?.len as u64),
    };
    let shape = super::preflight::Shape {
        model: &model_name,
        seq,
        checkpointing: a.checkpointing,
        sharding: Sharding {
            stage: zero.unwrap_or(0),
            ranks: shard_group,
        },
        ranks,
        local_workers: world.as_ref().map_or(1, |w| w.local_world_size),
        offload,
        accum: a.accum,
        tensor: a.tp,
        sequence,
        plain_grads: grad_comm == GradComm::Plain,
        gpu_memory,
    };
    // Before the memory pre-flight: a --seq past the context is the
    // cause, not the memory it would take.
    check_fits(&cfg, seq, &*data.source)?;
    if cuda && world.is_none() {
        super::gpus_for(&a.device)?;
    }
    // Before the host spends time reading or initialising a model it (or
    // the GPU) cannot hold; the GPU is checked again, with the same
    // figures, once the run's device is set up.
    let preflight = |cfg: &GptConfig| -> Result<(), String> {
        let adamw = optimizer == OptimizerKind::AdamW;
        super::preflight::host(&shape, cfg, batch, cuda, precision, adamw)?;
        // (A pipeline rank holds its stages only: the whole model's
        // figures do not apply; not estimated yet.)
        if cuda && a.pp == 1 {
            let local = braid_core::world::local_rank_from_env().unwrap_or(0);
            let dev = braid_cuda::Device::open(local).map_err(|e| format!("--device cuda: {e}"))?;
            let defer = defer_for(cfg.n_layer);
            super::preflight::device(&shape, cfg, &dev, precision, batch, defer)?;
        }
        Ok(())
    };
    // Both arms give the parameters in the layout the run trains on.
    let mut params = match &a.load {
        Some(path) => {
            preflight(&cfg)?;
            // Read straight into that layout: one copy of the model.
            let layout = train_layout(&cfg, zero, shard_group, tensor)?;
            checkpoint::load_as(path, |_| layout)
                .map_err(|e| e.to_string())?
                .0
        }
        None => {
            preflight(&cfg)?;
            let started = Instant::now();
            // Drawn straight into the layout the run trains on (values by
            // tensor and chunk, not by offset: the same either way).
            let p = Params::init_gpt2(
                Arc::new(train_layout(&cfg, zero, shard_group, tensor)?),
                a.seed,
            );
            if lead {
                slow_note("parameters initialised", started, cfg.num_params());
            }
            p
        }
    };
    let cfg = params.layout.config;
    let dump_grads = dump_grads_path(world_size, &place, zero)?;
    let lr = a.lr.unwrap_or_else(|| default_lr(cfg.num_params()));
    let data_desc = data.describe(seq)?;
    check_fits(&cfg, seq, &*data.source)?;
    let mut loader =
        TokenWindows::new(&*data.source, batch, seq, place.data_rank(), ranks, a.seed)?;
    let mut opts = LoopOptions {
        steps: a.steps,
        accum: a.accum,
        schedule: Schedule {
            max_lr: lr,
            min_lr: lr * 0.1,
            warmup: a.warmup.min(a.steps.max(1)),
            total: a.steps,
        },
        grad_clip: a.grad_clip,
        eval_every: a.eval_every,
        eval_batches: 4,
        update: !a.fwd_bwd_only,
        profile_warmup: 5,
        measure_unoverlapped: ranks > 1,
        // The GPU pre-flight decides (below).
        saved_in_grads: false,
        keep_first_grads: dump_grads.is_some(),
    };
    if lead {
        for note in device
            .chosen
            .iter()
            .chain(&model_note)
            .chain(&vocab_note)
            .chain(&context_note)
            .chain(&sequence_note)
        {
            println!("{note}");
        }
        println!(
            "braid train: model {} ({} layers, {} heads, width {}, vocab {}, context {}; {:.2}M \
             parameters), {}, lr {}, seed {}",
            model,
            cfg.n_layer,
            cfg.n_head,
            cfg.n_embd,
            cfg.vocab_size,
            cfg.context,
            cfg.num_params() as f64 / 1e6,
            braid_core::words::count(a.steps, "step"),
            lr,
            a.seed,
        );
        println!(
            "data: {} ({}, {}), batch {} x {} per rank{}, {}{}",
            a.data,
            data_desc,
            tokenizer.name(),
            batch,
            seq,
            if a.accum > 1 {
                format!(" x {} micro-batches", a.accum)
            } else {
                String::new()
            },
            braid_core::words::count(rayon::current_num_threads(), "thread"),
            if ranks > 1 {
                format!(" per rank, {ranks} ranks")
            } else {
                String::new()
            },
        );
        println!(
            "initial loss should be about ln({}) = {:.3}",
            cfg.vocab_size,
            (cfg.vocab_size as f64).ln()
        );
    }
    // (A worker started by another launcher checks it too.)
    update_beside_removed()?;
    let shard_choice = ShardChoice {
        stage: zero,
        keep_params: a.no_reshard_after_forward,
        saved_in_grads: false,
        half_gathers: true,
        final_gather: a.save.is_some(),
        split_reduce: super::preflight::split_embedding_grads(
            &cfg,
            zero.unwrap_or(0),
            a.checkpointing,
        )?,
        kept_spares: super::preflight::env_choice(env::BRAID_ZERO3_SPARES, "kept", "capped")?,
    };
    let ddp = DdpOptions {
        bucket_cap_mb: a.bucket_mb,
        first_bucket_mb: a.first_bucket_mb,
        grad_comm,
        overlap: !a.no_overlap,
    };
    let comm = match &world {
        Some(_) if world_size > 1 || zero.is_some() => {
            let c = super::workers::init(CommOptions::from_env().map_err(|e| e.to_string())?)?;
            super::workers::stop_on_sigterm(&c);
            Some(c)
        }
        _ => None,
    };
    let strategy_name = match (zero, a.shard_group) {
        (None, _) if ranks > 1 => "data parallel".to_string(),
        (None, _) => "one process".to_string(),
        (Some(z), None) => format!("ZeRO-{z}"),
        (Some(z), Some(g)) => format!("ZeRO-{z}, shard groups of {g}"),
    };
    let strategy_name = match (place.tensor, zero.is_none() && ranks == 1) {
        (1, _) => strategy_name,
        (n, one_replica) => format!(
            "tensor parallel {n}{}{}",
            if place.sequence {
                " (sequence parallel)"
            } else {
                ""
            },
            match one_replica {
                true => String::new(),
                false => format!(" x {strategy_name}"),
            }
        ),
    };
    // Under --pp the whole mesh names the strategy.
    let strategy_name = match &pipe_schedule {
        Some(s) => super::train_pipeline_run::strategy_name(s, &place, zero, a.shard_group),
        None => strategy_name,
    };
    if a.resume.is_some() && grad_comm != GradComm::Plain && lead {
        println!(
            "note: --grad-comm {}: its state (error feedback) is not in checkpoints; a resumed run starts it afresh",
            a.grad_comm
        );
    }
    let run_desc = serde_json::json!({
        "model": model,
        "config": cfg,
        "params": cfg.num_params(),
        "backend": match (&comm, cuda) {
            (Some(_), true) => "nccl".to_string(),
            (Some(c), false) => c.backend_name().to_string(),
            (None, _) => String::new(),
        },
        "tokenizer": tokenizer.name(),
        "data": a.data,
        "seed": a.seed,
        "seq": seq,
        "batch_per_rank": batch,
        "accum": a.accum,
        "ranks": world_size,
        "data_parallel": ranks,
        "tensor_parallel": place.tensor,
        "sequence_parallel": place.sequence,
        "global_batch": batch * ranks * a.accum,
        "strategy": strategy_name,
        "optimizer": a.optimizer,
        "lr": lr,
        "warmup": opts.schedule.warmup,
        "steps": a.steps,
        "weight_decay": a.weight_decay,
        "grad_clip": a.grad_clip,
        "precision": precision.name(),
    });
    let mut ckpt = super::train_ckpt::setup(
        &super::train_ckpt::CkptFlags {
            dir: a.ckpt_dir.as_deref(),
            every: a.save_every,
            keep: a.keep,
            resume: a.resume.as_deref(),
            sync: a.ckpt_sync,
        },
        rank,
        world_size,
        &strategy_name,
        run_desc.clone(),
        lead,
    )?;
    // A checkpoint is committed once every rank of the run has written
    // its files: the agreement goes over the world, not the strategy's
    // ranks (under --pp those are one stage's data group).
    if let Some(c) = &comm {
        ckpt.agree_over(c);
    }
    // Under --pp the trace also records the pipeline's layout (`braid report`).
    let trace_desc = match &pipe_schedule {
        Some(s) if a.trace.is_some() => {
            super::train_pipeline_run::traced_desc(run_desc.clone(), &cfg, s, &pipe_flags, &place)?
        }
        _ => run_desc.clone(),
    };
    let mut tracing = super::train_trace::start(
        a.trace.as_deref(),
        a.metrics_addr.as_deref(),
        comm.as_ref(),
        trace_desc,
        (batch * seq * a.accum * ranks) as f64,
    )?;
    let mut progress = Progress::new(lead, a.log_every, a.steps);
    progress.metrics = tracing.live();
    if !cuda {
        progress.slow_hint = Some(match braid_cuda::device_count().unwrap_or(0) {
            0 => "this CPU run will take over an hour: a smaller --model, fewer --steps or a \
                  machine with a GPU finish sooner"
                .to_string(),
            g => format!(
                "this run is on the CPU; --device cuda trains on the {g} GPU(s) here (--device \
                 auto picks them when there is one per worker)"
            ),
        });
    }
    let mut tb = TokenBatch::new(batch, seq);
    let mut parts = LoopParts {
        progress: &mut progress,
        loader: &mut loader,
        batch: &mut tb,
        opts: &mut opts,
        ckpt: &mut ckpt,
        tracing: &mut tracing,
        lead,
        strategy: strategy_name.clone(),
    };
    // Under --pp: the parameters of this rank's stages, and the timeline.
    let mut stage_params = None;
    let mut pipeline_json = None;
    let run = if let Some(schedule) = pipe_schedule {
        let done = super::train_pipeline_run::run(
            super::train_pipeline_run::PipelineRun {
                comm,
                cfg,
                schedule,
                pipe_flags: &pipe_flags,
                params: &mut params,
                batch,
                seq,
                place: &place,
                cuda,
                precision,
                optimizer,
                weight_decay: a.weight_decay,
                checkpointing: a.checkpointing,
                save: a.save.is_some(),
                gpu_memory,
                shard_choice,
                ddp,
            },
            &mut parts,
        )?;
        stage_params = Some(done.stage_params);
        pipeline_json = done.timeline_json;
        done.report
    } else if !cuda {
        let (run, trained) = super::train_cpu_run::run(
            super::train_cpu_run::CpuRun {
                comm,
                params,
                batch,
                seq,
                place: &place,
                optimizer,
                weight_decay: a.weight_decay,
                checkpointing: a.checkpointing,
                save: a.save.is_some(),
                shard_choice,
                ddp,
            },
            &mut parts,
        )?;
        params = trained;
        run
    } else {
        super::train_gpu_run::run(
            super::train_gpu_run::GpuRun {
                comm: comm.as_ref(),
                cfg,
                params: &mut params,
                shape: &shape,
                batch,
                seq,
                place: &place,
                ranks,
                precision,
                zero,
                offload,
                defer: defer_for(cfg.n_layer),
                weight_decay: a.weight_decay,
                checkpointing: a.checkpointing,
                save: a.save.is_some(),
                shard_choice,
                ddp,
            },
            &mut parts,
        )?
    };
    let tokens_per_step = (batch * seq * a.accum * ranks) as f64;
    if let (Some(path), Some(grads)) = (&dump_grads, &run.first_grads) {
        write_first_grads(path, &params.layout, grads)?;
    }
    if lead {
        let summary = print_summary(
            &run,
            &cfg,
            seq,
            tokens_per_step,
            cuda.then_some(precision),
            world_size,
        );
        print_state(
            &run,
            &cfg,
            stage_params.or(tensor_share),
            zero.unwrap_or(0),
            shard_group,
        );
        if let Some(out) = &a.json {
            write_json(out, &run, summary.as_ref(), cfg.n_layer, pipeline_json)?;
        }
        if a.fwd_bwd_only && run.steps.len() > 1 {
            let mut tps: Vec<f64> = run.steps[1..].iter().map(|r| r.tokens_per_s).collect();
            tps.sort_by(|x, y| x.partial_cmp(y).expect("finite"));
            println!(
                "forward+backward: median {:.1} tokens/s over {} steps (first step not counted)",
                tps[tps.len() / 2],
                tps.len()
            );
        }
        if let Some(path) = &a.save {
            let dtype = braid_core::DType::parse(&a.save_dtype)?;
            checkpoint::save_as(
                &params,
                path,
                dtype,
                &[("braid.tokenizer", tokenizer.name())],
            )
            .map_err(|e| e.to_string())?;
            println!("saved {}", path.display());
        }
    }
    Ok(0)
}

/// What `--pp`, `--micro-batches`, `--schedule` and `--stage-layers` ask
/// (the schedule 1F1B and twice as many micro-batches as stages unless
/// told).
fn pipe_flags(a: &TrainArgs) -> super::train_pipeline::PipeFlags<'_> {
    super::train_pipeline::PipeFlags {
        ranks: a.pp,
        micro: a.micro_batches.unwrap_or(2 * a.pp),
        schedule: a.schedule.as_deref().unwrap_or("1f1b"),
        stage_layers: a.stage_layers.as_deref(),
    }
}

/// `BRAID_DUMP_GRADS=FILE` (a diagnostic): where to write the first
/// step's gradients, in one process without model parallelism or ZeRO
/// (where the gradient buffer is the whole model's, in its layout).
fn dump_grads_path(
    world_size: usize,
    place: &super::train_mesh::Place,
    zero: Option<u8>,
) -> Result<Option<PathBuf>, String> {
    let Some(path) = std::env::var_os(env::BRAID_DUMP_GRADS).filter(|p| !p.is_empty()) else {
        return Ok(None);
    };
    if world_size > 1 || place.tensor > 1 || place.pipe > 1 || zero.is_some() {
        return Err(
            "BRAID_DUMP_GRADS writes one process's whole gradient buffer: train in one \
             process without --tp, --pp or --zero (or unset it)"
                .into(),
        );
    }
    let path = PathBuf::from(path);
    super::train_ckpt::check_outputs(&[(env::BRAID_DUMP_GRADS, Some(&path))])?;
    Ok(Some(path))
}

/// Writes the first step's gradients (`grads`, in `layout`) to `path` as
/// safetensors under the parameters' Hugging Face names (f32).
fn write_first_grads(path: &Path, layout: &Arc<Layout>, grads: &[f32]) -> Result<(), String> {
    if grads.len() != layout.len {
        return Err(format!(
            "BRAID_DUMP_GRADS: {} gradients for a layout of {} parameters",
            grads.len(),
            layout.len
        ));
    }
    let p = Params {
        layout: layout.clone(),
        data: grads.to_vec(),
    };
    checkpoint::save_as(
        &p,
        path,
        braid_core::DType::F32,
        &[(
            "braid.kind",
            "the first step's gradients (BRAID_DUMP_GRADS)",
        )],
    )
    .map_err(|e| e.to_string())?;
    println!("first step's gradients written to {}", path.display());
    Ok(())
}

/// The layout a run trains on: this rank's share of the model under
/// `--tp`; under `--zero`, every block padded so that it splits into one
/// equal, aligned block per rank of the shard group.
fn train_layout(
    cfg: &GptConfig,
    zero: Option<u8>,
    shard_group: usize,
    tensor: braid_model::layout::TensorShard,
) -> Result<Layout, String> {
    let multiple = match zero {
        Some(_) => ZERO_ALIGN * shard_group,
        None => 1,
    };
    Layout::tensor_parallel(cfg, tensor, multiple)
}

/// Says how long a start-up phase of a large model took, when it took
/// long enough for someone to wonder (a second or more).
pub(super) fn slow_note(what: &str, started: Instant, params: usize) {
    let s = started.elapsed().as_secs_f64();
    if s >= 1.0 {
        println!("{what} in {s:.1} s ({:.2e} parameters)", params as f64);
    }
}

/// The training data, opened.
struct TrainData {
    source: Box<dyn WindowSource>,
    /// A `.beton` file's window length (`T`, the tokens before the last).
    window: Option<usize>,
    path: String,
    beton: bool,
}

impl TrainData {
    /// What the data holds at sequence length `seq`, for the banner;
    /// refuses a `.beton` file whose windows are shorter.
    fn describe(&self, seq: usize) -> Result<String, String> {
        match self.window {
            Some(w) if w < seq => Err(format!(
                "{}: its windows hold {w} tokens; --seq {seq} needs more: use --seq {w} or less, \
                 or rewrite it with braid data write --seq {seq}",
                self.path
            )),
            Some(w) if self.beton => Ok(format!(
                "{} training and {} held-out windows of {seq} tokens{}, memory-mapped",
                self.source.windows(seq, false),
                self.source.windows(seq, true),
                match w / seq {
                    1 => String::new(),
                    per => format!(", {per} cut from each of the file's windows of {w}"),
                }
            )),
            _ => Ok(format!(
                "{} training windows of {seq} tokens",
                self.source.windows(seq, false)
            )),
        }
    }
}

/// The training data: a `.beton` file's token windows, or a token
/// dataset (synthetic, random, text, shards) loaded into memory.
fn open_data(data: &str, tokenizer: Tokenizer, seed: u64) -> Result<TrainData, String> {
    let path = std::path::Path::new(data);
    if path.extension().is_some_and(|e| e == "beton") {
        let b = BetonTokens::open(path, None)?;
        return Ok(TrainData {
            window: Some(b.window_len() - 1),
            source: Box::new(b),
            path: data.to_string(),
            beton: true,
        });
    }
    let d = Dataset::load(&Source::parse(data)?, tokenizer, seed)?;
    Ok(TrainData {
        source: Box::new(d),
        window: None,
        path: data.to_string(),
        beton: false,
    })
}

/// What every run's training loop takes besides its engine and strategy:
/// the progress printer, the loader and its batch, the loop's options,
/// checkpoints and tracing, and whether this rank leads.
pub(crate) struct LoopParts<'r, 'd> {
    pub progress: &'r mut Progress,
    pub loader: &'r mut TokenWindows<'d>,
    pub batch: &'r mut TokenBatch,
    /// The loop's options (a GPU run's pre-flight decides where saved
    /// activations live before the loop starts).
    pub opts: &'r mut LoopOptions,
    pub ckpt: &'r mut super::train_ckpt::CkptSetup,
    pub tracing: &'r mut super::train_trace::TraceSetup,
    pub lead: bool,
    /// The run's layout in words (`data parallel`, `pipeline 2 (1f1b, 4
    /// micro-batches)`): a pipeline's is printed before the strategy of
    /// its data dimension.
    pub strategy: String,
}

/// One of braid-train's loops: [`braid_train::train_with`], or
/// [`braid_train::train_lending`] for an engine that
/// [`LendsMemory`](braid_train::LendsMemory) (the GPU engine: its saved
/// activations may live in the loop's gradient buffer).
pub(super) type Trainer<'d, E, S> = fn(
    &mut E,
    &mut S,
    &mut TokenWindows<'d>,
    &mut TokenBatch,
    &LoopOptions,
    Checkpoints<'_>,
    &mut dyn FnMut(&StepReport),
) -> Result<RunReport, String>;

/// The loop with `strategy`, progress printed by the lead rank, run by
/// `train`; `distributed`: the strategy runs over a communicator (of one
/// rank, or more).
pub(super) fn run_loop<'d, E, S>(
    parts: &mut LoopParts<'_, 'd>,
    engine: &mut E,
    strategy: &mut S,
    distributed: bool,
    train: Trainer<'d, E, S>,
) -> Result<RunReport, String>
where
    E: Checkpointable<Batch = TokenBatch>,
    S: Strategy<E> + ?Sized,
{
    if parts.lead && distributed {
        // A pipeline's data dimension says how it reduces (or, with one
        // replica, nothing: "one process").
        let how = strategy.describe();
        let line = match (parts.strategy.starts_with("pipeline"), how.as_str()) {
            (false, _) => format!("strategy: {how}"),
            (true, "one process") => format!("strategy: {}", parts.strategy),
            (true, _) => format!(
                "strategy: {}; over the data dimension: {how}",
                parts.strategy
            ),
        };
        println!("{}", braid_core::words::clauses(&line, "  "));
    }
    let r = train(
        engine,
        strategy,
        &mut *parts.loader,
        &mut *parts.batch,
        &*parts.opts,
        parts.ckpt.loop_view(),
        &mut |r| parts.progress.step(r),
    );
    if let (Err(e), true) = (&r, distributed) {
        // A failed distributed run may have device work queued that waits
        // for a peer that is gone (a reduction stuck on its flags): freeing
        // buffers would wait for it forever. Report and leave; the
        // operating system reclaims the rest.
        eprintln!("braid: error: {e}");
        std::process::exit(1);
    }
    // While the communicator lives: rank 0 may host the store.
    let run = r?;
    parts.tracing.finish(&run)?;
    Ok(run)
}

#[cfg(test)]
mod tests {
    use super::{default_lr, gather_via_checked_given};
    use braid_model::config::GptConfig;

    /// `BRAID_ZERO3_GATHER_VIA`: auto by default (anywhere); ce only for
    /// ZeRO-3 on GPUs, and not under another NCCL_CTA_POLICY.
    #[test]
    fn copy_engine_gathers_are_zero3_on_gpus_under_the_zero_cta_policy() {
        for via in [None, Some("auto"), Some("nccl"), Some("ce")] {
            assert_eq!(gather_via_checked_given(via, None, Some(3), true), Ok(()));
        }
        for via in [None, Some("auto"), Some("nccl")] {
            assert_eq!(gather_via_checked_given(via, None, None, false), Ok(()));
            assert_eq!(
                gather_via_checked_given(via, Some("1"), Some(3), true),
                Ok(())
            );
        }
        assert_eq!(
            gather_via_checked_given(Some("ce"), Some("2"), Some(3), true),
            Ok(())
        );
        let e = gather_via_checked_given(Some("ce"), Some("1"), Some(3), true).unwrap_err();
        assert!(
            e.contains("NCCL_CTA_POLICY=\"1\"") && e.contains("unset"),
            "{e}"
        );
        let e = gather_via_checked_given(Some("kernels"), None, Some(3), true).unwrap_err();
        assert!(e.contains("expected auto, ce or nccl"), "{e}");
        for (zero, cuda) in [(Some(3), false), (Some(1), true), (None, true)] {
            let e = gather_via_checked_given(Some("ce"), None, zero, cuda).unwrap_err();
            assert!(e.contains("--zero 3") && e.contains("--device cuda"), "{e}");
        }
    }

    #[test]
    fn default_learning_rate_follows_the_model_size() {
        let lr = |m: &str| default_lr(GptConfig::parse(m).expect("valid").num_params());
        assert_eq!(lr("tiny"), 3e-3);
        assert_eq!(lr("124M"), 6e-4);
        assert_eq!(lr("350M"), 3e-4);
        assert_eq!(lr("774M"), 2.5e-4);
        assert_eq!(lr("1558M"), 2e-4);
    }

    /// `--tp`'s sequence parallelism: on by default (CPU, GPU f32 and
    /// bf16), off with a note in a pipeline's GPU stages (bf16: on with
    /// `--sp`; f32: `--sp` refused).
    #[test]
    fn sequence_parallelism_is_on_where_built_and_said_off_elsewhere() {
        use super::{sequence_parallel, Precision, TrainArgs};
        use clap::{Args, Command};
        let args = |extra: &[&str]| {
            let cmd = TrainArgs::augment_args(Command::new("train"));
            let m = cmd
                .try_get_matches_from(std::iter::once("train").chain(extra.iter().copied()))
                .expect("arguments parse");
            <TrainArgs as clap::FromArgMatches>::from_arg_matches(&m).expect("arguments")
        };
        let (bf16, f32) = (Precision::Bf16, Precision::F32);
        let on = |a: &TrainArgs, cuda, p| sequence_parallel(a, cuda, p);
        let tp = args(&["--tp", "2"]);
        assert_eq!(on(&tp, false, f32), Ok((true, None)));
        assert_eq!(on(&tp, true, f32), Ok((true, None)));
        assert_eq!(on(&tp, true, bf16), Ok((true, None)));
        let pp = args(&["--tp", "2", "--pp", "2"]);
        assert_eq!(on(&pp, false, f32), Ok((true, None)));
        for (p, want) in [
            (bf16, "off for --tp 2 --pp 2 by default"),
            (f32, "off for --tp 2 --pp 2 --precision f32"),
        ] {
            let (sp, note) = on(&pp, true, p).expect("a default");
            let note = note.expect("a note");
            assert!(!sp && note.contains(want), "{note}");
        }
        let sp_pp = args(&["--tp", "2", "--pp", "2", "--sp"]);
        assert_eq!(on(&sp_pp, true, bf16), Ok((true, None)));
        let e = on(&sp_pp, true, f32).expect_err("refused");
        assert!(e.contains("--sp with --tp 2 --pp 2 --precision f32"), "{e}");
        let no = args(&["--tp", "2", "--no-sp"]);
        assert_eq!(on(&no, true, bf16), Ok((false, None)));
        assert_eq!(on(&args(&[]), true, bf16), Ok((false, None)));
        let e = on(&args(&["--sp"]), false, f32).expect_err("refused");
        assert!(e.contains("--sp") && e.contains("--tp N"), "{e}");
    }
}
