//! How the launchers of a multi-node job agree on the world, and later on
//! how it ended, through the store hosted by node 0.
//!
//! Keys, under the launcher's prefix, for attempt `k`:
//!
//! | key | written by | meaning |
//! |---|---|---|
//! | `run_id` | node 0 | the run id every node uses |
//! | `{k}/node/{r}` | node r | [`NodeInfo`]: host, pid, workers |
//! | `{k}/world` | node 0 | [`World`], or the reason rendezvous failed |
//! | `{k}/failure` | first failing node | [`Failure`]: the root cause |
//! | `{k}/done/{r}` | node r | all of node r's workers succeeded |
//! | `{k}/ack/{r}` | node r ≠ 0 | node r has seen the outcome; node 0 may exit |

use crate::config::LaunchPlan;
use crate::error::LaunchError;
use crate::signals::Signals;
use braid_store::{StoreClient, StoreError};
use serde::{Deserialize, Serialize};
use std::time::{Duration, Instant};

/// One node's entry at rendezvous.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct NodeInfo {
    /// The node's rank.
    pub node_rank: usize,
    /// The number of nodes this node was told about.
    pub nnodes: usize,
    /// Workers it will start.
    pub nproc: usize,
    /// Its host name.
    pub host: String,
    /// Its launcher's process id.
    pub pid: u32,
}

/// The agreed world of one attempt.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct World {
    /// Run id.
    pub run_id: String,
    /// Every node, by node rank.
    pub nodes: Vec<NodeInfo>,
    /// Port on the master address left free for the workers' own use.
    pub worker_master_port: u16,
    /// Set instead of the rest when rendezvous failed.
    pub error: Option<String>,
}

impl World {
    /// Total number of workers.
    pub fn world_size(&self) -> usize {
        self.nodes.iter().map(|n| n.nproc).sum()
    }

    /// Global rank of the first worker of the node at place `node` of
    /// [`nodes`](Self::nodes).
    pub fn rank_offset(&self, node: usize) -> usize {
        self.nodes[..node].iter().map(|n| n.nproc).sum()
    }

    /// Where node rank `node_rank` is in [`nodes`](Self::nodes): its rank
    /// in this attempt (an elastic attempt without some nodes numbers the
    /// others from 0 without gaps).
    pub fn place_of(&self, node_rank: usize) -> Option<usize> {
        self.nodes.iter().position(|n| n.node_rank == node_rank)
    }
}

/// The first worker failure of an attempt, as every node reports it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Failure {
    /// Node where it happened.
    pub node_rank: usize,
    /// That node's host name.
    pub host: String,
    /// Failing global rank (`None`: the launcher itself was interrupted).
    pub rank: Option<usize>,
    /// Its local rank.
    pub local_rank: Option<usize>,
    /// Its process id.
    pub pid: Option<u32>,
    /// "exit code 3", "signal SIGKILL", or what interrupted the launcher.
    pub how: String,
    /// Exit code the launchers should end with.
    pub exit_code: i32,
    /// Last lines of the failing worker's stderr.
    pub stderr_tail: Vec<String>,
    /// False when restarting cannot help (a launcher was interrupted, the
    /// program could not be started).
    pub restartable: bool,
}

/// Key names of attempt `k`.
pub struct Keys {
    k: u32,
}

impl Keys {
    /// Keys of attempt `attempt`.
    pub fn new(attempt: u32) -> Self {
        Keys { k: attempt }
    }
    /// Node `r`'s entry.
    pub fn node(&self, r: usize) -> String {
        format!("{}/node/{r}", self.k)
    }
    /// The agreed world.
    pub fn world(&self) -> String {
        format!("{}/world", self.k)
    }
    /// The root-cause failure.
    pub fn failure(&self) -> String {
        format!("{}/failure", self.k)
    }
    /// Node `r` finished successfully.
    pub fn done(&self, r: usize) -> String {
        format!("{}/done/{r}", self.k)
    }
    /// Node `r` has seen the outcome.
    pub fn ack(&self, r: usize) -> String {
        format!("{}/ack/{r}", self.k)
    }
    /// Node `r`'s heartbeat counter.
    pub fn heartbeat(&self, r: usize) -> String {
        format!("{}/hb/{r}", self.k)
    }
}

/// How long one blocking store call may last, so signals are noticed.
const SLICE: Duration = Duration::from_millis(250);

