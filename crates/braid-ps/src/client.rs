//! A worker's side: a connection to every server, pushes handed to a
//! writer thread per server (so a backward pass goes on while its buckets
//! travel), and requests whose replies are read in server order after all
//! were sent (the servers work on them at once).
//!
//! Every reply is waited for at most the run's timeout; every error names
//! the server and its address. With [`Client::recover_through`], a lost
//! server is waited for (its restart publishes a new address in the
//! store), and brought level with the run: the steps since the checkpoint
//! it restarted from are pushed and committed again from this worker's
//! log ([`replay`](Client::recover)), then the current step's pushes.

use crate::server::{frame_snapshot, snapshot_frame};
use crate::shard_state::Snapshot;
use crate::shards::Shards;
use crate::wire::{Encoding, Frame, Kind};
use braid_store::StoreClient;
use std::collections::VecDeque;
use std::io::{BufReader, BufWriter};
use std::net::{TcpStream, ToSocketAddrs};
use std::ops::Range;
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Why a request to a server failed.
enum Fail {
    /// The connection is gone (the server died): it may come back.
    Lost(String),
    /// Anything else (the server said an error, a timeout): fatal.
    Fatal(String),
}

impl From<Fail> for String {
    fn from(f: Fail) -> String {
        match f {
            Fail::Lost(s) | Fail::Fatal(s) => s,
        }
    }
}

/// One server's connection.
struct Conn {
    index: usize,
    addr: String,
    reader: BufReader<TcpStream>,
    /// Frames to write, in order (`None` ends the writer).
    tx: Option<Sender<Frame>>,
    writer: Option<JoinHandle<()>>,
    /// The writer's failure, if it had one.
    failed: Arc<Mutex<Option<String>>>,
}

impl Conn {
    /// Connects to server `index` at `addr` and joins as `hello` says;
    /// returns the connection and the server's welcome.
    fn open(
        index: usize,
        addr: &str,
        hello: Frame,
        timeout: Duration,
    ) -> Result<(Conn, Frame), String> {
        let name = |e: String| format!("parameter server {index} ({addr}): {e}");
        let stream = connect_retrying(addr, timeout).map_err(name)?;
        let _ = stream.set_nodelay(true);
        let _ = stream.set_read_timeout(Some(timeout));
        let _ = stream.set_write_timeout(Some(timeout));
        let read_half = stream.try_clone().map_err(|e| name(e.to_string()))?;
        let failed = Arc::new(Mutex::new(None));
        let (tx, rx) = channel::<Frame>();
        let writer = {
            let failed = failed.clone();
            let mut w = BufWriter::with_capacity(1 << 20, stream);
            std::thread::Builder::new()
                .name(format!("ps-client{index}"))
                .spawn(move || {
                    for f in rx {
                        if let Err(e) = f.write_to(&mut w) {
                            *failed.lock().unwrap_or_else(|p| p.into_inner()) =
                                Some(format!("writing to it: {e}"));
                            return;
                        }
                    }
                })
                .map_err(|e| e.to_string())?
        };
        let mut c = Conn {
            index,
            addr: addr.to_string(),
            reader: BufReader::with_capacity(1 << 20, read_half),
            tx: Some(tx),
            writer: Some(writer),
            failed,
        };
        c.send(hello).map_err(String::from)?;
        let welcome = c.reply(Kind::Welcome).map_err(String::from)?;
        Ok((c, welcome))
    }

    fn name(&self) -> String {
        format!("parameter server {} ({})", self.index, self.addr)
    }

    fn send(&self, f: Frame) -> Result<(), Fail> {
        let sent = self.tx.as_ref().map(|tx| tx.send(f).is_ok());
        if sent != Some(true) {
            return Err(Fail::Lost(
                self.failure("the connection's writer has stopped"),
            ));
        }
        Ok(())
    }

    fn failure(&self, fallback: &str) -> String {
        let why = self
            .failed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .unwrap_or_else(|| fallback.to_string());
        format!("{}: {why}", self.name())
    }

