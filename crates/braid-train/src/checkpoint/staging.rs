//! [`Staging`]: the host memory a save copies the model state into before
//! the background writer takes it. For a GPU it is page-locked (the copy
//! from the device runs at the link's speed instead of through the
//! driver's bounce buffers) where host memory allows; it is kept from one
//! save to the next (the writer hands it back), so that page-locking and
//! first-touch page faults are paid once, not at every save.

use crate::Result;
use braid_cuda::{Device, PinnedBuffer};
use std::ops::{Deref, DerefMut};
use std::thread::JoinHandle;

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
pub struct Staging {
    /// Buffers of earlier saves, free again.
    spare: Vec<HostBuf>,
    /// The GPU whose state is copied (page-locked memory for it), if any.
    device: Option<Device>,
    /// Page-locked buffers being allocated in the background, by length.
    pending: Vec<(usize, JoinHandle<Option<PinnedBuffer<f32>>>)>,
    /// Bytes of page-locked memory asked for.
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
            spare: Vec::new(),
            device,
            pending: Vec::new(),
            pinned_bytes: 0,
        }
    }

    /// A buffer of `len` elements (contents unspecified): a spare of that
    /// length if there is one (page-locked first), else new memory. For a
    /// GPU, page-locking gigabytes takes seconds: the first buffer of a
    /// length is pageable, and a page-locked one is made in the
    /// background for the saves after it.
    pub fn take(&mut self, len: usize) -> Result<HostBuf> {
        // Page-locked buffers of this length on their way: worth waiting
        // for (their allocation costs about what a pageable copy would).
        if self.pending.iter().any(|(l, _)| *l == len) {
            self.collect_len(len);
        }
        self.collect(false);
        let pinned = self
            .spare
            .iter()
            .position(|b| b.len() == len && matches!(b, HostBuf::Pinned(_)));
        if let Some(i) = pinned.or_else(|| self.spare.iter().position(|b| b.len() == len)) {
            let buf = self.spare.swap_remove(i);
            if matches!(buf, HostBuf::Plain(_)) {
                self.pin_later(len);
            }
            return Ok(buf);
        }
        self.pin_later(len);
        Ok(HostBuf::Plain(vec![0.0; len]))
    }

    /// Starts making a page-locked buffer of `len` elements in the
    /// background, if there is a GPU, none is on its way, and the host has
    /// the memory.
    fn pin_later(&mut self, len: usize) {
        let Some(dev) = self.device.clone() else {
            return;
        };
        let wanted = self.pending.iter().filter(|(l, _)| *l == len).count()
            + self
                .spare
                .iter()
                .filter(|b| b.len() == len && matches!(b, HostBuf::Pinned(_)))
                .count();
        // As many page-locked buffers of a length as a save takes of it
        // (a part's moments share their length).
        let per_save = 3;
        let bytes = 4 * len as u64;
        let budget = braid_model::footprint::host_available()
            .map(|a| (a as f64 * PINNED_SHARE) as u64)
            .unwrap_or(0);
        if len == 0 || wanted >= per_save || bytes > budget.saturating_sub(self.pinned_bytes) {
            return;
        }
        self.pinned_bytes += bytes;
        let h = std::thread::Builder::new()
            .name("braid-ckpt-pin".into())
            .spawn(move || PinnedBuffer::zeros(&dev, len).ok());
        if let Ok(h) = h {
            self.pending.push((len, h));
        }
    }

    /// Makes `count` page-locked buffers of `len` elements in the
    /// background now (before the first save, which then copies at the
    /// link's speed too).
    pub fn prepare(&mut self, len: usize, count: usize) {
        for _ in 0..count {
            self.pin_later(len);
        }
    }

    /// Waits for the page-locked allocations of `len` elements.
    fn collect_len(&mut self, len: usize) {
        let (mine, rest): (Vec<_>, Vec<_>) = std::mem::take(&mut self.pending)
            .into_iter()
            .partition(|(l, _)| *l == len);
        self.pending = rest;
        for (len, h) in mine {
            if let Ok(Some(p)) = h.join() {
                self.adopt(len, p);
            }
        }
    }

    /// A finished page-locked buffer joins the spares, replacing a
    /// pageable one of its length.
    fn adopt(&mut self, len: usize, p: PinnedBuffer<f32>) {
        if let Some(j) = self
            .spare
            .iter()
            .position(|b| b.len() == len && matches!(b, HostBuf::Plain(_)))
        {
            self.spare.swap_remove(j);
        }
        self.spare.push(HostBuf::Pinned(p));
    }

    /// Moves finished page-locked allocations into the spares (waiting
    /// for all with `wait`), dropping pageable spares they replace.
    fn collect(&mut self, wait: bool) {
        let mut i = 0;
        while i < self.pending.len() {
            if !wait && !self.pending[i].1.is_finished() {
                i += 1;
                continue;
            }
            let (len, h) = self.pending.swap_remove(i);
            if let Ok(Some(p)) = h.join() {
                self.adopt(len, p);
            }
        }
    }

    /// Hands buffers back for the next save (a pageable one is dropped
    /// where a page-locked one of its length is spare).
    pub fn give_back(&mut self, bufs: impl IntoIterator<Item = HostBuf>) {
        for b in bufs {
            let replaced = matches!(b, HostBuf::Plain(_))
                && self
                    .spare
                    .iter()
                    .any(|s| s.len() == b.len() && matches!(s, HostBuf::Pinned(_)));
            if !replaced {
                self.spare.push(b);
            }
        }
    }

    /// Bytes of page-locked memory asked for so far.
    pub fn pinned_bytes(&self) -> u64 {
        self.pinned_bytes
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        self.collect(true);
    }
}
