//! `braid train`'s flag checks that need no world: every flag and flag
//! combination refused before workers are started or a model is read,
//! in one order, and the choices they resolve to (the optimizer, the
//! device and precision, sequence parallelism, the ZeRO stage, the
//! offload, the workers to start).

use super::train::{
    gpu_memory_budget, model_of, paths_checked, sequence_parallel, world, ModelChoice,
    OptimizerKind, TrainArgs, BUCKET_MB, FIRST_BUCKET_MB,
};
use super::train_strategy::{zero_stage, ZeroFlags};
use braid_train::collective::GradComm;
use braid_train::engines::Precision;
use std::path::PathBuf;

/// What `braid train`'s flags resolve to, once checked.
pub struct Choices {
    /// The model to train (`--model`, else the resumed checkpoint's, else
    /// tiny), and a note where it came from the checkpoint.
    pub model: String,
    pub model_note: Option<String>,
    /// The checkpoint resumed (its directory and its run's description).
    pub resumed: Option<(PathBuf, serde_json::Value)>,
    pub optimizer: OptimizerKind,
    /// This process's place in a distributed run, when it is one.
    pub world: Option<braid_core::WorldInfo>,
    /// The workers to start here (`--nproc-per-node`, or a lone `--tp` or
    /// `--pp` run's model-parallel group).
    pub nproc: Option<usize>,
    /// On GPUs, and with `--device auto` what was chosen and why.
    pub cuda: bool,
    pub device_note: Option<String>,
    pub precision: Precision,
    /// Sequence parallelism in the tensor groups, and a note where its
    /// default is off.
    pub sequence: bool,
    pub sequence_note: Option<String>,
    /// `--gpu-memory` in bytes.
    pub gpu_memory: Option<u128>,
    pub grad_comm: GradComm,
    /// `--zero` (or `--fsdp`): the ZeRO stage.
    pub zero: Option<u8>,
    /// `--offload optimizer`.
    pub offload: bool,
    /// `--ps`: the parameter server's roles (on a worker, `world` is the
    /// workers' alone).
    pub ps: Option<super::train_ps::Ps>,
}

/// Checks `braid train`'s flags in their order (refusing the first that
/// is wrong) and resolves them.
pub fn checked(a: &TrainArgs) -> Result<Choices, String> {
    paths_checked(a)?;
    let ModelChoice {
        name: model,
        note: model_note,
        resumed,
    } = model_of(a)?;
    let optimizer = optimizer_of(a)?;
    numbers_checked(a)?;
    checkpoint_flags_checked(a)?;
    let mut world = world()?;
    let nproc = nproc_of(a, world.as_ref())?;
    let ps = super::train_ps::checked(a, world.as_ref(), nproc)?;
    if let Some(p) = ps
        .as_ref()
        .filter(|p| p.server.is_none() && world.is_some())
    {
        // A worker trains in the workers' world.
        world = Some(p.workers_world());
    }
    // Workers on this node: the launcher's, or those --nproc-per-node starts.
    let local_workers = match &world {
        Some(w) => w.local_world_size,
        None => nproc.unwrap_or(1),
    };
    let super::Device { cuda, chosen } = match (a.ps, a.device.as_str()) {
        // The parameter server's workers train on the CPU engine (--device
        // cuda is refused with --ps above).
        (Some(_), "auto") => super::Device {
            cuda: false,
            chosen: Some(
                "device: cpu (--device auto with --ps: the parameter server's workers train on the CPU \
                 engine)"
                    .into(),
            ),
        },
        _ => super::Device::resolve(&a.device, local_workers)?,
    };
    parallel_flags_checked(a, cuda)?;
    let precision = precision_of(a, cuda)?;
    let (sequence, sequence_note) = sequence_parallel(a, cuda, precision)?;
    let gpu_memory = gpu_memory_budget(a, cuda)?;
    gpu_engine_checked(a, cuda, precision, optimizer)?;
    let grad_comm = GradComm::parse(&a.grad_comm)?;
    if let (GradComm::TopK(_), None) = (grad_comm, a.ps) {
        return Err(format!(
            "--grad-comm {}: top-k with error feedback compresses a parameter server's pushes \
             (add --ps N); data parallelism's all-reduce sums dense buckets (try fp16 or \
             powersgd)",
            a.grad_comm
        ));
    }
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
    let offload = offload_of(a, zero, optimizer)?;
    Ok(Choices {
        model,
        model_note,
        resumed,
        optimizer,
        world,
        nproc,
        cuda,
        device_note: chosen,
        precision,
        sequence,
        sequence_note,
        gpu_memory,
        grad_comm,
        zero,
        offload,
        ps,
    })
}

