//! [`Strategy`]: how a parallel strategy plugs into the one training loop,
//! and [`Single`], the strategy of one process (no communication).
//!
//! The loop ([`crate::trainer`]) never knows which strategy runs. It tells
//! the strategy, in this order every step:
//!
//! 1. [`start`](Strategy::start) (once, before the first step): the
//!    parameters are ready — make every replica start from the same ones;
//!    then [`new_grads`](Strategy::new_grads) makes the loop's gradient
//!    buffer, which [`zero_grads`](Strategy::zero_grads) clears at the
//!    start of every step;
//! 2. every forward pass (training and evaluation) through
//!    [`forward`](Strategy::forward) (a strategy that shards the
//!    parameters gathers them there); for each micro-batch but the last,
//!    [`accumulate`](Strategy::accumulate): by default those backward
//!    passes accumulate locally (PyTorch's `no_sync`);
//! 3. [`backward`](Strategy::backward) for the last micro-batch: the
//!    strategy runs the engine's backward units itself, so that it sees
//!    each unit's gradients become final and can start communicating them
//!    while the next unit computes;
//! 4. [`before_update`](Strategy::before_update): the gradients must be
//!    reduced (or ordered to be, on a GPU) when this returns;
//! 5. the loop clips (by [`grad_sq_norm`](Strategy::grad_sq_norm)) and
//!    updates ([`update`](Strategy::update)), dividing by
//!    [`replicas`](Strategy::replicas) × micro-batches once, inside the
//!    update;
//! 6. [`after_update`](Strategy::after_update): parameters changed (a
//!    sharded strategy gathers them here);
//! 7. [`finish`](Strategy::finish) (once, after the last step): the
//!    engine holds whole parameters again (to save or sample them).

use crate::checkpoint::{self, Staging, StatePart, StateSource};
use crate::engine::{
    backward_local, Checkpointable, Engine, Flat, ShardedBytes, StateBytes, UpdateStep,
};
use crate::timeline::Timeline;
use crate::Result;

/// Bytes and timings of a strategy's communication in one step.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CommStep {
    /// Bytes handed to collectives — gradients reduced, and parameters
    /// gathered where they are sharded (payload, in the dtype they travel
    /// in).
    pub payload_bytes: u64,
    /// Bytes each rank sends for that payload (a ring all-reduce sends
    /// `2(n-1)/n` of it).
    pub wire_bytes: u64,
    /// Collectives started.
    pub collectives: u32,
    /// What carried them, where the collectives say (e.g. "NCCL").
    pub via: &'static str,
    /// Seconds the engine's own stream spent on the collectives' work
    /// while the backward pass ran (the copy engines' flag waits and
    /// sums, queued between its units): communication the computation did
    /// not hide, though it ends before the pass does.
    pub in_stream_s: f64,
    /// The tensor groups' collectives inside the passes (tensor
    /// parallelism), apart: another dimension of the mesh.
    pub tensor: TensorStep,
}

/// The tensor groups' collectives of one step.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct TensorStep {
    /// Collectives run.
    pub collectives: u64,
    /// Bytes handed to them.
    pub payload_bytes: u64,
    /// Bytes each rank sent for them.
    pub wire_bytes: u64,
}

impl CommStep {
    /// Adds the bytes and collectives of `other` (more communication in
    /// the same step). `via` stays, unless it is unsaid or `other` says
    /// more of the same path ("NCCL", then "NCCL, the gathers on the copy
    /// engines").
    pub fn add(&mut self, other: CommStep) {
        if self.via.is_empty()
            || (other.via.len() > self.via.len() && other.via.starts_with(self.via))
        {
            self.via = other.via;
        }
        self.payload_bytes += other.payload_bytes;
        self.wire_bytes += other.wire_bytes;
        self.collectives += other.collectives;
        self.in_stream_s += other.in_stream_s;
    }
}

/// A parallel strategy; see the [module docs](self) for when each hook
/// runs.
pub trait Strategy<E: Engine> {
    /// One line for the run's header.
    fn describe(&self) -> String;

