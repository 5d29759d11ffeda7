//! One transformer block's forward pass of the bf16 [`GpuGptMixed`]: the
//! operations of [`crate::block`]'s description as this backend runs them
//! ([`MixedForward`]), the sequence walked by [`crate::block::forward`].
//! Its fused kernels are its operations: the qkv product writes the
//! attention's saved state with its bias where cuBLASLt can add it; the
//! MLP's first product, its bias and the GELU are one cuBLASLt epilogue
//! (the GELU operation then has nothing left to do); a row product adds
//! its bias and the residual around its sum over the tensor group
//! (`row_sum`). Both LayerNorms write the one `ln` scratch, which the
//! product after each reads; under checkpointing the recomputation
//! ([`Pass::Recompute`]) stops before the last product, and starts at the
//! attention's output where the layer kept the attention.
//!
//! [`GpuGptMixed`]: super::state::GpuGptMixed

use super::pass::Pass;
use super::products::{span, Product};
use super::row_sum;
use super::seq;
use super::state::{FusedProducts, Group};
use super::wide::Wide;
use crate::block::LayerRanges;
use crate::block::{Act, BlockForward, Linear, Norm};
use crate::cpu::attention::AttnShape;
use crate::cuda::f32_params::F32Params;
use crate::cuda::mixed::MixedKernels;
use crate::cuda::mixed_attention::{self as attention, AttnSaved, AttnShared};
use crate::cuda::profile::PhaseTimer;
use crate::model::Widths;
use braid_cuda::blas::{Blas, Mat};
use braid_cuda::blaslt::Epilogue;
use braid_cuda::DeviceView;
use braid_cuda::{CudaError, DeviceBuffer, Result, Stream};
use half::bf16;

/// Block `l`'s forward pass (or its recomputation): the pieces of the
/// model it reads and writes, borrowed for the pass.
pub(super) struct MixedForward<'a> {
    pub(super) s: &'a Stream,
    pub(super) mk: &'a MixedKernels,
    pub(super) blas: &'a mut Blas,
    pub(super) lt: &'a mut Option<FusedProducts>,
    pub(super) prof: &'a mut PhaseTimer,
    pub(super) group: &'a Option<Group>,
    pub(super) sp: &'a Option<seq::SeqRows>,
    /// Row blocks of the row products' sums, and whether they run in bf16.
    pub(super) tensor_blocks: usize,
    pub(super) in_bf16: bool,
    /// Whether this rank adds the residual and bias of a row product.
    pub(super) adds_residual: bool,
    pub(super) p: F32Params<'a>,
    /// The layer's bf16 weights and the layout index of their first
    /// element.
    pub(super) wb: &'a DeviceBuffer<bf16>,
    pub(super) base: usize,
    pub(super) r: &'a LayerRanges,
    /// The block's input and output: this rank's rows of the residual
    /// stream.
    pub(super) x: &'a DeviceBuffer<f32>,
    pub(super) out: &'a mut DeviceBuffer<f32>,
    /// The LayerNorms' statistics (`ln_1`'s, `ln_2`'s).
    pub(super) mean: [&'a mut DeviceBuffer<f32>; 2],
    pub(super) rstd: [&'a mut DeviceBuffer<f32>; 2],
    pub(super) atty: &'a mut DeviceBuffer<bf16>,
    pub(super) attn: &'a mut AttnSaved,
    pub(super) kept_lse: Option<&'a mut DeviceBuffer<f32>>,
    pub(super) resid2: &'a mut DeviceBuffer<f32>,
    pub(super) fch: &'a mut DeviceBuffer<bf16>,
    pub(super) ln: &'a mut DeviceBuffer<bf16>,
    pub(super) wide: &'a mut DeviceBuffer<bf16>,
    pub(super) shared: &'a mut AttnShared,
    pub(super) pass: Pass,
    /// The recomputation starts at the attention's output (the layer
    /// kept the attention's state).
    pub(super) from_atty: bool,
    /// The qkv product wrote the attention's saved state with its bias.
    pub(super) into_saved: bool,
    pub(super) shape: AttnShape,
    pub(super) w: Widths,
}

impl<'a> MixedForward<'a> {
    fn n(&self) -> usize {
        self.shape.b * self.shape.t
    }

    /// A product's bf16 weight and bias (of the layer's bf16 copy).
    fn weight(&self, linear: Linear) -> (DeviceView<'a, bf16>, DeviceView<'a, bf16>) {
        let (w, b) = self.r.linear(linear);
        let wb: &'a DeviceBuffer<bf16> = self.wb;
        (
            wb.view(w.start - self.base..w.end - self.base),
            wb.view(b.start - self.base..b.end - self.base),
        )
    }
}

fn unexpected(a: Act) -> CudaError {
    CudaError::Invalid(format!(
        "the bf16 block reads or writes {a:?} where its operation has no buffer for it"
    ))
}

/// The phase timer's name for a product's forward pass.
fn gemm_phase(linear: Linear, pass: Pass) -> &'static str {
    match linear {
        Linear::Qkv => pass.phase("fwd gemm qkv", "recompute gemm qkv"),
        Linear::Proj => pass.phase("fwd gemm proj", "recompute gemm proj"),
        Linear::Fc => pass.phase("fwd gemm fc", "recompute gemm fc"),
        Linear::FcProj => "fwd gemm fcproj",
    }
}

