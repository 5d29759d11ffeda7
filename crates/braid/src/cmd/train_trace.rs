//! `braid train --trace DIR` and `--metrics-addr HOST:PORT`: what a run
//! records about itself.
//!
//! With `--trace`, every rank records spans from the start (the recorder
//! of `braid-trace`), and at the end measures its clock's offset from the
//! store server's, writes `DIR/trace-rankNNNNN.json` with its spans, its
//! per-step times and the run's description, and tells the store; the lead
//! rank waits for every rank's file and writes the merged `DIR/trace.json`
//! (one process track per rank) for Perfetto, then names the files and
//! `braid report DIR`.
//!
//! With `--metrics-addr`, every rank serves Prometheus metrics at the
//! address (the port plus the rank's local rank, so that the ranks of a
//! node do not collide; port 0 picks free ports): the step, loss,
//! tokens/s, the step's time split, memory, and the collectives' counts,
//! bytes and time.

use braid_trace::clock::{self, ClockOffset};
use braid_trace::format::{self, RankTrace};
use braid_trace::metrics::MetricsServer;
use braid_train::{RunReport, StepReport};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// What a run records, set up before its first step.
pub struct TraceSetup {
    dir: Option<PathBuf>,
    store: Option<braid_store::StoreClient>,
    desc: serde_json::Value,
    items_per_step: f64,
    metrics: Option<Arc<MetricsServer>>,
    rank: usize,
    world: usize,
}

/// NVTX ranges for Nsight: `BRAID_NVTX=1` asks for them, `0` refuses
/// them, and by default a trace (`traced`) asks. They go to the tool that
/// profiles the process (`NVTX_INJECTION64_PATH`, set by `nsys profile`
/// or `ncu`); without one they cost one atomic load each. A tool that
/// cannot attach is a warning, not a failed run.
fn start_nvtx(rank: usize, traced: bool) -> Result<(), String> {
    let asked = match std::env::var(braid_core::env::BRAID_NVTX).as_deref() {
        Ok("1" | "on") => Some(true),
        Ok("0" | "off") => Some(false),
        Ok("") | Err(_) => None,
        Ok(other) => return Err(format!("BRAID_NVTX={other}: expected 1 (on) or 0 (off)")),
    };
    match braid_trace::nvtx::init(asked.unwrap_or(traced)) {
        Ok(true) if rank == 0 => println!("NVTX: ranges go to the attached profiler"),
        Ok(false) if asked == Some(true) && rank == 0 => println!(
            "note: BRAID_NVTX=1 but no profiler is attached (NVTX_INJECTION64_PATH is unset): \
             run braid under `nsys profile` or `ncu --nvtx`"
        ),
        Ok(_) => {}
        Err(e) => eprintln!("braid: warning: rank {rank}: {e}; NVTX ranges are off"),
    }
    Ok(())
}

/// Checks `--trace DIR` (made if missing, must be writable) and starts
/// recording; starts the metrics endpoint of `--metrics-addr`. `comm`:
/// the run's communicator (its store aligns the clocks and collects the
/// ranks' files; `ps`, a parameter-server worker's rank, worker count and
/// store instead); `desc` describes the run in the trace.
pub fn start(
    dir: Option<&Path>,
    metrics_addr: Option<&str>,
    comm: Option<&braid_comm::Communicator>,
    ps: Option<(usize, usize, braid_store::StoreClient)>,
    desc: serde_json::Value,
    items_per_step: f64,
) -> Result<TraceSetup, String> {
    let (rank, world) = match (&ps, comm) {
        (Some((r, w, _)), _) => (*r, *w),
        (None, c) => c.map_or((0, 1), |c| (c.rank(), c.size())),
    };
    let store = match (dir, comm, ps) {
        // A parameter-server run's workers: the run's store, no
        // communicator.
        (Some(_), _, Some((_, w, store))) if w > 1 => Some(store),
        (Some(_), Some(c), None) if c.size() > 1 => Some(
            c.store_client()
                .map_err(|e| format!("--trace: rank {rank}: cannot reach the store: {e}"))?,
        ),
        _ => None,
    };
    if let Some(d) = dir {
        std::fs::create_dir_all(d)
            .map_err(|e| format!("--trace {}: cannot create the directory: {e}", d.display()))?;
        let probe = d.join(format!(".write-test-{rank}"));
        std::fs::write(&probe, b"")
            .map_err(|e| format!("--trace {}: cannot write there: {e}", d.display()))?;
        let _ = std::fs::remove_file(probe);
        if rank == 0 {
            // Files of an earlier run would be merged with this one's.
            for entry in std::fs::read_dir(d).map_err(|e| e.to_string())?.flatten() {
                let name = entry.file_name().to_string_lossy().to_string();
                if name.starts_with("trace-rank") || name == format::MERGED {
                    let _ = std::fs::remove_file(entry.path());
                }
            }
        }
        braid_trace::recorder::start();
    }
    start_nvtx(rank, dir.is_some())?;
    let metrics = match metrics_addr {
        None => None,
        Some(addr) => {
            let addr = per_rank_addr(addr)?;
            let server = MetricsServer::start(&addr)?;
            println!(
                "rank {rank}: metrics at http://{}/metrics",
                server.local_addr()
            );
            Some(Arc::new(server))
        }
    };
    Ok(TraceSetup {
        dir: dir.map(Path::to_path_buf),
        store,
        desc,
        items_per_step,
        metrics,
        rank,
        world,
    })
}

