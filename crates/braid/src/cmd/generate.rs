//! `braid generate`: text from a model saved by `braid train --save`.

use super::train::tokenizer_for;
use braid_model::checkpoint;
use clap::Args;
use std::path::PathBuf;

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
    #[arg(long, default_value_t = super::DEFAULT_SEED)]
    seed: u64,
    /// bytes or gpt2 (default: what the checkpoint was trained with).
    #[arg(long)]
    tokenizer: Option<String>,
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