    /// The next reply, which must be of `kind`.
    fn reply(&mut self, kind: Kind) -> Result<Frame, Fail> {
        let f = Frame::read_from(&mut self.reader).map_err(|e| match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => Fail::Fatal(format!(
                "{}: no reply within the run's timeout (BRAID_TIMEOUT) to the {kind:?} request",
                self.name()
            )),
            _ => Fail::Lost(self.failure(&format!("reading its reply: {e}"))),
        })?;
        match f {
            None => Err(Fail::Lost(
                self.failure("it closed the connection (did the server die?)"),
            )),
            Some(f) if f.kind == Kind::Error => {
                Err(Fail::Fatal(format!("{}: {}", self.name(), f.text())))
            }
            Some(f) if f.kind != kind => Err(Fail::Fatal(format!(
                "{}: replied {:?} to a request for {kind:?}",
                self.name(),
                f.kind
            ))),
            Some(f) => Ok(f),
        }
    }

    /// Closes the writer (after what is queued).
    fn close(&mut self) {
        self.tx = None;
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
    }
}

/// What the servers said when the worker joined.
#[derive(Debug, Clone, Copy)]
pub struct Joined {
    /// Whether the parameters were already given (by worker 0, or before
    /// this worker restarted).
    pub initialized: bool,
    /// The servers' version of the parameters (updates applied).
    pub version: u64,
    /// The step this worker goes on from (a restarted worker's, or a
    /// synchronous run's current step).
    pub clock: u64,
}

/// The whole flat buffer's state, gathered from every server.
#[derive(Debug, Clone, PartialEq)]
pub struct WholeState {
    pub params: Vec<f32>,
    pub moments: Vec<Vec<f32>>,
    pub updates: u64,
    pub version: u64,
}

/// One committed step, kept to bring a restarted server level again.
struct Logged {
    step: u64,
    grads: Vec<f32>,
    lr: f32,
    scale: f32,
}

/// How a lost server is waited for and brought level.
struct Recovery {
    store: StoreClient,
    /// Each server's published value (address and process), to tell a
    /// restart by.
    seen: Vec<String>,
    /// The committed steps since the checkpoint before the last.
    log: VecDeque<Logged>,
    /// The current step's gradients as pushed, and which ranges.
    current: Vec<f32>,
    pushed: Vec<Range<usize>>,
    step: u64,
    /// The steps of the last two checkpoints.
    saves: [u64; 2],
    /// Buffers of trimmed log entries, for the next steps' gradients.
    spare: Vec<Vec<f32>>,
}

/// A worker's connections to the servers.
pub struct Client {
    conns: Vec<Conn>,
    shards: Shards,
    worker: usize,
    workers: usize,
    len: usize,
    description: String,
    timeout: Duration,
    recovery: Option<Recovery>,
}

impl Client {
    /// Connects worker `worker` of `workers` to the servers at `addrs`, for
    /// a flat buffer of `len` elements in a run described by
    /// `description` (which must be the servers'), retrying a refused
    /// connection until `timeout`.
    pub fn connect(
        addrs: &[String],
        worker: usize,
        workers: usize,
        len: usize,
        description: &str,
        timeout: Duration,
    ) -> Result<(Client, Joined), String> {
        let shards = Shards::balanced(len, addrs.len())?;
        let mut client = Client {
            conns: Vec::new(),
            shards,
            worker,
            workers,
            len,
            description: description.to_string(),
            timeout,
            recovery: None,
        };
        let mut joined = Joined {
            initialized: true,
            version: 0,
            clock: 0,
        };
        for (index, addr) in addrs.iter().enumerate() {
            let (c, w) = client.open(index, addr)?;
            joined.initialized &= w.b != 0.0;
            joined.version = joined.version.max(w.a as u64);
            if let Ok(b) = <[u8; 8]>::try_from(w.payload.as_slice()) {
                joined.clock = joined.clock.max(u64::from_le_bytes(b));
            }
            client.conns.push(c);
        }
        Ok((client, joined))
    }

    /// Connects to server `index` at `addr`, checking its shard.
    fn open(&self, index: usize, addr: &str) -> Result<(Conn, Frame), String> {
        let hello = Frame {
            worker: self.worker as u32,
            step: self.workers as u64,
            offset: self.len as u64,
            payload: self.description.as_bytes().to_vec(),
            ..Frame::new(Kind::Hello)
        };
        let (c, w) = Conn::open(index, addr, hello, self.timeout)?;
        let want = self.shards.range(index);
        if w.offset as usize != want.start || w.step as usize != want.len() {
            return Err(format!(
                "{} owns elements {}..{}, and this worker expected {want:?} of {} servers: \
                 were they started with the same --ps?",
                c.name(),
                w.offset,
                w.offset + w.step,
                self.shards.len()
            ));
        }
        Ok((c, w))
    }

