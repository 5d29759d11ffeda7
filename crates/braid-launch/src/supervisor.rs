//! One attempt of the worker group on this node: start the workers, watch
//! them (and, on multi-node jobs, the other nodes through the store), and
//! stop them all at the first failure.

use crate::config::LaunchPlan;
use crate::error::LaunchError;
use crate::process::{self, Worker, WorkerSpec};
use crate::rendezvous::{hostname, Failure, Keys, World};
use crate::signals::Signals;
use braid_core::env;
use braid_store::StoreClient;
use nix::sys::signal::Signal;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// How an attempt ended on this node.
#[derive(Debug)]
pub enum AttemptOutcome {
    /// Every worker of every node exited with status 0.
    Success,
    /// The job failed; this is the root cause (possibly on another node).
    Failed(Failure),
}

/// How often local workers are polled.
const POLL: Duration = Duration::from_millis(10);
/// How often the store is polled for other nodes' news.
const STORE_POLL: Duration = Duration::from_millis(100);
/// How often this node proves it is alive.
const HEARTBEAT_EVERY: Duration = Duration::from_secs(1);
/// A node silent this long is declared dead.
const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(15);

/// The environment of local worker `local_rank`.
pub fn worker_env(
    plan: &LaunchPlan,
    world: &World,
    attempt: u32,
    local_rank: usize,
) -> Vec<(String, String)> {
    let rank = world.rank_offset(plan.node_rank) + local_rank;
    let mut vars = vec![
        (env::RANK, rank.to_string()),
        (env::LOCAL_RANK, local_rank.to_string()),
        (env::WORLD_SIZE, world.world_size().to_string()),
        (env::LOCAL_WORLD_SIZE, plan.nproc_per_node.to_string()),
        (env::GROUP_RANK, plan.node_rank.to_string()),
        ("GROUP_WORLD_SIZE", plan.nnodes.to_string()),
        ("ROLE_RANK", rank.to_string()),
        ("ROLE_WORLD_SIZE", world.world_size().to_string()),
        ("ROLE_NAME", "default".to_string()),
        (env::MASTER_ADDR, plan.master_addr.clone()),
        (env::MASTER_PORT, world.worker_master_port.to_string()),
        (env::BRAID_RUN_ID, world.run_id.clone()),
        (env::BRAID_RESTART_COUNT, attempt.to_string()),
        (env::BRAID_MAX_RESTARTS, plan.max_restarts.to_string()),
        (env::BRAID_STORE_ADDR, plan.store_addr()),
        (env::BRAID_STORE_PREFIX, format!("run/{attempt}/")),
        ("TORCHELASTIC_RUN_ID", world.run_id.clone()),
        ("TORCHELASTIC_RESTART_COUNT", attempt.to_string()),
        ("TORCHELASTIC_MAX_RESTARTS", plan.max_restarts.to_string()),
    ];
    // Like torchrun: several workers per node each get one thread by
    // default instead of all of them claiming every core.
    if plan.nproc_per_node > 1 && std::env::var_os("OMP_NUM_THREADS").is_none() {
        vars.push(("OMP_NUM_THREADS", "1".to_string()));
    }
    vars.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
}

