//! Matrix products with fused epilogues through cuBLASLt (loaded at run
//! time), in the same row-major terms as [`crate::blas::Blas::gemm_ex`]:
//! `d[m,n] = alpha · a[m,k] · b[k,n] + beta · c`, bf16 or f32 operands,
//! f32 accumulation, then one of the [`Epilogue`]s: a bias broadcast over
//! rows, bias + GELU (tanh form) keeping the pre-activation, or the GELU
//! backward with the bias gradient. `c` may be a different buffer from `d`
//! (a residual input), which saves the pass that would otherwise copy it.
//!
//! Each distinct shape gets a plan (descriptors and an algorithm, given the
//! operands' actual alignment), made on first use and kept. The algorithm
//! is cuBLASLt's heuristic's first offer, or with [`Tuning::Timed`] the
//! fastest of its offers that compute the same bits (see [`Tuning`]).

use crate::blas::Mat;
use crate::driver::{Device, Event, Stream};
use crate::error::{CudaError, Result};
use crate::memory::{DeviceBuffer, DeviceMem};
use braid_core::DType;
use cudarc::cublaslt::{result, sys};
use std::collections::HashMap;
use std::ffi::c_void;

/// Workspace handed to cuBLASLt for split-k and similar algorithms.
const WORKSPACE: usize = 32 << 20;

/// Offers asked of the heuristic when tuning (it rarely gives more).
const TUNE_OFFERS: usize = 8;
/// Rounds over the offers, and timed runs of each per round (the best
/// round counts: the first runs after a pause are slower).
const TUNE_ROUNDS: usize = 3;
const TUNE_RUNS: usize = 2;
/// A later offer replaces the first only when this much faster (timings of
/// one product vary by a few percent from run to run).
const TUNE_MARGIN: f32 = 0.97;

/// How [`BlasLt`] picks each shape's algorithm.
///
/// On an H200 with cuBLAS 13 the heuristic's first offer was up to 22 %
/// slower than a later one (the attention projection's f32-output product
/// at 8192 x 2560 x 2560: 0.205 against 0.160 ms), so by default the
/// offers are timed on first use. Only offers of the first one's kernel
/// family without split-K are timed; each of those computes every element
/// in the same order, and on that H200 all of them gave the same bits for
/// every product of a GPT block (a GPU test checks this), so tuning
/// changes the speed and not the result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tuning {
    /// The heuristic's first offer.
    Heuristic,
    /// The fastest offer, timed on first use.
    Timed,
    /// As `Timed`, printing each choice to stderr.
    TimedVerbose,
}

impl Tuning {
    /// `BRAID_GEMM_TUNE`: `off`, `on` (the default) or `verbose`.
    pub fn from_env() -> Result<Tuning> {
        match std::env::var(braid_core::env::BRAID_GEMM_TUNE).as_deref() {
            Err(_) | Ok("on") | Ok("1") => Ok(Tuning::Timed),
            Ok("off") | Ok("0") => Ok(Tuning::Heuristic),
            Ok("verbose") => Ok(Tuning::TimedVerbose),
            Ok(other) => Err(CudaError::Invalid(format!(
                "BRAID_GEMM_TUNE={other}: expected on, off or verbose"
            ))),
        }
    }
}

/// What happens to the product before it is stored. Vectors are
/// `(device address, elements)`; `aux` is a matrix of `d`'s type and
/// shape with `aux_ld` elements per row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Epilogue {
    /// `d = product` (plus `beta · c`), nothing else.
    Plain,
    /// `d = product + bias[n]` (bias of `d`'s type; a scaled FP8
    /// product's of [`scaled_bias_type`]).
    Bias { bias: (u64, usize) },
    /// `aux = product + bias[n]`, `d = gelu(aux)` (bias as for `Bias`).
    GeluAuxBias {
        bias: (u64, usize),
        aux: (u64, usize),
        aux_ld: usize,
    },
    /// `d = product · gelu'(aux)`, and `bgrad[n]` (of `d`'s type) = the
    /// column sums of `d` (overwritten). Correct, but on an H200 with
    /// cuBLAS 13 it ran 2.4× slower than the plain product plus separate
    /// GELU-backward and bias-gradient passes, so the GPT engine does not
    /// use it.
    DGeluBGrad {
        aux: (u64, usize),
        aux_ld: usize,
        bgrad: (u64, usize),
    },
}

impl Epilogue {
    /// 0, 1, 2, 3 for `Bias`, `GeluAuxBias`, `DGeluBGrad`, `Plain`.
    pub fn kind(&self) -> u8 {
        match self {
            Epilogue::Plain => 3,
            Epilogue::Bias { .. } => 0,
            Epilogue::GeluAuxBias { .. } => 1,
            Epilogue::DGeluBGrad { .. } => 2,
        }
    }

    /// A short name for messages.
    pub fn name(&self) -> &'static str {
        match self {
            Epilogue::Plain => "plain",
            Epilogue::Bias { .. } => "bias",
            Epilogue::GeluAuxBias { .. } => "bias+gelu",
            Epilogue::DGeluBGrad { .. } => "dgelu+bgrad",
        }
    }

    fn aux_ld(&self) -> usize {
        match *self {
            Epilogue::Plain | Epilogue::Bias { .. } => 0,
            Epilogue::GeluAuxBias { aux_ld, .. } | Epilogue::DGeluBGrad { aux_ld, .. } => aux_ld,
        }
    }
}

