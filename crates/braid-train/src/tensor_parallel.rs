//! Tensor parallelism in the training loop. The model's own collectives
//! run inside its passes over the tensor group ([`HostTensorGroup`]: the
//! model's [`TensorComm`] over a host communicator, each operation
//! counted and traced as its own category); the strategy that reduces
//! gradients runs unchanged over the data group (every rank of a data
//! group holds the same share of the model); [`TensorParallel`] wraps it
//! so that what concerns every rank — the step's loss, the checkpoint's
//! agreement that every file is written — spans the whole world.

use crate::checkpoint::{StatePart, StateSource};
use crate::engine::{Checkpointable, Engine, Flat, ShardedBytes, StateBytes, UpdateStep};
use crate::strategy::{CommStep, Strategy, TensorStep};
use crate::timeline::Timeline;
use crate::Result;
use braid_comm::{Communicator, ReduceOp};
use braid_model::tensor_comm::{check_split, ReduceKind, TensorComm};
use braid_trace::Cat;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// What the tensor-parallel collectives moved (all the run's).
#[derive(Debug, Default)]
pub struct TensorTraffic {
    /// Collectives run.
    pub collectives: AtomicU64,
    /// Bytes handed to them.
    pub payload: AtomicU64,
    /// Bytes each rank sent for them (a ring's share).
    pub wire: AtomicU64,
}

impl TensorTraffic {
    /// (collectives, payload bytes, wire bytes) so far.
    pub fn totals(&self) -> (u64, u64, u64) {
        (
            self.collectives.load(Ordering::Relaxed),
            self.payload.load(Ordering::Relaxed),
            self.wire.load(Ordering::Relaxed),
        )
    }
}

/// The model's collectives over a host communicator (the tensor group).
pub struct HostTensorGroup {
    comm: Communicator,
    traffic: Arc<TensorTraffic>,
}

impl HostTensorGroup {
    /// The tensor group's collectives over `comm`.
    pub fn new(comm: Communicator) -> HostTensorGroup {
        HostTensorGroup {
            comm,
            traffic: Arc::new(TensorTraffic::default()),
        }
    }

    /// What its collectives moved so far (shared).
    pub fn traffic(&self) -> Arc<TensorTraffic> {
        self.traffic.clone()
    }

    /// Runs one collective of `bytes` (payload) whose ring sends
    /// `wire_share` of it per rank, traced as `name`.
    fn run<R>(
        &self,
        name: &'static str,
        bytes: usize,
        wire_share: f64,
        f: impl FnOnce() -> braid_comm::Result<R>,
    ) -> Result<R> {
        let _span = braid_trace::scope::start(None, Cat::TensorComm, || {
            format!("tensor {name} ({bytes} B)")
        });
        let r = f().map_err(|e| format!("{name} over the tensor group: {e}"))?;
        let t = &self.traffic;
        t.collectives.fetch_add(1, Ordering::Relaxed);
        t.payload.fetch_add(bytes as u64, Ordering::Relaxed);
        t.wire
            .fetch_add((bytes as f64 * wire_share) as u64, Ordering::Relaxed);
        Ok(r)
    }

    fn n(&self) -> f64 {
        self.comm.size() as f64
    }
}

fn op_of(op: ReduceKind) -> ReduceOp {
    match op {
        ReduceKind::Sum => ReduceOp::Sum,
        ReduceKind::Max => ReduceOp::Max,
    }
}

impl TensorComm for HostTensorGroup {
    fn size(&self) -> usize {
        self.comm.size()
    }
    fn rank(&self) -> usize {
        self.comm.rank()
    }
    fn all_reduce_f32(&self, x: &mut [f32], op: ReduceKind) -> Result<()> {
        let share = 2.0 * (self.n() - 1.0) / self.n();
        self.run("all_reduce", 4 * x.len(), share, || {
            self.comm.all_reduce(x, op_of(op))
        })
    }
    fn all_gather_f32(&self, local: &[f32], full: &mut [f32]) -> Result<()> {
        check_split("all-gather", full.len(), local.len(), self.size())?;
        let share = (self.n() - 1.0) / self.n();
        self.run("all_gather", 4 * full.len(), share, || {
            self.comm.all_gather(local, full)
        })
    }
    fn reduce_scatter_f32(&self, full: &[f32], local: &mut [f32]) -> Result<()> {
        check_split("reduce-scatter", full.len(), local.len(), self.size())?;
        let share = (self.n() - 1.0) / self.n();
        self.run("reduce_scatter", 4 * full.len(), share, || {
            self.comm.reduce_scatter(full, local, ReduceOp::Sum)
        })
    }
    fn all_reduce_f64(&self, x: &mut [f64], op: ReduceKind) -> Result<()> {
        let share = 2.0 * (self.n() - 1.0) / self.n();
        self.run("all_reduce", 8 * x.len(), share, || {
            self.comm.all_reduce(x, op_of(op))
        })
    }
}