    /// From now on, a lost server is waited for in `store` (where its
    /// restart publishes its new address; `seen` are the values read at
    /// start) and brought level from this worker's log of the committed
    /// steps since the checkpoint before the last
    /// ([`checkpointed`](Self::checkpointed)). Costs a copy of the
    /// gradients per logged step.
    pub fn recover_through(&mut self, store: StoreClient, seen: Vec<String>) {
        self.recovery = Some(Recovery {
            store,
            seen,
            log: VecDeque::new(),
            current: vec![0.0; self.len],
            pushed: Vec::new(),
            step: 0,
            saves: [0, 0],
            spare: Vec::new(),
        });
    }

    /// A checkpoint of step `step` was taken: the log keeps the steps
    /// after the one before it (a restarted server may find only that
    /// one committed).
    pub fn checkpointed(&mut self, step: u64) {
        if let Some(r) = &mut self.recovery {
            r.saves = [r.saves[1], step];
            let keep_after = r.saves[0];
            while r.log.front().is_some_and(|e| e.step <= keep_after) {
                let e = r.log.pop_front().expect("checked above");
                // (Only the current step's pushed ranges are ever read
                // back, so a spare's old values do not matter.)
                if r.spare.len() < 2 {
                    r.spare.push(e.grads);
                }
            }
        }
    }

    /// The servers' ranges of the flat buffer.
    pub fn shards(&self) -> &Shards {
        &self.shards
    }

    fn frame(&self, kind: Kind, step: u64) -> Frame {
        Frame {
            worker: self.worker as u32,
            step,
            ..Frame::new(kind)
        }
    }

    /// Gives the servers the initial parameters (the whole flat buffer).
    pub fn init(&mut self, params: &[f32]) -> Result<(), String> {
        for s in 0..self.conns.len() {
            let r = self.shards.range(s);
            let f = self
                .frame(Kind::Init, 0)
                .with_values(&params[r], Encoding::F32);
            self.conns[s].send(f).map_err(String::from)?;
        }
        Ok(())
    }

    /// The parameters (whole flat buffer, into `out`), once given; returns
    /// the servers' version.
    pub fn get_params(&mut self, out: &mut [f32]) -> Result<u64, String> {
        let f = self.frame(Kind::GetParams, 0);
        self.ask_all(&f)?;
        self.read_all(&f, Kind::Params, Some(out))
            .map(|(v, _, _)| v)
    }

    /// Pushes the gradients `values` of the flat elements `range` for
    /// `step`, split between the servers that own them (queued: this
    /// returns before they are sent).
    pub fn push(
        &mut self,
        step: u64,
        range: Range<usize>,
        values: &[f32],
        encoding: Encoding,
    ) -> Result<(), String> {
        debug_assert_eq!(range.len(), values.len());
        if let Some(r) = &mut self.recovery {
            if r.step != step {
                r.step = step;
                r.pushed.clear();
            }
            r.current[range.clone()].copy_from_slice(values);
            r.pushed.push(range.clone());
        }
        for (s, part) in self.shards.split(range.clone()) {
            let own = self.shards.range(s);
            let f = Frame {
                offset: (part.start - own.start) as u64,
                ..self.frame(Kind::Push, step)
            }
            .with_values(
                &values[part.start - range.start..part.end - range.start],
                encoding,
            );
            match self.conns[s].send(f) {
                Ok(()) => {}
                // Brought level, this push included.
                Err(Fail::Lost(why)) => self.recover(s, why)?,
                Err(Fail::Fatal(e)) => return Err(e),
            }
        }
        Ok(())
    }

    /// The sum over the workers of `step`'s gradients (whole flat buffer,
    /// into `out`).
    pub fn get_sum(&mut self, step: u64, out: &mut [f32]) -> Result<(), String> {
        let f = self.frame(Kind::GetSum, step);
        self.ask_all(&f)?;
        self.read_all(&f, Kind::Sum, Some(out)).map(|_| ())
    }

    /// The squared norm of `step`'s summed gradients, over every server.
    pub fn get_norm(&mut self, step: u64) -> Result<f64, String> {
        let f = self.frame(Kind::GetNorm, step);
        self.ask_all(&f)?;
        self.read_all(&f, Kind::Norm, None).map(|(_, _, norm)| norm)
    }

