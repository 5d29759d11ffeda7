//! The launcher's own signals: Ctrl-C (SIGINT), SIGTERM and SIGHUP (and
//! SIGQUIT, or the set torchrun's `--signals-to-handle` names, under
//! `braid launch`) are caught rather than killing the launcher, so that it
//! can forward them to the workers and clean up.

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
        Signals::install_for(&[libc::SIGINT, libc::SIGTERM, libc::SIGHUP])
    }

    /// Catches `signals` from now on (SIGKILL and SIGSTOP cannot be).
    pub fn install_for(signals: &[i32]) -> std::io::Result<Signals> {
        let last = Arc::new(AtomicUsize::new(0));
        let count = Arc::new(AtomicUsize::new(0));
        for &sig in signals {
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

/// torchrun's default `--signals-to-handle`.
pub const TORCHRUN_SIGNALS: &str = "SIGTERM,SIGINT,SIGHUP,SIGQUIT";

/// Parses `--signals-to-handle`: names (`SIGTERM`, `TERM`) or numbers,
/// comma-separated; SIGKILL, SIGSTOP and SIGCHLD cannot be handled.
pub fn parse_signal_list(s: &str) -> Result<Vec<i32>, String> {
    use nix::sys::signal::Signal;
    use std::str::FromStr;
    let mut out = Vec::new();
    for name in s.split(',').map(str::trim).filter(|n| !n.is_empty()) {
        let upper = name.to_ascii_uppercase();
        let full = match upper.starts_with("SIG") {
            true => upper,
            false => format!("SIG{upper}"),
        };
        let sig = match name.parse::<i32>() {
            Ok(n) => Signal::try_from(n).ok(),
            Err(_) => Signal::from_str(&full).ok(),
        }
        .ok_or_else(|| {
            format!("--signals-to-handle: {name:?} is not a signal (e.g. SIGTERM,SIGINT,SIGUSR1)")
        })?;
        if matches!(sig, Signal::SIGKILL | Signal::SIGSTOP | Signal::SIGCHLD) {
            return Err(format!(
                "--signals-to-handle: {} cannot be caught and forwarded",
                sig.as_str()
            ));
        }
        out.push(sig as i32);
    }
    if out.is_empty() {
        return Err("--signals-to-handle: name at least one signal, e.g. SIGTERM".into());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signal_lists_read_names_and_numbers() {
        assert_eq!(
            parse_signal_list(TORCHRUN_SIGNALS),
            Ok(vec![
                libc::SIGTERM,
                libc::SIGINT,
                libc::SIGHUP,
                libc::SIGQUIT
            ])
        );
        assert_eq!(
            parse_signal_list("usr1, 15"),
            Ok(vec![libc::SIGUSR1, libc::SIGTERM])
        );
        assert!(parse_signal_list("SIGKILL").unwrap_err().contains("cannot"));
        assert!(parse_signal_list("SIGNOPE")
            .unwrap_err()
            .contains("not a signal"));
        assert!(parse_signal_list("").is_err());
    }
}
