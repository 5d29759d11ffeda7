//! [`GpuStage`]: one pipeline rank's stages of a GPU model (bf16 or f32,
//! through [`StageModel`]) as an [`Engine`], as [`super::CpuStage`] is on
//! CPUs: its forward pass with gradients runs the whole step's schedule
//! on this rank — every
//! micro-batch's forward and backward passes, activations and their
//! gradients moving between the pipeline's GPUs over NCCL
//! ([`DeviceLinks`]) — adding the stage's gradients into its own buffer;
//! its backward units then hand them to the strategy (data parallelism
//! over the data dimension reduces them as usual).
//!
//! What a micro-batch's forward pass keeps for its backward pass is the
//! model's `StageBuffers` per (stage, micro-batch) in flight, swapped into the
//! model for each of its passes; a schedule keeps as many as it has in
//! flight (1F1B: at most the pipeline's depth on the first stage). The
//! loss's gradient is weighted `1 / M`, so the micro-batches' gradients
//! add up to the batch's. The tied token embedding lives on the first and
//! the last stage: their gradients are summed between the two every step;
//! the last stage's copy is not saved in checkpoints, nor counted twice in
//! the gradient norm. Split backward passes (ZB-H1) run in two halves on
//! the bf16 model (the input half defers the layers' weight gradients,
//! the weight half runs them from the micro-batch's buffers, kept until
//! then); the f32 model runs them whole at the input half.
//!
//! Without data parallelism ([`GpuStage::owning_grads`]) the stage's
//! buffer is the step's gradient buffer: the strategy's is empty, the
//! norm and the update read the stage's (one gradient buffer on the GPU,
//! not two).

use super::describe::gpt_describe;
use super::gpt_gpu::GpuGpt;
use super::state::stage_tensors;

mod err;
mod model;
mod passes;
use crate::engine::{
    Checkpointable, Engine, EngineInfo, Matrix, NamedTensor, OptimizerState, ShardedOptimizer,
    StateBytes, Unit, UpdateStep,
};
use crate::pipeline::device_links::DeviceLinks;
use crate::pipeline::exec;
use crate::pipeline::in_flight::InFlight;
use crate::pipeline::timeline::{self, Held, Measured};
use crate::schedule::check::Checked;
use crate::schedule::{Op, Schedule};
use crate::space::Gpu;
use crate::Result;
use braid_comm::gpu::GpuCommunicator;
use braid_comm::ReduceOp;
use braid_cuda::memory::{copy_async, zero_async};
use braid_cuda::{DeviceBuffer, DeviceWindow, Stream};
use braid_data::loader::TokenBatch;
use braid_model::{Block, Layout, Stage};
use err::e;
pub(crate) use model::StageModel;
use passes::Passes;
use std::ops::Range;

/// One pipeline rank's stages on its GPU.
pub struct GpuStage {
    passes: Passes,
    links: DeviceLinks,
    schedule: Schedule,
    /// This rank in the pipeline group.
    rank: usize,
    /// The pipeline group (the loss, the tied embeddings, the norm).
    group: GpuCommunicator,
    step: u64,
    /// The stage's buffer is the step's gradient buffer (no strategy
    /// reads gradients of its own).
    owns_grads: bool,
    /// The training steps' timelines.
    measured: Measured,
    /// The two buffers the tied embeddings' gradients go through.
    tied: Option<(DeviceBuffer<f32>, DeviceBuffer<f32>)>,
}

/// Elements of the tied embeddings' gradients summed at once (64 MB).
const TIED_CHUNK: usize = 16 << 20;

/// The directed pairs of pipeline ranks that `s`'s messages go between.
fn link_pairs(s: &Schedule) -> Vec<(usize, usize)> {
    let mut pairs = Vec::new();
    for (rank, actions) in s.actions.iter().enumerate() {
        for a in actions {
            let to = match a.op {
                Op::SendActivation => s.rank_of(a.stage + 1),
                Op::SendGrad => s.rank_of(a.stage - 1),
                _ => continue,
            };
            if to != rank {
                pairs.push((rank, to));
            }
        }
    }
    pairs.sort_unstable();
    pairs.dedup();
    pairs
}

