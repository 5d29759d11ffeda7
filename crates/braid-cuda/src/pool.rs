//! A caching device allocator for one stream of work, and the process's
//! device-memory counters.
//!
//! A [`DevicePool`] hands out [`DeviceBuffer`]s whose memory returns to the
//! pool when they are dropped (no `cuMemFree`, no synchronisation), to be
//! handed out again by the next allocation of the same rounded size. That
//! is only safe when everything using the pool's buffers runs on one
//! stream, in order — the training engine's discipline — so a pool belongs
//! to one stream's user. When the GPU runs out of memory the pool frees its
//! cached blocks and tries again.
//!
//! [`allocated_bytes`] and [`peak_allocated_bytes`] count every live
//! `DeviceBuffer` of the process (pooled or not; cached blocks excluded),
//! like PyTorch's `memory_allocated` / `max_memory_allocated`. The
//! training loop names the part of its work running now
//! ([`enter_phase`]); the counters keep the part in which the peak was
//! reached ([`peak_phase`]) and the most bytes live in each part.

use crate::driver::{Device, Stream};
use crate::error::{driver, CudaError, Result};
use crate::memory::DeviceBuffer;
use braid_core::Element;
use cudarc::driver::{result, sys};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
static PHASE: AtomicU64 = AtomicU64::new(0);
static PEAK_PHASE: AtomicU64 = AtomicU64::new(0);
static PHASE_PEAK: AtomicUsize = AtomicUsize::new(0);

/// Bytes held by live device buffers of this process.
pub fn allocated_bytes() -> usize {
    LIVE.load(Ordering::Relaxed)
}

/// The most bytes live device buffers held at once since the start (or
/// the last [`reset_peak`]).
pub fn peak_allocated_bytes() -> usize {
    PEAK.load(Ordering::Relaxed)
}

/// Starts a new peak measurement from what is live now.
pub fn reset_peak() {
    PEAK.store(LIVE.load(Ordering::Relaxed), Ordering::Relaxed);
    PEAK_PHASE.store(PHASE.load(Ordering::Relaxed), Ordering::Relaxed);
}

/// Names the part of the work that runs from now on (`code`, a number
/// its caller gives meaning to) and returns the most bytes live during
/// the part before (counted from what was live when it was entered).
pub fn enter_phase(code: u64) -> usize {
    PHASE.store(code, Ordering::Relaxed);
    PHASE_PEAK.swap(LIVE.load(Ordering::Relaxed), Ordering::Relaxed)
}

/// The code of the part of the work (see [`enter_phase`]) that was
/// running when [`peak_allocated_bytes`] was reached.
pub fn peak_phase() -> u64 {
    PEAK_PHASE.load(Ordering::Relaxed)
}

pub(crate) fn count_alloc(bytes: usize) {
    let now = LIVE.fetch_add(bytes, Ordering::Relaxed) + bytes;
    PHASE_PEAK.fetch_max(now, Ordering::Relaxed);
    if PEAK.fetch_max(now, Ordering::Relaxed) < now {
        PEAK_PHASE.store(PHASE.load(Ordering::Relaxed), Ordering::Relaxed);
    }
}

pub(crate) fn count_free(bytes: usize) {
    LIVE.fetch_sub(bytes, Ordering::Relaxed);
}

/// Sizes are rounded so that blocks are reusable across nearby requests:
/// 512 B steps below 1 MiB, 2 MiB steps above.
fn rounded(bytes: usize) -> usize {
    const SMALL: usize = 512;
    const LARGE: usize = 2 << 20;
    if bytes < (1 << 20) {
        bytes.div_ceil(SMALL) * SMALL
    } else {
        bytes.div_ceil(LARGE) * LARGE
    }
}

pub(crate) struct PoolInner {
    free: BTreeMap<usize, Vec<sys::CUdeviceptr>>,
    cached: usize,
}

/// A caching allocator for buffers used on one stream (see the module
/// documentation).
#[derive(Clone)]
pub struct DevicePool {
    device: Device,
    inner: Arc<Mutex<PoolInner>>,
}

/// Where a pooled buffer's block goes back to.
pub(crate) struct PoolSlot {
    pub(crate) inner: Arc<Mutex<PoolInner>>,
    pub(crate) block: usize,
}

