//! [`WorldInfo`]: who this worker is, read from the launcher's environment.

use crate::{env, slurm};
use std::time::Duration;

/// Why the worker environment could not be read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum WorldInfoError {
    /// A required variable is not set.
    #[error("environment variable {name} is not set: start workers with `braid launch` (or torchrun/srun), or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT yourself")]
    Missing {
        /// Name of the variable.
        name: &'static str,
    },
    /// A variable is set but its value cannot be used.
    #[error("environment variable {name}={value:?} is invalid: {why}")]
    Invalid {
        /// Name of the variable.
        name: &'static str,
        /// The value found.
        value: String,
        /// What is wrong with it.
        why: String,
    },
}

/// The identity of one worker in a distributed job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorldInfo {
    /// Global rank, `0..world_size`.
    pub rank: usize,
    /// Number of workers in the job.
    pub world_size: usize,
    /// Rank among the workers of this node.
    pub local_rank: usize,
    /// Number of workers on this node.
    pub local_world_size: usize,
    /// Rank of this worker's node.
    pub node_rank: usize,
    /// Host of the job's rendezvous.
    pub master_addr: String,
    /// Port on `master_addr` free for the workers' own rendezvous.
    pub master_port: u16,
    /// Run identifier when started by `braid launch`.
    pub run_id: Option<String>,
    /// Restart attempt number (0 on the first attempt).
    pub restart_count: u32,
    /// Maximum restarts the launcher allows.
    pub max_restarts: u32,
    /// Address of a running braid store (set by `braid launch`).
    pub store_addr: Option<String>,
    /// Key prefix this attempt's workers share in the store.
    pub store_prefix: String,
    /// Started by torchrun, whose own store already listens on
    /// `MASTER_PORT` (`TORCHELASTIC_USE_AGENT_STORE=True`).
    pub torchrun_agent_store: bool,
}

impl WorldInfo {
    /// The port where rank 0 hosts braid's store when no launcher provides
    /// one: `MASTER_PORT`, or the port after it under torchrun (whose own
    /// store occupies `MASTER_PORT`).
    pub fn braid_store_port(&self) -> u16 {
        if self.torchrun_agent_store {
            self.master_port.wrapping_add(1).max(1)
        } else {
            self.master_port
        }
    }
}

