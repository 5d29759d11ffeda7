//! [`Kernels`]: the f32 kernels (`kernels.cu`) loaded on one device and
//! launched on device buffers, with the inputs they take besides
//! buffers: a tensor-parallel rank's vocabulary rows ([`VocabRows`]) and
//! the positions grouped by token for the embedding backward pass
//! ([`token_buckets`]).

use super::sources::SOURCES;
use braid_cuda::nvrtc::{Function, Module};
use braid_cuda::{Device, DeviceMem, Result, Stream};
use std::ffi::c_void;

const BLOCK: u32 = 256;

fn grid(n: usize, per_block: usize) -> (u32, u32, u32) {
    (n.div_ceil(per_block).max(1) as u32, 1, 1)
}

/// Pointer to a kernel argument, as cuLaunchKernel wants it.
fn arg<T>(v: &T) -> *mut c_void {
    v as *const T as *mut c_void
}

/// The loaded kernels of one device.
pub struct Kernels {
    pool: braid_cuda::DevicePool,
    encoder_forward: Function,
    encoder_backward_wpe: Function,
    encoder_backward_wte: Function,
    layernorm_forward: Function,
    layernorm_backward_inp: Function,
    layernorm_backward_params: Function,
    gelu_forward: Function,
    gelu_backward: Function,
    residual_forward: Function,
    softmax_cross_entropy: Function,
    pub(crate) permute_qkv: Function,
    pub(crate) unpermute: Function,
    pub(crate) permute_grad: Function,
    pub(crate) unpermute_qkv_grad: Function,
    pub(crate) softmax_causal_forward: Function,
    pub(crate) softmax_causal_backward: Function,
    add_bias: Function,
    bias_backward: Function,
    sumsq_partial: Function,
    encoder_forward_part: Function,
    vocab_row_max: Function,
    vocab_row_sums: Function,
    vocab_softmax_ce: Function,
    decode_embed: Function,
    kv_write: Function,
    kv_write_bf16: Function,
    paged_attention_decode: Function,
    paged_attention_decode_bf16: Function,
    paged_attention_decode_warps: Function,
    paged_attention_decode_warps_bf16: Function,
    /// The pages kernel's instances (f32 cache, bf16 cache) of 4, 8 and
    /// 16 warps ([`PAGE_WARPS`]).
    paged_attention_decode_pages: [(Function, Function); 3],
    /// Which instance runs where `BRAID_DECODE_PAGE_WARPS` says (an index
    /// into [`PAGE_WARPS`]); `None`: chosen by the step's blocks
    /// ([`pages_instance`]).
    page_warps: Option<usize>,
    /// The device's streaming multiprocessors (the pages kernel's choice).
    multiprocessors: usize,
    /// Which kernel runs the decode attention.
    decode_attention: DecodeAttention,
    /// Whether the decode step's kernels that wait for the one ahead (the
    /// cache write and the pages kernel: `overlap_wait` in kernels.cu)
    /// launch overlapping it ([`Function::launch_overlapping`]); off
    /// unless the decoder turns it on.
    overlap: bool,
    gather_rows: Function,
    logits_pick: Function,
}

impl Kernels {
    /// Compiles (through the cache) and loads every kernel on `device`.
    pub fn load(device: &Device) -> Result<Kernels> {
        let module = Module::compile(device, SOURCES[0].0, SOURCES[0].1)?;
        let f = |n: &str| module.function(n);
        Ok(Kernels {
            pool: braid_cuda::DevicePool::new(device),
            encoder_forward: f("encoder_forward")?,
            encoder_backward_wpe: f("encoder_backward_wpe")?,
            encoder_backward_wte: f("encoder_backward_wte")?,
            layernorm_forward: f("layernorm_forward")?,
            layernorm_backward_inp: f("layernorm_backward_inp")?,
            layernorm_backward_params: f("layernorm_backward_params")?,
            gelu_forward: f("gelu_forward")?,
            gelu_backward: f("gelu_backward")?,
            residual_forward: f("residual_forward")?,
            softmax_cross_entropy: f("softmax_cross_entropy")?,
            permute_qkv: f("permute_qkv")?,
            unpermute: f("unpermute")?,
            permute_grad: f("permute_grad")?,
            unpermute_qkv_grad: f("unpermute_qkv_grad")?,
            softmax_causal_forward: f("softmax_causal_forward")?,
            softmax_causal_backward: f("softmax_causal_backward")?,
            add_bias: f("add_bias")?,
            bias_backward: f("bias_backward")?,
            sumsq_partial: f("sumsq_partial")?,
            encoder_forward_part: f("encoder_forward_part")?,
            vocab_row_max: f("vocab_row_max")?,
            vocab_row_sums: f("vocab_row_sums")?,
            vocab_softmax_ce: f("vocab_softmax_ce")?,
            decode_embed: f("decode_embed")?,
            kv_write: f("kv_write")?,
            kv_write_bf16: f("kv_write_bf16")?,
            paged_attention_decode: f("paged_attention_decode")?,
            paged_attention_decode_bf16: f("paged_attention_decode_bf16")?,
            paged_attention_decode_warps: f("paged_attention_decode_warps")?,
            paged_attention_decode_warps_bf16: f("paged_attention_decode_warps_bf16")?,
            paged_attention_decode_pages: [
                (
                    f("paged_attention_decode_pages_4")?,
                    f("paged_attention_decode_pages_bf16_4")?,
                ),
                (
                    f("paged_attention_decode_pages_8")?,
                    f("paged_attention_decode_pages_bf16_8")?,
                ),
                (
                    f("paged_attention_decode_pages_16")?,
                    f("paged_attention_decode_pages_bf16_16")?,
                ),
            ],
            page_warps: page_warps_from_env()?,
            multiprocessors: device.multiprocessors()?,
            decode_attention: DecodeAttention::from_env()?,
            overlap: false,
            gather_rows: f("gather_rows")?,
            logits_pick: f("logits_pick")?,
        })
    }

