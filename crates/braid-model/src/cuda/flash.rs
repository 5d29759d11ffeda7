//! Launchers for the fused causal attention (`flash.cu`): forward with the
//! row log-sum-exp kept, backward as a row-sum pass plus a dK/dV and a dQ
//! kernel, the dQ kernel either reading the score gradients the dK/dV
//! kernel stored (scratch of [`FlashKernels::score_grads_len`] elements)
//! or recomputing them. Needs tensor cores with bf16 (compute capability 8.0 or newer)
//! and a head size the kernels are instantiated for; the mixed engine
//! falls back to batched cuBLAS products otherwise. Every launcher checks
//! its buffers against the shape before launching.
//!
//! On GPUs of compute capability 9.0 the forward kernel, the dK/dV kernel
//! and both dQ kernels run at head sizes 64 and 128 on Hopper's warpgroup
//! products by default (`flash_wgmma.cu`, appended to `flash.cu` and
//! compiled for `compute_90a`; measured faster, BENCHMARKS.md); the row
//! sums stay. `BRAID_FLASH_FORWARD` and `BRAID_FLASH_BACKWARD` choose
//! each pass's products ([`Products`]).

use super::mixed::{MixedKernels, A};
use super::sources::SOURCES;
use crate::cpu::attention::AttnShape;
use braid_core::env;
use braid_cuda::nvrtc::{Function, Module};
use braid_cuda::{CudaError, Device, DeviceBuffer, DeviceMem, DeviceViewMut, Result, Stream};
use half::bf16;

/// Memory the dK/dV kernel stores the score gradients in for the dQ
/// kernel: the first heads' tiles in `first` (as many whole heads as it
/// holds), the others in `rest` (empty where `first` holds them all). Two
/// pieces, so that the memory of two buffers idle during the attention's
/// backward pass can take them.
pub struct ScoreGrads<'a> {
    /// The first heads' tiles.
    pub first: DeviceViewMut<'a, bf16>,
    /// The other heads' tiles, from its start.
    pub rest: DeviceViewMut<'a, bf16>,
}

impl<'a> ScoreGrads<'a> {
    /// All of them in one buffer.
    pub fn one(buf: &'a mut DeviceBuffer<bf16>) -> ScoreGrads<'a> {
        let len = buf.len();
        ScoreGrads {
            first: buf.view_mut(0..len),
            rest: DeviceViewMut::empty(),
        }
    }
}

/// Rows (and keys) per block of the fused kernels.
const TILE: usize = 64;
/// Threads per block: four warps of 16 rows.
const THREADS: u32 = 128;

/// Bytes of one 64-row shared tile of width `w`, padded by 8 values.
fn tile(w: usize) -> usize {
    TILE * (w + 8) * 2
}

/// Dynamic shared memory of the forward and recomputing dQ kernels at
/// head size `hs`: two stages of two tiles.
fn tile_bytes(hs: usize) -> usize {
    4 * tile(hs)
}

/// ... of the dK/dV kernel: two stages of (Q, dO), K and V, then two
/// stages of the rows' log-sum-exp and row sums.
fn dkdv_bytes(hs: usize) -> usize {
    6 * tile(hs) + 2 * 2 * TILE * 4
}

/// ... of the dQ kernel reading stored dS: two K tiles, two dS tiles.
fn dq_stored_bytes(hs: usize) -> usize {
    2 * tile(hs) + 2 * tile(TILE)
}

/// The Hopper kernels' source (appended to `flash.cu`'s).
pub const HOPPER_SOURCE: (&str, &str) = ("flash_wgmma", include_str!("flash_wgmma.cu"));

/// The virtual architecture the Hopper kernels compile for.
pub const HOPPER_ARCH: &str = "compute_90a";

/// Head sizes with Hopper kernels.
const HOPPER_HEAD_SIZES: [usize; 2] = [64, 128];

/// Query (or key) rows per block, and threads (two warpgroups), of the
/// Hopper backward kernels.
const HOPPER_ROWS: usize = 128;
const HOPPER_THREADS: u32 = 256;

/// Dynamic shared memory of the Hopper forward kernel: two stages of a K
/// and a V tile (64 × `hs`, unpadded: swizzled), and room to start them on
/// a 1024-byte boundary.
fn hopper_bytes(hs: usize) -> usize {
    4 * TILE * hs * 2 + 1024
}

/// ... of the pipelined Hopper forward kernel: four stages of a K and a V
/// tile, and the room to align.
fn hopper_pipelined_bytes(hs: usize) -> usize {
    8 * TILE * hs * 2 + 1024
}

/// ... of the Hopper dK/dV kernel: the block's two K and two V tiles, two
/// stages of a Q and a dO tile, two stages of 64 rows' lse and dsum, and
/// the room to align.
fn hopper_dkdv_bytes(hs: usize) -> usize {
    8 * TILE * hs * 2 + 2 * 2 * TILE * 4 + 1024
}

/// ... of the Hopper dQ kernel reading stored score gradients: two stages
/// of a K tile and two 64 × 64 dS tiles, and the room to align.
fn hopper_dq_bytes(hs: usize) -> usize {
    2 * (TILE * hs * 2 + 2 * TILE * TILE * 2) + 1024
}

/// ... of the Hopper dQ kernel recomputing the score gradients: the two
/// warpgroups' Q and dO tiles, two stages of a K and a V tile, and the
/// room to align.
fn hopper_dq_recompute_bytes(hs: usize) -> usize {
    8 * TILE * hs * 2 + 1024
}

/// `flash.cu` with the Hopper kernels appended (and the blocks-per-SM
/// defines `defines` ahead), what [`FlashKernels::load`] compiles for
/// [`HOPPER_ARCH`] where a pass runs on `wgmma`.
pub fn hopper_source(defines: &str) -> String {
    format!("{defines}{}{}", SOURCES[2].1, HOPPER_SOURCE.1)
}

/// The variables choosing each pass's products.
pub const FORWARD_VAR: &str = env::BRAID_FLASH_FORWARD;
pub const BACKWARD_VAR: &str = env::BRAID_FLASH_BACKWARD;

/// The products a pass's kernels are built on (`BRAID_FLASH_FORWARD` for
/// the forward kernel, `BRAID_FLASH_BACKWARD` for dK/dV and dQ). Unset
/// (or `auto`): [`Products::default_for`] the GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Products {
    /// `mma`: `mma.sync` tiles, any GPU from 8.0 (the default on GPUs
    /// other than 9.0).
    MmaSync,
    /// `wgmma`: Hopper's warpgroup products at head sizes 64 and 128, one
    /// warpgroup of 64 query rows a block in the forward kernel.
    Wgmma,
    /// `wgmma2` (the forward kernel only): two warpgroups a block sharing
    /// the key and value tiles.
    WgmmaPaired,
    /// `wgmma2p` (the forward kernel only): `wgmma2` with each warpgroup's
    /// softmax under its products (the next tile's scores issued before
    /// this tile's softmax, its P V waited for a tile later), four stages
    /// of key and value tiles. The same bits as `wgmma2`.
    WgmmaPipelined,
}

