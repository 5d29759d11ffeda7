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
//!
//! Its two rooms (the largest operand of each side: at 2.65B and 8,192
//! tokens about 84 MB each) count in `braid train`'s pre-flight as a part
//! of their own, "FP8 operands" ([`Fp8Use::room_bytes`]).

use super::fp8_sites::{Fp8Sites, SiteKey, Slot};
use super::products::Product;
use crate::cuda::fp8::Scaling;
use crate::cuda::fp8::{Fp8Kernels, Fp8Tensor};
use braid_core::DType;
use braid_cuda::blas::Mat;
use braid_cuda::blaslt::{scaled_bias_type, BlasLt, Epilogue, Fp8, LtGemm, Scaled};
use braid_cuda::{CudaError, Device, DeviceBuffer, DeviceMem, Result, Stream};

/// `BRAID_FP8_SCALING`: `dynamic` (the default: each operand's own amax,
/// measured first) or `delayed` (the amax it had the last step; see
/// `fp8_sites`). `true` for delayed.
fn scaling_from_env() -> Result<bool> {
    scaling_of(
        std::env::var(braid_core::env::BRAID_FP8_SCALING)
            .ok()
            .as_deref(),
    )
}

fn scaling_of(v: Option<&str>) -> Result<bool> {
    match v.map(str::trim) {
        None | Some("" | "dynamic") => Ok(false),
        Some("delayed") => Ok(true),
        Some(other) => Err(CudaError::Invalid(format!(
            "BRAID_FP8_SCALING={other:?}: expected dynamic (the default) or delayed"
        ))),
    }
}

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
    /// What a run uses: `BRAID_FP8`'s value, or where it is unset every
    /// product under `--precision fp8` (`fp8_precision`) and none else.
    pub fn of_run(fp8_precision: bool) -> std::result::Result<Fp8Use, String> {
        let var = braid_core::env::BRAID_FP8;
        match std::env::var(var) {
            Ok(v) => Fp8Use::parse(&v).map_err(|why| format!("{var}={v}: {why}")),
            Err(_) if fp8_precision => Ok(Fp8Use::All),
            Err(_) => Ok(Fp8Use::Off),
        }
    }

    /// Device bytes the FP8 products hold beside the model's own (not in
    /// `footprint::gpu_training`): the two operand rooms, each as large as
    /// the largest operand a product quantises — `tokens` rows of the
    /// widest output, `widest` (the MLP's width, a tensor group's share):
    /// an input gradient's `dy` and a weight gradient's `dyᵀ`, or in the
    /// forward pass the MLP projection's input — and where the backward
    /// pass's products run in FP8 (not under tensor parallelism,
    /// `tensor_parallel`) a third (`dy` transposed, kept from the input
    /// gradient for the weight gradient); the f32 bias's bf16 copy and
    /// delayed scaling's two arrays of amaxes.
    pub fn room_bytes(self, tokens: usize, widest: usize, tensor_parallel: bool) -> u128 {
        let rooms = match self {
            Fp8Use::Off => return 0,
            Fp8Use::All if !tensor_parallel => 3,
            _ => 2,
        };
        let room = tokens as u128 * widest as u128;
        rooms * room + 2 * widest as u128 + 2 * 4 * super::fp8_sites::CAPACITY as u128
    }

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
    /// An input gradient's `dy` transposed, cast beside it as stored (one
    /// read of `dy`) for the weight gradient of the same product that
    /// follows ([`Fp8Products::input_grad`]).
    dy_t: Room,
    /// Which `dy` the `dy_t` room holds the codes of.
    dy_t_of: KeptDy,
    /// Epilogues cuBLASLt had no FP8 product for, by [`Epilogue::kind`]
    /// and result type ([`Fp8Products::slot`]): an f32 result's bias is
    /// f32, a bf16 one's bf16, and either may be refused alone.
    pub(super) off: [bool; 8],
    /// The backward pass's products too.
    pub(super) backward: bool,
    /// cuBLASLt had no FP8 product for a gradient's shape (noted once).
    backward_off: bool,
    /// Delayed scaling's sites (`BRAID_FP8_SCALING=delayed`), else `None`:
    /// every operand scaled by its own amax, measured first.
    sites: Option<Fp8Sites>,
    /// The bf16 copy of an f32 result's bias ([`Fp8Products::bias_for`]).
    bias: Option<DeviceBuffer<half::bf16>>,
    /// `BRAID_FP8_TRACE=N`: the first N products each said with their
    /// operands' scales and whether the result is finite (a diagnosis:
    /// every product waits for the GPU).
    trace: Option<usize>,
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
            dy_t: room(),
            dy_t_of: KeptDy::default(),
            off: [false; 8],
            backward,
            backward_off: false,
            bias: None,
            sites: match scaling_from_env()? {
                true => Some(Fp8Sites::new()),
                false => None,
            },
            trace: std::env::var(braid_core::env::BRAID_FP8_TRACE)
                .ok()
                .and_then(|v| v.trim().parse().ok()),
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
        let beta = if residual.is_some() { 1.0 } else { 0.0 };
        let epilogue = self.bias_for(s, epilogue, &d)?;
        self.dy_t_of.forget();
        // (The weights `[k, n]` go in stored `[n, k]`.)
        self.scaled(
            lt,
            s,
            (m, n, k),
            Codes::Cast(Operand::new(&p.a, (m, k), false, Fp8::E4M3)),
            Codes::Cast(Operand::new(&p.b, (k, n), true, Fp8::E4M3)),
            (residual.unwrap_or(d), d, epilogue, beta),
            true,
        )
    }

    /// `epilogue` with its bias in the type the FP8 product takes
    /// ([`scaled_bias_type`]): an f32 result's f32 bias copied to bf16 in
    /// the bias room first (the model's f32 biases are only zero at
    /// initialisation; read as bf16 they are garbage after the first step).
    fn bias_for(&mut self, s: &Stream, epilogue: Epilogue, d: &Mat) -> Result<Epilogue> {
        if scaled_bias_type(d.dtype()) == d.dtype() {
            return Ok(epilogue);
        }
        let bias = match epilogue {
            Epilogue::Bias { bias } | Epilogue::GeluAuxBias { bias, .. } => bias,
            Epilogue::Plain | Epilogue::DGeluBGrad { .. } => return Ok(epilogue),
        };
        if self.bias.as_ref().is_none_or(|b| b.len() < bias.1) {
            s.synchronize()?;
            self.bias = None;
            self.bias = Some(DeviceBuffer::zeros(&self.input.device, bias.1)?);
        }
        let room = self.bias.as_mut().expect("made above");
        // SAFETY: `bias` is the epilogue's f32 vector of `bias.1` values
        // (a view of the model's parameters, unwritten until this product,
        // queued after the copy on the same stream, has run).
        unsafe { self.kernels.bias_to_bf16_at(s, room, bias)? };
        let bf = (room.device_ptr(), room.len());
        Ok(match epilogue {
            Epilogue::Bias { .. } => Epilogue::Bias { bias: bf },
            Epilogue::GeluAuxBias { aux, aux_ld, .. } => Epilogue::GeluAuxBias {
                bias: bf,
                aux,
                aux_ld,
            },
            other => other,
        })
    }

    /// A new pass (forward, then its backward) begins: delayed scaling's
    /// sites count from the first again.
    pub(super) fn begin_pass(&mut self) {
        self.dy_t_of.forget();
        if let Some(sites) = self.sites.as_mut() {
            sites.begin_pass();
        }
    }

    /// How `x` is scaled, and where its measured amax is kept (see
    /// [`Fp8Sites::next`]).
    fn scaling(&mut self, x: &Operand) -> Result<(Scaling, Option<Slot>)> {
        let Some(sites) = self.sites.as_mut() else {
            return Ok((Scaling::Dynamic, None));
        };
        let key = SiteKey {
            at: x.at,
            shape: x.shape,
            transposed: x.transposed,
            fmt: x.fmt,
        };
        sites.next(&self.input.device, key)
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
        self.dy_t_of.forget();
        if !self.backward_on() || !fits {
            return Ok(false);
        }
        let dy_codes = Operand::new(&dy, (n, out), false, Fp8::E5M2);
        let a = match Fp8Kernels::casts_both(dy_codes.at.0, (n, out)) {
            // `dy` as stored for this product and transposed for the
            // weight gradient that follows, from one read.
            true => {
                self.quantize_both(s, &dy_codes)?;
                self.dy_t_of.keep(dy_codes.at, (n, out));
                Codes::Kept(Side::Input, Fp8::E5M2)
            }
            false => Codes::Cast(dy_codes),
        };
        let ran = self.scaled(
            lt,
            s,
            (n, inp, out),
            a,
            Codes::Cast(Operand::new(&w, (inp, out), false, Fp8::E4M3)),
            (dx, dx, Epilogue::Plain, 0.0),
            false,
        );
        self.gradient(ran, (n, inp, out))
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
        // The input gradient's `dy` transposed, where it kept this one's.
        let kept = self.dy_t_of.take(dy.storage(), (n, out));
        if !self.backward_on() || !fits {
            return Ok(false);
        }
        let b = match kept {
            true => Codes::Kept(Side::DyT, Fp8::E5M2),
            false => Codes::Cast(Operand::new(&dy, (n, out), true, Fp8::E5M2)),
        };
        let ran = self.scaled(
            lt,
            s,
            (inp, out, n),
            Codes::Cast(Operand::new(&x, (n, inp), true, Fp8::E4M3)),
            b,
            (dw, dw, Epilogue::Plain, beta),
            false,
        );
        self.gradient(ran, (inp, out, n))
    }

    /// The one scaled product all three run: `a` quantised into the input
    /// room (as `[m, k]`), `b` into the weight room (as `[n, k]`) — or
    /// either already there, or in the `dy_t` room ([`Codes::Kept`]) —
    /// then `d = a · b + beta · c` with `epilogue` (fast accumulation
    /// where `fast`).
    #[allow(clippy::too_many_arguments)]
    fn scaled(
        &mut self,
        lt: &mut BlasLt,
        s: &Stream,
        (m, n, k): (usize, usize, usize),
        a: Codes,
        b: Codes,
        (c, d, epilogue, beta): (Mat, Mat, Epilogue, f32),
        fast: bool,
    ) -> Result<()> {
        let (a_side, a_fmt) = self.codes(s, a, m * k, Side::Input)?;
        let (b_side, b_fmt) = self.codes(s, b, n * k, Side::Weight)?;
        let traced = match self.trace.as_mut() {
            Some(left) if *left > 0 => {
                *left -= 1;
                true
            }
            _ => false,
        };
        let (qa, qb) = (self.held(a_side)?, self.held(b_side)?);
        let g = LtGemm {
            m,
            n,
            k,
            a: Mat::of(&qa.bytes, k),
            b: Mat::of(&qb.bytes, k).t(),
            c,
            d,
            epilogue,
            alpha: 1.0,
            beta,
        };
        let scaled = Scaled {
            a: a_fmt,
            b: b_fmt,
            a_scale: qa.deq.dptr(),
            b_scale: qb.deq.dptr(),
            fast_accum: fast,
        };
        lt.gemm_scaled(s, &g, &scaled)?;
        if traced {
            trace(s, (m, n, k), &epilogue, [qa, qb], &d)?;
        }
        Ok(())
    }

    /// Where an operand's codes are for the product (`n` values): cast
    /// now into the room of `side` ([`Codes::Cast`]), or kept; and their
    /// format.
    fn codes(&mut self, s: &Stream, x: Codes, n: usize, side: Side) -> Result<(Side, Fp8)> {
        match x {
            Codes::Cast(x) => {
                self.quantize(s, &x, n, side)?;
                Ok((side, x.fmt))
            }
            Codes::Kept(at, fmt) => Ok((at, fmt)),
        }
    }

    /// The codes held in the room of `side`.
    fn held(&self, side: Side) -> Result<&Fp8Tensor> {
        let room = match side {
            Side::Input => &self.input,
            Side::Weight => &self.weight,
            Side::DyT => &self.dy_t,
        };
        room.held.as_ref().ok_or_else(|| {
            CudaError::Invalid(format!("an FP8 product's {side:?} codes were never cast"))
        })
    }

    /// `x` (`n` values) quantised into the room of `side`, scaled as
    /// [`Fp8Products::scaling`] says, its measured amax kept where delayed
    /// scaling asks for it.
    fn quantize(&mut self, s: &Stream, x: &Operand, n: usize, side: Side) -> Result<()> {
        let (scaling, keep) = self.scaling(x)?;
        let Fp8Products {
            kernels,
            input,
            weight,
            dy_t,
            sites,
            ..
        } = self;
        let room = match side {
            Side::Input => input,
            Side::Weight => weight,
            Side::DyT => dy_t,
        };
        let q = room.at_least(s, n)?;
        // SAFETY: the products' operands are views of the model's live
        // buffers, unwritten until the product that reads them (queued
        // after these casts on the same stream) has run; the scaling's
        // addresses are the sites' own arrays.
        unsafe { kernels.quantize_bf16_at(s, q, x.at, x.shape, x.transposed, x.fmt, scaling)? };
        if let (Some(to), Some(sites)) = (keep, sites.as_mut()) {
            sites.keep(s, &q.amax, to)?;
        }
        Ok(())
    }

    /// `x` (as stored, `[rows, cols]`) quantised in one pass into the
    /// input room as stored and into the `dy_t` room transposed, scaled
    /// (one amax for both) as [`Fp8Products::scaling`] says for `x`.
    fn quantize_both(&mut self, s: &Stream, x: &Operand) -> Result<()> {
        let (scaling, keep) = self.scaling(x)?;
        let n = x.shape.0 * x.shape.1;
        let Fp8Products {
            kernels,
            input,
            dy_t,
            sites,
            ..
        } = self;
        let stored = input.at_least(s, n)?;
        let to = dy_t.at_least(s, n)?;
        // SAFETY: as in `quantize`: `x` views a live buffer of the model,
        // unwritten until the products that read its codes have run.
        unsafe { kernels.quantize_bf16_both_at(s, to, stored, x.at, x.shape, x.fmt, scaling)? };
        if let (Some(slot), Some(sites)) = (keep, sites.as_mut()) {
            sites.keep(s, &to.amax, slot)?;
        }
        Ok(())
    }

    /// A gradient's product's outcome: `true`, or `false` (noted, the
    /// backward pass in bf16 from then on) where cuBLASLt has none.
    fn gradient(&mut self, ran: Result<()>, (m, n, k): (usize, usize, usize)) -> Result<bool> {
        match ran {
            Ok(()) => Ok(true),
            Err(e) if !super::products::cublaslt_declined(&e) => Err(e),
            Err(e) => {
                eprintln!(
                    "note: cuBLASLt has no FP8 product for a gradient of {m}x{n}x{k} here ({e}); \
                     the backward pass runs in bf16"
                );
                self.backward_off = true;
                Ok(false)
            }
        }
    }
}

