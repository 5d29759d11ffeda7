//! The model state crossing a checkpoint: the part one rank writes
//! ([`StatePart`]), and where a resumed run reads its state from
//! ([`StateSource`]).

use super::staging::HostBuf;
use crate::engine::NamedTensor;
use crate::Result;
use std::ops::Range;

/// The part of the model state one rank writes: flat elements `ranges`
/// (of the engine's buffer, increasing), their parameters and their
/// optimizer state, each laid out as the ranges one after another, in
/// host memory from the save's [`Staging`](super::Staging).
#[derive(Debug)]
pub struct StatePart {
    /// The flat elements.
    pub ranges: Vec<Range<usize>>,
    /// Their parameters (f32 master weights).
    pub params: HostBuf,
    /// The optimizer's kind (`adamw`, `sgd`).
    pub kind: String,
    /// Its moments of those elements, by name.
    pub moments: Vec<(String, HostBuf)>,
}

impl StatePart {
    /// Its buffers, to be reused by the next save.
    pub fn into_bufs(self) -> impl Iterator<Item = HostBuf> {
        std::iter::once(self.params).chain(self.moments.into_iter().map(|(_, b)| b))
    }
}

/// Where a resumed run reads its state from.
pub trait StateSource {
    /// The values of `what` — `params`, or a moment's name — for the
    /// elements `ranges` of a flat buffer whose tensors are `tensors`,
    /// one range after another (elements between tensors, the padding of
    /// a sharded layout, are 0). A tensor the source lacks, or holds in
    /// another shape, is an error naming it.
    fn read(
        &self,
        what: &str,
        tensors: &[NamedTensor],
        ranges: &[Range<usize>],
    ) -> Result<Vec<f32>>;
    /// The optimizer's kind (`adamw`, `sgd`) and its moments' names.
    fn optimizer(&self) -> (String, Vec<String>);
    /// Optimizer steps taken when it was written.
    fn step(&self) -> u64;
}
