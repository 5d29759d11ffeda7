//! Per-operation collective statistics of this process: how many of each
//! operation ran, the bytes they carried and the time they took — what
//! live metrics export. Off unless switched on; fed by the collectives'
//! spans ([`crate::recorder::record`]).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

/// One operation's totals.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct OpTotals {
    /// Operations run.
    pub count: u64,
    /// Bytes of their buffers (each rank's input).
    pub bytes: u64,
    /// Seconds they ran.
    pub seconds: f64,
}

static ON: AtomicBool = AtomicBool::new(false);
static TOTALS: Mutex<BTreeMap<String, OpTotals>> = Mutex::new(BTreeMap::new());

/// Whether statistics are kept.
#[inline]
pub fn enabled() -> bool {
    ON.load(Ordering::Relaxed)
}

/// Starts keeping statistics.
pub fn enable() {
    ON.store(true, Ordering::Relaxed);
}

/// Counts one run of operation `op` over `bytes` bytes that took
/// `seconds`.
pub fn add(op: &str, bytes: u64, seconds: f64) {
    let mut t = TOTALS.lock().unwrap_or_else(|p| p.into_inner());
    let e = match t.get_mut(op) {
        Some(e) => e,
        None => t.entry(op.to_string()).or_default(),
    };
    e.count += 1;
    e.bytes += bytes;
    e.seconds += seconds;
}

/// The totals so far, by operation name.
pub fn snapshot() -> BTreeMap<String, OpTotals> {
    TOTALS.lock().unwrap_or_else(|p| p.into_inner()).clone()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::recorder::{record, track, Cat, Span};

    #[test]
    fn collective_spans_are_counted_once_enabled() {
        let s = |name: &str, bytes: u64| Span {
            name: name.into(),
            cat: Cat::Comm,
            tid: track::COLLECTIVES,
            ts_us: 0.0,
            dur_us: 1500.0,
            args: vec![("bytes", bytes.into())],
        };
        record(s("stats_test_op", 10));
        assert!(!snapshot().contains_key("stats_test_op"));
        enable();
        record(s("stats_test_op", 10));
        record(s("stats_test_op", 32));
        let t = snapshot()["stats_test_op"];
        assert_eq!((t.count, t.bytes), (2, 42));
        assert!((t.seconds - 0.003).abs() < 1e-12);
    }
}
