//! `braid bench serve`: load on an OpenAI-compatible completions endpoint
//! (`braid serve`, vLLM, ...) in the shape of `vllm bench serve`, through
//! braid-serve's load generator: request throughput, output tokens/s,
//! TTFT, TPOT, ITL and end-to-end latency; `--json` for the figures.
//! Several request rates (`--request-rate 1,2,4,inf`) run one after
//! another: a table of the sweep, and `--plot` draws the serving curve
//! (output tokens/s against the 99th percentile of the time to first
//! token), from light load to saturation.

use super::svg::{Chart, Options, Series, XAxis};
use braid_serve::loadgen::{run, LoadOptions, Report};
use clap::Parser;
use std::path::PathBuf;
use std::time::Duration;

/// Load a serving endpoint and time it.
#[derive(Parser)]
#[command(
    name = "braid bench serve",
    about = "Load an OpenAI-compatible completions endpoint and time it (like vllm bench serve)",
    after_help = "Examples:\n  \
        braid bench serve --url http://127.0.0.1:8000 --num-prompts 200 --request-rate 8\n  \
        braid bench serve --base-url http://127.0.0.1:8000 --max-concurrency 16 --input-len 128 \
        --output-len 128 --json out.json\n  \
        braid bench serve --url http://127.0.0.1:8000 --request-rate 1,2,4,8,inf --plot curve.svg\n\n\
        Prompts are random token ids (below --vocab) of --input-len tokens, each request streamed \
        with temperature 0 and max_tokens --output-len; arrivals are Poisson at --request-rate \
        (inf: all at once), at most --max-concurrency in flight. A list of rates runs each in \
        turn (its own warm-up and prompts) and prints the sweep; --plot draws output tokens/s \
        against the p99 time to first token, one point per rate."
)]
pub struct BenchServeArgs {
    /// The server (http://HOST:PORT).
    #[arg(long, visible_alias = "base-url", value_name = "URL")]
    url: String,
    /// The model to ask for (default: the first /v1/models lists).
    #[arg(long)]
    model: Option<String>,
    /// Bearer key for the server.
    #[arg(long, env = "BRAID_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    #[arg(long, default_value_t = 100)]
    num_prompts: usize,
    /// Requests a second on average (Poisson arrivals); inf: all at once.
    /// A list (1,2,4,inf) runs each rate in turn: a sweep.
    #[arg(long, default_value = "inf", value_name = "RATE[,RATE...]")]
    request_rate: String,
    /// Requests in flight at most.
    #[arg(long)]
    max_concurrency: Option<usize>,
    /// Prompt tokens per request.
    #[arg(long, default_value_t = 128)]
    input_len: usize,
    /// Tokens asked for per request.
    #[arg(long, default_value_t = 128)]
    output_len: usize,
    /// Prompt token ids are drawn below this (256 fits every tokenizer).
    #[arg(long, default_value_t = 256)]
    vocab: u32,
    /// Requests sent before the timed ones.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Send vLLM's ignore_eos so that every request runs --output-len
    /// (braid serve refuses the field).
    #[arg(long)]
    ignore_eos: bool,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Seconds one request may take.
    #[arg(long, default_value_t = 600)]
    timeout: u64,
    /// Write the figures as JSON here (a sweep: {"sweep": [one per rate]}).
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Draw the serving curve here (SVG): output tokens/s against the p99
    /// time to first token, a point per --request-rate.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,
}

/// `--request-rate`'s rates: each above 0, or inf.
fn rates_of(text: &str) -> Result<Vec<f64>, String> {
    let bad = |r: &str| {
        format!(
            "--request-rate {text}: {r:?} is not a rate (requests a second above 0, or inf; a \
             sweep lists several: 1,2,4,inf)"
        )
    };
    text.split(',')
        .map(|r| {
            let r = r.trim();
            match r {
                "inf" | "Inf" | "infinity" => Ok(f64::INFINITY),
                _ => r
                    .parse::<f64>()
                    .ok()
                    .filter(|v| *v > 0.0 && v.is_finite())
                    .ok_or_else(|| bad(r)),
            }
        })
        .collect()
}

