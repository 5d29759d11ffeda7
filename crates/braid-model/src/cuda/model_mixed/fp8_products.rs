//! The products in FP8 (`GpuGptMixed::set_fp8`), torchao's float8
//! recipe: every operand quantised by its own amax (dynamic per-tensor
//! scaling) and stored along the product's shared dimension, as Hopper's
//! FP8 products take them.
//!
//! - Forward ([`Fp8Products::run`], for each product
//!   [`super::products::Product::fused`] would run in bf16): e4m3 input
//!   and weights (transposed), fast accumulation, the same epilogue.
//! - With [`Fp8Use::All`], the backward pass's products too, without
//!   tensor parallelism: the input gradient `dy · wᵀ` from e5m2 `dy` and
//!   e4m3 weights ([`Fp8Products::input_grad`]), the weight gradient `xᵀ ·
//!   dy` from e4m3 `xᵀ` and e5m2 `dyᵀ`, added into the f32 gradients
//!   ([`Fp8Products::weight_grad`]).
//!
//! A product that does not meet the FP8 products' shapes (dimensions
//! multiples of 16, operands stored whole) runs in bf16 as before; an
//! epilogue cuBLASLt has no FP8 product for is noted once and runs in
//! bf16 from then on.

use super::products::Product;
use crate::cuda::fp8::{Fp8Kernels, Fp8Tensor};
use braid_core::DType;
use braid_cuda::blas::Mat;
use braid_cuda::blaslt::{BlasLt, Epilogue, Fp8, LtGemm, Scaled};
use braid_cuda::{Device, DeviceMem, Result, Stream};

/// Room for one FP8 operand, grown to the largest asked for.
struct Room {
    device: Device,
    held: Option<Fp8Tensor>,
}

impl Room {
    /// Room for `n` values, for work queued on `s`: a smaller one is
    /// freed once `s` has finished with it (a product queued on `s` may
    /// still read it), before the larger one is made.
    fn at_least(&mut self, s: &Stream, n: usize) -> Result<&mut Fp8Tensor> {
        if self.held.as_ref().is_none_or(|t| t.bytes.dlen() < n) {
            s.synchronize()?;
            self.held = None;
            self.held = Some(Fp8Tensor::new(&self.device, n)?);
        }
        Ok(self.held.as_mut().expect("made above"))
    }
}

/// Which products run in FP8.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fp8Use {
    /// None: bf16 throughout.
    Off,
    /// The forward pass's.
    Forward,
    /// The forward and backward passes' (without tensor parallelism).
    All,
}

impl Fp8Use {
    /// `off`, `forward` or `all` (`BRAID_FP8`'s values).
    pub fn parse(v: &str) -> std::result::Result<Fp8Use, String> {
        match v.trim().to_ascii_lowercase().as_str() {
            "" | "0" | "off" => Ok(Fp8Use::Off),
            "forward" => Ok(Fp8Use::Forward),
            "1" | "all" => Ok(Fp8Use::All),
            other => Err(format!(
                "FP8 products {other:?}: expected off, forward (the forward pass's) or all"
            )),
        }
    }
}

/// The FP8 casts and the room for a product's two operands.
pub(super) struct Fp8Products {
    kernels: Fp8Kernels,
    input: Room,
    weight: Room,
    /// Epilogues cuBLASLt had no FP8 product for, by [`Epilogue::kind`]
    /// and result type ([`Fp8Products::slot`]): an f32 result's bias is
    /// f32, a bf16 one's bf16, and either may be refused alone.
    pub(super) off: [bool; 8],
    /// The backward pass's products too.
    pub(super) backward: bool,
    /// cuBLASLt had no FP8 product for a gradient's shape (noted once).
    backward_off: bool,
}

impl Fp8Products {
    /// The casts loaded on `device`, no room yet.
    pub(super) fn new(device: &Device, backward: bool) -> Result<Fp8Products> {
        let room = || Room {
            device: device.clone(),
            held: None,
        };
        Ok(Fp8Products {
            kernels: Fp8Kernels::load(device)?,
            input: room(),
            weight: room(),
            off: [false; 8],
            backward,
            backward_off: false,
        })
    }

