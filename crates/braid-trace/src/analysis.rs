//! The analysis of a traced run: where each rank's steps went, how much
//! communication computation hid, which rank holds the others back, and
//! what bounds the run.
//!
//! The temporal breakdown follows Holistic Trace Analysis: within a step,
//! *compute* is the time some computation runs (on a GPU rank, the
//! compute stream's spans; on a CPU rank, the host's); *exposed
//! communication* is the time a collective runs while nothing computes;
//! *data* and *other* (checkpoint copies, evaluation) the host work
//! outside both; *idle* the rest. The five add up to the step. The
//! *overlap* is the share of collective time that computation hid.
//!
//! Under a pipeline (`braid train --pp`) a rank's *pipelined passes* — the
//! engine's forward pass, which runs the whole schedule: its stages'
//! forward and backward passes of every micro-batch, the sends and
//! receives between stages, the loss from the last stage, the tied
//! embeddings' sum — split into computation and the *pipeline bubble*:
//! the time in them that the rank computes nothing, waiting for the other
//! stages. The bubble is a sixth part of the step, not exposed
//! communication; the collectives outside those passes (data-parallel
//! reductions, the loss's all-reduce) stay communication. The straggler
//! is then sought among the ranks of one pipeline stage (its data-parallel
//! replicas): the stages' differing work is stage imbalance, which
//! `report` weighs on its own.

use crate::format::{RankTrace, TraceEvent};
use crate::intervals::Intervals;
use crate::recorder::track;

/// Where one step's time went on one rank (microseconds).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepBreakdown {
    /// 0-based step.
    pub step: u64,
    /// Step start on the reference clock.
    pub start: f64,
    /// The whole step.
    pub total: f64,
    /// Computation (a tensor-parallel pass's waits for its own
    /// collectives excluded: see `tensor_comm`).
    pub compute: f64,
    /// Tensor-parallel collectives inside the passes (the computation
    /// waits for them): their own category.
    pub tensor_comm: f64,
    /// Collectives while nothing computes (under a pipeline, outside its
    /// passes).
    pub exposed_comm: f64,
    /// Under a pipeline: the time in the rank's pipelined passes that it
    /// computes nothing (waiting for the other stages: in the receives
    /// between stages, in the step's last exchanges, idle between its
    /// actions). Zero otherwise.
    pub bubble: f64,
    /// Under a pipeline: the computation inside the pipelined passes (its
    /// stages' forward and backward passes; not the optimizer, nor the
    /// tensor group's collectives). Zero otherwise.
    pub stage_compute: f64,
    /// Under a pipeline: the pipelined passes' length (`stage_compute`,
    /// the tensor group's collectives in them and `bubble`). Zero
    /// otherwise.
    pub passes: f64,
    /// Host data loading outside computation and collectives.
    pub data: f64,
    /// Checkpoint copies and evaluation outside the above.
    pub other: f64,
    /// Nothing running.
    pub idle: f64,
    /// All collective time (under a pipeline, outside its passes: the
    /// pipeline's own transfers are in `bubble` and `stage_compute`).
    pub comm: f64,
    /// Collective time during computation (likewise).
    pub overlapped: f64,
}

/// The categories of a rank's spans, as interval sets.
struct Sets {
    compute: Intervals,
    tensor: Intervals,
    comm: Intervals,
    data: Intervals,
    other: Intervals,
    /// The forward passes (under a pipeline: the pipelined passes).
    forward: Intervals,
}

/// Whether `t` has spans timed on a GPU's compute stream.
pub fn on_gpu(events: &[TraceEvent]) -> bool {
    events.iter().any(|e| e.tid == track::GPU_COMPUTE)
}

fn sets(events: &[TraceEvent]) -> Sets {
    let gpu = on_gpu(events);
    let pick = |f: &dyn Fn(&TraceEvent) -> bool| {
        Intervals::union(events.iter().filter(|e| f(e)).map(|e| (e.ts, e.end())))
    };
    // Blocks' spans are the computation; a trace without them (an engine
    // that records none) counts its whole passes.
    let blocks = events.iter().any(|e| e.cat == "compute");
    let computing = |e: &TraceEvent| match e.cat.as_str() {
        "compute" | "optimizer" => true,
        "pass" => !blocks,
        _ => false,
    };
    Sets {
        compute: pick(&|e| computing(e) && (!gpu || e.tid == track::GPU_COMPUTE)),
        tensor: pick(&|e| e.cat == "tensor-comm"),
        comm: pick(&|e| e.cat == "comm"),
        data: pick(&|e| e.cat == "data"),
        other: pick(&|e| (e.cat == "checkpoint" || e.cat == "eval") && e.tid == track::HOST),
        forward: pick(&|e| e.cat == "pass" && e.name == "forward"),
    }
}

/// The step spans of a rank: (step, start, end).
pub fn steps(events: &[TraceEvent]) -> Vec<(u64, f64, f64)> {
    events
        .iter()
        .filter(|e| e.cat == "step")
        .map(|e| (e.num("step").unwrap_or(0.0) as u64, e.ts, e.end()))
        .collect()
}

