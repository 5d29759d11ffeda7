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
//! ([`dump_path`]), the heartbeat key ([`heartbeat_key`]), the default log
//! directory ([`default_log_dir`]) and how stale a heartbeat may get
//! ([`stale_after`]).

use crate::env;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
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

/// File name of world rank `rank`'s dump.
pub fn dump_file_name(rank: usize) -> String {
    format!("flight-rank{rank:05}.json")
}

/// Path of world rank `rank`'s dump in `dir`.
pub fn dump_path(dir: &Path, rank: usize) -> PathBuf {
    dir.join(dump_file_name(rank))
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

/// Where an operation is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OpState {
    /// Queued (host: on the progress thread, not numbered yet; GPU: on the
    /// stream, not yet seen complete).
    Enqueued,
    /// Running on the host.
    Started,
    /// Finished (GPU: its completion event was observed).
    Completed,
    /// Failed (timed out, aborted, or an error).
    Failed,
}

/// One collective operation as a rank recorded it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OpRecord {
    /// Communicator id (`world`, `world.s0c1`, `world/gpu0`).
    pub comm: String,
    /// Sequence number on that communicator (`None`: queued, not yet
    /// numbered).
    pub seq: Option<u64>,
    /// Operation name.
    pub op: String,
    /// Element type, when the operation has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dtype: Option<String>,
    /// Element count as the caller passed it, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub count: Option<u64>,
    /// State when the snapshot was taken.
    pub state: OpState,
    /// When it was queued or issued (wall clock, µs since the epoch).
    pub enqueued_us: u64,
    /// When it started running on the host.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_us: Option<u64>,
    /// When it completed or failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended_us: Option<u64>,
}

impl OpRecord {
    /// `all_reduce #12`.
    pub fn label(&self) -> String {
        match self.seq {
            Some(s) => format!("{} #{s}", self.op),
            None => format!("{} (not yet numbered)", self.op),
        }
    }

    /// `all_reduce #12 (1024 x f32)`.
    pub fn describe(&self) -> String {
        match self.shape() {
            Some(shape) => format!("{} ({shape})", self.label()),
            None => self.label(),
        }
    }

    fn shape(&self) -> Option<String> {
        match (self.count, &self.dtype) {
            (Some(c), Some(d)) => Some(format!("{c} x {d}")),
            (Some(c), None) => Some(format!("{c} elements")),
            (None, Some(d)) => Some(d.clone()),
            (None, None) => None,
        }
    }

    /// Whether two ranks' records of the same sequence number describe
    /// calls that belong together. Point-to-point operations pair up
    /// rather than agree, and operations without a count (GPU groups,
    /// graphs) are compared by name only.
    pub fn matches(&self, other: &OpRecord) -> bool {
        let p2p = |o: &str| matches!(o, "send" | "recv" | "send_recv");
        if p2p(&self.op) && p2p(&other.op) {
            return true;
        }
        if self.op != other.op {
            return false;
        }
        let same = |a: &Option<String>, b: &Option<String>| a.is_none() || b.is_none() || a == b;
        let same_count = self.count.is_none() || other.count.is_none() || self.count == other.count;
        same(&self.dtype, &other.dtype) && same_count
    }
}

/// One communicator of a rank, and where the rank is in it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CommInfo {
    /// Communicator id.
    pub id: String,
    /// `host` (braid's own backends) or `gpu` (NCCL).
    pub kind: String,
    /// This rank's rank in it (process rank for GPU communicators).
    pub rank: usize,
    /// Its number of ranks.
    pub size: usize,
    /// The world rank of each of its ranks (dumps only).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub world_ranks: Vec<usize>,
    /// The last operation seen complete.
    pub last_completed: Option<OpRecord>,
    /// The operation in progress: running (host), the newest queued and
    /// not seen complete (GPU), or the one that failed.
    pub current: Option<OpRecord>,
}

/// Whether a snapshot is a full dump or a heartbeat.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SnapshotKind {
    /// Written to the log directory, with the records.
    Dump,
    /// Published to the store, without records (or written by the launcher
    /// from the last heartbeat of a rank that left no dump).
    Heartbeat,
}

/// How alive a rank was when it was looked at.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum Liveness {
    /// Nothing known.
    Unknown,
    /// Publishing heartbeats.
    Alive {
        /// Age of its last heartbeat, seconds.
        heartbeat_age_s: Option<f64>,
    },
    /// Its process exists but is stopped (state T: SIGSTOP, a debugger).
    Stopped {
        /// Age of its last heartbeat, seconds.
        heartbeat_age_s: Option<f64>,
    },
    /// Its heartbeat is stale.
    Silent {
        /// Age of its last heartbeat, seconds.
        heartbeat_age_s: f64,
        /// Whether its process is known to exist (`None`: not known, e.g.
        /// another host).
        process_alive: Option<bool>,
    },
    /// Its process ended.
    Exited {
        /// How: `exit code 1`, `signal SIGKILL`.
        how: String,
    },
    /// It dropped its communicator cleanly.
    Left,
}

impl Liveness {
    /// Whether this alone makes the rank a suspect.
    pub fn is_problem(&self) -> bool {
        !matches!(self, Liveness::Unknown | Liveness::Alive { .. })
    }

