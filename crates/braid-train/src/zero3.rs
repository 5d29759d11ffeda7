//! ZeRO stages 3 and 2 on parameter blocks ([`Zero3`], FSDP): in stage 3 the parameters are sharded too.
//!
//! Every rank keeps, for its slice of every parameter block (one equal
//! slice per rank of each block of
//! [`BlockGrads::param_units`](crate::BlockGrads::param_units): the
//! embeddings, each transformer block, the final norm — FSDP's
//! transformer wrap policy), the f32 master weights, their reduced
//! gradients and the optimizer's state: `16Ψ/N` bytes of model state in
//! f32 training. Whole blocks exist only while a unit of a pass uses
//! them:
//!
//! - forward: each unit's blocks are all-gathered from the ranks' master
//!   shards just before it runs; the next unit's gather is started first
//!   so that it travels while the current unit computes (prefetch). A
//!   block no later forward unit reads is freed at once
//!   (`reshard_after_forward`, FSDP2's default), except those the
//!   backward pass starts with (the head: FSDP2 keeps its root unit);
//! - backward: each unit's blocks are gathered again (prefetched the same
//!   way), its gradients written into block-sized buffers, and a block
//!   whose gradient is final is reduce-scattered into the shard's
//!   gradients while the next unit computes, then freed; where the next
//!   unit first recomputes its activations (activation checkpointing,
//!   [`ShardedParams::recompute_unit_of`]), the reduce-scatter runs beside that
//!   part, and the freed buffer takes the unit's gradients: one layer's
//!   gradient buffer at a time;
//! - micro-batches before a step's last reduce-scatter the same way
//!   (adding into the shard's gradients), so that no whole gradient
//!   buffer ever exists;
//! - each block's reduced gradients overwrite its slice of the shard's
//!   gradients in a step's first micro-batch (so nothing zeroes them) and
//!   are added in the others;
//! - with one micro-batch per step ([`Zero3::with_saved_in_grads`]), the
//!   activations the engine saves for the backward pass live in the
//!   shard's gradient memory, which holds nothing from the update until
//!   the backward pass fills it block by block: a block's slice takes
//!   buffers read for the last time no later than the unit after which
//!   its gradients are final ([`braid_model::placement`]);
//! - on a GPU the engine's layers are gathered in bf16
//!   ([`ShardedParams::start_half_blocks`]; [`Zero3::with_half_gathers`]): each
//!   rank rounds its slice to bf16 and the block arrives as the bf16
//!   weights the layer's products read — half the bytes on the wire and
//!   in memory, and no cast of a whole layer on the engine's stream. The
//!   few f32 tensors in those blocks (LayerNorms, biases) stay whole on
//!   every rank: after each update each rank's elements of them are
//!   all-gathered into the engine's packed copy;
//! - with [`Zero3::with_split_reduce`], a block written by two runs of
//!   backward units (the tied embeddings: by the head first, by the
//!   embedding unit last) is reduce-scattered after each run, the second
//!   part added to the first, and no buffer holds its gradients in
//!   between: where its length is near a layer's (within 1.5×) one
//!   allocation serves the embeddings' and the layers' blocks in turn,
//!   and the embedding unit waits for the first layer's reduce-scatter
//!   to take its memory;
//! - clipping sums the shards' squares across the ranks; the update
//!   changes the master shard only ([`ShardedParams::update_compact`]); nothing
//!   is gathered after it — the next forward pass does that.
//!
//! ZeRO stage 2 runs on the same machinery with the parameters left
//! whole ([`Zero3::stage_2`]): the engine keeps its whole parameters and
//! runs its whole forward pass, writes each backward unit's gradients
//! into block buffers
//! ([`BlockGrads::backward_unit_into`](crate::BlockGrads::backward_unit_into))
//! that are reduce-scattered into the shard's gradients once final and
//! reused, so no whole gradient buffer exists (`4Ψ + 12Ψ/N` bytes of model
//! state in f32); its optimizer owns the rank's slice of every block
//! ([`ShardedOptimizer::shard_optimizer`](crate::ShardedOptimizer::shard_optimizer)),
//! and after the update each block's parameters are all-gathered from the
//! slices' owners.
//!
//! Both stages run one type, so an engine under it implements what stage
//! 3 needs ([`ShardedParams`], and with it [`BlockGrads`](crate::BlockGrads)
//! and [`ShardedOptimizer`](crate::ShardedOptimizer)), [`LendsMemory`]
//! (the saved activations in the gradient shard) and [`EngineInfo`].
//!
//! Hybrid sharding (`shard_group`) shards within groups of
//! consecutive ranks and all-reduces each rank's shard of the gradients
//! among its replicas before the update, as stages 1 and 2 do.
//!
//! The arithmetic per element is data parallelism's (the same AdamW on
//! the same sums, in the order the collectives add them), so parameters
//! agree with a data-parallel run within summation order.

