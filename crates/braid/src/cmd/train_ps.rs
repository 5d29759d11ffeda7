//! `braid train --ps N`: the parameter server's roles. The last N ranks of
//! the run serve ([`serve`]: a braid-ps server over their range of the
//! parameters, its address published in the run's store); the others are
//! workers, a world of their own ([`Ps::workers_world`]), each connected to
//! every server ([`worker_strategy`]).

use super::train::TrainArgs;
use braid_core::WorldInfo;
use braid_ps::{Adaptive, Client, Mode, Server, ServerConfig, Shards, Snapshot, UpdateAt};
use braid_store::{StoreClient, WorkerStore};
use braid_train::checkpoint::{CheckpointReader, StateSource};
use braid_train::engines::CpuOptimizer;
use braid_train::ps::{ParamServer, PsOptions};
use std::sync::OnceLock;
use std::time::Duration;

/// What `--ps`, `--ps-mode` and `--ps-update` resolved to.
#[derive(Debug, Clone)]
pub struct Ps {
    pub servers: usize,
    pub workers: usize,
    pub mode: Mode,
    pub update_at: UpdateAt,
    /// This process's role: `Some(i)`, server `i`; `None`, a worker.
    pub server: Option<usize>,
    /// What asynchronous updates change in the servers' optimizer,
    /// following the pushes' measured staleness (none in a synchronous run
    /// or under `--ps-no-compensation`).
    pub compensation: Option<Adaptive>,
    /// The launched world, servers included.
    pub world: WorldInfo,
}

/// Checks the parameter-server flags against the rest (`processes`: how
/// many the run starts, when known before a world exists) and resolves
/// them in a started process; `None` without `--ps` or before the
/// processes start.
pub fn checked(
    a: &TrainArgs,
    world: Option<&WorldInfo>,
    processes: Option<usize>,
) -> Result<Option<Ps>, String> {
    let Some(servers) = a.ps else {
        for (flag, given, default) in [
            ("--ps-mode", &a.ps_mode, "sync"),
            ("--ps-update", &a.ps_update, "server"),
        ] {
            if given != default {
                return Err(format!(
                    "{flag} {given}: a parameter-server setting, and this run has no servers: add \
                     --ps N (N server processes), or drop {flag}"
                ));
            }
        }
        return Ok(None);
    };
    let mode = Mode::parse(&a.ps_mode)?;
    let update_at = UpdateAt::parse(&a.ps_update)?;
    if update_at == UpdateAt::Worker && mode != Mode::Sync {
        return Err(format!(
            "--ps-update worker with --ps-mode {mode}: summation-only servers serve synchronous \
             steps (every worker updates from the same sum); drop one of them"
        ));
    }
    if servers == 0 {
        return Err("--ps 0: a parameter-server run needs at least one server".into());
    }
    let total = world.map(|w| w.world_size).or(processes);
    let Some(total) = total else {
        return Err(format!(
            "--ps {servers} runs {servers} server process(es) beside the workers: start them all, \
             e.g. --nproc-per-node {} for two workers (or under braid launch)",
            servers + 2
        ));
    };
    if total <= servers {
        return Err(format!(
            "--ps {servers} with {total} process(es): the last {servers} serve, which leaves no \
             worker; start at least {} (--nproc-per-node)",
            servers + 1
        ));
    }
    for (given, what) in [
        (a.tp > 1, "--tp"),
        (a.pp > 1, "--pp"),
        (a.zero.is_some() || a.fsdp, "--zero"),
        (a.offload != "none", "--offload"),
        (a.device == "cuda", "--device cuda"),
    ] {
        if given {
            return Err(format!(
                "--ps with {what}: not built yet (the parameter server's workers train on the CPU \
                 engine, each holding the whole model)"
            ));
        }
    }
    let Some(world) = world else {
        // Checked here before the processes start; each checks again.
        return Ok(None);
    };
    let workers = total - servers;
    let compensation = match a.ps_no_compensation {
        true => None,
        false => mode.adaptive(workers, 0.9),
    };
    Ok(Some(Ps {
        servers,
        workers,
        mode,
        update_at,
        compensation,
        server: (world.rank >= workers).then(|| world.rank - workers),
        world: world.clone(),
    }))
}

