//! Phase timing on the GPU (`BRAID_PROFILE=1`): timed events recorded on
//! the model's stream between phases; at the end of each step the time
//! between consecutive events is added to the phase that ended at the
//! second one. Off, every call returns at once.

use braid_cuda::{Device, Event, Result, Stream};
use std::collections::BTreeMap;

/// Per-phase GPU time over the steps profiled.
pub struct PhaseTimer {
    device: Option<Device>,
    events: Vec<Event>,
    names: Vec<&'static str>,
    totals: BTreeMap<&'static str, (f64, usize)>,
    steps: usize,
}

impl PhaseTimer {
    /// A timer on `device`, enabled when `BRAID_PROFILE` is set to
    /// something other than `0`.
    pub fn from_env(device: &Device) -> PhaseTimer {
        let on =
            std::env::var(braid_core::env::BRAID_PROFILE).is_ok_and(|v| !v.is_empty() && v != "0");
        PhaseTimer {
            device: on.then(|| device.clone()),
            events: Vec::new(),
            names: Vec::new(),
            totals: BTreeMap::new(),
            steps: 0,
        }
    }

    /// A timer that times nothing (while a graph is captured).
    pub fn off() -> PhaseTimer {
        PhaseTimer {
            device: None,
            events: Vec::new(),
            names: Vec::new(),
            totals: BTreeMap::new(),
            steps: 0,
        }
    }

    /// Whether phases are being timed.
    pub fn enabled(&self) -> bool {
        self.device.is_some()
    }

    /// Marks the end of phase `name` (the work queued on `s` since the
    /// previous mark).
    pub fn mark(&mut self, s: &Stream, name: &'static str) -> Result<()> {
        let Some(device) = &self.device else {
            return Ok(());
        };
        let i = self.names.len();
        if i == self.events.len() {
            self.events.push(Event::timed(device)?);
        }
        self.events[i].record(s)?;
        self.names.push(name);
        Ok(())
    }

    /// Waits for the marks of this step and adds their times up.
    pub fn end_step(&mut self) -> Result<()> {
        if self.device.is_none() || self.names.is_empty() {
            return Ok(());
        }
        self.events[self.names.len() - 1].synchronize()?;
        for i in 1..self.names.len() {
            let ms = self.events[i].elapsed_ms(&self.events[i - 1])? as f64;
            let e = self.totals.entry(self.names[i]).or_insert((0.0, 0));
            e.0 += ms;
            e.1 += 1;
        }
        self.names.clear();
        self.steps += 1;
        Ok(())
    }

    /// Forgets what was measured so far (after warm-up steps).
    pub fn reset(&mut self) {
        self.totals.clear();
        self.steps = 0;
    }

    /// A table: per phase, milliseconds per step and share of the total,
    /// largest first.
    pub fn report(&self) -> Option<String> {
        if self.steps == 0 {
            return None;
        }
        let total: f64 = self.totals.values().map(|v| v.0).sum();
        let mut rows: Vec<_> = self.totals.iter().collect();
        rows.sort_by(|a, b| b.1 .0.partial_cmp(&a.1 .0).expect("finite"));
        let mut out = format!(
            "GPU time per step by phase ({} steps, {:.2} ms per step marked):\n",
            self.steps,
            total / self.steps as f64
        );
        for (name, (ms, calls)) in rows {
            out.push_str(&format!(
                "  {:<28} {:>8.3} ms {:>5.1}%  ({} per step)\n",
                name,
                ms / self.steps as f64,
                100.0 * ms / total.max(1e-12),
                calls / self.steps
            ));
        }
        Some(out)
    }
}