/// Agrees on the run id: node 0 publishes its own, the others adopt it.
pub fn agree_run_id(
    store: &StoreClient,
    plan: &LaunchPlan,
    signals: &Signals,
) -> Result<String, LaunchError> {
    if plan.node_rank == 0 {
        let outcome = store.compare_set("run_id", None, plan.run_id.as_bytes())?;
        let current = outcome.current.unwrap_or_default();
        return Ok(String::from_utf8_lossy(&current).into_owned());
    }
    let value = wait_for(
        store,
        "run_id",
        plan.rdzv_timeout,
        signals,
        "node 0 to publish the run id",
    )?;
    Ok(String::from_utf8_lossy(&value).into_owned())
}

/// Joins attempt `attempt`'s rendezvous and returns the agreed world.
pub fn join(
    store: &StoreClient,
    plan: &LaunchPlan,
    attempt: u32,
    run_id: &str,
    signals: &Signals,
) -> Result<World, LaunchError> {
    let keys = Keys::new(attempt);
    let me = NodeInfo {
        node_rank: plan.node_rank,
        nnodes: plan.nnodes,
        nproc: plan.nproc_per_node,
        host: hostname(),
        pid: std::process::id(),
    };
    let entry = serde_json::to_vec(&me).expect("NodeInfo serialises");
    let claimed = store.compare_set(&keys.node(plan.node_rank), None, &entry)?;
    if !claimed.swapped {
        let other: Option<NodeInfo> = claimed
            .current
            .and_then(|c| serde_json::from_slice(&c).ok());
        return Err(LaunchError::Rendezvous(match other {
            Some(o) => format!(
                "node rank {} is already taken by the launcher on {} (pid {}): give each node a distinct --node-rank",
                plan.node_rank, o.host, o.pid
            ),
            None => format!("node rank {} is already taken: give each node a distinct --node-rank", plan.node_rank),
        }));
    }
    if plan.node_rank != 0 {
        let raw = wait_for(
            store,
            &keys.world(),
            plan.rdzv_timeout,
            signals,
            "node 0 to announce the world",
        )?;
        let world: World = serde_json::from_slice(&raw).map_err(|e| {
            LaunchError::Rendezvous(format!("node 0 announced an unreadable world: {e}"))
        })?;
        if let Some(error) = world.error {
            let _ = store.set(&keys.ack(plan.node_rank), b"");
            return Err(LaunchError::Rendezvous(format!(
                "{error} (reported by node 0)"
            )));
        }
        if world.place_of(plan.node_rank).is_none() {
            return Err(LaunchError::Rendezvous(format!(
                "attempt {attempt} started without node rank {} (it joined after node 0's last call, --rdzv-last-call)",
                plan.node_rank
            )));
        }
        return Ok(world);
    }
    // Node 0 gathers everyone.
    let node_keys: Vec<String> = (0..plan.nnodes).map(|r| keys.node(r)).collect();
    let start = Instant::now();
    // Elastic: when the fewest allowed nodes were first all there.
    let mut enough_since: Option<Instant> = None;
    let present = loop {
        let refs: Vec<&str> = node_keys.iter().map(String::as_str).collect();
        let present = store.check(&refs)?;
        if present.iter().all(|p| *p) {
            break present;
        }
        if present.iter().filter(|p| **p).count() >= plan.min_nnodes {
            let since = *enough_since.get_or_insert_with(Instant::now);
            if since.elapsed() >= plan.rdzv_last_call {
                break present;
            }
        }
        if let Some(sig) = signals.received() {
            return Err(LaunchError::Rendezvous(format!(
                "interrupted by {} while waiting for the other nodes",
                crate::process::signal_name(sig)
            )));
        }
        if start.elapsed() >= plan.rdzv_timeout && enough_since.is_none() {
            let missing: Vec<usize> = (0..plan.nnodes).filter(|r| !present[*r]).collect();
            let joined: Vec<usize> = (0..plan.nnodes).filter(|r| present[*r]).collect();
            let error = format!(
                "node rank(s) {missing:?} did not join within {:.1?} (expected {} nodes; joined: {joined:?}); start `braid launch --node-rank N` on every node, or raise --rdzv-timeout",
                plan.rdzv_timeout, plan.nnodes
            );
            let world = World {
                run_id: run_id.into(),
                nodes: vec![],
                worker_master_port: 0,
                error: Some(error.clone()),
            };
            store.set(
                &keys.world(),
                serde_json::to_vec(&world).expect("World serialises"),
            )?;
            let waiting: Vec<usize> = joined.into_iter().filter(|r| *r != 0).collect();
            linger_for_acks(store, &keys, &waiting, Duration::from_secs(3));
            return Err(LaunchError::Rendezvous(error));
        }
        // Block on the first missing key for a slice, then re-check all.
        let first_missing = node_keys
            .iter()
            .zip(&present)
            .find(|(_, p)| !**p)
            .map(|(k, _)| k.clone());
        if let Some(k) = first_missing {
            match store.get_timeout(&k, SLICE) {
                Ok(_) | Err(StoreError::Timeout { .. }) => {}
                Err(e) => return Err(e.into()),
            }
        }
    };
    let mut nodes = Vec::with_capacity(plan.nnodes);
    let joined = node_keys.iter().zip(&present).filter(|(_, p)| **p);
    if present.iter().any(|p| !*p) {
        let missing: Vec<usize> = (0..plan.nnodes).filter(|r| !present[*r]).collect();
        eprintln!(
            "braid launch: attempt {attempt} starts with {} of {} nodes (node rank(s) {missing:?} did not join within --rdzv-last-call {:.1?}); the workers' world is smaller",
            plan.nnodes - missing.len(),
            plan.nnodes,
            plan.rdzv_last_call
        );
    }
    for (k, _) in joined {
        let raw = store.get(k)?;
        let info: NodeInfo = serde_json::from_slice(&raw)
            .map_err(|e| LaunchError::Rendezvous(format!("unreadable entry {k}: {e}")))?;
        nodes.push(info);
    }
    let disagreeing: Vec<String> = nodes
        .iter()
        .filter(|n| n.nnodes != plan.nnodes)
        .map(|n| {
            format!(
                "node {} on {} says --nnodes {}",
                n.node_rank, n.host, n.nnodes
            )
        })
        .collect();
    let error = if disagreeing.is_empty() {
        None
    } else {
        Some(format!(
            "the nodes disagree on the number of nodes (node 0 says {}): {}",
            plan.nnodes,
            disagreeing.join("; ")
        ))
    };
    let worker_master_port = crate::config::free_port(&plan.store_bind)
        .or_else(|_| crate::config::free_port(&plan.master_addr))?;
    let world = World {
        run_id: run_id.into(),
        nodes,
        worker_master_port,
        error: error.clone(),
    };
    store.set(
        &keys.world(),
        serde_json::to_vec(&world).expect("World serialises"),
    )?;
    if let Some(error) = error {
        let others: Vec<usize> = world.nodes.iter().skip(1).map(|n| n.node_rank).collect();
        linger_for_acks(store, &keys, &others, Duration::from_secs(3));
        return Err(LaunchError::Rendezvous(error));
    }
    Ok(world)
}

