//! `braid train`: braid-train's one training loop over the CPU or GPU
//! engine — in one process, or over several ranks, data-parallel or with
//! ZeRO's sharded optimizer (`train_strategy`; `--nproc N` starts them
//! here through the launcher; under `braid launch`, torchrun or SLURM
//! each process is one rank).

use super::train_output::Progress;
use super::train_strategy::ZERO_ALIGN;
use braid_core::env;
use braid_data::loader::WindowSource;
use braid_data::token_beton::BetonTokens;
use braid_data::tokens::{Dataset, Source, Tokenizer};
use braid_model::checkpoint;
use braid_model::{GptConfig, Layout, Params};
use braid_train::checkpoint::load::resolve;
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
pub(super) const BUCKET_MB: f64 = 25.0;
/// `--first-bucket-mb`'s default (PyTorch DDP's).
pub(super) const FIRST_BUCKET_MB: f64 = 1.0;

/// Option groups of `braid train --help`.
const H_MODEL: &str = "Model and data";
const H_RUN: &str = "Steps, batch and optimizer";
const H_DEVICE: &str = "Devices and processes";
const H_PARALLEL: &str = "Parallelism and communication";
const H_CKPT: &str = "Checkpoints";
const H_OUTPUT: &str = "Output and tracing";

/// Train a GPT model.
#[derive(Args, Clone)]
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
    pub(super) model: Option<String>,
    /// synthetic, random, a text file, token shards or a .beton.
    ///
    /// synthetic: a built-in corpus (the same for a seed as `braid data write --tokens
    /// synthetic`); random: uniform tokens, for throughput; a UTF-8 text file; u16 token shards
    /// (.bin file or directory); or a .beton file of token windows (braid data write --tokens).
    #[arg(long, default_value = "synthetic", help_heading = H_MODEL)]
    pub(super) data: String,
    /// bytes or gpt2 (default: the data's, else bytes for a 256-token vocabulary, else gpt2).
    #[arg(long, hide_short_help = true, help_heading = H_MODEL)]
    pub(super) tokenizer: Option<String>,
    /// Tokens per sequence (default: a .beton's windows, else 64).
    ///
    /// At most the model's context; a .beton file's windows, capped at the context, by default.
    #[arg(long, help_heading = H_MODEL)]
    pub(super) seq: Option<usize>,
    /// Seed of initialisation, data order and sampling (one default across braid's commands).
    #[arg(long, default_value_t = super::DEFAULT_SEED, hide_short_help = true,
          help_heading = H_MODEL)]
    pub(super) seed: u64,

    /// Training steps.
    #[arg(long, default_value_t = 400, help_heading = H_RUN)]
    pub(super) steps: usize,
    /// Sequences per micro-batch on each rank.
    #[arg(long, default_value_t = 16, help_heading = H_RUN)]
    pub(super) batch: usize,
    /// Sequences per step over all ranks and micro-batches, instead of --batch.
    ///
    /// Must divide by ranks x --accum.
    #[arg(long, hide_short_help = true, help_heading = H_RUN)]
    pub(super) global_batch: Option<usize>,
    /// Micro-batches per step (gradient accumulation: only the last one communicates).
    #[arg(long, default_value_t = 1, hide_short_help = true, help_heading = H_RUN)]
    pub(super) accum: usize,
    /// Peak learning rate (default: by model size).
    ///
    /// Default: 3e-3 below 50M parameters, then GPT-3's choices: 6e-4 for 124M, 3e-4 for 350M,
    /// 2.5e-4 for 774M, 2e-4 above.
    #[arg(long, help_heading = H_RUN)]
    pub(super) lr: Option<f32>,
    /// Warmup steps.
    #[arg(long, default_value_t = 20, hide_short_help = true, help_heading = H_RUN)]
    pub(super) warmup: usize,
    /// Steps the learning rate's schedule spans (default: --steps).
    ///
    /// The cosine decay reaches its floor, a tenth of the peak, at this step and stays there:
    /// a run given more steps than another keeps the other's schedule (an asynchronous
    /// parameter-server run given the steps it needs to reach a synchronous run's loss).
    #[arg(long, value_name = "N", hide_short_help = true, help_heading = H_RUN)]
    pub(super) lr_steps: Option<usize>,
    /// Weight decay on matrices and embeddings.
    #[arg(long, default_value_t = 0.1, hide_short_help = true, help_heading = H_RUN)]
    pub(super) weight_decay: f32,
    /// Clip the gradients' global norm (0: off).
    #[arg(long, default_value_t = 1.0, hide_short_help = true, help_heading = H_RUN)]
    pub(super) grad_clip: f64,
    /// adamw or sgd.
    #[arg(long, default_value = "adamw", hide_short_help = true, help_heading = H_RUN)]
    pub(super) optimizer: String,
    /// Time forward + backward only, no optimizer step (a benchmark).
    #[arg(long, hide_short_help = true, help_heading = H_RUN)]
    pub(super) fwd_bwd_only: bool,

    /// auto (a GPU if there is one), cpu, or cuda.
    ///
    /// auto trains on the GPUs when this machine has enough of them for its workers (one GPU
    /// per process, LOCAL_RANK picks it) and says so at start; cpu and cuda choose.
    #[arg(long, default_value = "auto", help_heading = H_DEVICE)]
    pub(super) device: String,
    /// Local workers (data parallel): N, auto, gpu or cpu.
    ///
    /// The worker processes are started through braid launch; under braid launch, torchrun or
    /// SLURM each process is one rank already. auto: one per GPU if there are GPUs, else one
    /// per core.
    #[arg(long = "nproc-per-node", visible_alias = "nproc",
          aliases = ["nproc_per_node", "np"], value_name = "N", value_parser = super::parse_nproc,
          help_heading = H_DEVICE)]
    pub(super) nproc: Option<super::Nproc>,
    /// GPU arithmetic: bf16 (mixed precision, the default), fp8 or f32.
    ///
    /// bf16: bf16 products and activations, f32 master weights. fp8
    /// (experimental, compute capability 8.9 and up): as bf16, with the
    /// linear layers' products in FP8. The CPU engine is f32.
    #[arg(long, hide_short_help = true, help_heading = H_DEVICE)]
    pub(super) precision: Option<String>,
    /// Recompute activations in the backward pass instead of keeping them.
    ///
    /// Less memory, more compute. On a GPU (bf16) layers keep their input, attention output
    /// and, where it fits, the attention's state; each block's backward pass runs two of its
    /// four products and a LayerNorm again.
    #[arg(long, help_heading = H_DEVICE)]
    pub(super) checkpointing: bool,
    /// Move model state to host memory: optimizer or none.
    ///
    /// optimizer keeps the f32 master weights and AdamW's moments in host memory and runs the
    /// update on the CPU's cores (ZeRO-Offload's split: 12 bytes per parameter leave the GPU).
    /// AdamW, one process or data-parallel on GPUs; on CPUs (where the state is in host memory
    /// already) it also runs under --pp and --tp, the same update through the same code.
    #[arg(long, default_value = "none", value_name = "WHAT", hide_short_help = true,
          help_heading = H_DEVICE)]
    pub(super) offload: String,
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
    pub(super) gpu_memory: Option<f64>,

    /// Shard model states over the ranks: ZeRO stage 1, 2 or 3.
    ///
    /// 1: optimizer state sharded (gradients reduce-scattered after the backward pass,
    /// parameters all-gathered after every update); 2: gradients reduce-scattered bucket by
    /// bucket during the backward pass too; 3: parameters sharded as well, each block gathered
    /// just before it runs and freed after.
    #[arg(long, value_name = "STAGE", help_heading = H_PARALLEL)]
    pub(super) zero: Option<u8>,
    /// FSDP: an alias of --zero 3.
    #[arg(long, hide_short_help = true, help_heading = H_PARALLEL)]
    pub(super) fsdp: bool,
    /// With --zero 3: keep gathered parameters from forward to backward.
    ///
    /// FSDP2's reshard_after_forward=False: one gather per block and step instead of two, the
    /// whole model's parameters held at the peak.
    #[arg(long, hide_short_help = true, help_heading = H_PARALLEL)]
    pub(super) no_reshard_after_forward: bool,
    /// With --zero: shard within groups of N ranks, replicate across them (HSDP).
    #[arg(long, value_name = "N", hide_short_help = true, help_heading = H_PARALLEL)]
    pub(super) shard_group: Option<usize>,
    /// Parameter server: the last N processes serve, the rest are workers.
    ///
    /// The servers own balanced ranges of the parameters (and, with --ps-update server, their
    /// optimizer state) in host memory; workers push gradients by bucket as their backward pass
    /// makes them and pull parameters back. Start N + workers processes (--nproc-per-node or
    /// braid launch).
    #[arg(long, value_name = "N", hide_short_help = true, help_heading = H_PARALLEL)]
    pub(super) ps: Option<usize>,
    /// With --ps: sync, async or ssp:S.
    ///
    /// sync: every step's update from every worker's gradients (equal to data parallelism);
    /// async: a server applies each worker's push as it comes; ssp:S: as async, but no worker
    /// runs more than S steps ahead of the slowest.
    #[arg(long, default_value = "sync", value_name = "MODE", hide_short_help = true,
          help_heading = H_PARALLEL)]
    pub(super) ps_mode: String,
    /// With --ps: where the optimizer runs, server or worker.
    ///
    /// server: servers hold the optimizer state and update; worker: servers only sum the
    /// gradients and every worker updates its own copy (BytePS's split; synchronous only).
    #[arg(long, default_value = "server", value_name = "WHERE", hide_short_help = true,
          help_heading = H_PARALLEL)]
    pub(super) ps_update: String,
    /// With --ps: how many times a server or worker killed by a signal is started again.
    ///
    /// A server comes back in a synchronous run whose servers update and which writes
    /// checkpoints (its shard from the last one, brought level by the workers); a worker where
    /// the servers update (it rejoins at their step).
    #[arg(long, default_value_t = 3, value_name = "N", hide_short_help = true,
          help_heading = H_PARALLEL)]
    pub(super) ps_restarts: u32,
    /// With --ps-mode async or ssp:S: keep the optimizer's momentum and learning rate as given.
    ///
    /// By default a push's staleness, which acts as momentum of its own, is compensated as it is
    /// measured: with t the servers' moving average of their pushes' staleness (about W - 1 for
    /// async, W the workers), each update's learning rate is scaled by min(1, 2/(1+t)) and their
    /// momentum (AdamW's beta1, SGD's momentum) lowered by s/(1+s), s the part of it not computed
    /// from the same read (workers released together push bursts from one version).
    #[arg(long, hide_short_help = true, help_heading = H_PARALLEL)]
    pub(super) ps_no_compensation: bool,
    /// Tensor parallelism: every layer split over groups of N ranks.
    ///
    /// Megatron's split: attention heads and MLP columns over the group, the vocabulary too;
    /// the rest of the world is data parallel over the groups (with --zero over the data
    /// dimension). N must divide the heads and the workers of a node.
    #[arg(long, value_name = "N", default_value_t = 1, help_heading = H_PARALLEL)]
    pub(super) tp: usize,
    /// With --tp: no sequence parallelism (LayerNorms on every row on every rank).
    ///
    /// Sequence parallelism (the default with --tp, except in a pipeline's GPU stages) runs the
    /// LayerNorms, residual adds and position embedding on a slice of the rows: those
    /// activations shrink by N. Without it the bf16 GPU engine gathers no LayerNorm output in
    /// its backward pass (2 % faster at 2.65B --tp 4 on 4 H100s, 7.6 GiB more per GPU).
    #[arg(long, hide_short_help = true, conflicts_with = "sp", help_heading = H_PARALLEL)]
    pub(super) no_sp: bool,
    /// With --tp: sequence parallelism (the default, except in a pipeline's GPU stages: there
    /// bf16 takes it on this flag, f32 refuses it).
    #[arg(long, hide_short_help = true, help_heading = H_PARALLEL)]
    pub(super) sp: bool,
    /// auto: run the layout braid plan ranks first for this model, GPUs and global batch.
    ///
    /// On GPUs braid has a description of (H100, H200): the tensor and pipeline degrees, the
    /// schedule and micro-batches, the ZeRO stage, shard group, offload and checkpointing are
    /// chosen (so those flags are not given), the first of the ranked layouts that braid train
    /// takes; the choice and why are printed. The global batch: --global-batch, else --batch
    /// per GPU.
    #[arg(long, value_name = "auto", hide_short_help = true, help_heading = H_PARALLEL)]
    pub(super) layout: Option<String>,
    /// Pipeline parallelism: the layers cut into stages over N ranks.
    ///
    /// Micro-batches flow through the stages as --schedule says; the rest of the world is
    /// data parallel over whole pipelines (--zero 1 over it; on CPUs --zero 2 and 3 too).
    #[arg(long, value_name = "N", default_value_t = 1, help_heading = H_PARALLEL)]
    pub(super) pp: usize,
    /// With --pp: micro-batches per step (the batch per rank splits into them; default 2 x --pp).
    #[arg(long, value_name = "M", hide_short_help = true, help_heading = H_PARALLEL)]
    pub(super) micro_batches: Option<usize>,
    /// With --pp: gpipe, 1f1b, interleaved[:V], zb (ZB-H1), zb-h2, interleaved-zb[:V], or a
    /// schedule file.
    ///
    /// Default: 1f1b.
    #[arg(long, value_name = "S", hide_short_help = true, help_heading = H_PARALLEL)]
    pub(super) schedule: Option<String>,
    /// With --pp: each stage's layer count, e.g. 3,5,5,3 (default: balanced).
    #[arg(long, value_name = "N,N,..", hide_short_help = true, help_heading = H_PARALLEL)]
    pub(super) stage_layers: Option<String>,
    /// Gradients on the wire: plain (f32), bf16, fp16, powersgd[:RANK[:START]], or topk:F.
    ///
    /// powersgd takes PyTorch's defaults: rank 1, from step 1000. topk:F (with --ps) pushes the
    /// largest fraction F of each bucket and keeps the rest for the next step.
    #[arg(long, default_value = "plain", hide_short_help = true, help_heading = H_PARALLEL)]
    pub(super) grad_comm: String,
    /// Gradient bucket size in MiB (data parallelism and --zero 1).
    #[arg(long, default_value_t = BUCKET_MB, hide_short_help = true, help_heading = H_PARALLEL)]
    pub(super) bucket_mb: f64,
    /// First bucket's size in MiB.
    #[arg(long, default_value_t = FIRST_BUCKET_MB, hide_short_help = true,
          help_heading = H_PARALLEL)]
    pub(super) first_bucket_mb: f64,
    /// Reduce gradients after the backward pass, not during it (to measure the overlap).
    #[arg(long, hide_short_help = true, help_heading = H_PARALLEL)]
    pub(super) no_overlap: bool,
    /// GPU, bf16: run the first N layers' weight gradients after the embeddings' backward.
    ///
    /// So that the embeddings' gradient reduction (the largest, final only at the end)
    /// overlaps them. Default: 2 when data-parallel, else 0.
    #[arg(long, value_name = "N", hide_short_help = true, help_heading = H_PARALLEL)]
    pub(super) defer_layers: Option<usize>,

    /// Start from this model file (safetensors) instead of a fresh initialisation.
    #[arg(long, value_name = "FILE", hide_short_help = true, help_heading = H_CKPT)]
    pub(super) load: Option<PathBuf>,
    /// Save the trained model (safetensors, Hugging Face GPT-2 names) here.
    #[arg(long, value_name = "FILE", help_heading = H_CKPT)]
    pub(super) save: Option<PathBuf>,
    /// Element type of --save: f32 or bf16.
    #[arg(long, default_value = "f32", hide_short_help = true, help_heading = H_CKPT)]
    pub(super) save_dtype: String,
    /// Sharded checkpoints go here (at the end; see --save-every).
    ///
    /// One step-NNNNNNNN directory per save: every rank's parameters and optimizer state, the
    /// trainer's state, a manifest.
    #[arg(long, value_name = "DIR", help_heading = H_CKPT)]
    pub(super) ckpt_dir: Option<PathBuf>,
    /// Save a checkpoint into --ckpt-dir every K steps (in the background).
    #[arg(long, value_name = "K", default_value_t = 0, hide_short_help = true,
          help_heading = H_CKPT)]
    pub(super) save_every: usize,
    /// Keep only the N newest checkpoints in --ckpt-dir (0: all).
    #[arg(long, value_name = "N", default_value_t = 0, hide_short_help = true,
          help_heading = H_CKPT)]
    pub(super) keep: usize,
    /// Resume from a checkpoint directory, a --ckpt-dir (its newest), or auto.
    ///
    /// auto: --ckpt-dir's newest if there is one, else start afresh. Any world size and
    /// strategy: the state is resharded.
    #[arg(long, value_name = "DIR|auto", help_heading = H_CKPT)]
    pub(super) resume: Option<String>,
    /// Write each checkpoint before training goes on, not in the background.
    #[arg(long, hide_short_help = true, help_heading = H_CKPT)]
    pub(super) ckpt_sync: bool,

    /// Print a progress line every K steps (default: about once a second).
    #[arg(long, value_name = "K", hide_short_help = true, help_heading = H_OUTPUT)]
    pub(super) log_every: Option<usize>,
    /// Evaluate on held-out data every K steps and at the end (0: never).
    #[arg(long, value_name = "K", default_value_t = 100, hide_short_help = true,
          help_heading = H_OUTPUT)]
    pub(super) eval_every: usize,
    /// Every step and the run's summary as JSON (see --json in braid --help).
    #[arg(long, value_name = "FILE", num_args = 0..=1, default_missing_value = "-",
          value_parser = super::json_out::parse, help = super::json_out::HELP,
          help_heading = H_OUTPUT)]
    pub(super) json: Option<super::json_out::JsonOut>,
    /// Trace every rank into DIR; `braid report DIR` analyses it.
    ///
    /// Chrome/Perfetto traces.
    ///
    /// Steps, data, forward and backward per block, collectives, optimizer, checkpoint copies,
    /// idle gaps; GPU work timed with CUDA events; clocks aligned through the store; merged into
    /// DIR/trace.json.
    #[arg(long, value_name = "DIR", help_heading = H_OUTPUT)]
    pub(super) trace: Option<PathBuf>,
    /// Serve live Prometheus metrics at HOST:PORT (each local rank on PORT + its rank).
    #[arg(long, value_name = "HOST:PORT", hide_short_help = true, help_heading = H_OUTPUT)]
    pub(super) metrics_addr: Option<String>,
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
pub(super) fn update_beside_removed() -> Result<(), String> {
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
pub(super) fn gather_via_checked(zero: Option<u8>, cuda: bool) -> Result<(), String> {
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
pub(super) fn gpu_memory_budget(a: &TrainArgs, cuda: bool) -> Result<Option<u128>, String> {
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
pub(super) fn sequence_parallel(
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
        (false, _, _) | (true, Precision::Bf16 | Precision::Fp8, true) => Ok((true, None)),
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
        (true, _, false) => Ok((
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
pub(super) fn defer_layers(
    asked: Option<usize>,
    precision: Precision,
    ranks: usize,
    layers: usize,
) -> usize {
    match (asked, precision) {
        (Some(n), _) => n,
        (None, p) if p.mixed() => braid_model::footprint::deferred_by_default(ranks, layers),
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
pub(super) fn world() -> Result<Option<braid_core::WorldInfo>, String> {
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
pub(super) fn share_cores(local_workers: usize) {
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
pub(super) fn model_of(a: &TrainArgs) -> Result<ModelChoice, String> {
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
pub(super) struct ModelChoice {
    pub(super) name: String,
    pub(super) note: Option<String>,
    pub(super) resumed: Option<(PathBuf, serde_json::Value)>,
}

/// Refuses to resume a checkpoint of another model than `cfg`, naming
/// the checkpoint's (before the first step, rather than at the first
/// tensor that differs).
pub(super) fn same_model_as_checkpoint(
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
pub(super) fn paths_checked(a: &TrainArgs) -> Result<(), String> {
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

/// Runs `braid train`: its flags checked, its workers started (with
/// `--nproc-per-node`), its place in the world, model, data and
/// parameters set up, the banner, the run on its engine, the summary.
pub fn run_train(a: TrainArgs) -> Result<i32, String> {
    let a = super::train_layout::resolved(a)?;
    let c = super::train_check::checked(&a)?;
    if let Some(status) = super::train_relaunch::relaunched(&a, &c)? {
        return Ok(status);
    }
    if let Some(ps) = &c.ps {
        if super::train_ps_restart::attempt().is_none() {
            // This rank's process keeps its role in a child.
            return super::train_ps_restart::supervise(&a, ps);
        }
        if let Some(index) = ps.server {
            return serve_shard(&a, &c, ps, index);
        }
    }
    let p = super::train_place::placed(&a, &c)?;
    let pipe_flags = pipe_flags(&a);
    let m = super::train_model::model_and_data(&a, &c)?;
    let pipe_schedule = super::train_model::pipeline_schedule(&a, &pipe_flags, &m, &p, c.sequence)?;
    let tensor_share = super::train_params::tensor_share(&a, &c, &p, &m)?;
    let shape = super::train_params::shape(&a, &c, &p, &m);
    let mut params = super::train_params::parameters(&a, &c, &p, &m, &shape)?;
    let cfg = params.layout.config;
    let dump_grads = dump_grads_path(p.world_size, &p.place, c.zero)?;
    let lr = a.lr.unwrap_or_else(|| default_lr(cfg.num_params()));
    let data_desc = m.data.describe(m.seq)?;
    check_fits(&cfg, m.seq, &*m.data.source)?;
    let mut loader = TokenWindows::new(
        &*m.data.source,
        p.batch,
        m.seq,
        p.place.data_rank(),
        p.ranks,
        a.seed,
    )?;
    let mut opts = super::train_setup::loop_options(&a, lr, p.ranks, dump_grads.is_some());
    if p.lead {
        super::train_banner::print_banner(&a, &c, &p, &m, &cfg, lr, &data_desc);
    }
    // (A worker started by another launcher checks it too.)
    update_beside_removed()?;
    let shard_choice = super::train_setup::shard_choice(&a, &c, &cfg)?;
    let ddp = super::train_setup::ddp_options(&a, &c);
    let comm = super::train_setup::communicator(&c, p.world_size)?;
    let strategy_name = super::train_banner::strategy_name(&a, &c, &p, pipe_schedule.as_ref());
    super::train_banner::grad_comm_note(&a, &c, p.lead);
    // The run's layout in braid plan's terms (read once: the description
    // records it, the summary sets the plan's prediction beside the run).
    let layout = super::train_plan::RunLayout::of(&a, &c, &p, &m);
    let facts = super::train_banner::RunFacts {
        cfg: &cfg,
        lr,
        warmup: opts.schedule.warmup,
        comm: comm.as_ref(),
        strategy: &strategy_name,
        layout: &layout,
    };
    let run_desc = super::train_banner::run_description(&a, &c, &p, &m, &facts);
    let mut ckpt = super::train_setup::checkpoints(
        &a,
        &p,
        comm.as_ref(),
        c.ps.as_ref(),
        &strategy_name,
        run_desc.clone(),
    )?;
    let trace_desc = super::train_setup::trace_desc(
        &a,
        &run_desc,
        &cfg,
        pipe_schedule.as_ref(),
        &pipe_flags,
        &p,
    )?;
    let mut tracing =
        super::train_setup::tracing(&a, &p, m.seq, comm.as_ref(), c.ps.as_ref(), trace_desc)?;
    let mut progress = super::train_setup::progress(&a, &c, p.lead, &tracing);
    let mut tb = TokenBatch::new(p.batch, m.seq);
    let mut parts = LoopParts {
        progress: &mut progress,
        loader: &mut loader,
        batch: &mut tb,
        opts: &mut opts,
        ckpt: &mut ckpt,
        tracing: &mut tracing,
        lead: p.lead,
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
                batch: p.batch,
                seq: m.seq,
                place: &p.place,
                cuda: c.cuda,
                precision: c.precision,
                optimizer: c.optimizer,
                weight_decay: a.weight_decay,
                checkpointing: a.checkpointing,
                save: a.save.is_some(),
                gpu_memory: c.gpu_memory,
                offload: c.offload,
                shard_choice,
                ddp,
            },
            &mut parts,
        )?;
        stage_params = Some(done.stage_params);
        pipeline_json = done.timeline_json;
        done.report
    } else if !c.cuda {
        let (run, trained) = super::train_cpu_run::run(
            super::train_cpu_run::CpuRun {
                comm,
                params,
                batch: p.batch,
                seq: m.seq,
                place: &p.place,
                optimizer: c.optimizer,
                weight_decay: a.weight_decay,
                checkpointing: a.checkpointing,
                offload: c.offload,
                save: a.save.is_some(),
                shard_choice,
                ddp,
                ps: c.ps.as_ref(),
                model: &c.model,
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
                batch: p.batch,
                seq: m.seq,
                place: &p.place,
                ranks: p.ranks,
                precision: c.precision,
                zero: c.zero,
                offload: c.offload,
                defer: super::train_params::deferred_layers(&a, &c, p.ranks, cfg.n_layer),
                weight_decay: a.weight_decay,
                checkpointing: a.checkpointing,
                save: a.save.is_some(),
                shard_choice,
                ddp,
            },
            &mut parts,
        )?
    };
    let done = super::train_summary::Finished {
        run,
        cfg: &cfg,
        params: &params,
        held: stage_params.or(tensor_share),
        pipeline_json,
        dump_grads: dump_grads.as_deref(),
        layout: &layout,
    };
    super::train_summary::finish(&a, &c, &p, &m, done)?;
    Ok(0)
}

/// A parameter server's run (`--ps`): its shard of the model `braid
/// train`'s flags describe, served until the workers are done.
fn serve_shard(
    a: &TrainArgs,
    c: &super::train_check::Choices,
    ps: &super::train_ps::Ps,
    index: usize,
) -> Result<i32, String> {
    let m = super::train_model::model_and_data(a, c)?;
    let layout = Layout::new(&m.cfg);
    share_cores(ps.world.local_world_size);
    super::train_ps::serve(
        ps,
        index,
        &c.model,
        &layout,
        cpu_optimizer(c.optimizer, a.weight_decay),
        a.ckpt_dir.as_deref(),
    )
}

/// What `--pp`, `--micro-batches`, `--schedule` and `--stage-layers` ask
/// (the schedule 1F1B and twice as many micro-batches as stages unless
/// told).
pub(super) fn pipe_flags(a: &TrainArgs) -> super::train_pipeline::PipeFlags<'_> {
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
    place: &braid_train::place::Place,
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
pub(super) fn write_first_grads(
    path: &Path,
    layout: &Arc<Layout>,
    grads: &[f32],
) -> Result<(), String> {
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
pub(super) fn train_layout(
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
pub(crate) struct TrainData {
    pub(super) source: Box<dyn WindowSource>,
    /// A `.beton` file's window length (`T`, the tokens before the last).
    pub(super) window: Option<usize>,
    path: String,
    beton: bool,
}

impl TrainData {
    /// What the data holds at sequence length `seq`, for the banner;
    /// refuses a `.beton` file whose windows are shorter.
    pub(super) fn describe(&self, seq: usize) -> Result<String, String> {
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
pub(super) fn open_data(data: &str, tokenizer: Tokenizer, seed: u64) -> Result<TrainData, String> {
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
