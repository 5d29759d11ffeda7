//! The f32 model ([`GpuGpt`]) as a [`GpuModel`]: no bf16 weights, no
//! deferred or split passes, no saved buffers to lend out.

use super::face::{other_form, stage_buffers, BackwardPart, GpuModel, StageBuffers};
use crate::cuda::f32_params::F32Params;
use crate::cuda::kernels::Kernels;
use crate::cuda::model::{F32MicroSaved, GpuGpt};
use crate::cuda::model_mixed::SavedFor;
use crate::layout::Stage;
use crate::tensor_comm::DeviceTensorComm;
use braid_cuda::memory::zero_async;
use braid_cuda::{CudaError, DeviceBuffer, DeviceView, DeviceWindow, Result, Stream};
use half::bf16;
use std::ops::Range;
use std::sync::Arc;

stage_buffers!(F32MicroSaved);

impl GpuModel for GpuGpt {
    fn kernels(&self) -> &Kernels {
        GpuGpt::kernels(self)
    }

    fn stream(&self) -> &Stream {
        GpuGpt::stream(self)
    }

    fn weights_bf16(&self) -> Option<&DeviceBuffer<bf16>> {
        None
    }

    fn stream_and_weights_bf16(&mut self) -> (&Stream, Option<&mut DeviceBuffer<bf16>>) {
        (GpuGpt::stream(self), None)
    }

    fn streams_weights(&self) -> bool {
        false
    }

    fn carries_bias_grads(&self) -> bool {
        false
    }

    fn defer_weight_grads(&mut self, layers: usize) -> Result<()> {
        match layers {
            0 => Ok(()),
            _ => Err(CudaError::Invalid(
                "only the bf16 engine defers weight gradients".into(),
            )),
        }
    }

    fn overlap_tensor_sums(&mut self, _blocks: usize) {}

    fn sum_input_grads_beside_weight_grads(&mut self, _on: bool) {}

    fn sum_tensor_products_in_bf16(&mut self, _on: bool) {}

    fn tensor_parallel(
        self: Box<Self>,
        comm: Arc<dyn DeviceTensorComm>,
        sequence: bool,
    ) -> Result<Box<dyn GpuModel>> {
        Ok(Box::new(GpuGpt::tensor_parallel(*self, comm, sequence)?))
    }

    fn begin_grads(&mut self, g: &mut DeviceBuffer<f32>, _by_unit: bool) -> Result<()> {
        zero_async(g, GpuGpt::stream(self))
    }

    fn begin_block_grads(&mut self, _: Range<usize>, g: &mut DeviceBuffer<f32>) -> Result<()> {
        zero_async(g, GpuGpt::stream(self))
    }

    fn zero_unit_grads(
        &mut self,
        runs: &[Range<usize>],
        _: &mut DeviceWindow<'_, f32>,
    ) -> Result<()> {
        match runs.is_empty() {
            true => Ok(()),
            // begin_grads zeroed the whole buffer already.
            false => Err(CudaError::Invalid(
                "the f32 model zeroes its gradients whole, not unit by unit".into(),
            )),
        }
    }

    fn forward(
        &mut self,
        p: F32Params<'_>,
        tokens: &[u32],
        targets: &[u32],
        grad: bool,
    ) -> Result<f32> {
        GpuGpt::forward(self, p, tokens, targets, grad)
    }

    fn forward_begin(&mut self, tokens: &[u32], targets: &[u32]) -> Result<()> {
        GpuGpt::forward_begin(self, tokens, targets)
    }

    fn forward_encoder(&mut self, p: F32Params<'_>) -> Result<()> {
        GpuGpt::forward_encoder(self, p)
    }

    fn forward_block(&mut self, l: usize, p: F32Params<'_>) -> Result<()> {
        GpuGpt::forward_block(self, l, p)
    }

    fn forward_head(&mut self, p: F32Params<'_>, grad: bool) -> Result<f32> {
        GpuGpt::forward_head(self, p, grad)
    }

    fn backward_part(
        &mut self,
        part: BackwardPart,
        p: F32Params<'_>,
        g: &mut DeviceWindow<'_, f32>,
    ) -> Result<()> {
        match part {
            BackwardPart::Head => self.backward_head(p, g),
            BackwardPart::Layer(l) => self.backward_layer(l, p, g),
            BackwardPart::Embedding => self.backward_embedding(g),
            other => Err(CudaError::Invalid(format!(
                "the f32 model has no backward part {other:?} (it defers no weight gradients)"
            ))),
        }
    }

    fn recomputes(&self) -> bool {
        false
    }

    fn recompute_layer(&mut self, _l: usize, _p: F32Params<'_>) -> Result<bool> {
        Ok(false)
    }

    fn give_layer_weights(&mut self, given: Option<(usize, DeviceBuffer<bf16>)>) -> Result<()> {
        match given {
            None => Ok(()),
            Some(_) => Err(CudaError::Invalid(
                "the f32 model reads its layers in f32: it takes no bf16 weights".into(),
            )),
        }
    }

    fn end_step(&mut self) -> Result<()> {
        Ok(())
    }

    fn saved_buffers(&mut self) -> Vec<(SavedFor, usize)> {
        Vec::new()
    }

    unsafe fn place_saved(&mut self, _: &DeviceBuffer<f32>, at: &[Option<usize>]) -> Result<usize> {
        match at.iter().all(Option::is_none) {
            true => Ok(0),
            false => Err(CudaError::Invalid(
                "the f32 engine places no saved buffers in lent memory".into(),
            )),
        }
    }

    fn drop_saved(&mut self) -> Result<()> {
        Ok(())
    }

    fn own_saved(&mut self) -> Result<()> {
        Ok(())
    }

    fn profile_reset(&mut self) {}

    fn profile_report(&self) -> Option<String> {
        None
    }

    fn micro_saved(&self, st: &Stage, _split: bool) -> Result<Box<dyn StageBuffers>> {
        Ok(Box::new(GpuGpt::micro_saved(self, st)?))
    }

    fn no_micro_saved(&self) -> Result<Box<dyn StageBuffers>> {
        Ok(Box::new(GpuGpt::no_micro_saved(self)?))
    }

    fn set_loss_weight(&mut self, w: f32) {
        GpuGpt::set_loss_weight(self, w)
    }

    fn swap_micro(&mut self, set: &mut dyn StageBuffers) -> Result<()> {
        let set = set.as_any_mut().downcast_mut().ok_or_else(other_form)?;
        GpuGpt::swap_micro(self, set);
        Ok(())
    }

    fn stage_forward(
        &mut self,
        st: &Stage,
        p: F32Params<'_>,
        tokens: &[u32],
        targets: &[u32],
        grad: bool,
    ) -> Result<Option<f32>> {
        GpuGpt::stage_forward(self, st, p, tokens, targets, grad)
    }

    fn stage_backward(
        &mut self,
        st: &Stage,
        p: F32Params<'_>,
        dout: &dyn StageBuffers,
        g: &mut DeviceWindow<'_, f32>,
    ) -> Result<()> {
        let dout = dout.as_any().downcast_ref().ok_or_else(other_form)?;
        GpuGpt::stage_backward(self, st, p, dout, g)
    }

    fn splits_stage_backward(&self) -> bool {
        false
    }

    fn stage_backward_weights(&mut self, _: &Stage, _: &mut DeviceWindow<'_, f32>) -> Result<()> {
        Ok(())
    }

    fn input_grad(&self) -> DeviceView<'_, f32> {
        let g = GpuGpt::input_grad(self);
        g.view(0..g.len())
    }
}
