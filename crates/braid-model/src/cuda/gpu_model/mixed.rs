//! The bf16 mixed-precision model ([`GpuGptMixed`]) as a [`GpuModel`]: its
//! passes read the bf16 copy it keeps (or cast layer by layer when it
//! streams its weights).

use super::face::{other_form, stage_buffers, BackwardPart, GpuModel, StageBuffers};
use crate::cuda::f32_params::F32Params;
use crate::cuda::kernels::Kernels;
use crate::cuda::model_mixed::{GpuGptMixed, MicroSaved, SavedFor};
use crate::layout::Stage;
use crate::tensor_comm::DeviceTensorComm;
use braid_cuda::{CudaError, DeviceBuffer, DeviceView, DeviceWindow, Result, Stream};
use half::bf16;
use std::ops::Range;
use std::sync::Arc;

stage_buffers!(MicroSaved);

impl GpuModel for GpuGptMixed {
    fn kernels(&self) -> &Kernels {
        GpuGptMixed::kernels(self)
    }

    fn stream(&self) -> &Stream {
        GpuGptMixed::stream(self)
    }

    fn weights_bf16(&self) -> Option<&DeviceBuffer<bf16>> {
        GpuGptMixed::weights_bf16(self)
    }

    fn stream_and_weights_bf16(&mut self) -> (&Stream, Option<&mut DeviceBuffer<bf16>>) {
        GpuGptMixed::stream_and_weights_bf16(self)
    }

    fn streams_weights(&self) -> bool {
        GpuGptMixed::weights_bf16(self).is_none()
    }

    fn carries_bias_grads(&self) -> bool {
        true
    }

    fn defer_weight_grads(&mut self, layers: usize) -> Result<()> {
        GpuGptMixed::defer_weight_grads(self, layers)
    }

    fn overlap_tensor_sums(&mut self, blocks: usize) {
        GpuGptMixed::overlap_tensor_sums(self, blocks)
    }

    fn sum_input_grads_beside_weight_grads(&mut self, on: bool) {
        GpuGptMixed::sum_input_grads_beside_weight_grads(self, on)
    }

    fn sum_tensor_products_in_bf16(&mut self, on: bool) {
        GpuGptMixed::sum_tensor_products_in_bf16(self, on)
    }

    fn tensor_parallel(
        self: Box<Self>,
        comm: Arc<dyn DeviceTensorComm>,
        sequence: bool,
    ) -> Result<Box<dyn GpuModel>> {
        // The bf16 model sizes its buffers for its rows when built.
        if sequence != self.sequence_parallel() {
            return Err(CudaError::Invalid(format!(
                "a bf16 model built {} sequence parallelism made a tensor-parallel share {} it \
                 (MixedOptions::sequence_parallel must say what the share runs)",
                if self.sequence_parallel() {
                    "with"
                } else {
                    "without"
                },
                if sequence { "with" } else { "without" },
            )));
        }
        Ok(Box::new(GpuGptMixed::tensor_parallel(*self, comm)?))
    }

    fn begin_grads(&mut self, g: &mut DeviceBuffer<f32>, by_unit: bool) -> Result<()> {
        match by_unit {
            true => {
                self.begin_grads_by_unit();
                Ok(())
            }
            false => GpuGptMixed::begin_grads(self, g),
        }
    }

    fn begin_block_grads(&mut self, block: Range<usize>, g: &mut DeviceBuffer<f32>) -> Result<()> {
        GpuGptMixed::begin_block_grads(self, block, g)
    }

    fn zero_unit_grads(
        &mut self,
        runs: &[Range<usize>],
        g: &mut DeviceWindow<'_, f32>,
    ) -> Result<()> {
        GpuGptMixed::zero_unit_grads(self, runs, g)
    }

    fn forward(
        &mut self,
        p: F32Params<'_>,
        tokens: &[u32],
        targets: &[u32],
        grad: bool,
    ) -> Result<f32> {
        self.with_weights_bf16(|m, pb| m.forward(p, pb, tokens, targets, grad))
    }

    fn forward_begin(&mut self, tokens: &[u32], targets: &[u32]) -> Result<()> {
        GpuGptMixed::forward_begin(self, tokens, targets)
    }

    fn forward_encoder(&mut self, p: F32Params<'_>) -> Result<()> {
        GpuGptMixed::forward_encoder(self, p)
    }

