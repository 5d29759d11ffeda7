//! Checking a schedule before it runs, and running it on paper.
//!
//! [`check`] refuses a list that would train wrong or hang, naming the
//! action: an action on a rank that does not hold its stage; a stage's
//! forward or backward of a micro-batch missing or repeated; a backward
//! before its forward, a weight half before its input half, a stage
//! before the one that feeds it on the same rank; a send or receive that
//! is missing, repeated, misplaced or needless; and a deadlock.
//!
//! The executor's contract, which these checks hold lists to: a send
//! never holds its rank up (it goes out on its own stream while the rank
//! goes on), a receive waits until its message was sent, and the
//! messages from one rank to another, activations and gradients each,
//! arrive in the order they were sent — so the receiving rank must list
//! them in that order too.
//!
//! [`simulate`] runs the lists with a cost per operation under that
//! contract — so the same run finds deadlocks, and with the passes'
//! costs gives the schedule's idle time in theory.

use super::actions::{Action, Op, Schedule};
use crate::Result;
use std::collections::HashMap;

/// Checks `s` (see the module's doc); the error names the first problem.
pub fn check(s: &Schedule) -> Result<()> {
    Checker::new(s).run()?;
    simulate(s, &|op| match op {
        Op::Forward | Op::BackwardInput | Op::BackwardWeight => 1.0,
        Op::Backward => 2.0,
        _ => 0.0,
    })
    .map(|_| ())
}

/// A schedule that passed [`check`]: what a pipeline's engines take, so
/// that a schedule is checked once, where the run builds or reads it.
#[derive(Debug, Clone, PartialEq)]
pub struct Checked(Schedule);

impl Checked {
    /// Checks `s` (see [`check`]).
    pub fn new(s: Schedule) -> Result<Checked> {
        check(&s)?;
        Ok(Checked(s))
    }

    /// The schedule itself.
    pub fn into_schedule(self) -> Schedule {
        self.0
    }
}

impl std::ops::Deref for Checked {
    type Target = Schedule;

    fn deref(&self) -> &Schedule {
        &self.0
    }
}

/// What a rank did on paper.
#[derive(Debug, Clone, PartialEq)]
pub struct RankTimeline {
    /// Each computing action with its start and end.
    pub spans: Vec<(Action, f64, f64)>,
    /// When its last action ended.
    pub end: f64,
    /// Time spent computing.
    pub busy: f64,
}

/// A schedule run on paper.
#[derive(Debug, Clone, PartialEq)]
pub struct Simulated {
    /// Every rank's.
    pub ranks: Vec<RankTimeline>,
    /// When the last rank ended.
    pub makespan: f64,
}

impl Simulated {
    /// The fraction of the ranks' time spent waiting: `1 − busy / (ranks ×
    /// makespan)`.
    pub fn bubble(&self) -> f64 {
        let busy: f64 = self.ranks.iter().map(|r| r.busy).sum();
        match self.makespan > 0.0 {
            true => 1.0 - busy / (self.ranks.len() as f64 * self.makespan),
            false => 0.0,
        }
    }
}

/// Which message a send or receive carries: an activation out of
/// `stage`, or the gradient sent back from `stage`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Message {
    Activation { from: usize, micro: usize },
    Grad { from: usize, micro: usize },
}

fn message(a: &Action) -> Option<(Message, bool)> {
    let (stage, micro) = (a.stage, a.micro);
    Some(match a.op {
        Op::SendActivation => (Message::Activation { from: stage, micro }, true),
        Op::RecvActivation => (
            Message::Activation {
                from: stage.checked_sub(1)?,
                micro,
            },
            false,
        ),
        Op::SendGrad => (Message::Grad { from: stage, micro }, true),
        Op::RecvGrad => (
            Message::Grad {
                from: stage + 1,
                micro,
            },
            false,
        ),
        _ => return None,
    })
}

/// Runs `s` on paper with `cost(op)` per action; refuses a deadlock,
/// naming where every stuck rank waits.
pub fn simulate(s: &Schedule, cost: &dyn Fn(Op) -> f64) -> Result<Simulated> {
    simulate_actions(s, &|a: &Action| cost(a.op))
}

