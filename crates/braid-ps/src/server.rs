//! A parameter server process's network side: a TCP listener, a thread per
//! worker connection, and the shard's state ([`ShardState`]) behind one
//! lock. A request that must wait (a synchronous step's other workers, the
//! slowest worker under bounded staleness, the initial parameters) waits
//! on a condition variable, bounded by the run's timeout, and answers with
//! an error naming what never came.
//!
//! The server ends when every worker has said goodbye; a worker whose
//! connection closes without one is marked gone, and one that connects
//! again with its rank takes its place.

use crate::consistency::{Mode, UpdateAt};
use crate::shard_state::{Answer, Presence, ShardState, Snapshot, Staleness};
use crate::wire::{Encoding, Frame, Kind};
use braid_model::optim::Optimizer;
use std::io::{BufReader, BufWriter};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// What a server is set up with.
pub struct ServerConfig {
    /// This server's index among the servers.
    pub index: usize,
    /// The workers of the run.
    pub workers: usize,
    /// The flat buffer's length (checked against each worker's).
    pub len: usize,
    /// This server's elements of the flat buffer.
    pub shard: Range<usize>,
    pub mode: Mode,
    pub update_at: UpdateAt,
    /// The optimizer over the shard's elements (compact), where servers
    /// update.
    pub optimizer: Option<Optimizer>,
    /// What must agree between the workers and the servers (the model,
    /// the mode); a worker that differs is refused, named.
    pub description: String,
    /// The bound of every wait.
    pub timeout: Duration,
    /// The state to start from (a server restarted from a checkpoint).
    pub restored: Option<Snapshot>,
    /// Asynchronous and bounded-staleness updates: the momentum and
    /// learning rate following the pushes' staleness (`None`: as given).
    pub compensation: Option<crate::Adaptive>,
}

/// What a server did, for the run's summary.
#[derive(Debug, Clone, Default)]
pub struct ServerReport {
    pub index: usize,
    /// Updates applied (synchronous: steps).
    pub version: u64,
    /// The staleness of the pushes applied, and per worker.
    pub staleness: Staleness,
    pub per_worker: Vec<Staleness>,
    /// Seconds in optimizer updates.
    pub update_s: f64,
    /// Gradient bytes received.
    pub pushed_bytes: u64,
    /// Workers whose connection closed without a goodbye and did not come
    /// back.
    pub gone: Vec<usize>,
    /// The staleness compensation at the end: the staleness's moving
    /// average, and the momentum and learning-rate scale it gave.
    pub compensation: Option<(f64, crate::Compensation)>,
}

struct Shared {
    state: ShardState,
    /// The first fatal error of a connection (the run cannot go on).
    failed: Option<String>,
}

type Guarded = Arc<(Mutex<Shared>, Condvar)>;

/// A bound, not yet running, parameter server.
pub struct Server {
    listener: TcpListener,
    cfg: Arc<ServerConfig>,
    shared: Guarded,
}

fn lock(s: &Guarded) -> MutexGuard<'_, Shared> {
    // A handler that panicked leaves the state as it was at its last
    // complete request.
    s.0.lock().unwrap_or_else(|p| p.into_inner())
}

