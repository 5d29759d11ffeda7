//! `braid train` on CPUs without `--pp`: the run once `braid train` has
//! set it up — under `--tp` the tensor and data groups split from the
//! world and a tensor-parallel share of the model, the strategy over the
//! run's ranks (data parallel or ZeRO, wrapped for the tensor groups), the
//! loop, and for `--save` the whole model gathered from the shares.

use super::train::LoopParts;
use braid_comm::Communicator;
use braid_model::Params;
use braid_train::assemble::{strategy, ShardChoice, TensorSide};
use braid_train::collective::HostCollective;
use braid_train::ddp::DdpOptions;
use braid_train::engines::CpuGpt;
use braid_train::place::Place;
use braid_train::{train_with, RunReport};

/// What a CPU run takes from `braid train`'s set-up.
pub struct CpuRun<'r> {
    /// The world's communicator, where the run has several ranks.
    pub comm: Option<Communicator>,
    /// The whole model's parameters (given back after the run).
    pub params: Params,
    /// A rank's rows per micro-batch, and the sequence length.
    pub batch: usize,
    pub seq: usize,
    pub place: &'r Place,
    pub optimizer: super::train::OptimizerKind,
    pub weight_decay: f32,
    pub checkpointing: bool,
    /// `--offload optimizer`: AdamW through the offloaded update.
    pub offload: bool,
    /// `--save`: the whole model back from a tensor group's shares.
    pub save: bool,
    pub shard_choice: ShardChoice,
    pub ddp: DdpOptions,
    /// `--ps`: this worker's servers (the strategy is then theirs), and
    /// the model's name they agree on.
    pub ps: Option<&'r super::train_ps::Ps>,
    pub model: &'r str,
}

/// Runs training on the CPUs; `parts` is what the loop takes
/// besides the engine and the strategy. Returns the run and the parameters
/// after it (whole where this rank saves).
pub fn run(r: CpuRun<'_>, parts: &mut LoopParts<'_, '_>) -> Result<(RunReport, Params), String> {
    let CpuRun {
        comm,
        params,
        batch,
        seq,
        place,
        optimizer,
        weight_decay,
        checkpointing,
        offload,
        save,
        shard_choice,
        ddp,
        ps,
        model,
    } = r;
    let lead = parts.lead;
    let how = super::train::cpu_optimizer(optimizer, weight_decay);
    // Under --tp: the tensor and data groups, split from the world.
    let groups = match (&comm, place.tensor) {
        (Some(c), n) if n > 1 => Some(braid_train::place::split(c, place)?),
        _ => None,
    };
    if let (true, Some(g)) = (lead, &groups) {
        println!("mesh: {}", g.layout);
    }
    let mut engine = match &groups {
        None => CpuGpt::new(params, batch, seq, checkpointing, how),
        Some(g) => CpuGpt::tensor_parallel(
            params,
            batch,
            seq,
            checkpointing,
            how,
            g.tensor.clone(),
            place.sequence,
        )?,
    };
    if offload {
        engine = engine.offloaded()?;
    }
    let tensor_group = groups.as_ref().map(|g| g.tensor.clone());
    let several = comm.is_some() || ps.is_some();
    if let Some(ps) = ps {
        let len = braid_train::Engine::params(&engine).len();
        let checkpoints = parts.ckpt.saver.is_some() || ps.world.rank != 0;
        let mut s = super::train_ps::worker_strategy(ps, model, len, &ddp, checkpoints)?;
        let run = super::train::run_loop(parts, &mut engine, &mut s, several, train_with)?;
        return Ok((run, engine.into_params()));
    }
    let (data, tensor) = match (comm, groups) {
        (None, _) => (None, None),
        (Some(c), None) => (Some(HostCollective::new(c)), None),
        (Some(c), Some(g)) => (
            Some(g.data),
            Some(TensorSide {
                world: c,
                tensor: place.tensor,
                sequence: place.sequence,
                mesh: g.layout,
                traffic: g.tensor.traffic(),
            }),
        ),
    };
    let mut s = strategy(data, &place.mesh()?, tensor, shard_choice, ddp)?;
    let run = super::train::run_loop(parts, &mut engine, &mut *s, several, train_with)?;
    drop(s);
    let mut params = engine.into_params();
    if let (Some(g), true, 0) = (&tensor_group, save, place.data_rank()) {
        // The whole model, from every rank's share (the first data
        // group's ranks hold whole shares after the run).
        params = braid_train::tensor_parallel::gather_whole(&params, &**g)?;
    }
    Ok((run, params))
}
