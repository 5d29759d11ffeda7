//! What a [`GpuStage`](super::GpuStage)'s executor runs on: the engine,
//! the micro-batches' saved buffers in flight (made, reused and released
//! as the schedule goes), the step's gradients, and the time marks on the
//! compute stream.

use super::err::e;
use super::model::Saved;
use crate::engines::gpt_gpu::GpuGpt;
use crate::pipeline::exec::StagePasses;
use crate::pipeline::in_flight::InFlight;
use crate::Result;
use braid_cuda::memory::copy_async;
use braid_cuda::{DeviceBuffer, Event, Stream};
use braid_data::loader::TokenBatch;
use braid_model::Stage;
use std::ops::Range;

/// What the executor runs on: the engine (parameters, optimizer, model),
/// the micro-batches' saved buffers in flight and the step's gradients.
pub(super) struct Passes {
    pub(super) inner: GpuGpt,
    /// This rank's stages: their global index and blocks.
    pub(super) stages: Vec<(usize, Stage)>,
    /// Micro-batch rows, tokens per row.
    pub(super) b: usize,
    pub(super) t: usize,
    /// The saved buffers of the micro-batches in flight.
    pub(super) flight: InFlight<Saved>,
    /// Per stage of this rank: the device bytes of one set of them.
    pub(super) set_bytes: Vec<usize>,
    /// The step's batch (every micro-batch's rows).
    pub(super) batch: TokenBatch,
    /// Whether this step's passes keep what the backward pass needs.
    pub(super) grad: bool,
    /// The step's gradients, added up over its micro-batches.
    pub(super) acc: DeviceBuffer<f32>,
    /// The schedule splits backward passes and the model can: the input
    /// half defers the weight gradients to the weight half.
    pub(super) split: bool,
    /// Time marks on the compute stream: reused timed events, how many
    /// the step recorded, and the step's first and last marks (the last
    /// puts them on the host's clock, [`Passes::mark_times`]).
    pub(super) marks: Vec<Event>,
    pub(super) marked: usize,
    pub(super) origin: Option<(Event, Event)>,
}

impl Passes {
    /// Where `stage` is among this rank's.
    pub(super) fn local(&self, stage: usize) -> Result<usize> {
        self.flight.local(stage)
    }

    /// Rows of micro-batch `m`.
    pub(super) fn rows(&self, m: usize) -> Range<usize> {
        m * self.b * self.t..(m + 1) * self.b * self.t
    }

    /// The saved buffers of (`stage`, `m`), made when the pool has none.
    pub(super) fn saved(&mut self, stage: usize, m: usize) -> Result<&mut Saved> {
        let Passes {
            inner,
            stages,
            flight,
            set_bytes,
            split,
            ..
        } = self;
        flight.get(stage, m, |i| {
            let before = braid_cuda::pool::allocated_bytes();
            let set = inner.stage_model().micro_saved(&stages[i].1, *split)?;
            set_bytes[i] = braid_cuda::pool::allocated_bytes().saturating_sub(before);
            Ok(set)
        })
    }

    pub(super) fn stream(&self) -> Stream {
        self.inner.compute_stream().borrowed()
    }
}

impl StagePasses<DeviceBuffer<f32>> for Passes {
    fn forward(&mut self, stage: usize, m: usize) -> Result<Option<f32>> {
        self.flight.tidy()?;
        let i = self.local(stage)?;
        let st = self.stages[i].1.clone();
        // The previous stage on this rank hands its output over.
        if stage > 0 && self.flight.both_here(stage - 1, stage) {
            let prev = self.stages[self.local(stage - 1)?].1.clone();
            self.saved(stage, m)?;
            let mut here = self.flight.take(stage, m)?;
            let s = self.stream();
            let out = self.saved(stage - 1, m)?.output(&prev).map_err(e)?;
            copy_async(here.input_mut(&st).map_err(e)?, out, &s).map_err(e)?;
            self.flight.put(stage, m, here);
            if !self.grad {
                // Evaluation: no backward pass will read the previous
                // stage's buffers.
                self.flight.release(stage - 1, m)?;
            }
        }
        self.saved(stage, m)?;
        let mut set = self.flight.take(stage, m)?;
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
        self.flight.put(stage, m, set);
        if !self.grad && st.last {
            // Evaluation: the loss is all the last stage leaves.
            self.flight.release(stage, m)?;
        }
        loss
    }

