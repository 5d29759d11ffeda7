//! The store server: one listener thread and one thread per connection over
//! a shared map guarded by a mutex, with a condition variable that wakes
//! blocked gets and waits whenever a key changes.
//!
//! A connection that sends a malformed, truncated or oversized frame, or the
//! wrong token, is answered with an error frame and closed; its thread ends
//! and nothing else is affected.
//!
//! Connections are bounded so that anyone who can reach the port cannot pin
//! the server's threads:
//!
//! - At most [`ServerOptions::max_connections`] are open at once (so at most
//!   that many connection threads exist). The listener answers one more with
//!   a [`ErrorCode::TooManyConnections`] frame and closes it at once; it is
//!   counted ([`StoreServer::refused_connections`]) and logged, and the
//!   clients already connected are not disturbed. [`StoreClient::connect`]
//!   retries such a refusal until its connect timeout.
//! - A new connection must deliver its whole first request (the handshake:
//!   `hello` with the token when one is configured) within
//!   [`ServerOptions::handshake_timeout`] of being accepted, however it
//!   trickles it in; otherwise it is answered with a `Timeout` error and
//!   closed ([`StoreServer::handshakes_timed_out`]). After the handshake a
//!   client may stay idle, or block in a long `get`/`wait`, as long as it
//!   likes; only a request it has started must arrive whole within
//!   [`ServerOptions::frame_timeout`], and a reply it does not read for that
//!   long ends the connection.
//!
//! Refusals and timeouts are logged to stderr, at most one line per kind
//! every few seconds, with the number of similar events left unlogged.
//!
//! [`StoreClient::connect`]: crate::client::StoreClient::connect

use crate::error::StoreError;
use crate::protocol::{self, ErrorCode, Limits, ProtocolError, Request, Response};
use std::collections::HashMap;
use std::io::{BufRead, BufReader, BufWriter, ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Environment variable that sets [`ServerOptions::max_connections`] in
/// [`ServerOptions::from_env`] (a positive integer).
pub use braid_core::env::BRAID_STORE_MAX_CONNECTIONS;

/// Default [`ServerOptions::max_connections`]. Every braid rank holds about
/// three connections to its job's store (its worker client, the
/// communicator's and the health monitor's), plus one per communicator
/// split, so this admits jobs of well over a thousand ranks while still
/// bounding the server's threads.
pub const DEFAULT_MAX_CONNECTIONS: usize = 4096;

/// Default [`ServerOptions::handshake_timeout`].
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// How often, at most, one kind of connection event is logged.
const LOG_INTERVAL: Duration = Duration::from_secs(5);

/// How a server is configured.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// Size limits on keys, values and frames.
    pub limits: Limits,
    /// Shared secret every client must present; `None` accepts anyone.
    pub token: Option<String>,
    /// Longest a client may take to deliver the rest of a frame it started
    /// (counted from the frame's first byte, however slowly the rest comes),
    /// and longest a reply may wait for the client to read it.
    pub frame_timeout: Duration,
    /// Most connections open at once; the server refuses more (at once, with
    /// an error frame) until some close. It runs one thread per connection,
    /// so this also bounds its threads. Values below 1 count as 1.
    pub max_connections: usize,
    /// Longest a new connection may take, from being accepted, to deliver
    /// its whole first request (the handshake: `hello` with the token). A
    /// connection that sends nothing, or trickles its first frame, is closed
    /// then. Established connections are not subject to it.
    pub handshake_timeout: Duration,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            limits: Limits::default(),
            token: None,
            frame_timeout: Duration::from_secs(30),
            max_connections: DEFAULT_MAX_CONNECTIONS,
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
        }
    }
}

impl ServerOptions {
    /// Defaults, with the token taken from `BRAID_STORE_TOKEN` and the
    /// connection cap from `BRAID_STORE_MAX_CONNECTIONS` when set. An
    /// invalid cap is reported on stderr and the default kept.
    pub fn from_env() -> Self {
        let token = std::env::var(braid_core::env::BRAID_STORE_TOKEN)
            .ok()
            .filter(|t| !t.is_empty());
        let cap = std::env::var(BRAID_STORE_MAX_CONNECTIONS).ok();
        let max_connections = match parse_max_connections(cap.as_deref()) {
            Ok(cap) => cap.unwrap_or(DEFAULT_MAX_CONNECTIONS),
            Err(why) => {
                eprintln!("store: {why}; using the default of {DEFAULT_MAX_CONNECTIONS}");
                DEFAULT_MAX_CONNECTIONS
            }
        };
        ServerOptions {
            token,
            max_connections,
            ..Default::default()
        }
    }
}

