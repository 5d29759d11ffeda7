//! What braid says about one traced run agrees with itself: `braid
//! train`'s summary, `braid report DIR` (text) and `braid report DIR
//! --html FILE` state the same straggler threshold, count the same
//! collectives per step, and draw and state percentages that mean
//! something (a hidden share of at most 100%, a step plot whose axis is
//! the counted steps', not the warm-up's). On a pipeline run, the report
//! knows the layout: the waits between stages are the pipeline bubble and
//! the stages' differing work stage imbalance, not exposed communication
//! and a straggler.

mod common;

use common::{braid, run, TempDir};
use serde_json::Value;
use std::sync::OnceLock;
use std::time::Duration;

/// Everything braid printed and wrote about one run.
struct Outputs {
    /// `braid train`'s stdout.
    train: String,
    /// `braid report DIR`.
    text: String,
    /// `braid report DIR --json`.
    json: Value,
    /// `braid report DIR --html FILE`: the file.
    html: String,
}

/// One traced 4-rank run (the issue's: 4 CPU ranks, data parallel) and
/// its reports, made once for the tests of this file; the trace
/// directory is removed once they are read.
fn outputs() -> &'static Outputs {
    static RUN: OnceLock<Outputs> = OnceLock::new();
    RUN.get_or_init(|| {
        traced_run(
            "report-truth",
            &[
                "--nproc",
                "4",
                "--steps",
                "12",
                "--model",
                "L2-H2-C64",
                "--batch",
                "4",
            ],
        )
    })
}

/// A traced 2-stage pipeline (issue 63, point 6): 6 layers split 1,5 on
/// purpose, so that the last stage (5 layers and the head) computes far
/// more than the first (a layer moved off it evens them out however busy
/// the machine); 4 micro-batches of 1F1B.
fn pipeline_outputs() -> &'static Outputs {
    static RUN: OnceLock<Outputs> = OnceLock::new();
    RUN.get_or_init(|| {
        traced_run(
            "report-pipeline",
            &[
                "--pp",
                "2",
                "--stage-layers",
                "1,5",
                "--micro-batches",
                "4",
                "--steps",
                "16",
                "--model",
                "L6-H2-C64",
                "--batch",
                "8",
            ],
        )
    })
}

/// `braid train ARGS --seed 5 --trace DIR` and its reports (text with
/// `--html`, and `--json`), in a temporary directory named after `name`
/// that is removed once they are read.
fn traced_run(name: &str, args: &[&str]) -> Outputs {
    let dir = TempDir::new(name);
    let tr = dir.path().join("tr");
    let mut cmd = braid();
    cmd.arg("train")
        .args(args)
        .args(["--seed", "5", "--trace"])
        .arg(&tr);
    let t = run(cmd, Duration::from_secs(120));
    assert_eq!(t.code, Some(0), "{t:?}");
    let report = |extra: &[&str]| report_of(&tr, extra);
    let html_path = dir.path().join("r.html");
    let text = report(&["--html", html_path.to_str().unwrap()]);
    let json = serde_json::from_str(&report(&["--json"])).expect("report JSON");
    let html = std::fs::read_to_string(&html_path).unwrap();
    Outputs {
        train: t.stdout,
        text,
        json,
        html,
    }
}

/// `braid report DIR EXTRA`'s standard output (it must succeed).
fn report_of(dir: &std::path::Path, extra: &[&str]) -> String {
    let mut cmd = braid();
    cmd.arg("report").arg(dir).args(extra);
    let r = run(cmd, Duration::from_secs(60));
    assert_eq!(r.code, Some(0), "{r:?}");
    r.stdout
}

/// The train summary's line that starts (after `summary: `) with `start`.
fn summary_line<'a>(train: &'a str, start: &str) -> &'a str {
    train
        .lines()
        .filter_map(|l| l.split_once("summary: ").map(|(_, s)| s))
        .find(|s| s.starts_with(start))
        .unwrap_or_else(|| panic!("no summary line {start:?} in:\n{train}"))
}

