//! Decoding on the CPU with a paged KV cache (serving): the block's
//! description ([`crate::block::BLOCK`]) walked over [`DecodeForward`], a
//! backend whose rows are the new tokens of many sequences at once, each
//! at its own position and with its own block table
//! ([`crate::paged::BlockTable`]). Its attention first writes every row's
//! key and value into its sequence's pages ([`KvPages`]), then each row
//! attends to its sequence's positions up to its own, read through the
//! block table. Every other operation is the training pass's, row by row,
//! so a continuation decoded here is the one the whole window recomputed
//! gives ([`Gpt::next_token_logits`]), within the products' rounding.
//!
//! A prompt's prefill is rows at positions `0..n` of one sequence; a
//! decode step is one row per running sequence; a step may mix both
//! (continuous batching, chunked prefill).
//!
//! A tensor-parallel share ([`Gpt::tensor_parallel`], without sequence
//! parallelism) decodes its heads and MLP columns the way it trains:
//! its pages hold its heads' keys and values only, the row products are
//! summed over the group, the token embedding is looked up in its rows
//! of the vocabulary and summed, and the logits of its rows of the
//! vocabulary are gathered, so every rank of the group returns the whole
//! vocabulary's. Every rank of the group runs the same step.

use super::error::StepError;
use super::gpt::Gpt;
use super::layer::split;
use crate::block::{self, Act, BlockForward, LayerRanges, Linear, Norm};
use crate::cpu::gelu::gelu_forward;
use crate::cpu::matmul::{gemm_rm, linear_forward};
use crate::cpu::norm::layernorm_forward;
use crate::cpu::Real;
use crate::layout::{Block, Layout, TensorShard};
use crate::paged::{BlockCopy, BlockId};

/// The keys and values of every sequence being decoded, per layer, in
/// blocks of `block_size` positions: block `b`'s position `o` of layer
/// `l` holds `width` keys at `k[l][(b * block_size + o) * width..]` (the
/// same for values).
#[derive(Debug, Clone)]
pub struct KvPages<T> {
    k: Vec<Vec<T>>,
    v: Vec<Vec<T>>,
    block_size: usize,
    width: usize,
    blocks: usize,
}

impl<T: Real> KvPages<T> {
    /// `blocks` blocks of `block_size` positions for every layer of
    /// `layout`'s model (zeroed): a tensor-parallel share's heads only.
    pub fn new(layout: &Layout, blocks: usize, block_size: usize) -> KvPages<T> {
        let cfg = &layout.config;
        let width = Self::width_of(layout);
        let per = blocks * block_size * width;
        KvPages {
            k: (0..cfg.n_layer).map(|_| vec![T::ZERO; per]).collect(),
            v: (0..cfg.n_layer).map(|_| vec![T::ZERO; per]).collect(),
            block_size,
            width,
            blocks,
        }
    }

    /// Bytes one block takes over every layer (keys and values) for
    /// `layout`'s model in `T`: what a memory budget divides by.
    pub fn bytes_per_block(layout: &Layout, block_size: usize) -> usize {
        let cfg = &layout.config;
        2 * cfg.n_layer * block_size * Self::width_of(layout) * std::mem::size_of::<T>()
    }

    /// Keys (or values) per position of one layer: the widths of the
    /// heads `layout`'s share runs.
    fn width_of(layout: &Layout) -> usize {
        layout.config.n_embd / layout.shard.size.max(1)
    }

    /// Positions per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks per layer.
    pub fn blocks(&self) -> usize {
        self.blocks
    }

    /// Runs the copies a write into shared blocks asked for
    /// ([`crate::paged::BlockTable::append`]), in every layer.
    pub fn copy(&mut self, copies: &[BlockCopy]) {
        let n = self.block_size * self.width;
        for c in copies {
            let (from, to) = (c.from as usize * n, c.to as usize * n);
            for buf in self.k.iter_mut().chain(self.v.iter_mut()) {
                buf.copy_within(from..from + n, to);
            }
        }
    }

