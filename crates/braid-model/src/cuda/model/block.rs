//! One transformer block's passes of the f32 [`GpuGpt`]: the operations
//! of [`crate::block`]'s description as cuBLAS products and the checked
//! kernels ([`F32Forward`], [`F32Backward`]); the sequence is walked by
//! [`block::forward`] and [`block::backward`]. Under sequence parallelism
//! a LayerNorm's output holds this rank's rows and the column product
//! that reads it gathers them; a row product's sum is reduce-scattered
//! into this rank's rows.

use super::state::{no_rows, sequence, GpuGpt, Group, LayerActs};
use crate::block::{Act, BlockBackward, BlockForward, LayerRanges, Linear, Norm};
use crate::cpu::attention::AttnShape;
use crate::cuda::attention::{attention_backward, attention_forward};
use crate::cuda::f32_params::F32Params;
use crate::cuda::kernels::Kernels;
use crate::model::Widths;
use braid_cuda::blas::Blas;
use braid_cuda::memory::{copy_async, zero_async};
use braid_cuda::{CudaError, DeviceBuffer, DeviceWindow, Result, Stream};

/// Slots of the gradient scratch shared by every layer
/// ([`GpuGpt`]'s `d`): the residual stream's (the block's input's and
/// output's), `resid2`'s, either LayerNorm output's, the MLP's before and
/// after its GELU, the attention output's and `qkv`'s.
pub(super) const DRESID: usize = 0;
pub(super) const DRESID2: usize = 1;
pub(super) const DLN: usize = 2;
pub(super) const DFCH: usize = 3;
pub(super) const DGELU: usize = 4;
pub(super) const DATTY: usize = 5;
pub(super) const DQKV: usize = 6;

/// Where a tensor's gradient is kept in the scratch.
fn grad_slot(a: Act) -> usize {
    match a {
        Act::X | Act::Out => DRESID,
        Act::Resid2 => DRESID2,
        Act::Ln1 | Act::Ln2 => DLN,
        Act::Fch => DFCH,
        Act::Gelu => DGELU,
        Act::Atty => DATTY,
        Act::Qkv => DQKV,
    }
}

/// Two different slots of the gradient scratch, both to write.
fn grad_pair(
    d: &mut [DeviceBuffer<f32>; 7],
    a: Act,
    b: Act,
) -> Result<(&mut DeviceBuffer<f32>, &mut DeviceBuffer<f32>)> {
    let (i, j) = (grad_slot(a), grad_slot(b));
    match i.cmp(&j) {
        std::cmp::Ordering::Less => {
            let (lo, hi) = d.split_at_mut(j);
            Ok((&mut lo[i], &mut hi[0]))
        }
        std::cmp::Ordering::Greater => {
            let (lo, hi) = d.split_at_mut(i);
            Ok((&mut hi[0], &mut lo[j]))
        }
        std::cmp::Ordering::Equal => Err(CudaError::Invalid(format!(
            "the block relates {a:?} and {b:?}, whose gradients share a buffer"
        ))),
    }
}

/// The block's tensors but the one being written: the block's input
/// outside its buffers, the rest around a hole.
struct Others<'b> {
    x: &'b DeviceBuffer<f32>,
    lo: &'b [DeviceBuffer<f32>],
    hi: &'b [DeviceBuffer<f32>],
    hole: usize,
}

impl<'b> Others<'b> {
    fn get(&self, a: Act) -> Result<&'b DeviceBuffer<f32>> {
        match a.inner() {
            None if a == Act::X => Ok(self.x),
            Some(i) if i < self.hole => Ok(&self.lo[i]),
            Some(i) if i > self.hole => Ok(&self.hi[i - self.hole - 1]),
            _ => Err(CudaError::Invalid(format!(
                "an operation of the block reads {a:?}, which it writes or which is not kept"
            ))),
        }
    }
}