/// The sweep's table: a row per rate.
fn sweep_table(reports: &[Report]) -> String {
    let mut s = format!(
        "{:=^86}\n{:>10} {:>10} {:>9} {:>12} {:>11} {:>11} {:>11} {:>8}\n",
        " Serving Sweep ",
        "rate",
        "req/s",
        "done",
        "out tok/s",
        "TTFT p50",
        "TTFT p99",
        "TPOT p50",
        "failed"
    );
    for r in reports {
        let rate = match r.request_rate {
            Some(x) if x.is_finite() => format!("{x:.2}"),
            _ => "inf".into(),
        };
        s += &format!(
            "{rate:>10} {:>10.2} {:>9} {:>12.1} {:>9.1}ms {:>9.1}ms {:>9.1}ms {:>8}\n",
            r.request_throughput,
            r.completed,
            r.output_throughput,
            r.ttft.median_ms,
            r.ttft.p99_ms,
            r.tpot.median_ms,
            r.failed
        );
    }
    s
}

/// The serving curve: output tokens/s (x) against the p99 time to first
/// token (y), a point per rate, in the order run.
fn curve_svg(reports: &[Report]) -> String {
    let mut points: Vec<(f64, f64)> = reports
        .iter()
        .map(|r| (r.output_throughput, r.ttft.p99_ms))
        .collect();
    points.sort_by(|a, b| a.0.total_cmp(&b.0));
    let first = &reports[0];
    let chart = Chart {
        title: format!(
            "{} at {}: {} prompts of {} tokens, {} out",
            first.model, first.base_url, first.num_prompts, first.input_len, first.output_len
        ),
        x_label: "output tokens/s".into(),
        y_label: "time to first token, p99 (ms)".into(),
        series: vec![Series {
            name: "one point per request rate".into(),
            color: "#1f77b4",
            dashed: false,
            points,
        }],
    };
    chart.svg_with(
        720.0,
        420.0,
        &Options {
            x_axis: XAxis::Linear,
            ..Default::default()
        },
    )
}

/// Runs `braid bench serve`.
pub fn run_bench_serve(a: BenchServeArgs) -> Result<i32, String> {
    let rates = rates_of(&a.request_rate)?;
    let mut options = LoadOptions {
        base_url: a.url.trim_end_matches('/').to_string(),
        model: a.model,
        api_key: a.api_key,
        num_prompts: a.num_prompts,
        request_rate: rates[0],
        max_concurrency: a.max_concurrency,
        input_len: a.input_len,
        output_len: a.output_len,
        vocab: a.vocab,
        warmup: a.warmup,
        ignore_eos: a.ignore_eos,
        seed: a.seed,
        timeout: Duration::from_secs(a.timeout.max(1)),
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("starting the client runtime: {e}"))?;
    let mut reports = Vec::new();
    for (i, &rate) in rates.iter().enumerate() {
        if rates.len() > 1 {
            eprintln!(
                "braid bench serve: rate {} of {}: {} requests a second",
                i + 1,
                rates.len(),
                if rate.is_finite() {
                    format!("{rate}")
                } else {
                    "inf".into()
                }
            );
        }
        options.request_rate = rate;
        let report = rt.block_on(run(options.clone()))?;
        println!("{}", report.text());
        reports.push(report);
    }
    if reports.len() > 1 {
        println!("{}", sweep_table(&reports));
    }
    if let Some(path) = &a.json {
        let text = match reports.as_slice() {
            [one] => serde_json::to_string_pretty(one),
            all => serde_json::to_string_pretty(&serde_json::json!({ "sweep": all })),
        }
        .map_err(|e| e.to_string())?;
        std::fs::write(path, text + "\n").map_err(|e| format!("--json {}: {e}", path.display()))?;
    }
    if let Some(path) = &a.plot {
        std::fs::write(path, curve_svg(&reports))
            .map_err(|e| format!("--plot {}: {e}", path.display()))?;
        println!("curve: {}", path.display());
    }
    let failed: usize = reports.iter().map(|r| r.failed).sum();
    Ok(if failed == 0 { 0 } else { 1 })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_are_read_one_or_a_sweep_and_bad_ones_named() {
        assert_eq!(rates_of("inf").unwrap(), vec![f64::INFINITY]);
        assert_eq!(
            rates_of("1, 2.5,inf").unwrap(),
            vec![1.0, 2.5, f64::INFINITY]
        );
        for bad in ["0", "-1", "x", "1,,2", "nan"] {
            let e = rates_of(bad).unwrap_err();
            assert!(e.contains("is not a rate"), "{bad}: {e}");
        }
    }
}
