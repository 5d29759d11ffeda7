//! braid's distributed training: one training loop over any engine, and
//! the parallelism strategies that plug into it.
//!
//! - [`engine`]: the [`Engine`] core (flat parameters and gradients, a
//!   backward pass in units that declare which gradients they finish, an
//!   optimizer update), the capabilities a strategy may need beyond it
//!   ([`EngineInfo`], [`ShardedOptimizer`], [`BlockGrads`],
//!   [`ShardedParams`], [`LendsMemory`], [`Checkpointable`]), and
//!   [`engines`], braid's GPT engines behind them;
//! - [`space`]: host or GPU memory, and the gradient [`Window`] a backward
//!   pass hands finished parts out of;
//! - [`trainer`]: the loop (micro-batches, clipping, schedule,
//!   evaluation, timing) — it never knows the strategy;
//! - [`strategy`]: the hooks a strategy gets ([`Strategy`]) and the
//!   one-process strategy;
//! - [`ddp`] and [`zero`]: data parallelism, and ZeRO's sharded
//!   optimizer (stages 1 and 2) on the same buckets; [`zero3`]: ZeRO
//!   stage 3 (FSDP), parameters sharded too, gathered unit by unit;
//! - [`mesh`]: the world's ranks on named dimensions (data, tensor; hybrid
//!   sharding's replicate and shard), groups as communicator splits;
//!   [`tensor_parallel`]: the model's collectives over the tensor group
//!   and the wrapper that runs a strategy over the data groups;
//! - [`place`]: a rank's place in a run (its mesh) and the groups it
//!   trains over;
//! - [`pipeline`]: the executor that runs a schedule on one pipeline
//!   rank, and the links its messages take;
//! - [`schedule`]: pipeline schedules as data (every rank's list of
//!   forward, backward, send and receive actions), built or read from a
//!   file, checked before they run;
//! - [`loader`]: where the GPT engines' batches come from;
//! - [`timeline`]: step timings on the engine's clock;
//! - [`memory_phase`]: which part of a step holds the most device memory;
//! - [`lend`]: one process's gradient buffer lent to the activations
//!   saved for the backward pass;
//! - [`assemble`]: a run's strategy built in one place from its data
//!   group and mesh;
//! - [`checkpoint`]: sharded checkpoints — written in the background by
//!   every rank, committed atomically, loaded under any strategy and
//!   world (resharding).

pub mod assemble;
pub mod checkpoint;
pub mod collective;
pub mod cuda;
pub mod ddp;
pub mod engine;
pub mod engines;
pub mod lend;
pub mod loader;
pub mod memory_phase;
pub mod mesh;
pub mod pipeline;
pub mod place;
pub mod plan;
pub mod ps;
pub mod schedule;
pub mod space;
mod step_trace;
pub mod strategy;
pub mod summary;
pub mod tensor_parallel;
mod test_delay;
pub mod timeline;
pub mod trainer;
pub mod zero;
pub mod zero3;

pub use engine::{
    BlockGrads, Checkpointable, Engine, EngineInfo, LendsMemory, Matrix, NamedTensor,
    OptimizerState, ParamUnits, SavedBuffer, ShardedBytes, ShardedOptimizer, ShardedParams,
    StateBytes, Unit, UpdateStep,
};
pub use space::{Gpu, Host, Space, Window};
pub use strategy::{Single, Strategy};
pub use trainer::{
    train, train_lending, train_with, Checkpoints, Loader, LoopOptions, RunReport, StepReport,
    StepTimes,
};

/// Errors are messages naming what went wrong and what to do.
pub type Result<T> = std::result::Result<T, String>;