impl Products {
    /// The choice `value` of variable `var` names (`None`: unset, or
    /// `auto`: the GPU's default), or what is expected.
    pub fn parse(var: &str, value: Option<&str>) -> Result<Option<Products>> {
        let forward = var == FORWARD_VAR;
        match value.map(str::trim) {
            None | Some("" | "auto") => Ok(None),
            Some("mma") => Ok(Some(Products::MmaSync)),
            Some("wgmma") => Ok(Some(Products::Wgmma)),
            Some("wgmma2") if forward => Ok(Some(Products::WgmmaPaired)),
            Some("wgmma2p") if forward => Ok(Some(Products::WgmmaPipelined)),
            Some(other) => Err(CudaError::Invalid(format!(
                "{var}={other:?}: expected auto, mma or wgmma{}",
                if forward { " (or wgmma2, wgmma2p)" } else { "" }
            ))),
        }
    }

    /// The choice of `var` in this process's environment.
    pub fn from_env(var: &str) -> Result<Option<Products>> {
        Self::parse(var, std::env::var(var).ok().as_deref())
    }

    /// What a pass (`var`) runs on where its variable is unset, on a GPU of
    /// compute capability `cc`: Hopper's products on 9.0 (the forward's
    /// two-warpgroup form, measured the faster of the two), `mma.sync`
    /// tiles elsewhere.
    pub fn default_for(var: &str, cc: (i32, i32)) -> Products {
        match (cc == (9, 0), var == FORWARD_VAR) {
            (true, true) => Products::WgmmaPaired,
            (true, false) => Products::Wgmma,
            (false, _) => Products::MmaSync,
        }
    }

    /// What `var` chooses on a GPU of compute capability `cc`: its value,
    /// or the GPU's default; a Hopper choice elsewhere than 9.0 is refused.
    pub fn choose(var: &str, value: Option<&str>, cc: (i32, i32)) -> Result<Products> {
        let chosen = Self::parse(var, value)?.unwrap_or_else(|| Self::default_for(var, cc));
        if chosen != Products::MmaSync && cc != (9, 0) {
            return Err(CudaError::Invalid(format!(
                "{var}={}: Hopper's warpgroup products need a GPU of compute capability \
                 9.0, this one is {}.{}; unset the variable",
                value.unwrap_or_default().trim(),
                cc.0,
                cc.1
            )));
        }
        Ok(chosen)
    }

