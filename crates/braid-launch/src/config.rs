//! What to launch: the user's options, resolved against SLURM's variables
//! into a [`LaunchPlan`] with every choice made and checked.

use crate::error::LaunchError;
use crate::output::OutputOptions;
use braid_core::slurm;
use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

/// Default rendezvous port, as torchrun's.
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// Options as the user gave them; `None` means "not given".
#[derive(Debug, Clone)]
pub struct LaunchOptions {
    /// Workers to start on this node.
    pub nproc_per_node: usize,
    /// Start `nproc_per_node` workers even when that is far more than the
    /// host's cores (see [`nproc_limit`]).
    pub force_nproc: bool,
    /// Number of nodes (launchers) in the job (the most, when elastic).
    pub nnodes: Option<usize>,
    /// Elastic: the fewest nodes an attempt may start with (torchrun's
    /// `--nnodes MIN:MAX`); `None`: exactly `nnodes`.
    pub min_nnodes: Option<usize>,
    /// Elastic: once `min_nnodes` have joined, how long node 0 waits for
    /// more before starting without them.
    pub rdzv_last_call: Duration,
    /// This node's rank among the nodes.
    pub node_rank: Option<usize>,
    /// Address of node 0, where the rendezvous store runs.
    pub master_addr: Option<String>,
    /// Port of the rendezvous store on node 0.
    pub master_port: Option<u16>,
    /// Single node on localhost with a free port.
    pub standalone: bool,
    /// Restarts of the whole worker group allowed after a failure.
    pub max_restarts: u32,
    /// How long nodes wait for each other at rendezvous.
    pub rdzv_timeout: Duration,
    /// Time between SIGTERM and SIGKILL when stopping workers.
    pub grace_period: Duration,
    /// Directory for one log file per rank.
    pub log_dir: Option<PathBuf>,
    /// Run identifier shared by all nodes.
    pub run_id: Option<String>,
    /// Address the store listens on (node 0), default the master address.
    pub store_bind: Option<String>,
    /// The worker program and its arguments.
    pub command: Vec<OsString>,
    /// How a Python program is started (torchrun's habits).
    pub python: PythonMode,
    /// Whether workers' stdout lines get the `[rank N] ` prefix.
    pub prefix_stdout: bool,
    /// Which workers' streams reach the console and which their log files
    /// (`--tee`, `--redirects`, `--local-ranks-filter`; `--log-dir` adds
    /// every stream to the files).
    pub output: OutputOptions,
    /// The workers' role (`ROLE_NAME`, torchrun's `--role`).
    pub role: String,
}

/// How `braid launch` treats a Python program, as torchrun does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PythonMode {
    /// A program ending in `.py` runs as `python3 PROGRAM ARGS`; anything
    /// else is executed directly.
    #[default]
    Script,
    /// The program is a Python module: `python3 -m MODULE ARGS`
    /// (torchrun's `-m`).
    Module,
    /// Execute the program directly, whatever its name (torchrun's
    /// `--no-python`).
    Direct,
}

/// The interpreter a Python program runs under.
pub const PYTHON: &str = "python3";

/// The command line each worker runs: `command` with the interpreter put
/// in front where `mode` says so.
pub fn worker_command(command: &[OsString], mode: PythonMode) -> Vec<OsString> {
    let is_script = command.first().is_some_and(|p| {
        std::path::Path::new(p)
            .extension()
            .is_some_and(|e| e == "py")
    });
    let mut out = Vec::with_capacity(command.len() + 2);
    match mode {
        PythonMode::Script if is_script => out.push(OsString::from(PYTHON)),
        PythonMode::Module => out.extend([OsString::from(PYTHON), OsString::from("-m")]),
        _ => {}
    }
    out.extend(command.iter().cloned());
    out
}

