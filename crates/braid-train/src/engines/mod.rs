//! The GPT engines of `braid-model` behind the [`Engine`](crate::Engine)
//! trait: [`CpuGpt`] (f32, this machine's cores) and [`GpuGpt`] (one GPU,
//! f32 or bf16 mixed precision, optionally with its optimizer offloaded to
//! host memory: [`offload`]), with the batch type they share; and
//! [`CpuStage`] and [`GpuStage`], a pipeline rank's stages of the CPU
//! model and of the bf16 GPU model. What they share: their units
//! (`units`), what they say about themselves (`describe`) and their
//! checkpointed state (`state`).

mod describe;
mod gpt_cpu;
mod gpt_cpu_stage;
mod gpt_gpu;
mod gpt_gpu_stage;
pub mod offload;
mod state;
mod units;

pub use gpt_cpu::{CpuGpt, CpuOptimizer};
pub use gpt_cpu_stage::CpuStage;
pub use gpt_gpu::{GpuGpt, Precision};
pub use gpt_gpu_stage::GpuStage;
pub(crate) use state::copy_at;
pub use state::gpt_tensors;
pub use units::{backward_unit_name, forward_unit_name};

pub use braid_data::loader::TokenBatch;
