//! [`GpuGpt`]: the GPU GPT models of `braid-model` (f32, or bf16 mixed
//! precision) as an [`Engine`]: parameters, gradients and AdamW state in
//! one GPU's memory, every kernel on the device's own stream (so that
//! collectives order themselves after it), AdamW in one launch — or, with
//! the optimizer offloaded ([`GpuGpt::offloaded`]), master weights and
//! AdamW in host memory and the update on the CPU ([`super::offload`]).

use super::describe::{gpt_describe, gpt_matrices};
use super::state::{copy_at, gpt_tensors, moment};
use super::units::backward_unit_name;
use crate::engine::{
    check_shard, state_ranges, BlockGrads, Checkpointable, Engine, EngineInfo, LendsMemory, Matrix,
    NamedTensor, OptimizerState, ParamUnits, SavedBuffer, ShardedOptimizer, ShardedParams,
    StateBytes, Unit, UpdateStep,
};
use crate::space::Gpu;
use crate::Result;
use braid_cuda::memory::zero_async;
use braid_cuda::{DeviceBuffer, DeviceView, DeviceViewMut, DeviceWindow, Stream};
use braid_data::loader::TokenBatch;
use braid_model::cuda::gpu_model::GpuModel;
use braid_model::cuda::mixed::{AdamSegments, AdamStep, MixedKernels};
use braid_model::cuda::model_mixed::SavedFor;
use braid_model::tensor_comm::DeviceTensorComm;
use braid_model::{Block, Params};
use braid_trace::{scope, Cat};
use std::ops::Range;
use std::sync::Arc;

mod build;
mod err;
mod precision;
mod ranges;
mod sharded;
mod state;
mod units;
use err::e;
pub use precision::Precision;
use ranges::optimizer_ranges;
pub use state::GpuGpt;
use state::{BiasCarry, Offload, Step};
use units::*;

/// The views one AdamW launch reads and writes: parameters, gradients and
/// the two moments, alike in length.
type AdamViews<'a, 'b> = (
    &'a mut DeviceViewMut<'b, f32>,
    &'a DeviceView<'b, f32>,
    &'a mut DeviceViewMut<'b, f32>,
    &'a mut DeviceViewMut<'b, f32>,
);

/// One AdamW launch over the optimizer's flat parameters `r` (their
/// `views`), on `stream` or else the model's own; the bf16 model's whole
/// bf16 copy gets `r` too where the copy reaches that far (past a short
/// copy's end no bf16 is written: `optimizer_ranges` cut the ranges there).
fn adamw_launch(
    mk: &MixedKernels,
    model: &mut dyn GpuModel,
    stream: Option<&Stream>,
    (p, g, m, v): AdamViews<'_, '_>,
    r: &Range<usize>,
    segs: &AdamSegments,
    h: AdamStep,
) -> Result<()> {
    let (own, pb) = model.stream_and_weights_bf16();
    let mut pb = pb
        .filter(|b| r.end <= b.len())
        .map(|b| b.view_mut(r.clone()));
    let pb = pb.as_mut().map(|b| b as _);
    mk.adamw_multi(stream.unwrap_or(own), p, pb, g, m, v, segs, h)
        .map_err(e)
}

impl GpuGpt {
    /// Defers the weight gradients of the first `layers` layers until after
    /// the embeddings' backward (bf16 only): the embeddings' gradients —
    /// the largest reduction, and final only at the very end — then
    /// overlap those products instead of ending the step exposed. The
    /// gradients are the same bit for bit.
    pub fn defer_weight_grads(&mut self, layers: usize) -> Result<()> {
        if self.by_unit.is_some() && layers > 0 {
            return Err(
                "deferred weight gradients: the gradients are already written unit by unit".into(),
            );
        }
        // The deferred layers' buffers are the model's too.
        let before = braid_cuda::pool::allocated_bytes();
        self.model.defer_weight_grads(layers).map_err(e)?;
        let after = braid_cuda::pool::allocated_bytes();
        self.model_bytes = (self.model_bytes + after).saturating_sub(before);
        self.steps = plan(&self.layout, layers);
        Ok(())
    }

    /// The parameters' layout.
    pub fn layout(&self) -> &braid_model::Layout {
        &self.layout
    }

