//! The course's "distributed hello world", on braid.
//!
//! Every rank says who it is, meets the others at a barrier in the
//! rendezvous store, and adds its rank to a shared counter; after a second
//! barrier every rank reads the sum and checks it against 0 + 1 + … + (N-1).
//!
//! Run it through the launcher:
//!
//! ```text
//! cargo build --release --bins --examples
//! ./target/release/braid launch --standalone --nproc-per-node 4 -- ./target/release/examples/hello
//! ```

use braid_core::WorldInfo;
use braid_store::WorkerStore;
use std::process::ExitCode;
use std::time::Duration;

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("hello: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let world = WorldInfo::from_env()?;
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    println!(
        "Hello from rank {}/{} (local rank {} on node {}, host {})",
        world.rank,
        world.world_size,
        world.local_rank,
        world.node_rank,
        host.trim()
    );
    let store = WorkerStore::from_env(&world)?;
    let timeout = WorldInfo::timeout_from_env(Duration::from_secs(60))?;
    let (rank, size) = (world.rank, world.world_size);
    store.client.barrier("hello", rank, size, timeout)?;
    store.client.add("rank_sum", rank as i64)?;
    store.client.barrier("summed", rank, size, timeout)?;
    let sum: i64 = String::from_utf8(store.client.get("rank_sum")?)?.parse()?;
    let expected = (size * (size - 1) / 2) as i64;
    if sum != expected {
        return Err(format!("rank {rank}: sum of ranks is {sum}, expected {expected}").into());
    }
    println!("Rank {rank}: sum of ranks over the store = {sum} (expected {expected}) ok");
    // Rank 0 may host the store when there is no launcher: keep it up until
    // every rank has read the sum.
    store.client.barrier("bye", rank, size, timeout)?;
    Ok(())
}
