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
  braid bench all_reduce --np 4 -b 8 -e 64M -f 4 --check
  braid launch --standalone --nproc-per-node 2 -- braid bench all_gather -d bf16
Operations: all_reduce reduce broadcast all_gather reduce_scatter all_to_all gather scatter sendrecv"
)]
pub struct BenchArgs {
    /// Operation to measure.
    op: String,
    /// Smallest size in bytes (K, M, G suffixes allowed).
    #[arg(short = 'b', long = "minbytes", default_value = "8", value_parser = parse_size)]
    min_bytes: usize,
    /// Largest size in bytes.
    #[arg(short = 'e', long = "maxbytes", default_value = "64M", value_parser = parse_size)]
    max_bytes: usize,
    /// Multiply the size by this factor each step.
    #[arg(short = 'f', long = "stepfactor", default_value_t = 2)]
    factor: usize,
    /// Timed iterations per size (default: 100, fewer for large sizes).
    #[arg(short = 'n', long = "iters")]
    iters: Option<usize>,
    /// Untimed warm-up iterations per size.
    #[arg(short = 'w', long = "warmup", default_value_t = 5)]
    warmup: usize,
    /// Element type: f32 f64 f16 bf16 i32 i64 u8.
    #[arg(short = 'd', long = "datatype", default_value = "f32")]
    dtype: String,
    /// Reduce operator: sum prod min max avg.
    #[arg(short = 'o', long = "op", default_value = "sum")]
    redop: String,
    /// Root rank for rooted operations.
    #[arg(short = 'r', long = "root", default_value_t = 0)]
    root: usize,
    /// Verify every element of every result.
    #[arg(long)]
    check: bool,
    /// Also write the results as JSON to FILE (rank 0).
    #[arg(long, value_name = "FILE")]
    json: Option<std::path::PathBuf>,
    /// Backend: auto, shm, tcp, hier (default: BRAID_BACKEND, else auto).
    #[arg(long)]
    backend: Option<String>,
    /// Algorithm for the tcp backend: ring or tree (sets BRAID_ALGO).
    #[arg(long)]
    algo: Option<String>,
    /// Start N local workers (instead of running under `braid launch`).
    #[arg(long, value_name = "N")]
    np: Option<usize>,
}

fn parse_size(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let (num, mult) = match t.chars().last() {
        Some('K') | Some('k') => (&t[..t.len() - 1], 1usize << 10),
        Some('M') | Some('m') => (&t[..t.len() - 1], 1 << 20),
        Some('G') | Some('g') => (&t[..t.len() - 1], 1 << 30),
        _ => (t, 1),
    };
    num.parse::<usize>()
        .map(|n| n * mult)
        .map_err(|_| format!("{s:?} is not a size (e.g. 8, 64K, 16M)"))
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

/// Runs `braid bench`.
pub fn run(args: BenchArgs) -> Result<i32, String> {
    if !OPS.contains(&args.op.as_str()) {
        return Err(format!(
            "unknown operation {:?}: expected one of {}",
            args.op,
            OPS.join(" ")
        ));
    }
    let dtype = DType::parse(&args.dtype)?;
    let redop = ReduceOp::parse(&args.redop)?;
    let backend = args
        .backend
        .as_deref()
        .map(BackendKind::parse)
        .transpose()?;
    if args.factor < 2 && args.min_bytes != args.max_bytes {
        return Err("-f must be at least 2".into());
    }
    if let Some(algo) = &args.algo {
        braid_comm::tuning::Algo::parse(algo)?;
    }
    if let Some(np) = args.np {
        return super::workers::relaunch_locally(np);
    }
    if let Some(algo) = &args.algo {
        // Set before the communicator (or any other thread) reads it.
        std::env::set_var("BRAID_ALGO", algo);
    }
    let mut options = CommOptions::from_env().map_err(|e| e.to_string())?;
    if let Some(b) = backend {
        options.backend = b;
    }
    let comm = super::workers::init(options)?;
    if args.root >= comm.size() {
        return Err(format!(
            "--root {} is not below the world size {}",
            args.root,
            comm.size()
        ));
    }
    match dtype {
        DType::F32 => bench::<f32>(&comm, &args, redop),
        DType::F64 => bench::<f64>(&comm, &args, redop),
        DType::F16 => bench::<f16>(&comm, &args, redop),
        DType::BF16 => bench::<bf16>(&comm, &args, redop),
        DType::I32 => bench::<i32>(&comm, &args, redop),
        DType::I64 => bench::<i64>(&comm, &args, redop),
        DType::U8 => bench::<u8>(&comm, &args, redop),
    }
}

/// nccl-tests' bus-bandwidth factor.
fn bus_factor(op: &str, n: usize) -> f64 {
    let n = n as f64;
    match op {
        "all_reduce" => 2.0 * (n - 1.0) / n,
        "all_gather" | "reduce_scatter" | "all_to_all" | "gather" | "scatter" => (n - 1.0) / n,
        _ => 1.0,
    }
}

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

fn bench<T: Element>(comm: &Communicator, a: &BenchArgs, redop: ReduceOp) -> Result<i32, String> {
    let (n, r) = (comm.size(), comm.rank());
    let es = T::DTYPE.size();
    let op = a.op.as_str();
    let per_rank_op = matches!(
        op,
        "all_gather" | "reduce_scatter" | "all_to_all" | "gather" | "scatter"
    );
    let reduces = matches!(op, "all_reduce" | "reduce" | "reduce_scatter");
    if r == 0 {
        println!(
            "# braid bench {op}: {n} ranks, backend {}, dtype {}, redop {}, root {}, warmup {}, check {}",
            comm.backend_name(),
            T::DTYPE,
            if reduces { redop.name() } else { "none" },
            a.root,
            a.warmup,
            a.check
        );
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
            if in_place && matches!(op, "gather" | "scatter" | "sendrecv") {
                continue;
            }
            let (t, w) = time_op::<T>(comm, op, count, in_place, iters, a, redop)
                .map_err(|e| e.to_string())?;
            row.times[k] = Some(t);
            row.wrong[k] = w;
            total_wrong += w.unwrap_or(0);
        }
        if r == 0 {
            print_row::<T>(&row, op, reduces, redop, a.root, n);
        }
        rows.push(row);
        if size >= a.max_bytes {
            break;
        }
        size = (size * a.factor).min(a.max_bytes);
    }
    if r == 0 {
        if let Some(path) = &a.json {
            let json: Vec<serde_json::Value> = rows
                .iter()
                .map(|row| {
                    let f = bus_factor(op, n);
                    let side = |k: usize| {
                        row.times[k].map(|t| {
                            let algbw = row.bytes as f64 / t / 1e9;
                            serde_json::json!({"time_us": t * 1e6, "algbw": algbw, "busbw": algbw * f, "wrong": row.wrong[k]})
                        })
                    };
                    serde_json::json!({"op": op, "bytes": row.bytes, "count": row.count, "dtype": T::DTYPE.name(),
                        "redop": if reduces { redop.name() } else { "none" }, "ranks": n, "backend": comm.backend_name(),
                        "out_of_place": side(0), "in_place": side(1)})
                })
                .collect();
            std::fs::write(path, serde_json::to_string_pretty(&json).expect("json"))
                .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
        }
        if a.check {
            println!("# #wrong total: {total_wrong}");
        }
    }
    comm.barrier().map_err(|e| e.to_string())?;
    Ok(if total_wrong > 0 { 1 } else { 0 })
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
    let f = bus_factor(op, n);
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
    let mut t = [start.elapsed().as_secs_f64() / iters as f64];
    comm.all_reduce(&mut t, ReduceOp::Max)?;
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
