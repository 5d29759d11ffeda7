//! The store server: one listener thread and one thread per connection over
//! a shared map guarded by a mutex, with a condition variable that wakes
//! blocked gets and waits whenever a key changes.
//!
//! A connection that sends a malformed, truncated or oversized frame, or the
//! wrong token, is answered with an error frame and closed; its thread ends
//! and nothing else is affected.

use crate::error::StoreError;
use crate::protocol::{self, ErrorCode, Limits, ProtocolError, Request, Response};
use std::collections::HashMap;
use std::io::{BufReader, BufWriter, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How a server is configured.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// Size limits on keys, values and frames.
    pub limits: Limits,
    /// Shared secret every client must present; `None` accepts anyone.
    pub token: Option<String>,
    /// Longest a client may take to deliver the rest of a frame it started.
    pub frame_timeout: Duration,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            limits: Limits::default(),
            token: None,
            frame_timeout: Duration::from_secs(30),
        }
    }
}

impl ServerOptions {
    /// Defaults, with the token taken from `BRAID_STORE_TOKEN` when set.
    pub fn from_env() -> Self {
        let token = std::env::var(braid_core::env::BRAID_STORE_TOKEN)
            .ok()
            .filter(|t| !t.is_empty());
        ServerOptions {
            token,
            ..Default::default()
        }
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
    connections: Mutex<HashMap<u64, TcpStream>>,
    next_id: AtomicU64,
    options: ServerOptions,
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
                    " (the port is already in use: another job may be running; choose another --master-port, or use --standalone to pick a free one)"
                }
                std::io::ErrorKind::AddrNotAvailable => {
                    " (this host has no interface with that address: check --master-addr, or set the bind address)"
                }
                _ => "",
            };
            StoreError::Bind { addr: shown.clone(), source, hint }
        })?;
        let addr = listener.local_addr().map_err(|source| StoreError::Bind {
            addr: shown,
            source,
            hint: "",
        })?;
        let shared = Arc::new(Shared {
            map: Mutex::new(HashMap::new()),
            changed: Condvar::new(),
            stopping: AtomicBool::new(false),
            connections: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(0),
            options,
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

    /// Number of client connections currently open.
    pub fn num_connections(&self) -> usize {
        lock(&self.shared.connections).len()
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

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    for stream in listener.incoming() {
        if shared.stopping.load(Ordering::SeqCst) {
            break;
        }
        let Ok(stream) = stream else {
            // Transient accept errors (e.g. too many open files): back off.
            std::thread::sleep(Duration::from_millis(10));
            continue;
        };
        let _ = stream.set_nodelay(true);
        let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
        if let Ok(clone) = stream.try_clone() {
            lock(&shared.connections).insert(id, clone);
        }
        let conn_shared = shared.clone();
        let spawned = std::thread::Builder::new()
            .name("braid-store-conn".into())
            .stack_size(256 << 10)
            .spawn(move || {
                serve_connection(stream, &conn_shared);
                lock(&conn_shared.connections).remove(&id);
            });
        if spawned.is_err() {
            lock(&shared.connections).remove(&id);
        }
    }
}

fn serve_connection(stream: TcpStream, shared: &Shared) {
    let Ok(read_half) = stream.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(read_half);
    let mut writer = BufWriter::new(stream);
    let limits = shared.options.limits;
    let mut authenticated = shared.options.token.is_none();
    loop {
        let _ = reader.get_ref().set_read_timeout(None);
        let frame =
            match read_frame_with_timeout(&mut reader, &limits, shared.options.frame_timeout) {
                Ok(frame) => frame,
                Err(ProtocolError::Closed) => return,
                Err(e) => return reply_error_and_close(&mut writer, e.code(), e.to_string()),
            };
        let request = match Request::decode(&frame, &limits) {
            Ok(r) => r,
            Err(e) => return reply_error_and_close(&mut writer, e.code(), e.to_string()),
        };
        if let Request::Hello { token } = &request {
            if let Some(expected) = &shared.options.token {
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

/// Reads a frame; once the header has arrived, the rest must follow within
/// `frame_timeout` so that a stalled client cannot hold a half frame forever.
fn read_frame_with_timeout(
    reader: &mut BufReader<TcpStream>,
    limits: &Limits,
    frame_timeout: Duration,
) -> Result<Vec<u8>, ProtocolError> {
    use std::io::BufRead;
    // Block (without timeout) until at least one byte is available.
    match reader.fill_buf() {
        Ok([]) => return Err(ProtocolError::Closed),
        Ok(_) => {}
        Err(e) => return Err(ProtocolError::Truncated(e)),
    }
    let _ = reader.get_ref().set_read_timeout(Some(frame_timeout));
    protocol::read_frame(reader, limits.max_frame_len())
}

fn reply_error_and_close(writer: &mut BufWriter<TcpStream>, code: ErrorCode, message: String) {
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
