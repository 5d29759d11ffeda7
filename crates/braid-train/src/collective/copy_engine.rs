//! [`CopyEngineReduce`]: summing gradient buckets between the GPUs of
//! the processes of one host with the GPUs' copy engines instead of
//! NCCL's kernels — the default for 2 to 8 ranks on one host whose GPUs
//! map each other's memory (`BRAID_GPU_ALLREDUCE=auto`; `ce` insists on
//! it, `nccl` turns it off).
//!
//! NCCL moves bytes with SMs; running beside the backward pass, its
//! kernels slow the backward pass's own (`BENCHMARKS.md`). Here the bytes
//! travel by DMA over NVLink and only a short reduction kernel runs. Each
//! bucket is cut into N parts, part `r` owned by rank `r` (a
//! reduce-scatter, then an all-gather, both by copies):
//!
//! 1. when a bucket is final, each rank copies every other rank's part
//!    into that rank's landing buffer (peer memory mapped through CUDA
//!    IPC; one region per sender) and raises that rank's flag for it — on
//!    a stream per peer, so the copies to different GPUs run at once;
//! 2. after the engine's next unit of work, the engine's own stream waits
//!    for the N − 1 flags of its part (long raised by then) and adds the
//!    landed copies into its own part — between the engine's kernels, not
//!    beside them;
//! 3. a second stream per peer copies the summed part into that peer's
//!    gradient buffer and raises the peer's second flag; the rank waits
//!    for the N − 1 second flags of the parts it does not own.
//!
//! Every bucket of a step has its own flags (two per sender) and every
//! step uses a larger flag value, so flags never need resetting. Each
//! part is summed once, by its owner, in a fixed order (its own
//! gradients, then the others' by rank), so every rank ends the step with
//! the same bits. The host waits only at the end of the session, polling
//! with the communicator's health and timeout. Each step's reduction is
//! one operation of the GPU communicator ([`OutsideOp`]: numbered, in the
//! flight recorder), so a rank stopped in or before it is named by the
//! one that times out. A failed wait raises this rank's own flags,
//! releasing its streams (a stream waiting for a flag that never comes
//! would otherwise block the process's exit). `BRAID_CE_TRACE=STEP`
//! prints one step's timeline per rank.

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

/// The most ranks the copy-engine all-reduce serves (one host's GPUs).
pub const MAX_RANKS: usize = 8;

/// Whether plain data parallelism over `ranks` ranks (all on one host
/// where `one_host`) sums its gradients with the copy engines by default:
/// 2 to [`MAX_RANKS`] ranks of one host, unless `BRAID_GPU_ALLREDUCE=nccl`.
pub fn reduces_by_default(ranks: usize, one_host: bool) -> bool {
    let off = std::env::var(braid_core::env::BRAID_GPU_ALLREDUCE).as_deref() == Ok("nccl");
    (2..=MAX_RANKS).contains(&ranks) && one_host && !off
}

/// Device bytes of a rank's landing buffer for `elements` f32 gradients
/// summed over `ranks` ranks: an f32 for each element the other N − 1
/// ranks send it, (N − 1)/N of them (to a part's rounding). What the
/// memory pre-flight and `braid plan` count beside the gradients where
/// the copy engines sum them ([`reduces_by_default`]).
pub fn landing_bytes(ranks: usize, elements: u128) -> u128 {
    let n = ranks.max(1) as u128;
    4 * (n - 1) * elements.div_ceil(n)
}

/// How gradients are summed between GPUs (`BRAID_GPU_ALLREDUCE`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AllReduceChoice {
    /// The copy engines where they can serve (2 to [`MAX_RANKS`] ranks on
    /// one host, with peer access), NCCL otherwise.
    Auto,
    /// The copy engines, or an error saying why not.
    CopyEngines,
    /// NCCL always.
    Nccl,
}

impl AllReduceChoice {
    /// The choice in `BRAID_GPU_ALLREDUCE` (`auto` when unset).
    pub fn from_env() -> Result<AllReduceChoice> {
        match std::env::var(braid_core::env::BRAID_GPU_ALLREDUCE).as_deref() {
            Err(_) | Ok("auto") | Ok("") => Ok(AllReduceChoice::Auto),
            Ok("ce") => Ok(AllReduceChoice::CopyEngines),
            Ok("nccl") => Ok(AllReduceChoice::Nccl),
            Ok(other) => Err(format!(
                "BRAID_GPU_ALLREDUCE={other:?}: expected auto, ce or nccl"
            )),
        }
    }
}

