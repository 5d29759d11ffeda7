//! [`HostOptimizer`]: AdamW offloaded to host memory (ZeRO-Offload's
//! split of the work). The f32 master weights and both moments live in
//! host memory and the update runs on the CPU's cores (braid-model's
//! optimizer: rayon over the elements, loops the compiler vectorises); the
//! GPU keeps only what its passes read — the weights in the compute dtype
//! and, in bf16, the f32 tensors the passes read directly (embeddings,
//! LayerNorms, biases: [`SideMap`]).
//!
//! An update streams the buffer through in chunks of [`CHUNK`] elements
//! and two pinned buffers each way, so that three things run at once: the
//! next chunk's gradients copied down to the host (one copy engine), this
//! chunk's update on the CPU, and the last chunk's new weights copied up
//! (the other copy engine). The gradients cannot come down any earlier
//! than the update: with clipping, no element can be updated before the
//! global norm of all of them is known, and the copies hide behind the
//! CPU's work anyway. Only the transfer buffers are pinned: the master
//! weights and moments never cross the bus, and pinning them would lock
//! 12 bytes per parameter of the host's memory for nothing.

pub mod update;

pub use update::{HostUpdate, Narrow, CHUNK};

use crate::engine::UpdateStep;
use crate::Result;
use braid_cuda::{Device, DeviceBuffer, Event, PinnedBuffer, Stream};
use braid_model::cuda::f32_params::SideMap;
use braid_model::optim::AdamWConfig;
use braid_model::Layout;
use std::ops::Range;
use std::time::{Duration, Instant};

/// How long one chunk's copy may take before the update gives up: a
/// chunk crosses the bus in milliseconds, so this is a stuck device.
const COPY_TIMEOUT: Duration = Duration::from_secs(120);

fn e(x: impl std::fmt::Display) -> String {
    x.to_string()
}

/// Waits for `event`, polling, for at most [`COPY_TIMEOUT`].
fn wait(event: &Event, what: &str) -> Result<()> {
    let start = Instant::now();
    let mut spins = 0u32;
    while !event.query().map_err(e)? {
        if start.elapsed() > COPY_TIMEOUT {
            return Err(format!(
                "offloaded optimizer: {what} did not finish in {} s (is the GPU stuck?)",
                COPY_TIMEOUT.as_secs()
            ));
        }
        spins += 1;
        match spins < 1000 {
            true => std::hint::spin_loop(),
            false => std::thread::sleep(Duration::from_micros(50)),
        }
    }
    Ok(())
}

/// AdamW over master weights in host memory, refreshing the GPU's weights
/// of type `T` after each update (see the module's doc).
pub struct HostOptimizer<T: Narrow> {
    /// The master weights, the moments and the update itself.
    core: HostUpdate,
    /// The f32 tensors the GPU reads besides the weights, and their
    /// pinned staging (bf16 engines).
    side: Option<(SideMap, PinnedBuffer<f32>)>,
    grads_in: [PinnedBuffer<f32>; 2],
    weights_out: [PinnedBuffer<T>; 2],
    down: Stream,
    up: Stream,
    ready: Event,
    got: [Event; 2],
    sent: [Event; 2],
    /// Seconds of the last update the CPU spent updating (not waiting).
    pub last_cpu_s: f64,
}

