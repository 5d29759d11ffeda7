//! `braid report --html`: the report as one self-contained HTML page — the
//! report's sections as headings and tables, and its figures as inline
//! SVG (the scaling curve, bus bandwidth against message size per
//! backend, step time per rank, and one step's timeline across ranks).
//! Nothing is fetched: no scripts, fonts, style sheets or images, so the
//! page opens offline and can be attached to a ticket as it is.
//!
//! Every plot is an `<svg data-plot="scaling|busbw|steps|timeline">`
//! (`scripts/report-html/check.sh` looks for them in a headless browser).

use super::svg::{self, Chart, LaneGroup, Options, Series, Timeline, XAxis};
use braid_trace::analysis;
use braid_trace::format::{RankTrace, TraceEvent};
use serde_json::Value;
use std::fmt::Write as _;

/// Line colours (Tableau 10), one per series.
const PALETTE: [&str; 10] = [
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
    "#bcbd22", "#17becf",
];
/// The timeline's rows: (name, colour).
const KINDS: [(&str, &str); 4] = [
    ("compute", "#4c78a8"),
    ("communication", "#f58518"),
    ("data", "#54a24b"),
    ("idle", "#b9b9b9"),
];
/// Ranks drawn in the timeline at most.
const TIMELINE_RANKS: usize = 16;
/// Rectangles drawn in the timeline at most (about).
const TIMELINE_RECTS: usize = 3000;
/// Plot width in pixels (they shrink with the window).
const W: f64 = 1000.0;

const CSS: &str = "body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1060px;\
padding:0 1em;color:#222;line-height:1.4}h1{margin-bottom:.2em}h2{border-bottom:1px solid #ddd;\
padding-bottom:.2em;margin-top:1.8em}table{border-collapse:collapse;margin:.6em 0}\
th,td{border:1px solid #ccc;padding:.25em .6em}th{background:#f2f2f2}td.n{text-align:right}\
table.kv th{text-align:left;font-weight:normal}\
.verdict{background:#fff8e1;border:1px solid #f0c36d;padding:.6em 1em;border-radius:4px}\
.note{color:#666;font-style:italic}svg{max-width:100%;height:auto;display:block;margin:.8em 0}\
pre{background:#f7f7f7;padding:1em;overflow-x:auto;font-size:12px}";

/// The page for report `r` (from `braid_trace::report::build`) of the run
/// traced in `traces`.
pub fn page(r: &Value, traces: &[RankTrace]) -> String {
    let mut h = String::new();
    let _ = write!(
        h,
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <title>braid report: {}</title><style>{CSS}</style></head><body>\n",
        esc(r["run"]["model"].as_str().unwrap_or("run"))
    );
    if let Some(e) = r["error"].as_str() {
        let _ = writeln!(h, "<h1>braid report</h1><p>{}</p></body></html>", esc(e));
        return h;
    }
    h.push_str(&run_section(r));
    h.push_str(&verdict_section(r));
    h.push_str(&throughput_section(r));
    h.push_str(&breakdown_section(r, traces));
    h.push_str(&communication_section(r));
    h.push_str(&synchronisation_section(r));
    h.push_str(&scaling_section(r));
    h.push_str(&backends_section(r));
    let _ = write!(
        h,
        "<h2>Text version</h2><details><summary>as <code>braid report</code> prints it</summary>\
         <pre>{}</pre></details>\n</body></html>\n",
        esc(&braid_trace::report::render_text(r))
    );
    h
}

fn esc(s: &str) -> String {
    svg::esc(s)
}

/// A number of the report, with `dec` decimals, or "–".
fn num(v: &Value, dec: usize) -> String {
    match v.as_f64() {
        Some(x) => format!("{x:.dec$}"),
        None => "–".into(),
    }
}

/// A table: header cells, then rows of cells (already HTML).
fn table(class: &str, head: &[&str], rows: &[Vec<String>]) -> String {
    let mut s = format!("<table class=\"{class}\"><tr>");
    for c in head {
        let _ = write!(s, "<th>{c}</th>");
    }
    s.push_str("</tr>\n");
    for row in rows {
        s.push_str("<tr>");
        for c in row {
            let numeric = c.starts_with(|ch: char| ch.is_ascii_digit() || "-–±".contains(ch));
            let _ = write!(
                s,
                "<td{}>{c}</td>",
                if numeric { " class=\"n\"" } else { "" }
            );
        }
        s.push_str("</tr>\n");
    }
    s.push_str("</table>\n");
    s
}

