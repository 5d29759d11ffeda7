//! `braid train` and `braid generate`: the training engine on this
//! machine's CPUs (single process), and sampling from a saved model.

use braid_model::checkpoint;
use braid_model::data::{Dataset, Source, Tokenizer};
use braid_model::optim::Schedule;
use braid_model::{GptConfig, Layout, Params};
use braid_train::engines::{CpuGpt, CpuOptimizer, GpuGpt, Precision, TokenBatch};
use braid_train::loader::{check_fits, RandomWindows};
use braid_train::{train, Engine, LoopOptions, Single, StepReport};
use clap::Args;
use std::path::PathBuf;
use std::sync::Arc;

/// Train a GPT model on the CPU.
#[derive(Args)]
#[command(
    about = "Train a GPT-2 family model on this machine's CPUs",
    after_help = "Examples:\n  braid train                                   # tiny model, synthetic data\n  braid train --model L4-H4-C128 --steps 1000 --save tiny.safetensors\n  braid train --model 124M --data shards/ --tokenizer gpt2 --batch 4 --seq 256"
)]
pub struct TrainArgs {
    /// tiny, 124M, 350M, 774M, 1558M, or L<layers>-H<heads>-C<width>[-V<vocab>][-T<context>].
    #[arg(long, default_value = "tiny")]
    model: String,
    /// synthetic, random (uniform tokens, for throughput), a UTF-8 text file, or u16 token shards (.bin file or directory).
    #[arg(long, default_value = "synthetic")]
    data: String,
    /// bytes or gpt2 (default: bytes for a 256-token vocabulary, else gpt2).
    #[arg(long)]
    tokenizer: Option<String>,
    /// Training steps.
    #[arg(long, default_value_t = 400)]
    steps: usize,
    /// Sequences per batch.
    #[arg(long, default_value_t = 16)]
    batch: usize,
    /// Tokens per sequence (at most the model's context).
    #[arg(long, default_value_t = 64)]
    seq: usize,
    /// Peak learning rate (default: by model size, 3e-3 below 50M
    /// parameters, then GPT-3's choices: 6e-4 for 124M, 3e-4 for 350M,
    /// 2.5e-4 for 774M, 2e-4 above).
    #[arg(long)]
    lr: Option<f32>,
    /// Warmup steps.
    #[arg(long, default_value_t = 20)]
    warmup: usize,
    /// Weight decay on matrices and embeddings.
    #[arg(long, default_value_t = 0.1)]
    weight_decay: f32,
    /// Clip the gradients' global norm (0: off).
    #[arg(long, default_value_t = 1.0)]
    grad_clip: f64,
    /// adamw or sgd.
    #[arg(long, default_value = "adamw")]
    optimizer: String,
    /// Seed of initialisation, data and sampling.
    #[arg(long, default_value_t = 1337)]
    seed: u64,
    /// Evaluate on held-out data every K steps and at the end (0: never).
    #[arg(long, default_value_t = 100)]
    eval_every: usize,
    /// Recompute activations in the backward pass (less memory).
    #[arg(long)]
    checkpointing: bool,
    /// Print a progress line every K steps (default: about once a second).
    #[arg(long)]
    log_every: Option<usize>,
    /// Start from this checkpoint instead of a fresh initialisation.
    #[arg(long)]
    load: Option<PathBuf>,
    /// Save the trained model (safetensors) here.
    #[arg(long)]
    save: Option<PathBuf>,
    /// Element type of the saved checkpoint: f32 or bf16.
    #[arg(long, default_value = "f32")]
    save_dtype: String,
    /// Also write every step (loss, eval loss, lr, norm, tokens/s) as JSON here.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Where to train: cpu, or cuda (one GPU; LOCAL_RANK picks it).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Arithmetic on the GPU: bf16 (mixed precision: bf16 products and
    /// activations, f32 master weights; the default on cuda) or f32. The
    /// CPU engine is f32.
    #[arg(long)]
    precision: Option<String>,
    /// Benchmark mode: time forward + backward only (no optimizer step).
    #[arg(long)]
    fwd_bwd_only: bool,
}

