//! [`GpuGptMixed`]'s backward pass, unit by unit: the head, each block
//! (recomputed first under checkpointing), the embeddings, and the weight
//! gradients of the layers that defer theirs.

use super::*;

/// `dx = dy · wᵀ` (overwritten) for `y[n,out] = x[n,inp] · w[inp,out]`.
#[allow(clippy::too_many_arguments)]
fn input_grad(
    blas: &mut Blas,
    s: &Stream,
    n: usize,
    inp: usize,
    out: usize,
    dy: Mat,
    w: Mat,
    dx: Mat,
) -> Result<()> {
    mm(blas, s, n, inp, out, dy, w.t(), dx, 0.0)
}

/// `dw = xᵀ · dy + beta · dw` for `y[n,out] = x[n,inp] · w[inp,out]`
/// (`beta` 1 adds, 0 overwrites: [`fresh`]).
#[allow(clippy::too_many_arguments)]
fn weight_grad(
    blas: &mut Blas,
    s: &Stream,
    n: usize,
    inp: usize,
    out: usize,
    x: Mat,
    dy: Mat,
    dw: Mat,
    beta: f32,
) -> Result<()> {
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
            c,
            heads: nh,
            attn: ca,
            mlp: f,
            ..
        } = self.widths;
        let (b, t) = (self.b, self.t);
        let n = b * t;
        let shape = AttnShape { b, t, c: ca, nh };
        // The rows of the residual stream and the LayerNorms (this rank's
        // under sequence parallelism), and their elements.
        let (nl, mine) = seq::local(&self.seq, n, c);
        let sp = self.seq.is_some();
        let (s, mk) = (&self.stream, &self.mk);
        let block = self.layout.block_range(Block::Layer(l));
        let (wb, base) = layer_weights(mk, s, &self.pool, &mut self.streamed, pb, p, l, block)?;
        let w = |r: &Range<usize>| wb.view(r.start - base..r.end - base);
        let blas = &mut self.blas;
        let prof = &mut self.prof;
        let r = held(&self.ranges, l)?;
        let defer = self.deferred.get(l).is_some_and(Option::is_some);
        // MLP: out = resid2 + gelu(fch) · Wfcproj + b.
        // (cuBLASLt's GELU-backward epilogue with the bias gradient
        // measured 2.4× slower than this product plus the two passes
        // on an H200, so the backward keeps them separate.)
        // The input gradient first (dgelu, in the wide scratch); the GELU
        // backward then recomputes gelu(fch) for the weight gradient, over
        // fch itself (read there for the last time), or into the deferred
        // layer's buffer when its weight gradients come later.
        input_grad(
            blas,
            s,
            n,
            f,
            c,
            Mat::of(&self.dresid_bf, c),
            Mat::of(&w(&r.fcproj_w), c),
            Mat::of(&self.wide, f),
        )?;
        prof.mark(s, "bwd gemm fcproj")?;
        // (fcproj's bias gradient came with the LayerNorm backward above.)
        let block = held_mut(&mut self.layers, l)?
            .acts
            .as_mut()
            .or(self.work.as_mut());
        let fch = &mut block.ok_or_else(no_acts)?.fch;
        let mut dbias = g.view_mut(r.fc_b.clone())?;
        match self.deferred.get_mut(l).and_then(Option::as_mut) {
            Some(d) => mk.gelu_backward_bias(
                s,
                &mut self.wide,
                &*fch,
                &mut dbias,
                &mut self.partial,
                Some(&mut d.gelu),
                n,
                f,
            )?,
            None => mk.gelu_backward_bias_over_pre(
                s,
                &mut self.wide,
                fch,
                &mut dbias,
                &mut self.partial,
                n,
                f,
            )?,
        }
        prof.mark(s, "bwd gelu+bias")?;
        let a = held(&self.layers, l)?;
        let acts = a.acts.as_ref().or(self.work.as_ref()).ok_or_else(no_acts)?;
        if defer {
            std::mem::swap(
                &mut self.dresid_bf,
                &mut self.deferred[l]
                    .as_mut()
                    .ok_or_else(|| not_deferred(l))?
                    .fcproj,
            );
        } else {
            weight_grad(
                blas,
                s,
                n,
                f,
                c,
                // The GELU, over fch.
                Mat::of(&acts.fch, f),
                Mat::of(&self.dresid_bf, c),
                Mat::of(&g.view_mut(r.fcproj_w.clone())?, c),
                self.fresh.beta(),
            )?;
            prof.mark(s, "bwd gemm fcproj")?;
        }
        // fc: the input gradient, then the LayerNorm backward (which
        // recomputes ln2, the product's input), then the weight gradient.
        // A column-split product's input gradient: each rank's share summed
        // — beside the weight gradient where asked (ln2 recomputed first).
        let beside = match &self.group {
            Some(group) if self.grad_sums_beside && !defer && self.tensor_blocks <= 1 && !sp => {
                Some(group)
            }
            _ => None,
        };
        if let Some(group) = beside {
            row_sum::start_input_grad_sum(
                blas,
                s,
                group,
                (n, c, f),
                Mat::of(&self.wide, f),
                Mat::of(&w(&r.fc_w), f),
                &mut self.dln,
                "mlp.c_fc backward",
            )?;
            prof.mark(s, "bwd gemm fc")?;
            // ln2 from resid2 and its statistics, recomputed in the
            // forward's arithmetic (the same bits, written over the same).
            let LayerSaved {
                ln2_mean,
                ln2_rstd,
                acts: own,
                ..
            } = held_mut(&mut self.layers, l)?;
            let resid2 = &own
                .as_ref()
                .or(self.work.as_ref())
                .ok_or_else(no_acts)?
                .resid2;
            mk.layernorm_forward(
                s,
                &mut self.ln,
                ln2_mean,
                ln2_rstd,
                resid2,
                &p.view(r.ln2_w.clone())?,
                &p.view(r.ln2_b.clone())?,
                n,
                c,
            )?;
            prof.mark(s, "bwd layernorm")?;
            weight_grad(
                blas,
                s,
                n,
                c,
                f,
                Mat::of(&self.ln, c),
                Mat::of(&self.wide, f),
                Mat::of(&g.view_mut(r.fc_w.clone())?, f),
                self.fresh.beta(),
            )?;
            prof.mark(s, "bwd gemm fc")?;
            row_sum::wait_for_sums(group, s, "mlp.c_fc backward")?;
        } else {
            row_sum::input_grad_sum(
                blas,
                s,
                (&self.group, sp),
                self.tensor_blocks,
                (n, c, f),
                Mat::of(&self.wide, f),
                Mat::of(&w(&r.fc_w), f),
                &mut self.dln,
                "mlp.c_fc backward",
            )?;
            prof.mark(s, "bwd gemm fc")?;
        }
        let a = held(&self.layers, l)?;
        let acts = a.acts.as_ref().or(self.work.as_ref()).ok_or_else(no_acts)?;
        let ln2: &mut DeviceBuffer<bf16> = if defer {
            &mut self.deferred[l]
                .as_mut()
                .ok_or_else(|| not_deferred(l))?
                .ln2
        } else {
            &mut self.ln
        };
        {
            // ... and proj's bias gradient comes with this one (into the
            // scratch under sequence parallelism, summed after ln_1's).
            let [mut gw, mut gb, mut gnext] = match &mut self.seq {
                Some(q) => {
                    zero_async(&mut q.norm_grads, s)?;
                    q.norm_grads.views_mut_n([0..c, c..2 * c, 2 * c..3 * c])
                }
                None => g.views_mut_n([r.ln2_w.clone(), r.ln2_b.clone(), r.proj_b.clone()])?,
            };
            let mut ln2_rows = ln2.view_mut(mine.clone());
            let recomputed = beside.is_some();
            mk.layernorm_backward(
                s,
                &mut self.dresid.view_mut(mine.clone()),
                &mut self.dresid_bf.view_mut(mine.clone()),
                (!recomputed).then_some(&mut ln2_rows as &mut dyn DeviceMem<bf16>),
                &mut gw,
                &mut gb,
                Some(&mut gnext),
                &mut self.partial,
                &self.dln.view(mine.clone()),
                &acts.resid2,
                &p.view(r.ln2_w.clone())?,
                &p.view(r.ln2_b.clone())?,
                &a.ln2_mean,
                &a.ln2_rstd,
                nl,
                c,
            )?;
            // Every row's ln2 (the weight gradient's input) and output
            // gradient (the next products').
            let ln2 = (!recomputed).then_some(ln2);
            let what = "ln_2 backward gather";
            seq::gather_after_norm(
                &self.group,
                &self.seq,
                ln2,
                (&mut self.dresid_bf, n * c),
                s,
                what,
            )?;
            prof.mark(s, "bwd layernorm")?;
        }
        if defer {
            std::mem::swap(
                &mut self.wide,
                &mut self.deferred[l].as_mut().ok_or_else(|| not_deferred(l))?.fc,
            );
        } else if beside.is_none() {
            weight_grad(
                blas,
                s,
                n,
                c,
                f,
                Mat::of(&self.ln, c),
                Mat::of(&self.wide, f),
                Mat::of(&g.view_mut(r.fc_w.clone())?, f),
                self.fresh.beta(),
            )?;
            prof.mark(s, "bwd gemm fc")?;
        }
        // Attention: resid2 = x + atty · Wproj + b.
        input_grad(
            blas,
            s,
            n,
            ca,
            c,
            Mat::of(&self.dresid_bf, c),
            Mat::of(&w(&r.proj_w), c),
            Mat::of(&self.wide.view(Wide::datty(n, ca)), ca),
        )?;
        if defer {
            std::mem::swap(
                &mut self.dresid_bf,
                &mut self.deferred[l]
                    .as_mut()
                    .ok_or_else(|| not_deferred(l))?
                    .proj,
            );
        } else {
            weight_grad(
                blas,
                s,
                n,
                ca,
                c,
                Mat::of(
                    a.atty.as_ref().or(acts.atty.as_ref()).ok_or_else(no_acts)?,
                    ca,
                ),
                Mat::of(&self.dresid_bf, c),
                Mat::of(&g.view_mut(r.proj_w.clone())?, c),
                self.fresh.beta(),
            )?;
        }
        prof.mark(s, "bwd gemm proj")?;
        // dqkv goes beside datty in the wide scratch, or into the deferred
        // layer's buffer (kept for its weight gradient).
        let (deferred_qkv, deferred_ln1) = match self.deferred.get_mut(l).and_then(Option::as_mut) {
            Some(d) => (Some(&mut d.qkv), Some(&mut d.ln1)),
            None => (None, None),
        };
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
        } = held_mut(&mut self.layers, l)?;
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
            mk,
            blas,
            s,
            &mut dqkv,
            &datty,
            atty,
            kept_attn
                .as_ref()
                .or(block_attn.as_ref())
                .ok_or_else(no_acts)?,
            &mut self.attn,
            idle,
            shape,
            prof,
        )?;
        prof.mark(s, "bwd attention")?;
        // qkv: the input gradient and the bias gradient, then the
        // LayerNorm backward (recomputing ln1), then the weight gradient
        // — or, with the input gradient's sum beside, ln1 recomputed and
        // the weight gradient while the sum runs.
        match beside {
            Some(group) => row_sum::start_input_grad_sum(
                blas,
                s,
                group,
                (n, c, 3 * ca),
                Mat::of(&dqkv, 3 * ca),
                Mat::of(&w(&r.qkv_w), 3 * ca),
                &mut self.dln,
                "attn.c_attn backward",
            )?,
            None => row_sum::input_grad_sum(
                blas,
                s,
                (&self.group, sp),
                self.tensor_blocks,
                (n, c, 3 * ca),
                Mat::of(&dqkv, 3 * ca),
                Mat::of(&w(&r.qkv_w), 3 * ca),
                &mut self.dln,
                "attn.c_attn backward",
            )?,
        }
        prof.mark(s, "bwd gemm qkv")?;
        mk.bias_backward_bf(
            s,
            &mut g.view_mut(r.qkv_b.clone())?,
            &mut self.partial,
            &dqkv,
            n,
            3 * ca,
        )?;
        prof.mark(s, "bwd bias")?;
        if let Some(group) = beside {
            let LayerSaved {
                ln1_mean, ln1_rstd, ..
            } = held_mut(&mut self.layers, l)?;
            mk.layernorm_forward(
                s,
                &mut self.ln,
                ln1_mean,
                ln1_rstd,
                held(&self.resid, l)?,
                &p.view(r.ln1_w.clone())?,
                &p.view(r.ln1_b.clone())?,
                n,
                c,
            )?;
            prof.mark(s, "bwd layernorm")?;
            weight_grad(
                blas,
                s,
                n,
                c,
                3 * ca,
                Mat::of(&self.ln, c),
                Mat::of(&dqkv, 3 * ca),
                Mat::of(&g.view_mut(r.qkv_w.clone())?, 3 * ca),
                self.fresh.beta(),
            )?;
            prof.mark(s, "bwd gemm qkv")?;
            row_sum::wait_for_sums(group, s, "attn.c_attn backward")?;
        }
        let a = held(&self.layers, l)?;
        // The layer below's fcproj bias gradient comes with this one.
        // (Not below a pipeline stage's lowest layer: another stage's.)
        let below = if l > self.bottom {
            held(&self.ranges, l - 1)?.fcproj_b.clone()
        } else {
            0..0
        };
        let ln1: &mut DeviceBuffer<bf16> = match deferred_ln1 {
            Some(ln1) => ln1,
            None => &mut self.ln,
        };
        {
            let into = [r.ln1_w.clone(), r.ln1_b.clone(), below.clone()];
            let [mut gw, mut gb, mut gnext] = match &mut self.seq {
                Some(q) => q
                    .norm_grads
                    .views_mut_n([3 * c..4 * c, 4 * c..5 * c, 5 * c..6 * c]),
                None => g.views_mut_n(into)?,
            };
            let mut ln1_rows = ln1.view_mut(mine.clone());
            let recomputed = beside.is_some();
            mk.layernorm_backward(
                s,
                &mut self.dresid.view_mut(mine.clone()),
                &mut self.dresid_bf.view_mut(mine.clone()),
                (!recomputed).then_some(&mut ln1_rows as &mut dyn DeviceMem<bf16>),
                &mut gw,
                &mut gb,
                if l > self.bottom {
                    Some(&mut gnext)
                } else {
                    None
                },
                &mut self.partial,
                &self.dln.view(mine),
                held(&self.resid, l)?,
                &p.view(r.ln1_w.clone())?,
                &p.view(r.ln1_b.clone())?,
                &a.ln1_mean,
                &a.ln1_rstd,
                nl,
                c,
            )?;
            if let Some(q) = &mut self.seq {
                // Both LayerNorms' gradients from this rank's rows, summed.
                let into = [
                    r.ln2_w.clone(),
                    r.ln2_b.clone(),
                    r.proj_b.clone(),
                    r.ln1_w.clone(),
                    r.ln1_b.clone(),
                    below,
                ];
                seq::add_norm_grads(
                    &self.group,
                    q,
                    &self.kernels,
                    g,
                    &into,
                    c,
                    s,
                    "layernorm backward",
                )?;
                let ln1 = (!recomputed).then_some(ln1);
                let what = "ln_1 backward gather";
                seq::gather_after_norm(
                    &self.group,
                    &self.seq,
                    ln1,
                    (&mut self.dresid_bf, n * c),
                    s,
                    what,
                )?;
            }
            prof.mark(s, "bwd layernorm")?;
        }
        if defer || beside.is_some() {
            Ok(())
        } else {
            weight_grad(
                blas,
                s,
                n,
                c,
                3 * ca,
                Mat::of(&self.ln, c),
                Mat::of(&dqkv, 3 * ca),
                Mat::of(&g.view_mut(r.qkv_w.clone())?, 3 * ca),
                self.fresh.beta(),
            )?;
            prof.mark(s, "bwd gemm qkv")
        }
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
        let (s, blas) = (&self.stream, &mut self.blas);
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
