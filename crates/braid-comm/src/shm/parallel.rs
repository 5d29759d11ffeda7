//! Helper threads for one rank's share of large shared-memory collectives.
//!
//! When the host has more cores than ranks, a rank's copies and reductions
//! are split across `cores / ranks` threads (`BRAID_SHM_THREADS`
//! overrides), so that a 4-rank all-reduce on a 16-core host uses all 16
//! cores' memory bandwidth. With one thread per rank (the default when
//! ranks fill the cores) nothing changes.

use braid_core::reduce;
use braid_core::{DType, ReduceOp};
use rayon::prelude::*;

/// Most helper threads per rank unless `BRAID_SHM_THREADS` asks for more.
const MAX_DEFAULT_THREADS: usize = 3;

/// Below this many bytes a copy or reduction stays on the calling thread.
const MIN_PARALLEL: usize = 256 << 10;

/// A rank's helper threads (none when it works alone).
pub struct Helpers {
    pool: Option<rayon::ThreadPool>,
    threads: usize,
}

impl Helpers {
    /// Helpers for a rank sharing the host with `local_ranks - 1` others.
    pub fn for_ranks(local_ranks: usize) -> Helpers {
        let cores = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1);
        let wanted = std::env::var(braid_core::env::BRAID_SHM_THREADS)
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            // Measured on a 16-core host with 4 ranks: 3 threads per rank
            // beat 2 and 4 (more threads fight over memory bandwidth).
            .unwrap_or((cores / local_ranks.max(1)).min(MAX_DEFAULT_THREADS))
            .clamp(1, 16);
        Helpers::with_threads(wanted)
    }

    /// Exactly `threads` threads (1: none).
    pub fn with_threads(threads: usize) -> Helpers {
        let pool = if threads > 1 {
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .thread_name(|i| format!("braid-shm-{i}"))
                .build()
                .ok()
        } else {
            None
        };
        Helpers {
            threads: if pool.is_some() { threads } else { 1 },
            pool,
        }
    }

    /// Number of threads doing this rank's work.
    pub fn threads(&self) -> usize {
        self.threads
    }

    fn chunk(&self, len: usize, align: usize) -> Option<usize> {
        if self.pool.is_none() || len < MIN_PARALLEL {
            return None;
        }
        Some(len.div_ceil(self.threads).div_ceil(align).max(1) * align)
    }

    /// `dst.copy_from_slice(src)`, split across the helpers.
    pub fn copy(&self, dst: &mut [u8], src: &[u8]) {
        match (self.chunk(dst.len(), 64), &self.pool) {
            (Some(c), Some(pool)) => pool.install(|| {
                dst.par_chunks_mut(c)
                    .zip(src.par_chunks(c))
                    .for_each(|(d, s)| d.copy_from_slice(s));
            }),
            _ => dst.copy_from_slice(src),
        }
    }

    /// [`reduce::reduce_many`] (without `include_dst`), split across the
    /// helpers on element boundaries.
    pub fn reduce(
        &self,
        dtype: DType,
        op: ReduceOp,
        dst: &mut [u8],
        srcs: &[&[u8]],
        avg_divisor: Option<usize>,
    ) {
        let align = dtype.size() * 64;
        match (self.chunk(dst.len(), align), &self.pool) {
            (Some(c), Some(pool)) => pool.install(|| {
                dst.par_chunks_mut(c).enumerate().for_each(|(i, d)| {
                    let range = i * c..i * c + d.len();
                    let parts: Vec<&[u8]> = srcs.iter().map(|s| &s[range.clone()]).collect();
                    reduce::reduce_many(dtype, op, d, &parts, avg_divisor, false);
                });
            }),
            _ => reduce::reduce_many(dtype, op, dst, srcs, avg_divisor, false),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threaded_copy_and_reduce_match_the_plain_kernels() {
        let helpers = Helpers::with_threads(3);
        assert_eq!(helpers.threads(), 3);
        let n = (1 << 20) + 13;
        let a: Vec<f32> = (0..n).map(|i| (i % 97) as f32).collect();
        let b: Vec<f32> = (0..n).map(|i| (i % 13) as f32 - 6.0).collect();
        let (ab, bb): (&[u8], &[u8]) = (bytemuck::cast_slice(&a), bytemuck::cast_slice(&b));
        let mut copied = vec![0u8; ab.len()];
        helpers.copy(&mut copied, ab);
        assert_eq!(copied, ab);
        for op in ReduceOp::ALL {
            let mut threaded = vec![0u8; ab.len()];
            helpers.reduce(DType::F32, op, &mut threaded, &[ab, bb], Some(2));
            let mut plain = vec![0u8; ab.len()];
            reduce::reduce_many(DType::F32, op, &mut plain, &[ab, bb], Some(2), false);
            assert_eq!(threaded, plain, "{op}");
        }
    }
}
