//! `braid verify`: every collective on every dtype, checked element by
//! element, on this job's real processes and hosts.

use braid_comm::{BackendKind, CommOptions};
use clap::Args;

/// A correctness check of the whole collective API.
#[derive(Args)]
#[command(
    about = "Check every collective on every dtype and reduce op, element by element",
    after_help = "Examples:\n  braid verify --nproc-per-node 4\n  braid verify --device cuda --nproc-per-node gpu\n  braid launch --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --nproc-per-node 2 -- braid verify"
)]
pub struct VerifyArgs {
    /// Backend: auto, shm, tcp, hier (default: BRAID_BACKEND, else auto).
    #[arg(long)]
    backend: Option<String>,
    /// Start N local workers (instead of running under `braid launch`; default: one when not
    /// launched): a number, or auto, gpu or cpu.
    #[arg(long = "nproc-per-node", visible_alias = "np", aliases = ["nproc", "nproc_per_node"],
          value_name = "N", value_parser = super::parse_nproc)]
    np: Option<super::Nproc>,
    /// cpu (shm/tcp/hier backends) or cuda (NCCL on device memory).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// GPUs driven by each process (--device cuda).
    #[arg(short = 'g', long = "ngpus", default_value_t = 1)]
    gpus: usize,
}

/// Runs `braid verify`.
pub fn run(args: VerifyArgs) -> Result<i32, String> {
    let backend = args
        .backend
        .as_deref()
        .map(BackendKind::parse)
        .transpose()?;
    let cuda = super::wants_cuda(&args.device)?;
    if args.gpus == 0 || (!cuda && args.gpus != 1) {
        return Err("-g needs --device cuda and at least 1".into());
    }
    if cuda && !super::workers::launched() {
        super::gpus_for(&args.device)?;
    }
    match args.np {
        Some(np) => return super::workers::relaunch_locally(np.count()?, true),
        None if !super::workers::launched() => return super::workers::relaunch_locally(1, true),
        None => {}
    }
    let mut options = CommOptions::from_env().map_err(|e| e.to_string())?;
    if let Some(b) = backend {
        options.backend = b;
    }
    let comm = super::workers::init(options)?;
    let start = std::time::Instant::now();
    if cuda {
        return verify_gpu(&comm, args.gpus, start);
    }
    braid_comm::verify::everything(&comm).map_err(|e| format!("verification failed: {e}"))?;
    comm.barrier().map_err(|e| e.to_string())?;
    println!(
        "rank {}/{}: every collective verified on the {} backend in {:.1?}",
        comm.rank(),
        comm.size(),
        comm.backend_name(),
        start.elapsed()
    );
    Ok(0)
}

fn verify_gpu(
    comm: &braid_comm::Communicator,
    gpus: usize,
    start: std::time::Instant,
) -> Result<i32, String> {
    let gpu = braid_comm::gpu::GpuCommunicator::init_from_env_per_process(comm, gpus)
        .map_err(|e| e.to_string())?;
    let wrong = super::verify_gpu::everything(&gpu)?;
    comm.barrier().map_err(|e| e.to_string())?;
    if comm.rank() == 0 {
        println!(
            "{} GPUs ({} process(es) x {gpus}): {} in {:.1?}",
            gpu.size(),
            comm.size(),
            if wrong == 0 {
                "every GPU collective verified".to_string()
            } else {
                format!("{wrong} wrong elements")
            },
            start.elapsed()
        );
    }
    Ok(if wrong == 0 { 0 } else { 1 })
}
