//! What this GPU's training kernels reach, timed one at a time for the
//! planner's calibration (`braid plan calibrate`): the bf16 products as
//! the mixed engine runs them (cuBLASLt, f32 accumulation; forward, input
//! gradient and weight gradient of each shape), the fused attention
//! forward and backward, and a device-to-device copy (the memory
//! bandwidth the elementwise kernels and the optimizer are bound by).
//! Each figure is the best of a few rounds of several back-to-back runs,
//! after one warm-up, timed by events on one stream. The operands hold
//! random values, not zeros, and the products are timed after a second of
//! them back to back: a GPU at its power limit lowers its clocks under
//! sustained products, the more the more its operands' bits toggle, and a
//! training step runs at those clocks (zeroed operands timed from cold
//! read 780-885 TFLOP/s at 2.65B's shapes on an H100, where its steps ran
//! its products near 640).

use super::flash::{FlashKernels, ScoreGrads};
use crate::cpu::attention::AttnShape;
use braid_cuda::blas::Mat;
use braid_cuda::blaslt::{BlasLt, Epilogue, LtGemm};
use braid_cuda::memory::copy_async;
use braid_cuda::{CudaError, Device, DeviceBuffer, Event, Result, Stream};
use half::bf16;

/// Rounds timed per figure (the best is kept).
const ROUNDS: usize = 3;

/// One product timed: `m × k · k × n`, seconds per run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ProductTime {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub seconds: f64,
}

impl ProductTime {
    /// Its floating-point operations.
    pub fn flops(&self) -> f64 {
        2.0 * (self.m * self.n * self.k) as f64
    }
}

/// The fused attention timed at one shape: seconds per forward pass and
/// per backward pass.
#[derive(Debug, Clone, Copy)]
pub struct AttentionTime {
    pub shape: AttnShape,
    pub forward_s: f64,
    pub backward_s: f64,
}

/// Seconds per run of `f`: `reps` runs back to back after one warm-up,
/// the best of [`ROUNDS`].
pub(crate) fn timed(s: &Stream, reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    let (a, b) = (Event::timed(s.device())?, Event::timed(s.device())?);
    f()?;
    let mut best = f64::INFINITY;
    for _ in 0..ROUNDS {
        a.record(s)?;
        for _ in 0..reps.max(1) {
            f()?;
        }
        b.record(s)?;
        b.synchronize()?;
        best = best.min(b.elapsed_ms(&a)? as f64 * 1e-3 / reps.max(1) as f64);
    }
    Ok(best)
}

/// A zeroed buffer (outputs, and what only its size matters for).
fn zeros<T: braid_core::Element>(d: &Device, len: usize) -> Result<DeviceBuffer<T>> {
    DeviceBuffer::zeros(d, len)
}