    /// The [`Fp8Products::off`] slot of a forward product with `epilogue`
    /// into `d`.
    pub(super) fn slot(epilogue: &Epilogue, d: &Mat) -> usize {
        2 * epilogue.kind() as usize + usize::from(d.dtype() == DType::F32)
    }

    /// Whether `p` can run as an FP8 product: a bf16 input `[m, k]` and
    /// bf16 weights `[k, n]`, each stored whole, every dimension a
    /// multiple of 16.
    pub(super) fn takes(p: &Product) -> bool {
        let whole = |x: &Mat, ld: usize| x.dtype() == DType::BF16 && x.plain() && x.ld() == ld;
        whole(&p.a, p.k) && whole(&p.b, p.n) && [p.m, p.n, p.k].iter().all(|d| d % 16 == 0)
    }

    /// Runs `p` in FP8 on `s`: `d = a · b (+ residual)`, then `epilogue`
    /// (see the module docs). `p` must be one [`Fp8Products::takes`].
    pub(super) fn run(
        &mut self,
        lt: &mut BlasLt,
        s: &Stream,
        p: &Product,
        residual: Option<Mat>,
        d: Mat,
        epilogue: Epilogue,
    ) -> Result<()> {
        let (m, n, k) = (p.m, p.n, p.k);
        let input = self.input.at_least(s, m * k)?;
        // SAFETY: a Product's operands are views of live buffers of the
        // model, not written until the product that reads them has run
        // (its kernels and these casts are queued on the same stream).
        unsafe {
            self.kernels
                .quantize_bf16_at(s, input, p.a.storage(), (m, k), false, Fp8::E4M3)?
        };
        let weight = self.weight.at_least(s, k * n)?;
        // SAFETY: as above; the weights `[k, n]` go in stored `[n, k]`.
        unsafe {
            self.kernels
                .quantize_bf16_at(s, weight, p.b.storage(), (k, n), true, Fp8::E4M3)?
        };
        let g = LtGemm {
            m,
            n,
            k,
            a: Mat::of(&input.bytes, k),
            b: Mat::of(&weight.bytes, k).t(),
            c: residual.unwrap_or(d),
            d,
            epilogue,
            alpha: 1.0,
            beta: if residual.is_some() { 1.0 } else { 0.0 },
        };
        let scaled = Scaled {
            a: Fp8::E4M3,
            b: Fp8::E4M3,
            a_scale: input.deq.dptr(),
            b_scale: weight.deq.dptr(),
            fast_accum: true,
        };
        lt.gemm_scaled(s, &g, &scaled)
    }

    /// Whether the backward pass's products run here: asked for, and none
    /// refused yet.
    pub(super) fn backward_on(&self) -> bool {
        self.backward && !self.backward_off
    }