impl Ps {
    /// The world the training code sees on a worker: the workers alone
    /// (ranks `0..workers`), on this node those of them that run here.
    pub fn workers_world(&self) -> WorldInfo {
        let w = &self.world;
        let node_start = w.rank - w.local_rank;
        let here = (node_start..node_start + w.local_world_size)
            .filter(|r| *r < self.workers)
            .count();
        WorldInfo {
            world_size: self.workers,
            local_world_size: here.max(1),
            ..w.clone()
        }
    }

    /// What the servers and the workers must agree on.
    pub fn description(&self, model: &str, len: usize) -> String {
        format!(
            "model {model} ({len} parameters), {} server(s), {} worker(s), --ps-mode {}, \
             --ps-update {}",
            self.servers, self.workers, self.mode, self.update_at
        )
    }

    /// The bound of every wait (`BRAID_TIMEOUT`, else 300 s).
    pub fn timeout(&self) -> Result<Duration, String> {
        WorldInfo::timeout_from_env(Duration::from_secs(300)).map_err(|e| e.to_string())
    }
}

/// The run's store, connected once per process and kept for its life
/// (rank 0 hosts it when no launcher does).
fn store(world: &WorldInfo) -> Result<&'static StoreClient, String> {
    static STORE: OnceLock<WorkerStore> = OnceLock::new();
    if let Some(s) = STORE.get() {
        return Ok(&s.client);
    }
    let s = WorkerStore::from_env(world).map_err(|e| format!("the run's store: {e}"))?;
    Ok(&STORE.get_or_init(|| s).client)
}

/// Server `index`'s life: its range of the `len` parameters of `model`
/// (and their optimizer, `how`, where servers update) served until every
/// worker has said goodbye. Prints where it listens and, at the end, what
/// it did.
pub fn serve(
    ps: &Ps,
    index: usize,
    model: &str,
    layout: &braid_model::Layout,
    how: CpuOptimizer,
    ckpt_dir: Option<&std::path::Path>,
) -> Result<i32, String> {
    let store = store(&ps.world)?;
    let shards = Shards::balanced(layout.len, ps.servers)?;
    let shard = shards.range(index);
    let optimizer = (ps.update_at == UpdateAt::Server).then(|| {
        // (Compensated runs set the momentum at each update.)
        how.with_momentum(layout, std::slice::from_ref(&shard), 0.9)
    });
    // A restarted server: its shard from the last checkpoint.
    let restarted = super::train_ps_restart::attempt().unwrap_or(0) > 0;
    let restored = match (restarted, ckpt_dir) {
        (true, Some(dir)) => restored_shard(dir, layout, &shard, index)?,
        _ => None,
    };
    let bind = braid_ps::rendezvous::reachable_addr(store, 0);
    let server = Server::bind(
        &bind,
        ServerConfig {
            index,
            workers: ps.workers,
            len: layout.len,
            shard: shard.clone(),
            mode: ps.mode,
            update_at: ps.update_at,
            optimizer,
            description: ps.description(model, layout.len),
            timeout: ps.timeout()?,
            restored,
            compensation: ps.compensation.clone(),
        },
    )?;
    let addr = server.local_addr()?.to_string();
    braid_ps::rendezvous::publish(store, index, &addr)?;
    println!(
        "parameter server {index}: pid {}, {addr}, elements {}..{} of {} ({:.1} MiB{})",
        std::process::id(),
        shard.start,
        shard.end,
        layout.len,
        (shard.len() * 4) as f64 / (1 << 20) as f64,
        match ps.update_at {
            UpdateAt::Server => " and their optimizer state",
            UpdateAt::Worker => ", sums only",
        }
    );
    if let Some(c) = &ps.compensation {
        let now = c.now();
        println!(
            "parameter server {index}: {} workers' staleness compensated as measured: momentum \
             lowered by the staleness's own, learning rate x min(1, 2/(1 + staleness)); from \
             momentum {:.2} (of 0.90) and x {:.2} at the staleness of {:.1} expected \
             (--ps-no-compensation keeps them)",
            ps.workers,
            now.momentum,
            now.lr_scale,
            c.mean()
        );
    }
    let r = server.run()?;
    let s = &r.staleness;
    println!(
        "parameter server {index}: {} update(s), {:.1} MiB of gradients received, {:.2} s in \
         the optimizer{}",
        r.version,
        r.pushed_bytes as f64 / (1 << 20) as f64,
        r.update_s,
        match ps.mode {
            Mode::Sync => String::new(),
            _ => format!(
                "; staleness of the {} push(es): mean {:.2}, max {}",
                s.pushes,
                s.mean(),
                s.max
            ),
        }
    );
    if let Some((mean, c)) = r.compensation {
        println!(
            "parameter server {index}: compensation at the end: staleness average {mean:.2}, \
             momentum {:.2}, learning rate x {:.2}",
            c.momentum, c.lr_scale
        );
    }
    Ok(0)
}