impl GpuStage {
    /// Pipeline rank `group.rank()`'s stages of the schedule `schedule`
    /// (checked where it was built), over `inner` (the bf16 engine of its parameters laid out
    /// by [`Layout::pipeline_stages`] for `stages`, given by global index,
    /// built for micro-batches of `b × t`).
    pub fn new(
        mut inner: GpuGpt,
        stages: Vec<(usize, Stage)>,
        schedule: Checked,
        group: GpuCommunicator,
        b: usize,
        t: usize,
    ) -> Result<GpuStage> {
        let schedule = schedule.into_schedule();
        let rank = group.rank();
        if group.size() != schedule.ranks {
            return Err(format!(
                "a pipeline group of {} ranks for a schedule of {}",
                group.size(),
                schedule.ranks
            ));
        }
        let links = DeviceLinks::new(&group, &link_pairs(&schedule))?;
        // Split backward passes where the schedule has them and the model
        // defers weight gradients (bf16).
        let split = schedule
            .actions
            .iter()
            .flatten()
            .any(|a| a.op == Op::BackwardInput)
            && inner.stage_model().splits_backward();
        let len = inner.layout().len;
        let device = inner.params().device().clone();
        {
            let mut model = inner.stage_model();
            // The model's own buffers were made for all its layers at
            // once: each micro-batch in flight gets its own instead.
            let mut none = model.no_micro_saved()?;
            model.swap(&mut none)?;
            model.set_loss_weight(1.0 / schedule.micro_batches as f32);
        }
        let n = stages.len();
        let flight = InFlight::new(stages.iter().map(|(i, _)| *i).collect(), schedule.ranks);
        Ok(GpuStage {
            passes: Passes {
                acc: DeviceBuffer::zeros(&device, len).map_err(e)?,
                inner,
                stages,
                b,
                t,
                flight,
                set_bytes: vec![0; n],
                batch: TokenBatch::new(0, t),
                grad: false,
                marks: Vec::new(),
                marked: 0,
                origin: None,
                split,
            },
            links,
            schedule,
            rank,
            group,
            step: 0,
            owns_grads: false,
            measured: Measured::default(),
            tied: None,
        })
    }

    /// Makes the stage's buffer the step's gradient buffer, for a strategy
    /// without data parallelism (one replica: nothing reduces gradients,
    /// which then need no second buffer). The strategy's buffer is empty,
    /// the engine has no backward units (its forward pass ran them), and
    /// the norm and the update read the stage's buffer. Not with
    /// gradient accumulation over several forward passes.
    pub fn owning_grads(mut self) -> GpuStage {
        self.owns_grads = true;
        self
    }

    fn layout(&self) -> &Layout {
        self.passes.inner.layout()
    }

    /// Whether this rank holds the last stage's copy of the tied
    /// embeddings and not the first's (that copy is not saved or
    /// counted).
    fn second_copy(&self) -> bool {
        let holds = |s: usize| self.passes.stages.iter().any(|(i, _)| *i == s);
        holds(self.schedule.stages() - 1) && !holds(0)
    }

    /// The pipeline rank holding the last stage.
    fn last_rank(&self) -> usize {
        self.schedule.rank_of(self.schedule.stages() - 1)
    }