/// The `dy` whose transposed codes an input gradient kept for the weight
/// gradient of the same product: its storage (`(address, elements)`) and
/// shape, until the weight gradient takes them or any other product runs
/// (which forgets them: another product's casts may reuse the room, and
/// a `dy` at the same address may since have been written).
#[derive(Debug, Default)]
struct KeptDy(Option<((u64, usize), (usize, usize))>);

impl KeptDy {
    fn keep(&mut self, at: (u64, usize), shape: (usize, usize)) {
        self.0 = Some((at, shape));
    }

    fn forget(&mut self) {
        self.0 = None;
    }

    /// Whether the kept codes are those of `dy` at `at` of `shape`; they
    /// are forgotten either way (a weight gradient takes them once).
    fn take(&mut self, at: (u64, usize), shape: (usize, usize)) -> bool {
        self.0.take() == Some((at, shape))
    }
}

/// The rooms a scaled product's operands are cast into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    /// The product's first operand (`[m, k]`).
    Input,
    /// Its second (`[n, k]`).
    Weight,
    /// An input gradient's `dy` transposed, for the weight gradient.
    DyT,
}

/// A scaled product's operand: cast now, or codes already in a room (of
/// this format).
enum Codes {
    Cast(Operand),
    Kept(Side, Fp8),
}