/// One fused product; see the module docs.
#[derive(Debug, Clone, Copy)]
pub struct LtGemm {
    /// Rows of the result.
    pub m: usize,
    /// Columns of the result.
    pub n: usize,
    /// The shared dimension.
    pub k: usize,
    /// `[m,k]` (stored `[k,m]` when transposed).
    pub a: Mat,
    /// `[k,n]` (stored `[n,k]` when transposed); same type as `a`.
    pub b: Mat,
    /// The addend scaled by `beta` (same type and shape as `d`).
    pub c: Mat,
    /// The result.
    pub d: Mat,
    /// What is applied before storing.
    pub epilogue: Epilogue,
    pub alpha: f32,
    pub beta: f32,
}

impl LtGemm {
    /// `d = a · b` and nothing else (`m × k` by `k × n`): no epilogue,
    /// `alpha` 1, `beta` 0 (`c` is `d`, unread).
    pub fn plain(m: usize, n: usize, k: usize, a: Mat, b: Mat, d: Mat) -> LtGemm {
        LtGemm {
            m,
            n,
            k,
            a,
            b,
            c: d,
            d,
            epilogue: Epilogue::Plain,
            alpha: 1.0,
            beta: 0.0,
        }
    }
}

/// An FP8 format (OCP's): e4m3 (3 mantissa bits, finite up to ±448) or
/// e5m2 (2 bits, up to ±57344).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fp8 {
    E4M3,
    E5M2,
}

impl Fp8 {
    /// The largest finite value.
    pub fn max(self) -> f32 {
        match self {
            Fp8::E4M3 => 448.0,
            Fp8::E5M2 => 57344.0,
        }
    }

    /// `e4m3` or `e5m2`.
    pub fn name(self) -> &'static str {
        match self {
            Fp8::E4M3 => "e4m3",
            Fp8::E5M2 => "e5m2",
        }
    }

    fn lt(self) -> sys::cudaDataType {
        match self {
            Fp8::E4M3 => sys::cudaDataType::CUDA_R_8F_E4M3,
            Fp8::E5M2 => sys::cudaDataType::CUDA_R_8F_E5M2,
        }
    }
}

/// The type of a scaled FP8 product's bias ([`Epilogue::Bias`],
/// [`Epilogue::GeluAuxBias`]) for a result of type `d`: bf16 where the
/// result is f32 (cuBLASLt's FP8 kernels take no f32 bias), else `d`'s own.
pub fn scaled_bias_type(d: DType) -> DType {
    match d {
        DType::F32 => DType::BF16,
        other => other,
    }
}

/// What makes an [`LtGemm`] a scaled FP8 product ([`BlasLt::gemm_scaled`]):
/// its `a` and `b` hold FP8 bytes (`Mat`s of `u8`) in these formats (not
/// both e5m2), each to be multiplied by the f32 at its device address
/// (the dequantising scale: the tensor's amax over the format's largest
/// value); `fast_accum`: Hopper's faster, less exact accumulation (fine
/// for a forward pass, not for gradients, as torchao uses it).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scaled {
    pub a: Fp8,
    pub b: Fp8,
    pub a_scale: u64,
    pub b_scale: u64,
    pub fast_accum: bool,
}

#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct Key {
    mnk: (usize, usize, usize),
    ab: (DType, bool, bool, usize, usize),
    cd: (DType, usize, usize),
    epilogue: (u8, usize),
    align: [u32; 5],
    /// A scaled product's formats (of `a`, of `b`) and fast accumulation.
    fp8: Option<(Fp8, Fp8, bool)>,
}

/// Descriptors and algorithm for one shape.
struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    layouts: [sys::cublasLtMatrixLayout_t; 4],
    algo: sys::cublasLtMatmulAlgo_t,
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: created in `BlasLt::plan`, destroyed once.
        unsafe {
            let _ = result::destroy_matmul_desc(self.desc);
            for l in self.layouts {
                let _ = result::destroy_matrix_layout(l);
            }
        }
    }
}

/// A cuBLASLt handle bound to one device, with its workspace and plans.
pub struct BlasLt {
    handle: sys::cublasLtHandle_t,
    device: Device,
    workspace: DeviceBuffer<u8>,
    plans: HashMap<Key, Plan>,
    tuning: Tuning,
    /// With [`BlasLt::share_across_rows`]: the algorithm found for each
    /// bucket of row counts ([`row_bucket`]), reused by the other counts
    /// of its bucket after cuBLASLt's check instead of a new search.
    by_rows: Option<HashMap<Key, sys::cublasLtMatmulAlgo_t>>,
    /// With [`BlasLt::time_any_offer_up_to`]: products of at most this many
    /// rows time every offer, split-K included (0: none).
    any_up_to_rows: usize,
    /// Each timed choice printed to stderr (as [`Tuning::TimedVerbose`]).
    say_choices: bool,
}

/// Offers timed for a product of few rows ([`BlasLt::time_any_offer_up_to`]).
const ANY_OFFERS: usize = 16;

/// cuBLASLt's `CUBLASLT_REDUCTION_SCHEME_INPLACE`: split-K partial sums
/// added into the output as they come (in no fixed order).
const REDUCTION_INPLACE: u64 = 1;

/// Every offer whose result does not depend on timing: any kernel family
/// and split, but no in-place reduction of the splits.
fn deterministic(
    offered: &[sys::cublasLtMatmulHeuristicResult_t],
) -> Vec<&sys::cublasLtMatmulHeuristicResult_t> {
    offered
        .iter()
        .filter(|r| AlgoConfig::of(&r.algo).reduction & REDUCTION_INPLACE == 0)
        .collect()
}

