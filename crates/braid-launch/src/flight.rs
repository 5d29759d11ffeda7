//! After a failed attempt: what the workers' flight records say.
//!
//! Workers that use braid's communicators keep a flight record of their
//! last collectives, publish heartbeats to the store, and write their
//! record to the log directory ([`braid_core::env::BRAID_LOG_DIR`], set for
//! every worker: `--log-dir`, else [`log_dir`]'s default) when something
//! fails, one file per rank and attempt
//! ([`braid_core::flight::dump_file_name`]: `flight-rank00001-attempt2.json`),
//! so that a restart keeps the failed attempts' records. When an attempt
//! fails, before stopping the workers the launcher
//!
//! 1. notes how each local worker is doing ([`observe`]: exited, stopped by
//!    a signal such as SIGSTOP, or running),
//! 2. asks the running ones that catch SIGUSR1 to write their record
//!    ([`request_dumps`]; a stopped process cannot, a dead one no longer),
//!    and
//! 3. waits for those records ([`wait_for_dumps`]): each until it is
//!    complete, or its process ends or is stopped, or — if the record has
//!    not even begun (its temporary file) — [`DUMP_START_WAIT`] after the
//!    signal, and never longer than [`DUMP_WAIT_MAX`] in all; a record that
//!    did not come is said, with why;
//!
//! then, once they are stopped, it removes the temporary files of records
//! their processes could not finish, reads every record of the attempt and
//! every rank's last heartbeat, writes the last heartbeat of each local
//! rank that left no record in its place (under the attempt's name, so
//! `braid doctor` sees it too), and prints the diagnosis of
//! [`braid_core::flight::diagnose_world`] ([`report`]): which rank is
//! behind and where, ranks that called different operations, ranks never
//! heard from.

use crate::config::LaunchPlan;
use crate::process::{describe_status, Worker};
use crate::signals::Signals;
use braid_core::atomic_file;
use braid_core::flight::{self as format, ProcessState, Snapshot, SnapshotKind};
use braid_store::StoreClient;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use std::collections::{BTreeMap, HashMap};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

/// How long a worker sent SIGUSR1 has to begin its record (its temporary
/// file appears) before the launcher stops waiting for it: all that a
/// program that catches SIGUSR1 but keeps no flight record costs.
pub const DUMP_START_WAIT: Duration = Duration::from_secs(2);

/// The longest the launcher waits for the records it asked for with
/// SIGUSR1, however they progress: a record still being written then (a
/// hung file system) is given up, and said.
pub const DUMP_WAIT_MAX: Duration = Duration::from_secs(30);

/// How often the records asked for are looked at.
const DUMP_POLL: Duration = Duration::from_millis(20);

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

/// What `/proc/PID/stat` says of a process.
struct Stat {
    /// `R`, `S`, `D`, `T`, `Z`...
    state: String,
    pgrp: u32,
    /// In the kernel's exit path (`PF_EXITING`): a process killed while
    /// its GPU kernels run can stay there a long time, its threads gone.
    exiting: bool,
}

/// Fields of `/proc/PID/stat` after the command name: state, ppid, pgrp,
/// session, tty, tpgid, flags...
fn stat(pid: u32) -> Option<Stat> {
    const PF_EXITING: u64 = 0x4;
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let mut rest = stat[stat.rfind(')')? + 1..].split_whitespace();
    let state = rest.next()?.to_string();
    let pgrp = rest.nth(1)?.parse().ok()?;
    let flags: u64 = rest.nth(3)?.parse().ok()?;
    Some(Stat {
        state,
        pgrp,
        exiting: flags & PF_EXITING != 0,
    })
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

/// What a process of a worker's group is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Doing {
    Running,
    /// State T or t.
    Stopped,
    /// Exited (a zombie), or gone from its group (its pid reused).
    Gone,
}

/// Process `pid` of process group `pgrp`, now.
fn doing(pid: u32, pgrp: u32) -> Doing {
    match stat(pid) {
        Some(s) if s.pgrp == pgrp && !s.exiting => match s.state.as_str() {
            "Z" | "X" | "x" => Doing::Gone,
            "T" | "t" => Doing::Stopped,
            _ => Doing::Running,
        },
        _ => Doing::Gone,
    }
}

