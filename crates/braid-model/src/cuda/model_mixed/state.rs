//! What a [`GpuGptMixed`] holds: its buffers — what each layer's forward
//! pass keeps ([`LayerSaved`], [`BlockActs`]), the cast weights when no
//! full bf16 copy is kept ([`StreamedWeights`]), the inputs of deferred
//! weight gradients ([`DeferredDy`]) — its tensor-parallel group
//! ([`Group`]) and its fused-epilogue products ([`FusedProducts`]).

use super::fresh::FreshGrads;
use super::seq::SeqRows;
use super::stage::MicroPlan;
use crate::block::LayerRanges;
use crate::cpu::attention::AttnShape;
use crate::cuda::batch::DeviceBatch;
use crate::cuda::kernels::Kernels;
use crate::cuda::mixed::MixedKernels;
use crate::cuda::mixed_attention::{AttnPath, AttnSaved, AttnShared};
use crate::cuda::profile::PhaseTimer;
use crate::layout::Layout;
use crate::model::Widths;
use crate::tensor_comm::DeviceTensorComm;
use braid_cuda::blas::Blas;
use braid_cuda::blaslt::BlasLt;
use braid_cuda::{Device, DeviceBuffer, DevicePool, Result, Stream};
use half::bf16;
use std::sync::Arc;

/// What a layer's forward pass keeps for its backward pass (besides its
/// input, the residual stream below it). The two LayerNorms keep only
/// their statistics: their outputs (the inputs of the qkv and fc products)
/// are recomputed by the LayerNorm backward, bit for bit, just before the
/// weight gradients that read them.
pub(super) struct LayerSaved {
    pub(super) ln1_mean: DeviceBuffer<f32>,
    pub(super) ln1_rstd: DeviceBuffer<f32>,
    pub(super) ln2_mean: DeviceBuffer<f32>,
    pub(super) ln2_rstd: DeviceBuffer<f32>,
    /// The attention's output (the proj product's input); `None` where
    /// checkpointing recomputes it
    /// ([`MixedOptions::recompute_attention_output`](super::MixedOptions::recompute_attention_output)):
    /// the model's `work` buffers receive it again.
    pub(super) atty: Option<DeviceBuffer<bf16>>,
    /// The rest of the block's activations; `None` under checkpointing,
    /// where the model's `work` buffers receive them again at the start of
    /// the block's backward pass.
    pub(super) acts: Option<BlockActs>,
    /// Under checkpointing with the fused attention: the rows'
    /// log-sum-exp, so that the attention itself need not run again.
    pub(super) lse: Option<DeviceBuffer<f32>>,
    /// Under checkpointing, in a layer that keeps the attention
    /// ([`MixedOptions::kept_attention`](super::MixedOptions::kept_attention)):
    /// the attention's saved state, so that the recomputation starts after
    /// it (no LayerNorm, no qkv product, no attention).
    pub(super) attn: Option<AttnSaved>,
}

/// A block's activations that checkpointing recomputes instead of keeping.
pub(super) struct BlockActs {
    /// The attention's saved state (fused: the biased projection and the
    /// log-sum-exp; batched: per-head q, k, v and the probabilities);
    /// `None` in the shared buffers when every layer keeps its own.
    pub(super) attn: Option<AttnSaved>,
    /// The residual stream after the attention (the second LayerNorm's input).
    pub(super) resid2: DeviceBuffer<f32>,
    /// The MLP's pre-activation (bias included). Its GELU is not kept:
    /// the backward pass recomputes it (one write in the pass that reads
    /// `fch` anyway), saving 8 bytes per token and width of every layer.
    pub(super) fch: DeviceBuffer<bf16>,
    /// The attention's output, in the shared buffers where the layers keep
    /// none of their own
    /// ([`MixedOptions::recompute_attention_output`](super::MixedOptions::recompute_attention_output)).
    pub(super) atty: Option<DeviceBuffer<bf16>>,
}

impl BlockActs {
    /// A block's buffers: the attention's at `shape` (this rank's heads),
    /// `resid2` at the residual width `c` over `rows` rows (the batch's,
    /// or a sequence-parallel rank's slice), `fch` at the MLP's width `f`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        p: &DevicePool,
        s: &Stream,
        shape: AttnShape,
        path: AttnPath,
        with_attention: bool,
        with_output: bool,
        (c, f): (usize, usize),
        rows: usize,
    ) -> Result<BlockActs> {
        let n = shape.b * shape.t;
        Ok(BlockActs {
            attn: match with_attention {
                true => Some(AttnSaved::new(p, s, shape, path)?),
                false => None,
            },
            resid2: p.zeros(rows * c, s)?,
            fch: p.zeros(n * f, s)?,
            atty: match with_output {
                true => Some(p.zeros(n * shape.c, s)?),
                false => None,
            },
        })
    }
}