    /// Layer `l`'s keys and values (a check's view of the pages).
    #[cfg(test)]
    pub(crate) fn layer(&self, l: usize) -> (&[T], &[T]) {
        (&self.k[l], &self.v[l])
    }

    /// Where position `pos` of a sequence with blocks `table` sits in a
    /// layer's buffers.
    fn at(&self, table: &[BlockId], pos: usize) -> Result<usize, StepError> {
        let b = table.get(pos / self.block_size).ok_or_else(|| {
            StepError::Shape(format!(
                "position {pos} has no block in its sequence's table of {} block(s) of {}",
                table.len(),
                self.block_size
            ))
        })?;
        if *b as usize >= self.blocks {
            return Err(StepError::Shape(format!(
                "block {b} of a table is outside the cache's {} blocks",
                self.blocks
            )));
        }
        Ok((*b as usize * self.block_size + pos % self.block_size) * self.width)
    }
}

/// A decode step's logits, one row of the vocabulary after each row that
/// asked for them, in one flat buffer that is kept from step to step: a
/// server's steps write into the same memory instead of allocating (and,
/// on a GPU, faulting in) a fresh buffer per step and per row.
///
/// A caller that needs only the greedy choice of some rows says so
/// ([`want_whole`](Self::want_whole)): a decoder may then leave those
/// rows' vectors unwritten and hand over each row's [`Pick`] instead
/// ([`set_picks`](Self::set_picks)), which a GPU makes on the device so
/// that a step moves a few bytes per row to the host, not the vocabulary.
#[derive(Debug, Clone, Default)]
pub struct Logits {
    data: Vec<f32>,
    vocab: usize,
    rows: usize,
    /// Per output row, whether the caller needs its whole vector; rows
    /// past its end (or every row, when empty) do.
    whole: Vec<bool>,
    /// The decoder's picks of this step's rows, when it made them.
    picks: Vec<Pick>,
    picked: bool,
    /// Picks choose among the first this many tokens (0: every one).
    choosable: usize,
}

/// A row's greedy choice: the highest logit's token (the lowest such
/// token on a tie, as [`crate::sample`]'s argmax) and its log-probability.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Pick {
    pub token: u32,
    pub logprob: f32,
}

impl Pick {
    /// The pick of `logits`, on the host (the log-softmax in f64).
    pub fn of(logits: &[f32]) -> Pick {
        let token = crate::sample::argmax(logits);
        Pick {
            token: token as u32,
            logprob: log_softmax_at(logits, token),
        }
    }
}

/// `log softmax(logits)[at]`, in f64.
pub fn log_softmax_at(logits: &[f32], at: usize) -> f32 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().map(|&x| (x as f64 - max).exp()).sum();
    (logits[at] as f64 - max - sum.ln()) as f32
}

impl Logits {
    /// An empty buffer.
    pub fn new() -> Logits {
        Logits::default()
    }

    /// Makes room for `rows` rows of `vocab` logits and returns them,
    /// flat, to be written (their old values are left). Forgets the last
    /// step's picks.
    pub fn fill(&mut self, rows: usize, vocab: usize) -> &mut [f32] {
        let n = rows * vocab;
        if self.data.len() < n {
            self.data.resize(n, 0.0);
        }
        (self.rows, self.vocab) = (rows, vocab);
        self.picked = false;
        &mut self.data[..n]
    }