    /// Sums the tied embeddings' gradients of the first and last stage
    /// (on different ranks) into both.
    fn sum_tied(&mut self) -> Result<()> {
        let (first, last) = (0, self.last_rank());
        if first == last || (self.rank != first && self.rank != last) {
            return Ok(());
        }
        let peer = if self.rank == first { last } else { first };
        let er = self.layout().block_range(Block::Embedding);
        let s = self.passes.stream();
        // In pieces of at most TIED_CHUNK elements through two buffers
        // kept for it (the whole block twice is a GB at 12.85B).
        let chunk = TIED_CHUNK.min(er.len());
        if self.tied.as_ref().is_none_or(|(a, _)| a.len() != chunk) {
            let device = self.passes.acc.device().clone();
            let z = || DeviceBuffer::zeros(&device, chunk).map_err(e);
            self.tied = Some((z()?, z()?));
        }
        let (mine, theirs) = self.tied.as_mut().expect("made above");
        let k = self.passes.inner.kernels();
        let mut at = er.start;
        while at < er.end {
            let n = chunk.min(er.end - at);
            copy_async(
                &mut mine.view_mut(0..n),
                &self.passes.acc.view(at..at + n),
                &s,
            )
            .map_err(e)?;
            // (Both ranks cut the block alike: whole buffers go, the
            // first `n` elements count.)
            self.group
                .send_recv(mine, peer, theirs, peer)
                .and_then(|w| w.wait())
                .map_err(|x| {
                    format!("summing the tied embeddings' gradients with rank {peer}: {x}")
                })?;
            k.add_inplace(
                &s,
                &mut self.passes.acc.view_mut(at..at + n),
                &theirs.view(0..n),
            )
            .map_err(e)?;
            at += n;
        }
        s.synchronize().map_err(e)
    }

    /// Σ x² of `values` at the flat positions `ranges` (held one after
    /// another), the second copy of the tied embeddings left out, summed
    /// over the pipeline group.
    fn sq_norm(&self, values: &DeviceBuffer<f32>, ranges: &[Range<usize>]) -> Result<f64> {
        self.sq_norm_at(values, ranges, true)
    }

    /// [`sq_norm`](Self::sq_norm) of `values` holding `ranges` one after
    /// another (`compact`), or the whole flat buffer (`values[r]` is `r`).
    fn sq_norm_at(
        &self,
        values: &DeviceBuffer<f32>,
        ranges: &[Range<usize>],
        compact: bool,
    ) -> Result<f64> {
        let skip = match self.second_copy() {
            true => self.layout().block_range(Block::Embedding),
            false => 0..0,
        };
        // What counts on this rank of a tensor group, less the skipped
        // block: (flat range, offset in `values`).
        let inner = &self.passes.inner;
        let mut kept = Vec::new();
        for (r, at) in inner.kept_ranges(ranges) {
            let at = if compact { at } else { r.start };
            let cut = |x: usize| x.clamp(r.start, r.end);
            for part in [
                r.start..cut(skip.start),
                cut(skip.end.max(skip.start))..r.end,
            ] {
                if !part.is_empty() {
                    kept.push((part.clone(), at + part.start - r.start));
                }
            }
        }
        let mut sum = [inner.sum_kept(values, &kept)?];
        self.group
            .host()
            .all_reduce(&mut sum, ReduceOp::Sum)
            .map_err(|x| format!("the gradient norm over the pipeline: {x}"))?;
        Ok(sum[0])
    }

    /// What this rank's stages held at once.
    fn held(&self) -> Held<'_> {
        Held {
            rank: self.rank,
            stages: self.passes.stages.iter().map(|(i, _)| *i).collect(),
            made: self.passes.flight.made(),
            bytes: Some(&self.passes.set_bytes),
        }
    }

    /// [`timeline_report`](Self::timeline_report) as JSON.
    pub fn timeline_json(&self) -> Option<serde_json::Value> {
        self.measured.json_held(&self.schedule, &self.held())
    }

    /// The last step's timeline as a chart, the measured idle fraction
    /// beside the theory's, and the most micro-batches each stage held at
    /// once (printed at the end of a run).
    /// Each stage's estimated time (all the pipeline's stages, by global
    /// index), for the timeline's bubble on paper with the stages as split.
    pub fn with_stage_costs(mut self, costs: Vec<f64>) -> Self {
        self.measured.stage_costs = Some(costs);
        self
    }

    /// The world ranks of the pipeline's ranks, in pipeline order: the
    /// timeline's rows are named by them.
    pub fn with_world_ranks(mut self, ranks: Vec<usize>) -> Self {
        self.measured.world_ranks = ranks;
        self
    }

    pub fn timeline_report(&self) -> Option<String> {
        self.measured.report_held(&self.schedule, &self.held())
    }

    /// The parameters with their layout (this rank's stages).
    pub fn into_params(self) -> Result<braid_model::Params> {
        let layout = self.passes.inner.layout().clone();
        let mut params = braid_model::Params::zeros(std::sync::Arc::new(layout));
        self.passes.inner.into_params(&mut params)?;
        Ok(params)
    }
}

