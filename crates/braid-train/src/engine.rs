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
mod core;
pub mod info;
pub mod lending;
pub mod sharded_optimizer;
pub mod sharded_params;

pub use self::core::{Engine, Flat, Unit, UpdateStep, Window};
pub use blocks::{BlockGrads, ParamUnits};
pub use checkpointable::{state_ranges, Checkpointable, NamedTensor, OptimizerState};
pub use info::{EngineInfo, Matrix, StateBytes};
pub use lending::{LendsMemory, SavedBuffer};
pub use sharded_optimizer::{check_shard, ShardedOptimizer};
pub use sharded_params::ShardedParams;

use crate::space::Space;
use crate::Result;

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
