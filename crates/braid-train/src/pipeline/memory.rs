//! A pipeline rank's GPU memory, counted from what its stages allocate:
//! the model states of its part of the model, and the bf16 engine's
//! activations (`braid_model::footprint::gpu_mixed_stage_bytes`) as its
//! schedule keeps micro-batches in flight. `braid train --pp`'s pre-flight
//! refuses a rank by it, and `braid plan` counts a pipeline's layouts by
//! it.

use crate::schedule::Schedule;
use braid_model::cuda::model_mixed::MixedOptions;
use braid_model::{GptConfig, Stage};

/// A pipeline rank's model states on its GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StageStates {
    pub bytes: u128,
    /// The most bytes one parameter takes (f32 weights, gradients,
    /// AdamW's two moments, the strategy's reduced gradients, the bf16
    /// copy).
    pub per_parameter: usize,
}

/// The model states of a rank's stages, of `(len, bf16_len)` elements
/// (`Layout::len`, `Layout::bf16_len`): f32 weights, gradients and
/// AdamW's two moments, with `reduced` the data parallelism's reduced
/// gradients, and with `bf16_copy` the bf16 weights of all but a first
/// stage's embeddings.
pub fn stage_states(
    (len, bf16_len): (usize, usize),
    bf16_copy: bool,
    reduced: bool,
) -> StageStates {
    let bf16 = match bf16_copy {
        true => bf16_len,
        false => 0,
    };
    let per = 4 + 4 + 8 + if reduced { 4 } else { 0 };
    StageStates {
        bytes: (len * per + bf16 * 2) as u128,
        per_parameter: per + if bf16 > 0 { 2 } else { 0 },
    }
}

/// A pipeline rank's activation memory in the bf16 engine (estimated
/// from the sizes its buffers are made with,
/// `braid_model::footprint::gpu_mixed_stage_bytes`).
#[derive(Debug, Clone, Copy)]
pub struct StageActivations {
    /// The most its stages' micro-batches in flight hold at once, by the
    /// schedule on paper.
    pub held: u128,
    /// The most micro-batches in flight at once, and one's bytes on the
    /// rank's first stage.
    pub in_flight: usize,
    pub per_micro_batch: u128,
    /// The scratch shared by the layers, the send buffers (two per link
    /// out) and the tied embeddings' sum (in 64 MB pieces).
    pub shared: u128,
}

impl StageActivations {
    pub fn total(&self) -> u128 {
        self.held + self.shared
    }
}

/// [`StageActivations`] of pipeline rank `rank` under schedule `s` over
/// stages `all`, micro-batches of `b × t`, with the model built from
/// `options` (`fused`: the fused attention runs; `tensor` ranks split each
/// layer).
#[allow(clippy::too_many_arguments)]
pub fn stage_activations(
    cfg: &GptConfig,
    s: &Schedule,
    all: &[Stage],
    rank: usize,
    (b, t): (usize, usize),
    options: &MixedOptions,
    fused: bool,
    tensor: usize,
) -> StageActivations {
    use braid_model::footprint::{gpu_mixed_stage_bytes, GpuRun, Sharding, StageRun, TensorSplit};
    let run = GpuRun {
        b,
        t,
        mixed: true,
        fused_attention: fused,
        deferred: 0,
        checkpointing: options.checkpointing,
        streamed_weights: options.streamed_weights,
        stored_score_grads: fused && options.stored_score_grads,
        kept_attention: match fused {
            true => options.kept_attention,
            false => 0,
        },
        recompute_attention_output: options.recompute_attention_output,
        sharding: Sharding::NONE,
        offload: false,
        saved_in_grads: false,
        half_gathers: false,
        split_embeddings: false,
        tensor: TensorSplit {
            ranks: tensor,
            sequence: options.sequence_parallel,
        },
    };
    let split = s.splits_backward();
    let bytes = |stage: usize| {
        let st = &all[stage];
        gpu_mixed_stage_bytes(
            cfg,
            &StageRun {
                run,
                layers: st.layers.len(),
                last: st.last,
                split,
            },
        )
    };
    let mine = s.stages_of(rank);
    let first = bytes(mine[0]);
    // One output stream per send buffer: two per link to another rank.
    let links = usize::from(mine.iter().any(|&st| !all[st].last))
        + usize::from(mine.iter().any(|&st| !all[st].first));
    let stream = 4 * (b * t * cfg.n_embd) as u128;
    let tied = match mine.iter().any(|&st| all[st].first || all[st].last) && all.len() > 1 {
        true => 64 << 20,
        false => 0,
    };
    // Each of its stages' bytes per micro-batch, counted once (a
    // schedule walks thousands of actions).
    let mut per_micro_batch = vec![0; all.len()];
    for &st in &mine {
        per_micro_batch[st] = bytes(st).per_micro_batch;
    }
    StageActivations {
        held: s.peak_held(rank, |st| per_micro_batch[st]),
        in_flight: s.in_flight(rank),
        per_micro_batch: first.per_micro_batch,
        shared: first.shared + 2 * links as u128 * stream + tied,
    }
}
