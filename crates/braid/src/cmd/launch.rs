//! `braid launch`: start and supervise the workers of a distributed job.

use braid_launch::output::{self, OutputOptions, StreamSpec};
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
  braid launch --nproc-per-node 4 --tee 3 --local-ranks-filter 0 train.py   (rank 0 on the console, all in logs)
  srun -N4 --ntasks-per-node=1 braid launch --nproc-per-node 8 -- ./train   (layout from SLURM)

torchrun's flags are all accepted, with either spelling (--nproc-per-node, --nproc_per_node); the
few braid has no use for (--monitor-interval, --start-method, --event-log-handler, --local-addr,
--logs-specs, --numa-binding, --run-path, --use-env) say so in one line. Any other flag before the
program is refused; put `--` before a program whose name starts with `-`.

Like torchrun, each option may come from a PET_<NAME> variable (PET_NPROC_PER_NODE, PET_NNODES,
PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT, PET_RDZV_ENDPOINT, PET_MAX_RESTARTS, ...: what
Kubeflow's trainer sets); a flag on the command line wins over its variable.

Each worker gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE,
ROLE_NAME, ROLE_RANK, ROLE_WORLD_SIZE, MASTER_ADDR, MASTER_PORT (a port free for the workers' own
use), TORCHELASTIC_RUN_ID, TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS, BRAID_RUN_ID,
BRAID_RESTART_COUNT, BRAID_MAX_RESTARTS, BRAID_STORE_ADDR and BRAID_STORE_PREFIX (the launcher's
rendezvous store), BRAID_LOG_DIR (where workers dump their flight records,
flight-rankNNNNN-attemptA.json: --log-dir, else a directory printed at start), and
OMP_NUM_THREADS=1 when several workers share a node and it is not already set. Set
BRAID_STORE_TOKEN on every node to make the store demand a shared secret.

When an attempt fails, the running workers are asked for their flight records (SIGUSR1) and
waited for while they write them, up to 30 s; `braid doctor DIR` diagnoses every attempt's."
)]
pub struct LaunchArgs {
    /// Workers to start on this node: a number, or auto (one per GPU if
    /// there are GPUs, else one per core), gpu or cpu.
    #[arg(long, visible_alias = "nproc_per_node", alias = "nproc", default_value = "1",
          value_name = "N|auto|gpu|cpu", value_parser = super::parse_nproc,
          env = "PET_NPROC_PER_NODE", hide_env = true)]
    nproc_per_node: super::Nproc,
    /// Start --nproc-per-node workers even when there are far more of them than this host's
    /// cores (without it, more than 4 per CPU core, and more than 16, are refused).
    #[arg(long, alias = "force_nproc")]
    force_nproc: bool,
    /// Number of nodes (default: SLURM_NNODES, else 1), or MIN:MAX (elastic: an attempt
    /// starts once MIN nodes have joined and no more came within --rdzv-last-call; a restart
    /// after a node is lost goes on without it, the workers' world smaller).
    #[arg(long, value_name = "M|MIN:MAX", value_parser = parse_nnodes,
          env = "PET_NNODES", hide_env = true)]
    nnodes: Option<(Option<usize>, usize)>,
    /// Elastic (--nnodes MIN:MAX): seconds node 0 waits for more nodes once MIN have joined.
    #[arg(long, alias = "rdzv_last_call", default_value = "30", value_name = "S",
          value_parser = super::parse_seconds)]
    rdzv_last_call: Duration,
    /// This node's rank, 0..nnodes (default: SLURM_NODEID, else 0).
    #[arg(
        long,
        visible_alias = "node_rank",
        value_name = "R",
        env = "PET_NODE_RANK",
        hide_env = true
    )]
    node_rank: Option<usize>,
    /// Address of node 0 (default: first host of SLURM's node list, else 127.0.0.1).
    #[arg(
        long,
        visible_alias = "master_addr",
        value_name = "ADDR",
        env = "PET_MASTER_ADDR",
        hide_env = true
    )]
    master_addr: Option<String>,
    /// Port of the rendezvous store on node 0 [default: 29500] (0 on one node: any free port).
    #[arg(
        long,
        visible_alias = "master_port",
        value_name = "PORT",
        env = "PET_MASTER_PORT",
        hide_env = true
    )]
    master_port: Option<u16>,
    /// Node 0's store as torchrun's c10d rendezvous names it, HOST[:PORT]: the same as
    /// --master-addr HOST --master-port PORT (HOST:0 on one node: any free port).
    #[arg(
        long,
        alias = "rdzv_endpoint",
        value_name = "HOST[:PORT]",
        env = "PET_RDZV_ENDPOINT",
        hide_env = true
    )]
    rdzv_endpoint: Option<String>,
    /// torchrun's rendezvous backend: c10d or static are accepted (braid's own store plays
    /// their part); others are refused.
    #[arg(
        long,
        alias = "rdzv_backend",
        value_name = "NAME",
        env = "PET_RDZV_BACKEND",
        hide_env = true
    )]
    rdzv_backend: Option<String>,
    /// torchrun's rendezvous settings, KEY=VALUE,...: join_timeout sets --rdzv-timeout and
    /// last_call_timeout --rdzv-last-call; others are noted and not needed.
    #[arg(
        long,
        alias = "rdzv_conf",
        value_name = "K=V,...",
        env = "PET_RDZV_CONF",
        hide_env = true
    )]
    rdzv_conf: Option<String>,
    /// Single node on localhost, rendezvous on a free port.
    #[arg(long, env = "PET_STANDALONE", hide_env = true)]
    standalone: bool,
    /// Restart the whole worker group up to K times after a failure.
    #[arg(
        long,
        visible_alias = "max_restarts",
        default_value_t = 0,
        value_name = "K",
        env = "PET_MAX_RESTARTS",
        hide_env = true
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
    /// Also write each rank's output to DIR/rank<N>.log (and the workers' flight records).
    #[arg(
        long,
        visible_alias = "log_dir",
        value_name = "DIR",
        env = "PET_LOG_DIR",
        hide_env = true
    )]
    log_dir: Option<PathBuf>,
    /// Copy workers' streams to their log files as well as the console: 0 none, 1 stdout,
    /// 2 stderr, 3 both, or per local rank (0:3,1:2). Without --log-dir the files go to the run's
    /// log directory (printed at start).
    #[arg(
        short = 't',
        long,
        value_name = "N|LR:N,..",
        env = "PET_TEE",
        hide_env = true
    )]
    tee: Option<String>,
    /// Send workers' streams to their log files instead of the console (values as --tee).
    #[arg(
        short = 'r',
        long,
        value_name = "N|LR:N,..",
        env = "PET_REDIRECTS",
        hide_env = true
    )]
    redirects: Option<String>,
    /// Show only these local ranks' output on the console, e.g. 0 or 0,1 (log files keep
    /// every rank's).
    #[arg(
        long,
        alias = "local_ranks_filter",
        value_name = "R,..",
        env = "PET_LOCAL_RANKS_FILTER",
        hide_env = true
    )]
    local_ranks_filter: Option<String>,
    /// The workers' role name (ROLE_NAME; torchrun's --role).
    #[arg(long, default_value = braid_launch::config::DEFAULT_ROLE, value_name = "NAME",
          env = "PET_ROLE", hide_env = true)]
    role: String,
    /// Signals the launcher catches and forwards to the workers (torchrun's list by default).
    #[arg(long, alias = "signals_to_handle", value_name = "SIG,..",
          default_value = braid_launch::signals::TORCHRUN_SIGNALS,
          env = "PET_SIGNALS_TO_HANDLE", hide_env = true)]
    signals_to_handle: String,
    /// Run id shared by all nodes (default: SLURM_JOB_ID, else random).
    #[arg(long, visible_aliases = ["run_id", "rdzv-id", "rdzv_id"], value_name = "ID",
          env = "PET_RDZV_ID", hide_env = true)]
    run_id: Option<String>,
    /// Address node 0's store listens on (default: the master address; 0.0.0.0 for all interfaces).
    #[arg(long, alias = "store_bind", value_name = "ADDR")]
    store_bind: Option<String>,
    /// Run the program as it is named, even a .py file (by default a .py program runs under
    /// python3, as torchrun runs it).
    #[arg(
        long,
        visible_alias = "no_python",
        conflicts_with = "module",
        env = "PET_NO_PYTHON",
        hide_env = true
    )]
    no_python: bool,
    /// The program is a Python module: each worker runs `python3 -m MODULE ARGS`.
    #[arg(short = 'm', long, env = "PET_MODULE", hide_env = true)]
    module: bool,
    /// Forward the workers' stdout as it is, without the `[rank N] ` prefix (their stderr
    /// keeps it): for programs whose rank 0 prints output meant for parsers.
    #[arg(long)]
    no_prefix: bool,
    #[command(flatten)]
    unused: TorchrunOnly,
    /// The worker program and its arguments (`--` before them is optional; a .py program
    /// runs under python3).
    #[arg(required = true, trailing_var_arg = true, value_name = "PROGRAM ARGS")]
    command: Vec<OsString>,
}

