//! Causal multi-head attention on the GPU: the fused `qkv` is permuted to
//! per-head `q`, `k`, `v`, scores come from one batched cuBLAS product,
//! a warp-per-row kernel applies the causal softmax, and a second batched
//! product weighs the values. The backward pass mirrors it. Same inputs and
//! outputs as the CPU kernel (`cpu::attention`).

use super::kernels::{karg, Kernels};
use crate::cpu::attention::AttnShape;
use braid_cuda::blas::{Blas, Operand};
use braid_cuda::{Device, DeviceBuffer, DeviceMem, Result, Stream};

/// Per-shape buffers of the attention forward and backward passes.
pub struct AttnScratch {
    q: DeviceBuffer<f32>,
    k: DeviceBuffer<f32>,
    v: DeviceBuffer<f32>,
    /// Softmax probabilities `[B, NH, T, T]` (kept for the backward pass).
    pub att: DeviceBuffer<f32>,
    scores: DeviceBuffer<f32>,
    y: DeviceBuffer<f32>,
    dq: DeviceBuffer<f32>,
    dk: DeviceBuffer<f32>,
    dv: DeviceBuffer<f32>,
}

impl AttnScratch {
    /// Buffers for shape `s` on `device`.
    pub fn new(device: &Device, s: AttnShape) -> Result<AttnScratch> {
        let per_head = s.b * s.t * s.c;
        let tt = s.b * s.nh * s.t * s.t;
        let z = |n: usize| DeviceBuffer::zeros(device, n);
        Ok(AttnScratch {
            q: z(per_head)?,
            k: z(per_head)?,
            v: z(per_head)?,
            att: z(tt)?,
            scores: z(tt)?,
            y: z(per_head)?,
            dq: z(per_head)?,
            dk: z(per_head)?,
            dv: z(per_head)?,
        })
    }
}

fn op(buf: &impl DeviceMem<f32>, transposed: bool, stride: usize) -> Operand<'_> {
    Operand {
        buf,
        offset: 0,
        transposed,
        stride,
    }
}

/// `out[B,T,C]` from `qkv[B,T,3C]`.
pub fn attention_forward(
    k: &Kernels,
    blas: &mut Blas,
    st: &Stream,
    out: &mut impl DeviceMem<f32>,
    qkv: &impl DeviceMem<f32>,
    x: &mut AttnScratch,
    s: AttnShape,
) -> Result<()> {
    let hs = s.c / s.nh;
    let (b32, t32, nh32, hs32) = (s.b as i32, s.t as i32, s.nh as i32, hs as i32);
    let total = s.b * s.t * s.c;
    let batch = s.b * s.nh;
    let (qp, kp, vp, src) = (x.q.dptr(), x.k.dptr(), x.v.dptr(), qkv.dptr());
    // SAFETY: buffers sized by AttnScratch::new for this shape.
    unsafe {
        k.launch_1d(
            &k.permute_qkv,
            st,
            total,
            &mut [
                karg(&qp),
                karg(&kp),
                karg(&vp),
                karg(&src),
                karg(&b32),
                karg(&t32),
                karg(&nh32),
                karg(&hs32),
            ],
        )?
    };
    // scores_i[T,T] = q_i[T,HS] · k_iᵀ
    blas.gemm_rm_batched(
        st,
        &mut x.scores,
        s.t * s.t,
        op(&x.q, false, s.t * hs),
        op(&x.k, true, s.t * hs),
        s.t,
        s.t,
        hs,
        batch,
        false,
    )?;
    let rows = batch * s.t;
    let scale = 1.0f32 / (hs as f32).sqrt();
    let (ap, sp, rows32) = (x.att.dptr(), x.scores.dptr(), rows as i32);
    // SAFETY: att and scores hold rows*T elements.
    unsafe {
        k.launch_rows(
            &k.softmax_causal_forward,
            st,
            rows,
            &mut [
                karg(&ap),
                karg(&sp),
                karg(&rows32),
                karg(&t32),
                karg(&scale),
            ],
        )?
    };
    // y_i[T,HS] = att_i[T,T] · v_i[T,HS]
    blas.gemm_rm_batched(
        st,
        &mut x.y,
        s.t * hs,
        op(&x.att, false, s.t * s.t),
        op(&x.v, false, s.t * hs),
        s.t,
        hs,
        s.t,
        batch,
        false,
    )?;
    let (o, yp) = (out.dptr(), x.y.dptr());
    // SAFETY: out holds B*T*C elements.
    unsafe {
        k.launch_1d(
            &k.unpermute,
            st,
            total,
            &mut [
                karg(&o),
                karg(&yp),
                karg(&b32),
                karg(&t32),
                karg(&nh32),
                karg(&hs32),
            ],
        )
    }
}

