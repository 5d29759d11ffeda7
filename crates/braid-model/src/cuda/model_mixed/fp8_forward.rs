//! The forward pass's products in FP8 (`GpuGptMixed::set_fp8_forward`):
//! each product [`super::products::Product::fused`] would run in bf16 runs
//! instead on e4m3 copies of its input and of its weights (transposed, as
//! Hopper's FP8 products take them), each scaled by its own amax
//! (dynamic per-tensor scaling, torchao's float8 recipe for the forward
//! pass), with fast accumulation and the same epilogue. The backward
//! pass stays in bf16. A product that does not meet the FP8 products'
//! shapes (dimensions multiples of 16, operands stored whole) runs in
//! bf16 as before; an epilogue cuBLASLt has no FP8 product for is noted
//! once and runs in bf16 from then on.

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
    fn at_least(&mut self, n: usize) -> Result<&mut Fp8Tensor> {
        if self.held.as_ref().is_none_or(|t| t.bytes.dlen() < n) {
            self.held = None; // (freed before the larger one is made)
            self.held = Some(Fp8Tensor::new(&self.device, n)?);
        }
        Ok(self.held.as_mut().expect("made above"))
    }
}

/// The FP8 casts and the room for a product's two operands.
pub(super) struct Fp8Forward {
    kernels: Fp8Kernels,
    input: Room,
    weight: Room,
    /// Epilogues (by [`Epilogue::kind`]) cuBLASLt had no FP8 product for.
    pub(super) off: [bool; 4],
}

impl Fp8Forward {
    /// The casts loaded on `device`, no room yet.
    pub(super) fn new(device: &Device) -> Result<Fp8Forward> {
        let room = || Room {
            device: device.clone(),
            held: None,
        };
        Ok(Fp8Forward {
            kernels: Fp8Kernels::load(device)?,
            input: room(),
            weight: room(),
            off: [false; 4],
        })
    }

    /// Whether `p` can run as an FP8 product: a bf16 input `[m, k]` and
    /// bf16 weights `[k, n]`, each stored whole, every dimension a
    /// multiple of 16.
    pub(super) fn takes(p: &Product) -> bool {
        let whole = |x: &Mat, ld: usize| x.dtype() == DType::BF16 && x.plain() && x.ld() == ld;
        whole(&p.a, p.k) && whole(&p.b, p.n) && [p.m, p.n, p.k].iter().all(|d| d % 16 == 0)
    }

    /// Runs `p` in FP8 on `s`: `d = a · b (+ residual)`, then `epilogue`
    /// (see the module docs). `p` must be one [`Fp8Forward::takes`].
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
        let input = self.input.at_least(m * k)?;
        // SAFETY: a Product's operands are views of live buffers of the
        // model, not written until the product that reads them has run
        // (its kernels and these casts are queued on the same stream).
        unsafe {
            self.kernels
                .quantize_bf16_at(s, input, p.a.storage(), (m, k), false, Fp8::E4M3)?
        };
        let weight = self.weight.at_least(k * n)?;
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
}
