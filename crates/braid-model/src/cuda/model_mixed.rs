//! The GPT model on one GPU in mixed precision: bf16 matrix products
//! (cuBLAS, f32 accumulation; biases, the residual add and the MLP's GELU
//! inside the products through cuBLASLt epilogues where available) and
//! bf16 activations, with the residual stream, LayerNorm statistics, the
//! loss and every gradient in f32. Attention is [`super::mixed_attention`]
//! (fused flash-style kernels, or batched products).
//! Parameters come twice: the f32 master copy (LayerNorms, biases,
//! embeddings) and its bf16 copy (the matrices of the products), which the
//! optimizer refreshes — or, with streamed weights ([`MixedOptions`]), one
//! layer's bf16 weights cast as the passes reach it. Activations and
//! scratch come from one [`DevicePool`] at construction (the batch's small
//! buffers from [`DeviceBatch`]), so a step allocates nothing. What the
//! backward pass needs and the forward pass did not keep (the LayerNorm
//! outputs, the GELU, whole blocks under checkpointing) is recomputed in
//! the forward pass's arithmetic.

use super::batch::DeviceBatch;
use super::f32_params::F32Params;
use super::flash::{FlashKernels, ScoreGrads};
use super::mixed::MixedKernels;
use super::mixed_attention::{self as attention, AttnPath, AttnSaved, AttnShared};
use super::model::LayerRanges;
use super::profile::PhaseTimer;
use super::Kernels;
use crate::cpu::attention::AttnShape;
use crate::layout::{Block, Layout};
use braid_cuda::blas::{Blas, GemmEx, Mat};
use braid_cuda::blaslt::{BlasLt, Epilogue, LtGemm, Tuning};
use braid_cuda::memory::{copy_async, zero_async};
use braid_cuda::{
    CudaError, Device, DeviceBuffer, DeviceMem, DevicePool, DeviceWindow, Result, Stream,
};
use half::bf16;
use std::ops::Range;
use std::sync::Arc;

mod fresh;
mod saved;
pub use fresh::first_writes;
pub use saved::SavedFor;

/// What a layer's forward pass keeps for its backward pass (besides its
/// input, the residual stream below it). The two LayerNorms keep only
/// their statistics: their outputs (the inputs of the qkv and fc products)
/// are recomputed by the LayerNorm backward, bit for bit, just before the
/// weight gradients that read them.
struct LayerSaved {
    ln1_mean: DeviceBuffer<f32>,
    ln1_rstd: DeviceBuffer<f32>,
    ln2_mean: DeviceBuffer<f32>,
    ln2_rstd: DeviceBuffer<f32>,
    /// The attention's output (the proj product's input).
    atty: DeviceBuffer<bf16>,
    /// The rest of the block's activations; `None` under checkpointing,
    /// where the model's `work` buffers receive them again at the start of
    /// the block's backward pass.
    acts: Option<BlockActs>,
    /// Under checkpointing with the fused attention: the rows'
    /// log-sum-exp, so that the attention itself need not run again.
    lse: Option<DeviceBuffer<f32>>,
    /// Under checkpointing with the attention kept
    /// ([`MixedOptions::keep_attention`]): the attention's saved state, so
    /// that the recomputation starts after it (no LayerNorm, no qkv
    /// product, no attention).
    attn: Option<AttnSaved>,
}

/// A block's activations that checkpointing recomputes instead of keeping.
struct BlockActs {
    /// The attention's saved state (fused: the biased projection and the
    /// log-sum-exp; batched: per-head q, k, v and the probabilities);
    /// `None` in the shared buffers when every layer keeps its own.
    attn: Option<AttnSaved>,
    /// The residual stream after the attention (the second LayerNorm's input).
    resid2: DeviceBuffer<f32>,
    /// The MLP's pre-activation (bias included). Its GELU is not kept:
    /// the backward pass recomputes it (one write in the pass that reads
    /// `fch` anyway), saving 8 bytes per token and width of every layer.
    fch: DeviceBuffer<bf16>,
}

impl BlockActs {
    fn new(
        p: &DevicePool,
        s: &Stream,
        shape: AttnShape,
        path: AttnPath,
        with_attention: bool,
    ) -> Result<BlockActs> {
        let n = shape.b * shape.t;
        Ok(BlockActs {
            attn: match with_attention {
                true => Some(AttnSaved::new(p, s, shape, path)?),
                false => None,
            },
            resid2: p.zeros(n * shape.c, s)?,
            fch: p.zeros(n * 4 * shape.c, s)?,
        })
    }
}

/// Whether the fused attention's stored score gradients fit in a block's
/// `resid2` and `fch` (their heads split between the two, whole heads
/// each), which the backward pass has read for the last time when the
/// attention's backward pass runs: then they need no memory of their own.
/// At head size 128 and a sequence of 1024 they do (with 40 % to spare);
/// at head size 64 they do not.
pub fn score_grads_fit_in_block(shape: AttnShape) -> bool {
    let nc = shape.b * shape.t * shape.c;
    // fch: 4·nc bf16; resid2: nc f32, 2·nc bf16.
    FlashKernels::score_grads_split(shape, 4 * nc, 2 * nc).1
}

/// Whether a block's forward pass runs for the loss, or again under
/// checkpointing for its backward pass (then it stops before the last
/// product, whose output is the kept residual stream).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Pass {
    Forward,
    Recompute,
}

impl Pass {
    /// The phase timer's name for a phase of this pass.
    fn phase(self, forward: &'static str, recompute: &'static str) -> &'static str {
        match self {
            Pass::Forward => forward,
            Pass::Recompute => recompute,
        }
    }
}

/// The products' bf16 weights when the model keeps no full bf16 copy of
/// its parameters: each layer's parameters are cast from the f32 master
/// copy into one layer's buffer just before the layer's forward pass and
/// again before its backward pass, and the token embeddings (the
/// classifier's) once per step. 2 bytes per parameter less, for two casts
/// of every parameter per step.
struct StreamedWeights {
    /// One layer's parameters, in layout order (allocated at the first
    /// cast: a model given its layers in bf16 never casts one).
    layer: Option<DeviceBuffer<bf16>>,
    /// The layer whose current parameters `layer` holds.
    holds: Option<usize>,
    /// A layer's bf16 parameters handed in by the caller
    /// ([`GpuGptMixed::give_layer_weights`]): used instead of a cast.
    given: Option<(usize, DeviceBuffer<bf16>)>,
    /// The token embeddings, cast by the forward pass for the step.
    wte: DeviceBuffer<bf16>,
}

/// How a [`GpuGptMixed`] is built.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MixedOptions {
    /// Recompute the blocks' activations in the backward pass
    /// ([`GpuGptMixed::with_options`]).
    pub checkpointing: bool,
    /// No full bf16 copy of the parameters: the forward and backward
    /// passes take `pb = None` and cast each layer's weights as they go.
    pub streamed_weights: bool,
    /// With the fused attention, store the score gradients
    /// (`FlashKernels::score_grads_len`) so that the backward pass's dQ
    /// kernel reads them instead of recomputing them: faster, same bits.
    /// They go into the block's `resid2` and `fch`, idle by then, where
    /// they fit ([`score_grads_fit_in_block`]), else into scratch of their
    /// own.
    pub stored_score_grads: bool,
    /// Under checkpointing with the fused attention, each layer keeps the
    /// attention's saved state (the biased qkv and the log-sum-exp, 6
    /// bytes per token and width more than the log-sum-exp alone), so the
    /// backward pass recomputes only from the attention's output on: two
    /// products of four instead of three, same bits.
    pub keep_attention: bool,
}