/// The bucket of `m` rows whose products share an algorithm: up to 64
/// rows each count its own, then powers of two.
fn row_bucket(m: usize) -> usize {
    match m <= 64 {
        true => m,
        false => m.next_power_of_two(),
    }
}

// SAFETY: the handle may be used from any thread, one call at a time
// (`&mut self`).
unsafe impl Send for BlasLt {}

fn lt_err(call: &'static str) -> impl FnOnce(result::CublasError) -> CudaError {
    move |e| CudaError::Driver {
        call,
        name: format!("{:?}", e.0),
        text: String::new(),
    }
}

fn lt_type(t: DType) -> Option<sys::cudaDataType> {
    match t {
        DType::F32 => Some(sys::cudaDataType::CUDA_R_32F),
        DType::BF16 => Some(sys::cudaDataType::CUDA_R_16BF),
        _ => None,
    }
}

/// The largest power of two (up to 256) dividing `ptr`.
fn alignment(ptr: u64) -> u32 {
    if ptr == 0 {
        256
    } else {
        1u32 << ptr.trailing_zeros().min(8)
    }
}

/// Whether running `g` again leaves the same result: nothing it writes
/// (`d`, and the GELU epilogue's `aux`) overlaps anything it reads (`a`,
/// `b`, `c` unless `beta` is 0, the bias, the GELU backward's `aux`).
fn repeatable(g: &LtGemm) -> bool {
    let bytes = |m: &Mat| (m.ptr, m.ptr + (m.len * m.ty.size()) as u64);
    let mut reads = vec![bytes(&g.a), bytes(&g.b)];
    if g.beta != 0.0 {
        reads.push(bytes(&g.c));
    }
    let mut writes = vec![bytes(&g.d)];
    let vec_of = |(ptr, len): (u64, usize), size: usize| (ptr, ptr + (len * size) as u64);
    let size = g.d.ty.size();
    match g.epilogue {
        Epilogue::Plain => {}
        Epilogue::Bias { bias } => reads.push(vec_of(bias, size)),
        Epilogue::GeluAuxBias { bias, aux, .. } => {
            reads.push(vec_of(bias, size));
            writes.push(vec_of(aux, size));
        }
        Epilogue::DGeluBGrad { aux, bgrad, .. } => {
            reads.push(vec_of(aux, size));
            writes.push(vec_of(bgrad, size));
        }
    }
    let overlap = |x: (u64, u64), y: (u64, u64)| x.0 < y.1 && y.0 < x.1;
    !writes.iter().any(|w| reads.iter().any(|r| overlap(*w, *r)))
}

/// The offers that compute what the first does: its kernel family, no
/// split-K (none when the first splits K itself).
fn alike(
    offered: &[sys::cublasLtMatmulHeuristicResult_t],
) -> Vec<&sys::cublasLtMatmulHeuristicResult_t> {
    let first = AlgoConfig::of(&offered[0].algo);
    if first.split_k > 1 || first.reduction != 0 {
        return vec![&offered[0]];
    }
    offered
        .iter()
        .filter(|r| {
            let c = AlgoConfig::of(&r.algo);
            c.id == first.id && c.split_k <= 1 && c.reduction == 0
        })
        .collect()
}

/// cuBLAS's `CUBLAS_OP_T` / `CUBLAS_OP_N`, as the descriptor stores them.
fn op(t: bool) -> i32 {
    if t {
        1
    } else {
        0
    }
}

impl BlasLt {
    /// A handle on `device`, or why cuBLASLt cannot be used.
    pub fn new(device: &Device) -> Result<BlasLt> {
        // SAFETY: only probes whether the library can be opened.
        if !unsafe { sys::is_culib_present() } {
            return Err(CudaError::Unavailable(
                "fused-bias products are unavailable: libcublasLt.so.13 was not found".into(),
            ));
        }
        device.bind()?;
        let handle = result::create_handle().map_err(lt_err("cublasLtCreate"))?;
        Ok(BlasLt {
            handle,
            device: device.clone(),
            workspace: DeviceBuffer::zeros(device, WORKSPACE)?,
            plans: HashMap::new(),
            tuning: Tuning::Heuristic,
            by_rows: None,
            any_up_to_rows: 0,
            say_choices: false,
        })
    }

    /// Prints each timed choice to stderr from here on, whatever the
    /// tuning (the products of [`BlasLt::time_any_offer_up_to`] too).
    pub fn say_choices(&mut self) {
        self.say_choices = true;
    }

    /// Products of at most `rows` rows (a decoder's steps of few
    /// sequences, where the heuristic's first offer can leave most of the
    /// GPU idle) time up to 16 of the heuristic's offers on first use,
    /// any kernel family, split over K or not, and keep the fastest; offers
    /// that reduce the splits in place (atomically, in no fixed order) are
    /// left out, so a product's result still does not depend on timing.
    /// Its bits may differ from the first offer's (the sums split
    /// otherwise). The first use must not be inside a stream capture.
    pub fn time_any_offer_up_to(&mut self, rows: usize) {
        self.any_up_to_rows = rows;
    }

    /// Products whose row counts change at every call (a decoder's
    /// steps) search cuBLASLt's heuristic once per bucket of row counts
    /// (`row_bucket`: exact up to 64, then powers of two) instead of once
    /// per count: a search costs about a millisecond, a step of prompt
    /// rows a few. A count reuses its bucket's algorithm where cuBLASLt's
    /// check accepts it for the count's shape, else searches. Off by
    /// default (training's shapes repeat).
    pub fn share_across_rows(&mut self) {
        self.by_rows.get_or_insert_with(HashMap::new);
    }