/// The buffer of `o` to write — `out` for the block's output — and the
/// other tensors to read.
fn split<'b>(
    x: &'b DeviceBuffer<f32>,
    out: &'b mut DeviceBuffer<f32>,
    t: &'b mut [DeviceBuffer<f32>; 7],
    o: Act,
) -> Result<(&'b mut DeviceBuffer<f32>, Others<'b>)> {
    let Some(i) = o.inner() else {
        return match o {
            Act::Out => Ok((
                out,
                Others {
                    x,
                    lo: &t[..],
                    hi: &[],
                    hole: t.len(),
                },
            )),
            _ => Err(CudaError::Invalid(
                "an operation of the block writes its input".into(),
            )),
        };
    };
    let (lo, rest) = t.split_at_mut(i);
    let (mid, hi) = rest
        .split_first_mut()
        .ok_or_else(|| CudaError::Invalid(format!("no buffer for {o:?}")))?;
    Ok((mid, Others { x, lo, hi, hole: i }))
}

/// A saved tensor of the block: its input `x`, or one of its own.
fn saved<'b>(a: &'b LayerActs, x: &'b DeviceBuffer<f32>, t: Act) -> Result<&'b DeviceBuffer<f32>> {
    match t.inner() {
        Some(i) => Ok(&a.t[i]),
        None if t == Act::X => Ok(x),
        None => Err(CudaError::Invalid(format!("{t:?} is not saved"))),
    }
}

/// What both passes of one block read: the model's stream, kernels,
/// products and group, the layer's parameter ranges, its parameters and
/// the shape.
pub(super) struct BlockEnv<'a> {
    pub(super) s: &'a Stream,
    pub(super) k: &'a Kernels,
    pub(super) blas: &'a mut Blas,
    pub(super) group: &'a mut Option<Group>,
    /// Tensor-parallel shares of the model (1: the whole model).
    pub(super) shards: usize,
    pub(super) r: &'a LayerRanges,
    pub(super) p: F32Params<'a>,
    pub(super) w: Widths,
    pub(super) b: usize,
    pub(super) t: usize,
    /// The residual stream's rows here (this rank's under sequence
    /// parallelism).
    pub(super) rows: usize,
}

impl BlockEnv<'_> {
    fn n(&self) -> usize {
        self.b * self.t
    }

    fn shape(&self) -> AttnShape {
        AttnShape {
            b: self.b,
            t: self.t,
            c: self.w.attn,
            nh: self.w.heads,
        }
    }
}

/// Layer `l`'s forward pass: `x` to `out` (this rank's rows of the
/// residual stream), its tensors kept in `a`; `scratch` (whole rows) holds
/// a row product's sum before its reduce-scatter.
pub(super) struct F32Forward<'a> {
    pub(super) env: BlockEnv<'a>,
    pub(super) x: &'a DeviceBuffer<f32>,
    pub(super) out: &'a mut DeviceBuffer<f32>,
    pub(super) a: &'a mut LayerActs,
    pub(super) scratch: &'a mut DeviceBuffer<f32>,
}

