//! `braid launch`: start and supervise the workers of a distributed job.

use braid_launch::{LaunchOptions, PythonMode, Signals};
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
  braid launch --nproc-per-node 2 train.py        (runs `python3 train.py` twice, as torchrun)
  braid launch --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --nproc-per-node gpu train.py
  srun -N4 --ntasks-per-node=1 braid launch --nproc-per-node 8 -- ./train   (layout from SLURM)

Each worker gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,
MASTER_PORT (a port free for the workers' own use), BRAID_RUN_ID, BRAID_RESTART_COUNT,
BRAID_MAX_RESTARTS, BRAID_STORE_ADDR and BRAID_STORE_PREFIX (the launcher's rendezvous store),
BRAID_LOG_DIR (where workers dump their flight records: --log-dir, else a directory printed at
start), and OMP_NUM_THREADS=1 when several workers share a node and it is not already set.
Set BRAID_STORE_TOKEN on every node to make the store demand a shared secret."
)]
pub struct LaunchArgs {
    /// Workers to start on this node: a number, or auto (one per GPU if
    /// there are GPUs, else one per core), gpu or cpu.
    #[arg(long, visible_alias = "nproc_per_node", alias = "nproc", default_value = "1",
          value_name = "N|auto|gpu|cpu", value_parser = super::parse_nproc)]
    nproc_per_node: super::Nproc,
    /// Start --nproc-per-node workers even when there are far more of them than this host's
    /// cores (without it, more than 4 per CPU core, and more than 16, are refused).
    #[arg(long, alias = "force_nproc")]
    force_nproc: bool,
    /// Number of nodes (default: SLURM_NNODES, else 1), or MIN:MAX (elastic: an attempt
    /// starts once MIN nodes have joined and no more came within --rdzv-last-call; a restart
    /// after a node is lost goes on without it, the workers' world smaller).
    #[arg(long, value_name = "M|MIN:MAX", value_parser = parse_nnodes)]
    nnodes: Option<(Option<usize>, usize)>,
    /// Elastic (--nnodes MIN:MAX): seconds node 0 waits for more nodes once MIN have joined.
    #[arg(long, alias = "rdzv_last_call", default_value = "30", value_name = "S",
          value_parser = super::parse_seconds)]
    rdzv_last_call: Duration,
    /// This node's rank, 0..nnodes (default: SLURM_NODEID, else 0).
    #[arg(long, visible_alias = "node_rank", value_name = "R")]
    node_rank: Option<usize>,
    /// Address of node 0 (default: first host of SLURM's node list, else 127.0.0.1).
    #[arg(long, visible_alias = "master_addr", value_name = "ADDR")]
    master_addr: Option<String>,
    /// Port of the rendezvous store on node 0 [default: 29500].
    #[arg(long, visible_alias = "master_port", value_name = "PORT")]
    master_port: Option<u16>,
    /// Node 0's store as torchrun's c10d rendezvous names it, HOST[:PORT]: the same as
    /// --master-addr HOST --master-port PORT.
    #[arg(long, alias = "rdzv_endpoint", value_name = "HOST[:PORT]",
          conflicts_with_all = ["master_addr", "master_port"])]
    rdzv_endpoint: Option<String>,
    /// torchrun's rendezvous backend: c10d or static are accepted (braid's own store plays
    /// their part); others are refused.
    #[arg(long, alias = "rdzv_backend", value_name = "NAME")]
    rdzv_backend: Option<String>,
    /// Single node on localhost, rendezvous on a free port.
    #[arg(long)]
    standalone: bool,
    /// Restart the whole worker group up to K times after a failure.
    #[arg(
        long,
        visible_alias = "max_restarts",
        default_value_t = 0,
        value_name = "K"
    )]
    max_restarts: u32,
    /// Seconds nodes wait for each other at rendezvous.
    #[arg(long, alias = "rdzv_timeout", default_value = "300", value_name = "S",
          value_parser = super::parse_seconds)]
    rdzv_timeout: Duration,
    /// Seconds between SIGTERM and SIGKILL when stopping workers.
    #[arg(long, alias = "grace_period", default_value = "3", value_name = "S",
          value_parser = super::parse_seconds)]
    grace_period: Duration,
    /// Also write each rank's output to DIR/rank<N>.log.
    #[arg(long, visible_alias = "log_dir", value_name = "DIR")]
    log_dir: Option<PathBuf>,
    /// Run id shared by all nodes (default: SLURM_JOB_ID, else random).
    #[arg(long, visible_aliases = ["run_id", "rdzv-id", "rdzv_id"], value_name = "ID")]
    run_id: Option<String>,
    /// Address node 0's store listens on (default: the master address; 0.0.0.0 for all interfaces).
    #[arg(long, alias = "store_bind", value_name = "ADDR")]
    store_bind: Option<String>,
    /// Run the program as it is named, even a .py file (by default a .py program runs under
    /// python3, as torchrun runs it).
    #[arg(long, visible_alias = "no_python", conflicts_with = "module")]
    no_python: bool,
    /// The program is a Python module: each worker runs `python3 -m MODULE ARGS`.
    #[arg(short = 'm', long)]
    module: bool,
    /// Forward the workers' stdout as it is, without the `[rank N] ` prefix (their stderr
    /// keeps it): for programs whose rank 0 prints output meant for parsers.
    #[arg(long)]
    no_prefix: bool,
    /// The worker program and its arguments (`--` before them is optional; a .py program
    /// runs under python3).
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
    if let Some(b) = &a.rdzv_backend {
        if b != "c10d" && b != "static" {
            return Err(format!(
                "--rdzv-backend {b}: braid rendezvous through its own TCP store, which takes the \
                 part of c10d and static; drop the flag or pass c10d"
            ));
        }
    }
    let (master_addr, master_port) = match &a.rdzv_endpoint {
        Some(e) => {
            let (host, port) = split_endpoint(e)?;
            (Some(host), port)
        }
        None => (a.master_addr, a.master_port),
    };
    let options = LaunchOptions {
        nproc_per_node: a.nproc_per_node.count()?,
        force_nproc: a.force_nproc,
        nnodes: a.nnodes.map(|(_, max)| max),
        min_nnodes: a.nnodes.and_then(|(min, _)| min),
        rdzv_last_call: a.rdzv_last_call,
        node_rank: a.node_rank,
        master_addr,
        master_port,
        standalone: a.standalone,
        max_restarts: a.max_restarts,
        rdzv_timeout: a.rdzv_timeout,
        grace_period: a.grace_period,
        log_dir: a.log_dir,
        run_id: a.run_id,
        store_bind: a.store_bind,
        command: a.command,
        python: match (a.no_python, a.module) {
            (true, _) => PythonMode::Direct,
            (_, true) => PythonMode::Module,
            _ => PythonMode::Script,
        },
        prefix_stdout: !a.no_prefix,
    };
    let plan = options.resolve().map_err(|e| e.to_string())?;
    let signals = Signals::install().map_err(|e| format!("cannot install signal handlers: {e}"))?;
    braid_launch::launch(&plan, &signals).map_err(|e| e.to_string())
}

/// `HOST[:PORT]` (an IPv6 host in brackets) as torchrun's `--rdzv-endpoint`.
fn split_endpoint(e: &str) -> Result<(String, Option<u16>), String> {
    let bad = || format!("--rdzv-endpoint {e:?}: expected HOST or HOST:PORT");
    // A colon before the last one belongs to a bare IPv6 address.
    let (host, port) = match e.rsplit_once(':') {
        Some((h, p)) if !h.contains(':') || h.ends_with(']') => {
            (h, Some(p.parse::<u16>().map_err(|_| bad())?))
        }
        _ => (e, None),
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() {
        return Err(bad());
    }
    Ok((host.to_string(), port))
}

#[cfg(test)]
mod tests {
    use super::split_endpoint;

    #[test]
    fn rdzv_endpoints_split_into_host_and_port() {
        assert_eq!(
            split_endpoint("node0:29400").unwrap(),
            ("node0".into(), Some(29400))
        );
        assert_eq!(split_endpoint("node0").unwrap(), ("node0".into(), None));
        assert_eq!(split_endpoint("[::1]:5").unwrap(), ("::1".into(), Some(5)));
        assert!(split_endpoint("node0:x").is_err());
        assert!(split_endpoint(":1").is_err());
    }
}
