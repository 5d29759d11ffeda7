//! `braid store`: run a standalone rendezvous store, or measure one.

use braid_store::{ClientOptions, ServerOptions, StoreClient, StoreServer};
use clap::{Args, Subcommand};
use std::time::{Duration, Instant};

/// Tools for braid's rendezvous store.
#[derive(Args)]
#[command(
    about = "Run or benchmark braid's rendezvous store (a TCP key-value store)",
    after_help = "Examples:\n  braid store serve --addr 0.0.0.0:29500\n  braid store bench --clients 4 --ops 20000"
)]
pub struct StoreArgs {
    #[command(subcommand)]
    command: StoreCommand,
}

#[derive(Subcommand)]
enum StoreCommand {
    /// Serve a store until interrupted (BRAID_STORE_TOKEN sets the secret).
    #[command(
        after_help = "Example:\n  BRAID_STORE_TOKEN=s3cret braid store serve --addr 127.0.0.1:29500"
    )]
    Serve {
        /// Address to listen on.
        #[arg(long, default_value = "127.0.0.1:29500")]
        addr: String,
    },
    /// Measure set/get/add throughput and latency over loopback.
    #[command(
        after_help = "Example:\n  braid store bench --clients 4 --ops 20000 --value-size 64"
    )]
    Bench {
        /// Store to measure (default: start one in this process on a free port).
        #[arg(long)]
        addr: Option<String>,
        /// Concurrent clients, each with its own connection and thread.
        #[arg(long, default_value_t = 1)]
        clients: usize,
        /// Operations of each kind per client.
        #[arg(long, default_value_t = 10_000)]
        ops: usize,
        /// Bytes per value.
        #[arg(long, default_value_t = 32)]
        value_size: usize,
    },
}

/// Runs `braid store`.
pub fn run(args: StoreArgs) -> Result<i32, String> {
    match args.command {
        StoreCommand::Serve { addr } => serve(&addr),
        StoreCommand::Bench {
            addr,
            clients,
            ops,
            value_size,
        } => {
            if let Some(a) = &addr {
                host_port(a)?;
            }
            if clients == 0 || ops == 0 {
                let (flag, _) = [("--clients", clients), ("--ops", ops)]
                    .into_iter()
                    .find(|(_, n)| *n == 0)
                    .expect("one is 0");
                return Err(format!("{flag} 0: use at least 1"));
            }
            let most = braid_store::server::DEFAULT_MAX_CONNECTIONS;
            if clients > most {
                return Err(format!(
                    "--clients {clients}: at most {most} (each client is a thread with its own \
                     connection, and the store admits {most} at once)"
                ));
            }
            bench(addr, clients, ops, value_size)
        }
    }
}

/// Checks that `--addr` is `HOST:PORT`, before anything binds or connects.
fn host_port(addr: &str) -> Result<(), String> {
    match addr.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => Ok(()),
        Some(("", port)) if port.parse::<u16>().is_ok() => Err(format!(
            "--addr {addr}: no host before the port: use 127.0.0.1:{port} (this host only) or \
             0.0.0.0:{port} (every interface)"
        )),
        Some((_, port)) => Err(format!(
            "--addr {addr}: {port:?} is not a port (0 to 65535): expected HOST:PORT, e.g. \
             127.0.0.1:29500"
        )),
        None => Err(format!(
            "--addr {addr}: expected HOST:PORT, e.g. 127.0.0.1:29500"
        )),
    }
}

/// How long `store bench --addr` waits for a store that should be up.
const BENCH_CONNECT: Duration = Duration::from_secs(5);

