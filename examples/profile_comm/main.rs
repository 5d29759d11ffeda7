//! The course's communication-profiling exercise on braid: all-reduce time
//! and bandwidth for tensors of 1 000 to 10 000 000 f32 elements.
//!
//! The course computes its "bandwidth" as 2 × bytes / time (each byte sent
//! and received once); this prints that figure next to nccl-tests' algbw
//! and busbw so the three can be compared (`braid bench` prints the latter
//! two for every collective).
//!
//! ```text
//! ./target/release/braid launch --standalone --nproc-per-node 4 -- ./target/release/examples/profile_comm
//! ```

use braid_comm::{Communicator, ReduceOp};
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let comm = Communicator::init_from_env()?;
    let (rank, n) = (comm.rank(), comm.size());
    if rank == 0 {
        println!(
            "Benchmarking AllReduce on {n} ranks ({} backend)",
            comm.backend_name()
        );
        println!("{}", "-".repeat(86));
    }
    for size in [1_000usize, 10_000, 100_000, 1_000_000, 10_000_000] {
        let mut tensor: Vec<f32> = (0..size)
            .map(|i| ((i * 31 + rank * 7) % 101) as f32 / 101.0)
            .collect();
        let iterations = if size >= 1_000_000 { 20 } else { 100 };
        for _ in 0..10 {
            comm.all_reduce(&mut tensor, ReduceOp::Sum)?;
        }
        comm.barrier()?;
        let start = Instant::now();
        for _ in 0..iterations {
            comm.all_reduce(&mut tensor, ReduceOp::Sum)?;
        }
        // The slowest rank's time is the collective's time.
        let mut t = [start.elapsed().as_secs_f64() / iterations as f64];
        comm.all_reduce(&mut t, ReduceOp::Max)?;
        let bytes = (size * 4) as f64;
        let course_bw = bytes * 2.0 / t[0] / 1e9;
        let algbw = bytes / t[0] / 1e9;
        let busbw = algbw * 2.0 * (n as f64 - 1.0) / n as f64;
        if rank == 0 {
            println!(
                "Tensor size: {size:>10} | Avg time: {:>9.3} ms | Bandwidth (2x): {course_bw:>7.2} GB/s | algbw {algbw:>7.2} | busbw {busbw:>7.2}",
                t[0] * 1e3
            );
        }
    }
    Ok(())
}
