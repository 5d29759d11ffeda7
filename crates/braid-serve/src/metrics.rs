//! The serving figures ([`Metrics`]), kept by the engine thread and read
//! by `/metrics` in Prometheus' text format: requests by how they ended,
//! tokens in and out, time to first token, time per output token and
//! request latency as histograms, and the queue, the running requests
//! and the KV blocks in use as gauges.

use crate::batcher::Stats;
use crate::request::{Finish, Usage};
use std::fmt::Write;
use std::sync::Mutex;
use std::time::Duration;

/// Upper bounds of the latency histograms' buckets, in seconds.
const BUCKETS: [f64; 14] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// A Prometheus histogram: counts per bucket (not cumulative), sum, count.
#[derive(Default, Clone)]
struct Histogram {
    counts: [u64; BUCKETS.len()],
    sum: f64,
    count: u64,
}

impl Histogram {
    fn add(&mut self, d: Duration) {
        let s = d.as_secs_f64();
        if let Some(i) = BUCKETS.iter().position(|&b| s <= b) {
            self.counts[i] += 1;
        }
        self.sum += s;
        self.count += 1;
    }

    fn write(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cum = 0;
        for (b, c) in BUCKETS.iter().zip(self.counts) {
            cum += c;
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {cum}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum {}\n{name}_count {}", self.sum, self.count);
    }
}

#[derive(Default, Clone)]
struct Figures {
    stats: Stats,
    finished: [u64; 3],
    refused: u64,
    failed: u64,
    prompt_tokens: u64,
    cached_tokens: u64,
    generated_tokens: u64,
    steps: u64,
    step_seconds: f64,
    ttft: Histogram,
    tpot: Histogram,
    latency: Histogram,
}

/// The figures, behind one lock (updated once per step).
pub struct Metrics {
    f: Mutex<Figures>,
}

impl Metrics {
    pub fn new(stats: Stats) -> Metrics {
        Metrics {
            f: Mutex::new(Figures {
                stats,
                ..Default::default()
            }),
        }
    }

    fn with(&self, f: impl FnOnce(&mut Figures)) {
        // A panic elsewhere while holding the lock leaves plain numbers:
        // keep counting.
        let mut g = self.f.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut g)
    }

    pub fn set_stats(&self, s: Stats) {
        self.with(|f| f.stats = s)
    }

    pub fn stats(&self) -> Stats {
        let mut s = Stats::default();
        self.with(|f| s = f.stats);
        s
    }

    pub fn refused(&self) {
        self.with(|f| f.refused += 1)
    }

    pub fn failed(&self) {
        self.with(|f| f.failed += 1)
    }

    pub fn cancelled(&self) {
        self.with(|f| f.finished[2] += 1)
    }

    pub fn step(&self, tokens: usize, took: Duration) {
        self.with(|f| {
            f.steps += 1;
            f.step_seconds += took.as_secs_f64();
            f.generated_tokens += tokens as u64;
        })
    }

    pub fn first_token(&self, d: Duration) {
        self.with(|f| f.ttft.add(d))
    }

    pub fn next_token(&self, d: Duration) {
        self.with(|f| f.tpot.add(d))
    }

    pub fn finished(&self, finish: Finish, u: &Usage, took: Duration) {
        self.with(|f| {
            let i = match finish {
                Finish::Length => 0,
                Finish::Stop => 1,
                Finish::Cancelled => 2,
            };
            f.finished[i] += 1;
            f.prompt_tokens += u.prompt_tokens as u64;
            f.cached_tokens += u.cached_tokens as u64;
            f.latency.add(took);
        })
    }

    /// Prometheus' text format.
    pub fn render(&self) -> String {
        let mut f = Figures::default();
        self.with(|g| f = g.clone());
        let mut out = String::new();
        let mut gauge = |name: &str, help: &str, v: f64, kind: &str| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}"
            );
        };
        let s = f.stats;
        gauge(
            "braid_requests_waiting",
            "Requests queued for the cache.",
            s.waiting as f64,
            "gauge",
        );
        gauge(
            "braid_requests_running",
            "Requests decoding.",
            s.running as f64,
            "gauge",
        );
        gauge(
            "braid_kv_blocks_used",
            "KV cache blocks in use.",
            s.blocks_used as f64,
            "gauge",
        );
        gauge(
            "braid_kv_blocks",
            "KV cache blocks in all.",
            s.blocks as f64,
            "gauge",
        );
        gauge(
            "braid_prompt_tokens_total",
            "Prompt tokens of finished requests.",
            f.prompt_tokens as f64,
            "counter",
        );
        gauge(
            "braid_prefix_cached_tokens_total",
            "Prompt tokens read from the prefix cache.",
            f.cached_tokens as f64,
            "counter",
        );
        gauge(
            "braid_generation_tokens_total",
            "Tokens generated.",
            f.generated_tokens as f64,
            "counter",
        );
        gauge(
            "braid_requests_refused_total",
            "Requests refused (bad, too big, busy).",
            f.refused as f64,
            "counter",
        );
        gauge(
            "braid_requests_failed_total",
            "Requests ended by a failed model step.",
            f.failed as f64,
            "counter",
        );
        gauge(
            "braid_steps_total",
            "Model steps run.",
            f.steps as f64,
            "counter",
        );
        gauge(
            "braid_step_seconds_total",
            "Seconds spent in model steps.",
            f.step_seconds,
            "counter",
        );
        let _ = writeln!(
            out,
            "# HELP braid_requests_finished_total Requests ended, by reason.\n\
             # TYPE braid_requests_finished_total counter"
        );
        for (reason, n) in ["length", "stop", "cancelled"].iter().zip(f.finished) {
            let _ = writeln!(
                out,
                "braid_requests_finished_total{{reason=\"{reason}\"}} {n}"
            );
        }
        f.ttft.write(
            &mut out,
            "braid_time_to_first_token_seconds",
            "Time to first token.",
        );
        f.tpot.write(
            &mut out,
            "braid_time_per_output_token_seconds",
            "Time between tokens.",
        );
        f.latency.write(
            &mut out,
            "braid_request_seconds",
            "Request latency, arrival to end.",
        );
        out
    }
}
