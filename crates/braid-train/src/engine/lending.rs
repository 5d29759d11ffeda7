//! [`LendsMemory`]: the activations an engine's forward pass saves for
//! its backward pass, described ([`SavedBuffer`]) and placed in memory
//! that another part lends while it is idle — one process's gradient
//! buffer written unit by unit ([`crate::lend`]), or ZeRO-3's gradient
//! shard — and given their own memory back.

use super::core::{Engine, Flat};
use crate::Result;
use std::ops::Range;

/// A buffer an engine's forward pass saves for its backward pass
/// ([`LendsMemory::saved_buffers`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SavedBuffer {
    /// Its size.
    pub bytes: usize,
    /// The backward unit that reads it for the last time.
    pub last_read: usize,
    /// The first forward unit that writes it (no unit before it does).
    pub first_write: usize,
}

/// An engine whose saved activations can live in lent memory.
pub trait LendsMemory: Engine {
    /// Has the whole gradient buffer written unit by unit from the next
    /// step on: [`zero_grads`](Engine::zero_grads) then clears nothing,
    /// and each backward unit of a step's first micro-batch first clears
    /// what it adds into of the runs it writes before any other unit does
    /// — so that a run's memory holds nothing the step needs from the
    /// step's start until that unit. The saved buffers
    /// ([`saved_buffers`](Self::saved_buffers)) give their memory back
    /// until [`place_saved`](Self::place_saved) or the next forward pass
    /// makes them. Returns those runs (flat elements) for each backward
    /// unit, or `None` where the engine cannot (it goes on clearing the
    /// whole buffer in `zero_grads`).
    fn grads_by_unit(&mut self) -> Result<Option<Vec<Vec<Range<usize>>>>>;

    /// The buffers a forward pass in units with `grad` saves for the
    /// backward pass, each with the backward unit that reads it last: a
    /// parameter-sharded strategy, or one process writing its gradients
    /// unit by unit ([`grads_by_unit`](Self::grads_by_unit)), may lend
    /// them memory that is idle while they live
    /// ([`place_saved`](Self::place_saved)). None where the engine saves
    /// nothing it can place elsewhere.
    fn saved_buffers(&mut self) -> Result<Vec<SavedBuffer>>;

    /// Moves saved buffer `i` (of [`saved_buffers`](Self::saved_buffers))
    /// into `memory` from byte `at[i]` (`None`: it keeps its own memory)
    /// and returns the bytes moved.
    ///
    /// # Safety
    /// `memory` must outlive the engine's use of it: the caller calls
    /// [`own_saved`](Self::own_saved) (or
    /// [`drop_saved`](Self::drop_saved)) before it drops or replaces
    /// `memory`, and writes the lent bytes only after the backward unit
    /// that reads them last, ordered after the engine's work.
    unsafe fn place_saved(&mut self, memory: &Flat<Self>, at: &[Option<usize>]) -> Result<usize>;

    /// Gives back the memory of the saved buffers now (they hold nothing
    /// between steps): [`place_saved`](Self::place_saved) lends them
    /// memory without making their own first, and the next forward pass
    /// makes what was not lent — so that the lender's memory can be
    /// allocated in their room.
    fn drop_saved(&mut self) -> Result<()>;

    /// Stops using memory lent by [`place_saved`](Self::place_saved): the
    /// saved buffers get memory of their own again (by the next forward
    /// pass at the latest).
    fn own_saved(&mut self) -> Result<()>;
}
