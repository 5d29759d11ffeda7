//! Launchers for the mixed-precision kernels (`mixed.cu`): bf16
//! activations, f32 arithmetic, f32 master parameters and gradients. Each
//! launcher checks its buffers' lengths against the shape it is given, so
//! a wrong size is an error rather than an out-of-bounds kernel.

use super::flash::FlashKernels;
use super::kernels::{PagedKv, VocabRows};
use super::sources::SOURCES;
use braid_cuda::nvrtc::{Function, Module};
use braid_cuda::{CudaError, Device, DeviceBuffer, DeviceMem, Result, Stream};
use half::bf16;
use std::ffi::c_void;
use std::ops::Range;

const BLOCK: u32 = 256;
const WARPS: usize = (BLOCK / 32) as usize;

/// Rows per chunk of the deterministic column reductions (LayerNorm and
/// bias gradients): partial sums per chunk, then a sum over chunks.
pub const ROWS_PER_BLOCK: usize = 512;

/// Rows per block of the fused GELU backward + bias gradient.
const GELU_ROWS_PER_BLOCK: usize = 128;

/// Rows per block of the fused LayerNorm backward (one partial row each).
const LN_ROWS_PER_BLOCK: usize = 32;

/// Widths with their own LayerNorm kernels (`LN_WIDE` in mixed.cu), and
/// the threads of the block that takes one row.
const LN_WIDE: [(usize, u32); 6] = [
    (1280, 64),
    (1600, 128),
    (2048, 128),
    (2560, 128),
    (4096, 256),
    (5120, 256),
];

/// Fewest rows per block of the wide LayerNorm backward (one partial row
/// each). Above it, the rows are spread so that the blocks fill the GPU in
/// one wave (or whole waves): at 2.65B, 8192 rows in 512 blocks of 16 took
/// 1.29 waves of 3 blocks per SM on an H200, 391 of 21 take one.
const LN_WIDE_MIN_ROWS: usize = 16;

/// The largest element count one launch of a 32-bit-indexed kernel
/// (`residual_bias`, `bias_gelu_bf`) takes; larger buffers go in row
/// chunks below it. Chunking costs nothing (one more launch per 2^31
/// elements) where 64-bit indices would cost a 64-bit `% C` per element.
const MAX_I32: usize = i32::MAX as usize;

/// The largest grid.y (and grid.z) CUDA launches take.
const MAX_GRID_Y: usize = 65535;

/// Checks that `chunks` row chunks fit in grid.y: past that a column
/// reduction would need more than 65535 × `rows` rows (tokens) per GPU.
fn grid_y(what: &str, chunks: usize, rows: usize) -> Result<u32> {
    if chunks > MAX_GRID_Y {
        return Err(CudaError::Invalid(format!(
            "{what}: {} rows need {chunks} row chunks of {rows}, more than a launch's {MAX_GRID_Y} \
             (use fewer tokens per GPU: a smaller batch or sequence)",
            chunks * rows
        )));
    }
    Ok(chunks.max(1) as u32)
}

/// `n` rows of `c` as (first row, rows) launches of at most `MAX_I32`
/// elements each (at least one row), for kernels that index in 32 bits.
fn row_launches(n: usize, c: usize) -> impl Iterator<Item = (usize, usize)> {
    let per = (MAX_I32 / c.max(1)).max(1);
    (0..n).step_by(per).map(move |r0| (r0, per.min(n - r0)))
}

/// A kernel argument.
#[derive(Clone, Copy)]
pub(crate) enum A {
    P(u64),
    I(i32),
    L(i64),
    F(f32),
}

fn ptrs(args: &mut [A]) -> Vec<*mut c_void> {
    args.iter_mut()
        .map(|a| match a {
            A::P(x) => x as *mut u64 as *mut c_void,
            A::I(x) => x as *mut i32 as *mut c_void,
            A::L(x) => x as *mut i64 as *mut c_void,
            A::F(x) => x as *mut f32 as *mut c_void,
        })
        .collect()
}

/// The most elements one thread block of [`MixedKernels::zero_runs`]
/// zeroes: 64 per thread of 256.
pub const ZERO_PIECE: usize = 16384;

/// Runs of a buffer's elements that [`MixedKernels::zero_runs`] zeroes in
/// one launch: checked against the buffer's length and uploaded once, cut
/// into pieces of at most [`ZERO_PIECE`] elements, one thread block each
/// (a whole run per block left one SM zeroing the tied embedding's 38.6 M
/// gradients at 124M: 3 ms a step).
pub struct ZeroRuns {
    /// (start, length) of each piece.
    runs: DeviceBuffer<i64>,
    count: usize,
    /// The length of the buffer the runs lie in.
    len: usize,
}

impl std::fmt::Debug for ZeroRuns {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ZeroRuns({} pieces within {})", self.count, self.len)
    }
}

impl ZeroRuns {
    /// `runs` (each within `0..len`) on `device`.
    pub fn new(device: &Device, runs: &[Range<usize>], len: usize) -> Result<ZeroRuns> {
        if let Some(r) = runs.iter().find(|r| r.start > r.end || r.end > len) {
            return Err(CudaError::Invalid(format!(
                "zero runs: {r:?} outside a buffer of {len} elements"
            )));
        }
        let flat = zero_pieces(runs);
        let pieces = flat.len() / 2;
        let runs_on_device = match flat.is_empty() {
            true => DeviceBuffer::zeros(device, 2)?,
            false => DeviceBuffer::from_host(device, &flat)?,
        };
        if i32::try_from(pieces).is_err() {
            return Err(CudaError::Invalid(format!(
                "zero runs: {pieces} pieces of {ZERO_PIECE} elements"
            )));
        }
        Ok(ZeroRuns {
            runs: runs_on_device,
            count: pieces,
            len,
        })
    }
}

/// `runs` cut into pieces of at most [`ZERO_PIECE`] elements, flat
/// (start, length) pairs; empty runs give none.
fn zero_pieces(runs: &[Range<usize>]) -> Vec<i64> {
    runs.iter()
        .flat_map(|r| r.clone().step_by(ZERO_PIECE).map(|at| (at, r.end)))
        .flat_map(|(at, end)| [at as i64, (end - at).min(ZERO_PIECE) as i64])
        .collect()
}

fn need(what: &str, have: usize, want: usize) -> Result<()> {
    if have < want {
        return Err(CudaError::Invalid(format!(
            "{what}: buffer of {have} elements, the shape needs {want}"
        )));
    }
    Ok(())
}

fn even(what: &str, n: usize) -> Result<()> {
    if n % 2 != 0 {
        return Err(CudaError::Invalid(format!(
            "{what}: {n} is odd; the kernel takes pairs of bf16 values"
        )));
    }
    Ok(())
}

/// A launch's grid or block dimensions.
type Dim3 = (u32, u32, u32);

/// A 1-D grid of `ceil(n / per)` blocks (grid.x takes up to 2^31 - 1, so
/// 256-thread blocks cover 5.5 × 10^11 elements).
/// Threads a row of `softmax_cross_entropy_rows_bf` (CE_T) and the most
/// 8-value chunks each holds (CE_J), as mixed.cu defines them.
const CE_T: u32 = 1024;
const CE_J: usize = 8;

/// Whether a row of `ld` logits fits the block-per-row kernel.
fn ce_rows_take(ld: usize) -> bool {
    ld % 8 == 0 && ld <= 8 * CE_J * CE_T as usize
}

/// `BRAID_CE`: `rows` (one block a row, the row in registers) or `warp`
/// (the default: one warp a row, two reads).
fn ce_rows_from_env() -> Result<bool> {
    ce_rows_of(std::env::var(braid_core::env::BRAID_CE).ok().as_deref())
}

fn ce_rows_of(v: Option<&str>) -> Result<bool> {
    match v.map(str::trim) {
        None | Some("" | "warp") => Ok(false),
        Some("rows") => Ok(true),
        Some(other) => Err(CudaError::Invalid(format!(
            "BRAID_CE={other:?}: expected warp (the default) or rows"
        ))),
    }
}

fn too_many_rows(n: usize) -> CudaError {
    CudaError::Invalid(format!("softmax_cross_entropy: {n} rows past one launch"))
}

fn blocks(n: usize, per: usize) -> Result<Dim3> {
    let b = n.div_ceil(per).max(1);
    match u32::try_from(b) {
        Ok(x) if x <= i32::MAX as u32 => Ok((x, 1, 1)),
        _ => Err(CudaError::Invalid(format!(
            "{n} elements need {b} blocks, more than a launch's 2^31 - 1"
        ))),
    }
}

/// Whether every address is 16-byte aligned (the vectorised LayerNorm
/// kernels read float4s and groups of four bf16 values).
fn aligned16(addrs: &[u64]) -> bool {
    addrs.iter().all(|a| a % 16 == 0)
}

/// The LayerNorm kernels of one wide width.
struct LnWide {
    width: usize,
    threads: u32,
    forward: Function,
    backward: Function,
    /// Backward blocks the whole GPU runs at once.
    backward_slots: usize,
}

