//! `braid bench`: nccl-tests for braid's communicators.
//!
//! Each worker times every size out of place and in place, takes the
//! slowest rank's time, and rank 0 prints nccl-tests' columns. `--check`
//! fills the inputs with known values and counts every wrong element.
//! With `--np N` the command starts its own N local workers through the
//! launcher.

use braid_comm::{BackendKind, CommOptions, Communicator, DType, Element, ReduceOp};
use clap::Args;
use half::{bf16, f16};
use std::time::Instant;

/// Collective benchmarks in nccl-tests' terms.
#[derive(Args, Clone)]
#[command(
    about = "Benchmark collectives like nccl-tests: time, algbw, busbw, #wrong per size",
    after_help = "\
Examples:
  braid bench all_reduce --nproc-per-node 4 -b 8 -e 64M -f 4 --check
  braid launch --standalone --nproc-per-node 2 -- braid bench all_gather -d bf16
  braid bench all_reduce --device cuda --nproc-per-node 4 -b 8 -e 1G -f 4 --check
  braid bench all_reduce --device cuda -g 4 --graph
  braid bench all_gather --device cuda --nproc-per-node 4 --symmetric
Operations: all_reduce reduce broadcast all_gather reduce_scatter all_to_all gather scatter sendrecv
A serving endpoint: braid bench serve --url http://HOST:PORT (braid bench serve --help)"
)]
pub struct BenchArgs {
    /// Operation to measure.
    pub(crate) op: String,
    /// Smallest size in bytes (K, M, G suffixes allowed).
    #[arg(short = 'b', long = "minbytes", default_value = "8", value_parser = parse_size)]
    pub(crate) min_bytes: usize,
    /// Largest size in bytes.
    #[arg(short = 'e', long = "maxbytes", default_value = "64M", value_parser = parse_size)]
    pub(crate) max_bytes: usize,
    /// Multiply the size by this factor each step.
    #[arg(short = 'f', long = "stepfactor", default_value_t = 2)]
    pub(crate) factor: usize,
    /// Timed iterations per size (default: 100, fewer for large sizes).
    #[arg(short = 'n', long = "iters")]
    pub(crate) iters: Option<usize>,
    /// Untimed warm-up iterations per size.
    #[arg(short = 'w', long = "warmup", default_value_t = 5)]
    pub(crate) warmup: usize,
    /// Element type: f32 f64 f16 bf16 i32 i64 u8.
    #[arg(short = 'd', long = "datatype", default_value = "f32")]
    pub(crate) dtype: String,
    /// Reduce operator: sum prod min max avg.
    #[arg(short = 'o', long = "op", default_value = "sum")]
    pub(crate) redop: String,
    /// Root rank for rooted operations.
    #[arg(short = 'r', long = "root", default_value_t = 0)]
    pub(crate) root: usize,
    /// Verify every element of every result: 1 (the default, as nccl-tests' -c) or 0.
    ///
    /// --check alone is 1; --no-check is 0.
    #[arg(short = 'c', long = "check", value_name = "0|1", num_args = 0..=1,
          default_value = "1", default_missing_value = "1", value_parser = parse_check)]
    pub(crate) check: bool,
    /// Do not verify the results (-c 0).
    #[arg(long, overrides_with = "check")]
    pub(crate) no_check: bool,
    /// The results as JSON, one array of rows (rank 0).
    #[arg(long, value_name = "FILE", num_args = 0..=1, default_missing_value = "-",
          value_parser = super::json_out::parse, help = super::json_out::HELP)]
    pub(crate) json: Option<super::json_out::JsonOut>,
    /// Backend: auto, shm, tcp, hier (default: BRAID_BACKEND, else auto).
    #[arg(long)]
    pub(crate) backend: Option<String>,
    /// Algorithm for the tcp backend: ring or tree (sets BRAID_ALGO).
    #[arg(long)]
    pub(crate) algo: Option<String>,
    /// Start N local workers (instead of running under `braid launch`; default: one when
    /// not launched): a number, or auto, gpu or cpu.
    #[arg(long = "nproc-per-node", visible_alias = "np", aliases = ["nproc", "nproc_per_node"],
          value_name = "N", value_parser = super::parse_nproc)]
    pub(crate) np: Option<super::Nproc>,
    /// Prefix the table's lines with `[rank 0] ` as `braid launch` does (by default they are
    /// printed as nccl-tests prints them, for scripts that parse its output).
    #[arg(long)]
    pub(crate) prefix_ranks: bool,
    /// Whose time to report: max (the slowest rank's, default) or rank0
    /// (rank 0's own, as torch_collectives_bench.py reports).
    #[arg(long, default_value = "max", value_parser = ["max", "rank0"])]
    pub(crate) timer: String,
    /// Where the buffers live: cpu (shm/tcp/hier backends) or cuda (NCCL).
    #[arg(long, default_value = "cpu")]
    pub(crate) device: String,
    /// GPUs driven by each process (--device cuda; one process with -g N
    /// is NCCL's ncclCommInitAll pattern).
    #[arg(short = 'g', long = "ngpus", default_value_t = 1)]
    pub(crate) gpus: usize,
    /// Capture the timed iterations in a CUDA graph and replay it
    /// (--device cuda).
    #[arg(long)]
    pub(crate) graph: bool,
    /// Trace every collective into DIR (per rank, merged into
    /// DIR/trace.json; GPU operations timed with CUDA events; not with
    /// --graph, whose replays are one launch).
    #[arg(long, value_name = "DIR")]
    pub(crate) trace: Option<std::path::PathBuf>,
    /// all_gather's output buffers in NCCL symmetric windows of a
    /// communicator that runs only the in-place all-gathers, under NCCL's
    /// zero-CTA policy (NCCL 2.28 or later; refused under another
    /// NCCL_CTA_POLICY): the in-place column runs on the copy engines,
    /// the out-of-place column on NCCL's kernels
    /// (--device cuda, one GPU per process; nccl-tests' -R 2).
    #[arg(long)]
    pub(crate) symmetric: bool,
}