/// Reads a `BRAID_STORE_MAX_CONNECTIONS` value: `None` or empty means unset.
fn parse_max_connections(value: Option<&str>) -> Result<Option<usize>, String> {
    let Some(value) = value.map(str::trim).filter(|v| !v.is_empty()) else {
        return Ok(None);
    };
    match value.parse::<usize>() {
        Ok(n) if n > 0 => Ok(Some(n)),
        _ => Err(format!(
            "ignoring {BRAID_STORE_MAX_CONNECTIONS}={value:?}: it must be a positive integer"
        )),
    }
}

/// A running store server. Dropping it shuts it down.
pub struct StoreServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept_thread: Option<JoinHandle<()>>,
}

struct Shared {
    map: Mutex<HashMap<Vec<u8>, Vec<u8>>>,
    changed: Condvar,
    stopping: AtomicBool,
    /// Open connections, by id (kept to close them at shutdown); its length
    /// is what the cap is checked against. Only the accept thread inserts.
    connections: Mutex<HashMap<u64, Arc<TcpStream>>>,
    next_id: AtomicU64,
    options: ServerOptions,
    refused: AtomicU64,
    handshake_timeouts: AtomicU64,
    refusal_log: LogLimiter,
    timeout_log: LogLimiter,
    accept_log: LogLimiter,
}

impl StoreServer {
    /// Listens on `addr` (e.g. `"127.0.0.1:29500"`, port 0 for any free
    /// port) and starts serving in background threads.
    pub fn bind(
        addr: impl ToSocketAddrs + std::fmt::Display,
        options: ServerOptions,
    ) -> Result<Self, StoreError> {
        let shown = addr.to_string();
        let listener = TcpListener::bind(&addr).map_err(|source| {
            let hint = match source.kind() {
                std::io::ErrorKind::AddrInUse => {
                    " (the port is already in use: another job or store may be running there)"
                }
                std::io::ErrorKind::AddrNotAvailable => {
                    " (this host has no interface with that address)"
                }
                _ => "",
            };
            StoreError::Bind {
                addr: shown.clone(),
                source,
                hint: hint.into(),
            }
        })?;
        let addr = listener.local_addr().map_err(|source| StoreError::Bind {
            addr: shown,
            source,
            hint: String::new(),
        })?;
        let shared = Arc::new(Shared {
            map: Mutex::new(HashMap::new()),
            changed: Condvar::new(),
            stopping: AtomicBool::new(false),
            connections: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(0),
            options,
            refused: AtomicU64::new(0),
            handshake_timeouts: AtomicU64::new(0),
            refusal_log: LogLimiter::default(),
            timeout_log: LogLimiter::default(),
            accept_log: LogLimiter::default(),
        });
        let accept_shared = shared.clone();
        let accept_thread = std::thread::Builder::new()
            .name("braid-store-accept".into())
            .spawn(move || accept_loop(listener, accept_shared))
            .expect("spawning the store's accept thread");
        Ok(StoreServer {
            addr,
            shared,
            accept_thread: Some(accept_thread),
        })
    }

    /// The address the server listens on (with the real port if 0 was asked).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Number of client connections currently open (handshaking or not).
    pub fn num_connections(&self) -> usize {
        lock(&self.shared.connections).len()
    }

    /// Connections closed on arrival since the server started, because
    /// [`ServerOptions::max_connections`] were already open (or no thread
    /// could be started for them).
    pub fn refused_connections(&self) -> u64 {
        self.shared.refused.load(Ordering::Relaxed)
    }

    /// Connections closed since the server started because their first
    /// request did not arrive within [`ServerOptions::handshake_timeout`].
    pub fn handshakes_timed_out(&self) -> u64 {
        self.shared.handshake_timeouts.load(Ordering::Relaxed)
    }

