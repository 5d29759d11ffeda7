//! [`CommError`]: every way a collective can fail, each naming the
//! operation, its sequence number and the rank(s) involved.

use braid_store::StoreError;
use std::time::Duration;

/// A failed communicator operation.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CommError {
    /// The operation did not complete in time.
    #[error("{}", timeout_message(*.rank, .op, *.seq, .waiting_for, *.waited, .diagnosis.as_deref()))]
    Timeout {
        /// This rank.
        rank: usize,
        /// Operation.
        op: &'static str,
        /// Its sequence number on this communicator.
        seq: u64,
        /// Ranks whose contribution had not arrived.
        waiting_for: Vec<usize>,
        /// Time waited.
        waited: Duration,
        /// Who the operation waits for and why, from the other ranks'
        /// heartbeats (see [`crate::flight`]).
        diagnosis: Option<String>,
    },
    /// A peer process died or its connection broke.
    #[error("rank {rank}: {op} #{seq} failed because rank {peer} {detail}")]
    PeerFailed {
        /// This rank.
        rank: usize,
        /// Operation in flight.
        op: &'static str,
        /// Its sequence number.
        seq: u64,
        /// The failed peer.
        peer: usize,
        /// What happened to it.
        detail: String,
    },
    /// The communicator was aborted (by this or another rank).
    #[error("rank {rank}: communicator aborted: {reason}")]
    Aborted {
        /// This rank.
        rank: usize,
        /// Why, as first reported.
        reason: String,
    },
    /// Ranks called different operations, counts, dtypes or roots.
    #[error("{0}")]
    Mismatch(String),
    /// The caller's arguments are inconsistent.
    #[error("invalid {op} call on rank {rank}: {why}")]
    Invalid {
        /// This rank.
        rank: usize,
        /// Operation.
        op: &'static str,
        /// What is wrong.
        why: String,
    },
    /// A GPU operation failed (a CUDA or NCCL error, reported by the
    /// library while enqueueing or while the kernels ran).
    #[error("rank {rank}: {op} #{seq} failed on the GPU: {detail}")]
    Gpu {
        /// This rank.
        rank: usize,
        /// Operation.
        op: &'static str,
        /// Its sequence number on this communicator.
        seq: u64,
        /// The CUDA/NCCL error.
        detail: String,
    },
    /// Setting up the communicator failed.
    #[error("communicator setup failed: {0}")]
    Setup(String),
    /// The rendezvous store failed.
    #[error("rendezvous store: {0}")]
    Store(String),
}

impl From<StoreError> for CommError {
    fn from(e: StoreError) -> Self {
        CommError::Store(e.to_string())
    }
}

fn timeout_message(
    rank: usize,
    op: &str,
    seq: u64,
    waiting_for: &[usize],
    waited: Duration,
    diagnosis: Option<&str>,
) -> String {
    match diagnosis {
        Some(d) => {
            let direct = if waiting_for.is_empty() {
                String::new()
            } else {
                format!("; the transfer waited on rank(s) {waiting_for:?}")
            };
            format!(
                "rank {rank}: {op} #{seq} timed out after {waited:.1?}: {d}{direct} (raise BRAID_TIMEOUT if this is expected)"
            )
        }
        None => format!(
            "rank {rank}: {op} #{seq} timed out after {waited:.1?} waiting for rank(s) {waiting_for:?} (raise BRAID_TIMEOUT if this is expected; a rank may be stuck or may have called a different operation)"
        ),
    }
}

/// Result of communicator operations.
pub type Result<T, E = CommError> = std::result::Result<T, E>;
