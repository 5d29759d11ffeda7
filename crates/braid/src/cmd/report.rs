//! `braid report DIR`: the distributed-training analysis of a traced run
//! (`braid train --trace DIR`) — the course's report sections with their
//! figures, in the terminal, as JSON (`--json`) or as one self-contained
//! HTML page with plots (`--html FILE`). Other runs' trace directories
//! (`--compare`) add the scaling curve; `braid bench --json` files
//! (`--bench`) add the backend comparison.

use braid_trace::format::{self, RankTrace};
use braid_trace::report::{self, Inputs};
use clap::Args;
use std::path::PathBuf;

/// Analyse a traced run.
#[derive(Args)]
#[command(
    about = "Analyse a traced run: time breakdown, communication, stragglers, bottleneck, suggestions",
    after_help = "Examples:\n  braid train --nproc 4 --trace tr && braid report tr\n  braid report tr --json\n  braid report tr4 --compare tr1 --compare tr2 --bench shm.json --bench tcp.json --html report.html"
)]
pub struct ReportArgs {
    /// The run's trace directory (`braid train --trace DIR`).
    dir: PathBuf,
    /// Trace directories of the same model at other world sizes (the
    /// scaling curve).
    #[arg(long, value_name = "DIR")]
    compare: Vec<PathBuf>,
    /// `braid bench --json` files (the backend comparison: bus bandwidth
    /// against message size per backend).
    #[arg(long, value_name = "FILE")]
    bench: Vec<PathBuf>,
    /// The report as JSON.
    #[arg(long, value_name = "FILE", num_args = 0..=1, default_missing_value = "-",
          value_parser = super::json_out::parse, help = super::json_out::HELP)]
    json: Option<super::json_out::JsonOut>,
    /// Also write the report as one self-contained HTML page with plots.
    #[arg(long, value_name = "FILE")]
    html: Option<PathBuf>,
}

fn load(dir: &std::path::Path) -> Result<(Vec<RankTrace>, Vec<usize>), String> {
    if dir.is_file() {
        let parent = match dir.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => std::path::Path::new("."),
        };
        let name = dir.file_name().unwrap_or_default().to_string_lossy();
        return Err(format!(
            "{}: a file; braid report reads a trace directory (the DIR of `braid train --trace \
             DIR`, holding trace-rank*.json){}",
            dir.display(),
            match name.starts_with("trace") {
                true => format!(": try `braid report {}`", parent.display()),
                false => String::new(),
            }
        ));
    }
    let (traces, missing) = format::read_dir(dir)?;
    if let Some(t) = traces.iter().find(|t| t.run["steps"].as_array().is_none()) {
        return Err(format!(
            "{}: rank {}'s trace has no training steps (a trace of braid train is needed)",
            dir.display(),
            t.rank
        ));
    }
    Ok((traces, missing))
}

/// `braid plan`'s prediction for the run's layout beside its median step
/// (rank 0's), where the run recorded one it can be made for (a bf16 run
/// on a GPU braid has a description of).
fn plan_beside(traces: &[RankTrace]) -> Option<(String, serde_json::Value)> {
    let t = traces.iter().find(|t| t.rank == 0).or(traces.first())?;
    let layout: super::train_plan::RunLayout =
        serde_json::from_value(t.run["desc"]["layout"].clone()).ok()?;
    let measured = t.run["summary"]["median_step_s"].as_f64()?;
    super::train_plan::beside(&layout, measured)
}

/// Runs `braid report`.
pub fn run(a: ReportArgs) -> Result<i32, String> {
    // The outputs first, so that a bad path is not found after the work.
    if let Some(j) = &a.json {
        j.check()?;
    }
    super::train_ckpt::check_outputs(&[("--html", a.html.as_deref())])?;
    let (traces, missing) = load(&a.dir)?;
    let mut others = Vec::new();
    for d in &a.compare {
        others.push(load(d)?.0);
    }
    let mut bench = Vec::new();
    for f in &a.bench {
        let text = std::fs::read_to_string(f)
            .map_err(|e| format!("--bench {}: cannot read: {e}", f.display()))?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
            format!(
                "--bench {}: not a braid bench --json file ({e})",
                f.display()
            )
        })?;
        match v {
            serde_json::Value::Array(rows) => bench.extend(rows),
            _ => {
                return Err(format!(
                    "--bench {}: expected a JSON array of rows (braid bench --json)",
                    f.display()
                ))
            }
        }
    }
    let r = report::build(&Inputs {
        traces: &traces,
        missing: &missing,
        others: &others,
        bench: &bench,
    });
    let json_only = a.json.as_ref().is_some_and(|j| j.is_stdout());
    let plan = plan_beside(&traces);
    if let Some(out) = &a.json {
        let mut doc = serde_json::to_value(&r).expect("json");
        if let Some((_, p)) = &plan {
            doc["plan"] = p.clone();
        }
        out.write(&serde_json::to_string_pretty(&doc).expect("json"))?;
    }
    if !json_only {
        print!("{}", report::render_text(&r));
        if let Some((line, _)) = &plan {
            println!("{line}");
        }
        if !missing.is_empty() {
            eprintln!(
                "braid: warning: ranks {missing:?} left no trace in {} (did they fail?)",
                a.dir.display()
            );
        }
    }
    if let Some(path) = &a.html {
        let page = super::report_html::page(&r, &traces);
        std::fs::write(path, page)
            .map_err(|e| format!("--html {}: cannot write: {e}", path.display()))?;
        if !json_only {
            println!("wrote {}", path.display());
        }
    }
    Ok(0)
}
