//! The [`Engine`] trait — the core every engine implements — and its
//! small types: the flat buffer and gradient window of its space
//! ([`Flat`], [`Window`]), a backward unit ([`Unit`]) and one optimizer
//! update ([`UpdateStep`]). The capabilities beyond the core are the
//! [engine module](crate::engine)'s other submodules.

use crate::space::Space;
use crate::Result;
use std::ops::Range;

/// The flat buffer type of an engine's space.
pub type Flat<E> = <<E as Engine>::Space as Space>::Flat;

/// The gradient window type of an engine's space.
pub type Window<'a, E> = <<E as Engine>::Space as Space>::Window<'a>;

/// One step of the backward pass and the gradients it finishes.
///
/// Units run in order; after unit `i`, the elements `finalizes` of the
/// gradient buffer never change again this step (an empty range: nothing
/// final yet). Each finished range must lie at one end of what is still
/// being written, so that it can be handed to a reduction while the engine
/// goes on (the GPT engines finish the final norm, then the layers from
/// the last, from the buffer's end; the embeddings last).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unit {
    /// For messages and traces (`layer 3`).
    pub name: String,
    /// Gradient elements final after this unit.
    pub finalizes: Range<usize>,
}

/// One optimizer update.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct UpdateStep {
    /// Learning rate.
    pub lr: f32,
    /// 1-based step number (Adam's bias correction).
    pub step: u32,
    /// Every gradient is multiplied by this before use: the loop's
    /// averaging over ranks and micro-batches and the clipping factor,
    /// folded into the update instead of a pass over the gradients.
    pub grad_scale: f32,
}

/// The core every engine implements: the parameters, the gradients, a
/// forward pass, a backward pass in units, the gradient norm, an
/// optimizer update — what one process ([`crate::Single`]) runs on. What
/// the loop ([`crate::trainer`]: checkpoints) and each other strategy
/// need beyond it are capabilities of their own ([the module](crate::engine)).
pub trait Engine {
    /// Where parameters and gradients live.
    type Space: Space;
    /// One micro-batch of input.
    type Batch;

    /// What must agree across data-parallel ranks (model configuration,
    /// shapes, precision); compared at start, and a rank that differs is
    /// named.
    fn describe(&self) -> String;

    /// The flat parameters (f32; master weights under mixed precision).
    fn params(&self) -> &Flat<Self>;

    /// The flat parameters, writable (rank 0's are broadcast into them).
    /// Call [`params_changed`](Self::params_changed) after writing.
    fn params_mut(&mut self) -> &mut Flat<Self>;

    /// Refreshes whatever derives from the parameters (a bf16 copy) after
    /// they were overwritten.
    fn params_changed(&mut self) -> Result<()>;

    /// Replaces the whole parameters by `values` (a resumed run's): by
    /// default written into [`params_mut`](Self::params_mut), then
    /// [`params_changed`](Self::params_changed). An engine whose master
    /// weights live elsewhere (an offloaded optimizer's, in host memory)
    /// puts them there.
    fn load_params(&mut self, values: &[f32]) -> Result<()> {
        let whole = 0..<Self::Space as Space>::len(self.params());
        <Self::Space as Space>::write_ranges(
            self.params_mut(),
            std::slice::from_ref(&whole),
            values,
        )?;
        self.params_changed()
    }

    /// A zeroed gradient buffer the size of the parameters.
    fn new_grads(&self) -> Result<Flat<Self>>;

    /// Sets `grads` to zero (queued, on a GPU), or, where the engine's
    /// next backward pass overwrites part of it, zeroes the rest: either
    /// way that pass's gradients come out as if added to zeros.
    fn zero_grads(&mut self, grads: &mut Flat<Self>) -> Result<()>;

    /// The backward pass's units, in the order they run.
    fn units(&self) -> Vec<Unit>;

    /// How many units [`units`](Self::units) lists (asked every step: an
    /// engine can answer without building the list).
    fn unit_count(&self) -> usize {
        self.units().len()
    }

    /// Forward pass on `batch`; with `grad`, keeps what the backward pass
    /// needs. Returns the mean loss over the batch.
    fn forward(&mut self, batch: &Self::Batch, grad: bool) -> Result<f32>;

    /// Runs backward unit `unit` (after those before it, following a
    /// forward pass with `grad`), adding its gradients into `grads`, which
    /// holds the buffer elements not yet handed on.
    fn backward_unit(&mut self, unit: usize, grads: &mut Window<'_, Self>) -> Result<()>;

    /// The sum of squares of `grads` (waits for queued work).
    fn grad_sq_norm(&mut self, grads: &Flat<Self>) -> Result<f64>;

    /// One optimizer update of the parameters from `grads` (of the
    /// optimizer's shard only, after
    /// [`shard_optimizer`](crate::ShardedOptimizer::shard_optimizer)).
    fn update(&mut self, grads: &Flat<Self>, step: UpdateStep) -> Result<()>;

    /// Waits for everything queued (a GPU's stream); nothing on the CPU.
    fn synchronize(&mut self) -> Result<()>;

    /// The GPU stream the engine queues its work on (none on the CPU):
    /// timelines record their events there.
    fn stream(&self) -> Option<&braid_cuda::Stream> {
        None
    }
}