/// A data-parallel strategy over the data groups of a mesh with tensor
/// groups: every hook goes to it, but the step's loss and the
/// checkpoint's agreement are means over the whole world.
pub struct TensorParallel<E: Engine> {
    inner: Box<dyn Strategy<E>>,
    world: Communicator,
    /// The mesh, for the header.
    mesh: String,
    tensor: usize,
    sequence: bool,
    /// The tensor group's traffic, and its totals when the step began and
    /// when its work ended (the loss's mean: evaluation comes after).
    traffic: Option<Arc<TensorTraffic>>,
    step_start: (u64, u64, u64),
    step_end: Option<(u64, u64, u64)>,
}

impl<E: Engine> TensorParallel<E> {
    /// `inner` over the data group; `world` every rank; the tensor groups
    /// have `tensor` ranks (`sequence`: with sequence parallelism); `mesh`
    /// describes the layout.
    pub fn new(
        inner: Box<dyn Strategy<E>>,
        world: Communicator,
        tensor: usize,
        sequence: bool,
        mesh: String,
    ) -> TensorParallel<E> {
        TensorParallel {
            inner,
            world,
            mesh,
            tensor,
            sequence,
            traffic: None,
            step_start: (0, 0, 0),
            step_end: None,
        }
    }

    /// Counts the tensor group's `traffic` into every step's
    /// communication ([`CommStep::tensor`]).
    pub fn counting(mut self, traffic: Arc<TensorTraffic>) -> TensorParallel<E> {
        self.traffic = Some(traffic);
        self
    }

    fn totals(&self) -> (u64, u64, u64) {
        self.traffic.as_ref().map_or((0, 0, 0), |t| t.totals())
    }
}

