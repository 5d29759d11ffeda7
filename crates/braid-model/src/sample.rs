//! Sampling from a trained model: continuing a prompt token by token.

use crate::model::Gpt;
use crate::params::Params;
use crate::rng::Rng;
use braid_data::tokens::Tokenizer;

/// Continues `prompt` by `n` tokens, sampling at `temperature` (0: the most
/// likely token each time).
pub fn generate(
    params: &Params,
    tokenizer: Tokenizer,
    prompt: &str,
    n: usize,
    temperature: f32,
    seed: u64,
) -> Result<String, String> {
    let model = Gpt::new(params.layout.clone());
    let mut tokens = tokenizer.encode(prompt);
    if tokens.is_empty() {
        tokens.push(b'\n' as u32 % params.layout.config.vocab_size as u32);
    }
    let first_new = tokens.len();
    let mut rng = Rng::new(seed);
    for _ in 0..n {
        let logits = model
            .next_token_logits(&params.data, &tokens)
            .map_err(|e| e.to_string())?;
        let next = if temperature <= 0.0 {
            argmax(&logits)
        } else {
            let maxv = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let probs: Vec<f64> = logits
                .iter()
                .map(|&l| (((l - maxv) / temperature) as f64).exp())
                .collect();
            let total: f64 = probs.iter().sum();
            let mut u = rng.uniform() * total;
            let mut pick = probs.len() - 1;
            for (i, p) in probs.iter().enumerate() {
                if u < *p {
                    pick = i;
                    break;
                }
                u -= p;
            }
            pick
        };
        tokens.push(next as u32);
    }
    Ok(tokenizer.decode(&tokens[first_new..]))
}

fn argmax(v: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best
}