    /// In words, e.g. `no heartbeat for 4.1 s: stopped or hung, not dead`.
    pub fn note(&self) -> String {
        let age = |a: &Option<f64>| a.map(|a| format!("no heartbeat for {a:.1} s; "));
        match self {
            Liveness::Unknown => String::new(),
            Liveness::Alive {
                heartbeat_age_s: Some(a),
            } => format!("alive: heartbeat {a:.1} s ago"),
            Liveness::Alive {
                heartbeat_age_s: None,
            } => "alive".into(),
            Liveness::Stopped { heartbeat_age_s } => format!(
                "{}process stopped (state T: SIGSTOP or a debugger), not dead",
                age(heartbeat_age_s).unwrap_or_default()
            ),
            Liveness::Silent {
                heartbeat_age_s: a,
                process_alive: Some(true),
            } => format!("no heartbeat for {a:.1} s: stopped or hung, not dead"),
            Liveness::Silent {
                heartbeat_age_s: a,
                process_alive: Some(false),
            } => format!("no heartbeat for {a:.1} s; its process is gone"),
            Liveness::Silent {
                heartbeat_age_s: a,
                process_alive: None,
            } => format!("no heartbeat for {a:.1} s: stopped, hung or dead"),
            Liveness::Exited { how } => format!("exited: {how}"),
            Liveness::Left => "left: dropped its communicator".into(),
        }
    }
}

/// A local process as `/proc` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProcessState {
    /// Not looked at (another host).
    Unknown,
    /// Exists and is not stopped.
    Running,
    /// Stopped (state T or t).
    Stopped,
    /// Gone, in these words.
    Gone(String),
}

/// The state of local process `pid`.
pub fn local_process_state(pid: u32) -> ProcessState {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return ProcessState::Gone("its process is gone".into());
    };
    let state = stat
        .rsplit(')')
        .next()
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or("");
    match state {
        "Z" | "X" | "x" => ProcessState::Gone("its process exited".into()),
        "T" | "t" => ProcessState::Stopped,
        _ => ProcessState::Running,
    }
}

/// A rank's liveness from the age of its last heartbeat (published every
/// `heartbeat_ms`), if any, and what is known of its process.
pub fn liveness(
    heartbeat_age: Option<Duration>,
    heartbeat_ms: u64,
    process: ProcessState,
) -> Liveness {
    let age_s = heartbeat_age.map(|a| a.as_secs_f64());
    match process {
        ProcessState::Gone(how) => return Liveness::Exited { how },
        ProcessState::Stopped => {
            return Liveness::Stopped {
                heartbeat_age_s: age_s,
            }
        }
        _ => {}
    }
    match heartbeat_age {
        Some(age) if age > stale_after(heartbeat_ms) => Liveness::Silent {
            heartbeat_age_s: age.as_secs_f64(),
            process_alive: (process == ProcessState::Running).then_some(true),
        },
        Some(_) => Liveness::Alive {
            heartbeat_age_s: age_s,
        },
        None if process == ProcessState::Running => Liveness::Alive {
            heartbeat_age_s: None,
        },
        None => Liveness::Unknown,
    }
}

/// What one rank knows about itself: a dump or a heartbeat.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Snapshot {
    /// [`FORMAT_VERSION`].
    pub version: u32,
    /// Dump or heartbeat.
    pub kind: SnapshotKind,
    /// World rank.
    pub rank: usize,
    /// World size.
    pub world_size: usize,
    /// Process id.
    pub pid: u32,
    /// Host identity (as braid-comm tells hosts apart).
    pub host: String,
    /// Run id.
    pub run_id: String,
    /// The launcher's attempt (`BRAID_RESTART_COUNT`), if launched.
    pub attempt: Option<u32>,
    /// When the snapshot was taken (wall clock, µs since the epoch).
    pub wall_us: u64,
    /// How often heartbeats are published, ms.
    pub heartbeat_ms: u64,
    /// Why it was written (dumps): `collective timeout: ...`, `SIGUSR1`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// How alive the rank was, as someone else saw it (the launcher, when
    /// it writes a rank's last heartbeat for a rank that left no dump).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed: Option<Liveness>,
    /// The rank's communicators and where it is in each.
    pub comms: Vec<CommInfo>,
    /// The last operations, oldest first (dumps).
    #[serde(default)]
    pub records: Vec<OpRecord>,
}

impl Snapshot {
    /// JSON, one record per line.
    pub fn to_json(&self) -> String {
        let mut value = serde_json::to_value(self).expect("a snapshot serialises");
        let records = value
            .as_object_mut()
            .and_then(|o| o.remove("records"))
            .unwrap_or_default();
        let mut s = String::from("{\n");
        if let Some(o) = value.as_object() {
            for (k, v) in o {
                let _ = writeln!(s, "  {}: {},", serde_json::Value::from(k.as_str()), v);
            }
        }
        s.push_str("  \"records\": [");
        let records = records.as_array().cloned().unwrap_or_default();
        for (i, r) in records.iter().enumerate() {
            s.push_str(if i == 0 { "\n    " } else { ",\n    " });
            let _ = write!(s, "{r}");
        }
        s.push_str(if records.is_empty() {
            "]\n}\n"
        } else {
            "\n  ]\n}\n"
        });
        s
    }

    /// Compact JSON (heartbeats).
    pub fn to_compact_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a snapshot serialises")
    }

    /// Parses a snapshot.
    pub fn from_json(bytes: &[u8]) -> Result<Snapshot, String> {
        let s: Snapshot = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
        if s.version != FORMAT_VERSION {
            return Err(format!(
                "format version {} (this braid reads {FORMAT_VERSION})",
                s.version
            ));
        }
        Ok(s)
    }

    /// Writes the snapshot as `dir`/[`dump_file_name`], atomically (a
    /// temporary file renamed over it); returns the path.
    pub fn write_atomic(&self, dir: &Path) -> std::io::Result<PathBuf> {
        std::fs::create_dir_all(dir)?;
        let path = dump_path(dir, self.rank);
        crate::atomic_file::write(&path, self.to_json().as_bytes())?;
        Ok(path)
    }

    /// The records of communicator `comm`, plus its last completed and
    /// current operation (which outlive the ring).
    pub fn records_of(&self, comm: &str) -> Vec<OpRecord> {
        let mut out: Vec<OpRecord> = self
            .records
            .iter()
            .filter(|r| r.comm == comm)
            .cloned()
            .collect();
        if let Some(info) = self.comms.iter().find(|c| c.id == comm) {
            out.extend(info.last_completed.iter().cloned());
            out.extend(info.current.iter().cloned());
        }
        out
    }
}

