//! After a failed attempt: what the workers' flight records say.
//!
//! Workers that use braid's communicators keep a flight record of their
//! last collectives, publish heartbeats to the store, and write their
//! record to the log directory ([`braid_core::env::BRAID_LOG_DIR`], set for
//! every worker: `--log-dir`, else [`log_dir`]'s default) when something
//! fails. When an attempt fails, before stopping the workers the launcher
//!
//! 1. notes how each local worker is doing ([`observe`]: exited, stopped by
//!    a signal such as SIGSTOP, or running), and
//! 2. asks the running ones that catch SIGUSR1 to write their record
//!    ([`request_dumps`]; a stopped process cannot, a dead one no longer);
//!
//! then, once they are stopped, it reads every record of the attempt and
//! every rank's last heartbeat, writes the last heartbeat of each local
//! rank that left no record in its place (under the attempt's name,
//! `flight-rank00001-attempt2.json`, so `braid doctor` sees it too),
//! and prints the diagnosis of [`braid_core::flight::diagnose_world`]
//! ([`report`]): which rank is behind and where, ranks that called
//! different operations, ranks never heard from.

use crate::config::LaunchPlan;
use crate::process::{describe_status, Worker};
use crate::signals::Signals;
use braid_core::flight::{self as format, ProcessState, Snapshot, SnapshotKind};
use braid_store::StoreClient;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

/// The longest the launcher waits for records asked for with SIGUSR1.
pub const DUMP_WAIT: Duration = Duration::from_secs(2);

/// The directory every worker gets as `BRAID_LOG_DIR`: `--log-dir`, else
/// `BRAID_LOG_DIR` from the launcher's own environment, else
/// [`format::default_log_dir`] of the run.
pub fn log_dir(plan: &LaunchPlan, run_id: &str) -> PathBuf {
    plan.log_dir
        .clone()
        .or_else(format::log_dir_from_env)
        .unwrap_or_else(|| format::default_log_dir(run_id))
}

/// How the local workers were doing when the attempt failed.
#[derive(Debug, Clone)]
pub struct Observed {
    /// When they were looked at (wall clock, µs).
    pub at_us: u64,
    /// World rank → (pid, process state).
    pub workers: HashMap<usize, (u32, ProcessState)>,
}

/// Looks at every local worker: exited (and how), stopped, or running.
pub fn observe(workers: &mut [Worker]) -> Observed {
    let at_us = format::now_us();
    let workers = workers
        .iter_mut()
        .map(|w| {
            let state = match w.poll() {
                Some(status) => ProcessState::Gone(describe_status(status)),
                None => format::local_process_state(w.pid()),
            };
            (w.rank, (w.pid(), state))
        })
        .collect();
    Observed { at_us, workers }
}

/// Fields of `/proc/PID/stat` after the command name: (state, pgrp).
fn state_and_group(pid: u32) -> Option<(String, u32)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let mut rest = stat[stat.rfind(')')? + 1..].split_whitespace();
    let state = rest.next()?.to_string();
    let pgrp = rest.nth(1)?.parse().ok()?;
    Some((state, pgrp))
}

/// Whether process `pid` has a handler for SIGUSR1 (`SigCgt`).
fn catches_sigusr1(pid: u32) -> bool {
    let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
        return false;
    };
    status
        .lines()
        .find_map(|l| l.strip_prefix("SigCgt:"))
        .and_then(|mask| u64::from_str_radix(mask.trim(), 16).ok())
        .is_some_and(|mask| mask & (1 << (libc::SIGUSR1 - 1)) != 0)
}

