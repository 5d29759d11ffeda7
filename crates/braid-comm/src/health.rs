//! Liveness: the shared abort flag every wait checks, and the monitor that
//! raises it when a local peer process dies or another rank has aborted.
//!
//! Waits spin on data flags; checking one relaxed atomic per spin is what
//! lets a dead peer turn into an error within seconds instead of a hang.
//! The monitor thread watches the process ids of same-host peers and the
//! communicator's `abort` key in the store; the first rank to notice a
//! failure writes the reason there so that every rank reports the same
//! root cause. The world communicator's monitor also publishes the rank's
//! flight-record heartbeat ([`crate::flight`]), and the first abort writes
//! the rank's flight record.

use crate::flight::Recorder;
use braid_store::StoreClient;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// A communicator's abort state, shared by its backend and its monitor.
#[derive(Default)]
pub struct Health {
    aborted: AtomicBool,
    reason: Mutex<Option<String>>,
    stop: AtomicBool,
    /// Written when the communicator is first aborted.
    flight: OnceLock<Arc<Recorder>>,
}

impl Health {
    /// Whether the communicator has been aborted.
    #[inline]
    pub fn is_aborted(&self) -> bool {
        self.aborted.load(Ordering::Relaxed)
    }

    /// Why it was aborted (the first reason given).
    pub fn reason(&self) -> String {
        self.reason
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .unwrap_or_else(|| "aborted".into())
    }

    /// Marks the communicator aborted; the first reason wins. The first
    /// abort also writes the rank's flight record.
    pub fn abort(&self, reason: String) {
        let mut r = self.reason.lock().unwrap_or_else(|p| p.into_inner());
        if r.is_none() {
            *r = Some(reason);
        }
        let reason = r.clone().unwrap_or_default();
        drop(r);
        if !self.aborted.swap(true, Ordering::SeqCst) {
            if let Some(flight) = self.flight.get() {
                flight.dump("abort", &reason);
            }
        }
    }

    /// The recorder whose dump the first abort writes.
    pub(crate) fn set_flight(&self, recorder: Arc<Recorder>) {
        let _ = self.flight.set(recorder);
    }

    /// Asks the monitor thread to exit.
    pub fn stop_monitor(&self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// Key (under the communicator's store prefix) holding the abort reason.
pub const ABORT_KEY: &str = "abort";

/// Key a rank sets when it drops its communicator: its process exiting
/// afterwards is a clean departure, not a failure.
pub fn left_key(rank: usize) -> String {
    format!("left/{rank}")
}

/// Publishes `reason` as the communicator's abort reason unless another
/// rank did first, and returns the reason that stands.
pub fn publish_abort(store: &StoreClient, reason: &str) -> String {
    match store.compare_set(ABORT_KEY, None, reason.as_bytes()) {
        Ok(o) => o
            .current
            .map(|c| String::from_utf8_lossy(&c).into_owned())
            .unwrap_or_else(|| reason.to_string()),
        Err(_) => reason.to_string(),
    }
}

/// A peer process on this host to watch.
#[derive(Debug, Clone)]
pub struct LocalPeer {
    /// Its rank in the communicator.
    pub rank: usize,
    /// Its process id.
    pub pid: u32,
    /// Whether it has left cleanly (set by the monitor).
    pub left: bool,
}

/// Starts the monitor thread for a communicator.
pub fn spawn_monitor(
    health: Arc<Health>,
    store: StoreClient,
    peers: Vec<LocalPeer>,
    my_rank: usize,
    host: String,
) {
    spawn_monitor_with(health, store, peers, my_rank, host, None);
}

/// Something the monitor does every so often besides watching: publish the
/// rank's heartbeat.
pub type Periodic = (Duration, Box<dyn FnMut() + Send>);

/// [`spawn_monitor`], also calling `periodic`'s function at once and then
/// at its interval (it keeps going after an abort: the rank is still
/// alive).
pub fn spawn_monitor_with(
    health: Arc<Health>,
    store: StoreClient,
    mut peers: Vec<LocalPeer>,
    my_rank: usize,
    host: String,
    mut periodic: Option<Periodic>,
) {
    let spawned = std::thread::Builder::new()
        .name(format!("braid-health-{my_rank}"))
        .spawn(move || {
            let me = std::process::id();
            let mut last_beat: Option<Instant> = None;
            while !health.stop.load(Ordering::SeqCst) {
                if let Some((every, beat)) = periodic.as_mut() {
                    if last_beat.is_none_or(|t| t.elapsed() >= *every) {
                        last_beat = Some(Instant::now());
                        beat();
                    }
                }
                std::thread::sleep(Duration::from_millis(200));
                if health.stop.load(Ordering::SeqCst) {
                    break;
                }
                if health.is_aborted() {
                    continue;
                }
                for p in peers.iter_mut() {
                    if p.pid == me || p.left || process_alive(p.pid) {
                        continue;
                    }
                    // A rank that finished (dropped its communicator)
                    // and then exited has not failed.
                    if let Ok(Some(_)) = store.try_get(&left_key(p.rank)) {
                        p.left = true;
                        continue;
                    }
                    let reason = format!("rank {} (pid {} on {host}) died", p.rank, p.pid);
                    let reason = publish_abort(&store, &reason);
                    health.abort(reason);
                    break;
                }
                if let Ok(Some(reason)) = store.try_get(ABORT_KEY) {
                    health.abort(String::from_utf8_lossy(&reason).into_owned());
                }
            }
        });
    if spawned.is_err() {
        // Without a monitor, waits still end at their timeout.
    }
}

/// Whether `pid` is a live process: not a zombie, and not exiting. A
/// process killed while its GPU kernels run can stay in the kernel's exit
/// path for a long time (the driver tears its context down), so the
/// `PF_EXITING` flag counts as dead too.
pub fn process_alive(pid: u32) -> bool {
    const PF_EXITING: u64 = 0x4;
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            // Fields after the command name: state ppid pgrp session tty
            // tpgid flags ...
            let rest: Vec<&str> = stat
                .rsplit(')')
                .next()
                .unwrap_or("")
                .split_whitespace()
                .collect();
            let state = rest.first().copied().unwrap_or("");
            let flags: u64 = rest.get(6).and_then(|f| f.parse().ok()).unwrap_or(0);
            state != "Z" && state != "X" && flags & PF_EXITING == 0
        }
        Err(_) => false,
    }
}