/// The number that starts `s`.
fn leading_number(s: &str) -> f64 {
    let n: String = s
        .trim_start()
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.')
        .collect();
    n.parse()
        .unwrap_or_else(|_| panic!("no number at the start of {s:?}"))
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
fn the_html_straggler_threshold_is_the_text_report_s() {
    let o = outputs();
    let (text, html) = (thresholds(&o.text), thresholds(&o.html));
    assert!(
        !text.is_empty(),
        "the text report states no threshold:\n{}",
        o.text
    );
    assert!(!html.is_empty(), "the HTML page states no threshold");
    for x in &html {
        assert!(
            text.contains(x),
            "the HTML page says a straggler stands out by more than {x}% of the step, the text report {text:?}"
        );
    }
    assert!(text.iter().all(|x| *x == text[0]), "{text:?}");
}

#[test]
fn the_html_step_plot_axis_covers_the_counted_steps_not_the_warm_up() {
    let o = outputs();
    let warmup = o.json["run"]["warmup_steps"].as_u64().unwrap() as usize;
    assert!(warmup > 0);
    let (mut counted, mut warm) = (0.0f64, 0.0f64);
    for r in o.json["step_times"].as_array().unwrap() {
        let ms: Vec<f64> = r["step_ms"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        warm = ms[..warmup].iter().fold(warm, |a, b| a.max(*b));
        counted = ms[warmup..].iter().fold(counted, |a, b| a.max(*b));
    }
    // The step-time panel's y ticks (data-y) in the page; a plot without
    // panels: its y tick labels (the right-aligned texts).
    let at = o
        .html
        .find("<svg data-plot=\"steps\"")
        .expect("a step plot");
    let svg = &o.html[at..at + o.html[at..].find("</svg>").unwrap()];
    let ticks: Vec<f64> = match svg.find("data-panel=\"step-time\"") {
        Some(p) => svg[p..p + svg[p..].find("</g>").unwrap()]
            .split("data-y=\"")
            .skip(1)
            .map(|t| t[..t.find('"').unwrap()].parse().unwrap())
            .collect(),
        None => svg
            .split("text-anchor=\"end\">")
            .skip(1)
            .filter_map(|t| t[..t.find('<').unwrap()].parse().ok())
            .collect(),
    };
    assert!(ticks.len() >= 2, "{svg}");
    let top = ticks.iter().cloned().fold(f64::MIN, f64::max);
    let step = top
        - ticks
            .iter()
            .cloned()
            .filter(|t| *t < top)
            .fold(f64::MIN, f64::max);
    // The axis ends at the first tick at or above the slowest counted
    // step: the warm-up does not stretch it.
    assert!(
        top >= counted && top - step < counted,
        "y axis to {top} ms (ticks every {step}) for counted steps up to {counted} ms (warm-up up to {warm} ms)"
    );
    if warm > top {
        assert!(
            o.html
                .contains("(warm-up, not counted by the analysis either; up to"),
            "the warm-up left out of the plot is not stated"
        );
    }
}

#[test]
fn train_summary_and_report_count_the_same_collectives_per_step() {
    let o = outputs();
    let line = summary_line(&o.train, "communication per step:");
    let train = leading_number(&line["communication per step:".len()..]);
    let text_line = o
        .text
        .lines()
        .find_map(|l| l.split_once("collectives per step: "))
        .map(|(_, s)| s)
        .unwrap_or_else(|| panic!("the report counts no collectives per step:\n{}", o.text));
    let report = leading_number(text_line);
    // The per-operation table of the same report, summed.
    let table: f64 = o.json["communication"]["ops"]
        .as_array()
        .unwrap()
        .iter()
        .map(|op| op["per_step"].as_f64().unwrap())
        .sum();
    assert_eq!(
        train, report,
        "train: {line}\nreport: collectives per step: {text_line}"
    );
    assert!(
        (report - table).abs() < 0.01,
        "{report} against the table's {table}"
    );
    // Both name them alike: the data-parallel gradient bucket and the
    // loop's all-reduce of the loss.
    for part in [
        "1 of the training strategy",
        "1 all-reduce of the step's loss",
    ] {
        assert!(line.contains(part), "train: {line}");
        assert!(text_line.contains(part), "report: {text_line}");
    }
}

#[test]
fn train_overlap_line_has_no_percentage_over_100() {
    let o = outputs();
    let line = summary_line(&o.train, "overlap:");
    let percents: Vec<f64> = line
        .split('%')
        .filter_map(|before| {
            let digits: String = before
                .chars()
                .rev()
                .take_while(|c| c.is_ascii_digit() || *c == '.')
                .collect();
            digits.chars().rev().collect::<String>().parse().ok()
        })
        .collect();
    assert!(!percents.is_empty(), "{line}");
    assert!(percents.iter().all(|p| (0.0..=100.0).contains(p)), "{line}");
    // The same share the report gives for the run's own summary.
    let theirs = o.json["communication"]["summary_hidden_pct"]
        .as_f64()
        .unwrap();
    assert!(
        (percents[0] - theirs).abs() <= 0.11,
        "train: {line}; report: its own summary {theirs}% hidden"
    );
}

/// The report's line that starts with `start`.
fn report_line<'a>(text: &'a str, start: &str) -> &'a str {
    text.lines()
        .find(|l| l.starts_with(start))
        .unwrap_or_else(|| panic!("no line {start:?} in:\n{text}"))
}