    /// Whether cuBLASLt accepts `algo` for `plan`'s shape within the
    /// workspace.
    fn algo_fits(&self, plan: &Plan, algo: &sys::cublasLtMatmulAlgo_t) -> bool {
        // SAFETY: plain-old-data, filled in by the call below.
        let mut r: sys::cublasLtMatmulHeuristicResult_t = unsafe { std::mem::zeroed() };
        // SAFETY: every descriptor is live and `algo` came from a search
        // on this handle; `r` is written by the call.
        let status = unsafe {
            sys::cublasLtMatmulAlgoCheck(
                self.handle,
                plan.desc,
                plan.layouts[0],
                plan.layouts[1],
                plan.layouts[2],
                plan.layouts[3],
                algo,
                &mut r,
            )
        };
        status == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS
            && r.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS
            && r.workspaceSize <= WORKSPACE
    }

    fn key(g: &LtGemm, scaled: Option<&Scaled>) -> Key {
        Key {
            fp8: scaled.map(|x| (x.a, x.b, x.fast_accum)),
            mnk: (g.m, g.n, g.k),
            ab: (g.a.ty, g.a.transposed, g.b.transposed, g.a.ld, g.b.ld),
            cd: (g.d.ty, g.c.ld, g.d.ld),
            epilogue: (g.epilogue.kind(), g.epilogue.aux_ld()),
            align: [
                alignment(g.b.ptr),
                alignment(g.a.ptr),
                alignment(g.c.ptr),
                alignment(g.d.ptr),
                match g.epilogue {
                    Epilogue::Plain | Epilogue::Bias { .. } => 256,
                    Epilogue::GeluAuxBias { aux, .. } | Epilogue::DGeluBGrad { aux, .. } => {
                        alignment(aux.0)
                    }
                },
            ],
        }
    }

    fn check(g: &LtGemm) -> Result<()> {
        let bad = g.a.ty != g.b.ty
            || lt_type(g.a.ty).is_none()
            || lt_type(g.d.ty).is_none()
            || Self::out_of_bounds(g);
        if bad {
            let (m, n, k) = (g.m, g.n, g.k);
            return Err(CudaError::Invalid(format!(
                "lt gemm: operands do not fit a product of {m}x{k} · {k}x{n}: {g:?}"
            )));
        }
        Ok(())
    }

    /// Whether `g`'s dimensions, leading dimensions or spans do not fit its
    /// operands' buffers (types aside): what every product is checked for.
    fn out_of_bounds(g: &LtGemm) -> bool {
        let (m, n, k) = (g.m, g.n, g.k);
        let stored_cols = |x: &Mat, rows, cols| if x.transposed { rows } else { cols };
        m == 0
            || n == 0
            || k == 0
            || g.c.ty != g.d.ty
            || g.c.transposed
            || g.d.transposed
            || g.a.ld < stored_cols(&g.a, m, k)
            || g.b.ld < stored_cols(&g.b, k, n)
            || g.c.ld < n
            || g.d.ld < n
            || g.a.span(m, k, 1) > g.a.len
            || g.b.span(k, n, 1) > g.b.len
            || g.c.span(m, n, 1) > g.c.len
            || g.d.span(m, n, 1) > g.d.len
            || match g.epilogue {
                Epilogue::Plain => false,
                Epilogue::Bias { bias } => bias.1 < n,
                Epilogue::GeluAuxBias { bias, aux, aux_ld } => {
                    bias.1 < n || aux_ld < n || (m - 1) * aux_ld + n > aux.1
                }
                Epilogue::DGeluBGrad { aux, aux_ld, bgrad } => {
                    bgrad.1 < n || aux_ld < n || (m - 1) * aux_ld + n > aux.1
                }
            }
    }

    /// [`BlasLt::check`]'s bounds for a scaled FP8 product, and cuBLASLt's
    /// FP8 rules on Hopper (see [`BlasLt::gemm_scaled`]).
    fn check_scaled(g: &LtGemm, x: &Scaled) -> Result<()> {
        let bytes = DType::U8;
        let why = if g.a.ty != bytes || g.b.ty != bytes {
            Some("a and b must hold FP8 bytes (u8 buffers)".to_string())
        } else if x.a == Fp8::E5M2 && x.b == Fp8::E5M2 {
            Some("a and b may not both be e5m2".into())
        } else if g.a.transposed || !g.b.transposed {
            Some("a must be stored [m, k] and b transposed, stored [n, k]".into())
        } else if g.k % 16 != 0 || g.a.ld % 16 != 0 || g.b.ld % 16 != 0 {
            Some(format!(
                "k ({}) and the leading dimensions of a ({}) and b ({}) must be multiples of 16",
                g.k, g.a.ld, g.b.ld
            ))
        } else if x.a_scale == 0 || x.b_scale == 0 {
            Some("both scales need a device address".into())
        } else if matches!(g.epilogue, Epilogue::DGeluBGrad { .. }) {
            Some("no GELU backward epilogue".into())
        } else if lt_type(g.d.ty).is_none() || Self::out_of_bounds(g) {
            Some(format!("the operands do not fit it: {g:?}"))
        } else {
            None
        };
        match why {
            Some(why) => Err(CudaError::Invalid(format!(
                "lt gemm: a scaled FP8 product of {}x{} · {}x{}: {why}",
                g.m, g.k, g.k, g.n
            ))),
            None => Ok(()),
        }
    }

