//! The launcher behind `braid launch`: torchrun's job, done by braid.
//!
//! On each node a launcher starts `--nproc-per-node` workers with the
//! torchrun-compatible environment, forwards their output with a
//! `[rank N]` prefix, and watches them. Node 0's launcher hosts the
//! rendezvous store; the launchers of all nodes agree on the world through
//! it ([`rendezvous`]), and tell each other about failures, completion and
//! restarts. When a worker fails, every worker of every node is stopped
//! (SIGTERM, then SIGKILL after a grace period), a root-cause report is
//! printed, and the group is restarted if `--max-restarts` allows. Workers
//! that use braid's communicators keep flight records of their last
//! collectives; after a failure the launcher prints what they say: which
//! rank is behind or stopped, and where ([`flight`]).
//!
//! - [`config`]: options → [`LaunchPlan`] (flags, SLURM, defaults).
//! - [`rendezvous`]: the store protocol between launchers.
//! - [`supervisor`]: one attempt: spawn, watch, stop.
//! - [`process`]: worker processes, process groups, orphan sweeping.
//! - [`output`]: prefixed output, per-rank logs, stderr tails.
//! - [`signals`], [`summary`]: Ctrl-C handling; the failure report.
//! - [`flight`]: the workers' log directory, their flight records and
//!   heartbeats after a failure, and the diagnosis.

pub mod config;
pub mod error;
pub mod flight;
pub mod output;
pub mod process;
pub mod rendezvous;
pub mod signals;
pub mod summary;
pub mod supervisor;

pub use config::{LaunchOptions, LaunchPlan, PythonMode};
pub use error::LaunchError;
pub use signals::Signals;

use braid_store::{ClientOptions, ServerOptions, StoreClient, StoreError, StoreServer};
use rendezvous::Keys;
use std::time::Duration;
use supervisor::AttemptOutcome;

/// Runs a whole launch on this node and returns the exit code the launcher
/// should end with (0 when every worker of every node succeeded).
pub fn launch(plan: &LaunchPlan, signals: &Signals) -> Result<i32, LaunchError> {
    process::become_subreaper();
    let mut plan = plan.clone();
    let _server = if plan.node_rank == 0 {
        let bind = braid_store::worker::join_host_port(&plan.store_bind, plan.master_port);
        let server = StoreServer::bind(bind.as_str(), ServerOptions::from_env()).map_err(|e| {
            e.advise_port_in_use(
                "choose another --master-port, or --standalone to pick a free one \
                 (one node)",
            )
        })?;
        plan.master_port = server.local_addr().port();
        Some(server)
    } else {
        None
    };
    let plan = &plan;
    let options = ClientOptions {
        connect_timeout: plan.rdzv_timeout,
        timeout: Duration::from_secs(30),
        ..ClientOptions::from_env()?
    };
    let client = StoreClient::connect(&plan.store_addr(), options).map_err(|e| match e {
        StoreError::Connect { addr, waited, last_error } if plan.node_rank != 0 => LaunchError::Rendezvous(format!(
            "node 0 did not arrive: its rendezvous store at {addr} was unreachable for {waited:.1?} ({last_error}); start `braid launch --node-rank 0` on the master host, check --master-addr/--master-port, or raise --rdzv-timeout"
        )),
        other => other.into(),
    })?;
    let store = client.with_prefix("launch/");
    let run_id = rendezvous::agree_run_id(&store, plan, signals)?;
    let joining = plan;
    for attempt in 0..=joining.max_restarts {
        let world = rendezvous::join(&store, joining, attempt, &run_id, signals)?;
        // The attempt's own numbering of the nodes that joined (all of
        // them, unless an elastic attempt started without some).
        let plan = &LaunchPlan {
            nnodes: world.nodes.len(),
            node_rank: world.place_of(joining.node_rank).ok_or_else(|| {
                LaunchError::Rendezvous(format!(
                    "node rank {} is not in attempt {attempt}'s world",
                    joining.node_rank
                ))
            })?,
            ..joining.clone()
        };
        if attempt == 0 || plan.nnodes != joining.nnodes {
            let first = world.rank_offset(plan.node_rank);
            // Made now, so that the directory announced exists whatever
            // the workers write (`braid doctor` reads it even empty).
            let dir = flight::log_dir(plan, &world.run_id);
            std::fs::create_dir_all(&dir).map_err(|source| LaunchError::Io {
                what: format!("cannot create the log directory {}", dir.display()),
                source,
            })?;
            eprintln!(
                "braid launch: run {run_id}: node {}/{} starts ranks {first}..{} of {} ({}); store at {}; {} to {}",
                plan.node_rank,
                plan.nnodes,
                first + plan.nproc_per_node - 1,
                world.world_size(),
                plan.source,
                plan.store_addr(),
                match plan.output.any_file() {
                    true => "logs (rank<N>.log) and flight records",
                    false => "flight records",
                },
                flight::log_dir(plan, &world.run_id).display()
            );
        }
        let workers_store = client.with_prefix(&supervisor::worker_prefix(attempt));
        let outcome =
            supervisor::run_attempt(plan, &world, attempt, &store, &workers_store, signals)?;
        let keys = Keys::new(attempt);
        let others: Vec<usize> = (1..plan.nnodes).collect();
        match outcome {
            AttemptOutcome::Success => {
                acknowledge(&store, plan, &keys, &others, Duration::from_secs(10));
                // The run's own log directory, left empty by a run that
                // went well, goes (a directory that holds anything stays).
                if plan.log_dir.is_none() && braid_core::flight::log_dir_from_env().is_none() {
                    let _ = std::fs::remove_dir(flight::log_dir(plan, &world.run_id));
                }
                return Ok(0);
            }
            AttemptOutcome::Failed(failure, diagnosis) => {
                acknowledge(
                    &store,
                    plan,
                    &keys,
                    &others,
                    plan.grace_period + Duration::from_secs(5),
                );
                let restarting = failure.restartable && attempt < plan.max_restarts;
                eprint!(
                    "{}",
                    summary::failure_report(&failure, attempt, plan.max_restarts, restarting)
                );
                if let Some(d) = diagnosis {
                    eprint!("{d}");
                }
                if !restarting {
                    return Ok(failure.exit_code.max(1));
                }
            }
        }
    }
    unreachable!("the last attempt always returns")
}

/// Nodes other than 0 say they have seen the outcome; node 0 keeps the
/// store up until they have (bounded by `timeout`).
fn acknowledge(
    store: &StoreClient,
    plan: &LaunchPlan,
    keys: &Keys,
    others: &[usize],
    timeout: Duration,
) {
    if plan.nnodes == 1 {
        return;
    }
    if plan.node_rank == 0 {
        rendezvous::linger_for_acks(store, keys, others, timeout);
    } else {
        let _ = store.set(&keys.ack(plan.node_rank), b"");
    }
}