/// A two-column table of (name, value) rows, values already HTML.
fn kv(rows: &[(&str, String)]) -> String {
    let mut s = String::from("<table class=\"kv\">\n");
    for (k, v) in rows {
        let _ = writeln!(s, "<tr><th>{k}</th><td>{v}</td></tr>");
    }
    s.push_str("</table>\n");
    s
}

fn note(text: &str) -> String {
    format!("<p class=\"note\">{text}</p>\n")
}

fn text(v: &Value) -> String {
    esc(v.as_str().filter(|s| !s.is_empty()).unwrap_or("–"))
}

fn run_section(r: &Value) -> String {
    let run = &r["run"];
    let missing = match run["missing_ranks"].as_array() {
        Some(m) if !m.is_empty() => format!(
            " — <b>missing ranks {}</b>",
            esc(&serde_json::to_string(m).unwrap_or_default())
        ),
        _ => String::new(),
    };
    let mut s = String::from("<h1>Distributed training analysis</h1>\n");
    s.push_str(&kv(&[
        (
            "ranks",
            format!(
                "{} ({} traced){missing}",
                num(&run["ranks"], 0),
                num(&run["traced_ranks"], 0)
            ),
        ),
        ("strategy", text(&run["strategy"])),
        ("model", text(&run["model"])),
        (
            "precision, device",
            format!("{} on {}", text(&run["precision"]), text(&run["device"])),
        ),
        (
            "batch × sequence per rank",
            format!(
                "{} × {}",
                num(&run["batch_per_rank"], 0),
                num(&run["seq"], 0)
            ),
        ),
        (
            "steps",
            format!(
                "{} traced, the first {} not counted (warm-up)",
                num(&run["steps_traced"], 0),
                num(&run["warmup_steps"], 0)
            ),
        ),
        ("spans dropped", num(&run["dropped_spans"], 0)),
    ]));
    s
}

fn verdict_section(r: &Value) -> String {
    let b = &r["bottleneck"];
    let mut s = format!(
        "<h2>Bottleneck</h2>\n<div class=\"verdict\"><b>{}</b><ul>\n",
        text(&b["kind"])
    );
    for e in b["evidence"].as_array().into_iter().flatten() {
        let _ = writeln!(s, "<li>{}</li>", text(e));
    }
    s.push_str("</ul></div>\n<h2>Suggestions</h2>\n");
    match r["suggestions"].as_array().filter(|v| !v.is_empty()) {
        Some(list) => {
            s.push_str("<ul>\n");
            for x in list {
                let _ = writeln!(s, "<li>{}</li>", text(x));
            }
            s.push_str("</ul>\n");
        }
        None => s.push_str(&note("none: nothing in the figures calls for a change")),
    }
    s
}

fn throughput_section(r: &Value) -> String {
    let t = &r["throughput"];
    let mut rows = vec![
        ("tokens/s", num(&t["tokens_per_s"], 0)),
        (
            "median step",
            format!("{} ms", num(&t["median_step_ms"], 2)),
        ),
        (
            "computing",
            format!("{}% of the step", num(&t["compute_share_pct"], 1)),
        ),
    ];
    if !t["mfu_pct"].is_null() {
        rows.push((
            "MFU",
            format!("{}% (of 989 TFLOP/s per GPU)", num(&t["mfu_pct"], 1)),
        ));
    }
    if !t["peak_device_gib"].is_null() {
        rows.push((
            "peak device memory",
            format!("{} GiB", num(&t["peak_device_gib"], 2)),
        ));
    }
    format!("<h2>Throughput and utilisation</h2>\n{}", kv(&rows))
}

