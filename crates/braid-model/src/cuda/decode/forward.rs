//! One layer of a decode step on the GPU: the block's operations
//! ([`BlockForward`]) over the f32 kernels and products, the attention
//! through the paged cache. With [`Half`], the products read bf16: the
//! weights' bf16 copy, and a bf16 copy of the tensor each multiplies (the
//! LayerNorms write theirs directly, the attention's pages kernel too;
//! the MLP's first product applies the GELU in its epilogue straight into
//! bf16), accumulating in f32 into the f32 block tensors with the bias
//! (and for the projections the residual) in cuBLASLt's epilogue;
//! LayerNorm statistics and the residual stream stay f32, the cache is
//! f32 or bf16.

use crate::block::{Act, BlockForward, LayerRanges, Linear, Norm, Op, BLOCK};
use crate::cuda::kernels::{Kernels, PagedKv, PagedShape};
use crate::cuda::mixed::{MixedKernels, NtTail, SkinnyScratch, SkinnyTo, SKINNY_ROWS};
use crate::cuda::profile::PhaseTimer;
use crate::model::Widths;
use braid_cuda::blas::{Blas, Mat};
use braid_cuda::blaslt::{BlasLt, Epilogue, LtGemm};
use braid_cuda::{CudaError, DeviceBuffer, DeviceMem, DeviceView, Result, Stream};
use half::bf16;
use std::ops::Range;

/// A LayerNorm done by the product before it ([`Half::ln_tail`]): its
/// scale's and shift's ranges in the flat parameters, and its output.
type TailNorm = (Range<usize>, Range<usize>, Act);

/// The QKV product's target where it writes the step's keys and values
/// into the cache `kv` itself (each row's at its slot), its rows into
/// `out`.
fn into_cache(out: (u64, usize), kv: PagedKv, slots: &DeviceView<'_, i32>) -> SkinnyTo {
    SkinnyTo::QkvIntoCache {
        out,
        kv,
        slots: (slots.dptr(), slots.dlen()),
    }
}

/// The block's tensors but the one being written, around a hole.
struct Others<'b> {
    lo: &'b [DeviceBuffer<f32>],
    hi: &'b [DeviceBuffer<f32>],
    hole: usize,
}

impl<'b> Others<'b> {
    fn get(&self, a: Act) -> Result<&'b DeviceBuffer<f32>> {
        let i = a.index();
        match i.cmp(&self.hole) {
            std::cmp::Ordering::Less => Ok(&self.lo[i]),
            std::cmp::Ordering::Greater => Ok(&self.hi[i - self.hole - 1]),
            std::cmp::Ordering::Equal => Err(CudaError::Invalid(format!(
                "an operation of the block reads {a:?}, which it writes"
            ))),
        }
    }
}

/// The buffer of `o` to write and the others to read.
fn split(t: &mut [DeviceBuffer<f32>; 9], o: Act) -> (&mut DeviceBuffer<f32>, Others<'_>) {
    let (lo, rest) = t.split_at_mut(o.index());
    let (mid, hi) = rest.split_first_mut().expect("the hole is in the array");
    let hole = o.index();
    (mid, Others { lo, hi, hole })
}

