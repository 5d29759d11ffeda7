//! [`Engine`]: what the training loop and every parallel strategy need from
//! a model — flat parameters, a flat gradient buffer, a forward pass, a
//! backward pass in units that each declare which gradients they finish,
//! the gradient norm and an optimizer step — and the capabilities a
//! strategy may need beyond that core, each its own trait (its own
//! module), which an engine implements or does not:
//!
//! - [`EngineInfo`] ([`info`]): what an engine may say about itself beyond
//!   the core (its matrices, master weights in host memory, the bytes of
//!   its state, its own profile), each with a default that says nothing;
//! - [`ShardedOptimizer`] ([`sharded_optimizer`]): an optimizer that owns
//!   a shard of the flat buffer (ZeRO-1; ZeRO-2's update);
//! - [`BlockGrads`] ([`blocks`]): the parameter blocks and a backward
//!   pass writing its gradients block by block (ZeRO-2);
//! - [`ShardedParams`] ([`sharded_params`]): parameters given up for a
//!   shard of master weights and passes in units that take their blocks
//!   as arguments (ZeRO-3);
//! - [`LendsMemory`] ([`lending`]): the activations saved for the backward
//!   pass placed in memory another part lends (one process's gradient
//!   buffer, ZeRO-3's gradient shard);
//! - [`Checkpointable`] ([`checkpointable`]): named tensors and the
//!   optimizer's state, copied out and loaded back (checkpoints).
//!
//! Nothing here is GPT-specific: the GPT engines ([`crate::engines`]) and
//! the course's MLP (`examples/ddp_mlp`) implement the same traits, and
//! data-parallel training works on anything that implements the core and
//! [`EngineInfo`].

pub mod blocks;
pub mod checkpointable;
pub mod info;
pub mod lending;
pub mod sharded_optimizer;
pub mod sharded_params;

pub use blocks::{BlockGrads, ParamUnits};
pub use checkpointable::{state_ranges, Checkpointable, NamedTensor, OptimizerState};
pub use info::{EngineInfo, Matrix, StateBytes};
pub use lending::{LendsMemory, SavedBuffer};
pub use sharded_optimizer::{check_shard, ShardedOptimizer};
pub use sharded_params::ShardedParams;

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

/// Device memory a parameter-sharded strategy holds besides model state
/// ([`crate::Strategy::sharded_bytes`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ShardedBytes {
    /// The most bytes of whole blocks (gathered parameters, block
    /// gradients, freed buffers kept for reuse) held at once.
    pub units_peak: u64,
    /// Bytes of the engine's saved activations living in the gradient
    /// shard's memory.
    pub saved_in_grads: u64,
    /// Block buffers made (none of the spares fitted) in the last step,
    /// and in all steps before it: each costs an allocation, and on GPUs a
    /// wait for the engine's stream (or, for copy-engine gathers, a
    /// window registration on every rank).
    pub buffers_made: (u64, u64),
}

/// The core every engine implements: the parameters, the gradients, a
/// forward pass, a backward pass in units, the gradient norm, an
/// optimizer update — what one process ([`crate::Single`]) runs on. What
/// the loop ([`crate::trainer`]: checkpoints) and each other strategy
/// need beyond it are capabilities of their own ([the module](self)).
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
    /// [`shard_optimizer`](ShardedOptimizer::shard_optimizer)).
    fn update(&mut self, grads: &Flat<Self>, step: UpdateStep) -> Result<()>;

    /// Waits for everything queued (a GPU's stream); nothing on the CPU.
    fn synchronize(&mut self) -> Result<()>;

    /// The GPU stream the engine queues its work on (none on the CPU):
    /// timelines record their events there.
    fn stream(&self) -> Option<&braid_cuda::Stream> {
        None
    }
}

/// Runs every backward unit of `engine` into `grads` with nothing handed
/// on (one process, or a micro-batch that does not communicate).
pub fn backward_local<E: Engine>(engine: &mut E, grads: &mut Flat<E>) -> Result<()> {
    let units = engine.unit_count();
    let mut w = E::Space::window(grads);
    for u in 0..units {
        engine.backward_unit(u, &mut w)?;
    }
    Ok(())
}
