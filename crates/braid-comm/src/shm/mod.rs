//! The shared-memory backend, for ranks on one host.
//!
//! All-reduce has two paths. Small messages take the *latency path*: each
//! rank copies its data into its slot and every rank reduces all slots
//! itself, in rank order (one round, identical results everywhere). Large
//! messages take the *bandwidth path*, piece by piece: each rank copies a
//! piece into its slot, reduces its own 1/n of the piece from every slot
//! (reduce-scatter), then every rank copies the reduced parts out
//! (all-gather); the two halves of each slot alternate so that the next
//! piece's copy-in overlaps the previous piece's reads. The other
//! collectives are rounds of the same protocol ([`channel`]);
//! point-to-point messages use per-pair rings ([`rings`]).

pub mod channel;
pub mod flag;
pub mod parallel;
pub mod rings;
pub mod segment;

use crate::backend::{chunk_range, displacements, Backend, Ctx, Data};
use crate::error::{CommError, Result};
use crate::p2p_backend::P2pBackend;
use crate::setup::SetupCtx;
use braid_core::reduce;
use braid_core::{DType, ReduceOp};
use channel::{Channel, Layout};

/// Default bytes per slot half (`BRAID_SHM_HALF` overrides).
const DEFAULT_HALF: usize = 1 << 20;
/// Default bytes per slot half when each rank has helper threads.
const DEFAULT_HALF_THREADED: usize = 4 << 20;
/// Default bytes per point-to-point ring (`BRAID_SHM_RING` overrides).
const DEFAULT_RING: usize = 1 << 20;
/// All-reduces up to this size take the latency path.
const LATENCY_MAX: usize = 32 << 10;
/// With more ranks than cores, all-reduces above the latency path and up to
/// this size run as a ring over the point-to-point rings.
const OVERSUBSCRIBED_RING_MAX: usize = 8 << 20;

/// Input and output of an operation as raw views, so that an in-place
/// operation can read a piece of its buffer and later write the same piece.
struct Io {
    input: *const u8,
    output: *mut u8,
    len: usize,
}

impl Io {
    fn new(data: Data) -> Io {
        match data {
            Data::InPlace(b) => Io {
                input: b.as_ptr(),
                output: b.as_mut_ptr(),
                len: b.len(),
            },
            Data::OutOfPlace { send, recv } => Io {
                input: send.as_ptr(),
                output: recv.as_mut_ptr(),
                len: send.len(),
            },
        }
    }

    fn input(&self, r: std::ops::Range<usize>) -> &[u8] {
        assert!(r.end <= self.len);
        // SAFETY: in bounds of the caller's input buffer, which outlives the
        // operation; no mutable view of these bytes is alive while this one
        // is used (pieces are read before their output is written).
        unsafe { std::slice::from_raw_parts(self.input.add(r.start), r.len()) }
    }

    #[allow(clippy::mut_from_ref)]
    fn output(&self, r: std::ops::Range<usize>) -> &mut [u8] {
        assert!(r.end <= self.len);
        // SAFETY: in bounds of the caller's output buffer; each call's view
        // is dropped before another view of the same bytes is made.
        unsafe { std::slice::from_raw_parts_mut(self.output.add(r.start), r.len()) }
    }
}

fn env_bytes(name: &str, default: usize) -> Result<usize> {
    match std::env::var(name) {
        Ok(v) if !v.trim().is_empty() => v
            .trim()
            .parse::<usize>()
            .ok()
            .filter(|b| *b >= 4096)
            .map(|b| b.div_ceil(4096) * 4096)
            .ok_or_else(|| {
                CommError::Setup(format!(
                    "{name}={v:?}: expected a number of bytes, at least 4096"
                ))
            }),
        _ => Ok(default),
    }
}

/// The shm backend of one communicator.
pub struct ShmBackend {
    ch: Channel,
    /// Point-to-point traffic, and the ring algorithms over it.
    rings: P2pBackend<rings::ShmRings>,
    helpers: parallel::Helpers,
    /// More ranks than cores on this host.
    oversubscribed: bool,
}

