//! FP8 for `--precision fp8`'s products: [`Fp8Kernels`] quantise a bf16 or
//! f32 tensor into e4m3 or e5m2 bytes with one scale for the whole tensor
//! (its amax measured on the device each time: dynamic per-tensor scaling,
//! as torchao's float8 training does), as it is or transposed, leaving the
//! dequantising scale on the device for [`braid_cuda::blaslt::BlasLt::gemm_scaled`];
//! [`encode`] and [`decode`] are the formats on the host, the references the
//! kernels are checked against.

use super::sources::SOURCES;
use braid_cuda::blaslt::Fp8;
use braid_cuda::nvrtc::{Function, KernelArg, Module};
use braid_cuda::{CudaError, Device, DeviceBuffer, DeviceMem, Result, Stream};
use half::bf16;

/// The format's rounding: mantissa bits, exponent bias, largest finite code.
fn shape(f: Fp8) -> (i32, i32, u8) {
    match f {
        Fp8::E4M3 => (3, 7, 0x7e),
        Fp8::E5M2 => (2, 15, 0x7b),
    }
}

/// `x` in format `f`: rounded to nearest even, saturated at the largest
/// finite value (infinities too), NaN to NaN (0x7f with its sign) — what
/// the hardware's `cvt.rn.satfinite` gives.
pub fn encode(x: f32, f: Fp8) -> u8 {
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    if x.is_nan() {
        return sign | 0x7f;
    }
    let (mant, bias, max_code) = shape(f);
    let a = (x.abs() as f64).min(1e30);
    if a == 0.0 {
        return sign;
    }
    let emin = 1 - bias;
    let mut e = (a.log2().floor() as i32).max(emin);
    // (log2 may land a hair off at a power of two: settle it exactly.)
    if e > emin && a < 2f64.powi(e) {
        e -= 1;
    }
    if a >= 2f64.powi(e + 1) {
        e += 1;
    }
    let scaled = a * 2f64.powi(mant - e);
    // (Exact: a power of two times a value with f32's 24 bits.)
    let mut q = scaled.round_ties_even();
    if q >= (2 << mant) as f64 {
        q /= 2.0;
        e += 1;
    }
    let code = if q < (1 << mant) as f64 {
        q as u32
    } else {
        (((e + bias) as u32) << mant) | (q as u32 - (1 << mant))
    };
    sign | code.min(max_code as u32) as u8
}

/// The value of code `b` in format `f`.
pub fn decode(b: u8, f: Fp8) -> f32 {
    let (mant, bias, _) = shape(f);
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = ((b & 0x7f) >> mant) as i32;
    let m = (b & ((1 << mant) - 1)) as f64;
    let special = match f {
        Fp8::E4M3 => b & 0x7f == 0x7f,
        Fp8::E5M2 => exp == 31,
    };
    if special {
        return match (f, m == 0.0) {
            (Fp8::E5M2, true) => (sign * f64::INFINITY) as f32,
            _ => f32::NAN,
        };
    }
    let v = match exp {
        0 => m * 2f64.powi(1 - bias - mant),
        _ => (1.0 + m / (1 << mant) as f64) * 2f64.powi(exp - bias),
    };
    (sign * v) as f32
}

/// The multiplier into format `f` for a tensor of largest magnitude `amax`,
/// computed as the kernels do (f32, IEEE division).
pub fn scale(amax: f32, f: Fp8) -> f32 {
    f.max() / amax.max(1e-12)
}

/// A tensor's elements the cast kernels read: bf16 or f32.
pub trait Fp8Source: braid_core::Element {
    /// The kernels' name suffix.
    const SUFFIX: &'static str;
}

impl Fp8Source for bf16 {
    const SUFFIX: &'static str = "bf";
}

impl Fp8Source for f32 {
    const SUFFIX: &'static str = "f32";
}

/// One source type's kernels.
struct Casts {
    amax: Function,
    cast: Function,
    cast_t: Function,
    cast_delayed: Function,
    recast: Function,
    cast_t_delayed: Function,
    recast_t: Function,
}

/// How a quantisation finds its scale: from the tensor's own amax,
/// measured first (dynamic: two reads), or from the amax it had the last
/// time at the device address `hist`, measuring its own into `next` in
/// the same pass and casting again only where it outgrew a margin of 2
/// (delayed: one read; `fp8.cu`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Scaling {
    Dynamic,
    Delayed { hist: u64, next: u64 },
}

/// The FP8 cast kernels (`fp8.cu`), loaded on one device.
pub struct Fp8Kernels {
    bf: Casts,
    f32: Casts,
    bias_bf16: Function,
}

/// Threads of the amax and plain cast kernels' blocks.
const BLOCK: u32 = 256;

impl Fp8Kernels {
    /// Compiles `fp8.cu` for `device` and loads its kernels.
    pub fn load(device: &Device) -> Result<Fp8Kernels> {
        let (name, src) = SOURCES[3];
        let module = Module::compile(device, name, src)?;
        let casts = |suffix: &str| -> Result<Casts> {
            Ok(Casts {
                amax: module.function(&format!("fp8_amax_{suffix}"))?,
                cast: module.function(&format!("fp8_cast_{suffix}"))?,
                cast_t: module.function(&format!("fp8_cast_t_{suffix}"))?,
                cast_delayed: module.function(&format!("fp8_cast_delayed_{suffix}"))?,
                recast: module.function(&format!("fp8_recast_{suffix}"))?,
                cast_t_delayed: module.function(&format!("fp8_cast_t_delayed_{suffix}"))?,
                recast_t: module.function(&format!("fp8_recast_t_{suffix}"))?,
            })
        };
        Ok(Fp8Kernels {
            bf: casts("bf")?,
            f32: casts("f32")?,
            bias_bf16: module.function("fp8_bias_bf16")?,
        })
    }

