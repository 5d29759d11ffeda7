//! [`Lane`]: one GPU's NCCL member while operations are being queued —
//! argument checks, then the NCCL call on the communication stream.
//!
//! Operations NCCL has no call for are built from grouped send/recv
//! (all-to-all, gather, scatter) or grouped broadcasts (uneven all-gather);
//! a rank's own block goes through a self send/receive, which NCCL supports
//! inside a group.

use braid_core::{Element, ReduceOp};
use braid_cuda::nccl::{self, NcclComm};
use braid_cuda::{CudaError, DeviceBuffer, DeviceMem, Result, Stream};

/// Queues operations for one local GPU (inside [`GpuCommunicator::group`]
/// or `capture`, or through the communicator's one-GPU methods).
///
/// [`GpuCommunicator::group`]: super::GpuCommunicator::group
pub struct Lane<'c> {
    nccl: &'c NcclComm,
    /// Where the in-place all-gathers run, if not on `nccl`: the split
    /// that owns the symmetric windows
    /// ([`GpuCommunicator::symmetric_zeros`](super::GpuCommunicator::symmetric_zeros)).
    gathers: Option<&'c NcclComm>,
    stream: &'c Stream,
    rank: usize,
    size: usize,
}

fn invalid(op: &str, why: String) -> CudaError {
    CudaError::Invalid(format!("{op}: {why}"))
}

impl<'c> Lane<'c> {
    pub(crate) fn new(
        nccl: &'c NcclComm,
        gathers: Option<&'c NcclComm>,
        stream: &'c Stream,
        rank: usize,
        size: usize,
    ) -> Self {
        Lane {
            nccl,
            gathers,
            stream,
            rank,
            size,
        }
    }

    /// This lane's rank in the communicator.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The stream this lane's operations are queued on: kernels queued
    /// there run in order with them (a compression hook's casts).
    pub fn stream(&self) -> &Stream {
        self.stream
    }

    fn on_device<T: Element>(&self, op: &str, b: &DeviceBuffer<T>) -> Result<()> {
        let want = self.nccl.device().ordinal();
        if b.device().ordinal() != want {
            return Err(invalid(
                op,
                format!(
                    "buffer is on GPU {} but this rank's communicator runs on GPU {want}",
                    b.device().ordinal()
                ),
            ));
        }
        Ok(())
    }

    fn same_len<T: Element>(
        &self,
        op: &str,
        a: &DeviceBuffer<T>,
        b: &DeviceBuffer<T>,
    ) -> Result<()> {
        self.on_device(op, a)?;
        self.on_device(op, b)?;
        if a.len() != b.len() {
            return Err(invalid(
                op,
                format!("send has {} elements but recv has {}", a.len(), b.len()),
            ));
        }
        Ok(())
    }

    fn root(&self, op: &str, root: usize) -> Result<()> {
        if root >= self.size {
            return Err(invalid(
                op,
                format!(
                    "root {root} is not below the communicator size {}",
                    self.size
                ),
            ));
        }
        Ok(())
    }

    fn peer(&self, op: &str, peer: usize) -> Result<()> {
        if peer >= self.size {
            return Err(invalid(
                op,
                format!(
                    "peer {peer} is not below the communicator size {}",
                    self.size
                ),
            ));
        }
        Ok(())
    }

    fn blocks<T: Element>(&self, op: &str, what: &str, b: &DeviceBuffer<T>) -> Result<usize> {
        if b.len() % self.size != 0 {
            return Err(invalid(
                op,
                format!(
                    "{what} has {} elements, not a multiple of the communicator size {}",
                    b.len(),
                    self.size
                ),
            ));
        }
        Ok(b.len() / self.size)
    }

    /// In-place all-reduce.
    pub fn all_reduce<T: Element>(
        &mut self,
        buf: &mut DeviceBuffer<T>,
        op: ReduceOp,
    ) -> Result<()> {
        self.on_device("all_reduce", buf)?;
        if buf.is_empty() {
            return Ok(());
        }
        let p = buf.device_ptr();
        // SAFETY: `buf` holds `len` elements and outlives the operation
        // (the work handle borrows it).
        unsafe {
            self.nccl
                .all_reduce(p, p, buf.len(), T::DTYPE, op, self.stream)
        }
    }

    /// In-place all-reduce of device memory on this lane's GPU that is
    /// not a whole buffer (a view of part of one). The caller keeps it on
    /// this GPU: a view does not know its device.
    pub fn all_reduce_mem<T: Element>(
        &mut self,
        buf: &mut impl DeviceMem<T>,
        op: ReduceOp,
    ) -> Result<()> {
        if buf.dlen() == 0 {
            return Ok(());
        }
        let p = buf.dptr();
        // SAFETY: `buf` addresses `dlen` elements and outlives the operation
        // (the work handle borrows it).
        unsafe {
            self.nccl
                .all_reduce(p, p, buf.dlen(), T::DTYPE, op, self.stream)
        }
    }

