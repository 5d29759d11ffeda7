//! The built-in schedules as lists: GPipe, 1F1B, interleaved 1F1B,
//! ZB-H1 and ZB-H2, each the order of the computations on every rank, with the
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
}

impl ScheduleKind {
    /// `gpipe`, `1f1b`, `interleaved` (2 stages per rank),
    /// `interleaved:V`, `zb` (ZB-H1) or `zb-h2`.
    pub fn parse(s: &str) -> Result<ScheduleKind> {
        let s = s.trim().to_ascii_lowercase();
        Ok(match s.as_str() {
            "gpipe" => ScheduleKind::GPipe,
            "1f1b" => ScheduleKind::OneFOneB,
            "interleaved" => ScheduleKind::Interleaved(2),
            "zb" | "zb-h1" | "zbh1" | "zero-bubble" => ScheduleKind::ZeroBubble,
            "zb-h2" | "zbh2" => ScheduleKind::ZeroBubbleH2,
            _ => match s.strip_prefix("interleaved:").map(str::parse::<usize>) {
                Some(Ok(v)) if v >= 1 => ScheduleKind::Interleaved(v),
                _ => {
                    return Err(format!(
                        "--schedule {s}: expected gpipe, 1f1b, interleaved[:V] (V stages per \
                         rank, 2 by default), zb (ZB-H1) or zb-h2, or a schedule file's path"
                    ))
                }
            },
        })
    }

    /// Stages per rank.
    pub fn virtual_stages(self) -> usize {
        match self {
            ScheduleKind::Interleaved(v) => v,
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
        if let ScheduleKind::Interleaved(_) = self {
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

    /// ZB-H1 (`cap` = `P`) and ZB-H2 (a larger `cap`), built by running
    /// the pipeline on paper with the passes' halves of equal cost
    /// (forward, input half, weight half): whenever a rank is free it runs
    /// an input half whose gradient has arrived (the critical path), else
    /// a forward pass while it holds at most `cap` micro-batches (counted
    /// until their weight half; at `P`, one more than 1F1B's first rank,
    /// the most any rank holds there), else a weight half — which so fills
    /// the time 1F1B spends waiting. On paper ZB-H1's bubble is about 40 %
    /// of 1F1B's (`check`'s tests).
    fn zero_bubble(&self, cap: usize) -> Vec<Vec<Action>> {
        let (p, m) = (self.ranks, self.micro);
        const COST: f64 = 1.0;
        let mut out: Vec<Vec<Action>> = vec![Vec::new(); p];
        let mut free = vec![0.0f64; p];
        let mut next_f = vec![0usize; p];
        let mut held = vec![0usize; p];
        let mut weights: Vec<std::collections::VecDeque<usize>> = vec![Default::default(); p];
        // When each rank's inputs and gradients arrive, by micro-batch.
        let mut act_at = vec![vec![None::<f64>; m]; p];
        let mut grad_at = vec![vec![None::<f64>; m]; p];
        let mut next_i = vec![0usize; p];
        for slot in act_at[0].iter_mut() {
            *slot = Some(0.0);
        }
        let mut left = 3 * p * m;
        while left > 0 {
            // The rank that is free first and can act, with its choice.
            let mut best: Option<(f64, usize, Op)> = None;
            for r in 0..p {
                let t = free[r];
                let ready = |at: Option<f64>| at.map(|a| a.max(t));
                let i = (next_i[r] < m)
                    .then(|| ready(grad_at[r][next_i[r]]))
                    .flatten();
                let f = (next_f[r] < m && held[r] <= cap)
                    .then(|| ready(act_at[r][next_f[r]]))
                    .flatten();
                let w = (!weights[r].is_empty()).then_some(t);
                // At the earliest time anything can start, by priority.
                let start = [i, f, w]
                    .into_iter()
                    .flatten()
                    .fold(f64::INFINITY, f64::min);
                if start.is_infinite() {
                    continue;
                }
                let op = if i == Some(start) {
                    Op::BackwardInput
                } else if f == Some(start) {
                    Op::Forward
                } else {
                    Op::BackwardWeight
                };
                if best.is_none_or(|(s, _, _)| start < s) {
                    best = Some((start, r, op));
                }
            }
            let (start, r, op) = best.expect("a free rank can always act");
            let end = start + COST;
            free[r] = end;
            left -= 1;
            match op {
                Op::Forward => {
                    let mb = next_f[r];
                    next_f[r] += 1;
                    held[r] += 1;
                    self.forward(&mut out[r], r, mb);
                    match r + 1 < p {
                        true => act_at[r + 1][mb] = Some(end),
                        // The loss: its gradient is here.
                        false => grad_at[r][mb] = Some(end),
                    }
                }
                Op::BackwardInput => {
                    let mb = next_i[r];
                    next_i[r] += 1;
                    self.backward(&mut out[r], r, mb, Op::BackwardInput);
                    weights[r].push_back(mb);
                    if r > 0 {
                        grad_at[r - 1][mb] = Some(end);
                    }
                }
                _ => {
                    let mb = weights[r].pop_front().expect("a pending weight half");
                    held[r] -= 1;
                    out[r].push(Action::new(r, Op::BackwardWeight, mb));
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
