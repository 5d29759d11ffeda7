//! The distributed-training analysis report (`braid report`): the
//! course's sections — run, throughput and utilisation, the temporal
//! breakdown per rank, communication (per operation: time, bytes,
//! bandwidth; overhead; overlap), synchronisation and stragglers, under a
//! pipeline the pipeline (its bubble measured per rank and overall beside
//! the schedule's on paper, the stages' computation and their imbalance),
//! scaling efficiency (over several runs), the backend comparison (over
//! `braid bench --json` files), the bottleneck with its evidence, and
//! suggestions that follow from the figures.
//!
//! A pipeline run's layout comes from the run's description in the trace
//! (`desc.pipeline`, written by `braid train --pp`): without it a
//! pipeline's waits read as exposed communication and its stages'
//! differing work as stragglers.
//!
//! [`build`] computes it as one JSON value (what `--json` prints and the
//! HTML page draws); [`render_text`] prints it for a terminal.

use crate::analysis::{self, RunAnalysis, StepBreakdown};
use crate::format::RankTrace;
use serde_json::{json, Value};

/// What a report is made from.
pub struct Inputs<'a> {
    /// The run analysed: every rank's trace.
    pub traces: &'a [RankTrace],
    /// Ranks of the run whose trace is missing.
    pub missing: &'a [usize],
    /// Other runs of the same model at other world sizes (for scaling).
    pub others: &'a [Vec<RankTrace>],
    /// `braid bench --json` rows (for the backend comparison).
    pub bench: &'a [Value],
}

/// Peak dense bf16 FLOP/s of an H100/H200 GPU (what MFU is against).
const GPU_PEAK_FLOPS: f64 = 989e12;

/// The share of the step (mean over ranks) above which a pipeline's
/// bubble, where it is the largest part besides computation, is the
/// bottleneck.
pub const BUBBLE_SHARE: f64 = 0.10;

/// How far (a share of the stages' mean) the slowest pipeline stage's
/// computation per step must exceed the stages' mean to be called stage
/// imbalance.
pub const IMBALANCE_SHARE: f64 = 0.10;

fn ms(us: f64) -> f64 {
    (us / 1e3 * 1000.0).round() / 1000.0
}

fn pct(part: f64, whole: f64) -> f64 {
    (1000.0 * part / whole.max(1e-12)).round() / 10.0
}

/// The warm-up steps the run's own summary left out.
fn warmup_of(t: &RankTrace) -> usize {
    t.run["summary"]["warmup_steps"].as_u64().unwrap_or(1) as usize
}

fn desc(t: &RankTrace) -> &Value {
    &t.run["desc"]
}

/// Tokens per second of a run (its lead rank's summary).
fn tokens_per_s(traces: &[RankTrace]) -> Option<f64> {
    traces.first()?.run["summary"]["tokens_per_s"].as_f64()
}

fn breakdown_json(m: &StepBreakdown) -> Value {
    json!({
        "step_ms": ms(m.total),
        "compute_ms": ms(m.compute),
        "tensor_comm_ms": ms(m.tensor_comm),
        "exposed_comm_ms": ms(m.exposed_comm),
        "bubble_ms": ms(m.bubble),
        "data_ms": ms(m.data),
        "other_ms": ms(m.other),
        "idle_ms": ms(m.idle),
        "comm_ms": ms(m.comm),
        "overlapped_comm_ms": ms(m.overlapped),
        "compute_pct": pct(m.compute, m.total),
        "tensor_comm_pct": pct(m.tensor_comm, m.total),
        "exposed_comm_pct": pct(m.exposed_comm, m.total),
        "bubble_pct": pct(m.bubble, m.total),
        "data_pct": pct(m.data, m.total),
        "other_pct": pct(m.other, m.total),
        "idle_pct": pct(m.idle, m.total),
        "overlap_pct": if m.comm > 0.0 { pct(m.overlapped, m.comm) } else { 0.0 },
    })
}

/// The worst relative gap, over the counted steps of each rank, between
/// the traced step (compute + exposed communication + pipeline bubble +
/// data + other + idle) and the step time the training loop measured.
fn accounting(t: &RankTrace, steps: &[StepBreakdown], warmup: usize) -> Option<f64> {
    let measured: Vec<(u64, f64)> = t.run["steps"]
        .as_array()?
        .iter()
        .filter_map(|s| Some((s["step"].as_u64()?, s["step_s"].as_f64()? * 1e6)))
        .collect();
    let mut worst: Option<f64> = None;
    for s in steps.iter().skip(warmup.min(steps.len().saturating_sub(1))) {
        let Some(&(_, m)) = measured.iter().find(|(k, _)| *k == s.step) else {
            continue;
        };
        let traced =
            s.compute + s.tensor_comm + s.exposed_comm + s.bubble + s.data + s.other + s.idle;
        let gap = (traced - m).abs() / m.max(1e-9);
        worst = Some(worst.map_or(gap, |w: f64| w.max(gap)));
    }
    worst
}

