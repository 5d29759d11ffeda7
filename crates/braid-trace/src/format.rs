//! Trace files: the Chrome trace-event JSON format that PyTorch's profiler
//! writes and Perfetto and `chrome://tracing` read.
//!
//! Each rank writes `trace-rankNNNNN.json` in the trace directory:
//!
//! ```text
//! {"schemaVersion": 1, "displayTimeUnit": "ms",
//!  "traceEvents": [
//!    {"ph": "M", "name": "process_name", "pid": 3, "args": {"name": "rank 3"}},
//!    {"ph": "M", "name": "thread_name", "pid": 3, "tid": 10, "args": {"name": "GPU: compute stream"}},
//!    {"ph": "X", "name": "backward block 5", "cat": "compute", "pid": 3, "tid": 10,
//!     "ts": 1763900000123456.7, "dur": 812.4, "args": {...}}, ...],
//!  "braid": {"rank": 3, "world_size": 4, "clock": {"offset_us": .., "rtt_us": ..},
//!            "dropped_spans": 0, "run": {...}}}
//! ```
//!
//! `pid` is the rank; `ts` is microseconds since the UNIX epoch on the
//! reference clock (the store server's), so the ranks' files line up; the
//! merged file (`trace.json`, [`merge`]) holds every rank's events, one
//! process track per rank. Files are written atomically (temporary file,
//! rename). Reading checks every field it uses and names the file and the
//! event that is wrong.

use crate::clock::ClockOffset;
use crate::recorder::{self, track, Span};
use serde_json::{json, Map, Value};
use std::path::{Path, PathBuf};

/// One complete span read from a trace file.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceEvent {
    /// Rank.
    pub pid: u32,
    /// Track.
    pub tid: u32,
    /// What ran.
    pub name: String,
    /// Category (see [`recorder::Cat`]).
    pub cat: String,
    /// Start, microseconds on the reference clock.
    pub ts: f64,
    /// Length, microseconds.
    pub dur: f64,
    /// Details.
    pub args: Map<String, Value>,
}

impl TraceEvent {
    /// End, microseconds.
    pub fn end(&self) -> f64 {
        self.ts + self.dur
    }

    /// A numeric argument.
    pub fn num(&self, key: &str) -> Option<f64> {
        self.args.get(key).and_then(Value::as_f64)
    }
}

/// One rank's trace.
#[derive(Debug, Clone, PartialEq)]
pub struct RankTrace {
    /// The rank.
    pub rank: usize,
    /// Ranks in the run.
    pub world_size: usize,
    /// Its clock's offset from the reference when it was written.
    pub clock: ClockOffset,
    /// Spans not kept (past `BRAID_TRACE_MAX_EVENTS`).
    pub dropped: u64,
    /// What the run was (written by the caller).
    pub run: Value,
    /// Its spans, by start time.
    pub events: Vec<TraceEvent>,
}

/// The file name of `rank`'s trace.
pub fn rank_file_name(rank: usize) -> String {
    format!("trace-rank{rank:05}.json")
}

/// The merged trace's file name.
pub const MERGED: &str = "trace.json";

impl RankTrace {
    /// `rank`'s trace from recorded `spans` (on this process's trace
    /// clock), moved onto the reference clock by `clock`.
    pub fn from_spans(
        rank: usize,
        world_size: usize,
        clock: ClockOffset,
        spans: Vec<Span>,
        dropped: u64,
        run: Value,
    ) -> RankTrace {
        let base = recorder::epoch_wall_us() + clock.offset_us;
        let mut events: Vec<TraceEvent> = spans
            .into_iter()
            .map(|s| TraceEvent {
                pid: rank as u32,
                tid: s.tid,
                name: s.name,
                cat: s.cat.as_str().to_string(),
                ts: base + s.ts_us,
                dur: s.dur_us,
                args: s
                    .args
                    .into_iter()
                    .map(|(k, v)| (k.to_string(), v))
                    .collect(),
            })
            .collect();
        sort(&mut events);
        RankTrace {
            rank,
            world_size,
            clock,
            dropped,
            run,
            events,
        }
    }

    /// The trace as trace-event JSON (metadata events first).
    pub fn to_json(&self) -> Value {
        let mut out = metadata(self.rank as u32, self.events.iter().map(|e| e.tid));
        out.extend(self.events.iter().map(event_json));
        json!({
            "schemaVersion": 1,
            "displayTimeUnit": "ms",
            "traceEvents": out,
            "braid": self.meta_json(),
        })
    }

    fn meta_json(&self) -> Value {
        json!({
            "rank": self.rank,
            "world_size": self.world_size,
            "clock": {"offset_us": self.clock.offset_us, "rtt_us": self.clock.rtt_us},
            "dropped_spans": self.dropped,
            "run": self.run,
        })
    }

