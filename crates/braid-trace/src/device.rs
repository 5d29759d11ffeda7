//! Spans on GPU streams, timed with CUDA events.
//!
//! The host runs ahead of the GPU, so a GPU span is two timed events on
//! its stream ([`begin`] and [`end`]), resolved later ([`flush`]) into a
//! span on the host's trace clock. The conversion goes through an
//! *anchor*: an event recorded at a known host time on a stream of the
//! recorder's own, which nothing else uses and so is always idle (the
//! event completes as the device sees it; no user stream is waited for);
//! a span's start is the anchor's host time plus the device time between
//! the anchor and its start event. Anchors are per device, so spans on
//! every stream of a device (compute and collectives) share one clock;
//! the training loop re-anchors at every step start, which keeps the
//! device's clock drift against the host's out of the figures. Nothing is
//! done while nothing records (one atomic load). Waiting for spans to end
//! ([`flush`]) is bounded: a span whose stream never gets there (a hung
//! collective) is dropped, never waited for forever.

use crate::recorder::{self, Cat, Span};
use braid_cuda::{Event, Result, Stream};
use serde_json::Value;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

struct Anchor {
    event: Event,
    host_us: f64,
}

/// A span's start on a stream ([`begin`]); give it to [`end`].
pub struct Mark {
    event: Event,
    anchor: Arc<Anchor>,
}

struct Pending {
    start: Mark,
    end: Event,
    span: Span,
}

#[derive(Default)]
struct State {
    anchors: HashMap<usize, Arc<Anchor>>,
    /// The recorder's idle stream on each device, for anchors.
    anchor_streams: HashMap<usize, Stream>,
    /// Timed events to reuse, by device ordinal.
    pool: HashMap<usize, Vec<Event>>,
    pending: Vec<Pending>,
}

static STATE: Mutex<Option<State>> = Mutex::new(None);

fn state() -> MutexGuard<'static, Option<State>> {
    STATE.lock().unwrap_or_else(|p| p.into_inner())
}

fn take_event(st: &mut State, stream: &Stream) -> Result<Event> {
    let ordinal = stream.device().ordinal();
    match st.pool.get_mut(&ordinal).and_then(|p| p.pop()) {
        Some(e) => Ok(e),
        None => Event::timed(stream.device()),
    }
}

fn put_anchor(st: &mut State, stream: &Stream) -> Result<Arc<Anchor>> {
    let ordinal = stream.device().ordinal();
    let event = take_event(st, stream)?;
    let own = match st.anchor_streams.entry(ordinal) {
        std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
        std::collections::hash_map::Entry::Vacant(v) => v.insert(Stream::new(stream.device())?),
    };
    let before = recorder::now_us();
    event.record(own)?;
    let after = recorder::now_us();
    let a = Arc::new(Anchor {
        event,
        host_us: 0.5 * (before + after),
    });
    st.anchors.insert(stream.device().ordinal(), a.clone());
    Ok(a)
}

/// Re-anchors the device clock of `stream`'s device (never waits).
pub fn anchor(stream: &Stream) -> Result<()> {
    if !recorder::active() {
        return Ok(());
    }
    let mut g = state();
    let st = g.get_or_insert_with(State::default);
    put_anchor(st, stream)?;
    Ok(())
}

/// Starts a span at the current end of `stream` (`None` while nothing
/// records).
pub fn begin(stream: &Stream) -> Result<Option<Mark>> {
    if !recorder::active() {
        return Ok(None);
    }
    let mut g = state();
    let st = g.get_or_insert_with(State::default);
    let anchor = match st.anchors.get(&stream.device().ordinal()) {
        Some(a) => a.clone(),
        None => put_anchor(st, stream)?,
    };
    let event = take_event(st, stream)?;
    event.record(stream)?;
    Ok(Some(Mark { event, anchor }))
}

/// Ends the span begun at `mark` at the current end of `stream`; it is
/// recorded at the next [`flush`] after the stream passes it.
pub fn end(
    mark: Option<Mark>,
    stream: &Stream,
    name: impl Into<String>,
    cat: Cat,
    tid: u32,
    args: Vec<(&'static str, Value)>,
) -> Result<()> {
    let Some(start) = mark else {
        return Ok(());
    };
    let mut g = state();
    let st = g.get_or_insert_with(State::default);
    let end = take_event(st, stream)?;
    end.record(stream)?;
    st.pending.push(Pending {
        start,
        end,
        span: Span {
            name: name.into(),
            cat,
            tid,
            ts_us: 0.0,
            dur_us: 0.0,
            args,
        },
    });
    Ok(())
}

/// Records the GPU spans whose end has passed, polling for up to `wait`
/// for the others (`Duration::ZERO`: one look); returns how many are
/// still pending (they stay for a later flush, or [`drop_pending`]).
pub fn flush(wait: Duration) -> Result<usize> {
    let deadline = Instant::now() + wait;
    loop {
        let left = resolve_finished()?;
        if left == 0 || Instant::now() >= deadline {
            return Ok(left);
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// Forgets the pending spans (whose streams never got to their end);
/// returns how many.
pub fn drop_pending() -> usize {
    state()
        .as_mut()
        .map_or(0, |st| std::mem::take(&mut st.pending).len())
}

/// Records the pending spans whose end event has completed; returns how
/// many are left.
fn resolve_finished() -> Result<usize> {
    let mut g = state();
    let Some(st) = g.as_mut() else {
        return Ok(0);
    };
    let mut keep = Vec::new();
    for p in std::mem::take(&mut st.pending) {
        if !p.end.query()? {
            keep.push(p);
            continue;
        }
        let Pending {
            start,
            end,
            mut span,
        } = p;
        let from_anchor = start.event.elapsed_ms(&start.anchor.event)? as f64 * 1e3;
        span.ts_us = start.anchor.host_us + from_anchor;
        span.dur_us = (end.elapsed_ms(&start.event)? as f64 * 1e3).max(0.0);
        if span.cat == Cat::Comm {
            add_bandwidths(&mut span);
        }
        let ordinal = end.device().ordinal();
        let pool = st.pool.entry(ordinal).or_default();
        pool.push(start.event);
        pool.push(end);
        recorder::record(span);
    }
    let left = keep.len();
    st.pending = keep;
    Ok(left)
}

/// Adds a collective's algorithm and bus bandwidths (GB/s, nccl-tests'
/// convention) from its `bytes` and `ranks` arguments and its length.
fn add_bandwidths(span: &mut Span) {
    let get = |k: &str| {
        span.args
            .iter()
            .find(|(n, _)| *n == k)
            .and_then(|(_, v)| v.as_f64())
    };
    if let (Some(bytes), Some(ranks)) = (get("bytes"), get("ranks")) {
        let algbw = bytes / (span.dur_us * 1e-6).max(1e-9) / 1e9;
        let busbw = algbw * crate::analysis::busbw_factor(&span.name, ranks as usize);
        span.args.push(("algbw_GBps", algbw.into()));
        span.args.push(("busbw_GBps", busbw.into()));
    }
}

/// Forgets the anchors, pending spans and pooled events (the devices are
/// going away).
pub fn reset() {
    *state() = None;
}
