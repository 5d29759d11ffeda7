//! A load generator for any OpenAI-compatible completions endpoint, in
//! the shape of `vllm bench serve` ([`run`]): random prompts of a given
//! length (token ids), sent at a request rate with Poisson arrivals (or
//! all at once) under an optional concurrency bound, each streamed; what
//! comes back is timed per token. [`Report`] holds request throughput,
//! output tokens/s, time to first token, time per output token and
//! inter-token latency (mean, median, p99).

use braid_model::rng::Rng;
use futures_util::StreamExt;
use serde::Serialize;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What to send.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// The server's base URL (`http://HOST:PORT`).
    pub base_url: String,
    /// The model name to send (None: the first of `/v1/models`).
    pub model: Option<String>,
    pub api_key: Option<String>,
    pub num_prompts: usize,
    /// Requests per second on average (Poisson arrivals); infinite: all
    /// at once.
    pub request_rate: f64,
    /// Requests in flight at most (None: no bound).
    pub max_concurrency: Option<usize>,
    pub input_len: usize,
    pub output_len: usize,
    /// Prompt token ids are drawn below this.
    pub vocab: u32,
    /// Requests sent first, not counted.
    pub warmup: usize,
    /// Sends `ignore_eos` (vLLM's) so every request runs `output_len`.
    pub ignore_eos: bool,
    pub seed: u64,
    /// How long one request may take.
    pub timeout: Duration,
}

/// One request's timings.
#[derive(Debug, Clone, Default)]
struct Timed {
    ok: bool,
    error: Option<String>,
    ttft: f64,
    latency: f64,
    output_tokens: usize,
    /// Gaps between tokens after the first.
    itl: Vec<f64>,
}

/// Mean, median and 99th percentile, in milliseconds.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Spread {
    pub mean_ms: f64,
    pub median_ms: f64,
    pub p99_ms: f64,
}

impl Spread {
    fn of(seconds: &[f64]) -> Spread {
        if seconds.is_empty() {
            return Spread::default();
        }
        let mut v: Vec<f64> = seconds.iter().map(|s| s * 1e3).collect();
        v.sort_by(f64::total_cmp);
        let at = |q: f64| v[((q * (v.len() - 1) as f64).round() as usize).min(v.len() - 1)];
        Spread {
            mean_ms: v.iter().sum::<f64>() / v.len() as f64,
            median_ms: at(0.5),
            p99_ms: at(0.99),
        }
    }
}

/// What a run measured.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub base_url: String,
    pub model: String,
    pub num_prompts: usize,
    pub completed: usize,
    pub failed: usize,
    /// The first failures' messages (at most 5).
    pub errors: Vec<String>,
    pub request_rate: Option<f64>,
    pub max_concurrency: Option<usize>,
    pub input_len: usize,
    pub output_len: usize,
    pub duration_s: f64,
    pub total_input_tokens: usize,
    pub total_output_tokens: usize,
    pub request_throughput: f64,
    pub output_throughput: f64,
    pub total_token_throughput: f64,
    pub ttft: Spread,
    pub tpot: Spread,
    pub itl: Spread,
    pub e2el: Spread,
}

impl Report {
    /// The table `vllm bench serve` prints, in its words.
    pub fn text(&self) -> String {
        let mut s = String::new();
        let line = |s: &mut String, k: &str, v: String| *s += &format!("{k:<40}{v:>12}\n");
        s += &format!("{:=^52}\n", " Serving Benchmark Result ");
        line(&mut s, "Successful requests:", self.completed.to_string());
        line(&mut s, "Failed requests:", self.failed.to_string());
        if let Some(c) = self.max_concurrency {
            line(&mut s, "Maximum request concurrency:", c.to_string());
        }
        if let Some(r) = self.request_rate {
            line(&mut s, "Request rate (req/s):", format!("{r:.2}"));
        }
        line(
            &mut s,
            "Benchmark duration (s):",
            format!("{:.2}", self.duration_s),
        );
        line(
            &mut s,
            "Total input tokens:",
            self.total_input_tokens.to_string(),
        );
        line(
            &mut s,
            "Total generated tokens:",
            self.total_output_tokens.to_string(),
        );
        line(
            &mut s,
            "Request throughput (req/s):",
            format!("{:.2}", self.request_throughput),
        );
        line(
            &mut s,
            "Output token throughput (tok/s):",
            format!("{:.2}", self.output_throughput),
        );
        line(
            &mut s,
            "Total token throughput (tok/s):",
            format!("{:.2}", self.total_token_throughput),
        );
        for (title, name, v) in [
            ("Time to First Token", "TTFT", self.ttft),
            ("Time per Output Token (excl. 1st token)", "TPOT", self.tpot),
            ("Inter-token Latency", "ITL", self.itl),
            ("End-to-end Latency", "E2EL", self.e2el),
        ] {
            s += &format!("{:-^52}\n", format!(" {title} "));
            line(
                &mut s,
                &format!("Mean {name} (ms):"),
                format!("{:.2}", v.mean_ms),
            );
            line(
                &mut s,
                &format!("Median {name} (ms):"),
                format!("{:.2}", v.median_ms),
            );
            line(
                &mut s,
                &format!("P99 {name} (ms):"),
                format!("{:.2}", v.p99_ms),
            );
        }
        s += &"=".repeat(52);
        for e in &self.errors {
            s += &format!("\nfailed: {e}");
        }
        s
    }
}

