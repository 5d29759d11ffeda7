//! The executor: one rank's actions of a [`Schedule`] in order — a
//! stage's forward or backward pass of a micro-batch, the sends and
//! receives around them — over the rank's stages ([`StagePasses`]) and
//! its links to the other pipeline ranks ([`Links`]). It knows nothing of
//! models or memory (activations are host slices on CPUs, device buffers
//! on GPUs: `B`): the schedule is data, checked before it runs.

use crate::schedule::{Action, Op, Schedule};
use crate::Result;

/// What a rank's pipeline stages do, micro-batch by micro-batch, with
/// activations and their gradients in `B`.
pub trait StagePasses<B: ?Sized> {
    /// Stage `stage`'s forward pass of `micro`: the loss on the last
    /// stage.
    fn forward(&mut self, stage: usize, micro: usize) -> Result<Option<f32>>;
    /// Its backward pass: whole, or (`input_only`) the input gradient's
    /// half, the weights' to come by [`backward_weights`](Self::backward_weights).
    fn backward(&mut self, stage: usize, micro: usize, input_only: bool) -> Result<()>;
    /// The weight gradients' half of a split backward pass.
    fn backward_weights(&mut self, stage: usize, micro: usize) -> Result<()>;
    /// The stage's output activation of `micro` (after its forward).
    fn output(&mut self, stage: usize, micro: usize) -> Result<&B>;
    /// Where the stage's input activation of `micro` goes (before its
    /// forward).
    fn input(&mut self, stage: usize, micro: usize) -> Result<&mut B>;
    /// The gradient of the stage's input (after its backward).
    fn input_grad(&mut self, stage: usize, micro: usize) -> Result<&B>;
    /// Where the gradient of the stage's output goes (before its
    /// backward).
    fn output_grad(&mut self, stage: usize, micro: usize) -> Result<&mut B>;
    /// Marks the time at this point of the rank's work (on a GPU: of its
    /// stream), returning the mark's index in the step; the engine turns
    /// the step's marks into times afterwards.
    fn stamp(&mut self) -> Result<usize>;
}

/// What a rank's step gave: the losses of the micro-batches whose last
/// stage it runs, and each compute action between two of its stamps.
#[derive(Debug, Default)]
pub struct Ran {
    /// (micro-batch, loss).
    pub losses: Vec<(usize, f32)>,
    /// (action, stamp before, stamp after).
    pub spans: Vec<(Action, usize, usize)>,
}

/// How a rank's messages move: sends never hold the rank up; a receive
/// waits for its message (within the communicator's timeout).
pub trait Links<B: ?Sized> {
    /// Sends `data` to pipeline rank `to`, tagged `tag`.
    fn send(&mut self, to: usize, tag: u64, data: &B) -> Result<()>;
    /// Receives from pipeline rank `from` the message tagged `tag`.
    fn recv(&mut self, from: usize, tag: u64, into: &mut B) -> Result<()>;
    /// Waits until every send so far has gone out (the end of a step).
    fn flush(&mut self) -> Result<()>;
}

/// The tag of a message: an activation out of, or a gradient back from,
/// `stage` for `micro` in step `step` (below 2^63, as host tags must be).
pub fn tag(gradient: bool, stage: usize, micro: usize, step: u64) -> u64 {
    ((step & 0xffff) << 44)
        | ((gradient as u64) << 43)
        | ((stage as u64 & 0x1f_ffff) << 22)
        | (micro as u64 & 0x3f_ffff)
}

/// Runs rank `rank`'s actions of `s` for step `step`: the losses of the
/// micro-batches whose last stage it runs, and when each compute action
/// ran.
pub fn run<B: ?Sized>(
    s: &Schedule,
    rank: usize,
    passes: &mut dyn StagePasses<B>,
    links: &mut dyn Links<B>,
    step: u64,
) -> Result<Ran> {
    let mut losses = Vec::new();
    let mut spans = Vec::new();
    let actions = s
        .actions
        .get(rank)
        .ok_or_else(|| format!("schedule {}: no rank {rank}", s.name))?;
    for (i, a) in actions.iter().enumerate() {
        let Action { stage, op, micro } = *a;
        let named = |e: String| format!("pipeline rank {rank}, action {i} ({a}): {e}");
        let before = match op.communicates() {
            false => Some(passes.stamp().map_err(named)?),
            true => None,
        };
        match op {
            Op::Forward => {
                if let Some(l) = passes.forward(stage, micro).map_err(named)? {
                    losses.push((micro, l));
                }
            }
            Op::Backward => passes.backward(stage, micro, false).map_err(named)?,
            Op::BackwardInput => passes.backward(stage, micro, true).map_err(named)?,
            Op::BackwardWeight => passes.backward_weights(stage, micro).map_err(named)?,
            Op::SendActivation => {
                let to = s.rank_of(stage + 1);
                let data = passes.output(stage, micro).map_err(named)?;
                links
                    .send(to, tag(false, stage, micro, step), data)
                    .map_err(named)?;
            }
            Op::RecvActivation => {
                let from = s.rank_of(stage - 1);
                let into = passes.input(stage, micro).map_err(named)?;
                links
                    .recv(from, tag(false, stage - 1, micro, step), into)
                    .map_err(named)?;
            }
            Op::SendGrad => {
                let to = s.rank_of(stage - 1);
                let data = passes.input_grad(stage, micro).map_err(named)?;
                links
                    .send(to, tag(true, stage, micro, step), data)
                    .map_err(named)?;
            }
            Op::RecvGrad => {
                let from = s.rank_of(stage + 1);
                let into = passes.output_grad(stage, micro).map_err(named)?;
                links
                    .recv(from, tag(true, stage + 1, micro, step), into)
                    .map_err(named)?;
            }
        }
        if let Some(b) = before {
            spans.push((*a, b, passes.stamp().map_err(named)?));
        }
    }
    links
        .flush()
        .map_err(|e| format!("pipeline rank {rank}, end of step: {e}"))?;
    Ok(Ran { losses, spans })
}

/// `s` with only its forward passes and their messages (evaluation): each
/// rank's forward actions in their order.
pub fn forward_only(s: &Schedule) -> Schedule {
    let keep = |a: &&Action| matches!(a.op, Op::Forward | Op::SendActivation | Op::RecvActivation);
    Schedule {
        name: format!("{} (forward passes)", s.name),
        actions: s
            .actions
            .iter()
            .map(|l| l.iter().filter(keep).copied().collect())
            .collect(),
        ..s.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::build::ScheduleKind;
    use crate::schedule::check::check;

    #[test]
    fn tags_are_distinct_and_below_2_63() {
        let mut seen = std::collections::HashSet::new();
        for g in [false, true] {
            for s in 0..8 {
                for m in 0..16 {
                    let t = tag(g, s, m, 65_535);
                    assert!(t < 1 << 63);
                    assert!(seen.insert(t));
                }
            }
        }
    }

    #[test]
    fn forward_only_lists_pass_the_checks_of_their_kind() {
        for kind in [
            ScheduleKind::GPipe,
            ScheduleKind::OneFOneB,
            ScheduleKind::Interleaved(2),
        ] {
            let f = forward_only(&kind.build(4, 8).unwrap());
            // No backward at all: the coverage check refuses it, the
            // simulation (sends and receives) must still finish.
            assert!(check(&f).is_err());
            crate::schedule::check::simulate(&f, &|_| 1.0).unwrap();
        }
    }
}