    /// The model with the parameters its passes read: what a pipeline
    /// stage's passes run on ([`super::gpt_gpu_stage`]).
    pub(crate) fn stage_model(&mut self) -> super::gpt_gpu_stage::StageModel<'_> {
        super::gpt_gpu_stage::StageModel {
            model: &mut *self.model,
            p: f32_params(&self.p, &self.offload),
        }
    }

    /// The f32 kernels (sums of squares, additions).
    pub(crate) fn kernels(&self) -> &braid_model::cuda::Kernels {
        self.model.kernels()
    }

    /// The stream every kernel of the engine runs on.
    pub fn compute_stream(&self) -> &Stream {
        self.model.stream()
    }

    /// Copies the trained (f32 master) parameters into `params`.
    pub fn copy_params_to(&self, params: &mut Params) -> Result<()> {
        params.data.resize(self.layout.len, 0.0);
        match self.host_master().or(self.pending.as_deref()) {
            Some(master) => {
                params.data.copy_from_slice(master);
                Ok(())
            }
            None => self.p.copy_to_host(&mut params.data).map_err(e),
        }
    }

    /// Hands the trained (f32 master) parameters to `params`, ending the
    /// engine: master weights in host memory (an offloaded optimizer's,
    /// or ZeRO-3's gathered at its end) move over without a copy.
    pub fn into_params(mut self, params: &mut Params) -> Result<()> {
        if let Some(o) = self.offload.take() {
            params.data = o.into_master();
            return Ok(());
        }
        if let Some(host) = self.pending.take() {
            params.data = host;
            return Ok(());
        }
        self.copy_params_to(params)
    }

    /// The master weights in host memory, when the optimizer is offloaded.
    fn host_master(&self) -> Option<&[f32]> {
        self.offload.as_ref().map(Offload::master)
    }

    /// Seconds the CPU spent in the last offloaded update (none without
    /// offload).
    pub fn offload_cpu_seconds(&self) -> Option<f64> {
        self.offload.as_ref().map(Offload::cpu_seconds)
    }

    /// Device bytes the model's own buffers hold: its activations and
    /// the passes' scratch (not the parameters, gradients or optimizer
    /// state), by the allocator's counters.
    pub fn model_bytes(&self) -> usize {
        self.model_bytes
    }

    /// The arithmetic in use.
    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// Elements of AdamW state per moment: the optimizer's ranges.
    fn state_len(&self) -> usize {
        self.shard.iter().map(|(r, _, _)| r.len()).sum()
    }

    /// AdamW on every range of the optimizer's shard, one launch each;
    /// `compact`: `grads` holds the shard's gradients one range after
    /// another (indexed like the state), else the whole buffer. `master`:
    /// the parameters, laid out like compact gradients (a ZeRO-3 rank's
    /// master shard); else the engine's own whole buffer.
    fn adamw(
        &mut self,
        mut master: Option<&mut DeviceBuffer<f32>>,
        grads: &DeviceBuffer<f32>,
        compact: bool,
        step: UpdateStep,
    ) -> Result<()> {
        self.moments_ready()?;
        let h = self.adam_step(step);
        for (r, at, segs) in &self.shard {
            let len = r.len();
            let mut p = match master.as_mut() {
                Some(m) => m.view_mut(*at..at + len),
                None => self.p.view_mut(r.clone()),
            };
            let g = match compact {
                true => grads.view(*at..at + len),
                false => grads.view(r.clone()),
            };
            let mut m = self.m.view_mut(*at..at + len);
            let mut v = self.v.view_mut(*at..at + len);
            let views = (&mut p, &g, &mut m, &mut v);
            adamw_launch(&self.mk, &mut *self.model, None, views, r, segs, h)?;
        }
        self.updates += 1;
        Ok(())
    }

    /// AdamW's moments, made at the first update for the optimizer's
    /// ranges; refused after they were released.
    fn moments_ready(&mut self) -> Result<()> {
        if self.released {
            return Err(
                "an update after the optimizer's state was released (training ended)".into(),
            );
        }
        let len = self.state_len();
        if self.m.len() != len {
            let device = self.p.device().clone();
            self.m = DeviceBuffer::zeros(&device, len).map_err(e)?;
            self.v = DeviceBuffer::zeros(&device, len).map_err(e)?;
        }
        Ok(())
    }

    /// One AdamW launch's hyperparameters for `step`.
    fn adam_step(&self, step: UpdateStep) -> AdamStep {
        AdamStep {
            lr: step.lr,
            beta1: self.adam.beta1,
            beta2: self.adam.beta2,
            step: step.step as i32,
            eps: self.adam.eps,
            grad_scale: step.grad_scale,
        }
    }

    /// Refuses checkpointing the optimizer where its state is not in
    /// `m` and `v` (released after training).
    fn checkpointable(&self, what: &str) -> Result<()> {
        if self.released {
            return Err(format!(
                "{what}: the optimizer's state was released (training ended)"
            ));
        }
        Ok(())
    }

    /// Refuses `what` once the parameters are sharded (ZeRO-3 runs the
    /// unit passes instead).
    fn whole(&self, what: &str) -> Result<()> {
        if self.pending.is_some() {
            return Err(format!(
                "{what}: the engine's parameters are in host memory, before ZeRO-3 shards \
                 them (GpuGpt::for_sharding) or after it gathered them back to be saved"
            ));
        }
        match self.sharded {
            false => Ok(()),
            true => Err(format!(
                "{what}: the parameters are sharded (ZeRO-3); the engine runs only its unit passes"
            )),
        }
    }

    /// Under the bf16 model, starts the [`BiasCarry`] that block-by-block
    /// gradients need (once).
    fn start_bias_carry(&mut self) -> Result<()> {
        if self.model.carries_bias_grads() && self.carry.is_none() {
            let c = self.layout.config.n_embd;
            self.carry = Some(BiasCarry {
                buf: DeviceBuffer::zeros(self.p.device(), c).map_err(e)?,
                for_layer: None,
            });
        }
        Ok(())
    }

    /// Refuses `what` unless the parameters are sharded.
    fn in_units(&self, what: &str) -> Result<()> {
        match self.sharded {
            true => Ok(()),
            false => Err(format!(
                "{what}: the unit passes take sharded parameters (call shard_params first)"
            )),
        }
    }

    /// The lengths in elements of the blocks `params` hold for a unit
    /// reading `blocks`: a block taken in bf16 comes as half as many f32
    /// elements, two values to one.
    fn given_lens(&self, blocks: &[usize], params: &[&DeviceBuffer<f32>]) -> Vec<usize> {
        params
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let taken = blocks
                    .get(i)
                    .is_some_and(|&b| self.half.as_ref().is_some_and(|h| h.taken[b]));
                if taken {
                    2 * p.len()
                } else {
                    p.len()
                }
            })
            .collect()
    }

    /// The layer whose bf16 block a unit reading `blocks` (given
    /// `params`) runs on, if its blocks are taken in bf16 (then it reads
    /// that one block only), or `None` when it reads f32 blocks.
    ///
    /// `params[0]` then holds the layer's bf16 weights: the strategy
    /// gathered them so ([`ShardedParams::start_half_blocks`]'s contract), and
    /// keeps the buffer until the work queued with it has run, as it does
    /// for f32 blocks.
    fn half_layer(&self, blocks: &[usize], params: &[&DeviceBuffer<f32>]) -> Result<Option<usize>> {
        let Some(h) = &self.half else {
            return Ok(None);
        };
        let taken = blocks.iter().filter(|&&b| h.taken[b]).count();
        match (taken, blocks) {
            (0, _) => Ok(None),
            (1, &[b]) if params.len() == 1 => {
                let r = &self.units.blocks[b];
                self.layout
                    .blocks
                    .iter()
                    .find_map(|(block, range)| match block {
                        Block::Layer(l) if range == r => Some(*l),
                        _ => None,
                    })
                    .map(Some)
                    .ok_or_else(|| format!("block {b} is taken in bf16 but is no layer"))
            }
            _ => Err(format!(
                "a unit reads blocks {blocks:?}, some taken in bf16 and some not (bf16 \
                 layers run one to a unit)"
            )),
        }
    }
}

