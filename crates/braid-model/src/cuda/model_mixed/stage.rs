//! A pipeline stage's passes of [`GpuGptMixed`], one micro-batch at a time
//! with several in flight: what a forward pass keeps for its backward pass
//! (each held layer's saved buffers, the residual streams, the batch and,
//! on the last stage, the head's output and the loss's gradient) is a
//! [`MicroSaved`], swapped into the model for each pass of its
//! micro-batch ([`GpuGptMixed::swap_micro`]); the scratch the passes share
//! stays. A stage other than the first starts from its input written into
//! the micro-batch's residual stream ([`MicroSaved::input_mut`]); one
//! other than the last starts its backward pass from the gradient of its
//! output ([`MicroSaved::output_grad_mut`]) and computes its top layer's
//! output-projection bias gradient from it (the head's LayerNorm backward
//! does that on the last stage). The backward pass of a stage's lowest
//! layer leaves the gradient of the stage's input in
//! [`GpuGptMixed::input_grad`] and no bias gradient for the layer below
//! (another stage's). Under sequence parallelism a stage's input, output
//! and their gradients are the rank's rows of the residual stream: what
//! goes between stages shrinks with the tensor group. Where the schedule splits backward passes (ZB-H1)
//! a micro-batch's buffers also keep each layer's output gradients: the
//! input half defers the weight gradients, and the weight half
//! ([`GpuGptMixed::stage_backward_weights`]) runs them later, with the
//! micro-batch's buffers swapped in again.

use super::pass::Pass;
use super::seq;
use super::state::{BlockActs, DeferredDy, GpuGptMixed, LayerSaved};
use crate::cpu::attention::AttnShape;
use crate::cuda::batch::DeviceBatch;
use crate::cuda::f32_params::F32Params;
use crate::cuda::held::{output_grad, stage_input, stage_output};
use crate::cuda::mixed_attention::{AttnPath, AttnSaved};
use crate::layout::Layout;
use crate::layout::Stage;
use crate::model::Widths;
use braid_cuda::memory::{copy_async, zero_async};
use braid_cuda::{CudaError, Device, DeviceBuffer, DevicePool, DeviceWindow, Result, Stream};
use half::bf16;

/// How the per-micro-batch buffers of a model are shaped.
#[derive(Clone, Copy)]
pub(super) struct MicroPlan {
    pub(super) checkpointing: bool,
    /// How many layers, the last ones, keep the attention's state.
    pub(super) kept_attention: usize,
    /// The layers keep no attention output: the recomputation writes it
    /// into the model's `work` buffers ([`MixedOptions::recompute_attention_output`]).
    ///
    /// [`MixedOptions::recompute_attention_output`]: crate::cuda::model_mixed::MixedOptions::recompute_attention_output
    pub(super) shared_atty: bool,
    pub(super) fused: bool,
    pub(super) shape: AttnShape,
    pub(super) path: AttnPath,
    /// The residual width and the MLP's.
    pub(super) c: usize,
    pub(super) f: usize,
    /// The classifier's padded vocabulary.
    pub(super) vp: usize,
    /// The rows of the residual stream and the LayerNorms' statistics:
    /// the batch's, or a sequence-parallel rank's slice.
    pub(super) rows: usize,
}

/// What one micro-batch's forward pass through a stage keeps for its
/// backward pass (see the module docs of `stage`).
pub struct MicroSaved {
    pub(super) layers: Vec<Option<LayerSaved>>,
    pub(super) resid: Vec<Option<DeviceBuffer<f32>>>,
    pub(super) batch: DeviceBatch,
    pub(super) lnf: DeviceBuffer<bf16>,
    pub(super) lnf_mean: DeviceBuffer<f32>,
    pub(super) lnf_rstd: DeviceBuffer<f32>,
    pub(super) logits: DeviceBuffer<bf16>,
    pub(super) losses: DeviceBuffer<f32>,
    /// Per layer, where the stage's backward pass is split: the output
    /// gradients kept for the weight half ([`GpuGptMixed::stage_backward_weights`]).
    pub(super) deferred: Vec<Option<DeferredDy>>,
    /// The gradient of the stage's output (received from the next stage).
    dout: DeviceBuffer<f32>,
}

