//! `braid report --html`: the report as one self-contained HTML page — the
//! report's sections as headings and tables (under a pipeline, its own:
//! the bubble measured beside the schedule's on paper, the stages'
//! computation and their imbalance), and its figures as inline
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
use braid_trace::report;
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
    h.push_str(&pipeline_section(r));
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

/// Bytes in decimal megabytes, as `braid train`'s summary states them
/// ("0.72 MB"); under 10 kB in bytes.
fn megabytes(b: f64) -> String {
    if b < 1e4 {
        format!("{b:.0} B")
    } else {
        format!("{:.2} MB", b / 1e6)
    }
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
            format!(
                "{}% of the step (mean over ranks, optimizer included)",
                num(&t["compute_share_pct"], 1)
            ),
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
    // Under a pipeline, its bubble is a column of its own.
    let pipelined = !r["pipeline"].is_null();
    let row = |label: String, k: &Value| {
        let mut cells = vec![
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
        ];
        if pipelined {
            cells.push(format!(
                "{} ({}%)",
                num(&k["bubble_ms"], 2),
                num(&k["bubble_pct"], 1)
            ));
        }
        cells.extend([
            num(&k["data_ms"], 2),
            num(&k["other_ms"], 2),
            format!("{} ({}%)", num(&k["idle_ms"], 2), num(&k["idle_pct"], 1)),
            format!("{}%", num(&k["overlap_pct"], 0)),
            k["accounting_gap_pct"]
                .as_f64()
                .map_or("–".into(), |g| format!("±{g:.1}%")),
        ]);
        cells
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
         Analysis: computation (the optimizer included), communication not hidden by it, data \
         loading, other host work and idle time add up to the step. <i>Overlap</i>: the share of collective time hidden \
         by computation; <i>accounted</i>: the worst gap between the traced and the measured \
         step.</p>\n",
    );
    if pipelined {
        s.push_str(
            "<p>Under the pipeline, the <i>pipeline bubble</i> is a part of its own: the time in a \
             rank's pipelined passes that it computes nothing, waiting for the other stages (in the \
             receives between stages and the step's last exchanges). Exposed communication is the \
             collectives outside those passes.</p>\n",
        );
    }
    let mut head = vec!["rank", "step", "compute", "exposed comm"];
    if pipelined {
        head.push("pipeline bubble");
    }
    head.extend(["data", "other", "idle", "overlap", "accounted"]);
    s.push_str(&table("", &head, &rows));
    s.push_str(&steps_plot(r, traces));
    s.push_str(&timeline_plot(r, traces));
    s
}

/// Dash patterns of the step plot's ranks (with [`PALETTE`] and
/// [`MARKERS`], a rank's line stays told apart where it crosses others).
const DASHES: [&str; 4] = ["", "7 3", "2 2", "9 3 2 3"];
/// Marker shapes of the step plot's ranks.
const MARKERS: [Marker; 5] = [
    Marker::Circle,
    Marker::Square,
    Marker::Up,
    Marker::Diamond,
    Marker::Down,
];
/// Markers drawn per rank and panel, at most (evenly spread).
const MARKS_PER_LINE: usize = 40;
/// Ranks drawn in the legend at most (then "+N more").
const STEPS_LEGEND: usize = 12;

#[derive(Clone, Copy)]
enum Marker {
    Circle,
    Square,
    Up,
    Diamond,
    Down,
}

impl Marker {
    /// The marker at (x, y) in `color`.
    fn svg(self, x: f64, y: f64, color: &str) -> String {
        let r = 3.6;
        let poly = |pts: &[(f64, f64)]| {
            let p: Vec<String> = pts
                .iter()
                .map(|(dx, dy)| format!("{:.1},{:.1}", x + dx, y + dy))
                .collect();
            format!("<polygon points=\"{}\" fill=\"{color}\"/>", p.join(" "))
        };
        match self {
            Marker::Circle => {
                format!("<circle cx=\"{x:.1}\" cy=\"{y:.1}\" r=\"{r}\" fill=\"{color}\"/>")
            }
            Marker::Square => format!(
                "<rect x=\"{:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"{color}\"/>",
                x - r * 0.85,
                y - r * 0.85,
                r * 1.7,
                r * 1.7
            ),
            Marker::Up => poly(&[(0.0, -r * 1.15), (r, r * 0.75), (-r, r * 0.75)]),
            Marker::Down => poly(&[(0.0, r * 1.15), (r, -r * 0.75), (-r, -r * 0.75)]),
            Marker::Diamond => poly(&[(0.0, -r * 1.2), (r, 0.0), (0.0, r * 1.2), (-r, 0.0)]),
        }
    }
}