/// One bf16 operand of a scaled product: where it is (`(address,
/// elements)`), its shape as stored, whether it goes in transposed, and
/// its format.
struct Operand {
    at: (u64, usize),
    shape: (usize, usize),
    transposed: bool,
    fmt: Fp8,
}

impl Operand {
    fn new(m: &Mat, shape: (usize, usize), transposed: bool, fmt: Fp8) -> Operand {
        Operand {
            at: m.storage(),
            shape,
            transposed,
            fmt,
        }
    }
}

/// Whether `m` holds `dtype` stored whole, `ld` elements a row.
fn stored(m: &Mat, ld: usize, dtype: DType) -> bool {
    m.dtype() == dtype && m.plain() && m.ld() == ld
}

/// One product of `BRAID_FP8_TRACE`: its shape and epilogue, each
/// operand's amax and dequantising scale, and the result's largest
/// magnitude and count of values that are not finite (read back after
/// the GPU has run it).
fn trace(
    s: &Stream,
    (m, n, k): (usize, usize, usize),
    epilogue: &Epilogue,
    [qa, qb]: [&Fp8Tensor; 2],
    d: &Mat,
) -> Result<()> {
    let one = |b: &braid_cuda::DeviceBuffer<f32>| -> Result<f32> { Ok(b.to_vec()?[0]) };
    let (ptr, len) = d.storage();
    let count = (m * d.ld()).min(len);
    let values: Vec<f32> = match d.dtype() {
        DType::F32 => {
            let mut v = vec![0f32; count];
            // SAFETY: `d` views `len` live elements from `ptr` (a Mat of a
            // device buffer); `count` is at most that.
            unsafe { braid_cuda::memory::copy_raw_to_host(ptr, &mut v, s)? };
            v
        }
        _ => {
            let mut v = vec![half::bf16::ZERO; count];
            // SAFETY: as above, bf16 elements.
            unsafe { braid_cuda::memory::copy_raw_to_host(ptr, &mut v, s)? };
            v.iter().map(|x| x.to_f32()).collect()
        }
    };
    let bad = values.iter().filter(|x| !x.is_finite()).count();
    let big = values
        .iter()
        .filter(|x| x.is_finite())
        .fold(0f32, |a, x| a.max(x.abs()));
    eprintln!(
        "fp8 trace: {m}x{n}x{k} {}: a amax {:.4e} deq {:.4e} | b amax {:.4e} deq {:.4e} | out \
         max {big:.4e}, {bad} of {count} not finite",
        epilogue.name(),
        one(&qa.amax)?,
        one(&qa.deq)?,
        one(&qb.amax)?,
        one(&qb.deq)?,
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kept_dy_serves_one_weight_gradient_of_the_same_tensor_only() {
        let (at, shape) = ((0x1000, 4096), (64, 64));
        let mut kept = KeptDy::default();
        assert!(!kept.take(at, shape), "nothing kept yet");
        kept.keep(at, shape);
        assert!(!kept.take((0x2000, 4096), shape), "another tensor");
        assert!(!kept.take(at, shape), "a miss forgets");
        kept.keep(at, shape);
        assert!(!kept.take(at, (32, 128)), "the same bytes in another shape");
        kept.keep(at, shape);
        assert!(kept.take(at, shape));
        assert!(!kept.take(at, shape), "taken once");
        kept.keep(at, shape);
        kept.forget();
        assert!(!kept.take(at, shape), "another product ran between");
    }

    #[test]
    fn the_scaling_is_named_or_refused_naming_the_choices() {
        assert!(!scaling_of(None).unwrap());
        assert!(!scaling_of(Some("dynamic")).unwrap());
        assert!(scaling_of(Some(" delayed ")).unwrap());
        let e = scaling_of(Some("late")).unwrap_err().to_string();
        assert!(
            e.contains("BRAID_FP8_SCALING") && e.contains("delayed"),
            "{e}"
        );
    }
}
