//! `braid generate`: text from a trained model, on the CPU or one GPU — a
//! safetensors file (`braid train --save`, `braid ckpt consolidate`, a
//! Hugging Face `model.safetensors`) or a sharded checkpoint
//! (`braid train --ckpt-dir`), whose ranks' pieces are assembled in memory
//! as `braid ckpt consolidate` assembles them. stdout carries only the
//! prompt and its continuation; notes and the closing rate line (prompt
//! and new tokens, time to first token, tokens/s) go to stderr.
//!
//! Where both commands decode ([`decoding_device`], [`decoder`]) lives
//! here too: `braid serve` decodes as `braid generate` does.

use super::ckpt;
use super::train::tokenizer_for;
use braid_core::DType;
use braid_data::tokens::Tokenizer;
use braid_model::checkpoint;
use braid_model::cuda::decode::{GpuKvPages, KvDtype};
use braid_model::sample::{self, Sampler, Sampling};
use braid_model::Params;
use braid_serve::offline::complete;
use braid_serve::{Batcher, BatcherOptions, CpuDecoder, CudaDecoder, Decoder, Finish, Request};
use braid_train::checkpoint::load::resolve;
use braid_train::checkpoint::{CheckpointReader, LATEST, MANIFEST};
use clap::Args;
use std::path::{Path, PathBuf};

/// What `--load` accepts, for the errors that find something else.
const ACCEPTED: &str = "--load takes a safetensors file (`braid train --save`, \
    `braid ckpt consolidate`, a Hugging Face model.safetensors), a directory holding a \
    model.safetensors, or a `braid train --ckpt-dir` directory (its newest checkpoint) or one \
    of its step-NNNNNNNN directories";

/// Sample text from a trained model.
#[derive(Args)]
#[command(
    about = "Continue a prompt with a trained model (a --save file or a --ckpt-dir), on the CPU or a GPU",
    after_help = "Examples:\n  \
        braid generate --load tiny.safetensors --prompt 'the quick' --tokens 80\n  \
        braid generate --load ck --prompt 'the quick'           # --ckpt-dir ck's newest checkpoint\n  \
        braid generate --load ck/step-00000100 --temperature 0  # greedy\n  \
        braid generate --load gpt2/model.safetensors --top-k 40 --top-p 0.9 --seed 7\n  \
        braid generate --load tiny.safetensors --prompts prompts.txt --tokens 40 --temperature 0\n\n\
        The text goes to stdout; the rate line (prompt and new tokens, time to first token, tokens/s) \
        to stderr. Decoding runs with a paged KV cache, the engine `braid serve` runs (--prompts: \
        every prompt decoded together, continuous batching), on the CPU, or on one GPU in f32 with \
        --device cuda (--device auto, the default, takes a GPU where there is one). A prompt and \
        its new tokens that pass the model's context are predicted from the last context tokens \
        instead, on the CPU (a note says so), the whole window recomputed for each token."
)]
pub struct GenerateArgs {
    /// The model: a safetensors file, a directory holding a
    /// model.safetensors, or a `braid train --ckpt-dir` directory (its
    /// newest checkpoint) or one of its step-NNNNNNNN directories.
    #[arg(long, value_name = "PATH")]
    load: PathBuf,
    /// Text to continue.
    #[arg(long, default_value = "")]
    prompt: String,
    /// Tokens to generate (0: print the prompt).
    #[arg(long, default_value_t = 100)]
    tokens: usize,
    /// Sampling temperature, >= 0 (0: greedy, always the most likely token).
    #[arg(
        long,
        value_name = "T",
        default_value_t = 0.8,
        allow_negative_numbers = true
    )]
    temperature: f32,
    /// Sample from the K most likely tokens only (0: off; 1: greedy).
    #[arg(long, value_name = "K", default_value_t = 0, value_parser = parse_top_k,
          allow_negative_numbers = true)]
    top_k: usize,
    /// Nucleus sampling: from the fewest most likely tokens whose
    /// probability reaches P, in (0, 1] (1: off).
    #[arg(
        long,
        value_name = "P",
        default_value_t = 1.0,
        allow_negative_numbers = true
    )]
    top_p: f32,
    /// Sampling seed (the same seed, model, prompt and flags give the same text).
    #[arg(long, default_value_t = super::DEFAULT_SEED)]
    seed: u64,
    /// bytes or gpt2 (default: what the checkpoint was trained with).
    #[arg(long)]
    tokenizer: Option<String>,
    /// auto, cpu or cuda (cuda: one GPU, LOCAL_RANK's or GPU 0;
    /// auto: a GPU where there is one, else the CPU).
    #[arg(long, default_value = "auto")]
    device: String,
    /// The products' precision on a GPU: bf16 (the weights, each
    /// product's input and the KV cache in bf16, f32 accumulation) or f32
    /// (exact parity with the CPU; auto: bf16 on a GPU; the CPU decodes in
    /// f32).
    #[arg(long, default_value = "auto", value_name = "DTYPE")]
    dtype: String,
    /// A file of prompts, one a line (blank lines skipped), decoded
    /// together; each continuation is a JSON line on stdout, in the file's
    /// order (its text, finish reason, and the prompt's and the
    /// continuation's token ids).
    #[arg(long, value_name = "FILE", conflicts_with = "prompt")]
    prompts: Option<PathBuf>,
    /// With --prompts: sequences decoded at once at most (1: each prompt
    /// alone, in turn; the greedy texts are the same either way).
    #[arg(long, default_value_t = 64, requires = "prompts")]
    max_running: usize,
}

