//! [`GpuGptMixed`]'s backward pass, unit by unit: the head, each block
//! (recomputed first under checkpointing), the embeddings, and the weight
//! gradients of the layers that defer theirs.

use super::block_backward::MixedBackward;
use super::errors::{no_weights, not_deferred};
use super::pass::Pass;
use super::products::mm;
use super::seq;
use super::state::{FusedProducts, GpuGptMixed};
use super::sums::sum_bf16;
use super::weights::layer_weights;
use crate::cpu::attention::AttnShape;
use crate::cuda::f32_params::F32Params;
use crate::cuda::held::{held, held_mut};
use crate::layout::Block;
use crate::model::Widths;
use braid_cuda::blas::{Blas, Mat};
use braid_cuda::memory::zero_async;
use braid_cuda::{CudaError, DeviceBuffer, DeviceWindow, Result, Stream};
use half::bf16;

/// `dx = dy · wᵀ` (overwritten) for `y[n,out] = x[n,inp] · w[inp,out]`:
/// in FP8 where the backward pass's products are (`lt`'s
/// [`Fp8Products`](super::fp8_products::Fp8Products)), else bf16.
#[allow(clippy::too_many_arguments)]
pub(super) fn input_grad(
    blas: &mut Blas,
    lt: &mut Option<FusedProducts>,
    s: &Stream,
    n: usize,
    inp: usize,
    out: usize,
    dy: Mat,
    w: Mat,
    dx: Mat,
) -> Result<()> {
    if let Some(f) = lt.as_mut() {
        if let Some(fp8) = f.fp8.as_mut().filter(|x| x.backward_on()) {
            if fp8.input_grad(&mut f.lt, s, (n, inp, out), dy, w, dx)? {
                return Ok(());
            }
        }
    }
    mm(blas, s, n, inp, out, dy, w.t(), dx, 0.0)
}

/// `dw = xᵀ · dy + beta · dw` for `y[n,out] = x[n,inp] · w[inp,out]`
/// (`beta` 1 adds, 0 overwrites: [`fresh`]); in FP8 as [`input_grad`].
///
/// [`fresh`]: super::fresh
#[allow(clippy::too_many_arguments)]
pub(super) fn weight_grad(
    blas: &mut Blas,
    lt: &mut Option<FusedProducts>,
    s: &Stream,
    n: usize,
    inp: usize,
    out: usize,
    x: Mat,
    dy: Mat,
    dw: Mat,
    beta: f32,
) -> Result<()> {
    if let Some(f) = lt.as_mut() {
        if let Some(fp8) = f.fp8.as_mut().filter(|x| x.backward_on()) {
            if fp8.weight_grad(&mut f.lt, s, (n, inp, out), x, dy, dw, beta)? {
                return Ok(());
            }
        }
    }
    mm(blas, s, inp, out, n, x.t(), dy, dw, beta)
}

/// A layer's four weight-gradient products.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightGrads {
    /// The MLP's output projection.
    FcProj,
    /// The MLP's input projection.
    Fc,
    /// The attention's output projection.
    Proj,
    /// The attention's input projection (q, k, v).
    Qkv,
}

impl WeightGrads {
    /// All four, in the order the backward pass meets them.
    pub const ALL: &'static [WeightGrads] = &[
        WeightGrads::FcProj,
        WeightGrads::Fc,
        WeightGrads::Proj,
        WeightGrads::Qkv,
    ];
}