    /// Commits `step` (learning rate `lr`, gradients times `scale`) and
    /// reads back the parameters into `out`; returns the servers' version
    /// and the largest staleness of this worker's push on any of them.
    pub fn update(
        &mut self,
        step: u64,
        lr: f32,
        scale: f32,
        out: &mut [f32],
    ) -> Result<(u64, u64), String> {
        let f = Frame {
            a: lr as f64,
            b: scale as f64,
            ..self.frame(Kind::Update, step)
        };
        self.ask_all(&f)?;
        let (version, staleness, _) = self.read_all(&f, Kind::Params, Some(out))?;
        if let Some(r) = &mut self.recovery {
            let grads = std::mem::take(&mut r.current);
            r.log.push_back(Logged {
                step,
                grads,
                lr,
                scale,
            });
            // The next step's buffer: a trimmed entry's when there is one
            // (the log is trimmed at checkpoints).
            r.current = r.spare.pop().unwrap_or_else(|| vec![0.0; self.len]);
            r.pushed.clear();
        }
        Ok((version, staleness))
    }

    /// Every server's shard of the state, gathered.
    pub fn get_state(&mut self) -> Result<WholeState, String> {
        let f = self.frame(Kind::GetState, 0);
        self.ask_all(&f)?;
        let mut whole = WholeState {
            params: vec![0.0; self.len],
            moments: Vec::new(),
            updates: 0,
            version: 0,
        };
        for s in 0..self.conns.len() {
            let r = self.shards.range(s);
            let frame = self.reply_from(s, &f, Kind::State)?;
            let snap = frame_snapshot(&frame, r.len())?;
            if whole.moments.is_empty() {
                whole.moments = vec![vec![0.0; self.len]; snap.moments.len()];
            }
            whole.params[r.clone()].copy_from_slice(&snap.params);
            for (w, m) in whole.moments.iter_mut().zip(&snap.moments) {
                w[r.clone()].copy_from_slice(m);
            }
            whole.updates = snap.updates;
            whole.version = snap.version;
        }
        Ok(whole)
    }

    /// Replaces every server's state by its shard of `state`.
    pub fn set_state(&mut self, state: &WholeState) -> Result<(), String> {
        for s in 0..self.conns.len() {
            let r = self.shards.range(s);
            let snap = Snapshot {
                params: state.params[r.clone()].to_vec(),
                moments: state
                    .moments
                    .iter()
                    .map(|m| m[r.clone()].to_vec())
                    .collect(),
                updates: state.updates,
                version: state.version,
            };
            self.conns[s]
                .send(snapshot_frame(&snap))
                .map_err(String::from)?;
        }
        Ok(())
    }

