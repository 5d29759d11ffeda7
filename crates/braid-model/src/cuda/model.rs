//! The GPT model on one GPU in f32 (issue 6, first form): the same blocks,
//! flat parameter layout and arithmetic as the CPU model, composed from
//! the checked kernels and cuBLAS. Parameters, gradients and activations
//! live in device memory; parameters are addressed as views of the flat
//! buffer.
//!
//! A model may be one tensor-parallel rank's share
//! ([`GpuGpt::tensor_parallel`], over a `Layout::tensor_parallel` layout):
//! the CPU model's split (Megatron's), its collectives through the
//! group's [`DeviceTensorComm`] on the model's stream — one all-reduce
//! after each row-split product forward, one after each column-split
//! product backward, the vocabulary-parallel embedding and cross-entropy.

use super::attention::{attention_backward, attention_forward, AttnScratch};
use super::batch::DeviceBatch;
use super::f32_params::F32Params;
use super::{Kernels, VocabRows};
use crate::cpu::attention::AttnShape;
use crate::layout::Layout;
use crate::model::Widths;
use crate::tensor_comm::{DeviceTensorComm, ReduceKind};
use braid_cuda::blas::Blas;
use braid_cuda::memory::{copy_async, zero_async};
use braid_cuda::{CudaError, Device, DeviceBuffer, DeviceWindow, Result, Stream};
use std::ops::Range;
use std::sync::Arc;

/// One layer's parameter ranges in the flat buffer.
pub(crate) struct LayerRanges {
    pub(crate) ln1_w: Range<usize>,
    pub(crate) ln1_b: Range<usize>,
    pub(crate) qkv_w: Range<usize>,
    pub(crate) qkv_b: Range<usize>,
    pub(crate) proj_w: Range<usize>,
    pub(crate) proj_b: Range<usize>,
    pub(crate) ln2_w: Range<usize>,
    pub(crate) ln2_b: Range<usize>,
    pub(crate) fc_w: Range<usize>,
    pub(crate) fc_b: Range<usize>,
    pub(crate) fcproj_w: Range<usize>,
    pub(crate) fcproj_b: Range<usize>,
}

struct LayerActs {
    ln1: DeviceBuffer<f32>,
    ln1_mean: DeviceBuffer<f32>,
    ln1_rstd: DeviceBuffer<f32>,
    qkv: DeviceBuffer<f32>,
    atty: DeviceBuffer<f32>,
    attn: AttnScratch,
    resid2: DeviceBuffer<f32>,
    ln2: DeviceBuffer<f32>,
    ln2_mean: DeviceBuffer<f32>,
    ln2_rstd: DeviceBuffer<f32>,
    fch: DeviceBuffer<f32>,
    fch_gelu: DeviceBuffer<f32>,
}

impl LayerRanges {
    /// Layer `i`'s ranges in `layout`.
    pub(crate) fn of(layout: &Layout, i: usize) -> LayerRanges {
        let r = |s: &str| {
            layout
                .get(&format!("h.{i}.{s}"))
                .expect("layer parameter")
                .range()
        };
        LayerRanges {
            ln1_w: r("ln_1.weight"),
            ln1_b: r("ln_1.bias"),
            qkv_w: r("attn.c_attn.weight"),
            qkv_b: r("attn.c_attn.bias"),
            proj_w: r("attn.c_proj.weight"),
            proj_b: r("attn.c_proj.bias"),
            ln2_w: r("ln_2.weight"),
            ln2_b: r("ln_2.bias"),
            fc_w: r("mlp.c_fc.weight"),
            fc_b: r("mlp.c_fc.bias"),
            fcproj_w: r("mlp.c_proj.weight"),
            fcproj_b: r("mlp.c_proj.bias"),
        }
    }
}

/// A tensor-parallel rank's group: its collectives, and the rows' maxima
/// and sums of the vocabulary-parallel cross-entropy (`n` and `2n`).
struct Group {
    comm: Arc<dyn DeviceTensorComm>,
    mx: DeviceBuffer<f32>,
    sums: DeviceBuffer<f32>,
}

