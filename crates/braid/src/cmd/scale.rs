//! `braid scale`: the course's scaling-efficiency exercise in one command —
//! the same data-parallel training at 1, 2, 4, 8 workers (as many as this
//! machine has cores, or GPUs with `--device cuda`), each worker with the
//! same batch; tokens/s and scaling efficiency (tokens/s at N over N times
//! tokens/s at 1) per count, written as JSON and an SVG plot of the curve.

use super::svg::{Chart, Series};
use clap::Args;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Scaling run.
#[derive(Args)]
#[command(
    about = "Run the same training at 1, 2, 4, 8 workers: tokens/s, scaling efficiency, JSON and a plot",
    after_help = "Examples:\n  braid scale -- --steps 60                            # CPU, tiny model, 1 and 2 workers here\n  braid scale --workers 1,2 --out runs/124M -- --device cuda --model 124M --data random --batch 16 --seq 1024 --steps 30 --eval-every 0\n  braid scale --peer 'PyTorch DDP=1:337794,2:644854' -- --device cuda ..."
)]
pub struct ScaleArgs {
    /// Worker counts (default: 1, 2, 4, 8, up to the cores or GPUs here).
    #[arg(long, value_delimiter = ',')]
    workers: Vec<usize>,
    /// Directory for scaling.json, scaling.svg and each run's record.
    #[arg(long, default_value = "scaling")]
    out: PathBuf,
    /// A reference curve to draw beside braid's: NAME=WORKERS:TOKENS_S,...
    #[arg(long)]
    peer: Vec<String>,
    /// `braid train` options for every run (after `--`; not --nproc or --json).
    #[arg(last = true)]
    train: Vec<String>,
}

/// One worker count's result.
struct Point {
    workers: usize,
    tokens_per_s: f64,
    median_step: f64,
}

fn parse_peer(s: &str) -> Result<(String, Vec<(f64, f64)>), String> {
    let bad = || {
        format!("--peer {s:?}: expected NAME=WORKERS:TOKENS_S,... (e.g. 'PyTorch=1:3.4e5,2:6.4e5')")
    };
    let (name, pts) = s.split_once('=').ok_or_else(bad)?;
    let points = pts
        .split(',')
        .map(|p| {
            let (w, t) = p.split_once(':').ok_or_else(bad)?;
            Ok((
                w.trim().parse::<f64>().map_err(|_| bad())?,
                t.trim().parse::<f64>().map_err(|_| bad())?,
            ))
        })
        .collect::<Result<Vec<_>, String>>()?;
    Ok((name.to_string(), points))
}

/// Workers available: GPUs with `--device cuda`, else cores.
fn available(cuda: bool) -> Result<usize, String> {
    if cuda {
        braid_cuda::device_count().map_err(|e| format!("--device cuda: {e}"))
    } else {
        Ok(std::thread::available_parallelism().map_or(1, |n| n.get()))
    }
}

fn run_one(train: &[String], workers: usize, json: &Path) -> Result<Point, String> {
    let exe =
        std::env::current_exe().map_err(|e| format!("cannot find the braid executable: {e}"))?;
    println!(
        "--- {workers} worker(s): braid train {} --nproc {workers}",
        train.join(" ")
    );
    let status = Command::new(exe)
        .arg("train")
        .args(train)
        .args(["--nproc", &workers.to_string(), "--json"])
        .arg(json)
        .status()
        .map_err(|e| format!("cannot start braid train: {e}"))?;
    if !status.success() {
        return Err(format!(
            "braid train with {workers} worker(s) failed ({status})"
        ));
    }
    let doc: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(json).map_err(|e| format!("{}: {e}", json.display()))?,
    )
    .map_err(|e| format!("{}: {e}", json.display()))?;
    let s = &doc["summary"];
    match (s["tokens_per_s"].as_f64(), s["median_step_s"].as_f64()) {
        (Some(t), Some(m)) => Ok(Point {
            workers,
            tokens_per_s: t,
            median_step: m,
        }),
        _ => Err(format!("{}: no summary (too few steps?)", json.display())),
    }
}