/// Elements of the landing buffer per sender for `len` registered
/// elements cut into at most `buckets` buckets over `ranks` ranks: the
/// parts one rank owns add up to at most one element per bucket more
/// than `len / ranks`.
pub fn landing_per_sender(len: usize, buckets: usize, ranks: usize) -> usize {
    len.div_ceil(ranks.max(1)) + buckets.max(1)
}

/// The first bucket (in launch order, of the given lengths) that NCCL
/// reduces instead of the copy engines: over more than 2 ranks, the
/// largest bucket and those after it; over 2, none (`lens.len()`).
///
/// Over N ranks each GPU's copy engines move 2 (N − 1)/N of a bucket out
/// and as much in: on 4 H100s about 150 GB/s out per GPU, half of what
/// NCCL's kernels reach. Beside the backward pass that rate keeps up (the
/// engine takes longer to finish the next bucket), and the pass runs at
/// one GPU's speed, which NCCL's kernels beside it do not allow. At the
/// end it does not: the largest bucket (the embeddings', final under the
/// last deferred layers) and the small ones after it would finish well
/// after the pass. There NCCL is faster, and its kernels have little left
/// to slow down.
pub fn nccl_tail(lens: &[usize], ranks: usize) -> usize {
    if ranks <= 2 {
        return lens.len();
    }
    let mut largest = None;
    for (i, &l) in lens.iter().enumerate() {
        if largest.is_none_or(|(_, most)| l > most) {
            largest = Some((i, l));
        }
    }
    largest.map_or(lens.len(), |(i, _)| i)
}

/// Part `owner` of `range` cut into `ranks` parts (the first rank's
/// first; with 2 ranks, the halves).
fn part(range: &Range<usize>, owner: usize, ranks: usize) -> Range<usize> {
    let l = range.len();
    range.start + owner * l / ranks..range.start + (owner + 1) * l / ranks
}

/// Another rank's memory, mapped, and this rank's streams to it.
struct Peer {
    rank: usize,
    grads: PeerMemory,
    landing: PeerMemory,
    flags: PeerMemory,
    /// Copies out (stage 1).
    out: Stream,
    /// Copies back (stage 3).
    back: Stream,
}

/// A bucket copied out and not yet summed.
struct Pending {
    bucket: usize,
    range: Range<usize>,
    slot: usize,
    /// Where this rank's part of it lies in each sender's landing region.
    landed_at: usize,
    /// The start of its trace span.
    mark: Option<braid_trace::device::Mark>,
}