/// The model `/v1/models` lists first.
async fn first_model(c: &reqwest::Client, o: &LoadOptions) -> Result<String, String> {
    let url = format!("{}/v1/models", o.base_url);
    let mut r = c.get(&url);
    if let Some(k) = &o.api_key {
        r = r.bearer_auth(k);
    }
    let r = r
        .send()
        .await
        .map_err(|e| format!("{url}: {e} (is the server up?)"))?;
    let status = r.status();
    let v: Value = r.json().await.map_err(|e| format!("{url}: {e}"))?;
    if !status.is_success() {
        return Err(format!("{url}: {status}: {v}"));
    }
    v["data"][0]["id"]
        .as_str()
        .map(String::from)
        .ok_or_else(|| format!("{url} lists no model: {v}"))
}

/// One streamed request.
async fn one(c: &reqwest::Client, o: &LoadOptions, model: &str, prompt: Vec<u32>) -> Timed {
    let mut body = json!({
        "model": model,
        "prompt": prompt,
        "max_tokens": o.output_len,
        "temperature": 0,
        "stream": true,
    });
    if o.ignore_eos {
        body["ignore_eos"] = json!(true);
    }
    let url = format!("{}/v1/completions", o.base_url);
    let mut r = c.post(&url).json(&body).timeout(o.timeout);
    if let Some(k) = &o.api_key {
        r = r.bearer_auth(k);
    }
    let t0 = Instant::now();
    let fail = |e: String| Timed {
        error: Some(e),
        ..Default::default()
    };
    let resp = match r.send().await {
        Ok(r) => r,
        Err(e) => return fail(format!("{url}: {e}")),
    };
    if !resp.status().is_success() {
        let status = resp.status();
        let text = resp.text().await.unwrap_or_default();
        return fail(format!("{status}: {}", text.trim()));
    }
    let mut t = Timed::default();
    let mut last = None;
    let mut pending = String::new();
    let mut stream = resp.bytes_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = match chunk {
            Ok(c) => c,
            Err(e) => return fail(format!("the stream broke: {e}")),
        };
        pending += &String::from_utf8_lossy(&chunk);
        while let Some(end) = pending.find("\n\n") {
            let event: String = pending.drain(..end + 2).collect();
            for data in event.lines().filter_map(|l| l.strip_prefix("data: ")) {
                if data == "[DONE]" {
                    t.ok = true;
                    continue;
                }
                let v: Value = match serde_json::from_str(data) {
                    Ok(v) => v,
                    Err(e) => return fail(format!("a chunk is not JSON ({e}): {data}")),
                };
                if let Some(m) = v["error"]["message"].as_str() {
                    return fail(m.to_string());
                }
                let c = &v["choices"][0];
                let text = c["text"].as_str().unwrap_or_default();
                // A closing chunk with no text carries no token.
                if text.is_empty() && !c["finish_reason"].is_null() {
                    continue;
                }
                let now = t0.elapsed().as_secs_f64();
                match last {
                    None => t.ttft = now,
                    Some(l) => t.itl.push(now - l),
                }
                last = Some(now);
                t.output_tokens += 1;
            }
        }
    }
    t.latency = t0.elapsed().as_secs_f64();
    if !t.ok {
        return fail("the stream ended without [DONE]".into());
    }
    t
}