    /// [`fill`](Self::fill), then the rows the caller wants whole, each
    /// with its index, to be written (the others are left).
    pub fn fill_wanted(
        &mut self,
        rows: usize,
        vocab: usize,
    ) -> impl Iterator<Item = (usize, &mut [f32])> + '_ {
        self.fill(rows, vocab);
        let whole = &self.whole;
        self.data[..rows * vocab]
            .chunks_mut(vocab.max(1))
            .enumerate()
            .filter(move |(i, _)| whole.get(*i).copied().unwrap_or(true))
    }

    /// Replaces the contents by `rows` (each of the same length).
    pub fn set(&mut self, rows: &[Vec<f32>]) {
        let vocab = rows.first().map_or(0, Vec::len);
        let flat = self.fill(rows.len(), vocab);
        for (out, r) in flat.chunks_exact_mut(vocab.max(1)).zip(rows) {
            out.copy_from_slice(r);
        }
    }

    /// Says, per output row of the next step, whether its whole vector is
    /// needed (a sampled row) or only its [`Pick`] (a greedy one). Kept
    /// until said again; empty: every row whole.
    pub fn want_whole(&mut self, whole: impl IntoIterator<Item = bool>) {
        self.whole.clear();
        self.whole.extend(whole);
    }

    /// Picks choose among the first `tokens` tokens only (those a
    /// tokenizer can write, when the model's vocabulary is padded), their
    /// log-probabilities over those alone. Kept until said again.
    pub fn pick_among(&mut self, tokens: usize) {
        self.choosable = tokens;
    }

    /// How many of a row's first tokens a pick chooses among.
    pub fn choosable(&self) -> usize {
        self.choosable_of(self.vocab)
    }

    /// The same, for rows of `vocab` logits.
    pub fn choosable_of(&self, vocab: usize) -> usize {
        match self.choosable {
            0 => vocab,
            n => n.min(vocab),
        }
    }

    /// Whether the caller needs row `i`'s whole vector.
    pub fn wants_whole(&self, i: usize) -> bool {
        self.whole.get(i).copied().unwrap_or(true)
    }

    /// Whether every row's whole vector is needed.
    pub fn wants_every_row(&self) -> bool {
        self.whole.iter().all(|&w| w)
    }

    /// The decoder's picks of this step's rows (after [`fill`](Self::fill)),
    /// one per row.
    pub fn set_picks(&mut self, picks: impl IntoIterator<Item = Pick>) {
        self.picks.clear();
        self.picks.extend(picks);
        debug_assert_eq!(self.picks.len(), self.rows);
        self.picked = true;
    }

    /// Row `i`'s greedy token: the decoder's pick, or its vector's argmax
    /// (no log-softmax: [`pick`](Self::pick) has it).
    pub fn token(&self, i: usize) -> u32 {
        match self.picked {
            true => self.picks[i].token,
            false => crate::sample::argmax(&self.row(i)[..self.choosable()]) as u32,
        }
    }

    /// Row `i`'s greedy choice: the decoder's, or made here from its
    /// vector.
    pub fn pick(&self, i: usize) -> Pick {
        match self.picked {
            true => self.picks[i],
            false => Pick::of(&self.row(i)[..self.choosable()]),
        }
    }

    /// The number of rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Row `i`'s logits (written when the caller wanted it whole; a
    /// decoder may leave the others' stale).
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.vocab..(i + 1) * self.vocab]
    }

    /// Every row, in order.
    pub fn iter(&self) -> impl Iterator<Item = &[f32]> {
        (0..self.rows).map(|i| self.row(i))
    }

    /// The rows as owned vectors (tests).
    pub fn to_vecs(&self) -> Vec<Vec<f32>> {
        self.iter().map(<[f32]>::to_vec).collect()
    }
}

/// One row of a decode step: a token of one sequence.
#[derive(Debug, Clone, Copy)]
pub struct DecodeRow<'a> {
    /// The token at this position.
    pub token: u32,
    /// Its position in the sequence (0 for a prompt's first token).
    pub pos: usize,
    /// The sequence's blocks, holding every position up to `pos` (the
    /// earlier ones written by earlier rows or steps).
    pub table: &'a [BlockId],
    /// Whether the step returns the logits after this row (the last
    /// row of a sequence in the step, when it samples).
    pub logits: bool,
}

