//! The engine's model behind one face for the stage passes:
//! [`StageModel`] (the model with the parameters its passes read) and
//! [`Saved`] (a micro-batch's buffers of that model's form).

use super::err::e;
use crate::Result;
use braid_cuda::DeviceWindow;
use braid_model::cuda::f32_params::F32Params;
use braid_model::cuda::gpu_model::{GpuModel, StageBuffers};
use braid_model::Stage;

/// A micro-batch's saved buffers, of the model's form.
pub(super) type Saved = Box<dyn StageBuffers>;

/// The engine's model with the parameters its passes read
/// ([`GpuGpt::stage_model`]): the stage passes the executor runs.
///
/// [`GpuGpt::stage_model`]: super::super::GpuGpt::stage_model
pub(crate) struct StageModel<'a> {
    pub(crate) model: &'a mut dyn GpuModel,
    pub(crate) p: F32Params<'a>,
}

impl StageModel<'_> {
    pub(super) fn micro_saved(&self, st: &Stage, split: bool) -> Result<Saved> {
        self.model.micro_saved(st, split).map_err(e)
    }

    pub(super) fn no_micro_saved(&self) -> Result<Saved> {
        self.model.no_micro_saved().map_err(e)
    }

    pub(super) fn set_loss_weight(&mut self, w: f32) {
        self.model.set_loss_weight(w)
    }

    /// Swaps `set` with the buffers the model holds.
    pub(super) fn swap(&mut self, set: &mut Saved) -> Result<()> {
        self.model.swap_micro(&mut **set).map_err(e)
    }

    pub(super) fn forward(
        &mut self,
        st: &Stage,
        tokens: &[u32],
        targets: &[u32],
        grad: bool,
    ) -> Result<Option<f32>> {
        self.model
            .stage_forward(st, self.p, tokens, targets, grad)
            .map_err(e)
    }

    pub(super) fn backward(
        &mut self,
        st: &Stage,
        set: &Saved,
        g: &mut DeviceWindow<'_, f32>,
    ) -> Result<()> {
        self.model.stage_backward(st, self.p, &**set, g).map_err(e)
    }

    /// Whether the model splits a stage's backward pass into input and
    /// weight halves (the bf16 model's).
    pub(super) fn splits_backward(&self) -> bool {
        self.model.splits_stage_backward()
    }

    /// The weight half of a split backward pass (nothing where the model
    /// does not split it).
    pub(super) fn backward_weights(
        &mut self,
        st: &Stage,
        g: &mut DeviceWindow<'_, f32>,
    ) -> Result<()> {
        self.model.stage_backward_weights(st, g).map_err(e)
    }

    pub(super) fn input_grad(&self) -> braid_cuda::DeviceView<'_, f32> {
        self.model.input_grad()
    }
}