/// Every step's breakdown on one rank.
pub fn breakdown(events: &[TraceEvent]) -> Vec<StepBreakdown> {
    breakdown_as(events, false)
}

/// Every step's breakdown on one rank; `pipelined`: the rank is a
/// pipeline's (its forward passes are the pipelined passes, see the
/// module's documentation).
pub fn breakdown_as(events: &[TraceEvent], pipelined: bool) -> Vec<StepBreakdown> {
    let s = sets(events);
    steps(events)
        .into_iter()
        .map(|(step, a, b)| {
            let c = s.compute.clip(a, b);
            let p = match pipelined {
                true => s.forward.clip(a, b),
                false => Intervals::default(),
            };
            let m = s.comm.clip(a, b);
            // The pipeline's own transfers: inside its passes.
            let m_in = m.and(&p);
            let cp = c.or(&p);
            let cpm = cp.or(&m);
            let cpmd = cpm.or(&s.data.clip(a, b));
            let busy = cpmd.or(&s.other.clip(a, b));
            let overlapped = m.overlap_len(&c) - m_in.overlap_len(&c);
            // The tensor group's collectives run inside the passes' spans.
            let tensor_in = s.tensor.clip(a, b).and(&c);
            let tensor = tensor_in.len();
            StepBreakdown {
                step,
                start: a,
                total: b - a,
                compute: (c.len() - tensor).max(0.0),
                tensor_comm: tensor,
                // (Differences of sums: clamped against rounding.)
                exposed_comm: (cpm.len() - cp.len()).max(0.0),
                bubble: (cp.len() - c.len()).max(0.0),
                stage_compute: (c.overlap_len(&p) - tensor_in.overlap_len(&p)).max(0.0),
                passes: p.len(),
                data: (cpmd.len() - cpm.len()).max(0.0),
                other: (busy.len() - cpmd.len()).max(0.0),
                idle: ((b - a) - busy.len()).max(0.0),
                comm: (m.len() - m_in.len()).max(0.0),
                overlapped: overlapped.max(0.0),
            }
        })
        .collect()
}

/// The idle gaps of each step (for the trace's idle track), as (start,
/// end) pairs.
pub fn idle_gaps(events: &[TraceEvent]) -> Vec<(f64, f64)> {
    let s = sets(events);
    let busy = s.compute.or(&s.comm).or(&s.data).or(&s.other);
    steps(events)
        .into_iter()
        .flat_map(|(_, a, b)| busy.gaps(a, b).spans().to_vec())
        .collect()
}

/// Adds each step's idle gaps to `t` as spans on the idle track.
pub fn add_idle_spans(t: &mut RankTrace) {
    let gaps = idle_gaps(&t.events);
    for (a, b) in gaps {
        t.events.push(TraceEvent {
            pid: t.rank as u32,
            tid: track::IDLE,
            name: "idle".into(),
            cat: "idle".into(),
            ts: a,
            dur: b - a,
            args: Default::default(),
        });
    }
    crate::format::sort(&mut t.events);
}

/// A rank's mean step (microseconds) over the steps counted.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RankMeans {
    /// The rank.
    pub rank: usize,
    /// Steps averaged.
    pub steps: usize,
    /// Mean of each part (see [`StepBreakdown`]).
    pub mean: StepBreakdown,
}

/// The mean of `steps`, not counting the first `warmup` (fewer if the run
/// is short).
pub fn means(rank: usize, steps: &[StepBreakdown], warmup: usize) -> RankMeans {
    let warm = warmup.min(steps.len().saturating_sub(1));
    let counted = &steps[warm..];
    RankMeans {
        rank,
        steps: counted.len(),
        mean: StepBreakdown::mean_of(counted),
    }
}

impl StepBreakdown {
    /// The part-by-part mean of `items` (step and start zero).
    pub fn mean_of<'a>(items: impl IntoIterator<Item = &'a StepBreakdown>) -> StepBreakdown {
        let (mut sum, mut k) = (StepBreakdown::default(), 0usize);
        for s in items {
            sum.total += s.total;
            sum.compute += s.compute;
            sum.tensor_comm += s.tensor_comm;
            sum.exposed_comm += s.exposed_comm;
            sum.bubble += s.bubble;
            sum.stage_compute += s.stage_compute;
            sum.passes += s.passes;
            sum.data += s.data;
            sum.other += s.other;
            sum.idle += s.idle;
            sum.comm += s.comm;
            sum.overlapped += s.overlapped;
            k += 1;
        }
        let k = k.max(1) as f64;
        StepBreakdown {
            step: 0,
            start: 0.0,
            total: sum.total / k,
            compute: sum.compute / k,
            tensor_comm: sum.tensor_comm / k,
            exposed_comm: sum.exposed_comm / k,
            bubble: sum.bubble / k,
            stage_compute: sum.stage_compute / k,
            passes: sum.passes / k,
            data: sum.data / k,
            other: sum.other / k,
            idle: sum.idle / k,
            comm: sum.comm / k,
            overlapped: sum.overlapped / k,
        }
    }
}