#[test]
fn a_pipeline_s_waits_are_its_bubble_and_its_stages_imbalance_not_a_straggler() {
    let o = pipeline_outputs();
    let (text, html, json) = (&o.text, &o.html, &o.json);
    // The header names the layout, not "one process".
    let run = report_line(text, "run: ");
    assert!(
        run.contains("pipeline 2 (1f1b, 4 micro-batches)") && !run.contains("one process"),
        "{run}"
    );
    assert!(
        !html.contains("one process"),
        "the HTML page says one process"
    );
    // The bubble is its own part of the step, beside the schedule's on
    // paper, (N-1)/(M+N-1) = 1/5.
    for page in [text.as_str(), html.as_str()] {
        for said in [
            "pipeline bubble",
            "stage imbalance",
            "(N-1)/(M+N-1) = 20",
            "--stage-layers 2,4 (now 1,5)",
        ] {
            assert!(page.contains(said), "no {said:?} in:\n{text}");
        }
        // Rank 1 holds the head: heavier, not slow.
        for never in ["noisy neighbour", "straggler: rank", "slow in compute"] {
            assert!(!page.contains(never), "{never:?} in:\n{text}");
        }
    }
    assert!(html.contains("<h2>Pipeline</h2>"));
    assert_eq!(json["bottleneck"]["kind"], "stage imbalance", "{text}");
    assert!(json["synchronisation"]["straggler"].is_null(), "{text}");
    let pl = &json["pipeline"];
    assert_eq!(pl["imbalance"]["pipe_rank"], 1, "{text}");
    assert_eq!(pl["bubble_formula_pct"], 20.0);
    let measured = pl["bubble_measured_pct"].as_f64().unwrap();
    assert!(measured > 20.0 && measured < 100.0, "{text}");
    // Rank 0 waits for rank 1 in the pipeline, not in exposed
    // communication; every step is still accounted for.
    let r0 = &json["breakdown"]["ranks"][0];
    let pct = |k: &str| r0[k].as_f64().unwrap_or_else(|| panic!("{k}: {r0}"));
    assert!(pct("bubble_pct") > 20.0, "{r0}");
    assert!(pct("exposed_comm_pct") < 10.0, "{r0}");
    for r in json["breakdown"]["ranks"].as_array().unwrap() {
        assert!(r["accounting_gap_pct"].as_f64().unwrap() < 2.0, "{r}");
    }
    // braid train printed the same bubble on paper.
    assert!(o.train.contains("(N-1)/(M+N-1) = 20.0%"), "{}", o.train);
}

/// The run's description records its layout in `braid plan`'s terms (the
/// pipeline's degree, micro-batches and their size; no GPU on a CPU run,
/// so no prediction); a trace whose layout names an H100 gets `braid
/// plan`'s prediction beside its median step, in the text and the JSON.
#[test]
fn the_report_puts_the_plans_prediction_beside_a_gpu_runs_step() {
    let dir = TempDir::new("report-plan");
    let tr = dir.path().join("tr");
    let mut cmd = braid();
    cmd.args(["train", "--pp", "2", "--micro-batches", "4", "--batch", "8"])
        .args([
            "--steps",
            "8",
            "--model",
            "L2-H2-C64",
            "--seed",
            "5",
            "--trace",
        ])
        .arg(&tr);
    let t = run(cmd, Duration::from_secs(120));
    assert_eq!(t.code, Some(0), "{t:?}");
    assert!(!t.stdout.contains("plan: "), "a CPU run: {}", t.stdout);
    let report = |extra: &[&str]| report_of(&tr, extra);
    assert!(!report(&[]).contains("plan: "));
    let trace = std::fs::read_dir(&tr)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.file_name().unwrap().to_string_lossy() == "trace-rank00000.json")
        .expect("rank 0's trace");
    let mut doc: Value = serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    let layout = &doc["braid"]["run"]["desc"]["layout"];
    assert_eq!(layout["pp"], 2, "{layout}");
    assert_eq!(layout["micro_batches"], 4, "{layout}");
    assert_eq!(layout["micro_batch"], 2, "{layout}");
    assert_eq!(layout["dp"], 1, "{layout}");
    assert!(layout["gpu"].is_null(), "{layout}");
    doc["braid"]["run"]["desc"]["layout"]["gpu"] = "NVIDIA H100 80GB HBM3".into();
    std::fs::write(&trace, serde_json::to_string(&doc).unwrap()).unwrap();
    let text = report(&[]);
    let line = text
        .lines()
        .find(|l| l.starts_with("plan: this layout predicted"))
        .unwrap_or_else(|| panic!("no plan line:\n{text}"));
    assert!(
        line.contains("h100 description") && line.contains("bubble"),
        "{line}"
    );
    let json: Value = serde_json::from_str(&report(&["--json"])).unwrap();
    let plan = &json["plan"];
    let measured = doc["braid"]["run"]["summary"]["median_step_s"]
        .as_f64()
        .unwrap();
    assert_eq!(plan["measured_step_s"].as_f64(), Some(measured), "{plan}");
    let (p, r) = (
        plan["predicted_step_s"].as_f64().unwrap(),
        plan["measured_over_predicted"].as_f64().unwrap(),
    );
    assert!(p > 0.0 && (r - measured / p).abs() < 1e-9, "{plan}");
}