/// The loaded mixed-precision kernels of one device.
pub struct MixedKernels {
    ln_forward: Function,
    ln_backward: Function,
    /// Fused LayerNorm backward for widths 512, 768 and 1024.
    ln_backward_fused: [(usize, Function); 3],
    /// LayerNorm forward and fused backward for the widths of `LN_WIDE`.
    ln_wide: Vec<LnWide>,
    ln_param_partial: Function,
    bias_partial_f32: Function,
    bias_partial_bf: Function,
    bias_partial_bf8: Function,
    sum_partials: Function,
    residual_bias: Function,
    residual_bias_add_bf: Function,
    zero_runs: Function,
    bias_gelu: Function,
    gelu_backward_bias: Function,
    to_bf16: Function,
    pub(crate) permute_qkv: Function,
    pub(crate) unpermute: Function,
    pub(crate) permute_grad: Function,
    pub(crate) unpermute_qkv_grad: Function,
    pub(crate) softmax_forward: Function,
    pub(crate) softmax_backward: Function,
    softmax_cross_entropy: Function,
    /// The block-per-row form (`softmax_cross_entropy_rows_bf`) and
    /// whether `BRAID_CE=rows` chose it.
    softmax_cross_entropy_rows: Function,
    ce_rows: bool,
    vocab_row_max: Function,
    vocab_row_sums: Function,
    vocab_softmax_ce: Function,
    adamw_multi: Function,
    adamw_multi4: Function,
    /// The fused attention kernels, where the GPU has bf16 tensor cores.
    pub(crate) flash: Option<FlashKernels>,
    /// The skinny products for up to 1, 2, 4 and 8 rows.
    skinny_gemm: [Function; 4],
    /// The products of up to 1, 2, 4 and 8 rows against weights stored
    /// output by output ([`MixedKernels::nt_product`]).
    nt_gemm: [Function; 4],
    /// The same of a LayerNorm's output, normalised in the kernel
    /// ([`MixedKernels::nt_ln_product`]).
    nt_ln_gemm: [Function; 4],
    /// A layer's MLP half of a few rows in one kernel
    /// ([`MixedKernels::nt_mlp`]).
    nt_mlp: [Function; 4],
    /// The GPU's multiprocessors (the skinny products' tiles are sized to
    /// cover them).
    sms: usize,
    /// Whether the decode step's kernels that wait for the one ahead (the
    /// LayerNorm forward into bf16, the skinny products: `overlap_wait` in
    /// mixed.cu) launch overlapping it ([`Function::launch_overlapping`]);
    /// off unless the decoder turns it on.
    overlap: bool,
    /// Blocks a multiprocessor an NT product's grid holds at most, each
    /// looping over its groups of outputs; 0: a block per group
    /// ([`MixedKernels::set_nt_blocks_per_sm`]).
    nt_blocks_per_sm: usize,
    /// The same cap for the NT products that normalise their rows
    /// themselves, so each block normalises once for all the groups it
    /// takes ([`MixedKernels::set_nt_ln_blocks_per_sm`]; 2 unless set).
    nt_ln_blocks_per_sm: usize,
    /// How an NT product starts (mixed.cu's `how` bits;
    /// [`MixedKernels::set_nt_start`]); `None`, by its weights' size
    /// ([`NtStart::for_weights`]).
    nt_start: Option<NtStart>,
}

/// A layer's MLP half's buffers for [`MixedKernels::nt_mlp`], each as
/// `(device address, elements)`: its outputs (`x2` f32 `[m, c]`, `h` bf16
/// `[m, f]`, `out` f32 `[m, c]`), inputs (`att` bf16 `[m, c]`, `x` f32
/// `[m, c]`), the products' weights `[out, in]` in bf16 and their f32
/// biases, LayerNorm 2's scale and shift.
#[derive(Debug, Clone, Copy)]
pub struct NtMlp {
    pub x2: (u64, usize),
    pub h: (u64, usize),
    pub out: (u64, usize),
    pub att: (u64, usize),
    pub x: (u64, usize),
    pub wp: (u64, usize),
    pub bp: (u64, usize),
    pub lw: (u64, usize),
    pub lb: (u64, usize),
    pub wf: (u64, usize),
    pub bf: (u64, usize),
    pub wo: (u64, usize),
    pub bo: (u64, usize),
}

/// How an NT product starts, before its sums (which it does not change):
/// whether it lets the kernel behind it start before it waits for the one
/// ahead, and how it asks for its weights into L2 while it waits.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NtStart {
    /// Release the kernel behind before waiting (else after).
    pub release_first: bool,
    /// How the weights are asked for ahead of the wait.
    pub prefetch: NtPrefetch,
}

/// How an NT product asks for its weights into L2 before it waits.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum NtPrefetch {
    /// A request a 128-byte line, by every lane.
    #[default]
    Lines,
    /// A few bulk requests a group of outputs, by the copy engine
    /// (sm_90 on; none below).
    Bulk,
    /// Nothing asked ahead.
    None,
}

/// Bytes of an NT product's weights up to which it starts by releasing the
/// kernel behind first and asking for its weights in bulk, and past which
/// it waits first and asks for nothing ahead. Chosen from the two models
/// measured on an H100 (2026-12-07, a layer's four products chained at one
/// row): 124M's products (1.2-4.7 MB) took 18.3 µs the first way against
/// 20.8 the second, 1558M's (5.1-20.5 MB) 36.7 against 33.6 — small
/// products are bound by their waits, which asking ahead hides; large
/// ones by the bandwidth, which asking ahead only contends for.
pub const NT_ASK_AHEAD_UP_TO: usize = 5_000_000;

impl NtStart {
    /// The start for a product of `bytes` of weights
    /// ([`NT_ASK_AHEAD_UP_TO`]).
    pub fn for_weights(bytes: usize) -> NtStart {
        match bytes <= NT_ASK_AHEAD_UP_TO {
            true => NtStart {
                release_first: true,
                prefetch: NtPrefetch::Bulk,
            },
            false => NtStart {
                release_first: false,
                prefetch: NtPrefetch::None,
            },
        }
    }

    /// mixed.cu's `how` bits (NT_RELEASE_FIRST 1, NT_BULK_PREFETCH 2,
    /// NT_NO_PREFETCH 4).
    fn bits(self) -> i32 {
        i32::from(self.release_first)
            | match self.prefetch {
                NtPrefetch::Lines => 0,
                NtPrefetch::Bulk => 2,
                NtPrefetch::None => 4,
            }
    }
}

/// Where a skinny product ([`MixedKernels::skinny_product`]) puts its
/// rows: buffers as `(device address, elements)`.
#[derive(Debug, Clone, Copy)]
pub enum SkinnyTo {
    /// `out = y`, or `out = y + res` (f32).
    F32 {
        out: (u64, usize),
        res: Option<(u64, usize)>,
    },
    /// `out = bf16(gelu(y))`.
    GeluBf16 { out: (u64, usize) },
    /// A QKV product's `out = y` (f32, `[m, 3C]`), each row's key and
    /// value written into the paged cache `kv` as well, at the slot
    /// `slots[row]` (as [`Kernels::kv_write`](super::kernels::Kernels::kv_write)
    /// writes them, which the step then needs not run): the NT kernel
    /// only. Every slot must lie inside the cache (the caller's check, as
    /// for `kv_write`).
    QkvIntoCache {
        out: (u64, usize),
        kv: PagedKv,
        slots: (u64, usize),
    },
}

/// The LayerNorm after an NT product done by the product's own grid (its
/// last block to finish: mixed.cu's `nt_tail_ln`), so that the LayerNorm
/// needs no kernel of its own: of the product's f32 output (the residual
/// stream), with `scale` and `shift` (f32 `[n]`), into `out` (bf16 `[m,
/// n]`). `counter`: one 32-bit counter, zero between products (the last
/// block resets it), that no other kernel uses while the product runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NtTail {
    pub counter: (u64, usize),
    pub scale: (u64, usize),
    pub shift: (u64, usize),
    pub out: (u64, usize),
}

/// The NT kernels' tail arguments (counter, scale, shift, output) for a
/// product of `m` rows and `n` outputs into `to`: `tail`'s, checked (an
/// f32 product only), or nulls.
fn nt_tail_args(tail: Option<NtTail>, to: SkinnyTo, m: usize, n: usize) -> Result<Vec<A>> {
    let Some(t) = tail else {
        return Ok(vec![A::P(0), A::P(0), A::P(0), A::P(0)]);
    };
    if !matches!(to, SkinnyTo::F32 { .. }) {
        return Err(CudaError::Invalid(
            "nt product: a LayerNorm after it needs an f32 product".into(),
        ));
    }
    need("nt tail counter", t.counter.1, 1)?;
    need("nt tail LayerNorm", t.scale.1.min(t.shift.1), n)?;
    need("nt tail out", t.out.1, m * n)?;
    Ok(vec![
        A::P(t.counter.0),
        A::P(t.scale.0),
        A::P(t.shift.0),
        A::P(t.out.0),
    ])
}

/// Rows a skinny product takes at most (the kernel's `SK_ROWS`).
pub const SKINNY_ROWS: usize = 8;

/// Columns of a skinny product's tile: 8 lanes across, 8 columns each
/// (128 contiguous bytes of a weight row).
const SKINNY_TILE: usize = 64;
/// Splits of K a skinny product takes at most.
const SKINNY_SPLITS: usize = 8;

/// What a skinny product split over K needs besides its operands: each
/// split's sums, and a counter per tile of columns (zero between products:
/// each tile's last block resets its own). Made once, for the widest
/// product, so that a captured graph never names a buffer freed after.
pub struct SkinnyScratch {
    partials: DeviceBuffer<f32>,
    counters: DeviceBuffer<i32>,
}

impl SkinnyScratch {
    /// Scratch on `device` for products of up to `widest` columns.
    pub fn new(device: &Device, widest: usize) -> Result<SkinnyScratch> {
        Ok(SkinnyScratch {
            partials: DeviceBuffer::zeros(device, SKINNY_SPLITS * SKINNY_ROWS * widest.max(1))?,
            counters: DeviceBuffer::zeros(device, widest.div_ceil(SKINNY_TILE).max(1))?,
        })
    }
}

/// How a skinny product of `n` columns and `k` rows of weights is split
/// on `sms` multiprocessors: splits of K and rows per split, enough splits
/// for two blocks a multiprocessor, at most [`SKINNY_SPLITS`] and each of
/// at least 128 rows; it depends on the product's shape alone, never on
/// its row count.
fn skinny_layout(n: usize, k: usize, sms: usize) -> (usize, usize) {
    let tiles = n.div_ceil(SKINNY_TILE);
    let splits = (2 * sms)
        .div_ceil(tiles)
        .clamp(1, SKINNY_SPLITS)
        .min((k / 128).max(1));
    let rows = k.div_ceil(splits).next_multiple_of(8);
    (splits, rows)
}

/// Outputs a warp of an NT product takes (the kernel's `NT_OUT`).
const NT_OUT: usize = 2;
/// Warps of an NT product's block (the kernel's `NT_WARPS`).
const NT_WARPS: usize = 8;

/// The warps that split K in an NT product of `n` outputs over `k` on
/// `sms` multiprocessors: the fewest (1, 2, 4 or 8) that make two blocks a
/// multiprocessor, but never so many that a warp's slice of K is less than
/// one pass of its lanes (256 elements). By the shape alone, never the
/// row count.
fn nt_split(n: usize, k: usize, sms: usize) -> usize {
    let most = (k / 256).clamp(1, NT_WARPS);
    let mut kw = 1;
    while kw < most && 2 * kw <= most && (n * kw).div_ceil(NT_OUT * NT_WARPS) < 2 * sms {
        kw *= 2;
    }
    kw
}

