//! What a pipeline's step looked like: when every rank ran each of its
//! compute actions (from the stamps the executor takes around them, see
//! [`super::exec::StagePasses::stamp`]), put together over the pipeline
//! group into the [`Simulated`] form the schedules' paper runs use, so the
//! measured idle fraction ([`Simulated::bubble`]) sits beside the
//! theory's, and a compact chart of it ([`chart`]).

use crate::schedule::check::{RankTimeline, Simulated};
use crate::schedule::{Action, Op, Schedule};
use crate::Result;
use braid_comm::Communicator;
use std::collections::BTreeMap;

/// Fields per compute action in the gathered buffer: stage, op, micro,
/// start, end.
const FIELDS: usize = 5;

fn op_code(op: Op) -> f64 {
    u8::from(op) as f64
}

impl From<Op> for u8 {
    /// A compute action's kind as a small number (forward 0, backward 1,
    /// its input half 2, its weight half 3).
    fn from(op: Op) -> u8 {
        match op {
            Op::Forward => 0,
            Op::Backward => 1,
            Op::BackwardInput => 2,
            _ => 3,
        }
    }
}

fn op_of(code: f64) -> Op {
    match code as u8 {
        0 => Op::Forward,
        1 => Op::Backward,
        2 => Op::BackwardInput,
        _ => Op::BackwardWeight,
    }
}

/// The most compute actions any rank of `s` runs in a step.
fn most_actions(s: &Schedule) -> usize {
    s.actions
        .iter()
        .map(|l| l.iter().filter(|a| !a.op.communicates()).count())
        .max()
        .unwrap_or(0)
}

/// Every rank's compute actions of a step, from this rank's `spans`
/// (action, start, end in seconds of a clock every rank of `group` shares:
/// the host's wall clock), gathered over the pipeline group (every rank
/// calls it); times from the earliest start.
pub fn gather(
    s: &Schedule,
    spans: &[(Action, f64, f64)],
    group: &Communicator,
) -> Result<Simulated> {
    let per = most_actions(s) * FIELDS;
    if spans.len() * FIELDS > per {
        return Err(format!(
            "pipeline timeline: {} compute actions on this rank, the schedule lists at most {}",
            spans.len(),
            per / FIELDS
        ));
    }
    // Unused slots: a negative stage.
    let mut mine = vec![-1.0f64; per];
    for (i, (a, t0, t1)) in spans.iter().enumerate() {
        mine[i * FIELDS..(i + 1) * FIELDS].copy_from_slice(&[
            a.stage as f64,
            op_code(a.op),
            a.micro as f64,
            *t0,
            *t1,
        ]);
    }
    let mut all = vec![0.0f64; per * group.size()];
    group
        .all_gather(&mine, &mut all)
        .map_err(|e| format!("the pipeline's timeline: {e}"))?;
    let origin = all
        .chunks_exact(FIELDS)
        .filter(|f| f[0] >= 0.0)
        .map(|f| f[3])
        .fold(f64::INFINITY, f64::min);
    let mut ranks = Vec::with_capacity(group.size());
    for r in all.chunks_exact(per.max(1)) {
        let spans: Vec<(Action, f64, f64)> = r
            .chunks_exact(FIELDS)
            .filter(|f| f[0] >= 0.0)
            .map(|f| {
                let a = Action::new(f[0] as usize, op_of(f[1]), f[2] as usize);
                (a, f[3] - origin, f[4] - origin)
            })
            .collect();
        ranks.push(RankTimeline {
            end: spans.iter().map(|s| s.2).fold(0.0, f64::max),
            busy: spans.iter().map(|s| s.2 - s.1).sum(),
            spans,
        });
    }
    let makespan = ranks.iter().map(|r| r.end).fold(0.0, f64::max);
    Ok(Simulated { ranks, makespan })
}

/// The character of a compute action in the chart: forward passes the
/// micro-batch's digit, backward passes its letter (`a` for 0), weight
/// halves `w`.
fn glyph(a: &Action) -> char {
    let m = a.micro as u8;
    match a.op {
        Op::Forward => (b'0' + m % 10) as char,
        Op::Backward | Op::BackwardInput => (b'a' + m % 26) as char,
        _ => 'w',
    }
}

/// A chart of `t`, `width` columns per rank: each column the action
/// running at its middle, `.` where the rank waits.
pub fn chart(t: &Simulated, width: usize) -> String {
    chart_named(t, width, &[])
}