/// Builds the report.
pub fn build(inp: &Inputs<'_>) -> Value {
    let traces = inp.traces;
    let Some(first) = traces.first() else {
        return json!({"error": "no traces"});
    };
    let warmup = warmup_of(first);
    let d = desc(first);
    // Under a pipeline: each world rank's pipeline rank.
    let rank_pipe: Option<Vec<usize>> = d["pipeline"]["rank_pipe"]
        .as_array()
        .map(|v| v.iter().map(|x| x.as_u64().unwrap_or(0) as usize).collect());
    let a = analysis::analyse_layout(traces, warmup, rank_pipe.as_deref());
    let world = first.world_size;
    let avg = StepBreakdown::mean_of(a.means.iter().map(|m| &m.mean));
    let ranks: Vec<Value> = traces
        .iter()
        .zip(&a.means)
        .zip(&a.steps)
        .map(|((t, m), steps)| {
            let mut b = breakdown_json(&m.mean);
            b["rank"] = json!(t.rank);
            b["steps_counted"] = json!(m.steps);
            b["accounting_gap_pct"] = json!(accounting(t, steps, warmup).map(|g| pct(g, 1.0)));
            b["clock_offset_us"] = json!(t.clock.offset_us);
            b["clock_rtt_us"] = json!(t.clock.rtt_us);
            b
        })
        .collect();
    let step_times: Vec<Value> = traces
        .iter()
        .zip(&a.steps)
        .map(|(t, s)| json!({"rank": t.rank, "step_ms": s.iter().map(|b| ms(b.total)).collect::<Vec<_>>()}))
        .collect();

    // Throughput and utilisation.
    let tps = tokens_per_s(traces);
    let summary = &first.run["summary"];
    let mut throughput = json!({
        "tokens_per_s": tps,
        "median_step_ms": summary["median_step_s"].as_f64().map(|s| ms(s * 1e6)),
        "compute_share_pct": pct(avg.compute, avg.total),
    });
    if a.gpu {
        if let Some(f) = flops_per_token(d) {
            throughput["mfu_pct"] = json!(tps.map(|t| pct(t * f, GPU_PEAK_FLOPS * world as f64)));
        }
        throughput["peak_device_gib"] = json!(first.run["peak_device_bytes"]
            .as_f64()
            .map(|b| b / (1u64 << 30) as f64));
    }

    // Communication.
    let steps_counted = a.means.first().map_or(1, |m| m.steps.max(1));
    let ops: Vec<Value> = a.ops[0]
        .iter()
        .map(|o| {
            let per_step = o.count as f64 / steps_counted as f64;
            json!({
                "op": o.op,
                "count": o.count,
                "per_step": (per_step * 100.0).round() / 100.0,
                "total_ms": ms(o.total_us),
                "mean_ms": ms(o.total_us / o.count.max(1) as f64),
                "bytes": o.bytes,
                "algbw_GBps": (o.algbw * 1000.0).round() / 1000.0,
                "busbw_GBps": (o.busbw * 1000.0).round() / 1000.0,
            })
        })
        .collect();
    let named = |op: &str| {
        a.ops[0]
            .iter()
            .find(|o| o.op == op)
            .map_or(0.0, |o| ms(o.total_us / steps_counted as f64))
    };
    // Collectives per step by what runs them, on rank 0 (as the table).
    let per = |k: u64| (k as f64 / steps_counted as f64 * 100.0).round() / 100.0;
    let sc = &a.collectives[0];
    let collectives = json!({
        "per_step": per(sc.strategy_count() + sc.tensor_count() + sc.pipeline_count() + sc.norm + sc.loss),
        "strategy_per_step": per(sc.strategy_count()),
        "pipeline_per_step": per(sc.pipeline_count()),
        "tensor_per_step": per(sc.tensor_count()),
        "tensor_ops": sc.tensor.iter().map(|(op, k)| json!({"op": op, "per_step": per(*k)})).collect::<Vec<_>>(),
        "pipeline_ops": sc.pipeline.iter().map(|(op, k)| json!({"op": op, "per_step": per(*k)})).collect::<Vec<_>>(),
        "strategy_ops": sc.strategy.iter().map(|(op, k)| json!({"op": op, "per_step": per(*k)})).collect::<Vec<_>>(),
        "grad_norm_all_reduce_per_step": per(sc.norm),
        "loss_all_reduce_per_step": per(sc.loss),
        "summary_strategy_per_step": summary["collectives_per_step"],
    });
    let unoverlapped = first.run["unoverlapped_comm_s"].as_f64();
    let summary_exposed = summary["exposed_comm_s"].as_f64();
    let communication = json!({
        "backend": match summary["collectives_via"].as_str() {
            Some(v) if !v.is_empty() => json!(v),
            _ => d["backend"].clone(),
        },
        "ops": ops,
        "all_reduce_ms_per_step": named("all_reduce"),
        "broadcast_ms_per_step": named("broadcast"),
        "barrier_ms_per_step": named("barrier"),
        "comm_ms_per_step": ms(avg.comm),
        "exposed_comm_ms_per_step": ms(avg.exposed_comm),
        "overhead_pct": pct(avg.exposed_comm, avg.total),
        "overlap_pct": if avg.comm > 0.0 { pct(avg.overlapped, avg.comm) } else { 0.0 },
        "unoverlapped_comm_ms": unoverlapped.map(|u| ms(u * 1e6)),
        "hidden_pct": unoverlapped.map(|u| pct((u * 1e6 - avg.exposed_comm).max(0.0), u * 1e6)),
        "summary_exposed_comm_ms": summary_exposed.map(|e| ms(e * 1e6)),
        "rank0_exposed_comm_ms": a.means.first().map(|m| ms(m.mean.exposed_comm)),
        "rank0_hidden_pct": unoverlapped
            .zip(a.means.first())
            .map(|(u, m)| pct((u * 1e6 - m.mean.exposed_comm).max(0.0), u * 1e6)),
        "summary_hidden_pct": unoverlapped
            .zip(summary_exposed)
            .map(|(u, e)| pct((u - e).max(0.0), u)),
        "wire_bytes_per_step": summary["wire_bytes_per_step"],
        "steps_counted": steps_counted,
        "pipelined": a.pipe_ranks.is_some(),
        "collectives_per_step": collectives,
    });

    // Synchronisation and stragglers.
    let totals: Vec<f64> = a.means.iter().map(|m| m.mean.total).collect();
    let own: Vec<f64> = a
        .means
        .iter()
        .map(|m| m.mean.compute + m.mean.data + m.mean.other)
        .collect();
    let spread = |v: &[f64]| {
        let max = v.iter().cloned().fold(f64::MIN, f64::max);
        let min = v.iter().cloned().fold(f64::MAX, f64::min);
        if v.is_empty() {
            0.0
        } else {
            max - min
        }
    };
    let waits: Vec<f64> = a
        .means
        .iter()
        .map(|m| m.mean.exposed_comm + m.mean.idle)
        .collect();
    let synchronisation = json!({
        "step_spread_ms": ms(spread(&totals)),
        "own_work_spread_ms": ms(spread(&own)),
        "own_work_spread_pct": pct(spread(&own), avg.total),
        "wait_ms_per_rank": waits.iter().map(|w| ms(*w)).collect::<Vec<_>>(),
        "wait_ranks": a.means.iter().map(|m| m.rank).collect::<Vec<_>>(),
        "straggler_threshold_pct": (analysis::STRAGGLER_SHARE * 1e5).round() / 1e3,
        "straggler_threshold_min_ms": ms(analysis::STRAGGLER_MIN_US),
        // Under a pipeline a straggler is sought among one stage's ranks.
        "straggler_among": match &a.pipe_ranks {
            Some(_) => "stage",
            None => "all",
        },
        "stages_replicated": a.pipe_ranks.as_ref().is_some_and(|p| {
            p.iter().any(|r| p.iter().filter(|x| *x == r).count() > 1)
        }),
        "straggler": a.straggler.as_ref().map(|s| json!({
            "rank": s.rank, "category": s.category, "excess_ms": ms(s.excess_us), "evidence": s.evidence,
        })),
    });

    let pipeline = pipeline(&a, d);
    let scaling = scaling(traces, inp.others);
    let backends = backends(inp.bench);
    let (bottleneck, evidence) = classify(&a, &avg, d, &pipeline);
    let suggestions = suggest(&a, &avg, &bottleneck, d, &pipeline);
    json!({
        "run": {
            "ranks": world,
            "traced_ranks": traces.len(),
            "missing_ranks": inp.missing,
            "strategy": d["strategy"],
            "model": d["model"],
            "precision": d["precision"],
            "device": if a.gpu { "cuda" } else { "cpu" },
            "batch_per_rank": d["batch_per_rank"],
            "seq": d["seq"],
            "steps_traced": a.steps.first().map_or(0, Vec::len),
            "warmup_steps": warmup,
            "dropped_spans": traces.iter().map(|t| t.dropped).sum::<u64>(),
        },
        "throughput": throughput,
        "breakdown": {"mean": breakdown_json(&avg), "ranks": ranks},
        "step_times": step_times,
        "communication": communication,
        "synchronisation": synchronisation,
        "pipeline": pipeline,
        "scaling": scaling,
        "backends": backends,
        "bottleneck": {"kind": bottleneck, "evidence": evidence},
        "suggestions": suggestions,
        "parameter_server": crate::staleness::of(traces),
    })
}

