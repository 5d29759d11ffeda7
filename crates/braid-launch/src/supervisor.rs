//! One attempt of the worker group on this node: start the workers, watch
//! them (and, on multi-node jobs, the other nodes through the store), and
//! stop them all at the first failure. Watching starts with the first
//! worker: between two spawns, exited children are reaped and a signal or
//! failure ends the attempt, so a long spawn phase neither piles up zombies
//! nor delays Ctrl-C. Before the workers are stopped the launcher notes how
//! each is doing, asks for their flight records and waits (bounded) for
//! those being written; after, it diagnoses the attempt from them
//! ([`crate::flight`]).

use crate::config::LaunchPlan;
use crate::error::LaunchError;
use crate::flight;
use crate::process::{self, Worker, WorkerSpec};
use crate::rendezvous::{hostname, Failure, Keys, World};
use crate::signals::Signals;
use braid_core::env;
use braid_store::StoreClient;
use nix::sys::signal::Signal;
use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::process::ExitStatus;
use std::time::{Duration, Instant};

/// How an attempt ended on this node.
#[derive(Debug)]
pub enum AttemptOutcome {
    /// Every worker of every node exited with status 0.
    Success,
    /// The job failed; this is the root cause (possibly on another node),
    /// and what the workers' flight records say (when they kept any).
    Failed(Failure, Option<String>),
}

/// The store prefix of attempt `attempt`'s workers
/// (`BRAID_STORE_PREFIX`).
pub fn worker_prefix(attempt: u32) -> String {
    format!("run/{attempt}/")
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
        (env::GROUP_WORLD_SIZE, plan.nnodes.to_string()),
        (env::ROLE_RANK, rank.to_string()),
        (env::ROLE_WORLD_SIZE, world.world_size().to_string()),
        (env::ROLE_NAME, plan.role.clone()),
        (env::MASTER_ADDR, plan.master_addr.clone()),
        (env::MASTER_PORT, world.worker_master_port.to_string()),
        (env::BRAID_RUN_ID, world.run_id.clone()),
        (env::BRAID_RESTART_COUNT, attempt.to_string()),
        (env::BRAID_MAX_RESTARTS, plan.max_restarts.to_string()),
        (env::BRAID_STORE_ADDR, plan.store_addr()),
        (env::BRAID_STORE_PREFIX, worker_prefix(attempt)),
        (
            env::BRAID_LOG_DIR,
            flight::log_dir(plan, &world.run_id)
                .to_string_lossy()
                .into_owned(),
        ),
        (env::TORCHELASTIC_RUN_ID, world.run_id.clone()),
        (env::TORCHELASTIC_RESTART_COUNT, attempt.to_string()),
        (
            env::TORCHELASTIC_MAX_RESTARTS,
            plan.max_restarts.to_string(),
        ),
    ];
    // Like torchrun: several workers per node each get one thread by
    // default instead of all of them claiming every core.
    if plan.nproc_per_node > 1 && std::env::var_os(env::OMP_NUM_THREADS).is_none() {
        vars.push((env::OMP_NUM_THREADS, "1".to_string()));
    }
    vars.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
}

/// Runs attempt `attempt` on this node to its end; `workers_store` is
/// the store seen through the attempt's [`worker_prefix`] (the workers'
/// heartbeats).
///
/// Between two spawns, and every `POLL` once all are started, the attempt
/// is checked (`Attempt::check`): exited children are reaped, and a signal
/// to the launcher, a failed worker or news from other nodes ends the
/// attempt at once, spawning included.
pub fn run_attempt(
    plan: &LaunchPlan,
    world: &World,
    attempt: u32,
    store: &StoreClient,
    workers_store: &StoreClient,
    signals: &Signals,
) -> Result<AttemptOutcome, LaunchError> {
    let mut a = Attempt::new(plan, world, attempt, store, workers_store, signals);
    let with_diagnosis = |a: &mut Attempt, outcome| match outcome {
        AttemptOutcome::Failed(f, _) => AttemptOutcome::Failed(f, a.diagnosis.take()),
        success => success,
    };
    for local_rank in 0..plan.nproc_per_node {
        if let Some(outcome) = a.check()? {
            return Ok(with_diagnosis(&mut a, outcome));
        }
        a.spawn(local_rank)?;
    }
    loop {
        if let Some(outcome) = a.check()? {
            return Ok(with_diagnosis(&mut a, outcome));
        }
        std::thread::sleep(POLL);
    }
}

