//! `braid bench --device cuda`: nccl-tests on device memory through the
//! GPU communicator (NCCL).
//!
//! Every process drives `-g` GPUs. Inputs are pseudo-random, a function of
//! (rank, index), so with `--check` every rank recomputes all ranks' inputs
//! on the host and compares each output element with a host reference:
//! exactly for integers and for operations that only move data, within a
//! bound for floating-point reductions (NCCL sums in a different order, and
//! in the element type). `--graph` captures the timed iterations in one
//! CUDA graph per GPU and times its replay.

use super::bench::{sweep, BenchArgs, SweepInfo};
use braid_comm::gpu::{DeviceBuffer, GpuCommunicator, Lane};
use braid_comm::{Communicator, DType, Element, ReduceOp};
use half::{bf16, f16};
use std::time::Instant;

/// Runs the GPU benchmark on the world `host` belongs to.
pub fn run(
    host: &Communicator,
    a: &BenchArgs,
    dtype: DType,
    redop: ReduceOp,
) -> Result<i32, String> {
    let gpu = braid_comm::gpu::GpuCommunicator::init_from_env_per_process(host, a.gpus)
        .map_err(|e| e.to_string())?;
    if a.root >= gpu.size() {
        return Err(format!(
            "--root {} is not below the number of GPUs {}",
            a.root,
            gpu.size()
        ));
    }
    let mut code = 0;
    for op in a.op.split(',') {
        let a = BenchArgs {
            op: op.to_string(),
            ..a.clone()
        };
        let a = &a;
        code = code.max(match dtype {
            DType::F32 => bench::<f32>(&gpu, a, redop),
            DType::F64 => bench::<f64>(&gpu, a, redop),
            DType::F16 => bench::<f16>(&gpu, a, redop),
            DType::BF16 => bench::<bf16>(&gpu, a, redop),
            DType::I32 => bench::<i32>(&gpu, a, redop),
            DType::I64 => bench::<i64>(&gpu, a, redop),
            DType::U8 => bench::<u8>(&gpu, a, redop),
        }?);
    }
    Ok(code)
}

fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Rank `rank`'s input at `i`: random, in a range where integer results
/// stay meaningful and float products stay finite.
pub(crate) fn value<T: Element>(rank: usize, i: usize, redop: ReduceOp) -> T {
    let r = mix(((rank as u64) << 40) ^ i as u64 ^ 0x5EED);
    let u = (r >> 11) as f64 / (1u64 << 53) as f64;
    T::from_f64(match T::DTYPE {
        DType::U8 => (r % 16) as f64,
        DType::I32 | DType::I64 => (r % 100) as f64 - 50.0,
        _ if redop == ReduceOp::Prod => 0.5 + u,
        _ => 2.0 * u - 1.0,
    })
}

/// Relative error allowed per rank for floating-point reductions.
fn tolerance(d: DType) -> f64 {
    match d {
        DType::F64 => 1e-14,
        DType::F32 => 2e-7,
        DType::F16 => 1.5e-3,
        DType::BF16 => 1e-2,
        _ => 0.0,
    }
}