    /// `out[n] = wte[tokens[n]] + wpe[n % t]`.
    #[allow(clippy::too_many_arguments)]
    pub fn encoder_forward(
        &self,
        s: &Stream,
        out: &mut impl DeviceMem<f32>,
        tokens: &impl DeviceMem<i32>,
        wte: &impl DeviceMem<f32>,
        wpe: &impl DeviceMem<f32>,
        n: usize,
        t: usize,
        c: usize,
    ) -> Result<()> {
        let (o, tk, e, p) = (out.dptr(), tokens.dptr(), wte.dptr(), wpe.dptr());
        let (n32, t32, c32) = (n as i32, t as i32, c as i32);
        // SAFETY: buffers hold n*c, n, v*c and t*c elements (the caller's
        // shapes), alive until the stream has run the kernel.
        unsafe {
            self.encoder_forward.launch(
                grid(n * c, BLOCK as usize),
                (BLOCK, 1, 1),
                0,
                s,
                &mut [
                    arg(&o),
                    arg(&tk),
                    arg(&e),
                    arg(&p),
                    arg(&n32),
                    arg(&t32),
                    arg(&c32),
                ],
            )
        }
    }

    /// Embedding gradients: `order`/`starts` group positions by token
    /// (see [`token_buckets`]).
    #[allow(clippy::too_many_arguments)]
    pub fn encoder_backward(
        &self,
        s: &Stream,
        dwte: &mut impl DeviceMem<f32>,
        dwpe: &mut impl DeviceMem<f32>,
        dout: &impl DeviceMem<f32>,
        order: &impl DeviceMem<i32>,
        starts: &impl DeviceMem<i32>,
        n: usize,
        t: usize,
        c: usize,
        v: usize,
    ) -> Result<()> {
        let (dte, dpe, d, o, st) = (
            dwte.dptr(),
            dwpe.dptr(),
            dout.dptr(),
            order.dptr(),
            starts.dptr(),
        );
        let (n32, t32, c32, v32) = (n as i32, t as i32, c as i32, v as i32);
        // SAFETY: as in `encoder_forward`; `starts` has v + 1 entries.
        unsafe {
            self.encoder_backward_wpe.launch(
                grid(t * c, BLOCK as usize),
                (BLOCK, 1, 1),
                0,
                s,
                &mut [arg(&dpe), arg(&d), arg(&n32), arg(&t32), arg(&c32)],
            )?;
            self.encoder_backward_wte.launch(
                grid(v * c, BLOCK as usize),
                (BLOCK, 1, 1),
                0,
                s,
                &mut [arg(&dte), arg(&d), arg(&o), arg(&st), arg(&v32), arg(&c32)],
            )
        }
    }

    /// LayerNorm over rows of `c`.
    #[allow(clippy::too_many_arguments)]
    pub fn layernorm_forward(
        &self,
        s: &Stream,
        out: &mut impl DeviceMem<f32>,
        mean: &mut impl DeviceMem<f32>,
        rstd: &mut impl DeviceMem<f32>,
        inp: &impl DeviceMem<f32>,
        w: &impl DeviceMem<f32>,
        b: &impl DeviceMem<f32>,
        n: usize,
        c: usize,
    ) -> Result<()> {
        let ptrs = [
            out.dptr(),
            mean.dptr(),
            rstd.dptr(),
            inp.dptr(),
            w.dptr(),
            b.dptr(),
        ];
        let (n32, c32) = (n as i32, c as i32);
        let rows_per_block = (BLOCK / 32) as usize;
        // SAFETY: rows of `c` elements, `n` rows.
        unsafe {
            self.layernorm_forward.launch(
                grid(n, rows_per_block),
                (BLOCK, 1, 1),
                0,
                s,
                &mut [
                    arg(&ptrs[0]),
                    arg(&ptrs[1]),
                    arg(&ptrs[2]),
                    arg(&ptrs[3]),
                    arg(&ptrs[4]),
                    arg(&ptrs[5]),
                    arg(&n32),
                    arg(&c32),
                ],
            )
        }
    }

    /// LayerNorm backward: accumulates into `dinp`, `dw`, `db`.
    #[allow(clippy::too_many_arguments)]
    pub fn layernorm_backward(
        &self,
        s: &Stream,
        dinp: &mut impl DeviceMem<f32>,
        dw: &mut impl DeviceMem<f32>,
        db: &mut impl DeviceMem<f32>,
        dout: &impl DeviceMem<f32>,
        inp: &impl DeviceMem<f32>,
        w: &impl DeviceMem<f32>,
        mean: &impl DeviceMem<f32>,
        rstd: &impl DeviceMem<f32>,
        n: usize,
        c: usize,
    ) -> Result<()> {
        let (di, dwp, dbp, dy, x, wp, m, r) = (
            dinp.dptr(),
            dw.dptr(),
            db.dptr(),
            dout.dptr(),
            inp.dptr(),
            w.dptr(),
            mean.dptr(),
            rstd.dptr(),
        );
        let (n32, c32) = (n as i32, c as i32);
        let rows_per_block = (BLOCK / 32) as usize;
        // SAFETY: as in `layernorm_forward`.
        unsafe {
            self.layernorm_backward_inp.launch(
                grid(n, rows_per_block),
                (BLOCK, 1, 1),
                0,
                s,
                &mut [
                    arg(&di),
                    arg(&dy),
                    arg(&x),
                    arg(&wp),
                    arg(&m),
                    arg(&r),
                    arg(&n32),
                    arg(&c32),
                ],
            )?;
            self.layernorm_backward_params.launch(
                grid(c, BLOCK as usize),
                (BLOCK, 1, 1),
                0,
                s,
                &mut [
                    arg(&dwp),
                    arg(&dbp),
                    arg(&dy),
                    arg(&x),
                    arg(&m),
                    arg(&r),
                    arg(&n32),
                    arg(&c32),
                ],
            )
        }
    }

