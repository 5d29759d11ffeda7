//! `braid plot`: learning curves of several runs, grouped into series —
//! each series' mean over its runs (a solid line, its runs dashed beside
//! it) as an SVG, and the table of means and standard deviations between
//! the runs at every step all of them recorded (markdown on stdout,
//! `--json` for scripts). The runs are `braid train --json` files or
//! anything with the same `steps` rows (`bench/torch_gpt_recipe.py`'s).

use super::svg::{Chart, Options, Series, XAxis};
use clap::Args;
use std::collections::BTreeMap;
use std::path::PathBuf;

/// Draw learning curves.
#[derive(Args)]
#[command(
    about = "Draw learning curves of runs (braid train --json files), mean and spread per series",
    after_help = "Examples:
  braid plot --series braid=b1.json,b2.json --series PyTorch=t1.json,t2.json --out parity.svg
  braid plot --series seeds=run-*.json --y loss --out loss.svg --json table.json
  braid plot --series sync=s.json --series ssp=p.json --x elapsed_s --out time.svg"
)]
pub struct PlotArgs {
    /// NAME=FILE[,FILE...]: a series and its runs (repeat for several).
    #[arg(long = "series", value_name = "NAME=FILES", required = true)]
    series: Vec<String>,
    /// The field of each step row drawn: eval_loss, loss, lr, grad_norm...
    #[arg(long, default_value = "eval_loss")]
    y: String,
    /// The field along the x axis: step, or elapsed_s (wall-clock seconds
    /// since the run's first step: each run drawn as it went; the table
    /// stays by step).
    #[arg(long, default_value = "step")]
    x: String,
    /// Also say when each run first reached `--y` ≤ this value (its step
    /// and wall-clock seconds): which run gets to a loss sooner.
    #[arg(long, value_name = "VALUE")]
    reach: Option<f64>,
    /// The SVG to write.
    #[arg(long, value_name = "FILE.svg")]
    out: PathBuf,
    /// The chart's title.
    #[arg(long)]
    title: Option<String>,
    /// The table as JSON (see --json in braid --help).
    #[arg(long, value_name = "FILE", num_args = 0..=1, default_missing_value = "-",
          value_parser = super::json_out::parse, help = super::json_out::HELP)]
    json: Option<super::json_out::JsonOut>,
}

/// Line colours, one per series.
const COLORS: [&str; 6] = [
    "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b",
];

/// One series: its name and, per run, the points (step, value) it has
/// and where each is on the x axis.
struct Runs {
    name: String,
    runs: Vec<(PathBuf, Vec<(f64, f64)>)>,
    xs: Vec<Vec<f64>>,
}

/// A run's points (step, value) and each one's place on the x axis.
type Points = (Vec<(f64, f64)>, Vec<f64>);

/// The points (step, `field`) in the `steps` rows of the run at `path`,
/// and each one's `x`.
fn points(path: &PathBuf, field: &str, x: &str) -> Result<Points, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let doc: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
        format!(
            "{}: not JSON ({e}); expected braid train --json output",
            path.display()
        )
    })?;
    let rows = doc["steps"].as_array().ok_or_else(|| {
        format!(
            "{}: no \"steps\" array (expected braid train --json output)",
            path.display()
        )
    })?;
    let rows: Vec<(f64, f64, f64)> = rows
        .iter()
        .filter_map(|r| Some((r["step"].as_f64()?, r[field].as_f64()?, r[x].as_f64()?)))
        .collect();
    let pts: Vec<(f64, f64)> = rows.iter().map(|&(s, y, _)| (s, y)).collect();
    let xs: Vec<f64> = rows.iter().map(|&(_, _, x)| x).collect();
    if pts.is_empty() {
        return Err(format!(
            "{}: no step has a value of {field:?} (is it evaluated? braid train --eval-every)",
            path.display()
        ));
    }
    Ok((pts, xs))
}

/// The first step row of the run at `path` whose `field` is at most
/// `target`: its step, its elapsed seconds, and the seconds of training
/// to it (the steps' own times summed: evaluations and checkpoint saves,
/// which every run pays alike, left out).
fn reached(path: &PathBuf, field: &str, target: f64) -> Option<(f64, f64, f64)> {
    let doc: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()?;
    reached_in(doc["steps"].as_array()?, field, target)
}

