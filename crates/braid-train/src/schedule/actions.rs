//! A schedule as data: what an action does ([`Op`]), one action of a
//! rank's list ([`Action`]), and every rank's list ([`Schedule`]).

/// What an action does, for one micro-batch at one stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Op {
    /// The stage's forward pass (the loss too on the last stage).
    Forward,
    /// The whole backward pass: input and weight gradients.
    Backward,
    /// The backward pass's input gradient only (zero-bubble schedules).
    BackwardInput,
    /// The backward pass's weight gradients, after its input gradient.
    BackwardWeight,
    /// Sends the stage's output activation to the next stage's rank.
    SendActivation,
    /// Receives the stage's input activation from the previous stage's.
    RecvActivation,
    /// Sends the stage's input gradient to the previous stage's rank.
    SendGrad,
    /// Receives the gradient of the stage's output from the next stage's.
    RecvGrad,
}

impl Op {
    /// A send or a receive (the others compute).
    pub fn communicates(self) -> bool {
        matches!(
            self,
            Op::SendActivation | Op::RecvActivation | Op::SendGrad | Op::RecvGrad
        )
    }
}

/// One action of a rank's list: `op` for micro-batch `micro` at stage
/// `stage`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Action {
    /// The stage (global index, `0..stages`).
    pub stage: usize,
    /// What it does.
    pub op: Op,
    /// The micro-batch (`0..micro_batches`).
    pub micro: usize,
}

impl Action {
    /// `op` of `micro` at `stage`.
    pub fn new(stage: usize, op: Op, micro: usize) -> Action {
        Action { stage, op, micro }
    }
}

/// A pipeline schedule: every rank's actions, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule {
    /// Its name ("1f1b", "interleaved:2", a file's path, …), for messages.
    pub name: String,
    /// Pipeline ranks.
    pub ranks: usize,
    /// Stages per rank (`V`, interleaving; 1 otherwise).
    pub virtual_stages: usize,
    /// Micro-batches per step.
    pub micro_batches: usize,
    /// Each rank's actions, in the order it runs them.
    pub actions: Vec<Vec<Action>>,
}

impl Schedule {
    /// Stages in all: `ranks × virtual_stages`.
    pub fn stages(&self) -> usize {
        self.ranks * self.virtual_stages
    }

    /// The rank that runs `stage`.
    pub fn rank_of(&self, stage: usize) -> usize {
        stage % self.ranks
    }

    /// The stages rank `rank` runs, first to last.
    pub fn stages_of(&self, rank: usize) -> Vec<usize> {
        (0..self.virtual_stages)
            .map(|v| v * self.ranks + rank)
            .collect()
    }

    /// Whether the backward passes are split into input and weight halves
    /// (the engine keeps what the weight half needs in between).
    pub fn splits_backward(&self) -> bool {
        self.actions
            .iter()
            .flatten()
            .any(|a| a.op == Op::BackwardInput)
    }

    /// The most micro-batches rank `rank` holds activations for at once:
    /// counted from a stage's forward to its backward (to its weight half
    /// where the backward is split), over all its stages.
    pub fn in_flight(&self, rank: usize) -> usize {
        self.peak_held(rank, |_| 1) as usize
    }

    /// The most bytes rank `rank` holds for micro-batches in flight at
    /// once, where one micro-batch through stage `s` holds `bytes(s)`
    /// (stages of a rank may differ): counted as [`in_flight`](Self::in_flight).
    pub fn peak_held(&self, rank: usize, bytes: impl Fn(usize) -> u128) -> u128 {
        let (mut now, mut most) = (0u128, 0u128);
        for a in &self.actions[rank] {
            match a.op {
                Op::Forward => {
                    now += bytes(a.stage);
                    most = most.max(now);
                }
                Op::Backward | Op::BackwardWeight => now = now.saturating_sub(bytes(a.stage)),
                _ => {}
            }
        }
        most
    }
}