/// Sample text from a saved model.
#[derive(Args)]
#[command(
    about = "Continue a prompt with a model saved by `braid train --save`",
    after_help = "Example:\n  braid generate --load tiny.safetensors --prompt 'the quick' --tokens 80"
)]
pub struct GenerateArgs {
    /// The checkpoint.
    #[arg(long)]
    load: PathBuf,
    /// Text to continue.
    #[arg(long, default_value = "")]
    prompt: String,
    /// Tokens to generate.
    #[arg(long, default_value_t = 100)]
    tokens: usize,
    /// Sampling temperature (0: always the most likely token).
    #[arg(long, default_value_t = 0.8)]
    temperature: f32,
    /// Sampling seed.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// bytes or gpt2 (default: what the checkpoint was trained with).
    #[arg(long)]
    tokenizer: Option<String>,
}

fn tokenizer_for(
    explicit: Option<&str>,
    saved: Option<&String>,
    vocab: usize,
) -> Result<Tokenizer, String> {
    match explicit.or(saved.map(|s| s.as_str())) {
        Some(t) => Tokenizer::parse(t),
        None if vocab <= 256 => Ok(Tokenizer::Bytes),
        None => Ok(Tokenizer::Gpt2),
    }
}

/// Which optimizer to train with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OptimizerKind {
    AdamW,
    Sgd,
}

fn fmt_duration(secs: f64) -> String {
    let s = secs.max(0.0).round() as u64;
    format!("{}:{:02}", s / 60, s % 60)
}

/// The default peak learning rate for a model of `params` parameters: the
/// small models' 3e-3 below 50M, then the GPT-3 paper's rates for the
/// GPT-2 sizes (Brown et al. 2020, table 2.1), which keep 124M and larger
/// stable with AdamW.
pub fn default_lr(params: usize) -> f32 {
    match params {
        p if p < 50_000_000 => 3e-3,
        p if p < 200_000_000 => 6e-4,
        p if p < 500_000_000 => 3e-4,
        p if p < 1_000_000_000 => 2.5e-4,
        _ => 2e-4,
    }
}

