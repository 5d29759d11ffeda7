//! Collective algorithms over point-to-point messages, used by the tcp
//! backend: recursive doubling and a pipelined ring for all-reduce,
//! binomial trees for reduce and broadcast, rings for all-gather and
//! reduce-scatter, pairwise exchange for all-to-all, dissemination barrier.

use crate::backend::{chunk_range, displacements, Backend, Ctx, Data};
use crate::error::Result;
use crate::tcp::TcpMesh;
use crate::transport::{Recv, Send, Transport};
use crate::tuning::{self, Algo};
use braid_core::reduce::{self, divide};
use braid_core::{DType, ReduceOp};

/// Ring steps move data in segments of this many bytes, so the reduction of
/// one segment overlaps the arrival of the next.
const SEGMENT: usize = 1 << 20;

/// The algorithms above over a [`Transport`]: the tcp backend (over
/// [`TcpMesh`]), and shared memory's ring path (over shared-memory rings).
pub struct P2pBackend<T: Transport = TcpMesh> {
    mesh: T,
    forced: Option<Algo>,
    /// Receive buffer reused across operations (no allocation, and so no
    /// page faults, on the hot path).
    scratch: Vec<u8>,
}

impl<T: Transport> P2pBackend<T> {
    /// Wraps a connected transport.
    pub fn new(mesh: T, forced: Option<Algo>) -> Self {
        P2pBackend {
            mesh,
            forced,
            scratch: Vec::new(),
        }
    }

    fn rank(&self) -> usize {
        self.mesh.rank()
    }

    fn size(&self) -> usize {
        self.mesh.size()
    }

    fn sendrecv(
        &mut self,
        ctx: &Ctx,
        to: usize,
        send: &[u8],
        from: usize,
        recv: &mut [u8],
    ) -> Result<()> {
        self.mesh.exchange(
            ctx,
            &mut [Send {
                peer: to,
                data: send,
            }],
            &mut [Recv {
                peer: from,
                data: recv,
            }],
        )
    }

    fn send_only(&mut self, ctx: &Ctx, to: usize, send: &[u8]) -> Result<()> {
        self.mesh.exchange(
            ctx,
            &mut [Send {
                peer: to,
                data: send,
            }],
            &mut [],
        )
    }

    fn recv_only(&mut self, ctx: &Ctx, from: usize, recv: &mut [u8]) -> Result<()> {
        self.mesh.exchange(
            ctx,
            &mut [],
            &mut [Recv {
                peer: from,
                data: recv,
            }],
        )
    }

    /// In-place all-reduce of a dtype that is reduced natively (not f16/bf16).
    fn all_reduce_native(
        &mut self,
        ctx: &Ctx,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        let n = self.size();
        if n > 1 && !buf.is_empty() {
            match tuning::all_reduce_algo(buf.len(), n, self.forced) {
                Algo::Tree => self.recursive_doubling(ctx, buf, dtype, op)?,
                Algo::Ring => self.ring_all_reduce(ctx, buf, dtype, op)?,
            }
        }
        if op == ReduceOp::Avg {
            divide(dtype, buf, n);
        }
        Ok(())
    }

    /// Recursive doubling; ranks beyond the largest power of two first fold
    /// their data into a partner and get the result back at the end.
    fn recursive_doubling(
        &mut self,
        ctx: &Ctx,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        let (rank, n) = (self.rank(), self.size());
        let p2 = 1usize << (usize::BITS - 1 - n.leading_zeros());
        let rem = n - p2;
        let mut tmp = vec![0u8; buf.len()];
        let newrank = if rank < 2 * rem {
            if rank % 2 == 0 {
                self.send_only(ctx, rank + 1, buf)?;
                None
            } else {
                self.recv_only(ctx, rank - 1, &mut tmp)?;
                reduce::reduce_into(dtype, op, buf, &tmp);
                Some(rank / 2)
            }
        } else {
            Some(rank - rem)
        };
        if let Some(nr) = newrank {
            let real = |v: usize| if v < rem { v * 2 + 1 } else { v + rem };
            let mut mask = 1;
            while mask < p2 {
                let partner = real(nr ^ mask);
                self.sendrecv(ctx, partner, buf, partner, &mut tmp)?;
                // Lower rank's data first so both partners compute the
                // bitwise-identical result.
                if partner < rank {
                    reduce::reduce_into(dtype, op, &mut tmp, buf);
                    buf.copy_from_slice(&tmp);
                } else {
                    reduce::reduce_into(dtype, op, buf, &tmp);
                }
                mask <<= 1;
            }
        }
        if rank < 2 * rem {
            if rank % 2 == 0 {
                self.recv_only(ctx, rank + 1, buf)?;
            } else {
                self.send_only(ctx, rank - 1, buf)?;
            }
        }
        Ok(())
    }

