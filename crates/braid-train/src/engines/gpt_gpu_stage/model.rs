//! Either GPU model form behind one face for the stage passes:
//! [`StageModel`] (the model with the parameters its passes read) and
//! [`Saved`] (a micro-batch's buffers of that form).

use super::err::e;
use crate::Result;
use braid_cuda::{DeviceBuffer, DeviceWindow};
use braid_model::cuda::f32_params::F32Params;
use braid_model::cuda::model::{F32MicroSaved, GpuGpt as GpuGptF32};
use braid_model::cuda::model_mixed::{GpuGptMixed, MicroSaved};
use braid_model::Stage;
use half::bf16;

/// A micro-batch's saved buffers, for either model form.
pub(super) enum Saved {
    Mixed(MicroSaved),
    F32(F32MicroSaved),
}

impl Saved {
    pub(super) fn input_mut(&mut self, st: &Stage) -> braid_cuda::Result<&mut DeviceBuffer<f32>> {
        match self {
            Saved::Mixed(m) => m.input_mut(st),
            Saved::F32(m) => m.input_mut(st),
        }
    }

    pub(super) fn output(&self, st: &Stage) -> braid_cuda::Result<&DeviceBuffer<f32>> {
        match self {
            Saved::Mixed(m) => m.output(st),
            Saved::F32(m) => m.output(st),
        }
    }

    pub(super) fn output_grad_mut(&mut self) -> &mut DeviceBuffer<f32> {
        match self {
            Saved::Mixed(m) => m.output_grad_mut(),
            Saved::F32(m) => m.output_grad_mut(),
        }
    }
}

/// The engine's model, either form, with the parameters its passes read
/// ([`GpuGpt::stage_model`]): the stage passes the executor runs.
pub(crate) enum StageModel<'a> {
    /// The bf16 model, its f32 parameters and their bf16 copy (`None`
    /// with streamed weights).
    Mixed(
        &'a mut GpuGptMixed,
        F32Params<'a>,
        Option<&'a DeviceBuffer<bf16>>,
    ),
    /// The f32 model and its parameters.
    F32(&'a mut GpuGptF32, F32Params<'a>),
}

/// Buffers of one form handed to a model of the other.
fn mismatch() -> String {
    "a micro-batch's buffers of one model form handed to the other (a bug: please report it)".into()
}

impl StageModel<'_> {
    pub(super) fn micro_saved(&self, st: &Stage, split: bool) -> Result<Saved> {
        match self {
            StageModel::Mixed(m, ..) => m.micro_saved(st, split).map(Saved::Mixed),
            StageModel::F32(m, _) => m.micro_saved(st).map(Saved::F32),
        }
        .map_err(e)
    }

    pub(super) fn no_micro_saved(&self) -> Result<Saved> {
        match self {
            StageModel::Mixed(m, ..) => m.no_micro_saved().map(Saved::Mixed),
            StageModel::F32(m, _) => m.no_micro_saved().map(Saved::F32),
        }
        .map_err(e)
    }

    pub(super) fn set_loss_weight(&mut self, w: f32) {
        match self {
            StageModel::Mixed(m, ..) => m.set_loss_weight(w),
            StageModel::F32(m, _) => m.set_loss_weight(w),
        }
    }

    /// Swaps `set` with the buffers the model holds.
    pub(super) fn swap(&mut self, set: &mut Saved) -> Result<()> {
        match (self, set) {
            (StageModel::Mixed(m, ..), Saved::Mixed(s)) => m.swap_micro(s),
            (StageModel::F32(m, _), Saved::F32(s)) => m.swap_micro(s),
            _ => return Err(mismatch()),
        }
        Ok(())
    }

    pub(super) fn forward(
        &mut self,
        st: &Stage,
        tokens: &[u32],
        targets: &[u32],
        grad: bool,
    ) -> Result<Option<f32>> {
        match self {
            StageModel::Mixed(m, pf, pb) => m.stage_forward(st, *pf, *pb, tokens, targets, grad),
            StageModel::F32(m, pf) => m.stage_forward(st, *pf, tokens, targets, grad),
        }
        .map_err(e)
    }

    pub(super) fn backward(
        &mut self,
        st: &Stage,
        set: &Saved,
        g: &mut DeviceWindow<'_, f32>,
    ) -> Result<()> {
        match (self, set) {
            (StageModel::Mixed(m, pf, pb), Saved::Mixed(s)) => {
                m.stage_backward(st, *pf, *pb, s, g).map_err(e)
            }
            (StageModel::F32(m, pf), Saved::F32(s)) => m.stage_backward(st, *pf, s, g).map_err(e),
            _ => Err(mismatch()),
        }
    }

    /// The weight half of a split backward pass (the bf16 model's).
    pub(super) fn backward_weights(
        &mut self,
        st: &Stage,
        g: &mut DeviceWindow<'_, f32>,
    ) -> Result<()> {
        match self {
            StageModel::Mixed(m, ..) => m.stage_backward_weights(st, g).map_err(e),
            StageModel::F32(..) => Ok(()),
        }
    }

    pub(super) fn input_grad(&self) -> braid_cuda::DeviceView<'_, f32> {
        match self {
            StageModel::Mixed(m, ..) => m.input_grad(),
            StageModel::F32(m, _) => {
                let g = m.input_grad();
                g.view(0..g.len())
            }
        }
    }
}