/// One part of a step's breakdown.
type Part = fn(&StepBreakdown) -> f64;

/// A rank that holds the others back.
#[derive(Debug, Clone, PartialEq)]
pub struct Straggler {
    /// The rank.
    pub rank: usize,
    /// In what it is slow: `compute`, `data`, `other` or `communication`.
    pub category: &'static str,
    /// How much longer it takes per step than the median rank
    /// (microseconds).
    pub excess_us: f64,
    /// The figures behind the verdict.
    pub evidence: String,
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

/// How far (a share of the median rank's step) a rank's own work per
/// step must exceed the other ranks' median for [`straggler`] to name it.
/// A shared or oversubscribed machine makes ranks differ by a few percent
/// on their own: only a tenth of the step is called a straggler. Every
/// text that states the threshold (`braid report`, its HTML page) takes
/// it from here.
pub const STRAGGLER_SHARE: f64 = 0.10;

/// The least excess (microseconds) [`straggler`] names, however short the
/// step.
pub const STRAGGLER_MIN_US: f64 = 1000.0;

/// The straggler among `ranks`, if one stands out. A rank's own work per
/// step is its computation, data loading and other host work; in a
/// synchronous run the others wait for the rank with the most of it, so
/// the straggler is the rank whose own work exceeds the other ranks'
/// median by more than [`STRAGGLER_SHARE`] of the step (and
/// [`STRAGGLER_MIN_US`]), in the part that exceeds most. With no such
/// rank, a rank whose collectives take longer than the other ranks'
/// median by as much is slow in communication, not counting the time it
/// waits in them for the others because its own work is shorter.
pub fn straggler(ranks: &[RankMeans]) -> Option<Straggler> {
    straggler_among(ranks, "the other ranks")
}

/// [`straggler`] sought among the ranks that do the same work: `stage[i]`
/// is the pipeline rank of `ranks[i]`, and a straggler is looked for
/// within each pipeline stage's ranks (its data-parallel replicas), the
/// one that exceeds its stage's others most named. Ranks of different
/// stages differ by their stages' work (stage imbalance), not by
/// slowness; a stage on one rank has no straggler.
pub fn stage_straggler(ranks: &[RankMeans], stage: &[usize]) -> Option<Straggler> {
    let mut stages: Vec<usize> = stage.to_vec();
    stages.sort_unstable();
    stages.dedup();
    stages
        .into_iter()
        .filter_map(|st| {
            let mine: Vec<RankMeans> = ranks
                .iter()
                .zip(stage)
                .filter(|(_, s)| **s == st)
                .map(|(m, _)| *m)
                .collect();
            straggler_among(&mine, &format!("pipeline rank {st}'s other ranks"))
        })
        .max_by(|a, b| a.excess_us.total_cmp(&b.excess_us))
}

/// [`straggler`], the others called `peers` in the evidence (a plural
/// that takes a possessive `'`).
fn straggler_among(ranks: &[RankMeans], peers: &str) -> Option<Straggler> {
    if ranks.len() < 2 {
        return None;
    }
    let own = |m: &RankMeans| m.mean.compute + m.mean.data + m.mean.other;
    let step = median(ranks.iter().map(|m| m.mean.total).collect());
    let threshold = (STRAGGLER_SHARE * step).max(STRAGGLER_MIN_US);
    let slow = ranks.iter().max_by(|a, b| {
        own(a)
            .partial_cmp(&own(b))
            .unwrap_or(std::cmp::Ordering::Equal)
    })?;
    // Against the others: with two ranks the median of all would sit
    // halfway to the straggler.
    let others = |r: usize, f: &dyn Fn(&RankMeans) -> f64| {
        median(ranks.iter().filter(|m| m.rank != r).map(f).collect())
    };
    let excess = own(slow) - others(slow.rank, &own);
    let ms = |us: f64| format!("{:.2} ms", us / 1e3);
    if excess > threshold {
        let parts: [(&'static str, Part); 3] = [
            ("compute", |s| s.compute),
            ("data", |s| s.data),
            ("other", |s| s.other),
        ];
        let (category, part_excess) = parts
            .iter()
            .map(|(name, f)| (*name, f(&slow.mean) - others(slow.rank, &|m| f(&m.mean))))
            .max_by(|a, b| a.1.partial_cmp(&b.1).unwrap_or(std::cmp::Ordering::Equal))?;
        let others_wait = median(
            ranks
                .iter()
                .filter(|m| m.rank != slow.rank)
                .map(|m| m.mean.exposed_comm + m.mean.idle)
                .collect(),
        );
        return Some(Straggler {
            rank: slow.rank,
            category,
            excess_us: excess,
            evidence: format!(
                "rank {} works {} per step ({category} {} more than {peers}' median); {peers} wait {} per step in collectives or idle, rank {} {}",
                slow.rank,
                ms(own(slow)),
                ms(part_excess),
                ms(others_wait),
                slow.rank,
                ms(slow.mean.exposed_comm + slow.mean.idle),
            ),
        });
    }
    let busiest = ranks.iter().max_by(|a, b| {
        a.mean
            .comm
            .partial_cmp(&b.mean.comm)
            .unwrap_or(std::cmp::Ordering::Equal)
    })?;
    let med_comm = others(busiest.rank, &|m| m.mean.comm);
    // A rank that reaches each collective early waits in it for the
    // others: as much of its longer collectives as its own work falls
    // short of the other ranks' is waiting, not slowness (the fastest
    // rank has the longest collectives).
    let early = (others(busiest.rank, &own) - own(busiest)).max(0.0);
    if busiest.mean.comm - med_comm - early > threshold {
        return Some(Straggler {
            rank: busiest.rank,
            category: "communication",
            excess_us: busiest.mean.comm - med_comm,
            evidence: format!(
                "no rank's own work stands out, but rank {}'s collectives run {} per step against {peers}' median {}{}",
                busiest.rank,
                ms(busiest.mean.comm),
                ms(med_comm),
                if early > 0.0 {
                    format!(
                        " (its own work is {} shorter than theirs: that much is waiting for them)",
                        ms(early)
                    )
                } else {
                    String::new()
                }
            ),
        });
    }
    None
}

/// One collective operation's figures on one rank.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct OpStats {
    /// Operation (`all_reduce`, ...).
    pub op: String,
    /// How many ran.
    pub count: u64,
    /// Their total time, microseconds.
    pub total_us: f64,
    /// Their bytes (each rank's buffer).
    pub bytes: u64,
    /// Mean algorithm bandwidth, GB/s (bytes / time, time-weighted).
    pub algbw: f64,
    /// Mean bus bandwidth, GB/s (nccl-tests' convention).
    pub busbw: f64,
}

/// The bus-bandwidth factor of `op` over `n` ranks (nccl-tests).
pub fn busbw_factor(op: &str, n: usize) -> f64 {
    let n = n.max(1) as f64;
    match op {
        "all_reduce" => 2.0 * (n - 1.0) / n,
        "all_gather" | "reduce_scatter" | "all_to_all" | "gather" | "scatter" => (n - 1.0) / n,
        _ => 1.0,
    }
}

/// Per-operation figures of a rank's collectives that start inside one
/// of the `windows` (start, end), or all of them without windows.
pub fn op_stats(events: &[TraceEvent], world: usize, windows: &[(f64, f64)]) -> Vec<OpStats> {
    let mut out: Vec<OpStats> = Vec::new();
    let inside =
        |e: &TraceEvent| windows.is_empty() || windows.iter().any(|(a, b)| e.ts >= *a && e.ts < *b);
    for e in events.iter().filter(|e| e.cat == "comm" && inside(e)) {
        let bytes = e.num("bytes").unwrap_or(0.0) as u64;
        let i = match out.iter().position(|o| o.op == e.name) {
            Some(i) => i,
            None => {
                out.push(OpStats {
                    op: e.name.clone(),
                    ..Default::default()
                });
                out.len() - 1
            }
        };
        let n = e.num("ranks").map(|v| v as usize).unwrap_or(world);
        let o = &mut out[i];
        o.count += 1;
        o.total_us += e.dur;
        o.bytes += bytes;
        o.busbw += bytes as f64 * busbw_factor(&e.name, n);
    }
    for o in &mut out {
        let secs = (o.total_us / 1e6).max(1e-12);
        o.algbw = o.bytes as f64 / secs / 1e9;
        o.busbw = o.busbw / secs / 1e9;
    }
    out.sort_by(|a, b| {
        b.total_us
            .partial_cmp(&a.total_us)
            .unwrap_or(std::cmp::Ordering::Equal)
    });
    out
}

/// A rank's collectives per step, told apart by what runs them: the
/// training strategy's gradient reductions and parameter gathers; the
/// all-reduce of the gradient norm's square that a strategy with sharded
/// gradients runs in the optimizer's part of the step; and the training
/// loop's all-reduce of the step's loss (its mean over the ranks, for the
/// progress line), which runs once the optimizer is done; under a
/// pipeline, the pipeline's own (inside its passes: the sends and
/// receives between stages, the loss from the last stage, the timeline's
/// gather, the tied embeddings' sum); and the tensor group's, inside the
/// model's own `tensor-comm` spans.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepCollectives {
    /// Steps looked at.
    pub steps: usize,
    /// The tensor group's over those steps, per operation (operation,
    /// count), in the order first seen.
    pub tensor: Vec<(String, u64)>,
    /// The pipeline's over those steps, per operation (operation, count),
    /// in the order first seen.
    pub pipeline: Vec<(String, u64)>,
    /// The strategy's collectives over those steps but the gradient
    /// norm's, per operation (operation, count), in the order first seen.
    pub strategy: Vec<(String, u64)>,
    /// The all-reduces of the gradient norm over those steps.
    pub norm: u64,
    /// The loop's all-reduces of the step's loss over those steps.
    pub loss: u64,
}