impl GpuGpt {
    /// The bf16 model's row-split products in `blocks` row blocks, each
    /// block's sum over the tensor group beside the next block's product
    /// (`GpuGptMixed::overlap_tensor_sums`; the f32 model runs them whole).
    pub fn overlap_tensor_sums(mut self, blocks: usize) -> GpuGpt {
        self.model.overlap_tensor_sums(blocks);
        self
    }

    /// With `on`, the bf16 model's backward pass sums each column-split
    /// product's input gradient over the tensor group beside the product's
    /// weight gradient
    /// (`GpuGptMixed::sum_input_grads_beside_weight_grads`; the f32 model
    /// sums first).
    pub fn sum_input_grads_beside_weight_grads(mut self, on: bool) -> GpuGpt {
        self.model.sum_input_grads_beside_weight_grads(on);
        self
    }

    /// With `on`, the bf16 model sums its row-split products over the
    /// tensor group in bf16, every rank adding the residual and bias after
    /// the sum (`GpuGptMixed::sum_tensor_products_in_bf16`; the f32 model
    /// sums in f32).
    pub fn sum_tensor_products_in_bf16(mut self, on: bool) -> GpuGpt {
        self.model.sum_tensor_products_in_bf16(on);
        self
    }

    /// Makes this engine tensor-parallel rank `comm.rank()`'s share (its
    /// layout that rank's `Layout::tensor_parallel` one): the model (f32
    /// or bf16) runs the group's collectives in its passes, and the
    /// gradient norm is summed over the group. With `sequence`, sequence
    /// parallelism too (the bf16 engine must have been built for it:
    /// `MixedOptions::sequence_parallel`).
    pub fn tensor_parallel(
        mut self,
        comm: Arc<dyn DeviceTensorComm>,
        sequence: bool,
    ) -> Result<GpuGpt> {
        let before = braid_cuda::pool::allocated_bytes();
        self.model = self
            .model
            .tensor_parallel(comm.clone(), sequence)
            .map_err(e)?;
        // The share's buffers: sequence parallelism shrinks some, the
        // group adds its own.
        let after = braid_cuda::pool::allocated_bytes();
        self.model_bytes = (self.model_bytes + after).saturating_sub(before);
        let whole = self
            .layout
            .params
            .iter()
            .filter(|p| p.place.is_none())
            .map(|p| p.range())
            .collect();
        self.group = Some((comm, whole));
        Ok(self)
    }

