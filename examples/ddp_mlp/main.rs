//! The course's data-parallel training exercise on braid: an MLP
//! (784 → 512 → ReLU → 10) trained with Adam on fake data by every rank,
//! each on its own share of the data (a distributed sampler, reshuffled
//! every epoch), gradients averaged across ranks by braid's data-parallel
//! strategy, for 5 epochs.
//!
//! The model is this example's own code (`../common/dense.rs`); it only
//! implements braid-train's `Engine` core (and `EngineInfo`, empty). The
//! loop is the course's, by hand: set the epoch, take batches of 32,
//! forward, backward through DDP (buckets reduced as the layers' gradients
//! become final), Adam.
//!
//! ```text
//! cargo build --release --examples
//! ./target/release/braid launch --standalone --nproc-per-node 2 -- ./target/release/examples/ddp_mlp
//! ```

#[path = "../common/dense.rs"]
mod dense;

use braid_comm::Communicator;
use braid_data::sampler::DistributedSampler;
use braid_train::collective::{Collective, HostCollective};
use braid_train::ddp::{DataParallel, DdpOptions};
use braid_train::timeline::Timeline;
use braid_train::{Engine, Strategy, UpdateStep};
use dense::{teacher_data, Batch, Dense};
use std::process::ExitCode;

const SAMPLES: usize = 1000;
const BATCH: usize = 32;
const EPOCHS: u64 = 5;

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ddp_mlp: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), String> {
    let comm = Communicator::init_from_env().map_err(|e| e.to_string())?;
    let (rank, ranks) = (comm.rank(), comm.size());
    // Every rank builds the model from its own seed: DDP's start
    // broadcasts rank 0's parameters and checks that all ranks agree.
    let mut model = Dense::new(&[784, 512, 10], 100 + rank as u64);
    let mut ddp = DataParallel::new(HostCollective::new(comm), DdpOptions::default());
    ddp.start(&mut model)?;
    let (x, labels) = teacher_data(SAMPLES, 784, 10, 7);
    let mut sampler = DistributedSampler::new(SAMPLES, ranks, rank, true, 0, false)?;
    if rank == 0 {
        println!(
            "{} parameters, {ranks} ranks, {} samples per rank per epoch, batches of {BATCH}; {}",
            model.parameters(),
            sampler.num_samples(),
            ddp.describe()
        );
    }
    let mut grads = model.new_grads()?;
    let mut timeline = Timeline::new();
    let mut step = 0;
    for epoch in 0..EPOCHS {
        sampler.set_epoch(epoch); // a new shuffle every epoch
        for (batch_idx, chunk) in sampler.indices().chunks(BATCH).enumerate() {
            let batch = Batch {
                x: chunk
                    .iter()
                    .flat_map(|&i| x[i * 784..(i + 1) * 784].iter().copied())
                    .collect(),
                labels: chunk.iter().map(|&i| labels[i]).collect(),
            };
            model.zero_grads(&mut grads)?;
            let loss = model.forward(&batch, true)?;
            // Backward through DDP: each layer's bucket is summed across
            // ranks as soon as that layer's gradients exist.
            timeline.clear();
            ddp.backward(&mut model, &mut grads, &mut timeline)?;
            step += 1;
            model.update(
                &grads,
                UpdateStep {
                    lr: 1e-3,
                    step,
                    grad_scale: 1.0 / ranks as f32, // sum -> mean
                },
            )?;
            let mut mean = [loss as f64];
            ddp.mean(&mut mean)?;
            if rank == 0 && batch_idx % 10 == 0 {
                println!("Epoch {epoch}, Batch {batch_idx}, Loss: {:.4}", mean[0]);
            }
        }
    }
    // Every replica must end identical.
    let sum: f64 = model.params().iter().map(|&p| p as f64).sum();
    let mut sums = vec![0.0f64; ranks];
    ddp.collective()
        .host()
        .all_gather(&[sum], &mut sums)
        .map_err(|e| e.to_string())?;
    if sums.iter().any(|&s| s != sums[0]) {
        return Err(format!("replicas diverged: parameter sums {sums:?}"));
    }
    if rank == 0 {
        println!("done: {EPOCHS} epochs, {step} steps; every rank holds the same parameters");
    }
    Ok(())
}
