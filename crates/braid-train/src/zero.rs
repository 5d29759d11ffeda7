//! ZeRO stage 1 ([`Zero`]): data parallelism whose ranks each own a slice
//! of the optimizer. (Stage 2, which also keeps no whole gradient buffer,
//! runs on stage 3's block machinery: [`crate::zero3::Zero3::stage_2`].)
//!
//! Every rank holds the whole model for its forward and backward passes,
//! as under [`DataParallel`](crate::ddp::DataParallel). The gradient
//! buckets are those of data parallelism; each splits into one equal
//! block per rank (the engine's layout is padded so that they do, see
//! [`braid_model::Layout::padded`]), and rank `r` owns block `r` of every
//! bucket: its *shard*. The optimizer keeps master weights' state for the
//! shard only ([`ShardedOptimizer::shard_optimizer`]), so AdamW's two moments cost
//! `8Ψ/N` bytes per rank instead of `8Ψ`.
//!
//! Per step:
//! - backward: buckets are reduce-scattered instead of all-reduced (each
//!   rank receives the sum of its own blocks only: half an all-reduce's
//!   traffic), after the backward pass;
//! - clipping: each rank sums the squares of its shard of the gradients
//!   and the ranks add those up ([`Strategy::grad_sq_norm`]);
//! - update: each rank updates its shard of the parameters;
//! - after the update: every bucket's parameters are all-gathered from
//!   the ranks that own them (the other half of an all-reduce's traffic),
//!   and the engine refreshes what derives from them (bf16 copies).
//!
//! The arithmetic per element is data parallelism's: the same sums of the
//! same gradients (in the order the collective adds them), the same AdamW,
//! so parameters agree with a data-parallel run within summation order.
//!
//! Hybrid sharding ([`ZeroOptions::shard_group`], HSDP): the ranks form
//! groups of consecutive ranks (a node each); the optimizer is sharded
//! within a group, and the ranks at the same place in every group are
//! replicas of one another: after the reduce-scatter inside the group,
//! each rank's blocks are all-reduced among its replicas (a 2-D mesh of
//! two groups of the run's mesh, [`DataGroups`]).
//!
//! The reduce-scatter runs in place: the rank's blocks of the whole
//! gradient buffer hold the sums, and the update reads them there.

use crate::checkpoint::{self, Staging, StatePart, StateSource};
use crate::collective::{block_of, Collective};
use crate::ddp::buckets::{self, BucketPlan};
use crate::ddp::{mean_over, mib, replicate, run_units, time_sessions};
use crate::engine::{Checkpointable, Engine, EngineInfo, Flat, ShardedOptimizer, UpdateStep};
use crate::mesh::DataGroups;
use crate::space::Space;
use crate::strategy::{CommStep, Strategy};
use crate::timeline::Timeline;
use crate::Result;
use braid_comm::ReduceOp;
use std::ops::Range;

/// ZeRO's model-state bytes per rank for `psi` parameters over `n` ranks
/// at `stage` (0: plain data parallelism), with the formula's name.
///
/// `mixed`: the paper's count (Rajbhandari et al. 2020): 2-byte
/// parameters and gradients, 12 bytes of f32 master weights and Adam
/// moments — 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N. Otherwise the same
/// partitioning of f32 training, where the parameters are the master
/// weights (4-byte parameters and gradients, 8 bytes of moments): 16Ψ,
/// 8Ψ + 8Ψ/N, 4Ψ + 12Ψ/N, 16Ψ/N.
pub fn paper_bytes(psi: u64, stage: u8, n: u64, mixed: bool) -> (u64, &'static str) {
    let n = n.max(1);
    match (stage, mixed) {
        (0, _) => (16 * psi, "16Ψ"),
        (1, true) => (4 * psi + 12 * psi / n, "4Ψ + 12Ψ/N"),
        (2, true) => (2 * psi + 14 * psi / n, "2Ψ + 14Ψ/N"),
        (1, false) => (8 * psi + 8 * psi / n, "8Ψ + 8Ψ/N in f32"),
        (2, false) => (4 * psi + 12 * psi / n, "4Ψ + 12Ψ/N in f32"),
        _ => (16 * psi / n, "16Ψ/N"),
    }
}

/// ZeRO settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ZeroOptions {
    /// 1 (see the [module docs](self)).
    pub stage: u8,
    /// Cap of every bucket after the first, in MiB.
    pub bucket_cap_mb: f64,
    /// Cap of the first bucket, in MiB.
    pub first_bucket_mb: f64,
}

