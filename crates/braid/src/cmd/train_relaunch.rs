//! `braid train --nproc-per-node N` started alone: what its workers would
//! each refuse, checked once here (the mesh, the pipeline, the GPUs, the
//! environment), and the workers started through the launcher.

use super::train::{gather_via_checked, pipe_flags, update_beside_removed, TrainArgs};
use super::train_check::Choices;
use braid_core::env;
use braid_model::GptConfig;

/// Starts the workers `--nproc-per-node` asks for, when this process was
/// not started as one of them, after the checks they would each make;
/// `Some` of their exit status when it started them, `None` where this
/// process trains (one process, no world of workers to start).
pub fn relaunched(a: &TrainArgs, c: &Choices) -> Result<Option<i32>, String> {
    let (Some(n), None) = (c.nproc, &c.world) else {
        return Ok(None);
    };
    // What --tp cannot do, said once here rather than by every worker.
    if a.tp > 1 || a.pp > 1 {
        mesh_checked(a, c, n)?;
    }
    if c.cuda {
        gpus_checked(a, n)?;
    }
    // Said once here too, not by every worker.
    update_beside_removed()?;
    gather_via_checked(c.zero, c.cuda)?;
    // `--zero S --nproc 1`: a world of one rank, sharded over itself.
    if n > 1 || c.zero.is_some() {
        // JSON on stdout reaches it unprefixed.
        let json_stdout = a.json.as_ref().is_some_and(|j| j.is_stdout());
        return super::workers::relaunch_locally(n, !json_stdout).map(Some);
    }
    Ok(None)
}

/// A `--tp` or `--pp` run of `n` workers: the mesh, the tensor groups'
/// environment, the pipeline and the model's split, checked before they
/// start.
fn mesh_checked(a: &TrainArgs, c: &Choices, n: usize) -> Result<(), String> {
    braid_train::place::Place {
        world: n,
        rank: 0,
        tensor: a.tp,
        pipe: a.pp,
        sequence: c.sequence,
        shard_group: a.shard_group,
    }
    .check(n)?;
    if a.tp > 1 {
        super::train_mesh::tensor_overlap_blocks()?;
        super::train_mesh::tensor_sums_in_bf16()?;
        super::train_mesh::tensor_grad_sums_beside()?;
        super::train_mesh::sequence_knobs(c.sequence && c.cuda && c.precision.mixed())?;
    }
    if a.pp > 1 {
        pipeline_checked(a, &c.model, n)?;
    }
    if a.load.is_none() {
        let cfg = GptConfig::parse(&c.model)?;
        braid_model::layout::TensorShard {
            rank: 0,
            size: a.tp,
        }
        .check(&cfg)?;
    }
    Ok(())
}

/// A `--pp` run of `n` workers: the schedule and the stages against
/// `model` (unless loaded) and a rank's batch, and the pipeline's
/// environment choices.
fn pipeline_checked(a: &TrainArgs, model: &str, n: usize) -> Result<(), String> {
    // The schedule and the stages, checked once here.
    let flags = pipe_flags(a);
    // A rank's batch: --batch, or its share of --global-batch
    // (a share that does not divide is refused below).
    let data = n / (a.tp * a.pp);
    let batch = match a.global_batch {
        Some(g) if g % (data * a.accum) == 0 => Some(g / (data * a.accum)),
        Some(_) => None,
        None => Some(a.batch),
    };
    let cfg = match &a.load {
        None => Some(GptConfig::parse(model)?),
        Some(_) => None,
    };
    super::train_pipeline::checked(&flags, cfg.as_ref(), model, batch)?;
    // The pipeline's environment choices, once here too.
    for (var, yes, no) in [
        (env::BRAID_PP_EMBEDDINGS, "last", "first"),
        (env::BRAID_CKPT_ATTENTION_OUTPUT, "recomputed", "kept"),
    ] {
        super::preflight::env_choice(var, yes, no)?;
    }
    Ok(())
}

/// `--device cuda` over `n` workers here: the flash kernels' choices,
/// and a GPU for each.
fn gpus_checked(a: &TrainArgs, n: usize) -> Result<(), String> {
    braid_model::cuda::flash::FlashKernels::check_env().map_err(|e| e.to_string())?;
    let gpus = super::gpus_for(&a.device)?;
    if n > gpus {
        return Err(format!(
            "--nproc-per-node {n} with --device cuda needs {n} GPUs, but this machine has \
             {gpus} (one GPU per process: use --nproc-per-node {gpus} or fewer)"
        ));
    }
    Ok(())
}