/// FLOPs per token of the run's GPT (6 · parameters + 12 · layers · width
/// · sequence), from its description.
fn flops_per_token(d: &Value) -> Option<f64> {
    let c = &d["config"];
    let (l, e) = (c["n_layer"].as_f64()?, c["n_embd"].as_f64()?);
    Some(6.0 * d["params"].as_f64()? + 12.0 * l * e * d["seq"].as_f64()?)
}

/// Pipeline rank `r`'s stages in words, from the layout `p` (the run
/// description's `pipeline`): "stage 1 with layers 1..2 and the head".
fn stages_text(p: &Value, r: usize) -> String {
    let list: Vec<String> = p["stages"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|st| st["pipe_rank"].as_u64() == Some(r as u64))
        .map(|st| {
            format!(
                "stage {} with {}layers {}..{}{}",
                num(&st["stage"]),
                if st["first"] == true {
                    "the embeddings and "
                } else {
                    ""
                },
                num(&st["layers"][0]),
                num(&st["layers"][1]),
                if st["last"] == true {
                    " and the head"
                } else {
                    ""
                },
            )
        })
        .collect();
    match list.is_empty() {
        true => format!("pipeline rank {r}"),
        false => list.join("; "),
    }
}

/// The pipeline section (`Null` without a pipeline): per rank and per
/// pipeline rank (the mean of its data and tensor replicas) the
/// computation in the pipelined passes and the bubble; the bubble
/// measured overall (the idle share of all ranks' pipelined passes, as
/// `braid train`'s timeline measures it) beside the schedule's on paper —
/// `(N-1)/(V*M+N-1)`, the schedule run on paper with equal stages and
/// with the stages' estimated times, and for GPipe and 1F1B the bubble
/// the stages' measured computation allows, `1 - M·Σt / (N·(Σt + (M-1)·max
/// t))`; the stage imbalance (the slowest pipeline rank's computation
/// against the mean), and where one layer moved would even it out, the
/// `--stage-layers` that does.
fn pipeline(a: &RunAnalysis, d: &Value) -> Value {
    let (Some(pr), p) = (&a.pipe_ranks, &d["pipeline"]) else {
        return Value::Null;
    };
    let n = p["degree"].as_u64().unwrap_or(1).max(1) as usize;
    let m = p["micro_batches"].as_f64().unwrap_or(1.0);
    let v = p["virtual_stages"].as_u64().unwrap_or(1);
    let ranks: Vec<Value> = a
        .means
        .iter()
        .zip(pr)
        .map(|(k, &r)| {
            let passes = k.mean.passes;
            json!({
                "rank": k.rank,
                "pipe_rank": r,
                "passes_ms": ms(passes),
                "compute_ms": ms(k.mean.stage_compute),
                "bubble_ms": ms(k.mean.bubble),
                "bubble_pct": pct(k.mean.bubble, passes),
                "bubble_step_pct": pct(k.mean.bubble, k.mean.total),
            })
        })
        .collect();
    // Per pipeline rank: (pipeline rank, computation, bubble, its ranks,
    // passes).
    let mut per: Vec<(usize, f64, f64, Vec<usize>, f64)> = Vec::new();
    for r in 0..n {
        let mine: Vec<&analysis::RankMeans> = a
            .means
            .iter()
            .zip(pr)
            .filter(|(_, x)| **x == r)
            .map(|(k, _)| k)
            .collect();
        if mine.is_empty() {
            continue;
        }
        let k = mine.len() as f64;
        per.push((
            r,
            mine.iter().map(|x| x.mean.stage_compute).sum::<f64>() / k,
            mine.iter().map(|x| x.mean.bubble).sum::<f64>() / k,
            mine.iter().map(|x| x.rank).collect(),
            mine.iter().map(|x| x.mean.passes).sum::<f64>() / k,
        ));
    }
    let pipe_ranks: Vec<Value> = per
        .iter()
        .map(|(r, c, b, ranks, passes)| {
            json!({
                "pipe_rank": r,
                "stages": stages_text(p, *r),
                "ranks": ranks,
                "compute_ms": ms(*c),
                "bubble_ms": ms(*b),
                "bubble_pct": pct(*b, *passes),
            })
        })
        .collect();
    let sum = |f: &dyn Fn(&StepBreakdown) -> f64| a.means.iter().map(|k| f(&k.mean)).sum::<f64>();
    let (passes, waiting) = (sum(&|b| b.passes), sum(&|b| b.bubble));
    let mean_c = per.iter().map(|x| x.1).sum::<f64>() / per.len().max(1) as f64;
    let max_c = per.iter().map(|x| x.1).fold(0.0, f64::max);
    let slowest = per.iter().max_by(|x, y| x.1.total_cmp(&y.1));
    let imbalance = slowest.map(|s| {
        json!({
            "pipe_rank": s.0,
            "stages": stages_text(p, s.0),
            "compute_ms": ms(s.1),
            "mean_compute_ms": ms(mean_c),
            "pct": pct(s.1 - mean_c, mean_c),
            "layers": p["pipe_ranks"][s.0]["layers"],
        })
    });
    // GPipe and 1F1B, one stage per rank, every stage traced: the bubble
    // these stages' computation allows on paper.
    let flush = v == 1
        && matches!(p["schedule"].as_str(), Some("gpipe" | "1f1b"))
        && per.len() == n
        && mean_c > 0.0;
    let stage_times = flush.then(|| {
        let total: f64 = per.iter().map(|x| x.1).sum();
        1.0 - m * total / (n as f64 * (total + (m - 1.0) * max_c))
    });
    // One layer off the slowest stage onto its faster neighbour, where
    // that lowers the slowest stage's time (one stage per rank).
    let layers: Vec<u64> = p["stages"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|st| {
            st["layers"][1]
                .as_u64()
                .unwrap_or(0)
                .saturating_sub(st["layers"][0].as_u64().unwrap_or(0))
        })
        .collect();
    let rebalance = match (v, slowest) {
        (1, Some(&(s, t_s, _, _, _))) if per.len() == n && layers.len() == n && layers[s] > 1 => {
            let cost = p["stages"][s]["cost_layers"]
                .as_f64()
                .unwrap_or(layers[s] as f64)
                .max(1.0);
            let per_layer = t_s / cost;
            [s.wrapping_sub(1), s + 1]
                .into_iter()
                .filter(|&k| k < n)
                .map(|k| (k, per[k].1))
                .min_by(|x, y| x.1.total_cmp(&y.1))
                .filter(|&(_, t_k)| t_k + per_layer < t_s)
                .map(|(k, _)| {
                    let mut moved = layers.clone();
                    moved[s] -= 1;
                    moved[k] += 1;
                    moved
                })
        }
        _ => None,
    };
    let list = |l: &[u64]| {
        l.iter()
            .map(|x| x.to_string())
            .collect::<Vec<_>>()
            .join(",")
    };
    json!({
        "degree": n,
        "tensor": p["tensor"],
        "data": p["data"],
        "schedule": p["schedule"],
        "micro_batches": p["micro_batches"],
        "virtual_stages": v,
        "bubble_measured_pct": pct(waiting, passes),
        "bubble_step_pct": pct(waiting, sum(&|b| b.total)),
        "bubble_formula_pct": p["bubble_formula"].as_f64().map(|x| pct(x, 1.0)),
        "bubble_on_paper_pct": p["bubble_on_paper"].as_f64().map(|x| pct(x, 1.0)),
        "bubble_on_paper_these_stages_pct": p["bubble_on_paper_these_stages"].as_f64().map(|x| pct(x, 1.0)),
        "bubble_stage_times_pct": stage_times.map(|x| pct(x, 1.0)),
        "ranks": ranks,
        "pipe_ranks": pipe_ranks,
        "imbalance": imbalance,
        "stage_layers": list(&layers),
        "rebalanced_stage_layers": rebalance.map(|l| list(&l)),
    })
}