impl StepCollectives {
    /// All collectives per step.
    pub fn per_step(&self) -> f64 {
        (self.strategy_count()
            + self.tensor_count()
            + self.pipeline_count()
            + self.norm
            + self.loss) as f64
            / self.steps.max(1) as f64
    }

    /// The tensor group's operations over the steps.
    pub fn tensor_count(&self) -> u64 {
        self.tensor.iter().map(|(_, k)| k).sum()
    }

    /// The pipeline's operations over the steps.
    pub fn pipeline_count(&self) -> u64 {
        self.pipeline.iter().map(|(_, k)| k).sum()
    }

    /// The strategy's collectives over the steps.
    pub fn strategy_count(&self) -> u64 {
        self.strategy.iter().map(|(_, k)| k).sum()
    }
}

/// The collectives that start inside each of the step `windows` (start,
/// end) of a rank. The loop averages the loss after everything else in
/// the step, so the step's last all-reduce, where it starts after the
/// optimizer's span has begun, is the loss's; other all-reduces that start
/// inside the optimizer's span are the gradient norm's; the rest are the
/// strategy's (a step without an optimizer span counts all as the
/// strategy's). Which is the last is read on the rank's own clock: a GPU
/// rank's optimizer span, timed on the device, may end a few microseconds
/// off the host's. Those that start inside a `tensor-comm` span are the
/// tensor group's; with `pipelined`, the others that start inside the
/// forward passes are the pipeline's.
pub fn step_collectives(
    events: &[TraceEvent],
    windows: &[(f64, f64)],
    pipelined: bool,
) -> StepCollectives {
    let mut out = StepCollectives {
        steps: windows.len(),
        ..Default::default()
    };
    let passes = match pipelined {
        true => sets(events).forward,
        false => Intervals::default(),
    };
    let tensor = TensorSpans::of(events);
    let in_passes = |t: f64| passes.spans().iter().any(|(a, b)| t >= *a && t < *b);
    let count =
        |list: &mut Vec<(String, u64)>, op: &str| match list.iter_mut().find(|(o, _)| o == op) {
            Some((_, k)) => *k += 1,
            None => list.push((op.to_string(), 1)),
        };
    for &(a, b) in windows {
        let inside = |e: &&TraceEvent| e.ts >= a && e.ts < b;
        for e in events.iter().filter(inside).filter(|e| e.cat == "comm") {
            if tensor.holds(e) {
                count(&mut out.tensor, &e.name);
            } else if in_passes(e.ts) {
                count(&mut out.pipeline, &e.name);
            }
        }
        let optimizer = events
            .iter()
            .filter(inside)
            .filter(|e| e.cat == "optimizer")
            .map(|e| (e.ts, e.end()))
            .reduce(|x, y| (x.0.min(y.0), x.1.max(y.1)));
        let comm: Vec<&TraceEvent> = events
            .iter()
            .filter(inside)
            .filter(|e| e.cat == "comm" && !in_passes(e.ts) && !tensor.holds(e))
            .collect();
        let last = comm
            .iter()
            .enumerate()
            .filter(|(_, e)| e.name == "all_reduce")
            .max_by(|x, y| x.1.ts.total_cmp(&y.1.ts))
            .map(|(i, _)| i);
        for (i, e) in comm.into_iter().enumerate() {
            match optimizer {
                Some((start, _)) if Some(i) == last && e.ts >= start => {
                    out.loss += 1;
                    continue;
                }
                Some((start, end)) if e.name == "all_reduce" && e.ts >= start && e.ts < end => {
                    out.norm += 1;
                    continue;
                }
                _ => {}
            }
            count(&mut out.strategy, &e.name);
        }
    }
    out
}

