//! The products whose results the tensor group sums, in blocks of rows:
//! forward, a row-split product (the attention's output projection and the
//! MLP's second product, Megatron's `g`); backward, a column-split
//! product's input gradient (qkv's and the MLP's first, Megatron's `f`).
//! Each block's all-reduce starts as soon as its product is queued and runs
//! on the group's stream beside the next block's product; the model's
//! stream waits for all of them at the end
//! ([`GpuGptMixed::overlap_tensor_sums`]). In one block, or without a
//! group, it is the plain product and sum. A column-split product's input
//! gradient may also have its sum only started here, the backward pass
//! running the weight gradient beside it and joining it later
//! ([`GpuGptMixed::sum_input_grads_beside_weight_grads`]).
//!
//! [`GpuGptMixed::overlap_tensor_sums`]: super::state::GpuGptMixed::overlap_tensor_sums
//! [`GpuGptMixed::sum_input_grads_beside_weight_grads`]: super::state::GpuGptMixed::sum_input_grads_beside_weight_grads

use super::products::{mm, span, Product};
use super::state::{FusedProducts, Group};
use super::sums::{sum_bf16, sum_f32};
use crate::cuda::mixed::MixedKernels;
use braid_cuda::blas::{Blas, Mat};
use braid_cuda::blaslt::Epilogue;
use braid_cuda::{CudaError, DeviceBuffer, DeviceMem, Result, Stream};
use half::bf16;
use std::ops::Range;

/// What [`row_split_sum`] computes: `d = a · b` over `m` rows (`a`: `m ×
/// k` bf16, `b`: the `k × n` weights), then `+ residual + bias` where
/// `residual` is given (the group's first rank adds them once, before the
/// sum).
pub(super) struct RowSplit<'a, B: DeviceMem<f32>> {
    pub(super) m: usize,
    pub(super) n: usize,
    pub(super) k: usize,
    pub(super) a: &'a DeviceBuffer<bf16>,
    pub(super) b: Mat,
    pub(super) residual: Option<&'a DeviceBuffer<f32>>,
    pub(super) bias: &'a B,
}

/// Runs `x` into `d` and sums `d` over `group` (`what` names it in errors),
/// in `blocks` row blocks where the rows split evenly, else in one. With
/// `in_bf16` (a bf16 scratch of `m × n`) and a group, the product goes
/// there in bf16, is summed over the group in bf16 (half the bytes), and
/// every rank adds the residual and bias after the sum, in f32 (`x` must
/// then carry the residual on every rank).
#[allow(clippy::too_many_arguments)]
fn row_split_sum<B: DeviceMem<f32>>(
    blas: &mut Blas,
    lt: &mut Option<FusedProducts>,
    mk: &MixedKernels,
    s: &Stream,
    group: &Option<Group>,
    (blocks, in_bf16): (usize, Option<&mut DeviceBuffer<bf16>>),
    x: RowSplit<'_, B>,
    d: &mut DeviceBuffer<f32>,
    what: &str,
) -> Result<()> {
    if let (Some(g), Some(part)) = (group, in_bf16) {
        return bf16_sum(blas, mk, s, g, (blocks, None), x, part, d, what);
    }
    let g = match group {
        Some(g) if blocks > 1 && x.m % blocks == 0 => g,
        _ => {
            product_rows(blas, lt, mk, s, &x, 0..x.m, d)?;
            return sum_f32(group, d, s, what);
        }
    };
    let rows = x.m / blocks;
    let err = |e: String| CudaError::Group(format!("{what}: {e}"));
    for i in 0..blocks {
        let r = i * rows..(i + 1) * rows;
        product_rows(blas, lt, mk, s, &x, r.clone(), d)?;
        g.comm
            .start_all_reduce_f32(d.view_mut(r.start * x.n..r.end * x.n), s)
            .map_err(err)?;
    }
    g.comm.wait_started(s).map_err(err)
}