    /// GELU (tanh approximation).
    pub fn gelu_forward(
        &self,
        s: &Stream,
        out: &mut impl DeviceMem<f32>,
        inp: &impl DeviceMem<f32>,
    ) -> Result<()> {
        let (o, x, n) = (out.dptr(), inp.dptr(), inp.dlen() as i64);
        // SAFETY: both hold `n` elements.
        unsafe {
            self.gelu_forward.launch(
                grid(inp.dlen(), BLOCK as usize),
                (BLOCK, 1, 1),
                0,
                s,
                &mut [arg(&o), arg(&x), arg(&n)],
            )
        }
    }

    /// `dinp += gelu'(inp) · dout`.
    pub fn gelu_backward(
        &self,
        s: &Stream,
        dinp: &mut impl DeviceMem<f32>,
        inp: &impl DeviceMem<f32>,
        dout: &impl DeviceMem<f32>,
    ) -> Result<()> {
        let (d, x, g, n) = (dinp.dptr(), inp.dptr(), dout.dptr(), inp.dlen() as i64);
        // SAFETY: all hold `n` elements.
        unsafe {
            self.gelu_backward.launch(
                grid(inp.dlen(), BLOCK as usize),
                (BLOCK, 1, 1),
                0,
                s,
                &mut [arg(&d), arg(&x), arg(&g), arg(&n)],
            )
        }
    }

    /// `out = a + b`.
    pub fn residual_forward(
        &self,
        s: &Stream,
        out: &mut impl DeviceMem<f32>,
        a: &impl DeviceMem<f32>,
        b: &impl DeviceMem<f32>,
    ) -> Result<()> {
        let (o, x, y, n) = (out.dptr(), a.dptr(), b.dptr(), a.dlen() as i64);
        // SAFETY: all hold `n` elements.
        unsafe {
            self.residual_forward.launch(
                grid(a.dlen(), BLOCK as usize),
                (BLOCK, 1, 1),
                0,
                s,
                &mut [arg(&o), arg(&x), arg(&y), arg(&n)],
            )
        }
    }

    /// `out += x` (the residual kernel with `out` as its first input: each
    /// thread reads and writes only its own element).
    pub fn add_inplace(
        &self,
        s: &Stream,
        out: &mut impl DeviceMem<f32>,
        x: &impl DeviceMem<f32>,
    ) -> Result<()> {
        if out.dlen() != x.dlen() {
            return Err(braid_cuda::CudaError::Invalid(format!(
                "add_inplace: {} elements += {}",
                out.dlen(),
                x.dlen()
            )));
        }
        let (o, y, n) = (out.dptr(), x.dptr(), x.dlen() as i64);
        // SAFETY: both hold `n` elements.
        unsafe {
            self.residual_forward.launch(
                grid(x.dlen(), BLOCK as usize),
                (BLOCK, 1, 1),
                0,
                s,
                &mut [arg(&o), arg(&o), arg(&y), arg(&n)],
            )
        }
    }

    /// Fused softmax + cross-entropy on `n × v` logits, in place (they
    /// become `scale ·` their gradient when `scale ≠ 0`).
    #[allow(clippy::too_many_arguments)]
    pub fn softmax_cross_entropy(
        &self,
        s: &Stream,
        logits: &mut impl DeviceMem<f32>,
        losses: &mut impl DeviceMem<f32>,
        targets: &impl DeviceMem<i32>,
        n: usize,
        v: usize,
        scale: f32,
    ) -> Result<()> {
        let (l, lo, t) = (logits.dptr(), losses.dptr(), targets.dptr());
        let (n32, v32) = (n as i32, v as i32);
        // SAFETY: logits n*v, losses and targets n.
        unsafe {
            self.softmax_cross_entropy.launch(
                grid(n, (BLOCK / 32) as usize),
                (BLOCK, 1, 1),
                0,
                s,
                &mut [
                    arg(&l),
                    arg(&lo),
                    arg(&t),
                    arg(&n32),
                    arg(&v32),
                    arg(&scale),
                ],
            )
        }
    }
}

/// A tensor-parallel rank's rows of the vocabulary: `v` rows from
/// `first` (the kernels take whole-vocabulary token ids).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VocabRows {
    /// The first row held.
    pub first: usize,
    /// Rows held.
    pub v: usize,
}

