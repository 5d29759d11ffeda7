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
//! What a micro-batch's forward pass keeps for its backward pass is a
//! `MicroSaved` (`F32MicroSaved`) per (stage, micro-batch) in flight, swapped into the
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

use super::gpt_gpu::GpuGpt;
use super::{gpt_describe, TokenBatch};
use crate::engine::{Engine, Matrix, NamedTensor, OptimizerState, StateBytes, Unit, UpdateStep};
use crate::pipeline::device_links::DeviceLinks;
use crate::pipeline::exec::{self, StagePasses};
use crate::pipeline::timeline::{self, Measured};
use crate::schedule::{Op, Schedule};
use crate::space::Gpu;
use crate::Result;
use braid_comm::gpu::GpuCommunicator;
use braid_comm::ReduceOp;
use braid_cuda::memory::{copy_async, zero_async};
use braid_cuda::{DeviceBuffer, DeviceWindow, Event, Stream};
use braid_model::cuda::f32_params::F32Params;
use braid_model::cuda::model::{F32MicroSaved, GpuGpt as GpuGptF32};
use braid_model::cuda::model_mixed::{GpuGptMixed, MicroSaved};
use braid_model::{Block, Layout, Stage};
use half::bf16;
use std::collections::HashMap;
use std::ops::Range;

fn e(x: impl std::fmt::Display) -> String {
    x.to_string()
}

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

/// What the executor runs on: the engine (parameters, optimizer, model),
/// the micro-batches' saved buffers in flight and the step's gradients.
struct Passes {
    inner: GpuGpt,
    /// This rank's stages: their global index and blocks.
    stages: Vec<(usize, Stage)>,
    /// Pipeline ranks.
    ranks: usize,
    /// Micro-batch rows, tokens per row.
    b: usize,
    t: usize,
    /// Saved buffers not in use, per stage of this rank.
    free: Vec<Vec<Saved>>,
    /// Saved buffers of the micro-batches in flight, by (stage, micro).
    live: HashMap<(usize, usize), Saved>,
    /// Per stage of this rank: sets of saved buffers made (the most
    /// micro-batches in flight at once), and the device bytes of one.
    made: Vec<usize>,
    set_bytes: Vec<usize>,
    /// A micro-batch whose input gradient went out: its buffers go back to
    /// the pool at the next call.
    done: Option<(usize, usize)>,
    /// The step's batch (every micro-batch's rows).
    batch: TokenBatch,
    /// Whether this step's passes keep what the backward pass needs.
    grad: bool,
    /// The step's gradients, added up over its micro-batches.
    acc: DeviceBuffer<f32>,
    /// The schedule splits backward passes and the model can: the input
    /// half defers the weight gradients to the weight half.
    split: bool,
    /// (stage, micro) whose weight half has not run yet.
    pending: std::collections::HashSet<(usize, usize)>,
    /// Time marks on the compute stream: reused timed events, how many
    /// the step recorded, and the step's origin (an event recorded while
    /// the stream was idle, and the host's wall clock then).
    marks: Vec<Event>,
    marked: usize,
    origin: Option<(Event, f64)>,
}

impl Passes {
    /// Where `stage` is among this rank's.
    fn local(&self, stage: usize) -> Result<usize> {
        self.stages
            .iter()
            .position(|(s, _)| *s == stage)
            .ok_or_else(|| format!("stage {stage} does not run on this pipeline rank"))
    }

    /// Rows of micro-batch `m`.
    fn rows(&self, m: usize) -> Range<usize> {
        m * self.b * self.t..(m + 1) * self.b * self.t
    }

    /// Returns finished buffers to the pool.
    fn tidy(&mut self) -> Result<()> {
        if let Some((s, m)) = self.done.take() {
            self.release(s, m)?;
        }
        Ok(())
    }

    fn release(&mut self, stage: usize, m: usize) -> Result<()> {
        let i = self.local(stage)?;
        if self.pending.contains(&(stage, m)) {
            // Its weight half still reads them.
            return Ok(());
        }
        if let Some(a) = self.live.remove(&(stage, m)) {
            self.free[i].push(a);
        }
        Ok(())
    }

    /// The saved buffers of (`stage`, `m`), from the pool when new.
    fn saved(&mut self, stage: usize, m: usize) -> Result<&mut Saved> {
        let i = self.local(stage)?;
        if !self.live.contains_key(&(stage, m)) {
            let a = match self.free[i].pop() {
                Some(a) => a,
                None => {
                    let st = &self.stages[i].1;
                    let before = braid_cuda::pool::allocated_bytes();
                    let set = self.inner.stage_model().micro_saved(st, self.split)?;
                    self.made[i] += 1;
                    self.set_bytes[i] = braid_cuda::pool::allocated_bytes().saturating_sub(before);
                    set
                }
            };
            self.live.insert((stage, m), a);
        }
        Ok(self.live.get_mut(&(stage, m)).expect("inserted"))
    }