/// The snapshots found in a directory.
#[derive(Debug, Default)]
pub struct Loaded {
    /// Each file and what it holds, by file name.
    pub snapshots: Vec<(PathBuf, Snapshot)>,
    /// Files that could not be read, each with why.
    pub problems: Vec<String>,
}

/// Reads every `flight-rank*.json` in `dir`.
pub fn load_dir(dir: &Path) -> std::io::Result<Loaded> {
    let mut names: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("flight-rank") && n.ends_with(".json"))
        })
        .collect();
    names.sort();
    let mut loaded = Loaded::default();
    for path in names {
        match std::fs::read(&path)
            .map_err(|e| e.to_string())
            .and_then(|b| Snapshot::from_json(&b))
        {
            Ok(s) => loaded.snapshots.push((path, s)),
            Err(e) => loaded.problems.push(format!("{}: {e}", path.display())),
        }
    }
    Ok(loaded)
}

// ---- diagnosis --------------------------------------------------------

/// One rank of a communicator, as the diagnosis sees it.
#[derive(Debug, Clone)]
pub struct RankInput {
    /// Rank in the communicator.
    pub rank: usize,
    /// Its world rank, when known.
    pub world_rank: Option<usize>,
    /// Whether its position is known (it published a heartbeat or left a
    /// dump), even if `records` is empty (no operation yet).
    pub known: bool,
    /// Its records of this communicator (any order, duplicates allowed).
    pub records: Vec<OpRecord>,
    /// How alive it was.
    pub liveness: Liveness,
}

/// Where a rank is in a communicator.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Position {
    /// The last operation it completed.
    pub last_completed: Option<OpRecord>,
    /// The operation it is in (or failed in, or queued last on a GPU).
    pub current: Option<OpRecord>,
    /// An operation it must have joined, known from the others (someone
    /// completed it, and it needs every rank), when that is further than
    /// what its own records say (they may be as old as its last
    /// heartbeat).
    pub joined: Option<OpRecord>,
    /// The highest sequence number it has issued and not seen complete
    /// (a GPU rank queues several), when past `current`.
    pub queued_through: Option<u64>,
}

impl Position {
    /// From a rank's records: the highest completed sequence number, and
    /// the numbered operation past it that has not completed (a failed one
    /// first).
    pub fn of(records: &[OpRecord]) -> Position {
        let last_completed = records
            .iter()
            .filter(|r| r.state == OpState::Completed && r.seq.is_some())
            .max_by_key(|r| r.seq)
            .cloned();
        let done = last_completed.as_ref().and_then(|r| r.seq).unwrap_or(0);
        let open = records
            .iter()
            .filter(|r| r.state != OpState::Completed && r.seq.is_some_and(|s| s > done));
        let newest = open.clone().filter_map(|r| r.seq).max();
        let current = open
            .clone()
            .filter(|r| r.state == OpState::Failed)
            .max_by_key(|r| r.seq)
            .or_else(|| open.max_by_key(|r| r.seq))
            .cloned();
        let at = current.as_ref().and_then(|c| c.seq);
        Position {
            last_completed,
            current,
            joined: None,
            queued_through: newest.filter(|n| Some(*n) > at),
        }
    }

    /// The furthest sequence number reached (entered or completed).
    pub fn reach(&self) -> u64 {
        let c = self.current.as_ref().and_then(|r| r.seq).unwrap_or(0);
        let d = self
            .last_completed
            .as_ref()
            .and_then(|r| r.seq)
            .unwrap_or(0);
        let j = self.joined.as_ref().and_then(|r| r.seq).unwrap_or(0);
        c.max(d).max(j).max(self.queued_through.unwrap_or(0))
    }

    /// `in all_reduce #5`, `after all_reduce #4`, `after joining
    /// all_reduce #4`, `before its first operation`.
    pub fn describe(&self) -> String {
        if let Some(j) = &self.joined {
            return format!("after joining {}", j.label());
        }
        match (&self.current, &self.last_completed) {
            (Some(c), _) => match c.state {
                OpState::Failed => format!("in {} (failed)", c.label()),
                OpState::Enqueued => match &self.last_completed {
                    Some(d) => format!("after {} with {} queued on the GPU", d.label(), c.label()),
                    None => format!("with {} queued on the GPU", c.label()),
                },
                _ => format!("in {}", c.label()),
            },
            (None, Some(d)) => format!("after {}", d.label()),
            (None, None) => "before its first operation".into(),
        }
    }
}

/// What kind of problem a finding is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FindingKind {
    /// Stopped or silent (no heartbeat).
    Stopped,
    /// Its process ended.
    Exited,
    /// Dropped its communicator.
    Left,
    /// Alive (or unknown) but behind the others.
    Behind,
    /// No heartbeat and no record at all.
    NeverArrived,
    /// Ranks called different operations at one sequence number.
    Mismatch,
}

/// One thing the diagnosis found.
#[derive(Debug, Clone, Serialize)]
pub struct Finding {
    /// What kind.
    pub kind: FindingKind,
    /// The ranks (in the communicator) it is about.
    pub ranks: Vec<usize>,
    /// In words.
    pub text: String,
}

/// One rank's line of the diagnosis.
#[derive(Debug, Clone, Serialize)]
pub struct RankReport {
    /// Rank in the communicator.
    pub rank: usize,
    /// World rank, when known.
    pub world_rank: Option<usize>,
    /// `waiting`, `behind`, `stopped`, `exited`, `left`, `finished`,
    /// `never arrived`, `unknown`.
    pub status: String,
    /// Where it is, in words.
    pub position: String,
    /// Where it is.
    pub at: Position,
    /// How alive it was.
    pub liveness: Liveness,
}

