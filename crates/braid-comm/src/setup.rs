//! Creating a communicator's backend: the ranks publish who and where they
//! are through the store, then pick shared memory (one host), tcp (one rank
//! per host) or the hierarchical mix, unless `BRAID_BACKEND` says otherwise.

use crate::backend::Backend;
use crate::error::{CommError, Result};
use crate::health::LocalPeer;
use crate::p2p_backend::P2pBackend;
use crate::tcp::TcpMesh;
use crate::tuning;
use braid_store::StoreClient;
use std::net::IpAddr;
use std::time::{Duration, Instant};

/// Which backend to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendKind {
    /// Pick from the host layout.
    Auto,
    /// Shared memory (all ranks on one host).
    Shm,
    /// TCP between every pair of ranks.
    Tcp,
    /// Shared memory inside each host, TCP between hosts.
    Hier,
}

impl BackendKind {
    /// Parses `auto`, `shm`, `tcp`, `hier`.
    pub fn parse(s: &str) -> std::result::Result<BackendKind, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Ok(BackendKind::Auto),
            "shm" => Ok(BackendKind::Shm),
            "tcp" => Ok(BackendKind::Tcp),
            "hier" | "hierarchical" => Ok(BackendKind::Hier),
            other => Err(format!(
                "unknown backend {other:?}: expected auto, shm, tcp or hier"
            )),
        }
    }

    /// Reads `BRAID_BACKEND`.
    pub fn from_env() -> std::result::Result<BackendKind, String> {
        BackendKind::parse(&std::env::var(braid_core::env::BRAID_BACKEND).unwrap_or_default())
    }
}

/// What each rank tells the others at setup.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerInfo {
    /// Host identity: ranks with the same one share memory.
    pub host: String,
    /// Process id.
    pub pid: u32,
    /// Address to reach this rank over TCP.
    pub ip: IpAddr,
}

impl PeerInfo {
    /// This process: host identity is `BRAID_HOST_ID` if set, else the host
    /// name plus the address used to reach the store (two network
    /// namespaces on one machine are two hosts).
    pub fn local(store: &StoreClient) -> PeerInfo {
        let ip = store
            .local_addr()
            .map(|a| a.ip())
            .unwrap_or(IpAddr::V4(std::net::Ipv4Addr::LOCALHOST));
        let host = std::env::var(braid_core::env::BRAID_HOST_ID)
            .ok()
            .filter(|h| !h.is_empty())
            .unwrap_or_else(|| {
                let name = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
                format!("{}@{ip}", name.trim())
            });
        PeerInfo {
            host,
            pid: std::process::id(),
            ip,
        }
    }

    fn encode(&self) -> String {
        format!("{}|{}|{}", self.pid, self.ip, self.host)
    }

    fn decode(s: &str) -> Option<PeerInfo> {
        let mut it = s.splitn(3, '|');
        Some(PeerInfo {
            pid: it.next()?.parse().ok()?,
            ip: it.next()?.parse().ok()?,
            host: it.next()?.to_string(),
        })
    }
}

/// Publishes this rank's [`PeerInfo`] and collects everyone's.
pub fn exchange_peers(
    store: &StoreClient,
    rank: usize,
    size: usize,
    me: &PeerInfo,
    timeout: Duration,
) -> Result<Vec<PeerInfo>> {
    store.set(&format!("peer/{rank}"), me.encode())?;
    let deadline = Instant::now() + timeout;
    let keys: Vec<String> = (0..size).map(|r| format!("peer/{r}")).collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    store
        .wait(&refs, deadline.saturating_duration_since(Instant::now()))
        .map_err(|e| {
            CommError::Setup(format!(
                "rank {rank}: not every rank joined the communicator: {e}"
            ))
        })?;
    keys.iter()
        .enumerate()
        .map(|(r, k)| {
            let raw = store.get(k)?;
            PeerInfo::decode(&String::from_utf8_lossy(&raw))
                .ok_or_else(|| CommError::Setup(format!("rank {r} published unreadable peer info")))
        })
        .collect()
}

/// Resolves `Auto` from the layout and checks that a forced choice fits.
pub fn choose(kind: BackendKind, peers: &[PeerInfo]) -> Result<BackendKind> {
    let hosts: std::collections::BTreeSet<&str> = peers.iter().map(|p| p.host.as_str()).collect();
    let one_host = hosts.len() == 1;
    match kind {
        BackendKind::Auto if one_host => Ok(BackendKind::Shm),
        BackendKind::Auto if hosts.len() == peers.len() => Ok(BackendKind::Tcp),
        BackendKind::Auto => Ok(BackendKind::Hier),
        BackendKind::Shm if !one_host => Err(CommError::Setup(format!(
            "BRAID_BACKEND=shm needs every rank on one host, but the ranks are on {} hosts: use tcp or hier",
            hosts.len()
        ))),
        k => Ok(k),
    }
}

/// Everything a backend needs to start.
pub struct SetupCtx<'a> {
    /// This rank.
    pub rank: usize,
    /// All ranks' info.
    pub peers: &'a [PeerInfo],
    /// Store under the communicator's prefix.
    pub store: &'a StoreClient,
    /// Communicator id (unique within the run).
    pub id: &'a str,
    /// Run id (names shared-memory segments).
    pub run_id: &'a str,
    /// Setup timeout.
    pub timeout: Duration,
    /// Bytes per shared-memory slot half, when not the default.
    pub shm_half: Option<usize>,
}

/// Builds the backend of `kind` (already resolved by [`choose`]).
pub fn build(kind: BackendKind, s: &SetupCtx) -> Result<Box<dyn Backend>> {
    let forced = tuning::forced_from_env().map_err(CommError::Setup)?;
    match kind {
        BackendKind::Tcp | BackendKind::Auto => {
            let mesh = TcpMesh::connect(
                s.rank,
                s.peers.len(),
                s.store,
                s.peers[s.rank].ip,
                s.timeout,
            )?;
            Ok(Box::new(P2pBackend::new(mesh, forced)))
        }
        BackendKind::Shm => Ok(Box::new(crate::shm::ShmBackend::create(s)?)),
        BackendKind::Hier => Ok(Box::new(crate::hier::HierBackend::create(s, forced)?)),
    }
}

/// The ranks that share this rank's host, for the health monitor.
pub fn local_peers(rank: usize, peers: &[PeerInfo]) -> Vec<LocalPeer> {
    peers
        .iter()
        .enumerate()
        .filter(|(r, p)| *r != rank && p.host == peers[rank].host)
        .map(|(r, p)| LocalPeer {
            rank: r,
            pid: p.pid,
            left: false,
        })
        .collect()
}
