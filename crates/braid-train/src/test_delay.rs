//! A test-only slowdown: `BRAID_TEST_DELAY=RANK:PHASE:MS[,…]` makes rank
//! RANK sleep MS milliseconds in every micro-batch's PHASE (`data`: after
//! loading its batch, counted as data time; `compute`: after its forward
//! pass, traced as computation on the host — on a GPU rank the device
//! idles meanwhile; `end`: once, after the run's last step and the
//! strategy's finish, before the communicator is dropped; `write`: in the
//! background writer of each checkpoint, before its files). It exists to
//! make a straggler on purpose, so that `braid report` can be checked to
//! name it, a rank that finishes late, so that the others' departure can
//! be checked not to look like a death to it, and a rank slow to write a
//! checkpoint, so that rank 0 can be checked to wait for its files before
//! committing; a malformed value is reported once and ignored. (Its
//! `dump` items — a rank slow to write its flight record — are read by
//! braid-comm's flight recorder, and skipped here.)

use std::sync::OnceLock;
use std::time::Duration;

fn delays() -> &'static [(usize, String, u64)] {
    static D: OnceLock<Vec<(usize, String, u64)>> = OnceLock::new();
    D.get_or_init(|| {
        let Ok(v) = std::env::var(braid_core::env::BRAID_TEST_DELAY) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for item in v.split(',').filter(|s| !s.is_empty()) {
            let parts: Vec<&str> = item.split(':').collect();
            let parsed = match parts.as_slice() {
                [_, "dump", _] => continue, // braid-comm's.
                [r, p, ms] if ["data", "compute", "end", "write"].contains(p) => {
                    r.parse().ok().zip(ms.parse().ok()).map(|(r, ms)| (r, p.to_string(), ms))
                }
                _ => None,
            };
            match parsed {
                Some(d) => out.push(d),
                None => eprintln!(
                    "braid: warning: ignoring BRAID_TEST_DELAY item {item:?} (want RANK:data|compute|end|write|dump:MS)"
                ),
            }
        }
        out
    })
}

/// Sleeps if rank `rank` is to be slowed in `phase`.
#[inline]
pub(crate) fn apply(rank: usize, phase: &str) {
    let d = delays();
    if d.is_empty() {
        return;
    }
    for (r, p, ms) in d {
        if *r == rank && p == phase {
            let cat = match phase {
                "data" => braid_trace::Cat::Data,
                "write" => braid_trace::Cat::Checkpoint,
                _ => braid_trace::Cat::Compute,
            };
            let _s = braid_trace::span("test delay", cat, braid_trace::recorder::track::HOST);
            std::thread::sleep(Duration::from_millis(*ms));
        }
    }
}
