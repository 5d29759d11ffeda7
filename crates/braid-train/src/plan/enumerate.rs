//! Every layout of a workload over a number of GPUs that braid can run,
//! with what each would cost and why the others cannot run
//! ([`candidates`]).

use super::capacity::{capacity, LinkLoad};
use super::cost::{predict, Layout, Prediction, Workload};
use super::hardware::Hardware;
use super::memory;
use crate::schedule::build::ScheduleKind;
use serde::Serialize;

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
    let mut out = Vec::new();
    let budget = hw.memory_gib * (1u64 << 30) as f64 * 0.92;
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
                            };
                            out.push(judge(w, layout, hw, budget));
                        }
                    }
                }
            }
        }
    }
    out.sort_by(|a, b| {
        let key = |c: &Candidate| c.prediction.map_or(f64::INFINITY, |p| p.step_s);
        key(a).total_cmp(&key(b))
    });
    out
}

/// One layout: refused (and why) or predicted.
fn judge(w: &Workload, layout: Layout, hw: &Hardware, budget: f64) -> Candidate {
    let (states, acts) = memory::per_gpu(w, &layout);
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
            "{:.1} GiB per GPU ({:.1} GiB model states, {:.1} GiB activations) over the {:.0} GiB a GPU offers",
            gib(states + acts),
            gib(states),
            gib(acts),
            hw.memory_gib
        ))
    } else {
        None
    };
    match refuse {
        Some(r) => c.refused = Some(r),
        None => match predict(w, &layout, hw) {
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

    #[test]
    fn a_small_model_on_one_node_prefers_data_parallelism_and_a_large_one_refuses_it() {
        let hw = Hardware::builtin("h100").unwrap();
        let small = Workload {
            layers: 12,
            width: 768,
            heads: 12,
            vocab: 50304,
            seq: 1024,
            global_batch: 64,
            fused_attention: true,
        };
        let c = candidates(&small, 4, &hw, None);
        let best = &c[0];
        assert!(best.refused.is_none());
        assert_eq!((best.layout.tp, best.layout.pp), (1, 1), "{best:?}");
        // 12.85B: plain data parallelism cannot hold 18 bytes a parameter.
        let big = Workload {
            layers: 40,
            width: 5120,
            heads: 40,
            vocab: 50304,
            seq: 1024,
            global_batch: 16,
            fused_attention: true,
        };
        let c = candidates(&big, 4, &hw, None);
        let dp = c
            .iter()
            .find(|c| c.layout.tp == 1 && c.layout.pp == 1 && c.layout.zero == 0)
            .unwrap();
        assert!(
            dp.refused.as_deref().unwrap_or("").contains("GiB per GPU"),
            "{dp:?}"
        );
        assert!(c[0].refused.is_none(), "something fits: {:?}", c[0]);
        assert!(c.len() > 40);
    }
}