pub(crate) fn parse_size(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let (num, mult) = match t.chars().last() {
        Some('K') | Some('k') => (&t[..t.len() - 1], 1usize << 10),
        Some('M') | Some('m') => (&t[..t.len() - 1], 1 << 20),
        Some('G') | Some('g') => (&t[..t.len() - 1], 1 << 30),
        _ => (t, 1),
    };
    let n = num
        .parse::<usize>()
        .map_err(|_| format!("{s:?} is not a size (e.g. 8, 64K, 16M)"))?;
    n.checked_mul(mult).ok_or_else(|| {
        format!("{s:?} is too large a size (more bytes than this machine can address)")
    })
}

/// Bytes of host memory the CPU sweep's largest size takes on one of
/// `ranks` ranks (`time_op`'s buffers): an input and an output of
/// `max_bytes` each, or for the operations whose input (all_gather,
/// gather) or output (scatter) is one rank's block, one of them a block.
fn host_bytes_per_rank(ops: &str, max_bytes: usize, ranks: usize) -> u128 {
    let s = max_bytes as u128;
    ops.split(',')
        .map(|op| match op {
            "all_gather" | "gather" | "scatter" => s + s / ranks.max(1) as u128,
            _ => 2 * s,
        })
        .max()
        .unwrap_or(2 * s)
}

/// Refuses a CPU sweep whose largest size's buffers, on `local` ranks of
/// this host, exceed its available memory (the allocation would abort a
/// rank mid-sweep).
fn check_host_memory(ops: &str, max_bytes: usize, local: usize) -> Result<(), String> {
    let Some(available) = braid_model::footprint::host_available() else {
        return Ok(());
    };
    let each = host_bytes_per_rank(ops, max_bytes, local);
    let need = each * local as u128;
    if need <= available {
        return Ok(());
    }
    let gib = |b: u128| b as f64 / (1u128 << 30) as f64;
    Err(format!(
        "-e {max_bytes}: the largest size's buffers take about {:.1} GiB on each of the {local} \
         rank(s) on this host ({:.1} GiB in all: its input and output), but {:.1} GiB of memory \
         is available: lower -e (--maxbytes)",
        gib(each),
        gib(need),
        gib(available)
    ))
}

