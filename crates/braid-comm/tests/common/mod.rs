//! Runs a world of ranks as threads of this test process, each with its own
//! communicator, store connection and (for shm) mapping of the segment.
#![allow(dead_code)]

use braid_comm::{BackendKind, CommOptions, Communicator};
use braid_store::{ClientOptions, ServerOptions, StoreClient, StoreServer};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// How a test world is set up.
#[derive(Clone, Copy, Debug)]
pub struct WorldSpec {
    pub n: usize,
    pub backend: BackendKind,
    /// Number of simulated hosts (ranks split evenly by rank order).
    pub hosts: usize,
    pub timeout: Duration,
    pub debug: bool,
}

impl WorldSpec {
    pub fn new(n: usize, backend: BackendKind) -> WorldSpec {
        let hosts = if backend == BackendKind::Hier {
            2.min(n)
        } else {
            1
        };
        WorldSpec {
            n,
            backend,
            hosts,
            timeout: Duration::from_secs(30),
            debug: false,
        }
    }
}

static RUN: AtomicUsize = AtomicUsize::new(0);

/// Runs `f(comm)` on every rank and returns each rank's result in order.
pub fn run_world<R: Send>(spec: WorldSpec, f: impl Fn(Communicator) -> R + Sync) -> Vec<R> {
    let server = StoreServer::bind("127.0.0.1:0", ServerOptions::default()).unwrap();
    let addr = server.local_addr().to_string();
    let run = format!(
        "t{}-{}",
        std::process::id(),
        RUN.fetch_add(1, Ordering::SeqCst)
    );
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..spec.n)
            .map(|rank| {
                let addr = addr.clone();
                let run = run.clone();
                let f = &f;
                s.spawn(move || {
                    let store = StoreClient::connect(&addr, ClientOptions::default())
                        .unwrap()
                        .with_prefix(&format!("{run}/"));
                    let host = rank * spec.hosts / spec.n;
                    let options = CommOptions {
                        timeout: spec.timeout,
                        backend: spec.backend,
                        debug: spec.debug,
                        run_id: run.clone(),
                        host_id: Some(format!("host{host}")),
                        shm_half: Some(16 << 10),
                    };
                    let comm = Communicator::init(rank, spec.n, store, options)
                        .expect("communicator init");
                    f(comm)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread panicked"))
            .collect()
    })
}
