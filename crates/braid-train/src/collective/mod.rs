//! [`Collective`]: the collectives a strategy needs, over host memory
//! ([`HostCollective`]: braid's shm/tcp backends) or one GPU
//! ([`DeviceCollective`]: NCCL), called the same way.
//!
//! The central call is [`Collective::reduce`]: a *reduction session*
//! during a backward pass. The strategy's `drive` closure runs the
//! engine's backward units and hands each finished bucket — a part split
//! off the gradient [`Window`] — to a launcher, which starts
//! its reduction at once (on the progress thread of the host communicator,
//! or on the GPU's communication stream) through the bucket's
//! communication hook ([`GradComm`]). The session returns when every
//! reduction has finished (host) or is ordered before later work on the
//! engine's stream (GPU). Parts are borrowed from the gradient buffer for
//! the session, so no reduction can outlive it.

mod copy_engine;
mod device;
mod host;
pub(crate) mod powersgd;
mod symmetric_blocks;
pub mod zero_cta;

pub use copy_engine::{CopyEngineReduce, MAX_RANKS as COPY_ENGINE_MAX_RANKS};
pub use device::DeviceCollective;
pub use host::HostCollective;
pub use powersgd::PowerSgdOptions;

use crate::engine::Matrix;
use crate::space::{Space, Window};
use crate::strategy::CommStep;
use crate::Result;
use braid_comm::Communicator;
use std::ops::Range;

/// How a bucket's gradients travel (DDP's communication hook).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum GradComm {
    /// f32 all-reduce.
    Plain,
    /// Cast to bfloat16, all-reduce, cast back: half the bytes.
    Bf16,
    /// Cast to IEEE half (pre-divided by the number of ranks, against
    /// overflow), all-reduce, cast back: half the bytes.
    Fp16,
    /// PowerSGD low-rank compression of the matrices, with error feedback
    /// and warm start; everything else plain.
    PowerSgd(PowerSgdOptions),
}

impl GradComm {
    /// `plain`, `bf16`, `fp16` or `powersgd[:RANK[:START_ITER]]`.
    pub fn parse(s: &str) -> Result<GradComm> {
        let bad = || {
            format!(
                "--grad-comm {s:?}: expected plain, bf16, fp16 or powersgd[:RANK[:START_ITER]] \
                 (e.g. powersgd:2:10)"
            )
        };
        match s {
            "plain" | "none" | "f32" => return Ok(GradComm::Plain),
            "bf16" => return Ok(GradComm::Bf16),
            "fp16" => return Ok(GradComm::Fp16),
            _ => {}
        }
        let mut parts = s.split(':');
        if parts.next() != Some("powersgd") {
            return Err(bad());
        }
        let mut o = PowerSgdOptions::default();
        if let Some(r) = parts.next() {
            o.rank = r.parse().map_err(|_| bad())?;
            if o.rank == 0 {
                return Err(format!("{}: the rank must be at least 1", bad()));
            }
        }
        if let Some(k) = parts.next() {
            o.start_iter = k.parse().map_err(|_| bad())?;
        }
        if parts.next().is_some() {
            return Err(bad());
        }
        Ok(GradComm::PowerSgd(o))
    }

    /// The name for messages.
    pub fn name(&self) -> String {
        match self {
            GradComm::Plain => "plain f32".into(),
            GradComm::Bf16 => "bf16".into(),
            GradComm::Fp16 => "fp16".into(),
            GradComm::PowerSgd(o) => format!(
                "PowerSGD rank {} from step {} (error feedback, warm start)",
                o.rank, o.start_iter
            ),
        }
    }
}

/// Which end of the gradient window a bucket is split off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    /// The highest indices.
    Back,
    /// The lowest indices.
    Front,
}

/// Consecutive gradient elements reduced together.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bucket {
    /// Elements of the gradient buffer.
    pub range: Range<usize>,
    /// Where it leaves the window.
    pub end: End,
    /// The two-dimensional parameters inside it.
    pub matrices: Vec<Matrix>,
}

