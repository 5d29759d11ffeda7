//! [`Pass`]: whether a block's forward pass runs for the loss or again,
//! under checkpointing, for its backward pass.

/// Whether a block's forward pass runs for the loss, or again under
/// checkpointing for its backward pass (then it stops before the last
/// product, whose output is the kept residual stream).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Pass {
    Forward,
    Recompute,
}

impl Pass {
    /// The phase timer's name for a phase of this pass.
    pub(super) fn phase(self, forward: &'static str, recompute: &'static str) -> &'static str {
        match self {
            Pass::Forward => forward,
            Pass::Recompute => recompute,
        }
    }
}