/// The diagnosis of one communicator.
#[derive(Debug, Clone, Serialize)]
pub struct Diagnosis {
    /// Communicator id.
    pub comm: String,
    /// Its size.
    pub size: usize,
    /// The furthest operation any rank reached.
    pub front: Option<OpRecord>,
    /// Suspects and mismatches, most telling first.
    pub findings: Vec<Finding>,
    /// Ranks inside the front operation, waiting for the others.
    pub waiting: Vec<usize>,
    /// Every rank.
    pub ranks: Vec<RankReport>,
    /// One line: the suspects, then who waits where.
    pub summary: String,
}

impl Diagnosis {
    /// Whether anything is wrong (a suspect or a mismatch).
    pub fn has_problem(&self) -> bool {
        !self.findings.is_empty()
    }

    /// Whether to print it: the world's always; another communicator's
    /// when it found something and had operations (a split nobody used
    /// only repeats what the world's says about a stopped or dead rank).
    pub fn worth_showing(&self) -> bool {
        self.comm == "world" || (self.has_problem() && self.front.is_some())
    }

    /// The ranks the findings name, in order.
    pub fn suspects(&self) -> Vec<usize> {
        let mut seen = BTreeSet::new();
        self.findings
            .iter()
            .flat_map(|f| f.ranks.iter().copied())
            .filter(|r| seen.insert(*r))
            .collect()
    }

    /// Several lines: the summary, then one line per rank (at most
    /// `max_ranks`, suspects and waiting ranks first), each indented by
    /// `indent`.
    pub fn render(&self, indent: &str, max_ranks: usize) -> String {
        let mut s = format!(
            "{indent}{} ({} rank{}): {}\n",
            self.comm,
            self.size,
            if self.size == 1 { "" } else { "s" },
            self.summary
        );
        let suspects = self.suspects();
        let mut order: Vec<&RankReport> = self.ranks.iter().collect();
        order.sort_by_key(|r| (!suspects.contains(&r.rank), r.rank));
        for r in order.iter().take(max_ranks) {
            let world = match r.world_rank {
                Some(w) if w != r.rank => format!(" (world rank {w})"),
                _ => String::new(),
            };
            let note = r.liveness.note();
            let _ = writeln!(
                s,
                "{indent}  rank {}{world}: {}, {}{}",
                r.rank,
                r.status,
                r.position,
                if note.is_empty() {
                    String::new()
                } else {
                    format!(" ({note})")
                }
            );
        }
        if order.len() > max_ranks {
            let _ = writeln!(
                s,
                "{indent}  ... and {} more rank(s)",
                order.len() - max_ranks
            );
        }
        s
    }
}

/// `0`, `0, 2-5, 9`.
pub fn rank_list(ranks: &[usize]) -> String {
    let mut sorted = ranks.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut parts = Vec::new();
    let mut i = 0;
    while i < sorted.len() {
        let mut j = i;
        while j + 1 < sorted.len() && sorted[j + 1] == sorted[j] + 1 {
            j += 1;
        }
        parts.push(if j > i + 1 {
            format!("{}-{}", sorted[i], sorted[j])
        } else if j == i + 1 {
            format!("{}, {}", sorted[i], sorted[j])
        } else {
            sorted[i].to_string()
        });
        i = j + 1;
    }
    parts.join(", ")
}

fn ranks_word(ranks: &[usize]) -> String {
    if ranks.len() == 1 {
        format!("rank {}", ranks[0])
    } else {
        format!("ranks {}", rank_list(ranks))
    }
}

/// Whether every rank must have joined operation `op` for any rank to
/// complete it (not so for rooted operations, whose root or leaves may
/// finish first, nor for point-to-point ones).
pub fn needs_every_rank(op: &str) -> bool {
    matches!(
        op,
        "all_reduce"
            | "all_gather"
            | "all_gather_v"
            | "reduce_scatter"
            | "all_to_all"
            | "all_to_all_v"
            | "barrier"
    )
}

/// The first sequence number at which two ranks' records disagree.
fn first_mismatch(inputs: &[RankInput]) -> Option<(u64, Vec<(usize, OpRecord)>)> {
    let mut by_seq: BTreeMap<u64, Vec<(usize, OpRecord)>> = BTreeMap::new();
    for input in inputs {
        let mut seen = BTreeSet::new();
        for r in &input.records {
            if let Some(seq) = r.seq {
                if seen.insert(seq) {
                    by_seq.entry(seq).or_default().push((input.rank, r.clone()));
                }
            }
        }
    }
    by_seq.into_iter().find_map(|(seq, calls)| {
        let first = &calls[0].1;
        (calls.len() > 1 && calls.iter().any(|(_, r)| !r.matches(first))).then_some((seq, calls))
    })
}