/// `HOST:PORT` moved to `PORT + LOCAL_RANK` (port 0 stays 0).
fn per_rank_addr(addr: &str) -> Result<String, String> {
    let (host, port) = addr.rsplit_once(':').ok_or_else(|| {
        format!("--metrics-addr {addr:?}: expected HOST:PORT (e.g. 127.0.0.1:9400)")
    })?;
    let port: u16 = port
        .parse()
        .map_err(|_| format!("--metrics-addr {addr:?}: {port:?} is not a port number"))?;
    if port == 0 {
        return Ok(addr.to_string());
    }
    let local = braid_core::world::local_rank_from_env().unwrap_or(0);
    let p = port as usize + local;
    if p > u16::MAX as usize {
        return Err(format!(
            "--metrics-addr {addr}: port {port} + local rank {local} is past 65535"
        ));
    }
    Ok(format!("{host}:{p}"))
}

/// The live metrics a run updates at every step.
#[derive(Clone)]
pub struct LiveMetrics {
    server: Arc<MetricsServer>,
    rank: usize,
}

impl LiveMetrics {
    /// Sees step `r`: updates the metrics.
    pub fn step(&self, r: &StepReport) {
        let m = &self.server;
        let rank = self.rank.to_string();
        let l = [("rank", rank.as_str())];
        m.set_gauge("braid_step", "Steps done.", &l, (r.step + 1) as f64);
        m.set_gauge(
            "braid_loss",
            "Training loss of the last step.",
            &l,
            r.loss as f64,
        );
        if let Some(e) = r.eval_loss {
            m.set_gauge("braid_eval_loss", "Last held-out loss.", &l, e as f64);
        }
        m.set_gauge(
            "braid_learning_rate",
            "Learning rate of the last step.",
            &l,
            r.lr as f64,
        );
        m.set_gauge(
            "braid_grad_norm",
            "Gradient norm of the last step.",
            &l,
            r.grad_norm,
        );
        m.set_gauge(
            "braid_tokens_per_second",
            "Tokens per second over all ranks, last step.",
            &l,
            r.tokens_per_s,
        );
        let t = r.times;
        for (part, v) in [
            ("total", t.total),
            ("compute", t.compute),
            ("exposed_comm", t.exposed_comm),
            ("optimizer", t.optimizer),
            ("data", t.data),
        ] {
            m.set_gauge(
                "braid_step_seconds",
                "The last step's time, split by part.",
                &[("rank", rank.as_str()), ("part", part)],
                v,
            );
        }
        if let Some(rss) = resident_bytes() {
            m.set_gauge(
                "braid_host_resident_bytes",
                "Host memory resident.",
                &l,
                rss as f64,
            );
        }
        let (now, peak) = (
            braid_cuda::pool::allocated_bytes(),
            braid_cuda::pool::peak_allocated_bytes(),
        );
        if peak > 0 {
            let h = "Device memory allocated by braid's pool.";
            m.set_gauge(
                "braid_device_memory_bytes",
                h,
                &[("rank", rank.as_str()), ("kind", "allocated")],
                now as f64,
            );
            m.set_gauge(
                "braid_device_memory_bytes",
                h,
                &[("rank", rank.as_str()), ("kind", "peak")],
                peak as f64,
            );
        }
    }
}

impl TraceSetup {
    /// The live metrics, if served.
    pub fn live(&self) -> Option<LiveMetrics> {
        self.metrics.as_ref().map(|m| LiveMetrics {
            server: m.clone(),
            rank: self.rank,
        })
    }

