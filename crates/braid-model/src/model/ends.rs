//! The two ends of the model: the embeddings (token and position) into
//! the residual stream, and the head (final LayerNorm, the tied LM head
//! and cross-entropy). A tensor-parallel rank holds its rows of the
//! vocabulary: its lookups are summed over the group, and the
//! cross-entropy is vocabulary-parallel (each row's maximum, sum of
//! exponentials and target logit summed or maxed over the group) so that
//! no rank ever holds all the logits.

use super::acts::{Activations, Widths};
use super::error::StepError;
use super::gpt::Gpt;
use super::split::two_mut;
use crate::block::Act;
use crate::cpu::classifier::{classifier, ClassifierIo, CHUNK_ROWS};
use crate::cpu::embed::{embed_backward, embed_forward};
use crate::cpu::matmul::gemm_rm;
use crate::cpu::norm::{layernorm_backward, layernorm_forward};
use crate::cpu::Real;
use crate::tensor_comm::ReduceKind;
use rayon::prelude::*;

impl Gpt {
    /// The embedding block (`emb`: its parameters): checks the batch,
    /// then writes the residual stream entering layer 0 (this rank's rows).
    pub fn embedding_forward<T: Real>(
        &self,
        emb: &[T],
        acts: &mut Activations<T>,
        tokens: &[u32],
        targets: &[u32],
    ) -> Result<(), StepError> {
        self.check(acts, tokens, targets)?;
        let Widths {
            c,
            vocab,
            vocab_start,
            ..
        } = self.widths;
        let (wte, wpe) = (&emb[self.wte.clone()], &emb[self.wpe.clone()]);
        if self.group()?.is_none() {
            embed_forward(&mut acts.resid[0], tokens, wte, wpe, acts.t, c);
            return Ok(());
        }
        // This rank's rows of the vocabulary, zeros for the others'.
        let sp = self.sequence_parallel();
        let lookup: &mut [T] = match sp {
            true => &mut acts.scratch.full,
            false => &mut acts.resid[0],
        };
        for (o, &tok) in lookup.chunks_exact_mut(c).zip(tokens) {
            match (tok as usize)
                .checked_sub(vocab_start)
                .filter(|&k| k < vocab)
            {
                Some(k) => o.copy_from_slice(&wte[k * c..(k + 1) * c]),
                None => o.fill(T::ZERO),
            }
        }
        let what = "embedding forward: summing the token embeddings";
        match sp {
            false => self.all_reduce(&mut acts.resid[0], what)?,
            true => self.scatter_rows(&acts.scratch.full, &mut acts.resid[0], what)?,
        }
        // The position embedding of this rank's rows.
        let first = acts.split_rank(self) * acts.resid[0].len() / c;
        for (i, o) in acts.resid[0].chunks_exact_mut(c).enumerate() {
            let pos = &wpe[((first + i) % acts.t) * c..][..c];
            for (x, &p) in o.iter_mut().zip(pos) {
                *x += p;
            }
        }
        Ok(())
    }

    /// Backward of the embedding block (last; `g_emb` its gradients):
    /// token and position embedding gradients.
    pub fn embedding_backward<T: Real>(
        &self,
        g_emb: &mut [T],
        acts: &mut Activations<T>,
        tokens: &[u32],
    ) -> Result<(), StepError> {
        let Widths {
            c,
            vocab,
            vocab_start,
            ..
        } = self.widths;
        let (gte, gpe) = two_mut(g_emb, self.wte.clone(), self.wpe.clone());
        if self.group()?.is_none() {
            embed_backward(gte, gpe, &acts.dresid, tokens, acts.t, c);
            return Ok(());
        }
        // Every row's gradient (gathered under sequence parallelism): the
        // position embedding's gradient whole on every rank, the token
        // embedding's for this rank's rows of the vocabulary.
        let dout: &[T] = match self.sequence_parallel() {
            true => {
                let what = "embedding backward: gathering rows";
                self.gather_rows(&acts.dresid, &mut acts.scratch.full, what)?;
                &acts.scratch.full
            }
            false => &acts.dresid,
        };
        for (i, (d, &tok)) in dout.chunks_exact(c).zip(tokens).enumerate() {
            if let Some(k) = (tok as usize)
                .checked_sub(vocab_start)
                .filter(|&k| k < vocab)
            {
                for (g, &x) in gte[k * c..(k + 1) * c].iter_mut().zip(d) {
                    *g += x;
                }
            }
            for (g, &x) in gpe[(i % acts.t) * c..][..c].iter_mut().zip(d) {
                *g += x;
            }
        }
        Ok(())
    }

