//! Linear layers on row-major matrices through the `gemm` crate (blocked,
//! vectorised, parallel over output tiles — the reduction order of each
//! output element is fixed, so results are deterministic).
//!
//! Weights use GPT-2's Conv1D layout `[in, out]`: `out = inp · w + bias`.

use super::real::Real;
use gemm::{gemm, Parallelism};

fn parallelism(m: usize, n: usize, k: usize) -> Parallelism {
    // Small products are not worth waking the thread pool for.
    if m * n * k < 64 * 64 * 64 {
        Parallelism::None
    } else {
        Parallelism::Rayon(0)
    }
}

/// `dst[m,n] (= or +=) a · b` where `a` is `[m,k]` (or `[k,m]` read
/// transposed) and `b` is `[k,n]` (or `[n,k]` transposed), all row-major.
#[allow(clippy::too_many_arguments)]
pub fn gemm_rm<T: Real>(
    dst: &mut [T],
    a: &[T],
    a_transposed: bool,
    b: &[T],
    b_transposed: bool,
    m: usize,
    n: usize,
    k: usize,
    accumulate: bool,
) {
    assert_eq!(dst.len(), m * n, "gemm: dst is not {m}x{n}");
    assert_eq!(a.len(), m * k, "gemm: a is not {m}x{k}");
    assert_eq!(b.len(), k * n, "gemm: b is not {k}x{n}");
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            dst.fill(T::ZERO);
        }
        return;
    }
    // (row stride, column stride) of each operand as stored.
    let (a_rs, a_cs) = if a_transposed {
        (1, m as isize)
    } else {
        (k as isize, 1)
    };
    let (b_rs, b_cs) = if b_transposed {
        (1, k as isize)
    } else {
        (n as isize, 1)
    };
    // SAFETY: the lengths are checked above, and the strides describe
    // exactly those row-major buffers; dst does not alias a or b (distinct
    // borrows).
    unsafe {
        gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            a.as_ptr(),
            a_cs,
            a_rs,
            b.as_ptr(),
            b_cs,
            b_rs,
            T::ONE,
            T::ONE,
            false,
            false,
            false,
            parallelism(m, n, k),
        )
    }
}

/// `out[rows, oc] = inp[rows, ic] · w[ic, oc] + bias`.
pub fn linear_forward<T: Real>(
    out: &mut [T],
    inp: &[T],
    w: &[T],
    bias: Option<&[T]>,
    rows: usize,
    ic: usize,
    oc: usize,
) {
    gemm_rm(out, inp, false, w, false, rows, oc, ic, false);
    if let Some(b) = bias {
        for row in out.chunks_exact_mut(oc) {
            for (o, &bb) in row.iter_mut().zip(b) {
                *o += bb;
            }
        }
    }
}

/// Accumulates the gradients of [`linear_forward`]: `dinp += dout · wᵀ`,
/// `dw += inpᵀ · dout`, `dbias += Σ_rows dout`.
#[allow(clippy::too_many_arguments)]
pub fn linear_backward<T: Real>(
    dinp: &mut [T],
    dw: &mut [T],
    dbias: Option<&mut [T]>,
    dout: &[T],
    inp: &[T],
    w: &[T],
    rows: usize,
    ic: usize,
    oc: usize,
) {
    linear_backward_input(dinp, dbias, dout, w, rows, ic, oc);
    linear_backward_weight(dw, dout, inp, rows, ic, oc);
}

/// The input's half of [`linear_backward`]: `dinp += dout · wᵀ`,
/// `dbias += Σ_rows dout`.
pub fn linear_backward_input<T: Real>(
    dinp: &mut [T],
    dbias: Option<&mut [T]>,
    dout: &[T],
    w: &[T],
    rows: usize,
    ic: usize,
    oc: usize,
) {
    gemm_rm(dinp, dout, false, w, true, rows, ic, oc, true);
    if let Some(db) = dbias {
        for row in dout.chunks_exact(oc) {
            for (d, &g) in db.iter_mut().zip(row) {
                *d += g;
            }
        }
    }
}

/// The weight's half of [`linear_backward`]: `dw += inpᵀ · dout`.
pub fn linear_backward_weight<T: Real>(
    dw: &mut [T],
    dout: &[T],
    inp: &[T],
    rows: usize,
    ic: usize,
    oc: usize,
) {
    gemm_rm(dw, inp, true, dout, false, ic, oc, rows, true);
}