use crate::checkpoint::{self, Staging, StatePart, StateSource};
use crate::collective::{block_of, Collective, GatherPart};
use crate::ddp::mean_over;
use crate::engine::{
    Checkpointable, EngineInfo, Flat, LendsMemory, ShardedBytes, ShardedParams, StateBytes,
    UpdateStep,
};
use crate::memory_phase::{self, Phase};
use crate::mesh::DataGroups;
use crate::space::Space;
use crate::strategy::{CommStep, Strategy};
use crate::timeline::Timeline;
use crate::zero::{group_of, replicate_sharded};
use crate::Result;
use braid_comm::ReduceOp;
use braid_model::placement::Region;
use std::ops::Range;
use std::sync::Arc;

/// ZeRO stage 3 over collectives `C`.
pub struct Zero3<C: Collective> {
    /// 3, or 2: the parameters stay whole ([`Zero3::stage_2`]).
    stage: u8,
    /// Every rank (the start's broadcast, losses).
    comm: C,
    /// Hybrid sharding: the rank's shard group and its replicas.
    hybrid: Option<(C, C)>,
    /// Free blocks no later forward unit reads (FSDP2's
    /// `reshard_after_forward`); otherwise every gathered block stays
    /// until the backward pass is done with it.
    reshard_after_forward: bool,
    /// Lend the shard's gradient memory to the engine's saved
    /// activations (one micro-batch per step only).
    saved_in_grads: bool,
    /// Gather in bf16 the blocks the engine takes so, where the
    /// collectives can.
    half_gathers: bool,
    /// [`Zero3::with_final_gather`].
    final_gather: bool,
    /// [`Zero3::with_split_reduce`].
    split_reduce: bool,
    /// [`Zero3::with_kept_spares`].
    kept_spares: Option<bool>,
    /// Set by [`Strategy::start`].
    state: Option<Sharded<C>>,
    last: CommStep,
}

impl<C: Collective> Zero3<C> {
    /// ZeRO-3 over the data groups `groups` (hybrid sharding: within the
    /// shard groups, replicated over the others), freeing blocks after
    /// the forward pass when `reshard_after_forward`.
    pub fn new(groups: DataGroups<C>, reshard_after_forward: bool) -> Result<Self> {
        let DataGroups { all: comm, hybrid } = groups;
        Ok(Zero3 {
            stage: 3,
            comm,
            hybrid,
            reshard_after_forward,
            saved_in_grads: false,
            half_gathers: true,
            final_gather: true,
            split_reduce: false,
            kept_spares: None,
            state: None,
            last: CommStep::default(),
        })
    }

    /// ZeRO stage 2 over the data groups `groups` (see the module documentation): the
    /// parameters whole on every rank, the gradients block by block
    /// reduce-scattered into the rank's shard, the optimizer sharded.
    pub fn stage_2(groups: DataGroups<C>) -> Result<Self> {
        let mut z = Self::new(groups, true)?;
        z.stage = 2;
        z.half_gathers = false;
        Ok(z)
    }

    /// Whether the parameters are sharded (stage 3) or whole (stage 2).
    fn params_sharded(&self) -> bool {
        self.stage == 3
    }

    /// Lends the gradient shard's memory to the activations the engine
    /// saves for its backward pass (see the module documentation): only
    /// for runs of one micro-batch per step, whose forward pass may then
    /// overwrite the previous step's gradients. Set before
    /// [`Strategy::start`].
    pub fn with_saved_in_grads(mut self, on: bool) -> Self {
        self.saved_in_grads = on;
        self
    }

