//! [`Flag`]: a monotonically increasing counter in shared memory that one
//! process posts and others wait on — spinning first, then yielding, then
//! sleeping on a futex — with every wait bounded by the operation's
//! deadline and the communicator's abort flag.

use crate::backend::Ctx;
use crate::error::Result;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A counter shared between processes.
#[repr(C)]
pub struct Flag {
    value: AtomicU64,
    /// Low 32 bits of `value`: what futex waiters sleep on.
    word: AtomicU32,
    /// Number of waiters asleep on `word`.
    sleepers: AtomicU32,
}

impl Flag {
    /// Publishes `v` (which must not be below the current value) and wakes
    /// sleepers. Everything written before is visible to whoever sees `v`.
    #[inline]
    pub fn post(&self, v: u64) {
        self.value.store(v, Ordering::Release);
        self.word.store(v as u32, Ordering::SeqCst);
        if self.sleepers.load(Ordering::SeqCst) > 0 {
            futex_wake(&self.word);
        }
    }

    /// The current value (acquire).
    #[inline]
    pub fn get(&self) -> u64 {
        self.value.load(Ordering::Acquire)
    }
}

/// How long a waiter spins and yields before sleeping.
#[derive(Debug, Clone, Copy)]
pub struct WaitPolicy {
    /// Busy-wait iterations.
    pub spin: u32,
    /// Time spent yielding the CPU after spinning.
    pub yield_for: Duration,
}

impl WaitPolicy {
    /// Spin hard when every rank has a core; yield early when ranks
    /// outnumber cores, so that the rank being waited for can run.
    pub fn for_ranks(local_ranks: usize) -> WaitPolicy {
        let cores = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1);
        if local_ranks > cores {
            WaitPolicy {
                spin: 32,
                yield_for: Duration::from_millis(2),
            }
        } else {
            WaitPolicy {
                spin: 50_000,
                yield_for: Duration::from_millis(2),
            }
        }
    }
}

/// Waits until `flag >= target`; `who` names the rank that posts it.
#[inline]
pub fn wait(flag: &Flag, target: u64, policy: WaitPolicy, ctx: &Ctx, who: usize) -> Result<()> {
    if flag.get() >= target {
        return Ok(());
    }
    wait_slow(flag, target, policy, ctx, who)
}

#[cold]
fn wait_slow(flag: &Flag, target: u64, policy: WaitPolicy, ctx: &Ctx, who: usize) -> Result<()> {
    for i in 0..policy.spin {
        std::hint::spin_loop();
        if flag.get() >= target {
            return Ok(());
        }
        if i % 4096 == 4095 && ctx.health.is_aborted() {
            return Err(ctx.aborted());
        }
    }
    let yield_until = Instant::now() + policy.yield_for;
    while Instant::now() < yield_until {
        std::thread::yield_now();
        if flag.get() >= target {
            return Ok(());
        }
        if ctx.health.is_aborted() {
            return Err(ctx.aborted());
        }
    }
    loop {
        ctx.check(|| vec![who])?;
        flag.sleepers.fetch_add(1, Ordering::SeqCst);
        let seen = flag.word.load(Ordering::SeqCst);
        if flag.get() >= target {
            flag.sleepers.fetch_sub(1, Ordering::SeqCst);
            return Ok(());
        }
        futex_wait(&flag.word, seen, Duration::from_millis(20));
        flag.sleepers.fetch_sub(1, Ordering::SeqCst);
        if flag.get() >= target {
            return Ok(());
        }
    }
}

fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: FUTEX_WAIT on a valid, aligned u32 (inside a live mapping)
    // with a valid timespec; it only reads `word` and may return early.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            0usize,
            0u32,
        );
    }
}

fn futex_wake(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE on a valid, aligned u32; wakes every waiter.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            0usize,
            0usize,
            0u32,
        );
    }
}
