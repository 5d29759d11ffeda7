//! braid's collective communication: one [`Communicator`] API over every
//! backend.
//!
//! Code above this crate calls `all_reduce`, `reduce`, `broadcast`,
//! `all_gather`, `reduce_scatter`, `all_to_all`, `gather`, `scatter`,
//! `send`/`recv` and `barrier` the same way whatever the backend:
//!
//! - `shm` ([`shm`]): ranks on one host, through shared-memory segments;
//! - `tcp` ([`tcp`], [`p2p_backend`]): ranks on different hosts;
//! - `hier` ([`hier`]): shared memory inside each host, tcp between hosts.
//!
//! The backend is chosen from the host layout at initialisation
//! ([`setup`]). Operations are numbered, complete in issue order, can run
//! asynchronously ([`Communicator::scope`]), be fused ([`Communicator::group`])
//! and be split into sub-communicators ([`Communicator::split`]). Every wait
//! is bounded by a timeout and watched for dead peers ([`health`]); every
//! rank keeps a flight record of its last operations and publishes
//! heartbeats, so that a rank that is alive but stuck is named too
//! ([`flight`]).
//!
//! ```no_run
//! use braid_comm::{Communicator, ReduceOp};
//! let comm = Communicator::init_from_env()?;
//! let mut x = vec![comm.rank() as f32; 4];
//! comm.all_reduce(&mut x, ReduceOp::Sum)?;
//! # Ok::<(), braid_comm::CommError>(())
//! ```

pub mod api;
pub mod backend;
pub mod communicator;
pub mod debug;
pub mod error;
pub mod flight;
pub mod gpu;
pub mod group;
pub mod health;
pub mod hier;
pub mod p2p_backend;
pub mod setup;
pub mod shm;
pub mod tcp;
pub mod transport;
pub mod tuning;
pub mod verify;
pub mod work;

pub use braid_core::{DType, Element, ReduceOp};
pub use communicator::{CommOptions, Communicator, WeakCommunicator};
pub use error::{CommError, Result};
pub use group::Group;
pub use setup::BackendKind;
pub use work::{Scope, Work};