    /// Whether `a` and `b` run on this rank (a hand-over without a
    /// message).
    fn both_here(&self, a: usize, b: usize) -> bool {
        a % self.ranks == b % self.ranks
    }

    fn stream(&self) -> Stream {
        self.inner.compute_stream().borrowed()
    }

    /// Ends the step: every micro-batch's buffers back in the pool.
    fn end_step(&mut self) -> Result<()> {
        self.done = None;
        self.pending.clear();
        let keys: Vec<(usize, usize)> = self.live.keys().copied().collect();
        for (s, m) in keys {
            self.release(s, m)?;
        }
        Ok(())
    }
}

impl StagePasses<DeviceBuffer<f32>> for Passes {
    fn forward(&mut self, stage: usize, m: usize) -> Result<Option<f32>> {
        self.tidy()?;
        let i = self.local(stage)?;
        let st = self.stages[i].1.clone();
        // The previous stage on this rank hands its output over.
        if stage > 0 && self.both_here(stage - 1, stage) {
            let prev = self.stages[self.local(stage - 1)?].1.clone();
            self.saved(stage, m)?;
            let mut here = self.live.remove(&(stage, m)).expect("made above");
            let s = self.stream();
            let out = self.saved(stage - 1, m)?.output(&prev).map_err(e)?;
            copy_async(here.input_mut(&st).map_err(e)?, out, &s).map_err(e)?;
            self.live.insert((stage, m), here);
        }
        self.saved(stage, m)?;
        let mut set = self.live.remove(&(stage, m)).expect("made above");
        let rows = self.rows(m);
        let grad = self.grad;
        let mut model = self.inner.stage_model();
        model.swap(&mut set)?;
        let loss = model.forward(
            &st,
            &self.batch.tokens[rows.clone()],
            &self.batch.targets[rows],
            grad,
        );
        model.swap(&mut set)?;
        self.live.insert((stage, m), set);
        loss
    }

    fn backward(&mut self, stage: usize, m: usize, input_only: bool) -> Result<()> {
        self.tidy()?;
        if input_only && self.split {
            // The weight half comes later, from these buffers.
            self.pending.insert((stage, m));
        }
        let i = self.local(stage)?;
        let st = self.stages[i].1.clone();
        let mut set = self.live.remove(&(stage, m)).ok_or_else(|| {
            format!("stage {stage}: micro-batch {m}'s backward before its forward")
        })?;
        let mut acc = std::mem::replace(
            &mut self.acc,
            DeviceBuffer::zeros(self.inner.params().device(), 0).map_err(e)?,
        );
        let s = self.stream();
        let mut model = self.inner.stage_model();
        model.swap(&mut set)?;
        let ran = model.backward(&st, &set, &mut acc.window());
        model.swap(&mut set)?;
        self.acc = acc;
        ran?;
        if !st.first {
            // The input's gradient, kept where the input was (read no more).
            let model = self.inner.stage_model();
            copy_async(set.input_mut(&st).map_err(e)?, model.input_grad(), &s).map_err(e)?;
        }
        self.live.insert((stage, m), set);
        if stage > 0 && self.both_here(stage - 1, stage) {
            // The previous stage on this rank takes it over.
            let mut mine = self.live.remove(&(stage, m)).expect("inserted");
            let dst = self
                .live
                .get_mut(&(stage - 1, m))
                .ok_or_else(|| format!("stage {}: micro-batch {m} was not run", stage - 1))?;
            copy_async(dst.output_grad_mut(), &*mine.input_mut(&st).map_err(e)?, &s).map_err(e)?;
            self.live.insert((stage, m), mine);
            self.release(stage, m)?;
        }
        if st.first {
            self.release(stage, m)?;
        }
        Ok(())
    }

    fn backward_weights(&mut self, stage: usize, m: usize) -> Result<()> {
        self.tidy()?;
        if !self.pending.remove(&(stage, m)) {
            // (The f32 model ran the whole backward pass at the input half.)
            return Ok(());
        }
        let st = self.stages[self.local(stage)?].1.clone();
        let mut set = self
            .live
            .remove(&(stage, m))
            .ok_or_else(|| format!("stage {stage}: micro-batch {m}'s buffers are gone"))?;
        let mut acc = std::mem::replace(
            &mut self.acc,
            DeviceBuffer::zeros(self.inner.params().device(), 0).map_err(e)?,
        );
        let mut model = self.inner.stage_model();
        model.swap(&mut set)?;
        let ran = model.backward_weights(&st, &mut acc.window());
        model.swap(&mut set)?;
        self.acc = acc;
        self.live.insert((stage, m), set);
        ran?;
        self.release(stage, m)
    }

