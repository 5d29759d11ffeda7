//! Flight records: what each rank remembers of its last collectives, and
//! the diagnosis that turns several ranks' records into "who is behind,
//! and where".
//!
//! braid-comm keeps the records (a ring buffer per rank), publishes a small
//! heartbeat [`Snapshot`] to the rendezvous store every second or so, and
//! writes a full one (a *dump*) to the log directory on a collective
//! timeout, an abort or SIGUSR1. The launcher reads the dumps and the
//! heartbeats after a failed attempt; `braid doctor` reads the dumps in a
//! directory. All three call [`diagnose`] (one communicator) through
//! [`diagnose_world`] or directly, so a worker's timeout error, the
//! launcher's report and `braid doctor` say the same thing.
//!
//! The names shared by both sides live here too: the dump file of a rank
//! and attempt ([`dump_path`], read back by [`parse_dump_file_name`]), the
//! heartbeat key ([`heartbeat_key`]), the default log
//! directory ([`default_log_dir`]) and how stale a heartbeat may get
//! ([`stale_after`]).

use crate::env;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Version of the snapshot format.
pub const FORMAT_VERSION: u32 = 1;
/// Records a rank keeps unless [`env::BRAID_FLIGHT_RECORDS`] says otherwise.
pub const DEFAULT_RECORDS: usize = 2048;
/// The most records a rank may be asked to keep.
pub const MAX_RECORDS: usize = 1 << 22;

/// How many records to keep: [`env::BRAID_FLIGHT_RECORDS`], else
/// [`DEFAULT_RECORDS`]; 0 keeps none (dumps and heartbeats then carry only
/// each communicator's last completed and current operation).
pub fn records_from_env() -> Result<usize, String> {
    match std::env::var(env::BRAID_FLIGHT_RECORDS) {
        Ok(v) if !v.trim().is_empty() => match v.trim().parse::<usize>() {
            Ok(n) if n <= MAX_RECORDS => Ok(n),
            _ => Err(format!(
                "{}={v:?} is not a number of records from 0 to {MAX_RECORDS}",
                env::BRAID_FLIGHT_RECORDS
            )),
        },
        _ => Ok(DEFAULT_RECORDS),
    }
}

/// The log directory the launcher gives its workers when `--log-dir` is
/// not given.
pub fn default_log_dir(run_id: &str) -> PathBuf {
    std::env::temp_dir().join(format!("braid-{run_id}"))
}

/// Where this worker writes its dumps: [`env::BRAID_LOG_DIR`], which
/// `braid launch` always sets; `None` without it (torchrun, srun, a world
/// made in-process), where a rank writes no dump unless told where.
pub fn log_dir_from_env() -> Option<PathBuf> {
    std::env::var_os(env::BRAID_LOG_DIR)
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
}

/// File name of world rank `rank`'s dump in launcher attempt `attempt`
/// (its `BRAID_RESTART_COUNT`, from 0): `flight-rank00001-attempt1.json`,
/// the attempt counted from 1 as the launcher and `braid doctor` say it,
/// so that a restart never replaces an earlier attempt's record. Without
/// an attempt (a rank not started by `braid launch`) the name has none:
/// `flight-rank00001.json`, the only form older braids wrote, which
/// [`parse_dump_file_name`] and [`load_dir`] still read.
pub fn dump_file_name(rank: usize, attempt: Option<u32>) -> String {
    match attempt {
        Some(a) => format!("flight-rank{rank:05}-attempt{}.json", u64::from(a) + 1),
        None => format!("flight-rank{rank:05}.json"),
    }
}

/// Path of world rank `rank`'s dump of attempt `attempt` in `dir`
/// ([`dump_file_name`]).
pub fn dump_path(dir: &Path, rank: usize, attempt: Option<u32>) -> PathBuf {
    dir.join(dump_file_name(rank, attempt))
}

/// The world rank and attempt (from 0, as in `BRAID_RESTART_COUNT`) a
/// dump's file name stands for, in either form of [`dump_file_name`]
/// (`None` for the attempt: the form without one); `None` for any other
/// name, a dump's temporary file included.
pub fn parse_dump_file_name(name: &str) -> Option<(usize, Option<u32>)> {
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let stem = name.strip_prefix("flight-rank")?.strip_suffix(".json")?;
    let (rank, attempt) = match stem.split_once("-attempt") {
        Some((rank, attempt)) if digits(attempt) => {
            let n: u32 = attempt.parse().ok()?;
            (rank, Some(n.checked_sub(1)?))
        }
        Some(_) => return None,
        None => (stem, None),
    };
    if !digits(rank) {
        return None;
    }
    Some((rank.parse().ok()?, attempt))
}

/// Store key (under the workers' run prefix) of world rank `rank`'s
/// heartbeat.
pub fn heartbeat_key(rank: usize) -> String {
    format!("flight/hb/{rank}")
}

/// How often a rank publishes its heartbeat, for a communicator timeout
/// of `timeout`: a fifth of it, between 0.2 s and 1 s, so that a rank
/// stopped since the start of an operation is stale by the time the
/// operation times out.
pub fn heartbeat_interval(timeout: Duration) -> Duration {
    (timeout / 5).clamp(Duration::from_millis(200), Duration::from_secs(1))
}

/// A heartbeat published every `interval_ms` is stale after this long.
pub fn stale_after(interval_ms: u64) -> Duration {
    Duration::from_millis(interval_ms.saturating_mul(3) + 500)
}

/// Wall-clock time in microseconds since the Unix epoch.
pub fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

// The records and snapshots (`record`), and the diagnosis over them
// (`diagnose`), re-exported here as one module.
mod diagnose;
mod record;
#[cfg(test)]
mod tests;

pub use diagnose::*;
pub use record::*;