/// Runs `braid train`.
pub fn run_train(a: TrainArgs) -> Result<i32, String> {
    let optimizer = match a.optimizer.as_str() {
        "adamw" => OptimizerKind::AdamW,
        "sgd" => OptimizerKind::Sgd,
        o => return Err(format!("--optimizer {o:?}: expected adamw or sgd")),
    };
    if a.batch == 0 || a.seq == 0 || a.steps == 0 {
        return Err("--batch, --seq and --steps must be positive".into());
    }
    let (mut params, saved_tok) = match &a.load {
        Some(path) => {
            let (p, report) = checkpoint::load(path).map_err(|e| e.to_string())?;
            (p, report.metadata.get("braid.tokenizer").cloned())
        }
        None => {
            let cfg = GptConfig::parse(&a.model)?;
            (Params::init_gpt2(Arc::new(Layout::new(&cfg)), a.seed), None)
        }
    };
    let cfg = params.layout.config;
    let lr = a.lr.unwrap_or_else(|| default_lr(cfg.num_params()));
    let tokenizer = tokenizer_for(a.tokenizer.as_deref(), saved_tok.as_ref(), cfg.vocab_size)?;
    let source = Source::parse(&a.data)?;
    let data = Dataset::load(&source, tokenizer, a.seed)?;
    let cuda = if super::wants_cuda(&a.device)? {
        if optimizer != OptimizerKind::AdamW {
            return Err("--device cuda trains with adamw only (so far)".into());
        }
        Some(Precision::parse(a.precision.as_deref().unwrap_or("bf16"))?)
    } else {
        if let Some(p) = a
            .precision
            .as_deref()
            .filter(|p| Precision::parse(p) != Ok(Precision::F32))
        {
            return Err(format!(
                "--precision {p}: the CPU engine trains in f32 (use --device cuda for bf16)"
            ));
        }
        None
    };
    check_fits(&cfg, a.seq, &data)?;
    let opts = LoopOptions {
        steps: a.steps,
        accum: 1,
        schedule: Schedule {
            max_lr: lr,
            min_lr: lr * 0.1,
            warmup: a.warmup.min(a.steps.max(1)),
            total: a.steps,
        },
        grad_clip: a.grad_clip,
        eval_every: a.eval_every,
        eval_batches: 4,
        update: !a.fwd_bwd_only,
        profile_warmup: 5,
        measure_unoverlapped: false,
    };
    println!(
        "braid train: model {} ({} layers, {} heads, width {}, vocab {}, context {}; {:.2}M parameters), data {} ({} tokens, {}), batch {} x {}, {} steps, lr {}, seed {}, {} threads",
        a.model,
        cfg.n_layer,
        cfg.n_head,
        cfg.n_embd,
        cfg.vocab_size,
        cfg.context,
        cfg.num_params() as f64 / 1e6,
        a.data,
        data.len(),
        tokenizer.name(),
        a.batch,
        a.seq,
        a.steps,
        lr,
        a.seed,
        rayon::current_num_threads()
    );
    println!(
        "initial loss should be about ln({}) = {:.3}",
        cfg.vocab_size,
        (cfg.vocab_size as f64).ln()
    );
    let mut last_print = std::time::Instant::now() - std::time::Duration::from_secs(10);
    let mut print_step = |r: &StepReport| {
        let due = match a.log_every {
            Some(k) => (r.step + 1) % k.max(1) == 0,
            None => last_print.elapsed().as_secs_f64() >= 1.0,
        };
        let last = r.step + 1 == opts.steps;
        if due || last || r.step == 0 || r.eval_loss.is_some() {
            last_print = std::time::Instant::now();
            let eta = r.elapsed / (r.step + 1) as f64 * (opts.steps - r.step - 1) as f64;
            let eval = r
                .eval_loss
                .map(|e| format!(" | eval {e:.4}"))
                .unwrap_or_default();
            println!(
                "step {:>5}/{} | loss {:.4}{eval} | lr {:.2e} | norm {:.2} | {:.1}k tok/s | {} elapsed, eta {}",
                r.step + 1,
                opts.steps,
                r.loss,
                r.lr,
                r.grad_norm,
                r.tokens_per_s / 1e3,
                fmt_duration(r.elapsed),
                fmt_duration(eta)
            );
        }
    };
    let mut loader = RandomWindows::new(&data, a.batch, a.seq, a.seed);
    let mut batch = TokenBatch::new(a.batch, a.seq);
    let mut strategy = Single;
    let reports = match cuda {
        None => {
            let how = match optimizer {
                OptimizerKind::AdamW => CpuOptimizer::AdamW {
                    weight_decay: a.weight_decay,
                },
                OptimizerKind::Sgd => CpuOptimizer::Sgd {
                    weight_decay: a.weight_decay,
                },
            };
            let mut engine = CpuGpt::new(params, a.batch, a.seq, a.checkpointing, how);
            let r = train(
                &mut engine,
                &mut strategy,
                &mut loader,
                &mut batch,
                &opts,
                &mut print_step,
            )?;
            params = engine.into_params();
            r.steps
        }
        Some(precision) => {
            let local = braid_core::world::local_rank_from_env().unwrap_or(0);
            let dev = braid_cuda::Device::open(local).map_err(|e| format!("--device cuda: {e}"))?;
            println!(
                "training on GPU {} ({}), {}",
                dev.ordinal(),
                dev.name().unwrap_or_default(),
                precision.name()
            );
            braid_cuda::pool::reset_peak();
            let mut engine = GpuGpt::new(&dev, &params, a.batch, a.seq, precision, a.weight_decay)?;
            let r = train(
                &mut engine,
                &mut strategy,
                &mut loader,
                &mut batch,
                &opts,
                &mut print_step,
            )?;
            if let Some(report) = engine.profile_report() {
                println!("{report}");
            }
            engine.copy_params_to(&mut params)?;
            print_gpu_summary(&r.steps, &cfg, a.batch, a.seq, precision);
            r.steps
        }
    };
    if let Some(path) = &a.json {
        let rows: Vec<serde_json::Value> = reports
            .iter()
            .map(|r| {
                serde_json::json!({"step": r.step + 1, "loss": r.loss, "eval_loss": r.eval_loss, "lr": r.lr,
                    "grad_norm": r.grad_norm, "tokens_per_s": r.tokens_per_s, "elapsed_s": r.elapsed})
            })
            .collect();
        std::fs::write(path, serde_json::to_string_pretty(&rows).expect("json"))
            .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    }
    if a.fwd_bwd_only && reports.len() > 1 {
        let mut tps: Vec<f64> = reports[1..].iter().map(|r| r.tokens_per_s).collect();
        tps.sort_by(|x, y| x.partial_cmp(y).expect("finite"));
        println!(
            "forward+backward: median {:.1} tokens/s over {} steps (first step not counted)",
            tps[tps.len() / 2],
            tps.len()
        );
    }
    if let Some(last) = reports.last() {
        println!(
            "done: final loss {:.4} (ln(vocab)/2 = {:.3}) in {:.1} s",
            last.loss,
            (cfg.vocab_size as f64).ln() / 2.0,
            last.elapsed
        );
    }
    if let Some(path) = &a.save {
        let dtype = braid_core::DType::parse(&a.save_dtype)?;
        checkpoint::save_as(
            &params,
            path,
            dtype,
            &[("braid.tokenizer", tokenizer.name())],
        )
        .map_err(|e| e.to_string())?;
        println!("saved {}", path.display());
    }
    Ok(0)
}