    /// Gathers in bf16 the blocks the engine takes so (its layers, on a
    /// GPU), where the collectives can: on by default. Set before
    /// [`Strategy::start`].
    pub fn with_half_gathers(mut self, on: bool) -> Self {
        self.half_gathers = on;
        self
    }

    /// Whether [`Strategy::finish`] gathers the whole parameters back
    /// into the engine (on by default: for a run that saves its model);
    /// without it the run ends with the shards (a GPU never holds the
    /// whole model).
    pub fn with_final_gather(mut self, on: bool) -> Self {
        self.final_gather = on;
        self
    }

    /// Reduce-scatters a block written by two runs of backward units (the
    /// tied embeddings) after each run, and lets blocks of near lengths
    /// share buffers (see the module documentation): one embeddings'
    /// gradient buffer less through the layers' backward units, for one
    /// more reduce-scatter of the embeddings per micro-batch. Off by
    /// default. Set before [`Strategy::start`].
    pub fn with_split_reduce(mut self, on: bool) -> Self {
        self.split_reduce = on;
        self
    }

    /// Whether every freed block buffer is kept for reuse (`Some(true)`)
    /// or at most the few a unit's work has in flight (`Some(false)`);
    /// `None`, the default: kept where the collectives' block buffers are
    /// costly to make ([`Collective::block_buffers_kept`]: copy-engine
    /// gathers, where they are always kept and `Some(false)` is refused at
    /// the first buffer), capped elsewhere. Set before [`Strategy::start`].
    pub fn with_kept_spares(mut self, kept: Option<bool>) -> Self {
        self.kept_spares = kept;
        self
    }

    /// Whether some blocks are gathered in bf16 (after start).
    pub fn gathers_half(&self) -> bool {
        self.state.as_ref().is_some_and(|s| s.side.is_some())
    }

    /// Bytes of the engine's saved activations placed in the gradient
    /// shard's memory.
    pub fn saved_in_grads_bytes(&self) -> usize {
        self.state.as_ref().map_or(0, |s| s.lent)
    }

    /// The ranks the parameters are sharded over.
    fn group(&self) -> &C {
        group_of(&self.comm, &self.hybrid)
    }

    /// Bytes of gathered blocks and block gradients held at once, at
    /// most, so far (the transient part of a ZeRO-3 rank's memory).
    pub fn peak_unit_bytes(&self) -> u64 {
        self.state.as_ref().map_or(0, |s| s.peak)
    }

    /// One line: ranks, backend, policy.
    pub fn describe(&self) -> String {
        let (n, g) = (self.comm.size(), self.group().size());
        let hybrid = match g < n {
            true => format!(" hybrid: shard groups of {g}, {} replicas;", n / g),
            false => String::new(),
        };
        if !self.params_sharded() {
            return format!(
                "ZeRO stage 2 over {n} ranks ({}):{hybrid} optimizer state and gradients sharded \
                 (1/{g} per rank); each unit's gradients written into block buffers and \
                 reduce-scattered per block as soon as final (no whole gradient buffer), \
                 parameters all-gathered per block after the update",
                self.comm.backend(),
            );
        }
        let half = match self.half_gathers && self.group().half_gathers() {
            true => " (the layers' in bf16)",
            false => "",
        };
        format!(
            "ZeRO stage 3 over {n} ranks ({}):{hybrid} parameters, gradients and optimizer state \
             sharded (1/{g} per rank); each unit's parameters all-gathered{half} before it runs \
             (the next unit's prefetched), {}; gradients reduce-scattered per unit{}",
            self.comm.backend(),
            match self.reshard_after_forward {
                true => "freed after the forward pass (gathered again for the backward)",
                false => "kept from the forward pass to the backward",
            },
            match self.split_reduce {
                true => " (the tied embeddings' in two parts, no buffer between)",
                false => "",
            },
        )
    }

