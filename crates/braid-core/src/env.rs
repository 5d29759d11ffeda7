//! Names of the environment variables that make up the worker contract.
//!
//! The launcher writes them and workers read them; keeping the names in one
//! place means the two sides cannot drift apart. The first group is
//! torchrun-compatible, so programs written for torchrun run unchanged under
//! `braid launch`.

/// Global rank of this worker, `0..WORLD_SIZE`.
pub const RANK: &str = "RANK";
/// Rank of this worker among the workers of its node.
pub const LOCAL_RANK: &str = "LOCAL_RANK";
/// Number of workers in the whole job.
pub const WORLD_SIZE: &str = "WORLD_SIZE";
/// Number of workers on this node.
pub const LOCAL_WORLD_SIZE: &str = "LOCAL_WORLD_SIZE";
/// Rank of this worker's node (torchrun's name for the node rank).
pub const GROUP_RANK: &str = "GROUP_RANK";
/// Address of the host where rank 0's rendezvous lives.
pub const MASTER_ADDR: &str = "MASTER_ADDR";
/// Port on [`MASTER_ADDR`] that is free for the workers' own rendezvous.
pub const MASTER_PORT: &str = "MASTER_PORT";
/// Number of nodes (torchrun's name; written for torchrun's programs).
pub const GROUP_WORLD_SIZE: &str = "GROUP_WORLD_SIZE";
/// Rank among the workers of this worker's role: braid runs one role, so
/// the global rank (torchrun's name).
pub const ROLE_RANK: &str = "ROLE_RANK";
/// Number of workers of this worker's role: the world size (torchrun's).
pub const ROLE_WORLD_SIZE: &str = "ROLE_WORLD_SIZE";
/// The workers' role, `braid launch --role` (torchrun's name).
pub const ROLE_NAME: &str = "ROLE_NAME";
/// torchrun's name for [`BRAID_RUN_ID`].
pub const TORCHELASTIC_RUN_ID: &str = "TORCHELASTIC_RUN_ID";
/// torchrun's name for [`BRAID_RESTART_COUNT`].
pub const TORCHELASTIC_RESTART_COUNT: &str = "TORCHELASTIC_RESTART_COUNT";
/// torchrun's name for [`BRAID_MAX_RESTARTS`].
pub const TORCHELASTIC_MAX_RESTARTS: &str = "TORCHELASTIC_MAX_RESTARTS";
/// `True` when torchrun started the worker and its agent's own store
/// already listens on [`MASTER_PORT`] (braid's store then takes the port
/// after it; `braid launch` never sets it).
pub const TORCHELASTIC_USE_AGENT_STORE: &str = "TORCHELASTIC_USE_AGENT_STORE";
/// OpenMP's thread count: `braid launch` sets it to 1 for each of several
/// workers on a node unless it is set already, as torchrun does.
pub const OMP_NUM_THREADS: &str = "OMP_NUM_THREADS";

/// Identifier of the run, the same on every node and across restarts.
pub const BRAID_RUN_ID: &str = "BRAID_RUN_ID";
/// How many times the launcher has restarted the worker group so far.
pub const BRAID_RESTART_COUNT: &str = "BRAID_RESTART_COUNT";
/// How many restarts the launcher allows in total.
pub const BRAID_MAX_RESTARTS: &str = "BRAID_MAX_RESTARTS";
/// `host:port` of a braid rendezvous store that is already running (the
/// launcher's); workers connect to it instead of hosting one on rank 0.
pub const BRAID_STORE_ADDR: &str = "BRAID_STORE_ADDR";
/// Key prefix under which this attempt's workers keep their store keys, so
/// that restarts and concurrent groups never collide.
pub const BRAID_STORE_PREFIX: &str = "BRAID_STORE_PREFIX";
/// Shared secret the rendezvous store demands from every client.
pub const BRAID_STORE_TOKEN: &str = "BRAID_STORE_TOKEN";
/// Most connections a rendezvous store serves at once (it refuses more).
pub const BRAID_STORE_MAX_CONNECTIONS: &str = "BRAID_STORE_MAX_CONNECTIONS";
/// Default timeout in seconds for every blocking wait (store, collectives).
pub const BRAID_TIMEOUT: &str = "BRAID_TIMEOUT";
/// Directory for the run's logs and flight records
/// (`flight-rankNNNNN-attemptA.json`, `crate::flight::dump_file_name`): the
/// launcher's `--log-dir`, else a directory it names at start-up.
pub const BRAID_LOG_DIR: &str = "BRAID_LOG_DIR";
/// How many collective records each rank keeps for its flight record
/// (default 2048; 0 keeps only each communicator's last and current one).
pub const BRAID_FLIGHT_RECORDS: &str = "BRAID_FLIGHT_RECORDS";