    /// Ring reduce-scatter then ring all-gather, in segments.
    fn ring_all_reduce(
        &mut self,
        ctx: &Ctx,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        let (rank, n) = (self.rank(), self.size());
        let es = dtype.size();
        let count = buf.len() / es;
        let chunk = |j: usize| {
            let r = chunk_range(count, n, j);
            r.start * es..r.end * es
        };
        let mut tmp = std::mem::take(&mut self.scratch);
        tmp.resize(tmp.len().max(chunk(0).len().min(SEGMENT)), 0);
        let result = self.ring_steps(ctx, buf, &chunk, rank, n, &mut tmp, dtype, op);
        self.scratch = tmp;
        result
    }

    #[allow(clippy::too_many_arguments)]
    fn ring_steps(
        &mut self,
        ctx: &Ctx,
        buf: &mut [u8],
        chunk: &dyn Fn(usize) -> std::ops::Range<usize>,
        rank: usize,
        n: usize,
        tmp: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        let right = (rank + 1) % n;
        let left = (rank + n - 1) % n;
        for s in 0..n - 1 {
            let send_c = chunk((rank + n - s) % n);
            let recv_c = chunk((rank + 2 * n - s - 1) % n);
            self.segmented(
                ctx,
                buf,
                send_c,
                recv_c,
                right,
                left,
                tmp,
                Some((dtype, op)),
            )?;
        }
        for s in 0..n - 1 {
            let send_c = chunk((rank + 1 + n - s) % n);
            let recv_c = chunk((rank + n - s) % n);
            self.segmented(ctx, buf, send_c, recv_c, right, left, tmp, None)?;
        }
        Ok(())
    }

    /// Sends `buf[send_c]` to `right` while receiving `recv_c` from `left`,
    /// segment by segment; received segments are reduced into `buf` when
    /// `reduce_with` is given, else stored.
    #[allow(clippy::too_many_arguments)]
    fn segmented(
        &mut self,
        ctx: &Ctx,
        buf: &mut [u8],
        send_c: std::ops::Range<usize>,
        recv_c: std::ops::Range<usize>,
        right: usize,
        left: usize,
        tmp: &mut [u8],
        reduce_with: Option<(DType, ReduceOp)>,
    ) -> Result<()> {
        let es = reduce_with.map(|(d, _)| d.size()).unwrap_or(1);
        let seg = (SEGMENT / es).max(1) * es;
        let segments = send_c.len().max(recv_c.len()).div_ceil(seg).max(1);
        for k in 0..segments {
            let s_range = clamp(&send_c, k * seg, seg);
            let r_range = clamp(&recv_c, k * seg, seg);
            // Empty windows past the first segment carry no message.
            let send_any = !s_range.is_empty() || k == 0;
            let recv_any = !r_range.is_empty() || k == 0;
            let (send, recv): (&[u8], &mut [u8]) = match reduce_with {
                Some(_) => (&buf[s_range], &mut tmp[..r_range.len()]),
                None => disjoint(buf, s_range, r_range.clone()),
            };
            let mut sends: Vec<Send> = send_any
                .then_some(Send {
                    peer: right,
                    data: send,
                })
                .into_iter()
                .collect();
            let mut recvs: Vec<Recv> = recv_any
                .then_some(Recv {
                    peer: left,
                    data: recv,
                })
                .into_iter()
                .collect();
            self.mesh.exchange(ctx, &mut sends, &mut recvs)?;
            if let Some((dtype, op)) = reduce_with {
                reduce::reduce_into(dtype, op, &mut buf[r_range.clone()], &tmp[..r_range.len()]);
            }
        }
        Ok(())
    }
}

