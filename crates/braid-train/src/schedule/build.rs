//! The built-in schedules as lists: GPipe, 1F1B, interleaved 1F1B,
//! ZB-H1, ZB-H2 and interleaved zero bubble, each the order of the computations on every rank, with the
//! sends and receives a stage on another rank needs put around them
//! (`Lists`). The kind is parsed from `--schedule`
//! ([`ScheduleKind::parse`]).

use super::actions::{Action, Op, Schedule};
use crate::Result;

/// A built-in schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ScheduleKind {
    /// Every micro-batch's forward pass, then every backward pass.
    GPipe,
    /// One forward, one backward (after a warm-up of forwards): at most
    /// `ranks` micro-batches in flight on the first rank.
    OneFOneB,
    /// 1F1B over `V` stages per rank (Megatron's interleaving): the
    /// bubble shrinks by `V`.
    Interleaved(usize),
    /// 1F1B with each backward split into its input and weight halves,
    /// the weight halves put off to fill the cool-down's bubble (ZB-H1).
    ZeroBubble,
    /// ZB-H2: as ZB-H1, with up to twice as many micro-batches in flight,
    /// so that the warm-up's extra forward passes and the cool-down's
    /// weight halves fill the bubble at both ends (twice the activation
    /// memory of 1F1B's first rank).
    ZeroBubbleH2,
    /// Zero bubble over `V` stages per rank (stage `s` on rank `s % P`):
    /// interleaved 1F1B's order of forward passes and input halves, the
    /// weight halves put where a rank would wait.
    InterleavedZeroBubble(usize),
}

impl ScheduleKind {
    /// `gpipe`, `1f1b`, `interleaved` (2 stages per rank),
    /// `interleaved:V`, `zb` (ZB-H1), `zb-h2`, `interleaved-zb` (2 stages
    /// per rank) or `interleaved-zb:V`.
    pub fn parse(s: &str) -> Result<ScheduleKind> {
        let s = s.trim().to_ascii_lowercase();
        Ok(match s.as_str() {
            "gpipe" => ScheduleKind::GPipe,
            "1f1b" => ScheduleKind::OneFOneB,
            "interleaved" => ScheduleKind::Interleaved(2),
            "zb" | "zb-h1" | "zbh1" | "zero-bubble" => ScheduleKind::ZeroBubble,
            "zb-h2" | "zbh2" => ScheduleKind::ZeroBubbleH2,
            "interleaved-zb" => ScheduleKind::InterleavedZeroBubble(2),
            _ => match (
                s.strip_prefix("interleaved:").map(str::parse::<usize>),
                s.strip_prefix("interleaved-zb:").map(str::parse::<usize>),
            ) {
                (Some(Ok(v)), _) if v >= 1 => ScheduleKind::Interleaved(v),
                (_, Some(Ok(v))) if v >= 1 => ScheduleKind::InterleavedZeroBubble(v),
                _ => {
                    return Err(format!(
                        "--schedule {s}: expected gpipe, 1f1b, interleaved[:V] (V stages per \
                         rank, 2 by default), zb (ZB-H1), zb-h2 or interleaved-zb[:V], or a \
                         schedule file's path"
                    ))
                }
            },
        })
    }

    /// Stages per rank.
    pub fn virtual_stages(self) -> usize {
        match self {
            ScheduleKind::Interleaved(v) | ScheduleKind::InterleavedZeroBubble(v) => v,
            _ => 1,
        }
    }

    /// Its name in messages.
    pub fn name(self) -> String {
        match self {
            ScheduleKind::GPipe => "gpipe".into(),
            ScheduleKind::OneFOneB => "1f1b".into(),
            ScheduleKind::Interleaved(v) => format!("interleaved:{v}"),
            ScheduleKind::ZeroBubble => "zb".into(),
            ScheduleKind::ZeroBubbleH2 => "zb-h2".into(),
            ScheduleKind::InterleavedZeroBubble(v) => format!("interleaved-zb:{v}"),
        }
    }