    fn output(&mut self, stage: usize, m: usize) -> Result<&DeviceBuffer<f32>> {
        self.tidy()?;
        let st = self.stages[self.local(stage)?].1.clone();
        self.saved(stage, m)?.output(&st).map_err(e)
    }

    fn input(&mut self, stage: usize, m: usize) -> Result<&mut DeviceBuffer<f32>> {
        self.tidy()?;
        let st = self.stages[self.local(stage)?].1.clone();
        self.saved(stage, m)?.input_mut(&st).map_err(e)
    }

    fn input_grad(&mut self, stage: usize, m: usize) -> Result<&DeviceBuffer<f32>> {
        self.tidy()?;
        // Sent out by the caller before the next call (the link copies
        // it): then the micro-batch's buffers are done with.
        self.done = Some((stage, m));
        let st = self.stages[self.local(stage)?].1.clone();
        Ok(&*self.saved(stage, m)?.input_mut(&st).map_err(e)?)
    }

    fn output_grad(&mut self, stage: usize, m: usize) -> Result<&mut DeviceBuffer<f32>> {
        self.tidy()?;
        Ok(self.saved(stage, m)?.output_grad_mut())
    }

    fn stamp(&mut self) -> Result<usize> {
        if self.marked == self.marks.len() {
            let device = self.acc.device().clone();
            self.marks.push(Event::timed(&device).map_err(e)?);
        }
        let s = self.stream();
        self.marks[self.marked].record(&s).map_err(e)?;
        self.marked += 1;
        Ok(self.marked - 1)
    }
}

impl Passes {
    /// Starts the step's time marks: waits for the stream to be idle (the
    /// previous step's update), then marks the origin.
    fn start_marks(&mut self) -> Result<()> {
        let s = self.stream();
        s.synchronize().map_err(e)?;
        let origin = match self.origin.take() {
            Some((ev, _)) => ev,
            None => Event::timed(self.acc.device()).map_err(e)?,
        };
        origin.record(&s).map_err(e)?;
        self.origin = Some((origin, super::gpt_cpu_stage::wall_seconds()));
        self.marked = 0;
        Ok(())
    }

    /// The step's marks in seconds of the host's wall clock (waits for
    /// the stream).
    fn mark_times(&mut self) -> Result<Vec<f64>> {
        self.stream().synchronize().map_err(e)?;
        let (o, h0) = self.origin.as_ref().ok_or("no time marks this step")?;
        self.marks[..self.marked]
            .iter()
            .map(|m| Ok(h0 + m.elapsed_ms(o).map_err(e)? as f64 / 1e3))
            .collect()
    }
}

/// A micro-batch's saved buffers, for either model form.
enum Saved {
    Mixed(MicroSaved),
    F32(F32MicroSaved),
}

impl Saved {
    fn input_mut(&mut self, st: &Stage) -> braid_cuda::Result<&mut DeviceBuffer<f32>> {
        match self {
            Saved::Mixed(m) => m.input_mut(st),
            Saved::F32(m) => m.input_mut(st),
        }
    }

    fn output(&self, st: &Stage) -> braid_cuda::Result<&DeviceBuffer<f32>> {
        match self {
            Saved::Mixed(m) => m.output(st),
            Saved::F32(m) => m.output(st),
        }
    }