impl Kernels {
    /// This rank's share of the embeddings (tensor parallelism): `out[n] =
    /// wte[tokens[n] - first]` where this rank holds that token's row
    /// (else 0), plus `wpe[n % t]` when `with_positions`. Summed over the
    /// group afterwards.
    #[allow(clippy::too_many_arguments)]
    pub fn encoder_forward_part(
        &self,
        s: &Stream,
        out: &mut impl DeviceMem<f32>,
        tokens: &impl DeviceMem<i32>,
        wte: &impl DeviceMem<f32>,
        wpe: &impl DeviceMem<f32>,
        n: usize,
        t: usize,
        c: usize,
        rows: VocabRows,
        with_positions: bool,
    ) -> Result<()> {
        let (o, tk, e, p) = (out.dptr(), tokens.dptr(), wte.dptr(), wpe.dptr());
        let (n32, t32, c32) = (n as i32, t as i32, c as i32);
        let (v0, v, w) = (rows.first as i32, rows.v as i32, with_positions as i32);
        // SAFETY: out n*c, tokens n, wte rows.v*c, wpe t*c elements (the
        // caller's shapes), alive until the stream has run the kernel;
        // tokens outside this rank's rows are never read from wte.
        unsafe {
            self.encoder_forward_part.launch(
                grid(n * c, BLOCK as usize),
                (BLOCK, 1, 1),
                0,
                s,
                &mut [
                    arg(&o),
                    arg(&tk),
                    arg(&e),
                    arg(&p),
                    arg(&n32),
                    arg(&t32),
                    arg(&c32),
                    arg(&v0),
                    arg(&v),
                    arg(&w),
                ],
            )
        }
    }

    /// Each row's maximum of this rank's `v` logits into `mx` (`n` rows).
    pub fn vocab_row_max(
        &self,
        s: &Stream,
        logits: &impl DeviceMem<f32>,
        mx: &mut impl DeviceMem<f32>,
        n: usize,
        v: usize,
    ) -> Result<()> {
        let (l, m) = (logits.dptr(), mx.dptr());
        let (n32, v32) = (n as i32, v as i32);
        // SAFETY: logits n*v, mx n.
        unsafe {
            self.vocab_row_max.launch(
                grid(n, (BLOCK / 32) as usize),
                (BLOCK, 1, 1),
                0,
                s,
                &mut [arg(&l), arg(&m), arg(&n32), arg(&v32)],
            )
        }
    }

    /// After the group's row maxima `mx`: `sums[row]` this rank's sum of
    /// exponentials, `sums[n + row]` its target's logit minus the maximum
    /// where this rank holds the target, else 0.
    #[allow(clippy::too_many_arguments)]
    pub fn vocab_row_sums(
        &self,
        s: &Stream,
        logits: &impl DeviceMem<f32>,
        mx: &impl DeviceMem<f32>,
        sums: &mut impl DeviceMem<f32>,
        targets: &impl DeviceMem<i32>,
        n: usize,
        rows: VocabRows,
    ) -> Result<()> {
        let (l, m, su, t) = (logits.dptr(), mx.dptr(), sums.dptr(), targets.dptr());
        let (n32, v32, v0) = (n as i32, rows.v as i32, rows.first as i32);
        // SAFETY: logits n*v, mx and targets n, sums 2n.
        unsafe {
            self.vocab_row_sums.launch(
                grid(n, (BLOCK / 32) as usize),
                (BLOCK, 1, 1),
                0,
                s,
                &mut [
                    arg(&l),
                    arg(&m),
                    arg(&su),
                    arg(&t),
                    arg(&n32),
                    arg(&v32),
                    arg(&v0),
                ],
            )
        }
    }

    /// After the group's sums: each row's loss over the whole vocabulary,
    /// and (scale ≠ 0) the logits become `scale · (softmax − onehot)` in
    /// this rank's rows.
    #[allow(clippy::too_many_arguments)]
    pub fn vocab_softmax_ce(
        &self,
        s: &Stream,
        logits: &mut impl DeviceMem<f32>,
        losses: &mut impl DeviceMem<f32>,
        mx: &impl DeviceMem<f32>,
        sums: &impl DeviceMem<f32>,
        targets: &impl DeviceMem<i32>,
        n: usize,
        rows: VocabRows,
        scale: f32,
    ) -> Result<()> {
        let (l, lo, m, su, t) = (
            logits.dptr(),
            losses.dptr(),
            mx.dptr(),
            sums.dptr(),
            targets.dptr(),
        );
        let (n32, v32, v0) = (n as i32, rows.v as i32, rows.first as i32);
        // SAFETY: logits n*v, losses, mx and targets n, sums 2n.
        unsafe {
            self.vocab_softmax_ce.launch(
                grid(n, (BLOCK / 32) as usize),
                (BLOCK, 1, 1),
                0,
                s,
                &mut [
                    arg(&l),
                    arg(&lo),
                    arg(&m),
                    arg(&su),
                    arg(&t),
                    arg(&n32),
                    arg(&v32),
                    arg(&v0),
                    arg(&scale),
                ],
            )
        }
    }
}

impl Kernels {
    /// `out[rows, c] += bias`.
    pub fn add_bias(
        &self,
        s: &Stream,
        out: &mut impl DeviceMem<f32>,
        bias: &impl DeviceMem<f32>,
        rows: usize,
        c: usize,
    ) -> Result<()> {
        let (o, b, n, c32) = (out.dptr(), bias.dptr(), rows as i64, c as i32);
        // SAFETY: out holds rows*c, bias c elements.
        unsafe {
            self.add_bias.launch(
                grid(rows * c, BLOCK as usize),
                (BLOCK, 1, 1),
                0,
                s,
                &mut [arg(&o), arg(&b), arg(&n), arg(&c32)],
            )
        }
    }

