//! [`CpuStage`]: one pipeline rank's stages of the CPU GPT model as an
//! [`Engine`]. Its forward pass with gradients runs the whole step's
//! schedule on this rank — every micro-batch's forward and backward
//! passes, the activations and their gradients sent and received between
//! the pipeline's ranks ([`crate::pipeline`]) — accumulating the stage's
//! gradients; its backward units then hand them to the strategy (data
//! parallelism over the data dimension reduces them as usual). So the
//! training loop and the data-parallel strategies run unchanged.
//!
//! Every rank of a pipeline reads the same batch; micro-batch `m` is its
//! rows `m·b..(m+1)·b`. The loss is the last stage's, sent to every
//! pipeline rank. The tied token embedding lives on the first and the last
//! stage: their gradients are summed between the two every step, so the
//! copies stay equal; the last stage's copy is not saved in checkpoints,
//! nor counted twice in the gradient norm. Split backward passes (ZB-H1)
//! run in halves: the input half keeps each layer's output gradients in
//! the micro-batch's activations and the weight half forms the weight
//! gradients from them later (under activation checkpointing the whole
//! pass runs at the input half).

use super::describe::gpt_describe;
use super::gpt_cpu::CpuGpt;
use super::state::stage_tensors;
use crate::engine::{
    BlockGrads, Checkpointable, Engine, EngineInfo, LendsMemory, Matrix, NamedTensor,
    OptimizerState, ParamUnits, SavedBuffer, ShardedOptimizer, ShardedParams, StateBytes, Unit,
    UpdateStep,
};
use crate::pipeline::exec::{self, StagePasses};
use crate::pipeline::in_flight::InFlight;
use crate::pipeline::links::HostLinks;
use crate::pipeline::timeline::{self, Held, Measured};
use crate::schedule::check::Checked;
use crate::schedule::Schedule;
use crate::space::{Host, HostWindow};
use crate::Result;
use braid_comm::{Communicator, ReduceOp};
use braid_data::loader::TokenBatch;
use braid_model::{Activations, Block, Gpt, Layout, Stage};
use braid_trace::{scope, Cat};
use std::ops::Range;

/// One pipeline rank's stages on this machine's CPUs.
pub struct CpuStage {
    passes: Passes,
    links: HostLinks,
    schedule: Schedule,
    /// This rank in the pipeline group.
    rank: usize,
    /// The pipeline group (the loss, the norm).
    group: Communicator,
    /// The first and the last pipeline rank's own communicator (the tied
    /// embeddings' gradients); `None` on the ranks between.
    ends: Option<Communicator>,
    step: u64,
    /// The training steps' timelines.
    measured: Measured,
    /// The stage's buffer is the step's gradient buffer (no strategy
    /// reads gradients of its own).
    owns_grads: bool,
}

/// What the executor runs on: the stages' model, parameters, in-flight
/// activations and the step's gradients.
struct Passes {
    /// The parameters (this rank's stages' layout) and the optimizer.
    inner: CpuGpt,
    model: Gpt,
    /// This rank's stages: their global index and blocks.
    stages: Vec<(usize, Stage)>,
    /// Stages in the pipeline.
    total: usize,
    /// Micro-batch rows, tokens per row.
    b: usize,
    t: usize,
    checkpointing: bool,
    /// The activations of the micro-batches in flight.
    flight: InFlight<Activations<f32>>,
    /// The schedule splits backward passes (and the activations are kept
    /// whole: no checkpointing): the input half leaves the weight
    /// gradients to the weight half.
    split: bool,
    /// The step's batch (every micro-batch's rows).
    batch: TokenBatch,
    /// The step's gradients, accumulated over its micro-batches.
    acc: Vec<f32>,
    /// The step's time marks (the host's wall clock, seconds).
    stamps: Vec<f64>,
    /// Whether this step's passes keep what the backward pass needs
    /// (evaluation: a micro-batch's activations go back to the pool once
    /// its output has left).
    grad: bool,
    /// Under a parameter-sharded strategy (ZeRO-3 over the data
    /// dimension), the stage's whole parameters gathered for this step's
    /// schedule (the inner engine holds none); `None` otherwise.
    gathered: Option<Vec<f32>>,
}

/// What one stage's pass of one micro-batch works on.
struct Pass<'a> {
    model: &'a Gpt,
    stage: &'a Stage,
    params: &'a [f32],
    grads: &'a mut [f32],
    acts: &'a mut Activations<f32>,
    tokens: &'a [u32],
    targets: &'a [u32],
}

