//! `braid launch`: start and supervise the workers of a distributed job.

use braid_launch::{LaunchOptions, Signals};
use clap::Args;
use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

/// Start N workers per node with torchrun's environment, watch them, stop
/// them all at the first failure.
#[derive(Args)]
#[command(
    about = "Start and supervise the worker processes of a distributed job (like torchrun)",
    after_help = "\
Examples:
  braid launch --standalone --nproc-per-node 4 -- ./target/release/examples/hello
  braid launch --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --nproc-per-node 8 -- python train.py
  srun -N4 --ntasks-per-node=1 braid launch --nproc-per-node 8 -- ./train   (layout from SLURM)

Each worker gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,
MASTER_PORT (a port free for the workers' own use), BRAID_RUN_ID, BRAID_RESTART_COUNT,
BRAID_MAX_RESTARTS, BRAID_STORE_ADDR and BRAID_STORE_PREFIX (the launcher's rendezvous store),
BRAID_LOG_DIR (where workers dump their flight records: --log-dir, else a directory printed at
start), and OMP_NUM_THREADS=1 when several workers share a node and it is not already set.
Set BRAID_STORE_TOKEN on every node to make the store demand a shared secret."
)]
pub struct LaunchArgs {
    /// Workers to start on this node.
    #[arg(long, default_value_t = 1, value_name = "N")]
    nproc_per_node: usize,
    /// Start --nproc-per-node workers even when there are far more of them than this host's
    /// cores (without it, more than 4 per CPU core, and more than 16, are refused).
    #[arg(long)]
    force_nproc: bool,
    /// Number of nodes (default: SLURM_NNODES, else 1), or MIN:MAX (elastic: an attempt
    /// starts once MIN nodes have joined and no more came within --rdzv-last-call; a restart
    /// after a node is lost goes on without it, the workers' world smaller).
    #[arg(long, value_name = "M|MIN:MAX", value_parser = parse_nnodes)]
    nnodes: Option<(Option<usize>, usize)>,
    /// Elastic (--nnodes MIN:MAX): seconds node 0 waits for more nodes once MIN have joined.
    #[arg(long, default_value = "30", value_name = "S", value_parser = super::parse_seconds)]
    rdzv_last_call: Duration,
    /// This node's rank, 0..nnodes (default: SLURM_NODEID, else 0).
    #[arg(long, value_name = "R")]
    node_rank: Option<usize>,
    /// Address of node 0 (default: first host of SLURM's node list, else 127.0.0.1).
    #[arg(long, value_name = "ADDR")]
    master_addr: Option<String>,
    /// Port of the rendezvous store on node 0 [default: 29500].
    #[arg(long, value_name = "PORT")]
    master_port: Option<u16>,
    /// Single node on localhost, rendezvous on a free port.
    #[arg(long)]
    standalone: bool,
    /// Restart the whole worker group up to K times after a failure.
    #[arg(long, default_value_t = 0, value_name = "K")]
    max_restarts: u32,
    /// Seconds nodes wait for each other at rendezvous.
    #[arg(long, default_value = "300", value_name = "S", value_parser = super::parse_seconds)]
    rdzv_timeout: Duration,
    /// Seconds between SIGTERM and SIGKILL when stopping workers.
    #[arg(long, default_value = "3", value_name = "S", value_parser = super::parse_seconds)]
    grace_period: Duration,
    /// Also write each rank's output to DIR/rank<N>.log.
    #[arg(long, value_name = "DIR")]
    log_dir: Option<PathBuf>,
    /// Run id shared by all nodes (default: SLURM_JOB_ID, else random).
    #[arg(long, value_name = "ID")]
    run_id: Option<String>,
    /// Address node 0's store listens on (default: the master address; 0.0.0.0 for all interfaces).
    #[arg(long, value_name = "ADDR")]
    store_bind: Option<String>,
    /// The worker program and its arguments (after `--`).
    #[arg(
        required = true,
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "PROGRAM ARGS"
    )]
    command: Vec<OsString>,
}

/// `--nnodes M` or `MIN:MAX`.
fn parse_nnodes(s: &str) -> Result<(Option<usize>, usize), String> {
    let num = |v: &str| {
        v.trim()
            .parse::<usize>()
            .map_err(|_| format!("{s:?}: expected a number of nodes, or MIN:MAX"))
    };
    match s.split_once(':') {
        None => Ok((None, num(s)?)),
        Some((a, b)) => {
            let (min, max) = (num(a)?, num(b)?);
            if min == 0 || min > max {
                return Err(format!("{s:?}: MIN must be 1 to MAX"));
            }
            Ok((Some(min), max))
        }
    }
}

/// Runs `braid launch`; returns the launcher's exit code.
pub fn run(a: LaunchArgs) -> Result<i32, String> {
    let options = LaunchOptions {
        nproc_per_node: a.nproc_per_node,
        force_nproc: a.force_nproc,
        nnodes: a.nnodes.map(|(_, max)| max),
        min_nnodes: a.nnodes.and_then(|(min, _)| min),
        rdzv_last_call: a.rdzv_last_call,
        node_rank: a.node_rank,
        master_addr: a.master_addr,
        master_port: a.master_port,
        standalone: a.standalone,
        max_restarts: a.max_restarts,
        rdzv_timeout: a.rdzv_timeout,
        grace_period: a.grace_period,
        log_dir: a.log_dir,
        run_id: a.run_id,
        store_bind: a.store_bind,
        command: a.command,
    };
    let plan = options.resolve().map_err(|e| e.to_string())?;
    let signals = Signals::install().map_err(|e| format!("cannot install signal handlers: {e}"))?;
    braid_launch::launch(&plan, &signals).map_err(|e| e.to_string())
}