    /// `dbias += Σ_rows dout`.
    pub fn bias_backward(
        &self,
        s: &Stream,
        dbias: &mut impl DeviceMem<f32>,
        dout: &impl DeviceMem<f32>,
        rows: usize,
        c: usize,
    ) -> Result<()> {
        let (d, g, n32, c32) = (dbias.dptr(), dout.dptr(), rows as i32, c as i32);
        // SAFETY: dout holds rows*c, dbias c elements.
        unsafe {
            self.bias_backward.launch(
                grid(c, BLOCK as usize),
                (BLOCK, 1, 1),
                0,
                s,
                &mut [arg(&d), arg(&g), arg(&n32), arg(&c32)],
            )
        }
    }

    /// The L2 norm of `x` (partial sums on the GPU in a fixed order, summed
    /// on the host in f64).
    pub fn global_norm(&self, s: &Stream, x: &impl DeviceMem<f32>) -> Result<f64> {
        Ok(self.sum_of_squares(s, &[x])?.sqrt())
    }

    /// The sum of the squares of every element of `xs` (a sharded rank's
    /// ranges of its gradients): partial sums on the GPU, one launch per
    /// part, then one wait and the partials summed on the host in f64, in
    /// order.
    pub fn sum_of_squares(&self, s: &Stream, xs: &[&dyn DeviceMem<f32>]) -> Result<f64> {
        const CHUNK: usize = 1 << 16;
        let blocks: Vec<usize> = xs.iter().map(|x| x.dlen().div_ceil(CHUNK).max(1)).collect();
        // From the pool: no allocation per step; the block returns to the
        // pool only after the synchronisation below.
        let partial = self.pool.uninit::<f32>(blocks.iter().sum())?;
        let mut at = 0;
        for (x, &nb) in xs.iter().zip(&blocks) {
            let pp = partial.device_ptr() + (4 * at) as u64;
            let (xp, n64, ch) = (x.dptr(), x.dlen() as i64, CHUNK as i64);
            // SAFETY: `partial` has one slot per block of every part, this
            // part's from `at`; x holds n elements.
            unsafe {
                self.sumsq_partial.launch(
                    (nb as u32, 1, 1),
                    (BLOCK, 1, 1),
                    0,
                    s,
                    &mut [arg(&pp), arg(&xp), arg(&n64), arg(&ch)],
                )?;
            }
            at += nb;
        }
        s.synchronize()?;
        Ok(partial.to_vec()?.iter().map(|&v| v as f64).sum::<f64>())
    }

    /// Launches a 1-D elementwise kernel over `total` items.
    ///
    /// # Safety
    /// `args` must match `f`'s parameters and stay valid until it runs.
    pub(crate) unsafe fn launch_1d(
        &self,
        f: &Function,
        s: &Stream,
        total: usize,
        args: &mut [*mut c_void],
    ) -> Result<()> {
        f.launch(grid(total, BLOCK as usize), (BLOCK, 1, 1), 0, s, args)
    }

    /// Launches a one-warp-per-row kernel over `rows`.
    ///
    /// # Safety
    /// As [`launch_1d`](Self::launch_1d).
    pub(crate) unsafe fn launch_rows(
        &self,
        f: &Function,
        s: &Stream,
        rows: usize,
        args: &mut [*mut c_void],
    ) -> Result<()> {
        f.launch(grid(rows, (BLOCK / 32) as usize), (BLOCK, 1, 1), 0, s, args)
    }
}

/// One layer of the paged KV cache as the decode kernels read and write
/// it: the addresses of its keys and values, `len` elements each, in
/// f32 or (`bf16`) in bf16.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PagedKv {
    pub k: u64,
    pub v: u64,
    pub len: usize,
    pub bf16: bool,
}

/// The shape of one decode step's paged attention
/// ([`Kernels::paged_attention_decode`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PagedShape {
    /// The step's rows.
    pub rows: usize,
    /// Attention heads.
    pub heads: usize,
    /// Their size (the width is `heads * head_size`).
    pub head_size: usize,
    /// Positions per block of the cache.
    pub block_size: usize,
}

/// The kernels of the decode attention, all over the same paged cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodeAttention {
    /// Page rows read 16 bytes a lane, several positions a warp
    /// (`paged_attention_decode_pages`, the default where the head's
    /// bytes and the buffers' alignment allow; else `Warps`).
    Pages,
    /// A warp per position (`paged_attention_decode_warps`).
    Warps,
    /// A thread per position (`paged_attention_decode`, the first kernel).
    Block,
}

impl DecodeAttention {
    /// `BRAID_DECODE_ATTENTION`: `pages` (the default), `warps` or
    /// `block`; anything else refused with what is accepted.
    pub fn from_env() -> Result<DecodeAttention> {
        let v = std::env::var(braid_core::env::BRAID_DECODE_ATTENTION).unwrap_or_default();
        match v.as_str() {
            "" | "pages" => Ok(DecodeAttention::Pages),
            "warps" => Ok(DecodeAttention::Warps),
            "block" => Ok(DecodeAttention::Block),
            other => Err(braid_cuda::CudaError::Invalid(format!(
                "{}={other}: the decode attention is pages (the default), warps or block",
                braid_core::env::BRAID_DECODE_ATTENTION
            ))),
        }
    }
}

/// The pages kernel's instances: warps per block.
pub const PAGE_WARPS: [usize; 3] = [4, 8, 16];