impl ShmBackend {
    /// Maps the communicator's segment (every rank must be on this host).
    pub fn create(s: &SetupCtx) -> Result<ShmBackend> {
        let n = s.peers.len();
        let helpers = parallel::Helpers::for_ranks(n);
        // Bigger pieces when several threads share each piece's work.
        let default_half = if helpers.threads() > 1 {
            DEFAULT_HALF_THREADED
        } else {
            DEFAULT_HALF
        };
        let half = match s.shm_half {
            Some(h) => h.max(4096).div_ceil(4096) * 4096,
            None => env_bytes(braid_core::env::BRAID_SHM_HALF, default_half)?,
        };
        let layout = Layout {
            n,
            half,
            ring: env_bytes(braid_core::env::BRAID_SHM_RING, DEFAULT_RING)?,
        };
        let seg = segment::establish(
            s.store,
            s.rank,
            n,
            s.run_id,
            s.id,
            layout.total(),
            s.timeout,
        )?;
        let seg = std::sync::Arc::new(seg);
        let ch = Channel::new(seg.clone(), layout, s.rank);
        let rings = rings::ShmRings::new(seg, layout, s.rank, ch.policy);
        let cores = std::thread::available_parallelism()
            .map(|c| c.get())
            .unwrap_or(1);
        Ok(ShmBackend {
            ch,
            rings: P2pBackend::new(rings, Some(crate::tuning::Algo::Ring)),
            helpers,
            oversubscribed: n > cores,
        })
    }

    fn n(&self) -> usize {
        self.ch.layout.n
    }

    fn rank(&self) -> usize {
        self.ch.rank
    }

    fn half(&self) -> usize {
        self.ch.layout.half
    }

    /// Reduces all ranks' `io` into the output of `to` (every rank when
    /// `None`), through the latency path.
    fn reduce_small(
        &mut self,
        ctx: &Ctx,
        io: &Io,
        dtype: DType,
        op: ReduceOp,
        to: Option<usize>,
    ) -> Result<()> {
        let (n, len) = (self.n(), io.len);
        let (k, h) = self.ch.begin(ctx)?;
        self.ch
            .own_slot(h, 0..len)
            .copy_from_slice(io.input(0..len));
        self.ch.post(k);
        if to.is_none_or(|r| r == self.rank()) {
            self.ch.wait_all(ctx, k)?;
            let srcs: Vec<&[u8]> = (0..n).map(|r| self.ch.slot(r, h, 0..len)).collect();
            reduce::reduce_many(dtype, op, io.output(0..len), &srcs, Some(n), false);
        }
        self.ch.finish(k, h);
        Ok(())
    }

    /// Reduce-scatter then all-gather over pieces of a slot half; with
    /// `to = Some(root)` only the root gathers.
    fn reduce_large(
        &mut self,
        ctx: &Ctx,
        io: &Io,
        dtype: DType,
        op: ReduceOp,
        to: Option<usize>,
    ) -> Result<()> {
        let (n, rank, es) = (self.n(), self.rank(), dtype.size());
        let piece = (self.half() / es) * es;
        let mut off = 0;
        while off < io.len {
            let p = piece.min(io.len - off);
            let elems = p / es;
            let sub = |j: usize| {
                let r = chunk_range(elems, n, j);
                r.start * es..r.end * es
            };
            let (ka, h) = self.ch.begin(ctx)?;
            let mine = sub(rank);
            // Peers need every part of this piece but our own: copy the rest.
            self.helpers.copy(
                self.ch.own_slot(h, 0..mine.start),
                io.input(off..off + mine.start),
            );
            self.helpers.copy(
                self.ch.own_slot(h, mine.end..p),
                io.input(off + mine.end..off + p),
            );
            self.ch.post(ka);
            self.ch.wait_all(ctx, ka)?;
            {
                // Our part: our own input (read in place) and every peer's.
                let mut srcs: Vec<&[u8]> = Vec::with_capacity(n);
                srcs.push(io.input(off + mine.start..off + mine.end));
                srcs.extend(
                    (0..n)
                        .filter(|j| *j != rank)
                        .map(|j| self.ch.slot(j, h, mine.clone())),
                );
                self.helpers
                    .reduce(dtype, op, self.ch.own_slot(h, mine.clone()), &srcs, Some(n));
            }
            let kb = self.ch.continue_round();
            self.ch.post(kb);
            if to.is_none_or(|r| r == rank) {
                self.ch.wait_all(ctx, kb)?;
                for j in 0..n {
                    let sj = sub(j);
                    self.helpers.copy(
                        io.output(off + sj.start..off + sj.end),
                        self.ch.slot(j, h, sj),
                    );
                }
            }
            self.ch.finish(kb, h);
            off += p;
        }
        Ok(())
    }

    fn reduce_any(
        &mut self,
        ctx: &Ctx,
        data: Data,
        dtype: DType,
        op: ReduceOp,
        to: Option<usize>,
    ) -> Result<()> {
        let io = Io::new(data);
        if io.len == 0 {
            return Ok(());
        }
        if io.len <= LATENCY_MAX.min(self.half()) {
            self.reduce_small(ctx, &io, dtype, op, to)
        } else {
            self.reduce_large(ctx, &io, dtype, op, to)
        }
    }
}