fn parse_top_k(s: &str) -> Result<usize, String> {
    match s.trim().parse::<i64>() {
        Ok(k) if k >= 0 => Ok(k as usize),
        Ok(_) => Err("top-k must be >= 0 (0: off; 1: greedy)".into()),
        Err(_) => Err("expected a whole number of tokens >= 0 (0: off)".into()),
    }
}

/// Where `braid generate` and `braid serve` decode: `--device` resolved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct DecodeOn {
    /// The GPU decoding runs on, if any.
    pub gpu: Option<usize>,
    /// What `--device auto` chose, to say at start.
    pub note: Option<String>,
    /// The products' precision (`--dtype`): f32 on the CPU.
    pub dtype: DType,
    /// The GPU's KV cache element (`BRAID_DECODE_KV`, else the products'
    /// element): f32 on the CPU.
    pub kv: KvDtype,
}

/// Resolves `--device` for decoding: `cpu`; `cuda` (or `gpu`): one GPU,
/// `LOCAL_RANK`'s, else GPU 0 (as `braid train --device cuda` picks),
/// refused with what is missing where there is none; `auto`: a GPU where
/// the driver shows one, else the CPU.
pub(super) fn decoding_device(device: &str, dtype: &str) -> Result<DecodeOn, String> {
    let mut on = placed(device)?;
    on.dtype =
        match (dtype, on.gpu) {
            ("bf16" | "auto", Some(_)) => DType::BF16,
            ("auto", None) | ("f32", _) => DType::F32,
            ("bf16", None) => return Err(
                "--dtype bf16: the CPU decodes in f32 (bf16 products run on a GPU: --device cuda)"
                    .into(),
            ),
            (other, _) => return Err(format!("--dtype {other:?}: expected auto, bf16 or f32")),
        };
    if on.gpu.is_some() {
        on.kv = KvDtype::from_env(on.dtype).map_err(|e| e.to_string())?;
    }
    Ok(on)
}

/// `--device` resolved (in f32 until `--dtype` says).
fn placed(device: &str) -> Result<DecodeOn, String> {
    match device {
        "cpu" => Ok(DecodeOn {
            gpu: None,
            note: None,
            dtype: DType::F32,
            kv: KvDtype::F32,
        }),
        "cuda" | "gpu" => {
            let n = super::gpus_for(device)?;
            Ok(DecodeOn {
                gpu: Some(gpu_of(device, n)?),
                note: None,
                dtype: DType::F32,
                kv: KvDtype::F32,
            })
        }
        "auto" => match braid_cuda::device_count() {
            Ok(n) if n > 0 => {
                let g = gpu_of(device, n)?;
                Ok(DecodeOn {
                    gpu: Some(g),
                    note: Some(format!(
                        "device: cuda, GPU {g} (--device auto: {n} GPU(s) here; --device cpu \
                         decodes on the CPU)"
                    )),
                    dtype: DType::F32,
                    kv: KvDtype::F32,
                })
            }
            _ => Ok(DecodeOn {
                gpu: None,
                note: None,
                dtype: DType::F32,
                kv: KvDtype::F32,
            }),
        },
        other => Err(format!("--device {other:?}: expected auto, cpu or cuda")),
    }
}