    /// The head (`norm`: the final norm's block, `emb`: the embedding
    /// block, whose token embedding is the LM head): final LayerNorm, LM
    /// head, cross-entropy. Returns the mean loss over unmasked positions
    /// (the LM head is skipped when every target is masked, as in
    /// generation).
    pub fn head_forward<T: Real>(
        &self,
        norm: &[T],
        emb: &[T],
        acts: &mut Activations<T>,
        targets: &[u32],
    ) -> Result<T, StepError> {
        let cfg = &self.layout.config;
        let c = cfg.n_embd;
        let n = acts.b * acts.t;
        let (w, b) = (&norm[self.lnf_w.clone()], &norm[self.lnf_b.clone()]);
        let x = acts.resid.last().expect("at least the input");
        match self.sequence_parallel() {
            false => layernorm_forward(
                &mut acts.lnf,
                &mut acts.lnf_mean,
                &mut acts.lnf_rstd,
                x,
                w,
                b,
                c,
            ),
            true => {
                let local = &mut acts.scratch.local;
                layernorm_forward(local, &mut acts.lnf_mean, &mut acts.lnf_rstd, x, w, b, c);
                self.gather_rows(local, &mut acts.lnf, "head forward: gathering ln_f's rows")?;
            }
        }
        if targets.iter().all(|&x| x == u32::MAX) {
            acts.losses.fill(T::ZERO);
            return Ok(T::ZERO);
        }
        let io = ClassifierIo {
            x: &acts.lnf,
            wte: &emb[self.wte.clone()],
            targets,
            rows: n,
            c,
            v: self.widths.vocab,
        };
        match self.group()? {
            None => classifier(&io, &mut acts.losses, None, &mut acts.logits),
            Some(_) => {
                self.vocab_parallel_classifier(&io, &mut acts.losses, None, &mut acts.logits)?
            }
        }
        Ok(mean_loss(&acts.losses, targets))
    }

    /// Backward of the head (after [`head_forward`](Self::head_forward)
    /// with the same targets; `norm`/`emb` the final norm's and the
    /// embedding block's parameters, `g_norm`/`g_emb` their gradients):
    /// the LM head's share of the token embedding's gradient, the final
    /// norm's gradients, and the gradient of the last residual stream
    /// (kept in `acts` for the layers).
    pub fn head_backward<T: Real>(
        &self,
        norm: &[T],
        emb: &[T],
        g_norm: &mut [T],
        g_emb: &mut [T],
        acts: &mut Activations<T>,
        targets: &[u32],
    ) -> Result<(), StepError> {
        let cfg = &self.layout.config;
        let c = cfg.n_embd;
        let n = acts.b * acts.t;
        let counted = targets.iter().filter(|&&x| x != u32::MAX).count();
        let scale = if counted == 0 {
            T::ZERO
        } else {
            T::ONE / T::of(counted as f64)
        };
        // The gradient of the final norm's output, all rows.
        let dlnf = acts.grads.of_mut(Act::Ln2);
        dlnf.fill(T::ZERO);
        {
            let io = ClassifierIo {
                x: &acts.lnf,
                wte: &emb[self.wte.clone()],
                targets,
                rows: n,
                c,
                v: self.widths.vocab,
            };
            let dwte = &mut g_emb[self.wte.clone()];
            let grads = Some((&mut dlnf[..], dwte, scale));
            match self.group()? {
                None => classifier(&io, &mut acts.losses, grads, &mut acts.logits),
                Some(_) => {
                    self.vocab_parallel_classifier(&io, &mut acts.losses, grads, &mut acts.logits)?
                }
            }
        }
        // Each rank's share of it (the vocabulary's) summed: whole, or
        // this rank's rows.
        let what = "head backward: summing ln_f's gradient";
        let dlnf: &[T] = match (self.group()?.is_some(), self.sequence_parallel()) {
            (false, _) => acts.grads.of_mut(Act::Ln2),
            (true, false) => {
                self.all_reduce(acts.grads.of_mut(Act::Ln2), what)?;
                acts.grads.of_mut(Act::Ln2)
            }
            (true, true) => {
                self.scatter_rows(
                    &acts.grads.d[Act::Ln2.index()],
                    &mut acts.scratch.local,
                    what,
                )?;
                &acts.scratch.local
            }
        };
        let lnf = self.lnf_w.start..self.lnf_b.end;
        let norms = std::slice::from_ref(&lnf);
        let before: Vec<T> = match self.sequence_parallel() {
            true => g_norm[norms[0].clone()].to_vec(),
            false => Vec::new(),
        };
        acts.dresid.fill(T::ZERO);
        let (gw, gb) = two_mut(g_norm, self.lnf_w.clone(), self.lnf_b.clone());
        layernorm_backward(
            &mut acts.dresid,
            gw,
            gb,
            dlnf,
            acts.resid.last().expect("at least the input"),
            &norm[self.lnf_w.clone()],
            &acts.lnf_mean,
            &acts.lnf_rstd,
            c,
        );
        if self.sequence_parallel() {
            self.sum_row_grads(g_norm, norms, &before, "head backward: ln_f's gradients")?;
        }
        Ok(())
    }