/// Accumulates the gradient of [`attention_forward`] into `dqkv`, given
/// `dout`; uses the probabilities and per-head q, k, v of the forward pass
/// still in `x`.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    k: &Kernels,
    blas: &mut Blas,
    st: &Stream,
    dqkv: &mut impl DeviceMem<f32>,
    dout: &impl DeviceMem<f32>,
    x: &mut AttnScratch,
    s: AttnShape,
) -> Result<()> {
    let hs = s.c / s.nh;
    let (b32, t32, nh32, hs32) = (s.b as i32, s.t as i32, s.nh as i32, hs as i32);
    let total = s.b * s.t * s.c;
    let batch = s.b * s.nh;
    // dy (per head) reuses `y`; d(att) reuses `scores`.
    let (dyp, dop) = (x.y.dptr(), dout.dptr());
    // SAFETY: sized for this shape.
    unsafe {
        k.launch_1d(
            &k.permute_grad,
            st,
            total,
            &mut [
                karg(&dyp),
                karg(&dop),
                karg(&b32),
                karg(&t32),
                karg(&nh32),
                karg(&hs32),
            ],
        )?
    };
    // datt_i = dy_i · v_iᵀ ; dv_i = att_iᵀ · dy_i
    blas.gemm_rm_batched(
        st,
        &mut x.scores,
        s.t * s.t,
        op(&x.y, false, s.t * hs),
        op(&x.v, true, s.t * hs),
        s.t,
        s.t,
        hs,
        batch,
        false,
    )?;
    blas.gemm_rm_batched(
        st,
        &mut x.dv,
        s.t * hs,
        op(&x.att, true, s.t * s.t),
        op(&x.y, false, s.t * hs),
        s.t,
        hs,
        s.t,
        batch,
        false,
    )?;
    // dscores (in place over datt) = softmax backward, scaled.
    let rows = batch * s.t;
    let scale = 1.0f32 / (hs as f32).sqrt();
    let (dsp, ap, rows32) = (x.scores.dptr(), x.att.dptr(), rows as i32);
    // SAFETY: each row's kernel reads its own datt row before writing it
    // (one warp per row: all reads of the row happen in the reduction
    // before any write).
    unsafe {
        k.launch_rows(
            &k.softmax_causal_backward,
            st,
            rows,
            &mut [
                karg(&dsp),
                karg(&dsp),
                karg(&ap),
                karg(&rows32),
                karg(&t32),
                karg(&scale),
            ],
        )?
    };
    // dq_i = dscores_i · k_i ; dk_i = dscores_iᵀ · q_i
    blas.gemm_rm_batched(
        st,
        &mut x.dq,
        s.t * hs,
        op(&x.scores, false, s.t * s.t),
        op(&x.k, false, s.t * hs),
        s.t,
        hs,
        s.t,
        batch,
        false,
    )?;
    blas.gemm_rm_batched(
        st,
        &mut x.dk,
        s.t * hs,
        op(&x.scores, true, s.t * s.t),
        op(&x.q, false, s.t * hs),
        s.t,
        hs,
        s.t,
        batch,
        false,
    )?;
    let (dp, qg, kg, vg) = (dqkv.dptr(), x.dq.dptr(), x.dk.dptr(), x.dv.dptr());
    // SAFETY: dqkv holds B*T*3C elements.
    unsafe {
        k.launch_1d(
            &k.unpermute_qkv_grad,
            st,
            total,
            &mut [
                karg(&dp),
                karg(&qg),
                karg(&kg),
                karg(&vg),
                karg(&b32),
                karg(&t32),
                karg(&nh32),
                karg(&hs32),
            ],
        )
    }
}