/// A few rows' product's first three arguments (out, outb, res) for `to`
/// (the skinny and NT kernels take the same), its buffers checked against
/// `len` elements, and its epilogue (the kernels' mode: 0 plain, 1 with
/// the residual, 2 GELU into bf16, 3 with the keys and values into the
/// cache: NT only, its cache arguments from [`nt_cache_args`]).
fn product_outputs(what: &str, to: SkinnyTo, len: usize) -> Result<(Vec<A>, i32)> {
    Ok(match to {
        SkinnyTo::F32 { out, res } => {
            need(&format!("{what} out"), out.1, len)?;
            if let Some(r) = res {
                need(&format!("{what} residual"), r.1, len)?;
            }
            let mode = i32::from(res.is_some());
            (
                vec![A::P(out.0), A::P(0), A::P(res.map_or(0, |r| r.0))],
                mode,
            )
        }
        SkinnyTo::GeluBf16 { out } => {
            need(&format!("{what} out"), out.1, len)?;
            (vec![A::P(0), A::P(out.0), A::P(0)], 2)
        }
        SkinnyTo::QkvIntoCache { out, .. } => {
            need(&format!("{what} out"), out.1, len)?;
            (vec![A::P(out.0), A::P(0), A::P(0)], 3)
        }
    })
}

/// The NT kernels' last four arguments (the cache's keys, values, the
/// rows' slots, whether the cache is bf16) for a product of `m` rows and
/// `n` outputs: the cache's where `to` writes into it (`n` then a multiple
/// of 3, the slots checked for `m` rows), else nulls.
fn nt_cache_args(to: SkinnyTo, m: usize, n: usize) -> Result<Vec<A>> {
    Ok(match to {
        SkinnyTo::QkvIntoCache { kv, slots, .. } => {
            if n % 3 != 0 {
                return Err(CudaError::Invalid(format!(
                    "nt product into the cache: {n} outputs are not a QKV product's 3 x C"
                )));
            }
            need("nt product slots", slots.1, m)?;
            vec![
                A::P(kv.k),
                A::P(kv.v),
                A::P(slots.0),
                A::I(i32::from(kv.bf16)),
            ]
        }
        _ => vec![A::P(0), A::P(0), A::P(0), A::I(0)],
    })
}

/// The instance (of 1, 2, 4 and 8 rows) a few rows' product of `m` rows
/// runs: the smallest holding them.
fn instance_for_rows(m: usize) -> usize {
    match m {
        1 => 0,
        2 => 1,
        3..=4 => 2,
        _ => 3,
    }
}

impl MixedKernels {
    /// Compiles (through the cache) and loads the kernels on `device`.
    pub fn load(device: &Device) -> Result<MixedKernels> {
        let module = Module::compile(device, SOURCES[1].0, SOURCES[1].1)?;
        let sms = device.multiprocessors()?;
        let f = |n: &str| module.function(n);
        Ok(MixedKernels {
            ln_forward: f("ln_forward_bf")?,
            ln_backward: f("ln_backward_bf")?,
            ln_backward_fused: [
                (512, f("ln_backward_fused_4")?),
                (768, f("ln_backward_fused_6")?),
                (1024, f("ln_backward_fused_8")?),
            ],
            ln_wide: LN_WIDE
                .iter()
                .map(|&(width, threads)| {
                    let backward = f(&format!("ln_backward_{width}"))?;
                    Ok(LnWide {
                        width,
                        threads,
                        forward: f(&format!("ln_forward_{width}"))?,
                        backward_slots: sms * backward.max_active_blocks(threads, 0)?,
                        backward,
                    })
                })
                .collect::<Result<_>>()?,
            ln_param_partial: f("ln_param_partial_bf")?,
            bias_partial_f32: f("bias_partial_f32")?,
            bias_partial_bf: f("bias_partial_bf")?,
            bias_partial_bf8: f("bias_partial_bf8")?,
            sum_partials: f("sum_partials")?,
            residual_bias: f("residual_bias")?,
            residual_bias_add_bf: f("residual_bias_add_bf")?,
            zero_runs: f("zero_runs")?,
            bias_gelu: f("bias_gelu_bf")?,
            gelu_backward_bias: f("gelu_backward_bias_bf")?,
            to_bf16: f("to_bf16")?,
            skinny_gemm: [
                f("skinny_gemm_bf_1")?,
                f("skinny_gemm_bf_2")?,
                f("skinny_gemm_bf_4")?,
                f("skinny_gemm_bf_8")?,
            ],
            nt_gemm: [
                f("nt_gemm_bf_1")?,
                f("nt_gemm_bf_2")?,
                f("nt_gemm_bf_4")?,
                f("nt_gemm_bf_8")?,
            ],
            nt_ln_gemm: [
                f("nt_ln_gemm_bf_1")?,
                f("nt_ln_gemm_bf_2")?,
                f("nt_ln_gemm_bf_4")?,
                f("nt_ln_gemm_bf_8")?,
            ],
            nt_mlp: [
                f("nt_mlp_bf_1")?,
                f("nt_mlp_bf_2")?,
                f("nt_mlp_bf_4")?,
                f("nt_mlp_bf_8")?,
            ],
            sms,
            overlap: false,
            nt_blocks_per_sm: 0,
            nt_ln_blocks_per_sm: 2,
            nt_start: None,
            permute_qkv: f("permute_qkv_bf")?,
            unpermute: f("unpermute_bf")?,
            permute_grad: f("permute_grad_bf")?,
            unpermute_qkv_grad: f("unpermute_qkv_grad_bf")?,
            softmax_forward: f("softmax_causal_forward_bf")?,
            softmax_backward: f("softmax_causal_backward_bf")?,
            softmax_cross_entropy: f("softmax_cross_entropy_bf")?,
            softmax_cross_entropy_rows: f("softmax_cross_entropy_rows_bf")?,
            ce_rows: ce_rows_from_env()?,
            vocab_row_max: f("vocab_row_max_bf")?,
            vocab_row_sums: f("vocab_row_sums_bf")?,
            vocab_softmax_ce: f("vocab_softmax_ce_bf")?,
            adamw_multi: f("adamw_multi")?,
            adamw_multi4: f("adamw_multi4")?,
            flash: FlashKernels::load(device)?,
        })
    }

    pub(crate) fn go(
        f: &Function,
        s: &Stream,
        grid: Dim3,
        block: Dim3,
        args: Vec<A>,
    ) -> Result<()> {
        Self::go_shared(f, s, grid, block, 0, args)
    }

    /// [`Self::go`] with `shared` bytes of dynamic shared memory.
    pub(crate) fn go_shared(
        f: &Function,
        s: &Stream,
        grid: Dim3,
        block: Dim3,
        shared: u32,
        mut args: Vec<A>,
    ) -> Result<()> {
        let mut p = ptrs(&mut args);
        // SAFETY: every launcher passes the kernel's parameters in order,
        // with buffers checked against the shape (and the shared memory
        // its kernel declares); cuLaunchKernel copies the argument values
        // before returning.
        unsafe { f.launch(grid, block, shared, s, &mut p) }
    }

    /// A column reduction's grid: 32-column tiles × row chunks, blocks of
    /// 32 × 8 threads.
    fn column_grid(what: &str, n: usize, c: usize) -> Result<(Dim3, Dim3)> {
        let chunks = grid_y(what, n.div_ceil(ROWS_PER_BLOCK), ROWS_PER_BLOCK)?;
        Ok(((c.div_ceil(32) as u32, chunks, 1), (32, 8, 1)))
    }

    pub(crate) fn elementwise(
        &self,
        f: &Function,
        s: &Stream,
        total: usize,
        args: Vec<A>,
    ) -> Result<()> {
        Self::go(f, s, blocks(total, BLOCK as usize)?, (BLOCK, 1, 1), args)
    }

    pub(crate) fn rows(&self, f: &Function, s: &Stream, rows: usize, args: Vec<A>) -> Result<()> {
        Self::go(f, s, blocks(rows, WARPS)?, (BLOCK, 1, 1), args)
    }

    /// `out` (bf16) = LayerNorm of the f32 rows of `inp`; mean and rstd kept.
    #[allow(clippy::too_many_arguments)]
    pub fn layernorm_forward(
        &self,
        s: &Stream,
        out: &mut impl DeviceMem<bf16>,
        mean: &mut impl DeviceMem<f32>,
        rstd: &mut impl DeviceMem<f32>,
        inp: &impl DeviceMem<f32>,
        w: &impl DeviceMem<f32>,
        b: &impl DeviceMem<f32>,
        n: usize,
        c: usize,
    ) -> Result<()> {
        need("layernorm out", out.dlen(), n * c)?;
        need("layernorm inp", inp.dlen(), n * c)?;
        need("layernorm stats", mean.dlen().min(rstd.dlen()), n)?;
        need("layernorm params", w.dlen().min(b.dlen()), c)?;
        let mut args = vec![
            A::P(out.dptr()),
            A::P(mean.dptr()),
            A::P(rstd.dptr()),
            A::P(inp.dptr()),
            A::P(w.dptr()),
            A::P(b.dptr()),
        ];
        let vector = [out.dptr(), inp.dptr(), w.dptr(), b.dptr()];
        match self.ln_wide_for(c) {
            Some(k) if n > 0 && aligned16(&vector) => {
                self.go_decode(&k.forward, s, blocks(n, 1)?, (k.threads, 1, 1), args)
            }
            _ => {
                args.extend([A::I(n as i32), A::I(c as i32)]);
                let grid = blocks(n, WARPS)?;
                self.go_decode(&self.ln_forward, s, grid, (BLOCK, 1, 1), args)
            }
        }
    }

    /// Launches the decode step's kernels that wait for the one ahead
    /// (the LayerNorm forward, the skinny products) overlapping it
    /// ([`Function::launch_overlapping`]), from now on; `false` launches
    /// them as every other kernel.
    pub fn set_overlap(&mut self, on: bool) {
        self.overlap = on;
    }