    /// The parts of `ranges` (flat positions, held one after another)
    /// that count in this rank's share of the gradient norm, as (flat
    /// range, offset in the held values): everything on the group's first
    /// rank, else all but the tensors every rank holds whole.
    pub(crate) fn kept_ranges(&self, ranges: &[Range<usize>]) -> Vec<(Range<usize>, usize)> {
        let skip: &[Range<usize>] = match &self.group {
            Some((comm, whole)) if comm.rank() > 0 => whole,
            _ => &[],
        };
        let mut out = Vec::new();
        let mut at = 0;
        for r in ranges {
            let mut from = r.start;
            for s in skip.iter().filter(|s| s.end > r.start && s.start < r.end) {
                let cut = s.start.max(r.start);
                if cut > from {
                    out.push((from..cut, at + from - r.start));
                }
                from = s.end.min(r.end);
            }
            if r.end > from {
                out.push((from..r.end, at + from - r.start));
            }
            at += r.len();
        }
        out
    }

    /// Σ x² of the kept parts (`values` holding them at their offsets),
    /// summed over the tensor group.
    pub(crate) fn sum_kept(
        &self,
        values: &DeviceBuffer<f32>,
        kept: &[(Range<usize>, usize)],
    ) -> Result<f64> {
        let (k, s) = (self.model.kernels(), self.model.stream());
        let views: Vec<_> = kept
            .iter()
            .map(|(r, at)| values.view(*at..at + r.len()))
            .collect();
        let parts: Vec<&dyn braid_cuda::DeviceMem<f32>> = views.iter().map(|v| v as _).collect();
        let mut sum = [match parts.is_empty() {
            true => 0.0,
            false => k.sum_of_squares(s, &parts).map_err(e)?,
        }];
        if let Some((comm, _)) = &self.group {
            comm.host_sum_f64(&mut sum)
                .map_err(|e| format!("the gradient norm over the tensor group: {e}"))?;
        }
        Ok(sum[0])
    }

    /// The group's gradient norm of `values`, which hold the flat
    /// `ranges` one after another.
    fn group_sq_norm(&self, values: &DeviceBuffer<f32>, ranges: &[Range<usize>]) -> Result<f64> {
        let kept = self.kept_ranges(ranges);
        self.sum_kept(values, &kept)
    }
}

impl Engine for GpuGpt {
    type Space = Gpu;
    type Batch = TokenBatch;

    fn describe(&self) -> String {
        let shard = self.layout.shard;
        let tp = match shard.size {
            1 => String::new(),
            n => format!(", tensor-parallel rank {} of {n}", shard.rank),
        };
        gpt_describe(
            &self.layout.config,
            self.b,
            self.t,
            &format!("{} on a GPU{tp}", self.precision.name()),
        )
    }

    fn params(&self) -> &DeviceBuffer<f32> {
        &self.p
    }

    fn params_mut(&mut self) -> &mut DeviceBuffer<f32> {
        &mut self.p
    }

    fn params_changed(&mut self) -> Result<()> {
        if self.offload.is_some() {
            return Err(
                "the master weights of an offloaded optimizer live in host memory: the \
                 parameters on the GPU are derived from them and cannot be overwritten"
                    .into(),
            );
        }
        if let (s, Some(pb)) = self.model.stream_and_weights_bf16() {
            let n = pb.len();
            self.mk.to_bf16(s, pb, &self.p.view(0..n)).map_err(e)?;
        }
        Ok(())
    }