/// [`simulate`] with a cost per action (a stage's passes may take longer
/// than another's).
pub fn simulate_actions(s: &Schedule, cost: &dyn Fn(&Action) -> f64) -> Result<Simulated> {
    let n = s.ranks;
    let mut pc = vec![0usize; n];
    let mut clock = vec![0.0f64; n];
    let mut ranks: Vec<RankTimeline> = (0..n)
        .map(|_| RankTimeline {
            spans: Vec::new(),
            end: 0.0,
            busy: 0.0,
        })
        .collect();
    // When each message was sent.
    let mut sent: HashMap<Message, f64> = HashMap::new();
    loop {
        let mut moved = false;
        for r in 0..n {
            let list = &s.actions[r];
            while pc[r] < list.len() {
                let a = list[pc[r]];
                if !a.op.communicates() {
                    let start = clock[r];
                    clock[r] += cost(&a);
                    ranks[r].busy += cost(&a);
                    ranks[r].spans.push((a, start, clock[r]));
                    pc[r] += 1;
                    moved = true;
                    continue;
                }
                let (msg, send) = message(&a).ok_or_else(|| no_peer(r, &a))?;
                if send {
                    // Out on its own stream: the rank goes on.
                    sent.entry(msg).or_insert(clock[r]);
                } else {
                    match sent.get(&msg) {
                        Some(&t) => clock[r] = clock[r].max(t),
                        None => break,
                    }
                }
                pc[r] += 1;
                moved = true;
            }
        }
        if (0..n).all(|r| pc[r] == s.actions[r].len()) {
            break;
        }
        if !moved {
            let stuck: Vec<String> = (0..n)
                .filter(|&r| pc[r] < s.actions[r].len())
                .map(|r| format!("rank {r} at action {} ({})", pc[r], s.actions[r][pc[r]]))
                .collect();
            return Err(format!(
                "schedule {}: deadlock — every rank left waits to receive what no rank will \
                 send first: {}",
                s.name,
                stuck.join("; ")
            ));
        }
    }
    for (r, t) in ranks.iter_mut().enumerate() {
        t.end = clock[r];
    }
    let makespan = clock.iter().cloned().fold(0.0, f64::max);
    Ok(Simulated { ranks, makespan })
}

fn no_peer(r: usize, a: &Action) -> String {
    format!("rank {r}'s action {a}: stage 0 receives no activation")
}

/// The static checks, action by action.
struct Checker<'a> {
    s: &'a Schedule,
}

