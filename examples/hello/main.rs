//! The course's "distributed hello world", on braid.
//!
//! Every rank says who it is, joins the world's communicator, and
//! all-reduces a tensor holding its rank: afterwards every element on every
//! rank is 0 + 1 + … + (N-1). The communicator picks shared memory, tcp or
//! both from where the ranks run.
//!
//! ```text
//! cargo build --release --bins --examples
//! ./target/release/braid launch --standalone --nproc-per-node 4 -- ./target/release/examples/hello
//! ```

use braid_comm::{Communicator, ReduceOp};
use std::process::ExitCode;

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
    let comm = Communicator::init_from_env()?;
    let (rank, size) = (comm.rank(), comm.size());
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    println!(
        "Hello from rank {rank}/{size} on {} ({} backend)",
        host.trim(),
        comm.backend_name()
    );
    let mut tensor = vec![rank as f32; 10];
    comm.all_reduce(&mut tensor, ReduceOp::Sum)?;
    let expected = (size * (size - 1) / 2) as f32;
    if tensor.iter().any(|x| *x != expected) {
        return Err(format!(
            "rank {rank}: all-reduce gave {tensor:?}, expected {expected} everywhere"
        )
        .into());
    }
    println!(
        "Rank {rank}: after all_reduce: {} (expected {expected}) ok",
        tensor[0]
    );
    comm.barrier()?;
    Ok(())
}