impl Engine for GpuStage {
    type Space = Gpu;
    type Batch = TokenBatch;

    fn describe(&self) -> String {
        let ly = self.layout();
        let stages: Vec<String> = self
            .passes
            .stages
            .iter()
            .map(|(i, s)| format!("stage {i} (layers {}..{})", s.layers.start, s.layers.end))
            .collect();
        let how = format!(
            "{} on a GPU, pipeline rank {} of {} ({}), schedule {}, {} micro-batches",
            self.passes.inner.precision().name(),
            self.rank,
            self.schedule.ranks,
            stages.join(", "),
            self.schedule.name,
            self.schedule.micro_batches
        );
        gpt_describe(&ly.config, self.passes.b, self.passes.t, &how)
    }

    fn params(&self) -> &DeviceBuffer<f32> {
        self.passes.inner.params()
    }

    fn params_mut(&mut self) -> &mut DeviceBuffer<f32> {
        self.passes.inner.params_mut()
    }

    fn params_changed(&mut self) -> Result<()> {
        self.passes.inner.params_changed()
    }

    fn load_params(&mut self, values: &[f32]) -> Result<()> {
        self.passes.inner.load_params(values)
    }

    fn new_grads(&self) -> Result<DeviceBuffer<f32>> {
        let len = match self.owns_grads {
            true => 0,
            false => self.layout().len,
        };
        DeviceBuffer::zeros(self.passes.acc.device(), len).map_err(e)
    }

    fn zero_grads(&mut self, grads: &mut DeviceBuffer<f32>) -> Result<()> {
        // (Not the engine's: its passes write their own buffer, zeroed
        // by each forward pass with gradients.)
        zero_async(grads, &self.passes.stream()).map_err(e)
    }

    fn units(&self) -> Vec<Unit> {
        if self.owns_grads {
            return Vec::new();
        }
        // The blocks this rank holds, from the buffer's end.
        self.layout()
            .blocks
            .iter()
            .rev()
            .map(|(b, r)| Unit {
                name: match b {
                    Block::Embedding => "embedding".into(),
                    Block::Layer(l) => format!("layer {l}"),
                    Block::FinalNorm => "head".into(),
                },
                finalizes: r.clone(),
            })
            .collect()
    }

    fn forward(&mut self, batch: &TokenBatch, grad: bool) -> Result<f32> {
        let micro = self.schedule.micro_batches;
        let (b, t) = (self.passes.b, self.passes.t);
        if batch.b != micro * b || batch.t != t {
            return Err(format!(
                "a batch of {} x {} for {micro} micro-batches of {b} x {t}",
                batch.b, batch.t
            ));
        }
        self.passes.batch.clone_from(batch);
        self.passes.grad = grad;
        self.passes.start_marks()?;
        let schedule = match grad {
            true => {
                let s = self.passes.stream();
                zero_async(&mut self.passes.acc, &s).map_err(e)?;
                self.schedule.clone()
            }
            false => exec::forward_only(&self.schedule),
        };
        let run = exec::run(
            &schedule,
            self.rank,
            &mut self.passes,
            &mut self.links,
            self.step,
        );
        self.step += 1;
        let ended = self.passes.flight.end_step();
        let ran = run?;
        ended?;
        if grad {
            let at = self.passes.mark_times()?;
            let spans: Vec<_> = ran
                .spans
                .iter()
                .map(|(a, b, e)| (*a, at[*b], at[*e]))
                .collect();
            let t = timeline::gather(&schedule, &spans, self.group.host())?;
            self.measured.add(t);
        }
        let losses = ran.losses;
        // The last stage's mean over the micro-batches, to every rank.
        let mut loss = [losses.iter().map(|(_, l)| *l as f64).sum::<f64>() / micro as f64];
        self.group
            .host()
            .broadcast(&mut loss, self.last_rank())
            .map_err(|x| format!("the loss from the last pipeline stage: {x}"))?;
        if grad {
            self.sum_tied()?;
        }
        Ok(loss[0] as f32)
    }