/// One rank's line in the step plot: its style and its counted steps as
/// (step number as `braid train` prints it, ms).
struct RankLine {
    name: String,
    color: &'static str,
    dash: &'static str,
    marker: Marker,
    points: Vec<(f64, f64)>,
}

/// Whole multiples of a "nice" step over `[lo, hi]` (about `n` of them).
fn ticks(lo: f64, hi: f64, n: f64) -> (f64, Vec<f64>) {
    let st = svg::tick_step((hi - lo).max(1e-9), n);
    let (k0, k1) = (
        (lo / st + 1e-9).floor() as i64,
        (hi / st - 1e-9).ceil() as i64,
    );
    (st, (k0..=k1).map(|k| k as f64 * st).collect())
}

/// Step time per rank over the counted steps (the warm-up steps, which
/// the analysis leaves out, are left out here too and named in the
/// caption), and under it each rank's difference from the median across
/// ranks at each step: in a synchronous run every rank waits for the
/// others, so the step times coincide and only the differences tell the
/// ranks apart. Each rank has its own colour, dash pattern and marker.
fn steps_plot(r: &Value, traces: &[RankTrace]) -> String {
    let warmup = r["run"]["warmup_steps"].as_u64().unwrap_or(0) as usize;
    let mut lines: Vec<RankLine> = Vec::new();
    let mut warm_max = f64::NEG_INFINITY;
    // The warm-up steps left out: how many, and their numbers.
    let (mut warm_n, mut warm_steps) = (0, (u64::MAX, 0));
    for (i, st) in r["step_times"].as_array().into_iter().flatten().enumerate() {
        let times: Vec<f64> = st["step_ms"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_f64)
            .collect();
        // The trace's step numbers (0-based) where they can be read; braid
        // train prints them from 1.
        let numbers: Vec<u64> = traces
            .iter()
            .find(|t| Some(t.rank as u64) == st["rank"].as_u64())
            .map(|t| analysis::steps(&t.events).iter().map(|s| s.0).collect())
            .filter(|n: &Vec<u64>| n.len() == times.len())
            .unwrap_or_else(|| (0..times.len() as u64).collect());
        // As the analysis: the first `warmup`, fewer if the run is short.
        let warm = warmup.min(times.len().saturating_sub(1));
        warm_n = warm_n.max(warm);
        for (&k, &t) in numbers[..warm].iter().zip(&times[..warm]) {
            warm_max = warm_max.max(t);
            warm_steps = (warm_steps.0.min(k + 1), warm_steps.1.max(k + 1));
        }
        lines.push(RankLine {
            name: format!("rank {}", num(&st["rank"], 0)),
            color: PALETTE[i % PALETTE.len()],
            dash: DASHES[i % DASHES.len()],
            marker: MARKERS[i % MARKERS.len()],
            points: numbers[warm..]
                .iter()
                .zip(&times[warm..])
                .map(|(&k, &t)| ((k + 1) as f64, t))
                .collect(),
        });
    }
    let all: Vec<(f64, f64)> = lines.iter().flat_map(|l| l.points.clone()).collect();
    if all.is_empty() {
        return note("No step times in the report.");
    }
    // Each step's median across ranks, and each rank's difference from it.
    let mut by_step: std::collections::BTreeMap<u64, Vec<f64>> = Default::default();
    for &(k, t) in &all {
        by_step.entry(k as u64).or_default().push(t);
    }
    let med: std::collections::BTreeMap<u64, f64> = by_step
        .into_iter()
        .map(|(k, mut v)| {
            v.sort_by(f64::total_cmp);
            let n = v.len();
            (
                k,
                if n % 2 == 1 {
                    v[n / 2]
                } else {
                    0.5 * (v[n / 2 - 1] + v[n / 2])
                },
            )
        })
        .collect();
    let diffs: Vec<Vec<(f64, f64)>> = lines
        .iter()
        .map(|l| {
            l.points
                .iter()
                .map(|&(k, t)| (k, t - med[&(k as u64)]))
                .collect()
        })
        .collect();
    let spread = med
        .keys()
        .map(|k| {
            let v: Vec<f64> = all
                .iter()
                .filter(|p| p.0 as u64 == *k)
                .map(|p| p.1)
                .collect();
            v.iter().cloned().fold(f64::MIN, f64::max) - v.iter().cloned().fold(f64::MAX, f64::min)
        })
        .fold(0.0, f64::max);
    let (x0, x1) = (
        all.iter().map(|p| p.0).fold(f64::INFINITY, f64::min),
        all.iter().map(|p| p.0).fold(f64::NEG_INFINITY, f64::max),
    );
    let counted = (x0, x1);
    let (x0, x1) = if x1 > x0 {
        (x0, x1)
    } else {
        (x0 - 1.0, x1 + 1.0)
    };
    let y_max = all.iter().map(|p| p.1).fold(0.0, f64::max);
    let d_max = diffs
        .iter()
        .flatten()
        .map(|p| p.1.abs())
        .fold(0.0, f64::max)
        .max(1e-3);
    let several = lines.len() > 1;

    // Layout: the step-time panel, then (several ranks) the differences.
    let legend_w = 130.0;
    let (l, rr) = (80.0, 30.0 + legend_w);
    let (a_top, a_h, gap, b_h) = (56.0, 250.0, 58.0, 170.0);
    let b_top = a_top + a_h + gap;
    let bottom = if several { b_top + b_h } else { a_top + a_h };
    let h = bottom + 56.0;
    let px = |x: f64| l + (x - x0) / (x1 - x0) * (W - l - rr);
    let warm_text = match warm_steps {
        (a, b) if a > b => String::new(),
        (a, b) if a == b => format!("; warm-up step {a} left out"),
        (a, b) => format!("; warm-up steps {a}–{b} left out"),
    };
    let title = format!(
        "Step time per rank, counted steps {}–{}{warm_text}",
        counted.0, counted.1
    );
    let mut s = format!(
        "<svg data-plot=\"steps\" role=\"img\" width=\"{W}\" height=\"{h}\" viewBox=\"0 0 {W} {h}\" \
         font-family=\"sans-serif\" font-size=\"12\">\n<title>{}</title>\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{:.1}\" y=\"22\" text-anchor=\"middle\" font-size=\"15\">{}</text>\n",
        esc(&title),
        W / 2.0,
        esc(&title)
    );
    // One panel: y ticks and grid over [lo, hi], its lines, its frame.
    let panel = |s: &mut String,
                 name: &str,
                 label: &str,
                 top: f64,
                 ph: f64,
                 lo: f64,
                 hi: f64,
                 data: &[Vec<(f64, f64)>]| {
        let py = |y: f64| top + (1.0 - (y - lo) / (hi - lo)) * ph;
        let _ = writeln!(s, "<g data-panel=\"{name}\">");
        let (st, ys) = ticks(lo, hi, 5.0);
        for y in ys
            .into_iter()
            .filter(|y| *y >= lo - st * 1e-6 && *y <= hi + st * 1e-6)
        {
            let yy = py(y);
            let _ = writeln!(
                s,
                "<line x1=\"{l}\" y1=\"{yy:.1}\" x2=\"{:.1}\" y2=\"{yy:.1}\" stroke=\"{}\"/>\
                 <text class=\"tick\" data-y=\"{y}\" x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>",
                W - rr,
                if y.abs() < st * 1e-6 && lo < 0.0 { "#999" } else { "#ddd" },
                l - 6.0,
                yy + 4.0,
                svg::label(y)
            );
        }
        let _ = writeln!(
            s,
            "<text transform=\"translate(18 {:.1}) rotate(-90)\" text-anchor=\"middle\">{}</text>",
            top + ph / 2.0,
            esc(label)
        );
        for (i, (line, pts)) in lines.iter().zip(data).enumerate() {
            let path: Vec<String> = pts
                .iter()
                .map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y)))
                .collect();
            let dash = match line.dash {
                "" => String::new(),
                d => format!(" stroke-dasharray=\"{d}\""),
            };
            let _ = writeln!(
                s,
                "<polyline points=\"{}\" fill=\"none\" stroke=\"{}\" stroke-width=\"1.8\"{dash}/>",
                path.join(" "),
                line.color
            );
            // Every k-th point, each rank from its own offset: markers of
            // coinciding lines fall side by side.
            let every = pts.len().div_ceil(MARKS_PER_LINE).max(1);
            for &(x, y) in pts.iter().skip(i % every).step_by(every) {
                s.push_str(&line.marker.svg(px(x), py(y), line.color));
                s.push('\n');
            }
        }
        let _ = writeln!(
            s,
            "<line x1=\"{l}\" y1=\"{:.1}\" x2=\"{:.1}\" y2=\"{:.1}\" stroke=\"black\"/>\
             <line x1=\"{l}\" y1=\"{top}\" x2=\"{l}\" y2=\"{:.1}\" stroke=\"black\"/>\n</g>",
            top + ph,
            W - rr,
            top + ph,
            top + ph
        );
    };
    let (_, a_ticks) = ticks(0.0, y_max.max(1e-3), 5.0);
    let a_hi = a_ticks.last().copied().unwrap_or(1.0).max(1e-3);
    let times: Vec<Vec<(f64, f64)>> = lines.iter().map(|l| l.points.clone()).collect();
    panel(
        &mut s,
        "step-time",
        "step time (ms)",
        a_top,
        a_h,
        0.0,
        a_hi,
        &times,
    );
    if several {
        let (_, b_ticks) = ticks(0.0, d_max, 3.0);
        let b_hi = b_ticks.last().copied().unwrap_or(d_max);
        let _ = writeln!(
            s,
            "<text x=\"{l}\" y=\"{:.1}\">each rank's step time minus the median across ranks at that step (ms)</text>",
            b_top - 8.0
        );
        panel(
            &mut s,
            "difference",
            "difference (ms)",
            b_top,
            b_h,
            -b_hi,
            b_hi,
            &diffs,
        );
    }
    // x ticks under the last panel, at whole steps.
    let xst = svg::tick_step(x1 - x0, 8.0).max(1.0).round();
    let (k0, k1) = ((x0 / xst).ceil() as i64, (x1 / xst).floor() as i64);
    for x in (k0..=k1).map(|k| k as f64 * xst) {
        let _ = writeln!(
            s,
            "<line x1=\"{0:.1}\" y1=\"{bottom:.1}\" x2=\"{0:.1}\" y2=\"{1:.1}\" stroke=\"#999\"/>\
             <text class=\"tick\" x=\"{0:.1}\" y=\"{2:.1}\" text-anchor=\"middle\">{3}</text>",
            px(x),
            bottom + 5.0,
            bottom + 20.0,
            svg::label(x)
        );
    }
    let _ = writeln!(
        s,
        "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">step (numbered as braid train prints them, from 1)</text>",
        (l + W - rr) / 2.0,
        h - 14.0
    );
    // Legend: colour, dash and marker per rank.
    let lx = W - rr + 14.0;
    for (i, line) in lines.iter().enumerate() {
        let ly = a_top + 10.0 + 18.0 * i as f64;
        if i == STEPS_LEGEND && lines.len() > STEPS_LEGEND {
            let _ = writeln!(
                s,
                "<text x=\"{lx:.1}\" y=\"{:.1}\">+{} more</text>",
                ly + 4.0,
                lines.len() - i
            );
            break;
        }
        let dash = match line.dash {
            "" => String::new(),
            d => format!(" stroke-dasharray=\"{d}\""),
        };
        let _ = writeln!(
            s,
            "<line x1=\"{lx:.1}\" y1=\"{ly:.1}\" x2=\"{:.1}\" y2=\"{ly:.1}\" stroke=\"{}\" stroke-width=\"1.8\"{dash}/>{}\
             <text x=\"{:.1}\" y=\"{:.1}\">{}</text>",
            lx + 32.0,
            line.color,
            line.marker.svg(lx + 16.0, ly, line.color),
            lx + 38.0,
            ly + 4.0,
            esc(&line.name)
        );
    }
    s.push_str("</svg>\n");
    // The caption: what is left out, and whether the lines coincide.
    let mut cap = String::from("Counted steps only");
    if warm_n > 0 {
        let _ = write!(
            cap,
            ": the first {warm_n} step{} (warm-up, not counted by the analysis either; up to {:.2} ms) {} left out, so the axis covers the counted steps",
            if warm_n == 1 { "" } else { "s" },
            warm_max,
            if warm_n == 1 { "is" } else { "are" }
        );
    }
    cap.push('.');
    if several {
        let y_per_px = a_hi / a_h;
        if spread <= 2.0 * y_per_px {
            let _ = write!(
                cap,
                " The ranks' step times coincide (at any step they differ by at most {spread:.3} ms, \
                 under a pixel or two: each rank waits for the others in the step's collectives), so \
                 their lines lie on one another; the lower panel tells them apart: each rank's \
                 difference from the median across ranks."
            );
        } else {
            let _ = write!(
                cap,
                " At any step the ranks' step times differ by at most {spread:.3} ms; the lower \
                 panel shows each rank's difference from the median across ranks."
            );
        }
    }
    s + &note(&cap)
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
            "Step {} across ranks (as braid train numbers it; trace span \"step {step}\"; {:.2} ms, the union of the ranks' windows)",
            step + 1,
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
                o["bytes"].as_f64().map_or("–".into(), megabytes),
                num(&o["algbw_GBps"], 3),
                num(&o["busbw_GBps"], 3),
            ]
        })
        .collect();
    let mut s = format!(
        "<h2>Communication</h2>\n<p>Backend: {}. Per operation, on rank 0, over the counted steps:</p>\n",
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
                "bytes (all counted)",
                "algbw GB/s",
                "busbw GB/s",
            ],
            &rows,
        ));
    }
    let ms = |k: &str| format!("{} ms", num(&c[k], 3));
    let mut facts = Vec::new();
    if let Some(k) = report::collectives_text(c) {
        facts.push(("collectives per step (rank 0)", esc(&k)));
    }
    facts.extend([
        (
            "all-reduce time per step (rank 0)",
            ms("all_reduce_ms_per_step"),
        ),
        (
            "broadcast time per step (rank 0)",
            ms("broadcast_ms_per_step"),
        ),
        ("barrier time per step (rank 0)", ms("barrier_ms_per_step")),
        (
            "time in collectives per step (mean over ranks)",
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
    ]);
    if !c["unoverlapped_comm_ms"].is_null() {
        facts.push((
            "the strategy's reductions run alone",
            format!("{} per step", ms("unoverlapped_comm_ms")),
        ));
        facts.push((
            "hidden against that (mean over ranks)",
            format!(
                "{}% (exposed time beyond the reductions' own is waiting for slower ranks)",
                num(&c["hidden_pct"], 1)
            ),
        ));
        facts.push((
            "rank 0: exposed, hidden",
            format!(
                "{}, {}% (its own summary: {}, {}%)",
                ms("rank0_exposed_comm_ms"),
                num(&c["rank0_hidden_pct"], 1),
                ms("summary_exposed_comm_ms"),
                num(&c["summary_hidden_pct"], 1)
            ),
        ));
    }
    if let Some(b) = c["wire_bytes_per_step"].as_f64() {
        facts.push(("bytes sent per rank per step", megabytes(b)));
    }
    s.push_str(&kv(&facts));
    s
}