impl<T: Narrow> HostOptimizer<T> {
    /// AdamW with `cfg` over `master` (the model's flat parameters, of
    /// `layout`), for a GPU whose passes also read the f32 tensors `side`
    /// packs (`None`: the weights are all they read).
    pub fn new(
        device: &Device,
        layout: &Layout,
        master: Vec<f32>,
        cfg: AdamWConfig,
        side: Option<SideMap>,
    ) -> Result<Self> {
        let core = HostUpdate::new(layout, master, cfg)?;
        let chunk = CHUNK.min(core.len().max(1));
        let pinned = |n| PinnedBuffer::zeros(device, n).map_err(|x| pin_error(x, n));
        let side = match side {
            Some(map) => {
                let stage = PinnedBuffer::zeros(device, map.len().max(1))
                    .map_err(|x| pin_error(x, map.len()))?;
                Some((map, stage))
            }
            None => None,
        };
        let weights = || PinnedBuffer::<T>::zeros(device, chunk).map_err(|x| pin_error(x, chunk));
        Ok(HostOptimizer {
            core,
            side,
            grads_in: [pinned(chunk)?, pinned(chunk)?],
            weights_out: [weights()?, weights()?],
            down: Stream::new(device).map_err(e)?,
            up: Stream::new(device).map_err(e)?,
            ready: Event::new(device).map_err(e)?,
            got: [
                Event::new(device).map_err(e)?,
                Event::new(device).map_err(e)?,
            ],
            sent: [
                Event::new(device).map_err(e)?,
                Event::new(device).map_err(e)?,
            ],
            last_cpu_s: 0.0,
        })
    }

    /// The master weights.
    pub fn master(&self) -> &[f32] {
        self.core.master()
    }

    /// The master weights, ending the optimizer (its other memory freed
    /// first).
    pub fn into_master(self) -> Vec<f32> {
        self.core.into_master()
    }

    /// AdamW's moment `i` (0: `exp_avg`, 1: `exp_avg_sq`), laid out like
    /// the master weights (zeros before the first update).
    pub fn moment(&self, i: usize) -> Result<&[f32]> {
        self.core.moment(i)
    }

    /// Replaces AdamW's moments by `m` and `v` (laid out like the master
    /// weights), as after `updates` updates: a resumed run's state.
    pub fn set_moments(&mut self, m: &[f32], v: &[f32], updates: u64) -> Result<()> {
        self.core.set_moments(m, v, updates)
    }

    /// Replaces the master weights by `values` (a resumed run's); the
    /// GPU's copies follow with [`upload`](Self::upload).
    pub fn set_master(&mut self, values: &[f32]) -> Result<()> {
        self.core.set_master(values)
    }

    /// Bytes of host memory it holds: master weights, moments, staging.
    pub fn host_bytes(&self) -> (u64, u64, u64) {
        let staging = 4 * self.grads_in[0].as_slice().len() * 2
            + std::mem::size_of_val(self.weights_out[0].as_slice()) * 2
            + self
                .side
                .as_ref()
                .map_or(0, |(_, s)| 4 * s.as_slice().len());
        let (master, moments) = self.core.bytes();
        (master, moments, staging as u64)
    }

    /// Copies the master weights up (narrowed to `T` into `weights`, the
    /// packed f32 tensors into `side`), after work queued on `compute`
    /// that reads them; returns when they are there.
    pub fn upload(
        &mut self,
        weights: &mut DeviceBuffer<T>,
        side: Option<&mut DeviceBuffer<f32>>,
        compute: &Stream,
    ) -> Result<()> {
        self.check(weights.len(), None)?;
        self.ready.record(compute).map_err(e)?;
        self.up.wait_event(&self.ready).map_err(e)?;
        for (k, r) in self.core.chunks().into_iter().enumerate() {
            if k >= 2 {
                wait(&self.sent[k % 2], "copying weights to the GPU")?;
            }
            self.send(k, r, weights)?;
        }
        self.finish(side)
    }