/// Layer `l`'s bf16 weights (`block`, its range of the layout): the full
/// copy `pb`, or the streamed layer buffer, cast from `p` now unless it
/// holds the layer already. Returns the buffer and the layout index of
/// its first element.
#[allow(clippy::too_many_arguments)]
fn layer_weights<'a>(
    mk: &MixedKernels,
    s: &Stream,
    pool: &DevicePool,
    streamed: &'a mut Option<StreamedWeights>,
    pb: Option<&'a DeviceBuffer<bf16>>,
    p: F32Params<'_>,
    l: usize,
    block: Range<usize>,
) -> Result<(&'a DeviceBuffer<bf16>, usize)> {
    match (pb, streamed) {
        (Some(pb), _) => Ok((pb, 0)),
        (None, Some(st)) => {
            if let Some((given, w)) = &st.given {
                return match *given == l {
                    true => Ok((w, block.start)),
                    false => Err(CudaError::Invalid(format!(
                        "layer {l}'s pass was given layer {given}'s bf16 weights"
                    ))),
                };
            }
            let len = block.len();
            if st.layer.is_none() {
                st.layer = Some(pool.zeros(len, s)?);
            }
            let layer = st.layer.as_mut().expect("allocated above");
            if st.holds != Some(l) {
                mk.to_bf16(s, &mut layer.view_mut(0..len), &p.view(block.clone())?)?;
                st.holds = Some(l);
            }
            Ok((layer, block.start))
        }
        (None, None) => Err(no_weights()),
    }
}

fn no_weights() -> CudaError {
    CudaError::Invalid("no bf16 weights: pass the bf16 copy or build the model to stream".into())
}

fn no_acts() -> CudaError {
    CudaError::Invalid("a layer has neither its own activations nor checkpointing's".into())
}

/// Row-major `c[m,n] = a · b + beta · c` through cuBLAS.
#[allow(clippy::too_many_arguments)]
fn mm(
    blas: &mut Blas,
    s: &Stream,
    m: usize,
    n: usize,
    k: usize,
    a: Mat,
    b: Mat,
    c: Mat,
    beta: f32,
) -> Result<()> {
    blas.gemm_ex(
        s,
        &GemmEx {
            m,
            n,
            k,
            a,
            b,
            c,
            alpha: 1.0,
            beta,
            batch: 1,
            tf32: false,
        },
    )
}

/// One row-major product `a[m,k] · b[k,n]`, run plain (cuBLAS) or with a
/// fused epilogue (cuBLASLt).
#[derive(Clone, Copy)]
struct Product {
    m: usize,
    n: usize,
    k: usize,
    a: Mat,
    b: Mat,
}

impl Product {
    /// `c = a · b + beta · c` through cuBLAS.
    fn plain(self, blas: &mut Blas, s: &Stream, c: Mat, beta: f32) -> Result<()> {
        mm(blas, s, self.m, self.n, self.k, self.a, self.b, c, beta)
    }

    /// `d = a · b (+ residual)` with `epilogue` in one cuBLASLt product
    /// (the residual may be another buffer than `d`). `false`, with
    /// nothing run, when there is no cuBLASLt or it has no algorithm for
    /// this epilogue here (the epilogue is then switched off with a note):
    /// the caller takes the unfused route.
    fn fused(
        self,
        lt: &mut Option<FusedProducts>,
        s: &Stream,
        residual: Option<Mat>,
        d: Mat,
        epilogue: Epilogue,
    ) -> Result<bool> {
        let Some(fused) = lt.as_mut() else {
            return Ok(false);
        };
        let kind = epilogue.kind() as usize;
        if fused.off[kind] {
            return Ok(false);
        }
        let g = LtGemm {
            m: self.m,
            n: self.n,
            k: self.k,
            a: self.a,
            b: self.b,
            c: residual.unwrap_or(d),
            d,
            epilogue,
            alpha: 1.0,
            beta: if residual.is_some() { 1.0 } else { 0.0 },
        };
        match fused.lt.gemm(s, &g) {
            Ok(()) => Ok(true),
            Err(CudaError::Invalid(e)) => Err(CudaError::Invalid(e)),
            Err(e) => {
                eprintln!(
                    "note: cuBLASLt has no fused product for {epilogue:?} here ({e}); \
                     using a separate pass"
                );
                fused.off[kind] = true;
                Ok(false)
            }
        }
    }
}

/// `dx = dy · wᵀ` (overwritten) for `y[n,out] = x[n,inp] · w[inp,out]`.
#[allow(clippy::too_many_arguments)]
fn input_grad(
    blas: &mut Blas,
    s: &Stream,
    n: usize,
    inp: usize,
    out: usize,
    dy: Mat,
    w: Mat,
    dx: Mat,
) -> Result<()> {
    mm(blas, s, n, inp, out, dy, w.t(), dx, 0.0)
}

/// `dw = xᵀ · dy + beta · dw` for `y[n,out] = x[n,inp] · w[inp,out]`
/// (`beta` 1 adds, 0 overwrites: [`fresh`]).
#[allow(clippy::too_many_arguments)]
fn weight_grad(
    blas: &mut Blas,
    s: &Stream,
    n: usize,
    inp: usize,
    out: usize,
    x: Mat,
    dy: Mat,
    dw: Mat,
    beta: f32,
) -> Result<()> {
    mm(blas, s, inp, out, n, x.t(), dy, dw, beta)
}

/// A layer's four weight-gradient products.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightGrads {
    /// The MLP's output projection.
    FcProj,
    /// The MLP's input projection.
    Fc,
    /// The attention's output projection.
    Proj,
    /// The attention's input projection (q, k, v).
    Qkv,
}

impl WeightGrads {
    /// All four, in the order the backward pass meets them.
    pub const ALL: &'static [WeightGrads] = &[
        WeightGrads::FcProj,
        WeightGrads::Fc,
        WeightGrads::Proj,
        WeightGrads::Qkv,
    ];
}

/// The output gradients a layer's four products saw, kept when its
/// weight gradients are deferred until after the embedding backward (so
/// that the embeddings' gradient reduction, the largest, overlaps them
/// instead of ending the backward pass exposed). Swapped with the model's
/// scratch buffers, never copied.
struct DeferredDy {
    /// The MLP's recomputed GELU (the output projection's input).
    gelu: DeviceBuffer<bf16>,
    /// The recomputed LayerNorm outputs (the fc and qkv products' inputs).
    ln2: DeviceBuffer<bf16>,
    ln1: DeviceBuffer<bf16>,
    fcproj: DeviceBuffer<bf16>,
    fc: DeviceBuffer<bf16>,
    proj: DeviceBuffer<bf16>,
    qkv: DeviceBuffer<bf16>,
}

/// Where the wide scratch ([`GpuGptMixed`]'s `wide`, `b·t × 4·width`)
/// holds its two parts that live at once in the attention's backward pass:
/// the attention's input gradient (or, in the forward pass, the unbiased
/// qkv product) and its output gradient.
struct Wide;

impl Wide {
    /// The qkv product or its gradient: `n × 3c`, first.
    fn qkv(n: usize, c: usize) -> Range<usize> {
        0..n * 3 * c
    }

    /// The attention's output gradient: `n × c`, last.
    fn datty(n: usize, c: usize) -> Range<usize> {
        n * 3 * c..n * 4 * c
    }
}

/// Address and length of a device vector (a bias for [`Product::fused`]).
fn span<T: braid_core::Element>(v: &impl DeviceMem<T>) -> (u64, usize) {
    (v.dptr(), v.dlen())
}

/// cuBLASLt for fused-epilogue products, and which epilogues it turned
/// out not to support here (those run as separate passes).
struct FusedProducts {
    lt: BlasLt,
    off: [bool; 4],
}