/// One layer of a decode step on the GPU: the block's tensors for the
/// step's `n` rows in `t`, the layer's pages in `kv`, the step's indices
/// on the device.
pub(super) struct GpuDecodeForward<'a> {
    pub(super) k: &'a Kernels,
    pub(super) blas: &'a mut Blas,
    pub(super) s: &'a Stream,
    /// The flat parameters, addressed by `r`'s ranges.
    pub(super) p: &'a DeviceBuffer<f32>,
    pub(super) r: &'a LayerRanges,
    pub(super) w: Widths,
    pub(super) n: usize,
    pub(super) t: &'a mut [DeviceBuffer<f32>; 9],
    pub(super) mean: &'a mut DeviceBuffer<f32>,
    pub(super) rstd: &'a mut DeviceBuffer<f32>,
    pub(super) kv: PagedKv,
    pub(super) block_size: usize,
    pub(super) pos: DeviceView<'a, i32>,
    pub(super) slots: DeviceView<'a, i32>,
    pub(super) tab_off: DeviceView<'a, i32>,
    pub(super) tabs: DeviceView<'a, i32>,
    pub(super) prof: &'a mut PhaseTimer,
    /// The bf16 products' parts, when the decoder runs them.
    pub(super) half: Option<Half<'a>>,
    /// A LayerNorm put off to the product that reads it ([`Half::ln_into_nt`]):
    /// (which, its input, its output).
    pub(super) deferred: Option<(Norm, Act, Act)>,
    /// Whether the QKV product wrote this step's keys and values into the
    /// cache ([`Half::qkv_into_cache`]), so the attention need not.
    pub(super) kv_written: bool,
    /// The layer's MLP half gathered so far for one kernel
    /// ([`Half::mlp_barrier`]): its operations in block order, run as
    /// they came where the rest does not follow or the kernel does not
    /// apply.
    pub(super) mlp: Vec<Op>,
    /// A row product of a few rows on the NT kernel, put off to the
    /// operation after it: where that is the LayerNorm of its output, the
    /// product's own grid does it ([`Half::ln_tail`]).
    pub(super) deferred_row: Option<Op>,
    /// The next layer's first LayerNorm (its scale's and shift's ranges),
    /// for this layer's last product to do; `None` in the last layer.
    pub(super) next_norm: Option<(Range<usize>, Range<usize>)>,
    /// A LayerNorm output the layer before wrote already (by its last
    /// product's grid): the LayerNorm into it does not run again.
    pub(super) norm_ready: Option<Act>,
}

/// What bf16 products need: cuBLASLt, the mixed kernels (LayerNorm into
/// bf16, the cast), the flat parameters in bf16 (addressed by the same
/// ranges) and the bf16 copies of the block tensors (by [`Act::index`]).
pub(super) struct Half<'a> {
    pub(super) lt: &'a mut BlasLt,
    pub(super) mk: &'a MixedKernels,
    pub(super) wb: &'a DeviceBuffer<bf16>,
    pub(super) tb: &'a mut [DeviceBuffer<bf16>],
    /// Whether the MLP's first product applies its GELU in cuBLASLt's
    /// epilogue, straight into the bf16 input of the next (cleared, for
    /// the decoder's life, the first time cuBLASLt has no such product).
    pub(super) gelu_fused: &'a mut bool,
    /// Products of a few rows on the skinny kernel, with its scratch.
    pub(super) skinny: Option<&'a mut SkinnyScratch>,
    /// The layers' weights in `wb` stored `[out, in]`: products of a few
    /// rows on the NT kernel, more by cuBLASLt reading them transposed.
    pub(super) nt: bool,
    /// With `nt`, a LayerNorm read by an NT product normalised inside it
    /// (no kernel of its own; `BRAID_DECODE_FUSED_LN=1`, off by default).
    pub(super) ln_into_nt: bool,
    /// With `nt`, the QKV product on the NT kernel writes the step's keys
    /// and values into the cache in its epilogue (no cache-write kernel;
    /// on unless `BRAID_DECODE_QKV_CACHE=0`).
    pub(super) qkv_into_cache: bool,
    /// With `nt`, a layer's MLP half of a few rows in one kernel, with its
    /// grid barrier's counters (`BRAID_DECODE_MLP_KERNEL=1`, off by
    /// default).
    pub(super) mlp_barrier: Option<&'a DeviceBuffer<i32>>,
    /// With `nt`, the LayerNorm after a row product of a few rows done by
    /// the product's grid, with its counter (`BRAID_DECODE_LN_TAIL=1`, off
    /// by default).
    pub(super) ln_tail: Option<&'a DeviceBuffer<i32>>,
}