const OPS: [&str; 9] = [
    "all_reduce",
    "reduce",
    "broadcast",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "gather",
    "scatter",
    "sendrecv",
];

/// `-c`/`--check`: 1 or 0, as nccl-tests takes it.
fn parse_check(s: &str) -> Result<bool, String> {
    match s.trim() {
        "1" | "true" | "on" => Ok(true),
        "0" | "false" | "off" => Ok(false),
        other => Err(format!("{other:?}: expected 1 (check every result) or 0")),
    }
}

/// `--symmetric`'s checks: GPUs, one per process, an all_gather, and no
/// other `NCCL_CTA_POLICY` in the zero-CTA policy's way (the in-place
/// all-gathers would not run on the copy engines).
fn symmetric_checked(args: &BenchArgs, cuda: bool) -> Result<(), String> {
    if !args.symmetric {
        return Ok(());
    }
    if !cuda || args.gpus != 1 {
        return Err("--symmetric needs --device cuda and one GPU per process (-g 1)".into());
    }
    if !args.op.split(',').any(|op| op == "all_gather") {
        return Err(format!(
            "--symmetric registers all_gather's buffers; the operation {:?} has no all_gather",
            args.op
        ));
    }
    use braid_train::collective::zero_cta;
    match zero_cta::policy_in_the_way(zero_cta::policy_from_env().as_deref()) {
        Some(why) => Err(format!("--symmetric: {why}; unset it or set it to 2")),
        None => Ok(()),
    }
}

