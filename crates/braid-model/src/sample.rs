//! Sampling from a trained model: continuing a prompt token by token on
//! the CPU, the whole model recomputed over the window for every new token
//! (no KV cache: GPU decoding with one is `braid serve`'s, still to come).
//!
//! - [`Sampling`]: temperature (0: greedy), top-k, top-p (nucleus) and
//!   the seed, checked by [`Sampling::check`];
//! - [`Sampler`]: picks a token from one position's logits;
//! - [`generate`]: continues a prompt, timing the first token and the rest.
//!
//! The model sees at most its context: a prompt longer than the context,
//! or one that generation carries past it, is predicted from its last
//! `context` tokens (a sliding window; [`Generation::prompt_cut`] says when
//! the prompt itself was cut).

use crate::model::Gpt;
use crate::params::Params;
use crate::rng::Rng;
use braid_data::tokens::Tokenizer;
use std::time::{Duration, Instant};

/// How the next token is chosen from the logits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// Divides the logits before the softmax; 0: greedy (always the most
    /// likely token, the filters and the seed then play no part).
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens (0: all of them).
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability
    /// reaches `top_p` (nucleus sampling), in (0, 1]; 1: all of them.
    pub top_p: f32,
    /// The random generator's seed: the same seed, model and prompt give
    /// the same text.
    pub seed: u64,
}

/// A [`Sampling`] value out of range.
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
pub enum SamplingError {
    /// Negative or not a number.
    #[error(
        "temperature {0}: the temperature must be >= 0 (0 means greedy: the most likely token \
         every time; 0.8 is the default, higher is more random)"
    )]
    Temperature(f32),
    /// Outside (0, 1].
    #[error(
        "top-p {0}: top-p must be in (0, 1] (1: off; 0.9 keeps the most likely tokens until \
         they hold 90% of the probability)"
    )]
    TopP(f32),
}

impl Sampling {
    /// Whether every value is in range.
    pub fn check(&self) -> Result<(), SamplingError> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(SamplingError::Temperature(self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(SamplingError::TopP(self.top_p));
        }
        Ok(())
    }

    /// Whether every choice is the most likely token: temperature 0, or
    /// top-k 1.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }
}

/// Picks tokens from logits under a [`Sampling`], with its own random
/// generator (one uniform draw per token unless greedy).
pub struct Sampler {
    sampling: Sampling,
    rng: Rng,
}

impl Sampler {
    /// A sampler for `sampling`, refused when a value is out of range.
    pub fn new(sampling: Sampling) -> Result<Sampler, SamplingError> {
        sampling.check()?;
        Ok(Sampler {
            sampling,
            rng: Rng::new(sampling.seed),
        })
    }

    /// Whether it always picks the highest logit (then it draws nothing:
    /// a [`Pick`](crate::Pick) made elsewhere is its choice).
    pub fn is_greedy(&self) -> bool {
        self.sampling.is_greedy()
    }

    /// The next token, from one position's logits (not empty).
    pub fn pick(&mut self, logits: &[f32]) -> usize {
        let s = self.sampling;
        if s.is_greedy() {
            return argmax(logits);
        }
        let maxv = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let weights: Vec<f64> = logits
            .iter()
            .map(|&l| (((l - maxv) / s.temperature) as f64).exp())
            .collect();
        let filtered = s.top_k > 0 && s.top_k < weights.len() || s.top_p < 1.0;
        if !filtered {
            // Every token, in vocabulary order.
            return draw(&weights, 0..weights.len(), self.rng.uniform());
        }
        let kept = kept_tokens(&weights, s.top_k, s.top_p);
        draw(&weights, kept.iter().copied(), self.rng.uniform())
    }
}

/// The tokens top-k then top-p keep, most likely first (ties: the lower
/// token first). `weights` are unnormalised probabilities; top-p applies
/// to what top-k kept, renormalised (as Hugging Face's `generate` does).
fn kept_tokens(weights: &[f64], top_k: usize, top_p: f32) -> Vec<usize> {
    let mut order: Vec<usize> = (0..weights.len()).collect();
    order.sort_by(|&a, &b| weights[b].total_cmp(&weights[a]).then(a.cmp(&b)));
    if top_k > 0 {
        order.truncate(top_k);
    }
    if top_p < 1.0 {
        let total: f64 = order.iter().map(|&i| weights[i]).sum();
        let want = top_p as f64 * total;
        let mut sum = 0.0;
        let mut keep = order.len();
        for (n, &i) in order.iter().enumerate() {
            sum += weights[i];
            if sum >= want {
                keep = n + 1;
                break;
            }
        }
        order.truncate(keep.max(1));
    }
    order
}