/// Scaling efficiency against the smallest run given.
fn scaling(traces: &[RankTrace], others: &[Vec<RankTrace>]) -> Value {
    let mut runs: Vec<(usize, f64)> = std::iter::once(traces)
        .chain(others.iter().map(Vec::as_slice))
        .filter_map(|t| Some((t.first()?.world_size, tokens_per_s(t)?)))
        .collect();
    if runs.len() < 2 {
        return Value::Null;
    }
    runs.sort_by_key(|r| r.0);
    let (n0, t0) = runs[0];
    let points: Vec<Value> = runs
        .iter()
        .map(|&(n, t)| {
            let ideal = t0 * n as f64 / n0 as f64;
            json!({"ranks": n, "tokens_per_s": t.round(), "ideal_tokens_per_s": ideal.round(), "efficiency_pct": pct(t, ideal)})
        })
        .collect();
    json!({"baseline_ranks": n0, "points": points})
}

/// Per backend (and operation), the bus bandwidth against message size.
fn backends(rows: &[Value]) -> Value {
    let mut out: Vec<Value> = Vec::new();
    for r in rows {
        let (Some(op), Some(bytes)) = (r["op"].as_str(), r["bytes"].as_u64()) else {
            continue;
        };
        let backend = r["backend"].as_str().unwrap_or("?");
        let ranks = r["ranks"].as_u64().unwrap_or(0);
        let Some(busbw) = r["out_of_place"]["busbw"].as_f64() else {
            continue;
        };
        let name = format!("{backend} {op} ×{ranks}");
        let i = match out.iter().position(|s| s["name"] == name.as_str()) {
            Some(i) => i,
            None => {
                out.push(json!({"name": name, "backend": backend, "op": op, "ranks": ranks, "points": []}));
                out.len() - 1
            }
        };
        out[i]["points"]
            .as_array_mut()
            .expect("array")
            .push(json!([bytes, busbw]));
    }
    for s in &mut out {
        let peak = s["points"]
            .as_array()
            .expect("array")
            .iter()
            .filter_map(|p| p[1].as_f64())
            .fold(0.0, f64::max);
        s["peak_busbw_GBps"] = json!(peak);
    }
    Value::Array(out)
}

/// The bottleneck: the first of these that holds, with the figures.
fn classify(a: &RunAnalysis, avg: &StepBreakdown, d: &Value, pl: &Value) -> (String, Vec<String>) {
    let step = avg.total.max(1e-9);
    let share = |x: f64| 100.0 * x / step;
    let mut ev = Vec::new();
    let f = |x: f64| format!("{:.1}%", x);
    ev.push(format!(
        "an average step, mean over the {} traced ranks: compute {} (optimizer included), exposed communication {}{}, data {}, other {}, idle {}",
        a.means.len(),
        f(share(avg.compute)),
        f(share(avg.exposed_comm)),
        match pl.is_null() {
            true => String::new(),
            false => format!(", pipeline bubble {}", f(share(avg.bubble))),
        },
        f(share(avg.data)),
        f(share(avg.other)),
        f(share(avg.idle))
    ));
    let min_wait = a
        .means
        .iter()
        .map(|m| m.mean.exposed_comm + m.mean.idle)
        .fold(f64::MAX, f64::min);
    let mean_wait = avg.exposed_comm + avg.idle;
    // A straggler named in the synchronisation section is the bottleneck
    // here too (the same threshold, [`analysis::STRAGGLER_SHARE`]).
    let kind = if let Some(s) = a.straggler.as_ref() {
        ev.push(s.evidence.clone());
        "load imbalance"
    } else if let Some(kind) = pipeline_bound(pl, avg, &mut ev) {
        kind
    } else if share(avg.data) > 15.0 {
        ev.push(format!(
            "data loading takes {} of the step",
            f(share(avg.data))
        ));
        "data-bound"
    } else if share(avg.exposed_comm) > 15.0 && a.means.len() > 1 && min_wait < 0.5 * mean_wait {
        ev.push(format!(
            "ranks wait {:.2} ms per step on average but the least-waiting rank only {:.2} ms: the wait is for other ranks, not for bytes",
            mean_wait / 1e3,
            min_wait / 1e3
        ));
        "synchronisation-bound"
    } else if share(avg.exposed_comm) > 25.0 {
        let via = d["ranks"].as_u64().unwrap_or(1);
        ev.push(format!(
            "{} of the step is communication that computation does not hide ({} of the collectives' time is hidden) over {via} ranks",
            f(share(avg.exposed_comm)),
            f(100.0 * avg.overlapped / avg.comm.max(1e-9))
        ));
        let slow_link = a.ops[0]
            .iter()
            .filter(|o| o.op == "all_reduce" || o.op == "reduce_scatter" || o.op == "all_gather")
            .any(|o| o.bytes > (1 << 20) && o.busbw < 5.0);
        if slow_link {
            ev.push(
                "the collectives' bus bandwidth stays below 5 GB/s on MB-sized messages".into(),
            );
            "network-bound"
        } else {
            "communication-bound"
        }
    } else if share(avg.idle) > 20.0 {
        ev.push(format!(
            "{} of the step nothing runs (host overhead or launch latency)",
            f(share(avg.idle))
        ));
        "idle-bound"
    } else {
        "compute-bound"
    };
    (kind.to_string(), ev)
}