impl Default for ZeroOptions {
    fn default() -> Self {
        ZeroOptions {
            stage: 1,
            bucket_cap_mb: 25.0,
            first_bucket_mb: 1.0,
        }
    }
}

/// The ZeRO strategy (stage 1) over collectives `C`.
pub struct Zero<C: Collective> {
    /// Every rank (the start's broadcast, losses).
    comm: C,
    /// Hybrid sharding: the rank's shard group and its replicas (the
    /// ranks at the same place in the other groups).
    hybrid: Option<(C, C)>,
    opts: ZeroOptions,
    plan: Option<BucketPlan>,
    /// This rank's block of every bucket, increasing.
    shard: Vec<Range<usize>>,
    last: CommStep,
}

impl<C: Collective> Zero<C> {
    /// ZeRO over the data groups `groups` (hybrid sharding: within the
    /// shard groups, replicated over the others) with `opts`; a stage
    /// other than 1 is refused.
    pub fn new(groups: DataGroups<C>, opts: ZeroOptions) -> Result<Self> {
        if opts.stage != 1 {
            return Err(format!(
                "ZeRO stage {}: this strategy runs stage 1 (stages 2 and 3: Zero3)",
                opts.stage
            ));
        }
        let DataGroups { all: comm, hybrid } = groups;
        Ok(Zero {
            comm,
            hybrid,
            opts,
            plan: None,
            shard: Vec::new(),
            last: CommStep::default(),
        })
    }

    /// The elements of the flat buffer this rank's optimizer owns (after
    /// [`Strategy::start`]).
    pub fn shard(&self) -> &[Range<usize>] {
        &self.shard
    }

    /// The ranks the optimizer is sharded over.
    fn group(&self) -> &C {
        group_of(&self.comm, &self.hybrid)
    }

    /// One line: stage, ranks, backend, buckets.
    pub fn describe(&self) -> String {
        let (n, g) = (self.comm.size(), self.group().size());
        let hybrid = match g < n {
            true => format!(" hybrid: shard groups of {g}, {} replicas;", n / g),
            false => String::new(),
        };
        format!(
            "ZeRO stage {} over {n} ranks ({}):{hybrid} optimizer state sharded (1/{g} per rank), \
             gradients reduce-scattered after the backward pass, parameters all-gathered after \
             the update; buckets {} MiB (first {} MiB)",
            self.opts.stage,
            self.comm.backend(),
            self.opts.bucket_cap_mb,
            self.opts.first_bucket_mb,
        )
    }

    /// The reduce-scatter session of one backward pass (see
    /// [`run_units`]).
    fn session<E: Engine<Space = C::Space>>(
        &mut self,
        engine: &mut E,
        grads: &mut Flat<E>,
        timeline: &mut Timeline,
        compute: bool,
    ) -> Result<usize> {
        let plan = self
            .plan
            .as_ref()
            .ok_or("ZeRO: backward before start (call start first)")?;
        let mut computed = None;
        let window = <E::Space as Space>::window(grads);
        let step = group_of(&self.comm, &self.hybrid).reduce_scatter(
            window,
            &plan.buckets,
            &mut |w, launch| {
                computed = Some(run_units(
                    engine, plan, w, launch, timeline, compute, false,
                )?);
                Ok(())
            },
        )?;
        self.last = step;
        computed.ok_or_else(|| "ZeRO: the backward pass did not run".into())
    }
}

/// [`replicate`] for a strategy (`name`, for the message) that gathers
/// and shards parameters living in the engine's space: an engine whose
/// master weights are in host memory (an offloaded optimizer) is refused.
pub(crate) fn replicate_sharded<C: Collective, E: EngineInfo<Space = C::Space>>(
    comm: &C,
    engine: &mut E,
    name: &str,
) -> Result<usize> {
    if engine.host_params().is_some() {
        return Err(format!(
            "{name} with an optimizer offloaded to the host is not built yet: the parameters \
             it gathers live on the device (drop the offload, or train data-parallel with it)"
        ));
    }
    replicate(comm, engine)
}

/// The ranks the optimizer is sharded over: the shard group under hybrid
/// sharding, else every rank (a free function, so that it borrows only
/// those two fields).
pub(crate) fn group_of<'a, C>(comm: &'a C, hybrid: &'a Option<(C, C)>) -> &'a C {
    hybrid.as_ref().map_or(comm, |h| &h.0)
}