impl Default for LaunchOptions {
    fn default() -> Self {
        LaunchOptions {
            nproc_per_node: 1,
            force_nproc: false,
            nnodes: None,
            min_nnodes: None,
            rdzv_last_call: Duration::from_secs(30),
            node_rank: None,
            master_addr: None,
            master_port: None,
            standalone: false,
            max_restarts: 0,
            rdzv_timeout: Duration::from_secs(300),
            grace_period: Duration::from_secs(3),
            log_dir: None,
            run_id: None,
            store_bind: None,
            command: Vec::new(),
            python: PythonMode::Script,
            prefix_stdout: true,
            output: OutputOptions::default(),
            role: DEFAULT_ROLE.to_string(),
        }
    }
}

/// torchrun's default `--role`.
pub const DEFAULT_ROLE: &str = "default";

/// Every launch decision, made.
#[derive(Debug, Clone)]
pub struct LaunchPlan {
    /// Workers on this node.
    pub nproc_per_node: usize,
    /// Nodes in the job (the most, when elastic).
    pub nnodes: usize,
    /// The fewest nodes an attempt starts with (`nnodes` unless elastic).
    pub min_nnodes: usize,
    /// Elastic: how long node 0 waits for more nodes once `min_nnodes`
    /// have joined.
    pub rdzv_last_call: Duration,
    /// This node's rank.
    pub node_rank: usize,
    /// Node 0's address.
    pub master_addr: String,
    /// The rendezvous store's port on node 0 (0 with `--standalone` until
    /// the store has bound a free port).
    pub master_port: u16,
    /// Where node 0's store listens.
    pub store_bind: String,
    /// Restarts allowed.
    pub max_restarts: u32,
    /// Rendezvous timeout.
    pub rdzv_timeout: Duration,
    /// SIGTERM-to-SIGKILL grace period.
    pub grace_period: Duration,
    /// Log directory.
    pub log_dir: Option<PathBuf>,
    /// Proposed run id (node 0's wins).
    pub run_id: String,
    /// Program and arguments.
    pub command: Vec<OsString>,
    /// Where the node layout came from, for the start-up banner.
    pub source: &'static str,
    /// Whether workers' stdout lines get the `[rank N] ` prefix.
    pub prefix_stdout: bool,
    /// Where the workers' streams go (console, log files).
    pub output: OutputOptions,
    /// The workers' role (`ROLE_NAME`).
    pub role: String,
}

impl LaunchPlan {
    /// `host:port` of the rendezvous store.
    pub fn store_addr(&self) -> String {
        braid_store::worker::join_host_port(&self.master_addr, self.master_port)
    }
}

impl LaunchOptions {
    /// Resolves the options against the process environment.
    pub fn resolve(&self) -> Result<LaunchPlan, LaunchError> {
        self.resolve_with(|name| std::env::var(name).ok().filter(|v| !v.trim().is_empty()))
    }

