//! [`DeviceCollective`]: reduction sessions on one GPU per process through
//! a [`GpuCommunicator`] (NCCL).
//!
//! Launching a bucket records an event on the device's own stream (where
//! the engine computes), makes the communication stream wait for it and
//! queues the bucket's all-reduce there — the host does not wait. The
//! hooks queue their kernels on the communication stream around the NCCL
//! calls (casts; PowerSGD's products, orthogonalisation and error
//! feedback), so they overlap the backward pass too. The session ends with
//! the host waiting for every bucket (by then the whole backward pass is
//! queued): each wait watches NCCL's errors, the peers' health and the
//! timeout, so a dead or stuck peer becomes an error, not a hang.

use super::copy_engine::{nccl_tail, AllReduceChoice, CopyEngineReduce};
use super::core::{Bucket, Collective, Drive, During, End, GatherPart, ScatterPart};
use super::exchange::{block_of, check_exchange};
use super::grad_comm::GradComm;
use super::host::{count, count_half};
use super::powersgd::{self, MatOps, PowerSgdState};
use super::symmetric_blocks::Wish;
use crate::cuda::HookKernels;
use crate::space::{Gpu, Window};
use crate::strategy::CommStep;
use crate::Result;
use braid_comm::gpu::{DeviceWork, GpuCommunicator, Lane};
use braid_comm::{Communicator, ReduceOp};
use braid_core::Element;
use braid_cuda::blas::Blas;
use braid_cuda::memory::copy_async;
use braid_cuda::{CudaError, DeviceBuffer, DeviceMem, DeviceViewMut, DeviceWindow};
use half::{bf16, f16};
use std::ops::Range;
use std::sync::Mutex;

/// Whether plain buckets go through the copy engines.
enum CopyEngineSlot {
    /// Not decided yet (no session so far): what was asked for.
    Unset(AllReduceChoice),
    /// Through the copy engines, for the registered gradient buffer.
    Set(Box<CopyEngineReduce>),
    /// Through NCCL.
    Nccl,
}

/// GPU collectives over a [`GpuCommunicator`] (one GPU per process).
pub struct DeviceCollective {
    gpu: GpuCommunicator,
    kernels: HookKernels,
    blas: Mutex<Blas>,
    /// Plain buckets through the copy engines instead of NCCL where they
    /// can serve (`BRAID_GPU_ALLREDUCE`): decided at the first session.
    copy_engine: Mutex<CopyEngineSlot>,
    /// Whether block buffers are registered as NCCL symmetric windows, so
    /// that the parameter-sharded all-gathers into them run on the copy
    /// engines (`BRAID_ZERO3_GATHER_VIA`): this rank's wish, and the
    /// ranks' answer once agreed (at the first block buffer).
    symmetric_blocks: (Wish, Mutex<Option<bool>>),
}

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

impl DeviceCollective {
    /// Collectives over `gpu`, with the hook kernels loaded on its GPU.
    pub fn new(gpu: GpuCommunicator) -> Result<DeviceCollective> {
        let device = gpu.device().clone();
        let choice = AllReduceChoice::from_env()?;
        let most = super::copy_engine::MAX_RANKS;
        if choice == AllReduceChoice::CopyEngines && !(2..=most).contains(&gpu.size()) {
            return Err(format!(
                "BRAID_GPU_ALLREDUCE=ce needs 2 to {most} ranks of one host, not {} (use auto or \
                 nccl)",
                gpu.size()
            ));
        }
        let copy_engine = CopyEngineSlot::Unset(choice);
        let symmetric_blocks = (Wish::from_env()?, Mutex::new(None));
        Ok(DeviceCollective {
            symmetric_blocks,
            kernels: HookKernels::load(&device).map_err(err)?,
            blas: Mutex::new(Blas::new(&device).map_err(err)?),
            copy_engine: Mutex::new(copy_engine),
            gpu,
        })
    }

    /// The NCCL communicator.
    pub fn gpu(&self) -> &GpuCommunicator {
        &self.gpu
    }
}