    /// Out-of-place all-reduce.
    pub fn all_reduce_into<T: Element>(
        &mut self,
        send: &DeviceBuffer<T>,
        recv: &mut DeviceBuffer<T>,
        op: ReduceOp,
    ) -> Result<()> {
        self.same_len("all_reduce", send, recv)?;
        if send.is_empty() {
            return Ok(());
        }
        // SAFETY: equal lengths checked; buffers outlive the operation.
        unsafe {
            self.nccl.all_reduce(
                send.device_ptr(),
                recv.device_ptr(),
                send.len(),
                T::DTYPE,
                op,
                self.stream,
            )
        }
    }

    /// In-place reduce to `root`.
    pub fn reduce<T: Element>(
        &mut self,
        buf: &mut DeviceBuffer<T>,
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        self.root("reduce", root)?;
        self.on_device("reduce", buf)?;
        if buf.is_empty() {
            return Ok(());
        }
        let p = buf.device_ptr();
        // SAFETY: as in `all_reduce`.
        unsafe {
            self.nccl
                .reduce(p, p, buf.len(), T::DTYPE, op, root, self.stream)
        }
    }

    /// Out-of-place reduce to `root`.
    pub fn reduce_into<T: Element>(
        &mut self,
        send: &DeviceBuffer<T>,
        recv: &mut DeviceBuffer<T>,
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        self.root("reduce", root)?;
        self.same_len("reduce", send, recv)?;
        if send.is_empty() {
            return Ok(());
        }
        // SAFETY: as in `all_reduce_into`.
        unsafe {
            self.nccl.reduce(
                send.device_ptr(),
                recv.device_ptr(),
                send.len(),
                T::DTYPE,
                op,
                root,
                self.stream,
            )
        }
    }

    /// In-place broadcast from `root`.
    pub fn broadcast<T: Element>(&mut self, buf: &mut DeviceBuffer<T>, root: usize) -> Result<()> {
        self.root("broadcast", root)?;
        self.on_device("broadcast", buf)?;
        if buf.is_empty() {
            return Ok(());
        }
        let p = buf.device_ptr();
        // SAFETY: as in `all_reduce`.
        unsafe {
            self.nccl
                .broadcast(p, p, buf.len(), T::DTYPE, root, self.stream)
        }
    }

    /// Out-of-place broadcast from `root`.
    pub fn broadcast_into<T: Element>(
        &mut self,
        send: &DeviceBuffer<T>,
        recv: &mut DeviceBuffer<T>,
        root: usize,
    ) -> Result<()> {
        self.root("broadcast", root)?;
        self.same_len("broadcast", send, recv)?;
        if send.is_empty() {
            return Ok(());
        }
        // SAFETY: as in `all_reduce_into`.
        unsafe {
            self.nccl.broadcast(
                send.device_ptr(),
                recv.device_ptr(),
                send.len(),
                T::DTYPE,
                root,
                self.stream,
            )
        }
    }

    /// All-gather.
    pub fn all_gather<T: Element>(
        &mut self,
        send: &DeviceBuffer<T>,
        recv: &mut DeviceBuffer<T>,
    ) -> Result<()> {
        self.on_device("all_gather", send)?;
        self.on_device("all_gather", recv)?;
        if recv.len() != send.len() * self.size {
            return Err(invalid(
                "all_gather",
                format!(
                    "recv has {} elements but needs {} ({} ranks x {})",
                    recv.len(),
                    send.len() * self.size,
                    self.size,
                    send.len()
                ),
            ));
        }
        if send.is_empty() {
            return Ok(());
        }
        // SAFETY: sizes checked; buffers outlive the operation.
        unsafe {
            self.nccl.all_gather(
                send.device_ptr(),
                recv.device_ptr(),
                send.len(),
                T::DTYPE,
                self.stream,
            )
        }
    }

    /// In-place all-gather.
    pub fn all_gather_in_place<T: Element>(&mut self, buf: &mut DeviceBuffer<T>) -> Result<()> {
        self.on_device("all_gather", buf)?;
        let c = self.blocks("all_gather", "buffer", buf)?;
        if c == 0 {
            return Ok(());
        }
        // On the split that owns the symmetric windows, where there is one.
        let comm = self.gathers.unwrap_or(self.nccl);
        // SAFETY: NCCL's in-place form: send = recv + rank * count.
        unsafe {
            comm.all_gather(
                buf.ptr_at(self.rank * c),
                buf.device_ptr(),
                c,
                T::DTYPE,
                self.stream,
            )
        }
    }

