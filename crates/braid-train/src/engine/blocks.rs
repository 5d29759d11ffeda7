//! [`BlockGrads`]: the model's parameters as blocks ([`ParamUnits`]: the
//! blocks, and which forward and backward units read and write which),
//! and a backward pass that writes its gradients into one buffer per
//! block instead of one whole buffer — ZeRO stage 2's seam (no whole
//! gradient buffer: each block's gradients are reduce-scattered into the
//! shard once final, and the buffer reused), which stage 3 builds on
//! ([`ShardedParams`](super::ShardedParams)).

use super::core::Flat;
use super::sharded_optimizer::ShardedOptimizer;
use crate::Result;
use std::ops::Range;

/// How a model's parameters split into the units a parameter-sharded
/// strategy (ZeRO stage 3, FSDP) gathers one at a time, and which units
/// of each pass read and write which of them.
///
/// Blocks are numbered by their place in [`blocks`](Self::blocks); the
/// forward units run in the order listed, the backward units are those of
/// [`Engine::units`](super::Engine::units), in order. A block's gradient is final after the last
/// backward unit that writes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamUnits {
    /// The parameter blocks: ranges of the flat buffer, increasing,
    /// together covering it.
    pub blocks: Vec<Range<usize>>,
    /// For each forward unit, the blocks whose parameters it reads.
    pub forward: Vec<Vec<usize>>,
    /// For each backward unit, the blocks whose parameters it reads.
    pub backward_reads: Vec<Vec<usize>>,
    /// For each backward unit, the blocks whose gradients it adds to.
    pub backward_writes: Vec<Vec<usize>>,
}

impl ParamUnits {
    /// Whether the blocks cover `0..len` in order and every unit names
    /// blocks that exist, or what is wrong.
    pub fn check(&self, len: usize, backward_units: usize) -> Result<()> {
        let mut at = 0;
        for (i, b) in self.blocks.iter().enumerate() {
            if b.start != at || b.end < b.start {
                return Err(format!(
                    "parameter block {i} is {b:?}: blocks must follow one another from 0"
                ));
            }
            at = b.end;
        }
        if at != len {
            return Err(format!(
                "the parameter blocks cover {at} of the {len} parameters"
            ));
        }
        if self.backward_reads.len() != backward_units
            || self.backward_writes.len() != backward_units
        {
            return Err(format!(
                "the parameter units describe {} / {} backward units, the engine runs {backward_units}",
                self.backward_reads.len(),
                self.backward_writes.len()
            ));
        }
        let lists = self
            .forward
            .iter()
            .chain(&self.backward_reads)
            .chain(&self.backward_writes);
        for list in lists {
            if let Some(b) = list.iter().find(|&&b| b >= self.blocks.len()) {
                return Err(format!(
                    "a unit names parameter block {b} of {}",
                    self.blocks.len()
                ));
            }
        }
        Ok(())
    }

    /// Forward unit `unit`'s blocks, checked against the lengths of the
    /// buffers given for them (`lens`, in order).
    pub fn forward_given(&self, unit: usize, lens: &[usize]) -> Result<&[usize]> {
        self.reads_given("forward", &self.forward, unit, lens)
    }

    /// Backward unit `unit`'s blocks read, checked against the lengths of
    /// the parameter buffers given for them.
    pub fn backward_reads_given(&self, unit: usize, lens: &[usize]) -> Result<&[usize]> {
        self.reads_given("backward", &self.backward_reads, unit, lens)
    }