impl BlockForward for F32Forward<'_> {
    type Error = CudaError;

    fn norm_forward(&mut self, norm: Norm, input: Act, out: Act) -> Result<()> {
        let e = &self.env;
        let (w, b) = e.r.norm(norm);
        let i = norm.index();
        let (o, t) = split(self.x, self.out, &mut self.a.t, out)?;
        e.k.layernorm_forward(
            e.s,
            o,
            &mut self.a.mean[i],
            &mut self.a.rstd[i],
            t.get(input)?,
            &e.p.view(w)?,
            &e.p.view(b)?,
            e.rows,
            e.w.c,
        )
    }

    fn column_forward(&mut self, linear: Linear, input: Act, out: Act) -> Result<()> {
        let e = &mut self.env;
        let (w, b) = e.r.linear(linear);
        let (ic, oc) = linear.widths(&e.w);
        let n = e.n();
        let (o, t) = split(self.x, self.out, &mut self.a.t, out)?;
        // Under sequence parallelism every rank's rows, gathered.
        let inp = match e.group.as_mut() {
            Some(g) if g.seq.is_some() => {
                let what = format!("{} forward: gathering rows", linear.name());
                g.gather(t.get(input)?, ic, e.s, &what)?;
                g.gathered()?
            }
            _ => t.get(input)?,
        };
        e.blas
            .gemm_rm(e.s, o, inp, false, &e.p.view(w)?, false, n, oc, ic, false)?;
        e.k.add_bias(e.s, o, &e.p.view(b)?, n, oc)
    }

    fn attention_forward(&mut self, input: Act, out: Act) -> Result<()> {
        let e = &mut self.env;
        let shape = e.shape();
        let (o, t) = split(self.x, self.out, &mut self.a.t, out)?;
        attention_forward(e.k, e.blas, e.s, o, t.get(input)?, &mut self.a.attn, shape)
    }

    fn gelu_forward(&mut self, input: Act, out: Act) -> Result<()> {
        let e = &self.env;
        let (o, t) = split(self.x, self.out, &mut self.a.t, out)?;
        e.k.gelu_forward(e.s, o, t.get(input)?)
    }

    fn row_forward(&mut self, linear: Linear, input: Act, residual: Act, out: Act) -> Result<()> {
        let e = &mut self.env;
        let (w, b) = e.r.linear(linear);
        let (ic, oc) = linear.widths(&e.w);
        let (n, rows) = (e.n(), e.rows);
        let what = match linear {
            Linear::Proj => "attn.c_proj forward",
            _ => "mlp.c_proj forward",
        };
        let (o, t) = split(self.x, self.out, &mut self.a.t, out)?;
        // Each rank's share summed (into this rank's rows under sequence
        // parallelism), then the bias once, then the residual.
        let sp = sequence(e.group);
        let into = match sp {
            true => &mut *self.scratch,
            false => &mut *o,
        };
        e.blas.gemm_rm(
            e.s,
            into,
            t.get(input)?,
            false,
            &e.p.view(w)?,
            false,
            n,
            oc,
            ic,
            false,
        )?;
        match e.group.as_ref() {
            Some(g) if sp => {
                let mine = g.scatter(self.scratch, oc, e.s, what)?;
                copy_async(o, &self.scratch.view(mine), e.s)?;
            }
            _ => GpuGpt::sum_over_group(e.group, e.shards, o, e.s, what)?,
        }
        e.k.add_bias(e.s, o, &e.p.view(b)?, rows, oc)?;
        // out += residual (in place: out = a + b with out == a).
        e.k.add_inplace(e.s, o, t.get(residual)?)
    }
}

/// Layer `l`'s backward pass: the gradient scratch `d` (the block's
/// output's gradient in [`DRESID`] on entry, its input's on return), the
/// parameters' gradients into `g`, from the tensors `a` kept and the
/// block's input `x`.
pub(super) struct F32Backward<'a, 'g> {
    pub(super) env: BlockEnv<'a>,
    pub(super) g: &'a mut DeviceWindow<'g, f32>,
    pub(super) x: &'a DeviceBuffer<f32>,
    pub(super) a: &'a mut LayerActs,
    pub(super) d: &'a mut [DeviceBuffer<f32>; 7],
}

impl BlockBackward for F32Backward<'_, '_> {
    type Error = CudaError;

    fn backward_begin(&mut self) -> Result<()> {
        let e = &mut self.env;
        if let Some(grp) = e.group.as_mut().filter(|g| g.seq.is_some()) {
            zero_async(&mut grp.seq.as_mut().ok_or_else(no_rows)?.norm_grads, e.s)?;
        }
        Ok(())
    }

    fn norm_backward(&mut self, norm: Norm, input: Act, out: Act) -> Result<()> {
        let e = &mut self.env;
        let (w, b) = e.r.norm(norm);
        let (rows, c) = (e.rows, e.w.c);
        let i = norm.index();
        let x = saved(self.a, self.x, input)?;
        let (din, dout) = grad_pair(self.d, input, out)?;
        // The column product's input gradient: each rank's share summed
        // (into this rank's rows under sequence parallelism).
        let what = match norm {
            Norm::Ln1 => "attn.c_attn backward",
            Norm::Ln2 => "mlp.c_fc backward",
        };
        let mine = GpuGpt::sum_input_grad(e.group, e.shards, dout, c, e.s, what)?;
        GpuGpt::layernorm_backward_of(
            e.k,
            e.s,
            e.group.as_mut().filter(|g| g.seq.is_some()),
            self.g,
            (din, &dout.view(mine)),
            (x, &self.a.mean[i], &self.a.rstd[i]),
            (e.p.view(w.clone())?, [w, b], 2 * i),
            rows,
            c,
        )
    }

