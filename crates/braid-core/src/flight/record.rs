//! A rank's flight records as they are kept, published and written: one
//! operation's record, the snapshot of a rank (heartbeat or dump), whether
//! its process is alive, and the dumps of a directory read back.

use super::*;
use serde::{Deserialize, Serialize};
use std::fmt::Write as _;
use std::path::Path;
use std::time::Duration;

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

    pub(super) fn shape(&self) -> Option<String> {
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

    /// Writes the snapshot as `dir`/[`dump_file_name`] of its rank and
    /// attempt, atomically (a temporary file renamed over it); returns the
    /// path.
    pub fn write_atomic(&self, dir: &Path) -> std::io::Result<PathBuf> {
        std::fs::create_dir_all(dir)?;
        let path = dump_path(dir, self.rank, self.attempt);
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

/// Reads every flight record in `dir`: each file named by
/// [`dump_file_name`], with an attempt in its name or, as older braids
/// wrote them, without.
pub fn load_dir(dir: &Path) -> std::io::Result<Loaded> {
    load_dir_where(dir, |_, _| true)
}

/// [`load_dir`], reading only the files whose name's rank and attempt
/// (`None`: a name without one) pass `keep`; the others are not opened.
pub fn load_dir_where(
    dir: &Path,
    keep: impl Fn(usize, Option<u32>) -> bool,
) -> std::io::Result<Loaded> {
    let mut names: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .and_then(parse_dump_file_name)
                .is_some_and(|(rank, attempt)| keep(rank, attempt))
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