/// The products' bf16 weights when the model keeps no full bf16 copy of
/// its parameters: each layer's parameters are cast from the f32 master
/// copy into one layer's buffer just before the layer's forward pass and
/// again before its backward pass, and the token embeddings (the
/// classifier's) once per step. 2 bytes per parameter less, for two casts
/// of every parameter per step.
pub(super) struct StreamedWeights {
    /// One layer's parameters, in layout order (allocated at the first
    /// cast: a model given its layers in bf16 never casts one).
    pub(super) layer: Option<DeviceBuffer<bf16>>,
    /// The layer whose current parameters `layer` holds.
    pub(super) holds: Option<usize>,
    /// A layer's bf16 parameters handed in by the caller
    /// ([`GpuGptMixed::give_layer_weights`]): used instead of a cast.
    pub(super) given: Option<(usize, DeviceBuffer<bf16>)>,
    /// The token embeddings, cast by the forward pass for the step.
    pub(super) wte: DeviceBuffer<bf16>,
}

/// The output gradients a layer's four products saw, kept when its
/// weight gradients are deferred until after the embedding backward (so
/// that the embeddings' gradient reduction, the largest, overlaps them
/// instead of ending the backward pass exposed). Swapped with the model's
/// scratch buffers, never copied.
pub(super) struct DeferredDy {
    /// The MLP's recomputed GELU (the output projection's input).
    pub(super) gelu: DeviceBuffer<bf16>,
    /// The recomputed LayerNorm outputs (the fc and qkv products' inputs).
    pub(super) ln2: DeviceBuffer<bf16>,
    pub(super) ln1: DeviceBuffer<bf16>,
    pub(super) fcproj: DeviceBuffer<bf16>,
    pub(super) fc: DeviceBuffer<bf16>,
    pub(super) proj: DeviceBuffer<bf16>,
    pub(super) qkv: DeviceBuffer<bf16>,
}

impl DeferredDy {
    /// The buffers for `n` rows at the widths `w`.
    pub(super) fn new(p: &DevicePool, s: &Stream, n: usize, w: Widths) -> Result<DeferredDy> {
        let Widths {
            c, attn: a, mlp: f, ..
        } = w;
        Ok(DeferredDy {
            gelu: p.zeros(n * f, s)?,
            ln2: p.zeros(n * c, s)?,
            ln1: p.zeros(n * c, s)?,
            fcproj: p.zeros(n * c, s)?,
            fc: p.zeros(n * (4 * a).max(f), s)?,
            proj: p.zeros(n * c, s)?,
            qkv: p.zeros(n * 3 * a, s)?,
        })
    }
}

/// A tensor-parallel rank's group: its collectives, and the rows' maxima
/// and sums of the vocabulary-parallel cross-entropy (`n` and `2n`).
pub(super) struct Group {
    pub(super) comm: Arc<dyn DeviceTensorComm>,
    pub(super) mx: DeviceBuffer<f32>,
    pub(super) sums: DeviceBuffer<f32>,
}

/// cuBLASLt for fused-epilogue products, and which epilogues it turned
/// out not to support here (those run as separate passes).
pub(super) struct FusedProducts {
    pub(super) lt: BlasLt,
    pub(super) off: [bool; 4],
    /// Products in FP8 (`GpuGptMixed::set_fp8`).
    pub(super) fp8: Option<super::fp8_products::Fp8Products>,
}