/// Waits for `key`, in slices so that a signal to the launcher is noticed.
fn wait_for(
    store: &StoreClient,
    key: &str,
    timeout: Duration,
    signals: &Signals,
    what: &str,
) -> Result<Vec<u8>, LaunchError> {
    let start = Instant::now();
    loop {
        if let Some(sig) = signals.received() {
            return Err(LaunchError::Rendezvous(format!(
                "interrupted by {} while waiting for {what}",
                crate::process::signal_name(sig)
            )));
        }
        let left = timeout.saturating_sub(start.elapsed());
        if left.is_zero() {
            return Err(LaunchError::Rendezvous(format!(
                "timed out after {timeout:.1?} waiting for {what} (node 0 is missing or stuck: is its launcher running?)"
            )));
        }
        match store.get_timeout(key, left.min(SLICE)) {
            Ok(v) => return Ok(v),
            Err(StoreError::Timeout { .. }) => continue,
            Err(StoreError::Disconnected { .. }) => {
                return Err(LaunchError::Rendezvous(format!(
                    "lost node 0's store while waiting for {what}: node 0's launcher exited or is unreachable"
                )))
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// Node 0 keeps the store up until `nodes` have acknowledged the outcome,
/// or `timeout` passes.
pub fn linger_for_acks(store: &StoreClient, keys: &Keys, nodes: &[usize], timeout: Duration) {
    if nodes.is_empty() {
        return;
    }
    let acks: Vec<String> = nodes.iter().map(|r| keys.ack(*r)).collect();
    let refs: Vec<&str> = acks.iter().map(String::as_str).collect();
    let _ = store.wait(&refs, timeout);
}

/// This machine's host name.
pub fn hostname() -> String {
    nix::unistd::gethostname()
        .map(|h| h.to_string_lossy().into_owned())
        .unwrap_or_else(|_| "unknown-host".into())
}
