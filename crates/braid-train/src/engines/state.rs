//! The GPT engines' checkpointed state: their named tensors
//! ([`gpt_tensors`], and a pipeline rank's, [`stage_tensors`]), and
//! optimizer moments copied out ([`copy_at`]) and checked when loaded
//! back ([`moment`]).

use braid_model::{Block, Layout};

/// The named tensors of a GPT layout (Hugging Face's names and shapes):
/// what the GPT engines checkpoint, and what `braid ckpt` reads back.
pub fn gpt_tensors(layout: &Layout) -> Vec<crate::NamedTensor> {
    layout
        .params
        .iter()
        .map(|p| crate::NamedTensor {
            name: p.name.clone(),
            shape: p.full_shape().to_vec(),
            range: p.range(),
            place: p.place.clone(),
            stored: p.place.is_some() || layout.shard.rank == 0,
        })
        .collect()
}

/// A pipeline rank's tensors in the whole model's order: those of its
/// stages (`layout`, cut by `Layout::pipeline_stages`) where they are, the
/// rest [`NamedTensor::elsewhere`](crate::NamedTensor::elsewhere); with
/// `second_copy` (the last stage's copy of the tied token embedding,
/// where the first stage is another rank's) that copy is not stored.
pub(crate) fn stage_tensors(layout: &Layout, second_copy: bool) -> Vec<crate::NamedTensor> {
    let held = gpt_tensors(layout);
    let er = layout.block_range(Block::Embedding);
    Layout::new(&layout.config)
        .params
        .iter()
        .map(|p| match held.iter().find(|t| t.name == p.name) {
            Some(t) => crate::NamedTensor {
                stored: t.stored && !(second_copy && er.contains(&t.range.start)),
                ..t.clone()
            },
            None => crate::NamedTensor::elsewhere(p.name.clone(), p.full_shape().to_vec()),
        })
        .collect()
}

/// Copies the elements `at` (state indices) of `state` into `out`, one
/// range after another; a range outside `state` is an error.
pub(crate) fn copy_at(
    state: &[f32],
    at: &[std::ops::Range<usize>],
    out: &mut [f32],
) -> crate::Result<()> {
    let total: usize = at.iter().map(|r| r.len()).sum();
    if total != out.len() {
        return Err(format!(
            "{} elements asked into a buffer of {}",
            total,
            out.len()
        ));
    }
    let mut o = 0;
    for r in at {
        let from = state
            .get(r.clone())
            .ok_or_else(|| format!("elements {r:?} asked of {}", state.len()))?;
        out[o..o + r.len()].copy_from_slice(from);
        o += r.len();
    }
    Ok(())
}

/// The values of moment `name` in `state`, checked to be of `kind` and
/// `len` elements.
pub(crate) fn moment<'s>(
    state: &'s crate::OptimizerState,
    kind: &str,
    name: &str,
    len: usize,
) -> crate::Result<&'s [f32]> {
    if state.kind != kind {
        return Err(format!(
            "the checkpoint's optimizer is {}, this run's {kind} (resume with the same --optimizer)",
            state.kind
        ));
    }
    let (_, m) = state
        .moments
        .iter()
        .find(|(n, _)| n == name)
        .ok_or_else(|| format!("the checkpoint's {kind} state has no {name}"))?;
    if m.len() != len {
        return Err(format!(
            "the checkpoint's {name} holds {} elements, this rank's optimizer {len}",
            m.len()
        ));
    }
    Ok(m)
}