    fn load_params(&mut self, values: &[f32]) -> Result<()> {
        match &mut self.offload {
            None => {
                self.p.copy_from_host(values).map_err(e)?;
                self.params_changed()
            }
            // The master weights are the host's; the GPU's copies follow.
            Some(h) => h.load(values, &mut self.p, &mut *self.model),
        }
    }

    fn new_grads(&self) -> Result<DeviceBuffer<f32>> {
        DeviceBuffer::zeros(self.p.device(), self.layout.len).map_err(e)
    }

    fn zero_grads(&mut self, grads: &mut DeviceBuffer<f32>) -> Result<()> {
        match grads.len() == self.layout.len {
            // The whole buffer: the bf16 model's next backward pass
            // overwrites the weight matrices' gradients, so only the rest
            // is zeroed (the same values), or with gradients by unit each
            // backward unit zeroes what it writes first.
            true => self
                .model
                .begin_grads(grads, self.by_unit.is_some())
                .map_err(e),
            false => zero_async(grads, self.compute_stream()).map_err(e),
        }
    }

    fn units(&self) -> Vec<Unit> {
        self.steps.iter().map(|(u, _)| u.clone()).collect()
    }

    fn unit_count(&self) -> usize {
        self.steps.len()
    }

    fn forward(&mut self, batch: &TokenBatch, grad: bool) -> Result<f32> {
        self.whole("the forward pass")?;
        let pf = f32_params(&self.p, &self.offload);
        self.model
            .forward(pf, &batch.tokens, &batch.targets, grad)
            .map_err(e)
    }

    fn backward_unit(&mut self, unit: usize, g: &mut DeviceWindow<'_, f32>) -> Result<()> {
        let layers = self.layout.config.n_layer;
        let _t = scope::start(self.stream(), Cat::Compute, || {
            backward_unit_name(unit, layers)
        });
        self.whole("the backward pass")?;
        crate::memory_phase::enter(crate::memory_phase::Phase::BackwardUnit(unit));
        let step = self
            .steps
            .get(unit)
            .map(|s| s.1)
            .ok_or_else(|| format!("backward unit {unit} does not exist"))?;
        if let Some(runs) = &self.by_unit {
            self.model.zero_unit_grads(&runs[unit], g).map_err(e)?;
        }
        let pf = f32_params(&self.p, &self.offload);
        self.model.backward_part(step, pf, g).map_err(e)
    }

    fn grad_sq_norm(&mut self, grads: &DeviceBuffer<f32>) -> Result<f64> {
        if self.group.is_some() {
            let all = 0..grads.len();
            return self.group_sq_norm(grads, std::slice::from_ref(&all));
        }
        let norm = self
            .model
            .kernels()
            .global_norm(self.model.stream(), grads)
            .map_err(e)?;
        Ok(norm * norm)
    }

    fn update(&mut self, grads: &DeviceBuffer<f32>, step: UpdateStep) -> Result<()> {
        if grads.len() != self.layout.len {
            return Err(format!(
                "{} gradients for {} parameters",
                grads.len(),
                self.layout.len
            ));
        }
        if self.offload.is_none() {
            return self.adamw(None, grads, false, step);
        }
        let Some(h) = &mut self.offload else {
            unreachable!("offloaded, as checked above");
        };
        let done = h.step(grads, &mut self.p, &mut *self.model, step);
        self.updates += 1;
        done
    }

    fn synchronize(&mut self) -> Result<()> {
        self.model.end_step().map_err(e)?;
        // Bounded like every other wait: the communicator's timeout.
        self.compute_stream()
            .synchronize_within(self.sync_limit, "waiting for the GPU's work of the step")
            .map_err(e)
    }

    fn stream(&self) -> Option<&Stream> {
        Some(self.compute_stream())
    }
}

impl EngineInfo for GpuGpt {
    fn host_params(&self) -> Option<&[f32]> {
        self.host_master()
    }

    fn pending_params(&self) -> Option<&[f32]> {
        self.pending.as_deref()
    }

    fn matrices(&self) -> Vec<Matrix> {
        gpt_matrices(&self.layout)
    }

    fn state_bytes(&self) -> StateBytes {
        let f32s = 4 * self.p.len() as u64;
        let bf16s = self.model.weights_bf16().map_or(0, |b| 2 * b.len() as u64);
        if let Some(o) = &self.offload {
            let (master, optimizer, staging) = o.host_bytes();
            let on_gpu = f32s + bf16s;
            return StateBytes {
                params: on_gpu,
                master,
                grads: 0,
                optimizer: optimizer + staging,
                offloaded: master + optimizer + staging,
            };
        }
        let optimizer = 8 * self.state_len() as u64;
        match self.precision {
            Precision::F32 => StateBytes {
                params: f32s,
                optimizer,
                ..Default::default()
            },
            Precision::Bf16 | Precision::Fp8 => StateBytes {
                params: bf16s,
                master: f32s,
                optimizer,
                ..Default::default()
            },
        }
    }

