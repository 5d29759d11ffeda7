//! One transformer block's backward pass of the bf16 [`GpuGptMixed`]:
//! the operations of [`crate::block`]'s description as this backend runs
//! them ([`MixedBackward`]), the sequence walked by
//! [`crate::block::backward`].
//!
//! Its fusions follow the description. The GELU's backward pass also
//! sums the bias gradient of the product before it (the MLP's first) and
//! rebuilds the GELU over the pre-activation; a LayerNorm's backward pass
//! sums the bias gradient of the row product whose output its input is
//! (the attention's projection, or the MLP's projection of the layer
//! below) and rebuilds the LayerNorm's output. So a product's weight
//! gradient runs once its input is there again: right after its input
//! gradient where the input is kept (the attention's output), at the end
//! of the backward pass of the operation that rebuilds it otherwise (the
//! GELU, a LayerNorm). Under deferred weight gradients (a pipeline's
//! split backward) each product's output gradient and rebuilt input are
//! kept for later instead.
//!
//! [`GpuGptMixed`]: super::state::GpuGptMixed

use super::backward::{input_grad, weight_grad};
use super::errors::no_acts;
use super::fresh;
use super::row_sum;
use super::seq;
use super::state::{BlockActs, DeferredDy, FusedProducts, Group, LayerSaved};
use super::wide::Wide;
use crate::block::LayerRanges;
use crate::block::{Act, BlockBackward, Linear, Norm};
use crate::cpu::attention::AttnShape;
use crate::cuda::f32_params::F32Params;
use crate::cuda::flash::ScoreGrads;
use crate::cuda::kernels::Kernels;
use crate::cuda::mixed::MixedKernels;
use crate::cuda::mixed_attention::{self as attention, AttnShared};
use crate::cuda::profile::PhaseTimer;
use crate::model::Widths;
use braid_cuda::blas::{Blas, Mat};
use braid_cuda::memory::zero_async;
use braid_cuda::DeviceView;
use braid_cuda::{CudaError, DeviceBuffer, DeviceMem, DeviceWindow, Result, Stream};
use half::bf16;
use std::ops::Range;

/// Block `l`'s backward pass: the pieces of the model it reads and
/// writes, borrowed for the pass.
pub(super) struct MixedBackward<'a, 'g> {
    pub(super) s: &'a Stream,
    pub(super) mk: &'a MixedKernels,
    pub(super) kernels: &'a Kernels,
    pub(super) blas: &'a mut Blas,
    /// cuBLASLt, with the FP8 products where they are on.
    pub(super) lt: &'a mut Option<FusedProducts>,
    pub(super) prof: &'a mut PhaseTimer,
    pub(super) group: &'a Option<Group>,
    pub(super) seq: &'a mut Option<seq::SeqRows>,
    pub(super) tensor_blocks: usize,
    pub(super) fresh: &'a fresh::FreshGrads,
    pub(super) p: F32Params<'a>,
    pub(super) wb: &'a DeviceBuffer<bf16>,
    pub(super) base: usize,
    pub(super) r: &'a LayerRanges,
    /// The parameters' gradients.
    pub(super) g: &'a mut DeviceWindow<'g, f32>,
    /// The layer below's fcproj bias (empty at a stage's bottom layer).
    pub(super) below: Range<usize>,
    /// The block's input: this rank's rows of the residual stream.
    pub(super) x: &'a DeviceBuffer<f32>,
    pub(super) saved: &'a mut LayerSaved,
    pub(super) work: &'a mut Option<BlockActs>,
    /// Where the layer defers its weight gradients: their inputs and
    /// output gradients, kept for later.
    pub(super) deferred: Option<&'a mut DeferredDy>,
    pub(super) ln: &'a mut DeviceBuffer<bf16>,
    pub(super) wide: &'a mut DeviceBuffer<bf16>,
    pub(super) dresid: &'a mut DeviceBuffer<f32>,
    pub(super) dresid_bf: &'a mut DeviceBuffer<bf16>,
    pub(super) dln: &'a mut DeviceBuffer<bf16>,
    pub(super) partial: &'a mut DeviceBuffer<f32>,
    pub(super) shared: &'a mut AttnShared,
    /// The score gradients go into the block's `resid2` and `fch`.
    pub(super) score_grads_in_block: bool,
    /// The column products' input gradients are summed over the group
    /// beside their weight gradients (the LayerNorm's output rebuilt
    /// first, in the column product's backward pass).
    pub(super) beside: bool,
    pub(super) shape: AttnShape,
    pub(super) w: Widths,
}