    fn forward_block(&mut self, l: usize, p: F32Params<'_>) -> Result<()> {
        self.with_weights_bf16(|m, pb| m.forward_block(l, p, pb))
    }

    fn forward_head(&mut self, p: F32Params<'_>, grad: bool) -> Result<f32> {
        self.with_weights_bf16(|m, pb| m.forward_head(p, pb, grad))
    }

    fn backward_part(
        &mut self,
        part: BackwardPart,
        p: F32Params<'_>,
        g: &mut DeviceWindow<'_, f32>,
    ) -> Result<()> {
        match part {
            BackwardPart::Head => self.with_weights_bf16(|m, pb| m.backward_head(p, pb, g)),
            BackwardPart::Layer(l) | BackwardPart::LayerInput(l) => {
                self.with_weights_bf16(|m, pb| m.backward_layer(l, p, pb, g))
            }
            BackwardPart::Embedding => self.backward_embedding(g),
            BackwardPart::LayerWeights(l) => self.backward_layer_weights(l, g),
            BackwardPart::LayerWeightsOf(l, w) => self.backward_layer_weights_of(l, w, g),
        }
    }

    fn recomputes(&self) -> bool {
        GpuGptMixed::recomputes(self)
    }

    fn recompute_layer(&mut self, l: usize, p: F32Params<'_>) -> Result<bool> {
        self.with_weights_bf16(|m, pb| m.recompute_layer(l, p, pb))
    }

    fn give_layer_weights(&mut self, given: Option<(usize, DeviceBuffer<bf16>)>) -> Result<()> {
        GpuGptMixed::give_layer_weights(self, given)
    }

    fn end_step(&mut self) -> Result<()> {
        GpuGptMixed::end_step(self)
    }

    fn saved_buffers(&mut self) -> Vec<(SavedFor, usize)> {
        GpuGptMixed::saved_buffers(self)
    }

    unsafe fn place_saved(
        &mut self,
        memory: &DeviceBuffer<f32>,
        at: &[Option<usize>],
    ) -> Result<usize> {
        // SAFETY: the caller's contract, passed on.
        unsafe { GpuGptMixed::place_saved(self, memory, at) }
    }

    fn drop_saved(&mut self) -> Result<()> {
        GpuGptMixed::drop_saved(self)
    }

    fn own_saved(&mut self) -> Result<()> {
        GpuGptMixed::own_saved(self)
    }

    fn profile_reset(&mut self) {
        GpuGptMixed::profile_reset(self)
    }

    fn profile_report(&self) -> Option<String> {
        GpuGptMixed::profile_report(self)
    }

    fn micro_saved(&self, st: &Stage, split: bool) -> Result<Box<dyn StageBuffers>> {
        Ok(Box::new(GpuGptMixed::micro_saved(self, st, split)?))
    }

    fn no_micro_saved(&self) -> Result<Box<dyn StageBuffers>> {
        Ok(Box::new(GpuGptMixed::no_micro_saved(self)?))
    }

    fn set_loss_weight(&mut self, w: f32) {
        GpuGptMixed::set_loss_weight(self, w)
    }

    fn swap_micro(&mut self, set: &mut dyn StageBuffers) -> Result<()> {
        let set = set.as_any_mut().downcast_mut().ok_or_else(other_form)?;
        GpuGptMixed::swap_micro(self, set);
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
        self.with_weights_bf16(|m, pb| m.stage_forward(st, p, pb, tokens, targets, grad))
    }

    fn stage_backward(
        &mut self,
        st: &Stage,
        p: F32Params<'_>,
        dout: &dyn StageBuffers,
        g: &mut DeviceWindow<'_, f32>,
    ) -> Result<()> {
        let dout = dout.as_any().downcast_ref().ok_or_else(other_form)?;
        self.with_weights_bf16(|m, pb| m.stage_backward(st, p, pb, dout, g))
    }

    fn splits_stage_backward(&self) -> bool {
        true
    }

    fn stage_backward_weights(&mut self, st: &Stage, g: &mut DeviceWindow<'_, f32>) -> Result<()> {
        GpuGptMixed::stage_backward_weights(self, st, g)
    }

    fn input_grad(&self) -> DeviceView<'_, f32> {
        GpuGptMixed::input_grad(self)
    }
}
