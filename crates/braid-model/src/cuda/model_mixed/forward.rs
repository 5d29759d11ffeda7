//! [`GpuGptMixed`]'s forward pass: the batch, the embeddings, each
//! transformer block (also run again under checkpointing, as
//! [`Pass::Recompute`], to rebuild what its backward pass reads), and the
//! head with its loss.

use super::block::MixedForward;
use super::errors::{no_acts, no_weights};
use super::pass::Pass;
use super::products::mm;
use super::seq;
use super::state::{BlockActs, GpuGptMixed, Group, LayerSaved};
use super::sums::sum_f32;
use super::weights::layer_weights;
use crate::cpu::attention::AttnShape;
use crate::cuda::f32_params::F32Params;
use crate::cuda::held::{held, held_mut, not_held};
use crate::layout::Block;
use crate::model::Widths;
use crate::tensor_comm::ReduceKind;
use braid_cuda::blas::Mat;
use braid_cuda::memory::copy_async;
use braid_cuda::{CudaError, DeviceBuffer, Result, Stream};
use half::bf16;

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
        if let Some(fp8) = self.lt.as_mut().and_then(|l| l.fp8.as_mut()) {
            fp8.begin_pass();
        }
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
            heads: nh,
            attn: ca,
            ..
        } = self.widths;
        let (b, t) = (self.b, self.t);
        let shape = AttnShape { b, t, c: ca, nh };
        // A tensor-parallel rank other than the first adds neither the
        // residual nor the bias to its share of a row-split product (they
        // are added once, by the first, before the sum) — unless the sum
        // runs in bf16, after which every rank adds them in f32. Under
        // sequence parallelism every rank adds them to its own rows.
        let in_bf16 = self.tensor_sums_bf16 && self.group.is_some();
        let adds_residual = self.layout.shard.rank == 0 || in_bf16 || self.seq.is_some();
        let (s, mk) = (&self.stream, &self.mk);
        let block = self.layout.block_range(Block::Layer(l));
        let (wb, base) = layer_weights(mk, s, &self.pool, &mut self.streamed, pb, p, l, block)?;
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
        crate::block::forward(&mut MixedForward {
            s,
            mk,
            blas: &mut self.blas,
            lt: &mut self.lt,
            prof: &mut self.prof,
            group: &self.group,
            sp: &self.seq,
            tensor_blocks: self.tensor_blocks,
            in_bf16,
            adds_residual,
            p,
            wb,
            base,
            r,
            x,
            out,
            mean: [ln1_mean, ln2_mean],
            rstd: [ln1_rstd, ln2_rstd],
            atty,
            attn,
            kept_lse: kept_lse.as_mut(),
            resid2,
            fch,
            ln: &mut self.ln,
            wide: &mut self.wide,
            shared: &mut self.attn,
            pass,
            from_atty,
            into_saved: false,
            shape,
            w: self.widths,
        })
    }
}
