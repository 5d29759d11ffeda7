//! The training loop — one loop for every engine and every strategy:
//! batches from a [`Loader`], forward/backward (gradients accumulated over
//! micro-batches, only the last one communicating), the strategy's hooks,
//! clipping and the learning-rate schedule folded into one optimizer
//! update, periodic evaluation, and a per-step timing breakdown.
//!
//! The loop owns the loss scale: each micro-batch's gradient is that of
//! its mean loss, strategies sum gradients over replicas, and the update
//! divides once by `replicas × micro-batches` (as the gradient of the mean
//! over the whole global batch), together with the clipping factor.

use crate::checkpoint::{Checkpointer, StateSource};
use crate::engine::{Checkpointable, Engine, LendsMemory, ShardedBytes, StateBytes, UpdateStep};
use crate::memory_phase::{self, Phase};
use crate::space::Space;
use crate::step_trace::StepTrace;
use crate::strategy::{CommStep, Strategy};
use crate::timeline::Timeline;
use crate::{test_delay, Result};
use braid_model::optim::Schedule;
use braid_trace::nvtx;
use braid_trace::recorder::{self, track};
use braid_trace::Cat;
use std::time::Instant;

pub use braid_data::loader::Loader;

/// A training run's loop settings.
#[derive(Debug, Clone)]
pub struct LoopOptions {
    /// Optimizer steps.
    pub steps: usize,
    /// Micro-batches per step (gradient accumulation; 1: none).
    pub accum: usize,
    /// Learning rate per step.
    pub schedule: Schedule,
    /// Clip the gradients' global norm to this (0: off).
    pub grad_clip: f64,
    /// Evaluate every this many steps and after the last (0: never).
    pub eval_every: usize,
    /// Batches per evaluation.
    pub eval_batches: usize,
    /// Apply the optimizer (false: time forward + backward only).
    pub update: bool,
    /// Steps before the engine's per-phase profile starts counting (and
    /// before step times count in the summary).
    pub profile_warmup: usize,
    /// After the last step, time the strategy's reductions with nothing
    /// to overlap them (what overlap saves is measured against this).
    pub measure_unoverlapped: bool,
    /// With one micro-batch per step and a strategy that allows it, lend
    /// the gradient buffer's memory to the engine's saved activations
    /// until the backward pass writes it ([`crate::lend`]).
    pub saved_in_grads: bool,
    /// Keep a host copy of the first step's gradients, as the update sees
    /// them (summed over the ranks and micro-batches, not yet divided,
    /// clipped or scaled), in [`RunReport::first_grads`]: a diagnostic
    /// for one process (`BRAID_DUMP_GRADS`), comparing one step with
    /// another trainer's.
    pub keep_first_grads: bool,
}

impl LoopOptions {
    /// Whether the held-out loss is measured after 0-based `step`.
    pub fn evaluates_after(&self, step: usize) -> bool {
        self.eval_every > 0 && ((step + 1) % self.eval_every == 0 || step + 1 == self.steps)
    }
}

/// Where one step's time went (seconds, on the engine's clock).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepTimes {
    /// The whole step (host clock).
    pub total: f64,
    /// Waiting for batches.
    pub data: f64,
    /// Forward and backward computation.
    pub compute: f64,
    /// Communication that did not overlap the computation: from the end of
    /// the backward computation until the gradients were reduced, the
    /// collectives' work on the engine's own stream inside the backward
    /// pass ([`CommStep::in_stream_s`]), and the all-reduce of the step's
    /// loss after it (which waits for the slowest rank, so a trace counts
    /// it as communication too).
    pub exposed_comm: f64,
    /// Gradient norm, clipping and the update (with the strategy's
    /// after-update work).
    pub optimizer: f64,
}

/// What happened at one step.
#[derive(Debug, Clone)]
pub struct StepReport {
    /// 0-based step.
    pub step: usize,
    /// Training loss (mean over the global batch).
    pub loss: f32,
    /// Gradient norm before clipping.
    pub grad_norm: f64,
    /// Learning rate used.
    pub lr: f32,
    /// Tokens (or samples) per second over all ranks.
    pub tokens_per_s: f64,
    /// Held-out loss, when evaluated at this step.
    pub eval_loss: Option<f32>,
    /// Seconds since training started.
    pub elapsed: f64,
    /// Where the step's time went.
    pub times: StepTimes,
    /// The strategy's communication in this step.
    pub comm: CommStep,
}

