//! braid's compact training engine (CPU first; CUDA slots in next).
//!
//! - [`config`]: GPT-2 family configurations, named and custom.
//! - [`layout`]: every parameter's place in one flat buffer, block by block,
//!   under its Hugging Face GPT-2 name.
//! - [`params`]: the flat buffer itself, with named views and GPT-2's
//!   initialisation; gradients and optimizer state use the same type.
//! - [`checkpoint`]: safetensors save/load (braid's and Hugging Face's).
//! - [`rng`]: the deterministic generator behind initialisation and data.
//! - [`tensor`]: shape + dtype + device + storage (f32/bf16 on the CPU).
//!
//! Work in progress (issue 5): tensors, CPU kernels, per-block forward and
//! backward, optimizers, data and `braid train` follow.

pub mod checkpoint;
pub mod config;
pub mod cpu;
pub mod cuda;
pub mod data;
pub mod layout;
pub mod model;
pub mod optim;
pub mod params;
pub mod rng;
pub mod tensor;
pub mod trainer;

pub use config::GptConfig;
pub use layout::{Block, Kind, Layout};
pub use model::{Activations, Gpt, StepError};
pub use params::Params;
