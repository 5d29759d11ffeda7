//! What an f32 [`GpuGpt`] holds: its buffers — each layer's saved
//! tensors ([`LayerActs`]) — and its tensor-parallel group ([`Group`],
//! with a sequence-parallel rank's rows, [`SeqRows`]). Fields and methods
//! are `pub(super)`: seen by `model` and its children, as before.

use crate::block::LayerRanges;
use crate::cuda::attention::AttnScratch;
use crate::cuda::batch::DeviceBatch;
use crate::cuda::kernels::Kernels;
use crate::layout::Layout;
use crate::model::Widths;
use crate::tensor_comm::{DeviceTensorComm, ReduceKind};
use braid_cuda::blas::Blas;
use braid_cuda::memory::copy_async;
use braid_cuda::{CudaError, DeviceBuffer, DeviceWindow, Result, Stream};
use std::ops::Range;
use std::sync::Arc;

/// One layer's saved tensors: the block's own ([`crate::block::INSIDE`],
/// by [`Act::inner`]), each LayerNorm's statistics and the attention's
/// state.
///
/// [`Act::inner`]: crate::block::Act::inner
pub(super) struct LayerActs {
    pub(super) t: [DeviceBuffer<f32>; 7],
    pub(super) mean: [DeviceBuffer<f32>; 2],
    pub(super) rstd: [DeviceBuffer<f32>; 2],
    pub(super) attn: AttnScratch,
}

/// A tensor-parallel rank's group: its collectives, the rows' maxima
/// and sums of the vocabulary-parallel cross-entropy (`n` and `2n`), and
/// under sequence parallelism the rank's rows.
pub(super) struct Group {
    pub(super) comm: Arc<dyn DeviceTensorComm>,
    pub(super) mx: DeviceBuffer<f32>,
    pub(super) sums: DeviceBuffer<f32>,
    pub(super) seq: Option<SeqRows>,
}

/// A sequence-parallel rank's slice of the rows and its whole-row
/// scratch.
pub(super) struct SeqRows {
    /// This rank's rows of the `b × t`: the `rank`-th of `size` slices.
    pub(super) rows: Range<usize>,
    /// Whole rows gathered from every rank's slice (`n × c`): a
    /// LayerNorm's output before a column-split product or its weight
    /// gradient, a row-split product's output gradient.
    pub(super) gathered: DeviceBuffer<f32>,
    /// The gradients of one block's (or the head's) LayerNorms from this
    /// rank's rows (`ln_1` weight and bias, `ln_2` weight and bias: `4c`),
    /// summed over the group before they join the gradient buffer.
    pub(super) norm_grads: DeviceBuffer<f32>,
}

impl Group {
    /// `local` (this rank's rows of `c`) into its block of the whole-row
    /// buffer, then every rank's block gathered there.
    pub(super) fn gather(
        &mut self,
        local: &DeviceBuffer<f32>,
        c: usize,
        s: &Stream,
        what: &str,
    ) -> Result<()> {
        let Group { comm, seq, .. } = self;
        let seq = seq.as_mut().ok_or_else(no_rows)?;
        let block = seq.rows.start * c..seq.rows.end * c;
        copy_async(&mut seq.gathered.view_mut(block), local, s)?;
        let len = seq.gathered.len();
        comm.all_gather_f32(seq.gathered.view_mut(0..len), s)
            .map_err(|e| CudaError::Group(format!("{what}: {e}")))
    }

    /// Sums `full` (whole rows of `c`) over the group into this rank's
    /// block, in place; returns the block's elements.
    pub(super) fn scatter(
        &self,
        full: &mut DeviceBuffer<f32>,
        c: usize,
        s: &Stream,
        what: &str,
    ) -> Result<Range<usize>> {
        let seq = self.seq.as_ref().ok_or_else(no_rows)?;
        self.comm
            .reduce_scatter_f32(full.view_mut(0..full.len()), s)
            .map_err(|e| CudaError::Group(format!("{what}: {e}")))?;
        Ok(seq.rows.start * c..seq.rows.end * c)
    }

    /// The whole rows last gathered.
    pub(super) fn gathered(&self) -> Result<&DeviceBuffer<f32>> {
        Ok(&self.seq.as_ref().ok_or_else(no_rows)?.gathered)
    }

    /// Sums the first `len` LayerNorm gradients of this rank's rows over
    /// the group and adds them into `g` at `into` (`c` each, in order).
    pub(super) fn add_norm_grads(
        &mut self,
        k: &Kernels,
        g: &mut DeviceWindow<'_, f32>,
        into: &[Range<usize>],
        s: &Stream,
        what: &str,
    ) -> Result<()> {
        let Group { comm, seq, .. } = self;
        let seq = seq.as_mut().ok_or_else(no_rows)?;
        let len: usize = into.iter().map(|r| r.len()).sum();
        comm.all_reduce_f32(seq.norm_grads.view_mut(0..len), ReduceKind::Sum, s)
            .map_err(|e| CudaError::Group(format!("{what}: {e}")))?;
        let mut at = 0;
        for r in into {
            k.add_inplace(
                s,
                &mut g.view_mut(r.clone())?,
                &seq.norm_grads.view(at..at + r.len()),
            )?;
            at += r.len();
        }
        Ok(())
    }
}

pub(super) fn no_rows() -> CudaError {
    CudaError::Invalid(
        "sequence-parallel buffers asked of a model without sequence parallelism".into(),
    )
}

/// Whether `group` runs sequence parallelism.
pub(super) fn sequence(group: &Option<Group>) -> bool {
    matches!(group, Some(Group { seq: Some(_), .. }))
}

/// A GPT model's forward and backward passes on one GPU, sized for one
/// (batch, sequence) shape.
pub struct GpuGpt {
    pub(super) layout: Arc<Layout>,
    /// The widths of this rank's passes.
    pub(super) widths: Widths,
    /// The tensor-parallel group, when this is one rank's share.
    pub(super) group: Option<Group>,
    pub(super) stream: Stream,
    pub(super) kernels: Kernels,
    pub(super) blas: Blas,
    pub(super) b: usize,
    pub(super) t: usize,
    /// Per layer of the model: its ranges and activations, where this
    /// model's layout holds it (a pipeline stage's holds some).
    pub(super) ranges: Vec<Option<LayerRanges>>,
    pub(super) layers: Vec<Option<LayerActs>>,
    /// The residual stream at each held layer's input and output.
    pub(super) resid: Vec<Option<DeviceBuffer<f32>>>,
    pub(super) lnf: DeviceBuffer<f32>,
    pub(super) lnf_mean: DeviceBuffer<f32>,
    pub(super) lnf_rstd: DeviceBuffer<f32>,
    pub(super) logits: DeviceBuffer<f32>,
    pub(super) losses: DeviceBuffer<f32>,
    pub(super) batch: DeviceBatch,
    /// Gradient scratch of the block's tensors, shared by every layer (by
    /// the slots of `block`: `DRESID`, the residual stream's, ...).
    pub(super) d: [DeviceBuffer<f32>; 7],
    /// What the loss's gradient is multiplied by (1 / micro-batches where
    /// a step's gradients add up several: a pipeline's).
    pub(super) loss_weight: f32,
}