/// The model's `tensor-comm` spans ("tensor all_gather (65536 B)"),
/// sorted by start: a collective of the same operation that starts inside
/// one is the tensor group's.
struct TensorSpans {
    /// (start, end, operation).
    spans: Vec<(f64, f64, String)>,
    /// The longest one's length.
    longest: f64,
}

impl TensorSpans {
    fn of(events: &[TraceEvent]) -> TensorSpans {
        let mut spans: Vec<(f64, f64, String)> = events
            .iter()
            .filter(|e| e.cat == "tensor-comm")
            .map(|e| {
                let name = e.name.strip_prefix("tensor ").unwrap_or(&e.name);
                let op = name.split(' ').next().unwrap_or("");
                (e.ts, e.end(), op.to_string())
            })
            .collect();
        spans.sort_by(|a, b| a.0.total_cmp(&b.0));
        let longest = spans.iter().map(|s| s.1 - s.0).fold(0.0, f64::max);
        TensorSpans { spans, longest }
    }

    /// Whether collective `e` is the tensor group's.
    fn holds(&self, e: &TraceEvent) -> bool {
        let i = self.spans.partition_point(|s| s.0 <= e.ts);
        self.spans[..i]
            .iter()
            .rev()
            .take_while(|s| s.0 >= e.ts - self.longest)
            .any(|s| e.ts < s.1 && s.2 == e.name)
    }
}