impl<E: Engine> Strategy<E> for TensorParallel<E> {
    fn describe(&self) -> String {
        format!(
            "tensor parallel over {} ranks{} x {} (mesh: {})",
            self.tensor,
            match self.sequence {
                true => " with sequence parallelism",
                false => "",
            },
            self.inner.describe(),
            self.mesh
        )
    }
    fn rank(&self) -> usize {
        self.world.rank()
    }
    fn replicas(&self) -> usize {
        self.inner.replicas()
    }
    fn start(&mut self, engine: &mut E) -> Result<()> {
        self.inner.start(engine)
    }
    fn new_grads(&mut self, engine: &mut E) -> Result<Flat<E>> {
        self.inner.new_grads(engine)
    }
    fn zero_grads(&mut self, engine: &mut E, grads: &mut Flat<E>) -> Result<()> {
        self.step_start = self.totals();
        self.step_end = None;
        self.inner.zero_grads(engine, grads)
    }
    fn forward(&mut self, engine: &mut E, batch: &E::Batch, grad: bool) -> Result<f32> {
        self.inner.forward(engine, batch, grad)
    }
    fn accumulate(&mut self, engine: &mut E, grads: &mut Flat<E>) -> Result<()> {
        self.inner.accumulate(engine, grads)
    }
    fn backward(
        &mut self,
        engine: &mut E,
        grads: &mut Flat<E>,
        timeline: &mut Timeline,
    ) -> Result<usize> {
        self.inner.backward(engine, grads, timeline)
    }
    fn before_update(&mut self, engine: &mut E, grads: &mut Flat<E>) -> Result<()> {
        self.inner.before_update(engine, grads)
    }
    fn grad_sq_norm(&mut self, engine: &mut E, grads: &Flat<E>) -> Result<f64> {
        self.inner.grad_sq_norm(engine, grads)
    }
    fn update(&mut self, engine: &mut E, grads: &Flat<E>, step: UpdateStep) -> Result<()> {
        self.inner.update(engine, grads, step)
    }
    fn after_update(&mut self, engine: &mut E) -> Result<()> {
        self.inner.after_update(engine)
    }
    fn mean(&mut self, values: &mut [f64]) -> Result<()> {
        if self.step_end.is_none() {
            self.step_end = Some(self.totals());
        }
        // Every rank of a tensor group holds the same loss: the world's
        // mean is the data groups'.
        self.world
            .all_reduce(values, ReduceOp::Sum)
            .map_err(|e| format!("the mean over every rank: {e}"))?;
        let n = self.world.size() as f64;
        values.iter_mut().for_each(|v| *v /= n);
        Ok(())
    }
    fn finish(&mut self, engine: &mut E) -> Result<()> {
        self.inner.finish(engine)
    }
    fn state_bytes(&self) -> StateBytes {
        self.inner.state_bytes()
    }
    fn sharded_bytes(&self) -> ShardedBytes {
        self.inner.sharded_bytes()
    }
    fn save_part(
        &mut self,
        engine: &mut E,
        staging: &mut crate::checkpoint::Staging,
    ) -> Result<StatePart>
    where
        E: Checkpointable,
    {
        self.inner.save_part(engine, staging)
    }
    fn save_ranges(&mut self, engine: &mut E) -> Result<Vec<std::ops::Range<usize>>>
    where
        E: Checkpointable,
    {
        self.inner.save_ranges(engine)
    }
    fn restore(&mut self, engine: &mut E, from: &dyn StateSource) -> Result<()>
    where
        E: Checkpointable,
    {
        self.inner.restore(engine, from)
    }
    fn lends_whole_grads(&self) -> bool {
        false
    }
    fn last_step(&self) -> CommStep {
        let (a, b) = (
            self.step_start,
            self.step_end.unwrap_or_else(|| self.totals()),
        );
        CommStep {
            tensor: TensorStep {
                collectives: b.0 - a.0,
                payload_bytes: b.1 - a.1,
                wire_bytes: b.2 - a.2,
            },
            ..self.inner.last_step()
        }
    }
    fn time_unoverlapped(&mut self, engine: &mut E, grads: &mut Flat<E>) -> Result<Option<f64>> {
        self.inner.time_unoverlapped(engine, grads)
    }
}

/// The whole model put together from every rank's share (`local`, laid
/// out by [`braid_model::Layout::tensor_parallel`] for this rank of
/// `comm`'s group): each rank's tensors gathered and placed where they
/// sit in the whole tensors. Every rank of the group calls it and gets
/// the whole parameters (for `--save`).
pub fn gather_whole(
    local: &braid_model::Params,
    comm: &dyn TensorComm,
) -> Result<braid_model::Params> {
    use braid_model::layout::{Layout, TensorShard};
    let cfg = local.layout.config;
    let n = comm.size();
    if local.data.len() != local.layout.len {
        return Err(format!(
            "putting the whole model together: this rank holds {} of its share's {} parameters",
            local.data.len(),
            local.layout.len
        ));
    }
    // Each rank's tensors one after another (no padding), in its layout's
    // order; ranks differ in length only by their vocabulary rows.
    let shares: Vec<Layout> = (0..n)
        .map(|rank| Layout::tensor_parallel(&cfg, TensorShard { rank, size: n }, 1))
        .collect::<Result<_>>()?;
    let longest = shares.iter().map(|l| l.len).max().unwrap_or(0);
    let mut mine = vec![0.0f32; longest];
    let mut at = 0;
    for p in &local.layout.params {
        mine[at..at + p.len].copy_from_slice(&local.data[p.range()]);
        at += p.len;
    }
    let mut all = vec![0.0f32; longest * n];
    comm.all_gather_f32(&mine, &mut all)
        .map_err(|e| format!("putting the whole model together: {e}"))?;
    let mut whole = braid_model::Params::zeros(std::sync::Arc::new(Layout::new(&cfg)));
    for (rank, share) in shares.iter().enumerate() {
        let values = &all[rank * longest..];
        let mut at = 0;
        for p in &share.params {
            let dst = whole
                .layout
                .get(&p.name)
                .ok_or_else(|| format!("the whole model has no tensor {}", p.name))?
                .range();
            match &p.place {
                // Held whole by every rank: the first's.
                None if rank == 0 => {
                    whole.data[dst].copy_from_slice(&values[at..at + p.len]);
                }
                None => {}
                Some(place) => place.put_into(&values[at..at + p.len], &mut whole.data[dst]),
            }
            at += p.len;
        }
    }
    Ok(whole)
}