    /// The passes' choices in this process's environment on a GPU of
    /// compute capability `cc`: (forward, backward).
    pub fn chosen(cc: (i32, i32)) -> Result<(Products, Products)> {
        let pick = |var: &str| Self::choose(var, std::env::var(var).ok().as_deref(), cc);
        Ok((pick(FORWARD_VAR)?, pick(BACKWARD_VAR)?))
    }

    /// The value naming this choice.
    pub fn name(self) -> &'static str {
        match self {
            Products::MmaSync => "mma",
            Products::Wgmma => "wgmma",
            Products::WgmmaPaired => "wgmma2",
            Products::WgmmaPipelined => "wgmma2p",
        }
    }
}

/// `BRAID_FLASH128_BLOCKS=F,K,Q`: the blocks per SM the head-size-128
/// kernels' registers are planned for (forward, dK/dV, dQ recomputing the
/// score gradients; each 1 to 8), as `#define`s ahead of the source; the
/// source's own (2, 2, 2) when unset. For measuring occupancy: the bits do
/// not change (the same arithmetic in the same order), the speed may.
fn blocks_128_from_env() -> Result<String> {
    blocks_128(std::env::var(env::BRAID_FLASH128_BLOCKS).ok().as_deref())
}

/// [`blocks_128_from_env`] for the variable's value `v`.
fn blocks_128(v: Option<&str>) -> Result<String> {
    let Some(v) = v else {
        return Ok(String::new());
    };
    let bad = || {
        CudaError::Invalid(format!(
            "BRAID_FLASH128_BLOCKS={v}: expected three blocks per SM from 1 to 8, as F,K,Q \
             (forward, dK/dV, dQ), e.g. 2,2,2"
        ))
    };
    let n: Vec<u32> = v
        .split(',')
        .map(|x| x.trim().parse::<u32>().map_err(|_| bad()))
        .collect::<Result<_>>()?;
    match n[..] {
        [f, k, q] if [f, k, q].iter().all(|b| (1..=8).contains(b)) => Ok(format!(
            "#define FLASH128_FWD {f}\n#define FLASH128_DKDV {k}\n#define FLASH128_DQ {q}\n"
        )),
        _ => Err(bad()),
    }
}

/// `BRAID_FLASH_GROUP_HEADS=G`: the attention's blocks go out G heads at a
/// time, each group's blocks of every rank before the next group's, so
/// that the tiles a head's blocks share stay in L2 (0 or unset: the 2-D
/// grid, every head's longest blocks first). For measuring: the bits do
/// not change, only the order the blocks run in.
fn group_heads_from_env() -> Result<usize> {
    group_heads(std::env::var(env::BRAID_FLASH_GROUP_HEADS).ok().as_deref())
}

/// [`group_heads_from_env`] for the variable's value `v`.
fn group_heads(v: Option<&str>) -> Result<usize> {
    match v.map(str::trim) {
        None | Some("") => Ok(0),
        Some(x) => x
            .parse::<usize>()
            .ok()
            .filter(|g| *g <= 4096)
            .ok_or_else(|| {
                CudaError::Invalid(format!(
                    "BRAID_FLASH_GROUP_HEADS={x}: expected the heads a group, 0 (off) to 4096"
                ))
            }),
    }
}

/// Threads per block of the row-sum kernel (one block per token).
const DSUM_THREADS: u32 = 128;

/// The kernels of one head size.
struct HeadKernels {
    hs: usize,
    forward: Function,
    /// The forward pass on Hopper's warpgroup products, where chosen, and
    /// its warpgroups a block.
    forward_wg: Option<(Function, usize, usize)>,
    /// dK/dV on Hopper's warpgroup products, where chosen.
    dkdv_wg: Option<Function>,
    /// dQ from stored dS on Hopper's warpgroup products, where chosen.
    dq_stored_wg: Option<Function>,
    /// dQ recomputing dS on Hopper's warpgroup products, where chosen.
    dq_wg: Option<Function>,
    dsum: Function,
    dkdv: Function,
    dq: Function,
    dq_stored: Function,
}

/// The loaded fused-attention kernels of one device.
pub struct FlashKernels {
    heads: Vec<(usize, HeadKernels)>,
    add_bias: Function,
    /// Heads a group under `BRAID_FLASH_GROUP_HEADS` (0: the 2-D grid).
    group_heads: usize,
}

