//! [`TensorComm`]: the collectives a tensor-parallel model calls in the
//! middle of its passes — all-reduce (sum or max), all-gather and
//! reduce-scatter over its group, on host buffers. braid-model defines it
//! and braid-train implements it over its communicators, so the layers
//! point down: the model never names a backend.
//!
//! [`LocalGroup`] is a real implementation for ranks that are threads of
//! one process (shared buffers and a barrier; every sum in rank order):
//! what the model's own tests run tensor parallelism over.

use std::sync::{Arc, Barrier, Mutex};

/// How an all-reduce combines the ranks' values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceKind {
    /// Element-wise sum.
    Sum,
    /// Element-wise maximum.
    Max,
}

/// A tensor-parallel group's collectives, as one rank calls them. Every
/// rank of the group calls the same operations in the same order with
/// buffers of the same sizes. Errors name what failed.
pub trait TensorComm: Send + Sync {
    /// Ranks in the group.
    fn size(&self) -> usize;
    /// This rank's place in it.
    fn rank(&self) -> usize;
    /// `x` becomes the element-wise reduction of every rank's `x`.
    fn all_reduce_f32(&self, x: &mut [f32], op: ReduceKind) -> Result<(), String>;
    /// `full` (`size ×` the length of `local`) becomes every rank's
    /// `local`, rank by rank.
    fn all_gather_f32(&self, local: &[f32], full: &mut [f32]) -> Result<(), String>;
    /// `local` becomes this rank's slice (the `rank`-th of `size` equal
    /// slices) of the element-wise sum of every rank's `full`.
    fn reduce_scatter_f32(&self, full: &[f32], local: &mut [f32]) -> Result<(), String>;
    /// [`all_reduce_f32`](Self::all_reduce_f32) in f64 (the model's
    /// finite-difference checks); training refuses it by default.
    fn all_reduce_f64(&self, _x: &mut [f64], _op: ReduceKind) -> Result<(), String> {
        Err(f64_refused())
    }
    /// [`all_gather_f32`](Self::all_gather_f32) in f64.
    fn all_gather_f64(&self, _local: &[f64], _full: &mut [f64]) -> Result<(), String> {
        Err(f64_refused())
    }
    /// [`reduce_scatter_f32`](Self::reduce_scatter_f32) in f64.
    fn reduce_scatter_f64(&self, _full: &[f64], _local: &mut [f64]) -> Result<(), String> {
        Err(f64_refused())
    }
}