/// A file as it was: a record replaced by a new one (renamed over it) is
/// another file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileId {
    dev: u64,
    ino: u64,
    mtime_s: i64,
    mtime_ns: i64,
    len: u64,
}

fn file_id(path: &Path) -> Option<FileId> {
    let m = std::fs::metadata(path).ok()?;
    Some(FileId {
        dev: m.dev(),
        ino: m.ino(),
        mtime_s: m.mtime(),
        mtime_ns: m.mtime_nsec(),
        len: m.len(),
    })
}

/// The record asked of one local rank.
#[derive(Debug)]
struct Asked {
    rank: usize,
    /// Its worker's process group.
    pgrp: u32,
    /// The processes of its group that were sent SIGUSR1.
    pids: Vec<u32>,
    /// Where its record may appear: the attempt's name, and the name
    /// without an attempt (a worker of an older braid).
    paths: [PathBuf; 2],
    /// Those files as they were before the signal.
    before: [Option<FileId>; 2],
}

/// The records the launcher asked for ([`request_dumps`]), to wait for
/// ([`wait_for_dumps`]).
#[derive(Debug)]
pub struct Requested {
    /// When the signals went (monotonic and wall clock).
    at: Instant,
    at_wall: SystemTime,
    asked: Vec<Asked>,
}

/// A record asked for that did not come.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unfinished {
    /// World rank.
    pub rank: usize,
    /// Whether the rank had begun writing it (it keeps flight records).
    pub began: bool,
    /// Why it did not come.
    pub why: String,
}

/// Sends SIGUSR1 to every process of a running, not stopped, local
/// worker's process group that catches it (only those: to others it would
/// be fatal), asking for attempt `attempt`'s records in `dir`; returns
/// what was asked, for [`wait_for_dumps`].
pub fn request_dumps(
    workers: &[Worker],
    observed: &Observed,
    dir: &Path,
    attempt: u32,
) -> Requested {
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
    let mut to_ask: BTreeMap<usize, (u32, Vec<u32>)> = BTreeMap::new();
    if !running.is_empty() {
        let pids = std::fs::read_dir("/proc")
            .map(|d| {
                d.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
                    .collect::<Vec<_>>()
            })
            .unwrap_or_default();
        for pid in pids {
            let Some(pgrp) = stat(pid).map(|s| s.pgrp) else {
                continue;
            };
            let Some(&rank) = running.get(&pgrp) else {
                continue;
            };
            // Not a stopped process (it cannot answer) nor a dying one.
            if doing(pid, pgrp) == Doing::Running && catches_sigusr1(pid) {
                to_ask.entry(rank).or_insert((pgrp, Vec::new())).1.push(pid);
            }
        }
    }
    // The records as they are before the signals: a new one is what was
    // asked for (or one begun earlier, as recent).
    let mut asked: Vec<Asked> = to_ask
        .into_iter()
        .map(|(rank, (pgrp, pids))| {
            let paths = [
                format::dump_path(dir, rank, Some(attempt)),
                format::dump_path(dir, rank, None),
            ];
            let before = [file_id(&paths[0]), file_id(&paths[1])];
            Asked {
                rank,
                pgrp,
                pids,
                paths,
                before,
            }
        })
        .collect();
    let (at, at_wall) = (Instant::now(), SystemTime::now());
    for a in &mut asked {
        a.pids
            .retain(|&pid| kill(Pid::from_raw(pid as i32), Signal::SIGUSR1).is_ok());
    }
    asked.retain(|a| !a.pids.is_empty());
    Requested { at, at_wall, asked }
}

/// One asked rank's record, as last looked at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Look {
    /// A new complete record is there.
    fresh: bool,
    /// The size of its temporary file, if one is being written.
    writing: Option<u64>,
    /// What its processes are doing: running if any is, else stopped if
    /// any is, else gone.
    processes: Doing,
}

/// What the launcher knows of one rank's record so far.
#[derive(Debug, Clone, Copy)]
struct Watch {
    began: bool,
    len: u64,
    grew_at: Duration,
}

/// Whether to go on waiting for one rank's record.
#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    Wait,
    Done,
    GaveUp(String),
}

