//! [`CopyEngineReduce`]: summing gradient buckets between the two GPUs of
//! two processes on one host with the GPUs' copy engines instead of
//! NCCL's kernels — the default for 2 ranks on one host with peer access
//! (`BRAID_GPU_ALLREDUCE=auto`; `ce` insists on it, `nccl` turns it off).
//!
//! NCCL moves bytes with SMs; running beside the backward pass, its
//! kernels slow the backward pass's own (`BENCHMARKS.md`). Here the bytes
//! travel by DMA over NVLink and only a short reduction kernel runs:
//!
//! 1. when a bucket is final, each rank copies the half the other rank
//!    owns into the other's landing buffer (peer memory mapped through
//!    CUDA IPC) and raises the other's flag — on a stream of its own;
//! 2. after the engine's next unit of work, the engine's own stream waits
//!    for its flag (long raised by then) and adds the landed half into
//!    its own — between the engine's kernels, not beside them;
//! 3. a second stream copies the summed half into the other's gradient
//!    buffer and raises the other's second flag, then waits for its own.
//!
//! Every bucket of a step has its own pair of flags and every step uses a
//! larger flag value, so flags never need resetting. The host waits only
//! at the end of the session, polling with the communicator's health and
//! timeout. Each step's reduction is one operation of the GPU
//! communicator ([`OutsideOp`]: numbered, in the flight recorder), so a
//! rank stopped in or before it is named by the one that times out. A
//! failed wait raises this rank's own flags, releasing its streams (a
//! stream waiting for a flag that never comes would otherwise block the
//! process's exit). `BRAID_CE_TRACE=STEP` prints one step's timeline per
//! rank.

use crate::cuda::HookKernels;
use crate::Result;
use braid_comm::gpu::{GpuCommunicator, OutsideOp};
use braid_comm::Communicator;
use braid_cuda::ipc::{copy_raw_async, wait_flag_async, write_flag_async, IpcHandle, PeerMemory};
use braid_cuda::{Device, DeviceBuffer, DeviceMem, Event, Stream};
use braid_trace::Cat;
use std::ops::Range;
use std::time::{Duration, Instant};

fn e(x: impl std::fmt::Display) -> String {
    x.to_string()
}

/// How gradients are summed between GPUs (`BRAID_GPU_ALLREDUCE`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AllReduceChoice {
    /// The copy engines where they can serve (2 ranks on one host, with
    /// peer access), NCCL otherwise.
    Auto,
    /// The copy engines, or an error saying why not.
    CopyEngines,
    /// NCCL always.
    Nccl,
}

impl AllReduceChoice {
    /// The choice in `BRAID_GPU_ALLREDUCE` (`auto` when unset).
    pub fn from_env() -> Result<AllReduceChoice> {
        match std::env::var("BRAID_GPU_ALLREDUCE").as_deref() {
            Err(_) | Ok("auto") | Ok("") => Ok(AllReduceChoice::Auto),
            Ok("ce") => Ok(AllReduceChoice::CopyEngines),
            Ok("nccl") => Ok(AllReduceChoice::Nccl),
            Ok(other) => Err(format!(
                "BRAID_GPU_ALLREDUCE={other:?}: expected auto, ce or nccl"
            )),
        }
    }
}

/// Copy-engine reduction of one gradient buffer between 2 ranks.
pub struct CopyEngineReduce {
    rank: usize,
    /// Copies out (stage 1).
    out: Stream,
    /// Copies back (stage 3).
    back: Stream,
    landing: DeviceBuffer<f32>,
    flags: DeviceBuffer<i32>,
    peer_grads: PeerMemory,
    peer_landing: PeerMemory,
    peer_flags: PeerMemory,
    /// Device address of element 0 of the registered gradient buffer.
    grads: u64,
    len: usize,
    step: u32,
    /// The next bucket slot of this step (its flags are `2j`, `2j + 1`).
    next: usize,
    /// Buckets copied out and not yet summed: (bucket, elements, slot).
    /// Buckets copied out and not yet summed: (bucket, range, slot, the
    /// start of its trace span).
    pending: Vec<(
        usize,
        Range<usize>,
        usize,
        Option<braid_trace::device::Mark>,
    )>,
    ready: Event,
    summed: Event,
    done: [Event; 2],
    /// Per slot, timed events around the sum on the engine's stream (its
    /// flag wait and its kernel) queued inside the backward pass, and
    /// whether the slot's pair was recorded this step.
    sums: Vec<(Event, Event, bool)>,
    /// Whether the engine's backward pass is still being queued (the
    /// sums queued then sit between its units, not after them).
    in_backward: bool,
    /// Seconds the engine's stream spent on this step's sums inside the
    /// backward pass (known after [`wait`](Self::wait)).
    in_stream_s: f64,
    /// This step's operation on the GPU communicator.
    op: Option<OutsideOp>,
    trace: Option<Trace>,
}