/// A GPT model's mixed-precision forward and backward passes on one GPU,
/// sized for one (batch, sequence) shape.
pub struct GpuGptMixed {
    pub(super) layout: Arc<Layout>,
    /// The widths of this rank's passes (the whole model's in one
    /// process; a tensor-parallel rank's heads, MLP columns and
    /// vocabulary rows).
    pub(super) widths: Widths,
    /// The tensor-parallel group, when this is one rank's share.
    pub(super) group: Option<Group>,
    /// Under sequence parallelism, this rank's rows and their scratch.
    pub(super) seq: Option<SeqRows>,
    /// Row blocks of the row-split products whose sums over the group run
    /// beside the next block's product (1: the product, then its sum;
    /// [`overlap_tensor_sums`](Self::overlap_tensor_sums)).
    pub(super) tensor_blocks: usize,
    /// Whether the row-split products are summed over the tensor group in
    /// bf16 ([`sum_tensor_products_in_bf16`](Self::sum_tensor_products_in_bf16)).
    pub(super) tensor_sums_bf16: bool,
    /// Whether each column-split product's input gradient is summed over
    /// the tensor group beside its weight gradient
    /// ([`sum_input_grads_beside_weight_grads`](Self::sum_input_grads_beside_weight_grads)).
    pub(super) grad_sums_beside: bool,
    /// The whole bf16 copy of the parameters the products read, when the
    /// engine keeps one ([`keep_weights_bf16`](Self::keep_weights_bf16)):
    /// what the passes of [`GpuModel`](crate::cuda::gpu_model::GpuModel)
    /// read (the inherent passes take it as an argument instead).
    pub(super) weights_bf16: Option<DeviceBuffer<bf16>>,
    pub(super) stream: Stream,
    pub(super) kernels: Kernels,
    pub(super) mk: MixedKernels,
    /// Which attention implementation the layers use.
    pub(super) path: AttnPath,
    /// Fused-epilogue products (cuBLASLt), where available.
    pub(super) lt: Option<FusedProducts>,
    pub(super) blas: Blas,
    pub(super) pool: DevicePool,
    pub(super) b: usize,
    pub(super) t: usize,
    /// This rank's vocabulary rounded up to a multiple of 64: the classifier's
    /// products run over `vp` rows of a zero-padded embedding copy (an odd
    /// vocabulary makes cuBLAS several times slower).
    pub(super) vp: usize,
    /// Where the vocabulary is not a multiple of 64: the bf16 token
    /// embeddings over `vp` rows (rows past the vocabulary zero), and the
    /// classifier's f32 embedding gradient over `vp` rows. Otherwise the
    /// products use the parameters and the gradient buffer directly.
    pub(super) pad: Option<(DeviceBuffer<bf16>, DeviceBuffer<f32>)>,
    /// Per layer of the model: its ranges and what its forward pass keeps,
    /// where this model's layout holds it (a pipeline stage's holds some).
    pub(super) ranges: Vec<Option<LayerRanges>>,
    pub(super) layers: Vec<Option<LayerSaved>>,
    /// Under checkpointing (`--checkpointing`): the one block's
    /// activations, recomputed at the start of each block's backward pass.
    pub(super) work: Option<BlockActs>,
    /// Without a full bf16 copy of the parameters: the cast weights.
    pub(super) streamed: Option<StreamedWeights>,
    /// The residual stream at each layer's input (and the last's output),
    /// where a held layer reads or writes it.
    pub(super) resid: Vec<Option<DeviceBuffer<f32>>>,
    pub(super) lnf: DeviceBuffer<bf16>,
    pub(super) lnf_mean: DeviceBuffer<f32>,
    pub(super) lnf_rstd: DeviceBuffer<f32>,
    pub(super) logits: DeviceBuffer<bf16>,
    pub(super) losses: DeviceBuffer<f32>,
    pub(super) batch: DeviceBatch,
    pub(super) attn: AttnShared,
    // Scratch shared by the layers.
    /// A LayerNorm's output: written by the forward pass for the product
    /// it feeds, recomputed by the backward pass for that product's
    /// weight gradient.
    pub(super) ln: DeviceBuffer<bf16>,
    /// The wide scratch (`b·t × 4·width` bf16), holding one thing at a
    /// time. Forward: the qkv product where the attention does not take
    /// it into its saved state (the first `b·t × 3·width`), then the
    /// MLP's GELU, the output projection's input. Backward: the GELU's
    /// input gradient (made the pre-activation's in place), then the
    /// attention's output gradient (the last `b·t × width`) and its input
    /// gradient dqkv (the first `b·t × 3·width`). See [`Wide`](super::wide::Wide).
    pub(super) wide: DeviceBuffer<bf16>,
    pub(super) dresid: DeviceBuffer<f32>,
    pub(super) dresid_bf: DeviceBuffer<bf16>,
    pub(super) dln: DeviceBuffer<bf16>,
    pub(super) partial: DeviceBuffer<f32>,
    /// Per layer: `Some` where the layer defers its weight gradients.
    pub(super) deferred: Vec<Option<DeferredDy>>,
    /// SMs the backward pass's products are planned for (0: all), when
    /// communication kernels hold the others (`BRAID_BACKWARD_SM_TARGET`).
    pub(super) backward_sms: usize,
    pub(super) prof: PhaseTimer,
    /// Lengths of the saved buffers [`own_saved`](Self::own_saved)
    /// dropped, for the next forward pass to allocate (empty: none).
    pub(super) unowned_saved: Vec<usize>,
    /// Whether the backward pass overwrites the weight gradients.
    pub(super) fresh: FreshGrads,
    /// The block whose activations [`recompute_layer`](Self::recompute_layer)
    /// rebuilt for its backward pass, next.
    pub(super) recomputed: Option<usize>,
    /// The stored score gradients live in the block's `resid2` and `fch`
    /// during the attention's backward pass
    /// ([`score_grads_fit_in_block`](super::score_grads_fit_in_block)), not
    /// in scratch of their own.
    pub(super) score_grads_in_block: bool,
    /// The first layer of the pipeline stage whose backward pass runs (0
    /// for the whole model): its pass leaves the gradient of the stage's
    /// input in `dresid`, and no bias gradient of the layer below.
    pub(super) bottom: usize,
    /// What the forward pass keeps per micro-batch, and how to make more
    /// ([`MicroSaved`](super::MicroSaved)).
    pub(super) plan: MicroPlan,
    pub(super) device: Device,
    /// What the loss's gradient is multiplied by (1 / micro-batches where
    /// a step's gradients add up several: a pipeline's).
    pub(super) loss_weight: f32,
}