fn unexpected(a: Act) -> CudaError {
    CudaError::Invalid(format!(
        "the bf16 block's backward pass meets {a:?} where its operation has no buffer for it"
    ))
}

impl<'a> MixedBackward<'a, '_> {
    fn n(&self) -> usize {
        self.shape.b * self.shape.t
    }

    /// A product's bf16 weight (of the layer's bf16 copy).
    fn weight(&self, linear: Linear) -> DeviceView<'a, bf16> {
        let (w, _) = self.r.linear(linear);
        let wb: &'a DeviceBuffer<bf16> = self.wb;
        wb.view(w.start - self.base..w.end - self.base)
    }

    fn defers(&self) -> bool {
        self.deferred.is_some()
    }

    /// The group, when the column products' input gradients are summed
    /// beside their weight gradients.
    fn beside(&self) -> Option<&'a Group> {
        let group: &'a Option<Group> = self.group;
        group.as_ref().filter(|_| self.beside)
    }

    /// Where the attention's input gradient `dqkv` goes: beside its output
    /// gradient in the wide scratch, or into the deferred layer's buffer.
    fn dqkv_mat(&self) -> Mat {
        let (n, ca) = (self.n(), self.w.attn);
        match self.deferred.as_deref() {
            Some(d) => Mat::of(&d.qkv.view(Wide::qkv(n, ca)), 3 * ca),
            None => Mat::of(&self.wide.view(Wide::qkv(n, ca)), 3 * ca),
        }
    }

    /// A LayerNorm's output rebuilt into `ln` from its input and kept
    /// statistics, in the forward pass's arithmetic (every row: the
    /// products' input gradients are not summed beside under sequence
    /// parallelism).
    fn rebuild_norm(&mut self, norm: Norm) -> Result<()> {
        let (n, c) = (self.n(), self.w.c);
        let (w, b) = self.r.norm(norm);
        let x: &DeviceBuffer<f32> = match norm {
            Norm::Ln1 => self.x,
            Norm::Ln2 => {
                let own = self.saved.acts.as_ref().or(self.work.as_ref());
                &own.ok_or_else(no_acts)?.resid2
            }
        };
        let (mean, rstd) = match norm {
            Norm::Ln1 => (&mut self.saved.ln1_mean, &mut self.saved.ln1_rstd),
            Norm::Ln2 => (&mut self.saved.ln2_mean, &mut self.saved.ln2_rstd),
        };
        self.mk.layernorm_forward(
            self.s,
            self.ln,
            mean,
            rstd,
            x,
            &self.p.view(w)?,
            &self.p.view(b)?,
            n,
            c,
        )?;
        self.prof.mark(self.s, "bwd layernorm")
    }

    /// A product's weight gradient from its (rebuilt) input and its
    /// output's gradient — or, deferred, both kept for later.
    fn weight_grads(&mut self, linear: Linear) -> Result<()> {
        let (n, w) = (self.n(), self.w);
        let (inp, out) = linear.widths(&w);
        let (range, _) = self.r.linear(linear);
        let beta = self.fresh.beta();
        let (x, dy, phase) = match linear {
            Linear::FcProj => {
                if let Some(d) = self.deferred.as_deref_mut() {
                    std::mem::swap(self.dresid_bf, &mut d.fcproj);
                    return Ok(());
                }
                // The GELU, rebuilt over fch.
                let own = self.saved.acts.as_ref().or(self.work.as_ref());
                let fch = Mat::of(&own.ok_or_else(no_acts)?.fch, inp);
                (fch, Mat::of(&*self.dresid_bf, out), "bwd gemm fcproj")
            }
            Linear::Fc => {
                if let Some(d) = self.deferred.as_deref_mut() {
                    std::mem::swap(self.wide, &mut d.fc);
                    return Ok(());
                }
                let (x, dy) = (Mat::of(&*self.ln, inp), Mat::of(&*self.wide, out));
                (x, dy, "bwd gemm fc")
            }
            Linear::Proj => {
                if let Some(d) = self.deferred.as_deref_mut() {
                    std::mem::swap(self.dresid_bf, &mut d.proj);
                    return Ok(());
                }
                let shared = self.saved.acts.as_ref().or(self.work.as_ref());
                let atty = self
                    .saved
                    .atty
                    .as_ref()
                    .or(shared.and_then(|a| a.atty.as_ref()))
                    .ok_or_else(no_acts)?;
                (Mat::of(atty, inp), Mat::of(&*self.dresid_bf, out), "")
            }
            Linear::Qkv => {
                if self.defers() {
                    return Ok(());
                }
                (Mat::of(&*self.ln, inp), self.dqkv_mat(), "bwd gemm qkv")
            }
        };
        let dw = Mat::of(&self.g.view_mut(range)?, out);
        weight_grad(self.blas, self.lt, self.s, n, inp, out, x, dy, dw, beta)?;
        match phase.is_empty() {
            true => Ok(()),
            false => self.prof.mark(self.s, phase),
        }
    }
}