    fn column_backward(&mut self, linear: Linear, input: Act, out: Act) -> Result<()> {
        let e = &mut self.env;
        let (w, b) = e.r.linear(linear);
        let (ic, oc) = linear.widths(&e.w);
        let n = e.n();
        let saved = saved(self.a, self.x, input)?;
        let (din, dout) = grad_pair(self.d, input, out)?;
        zero_async(din, e.s)?;
        e.blas.gemm_rm(
            e.s,
            din,
            dout,
            false,
            &e.p.view(w.clone())?,
            true,
            n,
            ic,
            oc,
            true,
        )?;
        // The input (a LayerNorm's output) of every row: under sequence
        // parallelism gathered again.
        let inp = match e.group.as_mut() {
            Some(grp) if grp.seq.is_some() => {
                let what = format!("{} backward: gathering rows", linear.name());
                grp.gather(saved, ic, e.s, &what)?;
                grp.gathered()?
            }
            _ => saved,
        };
        let dw = &mut self.g.view_mut(w)?;
        e.blas
            .gemm_rm(e.s, dw, inp, true, &*dout, false, ic, oc, n, true)?;
        e.k.bias_backward(e.s, &mut self.g.view_mut(b)?, &*dout, n, oc)
    }

    fn attention_backward(&mut self, input: Act, out: Act) -> Result<()> {
        let e = &mut self.env;
        let shape = e.shape();
        let (din, dout) = grad_pair(self.d, input, out)?;
        zero_async(din, e.s)?;
        attention_backward(e.k, e.blas, e.s, din, dout, &mut self.a.attn, shape)
    }

    fn gelu_backward(&mut self, input: Act, out: Act) -> Result<()> {
        let e = &self.env;
        let x = saved(self.a, self.x, input)?;
        let (din, dout) = grad_pair(self.d, input, out)?;
        zero_async(din, e.s)?;
        e.k.gelu_backward(e.s, din, x, dout)
    }

    fn row_backward(&mut self, linear: Linear, input: Act, residual: Act, out: Act) -> Result<()> {
        let e = &mut self.env;
        let (w, b) = e.r.linear(linear);
        let (ic, oc) = linear.widths(&e.w);
        let n = e.n();
        let sp = sequence(e.group);
        // The residual's gradient begins as the output's.
        let (dres, dout) = grad_pair(self.d, residual, out)?;
        copy_async(dres, &*dout, e.s)?;
        // Under sequence parallelism the output's gradient of every row,
        // gathered.
        if let Some(grp) = e.group.as_mut().filter(|_| sp) {
            let what = format!("{} backward: gathering rows", linear.name());
            grp.gather(dout, oc, e.s, &what)?;
        }
        let saved = saved(self.a, self.x, input)?;
        let (din, dout) = grad_pair(self.d, input, out)?;
        let dout: &DeviceBuffer<f32> = match e.group.as_ref() {
            Some(grp) if sp => grp.gathered()?,
            _ => dout,
        };
        zero_async(din, e.s)?;
        e.blas.gemm_rm(
            e.s,
            din,
            dout,
            false,
            &e.p.view(w.clone())?,
            true,
            n,
            ic,
            oc,
            true,
        )?;
        let dw = &mut self.g.view_mut(w)?;
        e.blas
            .gemm_rm(e.s, dw, saved, true, dout, false, ic, oc, n, true)?;
        e.k.bias_backward(e.s, &mut self.g.view_mut(b)?, dout, n, oc)
    }

    fn backward_end(&mut self) -> Result<()> {
        let e = &mut self.env;
        let r = e.r;
        // Under sequence parallelism both LayerNorms' gradients of this
        // rank's rows, summed over the group.
        if let Some(grp) = e.group.as_mut().filter(|g| g.seq.is_some()) {
            let into = [
                r.ln1_w.clone(),
                r.ln1_b.clone(),
                r.ln2_w.clone(),
                r.ln2_b.clone(),
            ];
            grp.add_norm_grads(
                e.k,
                self.g,
                &into,
                e.s,
                "layer backward: LayerNorm gradients",
            )?;
        }
        Ok(())
    }
}