    /// Writes the trace into `dir` (made if missing), atomically.
    pub fn write(&self, dir: &Path) -> Result<PathBuf, String> {
        write_json(&dir.join(rank_file_name(self.rank)), &self.to_json())
    }
}

pub(crate) fn sort(events: &mut [TraceEvent]) {
    events.sort_by(|a, b| {
        (a.pid, a.ts)
            .partial_cmp(&(b.pid, b.ts))
            .unwrap_or(std::cmp::Ordering::Equal)
    });
}

fn metadata(pid: u32, tids: impl Iterator<Item = u32>) -> Vec<Value> {
    let mut tids: Vec<u32> = tids.collect();
    tids.sort_unstable();
    tids.dedup();
    let mut out = vec![
        json!({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": format!("rank {pid}")}}),
        json!({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}}),
    ];
    for t in tids {
        out.push(json!({"ph": "M", "name": "thread_name", "pid": pid, "tid": t, "args": {"name": track::name(t)}}));
        out.push(json!({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": t, "args": {"sort_index": t}}));
    }
    out
}

fn event_json(e: &TraceEvent) -> Value {
    json!({
        "ph": "X",
        "name": e.name,
        "cat": e.cat,
        "pid": e.pid,
        "tid": e.tid,
        "ts": (e.ts * 1e3).round() / 1e3,
        "dur": (e.dur * 1e3).round() / 1e3,
        "args": e.args,
    })
}

/// Writes `value` to `path` atomically ([`braid_core::atomic_file`]).
pub fn write_json(path: &Path, value: &Value) -> Result<PathBuf, String> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)
        .map_err(|e| format!("cannot create the trace directory {}: {e}", dir.display()))?;
    let text = serde_json::to_vec(value).map_err(|e| e.to_string())?;
    braid_core::atomic_file::write(path, &text)
        .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    Ok(path.to_path_buf())
}

/// Reads one rank's trace file.
pub fn read_rank(path: &Path) -> Result<RankTrace, String> {
    let bad = |what: String| format!("{}: {what}", path.display());
    let text = std::fs::read(path).map_err(|e| bad(format!("cannot read: {e}")))?;
    let v: Value = serde_json::from_slice(&text)
        .map_err(|e| bad(format!("not a trace-event JSON file ({e})")))?;
    let meta = v
        .get("braid")
        .ok_or_else(|| bad("no \"braid\" section (not written by braid --trace?)".into()))?;
    let num = |key: &str| -> Result<u64, String> {
        meta.get(key)
            .and_then(Value::as_u64)
            .ok_or_else(|| bad(format!("braid.{key} missing or not a number")))
    };
    let rank = num("rank")? as usize;
    let world_size = num("world_size")? as usize;
    let clock = ClockOffset {
        offset_us: meta["clock"]["offset_us"].as_f64().unwrap_or(0.0),
        rtt_us: meta["clock"]["rtt_us"].as_f64().unwrap_or(0.0),
    };
    let events = parse_events(&v, path)?;
    if let Some(e) = events.iter().find(|e| e.pid as usize != rank) {
        return Err(bad(format!(
            "event {:?} belongs to pid {} but the file is rank {rank}'s",
            e.name, e.pid
        )));
    }
    Ok(RankTrace {
        rank,
        world_size,
        clock,
        dropped: meta
            .get("dropped_spans")
            .and_then(Value::as_u64)
            .unwrap_or(0),
        run: meta.get("run").cloned().unwrap_or(Value::Null),
        events,
    })
}

/// The complete (`X`) events of a trace-event JSON value, by rank and
/// start.
pub fn parse_events(v: &Value, path: &Path) -> Result<Vec<TraceEvent>, String> {
    let list = v
        .get("traceEvents")
        .and_then(Value::as_array)
        .ok_or_else(|| format!("{}: no traceEvents array", path.display()))?;
    let mut events = Vec::new();
    for (i, e) in list.iter().enumerate() {
        if e.get("ph").and_then(Value::as_str) != Some("X") {
            continue;
        }
        let bad = |what: &str| format!("{}: traceEvents[{i}]: {what}", path.display());
        let f = |k: &str| e.get(k).and_then(Value::as_f64);
        let (Some(ts), Some(dur)) = (f("ts"), f("dur")) else {
            return Err(bad("ts or dur missing"));
        };
        if !ts.is_finite() || !dur.is_finite() || dur < 0.0 {
            return Err(bad("ts or dur not a finite time"));
        }
        events.push(TraceEvent {
            pid: e
                .get("pid")
                .and_then(Value::as_u64)
                .ok_or_else(|| bad("no pid"))? as u32,
            tid: e
                .get("tid")
                .and_then(Value::as_u64)
                .ok_or_else(|| bad("no tid"))? as u32,
            name: e
                .get("name")
                .and_then(Value::as_str)
                .ok_or_else(|| bad("no name"))?
                .to_string(),
            cat: e
                .get("cat")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string(),
            ts,
            dur,
            args: e
                .get("args")
                .and_then(Value::as_object)
                .cloned()
                .unwrap_or_default(),
        });
    }
    sort(&mut events);
    Ok(events)
}

/// Every rank's trace in `dir`, by rank, with the ranks of the run whose
/// file is missing.
pub fn read_dir(dir: &Path) -> Result<(Vec<RankTrace>, Vec<usize>), String> {
    let entries = std::fs::read_dir(dir)
        .map_err(|e| format!("cannot read the trace directory {}: {e}", dir.display()))?;
    let mut paths: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("trace-rank") && n.ends_with(".json"))
        })
        .collect();
    paths.sort();
    if paths.is_empty() {
        return Err(format!(
            "{} holds no trace-rank*.json files (run with --trace {})",
            dir.display(),
            dir.display()
        ));
    }
    let mut traces = Vec::new();
    for p in &paths {
        traces.push(read_rank(p)?);
    }
    traces.sort_by_key(|t| t.rank);
    let world = traces[0].world_size;
    if let Some(t) = traces.iter().find(|t| t.world_size != world) {
        return Err(format!(
            "{}: rank {} was written by a run of {} ranks, rank {} by one of {world} (traces of different runs in one directory)",
            dir.display(),
            t.rank,
            t.world_size,
            traces[0].rank
        ));
    }
    let missing = (0..world)
        .filter(|r| !traces.iter().any(|t| t.rank == *r))
        .collect();
    Ok((traces, missing))
}

