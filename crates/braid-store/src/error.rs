//! [`StoreError`]: everything that can go wrong talking to the store, with
//! messages that name the address, the operation, the key(s) and the time
//! waited.

use crate::protocol::ErrorCode;
use std::time::Duration;

/// A failed store operation.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The server could not listen on its address.
    #[error("the store could not listen on {addr}: {source}{hint}")]
    Bind {
        /// Address it tried.
        addr: String,
        /// The operating system's error.
        source: std::io::Error,
        /// What to do about it.
        hint: String,
    },
    /// No connection could be made before the deadline.
    #[error("could not connect to the store at {addr} within {waited:.1?} (last error: {last_error}); is the launcher or rank 0 running, and is the address reachable from here?")]
    Connect {
        /// Address tried.
        addr: String,
        /// Time spent retrying.
        waited: Duration,
        /// The last connection error.
        last_error: String,
    },
    /// The server refused this client (wrong token, wrong version).
    #[error("the store at {addr} refused this client: {message}")]
    Refused {
        /// Server address.
        addr: String,
        /// The server's reason.
        message: String,
    },
    /// A blocking operation did not complete in time.
    #[error("timed out after {waited:.1?} waiting for {what} in the store at {addr}")]
    Timeout {
        /// Server address.
        addr: String,
        /// What was awaited: the key(s), or the barrier and missing ranks.
        what: String,
        /// How long it waited.
        waited: Duration,
    },
    /// The connection broke or the server stopped answering.
    #[error("lost the store at {addr} during {op}: {detail}")]
    Disconnected {
        /// Server address.
        addr: String,
        /// Operation in flight.
        op: &'static str,
        /// What happened.
        detail: String,
    },
    /// The server answered the operation with an error.
    #[error("the store at {addr} rejected {op}: {message}")]
    Rejected {
        /// Server address.
        addr: String,
        /// Operation.
        op: &'static str,
        /// Error category.
        code: ErrorCode,
        /// Server's message.
        message: String,
    },
    /// The caller asked for something invalid (e.g. a key over the limit).
    #[error("invalid store request: {0}")]
    Invalid(String),
}

impl StoreError {
    /// Adds the caller's own advice to a failed bind whose port was taken
    /// (the store knows the port is in use; only its caller knows which
    /// flag or variable chose it).
    pub fn advise_port_in_use(self, advice: &str) -> StoreError {
        match self {
            StoreError::Bind { addr, source, hint }
                if source.kind() == std::io::ErrorKind::AddrInUse =>
            {
                StoreError::Bind {
                    addr,
                    source,
                    hint: format!("{hint}; {advice}"),
                }
            }
            other => other,
        }
    }
}