/// Views of two disjoint ranges of one buffer: one to read, one to write.
fn disjoint(
    buf: &mut [u8],
    read: std::ops::Range<usize>,
    write: std::ops::Range<usize>,
) -> (&[u8], &mut [u8]) {
    if write.is_empty() {
        return (&buf[read], &mut []);
    }
    if read.is_empty() {
        return (&[], &mut buf[write]);
    }
    if read.end <= write.start {
        let (lo, hi) = buf.split_at_mut(write.start);
        (&lo[read], &mut hi[..write.len()])
    } else {
        assert!(
            write.end <= read.start,
            "read {read:?} and write {write:?} overlap"
        );
        let (lo, hi) = buf.split_at_mut(read.start);
        (&hi[..read.len()], &mut lo[write])
    }
}

/// The `k`-th window of `len` bytes starting at `offset` within `range`.
fn clamp(range: &std::ops::Range<usize>, offset: usize, len: usize) -> std::ops::Range<usize> {
    let start = (range.start + offset).min(range.end);
    let end = (start + len).min(range.end);
    start..end
}

impl<T: Transport> Backend for P2pBackend<T> {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn all_reduce(&mut self, ctx: &Ctx, data: Data, dtype: DType, op: ReduceOp) -> Result<()> {
        let buf = data.into_in_place();
        crate::backend::with_f32_accumulation(buf, dtype, |b, d| {
            self.all_reduce_native(ctx, b, d, op)
        })
    }

    fn reduce(
        &mut self,
        ctx: &Ctx,
        data: Data,
        dtype: DType,
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        let (rank, n) = (self.rank(), self.size());
        let vr = (rank + n - root) % n;
        let mut acc = data.input().to_vec();
        crate::backend::with_f32_accumulation(&mut acc, dtype, |acc, d| {
            let mut tmp = vec![0u8; acc.len()];
            let mut mask = 1;
            while mask < n {
                if vr & mask != 0 {
                    let parent = (vr - mask + root) % n;
                    return self.send_only(ctx, parent, acc);
                }
                if vr + mask < n {
                    let child = (vr + mask + root) % n;
                    self.recv_only(ctx, child, &mut tmp)?;
                    reduce::reduce_into(d, op, acc, &tmp);
                }
                mask <<= 1;
            }
            if op == ReduceOp::Avg {
                divide(d, acc, n);
            }
            Ok(())
        })?;
        if rank == root {
            match data {
                Data::InPlace(b) => b.copy_from_slice(&acc),
                Data::OutOfPlace { recv, .. } => recv.copy_from_slice(&acc),
            }
        }
        Ok(())
    }

