//! A layout's memory per GPU, as the planner counts it: the model states
//! (bf16 weights, f32 master weights, gradients and AdamW's two moments:
//! 18 bytes per parameter, split as the ZeRO stage says over the replicas
//! or a hybrid shard group; 6 on the GPU with the optimizer offloaded) of
//! the rank's share of the model, and the activations its schedule keeps
//! in flight
//! (Korthikanti et al.'s 34 s b h bytes per layer and micro-batch under
//! sequence parallelism, the fused attention's score-free form; 2 s b h
//! under checkpointing), with the last stage's f32 logits.
//!
//! This is the planner's own count, not yet the pre-flight's
//! (`braid_model::footprint`): it ranks layouts and refuses what cannot
//! fit by a margin.

use super::cost::{Layout, Workload};

/// Bytes per GPU of `l` for `w`: model states and activations.
pub fn per_gpu(w: &Workload, l: &Layout) -> (f64, f64) {
    let per_gpu = w.params() / (l.tp * l.pp) as f64;
    // Sharded over the replicas, or a hybrid shard group.
    let dp = l.shard_ranks() as f64;
    let (weights, master_and_moments, grads) = (2.0 * per_gpu, 12.0 * per_gpu, 4.0 * per_gpu);
    let states = match (l.zero, l.offload) {
        // Offloaded: the master weights and moments in host memory.
        (0, true) => weights + grads,
        (0, false) => weights + master_and_moments + grads,
        (1, _) => weights + grads + master_and_moments / dp,
        (2, _) => weights + (grads + master_and_moments) / dp,
        _ => (weights + grads + master_and_moments) / dp,
    };
    let (s, b, h) = (w.seq as f64, l.micro_batch as f64, w.width as f64);
    let t = l.tp as f64;
    let layers = (w.layers as f64 / l.pp as f64).ceil();
    let per_layer = match l.checkpointing {
        true => 2.0 * s * b * h / t,
        false => 34.0 * s * b * h / t,
    };
    // 1F1B's first stage holds up to `pp` micro-batches; without a
    // pipeline one is in flight at a time.
    let in_flight = l.pp.min(l.micro_batches).max(1) as f64;
    let recompute_one = if l.checkpointing {
        34.0 * s * b * h / t
    } else {
        0.0
    };
    let logits = 2.0 * 4.0 * s * b * w.vocab as f64 / t;
    let activations = in_flight * layers * per_layer + recompute_one + logits;
    (states, activations)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::testing::gpt;

    #[test]
    fn zero_stages_shard_what_they_say() {
        let w = gpt(48, 25, 1600, 32);
        let l = |zero| Layout {
            dp: 4,
            tp: 1,
            pp: 1,
            zero,
            micro_batch: 8,
            micro_batches: 1,
            schedule: None,
            checkpointing: false,
            overlap_data: true,
            shard_group: None,
            offload: false,
        };
        let s: Vec<f64> = (0..4).map(|z| per_gpu(&w, &l(z)).0 / w.params()).collect();
        assert_eq!(s, vec![18.0, 9.0, 6.0, 4.5]);
        let with = per_gpu(
            &w,
            &Layout {
                checkpointing: true,
                ..l(0)
            },
        )
        .1;
        assert!(with < per_gpu(&w, &l(0)).1 / 4.0);
    }
}
