//! `braid plan`'s memory verdicts against `braid train`'s GPU pre-flight:
//! for every layout the planner judges, at budgets that leave some
//! layouts out, the planner calls a layout too large exactly where the
//! pre-flight would refuse it (`--gpu-memory` set to the planner's
//! budget, `Hardware::memory_budget`: the free memory at start less the
//! pre-flight's margin; a pipeline's every rank), so that a refusal in
//! the plan is never wrong.

use super::preflight::{device_in, Room, Shape};
use super::train_pipeline::{fitting_form, layouts, StageFit};
use braid_model::cuda::model_mixed::MixedOptions;
use braid_model::footprint::Sharding;
use braid_model::layout::{Layout as ModelLayout, TensorShard};
use braid_model::GptConfig;
use braid_train::engines::Precision;
use braid_train::pipeline::assign::{assign, head_cost};
use braid_train::plan::{candidates, Hardware, Layout, Workload};

/// A GPT-2-shaped workload of `layers` × `heads` × `width`.
fn gpt(layers: usize, heads: usize, width: usize, global_batch: usize) -> Workload {
    let name = format!("L{layers}-H{heads}-C{width}");
    let cfg = GptConfig::parse(&name).expect("a model");
    Workload::of(&cfg, 1024, global_batch)
}

/// Layouts without and with a pipeline.
type Pair = (usize, usize);

/// Layouts judged (fitting, refused for memory) and every disagreement,
/// described, for `w` over `gpus` GPUs of one node holding `memory_gib`.
fn verdicts(w: &Workload, gpus: usize, memory_gib: f64) -> (Pair, Pair, Vec<String>) {
    let mut hw = Hardware::builtin("h100").expect("h100 ships");
    hw.memory_gib = memory_gib;
    let budget = hw.memory_budget();
    let cfg = w.config();
    let (mut fits, mut refused, mut wrong) = ((0, 0), (0, 0), Vec::new());
    for c in candidates(w, gpus, &hw, None) {
        let l = c.layout;
        let pre = match l.pp {
            1 => whole_model_fits(w, &cfg, &l, gpus, budget),
            _ => match pipeline_fits(w, &cfg, &l, budget) {
                Some(fits) => fits,
                // Not a pipeline braid train would cut: refused for that.
                None => continue,
            },
        };
        let planned = c.memory_bytes() <= budget;
        match (planned, l.pp) {
            (true, 1) => fits.0 += 1,
            (true, _) => fits.1 += 1,
            (false, 1) => refused.0 += 1,
            (false, _) => refused.1 += 1,
        }
        if pre.is_ok() != planned {
            let gib = |b: f64| b / (1u64 << 30) as f64;
            wrong.push(format!(
                "{l:?}: plan {:.2} GiB ({}), pre-flight {}",
                gib(c.memory_bytes()),
                if planned { "fits" } else { "too large" },
                match pre {
                    Ok(estimate) => format!("fits at {:.2} GiB", gib(estimate as f64)),
                    Err(e) => format!("refuses: {e}"),
                }
            ));
        }
    }
    (fits, refused, wrong)
}

/// The pre-flight of `l` without a pipeline within `budget` bytes: its
/// estimate, or its refusal.
fn whole_model_fits(
    w: &Workload,
    cfg: &GptConfig,
    l: &Layout,
    gpus: usize,
    budget: f64,
) -> Result<u128, String> {
    let shape = Shape {
        model: "the workload",
        seq: w.seq,
        checkpointing: l.checkpointing,
        sharding: Sharding {
            stage: l.zero,
            ranks: l.shard_ranks(),
        },
        ranks: l.dp,
        local_workers: gpus,
        offload: l.offload,
        accum: l.micro_batches,
        tensor: l.tp,
        sequence: l.tp > 1,
        plain_grads: true,
        gpu_memory: Some(budget as u128),
        fp8: braid_model::cuda::model_mixed::Fp8Use::Off,
    };
    let deferred = super::train::defer_layers(None, Precision::Bf16, l.dp, w.layers);
    let deferred = if l.zero > 0 { 0 } else { deferred };
    device_in(
        &shape,
        cfg,
        (Some(Room::budget_only(budget as u128)), w.fused_attention),
        Precision::Bf16,
        l.micro_batch,
        deferred,
    )
    .map(|p| p.estimate)
}

