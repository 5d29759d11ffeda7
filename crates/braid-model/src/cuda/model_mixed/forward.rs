//! [`GpuGptMixed`]'s forward pass: the batch, the embeddings, each
//! transformer block (also run again under checkpointing, as
//! [`Pass::Recompute`], to rebuild what its backward pass reads), and the
//! head with its loss.

use super::*;

impl GpuGptMixed {
    /// Forward pass with master parameters `p` and their bf16 copy `pb`
    /// (`None` when the model streams its bf16 weights).
    /// With `grad`, the logits become the loss's gradient for
    /// [`backward`](Self::backward). Returns the mean loss over targets
    /// that are not `u32::MAX`. The same as
    /// [`forward_begin`](Self::forward_begin),
    /// [`forward_encoder`](Self::forward_encoder), every
    /// [`forward_block`](Self::forward_block) and
    /// [`forward_head`](Self::forward_head).
    pub fn forward<'p>(
        &mut self,
        p: impl Into<F32Params<'p>>,
        pb: Option<&DeviceBuffer<bf16>>,
        tokens: &[u32],
        targets: &[u32],
        grad: bool,
    ) -> Result<f32> {
        let p = p.into();
        self.check_params(p, pb)?;
        self.forward_begin(tokens, targets)?;
        let span = |name: &dyn Fn() -> String, s: &Stream| {
            braid_trace::scope::start(Some(s), braid_trace::Cat::Compute, name)
        };
        let t = span(&|| "forward embedding".into(), &self.stream);
        self.forward_encoder(p)?;
        drop(t);
        for l in 0..self.layout.config.n_layer {
            let _t = span(&|| format!("forward layer {l}"), &self.stream);
            self.forward_layer(l, p, pb, Pass::Forward)?;
        }
        let _t = span(&|| "forward head".into(), &self.stream);
        self.forward_head(p, pb, grad)
    }

    /// Hands the next passes layer `l`'s bf16 weights, `w` (the layer's
    /// block of the layout, in layout order: what a cast of its f32
    /// parameters would give), to use instead of casting them; `None`
    /// takes them back (later passes cast again). Only for a model built
    /// to stream its weights. The caller keeps `w`'s memory until the
    /// passes queued with it have run.
    pub fn give_layer_weights(&mut self, given: Option<(usize, DeviceBuffer<bf16>)>) -> Result<()> {
        let Some(st) = &mut self.streamed else {
            return Err(CudaError::Invalid(
                "bf16 layer weights handed to a model that keeps a whole bf16 copy".into(),
            ));
        };
        if let Some((l, w)) = &given {
            let cfg = self.layout.config;
            if *l >= cfg.n_layer {
                return Err(CudaError::Invalid(format!(
                    "bf16 weights of layer {l} for a model of {}",
                    cfg.n_layer
                )));
            }
            let want = self.layout.block_range(Block::Layer(*l)).len();
            if w.len() != want {
                return Err(CudaError::Invalid(format!(
                    "layer {l}'s bf16 weights: {} elements, the layer has {want}",
                    w.len()
                )));
            }
        }
        st.given = given;
        Ok(())
    }

    /// Starts a forward pass in parts on a batch (`b × t` tokens and their
    /// targets): uploads it.
    pub fn forward_begin(&mut self, tokens: &[u32], targets: &[u32]) -> Result<()> {
        self.own_missing()?;
        self.fresh.forward_starts();
        self.recomputed = None;
        if let Some(st) = &mut self.streamed {
            // The parameters may have changed since the last cast.
            st.holds = None;
        }
        if self.backward_sms > 0 {
            self.blas.set_sm_count_target(0)?;
        }
        let cfg = self.layout.config;
        self.batch
            .upload(tokens, targets, self.b, self.t, cfg.context)
    }

    /// The token and position embeddings' forward pass (after
    /// [`forward_begin`](Self::forward_begin)): reads `wte` and `wpe` from
    /// `p`. Queued; nothing waits.
    pub fn forward_encoder<'p>(&mut self, p: impl Into<F32Params<'p>>) -> Result<()> {
        let p = p.into();
        p.check(self.layout.len)?;
        self.check_group()?;
        let c = self.layout.config.n_embd;
        let (b, t) = (self.b, self.t);
        let rows = self.vocab_rows();
        let first_rank = self.layout.shard.rank == 0;
        let (wte, wpe) = (self.range("wte.weight"), self.range("wpe.weight"));
        let (s, k, prof) = (&self.stream, &self.kernels, &mut self.prof);
        prof.mark(s, "start")?;
        match &self.group {
            None => k.encoder_forward(
                s,
                held_mut(&mut self.resid, 0)?,
                self.batch.tokens(),
                &p.view(wte)?,
                &p.view(wpe)?,
                b * t,
                t,
                c,
            )?,
            // This rank's rows of the vocabulary (the first rank adds the
            // positions) for every row, summed over the group — under
            // sequence parallelism in the idle gradient scratch, the sum
            // scattered onto this rank's rows.
            Some(g) => {
                let sp = self.seq.is_some();
                let full = match sp {
                    true => &mut self.dresid,
                    false => held_mut(&mut self.resid, 0)?,
                };
                k.encoder_forward_part(
                    s,
                    full,
                    self.batch.tokens(),
                    &p.view(wte)?,
                    &p.view(wpe)?,
                    b * t,
                    t,
                    c,
                    rows,
                    first_rank,
                )?;
                let what = "embedding forward";
                match sp {
                    false => sum_f32(&self.group, held_mut(&mut self.resid, 0)?, s, what)?,
                    true => {
                        g.comm
                            .reduce_scatter_f32(self.dresid.view_mut(0..b * t * c), s)
                            .map_err(|e| CudaError::Group(format!("{what}: {e}")))?;
                        let (nl, mine) = seq::local(&self.seq, b * t, c);
                        let x = held_mut(&mut self.resid, 0)?;
                        copy_async(&mut x.view_mut(0..nl * c), &self.dresid.view(mine), s)?;
                    }
                }
            }
        }
        prof.mark(s, "fwd encoder")
    }

    /// Transformer block `l`'s forward pass (after the blocks below it):
    /// reads the block's parameters from `p` (and its bf16 weights from
    /// `pb`, or cast from `p` when streaming). Queued; nothing waits.
    pub fn forward_block<'p>(
        &mut self,
        l: usize,
        p: impl Into<F32Params<'p>>,
        pb: Option<&DeviceBuffer<bf16>>,
    ) -> Result<()> {
        let p = p.into();
        self.check_params(p, pb)?;
        if l >= self.layout.config.n_layer {
            return Err(CudaError::Invalid(format!(
                "layer {l} of a model of {}",
                self.layout.config.n_layer
            )));
        }
        self.forward_layer(l, p, pb, Pass::Forward)
    }

    /// The head's forward pass (after the last block): the final
    /// LayerNorm, the classifier (the token embeddings, bf16) and the loss.
    /// With `grad`, the logits become the loss's gradient for the backward
    /// pass. Waits, and returns the mean loss over targets that are not
    /// `u32::MAX`.
    pub fn forward_head<'p>(
        &mut self,
        p: impl Into<F32Params<'p>>,
        pb: Option<&DeviceBuffer<bf16>>,
        grad: bool,
    ) -> Result<f32> {
        let p = p.into();
        self.check_params(p, pb)?;
        let cfg = self.layout.config;
        let (c, v) = (cfg.n_embd, self.widths.vocab);
        let rows = self.vocab_rows();
        let (b, t, vp) = (self.b, self.t, self.vp);
        let n = b * t;
        let wte = self.range("wte.weight");
        let (lw, lb) = (self.range("ln_f.weight"), self.range("ln_f.bias"));
        let (s, mk) = (&self.stream, &self.mk);
        let blas = &mut self.blas;
        let prof = &mut self.prof;
        // (This rank's rows under sequence parallelism, then every row's.)
        let (nl, mine) = seq::local(&self.seq, n, c);
        mk.layernorm_forward(
            s,
            &mut self.lnf.view_mut(mine),
            &mut self.lnf_mean,
            &mut self.lnf_rstd,
            held(&self.resid, cfg.n_layer)?,
            &p.view(lw)?,
            &p.view(lb)?,
            nl,
            c,
        )?;
        seq::gather(
            &self.group,
            &self.seq,
            &mut self.lnf,
            n * c,
            s,
            "ln_f gather",
        )?;
        prof.mark(s, "fwd layernorm")?;
        let wte_b = match (pb, &mut self.streamed) {
            (Some(pb), _) => pb.view(wte.clone()),
            (None, Some(st)) => {
                mk.to_bf16(s, &mut st.wte, &p.view(wte.clone())?)?;
                st.wte.view(0..v * c)
            }
            (None, None) => return Err(no_weights()),
        };
        let wte_mat = match &mut self.pad {
            Some((wte_pad, _)) => {
                copy_async(&mut wte_pad.view_mut(0..v * c), &wte_b, s)?;
                Mat::of(wte_pad, c)
            }
            None => Mat::of(&wte_b, c),
        };
        mm(
            blas,
            s,
            n,
            vp,
            c,
            Mat::of(&self.lnf, c),
            wte_mat.t(),
            Mat::of(&self.logits, vp),
            0.0,
        )?;
        prof.mark(s, "fwd gemm classifier")?;
        let scale = self.batch.loss_scale(grad) * self.loss_weight;
        match &mut self.group {
            None => mk.softmax_cross_entropy(
                s,
                &mut self.logits,
                &mut self.losses,
                self.batch.targets(),
                n,
                v,
                vp,
                scale,
            )?,
            // Vocabulary-parallel: each row's maximum, then its sum of
            // exponentials and target logit, through the group.
            Some(Group { comm, mx, sums }) => {
                let group = |e: String| CudaError::Group(format!("cross-entropy: {e}"));
                mk.vocab_row_max(s, &self.logits, mx, n, v, vp)?;
                comm.all_reduce_f32(mx.view_mut(0..n), ReduceKind::Max, s)
                    .map_err(group)?;
                let targets = self.batch.targets();
                mk.vocab_row_sums(s, &self.logits, mx, sums, targets, n, rows, vp)?;
                comm.all_reduce_f32(sums.view_mut(0..2 * n), ReduceKind::Sum, s)
                    .map_err(group)?;
                mk.vocab_softmax_ce(
                    s,
                    &mut self.logits,
                    &mut self.losses,
                    mx,
                    sums,
                    targets,
                    n,
                    rows,
                    vp,
                    scale,
                )?;
            }
        }
        prof.mark(s, "softmax+cross-entropy")?;
        s.synchronize()?;
        self.batch.mean_loss(&self.losses)
    }

    /// Transformer block `l`'s forward pass. [`Pass::Forward`] computes its
    /// output, the next residual stream. [`Pass::Recompute`] (under
    /// checkpointing, at the start of the block's backward pass) rebuilds
    /// what that pass reads, in the same arithmetic: the LayerNorm
    /// statistics, the attention's saved state, `resid2` and `fch`. With
    /// the fused attention it keeps the attention output and restores the
    /// log-sum-exp instead of running the attention again, and it stops
    /// before the last product.
    pub(super) fn forward_layer(
        &mut self,
        l: usize,
        p: F32Params<'_>,
        pb: Option<&DeviceBuffer<bf16>>,
        pass: Pass,
    ) -> Result<()> {
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
        // A tensor-parallel rank other than the first adds neither the
        // residual nor the bias to its share of a row-split product (they
        // are added once, by the first, before the sum) — unless the sum
        // runs in bf16, after which every rank adds them in f32. Under
        // sequence parallelism every rank adds them to its own rows.
        let in_bf16 = self.tensor_sums_bf16 && self.group.is_some();
        let adds_residual = self.layout.shard.rank == 0 || in_bf16 || self.seq.is_some();
        let (group, sp) = (&self.group, &self.seq);
        // The rows of the residual stream and the LayerNorms (this rank's
        // under sequence parallelism), and their elements.
        let (nl, mine) = seq::local(sp, n, c);
        let (s, mk) = (&self.stream, &self.mk);
        let block = self.layout.block_range(Block::Layer(l));
        let (wb, base) = layer_weights(mk, s, &self.pool, &mut self.streamed, pb, p, l, block)?;
        let w = |r: &Range<usize>| wb.view(r.start - base..r.end - base);
        let (blas, lt, prof) = (&mut self.blas, &mut self.lt, &mut self.prof);
        let r = held(&self.ranges, l)?;
        let (before, after) = self.resid.split_at_mut(l + 1);
        let (x, out) = (
            before[l].as_ref().ok_or_else(|| not_held(l))?,
            after[0].as_mut().ok_or_else(|| not_held(l + 1))?,
        );
        let LayerSaved {
            ln1_mean,
            ln1_rstd,
            ln2_mean,
            ln2_rstd,
            atty,
            acts,
            lse: kept_lse,
            attn: kept_attn,
        } = held_mut(&mut self.layers, l)?;
        let BlockActs {
            attn: block_attn,
            resid2,
            fch,
            atty: shared_atty,
        } = acts.as_mut().or(self.work.as_mut()).ok_or_else(no_acts)?;
        let atty = atty.as_mut().or(shared_atty.as_mut()).ok_or_else(no_acts)?;
        // With the attention kept, the recomputation starts at its output.
        let from_atty = pass == Pass::Recompute && kept_attn.is_some();
        let attn = kept_attn
            .as_mut()
            .or(block_attn.as_mut())
            .ok_or_else(no_acts)?;
        if !from_atty {
            mk.layernorm_forward(
                s,
                &mut self.ln.view_mut(mine.clone()),
                ln1_mean,
                ln1_rstd,
                x,
                &p.view(r.ln1_w.clone())?,
                &p.view(r.ln1_b.clone())?,
                nl,
                c,
            )?;
            seq::gather(group, sp, &mut self.ln, n * c, s, "ln_1 gather")?;
            prof.mark(s, pass.phase("fwd layernorm", "recompute layernorm"))?;
            // The fused attention keeps qkv with its bias: one product
            // writes it there when cuBLASLt can add the bias.
            let qkv_product = Product {
                m: n,
                n: 3 * ca,
                k: c,
                a: Mat::of(&self.ln, c),
                b: Mat::of(&w(&r.qkv_w), 3 * ca),
            };
            let into_saved = match &mut *attn {
                AttnSaved::Fused { qkv, .. } => qkv_product.fused(
                    lt,
                    s,
                    None,
                    Mat::of(qkv, 3 * ca),
                    Epilogue::Bias {
                        bias: span(&w(&r.qkv_b)),
                    },
                )?,
                AttnSaved::Batched { .. } => false,
            };
            if !into_saved {
                let raw = self.wide.view(Wide::qkv(n, ca));
                qkv_product.plain(blas, s, Mat::of(&raw, 3 * ca), 0.0)?;
            }
            prof.mark(s, pass.phase("fwd gemm qkv", "recompute gemm qkv"))?;
            let qkv_b = p.view(r.qkv_b.clone())?;
            match (pass, kept_lse.as_mut()) {
                (Pass::Recompute, Some(kept)) => {
                    let raw = self.wide.view(Wide::qkv(n, ca));
                    let unbiased = (!into_saved).then_some((&raw, &qkv_b));
                    attention::restore(mk, s, attn, unbiased, kept, shape)?;
                }
                _ => {
                    if into_saved {
                        attention::forward_prebiased(mk, s, atty, attn, shape)?;
                    } else {
                        let (sh, raw) = (&mut self.attn, self.wide.view(Wide::qkv(n, ca)));
                        attention::forward(mk, blas, s, atty, &raw, &qkv_b, attn, sh, shape, prof)?;
                    }
                    if let Some(kept) = kept_lse.as_mut().filter(|_| pass == Pass::Forward) {
                        attention::keep_lse(s, attn, kept)?;
                    }
                }
            }
            prof.mark(s, pass.phase("fwd attention", "recompute attention"))?;
        }
        // resid2 = x + atty · Wproj + b (the residual and bias on the
        // group's first rank), summed over the group.
        let proj_b = p.view(r.proj_b.clone())?;
        let proj = row_sum::RowSplit {
            m: n,
            n: c,
            k: ca,
            a: &*atty,
            b: Mat::of(&w(&r.proj_w), c),
            residual: adds_residual.then_some(x),
            bias: &proj_b,
        };
        // The LayerNorm's output (read by the qkv product already) is the
        // scratch of a sum in bf16 (always so under sequence parallelism).
        row_sum::row_split_product(
            blas,
            lt,
            mk,
            s,
            (group, sp),
            (self.tensor_blocks, in_bf16),
            proj,
            &mut self.ln,
            resid2,
            "attn.c_proj forward",
        )?;
        prof.mark(s, pass.phase("fwd gemm proj", "recompute gemm proj"))?;
        mk.layernorm_forward(
            s,
            &mut self.ln.view_mut(mine.clone()),
            ln2_mean,
            ln2_rstd,
            &*resid2,
            &p.view(r.ln2_w.clone())?,
            &p.view(r.ln2_b.clone())?,
            nl,
            c,
        )?;
        seq::gather(group, sp, &mut self.ln, n * c, s, "ln_2 gather")?;
        prof.mark(s, pass.phase("fwd layernorm", "recompute layernorm"))?;
        // gelu = GELU(ln2 · W + b), the pre-activation kept in fch.
        let fc = Product {
            m: n,
            n: f,
            k: c,
            a: Mat::of(&self.ln, c),
            b: Mat::of(&w(&r.fc_w), f),
        };
        let gelu = Epilogue::GeluAuxBias {
            bias: span(&w(&r.fc_b)),
            aux: span(&*fch),
            aux_ld: f,
        };
        if fc.fused(lt, s, None, Mat::of(&self.wide, f), gelu)? {
            prof.mark(s, pass.phase("fwd gemm fc", "recompute gemm fc"))?;
        } else {
            fc.plain(blas, s, Mat::of(&*fch, f), 0.0)?;
            prof.mark(s, pass.phase("fwd gemm fc", "recompute gemm fc"))?;
            mk.bias_gelu(s, fch, &mut self.wide, &p.view(r.fc_b.clone())?, n, f)?;
            prof.mark(s, pass.phase("fwd bias+gelu", "recompute bias+gelu"))?;
        }
        if pass == Pass::Recompute {
            return Ok(());
        }
        // out = resid2 + gelu · Wfcproj + b, summed over the group.
        let fcproj_b = p.view(r.fcproj_b.clone())?;
        let fcproj = row_sum::RowSplit {
            m: n,
            n: c,
            k: f,
            a: &self.wide,
            b: Mat::of(&w(&r.fcproj_w), c),
            residual: adds_residual.then_some(&*resid2),
            bias: &fcproj_b,
        };
        // The second LayerNorm's output, read by the fc product already.
        row_sum::row_split_product(
            blas,
            lt,
            mk,
            s,
            (group, sp),
            (self.tensor_blocks, in_bf16),
            fcproj,
            &mut self.ln,
            out,
            "mlp.c_proj forward",
        )?;
        prof.mark(s, "fwd gemm fcproj")
    }
}