impl Passes {
    /// Where `stage` is among this rank's.
    fn local(&self, stage: usize) -> Result<usize> {
        self.flight.local(stage)
    }

    /// Rows of micro-batch `m`.
    fn rows(&self, m: usize) -> Range<usize> {
        m * self.b * self.t..(m + 1) * self.b * self.t
    }

    /// The activations of (`stage`, `m`), made when the pool has none.
    fn acts(&mut self, stage: usize, m: usize) -> Result<&mut Activations<f32>> {
        let Passes {
            model,
            stages,
            b,
            t,
            checkpointing,
            split,
            inner,
            flight,
            ..
        } = self;
        flight.get(stage, m, |i| {
            let mut a = model
                .stage_activations(&stages[i].1, *b, *t, *checkpointing)
                .map_err(|e| e.to_string())?;
            if *split {
                a.split_backward(inner.layout());
            }
            Ok(a)
        })
    }

    /// Runs `f` on stage `stage`'s pass of micro-batch `m`: the model, the
    /// stage, the parameters, the step's gradients, the micro-batch's
    /// activations and its rows' tokens and targets.
    fn with_micro<R>(
        &mut self,
        stage: usize,
        m: usize,
        f: impl FnOnce(Pass<'_>) -> std::result::Result<R, braid_model::StepError>,
    ) -> Result<R> {
        let i = self.local(stage)?;
        let _ = self.acts(stage, m)?;
        let rows = self.rows(m);
        let Passes {
            inner,
            model,
            stages,
            flight,
            batch,
            acc,
            gathered,
            ..
        } = self;
        f(Pass {
            model,
            stage: &stages[i].1,
            params: match gathered {
                Some(whole) => whole,
                None => inner.params(),
            },
            grads: acc,
            acts: flight.get_live(stage, m).expect("made above"),
            tokens: &batch.tokens[rows.clone()],
            targets: &batch.targets[rows],
        })
        .map_err(|e| e.to_string())
    }
}

impl StagePasses<[f32]> for Passes {
    fn forward(&mut self, stage: usize, m: usize) -> Result<Option<f32>> {
        self.flight.tidy()?;
        // The previous stage on this rank hands its output over.
        if stage > 0 && self.flight.both_here(stage - 1, stage) {
            let out = self.acts(stage - 1, m)?.output().to_vec();
            self.acts(stage, m)?.input_mut().copy_from_slice(&out);
            if !self.grad {
                self.flight.release(stage - 1, m)?;
            }
        }
        // (Traced as computation: `braid report` shows the waits between
        // a pipeline's passes as idle.)
        let _t = scope::start(None, Cat::Compute, || {
            format!("stage {stage} forward micro-batch {m}")
        });
        let loss = self.with_micro(stage, m, |p| {
            p.model
                .stage_forward(p.stage, p.params, p.acts, p.tokens, p.targets)
        })?;
        if !self.grad && stage + 1 == self.total {
            // Evaluation: the loss is all the last stage leaves.
            self.flight.release(stage, m)?;
        }
        Ok(loss)
    }

    fn backward(&mut self, stage: usize, m: usize, input_only: bool) -> Result<()> {
        self.flight.tidy()?;
        if input_only && self.split {
            // The weight half comes later, from these activations.
            self.flight.defer(stage, m);
        }
        // The next stage on this rank hands its input's gradient over.
        if stage + 1 < self.total && self.flight.both_here(stage, stage + 1) {
            let g = self.acts(stage + 1, m)?.residual_grad().to_vec();
            self.acts(stage, m)?.residual_grad_mut().copy_from_slice(&g);
            self.flight.release(stage + 1, m)?;
        }
        let _t = scope::start(None, Cat::Compute, || {
            format!("stage {stage} backward micro-batch {m}")
        });
        self.with_micro(stage, m, |p| {
            p.model.stage_backward(
                p.stage,
                p.params,
                p.grads,
                p.acts,
                p.tokens,
                p.targets,
                &mut |_, _| {},
            )
        })?;
        if stage == 0 {
            self.flight.release(stage, m)?;
        }
        Ok(())
    }

    fn backward_weights(&mut self, stage: usize, m: usize) -> Result<()> {
        self.flight.tidy()?;
        if !self.flight.undefer(stage, m) {
            // (Under checkpointing the whole pass ran at the input half.)
            return Ok(());
        }
        let _t = scope::start(None, Cat::Compute, || {
            format!("stage {stage} backward weights micro-batch {m}")
        });
        self.with_micro(stage, m, |p| {
            p.model.stage_backward_weights(p.stage, p.grads, p.acts)
        })?;
        self.flight.release(stage, m)
    }

