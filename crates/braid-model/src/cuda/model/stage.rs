//! A pipeline stage's passes of the f32 [`GpuGpt`], one micro-batch at a
//! time with several in flight, as `model_mixed/stage.rs` does for the
//! bf16 model: what a forward pass keeps for its backward pass (each held
//! layer's activations, the residual streams, the batch, the head's
//! output) is an [`F32MicroSaved`], swapped into the model for each pass
//! of its micro-batch ([`GpuGpt::swap_micro`]); the gradient scratch stays.
//! A stage other than the first starts from its input written into the
//! micro-batch's residual stream; one other than the last starts its
//! backward pass from the gradient of its output, and leaves the gradient
//! of its input in [`GpuGpt::input_grad`]. (Each layer's backward pass
//! computes its own bias gradients here: nothing crosses a stage's edge.)
//! Not with sequence parallelism yet.

use super::block::DRESID;
use super::state::{sequence, GpuGpt, LayerActs};
use crate::cpu::attention::AttnShape;
use crate::cuda::attention::AttnScratch;
use crate::cuda::batch::DeviceBatch;
use crate::cuda::f32_params::F32Params;
use crate::cuda::held::{output_grad, stage_input, stage_output};
use crate::layout::{Layout, Stage};
use crate::model::Widths;
use braid_cuda::memory::copy_async;
use braid_cuda::{CudaError, Device, DeviceBuffer, DeviceWindow, Result, Stream};

/// What one micro-batch's forward pass through a stage keeps for its
/// backward pass (see the module docs of `stage`).
pub struct F32MicroSaved {
    pub(super) layers: Vec<Option<LayerActs>>,
    pub(super) resid: Vec<Option<DeviceBuffer<f32>>>,
    pub(super) batch: DeviceBatch,
    pub(super) lnf: DeviceBuffer<f32>,
    pub(super) lnf_mean: DeviceBuffer<f32>,
    pub(super) lnf_rstd: DeviceBuffer<f32>,
    pub(super) logits: DeviceBuffer<f32>,
    pub(super) losses: DeviceBuffer<f32>,
    /// The gradient of the stage's output (received from the next stage).
    dout: DeviceBuffer<f32>,
}

/// The buffers of micro-batches of `b × t` for the layers of `layout`
/// that `held` says and, with `head`, the head's.
pub(super) fn make(
    device: &Device,
    layout: &Layout,
    (b, t): (usize, usize),
    held: &dyn Fn(usize) -> bool,
    head: bool,
) -> Result<F32MicroSaved> {
    let w = Widths::of(layout);
    let (c, a, f, nh, v) = (layout.config.n_embd, w.attn, w.mlp, w.heads, w.vocab);
    let n = b * t;
    let layers = layout.config.n_layer;
    let z = |k: usize| DeviceBuffer::<f32>::zeros(device, k);
    let mut acts = Vec::with_capacity(layers);
    for l in 0..layers {
        if !held(l) {
            acts.push(None);
            continue;
        }
        // Allocated in the block's order.
        let (ln1, ln1_mean, ln1_rstd) = (z(n * c)?, z(n)?, z(n)?);
        let (qkv, atty) = (z(n * 3 * a)?, z(n * a)?);
        let attn = AttnScratch::new(device, AttnShape { b, t, c: a, nh })?;
        let (resid2, ln2, ln2_mean, ln2_rstd) = (z(n * c)?, z(n * c)?, z(n)?, z(n)?);
        let (fch, fch_gelu) = (z(n * f)?, z(n * f)?);
        acts.push(Some(LayerActs {
            t: [ln1, qkv, atty, resid2, ln2, fch, fch_gelu],
            mean: [ln1_mean, ln2_mean],
            rstd: [ln1_rstd, ln2_rstd],
            attn,
        }));
    }
    // A layer's input and output streams.
    let stream_at = |j: usize| (j < layers && held(j)) || (j > 0 && held(j - 1));
    let resid = (0..=layers)
        .map(|j| stream_at(j).then(|| z(n * c)).transpose())
        .collect::<Result<_>>()?;
    // The head's buffers only where it runs.
    let (hn, hc) = if head { (n, n * c) } else { (1, 1) };
    Ok(F32MicroSaved {
        layers: acts,
        resid,
        // Tokens and targets are whole-vocabulary ids.
        batch: DeviceBatch::new(device, n, layout.config.vocab_size)?,
        lnf: z(hc)?,
        lnf_mean: z(hn)?,
        lnf_rstd: z(hn)?,
        logits: z(if head { n * v } else { 1 })?,
        losses: z(hn)?,
        dout: z(if head { 1 } else { n * c })?,
    })
}

