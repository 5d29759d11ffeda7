//! [`Checkpointable`]: what checkpoints take from an engine — its flat
//! buffer as named tensors ([`NamedTensor`]) and its optimizer's state,
//! copied out moment by moment and loaded back ([`OptimizerState`]).

use super::info::EngineInfo;
use crate::Result;
use std::ops::Range;

/// A named tensor of the flat parameter buffer: checkpoints store the
/// model by these names and element offsets, so that a checkpoint written
/// under one layout of the flat buffer (padded for sharding, or not)
/// loads under another.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamedTensor {
    /// Its name (Hugging Face's, for the GPT engines).
    pub name: String,
    /// The whole model's shape of it (row-major).
    pub shape: Vec<usize>,
    /// Its elements of the flat buffer.
    pub range: Range<usize>,
    /// Where those elements sit in the whole tensor when the buffer holds
    /// only part of it (a tensor-parallel rank's); `None`: all of it.
    pub place: Option<braid_model::place::Place>,
    /// Whether this rank's checkpoints store it: a tensor that every
    /// tensor-parallel rank holds whole is stored by the first only.
    pub stored: bool,
}

impl NamedTensor {
    /// A tensor held whole.
    pub fn whole(name: impl Into<String>, shape: Vec<usize>, range: Range<usize>) -> NamedTensor {
        NamedTensor {
            name: name.into(),
            shape,
            range,
            place: None,
            stored: true,
        }
    }

    /// A tensor of the model that another rank holds (a pipeline's other
    /// stages): listed so that a checkpoint names the whole model and
    /// checks every tensor is covered; no elements here, never stored by
    /// this rank.
    pub fn elsewhere(name: impl Into<String>, shape: Vec<usize>) -> NamedTensor {
        NamedTensor {
            name: name.into(),
            shape,
            range: 0..0,
            place: None,
            stored: false,
        }
    }

    /// Its place: the one it records, or the whole tensor.
    pub fn place(&self) -> braid_model::place::Place {
        self.place
            .clone()
            .unwrap_or_else(|| braid_model::place::Place::whole(&self.shape))
    }
}

/// An optimizer's state copied to host memory (for a checkpoint): each
/// moment holds the elements asked for, their ranges one after another.
#[derive(Debug, Clone, PartialEq)]
pub struct OptimizerState {
    /// `adamw` or `sgd`.
    pub kind: String,
    /// The moments by PyTorch's names (`exp_avg` and `exp_avg_sq` for
    /// AdamW, `momentum_buffer` for SGD) and their values.
    pub moments: Vec<(String, Vec<f32>)>,
}

/// Where the elements `want` (flat ranges, each inside one range of
/// `shard`) sit in state laid out like `shard` (its ranges one after
/// another), or which one is outside it.
pub fn state_ranges(shard: &[Range<usize>], want: &[Range<usize>]) -> Result<Vec<Range<usize>>> {
    let mut starts = Vec::with_capacity(shard.len());
    let mut at = 0;
    for s in shard {
        starts.push(at);
        at += s.len();
    }
    want.iter()
        .map(|w| {
            shard
                .iter()
                .zip(&starts)
                .find(|(s, _)| s.start <= w.start && w.end <= s.end)
                .map(|(s, at)| at + (w.start - s.start)..at + (w.end - s.start))
                .ok_or_else(|| {
                    format!("elements {w:?} are not inside one range of the optimizer's shard")
                })
        })
        .collect()
}

/// An engine that can be checkpointed and resumed. Its master weights are
/// read where [`EngineInfo::host_params`] says they live (in host memory
/// under an offloaded optimizer), hence the supertrait.
pub trait Checkpointable: EngineInfo {
    /// The named tensors of the flat buffer (what checkpoints store the
    /// model by).
    fn tensors(&self) -> Vec<NamedTensor>;

    /// The optimizer's kind (`adamw`, `sgd`) and the names of its moments
    /// (PyTorch's: `exp_avg`, `exp_avg_sq`; `momentum_buffer`).
    fn optimizer_moments(&self) -> Result<(String, Vec<String>)>;

    /// Copies moment `moment` (its place in
    /// [`optimizer_moments`](Self::optimizer_moments)) of the flat
    /// elements `ranges` (each inside one range the optimizer owns) into
    /// `out`, one range after another (zeros before the first update).
    fn read_moment(
        &mut self,
        moment: usize,
        ranges: &[Range<usize>],
        out: &mut [f32],
    ) -> Result<()>;

    /// Replaces the optimizer's state by `state` (every range it owns,
    /// one after another), as after `updates` updates (a resumed run).
    fn set_optimizer_state(&mut self, state: &OptimizerState, updates: u64) -> Result<()>;
}