    fn output(&mut self, stage: usize, m: usize) -> Result<&[f32]> {
        self.flight.tidy()?;
        if !self.grad {
            // Evaluation: sent out by the caller before the next call, and
            // no backward pass follows.
            self.flight.hand_out(stage, m);
        }
        Ok(self.acts(stage, m)?.output())
    }

    fn input(&mut self, stage: usize, m: usize) -> Result<&mut [f32]> {
        self.flight.tidy()?;
        Ok(self.acts(stage, m)?.input_mut())
    }

    fn input_grad(&mut self, stage: usize, m: usize) -> Result<&[f32]> {
        self.flight.tidy()?;
        // Sent out by the caller before the next call: then the
        // micro-batch's activations are done with.
        self.flight.hand_out(stage, m);
        Ok(self.acts(stage, m)?.residual_grad())
    }

    fn output_grad(&mut self, stage: usize, m: usize) -> Result<&mut [f32]> {
        self.flight.tidy()?;
        Ok(self.acts(stage, m)?.residual_grad_mut())
    }

    fn stamp(&mut self) -> Result<usize> {
        self.stamps.push(wall_seconds());
        Ok(self.stamps.len() - 1)
    }
}

/// The host's wall clock in seconds (shared by the processes of a host,
/// so the pipeline's ranks' marks compare).
pub(crate) fn wall_seconds() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

impl CpuStage {
    /// Pipeline rank `group.rank()`'s stages of the schedule `schedule`
    /// (checked where it was built), over `inner` (its parameters laid out by
    /// [`Layout::pipeline_stages`] for `stages`, given by global index),
    /// for micro-batches of `b × t`.
    pub fn new(
        mut inner: CpuGpt,
        stages: Vec<(usize, Stage)>,
        schedule: Checked,
        group: Communicator,
        b: usize,
        t: usize,
        checkpointing: bool,
    ) -> Result<CpuStage> {
        let schedule = schedule.into_schedule();
        let rank = group.rank();
        if group.size() != schedule.ranks {
            return Err(format!(
                "a pipeline group of {} ranks for a schedule of {}",
                group.size(),
                schedule.ranks
            ));
        }
        let layout = inner.layout().clone();
        // Each micro-batch in flight has its own activations: the
        // engine's whole set is never used.
        inner.release_activations();
        let links = HostLinks::new(&group)?;
        // The first and the last stage's ranks (the first stage's first;
        // one rank when both are on it).
        let last = schedule.rank_of(schedule.stages() - 1);
        let ends = match rank == 0 || rank == last {
            true => group.split(Some(0), rank as i64),
            false => group.split(None, 0),
        }
        .map_err(|e| format!("the pipeline's first and last rank's communicator: {e}"))?;
        // (A tensor-parallel rank's share runs with its group.)
        let model = inner.model().clone();
        let flight = InFlight::new(stages.iter().map(|(i, _)| *i).collect(), schedule.ranks);
        Ok(CpuStage {
            passes: Passes {
                acc: vec![0.0; layout.len],
                inner,
                model,
                total: schedule.stages(),
                stages,
                b,
                t,
                checkpointing,
                flight,
                split: !checkpointing
                    && schedule
                        .actions
                        .iter()
                        .flatten()
                        .any(|a| a.op == crate::schedule::Op::BackwardInput),
                batch: TokenBatch::new(0, t),
                stamps: Vec::new(),
                grad: true,
                gathered: None,
            },
            links,
            schedule,
            rank,
            group,
            ends,
            step: 0,
            measured: Measured::default(),
            owns_grads: false,
        })
    }

    /// Makes the stage's buffer the step's gradient buffer, for a strategy
    /// without data parallelism (one replica: nothing reduces gradients,
    /// which then need no second buffer). The strategy's buffer is empty,
    /// the engine has no backward units (its forward pass ran them), and
    /// the norm and the update read the stage's buffer. Not with
    /// gradient accumulation over several forward passes.
    pub fn owning_grads(mut self) -> CpuStage {
        self.owns_grads = true;
        self
    }