/// [`row_split_sum`] with the sum in bf16: the product into `part`, its
/// sum over `g` (in row blocks beside the next block's product, as the
/// f32 sums), then `d = residual + bias + part` on every rank. Under
/// sequence parallelism (`mine`, this rank's rows: one block) the sum is
/// reduce-scattered onto each rank's rows instead, and `d` and the
/// residual hold this rank's rows alone.
#[allow(clippy::too_many_arguments)]
fn bf16_sum<B: DeviceMem<f32>>(
    blas: &mut Blas,
    mk: &MixedKernels,
    s: &Stream,
    g: &Group,
    (blocks, mine): (usize, Option<Range<usize>>),
    x: RowSplit<'_, B>,
    part: &mut DeviceBuffer<bf16>,
    d: &mut DeviceBuffer<f32>,
    what: &str,
) -> Result<()> {
    let (m, n, k) = (x.m, x.n, x.k);
    let residual = x.residual.ok_or_else(|| {
        CudaError::Invalid(format!(
            "{what}: a sum in bf16 adds the residual after it, on every rank: none given"
        ))
    })?;
    let blocks = match blocks > 1 && m % blocks == 0 && mine.is_none() {
        true => blocks,
        false => 1,
    };
    let rows = m / blocks;
    let err = |e: String| CudaError::Group(format!("{what}: {e}"));
    for i in 0..blocks {
        let r = i * rows..(i + 1) * rows;
        let a = x.a.view(r.start * k..r.end * k);
        let out = part.view(r.start * n..r.end * n);
        let product = Product {
            m: rows,
            n,
            k,
            a: Mat::of(&a, k),
            b: x.b,
        };
        product.plain(blas, s, Mat::of(&out, n), 0.0)?;
        match (blocks, &mine) {
            (_, Some(_)) => super::seq::scatter(g, part, m * n, s, what)?,
            (1, None) => g
                .comm
                .all_reduce_bf16(part.view_mut(0..m * n), s)
                .map_err(err)?,
            _ => g
                .comm
                .start_all_reduce_bf16(part.view_mut(r.start * n..r.end * n), s)
                .map_err(err)?,
        }
    }
    if blocks > 1 {
        g.comm.wait_started(s).map_err(err)?;
    }
    match mine {
        None => mk.residual_bias_add(s, d, residual, x.bias, &*part, m, n),
        Some(r) => {
            let part = part.view(r.start * n..r.end * n);
            mk.residual_bias_add(s, d, residual, x.bias, &part, r.len(), n)
        }
    }
}

/// A row-split product and its sum over the group, as the forward pass
/// runs it: reduce-scattered onto this rank's rows under sequence
/// parallelism ([`bf16_sum`], `part` its bf16 scratch), else
/// [`row_split_sum`] (in `blocks` row blocks; in bf16 into `part` where
/// `in_bf16`).
#[allow(clippy::too_many_arguments)]
pub(super) fn row_split_product<B: DeviceMem<f32>>(
    blas: &mut Blas,
    lt: &mut Option<FusedProducts>,
    mk: &MixedKernels,
    s: &Stream,
    (group, seq): (&Option<Group>, &Option<super::seq::SeqRows>),
    (blocks, in_bf16): (usize, bool),
    x: RowSplit<'_, B>,
    part: &mut DeviceBuffer<bf16>,
    d: &mut DeviceBuffer<f32>,
    what: &str,
) -> Result<()> {
    match (group, seq) {
        (Some(g), Some(q)) => bf16_sum(blas, mk, s, g, (1, Some(q.rows.clone())), x, part, d, what),
        _ => {
            let part = in_bf16.then_some(part);
            row_split_sum(blas, lt, mk, s, group, (blocks, part), x, d, what)
        }
    }
}

/// Rows `r` of `x`'s product into the same rows of `d`.
fn product_rows<B: DeviceMem<f32>>(
    blas: &mut Blas,
    lt: &mut Option<FusedProducts>,
    mk: &MixedKernels,
    s: &Stream,
    x: &RowSplit<'_, B>,
    r: Range<usize>,
    d: &mut DeviceBuffer<f32>,
) -> Result<()> {
    let (n, k) = (x.n, x.k);
    let a = x.a.view(r.start * k..r.end * k);
    let product = || Product {
        m: r.len(),
        n,
        k,
        a: Mat::of(&a, k),
        b: x.b,
    };
    let mut out = d.view_mut(r.start * n..r.end * n);
    let Some(residual) = x.residual else {
        // This rank's share of a row-split product, alone.
        return product().plain(blas, s, Mat::of(&out, n), 0.0);
    };
    let residual = residual.view(r.start * n..r.end * n);
    let bias = Epilogue::Bias { bias: span(x.bias) };
    if !product().fused(lt, s, Some(Mat::of(&residual, n)), Mat::of(&out, n), bias)? {
        mk.residual_bias(s, &mut out, &residual, x.bias, r.len(), n)?;
        product().plain(blas, s, Mat::of(&out, n), 1.0)?;
    }
    Ok(())
}

