//! The flight recorder: each rank's last collective operations, kept so
//! that a hang can be explained after the fact.
//!
//! One [`Recorder`] per rank (made with the world communicator, shared by
//! its splits and GPU communicators) keeps the last N operations
//! (`BRAID_FLIGHT_RECORDS`, default 2048) in a ring buffer: sequence
//! number, operation, dtype, count, communicator, state and wall-clock
//! timestamps. Recording is one short critical section per state change
//! (queued, started, finished), no allocation.
//!
//! What the records are used for:
//!
//! - *dumps* ([`Recorder::dump`]): the records as JSON in the log
//!   directory (`BRAID_LOG_DIR`, which `braid launch` always sets;
//!   `flight-rankNNNNN-attemptA.json`, A the launcher's attempt counted
//!   from 1, or `flight-rankNNNNN.json` without `BRAID_RESTART_COUNT`;
//!   written atomically) on a collective timeout or any other abort (the health
//!   flag's first raise), SIGUSR1, or the GPU watchdog ending the process.
//!   Without `BRAID_LOG_DIR` (torchrun, srun, in-process worlds) nothing is
//!   written. A dump's temporary file is created before its snapshot is
//!   taken, so that the launcher, which asked with SIGUSR1, sees it begun
//!   and waits for it; a rank's dumps are written one at a time, and a
//!   process that exits while one is being written (its main thread
//!   erroring out of the collective the dump is about) first waits for it,
//!   up to [`EXIT_WAITS_FOR_DUMP`];
//! - *heartbeats* ([`Recorder::publish_heartbeat`]): the world
//!   communicator's health monitor publishes each communicator's last
//!   completed and current operation to the store every second or so; a
//!   stopped process publishes nothing, so its heartbeat goes stale while
//!   still saying where it stopped;
//! - the *timeout diagnosis* (`diagnose_timeout`): the rank whose
//!   operation timed out reads its peers' heartbeats and names the culprit
//!   with [`braid_core::flight::diagnose`], as the launcher and `braid
//!   doctor` do from the dumps.
//!
//! A dump never waits on a thread stuck in a collective. It takes three
//! locks of its own, none of which such a thread can hold: the ring's
//! (held only inside this module, for a copy or an update of a few slots —
//! see `Recorder::lock`), the rank's dump lock (held only by a dump, around
//! its snapshot and file write) and the live-recorder list's (held only to
//! register a recorder or copy the list); besides, only stderr's, for its
//! one line. A thread blocked in a wait loop, in NCCL or on a socket holds
//! none of them: it records before and after it blocks, never while.

use braid_core::flight::{
    self as format, CommInfo, Liveness, OpRecord, OpState, ProcessState, RankInput, Snapshot,
    SnapshotKind,
};
use braid_core::DType;
use braid_store::StoreClient;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Once, OnceLock, Weak};
use std::time::{Duration, Instant};

/// The longest a process that exits while one of its flight records is
/// being written waits for it (an `atexit` handler): as long as the
/// launcher waits for a record it asked for.
pub const EXIT_WAITS_FOR_DUMP: Duration = Duration::from_secs(30);

/// One operation in the ring (fixed size, no allocation).
#[derive(Clone, Copy)]
struct Slot {
    /// Record id (from 1); 0 marks an empty slot.
    id: u64,
    comm: u16,
    /// 0 while not numbered.
    seq: u64,
    op: &'static str,
    dtype: Option<DType>,
    count: Option<u64>,
    state: OpState,
    enqueued_us: u64,
    started_us: u64,
    ended_us: u64,
}

/// One communicator's registration and where the rank is in it.
struct Track {
    id: String,
    kind: &'static str,
    rank: usize,
    size: usize,
    world_ranks: Vec<usize>,
    last_completed: Option<Slot>,
    current: Option<Slot>,
}

struct Ring {
    slots: Vec<Slot>,
    /// Id of the next record.
    next: u64,
    comms: Vec<Track>,
}

impl Ring {
    fn push(&mut self, slot: Slot) -> u64 {
        let id = self.next;
        self.next += 1;
        if !self.slots.is_empty() {
            let n = self.slots.len() as u64;
            self.slots[((id - 1) % n) as usize] = Slot { id, ..slot };
        }
        id
    }