    fn backward_unit(&mut self, unit: usize, grads: &mut DeviceWindow<'_, f32>) -> Result<()> {
        let units = self.units();
        let u = units
            .get(unit)
            .ok_or_else(|| format!("backward unit {unit} does not exist"))?;
        let r = u.finalizes.clone();
        let s = self.passes.stream();
        let mut g = grads.view_mut(r.clone()).map_err(e)?;
        self.passes
            .inner
            .kernels()
            .add_inplace(&s, &mut g, &self.passes.acc.view(r))
            .map_err(e)
    }

    fn grad_sq_norm(&mut self, grads: &DeviceBuffer<f32>) -> Result<f64> {
        let grads = match self.owns_grads {
            true => &self.passes.acc,
            false => grads,
        };
        self.sq_norm(grads, std::slice::from_ref(&(0..grads.len())))
    }

    fn update(&mut self, grads: &DeviceBuffer<f32>, step: UpdateStep) -> Result<()> {
        match self.owns_grads {
            true => self.passes.inner.update(&self.passes.acc, step),
            false => self.passes.inner.update(grads, step),
        }
    }

    fn synchronize(&mut self) -> Result<()> {
        self.passes.inner.synchronize()
    }

    fn stream(&self) -> Option<&Stream> {
        Some(self.passes.inner.compute_stream())
    }
}

impl EngineInfo for GpuStage {
    fn matrices(&self) -> Vec<Matrix> {
        self.passes.inner.matrices()
    }

    fn state_bytes(&self) -> StateBytes {
        // The stage's own gradient buffer besides the strategy's.
        let mut s = self.passes.inner.state_bytes();
        s.grads += 4 * self.passes.acc.len() as u64;
        s
    }
}

impl ShardedOptimizer for GpuStage {
    fn grad_sq_norm_compact(
        &mut self,
        compact: &DeviceBuffer<f32>,
        ranges: &[Range<usize>],
    ) -> Result<f64> {
        self.sq_norm(compact, ranges)
    }

    fn grad_sq_norm_of(
        &mut self,
        grads: &DeviceBuffer<f32>,
        ranges: &[Range<usize>],
    ) -> Result<f64> {
        crate::engine::check_shard(ranges, grads.len())?;
        self.sq_norm_at(grads, ranges, false)
    }

    fn update_shard(&mut self, grads: &DeviceBuffer<f32>, step: UpdateStep) -> Result<()> {
        self.passes.inner.update_shard(grads, step)
    }

    fn shard_optimizer(&mut self, shard: &[Range<usize>]) -> Result<()> {
        self.passes.inner.shard_optimizer(shard)
    }
}

impl Checkpointable for GpuStage {
    fn tensors(&self) -> Vec<NamedTensor> {
        stage_tensors(self.layout(), self.second_copy())
    }

    fn optimizer_moments(&self) -> Result<(String, Vec<String>)> {
        self.passes.inner.optimizer_moments()
    }

    fn read_moment(
        &mut self,
        moment: usize,
        ranges: &[Range<usize>],
        out: &mut [f32],
    ) -> Result<()> {
        self.passes.inner.read_moment(moment, ranges, out)
    }

    fn set_optimizer_state(&mut self, state: &OptimizerState, updates: u64) -> Result<()> {
        self.passes.inner.set_optimizer_state(state, updates)
    }
}