impl MicroPlan {
    /// The buffers for the layers `held` says and, with `head`, the head's;
    /// with `split`, what the layers' weight halves read later.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn make(
        &self,
        device: &Device,
        p: &DevicePool,
        s: &Stream,
        layout: &Layout,
        held: &dyn Fn(usize) -> bool,
        head: bool,
        split: bool,
    ) -> Result<MicroSaved> {
        let MicroPlan {
            checkpointing,
            kept_attention,
            shared_atty,
            fused,
            shape,
            path,
            c,
            f,
            vp,
            rows,
        } = *self;
        let (b, t, nh, a) = (shape.b, shape.t, shape.nh, shape.c);
        let n = b * t;
        let layers = layout.config.n_layer;
        let mut saved = Vec::with_capacity(layers);
        let keeps =
            |l| checkpointing && crate::footprint::keeps_attention(l, layers, kept_attention);
        // A layer split for a later weight half reads its attention
        // output there.
        let own_atty = !shared_atty || split;
        for l in 0..layers {
            if !held(l) {
                saved.push(None);
                continue;
            }
            saved.push(Some(LayerSaved {
                ln1_mean: p.zeros(rows, s)?,
                ln1_rstd: p.zeros(rows, s)?,
                ln2_mean: p.zeros(rows, s)?,
                ln2_rstd: p.zeros(rows, s)?,
                atty: own_atty.then(|| p.zeros(n * a, s)).transpose()?,
                acts: match checkpointing {
                    false => Some(BlockActs::new(
                        p,
                        s,
                        shape,
                        path,
                        true,
                        false,
                        (c, f),
                        rows,
                    )?),
                    true => None,
                },
                lse: match checkpointing && fused && !keeps(l) && own_atty {
                    true => Some(p.zeros(b * nh * t, s)?),
                    false => None,
                },
                attn: match keeps(l) {
                    true => Some(AttnSaved::new(p, s, shape, path)?),
                    false => None,
                },
            }));
        }
        // A layer's input and output streams.
        let stream_at = |j: usize| (j < layers && held(j)) || (j > 0 && held(j - 1));
        let resid = (0..=layers)
            .map(|j| stream_at(j).then(|| p.zeros(rows * c, s)).transpose())
            .collect::<Result<_>>()?;
        // The head's buffers only where it runs (its LayerNorm's output
        // and the losses over every row, its statistics over the rows of
        // the residual stream).
        let (hn, hr, hc) = if head { (n, rows, n * c) } else { (1, 1, 1) };
        Ok(MicroSaved {
            layers: saved,
            resid,
            // Tokens and targets are whole-vocabulary ids.
            batch: DeviceBatch::new(device, n, layout.config.vocab_size)?,
            lnf: p.zeros(hc, s)?,
            lnf_mean: p.zeros(hr, s)?,
            lnf_rstd: p.zeros(hr, s)?,
            logits: p.zeros(if head { n * vp } else { 1 }, s)?,
            losses: p.zeros(hn, s)?,
            deferred: (0..layers)
                .map(|l| {
                    (split && held(l))
                        .then(|| DeferredDy::new(p, s, n, Widths::of(layout)))
                        .transpose()
                })
                .collect::<Result<_>>()?,
            // (Over the rows of the residual stream, as the stage's input
            // and output: a sequence-parallel rank's sends and receives
            // carry its rows alone.)
            dout: p.zeros(if head { 1 } else { rows * c }, s)?,
        })
    }
}

impl MicroSaved {
    /// Where the stage's input goes (a stage other than the first, before
    /// its forward pass).
    pub fn input_mut(&mut self, st: &Stage) -> Result<&mut DeviceBuffer<f32>> {
        stage_input(&mut self.resid, st)
    }

    /// The stage's output (after its forward pass).
    pub fn output(&self, st: &Stage) -> Result<&DeviceBuffer<f32>> {
        stage_output(&self.resid, st)
    }

    /// Where the gradient of the stage's output goes (a stage other than
    /// the last, before its backward pass).
    pub fn output_grad_mut(&mut self) -> &mut DeviceBuffer<f32> {
        &mut self.dout
    }
}

