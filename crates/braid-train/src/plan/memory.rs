//! A layout's memory per GPU. Without a pipeline it is the pre-flight's
//! own count — `braid_model::footprint::gpu_training`, the description
//! `braid train` refuses a run by — of the bf16 engine in the form the
//! pre-flight tries first ([`GpuRun::fastest`]), or, where that does not
//! fit, its leanest ([`GpuRun::leanest`]): what `braid train` would run.
//! A pipeline's stages keep the planner's own count: the model states
//! (bf16 weights, f32 master weights, gradients and AdamW's two moments:
//! 18 bytes per parameter, split as the ZeRO stage says over the replicas
//! or a hybrid shard group; 6 on the GPU with the optimizer offloaded) of
//! the rank's share of the model, and the activations its schedule keeps
//! in flight (Korthikanti et al.'s 34 s b h bytes per layer and
//! micro-batch under sequence parallelism, the fused attention's
//! score-free form; 2 s b h under checkpointing), with the last stage's
//! f32 logits.

use super::cost::{Layout, Workload};
use braid_model::footprint::{gpu_training, GpuRun, Sharding, TensorSplit};
use braid_model::GptConfig;

/// Bytes per GPU of `l` for `w` (model states, activations), within
/// `budget` bytes where a leaner form of the run fits it.
pub fn per_gpu(w: &Workload, l: &Layout, budget: f64) -> (f64, f64) {
    if l.pp > 1 {
        return planners_count(w, l);
    }
    let cfg = GptConfig {
        n_layer: w.layers,
        n_head: w.heads,
        n_embd: w.width,
        vocab_size: w.vocab,
        context: w.seq,
    };
    let run = GpuRun::fastest(
        &cfg,
        l.micro_batch,
        w.seq,
        l.micro_batches,
        Sharding {
            stage: l.zero,
            ranks: l.shard_ranks(),
        },
        l.offload,
        l.checkpointing,
        TensorSplit {
            ranks: l.tp,
            sequence: l.tp > 1,
        },
        l.dp,
    );
    let mut f = gpu_training(&cfg, &run);
    if f.total() as f64 > budget {
        f = gpu_training(&cfg, &run.leanest());
    }
    let acts = f.part("activations");
    ((f.total() - acts) as f64, acts as f64)
}

/// The planner's own count of a pipeline stage's bytes (model states,
/// activations).
fn planners_count(w: &Workload, l: &Layout) -> (f64, f64) {
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

    fn layout(zero: u8) -> Layout {
        Layout {
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
        }
    }

    /// The pre-flight's count, stage by stage: 18 bytes a parameter
    /// unsharded (bf16 weights, f32 weights, gradients, two moments);
    /// ZeRO-1 shards the moments alone (the f32 weights stay whole in
    /// braid's engine), ZeRO-2 the gradients too, ZeRO-3 everything.
    #[test]
    fn zero_stages_shard_what_braids_engine_shards() {
        let w = gpt(48, 25, 1600, 32);
        let big = f64::INFINITY;
        let s: Vec<f64> = (0..4)
            .map(|z| per_gpu(&w, &layout(z), big).0 / w.params())
            .collect();
        assert!((s[0] - 18.0).abs() < 0.05, "{s:?}");
        assert!((s[1] - 12.0).abs() < 0.05, "{s:?}");
        assert!(s[2] < s[1] && s[3] < s[2] && s[3] < 6.0, "{s:?}");
        let with = per_gpu(
            &w,
            &Layout {
                checkpointing: true,
                ..layout(0)
            },
            big,
        )
        .1;
        let without = per_gpu(&w, &layout(0), big).1;
        // The fastest form keeps every layer's attention state; the
        // leanest (what a short budget gets) saves each layer's input alone.
        let lean = per_gpu(
            &w,
            &Layout {
                checkpointing: true,
                ..layout(0)
            },
            1.0,
        )
        .1;
        assert!(lean < with && with < without, "{lean}, {with}, {without}");
        assert!(lean < without / 4.0, "{lean} against {without}");
    }

    /// Where the pre-flight's first form does not fit the budget, the
    /// count is its leanest form's, as `braid train` would run it.
    #[test]
    fn a_run_short_of_memory_is_counted_in_its_leanest_form() {
        let w = gpt(48, 25, 1600, 8);
        let l = Layout {
            dp: 1,
            checkpointing: true,
            ..layout(0)
        };
        let (s, a) = per_gpu(&w, &l, f64::INFINITY);
        let (ls, la) = per_gpu(&w, &l, s + a - 1.0);
        assert!(ls + la < s + a, "{ls} + {la} against {s} + {a}");
    }
}