    /// The f32 bias at `x` (`(address, elements)`) as bf16 into `out`
    /// (cuBLASLt's FP8 products with an f32 result take a bf16 bias).
    ///
    /// # Safety
    /// `x` must address that many live f32 elements on this device, left
    /// unwritten until the kernel queued on `s` has run.
    pub(crate) unsafe fn bias_to_bf16_at(
        &self,
        s: &Stream,
        out: &mut impl DeviceMem<half::bf16>,
        x: (u64, usize),
    ) -> Result<()> {
        let n = x.1;
        if out.dlen() < n || i32::try_from(n).is_err() {
            return Err(CudaError::Invalid(format!(
                "fp8 bias: {n} values into {} (or past 32-bit counts)",
                out.dlen()
            )));
        }
        if n == 0 {
            return Ok(());
        }
        let mut args = [
            KernelArg::Ptr(out.dptr()),
            KernelArg::Ptr(x.0),
            KernelArg::I32(n as i32),
        ];
        let grid = (n.div_ceil(BLOCK as usize) as u32, 1, 1);
        // SAFETY: fp8_bias_bf16 takes (bf16*, const float*, int): out holds
        // n bf16 (checked), the caller vouches for x's n floats.
        unsafe {
            self.bias_bf16
                .launch_args(grid, (BLOCK, 1, 1), 0, s, &mut args)
        }
    }

    /// `x` (`rows` × `cols`, row-major) into `out` in format `f`, scaled
    /// by its own amax (measured into `amax[0]`): as it is, or with
    /// `transposed` stored `cols` × `rows`. `deq[0]` becomes the
    /// dequantising scale (amax / the format's largest value) the product
    /// is given.
    #[allow(clippy::too_many_arguments)]
    pub fn quantize<T: Fp8Source>(
        &self,
        s: &Stream,
        out: &mut impl DeviceMem<u8>,
        deq: &mut impl DeviceMem<f32>,
        amax: &mut impl DeviceMem<f32>,
        x: &impl DeviceMem<T>,
        shape: (usize, usize),
        transposed: bool,
        f: Fp8,
    ) -> Result<()> {
        // SAFETY: x is a live device buffer of x.dlen() elements of T.
        unsafe {
            self.quantize_at(
                s,
                (out, deq, amax),
                (x.dptr(), x.dlen(), T::SUFFIX),
                shape,
                transposed,
                f,
                Scaling::Dynamic,
                None,
            )
        }
    }

    /// [`Fp8Kernels::quantize`] of the bf16 matrix at `x` (`(address,
    /// elements)`).
    ///
    /// # Safety
    /// `x` must address that many live bf16 elements on this device, left
    /// unwritten until the kernels queued on `s` have run.
    /// With [`Scaling::Delayed`], `hist` and `next` must address one live
    /// f32 each on this device (not the same one).
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn quantize_bf16_at(
        &self,
        s: &Stream,
        to: &mut Fp8Tensor,
        x: (u64, usize),
        shape: (usize, usize),
        transposed: bool,
        f: Fp8,
        scaling: Scaling,
    ) -> Result<()> {
        let out = (&mut to.bytes, &mut to.deq, &mut to.amax);
        // SAFETY: the caller vouches for x and the scaling's addresses.
        unsafe {
            self.quantize_at(
                s,
                out,
                (x.0, x.1, "bf"),
                shape,
                transposed,
                f,
                scaling,
                None,
            )
        }
    }

    /// Whether [`Fp8Kernels::quantize_bf16_both_at`] takes the bf16 matrix
    /// of `shape` at address `x`: 64 x 64 tiles moved eight values a load
    /// (columns a multiple of 8, rows of 16, `x` aligned to 16 bytes).
    pub(crate) fn casts_both(x: u64, (rows, cols): (usize, usize)) -> bool {
        cols % 8 == 0 && rows % 16 == 0 && x % 16 == 0
    }

    /// [`Fp8Kernels::quantize_bf16_at`] transposed into `to`, and in the
    /// same pass (one read of `x`) as stored into `stored` (its bytes and
    /// dequantising scale; its amax is left as it was): for a tensor a
    /// product takes as stored and another transposed. Refused unless
    /// [`Fp8Kernels::casts_both`].
    ///
    /// # Safety
    /// As [`Fp8Kernels::quantize_bf16_at`].
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn quantize_bf16_both_at(
        &self,
        s: &Stream,
        to: &mut Fp8Tensor,
        stored: &mut Fp8Tensor,
        x: (u64, usize),
        shape: (usize, usize),
        f: Fp8,
        scaling: Scaling,
    ) -> Result<()> {
        let out = (&mut to.bytes, &mut to.deq, &mut to.amax);
        let x = (x.0, x.1, "bf");
        // SAFETY: the caller vouches for x and the scaling's addresses.
        unsafe { self.quantize_at(s, out, x, shape, true, f, scaling, Some(stored)) }
    }

    /// [`Fp8Kernels::quantize`] with a [`Scaling`] (for the tests of the
    /// delayed kernels; the engine quantises at addresses).
    ///
    /// # Safety
    /// As [`Fp8Kernels::quantize_bf16_at`]'s scaling.
    #[cfg(test)]
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn quantize_scaled<T: Fp8Source>(
        &self,
        s: &Stream,
        to: &mut Fp8Tensor,
        x: &impl DeviceMem<T>,
        shape: (usize, usize),
        transposed: bool,
        f: Fp8,
        scaling: Scaling,
    ) -> Result<()> {
        let out = (&mut to.bytes, &mut to.deq, &mut to.amax);
        let x = (x.dptr(), x.dlen(), T::SUFFIX);
        // SAFETY: x is a live buffer; the caller vouches for the scaling.
        unsafe { self.quantize_at(s, out, x, shape, transposed, f, scaling, None) }
    }

