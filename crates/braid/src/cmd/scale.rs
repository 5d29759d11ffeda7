//! `braid scale`: the course's scaling-efficiency exercise in one command —
//! the same data-parallel training at 1, 2, 4, 8 processes (as many as this
//! machine has cores, or GPUs with `--device cuda`), each process with the
//! same batch; tokens/s and scaling efficiency (tokens/s at N over N times
//! tokens/s at 1) per count, written as JSON and an SVG plot of the curve.
//! `--plot-only POINTS.tsv` draws the plot from points measured elsewhere
//! (e.g. by `bench/device/x4.sh scale`) and runs nothing.

use super::svg::{Chart, Options, Series, XAxis};
use clap::Args;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Scaling run.
#[derive(Args)]
#[command(
    about = "Run the same training at 1, 2, 4, 8 processes: tokens/s, scaling efficiency, JSON and a plot",
    after_help = "Examples:\n  \
        braid scale -- --steps 60                            # CPU, tiny model, 1 and 2 processes here\n  \
        braid scale --nproc-per-node 1,2 --out runs/124M -- --device cuda --model 124M --data random --batch 16 --seq 1024 --steps 30 --eval-every 0\n  \
        braid scale --peer 'PyTorch DDP=1:337794,2:644854' -- --device cuda ...\n  \
        braid scale --plot-only logs/scaling.tsv --out logs --title 'GPT-2 124M data parallel'\n\n\
        --plot-only reads tab-separated points with a header line: a column `series` \
        (or `system`), a column `gpus` (or `nproc_per_node`, `workers`) and a column \
        `tokens_per_s`; other columns are ignored. It draws DIR/scaling.svg with an ideal \
        line, linear from the 1-GPU point of the series named `braid` (else the first series)."
)]
pub struct ScaleArgs {
    /// Process counts, one run each (default: 1, 2, 4, 8, up to the cores
    /// or GPUs here; one GPU per process with --device cuda).
    #[arg(
        long = "nproc-per-node",
        visible_aliases = ["workers", "nproc"],
        value_delimiter = ',',
        value_name = "N,...",
        value_parser = parse_count
    )]
    nproc_per_node: Vec<usize>,
    /// Directory for scaling.json, scaling.svg and each run's record
    /// (with --plot-only: for scaling.svg).
    #[arg(long, default_value = "scaling")]
    out: PathBuf,
    /// A reference curve to draw beside braid's: NAME=PROCESSES:TOKENS_S,...
    #[arg(long)]
    peer: Vec<String>,
    /// Draw scaling.svg from already measured points (a TSV file, see
    /// below) and run no training.
    #[arg(long, value_name = "POINTS.tsv", conflicts_with_all = ["nproc_per_node", "train"])]
    plot_only: Option<PathBuf>,
    /// The plot's title (default: the efficiency at the largest count).
    #[arg(long)]
    title: Option<String>,
    /// `braid train` options for every run (after `--`; not --nproc or --json).
    #[arg(last = true)]
    train: Vec<String>,
}

/// One process count's result.
struct Point {
    workers: usize,
    tokens_per_s: f64,
    median_step: f64,
}

/// Colours of the series after braid's.
const COLORS: [&str; 5] = ["#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"];
/// braid's colour, and its ideal line's.
const BRAID_COLOR: &str = "#1f77b4";
const IDEAL_COLOR: &str = "#888888";

/// One of `--nproc-per-node`'s counts (spaces around it allowed: `1, 2`).
fn parse_count(s: &str) -> Result<usize, String> {
    s.trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a process count: give whole numbers, e.g. 1,2,4"))
}

/// `--out` names a directory: refused when it is a file (before any run).
fn out_dir_checked(out: &Path) -> Result<(), String> {
    if out.exists() && !out.is_dir() {
        return Err(format!(
            "--out {}: a file; --out names the directory that scaling.json, scaling.svg and \
             the runs' records go to",
            out.display()
        ));
    }
    std::fs::create_dir_all(out)
        .map_err(|e| format!("--out {}: cannot make the directory: {e}", out.display()))
}