/// Fused-epilogue products, unless `BRAID_FUSED_EPILOGUES=0` or cuBLASLt
/// is missing (then the model adds biases and GELU in separate passes);
/// their algorithms timed on first use unless `BRAID_GEMM_TUNE=off` (see
/// [`Tuning`]).
fn fused_products(device: &Device) -> Result<Option<FusedProducts>> {
    let tuning = Tuning::from_env()?;
    if std::env::var("BRAID_FUSED_EPILOGUES").is_ok_and(|v| v == "0") {
        return Ok(None);
    }
    Ok(BlasLt::new(device).ok().map(|mut lt| {
        lt.set_tuning(tuning);
        FusedProducts {
            lt,
            off: [false; 4],
        }
    }))
}

/// A GPT model's mixed-precision forward and backward passes on one GPU,
/// sized for one (batch, sequence) shape.
pub struct GpuGptMixed {
    layout: Arc<Layout>,
    stream: Stream,
    kernels: Kernels,
    mk: MixedKernels,
    /// Which attention implementation the layers use.
    path: AttnPath,
    /// Fused-epilogue products (cuBLASLt), where available.
    lt: Option<FusedProducts>,
    blas: Blas,
    pool: DevicePool,
    b: usize,
    t: usize,
    /// The vocabulary rounded up to a multiple of 64: the classifier's
    /// products run over `vp` rows of a zero-padded embedding copy (an odd
    /// vocabulary makes cuBLAS several times slower).
    vp: usize,
    /// Where the vocabulary is not a multiple of 64: the bf16 token
    /// embeddings over `vp` rows (rows past the vocabulary zero), and the
    /// classifier's f32 embedding gradient over `vp` rows. Otherwise the
    /// products use the parameters and the gradient buffer directly.
    pad: Option<(DeviceBuffer<bf16>, DeviceBuffer<f32>)>,
    ranges: Vec<LayerRanges>,
    layers: Vec<LayerSaved>,
    /// Under checkpointing (`--checkpointing`): the one block's
    /// activations, recomputed at the start of each block's backward pass.
    work: Option<BlockActs>,
    /// Without a full bf16 copy of the parameters: the cast weights.
    streamed: Option<StreamedWeights>,
    resid: Vec<DeviceBuffer<f32>>,
    lnf: DeviceBuffer<bf16>,
    lnf_mean: DeviceBuffer<f32>,
    lnf_rstd: DeviceBuffer<f32>,
    logits: DeviceBuffer<bf16>,
    losses: DeviceBuffer<f32>,
    batch: DeviceBatch,
    attn: AttnShared,
    // Scratch shared by the layers.
    /// A LayerNorm's output: written by the forward pass for the product
    /// it feeds, recomputed by the backward pass for that product's
    /// weight gradient.
    ln: DeviceBuffer<bf16>,
    /// The wide scratch (`b·t × 4·width` bf16), holding one thing at a
    /// time. Forward: the qkv product where the attention does not take
    /// it into its saved state (the first `b·t × 3·width`), then the
    /// MLP's GELU, the output projection's input. Backward: the GELU's
    /// input gradient (made the pre-activation's in place), then the
    /// attention's output gradient (the last `b·t × width`) and its input
    /// gradient dqkv (the first `b·t × 3·width`). See [`Wide`].
    wide: DeviceBuffer<bf16>,
    dresid: DeviceBuffer<f32>,
    dresid_bf: DeviceBuffer<bf16>,
    dln: DeviceBuffer<bf16>,
    partial: DeviceBuffer<f32>,
    /// Layers `0..deferred.len()` defer their weight gradients.
    deferred: Vec<DeferredDy>,
    /// SMs the backward pass's products are planned for (0: all), when
    /// communication kernels hold the others (`BRAID_BACKWARD_SM_TARGET`).
    backward_sms: usize,
    prof: PhaseTimer,
    /// Lengths of the saved buffers [`own_saved`](Self::own_saved)
    /// dropped, for the next forward pass to allocate (empty: none).
    unowned_saved: Vec<usize>,
    /// Whether the backward pass overwrites the weight gradients.
    fresh: fresh::FreshGrads,
    /// The block whose activations [`recompute_layer`](Self::recompute_layer)
    /// rebuilt for its backward pass, next.
    recomputed: Option<usize>,
    /// The stored score gradients live in the block's `resid2` and `fch`
    /// during the attention's backward pass ([`score_grads_fit_in_block`]),
    /// not in scratch of their own.
    score_grads_in_block: bool,
}

impl GpuGptMixed {
    /// Buffers for batches of `b × t` tokens on `device`.
    pub fn new(device: &Device, layout: Arc<Layout>, b: usize, t: usize) -> Result<GpuGptMixed> {
        Self::with_options(device, layout, b, t, MixedOptions::default())
    }