    /// The quantisation itself; `x` is `(address, elements, the kernels'
    /// suffix)`; `both`: the codes as stored too (transposed, wide tiles
    /// only).
    ///
    /// # Safety
    /// As [`Fp8Kernels::quantize_bf16_at`], for elements of the suffix's type.
    #[allow(clippy::type_complexity, clippy::too_many_arguments)]
    unsafe fn quantize_at(
        &self,
        s: &Stream,
        (out, deq, amax): (
            &mut impl DeviceMem<u8>,
            &mut impl DeviceMem<f32>,
            &mut impl DeviceMem<f32>,
        ),
        (x_ptr, x_len, suffix): (u64, usize, &str),
        (rows, cols): (usize, usize),
        transposed: bool,
        f: Fp8,
        scaling: Scaling,
        both: Option<&mut Fp8Tensor>,
    ) -> Result<()> {
        let n = rows * cols;
        if x_len < n || out.dlen() < n || deq.dlen() < 1 || amax.dlen() < 1 {
            return Err(CudaError::Invalid(format!(
                "fp8 quantize: {rows} x {cols} from {x_len} elements into {} bytes (scale {}, \
                 amax {})",
                out.dlen(),
                deq.dlen(),
                amax.dlen()
            )));
        }
        let (i32_rows, i32_cols) = match (i32::try_from(rows), i32::try_from(cols)) {
            (Ok(r), Ok(c)) => (r, c),
            _ => {
                return Err(CudaError::Invalid(format!(
                    "fp8 quantize: {rows} x {cols} past 32-bit dimensions"
                )))
            }
        };
        let k = match suffix {
            "bf" => &self.bf,
            _ => &self.f32,
        };
        let fmt = KernelArg::I32(match f {
            Fp8::E4M3 => 0,
            Fp8::E5M2 => 1,
        });
        braid_cuda::memory::zero_async(amax, s)?;
        // Four values a thread where the count and the addresses allow:
        // x's four elements (8 or 16 bytes) and the output's four bytes
        // aligned.
        let elem = if suffix == "bf" { 2 } else { 4 };
        let vec = n % 4 == 0 && x_ptr % (4 * elem) == 0 && out.dptr() % 4 == 0;
        let threads = if vec { n / 4 } else { n };
        let grid = (threads.div_ceil(BLOCK as usize).clamp(1, 4096)) as u32;
        // Transposed, 64 x 64 tiles moved eight values a load and sixteen
        // bytes a store where the shape and the addresses allow (fp8.cu's
        // fp8_cast_t_wide), else 32 x 32 tiles a value at a time.
        let wide = cols % 8 == 0 && rows % 16 == 0 && x_ptr % 16 == 0 && out.dptr() % 16 == 0;
        let (tile, block) = match wide {
            true => (64, (256, 1, 1)),
            false => (32, (32, 8, 1)),
        };
        let tiles = (cols.div_ceil(tile) as u32, rows.div_ceil(tile) as u32, 1);
        if transposed && tiles.1 > 65535 {
            return Err(CudaError::Invalid(format!(
                "fp8 quantize: {rows} rows need more than 65535 tiles of {tile}"
            )));
        }
        let (o, d, a) = (
            KernelArg::Ptr(out.dptr()),
            KernelArg::Ptr(deq.dptr()),
            KernelArg::Ptr(amax.dptr()),
        );
        let x = KernelArg::Ptr(x_ptr);
        let (r, c, len) = (
            KernelArg::I32(i32_rows),
            KernelArg::I32(i32_cols),
            KernelArg::I64(n as i64),
        );
        let v = KernelArg::I32(i32::from(vec));
        let wd = KernelArg::I32(i32::from(wide));
        let (both_out, both_deq) = match both {
            None => (0, 0),
            Some(t) if transposed && wide && t.bytes.dlen() >= n && t.bytes.dptr() % 8 == 0 => {
                (t.bytes.dptr(), t.deq.dptr())
            }
            Some(t) => {
                return Err(CudaError::Invalid(format!(
                    "fp8 quantize: both layouts of {rows} x {cols} (transposed {transposed}, wide \
                     tiles {wide}) into {} bytes",
                    t.bytes.dlen()
                )))
            }
        };
        let (bo, bd) = (KernelArg::Ptr(both_out), KernelArg::Ptr(both_deq));
        // Launches `f` over the plain grid or, transposed, the tiles.
        let go = |f: &Function, args: &mut [KernelArg]| {
            // SAFETY: every kernel below takes the arguments given it, in
            // order (fp8.cu): out holds n bytes, deq and amax one f32 each,
            // x at least n elements of the suffix's type (checked above;
            // the caller vouches for x and the scaling's addresses), aligned
            // for four where vec says and x and out for sixteen bytes where
            // wide says; each thread writes inside out, and inside the
            // tensor `both` gives where it is non-null (n bytes, aligned for
            // eight, one f32 of scale: checked above).
            unsafe {
                match transposed {
                    true => f.launch_args(tiles, block, 0, s, args),
                    false => f.launch_args((grid, 1, 1), (BLOCK, 1, 1), 0, s, args),
                }
            }
        };
        match (scaling, transposed) {
            (Scaling::Dynamic, _) => {
                let mut args = [a, x, len, v];
                // SAFETY: fp8_amax_* takes (float*, const T*, long, int).
                unsafe {
                    k.amax
                        .launch_args((grid, 1, 1), (BLOCK, 1, 1), 0, s, &mut args)?
                };
                match transposed {
                    true => go(&k.cast_t, &mut [o, d, x, a, r, c, fmt, wd, bo, bd]),
                    false => go(&k.cast, &mut [o, d, x, a, len, fmt, v]),
                }
            }
            // `amax` is where the tensor's own is measured (`seen`).
            (Scaling::Delayed { hist, next }, true) => {
                let (h, nx) = (KernelArg::Ptr(hist), KernelArg::Ptr(next));
                go(
                    &k.cast_t_delayed,
                    &mut [o, d, x, h, a, r, c, fmt, wd, bo, bd],
                )?;
                go(&k.recast_t, &mut [o, d, x, h, a, nx, r, c, fmt, wd, bo, bd])
            }
            (Scaling::Delayed { hist, next }, false) => {
                let (h, nx) = (KernelArg::Ptr(hist), KernelArg::Ptr(next));
                go(&k.cast_delayed, &mut [o, d, x, h, a, len, fmt, v])?;
                go(&k.recast, &mut [o, d, x, h, a, nx, len, fmt, v])
            }
        }
    }
}