    /// How algorithms are picked from here on (plans made already keep
    /// theirs).
    pub fn set_tuning(&mut self, tuning: Tuning) {
        self.tuning = tuning;
    }

    /// Builds (or finds) the plan for `g`, timing the heuristic's offers
    /// on `stream` when tuning (see [`Tuning`]); errors when cuBLASLt has
    /// no algorithm for it (callers may then fall back to plain products).
    fn plan(&mut self, g: &LtGemm, stream: &Stream) -> Result<&Plan> {
        self.plan_scaled(g, None, stream)
    }

    /// [`BlasLt::plan`] for a product scaled as `scaled` says (`None`: a
    /// plain one).
    fn plan_scaled(
        &mut self,
        g: &LtGemm,
        scaled: Option<&Scaled>,
        stream: &Stream,
    ) -> Result<&Plan> {
        let key = Self::key(g, scaled);
        if self.plans.contains_key(&key) {
            return Ok(&self.plans[&key]);
        }
        let mut plan = self.describe(g, scaled)?;
        let bucket = Key {
            mnk: (row_bucket(g.m), g.n, g.k),
            ..key
        };
        if let Some(algo) = self.by_rows.as_ref().and_then(|b| b.get(&bucket)) {
            if self.algo_fits(&plan, algo) {
                plan.algo = *algo;
                return Ok(self.plans.entry(key).or_insert(plan));
            }
        }
        let any = g.m <= self.any_up_to_rows && repeatable(g);
        let tune = (self.tuning != Tuning::Heuristic || any) && repeatable(g);
        let max = match (any, tune) {
            (true, _) => ANY_OFFERS,
            (false, true) => TUNE_OFFERS,
            (false, false) => 1,
        };
        let offered = self.heuristics(&plan, &key, max)?;
        plan.algo = offered[0].algo;
        if offered.len() > 1 {
            let candidates = match any {
                true => deterministic(&offered),
                false => alike(&offered),
            };
            if !candidates.is_empty() {
                plan.algo = self.fastest(&plan, &candidates, stream, g, scaled)?;
            }
        }
        if let Some(b) = self.by_rows.as_mut() {
            b.entry(bucket).or_insert(plan.algo);
        }
        Ok(self.plans.entry(key).or_insert(plan))
    }

    /// The fastest of the offers `alike` (those of the first one's kernel
    /// family without split-K when tuning, the deterministic ones for a
    /// product of few rows), timed on `stream`; the first unless another
    /// beats it by [`TUNE_MARGIN`].
    fn fastest(
        &self,
        plan: &Plan,
        alike: &[&sys::cublasLtMatmulHeuristicResult_t],
        stream: &Stream,
        g: &LtGemm,
        scaled: Option<&Scaled>,
    ) -> Result<sys::cublasLtMatmulAlgo_t> {
        let Some(first) = alike.first() else {
            return Err(CudaError::Invalid(
                "lt gemm: no offer to time (a bug: please report it)".into(),
            ));
        };
        if alike.len() < 2 {
            return Ok(first.algo);
        }
        let events: Vec<(Event, Event)> = (0..alike.len())
            .map(|_| Ok((Event::timed(&self.device)?, Event::timed(&self.device)?)))
            .collect::<Result<_>>()?;
        let run = self.runner();
        let mut best = vec![f32::INFINITY; alike.len()];
        for _ in 0..TUNE_ROUNDS {
            for (r, (start, end)) in alike.iter().zip(&events) {
                run.launch(plan, &r.algo, stream, g, scaled)?;
                start.record(stream)?;
                for _ in 0..TUNE_RUNS {
                    run.launch(plan, &r.algo, stream, g, scaled)?;
                }
                end.record(stream)?;
            }
            for (t, (start, end)) in best.iter_mut().zip(&events) {
                end.synchronize()?;
                *t = t.min(end.elapsed_ms(start)? / TUNE_RUNS as f32);
            }
        }
        let (i, &ms) = best
            .iter()
            .enumerate()
            .min_by(|x, y| x.1.total_cmp(y.1))
            .expect("two or more offers");
        let pick = if ms < best[0] * TUNE_MARGIN { i } else { 0 };
        if self.tuning == Tuning::TimedVerbose || self.say_choices {
            eprintln!(
                "gemm tuning: {}x{}x{} {:?}->{:?} {}: offer {pick} of {} ({:.4} ms, split-K {}; \
                 the first {:.4} ms)",
                g.m,
                g.n,
                g.k,
                g.a.ty,
                g.d.ty,
                g.epilogue.name(),
                alike.len(),
                best[pick],
                AlgoConfig::of(&alike[pick].algo).split_k.max(1),
                best[0]
            );
        }
        Ok(alike[pick].algo)
    }

