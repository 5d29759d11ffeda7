//! How `braid train` spreads a run over several ranks: the flags that
//! shard the optimizer (`--zero`, `--fsdp`, `--shard-group`), checked, and
//! the one place every run's strategy is built ([`strategy`]): one
//! process alone, or over the run's data group (host or GPU collectives)
//! data parallelism or ZeRO — [`distributed`] for an engine that can run
//! under any of them, [`replicated`] (data parallelism or ZeRO-1, every
//! rank holding the whole model) for one that shards its optimizer only
//! (a GPU pipeline's stages) — wrapped for the tensor groups under `--tp`.

use braid_comm::Communicator;
use braid_train::collective::{Collective, DeviceCollective, GradComm, HostCollective};
use braid_train::ddp::{DataParallel, DdpOptions};
use braid_train::engines::{CpuGpt, CpuStage, GpuGpt, GpuStage};
use braid_train::mesh::{DataGroups, Mesh};
use braid_train::tensor_parallel::{TensorParallel, TensorTraffic};
use braid_train::zero::{Zero, ZeroOptions};
use braid_train::zero3::Zero3;
use braid_train::{
    Engine, EngineInfo, LendsMemory, ShardedOptimizer, ShardedParams, Single, Strategy,
};
use std::sync::Arc;

/// The flags that choose how the optimizer is sharded.
pub struct ZeroFlags<'a> {
    /// `--zero`.
    pub zero: Option<u8>,
    /// `--fsdp`.
    pub fsdp: bool,
    /// `--shard-group`.
    pub shard_group: Option<usize>,
    /// `--grad-comm`, as given and parsed.
    pub grad_comm: (&'a str, GradComm),
    /// `--defer-layers`.
    pub defer_layers: Option<usize>,
    /// `--no-reshard-after-forward`.
    pub keep_params: bool,
    /// `--bucket-mb` or `--first-bucket-mb` given (not their defaults).
    pub buckets: bool,
}

/// The ZeRO stage asked for (`--zero`, `--fsdp`), checked against the
/// rest of the run.
pub fn zero_stage(a: &ZeroFlags<'_>) -> Result<Option<u8>, String> {
    let stage = match (a.zero, a.fsdp) {
        (None, false) if a.shard_group.is_some() => {
            return Err("--shard-group shards the optimizer: add --zero 1, 2 or 3".into())
        }
        (None, false) if a.keep_params => {
            return Err("--no-reshard-after-forward is ZeRO-3's: add --zero 3 (or --fsdp)".into())
        }
        (None, false) => return Ok(None),
        (Some(s), true) if s != 3 => {
            return Err(format!(
                "--zero {s} with --fsdp: --fsdp means --zero 3 (give one of them)"
            ))
        }
        (_, true) => 3,
        (Some(s), false) => s,
    };
    match stage {
        1..=3 => {}
        s => return Err(format!("--zero {s}: expected 1, 2 or 3")),
    }
    if a.keep_params && stage != 3 {
        return Err(format!(
            "--no-reshard-after-forward keeps ZeRO-3's gathered parameters; --zero {stage} \
             does not gather them (use --zero 3)"
        ));
    }
    if a.buckets && stage >= 2 {
        return Err(format!(
            "--zero {stage} reduce-scatters each parameter block (the embeddings, each layer, \
             the final norm) as soon as it is final: --bucket-mb and --first-bucket-mb size data \
             parallelism's and --zero 1's buckets (drop them)"
        ));
    }
    if a.grad_comm.1 != GradComm::Plain {
        return Err(format!(
            "--zero {stage} with --grad-comm {}: ZeRO reduce-scatters f32 gradients (drop --grad-comm)",
            a.grad_comm.0
        ));
    }
    if a.defer_layers.is_some_and(|n| n > 0) {
        return Err(format!(
            "--zero {stage} with --defer-layers: ZeRO's buckets hold whole layers (drop --defer-layers)"
        ));
    }
    Ok(Some(stage))
}

/// Under ZeRO every rank's block of a layout block starts at a multiple of
/// this many elements (256 bytes of f32).
pub const ZERO_ALIGN: usize = 64;

/// How a multi-rank run shards its model state (from the checked flags).
#[derive(Debug, Clone, Copy)]
pub struct ShardChoice {
    /// The ZeRO stage (`None`: data parallelism).
    pub stage: Option<u8>,
    /// `--no-reshard-after-forward` (stage 3).
    pub keep_params: bool,
    /// Stage 3: the engine's saved activations in the gradient shard's
    /// memory (the pre-flight's choice).
    pub saved_in_grads: bool,
    /// Stage 3: gather in bf16 the blocks the engine takes so, where the
    /// collectives can (the pre-flight's choice on a GPU).
    pub half_gathers: bool,
    /// Stage 3: gather the whole parameters back at the end (for
    /// `--save`).
    pub final_gather: bool,
    /// Stage 3: the tied embeddings' gradients reduce-scattered in two
    /// parts (`preflight::split_embedding_grads`).
    pub split_reduce: bool,
    /// Stage 3: every freed block buffer kept for reuse, or at most a few
    /// (`BRAID_ZERO3_SPARES`; `None`: as the collectives suit).
    pub kept_spares: Option<bool>,
}