/// The GPU hooks' state.
pub enum DeviceHooks {
    /// Nothing to keep.
    Plain,
    /// A bf16 copy of the gradient buffer (each bucket its slot).
    Bf16(DeviceBuffer<bf16>),
    /// An fp16 copy of the gradient buffer.
    Fp16(DeviceBuffer<f16>),
    /// PowerSGD's per-bucket state.
    PowerSgd(Box<PowerSgdState<DeviceBuffer<f32>>>),
}

fn split_like<'h, T: Element>(
    w: &mut DeviceWindow<'h, T>,
    b: &Bucket,
) -> Result<DeviceViewMut<'h, T>> {
    match b.end {
        End::Back => Window::split_off_back(w, b.range.start),
        End::Front => Window::split_off_front(w, b.range.end),
    }
}

impl Collective for DeviceCollective {
    type Space = Gpu;
    type Hooks = DeviceHooks;

    fn rank(&self) -> usize {
        self.gpu.rank()
    }

    fn size(&self) -> usize {
        self.gpu.size()
    }

    fn host(&self) -> &Communicator {
        self.gpu.host()
    }

    fn backend(&self) -> String {
        "nccl".into()
    }

    fn broadcast(&self, flat: &mut DeviceBuffer<f32>, root: usize) -> Result<()> {
        self.gpu
            .broadcast(flat, root)
            .map_err(err)?
            .wait()
            .map_err(err)
    }

    fn hooks(&self, comm: GradComm, buckets: &[Bucket]) -> Result<DeviceHooks> {
        let len = buckets.iter().map(|b| b.range.end).max().unwrap_or(0);
        let device = self.gpu.device();
        Ok(match comm {
            GradComm::Plain => DeviceHooks::Plain,
            GradComm::Bf16 => DeviceHooks::Bf16(DeviceBuffer::zeros(device, len).map_err(err)?),
            GradComm::Fp16 => DeviceHooks::Fp16(DeviceBuffer::zeros(device, len).map_err(err)?),
            GradComm::PowerSgd(o) => {
                DeviceHooks::PowerSgd(Box::new(PowerSgdState::new(o, buckets)?))
            }
            GradComm::TopK(_) => {
                return Err(
                    "--grad-comm topk compresses a parameter server's pushes (--ps N): \
                            an all-reduce sums dense buckets"
                        .into(),
                )
            }
        })
    }