/// A GPT model's forward and backward passes on one GPU, sized for one
/// (batch, sequence) shape.
pub struct GpuGpt {
    layout: Arc<Layout>,
    /// The widths of this rank's passes.
    widths: Widths,
    /// The tensor-parallel group, when this is one rank's share.
    group: Option<Group>,
    stream: Stream,
    kernels: Kernels,
    blas: Blas,
    b: usize,
    t: usize,
    ranges: Vec<LayerRanges>,
    layers: Vec<LayerActs>,
    resid: Vec<DeviceBuffer<f32>>,
    lnf: DeviceBuffer<f32>,
    lnf_mean: DeviceBuffer<f32>,
    lnf_rstd: DeviceBuffer<f32>,
    logits: DeviceBuffer<f32>,
    losses: DeviceBuffer<f32>,
    batch: DeviceBatch,
    // Gradient scratch.
    dresid: DeviceBuffer<f32>,
    dresid2: DeviceBuffer<f32>,
    dln: DeviceBuffer<f32>,
    dfch: DeviceBuffer<f32>,
    dgelu: DeviceBuffer<f32>,
    datty: DeviceBuffer<f32>,
    dqkv: DeviceBuffer<f32>,
}

impl GpuGpt {
    /// Buffers for batches of `b × t` tokens on `device`.
    pub fn new(device: &Device, layout: Arc<Layout>, b: usize, t: usize) -> Result<GpuGpt> {
        let cfg = layout.config;
        let w = Widths::of(&layout);
        // This rank's widths: the whole model's in one process.
        let (c, v, nh) = (cfg.n_embd, w.vocab, w.heads);
        let (a, f) = (w.attn, w.mlp);
        let n = b * t;
        let z = |k: usize| DeviceBuffer::<f32>::zeros(device, k);
        let mut layers = Vec::new();
        let mut ranges = Vec::new();
        for i in 0..cfg.n_layer {
            ranges.push(LayerRanges::of(&layout, i));
            layers.push(LayerActs {
                ln1: z(n * c)?,
                ln1_mean: z(n)?,
                ln1_rstd: z(n)?,
                qkv: z(n * 3 * a)?,
                atty: z(n * a)?,
                attn: AttnScratch::new(device, AttnShape { b, t, c: a, nh })?,
                resid2: z(n * c)?,
                ln2: z(n * c)?,
                ln2_mean: z(n)?,
                ln2_rstd: z(n)?,
                fch: z(n * f)?,
                fch_gelu: z(n * f)?,
            });
        }
        Ok(GpuGpt {
            // The device's own stream: collectives order themselves after it.
            stream: device.main_stream(),
            kernels: Kernels::load(device)?,
            blas: Blas::new(device)?,
            b,
            t,
            ranges,
            layers,
            resid: (0..=cfg.n_layer).map(|_| z(n * c)).collect::<Result<_>>()?,
            lnf: z(n * c)?,
            lnf_mean: z(n)?,
            lnf_rstd: z(n)?,
            logits: z(n * v)?,
            losses: z(n)?,
            // Tokens and targets are whole-vocabulary ids.
            batch: DeviceBatch::new(device, n, cfg.vocab_size)?,
            dresid: z(n * c)?,
            dresid2: z(n * c)?,
            dln: z(n * c)?,
            dfch: z(n * f)?,
            dgelu: z(n * f)?,
            datty: z(n * a)?,
            dqkv: z(n * 3 * a)?,
            widths: w,
            group: None,
            layout,
        })
    }

    /// Makes this model tensor-parallel rank `comm.rank()`'s share: its
    /// layout must be that rank's `Layout::tensor_parallel` layout.
    pub fn tensor_parallel(mut self, comm: Arc<dyn DeviceTensorComm>) -> Result<GpuGpt> {
        let shard = self.layout.shard;
        if (comm.rank(), comm.size()) != (shard.rank, shard.size) {
            return Err(CudaError::Invalid(format!(
                "a layout of tensor-parallel rank {} of {} over a group where this is rank {} of {}",
                shard.rank,
                shard.size,
                comm.rank(),
                comm.size()
            )));
        }
        let n = self.b * self.t;
        let device = self.stream.device().clone();
        let mx = DeviceBuffer::<f32>::zeros(&device, n)?;
        let sums = DeviceBuffer::<f32>::zeros(&device, 2 * n)?;
        self.group = Some(Group { comm, mx, sums });
        Ok(self)
    }

    /// This rank's rows of the vocabulary.
    fn vocab_rows(&self) -> VocabRows {
        VocabRows {
            first: self.widths.vocab_start,
            v: self.widths.vocab,
        }
    }