fn breakdown_section(r: &Value, traces: &[RankTrace]) -> String {
    let row = |label: String, k: &Value| {
        vec![
            label,
            num(&k["step_ms"], 2),
            format!(
                "{} ({}%)",
                num(&k["compute_ms"], 2),
                num(&k["compute_pct"], 1)
            ),
            format!(
                "{} ({}%)",
                num(&k["exposed_comm_ms"], 2),
                num(&k["exposed_comm_pct"], 1)
            ),
            num(&k["data_ms"], 2),
            num(&k["other_ms"], 2),
            format!("{} ({}%)", num(&k["idle_ms"], 2), num(&k["idle_pct"], 1)),
            format!("{}%", num(&k["overlap_pct"], 0)),
            k["accounting_gap_pct"]
                .as_f64()
                .map_or("–".into(), |g| format!("±{g:.1}%")),
        ]
    };
    let mut rows: Vec<Vec<String>> = r["breakdown"]["ranks"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|k| row(num(&k["rank"], 0), k))
        .collect();
    rows.push(row("<b>mean</b>".into(), &r["breakdown"]["mean"]));
    let mut s = String::from(
        "<h2>Time per step, per rank</h2>\n<p>Milliseconds per counted step; as Holistic Trace \
         Analysis: computation, communication not hidden by it, data loading, other host work \
         and idle time add up to the step. <i>Overlap</i>: the share of collective time hidden \
         by computation; <i>accounted</i>: the worst gap between the traced and the measured \
         step.</p>\n",
    );
    s.push_str(&table(
        "",
        &[
            "rank",
            "step",
            "compute",
            "exposed comm",
            "data",
            "other",
            "idle",
            "overlap",
            "accounted",
        ],
        &rows,
    ));
    s.push_str(&steps_plot(r));
    s.push_str(&timeline_plot(r, traces));
    s
}

fn steps_plot(r: &Value) -> String {
    let series: Vec<Series> = r["step_times"]
        .as_array()
        .into_iter()
        .flatten()
        .enumerate()
        .map(|(i, st)| Series {
            name: format!("rank {}", num(&st["rank"], 0)),
            color: PALETTE[i % PALETTE.len()],
            dashed: false,
            points: st["step_ms"]
                .as_array()
                .into_iter()
                .flatten()
                .enumerate()
                .filter_map(|(k, v)| Some((k as f64, v.as_f64()?)))
                .collect(),
        })
        .collect();
    if series.iter().all(|s| s.points.is_empty()) {
        return note("No step times in the report.");
    }
    let warmup = r["run"]["warmup_steps"].as_f64().unwrap_or(0.0);
    let chart = Chart {
        title: "Step time per rank".into(),
        x_label: "step (index in the trace)".into(),
        y_label: "step time (ms)".into(),
        series,
    };
    chart.svg_with(
        W,
        360.0,
        &Options {
            x_axis: XAxis::Linear,
            legend_outside: true,
            shade: (warmup > 0.0).then(|| (0.0, warmup - 0.5, "warm-up (not counted)".into())),
            data_plot: Some("steps"),
            tapered: true,
        },
    )
}

/// A time window (start, end), µs.
type Window = (f64, f64);

/// The step drawn in the timeline: a counted step every rank traced, the
/// one whose window (the union of the ranks' windows) has the median
/// length. Returns (step, union window, each rank's own window).
fn pick_step(traces: &[RankTrace], warmup: usize) -> Option<(u64, Window, Vec<Window>)> {
    let steps: Vec<Vec<(u64, f64, f64)>> =
        traces.iter().map(|t| analysis::steps(&t.events)).collect();
    let first = steps.first()?;
    let skip = warmup.min(first.len().saturating_sub(1));
    let mut cands: Vec<(u64, Window, Vec<Window>)> = first
        .iter()
        .skip(skip)
        .filter_map(|&(k, _, _)| {
            let own: Vec<Window> = steps
                .iter()
                .map(|s| s.iter().find(|x| x.0 == k).map(|x| (x.1, x.2)))
                .collect::<Option<_>>()?;
            let a = own.iter().map(|w| w.0).fold(f64::INFINITY, f64::min);
            let b = own.iter().map(|w| w.1).fold(f64::NEG_INFINITY, f64::max);
            Some((k, (a, b), own))
        })
        .collect();
    cands.sort_by(|x, y| {
        let len = |c: &(u64, Window, Vec<Window>)| c.1 .1 - c.1 .0;
        len(x).total_cmp(&len(y))
    });
    let mid = cands.len() / 2;
    (!cands.is_empty()).then(|| cands.swap_remove(mid))
}