/// The pipeline as the bottleneck (`pl`: the report's `pipeline`
/// section): its bubble takes more than [`BUBBLE_SHARE`] of the step and
/// more than any other part besides computation; "stage imbalance" where
/// the slowest stage computes more than [`IMBALANCE_SHARE`] above the
/// stages' mean, "pipeline bubble" otherwise. The figures go to `ev`.
fn pipeline_bound(pl: &Value, avg: &StepBreakdown, ev: &mut Vec<String>) -> Option<&'static str> {
    if pl.is_null() {
        return None;
    }
    let step = avg.total.max(1e-9);
    let others = avg.exposed_comm.max(avg.data).max(avg.other).max(avg.idle);
    if avg.bubble <= BUBBLE_SHARE * step || avg.bubble < others {
        return None;
    }
    ev.push(format!(
        "the pipeline bubble takes {:.1}% of the step (mean over ranks): the time in a rank's pipelined passes that it computes nothing, waiting for the other stages",
        100.0 * avg.bubble / step
    ));
    ev.push(format!("pipeline bubble: {}", bubble_text(pl)));
    if let Some(t) = imbalance_text(pl) {
        ev.push(format!("stage imbalance: {t}"));
    }
    let imbalance = pl["imbalance"]["pct"].as_f64().unwrap_or(0.0);
    Some(match imbalance > 100.0 * IMBALANCE_SHARE {
        true => "stage imbalance",
        false => "pipeline bubble",
    })
}

/// The bubble measured beside the schedule's on paper, from the report's
/// `pipeline` section: "measured 29.5% of the pipelined passes (…); on
/// paper (N-1)/(M+N-1) = 20.0% (N = 2, M = 4), …".
pub fn bubble_text(pl: &Value) -> String {
    let v = pl["virtual_stages"].as_u64().unwrap_or(1);
    let mut paper = vec![format!(
        "{} = {}% (N = {}, M = {}{})",
        match v {
            1 => "(N-1)/(M+N-1)",
            _ => "(N-1)/(V*M+N-1)",
        },
        num(&pl["bubble_formula_pct"]),
        num(&pl["degree"]),
        num(&pl["micro_batches"]),
        match v {
            1 => String::new(),
            v => format!(", V = {v}"),
        }
    )];
    if let Some(x) = pl["bubble_on_paper_pct"].as_f64() {
        paper.push(format!(
            "the schedule {} run on paper {x}% (backward 2x forward, equal stages)",
            pl["schedule"].as_str().unwrap_or("?")
        ));
    }
    if let Some(x) = pl["bubble_on_paper_these_stages_pct"].as_f64() {
        if Some(x) != pl["bubble_on_paper_pct"].as_f64() {
            paper.push(format!("{x}% with these stages' estimated times"));
        }
    }
    if let Some(x) = pl["bubble_stage_times_pct"].as_f64() {
        paper.push(format!(
            "{x}% with the stages' measured computation (1 - M·Σt / (N·(Σt + (M-1)·max t)))"
        ));
    }
    format!(
        "measured {}% of the pipelined passes (all ranks' time in them that computes nothing, over the counted steps; {}% of the step); on paper {}",
        num(&pl["bubble_measured_pct"]),
        num(&pl["bubble_step_pct"]),
        paper.join(", ")
    )
}

/// The slowest stage against the stages' mean, from the report's
/// `pipeline` section (`None` with one pipeline rank traced).
pub fn imbalance_text(pl: &Value) -> Option<String> {
    let i = &pl["imbalance"];
    let each: Vec<String> = pl["pipe_ranks"]
        .as_array()?
        .iter()
        .map(|r| format!("{} ms", num(&r["compute_ms"])))
        .collect();
    if each.len() < 2 {
        return None;
    }
    Some(format!(
        "the slowest, pipeline rank {} ({}), computes {} ms per step in the pipelined passes, {}% above the stages' mean {} ms (pipeline ranks in order: {})",
        num(&i["pipe_rank"]),
        i["stages"].as_str().unwrap_or("?"),
        num(&i["compute_ms"]),
        num(&i["pct"]),
        num(&i["mean_compute_ms"]),
        each.join(", ")
    ))
}

/// What shrinks a pipeline's bubble: more micro-batches, a zero-bubble or
/// interleaved schedule (from the report's `pipeline` section and the
/// run's description).
fn bubble_suggestions(pl: &Value, d: &Value) -> Vec<String> {
    let mut out = Vec::new();
    let (Some(n), Some(m)) = (pl["degree"].as_u64(), pl["micro_batches"].as_u64()) else {
        return out;
    };
    let v = pl["virtual_stages"].as_u64().unwrap_or(1);
    let paper = |v: u64, m: u64| {
        let (n, v, m) = (n as f64, v as f64, m as f64);
        (1000.0 * (n - 1.0) / (v * m + n - 1.0)).round() / 10.0
    };
    let m2 = 2 * m;
    let rows = match d["batch_per_rank"].as_u64() {
        Some(b) if b % m2 == 0 => match b / m2 {
            1 => " (1 row each)".to_string(),
            k => format!(" ({k} rows each)"),
        },
        Some(b) => format!(" (with a --batch that {m2} divides: the batch per rank is {b})"),
        None => String::new(),
    };
    let formula = match v {
        1 => "(N-1)/(M+N-1)",
        _ => "(N-1)/(V*M+N-1)",
    };
    out.push(format!(
        "more micro-batches: --micro-batches {m2}{rows} takes {formula} to {}% (now {}%); each holds its activations until its backward pass",
        paper(v, m2),
        paper(v, m)
    ));
    let zero_bubble = pl["schedule"].as_str().unwrap_or("").contains("zb");
    if !zero_bubble {
        out.push(
            "a zero-bubble schedule: --schedule zb (ZB-H1) splits each backward pass and runs the weight halves in the waits".into(),
        );
    }
    let layers = d["config"]["n_layer"].as_u64().unwrap_or(0);
    if v == 1 && layers >= 2 * n {
        out.push(match zero_bubble {
            true => "an interleaved zero-bubble schedule: --schedule interleaved-zb:2 (two stages per rank), for twice the transfers between ranks".into(),
            false => format!(
                "an interleaved schedule: --schedule interleaved:2 (two stages per rank) takes (N-1)/(V*M+N-1) to {}%, for twice the transfers between ranks",
                paper(2, m)
            ),
        });
    }
    out
}

