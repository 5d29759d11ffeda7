//! A layout's memory per GPU. Without a pipeline it is the pre-flight's
//! own count — `braid_model::footprint::gpu_training`, the description
//! `braid train` refuses a run by — of the bf16 engine in the form the
//! pre-flight tries first ([`GpuRun::fastest`]), or, where that does not
//! fit, its leanest ([`GpuRun::leanest`]): what `braid train` would run.
//! A pipeline is counted as `braid train --pp`'s pre-flight counts each
//! of its ranks (`crate::pipeline::memory`: the rank's share of the model
//! states, and the bf16 engine's activations as the schedule keeps
//! micro-batches in flight), in the first of the pre-flight's forms that
//! fits every rank (the bf16 copy whole, then cast layer by layer; score
//! gradients stored, then recomputed); its bytes per GPU are its fullest
//! rank's. A pipeline that cannot be cut (more stages than layers, a
//! schedule refused) keeps the planner's own count (the model states,
//! 18 bytes per parameter split as the ZeRO stage says, and Korthikanti
//! et al.'s activations per layer and micro-batch in flight): the
//! planner refuses it for that reason anyway.

use super::cost::{Layout, Workload};
use crate::collective::{copy_engine_landing_bytes, copy_engines_by_default};
use crate::pipeline::assign::{assign, head_cost};
use crate::pipeline::memory::{pipeline_activations, stage_states};
use crate::schedule::Schedule;
use braid_model::cuda::model_mixed::MixedOptions;
use braid_model::footprint::{gpu_training, share_params, GpuRun, Sharding, TensorSplit};
use braid_model::layout::TensorShard;
use braid_model::GptConfig;

/// Bytes per GPU of `l` for `w` (model states, activations), within
/// `budget` bytes where a leaner form of the run fits it; `one_host`:
/// the layout's GPUs are one node's (plain data parallelism there sums
/// through the copy engines, whose landing buffer counts as a state);
/// `built`: a pipeline's schedule, where already built.
pub fn per_gpu(
    w: &Workload,
    l: &Layout,
    budget: f64,
    one_host: bool,
    built: Option<&Schedule>,
) -> (f64, f64) {
    let cfg = w.config();
    if l.pp > 1 {
        return pipeline_count(w, &cfg, l, budget, built).unwrap_or_else(|| planners_count(w, l));
    }
    let tensor = TensorSplit {
        ranks: l.tp,
        sequence: l.tp > 1,
    };
    let sharding = Sharding {
        stage: l.zero,
        ranks: l.shard_ranks(),
    };
    let (b, t, m) = (l.micro_batch, w.seq, l.micro_batches);
    let (offload, ckpt) = (l.offload, l.checkpointing);
    let fastest = GpuRun::fastest(&cfg, b, t, m, sharding, offload, ckpt, tensor, l.dp);
    // The batched attention (a head size without fused kernels, or the
    // workload's engine): no fused kernels' state to store or keep.
    let run = match w.fused_attention {
        true => fastest,
        false => GpuRun {
            fused_attention: false,
            stored_score_grads: false,
            kept_attention: 0,
            ..fastest
        },
    };
    // The gradients' landing buffer, as the pre-flight counts it.
    let landing = match l.zero == 0 && copy_engines_by_default(l.dp, one_host) {
        true => copy_engine_landing_bytes(l.dp, share_params(&cfg, tensor)),
        false => 0,
    };
    let mut f = gpu_training(&cfg, &run);
    if (f.total() + landing) as f64 > budget {
        f = gpu_training(&cfg, &run.leanest());
    }
    let acts = f.part("activations");
    ((f.total() - acts + landing) as f64, acts as f64)
}

/// A pipeline's bytes per GPU (model states, activations) as `braid
/// train --pp`'s pre-flight counts its fullest rank, in the first of its
/// forms that fits `budget` on every rank, else its leanest; `None` where
/// the pipeline cannot be cut.
fn pipeline_count(
    w: &Workload,
    cfg: &GptConfig,
    l: &Layout,
    budget: f64,
    built: Option<&Schedule>,
) -> Option<(f64, f64)> {
    let owned;
    let schedule = match built {
        Some(s) => s,
        None => {
            owned = l.schedule?.build(l.pp, l.micro_batches).ok()?;
            &owned
        }
    };
    let head = head_cost(cfg.n_embd, cfg.vocab_size, cfg.context);
    let all = assign(cfg.n_layer, schedule.stages(), None, head).ok()?;
    // Tensor rank 0's share: the ranks' shares differ by the vocabulary's
    // rounding at most.
    let share = braid_model::Layout::tensor_parallel(
        cfg,
        TensorShard {
            rank: 0,
            size: l.tp,
        },
        1,
    )
    .ok()?;
    // Each rank's elements and those of its bf16 copy.
    let sizes: Vec<(usize, usize)> = (0..l.pp)
        .map(|r| {
            let mine: Vec<_> = schedule
                .stages_of(r)
                .into_iter()
                .map(|i| all[i].clone())
                .collect();
            share.pipeline_stages_len(&mine, true)
        })
        .collect();
    let fused = w.fused_attention;
    let data = Sharding {
        stage: l.zero,
        ranks: l.dp,
    };
    // The fullest rank's (model states, activations) in a form: (bf16
    // weights streamed, score gradients stored).
    let count = |(streamed_weights, stored_score_grads): (bool, bool)| {
        let options = MixedOptions {
            checkpointing: l.checkpointing,
            streamed_weights,
            stored_score_grads,
            kept_attention: 0,
            recompute_attention_output: true,
            sequence_parallel: false,
        };
        let rows = (l.micro_batch, w.seq);
        pipeline_activations(cfg, schedule, &all, rows, &options, (fused, l.tp))
            .into_iter()
            .enumerate()
            .map(|(r, acts)| {
                let states = stage_states(sizes[r], !streamed_weights, data).bytes;
                (states as f64, acts.total() as f64)
            })
            .max_by(|a, b| (a.0 + a.1).total_cmp(&(b.0 + b.1)))
            .unwrap_or((0.0, 0.0))
    };
    // The leanest form first: where it does not fit, no form does (most
    // layouts of a large question), else the fastest that fits.
    let leanest = count((true, false));
    if leanest.0 + leanest.1 > budget {
        return Some(leanest);
    }
    let fastest_first = [(false, true), (false, false), (true, true)];
    Some(
        fastest_first
            .into_iter()
            .map(count)
            .find(|(s, a)| s + a <= budget)
            .unwrap_or(leanest),
    )
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
            sequence_parallel: false,
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
            .map(|z| per_gpu(&w, &layout(z), big, false, None).0 / w.params())
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
            false,
            None,
        )
        .1;
        let without = per_gpu(&w, &layout(0), big, false, None).1;
        // The fastest form keeps every layer's attention state; the
        // leanest (what a short budget gets) saves each layer's input alone.
        let lean = per_gpu(
            &w,
            &Layout {
                checkpointing: true,
                ..layout(0)
            },
            1.0,
            false,
            None,
        )
        .1;
        assert!(lean < with && with < without, "{lean}, {with}, {without}");
        // (Both keep the two deferred layers' gradients of data
        // parallelism over 4 ranks.)
        assert!(lean < without / 3.0, "{lean} against {without}");
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
        let (s, a) = per_gpu(&w, &l, f64::INFINITY, false, None);
        let (ls, la) = per_gpu(&w, &l, s + a - 1.0, false, None);
        assert!(ls + la < s + a, "{ls} + {la} against {s} + {a}");
    }
}