/// One rank's intervals per timeline kind (µs), clipped to `(a, b)`.
fn rank_rows(t: &RankTrace, (a, b): Window) -> Vec<Vec<(f64, f64)>> {
    let gpu = analysis::on_gpu(&t.events);
    let blocks = t.events.iter().any(|e| e.cat == "compute");
    let computing = |e: &TraceEvent| {
        let c = match e.cat.as_str() {
            "compute" | "optimizer" => true,
            "pass" => !blocks,
            _ => false,
        };
        c && (!gpu || e.tid == braid_trace::recorder::track::GPU_COMPUTE)
    };
    let clip = |iv: &mut dyn Iterator<Item = (f64, f64)>| -> Vec<(f64, f64)> {
        iv.filter(|&(s, e)| e > a && s < b)
            .map(|(s, e)| (s.max(a), e.min(b)))
            .collect()
    };
    let of = |f: &dyn Fn(&TraceEvent) -> bool| {
        clip(&mut t.events.iter().filter(|e| f(e)).map(|e| (e.ts, e.end())))
    };
    let mut idle = of(&|e| e.cat == "idle");
    if !t.events.iter().any(|e| e.cat == "idle") {
        idle = clip(&mut analysis::idle_gaps(&t.events).into_iter());
    }
    vec![
        of(&computing),
        of(&|e| e.cat == "comm"),
        of(&|e| e.cat == "data"),
        idle,
    ]
}

fn timeline_plot(r: &Value, traces: &[RankTrace]) -> String {
    let warmup = r["run"]["warmup_steps"].as_u64().unwrap_or(0) as usize;
    let Some((step, (a, b), own)) = pick_step(traces, warmup) else {
        return note("No step spans in the traces: no timeline.");
    };
    let ms = |x: f64| (x - a) / 1e3;
    let groups: Vec<LaneGroup> = traces
        .iter()
        .zip(&own)
        .take(TIMELINE_RANKS)
        .map(|(t, w)| LaneGroup {
            label: format!("rank {}", t.rank),
            window: Some((ms(w.0), ms(w.1))),
            rows: rank_rows(t, (a, b))
                .into_iter()
                .map(|iv| iv.into_iter().map(|(s, e)| (ms(s), ms(e))).collect())
                .collect(),
        })
        .collect();
    let more = if traces.len() > TIMELINE_RANKS {
        note(&format!(
            "The timeline shows the first {TIMELINE_RANKS} of {} ranks.",
            traces.len()
        ))
    } else {
        String::new()
    };
    let tl = Timeline {
        title: format!(
            "Step {step} across ranks ({:.2} ms, the union of the ranks' windows)",
            ms(b)
        ),
        x_label: "ms from the step's start (grey band: the rank's own step)".into(),
        span: (0.0, ms(b)),
        kinds: KINDS.iter().map(|&(n, c)| (n.to_string(), c)).collect(),
        groups,
        max_rects: TIMELINE_RECTS,
    };
    tl.svg(W, "timeline") + &more
}

fn communication_section(r: &Value) -> String {
    let c = &r["communication"];
    let rows: Vec<Vec<String>> = c["ops"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|o| {
            vec![
                text(&o["op"]),
                num(&o["count"], 0),
                num(&o["per_step"], 2),
                num(&o["total_ms"], 3),
                num(&o["mean_ms"], 3),
                o["bytes"].as_f64().map_or("–".into(), svg::bytes_label),
                num(&o["algbw_GBps"], 3),
                num(&o["busbw_GBps"], 3),
            ]
        })
        .collect();
    let mut s = format!(
        "<h2>Communication</h2>\n<p>Backend: {}. Per operation, on rank 0:</p>\n",
        text(&c["backend"])
    );
    if rows.is_empty() {
        s.push_str(&note("No collectives ran."));
    } else {
        s.push_str(&table(
            "",
            &[
                "operation",
                "count",
                "per step",
                "total ms",
                "mean ms",
                "bytes (all)",
                "algbw GB/s",
                "busbw GB/s",
            ],
            &rows,
        ));
    }
    let ms = |k: &str| format!("{} ms", num(&c[k], 3));
    let mut facts = vec![
        ("all-reduce per step", ms("all_reduce_ms_per_step")),
        ("broadcast per step", ms("broadcast_ms_per_step")),
        ("barrier per step", ms("barrier_ms_per_step")),
        (
            "collectives per step (mean over ranks)",
            ms("comm_ms_per_step"),
        ),
        ("of which exposed", ms("exposed_comm_ms_per_step")),
        (
            "communication overhead",
            format!("{}% of the step", num(&c["overhead_pct"], 1)),
        ),
        (
            "overlap",
            format!(
                "{}% of collective time hidden by computation",
                num(&c["overlap_pct"], 1)
            ),
        ),
    ];
    if !c["unoverlapped_comm_ms"].is_null() {
        facts.push(("the same reductions run alone", ms("unoverlapped_comm_ms")));
        facts.push((
            "hidden against that",
            format!("{}%", num(&c["hidden_pct"], 1)),
        ));
        facts.push((
            "the run's own summary: exposed",
            ms("summary_exposed_comm_ms"),
        ));
    }
    if let Some(b) = c["wire_bytes_per_step"].as_f64() {
        facts.push(("bytes sent per rank per step", svg::bytes_label(b)));
    }
    s.push_str(&kv(&facts));
    s
}

