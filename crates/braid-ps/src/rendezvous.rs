//! Where the servers are: each server publishes its address in the run's
//! store under `ps/server/<index>` as `ADDR PID` (the process id tells a
//! restarted server's entry from its predecessor's), and workers read
//! them.

use braid_store::StoreClient;
use std::time::Duration;

/// Server `index`'s key.
pub fn key(index: usize) -> String {
    format!("ps/server/{index}")
}

/// The address in a published value.
pub fn addr_of(value: &str) -> &str {
    value.split_whitespace().next().unwrap_or(value)
}

/// Publishes server `index`'s address (with this process's id).
pub fn publish(store: &StoreClient, index: usize, addr: &str) -> Result<(), String> {
    store
        .set(&key(index), format!("{addr} {}", std::process::id()))
        .map_err(|e| format!("parameter server {index}: publishing its address in the store: {e}"))
}

/// The published values of `servers` servers (see [`addr_of`]), waiting
/// up to `timeout` for each.
pub fn find(store: &StoreClient, servers: usize, timeout: Duration) -> Result<Vec<String>, String> {
    (0..servers)
        .map(|i| {
            let v = store.get_timeout(&key(i), timeout).map_err(|e| {
                format!(
                    "parameter server {i} did not say where it listens within {} s ({e}): did \
                     it start? (the last --ps ranks of the run are the servers)",
                    timeout.as_secs()
                )
            })?;
            String::from_utf8(v).map_err(|_| format!("parameter server {i}'s address is not text"))
        })
        .collect()
}

/// The address this host is reached at by the store's host (the local
/// end of the store connection), with `port`.
pub fn reachable_addr(store: &StoreClient, port: u16) -> String {
    let ip = store
        .local_addr()
        .map(|a| a.ip().to_string())
        .unwrap_or_else(|| "127.0.0.1".into());
    braid_store::worker::join_host_port(&ip, port)
}
