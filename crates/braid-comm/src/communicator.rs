//! [`Communicator`]: the one collective API of braid.
//!
//! A communicator is a group of ranks with a backend. Every operation is
//! numbered; operations run one at a time and complete in the order they
//! were issued, whether blocking (the methods in [`crate::api`]) or
//! asynchronous (inside [`Communicator::scope`]). A failure that involves
//! another rank (a timeout, a dead peer) aborts the communicator on every
//! rank with the same reason. Every operation is recorded in the rank's
//! flight recorder ([`crate::flight`]); a timeout's error names the rank
//! it waits for from the others' heartbeats.

use crate::backend::{Backend, Ctx};
use crate::debug::{self, OpDesc, DESC_LEN};
use crate::error::{CommError, Result};
use crate::flight::{self, CommFlight, Recorder};
use crate::health::{self, Health};
use crate::setup::{self, BackendKind, PeerInfo, SetupCtx};
use crate::work::Progress;
use braid_core::{DType, WorldInfo};
use braid_store::{StoreClient, WorkerStore};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The name of a descriptor's operation.
fn op_name(desc: &OpDesc) -> &'static str {
    debug::OP_NAMES
        .get(desc.op as usize)
        .copied()
        .unwrap_or("operation")
}

/// Records host collective `name` (run from `started` until now) as a
/// trace span on its communicator's track, with its bytes (each rank's
/// buffer) and bandwidths in nccl-tests' convention.
fn trace_op(inner: &Inner, desc: &OpDesc, name: &'static str, started: Instant) {
    let end = Instant::now();
    let secs = end
        .saturating_duration_since(started)
        .as_secs_f64()
        .max(1e-9);
    let dtype = DType::from_code(desc.dtype);
    let bytes = desc.count * dtype.map_or(1, |d| d.size()) as u64;
    let algbw = bytes as f64 / secs / 1e9;
    let busbw = algbw * braid_trace::analysis::busbw_factor(name, inner.size);
    braid_trace::recorder::record_between(
        name,
        braid_trace::Cat::Comm,
        braid_trace::recorder::track::COLLECTIVES + inner.flight.comm_index() as u32 * 100,
        started,
        end,
        vec![
            ("bytes", bytes.into()),
            ("count", desc.count.into()),
            ("dtype", dtype.map_or("-", |d| d.name()).into()),
            ("seq", desc.seq.into()),
            ("comm", (inner.flight.comm_index() as u64).into()),
            ("ranks", (inner.size as u64).into()),
            ("algbw_GBps", algbw.into()),
            ("busbw_GBps", busbw.into()),
        ],
    );
}

/// Default timeout of every operation (`BRAID_TIMEOUT` overrides).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// How to create a communicator explicitly.
#[derive(Debug, Clone)]
pub struct CommOptions {
    /// Timeout of every operation and of setup.
    pub timeout: Duration,
    /// Backend choice.
    pub backend: BackendKind,
    /// Check that all ranks call the same operations (`BRAID_DEBUG=detail`).
    pub debug: bool,
    /// Run id (names shared-memory segments).
    pub run_id: String,
    /// Overrides this rank's host identity (ranks with equal identities
    /// share memory); `BRAID_HOST_ID` does the same from the environment.
    pub host_id: Option<String>,
    /// Bytes per shared-memory slot half (`BRAID_SHM_HALF`).
    pub shm_half: Option<usize>,
}

impl CommOptions {
    /// Defaults overridden by `BRAID_TIMEOUT`, `BRAID_BACKEND`, `BRAID_DEBUG`.
    pub fn from_env() -> Result<CommOptions> {
        let timeout = WorldInfo::timeout_from_env(DEFAULT_TIMEOUT)
            .map_err(|e| CommError::Setup(e.to_string()))?;
        let backend = BackendKind::from_env().map_err(CommError::Setup)?;
        let debug = matches!(
            std::env::var(braid_core::env::BRAID_DEBUG).as_deref(),
            Ok("detail") | Ok("DETAIL") | Ok("1")
        );
        let run_id =
            std::env::var(braid_core::env::BRAID_RUN_ID).unwrap_or_else(|_| "local".into());
        Ok(CommOptions {
            timeout,
            backend,
            debug,
            run_id,
            host_id: None,
            shm_half: None,
        })
    }
}

