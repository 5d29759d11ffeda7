//! [`ShardedParams`]: ZeRO stage 3's unit protocol (FSDP) — the engine
//! gives up its whole parameter buffer for a shard of master weights,
//! runs its passes unit by unit on blocks the strategy gathers and hands
//! it ([`ParamUnits`](super::ParamUnits)), optionally in bf16, and updates
//! the shard alone; at the end it takes the whole parameters back.

use super::blocks::BlockGrads;
use super::core::{Flat, UpdateStep};
use crate::Result;
use std::ops::Range;

/// An engine whose parameters a strategy can shard (ZeRO-3): the master
/// shard's life cycle and the passes in units that take their parameter
/// blocks as arguments.
pub trait ShardedParams: BlockGrads {
    /// Gives up the whole parameter buffer: returns the elements `shard`
    /// of it, one range after another (a ZeRO-3 rank's master weights),
    /// and from then on runs only the unit passes
    /// ([`forward_begin`](Self::forward_begin),
    /// [`forward_unit`](Self::forward_unit),
    /// [`backward_unit_of`](Self::backward_unit_of)), which take their
    /// parameters as arguments, and [`update_compact`](Self::update_compact).
    /// The optimizer is sharded to `shard` as by
    /// [`shard_optimizer`](super::ShardedOptimizer::shard_optimizer).
    fn shard_params(&mut self, shard: &[Range<usize>]) -> Result<Flat<Self>>;

    /// Takes whole parameters back (`full`, the flat parameters in host
    /// memory), after [`shard_params`](Self::shard_params): the engine's
    /// parameters are whole again (a GPU engine keeps them in host memory,
    /// to be saved, and runs no further pass).
    fn unshard_params(&mut self, full: Vec<f32>) -> Result<()>;

    /// Takes some blocks in bf16 from now on (after
    /// [`shard_params`](Self::shard_params); a strategy whose collectives
    /// gather in bf16 asks once, before the first pass): returns those
    /// blocks and the flat ranges of the tensors in them that the passes
    /// still read in f32, in the order [`half_side`](Self::half_side)
    /// packs them. Such a block reaches [`forward_unit`](Self::forward_unit)
    /// and [`backward_unit_of`](Self::backward_unit_of) as bf16 values
    /// packed two to an element (a buffer of half the block's length),
    /// rounded to nearest even from the f32 master weights — what the
    /// engine's own cast would give. None by default.
    fn start_half_blocks(&mut self) -> Result<(Vec<usize>, Vec<Range<usize>>)> {
        Ok((Vec::new(), Vec::new()))
    }

    /// The f32 tensors of the blocks taken in bf16, packed in the order
    /// [`start_half_blocks`](Self::start_half_blocks) gave: the strategy
    /// fills it from the master weights whenever they change, before the
    /// next pass. `None` before then.
    fn half_side(&mut self) -> Option<&mut Flat<Self>> {
        None
    }

    /// Starts a forward pass in units on `batch` (after
    /// [`shard_params`](Self::shard_params)); with `grad`, keeps what the
    /// backward pass needs.
    fn forward_begin(&mut self, batch: &Self::Batch, grad: bool) -> Result<()>;

    /// Forward unit `unit` (in order), given the parameters of the blocks
    /// [`ParamUnits::forward`](super::ParamUnits::forward) names for it,
    /// in that order, each a buffer of its block's length. After the last
    /// unit, returns the mean loss.
    fn forward_unit(&mut self, unit: usize, params: &[&Flat<Self>]) -> Result<Option<f32>>;

    /// The part of backward unit `unit` that writes no gradient (under
    /// activation checkpointing, the recomputation of a layer's
    /// activations), run on its own before
    /// [`backward_unit_of`](Self::backward_unit_of) of the same unit,
    /// which then goes on from there: `params` as that takes them.
    /// `false`, with nothing run, where the unit has no such part (the
    /// default).
    fn recompute_unit_of(&mut self, unit: usize, params: &[&Flat<Self>]) -> Result<bool> {
        let _ = (unit, params);
        Ok(false)
    }

    /// Whether backward unit `unit` has a part that
    /// [`recompute_unit_of`](Self::recompute_unit_of) runs (false by
    /// default).
    fn recomputes_unit(&self, unit: usize) -> bool {
        let _ = unit;
        false
    }

    /// Backward unit `unit` (in order, after a forward pass in units with
    /// `grad`): `params` are the blocks
    /// [`ParamUnits::backward_reads`](super::ParamUnits::backward_reads)
    /// names, `grads` those
    /// [`ParamUnits::backward_writes`](super::ParamUnits::backward_writes)
    /// names (each its block's length), in that order; adds the unit's
    /// gradients into them.
    fn backward_unit_of(
        &mut self,
        unit: usize,
        params: &[&Flat<Self>],
        grads: &mut [&mut Flat<Self>],
    ) -> Result<()>;

    /// One optimizer update of the master weights `params` (the shard's,
    /// as [`shard_params`](Self::shard_params) returned them) from the
    /// shard's gradients `grads`, laid out alike.
    fn update_compact(
        &mut self,
        params: &mut Flat<Self>,
        grads: &Flat<Self>,
        step: UpdateStep,
    ) -> Result<()>;

    /// Frees the optimizer's state after the last update (training is
    /// over: a parameter-sharded strategy gathers the whole parameters
    /// into the room); an update after this is refused. Nothing by
    /// default.
    fn release_optimizer_state(&mut self) -> Result<()> {
        Ok(())
    }
}