/// `len` bf16 values spread evenly over (-2, 2), a fixed pseudo-random
/// sequence: operands whose bits toggle as a model's do.
fn noise(d: &Device, len: usize) -> Result<DeviceBuffer<bf16>> {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let v: Vec<bf16> = (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            bf16::from_f32(((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 4.0)
        })
        .collect();
    DeviceBuffer::from_host(d, &v)
}

/// Seconds of back-to-back products before the first is timed, so that
/// the clocks have settled where sustained products keep them.
const HEAT_S: f64 = 1.0;

/// Times, for each forward shape `(tokens, in, out)`, the three products
/// a layer runs with it: the forward `[tokens,in]·[in,out]` (bf16 out),
/// the input gradient `[tokens,out]·[out,in]ᵀ` (bf16 out) and the weight
/// gradient `[tokens,in]ᵀ·[tokens,out]` (f32, added into), each `reps`
/// times.
pub fn products(
    device: &Device,
    shapes: &[(usize, usize, usize)],
    reps: usize,
) -> Result<Vec<ProductTime>> {
    let s = Stream::new(device)?;
    let mut lt = BlasLt::new(device)?;
    let mut out = Vec::with_capacity(3 * shapes.len());
    // One buffer of noise read as every input (reads may alias).
    let most = shapes
        .iter()
        .map(|&(t, i, o)| (t * i).max(i * o).max(t * o))
        .max()
        .unwrap_or(0);
    let src = noise(device, most)?;
    // The heat: the largest product's forward pass, back to back.
    if let Some(&(t, i, o)) = shapes.iter().max_by_key(|&&(t, i, o)| t * i * o) {
        let out = zeros::<bf16>(device, t * o)?;
        let g = LtGemm::plain(
            t,
            o,
            i,
            Mat::of(&src, i),
            Mat::of(&src, o),
            Mat::of(&out, o),
        );
        heat(&s, || lt.gemm(&s, &g))?;
        s.synchronize()?;
    }
    for &(tokens, cin, cout) in shapes {
        let (x, w, y) = (&src, &src, &src);
        let dx = zeros::<bf16>(device, tokens * cin)?;
        let yout = zeros::<bf16>(device, tokens * cout)?;
        let dw = zeros::<f32>(device, cin * cout)?;
        let forward = LtGemm::plain(
            tokens,
            cout,
            cin,
            Mat::of(x, cin),
            Mat::of(w, cout),
            Mat::of(&yout, cout),
        );
        let input_grad = LtGemm::plain(
            tokens,
            cin,
            cout,
            Mat::of(y, cout),
            Mat::of(w, cout).t(),
            Mat::of(&dx, cin),
        );
        let weight_grad = LtGemm {
            m: cin,
            n: cout,
            k: tokens,
            a: Mat::of(x, cin).t(),
            b: Mat::of(y, cout),
            c: Mat::of(&dw, cout),
            d: Mat::of(&dw, cout),
            epilogue: Epilogue::Plain,
            alpha: 1.0,
            beta: 1.0,
        };
        for g in [&forward, &input_grad, &weight_grad] {
            let seconds = timed(&s, reps, || lt.gemm(&s, g))?;
            out.push(ProductTime {
                m: g.m,
                n: g.n,
                k: g.k,
                seconds,
            });
        }
        // The buffers stay alive until the products that use them ran.
        s.synchronize()?;
    }
    Ok(out)
}

/// Runs `f` back to back for about [`HEAT_S`] seconds.
fn heat(s: &Stream, mut f: impl FnMut() -> Result<()>) -> Result<()> {
    let start = std::time::Instant::now();
    while start.elapsed().as_secs_f64() < HEAT_S {
        for _ in 0..20 {
            f()?;
        }
        s.synchronize()?;
    }
    Ok(())
}

/// Times the fused attention (the kernels the bf16 engine runs at this
/// head size) forward and backward at each shape, `reps` runs each.
pub fn attention(device: &Device, shapes: &[AttnShape], reps: usize) -> Result<Vec<AttentionTime>> {
    let flash = FlashKernels::load(device)?.ok_or_else(|| {
        CudaError::Invalid(
            "this GPU has no bf16 tensor cores (compute capability below 8.0): no fused attention \
             to time"
                .into(),
        )
    })?;
    let s = Stream::new(device)?;
    let mut out = Vec::with_capacity(shapes.len());
    for &shape in shapes {
        flash.check(shape)?;
        let (rows, heads) = (shape.b * shape.t, shape.b * shape.nh * shape.t);
        let qkv = noise(device, rows * 3 * shape.c)?;
        let mut o = zeros::<bf16>(device, rows * shape.c)?;
        let mut lse = zeros::<f32>(device, heads)?;
        let dout = noise(device, rows * shape.c)?;
        let mut dqkv = zeros::<bf16>(device, rows * 3 * shape.c)?;
        let mut dsum = zeros::<f32>(device, heads)?;
        let len = usize::try_from(FlashKernels::score_grads_len(shape))
            .map_err(|_| CudaError::Invalid("attention shape too large to time".into()))?;
        let mut grads = zeros::<bf16>(device, len)?;
        let forward_s = timed(&s, reps, || {
            flash.forward(&s, &mut o, &mut lse, &qkv, shape)
        })?;
        let backward_s = timed(&s, reps, || {
            flash.backward(
                &s,
                &mut dqkv,
                &mut dsum,
                Some(ScoreGrads::one(&mut grads)),
                &dout,
                &qkv,
                &o,
                &lse,
                shape,
            )
        })?;
        out.push(AttentionTime {
            shape,
            forward_s,
            backward_s,
        });
    }
    s.synchronize()?;
    Ok(out)
}

/// Memory bandwidth, GB/s: a device-to-device copy of `bytes` (read once,
/// written once), `reps` runs.
pub fn copy_gbps(device: &Device, bytes: usize, reps: usize) -> Result<f64> {
    let n = bytes / 4;
    let src = zeros::<f32>(device, n)?;
    let mut dst = zeros::<f32>(device, n)?;
    let s = Stream::new(device)?;
    let seconds = timed(&s, reps, || copy_async(&mut dst, &src, &s))?;
    Ok(2.0 * (4 * n) as f64 / seconds / 1e9)
}