/// The host reference of element `i` reduced over `n` ranks: the value,
/// and the scale the allowed error is relative to (0: exact).
fn reference<T: Element>(n: usize, i: usize, redop: ReduceOp) -> (f64, f64) {
    let vals: Vec<T> = (0..n).map(|q| value::<T>(q, i, redop)).collect();
    if T::DTYPE.is_float() {
        let x: Vec<f64> = vals.iter().map(|v| v.to_f64()).collect();
        let abs: f64 = x.iter().map(|v| v.abs()).sum();
        return match redop {
            ReduceOp::Sum => (x.iter().sum(), abs),
            ReduceOp::Avg => (x.iter().sum::<f64>() / n as f64, abs / n as f64),
            ReduceOp::Prod => {
                let p: f64 = x.iter().product();
                (p, p.abs())
            }
            ReduceOp::Min => (x.iter().copied().fold(f64::INFINITY, f64::min), 0.0),
            ReduceOp::Max => (x.iter().copied().fold(f64::NEG_INFINITY, f64::max), 0.0),
        };
    }
    let x: Vec<i128> = vals.iter().map(|v| v.to_f64() as i128).collect();
    let v: i128 = match redop {
        ReduceOp::Sum => x.iter().sum(),
        ReduceOp::Avg => x.iter().sum::<i128>() / n as i128,
        ReduceOp::Prod => x.iter().fold(1i128, |a, b| a.wrapping_mul(*b)),
        ReduceOp::Min => *x.iter().min().expect("n >= 1"),
        ReduceOp::Max => *x.iter().max().expect("n >= 1"),
    };
    let wrapped = match T::DTYPE {
        DType::U8 => v as u8 as f64,
        DType::I32 => v as i32 as f64,
        _ => v as i64 as f64,
    };
    (wrapped, 0.0)
}

fn close<T: Element>(got: T, want: f64, scale: f64, n: usize) -> bool {
    let g = got.to_f64();
    if scale == 0.0 {
        return g == want || (T::DTYPE.is_float() && g == T::from_f64(want).to_f64());
    }
    (g - want).abs() <= tolerance(T::DTYPE) * (n as f64 + 1.0) * scale + f64::MIN_POSITIVE
}

fn bench<T: Element>(gpu: &GpuCommunicator, a: &BenchArgs, redop: ReduceOp) -> Result<i32, String> {
    let host = gpu.host();
    let reduces = matches!(a.op.as_str(), "all_reduce" | "reduce" | "reduce_scatter");
    let (v, path) = braid_cuda::nccl::version().unwrap_or((0, "?".into()));
    let info = SweepInfo {
        title: format!(
            "{} GPU(s) ({}), {} process(es) x {} GPU(s), NCCL {v} ({path}), dtype {}, redop {}, root {}, warmup {}, graph {}, check {}, timer {}",
            gpu.size(),
            gpu.device().name().unwrap_or_default(),
            host.size(),
            a.gpus,
            T::DTYPE,
            if reduces { redop.name() } else { "none" },
            a.root,
            a.warmup,
            a.graph,
            a.check,
            a.timer
        ),
        ranks: gpu.size(),
        prints: host.rank() == 0,
        // NCCL's all-to-all needs distinct buffers: no in-place column.
        no_in_place: &["gather", "scatter", "sendrecv", "all_to_all"],
        json_extra: serde_json::json!({"backend": "nccl", "graph": a.graph, "gpus_per_process": a.gpus}),
    };
    let wrong = sweep::<T>(a, redop, &info, |count, in_place, iters| {
        time_op::<T>(gpu, &a.op, count, in_place, iters, a, redop).map_err(|e| e.to_string())
    })?;
    host.barrier().map_err(|e| e.to_string())?;
    Ok(if wrong > 0 { 1 } else { 0 })
}

/// One local GPU's buffers.
struct Bufs<T: Element> {
    rank: usize,
    input: Vec<T>,
    inp: DeviceBuffer<T>,
    out: DeviceBuffer<T>,
}