    /// The lists for `ranks` pipeline ranks and `micro` micro-batches.
    pub fn build(self, ranks: usize, micro: usize) -> Result<Schedule> {
        if ranks == 0 || micro == 0 {
            return Err(format!(
                "a pipeline of {ranks} ranks over {micro} micro-batches: both must be at least 1"
            ));
        }
        let v = self.virtual_stages();
        if let ScheduleKind::Interleaved(_) | ScheduleKind::InterleavedZeroBubble(_) = self {
            if ranks > 1 && micro % ranks != 0 {
                return Err(format!(
                    "--schedule {}: interleaving runs the micro-batches in rounds of one per \
                     rank, so their number must divide by the {ranks} pipeline ranks (use \
                     --micro-batches {})",
                    self.name(),
                    micro.div_ceil(ranks) * ranks
                ));
            }
        }
        let shape = Lists {
            ranks,
            virtual_stages: v,
            micro,
        };
        let actions = match self {
            ScheduleKind::ZeroBubble => shape.zero_bubble(ranks),
            ScheduleKind::ZeroBubbleH2 => shape.zero_bubble(h2_in_flight(ranks)),
            ScheduleKind::InterleavedZeroBubble(_) => {
                shape.interleaved_zero_bubble(interleaved_zb_pending(ranks))
            }
            _ => (0..ranks)
                .map(|r| match self {
                    ScheduleKind::GPipe => shape.gpipe(r),
                    ScheduleKind::OneFOneB => shape.one_f_one_b(r),
                    _ => shape.interleaved(r),
                })
                .collect(),
        };
        Ok(Schedule {
            name: self.name(),
            ranks,
            virtual_stages: v,
            micro_batches: micro,
            actions,
        })
    }
}

/// Micro-batches ZB-H2 lets a rank hold (until their weight halves) over
/// `ranks` pipeline ranks.
fn h2_in_flight(ranks: usize) -> usize {
    2 * ranks
}

/// Weight halves the interleaved zero-bubble schedule lets a rank put
/// off before its next forward pass, over `ranks` ranks: on paper (the
/// halves as measured at 2.65B, P 4, M 8) 4 leave 7.3 % idle, 8 leave 5.7 %
/// with the first rank holding 14 stages' micro-batches (interleaved
/// 1F1B's 11 and 3 weight halves' worth), more gain nothing there.
fn interleaved_zb_pending(ranks: usize) -> usize {
    2 * ranks
}

/// The trivial schedule: one rank, one stage, each micro-batch's forward
/// then its backward (what training without a pipeline runs).
pub fn trivial(micro: usize) -> Schedule {
    let actions = (0..micro)
        .flat_map(|m| {
            [
                Action::new(0, Op::Forward, m),
                Action::new(0, Op::Backward, m),
            ]
        })
        .collect();
    Schedule {
        name: "no pipeline".into(),
        ranks: 1,
        virtual_stages: 1,
        micro_batches: micro,
        actions: vec![actions],
    }
}

/// A pipeline's shape, building one rank's list at a time.
struct Lists {
    ranks: usize,
    virtual_stages: usize,
    micro: usize,
}

impl Lists {
    fn stages(&self) -> usize {
        self.ranks * self.virtual_stages
    }

    /// Whether stages `a` and `b` run on different ranks.
    fn apart(&self, a: usize, b: usize) -> bool {
        a % self.ranks != b % self.ranks
    }

    /// A stage's forward pass with its receive before and send after.
    fn forward(&self, out: &mut Vec<Action>, stage: usize, m: usize) {
        if stage > 0 && self.apart(stage - 1, stage) {
            out.push(Action::new(stage, Op::RecvActivation, m));
        }
        out.push(Action::new(stage, Op::Forward, m));
        if stage + 1 < self.stages() && self.apart(stage, stage + 1) {
            out.push(Action::new(stage, Op::SendActivation, m));
        }
    }

    /// A stage's backward pass (`op`: whole, or its input half) with its
    /// receive before and send after.
    fn backward(&self, out: &mut Vec<Action>, stage: usize, m: usize, op: Op) {
        if stage + 1 < self.stages() && self.apart(stage, stage + 1) {
            out.push(Action::new(stage, Op::RecvGrad, m));
        }
        out.push(Action::new(stage, op, m));
        if stage > 0 && self.apart(stage - 1, stage) {
            out.push(Action::new(stage, Op::SendGrad, m));
        }
    }

    fn gpipe(&self, r: usize) -> Vec<Action> {
        let mut out = Vec::new();
        for m in 0..self.micro {
            self.forward(&mut out, r, m);
        }
        for m in 0..self.micro {
            self.backward(&mut out, r, m, Op::Backward);
        }
        out
    }

    /// Forwards of rank `r` before its first backward: one fewer per rank
    /// down the pipeline.
    fn warm_up(&self, r: usize) -> usize {
        (self.ranks - 1 - r).min(self.micro)
    }

    fn one_f_one_b(&self, r: usize) -> Vec<Action> {
        let mut out = Vec::new();
        let w = self.warm_up(r);
        let (mut f, mut b) = (0, 0);
        for _ in 0..w {
            self.forward(&mut out, r, f);
            f += 1;
        }
        while f < self.micro {
            self.forward(&mut out, r, f);
            f += 1;
            self.backward(&mut out, r, b, Op::Backward);
            b += 1;
        }
        while b < self.micro {
            self.backward(&mut out, r, b, Op::Backward);
            b += 1;
        }
        out
    }

