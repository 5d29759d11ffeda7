//! [`ShardedOptimizer`]: an optimizer that owns only a shard of the flat
//! buffer — ZeRO stage 1's seam (each rank updates its slice of every
//! bucket from the whole gradient buffer) and stage 2's (each rank
//! updates its slice from its reduce-scattered gradients alone) — with
//! the gradient norm over such a shard.

use super::core::{Engine, Flat, UpdateStep};
use crate::Result;
use std::ops::Range;

/// An engine whose optimizer can own a shard of the flat buffer (ZeRO-1
/// and ZeRO-2, and ZeRO-3's gradient norm).
pub trait ShardedOptimizer: Engine {
    /// Makes the optimizer own only the elements `shard` of the flat
    /// buffer (ranges, increasing, not overlapping), as a ZeRO rank owns
    /// its slice of each bucket: its state shrinks to them and
    /// [`update`](Engine::update) reads `grads` and changes parameters
    /// only there, with the same arithmetic per element. Before the first
    /// update.
    fn shard_optimizer(&mut self, shard: &[Range<usize>]) -> Result<()>;

    /// One optimizer update of the optimizer's shard from `grads`, which
    /// holds only the shard's gradients: its ranges one after another (a
    /// ZeRO rank's reduce-scattered blocks).
    fn update_shard(&mut self, grads: &Flat<Self>, step: UpdateStep) -> Result<()>;

    /// The sum of squares of the elements `ranges` of `grads` (a sharded
    /// strategy's part of the gradient norm; waits for queued work).
    fn grad_sq_norm_of(&mut self, grads: &Flat<Self>, ranges: &[Range<usize>]) -> Result<f64>;

    /// The sum of squares of `compact`, the gradients of the flat elements
    /// `ranges` one after another (a ZeRO-3 rank's reduce-scattered
    /// shard). By default that of `compact` alone; an engine whose norm
    /// weighs elements by where they sit (a tensor-parallel rank counts
    /// the tensors its whole group holds once) looks at `ranges`.
    fn grad_sq_norm_compact(
        &mut self,
        compact: &Flat<Self>,
        _ranges: &[Range<usize>],
    ) -> Result<f64> {
        self.grad_sq_norm(compact)
    }
}

/// `shard` for [`ShardedOptimizer::shard_optimizer`] over `len`
/// parameters, or why not: ranges must be non-empty, increasing, not
/// overlapping, inside.
pub fn check_shard(shard: &[Range<usize>], len: usize) -> Result<()> {
    let mut after = 0;
    for r in shard {
        if r.is_empty() || r.start < after || r.end > len {
            return Err(format!(
                "optimizer shard {shard:?}: ranges must be non-empty and increase without \
                 overlap inside the {len} parameters"
            ));
        }
        after = r.end;
    }
    Ok(())
}