/// Runs the load: warm-up requests first, then `num_prompts` at the rate.
pub async fn run(o: LoadOptions) -> Result<Report, String> {
    if o.num_prompts == 0 || o.input_len == 0 || o.output_len == 0 {
        return Err("--num-prompts, --input-len and --output-len must each be at least 1".into());
    }
    if o.request_rate.is_nan() || o.request_rate <= 0.0 {
        return Err(format!(
            "--request-rate {}: a positive rate (inf: every request at once)",
            o.request_rate
        ));
    }
    let c = reqwest::Client::new();
    let model = match &o.model {
        Some(m) => m.clone(),
        None => first_model(&c, &o).await?,
    };
    let mut rng = Rng::new(o.seed);
    let mut prompt = || -> Vec<u32> {
        (0..o.input_len)
            .map(|_| rng.below(o.vocab.max(1) as usize) as u32)
            .collect()
    };
    for _ in 0..o.warmup {
        let t = one(&c, &o, &model, prompt()).await;
        if let Some(e) = t.error {
            return Err(format!("the warm-up request failed: {e}"));
        }
    }
    let prompts: Vec<Vec<u32>> = (0..o.num_prompts).map(|_| prompt()).collect();
    let mut gaps = Rng::new(o.seed ^ 0x9e37_79b9);
    let limit = Arc::new(tokio::sync::Semaphore::new(
        o.max_concurrency
            .unwrap_or(tokio::sync::Semaphore::MAX_PERMITS),
    ));
    let shared = Arc::new((c, o.clone(), model.clone()));
    let start = Instant::now();
    let mut tasks = Vec::new();
    let mut at = 0.0f64;
    for p in prompts {
        if o.request_rate.is_finite() {
            // Exponential gaps: Poisson arrivals at the rate.
            let u = (gaps.below(1 << 30) as f64 + 0.5) / (1u64 << 30) as f64;
            at += -u.ln() / o.request_rate;
            let wait = Duration::from_secs_f64(at).saturating_sub(start.elapsed());
            tokio::time::sleep(wait).await;
        }
        let permit = limit
            .clone()
            .acquire_owned()
            .await
            .map_err(|e| e.to_string())?;
        let s = shared.clone();
        tasks.push(tokio::spawn(async move {
            let t = one(&s.0, &s.1, &s.2, p).await;
            drop(permit);
            t
        }));
    }
    let mut done = Vec::new();
    for t in tasks {
        done.push(t.await.map_err(|e| format!("a request task failed: {e}"))?);
    }
    let duration = start.elapsed().as_secs_f64();
    let ok: Vec<&Timed> = done.iter().filter(|t| t.error.is_none()).collect();
    let out: usize = ok.iter().map(|t| t.output_tokens).sum();
    let inputs = ok.len() * o.input_len;
    let tpot: Vec<f64> = ok
        .iter()
        .filter(|t| t.output_tokens > 1)
        .map(|t| (t.latency - t.ttft) / (t.output_tokens - 1) as f64)
        .collect();
    Ok(Report {
        base_url: o.base_url.clone(),
        model,
        num_prompts: o.num_prompts,
        completed: ok.len(),
        failed: done.len() - ok.len(),
        errors: done
            .iter()
            .filter_map(|t| t.error.clone())
            .take(5)
            .collect(),
        request_rate: o.request_rate.is_finite().then_some(o.request_rate),
        max_concurrency: o.max_concurrency,
        input_len: o.input_len,
        output_len: o.output_len,
        duration_s: duration,
        total_input_tokens: inputs,
        total_output_tokens: out,
        request_throughput: ok.len() as f64 / duration,
        output_throughput: out as f64 / duration,
        total_token_throughput: (out + inputs) as f64 / duration,
        ttft: Spread::of(&ok.iter().map(|t| t.ttft).collect::<Vec<_>>()),
        tpot: Spread::of(&tpot),
        itl: Spread::of(&ok.iter().flat_map(|t| t.itl.clone()).collect::<Vec<_>>()),
        e2el: Spread::of(&ok.iter().map(|t| t.latency).collect::<Vec<_>>()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_spread_is_mean_median_and_p99_in_milliseconds() {
        let s = Spread::of(&[0.001, 0.002, 0.003, 0.004, 0.100]);
        assert!((s.mean_ms - 22.0).abs() < 1e-9);
        assert_eq!(s.median_ms, 3.0);
        assert_eq!(s.p99_ms, 100.0);
        assert_eq!(Spread::of(&[]).mean_ms, 0.0);
    }
}
