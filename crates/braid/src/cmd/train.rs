//! `braid train`: braid-train's one training loop over the CPU or GPU
//! engine — in one process, or over several ranks, data-parallel or with
//! ZeRO's sharded optimizer (`train_strategy`; `--nproc N` starts them
//! here through the launcher; under `braid launch`, torchrun or SLURM
//! each process is one rank).

use super::train_output::{print_state, print_summary, write_json, Progress};
use super::train_strategy::{distributed, zero_stage, ShardChoice, ZeroFlags, ZERO_ALIGN};
use braid_comm::gpu::GpuCommunicator;
use braid_comm::CommOptions;
use braid_data::loader::WindowSource;
use braid_data::token_beton::BetonTokens;
use braid_data::tokens::{Dataset, Source, Tokenizer};
use braid_model::checkpoint;
use braid_model::footprint::Sharding;
use braid_model::optim::Schedule;
use braid_model::{GptConfig, Layout, Params};
use braid_train::collective::{DeviceCollective, GradComm, HostCollective};
use braid_train::ddp::DdpOptions;
use braid_train::engines::{CpuGpt, CpuOptimizer, GpuGpt, Precision, TokenBatch};
use braid_train::loader::{check_fits, TokenWindows};
use braid_train::{train_with, Engine, LoopOptions, RunReport, Single, Strategy};
use clap::Args;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

/// `--bucket-mb`'s default (PyTorch DDP's).
const BUCKET_MB: f64 = 25.0;
/// `--first-bucket-mb`'s default (PyTorch DDP's).
const FIRST_BUCKET_MB: f64 = 1.0;

