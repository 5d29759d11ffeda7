//! [`CopyEngineReduce`]: summing gradient buckets between the two GPUs of
//! two processes on one host with the GPUs' copy engines instead of
//! NCCL's kernels (`BRAID_GPU_ALLREDUCE=ce`).
//!
//! NCCL moves bytes with SMs; running beside the backward pass, its
//! kernels slow the backward pass's own (`BENCHMARKS.md`). Here the bytes
//! travel by DMA over NVLink and only a small reduction kernel runs:
//!
//! 1. each rank copies the half of the bucket the other rank owns into the
//!    other rank's landing buffer (peer memory mapped through CUDA IPC) and
//!    raises the other's flag;
//! 2. each waits for its own flag, adds the landed half into its own
//!    (a kernel with few blocks);
//! 3. each copies its summed half into the other's gradient buffer and
//!    raises the other's second flag; waits for its own.
//!
//! Every step uses a larger flag value, so flags never need resetting.
//! All of it is queued on a stream of its own after an event on the
//! engine's stream; the host waits only at the end of the session,
//! polling with the communicator's health and timeout.

use crate::cuda::HookKernels;
use crate::Result;
use braid_comm::Communicator;
use braid_cuda::ipc::{copy_raw_async, wait_flag_async, write_flag_async, IpcHandle, PeerMemory};
use braid_cuda::{Device, DeviceBuffer, DeviceViewMut, Event, Stream};
use std::ops::Range;
use std::time::{Duration, Instant};

fn e(x: impl std::fmt::Display) -> String {
    x.to_string()
}

/// Copy-engine reduction of one gradient buffer between 2 ranks.
pub struct CopyEngineReduce {
    rank: usize,
    stream: Stream,
    landing: DeviceBuffer<f32>,
    flags: DeviceBuffer<i32>,
    peer_grads: PeerMemory,
    peer_landing: PeerMemory,
    peer_flags: PeerMemory,
    /// Device address of element 0 of the registered gradient buffer.
    grads: u64,
    len: usize,
    step: u32,
    before: Event,
    done: Vec<Event>,
    pending: usize,
    blocks: u32,
}

impl CopyEngineReduce {
    /// Registers the gradient buffer at `grads` (`len` f32s on `device`,
    /// the start of its allocation)
    /// with the other rank of `host` (exactly 2 ranks): maps its gradient,
    /// landing and flag buffers. Every rank calls this at the same point.
    pub fn new(
        host: &Communicator,
        device: &Device,
        grads: u64,
        len: usize,
        buckets: usize,
    ) -> Result<CopyEngineReduce> {
        if host.size() != 2 {
            return Err(format!(
                "the copy-engine all-reduce runs between 2 ranks, not {} (BRAID_GPU_ALLREDUCE=nccl)",
                host.size()
            ));
        }
        let landing = DeviceBuffer::<f32>::zeros(device, len).map_err(e)?;
        let flags = DeviceBuffer::<i32>::zeros(device, 2 * buckets.max(1)).map_err(e)?;
        let mine = [
            braid_cuda::ipc::ipc_handle(device, grads).map_err(e)?,
            landing.ipc_handle().map_err(e)?,
            flags.ipc_handle().map_err(e)?,
        ];
        let mut bytes = [0u8; 3 * 64];
        for (k, h) in mine.iter().enumerate() {
            bytes[k * 64..(k + 1) * 64].copy_from_slice(&h.0);
        }
        let mut all = vec![0u8; 2 * 3 * 64];
        host.all_gather(&bytes, &mut all)
            .map_err(|x| format!("exchanging GPU memory handles: {x}"))?;
        let peer = 1 - host.rank();
        let handle = |k: usize| {
            let mut h = [0u8; 64];
            h.copy_from_slice(&all[(peer * 3 + k) * 64..(peer * 3 + k + 1) * 64]);
            IpcHandle(h)
        };
        Ok(CopyEngineReduce {
            rank: host.rank(),
            stream: Stream::new(device).map_err(e)?,
            peer_grads: PeerMemory::open(device, &handle(0), 4 * len).map_err(e)?,
            peer_landing: PeerMemory::open(device, &handle(1), 4 * len).map_err(e)?,
            peer_flags: PeerMemory::open(device, &handle(2), 8 * buckets.max(1)).map_err(e)?,
            grads,
            len,
            landing,
            flags,
            step: 0,
            before: Event::new(device).map_err(e)?,
            done: Vec::new(),
            pending: 0,
            // The reduction kernel's blocks (BRAID_CE_REDUCE_BLOCKS; by
            // default as many as fill the GPU: 32 measured slower).
            blocks: std::env::var("BRAID_CE_REDUCE_BLOCKS")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(u32::MAX),
        })
    }