/// Sends SIGUSR1 to every process of a running, not stopped, local
/// worker's process group that catches it (only those: to others it would
/// be fatal), then waits up to `limit` (less on another signal to the
/// launcher) for those workers' records of attempt `attempt` to appear in
/// `dir`.
pub fn request_dumps(
    workers: &[Worker],
    observed: &Observed,
    dir: &Path,
    attempt: u32,
    limit: Duration,
    signals: &Signals,
) {
    let running: HashMap<u32, usize> = workers
        .iter()
        .filter(|w| {
            matches!(
                observed.workers.get(&w.rank),
                Some((_, ProcessState::Running))
            )
        })
        .map(|w| (w.pid(), w.rank))
        .collect();
    if running.is_empty() {
        return;
    }
    let asked_at = SystemTime::now();
    let mut expected = HashSet::new();
    let pids = std::fs::read_dir("/proc")
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    for pid in pids {
        let Some((state, pgrp)) = state_and_group(pid) else {
            continue;
        };
        let Some(&rank) = running.get(&pgrp) else {
            continue;
        };
        if state != "T" && state != "t" && state != "Z" && catches_sigusr1(pid) {
            let _ = kill(Pid::from_raw(pid as i32), Signal::SIGUSR1);
            expected.insert(rank);
        }
    }
    let deadline = Instant::now() + limit;
    let signals_before = signals.count();
    while !expected.is_empty() && Instant::now() < deadline && signals.count() == signals_before {
        expected.retain(|&rank| {
            let fresh = std::fs::metadata(format::dump_path(dir, rank, Some(attempt)))
                .and_then(|m| m.modified())
                .is_ok_and(|t| t >= asked_at);
            !fresh
        });
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Every rank's last heartbeat in `store` (the attempt's worker prefix),
/// by world rank.
fn heartbeats(store: &StoreClient, world_size: usize) -> HashMap<usize, Snapshot> {
    let keys: Vec<String> = (0..world_size).map(format::heartbeat_key).collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let Ok(present) = store.check(&refs) else {
        return HashMap::new();
    };
    present
        .iter()
        .enumerate()
        .filter(|(_, p)| **p)
        .filter_map(|(r, _)| {
            let raw = store.try_get(&keys[r]).ok()??;
            Some((r, Snapshot::from_json(&raw).ok()?))
        })
        .collect()
}

/// What the launcher knows about an attempt's ranks.
pub struct Attempt<'a> {
    /// The log directory.
    pub dir: &'a Path,
    /// Run id.
    pub run_id: &'a str,
    /// Attempt number.
    pub attempt: u32,
    /// World size.
    pub world_size: usize,
    /// The local workers, as seen when the attempt failed.
    pub observed: &'a Observed,
    /// The store seen through the attempt's worker prefix (heartbeats).
    pub store: &'a StoreClient,
}

/// Reads the attempt's records and heartbeats and returns the diagnosis to
/// print, or `None` when no worker kept a flight record (workers that do
/// not use braid's communicators). Local ranks that left no record of
/// their own get their last heartbeat written in its place.
pub fn report(a: &Attempt) -> Option<String> {
    let beats = heartbeats(a.store, a.world_size);
    let mut dumps: HashMap<usize, Snapshot> = HashMap::new();
    if let Ok(loaded) = format::load_dir(a.dir) {
        for (_, s) in loaded.snapshots {
            if s.kind == SnapshotKind::Dump
                && s.run_id == a.run_id
                && s.attempt == Some(a.attempt)
                && s.rank < a.world_size
            {
                dumps.insert(s.rank, s);
            }
        }
    }
    if beats.is_empty() && dumps.is_empty() {
        return None;
    }
    let mut liveness = Vec::with_capacity(a.world_size);
    for rank in 0..a.world_size {
        let beat = beats.get(&rank);
        let age = beat.map(|b| Duration::from_micros(a.observed.at_us.saturating_sub(b.wall_us)));
        let interval = beat
            .or(dumps.get(&rank))
            .map(|s| s.heartbeat_ms)
            .unwrap_or(1000);
        let process = a
            .observed
            .workers
            .get(&rank)
            .map(|(_, s)| s.clone())
            .unwrap_or(ProcessState::Unknown);
        liveness.push(format::liveness(age, interval, process));
    }
    // A local rank with a heartbeat but no record of its own: its last
    // heartbeat (where it stopped, or died) stands in for it.
    let mut written = Vec::new();
    for (&rank, beat) in &beats {
        if dumps.contains_key(&rank) || !a.observed.workers.contains_key(&rank) {
            continue;
        }
        let mut stand_in = beat.clone();
        stand_in.observed = Some(liveness[rank].clone());
        stand_in.reason = Some(format!(
            "written by the launcher from rank {rank}'s last heartbeat: it left no flight record of its own ({})",
            liveness[rank].note()
        ));
        if stand_in.write_atomic(a.dir).is_ok() {
            written.push(rank);
        }
    }
    let ranks: Vec<format::WorldRank> = (0..a.world_size)
        .map(|r| format::WorldRank {
            snapshot: dumps.get(&r).or(beats.get(&r)),
            liveness: liveness[r].clone(),
        })
        .collect();
    let diagnoses = format::diagnose_world(&ranks);
    let mut s = format!(
        "braid launch: flight records of attempt {} ({} record(s), {} heartbeat(s); in {}; `braid doctor {}` shows them again):\n",
        a.attempt + 1,
        dumps.len(),
        beats.len(),
        a.dir.display(),
        a.dir.display()
    );
    let mut shown = 0;
    for d in diagnoses.iter().filter(|d| d.worth_showing()) {
        s.push_str(&d.render("  ", 16));
        shown += 1;
    }
    if shown == 0 {
        s.push_str("  no communicator of this attempt shows a problem\n");
    }
    if !written.is_empty() {
        written.sort_unstable();
        s.push_str(&format!(
            "  (the launcher wrote the last heartbeat of {} as its record)\n",
            format::rank_list(&written)
        ));
    }
    Some(s)
}