/// A tensor quantised to FP8 on the device: its bytes, its amax and its
/// dequantising scale.
pub struct Fp8Tensor {
    pub bytes: DeviceBuffer<u8>,
    pub amax: DeviceBuffer<f32>,
    pub deq: DeviceBuffer<f32>,
}

impl Fp8Tensor {
    /// Room for `n` values.
    pub fn new(device: &Device, n: usize) -> Result<Fp8Tensor> {
        Ok(Fp8Tensor {
            bytes: DeviceBuffer::zeros(device, n)?,
            amax: DeviceBuffer::zeros(device, 1)?,
            deq: DeviceBuffer::zeros(device, 1)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::{decode, encode, scale};
    use braid_cuda::blaslt::Fp8;

    /// Every code decodes and encodes back to itself (NaNs to the NaN
    /// code), and the formats' landmarks are where OCP puts them.
    #[test]
    fn every_fp8_code_round_trips_and_the_landmarks_hold() {
        for f in [Fp8::E4M3, Fp8::E5M2] {
            for b in 0..=255u8 {
                let v = decode(b, f);
                if v.is_nan() {
                    assert_eq!(encode(v, f) & 0x7f, 0x7f, "{f:?} {b:#x}");
                    continue;
                }
                if v.is_infinite() {
                    continue; // saturates to the largest finite
                }
                assert_eq!(encode(v, f), b, "{f:?} {b:#x} = {v}");
            }
            assert_eq!(decode(shape_max(f), f), f.max());
            assert_eq!(encode(1e9, f), shape_max(f));
            assert_eq!(encode(f32::INFINITY, f), shape_max(f));
            assert_eq!(encode(-1e9, f), 0x80 | shape_max(f));
        }
        assert_eq!(decode(0x01, Fp8::E4M3), 2f32.powi(-9));
        assert_eq!(decode(0x01, Fp8::E5M2), 2f32.powi(-16));
        assert_eq!(decode(0x38, Fp8::E4M3), 1.0);
        assert_eq!(decode(0x3c, Fp8::E5M2), 1.0);
    }

    fn shape_max(f: Fp8) -> u8 {
        super::shape(f).2
    }

    /// Halfway values go to the even code; values past the largest finite
    /// one by less than half a step saturate; tiny ones round to zero or
    /// the smallest subnormal.
    #[test]
    fn fp8_rounds_to_nearest_even_and_saturates() {
        // e4m3 near 1: steps of 1/8.
        assert_eq!(encode(1.0625, Fp8::E4M3), 0x38); // halfway 1 and 1.125: to 1 (even)
        assert_eq!(encode(1.1875, Fp8::E4M3), 0x3a); // halfway 1.125 and 1.25: to 1.25
        assert_eq!(encode(1.07, Fp8::E4M3), 0x39);
        assert_eq!(encode(464.0, Fp8::E4M3), 0x7e); // would round to 480: saturates
        assert_eq!(encode(2f32.powi(-10), Fp8::E4M3), 0x00); // half the smallest: to even 0
        assert_eq!(encode(1.5 * 2f32.powi(-9), Fp8::E4M3), 0x02);
        assert_eq!(encode(-0.0, Fp8::E4M3), 0x80);
        // e5m2 near 1: steps of 1/4.
        assert_eq!(encode(1.125, Fp8::E5M2), 0x3c);
        assert_eq!(encode(1.375, Fp8::E5M2), 0x3e);
        assert_eq!(encode(61440.0, Fp8::E5M2), 0x7b);
        // The scale maps amax onto the largest value.
        assert_eq!(scale(2.0, Fp8::E4M3), 224.0);
        assert_eq!(scale(0.0, Fp8::E5M2), 57344.0 / 1e-12);
    }

    /// fp8.cu compiles for Ampere (the software rounding) and Hopper (the
    /// hardware's), where NVRTC can be loaded.
    #[test]
    fn the_fp8_casts_compile_for_ampere_and_hopper() {
        if let Err(e) = braid_cuda::nvrtc::version() {
            eprintln!("skipped: the FP8 casts' PTX check ({e})");
            return;
        }
        let (name, src) = crate::cuda::SOURCES[3];
        for arch in ["compute_80", "compute_90"] {
            let ptx = braid_cuda::nvrtc::compile_ptx(name, src, arch).unwrap();
            for k in [
                "fp8_amax_f32",
                "fp8_cast_bf",
                "fp8_cast_t_bf",
                "fp8_cast_delayed_bf",
                "fp8_recast_f32",
                "fp8_cast_t_delayed_f32",
                "fp8_recast_t_bf",
                "fp8_bias_bf16",
            ] {
                assert!(ptx.contains(&format!(".entry {k}(")), "{arch}: {k}");
            }
        }
    }

    /// A GPU of compute capability 8.9 or later (FP8 products), or why not.
    fn fp8_gpu() -> Option<braid_cuda::Device> {
        if braid_cuda::device_count().unwrap_or(0) == 0 {
            eprintln!("skipped: no GPU");
            return None;
        }
        let device = braid_cuda::Device::open(0).unwrap();
        match device.compute_capability().unwrap() {
            (major, minor) if major * 10 + minor >= 89 => Some(device),
            cc => {
                eprintln!("skipped: compute capability {cc:?} has no FP8 products");
                None
            }
        }
    }

    fn randn(r: &mut crate::rng::Rng, n: usize, sd: f64) -> Vec<half::bf16> {
        (0..n)
            .map(|_| half::bf16::from_f64(r.normal() * sd))
            .collect()
    }

    /// The host's codes of the `rows` x `cols` tensor `v` multiplied by
    /// `sc`, as stored or transposed (`t`).
    fn host_codes(v: &[f32], (rows, cols): (usize, usize), sc: f32, t: bool, f: Fp8) -> Vec<u8> {
        let mut out = vec![0u8; rows * cols];
        for i in 0..rows {
            for j in 0..cols {
                let code = encode(v[i * cols + j] * sc, f);
                match t {
                    false => out[i * cols + j] = code,
                    true => out[j * rows + i] = code,
                }
            }
        }
        out
    }

    /// The device's casts give the host's codes bit for bit (as stored and
    /// transposed, e4m3 and e5m2, from bf16 and f32), its scales the
    /// host's; then cuBLASLt's scaled product of those codes equals the
    /// host's product of their values within bf16's rounding, and is
    /// within a few percent of the unquantised product.
    #[test]
    fn gpu_fp8_delayed_casts_match_the_host() {
        use super::{Fp8Kernels, Fp8Tensor, Scaling};
        use braid_cuda::{DeviceBuffer, DeviceMem, Stream};
        let Some(device) = fp8_gpu() else { return };
        let fk = Fp8Kernels::load(&device).unwrap();
        let s = Stream::new(&device).unwrap();
        let mut r = crate::rng::Rng::new(5);
        let (rows, cols) = (96, 320);
        let x = randn(&mut r, rows * cols, 1.0);
        let xf: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
        let xd = DeviceBuffer::from_host(&device, &x).unwrap();
        let amax = xf.iter().fold(0f32, |a, v| a.max(v.abs()));
        // The host's codes of x under the multiplier `sc`.
        let host = |sc: f32, t: bool, f: Fp8| host_codes(&xf, (rows, cols), sc, t, f);
        for f in [Fp8::E4M3, Fp8::E5M2] {
            for t in [false, true] {
                // The last amax as it was (no recast: the margin of 2 is
                // the scale), then a quarter of it (the tensor outgrew the
                // margin: cast again by its own, the dynamic codes).
                for (last, sc) in [(amax, scale(2.0 * amax, f)), (amax / 4.0, scale(amax, f))] {
                    let hist = DeviceBuffer::from_host(&device, &[last]).unwrap();
                    let next = DeviceBuffer::<f32>::zeros(&device, 1).unwrap();
                    let mut q = Fp8Tensor::new(&device, rows * cols).unwrap();
                    let delayed = Scaling::Delayed {
                        hist: hist.dptr(),
                        next: next.dptr(),
                    };
                    // SAFETY: hist and next hold one live f32 each.
                    unsafe {
                        fk.quantize_scaled(&s, &mut q, &xd, (rows, cols), t, f, delayed)
                            .unwrap()
                    };
                    s.synchronize().unwrap();
                    let what = format!("{} transposed {t}, last amax {last}", f.name());
                    assert_eq!(q.bytes.to_vec().unwrap(), host(sc, t, f), "{what}");
                    assert_eq!(q.deq.to_vec().unwrap()[0], 1.0 / sc, "{what}");
                    assert_eq!(next.to_vec().unwrap()[0], amax, "{what}: the amax kept");
                    if !t {
                        continue;
                    }
                    // Both layouts from one read, delayed alike.
                    let mut stored = Fp8Tensor::new(&device, rows * cols).unwrap();
                    // SAFETY: hist and next hold one live f32 each; xd
                    // rows * cols bf16 values.
                    unsafe {
                        fk.quantize_bf16_both_at(
                            &s,
                            &mut q,
                            &mut stored,
                            (xd.dptr(), rows * cols),
                            (rows, cols),
                            f,
                            delayed,
                        )
                        .unwrap()
                    };
                    assert_eq!(q.bytes.to_vec().unwrap(), host(sc, true, f), "both, {what}");
                    assert_eq!(
                        stored.bytes.to_vec().unwrap(),
                        host(sc, false, f),
                        "both, {what}"
                    );
                    assert_eq!(stored.deq.to_vec().unwrap()[0], 1.0 / sc, "both, {what}");
                }
            }
        }
    }

    #[test]
    fn gpu_fp8_casts_and_scaled_products_match_the_host() {
        use super::{Fp8Kernels, Fp8Tensor};
        use braid_cuda::blas::Mat;
        use braid_cuda::blaslt::{BlasLt, Epilogue, LtGemm, Scaled};
        use braid_cuda::{DeviceBuffer, DeviceMem, Stream};
        let Some(device) = fp8_gpu() else { return };
        let fk = Fp8Kernels::load(&device).unwrap();
        let s = Stream::new(&device).unwrap();
        let mut lt = BlasLt::new(&device).unwrap();
        let mut r = crate::rng::Rng::new(3);
        let (m, k, n) = (96, 320, 144);
        let x = randn(&mut r, m * k, 1.0);
        let w = randn(&mut r, k * n, 0.05);
        let xd = DeviceBuffer::from_host(&device, &x).unwrap();
        let wd = DeviceBuffer::from_host(&device, &w).unwrap();
        let wf: Vec<f32> = w.iter().map(|v| v.to_f32()).collect();
        let wfd = DeviceBuffer::from_host(&device, &wf).unwrap();
        let xf: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
        // The host's codes of a rows x cols tensor by its own amax, as
        // stored or transposed, and their dequantising scale.
        let host = |v: &[f32], shape: (usize, usize), t: bool, f: Fp8| -> (Vec<u8>, f32) {
            let sc = scale(v.iter().fold(0f32, |a, x| a.max(x.abs())), f);
            (host_codes(v, shape, sc, t, f), 1.0 / sc)
        };
        for (xf8, wf8) in [(Fp8::E4M3, Fp8::E4M3), (Fp8::E5M2, Fp8::E4M3)] {
            let mut xq = Fp8Tensor::new(&device, m * k).unwrap();
            let mut wq = Fp8Tensor::new(&device, k * n).unwrap();
            fk.quantize(
                &s,
                &mut xq.bytes,
                &mut xq.deq,
                &mut xq.amax,
                &xd,
                (m, k),
                false,
                xf8,
            )
            .unwrap();
            // W is stored [k, n]; the product wants it [n, k].
            fk.quantize(
                &s,
                &mut wq.bytes,
                &mut wq.deq,
                &mut wq.amax,
                &wd,
                (k, n),
                true,
                wf8,
            )
            .unwrap();
            let (hx, dx) = host(&xf, (m, k), false, xf8);
            let (hw, dw) = host(&wf, (k, n), true, wf8);
            assert_eq!(xq.bytes.to_vec().unwrap(), hx, "x as {xf8:?}");
            // One element in, x is not aligned for four: the value-a-thread
            // kernels give the same codes.
            let mut shifted = vec![half::bf16::ZERO];
            shifted.extend_from_slice(&x);
            let xs = DeviceBuffer::from_host(&device, &shifted).unwrap();
            let mut xq1 = Fp8Tensor::new(&device, m * k).unwrap();
            let xv = xs.view(1..1 + m * k);
            fk.quantize(
                &s,
                &mut xq1.bytes,
                &mut xq1.deq,
                &mut xq1.amax,
                &xv,
                (m, k),
                false,
                xf8,
            )
            .unwrap();
            assert_eq!(xq1.bytes.to_vec().unwrap(), hx, "x misaligned as {xf8:?}");
            // Transposed: misaligned, on the 32 x 32 tiles a value at a
            // time; aligned (w below, and here), on the wide tiles. The
            // same codes.
            let (hxt, _) = host(&xf, (m, k), true, xf8);
            for (from, what) in [(&xv, "misaligned"), (&xd.view(0..m * k), "aligned")] {
                let mut xt = Fp8Tensor::new(&device, m * k).unwrap();
                fk.quantize(
                    &s,
                    &mut xt.bytes,
                    &mut xt.deq,
                    &mut xt.amax,
                    from,
                    (m, k),
                    true,
                    xf8,
                )
                .unwrap();
                assert_eq!(xt.bytes.to_vec().unwrap(), hxt, "x transposed, {what}");
            }
            // Both layouts from one read: the same codes and scale in each.
            assert!(Fp8Kernels::casts_both(xd.dptr(), (m, k)));
            let (mut xt, mut xs) = (
                Fp8Tensor::new(&device, m * k).unwrap(),
                Fp8Tensor::new(&device, m * k).unwrap(),
            );
            // SAFETY: xd holds m * k live bf16 values.
            unsafe {
                fk.quantize_bf16_both_at(
                    &s,
                    &mut xt,
                    &mut xs,
                    (xd.dptr(), m * k),
                    (m, k),
                    xf8,
                    super::Scaling::Dynamic,
                )
                .unwrap()
            };
            assert_eq!(xt.bytes.to_vec().unwrap(), hxt, "both: x transposed");
            assert_eq!(xs.bytes.to_vec().unwrap(), hx, "both: x as stored");
            assert_eq!(xs.deq.to_vec().unwrap()[0], dx, "both: the scale as stored");
            assert_eq!(
                xt.deq.to_vec().unwrap()[0],
                dx,
                "both: the scale transposed"
            );
            assert_eq!(wq.bytes.to_vec().unwrap(), hw, "w transposed as {wf8:?}");
            assert_eq!(xq.deq.to_vec().unwrap()[0], dx);
            assert_eq!(wq.deq.to_vec().unwrap()[0], dw);
            // From f32 too (the master weights): the same codes.
            let mut wq32 = Fp8Tensor::new(&device, k * n).unwrap();
            fk.quantize(
                &s,
                &mut wq32.bytes,
                &mut wq32.deq,
                &mut wq32.amax,
                &wfd,
                (k, n),
                true,
                wf8,
            )
            .unwrap();
            assert_eq!(wq32.bytes.to_vec().unwrap(), hw, "w from f32");
            let y = DeviceBuffer::<half::bf16>::zeros(&device, m * n).unwrap();
            let g = LtGemm::plain(
                m,
                n,
                k,
                Mat::of(&xq.bytes, k),
                Mat::of(&wq.bytes, k).t(),
                Mat::of(&y, n),
            );
            let sc = Scaled {
                a: xf8,
                b: wf8,
                a_scale: xq.deq.dptr(),
                b_scale: wq.deq.dptr(),
                fast_accum: false,
            };
            lt.gemm_scaled(&s, &g, &sc).unwrap();
            s.synchronize().unwrap();
            let got: Vec<f32> = y.to_vec().unwrap().iter().map(|v| v.to_f32()).collect();
            let (mut worst, mut err2, mut ref2) = (0f64, 0f64, 0f64);
            for i in 0..m {
                for j in 0..n {
                    let (mut q, mut exact) = (0f64, 0f64);
                    for t in 0..k {
                        q += decode(hx[i * k + t], xf8) as f64 * decode(hw[j * k + t], wf8) as f64;
                        exact += xf[i * k + t] as f64 * wf[t * n + j] as f64;
                    }
                    q *= dx as f64 * dw as f64;
                    let e = (got[i * n + j] as f64 - q).abs() / q.abs().max(0.05);
                    worst = worst.max(e);
                    err2 += (q - exact).powi(2);
                    ref2 += exact.powi(2);
                }
            }
            let quant = (err2 / ref2).sqrt();
            eprintln!(
                "fp8 {}x{}: worst {worst:.2e} from the host's product of the codes; the \
                 quantisation's rms error {quant:.2e} of the bf16 product",
                xf8.name(),
                wf8.name()
            );
            assert!(worst < 1e-2, "{worst}");
            assert!(quant < 0.08, "{quant}");
            // An f32 result with a bias, as the residual products run: the
            // bias goes in as bf16 (`scaled_bias_type`), made from f32 by
            // the kernels, and lands on every row as the host adds it.
            let bias32: Vec<f32> = (0..n).map(|j| 0.37 - 0.013 * j as f32).collect();
            let bias_f = DeviceBuffer::from_host(&device, &bias32).unwrap();
            let mut bias_b = DeviceBuffer::<half::bf16>::zeros(&device, n).unwrap();
            // SAFETY: bias_f holds n live f32 values, unchanged here.
            unsafe {
                fk.bias_to_bf16_at(&s, &mut bias_b, (bias_f.dptr(), n))
                    .unwrap()
            };
            let bias_host: Vec<f32> = bias32
                .iter()
                .map(|&v| half::bf16::from_f32(v).to_f32())
                .collect();
            let got_b: Vec<f32> = bias_b
                .to_vec()
                .unwrap()
                .iter()
                .map(|v| v.to_f32())
                .collect();
            assert_eq!(got_b, bias_host, "the bias's bf16 copy");
            let y32 = DeviceBuffer::<f32>::zeros(&device, m * n).unwrap();
            let g32 = LtGemm {
                c: Mat::of(&y32, n),
                d: Mat::of(&y32, n),
                epilogue: Epilogue::Bias {
                    bias: (bias_b.dptr(), n),
                },
                ..g
            };
            lt.gemm_scaled(&s, &g32, &sc).unwrap();
            s.synchronize().unwrap();
            let with_bias = y32.to_vec().unwrap();
            let mut worst_b = 0f64;
            for i in 0..m {
                for j in 0..n {
                    let want = got[i * n + j] as f64 + bias_host[j] as f64;
                    let e = (with_bias[i * n + j] as f64 - want).abs() / want.abs().max(0.05);
                    worst_b = worst_b.max(e);
                }
            }
            assert!(worst_b < 1e-2, "f32 result with a bf16 bias: {worst_b}");
        }
        // What the product cannot take is refused, naming it.
        let b = DeviceBuffer::<u8>::zeros(&device, 64 * 64).unwrap();
        let y = DeviceBuffer::<half::bf16>::zeros(&device, 64 * 64).unwrap();
        let bad = LtGemm::plain(
            64,
            64,
            64,
            Mat::of(&b, 64),
            Mat::of(&b, 64),
            Mat::of(&y, 64),
        );
        let sc = Scaled {
            a: Fp8::E4M3,
            b: Fp8::E4M3,
            a_scale: y.dptr(),
            b_scale: y.dptr(),
            fast_accum: false,
        };
        let e = lt.gemm_scaled(&s, &bad, &sc).unwrap_err().to_string();
        assert!(e.contains("transposed"), "{e}");
    }

    /// Milliseconds per run of `f`: the planner's timing (the best of a
    /// few rounds of 5 runs, after a warm-up).
    fn time_ms(s: &braid_cuda::Stream, f: impl FnMut() -> braid_cuda::Result<()>) -> f64 {
        crate::cuda::rates::timed(s, 5, f).unwrap() * 1e3
    }

    /// A measurement, not a check (`--ignored`): a GPT layer's products at
    /// 8192 tokens (2.65B's width 2560 and 1558M's 1600), each pass's
    /// product in bf16 (cuBLASLt, timed offers) against FP8 (forward e4m3 ×
    /// e4m3 with fast accumulation, the gradients' e5m2 × e4m3 and
    /// e4m3 × e5m2), and the casts each FP8 product needs (amax and cast,
    /// as stored or transposed); the layer's totals, TFLOP/s, and what FP8
    /// would save a step.
    #[test]
    #[ignore = "a measurement on a GPU: run by name"]
    fn fp8_products_timed() {
        use super::{Fp8Kernels, Fp8Tensor, Scaling};
        use braid_cuda::blas::Mat;
        use braid_cuda::blaslt::{BlasLt, LtGemm, Scaled, Tuning};
        use braid_cuda::{DeviceBuffer, DeviceMem, Stream};
        let Some(device) = fp8_gpu() else { return };
        let fk = Fp8Kernels::load(&device).unwrap();
        let s = Stream::new(&device).unwrap();
        let mut lt = BlasLt::new(&device).unwrap();
        lt.set_tuning(Tuning::Timed);
        let mut r = crate::rng::Rng::new(5);
        let tokens = 8192;
        for (name, width, layers) in [("2.65B", 2560usize, 32usize), ("1558M", 1600, 48)] {
            let (mut bf_total, mut f8_total, mut cast_total, mut flops) = (0.0, 0.0, 0.0, 0.0);
            let mut delayed_total = 0.0;
            for (inp, out) in [
                (width, 3 * width),
                (width, width),
                (width, 4 * width),
                (4 * width, width),
            ] {
                let x =
                    DeviceBuffer::from_host(&device, &randn(&mut r, tokens * inp, 1.0)).unwrap();
                let w = DeviceBuffer::from_host(&device, &randn(&mut r, inp * out, 0.02)).unwrap();
                let dy =
                    DeviceBuffer::from_host(&device, &randn(&mut r, tokens * out, 0.01)).unwrap();
                let y = DeviceBuffer::<half::bf16>::zeros(&device, tokens * out).unwrap();
                let dx = DeviceBuffer::<half::bf16>::zeros(&device, tokens * inp).unwrap();
                let dw = DeviceBuffer::<f32>::zeros(&device, inp * out).unwrap();
                let plain = LtGemm::plain;
                // bf16: y = x·w, dx = dy·wᵀ, dw = xᵀ·dy (f32, as the engine keeps it).
                let bf = [
                    plain(
                        tokens,
                        out,
                        inp,
                        Mat::of(&x, inp),
                        Mat::of(&w, out),
                        Mat::of(&y, out),
                    ),
                    plain(
                        tokens,
                        inp,
                        out,
                        Mat::of(&dy, out),
                        Mat::of(&w, out).t(),
                        Mat::of(&dx, inp),
                    ),
                    plain(
                        inp,
                        out,
                        tokens,
                        Mat::of(&x, inp).t(),
                        Mat::of(&dy, out),
                        Mat::of(&dw, out),
                    ),
                ];
                let bf_ms: Vec<f64> = bf.iter().map(|g| time_ms(&s, || lt.gemm(&s, g))).collect();
                // FP8 operands, each stored along its product's shared
                // dimension; each cast timed scaled by its own amax measured
                // first (dynamic) and by the amax it had before (delayed,
                // here the same, so no cast again).
                let mut delayed = [0.0; 6];
                let mut turn = 0;
                let mut q = |rows, cols, t, f, src: &DeviceBuffer<half::bf16>| {
                    let mut q = Fp8Tensor::new(&device, rows * cols).unwrap();
                    let ms = time_ms(&s, || {
                        fk.quantize(
                            &s,
                            &mut q.bytes,
                            &mut q.deq,
                            &mut q.amax,
                            src,
                            (rows, cols),
                            t,
                            f,
                        )
                    });
                    let hist = DeviceBuffer::from_host(&device, &q.amax.to_vec().unwrap()).unwrap();
                    let next = DeviceBuffer::<f32>::zeros(&device, 1).unwrap();
                    let mut q2 = Fp8Tensor::new(&device, rows * cols).unwrap();
                    let scaling = Scaling::Delayed {
                        hist: hist.dptr(),
                        next: next.dptr(),
                    };
                    delayed[turn] = time_ms(&s, || {
                        // SAFETY: hist and next hold one live f32 each.
                        unsafe { fk.quantize_scaled(&s, &mut q2, src, (rows, cols), t, f, scaling) }
                    });
                    turn += 1;
                    (q, ms)
                };
                let (x8, c1) = q(tokens, inp, false, Fp8::E4M3, &x);
                let (wt8, c2) = q(inp, out, true, Fp8::E4M3, &w); // [out, in]
                let (w8, c3) = q(inp, out, false, Fp8::E4M3, &w); // [in, out]
                let (dy8, c4) = q(tokens, out, false, Fp8::E5M2, &dy);
                let (xt8, c5) = q(tokens, inp, true, Fp8::E4M3, &x); // [in, tokens]
                let (dyt8, c6) = q(tokens, out, true, Fp8::E5M2, &dy); // [out, tokens]
                let sc = |a: &Fp8Tensor, fa, b: &Fp8Tensor, fb, fast| Scaled {
                    a: fa,
                    b: fb,
                    a_scale: a.deq.dptr(),
                    b_scale: b.deq.dptr(),
                    fast_accum: fast,
                };
                let f8 = [
                    (
                        plain(
                            tokens,
                            out,
                            inp,
                            Mat::of(&x8.bytes, inp),
                            Mat::of(&wt8.bytes, inp).t(),
                            Mat::of(&y, out),
                        ),
                        sc(&x8, Fp8::E4M3, &wt8, Fp8::E4M3, true),
                    ),
                    (
                        plain(
                            tokens,
                            inp,
                            out,
                            Mat::of(&dy8.bytes, out),
                            Mat::of(&w8.bytes, out).t(),
                            Mat::of(&dx, inp),
                        ),
                        sc(&dy8, Fp8::E5M2, &w8, Fp8::E4M3, false),
                    ),
                    (
                        plain(
                            inp,
                            out,
                            tokens,
                            Mat::of(&xt8.bytes, tokens),
                            Mat::of(&dyt8.bytes, tokens).t(),
                            Mat::of(&dw, out),
                        ),
                        sc(&xt8, Fp8::E4M3, &dyt8, Fp8::E5M2, false),
                    ),
                ];
                let f8_ms: Vec<f64> = f8
                    .iter()
                    .map(|(g, x)| time_ms(&s, || lt.gemm_scaled(&s, g, x)))
                    .collect();
                let casts = c1 + c2 + c3 + c4 + c5 + c6;
                let delayed_casts: f64 = delayed.iter().sum();
                eprintln!(
                    "{name} {inp}->{out} casts: dynamic as stored {:.3} ms, transposed {:.3} ms; \
                     delayed as stored {:.3} ms, transposed {:.3} ms",
                    c1 + c3 + c4,
                    c2 + c5 + c6,
                    delayed[0] + delayed[2] + delayed[3],
                    delayed[1] + delayed[4] + delayed[5]
                );
                delayed_total += delayed_casts;
                let fl = 2.0 * (tokens * inp * out) as f64;
                eprintln!(
                    "{name} {inp}->{out}: bf16 fwd/dx/dw {:.3}/{:.3}/{:.3} ms, fp8 {:.3}/{:.3}/{:.3} ms \
                     ({:.0} against {:.0} TFLOP/s), casts {casts:.3} ms",
                    bf_ms[0],
                    bf_ms[1],
                    bf_ms[2],
                    f8_ms[0],
                    f8_ms[1],
                    f8_ms[2],
                    3.0 * fl / f8_ms.iter().sum::<f64>() / 1e9,
                    3.0 * fl / bf_ms.iter().sum::<f64>() / 1e9,
                );
                bf_total += bf_ms.iter().sum::<f64>();
                f8_total += f8_ms.iter().sum::<f64>();
                cast_total += casts;
                flops += 3.0 * fl;
            }
            eprintln!(
                "{name} a layer's products: bf16 {bf_total:.3} ms, fp8 {f8_total:.3} + casts \
                 {cast_total:.3} ms ({:.2}x); {layers} layers save {:.1} ms a step ({:.0} TFLOP/s \
                 in bf16)",
                bf_total / (f8_total + cast_total),
                layers as f64 * (bf_total - f8_total - cast_total),
                flops / bf_total / 1e9
            );
            eprintln!(
                "{name} with delayed scaling: fp8 {f8_total:.3} + casts {delayed_total:.3} ms \
                 ({:.2}x); {layers} layers save {:.1} ms a step",
                bf_total / (f8_total + delayed_total),
                layers as f64 * (bf_total - f8_total - delayed_total),
            );
        }
    }
}