/// A whole run.
#[derive(Debug, Clone)]
pub struct RunReport {
    /// Every step.
    pub steps: Vec<StepReport>,
    /// Seconds the strategy's reductions take per step with nothing to
    /// overlap them (when asked for, and the strategy communicates).
    pub unoverlapped_comm: Option<f64>,
    /// The model state this rank held (after the strategy's start: a
    /// sharded optimizer's state is its shard's).
    pub state: StateBytes,
    /// ZeRO-3's whole blocks held at once, at most, and the saved
    /// activations in its gradient shard.
    pub sharded: ShardedBytes,
    /// Bytes of the engine's saved activations that lived in the loop's
    /// gradient buffer ([`crate::lend`]; one process).
    pub saved_in_grads: u64,
    /// The parts of the last step, in order, each with the most device
    /// bytes live during it ([`crate::memory_phase`]; zeros on a CPU).
    pub memory_phases: Vec<(Phase, u64)>,
    /// The first step's gradients over the whole flat buffer, divided by
    /// the step's divisor (ranks × micro-batches), before clipping, where
    /// [`LoopOptions::keep_first_grads`] asked for them.
    pub first_grads: Option<Vec<f32>>,
    /// Device bytes the model's own buffers hold (activations and the
    /// passes' scratch, by the allocator's counters), where the caller
    /// measured them (0 otherwise).
    pub model_buffer_bytes: u64,
}

/// Trains `engine` under `strategy` on batches from `loader` (into
/// `batch`, reused); `progress` sees every step.
pub fn train<E, S, L>(
    engine: &mut E,
    strategy: &mut S,
    loader: &mut L,
    batch: &mut E::Batch,
    o: &LoopOptions,
    progress: &mut dyn FnMut(&StepReport),
) -> Result<RunReport>
where
    E: Checkpointable,
    S: Strategy<E> + ?Sized,
    L: Loader<E::Batch>,
{
    train_with(
        engine,
        strategy,
        loader,
        batch,
        o,
        Checkpoints::default(),
        progress,
    )
}

/// Checkpointing of a run: where it resumes from, and what saves it.
#[derive(Default)]
pub struct Checkpoints<'a> {
    /// Resume from this state: the strategy loads what its rank holds
    /// after its start, and the loop goes on from the step it was saved
    /// at, the loader skipping the micro-batches taken before.
    pub resume: Option<&'a dyn StateSource>,
    /// Saves as it says, in the background.
    pub save: Option<&'a mut Checkpointer>,
}

/// [`train`] with checkpoints: resumed from `ckpt.resume`, saved by
/// `ckpt.save`. The gradient buffer is the loop's own: lending it to the
/// engine's saved activations ([`LoopOptions::saved_in_grads`]) takes an
/// engine that [`LendsMemory`], through [`train_lending`].
pub fn train_with<E, S, L>(
    engine: &mut E,
    strategy: &mut S,
    loader: &mut L,
    batch: &mut E::Batch,
    o: &LoopOptions,
    ckpt: Checkpoints<'_>,
    progress: &mut dyn FnMut(&StepReport),
) -> Result<RunReport>
where
    E: Checkpointable,
    S: Strategy<E> + ?Sized,
    L: Loader<E::Batch>,
{
    start(engine, strategy, o)?;
    let mut grads = strategy.new_grads(engine)?;
    run_steps(
        engine, strategy, loader, batch, o, ckpt, &mut grads, progress,
    )
}

/// The loop's checks and the strategy's start (before the gradient
/// buffer is made).
fn start<E, S>(engine: &mut E, strategy: &mut S, o: &LoopOptions) -> Result<()>
where
    E: Engine,
    S: Strategy<E> + ?Sized,
{
    if o.accum == 0 {
        return Err("--accum must be at least 1".into());
    }
    memory_phase::enter(Phase::Start);
    strategy.start(engine)?;
    memory_phase::enter(Phase::Idle);
    Ok(())
}