/// The traced steps of every rank, with their means.
pub struct RunAnalysis {
    /// Per rank, every step.
    pub steps: Vec<Vec<StepBreakdown>>,
    /// Per rank, the mean step.
    pub means: Vec<RankMeans>,
    /// Per rank, its collectives.
    pub ops: Vec<Vec<OpStats>>,
    /// Per rank, its collectives in the counted steps by what runs them.
    pub collectives: Vec<StepCollectives>,
    /// The straggler, if any (under a pipeline, among the ranks of one
    /// pipeline stage).
    pub straggler: Option<Straggler>,
    /// Whether the ranks ran on GPUs.
    pub gpu: bool,
    /// Under a pipeline, per rank its pipeline rank.
    pub pipe_ranks: Option<Vec<usize>>,
}

/// Analyses `traces`, not counting the first `warmup` steps.
pub fn analyse(traces: &[RankTrace], warmup: usize) -> RunAnalysis {
    analyse_layout(traces, warmup, None)
}

/// [`analyse`] knowing the run's layout: under a pipeline,
/// `pipe_rank_of[r]` is world rank `r`'s pipeline rank (a trace of a rank
/// it does not name is analysed as no pipeline's, and so is every other).
pub fn analyse_layout(
    traces: &[RankTrace],
    warmup: usize,
    pipe_rank_of: Option<&[usize]>,
) -> RunAnalysis {
    let pipe_ranks: Option<Vec<usize>> = pipe_rank_of.and_then(|of| {
        traces
            .iter()
            .map(|t| of.get(t.rank).copied())
            .collect::<Option<Vec<usize>>>()
    });
    let pipelined = pipe_ranks.is_some();
    let steps: Vec<Vec<StepBreakdown>> = traces
        .iter()
        .map(|t| breakdown_as(&t.events, pipelined))
        .collect();
    let means: Vec<RankMeans> = traces
        .iter()
        .zip(&steps)
        .map(|(t, s)| means(t.rank, s, warmup))
        .collect();
    let windows: Vec<Vec<(f64, f64)>> = steps
        .iter()
        .map(|s| {
            let warm = warmup.min(s.len().saturating_sub(1));
            s[warm..]
                .iter()
                .map(|b| (b.start, b.start + b.total))
                .collect()
        })
        .collect();
    let ops = traces
        .iter()
        .zip(&windows)
        .map(|(t, w)| op_stats(&t.events, t.world_size, w))
        .collect();
    let collectives = traces
        .iter()
        .zip(&windows)
        .map(|(t, w)| step_collectives(&t.events, w, pipelined))
        .collect();
    RunAnalysis {
        straggler: match &pipe_ranks {
            Some(p) => stage_straggler(&means, p),
            None => straggler(&means),
        },
        gpu: traces.iter().any(|t| on_gpu(&t.events)),
        pipe_ranks,
        steps,
        means,
        ops,
        collectives,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn ev(tid: u32, cat: &str, name: &str, ts: f64, dur: f64) -> TraceEvent {
        TraceEvent {
            pid: 0,
            tid,
            name: name.into(),
            cat: cat.into(),
            ts,
            dur,
            args: json!({"step": 0, "bytes": 1000})
                .as_object()
                .unwrap()
                .clone(),
        }
    }

    #[test]
    fn a_step_splits_into_compute_exposed_comm_data_and_idle() {
        let events = vec![
            ev(track::HOST, "step", "step 0", 0.0, 100.0),
            ev(track::HOST, "data", "data", 0.0, 10.0),
            ev(track::HOST, "compute", "forward", 10.0, 30.0),
            ev(track::HOST, "compute", "forward block 0", 12.0, 5.0),
            ev(track::HOST, "compute", "backward", 40.0, 30.0),
            ev(track::COLLECTIVES, "comm", "all_reduce", 60.0, 25.0),
            ev(track::HOST, "optimizer", "optimizer", 85.0, 10.0),
        ];
        let b = breakdown(&events);
        assert_eq!(b.len(), 1);
        let s = b[0];
        assert_eq!(
            (s.compute, s.comm, s.overlapped, s.exposed_comm),
            (70.0, 25.0, 10.0, 15.0)
        );
        assert_eq!((s.data, s.other, s.idle), (10.0, 0.0, 5.0));
        assert_eq!(
            s.compute + s.exposed_comm + s.data + s.other + s.idle,
            s.total
        );
        assert_eq!(idle_gaps(&events), vec![(95.0, 100.0)]);
        // On a GPU rank only the device's compute spans count as compute.
        let mut gpu = events.clone();
        gpu.push(ev(track::GPU_COMPUTE, "compute", "backward", 50.0, 20.0));
        let g = breakdown(&gpu)[0];
        assert_eq!(g.compute, 20.0);
    }

    /// A pipeline rank's step: its pipelined passes (the forward pass)
    /// compute, wait in a receive and idle; after them the data-parallel
    /// all-reduce and the optimizer.
    #[test]
    fn a_pipeline_s_waits_in_its_passes_are_the_bubble_not_exposed_comm() {
        let events = vec![
            ev(track::HOST, "step", "step 0", 0.0, 100.0),
            ev(track::HOST, "data", "data", 0.0, 5.0),
            ev(track::HOST, "pass", "forward", 5.0, 70.0),
            ev(
                track::HOST,
                "compute",
                "stage 0 forward micro-batch 0",
                5.0,
                10.0,
            ),
            ev(track::COLLECTIVES, "comm", "send", 15.0, 1.0),
            ev(track::COLLECTIVES, "comm", "recv", 16.0, 24.0),
            ev(
                track::HOST,
                "compute",
                "stage 0 backward micro-batch 0",
                40.0,
                20.0,
            ),
            // A tensor-parallel layer's collective, inside the computation.
            ev(
                track::HOST,
                "tensor-comm",
                "tensor all_reduce (8 B)",
                45.0,
                2.0,
            ),
            ev(track::COLLECTIVES, "comm", "all_reduce", 45.0, 2.0),
            ev(track::COLLECTIVES, "comm", "all_gather", 70.0, 5.0),
            ev(track::HOST, "pass", "backward", 75.0, 1.0),
            ev(track::COLLECTIVES, "comm", "all_reduce", 76.0, 9.0),
            ev(track::HOST, "optimizer", "optimizer", 85.0, 10.0),
            ev(track::COLLECTIVES, "comm", "all_reduce", 96.0, 2.0),
        ];
        let s = breakdown_as(&events, true)[0];
        assert_eq!((s.compute, s.stage_compute, s.passes), (38.0, 28.0, 70.0));
        // 70 ms of passes, 30 of them computing (2 in the tensor group's
        // collective).
        assert_eq!((s.bubble, s.tensor_comm), (40.0, 2.0));
        assert_eq!((s.comm, s.exposed_comm, s.overlapped), (11.0, 11.0, 0.0));
        assert_eq!((s.data, s.idle), (5.0, 4.0));
        let parts =
            s.compute + s.tensor_comm + s.bubble + s.exposed_comm + s.data + s.other + s.idle;
        assert_eq!(parts, s.total);
        // Without the layout the waits are exposed communication.
        let flat = breakdown(&events)[0];
        assert_eq!((flat.bubble, flat.exposed_comm), (0.0, 41.0));
        let c = step_collectives(&events, &[(0.0, 100.0)], true);
        assert_eq!(
            c.pipeline,
            vec![
                ("send".to_string(), 1),
                ("recv".to_string(), 1),
                ("all_gather".to_string(), 1)
            ]
        );
        assert_eq!(c.strategy, vec![("all_reduce".to_string(), 1)]);
        assert_eq!(c.tensor, vec![("all_reduce".to_string(), 1)]);
        assert_eq!((c.norm, c.loss, c.per_step()), (0, 1, 6.0));
    }

    #[test]
    fn under_a_pipeline_a_straggler_is_sought_among_one_stage_s_ranks() {
        // Stage 1 holds the head: its ranks compute 30 ms more.
        let stages = [0, 1, 0, 1];
        let even = [
            rank(0, 50e3, 1e3, 10e3),
            rank(1, 80e3, 1e3, 10e3),
            rank(2, 51e3, 1e3, 10e3),
            rank(3, 81e3, 1e3, 10e3),
        ];
        assert!(straggler(&even).is_some());
        assert_eq!(stage_straggler(&even, &stages), None);
        // One replica of stage 1 is slow against the other.
        let mut slow = even;
        slow[3] = rank(3, 100e3, 1e3, 10e3);
        let s = stage_straggler(&slow, &stages).unwrap();
        assert_eq!((s.rank, s.category), (3, "compute"));
        assert!(
            s.evidence.contains("pipeline rank 1's other ranks"),
            "{}",
            s.evidence
        );
        // One rank per stage: nothing to compare.
        assert_eq!(stage_straggler(&even[..2], &stages[..2]), None);
    }

    fn rank(rank: usize, compute: f64, data: f64, comm: f64) -> RankMeans {
        RankMeans {
            rank,
            steps: 5,
            mean: StepBreakdown {
                total: 100_000.0,
                compute,
                data,
                exposed_comm: 100_000.0 - compute - data,
                comm,
                ..Default::default()
            },
        }
    }

    #[test]
    fn the_rank_with_the_most_own_work_is_named_with_its_category() {
        let even = [
            rank(0, 50e3, 5e3, 10e3),
            rank(1, 50e3, 5e3, 10e3),
            rank(2, 58e3, 5e3, 10e3),
        ];
        assert_eq!(straggler(&even), None);
        let slow_compute = [
            rank(0, 50e3, 5e3, 10e3),
            rank(1, 80e3, 5e3, 10e3),
            rank(2, 50e3, 5e3, 10e3),
        ];
        let s = straggler(&slow_compute).unwrap();
        assert_eq!((s.rank, s.category), (1, "compute"));
        let slow_data = [
            rank(0, 50e3, 5e3, 10e3),
            rank(1, 50e3, 5e3, 10e3),
            rank(2, 50e3, 40e3, 10e3),
        ];
        let s = straggler(&slow_data).unwrap();
        assert_eq!((s.rank, s.category), (2, "data"));
        let slow_comm = [
            rank(0, 50e3, 5e3, 10e3),
            rank(1, 50e3, 5e3, 40e3),
            rank(2, 50e3, 5e3, 10e3),
        ];
        let s = straggler(&slow_comm).unwrap();
        assert_eq!((s.rank, s.category), (1, "communication"));
        // The fastest rank waits longest in the collectives: it is not
        // slow in communication (nor is anyone a straggler).
        let early = [
            rank(0, 70e3, 5e3, 10e3),
            rank(1, 73e3, 5e3, 10e3),
            rank(2, 50e3, 5e3, 34e3),
            rank(3, 72e3, 5e3, 10e3),
        ];
        assert_eq!(straggler(&early), None);
    }

    #[test]
    fn the_straggler_threshold_is_one_constant() {
        // Just under and just over STRAGGLER_SHARE of the 100 ms step.
        let under = STRAGGLER_SHARE * 100e3 - 100.0;
        let over = STRAGGLER_SHARE * 100e3 + 100.0;
        let with = |extra: f64| {
            [
                rank(0, 50e3, 5e3, 10e3),
                rank(1, 50e3 + extra, 5e3, 10e3),
                rank(2, 50e3, 5e3, 10e3),
            ]
        };
        assert_eq!(straggler(&with(under)), None);
        assert_eq!(straggler(&with(over)).map(|s| s.rank), Some(1));
    }

    #[test]
    fn the_loss_all_reduce_after_the_optimizer_is_told_from_the_strategy_s() {
        let mut events = Vec::new();
        for k in 0..3u32 {
            let t = k as f64 * 100.0;
            events.push(ev(track::HOST, "step", "step", t, 100.0));
            events.push(ev(track::HOST, "compute", "backward", t, 40.0));
            events.push(ev(track::COLLECTIVES, "comm", "all_reduce", t + 20.0, 30.0));
            events.push(ev(track::COLLECTIVES, "comm", "all_reduce", t + 40.0, 20.0));
            events.push(ev(track::HOST, "optimizer", "optimizer", t + 60.0, 20.0));
            events.push(ev(track::COLLECTIVES, "comm", "all_reduce", t + 85.0, 5.0));
        }
        // A sharded strategy's gradient norm, inside the optimizer span,
        // and its parameter gather after the update.
        events.push(ev(track::COLLECTIVES, "comm", "all_reduce", 262.0, 2.0));
        events.push(ev(track::COLLECTIVES, "comm", "all_gather", 270.0, 5.0));
        // Outside every step window: not counted.
        events.push(ev(track::COLLECTIVES, "comm", "all_reduce", 400.0, 5.0));
        // A third step whose device-timed optimizer span ends a little
        // after the host's loss all-reduce starts.
        events.push(ev(track::HOST, "step", "step", 300.0, 100.0));
        events.push(ev(track::COLLECTIVES, "comm", "all_reduce", 320.0, 30.0));
        events.push(ev(
            track::GPU_COMPUTE,
            "optimizer",
            "optimizer",
            360.0,
            22.0,
        ));
        events.push(ev(track::COLLECTIVES, "comm", "all_reduce", 381.0, 5.0));
        let c3 = step_collectives(&events, &[(300.0, 400.0)], false);
        assert_eq!((c3.strategy_count(), c3.norm, c3.loss), (1, 0, 1));
        let c = step_collectives(&events, &[(100.0, 200.0), (200.0, 300.0)], false);
        assert_eq!(
            c.strategy,
            vec![("all_reduce".to_string(), 4), ("all_gather".to_string(), 1)]
        );
        assert_eq!((c.norm, c.loss, c.steps, c.per_step()), (1, 2, 2, 4.0));
        // The same count as the per-operation table.
        let ops = op_stats(&events, 2, &[(100.0, 200.0), (200.0, 300.0)]);
        let all: u64 = ops.iter().map(|o| o.count).sum();
        assert_eq!(all, c.strategy_count() + c.norm + c.loss);
    }

    #[test]
    fn collective_bandwidths_follow_nccl_tests() {
        let events = vec![
            ev(track::COLLECTIVES, "all_reduce", "all_reduce", 0.0, 1.0),
            ev(track::COLLECTIVES, "comm", "all_reduce", 0.0, 1.0),
            ev(track::COLLECTIVES, "comm", "all_reduce", 5.0, 1.0),
        ];
        let s = op_stats(&events, 4, &[]);
        assert_eq!(op_stats(&events, 4, &[(4.0, 10.0)])[0].count, 1);
        assert_eq!(s.len(), 1);
        assert_eq!((s[0].count, s[0].bytes), (2, 2000));
        assert!((s[0].algbw - 1.0).abs() < 1e-9, "1000 B per µs = 1 GB/s");
        assert!((s[0].busbw - 1.5).abs() < 1e-9);
    }
}
