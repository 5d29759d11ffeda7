//! Collectives on device memory through NCCL: [`GpuCommunicator`].
//!
//! A GPU communicator is made from a host [`Communicator`] (which supplies
//! rank, size, the store and the health monitor) and the GPU(s) this
//! process drives: one per process is the main mode (`LOCAL_RANK` picks the
//! device), several per process is the course's `ncclCommInitAll` pattern.
//! The NCCL unique id travels from rank 0 through the rendezvous store.
//!
//! Operations have the host API's names and semantics, on
//! [`DeviceBuffer`]s. Each one is ordered after the work already queued on
//! the device's main stream (an event recorded there, waited on by the
//! communication stream), runs on the communication stream, and returns a
//! [`DeviceWork`] whose `wait` polls the completion event, NCCL's
//! asynchronous error, the host communicator's abort flag and the timeout —
//! aborting the NCCL communicator instead of hanging when a peer is gone.
//! Each operation is recorded in the rank's flight recorder
//! ([`crate::flight`]) when queued, and marked completed when its wait
//! sees the completion event (which also completes every earlier one: one
//! stream runs them in order).
//!
//! ```no_run
//! use braid_comm::{Communicator, ReduceOp, gpu::GpuCommunicator};
//! let comm = Communicator::init_from_env()?;
//! let gpu = GpuCommunicator::init_from_env(&comm)?;
//! let mut x = gpu.buffer_from_host(&vec![comm.rank() as f32; 1024])?;
//! gpu.all_reduce(&mut x, ReduceOp::Sum)?.wait()?;
//! # Ok::<(), braid_comm::CommError>(())
//! ```

mod lane;
mod outside;
mod watchdog;
mod work;

pub use lane::Lane;
pub use outside::OutsideOp;
pub use work::{poll_pause, DeviceWork};