#[allow(clippy::too_many_arguments)]
fn enqueue<T: Element>(
    l: &mut Lane<'_>,
    b: &mut Bufs<T>,
    op: &str,
    in_place: bool,
    root: usize,
    redop: ReduceOp,
    n: usize,
) -> braid_cuda::Result<()> {
    let r = b.rank;
    let (inp, out) = (&b.inp, &mut b.out);
    match (op, in_place) {
        ("all_reduce", false) => l.all_reduce_into(inp, out, redop),
        ("all_reduce", true) => l.all_reduce(out, redop),
        ("reduce", false) => l.reduce_into(inp, out, redop, root),
        ("reduce", true) => l.reduce(out, redop, root),
        ("broadcast", false) => l.broadcast_into(inp, out, root),
        ("broadcast", true) => l.broadcast(out, root),
        ("all_gather", false) => l.all_gather(inp, out),
        ("all_gather", true) => l.all_gather_in_place(out),
        ("reduce_scatter", false) => l.reduce_scatter(inp, out, redop),
        ("reduce_scatter", true) => l.reduce_scatter_in_place(out, redop),
        ("all_to_all", _) => l.all_to_all(inp, out),
        ("gather", _) => l.gather(inp, out, root),
        ("scatter", _) => l.scatter(inp, out, root),
        ("sendrecv", _) => {
            l.send(inp, (r + 1) % n)?;
            l.recv(out, (r + n - 1) % n)
        }
        _ => unreachable!("operation names are checked"),
    }
}

/// One benchmark or check case: an operation at one count, with buffers on
/// every local GPU.
pub(crate) struct Case<'g, T: Element> {
    gpu: &'g GpuCommunicator,
    op: &'static str,
    count: usize,
    in_place: bool,
    root: usize,
    redop: ReduceOp,
    bufs: Vec<Bufs<T>>,
}

fn gpu_error(gpu: &GpuCommunicator, e: braid_cuda::CudaError) -> braid_comm::CommError {
    braid_comm::CommError::Gpu {
        rank: gpu.rank(),
        op: "bench",
        seq: 0,
        detail: e.to_string(),
    }
}

impl<'g, T: Element> Case<'g, T> {
    /// Allocates the buffers; `count` is per rank for per-rank operations.
    /// With `symmetric` the output buffers lie in NCCL symmetric windows
    /// (`--symmetric`: one GPU per process; collective, every rank
    /// allocates its case at the same point).
    pub(crate) fn new(
        gpu: &'g GpuCommunicator,
        op: &str,
        count: usize,
        in_place: bool,
        root: usize,
        redop: ReduceOp,
        symmetric: bool,
    ) -> braid_comm::Result<Self> {
        let n = gpu.size();
        let mut bufs = Vec::new();
        for (k, dev) in gpu.local_devices().iter().enumerate() {
            let r = gpu.rank() + k;
            let (in_len, out_len) = match op {
                "all_reduce" | "broadcast" | "reduce" | "sendrecv" => (count, count),
                "all_gather" => (count, count * n),
                "reduce_scatter" => (count * n, count),
                "all_to_all" => (count * n, count * n),
                "gather" => (count, if r == root { count * n } else { 0 }),
                "scatter" => (if r == root { count * n } else { 0 }, count),
                _ => unreachable!("checked"),
            };
            let input: Vec<T> = (0..in_len).map(|i| value::<T>(r, i, redop)).collect();
            let inp = DeviceBuffer::from_host(dev, &input).map_err(|e| gpu_error(gpu, e))?;
            let out_alloc = if in_place {
                out_len.max(in_len)
            } else {
                out_len
            };
            let out = match symmetric {
                true => gpu.symmetric_zeros(out_alloc)?,
                false => DeviceBuffer::zeros(dev, out_alloc).map_err(|e| gpu_error(gpu, e))?,
            };
            bufs.push(Bufs {
                rank: r,
                input,
                inp,
                out,
            });
        }
        let mut case = Case {
            gpu,
            op: op_name(op),
            count,
            in_place,
            root,
            redop,
            bufs,
        };
        case.prepare()?;
        Ok(case)
    }

    /// Resets the inputs (and, in place, the output buffers) to the inputs.
    fn prepare(&mut self) -> braid_comm::Result<()> {
        let gpu = self.gpu;
        for b in self.bufs.iter_mut() {
            b.inp
                .copy_from_host(&b.input)
                .map_err(|e| gpu_error(gpu, e))?;
            if !self.in_place {
                continue;
            }
            let mut start = vec![T::from_f64(0.0); b.out.len()];
            if self.op == "all_gather" {
                start[b.rank * self.count..(b.rank + 1) * self.count]
                    .copy_from_slice(&b.input[..self.count]);
            } else {
                start[..b.input.len()].copy_from_slice(&b.input);
            }
            b.out
                .copy_from_host(&start)
                .map_err(|e| gpu_error(gpu, e))?;
        }
        Ok(())
    }