/// Writes the merged trace of `traces` (one process track per rank) to
/// `dir/trace.json`.
pub fn merge(dir: &Path, traces: &[RankTrace]) -> Result<PathBuf, String> {
    let mut out = Vec::new();
    for t in traces {
        out.extend(metadata(t.rank as u32, t.events.iter().map(|e| e.tid)));
    }
    for t in traces {
        out.extend(t.events.iter().map(event_json));
    }
    let ranks: Vec<Value> = traces.iter().map(RankTrace::meta_json).collect();
    write_json(
        &dir.join(MERGED),
        &json!({
            "schemaVersion": 1,
            "displayTimeUnit": "ms",
            "traceEvents": out,
            "braid": {"merged": true, "world_size": traces.first().map_or(0, |t| t.world_size), "ranks": ranks},
        }),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::recorder::Cat;

    fn span(name: &str, cat: Cat, tid: u32, ts: f64, dur: f64) -> Span {
        Span {
            name: name.into(),
            cat,
            tid,
            ts_us: ts,
            dur_us: dur,
            args: vec![("bytes", 64.into())],
        }
    }

    #[test]
    fn rank_files_round_trip_and_merge_into_one_track_per_rank() {
        let dir = std::env::temp_dir().join(format!("braid-trace-fmt-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for rank in 0..2 {
            let t = RankTrace::from_spans(
                rank,
                2,
                ClockOffset {
                    offset_us: 100.0 * rank as f64,
                    rtt_us: 20.0,
                },
                vec![
                    span("step 0", Cat::Step, track::HOST, 10.0, 500.0),
                    span("all_reduce", Cat::Comm, track::COLLECTIVES, 50.0, 100.0),
                ],
                0,
                json!({"rank": rank}),
            );
            t.write(&dir).unwrap();
        }
        let (traces, missing) = read_dir(&dir).unwrap();
        assert!(missing.is_empty());
        assert_eq!(traces.len(), 2);
        assert_eq!(traces[1].events.len(), 2);
        let d = traces[1].events[0].ts - traces[0].events[0].ts;
        // (Times near 1.7e15 µs are rounded to the f64 grid: 0.25 µs.)
        assert!((d - 100.0).abs() < 1.0, "offsets applied: {d}");
        assert_eq!(traces[1].events[1].num("bytes"), Some(64.0));
        let merged = merge(&dir, &traces).unwrap();
        let v: Value = serde_json::from_slice(&std::fs::read(&merged).unwrap()).unwrap();
        let events = parse_events(&v, &merged).unwrap();
        assert_eq!(events.len(), 4);
        let names: Vec<&str> = v["traceEvents"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["name"] == "process_name")
            .map(|e| e["args"]["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["rank 0", "rank 1"]);
        // A missing rank is reported; a corrupt file is named.
        std::fs::remove_file(dir.join(rank_file_name(1))).unwrap();
        assert_eq!(read_dir(&dir).unwrap().1, vec![1]);
        std::fs::write(dir.join(rank_file_name(1)), b"{\"traceEvents\": [").unwrap();
        let err = read_dir(&dir).unwrap_err();
        assert!(
            err.contains("trace-rank00001.json") && err.contains("not a trace-event JSON"),
            "{err}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