    /// Caps an NT product's grid at `per_sm` blocks a multiprocessor, each
    /// looping over its groups of outputs (leaving room for the next
    /// product's blocks to start early where launches overlap); 0, the
    /// default, launches a block per group. The sums do not change.
    pub fn set_nt_blocks_per_sm(&mut self, per_sm: usize) {
        self.nt_blocks_per_sm = per_sm;
    }

    /// The cap of [`set_nt_blocks_per_sm`](Self::set_nt_blocks_per_sm)
    /// for the NT products that normalise their rows themselves
    /// ([`nt_ln_product`](Self::nt_ln_product)): every block normalises
    /// the rows before its first group, so a grid of many waves normalises
    /// them many times over; capped, each block does it once. 0: a block
    /// per group. The sums do not change.
    pub fn set_nt_ln_blocks_per_sm(&mut self, per_sm: usize) {
        self.nt_ln_blocks_per_sm = per_sm;
    }

    /// How NT products start from now on ([`NtStart`]; `None`: each by
    /// its weights' size, [`NtStart::for_weights`]; the sums do not
    /// change).
    pub fn set_nt_start(&mut self, start: Option<NtStart>) {
        self.nt_start = start;
    }

    /// [`Self::go`], overlapping the kernel ahead where
    /// [`set_overlap`](Self::set_overlap) said so: only for kernels that
    /// call `overlap_wait` before touching memory the work ahead touches.
    fn go_decode(
        &self,
        f: &Function,
        s: &Stream,
        grid: Dim3,
        block: Dim3,
        args: Vec<A>,
    ) -> Result<()> {
        self.go_decode_shared(f, s, grid, block, 0, args)
    }

    /// [`Self::go_decode`] with `shared` bytes of dynamic shared memory.
    fn go_decode_shared(
        &self,
        f: &Function,
        s: &Stream,
        grid: Dim3,
        block: Dim3,
        shared: u32,
        mut args: Vec<A>,
    ) -> Result<()> {
        if !self.overlap {
            return Self::go_shared(f, s, grid, block, shared, args);
        }
        let mut p = ptrs(&mut args);
        // SAFETY: as go's; and the launchers that come here pass kernels
        // that wait for the kernel ahead before any access but reading
        // weights (ln_forward_bf, ln_forward_<width>, skinny_gemm_bf_<R>,
        // nt_gemm_bf_<R>, nt_ln_gemm_bf_<R>, nt_mlp_bf_<R>), with the
        // shared memory their launchers size.
        unsafe { f.launch_overlapping(grid, block, shared, s, &mut p) }
    }

    /// Elements of the partial-sum scratch the column reductions of `n`
    /// rows of `c` need (LayerNorm backward: `parts` = 3, bias: 1), at
    /// most: the wide LayerNorm backward may take more rows per block.
    pub fn partial_len(n: usize, c: usize, parts: usize) -> usize {
        let rows = if parts == 3 {
            Self::ln_min_rows_per_block(c)
        } else {
            ROWS_PER_BLOCK
        };
        n.div_ceil(rows).max(1) * c * parts
    }

    /// Fewest rows per partial row of the LayerNorm backward at width `c`.
    fn ln_min_rows_per_block(c: usize) -> usize {
        if Self::ln_fused(c) {
            LN_ROWS_PER_BLOCK
        } else if LN_WIDE.iter().any(|&(w, _)| w == c) {
            LN_WIDE_MIN_ROWS
        } else {
            ROWS_PER_BLOCK
        }
    }

    /// Rows per block of the LayerNorm backward over `n` rows of `c`: the
    /// wide kernels' blocks spread to fill whole waves.
    fn ln_rows_per_block(&self, n: usize, c: usize) -> usize {
        match self.ln_wide_for(c) {
            Some(k) => {
                // Whole waves of at least the fewest rows each.
                let waves = (n / (k.backward_slots * LN_WIDE_MIN_ROWS)).max(1);
                n.div_ceil(k.backward_slots * waves).max(LN_WIDE_MIN_ROWS)
            }
            None => Self::ln_min_rows_per_block(c),
        }
    }

    /// LayerNorm backward: `dres += dx` (f32), `dres_bf` = bf16 copy of the
    /// result, `dw`/`db` += the parameter gradients and, when given,
    /// `dnext` += the column sums of the updated `dres` (the bias gradient
    /// of the projection below), all in a fixed order. With `ln_out`, the
    /// forward output is recomputed there from the kept statistics (the
    /// same bits [`layernorm_forward`](Self::layernorm_forward) wrote), for
    /// the weight gradient of the product it fed. Widths 512, 768 and 1024
    /// (GPT-2 small and medium) and those of `LN_WIDE` (1280 to 5120) take
    /// one fused pass.
    #[allow(clippy::too_many_arguments)]
    pub fn layernorm_backward(
        &self,
        s: &Stream,
        dres: &mut impl DeviceMem<f32>,
        dres_bf: &mut impl DeviceMem<bf16>,
        ln_out: Option<&mut dyn DeviceMem<bf16>>,
        dw: &mut impl DeviceMem<f32>,
        db: &mut impl DeviceMem<f32>,
        dnext: Option<&mut dyn DeviceMem<f32>>,
        partial: &mut impl DeviceMem<f32>,
        dout: &impl DeviceMem<bf16>,
        inp: &impl DeviceMem<f32>,
        w: &impl DeviceMem<f32>,
        b: &impl DeviceMem<f32>,
        mean: &impl DeviceMem<f32>,
        rstd: &impl DeviceMem<f32>,
        n: usize,
        c: usize,
    ) -> Result<()> {
        need("layernorm dres", dres.dlen().min(dres_bf.dlen()), n * c)?;
        need("layernorm dout", dout.dlen().min(inp.dlen()), n * c)?;
        need(
            "layernorm param grads",
            dw.dlen().min(db.dlen()).min(w.dlen()).min(b.dlen()),
            c,
        )?;
        need("layernorm stats", mean.dlen().min(rstd.dlen()), n)?;
        if let Some(d) = &dnext {
            need("layernorm next bias grad", d.dlen(), c)?;
        }
        if let Some(o) = &ln_out {
            need("layernorm recomputed output", o.dlen(), n * c)?;
        }
        need(
            "layernorm partials",
            partial.dlen(),
            Self::partial_len(n, c, 3),
        )?;
        let lnout = ln_out.map_or(0, |o| o.dptr());
        // Every kernel starts (dres, dres_bf, lnout, dout, inp, w, bias,
        // mean, rstd, N).
        let mut args = vec![
            A::P(dres.dptr()),
            A::P(dres_bf.dptr()),
            A::P(lnout),
            A::P(dout.dptr()),
            A::P(inp.dptr()),
            A::P(w.dptr()),
            A::P(b.dptr()),
            A::P(mean.dptr()),
            A::P(rstd.dptr()),
            A::I(n as i32),
        ];
        let vector = [
            dres.dptr(),
            dres_bf.dptr(),
            lnout,
            dout.dptr(),
            inp.dptr(),
            w.dptr(),
            b.dptr(),
        ];
        let fused = match (self.ln_fused_for(c), self.ln_wide_for(c)) {
            (Some(f), _) => Some((f, 128)),
            (_, Some(k)) => Some((&k.backward, k.threads)),
            _ => None,
        };
        if let Some((f, threads)) = fused.filter(|_| aligned16(&vector)) {
            let rows = self.ln_rows_per_block(n, c);
            let nblocks = n.div_ceil(rows).max(1);
            args.extend([A::P(partial.dptr()), A::I(rows as i32)]);
            Self::go(f, s, blocks(nblocks, 1)?, (threads, 1, 1), args)?;
            // The fused kernels write all three parts of every partial
            // row, the next bias gradient's too: read them as three wide,
            // even where that gradient is not wanted (a model's bottom
            // layer).
            let next = dnext.map_or(0, |d| d.dptr());
            return self.sum_partials(s, [dw.dptr(), db.dptr(), next], partial, nblocks, c, 3);
        }
        let nblocks = n.div_ceil(ROWS_PER_BLOCK).max(1);
        args.push(A::I(c as i32));
        self.rows(&self.ln_backward, s, n, args)?;
        let args = vec![
            A::P(partial.dptr()),
            A::P(dout.dptr()),
            A::P(inp.dptr()),
            A::P(mean.dptr()),
            A::P(rstd.dptr()),
            A::I(n as i32),
            A::I(c as i32),
            A::I(ROWS_PER_BLOCK as i32),
        ];
        let (grid, block) = Self::column_grid("layernorm backward", n, c)?;
        Self::go(&self.ln_param_partial, s, grid, block, args)?;
        self.sum_partials(s, [dw.dptr(), db.dptr(), 0], partial, nblocks, c, 2)?;
        if let Some(d) = dnext {
            self.bias_backward_f32(s, d, partial, &*dres, n, c)?;
        }
        Ok(())
    }

    /// Whether widths of `c` take the fused LayerNorm backward.
    fn ln_fused(c: usize) -> bool {
        matches!(c, 512 | 768 | 1024)
    }

    /// The wide LayerNorm kernels for width `c`, if there are some.
    fn ln_wide_for(&self, c: usize) -> Option<&LnWide> {
        self.ln_wide.iter().find(|k| k.width == c)
    }

    /// The fused LayerNorm backward for width `c`, if there is one.
    fn ln_fused_for(&self, c: usize) -> Option<&Function> {
        self.ln_backward_fused
            .iter()
            .find(|(w, _)| *w == c)
            .map(|(_, f)| f)
    }

    /// Adds the sums over `nblocks` partial rows of `stride × c` columns
    /// (as wide as the kernel that wrote them made them) to the
    /// destinations (device addresses of `c` f32 values each, checked by
    /// the callers; 0 for none: the trailing ones are not summed), in
    /// order.
    fn sum_partials(
        &self,
        s: &Stream,
        dst: [u64; 3],
        partial: &impl DeviceMem<f32>,
        nblocks: usize,
        c: usize,
        stride: usize,
    ) -> Result<()> {
        let parts = 3 - dst.iter().rev().take_while(|&&d| d == 0).count();
        debug_assert!(
            parts <= stride,
            "{parts} parts of partial rows {stride} wide"
        );
        let args = vec![
            A::P(dst[0]),
            A::P(dst[1]),
            A::P(dst[2]),
            A::P(partial.dptr()),
            A::I(nblocks as i32),
            A::I(c as i32),
            A::I(parts as i32),
            A::I(stride as i32),
        ];
        let tiles = blocks(c * parts, 32)?;
        Self::go(&self.sum_partials, s, tiles, (32, 8, 1), args)
    }

