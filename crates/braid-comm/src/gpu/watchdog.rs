//! The GPU communicator's watchdog: the one failure `DeviceWork::wait`
//! cannot handle is a thread stuck *inside* an NCCL call — enqueueing
//! blocks once CUDA's launch queue is full of kernels that wait for a dead
//! peer. Aborting the NCCL communicator under that call would free it while
//! in use, so, like PyTorch's NCCL watchdog, this thread ends the process
//! with an error naming the operation once the communicator has been
//! aborted (a peer died, another rank failed) or the timeout has passed,
//! after writing the rank's flight record.

use crate::flight::Recorder;
use crate::health::Health;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long an enqueue may stay blocked after an abort before the process
/// is ended.
const GRACE_AFTER_ABORT: Duration = Duration::from_secs(3);

/// What the enqueueing thread is doing, shared with the watchdog.
#[derive(Default)]
pub(crate) struct Enqueue {
    /// Sequence number of the operation being enqueued; 0 when none.
    seq: AtomicU64,
    /// Its name.
    op: Mutex<&'static str>,
    /// When it started, in ms since `epoch`.
    since_ms: AtomicU64,
    stop: AtomicBool,
}

/// Marks an enqueue in progress until dropped.
pub(crate) struct EnqueueGuard<'a>(&'a Enqueue);

impl Drop for EnqueueGuard<'_> {
    fn drop(&mut self) {
        self.0.seq.store(0, Ordering::SeqCst);
    }
}

pub(crate) struct Watchdog {
    pub(crate) state: Arc<Enqueue>,
    epoch: Instant,
}

impl Watchdog {
    pub(crate) fn start(
        rank: usize,
        health: Arc<Health>,
        timeout: Duration,
        flight: Arc<Recorder>,
    ) -> Watchdog {
        let state = Arc::new(Enqueue::default());
        let epoch = Instant::now();
        let s = state.clone();
        let _ = std::thread::Builder::new()
            .name(format!("braid-gpu-watchdog-{rank}"))
            .spawn(move || loop {
                std::thread::sleep(Duration::from_millis(100));
                if s.stop.load(Ordering::SeqCst) {
                    return;
                }
                let seq = s.seq.load(Ordering::SeqCst);
                if seq == 0 {
                    continue;
                }
                let since = Duration::from_millis(s.since_ms.load(Ordering::SeqCst));
                let stuck = epoch.elapsed().saturating_sub(since);
                let op = *s.op.lock().unwrap_or_else(|p| p.into_inner());
                let why = if health.is_aborted() && stuck > GRACE_AFTER_ABORT {
                    health.reason()
                } else if stuck > timeout {
                    format!("timed out after {stuck:.1?} (raise BRAID_TIMEOUT if this is expected)")
                } else {
                    continue;
                };
                let stuck = format!(
                    "rank {rank}: {op} #{seq} is stuck inside NCCL (its kernels wait for a peer): {why}"
                );
                // The stuck thread holds the NCCL locks, not the recorder's.
                flight.dump("stuck inside NCCL", &stuck);
                eprintln!("braid: error: {stuck}; ending the process");
                // SAFETY: _exit ends the process without running atexit
                // handlers, which could block on the stuck GPU context.
                unsafe { libc::_exit(1) };
            });
        Watchdog { state, epoch }
    }

    /// Marks `op` #`seq` as being enqueued.
    pub(crate) fn enter(&self, op: &'static str, seq: u64) -> EnqueueGuard<'_> {
        *self.state.op.lock().unwrap_or_else(|p| p.into_inner()) = op;
        self.state
            .since_ms
            .store(self.epoch.elapsed().as_millis() as u64, Ordering::SeqCst);
        self.state.seq.store(seq, Ordering::SeqCst);
        EnqueueGuard(&self.state)
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.state.stop.store(true, Ordering::SeqCst);
    }
}