    /// The descriptors for `g`, with no algorithm chosen yet.
    fn describe(&self, g: &LtGemm, scaled: Option<&Scaled>) -> Result<Plan> {
        // (cuBLASLt's A is our b: see below.)
        let (a_ty, b_ty) = match scaled {
            Some(x) => (x.b.lt(), x.a.lt()),
            None => {
                let ab = lt_type(g.a.ty).expect("checked");
                (ab, ab)
            }
        };
        let cd = lt_type(g.d.ty).expect("checked");
        // Row-major D = A·B is column-major Dᵀ = Bᵀ·Aᵀ: cuBLASLt's A is
        // our b, its B our a, and its m, n are our n, m.
        let (lm, ln) = (g.n as u64, g.m as u64);
        let k = g.k as u64;
        let stored = |t: bool, rows: u64, cols: u64| if t { (cols, rows) } else { (rows, cols) };
        let (ar, ac) = stored(g.b.transposed, lm, k);
        let (br, bc) = stored(g.a.transposed, k, ln);
        let mk = |ty, r, c, ld: usize| {
            result::create_matrix_layout(ty, r, c, ld as i64)
                .map_err(lt_err("cublasLtMatrixLayoutCreate"))
        };
        let layouts = [
            mk(a_ty, ar, ac, g.b.ld)?,
            mk(b_ty, br, bc, g.a.ld)?,
            mk(cd, lm, ln, g.c.ld)?,
            mk(cd, lm, ln, g.d.ld)?,
        ];
        let desc = result::create_matmul_desc(
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cudaDataType::CUDA_R_32F,
        )
        .map_err(lt_err("cublasLtMatmulDescCreate"))?;
        // The plan owns the descriptors from here on (freed on drop,
        // including on the error paths below).
        let plan = Plan {
            desc,
            layouts,
            // SAFETY: plain-old-data, chosen by the caller.
            algo: unsafe { std::mem::zeroed() },
        };
        let set = |attr, v: *const c_void, size| {
            // SAFETY: `desc` is live; `v` points at `size` readable bytes.
            unsafe { result::set_matmul_desc_attribute(desc, attr, v, size) }
                .map_err(lt_err("cublasLtMatmulDescSetAttribute"))
        };
        use sys::cublasLtMatmulDescAttributes_t as D;
        let (ta, tb) = (op(g.b.transposed), op(g.a.transposed));
        set(D::CUBLASLT_MATMUL_DESC_TRANSA, &ta as *const _ as _, 4)?;
        set(D::CUBLASLT_MATMUL_DESC_TRANSB, &tb as *const _ as _, 4)?;
        use sys::cublasLtEpilogue_t as E;
        let epilogue = match g.epilogue {
            Epilogue::Plain => E::CUBLASLT_EPILOGUE_DEFAULT,
            Epilogue::Bias { .. } => E::CUBLASLT_EPILOGUE_BIAS,
            Epilogue::GeluAuxBias { .. } => E::CUBLASLT_EPILOGUE_GELU_AUX_BIAS,
            Epilogue::DGeluBGrad { .. } => E::CUBLASLT_EPILOGUE_DGELU_BGRAD,
        };
        set(
            D::CUBLASLT_MATMUL_DESC_EPILOGUE,
            &epilogue as *const _ as _,
            4,
        )?;
        if let Some(x) = scaled {
            let fast = i8::from(x.fast_accum);
            set(
                D::CUBLASLT_MATMUL_DESC_FAST_ACCUM,
                &fast as *const i8 as _,
                1,
            )?;
            // The bias's type said outright: cuBLASLt's own default for an
            // FP8 product with an f32 result is bf16, not d's type (an f32
            // bias read as bf16 is garbage once it is not zero).
            if let Epilogue::Bias { .. } | Epilogue::GeluAuxBias { .. } = g.epilogue {
                let bias = lt_type(scaled_bias_type(g.d.ty)).ok_or_else(|| {
                    CudaError::Invalid(format!("lt gemm: no bias type for a {:?} result", g.d.ty))
                })?;
                set(
                    D::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                    &bias as *const _ as _,
                    4,
                )?;
            }
        }
        if let Epilogue::GeluAuxBias { aux_ld, .. } | Epilogue::DGeluBGrad { aux_ld, .. } =
            g.epilogue
        {
            let ld = aux_ld as i64;
            set(
                D::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD,
                &ld as *const _ as _,
                8,
            )?;
        }
        Ok(plan)
    }

    /// Up to `max` algorithms cuBLASLt's heuristic offers for `plan`
    /// (best first), each fitting the workspace and the operands'
    /// alignment in `key`.
    fn heuristics(
        &self,
        plan: &Plan,
        key: &Key,
        max: usize,
    ) -> Result<Vec<sys::cublasLtMatmulHeuristicResult_t>> {
        let pref =
            result::create_matmul_pref().map_err(lt_err("cublasLtMatmulPreferenceCreate"))?;
        let picked = (|| -> Result<Vec<sys::cublasLtMatmulHeuristicResult_t>> {
            use sys::cublasLtMatmulPreferenceAttributes_t as P;
            let setp = |attr, v: *const c_void, size| {
                // SAFETY: `pref` is live; `v` points at `size` readable bytes.
                unsafe { result::set_matmul_pref_attribute(pref, attr, v, size) }
                    .map_err(lt_err("cublasLtMatmulPreferenceSetAttribute"))
            };
            let ws = WORKSPACE as u64;
            setp(
                P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &ws as *const _ as _,
                8,
            )?;
            let attrs = [
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
            ];
            for (attr, a) in attrs.into_iter().zip(key.align) {
                setp(attr, &a as *const u32 as _, 4)?;
            }
            // SAFETY: plain-old-data, filled in by the call below.
            let mut found = vec![unsafe { std::mem::zeroed() }; max];
            let mut count = 0;
            // SAFETY: every descriptor is live; `found` holds `max` results.
            unsafe {
                sys::cublasLtMatmulAlgoGetHeuristic(
                    self.handle,
                    plan.desc,
                    plan.layouts[0],
                    plan.layouts[1],
                    plan.layouts[2],
                    plan.layouts[3],
                    pref,
                    max as i32,
                    found.as_mut_ptr(),
                    &mut count,
                )
            }
            .result()
            .map_err(lt_err("cublasLtMatmulAlgoGetHeuristic"))?;
            found.truncate(count.max(0) as usize);
            found.retain(|r: &sys::cublasLtMatmulHeuristicResult_t| {
                r.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS
            });
            if found.is_empty() {
                return Err(lt_err("cublasLtMatmulAlgoGetHeuristic")(
                    result::CublasError(sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED),
                ));
            }
            Ok(found)
        })();
        // SAFETY: created above, destroyed once.
        let _ = unsafe { result::destroy_matmul_pref(pref) };
        let mut picked = picked?;
        let wants = picked[0].workspaceSize;
        picked.retain(|r| r.workspaceSize <= WORKSPACE);
        if picked.is_empty() {
            return Err(CudaError::Invalid(format!(
                "lt gemm: the offered algorithm wants {wants} bytes of workspace"
            )));
        }
        Ok(picked)
    }

