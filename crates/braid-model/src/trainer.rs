//! The single-process training loop on the CPU — batches from a
//! [`Dataset`], forward/backward, clipping, the learning-rate schedule, an
//! optimizer step, periodic evaluation — and sampling from a trained model.

use crate::data::{Dataset, Tokenizer};
use crate::model::{Activations, Gpt};
use crate::optim::{clip_global_norm, AdamWConfig, Optimizer, Schedule};
use crate::params::Params;
use crate::rng::Rng;
use std::time::Instant;

/// Which optimizer to train with.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum OptimizerKind {
    /// AdamW (β = 0.9, 0.95).
    AdamW,
    /// SGD with momentum 0.9.
    Sgd,
}

/// A training run's settings.
#[derive(Debug, Clone)]
pub struct TrainOptions {
    /// Steps.
    pub steps: usize,
    /// Sequences per batch.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Peak learning rate.
    pub lr: f32,
    /// Final learning rate as a fraction of the peak.
    pub min_lr_ratio: f32,
    /// Warmup steps.
    pub warmup: usize,
    /// Weight decay (matrices and embeddings).
    pub weight_decay: f32,
    /// Clip the gradients' global norm to this (0: off).
    pub grad_clip: f64,
    /// Seed for initialisation and batch sampling.
    pub seed: u64,
    /// Evaluate on held-out data every this many steps (0: never).
    pub eval_every: usize,
    /// Batches per evaluation.
    pub eval_batches: usize,
    /// Recompute activations in the backward pass.
    pub checkpointing: bool,
    /// Optimizer.
    pub optimizer: OptimizerKind,
    /// Apply the optimizer (false: time forward + backward only).
    pub update: bool,
}

impl TrainOptions {
    /// Checks that the sequence length and the data's tokens fit the model.
    pub(crate) fn check_fits(
        &self,
        cfg: &crate::config::GptConfig,
        data: &Dataset,
    ) -> Result<(), String> {
        if self.seq > cfg.context {
            return Err(format!(
                "--seq {} exceeds the model's context {}",
                self.seq, cfg.context
            ));
        }
        if data.max_token() as usize >= cfg.vocab_size {
            return Err(format!(
                "the data holds token {} but the model's vocabulary has {} (pick a model or tokenizer that match)",
                data.max_token(),
                cfg.vocab_size
            ));
        }
        Ok(())
    }

    /// The learning-rate schedule of this run.
    pub(crate) fn schedule(&self) -> Schedule {
        Schedule {
            max_lr: self.lr,
            min_lr: self.lr * self.min_lr_ratio,
            warmup: self.warmup.min(self.steps.max(1)),
            total: self.steps,
        }
    }

    /// The training and evaluation batch samplers for this run's seed (the
    /// same on every device, so CPU and GPU runs see the same batches).
    pub(crate) fn samplers(&self) -> (Rng, Rng) {
        (Rng::new(self.seed ^ 0xDA7A), Rng::new(self.seed ^ 0xE7A1))
    }

    /// Whether the held-out loss is measured after 0-based `step`: every
    /// `eval_every` steps and at the last one (never when 0).
    pub(crate) fn evaluates_after(&self, step: usize) -> bool {
        self.eval_every > 0 && ((step + 1) % self.eval_every == 0 || step + 1 == self.steps)
    }
}

/// What happened at one step.
#[derive(Debug, Clone)]
pub struct StepReport {
    /// 0-based step.
    pub step: usize,
    /// Training loss.
    pub loss: f32,
    /// Gradient norm before clipping.
    pub grad_norm: f64,
    /// Learning rate used.
    pub lr: f32,
    /// Tokens per second of this step.
    pub tokens_per_s: f64,
    /// Held-out loss, when evaluated at this step.
    pub eval_loss: Option<f32>,
    /// Seconds since training started.
    pub elapsed: f64,
}

/// Trains `params` on `data`; `progress` sees every step.
pub fn train(
    params: &mut Params,
    data: &Dataset,
    o: &TrainOptions,
    progress: &mut dyn FnMut(&StepReport),
) -> Result<Vec<StepReport>, String> {
    let layout = params.layout.clone();
    let cfg = layout.config;
    o.check_fits(&cfg, data)?;
    let model = Gpt::new(layout.clone());
    let mut acts = Activations::<f32>::new(&layout, o.batch, o.seq, o.checkpointing);
    let mut grads = vec![0.0f32; layout.len];
    let mut opt = match o.optimizer {
        OptimizerKind::AdamW => Optimizer::adamw(
            &layout,
            AdamWConfig {
                weight_decay: o.weight_decay,
                ..Default::default()
            },
        ),
        OptimizerKind::Sgd => Optimizer::sgd(&layout, 0.9, o.weight_decay),
    };
    let sched = o.schedule();
    let (mut rng, mut eval_rng) = o.samplers();
    let n = o.batch * o.seq;
    let (mut tokens, mut targets) = (vec![0u32; n], vec![0u32; n]);
    let start = Instant::now();
    let mut reports = Vec::with_capacity(o.steps);
    for step in 0..o.steps {
        let t0 = Instant::now();
        data.batch(&mut rng, o.batch, o.seq, false, &mut tokens, &mut targets)?;
        grads.fill(0.0);
        let loss = model
            .forward_backward(
                &params.data,
                &mut grads,
                &mut acts,
                &tokens,
                &targets,
                &mut |_, _| {},
            )
            .map_err(|e| e.to_string())?;
        if !loss.is_finite() {
            return Err(format!("step {step}: the loss is {loss} (lower --lr?)"));
        }
        let lr = sched.lr(step);
        let grad_norm = if o.update {
            let norm = clip_global_norm(&mut grads, o.grad_clip);
            opt.step(params, &grads, lr);
            norm
        } else {
            0.0
        };
        let dt = t0.elapsed().as_secs_f64();
        let eval_loss = if o.evaluates_after(step) {
            Some(evaluate(&model, params, data, &mut acts, &mut eval_rng, o)?)
        } else {
            None
        };
        let r = StepReport {
            step,
            loss,
            grad_norm,
            lr,
            tokens_per_s: n as f64 / dt,
            eval_loss,
            elapsed: start.elapsed().as_secs_f64(),
        };
        progress(&r);
        reports.push(r);
    }
    Ok(reports)
}

fn evaluate(
    model: &Gpt,
    params: &Params,
    data: &Dataset,
    acts: &mut Activations<f32>,
    rng: &mut Rng,
    o: &TrainOptions,
) -> Result<f32, String> {
    let n = o.batch * o.seq;
    let (mut x, mut y) = (vec![0u32; n], vec![0u32; n]);
    let mut sum = 0.0f64;
    for _ in 0..o.eval_batches.max(1) {
        data.batch(rng, o.batch, o.seq, true, &mut x, &mut y)?;
        sum += model
            .forward(&params.data, acts, &x, &y)
            .map_err(|e| e.to_string())? as f64;
    }
    Ok((sum / o.eval_batches.max(1) as f64) as f32)
}

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