impl Half<'_> {
    /// A layer's weights `b` (`ic` in, `oc` out) as cuBLASLt's right-hand
    /// side: `[ic, oc]` row-major, or its transpose where they are stored
    /// `[oc, ic]` ([`Half::nt`]).
    fn weights(&self, b: &impl DeviceMem<bf16>, ic: usize, oc: usize) -> Mat {
        match self.nt {
            true => Mat::of(b, ic).t(),
            false => Mat::of(b, oc),
        }
    }

    /// The bf16 copy a product reads of `act`, cast from its f32 `x`
    /// (`len` elements).
    fn keep(&mut self, s: &Stream, act: Act, x: &DeviceBuffer<f32>, len: usize) -> Result<()> {
        self.mk.to_bf16(
            s,
            &mut self.tb[act.index()].view_mut(0..len),
            &x.view(0..len),
        )
    }

    /// `d[n, oc] = tb[input] · wb[w] + bias (+ residual)`, f32 out: by
    /// cuBLASLt (or, when turned on, the skinny kernel for a few rows).
    /// Where `tail` is given and the NT kernel runs the product, its grid
    /// then writes the LayerNorm of `d` too ([`NtTail`]); returns whether
    /// it did.
    #[allow(clippy::too_many_arguments)]
    fn product(
        &mut self,
        s: &Stream,
        d: &mut impl DeviceMem<f32>,
        input: Act,
        w: std::ops::Range<usize>,
        bias: &impl DeviceMem<f32>,
        residual: Option<&DeviceView<'_, f32>>,
        (n, ic, oc): (usize, usize, usize),
        tail: Option<NtTail>,
    ) -> Result<bool> {
        let a = self.tb[input.index()].view(0..n * ic);
        let b = self.wb.view(w);
        let to = SkinnyTo::F32 {
            out: (d.dptr(), d.dlen()),
            res: residual.map(|r| (r.dptr(), r.dlen())),
        };
        if self.nt
            && self
                .mk
                .nt_product_then(s, to, &a, &b, Some(bias), (n, oc, ic), tail)?
        {
            return Ok(tail.is_some());
        }
        if let Some(scratch) = self.skinny.as_deref_mut() {
            if self
                .mk
                .skinny_product(s, scratch, to, &a, &b, bias, (n, oc, ic))?
            {
                return Ok(false);
            }
        }
        let dm = Mat::of(d, oc);
        let (c, beta) = match residual {
            Some(r) => (Mat::of(r, oc), 1.0),
            None => (dm, 0.0),
        };
        self.lt.gemm(
            s,
            &LtGemm {
                m: n,
                n: oc,
                k: ic,
                a: Mat::of(&a, ic),
                b: self.weights(&b, ic, oc),
                c,
                d: dm,
                epilogue: Epilogue::Bias {
                    bias: (bias.dptr(), oc),
                },
                alpha: 1.0,
                beta,
            },
        )?;
        Ok(false)
    }

    /// `tb[Gelu] = gelu(tb[input] · wb[w] + wb[bias])` in bf16, the
    /// pre-activation into `tb[Fch]`; false (and the fused form off from
    /// then on, with a note) if cuBLASLt has no such product here.
    fn gelu_product(
        &mut self,
        s: &Stream,
        input: Act,
        (w, bias): (std::ops::Range<usize>, std::ops::Range<usize>),
        bias32: &impl DeviceMem<f32>,
        (n, ic, oc): (usize, usize, usize),
    ) -> Result<bool> {
        let a = self.tb[input.index()].view(0..n * ic);
        let b = self.wb.view(w);
        let d = self.tb[Act::Gelu.index()].view(0..n * oc);
        let to = SkinnyTo::GeluBf16 {
            out: (d.dptr(), d.dlen()),
        };
        // (The skinny and NT kernels write no pre-activation: nothing
        // reads it.)
        if self.nt
            && self
                .mk
                .nt_product(s, to, &a, &b, Some(bias32), (n, oc, ic))?
        {
            return Ok(true);
        }
        if let Some(scratch) = self.skinny.as_deref_mut() {
            if self
                .mk
                .skinny_product(s, scratch, to, &a, &b, bias32, (n, oc, ic))?
            {
                return Ok(true);
            }
        }
        let bias = self.wb.view(bias);
        let aux = self.tb[Act::Fch.index()].view(0..n * oc);
        let dm = Mat::of(&d, oc);
        let g = LtGemm {
            m: n,
            n: oc,
            k: ic,
            a: Mat::of(&a, ic),
            b: self.weights(&b, ic, oc),
            c: dm,
            d: dm,
            epilogue: Epilogue::GeluAuxBias {
                bias: (bias.dptr(), oc),
                aux: (aux.dptr(), n * oc),
                aux_ld: oc,
            },
            alpha: 1.0,
            beta: 0.0,
        };
        match self.lt.gemm(s, &g) {
            Ok(()) => Ok(true),
            Err(CudaError::Invalid(e)) => Err(CudaError::Invalid(e)),
            Err(e) => {
                eprintln!(
                    "note: cuBLASLt has no bf16 product with a GELU epilogue here ({e}); \
                     the decoder applies the GELU in a pass of its own"
                );
                *self.gelu_fused = false;
                Ok(false)
            }
        }
    }
}