    /// The classifier of a tensor-parallel rank: its rows of the
    /// vocabulary's logits, each row's maximum and sum of exponentials
    /// over the whole vocabulary through the group, the target's logit
    /// from the rank that holds it. With `grads`, also this rank's share
    /// of `∂loss/∂x` (summed by the caller) and its rows of `∂/∂wte`.
    fn vocab_parallel_classifier<T: Real>(
        &self,
        io: &ClassifierIo<T>,
        losses: &mut [T],
        mut grads: Option<(&mut [T], &mut [T], T)>,
        scratch: &mut Vec<T>,
    ) -> Result<(), StepError> {
        let ClassifierIo {
            x,
            wte,
            targets,
            rows,
            c,
            v,
        } = *io;
        let first = self.widths.vocab_start;
        let held = |target: u32| (target as usize).checked_sub(first).filter(|&k| k < v);
        scratch.resize(CHUNK_ROWS.min(rows.max(1)) * v, T::ZERO);
        let mut r0 = 0;
        while r0 < rows {
            let r = CHUNK_ROWS.min(rows - r0);
            let logits = &mut scratch[..r * v];
            let xs = &x[r0 * c..(r0 + r) * c];
            let tg = &targets[r0..r0 + r];
            gemm_rm(logits, xs, false, wte, true, r, v, c, false);
            let mut maxv: Vec<T> = logits
                .chunks_exact(v)
                .map(|row| row.iter().fold(T::of(f64::NEG_INFINITY), |m, &l| m.max(l)))
                .collect();
            let g = self
                .group()?
                .expect("a tensor-parallel classifier has a group");
            T::all_reduce(&*g.comm, &mut maxv, ReduceKind::Max)
                .map_err(|e| StepError::Group(format!("the logits' maximum: {e}")))?;
            // Each row: Σ exp(l - max) here, and its target's l - max (0
            // where another rank holds the target).
            let mut sums = vec![T::ZERO; 2 * r];
            let (sum, target) = sums.split_at_mut(r);
            logits
                .par_chunks_mut(v)
                .zip(sum.par_iter_mut().zip(target.par_iter_mut()))
                .zip(maxv.par_iter().zip(tg.par_iter()))
                .for_each(|((row, (s, tl)), (&m, &t))| {
                    if let Some(k) = held(t) {
                        *tl = row[k] - m;
                    }
                    for l in row.iter_mut() {
                        *l = (*l - m).exp();
                        *s += *l;
                    }
                });
            self.all_reduce(&mut sums, "the logits' sum of exponentials")?;
            let (sum, target) = sums.split_at(r);
            let scale = grads.as_ref().map(|g| g.2);
            logits
                .par_chunks_mut(v)
                .zip(losses[r0..r0 + r].par_iter_mut())
                .zip(sum.par_iter().zip(target.par_iter()).zip(tg.par_iter()))
                .for_each(|((row, loss), ((&s, &tl), &t))| {
                    let counted = t != u32::MAX;
                    *loss = match counted {
                        true => s.ln() - tl,
                        false => T::ZERO,
                    };
                    match scale {
                        Some(sc) if counted => {
                            let inv = T::ONE / s;
                            for l in row.iter_mut() {
                                *l = *l * inv * sc;
                            }
                            if let Some(k) = held(t) {
                                row[k] -= sc;
                            }
                        }
                        _ => row.fill(T::ZERO),
                    }
                });
            if let Some((dx, dwte, _)) = grads.as_mut() {
                gemm_rm(
                    &mut dx[r0 * c..(r0 + r) * c],
                    logits,
                    false,
                    wte,
                    false,
                    r,
                    c,
                    v,
                    true,
                );
                gemm_rm(dwte, logits, true, xs, false, v, c, r, true);
            }
            r0 += r;
        }
        Ok(())
    }
}

impl<T: Real> Activations<T> {
    /// This rank's place among the `split` slices of the rows (0 without
    /// sequence parallelism).
    fn split_rank(&self, m: &Gpt) -> usize {
        match (self.split, &m.group) {
            (1, _) | (_, None) => 0,
            (_, Some(g)) => g.comm.rank(),
        }
    }
}

/// Mean of the losses at unmasked positions.
fn mean_loss<T: Real>(losses: &[T], targets: &[u32]) -> T {
    let mut sum = 0.0f64;
    let mut k = 0usize;
    for (&l, &t) in losses.iter().zip(targets) {
        if t != u32::MAX {
            sum += l.f64();
            k += 1;
        }
    }
    if k == 0 {
        T::ZERO
    } else {
        T::of(sum / k as f64)
    }
}