use crate::communicator::Communicator;
use crate::debug::OpDesc;
use crate::error::{CommError, Result};
use crate::flight::CommFlight;
use braid_core::{DType, Element, ReduceOp};
use braid_cuda::nccl::{self, NcclComm, UniqueId};
pub use braid_cuda::{CudaError, Device, DeviceBuffer, DeviceViewMut, Event, Graph, Stream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;
use watchdog::Watchdog;

/// One GPU driven by this process: its NCCL member, communication stream
/// and events.
pub(crate) struct Member {
    pub(crate) device: Device,
    pub(crate) nccl: Mutex<NcclComm>,
    /// A split of `nccl` under NCCL's zero-CTA policy that owns the
    /// symmetric windows (made by the first
    /// [`GpuCommunicator::symmetric_zeros`]): the in-place all-gathers run
    /// on it, with the copy engines, while every other
    /// operation stays on `nccl`, whose reduce-scatters see no window and
    /// keep their ring kernels (and their bits).
    pub(crate) gathers: Mutex<Option<NcclComm>>,
    pub(crate) stream: Stream,
    /// Recorded on the main stream before each operation.
    pub(crate) before: Event,
    /// Completion events, reused.
    pub(crate) pool: Mutex<Vec<Event>>,
}

impl Member {
    fn new(device: Device, nccl: NcclComm) -> braid_cuda::Result<Member> {
        Ok(Member {
            stream: Stream::new(&device)?,
            before: Event::new(&device)?,
            device,
            nccl: Mutex::new(nccl),
            gathers: Mutex::new(None),
            pool: Mutex::new(Vec::new()),
        })
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, NcclComm> {
        self.nccl.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn lock_gathers(&self) -> MutexGuard<'_, Option<NcclComm>> {
        self.gathers.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn event(&self) -> braid_cuda::Result<Event> {
        let pooled = self.pool.lock().unwrap_or_else(|p| p.into_inner()).pop();
        match pooled {
            Some(e) => Ok(e),
            None => Event::new(&self.device),
        }
    }

    pub(crate) fn recycle(&self, e: Event) {
        self.pool.lock().unwrap_or_else(|p| p.into_inner()).push(e);
    }

    /// Orders the communication stream after the main stream's work.
    fn order_after_main(&self) -> braid_cuda::Result<()> {
        self.before.record(&self.device.main_stream())?;
        self.stream.wait_event(&self.before)
    }
}

/// Collectives on device memory over NCCL; see the [module docs](self).
pub struct GpuCommunicator {
    host: Communicator,
    members: Vec<Member>,
    rank: usize,
    size: usize,
    seq: AtomicU64,
    timeout: Duration,
    watchdog: Watchdog,
    /// This communicator in the rank's flight recorder.
    pub(crate) flight: CommFlight,
}

/// What a single-GPU operation is called with, for `BRAID_DEBUG=detail`:
/// (count, dtype, reduce op, root or peer), with the host API's meaning
/// of count for each operation.
type Call = (usize, DType, Option<ReduceOp>, Option<usize>);

fn setup_err(e: impl std::fmt::Display) -> CommError {
    CommError::Setup(e.to_string())
}

/// A setup error; a missing driver or NCCL reads "GPU collectives are
/// unavailable: <why>".
fn cuda_setup_err(e: CudaError) -> CommError {
    match e {
        CudaError::Unavailable(why) => {
            CommError::Setup(format!("GPU collectives are unavailable: {why}"))
        }
        other => setup_err(other),
    }
}

impl GpuCommunicator {
    /// One GPU per process: the device is `LOCAL_RANK` (modulo the number of
    /// visible GPUs, so `CUDA_VISIBLE_DEVICES` with one device per process
    /// works too).
    pub fn init_from_env(host: &Communicator) -> Result<GpuCommunicator> {
        let count = braid_cuda::device_count().map_err(cuda_setup_err)?;
        if count == 0 {
            return Err(CommError::Setup(
                "GPU collectives are unavailable: the CUDA driver sees no GPU".into(),
            ));
        }
        let local = braid_core::world::local_rank_from_env().unwrap_or(host.rank());
        Self::init(host, &[local % count])
    }

    /// `per_process` GPUs per process: process `LOCAL_RANK` drives GPUs
    /// `LOCAL_RANK * per_process ..` (one GPU: as [`init_from_env`](Self::init_from_env)).
    pub fn init_from_env_per_process(
        host: &Communicator,
        per_process: usize,
    ) -> Result<GpuCommunicator> {
        if per_process <= 1 {
            return Self::init_from_env(host);
        }
        let local = braid_core::world::local_rank_from_env().unwrap_or(0);
        let ordinals: Vec<usize> = (local * per_process..(local + 1) * per_process).collect();
        Self::init(host, &ordinals)
    }

    /// Drives the GPUs `ordinals` from this process. Every process must pass
    /// the same number of GPUs; NCCL rank of this process's `k`-th GPU is
    /// `host.rank() * ordinals.len() + k`. Collective over `host`.
    pub fn init(host: &Communicator, ordinals: &[usize]) -> Result<GpuCommunicator> {
        let per = ordinals.len();
        if per == 0 {
            return Err(setup_err("no GPU given"));
        }
        // Every process must drive the same number of GPUs.
        let mut range = [per as i64, -(per as i64)];
        host.all_reduce(&mut range, ReduceOp::Min)?;
        if range[0] != per as i64 || -range[1] != per as i64 {
            return Err(setup_err(format!(
                "processes drive different numbers of GPUs (from {} to {}); pass the same -g everywhere",
                range[0], -range[1]
            )));
        }
        let devices = ordinals
            .iter()
            .map(|&o| Device::open(o))
            .collect::<braid_cuda::Result<Vec<_>>>()
            .map_err(cuda_setup_err)?;
        // Fail on every rank together if NCCL is missing on any of them.
        let loaded = nccl::version();
        let mut ok = [i32::from(loaded.is_ok())];
        host.all_reduce(&mut ok, ReduceOp::Min)?;
        if let Err(e) = loaded {
            return Err(cuda_setup_err(e));
        }
        if ok[0] == 0 {
            return Err(setup_err(
                "GPU collectives are unavailable: NCCL could not be loaded on another rank",
            ));
        }
        let size = host.size() * per;
        let comms = if host.size() == 1 {
            NcclComm::init_all(&devices).map_err(setup_err)?
        } else {
            let id = exchange_unique_id(host)?;
            // Bounded by the timeout and by the host communicator's view
            // of its peers: a rank dying here fails the others instead of
            // leaving them in NCCL's initialisation.
            let health = host.inner.health.clone();
            NcclComm::init_ranks_bounded(
                &devices,
                size,
                &id,
                host.rank() * per,
                host.timeout(),
                move || health.is_aborted().then(|| health.reason()),
            )
            .map_err(setup_err)?
        };
        let members = devices
            .into_iter()
            .zip(comms)
            .map(|(d, c)| Member::new(d, c))
            .collect::<braid_cuda::Result<Vec<_>>>()
            .map_err(setup_err)?;
        let flight = register_flight(host);
        Ok(GpuCommunicator {
            host: host.clone(),
            members,
            rank: host.rank() * per,
            size,
            seq: AtomicU64::new(0),
            timeout: host.timeout(),
            watchdog: Watchdog::start(
                host.rank(),
                host.inner.health.clone(),
                host.timeout(),
                flight.recorder().clone(),
            ),
            flight,
        })
    }

    /// NCCL rank of this process's first GPU.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of GPUs in the communicator (all processes).
    pub fn size(&self) -> usize {
        self.size
    }

    /// GPUs this process drives.
    pub fn local_devices(&self) -> Vec<Device> {
        self.members.iter().map(|m| m.device.clone()).collect()
    }

    /// This process's (first) GPU.
    pub fn device(&self) -> &Device {
        &self.members[0].device
    }

    /// `len` zeroed elements registered as a symmetric window of a split
    /// of this communicator's NCCL communicator under NCCL's zero-CTA
    /// policy (one GPU per process, NCCL 2.28 or later), for the in-place
    /// all-gathers NCCL runs there on the copy engines
    /// ([`DeviceBuffer::symmetric_zeros`]). Collective: every rank calls
    /// it at the same point with the same `len`; blocks until all have
    /// (within the host communicator's timeout).
    pub fn symmetric_zeros<T: Element>(&self, len: usize) -> Result<DeviceBuffer<T>> {
        if self.members.len() != 1 {
            return Err(CommError::Setup(format!(
                "symmetric memory: one GPU per process, not {}",
                self.members.len()
            )));
        }
        self.check_usable()?;
        // NCCL's split and registration wait for every rank without a
        // bound: meet first on the host, where a missing rank times out
        // and is named (as `split` does).
        self.host.barrier()?;
        let m = &self.members[0];
        // (Locked in `enqueue`'s order: the communicator, then the split.)
        let nccl = m.lock();
        let mut gathers = m.lock_gathers();
        if gathers.is_none() {
            let split = nccl.split_zero_cta(Some(0), self.rank as i64);
            *gathers = Some(split.map_err(cuda_setup_err)?.ok_or_else(|| {
                CommError::Setup("splitting the communicator for symmetric gathers".to_string())
            })?);
        }
        let comm = gathers.as_ref().expect("made above");
        DeviceBuffer::symmetric_zeros(comm, len).map_err(cuda_setup_err)
    }

    /// The host communicator this one was made from.
    pub fn host(&self) -> &Communicator {
        &self.host
    }

    /// Timeout of each wait (the host communicator's, `BRAID_TIMEOUT`).
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// A device buffer on this process's (first) GPU holding `data`.
    pub fn buffer_from_host<T: Element>(&self, data: &[T]) -> Result<DeviceBuffer<T>> {
        DeviceBuffer::from_host(self.device(), data).map_err(|e| self.gpu_err("buffer", 0, e))
    }

    /// `len` zeroed elements on this process's (first) GPU.
    pub fn zeros<T: Element>(&self, len: usize) -> Result<DeviceBuffer<T>> {
        DeviceBuffer::zeros(self.device(), len).map_err(|e| self.gpu_err("buffer", 0, e))
    }

    pub(crate) fn gpu_err(&self, op: &'static str, seq: u64, e: CudaError) -> CommError {
        let health = &self.host.inner.health;
        if health.is_aborted() {
            return CommError::Aborted {
                rank: self.rank,
                reason: format!("{} (seen during {op} #{seq}: {e})", health.reason()),
            };
        }
        match e {
            CudaError::Invalid(why) => CommError::Invalid {
                rank: self.rank,
                op,
                why,
            },
            e => CommError::Gpu {
                rank: self.rank,
                op,
                seq,
                detail: e.to_string(),
            },
        }
    }

    fn next_seq(&self) -> u64 {
        self.seq.fetch_add(1, Ordering::SeqCst) + 1
    }

    fn check_usable(&self) -> Result<()> {
        let health = &self.host.inner.health;
        if health.is_aborted() {
            return Err(CommError::Aborted {
                rank: self.rank,
                reason: health.reason(),
            });
        }
        Ok(())
    }

    /// Queues the operations `f` issues on the lanes of the local GPUs
    /// (one lane per GPU this process drives) as one operation named `op`:
    /// ordered after each device's main stream, inside one NCCL group when
    /// `grouped` or when there are several GPUs, with one completion handle.
    pub fn queue<'a>(
        &'a self,
        op: &'static str,
        grouped: bool,
        f: impl FnOnce(&mut [Lane<'_>]) -> braid_cuda::Result<()>,
    ) -> Result<DeviceWork<'a>> {
        self.queue_described(op, None, grouped, f)
    }

    /// [`queue`](Self::queue), recording the operation's (count, dtype)
    /// in the flight recorder when known.
    fn queue_described<'a>(
        &'a self,
        op: &'static str,
        shape: Option<(usize, DType)>,
        grouped: bool,
        f: impl FnOnce(&mut [Lane<'_>]) -> braid_cuda::Result<()>,
    ) -> Result<DeviceWork<'a>> {
        self.check_usable()?;
        let seq = self.next_seq();
        // An NVTX range around the launch (Nsight puts NCCL's kernels under
        // it), where a tool is attached.
        let _range = braid_trace::nvtx::range(|| match shape {
            Some((count, dtype)) => format!("nccl {op} {count} x {dtype:?}"),
            None => format!("nccl {op}"),
        });
        let record =
            self.flight
                .gpu_enqueued(seq, op, shape.map(|s| s.1), shape.map(|s| s.0 as u64));
        let queued = self.enqueue(op, seq, shape, grouped, f);
        match queued {
            Ok(events) => Ok(DeviceWork::new(self, op, seq, record, events)),
            Err(e) => {
                self.flight.gpu_failed(record, seq, op);
                Err(e)
            }
        }
    }

    /// The body of [`queue`](Self::queue): the NCCL calls and the
    /// completion events.
    fn enqueue(
        &self,
        op: &'static str,
        seq: u64,
        shape: Option<(usize, DType)>,
        grouped: bool,
        f: impl FnOnce(&mut [Lane<'_>]) -> braid_cuda::Result<()>,
    ) -> Result<Vec<(usize, Event)>> {
        let err = |e| self.gpu_err(op, seq, e);
        let _enqueue = self.watchdog.enter(op, seq);
        let guards: Vec<_> = self.members.iter().map(|m| m.lock()).collect();
        let gathers: Vec<_> = self.members.iter().map(|m| m.lock_gathers()).collect();
        for m in &self.members {
            m.order_after_main().map_err(err)?;
        }
        // (Nothing is allocated while nothing records.)
        let marks: Vec<_> = if braid_trace::recorder::active() {
            self.members
                .iter()
                .map(|m| braid_trace::device::begin(&m.stream).map_err(err))
                .collect::<Result<_>>()?
        } else {
            Vec::new()
        };
        let mut lanes: Vec<Lane<'_>> = self
            .members
            .iter()
            .zip(guards.iter().zip(&gathers))
            .enumerate()
            .map(|(k, (m, (g, a)))| Lane::new(g, a.as_ref(), &m.stream, self.rank + k, self.size))
            .collect();
        let group = grouped || lanes.len() > 1;
        if group {
            nccl::group_start().map_err(err)?;
        }
        let queued = f(&mut lanes);
        if group {
            // End the group even after a failure, so NCCL's state stays sane.
            let ended = nccl::group_end();
            queued.map_err(err)?;
            ended.map_err(err)?;
        } else {
            queued.map_err(err)?;
        }
        drop(lanes);
        drop(gathers);
        drop(guards);
        for (m, mark) in self.members.iter().zip(marks) {
            self.trace_op(m, mark, op, seq, shape).map_err(err)?;
        }
        let mut events = Vec::with_capacity(self.members.len());
        for (k, m) in self.members.iter().enumerate() {
            let e = m.event().map_err(err)?;
            e.record(&m.stream).map_err(err)?;
            events.push((k, e));
        }
        Ok(events)
    }

    /// Ends operation `op`'s trace span on member `m`'s stream (begun at
    /// `mark`), with its bytes and bandwidths where its shape is known.
    fn trace_op(
        &self,
        m: &Member,
        mark: Option<braid_trace::device::Mark>,
        op: &'static str,
        seq: u64,
        shape: Option<(usize, DType)>,
    ) -> braid_cuda::Result<()> {
        if mark.is_none() {
            return Ok(());
        }
        let mut args = vec![
            ("seq", seq.into()),
            ("comm", (self.flight.comm_index() as u64).into()),
            ("ranks", (self.size as u64).into()),
            ("via", "nccl".into()),
        ];
        if let Some((count, dtype)) = shape {
            args.push(("bytes", ((count * dtype.size()) as u64).into()));
            args.push(("count", (count as u64).into()));
            args.push(("dtype", dtype.name().into()));
        }
        let tid = braid_trace::recorder::track::GPU_COMM + 100 * self.flight.comm_index() as u32;
        braid_trace::device::end(mark, &m.stream, op, braid_trace::Cat::Comm, tid, args)
    }

    /// Runs one operation on this process's single GPU; `call` describes
    /// it for `BRAID_DEBUG=detail`, which first checks (over the host
    /// communicator) that every rank makes the same call.
    fn single<'a>(
        &'a self,
        op: &'static str,
        call: Call,
        f: impl FnOnce(&mut Lane<'_>) -> braid_cuda::Result<()>,
    ) -> Result<DeviceWork<'a>> {
        // Operations are issued in order, so the next number is this one's.
        let seq = self.seq.load(Ordering::SeqCst) + 1;
        let (count, dtype, redop, root) = call;
        self.host
            .check_same_call(OpDesc::new(op, count, Some(dtype), redop, root, seq))?;
        if self.members.len() != 1 {
            return Err(CommError::Invalid {
                rank: self.rank,
                op,
                why: format!(
                    "this process drives {} GPUs; issue per-GPU operations inside group()",
                    self.members.len()
                ),
            });
        }
        self.queue_described(op, Some((count, dtype)), false, |lanes| f(&mut lanes[0]))
    }

    /// Launches several operations as one NCCL group (`ncclGroupStart/End`):
    /// `f` gets one [`Lane`] per local GPU and queues operations on them.
    pub fn group<'a>(
        &'a self,
        f: impl FnOnce(&mut [Lane<'_>]) -> braid_cuda::Result<()>,
    ) -> Result<DeviceWork<'a>> {
        self.queue("group", true, f)
    }

    /// Captures the operations `f` queues into a CUDA graph per local GPU
    /// (nothing runs until [`launch_graphs`](Self::launch_graphs)). The
    /// buffers used must stay alive as long as the graphs.
    pub fn capture(
        &self,
        f: impl FnOnce(&mut [Lane<'_>]) -> braid_cuda::Result<()>,
    ) -> Result<Vec<Graph>> {
        self.check_usable()?;
        let seq = self.next_seq();
        let err = |e| self.gpu_err("capture", seq, e);
        let _enqueue = self.watchdog.enter("capture", seq);
        let guards: Vec<_> = self.members.iter().map(|m| m.lock()).collect();
        for m in &self.members {
            m.stream.begin_capture().map_err(err)?;
        }
        let mut lanes: Vec<Lane<'_>> = self
            .members
            .iter()
            .zip(&guards)
            .enumerate()
            .map(|(k, (m, g))| Lane::new(g, None, &m.stream, self.rank + k, self.size))
            .collect();
        let many = lanes.len() > 1;
        let queued = (|| {
            if many {
                nccl::group_start()?;
            }
            let r = f(&mut lanes);
            if many {
                nccl::group_end()?;
            }
            r
        })();
        drop(lanes);
        // End every capture before instantiating any graph: the driver
        // refuses to instantiate while this thread still captures.
        let captured: Vec<_> = self
            .members
            .iter()
            .map(|m| m.stream.end_capture())
            .collect();
        queued.map_err(err)?;
        let captured = captured
            .into_iter()
            .collect::<braid_cuda::Result<Vec<_>>>()
            .map_err(err)?;
        captured
            .into_iter()
            .map(|g| g.instantiate())
            .collect::<braid_cuda::Result<Vec<_>>>()
            .map_err(err)
    }

    /// Replays graphs made by [`capture`](Self::capture) (one per local GPU).
    pub fn launch_graphs<'a>(&'a self, graphs: &'a [Graph]) -> Result<DeviceWork<'a>> {
        self.check_usable()?;
        let seq = self.next_seq();
        let record = self.flight.gpu_enqueued(seq, "graph", None, None);
        let err = |e| self.gpu_err("graph", seq, e);
        let launched = (|| {
            let _enqueue = self.watchdog.enter("graph", seq);
            let mut events = Vec::new();
            for (k, (m, g)) in self.members.iter().zip(graphs).enumerate() {
                m.order_after_main().map_err(err)?;
                g.launch(&m.stream).map_err(err)?;
                let e = m.event().map_err(err)?;
                e.record(&m.stream).map_err(err)?;
                events.push((k, e));
            }
            Ok(events)
        })();
        match launched {
            Ok(events) => Ok(DeviceWork::new(self, "graph", seq, record, events)),
            Err(e) => {
                self.flight.gpu_failed(record, seq, "graph");
                Err(e)
            }
        }
    }

    /// Aborts the NCCL communicator(s) and the host communicator with
    /// `reason`: every pending and later operation fails.
    pub fn abort(&self, reason: &str) {
        self.abort_nccl();
        self.host.abort(reason);
    }

    pub(crate) fn abort_nccl(&self) {
        for m in &self.members {
            m.lock().abort();
            if let Some(g) = m.lock_gathers().as_mut() {
                g.abort();
            }
        }
    }

    pub(crate) fn members(&self) -> &[Member] {
        &self.members
    }

    // ---- operations on one GPU -------------------------------------

    /// In-place all-reduce.
    pub fn all_reduce<'a, T: Element>(
        &'a self,
        buf: &'a mut DeviceBuffer<T>,
        op: ReduceOp,
    ) -> Result<DeviceWork<'a>> {
        self.single("all_reduce", (buf.len(), T::DTYPE, Some(op), None), |l| {
            l.all_reduce(buf, op)
        })
    }

    /// In-place all-reduce of a view (part of a buffer on this process's
    /// GPU): a gradient bucket inside the flat gradient buffer, say.
    pub fn all_reduce_view<'a, T: Element>(
        &'a self,
        mut buf: DeviceViewMut<'a, T>,
        op: ReduceOp,
    ) -> Result<DeviceWork<'a>> {
        self.single("all_reduce", (buf.len(), T::DTYPE, Some(op), None), |l| {
            l.all_reduce_mem(&mut buf, op)
        })
    }

    /// Out-of-place all-reduce.
    pub fn all_reduce_into<'a, T: Element>(
        &'a self,
        send: &'a DeviceBuffer<T>,
        recv: &'a mut DeviceBuffer<T>,
        op: ReduceOp,
    ) -> Result<DeviceWork<'a>> {
        self.single("all_reduce", (send.len(), T::DTYPE, Some(op), None), |l| {
            l.all_reduce_into(send, recv, op)
        })
    }

    /// In-place reduce to `root`.
    pub fn reduce<'a, T: Element>(
        &'a self,
        buf: &'a mut DeviceBuffer<T>,
        op: ReduceOp,
        root: usize,
    ) -> Result<DeviceWork<'a>> {
        self.single("reduce", (buf.len(), T::DTYPE, Some(op), Some(root)), |l| {
            l.reduce(buf, op, root)
        })
    }

    /// Out-of-place reduce to `root` (`recv` is written on the root only).
    pub fn reduce_into<'a, T: Element>(
        &'a self,
        send: &'a DeviceBuffer<T>,
        recv: &'a mut DeviceBuffer<T>,
        op: ReduceOp,
        root: usize,
    ) -> Result<DeviceWork<'a>> {
        self.single(
            "reduce",
            (send.len(), T::DTYPE, Some(op), Some(root)),
            |l| l.reduce_into(send, recv, op, root),
        )
    }

    /// In-place broadcast from `root`.
    pub fn broadcast<'a, T: Element>(
        &'a self,
        buf: &'a mut DeviceBuffer<T>,
        root: usize,
    ) -> Result<DeviceWork<'a>> {
        self.single("broadcast", (buf.len(), T::DTYPE, None, Some(root)), |l| {
            l.broadcast(buf, root)
        })
    }

    /// Out-of-place broadcast (`send` is read on the root only).
    pub fn broadcast_into<'a, T: Element>(
        &'a self,
        send: &'a DeviceBuffer<T>,
        recv: &'a mut DeviceBuffer<T>,
        root: usize,
    ) -> Result<DeviceWork<'a>> {
        self.single("broadcast", (recv.len(), T::DTYPE, None, Some(root)), |l| {
            l.broadcast_into(send, recv, root)
        })
    }

    /// All-gather: `recv` holds `size` blocks of `send.len()`.
    pub fn all_gather<'a, T: Element>(
        &'a self,
        send: &'a DeviceBuffer<T>,
        recv: &'a mut DeviceBuffer<T>,
    ) -> Result<DeviceWork<'a>> {
        self.single("all_gather", (send.len(), T::DTYPE, None, None), |l| {
            l.all_gather(send, recv)
        })
    }

    /// In-place all-gather: this rank's block is already at its offset.
    pub fn all_gather_in_place<'a, T: Element>(
        &'a self,
        buf: &'a mut DeviceBuffer<T>,
    ) -> Result<DeviceWork<'a>> {
        let count = buf.len() / self.size.max(1);
        self.single("all_gather", (count, T::DTYPE, None, None), |l| {
            l.all_gather_in_place(buf)
        })
    }

    /// All-gather with a count per rank.
    pub fn all_gather_v<'a, T: Element>(
        &'a self,
        send: &'a DeviceBuffer<T>,
        recv: &'a mut DeviceBuffer<T>,
        counts: &[usize],
    ) -> Result<DeviceWork<'a>> {
        let total = counts.iter().sum();
        self.single("all_gather_v", (total, T::DTYPE, None, None), |l| {
            l.all_gather_v(send, recv, counts)
        })
    }

    /// Reduce-scatter: `send` holds `size` blocks of `recv.len()`.
    pub fn reduce_scatter<'a, T: Element>(
        &'a self,
        send: &'a DeviceBuffer<T>,
        recv: &'a mut DeviceBuffer<T>,
        op: ReduceOp,
    ) -> Result<DeviceWork<'a>> {
        self.single(
            "reduce_scatter",
            (recv.len(), T::DTYPE, Some(op), None),
            |l| l.reduce_scatter(send, recv, op),
        )
    }

    /// In-place reduce-scatter of part of a buffer: the sum lands in this
    /// rank's block of `buf` (which splits into one equal block per rank).
    pub fn reduce_scatter_view<'a, T: Element>(
        &'a self,
        mut buf: DeviceViewMut<'a, T>,
        op: ReduceOp,
    ) -> Result<DeviceWork<'a>> {
        let count = buf.len() / self.size.max(1);
        self.single("reduce_scatter", (count, T::DTYPE, Some(op), None), |l| {
            l.reduce_scatter_mem(&mut buf, op)
        })
    }

    /// Reduce-scatter from part of a buffer into part of another: `send`
    /// (only read) holds one block of `recv`'s length per rank.
    pub fn reduce_scatter_views<'a, T: Element>(
        &'a self,
        send: DeviceViewMut<'a, T>,
        mut recv: DeviceViewMut<'a, T>,
        op: ReduceOp,
    ) -> Result<DeviceWork<'a>> {
        let count = recv.len();
        self.single("reduce_scatter", (count, T::DTYPE, Some(op), None), |l| {
            l.reduce_scatter_mem_into(&send, &mut recv, op)
        })
    }

    /// In-place all-gather of part of a buffer: this rank's block of `buf`
    /// is at its offset; every other block is filled in.
    pub fn all_gather_view<'a, T: Element>(
        &'a self,
        mut buf: DeviceViewMut<'a, T>,
    ) -> Result<DeviceWork<'a>> {
        let count = buf.len() / self.size.max(1);
        self.single("all_gather", (count, T::DTYPE, None, None), |l| {
            l.all_gather_mem(&mut buf)
        })
    }

    /// In-place reduce-scatter: the result lands in this rank's block.
    pub fn reduce_scatter_in_place<'a, T: Element>(
        &'a self,
        buf: &'a mut DeviceBuffer<T>,
        op: ReduceOp,
    ) -> Result<DeviceWork<'a>> {
        let count = buf.len() / self.size.max(1);
        self.single("reduce_scatter", (count, T::DTYPE, Some(op), None), |l| {
            l.reduce_scatter_in_place(buf, op)
        })
    }

    /// All-to-all with equal blocks.
    pub fn all_to_all<'a, T: Element>(
        &'a self,
        send: &'a DeviceBuffer<T>,
        recv: &'a mut DeviceBuffer<T>,
    ) -> Result<DeviceWork<'a>> {
        self.single("all_to_all", (send.len(), T::DTYPE, None, None), |l| {
            l.all_to_all(send, recv)
        })
    }

    /// All-to-all with counts per peer.
    pub fn all_to_all_v<'a, T: Element>(
        &'a self,
        send: &'a DeviceBuffer<T>,
        send_counts: &[usize],
        recv: &'a mut DeviceBuffer<T>,
        recv_counts: &[usize],
    ) -> Result<DeviceWork<'a>> {
        self.single("all_to_all_v", (0, T::DTYPE, None, None), |l| {
            l.all_to_all_v(send, send_counts, recv, recv_counts)
        })
    }

    /// Gather to `root` (`recv` holds `size` blocks on the root; ignored elsewhere).
    pub fn gather<'a, T: Element>(
        &'a self,
        send: &'a DeviceBuffer<T>,
        recv: &'a mut DeviceBuffer<T>,
        root: usize,
    ) -> Result<DeviceWork<'a>> {
        self.single("gather", (send.len(), T::DTYPE, None, Some(root)), |l| {
            l.gather(send, recv, root)
        })
    }

    /// Scatter from `root` (`send` holds `size` blocks on the root).
    pub fn scatter<'a, T: Element>(
        &'a self,
        send: &'a DeviceBuffer<T>,
        recv: &'a mut DeviceBuffer<T>,
        root: usize,
    ) -> Result<DeviceWork<'a>> {
        self.single("scatter", (recv.len(), T::DTYPE, None, Some(root)), |l| {
            l.scatter(send, recv, root)
        })
    }

    /// Sends to `peer`.
    pub fn send<'a, T: Element>(
        &'a self,
        buf: &'a DeviceBuffer<T>,
        peer: usize,
    ) -> Result<DeviceWork<'a>> {
        self.single("send", (buf.len(), T::DTYPE, None, Some(peer)), |l| {
            l.send(buf, peer)
        })
    }

    /// Receives from `peer`.
    pub fn recv<'a, T: Element>(
        &'a self,
        buf: &'a mut DeviceBuffer<T>,
        peer: usize,
    ) -> Result<DeviceWork<'a>> {
        self.single("recv", (buf.len(), T::DTYPE, None, Some(peer)), |l| {
            l.recv(buf, peer)
        })
    }

    /// Sends `send` to `to` and receives `recv` from `from` as one group.
    pub fn send_recv<'a, T: Element>(
        &'a self,
        send: &'a DeviceBuffer<T>,
        to: usize,
        recv: &'a mut DeviceBuffer<T>,
        from: usize,
    ) -> Result<DeviceWork<'a>> {
        if self.members.len() != 1 {
            return Err(CommError::Invalid {
                rank: self.rank,
                op: "send_recv",
                why: format!(
                    "this process drives {} GPUs; issue per-GPU operations inside group()",
                    self.members.len()
                ),
            });
        }
        self.queue("send_recv", true, |lanes| {
            lanes[0].send(send, to)?;
            lanes[0].recv(recv, from)
        })
    }

    /// Waits until every rank has reached the barrier and all earlier
    /// operations on this process's GPUs have completed.
    pub fn barrier(&self) -> Result<()> {
        let mut scratch: Vec<DeviceBuffer<f32>> = self
            .members
            .iter()
            .map(|m| DeviceBuffer::zeros(&m.device, 1))
            .collect::<braid_cuda::Result<_>>()
            .map_err(|e| self.gpu_err("barrier", 0, e))?;
        self.queue("barrier", false, |lanes| {
            for (l, b) in lanes.iter_mut().zip(scratch.iter_mut()) {
                l.all_reduce(b, ReduceOp::Sum)?;
            }
            Ok(())
        })?
        .wait()
    }

    // ---- host tensors through the GPU ------------------------------

    /// All-reduces a host slice through the GPU path: copied to the device,
    /// reduced by NCCL, copied back.
    pub fn all_reduce_host<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let mut dev = self.buffer_from_host(buf)?;
        self.all_reduce(&mut dev, op)?.wait()?;
        dev.copy_to_host(buf)
            .map_err(|e| self.gpu_err("all_reduce", 0, e))
    }

    /// Broadcasts a host slice from `root` through the GPU path.
    pub fn broadcast_host<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        let mut dev = self.buffer_from_host(buf)?;
        self.broadcast(&mut dev, root)?.wait()?;
        dev.copy_to_host(buf)
            .map_err(|e| self.gpu_err("broadcast", 0, e))
    }

    /// Splits like `ncclCommSplit` (and [`Communicator::split`] for the
    /// host side): ranks passing the same `color` form a new communicator
    /// ordered by `key`; `None` joins none. Every rank must call it.
    pub fn split(&self, color: Option<u32>, key: i64) -> Result<Option<GpuCommunicator>> {
        if self.members.len() != 1 {
            return Err(CommError::Invalid {
                rank: self.rank,
                op: "split",
                why: "split needs one GPU per process".into(),
            });
        }
        let host = self.host.split(color, key)?;
        let m = &self.members[0];
        let child = m
            .lock()
            .split(color, key)
            .map_err(|e| self.gpu_err("split", 0, e))?;
        match (host, child) {
            (Some(host), Some(nccl)) => {
                let rank = nccl.rank();
                let size = nccl.size();
                let member = Member::new(m.device.clone(), nccl).map_err(setup_err)?;
                let flight = register_flight(&host);
                Ok(Some(GpuCommunicator {
                    timeout: host.timeout(),
                    watchdog: Watchdog::start(
                        rank,
                        host.inner.health.clone(),
                        host.timeout(),
                        flight.recorder().clone(),
                    ),
                    flight,
                    host,
                    members: vec![member],
                    rank,
                    size,
                    seq: AtomicU64::new(0),
                }))
            }
            (None, None) => Ok(None),
            _ => Err(setup_err("host and NCCL splits disagree")),
        }
    }
}

