//! `braid verify`: every collective on every dtype, checked element by
//! element, on this job's real processes and hosts.

use braid_comm::{BackendKind, CommOptions};
use clap::Args;

/// A correctness check of the whole collective API.
#[derive(Args)]
#[command(
    about = "Check every collective on every dtype and reduce op, element by element",
    after_help = "Examples:\n  braid verify --np 4\n  braid launch --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --nproc-per-node 2 -- braid verify"
)]
pub struct VerifyArgs {
    /// Backend: auto, shm, tcp, hier (default: BRAID_BACKEND, else auto).
    #[arg(long)]
    backend: Option<String>,
    /// Start N local workers (instead of running under `braid launch`).
    #[arg(long, value_name = "N")]
    np: Option<usize>,
}

/// Runs `braid verify`.
pub fn run(args: VerifyArgs) -> Result<i32, String> {
    let backend = args
        .backend
        .as_deref()
        .map(BackendKind::parse)
        .transpose()?;
    if let Some(np) = args.np {
        return super::workers::relaunch_locally(np);
    }
    let mut options = CommOptions::from_env().map_err(|e| e.to_string())?;
    if let Some(b) = backend {
        options.backend = b;
    }
    let comm = super::workers::init(options)?;
    let start = std::time::Instant::now();
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