/// [`train_with`] for an engine that [`LendsMemory`]: with one
/// micro-batch per step and a strategy that allows it
/// ([`LoopOptions::saved_in_grads`], [`Strategy::lends_whole_grads`]),
/// the gradient buffer's memory is lent to the engine's saved activations
/// until the backward pass writes it ([`crate::lend`]).
pub fn train_lending<E, S, L>(
    engine: &mut E,
    strategy: &mut S,
    loader: &mut L,
    batch: &mut E::Batch,
    o: &LoopOptions,
    ckpt: Checkpoints<'_>,
    progress: &mut dyn FnMut(&StepReport),
) -> Result<RunReport>
where
    E: Checkpointable + LendsMemory,
    S: Strategy<E> + ?Sized,
    L: Loader<E::Batch>,
{
    start(engine, strategy, o)?;
    let by_unit = match o.saved_in_grads && o.accum == 1 && strategy.lends_whole_grads() {
        true => engine.grads_by_unit()?,
        false => None,
    };
    let mut grads = strategy.new_grads(engine)?;
    let Some(first) = by_unit else {
        return run_steps(
            engine, strategy, loader, batch, o, ckpt, &mut grads, progress,
        );
    };
    // SAFETY: `grads` stays until `own_saved` below has run, on every
    // path; meanwhile only the engine's backward units write it before
    // they are through with a step (the strategy says so: it lends).
    let lent = unsafe { crate::lend::saved_to_grads(engine, &grads, &first) };
    let (run, lent) = match lent {
        Ok(lent) => (
            run_steps(
                engine, strategy, loader, batch, o, ckpt, &mut grads, progress,
            ),
            lent,
        ),
        Err(e) => (Err(e), 0),
    };
    let owned = engine.own_saved();
    let mut run = run?;
    owned?;
    run.saved_in_grads = lent as u64;
    Ok(run)
}

