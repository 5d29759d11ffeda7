//! The rendezvous store: how braid's processes find each other.
//!
//! A small TCP key-value store in the spirit of PyTorch's `TCPStore`. One
//! process (the launcher, or rank 0 when there is no launcher) runs a
//! [`StoreServer`]; every other process talks to it through a
//! [`StoreClient`]. Everything distributed in braid starts here: exchanging
//! addresses and NCCL ids, agreeing on the world, barriers.
//!
//! - [`protocol`]: the versioned, length-prefixed wire format and its limits.
//! - [`server`]: a thread-per-connection server; malformed clients are
//!   answered with an error and dropped without disturbing anyone else,
//!   connections are capped, and a new connection must finish its handshake
//!   within a deadline.
//! - [`client`]: blocking operations, every one bounded by a timeout whose
//!   error names the key(s) and the time waited; key prefixes for sub-groups.
//! - [`barrier`]: a reusable barrier built from counters and keys.
//! - [`worker`]: connecting a worker from its launcher's environment.

pub mod barrier;
pub mod client;
pub mod error;
pub mod protocol;
pub mod server;
pub mod worker;

pub use client::{CasOutcome, ClientOptions, StoreClient};
pub use error::StoreError;
pub use protocol::Limits;
pub use server::{ServerOptions, StoreServer};
pub use worker::WorkerStore;
