//! Causal attention in mixed precision: the bf16 `qkv` (plus its f32 bias)
//! is permuted to per-head `q`, `k`, `v`; scores come from one batched
//! bf16 product (f32 accumulation, bf16 result), the causal softmax writes bf16 probabilities
//! (kept for the backward pass), and a second batched product weighs the
//! values. The backward pass mirrors it. Per-layer tensors live in
//! [`AttnSaved`]; the scratch every layer reuses in [`AttnShared`].

use super::mixed::{MixedKernels, A};
use super::profile::PhaseTimer;
use crate::cpu::attention::AttnShape;
use braid_cuda::blas::{Blas, GemmEx, Mat};
use braid_cuda::{DeviceBuffer, DeviceMem, DevicePool, Result, Stream};
use half::bf16;

/// What one layer keeps for its backward pass.
pub struct AttnSaved {
    q: DeviceBuffer<bf16>,
    k: DeviceBuffer<bf16>,
    v: DeviceBuffer<bf16>,
    att: DeviceBuffer<bf16>,
}

impl AttnSaved {
    /// Buffers for shape `s`.
    pub fn new(pool: &DevicePool, st: &Stream, s: AttnShape) -> Result<AttnSaved> {
        let per_head = s.b * s.t * s.c;
        Ok(AttnSaved {
            q: pool.zeros(per_head, st)?,
            k: pool.zeros(per_head, st)?,
            v: pool.zeros(per_head, st)?,
            att: pool.zeros(s.b * s.nh * s.t * s.t, st)?,
        })
    }
}

/// Scratch shared by all layers.
pub struct AttnShared {
    /// Scores, later their gradient (bf16).
    scores: DeviceBuffer<bf16>,
    dpre: DeviceBuffer<bf16>,
    y: DeviceBuffer<bf16>,
    dq: DeviceBuffer<bf16>,
    dk: DeviceBuffer<bf16>,
    dv: DeviceBuffer<bf16>,
}

impl AttnShared {
    /// Buffers for shape `s`.
    pub fn new(pool: &DevicePool, st: &Stream, s: AttnShape) -> Result<AttnShared> {
        let per_head = s.b * s.t * s.c;
        let tt = s.b * s.nh * s.t * s.t;
        Ok(AttnShared {
            scores: pool.zeros(tt, st)?,
            dpre: pool.zeros(tt, st)?,
            y: pool.zeros(per_head, st)?,
            dq: pool.zeros(per_head, st)?,
            dk: pool.zeros(per_head, st)?,
            dv: pool.zeros(per_head, st)?,
        })
    }
}

/// `batch` row-major products `c_i[m,n] = a_i · b_i`.
#[allow(clippy::too_many_arguments)]
fn bmm(
    blas: &mut Blas,
    st: &Stream,
    a: Mat,
    b: Mat,
    c: Mat,
    m: usize,
    n: usize,
    k: usize,
    batch: usize,
) -> Result<()> {
    blas.gemm_ex(
        st,
        &GemmEx {
            m,
            n,
            k,
            a,
            b,
            c,
            alpha: 1.0,
            beta: 0.0,
            batch,
            tf32: false,
        },
    )
}

fn dims(s: AttnShape) -> Vec<A> {
    vec![
        A::I(s.b as i32),
        A::I(s.t as i32),
        A::I(s.nh as i32),
        A::I((s.c / s.nh) as i32),
    ]
}

/// Whether the vectorised kernels (8 bf16 values per access) take shape
/// `s`: head size and sequence length multiples of 8.
pub fn check_shape(s: AttnShape) -> Result<()> {
    if s.nh == 0 || s.c % s.nh != 0 || (s.c / s.nh) % 8 != 0 || s.t % 8 != 0 {
        return Err(braid_cuda::CudaError::Invalid(format!(
            "bf16 attention needs a head size and a sequence length that are multiples of 8 \
             (width {} / {} heads, sequence {}); use --precision f32 or another --seq",
            s.c, s.nh, s.t
        )));
    }
    Ok(())
}