pub(crate) struct Exec {
    pub(crate) backend: Box<dyn Backend>,
}

pub(crate) struct Inner {
    pub(crate) rank: usize,
    pub(crate) size: usize,
    pub(crate) id: String,
    pub(crate) exec: Mutex<Exec>,
    pub(crate) seq: AtomicU64,
    pub(crate) health: Arc<Health>,
    /// Store seen through the run's prefix (sub-communicators are created
    /// under it).
    pub(crate) run_store: StoreClient,
    /// Store seen through this communicator's prefix.
    pub(crate) store: StoreClient,
    pub(crate) options: CommOptions,
    pub(crate) backend_name: &'static str,
    pub(crate) progress: Progress,
    pub(crate) splits: AtomicU64,
    /// GPU communicators made from this one (numbers their NCCL id keys).
    pub(crate) gpu_inits: AtomicU64,
    /// GPU communicators registered with the flight recorder (names them).
    pub(crate) gpu_flights: AtomicU64,
    /// This communicator in the rank's flight recorder.
    pub(crate) flight: CommFlight,
    /// The world rank of each rank.
    pub(crate) world_ranks: Vec<usize>,
    /// This rank's host identity.
    pub(crate) host: String,
    /// Keeps rank 0's store server alive when it hosts one.
    pub(crate) _worker_store: Option<WorkerStore>,
}

/// The longest the rank serving the store waits, at its communicator's
/// end, for the other ranks to leave (less where the operations' timeout
/// is shorter).
const DEPARTURES_WAIT: Duration = Duration::from_secs(60);

impl Drop for Inner {
    fn drop(&mut self) {
        // Tell the other ranks' monitors that this rank is leaving cleanly.
        if !self.health.is_aborted() {
            let _ = self.store.set(&health::left_key(self.rank), b"1");
            if self._worker_store.is_some() {
                self.wait_for_departures();
            }
        }
        self.health.stop_monitor();
    }
}