    fn reduce<'g>(
        &self,
        grads: DeviceWindow<'g, f32>,
        buckets: &[Bucket],
        hooks: &mut DeviceHooks,
        drive: &mut Drive<'_, 'g, Gpu>,
    ) -> Result<CommStep> {
        let n = self.gpu.size();
        let k = &self.kernels;
        let mut step = CommStep::default();
        let mut works: Vec<DeviceWork<'_>> = Vec::new();
        let bucket = |i: usize| {
            buckets
                .get(i)
                .ok_or_else(|| format!("bucket {i} was never planned"))
        };
        if let DeviceHooks::Plain = hooks {
            let base = grads.view(0..0).map_err(err)?.dptr();
            let len = grads.range().end;
            let mut slot = self.copy_engine.lock().unwrap_or_else(|p| p.into_inner());
            let choice = match &*slot {
                CopyEngineSlot::Unset(c) => Some(*c),
                CopyEngineSlot::Set(ce) if !ce.registered(base, len) => {
                    Some(AllReduceChoice::CopyEngines)
                }
                _ => None,
            };
            if let Some(choice) = choice {
                *slot = match CopyEngineReduce::new(
                    self.gpu.host(),
                    self.gpu.device(),
                    base,
                    len,
                    buckets.len(),
                    choice,
                )? {
                    Some(ce) => CopyEngineSlot::Set(Box::new(ce)),
                    None => CopyEngineSlot::Nccl,
                };
            }
            if let CopyEngineSlot::Set(ce) = &mut *slot {
                ce.begin_step(&self.gpu)?;
                let main = self.gpu.device().main_stream();
                let lens: Vec<usize> = buckets.iter().map(|b| b.range.len()).collect();
                let tail = nccl_tail(&lens, n);
                let r = drive(grads, &mut |i, part| {
                    count(&mut step, 4 * part.len() as u64, n);
                    if i >= tail {
                        works.push(self.gpu.all_reduce_view(part, ReduceOp::Sum).map_err(err)?);
                        return Ok(());
                    }
                    ce.launch(k, i, bucket(i)?.range.clone(), &main)
                });
                let mut waited = ce.wait(k, &self.gpu, &main);
                for w in works {
                    let r = w.wait().map_err(err);
                    if waited.is_ok() {
                        waited = r;
                    }
                }
                r?;
                waited?;
                step.in_stream_s = ce.in_stream_s();
                step.via = match tail < buckets.len() {
                    true => "the copy engines (NVLink), the last buckets NCCL",
                    false => "the copy engines (NVLink)",
                };
                return Ok(step);
            }
        }
        let result = match hooks {
            DeviceHooks::Plain => drive(grads, &mut |_, part| {
                count(&mut step, 4 * part.len() as u64, n);
                works.push(self.gpu.all_reduce_view(part, ReduceOp::Sum).map_err(err)?);
                Ok(())
            }),
            DeviceHooks::Bf16(copy) => {
                self.reduce_half(grads, buckets, copy, drive, &mut step, &mut works, 1.0, 1.0)
            }
            // Pre-divided by the ranks so the sum stays in fp16's range.
            DeviceHooks::Fp16(copy) => self.reduce_half(
                grads,
                buckets,
                copy,
                drive,
                &mut step,
                &mut works,
                1.0 / n as f32,
                n as f32,
            ),
            DeviceHooks::PowerSgd(state) => {
                let compressing = state.compressing();
                let r = drive(grads, &mut |i, part| {
                    if !compressing {
                        count(&mut step, 4 * part.len() as u64, n);
                        works.push(self.gpu.all_reduce_view(part, ReduceOp::Sum).map_err(err)?);
                        return Ok(());
                    }
                    let mut blas = self.blas.lock().unwrap_or_else(|p| p.into_inner());
                    let mut sent = Ok(CommStep::default());
                    let w = self.gpu.queue("PowerSGD", false, |lanes| {
                        let mut ops = DeviceOps {
                            lane: &mut lanes[0],
                            k,
                            blas: &mut blas,
                            device: self.gpu.device(),
                            _grads: std::marker::PhantomData,
                        };
                        sent = powersgd::compress(&mut ops, state, i, part, n);
                        sent.as_ref()
                            .map(|_| ())
                            .map_err(|e| CudaError::Invalid(e.clone()))
                    });
                    works.push(w.map_err(err)?);
                    step.add(sent?);
                    Ok(())
                });
                state.end_step();
                r
            }
        };
        // Wait for every bucket on the host — also after a failure, so
        // that no buffer is reused under a running reduction. By now the
        // whole backward pass is queued, so the device has nothing else to
        // do meanwhile; waiting here (instead of only ordering the
        // engine's stream after the reductions) is what bounds a dead or
        // stuck peer: each wait checks NCCL's errors, the host
        // communicator's health and the timeout, and aborts NCCL.
        let mut waited = Ok(());
        for w in works {
            let r = w.wait().map_err(err);
            if waited.is_ok() {
                waited = r;
            }
        }
        result?;
        waited?;
        step.via = "NCCL";
        Ok(step)
    }

    fn reduce_scatter<'g>(
        &self,
        grads: DeviceWindow<'g, f32>,
        buckets: &[Bucket],
        drive: &mut Drive<'_, 'g, Gpu>,
    ) -> Result<CommStep> {
        let n = self.gpu.size();
        let mut step = CommStep::default();
        let mut works: Vec<DeviceWork<'_>> = Vec::new();
        let result = drive(grads, &mut |i, part| {
            if i >= buckets.len() {
                return Err(format!("bucket {i} was never planned"));
            }
            block_of(&(0..part.len()), self.gpu.rank(), n)?;
            count_half(&mut step, 4 * part.len() as u64, n);
            let work = self.gpu.reduce_scatter_view(part, ReduceOp::Sum);
            works.push(work.map_err(err)?);
            Ok(())
        });
        // As in `reduce`: every bucket is waited for, also after a failure.
        let waited = wait_all(works);
        result?;
        waited?;
        step.via = "NCCL";
        Ok(step)
    }

    fn zeros(&self, len: usize) -> Result<DeviceBuffer<f32>> {
        DeviceBuffer::zeros(self.gpu.device(), len).map_err(err)
    }

    fn block_buffer(&self, len: usize) -> Result<DeviceBuffer<f32>> {
        match self.symmetric_blocks()? {
            true => self
                .gpu
                .symmetric_zeros(len)
                .map_err(|e| format!("a block buffer in an NCCL symmetric window: {e}")),
            false => self.zeros(len),
        }
    }

    fn block_buffers_kept(&self) -> bool {
        self.symmetric_agreed()
    }

    fn all_gather_ranges(
        &self,
        flat: &mut DeviceBuffer<f32>,
        ranges: &[Range<usize>],
    ) -> Result<CommStep> {
        let (n, rank) = (self.gpu.size(), self.gpu.rank());
        let mut step = CommStep::default();
        self.on_ranges(flat, ranges, &mut |part| {
            block_of(&(0..part.len()), rank, n)?;
            count_half(&mut step, 4 * part.len() as u64, n);
            self.gpu.all_gather_view(part).map_err(err)
        })
        .map_err(|e| format!("all-gather: {e}"))?;
        step.via = "NCCL";
        Ok(step)
    }

    fn all_reduce_ranges(
        &self,
        flat: &mut DeviceBuffer<f32>,
        ranges: &[Range<usize>],
    ) -> Result<CommStep> {
        let n = self.gpu.size();
        let mut step = CommStep::default();
        self.on_ranges(flat, ranges, &mut |part| {
            count(&mut step, 4 * part.len() as u64, n);
            self.gpu.all_reduce_view(part, ReduceOp::Sum).map_err(err)
        })
        .map_err(|e| format!("all-reduce: {e}"))?;
        step.via = "NCCL";
        Ok(step)
    }

    fn shard_exchange(
        &self,
        master: &DeviceBuffer<f32>,
        gathers: &mut [GatherPart<'_, DeviceBuffer<f32>>],
        shard_grads: &mut DeviceBuffer<f32>,
        scatters: &mut [ScatterPart<'_, DeviceBuffer<f32>>],
        during: &mut During<'_>,
    ) -> Result<CommStep> {
        let (n, rank) = (self.gpu.size(), self.gpu.rank());
        check_exchange(
            n,
            master.len(),
            gathers,
            shard_grads.len(),
            scatters,
            DeviceBuffer::len,
        )?;
        let mut step = CommStep::default();
        if gathers.is_empty() && scatters.is_empty() {
            during()?;
            return Ok(step);
        }
        // bf16 gathers: this rank's elements, rounded, into its own place
        // of the block (the all-gather below then runs in place), on the
        // communication stream after the engine's work queued so far (the
        // update that wrote the master shard).
        let casts = match gathers.iter().any(|g| g.half) {
            false => None,
            true => Some(
                self.gpu
                    .queue("shard exchange (bf16 casts)", false, |lanes| {
                        let s = lanes[0].stream();
                        for g in gathers.iter().filter(|g| g.half) {
                            let k = g.from.len();
                            let own = Bf16Part::of(g.into, g.at, rank * k, k);
                            self.kernels.pack::<bf16>(
                                s,
                                &mut { own },
                                &master.view(g.from.clone()),
                                1.0,
                            )?;
                        }
                        Ok(())
                    })
                    .map_err(err)?,
            ),
        };
        // One NCCL group, ordered after everything queued on the engine's
        // stream so far (the units that wrote the gradients and last read
        // the recycled buffers), not after the unit `during` queues next.
        let collectives = self.gpu.queue(
            "shard exchange (all-gather/reduce-scatter)",
            true,
            |lanes| {
                let lane = &mut lanes[0];
                for g in gathers.iter_mut() {
                    let k = g.from.len();
                    if g.half {
                        lane.all_gather_mem::<bf16>(&mut Bf16Part::of(g.into, g.at, 0, n * k))?;
                        continue;
                    }
                    let mut into = g.into.view_mut(g.at..g.at + n * k);
                    lane.all_gather_mem_into(&master.view(g.from.clone()), &mut into)?;
                }
                for sc in scatters.iter_mut() {
                    lane.reduce_scatter_mem(&mut *sc.grads, ReduceOp::Sum)?;
                }
                Ok(())
            },
        );
        let collectives = collectives.map_err(err)?;
        for g in gathers.iter() {
            let size = if g.half { 2 } else { 4 };
            count_half(&mut step, size * (n * g.from.len()) as u64, n);
        }
        for sc in scatters.iter() {
            count_half(&mut step, 4 * sc.grads.len() as u64, n);
        }
        // This rank's block of each sum, copied (the step's first
        // micro-batch) or added (micro-batches accumulate) into the shard's
        // gradients on the communication stream.
        let adds = match scatters.is_empty() {
            true => None,
            false => Some(
                self.gpu
                    .queue("shard exchange (add the reduced block)", false, |lanes| {
                        let s = lanes[0].stream();
                        for sc in scatters.iter() {
                            let k = sc.to.len();
                            let mine = sc.grads.view(rank * k..(rank + 1) * k);
                            let mut to = shard_grads.view_mut(sc.to.clone());
                            match sc.add {
                                true => self.kernels.add_into(s, &mut to, &mine)?,
                                false => copy_async(&mut to, &mine, s)?,
                            }
                        }
                        Ok(())
                    })
                    .map_err(err)?,
            ),
        };
        // The unit computes meanwhile. Then the host waits for the
        // exchange (with NCCL's errors, the peers' health and the
        // timeout watched) before anything later is queued: the next unit
        // reads the gathered blocks, and the scattered buffers are reused.
        let computed = during();
        let mut waited = match casts {
            Some(c) => c.wait().map_err(err),
            None => Ok(()),
        };
        let r = collectives.wait().map_err(err);
        if waited.is_ok() {
            waited = r;
        }
        if let Some(adds) = adds {
            let r = adds.wait().map_err(err);
            if waited.is_ok() {
                waited = r;
            }
        }
        computed?;
        waited?;
        step.via = self.exchange_via();
        Ok(step)
    }

    fn half_gathers(&self) -> bool {
        true
    }

    fn split(&self, color: u32, key: usize) -> Result<DeviceCollective> {
        let gpu = self
            .gpu
            .split(Some(color), key as i64)
            .map_err(err)?
            .ok_or("split: this rank joined no communicator")?;
        DeviceCollective::new(gpu)
    }
}

impl DeviceCollective {
    /// Whether block buffers are symmetric windows: agreed by all ranks at
    /// the first call (every rank's first block buffer), remembered after.
    /// Where `auto` falls back to NCCL's kernels, rank 0 says why.
    fn symmetric_blocks(&self) -> Result<bool> {
        let (wish, agreed) = &self.symmetric_blocks;
        let mut agreed = agreed.lock().expect("symmetric-blocks lock");
        if agreed.is_none() {
            let answer = wish.agree(self.gpu.host())?;
            if let (Some(why), 0) = (&answer.fallback, self.gpu.host().rank()) {
                eprintln!(
                    "[rank 0] note: ZeRO-3's gathers run on NCCL's kernels, not the copy \
                     engines: {why}"
                );
            }
            *agreed = Some(answer.copy_engines);
        }
        Ok(agreed.expect("set above"))
    }

    /// Whether the ranks agreed on symmetric block buffers (false before
    /// the first).
    fn symmetric_agreed(&self) -> bool {
        *self
            .symmetric_blocks
            .1
            .lock()
            .expect("symmetric-blocks lock")
            == Some(true)
    }

    /// How the shard exchanges travel, for the summary.
    fn exchange_via(&self) -> &'static str {
        match self.symmetric_agreed() {
            true => "NCCL, the gathers on the copy engines",
            false => "NCCL",
        }
    }

    /// Queues `op` on each of `ranges` of `flat` (views split off a window
    /// in increasing order) and waits for all of them.
    fn on_ranges<'a>(
        &'a self,
        flat: &'a mut DeviceBuffer<f32>,
        ranges: &[Range<usize>],
        op: &mut dyn FnMut(DeviceViewMut<'a, f32>) -> Result<DeviceWork<'a>>,
    ) -> Result<()> {
        let mut sorted: Vec<&Range<usize>> = ranges.iter().collect();
        sorted.sort_by_key(|r| r.start);
        let mut window = flat.window();
        let mut works: Vec<DeviceWork<'_>> = Vec::new();
        let mut result = Ok(());
        for r in sorted {
            let queued = Window::split_off_front(&mut window, r.start)
                .and_then(|_| Window::split_off_front(&mut window, r.end))
                .and_then(&mut *op);
            match queued {
                Ok(w) => works.push(w),
                Err(e) => {
                    result = Err(format!("elements {r:?} (of ranges {ranges:?}): {e}"));
                    break;
                }
            }
        }
        let waited = wait_all(works);
        result?;
        waited
    }
}