impl GpuGptMixed {
    /// Buffers for one micro-batch in flight through stage `st` (one of
    /// the layout's); with `split`, for a backward pass in two halves
    /// ([`stage_backward_weights`](Self::stage_backward_weights)).
    pub fn micro_saved(&self, st: &Stage, split: bool) -> Result<MicroSaved> {
        self.held_stage(st)?;
        let held = |l: usize| st.layers.contains(&l);
        self.plan.make(
            &self.device,
            &self.pool,
            &self.stream,
            &self.layout,
            &held,
            st.last,
            split,
        )
    }

    /// Buffers for no micro-batch (to park in the model while none is
    /// swapped in: the memory of its own set goes back).
    pub fn no_micro_saved(&self) -> Result<MicroSaved> {
        self.plan.make(
            &self.device,
            &self.pool,
            &self.stream,
            &self.layout,
            &|_| false,
            false,
            false,
        )
    }

    /// Multiplies the loss's gradient by `w` from the next forward pass on
    /// (`1 / M` where `M` micro-batches' gradients add up to a step's).
    pub fn set_loss_weight(&mut self, w: f32) {
        self.loss_weight = w;
    }

    /// Swaps `m` with what the model holds: the micro-batch's buffers in,
    /// the previous ones out (`m` then holds them).
    pub fn swap_micro(&mut self, m: &mut MicroSaved) {
        use std::mem::swap;
        swap(&mut self.layers, &mut m.layers);
        swap(&mut self.resid, &mut m.resid);
        swap(&mut self.batch, &mut m.batch);
        swap(&mut self.lnf, &mut m.lnf);
        swap(&mut self.lnf_mean, &mut m.lnf_mean);
        swap(&mut self.lnf_rstd, &mut m.lnf_rstd);
        swap(&mut self.logits, &mut m.logits);
        swap(&mut self.losses, &mut m.losses);
        swap(&mut self.deferred, &mut m.deferred);
    }

    /// Refuses a stage the layout does not hold.
    fn held_stage(&self, st: &Stage) -> Result<()> {
        self.layout.check_stage(st).map_err(CudaError::Invalid)
    }

