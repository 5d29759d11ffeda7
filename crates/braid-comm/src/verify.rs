//! A self-check of every collective: each operation × dtype × reduce
//! operator over sizes that exercise every algorithm path, with every
//! element compared against a reference each rank computes on its own.
//! The test suite runs it on thread worlds; `braid verify` runs it on real
//! processes and hosts.

use crate::{Communicator, DType, Element, ReduceOp};
use half::{bf16, f16};

/// Rank `r`'s input element `i` for a test with `salt`: small integers, so
/// sums and products are exact in every dtype.
fn value(r: usize, i: usize, salt: usize, op: ReduceOp) -> f64 {
    let x = (r * 7 + i * 13 + salt * 5) % 10;
    match op {
        ReduceOp::Prod => (x % 3 + 1) as f64,
        ReduceOp::Min | ReduceOp::Max => x as f64,
        _ => x as f64,
    }
}

fn input<T: Element>(r: usize, count: usize, salt: usize, op: ReduceOp) -> Vec<T> {
    (0..count)
        .map(|i| T::from_f64(value(r, i, salt, op)))
        .collect()
}

/// The exact reduction of every rank's element `i`, rounded as braid
/// promises: once, after accumulating (f16/bf16 in f32), with wrapping
/// integer arithmetic and truncating integer averages.
fn expected<T: Element>(n: usize, i: usize, salt: usize, op: ReduceOp) -> T {
    let vals: Vec<f64> = (0..n).map(|r| value(r, i, salt, op)).collect();
    let acc = match op {
        ReduceOp::Sum | ReduceOp::Avg => vals.iter().sum::<f64>(),
        ReduceOp::Prod => vals.iter().product::<f64>(),
        ReduceOp::Min => vals.iter().cloned().fold(f64::INFINITY, f64::min),
        ReduceOp::Max => vals.iter().cloned().fold(f64::NEG_INFINITY, f64::max),
    };
    let avg = op == ReduceOp::Avg;
    match T::DTYPE {
        DType::F32 => T::from_f64(if avg {
            ((acc as f32) / n as f32) as f64
        } else {
            acc
        }),
        DType::F64 => T::from_f64(if avg { acc / n as f64 } else { acc }),
        DType::F16 => {
            let v = if avg {
                (acc as f32) / n as f32
            } else {
                acc as f32
            };
            bytemuck::cast(f16::from_f32(v).to_bits())
        }
        DType::BF16 => {
            let v = if avg {
                (acc as f32) / n as f32
            } else {
                acc as f32
            };
            bytemuck::cast(bf16::from_f32(v).to_bits())
        }
        DType::I32 | DType::I64 | DType::U8 => {
            let wrapped: i64 = match T::DTYPE {
                DType::U8 => (acc as i64).rem_euclid(256),
                _ => acc as i64,
            };
            T::from_f64(if avg {
                (wrapped / n as i64) as f64
            } else {
                wrapped as f64
            })
        }
    }
}

fn assert_same<T: Element>(what: &str, got: &[T], want: &[T]) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!(
            "{what}: length {} instead of {}",
            got.len(),
            want.len()
        ));
    }
    match (0..got.len()).find(|i| got[*i] != want[*i]) {
        Some(i) => Err(format!(
            "{what}: element {i} is {:?}, expected {:?}",
            got[i], want[i]
        )),
        None => Ok(()),
    }
}

fn reductions<T: Element>(
    c: &Communicator,
    counts: &[usize],
    ops: &[ReduceOp],
    salt: usize,
) -> Result<(), String> {
    let (n, r) = (c.size(), c.rank());
    for &op in ops {
        for &count in counts {
            let tag = format!(
                "{} {op} count={count} n={n} rank={r} backend={}",
                T::DTYPE,
                c.backend_name()
            );
            let want: Vec<T> = (0..count).map(|i| expected(n, i, salt, op)).collect();
            // In place.
            let mut buf = input::<T>(r, count, salt, op);
            c.all_reduce(&mut buf, op).map_err(|e| e.to_string())?;
            assert_same(&format!("all_reduce {tag}"), &buf, &want)?;
            // Out of place.
            let send = input::<T>(r, count, salt, op);
            let mut recv = vec![T::from_f64(0.0); count];
            c.all_reduce_into(&send, &mut recv, op)
                .map_err(|e| e.to_string())?;
            assert_same(&format!("all_reduce_into {tag}"), &recv, &want)?;
            assert_same(
                &format!("all_reduce_into leaves send {tag}"),
                &send,
                &input::<T>(r, count, salt, op),
            )?;
            // Reduce to a root; others' buffers untouched.
            let root = count % n;
            let mut buf = input::<T>(r, count, salt, op);
            c.reduce(&mut buf, op, root).map_err(|e| e.to_string())?;
            if r == root {
                assert_same(&format!("reduce {tag}"), &buf, &want)?;
            } else {
                assert_same(
                    &format!("reduce non-root {tag}"),
                    &buf,
                    &input::<T>(r, count, salt, op),
                )?;
            }
            let mut recv = vec![T::from_f64(0.0); if r == root { count } else { 0 }];
            c.reduce_into(&send, &mut recv, op, root)
                .map_err(|e| e.to_string())?;
            if r == root {
                assert_same(&format!("reduce_into {tag}"), &recv, &want)?;
            }
            // Reduce-scatter: `count` elements per rank.
            let full = input::<T>(r, count * n, salt, op);
            let mut part = vec![T::from_f64(0.0); count];
            c.reduce_scatter(&full, &mut part, op)
                .map_err(|e| e.to_string())?;
            let want_part: Vec<T> = (r * count..(r + 1) * count)
                .map(|i| expected(n, i, salt, op))
                .collect();
            assert_same(&format!("reduce_scatter {tag}"), &part, &want_part)?;
            let mut inplace = input::<T>(r, count * n, salt, op);
            c.reduce_scatter_in_place(&mut inplace, op)
                .map_err(|e| e.to_string())?;
            assert_same(
                &format!("reduce_scatter_in_place {tag}"),
                &inplace[r * count..(r + 1) * count],
                &want_part,
            )?;
        }
    }
    Ok(())
}

