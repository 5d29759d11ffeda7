//! [`OutsideOp`]: an operation of a GPU communicator that its caller
//! carries itself instead of NCCL (the copy engines' all-reduce between two
//! GPUs of one host). It takes the next number of the communicator's
//! sequence and a flight record, like NCCL's operations, so that a rank
//! that stops in one shows in its heartbeat, and a timeout in one names
//! the rank it waits for from the other ranks' heartbeats.

use super::GpuCommunicator;
use crate::error::{CommError, Result};
use crate::health;
use braid_core::DType;
use std::time::{Duration, Instant};

/// An operation carried outside NCCL, numbered and recorded on its
/// communicator. End it with [`completed`](Self::completed) or one of
/// the failures; one that is dropped stays "enqueued" in the record.
#[must_use = "end the operation: completed, or a failure"]
pub struct OutsideOp {
    op: &'static str,
    seq: u64,
    record: u64,
    started: Instant,
}

impl GpuCommunicator {
    /// Starts operation `op` (`count` elements of `dtype`) that the caller
    /// carries itself: the next sequence number, recorded as enqueued.
    /// Every rank starts the same operations in the same order. Fails on
    /// an aborted communicator.
    pub fn outside(&self, op: &'static str, dtype: DType, count: u64) -> Result<OutsideOp> {
        self.check_usable()?;
        let seq = self.next_seq();
        let record = self.flight.gpu_enqueued(seq, op, Some(dtype), Some(count));
        Ok(OutsideOp {
            op,
            seq,
            record,
            started: Instant::now(),
        })
    }
}

impl OutsideOp {
    /// Its sequence number on the communicator.
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// How long ago it started.
    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    /// It completed on this rank.
    pub fn completed(self, comm: &GpuCommunicator) {
        comm.flight.gpu_completed(self.record, self.seq, self.op);
    }

    /// `Err` (marking it failed) when the communicator was aborted: by the
    /// health monitor (a local peer died), by another rank, or by a
    /// failure elsewhere in this one. Cheap enough to call between polls.
    pub fn check(&self, comm: &GpuCommunicator) -> Result<()> {
        let health = &comm.host().inner.health;
        if !health.is_aborted() {
            return Ok(());
        }
        comm.flight.gpu_failed(self.record, self.seq, self.op);
        Err(CommError::Aborted {
            rank: comm.rank(),
            reason: format!(
                "{} (seen while waiting for {} #{})",
                health.reason(),
                self.op,
                self.seq
            ),
        })
    }

    /// It failed on this rank with `detail` (a CUDA error): marked failed,
    /// and every rank told to abort.
    pub fn failed(self, comm: &GpuCommunicator, detail: String) -> CommError {
        comm.flight.gpu_failed(self.record, self.seq, self.op);
        let err = CommError::Gpu {
            rank: comm.rank(),
            op: self.op,
            seq: self.seq,
            detail,
        };
        abort_everywhere(comm, &err);
        err
    }

    /// It did not complete within the communicator's timeout: marked
    /// failed, the rank it waits for named from the others' heartbeats,
    /// and every rank told to abort.
    pub fn timed_out(self, comm: &GpuCommunicator) -> CommError {
        comm.flight.gpu_failed(self.record, self.seq, self.op);
        let diagnosis = comm.host().diagnose_timeout_of(&comm.flight, self.seq);
        let err = CommError::Timeout {
            rank: comm.rank(),
            op: self.op,
            seq: self.seq,
            waiting_for: Vec::new(),
            waited: self.started.elapsed(),
            diagnosis,
        };
        abort_everywhere(comm, &err);
        err
    }
}

/// Publishes `err` as the world's abort reason (the first one stands) and
/// raises this rank's abort flag, which also writes its flight record.
fn abort_everywhere(comm: &GpuCommunicator, err: &CommError) {
    let inner = &comm.host().inner;
    let standing = health::publish_abort(&inner.store, &err.to_string());
    inner.health.abort(standing);
}