    /// Stage `st`'s forward pass of the micro-batch swapped in (its input
    /// written there unless `st` is the first stage): the loss on the last
    /// stage (waits for it), `None` elsewhere (queued). `tokens` are read
    /// on the first stage, `targets` on the last.
    pub fn stage_forward<'p>(
        &mut self,
        st: &Stage,
        p: impl Into<F32Params<'p>>,
        pb: Option<&DeviceBuffer<bf16>>,
        tokens: &[u32],
        targets: &[u32],
        grad: bool,
    ) -> Result<Option<f32>> {
        let p = p.into();
        self.held_stage(st)?;
        self.check_params(p, pb)?;
        self.forward_begin(tokens, targets)?;
        let span = |name: &dyn Fn() -> String, s: &Stream| {
            braid_trace::scope::start(Some(s), braid_trace::Cat::Compute, name)
        };
        if st.first {
            let _t = span(&|| "forward embedding".into(), &self.stream);
            self.forward_encoder(p)?;
        }
        for l in st.layers.clone() {
            let _t = span(&|| format!("forward layer {l}"), &self.stream);
            self.forward_layer(l, p, pb, Pass::Forward)?;
        }
        if !st.last {
            return Ok(None);
        }
        let _t = span(&|| "forward head".into(), &self.stream);
        self.forward_head(p, pb, grad).map(Some)
    }

    /// Stage `st`'s backward pass of the micro-batch swapped in, adding
    /// its gradients into `g`: from the loss on the last stage, else from
    /// `dout` (the gradient of its output). Leaves the gradient of its
    /// input in [`input_grad`](Self::input_grad) (the first stage: the
    /// embeddings' gradients instead). Queued; nothing waits.
    pub fn stage_backward<'p>(
        &mut self,
        st: &Stage,
        p: impl Into<F32Params<'p>>,
        pb: Option<&DeviceBuffer<bf16>>,
        dout: &MicroSaved,
        g: &mut DeviceWindow<'_, f32>,
    ) -> Result<()> {
        let p = p.into();
        self.held_stage(st)?;
        self.check_params(p, pb)?;
        let span = |name: &dyn Fn() -> String, s: &Stream| {
            braid_trace::scope::start(Some(s), braid_trace::Cat::Compute, name)
        };
        if st.last {
            let _t = span(&|| "backward head".into(), &self.stream);
            self.backward_head(p, pb, g)?;
        } else {
            self.backward_from_output(st, &dout.dout, g)?;
        }
        self.bottom = st.layers.start;
        let run = st.layers.clone().rev().try_for_each(|l| {
            let _t = span(&|| format!("backward layer {l}"), &self.stream);
            self.backward_layer(l, p, pb, g)
        });
        self.bottom = 0;
        run?;
        if st.first {
            let _t = span(&|| "backward embedding".into(), &self.stream);
            self.backward_embedding(g)?;
        }
        Ok(())
    }

    /// The weight half of stage `st`'s backward pass of the micro-batch
    /// swapped in, after [`stage_backward`](Self::stage_backward) ran its
    /// input half (its buffers were made with `split`): every layer's
    /// weight gradients into `g`. Queued; nothing waits.
    pub fn stage_backward_weights(
        &mut self,
        st: &Stage,
        g: &mut DeviceWindow<'_, f32>,
    ) -> Result<()> {
        self.held_stage(st)?;
        for l in st.layers.clone().rev() {
            let _t =
                braid_trace::scope::start(Some(&self.stream), braid_trace::Cat::Compute, || {
                    format!("backward layer {l} weights")
                });
            self.backward_layer_weights(l, g)?;
        }
        Ok(())
    }

    /// A stage other than the last: its backward pass starts from the
    /// gradient of its output, `dout` (the residual stream's gradient, in
    /// f32 and bf16), whose column sums are its top layer's
    /// output-projection bias gradient. Under sequence parallelism `dout`
    /// holds this rank's rows: the bf16 copy is gathered for the products,
    /// and the bias gradient of those rows summed over the group.
    fn backward_from_output(
        &mut self,
        st: &Stage,
        dout: &DeviceBuffer<f32>,
        g: &mut DeviceWindow<'_, f32>,
    ) -> Result<()> {
        let c = self.layout.config.n_embd;
        let n = self.b * self.t;
        let (nl, mine) = seq::local(&self.seq, n, c);
        let dout = output_grad(dout, nl * c, st)?;
        if self.backward_sms > 0 {
            self.blas.set_sm_count_target(self.backward_sms)?;
        }
        self.fresh.backward_starts();
        let top = st.layers.end - 1;
        let bias = self.ranges[top]
            .as_ref()
            .ok_or_else(|| crate::cuda::held::not_held(top))?
            .fcproj_b
            .clone();
        let s = &self.stream;
        copy_async(&mut self.dresid.view_mut(mine.clone()), dout, s)?;
        self.mk.to_bf16(
            s,
            &mut self.dresid_bf.view_mut(mine.clone()),
            &self.dresid.view(mine.clone()),
        )?;
        let what = "stage output gradient";
        seq::gather(&self.group, &self.seq, &mut self.dresid_bf, n * c, s, what)?;
        let rows = self.dresid.view(mine);
        match &mut self.seq {
            None => {
                let mut into = g.view_mut(bias)?;
                self.mk
                    .bias_backward_f32(s, &mut into, &mut self.partial, &rows, nl, c)
            }
            Some(q) => {
                zero_async(&mut q.norm_grads, s)?;
                let mut into = q.norm_grads.view_mut(0..c);
                self.mk
                    .bias_backward_f32(s, &mut into, &mut self.partial, &rows, nl, c)?;
                seq::add_norm_grads(&self.group, q, &self.kernels, g, &[bias], c, s, what)
            }
        }
    }

    /// The gradient of the input of the stage whose backward pass ran
    /// last (valid until the next backward pass): this rank's rows under
    /// sequence parallelism.
    pub fn input_grad(&self) -> braid_cuda::DeviceView<'_, f32> {
        let c = self.layout.config.n_embd;
        let (_, mine) = seq::local(&self.seq, self.b * self.t, c);
        self.dresid.view(mine)
    }
}
