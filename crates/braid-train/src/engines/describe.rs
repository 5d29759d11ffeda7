//! What a GPT engine says about itself: what data-parallel ranks must
//! agree on ([`gpt_describe`]) and which parameters are matrices
//! ([`gpt_matrices`]).

use braid_model::{GptConfig, Layout};

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
