//! A worker's side: a connection to every server, pushes handed to a
//! writer thread per server (so a backward pass goes on while its buckets
//! travel), and requests whose replies are read in server order after all
//! were sent (the servers work on them at once).
//!
//! Every reply is waited for at most the run's timeout; every error names
//! the server and its address.

use crate::shards::Shards;
use crate::wire::{Encoding, Frame, Kind};
use std::io::{BufReader, BufWriter};
use std::net::{TcpStream, ToSocketAddrs};
use std::ops::Range;
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

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
    fn name(&self) -> String {
        format!("parameter server {} ({})", self.index, self.addr)
    }

    fn send(&self, f: Frame) -> Result<(), String> {
        let sent = self.tx.as_ref().map(|tx| tx.send(f).is_ok());
        if sent != Some(true) {
            return Err(self.failure("the connection's writer has stopped"));
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
    fn reply(&mut self, kind: Kind) -> Result<Frame, String> {
        let f = Frame::read_from(&mut self.reader).map_err(|e| match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => format!(
                "{}: no reply within the run's timeout (BRAID_TIMEOUT) to the {kind:?} request",
                self.name()
            ),
            _ => self.failure(&format!("reading its reply: {e}")),
        })?;
        match f {
            None => Err(self.failure("it closed the connection (did the server die?)")),
            Some(f) if f.kind == Kind::Error => Err(format!("{}: {}", self.name(), f.text())),
            Some(f) if f.kind != kind => Err(format!(
                "{}: replied {:?} to a request for {kind:?}",
                self.name(),
                f.kind
            )),
            Some(f) => Ok(f),
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
}

/// A worker's connections to the servers.
pub struct Client {
    conns: Vec<Conn>,
    shards: Shards,
    worker: usize,
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
        let mut conns = Vec::new();
        let mut joined = Joined {
            initialized: true,
            version: 0,
        };
        for (index, addr) in addrs.iter().enumerate() {
            let stream = connect_retrying(addr, timeout)
                .map_err(|e| format!("parameter server {index} ({addr}): {e}"))?;
            let _ = stream.set_nodelay(true);
            let _ = stream.set_read_timeout(Some(timeout));
            let _ = stream.set_write_timeout(Some(timeout));
            let read_half = stream
                .try_clone()
                .map_err(|e| format!("parameter server {index} ({addr}): {e}"))?;
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
                addr: addr.clone(),
                reader: BufReader::with_capacity(1 << 20, read_half),
                tx: Some(tx),
                writer: Some(writer),
                failed,
            };
            c.send(Frame {
                worker: worker as u32,
                step: workers as u64,
                offset: len as u64,
                payload: description.as_bytes().to_vec(),
                ..Frame::new(Kind::Hello)
            })?;
            let w = c.reply(Kind::Welcome)?;
            let want = shards.range(index);
            if w.offset as usize != want.start || w.step as usize != want.len() {
                return Err(format!(
                    "{} owns elements {}..{}, and this worker expected {want:?} of {} servers: \
                     were they started with the same --ps?",
                    c.name(),
                    w.offset,
                    w.offset + w.step,
                    addrs.len()
                ));
            }
            joined.initialized &= w.b != 0.0;
            joined.version = joined.version.max(w.a as u64);
            conns.push(c);
        }
        Ok((
            Client {
                conns,
                shards,
                worker,
            },
            joined,
        ))
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
    pub fn init(&self, params: &[f32]) -> Result<(), String> {
        for (s, c) in self.conns.iter().enumerate() {
            let r = self.shards.range(s);
            c.send(
                self.frame(Kind::Init, 0)
                    .with_values(&params[r], Encoding::F32),
            )?;
        }
        Ok(())
    }

    /// The parameters (whole flat buffer, into `out`), once given; returns
    /// the servers' version.
    pub fn get_params(&mut self, out: &mut [f32]) -> Result<u64, String> {
        self.ask_all(Kind::GetParams, 0, |f| f)?;
        self.read_all(Kind::Params, out).map(|(v, _)| v)
    }

    /// Pushes the gradients `values` of the flat elements `range` for
    /// `step`, split between the servers that own them (queued: this
    /// returns before they are sent).
    pub fn push(
        &self,
        step: u64,
        range: Range<usize>,
        values: &[f32],
        encoding: Encoding,
    ) -> Result<(), String> {
        debug_assert_eq!(range.len(), values.len());
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
            self.conns[s].send(f)?;
        }
        Ok(())
    }

    /// The sum over the workers of `step`'s gradients (whole flat buffer,
    /// into `out`).
    pub fn get_sum(&mut self, step: u64, out: &mut [f32]) -> Result<(), String> {
        self.ask_all(Kind::GetSum, step, |f| f)?;
        self.read_all(Kind::Sum, out).map(|_| ())
    }

    /// The squared norm of `step`'s summed gradients, over every server.
    pub fn get_norm(&mut self, step: u64) -> Result<f64, String> {
        self.ask_all(Kind::GetNorm, step, |f| f)?;
        let mut total = 0.0;
        for c in &mut self.conns {
            total += c.reply(Kind::Norm)?.a;
        }
        Ok(total)
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
        self.ask_all(Kind::Update, step, |f| Frame {
            a: lr as f64,
            b: scale as f64,
            ..f
        })?;
        self.read_all(Kind::Params, out)
    }

    /// Says goodbye to every server and closes the connections.
    pub fn bye(mut self) -> Result<(), String> {
        let mut first = None;
        for c in &mut self.conns {
            if let Err(e) = c.send(Frame::new(Kind::Bye)) {
                first.get_or_insert(e);
            }
            c.tx = None;
            if let Some(w) = c.writer.take() {
                let _ = w.join();
            }
            if let Some(e) = c.failed.lock().unwrap_or_else(|p| p.into_inner()).clone() {
                first.get_or_insert(format!("{}: {e}", c.name()));
            }
        }
        first.map_or(Ok(()), Err)
    }

    fn ask_all(&self, kind: Kind, step: u64, with: impl Fn(Frame) -> Frame) -> Result<(), String> {
        for c in &self.conns {
            c.send(with(self.frame(kind, step)))?;
        }
        Ok(())
    }

    /// Reads every server's reply of `kind` (values of its shard into
    /// `out`); the largest version and staleness they said.
    fn read_all(&mut self, kind: Kind, out: &mut [f32]) -> Result<(u64, u64), String> {
        let (mut version, mut staleness) = (0, 0);
        for s in 0..self.conns.len() {
            let r = self.shards.range(s);
            let c = &mut self.conns[s];
            let f = c.reply(kind)?;
            f.values_into(&mut out[r])
                .map_err(|e| format!("{}: {e}", c.name()))?;
            version = version.max(f.step);
            staleness = staleness.max(f.a as u64);
        }
        Ok((version, staleness))
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        for c in &mut self.conns {
            c.tx = None;
            if let Some(w) = c.writer.take() {
                let _ = w.join();
            }
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