    /// Runs `g` on `stream` (see [`LtGemm`]).
    pub fn gemm(&mut self, stream: &Stream, g: &LtGemm) -> Result<()> {
        Self::check(g)?;
        self.device.bind()?;
        let run = self.runner();
        let plan = self.plan(g, stream)?;
        run.launch(plan, &plan.algo, stream, g, None)
    }

    /// Runs the FP8 product `g` scaled as `scaled` says on `stream`: `d =
    /// alpha · (a_scale · a) · (b_scale · b) + beta · c`, then the
    /// epilogue, whose bias is of [`scaled_bias_type`] (bf16 for an f32
    /// result). On Hopper cuBLASLt takes FP8 operands only with both
    /// stored along the shared dimension: `a` untransposed (`[m, k]`),
    /// `b` transposed (stored `[n, k]`), every leading dimension and `k` a
    /// multiple of 16; anything else is refused here with what to change.
    pub fn gemm_scaled(&mut self, stream: &Stream, g: &LtGemm, scaled: &Scaled) -> Result<()> {
        Self::check_scaled(g, scaled)?;
        self.device.bind()?;
        let run = self.runner();
        let plan = self.plan_scaled(g, Some(scaled), stream)?;
        run.launch(plan, &plan.algo, stream, g, Some(scaled))
    }

    /// What launching a product needs besides its plan (copied out, so
    /// that a plan borrowed from `plans` can go with it).
    fn runner(&self) -> Runner {
        Runner {
            handle: self.handle,
            workspace: (self.workspace.dptr(), self.workspace.dlen()),
        }
    }

    /// Runs `g` with an algorithm [`BlasLt::time_offered`] returned for it.
    pub fn gemm_offered(&mut self, stream: &Stream, g: &LtGemm, o: &Offered) -> Result<()> {
        Self::check(g)?;
        self.device.bind()?;
        let run = self.runner();
        let plan = self.plan(g, stream)?;
        run.launch(plan, &o.algo, stream, g, None)
    }

    /// Runs `g` with each offer tuning may pick from (see [`Tuning`]) and
    /// counts those whose result (`read` back after each run) differs
    /// from the first's: `(offers, differing)`. `g` must be repeatable.
    pub fn alike_offers_agree(
        &mut self,
        stream: &Stream,
        g: &LtGemm,
        read: &dyn Fn() -> Result<Vec<u8>>,
    ) -> Result<(usize, usize)> {
        Self::check(g)?;
        if !repeatable(g) {
            return Err(CudaError::Invalid(
                "lt gemm: the product overwrites its own inputs".into(),
            ));
        }
        self.device.bind()?;
        self.plan(g, stream)?;
        let (run, key) = (self.runner(), Self::key(g, None));
        let plan = &self.plans[&key];
        let offered = self.heuristics(plan, &key, TUNE_OFFERS)?;
        let mut first = None;
        let mut differing = 0;
        let alike = alike(&offered);
        for r in &alike {
            run.launch(plan, &r.algo, stream, g, None)?;
            stream.synchronize()?;
            let bytes = read()?;
            match &first {
                None => first = Some(bytes),
                Some(f) => differing += usize::from(*f != bytes),
            }
        }
        Ok((alike.len(), differing))
    }

    /// Times each of the first `max` algorithms cuBLASLt's heuristic
    /// offers for `g` (best first), `reps` runs each after one warm-up, on
    /// `stream`. `g` runs many times, so its result must not feed its
    /// inputs (`d` apart from `a`, `b` and, unless `beta` is 0, `c`).
    pub fn time_offered(
        &mut self,
        stream: &Stream,
        g: &LtGemm,
        max: usize,
        reps: usize,
    ) -> Result<Vec<Offered>> {
        Self::check(g)?;
        self.device.bind()?;
        self.plan(g, stream)?;
        let (run, key) = (self.runner(), Self::key(g, None));
        let plan = &self.plans[&key];
        let offered = self.heuristics(plan, &key, max.max(1))?;
        let (start, end) = (Event::timed(&self.device)?, Event::timed(&self.device)?);
        let mut out = Vec::with_capacity(offered.len());
        for (rank, r) in offered.iter().enumerate() {
            run.launch(plan, &r.algo, stream, g, None)?;
            start.record(stream)?;
            for _ in 0..reps.max(1) {
                run.launch(plan, &r.algo, stream, g, None)?;
            }
            end.record(stream)?;
            end.synchronize()?;
            out.push(Offered {
                algo: r.algo,
                rank,
                config: AlgoConfig::of(&r.algo),
                waves: r.wavesCount,
                workspace: r.workspaceSize,
                ms: end.elapsed_ms(&start)? / reps.max(1) as f32,
            });
        }
        Ok(out)
    }
}