    /// "ZeRO-3", or "ZeRO-2" (stage 2), for messages.
    fn label(&self) -> &'static str {
        match self.stage {
            2 => "ZeRO-2",
            _ => "ZeRO-3",
        }
    }

    fn started(&mut self) -> Result<(&C, &mut Sharded<C>)> {
        let (group, label) = (group_of(&self.comm, &self.hybrid), self.label());
        let state = self
            .state
            .as_mut()
            .ok_or_else(|| format!("{label}: a pass before start (call start first)"))?;
        Ok((group, state))
    }

    /// A forward pass in units, gathering each unit's blocks.
    fn forward_pass<E: ShardedParams<Space = C::Space>>(
        &mut self,
        engine: &mut E,
        batch: &E::Batch,
        grad: bool,
    ) -> Result<f32> {
        if !self.params_sharded() {
            self.started()?;
            return engine.forward(batch, grad);
        }
        let keep_all = grad && !self.reshard_after_forward;
        let (group, st) = self.started()?;
        if grad && st.lent > 0 && st.micro > 0 {
            return Err(
                "ZeRO-3: the activations saved for the backward pass live in the gradient \
                 shard, which holds only one micro-batch: drop --accum (or set \
                 BRAID_SAVED_IN_GRADS=off)"
                    .into(),
            );
        }
        let mut step = st.refresh_side(group, engine)?;
        engine.forward_begin(batch, grad)?;
        let all = st.units.clone();
        let units = &all.forward;
        let first_backward: &[usize] = all.backward_reads.first().map_or(&[], |r| r);
        step.add(st.exchange(group, &units[0], &[], &mut || Ok(()))?);
        let mut loss = None;
        for (u, reads) in units.iter().enumerate() {
            memory_phase::enter(Phase::ForwardUnit(u));
            let next: &[usize] = units.get(u + 1).map_or(&[], |r| r);
            let (done, s) = st.run_unit(group, reads, &[], next, &[], &mut |params, _| {
                engine.forward_unit(u, params)
            })?;
            step.add(s);
            loss = done;
            for &b in reads {
                let later = units[u + 1..].iter().any(|r| r.contains(&b));
                let kept = keep_all || (grad && first_backward.contains(&b));
                if !later && !kept {
                    st.release(b);
                }
            }
        }
        if grad {
            // Evaluation's gathers are not the step's.
            self.last.add(step);
        }
        loss.ok_or_else(|| "ZeRO-3: the last forward unit returned no loss".into())
    }

    /// A backward pass in units: gathers, computes into block gradient
    /// buffers, reduce-scatters each block once final. Returns the mark
    /// where the engine's computation ended.
    fn backward_pass<E: ShardedParams<Space = C::Space>>(
        &mut self,
        engine: &mut E,
        timeline: &mut Timeline,
    ) -> Result<usize> {
        let whole = !self.params_sharded();
        let (group, st) = self.started()?;
        let all = st.units.clone();
        let (reads, writes) = (&all.backward_reads, &all.backward_writes);
        // Stage 2: the engine reads its own parameters; nothing is gathered.
        let none = vec![Vec::new(); reads.len()];
        let reads = if whole { &none } else { reads };
        let mut step = CommStep::default();
        st.reduced.fill(false);
        step.add(st.exchange(group, &reads[0], &[], &mut || Ok(()))?);
        let mut pending: Vec<usize> = Vec::new();
        for u in 0..reads.len() {
            if !whole && !pending.is_empty() && engine.recomputes_unit(u) {
                memory_phase::enter(Phase::Recompute(u));
                // The unit first recomputes its activations (writing no
                // gradient) while the blocks final after the unit before
                // are reduce-scattered; their buffers are then free for
                // this unit's gradients: one layer's gradient buffer at a
                // time instead of two.
                let (_, s) = st.run_unit(
                    group,
                    &reads[u],
                    &[],
                    &[],
                    &pending,
                    &mut |params, _| match engine.recompute_unit_of(u, params)? {
                        true => Ok(None),
                        false => Err(format!(
                            "backward unit {u}: the engine said it recomputes, then did not"
                        )),
                    },
                )?;
                step.add(s);
                st.drop_all_grads(&mut pending);
            }
            if !pending.is_empty() && writes[u].iter().any(|&b| st.reduced[b]) {
                // A block's second part: its buffer comes once the blocks
                // final before are reduce-scattered, taking their memory
                // (the embedding unit after the first layer's).
                step.add(st.reduce_alone(group, &mut pending)?);
            }
            memory_phase::enter(Phase::BackwardUnit(u));
            for &b in &writes[u] {
                st.grad_block(group, b, &mut |g| engine.zero_block_grads(b, g))?;
            }
            let next: &[usize] = reads.get(u + 1).map_or(&[], |r| r);
            let (_, s) = st.run_unit(
                group,
                &reads[u],
                &writes[u],
                next,
                &pending,
                &mut |params, mut grads| {
                    match whole {
                        true => engine.backward_unit_into(u, &mut grads)?,
                        false => engine.backward_unit_of(u, params, &mut grads)?,
                    }
                    Ok(None)
                },
            )?;
            step.add(s);
            st.drop_all_grads(&mut pending);
            pending.extend((0..st.reduce_after.len()).filter(|&b| st.reduce_after[b].contains(&u)));
            for &b in &reads[u] {
                if !reads[u + 1..].iter().any(|r| r.contains(&b)) {
                    st.release(b);
                }
            }
        }
        let computed = timeline.mark(engine.stream())?;
        step.add(st.reduce_alone(group, &mut pending)?);
        st.micro += 1;
        self.last.add(step);
        Ok(computed)
    }
}

