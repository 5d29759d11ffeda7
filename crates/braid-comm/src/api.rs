//! The typed operations of [`Communicator`]: argument checks, conversion to
//! bytes, and the same operations started asynchronously in a [`Scope`].
//!
//! Every operation is first turned into a [`Call`] (checked, with its
//! descriptor and a closure over the backend), which either runs at once
//! (blocking methods) or is queued (scope methods). Counts are in elements.

use crate::backend::{Backend, Ctx, Data};
use crate::communicator::Communicator;
use crate::debug::OpDesc;
use crate::error::{CommError, Result};
use crate::work::{Scope, Work};
use braid_core::{DType, Element, ReduceOp};

/// The body of an operation: what it does with the backend.
pub(crate) type RunFn<'a> = Box<dyn FnOnce(&mut dyn Backend, &Ctx) -> Result<()> + Send + 'a>;

/// A checked operation, ready to run on a backend.
pub struct Call<'a> {
    pub(crate) desc: OpDesc,
    pub(crate) run: RunFn<'a>,
}

fn bytes<T: Element>(s: &[T]) -> &[u8] {
    bytemuck::cast_slice(s)
}

fn bytes_mut<T: Element>(s: &mut [T]) -> &mut [u8] {
    bytemuck::cast_slice_mut(s)
}

impl Communicator {
    fn invalid(&self, op: &'static str, why: String) -> CommError {
        CommError::Invalid {
            rank: self.rank(),
            op,
            why,
        }
    }

    fn check_root(&self, op: &'static str, root: usize) -> Result<()> {
        if root >= self.size() {
            return Err(self.invalid(
                op,
                format!(
                    "root {root} is not below the communicator size {}",
                    self.size()
                ),
            ));
        }
        Ok(())
    }

    fn desc(
        op: &str,
        count: usize,
        dtype: Option<DType>,
        redop: Option<ReduceOp>,
        root: Option<usize>,
    ) -> OpDesc {
        OpDesc::new(op, count, dtype, redop, root, 0)
    }

    pub(crate) fn run_call(&self, call: Call) -> Result<()> {
        self.run_op(call.desc, call.run)
    }

    // ---- calls -------------------------------------------------------

