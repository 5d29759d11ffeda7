//! `braid plan`'s model of a run: what a machine can do ([`hardware`]),
//! what a layout of a workload costs on it ([`cost`]) and holds
//! ([`memory`]), and every layout braid can run, judged
//! ([`enumerate`]); the bandwidth each link of a layout needs
//! ([`capacity`]); a machine's description from its timed kernels
//! ([`calibrate`]).

pub mod calibrate;
pub mod capacity;
pub mod cost;
pub mod enumerate;
pub mod hardware;
pub mod memory;
#[cfg(test)]
mod recorded;
#[cfg(test)]
pub(crate) mod testing;

pub use capacity::{capacity, LinkLoad};
pub use cost::{predict, Layout, Prediction, Workload};
pub use enumerate::{candidates, Candidate};
pub use hardware::{AttentionRate, Hardware, Link, ProductRate};