    /// All-gather with a count per rank (grouped broadcasts).
    pub fn all_gather_v<T: Element>(
        &mut self,
        send: &DeviceBuffer<T>,
        recv: &mut DeviceBuffer<T>,
        counts: &[usize],
    ) -> Result<()> {
        let op = "all_gather_v";
        self.on_device(op, send)?;
        self.on_device(op, recv)?;
        if counts.len() != self.size {
            return Err(invalid(
                op,
                format!("{} counts for {} ranks", counts.len(), self.size),
            ));
        }
        if counts[self.rank] != send.len() {
            return Err(invalid(
                op,
                format!(
                    "send has {} elements but counts[{}] = {}",
                    send.len(),
                    self.rank,
                    counts[self.rank]
                ),
            ));
        }
        let total: usize = counts.iter().sum();
        if recv.len() != total {
            return Err(invalid(
                op,
                format!(
                    "recv has {} elements but the counts add up to {total}",
                    recv.len()
                ),
            ));
        }
        self.grouped(|l| {
            let mut off = 0;
            for (q, &c) in counts.iter().enumerate() {
                if c > 0 {
                    let src = if q == l.rank {
                        send.device_ptr()
                    } else {
                        recv.ptr_at(off)
                    };
                    // SAFETY: block `q` of `recv` holds `c` elements; the
                    // root reads `send` (same length).
                    unsafe {
                        l.nccl
                            .broadcast(src, recv.ptr_at(off), c, T::DTYPE, q, l.stream)?
                    };
                }
                off += c;
            }
            Ok(())
        })
    }

    /// Reduce-scatter.
    pub fn reduce_scatter<T: Element>(
        &mut self,
        send: &DeviceBuffer<T>,
        recv: &mut DeviceBuffer<T>,
        op: ReduceOp,
    ) -> Result<()> {
        self.on_device("reduce_scatter", send)?;
        self.on_device("reduce_scatter", recv)?;
        if send.len() != recv.len() * self.size {
            return Err(invalid(
                "reduce_scatter",
                format!(
                    "send has {} elements but needs {} ({} ranks x {})",
                    send.len(),
                    recv.len() * self.size,
                    self.size,
                    recv.len()
                ),
            ));
        }
        if recv.is_empty() {
            return Ok(());
        }
        // SAFETY: sizes checked; buffers outlive the operation.
        unsafe {
            self.nccl.reduce_scatter(
                send.device_ptr(),
                recv.device_ptr(),
                recv.len(),
                T::DTYPE,
                op,
                self.stream,
            )
        }
    }

    /// In-place reduce-scatter: the result lands in this rank's block.
    pub fn reduce_scatter_in_place<T: Element>(
        &mut self,
        buf: &mut DeviceBuffer<T>,
        op: ReduceOp,
    ) -> Result<()> {
        self.on_device("reduce_scatter", buf)?;
        let c = self.blocks("reduce_scatter", "buffer", buf)?;
        if c == 0 {
            return Ok(());
        }
        // SAFETY: NCCL's in-place form: recv = send + rank * count.
        unsafe {
            self.nccl.reduce_scatter(
                buf.device_ptr(),
                buf.ptr_at(self.rank * c),
                c,
                T::DTYPE,
                op,
                self.stream,
            )
        }
    }

    /// In-place reduce-scatter of device memory on this lane's GPU that is
    /// not a whole buffer (a view of part of one): the sum lands in this
    /// rank's block of `buf`, the other blocks are left as they were or
    /// overwritten (NCCL's in-place form). The caller keeps it on this GPU.
    pub fn reduce_scatter_mem<T: Element>(
        &mut self,
        buf: &mut impl DeviceMem<T>,
        op: ReduceOp,
    ) -> Result<()> {
        let c = self.mem_blocks("reduce_scatter", buf.dlen())?;
        if c == 0 {
            return Ok(());
        }
        let p = buf.dptr();
        let mine = p + (self.rank * c * std::mem::size_of::<T>()) as u64;
        // SAFETY: NCCL's in-place form (recv = send + rank * count) inside
        // the `dlen` elements `buf` addresses; it outlives the operation.
        unsafe {
            self.nccl
                .reduce_scatter(p, mine, c, T::DTYPE, op, self.stream)
        }
    }