/// Runs `braid bench`.
pub fn run(mut args: BenchArgs) -> Result<i32, String> {
    if args.no_check {
        args.check = false;
    }
    for op in args.op.split(',') {
        if !OPS.contains(&op) {
            return Err(format!(
                "unknown operation {op:?}: expected one of {} (or several, comma-separated)",
                OPS.join(" ")
            ));
        }
    }
    let dtype = DType::parse(&args.dtype)?;
    let redop = ReduceOp::parse(&args.redop)?;
    let backend = args
        .backend
        .as_deref()
        .map(BackendKind::parse)
        .transpose()?;
    if args.min_bytes > args.max_bytes {
        return Err(format!(
            "-b {} is larger than -e {}: the sweep goes from -b (minbytes) up to -e (maxbytes)",
            args.min_bytes, args.max_bytes
        ));
    }
    if args.factor < 2 && args.min_bytes != args.max_bytes {
        return Err("-f must be at least 2".into());
    }
    if args.iters == Some(0) {
        return Err(
            "-n 0: each size needs at least 1 timed iteration (-n 1 or more; without -n, 100, \
             fewer for large sizes)"
                .into(),
        );
    }
    if let Some(algo) = &args.algo {
        braid_comm::tuning::Algo::parse(algo)?;
        if backend == Some(BackendKind::Shm) {
            return Err(format!(
                "--algo {algo} with --backend shm: the algorithm is the tcp backend's (and hier's \
                 between hosts); shm always runs its own rings. Use --backend tcp, or drop --algo"
            ));
        }
    }
    let cuda = super::wants_cuda(&args.device)?;
    if args.trace.is_some() && args.graph {
        return Err("--trace with --graph: a graph's replay is one launch, its operations cannot be timed one by one (drop one of them)".into());
    }
    if !cuda && (args.gpus != 1 || args.graph) {
        return Err("-g and --graph need --device cuda".into());
    }
    if args.gpus == 0 {
        return Err("-g must be at least 1".into());
    }
    symmetric_checked(&args, cuda)?;
    if cuda && !super::workers::launched() {
        super::gpus_for(&args.device)?;
    }
    if let Some(j) = &args.json {
        j.check()?;
    }
    if let Some(d) = args.trace.as_deref().filter(|d| d.exists() && !d.is_dir()) {
        return Err(format!(
            "--trace {}: a file, not a directory (--trace names the directory the traces go to)",
            d.display()
        ));
    }
    // The ranks of the world (when this process starts them) and of this
    // host, known before any starts.
    let starts = match args.np {
        Some(np) => Some(np.count()?),
        None if !super::workers::launched() => Some(1),
        None => None,
    };
    // (On GPUs the world counts each process's -g GPUs: checked there.)
    if let (Some(n), false) = (starts, cuda) {
        if args.root >= n {
            return Err(format!(
                "--root {} is not below the world size {n}: use a rank from 0 to {}",
                args.root,
                n - 1
            ));
        }
    }
    if !cuda {
        let local = starts.unwrap_or_else(|| {
            std::env::var(braid_core::env::LOCAL_WORLD_SIZE)
                .ok()
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(1)
        });
        check_host_memory(&args.op, args.max_bytes, local)?;
    }
    match args.np {
        Some(np) => return super::workers::relaunch_locally(np.count()?, args.prefix_ranks),
        // Not launched and no count: one local worker, as nccl-tests runs.
        None if !super::workers::launched() => {
            return super::workers::relaunch_locally(1, args.prefix_ranks)
        }
        None => {}
    }
    if let Some(algo) = &args.algo {
        // Set before the communicator (or any other thread) reads it.
        std::env::set_var(braid_core::env::BRAID_ALGO, algo);
    }
    let mut options = CommOptions::from_env().map_err(|e| e.to_string())?;
    if let Some(b) = backend {
        options.backend = b;
    }
    let comm = super::workers::init(options)?;
    if let (Some(algo), 0, false, "shm") = (&args.algo, comm.rank(), cuda, comm.backend_name()) {
        eprintln!(
            "braid bench: note: --algo {algo} is not used: the backend (auto) is shm, which runs \
             its own rings; --backend tcp runs the algorithm"
        );
    }
    if let (Some(j), 0) = (&args.json, comm.rank()) {
        j.claim_stdout()?;
    }
    let mut tracing = super::train_trace::start(
        args.trace.as_deref(),
        None,
        Some(&comm),
        None,
        serde_json::json!({"command": "bench", "op": args.op, "dtype": args.dtype,
            "device": args.device, "ranks": comm.size()}),
        0.0,
    )?;
    let code = bench_all(&comm, &args, cuda, dtype, redop)?;
    if let (Some(out), 0) = (&args.json, comm.rank()) {
        let rows = std::mem::take(&mut *JSON_ROWS.lock().unwrap_or_else(|p| p.into_inner()));
        out.write(&serde_json::to_string_pretty(&rows).expect("json"))?;
    }
    tracing.write(
        serde_json::json!({"desc": {"command": "bench", "op": args.op,
        "dtype": args.dtype, "device": args.device, "ranks": comm.size()}}),
    )?;
    Ok(code)
}

/// Every operation of `args` over `comm`.
fn bench_all(
    comm: &Communicator,
    args: &BenchArgs,
    cuda: bool,
    dtype: DType,
    redop: ReduceOp,
) -> Result<i32, String> {
    if cuda {
        return super::bench_gpu::run(comm, args, dtype, redop);
    }
    if args.root >= comm.size() {
        return Err(format!(
            "--root {} is not below the world size {}",
            args.root,
            comm.size()
        ));
    }
    let mut code = 0;
    for op in args.op.split(',') {
        let a = BenchArgs {
            op: op.to_string(),
            ..args.clone()
        };
        code = code.max(match dtype {
            DType::F32 => bench::<f32>(comm, &a, redop),
            DType::F64 => bench::<f64>(comm, &a, redop),
            DType::F16 => bench::<f16>(comm, &a, redop),
            DType::BF16 => bench::<bf16>(comm, &a, redop),
            DType::I32 => bench::<i32>(comm, &a, redop),
            DType::I64 => bench::<i64>(comm, &a, redop),
            DType::U8 => bench::<u8>(comm, &a, redop),
        }?);
    }
    Ok(code)
}