/// [`train_with`]'s (and [`train_lending`]'s) steps, after the
/// strategy's start, into `grads`.
#[allow(clippy::too_many_arguments)]
fn run_steps<E, S, L>(
    engine: &mut E,
    strategy: &mut S,
    loader: &mut L,
    batch: &mut E::Batch,
    o: &LoopOptions,
    ckpt: Checkpoints<'_>,
    grads: &mut <E::Space as Space>::Flat,
    progress: &mut dyn FnMut(&StepReport),
) -> Result<RunReport>
where
    E: Checkpointable,
    S: Strategy<E> + ?Sized,
    L: Loader<E::Batch>,
{
    let Checkpoints { resume, mut save } = ckpt;
    let rank = strategy.rank();
    let first = match resume {
        None => match strategy.joined_at() {
            Some(k) if k > 0 => {
                loader.skip_to(k.min(o.steps) * o.accum)?;
                k.min(o.steps)
            }
            _ => 0,
        },
        Some(from) => {
            strategy.restore(engine, from)?;
            let k = usize::try_from(from.step()).map_err(|_| "checkpoint step".to_string())?;
            if k > o.steps {
                return Err(format!(
                    "the checkpoint was saved after step {k}, past this run's {} steps (raise --steps)",
                    o.steps
                ));
            }
            loader.skip_to(k * o.accum)?;
            k
        }
    };
    if let (Some(ck), true) = (save.as_deref_mut(), o.update) {
        // The saves' host memory is made while the first steps run.
        let len: usize = strategy.save_ranges(engine)?.iter().map(|r| r.len()).sum();
        let (_, moments) = engine.optimizer_moments()?;
        let device = engine.stream().map(|s| s.device().clone());
        ck.staging(device.as_ref()).prepare(len, 1 + moments.len());
    }
    let (own, engine_state) = (strategy.state_bytes(), engine.state_bytes());
    let state = StateBytes {
        params: engine_state.params + own.params,
        master: engine_state.master + own.master,
        grads: 4 * <E::Space as Space>::len(grads) as u64 + engine_state.grads + own.grads,
        optimizer: engine_state.optimizer + own.optimizer,
        offloaded: engine_state.offloaded + own.offloaded,
    };
    same_loop_everywhere(strategy, o, rank)?;
    let mut tl = Timeline::new();
    let global_items = (loader.items_per_batch() * o.accum * strategy.replicas()) as f64;
    let divide = (strategy.replicas() * o.accum) as f64;
    let start = Instant::now();
    let mut reports = Vec::with_capacity(o.steps);
    let mut memory_phases = Vec::new();
    let mut first_grads = None;
    for step in first..o.steps {
        if step == o.profile_warmup.min(o.steps / 2) {
            engine.profile_reset();
        }
        let t0 = Instant::now();
        tl.clear();
        // This step's parts are logged afresh (evaluation's and saving's
        // belong to no step).
        memory_phase::take();
        let mut trace = StepTrace::begin(engine.stream())?;
        // NVTX ranges for Nsight (where a tool is attached): the step and
        // its parts, on the host's timeline around the work they queue.
        let step_range = nvtx::range(|| format!("step {}", step + 1));
        let m_start = tl.mark(engine.stream())?;
        strategy.zero_grads(engine, grads)?;
        let mut data = 0.0;
        let mut loss_sum = 0.0f64;
        let mut m_computed = m_start;
        let mut straggled = std::time::Duration::ZERO;
        for micro in 0..o.accum {
            let td = Instant::now();
            let data_range = nvtx::range_str("data");
            loader.next_train(batch)?;
            test_delay::apply(rank, "data");
            drop(data_range);
            let tde = Instant::now();
            data += tde.duration_since(td).as_secs_f64();
            if trace.on() {
                let args = vec![("micro_batch", micro.into())];
                recorder::record_between("data", Cat::Data, track::HOST, td, tde, args);
            }
            let m_f0 = trace.mark(&mut tl, engine.stream())?;
            memory_phase::enter(Phase::Forward);
            let forward_range = nvtx::range_str("forward");
            let loss = strategy.forward(engine, batch, true)?;
            drop(forward_range);
            test_delay::apply(rank, "compute");
            if micro + 1 == o.accum {
                straggled = test_delay::straggle(rank, step, t0.elapsed());
            }
            let m_f1 = trace.mark(&mut tl, engine.stream())?;
            trace.between("forward", Cat::Pass, m_f0, m_f1, micro);
            if !loss.is_finite() {
                return Err(format!(
                    "rank {rank}, step {step}: the loss is {loss} (lower --lr?)"
                ));
            }
            loss_sum += loss as f64;
            memory_phase::enter(Phase::Backward);
            let _backward_range = nvtx::range_str("backward");
            if micro + 1 < o.accum {
                strategy.accumulate(engine, grads)?;
                let m_b = trace.mark(&mut tl, engine.stream())?;
                trace.between("backward", Cat::Pass, m_f1, m_b, micro);
            } else {
                m_computed = strategy.backward(engine, grads, &mut tl)?;
                trace.between("backward", Cat::Pass, m_f1, m_computed, micro);
            }
        }
        test_delay::stepped(rank, t0.elapsed().saturating_sub(straggled));
        {
            let _wait_range = nvtx::range_str("wait for reductions");
            strategy.before_update(engine, grads)?;
        }
        let m_reduced = tl.mark(engine.stream())?;
        if o.keep_first_grads && first_grads.is_none() {
            engine.synchronize()?;
            let n = <E::Space as Space>::len(grads);
            let mut host = vec![0.0f32; n];
            <E::Space as Space>::read_ranges_into(grads, std::slice::from_ref(&(0..n)), &mut host)?;
            let scale = (1.0 / divide) as f32;
            host.iter_mut().for_each(|g| *g *= scale);
            first_grads = Some(host);
        }
        let lr = o.schedule.lr(step);
        let mut grad_norm = 0.0;
        if o.update {
            memory_phase::enter(Phase::Update);
            let _optimizer_range = nvtx::range_str("optimizer");
            grad_norm = strategy.grad_sq_norm(engine, grads)?.sqrt() / divide;
            let clip = if o.grad_clip > 0.0 && grad_norm > o.grad_clip {
                o.grad_clip / (grad_norm + 1e-6)
            } else {
                1.0
            };
            strategy.update(
                engine,
                grads,
                UpdateStep {
                    lr,
                    step: step as u32 + 1,
                    grad_scale: ((clip as f32) as f64 / divide) as f32,
                },
            )?;
            strategy.after_update(engine)?;
        }
        let m_end = tl.mark(engine.stream())?;
        trace.between("wait for reductions", Cat::Wait, m_computed, m_reduced, 0);
        trace.between("optimizer", Cat::Optimizer, m_reduced, m_end, 0);
        engine
            .synchronize()
            .map_err(|e| format!("rank {rank}, step {}: {e}", step + 1))?;
        drop(step_range);
        memory_phase::enter(Phase::Idle);
        memory_phases = memory_phase::take();
        let mut mean = [loss_sum / o.accum as f64];
        let t_mean = Instant::now();
        strategy.mean(&mut mean)?;
        let loss_wait = t_mean.elapsed().as_secs_f64();
        let total = t0.elapsed().as_secs_f64();
        // The collectives' work queued on the engine's stream between its
        // backward units (the copy engines' sums) is communication, not
        // computation, though it ends before the pass does.
        let in_stream = strategy.last_step().in_stream_s;
        let times = StepTimes {
            total,
            data,
            compute: (tl.seconds(m_start, m_computed)? - data - in_stream).max(0.0),
            exposed_comm: tl.seconds(m_computed, m_reduced)? + in_stream + loss_wait,
            optimizer: tl.seconds(m_reduced, m_end)?,
        };
        trace.finish(
            &tl,
            step,
            t0,
            total,
            vec![("loss", (mean[0] as f32).into())],
        )?;
        let eval_loss = if o.evaluates_after(step) {
            let _s = braid_trace::span("evaluation", Cat::Eval, track::HOST);
            let _r = nvtx::range_str("evaluation");
            Some(evaluate(engine, strategy, loader, batch, o)?)
        } else {
            None
        };
        let r = StepReport {
            step,
            loss: mean[0] as f32,
            grad_norm,
            lr,
            tokens_per_s: global_items / total,
            eval_loss,
            elapsed: start.elapsed().as_secs_f64(),
            times,
            comm: strategy.last_step(),
        };
        progress(&r);
        reports.push(r);
        if let Some(ck) = save.as_deref_mut() {
            ck.poll(&mut |v| strategy.mean(v))?;
            if o.update && ck.due(step + 1, o.steps) {
                // The previous save first (its buffers come back for
                // this one): part of this save's stall.
                let t = Instant::now();
                ck.wait(&mut |v| strategy.mean(v))?;
                let waited_s = t.elapsed().as_secs_f64();
                let t = Instant::now();
                let device = engine.stream().map(|s| s.device().clone());
                let copy = braid_trace::span("checkpoint copy", Cat::Checkpoint, track::HOST);
                let copy_range = nvtx::range_str("checkpoint copy");
                let part = strategy.save_part(engine, ck.staging(device.as_ref()))?;
                drop((copy, copy_range));
                let stall = crate::checkpoint::save::Stall {
                    waited_s,
                    copied_s: t.elapsed().as_secs_f64(),
                };
                let (done, taken) = ((step + 1) as u64, ((step + 1) * o.accum) as u64);
                let (tensors, describe) = (engine.tensors(), engine.describe());
                ck.save(done, taken, part, tensors, describe, stall, &mut |v| {
                    strategy.mean(v)
                })?;
            }
        }
    }
    if let Some(ck) = save {
        ck.wait(&mut |v| strategy.mean(v))?;
    }
    let unoverlapped_comm = if o.measure_unoverlapped {
        strategy.time_unoverlapped(engine, grads)?
    } else {
        None
    };
    let sharded = strategy.sharded_bytes();
    memory_phase::enter(Phase::Finish);
    strategy.finish(engine)?;
    memory_phase::enter(Phase::Idle);
    test_delay::apply(rank, "end");
    Ok(RunReport {
        steps: reports,
        unoverlapped_comm,
        state,
        sharded,
        saved_in_grads: 0,
        memory_phases,
        first_grads,
        model_buffer_bytes: 0,
    })
}