/// Registers a GPU communicator made from `host` with the rank's flight
/// recorder: `<host id>/gpu<n>`, with the host communicator's (process)
/// ranks.
fn register_flight(host: &Communicator) -> CommFlight {
    let n = host.inner.gpu_flights.fetch_add(1, Ordering::SeqCst);
    host.inner.flight.recorder().register(
        format!("{}/gpu{n}", host.id()),
        "gpu",
        host.rank(),
        host.size(),
        host.inner.world_ranks.clone(),
    )
}

/// Rank 0 makes the NCCL unique id and publishes it in the rendezvous
/// store (under the host communicator's prefix, numbered per GPU
/// communicator); the others read it, bounded by the timeout.
fn exchange_unique_id(host: &Communicator) -> Result<UniqueId> {
    let n = host.inner.gpu_inits.fetch_add(1, Ordering::SeqCst);
    let key = format!("nccl-id/{n}");
    let store = &host.inner.store;
    if host.rank() == 0 {
        let id = nccl::unique_id().map_err(setup_err)?;
        store.set(&key, id.to_bytes())?;
        Ok(id)
    } else {
        let bytes = store.get_timeout(&key, host.timeout()).map_err(|e| {
            setup_err(format!(
                "rank {}: no NCCL unique id from rank 0 ({e})",
                host.rank()
            ))
        })?;
        UniqueId::from_bytes(&bytes).map_err(setup_err)
    }
}
