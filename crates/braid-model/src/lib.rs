//! braid's training engine: a GPT-2 family model you can read top to
//! bottom, on the CPU and on one GPU, below every training strategy.
//!
//! - [`config`]: GPT-2 family configurations, named and custom.
//! - [`layout`]: every parameter's place in one flat buffer, block by block,
//!   under its Hugging Face GPT-2 name.
//! - [`params`]: the flat buffer itself, with named views and GPT-2's
//!   initialisation; gradients and optimizer state use the same type.
//! - [`block`]: the transformer block described once — its operations in
//!   order, over which every backend runs, and its per-layer parameters.
//! - [`model`]: the CPU model, forward and backward block by block;
//!   [`cpu`]: its kernels.
//! - [`cuda`]: the GPU models (f32, and bf16 mixed precision), their
//!   NVRTC kernels and the checks of each kernel against the CPU.
//! - [`optim`]: AdamW, SGD, clipping, the learning-rate schedule.
//! - [`sample`]: text from a trained model (tokenizers and datasets are
//!   in `braid-data`).
//! - [`checkpoint`]: safetensors save/load (braid's and Hugging Face's).
//! - [`footprint`]: the memory pre-flight — what a run will allocate,
//!   from the shapes, before it allocates.
//! - [`paged`]: the paged KV cache's bookkeeping for serving — blocks of
//!   positions, each sequence's block table, shared prompt prefixes.
//! - [`placement`]: saved activations placed in memory idle while they
//!   live (ZeRO-3's gradient shard before the backward pass fills it).
//! - [`rng`]: the deterministic generator behind initialisation and data
//!   (`braid_core::rng`, re-exported).
//! - [`tensor`]: shape + dtype + device + storage (f32/bf16 on the CPU).
//!
//! The training loop and the parallel strategies are in `braid-train`.

pub mod block;
pub mod checkpoint;
pub mod config;
pub mod cpu;
pub mod cuda;
pub mod footprint;
pub mod layout;
pub mod model;
pub mod optim;
pub mod paged;
pub mod params;
pub mod place;
pub mod placement;
pub use braid_core::rng;
pub mod sample;
pub mod tensor;
pub mod tensor_comm;

pub use config::GptConfig;
pub use layout::{Block, Kind, Layout, Stage};
pub use model::{log_softmax_at, Activations, DecodeRow, Gpt, KvPages, Logits, Pick, StepError};
pub use params::Params;
