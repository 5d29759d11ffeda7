//! Loaders of token batches for the GPT engines: [`TokenWindows`] (the
//! distributed sampler over a dataset's windows) and [`RandomWindows`]
//! (random windows, one process).

use crate::engines::TokenBatch;
use crate::trainer::Loader;
use crate::Result;
use braid_data::sampler::DistributedSampler;
use braid_data::tokens::Dataset;

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

/// Token windows of a [`Dataset`] dealt out to data-parallel ranks by a
/// [`DistributedSampler`]: the training part cut into windows of `t`
/// tokens, shuffled each epoch (`seed + epoch`); each step takes this
/// rank's next `b`. An epoch has `windows / (ranks × b)` steps on every
/// rank (the incomplete last global batch is dropped), so `ranks` ranks
/// with batch `b` see exactly the windows one process with batch
/// `ranks × b` sees, step by step. Evaluation batches are fixed: the
/// held-out windows in order, dealt out the same way.
pub struct TokenWindows<'d> {
    data: &'d Dataset,
    b: usize,
    t: usize,
    ranks: usize,
    sampler: DistributedSampler,
    order: Vec<usize>,
    step_in_epoch: usize,
    steps_per_epoch: usize,
    eval_windows: usize,
}

impl<'d> TokenWindows<'d> {
    /// Rank `rank` of `ranks`, batches of `b × t`, shuffled by `seed`.
    pub fn new(
        data: &'d Dataset,
        b: usize,
        t: usize,
        rank: usize,
        ranks: usize,
        seed: u64,
    ) -> Result<Self> {
        let windows = data.windows(t, false);
        let global = b * ranks;
        if windows < global {
            return Err(format!(
                "the training data holds {windows} windows of {t} tokens, fewer than one global batch \
                 of {global} ({ranks} ranks x batch {b}): use more data, a shorter --seq or a smaller --batch"
            ));
        }
        let eval_windows = data.windows(t, true);
        if eval_windows == 0 {
            return Err(format!(
                "the held-out data holds no window of {t} tokens: use more data or a shorter --seq"
            ));
        }
        let sampler = DistributedSampler::new(windows, ranks, rank, true, seed, false)?;
        let order = sampler.indices();
        Ok(TokenWindows {
            data,
            b,
            t,
            ranks,
            sampler,
            order,
            step_in_epoch: 0,
            steps_per_epoch: windows / global,
            eval_windows,
        })
    }

    /// The epoch the next batch comes from.
    pub fn epoch(&self) -> u64 {
        self.sampler.epoch()
    }

    /// Steps in one epoch.
    pub fn steps_per_epoch(&self) -> usize {
        self.steps_per_epoch
    }

    fn fill(
        &self,
        out: &mut TokenBatch,
        windows: impl Iterator<Item = usize>,
        eval: bool,
    ) -> Result<()> {
        let t = self.t;
        for (row, w) in windows.enumerate() {
            let r = row * t..(row + 1) * t;
            // (Two disjoint fields of `out`.)
            let (tokens, targets) = (&mut out.tokens[r.clone()], &mut out.targets[r]);
            self.data.window(w, t, eval, tokens, targets)?;
        }
        Ok(())
    }
}

impl Loader<TokenBatch> for TokenWindows<'_> {
    fn next_train(&mut self, out: &mut TokenBatch) -> Result<()> {
        if self.step_in_epoch == self.steps_per_epoch {
            let next = self.sampler.epoch() + 1;
            self.sampler.set_epoch(next);
            self.order = self.sampler.indices();
            self.step_in_epoch = 0;
        }
        let at = self.step_in_epoch * self.b;
        let windows: Vec<usize> = self.order[at..at + self.b].to_vec();
        self.step_in_epoch += 1;
        self.fill(out, windows.into_iter(), false)
    }

    fn eval(&mut self, k: usize, out: &mut TokenBatch) -> Result<()> {
        let (b, ranks, rank) = (self.b, self.ranks, self.sampler.rank());
        let n = self.eval_windows;
        self.fill(out, (0..b).map(|i| ((k * b + i) * ranks + rank) % n), true)
    }

    fn items_per_batch(&self) -> usize {
        self.b * self.t
    }

    fn skip_to(&mut self, micro_batches: usize) -> Result<()> {
        // Each epoch deals out the same number of batches; the order of
        // the epoch the next one comes from is that of `seed + epoch`.
        let epoch = micro_batches / self.steps_per_epoch;
        self.sampler.set_epoch(epoch as u64);
        self.order = self.sampler.indices();
        self.step_in_epoch = micro_batches % self.steps_per_epoch;
        Ok(())
    }
}
