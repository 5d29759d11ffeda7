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
    /// Collectives while nothing computes.
    pub exposed_comm: f64,
    /// Host data loading outside computation and collectives.
    pub data: f64,
    /// Checkpoint copies and evaluation outside the above.
    pub other: f64,
    /// Nothing running.
    pub idle: f64,
    /// All collective time.
    pub comm: f64,
    /// Collective time during computation.
    pub overlapped: f64,
}

/// The categories of a rank's spans, as interval sets.
struct Sets {
    compute: Intervals,
    tensor: Intervals,
    comm: Intervals,
    data: Intervals,
    other: Intervals,
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
    let s = sets(events);
    steps(events)
        .into_iter()
        .map(|(step, a, b)| {
            let c = s.compute.clip(a, b);
            let m = s.comm.clip(a, b);
            let cm = c.or(&m);
            let cmd = cm.or(&s.data.clip(a, b));
            let busy = cmd.or(&s.other.clip(a, b));
            let overlapped = m.overlap_len(&c);
            // The tensor group's collectives run inside the passes' spans.
            let tensor = s.tensor.clip(a, b).overlap_len(&c);
            StepBreakdown {
                step,
                start: a,
                total: b - a,
                compute: (c.len() - tensor).max(0.0),
                tensor_comm: tensor,
                // (Differences of sums: clamped against rounding.)
                exposed_comm: (m.len() - overlapped).max(0.0),
                data: (cmd.len() - cm.len()).max(0.0),
                other: (busy.len() - cmd.len()).max(0.0),
                idle: ((b - a) - busy.len()).max(0.0),
                comm: m.len(),
                overlapped,
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
                "rank {} works {} per step ({category} {} more than the other ranks' median); the other ranks wait {} per step in collectives or idle, rank {} {}",
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
                "no rank's own work stands out, but rank {}'s collectives run {} per step against the other ranks' median {}{}",
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
/// progress line), which runs once the optimizer is done.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepCollectives {
    /// Steps looked at.
    pub steps: usize,
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
        (self.strategy_count() + self.norm + self.loss) as f64 / self.steps.max(1) as f64
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
/// off the host's.
pub fn step_collectives(events: &[TraceEvent], windows: &[(f64, f64)]) -> StepCollectives {
    let mut out = StepCollectives {
        steps: windows.len(),
        ..Default::default()
    };
    for &(a, b) in windows {
        let inside = |e: &&TraceEvent| e.ts >= a && e.ts < b;
        let optimizer = events
            .iter()
            .filter(inside)
            .filter(|e| e.cat == "optimizer")
            .map(|e| (e.ts, e.end()))
            .reduce(|x, y| (x.0.min(y.0), x.1.max(y.1)));
        let comm: Vec<&TraceEvent> = events
            .iter()
            .filter(inside)
            .filter(|e| e.cat == "comm")
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
            match out.strategy.iter_mut().find(|(op, _)| *op == e.name) {
                Some((_, k)) => *k += 1,
                None => out.strategy.push((e.name.clone(), 1)),
            }
        }
    }
    out
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
    /// The straggler, if any.
    pub straggler: Option<Straggler>,
    /// Whether the ranks ran on GPUs.
    pub gpu: bool,
}

/// Analyses `traces`, not counting the first `warmup` steps.
pub fn analyse(traces: &[RankTrace], warmup: usize) -> RunAnalysis {
    let steps: Vec<Vec<StepBreakdown>> = traces.iter().map(|t| breakdown(&t.events)).collect();
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
        .map(|(t, w)| step_collectives(&t.events, w))
        .collect();
    RunAnalysis {
        straggler: straggler(&means),
        gpu: traces.iter().any(|t| on_gpu(&t.events)),
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
        let c3 = step_collectives(&events, &[(300.0, 400.0)]);
        assert_eq!((c3.strategy_count(), c3.norm, c3.loss), (1, 0, 1));
        let c = step_collectives(&events, &[(100.0, 200.0), (200.0, 300.0)]);
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