/// The input gradient of a column-split product, `dx = dy · wᵀ` over `m`
/// rows (`dy`: `m × out`, `w`: the `inp × out` weights, `dx`: `m × inp`
/// bf16), its sum over `g` started on the group's stream: the model's
/// stream goes on with work that neither reads nor writes `dx` until
/// [`wait_for_sums`] joins it.
#[allow(clippy::too_many_arguments)]
pub(super) fn start_input_grad_sum(
    blas: &mut Blas,
    s: &Stream,
    g: &Group,
    (m, inp, out): (usize, usize, usize),
    dy: Mat,
    w: Mat,
    dx: &mut DeviceBuffer<bf16>,
    what: &str,
) -> Result<()> {
    mm(blas, s, m, inp, out, dy, w.t(), Mat::of(&*dx, inp), 0.0)?;
    g.comm
        .start_all_reduce_bf16(dx.view_mut(0..m * inp), s)
        .map_err(|e| CudaError::Group(format!("{what}: {e}")))
}

/// The model's stream `s` waits for the sums started over `g`.
pub(super) fn wait_for_sums(g: &Group, s: &Stream, what: &str) -> Result<()> {
    g.comm
        .wait_started(s)
        .map_err(|e| CudaError::Group(format!("{what}: {e}")))
}

/// The input gradient of a column-split product, `dx = dy · wᵀ` over `m`
/// rows (`dy`: `m × out`, `w`: the `inp × out` weights, `dx`: `m × inp`
/// bf16), summed over `group` — in `blocks` row blocks whose sums run
/// beside the next block's product, where the rows split evenly and `dy`
/// is a plain row-major operand; else whole, then summed. Under sequence
/// parallelism (`seq`) whole, its sum scattered onto each rank's rows.
#[allow(clippy::too_many_arguments)]
pub(super) fn input_grad_sum(
    blas: &mut Blas,
    s: &Stream,
    (group, seq): (&Option<Group>, bool),
    blocks: usize,
    (m, inp, out): (usize, usize, usize),
    dy: Mat,
    w: Mat,
    dx: &mut DeviceBuffer<bf16>,
    what: &str,
) -> Result<()> {
    if let (Some(g), true) = (group, seq) {
        // Sequence parallelism: the sum onto each rank's rows.
        mm(blas, s, m, inp, out, dy, w.t(), Mat::of(&*dx, inp), 0.0)?;
        return super::seq::scatter(g, dx, m * inp, s, what);
    }
    let rows = m / blocks.max(1);
    let split = match group {
        Some(g) if blocks > 1 && m % blocks == 0 && dy.rows(0..rows).is_some() => Some(g),
        _ => None,
    };
    let Some(g) = split else {
        mm(blas, s, m, inp, out, dy, w.t(), Mat::of(&*dx, inp), 0.0)?;
        return sum_bf16(group, dx, s, what);
    };
    let err = |e: String| CudaError::Group(format!("{what}: {e}"));
    for i in 0..blocks {
        let r = i * rows..(i + 1) * rows;
        let dy_r = dy.rows(r.clone()).ok_or_else(|| {
            CudaError::Invalid(format!("{what}: rows {r:?} of the output gradient"))
        })?;
        let dx_r = dx.view(r.start * inp..r.end * inp);
        mm(
            blas,
            s,
            rows,
            inp,
            out,
            dy_r,
            w.t(),
            Mat::of(&dx_r, inp),
            0.0,
        )?;
        g.comm
            .start_all_reduce_bf16(dx.view_mut(r.start * inp..r.end * inp), s)
            .map_err(err)?;
    }
    g.comm.wait_started(s).map_err(err)
}
