//! Serving a trained GPT (issue 66): many requests decoded together over
//! one paged KV cache.
//!
//! - [`decoder`]: what a model must do to be served ([`Decoder`]: one
//!   step over rows of many sequences, block copies), the CPU's
//!   ([`CpuDecoder`], the reference, on `braid_model`'s block description)
//!   and one GPU's in f32 ([`CudaDecoder`]);
//! - [`request`]: a request, its checks, and what comes back ([`Event`]);
//! - [`text`]: tokens to text as they come, held back where a character
//!   or a stop string is not finished;
//! - [`batcher`]: continuous batching ([`Batcher`]): requests join and
//!   leave at every step, long prompts are prefilled in chunks beside the
//!   running decodes, shared prompt prefixes are read from the cache, and
//!   a request is admitted only when the cache can hold all of it (a clear
//!   queue instead of preemption);
//! - [`engine`]: the batcher on its own thread, and the handle the HTTP
//!   side submits through ([`EngineHandle`]);
//! - [`http`]: the OpenAI-compatible API on axum (`/v1/completions`,
//!   streamed or whole, `/v1/models`, `/health`, `/metrics`, an API key);
//! - [`metrics`]: the figures `/metrics` gives in Prometheus' format;
//! - [`offline`]: requests run to the end without a server (`braid
//!   generate`);
//! - [`tensor_parallel`]: `--tp N`: rank 0 serves and sends each step to
//!   the other ranks, every rank decodes its share of the heads and MLP
//!   columns ([`tensor_parallel::TensorParallelDecoder`],
//!   [`tensor_parallel::follow`]);
//! - [`loadgen`]: a load generator for any OpenAI-compatible endpoint
//!   (`braid bench serve`, in the shape of `vllm bench serve`).

pub mod batcher;
pub mod decoder;
pub mod engine;
pub mod http;
pub mod loadgen;
pub mod metrics;
pub mod offline;
pub mod request;
pub mod tensor_parallel;
pub mod text;

pub use batcher::{Batcher, BatcherOptions, Stats};
pub use decoder::{CpuDecoder, CudaDecoder, Decoder};
pub use engine::{spawn, EngineHandle};
pub use request::{Event, Finish, Request, RequestError, TokenOut, Usage};