/// `--optimizer`: adamw or sgd.
fn optimizer_of(a: &TrainArgs) -> Result<OptimizerKind, String> {
    match a.optimizer.as_str() {
        "adamw" => Ok(OptimizerKind::AdamW),
        "sgd" => Ok(OptimizerKind::Sgd),
        o => Err(format!("--optimizer {o:?}: expected adamw or sgd")),
    }
}

/// Refuses counts of 0 (`--batch`, `--seq`, `--steps`, `--accum`,
/// `--global-batch`, `--lr-steps`) and rates that are negative or not
/// finite.
fn numbers_checked(a: &TrainArgs) -> Result<(), String> {
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
    if a.lr_steps == Some(0) {
        return Err("--lr-steps 0: the schedule spans 1 or more steps (default: --steps)".into());
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
    Ok(())
}

/// Refuses `--save-dtype` without `--save` (or of another type), and
/// `--resume auto`, `--save-every` and `--keep` without `--ckpt-dir`.
fn checkpoint_flags_checked(a: &TrainArgs) -> Result<(), String> {
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
    Ok(())
}

/// The workers to start here: `--nproc-per-node`'s count, or, for a
/// tensor- or pipeline-parallel run started alone, its group.
fn nproc_of(a: &TrainArgs, world: Option<&braid_core::WorldInfo>) -> Result<Option<usize>, String> {
    // A tensor-parallel run started alone starts its group.
    match (a.nproc, a.tp * a.pp, world) {
        (None, model, None) if model > 1 => Ok(Some(model)),
        (n, _, _) => n.map(|n| n.count()).transpose(),
    }
}

/// Refuses what a pipeline does not take yet (`--zero 2` and 3 and
/// `--offload` on GPUs, `--accum`), a pipeline's flags without `--pp`,
/// and `--offload` with `--tp` on GPUs.
fn parallel_flags_checked(a: &TrainArgs, cuda: bool) -> Result<(), String> {
    if a.pp > 1 {
        if let (Some(z @ (2 | 3)), true) = (a.zero.or(a.fsdp.then_some(3)), cuda) {
            return Err(format!(
                "--pp {} with --zero {z} on GPUs: not built yet (the CPU stages take it). --zero \
                 1 shards the optimizer state over the data dimension of a GPU pipeline",
                a.pp
            ));
        }
        if a.offload != "none" && cuda {
            return Err(format!(
                "--pp {} with --offload {} on GPUs: not built yet (the CPU stages take it; on a \
                 GPU the offloaded optimizer lives inside the one-process engine)",
                a.pp, a.offload
            ));
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
    if a.tp > 1 && a.offload != "none" && cuda {
        return Err(format!(
            "--tp {} with --offload {} on GPUs: not built yet (the CPU shares take it; drop one \
             of them)",
            a.tp, a.offload
        ));
    }
    Ok(())
}

/// `--precision`: bf16 by default on GPUs; the CPU engine's f32 only.
fn precision_of(a: &TrainArgs, cuda: bool) -> Result<Precision, String> {
    match (cuda, a.precision.as_deref()) {
        (true, p) => Precision::parse(p.unwrap_or("bf16")),
        (false, Some(p)) if Precision::parse(p) != Ok(Precision::F32) => Err(format!(
            "--precision {p}: the CPU engine trains in f32 (use --device cuda for bf16 or fp8)"
        )),
        (false, _) => Ok(Precision::F32),
    }
}

/// Refuses what the GPU engine does not do: `--checkpointing` outside
/// bf16, and optimizers other than AdamW.
fn gpu_engine_checked(
    a: &TrainArgs,
    cuda: bool,
    precision: Precision,
    optimizer: OptimizerKind,
) -> Result<(), String> {
    if cuda && a.checkpointing && !precision.mixed() {
        return Err(format!(
            "--checkpointing: the GPU engine recomputes blocks in bf16 only (drop \
             --precision {} or the flag)",
            precision.name()
        ));
    }
    if cuda && optimizer != OptimizerKind::AdamW {
        return Err("--device cuda trains with adamw only (so far)".into());
    }
    Ok(())
}

/// `--offload`: whether the optimizer moves to host memory (AdamW,
/// without ZeRO or a parameter server). On the CPU the state is in host
/// memory already; the offloaded update runs all the same (so a pipeline
/// or a tensor-parallel run with it can be checked on any machine).
fn offload_of(a: &TrainArgs, zero: Option<u8>, optimizer: OptimizerKind) -> Result<bool, String> {
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
    if offload && optimizer != OptimizerKind::AdamW {
        return Err(format!(
            "--offload optimizer with --optimizer {}: the offloaded optimizer is AdamW (drop \
             one of them)",
            a.optimizer
        ));
    }
    if offload && a.ps.is_some() {
        return Err(
            "--offload optimizer with --ps: a parameter server's servers hold the optimizer \
             already (drop --offload)"
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
    Ok(offload)
}
