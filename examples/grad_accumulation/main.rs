//! The course's gradient-accumulation exercise on braid: a linear layer
//! (1000 → 10) trained with Adam, 4 micro-batches of 32 per step. The
//! first three micro-batches' backward passes accumulate locally (no
//! communication: PyTorch's `no_sync`); only the last goes through DDP,
//! which reduces the accumulated gradients once. The update divides by
//! micro-batches × ranks, so a step is the gradient of the mean loss over
//! the effective batch of 4 × 32 × ranks.
//!
//! ```text
//! cargo build --release --examples
//! ./target/release/braid launch --standalone --nproc-per-node 2 -- ./target/release/examples/grad_accumulation
//! ```

#[path = "../common/dense.rs"]
mod dense;

use braid_comm::Communicator;
use braid_model::rng::Rng;
use braid_train::collective::HostCollective;
use braid_train::ddp::{DataParallel, DdpOptions};
use braid_train::engine::backward_local;
use braid_train::timeline::Timeline;
use braid_train::{Engine, Strategy, UpdateStep};
use dense::{teacher_data, Batch, Dense};
use std::process::ExitCode;

const ACCUMULATION_STEPS: usize = 4;
const MICRO_BATCH: usize = 32;
const STEPS: u32 = 100;

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("grad_accumulation: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), String> {
    let comm = Communicator::init_from_env().map_err(|e| e.to_string())?;
    let (rank, ranks) = (comm.rank(), comm.size());
    let mut model = Dense::new(&[1000, 10], 1);
    let mut ddp = DataParallel::new(HostCollective::new(comm), DdpOptions::default());
    ddp.start(&mut model)?;
    // A pool of labelled samples; each rank draws its own micro-batches.
    let pool = 4096;
    let (x, labels) = teacher_data(pool, 1000, 10, 3);
    let mut rng = Rng::new(1000 + rank as u64);
    let mut grads = model.new_grads()?;
    let mut timeline = Timeline::new();
    if rank == 0 {
        println!(
            "{} parameters; effective batch {} = {ACCUMULATION_STEPS} micro-batches x {MICRO_BATCH} x {ranks} ranks",
            model.parameters(),
            ACCUMULATION_STEPS * MICRO_BATCH * ranks
        );
    }
    for step in 0..STEPS {
        model.zero_grads(&mut grads)?;
        let mut loss_sum = 0.0;
        for accum_step in 0..ACCUMULATION_STEPS {
            let rows: Vec<usize> = (0..MICRO_BATCH).map(|_| rng.below(pool)).collect();
            let batch = Batch {
                x: rows
                    .iter()
                    .flat_map(|&i| x[i * 1000..(i + 1) * 1000].iter().copied())
                    .collect(),
                labels: rows.iter().map(|&i| labels[i]).collect(),
            };
            loss_sum += model.forward(&batch, true)?;
            if accum_step + 1 < ACCUMULATION_STEPS {
                backward_local(&mut model, &mut grads)?; // accumulate, no communication
            } else {
                timeline.clear();
                ddp.backward(&mut model, &mut grads, &mut timeline)?; // reduce once
            }
        }
        // The loss scale: gradients of K micro-batch means, summed over the
        // ranks, divided once.
        model.update(
            &grads,
            UpdateStep {
                lr: 1e-3,
                step: step + 1,
                grad_scale: 1.0 / (ACCUMULATION_STEPS * ranks) as f32,
            },
        )?;
        let mut mean = [(loss_sum / ACCUMULATION_STEPS as f32) as f64];
        ddp.mean(&mut mean)?;
        if rank == 0 && step % 10 == 0 {
            println!(
                "Step {step}, Loss: {:.4}, gradients sent this step: {} bytes in {} collective(s)",
                mean[0],
                ddp.last_step().payload_bytes,
                ddp.last_step().collectives
            );
        }
    }
    Ok(())
}