    /// Writes this rank's trace (with `run`'s steps and their summary),
    /// and on the lead rank merges every rank's once they are written.
    /// Call it while the communicator lives (rank 0 may host the store).
    pub fn finish(&mut self, run: &RunReport) -> Result<(), String> {
        let Some(dir) = self.dir.take() else {
            return Ok(());
        };
        self.dir = Some(dir);
        let summary =
            braid_train::summary::summarize(run, super::train_output::WARMUP, self.items_per_step)
                .map(|s| s.to_json());
        let steps: Vec<serde_json::Value> = run
            .steps
            .iter()
            .map(|r| {
                serde_json::json!({"step": r.step, "loss": r.loss, "step_s": r.times.total,
                    "compute_s": r.times.compute, "exposed_comm_s": r.times.exposed_comm,
                    "optimizer_s": r.times.optimizer, "data_s": r.times.data,
                    "tokens_per_s": r.tokens_per_s})
            })
            .collect();
        self.write(serde_json::json!({
            "desc": self.desc,
            "steps": steps,
            "summary": summary,
            "unoverlapped_comm_s": run.unoverlapped_comm,
            "peak_device_bytes": braid_cuda::pool::peak_allocated_bytes(),
        }))
    }

    /// Writes this rank's trace with `meta` as its run section, and on
    /// the lead rank merges every rank's once they are written (what
    /// [`finish`](Self::finish) does for a training run; `braid bench`
    /// calls it directly).
    pub fn write(&mut self, meta: serde_json::Value) -> Result<(), String> {
        let Some(dir) = self.dir.take() else {
            return Ok(());
        };
        let dir = &dir;
        // GPU spans still running: a bounded wait, then they are dropped
        // (a hung collective must not hang the trace).
        let unfinished = match braid_trace::device::flush(Duration::from_secs(10)) {
            Ok(0) => 0,
            Ok(_) => braid_trace::device::drop_pending(),
            Err(e) => {
                eprintln!(
                    "braid: warning: rank {}: GPU trace spans could not be read ({e})",
                    self.rank
                );
                braid_trace::device::drop_pending()
            }
        };
        if unfinished > 0 {
            eprintln!(
                "braid: warning: rank {}: {unfinished} GPU trace spans had not ended 10 s after the run; left out of the trace",
                self.rank
            );
        }
        let (spans, dropped) = braid_trace::recorder::finish();
        let store = self.store.take();
        let offset = match &store {
            Some(s) => clock::measure(16, || {
                s.server_time_us()
                    .map(|t| t as f64)
                    .map_err(|e| format!("rank {}: the store's clock: {e}", self.rank))
            })?,
            None => ClockOffset::default(),
        };
        let hint = if meta.get("steps").is_some() {
            format!(" (braid report {})", dir.display())
        } else {
            " (open it in Perfetto: ui.perfetto.dev)".to_string()
        };
        let mut t = RankTrace::from_spans(self.rank, self.world, offset, spans, dropped, meta);
        braid_trace::analysis::add_idle_spans(&mut t);
        let path = t.write(dir)?;
        if dropped > 0 {
            eprintln!(
                "braid: warning: rank {}: {dropped} spans were not kept (BRAID_TRACE_MAX_EVENTS)",
                self.rank
            );
        }
        let Some(store) = store else {
            let merged = format::merge(dir, std::slice::from_ref(&t))?;
            println!("trace: {} and {}{hint}", path.display(), merged.display());
            return Ok(());
        };
        let attempt = std::env::var(braid_core::env::BRAID_RESTART_COUNT).unwrap_or_default();
        let key = |r: usize| format!("braid/trace/{attempt}/{r}");
        store
            .set(&key(self.rank), b"1")
            .map_err(|e| format!("--trace: rank {}: the store: {e}", self.rank))?;
        if self.rank != 0 {
            return Ok(());
        }
        let keys: Vec<String> = (0..self.world).map(key).collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        store.wait(&refs, Duration::from_secs(120)).map_err(|e| {
            format!(
                "--trace: rank 0 waited 120 s for every rank's trace file in {}: {e}",
                dir.display()
            )
        })?;
        let (traces, missing) = format::read_dir(dir)?;
        if !missing.is_empty() {
            return Err(format!(
                "--trace: the trace files of ranks {missing:?} are missing from {} (is it on a file system every rank shares?)",
                dir.display()
            ));
        }
        let merged = format::merge(dir, &traces)?;
        println!(
            "trace: {} ranks' traces in {}, merged into {}{hint}",
            traces.len(),
            dir.display(),
            merged.display(),
        );
        Ok(())
    }
}

/// This process's resident set, bytes (Linux).
fn resident_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = s.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}

#[cfg(test)]
mod tests {
    use super::per_rank_addr;

    #[test]
    fn the_metrics_port_moves_by_the_local_rank_and_bad_addresses_are_named() {
        assert_eq!(per_rank_addr("127.0.0.1:0").unwrap(), "127.0.0.1:0");
        assert!(per_rank_addr("127.0.0.1")
            .unwrap_err()
            .contains("HOST:PORT"));
        assert!(per_rank_addr("x:99999").unwrap_err().contains("not a port"));
    }
}
