//! [`Gpt`]: the CPU model's state — its layout, the widths of its passes,
//! its tensor-parallel group ([`Group`]) and where its parameters sit in
//! their blocks. Its passes are the [model module](super)'s.

use super::acts::Widths;
use crate::block::LayerRanges;
use crate::layout::Layout;
use crate::tensor_comm::TensorComm;
use std::ops::Range;
use std::sync::Arc;

/// How this model takes part in tensor parallelism.
#[derive(Clone)]
pub(super) struct Group {
    pub(super) comm: Arc<dyn TensorComm>,
    /// Sequence parallelism: the residual stream's rows split too.
    pub(super) sequence: bool,
}

impl std::fmt::Debug for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Group {{ rank {} of {}, sequence {} }}",
            self.comm.rank(),
            self.comm.size(),
            self.sequence
        )
    }
}

/// Forward and backward passes of one model layout.
#[derive(Debug, Clone)]
pub struct Gpt {
    pub(super) layout: std::sync::Arc<Layout>,
    /// The widths of this rank's passes.
    pub(super) widths: Widths,
    /// Its tensor-parallel group, when it is one rank's share.
    pub(super) group: Option<Group>,
    /// Each layer's parameters in the layer's block.
    pub(super) layers: Vec<LayerRanges>,
    /// `wte` and `wpe` in the embedding block.
    pub(super) wte: Range<usize>,
    pub(super) wpe: Range<usize>,
    /// `ln_f`'s weight and bias in the final norm's block.
    pub(super) lnf_w: Range<usize>,
    pub(super) lnf_b: Range<usize>,
}