    /// Queues the operation once on every local GPU.
    fn once(&mut self) -> braid_comm::Result<braid_comm::gpu::DeviceWork<'g>> {
        let (op, in_place, root, redop, n) = (
            self.op,
            self.in_place,
            self.root,
            self.redop,
            self.gpu.size(),
        );
        let bufs = &mut self.bufs;
        self.gpu.queue(op, op == "send_recv", |lanes| {
            for (l, b) in lanes.iter_mut().zip(bufs.iter_mut()) {
                enqueue(l, b, bench_op(op), in_place, root, redop, n)?;
            }
            Ok(())
        })
    }

    /// Runs the operation once on fresh inputs and counts this process's
    /// wrong elements.
    pub(crate) fn check(&mut self) -> braid_comm::Result<u64> {
        self.prepare()?;
        self.once()?.wait()?;
        let n = self.gpu.size();
        let mut w = 0u64;
        for b in &self.bufs {
            let out = b.out.to_vec().map_err(|e| gpu_error(self.gpu, e))?;
            w += count_wrong::<T>(
                bench_op(self.op),
                &out,
                self.count,
                n,
                b.rank,
                self.root,
                self.redop,
                self.in_place,
            ) as u64;
        }
        Ok(w)
    }

    /// Mean seconds per operation over `iters`, the slowest process's.
    fn time(
        &mut self,
        warmup: usize,
        iters: usize,
        graph: bool,
        rank0: bool,
    ) -> braid_comm::Result<f64> {
        let gpu = self.gpu;
        let host = gpu.host();
        for _ in 0..warmup {
            drop(self.once()?);
        }
        gpu.barrier()?;
        host.barrier()?;
        let iters = iters.max(1);
        let elapsed = if graph {
            let (op, in_place, root, redop, n) =
                (self.op, self.in_place, self.root, self.redop, gpu.size());
            let bufs = &mut self.bufs;
            let graphs = gpu.capture(|lanes| {
                for _ in 0..iters {
                    for (l, b) in lanes.iter_mut().zip(bufs.iter_mut()) {
                        enqueue(l, b, bench_op(op), in_place, root, redop, n)?;
                    }
                }
                Ok(())
            })?;
            gpu.launch_graphs(&graphs)?.wait()?;
            gpu.barrier()?;
            host.barrier()?;
            let start = Instant::now();
            gpu.launch_graphs(&graphs)?.wait()?;
            start.elapsed()
        } else {
            let start = Instant::now();
            for _ in 1..iters {
                drop(self.once()?);
            }
            self.once()?.wait()?;
            start.elapsed()
        };
        let mine = elapsed.as_secs_f64() / iters as f64;
        let mut t = [mine];
        host.all_reduce(&mut t, ReduceOp::Max)?;
        Ok(if rank0 { mine } else { t[0] })
    }
}

fn time_op<T: Element>(
    gpu: &GpuCommunicator,
    op: &str,
    count: usize,
    in_place: bool,
    iters: usize,
    a: &BenchArgs,
    redop: ReduceOp,
) -> braid_comm::Result<(f64, Option<u64>)> {
    let symmetric = a.symmetric && op == "all_gather";
    let mut case = Case::<T>::new(gpu, op, count, in_place, a.root, redop, symmetric)?;
    let t = case.time(a.warmup, iters, a.graph, a.timer == "rank0")?;
    let wrong = if a.check {
        let mut w = [case.check()? as i64];
        gpu.host().all_reduce(&mut w, ReduceOp::Sum)?;
        Some(w[0] as u64)
    } else {
        None
    };
    Ok((t, wrong))
}

