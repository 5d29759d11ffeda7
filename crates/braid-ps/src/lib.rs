//! braid's parameter server: the course's mini framework as a strategy.
//!
//! Servers own disjoint ranges of the flat parameter buffer ([`Shards`])
//! and, where they update ([`UpdateAt::Server`]), the optimizer state of
//! their range; workers push gradients by bucket as their backward pass
//! makes them and pull parameters back ([`Client`]). Consistency is chosen
//! per run ([`Mode`]): synchronous steps (equal to data parallelism),
//! asynchronous pushes, or bounded staleness. A server is a real TCP
//! server ([`Server`]); workers find it through the run's store
//! ([`rendezvous`]). The frames are in [`wire`].
//!
//! braid-train's `ps` strategy drives a [`Client`] from the training loop;
//! `braid train --ps N` runs [`Server`] on the last N ranks.

pub mod client;
pub mod consistency;
pub mod rendezvous;
pub mod server;
pub mod shard_state;
pub mod shards;
pub mod wire;

pub use client::{Client, Joined, WholeState};
pub use consistency::{Adaptive, Compensation, Mode, UpdateAt};
pub use server::{Server, ServerConfig, ServerReport};
pub use shard_state::{Snapshot, Staleness};
pub use shards::Shards;