/// A span of the registered gradient buffer, by address, for the
/// reduction kernel: the bucket's window was handed on when it became
/// final, and nothing but this reduction writes it until the session ends.
struct Raw {
    ptr: u64,
    len: usize,
}

impl DeviceMem<f32> for Raw {
    fn dptr(&self) -> u64 {
        self.ptr
    }
    fn dlen(&self) -> usize {
        self.len
    }
}

/// This host's identity for telling apart ranks on one machine: the
/// kernel's boot id (the host name where that is missing).
fn host_identity() -> [u8; 64] {
    let id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .or_else(|_| std::fs::read_to_string("/etc/hostname"))
        .unwrap_or_default();
    let mut out = [0u8; 64];
    let b = id.trim().as_bytes();
    out[..b.len().min(64)].copy_from_slice(&b[..b.len().min(64)]);
    out
}

impl CopyEngineReduce {
    /// Sets up the copy-engine reduction of the gradient buffer at `grads`
    /// (`len` f32s on `device`, the start of its allocation) cut into at
    /// most `buckets` buckets, with the other rank of `host`. Every rank
    /// calls this at the same point, and all of them get the same answer:
    /// `Ok(None)` where the copy engines cannot serve (not 2 ranks, not
    /// one host, no peer mapping) and `choice` is `Auto` — an error naming
    /// the reason where it is `CopyEngines`.
    pub fn new(
        host: &Communicator,
        device: &Device,
        grads: u64,
        len: usize,
        buckets: usize,
        choice: AllReduceChoice,
    ) -> Result<Option<CopyEngineReduce>> {
        let refuse = |why: String| match choice {
            AllReduceChoice::CopyEngines => {
                Err(format!("BRAID_GPU_ALLREDUCE=ce: {why} (use auto or nccl)"))
            }
            _ => Ok(None),
        };
        if choice == AllReduceChoice::Nccl {
            return Ok(None);
        }
        if host.size() != 2 {
            return refuse(format!(
                "the copy-engine all-reduce runs between 2 ranks, not {}",
                host.size()
            ));
        }
        let slots = buckets.max(1);
        let landing = DeviceBuffer::<f32>::zeros(device, len).map_err(e)?;
        let flags = DeviceBuffer::<i32>::zeros(device, 2 * slots).map_err(e)?;
        let mine = [
            braid_cuda::ipc::ipc_handle(device, grads).map_err(e)?.0,
            landing.ipc_handle().map_err(e)?.0,
            flags.ipc_handle().map_err(e)?.0,
            host_identity(),
        ];
        let mut all = vec![0u8; 2 * 4 * 64];
        host.all_gather(&mine.concat(), &mut all)
            .map_err(|x| format!("exchanging GPU memory handles: {x}"))?;
        let peer = 1 - host.rank();
        let theirs = |k: usize| {
            let mut h = [0u8; 64];
            h.copy_from_slice(&all[(peer * 4 + k) * 64..(peer * 4 + k + 1) * 64]);
            h
        };
        if theirs(3) != mine[3] {
            return refuse("the 2 ranks run on different hosts".into());
        }
        let opened = (|| -> braid_cuda::Result<_> {
            Ok((
                PeerMemory::open(device, &IpcHandle(theirs(0)), 4 * len)?,
                PeerMemory::open(device, &IpcHandle(theirs(1)), 4 * len)?,
                PeerMemory::open(device, &IpcHandle(theirs(2)), 8 * slots)?,
            ))
        })();
        // Both ranks must agree: one that could not map the other's
        // memory makes both fall back.
        let mut ok = [0u8; 2];
        host.all_gather(&[opened.is_ok() as u8], &mut ok)
            .map_err(|x| format!("agreeing on the copy-engine all-reduce: {x}"))?;
        let (peer_grads, peer_landing, peer_flags) = match opened {
            Ok(m) if ok == [1, 1] => m,
            Ok(_) => return refuse(format!("rank {peer} could not map this rank's GPU memory")),
            Err(x) => return refuse(e(x)),
        };
        Ok(Some(CopyEngineReduce {
            rank: host.rank(),
            out: Stream::new(device).map_err(e)?,
            back: Stream::new(device).map_err(e)?,
            peer_grads,
            peer_landing,
            peer_flags,
            grads,
            len,
            landing,
            flags,
            step: 0,
            next: 0,
            pending: Vec::new(),
            ready: Event::new(device).map_err(e)?,
            summed: Event::new(device).map_err(e)?,
            done: [
                Event::new(device).map_err(e)?,
                Event::new(device).map_err(e)?,
            ],
            sums: (0..slots)
                .map(|_| Ok((Event::timed(device)?, Event::timed(device)?, false)))
                .collect::<braid_cuda::Result<_>>()
                .map_err(e)?,
            in_backward: false,
            in_stream_s: 0.0,
            op: None,
            trace: Trace::from_env()?,
        }))
    }