    pub(crate) fn all_reduce_call<'a, T: Element>(
        &self,
        buf: &'a mut [T],
        op: ReduceOp,
    ) -> Call<'a> {
        let desc = Self::desc("all_reduce", buf.len(), Some(T::DTYPE), Some(op), None);
        Call {
            desc,
            run: Box::new(move |b, c| b.all_reduce(c, Data::InPlace(bytes_mut(buf)), T::DTYPE, op)),
        }
    }

    pub(crate) fn all_reduce_into_call<'a, T: Element>(
        &self,
        send: &'a [T],
        recv: &'a mut [T],
        op: ReduceOp,
    ) -> Result<Call<'a>> {
        if send.len() != recv.len() {
            return Err(self.invalid(
                "all_reduce",
                format!(
                    "send has {} elements but recv has {}",
                    send.len(),
                    recv.len()
                ),
            ));
        }
        let desc = Self::desc("all_reduce", send.len(), Some(T::DTYPE), Some(op), None);
        Ok(Call {
            desc,
            run: Box::new(move |b, c| {
                b.all_reduce(
                    c,
                    Data::OutOfPlace {
                        send: bytes(send),
                        recv: bytes_mut(recv),
                    },
                    T::DTYPE,
                    op,
                )
            }),
        })
    }

    pub(crate) fn broadcast_call<'a, T: Element>(
        &self,
        buf: &'a mut [T],
        root: usize,
    ) -> Result<Call<'a>> {
        self.check_root("broadcast", root)?;
        let desc = Self::desc("broadcast", buf.len(), Some(T::DTYPE), None, Some(root));
        Ok(Call {
            desc,
            run: Box::new(move |b, c| b.broadcast(c, Data::InPlace(bytes_mut(buf)), root)),
        })
    }

    pub(crate) fn all_gather_call<'a, T: Element>(
        &self,
        send: &'a [T],
        recv: &'a mut [T],
    ) -> Result<Call<'a>> {
        if recv.len() != send.len() * self.size() {
            return Err(self.invalid(
                "all_gather",
                format!(
                    "recv has {} elements; it must hold send's {} times the {} ranks",
                    recv.len(),
                    send.len(),
                    self.size()
                ),
            ));
        }
        let counts = vec![send.len() * T::DTYPE.size(); self.size()];
        let desc = Self::desc("all_gather", send.len(), Some(T::DTYPE), None, None);
        Ok(Call {
            desc,
            run: Box::new(move |b, c| b.all_gather_v(c, bytes(send), bytes_mut(recv), &counts)),
        })
    }

    pub(crate) fn reduce_scatter_call<'a, T: Element>(
        &self,
        send: &'a [T],
        recv: &'a mut [T],
        op: ReduceOp,
    ) -> Result<Call<'a>> {
        if send.len() != recv.len() * self.size() {
            return Err(self.invalid(
                "reduce_scatter",
                format!(
                    "send has {} elements; it must hold recv's {} times the {} ranks",
                    send.len(),
                    recv.len(),
                    self.size()
                ),
            ));
        }
        let desc = Self::desc("reduce_scatter", recv.len(), Some(T::DTYPE), Some(op), None);
        Ok(Call {
            desc,
            run: Box::new(move |b, c| {
                b.reduce_scatter(c, bytes(send), bytes_mut(recv), T::DTYPE, op)
            }),
        })
    }

    pub(crate) fn send_call<'a, T: Element>(
        &self,
        buf: &'a [T],
        peer: usize,
        tag: u64,
    ) -> Result<Call<'a>> {
        self.check_peer("send", peer)?;
        self.check_tag("send", tag)?;
        let desc = Self::desc("send", buf.len(), Some(T::DTYPE), None, Some(peer));
        Ok(Call {
            desc,
            run: Box::new(move |b, c| b.send(c, bytes(buf), peer, tag)),
        })
    }

    pub(crate) fn recv_call<'a, T: Element>(
        &self,
        buf: &'a mut [T],
        peer: usize,
        tag: u64,
    ) -> Result<Call<'a>> {
        self.check_peer("recv", peer)?;
        self.check_tag("recv", tag)?;
        let desc = Self::desc("recv", buf.len(), Some(T::DTYPE), None, Some(peer));
        Ok(Call {
            desc,
            run: Box::new(move |b, c| b.recv(c, bytes_mut(buf), peer, tag)),
        })
    }

    fn check_tag(&self, op: &'static str, tag: u64) -> Result<()> {
        if tag >= 1 << 63 {
            return Err(self.invalid(
                op,
                format!("tag {tag} is reserved: user tags must be below 2^63"),
            ));
        }
        Ok(())
    }

    fn check_peer(&self, op: &'static str, peer: usize) -> Result<()> {
        if peer >= self.size() || peer == self.rank() {
            return Err(self.invalid(
                op,
                format!("peer {peer} must be another rank below {}", self.size()),
            ));
        }
        Ok(())
    }

    // ---- blocking operations -----------------------------------------

    /// Reduces `buf` across all ranks in place; every rank gets the result.
    pub fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.run_call(self.all_reduce_call(buf, op))
    }

    /// Reduces `send` across all ranks into `recv` (same length).
    pub fn all_reduce_into<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        self.run_call(self.all_reduce_into_call(send, recv, op)?)
    }

    /// Reduces `buf` across all ranks into `root`'s `buf`; other ranks'
    /// buffers are unchanged.
    pub fn reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp, root: usize) -> Result<()> {
        self.check_root("reduce", root)?;
        let desc = Self::desc("reduce", buf.len(), Some(T::DTYPE), Some(op), Some(root));
        self.run_op(desc, move |b, c| {
            b.reduce(c, Data::InPlace(bytes_mut(buf)), T::DTYPE, op, root)
        })
    }

    /// Reduces `send` across all ranks into `recv` on `root` (`recv` must
    /// match `send`'s length on the root and is ignored elsewhere).
    pub fn reduce_into<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        self.check_root("reduce", root)?;
        if self.rank() == root && recv.len() != send.len() {
            return Err(self.invalid(
                "reduce",
                format!(
                    "on the root, recv has {} elements but send has {}",
                    recv.len(),
                    send.len()
                ),
            ));
        }
        let desc = Self::desc("reduce", send.len(), Some(T::DTYPE), Some(op), Some(root));
        self.run_op(desc, move |b, c| {
            b.reduce(
                c,
                Data::OutOfPlace {
                    send: bytes(send),
                    recv: bytes_mut(recv),
                },
                T::DTYPE,
                op,
                root,
            )
        })
    }

    /// Copies `root`'s `buf` to every rank's `buf`.
    pub fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.run_call(self.broadcast_call(buf, root)?)
    }

    /// Copies `root`'s `send` into every rank's `recv` (`send` is only read
    /// on the root, where it must match `recv`'s length).
    pub fn broadcast_into<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        root: usize,
    ) -> Result<()> {
        self.check_root("broadcast", root)?;
        if self.rank() == root && send.len() != recv.len() {
            return Err(self.invalid(
                "broadcast",
                format!(
                    "on the root, send has {} elements but recv has {}",
                    send.len(),
                    recv.len()
                ),
            ));
        }
        let desc = Self::desc("broadcast", recv.len(), Some(T::DTYPE), None, Some(root));
        self.run_op(desc, move |b, c| {
            b.broadcast(
                c,
                Data::OutOfPlace {
                    send: bytes(send),
                    recv: bytes_mut(recv),
                },
                root,
            )
        })
    }

    /// Concatenates every rank's `send` (equal lengths) into `recv`.
    pub fn all_gather<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        self.run_call(self.all_gather_call(send, recv)?)
    }

    /// In-place all-gather: this rank's block is already at
    /// `buf[rank * n / size ..]`; the other blocks are filled in.
    pub fn all_gather_in_place<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        if buf.len() % self.size() != 0 {
            return Err(self.invalid(
                "all_gather",
                format!(
                    "{} elements do not split into {} equal blocks",
                    buf.len(),
                    self.size()
                ),
            ));
        }
        let block = buf.len() / self.size();
        let mine = buf[self.rank() * block..(self.rank() + 1) * block].to_vec();
        self.all_gather(&mine, buf)
    }

    /// Concatenates every rank's `send` (rank `i` contributes `counts[i]`
    /// elements) into `recv`.
    pub fn all_gather_v<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        counts: &[usize],
    ) -> Result<()> {
        let op = "all_gather_v";
        if counts.len() != self.size() {
            return Err(self.invalid(
                op,
                format!("{} counts given for {} ranks", counts.len(), self.size()),
            ));
        }
        if counts[self.rank()] != send.len() {
            return Err(self.invalid(
                op,
                format!(
                    "counts[{}] = {} but send has {} elements",
                    self.rank(),
                    counts[self.rank()],
                    send.len()
                ),
            ));
        }
        let total: usize = counts.iter().sum();
        if recv.len() != total {
            return Err(self.invalid(
                op,
                format!(
                    "recv has {} elements but the counts add up to {total}",
                    recv.len()
                ),
            ));
        }
        let es = T::DTYPE.size();
        let byte_counts: Vec<usize> = counts.iter().map(|c| c * es).collect();
        let desc = Self::desc(op, total, Some(T::DTYPE), None, None);
        self.run_op(desc, move |b, c| {
            b.all_gather_v(c, bytes(send), bytes_mut(recv), &byte_counts)
        })
    }

    /// Reduces `send` (size × `recv.len()` elements) and leaves block
    /// `rank` of the result in `recv`.
    pub fn reduce_scatter<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        self.run_call(self.reduce_scatter_call(send, recv, op)?)
    }

    /// In-place reduce-scatter: the result lands in this rank's block of `buf`.
    pub fn reduce_scatter_in_place<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        if buf.len() % self.size() != 0 {
            return Err(self.invalid(
                "reduce_scatter",
                format!(
                    "{} elements do not split into {} equal blocks",
                    buf.len(),
                    self.size()
                ),
            ));
        }
        let block = buf.len() / self.size();
        let send = buf.to_vec();
        let r = self.rank();
        self.reduce_scatter(&send, &mut buf[r * block..(r + 1) * block], op)
    }

    /// Sends block `j` of `send` to rank `j` and receives rank `i`'s block
    /// for this rank into block `i` of `recv` (equal blocks).
    pub fn all_to_all<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        if send.len() != recv.len() || send.len() % self.size() != 0 {
            return Err(self.invalid(
                "all_to_all",
                format!(
                    "send ({}) and recv ({}) must be equal and split into {} equal blocks",
                    send.len(),
                    recv.len(),
                    self.size()
                ),
            ));
        }
        let counts = vec![send.len() / self.size(); self.size()];
        self.all_to_all_impl("all_to_all", send, &counts, recv, &counts)
    }

    /// In-place all-to-all.
    pub fn all_to_all_in_place<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        let send = buf.to_vec();
        self.all_to_all(&send, buf)
    }

    /// All-to-all with per-rank counts: `send_counts[j]` elements to rank
    /// `j`, `recv_counts[i]` elements from rank `i`.
    pub fn all_to_all_v<T: Element>(
        &self,
        send: &[T],
        send_counts: &[usize],
        recv: &mut [T],
        recv_counts: &[usize],
    ) -> Result<()> {
        let op = "all_to_all_v";
        if send_counts.len() != self.size() || recv_counts.len() != self.size() {
            return Err(self.invalid(
                op,
                format!(
                    "send and recv counts need one entry per rank ({})",
                    self.size()
                ),
            ));
        }
        if send_counts.iter().sum::<usize>() != send.len()
            || recv_counts.iter().sum::<usize>() != recv.len()
        {
            return Err(self.invalid(
                op,
                "send/recv lengths do not match the sums of their counts".into(),
            ));
        }
        self.all_to_all_impl(op, send, send_counts, recv, recv_counts)
    }

    fn all_to_all_impl<T: Element>(
        &self,
        op: &'static str,
        send: &[T],
        sc: &[usize],
        recv: &mut [T],
        rc: &[usize],
    ) -> Result<()> {
        let es = T::DTYPE.size();
        let sb: Vec<usize> = sc.iter().map(|c| c * es).collect();
        let rb: Vec<usize> = rc.iter().map(|c| c * es).collect();
        let desc = Self::desc(
            op,
            if op == "all_to_all" { send.len() } else { 0 },
            Some(T::DTYPE),
            None,
            None,
        );
        self.run_op(desc, move |b, c| {
            b.all_to_all_v(c, bytes(send), &sb, bytes_mut(recv), &rb)
        })
    }

    /// Concatenates every rank's `send` into `recv` on `root` (`recv` holds
    /// size × `send.len()` elements there and is ignored elsewhere).
    pub fn gather<T: Element>(&self, send: &[T], recv: &mut [T], root: usize) -> Result<()> {
        self.check_root("gather", root)?;
        if self.rank() == root && recv.len() != send.len() * self.size() {
            return Err(self.invalid(
                "gather",
                format!(
                    "on the root, recv must hold {} elements, not {}",
                    send.len() * self.size(),
                    recv.len()
                ),
            ));
        }
        let desc = Self::desc("gather", send.len(), Some(T::DTYPE), None, Some(root));
        self.run_op(desc, move |b, c| {
            b.gather(c, bytes(send), bytes_mut(recv), root)
        })
    }

    /// Sends block `j` of `root`'s `send` to rank `j`'s `recv`.
    pub fn scatter<T: Element>(&self, send: &[T], recv: &mut [T], root: usize) -> Result<()> {
        self.check_root("scatter", root)?;
        if self.rank() == root && send.len() != recv.len() * self.size() {
            return Err(self.invalid(
                "scatter",
                format!(
                    "on the root, send must hold {} elements, not {}",
                    recv.len() * self.size(),
                    send.len()
                ),
            ));
        }
        let desc = Self::desc("scatter", recv.len(), Some(T::DTYPE), None, Some(root));
        self.run_op(desc, move |b, c| {
            b.scatter(c, bytes(send), bytes_mut(recv), root)
        })
    }

    /// Sends `buf` to `peer` with `tag`.
    pub fn send<T: Element>(&self, buf: &[T], peer: usize, tag: u64) -> Result<()> {
        self.run_call(self.send_call(buf, peer, tag)?)
    }

    /// Receives exactly `buf.len()` elements from `peer` sent with `tag`.
    pub fn recv<T: Element>(&self, buf: &mut [T], peer: usize, tag: u64) -> Result<()> {
        self.run_call(self.recv_call(buf, peer, tag)?)
    }

    /// Sends `send` to `to` and receives `recv` from `from` (both tagged
    /// `tag`) at the same time: the deadlock-free way for every rank to
    /// exchange with neighbours (a ring shift, a halo exchange).
    pub fn send_recv<T: Element>(
        &self,
        send: &[T],
        to: usize,
        recv: &mut [T],
        from: usize,
        tag: u64,
    ) -> Result<()> {
        self.check_peer("send", to)?;
        self.check_peer("recv", from)?;
        self.check_tag("send", tag)?;
        let desc = Self::desc("send", send.len(), Some(T::DTYPE), None, Some(to));
        self.run_op(desc, move |b, c| {
            b.send_recv(c, bytes(send), to, bytes_mut(recv), from, tag)
        })
    }

    /// Returns once every rank has called `barrier`.
    pub fn barrier(&self) -> Result<()> {
        self.run_op(Self::desc("barrier", 0, None, None, None), |b, c| {
            b.barrier(c)
        })
    }

    /// All-gather of raw bytes (equal sizes), used internally.
    pub(crate) fn all_gather_bytes(&self, send: &[u8], recv: &mut [u8]) -> Result<()> {
        let counts = vec![send.len(); self.size()];
        self.run_op(
            Self::desc("all_gather", send.len(), Some(DType::U8), None, None),
            move |b, c| b.all_gather_v(c, send, recv, &counts),
        )
    }
}

