//! [`GpuModel`]: what the GPU engine asks of a GPT model on the GPU,
//! whichever form it takes — the f32 model ([`super::model::GpuGpt`]) or
//! the bf16 mixed-precision one ([`super::model_mixed::GpuGptMixed`],
//! which keeps its own bf16 copy of the weights) — so that an engine
//! holds a `Box<dyn GpuModel>` and never asks which.
//!
//! A form without some part says what it does instead in the method's
//! documentation (the f32 model defers no weight gradients, places no
//! saved buffers in lent memory, splits no stage backward pass); nothing
//! here defaults to "cannot".

mod f32;
mod face;
mod mixed;

pub use face::{BackwardPart, GpuModel, StageBuffers};