/// Median step time and throughput over the steps after the first five
/// (warm-up), MFU against the H100/H200 bf16 dense peak (989 TFLOP/s) with
/// the PaLM-style count (6 · parameters + 12 · layers · width · sequence
/// FLOPs per token), and the peak of live device buffers.
fn print_gpu_summary(r: &[StepReport], cfg: &GptConfig, b: usize, t: usize, precision: Precision) {
    let warm = if r.len() > 5 {
        5
    } else {
        r.len().saturating_sub(1)
    };
    let mut times: Vec<f64> = r[warm..]
        .iter()
        .map(|x| (b * t) as f64 / x.tokens_per_s)
        .collect();
    if times.is_empty() {
        return;
    }
    times.sort_by(|a, b| a.partial_cmp(b).expect("finite"));
    let med = times[times.len() / 2];
    let tok_s = (b * t) as f64 / med;
    let flops_per_tok =
        6.0 * cfg.num_params() as f64 + 12.0 * (cfg.n_layer * cfg.n_embd * t) as f64;
    let mfu = tok_s * flops_per_tok / 989e12 * 100.0;
    println!(
        "gpu summary: {} | median step {:.1} ms over {} steps (first {warm} not counted) | {:.0} tokens/s | MFU {:.1}% (of 989 TFLOP/s) | peak device memory {:.2} GiB",
        precision.name(),
        med * 1e3,
        times.len(),
        tok_s,
        mfu,
        braid_cuda::pool::peak_allocated_bytes() as f64 / (1u64 << 30) as f64
    );
}

/// Runs `braid generate`.
pub fn run_generate(a: GenerateArgs) -> Result<i32, String> {
    let (params, report) = checkpoint::load(&a.load).map_err(|e| e.to_string())?;
    let tokenizer = tokenizer_for(
        a.tokenizer.as_deref(),
        report.metadata.get("braid.tokenizer"),
        params.layout.config.vocab_size,
    )?;
    if tokenizer.vocab_size() > params.layout.config.vocab_size {
        return Err(format!(
            "tokenizer {} has {} tokens but the model's vocabulary is {}",
            tokenizer.name(),
            tokenizer.vocab_size(),
            params.layout.config.vocab_size
        ));
    }
    let text = braid_model::sample::generate(
        &params,
        tokenizer,
        &a.prompt,
        a.tokens,
        a.temperature,
        a.seed,
    )?;
    println!("{}{}", a.prompt, text);
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::default_lr;
    use braid_model::config::GptConfig;

    #[test]
    fn default_learning_rate_follows_the_model_size() {
        let lr = |m: &str| default_lr(GptConfig::parse(m).expect("valid").num_params());
        assert_eq!(lr("tiny"), 3e-3);
        assert_eq!(lr("124M"), 6e-4);
        assert_eq!(lr("350M"), 3e-4);
        assert_eq!(lr("774M"), 2.5e-4);
        assert_eq!(lr("1558M"), 2e-4);
    }
}