/// Checks that every rank the strategy averages over runs the same
/// number of steps of the same micro-batches, evaluating as often (one
/// small mean at the start): a rank that would stop early, or
/// communicate at other steps, would leave the others waiting for it
/// until the timeout. Equal values have a variance of exactly 0 over the
/// ranks (small integers, exact in f64); any difference shows on every
/// rank.
fn same_loop_everywhere<E, S>(strategy: &mut S, o: &LoopOptions, rank: usize) -> Result<()>
where
    E: Engine,
    S: Strategy<E> + ?Sized,
{
    let settings = [
        ("--steps", o.steps as f64),
        ("--accum", o.accum as f64),
        ("--eval-every", o.eval_every as f64),
    ];
    let mut moments: Vec<f64> = settings.iter().flat_map(|&(_, v)| [v, v * v]).collect();
    strategy.mean(&mut moments)?;
    let differ: Vec<String> = settings
        .iter()
        .zip(moments.chunks(2))
        .filter(|(_, m)| m[1] - m[0] * m[0] != 0.0)
        .map(|((flag, v), m)| {
            format!(
                "{flag} is {v} here and {:.4} on average over the ranks",
                m[0]
            )
        })
        .collect();
    match differ.is_empty() {
        true => Ok(()),
        false => Err(format!(
            "rank {rank}: the ranks run different loops: {} (start every rank with the same \
             --steps, --accum and --eval-every)",
            differ.join("; ")
        )),
    }
}

/// The mean held-out loss over the evaluation batches of every rank.
fn evaluate<E, S, L>(
    engine: &mut E,
    strategy: &mut S,
    loader: &mut L,
    batch: &mut E::Batch,
    o: &LoopOptions,
) -> Result<f32>
where
    E: Engine,
    S: Strategy<E> + ?Sized,
    L: Loader<E::Batch>,
{
    memory_phase::enter(Phase::Evaluation);
    let k = o.eval_batches.max(1);
    let mut sum = 0.0f64;
    for i in 0..k {
        loader.eval(i, batch)?;
        sum += strategy.forward(engine, batch, false)? as f64;
    }
    let mut mean = [sum / k as f64];
    strategy.mean(&mut mean)?;
    Ok(mean[0] as f32)
}