    /// As [`new`](Self::new). With `checkpointing`, layers keep only their
    /// input, LayerNorm statistics, attention output and (fused attention)
    /// log-sum-exp, and each block's backward pass first runs its forward
    /// pass again up to the MLP's pre-activation: three of its four
    /// products, no attention (batched attention: that too). With
    /// `streamed_weights` there is no full bf16 copy of the parameters
    /// (see [`MixedOptions`]). Either way the gradients are the same bit
    /// for bit.
    pub fn with_options(
        device: &Device,
        layout: Arc<Layout>,
        b: usize,
        t: usize,
        options: MixedOptions,
    ) -> Result<GpuGptMixed> {
        let checkpointing = options.checkpointing;
        let cfg = layout.config;
        let (c, v, nh) = (cfg.n_embd, cfg.vocab_size, cfg.n_head);
        if c % nh != 0 {
            return Err(CudaError::Invalid(format!(
                "width {c} is not a multiple of the {nh} heads"
            )));
        }
        let n = b * t;
        let vp = v.div_ceil(64) * 64;
        let shape = AttnShape { b, t, c, nh };
        let mk = MixedKernels::load(device)?;
        let path = AttnPath::choose(&mk, shape)?;
        // The device's own stream: collectives order themselves after it.
        let stream = device.main_stream();
        let pool = DevicePool::new(device);
        let (s, p) = (&stream, &pool);
        let mut layers = Vec::new();
        let fused = path == AttnPath::Fused;
        let keep_attention = checkpointing && fused && options.keep_attention;
        for _ in 0..cfg.n_layer {
            layers.push(LayerSaved {
                ln1_mean: p.zeros(n, s)?,
                ln1_rstd: p.zeros(n, s)?,
                ln2_mean: p.zeros(n, s)?,
                ln2_rstd: p.zeros(n, s)?,
                atty: p.zeros(n * c, s)?,
                acts: match checkpointing {
                    false => Some(BlockActs::new(p, s, shape, path, true)?),
                    true => None,
                },
                lse: match checkpointing && fused && !keep_attention {
                    true => Some(p.zeros(b * nh * t, s)?),
                    false => None,
                },
                attn: match keep_attention {
                    true => Some(AttnSaved::new(p, s, shape, path)?),
                    false => None,
                },
            });
        }
        let work = match checkpointing {
            true => Some(BlockActs::new(p, s, shape, path, !keep_attention)?),
            false => None,
        };
        let streamed = match options.streamed_weights {
            true => Some(StreamedWeights {
                layer: None,
                holds: None,
                given: None,
                wte: p.zeros(v * c, s)?,
            }),
            false => None,
        };
        // Stored score gradients go into each block's idle resid2 and fch
        // where they fit, else into scratch of their own.
        let score_grads_in_block =
            fused && options.stored_score_grads && score_grads_fit_in_block(shape);
        let stored_own = options.stored_score_grads && !score_grads_in_block;
        let partial_len = MixedKernels::partial_len(n, 4 * c, 1)
            .max(MixedKernels::partial_len(n, c, 3))
            .max(MixedKernels::gelu_partial_len(n, 4 * c));
        let model = GpuGptMixed {
            kernels: Kernels::load(device)?,
            mk,
            path,
            lt: fused_products(device)?,
            blas: Blas::new(device)?,
            b,
            t,
            vp,
            ranges: (0..cfg.n_layer)
                .map(|i| LayerRanges::of(&layout, i))
                .collect(),
            layers,
            work,
            streamed,
            resid: (0..=cfg.n_layer)
                .map(|_| p.zeros(n * c, s))
                .collect::<Result<_>>()?,
            lnf: p.zeros(n * c, s)?,
            lnf_mean: p.zeros(n, s)?,
            lnf_rstd: p.zeros(n, s)?,
            logits: p.zeros(n * vp, s)?,
            pad: if vp == v {
                None
            } else {
                Some((p.zeros(vp * c, s)?, p.zeros(vp * c, s)?))
            },
            losses: p.zeros(n, s)?,
            batch: DeviceBatch::new(device, n, v)?,
            attn: AttnShared::new(p, s, shape, path, stored_own)?,
            ln: p.zeros(n * c, s)?,
            wide: p.zeros(n * 4 * c, s)?,
            dresid: p.zeros(n * c, s)?,
            dresid_bf: p.zeros(n * c, s)?,
            dln: p.zeros(n * c, s)?,
            partial: p.zeros(partial_len, s)?,
            deferred: Vec::new(),
            backward_sms: std::env::var("BRAID_BACKWARD_SM_TARGET")
                .ok()
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0),
            prof: PhaseTimer::from_env(device),
            unowned_saved: Vec::new(),
            fresh: fresh::FreshGrads::default(),
            recomputed: None,
            score_grads_in_block,
            layout,
            pool,
            stream,
        };
        model.stream.synchronize()?;
        Ok(model)
    }

    /// The loaded f32 kernels (embeddings, norms, scaling).
    pub fn kernels(&self) -> &Kernels {
        &self.kernels
    }

    /// The loaded mixed-precision kernels.
    pub fn mixed_kernels(&self) -> &MixedKernels {
        &self.mk
    }

    /// Which attention implementation the layers use.
    pub fn attention_path(&self) -> AttnPath {
        self.path
    }

    /// The stream everything runs on.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// The pool the model's buffers come from (for scratch on its stream).
    pub fn pool(&self) -> &DevicePool {
        &self.pool
    }

    /// Defers the weight gradients of layers `0..layers` until after the
    /// embedding backward ([`backward_layer_weights`](Self::backward_layer_weights)):
    /// their products read the output gradients kept aside (and the
    /// recomputed GELU and LayerNorm outputs: seven bf16 buffers per
    /// layer, `15·b·t·width` elements). Results are the same
    /// bit for bit; only the order of the work changes.
    pub fn defer_weight_grads(&mut self, layers: usize) -> Result<()> {
        let cfg = self.layout.config;
        if layers > cfg.n_layer {
            return Err(CudaError::Invalid(format!(
                "cannot defer the weight gradients of {layers} layers of {}",
                cfg.n_layer
            )));
        }
        let n = self.b * self.t;
        let c = cfg.n_embd;
        let (s, p) = (&self.stream, &self.pool);
        self.deferred.clear();
        for _ in 0..layers {
            self.deferred.push(DeferredDy {
                gelu: p.zeros(n * 4 * c, s)?,
                ln2: p.zeros(n * c, s)?,
                ln1: p.zeros(n * c, s)?,
                fcproj: p.zeros(n * c, s)?,
                fc: p.zeros(n * 4 * c, s)?,
                proj: p.zeros(n * c, s)?,
                qkv: p.zeros(n * 3 * c, s)?,
            });
        }
        s.synchronize()
    }

    /// How many layers defer their weight gradients.
    pub fn deferred_layers(&self) -> usize {
        self.deferred.len()
    }

    fn range(&self, name: &str) -> Range<usize> {
        self.layout.get(name).expect("model parameter").range()
    }

    /// Checks the parameters' lengths; without a full bf16 copy (`pb`
    /// `None`) the model must stream its bf16 weights.
    fn check_params(&self, p: F32Params<'_>, pb: Option<&DeviceBuffer<bf16>>) -> Result<()> {
        if pb.is_none() && self.streamed.is_none() {
            return Err(CudaError::Invalid(
                "no bf16 copy of the parameters, and the model was not built to stream its \
                 bf16 weights"
                    .into(),
            ));
        }
        p.check(self.layout.len)?;
        let pb_len = pb.map_or(self.layout.len, |b| b.len());
        if pb_len != self.layout.len {
            return Err(CudaError::Invalid(format!(
                "parameters: {pb_len} bf16 elements for a model of {}",
                self.layout.len
            )));
        }
        Ok(())
    }

    /// Forward pass with master parameters `p` and their bf16 copy `pb`
    /// (`None` when the model streams its bf16 weights).
    /// With `grad`, the logits become the loss's gradient for
    /// [`backward`](Self::backward). Returns the mean loss over targets
    /// that are not `u32::MAX`. The same as
    /// [`forward_begin`](Self::forward_begin),
    /// [`forward_encoder`](Self::forward_encoder), every
    /// [`forward_block`](Self::forward_block) and
    /// [`forward_head`](Self::forward_head).
    pub fn forward<'p>(
        &mut self,
        p: impl Into<F32Params<'p>>,
        pb: Option<&DeviceBuffer<bf16>>,
        tokens: &[u32],
        targets: &[u32],
        grad: bool,
    ) -> Result<f32> {
        let p = p.into();
        self.check_params(p, pb)?;
        self.forward_begin(tokens, targets)?;
        let span = |name: &dyn Fn() -> String, s: &Stream| {
            braid_trace::scope::start(Some(s), braid_trace::Cat::Compute, name)
        };
        let t = span(&|| "forward embedding".into(), &self.stream);
        self.forward_encoder(p)?;
        drop(t);
        for l in 0..self.layout.config.n_layer {
            let _t = span(&|| format!("forward layer {l}"), &self.stream);
            self.forward_layer(l, p, pb, Pass::Forward)?;
        }
        let _t = span(&|| "forward head".into(), &self.stream);
        self.forward_head(p, pb, grad)
    }

    /// Hands the next passes layer `l`'s bf16 weights, `w` (the layer's
    /// block of the layout, in layout order: what a cast of its f32
    /// parameters would give), to use instead of casting them; `None`
    /// takes them back (later passes cast again). Only for a model built
    /// to stream its weights. The caller keeps `w`'s memory until the
    /// passes queued with it have run.
    pub fn give_layer_weights(&mut self, given: Option<(usize, DeviceBuffer<bf16>)>) -> Result<()> {
        let Some(st) = &mut self.streamed else {
            return Err(CudaError::Invalid(
                "bf16 layer weights handed to a model that keeps a whole bf16 copy".into(),
            ));
        };
        if let Some((l, w)) = &given {
            let cfg = self.layout.config;
            if *l >= cfg.n_layer {
                return Err(CudaError::Invalid(format!(
                    "bf16 weights of layer {l} for a model of {}",
                    cfg.n_layer
                )));
            }
            let want = self.layout.block_range(Block::Layer(*l)).len();
            if w.len() != want {
                return Err(CudaError::Invalid(format!(
                    "layer {l}'s bf16 weights: {} elements, the layer has {want}",
                    w.len()
                )));
            }
        }
        st.given = given;
        Ok(())
    }

    /// Starts a forward pass in parts on a batch (`b × t` tokens and their
    /// targets): uploads it.
    pub fn forward_begin(&mut self, tokens: &[u32], targets: &[u32]) -> Result<()> {
        self.own_missing()?;
        self.fresh.forward_starts();
        self.recomputed = None;
        if let Some(st) = &mut self.streamed {
            // The parameters may have changed since the last cast.
            st.holds = None;
        }
        if self.backward_sms > 0 {
            self.blas.set_sm_count_target(0)?;
        }
        let cfg = self.layout.config;
        self.batch
            .upload(tokens, targets, self.b, self.t, cfg.context)
    }

    /// The token and position embeddings' forward pass (after
    /// [`forward_begin`](Self::forward_begin)): reads `wte` and `wpe` from
    /// `p`. Queued; nothing waits.
    pub fn forward_encoder<'p>(&mut self, p: impl Into<F32Params<'p>>) -> Result<()> {
        let p = p.into();
        p.check(self.layout.len)?;
        let c = self.layout.config.n_embd;
        let (b, t) = (self.b, self.t);
        let (wte, wpe) = (self.range("wte.weight"), self.range("wpe.weight"));
        let (s, k, prof) = (&self.stream, &self.kernels, &mut self.prof);
        prof.mark(s, "start")?;
        k.encoder_forward(
            s,
            &mut self.resid[0],
            self.batch.tokens(),
            &p.view(wte)?,
            &p.view(wpe)?,
            b * t,
            t,
            c,
        )?;
        prof.mark(s, "fwd encoder")
    }

    /// Transformer block `l`'s forward pass (after the blocks below it):
    /// reads the block's parameters from `p` (and its bf16 weights from
    /// `pb`, or cast from `p` when streaming). Queued; nothing waits.
    pub fn forward_block<'p>(
        &mut self,
        l: usize,
        p: impl Into<F32Params<'p>>,
        pb: Option<&DeviceBuffer<bf16>>,
    ) -> Result<()> {
        let p = p.into();
        self.check_params(p, pb)?;
        if l >= self.layout.config.n_layer {
            return Err(CudaError::Invalid(format!(
                "layer {l} of a model of {}",
                self.layout.config.n_layer
            )));
        }
        self.forward_layer(l, p, pb, Pass::Forward)
    }

    /// The head's forward pass (after the last block): the final
    /// LayerNorm, the classifier (the token embeddings, bf16) and the loss.
    /// With `grad`, the logits become the loss's gradient for the backward
    /// pass. Waits, and returns the mean loss over targets that are not
    /// `u32::MAX`.
    pub fn forward_head<'p>(
        &mut self,
        p: impl Into<F32Params<'p>>,
        pb: Option<&DeviceBuffer<bf16>>,
        grad: bool,
    ) -> Result<f32> {
        let p = p.into();
        self.check_params(p, pb)?;
        let cfg = self.layout.config;
        let (c, v) = (cfg.n_embd, cfg.vocab_size);
        let (b, t, vp) = (self.b, self.t, self.vp);
        let n = b * t;
        let wte = self.range("wte.weight");
        let (lw, lb) = (self.range("ln_f.weight"), self.range("ln_f.bias"));
        let (s, mk) = (&self.stream, &self.mk);
        let blas = &mut self.blas;
        let prof = &mut self.prof;
        mk.layernorm_forward(
            s,
            &mut self.lnf,
            &mut self.lnf_mean,
            &mut self.lnf_rstd,
            &self.resid[cfg.n_layer],
            &p.view(lw)?,
            &p.view(lb)?,
            n,
            c,
        )?;
        prof.mark(s, "fwd layernorm")?;
        let wte_b = match (pb, &mut self.streamed) {
            (Some(pb), _) => pb.view(wte.clone()),
            (None, Some(st)) => {
                mk.to_bf16(s, &mut st.wte, &p.view(wte.clone())?)?;
                st.wte.view(0..v * c)
            }
            (None, None) => return Err(no_weights()),
        };
        let wte_mat = match &mut self.pad {
            Some((wte_pad, _)) => {
                copy_async(&mut wte_pad.view_mut(0..v * c), &wte_b, s)?;
                Mat::of(wte_pad, c)
            }
            None => Mat::of(&wte_b, c),
        };
        mm(
            blas,
            s,
            n,
            vp,
            c,
            Mat::of(&self.lnf, c),
            wte_mat.t(),
            Mat::of(&self.logits, vp),
            0.0,
        )?;
        prof.mark(s, "fwd gemm classifier")?;
        let scale = self.batch.loss_scale(grad);
        mk.softmax_cross_entropy(
            s,
            &mut self.logits,
            &mut self.losses,
            self.batch.targets(),
            n,
            v,
            vp,
            scale,
        )?;
        prof.mark(s, "softmax+cross-entropy")?;
        s.synchronize()?;
        self.batch.mean_loss(&self.losses)
    }

    /// Transformer block `l`'s forward pass. [`Pass::Forward`] computes its
    /// output, the next residual stream. [`Pass::Recompute`] (under
    /// checkpointing, at the start of the block's backward pass) rebuilds
    /// what that pass reads, in the same arithmetic: the LayerNorm
    /// statistics, the attention's saved state, `resid2` and `fch`. With
    /// the fused attention it keeps the attention output and restores the
    /// log-sum-exp instead of running the attention again, and it stops
    /// before the last product.
    fn forward_layer(
        &mut self,
        l: usize,
        p: F32Params<'_>,
        pb: Option<&DeviceBuffer<bf16>>,
        pass: Pass,
    ) -> Result<()> {
        let cfg = self.layout.config;
        let (c, nh) = (cfg.n_embd, cfg.n_head);
        let (b, t) = (self.b, self.t);
        let n = b * t;
        let shape = AttnShape { b, t, c, nh };
        let (s, mk) = (&self.stream, &self.mk);
        let block = self.layout.block_range(Block::Layer(l));
        let (wb, base) = layer_weights(mk, s, &self.pool, &mut self.streamed, pb, p, l, block)?;
        let w = |r: &Range<usize>| wb.view(r.start - base..r.end - base);
        let (blas, lt, prof) = (&mut self.blas, &mut self.lt, &mut self.prof);
        let r = &self.ranges[l];
        let (before, after) = self.resid.split_at_mut(l + 1);
        let (x, out) = (&before[l], &mut after[0]);
        let LayerSaved {
            ln1_mean,
            ln1_rstd,
            ln2_mean,
            ln2_rstd,
            atty,
            acts,
            lse: kept_lse,
            attn: kept_attn,
        } = &mut self.layers[l];
        let BlockActs {
            attn: block_attn,
            resid2,
            fch,
        } = acts.as_mut().or(self.work.as_mut()).ok_or_else(no_acts)?;
        // With the attention kept, the recomputation starts at its output.
        let from_atty = pass == Pass::Recompute && kept_attn.is_some();
        let attn = kept_attn
            .as_mut()
            .or(block_attn.as_mut())
            .ok_or_else(no_acts)?;
        if !from_atty {
            mk.layernorm_forward(
                s,
                &mut self.ln,
                ln1_mean,
                ln1_rstd,
                x,
                &p.view(r.ln1_w.clone())?,
                &p.view(r.ln1_b.clone())?,
                n,
                c,
            )?;
            prof.mark(s, pass.phase("fwd layernorm", "recompute layernorm"))?;
            // The fused attention keeps qkv with its bias: one product
            // writes it there when cuBLASLt can add the bias.
            let qkv_product = Product {
                m: n,
                n: 3 * c,
                k: c,
                a: Mat::of(&self.ln, c),
                b: Mat::of(&w(&r.qkv_w), 3 * c),
            };
            let into_saved = match &mut *attn {
                AttnSaved::Fused { qkv, .. } => qkv_product.fused(
                    lt,
                    s,
                    None,
                    Mat::of(qkv, 3 * c),
                    Epilogue::Bias {
                        bias: span(&w(&r.qkv_b)),
                    },
                )?,
                AttnSaved::Batched { .. } => false,
            };
            if !into_saved {
                let raw = self.wide.view(Wide::qkv(n, c));
                qkv_product.plain(blas, s, Mat::of(&raw, 3 * c), 0.0)?;
            }
            prof.mark(s, pass.phase("fwd gemm qkv", "recompute gemm qkv"))?;
            let qkv_b = p.view(r.qkv_b.clone())?;
            match (pass, kept_lse.as_mut()) {
                (Pass::Recompute, Some(kept)) => {
                    let raw = self.wide.view(Wide::qkv(n, c));
                    let unbiased = (!into_saved).then_some((&raw, &qkv_b));
                    attention::restore(mk, s, attn, unbiased, kept, shape)?;
                }
                _ => {
                    if into_saved {
                        attention::forward_prebiased(mk, s, atty, attn, shape)?;
                    } else {
                        let (sh, raw) = (&mut self.attn, self.wide.view(Wide::qkv(n, c)));
                        attention::forward(mk, blas, s, atty, &raw, &qkv_b, attn, sh, shape, prof)?;
                    }
                    if let Some(kept) = kept_lse.as_mut().filter(|_| pass == Pass::Forward) {
                        attention::keep_lse(s, attn, kept)?;
                    }
                }
            }
            prof.mark(s, pass.phase("fwd attention", "recompute attention"))?;
        }
        let proj = Product {
            m: n,
            n: c,
            k: c,
            a: Mat::of(&*atty, c),
            b: Mat::of(&w(&r.proj_w), c),
        };
        let bias = Epilogue::Bias {
            bias: span(&p.view(r.proj_b.clone())?),
        };
        if !proj.fused(lt, s, Some(Mat::of(x, c)), Mat::of(&*resid2, c), bias)? {
            mk.residual_bias(s, resid2, x, &p.view(r.proj_b.clone())?, n, c)?;
            prof.mark(
                s,
                pass.phase("fwd residual+bias", "recompute residual+bias"),
            )?;
            proj.plain(blas, s, Mat::of(&*resid2, c), 1.0)?;
        }
        prof.mark(s, pass.phase("fwd gemm proj", "recompute gemm proj"))?;
        mk.layernorm_forward(
            s,
            &mut self.ln,
            ln2_mean,
            ln2_rstd,
            &*resid2,
            &p.view(r.ln2_w.clone())?,
            &p.view(r.ln2_b.clone())?,
            n,
            c,
        )?;
        prof.mark(s, pass.phase("fwd layernorm", "recompute layernorm"))?;
        // gelu = GELU(ln2 · W + b), the pre-activation kept in fch.
        let fc = Product {
            m: n,
            n: 4 * c,
            k: c,
            a: Mat::of(&self.ln, c),
            b: Mat::of(&w(&r.fc_w), 4 * c),
        };
        let gelu = Epilogue::GeluAuxBias {
            bias: span(&w(&r.fc_b)),
            aux: span(&*fch),
            aux_ld: 4 * c,
        };
        if fc.fused(lt, s, None, Mat::of(&self.wide, 4 * c), gelu)? {
            prof.mark(s, pass.phase("fwd gemm fc", "recompute gemm fc"))?;
        } else {
            fc.plain(blas, s, Mat::of(&*fch, 4 * c), 0.0)?;
            prof.mark(s, pass.phase("fwd gemm fc", "recompute gemm fc"))?;
            mk.bias_gelu(s, fch, &mut self.wide, &p.view(r.fc_b.clone())?, n, 4 * c)?;
            prof.mark(s, pass.phase("fwd bias+gelu", "recompute bias+gelu"))?;
        }
        if pass == Pass::Recompute {
            return Ok(());
        }
        let fcproj = Product {
            m: n,
            n: c,
            k: 4 * c,
            a: Mat::of(&self.wide, 4 * c),
            b: Mat::of(&w(&r.fcproj_w), c),
        };
        let bias = Epilogue::Bias {
            bias: span(&p.view(r.fcproj_b.clone())?),
        };
        if !fcproj.fused(lt, s, Some(Mat::of(&*resid2, c)), Mat::of(out, c), bias)? {
            mk.residual_bias(s, out, &*resid2, &p.view(r.fcproj_b.clone())?, n, c)?;
            prof.mark(s, "fwd residual+bias")?;
            fcproj.plain(blas, s, Mat::of(out, c), 1.0)?;
        }
        prof.mark(s, "fwd gemm fcproj")
    }

    /// Accumulates the gradient of the last `forward(.., grad = true)` into
    /// `g` (f32, flat, same layout as the parameters) and waits for it:
    /// [`backward_head`](Self::backward_head), every
    /// [`backward_layer`](Self::backward_layer) from the last down,
    /// [`backward_embedding`](Self::backward_embedding), then the deferred
    /// layers' [`backward_layer_weights`](Self::backward_layer_weights).
    pub fn backward<'p>(
        &mut self,
        p: impl Into<F32Params<'p>>,
        pb: Option<&DeviceBuffer<bf16>>,
        g: &mut DeviceBuffer<f32>,
    ) -> Result<()> {
        let p = p.into();
        if g.len() != self.layout.len {
            return Err(CudaError::Invalid(format!(
                "gradient buffer of {} elements for a model of {}",
                g.len(),
                self.layout.len
            )));
        }
        let mut w = g.window();
        self.backward_head(p, pb, &mut w)?;
        for l in (0..self.layout.config.n_layer).rev() {
            self.backward_layer(l, p, pb, &mut w)?;
        }
        self.backward_embedding(&mut w)?;
        for l in (0..self.deferred.len()).rev() {
            self.backward_layer_weights(l, &mut w)?;
        }
        self.stream.synchronize()?;
        self.end_step()
    }

    /// Backward of the head (first, after `forward(.., grad = true)`):
    /// the classifier's share of the token embedding's gradient, the final
    /// LayerNorm's gradients (final after this), the last layer's fcproj
    /// bias gradient, and the gradient of the last residual stream. Queued
    /// on the model's stream; nothing waits. `g` holds the gradient buffer's
    /// elements that are still being written (buffer indices).
    pub fn backward_head<'p>(
        &mut self,
        p: impl Into<F32Params<'p>>,
        pb: Option<&DeviceBuffer<bf16>>,
        g: &mut DeviceWindow<'_, f32>,
    ) -> Result<()> {
        let p = p.into();
        self.check_params(p, pb)?;
        let cfg = self.layout.config;
        let (c, v) = (cfg.n_embd, cfg.vocab_size);
        let (b, t, vp) = (self.b, self.t, self.vp);
        let n = b * t;
        let wte = self.range("wte.weight");
        let (lw, lb) = (self.range("ln_f.weight"), self.range("ln_f.bias"));
        if self.backward_sms > 0 {
            self.blas.set_sm_count_target(self.backward_sms)?;
        }
        self.fresh.backward_starts();
        let beta = self.fresh.beta();
        let (s, k, mk) = (&self.stream, &self.kernels, &self.mk);
        let blas = &mut self.blas;
        let prof = &mut self.prof;
        prof.mark(s, "start")?;
        // Head (over the padded vocabulary, whose logit gradients are
        // zero): dlnf = dlogits · wte ; dwte += dlogitsᵀ · lnf.
        mm(
            blas,
            s,
            n,
            c,
            vp,
            Mat::of(&self.logits, vp),
            match &self.pad {
                Some((wte_pad, _)) => Mat::of(wte_pad, c),
                None => match (pb, &self.streamed) {
                    (Some(pb), _) => Mat::of(&pb.view(wte.clone()), c),
                    // Cast by the forward pass.
                    (None, Some(st)) => Mat::of(&st.wte, c),
                    (None, None) => return Err(no_weights()),
                },
            },
            Mat::of(&self.dln, c),
            0.0,
        )?;
        prof.mark(s, "bwd gemm classifier")?;
        // dwte: into the padded scratch (then added to the gradient), or
        // accumulated by the product into the gradient buffer itself.
        let mut gwte = g.view_mut(wte)?;
        let (dst, beta) = match &self.pad {
            Some((_, dwte_pad)) => (Mat::of(dwte_pad, c), 0.0),
            None => (Mat::of(&gwte, c), beta),
        };
        mm(
            blas,
            s,
            vp,
            c,
            n,
            Mat::of(&self.logits, vp).t(),
            Mat::of(&self.lnf, c),
            dst,
            beta,
        )?;
        if let Some((_, dwte_pad)) = &self.pad {
            k.add_inplace(s, &mut gwte, &dwte_pad.view(0..v * c))?;
        }
        prof.mark(s, "bwd gemm classifier")?;
        zero_async(&mut self.dresid, s)?;
        prof.mark(s, "bwd zero")?;
        // The column sums of the LayerNorm's dres are the last layer's
        // fcproj bias gradient.
        let top = self.ranges[cfg.n_layer - 1].fcproj_b.clone();
        let [mut gw, mut gb, mut gnext] = g.views_mut_n([lw.clone(), lb.clone(), top])?;
        mk.layernorm_backward(
            s,
            &mut self.dresid,
            &mut self.dresid_bf,
            None,
            &mut gw,
            &mut gb,
            Some(&mut gnext),
            &mut self.partial,
            &self.dln,
            &self.resid[cfg.n_layer],
            &p.view(lw)?,
            &p.view(lb.clone())?,
            &self.lnf_mean,
            &self.lnf_rstd,
            n,
            c,
        )?;
        prof.mark(s, "bwd layernorm")
    }

    /// Whether the backward pass recomputes each block's activations
    /// (activation checkpointing).
    pub fn recomputes(&self) -> bool {
        self.work.is_some()
    }

    /// Under checkpointing, the first part of block `l`'s backward pass
    /// on its own: the recomputation of its activations, which writes no
    /// gradient (so that a strategy can still be reading the gradient
    /// memory meanwhile). [`backward_layer`](Self::backward_layer) of the
    /// same block, called next, goes on from there. `false`, with nothing
    /// run, without checkpointing. Queued; nothing waits.
    pub fn recompute_layer<'p>(
        &mut self,
        l: usize,
        p: impl Into<F32Params<'p>>,
        pb: Option<&DeviceBuffer<bf16>>,
    ) -> Result<bool> {
        let p = p.into();
        self.check_params(p, pb)?;
        if self.work.is_none() {
            return Ok(false);
        }
        self.forward_layer(l, p, pb, Pass::Recompute)?;
        self.recomputed = Some(l);
        Ok(true)
    }

    /// Backward of transformer block `l` (after the blocks above it): its
    /// gradients are final after this; it also writes the fcproj bias
    /// gradient of block `l - 1`. Queued; nothing waits.
    pub fn backward_layer<'p>(
        &mut self,
        l: usize,
        p: impl Into<F32Params<'p>>,
        pb: Option<&DeviceBuffer<bf16>>,
        g: &mut DeviceWindow<'_, f32>,
    ) -> Result<()> {
        let p = p.into();
        self.check_params(p, pb)?;
        let recomputed = self.recomputed.take() == Some(l);
        if self.work.is_some() && !recomputed {
            self.forward_layer(l, p, pb, Pass::Recompute)?;
        }
        let cfg = self.layout.config;
        let (c, nh) = (cfg.n_embd, cfg.n_head);
        let (b, t) = (self.b, self.t);
        let n = b * t;
        let shape = AttnShape { b, t, c, nh };
        let (s, mk) = (&self.stream, &self.mk);
        let block = self.layout.block_range(Block::Layer(l));
        let (wb, base) = layer_weights(mk, s, &self.pool, &mut self.streamed, pb, p, l, block)?;
        let w = |r: &Range<usize>| wb.view(r.start - base..r.end - base);
        let blas = &mut self.blas;
        let prof = &mut self.prof;
        let r = &self.ranges[l];
        let defer = l < self.deferred.len();
        // MLP: out = resid2 + gelu(fch) · Wfcproj + b.
        // (cuBLASLt's GELU-backward epilogue with the bias gradient
        // measured 2.4× slower than this product plus the two passes
        // on an H200, so the backward keeps them separate.)
        // The input gradient first (dgelu, in the wide scratch); the GELU
        // backward then recomputes gelu(fch) for the weight gradient, over
        // fch itself (read there for the last time), or into the deferred
        // layer's buffer when its weight gradients come later.
        input_grad(
            blas,
            s,
            n,
            4 * c,
            c,
            Mat::of(&self.dresid_bf, c),
            Mat::of(&w(&r.fcproj_w), c),
            Mat::of(&self.wide, 4 * c),
        )?;
        prof.mark(s, "bwd gemm fcproj")?;
        // (fcproj's bias gradient came with the LayerNorm backward above.)
        let fch = match self.layers[l].acts.as_mut() {
            Some(acts) => &mut acts.fch,
            None => &mut self.work.as_mut().ok_or_else(no_acts)?.fch,
        };
        let mut dbias = g.view_mut(r.fc_b.clone())?;
        match self.deferred.get_mut(l) {
            Some(d) => mk.gelu_backward_bias(
                s,
                &mut self.wide,
                &*fch,
                &mut dbias,
                &mut self.partial,
                Some(&mut d.gelu),
                n,
                4 * c,
            )?,
            None => mk.gelu_backward_bias_over_pre(
                s,
                &mut self.wide,
                fch,
                &mut dbias,
                &mut self.partial,
                n,
                4 * c,
            )?,
        }
        prof.mark(s, "bwd gelu+bias")?;
        let a = &self.layers[l];
        let acts = a.acts.as_ref().or(self.work.as_ref()).ok_or_else(no_acts)?;
        if defer {
            std::mem::swap(&mut self.dresid_bf, &mut self.deferred[l].fcproj);
        } else {
            weight_grad(
                blas,
                s,
                n,
                4 * c,
                c,
                // The GELU, over fch.
                Mat::of(&acts.fch, 4 * c),
                Mat::of(&self.dresid_bf, c),
                Mat::of(&g.view_mut(r.fcproj_w.clone())?, c),
                self.fresh.beta(),
            )?;
            prof.mark(s, "bwd gemm fcproj")?;
        }
        // fc: the input gradient, then the LayerNorm backward (which
        // recomputes ln2, the product's input), then the weight gradient.
        input_grad(
            blas,
            s,
            n,
            c,
            4 * c,
            Mat::of(&self.wide, 4 * c),
            Mat::of(&w(&r.fc_w), 4 * c),
            Mat::of(&self.dln, c),
        )?;
        prof.mark(s, "bwd gemm fc")?;
        let ln2: &mut DeviceBuffer<bf16> = if defer {
            &mut self.deferred[l].ln2
        } else {
            &mut self.ln
        };
        {
            // ... and proj's bias gradient comes with this one.
            let [mut gw, mut gb, mut gnext] =
                g.views_mut_n([r.ln2_w.clone(), r.ln2_b.clone(), r.proj_b.clone()])?;
            mk.layernorm_backward(
                s,
                &mut self.dresid,
                &mut self.dresid_bf,
                Some(ln2),
                &mut gw,
                &mut gb,
                Some(&mut gnext),
                &mut self.partial,
                &self.dln,
                &acts.resid2,
                &p.view(r.ln2_w.clone())?,
                &p.view(r.ln2_b.clone())?,
                &a.ln2_mean,
                &a.ln2_rstd,
                n,
                c,
            )?;
            prof.mark(s, "bwd layernorm")?;
        }
        if defer {
            std::mem::swap(&mut self.wide, &mut self.deferred[l].fc);
        } else {
            weight_grad(
                blas,
                s,
                n,
                c,
                4 * c,
                Mat::of(&self.ln, c),
                Mat::of(&self.wide, 4 * c),
                Mat::of(&g.view_mut(r.fc_w.clone())?, 4 * c),
                self.fresh.beta(),
            )?;
            prof.mark(s, "bwd gemm fc")?;
        }
        // Attention: resid2 = x + atty · Wproj + b.
        input_grad(
            blas,
            s,
            n,
            c,
            c,
            Mat::of(&self.dresid_bf, c),
            Mat::of(&w(&r.proj_w), c),
            Mat::of(&self.wide.view(Wide::datty(n, c)), c),
        )?;
        if defer {
            std::mem::swap(&mut self.dresid_bf, &mut self.deferred[l].proj);
        } else {
            weight_grad(
                blas,
                s,
                n,
                c,
                c,
                Mat::of(&a.atty, c),
                Mat::of(&self.dresid_bf, c),
                Mat::of(&g.view_mut(r.proj_w.clone())?, c),
                self.fresh.beta(),
            )?;
        }
        prof.mark(s, "bwd gemm proj")?;
        // dqkv goes beside datty in the wide scratch, or into the deferred
        // layer's buffer (kept for its weight gradient).
        let (deferred_qkv, deferred_ln1) = match self.deferred.get_mut(l) {
            Some(d) => (Some(&mut d.qkv), Some(&mut d.ln1)),
            None => (None, None),
        };
        let [wide_qkv, datty] = self.wide.views_mut_n([Wide::qkv(n, c), Wide::datty(n, c)]);
        let mut dqkv = match deferred_qkv {
            Some(q) => q.view_mut(Wide::qkv(n, c)),
            None => wide_qkv,
        };
        let LayerSaved {
            atty,
            attn: kept_attn,
            acts: own_acts,
            ..
        } = &mut self.layers[l];
        let BlockActs {
            attn: block_attn,
            resid2,
            fch,
        } = match own_acts {
            Some(acts) => acts,
            None => self.work.as_mut().ok_or_else(no_acts)?,
        };
        // The score gradients, where the model stores them in the block's
        // resid2 and fch: both were read for the last time above.
        let idle = self.score_grads_in_block.then(|| ScoreGrads {
            first: fch.bytes_as_mut(),
            rest: resid2.bytes_as_mut(),
        });
        attention::backward(
            mk,
            blas,
            s,
            &mut dqkv,
            &datty,
            &*atty,
            kept_attn
                .as_ref()
                .or(block_attn.as_ref())
                .ok_or_else(no_acts)?,
            &mut self.attn,
            idle,
            shape,
            prof,
        )?;
        prof.mark(s, "bwd attention")?;
        let a = &self.layers[l];
        // qkv: the input gradient and the bias gradient, then the
        // LayerNorm backward (recomputing ln1), then the weight gradient.
        input_grad(
            blas,
            s,
            n,
            c,
            3 * c,
            Mat::of(&dqkv, 3 * c),
            Mat::of(&w(&r.qkv_w), 3 * c),
            Mat::of(&self.dln, c),
        )?;
        prof.mark(s, "bwd gemm qkv")?;
        mk.bias_backward_bf(
            s,
            &mut g.view_mut(r.qkv_b.clone())?,
            &mut self.partial,
            &dqkv,
            n,
            3 * c,
        )?;
        prof.mark(s, "bwd bias")?;
        // The layer below's fcproj bias gradient comes with this one.
        let below = if l > 0 {
            self.ranges[l - 1].fcproj_b.clone()
        } else {
            0..0
        };
        let ln1: &mut DeviceBuffer<bf16> = match deferred_ln1 {
            Some(ln1) => ln1,
            None => &mut self.ln,
        };
        {
            let [mut gw, mut gb, mut gnext] =
                g.views_mut_n([r.ln1_w.clone(), r.ln1_b.clone(), below])?;
            mk.layernorm_backward(
                s,
                &mut self.dresid,
                &mut self.dresid_bf,
                Some(ln1),
                &mut gw,
                &mut gb,
                if l > 0 { Some(&mut gnext) } else { None },
                &mut self.partial,
                &self.dln,
                &self.resid[l],
                &p.view(r.ln1_w.clone())?,
                &p.view(r.ln1_b.clone())?,
                &a.ln1_mean,
                &a.ln1_rstd,
                n,
                c,
            )?;
            prof.mark(s, "bwd layernorm")?;
        }
        if defer {
            Ok(())
        } else {
            weight_grad(
                blas,
                s,
                n,
                c,
                3 * c,
                Mat::of(&self.ln, c),
                Mat::of(&dqkv, 3 * c),
                Mat::of(&g.view_mut(r.qkv_w.clone())?, 3 * c),
                self.fresh.beta(),
            )?;
            prof.mark(s, "bwd gemm qkv")
        }
    }

    /// The deferred weight gradients of layer `l` (one of the first
    /// [`deferred_layers`](Self::deferred_layers), after its
    /// [`backward_layer`](Self::backward_layer)); the layer's gradients
    /// are final after this. Queued; nothing waits.
    pub fn backward_layer_weights(
        &mut self,
        l: usize,
        g: &mut DeviceWindow<'_, f32>,
    ) -> Result<()> {
        self.backward_layer_weights_of(l, WeightGrads::ALL, g)
    }

    /// Some of the deferred weight gradients of layer `l` (`which`, in
    /// order); the layer's gradients are final once all four have run.
    pub fn backward_layer_weights_of(
        &mut self,
        l: usize,
        which: &[WeightGrads],
        g: &mut DeviceWindow<'_, f32>,
    ) -> Result<()> {
        let Some(d) = self.deferred.get(l) else {
            return Err(CudaError::Invalid(format!(
                "layer {l} does not defer its weight gradients ({} layers do)",
                self.deferred.len()
            )));
        };
        let c = self.layout.config.n_embd;
        let n = self.b * self.t;
        let (s, blas) = (&self.stream, &mut self.blas);
        let (r, a) = (&self.ranges[l], &self.layers[l]);
        for w in which {
            let (x, dy, range, inp, out) = match w {
                WeightGrads::FcProj => (&d.gelu, &d.fcproj, r.fcproj_w.clone(), 4 * c, c),
                WeightGrads::Fc => (&d.ln2, &d.fc, r.fc_w.clone(), c, 4 * c),
                WeightGrads::Proj => (&a.atty, &d.proj, r.proj_w.clone(), c, c),
                WeightGrads::Qkv => (&d.ln1, &d.qkv, r.qkv_w.clone(), c, 3 * c),
            };
            let dw = g.view_mut(range)?;
            weight_grad(
                blas,
                s,
                n,
                inp,
                out,
                Mat::of(x, inp),
                Mat::of(dy, out),
                Mat::of(&dw, out),
                self.fresh.beta(),
            )?;
        }
        self.prof.mark(s, "bwd gemm deferred weights")
    }

    /// Backward of the embeddings (last): token and position embedding
    /// gradients, final after this. Queued; nothing waits.
    pub fn backward_embedding(&mut self, g: &mut DeviceWindow<'_, f32>) -> Result<()> {
        let cfg = self.layout.config;
        let (c, t) = (cfg.n_embd, self.t);
        let (wte, wpe) = (self.range("wte.weight"), self.range("wpe.weight"));
        let [mut gte, mut gpe] = g.views_mut_n([wte, wpe])?;
        self.batch.embedding_backward(
            &self.kernels,
            &self.stream,
            &mut gte,
            &mut gpe,
            &self.dresid,
            t,
            c,
        )?;
        self.prof.mark(&self.stream, "bwd encoder")
    }

    /// Ends a profiled step (waits for its timing events; nothing when
    /// profiling is off).
    pub fn end_step(&mut self) -> Result<()> {
        self.prof.end_step()
    }

    /// The phase timings so far (`BRAID_PROFILE=1`), largest first.
    pub fn profile_report(&self) -> Option<String> {
        self.prof.report()
    }

    /// Starts the phase timings afresh (after warm-up steps).
    pub fn profile_reset(&mut self) {
        self.prof.reset();
    }
}