fn parse_peer(s: &str) -> Result<(String, Vec<(f64, f64)>), String> {
    let bad = || {
        format!(
            "--peer {s:?}: expected NAME=PROCESSES:TOKENS_S,... (e.g. 'PyTorch=1:3.4e5,2:6.4e5')"
        )
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

/// Processes available: GPUs with `--device cuda`, else cores.
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
        "--- {workers} process(es): braid train {} --nproc {workers}",
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
            "braid train with {workers} process(es) failed ({status})"
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

/// "1 GPU", "2 GPUs", "4 processes".
fn count(n: f64, unit: &str) -> String {
    match (n == 1.0, unit.ends_with('s')) {
        (true, _) => format!("{n} {unit}"),
        (false, true) => format!("{n} {unit}es"),
        (false, false) => format!("{n} {unit}s"),
    }
}

/// The ideal line of `points` (sorted by x): linear from its point at 1,
/// drawn over `xs`; none without a point at 1.
fn ideal(points: &[(f64, f64)], xs: &[f64]) -> Option<Vec<(f64, f64)>> {
    let one = points.iter().find(|p| p.0 == 1.0)?.1;
    Some(xs.iter().map(|&x| (x, one * x)).collect())
}

/// The efficiency at the largest count of `points` (sorted by x) against
/// its point at 1: (count, efficiency).
fn last_efficiency(points: &[(f64, f64)]) -> Option<(f64, f64)> {
    let one = points.iter().find(|p| p.0 == 1.0)?.1;
    let &(n, t) = points.last()?;
    (one > 0.0).then(|| (n, t / (one * n)))
}

/// Measured series read from a TSV file: their names in order of first
/// appearance, each with its points sorted by x; and the x column's name.
type Measured = (Vec<(String, Vec<(f64, f64)>)>, String);

/// Reads `--plot-only`'s TSV: a header naming the columns, then one point
/// per line (blank lines and lines starting with `#` skipped).
fn read_points(path: &Path) -> Result<Measured, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut lines = text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty() && !l.trim_start().starts_with('#'));
    let (_, header) = lines
        .next()
        .ok_or_else(|| format!("{}: empty (expected a header line)", path.display()))?;
    let cols: Vec<&str> = header.split('\t').map(str::trim).collect();
    let find = |names: &[&str]| cols.iter().position(|c| names.contains(c));
    let want = "series, gpus and tokens_per_s, tab-separated";
    let (Some(si), Some(xi), Some(yi)) = (
        find(&["series", "system"]),
        find(&["gpus", "nproc_per_node", "nproc", "workers"]),
        find(&["tokens_per_s"]),
    ) else {
        return Err(format!(
            "{}: the header {header:?} lacks a column (expected {want})",
            path.display()
        ));
    };
    let mut series: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    for (i, line) in lines {
        let f: Vec<&str> = line.split('\t').map(str::trim).collect();
        let bad = |what: &str| format!("{}:{}: {what} in {line:?}", path.display(), i + 1);
        let get = |k: usize| f.get(k).copied().ok_or_else(|| bad("too few columns"));
        let name = get(si)?;
        let x: f64 = get(xi)?
            .parse()
            .map_err(|_| bad(&format!("{} is not a number", cols[xi])))?;
        let y: f64 = get(yi)?
            .parse()
            .map_err(|_| bad("tokens_per_s is not a number"))?;
        if !(x > 0.0 && x.is_finite() && y >= 0.0 && y.is_finite()) {
            return Err(bad("a count must be positive and tokens/s not negative"));
        }
        match series.iter_mut().find(|s| s.0 == name) {
            Some(s) => s.1.push((x, y)),
            None => series.push((name.to_string(), vec![(x, y)])),
        }
    }
    if series.is_empty() {
        return Err(format!("{}: no points after the header", path.display()));
    }
    for s in &mut series {
        s.1.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    Ok((series, cols[xi].to_string()))
}

/// The chart of measured series: the ideal line of the reference series
/// (named `braid`, else the first) and that series first, then the others
/// and `peers`.
fn chart(
    measured: Vec<(String, Vec<(f64, f64)>)>,
    peers: Vec<(String, Vec<(f64, f64)>)>,
    title: Option<String>,
    x_label: &str,
    unit: &str,
) -> Chart {
    let mut measured = measured;
    let first = measured.iter().position(|s| s.0 == "braid").unwrap_or(0);
    let reference = measured.remove(first);
    let mut xs: Vec<f64> = std::iter::once(1.0)
        .chain(
            measured
                .iter()
                .chain(std::iter::once(&reference))
                .flat_map(|s| s.1.iter().map(|p| p.0)),
        )
        .collect();
    xs.sort_by(f64::total_cmp);
    xs.dedup();
    let eff = last_efficiency(&reference.1);
    let title = title.unwrap_or_else(|| match eff {
        Some((n, e)) => format!(
            "Scaling: {} {:.1}% efficiency at {}",
            reference.0,
            100.0 * e,
            count(n, unit)
        ),
        None => format!("Scaling: tokens/s against {x_label}"),
    });
    // The ideal line first, so that the measured points are drawn over it.
    let mut series = Vec::new();
    if let Some(line) = ideal(&reference.1, &xs) {
        series.push(Series {
            name: format!("{} ideal (linear from 1 {unit})", reference.0),
            color: IDEAL_COLOR,
            dashed: true,
            points: line,
        });
    }
    series.push(Series {
        name: reference.0,
        color: BRAID_COLOR,
        dashed: false,
        points: reference.1,
    });
    for (i, (name, points)) in measured.into_iter().chain(peers).enumerate() {
        series.push(Series {
            name,
            color: COLORS[i % COLORS.len()],
            dashed: false,
            points,
        });
    }
    Chart {
        title,
        x_label: x_label.into(),
        y_label: "tokens/s".into(),
        series,
    }
}

/// Writes `out/scaling.svg`: a tick at each count measured, or evenly
/// spaced ticks where there are more counts than fit.
fn write_svg(out: &Path, chart: &Chart) -> Result<PathBuf, String> {
    std::fs::create_dir_all(out).map_err(|e| format!("{}: {e}", out.display()))?;
    let mut xs: Vec<f64> = chart
        .series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.0))
        .collect();
    xs.sort_by(f64::total_cmp);
    xs.dedup();
    let text = if xs.len() > 12 {
        let o = Options {
            x_axis: XAxis::Linear,
            ..Default::default()
        };
        chart.svg_with(720.0, 440.0, &o)
    } else {
        chart.svg(720.0, 440.0)
    };
    let svg = out.join("scaling.svg");
    std::fs::write(&svg, text).map_err(|e| format!("{}: {e}", svg.display()))?;
    Ok(svg)
}

