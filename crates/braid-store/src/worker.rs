//! Connecting a worker process to its job's store.
//!
//! Under `braid launch` the launcher already runs a store and tells workers
//! where (`BRAID_STORE_ADDR`) and under which prefix (`BRAID_STORE_PREFIX`).
//! Without it (torchrun, srun, or variables set by hand), rank 0 hosts a
//! store at `MASTER_ADDR:MASTER_PORT` and the others connect there; under
//! torchrun, whose own store holds `MASTER_PORT`, braid's uses the next
//! port.

use crate::client::{ClientOptions, StoreClient};
use crate::error::StoreError;
use crate::server::{ServerOptions, StoreServer};
use braid_core::WorldInfo;

/// A worker's connection to the job's store, and the server itself when
/// this worker (rank 0, no launcher) hosts it.
pub struct WorkerStore {
    /// Client seeing this attempt's key prefix.
    pub client: StoreClient,
    /// The server, when hosted by this process; it stops when dropped.
    pub server: Option<StoreServer>,
}

impl WorkerStore {
    /// Reads the environment and connects (hosting the store on rank 0 when
    /// no launcher provides one).
    pub fn from_env(info: &WorldInfo) -> Result<Self, StoreError> {
        Self::connect(info, ClientOptions::from_env()?, ServerOptions::from_env())
    }

    /// Connects as `info` describes, with explicit options.
    pub fn connect(
        info: &WorldInfo,
        client: ClientOptions,
        server: ServerOptions,
    ) -> Result<Self, StoreError> {
        let (addr, hosted) = match &info.store_addr {
            Some(addr) => (addr.clone(), None),
            None => {
                let addr = join_host_port(&info.master_addr, info.braid_store_port());
                let hosted = if info.rank == 0 {
                    let bind = std::env::var(braid_core::env::BRAID_STORE_BIND)
                        .ok()
                        .filter(|b| !b.is_empty());
                    let bind = bind
                        .map(|b| join_host_port(&b, info.braid_store_port()))
                        .unwrap_or_else(|| addr.clone());
                    Some(StoreServer::bind(bind.as_str(), server).map_err(|e| {
                        e.advise_port_in_use(
                            "rank 0 hosts braid's store on the port MASTER_PORT names (under \
                             torchrun, MASTER_PORT + 1): pick another MASTER_PORT",
                        )
                    })?)
                } else {
                    None
                };
                (addr, hosted)
            }
        };
        let client = StoreClient::connect(&addr, client)?.with_prefix(&info.store_prefix);
        Ok(WorkerStore {
            client,
            server: hosted,
        })
    }
}

impl Drop for WorkerStore {
    /// A hosting rank 0 keeps the store up until every other rank has
    /// disconnected (at most 30 s), so that a rank still reading its last
    /// reply is not cut off by rank 0 exiting first.
    fn drop(&mut self) {
        if let Some(server) = &self.server {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
            // Our own client holds one connection.
            while server.num_connections() > 1 && std::time::Instant::now() < deadline {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
        }
    }
}

/// `host:port`, bracketing IPv6 literals.
pub fn join_host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}
