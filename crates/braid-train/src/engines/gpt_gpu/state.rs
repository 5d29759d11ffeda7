//! The state of a [`GpuGpt`]: the engine struct and the types of its
//! fields — the model (either form, a `Box<dyn GpuModel>`), the optimizer
//! in host memory ([`Offload`]), the backward units ([`Step`]), ZeRO-3's
//! bf16 blocks ([`HalfBlocks`]) and carried bias gradient
//! ([`BiasCarry`]) — and where the master weights start ([`Master`]). Fields and methods are
//! `pub(super)`: seen by `gpt_gpu` and its children, as before.

use super::precision::Precision;
use crate::engine::{ParamUnits, Unit, UpdateStep};
use crate::engines::offload::HostOptimizer;
use crate::Result;
use braid_cuda::DeviceBuffer;
use braid_model::cuda::f32_params::SideMap;
use braid_model::cuda::gpu_model::GpuModel;
use braid_model::cuda::mixed::{AdamSegments, MixedKernels};
use braid_model::optim::AdamWConfig;
use braid_model::tensor_comm::DeviceTensorComm;
use half::bf16;
use std::ops::Range;
use std::sync::Arc;

/// The optimizer in host memory, for either model form.
pub(super) enum Offload {
    /// The f32 model's: the GPU keeps its f32 weights (`p`).
    F32(HostOptimizer<f32>),
    /// The bf16 model's: the GPU keeps the bf16 copy and, in `p`, the f32
    /// tensors the passes read, packed by `SideMap`.
    Bf16(HostOptimizer<bf16>, SideMap),
}

impl Offload {
    /// Sets the master weights and copies them up into `p` and the
    /// model's bf16 copy (for the bf16 model's optimizer).
    pub(super) fn load(
        &mut self,
        values: &[f32],
        p: &mut DeviceBuffer<f32>,
        model: &mut dyn GpuModel,
    ) -> Result<()> {
        let (s, copy) = model.stream_and_weights_bf16();
        match (self, copy) {
            (Offload::F32(h), _) => {
                h.set_master(values)?;
                h.upload(p, None, s)
            }
            (Offload::Bf16(h, _), Some(pb)) => {
                h.set_master(values)?;
                h.upload(pb, Some(p), s)
            }
            (Offload::Bf16(..), None) => Err(no_bf16_copy()),
        }
    }

    /// One AdamW update from `grads`, the new weights copied up into `p`
    /// and the model's bf16 copy (for the bf16 model's optimizer).
    pub(super) fn step(
        &mut self,
        grads: &DeviceBuffer<f32>,
        p: &mut DeviceBuffer<f32>,
        model: &mut dyn GpuModel,
        step: UpdateStep,
    ) -> Result<()> {
        let (s, copy) = model.stream_and_weights_bf16();
        match (self, copy) {
            (Offload::F32(h), _) => h.step(grads, p, None, s, step),
            (Offload::Bf16(h, _), Some(pb)) => h.step(grads, pb, Some(p), s, step),
            (Offload::Bf16(..), None) => Err(no_bf16_copy()),
        }
    }

    pub(super) fn master(&self) -> &[f32] {
        match self {
            Offload::F32(h) => h.master(),
            Offload::Bf16(h, _) => h.master(),
        }
    }

    /// Host bytes: master weights, optimizer state, staging buffers.
    pub(super) fn host_bytes(&self) -> (u64, u64, u64) {
        match self {
            Offload::F32(h) => h.host_bytes(),
            Offload::Bf16(h, _) => h.host_bytes(),
        }
    }

    pub(super) fn cpu_seconds(&self) -> f64 {
        match self {
            Offload::F32(h) => h.last_cpu_s,
            Offload::Bf16(h, _) => h.last_cpu_s,
        }
    }

    pub(super) fn into_master(self) -> Vec<f32> {
        match self {
            Offload::F32(h) => h.into_master(),
            Offload::Bf16(h, _) => h.into_master(),
        }
    }

    pub(super) fn moment(&self, i: usize) -> Result<&[f32]> {
        match self {
            Offload::F32(h) => h.moment(i),
            Offload::Bf16(h, _) => h.moment(i),
        }
    }

    pub(super) fn set_moments(&mut self, m: &[f32], v: &[f32], updates: u64) -> Result<()> {
        match self {
            Offload::F32(h) => h.set_moments(m, v, updates),
            Offload::Bf16(h, _) => h.set_moments(m, v, updates),
        }
    }
}

/// The bf16 optimizer offloaded for a model without a whole bf16 copy.
fn no_bf16_copy() -> String {
    "the offloaded bf16 optimizer writes the model's whole bf16 copy, and this model streams its \
     weights instead (a bug: please report it)"
        .into()
}

/// One backward unit of the GPU engine: a part of the model's backward
/// pass.
pub(super) use braid_model::cuda::gpu_model::BackwardPart as Step;