    /// Interleaved 1F1B: rank `r`'s `k`-th forward unit is micro-batch
    /// `(k / (P·V))·P + k % P` at its stage `(k / P) % V`; the backward
    /// units run the stages in reverse.
    fn interleaved(&self, r: usize) -> Vec<Action> {
        let (p, v) = (self.ranks, self.virtual_stages);
        let total = self.micro * v;
        let unit = |k: usize, backward: bool| {
            let within = k % (p * v);
            let chunk = match backward {
                false => within / p,
                true => v - 1 - within / p,
            };
            ((k / (p * v)) * p + within % p, chunk * p + r)
        };
        let warm = ((p - 1 - r) * 2 + (v - 1) * p).min(total);
        let mut out = Vec::new();
        for k in 0..warm {
            let (m, s) = unit(k, false);
            self.forward(&mut out, s, m);
        }
        for i in 0..total - warm {
            let (m, s) = unit(warm + i, false);
            self.forward(&mut out, s, m);
            let (m, s) = unit(i, true);
            self.backward(&mut out, s, m, Op::Backward);
        }
        for i in total - warm..total {
            let (m, s) = unit(i, true);
            self.backward(&mut out, s, m, Op::Backward);
        }
        out
    }

    /// Interleaved 1F1B's order of forward passes and input halves on every
    /// rank, with the weight halves put wherever the rank would wait for
    /// its next input (on paper, all passes of equal cost) — and before a
    /// forward pass once `cap` weight halves are pending — the rest at the
    /// end.
    fn interleaved_zero_bubble(&self, cap: usize) -> Vec<Vec<Action>> {
        let (p, m, n) = (self.ranks, self.micro, self.stages());
        let base: Vec<Vec<Action>> = (0..p)
            .map(|r| {
                self.interleaved(r)
                    .into_iter()
                    .filter_map(|a| match a.op {
                        Op::Forward => Some(a),
                        Op::Backward => Some(Action::new(a.stage, Op::BackwardInput, a.micro)),
                        _ => None,
                    })
                    .collect()
            })
            .collect();
        let mut run = PaperRun::new(self);
        let mut pc = vec![0usize; p];
        for _ in 0..3 * n * m {
            let mut best: Option<(f64, usize, Option<Action>)> = None;
            for r in 0..p {
                let t = run.free[r];
                let next = base[r].get(pc[r]).copied();
                let ready = next.and_then(|a| run.arrives(a.op, a.stage, a.micro));
                let pending = run.pending(r);
                let w = pending > 0;
                let full = w && pending >= cap && next.is_some_and(|a| a.op == Op::Forward);
                // (start, the base action or None for a weight half)
                let choice = match (next, ready) {
                    _ if full => Some((t, None)),
                    (Some(a), Some(at)) if at <= t || !w => Some((at.max(t), Some(a))),
                    _ if w => Some((t, None)),
                    _ => None,
                };
                if let Some((start, a)) = choice {
                    if best.is_none_or(|(s, _, _)| start < s) {
                        best = Some((start, r, a));
                    }
                }
            }
            match best.expect("a rank can always act") {
                (start, r, Some(a)) => {
                    pc[r] += 1;
                    run.run(r, start, a.op, a.stage, a.micro);
                }
                (start, r, None) => run.run_weight(r, start),
            }
        }
        run.lists()
    }