/// One of `tokens` drawn in proportion to its weight, by the uniform
/// number `u` in [0, 1).
fn draw(weights: &[f64], tokens: impl Iterator<Item = usize> + Clone, u: f64) -> usize {
    let total: f64 = tokens.clone().map(|i| weights[i]).sum();
    let mut u = u * total;
    let mut pick = None;
    for i in tokens {
        pick = Some(i);
        if u < weights[i] {
            break;
        }
        u -= weights[i];
    }
    pick.expect("at least one token to draw from")
}

/// The first largest value's index.
pub(crate) fn argmax(v: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best
}

/// What [`generate`] produced, and how fast.
#[derive(Debug, Clone)]
pub struct Generation {
    /// The new text (the prompt not repeated).
    pub text: String,
    /// The prompt's tokens.
    pub prompt_tokens: usize,
    /// Of those, how many the model did not see: a prompt longer than the
    /// context is predicted from its last `context` tokens.
    pub prompt_cut: usize,
    /// The new tokens.
    pub tokens: Vec<u32>,
    /// From the start to the first new token (the prompt's forward pass).
    pub time_to_first: Option<Duration>,
    /// From the start to the last new token.
    pub elapsed: Duration,
}

impl Generation {
    /// New tokens per second after the first (the decoding rate; the
    /// first token's time is the prompt's), or over all of them when only
    /// one was made.
    pub fn tokens_per_second(&self) -> Option<f64> {
        let first = self.time_to_first?;
        let (n, secs) = if self.tokens.len() > 1 {
            (self.tokens.len() - 1, (self.elapsed - first).as_secs_f64())
        } else {
            (self.tokens.len(), self.elapsed.as_secs_f64())
        };
        (secs > 0.0).then(|| n as f64 / secs)
    }
}