/// `out[B,T,C]` (bf16) from `qkv[B,T,3C]` (bf16) plus `bias[3C]`.
#[allow(clippy::too_many_arguments)]
pub fn forward(
    k: &MixedKernels,
    blas: &mut Blas,
    st: &Stream,
    out: &mut impl DeviceMem<bf16>,
    qkv: &impl DeviceMem<bf16>,
    bias: &impl DeviceMem<f32>,
    saved: &mut AttnSaved,
    sh: &mut AttnShared,
    s: AttnShape,
    prof: &mut PhaseTimer,
) -> Result<()> {
    let (t, hs) = (s.t, s.c / s.nh);
    let total = s.b * s.t * s.c;
    let batch = s.b * s.nh;
    check_shape(s)?;
    if qkv.dlen() < 3 * total || out.dlen() < total || bias.dlen() < 3 * s.c {
        return Err(braid_cuda::CudaError::Invalid(
            "attention: qkv/out/bias do not fit the shape".into(),
        ));
    }
    let mut args = vec![
        A::P(saved.q.dptr()),
        A::P(saved.k.dptr()),
        A::P(saved.v.dptr()),
        A::P(qkv.dptr()),
        A::P(bias.dptr()),
    ];
    args.extend(dims(s));
    k.elementwise(&k.permute_qkv, st, total / 8, args)?;
    prof.mark(st, "fwd attn permute")?;
    bmm(
        blas,
        st,
        Mat::of(&saved.q, hs).batched(t * hs),
        Mat::of(&saved.k, hs).t().batched(t * hs),
        Mat::of(&sh.scores, t).batched(t * t),
        t,
        t,
        hs,
        batch,
    )?;
    prof.mark(st, "fwd attn gemm")?;
    let rows = batch * t;
    let scale = 1.0f32 / (hs as f32).sqrt();
    let args = vec![
        A::P(saved.att.dptr()),
        A::P(sh.scores.dptr()),
        A::I(rows as i32),
        A::I(t as i32),
        A::F(scale),
    ];
    k.rows(&k.softmax_forward, st, rows, args)?;
    prof.mark(st, "fwd attn softmax")?;
    bmm(
        blas,
        st,
        Mat::of(&saved.att, t).batched(t * t),
        Mat::of(&saved.v, hs).batched(t * hs),
        Mat::of(&sh.y, hs).batched(t * hs),
        t,
        hs,
        t,
        batch,
    )?;
    prof.mark(st, "fwd attn gemm")?;
    let mut args = vec![A::P(out.dptr()), A::P(sh.y.dptr())];
    args.extend(dims(s));
    k.elementwise(&k.unpermute, st, total / 8, args)
}

/// `dqkv[B,T,3C]` (bf16, overwritten) from `dout[B,T,C]` (bf16).
#[allow(clippy::too_many_arguments)]
pub fn backward(
    k: &MixedKernels,
    blas: &mut Blas,
    st: &Stream,
    dqkv: &mut impl DeviceMem<bf16>,
    dout: &impl DeviceMem<bf16>,
    saved: &AttnSaved,
    sh: &mut AttnShared,
    s: AttnShape,
    prof: &mut PhaseTimer,
) -> Result<()> {
    let (t, hs) = (s.t, s.c / s.nh);
    let total = s.b * s.t * s.c;
    let batch = s.b * s.nh;
    check_shape(s)?;
    if dqkv.dlen() < 3 * total || dout.dlen() < total {
        return Err(braid_cuda::CudaError::Invalid(
            "attention backward: dqkv/dout do not fit the shape".into(),
        ));
    }
    // dy [B,NH,T,HS] goes into `y` (free in the backward pass).
    let mut args = vec![A::P(sh.y.dptr()), A::P(dout.dptr())];
    args.extend(dims(s));
    k.elementwise(&k.permute_grad, st, total / 8, args)?;
    prof.mark(st, "bwd attn permute")?;
    // datt = dy · vᵀ (into the scores scratch)
    bmm(
        blas,
        st,
        Mat::of(&sh.y, hs).batched(t * hs),
        Mat::of(&saved.v, hs).t().batched(t * hs),
        Mat::of(&sh.scores, t).batched(t * t),
        t,
        t,
        hs,
        batch,
    )?;
    prof.mark(st, "bwd attn gemm")?;
    let rows = batch * t;
    let scale = 1.0f32 / (hs as f32).sqrt();
    let args = vec![
        A::P(sh.dpre.dptr()),
        A::P(sh.scores.dptr()),
        A::P(saved.att.dptr()),
        A::I(rows as i32),
        A::I(t as i32),
        A::F(scale),
    ];
    k.rows(&k.softmax_backward, st, rows, args)?;
    prof.mark(st, "bwd attn softmax")?;
    // dq = dpre · k ; dk = dpreᵀ · q ; dv = attᵀ · dy
    bmm(
        blas,
        st,
        Mat::of(&sh.dpre, t).batched(t * t),
        Mat::of(&saved.k, hs).batched(t * hs),
        Mat::of(&sh.dq, hs).batched(t * hs),
        t,
        hs,
        t,
        batch,
    )?;
    prof.mark(st, "bwd attn gemm")?;
    bmm(
        blas,
        st,
        Mat::of(&sh.dpre, t).t().batched(t * t),
        Mat::of(&saved.q, hs).batched(t * hs),
        Mat::of(&sh.dk, hs).batched(t * hs),
        t,
        hs,
        t,
        batch,
    )?;
    prof.mark(st, "bwd attn gemm")?;
    bmm(
        blas,
        st,
        Mat::of(&saved.att, t).t().batched(t * t),
        Mat::of(&sh.y, hs).batched(t * hs),
        Mat::of(&sh.dv, hs).batched(t * hs),
        t,
        hs,
        t,
        batch,
    )?;
    prof.mark(st, "bwd attn gemm")?;
    let mut args = vec![
        A::P(dqkv.dptr()),
        A::P(sh.dq.dptr()),
        A::P(sh.dk.dptr()),
        A::P(sh.dv.dptr()),
    ];
    args.extend(dims(s));
    k.elementwise(&k.unpermute_qkv_grad, st, total / 8, args)
}