/// The launcher a reduction session hands to its driver: starts the
/// reduction of bucket `index`, whose elements are `part`.
pub type Launch<'l, 'g, S> =
    dyn FnMut(usize, <<S as Space>::Window<'g> as Window<'g>>::Part) -> Result<()> + 'l;

/// The body of a reduction session: gets the gradient window and the
/// launcher.
pub type Drive<'d, 'g, S> =
    dyn FnMut(<S as Space>::Window<'g>, &mut Launch<'_, 'g, S>) -> Result<()> + 'd;

/// One all-gather of a parameter-sharded exchange
/// ([`Collective::shard_exchange`]): every rank's elements `from` of its
/// master shard, in rank order, land in `into` from element `at`.
pub struct GatherPart<'a, F> {
    /// This rank's elements of the master shard.
    pub from: Range<usize>,
    /// Where the gathered block goes.
    pub into: &'a mut F,
    /// Its first element there.
    pub at: usize,
    /// Gather in bf16 ([`Collective::half_gathers`]): each rank's f32
    /// elements are rounded to bf16 (to nearest even) and the block lands
    /// as bf16 values packed two to an f32 element of `into`, from `at`
    /// (half the elements, half the bytes on the wire). `from` must have
    /// an even length.
    pub half: bool,
}

impl<F> GatherPart<'_, F> {
    /// Elements of `into` the gathered block takes over `n` ranks.
    pub fn into_len(&self, n: usize) -> usize {
        match self.half {
            true => n * self.from.len() / 2,
            false => n * self.from.len(),
        }
    }
}

/// One reduce-scatter of a parameter-sharded exchange: `grads` (one
/// block's gradients, one equal part per rank) summed over the ranks;
/// this rank's part of the sum is added to the elements `to` of the
/// shard's gradients. `grads` holds nothing meaningful afterwards (the
/// GPU sums in place).
pub struct ScatterPart<'a, F> {
    /// The block's gradients on this rank.
    pub grads: &'a mut F,
    /// This rank's elements of the shard's gradients.
    pub to: Range<usize>,
    /// Add the reduced block into them (a later micro-batch of the step),
    /// or overwrite them (the step's first: nothing needs zeroing before,
    /// and the elements may hold something else until then).
    pub add: bool,
}

/// A parameter-sharded exchange's work besides its collectives (a unit
/// of the forward or backward pass).
pub type During<'d> = dyn FnMut() -> Result<()> + 'd;

/// Collectives over one memory space; see the [module docs](self).
pub trait Collective {
    /// Where the buffers are.
    type Space: Space;
    /// Per-bucket state of the communication hook (half-precision copies,
    /// PowerSGD's matrices and errors).
    type Hooks;