impl Gpt {
    /// One decode step: the rows' keys and values written into `kv`, and
    /// the logits (over the whole vocabulary) after each row that asks
    /// for them, in row order. Rows of the same sequence come in position
    /// order; a row sees its sequence's positions up to its own.
    pub fn decode<T: Real>(
        &self,
        p: &[T],
        kv: &mut KvPages<T>,
        rows: &[DecodeRow<'_>],
    ) -> Result<Vec<Vec<T>>, StepError> {
        let ly = &*self.layout;
        let cfg = &ly.config;
        let c = cfg.n_embd;
        // A share without its group is refused here, and one that splits
        // the residual stream's rows: a decode step's rows are few.
        if self.group()?.is_some() && self.sequence_parallel() {
            return Err(StepError::Group(
                "decoding splits no rows: build the tensor-parallel share without sequence \
                 parallelism"
                    .into(),
            ));
        }
        if p.len() != ly.len {
            return Err(StepError::Shape(format!(
                "{} parameters for a model of {}",
                p.len(),
                ly.len
            )));
        }
        let heads_width = self.widths.attn;
        if kv.width != heads_width || kv.k.len() != cfg.n_layer {
            return Err(StepError::Shape(format!(
                "a KV cache of {} layers × width {} for a model (or share) of {} × {heads_width}",
                kv.k.len(),
                kv.width,
                cfg.n_layer
            )));
        }
        for r in rows {
            if r.pos >= cfg.context {
                return Err(StepError::Shape(format!(
                    "position {} is past the model's context of {}",
                    r.pos, cfg.context
                )));
            }
            if r.token as usize >= cfg.vocab_size {
                return Err(StepError::Shape(format!(
                    "token {} is outside the vocabulary of {}",
                    r.token, cfg.vocab_size
                )));
            }
        }
        let n = rows.len();
        let emb = &p[ly.block_range(Block::Embedding)];
        let (wte, wpe) = (&emb[self.wte.clone()], &emb[self.wpe.clone()]);
        let mut x = vec![T::ZERO; n * c];
        self.decode_embedding(&mut x, wte, wpe, rows)?;
        let mut out = vec![T::ZERO; n * c];
        let mut t: [Vec<T>; 9] =
            std::array::from_fn(|i| vec![T::ZERO; n * Act::ALL[i].width(&self.widths)]);
        let mut stats = vec![T::ZERO; 2 * n];
        for l in 0..cfg.n_layer {
            let _t = braid_trace::scope::start(None, braid_trace::Cat::Compute, || {
                format!("decode layer {l}")
            });
            block::forward(&mut DecodeForward {
                gpt: self,
                r: &self.layers[l],
                p: &p[ly.block_range(Block::Layer(l))],
                x: &x,
                out: &mut out,
                t: &mut t,
                stats: &mut stats,
                kv,
                layer: l,
                rows,
            })?;
            std::mem::swap(&mut x, &mut out);
        }
        let norm = &p[ly.block_range(Block::FinalNorm)];
        let (w, b) = (&norm[self.lnf_w.clone()], &norm[self.lnf_b.clone()]);
        // The final norm of the rows that want logits, then one product
        // with the token embeddings (tied head).
        let want: Vec<usize> = (0..n).filter(|&i| rows[i].logits).collect();
        let mut lnf = vec![T::ZERO; want.len() * c];
        let (mut mean, mut rstd) = ([T::ZERO], [T::ZERO]);
        for (o, &i) in lnf.chunks_exact_mut(c).zip(&want) {
            layernorm_forward(o, &mut mean, &mut rstd, &x[i * c..(i + 1) * c], w, b, c);
        }
        self.decode_logits(&lnf, wte, want.len())
    }

    /// The residual stream entering layer 0 for `rows` (`x`: one row of
    /// `C` each): token plus position embedding. A tensor-parallel share
    /// looks up the tokens in its rows of the vocabulary (zeros for the
    /// others') and sums over the group first — adding zeros, so the sum
    /// is the one process's bit for bit.
    fn decode_embedding<T: Real>(
        &self,
        x: &mut [T],
        wte: &[T],
        wpe: &[T],
        rows: &[DecodeRow<'_>],
    ) -> Result<(), StepError> {
        let c = self.widths.c;
        let (first, held) = (self.widths.vocab_start, self.widths.vocab);
        for (o, r) in x.chunks_exact_mut(c).zip(rows) {
            match (r.token as usize).checked_sub(first).filter(|&k| k < held) {
                Some(k) => o.copy_from_slice(&wte[k * c..][..c]),
                None => o.fill(T::ZERO),
            }
        }
        self.all_reduce(x, "decode: summing the token embeddings")?;
        for (o, r) in x.chunks_exact_mut(c).zip(rows) {
            let q = &wpe[r.pos * c..][..c];
            for (e, &p) in o.iter_mut().zip(q) {
                *e += p;
            }
        }
        Ok(())
    }

    /// The logits over the whole vocabulary after each of the `n` rows of
    /// `lnf` (the final norm's output): one product with the token
    /// embeddings (tied head). A tensor-parallel share computes those of
    /// its rows of the vocabulary, and the group's are gathered, padded
    /// to the largest share (the vocabulary need not split evenly).
    fn decode_logits<T: Real>(
        &self,
        lnf: &[T],
        wte: &[T],
        n: usize,
    ) -> Result<Vec<Vec<T>>, StepError> {
        let c = self.widths.c;
        let v = self.layout.config.vocab_size;
        let held = self.widths.vocab;
        let Some(g) = self.group()? else {
            let mut all = vec![T::ZERO; n * v];
            gemm_rm(&mut all, lnf, false, &wte[..v * c], true, n, v, c, false);
            return Ok(all.chunks_exact(v).map(|r| r.to_vec()).collect());
        };
        let size = g.comm.size();
        let widest = v.div_ceil(size);
        let mut mine = vec![T::ZERO; n * widest];
        let mut part = vec![T::ZERO; n * held];
        gemm_rm(
            &mut part,
            lnf,
            false,
            &wte[..held * c],
            true,
            n,
            held,
            c,
            false,
        );
        for (o, p) in mine.chunks_exact_mut(widest).zip(part.chunks_exact(held)) {
            o[..held].copy_from_slice(p);
        }
        let mut gathered = vec![T::ZERO; size * n * widest];
        self.gather_rows(&mine, &mut gathered, "decode: gathering the logits")?;
        let mut logits = vec![vec![T::ZERO; v]; n];
        for rank in 0..size {
            let (start, len) = TensorShard { rank, size }.vocab(v);
            let from = &gathered[rank * n * widest..][..n * widest];
            for (row, f) in logits.iter_mut().zip(from.chunks_exact(widest)) {
                row[start..start + len].copy_from_slice(&f[..len]);
            }
        }
        Ok(logits)
    }
}

/// One layer of a decode step: the block's tensors for the step's rows
/// in `t`, the layer's pages in `kv`.
struct DecodeForward<'a, T> {
    gpt: &'a Gpt,
    r: &'a LayerRanges,
    /// The layer's block of parameters.
    p: &'a [T],
    x: &'a [T],
    out: &'a mut [T],
    t: &'a mut [Vec<T>; 9],
    /// Each row's LayerNorm mean and reciprocal deviation.
    stats: &'a mut [T],
    kv: &'a mut KvPages<T>,
    layer: usize,
    rows: &'a [DecodeRow<'a>],
}