    /// Stops accepting, fails pending waits and closes every connection.
    pub fn shutdown(&mut self) {
        if self.shared.stopping.swap(true, Ordering::SeqCst) {
            return;
        }
        // Wake blocked gets so they answer `ShuttingDown`.
        drop(lock(&self.shared.map));
        self.shared.changed.notify_all();
        // Wake the accept loop with a connection of our own.
        let wake = if self.addr.ip().is_unspecified() {
            SocketAddr::new(std::net::Ipv4Addr::LOCALHOST.into(), self.addr.port())
        } else {
            self.addr
        };
        let _ = TcpStream::connect_timeout(&wake, Duration::from_secs(1));
        if let Some(t) = self.accept_thread.take() {
            let _ = t.join();
        }
        for (_, stream) in lock(&self.shared.connections).drain() {
            let _ = stream.shutdown(Shutdown::Both);
        }
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Locks a mutex, recovering the data if a handler thread panicked while
/// holding it (the map stays consistent: every update is a single insert).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Logs to stderr at most once per [`LOG_INTERVAL`], so that a flood of
/// connections cannot flood the log; the next line logged says how many
/// were left out.
#[derive(Default)]
struct LogLimiter {
    /// When the last line was logged, and how many were dropped since.
    state: Mutex<(Option<Instant>, u64)>,
}

impl LogLimiter {
    fn log(&self, message: impl FnOnce() -> String) {
        let mut state = lock(&self.state);
        let now = Instant::now();
        if state
            .0
            .is_some_and(|last| now.duration_since(last) < LOG_INTERVAL)
        {
            state.1 += 1;
            return;
        }
        let left_out = std::mem::take(&mut state.1);
        state.0 = Some(now);
        drop(state);
        if left_out > 0 {
            eprintln!(
                "{} ({left_out} more like it since the last such message)",
                message()
            );
        } else {
            eprintln!("{}", message());
        }
    }
}

/// A connection's place in [`Shared::connections`], given up when its
/// thread ends (or when the thread could not be started).
struct Slot {
    shared: Arc<Shared>,
    id: u64,
}

impl Drop for Slot {
    fn drop(&mut self) {
        lock(&self.shared.connections).remove(&self.id);
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    let cap = shared.options.max_connections.max(1);
    loop {
        let accepted = listener.accept();
        if shared.stopping.load(Ordering::SeqCst) {
            break;
        }
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(e) => {
                // Transient accept errors (e.g. too many open files): back off.
                shared.accept_log.log(|| {
                    format!("store: accepting a connection failed: {e}; retrying in 10 ms")
                });
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        let accepted_at = Instant::now();
        // Only this thread inserts, so the count cannot grow past the cap
        // between this check and the insert below.
        let open = lock(&shared.connections).len();
        if open >= cap {
            refuse(
                &shared,
                stream,
                format!(
                    "store: refused connection from {peer}: {open} connections open (the cap); \
                     set {BRAID_STORE_MAX_CONNECTIONS} on the store's host to allow more"
                ),
            );
            continue;
        }
        let _ = stream.set_nodelay(true);
        let stream = Arc::new(stream);
        let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
        lock(&shared.connections).insert(id, stream.clone());
        let slot = Slot {
            shared: shared.clone(),
            id,
        };
        let spawned = std::thread::Builder::new()
            .name("braid-store-conn".into())
            .stack_size(256 << 10)
            .spawn(move || {
                serve_connection(&stream, peer, accepted_at, &slot.shared);
                drop(slot);
            });
        if let Err(e) = spawned {
            // The closure, and with it the stream and the slot, is gone.
            shared.refused.fetch_add(1, Ordering::Relaxed);
            shared.refusal_log.log(|| {
                format!(
                    "store: refused connection from {peer}: could not start a thread for it \
                     ({e}; {open} connections open)"
                )
            });
        }
    }
}

/// Closes a connection the server will not serve, telling the client why.
/// Runs on the accept thread, so nothing here may block.
fn refuse(shared: &Shared, stream: TcpStream, message: String) {
    shared.refused.fetch_add(1, Ordering::Relaxed);
    let _ = stream.set_nonblocking(true);
    let frame = Response::Error {
        code: ErrorCode::TooManyConnections,
        message: message.clone(),
    }
    .encode();
    // A fresh socket's send buffer is empty: the small frame fits at once.
    let _ = (&stream).write_all(&frame);
    // Discard what the client already sent (its hello), so that closing
    // sends a FIN after the frame rather than a reset that could discard it.
    let mut sink = [0u8; 4096];
    for _ in 0..4 {
        match (&stream).read(&mut sink) {
            Ok(n) if n > 0 => {}
            _ => break,
        }
    }
    let _ = stream.shutdown(Shutdown::Write);
    drop(stream);
    shared.refusal_log.log(|| message);
}

fn serve_connection(stream: &TcpStream, peer: SocketAddr, accepted_at: Instant, shared: &Shared) {
    let options = &shared.options;
    // A reply the client does not read within this long ends the connection,
    // so a client that stops reading cannot hold its thread forever.
    let _ = stream.set_write_timeout(Some(options.frame_timeout));
    let mut reader = BufReader::new(DeadlineReader::new(stream));
    let mut writer = BufWriter::new(stream);
    let limits = options.limits;
    // `None` (no deadline) only for a timeout too large to represent.
    let handshake_deadline = accepted_at.checked_add(options.handshake_timeout);
    let mut handshaken = false;
    let mut authenticated = options.token.is_none();
    loop {
        let frame = if handshaken {
            read_frame_with_timeout(&mut reader, &limits, options.frame_timeout)
        } else {
            reader.get_mut().deadline = handshake_deadline;
            protocol::read_frame(&mut reader, limits.max_frame_len())
        };
        let frame = match frame {
            Ok(frame) => frame,
            Err(ProtocolError::Closed) => return,
            Err(ProtocolError::Truncated(e)) if is_timeout(&e) => {
                let message = if handshaken {
                    format!(
                        "closed connection from {peer}: the rest of a request did not arrive \
                         within {:.1?} of its first byte (the frame timeout)",
                        options.frame_timeout
                    )
                } else {
                    shared.handshake_timeouts.fetch_add(1, Ordering::Relaxed);
                    format!(
                        "closed connection from {peer}: no complete first request within \
                         {:.1?} of connecting (the handshake deadline)",
                        options.handshake_timeout
                    )
                };
                shared.timeout_log.log(|| format!("store: {message}"));
                return reply_error_and_close(&mut writer, ErrorCode::Timeout, message);
            }
            Err(e) => return reply_error_and_close(&mut writer, e.code(), e.to_string()),
        };
        let request = match Request::decode(&frame, &limits) {
            Ok(r) => r,
            Err(e) => return reply_error_and_close(&mut writer, e.code(), e.to_string()),
        };
        if let Request::Hello { token } = &request {
            if let Some(expected) = &options.token {
                if !constant_time_eq(expected.as_bytes(), token) {
                    let why = if token.is_empty() {
                        "no token was presented"
                    } else {
                        "the token is wrong"
                    };
                    return reply_error_and_close(
                        &mut writer,
                        ErrorCode::Unauthorized,
                        format!("{why}; set BRAID_STORE_TOKEN to the job's shared secret"),
                    );
                }
            }
            authenticated = true;
        } else if !authenticated {
            return reply_error_and_close(
                &mut writer,
                ErrorCode::Unauthorized,
                "this store requires a token: the first request must present BRAID_STORE_TOKEN"
                    .into(),
            );
        }
        // The first request arrived whole (and, with a token, authenticated):
        // from now on the connection may idle or block as long as it likes.
        handshaken = true;
        let response = execute(shared, request);
        if writer
            .write_all(&response.encode())
            .and_then(|_| writer.flush())
            .is_err()
        {
            return;
        }
    }
}

/// Whether a read failed because its deadline or the socket's timeout passed.
fn is_timeout(e: &std::io::Error) -> bool {
    matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut)
}

/// Reads from a socket, failing with [`ErrorKind::TimedOut`] once
/// `deadline` has passed. Before every read the socket's read timeout is set
/// to the time left, so a peer that trickles bytes cannot stretch the
/// deadline the way a plain per-read timeout would let it.
struct DeadlineReader<'a> {
    stream: &'a TcpStream,
    /// `None`: block as long as it takes.
    deadline: Option<Instant>,
    /// Whether a read timeout is currently set on the socket.
    timeout_set: bool,
}

impl<'a> DeadlineReader<'a> {
    fn new(stream: &'a TcpStream) -> Self {
        DeadlineReader {
            stream,
            deadline: None,
            timeout_set: false,
        }
    }
}

impl Read for DeadlineReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self.deadline {
            Some(deadline) => {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(ErrorKind::TimedOut.into());
                }
                self.stream.set_read_timeout(Some(left))?;
                self.timeout_set = true;
            }
            None if self.timeout_set => {
                self.stream.set_read_timeout(None)?;
                self.timeout_set = false;
            }
            None => {}
        }
        self.stream.read(buf)
    }
}

