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
//! With sequence parallelism the residual stream, the LayerNorms and
//! their saved outputs hold only the rank's slice of the `b × t` rows: an
//! all-gather comes before each column-split product (and again, of the
//! saved LayerNorm output, for its weight gradient), a reduce-scatter
//! after each row-split one (and after each column-split product's input
//! gradient), and the LayerNorms' gradients of the rank's rows are summed
//! over the group after each block.

use super::f32_params::F32Params;
use super::held::{held, held_mut, not_held};
use super::kernels::{Kernels, VocabRows};
use crate::block::{Act, LayerRanges};
use crate::layout::Layout;
use crate::model::Widths;
use crate::tensor_comm::{DeviceTensorComm, ReduceKind};
use braid_cuda::blas::Blas;
use braid_cuda::memory::{copy_async, zero_async};
use braid_cuda::{CudaError, Device, DeviceBuffer, DeviceView, DeviceWindow, Result, Stream};
use std::ops::Range;
use std::sync::Arc;

mod block;
mod stage;
mod state;
use block::{BlockEnv, F32Backward, F32Forward, DLN, DRESID};
pub use stage::F32MicroSaved;
pub use state::GpuGpt;
use state::{no_rows, sequence, Group, SeqRows};

impl GpuGpt {
    /// Buffers for batches of `b × t` tokens on `device`.
    pub fn new(device: &Device, layout: Arc<Layout>, b: usize, t: usize) -> Result<GpuGpt> {
        let cfg = layout.config;
        let w = Widths::of(&layout);
        // This rank's widths: the whole model's in one process.
        let (c, a, f) = (cfg.n_embd, w.attn, w.mlp);
        let n = b * t;
        let z = |k: usize| DeviceBuffer::<f32>::zeros(device, k);
        // What the forward pass keeps, for the layers the layout holds.
        use crate::layout::Block;
        let held = |l: usize| layout.holds(Block::Layer(l));
        let head = layout.holds(Block::FinalNorm);
        let saved = stage::make(device, &layout, (b, t), &held, head)?;
        Ok(GpuGpt {
            // The device's own stream: collectives order themselves after it.
            stream: device.main_stream(),
            kernels: Kernels::load(device)?,
            blas: Blas::new(device)?,
            b,
            t,
            ranges: (0..cfg.n_layer)
                .map(|i| held(i).then(|| LayerRanges::of(&layout, i)))
                .collect(),
            layers: saved.layers,
            resid: saved.resid,
            lnf: saved.lnf,
            lnf_mean: saved.lnf_mean,
            lnf_rstd: saved.lnf_rstd,
            logits: saved.logits,
            losses: saved.losses,
            batch: saved.batch,
            d: [
                z(n * c)?,
                z(n * c)?,
                z(n * c)?,
                z(n * f)?,
                z(n * f)?,
                z(n * a)?,
                z(n * 3 * a)?,
            ],
            loss_weight: 1.0,
            widths: w,
            group: None,
            layout,
        })
    }

    /// Makes this model tensor-parallel rank `comm.rank()`'s share: its
    /// layout must be that rank's `Layout::tensor_parallel` layout. With
    /// `sequence`, sequence parallelism too: the `b × t` rows must divide
    /// by the group's size (the row-wide buffers shrink to a slice).
    pub fn tensor_parallel(
        mut self,
        comm: Arc<dyn DeviceTensorComm>,
        sequence: bool,
    ) -> Result<GpuGpt> {
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
        let seq = match sequence {
            false => None,
            true => Some(self.split_rows(comm.rank(), comm.size())?),
        };
        self.group = Some(Group {
            comm,
            mx,
            sums,
            seq,
        });
        Ok(self)
    }

    /// Sequence parallelism: shrinks the row-wide buffers (the residual
    /// stream, the LayerNorms' inputs, outputs and statistics, their
    /// gradients) to rank `rank`'s slice of `size`.
    fn split_rows(&mut self, rank: usize, size: usize) -> Result<SeqRows> {
        let n = self.b * self.t;
        if n % size != 0 {
            return Err(CudaError::Invalid(format!(
                "sequence parallelism over {size} ranks splits the batch's {} x {} = {n} tokens \
                 into equal slices: use a batch or --seq whose product divides by {size} (or --no-sp)",
                self.b, self.t
            )));
        }
        let (m, c) = (n / size, self.layout.config.n_embd);
        let device = self.stream.device().clone();
        let z = |k: usize| DeviceBuffer::<f32>::zeros(&device, k);
        for a in self.layers.iter_mut().flatten() {
            for t in [Act::Ln1, Act::Resid2, Act::Ln2] {
                a.t[t.inner().expect("a tensor of the block's own")] = z(m * c)?;
            }
            for i in 0..2 {
                a.mean[i] = z(m)?;
                a.rstd[i] = z(m)?;
            }
        }
        for buf in self.resid.iter_mut().flatten() {
            *buf = z(m * c)?;
        }
        let [dresid, dresid2, ..] = &mut self.d;
        for buf in [&mut self.lnf, dresid, dresid2] {
            *buf = z(m * c)?;
        }
        self.lnf_mean = z(m)?;
        self.lnf_rstd = z(m)?;
        Ok(SeqRows {
            rows: rank * m..(rank + 1) * m,
            gathered: z(n * c)?,
            norm_grads: z(4 * c)?,
        })
    }