impl<C, E> Strategy<E> for Zero<C>
where
    C: Collective,
    E: ShardedOptimizer<Space = C::Space> + EngineInfo,
{
    fn describe(&self) -> String {
        Zero::describe(self)
    }

    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn replicas(&self) -> usize {
        self.comm.size()
    }

    fn start(&mut self, engine: &mut E) -> Result<()> {
        let len = replicate_sharded(&self.comm, engine, "ZeRO")?;
        let plan = buckets::plan(
            &engine.units(),
            len,
            mib(self.opts.first_bucket_mb),
            mib(self.opts.bucket_cap_mb),
            &[],
        )?;
        let (rank, n) = (self.group().rank(), self.group().size());
        let mut shard = Vec::with_capacity(plan.buckets.len());
        for b in &plan.buckets {
            shard.push(block_of(&b.range, rank, n).map_err(|e| format!("ZeRO: bucket {e}"))?);
        }
        shard.sort_by_key(|r| r.start);
        engine
            .shard_optimizer(&shard)
            .map_err(|e| format!("ZeRO: {e}"))?;
        self.shard = shard;
        self.plan = Some(plan);
        Ok(())
    }

    fn backward(
        &mut self,
        engine: &mut E,
        grads: &mut Flat<E>,
        timeline: &mut Timeline,
    ) -> Result<usize> {
        self.session(engine, grads, timeline, true)
    }

    fn before_update(&mut self, _engine: &mut E, grads: &mut Flat<E>) -> Result<()> {
        if let Some((_, replicas)) = &self.hybrid {
            // Each group summed its own share of the batch: add the groups'.
            let summed = replicas.all_reduce_ranges(grads, &self.shard)?;
            self.last.add(summed);
        }
        Ok(())
    }

    fn grad_sq_norm(&mut self, engine: &mut E, grads: &Flat<E>) -> Result<f64> {
        // Every group holds the whole sum: its shards make up the norm.
        let mut sum = [engine.grad_sq_norm_of(grads, &self.shard)?];
        self.group()
            .host()
            .all_reduce(&mut sum, ReduceOp::Sum)
            .map_err(|e| format!("ZeRO: the gradient norm: {e}"))?;
        self.last.collectives += 1;
        Ok(sum[0])
    }

    fn update(&mut self, engine: &mut E, grads: &Flat<E>, step: UpdateStep) -> Result<()> {
        engine.update(grads, step)
    }

    fn after_update(&mut self, engine: &mut E) -> Result<()> {
        let plan = self
            .plan
            .as_ref()
            .ok_or("ZeRO: update before start (call start first)")?;
        let ranges: Vec<Range<usize>> = plan.buckets.iter().map(|b| b.range.clone()).collect();
        let gathered =
            group_of(&self.comm, &self.hybrid).all_gather_ranges(engine.params_mut(), &ranges)?;
        engine.params_changed()?;
        self.last.add(gathered);
        Ok(())
    }

    fn mean(&mut self, values: &mut [f64]) -> Result<()> {
        mean_over(self.comm.host(), values)
    }

    fn save_part(&mut self, engine: &mut E, staging: &mut Staging) -> Result<StatePart>
    where
        E: Checkpointable,
    {
        let ranges = self.save_ranges(engine)?;
        checkpoint::whole_part(engine, ranges, staging)
    }

    fn save_ranges(&mut self, _engine: &mut E) -> Result<Vec<Range<usize>>>
    where
        E: Checkpointable,
    {
        // Under hybrid sharding the first replica's shard group writes.
        let writes = self.hybrid.as_ref().is_none_or(|(_, r)| r.rank() == 0);
        Ok(match writes {
            true => self.shard.clone(),
            false => Vec::new(),
        })
    }

    fn restore(&mut self, engine: &mut E, from: &dyn StateSource) -> Result<()>
    where
        E: Checkpointable,
    {
        checkpoint::restore_whole_params(engine, from)?;
        checkpoint::restore_optimizer(engine, from, &self.shard)
    }

    fn last_step(&self) -> CommStep {
        self.last
    }

    fn time_unoverlapped(&mut self, engine: &mut E, grads: &mut Flat<E>) -> Result<Option<f64>> {
        time_sessions(engine, &mut |engine, tl| {
            self.session(engine, grads, tl, false).map(|_| ())
        })
    }
}
