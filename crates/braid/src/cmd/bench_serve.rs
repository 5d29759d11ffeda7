//! `braid bench serve`: load on an OpenAI-compatible completions endpoint
//! (`braid serve`, vLLM, ...) in the shape of `vllm bench serve`, through
//! braid-serve's load generator: request throughput, output tokens/s,
//! TTFT, TPOT, ITL and end-to-end latency; `--json` for the figures.

use braid_serve::loadgen::{run, LoadOptions};
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
        --output-len 128 --json out.json\n\n\
        Prompts are random token ids (below --vocab) of --input-len tokens, each request streamed \
        with temperature 0 and max_tokens --output-len; arrivals are Poisson at --request-rate \
        (inf: all at once), at most --max-concurrency in flight."
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
    #[arg(long, default_value = "inf")]
    request_rate: f64,
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
    /// Write the figures as JSON here.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
}

/// Runs `braid bench serve`.
pub fn run_bench_serve(a: BenchServeArgs) -> Result<i32, String> {
    let options = LoadOptions {
        base_url: a.url.trim_end_matches('/').to_string(),
        model: a.model,
        api_key: a.api_key,
        num_prompts: a.num_prompts,
        request_rate: a.request_rate,
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
    let report = rt.block_on(run(options))?;
    println!("{}", report.text());
    if let Some(path) = a.json {
        let text = serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?;
        std::fs::write(&path, text + "\n")
            .map_err(|e| format!("--json {}: {e}", path.display()))?;
    }
    Ok(if report.failed == 0 { 0 } else { 1 })
}