/// [`chart`] with row `r` named `rank names[r]` (a world rank), where
/// `names` has it; else `pipeline rank r`.
pub fn chart_named(t: &Simulated, width: usize, names: &[usize]) -> String {
    let mut out = String::new();
    let width = width.max(1);
    let label = |r: usize| match names.get(r) {
        Some(w) => format!("rank {w:>2}"),
        None => format!("pipeline rank {r:>2}"),
    };
    for (r, rank) in t.ranks.iter().enumerate() {
        let row: String = (0..width)
            .map(|c| {
                let at = (c as f64 + 0.5) / width as f64 * t.makespan;
                rank.spans
                    .iter()
                    .find(|(_, s, e)| *s <= at && at < *e)
                    .map_or('.', |(a, _, _)| glyph(a))
            })
            .collect();
        out.push_str(&format!("  {} |{row}|\n", label(r)));
    }
    out
}

/// The theory's idle fraction of `s`: the schedule run on paper with a
/// backward pass twice a forward's (its halves one each).
pub fn on_paper(s: &Schedule) -> Result<f64> {
    on_paper_weighted(s, &vec![1.0; s.stages()])
}

/// [`on_paper`] with stage `i`'s forward pass taking `costs[i]` (its
/// estimated time, e.g. its layers with the head counted: the stages of
/// whole layers are seldom equal, and the slowest sets the pace).
pub fn on_paper_weighted(s: &Schedule, costs: &[f64]) -> Result<f64> {
    if costs.len() != s.stages() {
        return Err(format!(
            "{} stage costs for a schedule of {} stages",
            costs.len(),
            s.stages()
        ));
    }
    let sim = crate::schedule::check::simulate_actions(s, &|a| {
        costs[a.stage]
            * match a.op {
                Op::Forward | Op::BackwardInput | Op::BackwardWeight => 1.0,
                Op::Backward => 2.0,
                _ => 0.0,
            }
    })?;
    Ok(sim.bubble())
}

/// The idle fraction of `s` run on paper with each action taking the
/// median time its stage and kind took in `measured` (a step as it ran):
/// the bubble this hardware's own times allow, waits for data and
/// stragglers aside (an action kind a stage never ran costs nothing).
pub fn on_paper_measured(s: &Schedule, measured: &Simulated) -> Result<f64> {
    let medians = median_times(measured);
    let sim = crate::schedule::check::simulate_actions(s, &|a| {
        medians.get(&(a.stage, a.op.into())).copied().unwrap_or(0.0)
    })?;
    Ok(sim.bubble())
}

/// The kinds of compute action, in the order [`action_times`] prints
/// them.
const KINDS: [(Op, &str); 4] = [
    (Op::Forward, "F"),
    (Op::Backward, "B"),
    (Op::BackwardInput, "I"),
    (Op::BackwardWeight, "W"),
];

/// Each (stage, kind of action)'s median duration in `measured`, seconds
/// (the kind as [`op_code`]).
fn median_times(measured: &Simulated) -> BTreeMap<(usize, u8), f64> {
    let mut times: BTreeMap<(usize, u8), Vec<f64>> = BTreeMap::new();
    for rank in &measured.ranks {
        for (a, t0, t1) in &rank.spans {
            times
                .entry((a.stage, a.op.into()))
                .or_default()
                .push(t1 - t0);
        }
    }
    times
        .into_iter()
        .map(|(k, mut v)| {
            v.sort_by(f64::total_cmp);
            (k, v[v.len() / 2])
        })
        .collect()
}

/// A line of each stage's median action times in `measured`
/// (`stage 0 F 4.81 I 6.52 W 2.40 ms`): with a zero-bubble schedule, how
/// long the weight half is beside the input half bounds what it can
/// fill.
pub fn action_times(measured: &Simulated) -> String {
    let medians = median_times(measured);
    let mut stages: Vec<usize> = medians.keys().map(|k| k.0).collect();
    stages.dedup();
    let parts: Vec<String> = stages
        .iter()
        .map(|&st| {
            let ops: Vec<String> = KINDS
                .iter()
                .filter_map(|&(op, name)| {
                    let t = medians.get(&(st, op.into()))?;
                    Some(format!("{name} {:.2}", 1e3 * t))
                })
                .collect();
            format!("stage {st} {}", ops.join(" "))
        })
        .collect();
    format!("{} ms", parts.join(" | "))
}

