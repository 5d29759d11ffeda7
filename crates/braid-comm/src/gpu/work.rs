//! [`DeviceWork`]: the handle of a queued GPU operation.
//!
//! `wait` polls the completion event; between polls it checks NCCL's
//! asynchronous error, the host communicator's abort flag (raised by the
//! health monitor when a local peer process dies, or by another rank) and
//! the deadline. Any of those aborts the NCCL communicator — which stops
//! its kernels — and returns an error naming the operation and its
//! sequence number, so a dead peer never leaves the GPU spinning forever.
//! A wait that sees the operation complete marks it (and every earlier one
//! of its communicator) completed in the flight recorder; a failure marks
//! it failed, and a timeout's error names the rank it waits for from the
//! other ranks' heartbeats.

use super::GpuCommunicator;
use crate::error::{CommError, Result};
use crate::health;
use braid_cuda::{Event, Stream};
use std::marker::PhantomData;
use std::time::{Duration, Instant};

/// How long a wait spins on its events before it yields, then sleeps.
const SPIN: Duration = Duration::from_millis(100);

/// What a host loop polling GPU events does between polls, `waited` into
/// its wait: spin for a while (a training step's backward pass runs tens
/// of ms after its reductions are queued; a sleeping host notices their
/// end up to ~0.1 ms late and the GPU idles meanwhile), then yield, then
/// sleep.
pub fn poll_pause(waited: Duration) {
    if waited < SPIN {
        std::hint::spin_loop();
    } else if waited < 2 * SPIN {
        std::thread::yield_now();
    } else {
        std::thread::sleep(Duration::from_micros(50));
    }
}

/// A GPU operation in flight. Dropping it without waiting orders the
/// device's main stream after it (later copies and kernels see its result)
/// without blocking the host.
#[must_use = "wait for the operation, or drop the handle to order the main stream after it"]
pub struct DeviceWork<'a> {
    comm: &'a GpuCommunicator,
    op: &'static str,
    seq: u64,
    /// Its record in the flight recorder.
    record: u64,
    started: Instant,
    /// (member index, completion event); empty once finished.
    events: Vec<(usize, Event)>,
    _borrows: PhantomData<&'a mut ()>,
}

impl<'a> DeviceWork<'a> {
    pub(crate) fn new(
        comm: &'a GpuCommunicator,
        op: &'static str,
        seq: u64,
        record: u64,
        events: Vec<(usize, Event)>,
    ) -> Self {
        DeviceWork {
            comm,
            op,
            seq,
            record,
            started: Instant::now(),
            events,
            _borrows: PhantomData,
        }
    }

    /// The operation's sequence number on its communicator.
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// Whether the operation has completed (never blocks).
    pub fn is_completed(&self) -> bool {
        let done = self.events.iter().all(|(_, e)| e.query().unwrap_or(true));
        if done {
            self.comm
                .flight
                .gpu_completed(self.record, self.seq, self.op);
        }
        done
    }

    /// Blocks until the operation completes; fails (after aborting the
    /// NCCL communicator) on an NCCL error, an aborted communicator, or
    /// the communicator's timeout.
    pub fn wait(mut self) -> Result<()> {
        let deadline = self.started + self.comm.timeout();
        let r = self.wait_until(deadline, true).map(|_| ());
        if r.is_err() {
            self.forget_events();
        }
        r
    }

    /// After a failure: the communicator is aborted and the events may
    /// never complete, so nothing is ordered after them.
    fn forget_events(&mut self) {
        for (k, e) in std::mem::take(&mut self.events) {
            self.comm.members()[k].recycle(e);
        }
    }