    /// Reduce-scatter from device memory that is not a whole buffer into
    /// another such part: `send` holds one block of `recv`'s length per
    /// rank. The caller keeps both on this GPU.
    pub fn reduce_scatter_mem_into<T: Element>(
        &mut self,
        send: &impl DeviceMem<T>,
        recv: &mut impl DeviceMem<T>,
        op: ReduceOp,
    ) -> Result<()> {
        if send.dlen() != recv.dlen() * self.size {
            return Err(invalid(
                "reduce_scatter",
                format!(
                    "send has {} elements but needs {} ({} ranks x {})",
                    send.dlen(),
                    recv.dlen() * self.size,
                    self.size,
                    recv.dlen()
                ),
            ));
        }
        if recv.dlen() == 0 {
            return Ok(());
        }
        // SAFETY: sizes checked; both outlive the operation (the work
        // handle borrows them).
        unsafe {
            self.nccl.reduce_scatter(
                send.dptr(),
                recv.dptr(),
                recv.dlen(),
                T::DTYPE,
                op,
                self.stream,
            )
        }
    }

    /// In-place all-gather of device memory that is not a whole buffer:
    /// this rank's block of `buf` is sent and every block filled in.
    pub fn all_gather_mem<T: Element>(&mut self, buf: &mut impl DeviceMem<T>) -> Result<()> {
        let c = self.mem_blocks("all_gather", buf.dlen())?;
        if c == 0 {
            return Ok(());
        }
        let p = buf.dptr();
        let mine = p + (self.rank * c * std::mem::size_of::<T>()) as u64;
        // The split that owns the symmetric windows, where there is one
        // (the same ranks in the same order).
        let comm = self.gathers.unwrap_or(self.nccl);
        // SAFETY: NCCL's in-place form (send = recv + rank * count) inside
        // the `dlen` elements `buf` addresses; it outlives the operation.
        unsafe { comm.all_gather(mine, p, c, T::DTYPE, self.stream) }
    }

    /// All-gather from device memory that is not a whole buffer into
    /// another such part: `recv` gets every rank's `send`, in rank order.
    /// The caller keeps both on this GPU.
    pub fn all_gather_mem_into<T: Element>(
        &mut self,
        send: &impl DeviceMem<T>,
        recv: &mut impl DeviceMem<T>,
    ) -> Result<()> {
        if recv.dlen() != send.dlen() * self.size {
            return Err(invalid(
                "all_gather",
                format!(
                    "recv has {} elements but needs {} ({} ranks x {})",
                    recv.dlen(),
                    send.dlen() * self.size,
                    self.size,
                    send.dlen()
                ),
            ));
        }
        if send.dlen() == 0 {
            return Ok(());
        }
        // SAFETY: sizes checked; both outlive the operation (the work
        // handle borrows them).
        unsafe {
            self.nccl
                .all_gather(send.dptr(), recv.dptr(), send.dlen(), T::DTYPE, self.stream)
        }
    }

    fn mem_blocks(&self, op: &str, len: usize) -> Result<usize> {
        if len % self.size != 0 {
            return Err(invalid(
                op,
                format!(
                    "{len} elements do not split into {} equal blocks (one per rank)",
                    self.size
                ),
            ));
        }
        Ok(len / self.size)
    }

    /// All-to-all with equal blocks.
    pub fn all_to_all<T: Element>(
        &mut self,
        send: &DeviceBuffer<T>,
        recv: &mut DeviceBuffer<T>,
    ) -> Result<()> {
        self.same_len("all_to_all", send, recv)?;
        let c = self.blocks("all_to_all", "send", send)?;
        let counts = vec![c; self.size];
        self.exchange(send, &counts, recv, &counts)
    }

    /// All-to-all with counts per peer.
    pub fn all_to_all_v<T: Element>(
        &mut self,
        send: &DeviceBuffer<T>,
        send_counts: &[usize],
        recv: &mut DeviceBuffer<T>,
        recv_counts: &[usize],
    ) -> Result<()> {
        let op = "all_to_all_v";
        self.on_device(op, send)?;
        self.on_device(op, recv)?;
        for (what, counts, buf) in [
            ("send", send_counts, send.len()),
            ("recv", recv_counts, recv.len()),
        ] {
            if counts.len() != self.size {
                return Err(invalid(
                    op,
                    format!("{} {what} counts for {} ranks", counts.len(), self.size),
                ));
            }
            let total: usize = counts.iter().sum();
            if total != buf {
                return Err(invalid(
                    op,
                    format!("{what} has {buf} elements but its counts add up to {total}"),
                ));
            }
        }
        self.exchange(send, send_counts, recv, recv_counts)
    }