    /// This rank.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn size(&self) -> usize;
    /// The host communicator (small host-side exchanges, health).
    fn host(&self) -> &Communicator;
    /// The backend, for messages (`shm`, `tcp`, `nccl`).
    fn backend(&self) -> String;
    /// Overwrites `flat` with rank `root`'s.
    fn broadcast(&self, flat: &mut <Self::Space as Space>::Flat, root: usize) -> Result<()>;
    /// The hook state for `comm` over `buckets`.
    fn hooks(&self, comm: GradComm, buckets: &[Bucket]) -> Result<Self::Hooks>;
    /// A reduction session over `grads` (see the [module docs](self)):
    /// `drive` gets the window and the launcher. Returns what was sent.
    fn reduce<'g>(
        &self,
        grads: <Self::Space as Space>::Window<'g>,
        buckets: &[Bucket],
        hooks: &mut Self::Hooks,
        drive: &mut Drive<'_, 'g, Self::Space>,
    ) -> Result<CommStep>;

    /// A reduce-scatter session (ZeRO stage 1's): like
    /// [`reduce`](Self::reduce), but each launched bucket, which splits
    /// into one equal block per rank, is summed over the ranks and only
    /// this rank's block of the sum ([`block_of`]) is kept, in place (the
    /// bucket's other elements then hold nothing meaningful). f32 sums,
    /// no hooks.
    fn reduce_scatter<'g>(
        &self,
        grads: <Self::Space as Space>::Window<'g>,
        buckets: &[Bucket],
        drive: &mut Drive<'_, 'g, Self::Space>,
    ) -> Result<CommStep>;

    /// A zeroed flat buffer of `len` elements where these collectives
    /// work.
    fn zeros(&self, len: usize) -> Result<<Self::Space as Space>::Flat>;

    /// A zeroed buffer of `len` elements for a parameter-sharded
    /// strategy's gathered blocks and block gradients
    /// ([`shard_exchange`](Self::shard_exchange)'s `into` and `grads`).
    /// Collective: every rank asks at the same point for the same `len`.
    /// [`zeros`](Self::zeros) unless the collectives keep such buffers
    /// apart (GPUs: registered for copy-engine all-gathers where every
    /// rank can have them, `BRAID_ZERO3_GATHER_VIA`).
    fn block_buffer(&self, len: usize) -> Result<<Self::Space as Space>::Flat> {
        self.zeros(len)
    }

    /// Whether a [`block_buffer`](Self::block_buffer) costs enough to
    /// make that a strategy should keep every one it frees for reuse
    /// rather than give some back (GPUs with copy-engine gathers: each is
    /// NCCL memory registered as a window, collective and slow). Known
    /// once the first block buffer is made.
    fn block_buffers_kept(&self) -> bool {
        false
    }

    /// Sums each of `ranges` of `flat` over the ranks, in place (a
    /// hybrid-sharded run's replicas adding up their shards).
    fn all_reduce_ranges(
        &self,
        flat: &mut <Self::Space as Space>::Flat,
        ranges: &[Range<usize>],
    ) -> Result<CommStep>;

    /// The collectives of the ranks that pass the same `color`, ordered by
    /// `key` (every rank calls it; a 2-D mesh is two splits).
    fn split(&self, color: u32, key: usize) -> Result<Self>
    where
        Self: Sized;

    /// Fills each of `ranges` of `flat` (each splitting into one equal
    /// block per rank) with every rank's block of it: rank `i` sends its
    /// block `i` (an all-gather in place per range). Returns what was sent.
    fn all_gather_ranges(
        &self,
        flat: &mut <Self::Space as Space>::Flat,
        ranges: &[Range<usize>],
    ) -> Result<CommStep>;

    /// Whether [`shard_exchange`](Self::shard_exchange) gathers in bf16
    /// ([`GatherPart::half`]).
    fn half_gathers(&self) -> bool {
        false
    }

    /// ZeRO stage 3's exchange around one unit of a pass: the
    /// `gathers` (parameter blocks from every rank's `master` shard) and
    /// the `scatters` (finished gradient blocks into `shard_grads`) run
    /// while `during` computes, and are complete when this returns (host)
    /// or ordered before the engine's later work (GPU). Collectives
    /// without it refuse.
    fn shard_exchange(
        &self,
        master: &<Self::Space as Space>::Flat,
        gathers: &mut [GatherPart<'_, <Self::Space as Space>::Flat>],
        shard_grads: &mut <Self::Space as Space>::Flat,
        scatters: &mut [ScatterPart<'_, <Self::Space as Space>::Flat>],
        during: &mut During<'_>,
    ) -> Result<CommStep> {
        let _ = (master, gathers, shard_grads, scatters, during);
        Err(format!(
            "ZeRO stage 3 (sharded parameters) over {} is not built (it runs over the host's \
             shm and tcp backends and NCCL)",
            self.backend()
        ))
    }
}

/// Whether a parameter-sharded exchange's parts fit their buffers over
/// `n` ranks (`len` gives a buffer's length), or which does not.
pub(crate) fn check_exchange<F>(
    n: usize,
    master_len: usize,
    gathers: &[GatherPart<'_, F>],
    grads_len: usize,
    scatters: &[ScatterPart<'_, F>],
    len: impl Fn(&F) -> usize,
) -> Result<()> {
    for (i, g) in gathers.iter().enumerate() {
        if g.half && g.from.len() % 2 != 0 {
            return Err(format!(
                "gather {i}: a bf16 gather of {} elements per rank (it packs two to an f32 \
                 element: an even number is needed)",
                g.from.len()
            ));
        }
        if g.from.start > g.from.end
            || g.from.end > master_len
            || g.at + g.into_len(n) > len(g.into)
        {
            return Err(format!(
                "gather {i}: elements {:?} of a master shard of {master_len}, {n} ranks' worth \
                 into {} elements from {}",
                g.from,
                len(g.into),
                g.at
            ));
        }
    }
    for (i, s) in scatters.iter().enumerate() {
        if s.to.start > s.to.end || s.to.end > grads_len || len(s.grads) != n * s.to.len() {
            return Err(format!(
                "reduce-scatter {i}: {} gradients over {n} ranks into elements {:?} of a shard \
                 of {grads_len}",
                len(s.grads),
                s.to
            ));
        }
    }
    Ok(())
}

/// What `n` ranks send for a reduce-scatter or an all-gather of `bytes`
/// by ring (`(n-1)/n`).
pub(crate) fn ring_half_wire_bytes(bytes: u64, n: usize) -> u64 {
    if n <= 1 {
        return 0;
    }
    bytes * (n as u64 - 1) / n as u64
}

/// Rank `rank`'s block of `range` split into `n` equal blocks, or why
/// not (the range does not split evenly).
pub fn block_of(range: &Range<usize>, rank: usize, n: usize) -> Result<Range<usize>> {
    if n == 0 || range.len() % n != 0 {
        return Err(format!(
            "elements {range:?} ({}) do not split into {n} equal blocks, one per rank (shard \
             groups need a layout padded to a multiple of their size)",
            range.len()
        ));
    }
    let k = range.len() / n;
    Ok(range.start + rank * k..range.start + (rank + 1) * k)
}

/// `ranges` of `flat` as disjoint writable slices, in increasing order of
/// their starts (with those starts), or why not.
pub(crate) fn disjoint_mut<'a, T>(
    flat: &'a mut [T],
    ranges: &[Range<usize>],
) -> Result<Vec<(usize, &'a mut [T])>> {
    let mut sorted: Vec<&Range<usize>> = ranges.iter().collect();
    sorted.sort_by_key(|r| r.start);
    let len = flat.len();
    let mut rest = flat;
    let mut cut = 0;
    let mut out = Vec::with_capacity(sorted.len());
    for r in sorted {
        if r.start < cut || r.start > r.end || r.end > len {
            return Err(format!(
                "ranges {ranges:?} overlap or leave the buffer of {len} elements"
            ));
        }
        let (_, tail) = std::mem::take(&mut rest).split_at_mut(r.start - cut);
        let (slot, tail) = tail.split_at_mut(r.len());
        rest = tail;
        cut = r.end;
        out.push((r.start, slot));
    }
    Ok(out)
}

/// What `n` ranks send for an all-reduce of `bytes` by ring (`2(n-1)/n`).
pub(crate) fn ring_wire_bytes(bytes: u64, n: usize) -> u64 {
    if n <= 1 {
        return 0;
    }
    bytes * 2 * (n as u64 - 1) / n as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_split_evenly_or_say_why() {
        assert_eq!(block_of(&(100..220), 1, 4).unwrap(), 130..160);
        let e = block_of(&(0..10), 0, 4).unwrap_err();
        assert!(
            e.contains("do not split into 4") && e.contains("padded"),
            "{e}"
        );
    }

    #[test]
    fn disjoint_slices_come_sorted_and_overlaps_are_refused() {
        let mut v: Vec<u32> = (0..10).collect();
        let got = disjoint_mut(&mut v, &[6..9, 1..3]).unwrap();
        let starts: Vec<usize> = got.iter().map(|(s, _)| *s).collect();
        assert_eq!(starts, vec![1, 6]);
        assert_eq!(got[0].1, &[1, 2]);
        assert_eq!(got[1].1, &[6, 7, 8]);
        assert!(disjoint_mut(&mut v, &[1..5, 4..6]).is_err());
        assert!(disjoint_mut(&mut v, std::slice::from_ref(&(8..11))).is_err());
    }
}