    /// Waits at most `timeout`: `Ok(true)` when done, `Ok(false)` when still
    /// running (the handle stays valid). Failures are as for `wait`.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Result<bool> {
        let hard = self.started + self.comm.timeout();
        let soft = Instant::now() + timeout;
        let r = if soft >= hard {
            self.wait_until(hard, true)
        } else {
            self.wait_until(soft, false)
        };
        if r.is_err() {
            self.forget_events();
        }
        r
    }

    /// Makes later work on `stream` wait for this operation, without
    /// blocking the host (the DDP pattern: the optimizer's stream waits for
    /// the gradient all-reduce).
    pub fn then_on(mut self, stream: &Stream) -> Result<()> {
        let events = std::mem::take(&mut self.events);
        let mut result = Ok(());
        for (k, e) in events {
            if result.is_ok() {
                result = stream
                    .wait_event(&e)
                    .map_err(|err| self.comm.gpu_err(self.op, self.seq, err));
            }
            self.comm.members()[k].recycle(e);
        }
        result
    }

    fn wait_until(&mut self, deadline: Instant, hard: bool) -> Result<bool> {
        let mut polls = 0u32;
        let started = Instant::now();
        loop {
            let mut all = true;
            for (_, e) in &self.events {
                match e.query() {
                    Ok(true) => {}
                    Ok(false) => {
                        all = false;
                        break;
                    }
                    Err(err) => return Err(self.fail(err.to_string())),
                }
            }
            if all {
                self.finish();
                self.comm
                    .flight
                    .gpu_completed(self.record, self.seq, self.op);
                return Ok(true);
            }
            polls += 1;
            // Check the slower conditions every few polls.
            if polls % 64 == 0 {
                self.check()?;
                if Instant::now() >= deadline {
                    if !hard {
                        return Ok(false);
                    }
                    return Err(self.timed_out());
                }
            }
            poll_pause(started.elapsed());
        }
    }

    fn finish(&mut self) {
        for (k, e) in std::mem::take(&mut self.events) {
            self.comm.members()[k].recycle(e);
        }
    }

    /// NCCL's asynchronous errors and the host abort flag.
    fn check(&self) -> Result<()> {
        for m in self.comm.members() {
            let err = m.lock().async_error();
            if let Err(e) = err {
                return Err(self.fail(e.to_string()));
            }
            let err = m
                .lock_gathers()
                .as_ref()
                .map_or(Ok(()), |g| g.async_error());
            if let Err(e) = err {
                return Err(self.fail(format!("(the gathers' communicator) {e}")));
            }
        }
        let health = &self.comm.host().inner.health;
        if health.is_aborted() {
            self.comm.flight.gpu_failed(self.record, self.seq, self.op);
            self.comm.abort_nccl();
            return Err(CommError::Aborted {
                rank: self.comm.rank(),
                reason: format!(
                    "{} (seen while waiting for {} #{} on the GPU; NCCL communicator aborted)",
                    health.reason(),
                    self.op,
                    self.seq
                ),
            });
        }
        Ok(())
    }

    /// Aborts everything after a CUDA/NCCL failure and names it.
    fn fail(&self, detail: String) -> CommError {
        // (The events are left to `forget_events`: the operation failed,
        // so nothing may be ordered after it.)
        self.comm.flight.gpu_failed(self.record, self.seq, self.op);
        self.comm.abort_nccl();
        let err = CommError::Gpu {
            rank: self.comm.rank(),
            op: self.op,
            seq: self.seq,
            detail,
        };
        let inner = &self.comm.host().inner;
        let standing = health::publish_abort(&inner.store, &err.to_string());
        inner.health.abort(standing);
        err
    }

    fn timed_out(&self) -> CommError {
        self.comm.flight.gpu_failed(self.record, self.seq, self.op);
        self.comm.abort_nccl();
        let diagnosis = self
            .comm
            .host()
            .diagnose_timeout_of(&self.comm.flight, self.seq);
        let err = CommError::Timeout {
            rank: self.comm.rank(),
            op: self.op,
            seq: self.seq,
            waiting_for: Vec::new(),
            waited: self.started.elapsed(),
            diagnosis,
        };
        let inner = &self.comm.host().inner;
        let standing = health::publish_abort(&inner.store, &err.to_string());
        inner.health.abort(standing);
        err
    }
}

impl Drop for DeviceWork<'_> {
    fn drop(&mut self) {
        for (k, e) in std::mem::take(&mut self.events) {
            let m = &self.comm.members()[k];
            // Order the main stream after the operation so buffers read or
            // freed there later see it complete.
            let _ = m.device.main_stream().wait_event(&e);
            m.recycle(e);
        }
    }
}
