//! The store client: a connection with retrying connect, blocking
//! operations bounded by timeouts, and key prefixes.
//!
//! A [`StoreClient`] owns one TCP connection; [`StoreClient::with_prefix`]
//! makes views that share it but see their own key space, which is how
//! sub-groups and restart attempts stay out of each other's way. Requests
//! on one connection are serialised; a thread that needs to block on a key
//! while another keeps working should open a second client.

use crate::error::StoreError;
use crate::protocol::{self, ErrorCode, Limits, ProtocolError, Request, Response};
use std::io::{BufReader, ErrorKind, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How a client connects and how long it waits.
#[derive(Debug, Clone)]
pub struct ClientOptions {
    /// How long to keep retrying the first connection.
    pub connect_timeout: Duration,
    /// Default timeout of blocking operations (get, wait, barrier).
    pub timeout: Duration,
    /// Shared secret to present; must match the server's.
    pub token: Option<String>,
    /// Limits checked before sending (the server enforces its own).
    pub limits: Limits,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            connect_timeout: Duration::from_secs(60),
            timeout: Duration::from_secs(300),
            token: None,
            limits: Limits::default(),
        }
    }
}

impl ClientOptions {
    /// Defaults, with `BRAID_STORE_TOKEN` and `BRAID_TIMEOUT` applied.
    pub fn from_env() -> Result<Self, StoreError> {
        let mut o = ClientOptions {
            token: std::env::var(braid_core::env::BRAID_STORE_TOKEN)
                .ok()
                .filter(|t| !t.is_empty()),
            ..Default::default()
        };
        o.timeout = braid_core::world::WorldInfo::timeout_from_env(o.timeout)
            .map_err(|e| StoreError::Invalid(e.to_string()))?;
        Ok(o)
    }
}

/// Result of [`StoreClient::compare_set`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CasOutcome {
    /// Whether the value was replaced.
    pub swapped: bool,
    /// The value stored after the operation (`None`: the key is absent).
    pub current: Option<Vec<u8>>,
}

struct Connection {
    writer: TcpStream,
    reader: BufReader<TcpStream>,
    /// Set once the connection has failed; later requests fail fast.
    broken: Option<String>,
}

/// A connection to a store server, seen through a key prefix.
pub struct StoreClient {
    conn: Arc<Mutex<Connection>>,
    addr: String,
    local: Option<SocketAddr>,
    prefix: String,
    options: ClientOptions,
    pub(crate) barrier_generations: Mutex<std::collections::HashMap<String, u64>>,
}

/// Extra time beyond an operation's own timeout before the client gives up
/// on a reply (covers the round trip and a busy server).
const REPLY_GRACE: Duration = Duration::from_secs(1);

impl StoreClient {
    /// Connects to `addr` (`host:port`), retrying with backoff until
    /// `options.connect_timeout`, then presents the token. A server that
    /// refuses the connection because it already holds as many as it allows
    /// is retried the same way; if it still refuses at the deadline, the
    /// error is [`StoreError::Refused`] with the server's reason.
    pub fn connect(addr: &str, options: ClientOptions) -> Result<Self, StoreError> {
        let start = Instant::now();
        let mut backoff = Duration::from_millis(10);
        loop {
            let remaining = options.connect_timeout.saturating_sub(start.elapsed());
            let retry = match try_connect(addr, remaining) {
                Ok(stream) => match Self::handshake(addr, stream, options.clone())? {
                    Ok(client) => return Ok(client),
                    Err(server_full) => Retry::Full(server_full),
                },
                Err(e) => Retry::Unreachable(e),
            };
            let waited = start.elapsed();
            if waited + backoff >= options.connect_timeout {
                return Err(match retry {
                    Retry::Unreachable(last_error) => StoreError::Connect {
                        addr: addr.to_string(),
                        waited,
                        last_error,
                    },
                    Retry::Full(message) => StoreError::Refused {
                        addr: addr.to_string(),
                        message: format!(
                            "{message} (still refused after retrying for {waited:.1?})"
                        ),
                    },
                });
            }
            std::thread::sleep(backoff);
            backoff = (backoff * 2).min(Duration::from_millis(500));
        }
    }