/// `--plot-only`: the plot of measured points.
fn plot_only(a: &ScaleArgs, tsv: &Path) -> Result<i32, String> {
    let (measured, column) = read_points(tsv).map_err(|e| format!("--plot-only {e}"))?;
    out_dir_checked(&a.out)?;
    let (x_label, unit) = match column.as_str() {
        "gpus" => ("GPUs", "GPU"),
        "workers" => ("workers", "worker"),
        _ => ("processes", "process"),
    };
    let peers = a
        .peer
        .iter()
        .map(|p| parse_peer(p))
        .collect::<Result<Vec<_>, _>>()?;
    let c = chart(measured, peers, a.title.clone(), x_label, unit);
    let svg = write_svg(&a.out, &c)?;
    println!("wrote {}", svg.display());
    Ok(0)
}

/// Runs `braid scale`.
pub fn run(a: ScaleArgs) -> Result<i32, String> {
    if let Some(tsv) = &a.plot_only {
        return plot_only(&a, tsv);
    }
    for bad in ["--nproc", "--nproc-per-node", "--json"] {
        if a.train
            .iter()
            .any(|x| x == bad || x.starts_with(&format!("{bad}=")))
        {
            return Err(format!(
                "{bad} is set by braid scale for each run; leave it out"
            ));
        }
    }
    // `braid train`'s --device, as it will resolve it (auto: the GPUs here,
    // if any; every count below then has one GPU per worker).
    let device = a
        .train
        .windows(2)
        .find(|w| w[0] == "--device")
        .map(|w| w[1].clone())
        .or_else(|| {
            a.train
                .iter()
                .find_map(|x| x.strip_prefix("--device=").map(str::to_string))
        })
        .unwrap_or_else(|| "auto".into());
    let cuda = super::Device::resolve(&device, 1)?.cuda;
    let have = available(cuda)?;
    let counts: Vec<usize> = if a.nproc_per_node.is_empty() {
        [1, 2, 4, 8].into_iter().filter(|&n| n <= have).collect()
    } else {
        a.nproc_per_node.clone()
    };
    if counts.is_empty() || counts.contains(&0) {
        return Err("--nproc-per-node: give counts of at least 1 (e.g. 1,2,4)".into());
    }
    if counts[0] != 1 {
        return Err(format!(
            "--nproc-per-node must start at 1: efficiency is measured against one process (e.g. \
             1,{})",
            counts[counts.len() - 1].max(2)
        ));
    }
    if let Some(w) = counts.windows(2).find(|w| w[1] <= w[0]) {
        return Err(format!(
            "--nproc-per-node {}: each count once, rising ({} after {}); e.g. 1,2,4",
            a.nproc_per_node
                .iter()
                .map(|n| n.to_string())
                .collect::<Vec<_>>()
                .join(","),
            w[1],
            w[0]
        ));
    }
    let peers = a
        .peer
        .iter()
        .map(|p| parse_peer(p))
        .collect::<Result<Vec<_>, _>>()?;
    out_dir_checked(&a.out)?;
    let mut points = Vec::new();
    for &w in &counts {
        let json = a.out.join(format!("train-{w}.json"));
        points.push(run_one(&a.train, w, &json)?);
    }
    let one = points[0].tokens_per_s;
    println!(
        "\nscaling: braid train {} ({})",
        a.train.join(" "),
        if cuda {
            "one GPU per process"
        } else {
            "CPU processes"
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
    let braid = (
        "braid".to_string(),
        points
            .iter()
            .map(|p| (p.workers as f64, p.tokens_per_s))
            .collect(),
    );
    let (x_label, unit) = if cuda {
        ("GPUs", "GPU")
    } else {
        ("processes", "process")
    };
    let last = points.last().expect("at least one run");
    let title = a.title.clone().unwrap_or_else(|| {
        format!(
            "Data-parallel scaling: {:.1}% efficiency at {}",
            100.0 * last.tokens_per_s / one / last.workers as f64,
            count(last.workers as f64, unit)
        )
    });
    let c = chart(vec![braid], peers, Some(title), x_label, unit);
    let svg = write_svg(&a.out, &c)?;
    println!("wrote {} and {}", json.display(), svg.display());
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn measured_points_are_read_by_their_header() {
        let dir = std::env::temp_dir().join(format!("braid-scale-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let tsv = dir.join("points.tsv");
        std::fs::write(
            &tsv,
            "system\tgpus\ttokens_per_s\tefficiency\n# a comment\nbraid\t2\t900\t-\n\
             braid\t1\t500\t100.0%\npeer\t1\t300\t100.0%\n",
        )
        .unwrap();
        let (series, col) = read_points(&tsv).unwrap();
        assert_eq!(col, "gpus");
        assert_eq!(series[0].0, "braid");
        assert_eq!(series[0].1, vec![(1.0, 500.0), (2.0, 900.0)]);
        assert_eq!(series[1].1, vec![(1.0, 300.0)]);
        let c = chart(series, Vec::new(), None, "GPUs", "GPU");
        assert_eq!(c.title, "Scaling: braid 90.0% efficiency at 2 GPUs");
        assert_eq!(c.series[0].points, vec![(1.0, 500.0), (2.0, 1000.0)]);
        assert_eq!(c.series[1].name, "braid");
        std::fs::write(&tsv, "name\tgpus\ttokens\nbraid\t1\t5\n").unwrap();
        assert!(read_points(&tsv).unwrap_err().contains("lacks a column"));
        std::fs::write(&tsv, "series\tgpus\ttokens_per_s\nbraid\tx\t5\n").unwrap();
        assert!(read_points(&tsv)
            .unwrap_err()
            .contains(":2: gpus is not a number"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