impl F32MicroSaved {
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

impl GpuGpt {
    /// Buffers for one micro-batch in flight through stage `st` (one of
    /// the layout's).
    pub fn micro_saved(&self, st: &Stage) -> Result<F32MicroSaved> {
        self.held_stage(st)?;
        let held = |l: usize| st.layers.contains(&l);
        make(
            self.stream.device(),
            &self.layout,
            (self.b, self.t),
            &held,
            st.last,
        )
    }

    /// Buffers for no micro-batch (to park in the model while none is
    /// swapped in: the memory of its own set goes back).
    pub fn no_micro_saved(&self) -> Result<F32MicroSaved> {
        make(
            self.stream.device(),
            &self.layout,
            (self.b, self.t),
            &|_| false,
            false,
        )
    }

    /// Multiplies the loss's gradient by `w` from the next forward pass on
    /// (`1 / M` where `M` micro-batches' gradients add up to a step's).
    pub fn set_loss_weight(&mut self, w: f32) {
        self.loss_weight = w;
    }

    /// Swaps `m` with what the model holds: the micro-batch's buffers in,
    /// the previous ones out.
    pub fn swap_micro(&mut self, m: &mut F32MicroSaved) {
        use std::mem::swap;
        swap(&mut self.layers, &mut m.layers);
        swap(&mut self.resid, &mut m.resid);
        swap(&mut self.batch, &mut m.batch);
        swap(&mut self.lnf, &mut m.lnf);
        swap(&mut self.lnf_mean, &mut m.lnf_mean);
        swap(&mut self.lnf_rstd, &mut m.lnf_rstd);
        swap(&mut self.logits, &mut m.logits);
        swap(&mut self.losses, &mut m.losses);
    }

    /// Refuses a stage the layout does not hold, and sequence parallelism
    /// (its row slices are not built for stages).
    fn held_stage(&self, st: &Stage) -> Result<()> {
        if sequence(&self.group) {
            return Err(CudaError::Invalid(
                "pipeline stages of the f32 GPU model with sequence parallelism: not built yet \
                 (add --no-sp)"
                    .into(),
            ));
        }
        self.layout.check_stage(st).map_err(CudaError::Invalid)
    }

    /// Stage `st`'s forward pass of the micro-batch swapped in (its input
    /// written there unless `st` is the first stage): the loss on the last
    /// stage (waits for it), `None` elsewhere (queued).
    pub fn stage_forward<'p>(
        &mut self,
        st: &Stage,
        p: impl Into<F32Params<'p>>,
        tokens: &[u32],
        targets: &[u32],
        grad: bool,
    ) -> Result<Option<f32>> {
        let p = p.into();
        self.held_stage(st)?;
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
            self.forward_block(l, p)?;
        }
        if !st.last {
            return Ok(None);
        }
        let _t = span(&|| "forward head".into(), &self.stream);
        self.forward_head(p, grad).map(Some)
    }

    /// Stage `st`'s backward pass of the micro-batch swapped in, adding
    /// its gradients into `g`: from the loss on the last stage, else from
    /// `dout`'s output gradient. Leaves the gradient of its input in
    /// [`input_grad`](Self::input_grad). Queued; nothing waits.
    pub fn stage_backward<'p>(
        &mut self,
        st: &Stage,
        p: impl Into<F32Params<'p>>,
        dout: &F32MicroSaved,
        g: &mut DeviceWindow<'_, f32>,
    ) -> Result<()> {
        let p = p.into();
        self.held_stage(st)?;
        let span = |name: &dyn Fn() -> String, s: &Stream| {
            braid_trace::scope::start(Some(s), braid_trace::Cat::Compute, name)
        };
        if st.last {
            let _t = span(&|| "backward head".into(), &self.stream);
            self.backward_head(p, g)?;
        } else {
            let d = output_grad(&dout.dout, self.d[DRESID].len(), st)?;
            copy_async(&mut self.d[DRESID], d, &self.stream)?;
        }
        for l in st.layers.clone().rev() {
            let _t = span(&|| format!("backward layer {l}"), &self.stream);
            self.backward_layer(l, p, g)?;
        }
        if st.first {
            let _t = span(&|| "backward embedding".into(), &self.stream);
            self.backward_embedding(g)?;
        }
        Ok(())
    }

    /// The gradient of the input of the stage whose backward pass ran
    /// last (valid until the next backward pass).
    pub fn input_grad(&self) -> &DeviceBuffer<f32> {
        &self.d[DRESID]
    }
}