/// How `dtype` is said (`bf16`, `f32`).
pub(super) fn dtype_name(dtype: DType) -> &'static str {
    match dtype {
        DType::BF16 => "bf16",
        _ => "f32",
    }
}

/// The GPU one decoding process takes of the `n` here: `LOCAL_RANK`'s,
/// else GPU 0.
fn gpu_of(device: &str, n: usize) -> Result<usize, String> {
    let g = braid_core::world::local_rank_from_env().unwrap_or(0);
    if g >= n {
        return Err(format!(
            "--device {device}: LOCAL_RANK={g} asks for GPU {g}, and this machine shows {n} \
             GPU(s)"
        ));
    }
    Ok(g)
}

/// A decoder of `params` with a KV cache of `blocks` blocks of
/// `block_size` positions where `on` says: on the CPU, or on its GPU in
/// its products' and cache's elements with room for `rows` rows a step.
/// The GPU's free memory is checked first (the parameters and the cache);
/// `hint` says how to ask for less.
pub(super) fn decoder(
    params: Params,
    on: &DecodeOn,
    blocks: usize,
    block_size: usize,
    rows: usize,
    hint: &str,
) -> Result<Box<dyn Decoder + Send>, String> {
    let (dtype, kv_dtype) = (on.dtype, on.kv);
    let Some(g) = on.gpu else {
        return Ok(Box::new(CpuDecoder::new(params, blocks, block_size)?));
    };
    let dev = braid_cuda::Device::open(g).map_err(|e| format!("--device cuda: GPU {g}: {e}"))?;
    // The f32 parameters, and in bf16 their bf16 copy too.
    let weights = (params.data.len() * if dtype == DType::BF16 { 6 } else { 4 }) as u64;
    let kv = (blocks * GpuKvPages::bytes_per_block(&params.layout, block_size, kv_dtype)) as u64;
    if let Ok(free) = dev.free_memory() {
        if weights + kv > free as u64 {
            let b = braid_core::words::bytes;
            return Err(format!(
                "GPU {g} has {} free, and decoding needs {}: the model's parameters ({}{}) and \
                 a KV cache of {blocks} blocks ({}); {hint}",
                b(free as u64),
                b(weights + kv),
                b(weights),
                if dtype == DType::BF16 {
                    ", f32 and bf16"
                } else {
                    ", f32"
                },
                b(kv)
            ));
        }
    }
    let d = CudaDecoder::new(&dev, &params, (blocks, block_size, rows), dtype, kv_dtype)
        .map_err(|e| format!("decoding on GPU {g}: {e}"))?;
    Ok(Box::new(d))
}

/// Where `--load` points.
#[derive(Debug, PartialEq)]
pub(super) enum Source {
    /// One safetensors file.
    File(PathBuf),
    /// A committed sharded checkpoint directory.
    Sharded(PathBuf),
}

/// What `path` is, or why it is none of what `--load` takes.
pub(super) fn locate(path: &Path) -> Result<Source, String> {
    let shown = path.display();
    let meta = match std::fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(format!(
                "--load {shown}: no such file or directory; {ACCEPTED}"
            ))
        }
        Err(e) => return Err(format!("--load {shown}: cannot be read: {e}")),
    };
    if meta.is_file() {
        let parent = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        if parent.join(MANIFEST).is_file() {
            return Err(format!(
                "--load {shown}: one file of the sharded checkpoint {}; --load {} assembles the \
                 whole model from every rank's pieces",
                parent.display(),
                parent.display()
            ));
        }
        if path.file_name().is_some_and(|n| n == LATEST) {
            return Err(format!(
                "--load {shown}: the file naming the newest checkpoint of {}; --load {} reads \
                 that checkpoint",
                parent.display(),
                parent.display()
            ));
        }
        return Ok(Source::File(path.to_path_buf()));
    }
    if !meta.is_dir() {
        return Err(format!(
            "--load {shown}: neither a file nor a directory; {ACCEPTED}"
        ));
    }
    let single = path.join("model.safetensors");
    match (single.is_file(), resolve(path)?) {
        (true, Some(d)) => Err(format!(
            "--load {shown}: holds both a model.safetensors and a sharded checkpoint ({}); name \
             one: --load {} or --load {}",
            d.display(),
            single.display(),
            d.display()
        )),
        (true, None) => Ok(Source::File(single)),
        (false, Some(d)) => Ok(Source::Sharded(d)),
        (false, None) => Err(format!("--load {shown}: {}", describe(path))),
    }
}