impl<T: Real> BlockForward for DecodeForward<'_, T> {
    type Error = StepError;

    fn norm_forward(&mut self, norm: Norm, input: Act, out: Act) -> Result<(), StepError> {
        let (w, b) = self.r.norm(norm);
        let (o, t) = split(self.x, self.out, self.t, out);
        let (mean, rstd) = self.stats.split_at_mut(self.rows.len());
        layernorm_forward(
            o,
            mean,
            rstd,
            t.get(input),
            &self.p[w],
            &self.p[b],
            self.gpt.widths.c,
        );
        Ok(())
    }

    fn column_forward(&mut self, linear: Linear, input: Act, out: Act) -> Result<(), StepError> {
        let (w, b) = self.r.linear(linear);
        let (ic, oc) = linear.widths(&self.gpt.widths);
        let (o, t) = split(self.x, self.out, self.t, out);
        let n = self.rows.len();
        linear_forward(o, t.get(input), &self.p[w], Some(&self.p[b]), n, ic, oc);
        Ok(())
    }

    fn attention_forward(&mut self, input: Act, out: Act) -> Result<(), StepError> {
        let (c, nh) = (self.gpt.widths.attn, self.gpt.widths.heads);
        let hs = c / nh;
        let scale = T::of(1.0 / (hs as f64).sqrt());
        let (o, t) = split(self.x, self.out, self.t, out);
        let qkv = t.get(input);
        let l = self.layer;
        // Every row's key and value into its page first: a prompt's rows
        // attend to one another.
        for (i, r) in self.rows.iter().enumerate() {
            let at = self.kv.at(r.table, r.pos)?;
            let row = &qkv[i * 3 * c..(i + 1) * 3 * c];
            self.kv.k[l][at..at + c].copy_from_slice(&row[c..2 * c]);
            self.kv.v[l][at..at + c].copy_from_slice(&row[2 * c..]);
        }
        let (keys, values) = (&self.kv.k[l], &self.kv.v[l]);
        let mut att = Vec::new();
        for (i, r) in self.rows.iter().enumerate() {
            let at: Vec<usize> = (0..=r.pos)
                .map(|j| self.kv.at(r.table, j))
                .collect::<Result<_, _>>()?;
            att.resize(r.pos + 1, T::ZERO);
            for h in 0..nh {
                // The training pass's arithmetic, in its order.
                let q = &qkv[i * 3 * c + h * hs..][..hs];
                let mut maxv = T::of(f64::NEG_INFINITY);
                for (a, &kat) in att.iter_mut().zip(&at) {
                    let k = &keys[kat + h * hs..][..hs];
                    let mut dot = T::ZERO;
                    for e in 0..hs {
                        dot += q[e] * k[e];
                    }
                    *a = dot * scale;
                    maxv = maxv.max(*a);
                }
                let mut sum = T::ZERO;
                for a in att.iter_mut() {
                    *a = (*a - maxv).exp();
                    sum += *a;
                }
                let inv = T::ONE / sum;
                for a in att.iter_mut() {
                    *a *= inv;
                }
                let y = &mut o[i * c + h * hs..][..hs];
                y.fill(T::ZERO);
                for (&a, &vat) in att.iter().zip(&at) {
                    let v = &values[vat + h * hs..][..hs];
                    for e in 0..hs {
                        y[e] += a * v[e];
                    }
                }
            }
        }
        Ok(())
    }

    fn gelu_forward(&mut self, input: Act, out: Act) -> Result<(), StepError> {
        let (o, t) = split(self.x, self.out, self.t, out);
        gelu_forward(o, t.get(input));
        Ok(())
    }

    fn row_forward(
        &mut self,
        linear: Linear,
        input: Act,
        residual: Act,
        out: Act,
    ) -> Result<(), StepError> {
        let (w, b) = self.r.linear(linear);
        let (k, _) = linear.widths(&self.gpt.widths);
        let (o, t) = split(self.x, self.out, self.t, out);
        // The training pass's row product (summed over a tensor-parallel
        // group; no rows split, so no scratch for a reduce-scatter).
        self.gpt.row_split_forward(
            o,
            t.get(input),
            &self.p[w],
            &self.p[b],
            t.get(residual),
            &mut [],
            self.rows.len(),
            k,
            "decode: a row product",
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::GptConfig;
    use crate::paged::{BlockPool, BlockTable};
    use crate::params::Params;
    use std::sync::Arc;

    fn model(spec: &str, seed: u64) -> (Gpt, Vec<f64>) {
        let l = Arc::new(Layout::new(&GptConfig::parse(spec).unwrap()));
        let init = Params::init_gpt2(l.clone(), seed);
        // Larger-than-GPT-2 weights so the attention is far from uniform.
        let p = init.data.iter().map(|&x| x as f64 * 8.0).collect();
        (Gpt::new(l), p)
    }

    fn close(a: &[f64], b: &[f64]) -> f64 {
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f64::max)
    }

    fn argmax(x: &[f64]) -> u32 {
        let mut best = 0;
        for (i, &v) in x.iter().enumerate() {
            if v > x[best] {
                best = i;
            }
        }
        best as u32
    }

    #[test]
    fn picks_are_the_rows_argmax_among_the_choosable_tokens() {
        let mut l = Logits::new();
        // Every row whole until said otherwise.
        assert!(l.wants_whole(3) && l.wants_every_row());
        l.set(&[
            vec![0.5, 2.0, 2.0, -1.0, 9.0],
            vec![-3.0, 1.0, 0.0, 1.0, 0.0],
        ]);
        // The first of tied maxima, and its log-softmax.
        let p = l.pick(1);
        assert_eq!(p.token, 1);
        let lse = [-3.0f64, 1.0, 0.0, 1.0, 0.0]
            .iter()
            .map(|x| x.exp())
            .sum::<f64>()
            .ln();
        assert!((p.logprob as f64 - (1.0 - lse)).abs() < 1e-6);
        // Among the first 4 only, row 0's 9.0 is out of reach.
        l.pick_among(4);
        assert_eq!(l.pick(0).token, 1);
        assert_eq!(l.choosable(), 4);
        // A decoder's own picks are handed over as they are, until the
        // next fill.
        l.want_whole([false, true]);
        assert!(!l.wants_whole(0) && l.wants_whole(1) && l.wants_whole(2));
        assert!(!l.wants_every_row());
        let mine = Pick {
            token: 3,
            logprob: -0.25,
        };
        // Only row 1 is handed out to be written whole.
        let wanted: Vec<usize> = l.fill_wanted(2, 5).map(|(i, _)| i).collect();
        assert_eq!(wanted, vec![1]);
        l.set_picks([mine, mine]);
        assert_eq!(l.pick(0), mine);
        assert_eq!(l.token(1), 3);
        l.fill(2, 5);
        assert_eq!(l.pick(0).token, 1);
        assert_eq!(l.token(0), 1);
    }

    /// Prefill in one step, then one row per step: the logits after every
    /// position equal the whole window recomputed (f64, within rounding),
    /// so the greedy continuation is the same.
    #[test]
    fn decoding_with_pages_gives_the_logits_of_the_whole_window() {
        let (m, p) = model("L2-H2-C16-V37-T24", 3);
        let mut pool = BlockPool::new(8, 4);
        let mut kv = KvPages::<f64>::new(&m.layout, 8, 4);
        let prompt = [5u32, 9, 1, 30, 2, 2, 17];
        let mut table = BlockTable::new();
        table.start(&mut pool, &prompt).unwrap();
        let rows: Vec<DecodeRow> = prompt
            .iter()
            .enumerate()
            .map(|(i, &token)| DecodeRow {
                token,
                pos: i,
                table: table.blocks(),
                logits: i + 1 == prompt.len(),
            })
            .collect();
        let mut logits = m.decode(&p, &mut kv, &rows).unwrap().remove(0);
        let mut tokens = prompt.to_vec();
        for _ in 0..12 {
            let whole = m.next_token_logits(&p, &tokens).unwrap();
            assert!(close(&logits, &whole) < 1e-9, "{}", close(&logits, &whole));
            let next = argmax(&logits);
            let pos = tokens.len();
            tokens.push(next);
            table.append(&mut pool, &[next]).unwrap();
            let row = DecodeRow {
                token: next,
                pos,
                table: table.blocks(),
                logits: true,
            };
            logits = m.decode(&p, &mut kv, &[row]).unwrap().remove(0);
        }
    }

    /// Three sequences of different lengths decoded together, one of them
    /// still in its prefill, give each the logits it gets alone; a shared
    /// prefix block is read, not recomputed.
    #[test]
    fn a_sequence_decodes_the_same_alone_or_batched() {
        let (m, p) = model("L2-H4-C16-V29-T32", 9);
        let prompts: [&[u32]; 3] = [&[1, 2, 3, 4, 5, 6, 7, 8, 9], &[1, 2, 3, 4, 20], &[7]];
        // Alone: each prompt prefilled in its own cache.
        let alone: Vec<Vec<f64>> = prompts
            .iter()
            .map(|pr| m.next_token_logits(&p, pr).unwrap())
            .collect();
        let mut pool = BlockPool::new(16, 4);
        let mut kv = KvPages::<f64>::new(&m.layout, 16, 4);
        let mut tables: Vec<BlockTable> = Vec::new();
        let mut cached = Vec::new();
        for pr in prompts {
            let mut t = BlockTable::new();
            cached.push(t.start(&mut pool, pr).unwrap());
            tables.push(t);
        }
        // The second prompt shares the first's first block (its hash is
        // known once the first's table holds it): computed by the first
        // sequence's rows in this very step, whose keys and values every
        // layer writes before any row attends.
        assert_eq!(cached, [0, 4, 0]);
        let mut rows = Vec::new();
        for (s, pr) in prompts.iter().enumerate() {
            for (i, &token) in pr.iter().enumerate().skip(cached[s]) {
                rows.push(DecodeRow {
                    token,
                    pos: i,
                    table: tables[s].blocks(),
                    logits: i + 1 == pr.len(),
                });
            }
        }
        let got = m.decode(&p, &mut kv, &rows).unwrap();
        for (s, (g, a)) in got.iter().zip(&alone).enumerate() {
            assert!(close(g, a) < 1e-9, "sequence {s}: {}", close(g, a));
        }
        // A fourth sequence with the first's prompt shares its two full
        // blocks and computes only its last position.
        let mut t = BlockTable::new();
        let skip = t.start(&mut pool, prompts[0]).unwrap();
        assert_eq!(skip, 8);
        let row = DecodeRow {
            token: prompts[0][8],
            pos: 8,
            table: t.blocks(),
            logits: true,
        };
        let got = m.decode(&p, &mut kv, &[row]).unwrap();
        assert!(close(&got[0], &alone[0]) < 1e-9);
    }

    #[test]
    fn bad_rows_are_refused_with_what_was_wrong() {
        let (m, p) = model("L1-H2-C8-V11-T6", 1);
        let mut kv = KvPages::<f64>::new(&m.layout, 2, 4);
        let table = [0u32, 1];
        let row = |token, pos| DecodeRow {
            token,
            pos,
            table: &table,
            logits: true,
        };
        let e = m.decode(&p, &mut kv, &[row(1, 6)]).unwrap_err().to_string();
        assert!(e.contains("past the model's context of 6"), "{e}");
        let e = m
            .decode(&p, &mut kv, &[row(11, 0)])
            .unwrap_err()
            .to_string();
        assert!(e.contains("outside the vocabulary"), "{e}");
        let short = [0u32];
        let e = m
            .decode(
                &p,
                &mut kv,
                &[DecodeRow {
                    token: 1,
                    pos: 5,
                    table: &short,
                    logits: true,
                }],
            )
            .unwrap_err()
            .to_string();
        assert!(e.contains("has no block"), "{e}");
    }
}
