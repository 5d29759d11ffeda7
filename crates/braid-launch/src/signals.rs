//! The launcher's own signals: Ctrl-C (SIGINT), SIGTERM and SIGHUP are
//! caught rather than killing the launcher, so that it can forward them to
//! the workers and clean up.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Signals the launcher has received.
#[derive(Clone)]
pub struct Signals {
    last: Arc<AtomicUsize>,
    count: Arc<AtomicUsize>,
}

impl Signals {
    /// Catches SIGINT, SIGTERM and SIGHUP from now on.
    pub fn install() -> std::io::Result<Signals> {
        let last = Arc::new(AtomicUsize::new(0));
        let count = Arc::new(AtomicUsize::new(0));
        for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
            signal_hook::flag::register_usize(sig, last.clone(), sig as usize)?;
            let c = count.clone();
            // SAFETY: the handler only increments an atomic, which is
            // async-signal-safe.
            unsafe {
                signal_hook::low_level::register(sig, move || {
                    c.fetch_add(1, Ordering::SeqCst);
                })?;
            }
        }
        Ok(Signals { last, count })
    }

    /// A set that never reports a signal (for library use without handlers).
    pub fn none() -> Signals {
        Signals {
            last: Arc::new(AtomicUsize::new(0)),
            count: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// The most recent signal received, if any.
    pub fn received(&self) -> Option<i32> {
        match self.last.load(Ordering::SeqCst) {
            0 => None,
            s => Some(s as i32),
        }
    }

    /// How many signals have arrived in total (a second Ctrl-C escalates).
    pub fn count(&self) -> usize {
        self.count.load(Ordering::SeqCst)
    }
}