/// Looks at rank `a`'s record: its temporary files first, then the
/// record, so that a rename between the two looks shows as a fresh record,
/// never as a dump that vanished. A temporary file last written more than
/// [`DUMP_START_WAIT`] before the signal is another process's leftover,
/// not a record being written.
fn look(a: &Asked, asked_at: SystemTime) -> Look {
    let recent = asked_at.checked_sub(DUMP_START_WAIT).unwrap_or(asked_at);
    let writing = a
        .pids
        .iter()
        .flat_map(|&pid| a.paths.iter().map(move |p| atomic_file::temp_path(p, pid)))
        .filter_map(|tmp| std::fs::metadata(tmp).ok())
        .filter(|m| m.modified().is_ok_and(|t| t >= recent))
        .map(|m| m.len())
        .max();
    let fresh = a
        .paths
        .iter()
        .zip(&a.before)
        .any(|(p, before)| file_id(p).is_some_and(|now| Some(now) != *before));
    let states: Vec<Doing> = a.pids.iter().map(|&pid| doing(pid, a.pgrp)).collect();
    let processes = if states.contains(&Doing::Running) {
        Doing::Running
    } else if states.contains(&Doing::Stopped) {
        Doing::Stopped
    } else {
        Doing::Gone
    };
    Look {
        fresh,
        writing,
        processes,
    }
}

/// Updates `w` with `l` (seen `since` after the signal) and says whether
/// to go on waiting.
fn judge(l: Look, w: &mut Watch, since: Duration) -> Verdict {
    if l.fresh {
        return Verdict::Done;
    }
    if let Some(len) = l.writing {
        if !w.began || len != w.len {
            w.grew_at = since;
        }
        w.began = true;
        w.len = len;
    }
    let so_far = |w: &Watch| match w.len {
        0 => "nothing written yet".to_string(),
        n => format!("{n} bytes written so far"),
    };
    match l.processes {
        Doing::Gone if w.began => {
            return Verdict::GaveUp(format!(
                "its process ended before the record was complete ({})",
                so_far(w)
            ))
        }
        Doing::Gone => {
            return Verdict::GaveUp("its process ended before it began the record".into())
        }
        Doing::Stopped => {
            return Verdict::GaveUp(format!(
                "its process was stopped (state T: SIGSTOP or a debugger) {} the record",
                if w.began {
                    "before it finished"
                } else {
                    "before it began"
                }
            ))
        }
        Doing::Running => {}
    }
    if w.began && l.writing.is_none() {
        return Verdict::GaveUp(
            "its record was begun but not written (the rank's stderr says why)".into(),
        );
    }
    if !w.began && since >= DUMP_START_WAIT {
        return Verdict::GaveUp(format!(
            "it caught SIGUSR1 but began no record within {} s (a program that keeps none?)",
            DUMP_START_WAIT.as_secs()
        ));
    }
    if since >= DUMP_WAIT_MAX {
        let quiet = since.saturating_sub(w.grew_at);
        let how = if quiet < Duration::from_secs(1) {
            "still growing: a very slow file system?".to_string()
        } else {
            format!(
                "none in the last {:.1} s: stuck writing, e.g. on a hung file system",
                quiet.as_secs_f64()
            )
        };
        return Verdict::GaveUp(format!(
            "the record was still being written after {} s ({}; {how})",
            DUMP_WAIT_MAX.as_secs(),
            so_far(w),
        ));
    }
    Verdict::Wait
}

/// Waits for the records asked for: each until it is complete, or its
/// processes have ended or are stopped, or it has not begun
/// [`DUMP_START_WAIT`] after the signal, or [`DUMP_WAIT_MAX`] has passed
/// (all of them: at once on another signal to the launcher). Says on
/// stderr when it waits past [`DUMP_START_WAIT`], and returns the records
/// that did not come, with why.
pub fn wait_for_dumps(req: &Requested, signals: &Signals) -> Vec<Unfinished> {
    let mut waiting: Vec<(&Asked, Watch)> = req
        .asked
        .iter()
        .map(|a| {
            let w = Watch {
                began: false,
                len: 0,
                grew_at: Duration::ZERO,
            };
            (a, w)
        })
        .collect();
    let mut unfinished = Vec::new();
    let signals_before = signals.count();
    let mut said = false;
    while !waiting.is_empty() {
        let since = req.at.elapsed();
        waiting.retain_mut(|(a, w)| match judge(look(a, req.at_wall), w, since) {
            Verdict::Wait => true,
            Verdict::Done => false,
            Verdict::GaveUp(why) => {
                unfinished.push(Unfinished {
                    rank: a.rank,
                    began: w.began,
                    why,
                });
                false
            }
        });
        if waiting.is_empty() {
            break;
        }
        if signals.count() != signals_before {
            for (a, w) in waiting.drain(..) {
                unfinished.push(Unfinished {
                    rank: a.rank,
                    began: w.began,
                    why: "the launcher was signalled again before the record was complete".into(),
                });
            }
            break;
        }
        if !said && since >= DUMP_START_WAIT {
            said = true;
            let ranks: Vec<usize> = waiting.iter().map(|(a, _)| a.rank).collect();
            eprintln!(
                "braid launch: waiting for the flight record of {} (being written; at most {} s after asking)",
                ranks_word(&ranks),
                DUMP_WAIT_MAX.as_secs()
            );
        }
        std::thread::sleep(DUMP_POLL);
    }
    unfinished.sort_by_key(|u| u.rank);
    unfinished
}

