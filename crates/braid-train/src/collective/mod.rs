//! [`Collective`]: the collectives a strategy needs, over host memory
//! ([`HostCollective`]: braid's shm/tcp backends) or one GPU
//! ([`DeviceCollective`]: NCCL), called the same way.
//!
//! The central call is [`Collective::reduce`]: a *reduction session*
//! during a backward pass. The strategy's `drive` closure runs the
//! engine's backward units and hands each finished bucket — a part split
//! off the gradient [`Window`](crate::space::Window) — to a launcher, which starts
//! its reduction at once (on the progress thread of the host communicator,
//! or on the GPU's communication stream) through the bucket's
//! communication hook ([`GradComm`]). The session returns when every
//! reduction has finished (host) or is ordered before later work on the
//! engine's stream (GPU). Parts are borrowed from the gradient buffer for
//! the session, so no reduction can outlive it.

mod copy_engine;
mod core;
mod device;
mod exchange;
mod grad_comm;
mod host;
pub(crate) mod powersgd;
mod symmetric_blocks;
mod wire;
pub mod zero_cta;

pub use self::core::{Bucket, Collective, Drive, During, End, GatherPart, Launch, ScatterPart};
pub use copy_engine::{
    landing_bytes as copy_engine_landing_bytes, reduces_by_default as copy_engines_by_default,
    CopyEngineReduce, MAX_RANKS as COPY_ENGINE_MAX_RANKS,
};
pub use device::DeviceCollective;
pub use exchange::block_of;
pub use grad_comm::GradComm;
pub use host::HostCollective;
pub use powersgd::PowerSgdOptions;