    /// Whether `grads` is the buffer registered here.
    pub fn registered(&self, grads: u64, len: usize) -> bool {
        self.grads == grads && self.len == len
    }

    /// Starts a new step (flag values move on).
    pub fn begin_step(&mut self) {
        self.step += 1;
        self.pending = 0;
    }

    /// Queues the reduction of bucket `b`, elements `range` of the
    /// registered buffer, whose part is `part`, after the work queued so
    /// far on `main`.
    pub fn launch(
        &mut self,
        k: &HookKernels,
        b: usize,
        range: Range<usize>,
        part: &mut DeviceViewMut<'_, f32>,
        main: &Stream,
    ) -> Result<()> {
        if range.end > self.len || 2 * b + 1 >= self.flags.len() {
            return Err(format!(
                "copy-engine all-reduce: bucket {b} {range:?} outside the {} registered elements",
                self.len
            ));
        }
        let s = &self.stream;
        self.before.record(main).map_err(e)?;
        s.wait_event(&self.before).map_err(e)?;
        let mid = range.start + range.len() / 2;
        let (mine, theirs) = if self.rank == 0 {
            (range.start..mid, mid..range.end)
        } else {
            (mid..range.end, range.start..mid)
        };
        let at = |base: u64, i: usize| base + 4 * i as u64;
        let flag = |base: u64, j: usize| base + 4 * j as u64;
        let step = self.step;
        // SAFETY: every address below lies in a buffer of `len` f32s
        // (ranges checked above) or in a flag buffer of `2 × buckets`
        // i32s; the part is this bucket's exclusive window of the
        // gradient buffer, and the peer only writes the other half of our
        // landing buffer and our gradients' half it owns after we raised
        // its flag (so it has read what it overwrites).
        unsafe {
            copy_raw_async(
                at(self.peer_landing.ptr(), theirs.start),
                at(self.grads, theirs.start),
                4 * theirs.len(),
                s,
            )
            .map_err(e)?;
            write_flag_async(flag(self.peer_flags.ptr(), 2 * b), step, s).map_err(e)?;
            wait_flag_async(flag(self.flags.device_ptr(), 2 * b), step, s).map_err(e)?;
        }
        let off = range.start;
        let mut own = part.sub_mut(mine.start - off..mine.end - off);
        k.add_into_limited(s, &mut own, &self.landing.view(mine.clone()), self.blocks)
            .map_err(e)?;
        // SAFETY: as above.
        unsafe {
            copy_raw_async(
                at(self.peer_grads.ptr(), mine.start),
                at(self.grads, mine.start),
                4 * mine.len(),
                s,
            )
            .map_err(e)?;
            write_flag_async(flag(self.peer_flags.ptr(), 2 * b + 1), step, s).map_err(e)?;
            wait_flag_async(flag(self.flags.device_ptr(), 2 * b + 1), step, s).map_err(e)?;
        }
        if self.pending == self.done.len() {
            self.done.push(Event::new(s.device()).map_err(e)?);
        }
        self.done[self.pending].record(s).map_err(e)?;
        self.pending += 1;
        Ok(())
    }

    /// Waits for every bucket of this step, checking `host`'s health and
    /// `timeout` between polls.
    pub fn wait(&mut self, host: &Communicator, timeout: Duration) -> Result<()> {
        let start = Instant::now();
        for ev in &self.done[..self.pending] {
            let mut polls = 0u32;
            while !ev.query().map_err(e)? {
                polls += 1;
                if polls % 64 == 0 {
                    if let Some(why) = host.aborted() {
                        return Err(format!(
                            "rank {}: communicator aborted: {why} (seen while waiting for the copy-engine all-reduce)",
                            self.rank
                        ));
                    }
                    if start.elapsed() > timeout {
                        let why = format!(
                            "the copy-engine all-reduce of step {} did not finish within {timeout:?}",
                            self.step
                        );
                        host.abort(&why);
                        return Err(format!("rank {}: {why}", self.rank));
                    }
                }
                if polls < 4096 {
                    std::hint::spin_loop();
                } else {
                    std::thread::sleep(Duration::from_micros(20));
                }
            }
        }
        self.pending = 0;
        Ok(())
    }
}