    /// Keeps `batch`, the step's every micro-batch, for the schedule.
    fn take_batch(&mut self, batch: &TokenBatch) -> Result<()> {
        let micro = self.schedule.micro_batches;
        let (b, t) = (self.passes.b, self.passes.t);
        if batch.b != micro * b || batch.t != t {
            return Err(format!(
                "a batch of {} x {} for {micro} micro-batches of {b} x {t}",
                batch.b, batch.t
            ));
        }
        self.passes.batch.clone_from(batch);
        Ok(())
    }

    /// Runs this rank's actions of the step's schedule (with `grad`; its
    /// forward passes alone without) on the batch taken: the loss of the
    /// last stage, to every pipeline rank; with `grad`, the step's
    /// gradients in the stage's buffer, the tied embeddings' summed.
    fn run_schedule(&mut self, grad: bool) -> Result<f32> {
        let micro = self.schedule.micro_batches;
        self.passes.stamps.clear();
        self.passes.grad = grad;
        let schedule = match grad {
            true => {
                self.passes.acc.fill(0.0);
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
            let at = &self.passes.stamps;
            let spans: Vec<_> = ran
                .spans
                .iter()
                .map(|(a, b, e)| (*a, at[*b], at[*e]))
                .collect();
            let t = timeline::gather(&schedule, &spans, &self.group)?;
            self.measured.add(t);
        }
        let losses = ran.losses;
        // The last stage's mean over the micro-batches, to every rank.
        let mut loss = [losses.iter().map(|(_, l)| *l as f64).sum::<f64>() / micro as f64];
        self.group
            .broadcast(&mut loss, self.last_rank())
            .map_err(|e| format!("the loss from the last pipeline stage: {e}"))?;
        if grad {
            self.sum_tied()?;
            let scale = 1.0 / micro as f32;
            self.passes.acc.iter_mut().for_each(|g| *g *= scale);
        }
        Ok(loss[0] as f32)
    }

    fn layout(&self) -> &Layout {
        self.passes.inner.layout()
    }

    /// The gradient elements backward unit `unit` hands on ([`Engine::units`]'
    /// ranges, without their names: asked for every unit of every step).
    fn unit_range(&self, unit: usize) -> Result<Range<usize>> {
        let blocks = &self.layout().blocks;
        match self.owns_grads {
            false => blocks.iter().rev().nth(unit).map(|(_, r)| r.clone()),
            true => None,
        }
        .ok_or_else(|| format!("backward unit {unit} does not exist"))
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
        let mut theirs = vec![0.0f32; er.len()];
        // Over the two ends' own communicator: the stages between take no
        // part in it (on the pipeline group an exchange of two ranks would
        // leave the others' operation count behind, which TCP refuses).
        let ends = self
            .ends
            .as_ref()
            .ok_or("the first and last stage have no communicator of their own")?;
        // The peer's place in it: the first rank is 0 there.
        let peer_at = usize::from(self.rank == first);
        ends.send_recv(
            &self.passes.acc[er.clone()],
            peer_at,
            &mut theirs,
            peer_at,
            1,
        )
        .map_err(|e| format!("summing the tied embeddings' gradients with rank {peer}: {e}"))?;
        for (g, o) in self.passes.acc[er].iter_mut().zip(&theirs) {
            *g += o;
        }
        Ok(())
    }

    /// Σ x² of `values` at the flat positions `ranges` (held one after
    /// another), the second copy of the tied embeddings left out, summed
    /// over the tensor group (by the inner engine: what every rank of it
    /// holds whole counted once) and the pipeline group.
    fn sq_norm(&mut self, values: &Vec<f32>, ranges: &[Range<usize>]) -> Result<f64> {
        let skip = match self.second_copy() {
            true => self.layout().block_range(Block::Embedding),
            false => 0..0,
        };
        let inner = &mut self.passes.inner;
        let local = match skip.is_empty() {
            // Nothing left out: no copy.
            true => inner.grad_sq_norm_compact(values, ranges)?,
            false => {
                let (mut kept, mut kept_ranges) = (Vec::new(), Vec::new());
                let mut at = 0;
                for r in ranges {
                    // The parts of `r` before and after the skipped block.
                    let cut = |x: usize| x.clamp(r.start, r.end);
                    for part in [
                        r.start..cut(skip.start),
                        cut(skip.end.max(skip.start))..r.end,
                    ] {
                        if !part.is_empty() {
                            kept.extend_from_slice(
                                &values[at + part.start - r.start..at + part.end - r.start],
                            );
                            kept_ranges.push(part);
                        }
                    }
                    at += r.len();
                }
                inner.grad_sq_norm_compact(&kept, &kept_ranges)?
            }
        };
        let mut sum = [local];
        self.group
            .all_reduce(&mut sum, ReduceOp::Sum)
            .map_err(|e| format!("the gradient norm over the pipeline: {e}"))?;
        Ok(sum[0])
    }

    /// What this rank's stages held at once.
    fn held(&self) -> Held<'_> {
        Held {
            rank: self.rank,
            stages: self.passes.stages.iter().map(|(i, _)| *i).collect(),
            made: self.passes.flight.made(),
            bytes: None,
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
    pub fn into_params(self) -> braid_model::Params {
        self.passes.inner.into_params()
    }
}

impl Engine for CpuStage {
    type Space = Host;
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
            "f32 on the CPU, pipeline rank {} of {} ({}), schedule {}, {} micro-batches",
            self.rank,
            self.schedule.ranks,
            stages.join(", "),
            self.schedule.name,
            self.schedule.micro_batches
        );
        gpt_describe(&ly.config, self.passes.b, self.passes.t, &how)
    }