impl GpuGptMixed {
    /// Accumulates the gradient of the last `forward(.., grad = true)` into
    /// `g` (f32, flat, same layout as the parameters) and waits for it:
    /// [`backward_head`](Self::backward_head), every
    /// [`backward_layer`](Self::backward_layer) from the last down,
    /// [`backward_embedding`](Self::backward_embedding), then the deferred
    /// layers' [`backward_layer_weights`](Self::backward_layer_weights).
    pub fn backward<'p>(
        &mut self,
        p: impl Into<F32Params<'p>>,
        pb: Option<&DeviceBuffer<bf16>>,
        g: &mut DeviceBuffer<f32>,
    ) -> Result<()> {
        let p = p.into();
        if g.len() != self.layout.len {
            return Err(CudaError::Invalid(format!(
                "gradient buffer of {} elements for a model of {}",
                g.len(),
                self.layout.len
            )));
        }
        let mut w = g.window();
        self.backward_head(p, pb, &mut w)?;
        for l in (0..self.layout.config.n_layer).rev() {
            self.backward_layer(l, p, pb, &mut w)?;
        }
        self.backward_embedding(&mut w)?;
        for l in (0..self.deferred.len()).rev() {
            if self.defers(l) {
                self.backward_layer_weights(l, &mut w)?;
            }
        }
        self.stream.synchronize()?;
        self.end_step()
    }

    /// Backward of the head (first, after `forward(.., grad = true)`):
    /// the classifier's share of the token embedding's gradient, the final
    /// LayerNorm's gradients (final after this), the last layer's fcproj
    /// bias gradient, and the gradient of the last residual stream. Queued
    /// on the model's stream; nothing waits. `g` holds the gradient buffer's
    /// elements that are still being written (buffer indices).
    pub fn backward_head<'p>(
        &mut self,
        p: impl Into<F32Params<'p>>,
        pb: Option<&DeviceBuffer<bf16>>,
        g: &mut DeviceWindow<'_, f32>,
    ) -> Result<()> {
        let p = p.into();
        self.check_params(p, pb)?;
        let cfg = self.layout.config;
        let (c, v) = (cfg.n_embd, self.widths.vocab);
        let (b, t, vp) = (self.b, self.t, self.vp);
        let n = b * t;
        let wte = self.range("wte.weight");
        let (lw, lb) = (self.range("ln_f.weight"), self.range("ln_f.bias"));
        if self.backward_sms > 0 {
            self.blas.set_sm_count_target(self.backward_sms)?;
        }
        self.fresh.backward_starts();
        let beta = self.fresh.beta();
        let (s, k, mk) = (&self.stream, &self.kernels, &self.mk);
        let blas = &mut self.blas;
        let prof = &mut self.prof;
        prof.mark(s, "start")?;
        // Head (over the padded vocabulary, whose logit gradients are
        // zero): dlnf = dlogits · wte ; dwte += dlogitsᵀ · lnf.
        mm(
            blas,
            s,
            n,
            c,
            vp,
            Mat::of(&self.logits, vp),
            match &self.pad {
                Some((wte_pad, _)) => Mat::of(wte_pad, c),
                None => match (pb, &self.streamed) {
                    (Some(pb), _) => Mat::of(&pb.view(wte.clone()), c),
                    // Cast by the forward pass.
                    (None, Some(st)) => Mat::of(&st.wte, c),
                    (None, None) => return Err(no_weights()),
                },
            },
            Mat::of(&self.dln, c),
            0.0,
        )?;
        prof.mark(s, "bwd gemm classifier")?;
        // dwte: into the padded scratch (then added to the gradient), or
        // accumulated by the product into the gradient buffer itself.
        let mut gwte = g.view_mut(wte)?;
        let (dst, beta) = match &self.pad {
            Some((_, dwte_pad)) => (Mat::of(dwte_pad, c), 0.0),
            None => (Mat::of(&gwte, c), beta),
        };
        mm(
            blas,
            s,
            vp,
            c,
            n,
            Mat::of(&self.logits, vp).t(),
            Mat::of(&self.lnf, c),
            dst,
            beta,
        )?;
        if let Some((_, dwte_pad)) = &self.pad {
            k.add_inplace(s, &mut gwte, &dwte_pad.view(0..v * c))?;
        }
        prof.mark(s, "bwd gemm classifier")?;
        // Each rank's share of the vocabulary's gradient, summed (onto
        // each rank's rows under sequence parallelism).
        match (&self.group, &self.seq) {
            (Some(grp), Some(_)) => seq::scatter(grp, &mut self.dln, n * c, s, "head backward")?,
            _ => sum_bf16(&self.group, &mut self.dln, s, "head backward")?,
        }
        zero_async(&mut self.dresid, s)?;
        prof.mark(s, "bwd zero")?;
        // The column sums of the LayerNorm's dres are the last layer's
        // fcproj bias gradient. Under sequence parallelism the three
        // vectors from this rank's rows go to the scratch, summed below.
        let top = held(&self.ranges, cfg.n_layer - 1)?.fcproj_b.clone();
        let into = [lw.clone(), lb.clone(), top];
        let (nl, mine) = seq::local(&self.seq, n, c);
        {
            let [mut gw, mut gb, mut gnext] = match &mut self.seq {
                Some(q) => {
                    zero_async(&mut q.norm_grads, s)?;
                    q.norm_grads.views_mut_n([0..c, c..2 * c, 2 * c..3 * c])
                }
                None => g.views_mut_n(into.clone())?,
            };
            mk.layernorm_backward(
                s,
                &mut self.dresid.view_mut(mine.clone()),
                &mut self.dresid_bf.view_mut(mine.clone()),
                None,
                &mut gw,
                &mut gb,
                Some(&mut gnext),
                &mut self.partial,
                &self.dln.view(mine),
                held(&self.resid, cfg.n_layer)?,
                &p.view(lw)?,
                &p.view(lb.clone())?,
                &self.lnf_mean,
                &self.lnf_rstd,
                nl,
                c,
            )?;
        }
        if let Some(q) = &mut self.seq {
            seq::add_norm_grads(&self.group, q, k, g, &into, c, s, "ln_f backward")?;
        }
        seq::gather(
            &self.group,
            &self.seq,
            &mut self.dresid_bf,
            n * c,
            s,
            "head backward gather",
        )?;
        prof.mark(s, "bwd layernorm")
    }

    /// Whether the backward pass recomputes each block's activations
    /// (activation checkpointing).
    pub fn recomputes(&self) -> bool {
        self.work.is_some()
    }

    /// Under checkpointing, the first part of block `l`'s backward pass
    /// on its own: the recomputation of its activations, which writes no
    /// gradient (so that a strategy can still be reading the gradient
    /// memory meanwhile). [`backward_layer`](Self::backward_layer) of the
    /// same block, called next, goes on from there. `false`, with nothing
    /// run, without checkpointing. Queued; nothing waits.
    pub fn recompute_layer<'p>(
        &mut self,
        l: usize,
        p: impl Into<F32Params<'p>>,
        pb: Option<&DeviceBuffer<bf16>>,
    ) -> Result<bool> {
        let p = p.into();
        self.check_params(p, pb)?;
        if self.work.is_none() {
            return Ok(false);
        }
        self.forward_layer(l, p, pb, Pass::Recompute)?;
        self.recomputed = Some(l);
        Ok(true)
    }

    /// Backward of transformer block `l` (after the blocks above it): its
    /// gradients are final after this; it also writes the fcproj bias
    /// gradient of block `l - 1`. Queued; nothing waits.
    pub fn backward_layer<'p>(
        &mut self,
        l: usize,
        p: impl Into<F32Params<'p>>,
        pb: Option<&DeviceBuffer<bf16>>,
        g: &mut DeviceWindow<'_, f32>,
    ) -> Result<()> {
        let p = p.into();
        self.check_params(p, pb)?;
        let recomputed = self.recomputed.take() == Some(l);
        if self.work.is_some() && !recomputed {
            self.forward_layer(l, p, pb, Pass::Recompute)?;
        }
        let Widths {
            heads: nh,
            attn: ca,
            ..
        } = self.widths;
        let (b, t) = (self.b, self.t);
        let shape = AttnShape { b, t, c: ca, nh };
        let sp = self.seq.is_some();
        let (s, mk) = (&self.stream, &self.mk);
        let block = self.layout.block_range(Block::Layer(l));
        let (wb, base) = layer_weights(mk, s, &self.pool, &mut self.streamed, pb, p, l, block)?;
        let defer = self.deferred.get(l).is_some_and(Option::is_some);
        // A column product's input gradient summed beside its weight
        // gradient where asked.
        let beside = self.group.is_some()
            && self.grad_sums_beside
            && !defer
            && self.tensor_blocks <= 1
            && !sp;
        // The layer below's fcproj bias gradient comes with this one's
        // ln_1. (Not below a pipeline stage's lowest layer: another
        // stage's.)
        let below = if l > self.bottom {
            held(&self.ranges, l - 1)?.fcproj_b.clone()
        } else {
            0..0
        };
        // (Only the first layers may defer theirs: the list may be short.)
        let deferred = self.deferred.get_mut(l).and_then(Option::as_mut);
        crate::block::backward(&mut MixedBackward {
            s,
            mk,
            kernels: &self.kernels,
            blas: &mut self.blas,
            lt: &mut self.lt,
            prof: &mut self.prof,
            group: &self.group,
            seq: &mut self.seq,
            tensor_blocks: self.tensor_blocks,
            fresh: &self.fresh,
            p,
            wb,
            base,
            r: held(&self.ranges, l)?,
            g,
            below,
            x: held(&self.resid, l)?,
            saved: held_mut(&mut self.layers, l)?,
            work: &mut self.work,
            deferred,
            ln: &mut self.ln,
            wide: &mut self.wide,
            dresid: &mut self.dresid,
            dresid_bf: &mut self.dresid_bf,
            dln: &mut self.dln,
            partial: &mut self.partial,
            shared: &mut self.attn,
            score_grads_in_block: self.score_grads_in_block,
            beside,
            shape,
            w: self.widths,
        })
    }

    /// The deferred weight gradients of layer `l` (one of the first
    /// [`deferred_layers`](Self::deferred_layers), after its
    /// [`backward_layer`](Self::backward_layer)); the layer's gradients
    /// are final after this. Queued; nothing waits.
    pub fn backward_layer_weights(
        &mut self,
        l: usize,
        g: &mut DeviceWindow<'_, f32>,
    ) -> Result<()> {
        self.backward_layer_weights_of(l, WeightGrads::ALL, g)
    }

    /// Some of the deferred weight gradients of layer `l` (`which`, in
    /// order); the layer's gradients are final once all four have run.
    pub fn backward_layer_weights_of(
        &mut self,
        l: usize,
        which: &[WeightGrads],
        g: &mut DeviceWindow<'_, f32>,
    ) -> Result<()> {
        let Some(d) = self.deferred.get(l).and_then(Option::as_ref) else {
            return Err(not_deferred(l));
        };
        let Widths {
            c,
            attn: ca,
            mlp: f,
            ..
        } = self.widths;
        let n = self.b * self.t;
        let (s, blas, lt) = (&self.stream, &mut self.blas, &mut self.lt);
        let (r, a) = (held(&self.ranges, l)?, held(&self.layers, l)?);
        for w in which {
            let (x, dy, range, inp, out) = match w {
                WeightGrads::FcProj => (&d.gelu, &d.fcproj, r.fcproj_w.clone(), f, c),
                WeightGrads::Fc => (&d.ln2, &d.fc, r.fc_w.clone(), c, f),
                WeightGrads::Proj => (
                    a.atty.as_ref().ok_or_else(|| not_deferred(l))?,
                    &d.proj,
                    r.proj_w.clone(),
                    ca,
                    c,
                ),
                WeightGrads::Qkv => (&d.ln1, &d.qkv, r.qkv_w.clone(), c, 3 * ca),
            };
            let dw = g.view_mut(range)?;
            weight_grad(
                blas,
                lt,
                s,
                n,
                inp,
                out,
                Mat::of(x, inp),
                Mat::of(dy, out),
                Mat::of(&dw, out),
                self.fresh.beta(),
            )?;
        }
        self.prof.mark(s, "bwd gemm deferred weights")
    }

    /// Backward of the embeddings (last): token and position embedding
    /// gradients, final after this. Queued; nothing waits.
    pub fn backward_embedding(&mut self, g: &mut DeviceWindow<'_, f32>) -> Result<()> {
        let cfg = self.layout.config;
        let (c, t) = (cfg.n_embd, self.t);
        let (wte, wpe) = (self.range("wte.weight"), self.range("wpe.weight"));
        // Every row's gradient (gathered under sequence parallelism).
        let n = self.b * self.t;
        seq::gather_f32(
            &self.group,
            &self.seq,
            &mut self.dresid,
            n * c,
            &self.stream,
            "embedding backward gather",
        )?;
        let [mut gte, mut gpe] = g.views_mut_n([wte, wpe])?;
        match &self.group {
            None => self.batch.embedding_backward(
                &self.kernels,
                &self.stream,
                &mut gte,
                &mut gpe,
                &self.dresid,
                t,
                c,
            )?,
            // Every rank's position embedding whole, its vocabulary rows'.
            Some(_) => {
                let rows = self.vocab_rows();
                self.batch.embedding_backward_rows(
                    &self.kernels,
                    &self.stream,
                    &mut gte,
                    &mut gpe,
                    &self.dresid,
                    t,
                    c,
                    rows,
                )?
            }
        }
        self.prof.mark(&self.stream, "bwd encoder")
    }
}