impl Server {
    /// Binds `addr` (`host:port`, port 0 for any) for `cfg`'s shard.
    pub fn bind(addr: &str, mut cfg: ServerConfig) -> Result<Server, String> {
        let listener = TcpListener::bind(addr).map_err(|e| {
            format!(
                "parameter server {}: cannot listen on {addr}: {e}{}",
                cfg.index,
                if e.kind() == std::io::ErrorKind::AddrInUse {
                    " (the port is in use: pick another, or 0 for any free one)"
                } else {
                    ""
                }
            )
        })?;
        let mut state = ShardState::new(
            cfg.mode,
            cfg.update_at,
            cfg.workers,
            cfg.shard.len(),
            cfg.optimizer.take(),
        )?;
        state.compensate(cfg.compensation.take());
        if let Some(snap) = cfg.restored.take() {
            state.restore(snap)?;
        }
        Ok(Server {
            listener,
            cfg: Arc::new(cfg),
            shared: Arc::new((
                Mutex::new(Shared {
                    state,
                    failed: None,
                }),
                Condvar::new(),
            )),
        })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> Result<SocketAddr, String> {
        self.listener.local_addr().map_err(|e| e.to_string())
    }

    /// Serves until every worker has said goodbye, a connection fails the
    /// run, or no worker has been connected for the timeout.
    pub fn run(self) -> Result<ServerReport, String> {
        let stop = Arc::new(AtomicBool::new(false));
        self.listener
            .set_nonblocking(true)
            .map_err(|e| format!("parameter server {}: {e}", self.cfg.index))?;
        let acceptor = {
            let (listener, cfg, shared, stop) = (
                self.listener,
                self.cfg.clone(),
                self.shared.clone(),
                stop.clone(),
            );
            std::thread::Builder::new()
                .name(format!("ps{}-accept", cfg.index))
                .spawn(move || accept_loop(listener, cfg, shared, stop))
                .map_err(|e| e.to_string())?
        };
        let result = wait_until_done(&self.cfg, &self.shared);
        stop.store(true, Ordering::SeqCst);
        let _ = acceptor.join();
        result
    }
}

/// Waits until every worker has said goodbye (the report), a connection
/// failed the run, or no worker has been connected for the timeout.
fn wait_until_done(cfg: &ServerConfig, shared: &Guarded) -> Result<ServerReport, String> {
    let mut g = lock(shared);
    let mut alone_since = Instant::now();
    loop {
        if let Some(e) = &g.failed {
            return Err(format!("parameter server {}: {e}", cfg.index));
        }
        if g.state.all_done() {
            return Ok(report(cfg.index, &g.state));
        }
        let live = (0..cfg.workers).any(|w| g.state.presence(w) == Presence::Live);
        if live {
            alone_since = Instant::now();
        } else if alone_since.elapsed() > cfg.timeout {
            let waiting: Vec<String> = (0..cfg.workers)
                .filter(|w| g.state.presence(*w) != Presence::Done)
                .map(|w| format!("{w}"))
                .collect();
            return Err(format!(
                "parameter server {}: no worker connected for {} s; worker(s) {} never said \
                     goodbye",
                cfg.index,
                cfg.timeout.as_secs(),
                waiting.join(", ")
            ));
        }
        g = shared
            .1
            .wait_timeout(g, Duration::from_millis(200))
            .unwrap_or_else(|p| p.into_inner())
            .0;
    }
}

fn report(index: usize, s: &ShardState) -> ServerReport {
    let (all, per) = s.staleness();
    let (update_s, pushed_bytes) = s.work();
    ServerReport {
        index,
        version: s.version(),
        staleness: all.clone(),
        per_worker: per.to_vec(),
        update_s,
        pushed_bytes,
        gone: (0..s.workers())
            .filter(|w| matches!(s.presence(*w), Presence::Gone(_)))
            .collect(),
        compensation: s.compensation(),
    }
}

fn accept_loop(
    listener: TcpListener,
    cfg: Arc<ServerConfig>,
    shared: Guarded,
    stop: Arc<AtomicBool>,
) {
    while !stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((stream, peer)) => {
                let (cfg, shared) = (cfg.clone(), shared.clone());
                let _ = std::thread::Builder::new()
                    .name(format!("ps{}-conn", cfg.index))
                    .spawn(move || {
                        connection(stream, peer, &cfg, &shared);
                    });
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(10))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

/// One worker's connection, from its hello to its goodbye.
fn connection(stream: TcpStream, peer: SocketAddr, cfg: &ServerConfig, shared: &Guarded) {
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_nodelay(true);
    let _ = stream.set_read_timeout(Some(cfg.timeout));
    let _ = stream.set_write_timeout(Some(cfg.timeout));
    let Ok(read_half) = stream.try_clone() else {
        return;
    };
    let mut reader = BufReader::with_capacity(1 << 20, read_half);
    let mut writer = BufWriter::with_capacity(1 << 20, stream);
    let mut worker = None;
    let outcome = serve(&mut reader, &mut writer, cfg, shared, &mut worker);
    let bye = matches!(outcome, Ok(true));
    if let Err(e) = &outcome {
        let _ = Frame::error(e).write_to(&mut writer);
    }
    // (A connection that never said which worker it is leaves nothing
    // behind: the error was said to it.)
    let _ = peer;
    if let Some(w) = worker {
        lock(shared).state.leave(w, bye);
    }
    shared.1.notify_all();
}

/// Serves one connection's requests; `Ok(true)` when it said goodbye,
/// `Ok(false)` when it closed without one.
fn serve(
    reader: &mut BufReader<TcpStream>,
    writer: &mut BufWriter<TcpStream>,
    cfg: &ServerConfig,
    shared: &Guarded,
    worker: &mut Option<usize>,
) -> Result<bool, String> {
    let Some(hello) = read(reader)? else {
        return Ok(false);
    };
    if hello.kind != Kind::Hello {
        return Err(format!("expected a hello first, got {:?}", hello.kind));
    }
    let w = hello.worker as usize;
    if hello.step as usize != cfg.workers || hello.offset as usize != cfg.len {
        return Err(format!(
            "worker {w} runs {} workers over {} parameters, this server {} workers over {}: \
             the processes were started with different flags",
            hello.step, hello.offset, cfg.workers, cfg.len
        ));
    }
    if hello.text() != cfg.description {
        return Err(format!(
            "worker {w} describes its run as\n  {}\nand parameter server {} as\n  {}\n(every \
             process of a run must be started with the same flags)",
            hello.text(),
            cfg.index,
            cfg.description
        ));
    }
    let welcome = {
        let mut g = lock(shared);
        g.state.join(w)?;
        *worker = Some(w);
        Frame {
            offset: cfg.shard.start as u64,
            step: cfg.shard.len() as u64,
            a: g.state.version() as f64,
            b: if g.state.initialized() { 1.0 } else { 0.0 },
            payload: g.state.clock(w).to_le_bytes().to_vec(),
            ..Frame::new(Kind::Welcome)
        }
    };
    shared.1.notify_all();
    write(writer, &welcome)?;
    loop {
        let Some(f) = read(reader)? else {
            return Ok(false);
        };
        let reply = match f.kind {
            Kind::Push => {
                let mut values = vec![0f32; f.value_count()];
                f.values_into(&mut values)
                    .map_err(|e| format!("worker {w}'s push of step {}: {e}", f.step))?;
                let mut g = lock(shared);
                g.state.push(w, f.step, f.offset as usize, &values)?;
                None
            }
            Kind::Init => {
                let values = f.values();
                lock(shared).state.init(values)?;
                None
            }
            Kind::GetParams => {
                let (version, params) = wait(shared, cfg, |s| s.get_params(w))?;
                Some(
                    Frame {
                        step: version,
                        ..Frame::new(Kind::Params)
                    }
                    .with_values(&params, Encoding::F32),
                )
            }
            Kind::GetSum => {
                let sum = wait(shared, cfg, |s| s.get_sum(w, f.step))?;
                Some(Frame::new(Kind::Sum).with_values(&sum, Encoding::F32))
            }
            Kind::GetNorm => {
                let n = wait(shared, cfg, |s| Ok(s.get_norm(f.step)))?;
                Some(Frame {
                    a: n,
                    ..Frame::new(Kind::Norm)
                })
            }
            Kind::Update => {
                let (version, params, staleness) =
                    wait(shared, cfg, |s| s.update(w, f.step, f.a, f.b))?;
                Some(
                    Frame {
                        step: version,
                        a: staleness as f64,
                        ..Frame::new(Kind::Params)
                    }
                    .with_values(&params, Encoding::F32),
                )
            }
            Kind::GetState => {
                let snap = lock(shared).state.snapshot()?;
                Some(snapshot_frame(&snap))
            }
            Kind::State => {
                let snap = frame_snapshot(&f, cfg.shard.len())?;
                lock(shared).state.restore(snap)?;
                None
            }
            Kind::Bye => return Ok(true),
            other => {
                return Err(format!(
                    "worker {w} sent a {other:?} frame, which servers do not take"
                ))
            }
        };
        shared.1.notify_all();
        if let Some(r) = reply {
            write(writer, &r)?;
        }
    }
}

/// Asks `ask` of the state until it answers, waiting for changes, for at
/// most the run's timeout.
fn wait<T>(
    shared: &Guarded,
    cfg: &ServerConfig,
    mut ask: impl FnMut(&mut ShardState) -> Result<Answer<T>, String>,
) -> Result<T, String> {
    let start = Instant::now();
    let mut g = lock(shared);
    loop {
        if let Some(e) = &g.failed {
            return Err(e.clone());
        }
        match ask(&mut g.state)? {
            Answer::Ready(t) => return Ok(t),
            Answer::Wait(what) => {
                let left = cfg.timeout.saturating_sub(start.elapsed());
                if left.is_zero() {
                    return Err(format!(
                        "parameter server {} waited {} s for {what} (BRAID_TIMEOUT sets the limit)",
                        cfg.index,
                        cfg.timeout.as_secs()
                    ));
                }
                g = shared
                    .1
                    .wait_timeout(g, left)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
            }
        }
    }
}

/// A shard's state as a [`Kind::State`] frame.
pub fn snapshot_frame(snap: &Snapshot) -> Frame {
    let mut values = snap.params.clone();
    for m in &snap.moments {
        values.extend_from_slice(m);
    }
    Frame {
        step: snap.version,
        a: snap.moments.len() as f64,
        b: snap.updates as f64,
        ..Frame::new(Kind::State)
    }
    .with_values(&values, Encoding::F32)
}

/// A [`Kind::State`] frame's state, for a shard of `len` elements.
pub fn frame_snapshot(f: &Frame, len: usize) -> Result<Snapshot, String> {
    let values = f.values();
    let moments = f.a as usize;
    if values.len() != len * (1 + moments) {
        return Err(format!(
            "a shard's state of {} values, where {} parameters and {moments} moment(s) make {}",
            values.len(),
            len,
            len * (1 + moments)
        ));
    }
    let mut parts = values.chunks(len.max(1)).map(<[f32]>::to_vec);
    Ok(Snapshot {
        params: parts.next().unwrap_or_default(),
        moments: parts.collect(),
        updates: f.b as u64,
        version: f.step,
    })
}

fn read(reader: &mut BufReader<TcpStream>) -> Result<Option<Frame>, String> {
    Frame::read_from(reader).map_err(|e| match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            "the worker sent nothing for the run's timeout".to_string()
        }
        _ => format!("reading from the worker: {e}"),
    })
}

fn write(writer: &mut BufWriter<TcpStream>, f: &Frame) -> Result<(), String> {
    f.write_to(writer)
        .map_err(|e| format!("writing to the worker: {e}"))
}