    fn params(&self) -> &Vec<f32> {
        self.passes.inner.params()
    }

    fn params_mut(&mut self) -> &mut Vec<f32> {
        self.passes.inner.params_mut()
    }

    fn params_changed(&mut self) -> Result<()> {
        // An offloaded optimizer's master weights follow.
        self.passes.inner.params_changed()
    }

    fn new_grads(&self) -> Result<Vec<f32>> {
        let len = match self.owns_grads {
            true => 0,
            false => self.layout().len,
        };
        Ok(vec![0.0; len])
    }

    fn zero_grads(&mut self, grads: &mut Vec<f32>) -> Result<()> {
        grads.fill(0.0);
        Ok(())
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
        self.passes.inner.whole("forward")?;
        self.take_batch(batch)?;
        self.run_schedule(grad)
    }

    fn backward_unit(&mut self, unit: usize, grads: &mut HostWindow<'_>) -> Result<()> {
        let r = self.unit_range(unit)?;
        let g = grads.prefix_mut()?;
        if g.len() < r.end {
            return Err(format!(
                "backward unit {unit} writes gradients up to {} but only {} are still being written",
                r.end,
                g.len()
            ));
        }
        for (d, s) in g[r.clone()].iter_mut().zip(&self.passes.acc[r]) {
            *d += s;
        }
        Ok(())
    }

    fn grad_sq_norm(&mut self, grads: &Vec<f32>) -> Result<f64> {
        if self.owns_grads {
            let acc = std::mem::take(&mut self.passes.acc);
            let norm = self.sq_norm(&acc, std::slice::from_ref(&(0..acc.len())));
            self.passes.acc = acc;
            return norm;
        }
        self.sq_norm(grads, std::slice::from_ref(&(0..grads.len())))
    }

    fn update(&mut self, grads: &Vec<f32>, step: UpdateStep) -> Result<()> {
        match self.owns_grads {
            true => self.passes.inner.update(&self.passes.acc, step),
            false => self.passes.inner.update(grads, step),
        }
    }

    fn synchronize(&mut self) -> Result<()> {
        Ok(())
    }
}

impl EngineInfo for CpuStage {
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

impl ShardedOptimizer for CpuStage {
    fn grad_sq_norm_of(&mut self, grads: &Vec<f32>, ranges: &[Range<usize>]) -> Result<f64> {
        crate::engine::check_shard(ranges, grads.len())?;
        let values: Vec<f32> = ranges
            .iter()
            .flat_map(|r| grads[r.clone()].to_vec())
            .collect();
        self.sq_norm(&values, ranges)
    }

    fn grad_sq_norm_compact(&mut self, compact: &Vec<f32>, ranges: &[Range<usize>]) -> Result<f64> {
        self.sq_norm(compact, ranges)
    }

    fn update_shard(&mut self, grads: &Vec<f32>, step: UpdateStep) -> Result<()> {
        self.passes.inner.update_shard(grads, step)
    }