/// `BRAID_DECODE_PAGE_WARPS`: 4, 8 or 16 warps per block of the pages
/// kernel for every step (the index into [`PAGE_WARPS`]); unset or `auto`:
/// chosen per step ([`pages_instance`]). Every instance computes the same
/// sums in the same order (kernels.cu), so the choice moves no bit.
fn page_warps_from_env() -> Result<Option<usize>> {
    let name = braid_core::env::BRAID_DECODE_PAGE_WARPS;
    match std::env::var(name).as_deref() {
        Err(_) | Ok("") | Ok("auto") => Ok(None),
        Ok(v) => v
            .parse::<usize>()
            .ok()
            .and_then(|w| PAGE_WARPS.iter().position(|&x| x == w))
            .map(Some)
            .ok_or_else(|| {
                braid_cuda::CudaError::Invalid(format!("{name}={v}: expected 4, 8, 16 or auto"))
            }),
    }
}

/// The pages kernel's instance (an index into [`PAGE_WARPS`]) for a step
/// of `blocks` (rows × heads) blocks on `multiprocessors`: 16 warps where
/// the blocks are too few to fill the GPU (a few rows: each block's
/// positions then take one pass of its warps, not several), else 4.
pub fn pages_instance(blocks: usize, multiprocessors: usize) -> usize {
    match blocks <= multiprocessors {
        true => 2,
        false => 0,
    }
}

/// Whether the pages kernel reads this head: 16 bytes a lane (`head_size`
/// a multiple of 4 elements in f32, 8 in bf16), a position in a power of
/// two of lanes up to a warp, and the cache's 16-byte loads aligned.
fn pages_fit(head_size: usize, kv: PagedKv) -> bool {
    let e = if kv.bf16 { 8 } else { 4 };
    let lanes = head_size / e;
    head_size % e == 0 && lanes.is_power_of_two() && lanes <= 32 && kv.k % 16 == 0 && kv.v % 16 == 0
}

fn too_short(what: &str, have: usize, want: usize) -> Result<()> {
    match have >= want {
        true => Ok(()),
        false => Err(braid_cuda::CudaError::Invalid(format!(
            "{what}: {have} elements where {want} are needed"
        ))),
    }
}

/// Threads of one (row, head) block of the paged attention: at least one
/// per element of a head, a whole number of warps, at least 128.
fn paged_threads(head_size: usize) -> Result<u32> {
    let t = head_size.next_multiple_of(32).max(128);
    match t <= 1024 {
        true => Ok(t as u32),
        false => Err(braid_cuda::CudaError::Invalid(format!(
            "paged attention: heads of {head_size} exceed a block's 1024 threads"
        ))),
    }
}

impl Kernels {
    /// A decode step's embeddings: `out[n] = wte[tokens[n]] + wpe[pos[n]]`
    /// for `n` rows of `c` (tokens and positions checked by the caller:
    /// inside the vocabulary and the context).
    #[allow(clippy::too_many_arguments)]
    pub fn decode_embed(
        &self,
        s: &Stream,
        out: &mut impl DeviceMem<f32>,
        tokens: &impl DeviceMem<i32>,
        pos: &impl DeviceMem<i32>,
        wte: &impl DeviceMem<f32>,
        wpe: &impl DeviceMem<f32>,
        n: usize,
        c: usize,
    ) -> Result<()> {
        too_short("decode_embed out", out.dlen(), n * c)?;
        too_short("decode_embed tokens", tokens.dlen(), n)?;
        too_short("decode_embed positions", pos.dlen(), n)?;
        let (o, tk, ps, e, p) = (
            out.dptr(),
            tokens.dptr(),
            pos.dptr(),
            wte.dptr(),
            wpe.dptr(),
        );
        let (n32, c32) = (n as i32, c as i32);
        // SAFETY: out holds n*c, tokens and pos n elements (checked); every
        // token indexes a row of wte and every position a row of wpe (the
        // caller's checks); all alive until the stream has run the kernel.
        unsafe {
            self.decode_embed.launch(
                grid(n * c, BLOCK as usize),
                (BLOCK, 1, 1),
                0,
                s,
                &mut [
                    arg(&o),
                    arg(&tk),
                    arg(&ps),
                    arg(&e),
                    arg(&p),
                    arg(&n32),
                    arg(&c32),
                ],
            )
        }
    }

    /// Each of `n` rows' key and value (`qkv` rows of `3c`: query, key,
    /// value) into its slot of a layer's cache: `k[slots[r]] =
    /// qkv[r][c..2c]`, `v[slots[r]] = qkv[r][2c..]` (slots checked by the
    /// caller: inside the cache).
    #[allow(clippy::too_many_arguments)]
    pub fn kv_write(
        &self,
        s: &Stream,
        kv: PagedKv,
        qkv: &impl DeviceMem<f32>,
        slots: &impl DeviceMem<i32>,
        n: usize,
        c: usize,
    ) -> Result<()> {
        too_short("kv_write qkv", qkv.dlen(), n * 3 * c)?;
        too_short("kv_write slots", slots.dlen(), n)?;
        let (kp, vp, q, sl) = (kv.k, kv.v, qkv.dptr(), slots.dptr());
        let (n32, c32) = (n as i32, c as i32);
        let f = match kv.bf16 {
            true => &self.kv_write_bf16,
            false => &self.kv_write,
        };
        // SAFETY: qkv holds n*3c and slots n elements (checked); every slot
        // is below the cache's kv.len / c (the caller's check), and the
        // kernel stores the element kv.bf16 names; all alive until the
        // stream has run the kernel.
        // kv_write_body waits for the kernel ahead before any access.
        unsafe {
            self.decode_launch(
                true,
                f,
                grid(n * c, BLOCK as usize),
                (BLOCK, 1, 1),
                0,
                s,
                &mut [arg(&kp), arg(&vp), arg(&q), arg(&sl), arg(&n32), arg(&c32)],
            )
        }
    }