/// torchrun's flags that have nothing to do in braid's launcher: accepted
/// so that torchrun's command lines run unchanged, each answered by one
/// line saying why it does nothing here.
#[derive(Args)]
#[command(next_help_heading = "torchrun's flags braid accepts and has no use for")]
struct TorchrunOnly {
    /// Seconds between checks of the workers (braid learns of an exit at once).
    #[arg(
        long,
        alias = "monitor_interval",
        value_name = "S",
        env = "PET_MONITOR_INTERVAL",
        hide_env = true
    )]
    monitor_interval: Option<f64>,
    /// spawn, fork or forkserver (braid always starts a fresh process: spawn).
    #[arg(long, alias = "start_method", value_name = "M",
          value_parser = ["spawn", "fork", "forkserver"],
          env = "PET_START_METHOD", hide_env = true)]
    start_method: Option<String>,
    /// A torchelastic event handler (braid prints its events).
    #[arg(
        long,
        alias = "event_log_handler",
        value_name = "NAME",
        env = "PET_EVENT_LOG_HANDLER",
        hide_env = true
    )]
    event_log_handler: Option<String>,
    /// This node's address for the rendezvous (braid's store sees the node's own).
    #[arg(
        long,
        alias = "local_addr",
        value_name = "ADDR",
        env = "PET_LOCAL_ADDR",
        hide_env = true
    )]
    local_addr: Option<String>,
    /// A torchrun logging plugin (Python; braid's --tee/--redirects/--log-dir instead).
    #[arg(long, alias = "logs_specs", value_name = "NAME")]
    logs_specs: Option<String>,
    /// NUMA binding of workers: node, socket, exclusive or core-complex (not applied).
    #[arg(long, alias = "numa_binding", value_name = "MODE",
          value_parser = ["node", "socket", "exclusive", "core-complex"])]
    numa_binding: Option<String>,
    /// Run the script in torchrun's own interpreter (braid runs it as python3 SCRIPT).
    #[arg(long, alias = "run_path", env = "PET_RUN_PATH", hide_env = true)]
    run_path: bool,
    /// torch.distributed.launch's --use-env (the environment is always set).
    #[arg(long, alias = "use_env")]
    use_env: bool,
}