impl WorldInfo {
    /// Reads the worker identity from the process environment.
    pub fn from_env() -> Result<Self, WorldInfoError> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// Reads the worker identity through `lookup` (a stand-in for the
    /// environment, so callers and tests need not mutate the real one).
    ///
    /// torchrun/`braid launch` variables win; when `RANK` is absent but
    /// SLURM's task variables are present (workers started directly by
    /// `srun`), the identity comes from SLURM and the master address is the
    /// first host of the node list.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self, WorldInfoError> {
        let get = |name: &'static str| lookup(name).filter(|v| !v.trim().is_empty());
        let from_slurm = get(env::RANK).is_none() && get(slurm::PROCID_VAR).is_some();
        let (rank, world_size, local_rank, local_world_size, node_rank, master_addr) = if from_slurm
        {
            let rank = parse_usize(slurm::PROCID_VAR, get(slurm::PROCID_VAR))?;
            let world = parse_usize(slurm::NTASKS_VAR, get(slurm::NTASKS_VAR))?;
            let local = match get(slurm::LOCALID_VAR) {
                Some(v) => parse_usize(slurm::LOCALID_VAR, Some(v))?,
                None => 0,
            };
            let nnodes = match get(slurm::NNODES_VAR) {
                Some(v) => parse_usize(slurm::NNODES_VAR, Some(v))?.max(1),
                None => 1,
            };
            let local_world = match get(slurm::NTASKS_PER_NODE_VAR) {
                Some(v) => v
                    .split(['(', ','])
                    .next()
                    .and_then(|s| s.parse().ok())
                    .unwrap_or(world.div_ceil(nnodes)),
                None => world.div_ceil(nnodes),
            };
            let node = match get(slurm::NODEID_VAR) {
                Some(v) => parse_usize(slurm::NODEID_VAR, Some(v))?,
                None => 0,
            };
            let master = match get(env::MASTER_ADDR) {
                Some(a) => a,
                None => slurm::master_from_env(&get)?,
            };
            (rank, world, local, local_world, node, master)
        } else {
            let rank = parse_usize(env::RANK, get(env::RANK))?;
            let world = parse_usize(env::WORLD_SIZE, get(env::WORLD_SIZE))?;
            let local = match get(env::LOCAL_RANK) {
                Some(v) => parse_usize(env::LOCAL_RANK, Some(v))?,
                None => rank,
            };
            let local_world = match get(env::LOCAL_WORLD_SIZE) {
                Some(v) => parse_usize(env::LOCAL_WORLD_SIZE, Some(v))?,
                None => world,
            };
            let node = match get(env::GROUP_RANK) {
                Some(v) => parse_usize(env::GROUP_RANK, Some(v))?,
                None => 0,
            };
            let master = get(env::MASTER_ADDR).ok_or(WorldInfoError::Missing {
                name: env::MASTER_ADDR,
            })?;
            (rank, world, local, local_world, node, master)
        };
        if world_size == 0 {
            return Err(invalid(
                env::WORLD_SIZE,
                "0",
                "the world needs at least one worker",
            ));
        }
        if rank >= world_size {
            return Err(invalid(
                env::RANK,
                &rank.to_string(),
                &format!("must be below WORLD_SIZE={world_size}"),
            ));
        }
        if local_world_size == 0 || local_rank >= local_world_size {
            return Err(invalid(
                env::LOCAL_RANK,
                &local_rank.to_string(),
                &format!("must be below LOCAL_WORLD_SIZE={local_world_size}"),
            ));
        }
        let port_text = match get(env::MASTER_PORT) {
            Some(p) => p,
            None if from_slurm => "29500".to_string(),
            None => {
                return Err(WorldInfoError::Missing {
                    name: env::MASTER_PORT,
                })
            }
        };
        let master_port = port_text
            .trim()
            .parse::<u16>()
            .ok()
            .filter(|p| *p != 0)
            .ok_or_else(|| {
                invalid(
                    env::MASTER_PORT,
                    &port_text,
                    "expected a port number 1-65535",
                )
            })?;
        let restart_count = match get(env::BRAID_RESTART_COUNT) {
            Some(v) => parse_usize(env::BRAID_RESTART_COUNT, Some(v))? as u32,
            None => 0,
        };
        let max_restarts = match get(env::BRAID_MAX_RESTARTS) {
            Some(v) => parse_usize(env::BRAID_MAX_RESTARTS, Some(v))? as u32,
            None => 0,
        };
        let run_id = get(env::BRAID_RUN_ID);
        let store_prefix = get(env::BRAID_STORE_PREFIX).unwrap_or_else(|| {
            format!(
                "{}/{}/",
                run_id.as_deref().unwrap_or("default"),
                restart_count
            )
        });
        Ok(WorldInfo {
            rank,
            world_size,
            local_rank,
            local_world_size,
            node_rank,
            master_addr,
            master_port,
            run_id,
            restart_count,
            max_restarts,
            store_addr: get(env::BRAID_STORE_ADDR),
            store_prefix,
            torchrun_agent_store: get(env::TORCHELASTIC_USE_AGENT_STORE)
                .is_some_and(|v| v.eq_ignore_ascii_case("true")),
        })
    }

    /// The default timeout for blocking waits: `BRAID_TIMEOUT` seconds when
    /// set (fractions allowed), otherwise `default`.
    pub fn timeout_from_env(default: Duration) -> Result<Duration, WorldInfoError> {
        match std::env::var(env::BRAID_TIMEOUT) {
            Ok(v) if !v.trim().is_empty() => parse_seconds(env::BRAID_TIMEOUT, &v),
            _ => Ok(default),
        }
    }
}

