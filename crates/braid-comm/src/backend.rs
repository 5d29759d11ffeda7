//! The contract between the [`Communicator`](crate::Communicator) and a
//! backend: byte-level collectives on host memory.
//!
//! The communicator checks arguments, converts typed slices to bytes,
//! numbers the operations and serialises them; a backend only moves and
//! reduces bytes. Counts in this trait are in **bytes** except where a
//! `dtype` is given for reductions.

use crate::error::{CommError, Result};
use crate::health::Health;
use braid_core::{DType, ReduceOp};
use std::time::{Duration, Instant};

/// What every wait inside an operation needs to know.
pub struct Ctx<'a> {
    /// This rank.
    pub rank: usize,
    /// Operation name, for errors.
    pub op: &'static str,
    /// Sequence number of the operation on its communicator.
    pub seq: u64,
    /// When the operation started.
    pub started: Instant,
    /// When it must have finished.
    pub deadline: Instant,
    /// The communicator's abort flag.
    pub health: &'a Health,
}

impl Ctx<'_> {
    /// Fails if the communicator is aborted or the deadline has passed;
    /// `waiting_for` names the ranks the caller is waiting on.
    #[inline]
    pub fn check(&self, waiting_for: impl FnOnce() -> Vec<usize>) -> Result<()> {
        if self.health.is_aborted() {
            return Err(self.aborted());
        }
        if Instant::now() >= self.deadline {
            return Err(self.timeout(waiting_for()));
        }
        Ok(())
    }

    /// The error for an aborted communicator.
    pub fn aborted(&self) -> CommError {
        CommError::Aborted {
            rank: self.rank,
            reason: format!(
                "{} (seen during {} #{})",
                self.health.reason(),
                self.op,
                self.seq
            ),
        }
    }

    /// The error for an expired deadline.
    pub fn timeout(&self, waiting_for: Vec<usize>) -> CommError {
        CommError::Timeout {
            rank: self.rank,
            op: self.op,
            seq: self.seq,
            waiting_for,
            waited: self.started.elapsed(),
            diagnosis: None,
        }
    }

    /// The error for a failed peer.
    pub fn peer_failed(&self, peer: usize, detail: impl Into<String>) -> CommError {
        CommError::PeerFailed {
            rank: self.rank,
            op: self.op,
            seq: self.seq,
            peer,
            detail: detail.into(),
        }
    }

    /// Time left before the deadline.
    pub fn remaining(&self) -> Duration {
        self.deadline.saturating_duration_since(Instant::now())
    }
}

/// A buffer that is updated in place, or read from one slice and written to
/// another.
pub enum Data<'a> {
    /// Input and output are the same memory.
    InPlace(&'a mut [u8]),
    /// Input from `send`, output to `recv` (same length).
    OutOfPlace {
        /// Input.
        send: &'a [u8],
        /// Output.
        recv: &'a mut [u8],
    },
}

impl<'a> Data<'a> {
    /// Number of bytes.
    pub fn len(&self) -> usize {
        match self {
            Data::InPlace(b) => b.len(),
            Data::OutOfPlace { recv, .. } => recv.len(),
        }
    }

    /// Whether there are no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The input bytes.
    pub fn input(&self) -> &[u8] {
        match self {
            Data::InPlace(b) => b,
            Data::OutOfPlace { send, .. } => send,
        }
    }

    /// Turns an out-of-place operation into an in-place one by copying the
    /// input to the output first.
    pub fn into_in_place(self) -> &'a mut [u8] {
        match self {
            Data::InPlace(b) => b,
            Data::OutOfPlace { send, recv } => {
                recv.copy_from_slice(send);
                recv
            }
        }
    }
}

/// A collective engine for one communicator.
pub trait Backend: Send {
    /// Name shown by tools (`shm`, `tcp`, `hier`).
    fn name(&self) -> &'static str;

    /// Element-wise reduction of every rank's buffer, result on every rank.
    fn all_reduce(&mut self, ctx: &Ctx, data: Data, dtype: DType, op: ReduceOp) -> Result<()>;

    /// Element-wise reduction with the result on `root` only; other ranks'
    /// outputs are left untouched.
    fn reduce(
        &mut self,
        ctx: &Ctx,
        data: Data,
        dtype: DType,
        op: ReduceOp,
        root: usize,
    ) -> Result<()>;

