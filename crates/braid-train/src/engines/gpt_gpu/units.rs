//! The unit-by-unit plumbing of a [`GpuGpt`]: the gradient windows and
//! parameter pieces a unit writes and reads, what the bf16 model reads in
//! f32, and the plan of backward units when layers defer their weight
//! gradients.
//!
//! [`GpuGpt`]: super::state::GpuGpt

use super::err::e;
use super::state::{BiasCarry, HalfBlocks, Offload, Step};
use crate::engine::{ParamUnits, Unit};
use crate::engines::units::gpt_units;
use crate::Result;
use braid_cuda::memory::{copy_async, zero_async};
use braid_cuda::{DeviceBuffer, DeviceWindow, Stream};
use braid_model::cuda::f32_params::{F32Params, Piece};
use braid_model::cuda::model_mixed::WeightGrads;
use half::bf16;

/// The gradient window of backward unit `unit` (`step`) writing the
/// blocks `writes` into `grads` (one buffer per block, in that order),
/// with, for the bf16 model, the [`BiasCarry`]: the bias gradient of the
/// layer below that this unit computes waits in `carry`, and the one that
/// waited for this unit's layer goes into its block.
#[allow(clippy::too_many_arguments)]
pub(super) fn block_window<'a>(
    layout: &braid_model::Layout,
    units: &ParamUnits,
    carry: &'a mut Option<BiasCarry>,
    s: &Stream,
    unit: usize,
    step: Step,
    writes: &[usize],
    grads: &'a mut [&mut DeviceBuffer<f32>],
) -> Result<DeviceWindow<'a, f32>> {
    let fcproj_b = |l: usize| {
        layout
            .get(&format!("h.{l}.mlp.c_proj.bias"))
            .map(|p| p.range())
            .ok_or_else(|| format!("layer {l} has no mlp.c_proj.bias"))
    };
    let mut below = None;
    if let Some(carry) = carry {
        if let (Step::Layer(l), Some(w)) = (step, carry.for_layer) {
            if w != l {
                return Err(format!(
                    "backward unit {unit}: layer {w}'s bias gradient is still waiting for its \
                     unit, but this unit is layer {l}'s"
                ));
            }
            // The layer above's pass computed this layer's bias gradient.
            let r = fcproj_b(l)?;
            let i = writes
                .iter()
                .position(|&b| units.blocks[b].contains(&r.start))
                .ok_or_else(|| format!("layer {l}'s unit writes no block holding its bias"))?;
            let at = r.start - units.blocks[writes[i]].start;
            copy_async(
                &mut grads[i].view_mut(at..at + r.len()),
                &carry.buf.view(0..r.len()),
                s,
            )
            .map_err(e)?;
            carry.for_layer = None;
        }
        let n = layout.config.n_layer;
        let next = match step {
            Step::Head => Some(n - 1),
            Step::Layer(l) if l > 0 => Some(l - 1),
            _ => None,
        };
        if let Some(b) = next {
            zero_async(&mut carry.buf, s).map_err(e)?;
            carry.for_layer = Some(b);
            below = Some((fcproj_b(b)?.start, carry.buf.view_mut(0..carry.buf.len())));
        }
    }
    let mut views: Vec<_> = grads
        .iter_mut()
        .zip(writes)
        .map(|(g, &b)| {
            let len = g.len();
            (units.blocks[b].start, g.view_mut(0..len))
        })
        .collect();
    views.extend(below);
    views.sort_by_key(|(start, _)| *start);
    DeviceWindow::of_pieces(views).map_err(e)
}

/// A bf16 view of the bf16 values a half block packs two to an element
/// of `packed`.
///
/// # Safety
/// The view must not outlive `packed`'s memory, nor be used after the
/// buffer's next writer (the caller orders them on the engine's stream).
pub(super) unsafe fn lent_bf16(packed: &DeviceBuffer<f32>) -> Result<DeviceBuffer<bf16>> {
    // SAFETY: the caller's contract; the view covers exactly the bytes of
    // `packed`, from byte 0.
    unsafe { DeviceBuffer::<bf16>::lent_from(packed, 0, 2 * packed.len()) }.map_err(e)
}

/// `units` with the head's backward unit reading only the final norm:
/// the bf16 engine streaming its weights casts the token embeddings for
/// the classifier in the head's forward pass and its backward pass reads
/// that cast. So under ZeRO-3 the f32 embeddings are freed after the
/// forward pass, and their memory takes their gradients.
pub(super) fn head_reads_cast_embeddings(mut units: ParamUnits) -> ParamUnits {
    let norm = units.blocks.len() - 1;
    units.backward_reads[0] = vec![norm];
    units
}

