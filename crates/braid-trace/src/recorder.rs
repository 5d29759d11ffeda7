//! The span recorder: one per process, off unless a run asks for a trace.
//!
//! Spans are complete intervals (`ph: "X"` in the trace-event format) on
//! named tracks, timed on the host's monotonic clock from the process's
//! trace epoch. Off, [`span`] and [`record`] cost one relaxed atomic load
//! and do nothing else; on, a span is one short critical section when it
//! ends. The number of spans kept is bounded (`BRAID_TRACE_MAX_EVENTS`,
//! default 2,000,000); past it, spans are counted as dropped, not kept.
//!
//! Collective spans also feed the per-operation statistics
//! ([`crate::stats`]), which live metrics switch on without a trace.

use serde_json::Value;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// Tracks (the trace format's `tid`) a rank's spans are drawn on.
pub mod track {
    /// The training loop on the host: steps, data, forward, backward,
    /// waits, optimizer, and the CPU engine's blocks.
    pub const HOST: u32 = 1;
    /// Host collectives as their backend runs them (the progress thread).
    pub const COLLECTIVES: u32 = 2;
    /// Checkpoint writes in the background.
    pub const CHECKPOINT: u32 = 3;
    /// The engine's GPU stream, timed with CUDA events.
    pub const GPU_COMPUTE: u32 = 10;
    /// The GPU collectives' stream, timed with CUDA events.
    pub const GPU_COMM: u32 = 11;
    /// Idle gaps found in each step (nothing computed or communicated).
    pub const IDLE: u32 = 20;

    /// The track's name in the trace. Collectives of a communicator
    /// other than the world's are on their track plus 100 × the
    /// communicator's number.
    pub fn name(tid: u32) -> String {
        let base = match tid % 100 {
            HOST => "host: training loop",
            COLLECTIVES => "host: collectives",
            CHECKPOINT => "host: checkpoint writer",
            GPU_COMPUTE => "GPU: compute stream",
            GPU_COMM => "GPU: collectives stream",
            IDLE => "idle",
            _ => "other",
        };
        match tid / 100 {
            0 => base.to_string(),
            k => format!("{base} (communicator {k})"),
        }
    }
}

/// What a span is (the trace format's `cat`): the analysis sorts time by
/// it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Cat {
    /// One training step, end to end.
    Step,
    /// Waiting for a batch.
    Data,
    /// Forward or backward computation of one block (or unit), or a
    /// kernel: what counts as computing.
    Compute,
    /// A whole forward or backward pass: it holds the blocks' spans and
    /// whatever the pass waits for between them.
    Pass,
    /// Gradient norm, clipping and the update.
    Optimizer,
    /// A collective operation while it runs.
    Comm,
    /// A tensor-parallel collective inside a forward or backward pass
    /// (the model waits for it: it is part of the pass's time).
    TensorComm,
    /// The loop waiting for collectives to finish.
    Wait,
    /// Copying state out for a checkpoint, or writing it.
    Checkpoint,
    /// Held-out evaluation.
    Eval,
    /// Nothing computed or communicated.
    Idle,
}

impl Cat {
    /// The name written in the trace.
    pub fn as_str(self) -> &'static str {
        match self {
            Cat::Step => "step",
            Cat::Data => "data",
            Cat::Compute => "compute",
            Cat::Pass => "pass",
            Cat::Optimizer => "optimizer",
            Cat::Comm => "comm",
            Cat::TensorComm => "tensor-comm",
            Cat::Wait => "wait",
            Cat::Checkpoint => "checkpoint",
            Cat::Eval => "eval",
            Cat::Idle => "idle",
        }
    }

    /// The category named `s` in a trace.
    pub fn parse(s: &str) -> Option<Cat> {
        Some(match s {
            "step" => Cat::Step,
            "data" => Cat::Data,
            "compute" => Cat::Compute,
            "pass" => Cat::Pass,
            "optimizer" => Cat::Optimizer,
            "comm" => Cat::Comm,
            "wait" => Cat::Wait,
            "checkpoint" => Cat::Checkpoint,
            "eval" => Cat::Eval,
            "idle" => Cat::Idle,
            _ => return None,
        })
    }
}

/// One complete interval.
#[derive(Debug, Clone, PartialEq)]
pub struct Span {
    /// What ran (e.g. `forward block 3`, `all_reduce`).
    pub name: String,
    /// Its category.
    pub cat: Cat,
    /// Its track.
    pub tid: u32,
    /// Start, microseconds from the process's trace epoch.
    pub ts_us: f64,
    /// Length, microseconds.
    pub dur_us: f64,
    /// Details shown with it.
    pub args: Vec<(&'static str, Value)>,
}

static ON: AtomicBool = AtomicBool::new(false);
static DROPPED: AtomicU64 = AtomicU64::new(0);
static SPANS: Mutex<Vec<Span>> = Mutex::new(Vec::new());

struct Epoch {
    at: Instant,
    /// Microseconds since the UNIX epoch at `at` (host wall clock).
    wall_us: f64,
}

fn epoch() -> &'static Epoch {
    static EPOCH: OnceLock<Epoch> = OnceLock::new();
    EPOCH.get_or_init(|| Epoch {
        at: Instant::now(),
        wall_us: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs_f64() * 1e6)
            .unwrap_or(0.0),
    })
}

fn max_spans() -> usize {
    static MAX: OnceLock<usize> = OnceLock::new();
    *MAX.get_or_init(|| {
        std::env::var(braid_core::env::BRAID_TRACE_MAX_EVENTS)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(2_000_000)
    })
}