/// What the directory `dir`, holding no model `--load` reads, holds.
fn describe(dir: &Path) -> String {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .map(|e| {
                    let name = e.file_name().to_string_lossy().into_owned();
                    if e.path().is_dir() {
                        format!("{name}/")
                    } else {
                        name
                    }
                })
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    if names.is_empty() {
        return format!("an empty directory; {ACCEPTED}");
    }
    let mut what = "a directory with neither a model.safetensors nor a committed checkpoint \
                    (braid-checkpoint.json, or step-NNNNNNNN directories holding one); it holds "
        .to_string();
    let shown = 8;
    what += &names[..names.len().min(shown)].join(", ");
    if names.len() > shown {
        what += &format!(" and {} more", names.len() - shown);
    }
    if names
        .iter()
        .any(|n| n.starts_with(".step-") && n.ends_with(".tmp/"))
    {
        what += " (a .step-NNNNNNNN.tmp directory is a checkpoint still being written, or one a \
                  crash left unfinished)";
    }
    let files: Vec<&String> = names
        .iter()
        .filter(|n| n.ends_with(".safetensors"))
        .collect();
    if let Some(f) = files.first() {
        what += &format!("; to load {f}: --load {}", dir.join(f).display());
    }
    format!("{what}; {ACCEPTED}")
}

/// The model at `source` and the tokenizer it was trained with, if it
/// says.
pub(super) fn load(source: &Source) -> Result<(Params, Option<String>), String> {
    match source {
        Source::File(path) => {
            let (params, report) = checkpoint::load(path).map_err(|e| e.to_string())?;
            Ok((params, report.metadata.get("braid.tokenizer").cloned()))
        }
        Source::Sharded(dir) => {
            let r = CheckpointReader::open(dir)?;
            let m = r.manifest();
            eprintln!(
                "loading {} (step {}, written by {} rank{} under {}), assembled in memory",
                dir.display(),
                m.step,
                m.world_size,
                if m.world_size == 1 { "" } else { "s" },
                m.strategy
            );
            let params = ckpt::whole_model(&r, "loading", false)?;
            Ok((params, ckpt::tokenizer_of(&r)))
        }
    }
}

/// The tokenizer for a model: `--tokenizer`, else the one it was saved
/// with, else by its vocabulary; refused when it has more tokens than the
/// model.
pub(super) fn model_tokenizer(
    explicit: Option<&str>,
    saved: Option<&String>,
    cfg: &braid_model::GptConfig,
) -> Result<Tokenizer, String> {
    let tokenizer = tokenizer_for(explicit, saved, cfg.vocab_size)?;
    if tokenizer.vocab_size() > cfg.vocab_size {
        return Err(format!(
            "tokenizer {} has {} tokens but the model's vocabulary is {}: {}",
            tokenizer.name(),
            tokenizer.vocab_size(),
            cfg.vocab_size,
            if cfg.vocab_size <= 256 {
                "--tokenizer bytes fits it"
            } else {
                "the model was not trained with this tokenizer"
            }
        ));
    }
    Ok(tokenizer)
}

/// Milliseconds or seconds, whichever reads better.
fn duration(d: std::time::Duration) -> String {
    let s = d.as_secs_f64();
    if s < 1.0 {
        format!("{:.0} ms", s * 1e3)
    } else {
        format!("{s:.2} s")
    }
}

