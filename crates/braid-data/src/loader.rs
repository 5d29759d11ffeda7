//! Where a training loop's batches come from: the [`Loader`] interface
//! every loader implements, and [`TokenWindows`], which deals the windows
//! of a [`WindowSource`] (a token [`Dataset`] in memory, or a `.beton`
//! file's token field: [`crate::token_beton`]) out to data-parallel ranks
//! ([`TokenBatch`]es for the GPT engines).

use crate::sampler::DistributedSampler;
use crate::tokens::Dataset;

/// Errors are messages for the user.
pub type Result<T> = std::result::Result<T, String>;

/// Where a training loop's batches come from (`B`: the batch type its
/// engine takes).
pub trait Loader<B> {
    /// The next training micro-batch of this rank, into `out`.
    fn next_train(&mut self, out: &mut B) -> Result<()>;
    /// Evaluation batch `k` of this rank into `out` (`k` below
    /// the loop's `LoopOptions::eval_batches`).
    fn eval(&mut self, k: usize, out: &mut B) -> Result<()>;
    /// Tokens (or samples) in one micro-batch of this rank.
    fn items_per_batch(&self) -> usize;
    /// Goes on as if `micro_batches` training micro-batches had been
    /// taken since the start (a resumed run). Loaders without it refuse.
    fn skip_to(&mut self, micro_batches: usize) -> Result<()> {
        let _ = micro_batches;
        Err("this loader cannot resume from a checkpoint".into())
    }
}

/// Where GPT training windows come from: a training part and a held-out
/// part, each a list of windows of `t` tokens and the token after each.
pub trait WindowSource {
    /// Windows of `t` tokens in the training (`eval` false) or held-out
    /// part.
    fn windows(&self, t: usize, eval: bool) -> usize;
    /// Window `i` of [`windows`](Self::windows): `t` tokens into `tokens`
    /// and the `t` that follow each into `targets`.
    fn window(
        &self,
        i: usize,
        t: usize,
        eval: bool,
        tokens: &mut [u32],
        targets: &mut [u32],
    ) -> Result<()>;
    /// The largest token the source may hold (checked against the
    /// model's vocabulary before training).
    fn max_token(&self) -> u32;
}

impl WindowSource for Dataset {
    fn windows(&self, t: usize, eval: bool) -> usize {
        Dataset::windows(self, t, eval)
    }
    fn window(
        &self,
        i: usize,
        t: usize,
        eval: bool,
        tokens: &mut [u32],
        targets: &mut [u32],
    ) -> Result<()> {
        Dataset::window(self, i, t, eval, tokens, targets)
    }
    fn max_token(&self) -> u32 {
        Dataset::max_token(self)
    }
}

/// One micro-batch of token windows: `b` rows of `t` tokens and the
/// tokens that follow each (`u32::MAX`: not counted in the loss).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenBatch {
    /// Rows.
    pub b: usize,
    /// Tokens per row.
    pub t: usize,
    /// Inputs, `b × t`, row-major.
    pub tokens: Vec<u32>,
    /// Targets, `b × t`.
    pub targets: Vec<u32>,
}

impl TokenBatch {
    /// A batch of `b × t` zeros.
    pub fn new(b: usize, t: usize) -> TokenBatch {
        TokenBatch {
            b,
            t,
            tokens: vec![0; b * t],
            targets: vec![0; b * t],
        }
    }
}

/// Token windows of a [`WindowSource`] dealt out to data-parallel ranks by a
/// [`DistributedSampler`]: the training part cut into windows of `t`
/// tokens, shuffled each epoch (`seed + epoch`); each step takes this
/// rank's next `b`. An epoch has `windows / (ranks × b)` steps on every
/// rank (the incomplete last global batch is dropped), so `ranks` ranks
/// with batch `b` see exactly the windows one process with batch
/// `ranks × b` sees, step by step. Evaluation batches are fixed: the
/// held-out windows in order, dealt out the same way.
pub struct TokenWindows<'d> {
    data: &'d dyn WindowSource,
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
        data: &'d dyn WindowSource,
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