/// [`reached`] over a run's step rows.
fn reached_in(rows: &[serde_json::Value], field: &str, target: f64) -> Option<(f64, f64, f64)> {
    let mut training = 0.0;
    rows.iter().find_map(|r| {
        training += r["step_s"].as_f64().unwrap_or(0.0);
        (r[field].as_f64()? <= target).then_some((
            r["step"].as_f64()?,
            r["elapsed_s"].as_f64()?,
            training,
        ))
    })
}

/// `NAME=FILE,FILE`.
fn parse_series(spec: &str, field: &str, x: &str) -> Result<Runs, String> {
    let (name, files) = spec
        .split_once('=')
        .filter(|(n, f)| !n.is_empty() && !f.is_empty())
        .ok_or_else(|| format!("--series {spec:?}: expected NAME=FILE[,FILE...]"))?;
    let (runs, xs) = files
        .split(',')
        .map(|f| {
            let p = PathBuf::from(f.trim());
            points(&p, field, x).map(|(pts, xs)| ((p, pts), xs))
        })
        .collect::<Result<Vec<_>, _>>()?
        .into_iter()
        .unzip();
    Ok(Runs {
        name: name.to_string(),
        runs,
        xs,
    })
}

/// Mean and standard deviation (between runs, n − 1) of a series at
/// every step all its runs have.
fn stats(r: &Runs) -> BTreeMap<u64, (f64, f64, usize)> {
    let mut by: BTreeMap<u64, Vec<f64>> = BTreeMap::new();
    for (_, pts) in &r.runs {
        for &(x, y) in pts {
            by.entry(x as u64).or_default().push(y);
        }
    }
    by.into_iter()
        .filter(|(_, v)| v.len() == r.runs.len())
        .map(|(x, v)| {
            let n = v.len() as f64;
            let mean = v.iter().sum::<f64>() / n;
            let sd = match v.len() {
                1 => 0.0,
                _ => (v.iter().map(|y| (y - mean).powi(2)).sum::<f64>() / (n - 1.0)).sqrt(),
            };
            (x, (mean, sd, v.len()))
        })
        .collect()
}