    /// `dbias += column sums of dout` (f32 rows), in a fixed order.
    pub fn bias_backward_f32(
        &self,
        s: &Stream,
        dbias: &mut dyn DeviceMem<f32>,
        partial: &mut impl DeviceMem<f32>,
        dout: &impl DeviceMem<f32>,
        n: usize,
        c: usize,
    ) -> Result<()> {
        need("bias grad", dbias.dlen(), c)?;
        need("bias dout", dout.dlen(), n * c)?;
        self.bias_backward(s, &self.bias_partial_f32, dbias, partial, dout.dptr(), n, c)
    }

    /// `dbias += column sums of dout` (bf16 rows), in a fixed order.
    pub fn bias_backward_bf(
        &self,
        s: &Stream,
        dbias: &mut impl DeviceMem<f32>,
        partial: &mut impl DeviceMem<f32>,
        dout: &impl DeviceMem<bf16>,
        n: usize,
        c: usize,
    ) -> Result<()> {
        need("bias grad", dbias.dlen(), c)?;
        need("bias dout", dout.dlen(), n * c)?;
        if c % 8 != 0 || dout.dptr() % 16 != 0 {
            return self.bias_backward(s, &self.bias_partial_bf, dbias, partial, dout.dptr(), n, c);
        }
        // 8 columns per thread: the same partial sums, 4x fewer loads.
        need("bias partials", partial.dlen(), Self::partial_len(n, c, 1))?;
        let (grid, block) = Self::column_grid("bias backward", n, c)?;
        let grid = (c.div_ceil(256) as u32, grid.1, 1);
        let args = vec![
            A::P(partial.dptr()),
            A::P(dout.dptr()),
            A::I(n as i32),
            A::I(c as i32),
            A::I(ROWS_PER_BLOCK as i32),
        ];
        Self::go(&self.bias_partial_bf8, s, grid, block, args)?;
        let nblocks = n.div_ceil(ROWS_PER_BLOCK).max(1);
        self.sum_partials(s, [dbias.dptr(), 0, 0], partial, nblocks, c, 1)
    }

    #[allow(clippy::too_many_arguments)]
    fn bias_backward(
        &self,
        s: &Stream,
        f: &Function,
        dbias: &mut dyn DeviceMem<f32>,
        partial: &mut impl DeviceMem<f32>,
        dout: u64,
        n: usize,
        c: usize,
    ) -> Result<()> {
        need("bias partials", partial.dlen(), Self::partial_len(n, c, 1))?;
        let nblocks = n.div_ceil(ROWS_PER_BLOCK).max(1);
        let args = vec![
            A::P(partial.dptr()),
            A::P(dout),
            A::I(n as i32),
            A::I(c as i32),
            A::I(ROWS_PER_BLOCK as i32),
        ];
        let (grid, block) = Self::column_grid("bias backward", n, c)?;
        Self::go(f, s, grid, block, args)?;
        self.sum_partials(s, [dbias.dptr(), 0, 0], partial, nblocks, c, 1)
    }

    /// `out = x + bias` over rows of `c` (f32).
    pub fn residual_bias(
        &self,
        s: &Stream,
        out: &mut impl DeviceMem<f32>,
        x: &impl DeviceMem<f32>,
        bias: &impl DeviceMem<f32>,
        n: usize,
        c: usize,
    ) -> Result<()> {
        need("residual", out.dlen().min(x.dlen()), n * c)?;
        need("residual bias", bias.dlen(), c)?;
        for (r0, rows) in row_launches(n, c) {
            let at = (r0 * c * 4) as u64;
            let args = vec![
                A::P(out.dptr() + at),
                A::P(x.dptr() + at),
                A::P(bias.dptr()),
                A::I((rows * c) as i32),
                A::I(c as i32),
            ];
            self.elementwise(&self.residual_bias, s, rows * c, args)?;
        }
        Ok(())
    }

    /// `out = (x + bias) + part`: `x` and `out` f32 rows of `c`, `bias`
    /// broadcast over the `n` rows, `part` bf16 (a row-split product
    /// summed over the tensor group in bf16).
    #[allow(clippy::too_many_arguments)]
    pub fn residual_bias_add(
        &self,
        s: &Stream,
        out: &mut impl DeviceMem<f32>,
        x: &impl DeviceMem<f32>,
        bias: &impl DeviceMem<f32>,
        part: &impl DeviceMem<bf16>,
        n: usize,
        c: usize,
    ) -> Result<()> {
        need("residual", out.dlen().min(x.dlen()), n * c)?;
        need("residual bias", bias.dlen(), c)?;
        need("summed product", part.dlen(), n * c)?;
        for (r0, rows) in row_launches(n, c) {
            let at = (r0 * c) as u64;
            let args = vec![
                A::P(out.dptr() + 4 * at),
                A::P(x.dptr() + 4 * at),
                A::P(bias.dptr()),
                A::P(part.dptr() + 2 * at),
                A::I((rows * c) as i32),
                A::I(c as i32),
            ];
            self.elementwise(&self.residual_bias_add_bf, s, rows * c, args)?;
        }
        Ok(())
    }

    /// Zeroes `runs`' elements of `g` (a buffer of `runs.len()` f32s) in
    /// one launch.
    pub fn zero_runs(
        &self,
        s: &Stream,
        g: &mut impl DeviceMem<f32>,
        runs: &ZeroRuns,
    ) -> Result<()> {
        if g.dlen() != runs.len {
            return Err(CudaError::Invalid(format!(
                "zero_runs: a buffer of {} elements for runs within {}",
                g.dlen(),
                runs.len
            )));
        }
        if runs.count == 0 {
            return Ok(());
        }
        let args = vec![
            A::P(g.dptr()),
            A::P(runs.runs.dptr()),
            A::I(runs.count as i32),
        ];
        Self::go(
            &self.zero_runs,
            s,
            (runs.count as u32, 1, 1),
            (BLOCK, 1, 1),
            args,
        )
    }

    /// `pre += bias` (bf16, in place) and `out = gelu(pre)`.
    pub fn bias_gelu(
        &self,
        s: &Stream,
        pre: &mut impl DeviceMem<bf16>,
        out: &mut impl DeviceMem<bf16>,
        bias: &impl DeviceMem<f32>,
        n: usize,
        c: usize,
    ) -> Result<()> {
        need("bias_gelu", pre.dlen().min(out.dlen()), n * c)?;
        need("bias_gelu bias", bias.dlen(), c)?;
        even("bias_gelu", c)?;
        for (r0, rows) in row_launches(n, c) {
            let at = (r0 * c * 2) as u64;
            let args = vec![
                A::P(pre.dptr() + at),
                A::P(out.dptr() + at),
                A::P(bias.dptr()),
                A::I((rows * c) as i32),
                A::I(c as i32),
            ];
            self.elementwise(&self.bias_gelu, s, rows * c / 2, args)?;
        }
        Ok(())
    }

    /// `dx *= gelu'(pre)` (bf16, in place, `n` rows of `c`) and `dbias +=`
    /// the column sums of the result, in a fixed order; with `out`, also
    /// `out = gelu(pre)` (the activation recomputed, not kept).
    #[allow(clippy::too_many_arguments)]
    pub fn gelu_backward_bias(
        &self,
        s: &Stream,
        dx: &mut impl DeviceMem<bf16>,
        pre: &impl DeviceMem<bf16>,
        dbias: &mut impl DeviceMem<f32>,
        partial: &mut impl DeviceMem<f32>,
        out: Option<&mut dyn DeviceMem<bf16>>,
        n: usize,
        c: usize,
    ) -> Result<()> {
        need("gelu backward", dx.dlen().min(pre.dlen()), n * c)?;
        let out = match out {
            Some(o) => {
                need("gelu backward activation", o.dlen(), n * c)?;
                o.dptr()
            }
            None => 0,
        };
        self.gelu_backward_launch(s, dx.dptr(), pre.dptr(), out, dbias, partial, n, c)
    }

    /// As [`gelu_backward_bias`](Self::gelu_backward_bias) with the
    /// recomputed activation written over `pre` (whose pre-activation is
    /// not needed after this): the same bits, in no memory of its own.
    #[allow(clippy::too_many_arguments)]
    pub fn gelu_backward_bias_over_pre(
        &self,
        s: &Stream,
        dx: &mut impl DeviceMem<bf16>,
        pre: &mut impl DeviceMem<bf16>,
        dbias: &mut impl DeviceMem<f32>,
        partial: &mut impl DeviceMem<f32>,
        n: usize,
        c: usize,
    ) -> Result<()> {
        need("gelu backward", dx.dlen().min(pre.dlen()), n * c)?;
        self.gelu_backward_launch(s, dx.dptr(), pre.dptr(), pre.dptr(), dbias, partial, n, c)
    }

    /// The GELU backward kernel over `n` rows of `c` at device addresses
    /// `dx`, `pre` and `out` (0: no activation written; it may be `pre`),
    /// then the bias gradient's column sums.
    #[allow(clippy::too_many_arguments)]
    fn gelu_backward_launch(
        &self,
        s: &Stream,
        dx: u64,
        pre: u64,
        out: u64,
        dbias: &mut impl DeviceMem<f32>,
        partial: &mut impl DeviceMem<f32>,
        n: usize,
        c: usize,
    ) -> Result<()> {
        need("gelu backward bias grad", dbias.dlen(), c)?;
        if c % 8 != 0 {
            return Err(CudaError::Invalid(format!(
                "gelu backward: width {c} is not a multiple of 8"
            )));
        }
        let chunks = n.div_ceil(GELU_ROWS_PER_BLOCK).max(1);
        let grid_rows = grid_y("gelu backward", chunks, GELU_ROWS_PER_BLOCK)?;
        need("gelu backward partials", partial.dlen(), chunks * c)?;
        let args = vec![
            A::P(dx),
            A::P(pre),
            A::P(partial.dptr()),
            A::P(out),
            A::I(n as i32),
            A::I(c as i32),
            A::I(GELU_ROWS_PER_BLOCK as i32),
        ];
        let grid = (c.div_ceil(256) as u32, grid_rows, 1);
        Self::go(&self.gelu_backward_bias, s, grid, (256, 1, 1), args)?;
        self.sum_partials(s, [dbias.dptr(), 0, 0], partial, chunks, c, 1)
    }

