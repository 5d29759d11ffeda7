//! One process's gradient buffer lent to the activations its forward
//! pass saves for the backward pass.
//!
//! With one micro-batch per step and the gradients written unit by unit
//! ([`LendsMemory::grads_by_unit`]), each run of the whole gradient buffer holds
//! nothing the step needs from the step's start until the backward unit
//! that writes it first — and the activations a layer saves live from its
//! forward pass until its own backward unit, which runs before the units
//! of the layers below it. The layers below therefore lend their
//! gradients' memory to the layers above ([`braid_model::placement`]):
//! at GPT-2 2.65B about half the activations live there, 9 GB less at
//! the peak. The loop ([`crate::trainer`]) lends when its options and the
//! strategy allow ([`crate::Strategy::lends_whole_grads`]) and takes the
//! memory back before the buffer goes.

use crate::engine::{Flat, LendsMemory};
use crate::Result;
use braid_model::placement::{self, Region, Want};
use std::ops::Range;

/// Places `engine`'s saved buffers in `grads`, the whole gradient buffer
/// the engine writes unit by unit (`first[u]`: the runs unit `u` writes
/// first, from [`LendsMemory::grads_by_unit`]); returns the bytes lent.
///
/// # Safety
/// `grads` must stay allocated until the caller has called
/// [`LendsMemory::own_saved`], and nothing but the engine's backward units may
/// write it meanwhile before they do (a strategy reducing gradients that
/// are final, or the optimizer reading them, come after).
pub unsafe fn saved_to_grads<E: LendsMemory>(
    engine: &mut E,
    grads: &Flat<E>,
    first: &[Vec<Range<usize>>],
) -> Result<usize> {
    let regions = placement::regions_before_first_writes(first);
    let at = offsets_in(engine, &regions)?;
    // SAFETY: the caller keeps `grads` until `own_saved` and lets only
    // the backward units write it before they are through. Each buffer
    // lies in runs (one, or several that follow each other) that no unit
    // writes before the one after the buffer's last reader, in the order
    // of the engine's stream; the next forward pass writes the buffers
    // after the update has read the gradients, on that stream too.
    unsafe { engine.place_saved(grads, &at) }
        .map_err(|e| format!("saved activations in the gradient buffer: {e}"))
}

/// Byte offsets in the memory of `regions` for each of `engine`'s saved
/// buffers ([`LendsMemory::saved_buffers`], in order; `None`: it keeps memory
/// of its own), by [`placement::place`].
pub(crate) fn offsets_in<E: LendsMemory>(
    engine: &mut E,
    regions: &[Region],
) -> Result<Vec<Option<usize>>> {
    let wants: Vec<Want> = engine
        .saved_buffers()?
        .iter()
        .map(|b| Want {
            bytes: b.bytes as u64,
            last_read: b.last_read,
        })
        .collect();
    Ok(placement::place(&wants, regions)
        .into_iter()
        .map(|a| a.map(|a| a as usize))
        .collect())
}