/// What evens out the stages (from the report's `pipeline` section).
fn rebalance_suggestion(pl: &Value) -> Option<String> {
    let i = &pl["imbalance"];
    let now = pl["stage_layers"].as_str()?;
    let who = format!(
        "pipeline rank {} ({}) computes {}% above the stages' mean",
        num(&i["pipe_rank"]),
        i["stages"].as_str().unwrap_or("?"),
        num(&i["pct"])
    );
    Some(match pl["rebalanced_stage_layers"].as_str() {
        Some(new) => format!(
            "even out the stages: {who}; --stage-layers {new} (now {now}) moves a layer off it"
        ),
        None if i["layers"].as_u64() == Some(1) => format!(
            "{who} with a single layer: no layer can move off it (--stage-layers now {now}); with more layers per stage (a deeper model, or fewer stages) the head and the embeddings weigh less"
        ),
        None => format!(
            "{who}, but a layer moved onto its neighbour would make that stage the slowest (--stage-layers now {now}): more, smaller layers per stage split more evenly"
        ),
    })
}

/// Suggestions that follow from the figures.
fn suggest(a: &RunAnalysis, avg: &StepBreakdown, kind: &str, d: &Value, pl: &Value) -> Vec<String> {
    let mut out = Vec::new();
    let step = avg.total.max(1e-9);
    let strategy = d["strategy"].as_str().unwrap_or("");
    match kind {
        "stage imbalance" => {
            out.extend(rebalance_suggestion(pl));
            out.extend(bubble_suggestions(pl, d));
        }
        "pipeline bubble" => out.extend(bubble_suggestions(pl, d)),
        "load imbalance" => {
            if let Some(s) = &a.straggler {
                out.push(format!(
                    "rank {} is slow in {}: check what else runs on its cores or GPU (pinning, clocks, a noisy neighbour){}",
                    s.rank,
                    s.category,
                    if s.category == "data" {
                        "; its data source or storage may be slower"
                    } else {
                        ""
                    }
                ));
            }
        }
        "data-bound" => out.push(
            "load batches ahead of the step (more loader threads, data on faster storage, or pre-tokenised shards)".into(),
        ),
        "synchronisation-bound" => out.push(
            "ranks wait for each other: even out the work per rank, and look at the straggler section".into(),
        ),
        "communication-bound" | "network-bound" => {
            if avg.overlapped < 0.5 * avg.comm {
                out.push("most communication runs after the backward pass: smaller first buckets (--first-bucket-mb) start reductions earlier".into());
            }
            out.push("fewer, larger messages: raise --bucket-mb if many small collectives run per step".into());
            out.push("fewer bytes: --grad-comm bf16 halves them; powersgd compresses far more".into());
            out.push("more work per exchange: --accum K reduces once per K micro-batches".into());
            if strategy.contains("ZeRO-3") {
                out.push("ZeRO-3 gathers parameters twice per step: ZeRO-2 or hybrid sharding (--shard-group) move fewer bytes when memory allows".into());
            }
        }
        "idle-bound" => out.push(
            "the device waits for the host: a larger batch per rank gives each launch more work".into(),
        ),
        _ => {
            if avg.comm > 0.0 && avg.exposed_comm < 0.05 * step {
                out.push("communication is already hidden; speed comes from the computation (larger batches, fused kernels, bf16)".into());
            }
        }
    }
    if avg.exposed_comm > 0.1 * step && kind != "communication-bound" && kind != "network-bound" {
        out.push(
            "exposed communication is above 10% of the step: see the communication section".into(),
        );
    }
    out
}

fn num(v: &Value) -> String {
    match v.as_f64() {
        Some(x) => format!("{x}"),
        None => "-".into(),
    }
}

/// The straggler rule as the report states it, from its
/// `synchronisation` section (the terminal text and the HTML page alike).
pub fn straggler_rule(sync: &Value) -> String {
    format!(
        "{}a rank whose own work per step (compute, data, other host work) exceeds the other ranks' median by more than {}% of the step (and at least {} ms); failing that, a rank whose collectives take that much longer than the other ranks' median, not counting the time it waits in them for the others because its own work is shorter",
        match sync["straggler_among"].as_str() {
            Some("stage") => "under a pipeline, among the ranks of one pipeline stage (its data-parallel replicas; the stages' differing work is stage imbalance, see the pipeline section): ",
            _ => "",
        },
        num(&sync["straggler_threshold_pct"]),
        num(&sync["straggler_threshold_min_ms"]),
    )
}

/// The straggler verdict, from the report's `synchronisation` section.
pub fn straggler_verdict(sync: &Value) -> String {
    match sync["straggler"].as_object() {
        Some(st) => format!(
            "rank {} (slow in {}, {} ms per step over the other ranks' median): {}",
            num(&st["rank"]),
            st["category"].as_str().unwrap_or("?"),
            num(&st["excess_ms"]),
            st["evidence"].as_str().unwrap_or("")
        ),
        None if sync["straggler_among"] == "stage" && sync["stages_replicated"] != true => {
            "none sought: each pipeline stage runs on one rank, and ranks of different stages differ by their stages' work (stage imbalance: see the pipeline section)".into()
        }
        None => format!(
            "none (no rank's own work, nor its collectives beyond its wait for the others, exceeds the median of the other ranks{} by more than {}% of the step)",
            match sync["straggler_among"].as_str() {
                Some("stage") => " of its pipeline stage",
                _ => "",
            },
            num(&sync["straggler_threshold_pct"])
        ),
    }
}

/// The waits per rank as `rank N: ms` pairs, from the report's
/// `synchronisation` section.
pub fn waits_text(sync: &Value) -> String {
    let ranks = sync["wait_ranks"].as_array();
    sync["wait_ms_per_rank"]
        .as_array()
        .into_iter()
        .flatten()
        .enumerate()
        .map(|(i, w)| {
            let rank = ranks.and_then(|r| r.get(i)).map_or(i.to_string(), num);
            format!("rank {rank}: {}", num(w))
        })
        .collect::<Vec<_>>()
        .join(", ")
}

fn count(x: f64, one: &str, many: &str) -> String {
    format!("{x} {}", if x == 1.0 { one } else { many })
}

