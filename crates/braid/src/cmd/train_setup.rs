//! What `braid train`'s loop is set up with once the model is there: the
//! loop's options, the sharding and gradient-reduction choices, the
//! world's communicator, checkpoints, tracing and the progress printer.

use super::train::TrainArgs;
use super::train_check::Choices;
use super::train_ckpt::{CkptFlags, CkptSetup};
use super::train_output::Progress;
use super::train_pipeline::PipeFlags;
use super::train_place::Placement;
use super::train_trace::TraceSetup;
use braid_comm::{CommOptions, Communicator};
use braid_core::env;
use braid_model::optim::Schedule;
use braid_model::GptConfig;
use braid_train::assemble::ShardChoice;
use braid_train::ddp::DdpOptions;
use braid_train::schedule::check::Checked as PipeSchedule;
use braid_train::LoopOptions;

/// The loop's options: `lr`'s schedule over the steps, evaluation, and
/// (`keep_first_grads`, for `BRAID_DUMP_GRADS`) the first step's
/// gradients kept.
pub fn loop_options(a: &TrainArgs, lr: f32, ranks: usize, keep_first_grads: bool) -> LoopOptions {
    LoopOptions {
        steps: a.steps,
        accum: a.accum,
        schedule: {
            let total = a.lr_steps.unwrap_or(a.steps);
            Schedule {
                max_lr: lr,
                min_lr: lr * 0.1,
                warmup: a.warmup.min(total.max(1)),
                total,
            }
        },
        grad_clip: a.grad_clip,
        eval_every: a.eval_every,
        eval_batches: 4,
        update: !a.fwd_bwd_only,
        profile_warmup: 5,
        measure_unoverlapped: ranks > 1,
        // The GPU pre-flight decides (below).
        saved_in_grads: false,
        keep_first_grads,
    }
}

/// How the model states are sharded (`--zero` and its flags, and the
/// environment's choices for ZeRO-3).
pub fn shard_choice(a: &TrainArgs, c: &Choices, cfg: &GptConfig) -> Result<ShardChoice, String> {
    Ok(ShardChoice {
        stage: c.zero,
        keep_params: a.no_reshard_after_forward,
        saved_in_grads: false,
        half_gathers: true,
        final_gather: a.save.is_some(),
        split_reduce: super::preflight::split_embedding_grads(
            cfg,
            c.zero.unwrap_or(0),
            a.checkpointing,
        )?,
        kept_spares: super::preflight::env_choice(env::BRAID_ZERO3_SPARES, "kept", "capped")?,
    })
}

/// How data parallelism reduces the gradients: buckets, the wire's
/// format, overlap with the backward pass.
pub fn ddp_options(a: &TrainArgs, c: &Choices) -> DdpOptions {
    DdpOptions {
        bucket_cap_mb: a.bucket_mb,
        first_bucket_mb: a.first_bucket_mb,
        grad_comm: c.grad_comm,
        overlap: !a.no_overlap,
    }
}

/// The world's communicator, where the run has several ranks or shards
/// over one (stopping the run on SIGTERM).
pub fn communicator(c: &Choices, world_size: usize) -> Result<Option<Communicator>, String> {
    if c.ps.is_some() {
        // A parameter-server run's workers share no collective.
        return Ok(None);
    }
    Ok(match &c.world {
        Some(_) if world_size > 1 || c.zero.is_some() => {
            let comm = super::workers::init(CommOptions::from_env().map_err(|e| e.to_string())?)?;
            super::workers::stop_on_sigterm(&comm);
            Some(comm)
        }
        _ => None,
    })
}

/// The run's checkpoints (`--ckpt-dir`, `--save-every`, `--keep`,
/// `--resume`), described by `run_desc`, committed once every rank of
/// the world has written its files.
pub fn checkpoints(
    a: &TrainArgs,
    p: &Placement,
    comm: Option<&Communicator>,
    ps: Option<&super::train_ps::Ps>,
    strategy: &str,
    run_desc: serde_json::Value,
) -> Result<CkptSetup, String> {
    if ps.is_some() {
        return ps_checkpoints(a, p, strategy, run_desc);
    }
    let mut ckpt = super::train_ckpt::setup(
        &CkptFlags {
            dir: a.ckpt_dir.as_deref(),
            every: a.save_every,
            keep: a.keep,
            resume: a.resume.as_deref(),
            sync: a.ckpt_sync,
        },
        p.rank,
        p.world_size,
        strategy,
        run_desc,
        p.lead,
    )?;
    // A checkpoint is committed once every rank of the run has written
    // its files: the agreement goes over the world, not the strategy's
    // ranks (under --pp those are one stage's data group).
    if let Some(c) = comm {
        ckpt.agree_over(c);
    }
    Ok(ckpt)
}

/// A parameter-server run's checkpoints: worker 0 writes them whole and
/// commits them alone (the workers share no collective to agree over);
/// every worker resumes from them, but a worker's process started again
/// after it died rejoins the servers instead.
fn ps_checkpoints(
    a: &TrainArgs,
    p: &Placement,
    strategy: &str,
    run_desc: serde_json::Value,
) -> Result<CkptSetup, String> {
    let restarted = super::train_ps_restart::attempt().unwrap_or(0) > 0;
    let mut ckpt = super::train_ckpt::setup(
        &CkptFlags {
            dir: a.ckpt_dir.as_deref(),
            every: a.save_every,
            keep: a.keep,
            resume: a.resume.as_deref().filter(|_| !restarted),
            sync: a.ckpt_sync,
        },
        0,
        1,
        strategy,
        run_desc,
        p.lead,
    )?;
    if p.rank != 0 {
        ckpt.saver = None;
    }
    Ok(ckpt)
}

/// The trace's description of the run: `run_desc`, and under `--pp`
/// (when traced) the pipeline's layout, which `braid report` reads.
pub fn trace_desc(
    a: &TrainArgs,
    run_desc: &serde_json::Value,
    cfg: &GptConfig,
    pipe_schedule: Option<&PipeSchedule>,
    pipe_flags: &PipeFlags<'_>,
    p: &Placement,
) -> Result<serde_json::Value, String> {
    Ok(match pipe_schedule {
        Some(s) if a.trace.is_some() => {
            super::train_pipeline_run::traced_desc(run_desc.clone(), cfg, s, pipe_flags, &p.place)?
        }
        _ => run_desc.clone(),
    })
}

/// Tracing (`--trace`) and live metrics (`--metrics-addr`), started with
/// the trace's description `desc` and the tokens of a step of `seq`.
pub fn tracing(
    a: &TrainArgs,
    p: &Placement,
    seq: usize,
    comm: Option<&Communicator>,
    ps: Option<&super::train_ps::Ps>,
    desc: serde_json::Value,
) -> Result<TraceSetup, String> {
    let ps = match (ps, &a.trace) {
        (Some(ps), Some(_)) => Some((p.rank, p.world_size, super::train_ps::store_client(ps)?)),
        _ => None,
    };
    super::train_trace::start(
        a.trace.as_deref(),
        a.metrics_addr.as_deref(),
        comm,
        ps,
        desc,
        (p.batch * seq * a.accum * p.ranks) as f64,
    )
}

/// The progress printer (on the lead), with the live metrics and, for a
/// CPU run, a hint where it would be slow.
pub fn progress(a: &TrainArgs, c: &Choices, lead: bool, tracing: &TraceSetup) -> Progress {
    let mut progress = Progress::new(lead, a.log_every, a.steps);
    progress.metrics = tracing.live();
    if !c.cuda {
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
    progress
}