fn need(what: &str, have: usize, want: usize) -> Result<()> {
    if have < want {
        return Err(CudaError::Invalid(format!(
            "flash attention: {what} holds {have} elements, the shape needs {want}"
        )));
    }
    Ok(())
}

impl FlashKernels {
    /// Head sizes with fused kernels.
    pub const HEAD_SIZES: [usize; 6] = [16, 32, 64, 80, 96, 128];

    /// Checks the kernels' variables (`BRAID_FLASH_FORWARD`,
    /// `BRAID_FLASH_BACKWARD`, `BRAID_FLASH_GROUP_HEADS`,
    /// `BRAID_FLASH128_BLOCKS`) without a GPU, so that a bad value is said
    /// once before workers start rather than by each of them.
    pub fn check_env() -> Result<()> {
        Products::from_env(FORWARD_VAR)?;
        Products::from_env(BACKWARD_VAR)?;
        group_heads_from_env()?;
        blocks_128_from_env().map(|_| ())
    }

    /// Compiles (through the cache) and loads the kernels, or `None` on a
    /// GPU older than compute capability 8.0.
    pub fn load(device: &Device) -> Result<Option<FlashKernels>> {
        let cc = device.compute_capability()?;
        if cc.0 < 8 {
            return Ok(None);
        }
        let (fwd_products, bwd_products) = Products::chosen(cc)?;
        let fwd = fwd_products != Products::MmaSync;
        // The forward kernel's warpgroups a block, name suffix and shared
        // memory.
        let (groups, suffix, fwd_bytes): (usize, &str, fn(usize) -> usize) = match fwd_products {
            Products::WgmmaPaired => (2, "_2", hopper_bytes),
            Products::WgmmaPipelined => (2, "_2p", hopper_pipelined_bytes),
            _ => (1, "", hopper_bytes),
        };
        let bwd = bwd_products == Products::Wgmma;
        let hopper = fwd || bwd;
        let group_heads = group_heads_from_env()?;
        let mut defines = blocks_128_from_env()?;
        if group_heads > 0 {
            defines += &format!("#define FLASH_GROUP_HEADS {group_heads}\n");
        }
        let module = match hopper {
            true => Module::compile_for(
                device,
                HOPPER_SOURCE.0,
                &hopper_source(&defines),
                HOPPER_ARCH,
            )?,
            false => Module::compile(device, SOURCES[2].0, &format!("{defines}{}", SOURCES[2].1))?,
        };
        let mut heads = Vec::new();
        for hs in Self::HEAD_SIZES {
            let f = |n: &str| module.function(&format!("{n}_{hs}"));
            // A Hopper kernel `NAME_HS` + `suffix`, where chosen.
            let wg = |on: bool, name: &str, suffix: &str, bytes: usize| {
                if !on || !HOPPER_HEAD_SIZES.contains(&hs) {
                    return Ok(None);
                }
                let k = module.function(&format!("{name}_{hs}{suffix}"))?;
                k.set_max_dynamic_shared(bytes)?;
                Ok::<_, CudaError>(Some(k))
            };
            let forward_wg = wg(fwd, "flash_forward_wg", suffix, fwd_bytes(hs))?
                .map(|k| (k, groups, fwd_bytes(hs)));
            let dkdv_wg = wg(bwd, "flash_dkdv_wg", "", hopper_dkdv_bytes(hs))?;
            let dq_stored_wg = wg(bwd, "flash_dq_ds_wg", "", hopper_dq_bytes(hs))?;
            let dq_wg = wg(bwd, "flash_dq_wg", "", hopper_dq_recompute_bytes(hs))?;
            let k = HeadKernels {
                hs,
                forward: f("flash_forward")?,
                forward_wg,
                dkdv_wg,
                dq_stored_wg,
                dq_wg,
                dsum: f("flash_dsum")?,
                dkdv: f("flash_dkdv")?,
                dq: f("flash_dq")?,
                dq_stored: f("flash_dq_ds")?,
            };
            k.forward.set_max_dynamic_shared(tile_bytes(hs))?;
            k.dq.set_max_dynamic_shared(tile_bytes(hs))?;
            k.dkdv.set_max_dynamic_shared(dkdv_bytes(hs))?;
            k.dq_stored.set_max_dynamic_shared(dq_stored_bytes(hs))?;
            heads.push((hs, k));
        }
        Ok(Some(FlashKernels {
            add_bias: module.function("add_bias_bf")?,
            heads,
            group_heads,
        }))
    }

    /// Elements (bf16) of the score-gradient scratch that lets the dQ
    /// kernel read dS instead of recomputing it: each head's lower
    /// triangle of 64 × 64 tiles (u128: the memory estimate takes any
    /// shape).
    pub fn score_grads_len(s: AttnShape) -> u128 {
        (s.b * s.nh) as u128 * Self::score_grads_per_head(s)
    }