fn synchronisation_section(r: &Value) -> String {
    let y = &r["synchronisation"];
    let waits: Vec<String> = y["wait_ms_per_rank"]
        .as_array()
        .into_iter()
        .flatten()
        .enumerate()
        .map(|(i, w)| format!("rank {i}: {}", num(w, 2)))
        .collect();
    let straggler = match y["straggler"].as_object() {
        Some(st) => format!(
            "rank {} (slow in {}, {} ms per step over the median rank): {}",
            num(&st["rank"], 0),
            text(&st["category"]),
            num(&st["excess_ms"], 2),
            text(&st["evidence"])
        ),
        None => "none (no rank's work stands out by more than 5% of the step)".into(),
    };
    format!(
        "<h2>Synchronisation and stragglers</h2>\n{}",
        kv(&[
            (
                "step-time spread across ranks",
                format!("{} ms", num(&y["step_spread_ms"], 3))
            ),
            (
                "own-work spread",
                format!(
                    "{} ms ({}% of the step)",
                    num(&y["own_work_spread_ms"], 3),
                    num(&y["own_work_spread_pct"], 1)
                ),
            ),
            ("waiting per step (ms)", waits.join(", ")),
            ("straggler", straggler),
        ])
    )
}

fn scaling_section(r: &Value) -> String {
    let mut s = String::from("<h2>Scaling efficiency</h2>\n");
    let Some(points) = r["scaling"]["points"].as_array().filter(|p| !p.is_empty()) else {
        s.push_str(&note(
            "No scaling curve: add the trace directories of the same model at other world \
             sizes with <code>--compare DIR</code> (e.g. <code>braid report tr4 --compare tr1 \
             --compare tr2</code>).",
        ));
        return s;
    };
    let pts = |key: &str| -> Vec<(f64, f64)> {
        points
            .iter()
            .filter_map(|p| Some((p["ranks"].as_f64()?, p[key].as_f64()?)))
            .collect()
    };
    let last = points.last().expect("non-empty");
    let chart = Chart {
        title: format!(
            "Scaling: {}% efficiency at {} ranks (against {})",
            num(&last["efficiency_pct"], 1),
            num(&last["ranks"], 0),
            num(&r["scaling"]["baseline_ranks"], 0)
        ),
        x_label: "ranks".into(),
        y_label: "tokens/s".into(),
        series: vec![
            Series {
                name: "measured".into(),
                color: PALETTE[0],
                dashed: false,
                points: pts("tokens_per_s"),
            },
            Series {
                name: "ideal (linear)".into(),
                color: "#888888",
                dashed: true,
                points: pts("ideal_tokens_per_s"),
            },
        ],
    };
    s.push_str(&chart.svg_with(
        W,
        380.0,
        &Options {
            legend_outside: true,
            data_plot: Some("scaling"),
            ..Default::default()
        },
    ));
    let rows: Vec<Vec<String>> = points
        .iter()
        .map(|p| {
            vec![
                num(&p["ranks"], 0),
                num(&p["tokens_per_s"], 0),
                num(&p["ideal_tokens_per_s"], 0),
                format!("{}%", num(&p["efficiency_pct"], 1)),
            ]
        })
        .collect();
    s.push_str(&table(
        "",
        &["ranks", "tokens/s", "ideal", "efficiency"],
        &rows,
    ));
    s
}