    /// This process's rank among the strategy's ranks.
    fn rank(&self) -> usize;

    /// Number of model replicas whose gradients are summed (the loop
    /// divides by this).
    fn replicas(&self) -> usize;

    /// The parameters are ready (before the first step).
    fn start(&mut self, engine: &mut E) -> Result<()>;

    /// The steps already taken by the run this rank joins, where the
    /// strategy knows them without a checkpoint (after
    /// [`start`](Self::start)): a worker restarted into a parameter-server
    /// run goes on from the servers' step. None by default.
    fn joined_at(&self) -> Option<usize> {
        None
    }

    /// The loop's gradient buffer (after [`start`](Self::start)): the
    /// engine's, the size of the parameters, by default.
    fn new_grads(&mut self, engine: &mut E) -> Result<Flat<E>> {
        engine.new_grads()
    }

    /// Clears the gradients at the start of a step.
    fn zero_grads(&mut self, engine: &mut E, grads: &mut Flat<E>) -> Result<()> {
        engine.zero_grads(grads)
    }

    /// A forward pass on `batch` (with `grad`: for a backward pass);
    /// returns the mean loss.
    fn forward(&mut self, engine: &mut E, batch: &E::Batch, grad: bool) -> Result<f32> {
        engine.forward(batch, grad)
    }

    /// The backward pass of a micro-batch before a step's last: adds its
    /// gradients locally by default, with nothing communicated.
    fn accumulate(&mut self, engine: &mut E, grads: &mut Flat<E>) -> Result<()> {
        backward_local(engine, grads)
    }

    /// The backward pass of a step's last micro-batch: runs every unit of
    /// `engine` into `grads`; marks on `timeline` the point where the
    /// engine's computation ended and returns that mark.
    fn backward(
        &mut self,
        engine: &mut E,
        grads: &mut Flat<E>,
        timeline: &mut Timeline,
    ) -> Result<usize>;

    /// Before the optimizer step: the gradients are the sum over the
    /// replicas once this returns (or, on a GPU, once the engine's stream
    /// gets there).
    fn before_update(&mut self, engine: &mut E, grads: &mut Flat<E>) -> Result<()>;

    /// The sum of the squares of the gradients over the whole model, for
    /// clipping (after [`before_update`](Self::before_update)). The
    /// engine's own sum by default; a strategy whose ranks each hold a
    /// shard of the gradients sums the shards' across the ranks.
    fn grad_sq_norm(&mut self, engine: &mut E, grads: &Flat<E>) -> Result<f64> {
        engine.grad_sq_norm(grads)
    }

    /// The optimizer step (the engine's update from the whole gradient
    /// buffer by default; a strategy whose ranks each hold a shard of the
    /// reduced gradients updates from those).
    fn update(&mut self, engine: &mut E, grads: &Flat<E>, step: UpdateStep) -> Result<()> {
        engine.update(grads, step)
    }

    /// After the optimizer step.
    fn after_update(&mut self, engine: &mut E) -> Result<()>;

    /// Replaces each of `values` by its mean over the ranks (losses).
    fn mean(&mut self, values: &mut [f64]) -> Result<()>;

    /// After the last step: the engine's parameters are whole (a
    /// strategy that sharded them gathers them back). Nothing by default.
    fn finish(&mut self, _engine: &mut E) -> Result<()> {
        Ok(())
    }

    /// Model state the strategy keeps besides the engine's and the loop's
    /// gradient buffer (a sharded strategy's reduced gradients, or its
    /// master weights), for the model-state account.
    fn state_bytes(&self) -> StateBytes {
        StateBytes::default()
    }

    /// What a parameter-sharded strategy holds besides model state (after
    /// the steps, before [`finish`](Self::finish)). Nothing by default.
    fn sharded_bytes(&self) -> ShardedBytes {
        ShardedBytes::default()
    }