/// A tensor-parallel group's collectives on device memory, as one rank's
/// GPU model calls them: each queued after the work already on the
/// model's `stream`, and the stream's later work after it (so the pass
/// goes on with the reduced values). braid-train implements it over NCCL.
pub trait DeviceTensorComm: Send + Sync {
    /// Ranks in the group.
    fn size(&self) -> usize;
    /// This rank's place in it.
    fn rank(&self) -> usize;
    /// `x` (f32 on this rank's GPU) becomes the element-wise reduction of
    /// every rank's `x`.
    fn all_reduce_f32(
        &self,
        x: braid_cuda::DeviceViewMut<'_, f32>,
        op: ReduceKind,
        stream: &braid_cuda::Stream,
    ) -> Result<(), String>;
    /// `x` (bf16 on this rank's GPU) becomes the sum of every rank's `x`
    /// (NCCL adds in bf16, as Megatron's activation all-reduces do).
    fn all_reduce_bf16(
        &self,
        x: braid_cuda::DeviceViewMut<'_, half::bf16>,
        stream: &braid_cuda::Stream,
    ) -> Result<(), String>;
    /// In place over `full` (f32, `size` equal blocks, this rank's block
    /// already at its offset): every other rank's block lands at its own
    /// (sequence parallelism's gather of the rows before a column-split
    /// product).
    fn all_gather_f32(
        &self,
        full: braid_cuda::DeviceViewMut<'_, f32>,
        stream: &braid_cuda::Stream,
    ) -> Result<(), String>;
    /// In place over `full` (f32, `size` equal blocks): this rank's block
    /// becomes the sum of every rank's same block; the others are left
    /// undefined (sequence parallelism's reduction after a row-split
    /// product).
    fn reduce_scatter_f32(
        &self,
        full: braid_cuda::DeviceViewMut<'_, f32>,
        stream: &braid_cuda::Stream,
    ) -> Result<(), String>;
    /// [`all_gather_f32`](Self::all_gather_f32) in bf16 (the bf16
    /// engine's gather of a LayerNorm's output, or of the residual
    /// stream's gradient, before the products that read every row).
    fn all_gather_bf16(
        &self,
        full: braid_cuda::DeviceViewMut<'_, half::bf16>,
        stream: &braid_cuda::Stream,
    ) -> Result<(), String>;
    /// [`reduce_scatter_f32`](Self::reduce_scatter_f32) in bf16 (NCCL
    /// adds in bf16): the bf16 engine's reduction of a row-split
    /// product's shares, or of a column-split product's input gradients,
    /// onto each rank's rows.
    fn reduce_scatter_bf16(
        &self,
        full: braid_cuda::DeviceViewMut<'_, half::bf16>,
        stream: &braid_cuda::Stream,
    ) -> Result<(), String>;
    /// `x` (host memory) becomes the sum of every rank's (a gradient
    /// norm's parts).
    fn host_sum_f64(&self, x: &mut [f64]) -> Result<(), String>;
    /// Starts summing `x` (f32) over the group after `stream`'s work so
    /// far, without ordering `stream`'s later work after it: that runs
    /// beside the sum until [`wait_started`](Self::wait_started). By
    /// default the plain [`all_reduce_f32`](Self::all_reduce_f32), which
    /// orders it.
    fn start_all_reduce_f32(
        &self,
        x: braid_cuda::DeviceViewMut<'_, f32>,
        stream: &braid_cuda::Stream,
    ) -> Result<(), String> {
        self.all_reduce_f32(x, ReduceKind::Sum, stream)
    }
    /// [`start_all_reduce_f32`](Self::start_all_reduce_f32) for bf16 (by
    /// default the plain [`all_reduce_bf16`](Self::all_reduce_bf16)).
    fn start_all_reduce_bf16(
        &self,
        x: braid_cuda::DeviceViewMut<'_, half::bf16>,
        stream: &braid_cuda::Stream,
    ) -> Result<(), String> {
        self.all_reduce_bf16(x, stream)
    }
    /// Orders `stream`'s later work after every sum
    /// [`start_all_reduce_f32`](Self::start_all_reduce_f32) started (by
    /// default nothing is left to wait for).
    fn wait_started(&self, _stream: &braid_cuda::Stream) -> Result<(), String> {
        Ok(())
    }
}

fn f64_refused() -> String {
    "this tensor-parallel group carries f32 only (f64 passes are the model's own checks)".into()
}

/// Checks the lengths of an all-gather or reduce-scatter.
pub fn check_split(what: &str, full: usize, local: usize, size: usize) -> Result<(), String> {
    match full == local * size {
        true => Ok(()),
        false => Err(format!(
            "{what}: {full} elements do not split into {size} slices of {local}"
        )),
    }
}

/// Ranks that are threads of one process: each holds a [`LocalGroup`]
/// handle with its rank.
pub struct LocalGroup {
    rank: usize,
    shared: Arc<Shared>,
}

struct Shared {
    size: usize,
    barrier: Barrier,
    /// Each rank's contribution to the operation under way.
    slots: Vec<Mutex<Vec<f64>>>,
}

impl LocalGroup {
    /// `size` handles, one per rank (rank `i` at index `i`).
    pub fn new(size: usize) -> Vec<LocalGroup> {
        let shared = Arc::new(Shared {
            size,
            barrier: Barrier::new(size),
            slots: (0..size).map(|_| Mutex::new(Vec::new())).collect(),
        });
        (0..size)
            .map(|rank| LocalGroup {
                rank,
                shared: shared.clone(),
            })
            .collect()
    }

    /// Runs `f` on every rank of a new group of `size`, each on a thread
    /// of its own, and returns their results in rank order (a rank's
    /// panic is raised again here).
    pub fn run<R: Send>(size: usize, f: impl Fn(LocalGroup) -> R + Sync) -> Vec<R> {
        let f = &f;
        std::thread::scope(|s| {
            let ranks: Vec<_> = LocalGroup::new(size)
                .into_iter()
                .map(|g| s.spawn(move || f(g)))
                .collect();
            ranks
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
                .collect()
        })
    }

    /// Publishes `mine`, waits for every rank's, and hands them to `f`
    /// in rank order; then waits until every rank has read them.
    fn exchange<R>(&self, mine: Vec<f64>, f: impl FnOnce(&[Vec<f64>]) -> R) -> R {
        *self.shared.slots[self.rank].lock().expect("slot") = mine;
        self.shared.barrier.wait();
        let all: Vec<Vec<f64>> = self
            .shared
            .slots
            .iter()
            .map(|s| s.lock().expect("slot").clone())
            .collect();
        let r = f(&all);
        self.shared.barrier.wait();
        r
    }