/// A GPT model trained on one GPU with AdamW.
pub struct GpuGpt {
    pub(super) layout: std::sync::Arc<braid_model::Layout>,
    /// The model, either form (f32, or bf16 with its bf16 weights).
    pub(super) model: Box<dyn GpuModel>,
    /// Device bytes the model's buffers hold (activations and the passes'
    /// scratch), by the allocator's counters around their allocation.
    pub(super) model_bytes: usize,
    pub(super) precision: Precision,
    pub(super) mk: MixedKernels,
    /// The f32 parameters on the GPU: the master weights, or under an
    /// offloaded optimizer what the passes read in f32 (all of them for
    /// the f32 model, the packed side tensors for bf16).
    pub(super) p: DeviceBuffer<f32>,
    /// The optimizer and master weights in host memory, if offloaded.
    pub(super) offload: Option<Offload>,
    /// Built for ZeRO-3 ([`GpuGpt::for_sharding`]): the parameters in host
    /// memory until [`ShardedParams::shard_params`] uploads this rank's shard of
    /// them, and again after [`ShardedParams::unshard_params`] (`p` is empty
    /// meanwhile), so that the whole model is never on the GPU.
    ///
    /// [`ShardedParams::shard_params`]: crate::ShardedParams::shard_params
    /// [`ShardedParams::unshard_params`]: crate::ShardedParams::unshard_params
    pub(super) pending: Option<Vec<f32>>,
    pub(super) m: DeviceBuffer<f32>,
    pub(super) v: DeviceBuffer<f32>,
    pub(super) adam: AdamWConfig,
    /// The ranges of the flat buffer the optimizer owns, each with where
    /// its state starts in `m` and `v` and its weight-decay segments.
    pub(super) shard: Vec<(Range<usize>, usize, AdamSegments)>,
    /// Updates made (the optimizer may be sharded only before the first).
    pub(super) updates: u64,
    pub(super) b: usize,
    pub(super) t: usize,
    pub(super) steps: Vec<(Unit, Step)>,
    /// The parameter units a ZeRO-3 strategy gathers (which blocks each
    /// pass of this model form reads and writes).
    pub(super) units: ParamUnits,
    /// After [`ShardedParams::shard_params`]: `p` is empty, the passes take
    /// their blocks as arguments and the optimizer updates the strategy's
    /// master shard.
    ///
    /// [`ShardedParams::shard_params`]: crate::ShardedParams::shard_params
    pub(super) sharded: bool,
    /// The forward pass in units keeps what the backward pass needs.
    pub(super) forward_grad: bool,
    /// AdamW's moments were freed after the last update.
    pub(super) released: bool,
    /// Under ZeRO-3 with the bf16 model, see [`BiasCarry`].
    pub(super) carry: Option<BiasCarry>,
    /// After [`LendsMemory::grads_by_unit`]: for each backward unit, the runs
    /// of the whole gradient buffer it writes first (and zeroes, of those,
    /// what it adds into, at a step's first backward pass).
    ///
    /// [`LendsMemory::grads_by_unit`]: crate::LendsMemory::grads_by_unit
    pub(super) by_unit: Option<Vec<Vec<Range<usize>>>>,
    /// Under ZeRO-3 with bf16 gathers, see [`HalfBlocks`].
    pub(super) half: Option<HalfBlocks>,
    /// How long the wait for a step's GPU work may take
    /// (`BRAID_TIMEOUT`, like the collectives').
    pub(super) sync_limit: std::time::Duration,
    /// The tensor group, when this is one rank's share of the model: its
    /// collectives, and the flat ranges of the tensors every rank of the
    /// group holds whole (counted once in the gradient norm).
    pub(super) group: Option<TensorGroup>,
}

/// A tensor-parallel rank's group: its collectives, and the flat ranges
/// of the tensors every rank of it holds whole.
type TensorGroup = (Arc<dyn DeviceTensorComm>, Vec<Range<usize>>);

/// Under ZeRO-3 with bf16 gathers ([`ShardedParams::start_half_blocks`]) the
/// bf16 model takes each layer's block as the bf16 weights its products
/// read, gathered so, instead of f32 parameters it casts; what it reads
/// of those blocks in f32 (LayerNorms, biases) comes from `side`, which
/// the strategy refreshes after every update.
///
/// [`ShardedParams::start_half_blocks`]: crate::ShardedParams::start_half_blocks
pub(super) struct HalfBlocks {
    /// Per block of the units: taken in bf16.
    pub(super) taken: Vec<bool>,
    /// The f32 tensors of those blocks, packed as `map` says.
    pub(super) side: DeviceBuffer<f32>,
    pub(super) map: SideMap,
}

/// The bf16 model's layer backward pass (and the head's) also computes
/// the output-projection bias gradient of the layer below (the column
/// sums its LayerNorm backward forms anyway). Under ZeRO-3 that gradient
/// waits here, `width` floats, until the layer below's own unit copies it
/// into that layer's block: so that block's gradient buffer (a whole
/// layer's) need not exist one unit early. The same bits: the sums are
/// added into zeros either way.
pub(super) struct BiasCarry {
    pub(super) buf: DeviceBuffer<f32>,
    /// The layer whose bias gradient `buf` holds, until its unit runs.
    pub(super) for_layer: Option<usize>,
}

/// Where an engine's f32 master weights live.
pub(super) enum Master {
    /// On the GPU, uploaded whole at the start.
    OnGpu,
    /// In host memory with the optimizer (offloaded).
    Offloaded(Vec<f32>),
    /// In host memory until the strategy uploads its shard (ZeRO-3).
    Pending(Vec<f32>),
}