/// One attempt in progress on this node.
struct Attempt<'a> {
    plan: &'a LaunchPlan,
    world: &'a World,
    attempt: u32,
    store: &'a StoreClient,
    workers_store: &'a StoreClient,
    signals: &'a Signals,
    keys: Keys,
    /// The workers' log directory (flight records).
    log_dir: PathBuf,
    /// What the flight records said when the attempt failed.
    diagnosis: Option<String>,
    multi_node: bool,
    host: String,
    /// Workers started so far, in local-rank order.
    workers: Vec<Worker>,
    /// Index in `workers` of each worker whose exit is not yet collected.
    running: HashMap<u32, usize>,
    /// Workers that exited with status 0.
    succeeded: usize,
    done_published: bool,
    last_store_poll: Instant,
    last_heartbeat: Option<Instant>,
    heartbeats: HashMap<usize, (i64, Instant)>,
}

impl<'a> Attempt<'a> {
    fn new(
        plan: &'a LaunchPlan,
        world: &'a World,
        attempt: u32,
        store: &'a StoreClient,
        workers_store: &'a StoreClient,
        signals: &'a Signals,
    ) -> Attempt<'a> {
        Attempt {
            plan,
            world,
            attempt,
            store,
            workers_store,
            signals,
            keys: Keys::new(attempt),
            log_dir: flight::log_dir(plan, &world.run_id),
            diagnosis: None,
            multi_node: plan.nnodes > 1,
            host: hostname(),
            workers: Vec::with_capacity(plan.nproc_per_node),
            running: HashMap::with_capacity(plan.nproc_per_node),
            succeeded: 0,
            done_published: false,
            last_store_poll: Instant::now(),
            last_heartbeat: None,
            heartbeats: HashMap::new(),
        }
    }

    /// Starts local worker `local_rank`; if it cannot be started, the
    /// workers already started are stopped and the error returned.
    fn spawn(&mut self, local_rank: usize) -> Result<(), LaunchError> {
        let (plan, world) = (self.plan, self.world);
        let spec = WorkerSpec {
            rank: world.rank_offset(plan.node_rank) + local_rank,
            local_rank,
            command: plan.command.clone(),
            env: worker_env(plan, world, self.attempt, local_rank),
            prefix_stdout: plan.prefix_stdout,
            routes: plan.output.routes(local_rank),
        };
        match Worker::spawn(&spec, Some(&self.log_dir), self.attempt) {
            Ok(w) => {
                self.running.insert(w.pid(), self.workers.len());
                self.workers.push(w);
                Ok(())
            }
            Err(e) => {
                let failure = Failure {
                    node_rank: plan.node_rank,
                    host: self.host.clone(),
                    rank: Some(spec.rank),
                    local_rank: Some(local_rank),
                    pid: None,
                    how: e.to_string(),
                    exit_code: 127,
                    stderr_tail: vec![],
                    restartable: false,
                };
                let _ = publish_failure(self.store, &self.keys, self.multi_node, failure);
                self.stop(Signal::SIGTERM);
                Err(e)
            }
        }
    }

    /// Stops every worker started so far: first notes how each is doing,
    /// asks the running ones for their flight records and waits for them
    /// (bounded: [`flight::wait_for_dumps`]), and afterwards diagnoses the
    /// attempt from the records and heartbeats.
    fn stop(&mut self, first: Signal) {
        let observed = flight::observe(&mut self.workers);
        let asked = flight::request_dumps(&self.workers, &observed, &self.log_dir, self.attempt);
        let unfinished = flight::wait_for_dumps(&asked, self.signals);
        stop_workers(
            &mut self.workers,
            first,
            self.plan.grace_period,
            self.signals,
        );
        flight::remove_cut_dumps(&self.workers, &asked, &self.log_dir, self.attempt);
        self.diagnosis = flight::report(&flight::Attempt {
            dir: &self.log_dir,
            run_id: &self.world.run_id,
            attempt: self.attempt,
            world_size: self.world.world_size(),
            observed: &observed,
            store: self.workers_store,
            unfinished: &unfinished,
        });
    }

    /// Reaps what has exited and looks for a reason to end the attempt:
    /// a signal to the launcher, a failed worker, success (once every
    /// worker has been started and exited with 0), or another node's news.
    /// Cheap enough to run between two spawns: no work per running worker.
    fn check(&mut self) -> Result<Option<AttemptOutcome>, LaunchError> {
        let plan = self.plan;
        if let Some(sig) = self.signals.received() {
            let failure = Failure {
                node_rank: plan.node_rank,
                host: self.host.clone(),
                rank: None,
                local_rank: None,
                pid: Some(std::process::id()),
                how: format!(
                    "the launcher on node {} ({}) received {}",
                    plan.node_rank,
                    self.host,
                    process::signal_name(sig)
                ),
                exit_code: 128 + sig,
                stderr_tail: vec![],
                restartable: false,
            };
            let root = publish_failure(self.store, &self.keys, self.multi_node, failure);
            self.stop(Signal::try_from(sig).unwrap_or(Signal::SIGTERM));
            return Ok(Some(AttemptOutcome::Failed(root, None)));
        }

        if let Some((i, status)) = self.reap() {
            let w = &mut self.workers[i];
            // Let its last words reach the log before quoting them.
            w.finish_output(Instant::now() + Duration::from_millis(300));
            let failure = Failure {
                node_rank: plan.node_rank,
                host: self.host.clone(),
                rank: Some(w.rank),
                local_rank: Some(w.local_rank),
                pid: Some(w.pid()),
                how: process::describe_status(status),
                exit_code: process::exit_code_of(status),
                stderr_tail: w.tail.lines(),
                restartable: true,
            };
            let root = publish_failure(self.store, &self.keys, self.multi_node, failure);
            self.stop(Signal::SIGTERM);
            return Ok(Some(AttemptOutcome::Failed(root, None)));
        }

        if self.succeeded == plan.nproc_per_node && !self.done_published {
            clean_up_after_success(&mut self.workers);
            if !self.multi_node {
                return Ok(Some(AttemptOutcome::Success));
            }
            self.store.set(&self.keys.done(plan.node_rank), b"")?;
            self.done_published = true;
        }

        if self.multi_node && self.last_store_poll.elapsed() >= STORE_POLL {
            self.last_store_poll = Instant::now();
            if let Some(root) = self.news_from_other_nodes() {
                self.stop(Signal::SIGTERM);
                return Ok(Some(AttemptOutcome::Failed(root, None)));
            }
            let mut watched = vec![self.keys.failure()];
            watched.extend((0..plan.nnodes).map(|r| self.keys.done(r)));
            let refs: Vec<&str> = watched.iter().map(String::as_str).collect();
            match self.store.check(&refs) {
                Ok(present) if present[0] => {
                    let root = read_failure(self.store, &self.keys).unwrap_or_else(|| {
                        lost_store(plan, &self.host, "unreadable failure record")
                    });
                    self.stop(Signal::SIGTERM);
                    return Ok(Some(AttemptOutcome::Failed(root, None)));
                }
                Ok(present) if present[1..].iter().all(|p| *p) => {
                    return Ok(Some(AttemptOutcome::Success))
                }
                Ok(_) => {}
                Err(e) => {
                    let root = lost_store(plan, &self.host, e);
                    self.stop(Signal::SIGTERM);
                    return Ok(Some(AttemptOutcome::Failed(root, None)));
                }
            }
        }
        Ok(None)
    }

    /// Beats this node's heartbeat and, on node 0, looks for silent nodes
    /// (at most every [`HEARTBEAT_EVERY`]); returns a failure to act on.
    fn news_from_other_nodes(&mut self) -> Option<Failure> {
        if self
            .last_heartbeat
            .is_some_and(|t| t.elapsed() < HEARTBEAT_EVERY)
        {
            return None;
        }
        self.last_heartbeat = Some(Instant::now());
        if let Err(e) = self.store.add(&self.keys.heartbeat(self.plan.node_rank), 1) {
            return Some(lost_store(self.plan, &self.host, e));
        }
        let dead = silent_node(self.store, &self.keys, self.plan, &mut self.heartbeats)?;
        Some(publish_failure(self.store, &self.keys, true, dead))
    }

    /// Collects every child of the launcher that has exited, so that none
    /// stays a zombie: a worker's status is recorded, an adopted orphan is
    /// simply reaped. Asks the kernel which children exited rather than
    /// polling each worker, so the cost does not grow with the worker
    /// count. Returns the first worker found to have failed.
    fn reap(&mut self) -> Option<(usize, ExitStatus)> {
        let mut failed = None;
        let mut seen = HashSet::new();
        while let Some(pid) = process::exited_child() {
            if !seen.insert(pid) {
                break; // Not collected below; never spin on it.
            }
            let Some(i) = self.running.remove(&pid) else {
                process::reap(pid);
                continue;
            };
            match self.workers[i].poll() {
                Some(status) if status.success() => self.succeeded += 1,
                Some(status) => {
                    failed = failed.or(Some((i, status)));
                }
                None => {
                    self.running.insert(pid, i);
                }
            }
        }
        failed
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