/// Continues `prompt` by `n` tokens chosen by `sampler`, on the CPU. Only
/// tokens the tokenizer can write are chosen (a model's vocabulary may be
/// padded past the tokenizer's). An empty prompt starts from a newline.
pub fn generate(
    params: &Params,
    tokenizer: Tokenizer,
    prompt: &str,
    n: usize,
    sampler: &mut Sampler,
) -> Result<Generation, String> {
    let cfg = &params.layout.config;
    if tokenizer.vocab_size() > cfg.vocab_size {
        return Err(format!(
            "tokenizer {} has {} tokens but the model's vocabulary is {}",
            tokenizer.name(),
            tokenizer.vocab_size(),
            cfg.vocab_size
        ));
    }
    let model = Gpt::new(params.layout.clone());
    let mut tokens = tokenizer.encode(prompt);
    let prompt_tokens = tokens.len();
    if tokens.is_empty() {
        tokens = tokenizer.encode("\n");
    }
    let prompt_cut = prompt_tokens.saturating_sub(cfg.context);
    let first_new = tokens.len();
    let writable = tokenizer.vocab_size().min(cfg.vocab_size);
    let start = Instant::now();
    let mut time_to_first = None;
    for _ in 0..n {
        let logits = model
            .next_token_logits(&params.data, &tokens)
            .map_err(|e| e.to_string())?;
        tokens.push(sampler.pick(&logits[..writable]) as u32);
        time_to_first.get_or_insert_with(|| start.elapsed());
    }
    let new = tokens.split_off(first_new);
    Ok(Generation {
        text: tokenizer.decode(&new),
        prompt_tokens,
        prompt_cut,
        tokens: new,
        time_to_first,
        elapsed: start.elapsed(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampler(temperature: f32, top_k: usize, top_p: f32, seed: u64) -> Sampler {
        Sampler::new(Sampling {
            temperature,
            top_k,
            top_p,
            seed,
        })
        .unwrap()
    }

    /// Logits drawn from a seeded generator, `v` of them.
    fn logits(v: usize, seed: u64) -> Vec<f32> {
        let mut r = Rng::new(seed);
        (0..v).map(|_| 3.0 * r.normal() as f32).collect()
    }

    #[test]
    fn top_k_one_is_greedy() {
        for seed in 0..20 {
            let l = logits(300, seed);
            let greedy = sampler(0.0, 0, 1.0, seed).pick(&l);
            assert_eq!(greedy, argmax(&l));
            for t in [0.5, 1.0, 5.0] {
                let mut s = sampler(t, 1, 1.0, seed);
                for _ in 0..5 {
                    assert_eq!(s.pick(&l), greedy, "seed {seed} temperature {t}");
                }
            }
        }
        // Ties go to the lower token either way.
        assert_eq!(sampler(1.0, 1, 1.0, 3).pick(&[1.0, 2.0, 2.0]), 1);
        assert_eq!(sampler(0.0, 0, 1.0, 3).pick(&[1.0, 2.0, 2.0]), 1);
    }

    #[test]
    fn top_k_draws_only_the_k_most_likely() {
        let l = logits(100, 5);
        let mut best: Vec<usize> = (0..l.len()).collect();
        best.sort_by(|&a, &b| l[b].total_cmp(&l[a]));
        let mut s = sampler(5.0, 3, 1.0, 9);
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..2000 {
            let t = s.pick(&l);
            assert!(best[..3].contains(&t), "{t} is not among the top 3");
            seen.insert(t);
        }
        assert_eq!(seen.len(), 3, "a high temperature reaches all three");
    }

    #[test]
    fn top_p_keeps_the_smallest_set_reaching_p() {
        // Probabilities 1/2, 1/4, 3/16, 1/16 (exact in binary; token order
        // shuffled): cumulative 0.5, 0.75, 0.9375, 1.
        let w = [0.1875, 0.5, 0.0625, 0.25];
        assert_eq!(kept_tokens(&w, 0, 0.5), vec![1], "0.5 reaches 0.5");
        assert_eq!(kept_tokens(&w, 0, 0.51), vec![1, 3]);
        assert_eq!(kept_tokens(&w, 0, 0.75), vec![1, 3]);
        assert_eq!(kept_tokens(&w, 0, 0.76), vec![1, 3, 0]);
        assert_eq!(kept_tokens(&w, 0, 0.95), vec![1, 3, 0, 2]);
        assert_eq!(kept_tokens(&w, 0, 1e-6), vec![1], "never empty");
        // After top-k 2 the probabilities are 2/3 and 1/3.
        assert_eq!(kept_tokens(&w, 2, 0.6), vec![1]);
        assert_eq!(kept_tokens(&w, 2, 0.7), vec![1, 3]);
        // Sampling draws only from the nucleus, and all of it.
        let l: Vec<f32> = w.iter().map(|&p: &f64| p.ln() as f32).collect();
        let mut s = sampler(1.0, 0, 0.7, 4);
        let mut seen = [0usize; 4];
        for _ in 0..4000 {
            seen[s.pick(&l)] += 1;
        }
        assert_eq!((seen[0], seen[2]), (0, 0), "{seen:?}");
        let share = seen[1] as f64 / 4000.0;
        assert!((share - 2.0 / 3.0).abs() < 0.03, "{seen:?}");
    }

    #[test]
    fn seeded_runs_repeat() {
        let l = logits(500, 1);
        let run = |seed, k, p| {
            let mut s = sampler(1.0, k, p, seed);
            (0..50).map(|_| s.pick(&l)).collect::<Vec<_>>()
        };
        for (k, p) in [(0, 1.0), (40, 1.0), (0, 0.9), (40, 0.9)] {
            assert_eq!(run(7, k, p), run(7, k, p), "top-k {k} top-p {p}");
            assert_ne!(run(7, k, p), run(8, k, p), "top-k {k} top-p {p}");
        }
    }

    #[test]
    fn out_of_range_values_are_refused() {
        let bad = |temperature, top_p| {
            Sampler::new(Sampling {
                temperature,
                top_k: 0,
                top_p,
                seed: 1,
            })
            .err()
        };
        assert_eq!(bad(-1.0, 1.0), Some(SamplingError::Temperature(-1.0)));
        assert!(matches!(
            bad(f32::NAN, 1.0),
            Some(SamplingError::Temperature(_))
        ));
        assert_eq!(bad(0.0, 0.0), Some(SamplingError::TopP(0.0)));
        assert_eq!(bad(0.0, 1.5), Some(SamplingError::TopP(1.5)));
        assert_eq!(bad(0.0, 1.0), None);
        let msg = SamplingError::Temperature(-1.0).to_string();
        assert!(
            msg.contains("must be >= 0") && msg.contains("greedy"),
            "{msg}"
        );
    }

    #[test]
    fn generate_counts_and_cuts_the_prompt() {
        use crate::{GptConfig, Layout};
        use std::sync::Arc;
        let cfg = GptConfig {
            n_layer: 1,
            n_head: 2,
            n_embd: 16,
            vocab_size: 256,
            context: 8,
        };
        let params = Params::init_gpt2(Arc::new(Layout::new(&cfg)), 1);
        let mut s = sampler(0.0, 0, 1.0, 1);
        let g = generate(&params, Tokenizer::Bytes, "0123456789ab", 3, &mut s).unwrap();
        assert_eq!((g.prompt_tokens, g.prompt_cut, g.tokens.len()), (12, 4, 3));
        assert!(g.time_to_first.is_some() && g.tokens_per_second().is_some());
        let none = generate(&params, Tokenizer::Bytes, "", 0, &mut s).unwrap();
        assert_eq!((none.prompt_tokens, none.tokens.len()), (0, 0));
        assert!(none.text.is_empty() && none.tokens_per_second().is_none());
    }
}