    /// Whether `grads` is the buffer registered here.
    pub fn registered(&self, grads: u64, len: usize) -> bool {
        self.grads == grads && self.len == len
    }

    /// Starts a new step (flag values move on): the next operation of
    /// `gpu`, an all-reduce of the registered buffer.
    pub fn begin_step(&mut self, gpu: &GpuCommunicator) -> Result<()> {
        if let Some(stale) = self.op.take() {
            // (A session that failed before its wait.)
            let _ = stale.failed(gpu, "its session ended before waiting".into());
        }
        self.op = Some(
            gpu.outside("all_reduce", braid_core::DType::F32, self.len as u64)
                .map_err(e)?,
        );
        self.step += 1;
        self.next = 0;
        self.pending.clear();
        self.in_backward = true;
        self.in_stream_s = 0.0;
        for s in &mut self.sums {
            s.2 = false;
        }
        Ok(())
    }

    /// Seconds the engine's stream spent on the last step's reductions
    /// while its backward pass ran: each bucket's flag wait and sum, queued
    /// between the engine's units (the last bucket's, queued after the
    /// pass, is not counted here). The computation's time excludes them.
    pub fn in_stream_s(&self) -> f64 {
        self.in_stream_s
    }

    /// Queues the reduction of bucket `b`, elements `range` of the
    /// registered buffer (final on `main` now). Both ranks hand over the
    /// same buckets in the same order, so their slots (and flags) match.
    ///
    /// Only the copy out is queued now; the sum and the copy back are
    /// queued on `main` at the next bucket's launch (or at
    /// [`wait`](Self::wait)), so the sum runs between the engine's
    /// kernels, after its next unit of work, instead of beside them.
    pub fn launch(
        &mut self,
        k: &HookKernels,
        b: usize,
        range: Range<usize>,
        main: &Stream,
    ) -> Result<()> {
        if range.end > self.len || 2 * self.next + 1 >= self.flags.len() {
            return Err(format!(
                "copy-engine all-reduce: bucket {b} {range:?} outside the {} registered elements \
                 or past the {} buckets planned per step",
                self.len,
                self.flags.len() / 2
            ));
        }
        self.finish_pending(k, main)?;
        let j = self.next;
        self.next += 1;
        self.ready.record(main).map_err(e)?;
        if let Some(t) = &mut self.trace {
            t.mark(main, b, range.len(), Phase::Ready)?;
        }
        self.out.wait_event(&self.ready).map_err(e)?;
        let mark = braid_trace::device::begin(&self.out).map_err(e)?;
        let theirs = self.halves(&range).1;
        // SAFETY: the addresses lie in buffers of `len` f32s (range
        // checked above) and in a flag buffer of two i32s per slot (slot
        // checked above); `out` starts after the engine wrote the bucket.
        // The peer overwrites this half of our gradients (with the sum)
        // only after waiting for the flag raised here, after our copy.
        unsafe {
            copy_raw_async(
                addr(self.peer_landing.ptr(), theirs.start),
                addr(self.grads, theirs.start),
                4 * theirs.len(),
                &self.out,
            )
            .map_err(e)?;
            write_flag_async(addr(self.peer_flags.ptr(), 2 * j), self.step, &self.out)
                .map_err(e)?;
        }
        if let Some(t) = &mut self.trace {
            t.mark(&self.out, b, range.len(), Phase::CopiedOut)?;
        }
        self.pending.push((b, range, j, mark));
        Ok(())
    }

    /// This rank's and the peer's halves of `range`.
    fn halves(&self, range: &Range<usize>) -> (Range<usize>, Range<usize>) {
        let mid = range.start + range.len() / 2;
        if self.rank == 0 {
            (range.start..mid, mid..range.end)
        } else {
            (mid..range.end, range.start..mid)
        }
    }