/// Diagnoses communicator `comm` of `size` ranks from what is known of
/// each (`ranks` need not cover every rank: one missing never arrived).
///
/// The *front* is the furthest operation any rank reached. A rank short
/// of it is behind; a rank that is stopped, silent, gone or left without
/// having failed an operation itself is a suspect wherever it is; ranks
/// in the front operation are waiting. Ranks that recorded different
/// operations under one sequence number are a mismatch.
pub fn diagnose(comm: &str, size: usize, ranks: &[RankInput]) -> Diagnosis {
    let mut inputs: Vec<RankInput> = (0..size)
        .map(|r| RankInput {
            rank: r,
            world_rank: None,
            known: false,
            records: Vec::new(),
            liveness: Liveness::Unknown,
        })
        .collect();
    for input in ranks.iter().filter(|i| i.rank < size) {
        inputs[input.rank] = input.clone();
    }
    let mut positions: Vec<Position> = inputs.iter().map(|i| Position::of(&i.records)).collect();
    // A rank's records may be older than where it is (a heartbeat lags by
    // up to its interval): an operation that needs every rank and that
    // some rank completed was joined by all.
    let joined_by_all = inputs
        .iter()
        .flat_map(|i| &i.records)
        .filter(|r| r.state == OpState::Completed && needs_every_rank(&r.op))
        .max_by_key(|r| r.seq)
        .cloned();
    if let Some(j) = &joined_by_all {
        let seq = j.seq.unwrap_or(0);
        for p in positions.iter_mut().filter(|p| p.reach() < seq) {
            p.joined = Some(j.clone());
        }
    }
    let mut by_seq: BTreeMap<u64, &OpRecord> = BTreeMap::new();
    for r in inputs.iter().flat_map(|i| &i.records) {
        if let Some(seq) = r.seq {
            by_seq.entry(seq).or_insert(r);
        }
    }
    let front_seq = positions.iter().map(Position::reach).max().unwrap_or(0);
    let front = (front_seq > 0).then(|| {
        let at_front = |r: &Option<OpRecord>| r.clone().filter(|r| r.seq == Some(front_seq));
        positions
            .iter()
            .find_map(|p| at_front(&p.current))
            .or_else(|| positions.iter().find_map(|p| at_front(&p.last_completed)))
            .or_else(|| by_seq.get(&front_seq).map(|r| (*r).clone()))
            .or_else(|| positions.iter().find_map(|p| at_front(&p.joined)))
    });
    let front = front.flatten();
    let front_label = front
        .as_ref()
        .map(OpRecord::label)
        .unwrap_or_else(|| "its first operation".into());

    let mut findings: Vec<Finding> = Vec::new();
    let mut waiting = Vec::new();
    let mut reports = Vec::new();
    let mut never = Vec::new();
    for (input, pos) in inputs.iter().zip(&positions) {
        let has_info = input.known || !input.records.is_empty() || pos.joined.is_some();
        let failed_here = pos
            .current
            .as_ref()
            .is_some_and(|c| c.state == OpState::Failed);
        let behind = has_info && pos.reach() < front_seq;
        let where_ = if has_info {
            pos.describe()
        } else {
            "at an unknown point (no heartbeat, no flight record)".into()
        };
        // The first operation it is missing (GPU ranks may have queued
        // several past it), else the front.
        let missing = by_seq
            .get(&(pos.reach() + 1))
            .map(|r| r.label())
            .unwrap_or_else(|| front_label.clone());
        let short_of = if behind {
            format!(" and did not reach {missing}")
        } else {
            String::new()
        };
        let own_info = input.known || !input.records.is_empty();
        let note = input.liveness.note();
        let paren = if !note.is_empty() {
            format!(" ({note})")
        } else if !own_info {
            " (it left no heartbeat or flight record)".into()
        } else {
            String::new()
        };
        let suspect_by_liveness = input.liveness.is_problem() && !failed_here;
        let r = input.rank;
        let (status, finding) = if !has_info && input.liveness == Liveness::Unknown {
            never.push(r);
            ("never arrived", None)
        } else if behind || suspect_by_liveness {
            match &input.liveness {
                Liveness::Stopped { .. } | Liveness::Silent { .. } => (
                    "stopped",
                    Some((
                        FindingKind::Stopped,
                        format!("rank {r} stopped {where_}{short_of}{paren}"),
                    )),
                ),
                Liveness::Exited { how } => (
                    "exited",
                    Some((
                        FindingKind::Exited,
                        format!("rank {r} exited {where_}{short_of} ({how})"),
                    )),
                ),
                Liveness::Left => (
                    "left",
                    Some((
                        FindingKind::Left,
                        format!("rank {r} left {where_}{short_of} (dropped its communicator)"),
                    )),
                ),
                _ => (
                    "behind",
                    Some((
                        FindingKind::Behind,
                        format!(
                            "rank {r} is behind, {where_}, and has not reached {missing}{paren}"
                        ),
                    )),
                ),
            }
        } else if !has_info {
            ("unknown", None)
        } else if pos.current.is_some() {
            waiting.push(r);
            ("waiting", None)
        } else {
            ("finished", None)
        };
        if let Some((kind, text)) = finding {
            findings.push(Finding {
                kind,
                ranks: vec![r],
                text,
            });
        }
        reports.push(RankReport {
            rank: r,
            world_rank: input.world_rank,
            status: status.into(),
            position: where_,
            at: pos.clone(),
            liveness: input.liveness.clone(),
        });
    }
    if !never.is_empty() {
        findings.push(Finding {
            kind: FindingKind::NeverArrived,
            text: format!(
                "{} never arrived (no heartbeat, no flight record{})",
                ranks_word(&never),
                if front_seq > 0 {
                    format!("; the others reached {front_label}")
                } else {
                    String::new()
                }
            ),
            ranks: never,
        });
    }
    if let Some((seq, calls)) = first_mismatch(&inputs) {
        let mut groups: Vec<(OpRecord, Vec<usize>)> = Vec::new();
        for (r, rec) in calls {
            match groups.iter_mut().find(|(g, _)| g.matches(&rec)) {
                Some((_, ranks)) => ranks.push(r),
                None => groups.push((rec, vec![r])),
            }
        }
        let parts: Vec<String> = groups
            .iter()
            .map(|(rec, ranks)| {
                let shape = rec.shape().map(|s| format!(" ({s})")).unwrap_or_default();
                format!("{}{shape} on {}", rec.op, ranks_word(ranks))
            })
            .collect();
        findings.push(Finding {
            kind: FindingKind::Mismatch,
            ranks: groups.iter().skip(1).flat_map(|(_, r)| r.clone()).collect(),
            text: format!(
                "ranks called different operations at #{seq}: {}",
                parts.join("; ")
            ),
        });
    }

    const MAX_LISTED: usize = 8;
    let mut parts: Vec<String> = findings
        .iter()
        .take(MAX_LISTED)
        .map(|f| f.text.clone())
        .collect();
    if findings.len() > MAX_LISTED {
        parts.push(format!(
            "and {} more finding(s)",
            findings.len() - MAX_LISTED
        ));
    }
    // Who waits in what (a GPU rank waits in its oldest unfinished
    // operation, maybe short of what it queued).
    let mut waits: Vec<(String, Vec<usize>)> = Vec::new();
    for &r in &waiting {
        let label = positions[r]
            .current
            .as_ref()
            .map(OpRecord::label)
            .unwrap_or_else(|| front_label.clone());
        match waits.iter_mut().find(|(l, _)| *l == label) {
            Some((_, ranks)) => ranks.push(r),
            None => waits.push((label, vec![r])),
        }
    }
    for (label, ranks) in waits.iter().take(4) {
        parts.push(format!("{} waiting in {label}", ranks_word(ranks)));
    }
    if waits.len() > 4 {
        parts.push(format!(
            "{} more rank(s) waiting elsewhere",
            waits[4..].iter().map(|(_, r)| r.len()).sum::<usize>()
        ));
    }
    if findings.is_empty() {
        if !waiting.is_empty() && waiting.len() == size {
            parts.insert(
                0,
                "no rank is behind and none stopped: every rank is inside the same operation (a transfer stuck in the backend or the network)".into(),
            );
        } else if waiting.is_empty() && front_seq > 0 {
            parts.push(format!(
                "every rank finished {front_label} and none is inside an operation"
            ));
        } else if front_seq == 0 && waiting.is_empty() {
            parts.push("no operation has started".into());
        }
    }
    Diagnosis {
        comm: comm.to_string(),
        size,
        front,
        findings,
        waiting,
        ranks: reports,
        summary: parts.join("; "),
    }
}

