//! What the planner's tests build their questions from: a GPT-2-shaped
//! workload and a plain layout, varied by struct update where a test
//! needs more.

use super::cost::{Layout, Workload};

/// A GPT-2-shaped workload (vocabulary 50,304, 1,024 tokens, the fused
/// attention) of `layers` × `heads` × `width` over `global_batch`.
pub fn gpt(layers: usize, heads: usize, width: usize, global_batch: usize) -> Workload {
    Workload {
        layers,
        width,
        heads,
        vocab: 50304,
        seq: 1024,
        global_batch,
        fused_attention: true,
    }
}

/// `dp` replicas × `tp` × `pp`, `m` micro-batches of `micro`: no ZeRO,
/// schedule, checkpointing, hybrid sharding or offload; the data
/// dimension's reduction under the backward pass.
pub fn plain(dp: usize, tp: usize, pp: usize, micro: usize, m: usize) -> Layout {
    Layout {
        dp,
        tp,
        pp,
        zero: 0,
        micro_batch: micro,
        micro_batches: m,
        schedule: None,
        checkpointing: false,
        overlap_data: true,
        sequence_parallel: Layout::braid_sequence_parallel(tp, pp),
        shard_group: None,
        offload: false,
    }
}