    /// Queues the sum (on `main`) and the copy back (on `back`) of every
    /// bucket copied out and not yet summed.
    fn finish_pending(&mut self, k: &HookKernels, main: &Stream) -> Result<()> {
        for (b, range, j, mark) in std::mem::take(&mut self.pending) {
            let mine = self.halves(&range).0;
            if self.in_backward {
                let s = &mut self.sums[j];
                s.0.record(main).map_err(e)?;
                s.2 = true;
            }
            // SAFETY: as in `launch`; the peer's half in our landing
            // buffer is read only after its flag `2j` says it landed.
            unsafe {
                wait_flag_async(addr(self.flags.device_ptr(), 2 * j), self.step, main)
                    .map_err(e)?;
            }
            if let Some(t) = &mut self.trace {
                t.mark(main, b, range.len(), Phase::Landed)?;
            }
            let mut own = Raw {
                ptr: addr(self.grads, mine.start),
                len: mine.len(),
            };
            k.add_into(main, &mut own, &self.landing.view(mine.clone()))
                .map_err(e)?;
            if self.in_backward {
                self.sums[j].1.record(main).map_err(e)?;
            }
            self.summed.record(main).map_err(e)?;
            self.back.wait_event(&self.summed).map_err(e)?;
            // SAFETY: as above; our summed half goes into the peer's
            // gradients, which the peer copied out before raising `2j`.
            unsafe {
                copy_raw_async(
                    addr(self.peer_grads.ptr(), mine.start),
                    addr(self.grads, mine.start),
                    4 * mine.len(),
                    &self.back,
                )
                .map_err(e)?;
                write_flag_async(
                    addr(self.peer_flags.ptr(), 2 * j + 1),
                    self.step,
                    &self.back,
                )
                .map_err(e)?;
                wait_flag_async(
                    addr(self.flags.device_ptr(), 2 * j + 1),
                    self.step,
                    &self.back,
                )
                .map_err(e)?;
            }
            if let Some(t) = &mut self.trace {
                t.mark(&self.back, b, range.len(), Phase::Done)?;
            }
            // The bucket's all-reduce in a trace: from its copy out
            // to its summed half back in the peer's gradients.
            let tid = braid_trace::recorder::track::GPU_COMM;
            let args = vec![
                ("bytes", (4 * range.len() as u64).into()),
                ("count", (range.len() as u64).into()),
                ("dtype", "f32".into()),
                ("ranks", 2u64.into()),
                ("bucket", (b as u64).into()),
                ("via", "copy engines".into()),
            ];
            braid_trace::device::end(mark, &self.back, "all_reduce", Cat::Comm, tid, args)
                .map_err(e)?;
        }
        Ok(())
    }

    /// Queues what is left of this step's buckets and waits for all of
    /// them, checking `gpu`'s health and timeout between polls. A failure
    /// (a CUDA error, an aborted communicator, the timeout: the latter
    /// naming the rank waited for) releases this rank's streams and tells
    /// every rank to abort.
    pub fn wait(&mut self, k: &HookKernels, gpu: &GpuCommunicator, main: &Stream) -> Result<()> {
        let op = self
            .op
            .take()
            .ok_or("copy-engine all-reduce: wait without begin_step")?;
        let r = self.wait_for(k, gpu, main, &op);
        match r {
            Ok(()) => {
                op.completed(gpu);
                Ok(())
            }
            Err(why) => {
                self.release_streams();
                Err(match why {
                    Failure::Aborted(err) => err,
                    Failure::TimedOut => op.timed_out(gpu).to_string(),
                    Failure::Cuda(detail) => op.failed(gpu, detail).to_string(),
                })
            }
        }
    }

    /// The body of [`wait`](Self::wait).
    fn wait_for(
        &mut self,
        k: &HookKernels,
        gpu: &GpuCommunicator,
        main: &Stream,
        op: &OutsideOp,
    ) -> std::result::Result<(), Failure> {
        let cuda = |x: String| Failure::Cuda(x);
        if let Some(t) = &mut self.trace {
            t.mark(main, 0, 0, Phase::BackwardDone).map_err(cuda)?;
        }
        self.in_backward = false;
        self.finish_pending(k, main).map_err(cuda)?;
        self.done[0].record(main).map_err(|x| cuda(e(x)))?;
        self.done[1].record(&self.back).map_err(|x| cuda(e(x)))?;
        let timeout = gpu.timeout();
        let start = Instant::now();
        for ev in &self.done {
            let mut polls = 0u32;
            while !ev.query().map_err(|x| cuda(e(x)))? {
                polls += 1;
                if polls % 64 == 0 {
                    op.check(gpu).map_err(|x| {
                        Failure::Aborted(format!(
                            "{x} (the copy-engine all-reduce of step {})",
                            self.step
                        ))
                    })?;
                    if start.elapsed() > timeout {
                        return Err(Failure::TimedOut);
                    }
                }
                braid_comm::gpu::poll_pause(start.elapsed());
            }
        }
        let mut ms = 0.0;
        for (a, b, recorded) in &self.sums {
            if *recorded {
                ms += b.elapsed_ms(a).map_err(|x| cuda(e(x)))? as f64;
            }
        }
        self.in_stream_s = ms / 1e3;
        if let Some(t) = &mut self.trace {
            t.report(self.rank, self.step).map_err(cuda)?;
        }
        Ok(())
    }