fn synchronisation_section(r: &Value) -> String {
    let y = &r["synchronisation"];
    // The same sentences as the text report's, from the same figures.
    let waits = esc(&report::waits_text(y));
    let rule = esc(&report::straggler_rule(y));
    let straggler = esc(&report::straggler_verdict(y));
    format!(
        "<h2>Synchronisation and stragglers</h2>\n{}",
        kv(&[
            (
                "spread of the ranks' mean step times",
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
            (
                match r["pipeline"].is_null() {
                    true => "waiting per step (ms, in collectives or idle)",
                    false =>
                        "waiting per step (ms, in collectives or idle; the pipeline bubble apart)",
                },
                waits
            ),
            ("straggler rule", rule),
            ("straggler", straggler),
        ])
    )
}

/// The pipeline's section (nothing without a pipeline): the stages per
/// pipeline rank with their computation and bubble, the bubble measured
/// beside the schedule's on paper, the stage imbalance — the text
/// report's sentences, from the same figures.
fn pipeline_section(r: &Value) -> String {
    let pl = &r["pipeline"];
    if pl.is_null() {
        return String::new();
    }
    let mut s = format!(
        "<h2>Pipeline</h2>\n<p>Layout: {}. The <i>pipeline bubble</i>: the time in a rank's pipelined \
         passes (every stage's forward and backward passes of every micro-batch and the transfers \
         between them) that it computes nothing, waiting for the other stages.</p>\n",
        esc(&report::pipeline_layout(pl))
    );
    let rows: Vec<Vec<String>> = pl["pipe_ranks"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|k| {
            vec![
                num(&k["pipe_rank"], 0),
                text(&k["stages"]),
                esc(&report::ranks_list(&k["ranks"])),
                num(&k["compute_ms"], 2),
                format!(
                    "{} ({}%)",
                    num(&k["bubble_ms"], 2),
                    num(&k["bubble_pct"], 1)
                ),
            ]
        })
        .collect();
    s.push_str(&table(
        "",
        &[
            "pipeline rank",
            "stages",
            "ranks",
            "computes (ms per step)",
            "bubble (ms per step, % of its passes)",
        ],
        &rows,
    ));
    let mut facts = vec![("pipeline bubble", esc(&report::bubble_text(pl)))];
    if let Some(t) = report::imbalance_text(pl) {
        facts.push(("stage imbalance", esc(&t)));
    }
    s.push_str(&kv(&facts));
    s
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

    /// The numbers X of "more than X% of the step" in `text`.
    fn thresholds(text: &str) -> Vec<String> {
        text.split("more than ")
            .skip(1)
            .filter_map(|t| t.split_once("% of the step").map(|(x, _)| x.to_string()))
            .filter(|x| x.len() < 8)
            .collect()
    }

    #[test]
    fn the_straggler_threshold_is_the_text_report_s_and_the_analysis_s() {
        let traces = [trace(0, vec![]), trace(1, vec![])];
        let r = report::build(&report::Inputs {
            traces: &traces,
            missing: &[],
            others: &[],
            bench: &[],
        });
        let want = format!("{}", analysis::STRAGGLER_SHARE * 100.0);
        let text = report::render_text(&r);
        let page = page(&r, &traces);
        let (t, h) = (thresholds(&text), thresholds(&page));
        assert!(!t.is_empty() && !h.is_empty(), "{text}");
        assert!(t.iter().chain(&h).all(|x| *x == want), "{t:?} {h:?}");
        // The page states the rule and the verdict as the text does.
        assert!(page.contains(&esc(&report::straggler_rule(&r["synchronisation"]))));
        assert!(text.contains(&report::straggler_verdict(&r["synchronisation"])));
    }

    /// The `data-y` ticks of panel `name` of the step plot in `page`.
    fn y_ticks(page: &str, name: &str) -> Vec<f64> {
        let svg = plot(page, "steps");
        let at = svg
            .find(&format!("<g data-panel=\"{name}\""))
            .unwrap_or_else(|| panic!("no {name} panel"));
        let panel = &svg[at..at + svg[at..].find("</g>").unwrap()];
        panel
            .split("data-y=\"")
            .skip(1)
            .map(|t| t[..t.find('"').unwrap()].parse().unwrap())
            .collect()
    }

    #[test]
    fn the_step_plot_leaves_the_warm_up_out_and_tells_the_ranks_apart() {
        let mut r = report();
        r["step_times"] = json!([
            {"rank": 0, "step_ms": [420.0, 39.0, 41.0]},
            {"rank": 1, "step_ms": [410.0, 39.5, 41.0]},
        ]);
        let p = page(&r, &[trace(0, vec![]), trace(1, vec![])]);
        let top = y_ticks(&p, "step-time").into_iter().fold(0.0, f64::max);
        assert!((41.0..60.0).contains(&top), "top tick {top}");
        let diff = y_ticks(&p, "difference");
        assert!(diff.iter().any(|y| *y < 0.0) && diff.iter().any(|y| *y > 0.0));
        let svg = plot(&p, "steps");
        assert!(
            svg.contains("counted steps 2–3; warm-up step 1 left out"),
            "{svg}"
        );
        assert!(p.contains("(warm-up, not counted by the analysis either; up to 420.00 ms)"));
        // Two ranks: two colours, a dashed line, a circle and a square (in
        // the legend too), and both names.
        assert!(svg.contains(PALETTE[0]) && svg.contains(PALETTE[1]));
        assert!(
            svg.contains("stroke-dasharray") && svg.contains("<circle") && svg.contains("<rect x")
        );
        assert!(svg.contains(">rank 0<") && svg.contains(">rank 1<"));
        assert_eq!(svg.matches("<polyline").count(), 4, "2 ranks × 2 panels");
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
