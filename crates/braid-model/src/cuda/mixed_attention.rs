//! Causal attention in mixed precision, two ways:
//! - fused (the default where the GPU has bf16 tensor cores and the head
//!   size has kernels, see [`super::flash`]): `qkv` with its bias is kept
//!   (the model's fused-bias product writes it there, else one pass adds
//!   the bias), and flash-style kernels read it directly, keeping only
//!   the row log-sum-exp for the backward pass;
//! - batched: `qkv` (plus its f32 bias) is permuted to per-head `q`, `k`,
//!   `v`; scores come from one batched bf16 product (f32 accumulation,
//!   bf16 result), the causal softmax writes bf16 probabilities (kept for
//!   the backward pass), and a second batched product weighs the values.
//!   The backward pass mirrors it.
//!
//! `BRAID_ATTENTION=fused|batched` forces one. Per-layer tensors live in
//! [`AttnSaved`]; the scratch every layer reuses in [`AttnShared`].

use super::flash::{FlashKernels, ScoreGrads};
use super::mixed::{MixedKernels, A};
use super::profile::PhaseTimer;
use crate::cpu::attention::AttnShape;
use braid_cuda::blas::{Blas, GemmEx, Mat};
use braid_cuda::memory::copy_async;
use braid_cuda::{CudaError, DeviceBuffer, DeviceMem, DevicePool, Result, Stream};
use half::bf16;

/// Which implementation a model's attention uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttnPath {
    /// Flash-style fused kernels.
    Fused,
    /// Batched cuBLAS products around a causal softmax.
    Batched,
}

impl AttnPath {
    /// The fused kernels where they take shape `s`, else the batched
    /// products; `BRAID_ATTENTION` (`fused` or `batched`) overrides.
    pub fn choose(k: &MixedKernels, s: AttnShape) -> Result<AttnPath> {
        let fused = || -> Result<AttnPath> {
            let f = k.flash.as_ref().ok_or_else(|| {
                CudaError::Invalid(
                    "BRAID_ATTENTION=fused: this GPU has no bf16 tensor cores \
                     (compute capability below 8.0)"
                        .into(),
                )
            })?;
            f.check(s)?;
            Ok(AttnPath::Fused)
        };
        let path = match std::env::var(braid_core::env::BRAID_ATTENTION).as_deref() {
            Ok("fused") => fused()?,
            Ok("batched") => AttnPath::Batched,
            Ok("") | Err(_) => fused().unwrap_or(AttnPath::Batched),
            Ok(other) => {
                return Err(CudaError::Invalid(format!(
                    "BRAID_ATTENTION={other}: expected `fused` or `batched`"
                )))
            }
        };
        check_shape(s, path)?;
        Ok(path)
    }
}

/// What one layer keeps for its backward pass.
pub enum AttnSaved {
    /// `qkv` with its bias, and the rows' log-sum-exp.
    Fused {
        qkv: DeviceBuffer<bf16>,
        lse: DeviceBuffer<f32>,
    },
    /// Per-head `q`, `k`, `v` and the probabilities.
    Batched {
        q: DeviceBuffer<bf16>,
        k: DeviceBuffer<bf16>,
        v: DeviceBuffer<bf16>,
        att: DeviceBuffer<bf16>,
    },
}

impl AttnSaved {
    /// Buffers for shape `s` on `path`.
    pub fn new(pool: &DevicePool, st: &Stream, s: AttnShape, path: AttnPath) -> Result<AttnSaved> {
        let per_head = s.b * s.t * s.c;
        Ok(match path {
            AttnPath::Fused => AttnSaved::Fused {
                qkv: pool.zeros(3 * per_head, st)?,
                lse: pool.zeros(s.b * s.nh * s.t, st)?,
            },
            AttnPath::Batched => AttnSaved::Batched {
                q: pool.zeros(per_head, st)?,
                k: pool.zeros(per_head, st)?,
                v: pool.zeros(per_head, st)?,
                att: pool.zeros(s.b * s.nh * s.t * s.t, st)?,
            },
        })
    }
}

/// Scratch shared by all layers.
pub enum AttnShared {
    /// Row sums of `dout · out` for the fused backward pass, and, where
    /// kept, the score gradients its dK/dV kernel stores for its dQ
    /// kernel ([`FlashKernels::score_grads_len`]).
    Fused {
        dsum: DeviceBuffer<f32>,
        score_grads: Option<DeviceBuffer<bf16>>,
    },
    /// Scores (later their gradient), probabilities' gradient, per-head
    /// output and gradients.
    Batched {
        scores: DeviceBuffer<bf16>,
        dpre: DeviceBuffer<bf16>,
        y: DeviceBuffer<bf16>,
        dq: DeviceBuffer<bf16>,
        dk: DeviceBuffer<bf16>,
        dv: DeviceBuffer<bf16>,
    },
}