/// What a rank's stages held at once: per stage (global index) the most
/// micro-batches' buffers in flight, and where known the bytes of one.
pub struct Held<'a> {
    /// The pipeline rank.
    pub rank: usize,
    /// Its stages.
    pub stages: Vec<usize>,
    /// Buffers made per stage.
    pub made: &'a [usize],
    /// Bytes of one, per stage (GPUs).
    pub bytes: Option<&'a [usize]>,
}

impl Held<'_> {
    /// The line printed after the timeline.
    fn line(&self) -> String {
        let parts: Vec<String> = self
            .stages
            .iter()
            .enumerate()
            .map(|(k, i)| {
                let n = self.made.get(k).copied().unwrap_or(0);
                match self.bytes.and_then(|b| b.get(k)) {
                    Some(b) => format!("stage {i}: {n} ({:.1} MB each)", *b as f64 / 1e6),
                    None => format!("stage {i}: {n}"),
                }
            })
            .collect();
        format!(
            "micro-batches whose activations pipeline rank {} held at once, at most: {}",
            self.rank,
            parts.join(", ")
        )
    }

    /// The same as JSON.
    fn json(&self) -> serde_json::Value {
        self.stages
            .iter()
            .enumerate()
            .map(|(k, i)| {
                let mut v = serde_json::json!({"stage": i, "micro_batches": self.made.get(k)});
                if let Some(b) = self.bytes.and_then(|b| b.get(k)) {
                    v["bytes"] = (*b).into();
                }
                v
            })
            .collect()
    }
}

/// A pipeline's steps as they ran: the last step's timeline and the
/// measured idle fractions of the steps after the first `skip`.
#[derive(Debug, Default)]
pub struct Measured {
    /// The last step's.
    pub last: Option<Simulated>,
    /// Idle fractions of the steps counted.
    pub bubbles: Vec<f64>,
    /// Steps seen.
    pub steps: usize,
    /// Each stage's estimated time (its layers, the head counted), where
    /// known: the paper's bubble with the stages as split.
    pub stage_costs: Option<Vec<f64>>,
    /// The world rank of each pipeline rank, where known (the chart's
    /// rows are named by them; else by pipeline rank).
    pub world_ranks: Vec<usize>,
}

impl Measured {
    /// Steps not counted (warm-up).
    pub const SKIP: usize = 2;

    /// Adds a step's timeline.
    pub fn add(&mut self, t: Simulated) {
        self.steps += 1;
        if self.steps > Self::SKIP {
            self.bubbles.push(t.bubble());
        }
        self.last = Some(t);
    }

    /// The idle fraction of the steps counted (the last step's when none
    /// are).
    pub fn measured(&self) -> Option<f64> {
        let last = self.last.as_ref()?;
        Some(match self.bubbles.is_empty() {
            true => last.bubble(),
            false => self.bubbles.iter().sum::<f64>() / self.bubbles.len() as f64,
        })
    }

    /// [`report`](Self::report) followed by what the rank's stages held.
    pub fn report_held(&self, s: &Schedule, held: &Held<'_>) -> Option<String> {
        Some(format!("{}\n{}", self.report(s)?, held.line()))
    }

    /// [`to_json`](Self::to_json) with what the rank's stages held.
    pub fn json_held(&self, s: &Schedule, held: &Held<'_>) -> Option<serde_json::Value> {
        let mut doc = self.to_json(s)?;
        doc["in_flight"] = held.json();
        doc["pipeline_rank"] = held.rank.into();
        Some(doc)
    }

