//! The face itself: [`GpuModel`], the parts of a backward pass
//! ([`BackwardPart`]) and a stage's micro-batch buffers
//! ([`StageBuffers`]).

use crate::cuda::f32_params::F32Params;
use crate::cuda::kernels::Kernels;
use crate::cuda::model_mixed::{SavedFor, WeightGrads};
use crate::layout::Stage;
use crate::tensor_comm::DeviceTensorComm;
use braid_cuda::{DeviceBuffer, DeviceView, DeviceWindow, Result, Stream};
use half::bf16;
use std::any::Any;
use std::ops::Range;
use std::sync::Arc;

/// One backward unit's part of a model's backward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackwardPart {
    /// The head (final norm, classifier, loss).
    Head,
    /// A whole layer.
    Layer(usize),
    /// A layer whose weight gradients come later: its input gradient (and
    /// its biases' and norms' gradients).
    LayerInput(usize),
    /// The embeddings.
    Embedding,
    /// A deferred layer's weight gradients.
    LayerWeights(usize),
    /// Some of a deferred layer's weight gradients.
    LayerWeightsOf(usize, &'static [WeightGrads]),
}

/// One micro-batch's buffers in flight through a pipeline stage, of
/// either model form ([`GpuModel::micro_saved`]).
pub trait StageBuffers: Any {
    /// Where the stage's input goes (a stage other than the first).
    fn input_mut(&mut self, st: &Stage) -> Result<&mut DeviceBuffer<f32>>;
    /// The stage's output (after its forward pass).
    fn output(&self, st: &Stage) -> Result<&DeviceBuffer<f32>>;
    /// Where the gradient of the stage's output goes (a stage other than
    /// the last).
    fn output_grad_mut(&mut self) -> &mut DeviceBuffer<f32>;
    /// Itself, to be taken back as its own type by its model.
    fn as_any(&self) -> &dyn Any;
    /// Itself, to be taken back as its own type by its model.
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

/// A GPT model on one GPU (or one tensor-parallel rank's share of it):
/// its passes over the flat f32 parameters `p` the engine holds (whole,
/// by blocks, or packed: [`F32Params`]) into gradient windows, queued on
/// its stream.
pub trait GpuModel {
    /// The f32 kernels (norms, sums of squares).
    fn kernels(&self) -> &Kernels;
    /// The stream every pass is queued on.
    fn stream(&self) -> &Stream;

    /// The whole bf16 copy of the parameters the products read, when the
    /// model keeps one (the bf16 model unless it streams its weights; the
    /// f32 model never). The optimizer writes it beside the f32 update.
    fn weights_bf16(&self) -> Option<&DeviceBuffer<bf16>>;
    /// The model's stream and its bf16 copy (if it keeps one) to be
    /// written there: by the optimizer beside the f32 update, or a refresh
    /// from the f32 parameters.
    fn stream_and_weights_bf16(&mut self) -> (&Stream, Option<&mut DeviceBuffer<bf16>>);
    /// Whether the model casts its bf16 weights layer by layer as it runs
    /// (bf16 without a whole copy): its head's backward pass then reads
    /// the embeddings its forward pass cast, and ZeRO-3 may hand it layers
    /// already in bf16 ([`GpuModel::give_layer_weights`]).
    fn streams_weights(&self) -> bool;
    /// Whether a layer's backward pass also computes the bias gradient of
    /// the layer below's output projection (the bf16 model's fused
    /// LayerNorm backward), which a unit-by-unit engine carries down.
    fn carries_bias_grads(&self) -> bool;

    /// Defers the weight gradients of the first `layers` layers until
    /// after the embeddings' backward pass (the f32 model: only 0).
    fn defer_weight_grads(&mut self, layers: usize) -> Result<()>;
    /// Runs row-split products in `blocks` row blocks, each block's sum
    /// beside the next block's product (the f32 model runs them whole).
    fn overlap_tensor_sums(&mut self, blocks: usize);
    /// Sums column-split products' input gradients beside their weight
    /// gradients (the f32 model sums first).
    fn sum_input_grads_beside_weight_grads(&mut self, on: bool);
    /// Sums row-split products over the tensor group in bf16 (the f32
    /// model sums in f32).
    fn sum_tensor_products_in_bf16(&mut self, on: bool);
    /// This model as tensor-parallel rank `comm.rank()`'s share (its
    /// layout that rank's), with sequence parallelism if `sequence` (the
    /// bf16 model must have been built for what it is asked).
    fn tensor_parallel(
        self: Box<Self>,
        comm: Arc<dyn DeviceTensorComm>,
        sequence: bool,
    ) -> Result<Box<dyn GpuModel>>;

    /// Readies the whole gradient buffer `g` for a step's first backward
    /// pass: zeroes what the passes add into (the bf16 model leaves the
    /// weight matrices, which it overwrites). With `by_unit`, each backward
    /// unit zeroes what it writes first ([`GpuModel::zero_unit_grads`]).
    fn begin_grads(&mut self, g: &mut DeviceBuffer<f32>, by_unit: bool) -> Result<()>;
    /// Readies the buffer `g` of one parameter block (flat `block`) for a
    /// unit that writes it afresh.
    fn begin_block_grads(&mut self, block: Range<usize>, g: &mut DeviceBuffer<f32>) -> Result<()>;
    /// Zeroes `runs` of the window before the unit that writes them first
    /// (after `begin_grads(.., true)`).
    fn zero_unit_grads(
        &mut self,
        runs: &[Range<usize>],
        g: &mut DeviceWindow<'_, f32>,
    ) -> Result<()>;