/// Runs attempt `attempt` on this node to its end.
pub fn run_attempt(
    plan: &LaunchPlan,
    world: &World,
    attempt: u32,
    store: &StoreClient,
    signals: &Signals,
) -> Result<AttemptOutcome, LaunchError> {
    let keys = Keys::new(attempt);
    let multi_node = plan.nnodes > 1;
    let host = hostname();
    let mut workers: Vec<Worker> = Vec::with_capacity(plan.nproc_per_node);
    for local_rank in 0..plan.nproc_per_node {
        let spec = WorkerSpec {
            rank: world.rank_offset(plan.node_rank) + local_rank,
            local_rank,
            command: plan.command.clone(),
            env: worker_env(plan, world, attempt, local_rank),
        };
        match Worker::spawn(&spec, plan.log_dir.as_deref(), attempt) {
            Ok(w) => workers.push(w),
            Err(e) => {
                let failure = Failure {
                    node_rank: plan.node_rank,
                    host: host.clone(),
                    rank: Some(spec.rank),
                    local_rank: Some(local_rank),
                    pid: None,
                    how: e.to_string(),
                    exit_code: 127,
                    stderr_tail: vec![],
                    restartable: false,
                };
                let _ = publish_failure(store, &keys, multi_node, failure);
                stop_workers(&mut workers, Signal::SIGTERM, plan.grace_period, signals);
                return Err(e);
            }
        }
    }
    let mut done_published = false;
    let mut last_store_poll = Instant::now();
    let mut last_heartbeat: Option<Instant> = None;
    let mut heartbeats: HashMap<usize, (i64, Instant)> = HashMap::new();
    loop {
        if let Some(sig) = signals.received() {
            let failure = Failure {
                node_rank: plan.node_rank,
                host: host.clone(),
                rank: None,
                local_rank: None,
                pid: Some(std::process::id()),
                how: format!(
                    "the launcher on node {} ({host}) received {}",
                    plan.node_rank,
                    process::signal_name(sig)
                ),
                exit_code: 128 + sig,
                stderr_tail: vec![],
                restartable: false,
            };
            let root = publish_failure(store, &keys, multi_node, failure);
            let forward = Signal::try_from(sig).unwrap_or(Signal::SIGTERM);
            stop_workers(&mut workers, forward, plan.grace_period, signals);
            return Ok(AttemptOutcome::Failed(root));
        }

        let mut local_failure = None;
        for w in workers.iter_mut() {
            if let Some(status) = w.poll() {
                if !status.success() && local_failure.is_none() {
                    local_failure = Some((w.rank, status));
                }
            }
        }
        if let Some((rank, status)) = local_failure {
            let w = workers
                .iter_mut()
                .find(|w| w.rank == rank)
                .expect("failing worker is ours");
            // Let its last words reach the log before quoting them.
            w.finish_output(Instant::now() + Duration::from_millis(300));
            let failure = Failure {
                node_rank: plan.node_rank,
                host: host.clone(),
                rank: Some(w.rank),
                local_rank: Some(w.local_rank),
                pid: Some(w.pid()),
                how: process::describe_status(status),
                exit_code: process::exit_code_of(status),
                stderr_tail: w.tail.lines(),
                restartable: true,
            };
            let root = publish_failure(store, &keys, multi_node, failure);
            stop_workers(&mut workers, Signal::SIGTERM, plan.grace_period, signals);
            return Ok(AttemptOutcome::Failed(root));
        }

        let all_succeeded = workers
            .iter()
            .all(|w| w.status.is_some_and(|s| s.success()));
        if all_succeeded && !done_published {
            clean_up_after_success(&mut workers);
            if !multi_node {
                return Ok(AttemptOutcome::Success);
            }
            store.set(&keys.done(plan.node_rank), b"")?;
            done_published = true;
        }

        if multi_node && last_store_poll.elapsed() >= STORE_POLL {
            last_store_poll = Instant::now();
            if last_heartbeat.is_none_or(|t| t.elapsed() >= HEARTBEAT_EVERY) {
                last_heartbeat = Some(Instant::now());
                if let Err(e) = store.add(&keys.heartbeat(plan.node_rank), 1) {
                    let root = lost_store(plan, &host, e);
                    stop_workers(&mut workers, Signal::SIGTERM, plan.grace_period, signals);
                    return Ok(AttemptOutcome::Failed(root));
                }
                if let Some(dead) = silent_node(store, &keys, plan, &mut heartbeats) {
                    let root = publish_failure(store, &keys, true, dead);
                    stop_workers(&mut workers, Signal::SIGTERM, plan.grace_period, signals);
                    return Ok(AttemptOutcome::Failed(root));
                }
            }
            let mut watched = vec![keys.failure()];
            watched.extend((0..plan.nnodes).map(|r| keys.done(r)));
            let refs: Vec<&str> = watched.iter().map(String::as_str).collect();
            match store.check(&refs) {
                Ok(present) if present[0] => {
                    let root = read_failure(store, &keys)
                        .unwrap_or_else(|| lost_store(plan, &host, "unreadable failure record"));
                    stop_workers(&mut workers, Signal::SIGTERM, plan.grace_period, signals);
                    return Ok(AttemptOutcome::Failed(root));
                }
                Ok(present) if present[1..].iter().all(|p| *p) => {
                    return Ok(AttemptOutcome::Success)
                }
                Ok(_) => {}
                Err(e) => {
                    let root = lost_store(plan, &host, e);
                    stop_workers(&mut workers, Signal::SIGTERM, plan.grace_period, signals);
                    return Ok(AttemptOutcome::Failed(root));
                }
            }
        }
        std::thread::sleep(POLL);
    }
}