/// Waits for every one of `works`; the first error, if any.
fn wait_all(works: Vec<DeviceWork<'_>>) -> Result<()> {
    let mut waited = Ok(());
    for w in works {
        let r = w.wait().map_err(err);
        if waited.is_ok() {
            waited = r;
        }
    }
    waited
}

impl DeviceCollective {
    /// A half-precision session: each launched bucket, multiplied by
    /// `pre`, is cast into its slot of `copy`, all-reduced and cast back
    /// multiplied by `post`, all on the communication stream.
    #[allow(clippy::too_many_arguments)]
    fn reduce_half<'a, 'g, H: Element>(
        &'a self,
        grads: DeviceWindow<'g, f32>,
        buckets: &[Bucket],
        copy: &mut DeviceBuffer<H>,
        drive: &mut Drive<'_, 'g, Gpu>,
        step: &mut CommStep,
        works: &mut Vec<DeviceWork<'a>>,
        pre: f32,
        post: f32,
    ) -> Result<()> {
        let (n, k) = (self.gpu.size(), &self.kernels);
        let mut halves = copy.window();
        drive(grads, &mut |i, mut part| {
            let b = buckets
                .get(i)
                .ok_or_else(|| format!("bucket {i} was never planned"))?;
            let mut h = split_like(&mut halves, b)?;
            count(step, 2 * h.len() as u64, n);
            let w = self
                .gpu
                .queue("all_reduce (half precision)", false, |lanes| {
                    let l = &mut lanes[0];
                    k.pack(l.stream(), &mut h, &part, pre)?;
                    l.all_reduce_mem(&mut h, ReduceOp::Sum)?;
                    k.unpack(l.stream(), &mut part, &h, post)
                });
            works.push(w.map_err(err)?);
            Ok(())
        })
    }
}

