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
//! the forward pass's arithmetic. This file holds the model's
//! construction (its buffers are in `state`); the passes are in `forward`
//! and `backward`, what holds nothing between steps in `saved`, the first
//! writes of each step's gradients in `fresh`; what the passes share in
//! `products`, `sums`, `weights`, `pass`, `wide` and `errors`.
//!
//! [`DeviceBatch`]: super::batch::DeviceBatch

use super::f32_params::F32Params;
use super::flash::FlashKernels;
use super::kernels::{Kernels, VocabRows};
use super::mixed::MixedKernels;
use super::mixed_attention::{AttnPath, AttnShared};
use super::profile::PhaseTimer;
use crate::block::LayerRanges;
use crate::cpu::attention::AttnShape;
use crate::layout::{Block, Layout};
use crate::model::Widths;
use crate::tensor_comm::DeviceTensorComm;
use braid_cuda::blas::Blas;
use braid_cuda::blaslt::{BlasLt, Tuning};
use braid_cuda::{CudaError, Device, DeviceBuffer, DevicePool, Result, Stream};
use half::bf16;
use std::ops::Range;
use std::sync::Arc;

mod backward;
mod block;
mod block_backward;
mod errors;
mod forward;
mod fp8_products;
mod fp8_sites;
mod fresh;
mod pass;
mod products;
mod row_sum;
mod saved;
mod seq;
mod stage;
mod state;
mod sums;
mod weights;
mod wide;

pub use backward::WeightGrads;
pub use fp8_products::Fp8Use;
pub use fresh::first_writes;
pub use saved::SavedFor;
use stage::MicroPlan;
pub use stage::MicroSaved;
pub use state::GpuGptMixed;
use state::{BlockActs, DeferredDy, FusedProducts, Group, StreamedWeights};

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
    /// Under checkpointing with the fused attention, how many layers (the
    /// last ones, [`crate::footprint::keeps_attention`]; 0 none,
    /// `usize::MAX` all) keep the attention's saved state (the biased qkv
    /// and the log-sum-exp, 6 bytes per token and width more than the
    /// log-sum-exp alone), so that their backward pass recomputes only
    /// from the attention's output on: two products of four instead of
    /// three, same bits. A memory budget between none and all keeps it in
    /// as many layers as fit.
    pub kept_attention: usize,
    /// Under checkpointing where no layer keeps the attention
    /// ([`kept_attention`](Self::kept_attention) 0),
    /// no layer keeps its attention output or log-sum-exp either: the
    /// recomputation runs the attention again (one attention forward per
    /// layer more, 2 bytes per token and width of every layer less; what a
    /// pipeline stage keeps for each micro-batch in flight). Layers whose
    /// weight gradients are deferred keep theirs.
    pub recompute_attention_output: bool,
    /// A tensor-parallel rank's share ([`GpuGptMixed::tensor_parallel`])
    /// with sequence parallelism: the residual stream, the LayerNorms and
    /// their gradients over the rank's slice of the rows, gathered before
    /// the products that read every row and reduce-scattered after them
    /// (see `seq`). The row-split products are then summed in bf16.
    pub sequence_parallel: bool,
}