    fn exchange<T: Element>(
        &mut self,
        send: &DeviceBuffer<T>,
        send_counts: &[usize],
        recv: &DeviceBuffer<T>,
        recv_counts: &[usize],
    ) -> Result<()> {
        self.grouped(|l| {
            let (mut so, mut ro) = (0, 0);
            for q in 0..l.size {
                if send_counts[q] > 0 {
                    // SAFETY: block `q` of `send` holds `send_counts[q]` elements.
                    unsafe {
                        l.nccl
                            .send(send.ptr_at(so), send_counts[q], T::DTYPE, q, l.stream)?
                    };
                }
                if recv_counts[q] > 0 {
                    // SAFETY: block `q` of `recv` holds `recv_counts[q]` elements.
                    unsafe {
                        l.nccl
                            .recv(recv.ptr_at(ro), recv_counts[q], T::DTYPE, q, l.stream)?
                    };
                }
                so += send_counts[q];
                ro += recv_counts[q];
            }
            Ok(())
        })
    }

    /// Gather to `root`.
    pub fn gather<T: Element>(
        &mut self,
        send: &DeviceBuffer<T>,
        recv: &mut DeviceBuffer<T>,
        root: usize,
    ) -> Result<()> {
        self.root("gather", root)?;
        self.on_device("gather", send)?;
        let c = send.len();
        let is_root = self.rank == root;
        if is_root {
            self.on_device("gather", recv)?;
            if recv.len() != c * self.size {
                return Err(invalid(
                    "gather",
                    format!(
                        "recv on the root has {} elements but needs {}",
                        recv.len(),
                        c * self.size
                    ),
                ));
            }
        }
        if c == 0 {
            return Ok(());
        }
        self.grouped(|l| {
            // SAFETY: `send` holds `c` elements; on the root, block `q` of
            // `recv` holds `c` elements.
            unsafe {
                l.nccl
                    .send(send.device_ptr(), c, T::DTYPE, root, l.stream)?;
                if is_root {
                    for q in 0..l.size {
                        l.nccl.recv(recv.ptr_at(q * c), c, T::DTYPE, q, l.stream)?;
                    }
                }
            }
            Ok(())
        })
    }

    /// Scatter from `root`.
    pub fn scatter<T: Element>(
        &mut self,
        send: &DeviceBuffer<T>,
        recv: &mut DeviceBuffer<T>,
        root: usize,
    ) -> Result<()> {
        self.root("scatter", root)?;
        self.on_device("scatter", recv)?;
        let c = recv.len();
        let is_root = self.rank == root;
        if is_root {
            self.on_device("scatter", send)?;
            if send.len() != c * self.size {
                return Err(invalid(
                    "scatter",
                    format!(
                        "send on the root has {} elements but needs {}",
                        send.len(),
                        c * self.size
                    ),
                ));
            }
        }
        if c == 0 {
            return Ok(());
        }
        self.grouped(|l| {
            // SAFETY: on the root, block `q` of `send` holds `c` elements;
            // `recv` holds `c` elements.
            unsafe {
                if is_root {
                    for q in 0..l.size {
                        l.nccl.send(send.ptr_at(q * c), c, T::DTYPE, q, l.stream)?;
                    }
                }
                l.nccl
                    .recv(recv.device_ptr(), c, T::DTYPE, root, l.stream)?;
            }
            Ok(())
        })
    }

    /// Runs `f` inside `ncclGroupStart/End`, ending the group even when `f`
    /// fails.
    fn grouped(&mut self, f: impl FnOnce(&mut Self) -> Result<()>) -> Result<()> {
        nccl::group_start()?;
        let r = f(self);
        let end = nccl::group_end();
        r.and(end)
    }

    /// Send to `peer`.
    pub fn send<T: Element>(&mut self, buf: &DeviceBuffer<T>, peer: usize) -> Result<()> {
        self.peer("send", peer)?;
        self.on_device("send", buf)?;
        if buf.is_empty() {
            return Ok(());
        }
        // SAFETY: `buf` holds `len` elements and outlives the operation.
        unsafe {
            self.nccl
                .send(buf.device_ptr(), buf.len(), T::DTYPE, peer, self.stream)
        }
    }

    /// Receive from `peer`.
    pub fn recv<T: Element>(&mut self, buf: &mut DeviceBuffer<T>, peer: usize) -> Result<()> {
        self.peer("recv", peer)?;
        self.on_device("recv", buf)?;
        if buf.is_empty() {
            return Ok(());
        }
        // SAFETY: as in `send`.
        unsafe {
            self.nccl
                .recv(buf.device_ptr(), buf.len(), T::DTYPE, peer, self.stream)
        }
    }
}
