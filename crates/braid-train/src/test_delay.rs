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

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
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

/// `BRAID_TEST_STRAGGLE=P[@RANK][:SEED]` (experiments and tests): with
/// probability P, once per step, a rank (RANK alone, else any) sleeps as
/// long as its previous step took (its data, forward and backward passes)
/// between its last forward pass and its backward pass, so its gradients
/// come that much later — the transient stragglers of the SSP paper's
/// experiments, a worker whose computation takes twice as long (`1@1`:
/// rank 1 at half speed throughout). The draw is a hash of (SEED, rank,
/// step): the same stragglers on every run. (Until 2026-12-07 the sleep
/// came after the backward pass, once the gradients were on their way, so
/// that synchronous training hid part of it.)
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Straggle {
    pub probability: f64,
    pub rank: Option<usize>,
    pub seed: u64,
}

impl Straggle {
    /// Parses the variable's value.
    pub fn parse(v: &str) -> Result<Straggle, String> {
        let bad = || {
            format!(
                "BRAID_TEST_STRAGGLE={v:?}: expected P[@RANK][:SEED] (a probability from 0 to 1, \
                 e.g. 0.2:7, or 1@1 for rank 1 at half speed)"
            )
        };
        let (head, seed) = match v.split_once(':') {
            Some((h, s)) => (h, s.parse().map_err(|_| bad())?),
            None => (v, 0),
        };
        let (p, rank) = match head.split_once('@') {
            Some((p, r)) => (p, Some(r.parse().map_err(|_| bad())?)),
            None => (head, None),
        };
        let probability: f64 = p.parse().map_err(|_| bad())?;
        if !(0.0..=1.0).contains(&probability) {
            return Err(bad());
        }
        Ok(Straggle {
            probability,
            rank,
            seed,
        })
    }

    /// Whether rank `rank` straggles in step `step`.
    pub fn hits(&self, rank: usize, step: usize) -> bool {
        if self.rank.is_some_and(|r| r != rank) {
            return false;
        }
        // SplitMix64 of the three: a uniform draw in [0, 1).
        let mut z = self
            .seed
            .wrapping_add((rank as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15))
            .wrapping_add((step as u64).wrapping_mul(0xBF58_476D_1CE4_E5B9));
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        ((z >> 11) as f64 / (1u64 << 53) as f64) < self.probability
    }
}

fn straggle_setting() -> Option<Straggle> {
    static S: OnceLock<Option<Straggle>> = OnceLock::new();
    *S.get_or_init(|| {
        let v = std::env::var(braid_core::env::BRAID_TEST_STRAGGLE).ok()?;
        match Straggle::parse(&v) {
            Ok(s) => Some(s),
            Err(e) => {
                eprintln!("braid: warning: ignoring {e}");
                None
            }
        }
    })
}

/// Each rank's last step's length, its straggling aside.
fn last_steps() -> &'static Mutex<HashMap<usize, Duration>> {
    static L: OnceLock<Mutex<HashMap<usize, Duration>>> = OnceLock::new();
    L.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Before the backward pass of rank `rank`'s step `step`, `so_far` into
/// it: if it straggles (`BRAID_TEST_STRAGGLE`), sleeps as long as its last
/// step took (its first: three times `so_far`, about a forward pass's
/// share). What it slept.
#[inline]
pub(crate) fn straggle(rank: usize, step: usize, so_far: Duration) -> Duration {
    let Some(s) = straggle_setting() else {
        return Duration::ZERO;
    };
    if !s.hits(rank, step) {
        return Duration::ZERO;
    }
    let last = last_steps().lock().ok().and_then(|l| l.get(&rank).copied());
    let sleep = last.unwrap_or(3 * so_far);
    let _s = braid_trace::span(
        "test straggle",
        braid_trace::Cat::Compute,
        braid_trace::recorder::track::HOST,
    );
    std::thread::sleep(sleep);
    sleep
}

/// Rank `rank`'s step took `took`, its straggling aside (what the next
/// straggle sleeps).
#[inline]
pub(crate) fn stepped(rank: usize, took: Duration) {
    if straggle_setting().is_some() {
        if let Ok(mut l) = last_steps().lock() {
            l.insert(rank, took);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Straggle;

    #[test]
    fn stragglers_parse_and_hit_at_their_rate() {
        let s = Straggle::parse("0.25:7").unwrap();
        let hits = (0..4000).filter(|i| s.hits(i % 4, i / 4)).count();
        assert!((850..1150).contains(&hits), "{hits} of 4000 at 0.25");
        assert_eq!(hits, (0..4000).filter(|i| s.hits(i % 4, i / 4)).count());
        let one = Straggle::parse("1@1").unwrap();
        assert!(one.hits(1, 5) && !one.hits(0, 5));
        for bad in ["2", "x", "0.5@y", "0.5:z"] {
            assert!(Straggle::parse(bad).is_err(), "{bad}");
        }
    }
}