    fn all_reduce(&self, x: &mut [f64], op: ReduceKind) {
        let combined = self.exchange(x.to_vec(), |all| {
            let mut acc = all[0].clone();
            for other in &all[1..] {
                for (a, &b) in acc.iter_mut().zip(other) {
                    *a = match op {
                        ReduceKind::Sum => *a + b,
                        ReduceKind::Max => a.max(b),
                    };
                }
            }
            acc
        });
        x.copy_from_slice(&combined);
    }

    fn all_gather(&self, local: &[f64], full: &mut [f64]) -> Result<(), String> {
        check_split("all-gather", full.len(), local.len(), self.shared.size)?;
        let all = self.exchange(local.to_vec(), |all| all.concat());
        full.copy_from_slice(&all);
        Ok(())
    }

    fn reduce_scatter(&self, full: &[f64], local: &mut [f64]) -> Result<(), String> {
        check_split("reduce-scatter", full.len(), local.len(), self.shared.size)?;
        let mut sum = full.to_vec();
        self.all_reduce(&mut sum, ReduceKind::Sum);
        let n = local.len();
        local.copy_from_slice(&sum[self.rank * n..(self.rank + 1) * n]);
        Ok(())
    }
}

/// Runs `f` through an f64 copy of an f32 buffer.
fn via_f64(x: &mut [f32], f: impl FnOnce(&mut [f64]) -> Result<(), String>) -> Result<(), String> {
    let mut wide: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    f(&mut wide)?;
    for (o, w) in x.iter_mut().zip(wide) {
        *o = w as f32;
    }
    Ok(())
}

impl TensorComm for LocalGroup {
    fn size(&self) -> usize {
        self.shared.size
    }
    fn rank(&self) -> usize {
        self.rank
    }
    fn all_reduce_f32(&self, x: &mut [f32], op: ReduceKind) -> Result<(), String> {
        // Sums of f32 in f64, rounded once: no worse than f32 adds.
        via_f64(x, |w| {
            self.all_reduce(w, op);
            Ok(())
        })
    }
    fn all_gather_f32(&self, local: &[f32], full: &mut [f32]) -> Result<(), String> {
        let wide: Vec<f64> = local.iter().map(|&v| v as f64).collect();
        via_f64(full, |f| self.all_gather(&wide, f))
    }
    fn reduce_scatter_f32(&self, full: &[f32], local: &mut [f32]) -> Result<(), String> {
        let wide: Vec<f64> = full.iter().map(|&v| v as f64).collect();
        via_f64(local, |l| self.reduce_scatter(&wide, l))
    }
    fn all_reduce_f64(&self, x: &mut [f64], op: ReduceKind) -> Result<(), String> {
        self.all_reduce(x, op);
        Ok(())
    }
    fn all_gather_f64(&self, local: &[f64], full: &mut [f64]) -> Result<(), String> {
        self.all_gather(local, full)
    }
    fn reduce_scatter_f64(&self, full: &[f64], local: &mut [f64]) -> Result<(), String> {
        self.reduce_scatter(full, local)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_local_group_reduces_gathers_and_scatters_in_rank_order() {
        let out = LocalGroup::run(3, |g| {
            let r = g.rank() as f32;
            let mut x = [r, -r];
            g.all_reduce_f32(&mut x, ReduceKind::Sum).unwrap();
            let mut m = [r];
            g.all_reduce_f32(&mut m, ReduceKind::Max).unwrap();
            let mut full = [0.0; 6];
            g.all_gather_f32(&[r, r + 10.0], &mut full).unwrap();
            let mut local = [0.0; 2];
            g.reduce_scatter_f32(&[1.0, 2.0, 3.0, 4.0, 5.0, r], &mut local)
                .unwrap();
            assert!(g.all_gather_f32(&[1.0], &mut [0.0; 2]).is_err());
            (x, m, full, local)
        });
        for (rank, (x, m, full, local)) in out.into_iter().enumerate() {
            assert_eq!(x, [3.0, -3.0]);
            assert_eq!(m, [2.0]);
            assert_eq!(full, [0.0, 10.0, 1.0, 11.0, 2.0, 12.0]);
            let want = [[3.0, 6.0], [9.0, 12.0], [15.0, 3.0]][rank];
            assert_eq!(local, want);
        }
    }
}