/// Every operation's JSON rows of this run (rank 0), written once at the
/// end.
static JSON_ROWS: std::sync::Mutex<Vec<serde_json::Value>> = std::sync::Mutex::new(Vec::new());

/// Fills rank `r`'s input with [`value`].
fn fill<T: Element>(buf: &mut [T], r: usize, op: ReduceOp) {
    for (i, x) in buf.iter_mut().enumerate() {
        *x = T::from_f64(value(r, i, op));
    }
}

/// Rank `r`'s input value at `i`: small integers, exact in every dtype.
fn value(r: usize, i: usize, op: ReduceOp) -> f64 {
    let v = (r * 3 + i * 7) % 5;
    if op == ReduceOp::Prod {
        (v % 2 + 1) as f64
    } else {
        v as f64
    }
}

fn reduced<T: Element>(n: usize, i: usize, op: ReduceOp) -> T {
    let vals = (0..n).map(|r| value(r, i, op));
    let acc = match op {
        ReduceOp::Sum | ReduceOp::Avg => vals.sum::<f64>(),
        ReduceOp::Prod => vals.product::<f64>(),
        ReduceOp::Min => vals.fold(f64::INFINITY, f64::min),
        ReduceOp::Max => vals.fold(f64::NEG_INFINITY, f64::max),
    };
    let acc = if T::DTYPE == DType::U8 {
        (acc as i64).rem_euclid(256) as f64
    } else {
        acc
    };
    if op != ReduceOp::Avg {
        return T::from_f64(acc);
    }
    match T::DTYPE {
        DType::I32 | DType::I64 | DType::U8 => T::from_f64(((acc as i64) / n as i64) as f64),
        DType::F64 => T::from_f64(acc / n as f64),
        _ => T::from_f64(((acc as f32) / n as f32) as f64),
    }
}

struct Row {
    bytes: usize,
    count: usize,
    times: [Option<f64>; 2],
    wrong: [Option<u64>; 2],
}

/// What a sweep prints and records besides the timings.
pub(crate) struct SweepInfo<'a> {
    /// The first line, after "# braid bench OP".
    pub(crate) title: String,
    /// Ranks taking part (busbw factors, per-rank block sizes).
    pub(crate) ranks: usize,
    /// Whether this process prints (rank 0).
    pub(crate) prints: bool,
    /// Operations without an in-place column.
    pub(crate) no_in_place: &'a [&'a str],
    /// Extra JSON fields of every row.
    pub(crate) json_extra: serde_json::Value,
}