/// Copy-engine reduction of one gradient buffer between the ranks of a
/// host.
pub struct CopyEngineReduce {
    rank: usize,
    ranks: usize,
    peers: Vec<Peer>,
    /// One region of `per_sender` elements for each other rank, in rank
    /// order.
    landing: DeviceBuffer<f32>,
    per_sender: usize,
    /// Per bucket slot `j`, stage `s` (0: landed, 1: summed and back) and
    /// sender `q`: flag `(2j + s) · ranks + q`.
    flags: DeviceBuffer<i32>,
    slots: usize,
    /// Device address of element 0 of the registered gradient buffer.
    grads: u64,
    len: usize,
    step: u32,
    /// The next bucket slot of this step.
    next: usize,
    /// Per owner, the elements of its parts handed over so far this step
    /// (where its next part lands in every sender's region).
    owned: Vec<usize>,
    pending: Vec<Pending>,
    /// Where the sums run ([`SumPlacement`]): `None` on the engine's
    /// stream between its units; a stream of their own beside them.
    side: Option<Stream>,
    ready: Event,
    summed: Event,
    /// Recorded at the end of a session on the engine's stream and on
    /// every peer's copy-back stream.
    done: Vec<Event>,
    /// Per slot, timed events around the sum on the engine's stream (its
    /// flag waits and its kernels) queued inside the backward pass, and
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
pub(super) fn host_identity() -> [u8; 64] {
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
    /// most `buckets` buckets, with the other ranks of `host`. Every rank
    /// calls this at the same point, and all of them get the same answer:
    /// `Ok(None)` where the copy engines cannot serve (one rank or more
    /// than [`MAX_RANKS`], not one host, no peer mapping) and `choice` is
    /// `Auto` — an error naming the reason where it is `CopyEngines`.
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
        let ranks = host.size();
        if !(2..=MAX_RANKS).contains(&ranks) {
            return refuse(format!(
                "the copy-engine all-reduce runs between 2 and {MAX_RANKS} ranks of one host, \
                 not {ranks}"
            ));
        }
        let slots = buckets.max(1);
        let per_sender = landing_per_sender(len, slots, ranks);
        let landing = DeviceBuffer::<f32>::zeros(device, (ranks - 1) * per_sender).map_err(e)?;
        let flags = DeviceBuffer::<i32>::zeros(device, 2 * slots * ranks).map_err(e)?;
        let mine = [
            braid_cuda::ipc::ipc_handle(device, grads).map_err(e)?.0,
            landing.ipc_handle().map_err(e)?.0,
            flags.ipc_handle().map_err(e)?.0,
            host_identity(),
        ];
        let mut all = vec![0u8; ranks * 4 * 64];
        host.all_gather(&mine.concat(), &mut all)
            .map_err(|x| format!("exchanging GPU memory handles: {x}"))?;
        let theirs = |q: usize, k: usize| {
            let mut h = [0u8; 64];
            h.copy_from_slice(&all[(q * 4 + k) * 64..(q * 4 + k + 1) * 64]);
            h
        };
        let others: Vec<usize> = (0..ranks).filter(|&q| q != host.rank()).collect();
        if let Some(q) = others.iter().find(|&&q| theirs(q, 3) != mine[3]) {
            return refuse(format!("rank {q} runs on another host"));
        }
        let opened = others
            .iter()
            .map(|&q| -> braid_cuda::Result<Peer> {
                Ok(Peer {
                    rank: q,
                    grads: PeerMemory::open(device, &IpcHandle(theirs(q, 0)), 4 * len)?,
                    landing: PeerMemory::open(
                        device,
                        &IpcHandle(theirs(q, 1)),
                        4 * (ranks - 1) * per_sender,
                    )?,
                    flags: PeerMemory::open(device, &IpcHandle(theirs(q, 2)), 8 * slots * ranks)?,
                    out: Stream::new(device)?,
                    back: Stream::new(device)?,
                })
            })
            .collect::<braid_cuda::Result<Vec<Peer>>>();
        // Every rank must agree: one that could not map another's memory
        // makes all of them fall back.
        let mut ok = vec![0u8; ranks];
        host.all_gather(&[opened.is_ok() as u8], &mut ok)
            .map_err(|x| format!("agreeing on the copy-engine all-reduce: {x}"))?;
        let peers = match opened {
            Ok(p) if ok.iter().all(|&b| b == 1) => p,
            Ok(_) => {
                let q = ok.iter().position(|&b| b == 0).unwrap_or(0);
                return refuse(format!("rank {q} could not map another rank's GPU memory"));
            }
            Err(x) => return refuse(e(x)),
        };
        let side = match SumPlacement::for_ranks(ranks) {
            SumPlacement::Main => None,
            SumPlacement::Side => Some(Stream::new(device).map_err(e)?),
        };
        // The engine's stream, each copy-back stream and the side stream.
        let done = (0..1 + peers.len() + side.is_some() as usize)
            .map(|_| Event::new(device))
            .collect::<braid_cuda::Result<Vec<Event>>>()
            .map_err(e)?;
        Ok(Some(CopyEngineReduce {
            rank: host.rank(),
            ranks,
            peers,
            landing,
            per_sender,
            flags,
            slots,
            grads,
            len,
            step: 0,
            next: 0,
            owned: vec![0; ranks],
            pending: Vec::new(),
            side,
            ready: Event::new(device).map_err(e)?,
            summed: Event::new(device).map_err(e)?,
            done,
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
        self.owned.iter_mut().for_each(|o| *o = 0);
        self.pending.clear();
        self.in_backward = true;
        self.in_stream_s = 0.0;
        for s in &mut self.sums {
            s.2 = false;
        }
        Ok(())
    }

    /// Seconds the engine's stream spent on the last step's reductions
    /// while its backward pass ran: each bucket's flag waits and sums,
    /// queued between the engine's units (the last bucket's, queued after
    /// the pass, is not counted here). The computation's time excludes
    /// them.
    pub fn in_stream_s(&self) -> f64 {
        self.in_stream_s
    }

    /// Flag `stage` of slot `j` raised by rank `sender`.
    fn flag(&self, j: usize, stage: usize, sender: usize) -> usize {
        (2 * j + stage) * self.ranks + sender
    }

    /// Where rank `sender`'s region starts in rank `owner`'s landing
    /// buffer (elements).
    fn region(&self, sender: usize, owner: usize) -> usize {
        let index = if sender < owner { sender } else { sender - 1 };
        index * self.per_sender
    }

    /// Queues the reduction of bucket `b`, elements `range` of the
    /// registered buffer (final on `main` now). Every rank hands over the
    /// same buckets in the same order, so their slots, flags and landing
    /// places match.
    ///
    /// Between 2 ranks only the copies out are queued now; the sum and the
    /// copies back are queued on `main` at the next bucket's launch (or at
    /// [`wait`](Self::wait)), so the sum runs between the engine's
    /// kernels, after its next unit of work, instead of beside them. Over
    /// more ranks (`SumPlacement::Side`) they are queued now too, on the
    /// side stream, which waits there for the others' copies.
    pub fn launch(
        &mut self,
        k: &HookKernels,
        b: usize,
        range: Range<usize>,
        main: &Stream,
    ) -> Result<()> {
        if range.end > self.len || self.next >= self.slots {
            return Err(format!(
                "copy-engine all-reduce: bucket {b} {range:?} outside the {} registered elements \
                 or past the {} buckets planned per step",
                self.len, self.slots
            ));
        }
        let n = self.ranks;
        let ends: Vec<usize> = (0..n)
            .map(|o| self.owned[o] + part(&range, o, n).len())
            .collect();
        if ends.iter().any(|&end| end > self.per_sender) {
            return Err(format!(
                "copy-engine all-reduce: bucket {b} {range:?} overflows the landing buffer \
                 ({} elements per sender): more buckets than the {} planned?",
                self.per_sender, self.slots
            ));
        }
        // Named for Nsight where a tool is attached: what this launch
        // queues (the bucket's copies and flags; its sum too over more
        // than 2 ranks, the previous bucket's between 2).
        let _range = braid_trace::nvtx::range(|| {
            format!("copy-engine all_reduce bucket {b} {} x F32", range.len())
        });
        self.finish_pending(k, main)?;
        let j = self.next;
        self.next += 1;
        self.ready.record(main).map_err(e)?;
        if let Some(t) = &mut self.trace {
            t.mark(main, b, range.len(), Phase::Ready)?;
        }
        let mut mark = None;
        for (i, p) in self.peers.iter().enumerate() {
            p.out.wait_event(&self.ready).map_err(e)?;
            if i == 0 {
                mark = braid_trace::device::begin(&p.out).map_err(e)?;
            }
            let theirs = part(&range, p.rank, n);
            let at = self.region(self.rank, p.rank) + self.owned[p.rank];
            // SAFETY: `theirs` lies in our buffer of `len` f32s (range
            // checked above); `at + theirs.len()` is within the peer's
            // region of `per_sender` elements in its landing buffer of
            // `(ranks - 1) · per_sender` (checked above: every rank's
            // offsets are the same), and the flag index within its
            // `2 · slots · ranks` flags (slot checked above). `out` starts
            // after the engine wrote the bucket. The peer overwrites this
            // part of our gradients (with its sum) only after waiting for
            // the flag raised here, after our copy.
            unsafe {
                copy_raw_async(
                    addr(p.landing.ptr(), at),
                    addr(self.grads, theirs.start),
                    4 * theirs.len(),
                    &p.out,
                )
                .map_err(e)?;
                write_flag_async(
                    addr(p.flags.ptr(), self.flag(j, 0, self.rank)),
                    self.step,
                    &p.out,
                )
                .map_err(e)?;
            }
        }
        if let Some(t) = &mut self.trace {
            for p in &self.peers {
                t.mark(&p.out, b, range.len(), Phase::CopiedOut(p.rank))?;
            }
        }
        let landed_at = self.owned[self.rank];
        self.owned = ends;
        self.pending.push(Pending {
            bucket: b,
            range,
            slot: j,
            landed_at,
            mark,
        });
        if let Some(side) = &self.side {
            // Beside the engine: queued now, after the bucket is final.
            side.wait_event(&self.ready).map_err(e)?;
            self.finish_pending(k, main)?;
        }
        Ok(())
    }

    /// Queues the sum (on `main`, or the side stream where the sums run
    /// there) and the copies back (on the peers' `back` streams) of every
    /// bucket copied out and not yet summed.
    fn finish_pending(&mut self, k: &HookKernels, main: &Stream) -> Result<()> {
        let n = self.ranks;
        let timed = self.in_backward && self.side.is_none();
        let main = self.side.as_ref().unwrap_or(main);
        for p in std::mem::take(&mut self.pending) {
            let j = p.slot;
            let mine = part(&p.range, self.rank, n);
            if timed {
                let s = &mut self.sums[j];
                s.0.record(main).map_err(e)?;
                s.2 = true;
            }
            for q in self.peers.iter().map(|q| q.rank) {
                // SAFETY: the flag lies in our own buffer (slot checked at
                // launch); the senders' copies into our landing buffer
                // are read only after their flags say they landed.
                unsafe {
                    wait_flag_async(
                        addr(self.flags.device_ptr(), self.flag(j, 0, q)),
                        self.step,
                        main,
                    )
                    .map_err(e)?;
                }
            }
            if let Some(t) = &mut self.trace {
                t.mark(main, p.bucket, p.range.len(), Phase::Landed)?;
            }
            let mut own = Raw {
                ptr: addr(self.grads, mine.start),
                len: mine.len(),
            };
            // The senders' regions lie in rank order, `per_sender` apart:
            // their copies added in that order, in one pass.
            let landed = self.landing.view(p.landed_at..self.landing.len());
            k.add_parts_into(main, &mut own, &landed, self.per_sender, self.ranks - 1)
                .map_err(e)?;
            if timed {
                self.sums[j].1.record(main).map_err(e)?;
            }
            self.summed.record(main).map_err(e)?;
            for peer in &self.peers {
                peer.back.wait_event(&self.summed).map_err(e)?;
                // SAFETY: as in `launch`; our summed part goes into the
                // peer's gradients, which the peer copied out to us
                // before raising our stage-0 flag, waited for above.
                unsafe {
                    copy_raw_async(
                        addr(peer.grads.ptr(), mine.start),
                        addr(self.grads, mine.start),
                        4 * mine.len(),
                        &peer.back,
                    )
                    .map_err(e)?;
                    write_flag_async(
                        addr(peer.flags.ptr(), self.flag(j, 1, self.rank)),
                        self.step,
                        &peer.back,
                    )
                    .map_err(e)?;
                }
            }
            // The others' summed parts, back in our gradients.
            let Some(first) = self.peers.first() else {
                continue;
            };
            for q in self.peers.iter().map(|q| q.rank) {
                // SAFETY: as above, our own flag buffer.
                unsafe {
                    wait_flag_async(
                        addr(self.flags.device_ptr(), self.flag(j, 1, q)),
                        self.step,
                        &first.back,
                    )
                    .map_err(e)?;
                }
            }
            if let Some(t) = &mut self.trace {
                t.mark(&first.back, p.bucket, p.range.len(), Phase::Done)?;
            }
            // The bucket's all-reduce in a trace: from its copies out
            // to the summed parts back in every rank's gradients.
            let tid = braid_trace::recorder::track::GPU_COMM;
            let args = vec![
                ("bytes", (4 * p.range.len() as u64).into()),
                ("count", (p.range.len() as u64).into()),
                ("dtype", "f32".into()),
                ("ranks", (n as u64).into()),
                ("bucket", (p.bucket as u64).into()),
                ("via", "copy engines".into()),
            ];
            braid_trace::device::end(p.mark, &first.back, "all_reduce", Cat::Comm, tid, args)
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
        let streams = self.peers.iter().map(|p| &p.back).chain(self.side.as_ref());
        for (ev, s) in self.done[1..].iter().zip(streams) {
            ev.record(s).map_err(|x| cuda(e(x)))?;
        }
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
    /// for the others go on (into garbage: the run is over) instead of
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

/// Where the copy-engine sums run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SumPlacement {
    /// On the engine's stream, after its next unit of work: no kernel
    /// beside the engine's, but the engine's stream waits there for the
    /// slowest peer's copies.
    Main,
    /// On a stream of their own as soon as a bucket is final: the
    /// engine's stream never waits for a peer.
    Side,
}

impl SumPlacement {
    /// Between 2 ranks the engine's stream (97-98 % scaling on 2 H200s);
    /// over more, where a sum waits for the slowest of N − 1 peers, a
    /// stream of their own (4 H100s, 124M: 94.6-94.9 % scaling against
    /// 93.9-94.2 % on the engine's stream, 2 rounds each in one call).
    fn for_ranks(ranks: usize) -> SumPlacement {
        match ranks {
            2 => SumPlacement::Main,
            _ => SumPlacement::Side,
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
    /// To this rank.
    CopiedOut(usize),
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
        let Ok(v) = std::env::var(braid_core::env::BRAID_CE_TRACE) else {
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
                    Phase::Ready => "bucket final".to_string(),
                    Phase::CopiedOut(q) => format!("copied out to rank {q}"),
                    Phase::Landed => "the others' parts landed".to_string(),
                    Phase::Done => "summed, and every part back".to_string(),
                    Phase::BackwardDone => "backward pass queued to here".to_string(),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_cover_a_range_once_and_halve_it_for_two() {
        for n in 1..=MAX_RANKS {
            for range in [0..0, 3..4, 10..17, 5..1005] {
                let parts: Vec<_> = (0..n).map(|o| part(&range, o, n)).collect();
                assert_eq!(parts[0].start, range.start);
                assert_eq!(parts[n - 1].end, range.end);
                for w in parts.windows(2) {
                    assert_eq!(w[0].end, w[1].start, "{range:?} over {n}");
                }
                let most = parts.iter().map(|p| p.len()).max().unwrap_or(0);
                assert!(most <= range.len().div_ceil(n), "{range:?} over {n}");
            }
        }
        let mid = 10 + 7 / 2;
        assert_eq!(part(&(10..17), 0, 2), 10..mid);
        assert_eq!(part(&(10..17), 1, 2), mid..17);
    }

    #[test]
    fn the_tail_from_the_largest_bucket_goes_to_nccl_above_two_ranks() {
        let lens = [1, 25, 25, 160, 25, 7, 2];
        assert_eq!(nccl_tail(&lens, 2), lens.len());
        assert_eq!(nccl_tail(&lens, 4), 3);
        assert_eq!(nccl_tail(&lens, 8), 3);
        // Ties: the first of the largest.
        assert_eq!(nccl_tail(&[5, 9, 9, 1], 3), 1);
        assert_eq!(nccl_tail(&[], 4), 0);
    }

    #[test]
    fn a_ranks_parts_fit_its_landing_region() {
        // Buckets of uneven sizes cut over 3 and 4 ranks: what one owner
        // receives from one sender never passes its region.
        let sizes = [7usize, 1, 1000, 33, 2, 999, 64];
        let len: usize = sizes.iter().sum();
        for n in [2, 3, 4, 8] {
            let per = landing_per_sender(len, sizes.len(), n);
            let mut start = 0;
            let mut owned = vec![0; n];
            for s in sizes {
                let r = start..start + s;
                for (o, total) in owned.iter_mut().enumerate() {
                    *total += part(&r, o, n).len();
                }
                start += s;
            }
            assert!(
                owned.iter().all(|&t| t <= per),
                "{owned:?} > {per} over {n}"
            );
            assert_eq!(owned.iter().sum::<usize>(), len);
        }
    }
}