/// The collectives per step by what runs them, from the report's
/// `communication` section, as `braid train`'s summary counts them: "2 =
/// 1 of the training strategy (all_reduce 1) + 1 all-reduce of the step's
/// loss" (`None` without the figures).
pub fn collectives_text(comm: &Value) -> Option<String> {
    let c = &comm["collectives_per_step"];
    let total = c["per_step"].as_f64()?;
    let ops: Vec<String> = c["strategy_ops"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|o| {
            format!(
                "{} {}",
                o["op"].as_str().unwrap_or("?"),
                num(&o["per_step"])
            )
        })
        .collect();
    let norm = c["grad_norm_all_reduce_per_step"].as_f64().unwrap_or(0.0);
    // The tensor group's and the pipeline's, where there are any.
    let part = |ops: &str, per: &str, whose: &str| {
        let list: Vec<String> = c[ops]
            .as_array()
            .into_iter()
            .flatten()
            .map(|o| {
                format!(
                    "{} {}",
                    o["op"].as_str().unwrap_or("?"),
                    num(&o["per_step"])
                )
            })
            .collect();
        match list.is_empty() {
            true => String::new(),
            false => format!(" + {} {whose} ({})", num(&c[per]), list.join(", ")),
        }
    };
    let mut s = format!(
        "{total} = {} of the training strategy{}{}{}{} + {}",
        num(&c["strategy_per_step"]),
        match ops.is_empty() {
            true => String::new(),
            false => format!(" ({})", ops.join(", ")),
        },
        part(
            "tensor_ops",
            "tensor_per_step",
            "of the tensor-parallel layers"
        ),
        part("pipeline_ops", "pipeline_per_step", "of the pipeline"),
        match norm > 0.0 {
            true => format!(
                " + {}",
                count(
                    norm,
                    "all-reduce of the gradient norm",
                    "all-reduces of the gradient norm"
                )
            ),
            false => String::new(),
        },
        count(
            c["loss_all_reduce_per_step"].as_f64().unwrap_or(0.0),
            "all-reduce of the step's loss",
            "all-reduces of the step's loss"
        ),
    );
    if let (Some(mine), Some(theirs)) = (
        c["strategy_per_step"].as_f64(),
        c["summary_strategy_per_step"].as_f64(),
    ) {
        let near = |a: f64, b: f64| (a - b).abs() <= 0.01;
        if near(mine, theirs) && norm > 0.0 {
            s.push_str(&format!(
                " (braid train's summary counts the strategy's {theirs} without the gradient norm's)"
            ));
        } else if !near(mine, theirs) && !near(mine + norm, theirs) {
            s.push_str(&format!(
                " (braid train's summary counted {theirs} of the strategy's per step)"
            ));
        }
    }
    Some(s)
}

/// The pipeline's layout in words, from the report's `pipeline` section:
/// "2 pipeline ranks x tensor 1 x data 1, schedule 1f1b, 4 micro-batches".
pub fn pipeline_layout(pl: &Value) -> String {
    format!(
        "{} pipeline ranks x tensor {} x data {}, schedule {}, {} micro-batches{}",
        num(&pl["degree"]),
        num(&pl["tensor"]),
        num(&pl["data"]),
        pl["schedule"].as_str().unwrap_or("?"),
        num(&pl["micro_batches"]),
        match pl["virtual_stages"].as_u64() {
            Some(v) if v > 1 => format!(", {v} stages per rank"),
            _ => String::new(),
        }
    )
}

/// A JSON list of ranks as "0, 2".
pub fn ranks_list(v: &Value) -> String {
    v.as_array()
        .into_iter()
        .flatten()
        .map(num)
        .collect::<Vec<_>>()
        .join(", ")
}