/// Train a GPT model.
#[derive(Args)]
#[command(
    about = "Train a GPT-2 family model on CPUs or GPUs, in one process or data-parallel",
    after_help = "Examples:\n  braid train                                   # tiny model, synthetic data, one process\n  braid train --nproc 2 --ckpt-dir ck --save-every 100 --resume auto   # checkpointed, resumable\n  braid train --nproc 2                         # data parallel over 2 local workers\n  braid train --model L4-H4-C128 --steps 1000 --save tiny.safetensors\n  braid train --model 124M --data shards/ --tokenizer gpt2 --batch 4 --seq 256\n  braid train --model 124M --device cuda --nproc 2 --batch 16 --seq 1024 --data random\n  braid launch --nnodes 2 ... -- braid train --device cuda --grad-comm bf16   # multi-node"
)]
pub struct TrainArgs {
    /// tiny, 124M, 350M, 774M, 1558M, or L<layers>-H<heads>-C<width>[-V<vocab>][-T<context>].
    #[arg(long, default_value = "tiny")]
    model: String,
    /// synthetic, random (uniform tokens, for throughput), a UTF-8 text file, u16 token shards (.bin file or directory), or a .beton file of token windows (braid data write --tokens).
    #[arg(long, default_value = "synthetic")]
    data: String,
    /// bytes or gpt2 (default: bytes for a 256-token vocabulary, else gpt2).
    #[arg(long)]
    tokenizer: Option<String>,
    /// Training steps.
    #[arg(long, default_value_t = 400)]
    steps: usize,
    /// Sequences per micro-batch on each rank.
    #[arg(long, default_value_t = 16)]
    batch: usize,
    /// Sequences per step over all ranks and micro-batches, instead of
    /// --batch (must divide by ranks x --accum).
    #[arg(long)]
    global_batch: Option<usize>,
    /// Micro-batches per step (gradient accumulation: only the last one
    /// communicates). With more than one, a bf16 GPU run keeps the
    /// activations saved for the backward pass in memory of their own
    /// rather than in idle gradient memory (BRAID_SAVED_IN_GRADS)
    #[arg(long, default_value_t = 1)]
    accum: usize,
    /// Tokens per sequence (at most the model's context).
    #[arg(long, default_value_t = 64)]
    seq: usize,
    /// Peak learning rate (default: by model size, 3e-3 below 50M
    /// parameters, then GPT-3's choices: 6e-4 for 124M, 3e-4 for 350M,
    /// 2.5e-4 for 774M, 2e-4 above).
    #[arg(long)]
    lr: Option<f32>,
    /// Warmup steps.
    #[arg(long, default_value_t = 20)]
    warmup: usize,
    /// Weight decay on matrices and embeddings.
    #[arg(long, default_value_t = 0.1)]
    weight_decay: f32,
    /// Clip the gradients' global norm (0: off).
    #[arg(long, default_value_t = 1.0)]
    grad_clip: f64,
    /// adamw or sgd.
    #[arg(long, default_value = "adamw")]
    optimizer: String,
    /// Seed of initialisation, data order and sampling.
    #[arg(long, default_value_t = 1337)]
    seed: u64,
    /// Evaluate on held-out data every K steps and at the end (0: never).
    #[arg(long, default_value_t = 100)]
    eval_every: usize,
    /// Recompute activations in the backward pass instead of keeping them
    /// (less memory, more compute). GPU (bf16): layers keep their input,
    /// attention output and, where it fits, the attention's state; each
    /// block's backward pass runs two of its four products and a LayerNorm
    /// again (three products and both LayerNorms where the attention's
    /// state is not kept: BRAID_CKPT_ATTENTION=kept|recomputed|auto)
    #[arg(long)]
    checkpointing: bool,
    /// Print a progress line every K steps (default: about once a second).
    #[arg(long)]
    log_every: Option<usize>,
    /// Start from this checkpoint instead of a fresh initialisation.
    #[arg(long)]
    load: Option<PathBuf>,
    /// Save the trained model (safetensors) here.
    #[arg(long)]
    save: Option<PathBuf>,
    /// Element type of the saved checkpoint: f32 or bf16.
    #[arg(long, default_value = "f32")]
    save_dtype: String,
    /// Sharded checkpoints go here (one `step-NNNNNNNN` directory per
    /// save: every rank's parameters and optimizer state, the trainer's
    /// state, a manifest); saved at the end, and every --save-every steps.
    #[arg(long, value_name = "DIR")]
    ckpt_dir: Option<PathBuf>,
    /// Save a checkpoint into --ckpt-dir every K steps (in the background:
    /// training stalls only while the state is copied to host memory).
    #[arg(long, value_name = "K", default_value_t = 0)]
    save_every: usize,
    /// Keep only the N newest checkpoints in --ckpt-dir (0: all).
    #[arg(long, value_name = "N", default_value_t = 0)]
    keep: usize,
    /// Resume from a checkpoint: a checkpoint directory, a --ckpt-dir (its
    /// newest), or `auto` (--ckpt-dir's newest if there is one, else start
    /// afresh). Any world size and strategy: the state is resharded.
    #[arg(long, value_name = "DIR|auto")]
    resume: Option<String>,
    /// Write each checkpoint before training goes on, instead of in the
    /// background (to measure what the background write saves).
    #[arg(long)]
    ckpt_sync: bool,
    /// Also write every step (loss, eval loss, lr, norm, tokens/s, time
    /// breakdown) and the run's summary as JSON here.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Trace the run into DIR: every rank writes a Chrome/Perfetto
    /// trace (steps, data, forward and backward per block, collectives,
    /// optimizer, checkpoint copies, idle gaps; GPU work timed with CUDA
    /// events), clocks aligned through the store, merged into
    /// DIR/trace.json. `braid report DIR` analyses it.
    #[arg(long, value_name = "DIR")]
    trace: Option<PathBuf>,
    /// Serve live metrics (Prometheus text format) at HOST:PORT while
    /// training: step, loss, tokens/s, step-time split, collectives,
    /// memory. Each rank of a node serves on PORT + its local rank.
    #[arg(long, value_name = "HOST:PORT")]
    metrics_addr: Option<String>,
    /// Where to train: cpu, or cuda (one GPU per process; LOCAL_RANK picks it).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Arithmetic on the GPU: bf16 (mixed precision: bf16 products and
    /// activations, f32 master weights; the default on cuda) or f32. The
    /// CPU engine is f32.
    #[arg(long)]
    precision: Option<String>,
    /// Benchmark mode: time forward + backward only (no optimizer step).
    #[arg(long)]
    fwd_bwd_only: bool,
    /// Start N local workers (data parallel) through the launcher.
    #[arg(long, value_name = "N")]
    nproc: Option<usize>,
    /// How gradients travel between ranks: plain (f32), bf16, fp16, or
    /// powersgd[:RANK[:START_STEP]] (PyTorch's defaults: rank 1, from step 1000).
    #[arg(long, default_value = "plain")]
    grad_comm: String,
    /// Gradient bucket size in MiB (PyTorch's default 25; data parallelism
    /// and --zero 1).
    #[arg(long, default_value_t = BUCKET_MB)]
    bucket_mb: f64,
    /// First bucket's size in MiB (PyTorch's default 1).
    #[arg(long, default_value_t = FIRST_BUCKET_MB)]
    first_bucket_mb: f64,
    /// Reduce gradients after the backward pass instead of bucket by
    /// bucket during it (to measure what the overlap saves).
    #[arg(long)]
    no_overlap: bool,
    /// Shard the model states over the ranks: ZeRO stage 1 (AdamW state
    /// and master weights' updates sharded; gradients reduce-scattered
    /// after the backward pass, parameters all-gathered after every
    /// update), 2 (gradients reduce-scattered bucket by bucket during the
    /// backward pass, only the shard's kept) or 3 (parameters sharded too:
    /// each transformer block's gathered just before it runs and freed
    /// after; under --checkpointing, where a layer's gradient buffer can
    /// hold them, the tied embeddings' gradients reduce-scattered in two
    /// parts: BRAID_SPLIT_REDUCE=on|off|auto).
    #[arg(long, value_name = "STAGE")]
    zero: Option<u8>,
    /// FSDP: an alias of --zero 3.
    #[arg(long)]
    fsdp: bool,
    /// With --zero 3: keep each block's gathered parameters from the
    /// forward pass until its backward pass (FSDP2's
    /// reshard_after_forward=False): one gather per block and step instead
    /// of two, the whole model's parameters held at the peak.
    #[arg(long)]
    no_reshard_after_forward: bool,
    /// With --zero: hybrid sharding (HSDP) — shard within groups of N
    /// consecutive ranks (e.g. a node's GPUs), replicate across the groups.
    #[arg(long, value_name = "N")]
    shard_group: Option<usize>,
    /// Move model state off the GPU into host memory: `optimizer` keeps the
    /// f32 master weights and AdamW's moments there and runs the update on
    /// the CPU's cores (ZeRO-Offload's split: 12 bytes per parameter leave
    /// the GPU, which keeps the bf16 weights and the gradients); `none`.
    /// GPU only, one process or data-parallel.
    #[arg(long, default_value = "none", value_name = "WHAT")]
    offload: String,
    /// GPU, bf16: run the weight gradients of the first N layers after the
    /// embeddings' backward, so that the embeddings' gradient reduction
    /// (the largest, and final only at the end) overlaps them (default: 2
    /// when data-parallel, else 0).
    #[arg(long, value_name = "N")]
    defer_layers: Option<usize>,
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
enum OptimizerKind {
    AdamW,
    Sgd,
}

/// This process's place in a distributed run, when it is one.
fn world() -> Result<Option<braid_core::WorldInfo>, String> {
    if std::env::var_os(braid_core::env::WORLD_SIZE).is_none() {
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
    if local_workers <= 1 || std::env::var_os("RAYON_NUM_THREADS").is_some() {
        return;
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = (cores / local_workers).max(1);
    // Fails only if the pool already exists; then it keeps its size.
    let _ = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_global();
}

/// Runs `braid train`.
pub fn run_train(a: TrainArgs) -> Result<i32, String> {
    let optimizer = match a.optimizer.as_str() {
        "adamw" => OptimizerKind::AdamW,
        "sgd" => OptimizerKind::Sgd,
        o => return Err(format!("--optimizer {o:?}: expected adamw or sgd")),
    };
    if a.batch == 0 || a.seq == 0 || a.steps == 0 || a.accum == 0 {
        return Err("--batch, --seq, --steps and --accum must be positive".into());
    }
    let cuda = super::wants_cuda(&a.device)?;
    let precision = match (cuda, a.precision.as_deref()) {
        (true, p) => Precision::parse(p.unwrap_or("bf16"))?,
        (false, Some(p)) if Precision::parse(p) != Ok(Precision::F32) => {
            return Err(format!(
                "--precision {p}: the CPU engine trains in f32 (use --device cuda for bf16)"
            ))
        }
        (false, _) => Precision::F32,
    };
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
        ("--json", a.json.as_deref()),
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
    let world = world()?;
    if let (Some(n), None) = (a.nproc, &world) {
        if n == 0 {
            return Err("--nproc must be at least 1".into());
        }
        if cuda {
            let gpus = braid_cuda::device_count().map_err(|e| format!("--device cuda: {e}"))?;
            if n > gpus {
                return Err(format!(
                    "--nproc {n} with --device cuda needs {n} GPUs, but this machine has {gpus} \
                     (one GPU per process: use --nproc {gpus} or fewer)"
                ));
            }
        }
        // `--zero S --nproc 1`: a world of one rank, sharded over itself.
        if n > 1 || zero.is_some() {
            return super::workers::relaunch_locally(n, "--nproc");
        }
    }
    let ranks = world.as_ref().map_or(1, |w| w.world_size);
    let rank = world.as_ref().map_or(0, |w| w.rank);
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
            "--shard-group {shard_group} does not divide the {ranks} ranks: pick a divisor of {ranks} \
             (the ranks form groups of that many, each holding one copy of the sharded state)"
        ));
    }
    let lead = rank == 0;
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
    // ZeRO's buckets hold whole layers: no deferred weight gradients.
    let defer_for = |layers| match zero {
        Some(_) => 0,
        None => defer_layers(a.defer_layers, precision, ranks, layers),
    };
    // A loaded model is named by its file in the pre-flight's messages.
    let model_name = match &a.load {
        Some(path) => path.display().to_string(),
        None => a.model.clone(),
    };
    let shape = super::preflight::Shape {
        model: &model_name,
        seq: a.seq,
        checkpointing: a.checkpointing,
        sharding: Sharding {
            stage: zero.unwrap_or(0),
            ranks: shard_group,
        },
        ranks,
        local_workers: world.as_ref().map_or(1, |w| w.local_world_size),
        offload,
        accum: a.accum,
    };
    // Before the host spends time reading or initialising a model it (or
    // the GPU) cannot hold; the GPU is checked again, with the same
    // figures, once the run's device is set up.
    let preflight = |cfg: &GptConfig| -> Result<(), String> {
        let adamw = optimizer == OptimizerKind::AdamW;
        super::preflight::host(&shape, cfg, batch, cuda, precision, adamw)?;
        if cuda {
            let local = braid_core::world::local_rank_from_env().unwrap_or(0);
            let dev = braid_cuda::Device::open(local).map_err(|e| format!("--device cuda: {e}"))?;
            let defer = defer_for(cfg.n_layer);
            super::preflight::device(&shape, cfg, &dev, precision, batch, defer)?;
        }
        Ok(())
    };
    // Both arms give the parameters in the layout the run trains on.
    let (mut params, saved_tok) = match &a.load {
        Some(path) => {
            preflight(&checkpoint::config_of(path).map_err(|e| e.to_string())?)?;
            // Read straight into that layout: one copy of the model.
            let (p, report) = checkpoint::load_as(path, |cfg| train_layout(cfg, zero, shard_group))
                .map_err(|e| e.to_string())?;
            (p, report.metadata.get("braid.tokenizer").cloned())
        }
        None => {
            let cfg = GptConfig::parse(&a.model)?;
            preflight(&cfg)?;
            let started = Instant::now();
            // Drawn straight into the layout the run trains on (values by
            // tensor and chunk, not by offset: the same either way).
            let p = Params::init_gpt2(Arc::new(train_layout(&cfg, zero, shard_group)), a.seed);
            if lead {
                slow_note("parameters initialised", started, cfg.num_params());
            }
            (p, None)
        }
    };
    let cfg = params.layout.config;
    let lr = a.lr.unwrap_or_else(|| default_lr(cfg.num_params()));
    let tokenizer = tokenizer_for(a.tokenizer.as_deref(), saved_tok.as_ref(), cfg.vocab_size)?;
    let (data, data_desc) = open_data(&a.data, tokenizer, a.seq, a.seed)?;
    check_fits(&cfg, a.seq, &*data)?;
    let mut loader = TokenWindows::new(&*data, batch, a.seq, rank, ranks, a.seed)?;
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
    };
    if lead {
        println!(
            "braid train: model {} ({} layers, {} heads, width {}, vocab {}, context {}; {:.2}M parameters), data {} ({}, {}), batch {} x {} per rank{}, {} steps, lr {}, seed {}, {} threads{}",
            a.model,
            cfg.n_layer,
            cfg.n_head,
            cfg.n_embd,
            cfg.vocab_size,
            cfg.context,
            cfg.num_params() as f64 / 1e6,
            a.data,
            data_desc,
            tokenizer.name(),
            batch,
            a.seq,
            if a.accum > 1 { format!(" x {} micro-batches", a.accum) } else { String::new() },
            a.steps,
            lr,
            a.seed,
            rayon::current_num_threads(),
            if ranks > 1 { format!(" per rank, {ranks} ranks") } else { String::new() },
        );
        println!(
            "initial loss should be about ln({}) = {:.3}",
            cfg.vocab_size,
            (cfg.vocab_size as f64).ln()
        );
    }
    let mut shard_choice = ShardChoice {
        stage: zero,
        shard_group: a.shard_group,
        keep_params: a.no_reshard_after_forward,
        saved_in_grads: false,
        half_gathers: true,
        final_gather: a.save.is_some(),
        split_reduce: super::preflight::split_embedding_grads(
            &cfg,
            zero.unwrap_or(0),
            a.checkpointing,
        )?,
    };
    let ddp = DdpOptions {
        bucket_cap_mb: a.bucket_mb,
        first_bucket_mb: a.first_bucket_mb,
        grad_comm,
        overlap: !a.no_overlap,
    };
    let comm = match &world {
        Some(_) if ranks > 1 || zero.is_some() => {
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
    if a.resume.is_some() && grad_comm != GradComm::Plain && lead {
        println!(
            "note: --grad-comm {}: its state (error feedback) is not in checkpoints; a resumed run starts it afresh",
            a.grad_comm
        );
    }
    let run_desc = serde_json::json!({
        "model": a.model,
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
        "seq": a.seq,
        "batch_per_rank": batch,
        "accum": a.accum,
        "ranks": ranks,
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
        ranks,
        &strategy_name,
        run_desc.clone(),
        lead,
    )?;
    let mut tracing = super::train_trace::start(
        a.trace.as_deref(),
        a.metrics_addr.as_deref(),
        comm.as_ref(),
        run_desc.clone(),
        (batch * a.seq * a.accum * ranks) as f64,
    )?;
    let mut progress = Progress::new(lead, a.log_every, a.steps);
    progress.metrics = tracing.live();
    let mut tb = TokenBatch::new(batch, a.seq);
    let mut run_with =
        |engine: &mut dyn FnMut(
            &mut Progress,
            &mut TokenWindows,
            &mut TokenBatch,
        ) -> Result<RunReport, String>| { engine(&mut progress, &mut loader, &mut tb) };
    let run = if !cuda {
        let how = match optimizer {
            OptimizerKind::AdamW => CpuOptimizer::AdamW {
                weight_decay: a.weight_decay,
            },
            OptimizerKind::Sgd => CpuOptimizer::Sgd {
                weight_decay: a.weight_decay,
            },
        };
        let mut engine = CpuGpt::new(params, batch, a.seq, a.checkpointing, how);
        let run = match comm {
            None => run_with(&mut |p, l, b| {
                run_loop(
                    &mut engine,
                    &mut Single,
                    l,
                    b,
                    &opts,
                    p,
                    lead,
                    false,
                    (&mut ckpt, &mut tracing),
                )
            })?,
            Some(c) => {
                let mut s = distributed(HostCollective::new(c), shard_choice, ddp)?;
                run_with(&mut |p, l, b| {
                    run_loop(
                        &mut engine,
                        &mut *s,
                        l,
                        b,
                        &opts,
                        p,
                        lead,
                        true,
                        (&mut ckpt, &mut tracing),
                    )
                })?
            }
        };
        params = engine.into_params();
        run
    } else {
        let gpu = match &comm {
            Some(c) => Some(GpuCommunicator::init_from_env(c).map_err(|e| e.to_string())?),
            None => None,
        };
        let dev = match &gpu {
            Some(g) => g.device().clone(),
            None => {
                let local = braid_core::world::local_rank_from_env().unwrap_or(0);
                braid_cuda::Device::open(local).map_err(|e| format!("--device cuda: {e}"))?
            }
        };
        if lead {
            println!(
                "training on GPU {} ({}), {}{}{}",
                dev.ordinal(),
                dev.name().unwrap_or_default(),
                precision.name(),
                match offload {
                    true => ", optimizer offloaded to host memory",
                    false => "",
                },
                if ranks > 1 { ", one GPU per rank" } else { "" }
            );
        }
        let defer = defer_for(cfg.n_layer);
        let plan = super::preflight::device(&shape, &cfg, &dev, precision, batch, defer)?;
        if lead && plan.estimate > 0 {
            let mut lean = Vec::new();
            if plan.streamed_weights {
                lean.push("bf16 weights cast layer by layer instead of a full copy");
            }
            if plan.fused_attention && !plan.stored_score_grads {
                lean.push("attention score gradients recomputed, not stored");
            }
            if plan.fused_attention && a.checkpointing && !plan.keep_attention {
                lean.push("the attention recomputed too");
            }
            match (plan.saved_in_grads, zero) {
                (true, Some(_)) => {
                    lean.push("saved activations in the gradient shard until it fills")
                }
                (true, None) => lean.push(
                    "saved activations in the gradient buffer until the backward pass writes it",
                ),
                (false, _) => {}
            }
            if plan.half_gathers {
                lean.push("layers gathered in bf16");
            }
            if plan.split_embeddings {
                lean.push("the embeddings' gradients reduce-scattered in two parts");
            }
            println!(
                "GPU memory estimate: {:.2} GiB{}",
                braid_model::footprint::gib(plan.estimate),
                match lean.is_empty() {
                    true => String::new(),
                    false => format!(" ({})", lean.join("; ")),
                }
            );
        }
        shard_choice.saved_in_grads = plan.saved_in_grads;
        opts.saved_in_grads = plan.saved_in_grads && zero.is_none();
        shard_choice.half_gathers = plan.half_gathers;
        shard_choice.split_reduce = plan.split_embeddings;
        braid_cuda::pool::reset_peak();
        let options = braid_model::cuda::model_mixed::MixedOptions {
            checkpointing: a.checkpointing,
            streamed_weights: plan.streamed_weights,
            stored_score_grads: plan.stored_score_grads,
            keep_attention: plan.keep_attention,
        };
        let shape = (batch, a.seq);
        let started = Instant::now();
        // ZeRO-3 uploads only each rank's shard: the whole model never
        // sits on one GPU (the parameters wait in host memory until then).
        let sharded_start = zero == Some(3) && !offload;
        let mut engine = match offload {
            false if sharded_start => {
                GpuGpt::for_sharding(&dev, &mut params, shape, precision, options, a.weight_decay)?
            }
            false => GpuGpt::new(&dev, &params, shape, precision, options, a.weight_decay)?,
            // The master weights move into the engine (host memory holds
            // them once).
            true => {
                GpuGpt::offloaded(&dev, &mut params, shape, precision, options, a.weight_decay)?
            }
        };
        if lead {
            let what = match sharded_start {
                // Each rank's shard goes up when the strategy starts.
                true => "engine built (the parameters wait in host memory for their shards)",
                false => "model copied to the GPU",
            };
            slow_note(what, started, cfg.num_params());
        }
        if !offload {
            // The engine holds the parameters now; a --save makes the host
            // copy again at the end (at billions of parameters it is tens
            // of GB per worker).
            params.data = Vec::new();
        }
        engine.defer_weight_grads(defer)?;
        let run = match gpu {
            None => run_with(&mut |p, l, b| {
                run_loop(
                    &mut engine,
                    &mut Single,
                    l,
                    b,
                    &opts,
                    p,
                    lead,
                    false,
                    (&mut ckpt, &mut tracing),
                )
            })?,
            Some(g) => {
                let mut s = distributed(DeviceCollective::new(g)?, shard_choice, ddp)?;
                run_with(&mut |p, l, b| {
                    run_loop(
                        &mut engine,
                        &mut *s,
                        l,
                        b,
                        &opts,
                        p,
                        lead,
                        true,
                        (&mut ckpt, &mut tracing),
                    )
                })?
            }
        };
        if lead {
            if let Some(report) = engine.profile_report() {
                println!("{report}");
            }
            if let Some(cpu) = engine.offload_cpu_seconds() {
                println!(
                    "offloaded optimizer: the last update took {cpu:.2} s on the CPU ({} threads)",
                    rayon::current_num_threads()
                );
            }
        }
        if lead && a.save.is_some() {
            // Ends the engine first: an offloaded optimizer's master
            // weights move over instead of being copied.
            engine.into_params(&mut params)?;
        }
        run
    };
    let tokens_per_step = (batch * a.seq * a.accum * ranks) as f64;
    if lead {
        let summary = print_summary(
            &run,
            &cfg,
            a.seq,
            tokens_per_step,
            cuda.then_some(precision),
            ranks,
        );
        print_state(&run, &cfg, zero.unwrap_or(0), shard_group);
        if let Some(path) = &a.json {
            write_json(path, &run, summary.as_ref(), cfg.n_layer)?;
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

/// The layout a run trains on: under `--zero`, every block padded so that
/// it splits into one equal, aligned block per rank of the shard group.
fn train_layout(cfg: &GptConfig, zero: Option<u8>, shard_group: usize) -> Layout {
    match zero {
        Some(_) => Layout::padded(cfg, ZERO_ALIGN * shard_group),
        None => Layout::new(cfg),
    }
}

/// Says how long a start-up phase of a large model took, when it took
/// long enough for someone to wonder (a second or more).
fn slow_note(what: &str, started: Instant, params: usize) {
    let s = started.elapsed().as_secs_f64();
    if s >= 1.0 {
        println!("{what} in {s:.1} s ({:.2e} parameters)", params as f64);
    }
}

/// The training data: a `.beton` file's token windows, or a token
/// dataset (synthetic, random, text, shards) loaded into memory; and how
/// to describe it.
fn open_data(
    data: &str,
    tokenizer: Tokenizer,
    seq: usize,
    seed: u64,
) -> Result<(Box<dyn WindowSource>, String), String> {
    let path = std::path::Path::new(data);
    if path.extension().is_some_and(|e| e == "beton") {
        let b = BetonTokens::open(path, None)?;
        let desc = format!(
            "{} training and {} held-out windows of {} tokens, memory-mapped",
            b.windows(seq, false),
            b.windows(seq, true),
            b.window_len() - 1
        );
        if b.window_len() < seq + 1 {
            return Err(format!(
                "{data}: its windows hold {} tokens; --seq {seq} needs more: use --seq {} or less, or rewrite it with braid data write --seq {seq}",
                b.window_len() - 1,
                b.window_len() - 1
            ));
        }
        return Ok((Box::new(b), desc));
    }
    let d = Dataset::load(&Source::parse(data)?, tokenizer, seed)?;
    let desc = format!("{} tokens", d.len());
    Ok((Box::new(d), desc))
}

/// The loop with `strategy`, progress printed by the lead rank;
/// `distributed`: the strategy runs over a communicator (of one rank, or
/// more).
#[allow(clippy::too_many_arguments)]
fn run_loop<E, S>(
    engine: &mut E,
    strategy: &mut S,
    loader: &mut TokenWindows,
    batch: &mut TokenBatch,
    opts: &LoopOptions,
    progress: &mut Progress,
    lead: bool,
    distributed: bool,
    (ckpt, tracing): (
        &mut super::train_ckpt::CkptSetup,
        &mut super::train_trace::TraceSetup,
    ),
) -> Result<RunReport, String>
where
    E: Engine<Batch = TokenBatch>,
    S: Strategy<E> + ?Sized,
{
    if lead && distributed {
        println!("strategy: {}", strategy.describe());
    }
    let r = train_with(
        engine,
        strategy,
        loader,
        batch,
        opts,
        ckpt.loop_view(),
        &mut |r| progress.step(r),
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
    tracing.finish(&run)?;
    Ok(run)
}

#[cfg(test)]
mod tests {
    use super::default_lr;
    use braid_model::config::GptConfig;

    #[test]
    fn default_learning_rate_follows_the_model_size() {
        let lr = |m: &str| default_lr(GptConfig::parse(m).expect("valid").num_params());
        assert_eq!(lr("tiny"), 3e-3);
        assert_eq!(lr("124M"), 6e-4);
        assert_eq!(lr("350M"), 3e-4);
        assert_eq!(lr("774M"), 2.5e-4);
        assert_eq!(lr("1558M"), 2e-4);
    }
}