/// `len - off`, clamped to `[0, max]`.
fn window(len: usize, off: usize, max: usize) -> usize {
    len.saturating_sub(off).min(max)
}

impl Backend for ShmBackend {
    fn name(&self) -> &'static str {
        "shm"
    }

    fn all_reduce(&mut self, ctx: &Ctx, data: Data, dtype: DType, op: ReduceOp) -> Result<()> {
        // With more ranks than cores, rounds in which every rank waits for
        // every other cost a round of context switches each; a ring, where
        // each rank waits only for its neighbour, pipelines better.
        if self.oversubscribed && (LATENCY_MAX + 1..=OVERSUBSCRIBED_RING_MAX).contains(&data.len())
        {
            return self.rings.all_reduce(ctx, data, dtype, op);
        }
        self.reduce_any(ctx, data, dtype, op, None)
    }

    fn reduce(
        &mut self,
        ctx: &Ctx,
        data: Data,
        dtype: DType,
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        // Non-roots only contribute their input; their output (possibly an
        // empty slice) is never written.
        self.reduce_any(ctx, data, dtype, op, Some(root))
    }

    fn broadcast(&mut self, ctx: &Ctx, data: Data, root: usize) -> Result<()> {
        let rank = self.rank();
        let io = Io::new(data);
        if rank == root && !std::ptr::eq(io.input, io.output) {
            io.output(0..io.len).copy_from_slice(io.input(0..io.len));
        }
        let mut off = 0;
        while off < io.len {
            let p = window(io.len, off, self.half());
            let (k, h) = self.ch.begin(ctx)?;
            if rank == root {
                self.ch
                    .own_slot(h, 0..p)
                    .copy_from_slice(io.input(off..off + p));
                self.ch.post(k);
            } else {
                self.ch.wait_for(ctx, root, k)?;
                io.output(off..off + p)
                    .copy_from_slice(self.ch.slot(root, h, 0..p));
            }
            self.ch.finish(k, h);
            off += p;
        }
        Ok(())
    }

    fn all_gather_v(
        &mut self,
        ctx: &Ctx,
        send: &[u8],
        recv: &mut [u8],
        counts: &[usize],
    ) -> Result<()> {
        let (n, rank, half) = (self.n(), self.rank(), self.half());
        let disp = displacements(counts);
        recv[disp[rank]..disp[rank] + counts[rank]].copy_from_slice(send);
        let max = counts.iter().copied().max().unwrap_or(0);
        let mut off = 0;
        while off < max {
            let (k, h) = self.ch.begin(ctx)?;
            let mine = window(counts[rank], off, half);
            if mine > 0 {
                self.ch
                    .own_slot(h, 0..mine)
                    .copy_from_slice(&send[off..off + mine]);
            }
            self.ch.post(k);
            for j in (0..n).filter(|j| *j != rank) {
                let pj = window(counts[j], off, half);
                if pj > 0 {
                    self.ch.wait_for(ctx, j, k)?;
                    recv[disp[j] + off..disp[j] + off + pj].copy_from_slice(self.ch.slot(
                        j,
                        h,
                        0..pj,
                    ));
                }
            }
            self.ch.finish(k, h);
            off += half;
        }
        Ok(())
    }

    fn reduce_scatter(
        &mut self,
        ctx: &Ctx,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        let (n, rank, es) = (self.n(), self.rank(), dtype.size());
        let c = recv.len();
        let q_max = (self.half() / n / es).max(1) * es;
        let mut off = 0;
        while off < c {
            let q = window(c, off, q_max);
            let (k, h) = self.ch.begin(ctx)?;
            for j in 0..n {
                self.ch
                    .own_slot(h, j * q..(j + 1) * q)
                    .copy_from_slice(&send[j * c + off..j * c + off + q]);
            }
            self.ch.post(k);
            self.ch.wait_all(ctx, k)?;
            let srcs: Vec<&[u8]> = (0..n)
                .map(|i| self.ch.slot(i, h, rank * q..(rank + 1) * q))
                .collect();
            reduce::reduce_many(dtype, op, &mut recv[off..off + q], &srcs, Some(n), false);
            self.ch.finish(k, h);
            off += q;
        }
        Ok(())
    }

    fn all_to_all_v(
        &mut self,
        ctx: &Ctx,
        send: &[u8],
        sc: &[usize],
        recv: &mut [u8],
        rc: &[usize],
    ) -> Result<()> {
        let (n, rank) = (self.n(), self.rank());
        // Round 0: everyone learns every rank's send counts, to agree on the
        // number of rounds and to catch inconsistent counts.
        let (k, h) = self.ch.begin(ctx)?;
        let mine: Vec<u8> = sc.iter().flat_map(|c| (*c as u64).to_le_bytes()).collect();
        self.ch.own_slot(h, 0..8 * n).copy_from_slice(&mine);
        self.ch.post(k);
        self.ch.wait_all(ctx, k)?;
        let mut max = 0;
        for (i, &expect) in rc.iter().enumerate() {
            let row = self.ch.slot(i, h, 0..8 * n);
            let counts: Vec<usize> = row
                .chunks_exact(8)
                .map(|b| u64::from_le_bytes(b.try_into().expect("8")) as usize)
                .collect();
            if counts[rank] != expect {
                self.ch.finish(k, h);
                return Err(CommError::Mismatch(format!(
                    "rank {rank}: all_to_all #{}: rank {i} sends {} bytes to this rank, which expects {expect}",
                    ctx.seq, counts[rank]
                )));
            }
            max = max.max(counts.into_iter().max().unwrap_or(0));
        }
        self.ch.finish(k, h);
        let sd = displacements(sc);
        let rd = displacements(rc);
        let q = self.half() / n;
        let mut off = 0;
        while off < max {
            let (k, h) = self.ch.begin(ctx)?;
            for j in 0..n {
                let p = window(sc[j], off, q);
                if p > 0 {
                    self.ch
                        .own_slot(h, j * q..j * q + p)
                        .copy_from_slice(&send[sd[j] + off..sd[j] + off + p]);
                }
            }
            self.ch.post(k);
            for i in 0..n {
                let p = window(rc[i], off, q);
                if p > 0 {
                    self.ch.wait_for(ctx, i, k)?;
                    recv[rd[i] + off..rd[i] + off + p].copy_from_slice(self.ch.slot(
                        i,
                        h,
                        rank * q..rank * q + p,
                    ));
                }
            }
            self.ch.finish(k, h);
            off += q;
        }
        Ok(())
    }

    fn gather(&mut self, ctx: &Ctx, send: &[u8], recv: &mut [u8], root: usize) -> Result<()> {
        let (n, rank, half) = (self.n(), self.rank(), self.half());
        let len = send.len();
        if rank == root {
            recv[rank * len..(rank + 1) * len].copy_from_slice(send);
        }
        let mut off = 0;
        while off < len {
            let p = window(len, off, half);
            let (k, h) = self.ch.begin(ctx)?;
            self.ch
                .own_slot(h, 0..p)
                .copy_from_slice(&send[off..off + p]);
            self.ch.post(k);
            if rank == root {
                for j in (0..n).filter(|j| *j != rank) {
                    self.ch.wait_for(ctx, j, k)?;
                    recv[j * len + off..j * len + off + p].copy_from_slice(self.ch.slot(
                        j,
                        h,
                        0..p,
                    ));
                }
            }
            self.ch.finish(k, h);
            off += p;
        }
        Ok(())
    }

    fn scatter(&mut self, ctx: &Ctx, send: &[u8], recv: &mut [u8], root: usize) -> Result<()> {
        let (n, rank) = (self.n(), self.rank());
        let len = recv.len();
        if rank == root {
            recv.copy_from_slice(&send[rank * len..(rank + 1) * len]);
        }
        let q = self.half() / n;
        let mut off = 0;
        while off < len {
            let p = window(len, off, q);
            let (k, h) = self.ch.begin(ctx)?;
            if rank == root {
                for j in 0..n {
                    self.ch
                        .own_slot(h, j * q..j * q + p)
                        .copy_from_slice(&send[j * len + off..j * len + off + p]);
                }
                self.ch.post(k);
            } else {
                self.ch.wait_for(ctx, root, k)?;
                recv[off..off + p].copy_from_slice(self.ch.slot(root, h, rank * q..rank * q + p));
            }
            self.ch.finish(k, h);
            off += p;
        }
        Ok(())
    }

    fn send(&mut self, ctx: &Ctx, buf: &[u8], peer: usize, tag: u64) -> Result<()> {
        self.rings.send(ctx, buf, peer, tag)
    }

    fn recv(&mut self, ctx: &Ctx, buf: &mut [u8], peer: usize, tag: u64) -> Result<()> {
        self.rings.recv(ctx, buf, peer, tag)
    }

    fn send_recv(
        &mut self,
        ctx: &Ctx,
        send: &[u8],
        to: usize,
        recv: &mut [u8],
        from: usize,
        tag: u64,
    ) -> Result<()> {
        self.rings.send_recv(ctx, send, to, recv, from, tag)
    }

    fn barrier(&mut self, ctx: &Ctx) -> Result<()> {
        let (k, h) = self.ch.begin(ctx)?;
        self.ch.post(k);
        self.ch.wait_all(ctx, k)?;
        self.ch.finish(k, h);
        Ok(())
    }
}