    /// The group's all-reduce (sum) of `x` on the model's stream; nothing
    /// in one process. A share of the model without its group is refused.
    fn sum_over_group(
        group: &Option<Group>,
        shards: usize,
        x: &mut DeviceBuffer<f32>,
        s: &Stream,
        what: &str,
    ) -> Result<()> {
        match (group, shards) {
            (None, 1) => Ok(()),
            (None, n) => Err(CudaError::Group(format!(
                "this is one of {n} tensor-parallel shares of the model, built without its group"
            ))),
            (Some(g), _) => g
                .comm
                .all_reduce_f32(x.view_mut(0..x.len()), ReduceKind::Sum, s)
                .map_err(|e| CudaError::Group(format!("{what}: {e}"))),
        }
    }

    /// The loaded kernels.
    pub fn kernels(&self) -> &Kernels {
        &self.kernels
    }

    /// The stream everything runs on.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    fn range(&self, name: &str) -> Range<usize> {
        self.layout.get(name).expect("model parameter").range()
    }

    /// Forward pass on `p` (the flat parameters). With `grad`, the logits
    /// are turned into the loss's gradient for [`backward`](Self::backward).
    /// Returns the mean loss over targets that are not `u32::MAX`. The same
    /// as [`forward_begin`](Self::forward_begin),
    /// [`forward_encoder`](Self::forward_encoder), every
    /// [`forward_block`](Self::forward_block) and
    /// [`forward_head`](Self::forward_head).
    pub fn forward<'p>(
        &mut self,
        p: impl Into<F32Params<'p>>,
        tokens: &[u32],
        targets: &[u32],
        grad: bool,
    ) -> Result<f32> {
        let p = p.into();
        self.forward_begin(tokens, targets)?;
        let span = |name: &dyn Fn() -> String, s: &Stream| {
            braid_trace::scope::start(Some(s), braid_trace::Cat::Compute, name)
        };
        let t = span(&|| "forward embedding".into(), &self.stream);
        self.forward_encoder(p)?;
        drop(t);
        for l in 0..self.layout.config.n_layer {
            let _t = span(&|| format!("forward layer {l}"), &self.stream);
            self.forward_block(l, p)?;
        }
        let _t = span(&|| "forward head".into(), &self.stream);
        self.forward_head(p, grad)
    }

    /// Starts a forward pass in parts: uploads the batch.
    pub fn forward_begin(&mut self, tokens: &[u32], targets: &[u32]) -> Result<()> {
        let cfg = self.layout.config;
        self.batch
            .upload(tokens, targets, self.b, self.t, cfg.context)
    }

    /// The embeddings' forward pass (reads `wte` and `wpe`). Queued.
    pub fn forward_encoder<'p>(&mut self, p: impl Into<F32Params<'p>>) -> Result<()> {
        let p = p.into();
        let c = self.layout.config.n_embd;
        let (b, t) = (self.b, self.t);
        let n = b * t;
        let rows = self.vocab_rows();
        let (s, k) = (&self.stream, &self.kernels);
        let (wte, wpe) = (self.range("wte.weight"), self.range("wpe.weight"));
        if self.group.is_none() {
            return k.encoder_forward(
                s,
                &mut self.resid[0],
                self.batch.tokens(),
                &p.view(wte)?,
                &p.view(wpe)?,
                n,
                t,
                c,
            );
        }
        // This rank's rows of the vocabulary (the first rank adds the
        // positions), summed over the group.
        k.encoder_forward_part(
            s,
            &mut self.resid[0],
            self.batch.tokens(),
            &p.view(wte)?,
            &p.view(wpe)?,
            n,
            t,
            c,
            rows,
            self.layout.shard.rank == 0,
        )?;
        let shards = self.layout.shard.size;
        Self::sum_over_group(
            &self.group,
            shards,
            &mut self.resid[0],
            s,
            "embedding forward",
        )
    }

    /// Transformer block `l`'s forward pass (after those below it; reads
    /// its parameters). Queued.
    pub fn forward_block<'p>(&mut self, l: usize, p: impl Into<F32Params<'p>>) -> Result<()> {
        let p = p.into();
        let cfg = self.layout.config;
        if l >= cfg.n_layer {
            return Err(CudaError::Invalid(format!(
                "layer {l} of a model of {}",
                cfg.n_layer
            )));
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
        let shards = self.layout.shard.size;
        let (s, k) = (&self.stream, &self.kernels);
        let r = &self.ranges[l];
        let (before, after) = self.resid.split_at_mut(l + 1);
        let (x, out) = (&before[l], &mut after[0]);
        let a = &mut self.layers[l];
        let group = &self.group;
        k.layernorm_forward(
            s,
            &mut a.ln1,
            &mut a.ln1_mean,
            &mut a.ln1_rstd,
            x,
            &p.view(r.ln1_w.clone())?,
            &p.view(r.ln1_b.clone())?,
            n,
            c,
        )?;
        self.blas.gemm_rm(
            s,
            &mut a.qkv,
            &a.ln1,
            false,
            &p.view(r.qkv_w.clone())?,
            false,
            n,
            3 * ca,
            c,
            false,
        )?;
        k.add_bias(s, &mut a.qkv, &p.view(r.qkv_b.clone())?, n, 3 * ca)?;
        attention_forward(
            k,
            &mut self.blas,
            s,
            &mut a.atty,
            &a.qkv,
            &mut a.attn,
            AttnShape { b, t, c: ca, nh },
        )?;
        self.blas.gemm_rm(
            s,
            &mut a.resid2,
            &a.atty,
            false,
            &p.view(r.proj_w.clone())?,
            false,
            n,
            c,
            ca,
            false,
        )?;
        // A row-split product: each rank's share summed, then the bias once.
        Self::sum_over_group(group, shards, &mut a.resid2, s, "attn.c_proj forward")?;
        k.add_bias(s, &mut a.resid2, &p.view(r.proj_b.clone())?, n, c)?;
        // resid2 += x (in place: out = a + b with out == a).
        k.add_inplace(s, &mut a.resid2, x)?;
        k.layernorm_forward(
            s,
            &mut a.ln2,
            &mut a.ln2_mean,
            &mut a.ln2_rstd,
            &a.resid2,
            &p.view(r.ln2_w.clone())?,
            &p.view(r.ln2_b.clone())?,
            n,
            c,
        )?;
        self.blas.gemm_rm(
            s,
            &mut a.fch,
            &a.ln2,
            false,
            &p.view(r.fc_w.clone())?,
            false,
            n,
            f,
            c,
            false,
        )?;
        k.add_bias(s, &mut a.fch, &p.view(r.fc_b.clone())?, n, f)?;
        k.gelu_forward(s, &mut a.fch_gelu, &a.fch)?;
        self.blas.gemm_rm(
            s,
            out,
            &a.fch_gelu,
            false,
            &p.view(r.fcproj_w.clone())?,
            false,
            n,
            c,
            f,
            false,
        )?;
        Self::sum_over_group(group, shards, out, s, "mlp.c_proj forward")?;
        k.add_bias(s, out, &p.view(r.fcproj_b.clone())?, n, c)?;
        k.add_inplace(s, out, &a.resid2)?;
        Ok(())
    }

    /// The head's forward pass (after the last block): final LayerNorm,
    /// classifier (reads `ln_f` and `wte`), loss. With `grad`, the logits
    /// become the loss's gradient. Waits; returns the mean loss.
    pub fn forward_head<'p>(&mut self, p: impl Into<F32Params<'p>>, grad: bool) -> Result<f32> {
        let p = p.into();
        let cfg = self.layout.config;
        let (c, v) = (cfg.n_embd, self.widths.vocab);
        let n = self.b * self.t;
        let rows = self.vocab_rows();
        let (s, k) = (&self.stream, &self.kernels);
        let wte = self.range("wte.weight");
        let (lw, lb) = (self.range("ln_f.weight"), self.range("ln_f.bias"));
        k.layernorm_forward(
            s,
            &mut self.lnf,
            &mut self.lnf_mean,
            &mut self.lnf_rstd,
            &self.resid[cfg.n_layer],
            &p.view(lw)?,
            &p.view(lb)?,
            n,
            c,
        )?;
        self.blas.gemm_rm(
            s,
            &mut self.logits,
            &self.lnf,
            false,
            &p.view(wte)?,
            true,
            n,
            v,
            c,
            false,
        )?;
        let scale = self.batch.loss_scale(grad);
        match &mut self.group {
            None => k.softmax_cross_entropy(
                s,
                &mut self.logits,
                &mut self.losses,
                self.batch.targets(),
                n,
                v,
                scale,
            )?,
            // Vocabulary-parallel: each row's maximum, then its sum of
            // exponentials and target logit, through the group.
            Some(Group { comm, mx, sums }) => {
                let group = |e: String| CudaError::Group(format!("cross-entropy: {e}"));
                k.vocab_row_max(s, &self.logits, mx, n, v)?;
                comm.all_reduce_f32(mx.view_mut(0..n), ReduceKind::Max, s)
                    .map_err(group)?;
                let targets = self.batch.targets();
                k.vocab_row_sums(s, &self.logits, mx, sums, targets, n, rows)?;
                comm.all_reduce_f32(sums.view_mut(0..2 * n), ReduceKind::Sum, s)
                    .map_err(group)?;
                k.vocab_softmax_ce(
                    s,
                    &mut self.logits,
                    &mut self.losses,
                    mx,
                    sums,
                    targets,
                    n,
                    rows,
                    scale,
                )?;
            }
        }
        s.synchronize()?;
        self.batch.mean_loss(&self.losses)
    }

    /// Accumulates the gradient of the last `forward(.., grad = true)` into
    /// `g` (flat, same layout as the parameters) and waits for it: the
    /// head, every layer from the last down, then the embeddings.
    pub fn backward<'p>(
        &mut self,
        p: impl Into<F32Params<'p>>,
        g: &mut DeviceBuffer<f32>,
    ) -> Result<()> {
        let p = p.into();
        let mut w = g.window();
        self.backward_head(p, &mut w)?;
        for l in (0..self.layout.config.n_layer).rev() {
            self.backward_layer(l, p, &mut w)?;
        }
        self.backward_embedding(&mut w)?;
        self.stream.synchronize()
    }

    /// Backward of the head (first): the classifier's share of the token
    /// embedding's gradient and the final LayerNorm's gradients (final
    /// after this). Queued; nothing waits. `g` holds the gradient buffer's
    /// elements still being written (buffer indices).
    pub fn backward_head<'p>(
        &mut self,
        p: impl Into<F32Params<'p>>,
        g: &mut DeviceWindow<'_, f32>,
    ) -> Result<()> {
        let p = p.into();
        let cfg = self.layout.config;
        let (c, v) = (cfg.n_embd, self.widths.vocab);
        let n = self.b * self.t;
        let shards = self.layout.shard.size;
        let (s, k) = (&self.stream, &self.kernels);
        let wte = self.range("wte.weight");
        let (lw, lb) = (self.range("ln_f.weight"), self.range("ln_f.bias"));
        // Head: dlnf = dlogits · wte ; dwte += dlogitsᵀ · lnf.
        self.blas.gemm_rm(
            s,
            &mut self.dln,
            &self.logits,
            false,
            &p.view(wte.clone())?,
            false,
            n,
            c,
            v,
            false,
        )?;
        self.blas.gemm_rm(
            s,
            &mut g.view_mut(wte.clone())?,
            &self.logits,
            true,
            &self.lnf,
            false,
            v,
            c,
            n,
            true,
        )?;
        // Each rank's share of the vocabulary's gradient, summed.
        Self::sum_over_group(&self.group, shards, &mut self.dln, s, "head backward")?;
        zero_async(&mut self.dresid, s)?;
        {
            let [mut gw, mut gb] = g.views_mut_n([lw.clone(), lb])?;
            k.layernorm_backward(
                s,
                &mut self.dresid,
                &mut gw,
                &mut gb,
                &self.dln,
                &self.resid[cfg.n_layer],
                &p.view(lw)?,
                &self.lnf_mean,
                &self.lnf_rstd,
                n,
                c,
            )?;
        }
        Ok(())
    }

    /// Backward of transformer block `l` (after the blocks above it); its
    /// gradients are final after this. Queued; nothing waits.
    pub fn backward_layer<'p>(
        &mut self,
        l: usize,
        p: impl Into<F32Params<'p>>,
        g: &mut DeviceWindow<'_, f32>,
    ) -> Result<()> {
        let p = p.into();
        let Widths {
            c,
            heads: nh,
            attn: ca,
            mlp: f,
            ..
        } = self.widths;
        let (b, t) = (self.b, self.t);
        let n = b * t;
        let shards = self.layout.shard.size;
        let (s, k) = (&self.stream, &self.kernels);
        let r = &self.ranges[l];
        let a = &mut self.layers[l];
        let x = &self.resid[l];
        let group = &self.group;
        // MLP.
        copy_async(&mut self.dresid2, &self.dresid, s)?;
        zero_async(&mut self.dgelu, s)?;
        self.blas.gemm_rm(
            s,
            &mut self.dgelu,
            &self.dresid,
            false,
            &p.view(r.fcproj_w.clone())?,
            true,
            n,
            f,
            c,
            true,
        )?;
        self.blas.gemm_rm(
            s,
            &mut g.view_mut(r.fcproj_w.clone())?,
            &a.fch_gelu,
            true,
            &self.dresid,
            false,
            f,
            c,
            n,
            true,
        )?;
        k.bias_backward(s, &mut g.view_mut(r.fcproj_b.clone())?, &self.dresid, n, c)?;
        zero_async(&mut self.dfch, s)?;
        k.gelu_backward(s, &mut self.dfch, &a.fch, &self.dgelu)?;
        zero_async(&mut self.dln, s)?;
        self.blas.gemm_rm(
            s,
            &mut self.dln,
            &self.dfch,
            false,
            &p.view(r.fc_w.clone())?,
            true,
            n,
            c,
            f,
            true,
        )?;
        self.blas.gemm_rm(
            s,
            &mut g.view_mut(r.fc_w.clone())?,
            &a.ln2,
            true,
            &self.dfch,
            false,
            c,
            f,
            n,
            true,
        )?;
        k.bias_backward(s, &mut g.view_mut(r.fc_b.clone())?, &self.dfch, n, f)?;
        // A column-split product's input gradient: each rank's share summed.
        Self::sum_over_group(group, shards, &mut self.dln, s, "mlp.c_fc backward")?;
        {
            let [mut gw, mut gb] = g.views_mut_n([r.ln2_w.clone(), r.ln2_b.clone()])?;
            k.layernorm_backward(
                s,
                &mut self.dresid2,
                &mut gw,
                &mut gb,
                &self.dln,
                &a.resid2,
                &p.view(r.ln2_w.clone())?,
                &a.ln2_mean,
                &a.ln2_rstd,
                n,
                c,
            )?;
        }
        // Attention.
        copy_async(&mut self.dresid, &self.dresid2, s)?;
        zero_async(&mut self.datty, s)?;
        self.blas.gemm_rm(
            s,
            &mut self.datty,
            &self.dresid2,
            false,
            &p.view(r.proj_w.clone())?,
            true,
            n,
            ca,
            c,
            true,
        )?;
        self.blas.gemm_rm(
            s,
            &mut g.view_mut(r.proj_w.clone())?,
            &a.atty,
            true,
            &self.dresid2,
            false,
            ca,
            c,
            n,
            true,
        )?;
        k.bias_backward(s, &mut g.view_mut(r.proj_b.clone())?, &self.dresid2, n, c)?;
        zero_async(&mut self.dqkv, s)?;
        attention_backward(
            k,
            &mut self.blas,
            s,
            &mut self.dqkv,
            &self.datty,
            &mut a.attn,
            AttnShape { b, t, c: ca, nh },
        )?;
        zero_async(&mut self.dln, s)?;
        self.blas.gemm_rm(
            s,
            &mut self.dln,
            &self.dqkv,
            false,
            &p.view(r.qkv_w.clone())?,
            true,
            n,
            c,
            3 * ca,
            true,
        )?;
        self.blas.gemm_rm(
            s,
            &mut g.view_mut(r.qkv_w.clone())?,
            &a.ln1,
            true,
            &self.dqkv,
            false,
            c,
            3 * ca,
            n,
            true,
        )?;
        k.bias_backward(s, &mut g.view_mut(r.qkv_b.clone())?, &self.dqkv, n, 3 * ca)?;
        Self::sum_over_group(group, shards, &mut self.dln, s, "attn.c_attn backward")?;
        {
            let [mut gw, mut gb] = g.views_mut_n([r.ln1_w.clone(), r.ln1_b.clone()])?;
            k.layernorm_backward(
                s,
                &mut self.dresid,
                &mut gw,
                &mut gb,
                &self.dln,
                x,
                &p.view(r.ln1_w.clone())?,
                &a.ln1_mean,
                &a.ln1_rstd,
                n,
                c,
            )?;
        }
        Ok(())
    }

    /// Backward of the embeddings (last); final after this. Queued.
    pub fn backward_embedding(&mut self, g: &mut DeviceWindow<'_, f32>) -> Result<()> {
        let (c, t) = (self.layout.config.n_embd, self.t);
        let (wte, wpe) = (self.range("wte.weight"), self.range("wpe.weight"));
        let [mut gte, mut gpe] = g.views_mut_n([wte, wpe])?;
        if self.group.is_none() {
            return self.batch.embedding_backward(
                &self.kernels,
                &self.stream,
                &mut gte,
                &mut gpe,
                &self.dresid,
                t,
                c,
            );
        }
        // Every rank's position embedding whole, its vocabulary rows'.
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
        )
    }
}