    /// Elements of partial-sum scratch [`Self::gelu_backward_bias`] needs.
    pub fn gelu_partial_len(n: usize, c: usize) -> usize {
        n.div_ceil(GELU_ROWS_PER_BLOCK).max(1) * c
    }

    /// `y = x · wᵀ (+ bias)` for a few rows (`m` up to [`SKINNY_ROWS`]),
    /// `x` `[m, k]` and `w` `[n, k]` row-major in bf16 (weights stored
    /// output by output: the decoder's transposed copy of a layer's, or the
    /// tied embedding for the logits), `bias` f32 `[n]` or none,
    /// accumulated in f32 and written as `to` says. Each warp takes two
    /// outputs over a slice of K ([`nt_split`], by the shape alone), its
    /// weight rows read contiguously; every sum is reduced in a fixed
    /// order, so a row's result depends on neither the other rows nor
    /// timing. Launched overlapping the kernel ahead where
    /// [`set_overlap`](Self::set_overlap) said so. Returns false, launching
    /// nothing, where the kernel does not apply (more rows, `k` not a
    /// multiple of 8, `x` or `w` not 16-byte aligned).
    #[allow(clippy::too_many_arguments)]
    pub fn nt_product(
        &self,
        s: &Stream,
        to: SkinnyTo,
        x: &impl DeviceMem<bf16>,
        w: &impl DeviceMem<bf16>,
        bias: Option<&dyn DeviceMem<f32>>,
        shape: (usize, usize, usize),
    ) -> Result<bool> {
        self.nt_product_then(s, to, x, w, bias, shape, None)
    }

    /// [`nt_product`](Self::nt_product), then, where `tail` is given, the
    /// LayerNorm of its f32 output by its own grid ([`NtTail`]).
    #[allow(clippy::too_many_arguments)]
    pub fn nt_product_then(
        &self,
        s: &Stream,
        to: SkinnyTo,
        x: &impl DeviceMem<bf16>,
        w: &impl DeviceMem<bf16>,
        bias: Option<&dyn DeviceMem<f32>>,
        (m, n, k): (usize, usize, usize),
        tail: Option<NtTail>,
    ) -> Result<bool> {
        if m == 0
            || m > SKINNY_ROWS
            || n == 0
            || k % 8 != 0
            || !aligned16(&[x.dptr(), w.dptr()])
            || n > i32::MAX as usize
            || k > i32::MAX as usize
        {
            return Ok(false);
        }
        need("nt product x", x.dlen(), m * k)?;
        let (mut args, mode) = product_outputs("nt product", to, m * n)?;
        args.push(A::P(x.dptr()));
        let launch = (0, self.nt_blocks_per_sm);
        self.nt_launch(
            &self.nt_gemm,
            s,
            (args, mode, to, tail),
            w,
            bias,
            (m, n, k),
            launch,
        )
    }

    /// [`nt_product`](Self::nt_product) of `LayerNorm(xf)` (f32 rows,
    /// scale `lw`, shift `lb`, epsilon 1e-5): every block normalises the
    /// rows into bf16 in its shared memory first, so the LayerNorm needs
    /// no kernel of its own. False, launching nothing, where the product
    /// does not apply or the rows do not fit the default 48 KiB of shared
    /// memory (8 rows of up to 3,072).
    #[allow(clippy::too_many_arguments)]
    pub fn nt_ln_product(
        &self,
        s: &Stream,
        to: SkinnyTo,
        xf: &impl DeviceMem<f32>,
        (lw, lb): (&impl DeviceMem<f32>, &impl DeviceMem<f32>),
        w: &impl DeviceMem<bf16>,
        bias: Option<&dyn DeviceMem<f32>>,
        (m, n, k): (usize, usize, usize),
    ) -> Result<bool> {
        let shared = m * k * std::mem::size_of::<bf16>();
        if m == 0
            || m > SKINNY_ROWS
            || n == 0
            || k % 8 != 0
            || shared > 48 << 10
            || !aligned16(&[w.dptr()])
            || n > i32::MAX as usize
        {
            return Ok(false);
        }
        need("nt product rows", xf.dlen(), m * k)?;
        need("nt product LayerNorm", lw.dlen().min(lb.dlen()), k)?;
        let (mut args, mode) = product_outputs("nt product", to, m * n)?;
        args.extend([A::P(xf.dptr()), A::P(lw.dptr()), A::P(lb.dptr())]);
        let launch = (shared as u32, self.nt_ln_blocks_per_sm);
        self.nt_launch(
            &self.nt_ln_gemm,
            s,
            (args, mode, to, None),
            w,
            bias,
            (m, n, k),
            launch,
        )
    }

    /// A layer's MLP half for `m` rows (up to [`SKINNY_ROWS`]) in one
    /// kernel whose blocks meet at grid-wide barriers (mixed.cu's
    /// `nt_mlp_bf_<R>`): `x2 = att · Wp + bp + x`, `h = gelu(LayerNorm(x2)
    /// · Wf + bf)` in bf16, `out = h · Wo + bo + x2`, the weights stored
    /// `[out, in]` (the NT layout), widths `c` and `f` (the MLP's). Each
    /// product's sums are the NT kernel's and the LayerNorm's those of
    /// [`nt_ln_product`](Self::nt_ln_product). `barrier` holds two
    /// counters (i32, read as unsigned) that must be zero at launch (the
    /// kernel leaves them so); the grid is a block a multiprocessor at
    /// most, so it is resident at once. Returns false, launching nothing,
    /// where the kernel does not apply (more rows, widths not multiples of
    /// 8, a LayerNorm's rows past 48 KiB of shared memory, unaligned rows
    /// or weights).
    pub fn nt_mlp(
        &self,
        s: &Stream,
        mlp: &NtMlp,
        barrier: &impl DeviceMem<i32>,
        (m, c, f): (usize, usize, usize),
    ) -> Result<bool> {
        let shared = m * c * std::mem::size_of::<bf16>();
        if m == 0
            || m > SKINNY_ROWS
            || c % 8 != 0
            || f % 8 != 0
            || shared > 48 << 10
            || f > i32::MAX as usize
            || !aligned16(&[mlp.att.0, mlp.h.0, mlp.wp.0, mlp.wf.0, mlp.wo.0])
        {
            return Ok(false);
        }
        // The buffers in the kernel's order, each with the elements it needs.
        let buffers = [
            ("mlp x2", mlp.x2, m * c),
            ("mlp h", mlp.h, m * f),
            ("mlp out", mlp.out, m * c),
            ("mlp att", mlp.att, m * c),
            ("mlp x", mlp.x, m * c),
            ("mlp proj weights", mlp.wp, c * c),
            ("mlp proj bias", mlp.bp, c),
            ("mlp LayerNorm scale", mlp.lw, c),
            ("mlp LayerNorm shift", mlp.lb, c),
            ("mlp fc weights", mlp.wf, f * c),
            ("mlp fc bias", mlp.bf, f),
            ("mlp fc projection weights", mlp.wo, c * f),
            ("mlp fc projection bias", mlp.bo, c),
        ];
        for (what, (_, len), want) in buffers {
            need(what, len, want)?;
        }
        need("mlp barrier", barrier.dlen(), 2)?;
        let (kwp, kwf, kwo) = (
            nt_split(c, c, self.sms),
            nt_split(f, c, self.sms),
            nt_split(c, f, self.sms),
        );
        let mut args: Vec<A> = buffers.iter().map(|(_, (at, _), _)| A::P(*at)).collect();
        args.push(A::P(barrier.dptr()));
        args.extend([m, c, f, kwp, kwf, kwo].map(|v| A::I(v as i32)));
        let grid = (self.sms as u32, 1, 1);
        let threads = (NT_WARPS * 32) as u32;
        let which = instance_for_rows(m);
        self.go_decode_shared(
            &self.nt_mlp[which],
            s,
            grid,
            (threads, 1, 1),
            shared as u32,
            args,
        )?;
        Ok(true)
    }

    /// Launches an NT product's instance for `m` rows: `args` its outputs
    /// and input so far (with its epilogue's mode, its target `to` and its
    /// LayerNorm after it, `tail`), the weights, bias, shape and the
    /// arguments after the shape (the cache's, [`nt_cache_args`], then the
    /// tail's, [`nt_tail_args`]) added here; its dynamic shared memory and
    /// its grid's cap in blocks a multiprocessor (0: a block per group of
    /// outputs).
    #[allow(clippy::too_many_arguments)]
    fn nt_launch(
        &self,
        instances: &[Function; 4],
        s: &Stream,
        (mut args, mode, to, tail): (Vec<A>, i32, SkinnyTo, Option<NtTail>),
        w: &impl DeviceMem<bf16>,
        bias: Option<&dyn DeviceMem<f32>>,
        (m, n, k): (usize, usize, usize),
        (shared, per_sm): (u32, usize),
    ) -> Result<bool> {
        need("nt product w", w.dlen(), n * k)?;
        if let Some(b) = bias {
            need("nt product bias", b.dlen(), n)?;
        }
        let kw = nt_split(n, k, self.sms);
        let per_block = NT_OUT * NT_WARPS / kw;
        args.extend([
            A::P(w.dptr()),
            A::P(bias.map_or(0, |b| b.dptr())),
            A::I(m as i32),
            A::I(n as i32),
            A::I(k as i32),
            A::I(kw as i32),
            A::I(mode),
            A::I(
                self.nt_start
                    .unwrap_or_else(|| NtStart::for_weights(n * k * std::mem::size_of::<bf16>()))
                    .bits(),
            ),
        ]);
        args.extend(nt_cache_args(to, m, n)?);
        args.extend(nt_tail_args(tail, to, m, n)?);
        let groups = n.div_ceil(per_block);
        let blocks = match per_sm {
            0 => groups,
            per_sm => groups.min(per_sm * self.sms),
        };
        let grid = (blocks as u32, 1, 1);
        let which = instance_for_rows(m);
        let threads = (NT_WARPS * 32) as u32;
        self.go_decode_shared(&instances[which], s, grid, (threads, 1, 1), shared, args)?;
        Ok(true)
    }