    fn get_mut(&mut self, id: u64) -> Option<&mut Slot> {
        if self.slots.is_empty() || id == 0 {
            return None;
        }
        let n = self.slots.len() as u64;
        let slot = &mut self.slots[((id - 1) % n) as usize];
        (slot.id == id).then_some(slot)
    }
}

/// A rank's flight recorder; see the [module docs](self).
pub struct Recorder {
    ring: Mutex<Ring>,
    rank: usize,
    world_size: usize,
    host: String,
    run_id: String,
    attempt: Option<u32>,
    dir: Option<PathBuf>,
    heartbeat: Duration,
    announced: AtomicBool,
    write_failed: AtomicBool,
    /// Held by a dump, around its snapshot and write (two dumps of a rank
    /// share a file and its temporary name); by nothing else.
    dumping: Mutex<()>,
}

/// The live recorders of this process (several ranks may share one in
/// tests), for SIGUSR1.
static RECORDERS: Mutex<Vec<Weak<Recorder>>> = Mutex::new(Vec::new());
static SIGUSR1_THREAD: Once = Once::new();
/// Dumps of this process begun and not yet ended (the exit waits for
/// them).
static DUMPS_IN_PROGRESS: AtomicUsize = AtomicUsize::new(0);
static EXIT_WAIT: Once = Once::new();

fn empty_slot() -> Slot {
    Slot {
        id: 0,
        comm: 0,
        seq: 0,
        op: "",
        dtype: None,
        count: None,
        state: OpState::Enqueued,
        enqueued_us: 0,
        started_us: 0,
        ended_us: 0,
    }
}

impl Recorder {
    /// A recorder for world rank `rank` of `world_size` on `host`, whose
    /// communicators time out after `timeout`; `BRAID_FLIGHT_RECORDS` and
    /// `BRAID_LOG_DIR` are read here. Starts the process's SIGUSR1 thread.
    pub(crate) fn new(
        rank: usize,
        world_size: usize,
        host: String,
        run_id: &str,
        timeout: Duration,
    ) -> Result<Arc<Recorder>, String> {
        let capacity = format::records_from_env()?;
        let attempt = std::env::var(braid_core::env::BRAID_RESTART_COUNT)
            .ok()
            .and_then(|v| v.trim().parse().ok());
        let rec = Arc::new(Recorder {
            ring: Mutex::new(Ring {
                slots: vec![empty_slot(); capacity],
                next: 1,
                comms: Vec::new(),
            }),
            rank,
            world_size,
            host,
            run_id: run_id.to_string(),
            attempt,
            dir: format::log_dir_from_env(),
            heartbeat: format::heartbeat_interval(timeout),
            announced: AtomicBool::new(false),
            write_failed: AtomicBool::new(false),
            dumping: Mutex::new(()),
        });
        let mut live = RECORDERS.lock().unwrap_or_else(|p| p.into_inner());
        live.retain(|w| w.strong_count() > 0);
        live.push(Arc::downgrade(&rec));
        drop(live);
        SIGUSR1_THREAD.call_once(start_sigusr1_thread);
        if rec.dir.is_some() {
            EXIT_WAIT.call_once(register_exit_wait);
        }
        Ok(rec)
    }

    /// The ring, locked. What a dump relies on (see the module docs): the
    /// guard never leaves this module, and no critical section in it calls
    /// out — no I/O, no store, no wait on a peer or the GPU, no other lock
    /// taken —, it only copies or updates a few slots (a dump's snapshot:
    /// the whole ring, into memory). So the lock is never held by a thread
    /// blocked in a collective, and whoever takes it waits at most for one
    /// such copy.
    fn lock(&self) -> MutexGuard<'_, Ring> {
        self.ring.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers a communicator (`kind` `host` or `gpu`) of which this
    /// rank is `rank` of `size`; `world_ranks[r]` is the world rank of its
    /// rank `r`.
    pub(crate) fn register(
        self: &Arc<Self>,
        id: String,
        kind: &'static str,
        rank: usize,
        size: usize,
        world_ranks: Vec<usize>,
    ) -> CommFlight {
        let mut ring = self.lock();
        ring.comms.push(Track {
            id,
            kind,
            rank,
            size,
            world_ranks,
            last_completed: None,
            current: None,
        });
        CommFlight {
            rec: self.clone(),
            comm: (ring.comms.len() - 1) as u16,
        }
    }