impl<'scope> Scope<'scope, '_> {
    fn start(&'scope self, call: Result<Call<'scope>>) -> Work<'scope> {
        match call {
            Ok(c) => self.submit(c),
            Err(e) => self.failed(e),
        }
    }

    /// Starts an in-place all-reduce.
    pub fn all_reduce<T: Element>(
        &'scope self,
        buf: &'scope mut [T],
        op: ReduceOp,
    ) -> Work<'scope> {
        self.start(Ok(self.comm.all_reduce_call(buf, op)))
    }

    /// Starts an out-of-place all-reduce.
    pub fn all_reduce_into<T: Element>(
        &'scope self,
        send: &'scope [T],
        recv: &'scope mut [T],
        op: ReduceOp,
    ) -> Work<'scope> {
        self.start(self.comm.all_reduce_into_call(send, recv, op))
    }

    /// Starts a broadcast.
    pub fn broadcast<T: Element>(&'scope self, buf: &'scope mut [T], root: usize) -> Work<'scope> {
        self.start(self.comm.broadcast_call(buf, root))
    }

    /// Starts an all-gather.
    pub fn all_gather<T: Element>(
        &'scope self,
        send: &'scope [T],
        recv: &'scope mut [T],
    ) -> Work<'scope> {
        self.start(self.comm.all_gather_call(send, recv))
    }

    /// Starts a reduce-scatter.
    pub fn reduce_scatter<T: Element>(
        &'scope self,
        send: &'scope [T],
        recv: &'scope mut [T],
        op: ReduceOp,
    ) -> Work<'scope> {
        self.start(self.comm.reduce_scatter_call(send, recv, op))
    }

    /// Starts a tagged send.
    pub fn send<T: Element>(&'scope self, buf: &'scope [T], peer: usize, tag: u64) -> Work<'scope> {
        self.start(self.comm.send_call(buf, peer, tag))
    }

    /// Starts a tagged receive.
    pub fn recv<T: Element>(
        &'scope self,
        buf: &'scope mut [T],
        peer: usize,
        tag: u64,
    ) -> Work<'scope> {
        self.start(self.comm.recv_call(buf, peer, tag))
    }
}