/// [`MatOps`] on the GPU: kernels and cuBLAS products queued on a lane's
/// (the communication) stream, all-reduces through the lane.
struct DeviceOps<'l, 'c, 'g> {
    lane: &'l mut Lane<'c>,
    k: &'l HookKernels,
    blas: &'l mut Blas,
    device: &'l braid_cuda::Device,
    _grads: std::marker::PhantomData<&'g mut ()>,
}

fn cu(e: CudaError) -> String {
    e.to_string()
}

impl<'g> MatOps for DeviceOps<'_, '_, 'g> {
    type Buf = DeviceBuffer<f32>;
    type Grad = DeviceViewMut<'g, f32>;

    fn alloc(&mut self, n: usize) -> Result<DeviceBuffer<f32>> {
        DeviceBuffer::zeros(self.device, n).map_err(cu)
    }

    fn add_into(&mut self, g: &mut DeviceViewMut<'g, f32>, e: &DeviceBuffer<f32>) -> Result<()> {
        self.k.add_into(self.lane.stream(), g, e).map_err(cu)
    }

    fn copy_from(&mut self, dst: &mut DeviceBuffer<f32>, g: &DeviceViewMut<'g, f32>) -> Result<()> {
        braid_cuda::memory::copy_async(dst, g, self.lane.stream()).map_err(cu)
    }