    /// `y = x · w + bias` for a few rows (`m` up to [`SKINNY_ROWS`]), `x`
    /// `[m, k]` and `w` `[k, n]` row-major in bf16, `bias` f32 `[n]`,
    /// accumulated in f32 and written as `to` says: a decode step's
    /// products at batch sizes where cuBLASLt's tiles leave most of the
    /// GPU idle. K is split over blocks ([`skinny_layout`], by the shape
    /// alone), each split's sums kept in `scratch` and added in order by
    /// the tile's last block; every sum is reduced in a fixed order, so a
    /// row's result depends on neither the other rows nor timing. Returns
    /// false, launching nothing, where the kernel does not apply (more
    /// rows, `n` or `k` not a multiple of 8, `x` or `w` not 16-byte
    /// aligned, a product into the cache).
    #[allow(clippy::too_many_arguments)]
    pub fn skinny_product(
        &self,
        s: &Stream,
        scratch: &mut SkinnyScratch,
        to: SkinnyTo,
        x: &impl DeviceMem<bf16>,
        w: &impl DeviceMem<bf16>,
        bias: &impl DeviceMem<f32>,
        (m, n, k): (usize, usize, usize),
    ) -> Result<bool> {
        if m == 0
            || m > SKINNY_ROWS
            || n % 8 != 0
            || k % 8 != 0
            || !aligned16(&[x.dptr(), w.dptr()])
            || n > i32::MAX as usize
            || k > i32::MAX as usize
            || matches!(to, SkinnyTo::QkvIntoCache { .. })
        {
            return Ok(false);
        }
        need("skinny product x", x.dlen(), m * k)?;
        need("skinny product w", w.dlen(), k * n)?;
        need("skinny product bias", bias.dlen(), n)?;
        let (mut args, mode) = product_outputs("skinny product", to, m * n)?;
        let (splits, split_rows) = skinny_layout(n, k, self.sms);
        let tiles = n.div_ceil(SKINNY_TILE);
        need(
            "skinny product scratch",
            scratch.partials.len(),
            splits * m * n,
        )?;
        need("skinny product counters", scratch.counters.len(), tiles)?;
        args.extend([
            A::P(x.dptr()),
            A::P(w.dptr()),
            A::P(bias.dptr()),
            A::I(m as i32),
            A::I(n as i32),
            A::I(k as i32),
            A::I((SKINNY_TILE / 8) as i32),
            A::I(mode),
            A::P(scratch.partials.dptr()),
            A::P(scratch.counters.dptr()),
            A::I(splits as i32),
            A::I(split_rows as i32),
        ]);
        let grid = (tiles as u32, splits as u32, 1);
        let which = instance_for_rows(m);
        self.go_decode(&self.skinny_gemm[which], s, grid, (256, 1, 1), args)?;
        Ok(true)
    }

    /// `out = bf16(x)`.
    pub fn to_bf16(
        &self,
        s: &Stream,
        out: &mut impl DeviceMem<bf16>,
        x: &impl DeviceMem<f32>,
    ) -> Result<()> {
        need("to_bf16", out.dlen(), x.dlen())?;
        let n = x.dlen();
        let args = vec![A::P(out.dptr()), A::P(x.dptr()), A::L(n as i64)];
        self.elementwise(&self.to_bf16, s, n, args)
    }

    /// Loss per row of `logits` (`n` rows of `v`, row stride `ld`, bf16);
    /// with `scale != 0` the logits become `scale * (softmax - onehot)`.
    #[allow(clippy::too_many_arguments)]
    pub fn softmax_cross_entropy(
        &self,
        s: &Stream,
        logits: &mut impl DeviceMem<bf16>,
        losses: &mut impl DeviceMem<f32>,
        targets: &impl DeviceMem<i32>,
        n: usize,
        v: usize,
        ld: usize,
        scale: f32,
    ) -> Result<()> {
        need("logits", logits.dlen(), n * ld)?;
        need("losses", losses.dlen().min(targets.dlen()), n)?;
        if ld < v {
            return Err(CudaError::Invalid(format!(
                "logits row stride {ld} < vocabulary {v}"
            )));
        }
        let args = vec![
            A::P(logits.dptr()),
            A::P(losses.dptr()),
            A::P(targets.dptr()),
            A::I(n as i32),
            A::I(v as i32),
            A::I(ld as i32),
            A::F(scale),
        ];
        if self.ce_rows && ce_rows_take(ld) {
            let grid = (u32::try_from(n).map_err(|_| too_many_rows(n))?, 1, 1);
            return Self::go(
                &self.softmax_cross_entropy_rows,
                s,
                grid,
                (CE_T, 1, 1),
                args,
            );
        }
        self.rows(&self.softmax_cross_entropy, s, n, args)
    }

    /// Sets whether the loss uses the block-per-row kernel (where the row
    /// fits it; `BRAID_CE=rows` at load).
    pub fn set_ce_rows(&mut self, on: bool) {
        self.ce_rows = on;
    }

    /// A tensor-parallel rank's bf16 logits (`n` rows of `ld`, this rank's
    /// `rows.v` of the vocabulary): each row's maximum into `mx`.
    pub fn vocab_row_max(
        &self,
        s: &Stream,
        logits: &impl DeviceMem<bf16>,
        mx: &mut impl DeviceMem<f32>,
        n: usize,
        v: usize,
        ld: usize,
    ) -> Result<()> {
        need("logits", logits.dlen(), n * ld)?;
        need("row maxima", mx.dlen(), n)?;
        let args = vec![
            A::P(logits.dptr()),
            A::P(mx.dptr()),
            A::I(n as i32),
            A::I(v as i32),
            A::I(ld as i32),
        ];
        self.rows(&self.vocab_row_max, s, n, args)
    }

    /// After the group's maxima: `sums[row]` this rank's sum of
    /// exponentials, `sums[n + row]` its target's logit minus the maximum
    /// where this rank holds the target.
    #[allow(clippy::too_many_arguments)]
    pub fn vocab_row_sums(
        &self,
        s: &Stream,
        logits: &impl DeviceMem<bf16>,
        mx: &impl DeviceMem<f32>,
        sums: &mut impl DeviceMem<f32>,
        targets: &impl DeviceMem<i32>,
        n: usize,
        rows: VocabRows,
        ld: usize,
    ) -> Result<()> {
        need("logits", logits.dlen(), n * ld)?;
        need("row sums", sums.dlen(), 2 * n)?;
        need("row maxima", mx.dlen().min(targets.dlen()), n)?;
        let args = vec![
            A::P(logits.dptr()),
            A::P(mx.dptr()),
            A::P(sums.dptr()),
            A::P(targets.dptr()),
            A::I(n as i32),
            A::I(rows.v as i32),
            A::I(ld as i32),
            A::I(rows.first as i32),
        ];
        self.rows(&self.vocab_row_sums, s, n, args)
    }

    /// After the group's sums: each row's loss over the whole vocabulary,
    /// and (scale ≠ 0) this rank's logits become `scale · (softmax −
    /// onehot)`, the padding past its rows zero.
    #[allow(clippy::too_many_arguments)]
    pub fn vocab_softmax_ce(
        &self,
        s: &Stream,
        logits: &mut impl DeviceMem<bf16>,
        losses: &mut impl DeviceMem<f32>,
        mx: &impl DeviceMem<f32>,
        sums: &impl DeviceMem<f32>,
        targets: &impl DeviceMem<i32>,
        n: usize,
        rows: VocabRows,
        ld: usize,
        scale: f32,
    ) -> Result<()> {
        need("logits", logits.dlen(), n * ld)?;
        need("row sums", sums.dlen(), 2 * n)?;
        need(
            "losses",
            losses.dlen().min(targets.dlen()).min(mx.dlen()),
            n,
        )?;
        let args = vec![
            A::P(logits.dptr()),
            A::P(losses.dptr()),
            A::P(mx.dptr()),
            A::P(sums.dptr()),
            A::P(targets.dptr()),
            A::I(n as i32),
            A::I(rows.v as i32),
            A::I(ld as i32),
            A::I(rows.first as i32),
            A::F(scale),
        ];
        self.rows(&self.vocab_softmax_ce, s, n, args)
    }

    /// One AdamW step over the whole flat buffer (see [`AdamSegments`]);
    /// the gradient is scaled by `gscale` first; `pb` gets the bf16 copy.
    #[allow(clippy::too_many_arguments)]
    pub fn adamw_multi(
        &self,
        s: &Stream,
        p: &mut impl DeviceMem<f32>,
        pb: Option<&mut dyn DeviceMem<bf16>>,
        g: &impl DeviceMem<f32>,
        m: &mut impl DeviceMem<f32>,
        v: &mut impl DeviceMem<f32>,
        segs: &AdamSegments,
        h: AdamStep,
    ) -> Result<()> {
        let n = p.dlen();
        need("adamw g/m/v", g.dlen().min(m.dlen()).min(v.dlen()), n)?;
        if segs.total != n {
            return Err(CudaError::Invalid(format!(
                "adamw: segments cover {} elements, parameters {n}",
                segs.total
            )));
        }
        let pbp = match pb {
            Some(b) => {
                need("adamw bf16 copy", b.dlen(), n)?;
                b.dptr()
            }
            None => 0,
        };
        let args = vec![
            A::P(p.dptr()),
            A::P(pbp),
            A::P(g.dptr()),
            A::P(m.dptr()),
            A::P(v.dptr()),
            A::L(n as i64),
            A::P(segs.ends.dptr()),
            A::P(segs.decay.dptr()),
            A::I(segs.ends.dlen() as i32),
            A::F(h.lr),
            A::F(h.beta1),
            A::F(h.beta2),
            A::F(1.0 - h.beta1.powi(h.step)),
            A::F(1.0 - h.beta2.powi(h.step)),
            A::F(h.eps),
            A::F(h.grad_scale),
        ];
        // Four elements per thread where every buffer allows 16-byte
        // accesses (the flat buffers always do; views may not).
        let aligned = [p.dptr(), g.dptr(), m.dptr(), v.dptr()]
            .iter()
            .all(|a| a % 16 == 0)
            && pbp % 8 == 0;
        if aligned {
            self.elementwise(&self.adamw_multi4, s, n.div_ceil(4), args)
        } else {
            self.elementwise(&self.adamw_multi, s, n, args)
        }
    }
}