fn serve(addr: &str) -> Result<i32, String> {
    host_port(addr)?;
    let signals = braid_launch::Signals::install().map_err(|e| e.to_string())?;
    let server = StoreServer::bind(addr, ServerOptions::from_env())
        .map_err(|e| {
            e.advise_port_in_use("choose another port in --addr (port 0 picks a free one)")
        })
        .map_err(|e| e.to_string())?;
    eprintln!(
        "braid store: serving on {} (Ctrl-C to stop)",
        server.local_addr()
    );
    while signals.received().is_none() {
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!("braid store: stopping");
    Ok(0)
}

/// One operation kind's measurements.
struct Series {
    name: &'static str,
    latencies: Vec<Duration>,
    wall: Duration,
}

fn bench(
    addr: Option<String>,
    clients: usize,
    ops: usize,
    value_size: usize,
) -> Result<i32, String> {
    let server = match &addr {
        Some(_) => None,
        None => Some(
            StoreServer::bind("127.0.0.1:0", ServerOptions::from_env())
                .map_err(|e| e.to_string())?,
        ),
    };
    let addr = addr.unwrap_or_else(|| {
        server
            .as_ref()
            .expect("server started")
            .local_addr()
            .to_string()
    });
    let options = || ClientOptions::from_env().map_err(|e| e.to_string());
    if server.is_none() {
        // A store named by --addr should be serving already: say so at
        // once rather than from every client after its retries.
        let probe = ClientOptions {
            connect_timeout: BENCH_CONNECT,
            ..options()?
        };
        StoreClient::connect(&addr, probe).map_err(|e| match e {
            braid_store::StoreError::Connect {
                waited, last_error, ..
            } => format!(
                "--addr {addr}: no store answers there (tried for {waited:.1?}; last error: \
                 {last_error}); start one with `braid store serve --addr {addr}`, or leave --addr \
                 out to measure one in this process"
            ),
            other => format!("--addr {addr}: {other}"),
        })?;
    }
    let value = vec![0xabu8; value_size];
    let mut results = Vec::new();
    for name in ["set", "get", "add"] {
        let start = Instant::now();
        let threads: Vec<_> = (0..clients)
            .map(|c| {
                let addr = addr.clone();
                let value = value.clone();
                std::thread::spawn(move || -> Result<Vec<Duration>, String> {
                    let store = StoreClient::connect(&addr, options()?)
                        .map_err(|e| e.to_string())?
                        .with_prefix(&format!("bench/{c}/"));
                    let mut lat = Vec::with_capacity(ops);
                    for i in 0..ops {
                        let key = format!("k{}", i % 1024);
                        let t = Instant::now();
                        match name {
                            "set" => store.set(&key, &value).map(|_| ()),
                            "get" => store.get(&key).map(|v| assert_eq!(v.len(), value.len())),
                            _ => store.add("counter", 1).map(|_| ()),
                        }
                        .map_err(|e| e.to_string())?;
                        lat.push(t.elapsed());
                    }
                    Ok(lat)
                })
            })
            .collect();
        let mut latencies = Vec::with_capacity(clients * ops);
        for t in threads {
            latencies.extend(
                t.join()
                    .map_err(|_| "a benchmark client panicked".to_string())??,
            );
        }
        results.push(Series {
            name,
            latencies,
            wall: start.elapsed(),
        });
    }
    // Check the counters really moved: each client added `ops` times.
    let check = StoreClient::connect(&addr, ClientOptions::from_env().map_err(|e| e.to_string())?)
        .map_err(|e| e.to_string())?;
    for c in 0..clients {
        let n = check
            .add(&format!("bench/{c}/counter"), 0)
            .map_err(|e| e.to_string())?;
        if n < ops as i64 {
            return Err(format!(
                "client {c}'s counter is {n}, expected at least {ops}"
            ));
        }
    }
    println!("# braid store bench: {clients} client(s), {ops} ops each, {value_size}-byte values, store at {addr}");
    println!(
        "{:>6} {:>12} {:>10} {:>10} {:>10}",
        "op", "ops/s", "p50_us", "p99_us", "max_us"
    );
    for s in &mut results {
        s.latencies.sort();
        let pct = |p: f64| {
            s.latencies[((s.latencies.len() - 1) as f64 * p).round() as usize].as_secs_f64() * 1e6
        };
        let rate = s.latencies.len() as f64 / s.wall.as_secs_f64();
        println!(
            "{:>6} {:>12.0} {:>10.1} {:>10.1} {:>10.1}",
            s.name,
            rate,
            pct(0.5),
            pct(0.99),
            pct(1.0)
        );
    }
    Ok(0)
}