    /// How often heartbeats are published.
    pub fn heartbeat_interval(&self) -> Duration {
        self.heartbeat
    }

    /// Where dumps go (`None`: nowhere, `BRAID_LOG_DIR` is not set).
    pub fn dir(&self) -> Option<&std::path::Path> {
        self.dir.as_deref()
    }

    /// This rank's records and communicators now. Heartbeats carry no
    /// records.
    pub fn snapshot(&self, kind: SnapshotKind, reason: Option<String>) -> Snapshot {
        let (slots, tracks) = {
            let ring = self.lock();
            let slots: Vec<Slot> = if kind == SnapshotKind::Dump && !ring.slots.is_empty() {
                let n = ring.slots.len();
                let start = ((ring.next - 1) % n as u64) as usize;
                ring.slots[start..]
                    .iter()
                    .chain(&ring.slots[..start])
                    .filter(|s| s.id != 0)
                    .copied()
                    .collect()
            } else {
                Vec::new()
            };
            let tracks: Vec<(String, CommInfo)> = ring
                .comms
                .iter()
                .map(|t| {
                    (
                        t.id.clone(),
                        CommInfo {
                            id: t.id.clone(),
                            kind: t.kind.into(),
                            rank: t.rank,
                            size: t.size,
                            world_ranks: if kind == SnapshotKind::Dump {
                                t.world_ranks.clone()
                            } else {
                                Vec::new()
                            },
                            last_completed: t.last_completed.map(|s| record(&t.id, &s)),
                            current: t.current.map(|s| record(&t.id, &s)),
                        },
                    )
                })
                .collect();
            (slots, tracks)
        };
        let records = slots
            .iter()
            .map(|s| record(&tracks[s.comm as usize].0, s))
            .collect();
        Snapshot {
            version: format::FORMAT_VERSION,
            kind,
            rank: self.rank,
            world_size: self.world_size,
            pid: std::process::id(),
            host: self.host.clone(),
            run_id: self.run_id.clone(),
            attempt: self.attempt,
            wall_us: format::now_us(),
            heartbeat_ms: self.heartbeat.as_millis() as u64,
            reason,
            observed: None,
            comms: tracks.into_iter().map(|(_, c)| c).collect(),
            records,
        }
    }

    /// Writes this rank's dump (`why`: a few words for the log line,
    /// `reason`: the full cause, kept in the file); returns its path, or
    /// `None` if it could not be written (said once on stderr) or there is
    /// no log directory (said on stderr when the dump was asked for).
    pub fn dump(&self, why: &str, reason: &str) -> Option<PathBuf> {
        let Some(dir) = &self.dir else {
            if matches!(why, "SIGUSR1" | "requested") {
                eprintln!(
                    "braid: rank {}: no flight record written: set {} to say where",
                    self.rank,
                    braid_core::env::BRAID_LOG_DIR
                );
            }
            return None;
        };
        let _counted = InProgress::begin();
        let _one_at_a_time = self.dumping.lock().unwrap_or_else(|p| p.into_inner());
        let path = format::dump_path(dir, self.rank, self.attempt);
        match self.write_dump(dir, &path, &format!("{why}: {reason}")) {
            Ok(()) => {
                if !self.announced.swap(true, Ordering::SeqCst) {
                    eprintln!(
                        "braid: rank {}: flight record ({why}) written to {}",
                        self.rank,
                        path.display()
                    );
                }
                Some(path)
            }
            Err(e) => {
                if !self.write_failed.swap(true, Ordering::SeqCst) {
                    eprintln!(
                        "braid: rank {}: cannot write the flight record to {}: {e}",
                        self.rank,
                        dir.display()
                    );
                }
                None
            }
        }
    }

    /// Writes a dump to `path` in `dir`: its temporary file first (the
    /// dump is seen begun), then the snapshot, then the file made whole.
    fn write_dump(&self, dir: &Path, path: &Path, reason: &str) -> std::io::Result<()> {
        std::fs::create_dir_all(dir)?;
        let mut file = braid_core::atomic_file::Pending::create(path)?;
        let json = self
            .snapshot(SnapshotKind::Dump, Some(reason.to_string()))
            .to_json();
        let (head, tail) = json.as_bytes().split_at(json.len() / 2);
        file.write_all(head)?;
        test_dump_delay(self.rank);
        file.write_all(tail)?;
        file.commit()
    }