/// Fused-epilogue products, unless `BRAID_FUSED_EPILOGUES=0` or cuBLASLt
/// is missing (then the model adds biases and GELU in separate passes);
/// their algorithms timed on first use unless `BRAID_GEMM_TUNE=off` (see
/// [`Tuning`]).
fn fused_products(device: &Device) -> Result<Option<FusedProducts>> {
    let tuning = Tuning::from_env()?;
    if std::env::var(braid_core::env::BRAID_FUSED_EPILOGUES).is_ok_and(|v| v == "0") {
        return Ok(None);
    }
    Ok(BlasLt::new(device).ok().map(|mut lt| {
        lt.set_tuning(tuning);
        FusedProducts {
            lt,
            off: [false; 4],
            fp8: None,
        }
    }))
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
        let w = Widths::of(&layout);
        // This rank's widths (the whole model's in one process).
        let (c, v, nh) = (cfg.n_embd, w.vocab, w.heads);
        let (a, f) = (w.attn, w.mlp);
        if c % cfg.n_head != 0 {
            return Err(CudaError::Invalid(format!(
                "width {c} is not a multiple of the {} heads",
                cfg.n_head
            )));
        }
        let n = b * t;
        let vp = v.div_ceil(64) * 64;
        let shape = AttnShape { b, t, c: a, nh };
        let shard = layout.shard;
        let seq_rows = match (options.sequence_parallel, shard.size) {
            (false, _) => None,
            (true, 1) => {
                return Err(CudaError::Invalid(
                    "sequence parallelism asked of a model that is no tensor-parallel share".into(),
                ))
            }
            (true, size) => Some(seq::SeqRows::rows(n, shard.rank, size, (b, t))?),
        };
        // The rows of the residual stream and the LayerNorms' buffers.
        let rows = seq_rows.as_ref().map_or(n, |r| r.len());
        let mk = MixedKernels::load(device)?;
        let path = AttnPath::choose(&mk, shape)?;
        // The device's own stream: collectives order themselves after it.
        let stream = device.main_stream();
        let pool = DevicePool::new(device);
        let (s, p) = (&stream, &pool);
        let fused = path == AttnPath::Fused;
        let kept_attention = match checkpointing && fused {
            true => options.kept_attention.min(cfg.n_layer),
            false => 0,
        };
        let plan = MicroPlan {
            checkpointing,
            kept_attention,
            shared_atty: checkpointing && kept_attention == 0 && options.recompute_attention_output,
            fused,
            shape,
            path,
            c,
            f,
            vp,
            rows,
        };
        // What the forward pass keeps, for the layers the layout holds.
        let held = |l: usize| layout.holds(Block::Layer(l));
        let head = layout.holds(Block::FinalNorm);
        let saved = plan.make(device, p, s, &layout, &held, head, false)?;
        let work = match checkpointing {
            true => Some(BlockActs::new(
                p,
                s,
                shape,
                path,
                kept_attention < cfg.n_layer,
                plan.shared_atty,
                (c, f),
                rows,
            )?),
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
        // (Sized for the whole model's block; a tensor-parallel rank keeps
        // its score gradients apart.)
        let score_grads_in_block = fused
            && options.stored_score_grads
            && layout.shard.size == 1
            && score_grads_fit_in_block(shape);
        let stored_own = options.stored_score_grads && !score_grads_in_block;
        let partial_len = MixedKernels::partial_len(n, f.max(3 * a), 1)
            .max(MixedKernels::partial_len(n, c, 3))
            .max(MixedKernels::gelu_partial_len(n, f));
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
                .map(|i| held(i).then(|| LayerRanges::of(&layout, i)))
                .collect(),
            layers: saved.layers,
            work,
            streamed,
            resid: saved.resid,
            lnf: saved.lnf,
            lnf_mean: saved.lnf_mean,
            lnf_rstd: saved.lnf_rstd,
            logits: saved.logits,
            pad: if vp == v {
                None
            } else {
                Some((p.zeros(vp * c, s)?, p.zeros(vp * c, s)?))
            },
            losses: saved.losses,
            batch: saved.batch,
            attn: AttnShared::new(p, s, shape, path, stored_own)?,
            ln: p.zeros(n * c, s)?,
            wide: p.zeros(n * (4 * a).max(f), s)?,
            dresid: p.zeros(n * c, s)?,
            dresid_bf: p.zeros(n * c, s)?,
            dln: p.zeros(n * c, s)?,
            partial: p.zeros(partial_len, s)?,
            deferred: Vec::new(),
            backward_sms: std::env::var(braid_core::env::BRAID_BACKWARD_SM_TARGET)
                .ok()
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0),
            prof: PhaseTimer::from_env(device),
            unowned_saved: Vec::new(),
            fresh: fresh::FreshGrads::default(),
            recomputed: None,
            score_grads_in_block,
            bottom: 0,
            plan,
            device: device.clone(),
            loss_weight: 1.0,
            widths: w,
            weights_bf16: None,
            group: None,
            seq: match seq_rows {
                Some(rows) => Some(seq::SeqRows {
                    rows,
                    norm_grads: p.zeros(6 * c, s)?,
                }),
                None => None,
            },
            tensor_blocks: 1,
            tensor_sums_bf16: false,
            grad_sums_beside: false,
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
        let (s, p) = (&self.stream, &self.pool);
        self.deferred.clear();
        for l in 0..layers {
            let d = DeferredDy::new(p, s, self.b * self.t, self.widths)?;
            self.deferred.push(Some(d));
            // Its weight half reads its attention output late: its own.
            if let Some(layer) = self.layers.get_mut(l).and_then(Option::as_mut) {
                if layer.atty.is_none() {
                    layer.atty = Some(p.zeros(self.b * self.t * self.widths.attn, s)?);
                }
            }
        }
        s.synchronize()
    }

    /// How many layers defer their weight gradients.
    pub fn deferred_layers(&self) -> usize {
        self.deferred.iter().flatten().count()
    }

    /// Whether layer `l` defers its weight gradients.
    fn defers(&self, l: usize) -> bool {
        self.deferred.get(l).is_some_and(Option::is_some)
    }

    fn range(&self, name: &str) -> Range<usize> {
        self.layout.get(name).expect("model parameter").range()
    }

    /// Splits each product whose result the tensor group sums (forward,
    /// the attention's output projection and the MLP's second product;
    /// backward, the qkv and MLP-first products' input gradients) into
    /// `blocks` row blocks, each block's sum over the group running beside
    /// the next block's product (1, the default: the whole product, then
    /// its sum). Rows that do not split evenly run in one block. The sums add
    /// the same numbers; NCCL may add them in another order per block.
    pub fn overlap_tensor_sums(&mut self, blocks: usize) {
        self.tensor_blocks = blocks.max(1);
    }

    /// Which products run in FP8 (see `fp8_products`: e4m3 inputs and
    /// weights, e5m2 gradients, each scaled by its own amax): none (the
    /// default), the forward pass's, or the backward pass's too (without
    /// tensor parallelism). Refused without cuBLASLt's fused products or on
    /// a GPU below compute capability 8.9 (no FP8 products).
    pub fn set_fp8(&mut self, use_: Fp8Use) -> Result<()> {
        let Some(fused) = self.lt.as_mut() else {
            return match use_ {
                Fp8Use::Off => Ok(()),
                _ => Err(braid_cuda::CudaError::Invalid(
                    "FP8 products need cuBLASLt's fused products (libcublasLt, and not \
                     BRAID_FUSED_EPILOGUES=0)"
                        .into(),
                )),
            };
        };
        if use_ == Fp8Use::Off {
            fused.fp8 = None;
            return Ok(());
        }
        let (major, minor) = self.device.compute_capability()?;
        if major * 10 + minor < 89 {
            return Err(braid_cuda::CudaError::Invalid(format!(
                "FP8 products need a GPU of compute capability 8.9 or later (Ada, Hopper); \
                 this one is {major}.{minor}: train in bf16"
            )));
        }
        let backward = use_ == Fp8Use::All;
        fused.fp8 = Some(fp8_products::Fp8Products::new(&self.device, backward)?);
        Ok(())
    }

    /// With `on`, the forward pass's row-split products (the attention's
    /// output projection and the MLP's second product) are summed over the
    /// tensor group in bf16, as Megatron sums them — half the bytes of the
    /// f32 sums, the default — and every rank adds the residual and bias
    /// to the sum in f32 after it. The sum is rounded to bf16 once before
    /// it joins the residual stream: not the same bits as the f32 sums.
    pub fn sum_tensor_products_in_bf16(&mut self, on: bool) {
        self.tensor_sums_bf16 = on;
    }

    /// With `on`, the backward pass sums each column-split product's input
    /// gradient (qkv's, the MLP's first) over the tensor group on the
    /// group's stream while the model's stream recomputes the product's
    /// input (the LayerNorm's output, from its kept statistics) and runs
    /// the weight gradient, which needs no sum: Megatron's overlap of the
    /// input gradient's all-reduce with the weight gradient. The
    /// LayerNorm backward then waits for the sum. The same numbers in the
    /// same order: the same bits. Layers whose weight gradients are
    /// deferred, products split in row blocks
    /// ([`overlap_tensor_sums`](Self::overlap_tensor_sums)) and sequence
    /// parallelism keep the plain order (under sequence parallelism the
    /// same overlap — the LayerNorm output's gather beside the input
    /// gradient, the input gradient's reduce-scatter beside the weight
    /// gradient — measured 1.2 ms a step slower on 4 H100s at 2.65B
    /// `--tp 4`: 211.5 against 210.3 ms).
    pub fn sum_input_grads_beside_weight_grads(&mut self, on: bool) {
        self.grad_sums_beside = on;
    }

    /// Makes this model tensor-parallel rank `comm.rank()`'s share: its
    /// layout must be that rank's `Layout::tensor_parallel` layout.
    pub fn tensor_parallel(mut self, comm: Arc<dyn DeviceTensorComm>) -> Result<GpuGptMixed> {
        let shard = self.layout.shard;
        if (comm.rank(), comm.size()) != (shard.rank, shard.size) {
            return Err(CudaError::Invalid(format!(
                "a layout of tensor-parallel rank {} of {} over a group where this is rank {} of {}",
                shard.rank,
                shard.size,
                comm.rank(),
                comm.size()
            )));
        }
        let n = self.b * self.t;
        let (s, p) = (&self.stream, &self.pool);
        let (mx, sums) = (p.zeros(n, s)?, p.zeros(2 * n, s)?);
        self.group = Some(Group { comm, mx, sums });
        Ok(self)
    }

    /// Keeps `weights` as the model's whole bf16 copy of the parameters
    /// (the bf16 values of the layout's first `bf16_len` elements, which
    /// the optimizer refreshes), or none when the model streams its
    /// weights.
    pub fn keep_weights_bf16(&mut self, weights: Option<DeviceBuffer<bf16>>) {
        self.weights_bf16 = weights;
    }

    /// The whole bf16 copy of the parameters, if the model keeps one.
    pub fn weights_bf16(&self) -> Option<&DeviceBuffer<bf16>> {
        self.weights_bf16.as_ref()
    }

    /// The model's stream and its bf16 copy to be written there (by the
    /// optimizer, or a refresh from the f32 parameters).
    pub fn stream_and_weights_bf16(&mut self) -> (&Stream, Option<&mut DeviceBuffer<bf16>>) {
        (&self.stream, self.weights_bf16.as_mut())
    }

    /// Runs `pass` with the bf16 copy taken out of the model for the
    /// call (the inherent passes borrow the model and the copy apart).
    pub(crate) fn with_weights_bf16<R>(
        &mut self,
        pass: impl FnOnce(&mut Self, Option<&DeviceBuffer<bf16>>) -> R,
    ) -> R {
        let weights = self.weights_bf16.take();
        let r = pass(self, weights.as_ref());
        self.weights_bf16 = weights;
        r
    }

    /// Whether the model was built with sequence parallelism
    /// ([`MixedOptions::sequence_parallel`]).
    pub fn sequence_parallel(&self) -> bool {
        self.seq.is_some()
    }

    /// This rank's rows of the vocabulary.
    fn vocab_rows(&self) -> VocabRows {
        VocabRows {
            first: self.widths.vocab_start,
            v: self.widths.vocab,
        }
    }

    /// A share of the model without its group is refused.
    fn check_group(&self) -> Result<()> {
        match (&self.group, self.layout.shard.size) {
            (None, n) if n > 1 => Err(CudaError::Group(format!(
                "this is one of {n} tensor-parallel shares of the model, built without its group"
            ))),
            _ => Ok(()),
        }
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
        let want = self.layout.bf16_len();
        let pb_len = pb.map_or(want, |b| b.len());
        if pb_len != want {
            return Err(CudaError::Invalid(format!(
                "parameters: {pb_len} bf16 elements for a model whose bf16 copy has {want} \
                 (of {})",
                self.layout.len
            )));
        }
        Ok(())
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