    /// The same as JSON (for `--json`): the schedule, the measured idle
    /// fraction beside the paper's and the formula's, and the last step's
    /// compute actions per rank (stage, op, micro-batch, start and end in
    /// seconds from the step's first).
    pub fn to_json(&self, s: &Schedule) -> Option<serde_json::Value> {
        let last = self.last.as_ref()?;
        let (n, m, v) = (
            s.ranks as f64,
            s.micro_batches as f64,
            s.virtual_stages as f64,
        );
        let op = |o: Op| match o {
            Op::Forward => "F",
            Op::Backward => "B",
            Op::BackwardInput => "I",
            _ => "W",
        };
        let ranks: Vec<serde_json::Value> = last
            .ranks
            .iter()
            .map(|r| {
                let spans: Vec<serde_json::Value> = r
                    .spans
                    .iter()
                    .map(|(a, t0, t1)| serde_json::json!([a.stage, op(a.op), a.micro, t0, t1]))
                    .collect();
                serde_json::json!({"busy_s": r.busy, "spans": spans})
            })
            .collect();
        Some(serde_json::json!({
            "schedule": s.name,
            "ranks": s.ranks,
            "micro_batches": s.micro_batches,
            "virtual_stages": s.virtual_stages,
            "bubble_measured": self.measured()?,
            "bubble_last_step": last.bubble(),
            "bubble_on_paper": on_paper(s).ok(),
            "bubble_on_paper_these_stages": self
                .stage_costs
                .as_ref()
                .and_then(|c| on_paper_weighted(s, c).ok()),
            "bubble_on_paper_measured_times": on_paper_measured(s, last).ok(),
            "action_times_s": median_times(last)
                .iter()
                .map(|(&(stage, op), t)| serde_json::json!([stage, KINDS[op as usize].1, t]))
                .collect::<Vec<_>>(),
            "bubble_formula": (n - 1.0) / (v * m + n - 1.0),
            "steps_counted": self.bubbles.len(),
            "last_step": {"step_s": last.makespan, "ranks": ranks},
        }))
    }