impl BlockBackward for MixedBackward<'_, '_> {
    type Error = CudaError;

    fn backward_begin(&mut self) -> Result<()> {
        Ok(())
    }

    fn row_backward(
        &mut self,
        linear: Linear,
        _input: Act,
        _residual: Act,
        out: Act,
    ) -> Result<()> {
        // The residual's gradient is the output's already: both are the
        // residual stream's gradient (`dresid`, its bf16 copy
        // `dresid_bf`), which the LayerNorm backward passes add to. The
        // bias gradient came with the LayerNorm backward pass above
        // (this layer's ln_2, or the layer above's ln_1, or the head's).
        let (n, w) = (self.n(), self.w);
        let (inp, oc) = linear.widths(&w);
        let wt = self.weight(linear);
        let (dx, phase) = match out {
            // The GELU's gradient, in the wide scratch.
            Act::Out => (Mat::of(&*self.wide, inp), "bwd gemm fcproj"),
            // The attention output's gradient (the last `n × width` of it).
            Act::Resid2 => (
                Mat::of(&self.wide.view(Wide::datty(n, w.attn)), inp),
                "bwd gemm proj",
            ),
            o => return Err(unexpected(o)),
        };
        input_grad(
            self.blas,
            self.lt,
            self.s,
            n,
            inp,
            oc,
            Mat::of(&*self.dresid_bf, oc),
            Mat::of(&wt, oc),
            dx,
        )?;
        match linear {
            // (cuBLASLt's GELU-backward epilogue with the bias gradient
            // measured 2.4× slower than this product plus the two passes
            // on an H200, so the backward keeps them separate.) The weight
            // gradient waits for the GELU rebuilt over fch.
            Linear::FcProj => self.prof.mark(self.s, phase),
            _ => {
                self.weight_grads(linear)?;
                self.prof.mark(self.s, phase)
            }
        }
    }

    fn gelu_backward(&mut self, _input: Act, _out: Act) -> Result<()> {
        // The GELU backward with the fc bias gradient; it rebuilds
        // gelu(fch) for the weight gradient, over fch itself (read there
        // for the last time), or into the deferred layer's buffer.
        let n = self.n();
        let f = self.w.mlp;
        let (_, fc_b) = self.r.linear(Linear::Fc);
        let mut dbias = self.g.view_mut(fc_b)?;
        let own = self.saved.acts.as_mut().or(self.work.as_mut());
        let fch = &mut own.ok_or_else(no_acts)?.fch;
        match self.deferred.as_deref_mut() {
            Some(d) => self.mk.gelu_backward_bias(
                self.s,
                self.wide,
                &*fch,
                &mut dbias,
                self.partial,
                Some(&mut d.gelu),
                n,
                f,
            )?,
            None => self.mk.gelu_backward_bias_over_pre(
                self.s,
                self.wide,
                fch,
                &mut dbias,
                self.partial,
                n,
                f,
            )?,
        }
        self.prof.mark(self.s, "bwd gelu+bias")?;
        // The MLP's projection reads the GELU: its weight gradient now.
        self.weight_grads(Linear::FcProj)
    }