impl Inner {
    /// On the rank whose process serves the store: waits until every other
    /// rank has left cleanly (its `left` key set), the communicator is
    /// aborted (a peer died: the monitor still runs) or the wait's limit
    /// passes. The other ranks' monitors tell a rank that finished and
    /// exited from one that died by reading its departure from the store:
    /// were the store gone first, a rank still finishing its last
    /// collective would take a finished peer for a dead one.
    fn wait_for_departures(&self) {
        let keys: Vec<String> = (0..self.size)
            .filter(|&r| r != self.rank)
            .map(health::left_key)
            .collect();
        let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
        let deadline = Instant::now() + self.options.timeout.min(DEPARTURES_WAIT);
        loop {
            let missing: Vec<usize> = match self.store.check(&keys) {
                Ok(present) => (0..self.size)
                    .filter(|&r| r != self.rank)
                    .zip(present)
                    .filter_map(|(r, there)| (!there).then_some(r))
                    .collect(),
                Err(_) => return,
            };
            if missing.is_empty() || self.health.is_aborted() {
                return;
            }
            if Instant::now() >= deadline {
                eprintln!(
                    "braid: rank {}: leaving without rank(s) {missing:?} having left the \
                     communicator after {:?} (the store this rank serves closes now; they may \
                     report it gone)",
                    self.rank,
                    self.options.timeout.min(DEPARTURES_WAIT)
                );
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// A group of ranks that run collectives together. Cheap to clone.
///
/// Every rank must issue the same operations in the same order; issue them
/// from one thread per communicator (as with NCCL), or the order in which
/// two threads' operations interleave may differ between ranks.
#[derive(Clone)]
pub struct Communicator {
    pub(crate) inner: Arc<Inner>,
}

/// A handle on a [`Communicator`] that does not keep it alive: a watcher
/// (a signal handler's thread) holds one, so that the communicator still
/// ends — and announces its rank's clean departure — when its users drop
/// it.
#[derive(Clone)]
pub struct WeakCommunicator {
    inner: std::sync::Weak<Inner>,
}

impl WeakCommunicator {
    /// The communicator, if it has not ended.
    pub fn upgrade(&self) -> Option<Communicator> {
        self.inner.upgrade().map(|inner| Communicator { inner })
    }
}

impl Communicator {
    /// Joins the world described by the environment that `braid launch`,
    /// torchrun or SLURM set (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, ...).
    pub fn init_from_env() -> Result<Communicator> {
        Self::init_from_env_with(CommOptions::from_env()?)
    }

    /// [`init_from_env`](Self::init_from_env) with explicit options (the run
    /// id still comes from the launcher when it gives one). When this rank
    /// hosts the store (rank 0, no launcher), dropping the communicator
    /// waits, bounded, for the other ranks to disconnect.
    pub fn init_from_env_with(mut options: CommOptions) -> Result<Communicator> {
        let world = WorldInfo::from_env().map_err(|e| CommError::Setup(e.to_string()))?;
        let store = WorkerStore::from_env(&world).map_err(|e| CommError::Setup(e.to_string()))?;
        if let Some(id) = &world.run_id {
            options.run_id = id.clone();
        }
        let run_store = store
            .client
            .reconnect()
            .map_err(|e| CommError::Setup(e.to_string()))?;
        Self::create(
            world.rank,
            world.world_size,
            run_store,
            "world",
            options,
            Some(store),
            None,
        )
    }

    /// Joins a world explicitly: `store` is a client of the job's store (its
    /// prefix separates this job from others), `rank` and `size` say who is
    /// who. Every rank must call this with the same `size`.
    pub fn init(
        rank: usize,
        size: usize,
        store: StoreClient,
        options: CommOptions,
    ) -> Result<Communicator> {
        Self::create(rank, size, store, "world", options, None, None)
    }

    /// Creates a communicator; `parent` is the recorder of the world it
    /// splits from and the world rank of each of its ranks (`None`: this
    /// is a world, with a recorder of its own).
    pub(crate) fn create(
        rank: usize,
        size: usize,
        run_store: StoreClient,
        id: &str,
        options: CommOptions,
        worker_store: Option<WorkerStore>,
        parent: Option<(Arc<Recorder>, Vec<usize>)>,
    ) -> Result<Communicator> {
        if size == 0 || rank >= size {
            return Err(CommError::Setup(format!(
                "rank {rank} is not below world size {size}"
            )));
        }
        let store = run_store.with_prefix(&format!("comm/{id}/"));
        let mut me = PeerInfo::local(&store);
        if let Some(h) = &options.host_id {
            me.host = h.clone();
        }
        let peers = setup::exchange_peers(&store, rank, size, &me, options.timeout)?;
        let kind = setup::choose(options.backend, &peers)?;
        let ctx = SetupCtx {
            rank,
            peers: &peers,
            store: &store,
            id,
            run_id: &options.run_id,
            timeout: options.timeout,
            shm_half: options.shm_half,
        };
        let backend = setup::build(kind, &ctx)?;
        let backend_name = backend.name();
        let is_world = parent.is_none();
        let (recorder, world_ranks) = match parent {
            Some(p) => p,
            None => (
                Recorder::new(
                    rank,
                    size,
                    me.host.clone(),
                    &options.run_id,
                    options.timeout,
                )
                .map_err(CommError::Setup)?,
                (0..size).collect(),
            ),
        };
        let flight = recorder.register(id.to_string(), "host", rank, size, world_ranks.clone());
        let health = Arc::new(Health::default());
        health.set_flight(recorder.clone());
        if let Ok(monitor_run_store) = run_store.reconnect() {
            // The world's monitor publishes the rank's heartbeat (every
            // communicator of the rank is in it).
            let periodic: Option<health::Periodic> = is_world.then(|| {
                let rec = recorder.clone();
                let beat_store = monitor_run_store.with_prefix("");
                let beat: Box<dyn FnMut() + Send> =
                    Box::new(move || rec.publish_heartbeat(&beat_store));
                (recorder.heartbeat_interval(), beat)
            });
            health::spawn_monitor_with(
                health.clone(),
                monitor_run_store.with_prefix(&format!("comm/{id}/")),
                setup::local_peers(rank, &peers),
                rank,
                me.host.clone(),
                periodic,
            );
        }
        let inner = Arc::new(Inner {
            rank,
            size,
            id: id.to_string(),
            exec: Mutex::new(Exec { backend }),
            seq: AtomicU64::new(0),
            health,
            run_store,
            store,
            options,
            backend_name,
            progress: Progress::default(),
            splits: AtomicU64::new(0),
            gpu_inits: AtomicU64::new(0),
            gpu_flights: AtomicU64::new(0),
            flight,
            world_ranks,
            host: me.host,
            _worker_store: worker_store,
        });
        Ok(Communicator { inner })
    }

    /// This rank, `0..size`.
    pub fn rank(&self) -> usize {
        self.inner.rank
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.inner.size
    }

    /// A connection of this rank's own to the job's store (under the
    /// communicator's key prefix), for bookkeeping beside the
    /// collectives (trace files written, clock offsets). The store lives
    /// as long as the job's launcher, or as rank 0's communicator where
    /// rank 0 hosts it.
    pub fn store_client(&self) -> std::result::Result<StoreClient, String> {
        self.inner.store.reconnect().map_err(|e| e.to_string())
    }

    /// Backend in use: `shm`, `tcp` or `hier`.
    pub fn backend_name(&self) -> &'static str {
        self.inner.backend_name
    }

    /// Communicator id, unique within the run (`world`, `world.s0c1`, ...).
    pub fn id(&self) -> &str {
        &self.inner.id
    }

    /// Timeout of each operation.
    pub fn timeout(&self) -> Duration {
        self.inner.options.timeout
    }

    /// Why the communicator was aborted (a dead peer, another rank's
    /// failure), or `None` while it is healthy: what a wait on work this
    /// communicator does not see (a GPU stream) checks between polls.
    pub fn aborted(&self) -> Option<String> {
        self.inner
            .health
            .is_aborted()
            .then(|| self.inner.health.reason())
    }

    /// A handle that does not keep the communicator alive.
    pub fn downgrade(&self) -> WeakCommunicator {
        WeakCommunicator {
            inner: Arc::downgrade(&self.inner),
        }
    }

    /// Aborts the communicator on every rank with `reason`.
    pub fn abort(&self, reason: &str) {
        let reason = health::publish_abort(
            &self.inner.store,
            &format!("rank {}: {reason}", self.inner.rank),
        );
        self.inner.health.abort(reason);
    }

    /// Runs one operation: waits for earlier asynchronous operations, checks
    /// consistency in debug mode, and turns failures involving peers into an
    /// abort every rank sees.
    pub(crate) fn run_op(
        &self,
        desc: OpDesc,
        f: impl FnOnce(&mut dyn Backend, &Ctx) -> Result<()>,
    ) -> Result<()> {
        self.inner.progress.wait_idle();
        self.execute(desc, f)
    }

    /// Under `BRAID_DEBUG=detail`, checks that every rank is about to make
    /// the same call `desc` (exchanged over this communicator); on a
    /// mismatch every rank gets the same report and the communicator is
    /// aborted, as for its own operations. A no-op otherwise. The GPU
    /// communicator checks its operations this way.
    pub(crate) fn check_same_call(&self, desc: OpDesc) -> Result<()> {
        let inner = &self.inner;
        if !inner.options.debug || inner.size <= 1 {
            return Ok(());
        }
        let mut all = vec![0u8; DESC_LEN * inner.size];
        self.all_gather(&desc.encode(), &mut all)?;
        let descs: Vec<OpDesc> = all.chunks_exact(DESC_LEN).map(OpDesc::decode).collect();
        match debug::compare(&descs, inner.rank) {
            None => Ok(()),
            Some(report) => {
                let standing = health::publish_abort(&inner.store, &report);
                inner.health.abort(standing);
                Err(CommError::Mismatch(report))
            }
        }
    }

    /// Runs an operation on the calling thread.
    pub(crate) fn execute(
        &self,
        desc: OpDesc,
        f: impl FnOnce(&mut dyn Backend, &Ctx) -> Result<()>,
    ) -> Result<()> {
        self.execute_queued(desc, None, f)
    }

    /// Records an operation about to be queued on the progress thread;
    /// the id goes to [`execute_queued`](Self::execute_queued).
    pub(crate) fn record_queued(&self, desc: &OpDesc) -> u64 {
        self.inner
            .flight
            .enqueue(op_name(desc), DType::from_code(desc.dtype), desc.count)
    }

    /// Runs an operation on the calling thread (the progress thread calls
    /// this for queued operations, with the id `record_queued` gave).
    pub(crate) fn execute_queued(
        &self,
        mut desc: OpDesc,
        queued: Option<u64>,
        f: impl FnOnce(&mut dyn Backend, &Ctx) -> Result<()>,
    ) -> Result<()> {
        let inner = &self.inner;
        let name = op_name(&desc);
        // An NVTX range around the operation, for Nsight (where attached).
        let _range = braid_trace::nvtx::range(|| format!("{name} {}", desc.count));
        if inner.health.is_aborted() {
            if let Some(id) = queued {
                inner.flight.drop_queued(id);
            }
            return Err(CommError::Aborted {
                rank: inner.rank,
                reason: inner.health.reason(),
            });
        }
        let mut exec = inner.exec.lock().unwrap_or_else(|p| p.into_inner());
        let seq = inner.seq.fetch_add(1, Ordering::SeqCst) + 1;
        desc.seq = seq;
        let record =
            inner
                .flight
                .start(queued, seq, name, DType::from_code(desc.dtype), desc.count);
        let started = Instant::now();
        let ctx = Ctx {
            rank: inner.rank,
            op: name,
            seq,
            started,
            deadline: started + inner.options.timeout,
            health: &inner.health,
        };
        let result = (|| {
            if inner.options.debug && inner.size > 1 {
                let mine = desc.encode();
                let mut all = vec![0u8; DESC_LEN * inner.size];
                let counts = vec![DESC_LEN; inner.size];
                exec.backend.all_gather_v(&ctx, &mine, &mut all, &counts)?;
                let descs: Vec<OpDesc> = all.chunks_exact(DESC_LEN).map(OpDesc::decode).collect();
                if let Some(report) = debug::compare(&descs, inner.rank) {
                    return Err(CommError::Mismatch(report));
                }
            }
            f(exec.backend.as_mut(), &ctx)
        })();
        inner.flight.finish(record, result.is_ok());
        if braid_trace::recorder::active() {
            trace_op(inner, &desc, name, started);
        }
        let mut result = result;
        if let Err(CommError::Timeout { diagnosis, .. }) = &mut result {
            *diagnosis = self.diagnose_timeout(seq);
        }
        if let Err(e) = &result {
            if matches!(
                e,
                CommError::Timeout { .. } | CommError::PeerFailed { .. } | CommError::Mismatch(_)
            ) {
                // The first failure any rank reported is the root cause; a
                // rank that only saw its consequence (a neighbour leaving)
                // reports that root cause.
                let mine = e.to_string();
                let standing = health::publish_abort(&inner.store, &mine);
                inner.health.abort(standing.clone());
                if standing != mine && !matches!(e, CommError::Mismatch(_)) {
                    return Err(CommError::Aborted {
                        rank: inner.rank,
                        reason: format!("{standing} (first failure; this rank then saw: {mine})"),
                    });
                }
            }
        }
        result
    }

    /// Who this rank's timed-out operation #`seq` waits for, from the
    /// other ranks' heartbeats (`None`: another rank diagnoses it).
    pub(crate) fn diagnose_timeout(&self, seq: u64) -> Option<String> {
        self.diagnose_timeout_of(&self.inner.flight, seq)
    }

    /// [`diagnose_timeout`](Self::diagnose_timeout) for a communicator
    /// made from this one (a GPU communicator: the same ranks).
    pub(crate) fn diagnose_timeout_of(&self, comm: &CommFlight, seq: u64) -> Option<String> {
        let inner = &self.inner;
        flight::diagnose_timeout(
            comm,
            &flight::Peers {
                rank: inner.rank,
                run_store: &inner.run_store,
                comm_store: &inner.store,
                host: &inner.host,
            },
            seq,
        )
    }

    /// This rank's flight record now: the last operations of every
    /// communicator of this rank (the world, its splits, GPU communicators
    /// made from them) and where the rank is in each.
    pub fn flight_record(&self) -> braid_core::flight::Snapshot {
        self.inner
            .flight
            .recorder()
            .snapshot(braid_core::flight::SnapshotKind::Dump, None)
    }

    /// Writes this rank's flight record to the log directory
    /// (`BRAID_LOG_DIR`) now, as SIGUSR1 does; returns its path.
    pub fn dump_flight_record(&self, reason: &str) -> Option<std::path::PathBuf> {
        self.inner.flight.recorder().dump("requested", reason)
    }

    /// Splits into sub-communicators: ranks passing the same `color` form
    /// one, ordered by `key` (then by rank); `None` joins none (like
    /// `MPI_UNDEFINED`). Every rank must call it.
    pub fn split(&self, color: Option<u32>, key: i64) -> Result<Option<Communicator>> {
        let n = self.inner.splits.fetch_add(1, Ordering::SeqCst);
        let mut mine = [0u8; 16];
        if let Some(c) = color {
            mine[0] = 1;
            mine[4..8].copy_from_slice(&c.to_le_bytes());
        }
        mine[8..16].copy_from_slice(&key.to_le_bytes());
        let mut all = vec![0u8; 16 * self.size()];
        self.all_gather_bytes(&mine, &mut all)?;
        let Some(color) = color else { return Ok(None) };
        let mut members: Vec<(i64, usize)> = all
            .chunks_exact(16)
            .enumerate()
            .filter(|(_, c)| {
                c[0] == 1 && u32::from_le_bytes(c[4..8].try_into().expect("4")) == color
            })
            .map(|(r, c)| (i64::from_le_bytes(c[8..16].try_into().expect("8")), r))
            .collect();
        members.sort();
        let new_rank = members
            .iter()
            .position(|(_, r)| *r == self.rank())
            .expect("this rank has this color");
        let id = format!("{}.s{n}c{color}", self.inner.id);
        let store = self
            .inner
            .run_store
            .reconnect()
            .map_err(|e| CommError::Setup(e.to_string()))?;
        let world_ranks = members
            .iter()
            .map(|(_, r)| self.inner.world_ranks[*r])
            .collect();
        Self::create(
            new_rank,
            members.len(),
            store,
            &id,
            self.inner.options.clone(),
            None,
            Some((self.inner.flight.recorder().clone(), world_ranks)),
        )
        .map(Some)
    }
}