    fn broadcast(&mut self, ctx: &Ctx, data: Data, root: usize) -> Result<()> {
        let (rank, n) = (self.rank(), self.size());
        let buf: &mut [u8] = if rank == root {
            data.into_in_place()
        } else {
            match data {
                Data::InPlace(b) => b,
                Data::OutOfPlace { recv, .. } => recv,
            }
        };
        let vr = (rank + n - root) % n;
        let mut mask = 1;
        while mask < n {
            if vr & mask != 0 {
                self.recv_only(ctx, (vr - mask + root) % n, buf)?;
                break;
            }
            mask <<= 1;
        }
        mask >>= 1;
        while mask > 0 {
            if vr + mask < n {
                self.send_only(ctx, (vr + mask + root) % n, buf)?;
            }
            mask >>= 1;
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
        let (rank, n) = (self.rank(), self.size());
        let disp = displacements(counts);
        recv[disp[rank]..disp[rank] + counts[rank]].copy_from_slice(send);
        let right = (rank + 1) % n;
        let left = (rank + n - 1) % n;
        for s in 0..n - 1 {
            let si = (rank + n - s) % n;
            let ri = (rank + 2 * n - s - 1) % n;
            let (out, inn) = disjoint(
                recv,
                disp[si]..disp[si] + counts[si],
                disp[ri]..disp[ri] + counts[ri],
            );
            self.sendrecv(ctx, right, out, left, inn)?;
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
        let (rank, n) = (self.rank(), self.size());
        let mut acc = send.to_vec();
        let block = recv.len();
        let mut out = vec![0u8; block];
        crate::backend::with_f32_accumulation(&mut acc, dtype, |acc, d| {
            let wb = acc.len() / n;
            let right = (rank + 1) % n;
            let left = (rank + n - 1) % n;
            let mut tmp = vec![0u8; wb];
            for s in 0..n - 1 {
                let si = (rank + 2 * n - s - 1) % n;
                let ri = (rank + 2 * n - s - 2) % n;
                self.sendrecv(ctx, right, &acc[si * wb..(si + 1) * wb], left, &mut tmp)?;
                reduce::reduce_into(d, op, &mut acc[ri * wb..(ri + 1) * wb], &tmp);
            }
            if op == ReduceOp::Avg {
                divide(d, &mut acc[rank * wb..(rank + 1) * wb], n);
            }
            Ok(())
        })?;
        out.copy_from_slice(&acc[rank * block..(rank + 1) * block]);
        recv.copy_from_slice(&out);
        Ok(())
    }

    fn all_to_all_v(
        &mut self,
        ctx: &Ctx,
        send: &[u8],
        send_counts: &[usize],
        recv: &mut [u8],
        recv_counts: &[usize],
    ) -> Result<()> {
        let (rank, n) = (self.rank(), self.size());
        let sd = displacements(send_counts);
        let rd = displacements(recv_counts);
        recv[rd[rank]..rd[rank] + recv_counts[rank]]
            .copy_from_slice(&send[sd[rank]..sd[rank] + send_counts[rank]]);
        for s in 1..n {
            let to = (rank + s) % n;
            let from = (rank + n - s) % n;
            let out = &send[sd[to]..sd[to] + send_counts[to]];
            let inn = &mut recv[rd[from]..rd[from] + recv_counts[from]];
            self.sendrecv(ctx, to, out, from, inn)?;
        }
        Ok(())
    }

    fn gather(&mut self, ctx: &Ctx, send: &[u8], recv: &mut [u8], root: usize) -> Result<()> {
        let (rank, n) = (self.rank(), self.size());
        if rank != root {
            return self.send_only(ctx, root, send);
        }
        let len = send.len();
        let mut recvs: Vec<Recv> = Vec::with_capacity(n);
        for (j, block) in recv.chunks_mut(len.max(1)).enumerate().take(n) {
            if j == rank {
                block[..len].copy_from_slice(send);
            } else {
                recvs.push(Recv {
                    peer: j,
                    data: &mut block[..len],
                });
            }
        }
        if len == 0 {
            recvs = (0..n)
                .filter(|j| *j != rank)
                .map(|j| Recv {
                    peer: j,
                    data: &mut [],
                })
                .collect();
        }
        self.mesh.exchange(ctx, &mut [], &mut recvs)
    }

    fn scatter(&mut self, ctx: &Ctx, send: &[u8], recv: &mut [u8], root: usize) -> Result<()> {
        let (rank, n) = (self.rank(), self.size());
        if rank != root {
            return self.recv_only(ctx, root, recv);
        }
        let len = recv.len();
        let mut sends: Vec<Send> = (0..n)
            .filter(|j| *j != rank)
            .map(|j| Send {
                peer: j,
                data: &send[j * len..(j + 1) * len],
            })
            .collect();
        recv.copy_from_slice(&send[rank * len..(rank + 1) * len]);
        self.mesh.exchange(ctx, &mut sends, &mut [])
    }

    fn send(&mut self, ctx: &Ctx, buf: &[u8], peer: usize, tag: u64) -> Result<()> {
        self.mesh.send_tagged(ctx, peer, tag, buf)
    }

    fn recv(&mut self, ctx: &Ctx, buf: &mut [u8], peer: usize, tag: u64) -> Result<()> {
        self.mesh.recv_tagged(ctx, peer, tag, buf)
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
        self.mesh.send_recv_tagged(ctx, to, send, from, recv, tag)
    }

    fn barrier(&mut self, ctx: &Ctx) -> Result<()> {
        let (rank, n) = (self.rank(), self.size());
        let mut dist = 1;
        while dist < n {
            let to = (rank + dist) % n;
            let from = (rank + n - dist) % n;
            self.sendrecv(ctx, to, &[], from, &mut [])?;
            dist <<= 1;
        }
        Ok(())
    }
}