/// The lengths of buffers a rank asks for (each block's in f32, or half
/// that where it is gathered in bf16), each once, shortest first.
fn size_classes(blocks: &[Range<usize>], half: &[bool]) -> Vec<usize> {
    let mut sizes: Vec<usize> = blocks.iter().map(|b| b.len()).collect();
    sizes.extend(
        blocks
            .iter()
            .zip(half)
            .filter(|(_, &h)| h)
            .map(|(b, _)| b.len() / 2),
    );
    sizes.sort_unstable();
    sizes.dedup();
    sizes
}

impl<C: Collective> Zero3<C> {
    /// Places the engine's saved activations in the gradient shard's
    /// memory where blocks' slices are idle through their last read.
    fn lend_grads<E: LendsMemory<Space = C::Space>>(&mut self, engine: &mut E) -> Result<()> {
        let st = self.state.as_mut().ok_or("ZeRO-3: lending before start")?;
        let regions: Vec<Region> = st
            .slots
            .iter()
            .zip(&st.reduce_after)
            .filter_map(|(slot, after)| {
                // Idle until the block's first part arrives.
                after.first().map(|&free_through| Region {
                    start: 4 * slot.start as u64,
                    end: 4 * slot.end as u64,
                    free_through,
                })
            })
            .collect();
        let at = crate::lend::offsets_in(engine, &regions)?;
        if at.is_empty() {
            return Ok(());
        }
        // Which elements each forward unit writes first (an update beside
        // the stream reads their gradients before).
        let buffers = engine.saved_buffers()?;
        st.lent_runs = buffers
            .iter()
            .zip(&at)
            .filter_map(|(b, at)| at.map(|at| (at / 4..(at + b.bytes).div_ceil(4), b.first_write)))
            .collect();
        // SAFETY: `st.grads` stays until `finish`, which calls `drop_saved`
        // before replacing it (and the engine never reads lent buffers
        // after this strategy is gone: the run ends with it). Each buffer
        // lies in the slices of blocks (one, or several that follow each
        // other in the shard) whose reduced gradients are written (on the
        // communication stream, ordered after the engine's work queued so
        // far) only once the unit after which the block's first part is
        // reduced has been queued, which is no earlier than the buffer's
        // last read;
        // the next forward pass writes them after the update has read the
        // gradients, on the engine's stream.
        st.lent = unsafe { engine.place_saved(&st.grads, &at) }
            .map_err(|e| format!("ZeRO-3: saved activations in the gradient shard: {e}"))?;
        Ok(())
    }
}