/// Reads a frame after the handshake: waits as long as it takes for its
/// first byte, then the whole frame must follow within `frame_timeout`, so
/// that a stalled client cannot hold a half frame forever.
fn read_frame_with_timeout(
    reader: &mut BufReader<DeadlineReader<'_>>,
    limits: &Limits,
    frame_timeout: Duration,
) -> Result<Vec<u8>, ProtocolError> {
    if reader.buffer().is_empty() {
        reader.get_mut().deadline = None;
        match reader.fill_buf() {
            Ok([]) => return Err(ProtocolError::Closed),
            Ok(_) => {}
            Err(e) => return Err(ProtocolError::Truncated(e)),
        }
    }
    reader.get_mut().deadline = Instant::now().checked_add(frame_timeout);
    protocol::read_frame(reader, limits.max_frame_len())
}

fn reply_error_and_close(writer: &mut BufWriter<&TcpStream>, code: ErrorCode, message: String) {
    let _ = writer.write_all(&Response::Error { code, message }.encode());
    let _ = writer.flush();
    let _ = writer.get_ref().shutdown(Shutdown::Both);
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn execute(shared: &Shared, request: Request) -> Response {
    let mut map = lock(&shared.map);
    match request {
        Request::Hello { .. } | Request::Ping => Response::Ok,
        Request::Time => Response::Int(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_micros() as i64),
        ),
        Request::Set { key, value } => {
            map.insert(key, value);
            drop(map);
            shared.changed.notify_all();
            Response::Ok
        }
        Request::Get { key, timeout_ms: 0 } => match map.get(&key) {
            Some(v) => Response::Value(v.clone()),
            None => Response::NotFound,
        },
        Request::Get { key, timeout_ms } => {
            match wait_until(shared, map, timeout_ms, |m| m.contains_key(&key)) {
                Ok(m) => Response::Value(m[&key].clone()),
                Err(e) => e.into_response(|| format!("key {:?}", String::from_utf8_lossy(&key))),
            }
        }
        Request::Wait { keys, timeout_ms } => {
            match wait_until(shared, map, timeout_ms, |m| {
                keys.iter().all(|k| m.contains_key(k))
            }) {
                Ok(_) => Response::Ok,
                Err(WaitFailed::Timeout(m)) => {
                    let missing: Vec<_> = keys
                        .iter()
                        .filter(|k| !m.contains_key(*k))
                        .map(|k| String::from_utf8_lossy(k))
                        .collect();
                    Response::Error {
                        code: ErrorCode::Timeout,
                        message: format!("still missing: {missing:?}"),
                    }
                }
                Err(e) => e.into_response(String::new),
            }
        }
        Request::Check { keys } => {
            Response::Present(keys.iter().map(|k| map.contains_key(k)).collect())
        }
        Request::Add { key, delta } => {
            let current = match map.get(&key) {
                None => 0,
                Some(v) => match std::str::from_utf8(v)
                    .ok()
                    .and_then(|s| s.parse::<i64>().ok())
                {
                    Some(n) => n,
                    None => {
                        return Response::Error {
                            code: ErrorCode::NotAnInteger,
                            message: format!(
                                "key {:?} holds a value that is not a decimal integer",
                                String::from_utf8_lossy(&key)
                            ),
                        }
                    }
                },
            };
            let new = current.wrapping_add(delta);
            map.insert(key, new.to_string().into_bytes());
            drop(map);
            shared.changed.notify_all();
            Response::Int(new)
        }
        Request::CompareSet {
            key,
            expected,
            desired,
        } => {
            let matches = map.get(&key).map(|v| v.as_slice()) == expected.as_deref();
            if matches {
                map.insert(key, desired.clone());
                drop(map);
                shared.changed.notify_all();
                Response::Swapped {
                    swapped: true,
                    current: Some(desired),
                }
            } else {
                Response::Swapped {
                    swapped: false,
                    current: map.get(&key).cloned(),
                }
            }
        }
        Request::Delete { key } => Response::Bool(map.remove(&key).is_some()),
        Request::DeletePrefix { prefix } => {
            let before = map.len();
            map.retain(|k, _| !k.starts_with(&prefix));
            Response::Int((before - map.len()) as i64)
        }
        Request::NumKeys => Response::Int(map.len() as i64),
    }
}