    /// `dx[n, inp] = dy[n, out] · wᵀ` (overwritten) for `y = x · w`, `w`
    /// stored `[inp, out]`: `dy` in e5m2 as stored, `w` in e4m3 as stored
    /// (`[inp, out]` is the product's `[n, k]`). `false`, nothing run,
    /// where the shapes do not fit or cuBLASLt has no such product (noted
    /// once; bf16 from then on).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn input_grad(
        &mut self,
        lt: &mut BlasLt,
        s: &Stream,
        (n, inp, out): (usize, usize, usize),
        dy: Mat,
        w: Mat,
        dx: Mat,
    ) -> Result<bool> {
        let fits = stored(&dy, out, DType::BF16)
            && stored(&w, out, DType::BF16)
            && stored(&dx, inp, DType::BF16)
            && [n, inp, out].iter().all(|d| d % 16 == 0);
        if !self.backward_on() || !fits {
            return Ok(false);
        }
        let a = self.input.at_least(s, n * out)?;
        // SAFETY: the backward pass's operands are views of the model's
        // live buffers, unwritten until this product (queued after these
        // casts on the same stream) has run.
        unsafe {
            self.kernels
                .quantize_bf16_at(s, a, dy.storage(), (n, out), false, Fp8::E5M2)?
        };
        let b = self.weight.at_least(s, inp * out)?;
        // SAFETY: as above.
        unsafe {
            self.kernels
                .quantize_bf16_at(s, b, w.storage(), (inp, out), false, Fp8::E4M3)?
        };
        let g = LtGemm {
            m: n,
            n: inp,
            k: out,
            a: Mat::of(&a.bytes, out),
            b: Mat::of(&b.bytes, out).t(),
            c: dx,
            d: dx,
            epilogue: Epilogue::Plain,
            alpha: 1.0,
            beta: 0.0,
        };
        let scaled = Scaled {
            a: Fp8::E5M2,
            b: Fp8::E4M3,
            a_scale: a.deq.dptr(),
            b_scale: b.deq.dptr(),
            fast_accum: false,
        };
        self.gradient(lt, s, &g, &scaled)
    }

    /// `dw[inp, out] = xᵀ · dy + beta · dw` (f32) for `y = x · w`: `x`
    /// (`[n, inp]`) in e4m3 transposed, `dy` (`[n, out]`) in e5m2
    /// transposed. `false` as [`Fp8Products::input_grad`].
    #[allow(clippy::too_many_arguments)]
    pub(super) fn weight_grad(
        &mut self,
        lt: &mut BlasLt,
        s: &Stream,
        (n, inp, out): (usize, usize, usize),
        x: Mat,
        dy: Mat,
        dw: Mat,
        beta: f32,
    ) -> Result<bool> {
        let fits = stored(&x, inp, DType::BF16)
            && stored(&dy, out, DType::BF16)
            && stored(&dw, out, DType::F32)
            && [n, inp, out].iter().all(|d| d % 16 == 0);
        if !self.backward_on() || !fits {
            return Ok(false);
        }
        let a = self.input.at_least(s, n * inp)?;
        // SAFETY: as in input_grad.
        unsafe {
            self.kernels
                .quantize_bf16_at(s, a, x.storage(), (n, inp), true, Fp8::E4M3)?
        };
        let b = self.weight.at_least(s, n * out)?;
        // SAFETY: as above.
        unsafe {
            self.kernels
                .quantize_bf16_at(s, b, dy.storage(), (n, out), true, Fp8::E5M2)?
        };
        let g = LtGemm {
            m: inp,
            n: out,
            k: n,
            a: Mat::of(&a.bytes, n),
            b: Mat::of(&b.bytes, n).t(),
            c: dw,
            d: dw,
            epilogue: Epilogue::Plain,
            alpha: 1.0,
            beta,
        };
        let scaled = Scaled {
            a: Fp8::E4M3,
            b: Fp8::E5M2,
            a_scale: a.deq.dptr(),
            b_scale: b.deq.dptr(),
            fast_accum: false,
        };
        self.gradient(lt, s, &g, &scaled)
    }

    /// Runs a gradient's scaled product: `true`, or `false` (noted, the
    /// backward pass in bf16 from then on) where cuBLASLt has none.
    fn gradient(&mut self, lt: &mut BlasLt, s: &Stream, g: &LtGemm, x: &Scaled) -> Result<bool> {
        match lt.gemm_scaled(s, g, x) {
            Ok(()) => Ok(true),
            Err(braid_cuda::CudaError::Invalid(e)) => Err(braid_cuda::CudaError::Invalid(e)),
            Err(e) => {
                eprintln!(
                    "note: cuBLASLt has no FP8 product for a gradient of {}x{}x{} here ({e}); \
                     the backward pass runs in bf16",
                    g.m, g.n, g.k
                );
                self.backward_off = true;
                Ok(false)
            }
        }
    }
}

/// Whether `m` holds `dtype` stored whole, `ld` elements a row.
fn stored(m: &Mat, ld: usize, dtype: DType) -> bool {
    m.dtype() == dtype && m.plain() && m.ld() == ld
}