/// The f32 blocks `reads` a backward unit is given as `params`, as
/// pieces of the layout (none when the unit runs on a bf16 layer,
/// `half_layer`: it reads the packed f32 tensors then).
pub(super) fn unit_pieces<'a>(
    units: &ParamUnits,
    half_layer: Option<usize>,
    reads: &[usize],
    params: &[&'a DeviceBuffer<f32>],
) -> Vec<Piece<'a>> {
    match half_layer {
        Some(_) => Vec::new(),
        None => pieces(units, reads, params),
    }
}

/// Where a unit reads its f32 tensors: the packed copy of the bf16
/// blocks' (`half`) when it runs on a bf16 layer, else `pieces`.
pub(super) fn unit_f32_params<'a>(
    half: Option<&'a HalfBlocks>,
    half_layer: Option<usize>,
    pieces: &'a [Piece<'a>],
) -> F32Params<'a> {
    match (half_layer, half) {
        (Some(_), Some(h)) => F32Params::packed(&h.side, &h.map),
        _ => F32Params::blocks(pieces),
    }
}

/// Blocks `blocks` of `units`, given as `bufs` (in that order), as the
/// pieces of the flat buffer the models read.
pub(super) fn pieces<'a>(
    units: &ParamUnits,
    blocks: &[usize],
    bufs: &[&'a DeviceBuffer<f32>],
) -> Vec<Piece<'a>> {
    blocks
        .iter()
        .zip(bufs)
        .map(|(&b, buf)| Piece {
            start: units.blocks[b].start,
            buf,
        })
        .collect()
}

/// What the bf16 model reads in f32: the whole buffer `p`, or under an
/// offloaded optimizer the side tensors packed in it.
pub(super) fn f32_params<'a>(
    p: &'a DeviceBuffer<f32>,
    offload: &'a Option<Offload>,
) -> F32Params<'a> {
    match offload {
        Some(Offload::Bf16(_, map)) => F32Params::packed(p, map),
        _ => F32Params::whole(p),
    }
}

/// The backward units of a GPT model whose first `deferred` layers defer
/// their weight gradients: the head, the other layers from the last, the
/// deferred layers' input gradients, the embeddings, the deferred layers'
/// weight gradients. Each unit finishes a range at one end of what is
/// still being written (the embeddings come first in the buffer, the
/// deferred layers right after them). Layer 0, the very last, finishes in
/// three parts — its MLP (the back of its block), its qkv and norms (the
/// front), its attention projection (the middle) — so that the reduction
/// nothing overlaps any more is only that projection's (`width²`).
pub(super) fn plan(layout: &braid_model::Layout, deferred: usize) -> Vec<(Unit, Step)> {
    use braid_model::Block;
    let n = layout.config.n_layer;
    let base = gpt_units(layout);
    // gpt_units: head, layers n-1 .. 0, embedding.
    let mut out = vec![(base[0].clone(), Step::Head)];
    for l in (deferred..n).rev() {
        out.push((base[n - l].clone(), Step::Layer(l)));
    }
    for l in (0..deferred).rev() {
        out.push((
            Unit {
                name: format!("layer {l} (input gradients)"),
                finalizes: 0..0,
            },
            Step::LayerInput(l),
        ));
    }
    out.push((base[n + 1].clone(), Step::Embedding));
    for l in (1..deferred).rev() {
        out.push((
            Unit {
                name: format!("layer {l} (weight gradients)"),
                finalizes: layout.block_range(Block::Layer(l)),
            },
            Step::LayerWeights(l),
        ));
    }
    if deferred > 0 {
        let block = layout.block_range(Block::Layer(0));
        let at = |name: &str| {
            layout
                .get(&format!("h.0.{name}"))
                .expect("layer 0 parameter")
                .offset
        };
        let (proj, ln2) = (at("attn.c_proj.weight"), at("ln_2.weight"));
        use WeightGrads::*;
        for (name, finalizes, which) in [
            ("MLP", ln2..block.end, &[FcProj, Fc][..]),
            ("qkv", block.start..proj, &[Qkv][..]),
            ("attention projection", proj..ln2, &[Proj][..]),
        ] {
            out.push((
                Unit {
                    name: format!("layer 0 (weight gradients: {name})"),
                    finalizes,
                },
                Step::LayerWeightsOf(0, which),
            ));
        }
    }
    out
}