/// Runs `a.op` over the size sweep: for each size, `time(count, in_place,
/// iters)` gives the time and (with --check) the wrong elements; prints
/// nccl-tests' table and appends the JSON rows. Returns the number of wrong
/// elements.
pub(crate) fn sweep<T: Element>(
    a: &BenchArgs,
    redop: ReduceOp,
    info: &SweepInfo,
    mut time: impl FnMut(usize, bool, usize) -> Result<(f64, Option<u64>), String>,
) -> Result<u64, String> {
    let n = info.ranks;
    let es = T::DTYPE.size();
    let op = a.op.as_str();
    let per_rank_op = matches!(
        op,
        "all_gather" | "reduce_scatter" | "all_to_all" | "gather" | "scatter"
    );
    let reduces = matches!(op, "all_reduce" | "reduce" | "reduce_scatter");
    if info.prints {
        println!("# braid bench {op}: {}", info.title);
        println!(
            "#{:>11} {:>12} {:>6} {:>6} {:>5}   {:>10} {:>8} {:>8} {:>6}   {:>10} {:>8} {:>8} {:>6}",
            "size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong", "time", "algbw", "busbw", "#wrong"
        );
        println!("#{:>11} {:>12} {:>6} {:>6} {:>5}   {:>10} {:>8} {:>8} {:>6}   {:>10} {:>8} {:>8} {:>6}", "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", "");
        println!("#{:>45}   {:^36}   {:^36}", "", "out-of-place", "in-place");
    }
    let mut rows = Vec::new();
    let mut size = a.min_bytes.max(es);
    let mut total_wrong = 0u64;
    // One untimed pass of the first size before the table (as nccl-tests
    // warms up before its first size): the sweep's one-time costs —
    // threads started, memory mapped, connections made — stay out of its
    // first row.
    let first = match per_rank_op {
        true => (size / es / n).max(1),
        false => (size / es).max(1),
    };
    time(first, false, a.iters.unwrap_or(100).min(20))?;
    loop {
        // Elements per rank block, rounded so the total splits evenly.
        let count = if per_rank_op {
            (size / es / n).max(1)
        } else {
            (size / es).max(1)
        };
        let total_bytes = if per_rank_op {
            count * n * es
        } else {
            count * es
        };
        let iters = a
            .iters
            .unwrap_or(if total_bytes >= 16 << 20 { 20 } else { 100 });
        let mut row = Row {
            bytes: total_bytes,
            count: if per_rank_op { count * n } else { count },
            times: [None, None],
            wrong: [None, None],
        };
        for (k, in_place) in [false, true].into_iter().enumerate() {
            if in_place && info.no_in_place.contains(&op) {
                continue;
            }
            let (t, w) = time(count, in_place, iters)?;
            row.times[k] = Some(t);
            row.wrong[k] = w;
            total_wrong += w.unwrap_or(0);
        }
        if info.prints {
            print_row::<T>(&row, op, reduces, redop, a.root, n);
        }
        rows.push(row);
        if size >= a.max_bytes {
            break;
        }
        size = (size * a.factor).min(a.max_bytes);
    }
    if info.prints {
        if a.json.is_some() {
            let f = braid_trace::analysis::busbw_factor(op, n);
            let json: Vec<serde_json::Value> = rows
                .iter()
                .map(|row| {
                    let side = |k: usize| {
                        row.times[k].map(|t| {
                            let algbw = row.bytes as f64 / t / 1e9;
                            serde_json::json!({"time_us": t * 1e6, "algbw": algbw, "busbw": algbw * f, "wrong": row.wrong[k]})
                        })
                    };
                    let mut v = serde_json::json!({"op": op, "bytes": row.bytes, "count": row.count, "dtype": T::DTYPE.name(),
                        "redop": if reduces { redop.name() } else { "none" }, "ranks": n,
                        "out_of_place": side(0), "in_place": side(1)});
                    if let (Some(o), Some(extra)) = (v.as_object_mut(), info.json_extra.as_object()) {
                        o.extend(extra.clone());
                    }
                    v
                })
                .collect();
            JSON_ROWS
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .extend(json);
        }
        // nccl-tests' footer: wrong values, then the mean bus bandwidth
        // over every size and both columns.
        let f = braid_trace::analysis::busbw_factor(op, n);
        let busbw: Vec<f64> = rows
            .iter()
            .flat_map(|row| {
                row.times
                    .iter()
                    .flatten()
                    .map(|t| row.bytes as f64 / t / 1e9 * f)
            })
            .collect();
        match a.check {
            true => println!(
                "# Out of bounds values : {total_wrong} {}",
                if total_wrong == 0 { "OK" } else { "FAILED" }
            ),
            false => println!("# Out of bounds values : N/A (not checked: -c 0)"),
        }
        println!(
            "# Avg bus bandwidth    : {:.4} ",
            busbw.iter().sum::<f64>() / busbw.len().max(1) as f64
        );
        println!("#");
    }
    Ok(total_wrong)
}