    /// One AdamW update from `grads` (on the GPU, final once the work
    /// queued on `compute` is done), then the new weights up into
    /// `weights` (and `side`); returns when they are there.
    pub fn step(
        &mut self,
        grads: &DeviceBuffer<f32>,
        weights: &mut DeviceBuffer<T>,
        side: Option<&mut DeviceBuffer<f32>>,
        compute: &Stream,
        step: UpdateStep,
    ) -> Result<()> {
        self.check(weights.len(), Some(grads.len()))?;
        self.ready.record(compute).map_err(e)?;
        self.down.wait_event(&self.ready).map_err(e)?;
        self.up.wait_event(&self.ready).map_err(e)?;
        let chunks = self.core.chunks();
        self.core.begin_step();
        let mut cpu = Duration::ZERO;
        if let Some(r) = chunks.first() {
            self.fetch(0, r.clone(), grads)?;
        }
        for (k, r) in chunks.iter().enumerate() {
            // Buffer (k + 1) % 2 was last read by the CPU for chunk k - 1.
            if let Some(next) = chunks.get(k + 1) {
                self.fetch(k + 1, next.clone(), grads)?;
            }
            wait(&self.got[k % 2], "copying gradients to the host")?;
            if k >= 2 {
                wait(&self.sent[k % 2], "copying weights to the GPU")?;
            }
            let t0 = Instant::now();
            let g = &self.grads_in[k % 2].as_slice()[..r.len()];
            let out = &mut self.weights_out[k % 2].as_mut_slice()[..r.len()];
            self.core.update_chunk(r.clone(), g, out, step);
            cpu += t0.elapsed();
            self.queue_up(k, r.clone(), weights)?;
        }
        self.last_cpu_s = cpu.as_secs_f64();
        self.finish(side)
    }

    /// Lengths against the master weights'.
    fn check(&self, weights: usize, grads: Option<usize>) -> Result<()> {
        let n = self.core.len();
        if weights != n || grads.is_some_and(|g| g != n) {
            return Err(format!(
                "offloaded optimizer over {n} parameters given {weights} weights{}",
                grads.map_or(String::new(), |g| format!(" and {g} gradients"))
            ));
        }
        Ok(())
    }

    /// Queues chunk `k`'s (elements `r`) gradients down into buffer k % 2.
    fn fetch(&mut self, k: usize, r: Range<usize>, grads: &DeviceBuffer<f32>) -> Result<()> {
        self.grads_in[k % 2]
            .copy_in_async(0, &grads.view(r), &self.down)
            .map_err(e)?;
        self.got[k % 2].record(&self.down).map_err(e)
    }

    /// Narrows chunk `k`'s (elements `r`) master weights into buffer
    /// k % 2 and queues them up into `weights`.
    fn send(&mut self, k: usize, r: Range<usize>, weights: &mut DeviceBuffer<T>) -> Result<()> {
        let out = &mut self.weights_out[k % 2].as_mut_slice()[..r.len()];
        self.core.narrow_into(r.clone(), out);
        self.queue_up(k, r, weights)
    }

    /// Queues buffer k % 2, chunk `k`'s (elements `r`) narrowed weights,
    /// up into `weights`.
    fn queue_up(&mut self, k: usize, r: Range<usize>, weights: &mut DeviceBuffer<T>) -> Result<()> {
        self.weights_out[k % 2]
            .copy_out_async(0, &mut weights.view_mut(r), &self.up)
            .map_err(e)?;
        self.sent[k % 2].record(&self.up).map_err(e)
    }

    /// Queues the packed f32 tensors up into `side`, then waits for every
    /// copy up.
    fn finish(&mut self, side: Option<&mut DeviceBuffer<f32>>) -> Result<()> {
        match (&mut self.side, side) {
            (Some((map, stage)), Some(dev)) => {
                if dev.len() != map.len() {
                    return Err(format!(
                        "offloaded optimizer: {} packed f32 parameters on the GPU, {} expected",
                        dev.len(),
                        map.len()
                    ));
                }
                let out = stage.as_mut_slice();
                for (r, at) in map.parts() {
                    out[*at..at + r.len()].copy_from_slice(&self.core.master()[r.clone()]);
                }
                if !map.is_empty() {
                    stage.copy_out_async(0, dev, &self.up).map_err(e)?;
                }
            }
            (None, None) => {}
            _ => return Err("offloaded optimizer: packed f32 parameters mismatched".into()),
        }
        self.ready.record(&self.up).map_err(e)?;
        wait(&self.ready, "copying weights to the GPU")
    }
}

/// The error of a pinned allocation of `n` elements that failed.
fn pin_error(x: braid_cuda::CudaError, n: usize) -> String {
    format!("offloaded optimizer: pinning {n} elements of host memory for transfers: {x}")
}
