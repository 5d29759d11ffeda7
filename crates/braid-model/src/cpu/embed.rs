//! Token + position embeddings.

use super::real::Real;

/// `out[b,t,:] = wte[tokens[b,t]] + wpe[t]`.
pub fn embed_forward<T: Real>(
    out: &mut [T],
    tokens: &[u32],
    wte: &[T],
    wpe: &[T],
    t: usize,
    c: usize,
) {
    for (i, (o, &tok)) in out.chunks_exact_mut(c).zip(tokens).enumerate() {
        let e = &wte[tok as usize * c..][..c];
        let p = &wpe[(i % t) * c..][..c];
        for k in 0..c {
            o[k] = e[k] + p[k];
        }
    }
}

/// Accumulates the embedding gradients (sequentially: a token repeated in
/// the batch sums in a fixed order).
pub fn embed_backward<T: Real>(
    dwte: &mut [T],
    dwpe: &mut [T],
    dout: &[T],
    tokens: &[u32],
    t: usize,
    c: usize,
) {
    for (i, (d, &tok)) in dout.chunks_exact(c).zip(tokens).enumerate() {
        let e = &mut dwte[tok as usize * c..][..c];
        for k in 0..c {
            e[k] += d[k];
        }
        let p = &mut dwpe[(i % t) * c..][..c];
        for k in 0..c {
            p[k] += d[k];
        }
    }
}