    /// ZB-H1 (`cap` = `P`) and ZB-H2 (a larger `cap`), built by running
    /// the pipeline on paper with the passes' halves of equal cost
    /// (forward, input half, weight half): whenever a rank is free it runs
    /// an input half whose gradient has arrived (the critical path), else a
    /// forward pass while it holds at most `cap` micro-batches (counted
    /// until their weight half; at `P`, one more than 1F1B's first rank,
    /// the most any rank holds there), else a weight half — which so fills
    /// the time 1F1B spends waiting. On paper ZB-H1's bubble is about 40 %
    /// of 1F1B's (`check`'s tests).
    fn zero_bubble(&self, cap: usize) -> Vec<Vec<Action>> {
        let (p, m) = (self.ranks, self.micro);
        let mut run = PaperRun::new(self);
        let mut next = Next {
            forward: vec![0; p],
            input: vec![0; p],
            held: vec![0; p],
            micro: m,
            cap,
        };
        // Each rank's choice, kept between steps: an action changes only
        // its own rank's and its neighbours' (what it hands on).
        let mut choice: Vec<Option<(f64, Op)>> = (0..p).map(|r| next.choice(&run, r)).collect();
        for _ in 0..3 * p * m {
            // The rank that is free first and can act (the lowest of a
            // tie), with its choice.
            let mut best: Option<(f64, usize, Op)> = None;
            for (r, c) in choice.iter().enumerate() {
                if let Some((start, op)) = *c {
                    if best.is_none_or(|(s, _, _)| start < s) {
                        best = Some((start, r, op));
                    }
                }
            }
            let (start, r, op) = best.expect("a free rank can always act");
            match op {
                Op::Forward => {
                    run.run(r, start, op, r, next.forward[r]);
                    next.forward[r] += 1;
                    next.held[r] += 1;
                }
                Op::BackwardInput => {
                    run.run(r, start, op, r, next.input[r]);
                    next.input[r] += 1;
                }
                _ => {
                    run.run_weight(r, start);
                    next.held[r] -= 1;
                }
            }
            let near = r.saturating_sub(1)..(r + 2).min(p);
            for (q, c) in choice
                .iter_mut()
                .enumerate()
                .take(near.end)
                .skip(near.start)
            {
                *c = next.choice(&run, q);
            }
        }
        run.lists()
    }
}

/// Where each rank of a zero-bubble pipeline being built is: the next
/// micro-batch of its forward passes and of its input halves, and the
/// micro-batches it holds (forward run, weight half not yet), at most
/// `cap` before it takes no new forward pass.
struct Next {
    forward: Vec<usize>,
    input: Vec<usize>,
    held: Vec<usize>,
    micro: usize,
    cap: usize,
}

impl Next {
    /// What rank `r` would run next and from when: the earliest start of
    /// an input half, a forward pass or a pending weight half, in that
    /// order of priority at the same time; `None` where it can do nothing
    /// yet.
    fn choice(&self, run: &PaperRun<'_>, r: usize) -> Option<(f64, Op)> {
        let t = run.free[r];
        let ready = |at: Option<f64>| at.map(|a| a.max(t));
        let m = self.micro;
        let i = (self.input[r] < m)
            .then(|| ready(run.arrives(Op::BackwardInput, r, self.input[r])))
            .flatten();
        let f = (self.forward[r] < m && self.held[r] <= self.cap)
            .then(|| ready(run.arrives(Op::Forward, r, self.forward[r])))
            .flatten();
        let w = (run.pending(r) > 0).then_some(t);
        let start = [i, f, w]
            .into_iter()
            .flatten()
            .fold(f64::INFINITY, f64::min);
        if start.is_infinite() {
            return None;
        }
        let op = if i == Some(start) {
            Op::BackwardInput
        } else if f == Some(start) {
            Op::Forward
        } else {
            Op::BackwardWeight
        };
        Some((start, op))
    }
}

/// A pipeline run on paper while its lists are built, every pass taking
/// one unit of time: when each rank is free, when each micro-batch's input
/// and output gradient reach each stage, each rank's weight halves not yet
/// run (oldest first), and the lists so far (with their sends and
/// receives).
struct PaperRun<'a> {
    shape: &'a Lists,
    out: Vec<Vec<Action>>,
    free: Vec<f64>,
    weights: Vec<std::collections::VecDeque<(usize, usize)>>,
    act_at: Vec<Vec<Option<f64>>>,
    grad_at: Vec<Vec<Option<f64>>>,
}