impl AttnShared {
    /// Buffers for shape `s` on `path`; the fused path keeps the score
    /// gradients when `stored_score_grads`.
    pub fn new(
        pool: &DevicePool,
        st: &Stream,
        s: AttnShape,
        path: AttnPath,
        stored_score_grads: bool,
    ) -> Result<AttnShared> {
        let per_head = s.b * s.t * s.c;
        let tt = s.b * s.nh * s.t * s.t;
        Ok(match path {
            AttnPath::Fused => AttnShared::Fused {
                dsum: pool.zeros(s.b * s.nh * s.t, st)?,
                score_grads: match stored_score_grads {
                    true => {
                        let len =
                            usize::try_from(FlashKernels::score_grads_len(s)).map_err(|_| {
                                CudaError::Invalid(
                                    "attention score gradients: too many elements".into(),
                                )
                            })?;
                        Some(pool.zeros(len, st)?)
                    }
                    false => None,
                },
            },
            AttnPath::Batched => AttnShared::Batched {
                scores: pool.zeros(tt, st)?,
                dpre: pool.zeros(tt, st)?,
                y: pool.zeros(per_head, st)?,
                dq: pool.zeros(per_head, st)?,
                dk: pool.zeros(per_head, st)?,
                dv: pool.zeros(per_head, st)?,
            },
        })
    }
}