    /// Launches the decode step's kernels that wait for the one ahead
    /// (the cache write, the pages kernel) overlapping it
    /// ([`Function::launch_overlapping`]), from now on; `false` launches
    /// them as every other kernel.
    pub(crate) fn set_overlap(&mut self, on: bool) {
        self.overlap = on;
    }

    /// `f` launched overlapping the kernel ahead where it `waits` for it
    /// and [`set_overlap`](Self::set_overlap) said so, else as usual.
    ///
    /// # Safety
    /// As [`Function::launch`], and where `waits`, `f` must wait
    /// (`overlap_wait`) before touching memory the work ahead of it
    /// touches.
    #[allow(clippy::too_many_arguments)]
    unsafe fn decode_launch(
        &self,
        waits: bool,
        f: &Function,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        shared: u32,
        s: &Stream,
        args: &mut [*mut c_void],
    ) -> Result<()> {
        // SAFETY: the caller's promises, passed on.
        unsafe {
            match self.overlap && waits {
                true => f.launch_overlapping(grid, block, shared, s, args),
                false => f.launch(grid, block, shared, s, args),
            }
        }
    }

    /// The decode attention's kernel (the tests try each).
    #[cfg(test)]
    pub(crate) fn set_decode_attention(&mut self, which: DecodeAttention) {
        self.decode_attention = which;
    }

    /// The pages kernel's warps per block, one of [`PAGE_WARPS`] (`None`:
    /// chosen per step).
    #[cfg(test)]
    pub(crate) fn set_page_warps(&mut self, warps: Option<usize>) {
        self.page_warps = warps.map(|warps| {
            PAGE_WARPS
                .iter()
                .position(|&w| w == warps)
                .expect("4, 8 or 16")
        });
    }

    /// A decode step's attention over the paged cache of one layer: row
    /// `r`'s query (in `qkv`, rows of `3c`) attends to its sequence's
    /// positions `0..=pos[r]`, whose keys and values `k` and `v` hold in
    /// the slots its table gives — `tabs[tab_off[r]..]`, the sequence's
    /// block ids in order (position `p` at slot `tab[p / block_size] *
    /// block_size + p % block_size`). Softmax scale `1/sqrt(head_size)`;
    /// `out` rows of `c`. One block of threads per (row, head). Tables,
    /// positions and block ids are checked by the caller.
    ///
    /// `outb` (a bf16 buffer's pointer and length, `rows * c` at least):
    /// the output narrowed to bf16 there too, when the kernel that runs
    /// can (the pages kernel). Returns whether it did; if not, the caller
    /// narrows `out` itself.
    #[allow(clippy::too_many_arguments)]
    pub fn paged_attention_decode(
        &self,
        s: &Stream,
        out: &mut impl DeviceMem<f32>,
        outb: Option<(u64, usize)>,
        qkv: &impl DeviceMem<f32>,
        kv: PagedKv,
        pos: &impl DeviceMem<i32>,
        tab_off: &impl DeviceMem<i32>,
        tabs: &impl DeviceMem<i32>,
        shape: PagedShape,
    ) -> Result<bool> {
        let PagedShape {
            rows,
            heads,
            head_size,
            block_size,
        } = shape;
        let c = heads * head_size;
        if rows == 0 {
            return Ok(outb.is_some());
        }
        too_short("paged attention out", out.dlen(), rows * c)?;
        too_short("paged attention qkv", qkv.dlen(), rows * 3 * c)?;
        too_short("paged attention positions", pos.dlen(), rows)?;
        too_short("paged attention table offsets", tab_off.dlen(), rows)?;
        if let Some((_, len)) = outb {
            too_short("paged attention bf16 out", len, rows * c)?;
        }
        let which = match self.decode_attention {
            DecodeAttention::Pages if pages_fit(head_size, kv) => DecodeAttention::Pages,
            DecodeAttention::Pages | DecodeAttention::Warps if head_size <= 128 => {
                DecodeAttention::Warps
            }
            _ => DecodeAttention::Block,
        };
        let threads = paged_threads(head_size)?;
        let shared = (threads as usize + 32 + head_size) * std::mem::size_of::<f32>();
        // The pages' and the warps' kernels: a fixed number of warps
        // (PG_WARPS, DEC_WARPS), their shared memory static.
        let (f, threads, shared) = match (which, kv.bf16) {
            (DecodeAttention::Pages, bf16) => {
                let at = self
                    .page_warps
                    .unwrap_or_else(|| pages_instance(rows * heads, self.multiprocessors));
                let (f32_cache, bf16_cache) = &self.paged_attention_decode_pages[at];
                let threads = (PAGE_WARPS[at] * 32) as u32;
                (if bf16 { bf16_cache } else { f32_cache }, threads, 0)
            }
            (DecodeAttention::Warps, false) => (&self.paged_attention_decode_warps, 8 * 32, 0),
            (DecodeAttention::Warps, true) => (&self.paged_attention_decode_warps_bf16, 8 * 32, 0),
            (DecodeAttention::Block, false) => (&self.paged_attention_decode, threads, shared),
            (DecodeAttention::Block, true) => (&self.paged_attention_decode_bf16, threads, shared),
        };
        let narrowed = which == DecodeAttention::Pages && outb.is_some();
        let ob: u64 = match (which, outb) {
            (DecodeAttention::Pages, Some((p, _))) => p,
            _ => 0,
        };
        let ptrs = [
            out.dptr(),
            qkv.dptr(),
            kv.k,
            kv.v,
            pos.dptr(),
            tab_off.dptr(),
            tabs.dptr(),
        ];
        let (nh, hs, bs) = (heads as i32, head_size as i32, block_size as i32);
        let scale = 1.0f32 / (head_size as f32).sqrt();
        let mut args = vec![arg(&ptrs[0])];
        if which == DecodeAttention::Pages {
            args.push(arg(&ob));
        }
        args.extend([
            arg(&ptrs[1]),
            arg(&ptrs[2]),
            arg(&ptrs[3]),
            arg(&ptrs[4]),
            arg(&ptrs[5]),
            arg(&ptrs[6]),
            arg(&nh),
            arg(&hs),
            arg(&bs),
            arg(&scale),
        ]);
        // SAFETY: out holds rows*c, qkv rows*3c, pos and tab_off rows
        // elements, and outb (when the pages kernel writes it, else null)
        // rows*c (checked); each row's table holds a block for each of its
        // positions 0..=pos and every block id is inside the cache (the
        // caller's checks), the kernel reading the element kv.bf16 names;
        // the pages kernel runs only where pages_fit found its 16-byte
        // loads aligned and a position's lanes a power of two up to a
        // warp; the first kernel's dynamic shared memory is its (threads +
        // 32 + head_size) floats, under 48 KiB for threads <= 1024 (the
        // others' arrays static; the warps' kernel for head_size <= 128);
        // all alive until the stream has run the kernel.
        // Only the pages kernel waits for the kernel ahead (overlap_wait):
        // the others launch as usual.
        unsafe {
            self.decode_launch(
                which == DecodeAttention::Pages,
                f,
                (rows as u32, heads as u32, 1),
                (threads, 1, 1),
                shared as u32,
                s,
                &mut args,
            )?;
        }
        Ok(narrowed)
    }

