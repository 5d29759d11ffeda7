//! Foundations shared by every braid crate.
//!
//! This crate sits at the bottom of the dependency graph and depends on no
//! other braid crate. Today it holds the *worker environment contract*: the
//! names of the variables a launcher (braid's own, torchrun or SLURM) sets for
//! each worker, and [`WorldInfo`], which reads them back with errors that say
//! which variable was wrong and what to do about it.

pub mod env;
pub mod slurm;
pub mod world;

pub use world::{WorldInfo, WorldInfoError};
