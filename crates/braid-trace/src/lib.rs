//! braid-trace: seeing into a braid run.
//!
//! - [`recorder`]: spans on the host's clock, recorded per process, off
//!   (one atomic load) unless a run asks for a trace;
//! - [`device`]: spans on GPU streams, timed with CUDA events and moved
//!   onto the host's clock;
//! - [`clock`]: the ranks' clock offsets from a reference (the store);
//! - [`format`](mod@format): Chrome/Perfetto trace-event files, per rank and merged;
//! - [`scope`]: one-line spans around work on the host or a GPU stream;
//! - [`nvtx`]: the same spans as NVTX ranges for Nsight, when a tool is
//!   attached;
//! - [`stats`]: per-operation collective counts, bytes and time;
//! - [`metrics`]: live metrics over HTTP in Prometheus' text format,
//!   with the collective statistics on every scrape;
//! - [`intervals`], [`analysis`] and [`report`]: the temporal breakdown of each step,
//!   overlap, stragglers, a pipeline's bubble and stage imbalance, and
//!   per-operation bandwidths behind `braid report`.
//!
//! This crate sits beside `braid-comm` and below the training crates: the
//! collectives, the engines and the loop all record into it, and it
//! depends on nothing of braid's but `braid-cuda` (for GPU events).

pub mod analysis;
pub mod clock;
pub mod device;
pub mod format;
pub mod intervals;
pub mod metrics;
pub mod nvtx;
pub mod recorder;
pub mod report;
pub mod scope;
pub mod staleness;
pub mod stats;

pub use recorder::{enabled, span, Cat, HostSpan, Span};
pub use scope::timed;