impl<C, E> Strategy<E> for Zero3<C>
where
    C: Collective,
    E: ShardedParams<Space = C::Space> + LendsMemory + EngineInfo,
{
    fn describe(&self) -> String {
        Zero3::describe(self)
    }

    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn replicas(&self) -> usize {
        self.comm.size()
    }

    fn start(&mut self, engine: &mut E) -> Result<()> {
        let name = self.label();
        if engine.pending_params().is_some() && !self.params_sharded() {
            return Err(format!(
                "{name} keeps whole parameters in the engine: build it with them on the \
                 device, not for sharding"
            ));
        }
        // An engine built for sharding has its parameters in host memory:
        // the ranks compare them, and each uploads only its shard.
        let len = replicate_sharded(&self.comm, engine, name)?;
        let units = engine.param_units().map_err(|e| format!("{name}: {e}"))?;
        units
            .check(len, engine.unit_count())
            .map_err(|e| format!("{name}: {e}"))?;
        if self.saved_in_grads && self.params_sharded() {
            // The saved activations will live in the gradient shard: their
            // own memory goes before the shard is made beside the whole
            // parameters (the start's peak).
            engine.drop_saved()?;
        }
        let (rank, n) = (self.group().rank(), self.group().size());
        let mut shard = Vec::with_capacity(units.blocks.len());
        let mut slots = Vec::with_capacity(units.blocks.len());
        let mut at = 0;
        for (i, b) in units.blocks.iter().enumerate() {
            let mine =
                block_of(b, rank, n).map_err(|e| format!("{name}: parameter block {i} {e}"))?;
            slots.push(at..at + mine.len());
            at += mine.len();
            shard.push(mine);
        }
        let master = match self.params_sharded() {
            true => engine
                .shard_params(&shard)
                .map_err(|e| format!("ZeRO-3: {e}"))?,
            false => {
                engine
                    .shard_optimizer(&shard)
                    .map_err(|e| format!("ZeRO-2: {e}"))?;
                self.group().zeros(0)?
            }
        };
        let shard_ranges = shard;
        let blocks = units.blocks.len();
        let mut half = vec![false; blocks];
        let mut side = None;
        if self.params_sharded() && self.half_gathers && self.group().half_gathers() {
            let (taken, tensors) = engine
                .start_half_blocks()
                .map_err(|e| format!("ZeRO-3: bf16 gathers: {e}"))?;
            for &b in &taken {
                let ok = b < blocks && slots[b].len() % 2 == 0;
                if !ok {
                    return Err(format!(
                        "ZeRO-3: the engine takes block {b} in bf16, but it is not a block of \
                         an even number of elements per rank"
                    ));
                }
                half[b] = true;
            }
            if !taken.is_empty() {
                let (mine, all, per_rank) = side_runs(&units.blocks, &slots, &tensors, rank, n)?;
                side = Some(SideRefresh {
                    exchange: self.group().zeros(n * per_rank)?,
                    per_rank,
                    mine,
                    all,
                    stale: true,
                });
            }
        }
        self.state = Some(Sharded {
            reduce_after: units.reduce_after(self.split_reduce),
            reduced: vec![false; blocks],
            sizes: match self.split_reduce {
                true => size_classes(&units.blocks, &half),
                false => Vec::new(),
            },
            units: Arc::new(units),
            slots,
            shard: shard_ranges,
            master,
            grads: self.group().zeros(at)?,
            gathered: (0..blocks).map(|_| None).collect(),
            block_grads: (0..blocks).map(|_| None).collect(),
            spare: Vec::new(),
            keep_spares: false,
            spares_asked: self.kept_spares,
            made: (0, 0),
            held: 0,
            peak: 0,
            micro: 0,
            lent: 0,
            lent_runs: Vec::new(),
            half,
            side,
            label: name,
        });
        if self.saved_in_grads && self.params_sharded() {
            self.lend_grads(engine)?;
        }
        Ok(())
    }

    fn new_grads(&mut self, _engine: &mut E) -> Result<Flat<E>> {
        // No whole gradient buffer: blocks come and go per unit.
        self.group().zeros(0)
    }

    fn zero_grads(&mut self, _engine: &mut E, _grads: &mut Flat<E>) -> Result<()> {
        // A step starts: its communication is counted afresh, and its
        // first micro-batch overwrites the shard's gradients.
        self.last = CommStep::default();
        let (_, st) = self.started()?;
        st.micro = 0;
        st.made = (0, st.made.0 + st.made.1);
        Ok(())
    }

    fn forward(&mut self, engine: &mut E, batch: &E::Batch, grad: bool) -> Result<f32> {
        self.forward_pass(engine, batch, grad)
    }

    fn accumulate(&mut self, engine: &mut E, _grads: &mut Flat<E>) -> Result<()> {
        let mut tl = Timeline::new();
        self.backward_pass(engine, &mut tl).map(|_| ())
    }

    fn backward(
        &mut self,
        engine: &mut E,
        _grads: &mut Flat<E>,
        timeline: &mut Timeline,
    ) -> Result<usize> {
        self.backward_pass(engine, timeline)
    }

    fn before_update(&mut self, _engine: &mut E, _grads: &mut Flat<E>) -> Result<()> {
        if let (Some((_, replicas)), Some(st)) = (&self.hybrid, &mut self.state) {
            // Each group summed its own share of the batch: add the groups'.
            let all = 0..<C::Space as Space>::len(&st.grads);
            let summed = replicas.all_reduce_ranges(&mut st.grads, &[all])?;
            self.last.add(summed);
        }
        Ok(())
    }

    fn grad_sq_norm(&mut self, engine: &mut E, _grads: &Flat<E>) -> Result<f64> {
        let (group, st) = self.started()?;
        let mut sum = [engine.grad_sq_norm_compact(&st.grads, &st.shard)?];
        group
            .host()
            .all_reduce(&mut sum, ReduceOp::Sum)
            .map_err(|e| format!("{}: the gradient norm: {e}", st.label))?;
        self.last.collectives += 1;
        Ok(sum[0])
    }

    fn update(&mut self, engine: &mut E, _grads: &Flat<E>, step: UpdateStep) -> Result<()> {
        let sharded = self.params_sharded();
        let (_, st) = self.started()?;
        match sharded {
            true => {
                st.master_changed();
                engine.update_compact(&mut st.master, &st.grads, step)
            }
            false => engine.update_shard(&st.grads, step),
        }
    }

    fn after_update(&mut self, engine: &mut E) -> Result<()> {
        let sharded = self.params_sharded();
        let (group, st) = self.started()?;
        if !sharded {
            // Stage 2: every block's slices from their owners.
            let blocks = st.units.blocks.clone();
            let gathered = group.all_gather_ranges(engine.params_mut(), &blocks)?;
            engine.params_changed()?;
            self.last.add(gathered);
            return Ok(());
        }
        // The next forward pass gathers the new parameters.
        for b in 0..st.gathered.len() {
            st.release(b);
        }
        Ok(())
    }

    fn finish(&mut self, engine: &mut E) -> Result<()> {
        engine.synchronize()?;
        if !self.params_sharded() {
            // Stage 2: the engine holds the whole parameters throughout.
            return Ok(());
        }
        if !self.final_gather {
            // Nothing reads the whole parameters after the run.
            return Ok(());
        }
        let lead = self.comm.rank() == 0;
        // Training is over: make room for the whole parameters (on a GPU
        // they would not fit beside everything else) — the gathered
        // blocks, the spares, the gradient shard, the optimizer's state.
        engine
            .release_optimizer_state()
            .map_err(|e| format!("ZeRO-3: {e}"))?;
        let (group, st) = self.started()?;
        for b in 0..st.gathered.len() {
            st.release(b);
            st.drop_grads(b);
        }
        st.spare.clear();
        st.held = 0;
        // The gradient memory goes, and the whole parameters need room:
        // the saved activations give back theirs, lent or not (a later
        // forward pass makes them again).
        engine.drop_saved()?;
        st.lent = 0;
        st.grads = group.zeros(0)?;
        let len = st.units.blocks.last().map_or(0, |b| b.end);
        // Block by block, every rank's master shard gathered into one
        // block's buffer, and from it into host memory: rank 0, which
        // saves, keeps the whole model there; no device holds it.
        let mut full = vec![0f32; if lead { len } else { 0 }];
        let biggest = st.units.blocks.iter().map(|r| r.len()).max().unwrap_or(0);
        let mut block = group.zeros(biggest)?;
        for (b, r) in st.units.blocks.iter().enumerate() {
            let mut gather = [GatherPart {
                from: st.slots[b].clone(),
                into: &mut block,
                at: 0,
                half: false,
            }];
            group.shard_exchange(&st.master, &mut gather, &mut st.grads, &mut [], &mut || {
                Ok(())
            })?;
            if lead {
                <C::Space as Space>::read_ranges_into(
                    &block,
                    std::slice::from_ref(&(0..r.len())),
                    &mut full[r.clone()],
                )?;
            }
        }
        if !lead {
            // Only rank 0 saves the model.
            return Ok(());
        }
        engine
            .unshard_params(full)
            .map_err(|e| format!("ZeRO-3: {e}"))
    }

    fn mean(&mut self, values: &mut [f64]) -> Result<()> {
        mean_over(self.comm.host(), values)
    }

    fn state_bytes(&self) -> StateBytes {
        match &self.state {
            // (Stage 2's master is empty: the engine counts its whole
            // parameters.)
            Some(st) => StateBytes {
                params: 4 * <C::Space as Space>::len(&st.master) as u64,
                grads: 4 * <C::Space as Space>::len(&st.grads) as u64,
                ..Default::default()
            },
            None => StateBytes::default(),
        }
    }

    fn sharded_bytes(&self) -> ShardedBytes {
        ShardedBytes {
            units_peak: self.peak_unit_bytes(),
            saved_in_grads: self.saved_in_grads_bytes() as u64,
            buffers_made: self.state.as_ref().map_or((0, 0), |s| s.made),
        }
    }

    fn save_ranges(&mut self, _engine: &mut E) -> Result<Vec<Range<usize>>>
    where
        E: Checkpointable,
    {
        // Under hybrid sharding the first replica's shard group writes.
        let writes = self.hybrid.as_ref().is_none_or(|(_, r)| r.rank() == 0);
        let (_, st) = self.started()?;
        Ok(match writes {
            true => st.shard.clone(),
            false => Vec::new(),
        })
    }

    fn save_part(&mut self, engine: &mut E, staging: &mut Staging) -> Result<StatePart>
    where
        E: Checkpointable,
    {
        let ranges = self.save_ranges(engine)?;
        if !self.params_sharded() {
            return checkpoint::whole_part(engine, ranges, staging);
        }
        let writes = !ranges.is_empty();
        engine.synchronize()?;
        let (_, st) = self.started()?;
        let len = ranges.iter().map(|r| r.len()).sum();
        let mut params = staging.take(len)?;
        if writes {
            let all = 0..<C::Space as Space>::len(&st.master);
            <C::Space as Space>::read_ranges_into(
                &st.master,
                std::slice::from_ref(&all),
                &mut params,
            )?;
        }
        let (kind, moments) = checkpoint::moments_part(engine, &ranges, staging)?;
        Ok(StatePart {
            ranges,
            params,
            kind,
            moments,
        })
    }

    fn restore(&mut self, engine: &mut E, from: &dyn StateSource) -> Result<()>
    where
        E: Checkpointable,
    {
        engine.synchronize()?;
        if !self.params_sharded() {
            let (_, st) = self.started()?;
            let shard = st.shard.clone();
            checkpoint::restore_whole_params(engine, from)?;
            return checkpoint::restore_optimizer(engine, from, &shard);
        }
        let tensors = checkpoint::tensors_of(engine)?;
        let (_, st) = self.started()?;
        let values = from.read("params", &tensors, &st.shard)?;
        let len = <C::Space as Space>::len(&st.master);
        <C::Space as Space>::write_ranges(
            &mut st.master,
            std::slice::from_ref(&(0..len)),
            &values,
        )?;
        st.master_changed();
        let shard = st.shard.clone();
        checkpoint::restore_optimizer(engine, from, &shard)
    }

    fn last_step(&self) -> CommStep {
        self.last
    }
}

mod sharded;
use sharded::{side_runs, Sharded, SideRefresh};