    /// Says goodbye to every server and closes the connections.
    pub fn bye(mut self) -> Result<(), String> {
        let mut first = None;
        for c in &mut self.conns {
            if let Err(e) = c.send(Frame::new(Kind::Bye)) {
                first.get_or_insert(String::from(e));
            }
            c.close();
            if let Some(e) = c.failed.lock().unwrap_or_else(|p| p.into_inner()).clone() {
                first.get_or_insert(format!("{}: {e}", c.name()));
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// Sends `f` to every server (a lost one brought level first).
    fn ask_all(&mut self, f: &Frame) -> Result<(), String> {
        for s in 0..self.conns.len() {
            if let Err(fail) = self.conns[s].send(f.clone()) {
                match fail {
                    Fail::Lost(why) => {
                        self.recover(s, why)?;
                        self.conns[s].send(f.clone()).map_err(String::from)?;
                    }
                    Fail::Fatal(e) => return Err(e),
                }
            }
        }
        Ok(())
    }

    /// Server `s`'s reply of `kind` to `f`, sent already; a lost server
    /// is brought level and asked again.
    fn reply_from(&mut self, s: usize, f: &Frame, kind: Kind) -> Result<Frame, String> {
        loop {
            match self.conns[s].reply(kind) {
                Ok(r) => return Ok(r),
                Err(Fail::Fatal(e)) => return Err(e),
                Err(Fail::Lost(why)) => {
                    self.recover(s, why)?;
                    self.conns[s].send(f.clone()).map_err(String::from)?;
                }
            }
        }
    }

    /// Reads every server's reply of `kind` to `f` (values of its shard
    /// into `out`); the largest version and staleness they said, and the
    /// sum of their `a` (norms).
    fn read_all(
        &mut self,
        f: &Frame,
        kind: Kind,
        mut out: Option<&mut [f32]>,
    ) -> Result<(u64, u64, f64), String> {
        let (mut version, mut staleness, mut sum) = (0, 0, 0.0);
        for s in 0..self.conns.len() {
            let r = self.shards.range(s);
            let reply = self.reply_from(s, f, kind)?;
            if let Some(out) = out.as_deref_mut() {
                reply
                    .values_into(&mut out[r])
                    .map_err(|e| format!("{}: {e}", self.conns[s].name()))?;
            }
            version = version.max(reply.step);
            staleness = staleness.max(reply.a as u64);
            sum += reply.a;
        }
        Ok((version, staleness, sum))
    }

    /// Server `s` was lost (`why`): waits for its restart to publish a new
    /// address, joins it again, and brings it level — the logged steps it
    /// lacks pushed and committed again, then this step's pushes so far.
    fn recover(&mut self, s: usize, why: String) -> Result<(), String> {
        let Some(rec) = &self.recovery else {
            return Err(why);
        };
        eprintln!(
            "worker {}: lost {why}; waiting up to {} s for it to restart",
            self.worker,
            self.timeout.as_secs()
        );
        let start = Instant::now();
        let key = crate::rendezvous::key(s);
        let value = loop {
            let now = rec
                .store
                .try_get(&key)
                .map_err(|e| format!("{why}; the store: {e}"))?
                .map(|v| String::from_utf8_lossy(&v).into_owned());
            match now {
                Some(v) if v != rec.seen[s] => break v,
                _ if start.elapsed() > self.timeout => {
                    return Err(format!(
                        "{why}; it did not restart within {} s (BRAID_TIMEOUT)",
                        self.timeout.as_secs()
                    ))
                }
                _ => std::thread::sleep(Duration::from_millis(50)),
            }
        };
        let addr = crate::rendezvous::addr_of(&value).to_string();
        let (conn, welcome) = self.open(s, &addr)?;
        let mut old = std::mem::replace(&mut self.conns[s], conn);
        old.close();
        let restored = welcome.a as u64;
        let own = self.shards.range(s);
        let rec = self.recovery.as_mut().expect("checked above");
        rec.seen[s] = value;
        // The steps it lacks, from the log.
        let first = rec.log.front().map(|e| e.step);
        let last = rec.log.back().map(|e| e.step);
        if let (Some(first), Some(last)) = (first, last) {
            if restored < last && restored + 1 < first {
                return Err(format!(
                    "parameter server {s} restarted from step {restored}, and this worker's log \
                     of committed steps starts at step {first}: it cannot be brought level (keep \
                     --save-every small enough that a committed checkpoint is always among the \
                     last two)"
                ));
            }
        }
        eprintln!(
            "worker {}: parameter server {s} is back at {addr} (from step {restored}); replaying \
             steps {}..{}",
            self.worker,
            restored + 1,
            last.unwrap_or(restored)
        );
        let worker = self.worker as u32;
        let conn = &mut self.conns[s];
        for e in rec.log.iter().filter(|e| e.step > restored) {
            let push = Frame {
                worker,
                step: e.step,
                ..Frame::new(Kind::Push)
            }
            .with_values(&e.grads[own.clone()], Encoding::F32);
            let commit = Frame {
                worker,
                step: e.step,
                a: e.lr as f64,
                b: e.scale as f64,
                ..Frame::new(Kind::Update)
            };
            conn.send(push).map_err(String::from)?;
            conn.send(commit).map_err(String::from)?;
            conn.reply(Kind::Params).map_err(String::from)?;
        }
        // This step's pushes so far.
        for r in &rec.pushed {
            let part = r.start.max(own.start)..r.end.min(own.end);
            if part.is_empty() {
                continue;
            }
            let f = Frame {
                worker,
                step: rec.step,
                offset: (part.start - own.start) as u64,
                ..Frame::new(Kind::Push)
            }
            .with_values(&rec.current[part], Encoding::F32);
            conn.send(f).map_err(String::from)?;
        }
        Ok(())
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        for c in &mut self.conns {
            c.close();
        }
    }
}

/// Connects to `addr`, retrying while it refuses, until `timeout`.
fn connect_retrying(addr: &str, timeout: Duration) -> Result<TcpStream, String> {
    let start = Instant::now();
    let mut backoff = Duration::from_millis(10);
    loop {
        let target = addr
            .to_socket_addrs()
            .map_err(|e| format!("cannot resolve {addr}: {e}"))?
            .next()
            .ok_or_else(|| format!("{addr} resolves to nothing"))?;
        let left = timeout.saturating_sub(start.elapsed());
        match TcpStream::connect_timeout(&target, left.max(Duration::from_millis(10))) {
            Ok(s) => return Ok(s),
            Err(e) if start.elapsed() >= timeout => {
                return Err(format!("no connection within {} s: {e}", timeout.as_secs()))
            }
            Err(_) => {
                std::thread::sleep(backoff);
                backoff = (backoff * 2).min(Duration::from_millis(500));
            }
        }
    }
}