    /// Each of `m` rows of `ld` logits' greedy choice among its first
    /// `v`: `token[r]` the largest logit's index (the lowest on a tie),
    /// `logprob[r]` that token's log-softmax over those `v`.
    #[allow(clippy::too_many_arguments)]
    pub fn logits_pick(
        &self,
        s: &Stream,
        token: &mut impl DeviceMem<i32>,
        logprob: &mut impl DeviceMem<f32>,
        logits: &impl DeviceMem<f32>,
        m: usize,
        ld: usize,
        v: usize,
    ) -> Result<()> {
        too_short("logits_pick token", token.dlen(), m)?;
        too_short("logits_pick logprob", logprob.dlen(), m)?;
        too_short("logits_pick logits", logits.dlen(), m * ld)?;
        if m == 0 || v == 0 || v > ld {
            return Err(braid_cuda::CudaError::Invalid(format!(
                "greedy picks of {m} row(s) among the first {v} of {ld} logits"
            )));
        }
        let (t, l, x) = (token.dptr(), logprob.dptr(), logits.dptr());
        let (ld32, v32) = (ld as i32, v as i32);
        // SAFETY: token and logprob hold m elements and logits m*v
        // (checked); one block per row, 1024 threads (a multiple of the
        // warp, at most 32 warps: the kernel's reductions); all alive until
        // the stream has run the kernel.
        unsafe {
            self.logits_pick.launch(
                (m as u32, 1, 1),
                (1024, 1, 1),
                0,
                s,
                &mut [arg(&t), arg(&l), arg(&x), arg(&ld32), arg(&v32)],
            )
        }
    }

    /// `out[m] = inp[rows[m]]` for `m` rows of `c` (the row indices
    /// checked by the caller: rows of `inp`).
    pub fn gather_rows(
        &self,
        s: &Stream,
        out: &mut impl DeviceMem<f32>,
        inp: &impl DeviceMem<f32>,
        rows: &impl DeviceMem<i32>,
        m: usize,
        c: usize,
    ) -> Result<()> {
        too_short("gather_rows out", out.dlen(), m * c)?;
        too_short("gather_rows rows", rows.dlen(), m)?;
        let (o, x, r) = (out.dptr(), inp.dptr(), rows.dptr());
        let (m32, c32) = (m as i32, c as i32);
        // SAFETY: out holds m*c and rows m elements (checked); every row
        // index is a row of inp (the caller's check); all alive until the
        // stream has run the kernel.
        unsafe {
            self.gather_rows.launch(
                grid(m * c, BLOCK as usize),
                (BLOCK, 1, 1),
                0,
                s,
                &mut [arg(&o), arg(&x), arg(&r), arg(&m32), arg(&c32)],
            )
        }
    }
}

/// Pointer to a kernel argument (for sibling modules).
pub(crate) fn karg<T>(v: &T) -> *mut c_void {
    arg(v)
}

/// Positions grouped by token for the deterministic embedding backward:
/// `order` lists positions sorted by token (stable), `starts[v]..starts[v+1]`
/// is token `v`'s range.
pub fn token_buckets(tokens: &[u32], vocab: usize) -> (Vec<i32>, Vec<i32>) {
    let mut starts = vec![0i32; vocab + 1];
    for &t in tokens {
        starts[t as usize + 1] += 1;
    }
    for v in 0..vocab {
        starts[v + 1] += starts[v];
    }
    let mut fill = starts.clone();
    let mut order = vec![0i32; tokens.len()];
    for (pos, &t) in tokens.iter().enumerate() {
        order[fill[t as usize] as usize] = pos as i32;
        fill[t as usize] += 1;
    }
    (order, starts)
}