    /// Unit `unit`'s blocks of `lists` (the `pass`'s reads), checked
    /// against the lengths of the buffers given for them.
    fn reads_given<'a>(
        &self,
        pass: &str,
        lists: &'a [Vec<usize>],
        unit: usize,
        lens: &[usize],
    ) -> Result<&'a [usize]> {
        let what = format!("{pass} unit {unit}");
        let want = lists
            .get(unit)
            .ok_or_else(|| format!("{what} does not exist"))?;
        self.check_lens(&what, want, lens)?;
        Ok(want)
    }

    /// Backward unit `unit`'s blocks, read and written, checked against
    /// the lengths of the parameter and gradient buffers given for them.
    pub fn backward_given(
        &self,
        unit: usize,
        params: &[usize],
        grads: &[usize],
    ) -> Result<(&[usize], &[usize])> {
        let what = format!("backward unit {unit}");
        let (reads, writes) = match (
            self.backward_reads.get(unit),
            self.backward_writes.get(unit),
        ) {
            (Some(r), Some(w)) => (r, w),
            _ => return Err(format!("{what} does not exist")),
        };
        self.check_lens(&what, reads, params)?;
        self.check_lens(&what, writes, grads)?;
        Ok((reads, writes))
    }

    /// Whether buffers of `lens` elements are the blocks `want`, in order,
    /// or what `what` was given instead.
    fn check_lens(&self, what: &str, want: &[usize], lens: &[usize]) -> Result<()> {
        let blocks: Vec<usize> = want.iter().map(|&b| self.blocks[b].len()).collect();
        match blocks == lens {
            true => Ok(()),
            false => Err(format!(
                "{what}: got buffers of {lens:?} elements for parameter blocks {want:?} \
                 ({blocks:?} elements)"
            )),
        }
    }

    /// For each block, the backward units after which its gradients are
    /// reduced, in order (none: no unit writes it): the last unit writing
    /// it (then its gradient is final) and, when `split`, also the last
    /// unit of every earlier run of consecutive units writing it — the
    /// tied embeddings, written by the head first and by the embedding
    /// unit last, are reduced in two parts, and no buffer holds their
    /// gradients in between.
    pub fn reduce_after(&self, split: bool) -> Vec<Vec<usize>> {
        let mut after: Vec<Vec<usize>> = vec![Vec::new(); self.blocks.len()];
        let units = self.backward_writes.len();
        for (u, writes) in self.backward_writes.iter().enumerate() {
            for &b in writes {
                let written_next = u + 1 < units && self.backward_writes[u + 1].contains(&b);
                let written_later = self.backward_writes[u + 1..].iter().any(|w| w.contains(&b));
                if !written_later || (split && !written_next) {
                    after[b].push(u);
                }
            }
        }
        after
    }
}

/// An engine whose parameters split into blocks ([`ParamUnits`]) and whose
/// backward pass can write each unit's gradients into block-sized
/// buffers (ZeRO-2; ZeRO-3 on top of it).
pub trait BlockGrads: ShardedOptimizer {
    /// The parameter units, for strategies that shard the gradients or
    /// the parameters by block (see [`ParamUnits`]).
    fn param_units(&self) -> Result<ParamUnits>;

    /// Prepares `grads`, the gradient buffer of parameter block `block`
    /// of [`param_units`](Self::param_units), for a backward unit that
    /// writes it: zeroes it (the default, as
    /// [`Engine::zero_grads`](super::Engine::zero_grads)), or,
    /// where the engine's next backward pass overwrites some of it, the
    /// rest.
    fn zero_block_grads(&mut self, block: usize, grads: &mut Flat<Self>) -> Result<()> {
        let _ = block;
        self.zero_grads(grads)
    }

    /// Backward unit `unit` of a whole-parameter engine (in order, after
    /// [`forward`](super::Engine::forward) with `grad`), reading its own
    /// parameters and adding the unit's gradients into `grads`: the blocks
    /// [`ParamUnits::backward_writes`] names for it, each its block's
    /// length, in that order (ZeRO stage 2: no whole gradient buffer).
    fn backward_unit_into(&mut self, unit: usize, grads: &mut [&mut Flat<Self>]) -> Result<()>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_reduced_after_their_last_writer_or_after_each_run_of_writers() {
        // The embeddings (block 0) written by the head (unit 0) and the
        // embedding unit (3); layer 1 (block 2) by units 1 and 2 in a row.
        let units = ParamUnits {
            blocks: vec![0..4, 4..8, 8..12, 12..14],
            forward: vec![vec![0], vec![1], vec![2], vec![3, 0]],
            backward_reads: vec![vec![3, 0], vec![2], vec![2, 1], vec![0]],
            backward_writes: vec![vec![3, 0], vec![2], vec![2, 1], vec![0]],
        };
        assert_eq!(
            units.reduce_after(false),
            vec![vec![3], vec![2], vec![2], vec![0]]
        );
        assert_eq!(
            units.reduce_after(true),
            vec![vec![0, 3], vec![2], vec![2], vec![0]]
        );
    }
}