/// The bench's name for an operation (`send_recv` is `sendrecv` there).
fn bench_op(op: &str) -> &str {
    if op == "send_recv" {
        "sendrecv"
    } else {
        op
    }
}

pub(crate) fn op_name(op: &str) -> &'static str {
    match op {
        "all_reduce" => "all_reduce",
        "reduce" => "reduce",
        "broadcast" => "broadcast",
        "all_gather" => "all_gather",
        "reduce_scatter" => "reduce_scatter",
        "all_to_all" => "all_to_all",
        "gather" => "gather",
        "scatter" => "scatter",
        _ => "send_recv",
    }
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn count_wrong<T: Element>(
    op: &str,
    out: &[T],
    count: usize,
    n: usize,
    r: usize,
    root: usize,
    redop: ReduceOp,
    in_place: bool,
) -> usize {
    let input_of = |q: usize, i: usize| value::<T>(q, i, redop);
    let mut wrong = 0;
    let mut same = |got: T, want: T| {
        if got != want {
            wrong += 1;
        }
    };
    match op {
        "broadcast" => (0..count).for_each(|i| same(out[i], input_of(root, i))),
        "all_gather" => (0..n * count).for_each(|j| same(out[j], input_of(j / count, j % count))),
        "all_to_all" => {
            (0..n * count).for_each(|j| same(out[j], input_of(j / count, r * count + j % count)))
        }
        "gather" if r == root => {
            (0..n * count).for_each(|j| same(out[j], input_of(j / count, j % count)))
        }
        "scatter" => (0..count).for_each(|i| same(out[i], input_of(root, r * count + i))),
        "sendrecv" => (0..count).for_each(|i| same(out[i], input_of((r + n - 1) % n, i))),
        _ => {}
    }
    let mut reduced = |got: T, i: usize| {
        let (want, scale) = reference::<T>(n, i, redop);
        if !close(got, want, scale, n) {
            wrong += 1;
        }
    };
    match op {
        "all_reduce" => (0..count).for_each(|i| reduced(out[i], i)),
        "reduce" if r == root => (0..count).for_each(|i| reduced(out[i], i)),
        "reduce_scatter" => {
            let base = if in_place { r * count } else { 0 };
            (0..count).for_each(|i| reduced(out[base + i], r * count + i))
        }
        _ => {}
    }
    wrong
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integer_references_wrap_like_the_device_type() {
        // u8 products wrap modulo 256, i32 sums stay exact in range.
        let (want, scale) = reference::<u8>(8, 3, ReduceOp::Prod);
        assert_eq!(scale, 0.0);
        let direct = (0..8).fold(1u8, |acc, q| {
            acc.wrapping_mul(value::<u8>(q, 3, ReduceOp::Prod))
        });
        assert_eq!(want, direct as f64);
        let (want, _) = reference::<i32>(4, 9, ReduceOp::Avg);
        let sum: i32 = (0..4).map(|q| value::<i32>(q, 9, ReduceOp::Avg)).sum();
        assert_eq!(want, (sum / 4) as f64);
    }

    #[test]
    fn float_references_accept_rounding_and_reject_wrong_values() {
        let (want, scale) = reference::<bf16>(4, 11, ReduceOp::Sum);
        let rounded = bf16::from_f64(want);
        assert!(close(rounded, want, scale, 4));
        let off = bf16::from_f64(want + 0.5 + scale);
        assert!(!close(off, want, scale, 4));
        // Min and max must be exact.
        let (want, scale) = reference::<f32>(4, 2, ReduceOp::Max);
        assert_eq!(scale, 0.0);
        assert!(close(f32::from_f64(want), want, scale, 4));
        assert!(!close(f32::from_f64(want) + 1e-6, want, scale, 4));
    }
}