/// `rank 1`, `ranks 0, 2-5`.
fn ranks_word(ranks: &[usize]) -> String {
    match ranks {
        [one] => format!("rank {one}"),
        _ => format!("ranks {}", format::rank_list(ranks)),
    }
}

/// Once the workers are stopped: removes the temporary files of attempt
/// `attempt`'s records that their processes (each worker's, and those
/// asked for a record) did not finish, as they never will be.
pub fn remove_cut_dumps(workers: &[Worker], req: &Requested, dir: &Path, attempt: u32) {
    for w in workers {
        let mut pids = vec![w.pid()];
        if let Some(a) = req.asked.iter().find(|a| a.rank == w.rank) {
            pids.extend(&a.pids);
        }
        for pid in pids {
            if doing(pid, w.pid()) != Doing::Gone {
                continue;
            }
            for name in [Some(attempt), None] {
                let path = format::dump_path(dir, w.rank, name);
                let _ = std::fs::remove_file(atomic_file::temp_path(&path, pid));
            }
        }
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
    /// The records asked for that did not come ([`wait_for_dumps`]).
    pub unfinished: &'a [Unfinished],
}

/// Reads the attempt's records and heartbeats and returns the diagnosis to
/// print, or `None` when no worker kept a flight record (workers that do
/// not use braid's communicators). Local ranks that left no record of
/// their own get their last heartbeat written in its place, under the
/// attempt's name.
pub fn report(a: &Attempt) -> Option<String> {
    let beats = heartbeats(a.store, a.world_size);
    let mut dumps: HashMap<usize, Snapshot> = HashMap::new();
    // This attempt's files, and those named without an attempt (written by
    // older braids); which attempt a record is of, its contents say.
    let ours = |_, attempt: Option<u32>| attempt.is_none() || attempt == Some(a.attempt);
    if let Ok(loaded) = format::load_dir_where(a.dir, ours) {
        for (_, s) in loaded.snapshots {
            if s.kind == SnapshotKind::Dump
                && s.run_id == a.run_id
                && s.attempt == Some(a.attempt)
                && s.rank < a.world_size
                && dumps.get(&s.rank).is_none_or(|d| d.wall_us < s.wall_us)
            {
                dumps.insert(s.rank, s);
            }
        }
    }
    // A rank that began a record keeps flight records, even with none here.
    let began_one = a.unfinished.iter().any(|u| u.began);
    if beats.is_empty() && dumps.is_empty() && !began_one {
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
    for u in a.unfinished {
        s.push_str(&format!(
            "  rank {}: the flight record asked for (SIGUSR1) did not come: {}\n",
            u.rank, u.why
        ));
    }
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
            ranks_word(&written)
        ));
    }
    Some(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn watch() -> Watch {
        Watch {
            began: false,
            len: 0,
            grew_at: Duration::ZERO,
        }
    }

    fn at(s: f64) -> Duration {
        Duration::from_secs_f64(s)
    }

    const RUNNING: Look = Look {
        fresh: false,
        writing: None,
        processes: Doing::Running,
    };

    fn writing(len: u64) -> Look {
        Look {
            writing: Some(len),
            ..RUNNING
        }
    }

    fn gave_up(v: Verdict) -> String {
        match v {
            Verdict::GaveUp(why) => why,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_record_being_written_is_waited_for_up_to_the_bound() {
        let mut w = watch();
        assert_eq!(judge(RUNNING, &mut w, at(0.1)), Verdict::Wait);
        assert_eq!(judge(writing(0), &mut w, at(0.5)), Verdict::Wait);
        assert_eq!(judge(writing(4096), &mut w, at(1.0)), Verdict::Wait);
        // Begun: no longer bound by DUMP_START_WAIT.
        assert_eq!(judge(writing(4096), &mut w, at(10.0)), Verdict::Wait);
        let done = Look {
            fresh: true,
            ..RUNNING
        };
        assert_eq!(judge(done, &mut w.clone(), at(12.0)), Verdict::Done);
        let why = gave_up(judge(writing(4096), &mut w, DUMP_WAIT_MAX));
        assert!(
            why.starts_with("the record was still being written after 30 s (4096 bytes written so far; none in the last 29.0 s: stuck"),
            "{why}"
        );
    }

    #[test]
    fn a_record_not_begun_a_stopped_or_dead_writer_and_a_failed_write_end_the_wait() {
        let mut w = watch();
        assert_eq!(judge(RUNNING, &mut w, at(1.9)), Verdict::Wait);
        let why = gave_up(judge(RUNNING, &mut w, DUMP_START_WAIT));
        assert!(why.contains("began no record within 2 s"), "{why}");

        let mut w = watch();
        assert_eq!(judge(writing(10), &mut w, at(0.2)), Verdict::Wait);
        let gone = Look {
            processes: Doing::Gone,
            ..writing(10)
        };
        let why = gave_up(judge(gone, &mut w.clone(), at(0.4)));
        assert_eq!(
            why,
            "its process ended before the record was complete (10 bytes written so far)"
        );
        let stopped = Look {
            processes: Doing::Stopped,
            ..writing(10)
        };
        let why = gave_up(judge(stopped, &mut w.clone(), at(0.4)));
        assert!(why.contains("stopped (state T") && why.contains("before it finished"));
        // Its temporary file gone with no record: the write failed.
        let why = gave_up(judge(RUNNING, &mut w, at(0.6)));
        assert!(why.contains("begun but not written"), "{why}");
        // A fresh record wins over how its process is doing.
        let done_and_gone = Look {
            fresh: true,
            processes: Doing::Gone,
            writing: None,
        };
        assert_eq!(judge(done_and_gone, &mut watch(), at(0.1)), Verdict::Done);
    }

    #[test]
    fn look_sees_a_record_begun_then_made_whole_and_not_a_leftover() {
        let dir = std::env::temp_dir().join(format!("braid-launch-look-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let me = std::process::id();
        let paths = [
            format::dump_path(&dir, 3, Some(1)),
            format::dump_path(&dir, 3, None),
        ];
        // An older record of the rank is there before asking.
        std::fs::write(&paths[0], "old").unwrap();
        let asked = Asked {
            rank: 3,
            pgrp: nix::unistd::getpgrp().as_raw() as u32,
            pids: vec![me],
            before: [file_id(&paths[0]), file_id(&paths[1])],
            paths,
        };
        let now = SystemTime::now();
        assert_eq!(look(&asked, now), RUNNING);
        // A leftover temporary file of another time is not a record being
        // written.
        let tmp = atomic_file::temp_path(&asked.paths[0], me);
        std::fs::write(&tmp, "cut").unwrap();
        let old = now - Duration::from_secs(3600);
        std::fs::File::options()
            .write(true)
            .open(&tmp)
            .unwrap()
            .set_modified(old)
            .unwrap();
        assert_eq!(look(&asked, now), RUNNING);
        std::fs::remove_file(&tmp).unwrap();
        let mut pending = atomic_file::Pending::create(&asked.paths[0]).unwrap();
        pending.write_all(b"{ half").unwrap();
        assert_eq!(look(&asked, now), writing(6));
        pending.write_all(b" whole }").unwrap();
        pending.commit().unwrap();
        let seen = look(&asked, now);
        assert!(seen.fresh && seen.writing.is_none(), "{seen:?}");
        // Another group's process (or a pid reused) counts as gone.
        let elsewhere = Asked {
            pgrp: asked.pgrp + 1,
            ..asked
        };
        assert_eq!(look(&elsewhere, now).processes, Doing::Gone);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
