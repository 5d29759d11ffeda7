//! Causal multi-head self-attention on the fused `qkv` projection
//! (`[B, T, 3C]`: queries, keys, values), parallel over (batch, head).
//! The softmax probabilities are kept (`att`, `[B, NH, T, T]`) for the
//! backward pass; the scores before the softmax are not.

use super::real::Real;
use rayon::prelude::*;

/// Shapes of one attention call.
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    /// Batch.
    pub b: usize,
    /// Sequence length.
    pub t: usize,
    /// Width.
    pub c: usize,
    /// Heads.
    pub nh: usize,
}

/// `out[B,T,C]` = softmax(q·kᵀ/√hs, causal) · v per head.
pub fn attention_forward<T: Real>(out: &mut [T], att: &mut [T], qkv: &[T], s: AttnShape) {
    let AttnShape { b: _, t, c, nh } = s;
    let hs = c / nh;
    let scale = T::of(1.0 / (hs as f64).sqrt());
    // Work items: (batch, head) pairs; each owns its att block and writes
    // its own head's columns of `out`.
    let out_ptr = SyncPtr(out.as_mut_ptr());
    att.par_chunks_mut(t * t).enumerate().for_each(|(bh, a)| {
        let (bi, h) = (bh / nh, bh % nh);
        let out = out_ptr;
        for ti in 0..t {
            let q = &qkv[(bi * t + ti) * 3 * c + h * hs..][..hs];
            let row = &mut a[ti * t..(ti + 1) * t];
            let mut maxv = T::of(f64::NEG_INFINITY);
            for tj in 0..=ti {
                let k = &qkv[(bi * t + tj) * 3 * c + c + h * hs..][..hs];
                let mut dot = T::ZERO;
                for i in 0..hs {
                    dot += q[i] * k[i];
                }
                let v = dot * scale;
                row[tj] = v;
                maxv = maxv.max(v);
            }
            let mut sum = T::ZERO;
            for v in row[..=ti].iter_mut() {
                *v = (*v - maxv).exp();
                sum += *v;
            }
            let inv = T::ONE / sum;
            for v in row[..=ti].iter_mut() {
                *v *= inv;
            }
            for v in row[ti + 1..].iter_mut() {
                *v = T::ZERO;
            }
            // SAFETY: each (batch, head) work item writes only row
            // (bi, ti)'s columns h*hs..(h+1)*hs, disjoint across items.
            let o = unsafe {
                std::slice::from_raw_parts_mut(out.0.add((bi * t + ti) * c + h * hs), hs)
            };
            o.fill(T::ZERO);
            for tj in 0..=ti {
                let v = &qkv[(bi * t + tj) * 3 * c + 2 * c + h * hs..][..hs];
                let p = row[tj];
                for i in 0..hs {
                    o[i] += p * v[i];
                }
            }
        }
    });
}

/// Accumulates the gradient of [`attention_forward`] into `dqkv`.
pub fn attention_backward<T: Real>(dqkv: &mut [T], dout: &[T], qkv: &[T], att: &[T], s: AttnShape) {
    let AttnShape { b, t, c, nh } = s;
    let hs = c / nh;
    let scale = T::of(1.0 / (hs as f64).sqrt());
    let dptr = SyncPtr(dqkv.as_mut_ptr());
    (0..b * nh).into_par_iter().for_each(|bh| {
        let (bi, h) = (bh / nh, bh % nh);
        let d = dptr;
        let a = &att[bh * t * t..(bh + 1) * t * t];
        let mut datt = vec![T::ZERO; t];
        // SAFETY: item (bi, h) touches only head h's q/k/v columns of batch
        // bi's rows in dqkv — disjoint across items.
        let slot = |row: usize, part: usize| unsafe {
            std::slice::from_raw_parts_mut(d.0.add((bi * t + row) * 3 * c + part * c + h * hs), hs)
        };
        for ti in 0..t {
            let dy = &dout[(bi * t + ti) * c + h * hs..][..hs];
            let row = &a[ti * t..(ti + 1) * t];
            // d(att) = dy · v; dv += att · dy.
            for tj in 0..=ti {
                let v = &qkv[(bi * t + tj) * 3 * c + 2 * c + h * hs..][..hs];
                let mut s = T::ZERO;
                for i in 0..hs {
                    s += dy[i] * v[i];
                }
                datt[tj] = s;
                let dv = slot(tj, 2);
                for i in 0..hs {
                    dv[i] += row[tj] * dy[i];
                }
            }
            // Softmax backward: dscore_j = p_j (datt_j − Σ p·datt).
            let mut dot = T::ZERO;
            for tj in 0..=ti {
                dot += row[tj] * datt[tj];
            }
            let q = &qkv[(bi * t + ti) * 3 * c + h * hs..][..hs];
            for tj in 0..=ti {
                let ds = row[tj] * (datt[tj] - dot) * scale;
                let k = &qkv[(bi * t + tj) * 3 * c + c + h * hs..][..hs];
                let dq = slot(ti, 0);
                for i in 0..hs {
                    dq[i] += ds * k[i];
                }
                let dk = slot(tj, 1);
                for i in 0..hs {
                    dk[i] += ds * q[i];
                }
            }
        }
    });
}

/// A raw pointer shared by parallel work items that write disjoint parts.
#[derive(Clone, Copy)]
struct SyncPtr<T>(*mut T);
// SAFETY: only used for disjoint writes, as argued at each use.
unsafe impl<T> Send for SyncPtr<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for SyncPtr<T> {}