impl TorchrunOnly {
    /// One line per flag given, saying what braid does instead.
    fn notes(&self) -> Vec<String> {
        let mut notes = Vec::new();
        if let Some(s) = self.monitor_interval {
            notes.push(format!(
                "--monitor-interval {s}: not needed (braid learns of a worker's exit at once)"
            ));
        }
        if let Some(m) = self.start_method.as_deref().filter(|m| *m != "spawn") {
            notes.push(format!(
                "--start-method {m}: braid starts every worker as a fresh process (spawn)"
            ));
        }
        if let Some(h) = self.event_log_handler.as_deref().filter(|h| *h != "null") {
            notes.push(format!(
                "--event-log-handler {h}: not used (braid prints its events)"
            ));
        }
        if let Some(a) = &self.local_addr {
            notes.push(format!(
                "--local-addr {a}: not needed (the store sees each node's own address)"
            ));
        }
        if let Some(l) = &self.logs_specs {
            notes.push(format!(
                "--logs-specs {l}: a torchrun plugin, not used (--tee, --redirects and --log-dir \
                 choose where output goes)"
            ));
        }
        if let Some(n) = &self.numa_binding {
            notes.push(format!(
                "--numa-binding {n}: not applied (bind with numactl in the program's command)"
            ));
        }
        if self.run_path {
            notes.push("--run-path: the script runs as python3 SCRIPT".into());
        }
        if self.use_env {
            notes.push("--use-env: not needed (the workers' environment is always set)".into());
        }
        notes
    }
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
    let mut notes = a.unused.notes();
    let (master_addr, master_port) = match &a.rdzv_endpoint {
        Some(e) => {
            if a.master_addr.is_some() || a.master_port.is_some() {
                notes.push(format!(
                    "--rdzv-endpoint {e} stands for node 0's address and port: \
                     --master-addr/--master-port are not used"
                ));
            }
            let (host, port) = split_endpoint(e)?;
            (Some(host), port)
        }
        None => (a.master_addr, a.master_port),
    };
    let (mut rdzv_timeout, mut rdzv_last_call) = (a.rdzv_timeout, a.rdzv_last_call);
    if let Some(conf) = &a.rdzv_conf {
        for (key, value) in parse_rdzv_conf(conf)? {
            let seconds =
                || super::parse_seconds(&value).map_err(|e| format!("--rdzv-conf {key}: {e}"));
            match key.as_str() {
                "join_timeout" => rdzv_timeout = seconds()?,
                "last_call_timeout" => rdzv_last_call = seconds()?,
                _ => notes.push(format!(
                    "--rdzv-conf {key}={value}: not used (braid reads join_timeout and \
                     last_call_timeout)"
                )),
            }
        }
    }
    let output = OutputOptions {
        log_all: false,
        tee: parse_streams("--tee", a.tee.as_deref())?,
        redirects: parse_streams("--redirects", a.redirects.as_deref())?,
        console_ranks: a
            .local_ranks_filter
            .as_deref()
            .map(output::parse_ranks_filter)
            .transpose()?,
    };
    let handled = braid_launch::signals::parse_signal_list(&a.signals_to_handle)?;
    let options = LaunchOptions {
        nproc_per_node: a.nproc_per_node.count()?,
        force_nproc: a.force_nproc,
        nnodes: a.nnodes.map(|(_, max)| max),
        min_nnodes: a.nnodes.and_then(|(min, _)| min),
        rdzv_last_call,
        node_rank: a.node_rank,
        master_addr,
        master_port,
        standalone: a.standalone,
        max_restarts: a.max_restarts,
        rdzv_timeout,
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
        output,
        role: a.role,
    };
    local_ranks_checked(&options)?;
    if let Some(d) = options
        .log_dir
        .as_deref()
        .filter(|d| d.exists() && !d.is_dir())
    {
        return Err(format!(
            "--log-dir {}: a file; --log-dir names the directory the ranks' logs and flight \
             records go to",
            d.display()
        ));
    }
    let plan = options.resolve().map_err(|e| e.to_string())?;
    for note in &notes {
        eprintln!("braid launch: note: {note}");
    }
    let signals = Signals::install_for(&handled)
        .map_err(|e| format!("cannot install signal handlers: {e}"))?;
    braid_launch::launch(&plan, &signals).map_err(|e| e.to_string())
}