    fn profile_reset(&mut self) {
        self.model.profile_reset();
    }

    fn profile_report(&self) -> Option<String> {
        self.model.profile_report()
    }
}

impl ShardedOptimizer for GpuGpt {
    fn grad_sq_norm_compact(
        &mut self,
        compact: &DeviceBuffer<f32>,
        ranges: &[Range<usize>],
    ) -> Result<f64> {
        match self.group {
            None => self.grad_sq_norm(compact),
            Some(_) => self.group_sq_norm(compact, ranges),
        }
    }

    fn grad_sq_norm_of(
        &mut self,
        grads: &DeviceBuffer<f32>,
        ranges: &[Range<usize>],
    ) -> Result<f64> {
        check_shard(ranges, grads.len())?;
        if self.group.is_some() {
            // The elements of `ranges`, each where it is in `grads`.
            let kept = self.kept_ranges(ranges);
            return self.sum_kept(grads, &kept);
        }
        let (k, s) = (self.model.kernels(), self.model.stream());
        let views: Vec<_> = ranges.iter().map(|r| grads.view(r.clone())).collect();
        let parts: Vec<&dyn braid_cuda::DeviceMem<f32>> = views.iter().map(|v| v as _).collect();
        k.sum_of_squares(s, &parts).map_err(e)
    }

    fn update_shard(&mut self, grads: &DeviceBuffer<f32>, step: UpdateStep) -> Result<()> {
        let len = self.state_len();
        if grads.len() != len {
            return Err(format!(
                "{} shard gradients for an optimizer shard of {len} elements",
                grads.len()
            ));
        }
        self.adamw(None, grads, true, step)
    }

    fn shard_optimizer(&mut self, shard: &[Range<usize>]) -> Result<()> {
        check_shard(shard, self.layout.len)?;
        if self.offload.is_some() {
            return Err("an optimizer offloaded to the host is not sharded (yet)".into());
        }
        if self.updates > 0 {
            return Err("the optimizer can be sharded only before the first update".into());
        }
        let device = self.p.device().clone();
        self.shard = optimizer_ranges(shard, self.layout.bf16_len())
            .into_iter()
            .map(|(r, at)| {
                let segs =
                    AdamSegments::shard(&device, &self.layout, self.adam.weight_decay, r.clone());
                Ok((r, at, segs.map_err(e)?))
            })
            .collect::<Result<_>>()?;
        Ok(())
    }
}

impl BlockGrads for GpuGpt {
    fn zero_block_grads(&mut self, block: usize, grads: &mut DeviceBuffer<f32>) -> Result<()> {
        let range = self
            .units
            .blocks
            .get(block)
            .cloned()
            .ok_or_else(|| format!("zero_block_grads: no parameter block {block}"))?;
        // Each backward unit writes its blocks' buffers afresh (the shard
        // adds micro-batches): the bf16 model overwrites the weight
        // matrices and zeroes the rest of the block, the f32 model zeroes
        // it all.
        self.model.begin_block_grads(range, grads).map_err(e)
    }

    fn backward_unit_into(
        &mut self,
        unit: usize,
        grads: &mut [&mut DeviceBuffer<f32>],
    ) -> Result<()> {
        let layers = self.layout.config.n_layer;
        let _t = scope::start(self.stream(), Cat::Compute, || {
            backward_unit_name(unit, layers)
        });
        self.whole("backward_unit_into")?;
        if self.steps != plan(&self.layout, 0) {
            return Err(
                "gradients block by block (ZeRO stage 2) go one layer to a unit: layers that \
                 defer their weight gradients do not go with it (drop --defer-layers)"
                    .into(),
            );
        }
        let reads = self
            .units
            .backward_reads
            .get(unit)
            .ok_or_else(|| format!("backward unit {unit} does not exist"))?;
        let lens: Vec<usize> = reads.iter().map(|&b| self.units.blocks[b].len()).collect();
        let grad_lens: Vec<usize> = grads.iter().map(|g| g.len()).collect();
        let writes = self
            .units
            .backward_given(unit, &lens, &grad_lens)?
            .1
            .to_vec();
        self.start_bias_carry()?;
        let step = self.steps[unit].1;
        let pf = f32_params(&self.p, &self.offload);
        let mut window = block_window(
            &self.layout,
            &self.units,
            &mut self.carry,
            self.model.stream(),
            unit,
            step,
            &writes,
            grads,
        )?;
        self.model.backward_part(step, pf, &mut window).map_err(e)
    }