    /// Elements (bf16) of one head's score gradients.
    fn score_grads_per_head(s: AttnShape) -> u128 {
        let nb = s.t.div_ceil(TILE) as u128;
        (nb * (nb + 1) / 2) * (TILE * TILE) as u128
    }

    /// How many heads' score gradients go into a first piece of `first`
    /// elements, and whether a second of `rest` takes the others
    /// ([`ScoreGrads`]).
    pub fn score_grads_split(s: AttnShape, first: usize, rest: usize) -> (usize, bool) {
        let per = Self::score_grads_per_head(s).max(1);
        let heads = (s.b * s.nh) as u128;
        let split = (first as u128 / per).min(heads);
        (split as usize, rest as u128 / per >= heads - split)
    }

    /// Whether the fused kernels take shape `s` (an error saying why not).
    pub fn check(&self, s: AttnShape) -> Result<()> {
        self.head(s).map(|_| ())
    }

    fn head(&self, s: AttnShape) -> Result<&HeadKernels> {
        let hs = s.c.checked_div(s.nh).unwrap_or(0);
        // Grids are (B*NH, row blocks).
        if s.b * s.nh > i32::MAX as usize || s.t.div_ceil(TILE) > u16::MAX as usize {
            return Err(CudaError::Invalid(format!(
                "flash attention: batch × heads {} or sequence {} too large for one launch",
                s.b * s.nh,
                s.t
            )));
        }
        self.heads
            .iter()
            .find(|(h, _)| *h == hs && s.nh * hs == s.c)
            .map(|(_, k)| k)
            .ok_or_else(|| {
                CudaError::Invalid(format!(
                    "flash attention: head size {hs} (width {} / {} heads) has no fused kernel \
                     (sizes {:?})",
                    s.c,
                    s.nh,
                    Self::HEAD_SIZES
                ))
            })
    }

    /// The grid of a kernel with `ny` row blocks a head: `(B*NH, ny)`, the
    /// kernels going out longest first across all heads, or under head
    /// groups one dimension of `B*NH*ny` blocks (`block_place` in
    /// flash.cu).
    fn grid(&self, s: AttnShape, ny: usize) -> Result<(u32, u32, u32)> {
        launch_grid(self.group_heads, s.b * s.nh, ny)
    }

    /// `dst[N, 3C] = src + bias` (bf16 rows, f32 bias).
    pub fn add_bias(
        &self,
        st: &Stream,
        dst: &mut impl DeviceMem<bf16>,
        src: &impl DeviceMem<bf16>,
        bias: &impl DeviceMem<f32>,
        n: usize,
        c3: usize,
    ) -> Result<()> {
        if c3 % 8 != 0 {
            return Err(CudaError::Invalid(format!(
                "add_bias: row width {c3} must be a multiple of 8 ({n} rows)"
            )));
        }
        need("bias", bias.dlen(), c3)?;
        need("source", src.dlen(), n * c3)?;
        need("destination", dst.dlen(), n * c3)?;
        let blocks = (n * c3 / 8).div_ceil(256).max(1) as u32;
        let args = vec![
            A::P(dst.dptr()),
            A::P(src.dptr()),
            A::P(bias.dptr()),
            A::I(n as i32),
            A::I(c3 as i32),
        ];
        MixedKernels::go(&self.add_bias, st, (blocks, 1, 1), (256, 1, 1), args)
    }

    /// `out[B,T,C]` and `lse[B*NH,T]` from `qkv[B,T,3C]` (bias included).
    pub fn forward(
        &self,
        st: &Stream,
        out: &mut impl DeviceMem<bf16>,
        lse: &mut impl DeviceMem<f32>,
        qkv: &impl DeviceMem<bf16>,
        s: AttnShape,
    ) -> Result<()> {
        let k = self.head(s)?;
        need("qkv", qkv.dlen(), s.b * s.t * 3 * s.c)?;
        need("out", out.dlen(), s.b * s.t * s.c)?;
        need("lse", lse.dlen(), s.b * s.nh * s.t)?;
        let hs = s.c / s.nh;
        let sl2 = std::f32::consts::LOG2_E / (hs as f32).sqrt();
        let args = vec![
            A::P(out.dptr()),
            A::P(lse.dptr()),
            A::P(qkv.dptr()),
            A::I(s.t as i32),
            A::I(s.nh as i32),
            A::F(sl2),
        ];
        if let Some((wg, groups, bytes)) = &k.forward_wg {
            let grid = self.grid(s, s.t.div_ceil(TILE * groups))?;
            let shared = *bytes as u32;
            let threads = (128 * groups) as u32;
            return MixedKernels::go_shared(wg, st, grid, (threads, 1, 1), shared, args);
        }
        let shared = tile_bytes(k.hs) as u32;
        let grid = self.grid(s, s.t.div_ceil(TILE))?;
        MixedKernels::go_shared(&k.forward, st, grid, (THREADS, 1, 1), shared, args)
    }