/// `--tee`/`--redirects`, parsed (absent: no stream).
/// Refuses local ranks in `--local-ranks-filter`, `--tee` or
/// `--redirects` that this node does not start (they would silently
/// match none: a filter of only such ranks hides every worker's output).
fn local_ranks_checked(o: &LaunchOptions) -> Result<(), String> {
    let n = o.nproc_per_node;
    let per_rank = |spec: &StreamSpec| match spec {
        StreamSpec::PerRank(pairs) => pairs.iter().map(|(r, _)| *r).collect(),
        _ => Vec::new(),
    };
    for (flag, ranks) in [
        (
            "--local-ranks-filter",
            o.output.console_ranks.clone().unwrap_or_default(),
        ),
        ("--tee", per_rank(&o.output.tee)),
        ("--redirects", per_rank(&o.output.redirects)),
    ] {
        if let Some(r) = ranks.iter().find(|&&r| r >= n) {
            return Err(format!(
                "{flag}: local rank {r} is not on this node, which starts {} (local ranks 0 to \
                 {}; --nproc-per-node sets how many)",
                braid_core::words::count(n, "worker"),
                n - 1
            ));
        }
    }
    Ok(())
}

fn parse_streams(flag: &str, value: Option<&str>) -> Result<StreamSpec, String> {
    value.map_or(Ok(StreamSpec::None), |v| StreamSpec::parse(flag, v))
}

/// torchrun's `--rdzv-conf KEY=VALUE,...`.
fn parse_rdzv_conf(conf: &str) -> Result<Vec<(String, String)>, String> {
    conf.split(',')
        .filter(|kv| !kv.trim().is_empty())
        .map(|kv| match kv.split_once('=') {
            Some((k, v)) if !k.trim().is_empty() => Ok((k.trim().into(), v.trim().into())),
            _ => Err(format!(
                "--rdzv-conf {conf:?}: expected KEY=VALUE pairs separated by commas, e.g. \
                 join_timeout=600"
            )),
        })
        .collect()
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
    use super::{parse_rdzv_conf, split_endpoint};

    #[test]
    fn rdzv_conf_reads_pairs() {
        assert_eq!(
            parse_rdzv_conf("join_timeout=600, read_timeout=60").unwrap(),
            vec![
                ("join_timeout".to_string(), "600".to_string()),
                ("read_timeout".to_string(), "60".to_string())
            ]
        );
        assert!(parse_rdzv_conf("join_timeout").is_err());
    }

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