/// Records `failure` as the attempt's root cause unless another node got
/// there first; returns whichever is the root cause.
fn publish_failure(
    store: &StoreClient,
    keys: &Keys,
    multi_node: bool,
    failure: Failure,
) -> Failure {
    if !multi_node {
        return failure;
    }
    let json = serde_json::to_vec(&failure).expect("Failure serialises");
    match store.compare_set(&keys.failure(), None, &json) {
        Ok(o) if !o.swapped => o
            .current
            .and_then(|c| serde_json::from_slice(&c).ok())
            .unwrap_or(failure),
        _ => failure,
    }
}

fn read_failure(store: &StoreClient, keys: &Keys) -> Option<Failure> {
    let raw = store.try_get(&keys.failure()).ok()??;
    serde_json::from_slice(&raw).ok()
}

fn lost_store(plan: &LaunchPlan, host: &str, why: impl std::fmt::Display) -> Failure {
    Failure {
        node_rank: plan.node_rank,
        host: host.to_string(),
        rank: None,
        local_rank: None,
        pid: None,
        how: format!("node {} lost contact with the rendezvous store on node 0 ({why}); node 0's launcher exited or is unreachable", plan.node_rank),
        exit_code: 1,
        stderr_tail: vec![],
        restartable: false,
    }
}

/// Node 0 watches every node's heartbeat counter; a counter that has not
/// moved for [`HEARTBEAT_TIMEOUT`] means that node's launcher is gone.
fn silent_node(
    store: &StoreClient,
    keys: &Keys,
    plan: &LaunchPlan,
    seen: &mut HashMap<usize, (i64, Instant)>,
) -> Option<Failure> {
    if plan.node_rank != 0 {
        return None;
    }
    for r in 1..plan.nnodes {
        // A node that has finished its workers may stop beating.
        if store.check(&[&keys.done(r)]).ok()?.first() == Some(&true) {
            continue;
        }
        let value = store
            .try_get(&keys.heartbeat(r))
            .ok()?
            .and_then(|v| String::from_utf8_lossy(&v).parse::<i64>().ok())
            .unwrap_or(0);
        let entry = seen.entry(r).or_insert((value, Instant::now()));
        if entry.0 != value {
            *entry = (value, Instant::now());
        } else if entry.1.elapsed() >= HEARTBEAT_TIMEOUT {
            return Some(Failure {
                node_rank: r,
                host: "?".into(),
                rank: None,
                local_rank: None,
                pid: None,
                how: format!("the launcher of node {r} stopped responding (no heartbeat for {HEARTBEAT_TIMEOUT:?})"),
                exit_code: 1,
                stderr_tail: vec![],
                restartable: true,
            });
        }
    }
    None
}

/// Kills what successful workers left behind in their process groups.
fn clean_up_after_success(workers: &mut [Worker]) {
    for w in workers.iter() {
        w.signal_group(Signal::SIGKILL);
    }
    process::sweep_orphans(&[]);
    let deadline = Instant::now() + Duration::from_secs(2);
    for w in workers.iter_mut() {
        w.finish_output(deadline);
    }
}

/// Stops every worker: `first` to each process group, then SIGKILL after the
/// grace period (or at once on a second signal to the launcher); reaps them
/// and any orphans, and drains their output.
pub fn stop_workers(workers: &mut [Worker], first: Signal, grace: Duration, signals: &Signals) {
    let signals_before = signals.count();
    for w in workers.iter_mut() {
        if w.poll().is_none() {
            w.signal_group(first);
        }
    }
    let deadline = Instant::now() + grace;
    while workers.iter_mut().any(|w| w.poll().is_none())
        && Instant::now() < deadline
        && signals.count() <= signals_before
    {
        std::thread::sleep(POLL);
    }
    // Everything left in any group, leaders or not, is killed now.
    for w in workers.iter() {
        w.signal_group(Signal::SIGKILL);
    }
    let reap_deadline = Instant::now() + Duration::from_secs(5);
    while workers.iter_mut().any(|w| w.poll().is_none()) && Instant::now() < reap_deadline {
        std::thread::sleep(POLL);
    }
    process::sweep_orphans(&[]);
    let drain_deadline = Instant::now() + Duration::from_secs(2);
    for w in workers.iter_mut() {
        w.finish_output(drain_deadline);
    }
}