enum WaitFailed<'a> {
    Timeout(MutexGuard<'a, HashMap<Vec<u8>, Vec<u8>>>),
    Stopping,
}

impl WaitFailed<'_> {
    fn into_response(self, what: impl FnOnce() -> String) -> Response {
        match self {
            WaitFailed::Timeout(_) => Response::Error {
                code: ErrorCode::Timeout,
                message: what(),
            },
            WaitFailed::Stopping => Response::Error {
                code: ErrorCode::ShuttingDown,
                message: "the store is shutting down".into(),
            },
        }
    }
}

type Map = HashMap<Vec<u8>, Vec<u8>>;

fn wait_until<'a>(
    shared: &'a Shared,
    mut map: MutexGuard<'a, Map>,
    timeout_ms: u64,
    ready: impl Fn(&Map) -> bool,
) -> Result<MutexGuard<'a, Map>, WaitFailed<'a>> {
    let start = Instant::now();
    // A client may ask for an absurd timeout; cap it instead of overflowing.
    let deadline = start
        .checked_add(Duration::from_millis(timeout_ms))
        .unwrap_or(start + Duration::from_secs(365 * 24 * 3600));
    loop {
        if ready(&map) {
            return Ok(map);
        }
        if shared.stopping.load(Ordering::SeqCst) {
            return Err(WaitFailed::Stopping);
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(WaitFailed::Timeout(map));
        }
        map = shared
            .changed
            .wait_timeout(map, deadline - now)
            .unwrap_or_else(|p| p.into_inner())
            .0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_connections_from_the_environment() {
        assert_eq!(parse_max_connections(None), Ok(None));
        assert_eq!(parse_max_connections(Some("")), Ok(None));
        assert_eq!(parse_max_connections(Some(" 8192 ")), Ok(Some(8192)));
        for bad in ["0", "-1", "lots", "1.5"] {
            let err = parse_max_connections(Some(bad)).unwrap_err();
            assert!(
                err.contains(BRAID_STORE_MAX_CONNECTIONS) && err.contains("positive integer"),
                "{err}"
            );
        }
    }

    #[test]
    fn defaults_bound_connections_and_handshakes() {
        let o = ServerOptions::default();
        assert_eq!(o.max_connections, DEFAULT_MAX_CONNECTIONS);
        assert_eq!(o.handshake_timeout, Duration::from_secs(10));
    }

    #[test]
    fn deadline_reader_stops_at_the_deadline_however_bytes_trickle() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        let start = Instant::now();
        let mut reader = DeadlineReader::new(&server);
        reader.deadline = Some(start + Duration::from_millis(300));
        let trickle = std::thread::spawn(move || {
            for _ in 0..20 {
                if client.write_all(b"x").is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        let mut buf = [0u8; 1];
        let err = loop {
            match reader.read(&mut buf) {
                Ok(1) => continue,
                Ok(n) => panic!("read {n} bytes"),
                Err(e) => break e,
            }
        };
        let waited = start.elapsed();
        assert!(is_timeout(&err), "{err}");
        assert!(
            waited >= Duration::from_millis(290) && waited < Duration::from_millis(800),
            "{waited:?}"
        );
        // Without a deadline, reads block again (the socket timeout is cleared).
        reader.deadline = None;
        assert_eq!(reader.read(&mut buf).unwrap(), 1);
        assert_eq!(server.read_timeout().unwrap(), None);
        drop(server);
        trickle.join().unwrap();
    }
}