/// Under `--tp`, what wraps the data group's strategy: the world's
/// communicator, the tensor groups' size, sequence parallelism, the mesh
/// in one line and the tensor group's traffic (counted into every step).
pub struct TensorSide {
    pub world: Communicator,
    pub tensor: usize,
    pub sequence: bool,
    pub mesh: String,
    pub traffic: Arc<TensorTraffic>,
}

/// Which data-parallel strategies an engine runs under, over collectives
/// `C`: [`distributed`]'s where it shards its parameters
/// ([`ShardedParams`]), [`replicated`]'s where it shards its optimizer
/// only.
pub trait DataStrategy<C: Collective>: Engine + Sized + 'static {
    /// The strategy over the data groups `groups`.
    fn over(
        groups: DataGroups<C>,
        choice: ShardChoice,
        ddp: DdpOptions,
    ) -> Result<Box<dyn Strategy<Self>>, String>;
}

/// A run's strategy — the one place `braid train` builds it: one process
/// alone (no `data` group), else over the data group as the engine takes
/// it ([`DataStrategy`]) with `choice` and `ddp` — its shard groups and
/// their replicas under hybrid sharding split from it as the run's
/// `mesh` says; wrapped for the tensor groups under `--tp` (`tensor`).
pub fn strategy<C, E>(
    data: Option<C>,
    mesh: &Mesh,
    tensor: Option<TensorSide>,
    choice: ShardChoice,
    ddp: DdpOptions,
) -> Result<Box<dyn Strategy<E>>, String>
where
    C: Collective,
    E: DataStrategy<C>,
{
    let inner: Box<dyn Strategy<E>> = match data {
        None => Box::new(Single),
        Some(c) => E::over(DataGroups::split(&mesh.view("data"), c)?, choice, ddp)?,
    };
    Ok(match tensor {
        None => inner,
        Some(t) => Box::new(
            TensorParallel::new(inner, t.world, t.tensor, t.sequence, t.mesh).counting(t.traffic),
        ),
    })
}

/// Engines that shard their parameters: every data-parallel strategy.
macro_rules! distributed_over {
    ($($engine:ty => $comm:ty),* $(,)?) => {$(
        impl DataStrategy<$comm> for $engine {
            fn over(
                groups: DataGroups<$comm>,
                choice: ShardChoice,
                ddp: DdpOptions,
            ) -> Result<Box<dyn Strategy<Self>>, String> {
                distributed(groups, choice, ddp)
            }
        }
    )*};
}

distributed_over!(CpuGpt => HostCollective, CpuStage => HostCollective, GpuGpt => DeviceCollective);

/// A GPU pipeline's stages shard their optimizer only (ZeRO-2 and 3 are
/// refused before they are built).
impl DataStrategy<DeviceCollective> for GpuStage {
    fn over(
        groups: DataGroups<DeviceCollective>,
        choice: ShardChoice,
        ddp: DdpOptions,
    ) -> Result<Box<dyn Strategy<Self>>, String> {
        replicated(groups, choice, ddp)
    }
}

/// The strategy over `comm`: ZeRO as `choice` says (stage 3 keeping
/// gathered parameters from the forward pass to the backward when
/// `keep_params`) when there is a stage, else data parallelism, with the
/// buckets of `ddp`.
fn distributed<C, E>(
    groups: DataGroups<C>,
    choice: ShardChoice,
    ddp: DdpOptions,
) -> Result<Box<dyn Strategy<E>>, String>
where
    C: Collective + 'static,
    E: ShardedParams<Space = C::Space> + LendsMemory + EngineInfo + 'static,
{
    let ShardChoice {
        stage,
        keep_params,
        saved_in_grads,
        half_gathers,
        final_gather,
        split_reduce,
        kept_spares,
    } = choice;
    match stage {
        Some(3) => Ok(Box::new(
            Zero3::new(groups, !keep_params)?
                .with_saved_in_grads(saved_in_grads)
                .with_half_gathers(half_gathers)
                .with_final_gather(final_gather)
                .with_split_reduce(split_reduce)
                .with_kept_spares(kept_spares),
        )),
        // Stage 2 writes gradients block by block (no whole buffer).
        Some(2) => Ok(Box::new(Zero3::stage_2(groups)?)),
        _ => replicated(groups, choice, ddp),
    }
}

/// The strategy over `comm` whose ranks each hold the whole model: ZeRO-1
/// when `choice` has a stage (stages 2 and 3, which run on ZeRO-3's block
/// machinery, are refused: [`distributed`] builds them), else data
/// parallelism, with the buckets of `ddp`.
fn replicated<C, E>(
    groups: DataGroups<C>,
    choice: ShardChoice,
    ddp: DdpOptions,
) -> Result<Box<dyn Strategy<E>>, String>
where
    C: Collective + 'static,
    E: ShardedOptimizer<Space = C::Space> + EngineInfo + 'static,
{
    Ok(match choice.stage {
        Some(stage) => Box::new(Zero::new(
            groups,
            ZeroOptions {
                stage,
                bucket_cap_mb: ddp.bucket_cap_mb,
                first_bucket_mb: ddp.first_bucket_mb,
            },
        )?),
        None => Box::new(DataParallel::new(groups.all, ddp)),
    })
}
