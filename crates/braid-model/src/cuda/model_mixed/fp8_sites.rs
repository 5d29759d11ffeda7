//! Delayed scaling's memory (`BRAID_FP8_SCALING=delayed`): each
//! quantisation in a pass is a site, known by its place in the pass's
//! order (the forward and backward passes run their products in the same
//! order every step) and checked by what it quantises; a site the previous
//! pass quantised alike takes the amax it measured then as its scale
//! (`fp8.cu`'s delayed casts), any other is scaled by its own amax, as the
//! dynamic recipe does, and remembered for the next pass.
//!
//! The amaxes live on the device in two arrays of [`CAPACITY`] values, one
//! a pass writes and one it reads (written by the pass before), so that no
//! kernel reads a value another may be writing.

use crate::cuda::fp8::Scaling;
use braid_cuda::blaslt::Fp8;
use braid_cuda::{Device, DeviceBuffer, Result, Stream};

/// Sites remembered a pass; those past it are scaled dynamically.
pub(crate) const CAPACITY: usize = 4096;

/// What a site quantises: the source's address and length, its shape, as
/// stored or transposed, and the format.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct SiteKey {
    pub(super) at: (u64, usize),
    pub(super) shape: (usize, usize),
    pub(super) transposed: bool,
    pub(super) fmt: Fp8,
}

/// The sites' order and history on the host (what the device arrays hold).
#[derive(Debug, Default)]
pub(super) struct SiteOrder {
    keys: Vec<SiteKey>,
    /// The pass that last wrote each site's amax.
    written: Vec<u64>,
    pass: u64,
    next: usize,
}

/// A site's turn: its index, and whether the previous pass left it an
/// amax to scale by (else: dynamic, and its amax kept for the next).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Visit {
    pub(super) index: usize,
    pub(super) delayed: bool,
}

impl SiteOrder {
    /// A new pass: the sites count from 0 again.
    pub(super) fn begin_pass(&mut self) {
        self.pass += 1;
        self.next = 0;
    }

    /// The next site, quantising `key`; `None` past [`CAPACITY`].
    pub(super) fn visit(&mut self, key: SiteKey) -> Option<Visit> {
        let index = self.next;
        self.next += 1;
        if index >= CAPACITY {
            return None;
        }
        if index == self.keys.len() {
            self.keys.push(key);
            self.written.push(0);
        }
        let delayed =
            self.keys[index] == key && self.pass > 1 && self.written[index] == self.pass - 1;
        self.keys[index] = key;
        self.written[index] = self.pass;
        Some(Visit { index, delayed })
    }

    /// The array this pass writes (0 or 1); it reads the other.
    pub(super) fn writes(&self) -> usize {
        (self.pass % 2) as usize
    }
}

/// Where a dynamically scaled site's amax is kept: one of the two arrays,
/// at the site's index.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Slot {
    array: usize,
    index: usize,
}

/// The sites with their device arrays (made at the first visit).
pub(super) struct Fp8Sites {
    order: SiteOrder,
    amax: Option<[DeviceBuffer<f32>; 2]>,
}

impl Fp8Sites {
    pub(super) fn new() -> Fp8Sites {
        Fp8Sites {
            order: SiteOrder::default(),
            amax: None,
        }
    }

    pub(super) fn begin_pass(&mut self) {
        self.order.begin_pass();
    }

    /// The scaling for the next site, quantising `key`, and where its
    /// dynamically measured amax must be kept (`Some(slot)`: give the
    /// quantisation's amax to [`Fp8Sites::keep`] after it; `None`: the
    /// delayed kernels keep it themselves, or the site is past the
    /// capacity).
    pub(super) fn next(
        &mut self,
        device: &Device,
        key: SiteKey,
    ) -> Result<(Scaling, Option<Slot>)> {
        let Some(v) = self.order.visit(key) else {
            return Ok((Scaling::Dynamic, None));
        };
        if self.amax.is_none() {
            self.amax = Some([
                DeviceBuffer::zeros(device, CAPACITY)?,
                DeviceBuffer::zeros(device, CAPACITY)?,
            ]);
        }
        let arrays = self.amax.as_ref().expect("made above");
        let w = self.order.writes();
        Ok(match v.delayed {
            true => (
                Scaling::Delayed {
                    hist: arrays[1 - w].ptr_at(v.index),
                    next: arrays[w].ptr_at(v.index),
                },
                None,
            ),
            false => (
                Scaling::Dynamic,
                Some(Slot {
                    array: w,
                    index: v.index,
                }),
            ),
        })
    }

    /// Keeps a dynamic quantisation's amax (`from`, one f32) in `to` (a
    /// slot [`Fp8Sites::next`] gave), queued on `s`.
    pub(super) fn keep(&mut self, s: &Stream, from: &DeviceBuffer<f32>, to: Slot) -> Result<()> {
        let Some(arrays) = self.amax.as_mut() else {
            return Ok(());
        };
        let mut kept = arrays[to.array].view_mut(to.index..to.index + 1);
        braid_cuda::memory::copy_async(&mut kept, from, s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(at: u64) -> SiteKey {
        SiteKey {
            at: (at, 64),
            shape: (8, 8),
            transposed: false,
            fmt: Fp8::E4M3,
        }
    }

    /// A site is delayed only where the pass before quantised the same
    /// thing at the same place in its order.
    #[test]
    fn a_site_scales_by_the_last_pass_only_when_it_was_alike() {
        let mut o = SiteOrder::default();
        o.begin_pass();
        assert_eq!(o.writes(), 1);
        let first: Vec<bool> = [1, 2, 3].map(|a| o.visit(key(a)).unwrap().delayed).to_vec();
        assert_eq!(first, [false, false, false]);
        o.begin_pass();
        assert_eq!(o.writes(), 0);
        assert_eq!(
            o.visit(key(1)),
            Some(Visit {
                index: 0,
                delayed: true
            })
        );
        // Another tensor at site 1: dynamic, and remembered.
        assert_eq!(
            o.visit(key(9)),
            Some(Visit {
                index: 1,
                delayed: false
            })
        );
        // A shorter pass (an evaluation) leaves site 2 unwritten...
        o.begin_pass();
        assert!(o.visit(key(1)).unwrap().delayed);
        assert!(o.visit(key(9)).unwrap().delayed);
        o.begin_pass();
        assert!(o.visit(key(1)).unwrap().delayed);
        assert!(o.visit(key(9)).unwrap().delayed);
        // ...so when it comes back its amax is two passes old: dynamic.
        assert!(!o.visit(key(3)).unwrap().delayed);
    }

    #[test]
    fn sites_past_the_capacity_are_scaled_dynamically() {
        let mut o = SiteOrder::default();
        o.begin_pass();
        for i in 0..CAPACITY {
            assert!(o.visit(key(i as u64)).is_some());
        }
        assert_eq!(o.visit(key(0)), None);
    }
}
