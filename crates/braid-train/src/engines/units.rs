//! The GPT engines' units: the backward pass's ([`gpt_units`]), the
//! parameter blocks and which units of each pass read and write them
//! ([`gpt_param_units`]), and the units' names in traces.

use crate::engine::{ParamUnits, Unit};
use braid_model::{Block, Layout};

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