fn mismatch() -> CudaError {
    CudaError::Invalid("attention: saved and shared buffers are for different paths".into())
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

/// Whether `path` takes shape `s`: the batched path's vectorised kernels
/// (8 bf16 values per access) need head size and sequence length
/// multiples of 8; the fused one a head size with kernels.
pub fn check_shape(s: AttnShape, path: AttnPath) -> Result<()> {
    if path == AttnPath::Fused {
        return if s.nh > 0 && s.c % s.nh == 0 {
            Ok(())
        } else {
            Err(CudaError::Invalid(format!(
                "attention: width {} is not a multiple of the {} heads",
                s.c, s.nh
            )))
        };
    }
    if s.nh == 0 || s.c % s.nh != 0 || (s.c / s.nh) % 8 != 0 || s.t % 8 != 0 {
        return Err(CudaError::Invalid(format!(
            "bf16 attention needs a head size and a sequence length that are multiples of 8 \
             (width {} / {} heads, sequence {}); use --precision f32 or another --seq",
            s.c, s.nh, s.t
        )));
    }
    // The permutes number their groups of 8 elements in 32 bits (the
    // fused path has no such limit).
    let groups = s.b * s.t * s.c / 8;
    if groups > i32::MAX as usize {
        return Err(CudaError::Invalid(format!(
            "batched attention: {} tokens of width {} exceed its 32-bit indexing \
             (2^34 elements); use a smaller batch",
            s.b * s.t,
            s.c
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
    match (saved, sh) {
        (AttnSaved::Fused { qkv: biased, lse }, AttnShared::Fused { .. }) => {
            let f = k.flash.as_ref().ok_or_else(mismatch)?;
            f.add_bias(st, biased, qkv, bias, s.b * s.t, 3 * s.c)?;
            prof.mark(st, "fwd attn bias")?;
            f.forward(st, out, lse, biased, s)
        }
        (AttnSaved::Batched { q, k: kk, v, att }, AttnShared::Batched { scores, y, .. }) => {
            batched_forward(
                k,
                blas,
                st,
                out,
                qkv,
                bias,
                [q, kk, v],
                att,
                scores,
                y,
                s,
                prof,
            )
        }
        _ => Err(mismatch()),
    }
}

/// The fused path's forward pass when the saved `qkv` already holds the
/// projection with its bias (written there by a fused-bias product).
pub fn forward_prebiased(
    k: &MixedKernels,
    st: &Stream,
    out: &mut impl DeviceMem<bf16>,
    saved: &mut AttnSaved,
    s: AttnShape,
) -> Result<()> {
    match (saved, k.flash.as_ref()) {
        (AttnSaved::Fused { qkv, lse }, Some(f)) => f.forward(st, out, lse, qkv, s),
        _ => Err(mismatch()),
    }
}

/// Under checkpointing, after the forward pass of a fused layer: its
/// log-sum-exp (in the shared `saved`) into the layer's `kept`.
pub fn keep_lse(st: &Stream, saved: &AttnSaved, kept: &mut DeviceBuffer<f32>) -> Result<()> {
    match saved {
        AttnSaved::Fused { lse, .. } => copy_async(kept, lse, st),
        AttnSaved::Batched { .. } => Err(mismatch()),
    }
}

/// Under checkpointing, at the start of a fused layer's backward pass:
/// `saved` as its forward pass left it, without running the attention
/// again. The recomputed projection gets its bias into `saved` from
/// `unbiased` (projection, bias), unless a fused-bias product already
/// wrote it there (`None`), and the log-sum-exp comes back from `kept`.
pub fn restore(
    k: &MixedKernels,
    st: &Stream,
    saved: &mut AttnSaved,
    unbiased: Option<(&impl DeviceMem<bf16>, &impl DeviceMem<f32>)>,
    kept: &DeviceBuffer<f32>,
    s: AttnShape,
) -> Result<()> {
    match (saved, k.flash.as_ref()) {
        (AttnSaved::Fused { qkv, lse }, Some(f)) => {
            if let Some((raw, bias)) = unbiased {
                f.add_bias(st, qkv, raw, bias, s.b * s.t, 3 * s.c)?;
            }
            copy_async(lse, kept, st)
        }
        _ => Err(mismatch()),
    }
}

/// The batched path's forward pass.
#[allow(clippy::too_many_arguments)]
fn batched_forward(
    k: &MixedKernels,
    blas: &mut Blas,
    st: &Stream,
    out: &mut impl DeviceMem<bf16>,
    qkv: &impl DeviceMem<bf16>,
    bias: &impl DeviceMem<f32>,
    [q, kk, v]: [&mut DeviceBuffer<bf16>; 3],
    att: &mut DeviceBuffer<bf16>,
    scores: &mut DeviceBuffer<bf16>,
    y: &mut DeviceBuffer<bf16>,
    s: AttnShape,
    prof: &mut PhaseTimer,
) -> Result<()> {
    let (t, hs) = (s.t, s.c / s.nh);
    let total = s.b * s.t * s.c;
    let batch = s.b * s.nh;
    check_shape(s, AttnPath::Batched)?;
    if qkv.dlen() < 3 * total || out.dlen() < total || bias.dlen() < 3 * s.c {
        return Err(CudaError::Invalid(
            "attention: qkv/out/bias do not fit the shape".into(),
        ));
    }
    let mut args = vec![
        A::P(q.dptr()),
        A::P(kk.dptr()),
        A::P(v.dptr()),
        A::P(qkv.dptr()),
        A::P(bias.dptr()),
    ];
    args.extend(dims(s));
    k.elementwise(&k.permute_qkv, st, total / 8, args)?;
    prof.mark(st, "fwd attn permute")?;
    bmm(
        blas,
        st,
        Mat::of(&*q, hs).batched(t * hs),
        Mat::of(&*kk, hs).t().batched(t * hs),
        Mat::of(&*scores, t).batched(t * t),
        t,
        t,
        hs,
        batch,
    )?;
    prof.mark(st, "fwd attn gemm")?;
    let rows = batch * t;
    let scale = 1.0f32 / (hs as f32).sqrt();
    let args = vec![
        A::P(att.dptr()),
        A::P(scores.dptr()),
        A::I(rows as i32),
        A::I(t as i32),
        A::F(scale),
    ];
    k.rows(&k.softmax_forward, st, rows, args)?;
    prof.mark(st, "fwd attn softmax")?;
    bmm(
        blas,
        st,
        Mat::of(&*att, t).batched(t * t),
        Mat::of(&*v, hs).batched(t * hs),
        Mat::of(&*y, hs).batched(t * hs),
        t,
        hs,
        t,
        batch,
    )?;
    prof.mark(st, "fwd attn gemm")?;
    let mut args = vec![A::P(out.dptr()), A::P(y.dptr())];
    args.extend(dims(s));
    k.elementwise(&k.unpermute, st, total / 8, args)
}

/// `dqkv[B,T,3C]` (bf16, overwritten) from `dout[B,T,C]` (bf16); `out`
/// is the forward pass's output. The fused path stores its score
/// gradients in the shared buffers' scratch where they keep one, else in
/// `idle` (memory idle during this pass) where given, else recomputes
/// them.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    k: &MixedKernels,
    blas: &mut Blas,
    st: &Stream,
    dqkv: &mut impl DeviceMem<bf16>,
    dout: &impl DeviceMem<bf16>,
    out: &impl DeviceMem<bf16>,
    saved: &AttnSaved,
    sh: &mut AttnShared,
    idle: Option<ScoreGrads<'_>>,
    s: AttnShape,
    prof: &mut PhaseTimer,
) -> Result<()> {
    match (saved, sh) {
        (AttnSaved::Fused { qkv, lse }, AttnShared::Fused { dsum, score_grads }) => {
            let f = k.flash.as_ref().ok_or_else(mismatch)?;
            let stored = score_grads.as_mut().map(ScoreGrads::one).or(idle);
            f.backward(st, dqkv, dsum, stored, dout, qkv, out, lse, s)
        }
        (
            AttnSaved::Batched { q, k: kk, v, att },
            AttnShared::Batched {
                scores,
                dpre,
                y,
                dq,
                dk,
                dv,
            },
        ) => batched_backward(
            k,
            blas,
            st,
            dqkv,
            dout,
            [q, kk, v, att],
            [scores, dpre, y, dq, dk, dv],
            s,
            prof,
        ),
        _ => Err(mismatch()),
    }
}

/// The batched path's backward pass.
#[allow(clippy::too_many_arguments)]
fn batched_backward(
    k: &MixedKernels,
    blas: &mut Blas,
    st: &Stream,
    dqkv: &mut impl DeviceMem<bf16>,
    dout: &impl DeviceMem<bf16>,
    [q, kk, v, att]: [&DeviceBuffer<bf16>; 4],
    [scores, dpre, y, dq, dk, dv]: [&mut DeviceBuffer<bf16>; 6],
    s: AttnShape,
    prof: &mut PhaseTimer,
) -> Result<()> {
    let (t, hs) = (s.t, s.c / s.nh);
    let total = s.b * s.t * s.c;
    let batch = s.b * s.nh;
    check_shape(s, AttnPath::Batched)?;
    if dqkv.dlen() < 3 * total || dout.dlen() < total {
        return Err(CudaError::Invalid(
            "attention backward: dqkv/dout do not fit the shape".into(),
        ));
    }
    // dy [B,NH,T,HS] goes into `y` (free in the backward pass).
    let mut args = vec![A::P(y.dptr()), A::P(dout.dptr())];
    args.extend(dims(s));
    k.elementwise(&k.permute_grad, st, total / 8, args)?;
    prof.mark(st, "bwd attn permute")?;
    // datt = dy · vᵀ (into the scores scratch)
    bmm(
        blas,
        st,
        Mat::of(&*y, hs).batched(t * hs),
        Mat::of(v, hs).t().batched(t * hs),
        Mat::of(&*scores, t).batched(t * t),
        t,
        t,
        hs,
        batch,
    )?;
    prof.mark(st, "bwd attn gemm")?;
    let rows = batch * t;
    let scale = 1.0f32 / (hs as f32).sqrt();
    let args = vec![
        A::P(dpre.dptr()),
        A::P(scores.dptr()),
        A::P(att.dptr()),
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
        Mat::of(&*dpre, t).batched(t * t),
        Mat::of(kk, hs).batched(t * hs),
        Mat::of(&*dq, hs).batched(t * hs),
        t,
        hs,
        t,
        batch,
    )?;
    prof.mark(st, "bwd attn gemm")?;
    bmm(
        blas,
        st,
        Mat::of(&*dpre, t).t().batched(t * t),
        Mat::of(q, hs).batched(t * hs),
        Mat::of(&*dk, hs).batched(t * hs),
        t,
        hs,
        t,
        batch,
    )?;
    prof.mark(st, "bwd attn gemm")?;
    bmm(
        blas,
        st,
        Mat::of(att, t).t().batched(t * t),
        Mat::of(&*y, hs).batched(t * hs),
        Mat::of(&*dv, hs).batched(t * hs),
        t,
        hs,
        t,
        batch,
    )?;
    prof.mark(st, "bwd attn gemm")?;
    let mut args = vec![
        A::P(dqkv.dptr()),
        A::P(dq.dptr()),
        A::P(dk.dptr()),
        A::P(dv.dptr()),
    ];
    args.extend(dims(s));
    k.elementwise(&k.unpermute_qkv_grad, st, total / 8, args)
}