    /// The rows of the residual stream this rank holds (all of them
    /// without sequence parallelism).
    fn rows(&self) -> usize {
        match &self.group {
            Some(Group { seq: Some(q), .. }) => q.rows.len(),
            _ => self.b * self.t,
        }
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
                held_mut(&mut self.resid, 0)?,
                self.batch.tokens(),
                &p.view(wte)?,
                &p.view(wpe)?,
                n,
                t,
                c,
            );
        }
        // This rank's rows of the vocabulary (the first rank adds the
        // positions), summed over the group (into this rank's rows of the
        // stream under sequence parallelism).
        let sp = sequence(&self.group);
        k.encoder_forward_part(
            s,
            match sp {
                true => &mut self.d[DLN],
                false => held_mut(&mut self.resid, 0)?,
            },
            self.batch.tokens(),
            &p.view(wte)?,
            &p.view(wpe)?,
            n,
            t,
            c,
            rows,
            self.layout.shard.rank == 0,
        )?;
        if let (true, Some(g)) = (sp, &self.group) {
            let mine = g.scatter(&mut self.d[DLN], c, s, "embedding forward")?;
            return copy_async(held_mut(&mut self.resid, 0)?, &self.d[DLN].view(mine), s);
        }
        let shards = self.layout.shard.size;
        Self::sum_over_group(
            &self.group,
            shards,
            held_mut(&mut self.resid, 0)?,
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
        let rows = self.rows();
        let (before, after) = self.resid.split_at_mut(l + 1);
        let [_, _, dln, ..] = &mut self.d;
        crate::block::forward(&mut F32Forward {
            env: BlockEnv {
                s: &self.stream,
                k: &self.kernels,
                blas: &mut self.blas,
                group: &mut self.group,
                shards: self.layout.shard.size,
                r: held(&self.ranges, l)?,
                p,
                w: self.widths,
                b: self.b,
                t: self.t,
                rows,
            },
            x: before[l].as_ref().ok_or_else(|| not_held(l))?,
            out: after[0].as_mut().ok_or_else(|| not_held(l + 1))?,
            a: held_mut(&mut self.layers, l)?,
            scratch: dln,
        })
    }

    /// The head's forward pass (after the last block): final LayerNorm,
    /// classifier (reads `ln_f` and `wte`), loss. With `grad`, the logits
    /// become the loss's gradient. Waits; returns the mean loss.
    pub fn forward_head<'p>(&mut self, p: impl Into<F32Params<'p>>, grad: bool) -> Result<f32> {
        let p = p.into();
        let cfg = self.layout.config;
        let (c, v) = (cfg.n_embd, self.widths.vocab);
        let n = self.b * self.t;
        let (rows, mine) = (self.vocab_rows(), self.rows());
        let (s, k) = (&self.stream, &self.kernels);
        let wte = self.range("wte.weight");
        let (lw, lb) = (self.range("ln_f.weight"), self.range("ln_f.bias"));
        k.layernorm_forward(
            s,
            &mut self.lnf,
            &mut self.lnf_mean,
            &mut self.lnf_rstd,
            held(&self.resid, cfg.n_layer)?,
            &p.view(lw)?,
            &p.view(lb)?,
            mine,
            c,
        )?;
        let lnf = match &mut self.group {
            Some(g) if g.seq.is_some() => {
                g.gather(&self.lnf, c, s, "head forward: gathering rows")?;
                g.gathered()?
            }
            _ => &self.lnf,
        };
        self.blas.gemm_rm(
            s,
            &mut self.logits,
            lnf,
            false,
            &p.view(wte)?,
            true,
            n,
            v,
            c,
            false,
        )?;
        let scale = self.batch.loss_scale(grad) * self.loss_weight;
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
            Some(Group { comm, mx, sums, .. }) => {
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
        let (n, rows) = (self.b * self.t, self.rows());
        let shards = self.layout.shard.size;
        let (s, k) = (&self.stream, &self.kernels);
        let wte = self.range("wte.weight");
        let (lw, lb) = (self.range("ln_f.weight"), self.range("ln_f.bias"));
        let group = &mut self.group;
        let sp = sequence(group);
        // Head: dlnf = dlogits · wte ; dwte += dlogitsᵀ · lnf.
        self.blas.gemm_rm(
            s,
            &mut self.d[DLN],
            &self.logits,
            false,
            &p.view(wte.clone())?,
            false,
            n,
            c,
            v,
            false,
        )?;
        // Under sequence parallelism the LayerNorm's output of every row,
        // gathered again.
        let lnf = match group {
            Some(grp) if sp => {
                grp.gather(&self.lnf, c, s, "head backward: gathering rows")?;
                grp.gathered()?
            }
            _ => &self.lnf,
        };
        self.blas.gemm_rm(
            s,
            &mut g.view_mut(wte.clone())?,
            &self.logits,
            true,
            lnf,
            false,
            v,
            c,
            n,
            true,
        )?;
        // Each rank's share of the vocabulary's gradient, summed (into this
        // rank's rows under sequence parallelism).
        let dlnf = match group {
            Some(grp) if sp => grp.scatter(&mut self.d[DLN], c, s, "head backward")?,
            _ => {
                Self::sum_over_group(group, shards, &mut self.d[DLN], s, "head backward")?;
                0..n * c
            }
        };
        let [dresid, _, dln, ..] = &mut self.d;
        zero_async(dresid, s)?;
        match group {
            Some(grp) if sp => {
                let ng = &mut grp.seq.as_mut().ok_or_else(no_rows)?.norm_grads;
                zero_async(ng, s)?;
                let [mut gw, mut gb] = ng.views_mut_n([0..c, c..2 * c]);
                k.layernorm_backward(
                    s,
                    dresid,
                    &mut gw,
                    &mut gb,
                    &dln.view(dlnf),
                    held(&self.resid, cfg.n_layer)?,
                    &p.view(lw.clone())?,
                    &self.lnf_mean,
                    &self.lnf_rstd,
                    rows,
                    c,
                )?;
                grp.add_norm_grads(k, g, &[lw, lb], s, "head backward: LayerNorm gradients")?;
            }
            _ => {
                let [mut gw, mut gb] = g.views_mut_n([lw.clone(), lb])?;
                k.layernorm_backward(
                    s,
                    dresid,
                    &mut gw,
                    &mut gb,
                    &*dln,
                    held(&self.resid, cfg.n_layer)?,
                    &p.view(lw)?,
                    &self.lnf_mean,
                    &self.lnf_rstd,
                    n,
                    c,
                )?;
            }
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
        let rows = self.rows();
        crate::block::backward(&mut F32Backward {
            env: BlockEnv {
                s: &self.stream,
                k: &self.kernels,
                blas: &mut self.blas,
                group: &mut self.group,
                shards: self.layout.shard.size,
                r: held(&self.ranges, l)?,
                p,
                w: self.widths,
                b: self.b,
                t: self.t,
                rows,
            },
            g,
            x: held(&self.resid, l)?,
            a: held_mut(&mut self.layers, l)?,
            d: &mut self.d,
        })
    }

    /// A column-split product's input gradient in `dln` (whole rows),
    /// summed over the group: all-reduced, or reduce-scattered into this
    /// rank's rows under sequence parallelism. Returns the elements of
    /// `dln` that hold this rank's rows.
    fn sum_input_grad(
        group: &Option<Group>,
        shards: usize,
        dln: &mut DeviceBuffer<f32>,
        c: usize,
        s: &Stream,
        what: &str,
    ) -> Result<Range<usize>> {
        match group {
            Some(grp) if grp.seq.is_some() => grp.scatter(dln, c, s, what),
            _ => {
                Self::sum_over_group(group, shards, dln, s, what)?;
                Ok(0..dln.len())
            }
        }
    }

    /// A block's LayerNorm backward over this rank's `rows`: the input's
    /// gradient added into `d.0` from the output's `d.1`; the weight and
    /// bias gradients into the gradient buffer at `norm.1`, or under
    /// sequence parallelism (`seq`) into the group's LayerNorm scratch at
    /// slot `norm.2` (summed over the group at the end of the block).
    #[allow(clippy::too_many_arguments)]
    fn layernorm_backward_of(
        k: &Kernels,
        s: &Stream,
        seq: Option<&mut Group>,
        g: &mut DeviceWindow<'_, f32>,
        d: (&mut DeviceBuffer<f32>, &DeviceView<'_, f32>),
        saved: (&DeviceBuffer<f32>, &DeviceBuffer<f32>, &DeviceBuffer<f32>),
        norm: (DeviceView<'_, f32>, [Range<usize>; 2], usize),
        rows: usize,
        c: usize,
    ) -> Result<()> {
        let (x, mean, rstd) = saved;
        let (w, [rw, rb], slot) = norm;
        let [mut gw, mut gb] = match seq {
            Some(grp) => {
                let ng = &mut grp.seq.as_mut().ok_or_else(no_rows)?.norm_grads;
                ng.views_mut_n([slot * c..(slot + 1) * c, (slot + 1) * c..(slot + 2) * c])
            }
            None => g.views_mut_n([rw, rb])?,
        };
        k.layernorm_backward(s, d.0, &mut gw, &mut gb, d.1, x, &w, mean, rstd, rows, c)
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
                &self.d[DRESID],
                t,
                c,
            );
        }
        // Every rank's position embedding whole, its vocabulary rows', from
        // every row's gradient (gathered under sequence parallelism).
        let rows = self.vocab_rows();
        let dout = match &mut self.group {
            Some(grp) if grp.seq.is_some() => {
                grp.gather(
                    &self.d[DRESID],
                    c,
                    &self.stream,
                    "embedding backward: gathering rows",
                )?;
                grp.gathered()?
            }
            _ => &self.d[DRESID],
        };
        self.batch.embedding_backward_rows(
            &self.kernels,
            &self.stream,
            &mut gte,
            &mut gpe,
            dout,
            t,
            c,
            rows,
        )
    }
}