    fn param_units(&self) -> Result<ParamUnits> {
        Ok(self.units.clone())
    }
}

impl ShardedParams for GpuGpt {
    fn start_half_blocks(&mut self) -> Result<(Vec<usize>, Vec<Range<usize>>)> {
        self.take_half_blocks()
    }

    fn half_side(&mut self) -> Option<&mut DeviceBuffer<f32>> {
        self.half.as_mut().map(|h| &mut h.side)
    }

    fn shard_params(&mut self, shard: &[Range<usize>]) -> Result<DeviceBuffer<f32>> {
        self.upload_shard(shard)
    }

    fn unshard_params(&mut self, full: Vec<f32>) -> Result<()> {
        self.keep_whole_params(full)
    }

    fn forward_begin(&mut self, batch: &TokenBatch, grad: bool) -> Result<()> {
        self.in_units("forward_begin")?;
        self.forward_grad = grad;
        self.model
            .forward_begin(&batch.tokens, &batch.targets)
            .map_err(e)
    }

    fn forward_unit(&mut self, unit: usize, params: &[&DeviceBuffer<f32>]) -> Result<Option<f32>> {
        self.run_forward_unit(unit, params)
    }

    fn recomputes_unit(&self, unit: usize) -> bool {
        let layer = matches!(self.steps.get(unit), Some((_, Step::Layer(_))));
        layer && self.model.recomputes()
    }

    fn recompute_unit_of(&mut self, unit: usize, params: &[&DeviceBuffer<f32>]) -> Result<bool> {
        self.run_recompute_unit(unit, params)
    }

    fn backward_unit_of(
        &mut self,
        unit: usize,
        params: &[&DeviceBuffer<f32>],
        grads: &mut [&mut DeviceBuffer<f32>],
    ) -> Result<()> {
        self.run_backward_unit(unit, params, grads)
    }

    fn update_compact(
        &mut self,
        params: &mut DeviceBuffer<f32>,
        grads: &DeviceBuffer<f32>,
        step: UpdateStep,
    ) -> Result<()> {
        self.update_master_shard(params, grads, step)
    }

    fn release_optimizer_state(&mut self) -> Result<()> {
        if self.offload.is_none() {
            self.compute_stream().synchronize().map_err(e)?;
            self.m = DeviceBuffer::zeros(self.p.device(), 0).map_err(e)?;
            self.v = DeviceBuffer::zeros(self.p.device(), 0).map_err(e)?;
            self.released = true;
        }
        Ok(())
    }
}

impl LendsMemory for GpuGpt {
    fn grads_by_unit(&mut self) -> Result<Option<Vec<Vec<Range<usize>>>>> {
        // The bf16 model over its whole parameters, every layer one unit
        // (no deferred weight gradients), its optimizer on the GPU.
        let whole_plan = self.steps == plan(&self.layout, 0);
        let bf16 = self.precision.mixed();
        if !bf16 || self.sharded || !whole_plan || self.offload.is_some() {
            return Ok(None);
        }
        let runs = braid_model::cuda::model_mixed::first_writes(&self.layout);
        self.model.drop_saved().map_err(e)?;
        self.by_unit = Some(runs.clone());
        Ok(Some(runs))
    }

    fn saved_buffers(&mut self) -> Result<Vec<SavedBuffer>> {
        if self.by_unit.is_none() {
            self.in_units("saved_buffers")?;
        }
        let n = self.layout.config.n_layer;
        // The unit plan ZeRO-3 runs (`shard_params` refuses others), and
        // the whole model's by unit (`grads_by_unit` refuses others):
        // backward unit 0 the head, unit n - l layer l; forward unit 0 the
        // embeddings, unit l + 1 layer l. A layer's buffers are first
        // written by the unit before its own (its input is that unit's
        // output), the head's by the last layer's; the shared scratch
        // (read last by the embeddings' backward, or listed with layer 0)
        // from the first unit on.
        Ok(self
            .model
            .saved_buffers()
            .into_iter()
            .map(|(part, bytes)| {
                let (last_read, first_write) = match part {
                    SavedFor::Head => (0, n),
                    SavedFor::Layer(l) => (n - l, l),
                    SavedFor::Embedding => (n + 1, 0),
                };
                SavedBuffer {
                    bytes,
                    last_read,
                    first_write,
                }
            })
            .collect())
    }