    fn output_grad_mut(&mut self) -> &mut DeviceBuffer<f32> {
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
    fn micro_saved(&self, st: &Stage, split: bool) -> Result<Saved> {
        match self {
            StageModel::Mixed(m, ..) => m.micro_saved(st, split).map(Saved::Mixed),
            StageModel::F32(m, _) => m.micro_saved(st).map(Saved::F32),
        }
        .map_err(e)
    }

    fn no_micro_saved(&self) -> Result<Saved> {
        match self {
            StageModel::Mixed(m, ..) => m.no_micro_saved().map(Saved::Mixed),
            StageModel::F32(m, _) => m.no_micro_saved().map(Saved::F32),
        }
        .map_err(e)
    }

    fn set_loss_weight(&mut self, w: f32) {
        match self {
            StageModel::Mixed(m, ..) => m.set_loss_weight(w),
            StageModel::F32(m, _) => m.set_loss_weight(w),
        }
    }

    /// Swaps `set` with the buffers the model holds.
    fn swap(&mut self, set: &mut Saved) -> Result<()> {
        match (self, set) {
            (StageModel::Mixed(m, ..), Saved::Mixed(s)) => m.swap_micro(s),
            (StageModel::F32(m, _), Saved::F32(s)) => m.swap_micro(s),
            _ => return Err(mismatch()),
        }
        Ok(())
    }

    fn forward(
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

    fn backward(&mut self, st: &Stage, set: &Saved, g: &mut DeviceWindow<'_, f32>) -> Result<()> {
        match (self, set) {
            (StageModel::Mixed(m, pf, pb), Saved::Mixed(s)) => {
                m.stage_backward(st, *pf, *pb, s, g).map_err(e)
            }
            (StageModel::F32(m, pf), Saved::F32(s)) => m.stage_backward(st, *pf, s, g).map_err(e),
            _ => Err(mismatch()),
        }
    }

    /// The weight half of a split backward pass (the bf16 model's).
    fn backward_weights(&mut self, st: &Stage, g: &mut DeviceWindow<'_, f32>) -> Result<()> {
        match self {
            StageModel::Mixed(m, ..) => m.stage_backward_weights(st, g).map_err(e),
            StageModel::F32(..) => Ok(()),
        }
    }

    fn input_grad(&self) -> &DeviceBuffer<f32> {
        match self {
            StageModel::Mixed(m, ..) => m.input_grad(),
            StageModel::F32(m, _) => m.input_grad(),
        }
    }
}

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
    /// (checked), over `inner` (the bf16 engine of its parameters laid out
    /// by [`Layout::pipeline_stages`] for `stages`, given by global index,
    /// built for micro-batches of `b × t`).
    pub fn new(
        mut inner: GpuGpt,
        stages: Vec<(usize, Stage)>,
        schedule: Schedule,
        group: GpuCommunicator,
        b: usize,
        t: usize,
    ) -> Result<GpuStage> {
        crate::schedule::check::check(&schedule)?;
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
            && matches!(inner.stage_model(), StageModel::Mixed(..));
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
        Ok(GpuStage {
            passes: Passes {
                acc: DeviceBuffer::zeros(&device, len).map_err(e)?,
                inner,
                ranks: schedule.ranks,
                stages,
                b,
                t,
                free: (0..n).map(|_| Vec::new()).collect(),
                live: HashMap::new(),
                made: vec![0; n],
                set_bytes: vec![0; n],
                done: None,
                batch: TokenBatch::new(0, t),
                grad: false,
                marks: Vec::new(),
                marked: 0,
                origin: None,
                split,
                pending: Default::default(),
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

    /// [`timeline_report`](Self::timeline_report) as JSON, with the most
    /// micro-batches each stage held at once (and the bytes of one).
    pub fn timeline_json(&self) -> Option<serde_json::Value> {
        let mut doc = self.measured.to_json(&self.schedule)?;
        let p = &self.passes;
        doc["in_flight"] = p
            .stages
            .iter()
            .zip(p.made.iter().zip(&p.set_bytes))
            .map(|((i, _), (n, b))| serde_json::json!({"stage": i, "micro_batches": n, "bytes": b}))
            .collect();
        doc["pipeline_rank"] = self.rank.into();
        Some(doc)
    }

    /// The last step's timeline as a chart, and the measured idle
    /// fraction beside the theory's (printed at the end of a run).
    pub fn timeline_report(&self) -> Option<String> {
        let held: Vec<String> = self
            .passes
            .stages
            .iter()
            .zip(self.passes.made.iter().zip(&self.passes.set_bytes))
            .map(|((i, _), (n, b))| format!("stage {i}: {n} ({:.1} MB each)", *b as f64 / 1e6))
            .collect();
        let report = self.measured.report(&self.schedule)?;
        Some(format!(
            "{report}\nmicro-batches whose activations pipeline rank {} held at once, at most: {}",
            self.rank,
            held.join(", ")
        ))
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

    fn matrices(&self) -> Vec<Matrix> {
        self.passes.inner.matrices()
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
        let ended = self.passes.end_step();
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

    fn update(&mut self, grads: &DeviceBuffer<f32>, step: UpdateStep) -> Result<()> {
        match self.owns_grads {
            true => self.passes.inner.update(&self.passes.acc, step),
            false => self.passes.inner.update(grads, step),
        }
    }

    fn update_shard(&mut self, grads: &DeviceBuffer<f32>, step: UpdateStep) -> Result<()> {
        self.passes.inner.update_shard(grads, step)
    }

    fn shard_optimizer(&mut self, shard: &[Range<usize>]) -> Result<()> {
        self.passes.inner.shard_optimizer(shard)
    }

    fn state_bytes(&self) -> StateBytes {
        // The stage's own gradient buffer besides the strategy's.
        let mut s = self.passes.inner.state_bytes();
        s.grads += 4 * self.passes.acc.len() as u64;
        s
    }

    fn tensors(&self) -> Vec<NamedTensor> {
        super::stage_tensors(self.layout(), self.second_copy())
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

    fn synchronize(&mut self) -> Result<()> {
        self.passes.inner.synchronize()
    }

    fn stream(&self) -> Option<&Stream> {
        Some(self.passes.inner.compute_stream())
    }
}
