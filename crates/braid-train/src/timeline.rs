//! [`Timeline`]: points recorded in a step (data ready, forward done,
//! backward computed, gradients reduced, update done) and the time between
//! them, on the engine's own clock — CUDA events on its stream when it
//! runs on a GPU (the host runs ahead of the device there), the host clock
//! otherwise.

use crate::Result;
use braid_cuda::{Event, Stream};
use std::time::Instant;

/// Points on one step's timeline.
#[derive(Default)]
pub struct Timeline {
    host: Vec<Instant>,
    events: Vec<Event>,
    used: usize,
}

fn e(x: impl std::fmt::Display) -> String {
    x.to_string()
}

impl Timeline {
    /// An empty timeline.
    pub fn new() -> Timeline {
        Timeline::default()
    }

    /// Forgets the points (their events are reused).
    pub fn clear(&mut self) {
        self.host.clear();
        self.used = 0;
    }

    /// Records a point after the work queued so far on `stream` (or now,
    /// on the host clock, without one); returns its index.
    pub fn mark(&mut self, stream: Option<&Stream>) -> Result<usize> {
        let i = self.host.len();
        self.host.push(Instant::now());
        if let Some(s) = stream {
            if self.used == self.events.len() {
                self.events.push(Event::timed(s.device()).map_err(e)?);
            }
            self.events[self.used].record(s).map_err(e)?;
            self.used += 1;
            if self.used != i + 1 {
                return Err("a timeline mixes host and device points".into());
            }
        }
        Ok(i)
    }

    /// Point `i` on the host's clock: the first point's host time plus
    /// the engine's time from it (device points: after the stream has
    /// passed `i`; the first point must have been marked on an idle
    /// stream for the two clocks to meet there).
    pub fn instant(&self, i: usize) -> Result<Instant> {
        let first = *self.host.first().ok_or("an empty timeline")?;
        Ok(first + std::time::Duration::from_secs_f64(self.seconds(0, i)?.max(0.0)))
    }

    /// Seconds from point `a` to point `b` (device points: after the
    /// stream has passed `b`).
    pub fn seconds(&self, a: usize, b: usize) -> Result<f64> {
        if self.used > 0 {
            if b >= self.used || a >= self.used {
                return Err(format!("timeline points {a}, {b} of {}", self.used));
            }
            return Ok(self.events[b].elapsed_ms(&self.events[a]).map_err(e)? as f64 / 1e3);
        }
        match (self.host.get(a), self.host.get(b)) {
            (Some(x), Some(y)) => Ok(y.saturating_duration_since(*x).as_secs_f64()),
            _ => Err(format!("timeline points {a}, {b} of {}", self.host.len())),
        }
    }
}
