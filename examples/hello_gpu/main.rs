//! The course's distributed hello world on GPUs: one process per GPU
//! (`LOCAL_RANK` picks it), a real NCCL all-reduce on device memory.
//!
//! Every rank fills a device buffer with `rank + 1` and all-reduces it with
//! `avg`, waiting for each operation: afterwards every element is
//! `(N + 1) / 2`. `--iters K` repeats the all-reduce K times (the GPU check
//! script uses a long loop to kill a rank in the middle of it); `--mib M`
//! sets the buffer size.
//!
//! ```text
//! cargo build --release --bins --examples
//! ./target/release/braid launch --standalone --nproc-per-node 4 -- ./target/release/examples/hello_gpu
//! ```

use braid_comm::gpu::GpuCommunicator;
use braid_comm::{Communicator, ReduceOp};
use std::process::ExitCode;

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("hello_gpu: {e}");
            ExitCode::FAILURE
        }
    }
}

fn flag(name: &str, default: usize) -> Result<usize, String> {
    let args: Vec<String> = std::env::args().collect();
    match args.iter().position(|a| a == name) {
        None => Ok(default),
        Some(i) => args
            .get(i + 1)
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| format!("{name} needs a number")),
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let iters = flag("--iters", 1)?;
    let mib = flag("--mib", 1)?;
    let comm = Communicator::init_from_env()?;
    let gpu = GpuCommunicator::init_from_env(&comm)?;
    let (rank, size) = (comm.rank(), comm.size());
    println!(
        "Hello from rank {rank}/{size} on GPU {} ({})",
        gpu.device().ordinal(),
        gpu.device().name()?
    );
    let n = (mib << 20) / 4;
    let mut tensor = gpu.buffer_from_host(&vec![(rank + 1) as f32; n.max(1)])?;
    for _ in 0..iters {
        gpu.all_reduce(&mut tensor, ReduceOp::Avg)?.wait()?;
    }
    let expected = (size + 1) as f32 / 2.0;
    let host = tensor.to_vec()?;
    if let Some(bad) = host.iter().position(|x| (x - expected).abs() > 1e-5) {
        return Err(format!(
            "rank {rank}: element {bad} is {} after all_reduce, expected {expected}",
            host[bad]
        )
        .into());
    }
    println!(
        "Rank {rank}: after all_reduce (avg) x{iters}: {} (expected {expected}) ok",
        host[0]
    );
    gpu.barrier()?;
    Ok(())
}