    fn backward(&mut self, stage: usize, m: usize, input_only: bool) -> Result<()> {
        self.flight.tidy()?;
        if input_only && self.split {
            // The weight half comes later, from these buffers.
            self.flight.defer(stage, m);
        }
        let i = self.local(stage)?;
        let st = self.stages[i].1.clone();
        let mut set = self.flight.take(stage, m)?;
        let s = self.stream();
        let Passes { inner, acc, .. } = self;
        let mut model = inner.stage_model();
        model.swap(&mut set)?;
        let ran = model.backward(&st, &set, &mut acc.window());
        model.swap(&mut set)?;
        ran?;
        if !st.first {
            // The input's gradient, kept where the input was (read no more).
            let model = self.inner.stage_model();
            copy_async(set.input_mut(&st).map_err(e)?, &model.input_grad(), &s).map_err(e)?;
        }
        self.flight.put(stage, m, set);
        if stage > 0 && self.flight.both_here(stage - 1, stage) {
            // The previous stage on this rank takes it over.
            let mut mine = self.flight.take(stage, m)?;
            let dst = self
                .flight
                .get_live(stage - 1, m)
                .ok_or_else(|| format!("stage {}: micro-batch {m} was not run", stage - 1))?;
            copy_async(dst.output_grad_mut(), &*mine.input_mut(&st).map_err(e)?, &s).map_err(e)?;
            self.flight.put(stage, m, mine);
            self.flight.release(stage, m)?;
        }
        if st.first {
            self.flight.release(stage, m)?;
        }
        Ok(())
    }

    fn backward_weights(&mut self, stage: usize, m: usize) -> Result<()> {
        self.flight.tidy()?;
        if !self.flight.undefer(stage, m) {
            // (The f32 model ran the whole backward pass at the input half.)
            return Ok(());
        }
        let st = self.stages[self.local(stage)?].1.clone();
        let mut set = self.flight.take(stage, m)?;
        let Passes { inner, acc, .. } = self;
        let mut model = inner.stage_model();
        model.swap(&mut set)?;
        let ran = model.backward_weights(&st, &mut acc.window());
        model.swap(&mut set)?;
        self.flight.put(stage, m, set);
        ran?;
        self.flight.release(stage, m)
    }

    fn output(&mut self, stage: usize, m: usize) -> Result<&DeviceBuffer<f32>> {
        self.flight.tidy()?;
        if !self.grad {
            // Evaluation: sent out by the caller before the next call (the
            // link copies it), and no backward pass follows.
            self.flight.hand_out(stage, m);
        }
        let st = self.stages[self.local(stage)?].1.clone();
        self.saved(stage, m)?.output(&st).map_err(e)
    }

    fn input(&mut self, stage: usize, m: usize) -> Result<&mut DeviceBuffer<f32>> {
        self.flight.tidy()?;
        let st = self.stages[self.local(stage)?].1.clone();
        self.saved(stage, m)?.input_mut(&st).map_err(e)
    }

    fn input_grad(&mut self, stage: usize, m: usize) -> Result<&DeviceBuffer<f32>> {
        self.flight.tidy()?;
        // Sent out by the caller before the next call (the link copies
        // it): then the micro-batch's buffers are done with.
        self.flight.hand_out(stage, m);
        let st = self.stages[self.local(stage)?].1.clone();
        Ok(&*self.saved(stage, m)?.input_mut(&st).map_err(e)?)
    }

    fn output_grad(&mut self, stage: usize, m: usize) -> Result<&mut DeviceBuffer<f32>> {
        self.flight.tidy()?;
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
    /// Starts the step's time marks: the origin, queued (nothing waits).
    pub(super) fn start_marks(&mut self) -> Result<()> {
        let device = self.acc.device().clone();
        let timed = || Event::timed(&device).map_err(e);
        let (origin, end) = match self.origin.take() {
            Some(pair) => pair,
            None => (timed()?, timed()?),
        };
        origin.record(&self.stream()).map_err(e)?;
        self.origin = Some((origin, end));
        self.marked = 0;
        Ok(())
    }

    /// The step's marks in seconds of the host's wall clock: a last mark,
    /// queued, is taken as ending when the wait for the stream returns,
    /// which puts the others on the host's clock (no wait at the step's
    /// start).
    pub(super) fn mark_times(&mut self) -> Result<Vec<f64>> {
        let s = self.stream();
        let (o, end) = self.origin.as_ref().ok_or("no time marks this step")?;
        end.record(&s).map_err(e)?;
        s.synchronize().map_err(e)?;
        let now = crate::engines::gpt_cpu_stage::wall_seconds();
        let h0 = now - end.elapsed_ms(o).map_err(e)? as f64 / 1e3;
        self.marks[..self.marked]
            .iter()
            .map(|m| Ok(h0 + m.elapsed_ms(o).map_err(e)? as f64 / 1e3))
            .collect()
    }
}