    /// Resolves the options, reading variables through `env`. Flags win over
    /// SLURM's variables, which win over the defaults.
    pub fn resolve_with(
        &self,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<LaunchPlan, LaunchError> {
        self.resolve_on(env, host_cores())
    }

    /// [`resolve_with`](Self::resolve_with) on a host with `cores` cores.
    fn resolve_on(
        &self,
        env: impl Fn(&str) -> Option<String>,
        cores: usize,
    ) -> Result<LaunchPlan, LaunchError> {
        let config = |m: String| LaunchError::Config(m);
        if self.command.is_empty() {
            return Err(config("no program to launch: name it last, e.g. `braid launch --nproc-per-node 2 train.py` (a .py program runs under python3, as with torchrun)".into()));
        }
        if self.nproc_per_node == 0 {
            return Err(config("--nproc-per-node must be at least 1".into()));
        }
        let limit = nproc_limit(cores);
        if self.nproc_per_node > limit && !self.force_nproc {
            let unit = if cores == 1 { "core" } else { "cores" };
            return Err(config(format!(
                "refusing to start {n} workers on this node: the host has {cores} CPU {unit}, \
                 and more than {limit} workers ({CORE_OVERSUBSCRIPTION} per core, at least \
                 {MIN_NPROC_LIMIT}) is most likely a mistake; lower --nproc-per-node, or pass \
                 --force-nproc to `braid launch` to start them anyway",
                n = self.nproc_per_node
            )));
        }
        let in_slurm = env(slurm::NNODES_VAR).is_some() && env(slurm::NODEID_VAR).is_some();
        let parse = |name: &str, v: String| -> Result<usize, LaunchError> {
            v.trim()
                .parse()
                .map_err(|_| config(format!("{name}={v:?} is not a non-negative integer")))
        };
        let (nnodes, node_rank, master_addr, master_port, source);
        if self.standalone {
            if self.nnodes.is_some_and(|n| n != 1) || self.node_rank.is_some_and(|r| r != 0) {
                return Err(config("--standalone runs a single node on localhost: drop --nnodes/--node-rank, or drop --standalone".into()));
            }
            if self.master_addr.is_some() || self.master_port.is_some() {
                return Err(config(
                    "--standalone picks its own address and port: drop --master-addr/--master-port"
                        .into(),
                ));
            }
            nnodes = 1;
            node_rank = 0;
            master_addr = "127.0.0.1".to_string();
            // 0: the store binds any free port and the launcher adopts it,
            // leaving no window in which another process could take it.
            master_port = 0;
            source = "standalone";
        } else {
            nnodes = match (self.nnodes, in_slurm) {
                (Some(n), _) => n,
                (None, true) => parse(
                    slurm::NNODES_VAR,
                    env(slurm::NNODES_VAR).unwrap_or_default(),
                )?,
                (None, false) => 1,
            };
            node_rank = match (self.node_rank, in_slurm) {
                (Some(r), _) => r,
                (None, true) => parse(
                    slurm::NODEID_VAR,
                    env(slurm::NODEID_VAR).unwrap_or_default(),
                )?,
                (None, false) => 0,
            };
            master_addr = match (&self.master_addr, in_slurm) {
                (Some(a), _) => a.clone(),
                (None, true) => {
                    let get = |n: &'static str| env(n);
                    slurm::master_from_env(&get).map_err(|e| config(e.to_string()))?
                }
                (None, false) => "127.0.0.1".to_string(),
            };
            master_port = self.master_port.unwrap_or(DEFAULT_MASTER_PORT);
            source = if in_slurm { "slurm" } else { "flags" };
        }
        if nnodes == 0 {
            return Err(config("--nnodes must be at least 1".into()));
        }
        let min_nnodes = self.min_nnodes.unwrap_or(nnodes);
        if min_nnodes == 0 || min_nnodes > nnodes {
            return Err(config(format!(
                "--nnodes {min_nnodes}:{nnodes}: the fewest nodes must be 1 to {nnodes}"
            )));
        }
        if node_rank >= nnodes {
            return Err(config(format!(
                "node rank {node_rank} is not below the number of nodes {nnodes}"
            )));
        }
        // Port 0 (torchrun's `--rdzv-endpoint HOST:0`): the store binds a
        // free port, which only a single node can learn.
        if master_port == 0 && nnodes > 1 {
            return Err(config(format!(
                "port 0 lets the operating system pick a free port, which the other {} nodes \
                 cannot know: give node 0's port (--master-port or --rdzv-endpoint HOST:PORT)",
                nnodes - 1
            )));
        }
        let run_id = match &self.run_id {
            Some(id) => id.clone(),
            None => env(slurm::JOB_ID_VAR).unwrap_or_else(random_run_id),
        };
        if run_id.is_empty() || run_id.contains('/') {
            return Err(config(format!(
                "run id {run_id:?} must be non-empty and contain no '/'"
            )));
        }
        Ok(LaunchPlan {
            nproc_per_node: self.nproc_per_node,
            nnodes,
            node_rank,
            store_bind: self
                .store_bind
                .clone()
                .unwrap_or_else(|| master_addr.clone()),
            master_addr,
            master_port,
            max_restarts: self.max_restarts,
            rdzv_timeout: self.rdzv_timeout,
            min_nnodes,
            rdzv_last_call: self.rdzv_last_call,
            grace_period: self.grace_period,
            log_dir: self.log_dir.clone(),
            run_id,
            command: worker_command(&self.command, self.python),
            source,
            prefix_stdout: self.prefix_stdout,
            output: OutputOptions {
                log_all: self.log_dir.is_some(),
                ..self.output.clone()
            },
            role: self.role.clone(),
        })
    }
}

/// Workers per core allowed without `--force-nproc`.
pub const CORE_OVERSUBSCRIPTION: usize = 4;
/// The worker limit without `--force-nproc` on hosts with very few cores.
pub const MIN_NPROC_LIMIT: usize = 16;

/// The most workers per node started without `--force-nproc` on a host
/// with `cores` cores: [`CORE_OVERSUBSCRIPTION`] per core, at least
/// [`MIN_NPROC_LIMIT`] (so that small test jobs run on small machines).
/// Far more almost always is a typo, and would start that many processes.
pub fn nproc_limit(cores: usize) -> usize {
    cores
        .saturating_mul(CORE_OVERSUBSCRIPTION)
        .max(MIN_NPROC_LIMIT)
}

/// The cores this process may run on (its CPU affinity and quota), 1 if
/// unknown.
pub fn host_cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// A port that is free on `host` right now (the OS picks it).
pub fn free_port(host: &str) -> Result<u16, LaunchError> {
    let addr = braid_store::worker::join_host_port(host, 0);
    std::net::TcpListener::bind(&addr)
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| LaunchError::Config(format!("cannot find a free port on {host}: {e}")))
}