/// This worker's `LOCAL_RANK`, if the environment gives a valid one (what
/// picks a worker's GPU).
pub fn local_rank_from_env() -> Option<usize> {
    std::env::var(crate::env::LOCAL_RANK)
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
}

/// Parses a positive number of seconds, e.g. `30` or `2.5`.
pub fn parse_seconds(name: &'static str, value: &str) -> Result<Duration, WorldInfoError> {
    value
        .trim()
        .parse::<f64>()
        .ok()
        .filter(|s| s.is_finite() && *s > 0.0)
        .map(Duration::from_secs_f64)
        .ok_or_else(|| invalid(name, value, "expected a positive number of seconds"))
}

fn parse_usize(name: &'static str, value: Option<String>) -> Result<usize, WorldInfoError> {
    let value = value.ok_or(WorldInfoError::Missing { name })?;
    value
        .trim()
        .parse::<usize>()
        .map_err(|_| invalid(name, &value, "expected a non-negative integer"))
}

fn invalid(name: &'static str, value: &str, why: &str) -> WorldInfoError {
    WorldInfoError::Invalid {
        name,
        value: value.to_string(),
        why: why.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn lookup(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn reads_torchrun_variables() {
        let info = WorldInfo::from_lookup(lookup(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("GROUP_RANK", "1"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "29500"),
            ("BRAID_RUN_ID", "abc"),
            ("BRAID_RESTART_COUNT", "2"),
        ]))
        .unwrap();
        assert_eq!(
            (info.rank, info.world_size, info.local_rank, info.node_rank),
            (3, 8, 1, 1)
        );
        assert_eq!(info.master_addr, "node0");
        assert_eq!(info.master_port, 29500);
        assert_eq!(info.restart_count, 2);
        assert_eq!(info.store_prefix, "abc/2/");
        assert_eq!(info.braid_store_port(), 29500);
    }

    #[test]
    fn under_torchrun_braid_uses_the_next_port() {
        let info = WorldInfo::from_lookup(lookup(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "29500"),
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
        ]))
        .unwrap();
        assert_eq!(info.braid_store_port(), 29501);
    }

    #[test]
    fn names_the_missing_variable() {
        let err = WorldInfo::from_lookup(lookup(&[("RANK", "0")])).unwrap_err();
        assert_eq!(err, WorldInfoError::Missing { name: "WORLD_SIZE" });
        assert!(err.to_string().contains("braid launch"));
    }

    #[test]
    fn rejects_rank_outside_world() {
        let err = WorldInfo::from_lookup(lookup(&[
            ("RANK", "4"),
            ("WORLD_SIZE", "4"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "1"),
        ]))
        .unwrap_err();
        assert!(err.to_string().contains("RANK=\"4\""), "{err}");
    }

    #[test]
    fn rejects_bad_port() {
        let err = WorldInfo::from_lookup(lookup(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "70000"),
        ]))
        .unwrap_err();
        assert!(matches!(
            err,
            WorldInfoError::Invalid {
                name: "MASTER_PORT",
                ..
            }
        ));
    }

    #[test]
    fn falls_back_to_slurm_tasks() {
        let info = WorldInfo::from_lookup(lookup(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NNODES", "2"),
            ("SLURM_NODEID", "1"),
            ("SLURM_JOB_NODELIST", "gpu[07-08]"),
        ]))
        .unwrap();
        assert_eq!(
            (
                info.rank,
                info.world_size,
                info.local_rank,
                info.local_world_size
            ),
            (5, 8, 1, 4)
        );
        assert_eq!(info.node_rank, 1);
        assert_eq!(info.master_addr, "gpu07");
        assert_eq!(info.master_port, 29500);
    }
}