    /// `dqkv[B,T,3C]` (overwritten) from `dout[B,T,C]`, with the forward
    /// pass's `qkv`, `out` and `lse`; `dsum[B*NH,T]` is scratch, and so is
    /// `score_grads` ([`Self::score_grads_len`] elements, in one piece or
    /// two), which, when given, spares the dQ kernel two of its three
    /// products. The gradients are the same bits either way.
    #[allow(clippy::too_many_arguments)]
    pub fn backward(
        &self,
        st: &Stream,
        dqkv: &mut impl DeviceMem<bf16>,
        dsum: &mut impl DeviceMem<f32>,
        score_grads: Option<ScoreGrads<'_>>,
        dout: &impl DeviceMem<bf16>,
        qkv: &impl DeviceMem<bf16>,
        out: &impl DeviceMem<bf16>,
        lse: &impl DeviceMem<f32>,
        s: AttnShape,
    ) -> Result<()> {
        let k = self.head(s)?;
        let (rows, heads) = (s.b * s.t, s.b * s.nh * s.t);
        need("qkv", qkv.dlen(), rows * 3 * s.c)?;
        need("dqkv", dqkv.dlen(), rows * 3 * s.c)?;
        need("out", out.dlen(), rows * s.c)?;
        need("dout", dout.dlen(), rows * s.c)?;
        need("lse", lse.dlen(), heads)?;
        need("dsum", dsum.dlen(), heads)?;
        let heads_total = s.b * s.nh;
        let (ds, ds2, split) = match &score_grads {
            Some(d) => {
                let (split, fits) = Self::score_grads_split(s, d.first.len(), d.rest.len());
                if !fits {
                    return Err(CudaError::Invalid(format!(
                        "flash attention: score gradients hold {} + {} elements, the shape \
                         needs {} in whole heads of {}",
                        d.first.len(),
                        d.rest.len(),
                        Self::score_grads_len(s),
                        Self::score_grads_per_head(s)
                    )));
                }
                let first = d.first.dptr();
                let rest = if split < heads_total {
                    d.rest.dptr()
                } else {
                    first
                };
                (first, rest, split)
            }
            None => (0, 0, heads_total),
        };
        if rows > i32::MAX as usize {
            return Err(CudaError::Invalid(format!(
                "flash attention: {rows} tokens are too many for one row-sum launch"
            )));
        }
        let hs = s.c / s.nh;
        let scale = 1.0 / (hs as f32).sqrt();
        let sl2 = std::f32::consts::LOG2_E * scale;
        let args = vec![
            A::P(dsum.dptr()),
            A::P(dout.dptr()),
            A::P(out.dptr()),
            A::I(s.t as i32),
            A::I(s.nh as i32),
        ];
        let dsum_grid = (rows as u32, 1, 1);
        MixedKernels::go(&k.dsum, st, dsum_grid, (DSUM_THREADS, 1, 1), args)?;
        let grid = self.grid(s, s.t.div_ceil(TILE))?;
        // The arguments of the kernels that recompute the probabilities.
        let recompute = vec![
            A::P(dqkv.dptr()),
            A::P(qkv.dptr()),
            A::P(dout.dptr()),
            A::P(lse.dptr()),
            A::P(dsum.dptr()),
            A::I(s.t as i32),
            A::I(s.nh as i32),
            A::F(sl2),
            A::F(scale),
        ];
        // A backward kernel: its Hopper form where chosen (`wg`, with its
        // shared memory `wg_bytes`), else the `mma.sync` one.
        let go =
            |wg: &Option<Function>, wg_bytes: usize, plain: &Function, bytes: usize, args| match wg
            {
                Some(f) => {
                    let grid = self.grid(s, s.t.div_ceil(HOPPER_ROWS))?;
                    let shared = wg_bytes as u32;
                    MixedKernels::go_shared(f, st, grid, (HOPPER_THREADS, 1, 1), shared, args)
                }
                None => {
                    MixedKernels::go_shared(plain, st, grid, (THREADS, 1, 1), bytes as u32, args)
                }
            };
        let mut args = recompute.clone();
        args.extend([A::P(ds), A::P(ds2), A::I(split as i32)]);
        let (dkdv_bytes, hopper_dkdv) = (dkdv_bytes(k.hs), hopper_dkdv_bytes(k.hs));
        go(&k.dkdv_wg, hopper_dkdv, &k.dkdv, dkdv_bytes, args)?;
        if ds != 0 {
            let args = vec![
                A::P(dqkv.dptr()),
                A::P(qkv.dptr()),
                A::P(ds),
                A::P(ds2),
                A::I(split as i32),
                A::I(s.t as i32),
                A::I(s.nh as i32),
                A::F(scale),
            ];
            let bytes = dq_stored_bytes(k.hs);
            go(
                &k.dq_stored_wg,
                hopper_dq_bytes(k.hs),
                &k.dq_stored,
                bytes,
                args,
            )
        } else {
            let hopper = hopper_dq_recompute_bytes(k.hs);
            go(&k.dq_wg, hopper, &k.dq, tile_bytes(k.hs), recompute)
        }
    }
}