    /// This rank's part of the model state for a checkpoint, copied to
    /// host memory from `staging` (after an update). By default that of a model every
    /// rank holds whole: rank `r` of the replicas writes its share of the
    /// tensors ([`checkpoint::replica_share`]). (This and the other
    /// checkpoint hooks need a [`Checkpointable`] engine.)
    fn save_part(&mut self, engine: &mut E, staging: &mut Staging) -> Result<StatePart>
    where
        E: Checkpointable,
    {
        let ranges = self.save_ranges(engine)?;
        checkpoint::whole_part(engine, ranges, staging)
    }

    /// The flat elements [`save_part`](Self::save_part) writes (after
    /// [`start`](Self::start)). By default, for a model every rank holds
    /// whole, rank `r`'s share of the tensors
    /// ([`checkpoint::replica_share`]).
    fn save_ranges(&mut self, engine: &mut E) -> Result<Vec<std::ops::Range<usize>>>
    where
        E: Checkpointable,
    {
        let tensors = checkpoint::tensors_of(engine)?;
        Ok(checkpoint::replica_share(
            &tensors,
            self.rank(),
            self.replicas(),
        ))
    }

    /// Loads what this rank holds from a checkpoint (after
    /// [`start`](Self::start)): by default whole parameters and the whole
    /// optimizer state.
    fn restore(&mut self, engine: &mut E, from: &dyn StateSource) -> Result<()>
    where
        E: Checkpointable,
    {
        checkpoint::restore_whole_params(engine, from)?;
        let whole = 0..checkpoint::whole_len(engine);
        checkpoint::restore_optimizer(engine, from, std::slice::from_ref(&whole))
    }

    /// Whether nothing but the engine's backward units writes the loop's
    /// gradient buffer before they are through with a step (so the loop
    /// may lend its memory to the engine's saved activations:
    /// [`crate::lend`]). False by default; one process's strategy.
    fn lends_whole_grads(&self) -> bool {
        false
    }

    /// The communication of the last step.
    fn last_step(&self) -> CommStep {
        CommStep::default()
    }

    /// Measures how long the step's reductions take when nothing overlaps
    /// them (the gradient buffer's contents are overwritten): seconds per
    /// step, or `None` for a strategy that does not communicate.
    fn time_unoverlapped(&mut self, _engine: &mut E, _grads: &mut Flat<E>) -> Result<Option<f64>> {
        Ok(None)
    }
}

/// One process: nothing to communicate.
#[derive(Debug, Default)]
pub struct Single;

impl<E: Engine> Strategy<E> for Single {
    fn describe(&self) -> String {
        "one process".into()
    }

    fn rank(&self) -> usize {
        0
    }

    fn replicas(&self) -> usize {
        1
    }

    fn start(&mut self, _engine: &mut E) -> Result<()> {
        Ok(())
    }

    fn backward(
        &mut self,
        engine: &mut E,
        grads: &mut Flat<E>,
        timeline: &mut Timeline,
    ) -> Result<usize> {
        backward_local(engine, grads)?;
        timeline.mark(engine.stream())
    }

    fn before_update(&mut self, _engine: &mut E, _grads: &mut Flat<E>) -> Result<()> {
        Ok(())
    }

    fn after_update(&mut self, _engine: &mut E) -> Result<()> {
        Ok(())
    }

    fn mean(&mut self, _values: &mut [f64]) -> Result<()> {
        Ok(())
    }

    fn lends_whole_grads(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::CommStep;

    #[test]
    fn adding_steps_keeps_the_most_said_of_one_path() {
        let step = |via| CommStep {
            collectives: 1,
            via,
            ..Default::default()
        };
        let mut s = step("");
        s.add(step("NCCL"));
        assert_eq!(s.via, "NCCL");
        s.add(step("NCCL, the gathers on the copy engines"));
        s.add(step("NCCL"));
        assert_eq!(
            (s.via, s.collectives),
            ("NCCL, the gathers on the copy engines", 4)
        );
        let mut ce = step("the copy engines (NVLink)");
        ce.add(step("NCCL"));
        assert_eq!(ce.via, "the copy engines (NVLink)");
    }
}