impl BlockForward for GpuDecodeForward<'_> {
    type Error = CudaError;

    fn norm_forward(&mut self, norm: Norm, input: Act, out: Act) -> Result<()> {
        self.offer_or_run(Op::Norm { norm, input, out })
    }

    fn column_forward(&mut self, linear: Linear, input: Act, out: Act) -> Result<()> {
        self.offer_or_run(Op::Column { linear, input, out })
    }

    fn attention_forward(&mut self, input: Act, out: Act) -> Result<()> {
        self.offer_or_run(Op::Attention { input, out })
    }

    fn gelu_forward(&mut self, input: Act, out: Act) -> Result<()> {
        self.offer_or_run(Op::Gelu { input, out })
    }

    fn row_forward(&mut self, linear: Linear, input: Act, residual: Act, out: Act) -> Result<()> {
        self.offer_or_run(Op::Row {
            linear,
            input,
            residual,
            out,
        })
    }
}

impl GpuDecodeForward<'_> {
    /// Runs `op` now, as the block's order brings it (a LayerNorm read by
    /// an NT product put off to it; a row product put off to the LayerNorm
    /// of its output, which its grid then does).
    pub(super) fn run_op(&mut self, op: Op) -> Result<()> {
        if let Some(row) = self.deferred_row.take() {
            let tail = match (row, op) {
                (
                    Op::Row { out, .. },
                    Op::Norm {
                        norm,
                        input,
                        out: ln,
                    },
                ) if input == out => {
                    let (w, b) = self.r.norm(norm);
                    Some((w, b, ln))
                }
                _ => None,
            };
            if self.run_row(row, tail)? {
                return Ok(());
            }
        }
        match op {
            Op::Norm { out, .. } if self.norm_ready == Some(out) => {
                // Written by the layer before's last product.
                self.norm_ready = None;
                Ok(())
            }
            Op::Norm { norm, input, out } => {
                self.flush_norm()?;
                // Read only by the product next (the block's order): put
                // off to it, which normalises the rows itself where its
                // kernel can (`nt_ln_product` says), else runs it first.
                if self.half.as_ref().is_some_and(|h| h.nt && h.ln_into_nt) {
                    self.deferred = Some((norm, input, out));
                    return Ok(());
                }
                self.run_norm(norm, input, out)
            }
            Op::Column { linear, input, out } => {
                if let Some((norm, ln_in, ln_out)) = self.deferred.take() {
                    if ln_out != input || !self.fused_norm_product(norm, ln_in, linear, out)? {
                        self.run_norm(norm, ln_in, ln_out)?;
                    } else {
                        return Ok(());
                    }
                }
                self.column_product(linear, input, out)
            }
            Op::Attention { input, out } => {
                self.flush_norm()?;
                self.attention(input, out)
            }
            Op::Gelu { input, out } => {
                self.flush_norm()?;
                self.gelu(input, out)
            }
            Op::Row { .. } => {
                self.flush_norm()?;
                if self.tail_after_rows() {
                    self.deferred_row = Some(op);
                    return Ok(());
                }
                self.run_row(op, None).map(|_| ())
            }
        }
    }

    /// Whether row products put off their LayerNorm to their own grid:
    /// NT products of a few rows with the tail's counter, neither the
    /// LayerNorms inside the products nor the one-kernel MLP on.
    fn tail_after_rows(&self) -> bool {
        self.n <= SKINNY_ROWS
            && self.mlp.is_empty()
            && self.half.as_ref().is_some_and(|h| {
                h.nt && h.ln_tail.is_some() && !h.ln_into_nt && h.mlp_barrier.is_none()
            })
    }

    /// Runs a put-off row product as the layer's last operation: with the
    /// next layer's first LayerNorm by its grid where there is a next layer
    /// (this layer's output becomes the next one's input, `BLOCK[0]`'s, when
    /// the decoder swaps them); whether it did.
    pub(super) fn flush_row(&mut self) -> Result<bool> {
        let Some(row) = self.deferred_row.take() else {
            return Ok(false);
        };
        let tail = match (row, BLOCK[0], self.next_norm.clone()) {
            (
                Op::Row { out: Act::Out, .. },
                Op::Norm {
                    input: Act::X, out, ..
                },
                Some((w, b)),
            ) => Some((w, b, out)),
            _ => None,
        };
        self.run_row(row, tail)
    }

    /// Runs the row product `row`, and where `tail` is given and the NT
    /// kernel runs it, the LayerNorm of its output into `tail`'s bf16
    /// output by its grid; whether it did.
    fn run_row(&mut self, row: Op, tail: Option<TailNorm>) -> Result<bool> {
        let Op::Row {
            linear,
            input,
            residual,
            out,
        } = row
        else {
            return Err(CudaError::Invalid(format!(
                "decode: {row:?} put off as a row product"
            )));
        };
        self.row_product(linear, input, residual, out, tail)
    }

    /// Runs a put-off LayerNorm, if any, as its own kernel.
    pub(super) fn flush_norm(&mut self) -> Result<()> {
        match self.deferred.take() {
            Some((norm, input, out)) => self.run_norm(norm, input, out),
            None => Ok(()),
        }
    }

    /// `out = linear(LayerNorm(ln_in))` by the NT kernel normalising the
    /// rows itself: the QKV product (f32 out) and the MLP's first (GELU
    /// into bf16, where the decoder fuses it); false, launching nothing,
    /// where it does not apply.
    fn fused_norm_product(
        &mut self,
        norm: Norm,
        ln_in: Act,
        linear: Linear,
        out: Act,
    ) -> Result<bool> {
        let Some(h) = &mut self.half else {
            return Ok(false);
        };
        let (w, b) = self.r.linear(linear);
        let (ic, oc) = linear.widths(&self.w);
        let n = self.n;
        let (lw, lb) = self.r.norm(norm);
        let (lw, lb) = (self.p.view(lw), self.p.view(lb));
        let bias = self.p.view(b);
        let wt = h.wb.view(w);
        let (to, what) = match linear {
            Linear::Fc if *h.gelu_fused => {
                let d = &h.tb[Act::Gelu.index()];
                (
                    SkinnyTo::GeluBf16 {
                        out: (d.dptr(), d.dlen()),
                    },
                    "ln + gemm + bias + gelu",
                )
            }
            Linear::Qkv => {
                let d = self.t[out.index()].view(0..n * oc);
                let out = (d.dptr(), d.dlen());
                match h.qkv_into_cache {
                    true => (
                        into_cache(out, self.kv, &self.slots),
                        "ln + gemm + bias + kv write",
                    ),
                    false => (SkinnyTo::F32 { out, res: None }, "ln + gemm + bias"),
                }
            }
            _ => return Ok(false),
        };
        let x = self.t[ln_in.index()].view(0..n * ic);
        let bias: Option<&dyn DeviceMem<f32>> = Some(&bias);
        let ran =
            h.mk.nt_ln_product(self.s, to, &x, (&lw, &lb), &wt, bias, (n, oc, ic))?;
        if ran {
            self.kv_written = matches!(to, SkinnyTo::QkvIntoCache { .. });
            self.prof.mark(self.s, what)?;
        }
        Ok(ran)
    }

    /// The LayerNorm `norm` of `input` into `out` (bf16 alone with bf16
    /// products: only a product reads it).
    fn run_norm(&mut self, norm: Norm, input: Act, out: Act) -> Result<()> {
        let (w, b) = self.r.norm(norm);
        let (n, c) = (self.n, self.w.c);
        let (o, t) = split(self.t, out);
        if let Some(h) = &mut self.half {
            // Read only by a product: bf16 alone.
            h.mk.layernorm_forward(
                self.s,
                &mut h.tb[out.index()].view_mut(0..n * c),
                &mut self.mean.view_mut(0..n),
                &mut self.rstd.view_mut(0..n),
                &t.get(input)?.view(0..n * c),
                &self.p.view(w),
                &self.p.view(b),
                n,
                c,
            )?;
            return self.prof.mark(self.s, "layernorm");
        }
        self.k.layernorm_forward(
            self.s,
            &mut o.view_mut(0..n * c),
            &mut self.mean.view_mut(0..n),
            &mut self.rstd.view_mut(0..n),
            &t.get(input)?.view(0..n * c),
            &self.p.view(w),
            &self.p.view(b),
            n,
            c,
        )?;
        self.prof.mark(self.s, "layernorm")
    }

    /// `out = linear(input)` (with its GELU where the decoder fuses it).
    fn column_product(&mut self, linear: Linear, input: Act, out: Act) -> Result<()> {
        let (w, b) = self.r.linear(linear);
        let (ic, oc) = linear.widths(&self.w);
        let n = self.n;
        if let Some(h) = &mut self.half {
            if linear == Linear::Fc
                && *h.gelu_fused
                && h.gelu_product(
                    self.s,
                    input,
                    (w.clone(), b.clone()),
                    &self.p.view(b.clone()),
                    (n, ic, oc),
                )?
            {
                return self.prof.mark(self.s, "gemm + bias + gelu");
            }
        }
        let (o, t) = split(self.t, out);
        let mut o = o.view_mut(0..n * oc);
        if let Some(h) = &mut self.half {
            if linear == Linear::Qkv && h.nt && h.qkv_into_cache {
                let to = into_cache((o.dptr(), o.dlen()), self.kv, &self.slots);
                let (a, wt) = (h.tb[input.index()].view(0..n * ic), h.wb.view(w.clone()));
                let bias = self.p.view(b.clone());
                let bias: Option<&dyn DeviceMem<f32>> = Some(&bias);
                if h.mk.nt_product(self.s, to, &a, &wt, bias, (n, oc, ic))? {
                    self.kv_written = true;
                    return self.prof.mark(self.s, "gemm + bias + kv write");
                }
            }
            h.product(
                self.s,
                &mut o,
                input,
                w,
                &self.p.view(b),
                None,
                (n, ic, oc),
                None,
            )?;
            return self.prof.mark(self.s, "gemm + bias");
        }
        self.blas.gemm_rm(
            self.s,
            &mut o,
            &t.get(input)?.view(0..n * ic),
            false,
            &self.p.view(w),
            false,
            n,
            oc,
            ic,
            false,
        )?;
        self.k.add_bias(self.s, &mut o, &self.p.view(b), n, oc)?;
        self.prof.mark(self.s, "gemm + bias")
    }

    /// The attention over the paged cache, the step's keys and values
    /// written first.
    fn attention(&mut self, input: Act, out: Act) -> Result<()> {
        let (c, nh) = (self.w.attn, self.w.heads);
        let n = self.n;
        let (o, t) = split(self.t, out);
        let qkv = t.get(input)?.view(0..n * 3 * c);
        // Every row's key and value into its page first (unless the QKV
        // product wrote them): a prompt's rows attend to one another.
        if !std::mem::take(&mut self.kv_written) {
            self.k.kv_write(self.s, self.kv, &qkv, &self.slots, n, c)?;
            self.prof.mark(self.s, "kv write")?;
        }
        // With bf16 products the kernel narrows its output into the
        // product's bf16 input too where it can.
        let outb = self.half.as_ref().map(|h| {
            let b = &h.tb[out.index()];
            (b.dptr(), b.dlen())
        });
        let narrowed = self.k.paged_attention_decode(
            self.s,
            &mut o.view_mut(0..n * c),
            outb,
            &qkv,
            self.kv,
            &self.pos,
            &self.tab_off,
            &self.tabs,
            PagedShape {
                rows: n,
                heads: nh,
                head_size: c / nh,
                block_size: self.block_size,
            },
        )?;
        if let Some(h) = &mut self.half {
            if !narrowed {
                h.keep(self.s, out, o, n * c)?;
            }
        }
        self.prof.mark(self.s, "paged attention")
    }

    /// `out = gelu(input)`, unless the MLP's first product applied it.
    fn gelu(&mut self, input: Act, out: Act) -> Result<()> {
        if self.half.as_ref().is_some_and(|h| *h.gelu_fused) {
            // Applied in the MLP's first product, into its bf16 output.
            return Ok(());
        }
        let n = self.n;
        let width = out.width(&self.w);
        let (o, t) = split(self.t, out);
        self.k.gelu_forward(
            self.s,
            &mut o.view_mut(0..n * width),
            &t.get(input)?.view(0..n * width),
        )?;
        if let Some(h) = &mut self.half {
            h.keep(self.s, out, o, n * width)?;
        }
        self.prof.mark(self.s, "gelu")
    }

    /// `out = linear(input) + residual`.
    fn row_product(
        &mut self,
        linear: Linear,
        input: Act,
        residual: Act,
        out: Act,
        tail: Option<TailNorm>,
    ) -> Result<bool> {
        if let Some(h) = &mut self.half {
            // The residual added in the product's epilogue.
            let (w, b) = self.r.linear(linear);
            let (ic, oc) = linear.widths(&self.w);
            let n = self.n;
            let (o, t) = split(self.t, out);
            let r = t.get(residual)?.view(0..n * oc);
            let tail = match (tail, h.ln_tail) {
                (Some((lw, lb, ln)), Some(counter)) => {
                    let (scale, shift) = (self.p.view(lw), self.p.view(lb));
                    let to = &h.tb[ln.index()];
                    Some(NtTail {
                        counter: (counter.dptr(), counter.dlen()),
                        scale: (scale.dptr(), scale.dlen()),
                        shift: (shift.dptr(), shift.dlen()),
                        out: (to.dptr(), to.dlen()),
                    })
                }
                _ => None,
            };
            let normed = h.product(
                self.s,
                &mut o.view_mut(0..n * oc),
                input,
                w,
                &self.p.view(b),
                Some(&r),
                (n, ic, oc),
                tail,
            )?;
            let what = match normed {
                true => "gemm + bias + residual + layernorm",
                false => "gemm + bias + residual",
            };
            self.prof.mark(self.s, what)?;
            return Ok(normed);
        }
        self.column_product(linear, input, out)?;
        let oc = linear.widths(&self.w).1;
        let n = self.n;
        let (o, t) = split(self.t, out);
        // out += residual (in place).
        self.k.add_inplace(
            self.s,
            &mut o.view_mut(0..n * oc),
            &t.get(residual)?.view(0..n * oc),
        )?;
        self.prof.mark(self.s, "residual add")?;
        Ok(false)
    }
}