    fn shard_optimizer(&mut self, shard: &[Range<usize>]) -> Result<()> {
        self.passes.inner.shard_optimizer(shard)
    }
}

/// The stage's parameter blocks are its layout's (the embeddings, each
/// layer, the final norm); its one forward unit is the whole schedule,
/// reading every block; each backward unit hands on one block's
/// gradients, made by the schedule, reading none. So a strategy that
/// shards gradients or parameters over the data dimension (ZeRO-2, ZeRO-3)
/// gathers the stage's parameters for the step's schedule and
/// reduce-scatters each block's gradients after it — as FSDP under a
/// pipeline does when it keeps the gathered parameters from the forward
/// passes to the backward ones and accumulates the micro-batches'
/// gradients before reducing them.
impl BlockGrads for CpuStage {
    fn param_units(&self) -> Result<ParamUnits> {
        let units = self.units();
        if units.is_empty() {
            return Err(
                "the stage's buffer is the step's gradient buffer (one replica): no strategy \
                 shards it"
                    .into(),
            );
        }
        let mut blocks: Vec<Range<usize>> = units.iter().map(|u| u.finalizes.clone()).collect();
        blocks.sort_by_key(|r| r.start);
        let index = |r: &Range<usize>| blocks.iter().position(|b| b == r).unwrap_or(usize::MAX);
        Ok(ParamUnits {
            forward: vec![(0..blocks.len()).collect()],
            backward_reads: vec![Vec::new(); units.len()],
            backward_writes: units.iter().map(|u| vec![index(&u.finalizes)]).collect(),
            blocks,
        })
    }

    fn backward_unit_into(&mut self, unit: usize, grads: &mut [&mut Vec<f32>]) -> Result<()> {
        let r = self.unit_range(unit)?;
        match grads {
            [g] if g.len() == r.len() => {
                for (d, s) in g.iter_mut().zip(&self.passes.acc[r]) {
                    *d += s;
                }
                Ok(())
            }
            _ => Err(format!(
                "backward unit {unit} writes one block of {} elements: given {:?}",
                r.len(),
                grads.iter().map(|g| g.len()).collect::<Vec<_>>()
            )),
        }
    }
}

impl ShardedParams for CpuStage {
    fn shard_params(&mut self, shard: &[Range<usize>]) -> Result<Vec<f32>> {
        self.passes.inner.shard_params(shard)
    }

    fn unshard_params(&mut self, full: Vec<f32>) -> Result<()> {
        self.passes.inner.unshard_params(full)
    }

    fn forward_begin(&mut self, batch: &TokenBatch, grad: bool) -> Result<()> {
        self.passes.inner.in_units("forward")?;
        self.passes.grad = grad;
        self.take_batch(batch)
    }

    fn forward_unit(&mut self, unit: usize, params: &[&Vec<f32>]) -> Result<Option<f32>> {
        self.passes.inner.in_units("forward")?;
        let units = self.param_units()?;
        let lens: Vec<usize> = params.iter().map(|p| p.len()).collect();
        units.forward_given(unit, &lens)?;
        // The blocks follow one another from 0: the whole stage, for the
        // schedule's passes, and dropped after them (the backward units
        // read no parameters).
        self.passes.gathered = Some(params.iter().flat_map(|p| p.iter().copied()).collect());
        let loss = self.run_schedule(self.passes.grad);
        self.passes.gathered = None;
        loss.map(Some)
    }

    fn backward_unit_of(
        &mut self,
        unit: usize,
        params: &[&Vec<f32>],
        grads: &mut [&mut Vec<f32>],
    ) -> Result<()> {
        if !params.is_empty() {
            return Err(format!(
                "backward unit {unit} reads no parameters: given {} blocks",
                params.len()
            ));
        }
        self.backward_unit_into(unit, grads)
    }

    fn update_compact(
        &mut self,
        params: &mut Vec<f32>,
        grads: &Vec<f32>,
        step: UpdateStep,
    ) -> Result<()> {
        self.passes.inner.update_compact(params, grads, step)
    }
}

/// The stage's activations keep memory of their own, as the CPU model's.
impl LendsMemory for CpuStage {
    fn grads_by_unit(&mut self) -> Result<Option<Vec<Vec<Range<usize>>>>> {
        self.passes.inner.grads_by_unit()
    }

    fn saved_buffers(&mut self) -> Result<Vec<SavedBuffer>> {
        self.passes.inner.saved_buffers()
    }

    unsafe fn place_saved(&mut self, memory: &Vec<f32>, at: &[Option<usize>]) -> Result<usize> {
        // SAFETY: the caller's promise about `memory` is passed on
        // unchanged; the CPU model places nothing in it.
        unsafe { self.passes.inner.place_saved(memory, at) }
    }

    fn drop_saved(&mut self) -> Result<()> {
        self.passes.inner.drop_saved()
    }

    fn own_saved(&mut self) -> Result<()> {
        self.passes.inner.own_saved()
    }
}

impl Checkpointable for CpuStage {
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