    fn column_backward(&mut self, linear: Linear, _input: Act, _out: Act) -> Result<()> {
        // The input gradient (into `dln`), summed over the group — beside
        // the weight gradient where asked (the LayerNorm's output rebuilt
        // first); the qkv bias gradient (the MLP's came with the GELU's).
        let (n, w) = (self.n(), self.w);
        let (c, oc) = linear.widths(&w);
        let wt = Mat::of(&self.weight(linear), oc);
        let (dy, what, phase) = match linear {
            Linear::Fc => (Mat::of(&*self.wide, oc), "mlp.c_fc backward", "bwd gemm fc"),
            Linear::Qkv => (self.dqkv_mat(), "attn.c_attn backward", "bwd gemm qkv"),
            k => return Err(unexpected_linear(k)),
        };
        let sp = self.seq.is_some();
        match self.beside() {
            Some(group) => {
                row_sum::start_input_grad_sum(
                    self.blas,
                    self.s,
                    group,
                    (n, c, oc),
                    dy,
                    wt,
                    self.dln,
                    what,
                )?;
            }
            // One process's product (FP8 where the backward pass's are).
            None if self.group.is_none() => {
                let dx = Mat::of(&*self.dln, c);
                input_grad(self.blas, self.lt, self.s, n, c, oc, dy, wt, dx)?;
            }
            None => row_sum::input_grad_sum(
                self.blas,
                self.s,
                (self.group, sp),
                self.tensor_blocks,
                (n, c, oc),
                dy,
                wt,
                self.dln,
                what,
            )?,
        }
        self.prof.mark(self.s, phase)?;
        if linear == Linear::Qkv {
            let (_, b) = self.r.linear(linear);
            let dqkv = match self.deferred.as_deref() {
                Some(d) => d.qkv.view(Wide::qkv(n, w.attn)),
                None => self.wide.view(Wide::qkv(n, w.attn)),
            };
            self.mk.bias_backward_bf(
                self.s,
                &mut self.g.view_mut(b)?,
                self.partial,
                &dqkv,
                n,
                oc,
            )?;
            self.prof.mark(self.s, "bwd bias")?;
        }
        if let Some(group) = self.beside() {
            let norm = match linear {
                Linear::Fc => Norm::Ln2,
                _ => Norm::Ln1,
            };
            self.rebuild_norm(norm)?;
            self.weight_grads(linear)?;
            row_sum::wait_for_sums(group, self.s, what)?;
        }
        Ok(())
    }