/// Server `index`'s shard (`shard` of `layout`) from the newest committed
/// checkpoint in `dir`, if there is one.
fn restored_shard(
    dir: &std::path::Path,
    layout: &braid_model::Layout,
    shard: &std::ops::Range<usize>,
    index: usize,
) -> Result<Option<Snapshot>, String> {
    let Some(path) = braid_train::checkpoint::load::resolve(dir)? else {
        println!(
            "parameter server {index}: restarted, with no checkpoint in {} yet: from the start",
            dir.display()
        );
        return Ok(None);
    };
    let from = CheckpointReader::open(&path)?;
    let tensors = braid_train::engines::gpt_tensors(layout);
    let ranges = std::slice::from_ref(shard);
    let params = from.read("params", &tensors, ranges)?;
    let (_, names) = from.optimizer();
    let moments = names
        .iter()
        .map(|n| from.read(n, &tensors, ranges))
        .collect::<Result<Vec<_>, _>>()?;
    println!(
        "parameter server {index}: restarted, its shard from {} (step {})",
        path.display(),
        from.step()
    );
    Ok(Some(Snapshot {
        params,
        moments,
        updates: from.step(),
        version: from.step(),
    }))
}

/// A client of the run's store of its own.
pub fn store_client(ps: &Ps) -> Result<StoreClient, String> {
    store(&ps.world)?
        .reconnect()
        .map_err(|e| format!("the run's store: {e}"))
}

/// A worker's strategy: connected to every server (their addresses from
/// the store), the parameters of `len` elements of `model` agreed; a lost
/// server waited for and brought level where it can come back
/// (`checkpoints`: the run writes them).
pub fn worker_strategy(
    ps: &Ps,
    model: &str,
    len: usize,
    ddp: &braid_train::ddp::DdpOptions,
    checkpoints: bool,
) -> Result<ParamServer, String> {
    use braid_train::collective::GradComm;
    let (encoding, top_k) = match ddp.grad_comm {
        GradComm::Plain => (braid_ps::wire::Encoding::F32, None),
        GradComm::Fp16 => (braid_ps::wire::Encoding::F16, None),
        GradComm::TopK(f) => (braid_ps::wire::Encoding::Sparse, Some(f)),
        other => {
            return Err(format!(
                "--grad-comm {} with --ps: parameter-server pushes travel as plain (f32), fp16 or \
                 topk:FRACTION",
                other.name()
            ))
        }
    };
    let store = store(&ps.world)?;
    let timeout = ps.timeout()?;
    let seen = braid_ps::rendezvous::find(store, ps.servers, timeout)?;
    let addrs: Vec<String> = seen
        .iter()
        .map(|v| braid_ps::rendezvous::addr_of(v).to_string())
        .collect();
    let (mut client, joined) = Client::connect(
        &addrs,
        ps.world.rank,
        ps.workers,
        len,
        &ps.description(model, len),
        timeout,
    )?;
    if checkpoints && ps.mode == Mode::Sync && ps.update_at == UpdateAt::Server {
        let own = store.reconnect().map_err(|e| e.to_string())?;
        client.recover_through(own, seen);
    }
    if joined.initialized && joined.clock > 0 {
        println!(
            "worker {}: joined the running servers at step {}",
            ps.world.rank, joined.clock
        );
    }
    Ok(ParamServer::new(
        client,
        PsOptions {
            worker: ps.world.rank,
            workers: ps.workers,
            mode: ps.mode,
            update_at: ps.update_at,
            first_bucket_mb: ddp.first_bucket_mb,
            bucket_mb: ddp.bucket_cap_mb,
            encoding,
            top_k,
            joined,
            // The servers scale it, following the staleness.
            lr_scale: 1.0,
        },
    ))
}
