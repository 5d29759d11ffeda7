//! Loaders of token batches for the GPT engines.

use crate::engines::TokenBatch;
use crate::trainer::Loader;
use crate::Result;
use braid_model::data::Dataset;
use braid_model::rng::Rng;

/// Random windows of a [`Dataset`]: training batches from the training
/// part, evaluation batches from the held-out part, each from its own
/// generator seeded by the run's seed.
pub struct RandomWindows<'d> {
    data: &'d Dataset,
    b: usize,
    t: usize,
    train: Rng,
    eval: Rng,
}

impl<'d> RandomWindows<'d> {
    /// Batches of `b × t` from `data` for `seed`.
    pub fn new(data: &'d Dataset, b: usize, t: usize, seed: u64) -> Self {
        RandomWindows {
            data,
            b,
            t,
            train: Rng::new(seed ^ 0xDA7A),
            eval: Rng::new(seed ^ 0xE7A1),
        }
    }
}

impl Loader<TokenBatch> for RandomWindows<'_> {
    fn next_train(&mut self, out: &mut TokenBatch) -> Result<()> {
        let (b, t) = (self.b, self.t);
        self.data.batch(
            &mut self.train,
            b,
            t,
            false,
            &mut out.tokens,
            &mut out.targets,
        )
    }

    fn eval(&mut self, _k: usize, out: &mut TokenBatch) -> Result<()> {
        let (b, t) = (self.b, self.t);
        self.data.batch(
            &mut self.eval,
            b,
            t,
            true,
            &mut out.tokens,
            &mut out.targets,
        )
    }

    fn items_per_batch(&self) -> usize {
        self.b * self.t
    }
}

/// Checks that sequences of `seq` tokens from `data` fit a model of `cfg`.
pub fn check_fits(cfg: &braid_model::GptConfig, seq: usize, data: &Dataset) -> Result<()> {
    if seq > cfg.context {
        return Err(format!(
            "--seq {seq} exceeds the model's context {}",
            cfg.context
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