/// [`FlashKernels::grid`] for `heads` (B*NH) heads of `ny` row blocks and
/// `group_heads` heads a group (0: none).
fn launch_grid(group_heads: usize, heads: usize, ny: usize) -> Result<(u32, u32, u32)> {
    let ny = ny.max(1);
    let too_many = || {
        CudaError::Invalid(format!(
            "flash attention: {heads} heads x {ny} row blocks are too many blocks for one launch"
        ))
    };
    if group_heads == 0 {
        if ny > 65535 || heads > i32::MAX as usize {
            return Err(too_many());
        }
        return Ok((heads as u32, ny as u32, 1));
    }
    match heads.checked_mul(ny) {
        Some(n) if n <= i32::MAX as usize => Ok((n as u32, 1, 1)),
        _ => Err(too_many()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `BRAID_FLASH_GROUP_HEADS`: a count of heads or a clear refusal; the
    /// grid two-dimensional without it, one-dimensional with it, and too
    /// many blocks refused; both sources compile with the define (NVRTC at
    /// hand).
    #[test]
    fn head_groups_change_the_grid_and_compile() {
        assert_eq!(group_heads(None).unwrap(), 0);
        assert_eq!(group_heads(Some(" 16")).unwrap(), 16);
        for bad in ["-1", "x", "4097", "1.5"] {
            let e = group_heads(Some(bad)).unwrap_err().to_string();
            assert!(e.contains("BRAID_FLASH_GROUP_HEADS"), "{bad}: {e}");
        }
        assert_eq!(launch_grid(0, 320, 8).unwrap(), (320, 8, 1));
        assert_eq!(launch_grid(16, 320, 8).unwrap(), (2560, 1, 1));
        assert_eq!(launch_grid(16, 320, 0).unwrap(), (320, 1, 1));
        assert!(launch_grid(0, 4, 65536).is_err());
        assert!(launch_grid(16, 1 << 20, 1 << 12).is_err());
        if braid_cuda::nvrtc::version().is_ok() {
            let d = "#define FLASH_GROUP_HEADS 16\n";
            let src = format!("{d}{}", SOURCES[2].1);
            let ptx = braid_cuda::nvrtc::compile_ptx("flash-groups", &src, "compute_80").unwrap();
            assert!(ptx.contains("flash_forward_64") && ptx.contains("%nctaid.x"));
            let ptx =
                braid_cuda::nvrtc::compile_ptx("flash-groups", &hopper_source(d), HOPPER_ARCH)
                    .unwrap();
            assert!(ptx.contains("flash_forward_wg_128_2"));
        }
    }

    #[test]
    fn head_size_128_blocks_become_defines_or_a_clear_refusal() {
        assert_eq!(blocks_128(None).unwrap(), "");
        let d = blocks_128(Some("3, 2,2")).unwrap();
        assert_eq!(
            d,
            "#define FLASH128_FWD 3\n#define FLASH128_DKDV 2\n#define FLASH128_DQ 2\n"
        );
        for bad in ["3,2", "0,2,2", "9,2,2", "a,b,c", ""] {
            let e = blocks_128(Some(bad)).unwrap_err().to_string();
            assert!(e.contains("BRAID_FLASH128_BLOCKS"), "{bad}: {e}");
        }
        // With NVRTC at hand (CI unpacks it), the defines compile.
        if braid_cuda::nvrtc::version().is_ok() {
            let src = format!("{d}{}", SOURCES[2].1);
            let ptx = braid_cuda::nvrtc::compile_ptx("flash-blocks", &src, "compute_90").unwrap();
            assert!(ptx.contains("flash_forward_128"));
        }
    }

    /// The Hopper kernels' shared memory fits an H100's or H200's 227 KiB
    /// per block, and the forward's leaves room for two blocks per SM at
    /// head size 128 (its `wgmma` form's plan).
    #[test]
    fn the_hopper_kernels_fit_hoppers_shared_memory() {
        const PER_SM: usize = 228 * 1024;
        const PER_BLOCK: usize = 227 * 1024;
        for hs in HOPPER_HEAD_SIZES {
            for bytes in [
                hopper_bytes(hs),
                hopper_pipelined_bytes(hs),
                hopper_dkdv_bytes(hs),
                hopper_dq_bytes(hs),
                hopper_dq_recompute_bytes(hs),
            ] {
                assert!(bytes <= PER_BLOCK, "head size {hs}: {bytes} bytes");
            }
        }
        // Each block also holds 1 KiB the driver reserves.
        assert!(2 * (hopper_bytes(128) + 1024) <= PER_SM);
        assert!(4 * (hopper_bytes(64) + 1024) <= PER_SM);
    }

    /// `BRAID_FLASH_FORWARD`'s and `BRAID_FLASH_BACKWARD`'s values; the
    /// Hopper kernels exist in the `compute_90a` build of the appended
    /// source only (NVRTC at hand).
    #[test]
    fn the_hopper_kernels_are_chosen_and_built_for_compute_90a() {
        for var in [FORWARD_VAR, BACKWARD_VAR] {
            let parse = |v| Products::parse(var, v);
            assert_eq!(parse(None).unwrap(), None);
            assert_eq!(parse(Some("auto")).unwrap(), None);
            assert_eq!(parse(Some("mma")).unwrap(), Some(Products::MmaSync));
            assert_eq!(parse(Some(" wgmma")).unwrap(), Some(Products::Wgmma));
            let e = parse(Some("tma")).unwrap_err().to_string();
            assert!(
                e.contains(&format!("{var}=\"tma\": expected auto, mma or wgmma")),
                "{e}"
            );
            // Unset: Hopper's products on 9.0 only; a Hopper choice
            // elsewhere is refused, naming the variable and the GPU.
            let choose = |v, cc| Products::choose(var, v, cc);
            assert_ne!(choose(None, (9, 0)).unwrap(), Products::MmaSync);
            assert_eq!(choose(Some("mma"), (9, 0)).unwrap(), Products::MmaSync);
            for cc in [(8, 0), (8, 9), (10, 0), (12, 0)] {
                assert_eq!(choose(None, cc).unwrap(), Products::MmaSync);
                let e = choose(Some("wgmma"), cc).unwrap_err().to_string();
                assert!(e.contains(&format!("{var}=wgmma: Hopper's")), "{e}");
                assert!(e.contains(&format!("this one is {}.{}", cc.0, cc.1)), "{e}");
            }
        }
        assert_eq!(
            Products::default_for(FORWARD_VAR, (9, 0)),
            Products::WgmmaPaired
        );
        assert_eq!(Products::default_for(BACKWARD_VAR, (9, 0)), Products::Wgmma);
        // Two warpgroups a block: the forward kernel only.
        let paired = Products::parse(FORWARD_VAR, Some("wgmma2")).unwrap();
        assert_eq!(paired, Some(Products::WgmmaPaired));
        let pipelined = Products::parse(FORWARD_VAR, Some("wgmma2p")).unwrap();
        assert_eq!(pipelined, Some(Products::WgmmaPipelined));
        assert_eq!(Products::WgmmaPipelined.name(), "wgmma2p");
        let e = Products::parse(BACKWARD_VAR, Some("wgmma2"))
            .unwrap_err()
            .to_string();
        assert!(e.ends_with("expected auto, mma or wgmma"), "{e}");
        if braid_cuda::nvrtc::version().is_ok() {
            let src = hopper_source("");
            let ptx = braid_cuda::nvrtc::compile_ptx("flash-hopper", &src, HOPPER_ARCH).unwrap();
            for hs in HOPPER_HEAD_SIZES {
                for kernel in [
                    "flash_forward_wg",
                    "flash_dkdv_wg",
                    "flash_dq_ds_wg",
                    "flash_dq_wg",
                ] {
                    let entry = format!(".entry {kernel}_{hs}(");
                    assert!(ptx.contains(&entry), "{entry}");
                }
                for suffix in ["_2", "_2p"] {
                    let entry = format!(".entry flash_forward_wg_{hs}{suffix}(");
                    assert!(ptx.contains(&entry), "{entry}");
                }
            }
            assert!(ptx.contains("wgmma.mma_async") && ptx.contains("flash_forward_128"));
            let plain = braid_cuda::nvrtc::compile_ptx("flash-hopper", &src, "compute_90").unwrap();
            assert!(!plain.contains("_wg_") && plain.contains("flash_forward_128"));
        }
    }
}