/// The hyperparameters of one AdamW step.
#[derive(Debug, Clone, Copy)]
pub struct AdamStep {
    /// Learning rate.
    pub lr: f32,
    /// First-moment decay.
    pub beta1: f32,
    /// Second-moment decay.
    pub beta2: f32,
    /// Step number, from 1.
    pub step: i32,
    /// Denominator epsilon.
    pub eps: f32,
    /// Gradient multiplier (clipping; 1 otherwise).
    pub grad_scale: f32,
}

/// The flat parameter buffer's tensors as (end, weight decay) segments, on
/// the device, for [`MixedKernels::adamw_multi`].
pub struct AdamSegments {
    ends: braid_cuda::DeviceBuffer<i64>,
    decay: braid_cuda::DeviceBuffer<f32>,
    total: usize,
}

impl AdamSegments {
    /// Segments of `layout`, decay `weight_decay` where the tensor's kind
    /// decays (matrices, embeddings) and none elsewhere.
    pub fn new(device: &Device, layout: &crate::layout::Layout, weight_decay: f32) -> Result<Self> {
        Self::shard(device, layout, weight_decay, 0..layout.len)
    }

    /// The segments of the elements `shard` of `layout`'s flat buffer
    /// (ends counted from the shard's start), for an AdamW step over that
    /// shard alone (a ZeRO rank's).
    pub fn shard(
        device: &Device,
        layout: &crate::layout::Layout,
        weight_decay: f32,
        shard: std::ops::Range<usize>,
    ) -> Result<Self> {
        Self::from_ends(device, &Self::shard_ends(layout, weight_decay, shard)?)
    }

    /// The (end, weight decay) segments of [`AdamSegments::shard`].
    pub fn shard_ends(
        layout: &crate::layout::Layout,
        weight_decay: f32,
        shard: std::ops::Range<usize>,
    ) -> Result<Vec<(usize, f32)>> {
        if shard.is_empty() || shard.end > layout.len {
            return Err(CudaError::Invalid(format!(
                "adamw segments: shard {shard:?} is empty or outside the {} parameters",
                layout.len
            )));
        }
        // The tensors' runs inside the shard, and between them (and to
        // its end) the gaps of a padded layout: no decay, and their
        // gradients are zero, so they stay zero.
        let (pieces, _) = crate::optim::pieces(layout, std::slice::from_ref(&shard));
        let mut segs = Vec::new();
        let mut at = shard.start;
        for piece in pieces {
            if piece.range.start > at {
                segs.push((piece.range.start - shard.start, 0.0));
            }
            let decay = if piece.decays { weight_decay } else { 0.0 };
            segs.push((piece.range.end - shard.start, decay));
            at = piece.range.end;
        }
        if shard.end > at {
            segs.push((shard.end - shard.start, 0.0));
        }
        Ok(segs)
    }

    /// Segments given as (end, weight decay), ends increasing; the last
    /// end is the buffer's length.
    pub fn from_ends(device: &Device, segs: &[(usize, f32)]) -> Result<Self> {
        if segs.windows(2).any(|w| w[1].0 <= w[0].0) || segs.first().is_some_and(|s| s.0 == 0) {
            return Err(CudaError::Invalid(
                "adamw segments: ends must increase from above 0".into(),
            ));
        }
        let ends: Vec<i64> = segs.iter().map(|s| s.0 as i64).collect();
        let decay: Vec<f32> = segs.iter().map(|s| s.1).collect();
        Ok(AdamSegments {
            ends: braid_cuda::DeviceBuffer::from_host(device, &ends)?,
            decay: braid_cuda::DeviceBuffer::from_host(device, &decay)?,
            total: segs.last().map_or(0, |s| s.0),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::{ce_rows_of, ce_rows_take};
    use super::{nt_split, skinny_layout, zero_pieces, AdamSegments, ZERO_PIECE};
    use super::{NtPrefetch, NtStart};

    /// `BRAID_CE` names one of two kernels; the block-per-row one takes
    /// GPT-2's padded vocabulary and refuses rows past its registers.
    #[test]
    fn the_loss_kernel_is_chosen_by_name_and_by_the_rows_width() {
        assert!(!ce_rows_of(None).unwrap());
        assert!(!ce_rows_of(Some("warp")).unwrap());
        assert!(ce_rows_of(Some(" rows")).unwrap());
        let e = ce_rows_of(Some("block")).unwrap_err().to_string();
        assert!(e.contains("BRAID_CE") && e.contains("rows"), "{e}");
        assert!(ce_rows_take(50304) && ce_rows_take(65536));
        assert!(!ce_rows_take(65544) && !ce_rows_take(50257));
        if braid_cuda::nvrtc::version().is_ok() {
            let (name, src) = crate::cuda::SOURCES[1];
            let ptx = braid_cuda::nvrtc::compile_ptx(name, src, "compute_80").unwrap();
            assert!(ptx.contains(".entry softmax_cross_entropy_rows_bf("));
        }
    }

    /// 124M's products (up to 768 x 3072 in bf16) ask for their weights
    /// ahead, 1558M's (from 1600 x 1600) and the logits do not.
    #[test]
    fn nt_products_ask_ahead_only_for_small_weights() {
        let bf16 = 2;
        for (k, n) in [(768, 768), (768, 2304), (768, 3072), (3072, 768)] {
            let s = NtStart::for_weights(k * n * bf16);
            assert!(
                s.release_first && s.prefetch == NtPrefetch::Bulk,
                "{k} x {n}"
            );
        }
        for (k, n) in [(1600, 1600), (1600, 4800), (1600, 6400), (768, 50257)] {
            let s = NtStart::for_weights(k * n * bf16);
            assert!(
                !s.release_first && s.prefetch == NtPrefetch::None,
                "{k} x {n}"
            );
        }
    }

    /// The NT products' warps along K on an H100's 132 multiprocessors:
    /// the fewest for two blocks a multiprocessor, never a slice of K
    /// shorter than a pass of the lanes.
    #[test]
    fn nt_products_split_k_until_two_blocks_a_multiprocessor() {
        // (n, k, warps along K) on 132 multiprocessors: 1558M's qkv, proj,
        // fc, fc's projection and logits, then 124M's proj and fc's
        // projection, and a K too short to split.
        for (n, k, want) in [
            (4800, 1600, 1),
            (1600, 1600, 4),
            (6400, 1600, 1),
            (1600, 6400, 4),
            (50257, 1600, 1),
            (768, 768, 2),
            (768, 3072, 8),
            (64, 200, 1),
        ] {
            assert_eq!(nt_split(n, k, 132), want, "{n} x {k}");
        }
    }

    /// The skinny products' splits on an H100's 132 multiprocessors (tiles
    /// of 64 columns): enough for two blocks a multiprocessor (at most 8,
    /// each of at least 128 rows, whole rows of 8), covering K; a shape too
    /// small to split runs whole.
    #[test]
    fn skinny_products_split_k_for_two_blocks_a_multiprocessor() {
        for (n, k, want) in [
            (4800, 1600, 4),
            (1600, 6400, 8),
            (6400, 1600, 3),
            (2304, 768, 6),
            (768, 3072, 8),
            (48, 16, 1),
        ] {
            let (splits, rows) = skinny_layout(n, k, 132);
            assert_eq!(splits, want, "{n} x {k}");
            assert!(rows % 8 == 0 && rows * splits >= k && rows * (splits - 1) < k);
        }
    }
    use crate::config::GptConfig;
    use crate::layout::Layout;

    /// A shard's segments are the whole buffer's, cut at its edges and
    /// counted from its start; an empty or outside shard is refused.
    #[test]
    fn shard_segments_cut_the_whole_buffers_at_its_edges() {
        let l = Layout::new(&GptConfig::parse("L2-H2-C8-V11-T5").unwrap());
        let whole = AdamSegments::shard_ends(&l, 0.1, 0..l.len).unwrap();
        assert_eq!(whole.len(), l.params.len());
        for ((end, wd), spec) in whole.iter().zip(&l.params) {
            assert_eq!(*end, spec.range().end);
            assert_eq!(*wd, if spec.kind.decays() { 0.1 } else { 0.0 });
        }
        // A shard from inside the second tensor to inside a later one.
        let (a, b) = (l.params[1].range().start + 3, l.params[4].range().start + 2);
        let part = AdamSegments::shard_ends(&l, 0.1, a..b).unwrap();
        let want: Vec<(usize, f32)> = (1..=4)
            .map(|i| (whole[i].0.min(b) - a, whole[i].1))
            .collect();
        assert_eq!(part, want);
        assert!(AdamSegments::shard_ends(&l, 0.1, 5..5).is_err());
        // A padded layout: the gaps are segments without decay, and the
        // last end is the padded length.
        let p = Layout::padded(&GptConfig::parse("L2-H2-C8-V11-T5").unwrap(), 64);
        let segs = AdamSegments::shard_ends(&p, 0.1, 0..p.len).unwrap();
        assert_eq!(segs.last().unwrap().0, p.len);
        let gaps = p
            .blocks
            .iter()
            .filter(|(_, r)| !p.params.iter().any(|t| t.range().end == r.end))
            .count();
        assert!(gaps > 0);
        assert_eq!(segs.len(), p.params.len() + gaps);
        for (_, r) in &p.blocks {
            // A gap: the segment after the block's last tensor ends the
            // block, without decay.
            let last = p.params.iter().rfind(|t| r.contains(&t.offset)).unwrap();
            if last.range().end < r.end {
                let at = segs.iter().position(|s| s.0 == last.range().end).unwrap();
                assert_eq!(segs[at + 1], (r.end, 0.0));
            }
        }
        assert!(AdamSegments::shard_ends(&l, 0.1, 0..l.len + 1).is_err());
    }

    #[test]
    fn zero_runs_are_cut_into_pieces_one_block_can_zero() {
        let p = ZERO_PIECE as i64;
        let runs = [0..3, 10..10, 100..100 + 2 * ZERO_PIECE + 5];
        assert_eq!(
            zero_pieces(&runs),
            vec![0, 3, 100, p, 100 + p, p, 100 + 2 * p, 5]
        );
        // The tied embedding of 124M alone: 2,357 blocks, not one.
        let wte = 50_257 * 768;
        let whole = std::iter::once(0..wte).collect::<Vec<_>>();
        assert_eq!(zero_pieces(&whole).len() / 2, wte.div_ceil(ZERO_PIECE));
    }
}