/// The model's collectives over a GPU communicator (the tensor group,
/// NCCL): each queued after the model's stream's work, the stream's later
/// work after it; counted like [`HostTensorGroup`]'s.
pub struct DeviceTensorGroup {
    gpu: braid_comm::gpu::GpuCommunicator,
    traffic: Arc<TensorTraffic>,
    /// For collectives started beside the model's stream: a stream that
    /// waits for each (the model's stream goes on), and the event the
    /// model's stream then waits on; made at the first.
    started: std::sync::OnceLock<(braid_cuda::Stream, braid_cuda::Event)>,
}

impl DeviceTensorGroup {
    /// The tensor group's collectives over `gpu`.
    pub fn new(gpu: braid_comm::gpu::GpuCommunicator) -> DeviceTensorGroup {
        DeviceTensorGroup {
            gpu,
            traffic: Arc::new(TensorTraffic::default()),
            started: std::sync::OnceLock::new(),
        }
    }

    fn started(&self) -> Result<&(braid_cuda::Stream, braid_cuda::Event)> {
        if let Some(s) = self.started.get() {
            return Ok(s);
        }
        let device = self.gpu.device();
        let e = |x: braid_cuda::CudaError| format!("the tensor group's side stream: {x}");
        let made = (
            braid_cuda::Stream::new(device).map_err(e)?,
            braid_cuda::Event::new(device).map_err(e)?,
        );
        Ok(self.started.get_or_init(|| made))
    }

    /// What its collectives moved so far (shared).
    pub fn traffic(&self) -> Arc<TensorTraffic> {
        self.traffic.clone()
    }

    /// Queues the collective `start` launches (`what`, over `bytes` in
    /// all) after the model's `stream` and the stream's later work after
    /// it; traced as tensor-group communication and counted (each rank
    /// sends `rounds × (n - 1) / n` of the bytes: 2 for an all-reduce, 1
    /// for an all-gather or reduce-scatter).
    fn run<'a>(
        &'a self,
        what: &str,
        bytes: usize,
        rounds: f64,
        stream: &braid_cuda::Stream,
        start: impl FnOnce() -> braid_comm::Result<braid_comm::gpu::DeviceWork<'a>>,
    ) -> Result<()> {
        self.run_then(what, bytes, rounds, stream, stream, start)
    }

    /// [`run`](Self::run), with `then`'s later work ordered after the
    /// collective instead of `stream`'s.
    fn run_then<'a>(
        &'a self,
        what: &str,
        bytes: usize,
        rounds: f64,
        stream: &braid_cuda::Stream,
        then: &braid_cuda::Stream,
        start: impl FnOnce() -> braid_comm::Result<braid_comm::gpu::DeviceWork<'a>>,
    ) -> Result<()> {
        let _span = braid_trace::scope::start(Some(stream), Cat::TensorComm, || {
            format!("tensor {what} ({bytes} B)")
        });
        start()
            .and_then(|w| w.then_on(then))
            .map_err(|e| format!("{what} over the tensor group: {e}"))?;
        let (n, t) = (self.gpu.size() as f64, &self.traffic);
        t.collectives.fetch_add(1, Ordering::Relaxed);
        t.payload.fetch_add(bytes as u64, Ordering::Relaxed);
        t.wire.fetch_add(
            (bytes as f64 * rounds * (n - 1.0) / n) as u64,
            Ordering::Relaxed,
        );
        Ok(())
    }
}

