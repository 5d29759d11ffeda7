//! Every layout of a workload over a number of GPUs that braid can run,
//! with what each would cost and why the others cannot run
//! ([`candidates`]).

use super::capacity::{capacity, LinkLoad};
use super::cost::{predict_with, Layout, Prediction, Workload};
use super::hardware::Hardware;
use super::memory;
use crate::schedule::build::ScheduleKind;
use crate::schedule::Schedule;
use rayon::prelude::*;
use serde::Serialize;
use std::collections::HashMap;

/// A layout and its verdict.
#[derive(Debug, Clone, Serialize)]
pub struct Candidate {
    pub layout: Layout,
    /// The pipeline's schedule by name.
    pub schedule: Option<String>,
    /// Model states and activations per GPU, bytes.
    pub states_bytes: f64,
    pub activation_bytes: f64,
    /// The prediction, where the layout runs.
    pub prediction: Option<Prediction>,
    /// Why it does not, otherwise.
    pub refused: Option<String>,
    /// Where it runs: each link's traffic per step and the bandwidth it
    /// needs to stay hidden.
    pub capacity: Vec<LinkLoad>,
}

impl Candidate {
    /// Memory per GPU, bytes.
    pub fn memory_bytes(&self) -> f64 {
        self.states_bytes + self.activation_bytes
    }
}

fn divisors(n: usize) -> Vec<usize> {
    (1..=n).filter(|d| n % d == 0).collect()
}

/// Every layout of `w` over `gpus` GPUs of `hw` (tensor groups inside a
/// node; micro-batches of `micro` sequences, or every power of two that
/// divides the replica's batch), predicted or refused, fastest first.
pub fn candidates(
    w: &Workload,
    gpus: usize,
    hw: &Hardware,
    micro: Option<usize>,
) -> Vec<Candidate> {
    let mut layouts = Vec::new();
    let budget = hw.memory_budget();
    for tp in divisors(gpus.min(hw.gpus_per_node)) {
        if w.heads % tp != 0 || w.width % tp != 0 {
            continue;
        }
        for pp in divisors(gpus / tp).into_iter().filter(|p| *p <= w.layers) {
            if (gpus / tp) % pp != 0 {
                continue;
            }
            let dp = gpus / (tp * pp);
            if w.global_batch % dp != 0 {
                continue;
            }
            let per_replica = w.global_batch / dp;
            let micros: Vec<usize> = match micro {
                Some(b) => vec![b],
                None => (0..8)
                    .map(|k| 1 << k)
                    .filter(|b| per_replica % *b == 0)
                    .collect(),
            };
            let schedules: Vec<Option<ScheduleKind>> = match pp {
                1 => vec![None],
                _ => vec![
                    Some(ScheduleKind::OneFOneB),
                    Some(ScheduleKind::Interleaved(2)),
                    Some(ScheduleKind::ZeroBubble),
                    Some(ScheduleKind::GPipe),
                ],
            };
            let zeros: Vec<u8> = match dp {
                1 => vec![0],
                _ => vec![0, 1, 2, 3],
            };
            for &b in &micros {
                if per_replica % b != 0 {
                    continue;
                }
                let m = per_replica / b;
                for sched in &schedules {
                    for &zero in &zeros {
                        for (shard_group, offload) in sharding(dp, tp, pp, zero) {
                            for ckpt in [false, true] {
                                let layout = Layout {
                                    dp,
                                    tp,
                                    pp,
                                    zero,
                                    micro_batch: b,
                                    micro_batches: m,
                                    schedule: *sched,
                                    checkpointing: ckpt,
                                    overlap_data: true,
                                    sequence_parallel: Layout::braid_sequence_parallel(tp, pp),
                                    shard_group,
                                    offload,
                                };
                                layouts.push(layout);
                            }
                        }
                    }
                }
            }
        }
    }
    // Each pipeline schedule built once (the layouts of one pipeline
    // differ in their ZeRO stage, sharding and checkpointing) and, like
    // the layouts, judged in parallel: a thousand-GPU question simulates
    // hundreds of pipelines of thousands of micro-batches.
    let mut keys: Vec<(ScheduleKind, usize, usize)> = layouts
        .iter()
        .filter_map(|l| l.schedule.map(|k| (k, l.pp, l.micro_batches)))
        .collect();
    keys.sort_by_key(|&(k, p, m)| (k.name(), p, m));
    keys.dedup();
    let schedules: HashMap<(ScheduleKind, usize, usize), Schedule> = keys
        .into_par_iter()
        .filter_map(|(k, p, m)| Some(((k, p, m), k.build(p, m).ok()?)))
        .collect();
    let mut out: Vec<Candidate> = layouts
        .into_par_iter()
        .map(|layout| {
            let built = layout
                .schedule
                .and_then(|k| schedules.get(&(k, layout.pp, layout.micro_batches)));
            judge(w, layout, hw, budget, built)
        })
        .collect();
    out.sort_by(|a, b| {
        let key = |c: &Candidate| c.prediction.map_or(f64::INFINITY, |p| p.step_s);
        key(a).total_cmp(&key(b))
    });
    out
}