fn bench<T: Element>(comm: &Communicator, a: &BenchArgs, redop: ReduceOp) -> Result<i32, String> {
    let reduces = matches!(a.op.as_str(), "all_reduce" | "reduce" | "reduce_scatter");
    let info = SweepInfo {
        title: format!(
            "{} ranks, backend {}, dtype {}, redop {}, root {}, warmup {}, check {}",
            comm.size(),
            comm.backend_name(),
            T::DTYPE,
            if reduces { redop.name() } else { "none" },
            a.root,
            a.warmup,
            a.check
        ),
        ranks: comm.size(),
        prints: comm.rank() == 0,
        no_in_place: &["gather", "scatter", "sendrecv"],
        json_extra: serde_json::json!({"backend": comm.backend_name()}),
    };
    let wrong = sweep::<T>(a, redop, &info, |count, in_place, iters| {
        time_op::<T>(comm, &a.op, count, in_place, iters, a, redop).map_err(|e| e.to_string())
    })?;
    comm.barrier().map_err(|e| e.to_string())?;
    Ok(if wrong > 0 { 1 } else { 0 })
}

fn print_row<T: Element>(
    row: &Row,
    op: &str,
    reduces: bool,
    redop: ReduceOp,
    root: usize,
    n: usize,
) {
    let rooted = matches!(op, "reduce" | "broadcast" | "gather" | "scatter");
    let f = braid_trace::analysis::busbw_factor(op, n);
    let mut line = format!(
        "{:>12} {:>12} {:>6} {:>6} {:>5}",
        row.bytes,
        row.count,
        T::DTYPE.name(),
        if reduces { redop.name() } else { "none" },
        if rooted { root as i64 } else { -1 }
    );
    for k in 0..2 {
        match row.times[k] {
            Some(t) => {
                let algbw = row.bytes as f64 / t / 1e9;
                let wrong = row.wrong[k]
                    .map(|w| w.to_string())
                    .unwrap_or_else(|| "N/A".into());
                line += &format!(
                    "   {:>10.2} {:>8.2} {:>8.2} {:>6}",
                    t * 1e6,
                    algbw,
                    algbw * f,
                    wrong
                );
            }
            None => line += &format!("   {:>10} {:>8} {:>8} {:>6}", "-", "-", "-", "-"),
        }
    }
    println!("{line}");
}

