//! The GPT engines of `braid-model` behind the [`Engine`](crate::Engine)
//! trait: [`CpuGpt`] (f32, this machine's cores) and [`GpuGpt`] (one GPU,
//! f32 or bf16 mixed precision, optionally with its optimizer offloaded to
//! host memory: [`offload`]), with the batch type they share; and
//! [`CpuStage`] and [`GpuStage`], a pipeline rank's stages of the CPU
//! model and of the bf16 GPU model.

mod gpt_cpu;
mod gpt_cpu_stage;
mod gpt_gpu;
mod gpt_gpu_stage;
pub mod offload;

pub use gpt_cpu::{CpuGpt, CpuOptimizer};
pub use gpt_cpu_stage::CpuStage;
pub use gpt_gpu::{GpuGpt, Precision};
pub use gpt_gpu_stage::GpuStage;

use crate::engine::{ParamUnits, Unit};
use braid_model::{Block, GptConfig, Layout};

pub use braid_data::loader::TokenBatch;

/// The GPT engines' backward units: the head (final norm final), each
/// layer from the last (its block final), then the embeddings.
pub(crate) fn gpt_units(layout: &Layout) -> Vec<Unit> {
    let mut units = vec![Unit {
        name: "head".into(),
        finalizes: layout.block_range(Block::FinalNorm),
    }];
    for l in (0..layout.config.n_layer).rev() {
        units.push(Unit {
            name: format!("layer {l}"),
            finalizes: layout.block_range(Block::Layer(l)),
        });
    }
    units.push(Unit {
        name: "embedding".into(),
        finalizes: layout.block_range(Block::Embedding),
    });
    units
}

/// The GPT engines' parameter units (FSDP's transformer wrap policy):
/// the blocks are the layout's — the embeddings (block 0), each layer
/// (block `1 + l`), the final norm (block `L + 1`). Forward: the
/// embeddings, each layer, then the head (the final norm, and the token
/// embedding as the LM head). Backward, in [`gpt_units`]' order: the head
/// (reading and writing the final norm and the embeddings), each layer
/// from the last, then the embeddings (writing their gradients, reading
/// no parameters).
pub(crate) fn gpt_param_units(layout: &Layout) -> ParamUnits {
    let n = layout.config.n_layer;
    let (emb, norm) = (0, n + 1);
    let mut forward = vec![vec![emb]];
    forward.extend((0..n).map(|l| vec![1 + l]));
    forward.push(vec![norm, emb]);
    let mut reads = vec![vec![norm, emb]];
    reads.extend((0..n).rev().map(|l| vec![1 + l]));
    let mut writes = reads.clone();
    reads.push(Vec::new());
    writes.push(vec![emb]);
    ParamUnits {
        blocks: layout.blocks.iter().map(|(_, r)| r.clone()).collect(),
        forward,
        backward_reads: reads,
        backward_writes: writes,
    }
}

/// What data-parallel ranks must agree on for a GPT engine.
pub(crate) fn gpt_describe(cfg: &GptConfig, b: usize, t: usize, how: &str) -> String {
    format!(
        "GPT L{}-H{}-C{}-V{}-T{} ({} parameters), batch {b} x {t} per rank, {how}",
        cfg.n_layer,
        cfg.n_head,
        cfg.n_embd,
        cfg.vocab_size,
        cfg.context,
        cfg.num_params()
    )
}

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

/// The two-dimensional parameters of a GPT layout (what PowerSGD
/// compresses).
pub(crate) fn gpt_matrices(layout: &Layout) -> Vec<crate::Matrix> {
    layout
        .params
        .iter()
        .filter(|p| p.shape.len() == 2)
        .map(|p| crate::Matrix {
            offset: p.offset,
            rows: p.shape[0],
            cols: p.shape[1],
        })
        .collect()
}

/// The name of forward unit `unit` of a GPT with `n_layer` layers (in
/// traces): the embedding, each layer, the head.
pub fn forward_unit_name(unit: usize, n_layer: usize) -> String {
    match unit {
        0 => "forward embedding".to_string(),
        u if u <= n_layer => format!("forward layer {}", u - 1),
        _ => "forward head".to_string(),
    }
}

/// The name of backward unit `unit` (units run from the head down).
pub fn backward_unit_name(unit: usize, n_layer: usize) -> String {
    match unit {
        0 => "backward head".to_string(),
        u if u <= n_layer => format!("backward layer {}", n_layer - u),
        _ => "backward embedding".to_string(),
    }
}