fn movement<T: Element>(c: &Communicator, counts: &[usize], salt: usize) -> Result<(), String> {
    let (n, r) = (c.size(), c.rank());
    let op = ReduceOp::Sum;
    for &count in counts {
        let tag = format!(
            "{} count={count} n={n} rank={r} backend={}",
            T::DTYPE,
            c.backend_name()
        );
        let mine = input::<T>(r, count, salt, op);
        let everyone: Vec<T> = (0..n)
            .flat_map(|q| input::<T>(q, count, salt, op))
            .collect();
        // Broadcast, in place and out of place.
        let root = (count + 1) % n;
        let mut buf = mine.clone();
        c.broadcast(&mut buf, root).map_err(|e| e.to_string())?;
        assert_same(
            &format!("broadcast {tag}"),
            &buf,
            &input::<T>(root, count, salt, op),
        )?;
        let mut recv = vec![T::from_f64(0.0); count];
        c.broadcast_into(&mine, &mut recv, root)
            .map_err(|e| e.to_string())?;
        assert_same(
            &format!("broadcast_into {tag}"),
            &recv,
            &input::<T>(root, count, salt, op),
        )?;
        // All-gather and its in-place and uneven variants.
        let mut all = vec![T::from_f64(0.0); count * n];
        c.all_gather(&mine, &mut all).map_err(|e| e.to_string())?;
        assert_same(&format!("all_gather {tag}"), &all, &everyone)?;
        let mut inplace = vec![T::from_f64(0.0); count * n];
        inplace[r * count..(r + 1) * count].copy_from_slice(&mine);
        c.all_gather_in_place(&mut inplace)
            .map_err(|e| e.to_string())?;
        assert_same(&format!("all_gather_in_place {tag}"), &inplace, &everyone)?;
        let counts_v: Vec<usize> = (0..n).map(|q| (count + q * 3) % (count + 5)).collect();
        let mine_v = input::<T>(r, counts_v[r], salt + 1, op);
        let mut all_v = vec![T::from_f64(0.0); counts_v.iter().sum()];
        c.all_gather_v(&mine_v, &mut all_v, &counts_v)
            .map_err(|e| e.to_string())?;
        let want_v: Vec<T> = (0..n)
            .flat_map(|q| input::<T>(q, counts_v[q], salt + 1, op))
            .collect();
        assert_same(&format!("all_gather_v {tag}"), &all_v, &want_v)?;
        // All-to-all: block j of rank q is input(q)[j*count..]; this rank
        // receives block r from every q.
        let send = input::<T>(r, count * n, salt, op);
        let mut recv = vec![T::from_f64(0.0); count * n];
        c.all_to_all(&send, &mut recv).map_err(|e| e.to_string())?;
        let want: Vec<T> = (0..n)
            .flat_map(|q| input::<T>(q, count * n, salt, op)[r * count..(r + 1) * count].to_vec())
            .collect();
        assert_same(&format!("all_to_all {tag}"), &recv, &want)?;
        let mut inplace = send.clone();
        c.all_to_all_in_place(&mut inplace)
            .map_err(|e| e.to_string())?;
        assert_same(&format!("all_to_all_in_place {tag}"), &inplace, &want)?;
        // Uneven all-to-all: rank q sends (q + j + count) % 4 elements to j.
        let sc: Vec<usize> = (0..n).map(|j| (r + j + count) % 4).collect();
        let rc: Vec<usize> = (0..n).map(|q| (q + r + count) % 4).collect();
        let send_v = input::<T>(r, sc.iter().sum(), salt + 2, op);
        let mut recv_v = vec![T::from_f64(0.0); rc.iter().sum()];
        c.all_to_all_v(&send_v, &sc, &mut recv_v, &rc)
            .map_err(|e| e.to_string())?;
        let mut want_v = Vec::new();
        for q in 0..n {
            let sc_q: Vec<usize> = (0..n).map(|j| (q + j + count) % 4).collect();
            let start: usize = sc_q[..r].iter().sum();
            want_v.extend_from_slice(
                &input::<T>(q, sc_q.iter().sum(), salt + 2, op)[start..start + sc_q[r]],
            );
        }
        assert_same(&format!("all_to_all_v {tag}"), &recv_v, &want_v)?;
        // Gather and scatter.
        let root = count % n;
        let mut gathered = vec![T::from_f64(0.0); if r == root { count * n } else { 0 }];
        c.gather(&mine, &mut gathered, root)
            .map_err(|e| e.to_string())?;
        if r == root {
            assert_same(&format!("gather {tag}"), &gathered, &everyone)?;
        }
        let src = if r == root {
            everyone.clone()
        } else {
            Vec::new()
        };
        let mut part = vec![T::from_f64(0.0); count];
        c.scatter(&src, &mut part, root)
            .map_err(|e| e.to_string())?;
        assert_same(
            &format!("scatter {tag}"),
            &part,
            &input::<T>(r, count, salt, op),
        )?;
        // Point-to-point around a ring, two tags received in reverse order.
        if n > 1 {
            let right = (r + 1) % n;
            let left = (r + n - 1) % n;
            let a = input::<T>(r, count, salt + 3, op);
            let b = input::<T>(r, count + 1, salt + 4, op);
            let mut got_a = vec![T::from_f64(0.0); count];
            let mut got_b = vec![T::from_f64(0.0); count + 1];
            if r % 2 == 0 {
                c.send(&a, right, 1).map_err(|e| e.to_string())?;
                c.send(&b, right, 2).map_err(|e| e.to_string())?;
                c.recv(&mut got_b, left, 2).map_err(|e| e.to_string())?;
                c.recv(&mut got_a, left, 1).map_err(|e| e.to_string())?;
            } else {
                c.recv(&mut got_b, left, 2).map_err(|e| e.to_string())?;
                c.recv(&mut got_a, left, 1).map_err(|e| e.to_string())?;
                c.send(&a, right, 1).map_err(|e| e.to_string())?;
                c.send(&b, right, 2).map_err(|e| e.to_string())?;
            }
            assert_same(
                &format!("recv tag 1 {tag}"),
                &got_a,
                &input::<T>(left, count, salt + 3, op),
            )?;
            assert_same(
                &format!("recv tag 2 {tag}"),
                &got_b,
                &input::<T>(left, count + 1, salt + 4, op),
            )?;
        }
        c.barrier().map_err(|e| e.to_string())?;
    }
    Ok(())
}