    /// Publishes this rank's heartbeat to `store` (the run's prefix).
    pub fn publish_heartbeat(&self, store: &StoreClient) {
        let snap = self.snapshot(SnapshotKind::Heartbeat, None);
        let _ = store.set(&format::heartbeat_key(self.rank), snap.to_compact_json());
    }
}

fn record(comm: &str, s: &Slot) -> OpRecord {
    let opt = |v: u64| (v != 0).then_some(v);
    OpRecord {
        comm: comm.to_string(),
        seq: opt(s.seq),
        op: s.op.to_string(),
        dtype: s.dtype.map(|d| d.name().to_string()),
        count: s.count,
        state: s.state,
        enqueued_us: s.enqueued_us,
        started_us: opt(s.started_us),
        ended_us: opt(s.ended_us),
    }
}

/// Counts a dump in [`DUMPS_IN_PROGRESS`] while it lives.
struct InProgress;

impl InProgress {
    fn begin() -> InProgress {
        DUMPS_IN_PROGRESS.fetch_add(1, Ordering::SeqCst);
        InProgress
    }
}

impl Drop for InProgress {
    fn drop(&mut self) {
        DUMPS_IN_PROGRESS.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Makes the process's exit (`exit`, a return from `main`) wait for the
/// dumps being written, up to [`EXIT_WAITS_FOR_DUMP`]: a rank's main
/// thread that errors out of a collective the health monitor has just
/// aborted would otherwise end the process in the middle of the abort's
/// dump, or of one SIGUSR1 asked for. (A kill or `_exit` does not wait.)
fn register_exit_wait() {
    extern "C" fn wait_for_dumps() {
        let deadline = Instant::now().checked_add(EXIT_WAITS_FOR_DUMP);
        while DUMPS_IN_PROGRESS.load(Ordering::SeqCst) > 0 {
            if deadline.is_none_or(|d| Instant::now() >= d) {
                // Not eprintln!: it panics on a closed stderr, and a panic
                // must not unwind out of this C callback.
                use std::io::Write;
                let _ = writeln!(
                    std::io::stderr(),
                    "braid: exiting with a flight record still being written after {} s",
                    EXIT_WAITS_FOR_DUMP.as_secs()
                );
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    // SAFETY: `atexit` only stores the pointer; `wait_for_dumps` is a
    // plain function that takes no lock the exiting thread could hold (one
    // atomic, a clock, sleep and, at worst, one line on stderr, whose
    // error is ignored) and cannot unwind (nothing in it panics).
    let _ = unsafe { libc::atexit(wait_for_dumps) };
}

/// The test-only slowdown of this rank's dumps: `BRAID_TEST_DELAY`'s
/// `RANK:dump:MS` items (its other phases are braid-train's), a sleep of MS
/// milliseconds in the middle of writing each of rank RANK's flight
/// records (half of it written), as a slow disk would; a malformed `dump`
/// item is reported once and ignored.
fn test_dump_delay(rank: usize) {
    static DELAYS: OnceLock<Vec<(usize, u64)>> = OnceLock::new();
    let delays = DELAYS.get_or_init(|| {
        let Ok(v) = std::env::var(braid_core::env::BRAID_TEST_DELAY) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for item in v.split(',') {
            let parts: Vec<&str> = item.split(':').collect();
            if parts.get(1) != Some(&"dump") {
                continue;
            }
            let parsed = match parts.as_slice() {
                [r, _, ms] => r.parse().ok().zip(ms.parse().ok()),
                _ => None,
            };
            match parsed {
                Some(d) => out.push(d),
                None => eprintln!(
                    "braid: warning: ignoring BRAID_TEST_DELAY item {item:?} (want RANK:dump:MS)"
                ),
            }
        }
        out
    });
    for &(r, ms) in delays {
        if r == rank {
            std::thread::sleep(Duration::from_millis(ms));
        }
    }
}

/// Dumps every live recorder of the process on SIGUSR1, from a thread of
/// its own (the signal handler only wakes it). Chains to any handler the
/// program installed before.
fn start_sigusr1_thread() {
    let Ok(mut signals) = signal_hook::iterator::Signals::new([signal_hook::consts::SIGUSR1])
    else {
        return;
    };
    let _ = std::thread::Builder::new()
        .name("braid-flight-sigusr1".into())
        .spawn(move || {
            for _ in signals.forever() {
                let live: Vec<Arc<Recorder>> = RECORDERS
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .iter()
                    .filter_map(Weak::upgrade)
                    .collect();
                for rec in live {
                    rec.dump("SIGUSR1", "dump requested by signal SIGUSR1");
                }
            }
        });
}

/// One communicator's handle on its rank's recorder.
#[derive(Clone)]
pub(crate) struct CommFlight {
    rec: Arc<Recorder>,
    comm: u16,
}

impl CommFlight {
    pub(crate) fn recorder(&self) -> &Arc<Recorder> {
        &self.rec
    }

    /// The communicator's number in its rank's recorder (0: the world).
    pub(crate) fn comm_index(&self) -> u16 {
        self.comm
    }

    /// A new record of this communicator, issued at `now_us`.
    fn slot(
        &self,
        seq: u64,
        op: &'static str,
        dtype: Option<DType>,
        count: Option<u64>,
        now_us: u64,
    ) -> Slot {
        Slot {
            comm: self.comm,
            seq,
            op,
            dtype,
            count,
            enqueued_us: now_us,
            ..empty_slot()
        }
    }

    /// A host operation queued on the progress thread (not numbered yet).
    pub(crate) fn enqueue(&self, op: &'static str, dtype: Option<DType>, count: u64) -> u64 {
        let slot = self.slot(0, op, dtype, Some(count), format::now_us());
        self.rec.lock().push(slot)
    }

    /// Host operation #`seq` starts (`queued`: its id if it was queued).
    pub(crate) fn start(
        &self,
        queued: Option<u64>,
        seq: u64,
        op: &'static str,
        dtype: Option<DType>,
        count: u64,
    ) -> u64 {
        let now = format::now_us();
        let mut ring = self.rec.lock();
        let fresh = Slot {
            state: OpState::Started,
            started_us: now,
            ..self.slot(seq, op, dtype, Some(count), now)
        };
        let (id, slot) = match queued.map(|q| (q, ring.get_mut(q))) {
            Some((q, Some(s))) => {
                s.seq = seq;
                s.state = OpState::Started;
                s.started_us = now;
                (q, *s)
            }
            Some((q, None)) => (q, Slot { id: q, ..fresh }),
            None => {
                let id = ring.push(fresh);
                (id, Slot { id, ..fresh })
            }
        };
        ring.comms[self.comm as usize].current = Some(slot);
        id
    }

    /// Host operation `id` finished (`ok`) or failed.
    pub(crate) fn finish(&self, id: u64, ok: bool) {
        let now = format::now_us();
        let state = if ok {
            OpState::Completed
        } else {
            OpState::Failed
        };
        let mut ring = self.rec.lock();
        if let Some(s) = ring.get_mut(id) {
            s.state = state;
            s.ended_us = now;
        }
        let track = &mut ring.comms[self.comm as usize];
        if let Some(mut cur) = track.current.filter(|c| c.id == id) {
            cur.state = state;
            cur.ended_us = now;
            if ok {
                track.last_completed = Some(cur);
                track.current = None;
            } else {
                track.current = Some(cur);
            }
        }
    }

    /// A queued host operation that never ran (the communicator was
    /// aborted first).
    pub(crate) fn drop_queued(&self, id: u64) {
        let now = format::now_us();
        if let Some(s) = self.rec.lock().get_mut(id) {
            s.state = OpState::Failed;
            s.ended_us = now;
        }
    }

    /// GPU operation #`seq` queued on the device.
    pub(crate) fn gpu_enqueued(
        &self,
        seq: u64,
        op: &'static str,
        dtype: Option<DType>,
        count: Option<u64>,
    ) -> u64 {
        let slot = self.slot(seq, op, dtype, count, format::now_us());
        let mut ring = self.rec.lock();
        let id = ring.push(slot);
        ring.comms[self.comm as usize].current = Some(Slot { id, ..slot });
        id
    }

    /// GPU operation `id` (#`seq`) was seen complete: it and every earlier
    /// one of this communicator (one stream, completed in order) are
    /// marked completed.
    pub(crate) fn gpu_completed(&self, id: u64, seq: u64, op: &'static str) {
        let now = format::now_us();
        let mut ring = self.rec.lock();
        let n = ring.slots.len() as u64;
        let mut at = ring.next;
        while at > 1 && ring.next - at < n {
            at -= 1;
            let Some(s) = ring.get_mut(at) else { break };
            if s.comm != self.comm || s.seq > seq {
                continue;
            }
            if s.state != OpState::Enqueued {
                break; // Everything older was seen through already.
            }
            s.state = OpState::Completed;
            s.ended_us = now;
        }
        let done = ring.get_mut(id).copied().unwrap_or(Slot {
            id,
            state: OpState::Completed,
            ended_us: now,
            ..self.slot(seq, op, None, None, now)
        });
        let track = &mut ring.comms[self.comm as usize];
        if track.last_completed.is_none_or(|l| l.seq < seq) {
            track.last_completed = Some(done);
        }
        if track.current.is_some_and(|c| c.seq <= seq) {
            track.current = None;
        }
    }

    /// GPU operation `id` (#`seq`) failed (timed out, aborted, an error).
    pub(crate) fn gpu_failed(&self, id: u64, seq: u64, op: &'static str) {
        let now = format::now_us();
        let mut ring = self.rec.lock();
        let failed = match ring.get_mut(id) {
            Some(s) => {
                s.state = OpState::Failed;
                s.ended_us = now;
                *s
            }
            None => Slot {
                id,
                state: OpState::Failed,
                ended_us: now,
                ..self.slot(seq, op, None, None, now)
            },
        };
        ring.comms[self.comm as usize].current = Some(failed);
    }

    /// This communicator's records and its last completed and current
    /// operation.
    fn own_records(&self) -> (String, usize, Vec<usize>, Vec<OpRecord>) {
        let ring = self.rec.lock();
        let t = &ring.comms[self.comm as usize];
        let mut out: Vec<OpRecord> = ring
            .slots
            .iter()
            .filter(|s| s.id != 0 && s.comm == self.comm)
            .map(|s| record(&t.id, s))
            .collect();
        out.extend(t.last_completed.iter().map(|s| record(&t.id, s)));
        out.extend(t.current.iter().map(|s| record(&t.id, s)));
        (t.id.clone(), t.size, t.world_ranks.clone(), out)
    }
}

fn str_refs(keys: &[String]) -> Vec<&str> {
    keys.iter().map(String::as_str).collect()
}

/// What the diagnosis of a timed-out operation needs besides the
/// recorder.
pub(crate) struct Peers<'a> {
    /// This rank in the communicator.
    pub(crate) rank: usize,
    /// The run's store (heartbeats).
    pub(crate) run_store: &'a StoreClient,
    /// The communicator's store (who has left).
    pub(crate) comm_store: &'a StoreClient,
    /// This rank's host identity (peers on it are looked up in /proc).
    pub(crate) host: &'a str,
}

/// Up to this many ranks, every rank whose operation times out reads all
/// the others' heartbeats; in larger communicators one rank does (the
/// first to claim operation `seq`), and the others report its diagnosis
/// through the abort reason, so that a timeout does not turn into ranks²
/// store requests.
pub const DIAGNOSE_EVERYWHERE_UP_TO: usize = 64;

/// How long a rank that leaves the diagnosis to another waits for it to be
/// published (as the communicator's abort reason).
const WAIT_FOR_DIAGNOSIS: Duration = Duration::from_secs(5);

/// Reads the other ranks' heartbeats and says who operation #`seq`, which
/// just timed out on this rank, is waiting for, and why. `None` when
/// another rank of a large communicator diagnoses it (its reason is then
/// the communicator's abort reason, awaited here for a few seconds).
pub(crate) fn diagnose_timeout(flight: &CommFlight, peers: &Peers, seq: u64) -> Option<String> {
    let (comm, size, world_ranks, mine) = flight.own_records();
    if size > DIAGNOSE_EVERYWHERE_UP_TO {
        let claim = format!("diagnosis/{comm}/{seq}");
        let mine = peers
            .comm_store
            .compare_set(&claim, None, peers.rank.to_string().as_bytes())
            .map(|o| o.swapped)
            .unwrap_or(true);
        if !mine {
            let _ = peers
                .comm_store
                .get_timeout(crate::health::ABORT_KEY, WAIT_FOR_DIAGNOSIS);
            return None;
        }
    }
    let now = format::now_us();
    let mut inputs = vec![RankInput {
        rank: peers.rank,
        world_rank: world_ranks.get(peers.rank).copied(),
        known: true,
        records: mine,
        liveness: Liveness::Alive {
            heartbeat_age_s: Some(0.0),
        },
    }];
    // Which peers have a heartbeat, and which have left: one request each.
    let others: Vec<(usize, usize)> = world_ranks
        .iter()
        .copied()
        .enumerate()
        .take(size)
        .filter(|(r, _)| *r != peers.rank)
        .collect();
    let beat_keys: Vec<String> = others
        .iter()
        .map(|(_, w)| format::heartbeat_key(*w))
        .collect();
    let left_keys: Vec<String> = others
        .iter()
        .map(|(r, _)| crate::health::left_key(*r))
        .collect();
    let beating = peers
        .run_store
        .check(&str_refs(&beat_keys))
        .unwrap_or_else(|_| vec![true; others.len()]);
    let left = peers
        .comm_store
        .check(&str_refs(&left_keys))
        .unwrap_or_else(|_| vec![false; others.len()]);
    for (i, &(r, w)) in others.iter().enumerate() {
        let beat = beating[i]
            .then(|| peers.run_store.try_get(&beat_keys[i]).ok().flatten())
            .flatten()
            .and_then(|b| Snapshot::from_json(&b).ok());
        let Some(beat) = beat else {
            inputs.push(RankInput {
                rank: r,
                world_rank: Some(w),
                known: false,
                records: Vec::new(),
                liveness: if left[i] {
                    Liveness::Left
                } else {
                    Liveness::Unknown
                },
            });
            continue;
        };
        let process = if beat.pid == std::process::id() && beat.host == peers.host {
            ProcessState::Running
        } else if beat.host == peers.host {
            format::local_process_state(beat.pid)
        } else {
            ProcessState::Unknown
        };
        let age = Duration::from_micros(now.saturating_sub(beat.wall_us));
        let liveness = if left[i] {
            Liveness::Left
        } else {
            format::liveness(Some(age), beat.heartbeat_ms, process)
        };
        inputs.push(RankInput {
            rank: r,
            world_rank: Some(w),
            known: beat.comms.iter().any(|c| c.id == comm),
            records: beat.records_of(&comm),
            liveness,
        });
    }
    Some(format::diagnose(&comm, size, &inputs).summary)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn recorder() -> Arc<Recorder> {
        Recorder::new(0, 1, "h".into(), "unit", Duration::from_secs(5)).unwrap()
    }

    #[test]
    fn host_operations_go_from_queued_to_completed() {
        let rec = recorder();
        let f = rec.register("world".into(), "host", 0, 1, vec![0]);
        let q = f.enqueue("broadcast", Some(DType::F32), 8);
        let a = f.start(None, 1, "all_reduce", Some(DType::F32), 1024);
        f.finish(a, true);
        let b = f.start(Some(q), 2, "broadcast", Some(DType::F32), 8);
        assert_eq!(b, q);
        let s = rec.snapshot(SnapshotKind::Dump, None);
        assert_eq!(s.records.len(), 2);
        assert_eq!(s.records[0].op, "broadcast");
        assert_eq!(s.records[0].seq, Some(2));
        assert_eq!(s.records[0].state, OpState::Started);
        assert_eq!(s.records[1].state, OpState::Completed);
        assert_eq!(s.comms[0].current.as_ref().unwrap().label(), "broadcast #2");
        assert_eq!(
            s.comms[0].last_completed.as_ref().unwrap().describe(),
            "all_reduce #1 (1024 x f32)"
        );
        f.finish(b, false);
        let s = rec.snapshot(SnapshotKind::Heartbeat, None);
        assert!(s.records.is_empty());
        assert_eq!(s.comms[0].current.as_ref().unwrap().state, OpState::Failed);
    }

    #[test]
    fn gpu_completion_marks_everything_before_it() {
        let rec = recorder();
        let f = rec.register("world/gpu0".into(), "gpu", 0, 1, vec![0]);
        let ids: Vec<u64> = (1..=4)
            .map(|s| f.gpu_enqueued(s, "all_reduce", Some(DType::F32), Some(4)))
            .collect();
        f.gpu_completed(ids[2], 3, "all_reduce");
        let s = rec.snapshot(SnapshotKind::Dump, None);
        let states: Vec<OpState> = s.records.iter().map(|r| r.state).collect();
        assert_eq!(
            states,
            [
                OpState::Completed,
                OpState::Completed,
                OpState::Completed,
                OpState::Enqueued
            ]
        );
        assert_eq!(s.comms[0].last_completed.as_ref().unwrap().seq, Some(3));
        assert_eq!(s.comms[0].current.as_ref().unwrap().seq, Some(4));
        f.gpu_failed(ids[3], 4, "all_reduce");
        let s = rec.snapshot(SnapshotKind::Heartbeat, None);
        assert_eq!(s.comms[0].current.as_ref().unwrap().state, OpState::Failed);
    }

    fn with_capacity(n: usize) -> Arc<Recorder> {
        Arc::new(Recorder {
            ring: Mutex::new(Ring {
                slots: vec![empty_slot(); n],
                next: 1,
                comms: Vec::new(),
            }),
            rank: 0,
            world_size: 1,
            host: "h".into(),
            run_id: "unit".into(),
            attempt: None,
            dir: None,
            heartbeat: Duration::from_secs(1),
            announced: AtomicBool::new(false),
            write_failed: AtomicBool::new(false),
            dumping: Mutex::new(()),
        })
    }

    #[test]
    fn dumps_at_once_are_written_one_at_a_time_under_the_attempts_name() {
        let dir = std::env::temp_dir().join(format!("braid-comm-dumps-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let rec = Arc::new(Recorder {
            dir: Some(dir.clone()),
            attempt: Some(2),
            rank: 5,
            ..Arc::into_inner(with_capacity(64)).unwrap()
        });
        let f = rec.register("world".into(), "host", 0, 1, vec![5]);
        for seq in 1..=40 {
            let id = f.start(None, seq, "all_reduce", Some(DType::F32), 8);
            f.finish(id, true);
        }
        // Two dumps of a rank share a file and its temporary: four at
        // once (SIGUSR1, an abort, ...) must each leave it whole.
        let paths: Vec<Option<PathBuf>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..4)
                .map(|i| {
                    let rec = &rec;
                    s.spawn(move || rec.dump("requested", &format!("test {i}")))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let expected = dir.join("flight-rank00005-attempt3.json");
        assert!(
            paths.iter().all(|p| p.as_ref() == Some(&expected)),
            "{paths:?}"
        );
        let snap = Snapshot::from_json(&std::fs::read(&expected).unwrap()).unwrap();
        assert_eq!((snap.rank, snap.attempt), (5, Some(2)));
        assert_eq!(snap.records.len(), 40);
        assert!(snap.reason.unwrap().starts_with("requested: test "));
        let names: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            names,
            ["flight-rank00005-attempt3.json"],
            "no temporary left"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_ring_keeps_the_last_records_in_order() {
        let rec = with_capacity(3);
        let f = rec.register("world".into(), "host", 0, 1, vec![0]);
        for seq in 1..=5 {
            let id = f.start(None, seq, "barrier", None, 0);
            f.finish(id, true);
        }
        let seqs: Vec<Option<u64>> = rec
            .snapshot(SnapshotKind::Dump, None)
            .records
            .iter()
            .map(|r| r.seq)
            .collect();
        assert_eq!(seqs, [Some(3), Some(4), Some(5)]);
        // An empty ring still tracks the last and current operation.
        let none = with_capacity(0);
        let f = none.register("world".into(), "host", 0, 1, vec![0]);
        let id = f.start(None, 9, "barrier", None, 0);
        f.finish(id, true);
        let s = none.snapshot(SnapshotKind::Dump, None);
        assert!(s.records.is_empty());
        assert_eq!(s.comms[0].last_completed.as_ref().unwrap().seq, Some(9));
    }
}