    fn norm_backward(&mut self, norm: Norm, _input: Act, _out: Act) -> Result<()> {
        let (n, c) = (self.n(), self.w.c);
        let (nl, mine) = seq::local(self.seq, n, c);
        let (w, b) = self.r.norm(norm);
        // The bias gradient of the row product whose output is this
        // LayerNorm's input comes with it: the attention's projection for
        // ln_2, the layer below's MLP projection for ln_1 (none at a
        // stage's bottom layer).
        let (next, slots) = match norm {
            Norm::Ln2 => (
                self.r.linear(Linear::Proj).1,
                [0..c, c..2 * c, 2 * c..3 * c],
            ),
            Norm::Ln1 => (
                self.below.clone(),
                [3 * c..4 * c, 4 * c..5 * c, 5 * c..6 * c],
            ),
        };
        let has_next = norm == Norm::Ln2 || !self.below.is_empty();
        // Where the LayerNorm's output is rebuilt: the deferred layer's
        // buffer, or the `ln` scratch (not again where the column product
        // rebuilt it beside its sum).
        let rebuilt = self.beside;
        let x: &DeviceBuffer<f32> = match norm {
            Norm::Ln1 => self.x,
            Norm::Ln2 => {
                let own = self.saved.acts.as_ref().or(self.work.as_ref());
                &own.ok_or_else(no_acts)?.resid2
            }
        };
        let (mean, rstd) = match norm {
            Norm::Ln1 => (&self.saved.ln1_mean, &self.saved.ln1_rstd),
            Norm::Ln2 => (&self.saved.ln2_mean, &self.saved.ln2_rstd),
        };
        let ln: &mut DeviceBuffer<bf16> = match self.deferred.as_deref_mut() {
            Some(d) => match norm {
                Norm::Ln1 => &mut d.ln1,
                Norm::Ln2 => &mut d.ln2,
            },
            None => self.ln,
        };
        {
            // Into the scratch under sequence parallelism (ln_2's zeroes
            // it first), summed after ln_1's.
            let [mut gw, mut gb, mut gnext] = match self.seq.as_mut() {
                Some(q) => {
                    if norm == Norm::Ln2 {
                        zero_async(&mut q.norm_grads, self.s)?;
                    }
                    q.norm_grads.views_mut_n(slots)
                }
                None => self.g.views_mut_n([w.clone(), b.clone(), next.clone()])?,
            };
            let mut ln_rows = ln.view_mut(mine.clone());
            self.mk.layernorm_backward(
                self.s,
                &mut self.dresid.view_mut(mine.clone()),
                &mut self.dresid_bf.view_mut(mine.clone()),
                (!rebuilt).then_some(&mut ln_rows as &mut dyn DeviceMem<bf16>),
                &mut gw,
                &mut gb,
                has_next.then_some(&mut gnext),
                self.partial,
                &self.dln.view(mine.clone()),
                x,
                &self.p.view(w)?,
                &self.p.view(b)?,
                mean,
                rstd,
                nl,
                c,
            )?;
        }
        if norm == Norm::Ln1 {
            if let Some(q) = self.seq.as_mut() {
                // Both LayerNorms' gradients from this rank's rows, summed.
                let r = self.r;
                let into = [
                    r.ln2_w.clone(),
                    r.ln2_b.clone(),
                    r.proj_b.clone(),
                    r.ln1_w.clone(),
                    r.ln1_b.clone(),
                    self.below.clone(),
                ];
                seq::add_norm_grads(
                    self.group,
                    q,
                    self.kernels,
                    self.g,
                    &into,
                    c,
                    self.s,
                    "layernorm backward",
                )?;
            }
        }
        // Every row's LayerNorm output (the weight gradient's input) and
        // output gradient (the next products').
        let what = match norm {
            Norm::Ln1 => "ln_1 backward gather",
            Norm::Ln2 => "ln_2 backward gather",
        };
        if self.seq.is_some() || norm == Norm::Ln2 {
            let ln = (!rebuilt).then_some(ln);
            seq::gather_after_norm(
                self.group,
                self.seq,
                ln,
                (self.dresid_bf, n * c),
                self.s,
                what,
            )?;
        }
        self.prof.mark(self.s, "bwd layernorm")?;
        // The column product reading this LayerNorm's output: its weight
        // gradient now (not again where it ran beside the sum).
        let linear = match norm {
            Norm::Ln1 => Linear::Qkv,
            Norm::Ln2 => Linear::Fc,
        };
        match rebuilt {
            true => Ok(()),
            false => self.weight_grads(linear),
        }
    }

    fn attention_backward(&mut self, _input: Act, _out: Act) -> Result<()> {
        let (n, ca, shape) = (self.n(), self.w.attn, self.shape);
        let deferred_qkv = self.deferred.as_deref_mut().map(|d| &mut d.qkv);
        let [wide_qkv, datty] = self
            .wide
            .views_mut_n([Wide::qkv(n, ca), Wide::datty(n, ca)]);
        let mut dqkv = match deferred_qkv {
            Some(q) => q.view_mut(Wide::qkv(n, ca)),
            None => wide_qkv,
        };
        let LayerSaved {
            atty,
            attn: kept_attn,
            acts: own_acts,
            ..
        } = &mut *self.saved;
        let BlockActs {
            attn: block_attn,
            resid2,
            fch,
            atty: shared_atty,
        } = own_acts
            .as_mut()
            .or(self.work.as_mut())
            .ok_or_else(no_acts)?;
        let atty = atty.as_ref().or(shared_atty.as_ref()).ok_or_else(no_acts)?;
        // The score gradients, where the model stores them in the block's
        // resid2 and fch: both were read for the last time above.
        let idle = self.score_grads_in_block.then(|| ScoreGrads {
            first: fch.bytes_as_mut(),
            rest: resid2.bytes_as_mut(),
        });
        attention::backward(
            self.mk,
            self.blas,
            self.s,
            &mut dqkv,
            &datty,
            atty,
            kept_attn
                .as_ref()
                .or(block_attn.as_ref())
                .ok_or_else(no_acts)?,
            self.shared,
            idle,
            shape,
            self.prof,
        )?;
        self.prof.mark(self.s, "bwd attention")
    }

    fn backward_end(&mut self) -> Result<()> {
        Ok(())
    }
}

fn unexpected_linear(k: Linear) -> CudaError {
    CudaError::Invalid(format!(
        "the bf16 block's backward pass meets {k:?} where a column product belongs"
    ))
}
