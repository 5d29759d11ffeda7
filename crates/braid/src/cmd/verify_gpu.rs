//! `braid verify --device cuda`: every GPU collective × dtype × reduce op
//! at counts including 0, 1 and ones not divisible by the number of GPUs,
//! in place and out of place, each output element checked against a host
//! reference. Rank 0 prints one summary line per (operation, dtype).

use super::bench_gpu::{value, Case};
use braid_comm::gpu::{DeviceBuffer, GpuCommunicator};
use braid_comm::{DType, Element, ReduceOp};
use half::{bf16, f16};

/// Element counts checked (per rank for per-rank operations).
const COUNTS: [usize; 6] = [0, 1, 7, 1031, 4099, 90001];

const OPS: [&str; 11] = [
    "all_reduce",
    "reduce",
    "broadcast",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "gather",
    "scatter",
    "sendrecv",
    "all_gather_v",
    "all_to_all_v",
];

/// Runs every check; returns the number of wrong elements over all ranks.
pub fn everything(gpu: &GpuCommunicator) -> Result<u64, String> {
    let mut total = 0;
    for op in OPS {
        for dtype in DType::ALL {
            total += match dtype {
                DType::F32 => group::<f32>(gpu, op)?,
                DType::F64 => group::<f64>(gpu, op)?,
                DType::F16 => group::<f16>(gpu, op)?,
                DType::BF16 => group::<bf16>(gpu, op)?,
                DType::I32 => group::<i32>(gpu, op)?,
                DType::I64 => group::<i64>(gpu, op)?,
                DType::U8 => group::<u8>(gpu, op)?,
            };
        }
    }
    if gpu.local_devices().len() == 1 {
        total += split_and_staging(gpu)?;
    }
    Ok(total)
}

/// `split` (ncclCommSplit) into even and odd ranks with an all-reduce on
/// each half, and host slices reduced through the GPU path.
fn split_and_staging(gpu: &GpuCommunicator) -> Result<u64, String> {
    let (r, n) = (gpu.rank(), gpu.size());
    let mut wrong = 0i64;
    let sub = gpu.split(Some((r % 2) as u32), r as i64).map_err(err)?;
    let sub = sub.ok_or("split returned no communicator for a colored rank")?;
    let mut buf = sub
        .buffer_from_host(&vec![(r + 1) as f32; 1031])
        .map_err(err)?;
    sub.all_reduce(&mut buf, ReduceOp::Sum)
        .and_then(|w| w.wait())
        .map_err(err)?;
    let want: usize = (0..n).filter(|q| q % 2 == r % 2).map(|q| q + 1).sum();
    let members = (0..n).filter(|q| q % 2 == r % 2).count();
    if sub.size() != members || sub.rank() != r / 2 {
        wrong += 1;
    }
    wrong += buf
        .to_vec()
        .map_err(err)?
        .iter()
        .filter(|&&x| x != want as f32)
        .count() as i64;
    drop(buf);
    drop(sub);
    let mut host: Vec<bf16> = (0..4099)
        .map(|i| value::<bf16>(r, i, ReduceOp::Max))
        .collect();
    gpu.all_reduce_host(&mut host, ReduceOp::Max).map_err(err)?;
    for (i, x) in host.iter().enumerate() {
        let want = (0..n)
            .map(|q| value::<bf16>(q, i, ReduceOp::Max))
            .fold(bf16::MIN, bf16::max);
        if *x != want {
            wrong += 1;
        }
    }
    let mut w = [wrong];
    gpu.host().all_reduce(&mut w, ReduceOp::Sum).map_err(err)?;
    if gpu.host().rank() == 0 {
        println!(
            "split (ncclCommSplit, even/odd ranks) + all_reduce; all_reduce_host (bf16 max, host slices staged through the GPU), {n} GPUs: {}",
            if w[0] == 0 { "ok".to_string() } else { format!("{} WRONG", w[0]) }
        );
    }
    Ok(w[0] as u64)
}