/// Runs `braid generate`.
pub fn run_generate(a: GenerateArgs) -> Result<i32, String> {
    let sampling = Sampling {
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        seed: a.seed,
    };
    sampling.check().map_err(|e| format!("--{e}"))?;
    let on = decoding_device(&a.device, &a.dtype)?;
    let source = locate(&a.load)?;
    if let Some(note) = &on.note {
        eprintln!("{note}");
    }
    let (params, saved_tokenizer) = load(&source)?;
    let cfg = params.layout.config;
    let tokenizer = model_tokenizer(a.tokenizer.as_deref(), saved_tokenizer.as_ref(), &cfg)?;
    let prompt_tokens = tokenizer.encode(&a.prompt).len();
    if prompt_tokens > cfg.context {
        eprintln!(
            "note: the prompt is {prompt_tokens} tokens, longer than the model's context of {}: \
             the model sees only its last {} (the whole prompt is still printed); shorten the \
             prompt to keep its start in view",
            cfg.context, cfg.context
        );
    } else if a.tokens > 0 && prompt_tokens + a.tokens > cfg.context {
        eprintln!(
            "note: {prompt_tokens} prompt and {} new tokens pass the model's context of {}: \
             tokens past it are predicted from the last {}",
            a.tokens, cfg.context, cfg.context
        );
    }
    if let Some(file) = &a.prompts {
        return batch(&a, file, params, tokenizer, sampling, &on);
    }
    let mut prompt = tokenizer.encode(&a.prompt);
    if prompt.is_empty() {
        prompt = tokenizer.encode("\n");
    }
    // Within the context: the serving engine (a paged KV cache); past it,
    // the whole window recomputed for each token.
    let (text, new_tokens, first, elapsed, how) =
        if a.tokens > 0 && prompt.len() + a.tokens <= cfg.context {
            let mut b = batcher(params, tokenizer, 1, &on)?;
            let request = Request {
                prompt,
                max_tokens: a.tokens,
                sampling,
                stop: Vec::new(),
                logprobs: false,
            };
            let c = complete(&mut b, vec![request])?.remove(0);
            let mut how = match on.gpu {
                Some(g) => format!("GPU {g}, {}, KV cache", dtype_name(on.dtype)),
                None => "CPU, KV cache".to_string(),
            };
            if c.finish == Finish::Stop {
                how += "; stopped at the end-of-text token";
            }
            (c.text, c.tokens.len(), c.time_to_first, c.elapsed, how)
        } else {
            if let (Some(g), true) = (on.gpu, a.tokens > 0) {
                eprintln!(
                    "note: --device {}: past the model's context braid generate decodes on the \
                     CPU (GPU {g} decodes within it)",
                    a.device
                );
            }
            let mut sampler = Sampler::new(sampling).map_err(|e| format!("--{e}"))?;
            let g = sample::generate(&params, tokenizer, &a.prompt, a.tokens, &mut sampler)?;
            let n = g.tokens.len();
            (
                g.text,
                n,
                g.time_to_first,
                g.elapsed,
                "CPU, no KV cache past the context".to_string(),
            )
        };
    println!("{}{}", a.prompt, text);
    let mut rate = format!("generate: {prompt_tokens} prompt tokens, {new_tokens} new tokens");
    if let Some(first) = first {
        rate += &format!(
            " in {}; time to first token {}",
            duration(elapsed),
            duration(first)
        );
    }
    // The tokens after the first, over their time (the first is the
    // prompt's prefill).
    let after = first.map(|f| elapsed.saturating_sub(f).as_secs_f64());
    if let Some(secs) = after.filter(|&s| new_tokens > 1 && s > 0.0) {
        rate += &format!("; {:.1} tokens/s ({how})", (new_tokens - 1) as f64 / secs);
    }
    eprintln!("{rate}");
    Ok(0)
}

