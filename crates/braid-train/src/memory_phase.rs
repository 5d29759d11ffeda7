//! Where in a step device memory is used most: the loop and the
//! strategies name the part of the step that runs ([`enter`]: a pass, a
//! unit of it, the update); the device allocator's counters keep the most
//! bytes live in each part and the part in which the run's peak was
//! reached. A run reports its last step part by part and names the part
//! of its peak, so that a user (or the memory pre-flight's author) sees
//! what to shrink instead of guessing.

use crate::engines::{backward_unit_name, forward_unit_name};
use std::sync::Mutex;

/// A part of a training run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Outside the loop's steps (building the engine, between steps).
    Idle,
    /// The strategy's start (sharding, buffers).
    Start,
    /// A whole forward pass.
    Forward,
    /// A whole backward pass (and its reductions).
    Backward,
    /// Forward unit `u` (0 the embeddings, then the layers, the head).
    ForwardUnit(usize),
    /// Backward unit `u` (0 the head, then the layers from the top, the
    /// embeddings).
    BackwardUnit(usize),
    /// Backward unit `u` recomputing its activations (checkpointing).
    Recompute(usize),
    /// The optimizer's update and what follows it.
    Update,
    /// An evaluation pass.
    Evaluation,
    /// The strategy's finish (gathering the model back).
    Finish,
}

impl Phase {
    fn code(self) -> u64 {
        let (kind, unit) = match self {
            Phase::Idle => (0, 0),
            Phase::Start => (1, 0),
            Phase::Forward => (2, 0),
            Phase::Backward => (3, 0),
            Phase::ForwardUnit(u) => (4, u),
            Phase::BackwardUnit(u) => (5, u),
            Phase::Recompute(u) => (6, u),
            Phase::Update => (7, 0),
            Phase::Evaluation => (8, 0),
            Phase::Finish => (9, 0),
        };
        (kind << 32) | (unit as u64 & 0xffff_ffff)
    }

    fn from_code(code: u64) -> Option<Phase> {
        let unit = (code & 0xffff_ffff) as usize;
        Some(match code >> 32 {
            0 => Phase::Idle,
            1 => Phase::Start,
            2 => Phase::Forward,
            3 => Phase::Backward,
            4 => Phase::ForwardUnit(unit),
            5 => Phase::BackwardUnit(unit),
            6 => Phase::Recompute(unit),
            7 => Phase::Update,
            8 => Phase::Evaluation,
            9 => Phase::Finish,
            _ => return None,
        })
    }

    /// The part's name for a GPT of `n_layer` layers ("backward layer 3",
    /// "update").
    pub fn name(self, n_layer: usize) -> String {
        match self {
            Phase::Idle => "between steps".into(),
            Phase::Start => "start".into(),
            Phase::Forward => "forward".into(),
            Phase::Backward => "backward".into(),
            Phase::ForwardUnit(u) => forward_unit_name(u, n_layer),
            Phase::BackwardUnit(u) => backward_unit_name(u, n_layer),
            Phase::Recompute(u) => format!("{} (recompute)", backward_unit_name(u, n_layer)),
            Phase::Update => "update".into(),
            Phase::Evaluation => "evaluation".into(),
            Phase::Finish => "finish".into(),
        }
    }
}

/// The parts entered since the log was last taken, each with the most
/// device bytes live during it.
struct Log {
    current: Phase,
    parts: Vec<(Phase, u64)>,
}

/// Enough for every unit of a deep model's step, several times over; a
/// loop that never takes its log stops adding to it there.
const MOST_PARTS: usize = 1 << 16;

static LOG: Mutex<Log> = Mutex::new(Log {
    current: Phase::Idle,
    parts: Vec::new(),
});

/// Enters `phase`: the part before ends, and its most live device bytes
/// are logged. Entering the part already running changes nothing.
pub fn enter(phase: Phase) {
    let mut log = LOG.lock().unwrap_or_else(|e| e.into_inner());
    if log.current == phase {
        return;
    }
    let most = braid_cuda::pool::enter_phase(phase.code()) as u64;
    let before = std::mem::replace(&mut log.current, phase);
    if log.parts.len() < MOST_PARTS {
        log.parts.push((before, most));
    }
}

/// The parts ended since the last call, in order, each with the most
/// device bytes live during it.
pub fn take() -> Vec<(Phase, u64)> {
    let mut log = LOG.lock().unwrap_or_else(|e| e.into_inner());
    std::mem::take(&mut log.parts)
}

/// The part in which the device memory's peak
/// ([`braid_cuda::pool::peak_allocated_bytes`]) was reached.
pub fn peak() -> Option<Phase> {
    Phase::from_code(braid_cuda::pool::peak_phase())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_name_the_gpt_units() {
        for p in [
            Phase::Idle,
            Phase::Start,
            Phase::Forward,
            Phase::Backward,
            Phase::ForwardUnit(7),
            Phase::BackwardUnit(41),
            Phase::Recompute(3),
            Phase::Update,
            Phase::Evaluation,
            Phase::Finish,
        ] {
            assert_eq!(Phase::from_code(p.code()), Some(p));
        }
        assert_eq!(Phase::from_code(99 << 32), None);
        assert_eq!(Phase::BackwardUnit(0).name(40), "backward head");
        assert_eq!(Phase::BackwardUnit(40).name(40), "backward layer 0");
        assert_eq!(
            Phase::Recompute(1).name(40),
            "backward layer 39 (recompute)"
        );
        assert_eq!(Phase::ForwardUnit(41).name(40), "forward head");
    }
}