    fn reduce_span(&mut self, g: &mut DeviceViewMut<'g, f32>, span: Range<usize>) -> Result<()> {
        self.lane
            .all_reduce_mem(&mut g.sub_mut(span), ReduceOp::Sum)
            .map_err(cu)
    }

    fn set(&mut self, dst: &mut DeviceBuffer<f32>, off: usize, values: &[f32]) -> Result<()> {
        if off != 0 || values.len() != dst.len() {
            return Err(format!(
                "PowerSGD: setting {} values at {off} of a buffer of {}",
                values.len(),
                dst.len()
            ));
        }
        // Synchronous (the first compressed step only).
        dst.copy_from_host(values).map_err(cu)
    }

    fn orthogonalize(
        &mut self,
        m: &mut DeviceBuffer<f32>,
        off: usize,
        rows: usize,
        cols: usize,
        eps: f32,
    ) -> Result<()> {
        self.k
            .orthogonalize(
                self.lane.stream(),
                &mut m.view_mut(off..off + rows * cols),
                rows,
                cols,
                eps,
            )
            .map_err(cu)
    }

    fn m_q(
        &mut self,
        p: &mut DeviceBuffer<f32>,
        po: usize,
        g: &DeviceViewMut<'g, f32>,
        mo: usize,
        q: &DeviceBuffer<f32>,
        qo: usize,
        n: usize,
        m: usize,
        r: usize,
    ) -> Result<()> {
        self.blas
            .gemm_rm(
                self.lane.stream(),
                &mut p.view_mut(po..po + n * r),
                &g.sub(mo..mo + n * m),
                false,
                &q.view(qo..qo + m * r),
                false,
                n,
                r,
                m,
                false,
            )
            .map_err(cu)
    }