/// Runs `braid plot`.
pub fn run(a: PlotArgs) -> Result<i32, String> {
    let all = a
        .series
        .iter()
        .map(|s| parse_series(s, &a.y, &a.x))
        .collect::<Result<Vec<_>, _>>()?;
    super::train_ckpt::check_outputs(&[("--out", Some(&a.out))])?;
    if let Some(j) = &a.json {
        j.claim_stdout()?;
    }
    let mut chart = Chart {
        title: a
            .title
            .clone()
            .unwrap_or_else(|| format!("{} by {}", a.y, a.x)),
        x_label: a.x.clone(),
        y_label: a.y.clone(),
        series: Vec::new(),
    };
    let table: Vec<_> = all.iter().map(|r| (r, stats(r))).collect();
    for (i, (r, st)) in table.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        if a.x != "step" {
            // Each run as it went: no mean across runs along time.
            for (k, ((path, pts), xs)) in r.runs.iter().zip(&r.xs).enumerate() {
                chart.series.push(Series {
                    name: match r.runs.len() {
                        1 => r.name.clone(),
                        _ => format!(
                            "{} {}",
                            r.name,
                            path.file_stem().unwrap_or_default().to_string_lossy()
                        ),
                    },
                    color,
                    dashed: k > 0,
                    points: xs.iter().zip(pts).map(|(&x, &(_, y))| (x, y)).collect(),
                });
            }
            continue;
        }
        chart.series.push(Series {
            name: format!("{} (mean of {})", r.name, r.runs.len()),
            color,
            dashed: false,
            points: st.iter().map(|(&x, &(m, _, _))| (x as f64, m)).collect(),
        });
        if r.runs.len() > 1 {
            for (path, pts) in &r.runs {
                chart.series.push(Series {
                    name: format!(
                        "{} {}",
                        r.name,
                        path.file_stem().unwrap_or_default().to_string_lossy()
                    ),
                    color,
                    dashed: true,
                    points: pts.clone(),
                });
            }
        }
    }
    let options = Options {
        x_axis: XAxis::Linear,
        legend_outside: true,
        ..Default::default()
    };
    std::fs::write(&a.out, chart.svg_with(900.0, 480.0, &options))
        .map_err(|e| format!("{}: {e}", a.out.display()))?;
    // The table: every step all series share, mean ± sd per series.
    let steps: Vec<u64> = table
        .first()
        .map(|(_, st)| {
            st.keys()
                .filter(|x| table.iter().all(|(_, s)| s.contains_key(x)))
                .copied()
                .collect()
        })
        .unwrap_or_default();
    let quiet = a.json.as_ref().is_some_and(|j| j.is_stdout());
    if !quiet {
        let head: Vec<String> = table
            .iter()
            .map(|(r, _)| format!("{} (mean ± sd of {})", r.name, r.runs.len()))
            .collect();
        println!("| step | {} |", head.join(" | "));
        println!("|---|{}", "---|".repeat(head.len()));
        for x in &steps {
            let cells: Vec<String> = table
                .iter()
                .map(|(_, st)| {
                    let (m, sd, _) = st[x];
                    format!("{m:.4} ± {sd:.4}")
                })
                .collect();
            println!("| {x} | {} |", cells.join(" | "));
        }
        if let Some(target) = a.reach {
            println!(
                "\n| run | first step with {} ≤ {target} | at (s) | training (s) |",
                a.y
            );
            println!("|---|---|---|---|");
            for r in &all {
                for (path, _) in &r.runs {
                    let run = format!(
                        "{} {}",
                        r.name,
                        path.file_stem().unwrap_or_default().to_string_lossy()
                    );
                    match reached(path, &a.y, target) {
                        Some((step, t, training)) => {
                            println!("| {run} | {step} | {t:.2} | {training:.2} |")
                        }
                        None => println!("| {run} | not reached | - | - |"),
                    }
                }
            }
        }
        eprintln!("braid plot: wrote {}", a.out.display());
    }
    if let Some(j) = &a.json {
        let rows: Vec<serde_json::Value> = steps
            .iter()
            .map(|x| {
                let mut row = serde_json::json!({ "step": x });
                for (r, st) in &table {
                    let (m, sd, n) = st[x];
                    row[&r.name] = serde_json::json!({"mean": m, "sd": sd, "runs": n});
                }
                row
            })
            .collect();
        let doc = serde_json::json!({ "y": a.y, "steps": rows });
        j.write(&serde_json::to_string_pretty(&doc).map_err(|e| e.to_string())?)?;
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A target is reached at the first row at or below it; the training
    /// time sums the steps' own times to it, the elapsed time is the row's.
    #[test]
    fn a_loss_is_reached_at_its_first_row_with_the_training_time_to_it() {
        let rows: Vec<serde_json::Value> = [
            (1, 4.0, 0.5, 0.5),
            (2, 3.0, 0.5, 3.0), // an evaluation paused the run 2 s
            (3, 2.0, 0.5, 3.5),
        ]
        .iter()
        .map(|&(step, loss, step_s, elapsed_s)| {
            serde_json::json!({"step": step, "loss": loss, "step_s": step_s, "elapsed_s": elapsed_s})
        })
        .collect();
        assert_eq!(reached_in(&rows, "loss", 3.0), Some((2.0, 3.0, 1.0)));
        assert_eq!(reached_in(&rows, "loss", 2.5), Some((3.0, 3.5, 1.5)));
        assert_eq!(reached_in(&rows, "loss", 1.0), None);
        assert_eq!(reached_in(&rows, "eval_loss", 9.0), None);
    }

    #[test]
    fn series_are_averaged_over_the_steps_every_run_has() {
        let r = Runs {
            name: "a".into(),
            runs: vec![
                ("1".into(), vec![(100.0, 3.0), (200.0, 2.0)]),
                ("2".into(), vec![(100.0, 5.0)]),
            ],
            xs: Vec::new(),
        };
        let st = stats(&r);
        assert_eq!(st.len(), 1);
        let (m, sd, n) = st[&100];
        assert_eq!((m, n), (4.0, 2));
        assert!((sd - 2f64.sqrt()).abs() < 1e-12);
        assert!(parse_series("nofiles", "eval_loss", "step").is_err());
        assert!(parse_series("a=/nonexistent.json", "eval_loss", "step")
            .err()
            .unwrap()
            .contains("/nonexistent.json"));
    }
}