/// One world rank, as the launcher or `braid doctor` knows it.
#[derive(Debug, Clone)]
pub struct WorldRank<'a> {
    /// Its dump or last heartbeat, if any.
    pub snapshot: Option<&'a Snapshot>,
    /// How alive it was.
    pub liveness: Liveness,
}

/// Diagnoses every communicator the snapshots mention (`world` first),
/// from `ranks`, indexed by world rank.
pub fn diagnose_world(ranks: &[WorldRank]) -> Vec<Diagnosis> {
    let mut comms: BTreeMap<String, usize> = BTreeMap::new();
    for s in ranks.iter().filter_map(|r| r.snapshot) {
        for c in &s.comms {
            comms.entry(c.id.clone()).or_insert(c.size);
        }
    }
    let mut ids: Vec<String> = comms.keys().cloned().collect();
    ids.sort_by_key(|id| (id != "world", id.clone()));
    let mut out = Vec::new();
    for id in ids {
        let size = comms[&id];
        // Comm rank -> world rank: a dump's list, else each snapshot's own
        // entry; the world communicator's ranks are the world's.
        let mut map: BTreeMap<usize, usize> = BTreeMap::new();
        for (w, s) in ranks
            .iter()
            .enumerate()
            .filter_map(|(w, r)| r.snapshot.map(|s| (w, s)))
        {
            for c in s.comms.iter().filter(|c| c.id == id) {
                for (cr, wr) in c.world_ranks.iter().enumerate() {
                    map.insert(cr, *wr);
                }
                map.insert(c.rank, w);
            }
        }
        if id == "world" || id.starts_with("world/gpu") {
            for r in 0..size.min(ranks.len()) {
                map.entry(r).or_insert(r);
            }
        }
        let inputs: Vec<RankInput> = map
            .iter()
            .filter(|(_, w)| **w < ranks.len())
            .map(|(&cr, &w)| {
                let rank = &ranks[w];
                let known = rank
                    .snapshot
                    .is_some_and(|s| s.comms.iter().any(|c| c.id == id));
                RankInput {
                    rank: cr,
                    world_rank: Some(w),
                    known,
                    records: rank.snapshot.map(|s| s.records_of(&id)).unwrap_or_default(),
                    liveness: rank.liveness.clone(),
                }
            })
            .collect();
        out.push(diagnose(&id, size, &inputs));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(seq: u64, op: &str, count: u64, state: OpState) -> OpRecord {
        OpRecord {
            comm: "world".into(),
            seq: Some(seq),
            op: op.into(),
            dtype: Some("f32".into()),
            count: Some(count),
            state,
            enqueued_us: seq * 10,
            started_us: Some(seq * 10),
            ended_us: (state != OpState::Started).then_some(seq * 10 + 5),
        }
    }

    /// Records of a rank that completed all_reduce #1..=done and is in
    /// `current` (if any).
    fn history(done: u64, current: Option<OpRecord>) -> Vec<OpRecord> {
        let mut v: Vec<OpRecord> = (1..=done)
            .map(|s| rec(s, "all_reduce", 1024, OpState::Completed))
            .collect();
        v.extend(current);
        v
    }

    fn input(rank: usize, records: Vec<OpRecord>, liveness: Liveness) -> RankInput {
        RankInput {
            rank,
            world_rank: Some(rank),
            known: liveness != Liveness::Unknown,
            records,
            liveness,
        }
    }

    fn alive() -> Liveness {
        Liveness::Alive {
            heartbeat_age_s: Some(0.2),
        }
    }

    #[test]
    fn a_stopped_rank_behind_the_others_is_named_with_where_it_stopped() {
        let ranks = [
            input(
                0,
                history(41, Some(rec(42, "all_reduce", 1024, OpState::Failed))),
                alive(),
            ),
            input(
                1,
                history(41, None),
                liveness(
                    Some(Duration::from_millis(19_800)),
                    1000,
                    ProcessState::Running,
                ),
            ),
            input(
                2,
                history(41, Some(rec(42, "all_reduce", 1024, OpState::Started))),
                alive(),
            ),
        ];
        let d = diagnose("world", 3, &ranks);
        assert_eq!(d.suspects(), vec![1]);
        assert_eq!(d.findings[0].kind, FindingKind::Stopped);
        assert_eq!(d.waiting, vec![0, 2]);
        assert_eq!(
            d.summary,
            "rank 1 stopped after all_reduce #41 and did not reach all_reduce #42 \
             (no heartbeat for 19.8 s: stopped or hung, not dead); \
             ranks 0, 2 waiting in all_reduce #42"
        );
        let text = d.render("", 8);
        assert!(
            text.contains("rank 1: stopped, after all_reduce #41"),
            "{text}"
        );
        assert!(
            text.contains("rank 0: waiting, in all_reduce #42 (failed)"),
            "{text}"
        );
    }

    #[test]
    fn an_alive_rank_behind_is_behind_not_stopped() {
        let ranks = [
            input(
                0,
                history(3, Some(rec(4, "all_reduce", 1024, OpState::Failed))),
                alive(),
            ),
            input(1, history(2, None), alive()),
        ];
        let d = diagnose("world", 2, &ranks);
        assert_eq!(d.findings.len(), 1);
        assert_eq!(d.findings[0].kind, FindingKind::Behind);
        assert!(
            d.summary.starts_with(
                "rank 1 is behind, after joining all_reduce #3, and has not reached all_reduce #4 (alive"
            ),
            "{}",
            d.summary
        );
    }

    #[test]
    fn a_stopped_rank_inside_the_front_operation_is_still_the_suspect() {
        let ranks = [
            input(
                0,
                history(7, Some(rec(8, "all_reduce", 1024, OpState::Failed))),
                alive(),
            ),
            input(
                1,
                history(7, Some(rec(8, "all_reduce", 1024, OpState::Started))),
                liveness(Some(Duration::from_secs(6)), 1000, ProcessState::Stopped),
            ),
        ];
        let d = diagnose("world", 2, &ranks);
        assert_eq!(d.suspects(), vec![1]);
        assert!(
            d.summary.starts_with(
                "rank 1 stopped in all_reduce #8 (no heartbeat for 6.0 s; process stopped (state T"
            ),
            "{}",
            d.summary
        );
    }

    #[test]
    fn mismatched_operations_at_one_sequence_number_are_reported() {
        let ranks = [
            input(
                0,
                history(4, Some(rec(5, "all_reduce", 1024, OpState::Failed))),
                alive(),
            ),
            input(
                1,
                history(4, Some(rec(5, "broadcast", 8, OpState::Started))),
                alive(),
            ),
            input(
                2,
                history(4, Some(rec(5, "all_reduce", 1000, OpState::Started))),
                alive(),
            ),
        ];
        let d = diagnose("world", 3, &ranks);
        let m = d
            .findings
            .iter()
            .find(|f| f.kind == FindingKind::Mismatch)
            .expect("a mismatch");
        assert_eq!(
            m.text,
            "ranks called different operations at #5: all_reduce (1024 x f32) on rank 0; \
             broadcast (8 x f32) on rank 1; all_reduce (1000 x f32) on rank 2"
        );
        assert_eq!(m.ranks, vec![1, 2]);
        // Point-to-point pairs are not a mismatch.
        let p2p = [
            input(0, vec![rec(1, "send", 8, OpState::Started)], alive()),
            input(1, vec![rec(1, "recv", 8, OpState::Started)], alive()),
        ];
        assert!(!diagnose("world", 2, &p2p).has_problem());
    }

    #[test]
    fn ranks_never_heard_from_are_never_arrived() {
        let ranks = [
            input(
                0,
                history(0, Some(rec(1, "barrier", 0, OpState::Failed))),
                alive(),
            ),
            input(
                2,
                history(0, Some(rec(1, "barrier", 0, OpState::Started))),
                alive(),
            ),
        ];
        let d = diagnose("world", 4, &ranks);
        let never = d
            .findings
            .iter()
            .find(|f| f.kind == FindingKind::NeverArrived)
            .expect("never arrived");
        assert_eq!(never.ranks, vec![1, 3]);
        assert!(
            never.text.starts_with("ranks 1, 3 never arrived"),
            "{}",
            never.text
        );
        assert!(
            d.summary.ends_with("ranks 0, 2 waiting in barrier #1"),
            "{}",
            d.summary
        );
    }

    #[test]
    fn a_stale_heartbeat_is_moved_up_to_what_the_others_completed() {
        // Rank 1's last heartbeat says all_reduce #40; rank 0 completed #90
        // (which needs every rank) and waits in #91.
        let ranks = [
            input(
                0,
                history(90, Some(rec(91, "all_reduce", 1024, OpState::Failed))),
                alive(),
            ),
            input(
                1,
                history(39, Some(rec(40, "all_reduce", 1024, OpState::Started))),
                liveness(Some(Duration::from_secs(5)), 1000, ProcessState::Stopped),
            ),
            // Rank 2 left nothing at all, but must have joined #90 too.
            input(2, vec![], Liveness::Unknown),
        ];
        let d = diagnose("world", 3, &ranks);
        assert_eq!(d.suspects(), vec![1, 2]);
        assert!(
            d.summary.starts_with(
                "rank 1 stopped after joining all_reduce #90 and did not reach all_reduce #91 (no heartbeat for 5.0 s; process stopped"
            ),
            "{}",
            d.summary
        );
        assert!(
            d.summary.contains(
                "rank 2 is behind, after joining all_reduce #90, and has not reached all_reduce #91 (it left no heartbeat or flight record)"
            ),
            "{}",
            d.summary
        );
        // A broadcast's root may finish alone: nothing is inferred from it.
        let rooted = [
            input(0, vec![rec(1, "broadcast", 8, OpState::Completed)], alive()),
            input(1, vec![], alive()),
        ];
        let d = diagnose("world", 2, &rooted);
        assert!(
            d.summary
                .starts_with("rank 1 is behind, before its first operation"),
            "{}",
            d.summary
        );
    }

    #[test]
    fn a_rank_behind_on_a_gpu_is_short_of_the_first_operation_it_misses() {
        let queued = |seq| OpRecord {
            comm: "world/gpu0".into(),
            ..rec(seq, "all_reduce", 1024, OpState::Enqueued)
        };
        // Rank 0 queued #4..#9 and waits (failed) in #5; rank 1 queued
        // only #4 when it stopped.
        let mut ahead = history(3, None);
        ahead.extend((4..=9).map(queued));
        ahead.push(OpRecord {
            comm: "world/gpu0".into(),
            ..rec(5, "all_reduce", 1024, OpState::Failed)
        });
        let mut behind = history(3, None);
        behind.push(queued(4));
        let ranks = [
            input(0, ahead, alive()),
            input(
                1,
                behind,
                liveness(Some(Duration::from_secs(9)), 1000, ProcessState::Stopped),
            ),
        ];
        let d = diagnose("world/gpu0", 2, &ranks);
        assert!(
            d.summary.starts_with(
                "rank 1 stopped after all_reduce #3 with all_reduce #4 queued on the GPU and did not reach all_reduce #5 ("
            ),
            "{}",
            d.summary
        );
        assert!(
            d.summary.ends_with("rank 0 waiting in all_reduce #5"),
            "{}",
            d.summary
        );
        assert_eq!(d.front.as_ref().unwrap().seq, Some(9));
    }

    #[test]
    fn a_healthy_communicator_has_no_findings() {
        let ranks = [
            input(0, history(9, None), alive()),
            input(1, history(9, None), alive()),
        ];
        let d = diagnose("world", 2, &ranks);
        assert!(!d.has_problem());
        assert_eq!(
            d.summary,
            "every rank finished all_reduce #9 and none is inside an operation"
        );
    }

    #[test]
    fn positions_prefer_the_failed_operation_and_queued_gpu_work() {
        let mut gpu = history(3, None);
        gpu.push(OpRecord {
            state: OpState::Enqueued,
            ..rec(4, "all_reduce", 1024, OpState::Enqueued)
        });
        gpu.push(OpRecord {
            state: OpState::Enqueued,
            ..rec(5, "all_reduce", 1024, OpState::Enqueued)
        });
        let p = Position::of(&gpu);
        assert_eq!(p.reach(), 5);
        assert_eq!(
            p.describe(),
            "after all_reduce #3 with all_reduce #5 queued on the GPU"
        );
        let mut failed = gpu.clone();
        failed.push(rec(4, "all_reduce", 1024, OpState::Failed));
        assert_eq!(
            Position::of(&failed).describe(),
            "in all_reduce #4 (failed)"
        );
    }

    #[test]
    fn snapshots_round_trip_and_world_diagnosis_maps_splits() {
        let comm = |id: &str, rank, world_ranks: Vec<usize>, cur: Option<OpRecord>| CommInfo {
            id: id.into(),
            kind: "host".into(),
            rank,
            size: 2,
            world_ranks,
            last_completed: Some(OpRecord {
                comm: id.into(),
                ..rec(3, "all_reduce", 4, OpState::Completed)
            }),
            current: cur,
        };
        let snap = |rank, comms, records| Snapshot {
            version: FORMAT_VERSION,
            kind: SnapshotKind::Dump,
            rank,
            world_size: 2,
            pid: 1,
            host: "h".into(),
            run_id: "r".into(),
            attempt: Some(0),
            wall_us: 5,
            heartbeat_ms: 1000,
            reason: Some("test".into()),
            observed: None,
            comms,
            records,
        };
        let failed = OpRecord {
            comm: "world.s0c0".into(),
            ..rec(4, "all_reduce", 4, OpState::Failed)
        };
        // World rank 1 is comm rank 0 of the split; rank 0 is its rank 1.
        let a = snap(
            1,
            vec![
                comm("world", 1, vec![0, 1], None),
                comm("world.s0c0", 0, vec![1, 0], Some(failed.clone())),
            ],
            history(3, None),
        );
        let json = a.to_json();
        assert!(json.contains("\n  \"records\": [\n    {"), "{json}");
        assert_eq!(Snapshot::from_json(json.as_bytes()).unwrap(), a);
        let b = snap(
            0,
            vec![
                comm("world", 0, vec![0, 1], None),
                comm("world.s0c0", 1, vec![1, 0], None),
            ],
            vec![],
        );
        let ranks = [
            WorldRank {
                snapshot: Some(&b),
                liveness: Liveness::Stopped {
                    heartbeat_age_s: None,
                },
            },
            WorldRank {
                snapshot: Some(&a),
                liveness: Liveness::Unknown,
            },
        ];
        let ds = diagnose_world(&ranks);
        assert_eq!(ds[0].comm, "world");
        let split = &ds[1];
        assert_eq!(split.comm, "world.s0c0");
        assert_eq!(split.suspects(), vec![1]);
        assert_eq!(split.ranks[1].world_rank, Some(0));
        assert!(
            split
                .summary
                .starts_with("rank 1 stopped after all_reduce #3 and did not reach all_reduce #4"),
            "{}",
            split.summary
        );
    }

    #[test]
    fn rank_lists_are_compact() {
        assert_eq!(rank_list(&[5, 0, 2, 3, 4, 9]), "0, 2-5, 9");
        assert_eq!(rank_list(&[1, 2]), "1, 2");
        assert_eq!(rank_list(&[]), "");
    }

    #[test]
    fn liveness_tells_stale_from_fresh() {
        let ms = 1000;
        assert!(matches!(
            liveness(Some(Duration::from_millis(500)), ms, ProcessState::Unknown),
            Liveness::Alive { .. }
        ));
        assert_eq!(
            liveness(Some(Duration::from_secs(5)), ms, ProcessState::Unknown).note(),
            "no heartbeat for 5.0 s: stopped, hung or dead"
        );
        assert_eq!(
            liveness(None, ms, ProcessState::Gone("signal SIGKILL".into())),
            Liveness::Exited {
                how: "signal SIGKILL".into()
            }
        );
        assert_eq!(
            local_process_state(std::process::id()),
            ProcessState::Running
        );
    }
}