/// Whether spans are being recorded.
#[inline]
pub fn enabled() -> bool {
    ON.load(Ordering::Relaxed)
}

/// Whether anything wants spans made: a trace, or the statistics.
#[inline]
pub fn active() -> bool {
    enabled() || crate::stats::enabled()
}

/// Starts recording (forgetting earlier spans).
pub fn start() {
    epoch();
    lock().clear();
    DROPPED.store(0, Ordering::Relaxed);
    ON.store(true, Ordering::Relaxed);
}

/// Stops recording and hands over what was recorded, in the order spans
/// ended, with the number dropped past the bound.
pub fn finish() -> (Vec<Span>, u64) {
    ON.store(false, Ordering::Relaxed);
    let spans = std::mem::take(&mut *lock());
    (spans, DROPPED.swap(0, Ordering::Relaxed))
}

fn lock() -> std::sync::MutexGuard<'static, Vec<Span>> {
    SPANS.lock().unwrap_or_else(|p| p.into_inner())
}

/// Microseconds from the trace epoch to `t`.
pub fn us_of(t: Instant) -> f64 {
    let e = epoch();
    if t >= e.at {
        t.duration_since(e.at).as_secs_f64() * 1e6
    } else {
        -(e.at.duration_since(t).as_secs_f64() * 1e6)
    }
}

/// Microseconds from the trace epoch to now.
pub fn now_us() -> f64 {
    us_of(Instant::now())
}

/// Microseconds since the UNIX epoch (this host's wall clock) at the
/// trace epoch.
pub fn epoch_wall_us() -> f64 {
    epoch().wall_us
}

/// Keeps `span` (if recording) and counts it in the statistics (if a
/// collective and they are on).
pub fn record(span: Span) {
    if span.cat == Cat::Comm && crate::stats::enabled() {
        let bytes = span
            .args
            .iter()
            .find(|(k, _)| *k == "bytes")
            .and_then(|(_, v)| v.as_u64())
            .unwrap_or(0);
        crate::stats::add(&span.name, bytes, span.dur_us / 1e6);
    }
    if !enabled() {
        return;
    }
    let mut spans = lock();
    if spans.len() >= max_spans() {
        DROPPED.fetch_add(1, Ordering::Relaxed);
        return;
    }
    spans.push(span);
}

/// A span on the host clock that ends when dropped (or at
/// [`HostSpan::end`]); inert when nothing records.
#[must_use = "a span ends when dropped: bind it to a name"]
pub struct HostSpan {
    live: Option<(Span, Instant)>,
}

/// Starts a host span `name` of category `cat` on track `tid`.
#[inline]
pub fn span(name: impl Into<String>, cat: Cat, tid: u32) -> HostSpan {
    if !active() {
        return HostSpan { live: None };
    }
    let now = Instant::now();
    HostSpan {
        live: Some((
            Span {
                name: name.into(),
                cat,
                tid,
                ts_us: us_of(now),
                dur_us: 0.0,
                args: Vec::new(),
            },
            now,
        )),
    }
}

impl HostSpan {
    /// Adds a detail (ignored when inert).
    pub fn arg(&mut self, key: &'static str, value: impl Into<Value>) {
        if let Some((s, _)) = &mut self.live {
            s.args.push((key, value.into()));
        }
    }

    /// Whether the span will be recorded.
    pub fn is_live(&self) -> bool {
        self.live.is_some()
    }

    /// Ends the span now.
    pub fn end(self) {}
}

impl Drop for HostSpan {
    fn drop(&mut self) {
        if let Some((mut s, at)) = self.live.take() {
            s.dur_us = at.elapsed().as_secs_f64() * 1e6;
            record(s);
        }
    }
}

/// Records a host span that ran from `start` to `end`.
pub fn record_between(
    name: impl Into<String>,
    cat: Cat,
    tid: u32,
    start: Instant,
    end: Instant,
    args: Vec<(&'static str, Value)>,
) {
    if !active() {
        return;
    }
    record(Span {
        name: name.into(),
        cat,
        tid,
        ts_us: us_of(start),
        dur_us: end.saturating_duration_since(start).as_secs_f64() * 1e6,
        args,
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One test touches the process-wide recorder (tests run in threads).
    #[test]
    fn spans_are_kept_only_while_recording_and_end_when_dropped() {
        {
            let _s = span("before", Cat::Compute, track::HOST);
        }
        start();
        {
            let mut s = span("forward", Cat::Compute, track::HOST);
            s.arg("block", 3);
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        let t0 = Instant::now();
        record_between("data", Cat::Data, track::HOST, t0, t0, vec![]);
        // (Other tests in this process may record meanwhile.)
        let (mut spans, dropped) = finish();
        spans.retain(|s| ["before", "forward", "data", "after"].contains(&s.name.as_str()));
        assert_eq!(dropped, 0);
        assert_eq!(spans.len(), 2, "{spans:?}");
        assert_eq!(spans[0].name, "forward");
        assert!(spans[0].dur_us >= 2000.0, "{}", spans[0].dur_us);
        assert_eq!(spans[0].args, vec![("block", Value::from(3))]);
        assert!(spans[1].ts_us >= spans[0].ts_us + spans[0].dur_us);
        {
            let _s = span("after", Cat::Compute, track::HOST);
        }
        assert!(!finish().0.iter().any(|s| s.name == "after"));
        for c in [Cat::Step, Cat::Comm, Cat::Idle, Cat::Wait] {
            assert_eq!(Cat::parse(c.as_str()), Some(c));
        }
    }
}