    /// `root`'s input copied to every rank's output.
    fn broadcast(&mut self, ctx: &Ctx, data: Data, root: usize) -> Result<()>;

    /// Every rank's `send` (of `counts[rank]` bytes) concatenated in rank
    /// order into every rank's `recv`.
    fn all_gather_v(
        &mut self,
        ctx: &Ctx,
        send: &[u8],
        recv: &mut [u8],
        counts: &[usize],
    ) -> Result<()>;

    /// Reduction of `send` (n equal blocks) with block `rank` of the result
    /// written to `recv`.
    fn reduce_scatter(
        &mut self,
        ctx: &Ctx,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()>;

    /// Block `j` of `send` (`send_counts[j]` bytes) goes to rank `j`; block
    /// `i` of `recv` (`recv_counts[i]` bytes) comes from rank `i`.
    fn all_to_all_v(
        &mut self,
        ctx: &Ctx,
        send: &[u8],
        send_counts: &[usize],
        recv: &mut [u8],
        recv_counts: &[usize],
    ) -> Result<()>;

    /// Every rank's `send` concatenated into `recv` on `root`.
    fn gather(&mut self, ctx: &Ctx, send: &[u8], recv: &mut [u8], root: usize) -> Result<()>;

    /// Block `j` of `root`'s `send` to rank `j`'s `recv`.
    fn scatter(&mut self, ctx: &Ctx, send: &[u8], recv: &mut [u8], root: usize) -> Result<()>;

    /// Tagged point-to-point send.
    fn send(&mut self, ctx: &Ctx, buf: &[u8], peer: usize, tag: u64) -> Result<()>;

    /// Tagged point-to-point receive of exactly `buf.len()` bytes.
    fn recv(&mut self, ctx: &Ctx, buf: &mut [u8], peer: usize, tag: u64) -> Result<()>;

    /// Sends `send` to `to` while receiving `recv` from `from`, both with
    /// `tag`, without deadlocking when every rank does the same.
    fn send_recv(
        &mut self,
        ctx: &Ctx,
        send: &[u8],
        to: usize,
        recv: &mut [u8],
        from: usize,
        tag: u64,
    ) -> Result<()>;

    /// Returns once every rank has entered the barrier.
    fn barrier(&mut self, ctx: &Ctx) -> Result<()>;
}

/// Runs `f` on an f32 copy of a 16-bit float buffer and rounds the result
/// back, so that algorithms which combine partial results step by step
/// still accumulate f16/bf16 in f32; other dtypes run on `buf` directly.
pub fn with_f32_accumulation(
    buf: &mut [u8],
    dtype: DType,
    f: impl FnOnce(&mut [u8], DType) -> Result<()>,
) -> Result<()> {
    if !matches!(dtype, DType::F16 | DType::BF16) {
        return f(buf, dtype);
    }
    let mut wide = vec![0f32; buf.len() / 2];
    braid_core::reduce::widen_to_f32(dtype, buf, &mut wide);
    f(bytemuck::cast_slice_mut(&mut wide), DType::F32)?;
    braid_core::reduce::narrow_from_f32(dtype, &wide, buf);
    Ok(())
}

/// Chunk `j` of `n` over `len` units: the half-open unit range, as even as
/// possible (the first `len % n` chunks get one more).
pub fn chunk_range(len: usize, n: usize, j: usize) -> std::ops::Range<usize> {
    let base = len / n;
    let extra = len % n;
    let start = j * base + j.min(extra);
    let size = base + usize::from(j < extra);
    start..start + size
}

/// Byte offsets of blocks with the given sizes.
pub fn displacements(counts: &[usize]) -> Vec<usize> {
    let mut d = Vec::with_capacity(counts.len());
    let mut acc = 0;
    for c in counts {
        d.push(acc);
        acc += c;
    }
    d
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_everything_once() {
        for len in [0, 1, 7, 64, 101] {
            for n in 1..9 {
                let mut next = 0;
                for j in 0..n {
                    let r = chunk_range(len, n, j);
                    assert_eq!(r.start, next);
                    next = r.end;
                }
                assert_eq!(next, len);
            }
        }
    }
}
