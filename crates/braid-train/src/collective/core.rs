//! The [`Collective`] trait and the types of its calls: the buckets a
//! reduction session hands out ([`Bucket`], [`End`]), its launcher and
//! driver ([`Launch`], [`Drive`]), and a parameter-sharded exchange's
//! parts ([`GatherPart`], [`ScatterPart`], [`During`]).

use super::grad_comm::GradComm;
use crate::engine::Matrix;
use crate::space::{Space, Window};
use crate::strategy::CommStep;
use crate::Result;
use braid_comm::Communicator;
use std::ops::Range;

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

/// Collectives over one memory space; see the [module docs](crate::collective).
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
    /// A reduction session over `grads` (see the [module docs](crate::collective)):
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
    /// this rank's block of the sum
    /// ([`block_of`](super::exchange::block_of)) is kept, in place (the
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