impl<'a> PaperRun<'a> {
    /// Every micro-batch's input at the first stage from the start.
    fn new(shape: &'a Lists) -> PaperRun<'a> {
        let (p, m, n) = (shape.ranks, shape.micro, shape.stages());
        let mut act_at = vec![vec![None; m]; n];
        act_at[0].fill(Some(0.0));
        PaperRun {
            shape,
            out: vec![Vec::new(); p],
            free: vec![0.0; p],
            weights: vec![Default::default(); p],
            act_at,
            grad_at: vec![vec![None; m]; n],
        }
    }

    /// When what a forward pass (its input) or an input half (its output's
    /// gradient) of micro-batch `mb` at `stage` needs arrives, if it has.
    fn arrives(&self, op: Op, stage: usize, mb: usize) -> Option<f64> {
        match op {
            Op::Forward => self.act_at[stage][mb],
            _ => self.grad_at[stage][mb],
        }
    }

    /// Weight halves rank `r` has not run yet.
    fn pending(&self, r: usize) -> usize {
        self.weights[r].len()
    }

    /// Rank `r` runs the forward pass or the input half (`op`) of
    /// micro-batch `mb` at `stage` from `start`: its list gains it with its
    /// receive and send, and what it hands on arrives when it ends.
    fn run(&mut self, r: usize, start: f64, op: Op, stage: usize, mb: usize) {
        let end = start + 1.0;
        self.free[r] = end;
        let last = stage + 1 == self.shape.stages();
        match op {
            Op::Forward => {
                self.shape.forward(&mut self.out[r], stage, mb);
                match last {
                    false => self.act_at[stage + 1][mb] = Some(end),
                    // The loss: its gradient is here.
                    true => self.grad_at[stage][mb] = Some(end),
                }
            }
            _ => {
                self.shape
                    .backward(&mut self.out[r], stage, mb, Op::BackwardInput);
                self.weights[r].push_back((stage, mb));
                if stage > 0 {
                    self.grad_at[stage - 1][mb] = Some(end);
                }
            }
        }
    }

    /// Rank `r` runs its oldest pending weight half from `start`.
    fn run_weight(&mut self, r: usize, start: f64) {
        self.free[r] = start + 1.0;
        let (stage, mb) = self.weights[r].pop_front().expect("a pending weight half");
        self.out[r].push(Action::new(stage, Op::BackwardWeight, mb));
    }

    /// The lists built.
    fn lists(self) -> Vec<Vec<Action>> {
        self.out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_parse_and_name_themselves() {
        for (s, k) in [
            ("gpipe", ScheduleKind::GPipe),
            ("1F1B", ScheduleKind::OneFOneB),
            ("interleaved", ScheduleKind::Interleaved(2)),
            ("interleaved:4", ScheduleKind::Interleaved(4)),
            ("zb", ScheduleKind::ZeroBubble),
            ("zb-h2", ScheduleKind::ZeroBubbleH2),
            ("interleaved-zb", ScheduleKind::InterleavedZeroBubble(2)),
            ("interleaved-zb:4", ScheduleKind::InterleavedZeroBubble(4)),
        ] {
            assert_eq!(ScheduleKind::parse(s).unwrap(), k);
            assert_eq!(ScheduleKind::parse(&k.name()).unwrap(), k);
        }
        let e = ScheduleKind::parse("looped").unwrap_err();
        assert!(e.contains("gpipe, 1f1b, interleaved[:V]"), "{e}");
        assert!(ScheduleKind::parse("interleaved:0").is_err());
        let e = ScheduleKind::Interleaved(2).build(4, 6).unwrap_err();
        assert!(e.contains("--micro-batches 8"), "{e}");
    }

    #[test]
    fn one_f_one_b_keeps_at_most_one_micro_batch_per_later_rank_in_flight() {
        let s = ScheduleKind::OneFOneB.build(4, 8).unwrap();
        for r in 0..4 {
            assert_eq!(s.in_flight(r), 4 - r, "rank {r}");
        }
        let g = ScheduleKind::GPipe.build(4, 8).unwrap();
        assert_eq!(g.in_flight(0), 8);
        // ZB-H1 holds at most one more than 1F1B's first rank, anywhere.
        let z = ScheduleKind::ZeroBubble.build(4, 16).unwrap();
        assert!(z.splits_backward());
        for r in 0..4 {
            assert!(z.in_flight(r) <= 5, "rank {r}: {}", z.in_flight(r));
        }
    }

    /// Bytes held at once, with stages of a rank weighing differently: on
    /// 4 H100s the first rank of interleaved 1F1B (2 stages per rank, 8
    /// micro-batches) held at most 8 micro-batches of its first stage and
    /// 4 of its second (stage 4), as on paper.
    #[test]
    fn peak_held_weighs_each_stage_by_its_bytes() {
        let s = ScheduleKind::OneFOneB.build(4, 8).unwrap();
        assert_eq!(s.peak_held(0, |_| 10), 40);
        let i = ScheduleKind::Interleaved(2).build(4, 8).unwrap();
        assert_eq!(i.peak_held(0, |st| (st == 0) as u128), 8);
        assert_eq!(i.peak_held(0, |st| (st == 4) as u128), 4);
        // Together they never all wait at once.
        let both = i.peak_held(0, |st| if st == 0 { 1 } else { 100 });
        assert!((400..408).contains(&both), "{both}");
    }

    #[test]
    fn the_trivial_schedule_is_forward_then_backward() {
        let s = trivial(2);
        let ops: Vec<Op> = s.actions[0].iter().map(|a| a.op).collect();
        assert_eq!(ops, [Op::Forward, Op::Backward, Op::Forward, Op::Backward]);
    }
}