/// How the model states of a layout may be placed, as braid train takes
/// them: sharded over every replica or, without a pipeline, hybrid
/// (`--shard-group`: each proper divisor of the replicas); the
/// optimizer offloaded to the host in plain data parallelism (braid
/// offloads without ZeRO, `--tp` or `--pp`).
fn sharding(dp: usize, tp: usize, pp: usize, zero: u8) -> Vec<(Option<usize>, bool)> {
    let mut out = vec![(None, false)];
    if zero > 0 && pp == 1 {
        out.extend(
            divisors(dp)
                .into_iter()
                .filter(|&g| g > 1 && g < dp)
                .map(|g| (Some(g), false)),
        );
    }
    if zero == 0 && tp == 1 && pp == 1 {
        out.push((None, true));
    }
    out
}

/// One layout: refused (and why) or predicted.
fn judge(
    w: &Workload,
    layout: Layout,
    hw: &Hardware,
    budget: f64,
    built: Option<&Schedule>,
) -> Candidate {
    let one_host = layout.dp * layout.tp * layout.pp <= hw.gpus_per_node;
    let (states, acts) = memory::per_gpu(w, &layout, budget, one_host, built);
    let mut c = Candidate {
        layout,
        schedule: layout.schedule.map(|s| s.name()),
        states_bytes: states,
        activation_bytes: acts,
        prediction: None,
        refused: None,
        capacity: Vec::new(),
    };
    let gib = |x: f64| x / (1u64 << 30) as f64;
    let refuse = if layout.pp > 1 && layout.micro_batches < layout.pp {
        Some(format!(
            "{} micro-batches for {} stages: the pipeline would idle (raise the batch or lower --pp)",
            layout.micro_batches, layout.pp
        ))
    } else if layout.pp > 1 && layout.zero >= 2 {
        Some("a pipeline under ZeRO-2/3 on GPUs is not built yet (issue 65)".to_string())
    } else if let Some(ScheduleKind::Interleaved(v)) =
        layout.schedule.filter(|_| w.layers % (layout.pp * 2) != 0)
    {
        Some(format!(
            "interleaving {v} stages per rank needs the {} layers to divide into {} stages",
            w.layers,
            layout.pp * v
        ))
    } else if states + acts > budget {
        Some(format!(
            "{:.1} GiB per GPU ({:.1} GiB model states, {:.1} GiB activations) over the {:.1} GiB \
             braid train's pre-flight leaves on a {:.1} GiB GPU",
            gib(states + acts),
            gib(states),
            gib(acts),
            gib(budget),
            hw.memory_gib
        ))
    } else {
        None
    };
    match refuse {
        Some(r) => c.refused = Some(r),
        None => match predict_with(w, &layout, hw, built) {
            Ok(p) => {
                c.capacity = capacity(w, &layout, hw, &p);
                c.prediction = Some(p);
            }
            Err(e) => c.refused = Some(e),
        },
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::testing::gpt;

    #[test]
    fn a_small_model_on_one_node_prefers_data_parallelism_and_a_large_one_refuses_it() {
        let hw = Hardware::builtin("h100").unwrap();
        let small = gpt(12, 12, 768, 64);
        let c = candidates(&small, 4, &hw, None);
        let best = &c[0];
        assert!(best.refused.is_none());
        assert_eq!((best.layout.tp, best.layout.pp), (1, 1), "{best:?}");
        // 12.85B: plain data parallelism cannot hold 18 bytes a parameter.
        let big = gpt(40, 40, 5120, 16);
        let c = candidates(&big, 4, &hw, None);
        let dp = c
            .iter()
            .find(|c| {
                c.layout.tp == 1 && c.layout.pp == 1 && c.layout.zero == 0 && !c.layout.offload
            })
            .unwrap();
        assert!(
            dp.refused.as_deref().unwrap_or("").contains("GiB per GPU"),
            "{dp:?}"
        );
        assert!(c[0].refused.is_none(), "something fits: {:?}", c[0]);
        assert!(c.len() > 40);
    }

    /// Hybrid sharding is enumerated for ZeRO without a pipeline (shard
    /// groups strictly inside the replicas), and holds more per GPU than
    /// sharding over every replica but less than none; the offloaded
    /// optimizer only in plain data parallelism, holding 6 bytes a
    /// parameter on the GPU.
    #[test]
    fn hybrid_sharding_and_offload_are_enumerated_as_braid_runs_them() {
        let hw = Hardware::builtin("h100").unwrap();
        let w = gpt(24, 16, 2048, 64);
        let c = candidates(&w, 16, &hw, Some(4));
        let hybrid: Vec<&Candidate> = c
            .iter()
            .filter(|c| c.layout.shard_group.is_some())
            .collect();
        assert!(!hybrid.is_empty());
        for h in &hybrid {
            let (l, g) = (h.layout, h.layout.shard_group.unwrap());
            assert!(
                l.zero > 0 && l.pp == 1 && g > 1 && g < l.dp && l.dp % g == 0,
                "{l:?}"
            );
            let same = |shard_group| {
                c.iter()
                    .find(|o| o.layout == Layout { shard_group, ..l })
                    .unwrap()
            };
            let (full, zero_none) = (
                same(None),
                c.iter().find(|o| {
                    o.layout
                        == Layout {
                            zero: 0,
                            shard_group: None,
                            ..l
                        }
                }),
            );
            assert!(h.states_bytes > full.states_bytes, "{l:?}");
            if let Some(z) = zero_none {
                assert!(h.states_bytes < z.states_bytes, "{l:?}");
            }
        }
        // Groups of 8 in 16 GPUs: the sum across the groups leaves the node.
        let across = hybrid
            .iter()
            .find(|h| {
                h.layout.dp == 16 && h.layout.shard_group == Some(8) && h.prediction.is_some()
            })
            .expect("a 2 x 8 hybrid layout");
        let replicas = across
            .capacity
            .iter()
            .find(|d| d.dimension == "replicas")
            .unwrap();
        assert!(replicas.across_nodes && replicas.ranks == 2, "{replicas:?}");
        let offloaded: Vec<&Candidate> = c.iter().filter(|c| c.layout.offload).collect();
        assert!(!offloaded.is_empty());
        for o in offloaded {
            let l = o.layout;
            assert!(l.zero == 0 && l.tp == 1 && l.pp == 1, "{l:?}");
            let per = w.params() / (l.tp * l.pp) as f64;
            // bf16 weights and f32 gradients on the GPU, and the f32
            // tensors the passes read besides
            // (`braid_model::footprint::side_params`).
            let bytes = o.states_bytes / per;
            assert!((6.0..6.5).contains(&bytes), "{l:?}: {bytes}");
        }
    }
}
