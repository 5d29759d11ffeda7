//! The LM head fused with softmax and cross-entropy: logits against the
//! (tied) token embedding, each row's loss, and — in the same pass over
//! the logits, which are overwritten by their gradient — the gradients of
//! the input and the embedding. Rows go in chunks, so memory is
//! `chunk × vocabulary` however large the batch.

use super::matmul::gemm_rm;
use super::real::Real;
use rayon::prelude::*;

/// Rows per chunk of logits.
pub const CHUNK_ROWS: usize = 256;

/// Inputs of the classifier.
pub struct ClassifierIo<'a, T> {
    /// Final-norm output `[rows, c]`.
    pub x: &'a [T],
    /// Token embedding `[v, c]` (the tied LM head).
    pub wte: &'a [T],
    /// Target token per row (`u32::MAX`: no loss for that row).
    pub targets: &'a [u32],
    /// Rows, width, vocabulary.
    pub rows: usize,
    /// Width.
    pub c: usize,
    /// Vocabulary.
    pub v: usize,
}

/// Writes each row's loss into `losses`; with `grads = Some((dx, dwte,
/// scale))` also accumulates `scale · ∂loss/∂x` and `∂/∂wte`. `scratch`
/// holds one chunk of logits (resized once).
pub fn classifier<T: Real>(
    io: &ClassifierIo<T>,
    losses: &mut [T],
    mut grads: Option<(&mut [T], &mut [T], T)>,
    scratch: &mut Vec<T>,
) {
    let ClassifierIo {
        x,
        wte,
        targets,
        rows,
        c,
        v,
    } = *io;
    scratch.resize(CHUNK_ROWS.min(rows.max(1)) * v, T::ZERO);
    let mut r0 = 0;
    while r0 < rows {
        let r = CHUNK_ROWS.min(rows - r0);
        let logits = &mut scratch[..r * v];
        let xs = &x[r0 * c..(r0 + r) * c];
        gemm_rm(logits, xs, false, wte, true, r, v, c, false);
        let scale = grads.as_ref().map(|g| g.2);
        logits
            .par_chunks_mut(v)
            .zip(losses[r0..r0 + r].par_iter_mut())
            .zip(targets[r0..r0 + r].par_iter())
            .for_each(|((row, loss), &target)| {
                let mut maxv = T::of(f64::NEG_INFINITY);
                for &l in row.iter() {
                    maxv = maxv.max(l);
                }
                let mut sum = T::ZERO;
                for l in row.iter_mut() {
                    *l = (*l - maxv).exp();
                    sum += *l;
                }
                let inv = T::ONE / sum;
                let t = target as usize;
                if t < v {
                    *loss = -(row[t] * inv).ln();
                } else {
                    *loss = T::ZERO;
                }
                // Turn probabilities into the gradient of the loss.
                match scale {
                    Some(s) if t < v => {
                        for l in row.iter_mut() {
                            *l = *l * inv * s;
                        }
                        row[t] -= s;
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
}