fn backends_section(r: &Value) -> String {
    let mut s = String::from("<h2>Backend comparison</h2>\n");
    let Some(list) = r["backends"].as_array().filter(|b| !b.is_empty()) else {
        s.push_str(&note(
            "No backend comparison: add <code>--bench FILE</code> with files from <code>braid \
             bench OP --json FILE</code> (one per backend, e.g. <code>--backend shm</code> and \
             <code>--backend tcp</code>).",
        ));
        return s;
    };
    let series: Vec<Series> = list
        .iter()
        .enumerate()
        .map(|(i, b)| Series {
            name: b["name"].as_str().unwrap_or("?").to_string(),
            color: PALETTE[i % PALETTE.len()],
            dashed: false,
            points: b["points"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|p| Some((p[0].as_f64()?, p[1].as_f64()?)))
                .filter(|p| p.0 > 0.0)
                .collect(),
        })
        .collect();
    let chart = Chart {
        title: "Bus bandwidth against message size".into(),
        x_label: "message size (bytes, log2)".into(),
        y_label: "bus bandwidth (GB/s)".into(),
        series,
    };
    s.push_str(&chart.svg_with(
        W,
        400.0,
        &Options {
            x_axis: XAxis::Log2Bytes,
            legend_outside: true,
            data_plot: Some("busbw"),
            ..Default::default()
        },
    ));
    let rows: Vec<Vec<String>> = list
        .iter()
        .map(|b| {
            vec![
                text(&b["name"]),
                text(&b["backend"]),
                text(&b["op"]),
                num(&b["ranks"], 0),
                num(&b["peak_busbw_GBps"], 3),
            ]
        })
        .collect();
    s.push_str(&table(
        "",
        &["series", "backend", "operation", "ranks", "peak busbw GB/s"],
        &rows,
    ));
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use braid_trace::clock::ClockOffset;
    use serde_json::json;

    fn ev(rank: usize, tid: u32, cat: &str, ts: f64, dur: f64, step: Option<u64>) -> TraceEvent {
        let mut args = serde_json::Map::new();
        if let Some(k) = step {
            args.insert("step".into(), json!(k));
        }
        TraceEvent {
            pid: rank as u32,
            tid,
            name: cat.into(),
            cat: cat.into(),
            ts,
            dur,
            args,
        }
    }

    /// A rank with steps 0..3 of 1 ms each: compute, then an all-reduce.
    fn trace(rank: usize, extra: Vec<TraceEvent>) -> RankTrace {
        let mut events = Vec::new();
        for k in 0..3u64 {
            let t0 = 1e9 + k as f64 * 1000.0 + rank as f64 * 5.0;
            events.push(ev(rank, 1, "step", t0, 1000.0, Some(k)));
            events.push(ev(rank, 1, "data", t0, 50.0, None));
            events.push(ev(rank, 1, "compute", t0 + 50.0, 600.0, None));
            events.push(ev(rank, 2, "comm", t0 + 650.0, 300.0, None));
            events.push(ev(rank, 20, "idle", t0 + 950.0, 50.0, None));
        }
        events.extend(extra);
        events.sort_by(|a, b| a.ts.total_cmp(&b.ts));
        RankTrace {
            rank,
            world_size: 2,
            clock: ClockOffset {
                offset_us: 0.0,
                rtt_us: 10.0,
            },
            dropped: 0,
            run: Value::Null,
            events,
        }
    }

    fn report() -> Value {
        json!({
            "run": {"ranks": 2, "traced_ranks": 2, "missing_ranks": [], "strategy": "data parallel",
                    "model": "tiny <m>", "precision": "f32", "device": "cpu", "batch_per_rank": 4,
                    "seq": 16, "steps_traced": 3, "warmup_steps": 1, "dropped_spans": 0},
            "throughput": {"tokens_per_s": 1000.0, "median_step_ms": 1.0, "compute_share_pct": 60.0},
            "breakdown": {"mean": {"step_ms": 1.0, "compute_ms": 0.6, "compute_pct": 60.0},
                          "ranks": [{"rank": 0, "step_ms": 1.0}, {"rank": 1, "step_ms": 1.0}]},
            "step_times": [{"rank": 0, "step_ms": [2.0, 1.0, 1.0]}, {"rank": 1, "step_ms": [2.0, 1.1, 1.0]}],
            "communication": {"backend": "shm", "ops": [{"op": "all_reduce", "count": 3, "bytes": 4096}]},
            "synchronisation": {"step_spread_ms": 0.01, "wait_ms_per_rank": [0.3, 0.3], "straggler": null},
            "scaling": {"baseline_ranks": 1, "points": [
                {"ranks": 1, "tokens_per_s": 600.0, "ideal_tokens_per_s": 600.0, "efficiency_pct": 100.0},
                {"ranks": 2, "tokens_per_s": 1000.0, "ideal_tokens_per_s": 1200.0, "efficiency_pct": 83.3}]},
            "backends": [{"name": "shm all_reduce ×2", "backend": "shm", "op": "all_reduce", "ranks": 2,
                          "points": [[1024, 0.1], [65536, 1.5], [4194304, 3.0]], "peak_busbw_GBps": 3.0}],
            "bottleneck": {"kind": "compute-bound", "evidence": ["a & b"]},
            "suggestions": ["<script>alert(1)</script>"],
        })
    }

    fn plot<'a>(page: &'a str, name: &str) -> &'a str {
        let at = page
            .find(&format!("<svg data-plot=\"{name}\""))
            .unwrap_or_else(|| panic!("no {name} plot"));
        let end = at + page[at..].find("</svg>").expect("closed");
        &page[at..end]
    }

    #[test]
    fn pages_hold_four_plots_escape_text_and_fetch_nothing() {
        let p = page(&report(), &[trace(0, vec![]), trace(1, vec![])]);
        for name in ["scaling", "busbw", "steps", "timeline"] {
            let svg = plot(&p, name);
            assert!(
                svg.contains("<polyline") || svg.contains("<rect x"),
                "{name} is empty"
            );
        }
        assert!(plot(&p, "busbw").contains(">64K<"));
        assert!(plot(&p, "scaling").contains("stroke-dasharray"));
        // 2 ranks × (compute, comm, data, idle) in step 1.
        assert!(plot(&p, "timeline").matches("<g fill").count() == 8);
        assert!(!p.contains("<script>"));
        assert!(p.contains("&lt;script&gt;alert(1)&lt;/script&gt;"));
        assert!(p.contains("tiny &lt;m&gt;") && p.contains("a &amp; b"));
        assert!(!p.contains("src=") && !p.contains("href="));
        assert!(!p.contains("http://") && !p.contains("https://") && !p.contains("url("));
    }

    #[test]
    fn missing_sections_say_how_to_get_them() {
        let mut r = report();
        r["scaling"] = Value::Null;
        r["backends"] = json!([]);
        let p = page(&r, &[trace(0, vec![])]);
        assert!(!p.contains("data-plot=\"scaling\"") && p.contains("--compare DIR"));
        assert!(!p.contains("data-plot=\"busbw\"") && p.contains("--bench FILE"));
        assert!(p.contains("data-plot=\"timeline\""));
    }

    #[test]
    fn gpu_ranks_compute_on_the_gpu_stream_only() {
        let t0 = 1e9 + 1000.0;
        let gpu = vec![ev(0, 10, "compute", t0 + 100.0, 200.0, None)];
        let rows = rank_rows(&trace(0, gpu), (t0, t0 + 1000.0));
        assert_eq!(rows[0], vec![(t0 + 100.0, t0 + 300.0)]);
        assert_eq!(rows[1], vec![(t0 + 650.0, t0 + 950.0)]);
        assert_eq!(rows[3], vec![(t0 + 950.0, t0 + 1000.0)]);
        let (step, w, own) = pick_step(&[trace(0, vec![]), trace(1, vec![])], 1).unwrap();
        assert!(step >= 1 && w.0 == own[0].0 && w.1 == own[1].1);
    }

    #[test]
    fn timelines_of_big_traces_stay_small() {
        // 100k tiny events on each rank, in step 1, at 400 places about
        // two pixels apart in each category: more rects than the budget
        // unless merged further.
        let tiny = |rank: usize| -> Vec<TraceEvent> {
            (0..100_000)
                .map(|i| {
                    let cat = ["compute", "comm", "data", "idle"][i % 4];
                    let slot = (i / 4 * 7919) % 400;
                    ev(rank, 1, cat, 1e9 + 1000.0 + slot as f64 * 2.5, 0.1, None)
                })
                .collect()
        };
        let traces = [trace(0, tiny(0)), trace(1, tiny(1))];
        let tl = timeline_plot(&report(), &traces);
        let rects = tl.matches("<rect").count();
        assert!(rects <= TIMELINE_RECTS + 20, "{rects} rects");
        assert!(tl.len() < 400_000, "{} bytes", tl.len());
    }
}