/// Times `iters` runs of `op`; returns the slowest rank's mean time and,
/// with `--check`, the number of wrong elements summed over ranks.
fn time_op<T: Element>(
    comm: &Communicator,
    op: &str,
    count: usize,
    in_place: bool,
    iters: usize,
    a: &BenchArgs,
    redop: ReduceOp,
) -> braid_comm::Result<(f64, Option<u64>)> {
    let (n, r) = (comm.size(), comm.rank());
    let root = a.root;
    let zero = T::from_f64(0.0);
    let (in_len, out_len) = match op {
        "all_reduce" | "broadcast" | "reduce" | "sendrecv" => (count, count),
        "all_gather" => (count, count * n),
        "reduce_scatter" => (count * n, count),
        "all_to_all" => (count * n, count * n),
        "gather" => (count, if r == root { count * n } else { 0 }),
        "scatter" => (if r == root { count * n } else { 0 }, count),
        _ => unreachable!("checked"),
    };
    let mut input = vec![zero; in_len];
    let mut output = vec![zero; out_len.max(if in_place { in_len } else { 0 })];
    let run_once = |input: &mut Vec<T>, output: &mut Vec<T>| -> braid_comm::Result<()> {
        match (op, in_place) {
            ("all_reduce", false) => comm.all_reduce_into(input, output, redop),
            ("all_reduce", true) => comm.all_reduce(output, redop),
            ("reduce", false) => comm.reduce_into(input, output, redop, root),
            ("reduce", true) => comm.reduce(output, redop, root),
            ("broadcast", false) => comm.broadcast_into(input, output, root),
            ("broadcast", true) => comm.broadcast(output, root),
            ("all_gather", false) => comm.all_gather(input, output),
            ("all_gather", true) => comm.all_gather_in_place(output),
            ("reduce_scatter", false) => comm.reduce_scatter(input, output, redop),
            ("reduce_scatter", true) => comm.reduce_scatter_in_place(output, redop),
            ("all_to_all", false) => comm.all_to_all(input, output),
            ("all_to_all", true) => comm.all_to_all_in_place(output),
            ("gather", _) => comm.gather(input, output, root),
            ("scatter", _) => comm.scatter(input, output, root),
            ("sendrecv", _) => {
                if n == 1 {
                    output.copy_from_slice(input);
                    return Ok(());
                }
                comm.send_recv(input, (r + 1) % n, output, (r + n - 1) % n, 0)
            }
            _ => unreachable!("checked"),
        }
    };
    let prepare = |input: &mut Vec<T>, output: &mut Vec<T>| {
        fill(input, r, redop);
        if in_place {
            if op == "all_gather" {
                output.iter_mut().for_each(|x| *x = zero);
                output[r * count..(r + 1) * count].copy_from_slice(&input[..count]);
            } else {
                output[..in_len].copy_from_slice(input);
            }
        }
    };
    prepare(&mut input, &mut output);
    for _ in 0..a.warmup {
        if in_place {
            prepare(&mut input, &mut output);
        }
        run_once(&mut input, &mut output)?;
    }
    comm.barrier()?;
    let start = Instant::now();
    for _ in 0..iters {
        run_once(&mut input, &mut output)?;
    }
    let mine = start.elapsed().as_secs_f64() / iters as f64;
    let mut t = [mine];
    comm.all_reduce(&mut t, ReduceOp::Max)?;
    if a.timer == "rank0" {
        t[0] = mine;
    }
    let wrong = if a.check {
        prepare(&mut input, &mut output);
        run_once(&mut input, &mut output)?;
        let mut w = [count_wrong(op, &output, count, n, r, root, redop, in_place) as i64];
        comm.all_reduce(&mut w, ReduceOp::Sum)?;
        Some(w[0] as u64)
    } else {
        None
    };
    Ok((t[0], wrong))
}

#[allow(clippy::too_many_arguments)]
fn count_wrong<T: Element>(
    op: &str,
    out: &[T],
    count: usize,
    n: usize,
    r: usize,
    root: usize,
    redop: ReduceOp,
    in_place: bool,
) -> usize {
    let input_of = |q: usize, i: usize| T::from_f64(value(q, i, redop));
    let mut wrong = 0;
    let mut expect = |got: T, want: T| {
        if got != want {
            wrong += 1;
        }
    };
    match op {
        "all_reduce" => (0..count).for_each(|i| expect(out[i], reduced::<T>(n, i, redop))),
        "reduce" if r == root => (0..count).for_each(|i| expect(out[i], reduced::<T>(n, i, redop))),
        "broadcast" => (0..count).for_each(|i| expect(out[i], input_of(root, i))),
        "all_gather" => (0..n * count).for_each(|j| expect(out[j], input_of(j / count, j % count))),
        "reduce_scatter" => {
            let base = if in_place { r * count } else { 0 };
            (0..count).for_each(|i| expect(out[base + i], reduced::<T>(n, r * count + i, redop)))
        }
        "all_to_all" => {
            (0..n * count).for_each(|j| expect(out[j], input_of(j / count, r * count + j % count)))
        }
        "gather" if r == root => {
            (0..n * count).for_each(|j| expect(out[j], input_of(j / count, j % count)))
        }
        "scatter" => (0..count).for_each(|i| expect(out[i], input_of(root, r * count + i))),
        "sendrecv" => (0..count).for_each(|i| expect(out[i], input_of((r + n - 1) % n, i))),
        _ => {}
    }
    wrong
}