/// The pre-flight of every rank of pipeline `l` within `budget` bytes, as `braid
/// train --pp` runs it with no environment set: the fullest rank's
/// estimate, or the first refusal; `None` where the pipeline is not cut
/// (its schedule or stages refused).
fn pipeline_fits(
    w: &Workload,
    cfg: &GptConfig,
    l: &Layout,
    budget: f64,
) -> Option<Result<u128, String>> {
    let room = Room::budget_only(budget as u128);
    let schedule = l.schedule?.build(l.pp, l.micro_batches).ok()?;
    let head = head_cost(cfg.n_embd, cfg.vocab_size, cfg.context);
    let all = assign(cfg.n_layer, schedule.stages(), None, head).ok()?;
    let shard = TensorShard {
        rank: 0,
        size: l.tp,
    };
    let whole = ModelLayout::tensor_parallel(cfg, shard, 1).ok()?;
    let layouts = layouts(&whole, &schedule, &all).ok()?;
    let fit = StageFit {
        cfg,
        schedule: &schedule,
        all: &all,
        layouts: &layouts,
        rows: (l.micro_batch, w.seq),
        precision: Precision::Bf16,
        fused: w.fused_attention,
        tensor: l.tp,
        data: Sharding {
            stage: l.zero,
            ranks: l.dp,
        },
        weights: vec![false, true],
        scores: vec![true, false],
        base: MixedOptions {
            checkpointing: l.checkpointing,
            recompute_attention_output: true,
            ..Default::default()
        },
    };
    let mut fullest = 0;
    for rank in 0..l.pp {
        match fitting_form(&fit, rank, Some(&room)) {
            Ok((_, acts, states)) => {
                let total = states as u128 + acts.map_or(0, |a| a.total());
                fullest = fullest.max(total);
            }
            Err(e) => return Some(Err(e)),
        }
    }
    Some(Ok(fullest))
}

/// 1558M (also through the batched attention) and 2.65B over 4 GPUs at
/// budgets from 20 to 80 GiB, and 12.85B
/// over 8 at 40 to 141 GiB (data, ZeRO, hybrid, offload, tensor,
/// pipelines under each schedule, their products): every layout the
/// plan keeps, the pre-flight keeps, and every layout it refuses for
/// memory, the pre-flight refuses.
#[test]
fn the_plan_refuses_for_memory_exactly_where_the_preflight_does() {
    let (mut fits, mut refused, mut wrong) = ((0, 0), (0, 0), Vec::new());
    // (And 1558M through the batched attention, as for a head size
    // without fused kernels.)
    let batched = Workload {
        fused_attention: false,
        ..gpt(48, 25, 1600, 32)
    };
    let questions: [(Workload, usize, &[f64]); 4] = [
        (
            gpt(48, 25, 1600, 32),
            4,
            &[20.0, 28.0, 36.0, 44.0, 60.0, 80.0],
        ),
        (batched, 4, &[20.0, 36.0, 60.0, 80.0]),
        (
            gpt(32, 32, 2560, 16),
            4,
            &[20.0, 28.0, 36.0, 44.0, 60.0, 80.0],
        ),
        (gpt(40, 40, 5120, 16), 8, &[40.0, 64.0, 80.0, 141.0]),
    ];
    for (w, gpus, memories) in questions {
        for &memory in memories {
            let (f, r, w) = verdicts(&w, gpus, memory);
            (fits.0, fits.1) = (fits.0 + f.0, fits.1 + f.1);
            (refused.0, refused.1) = (refused.0 + r.0, refused.1 + r.1);
            wrong.extend(w);
        }
    }
    // (Without a pipeline, with one.)
    eprintln!("layouts that fit: {fits:?}; refused for memory: {refused:?}");
    let each = [fits.0, fits.1, refused.0, refused.1];
    assert!(
        each.iter().all(|&n| n > 20),
        "{fits:?} fit, {refused:?} refused"
    );
    assert!(
        wrong.is_empty(),
        "{} of {} verdicts differ:\n{}",
        wrong.len(),
        each.iter().sum::<usize>(),
        wrong.join("\n")
    );
}
