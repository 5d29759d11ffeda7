//! Pipeline schedules as data: for every pipeline rank, the list of
//! actions it runs in order — a stage's forward or backward pass of one
//! micro-batch (the backward whole, or split into its input-gradient and
//! weight-gradient halves), and the sends and receives of activations and
//! their gradients between stages. One executor runs any list; a new
//! schedule is a new list ([`build`]: GPipe, 1F1B, interleaved 1F1B,
//! ZB-H1, ZB-H2; or a file in the text form of [`text`]), checked before it runs
//! ([`check`]: every micro-batch through every stage once, sends matched
//! by receives, no deadlock).
//!
//! Stages are the model's consecutive block ranges; with `V` stages per
//! rank (interleaving), stage `s` runs on rank `s % ranks` (Megatron's
//! assignment: rank `r` holds stages `r`, `r + ranks`, …). "No pipeline"
//! is the trivial schedule: one rank, one stage, each micro-batch's
//! forward then backward.

mod actions;
pub mod build;
pub mod check;
pub mod text;

pub use actions::{Action, Op, Schedule};
