//! A run's strategy, assembled in one place: [`strategy`] builds it from
//! the run's data group (host or GPU collectives) and its mesh — one
//! process alone, else data parallelism or ZeRO as the engine takes it
//! ([`DataStrategy`]: every data-parallel strategy for an engine that
//! shards its parameters, data parallelism or ZeRO-1 for one that shards
//! its optimizer only), hybrid sharding's groups split from the mesh's
//! data view, wrapped for the tensor groups under tensor parallelism
//! ([`TensorSide`]).

use crate::collective::{Collective, DeviceCollective, HostCollective};
use crate::ddp::{DataParallel, DdpOptions};
use crate::engines::{CpuGpt, CpuStage, GpuGpt, GpuStage};
use crate::mesh::{DataGroups, Mesh};
use crate::tensor_parallel::{TensorParallel, TensorTraffic};
use crate::zero::{Zero, ZeroOptions};
use crate::zero3::Zero3;
use crate::Strategy;
use crate::{Engine, EngineInfo, LendsMemory, Result, ShardedOptimizer, ShardedParams, Single};
use braid_comm::Communicator;
use std::sync::Arc;

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
    /// parts (`braid train`'s pre-flight decides).
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
    ) -> Result<Box<dyn Strategy<Self>>>;
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
) -> Result<Box<dyn Strategy<E>>>
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

/// Each engine over its collectives, built by `$build`: [`distributed`]
/// (every data-parallel strategy) for one that shards its parameters,
/// [`replicated`] for one that shards its optimizer only — a GPU
/// pipeline's stages (`--zero 2` and `3` are refused before they are
/// built).
macro_rules! data_strategy {
    ($($engine:ty => $comm:ty, $build:ident);* $(;)?) => {$(
        impl DataStrategy<$comm> for $engine {
            fn over(
                groups: DataGroups<$comm>,
                choice: ShardChoice,
                ddp: DdpOptions,
            ) -> Result<Box<dyn Strategy<Self>>> {
                $build(groups, choice, ddp)
            }
        }
    )*};
}

data_strategy!(
    CpuGpt => HostCollective, distributed;
    CpuStage => HostCollective, distributed;
    GpuGpt => DeviceCollective, distributed;
    GpuStage => DeviceCollective, replicated;
);

/// The strategy over `comm`: ZeRO as `choice` says (stage 3 keeping
/// gathered parameters from the forward pass to the backward when
/// `keep_params`) when there is a stage, else data parallelism, with the
/// buckets of `ddp`.
fn distributed<C, E>(
    groups: DataGroups<C>,
    choice: ShardChoice,
    ddp: DdpOptions,
) -> Result<Box<dyn Strategy<E>>>
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
) -> Result<Box<dyn Strategy<E>>>
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