/// The report as terminal text.
pub fn render_text(r: &Value) -> String {
    let mut o = String::new();
    let mut line = |s: String| {
        o.push_str(&s);
        o.push('\n');
    };
    let run = &r["run"];
    line("== Distributed training analysis ==".into());
    line(format!(
        "run: {} ranks ({} traced{}) | {} | model {} | {} on {} | batch {} × seq {} per rank | {} steps traced, first {} not counted",
        num(&run["ranks"]),
        num(&run["traced_ranks"]),
        match run["missing_ranks"].as_array() {
            Some(m) if !m.is_empty() => format!(", missing {m:?}"),
            _ => String::new(),
        },
        run["strategy"].as_str().unwrap_or("?"),
        run["model"].as_str().unwrap_or("?"),
        run["precision"].as_str().unwrap_or("?"),
        run["device"].as_str().unwrap_or("?"),
        num(&run["batch_per_rank"]),
        num(&run["seq"]),
        num(&run["steps_traced"]),
        num(&run["warmup_steps"]),
    ));
    let t = &r["throughput"];
    let mut tl = format!(
        "\n-- throughput --\n{} tokens/s | median step {} ms | computing {}% of the step (mean over ranks, optimizer included)",
        t["tokens_per_s"]
            .as_f64()
            .map_or("-".into(), |x| format!("{x:.0}")),
        num(&t["median_step_ms"]),
        num(&t["compute_share_pct"])
    );
    if !t["mfu_pct"].is_null() {
        tl.push_str(&format!(
            " | MFU {}% (of 989 TFLOP/s per GPU)",
            num(&t["mfu_pct"])
        ));
    }
    if let Some(g) = t["peak_device_gib"].as_f64() {
        tl.push_str(&format!(" | peak device memory {g:.2} GiB"));
    }
    line(tl);
    // Under a pipeline, its bubble is a column of its own.
    let pipelined = !r["pipeline"].is_null();
    line(format!(
        "\n-- temporal breakdown per rank (ms per counted step; as Holistic Trace Analysis: compute (optimizer included) / non-overlapped communication{} / idle) --",
        if pipelined { " / pipeline bubble (waiting for the other stages in the pipelined passes)" } else { "" }
    ));
    line(format!(
        "{:>5} {:>9} {:>14} {:>16}{} {:>9} {:>9} {:>9} {:>9} {:>12}",
        "rank",
        "step",
        "compute",
        "exposed comm",
        if pipelined {
            format!(" {:>16}", "pipeline bubble")
        } else {
            String::new()
        },
        "data",
        "other",
        "idle",
        "overlap",
        "accounted"
    ));
    for k in r["breakdown"]["ranks"].as_array().into_iter().flatten() {
        line(format!(
            "{:>5} {:>9.2} {:>8.2} {:>4.0}% {:>10.2} {:>4.0}%{} {:>9.2} {:>9.2} {:>9.2} {:>8.0}% {:>12}",
            num(&k["rank"]),
            k["step_ms"].as_f64().unwrap_or(0.0),
            k["compute_ms"].as_f64().unwrap_or(0.0),
            k["compute_pct"].as_f64().unwrap_or(0.0),
            k["exposed_comm_ms"].as_f64().unwrap_or(0.0),
            k["exposed_comm_pct"].as_f64().unwrap_or(0.0),
            if pipelined {
                format!(
                    " {:>10.2} {:>4.0}%",
                    k["bubble_ms"].as_f64().unwrap_or(0.0),
                    k["bubble_pct"].as_f64().unwrap_or(0.0)
                )
            } else {
                String::new()
            },
            k["data_ms"].as_f64().unwrap_or(0.0),
            k["other_ms"].as_f64().unwrap_or(0.0),
            k["idle_ms"].as_f64().unwrap_or(0.0),
            k["overlap_pct"].as_f64().unwrap_or(0.0),
            k["accounting_gap_pct"]
                .as_f64()
                .map_or("-".into(), |g| format!("±{g:.1}%")),
        ));
    }
    let ranks = r["breakdown"]["ranks"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    if ranks
        .iter()
        .any(|k| k["tensor_comm_ms"].as_f64().unwrap_or(0.0) > 0.0)
    {
        let each: Vec<String> = ranks
            .iter()
            .map(|k| {
                format!(
                    "rank {} {:.2} ms ({:.0}%)",
                    num(&k["rank"]),
                    k["tensor_comm_ms"].as_f64().unwrap_or(0.0),
                    k["tensor_comm_pct"].as_f64().unwrap_or(0.0)
                )
            })
            .collect();
        line(format!(
            "tensor-parallel collectives inside the passes (not in compute above), per step: {}",
            each.join(", ")
        ));
    }
    let c = &r["communication"];
    line(format!(
        "\n-- communication ({}; the table and per-operation times are rank 0's) --",
        c["backend"]
            .as_str()
            .filter(|s| !s.is_empty())
            .unwrap_or("collectives")
    ));
    line(format!(
        "{:<16} {:>8} {:>9} {:>11} {:>10} {:>12} {:>12} {:>12}",
        "operation",
        "count",
        "per step",
        "total ms",
        "mean ms",
        "bytes",
        "algbw GB/s",
        "busbw GB/s"
    ));
    for op in c["ops"].as_array().into_iter().flatten() {
        line(format!(
            "{:<16} {:>8} {:>9} {:>11.3} {:>10.3} {:>12} {:>12.3} {:>12.3}",
            op["op"].as_str().unwrap_or("?"),
            num(&op["count"]),
            num(&op["per_step"]),
            op["total_ms"].as_f64().unwrap_or(0.0),
            op["mean_ms"].as_f64().unwrap_or(0.0),
            num(&op["bytes"]),
            op["algbw_GBps"].as_f64().unwrap_or(0.0),
            op["busbw_GBps"].as_f64().unwrap_or(0.0),
        ));
    }
    if let Some(k) = collectives_text(c) {
        line(format!("rank 0's collectives per step: {k}"));
    }
    if pipelined {
        line("the pipeline's own operations (inside its passes: the transfers between stages, the loss from the last stage, the timeline's gather, the tied embeddings' sum) are in the table, not in the times in collectives below: their waits are the pipeline bubble (see the pipeline section)".into());
    }
    line(format!(
        "rank 0 per step: all-reduce {} ms, broadcast {} ms, barrier {} ms | all ranks' mean per step: time in collectives {} ms, of which exposed {} ms = communication overhead {}% of the step | overlap {}% of collective time hidden by computation",
        num(&c["all_reduce_ms_per_step"]),
        num(&c["broadcast_ms_per_step"]),
        num(&c["barrier_ms_per_step"]),
        num(&c["comm_ms_per_step"]),
        num(&c["exposed_comm_ms_per_step"]),
        num(&c["overhead_pct"]),
        num(&c["overlap_pct"]),
    ));
    if let Some(u) = c["unoverlapped_comm_ms"].as_f64() {
        line(format!(
            "the strategy's reductions run alone take {u:.2} ms per step: {}% of that hidden over all ranks (exposed time beyond it is waiting for slower ranks) | rank 0: {} ms exposed, {}% hidden (its own summary: {} ms, {}%)",
            num(&c["hidden_pct"]),
            num(&c["rank0_exposed_comm_ms"]),
            num(&c["rank0_hidden_pct"]),
            num(&c["summary_exposed_comm_ms"]),
            num(&c["summary_hidden_pct"]),
        ));
    }
    let s = &r["synchronisation"];
    line("\n-- synchronisation and stragglers --".into());
    line(format!(
        "spread of the ranks' mean step times {} ms | own-work spread {} ms ({}% of the step) | waiting per step (ms, in collectives or idle{}): {}",
        num(&s["step_spread_ms"]),
        num(&s["own_work_spread_ms"]),
        num(&s["own_work_spread_pct"]),
        if pipelined { "; the pipeline bubble apart" } else { "" },
        waits_text(s)
    ));
    line(format!("straggler rule: {}", straggler_rule(s)));
    line(format!("straggler: {}", straggler_verdict(s)));
    let pl = &r["pipeline"];
    if pipelined {
        line(format!("\n-- pipeline: {} --", pipeline_layout(pl)));
        for k in pl["pipe_ranks"].as_array().into_iter().flatten() {
            line(format!(
                "pipeline rank {} on rank{} {}: {} | computes {} ms per step in the pipelined passes | bubble {} ms ({}% of its passes)",
                num(&k["pipe_rank"]),
                if k["ranks"].as_array().map_or(0, Vec::len) > 1 { "s" } else { "" },
                ranks_list(&k["ranks"]),
                k["stages"].as_str().unwrap_or("?"),
                num(&k["compute_ms"]),
                num(&k["bubble_ms"]),
                num(&k["bubble_pct"]),
            ));
        }
        line(format!("pipeline bubble: {}", bubble_text(pl)));
        if let Some(t) = imbalance_text(pl) {
            line(format!("stage imbalance: {t}"));
        }
    }
    if let Some(points) = r["scaling"]["points"].as_array() {
        line("\n-- scaling efficiency --".into());
        for p in points {
            line(format!(
                "{} ranks: {} tokens/s (ideal {}) = {}%",
                num(&p["ranks"]),
                num(&p["tokens_per_s"]),
                num(&p["ideal_tokens_per_s"]),
                num(&p["efficiency_pct"])
            ));
        }
    }
    if let Some(b) = r["backends"].as_array().filter(|b| !b.is_empty()) {
        line("\n-- backend comparison (peak bus bandwidth) --".into());
        for s in b {
            line(format!(
                "{}: {:.2} GB/s",
                s["name"].as_str().unwrap_or("?"),
                s["peak_busbw_GBps"].as_f64().unwrap_or(0.0)
            ));
        }
    }
    for l in crate::staleness::render(&r["parameter_server"]) {
        line(l);
    }
    line(format!(
        "\n-- bottleneck: {} --",
        r["bottleneck"]["kind"].as_str().unwrap_or("?")
    ));
    for e in r["bottleneck"]["evidence"].as_array().into_iter().flatten() {
        line(format!("  {}", e.as_str().unwrap_or("")));
    }
    if let Some(sg) = r["suggestions"].as_array().filter(|s| !s.is_empty()) {
        line("\n-- suggestions --".into());
        for x in sg {
            line(format!("  - {}", x.as_str().unwrap_or("")));
        }
    }
    o
}