impl braid_model::tensor_comm::DeviceTensorComm for DeviceTensorGroup {
    fn size(&self) -> usize {
        self.gpu.size()
    }
    fn rank(&self) -> usize {
        self.gpu.rank()
    }
    fn all_reduce_f32(
        &self,
        x: braid_cuda::DeviceViewMut<'_, f32>,
        op: ReduceKind,
        stream: &braid_cuda::Stream,
    ) -> Result<()> {
        let bytes = 4 * braid_cuda::DeviceMem::dlen(&x);
        self.run("all_reduce", bytes, 2.0, stream, || {
            self.gpu.all_reduce_view(x, op_of(op))
        })
    }
    fn all_reduce_bf16(
        &self,
        x: braid_cuda::DeviceViewMut<'_, half::bf16>,
        stream: &braid_cuda::Stream,
    ) -> Result<()> {
        let bytes = 2 * braid_cuda::DeviceMem::dlen(&x);
        self.run("all_reduce bf16", bytes, 2.0, stream, || {
            self.gpu.all_reduce_view(x, ReduceOp::Sum)
        })
    }
    fn all_gather_f32(
        &self,
        full: braid_cuda::DeviceViewMut<'_, f32>,
        stream: &braid_cuda::Stream,
    ) -> Result<()> {
        let bytes = 4 * braid_cuda::DeviceMem::dlen(&full);
        self.run("all_gather", bytes, 1.0, stream, || {
            self.gpu.all_gather_view(full)
        })
    }
    fn reduce_scatter_f32(
        &self,
        full: braid_cuda::DeviceViewMut<'_, f32>,
        stream: &braid_cuda::Stream,
    ) -> Result<()> {
        let bytes = 4 * braid_cuda::DeviceMem::dlen(&full);
        self.run("reduce_scatter", bytes, 1.0, stream, || {
            self.gpu.reduce_scatter_view(full, ReduceOp::Sum)
        })
    }
    fn all_gather_bf16(
        &self,
        full: braid_cuda::DeviceViewMut<'_, half::bf16>,
        stream: &braid_cuda::Stream,
    ) -> Result<()> {
        let bytes = 2 * braid_cuda::DeviceMem::dlen(&full);
        self.run("all_gather bf16", bytes, 1.0, stream, || {
            self.gpu.all_gather_view(full)
        })
    }
    fn reduce_scatter_bf16(
        &self,
        full: braid_cuda::DeviceViewMut<'_, half::bf16>,
        stream: &braid_cuda::Stream,
    ) -> Result<()> {
        let bytes = 2 * braid_cuda::DeviceMem::dlen(&full);
        self.run("reduce_scatter bf16", bytes, 1.0, stream, || {
            self.gpu.reduce_scatter_view(full, ReduceOp::Sum)
        })
    }
    fn host_sum_f64(&self, x: &mut [f64]) -> Result<()> {
        self.gpu
            .host()
            .all_reduce(x, ReduceOp::Sum)
            .map_err(|e| format!("a sum over the tensor group: {e}"))
    }
    fn start_all_reduce_f32(
        &self,
        x: braid_cuda::DeviceViewMut<'_, f32>,
        stream: &braid_cuda::Stream,
    ) -> Result<()> {
        let bytes = 4 * braid_cuda::DeviceMem::dlen(&x);
        let (side, _) = self.started()?;
        self.run_then("all_reduce", bytes, 2.0, stream, side, || {
            self.gpu.all_reduce_view(x, ReduceOp::Sum)
        })
    }
    fn start_all_reduce_bf16(
        &self,
        x: braid_cuda::DeviceViewMut<'_, half::bf16>,
        stream: &braid_cuda::Stream,
    ) -> Result<()> {
        let bytes = 2 * braid_cuda::DeviceMem::dlen(&x);
        let (side, _) = self.started()?;
        self.run_then("all_reduce bf16", bytes, 2.0, stream, side, || {
            self.gpu.all_reduce_view(x, ReduceOp::Sum)
        })
    }
    fn wait_started(&self, stream: &braid_cuda::Stream) -> Result<()> {
        let (side, joined) = self.started()?;
        let e = |x: braid_cuda::CudaError| format!("waiting for the tensor group's sums: {x}");
        joined.record(side).map_err(e)?;
        stream.wait_event(joined).map_err(e)
    }
}
