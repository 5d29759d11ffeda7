//! Sequence parallelism in the bf16 engine ([`MixedOptions::sequence_parallel`]):
//! a tensor-parallel rank keeps the residual stream, the LayerNorms'
//! inputs and statistics, and their gradients for its slice of the
//! `b × t` rows only (the `rank`-th of `size` equal slices). The row-wide
//! bf16 buffers a product reads whole (a LayerNorm's output, the residual
//! stream's gradient) keep every row: the rank writes its own block and
//! [`gather`] fills in the others in place. A row-split product's shares,
//! and a column-split product's input gradients, are summed onto each
//! rank's rows by [`scatter`] instead of an all-reduce. The LayerNorms'
//! parameter gradients (and the bias gradients that come with them) from
//! a rank's rows go to [`SeqRows::norm_grads`] first and are summed over
//! the group before they join the gradient buffer ([`add_norm_grads`]).
//!
//! [`MixedOptions::sequence_parallel`]: crate::cuda::model_mixed::MixedOptions::sequence_parallel

use super::state::Group;
use crate::cuda::kernels::Kernels;
use crate::tensor_comm::ReduceKind;
use braid_cuda::{CudaError, DeviceBuffer, DeviceWindow, Result, Stream};
use half::bf16;
use std::ops::Range;

/// A sequence-parallel rank's rows and its scratch.
pub(super) struct SeqRows {
    /// This rank's rows of the `b × t`.
    pub(super) rows: Range<usize>,
    /// Up to six vectors of the width (`6c`): a block's (or the head's)
    /// LayerNorm parameter gradients and the bias gradients computed with
    /// them, from this rank's rows.
    pub(super) norm_grads: DeviceBuffer<f32>,
}

impl SeqRows {
    /// The rows of `rank` of `size` over `n` rows, refused where they do
    /// not split evenly.
    pub(super) fn rows(
        n: usize,
        rank: usize,
        size: usize,
        (b, t): (usize, usize),
    ) -> Result<Range<usize>> {
        if n % size != 0 {
            return Err(CudaError::Invalid(format!(
                "sequence parallelism over {size} ranks splits the batch's {b} x {t} = {n} tokens \
                 into equal slices: use a batch or --seq whose product divides by {size} (or --no-sp)"
            )));
        }
        let m = n / size;
        Ok(rank * m..(rank + 1) * m)
    }
}

/// The rows a row-wide buffer of `n` rows keeps (`seq`'s, or all), and
/// their elements at width `c`.
pub(super) fn local(seq: &Option<SeqRows>, n: usize, c: usize) -> (usize, Range<usize>) {
    match seq {
        Some(q) => (q.rows.len(), q.rows.start * c..q.rows.end * c),
        None => (n, 0..n * c),
    }
}

fn no_group() -> CudaError {
    CudaError::Group("sequence parallelism without a tensor-parallel group".into())
}

/// Runs `gather` over the group under sequence parallelism (nothing
/// without it), its error named `what`.
fn gathering(
    group: &Option<Group>,
    seq: &Option<SeqRows>,
    what: &str,
    gather: impl FnOnce(&Group) -> std::result::Result<(), String>,
) -> Result<()> {
    match seq {
        None => Ok(()),
        Some(_) => gather(group.as_ref().ok_or_else(no_group)?)
            .map_err(|e| CudaError::Group(format!("{what}: {e}"))),
    }
}

/// The first `len` elements of `full` (bf16), this rank's rows written:
/// every rank's rows gathered there in place. Nothing without sequence
/// parallelism.
pub(super) fn gather(
    group: &Option<Group>,
    seq: &Option<SeqRows>,
    full: &mut DeviceBuffer<bf16>,
    len: usize,
    s: &Stream,
    what: &str,
) -> Result<()> {
    gathering(group, seq, what, |g| {
        g.comm.all_gather_bf16(full.view_mut(0..len), s)
    })
}

/// After a LayerNorm's backward pass over this rank's rows: every row of
/// its recomputed output `ln` (where it was recomputed there, for the
/// weight gradient of the product it feeds) and of the residual stream's
/// bf16 gradient `dres_bf` (the next products' output gradient), each
/// `b·t × c`.
pub(super) fn gather_after_norm(
    group: &Option<Group>,
    seq: &Option<SeqRows>,
    ln: Option<&mut DeviceBuffer<bf16>>,
    (dres_bf, len): (&mut DeviceBuffer<bf16>, usize),
    s: &Stream,
    what: &str,
) -> Result<()> {
    if let Some(ln) = ln {
        gather(group, seq, ln, len, s, what)?;
    }
    gather(group, seq, dres_bf, len, s, what)
}

/// [`gather`] for f32 (the residual stream's gradient before the
/// embeddings' backward pass).
pub(super) fn gather_f32(
    group: &Option<Group>,
    seq: &Option<SeqRows>,
    full: &mut DeviceBuffer<f32>,
    len: usize,
    s: &Stream,
    what: &str,
) -> Result<()> {
    gathering(group, seq, what, |g| {
        g.comm.all_gather_f32(full.view_mut(0..len), s)
    })
}

/// The first `len` elements of `full` (bf16, every row): this rank's
/// rows become the sum of every rank's same rows (the others are left
/// undefined).
pub(super) fn scatter(
    g: &Group,
    full: &mut DeviceBuffer<bf16>,
    len: usize,
    s: &Stream,
    what: &str,
) -> Result<()> {
    g.comm
        .reduce_scatter_bf16(full.view_mut(0..len), s)
        .map_err(|e| CudaError::Group(format!("{what}: {e}")))
}

/// Sums the first `into.len()` vectors of `seq`'s LayerNorm scratch
/// (`c` each) over the group and adds them into `g` at `into`, in order
/// (an empty range skips its vector).
#[allow(clippy::too_many_arguments)]
pub(super) fn add_norm_grads(
    group: &Option<Group>,
    seq: &mut SeqRows,
    k: &Kernels,
    g: &mut DeviceWindow<'_, f32>,
    into: &[Range<usize>],
    c: usize,
    s: &Stream,
    what: &str,
) -> Result<()> {
    let grp = group.as_ref().ok_or_else(no_group)?;
    let len = into.len() * c;
    grp.comm
        .all_reduce_f32(seq.norm_grads.view_mut(0..len), ReduceKind::Sum, s)
        .map_err(|e| CudaError::Group(format!("{what}: {e}")))?;
    for (i, r) in into.iter().enumerate().filter(|(_, r)| !r.is_empty()) {
        k.add_inplace(
            s,
            &mut g.view_mut(r.clone())?,
            &seq.norm_grads.view(i * c..(i + 1) * c),
        )?;
    }
    Ok(())
}