impl PoolSlot {
    pub(crate) fn give_back(&self, ptr: sys::CUdeviceptr) {
        let mut p = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        p.free.entry(self.block).or_default().push(ptr);
        p.cached += self.block;
    }
}

impl DevicePool {
    /// An empty pool on `device`.
    pub fn new(device: &Device) -> DevicePool {
        DevicePool {
            device: device.clone(),
            inner: Arc::new(Mutex::new(PoolInner {
                free: BTreeMap::new(),
                cached: 0,
            })),
        }
    }

    /// `len` elements whose contents are whatever the block held before.
    pub fn uninit<T: Element>(&self, len: usize) -> Result<DeviceBuffer<T>> {
        let bytes = len.checked_mul(T::DTYPE.size()).ok_or_else(|| {
            CudaError::Invalid(format!("{len} elements of {} overflow", T::DTYPE))
        })?;
        if bytes == 0 {
            return DeviceBuffer::zeros(&self.device, 0);
        }
        let block = rounded(bytes);
        let reused = {
            let mut p = self.inner.lock().unwrap_or_else(|e| e.into_inner());
            let ptr = p.free.get_mut(&block).and_then(|v| v.pop());
            if ptr.is_some() {
                p.cached -= block;
            }
            ptr
        };
        let ptr = match reused {
            Some(ptr) => ptr,
            None => self.fresh(block)?,
        };
        let slot = PoolSlot {
            inner: self.inner.clone(),
            block,
        };
        // SAFETY: `ptr` is a block of `block >= bytes` bytes on this
        // device, owned by nobody else until the buffer gives it back.
        Ok(unsafe { DeviceBuffer::from_pool(&self.device, ptr, len, slot) })
    }

    /// `len` zeroed elements; the zeroing is queued on `stream`.
    pub fn zeros<T: Element>(&self, len: usize, stream: &Stream) -> Result<DeviceBuffer<T>> {
        let mut buf = self.uninit(len)?;
        crate::memory::zero_async(&mut buf, stream)?;
        Ok(buf)
    }

    /// Bytes cached (free blocks not yet returned to the driver).
    pub fn cached_bytes(&self) -> usize {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).cached
    }

    /// Returns every cached block to the driver (after the device is idle).
    pub fn release(&self) -> Result<()> {
        self.device.bind()?;
        let blocks: Vec<sys::CUdeviceptr> = {
            let mut p = self.inner.lock().unwrap_or_else(|e| e.into_inner());
            p.cached = 0;
            std::mem::take(&mut p.free)
                .into_values()
                .flatten()
                .collect()
        };
        if blocks.is_empty() {
            return Ok(());
        }
        self.device.synchronize()?;
        for ptr in blocks {
            // SAFETY: cached blocks belong to no buffer; the device is idle.
            unsafe { result::free_sync(ptr) }.map_err(driver("cuMemFree"))?;
        }
        Ok(())
    }

    fn fresh(&self, block: usize) -> Result<sys::CUdeviceptr> {
        self.device.bind()?;
        // SAFETY: plain allocation in the bound context; it goes back to
        // the pool, and to the driver in `release`.
        match unsafe { result::malloc_sync(block) } {
            Ok(p) => Ok(p),
            Err(_) if self.cached_bytes() > 0 => {
                self.release()?;
                // SAFETY: as above.
                unsafe { result::malloc_sync(block) }.map_err(|e| oom(e, block, &self.device))
            }
            Err(e) => Err(oom(e, block, &self.device)),
        }
    }
}

fn oom(e: result::DriverError, block: usize, device: &Device) -> CudaError {
    let mut err = driver("cuMemAlloc")(e);
    if let CudaError::Driver { text, .. } = &mut err {
        text.push_str(&format!(
            "; asked for {block} bytes on GPU {} with {} bytes in live buffers",
            device.ordinal(),
            allocated_bytes()
        ));
    }
    err
}

#[cfg(test)]
mod tests {
    use super::rounded;

    #[test]
    fn sizes_round_to_reusable_blocks() {
        assert_eq!(rounded(1), 512);
        assert_eq!(rounded(512), 512);
        assert_eq!(rounded(513), 1024);
        assert_eq!(rounded(1 << 20), 2 << 20);
        assert_eq!(rounded((2 << 20) + 1), 4 << 20);
    }
}