impl<'a> Checker<'a> {
    fn new(s: &'a Schedule) -> Checker<'a> {
        Checker { s }
    }

    fn run(&self) -> Result<()> {
        let s = self.s;
        let (stages, micro) = (s.stages(), s.micro_batches);
        if s.actions.len() != s.ranks {
            return Err(format!(
                "schedule {}: {} rank lists for {} ranks",
                s.name,
                s.actions.len(),
                s.ranks
            ));
        }
        // Where on its rank's list each action is.
        let mut at: HashMap<Action, (usize, usize)> = HashMap::new();
        for (r, list) in s.actions.iter().enumerate() {
            for (i, a) in list.iter().enumerate() {
                let named = || format!("schedule {}: rank {r}, action {i} ({a})", s.name);
                if a.stage >= stages || a.micro >= micro {
                    return Err(format!(
                        "{}: outside its {stages} stages and {micro} micro-batches",
                        named()
                    ));
                }
                if s.rank_of(a.stage) != r {
                    return Err(format!(
                        "{}: stage {} runs on rank {}",
                        named(),
                        a.stage,
                        s.rank_of(a.stage)
                    ));
                }
                if at.insert(*a, (r, i)).is_some() {
                    return Err(format!("{}: a second time", named()));
                }
            }
        }
        for stage in 0..stages {
            for m in 0..micro {
                self.stage_micro(stage, m, &at)?;
            }
        }
        self.channels()
    }

    /// Between two ranks, activations and gradients each arrive in the
    /// order they were sent: the receiver's list must take them so.
    fn channels(&self) -> Result<()> {
        let s = self.s;
        // (from, to, gradient?) -> the messages in the sender's and the
        // receiver's order.
        type Lane = (usize, usize, bool);
        let mut sends: HashMap<Lane, Vec<(Message, Action)>> = HashMap::new();
        let mut recvs: HashMap<Lane, Vec<(Message, Action)>> = HashMap::new();
        for (r, list) in s.actions.iter().enumerate() {
            for a in list {
                let Some((msg, send)) = message(a) else {
                    continue;
                };
                let (from, to) = match msg {
                    Message::Activation { from, .. } => (s.rank_of(from), s.rank_of(from + 1)),
                    Message::Grad { from, .. } => (s.rank_of(from), s.rank_of(from - 1)),
                };
                let lane = (from, to, matches!(msg, Message::Grad { .. }));
                let book = match send {
                    true => &mut sends,
                    false => &mut recvs,
                };
                debug_assert_eq!(r, if send { from } else { to });
                book.entry(lane).or_default().push((msg, *a));
            }
        }
        for (lane, out) in &sends {
            let got = recvs.get(lane).map_or(&[][..], |v| &v[..]);
            for (i, ((sent, sa), (recv, ra))) in out.iter().zip(got).enumerate() {
                if sent != recv {
                    return Err(format!(
                        "schedule {}: rank {} sends {sa} as its message {i} to rank {}, which                          receives {ra} there instead (between two ranks the {} arrive in the                          order they are sent: list the receives in the same order)",
                        s.name,
                        lane.0,
                        lane.1,
                        match lane.2 {
                            true => "gradients",
                            false => "activations",
                        }
                    ));
                }
            }
        }
        Ok(())
    }

    /// Stage `stage`'s actions for micro-batch `m`.
    fn stage_micro(
        &self,
        stage: usize,
        m: usize,
        at: &HashMap<Action, (usize, usize)>,
    ) -> Result<()> {
        let s = self.s;
        let stages = s.stages();
        let r = s.rank_of(stage);
        let pos = |op: Op| at.get(&Action::new(stage, op, m)).map(|&(_, i)| i);
        let name = |op: Op| Action::new(stage, op, m).to_string();
        let missing = |op: Op, why: &str| {
            format!(
                "schedule {}: rank {r} never runs {} ({why})",
                s.name,
                name(op)
            )
        };
        let order = |first: Op, then: Op| -> Result<()> {
            match (pos(first), pos(then)) {
                (Some(a), Some(b)) if a > b => Err(format!(
                    "schedule {}: rank {r} runs {} (action {b}) before {} (action {a})",
                    s.name,
                    name(then),
                    name(first)
                )),
                _ => Ok(()),
            }
        };
        let forward = pos(Op::Forward).ok_or_else(|| missing(Op::Forward, "the forward pass"))?;
        let back = match (
            pos(Op::Backward),
            pos(Op::BackwardInput),
            pos(Op::BackwardWeight),
        ) {
            (Some(b), None, None) => {
                order(Op::Forward, Op::Backward)?;
                b
            }
            (None, Some(i), Some(_)) => {
                order(Op::Forward, Op::BackwardInput)?;
                order(Op::BackwardInput, Op::BackwardWeight)?;
                i
            }
            (None, None, None) => return Err(missing(Op::Backward, "the backward pass")),
            (None, Some(_), None) => {
                return Err(missing(
                    Op::BackwardWeight,
                    "the weight half of its backward",
                ))
            }
            (None, None, Some(_)) => {
                return Err(missing(Op::BackwardInput, "the input half of its backward"))
            }
            (Some(_), _, _) => {
                return Err(format!(
                    "schedule {}: rank {r} runs {} whole and in halves",
                    s.name,
                    name(Op::Backward)
                ))
            }
        };
        let back_op = match pos(Op::Backward) {
            Some(_) => Op::Backward,
            None => Op::BackwardInput,
        };
        // The previous stage: its activation comes by a receive from
        // another rank, or from this rank's own earlier forward.
        let apart = |a: usize, b: usize| s.rank_of(a) != s.rank_of(b);
        let needs = |op: Op, needed: bool, why: &str| -> Result<()> {
            match (pos(op), needed) {
                (None, true) => Err(missing(op, why)),
                (Some(i), false) => Err(format!(
                    "schedule {}: rank {r}, action {i} ({}): {why}",
                    s.name,
                    name(op)
                )),
                _ => Ok(()),
            }
        };
        let has_prev = stage > 0;
        let has_next = stage + 1 < stages;
        let prev_apart = has_prev && apart(stage - 1, stage);
        let next_apart = has_next && apart(stage, stage + 1);
        needs(
            Op::RecvActivation,
            prev_apart,
            match prev_apart {
                true => "its input activation comes from another rank",
                false => "nothing to receive: the input is on this rank",
            },
        )?;
        needs(
            Op::SendActivation,
            next_apart,
            match next_apart {
                true => "the next stage runs on another rank",
                false => "nothing to send: no next stage on another rank",
            },
        )?;
        needs(
            Op::RecvGrad,
            next_apart,
            match next_apart {
                true => "its output's gradient comes from another rank",
                false => "nothing to receive: no next stage on another rank",
            },
        )?;
        needs(
            Op::SendGrad,
            prev_apart,
            match prev_apart {
                true => "the previous stage runs on another rank",
                false => "nothing to send: no previous stage on another rank",
            },
        )?;
        order(Op::RecvActivation, Op::Forward)?;
        order(Op::Forward, Op::SendActivation)?;
        order(Op::RecvGrad, back_op)?;
        order(back_op, Op::SendGrad)?;
        // Same-rank neighbours: the earlier stage's forward first, the
        // later stage's backward first.
        let first = |st: usize, ops: &[Op]| {
            ops.iter()
                .find_map(|&op| at.get(&Action::new(st, op, m)).map(|&(_, i)| i))
        };
        if has_prev && !prev_apart {
            if let Some(p) = first(stage - 1, &[Op::Forward]) {
                if p > forward {
                    return Err(format!(
                        "schedule {}: rank {r} runs {} (action {forward}) before the forward \
                         pass of stage {} that feeds it (action {p})",
                        s.name,
                        name(Op::Forward),
                        stage - 1
                    ));
                }
            }
        }
        if has_next && !next_apart {
            if let Some(n) = first(stage + 1, &[Op::Backward, Op::BackwardInput]) {
                if n > back {
                    return Err(format!(
                        "schedule {}: rank {r} runs {} (action {back}) before the backward pass \
                         of stage {} that gives its output's gradient (action {n})",
                        s.name,
                        name(back_op),
                        stage + 1
                    ));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::build::{trivial, ScheduleKind};
    use crate::schedule::text::parse;

    const KINDS: [ScheduleKind; 8] = [
        ScheduleKind::GPipe,
        ScheduleKind::OneFOneB,
        ScheduleKind::Interleaved(2),
        ScheduleKind::Interleaved(4),
        ScheduleKind::ZeroBubble,
        ScheduleKind::ZeroBubbleH2,
        ScheduleKind::InterleavedZeroBubble(2),
        ScheduleKind::InterleavedZeroBubble(4),
    ];

    #[test]
    fn every_built_schedule_passes_its_checks() {
        for kind in KINDS {
            for (p, m) in [
                (1, 1),
                (1, 4),
                (2, 2),
                (2, 4),
                (4, 4),
                (4, 8),
                (4, 16),
                (8, 16),
            ] {
                let s = kind.build(p, m).unwrap();
                check(&s).unwrap_or_else(|e| panic!("{} P{p} M{m}: {e}\n{s}", kind.name()));
            }
        }
        check(&trivial(3)).unwrap();
    }

    /// Equal forward and backward halves (backward = 2 forward): GPipe's
    /// and 1F1B's bubble is (P − 1)/(M + P − 1); interleaving divides the
    /// waiting by V; ZB-H1's is at most 42 % of 1F1B's.
    #[test]
    fn the_bubbles_on_paper_are_the_theory() {
        let cost = |op: Op| match op {
            Op::Forward | Op::BackwardInput | Op::BackwardWeight => 1.0,
            Op::Backward => 2.0,
            _ => 0.0,
        };
        for (p, m) in [(2usize, 4usize), (4, 8), (4, 16)] {
            let theory = (p - 1) as f64 / (m + p - 1) as f64;
            for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
                let b = simulate(&kind.build(p, m).unwrap(), &cost)
                    .unwrap()
                    .bubble();
                assert!(
                    (b - theory).abs() < 1e-9,
                    "{} P{p} M{m}: {b} vs {theory}",
                    kind.name()
                );
            }
            let one = simulate(&ScheduleKind::OneFOneB.build(p, m).unwrap(), &cost).unwrap();
            let inter =
                simulate(&ScheduleKind::Interleaved(2).build(p, m).unwrap(), &cost).unwrap();
            let zb = simulate(&ScheduleKind::ZeroBubble.build(p, m).unwrap(), &cost).unwrap();
            // Interleaving: each stage is half the work, the idle time is
            // (P − 1)/V stage-units out of M + (P − 1)/V.
            let v_theory = (p - 1) as f64 / 2.0 / (m as f64 + (p - 1) as f64 / 2.0);
            assert!(
                (inter.bubble() - v_theory).abs() < 0.02,
                "interleaved P{p} M{m}: {} vs {v_theory}",
                inter.bubble()
            );
            assert!(
                zb.bubble() <= 0.42 * one.bubble(),
                "zb {} vs 1f1b {}",
                zb.bubble(),
                one.bubble()
            );
        }
    }

    /// With the halves as measured on 4 H100s at 2.65B (forward 4.65 ms,
    /// input half 7.13, weight half 5.02: the input half the longest),
    /// ZB-H2's lists leave less idle than ZB-H1's on paper — 9.4 % against
    /// 12.1 % at P 4, M 8 — holding up to twice the ranks' micro-batches;
    /// interleaved zero bubble over 2 stages per rank (each stage half the
    /// time) less again: 5.7 %, against interleaved 1F1B's 15.8 %.
    #[test]
    fn zb_h2_waits_less_than_zb_h1_with_a_longer_input_half() {
        let cost = |op: Op| match op {
            Op::Forward => 4.65,
            Op::BackwardInput => 7.13,
            Op::BackwardWeight => 5.02,
            Op::Backward => 12.15,
            _ => 0.0,
        };
        for (p, m) in [(4usize, 8usize), (4, 16)] {
            let h1 = simulate(&ScheduleKind::ZeroBubble.build(p, m).unwrap(), &cost).unwrap();
            let h2s = ScheduleKind::ZeroBubbleH2.build(p, m).unwrap();
            let h2 = simulate(&h2s, &cost).unwrap();
            assert!(
                h2.bubble() < 0.8 * h1.bubble(),
                "P{p} M{m}: zb-h2 {} against zb {}",
                h2.bubble(),
                h1.bubble()
            );
            for r in 0..p {
                assert!(
                    h2s.in_flight(r) <= 2 * p + 1,
                    "rank {r}: {}",
                    h2s.in_flight(r)
                );
            }
            let half = |op: Op| cost(op) / 2.0;
            let il = simulate(&ScheduleKind::Interleaved(2).build(p, m).unwrap(), &half).unwrap();
            let izb = simulate(
                &ScheduleKind::InterleavedZeroBubble(2).build(p, m).unwrap(),
                &half,
            )
            .unwrap();
            assert!(
                izb.bubble() < 0.75 * h2.bubble() && izb.bubble() < 0.5 * il.bubble(),
                "P{p} M{m}: interleaved-zb {} against zb-h2 {} and interleaved {}",
                izb.bubble(),
                h2.bubble(),
                il.bubble()
            );
        }
    }

    #[test]
    fn bad_lists_are_refused_with_the_action_named() {
        let refused = |text: &str| check(&parse("f", text).unwrap()).unwrap_err();
        // A deadlock: rank 0 waits for the gradient before it sends the
        // activation rank 1 waits for.
        let e = refused("rank 0: 0F0 0RB0 0B0 0SF0\nrank 1: 1RF0 1F0 1B0 1SB0");
        assert!(
            e.contains("deadlock")
                && e.contains("rank 0 at action 1 (0RB0)")
                && e.contains("rank 1 at action 0 (1RF0)"),
            "{e}"
        );
        // A backward before the gradient it needs arrives.
        let e = refused("rank 0: 0F0 0SF0 0B0 0RB0\nrank 1: 1RF0 1F0 1B0 1SB0");
        assert!(
            e.contains("runs 0B0 (action 2) before 0RB0 (action 3)"),
            "{e}"
        );
        // A missing send, a missing backward, a missing half.
        let e = refused("rank 0: 0F0 0SF0 0RB0 0B0\nrank 1: 1RF0 1F0 1B0");
        assert!(e.contains("never runs 1SB0"), "{e}");
        let e = refused("rank 0: 0F0 0F1 0B0");
        assert!(e.contains("never runs 0B1 (the backward pass)"), "{e}");
        let e = refused("rank 0: 0F0 0W0");
        assert!(e.contains("never runs 0I0"), "{e}");
        // Repeats, wrong ranks, needless sends.
        let e = refused("rank 0: 0F0 0F0 0B0");
        assert!(e.contains("action 1 (0F0): a second time"), "{e}");
        let e = refused("rank 0: 1F0 0F0\nrank 1: 0B0 1B0");
        assert!(e.contains("stage 1 runs on rank 1"), "{e}");
        let e = refused("rank 0: 0F0 0SF0 0B0");
        assert!(e.contains("nothing to send"), "{e}");
    }
}