/// 16 hex digits from the OS's randomness (time and pid if unavailable).
pub fn random_run_id() -> String {
    use std::io::Read;
    let mut bytes = [0u8; 8];
    let ok = std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .is_ok();
    if !ok {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        bytes = (nanos ^ ((std::process::id() as u64) << 32)).to_le_bytes();
    }
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn opts() -> LaunchOptions {
        LaunchOptions {
            command: vec!["true".into()],
            ..Default::default()
        }
    }

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn defaults_are_one_local_node() {
        let p = opts().resolve_with(env(&[])).unwrap();
        assert_eq!(
            (p.nnodes, p.node_rank, p.master_port),
            (1, 0, DEFAULT_MASTER_PORT)
        );
        assert_eq!(p.master_addr, "127.0.0.1");
        assert_eq!(p.store_bind, "127.0.0.1");
        assert_eq!(p.run_id.len(), 16);
    }

    #[test]
    fn slurm_variables_fill_the_layout() {
        let e = env(&[
            ("SLURM_NNODES", "4"),
            ("SLURM_NODEID", "2"),
            ("SLURM_PROCID", "2"),
            ("SLURM_JOB_NODELIST", "gpu[01-04,07]"),
            ("SLURM_JOB_ID", "777"),
        ]);
        let p = opts().resolve_with(e).unwrap();
        assert_eq!((p.nnodes, p.node_rank), (4, 2));
        assert_eq!(p.master_addr, "gpu01");
        assert_eq!(p.run_id, "777");
        assert_eq!(p.source, "slurm");
    }

    #[test]
    fn flags_win_over_slurm() {
        let e = env(&[
            ("SLURM_NNODES", "4"),
            ("SLURM_NODEID", "2"),
            ("SLURM_NODELIST", "a[1-4]"),
        ]);
        let o = LaunchOptions {
            nnodes: Some(2),
            node_rank: Some(1),
            master_addr: Some("head".into()),
            ..opts()
        };
        let p = o.resolve_with(e).unwrap();
        assert_eq!(
            (p.nnodes, p.node_rank, p.master_addr.as_str()),
            (2, 1, "head")
        );
    }

    #[test]
    fn standalone_leaves_the_port_to_the_store() {
        let p = LaunchOptions {
            standalone: true,
            ..opts()
        }
        .resolve_with(env(&[]))
        .unwrap();
        assert_eq!(p.master_addr, "127.0.0.1");
        assert_eq!(p.master_port, 0, "bound by the store itself");
    }

    #[test]
    fn port_zero_picks_a_free_port_on_one_node_only() {
        let one = LaunchOptions {
            master_port: Some(0),
            ..opts()
        };
        assert_eq!(one.resolve_with(env(&[])).unwrap().master_port, 0);
        let two = LaunchOptions {
            master_port: Some(0),
            nnodes: Some(2),
            ..opts()
        };
        let e = two.resolve_with(env(&[])).unwrap_err().to_string();
        assert!(e.contains("port 0") && e.contains("other 1 nodes"), "{e}");
    }

    #[test]
    fn contradictions_are_explained() {
        let err = LaunchOptions {
            standalone: true,
            nnodes: Some(2),
            ..opts()
        }
        .resolve_with(env(&[]))
        .unwrap_err();
        assert!(err.to_string().contains("--standalone"), "{err}");
        let err = LaunchOptions {
            nnodes: Some(2),
            node_rank: Some(2),
            ..opts()
        }
        .resolve_with(env(&[]))
        .unwrap_err();
        assert!(err.to_string().contains("node rank 2"), "{err}");
        let err = LaunchOptions::default().resolve_with(env(&[])).unwrap_err();
        assert!(err.to_string().contains("name it last"), "{err}");
        let err = LaunchOptions {
            nproc_per_node: 0,
            ..opts()
        }
        .resolve_with(env(&[]))
        .unwrap_err();
        assert!(err.to_string().contains("--nproc-per-node"), "{err}");
    }

    #[test]
    fn elastic_node_counts_are_checked() {
        let elastic = |min, max| LaunchOptions {
            nnodes: Some(max),
            min_nnodes: min,
            command: vec!["x".into()],
            ..Default::default()
        };
        let p = elastic(Some(1), 3).resolve_with(env(&[])).unwrap();
        assert_eq!((p.min_nnodes, p.nnodes), (1, 3));
        let p = elastic(None, 3).resolve_with(env(&[])).unwrap();
        assert_eq!((p.min_nnodes, p.nnodes), (3, 3));
        for bad in [Some(0), Some(4)] {
            let e = elastic(bad, 3)
                .resolve_with(env(&[]))
                .unwrap_err()
                .to_string();
            assert!(e.contains("the fewest nodes must be 1 to 3"), "{e}");
        }
    }

    #[test]
    fn far_more_workers_than_cores_needs_force() {
        let many = LaunchOptions {
            nproc_per_node: 100_000,
            ..opts()
        };
        let err = many.resolve_on(env(&[]), 2).unwrap_err().to_string();
        for want in [
            "100000 workers",
            "2 CPU cores",
            "more than 16 workers",
            "--force-nproc",
        ] {
            assert!(err.contains(want), "missing {want:?}: {err}");
        }
        let err = many.resolve_on(env(&[]), 1).unwrap_err().to_string();
        assert!(err.contains("1 CPU core,"), "{err}");
        let forced = LaunchOptions {
            force_nproc: true,
            ..many
        };
        assert_eq!(
            forced.resolve_on(env(&[]), 2).unwrap().nproc_per_node,
            100_000
        );
        // Up to 4 per core, and at least 16, need no force.
        for (cores, n) in [(64, 256), (2, 16), (1, 16)] {
            let o = LaunchOptions {
                nproc_per_node: n,
                ..opts()
            };
            assert!(o.resolve_on(env(&[]), cores).is_ok(), "{n} on {cores}");
            let o = LaunchOptions {
                nproc_per_node: n + 1,
                ..opts()
            };
            assert!(
                o.resolve_on(env(&[]), cores).is_err(),
                "{} on {cores}",
                n + 1
            );
        }
        assert_eq!(nproc_limit(usize::MAX), usize::MAX);
    }
}
