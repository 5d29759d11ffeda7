//! [`Staging`]: the host memory a save copies the model state into before
//! the background writer takes it. For a GPU it is page-locked (the copy
//! from the device runs at the link's speed instead of through the
//! driver's bounce buffers) where host memory allows; it is kept from one
//! save to the next (the writer hands it back), so that page-locking and
//! first-touch page faults are paid once, not at every save.

use crate::Result;
use braid_cuda::{Device, PinnedBuffer};
use std::ops::{Deref, DerefMut};

/// Host memory holding `f32`s: plain, or page-locked for a GPU.
pub enum HostBuf {
    /// Ordinary memory.
    Plain(Vec<f32>),
    /// Page-locked memory.
    Pinned(PinnedBuffer<f32>),
}

impl Deref for HostBuf {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        match self {
            HostBuf::Plain(v) => v,
            HostBuf::Pinned(p) => p.as_slice(),
        }
    }
}

impl DerefMut for HostBuf {
    fn deref_mut(&mut self) -> &mut [f32] {
        match self {
            HostBuf::Plain(v) => v,
            HostBuf::Pinned(p) => p.as_mut_slice(),
        }
    }
}

impl std::fmt::Debug for HostBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self {
            HostBuf::Plain(_) => "plain",
            HostBuf::Pinned(_) => "pinned",
        };
        write!(f, "HostBuf({kind}, {} elements)", self.len())
    }
}

/// Where a rank's saves get their host buffers.
#[derive(Default)]
pub struct Staging {
    /// Buffers of earlier saves, free again.
    spare: Vec<HostBuf>,
    /// The GPU whose state is copied (page-locked memory for it), if any.
    device: Option<Device>,
    /// Bytes of page-locked memory held.
    pinned_bytes: u64,
}

/// Page-locked memory a rank takes at most, as a share of the host's
/// available memory when it asks (the rest stays pageable: pinning most
/// of the memory starves the page cache the writer needs).
const PINNED_SHARE: f64 = 0.4;

impl Staging {
    /// Staging for state copied from `device` (page-locked), or from host
    /// memory (`None`).
    pub fn new(device: Option<Device>) -> Staging {
        Staging {
            device,
            ..Default::default()
        }
    }

    /// A buffer of `len` elements (contents unspecified): a spare of that
    /// length if there is one, else new memory.
    pub fn take(&mut self, len: usize) -> Result<HostBuf> {
        if let Some(i) = self.spare.iter().position(|b| b.len() == len) {
            return Ok(self.spare.swap_remove(i));
        }
        let bytes = 4 * len as u64;
        if let Some(dev) = &self.device {
            let budget = braid_model::footprint::host_available()
                .map(|a| (a as f64 * PINNED_SHARE) as u64)
                .unwrap_or(0);
            if bytes > 0 && bytes <= budget {
                if let Ok(p) = PinnedBuffer::zeros(dev, len) {
                    self.pinned_bytes += bytes;
                    return Ok(HostBuf::Pinned(p));
                }
            }
        }
        Ok(HostBuf::Plain(vec![0.0; len]))
    }

    /// Hands buffers back for the next save.
    pub fn give_back(&mut self, bufs: impl IntoIterator<Item = HostBuf>) {
        self.spare.extend(bufs);
    }

    /// Bytes of page-locked memory taken so far.
    pub fn pinned_bytes(&self) -> u64 {
        self.pinned_bytes
    }
}