/// One algorithm the heuristic offered, with its measured time.
#[derive(Debug, Clone)]
pub struct Offered {
    algo: sys::cublasLtMatmulAlgo_t,
    /// Its place in the heuristic's order (0: the one `gemm` uses).
    pub rank: usize,
    pub config: AlgoConfig,
    /// The heuristic's wave count.
    pub waves: f32,
    /// Workspace bytes it wants.
    pub workspace: usize,
    /// Milliseconds per run.
    pub ms: f32,
}

/// The readable part of a cuBLASLt algorithm's configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AlgoConfig {
    pub id: u64,
    pub tile: u64,
    pub split_k: u64,
    pub reduction: u64,
    pub swizzle: u64,
    pub custom: u64,
    pub stages: u64,
    pub inner: u64,
    pub cluster: u64,
}

impl AlgoConfig {
    fn of(algo: &sys::cublasLtMatmulAlgo_t) -> AlgoConfig {
        use sys::cublasLtMatmulAlgoConfigAttributes_t as C;
        // Each attribute is read at its own size (cuBLASLt refuses any
        // other): 2 bytes for the shapes, 4 for the rest.
        let get = |attr| {
            let size = match attr {
                C::CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID
                | C::CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID => 2,
                _ => 4,
            };
            let mut v = 0u64;
            let mut written = 0usize;
            // SAFETY: `algo` is initialised; `v` has 8 writable bytes, more
            // than `size`.
            let _ = unsafe {
                sys::cublasLtMatmulAlgoConfigGetAttribute(
                    algo,
                    attr,
                    &mut v as *mut u64 as *mut c_void,
                    size,
                    &mut written,
                )
            };
            v
        };
        AlgoConfig {
            id: get(C::CUBLASLT_ALGO_CONFIG_ID),
            tile: get(C::CUBLASLT_ALGO_CONFIG_TILE_ID),
            split_k: get(C::CUBLASLT_ALGO_CONFIG_SPLITK_NUM),
            reduction: get(C::CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME),
            swizzle: get(C::CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING),
            custom: get(C::CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION),
            stages: get(C::CUBLASLT_ALGO_CONFIG_STAGES_ID),
            inner: get(C::CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID),
            cluster: get(C::CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID),
        }
    }
}

impl std::fmt::Display for AlgoConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "algo {} tile {} splitK {} red {} swz {} custom {} stages {} inner {} cluster {}",
            self.id,
            self.tile,
            self.split_k,
            self.reduction,
            self.swizzle,
            self.custom,
            self.stages,
            self.inner,
            self.cluster
        )
    }
}

/// A cuBLASLt handle and workspace, to launch planned products with.
#[derive(Clone, Copy)]
struct Runner {
    handle: sys::cublasLtHandle_t,
    workspace: (u64, usize),
}

impl Runner {
    /// Runs `g` through `plan`'s descriptors with algorithm `algo`.
    fn launch(
        &self,
        plan: &Plan,
        algo: &sys::cublasLtMatmulAlgo_t,
        stream: &Stream,
        g: &LtGemm,
        scaled: Option<&Scaled>,
    ) -> Result<()> {
        let (bias, aux) = match g.epilogue {
            Epilogue::Plain => (None, None),
            Epilogue::Bias { bias } => (Some(bias.0), None),
            Epilogue::GeluAuxBias { bias, aux, .. } => (Some(bias.0), Some(aux.0)),
            Epilogue::DGeluBGrad { aux, bgrad, .. } => (Some(bgrad.0), Some(aux.0)),
        };
        use sys::cublasLtMatmulDescAttributes_t as D;
        // (cuBLASLt's A is our b.)
        for (attr, ptr) in [
            (D::CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias),
            (D::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, aux),
            (
                D::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                scaled.map(|x| x.b_scale),
            ),
            (
                D::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                scaled.map(|x| x.a_scale),
            ),
        ] {
            let Some(ptr) = ptr else { continue };
            // SAFETY: the descriptor is live; the pointer value is copied.
            unsafe {
                result::set_matmul_desc_attribute(plan.desc, attr, &ptr as *const u64 as _, 8)
            }
            .map_err(lt_err("cublasLtMatmulDescSetAttribute"))?;
        }
        let (alpha, beta) = (g.alpha, g.beta);
        // SAFETY: every operand was checked to lie inside its buffer and
        // matches the plan's layouts (the plan key holds every dimension,
        // leading dimension, type and alignment); the workspace is ours.
        unsafe {
            result::matmul(
                self.handle,
                plan.desc,
                &alpha as *const f32 as _,
                &beta as *const f32 as _,
                g.b.ptr as *const c_void,
                plan.layouts[0],
                g.a.ptr as *const c_void,
                plan.layouts[1],
                g.c.ptr as *const c_void,
                plan.layouts[2],
                g.d.ptr as *mut c_void,
                plan.layouts[3],
                algo,
                self.workspace.0 as *mut c_void,
                self.workspace.1,
                stream.raw() as _,
            )
        }
        .map_err(lt_err("cublasLtMatmul"))
    }
}

impl Drop for BlasLt {
    fn drop(&mut self) {
        self.plans.clear();
        if self.device.bind().is_ok() {
            // SAFETY: created in `new`, destroyed once.
            let _ = unsafe { result::destroy_handle(self.handle) };
        }
    }
}