    /// Presents the token on a fresh connection. `Ok(Err(message))`: the
    /// server is at its connection cap and closed this one (worth retrying).
    fn handshake(
        addr: &str,
        stream: TcpStream,
        options: ClientOptions,
    ) -> Result<Result<Self, String>, StoreError> {
        let _ = stream.set_nodelay(true);
        let local = stream.local_addr().ok();
        let reader = BufReader::new(stream.try_clone().map_err(|e| StoreError::Disconnected {
            addr: addr.to_string(),
            op: "connect",
            detail: e.to_string(),
        })?);
        let client = StoreClient {
            conn: Arc::new(Mutex::new(Connection {
                writer: stream,
                reader,
                broken: None,
            })),
            addr: addr.to_string(),
            local,
            prefix: String::new(),
            options,
            barrier_generations: Default::default(),
        };
        let token = client
            .options
            .token
            .clone()
            .unwrap_or_default()
            .into_bytes();
        match client.request(Request::Hello { token }, client.options.timeout)? {
            Response::Ok => Ok(Ok(client)),
            Response::Error {
                code: ErrorCode::TooManyConnections,
                message,
            } => Ok(Err(message)),
            other => Err(client.unexpected("hello", other)),
        }
    }

    /// A view of the same connection whose keys all start with
    /// `self.prefix() + prefix`.
    pub fn with_prefix(&self, prefix: &str) -> StoreClient {
        StoreClient {
            conn: self.conn.clone(),
            addr: self.addr.clone(),
            local: self.local,
            prefix: format!("{}{}", self.prefix, prefix),
            options: self.options.clone(),
            barrier_generations: Default::default(),
        }
    }

    /// A new, independent connection to the same server with the same
    /// prefix (for a thread that must block while others use the store).
    pub fn reconnect(&self) -> Result<StoreClient, StoreError> {
        let fresh = StoreClient::connect(&self.addr, self.options.clone())?;
        Ok(fresh.with_prefix(&self.prefix))
    }