/// Runs `braid scale`.
pub fn run(a: ScaleArgs) -> Result<i32, String> {
    for bad in ["--nproc", "--json"] {
        if a.train
            .iter()
            .any(|x| x == bad || x.starts_with(&format!("{bad}=")))
        {
            return Err(format!(
                "{bad} is set by braid scale for each run; leave it out"
            ));
        }
    }
    let cuda = a
        .train
        .windows(2)
        .any(|w| w[0] == "--device" && (w[1] == "cuda" || w[1] == "gpu"))
        || a.train
            .iter()
            .any(|x| x == "--device=cuda" || x == "--device=gpu");
    let have = available(cuda)?;
    let workers: Vec<usize> = if a.workers.is_empty() {
        [1, 2, 4, 8].into_iter().filter(|&n| n <= have).collect()
    } else {
        a.workers.clone()
    };
    if workers.is_empty() || workers.contains(&0) {
        return Err("--workers: give counts of at least 1 (e.g. 1,2,4)".into());
    }
    if workers[0] != 1 {
        return Err("--workers must start at 1: efficiency is measured against one worker".into());
    }
    let peers = a
        .peer
        .iter()
        .map(|p| parse_peer(p))
        .collect::<Result<Vec<_>, _>>()?;
    std::fs::create_dir_all(&a.out).map_err(|e| format!("{}: {e}", a.out.display()))?;
    let mut points = Vec::new();
    for &w in &workers {
        let json = a.out.join(format!("train-{w}.json"));
        points.push(run_one(&a.train, w, &json)?);
    }
    let one = points[0].tokens_per_s;
    println!(
        "\nscaling: braid train {} ({})",
        a.train.join(" "),
        if cuda {
            "one GPU per worker"
        } else {
            "CPU workers"
        }
    );
    println!(
        "{:>8} {:>14} {:>10} {:>8} {:>11}",
        "workers", "tokens/s", "step ms", "speedup", "efficiency"
    );
    let mut rows = Vec::new();
    for p in &points {
        let speedup = p.tokens_per_s / one;
        let eff = speedup / p.workers as f64;
        println!(
            "{:>8} {:>14.0} {:>10.2} {:>8.2} {:>10.1}%",
            p.workers,
            p.tokens_per_s,
            p.median_step * 1e3,
            speedup,
            100.0 * eff
        );
        rows.push(
            serde_json::json!({"workers": p.workers, "tokens_per_s": p.tokens_per_s,
            "median_step_s": p.median_step, "speedup": speedup, "efficiency": eff,
            "record": format!("train-{}.json", p.workers)}),
        );
    }
    let doc = serde_json::json!({
        "train_args": a.train,
        "device": if cuda { "cuda" } else { "cpu" },
        "runs": rows,
        "peers": peers.iter().map(|(n, p)| serde_json::json!({"name": n, "points": p})).collect::<Vec<_>>(),
    });
    let json = a.out.join("scaling.json");
    std::fs::write(&json, serde_json::to_string_pretty(&doc).expect("json"))
        .map_err(|e| format!("{}: {e}", json.display()))?;
    let mut series = vec![
        Series {
            name: "braid".into(),
            color: "#1f77b4",
            dashed: false,
            points: points
                .iter()
                .map(|p| (p.workers as f64, p.tokens_per_s))
                .collect(),
        },
        Series {
            name: "ideal (linear from 1 worker)".into(),
            color: "#888888",
            dashed: true,
            points: points
                .iter()
                .map(|p| (p.workers as f64, one * p.workers as f64))
                .collect(),
        },
    ];
    let colors = ["#d62728", "#2ca02c", "#9467bd", "#ff7f0e"];
    for (i, (name, pts)) in peers.into_iter().enumerate() {
        series.push(Series {
            name,
            color: colors[i % colors.len()],
            dashed: false,
            points: pts,
        });
    }
    let last = points.last().expect("at least one run");
    let chart = Chart {
        title: format!(
            "Data-parallel scaling: {:.1}% efficiency at {} workers",
            100.0 * last.tokens_per_s / one / last.workers as f64,
            last.workers
        ),
        x_label: if cuda { "GPUs" } else { "workers" }.into(),
        y_label: "tokens/s".into(),
        series,
    };
    let svg = a.out.join("scaling.svg");
    std::fs::write(&svg, chart.svg(720.0, 440.0)).map_err(|e| format!("{}: {e}", svg.display()))?;
    println!("wrote {} and {}", json.display(), svg.display());
    Ok(0)
}
