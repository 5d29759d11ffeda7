//! The built-in schedules as lists: GPipe, 1F1B, interleaved 1F1B,
//! ZB-H1, ZB-H2 and interleaved zero bubble, each the order of the computations on every rank, with the
//! sends and receives a stage on another rank needs put around them
//! (`Lists`). The kind is parsed from `--schedule`
//! ([`ScheduleKind::parse`]).

use super::{Action, Op, Schedule};
use crate::Result;

/// A built-in schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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
        const COST: f64 = 1.0;
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
        let mut out: Vec<Vec<Action>> = vec![Vec::new(); p];
        let mut pc = vec![0usize; p];
        let mut free = vec![0.0f64; p];
        let mut weights: Vec<std::collections::VecDeque<(usize, usize)>> =
            vec![Default::default(); p];
        let mut act_at = vec![vec![None::<f64>; m]; n];
        let mut grad_at = vec![vec![None::<f64>; m]; n];
        for slot in act_at[0].iter_mut() {
            *slot = Some(0.0);
        }
        let mut left = 3 * n * m;
        while left > 0 {
            let mut best: Option<(f64, usize, Option<Action>)> = None;
            for r in 0..p {
                let t = free[r];
                let next = base[r].get(pc[r]).copied();
                let ready = next.and_then(|a| match a.op {
                    Op::Forward => act_at[a.stage][a.micro],
                    _ => grad_at[a.stage][a.micro],
                });
                let w = !weights[r].is_empty();
                let full =
                    w && weights[r].len() >= cap && next.is_some_and(|a| a.op == Op::Forward);
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
            let (start, r, a) = best.expect("a rank can always act");
            let end = start + COST;
            free[r] = end;
            left -= 1;
            match a {
                Some(a) if a.op == Op::Forward => {
                    pc[r] += 1;
                    self.forward(&mut out[r], a.stage, a.micro);
                    match a.stage + 1 < n {
                        true => act_at[a.stage + 1][a.micro] = Some(end),
                        false => grad_at[a.stage][a.micro] = Some(end),
                    }
                }
                Some(a) => {
                    pc[r] += 1;
                    self.backward(&mut out[r], a.stage, a.micro, Op::BackwardInput);
                    weights[r].push_back((a.stage, a.micro));
                    if a.stage > 0 {
                        grad_at[a.stage - 1][a.micro] = Some(end);
                    }
                }
                None => {
                    let (st, mb) = weights[r].pop_front().expect("a pending weight half");
                    out[r].push(Action::new(st, Op::BackwardWeight, mb));
                }
            }
        }
        out
    }

    /// ZB-H1 (`cap` = `P`) and ZB-H2 (a larger `cap`), built by running
    /// the pipeline on paper with the passes' halves of equal cost
    /// (forward, input half, weight half): whenever a rank is free it runs
    /// an input half whose gradient has arrived (the critical path; the
    /// lowest such stage first, the nearest the pipeline's start), else a
    /// forward pass while it holds at most `cap` micro-batches' stages
    /// (counted until their weight half; at `P`, one more than 1F1B's first
    /// rank, the most any rank holds there; the highest such stage first,
    /// so that micro-batches reach the end sooner), else its oldest weight
    /// half — which so fills the time 1F1B spends waiting. On paper
    /// ZB-H1's bubble is about 40 % of 1F1B's (`check`'s tests).
    fn zero_bubble(&self, cap: usize) -> Vec<Vec<Action>> {
        let (p, m, n) = (self.ranks, self.micro, self.stages());
        const COST: f64 = 1.0;
        let mut out: Vec<Vec<Action>> = vec![Vec::new(); p];
        let mut free = vec![0.0f64; p];
        let mut held = vec![0usize; p];
        let mut weights: Vec<std::collections::VecDeque<(usize, usize)>> =
            vec![Default::default(); p];
        // By stage: the next micro-batch to run forward and backward, and
        // when each micro-batch's input and output gradient arrive there.
        let mut next_f = vec![0usize; n];
        let mut next_i = vec![0usize; n];
        let mut act_at = vec![vec![None::<f64>; m]; n];
        let mut grad_at = vec![vec![None::<f64>; m]; n];
        for slot in act_at[0].iter_mut() {
            *slot = Some(0.0);
        }
        let mut left = 3 * n * m;
        while left > 0 {
            // The rank that is free first and can act, with its choice.
            let mut best: Option<(f64, usize, Op, usize)> = None;
            for r in 0..p {
                let t = free[r];
                let ready = |at: Option<f64>| at.map(|a| a.max(t));
                let stages = (r..n).step_by(p);
                // The earliest input half (lowest stage on a tie) and
                // forward pass (highest stage on a tie).
                let mut i: Option<(f64, usize)> = None;
                let mut f: Option<(f64, usize)> = None;
                for st in stages {
                    if let Some(at) = (next_i[st] < m)
                        .then(|| ready(grad_at[st][next_i[st]]))
                        .flatten()
                    {
                        if i.is_none_or(|(s, _)| at < s) {
                            i = Some((at, st));
                        }
                    }
                    if let Some(at) = (next_f[st] < m && held[r] <= cap)
                        .then(|| ready(act_at[st][next_f[st]]))
                        .flatten()
                    {
                        if f.is_none_or(|(s, _)| at <= s) {
                            f = Some((at, st));
                        }
                    }
                }
                let w = weights[r].front().map(|&(st, _)| (t, st));
                // At the earliest time anything can start, by priority.
                let start = [i, f, w]
                    .into_iter()
                    .flatten()
                    .fold(f64::INFINITY, |a, (s, _)| a.min(s));
                if start.is_infinite() {
                    continue;
                }
                let (op, st) = match (i, f, w) {
                    (Some((s, st)), _, _) if s == start => (Op::BackwardInput, st),
                    (_, Some((s, st)), _) if s == start => (Op::Forward, st),
                    (_, _, Some((_, st))) => (Op::BackwardWeight, st),
                    _ => unreachable!("the earliest start is one of the three"),
                };
                if best.is_none_or(|(s, _, _, _)| start < s) {
                    best = Some((start, r, op, st));
                }
            }
            let (start, r, op, st) = best.expect("a free rank can always act");
            let end = start + COST;
            free[r] = end;
            left -= 1;
            match op {
                Op::Forward => {
                    let mb = next_f[st];
                    next_f[st] += 1;
                    held[r] += 1;
                    self.forward(&mut out[r], st, mb);
                    match st + 1 < n {
                        true => act_at[st + 1][mb] = Some(end),
                        // The loss: its gradient is here.
                        false => grad_at[st][mb] = Some(end),
                    }
                }
                Op::BackwardInput => {
                    let mb = next_i[st];
                    next_i[st] += 1;
                    self.backward(&mut out[r], st, mb, Op::BackwardInput);
                    weights[r].push_back((st, mb));
                    if st > 0 {
                        grad_at[st - 1][mb] = Some(end);
                    }
                }
                _ => {
                    let (st, mb) = weights[r].pop_front().expect("a pending weight half");
                    held[r] -= 1;
                    out[r].push(Action::new(st, Op::BackwardWeight, mb));
                }
            }
        }
        out
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
