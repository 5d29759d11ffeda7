//! A pipeline rank's GPU memory, counted from what its stages allocate:
//! the model states of its part of the model, and the bf16 engine's
//! activations (`braid_model::footprint::gpu_mixed_stage_bytes`) as its
//! schedule keeps micro-batches in flight. `braid train --pp`'s pre-flight
//! refuses a rank by it, and `braid plan` counts a pipeline's layouts by
//! it.

use crate::schedule::Schedule;
use braid_model::cuda::model_mixed::MixedOptions;
use braid_model::footprint::Sharding;
use braid_model::{GptConfig, Stage};

/// A pipeline rank's model states on its GPU.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StageStates {
    pub bytes: u128,
    /// Bytes a parameter takes on average (f32 weights and gradients,
    /// AdamW's moments or their shard, the data parallelism's reduced
    /// gradients, the bf16 copy).
    pub per_parameter: f64,
}

/// The model states of a rank's stages, of `(len, bf16_len)` elements
/// (`Layout::len`, `Layout::bf16_len`), over the data dimension `data`:
/// f32 weights and gradients; AdamW's two moments, under ZeRO-1 the
/// rank's shard of them (`8Ψ/N`: `ShardedOptimizer::shard_optimizer`
/// makes them for the shard alone, and the reduce-scatter runs in place);
/// without ZeRO over several replicas, data parallelism's reduced
/// gradients; and with `bf16_copy` the bf16 weights of all but a first
/// stage's embeddings.
pub fn stage_states(
    (len, bf16_len): (usize, usize),
    bf16_copy: bool,
    data: Sharding,
) -> StageStates {
    let len = len as u128;
    let bf16 = match bf16_copy {
        true => bf16_len as u128,
        false => 0,
    };
    let moments = match data.stage {
        0 => 8 * len,
        _ => 8 * len.div_ceil(data.ranks.max(1) as u128),
    };
    let reduced = match data.stage == 0 && data.ranks > 1 {
        true => 4 * len,
        false => 0,
    };
    let bytes = 8 * len + moments + reduced + 2 * bf16;
    StageStates {
        bytes,
        per_parameter: bytes as f64 / len.max(1) as f64,
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
    rows: (usize, usize),
    options: &MixedOptions,
    fused: bool,
    tensor: usize,
) -> StageActivations {
    let split = s.splits_backward();
    rank_activations(cfg, s, all, rank, rows, options, (fused, tensor, split))
}

/// [`stage_activations`] of every rank of `s`, in rank order (whether the
/// schedule splits its backward passes looked up once: a plan asks for
/// thousands of ranks).
pub fn pipeline_activations(
    cfg: &GptConfig,
    s: &Schedule,
    all: &[Stage],
    rows: (usize, usize),
    options: &MixedOptions,
    (fused, tensor): (bool, usize),
) -> Vec<StageActivations> {
    let split = s.splits_backward();
    (0..s.ranks)
        .map(|rank| rank_activations(cfg, s, all, rank, rows, options, (fused, tensor, split)))
        .collect()
}

/// [`stage_activations`], with whether `s` splits its backward passes.
fn rank_activations(
    cfg: &GptConfig,
    s: &Schedule,
    all: &[Stage],
    rank: usize,
    (b, t): (usize, usize),
    options: &MixedOptions,
    (fused, tensor, split): (bool, usize, bool),
) -> StageActivations {
    use braid_model::footprint::{gpu_mixed_stage_bytes, GpuRun, StageRun, TensorSplit};
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes a parameter: f32 weights and gradients and AdamW's moments
    /// (16), the reduced gradients of data parallelism (+4), ZeRO-1's
    /// shard of the moments over 4 replicas (8 / 4), the bf16 copy (+2).
    #[test]
    fn a_ranks_states_follow_the_data_dimension() {
        let per = |bf16, stage, ranks| {
            let s = stage_states((1000, 800), bf16, Sharding { stage, ranks });
            (s.bytes as f64 / 1000.0, s.per_parameter)
        };
        assert_eq!(per(false, 0, 1), (16.0, 16.0));
        assert_eq!(per(false, 0, 4), (20.0, 20.0));
        assert_eq!(per(false, 1, 4), (10.0, 10.0));
        assert_eq!(per(true, 1, 4), (11.6, 11.6));
    }
}