fn group<T: Element>(gpu: &GpuCommunicator, op: &str) -> Result<u64, String> {
    let n = gpu.size();
    let reduces = matches!(op, "all_reduce" | "reduce" | "reduce_scatter");
    let redops: &[ReduceOp] = if reduces {
        &ReduceOp::ALL
    } else {
        &[ReduceOp::Sum]
    };
    let places: &[bool] = match op {
        "all_reduce" | "reduce" | "broadcast" | "all_gather" | "reduce_scatter" => &[false, true],
        _ => &[false],
    };
    let root = n - 1;
    let started = std::time::Instant::now();
    let mut checks = 0;
    let mut wrong = 0u64;
    for &redop in redops {
        for &count in &COUNTS {
            for &in_place in places {
                let bad = match op {
                    "all_gather_v" => all_gather_v::<T>(gpu, count)?,
                    "all_to_all_v" => all_to_all_v::<T>(gpu, count)?,
                    _ => Case::<T>::new(gpu, op, count, in_place, root, redop, false)
                        .and_then(|mut c| c.check())
                        .map_err(|e| format!("{op} {} count {count}: {e}", T::DTYPE))?,
                };
                if bad > 0 {
                    // Which case, so that a failure can be reproduced.
                    eprintln!(
                        "rank {}: {op} {} {} count {count} {}: {bad} wrong element(s)",
                        gpu.rank(),
                        T::DTYPE.name(),
                        if reduces { redop.name() } else { "-" },
                        if in_place { "in place" } else { "out of place" }
                    );
                }
                wrong += bad;
                checks += 1;
            }
        }
    }
    let mut w = [wrong as i64];
    gpu.host()
        .all_reduce(&mut w, ReduceOp::Sum)
        .map_err(|e| e.to_string())?;
    if gpu.host().rank() == 0 {
        let ops: Vec<&str> = redops.iter().map(|r| r.name()).collect();
        println!(
            "{:<15} {:<5} {:<20} counts {:<24} {:<18} {} GPUs: {} ({} checks, {:.2?})",
            op,
            T::DTYPE.name(),
            if reduces { ops.join(",") } else { "-".into() },
            COUNTS.map(|c| c.to_string()).join(","),
            if places.len() == 2 {
                "in+out of place"
            } else {
                "out of place"
            },
            n,
            if w[0] == 0 {
                "ok".to_string()
            } else {
                format!("{} WRONG", w[0])
            },
            checks,
            started.elapsed()
        );
    }
    Ok(w[0] as u64)
}

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// Uneven all-gather: rank `q` contributes `base + q` elements.
fn all_gather_v<T: Element>(gpu: &GpuCommunicator, base: usize) -> Result<u64, String> {
    let n = gpu.size();
    let counts: Vec<usize> = (0..n).map(|q| base + q).collect();
    let total: usize = counts.iter().sum();
    let devs = gpu.local_devices();
    let mut sends = Vec::new();
    let mut recvs = Vec::new();
    for (k, d) in devs.iter().enumerate() {
        let r = gpu.rank() + k;
        let input: Vec<T> = (0..counts[r])
            .map(|i| value::<T>(r, i, ReduceOp::Sum))
            .collect();
        sends.push(DeviceBuffer::from_host(d, &input).map_err(err)?);
        recvs.push(DeviceBuffer::<T>::zeros(d, total).map_err(err)?);
    }
    gpu.queue("all_gather_v", false, |lanes| {
        for ((l, s), r) in lanes.iter_mut().zip(&sends).zip(recvs.iter_mut()) {
            l.all_gather_v(s, r, &counts)?;
        }
        Ok(())
    })
    .and_then(|w| w.wait())
    .map_err(err)?;
    let mut wrong = 0;
    for r in &recvs {
        let got = r.to_vec().map_err(err)?;
        let mut off = 0;
        for (q, &c) in counts.iter().enumerate() {
            for i in 0..c {
                if got[off + i] != value::<T>(q, i, ReduceOp::Sum) {
                    wrong += 1;
                }
            }
            off += c;
        }
    }
    Ok(wrong)
}

/// Elements rank `src` sends to rank `dst` in the uneven all-to-all.
fn a2a_count(base: usize, src: usize, dst: usize) -> usize {
    base + (src * 2 + dst) % 3
}

/// Uneven all-to-all: rank `s` sends `a2a_count(base, s, d)` elements to `d`.
fn all_to_all_v<T: Element>(gpu: &GpuCommunicator, base: usize) -> Result<u64, String> {
    let n = gpu.size();
    let devs = gpu.local_devices();
    let mut plans = Vec::new();
    for (k, d) in devs.iter().enumerate() {
        let r = gpu.rank() + k;
        let send_counts: Vec<usize> = (0..n).map(|q| a2a_count(base, r, q)).collect();
        let recv_counts: Vec<usize> = (0..n).map(|q| a2a_count(base, q, r)).collect();
        let input: Vec<T> = (0..send_counts.iter().sum())
            .map(|i| value::<T>(r, i, ReduceOp::Sum))
            .collect();
        let send = DeviceBuffer::from_host(d, &input).map_err(err)?;
        let recv = DeviceBuffer::<T>::zeros(d, recv_counts.iter().sum()).map_err(err)?;
        plans.push((send, send_counts, recv, recv_counts));
    }
    gpu.queue("all_to_all_v", false, |lanes| {
        for (l, (s, sc, r, rc)) in lanes.iter_mut().zip(plans.iter_mut()) {
            l.all_to_all_v(s, sc, r, rc)?;
        }
        Ok(())
    })
    .and_then(|w| w.wait())
    .map_err(err)?;
    let mut wrong = 0;
    for (k, (_, _, recv, recv_counts)) in plans.iter().enumerate() {
        let r = gpu.rank() + k;
        let got = recv.to_vec().map_err(err)?;
        let mut off = 0;
        for (q, &c) in recv_counts.iter().enumerate() {
            // Where q's block for r starts in q's send buffer.
            let start: usize = (0..r).map(|d| a2a_count(base, q, d)).sum();
            for i in 0..c {
                if got[off + i] != value::<T>(q, start + i, ReduceOp::Sum) {
                    wrong += 1;
                }
            }
            off += c;
        }
    }
    Ok(wrong)
}
