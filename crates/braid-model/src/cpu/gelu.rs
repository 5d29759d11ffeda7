//! GELU, tanh approximation (GPT-2's `gelu_new`).

use super::real::Real;
use rayon::prelude::*;

const S2PI: f64 = 0.797_884_560_802_865_4; // sqrt(2/pi)

/// `out = 0.5·x·(1 + tanh(√(2/π)(x + 0.044715x³)))`.
pub fn gelu_forward<T: Real>(out: &mut [T], inp: &[T]) {
    out.par_chunks_mut(4096)
        .zip(inp.par_chunks(4096))
        .for_each(|(o, x)| {
            for (o, &x) in o.iter_mut().zip(x) {
                let cube = T::of(0.044715) * x * x * x;
                *o = T::of(0.5) * x * (T::ONE + (T::of(S2PI) * (x + cube)).tanh());
            }
        });
}

/// Accumulates `dinp += gelu'(inp) · dout`.
pub fn gelu_backward<T: Real>(dinp: &mut [T], inp: &[T], dout: &[T]) {
    dinp.par_chunks_mut(4096)
        .zip(inp.par_chunks(4096))
        .zip(dout.par_chunks(4096))
        .for_each(|((d, x), g)| {
            for ((d, &x), &g) in d.iter_mut().zip(x).zip(g) {
                let cube = T::of(0.044715) * x * x * x;
                let arg = T::of(S2PI) * (x + cube);
                let th = arg.tanh();
                let sech2 = T::ONE - th * th;
                let local = T::of(0.5) * (T::ONE + th)
                    + x * T::of(0.5)
                        * sech2
                        * T::of(S2PI)
                        * (T::ONE + T::of(3.0 * 0.044715) * x * x);
                *d += local * g;
            }
        });
}