    /// The whole forward pass; with `grad`, the loss's gradient kept for
    /// the backward pass. The mean loss.
    fn forward(
        &mut self,
        p: F32Params<'_>,
        tokens: &[u32],
        targets: &[u32],
        grad: bool,
    ) -> Result<f32>;
    /// Starts a forward pass in parts: uploads the batch.
    fn forward_begin(&mut self, tokens: &[u32], targets: &[u32]) -> Result<()>;
    /// The embeddings' forward pass.
    fn forward_encoder(&mut self, p: F32Params<'_>) -> Result<()>;
    /// Layer `l`'s forward pass.
    fn forward_block(&mut self, l: usize, p: F32Params<'_>) -> Result<()>;
    /// The head's forward pass: the mean loss.
    fn forward_head(&mut self, p: F32Params<'_>, grad: bool) -> Result<f32>;
    /// One part of the backward pass into the window `g` (the f32 model
    /// has no deferred parts).
    fn backward_part(
        &mut self,
        part: BackwardPart,
        p: F32Params<'_>,
        g: &mut DeviceWindow<'_, f32>,
    ) -> Result<()>;
    /// Whether the backward pass recomputes layers (checkpointing).
    fn recomputes(&self) -> bool;
    /// Recomputes layer `l`'s forward pass ahead of its backward pass;
    /// whether anything was recomputed (the f32 model: never).
    fn recompute_layer(&mut self, l: usize, p: F32Params<'_>) -> Result<bool>;
    /// Layer `l`'s bf16 weights, given ready-made for the next passes
    /// (`None` takes them back); only a model that streams its weights.
    fn give_layer_weights(&mut self, given: Option<(usize, DeviceBuffer<bf16>)>) -> Result<()>;
    /// Ends a step (the bf16 model's profile and per-step state).
    fn end_step(&mut self) -> Result<()>;

    /// The buffers the forward pass saves for the backward pass, by part,
    /// with their sizes in bytes (the f32 model lists none).
    fn saved_buffers(&mut self) -> Vec<(SavedFor, usize)>;
    /// Places the saved buffers in `memory` at the given byte offsets
    /// (`None`: the model's own); the bytes placed.
    ///
    /// # Safety
    /// `memory` must outlive every pass that runs until
    /// [`GpuModel::own_saved`] or [`GpuModel::drop_saved`].
    unsafe fn place_saved(
        &mut self,
        memory: &DeviceBuffer<f32>,
        at: &[Option<usize>],
    ) -> Result<usize>;
    /// Frees the saved buffers (until [`GpuModel::own_saved`]).
    fn drop_saved(&mut self) -> Result<()>;
    /// Allocates the saved buffers again as the model's own.
    fn own_saved(&mut self) -> Result<()>;

    /// Clears the per-phase profile.
    fn profile_reset(&mut self);
    /// The per-phase profile, if the model keeps one.
    fn profile_report(&self) -> Option<String>;

    /// Buffers for one micro-batch in flight through stage `st` (with
    /// `split`, room for a backward pass split into its input and weight
    /// halves, where the model splits them).
    fn micro_saved(&self, st: &Stage, split: bool) -> Result<Box<dyn StageBuffers>>;
    /// Buffers for no micro-batch, to park in the model.
    fn no_micro_saved(&self) -> Result<Box<dyn StageBuffers>>;
    /// The weight of this micro-batch's loss in the step's mean.
    fn set_loss_weight(&mut self, w: f32);
    /// Swaps `set` with the buffers the model holds.
    fn swap_micro(&mut self, set: &mut dyn StageBuffers) -> Result<()>;
    /// Stage `st`'s forward pass over the micro-batch swapped in: the loss
    /// on the last stage.
    fn stage_forward(
        &mut self,
        st: &Stage,
        p: F32Params<'_>,
        tokens: &[u32],
        targets: &[u32],
        grad: bool,
    ) -> Result<Option<f32>>;
    /// Stage `st`'s backward pass (its input half, where split), reading
    /// the output gradient in `dout`.
    fn stage_backward(
        &mut self,
        st: &Stage,
        p: F32Params<'_>,
        dout: &dyn StageBuffers,
        g: &mut DeviceWindow<'_, f32>,
    ) -> Result<()>;
    /// Whether the model splits a stage's backward pass into input and
    /// weight halves.
    fn splits_stage_backward(&self) -> bool;
    /// The weight half of a split stage backward pass (nothing where the
    /// model does not split it).
    fn stage_backward_weights(&mut self, st: &Stage, g: &mut DeviceWindow<'_, f32>) -> Result<()>;
    /// The gradient of the input of the stage whose backward pass ran
    /// last.
    fn input_grad(&self) -> DeviceView<'_, f32>;
}

/// [`StageBuffers`] for a model form's micro-batch buffers, by their
/// inherent methods of the same names (the caller has `StageBuffers` and
/// `Stage` in scope).
macro_rules! stage_buffers {
    ($t:ty) => {
        impl StageBuffers for $t {
            fn input_mut(
                &mut self,
                st: &Stage,
            ) -> braid_cuda::Result<&mut braid_cuda::DeviceBuffer<f32>> {
                <$t>::input_mut(self, st)
            }

            fn output(&self, st: &Stage) -> braid_cuda::Result<&braid_cuda::DeviceBuffer<f32>> {
                <$t>::output(self, st)
            }

            fn output_grad_mut(&mut self) -> &mut braid_cuda::DeviceBuffer<f32> {
                <$t>::output_grad_mut(self)
            }

            fn as_any(&self) -> &dyn std::any::Any {
                self
            }

            fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
                self
            }
        }
    };
}
pub(super) use stage_buffers;

/// A stage's buffers of one form handed to a model of the other.
pub(super) fn other_form() -> braid_cuda::CudaError {
    braid_cuda::CudaError::Invalid(
        "a micro-batch's buffers of one model form handed to the other (a bug: please report it)"
            .into(),
    )
}