    /// The report printed at the end of a run: the last step's chart, the
    /// measured idle fraction beside the paper's (and, for GPipe and
    /// 1F1B, `(N−1)/(M+N−1)`).
    pub fn report(&self, s: &Schedule) -> Option<String> {
        let last = self.last.as_ref()?;
        let measured = self.measured()?;
        let counted = match self.bubbles.len() {
            0 => "the last step".to_string(),
            n => format!("the mean of {n} steps after {}", Self::SKIP),
        };
        let (n, m) = (s.ranks as f64, s.micro_batches as f64);
        let formula = match s.virtual_stages {
            1 => format!(
                ", (N-1)/(M+N-1) = {:.1}%",
                100.0 * (n - 1.0) / (m + n - 1.0)
            ),
            v => format!(
                ", (N-1)/(V*M+N-1) = {:.1}%",
                100.0 * (n - 1.0) / (v as f64 * m + n - 1.0)
            ),
        };
        let paper = on_paper(s)
            .map(|b| format!("{:.1}%", 100.0 * b))
            .unwrap_or_else(|e| e);
        let split = match &self.stage_costs {
            Some(c) if c.iter().any(|&x| (x - c[0]).abs() > 1e-9) => on_paper_weighted(s, c)
                .map(|b| format!(", {:.1}% with these stages' estimated times", 100.0 * b))
                .unwrap_or_default(),
            _ => String::new(),
        };
        let timed = on_paper_measured(s, last)
            .map(|b| {
                format!(
                    ", {:.1}% with the last step's measured action times",
                    100.0 * b
                )
            })
            .unwrap_or_default();
        let per_rank: Vec<String> = last
            .ranks
            .iter()
            .map(|r| match last.makespan > 0.0 {
                true => format!("{:.0}%", 100.0 * (1.0 - r.busy / last.makespan)),
                false => "-".into(),
            })
            .collect();
        Some(format!(
            "pipeline timeline of the last step ({:.1} ms; digits: forward of micro-batch n, \
             letters: its backward, w: weight half, '.': waiting):\n{}pipeline bubble: measured \
             {:.1}% ({counted}; last step by rank {})\npipeline bubble on paper: {paper} \
             (backward 2x forward, equal stages{split}{timed}){formula}\nmedian action times of \
             the last step: {}",
            1e3 * last.makespan,
            chart_named(last, 64, &self.world_ranks),
            100.0 * measured,
            per_rank.join(" "),
            action_times(last),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::build::ScheduleKind;

    #[test]
    fn the_chart_of_a_paper_run_shows_the_1f1b_bubble() {
        let s = ScheduleKind::OneFOneB.build(2, 4).unwrap();
        let sim = crate::schedule::check::simulate(&s, &|op| match op {
            Op::Forward => 1.0,
            Op::Backward => 2.0,
            _ => 0.0,
        })
        .unwrap();
        let c = chart(&sim, 15);
        let rows: Vec<&str> = c.lines().collect();
        // Rank 1 waits for its first activation; rank 0 for its last
        // gradient.
        assert!(rows[1].contains("|.0"), "{c}");
        assert!(rows[0].starts_with("  pipeline rank  0 |0"), "{c}");
        assert!(rows[0].ends_with(".d|") || rows[0].contains(".d"), "{c}");
        // (N−1)/(M+N−1) with a backward twice a forward: 1/5.
        assert!((sim.bubble() - 0.2).abs() < 1e-9, "{}", sim.bubble());
    }

    /// With the 2.65B model's split over 4 stages (8, 8, 9 layers and 7
    /// with the head's 1.54), GPipe at 8 micro-batches idles about what
    /// its slowest stage allows, `1 − M·Σt / (N·(Σt + (M−1)·max))` =
    /// 30.5 % (the formula's 27.3 % needs equal stages; 4 H100s measured
    /// 31.5 %), 1F1B likewise; equal costs give the plain paper figure.
    #[test]
    fn the_paper_bubble_weighs_unequal_stages() {
        let costs = [8.0, 8.0, 9.0, 7.0 + 1.535];
        let (sum, max, m, n) = (costs.iter().sum::<f64>(), 9.0, 8.0, 4.0);
        let bound = 1.0 - m * sum / (n * (sum + (m - 1.0) * max));
        for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
            let s = kind.build(4, 8).unwrap();
            let even = on_paper(&s).unwrap();
            let split = on_paper_weighted(&s, &costs).unwrap();
            assert!((even - 3.0 / 11.0).abs() < 1e-9, "{even}");
            assert!(split > even + 0.02, "{split} vs {even}");
            assert!(
                (split - bound).abs() < 0.01,
                "{}: {split} vs {bound}",
                s.name
            );
            assert_eq!(on_paper_weighted(&s, &[2.0; 4]).unwrap(), even);
        }
        let s = ScheduleKind::OneFOneB.build(4, 8).unwrap();
        assert!(on_paper_weighted(&s, &[1.0; 3]).is_err());
    }

    /// A paper run fed back as if measured gives its own bubble back, and
    /// a weight half shorter than the input half leaves ZB-H1 more of
    /// 1F1B's bubble than the equal halves do.
    #[test]
    fn the_measured_times_bubble_replays_a_step() {
        let cost = |a: &Action| match a.op {
            Op::Forward => 1.0,
            Op::Backward => 2.0,
            Op::BackwardInput => 1.0,
            Op::BackwardWeight => 1.0,
            _ => 0.0,
        };
        let short_w = |a: &Action| match a.op {
            Op::BackwardInput => 1.4,
            Op::BackwardWeight => 0.6,
            _ => cost(a),
        };
        let one = ScheduleKind::OneFOneB.build(4, 8).unwrap();
        let zb = ScheduleKind::ZeroBubble.build(4, 8).unwrap();
        let run = |s: &Schedule, c: &dyn Fn(&Action) -> f64| {
            crate::schedule::check::simulate_actions(s, c).unwrap()
        };
        let times = action_times(&run(&zb, &short_w));
        assert!(
            times.starts_with("stage 0 F 1000.00 I 1400.00 W 600.00 |"),
            "{times}"
        );
        assert!(
            times.ends_with("stage 3 F 1000.00 I 1400.00 W 600.00 ms"),
            "{times}"
        );
        for s in [&one, &zb] {
            let sim = run(s, &cost);
            let replay = on_paper_measured(s, &sim).unwrap();
            assert!((replay - sim.bubble()).abs() < 1e-9, "{}: {replay}", s.name);
        }
        let even = on_paper_measured(&zb, &run(&zb, &cost)).unwrap()
            / on_paper_measured(&one, &run(&one, &cost)).unwrap();
        let skew = on_paper_measured(&zb, &run(&zb, &short_w)).unwrap()
            / on_paper_measured(&one, &run(&one, &short_w)).unwrap();
        assert!(skew > even + 0.05, "{skew} vs {even}");
    }

    #[test]
    fn gathered_spans_keep_their_actions() {
        let spans = [
            (Action::new(0, Op::Forward, 3), 10.0, 11.0),
            (Action::new(0, Op::BackwardInput, 3), 11.0, 12.5),
        ];
        for (a, _, _) in &spans {
            let f = [a.stage as f64, op_code(a.op), a.micro as f64];
            assert_eq!(Action::new(f[0] as usize, op_of(f[1]), f[2] as usize), *a);
        }
    }
}