    /// After a failed wait: raises every flag of this rank to this step's
    /// value, on a stream of its own, so that this rank's streams waiting
    /// for the peer go on (into garbage: the run is over) instead of
    /// blocking the process's exit, and waits for them, bounded.
    fn release_streams(&mut self) {
        let released = (|| -> braid_cuda::Result<()> {
            let s = Stream::new(self.landing.device())?;
            for i in 0..self.flags.len() {
                // SAFETY: flag `i` lies in our own flag buffer, alive
                // for as long as `self`, and the stream's write is
                // waited for below (bounded) or outlived by the buffer's
                // owner, which ends the process.
                unsafe { write_flag_async(addr(self.flags.device_ptr(), i), self.step, &s)? };
            }
            s.synchronize()
        })();
        if let Err(x) = released {
            eprintln!(
                "braid: rank {}: could not release the copy-engine streams after a failure: {x}",
                self.rank
            );
            return;
        }
        let t0 = Instant::now();
        for ev in &self.done {
            while !ev.query().unwrap_or(true) && t0.elapsed() < Duration::from_secs(5) {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }
}

/// How a wait failed.
enum Failure {
    /// The communicator was aborted (the reason, already named).
    Aborted(String),
    /// The timeout passed.
    TimedOut,
    /// A CUDA error.
    Cuda(String),
}

/// Device address of f32 element `i` of the buffer at `base`.
fn addr(base: u64, i: usize) -> u64 {
    base + 4 * i as u64
}

/// What a traced point marks.
#[derive(Clone, Copy)]
enum Phase {
    Ready,
    CopiedOut,
    Landed,
    Done,
    BackwardDone,
}

/// Timed points of one step of copy-engine reductions
/// (`BRAID_CE_TRACE=STEP`), printed to stderr: where its time goes.
struct Trace {
    step: u32,
    points: Vec<(Event, usize, usize, Phase)>,
    used: usize,
}

impl Trace {
    fn from_env() -> Result<Option<Trace>> {
        let Ok(v) = std::env::var("BRAID_CE_TRACE") else {
            return Ok(None);
        };
        let step = v
            .trim()
            .parse()
            .map_err(|_| format!("BRAID_CE_TRACE={v:?}: expected the step to trace"))?;
        Ok(Some(Trace {
            step,
            points: Vec::new(),
            used: 0,
        }))
    }

    fn mark(&mut self, s: &Stream, bucket: usize, len: usize, phase: Phase) -> Result<()> {
        if self.used == self.points.len() {
            let ev = Event::timed(s.device()).map_err(e)?;
            self.points.push((ev, bucket, len, phase));
        }
        let p = &mut self.points[self.used];
        p.0.record(s).map_err(e)?;
        (p.1, p.2, p.3) = (bucket, len, phase);
        self.used += 1;
        Ok(())
    }

    /// Prints the points of step `step` (after they completed) and
    /// forgets them.
    fn report(&mut self, rank: usize, step: u32) -> Result<()> {
        if step == self.step && self.used > 0 {
            let t0 = &self.points[0].0;
            for (ev, b, n, phase) in &self.points[..self.used] {
                ev.synchronize().map_err(e)?;
                let what = match phase {
                    Phase::Ready => "bucket final",
                    Phase::CopiedOut => "copied out",
                    Phase::Landed => "peer's half landed",
                    Phase::Done => "summed and back",
                    Phase::BackwardDone => "backward pass queued to here",
                };
                eprintln!(
                    "[ce trace] rank {rank} step {step} +{:.3} ms bucket {b} ({:.1} MB) {what}",
                    ev.elapsed_ms(t0).map_err(e)?,
                    4.0 * *n as f64 / 1e6
                );
            }
        }
        self.used = 0;
        Ok(())
    }
}
