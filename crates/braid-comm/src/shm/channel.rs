//! Layout of a communicator's segment and the round protocol on it.
//!
//! ```text
//! [ control: one 256-byte block per rank: `ready` flag, `consumed` flag ]
//! [ data: per rank, two halves of `half` bytes                          ]
//! [ rings: one byte ring per ordered pair of ranks (point-to-point)     ]
//! ```
//!
//! Collectives proceed in *rounds* numbered 1, 2, 3... identically on every
//! rank. In a round, writers fill a half of their own data slot and post
//! `ready = round`; readers wait for the writers they need, read, and at
//! the end of the round every rank posts `consumed = round`. Before a
//! writer reuses a half it waits until every rank has consumed the last
//! round that read it; alternating halves lets consecutive rounds overlap.

use super::flag::{self, Flag, WaitPolicy};
use super::segment::Segment;
use crate::backend::Ctx;
use crate::error::Result;

const CTL: usize = 256;
const RING_CTL: usize = 256;
const PAGE: usize = 4096;

/// Sizes of a segment's parts.
#[derive(Debug, Clone, Copy)]
pub struct Layout {
    /// Ranks.
    pub n: usize,
    /// Bytes per data half.
    pub half: usize,
    /// Bytes per point-to-point ring.
    pub ring: usize,
}

impl Layout {
    fn ctl_bytes(&self) -> usize {
        (self.n * CTL).div_ceil(PAGE) * PAGE
    }
    fn data_bytes(&self) -> usize {
        self.n * 2 * self.half
    }
    fn ring_stride(&self) -> usize {
        RING_CTL + self.ring
    }
    /// Total segment size.
    pub fn total(&self) -> usize {
        self.ctl_bytes() + self.data_bytes() + self.n * self.n * self.ring_stride()
    }
}

/// One rank's view of the segment.
pub struct Channel {
    seg: std::sync::Arc<Segment>,
    /// Segment layout.
    pub layout: Layout,
    /// This rank.
    pub rank: usize,
    round: u64,
    last_read: [u64; 2],
    next_half: usize,
    /// How waits spin, yield and sleep.
    pub policy: WaitPolicy,
}

impl Channel {
    /// Wraps a mapped segment.
    pub fn new(seg: std::sync::Arc<Segment>, layout: Layout, rank: usize) -> Channel {
        assert!(
            seg.len() >= layout.total(),
            "segment smaller than its layout"
        );
        Channel {
            seg,
            layout,
            rank,
            round: 0,
            last_read: [0; 2],
            next_half: 0,
            policy: WaitPolicy::for_ranks(layout.n),
        }
    }

    fn ready(&self, r: usize) -> &Flag {
        // SAFETY: the control block of rank `r < n` lies inside the mapping,
        // is 8-byte aligned (page-aligned base, 256-byte blocks) and is only
        // accessed through the atomics of `Flag`.
        unsafe { &*(self.seg.ptr().add(r * CTL) as *const Flag) }
    }

    fn consumed(&self, r: usize) -> &Flag {
        // SAFETY: as for `ready`, 128 bytes further (its own cache lines).
        unsafe { &*(self.seg.ptr().add(r * CTL + 128) as *const Flag) }
    }

    fn slot_ptr(&self, r: usize, h: usize) -> *mut u8 {
        debug_assert!(r < self.layout.n && h < 2);
        // SAFETY: offset of rank r's half h, inside the data area.
        unsafe {
            self.seg
                .ptr()
                .add(self.layout.ctl_bytes() + (r * 2 + h) * self.layout.half)
        }
    }

    /// Bytes `range` of rank `r`'s half `h`, for reading. The round protocol
    /// guarantees nobody writes them while a reader holds them.
    pub fn slot(&self, r: usize, h: usize, range: std::ops::Range<usize>) -> &[u8] {
        assert!(range.end <= self.layout.half);
        // SAFETY: in bounds (checked above) of a live mapping; writers of
        // this region wait for readers through the consumed flags.
        unsafe { std::slice::from_raw_parts(self.slot_ptr(r, h).add(range.start), range.len()) }
    }

    /// Bytes `range` of this rank's own half `h`, for writing.
    #[allow(clippy::mut_from_ref)]
    pub fn own_slot(&self, h: usize, range: std::ops::Range<usize>) -> &mut [u8] {
        assert!(range.end <= self.layout.half);
        // SAFETY: in bounds of a live mapping; only this rank writes its own
        // slot, and callers never hold two overlapping views of it.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.slot_ptr(self.rank, h).add(range.start),
                range.len(),
            )
        }
    }

    /// Starts a round writing into the next half: waits until every rank has
    /// consumed the last round that read that half. Returns (round, half).
    pub fn begin(&mut self, ctx: &Ctx) -> Result<(u64, usize)> {
        let h = self.next_half;
        self.next_half ^= 1;
        let need = self.last_read[h];
        if need > 0 {
            for r in 0..self.layout.n {
                flag::wait(self.consumed(r), need, self.policy, ctx, r)?;
            }
        }
        self.round += 1;
        Ok((self.round, h))
    }

    /// Starts a further round reading the same half as the previous one
    /// (no wait: only regions nobody else reads are rewritten).
    pub fn continue_round(&mut self) -> u64 {
        self.round += 1;
        self.round
    }

    /// Publishes this rank's data for `round`.
    pub fn post(&self, round: u64) {
        self.ready(self.rank).post(round);
    }

    /// Waits until rank `r` has posted `round`.
    pub fn wait_for(&self, ctx: &Ctx, r: usize, round: u64) -> Result<()> {
        flag::wait(self.ready(r), round, self.policy, ctx, r)
    }

    /// Waits until every rank has posted `round`.
    pub fn wait_all(&self, ctx: &Ctx, round: u64) -> Result<()> {
        for r in 0..self.layout.n {
            self.wait_for(ctx, r, round)?;
        }
        Ok(())
    }

    /// Ends `round`, whose reads touched half `h`.
    pub fn finish(&mut self, round: u64, h: usize) {
        self.last_read[h] = round;
        self.consumed(self.rank).post(round);
    }

    /// The mapping this channel works in.
    pub fn segment(&self) -> std::sync::Arc<Segment> {
        self.seg.clone()
    }
}

/// The ring carrying bytes from `src` to `dst` in `seg`: (head flag written
/// by `src`, tail flag written by `dst`, data of `layout.ring` bytes).
pub fn ring<'a>(
    seg: &'a Segment,
    layout: &Layout,
    src: usize,
    dst: usize,
) -> (&'a Flag, &'a Flag, *mut u8) {
    assert!(src < layout.n && dst < layout.n && seg.len() >= layout.total());
    let base =
        layout.ctl_bytes() + layout.data_bytes() + (src * layout.n + dst) * layout.ring_stride();
    // SAFETY: the ring block of (src, dst) lies inside the mapping (checked
    // above); its two flags sit on separate cache lines at 8-byte aligned
    // offsets and are only used through atomics.
    unsafe {
        let p = seg.ptr().add(base);
        (
            &*(p as *const Flag),
            &*(p.add(128) as *const Flag),
            p.add(RING_CTL),
        )
    }
}
