//! LayerNorm over the last dimension (ε = 1e-5, as GPT-2), keeping each
//! row's mean and reciprocal standard deviation for the backward pass.

use super::real::Real;
use rayon::prelude::*;

const EPS: f64 = 1e-5;

/// `out = (inp − mean) · rstd · w + b` per row of `c` elements.
pub fn layernorm_forward<T: Real>(
    out: &mut [T],
    mean: &mut [T],
    rstd: &mut [T],
    inp: &[T],
    w: &[T],
    b: &[T],
    c: usize,
) {
    out.par_chunks_mut(c)
        .zip(mean.par_iter_mut())
        .zip(rstd.par_iter_mut())
        .zip(inp.par_chunks(c))
        .for_each(|(((o, m), r), x)| {
            let mut s = T::ZERO;
            for &v in x {
                s += v;
            }
            let mu = s / T::of(c as f64);
            let mut var = T::ZERO;
            for &v in x {
                let d = v - mu;
                var += d * d;
            }
            let rs = T::ONE / (var / T::of(c as f64) + T::of(EPS)).sqrt();
            for i in 0..c {
                o[i] = (x[i] - mu) * rs * w[i] + b[i];
            }
            *m = mu;
            *r = rs;
        });
}

/// Accumulates the gradients of [`layernorm_forward`] into `dinp`, `dw`
/// and `db`.
#[allow(clippy::too_many_arguments)]
pub fn layernorm_backward<T: Real>(
    dinp: &mut [T],
    dw: &mut [T],
    db: &mut [T],
    dout: &[T],
    inp: &[T],
    w: &[T],
    mean: &[T],
    rstd: &[T],
    c: usize,
) {
    let n = T::of(c as f64);
    // Input gradients row by row in parallel; weight gradients in a fixed
    // sequential order (deterministic sums).
    dinp.par_chunks_mut(c)
        .zip(dout.par_chunks(c))
        .zip(inp.par_chunks(c))
        .zip(mean.par_iter().zip(rstd.par_iter()))
        .for_each(|(((di, dy), x), (&mu, &rs))| {
            let mut dnorm_mean = T::ZERO;
            let mut dnorm_norm_mean = T::ZERO;
            for i in 0..c {
                let norm = (x[i] - mu) * rs;
                let dnorm = w[i] * dy[i];
                dnorm_mean += dnorm;
                dnorm_norm_mean += dnorm * norm;
            }
            dnorm_mean = dnorm_mean / n;
            dnorm_norm_mean = dnorm_norm_mean / n;
            for i in 0..c {
                let norm = (x[i] - mu) * rs;
                let dnorm = w[i] * dy[i];
                di[i] += (dnorm - dnorm_mean - norm * dnorm_norm_mean) * rs;
            }
        });
    for ((dy, x), (&mu, &rs)) in dout
        .chunks_exact(c)
        .zip(inp.chunks_exact(c))
        .zip(mean.iter().zip(rstd))
    {
        for i in 0..c {
            let norm = (x[i] - mu) * rs;
            dw[i] += norm * dy[i];
            db[i] += dy[i];
        }
    }
}