    fn mt_p(
        &mut self,
        q: &mut DeviceBuffer<f32>,
        qo: usize,
        g: &DeviceViewMut<'g, f32>,
        mo: usize,
        p: &DeviceBuffer<f32>,
        po: usize,
        n: usize,
        m: usize,
        r: usize,
    ) -> Result<()> {
        self.blas
            .gemm_rm(
                self.lane.stream(),
                &mut q.view_mut(qo..qo + m * r),
                &g.sub(mo..mo + n * m),
                true,
                &p.view(po..po + n * r),
                false,
                m,
                r,
                n,
                false,
            )
            .map_err(cu)
    }

    fn p_qt(
        &mut self,
        g: &mut DeviceViewMut<'g, f32>,
        mo: usize,
        p: &DeviceBuffer<f32>,
        po: usize,
        q: &DeviceBuffer<f32>,
        qo: usize,
        n: usize,
        m: usize,
        r: usize,
    ) -> Result<()> {
        self.blas
            .gemm_rm(
                self.lane.stream(),
                &mut g.sub_mut(mo..mo + n * m),
                &p.view(po..po + n * r),
                false,
                &q.view(qo..qo + m * r),
                true,
                n,
                m,
                r,
                false,
            )
            .map_err(cu)
    }

    fn all_reduce(&mut self, b: &mut DeviceBuffer<f32>) -> Result<()> {
        self.lane.all_reduce_mem(b, ReduceOp::Sum).map_err(cu)
    }

    fn residual(
        &mut self,
        e: &mut DeviceBuffer<f32>,
        before: &DeviceBuffer<f32>,
        g: &DeviceViewMut<'g, f32>,
        scale: f32,
    ) -> Result<()> {
        self.k
            .residual_error(self.lane.stream(), e, before, g, scale)
            .map_err(cu)
    }
}

/// bf16 elements `at..at + len` (counted in bf16) of the part of an f32
/// buffer that starts at f32 element `from`: where a bf16 gather packs its
/// block, two values to an f32 element.
struct Bf16Part {
    ptr: u64,
    len: usize,
}

impl Bf16Part {
    /// `len` bf16 values from bf16 index `at` past f32 element `from` of
    /// `buf` (checked by the caller's `check_exchange`: the block fits).
    fn of(buf: &DeviceBuffer<f32>, from: usize, at: usize, len: usize) -> Bf16Part {
        Bf16Part {
            ptr: buf.view(0..0).dptr() + 4 * from as u64 + 2 * at as u64,
            len,
        }
    }
}

impl DeviceMem<bf16> for Bf16Part {
    fn dptr(&self) -> u64 {
        self.ptr
    }
    fn dlen(&self) -> usize {
        self.len
    }
}