const SMALL: [usize; 5] = [0, 1, 2, 7, 1031];
/// Beyond the latency path and across several slot pieces (16 KiB halves).
const LARGE: [usize; 2] = [12_289, 90_001];

/// Runs every operation on every dtype (and every reduce op for the
/// reductions) over sizes that hit each algorithm path, checking every
/// element; returns the first discrepancy.
pub fn everything(c: &Communicator) -> Result<(), String> {
    let all_ops = ReduceOp::ALL;
    reductions::<f32>(c, &SMALL, &all_ops, 1)?;
    reductions::<f64>(c, &SMALL, &all_ops, 2)?;
    reductions::<f16>(c, &SMALL, &all_ops, 3)?;
    reductions::<bf16>(c, &SMALL, &all_ops, 4)?;
    reductions::<i32>(c, &SMALL, &all_ops, 5)?;
    reductions::<i64>(c, &SMALL, &all_ops, 6)?;
    reductions::<u8>(c, &SMALL, &all_ops, 7)?;
    reductions::<f32>(c, &LARGE, &[ReduceOp::Sum, ReduceOp::Avg], 8)?;
    reductions::<bf16>(c, &LARGE, &[ReduceOp::Sum, ReduceOp::Max], 9)?;
    reductions::<i64>(c, &LARGE[..1], &[ReduceOp::Prod], 10)?;
    movement::<f32>(c, &SMALL, 11)?;
    movement::<f64>(c, &SMALL[..4], 12)?;
    movement::<f16>(c, &SMALL[..4], 13)?;
    movement::<bf16>(c, &SMALL[..4], 14)?;
    movement::<i32>(c, &SMALL[..4], 15)?;
    movement::<i64>(c, &SMALL[..4], 16)?;
    movement::<u8>(c, &SMALL, 17)?;
    movement::<f32>(c, &LARGE, 18)?;
    Ok(())
}