/// A batcher of `params` where `on` says, with room for `running`
/// sequences filling the context at once (within 1 GiB of KV cache).
fn batcher(
    params: Params,
    tokenizer: Tokenizer,
    running: usize,
    on: &DecodeOn,
) -> Result<Batcher<Box<dyn Decoder + Send>>, String> {
    let block = 16;
    let one = params.layout.config.context.div_ceil(block) + 1;
    // 1 GiB of keys and values in the cache's element (bf16 on a GPU
    // under bf16 products: twice the blocks).
    let budget = match on.gpu {
        Some(_) => CudaDecoder::blocks_in(&params.layout, 1 << 30, block, on.kv),
        None => CpuDecoder::blocks_in(&params.layout, 1 << 30, block),
    };
    let blocks = (running * one).min(budget).max(one);
    let running = (blocks / one).max(1);
    let options = BatcherOptions {
        max_running: running,
        ..BatcherOptions::for_device(on.gpu.is_some())
    };
    let hint = "--device cpu decodes on the CPU";
    let decoder = decoder(params, on, blocks, block, options.step_tokens, hint)?;
    Ok(Batcher::new(decoder, tokenizer, options))
}

/// `--prompts FILE`: every prompt decoded together, each continuation a
/// JSON line.
fn batch(
    a: &GenerateArgs,
    file: &Path,
    params: Params,
    tokenizer: Tokenizer,
    sampling: Sampling,
    on: &DecodeOn,
) -> Result<i32, String> {
    let text = std::fs::read_to_string(file)
        .map_err(|e| format!("--prompts {}: cannot be read: {e}", file.display()))?;
    let prompts: Vec<(usize, &str)> = text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .collect();
    if prompts.is_empty() {
        return Err(format!(
            "--prompts {}: no prompts (one a line; blank lines are skipped)",
            file.display()
        ));
    }
    if a.tokens == 0 {
        return Err("--tokens 0 with --prompts: ask for at least one new token".into());
    }
    if a.max_running == 0 {
        return Err("--max-running 0: decode at least one sequence at a time".into());
    }
    let context = params.layout.config.context;
    let requests: Vec<Request> = prompts
        .iter()
        .enumerate()
        .map(|(i, (line, p))| {
            let tokens = tokenizer.encode(p);
            if tokens.len() >= context {
                return Err(format!(
                    "--prompts {}: line {} is {} tokens and the model's context is {context}: \
                     shorten it to at most {} tokens",
                    file.display(),
                    line + 1,
                    tokens.len(),
                    context - 1
                ));
            }
            Ok(Request {
                prompt: tokens,
                max_tokens: a.tokens,
                // Each prompt its own draws (the same file and seed, the
                // same texts).
                sampling: Sampling {
                    seed: sampling.seed.wrapping_add(i as u64),
                    ..sampling
                },
                stop: Vec::new(),
                logprobs: false,
            })
        })
        .collect::<Result<_, _>>()?;
    let prompt_tokens: usize = requests.iter().map(|r| r.prompt.len()).sum();
    let prompt_ids: Vec<Vec<u32>> = requests.iter().map(|r| r.prompt.clone()).collect();
    let running = requests.len().min(a.max_running);
    let mut b = batcher(params, tokenizer, running, on)?;
    let done = complete(&mut b, requests)?;
    let mut new_tokens = 0;
    let mut at_context = 0;
    let mut elapsed = std::time::Duration::ZERO;
    for (((_, p), c), ids) in prompts.iter().zip(&done).zip(&prompt_ids) {
        new_tokens += c.tokens.len();
        elapsed = elapsed.max(c.elapsed);
        if c.finish == Finish::Length && c.tokens.len() < a.tokens {
            at_context += 1;
        }
        let line = serde_json::json!({
            "prompt": p,
            "text": c.text,
            "finish_reason": c.finish.as_str(),
            "completion_tokens": c.tokens.len(),
            "prompt_token_ids": ids,
            "token_ids": c.tokens,
        });
        println!("{line}");
    }
    if at_context > 0 {
        eprintln!(
            "note: {at_context} continuation(s) stopped at the model's context of {context} \
             before --tokens {}",
            a.tokens
        );
    }
    let secs = elapsed.as_secs_f64().max(1e-9);
    eprintln!(
        "generate: {} prompts, {prompt_tokens} prompt tokens, {new_tokens} new tokens in {}; \
         {:.1} tokens/s ({}, KV cache, {})",
        done.len(),
        duration(elapsed),
        new_tokens as f64 / secs,
        match on.gpu {
            Some(g) => format!("GPU {g}, {}", dtype_name(on.dtype)),
            None => "CPU".into(),
        },
        match running {
            1 => "one at a time".to_string(),
            r if r == done.len() => "decoded together".to_string(),
            r => format!("{r} at a time"),
        }
    );
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Dir(PathBuf);
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    fn tempdir(tag: &str) -> Dir {
        let d = std::env::temp_dir().join(format!("braid-gen-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        Dir(d)
    }

    #[test]
    fn load_paths_are_told_apart() {
        let d = tempdir("locate");
        let root = &d.0;
        let missing = locate(&root.join("nope")).unwrap_err();
        assert!(
            missing.contains("no such file") && missing.contains("--ckpt-dir"),
            "{missing}"
        );
        let empty = locate(root).unwrap_err();
        assert!(empty.contains("an empty directory"), "{empty}");
        std::fs::write(root.join("notes.txt"), "x").unwrap();
        std::fs::write(root.join("m.safetensors"), "x").unwrap();
        let other = locate(root).unwrap_err();
        assert!(
            other.contains("notes.txt")
                && other.contains(&format!("--load {}", root.join("m.safetensors").display())),
            "{other}"
        );
        assert_eq!(
            locate(&root.join("m.safetensors")).unwrap(),
            Source::File(root.join("m.safetensors"))
        );
        std::fs::write(root.join("model.safetensors"), "x").unwrap();
        assert_eq!(
            locate(root).unwrap(),
            Source::File(root.join("model.safetensors"))
        );
        // A step directory, the root naming it, and both kinds at once.
        let step = root.join("step-00000004");
        std::fs::create_dir_all(&step).unwrap();
        std::fs::write(step.join(MANIFEST), "{}").unwrap();
        std::fs::write(step.join("model-rank00000-of-00001.safetensors"), "x").unwrap();
        assert_eq!(locate(&step).unwrap(), Source::Sharded(step.clone()));
        let both = locate(root).unwrap_err();
        assert!(both.contains("holds both"), "{both}");
        std::fs::remove_file(root.join("model.safetensors")).unwrap();
        assert_eq!(locate(root).unwrap(), Source::Sharded(step.clone()));
        let piece = locate(&step.join("model-rank00000-of-00001.safetensors")).unwrap_err();
        assert!(
            piece.contains("one file of the sharded checkpoint"),
            "{piece}"
        );
    }

    #[test]
    fn devices_and_top_k() {
        let cpu = DecodeOn {
            gpu: None,
            note: None,
            dtype: DType::F32,
            kv: KvDtype::F32,
        };
        assert_eq!(decoding_device("cpu", "auto"), Ok(cpu.clone()));
        match braid_cuda::device_count() {
            Ok(n) if n > 0 => {
                assert!(decoding_device("cuda", "auto").unwrap().gpu.is_some());
                assert!(decoding_device("auto", "auto").unwrap().note.is_some());
            }
            _ => {
                // No GPU here: cuda is refused naming what is missing,
                // auto takes the CPU.
                let cuda = decoding_device("cuda", "auto").unwrap_err();
                assert!(
                    cuda.contains("--device cuda: no GPU to use here")
                        && cuda.contains("--device cpu"),
                    "{cuda}"
                );
                assert_eq!(decoding_device("auto", "auto"), Ok(cpu.clone()));
            }
        }
        let tpu = decoding_device("tpu", "auto").unwrap_err();
        assert!(tpu.contains("expected auto, cpu or cuda"), "{tpu}");
        // The CPU decodes in f32; a GPU in bf16 when told.
        assert_eq!(decoding_device("cpu", "f32"), Ok(cpu.clone()));
        let bf = decoding_device("cpu", "bf16").unwrap_err();
        assert!(bf.contains("the CPU decodes in f32"), "{bf}");
        let f8 = decoding_device("cpu", "fp8").unwrap_err();
        assert!(f8.contains("expected auto, bf16 or f32"), "{f8}");
        if braid_cuda::device_count().unwrap_or(0) > 0 {
            assert_eq!(decoding_device("cuda", "bf16").unwrap().dtype, DType::BF16);
            assert_eq!(decoding_device("cuda", "auto").unwrap().dtype, DType::BF16);
        }
        assert_eq!(parse_top_k("40"), Ok(40));
        assert!(parse_top_k("-1").unwrap_err().contains(">= 0"));
    }
}