    unsafe fn place_saved(
        &mut self,
        memory: &DeviceBuffer<f32>,
        at: &[Option<usize>],
    ) -> Result<usize> {
        if self.by_unit.is_none() {
            self.in_units("place_saved")?;
        }
        // SAFETY: the caller's contract, passed on.
        unsafe { self.model.place_saved(memory, at) }.map_err(e)
    }

    fn drop_saved(&mut self) -> Result<()> {
        self.model.drop_saved().map_err(e)
    }

    fn own_saved(&mut self) -> Result<()> {
        self.model.own_saved().map_err(e)
    }
}

impl Checkpointable for GpuGpt {
    fn tensors(&self) -> Vec<NamedTensor> {
        gpt_tensors(&self.layout)
    }

    fn optimizer_moments(&self) -> Result<(String, Vec<String>)> {
        self.checkpointable("optimizer_moments")?;
        Ok(("adamw".into(), vec!["exp_avg".into(), "exp_avg_sq".into()]))
    }

    fn read_moment(
        &mut self,
        moment: usize,
        ranges: &[Range<usize>],
        out: &mut [f32],
    ) -> Result<()> {
        self.checkpointable("read_moment")?;
        // (Ranges cut where the bf16 copy ends run on in the state.)
        let mut shard: Vec<Range<usize>> = Vec::new();
        for (r, _, _) in &self.shard {
            match shard.last_mut() {
                Some(last) if last.end == r.start => last.end = r.end,
                _ => shard.push(r.clone()),
            }
        }
        let at = state_ranges(&shard, ranges)?;
        let total: usize = at.iter().map(|r| r.len()).sum();
        if total != out.len() || moment > 1 {
            return Err(format!(
                "read_moment: moment {moment}, {total} elements into a buffer of {}",
                out.len()
            ));
        }
        if let Some(host) = &self.offload {
            // The offloaded optimizer owns every element, in flat order.
            return copy_at(host.moment(moment)?, &at, out);
        }
        // Before the first update the moments are zero (and not yet
        // allocated).
        if self.m.len() != self.state_len() {
            out.fill(0.0);
            return Ok(());
        }
        self.synchronize()?;
        let state = match moment {
            0 => &self.m,
            _ => &self.v,
        };
        let mut o = 0;
        for r in at {
            state
                .copy_range_to_host(r.clone(), &mut out[o..o + r.len()])
                .map_err(e)?;
            o += r.len();
        }
        Ok(())
    }

    fn set_optimizer_state(&mut self, state: &OptimizerState, updates: u64) -> Result<()> {
        self.checkpointable("set_optimizer_state")?;
        let len = self.state_len();
        let device = self.p.device().clone();
        self.synchronize()?;
        let m = moment(state, "adamw", "exp_avg", len)?;
        let v = moment(state, "adamw", "exp_avg_sq", len)?;
        if let Some(host) = &mut self.offload {
            host.set_moments(m, v, updates)?;
            self.updates = updates;
            return Ok(());
        }
        self.m = DeviceBuffer::from_host(&device, m).map_err(e)?;
        self.v = DeviceBuffer::from_host(&device, v).map_err(e)?;
        self.updates = updates;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engines::units::gpt_units;
    use braid_model::{GptConfig, Layout};

    #[test]
    fn optimizer_ranges_are_cut_where_the_bf16_copy_ends() {
        assert_eq!(
            optimizer_ranges(std::slice::from_ref(&(0..10)), 10),
            [(0..10, 0)]
        );
        assert_eq!(
            optimizer_ranges(std::slice::from_ref(&(0..10)), 6),
            [(0..6, 0), (6..10, 6)]
        );
        // ZeRO-1's ranges: only the one across the end is cut, the state
        // offsets run on.
        assert_eq!(
            optimizer_ranges(&[2..4, 5..9, 9..12], 6),
            [(2..4, 0), (5..6, 2), (6..9, 3), (9..12, 6)]
        );
    }

    #[test]
    fn deferred_plans_finish_the_buffer_from_its_ends() {
        let layout = Layout::new(&GptConfig::parse("L4-H2-C16-V50-T8").unwrap());
        for d in 0..=4 {
            let p = plan(&layout, d);
            assert_eq!(
                p.len(),
                2 + 4 + d + if d > 0 { 2 } else { 0 },
                "deferred {d}"
            );
            let units: Vec<Unit> = p.iter().map(|x| x.0.clone()).collect();
            // The DDP bucket planner accepts it (every unit at an end).
            crate::ddp::buckets::plan(&units, layout.len, 4, 4, &[]).unwrap();
        }
        assert_eq!(
            plan(&layout, 0)
                .iter()
                .map(|x| x.0.clone())
                .collect::<Vec<_>>(),
            gpt_units(&layout)
        );
    }
}