    /// The server's address as given to [`connect`](Self::connect).
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// This side's address of the connection: the IP address this host uses
    /// to reach the store, which is how braid tells hosts apart.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.local
    }

    /// This view's key prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Default timeout of blocking operations.
    pub fn timeout(&self) -> Duration {
        self.options.timeout
    }

    /// Changes the default timeout of blocking operations.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.options.timeout = timeout;
    }

    /// Stores `value` under `key`.
    pub fn set(&self, key: &str, value: impl AsRef<[u8]>) -> Result<(), StoreError> {
        let value = value.as_ref();
        if value.len() > self.options.limits.max_value_len {
            return Err(StoreError::Invalid(format!(
                "value of {} bytes for key {key:?} exceeds the limit of {} bytes",
                value.len(),
                self.options.limits.max_value_len
            )));
        }
        let req = Request::Set {
            key: self.key(key)?,
            value: value.to_vec(),
        };
        self.expect_ok("set", req, self.options.timeout)
    }

    /// Fetches `key`, waiting up to the default timeout for it to appear.
    pub fn get(&self, key: &str) -> Result<Vec<u8>, StoreError> {
        self.get_timeout(key, self.options.timeout)
    }

    /// Fetches `key`, waiting up to `timeout` for it to appear.
    pub fn get_timeout(&self, key: &str, timeout: Duration) -> Result<Vec<u8>, StoreError> {
        let full = self.key(key)?;
        let req = Request::Get {
            key: full,
            timeout_ms: millis(timeout).max(1),
        };
        match self.request(req, timeout)? {
            Response::Value(v) => Ok(v),
            Response::Error {
                code: ErrorCode::Timeout,
                ..
            } => Err(self.timeout_error(format!("key {:?}", self.full_name(key)), timeout)),
            other => Err(self.unexpected("get", other)),
        }
    }

    /// Fetches `key` if it exists, without waiting.
    pub fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        match self.request(
            Request::Get {
                key: self.key(key)?,
                timeout_ms: 0,
            },
            self.options.timeout,
        )? {
            Response::Value(v) => Ok(Some(v)),
            Response::NotFound => Ok(None),
            other => Err(self.unexpected("get", other)),
        }
    }

    /// Waits until every key in `keys` exists, up to `timeout`.
    pub fn wait(&self, keys: &[&str], timeout: Duration) -> Result<(), StoreError> {
        let full = keys
            .iter()
            .map(|k| self.key(k))
            .collect::<Result<Vec<_>, _>>()?;
        match self.request(
            Request::Wait {
                keys: full,
                timeout_ms: millis(timeout).max(1),
            },
            timeout,
        )? {
            Response::Ok => Ok(()),
            Response::Error {
                code: ErrorCode::Timeout,
                message,
            } => {
                let names: Vec<_> = keys.iter().map(|k| self.full_name(k)).collect();
                Err(self.timeout_error(format!("keys {names:?} ({message})"), timeout))
            }
            other => Err(self.unexpected("wait", other)),
        }
    }

    /// Reports, for each key, whether it exists (no waiting).
    pub fn check(&self, keys: &[&str]) -> Result<Vec<bool>, StoreError> {
        let full = keys
            .iter()
            .map(|k| self.key(k))
            .collect::<Result<Vec<_>, _>>()?;
        match self.request(Request::Check { keys: full }, self.options.timeout)? {
            Response::Present(p) if p.len() == keys.len() => Ok(p),
            other => Err(self.unexpected("check", other)),
        }
    }

    /// Atomically adds `delta` to the counter at `key` (absent counts as 0)
    /// and returns the new value. Counters are stored as decimal text.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        match self.request(
            Request::Add {
                key: self.key(key)?,
                delta,
            },
            self.options.timeout,
        )? {
            Response::Int(v) => Ok(v),
            other => Err(self.unexpected("add", other)),
        }
    }

    /// Atomically replaces the value at `key` with `desired` if it currently
    /// equals `expected` (`None`: only if the key is absent).
    pub fn compare_set(
        &self,
        key: &str,
        expected: Option<&[u8]>,
        desired: impl AsRef<[u8]>,
    ) -> Result<CasOutcome, StoreError> {
        let req = Request::CompareSet {
            key: self.key(key)?,
            expected: expected.map(|e| e.to_vec()),
            desired: desired.as_ref().to_vec(),
        };
        match self.request(req, self.options.timeout)? {
            Response::Swapped { swapped, current } => Ok(CasOutcome { swapped, current }),
            other => Err(self.unexpected("compare_set", other)),
        }
    }

    /// Removes `key`; returns whether it existed.
    pub fn delete(&self, key: &str) -> Result<bool, StoreError> {
        match self.request(
            Request::Delete {
                key: self.key(key)?,
            },
            self.options.timeout,
        )? {
            Response::Bool(b) => Ok(b),
            other => Err(self.unexpected("delete", other)),
        }
    }

    /// Removes every key under `self.prefix() + prefix`; returns how many.
    pub fn delete_prefix(&self, prefix: &str) -> Result<u64, StoreError> {
        match self.request(
            Request::DeletePrefix {
                prefix: self.key(prefix)?,
            },
            self.options.timeout,
        )? {
            Response::Int(n) => Ok(n.max(0) as u64),
            other => Err(self.unexpected("delete_prefix", other)),
        }
    }

    /// Number of keys in the whole store (all prefixes).
    pub fn num_keys(&self) -> Result<u64, StoreError> {
        match self.request(Request::NumKeys, self.options.timeout)? {
            Response::Int(n) => Ok(n.max(0) as u64),
            other => Err(self.unexpected("num_keys", other)),
        }
    }

    /// The server's clock, microseconds since the UNIX epoch.
    pub fn server_time_us(&self) -> Result<i64, StoreError> {
        match self.request(Request::Time, self.options.timeout)? {
            Response::Int(t) => Ok(t),
            other => Err(self.unexpected("time", other)),
        }
    }

    /// Round-trips an empty request.
    pub fn ping(&self) -> Result<(), StoreError> {
        self.expect_ok("ping", Request::Ping, self.options.timeout)
    }

    fn key(&self, key: &str) -> Result<Vec<u8>, StoreError> {
        let len = self.prefix.len() + key.len();
        if len > self.options.limits.max_key_len {
            return Err(StoreError::Invalid(format!(
                "key {:?} is {len} bytes with its prefix, over the limit of {} bytes",
                self.full_name(key),
                self.options.limits.max_key_len
            )));
        }
        let mut k = Vec::with_capacity(len);
        k.extend_from_slice(self.prefix.as_bytes());
        k.extend_from_slice(key.as_bytes());
        Ok(k)
    }

    pub(crate) fn full_name(&self, key: &str) -> String {
        format!("{}{}", self.prefix, key)
    }

    pub(crate) fn timeout_error(&self, what: String, waited: Duration) -> StoreError {
        StoreError::Timeout {
            addr: self.addr.clone(),
            what,
            waited,
        }
    }

    fn expect_ok(
        &self,
        op: &'static str,
        req: Request,
        timeout: Duration,
    ) -> Result<(), StoreError> {
        match self.request(req, timeout)? {
            Response::Ok => Ok(()),
            other => Err(self.unexpected(op, other)),
        }
    }

    fn unexpected(&self, op: &'static str, response: Response) -> StoreError {
        match response {
            Response::Error {
                code: ErrorCode::Unauthorized | ErrorCode::VersionMismatch,
                message,
            } => StoreError::Refused {
                addr: self.addr.clone(),
                message,
            },
            Response::Error { code, message } => StoreError::Rejected {
                addr: self.addr.clone(),
                op,
                code,
                message,
            },
            other => StoreError::Disconnected {
                addr: self.addr.clone(),
                op,
                detail: format!("unexpected reply {other:?}"),
            },
        }
    }

    /// Sends one request and reads its reply. `wait` is how long the server
    /// may legitimately take; the client waits that plus a grace period.
    fn request(&self, req: Request, wait: Duration) -> Result<Response, StoreError> {
        let op = req.name();
        let mut conn = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(why) = &conn.broken {
            return Err(StoreError::Disconnected {
                addr: self.addr.clone(),
                op,
                detail: why.clone(),
            });
        }
        let deadline = wait.saturating_add(REPLY_GRACE);
        let frame = req.encode();
        let sent = conn.writer.write_all(&frame);
        let _ = conn.reader.get_ref().set_read_timeout(Some(deadline));
        // Even when the write failed, the server may have sent an error
        // (e.g. "frame too large") before closing: try to read it.
        let reply = protocol::read_frame(&mut conn.reader, usize::MAX >> 1);
        let result = match (reply, sent) {
            (Ok(body), _) => Response::decode(&body).map_err(|e| e.to_string()),
            (Err(ProtocolError::Closed), _) => Err("the server closed the connection".to_string()),
            (Err(ProtocolError::Truncated(e)), _)
                if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) =>
            {
                Err(format!(
                    "no reply within {deadline:.1?}; the server is unresponsive or unreachable"
                ))
            }
            (Err(e), Err(w)) => Err(format!("{w}; {e}")),
            (Err(e), Ok(())) => Err(e.to_string()),
        };
        match result {
            Ok(resp) => {
                if let Response::Error { code, .. } = &resp {
                    // The server closes the connection after these.
                    if matches!(
                        code,
                        ErrorCode::Malformed
                            | ErrorCode::TooLarge
                            | ErrorCode::Unauthorized
                            | ErrorCode::VersionMismatch
                            | ErrorCode::TooManyConnections
                    ) {
                        conn.broken = Some(format!(
                            "the server closed the connection after a {code:?} error"
                        ));
                    }
                }
                Ok(resp)
            }
            Err(detail) => {
                conn.broken = Some(detail.clone());
                Err(StoreError::Disconnected {
                    addr: self.addr.clone(),
                    op,
                    detail,
                })
            }
        }
    }
}

/// Why a connection attempt is worth repeating.
enum Retry {
    /// No TCP connection could be made (the error).
    Unreachable(String),
    /// The server is at its connection cap (its message).
    Full(String),
}

fn millis(d: Duration) -> u64 {
    d.as_millis().min(u64::MAX as u128) as u64
}

fn try_connect(addr: &str, remaining: Duration) -> Result<TcpStream, String> {
    let addrs: Vec<SocketAddr> = addr
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve {addr:?}: {e}"))?
        .collect();
    let mut last = format!("{addr:?} resolved to no address");
    for a in addrs {
        let per_try = remaining.clamp(Duration::from_millis(10), Duration::from_secs(5));
        match TcpStream::connect_timeout(&a, per_try) {
            Ok(s) => return Ok(s),
            Err(e) => last = format!("{a}: {e}"),
        }
    }
    Err(last)
}