impl BlockForward for MixedForward<'_> {
    type Error = CudaError;

    fn norm_forward(&mut self, norm: Norm, input: Act, _out: Act) -> Result<()> {
        // With the attention kept, the recomputation starts at its output.
        if norm == Norm::Ln1 && self.from_atty {
            return Ok(());
        }
        let (n, c) = (self.n(), self.w.c);
        let (nl, mine) = seq::local(self.sp, n, c);
        let (w, b) = self.r.norm(norm);
        let i = norm.index();
        let x = match input {
            Act::X => self.x,
            Act::Resid2 => &*self.resid2,
            a => return Err(unexpected(a)),
        };
        self.mk.layernorm_forward(
            self.s,
            &mut self.ln.view_mut(mine),
            &mut *self.mean[i],
            &mut *self.rstd[i],
            x,
            &self.p.view(w)?,
            &self.p.view(b)?,
            nl,
            c,
        )?;
        let what = match norm {
            Norm::Ln1 => "ln_1 gather",
            Norm::Ln2 => "ln_2 gather",
        };
        seq::gather(self.group, self.sp, self.ln, n * c, self.s, what)?;
        self.prof.mark(
            self.s,
            self.pass.phase("fwd layernorm", "recompute layernorm"),
        )
    }

    fn column_forward(&mut self, linear: Linear, _input: Act, out: Act) -> Result<()> {
        let (n, c) = (self.n(), self.w.c);
        let (_, oc) = linear.widths(&self.w);
        match out {
            Act::Qkv => {
                if self.from_atty {
                    return Ok(());
                }
                // The fused attention keeps qkv with its bias: one product
                // writes it there when cuBLASLt can add the bias.
                let (w, bias) = self.weight(linear);
                let qkv_product = Product {
                    m: n,
                    n: oc,
                    k: c,
                    a: Mat::of(&*self.ln, c),
                    b: Mat::of(&w, oc),
                };
                self.into_saved = match &mut *self.attn {
                    AttnSaved::Fused { qkv, .. } => qkv_product.fused(
                        self.lt,
                        self.s,
                        None,
                        Mat::of(qkv, oc),
                        Epilogue::Bias { bias: span(&bias) },
                    )?,
                    AttnSaved::Batched { .. } => false,
                };
                if !self.into_saved {
                    let raw = self.wide.view(Wide::qkv(n, self.w.attn));
                    qkv_product.plain(self.blas, self.s, Mat::of(&raw, oc), 0.0)?;
                }
            }
            Act::Fch => {
                // gelu = GELU(ln2 · W + b), the pre-activation kept in fch:
                // the GELU operation's work too.
                let (w, bias) = self.weight(linear);
                let fc = Product {
                    m: n,
                    n: oc,
                    k: c,
                    a: Mat::of(&*self.ln, c),
                    b: Mat::of(&w, oc),
                };
                let (_, b) = self.r.linear(linear);
                let gelu = Epilogue::GeluAuxBias {
                    bias: span(&bias),
                    aux: span(&*self.fch),
                    aux_ld: oc,
                };
                if !fc.fused(self.lt, self.s, None, Mat::of(&*self.wide, oc), gelu)? {
                    fc.plain(self.blas, self.s, Mat::of(&*self.fch, oc), 0.0)?;
                    self.prof.mark(self.s, gemm_phase(linear, self.pass))?;
                    self.mk
                        .bias_gelu(self.s, self.fch, self.wide, &self.p.view(b)?, n, oc)?;
                    return self.prof.mark(
                        self.s,
                        self.pass.phase("fwd bias+gelu", "recompute bias+gelu"),
                    );
                }
            }
            a => return Err(unexpected(a)),
        }
        self.prof.mark(self.s, gemm_phase(linear, self.pass))
    }

    fn attention_forward(&mut self, _input: Act, _out: Act) -> Result<()> {
        if self.from_atty {
            return Ok(());
        }
        let (n, shape) = (self.n(), self.shape);
        let (_, b) = self.r.linear(Linear::Qkv);
        let qkv_b = self.p.view(b)?;
        match (self.pass, self.kept_lse.as_deref_mut()) {
            (Pass::Recompute, Some(kept)) => {
                let raw = self.wide.view(Wide::qkv(n, self.w.attn));
                let unbiased = (!self.into_saved).then_some((&raw, &qkv_b));
                attention::restore(self.mk, self.s, self.attn, unbiased, kept, shape)?;
            }
            _ => {
                if self.into_saved {
                    attention::forward_prebiased(self.mk, self.s, self.atty, self.attn, shape)?;
                } else {
                    let raw = self.wide.view(Wide::qkv(n, self.w.attn));
                    attention::forward(
                        self.mk,
                        self.blas,
                        self.s,
                        self.atty,
                        &raw,
                        &qkv_b,
                        self.attn,
                        self.shared,
                        shape,
                        self.prof,
                    )?;
                }
                if self.pass == Pass::Forward {
                    if let Some(kept) = self.kept_lse.as_deref_mut() {
                        attention::keep_lse(self.s, self.attn, kept)?;
                    }
                }
            }
        }
        self.prof.mark(
            self.s,
            self.pass.phase("fwd attention", "recompute attention"),
        )
    }

    fn gelu_forward(&mut self, _input: Act, _out: Act) -> Result<()> {
        // Done by the MLP's first product (its epilogue, or the bias+GELU
        // kernel after it).
        Ok(())
    }

    fn row_forward(&mut self, linear: Linear, input: Act, residual: Act, out: Act) -> Result<()> {
        // The recomputation ends before the last product: its output is
        // the kept residual stream.
        if out == Act::Out && self.pass == Pass::Recompute {
            return Ok(());
        }
        let n = self.n();
        let (k, oc) = linear.widths(&self.w);
        let (_, b) = self.r.linear(linear);
        let bias = self.p.view(b)?;
        let (w, _) = self.weight(linear);
        let a: &DeviceBuffer<bf16> = match input {
            Act::Atty => &*self.atty,
            Act::Gelu => &*self.wide,
            i => return Err(unexpected(i)),
        };
        let x = self.x;
        let (resid, into): (&DeviceBuffer<f32>, &mut DeviceBuffer<f32>) = match (residual, out) {
            (Act::X, Act::Resid2) => (x, &mut *self.resid2),
            (Act::Resid2, Act::Out) => (&*self.resid2, &mut *self.out),
            (r, _) => return Err(unexpected(r)),
        };
        // out = residual + input · W + b (the residual and bias on the
        // group's first rank), summed over the group.
        let product = row_sum::RowSplit {
            m: n,
            n: oc,
            k,
            a,
            b: Mat::of(&w, oc),
            residual: self.adds_residual.then_some(resid),
            bias: &bias,
        };
        // The LayerNorm's output (read by the column product already) is
        // the scratch of a sum in bf16 (always so under sequence
        // parallelism).
        let what = match linear {
            Linear::Proj => "attn.c_proj forward",
            _ => "mlp.c_proj forward",
        };
        row_sum::row_split_product(
            self.blas,
            self.lt,
            self.mk,
            self.s,
            (self.group, self.sp),
            (self.tensor_blocks, self.in_bf16),
            product,
            self.ln,
            into,
            what,
        )?;
        self.prof.mark(self.s, gemm_phase(linear, self.pass))
    }
}
