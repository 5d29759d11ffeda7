//! Foundations shared by every braid crate.
//!
//! This crate sits at the bottom of the dependency graph and depends on no
//! other braid crate. It holds:
//!
//! - the *worker environment contract* ([`env`](mod@env), [`world`], [`slurm`]): the
//!   variables a launcher (braid's own, torchrun or SLURM) sets for each
//!   worker, and [`WorldInfo`], which reads them back with errors that say
//!   which variable was wrong and what to do about it; [`env`](mod@env)
//!   also names every other environment variable braid reads;
//! - element types ([`DType`], [`Element`]) and reduction operators with
//!   their CPU kernels ([`reduce`]);
//! - the flight-record format and the diagnosis shared by workers, the
//!   launcher and `braid doctor` ([`flight`]);
//! - the deterministic random number generator every crate seeds from
//!   ([`rng`]: the same seed gives the same model and data everywhere);
//! - files written whole or not at all ([`atomic_file`]);
//! - counts in words (`1 step`, `2 steps`: [`words`]).

pub mod atomic_file;
pub mod dtype;
pub mod env;
pub mod flight;
pub mod reduce;
pub mod rng;
pub mod slurm;
pub mod words;
pub mod world;

pub use dtype::{DType, Element};
pub use reduce::ReduceOp;
pub use world::{WorldInfo, WorldInfoError};
