//! Matrix products on the GPU through cuBLAS (loaded at run time), in the
//! same row-major terms as the CPU engine's `gemm_rm`: f32 products
//! ([`Blas::gemm_rm`], [`Blas::gemm_rm_batched`]) and mixed-precision ones
//! with explicit leading dimensions ([`Blas::gemm_ex`], bf16 or f32 inputs,
//! f32 accumulation).

use crate::driver::{Device, Stream};
use crate::error::{CudaError, Result};
use crate::memory::DeviceMem;
use braid_core::{DType, Element};
use cudarc::cublas::{result, sys};

/// A cuBLAS handle bound to one device.
pub struct Blas {
    handle: sys::cublasHandle_t,
    device: Device,
}

// SAFETY: a cuBLAS handle may be used from any thread, one call at a time
// (braid serialises calls per handle through `&mut self`/ownership).
unsafe impl Send for Blas {}

/// cuBLAS's dimensions, leading dimensions and batch counts are 32-bit:
/// `vals` as `i32`, or an error naming the first that does not fit (a
/// product that large must be split by the caller).
fn dims<const N: usize>(call: &str, vals: [(&str, usize); N]) -> Result<[i32; N]> {
    let mut out = [0i32; N];
    for (o, (name, v)) in out.iter_mut().zip(vals) {
        *o = i32::try_from(v).map_err(|_| {
            CudaError::Invalid(format!(
                "{call}: {name} = {v} exceeds cuBLAS's 32-bit dimensions (2^31 - 1)"
            ))
        })?;
    }
    Ok(out)
}

fn blas_err(call: &'static str) -> impl FnOnce(result::CublasError) -> CudaError {
    move |e| CudaError::Driver {
        call,
        name: format!("{:?}", e.0),
        text: String::new(),
    }
}

impl Blas {
    /// A handle on `device`, or why cuBLAS cannot be used.
    pub fn new(device: &Device) -> Result<Blas> {
        // SAFETY: only probes whether the library can be opened.
        if !unsafe { sys::is_culib_present() } {
            return Err(CudaError::Unavailable(
                "GPU matrix products are unavailable: the cuBLAS library (libcublas.so.13) was not found".into(),
            ));
        }
        device.bind()?;
        let handle = result::create_handle().map_err(blas_err("cublasCreate"))?;
        Ok(Blas {
            handle,
            device: device.clone(),
        })
    }

    /// Plans later products for `sms` streaming multiprocessors (0: all of
    /// the GPU's): with some SMs busy elsewhere (communication kernels),
    /// products sized for the rest avoid a last, nearly empty wave.
    pub fn set_sm_count_target(&mut self, sms: usize) -> Result<()> {
        self.device.bind()?;
        // SAFETY: valid handle; the target is a plain integer.
        let r = unsafe { sys::cublasSetSmCountTarget(self.handle, sms as i32) };
        if r != sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            return Err(CudaError::Invalid(format!(
                "cublasSetSmCountTarget({sms}): {r:?}"
            )));
        }
        Ok(())
    }

    /// `dst[m,n] (= or +=) a · b` on `stream`, all row-major; `a` is
    /// `[m,k]` (`[k,m]` when `a_t`), `b` is `[k,n]` (`[n,k]` when `b_t`).
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_rm(
        &mut self,
        stream: &Stream,
        dst: &mut impl DeviceMem<f32>,
        a: &impl DeviceMem<f32>,
        a_t: bool,
        b: &impl DeviceMem<f32>,
        b_t: bool,
        m: usize,
        n: usize,
        k: usize,
        accumulate: bool,
    ) -> Result<()> {
        if dst.dlen() != m * n || a.dlen() != m * k || b.dlen() != k * n {
            return Err(CudaError::Invalid(format!(
                "gemm: dst {} / a {} / b {} elements do not fit {m}x{k} · {k}x{n}",
                dst.dlen(),
                a.dlen(),
                b.dlen()
            )));
        }
        if m == 0 || n == 0 {
            return Ok(());
        }
        self.device.bind()?;
        let (op_b, ldb) = if b_t {
            (sys::cublasOperation_t::CUBLAS_OP_T, k)
        } else {
            (sys::cublasOperation_t::CUBLAS_OP_N, n)
        };
        let (op_a, lda) = if a_t {
            (sys::cublasOperation_t::CUBLAS_OP_T, m)
        } else {
            (sys::cublasOperation_t::CUBLAS_OP_N, k)
        };
        let alpha = 1.0f32;
        let beta = if accumulate { 1.0f32 } else { 0.0 };
        let [ni, mi, ki, ldbi, ldai] = dims(
            "cublasSgemm",
            [
                ("n", n),
                ("m", m),
                ("k", k.max(1)),
                ("ldb", ldb.max(1)),
                ("lda", lda.max(1)),
            ],
        )?;
        // SAFETY: the handle is ours; sizes checked above; row-major C = A·B
        // is column-major Cᵀ = Bᵀ·Aᵀ, which is what the operands and
        // leading dimensions describe.
        unsafe {
            result::set_stream(self.handle, stream.raw() as _)
                .map_err(blas_err("cublasSetStream"))?;
            result::sgemm(
                self.handle,
                op_b,
                op_a,
                ni,
                mi,
                ki,
                &alpha,
                b.dptr() as *const f32,
                ldbi,
                a.dptr() as *const f32,
                ldai,
                &beta,
                dst.dptr() as *mut f32,
                ni,
            )
            .map_err(blas_err("cublasSgemm"))
        }
    }
}

/// One operand of a strided batched product: the buffer, whether it is
/// stored transposed, and the element stride between batch entries.
pub struct Operand<'a> {
    /// The buffer (all batch entries).
    pub buf: &'a dyn DeviceMem<f32>,
    /// Element offset of batch entry 0.
    pub offset: usize,
    /// Stored transposed.
    pub transposed: bool,
    /// Elements between consecutive batch entries.
    pub stride: usize,
}

impl Blas {
    /// `batch` row-major products `dst_i[m,n] (= or +=) a_i · b_i`, entry
    /// `i` of each operand at `offset + i * stride`.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_rm_batched(
        &mut self,
        stream: &Stream,
        dst: &mut impl DeviceMem<f32>,
        dst_stride: usize,
        a: Operand,
        b: Operand,
        m: usize,
        n: usize,
        k: usize,
        batch: usize,
        accumulate: bool,
    ) -> Result<()> {
        let last = |o: &Operand, len: usize| o.offset + (batch.max(1) - 1) * o.stride + len;
        if last(&a, m * k) > a.buf.dlen()
            || last(&b, k * n) > b.buf.dlen()
            || (batch.max(1) - 1) * dst_stride + m * n > dst.dlen()
        {
            return Err(CudaError::Invalid(format!(
                "batched gemm: {batch} products of {m}x{k} · {k}x{n} do not fit the buffers"
            )));
        }
        if m == 0 || n == 0 || batch == 0 {
            return Ok(());
        }
        self.device.bind()?;
        let (op_b, ldb) = if b.transposed {
            (sys::cublasOperation_t::CUBLAS_OP_T, k)
        } else {
            (sys::cublasOperation_t::CUBLAS_OP_N, n)
        };
        let (op_a, lda) = if a.transposed {
            (sys::cublasOperation_t::CUBLAS_OP_T, m)
        } else {
            (sys::cublasOperation_t::CUBLAS_OP_N, k)
        };
        let alpha = 1.0f32;
        let beta = if accumulate { 1.0f32 } else { 0.0 };
        let [ni, mi, ki, ldbi, ldai, bi] = dims(
            "cublasSgemmStridedBatched",
            [
                ("n", n),
                ("m", m),
                ("k", k.max(1)),
                ("ldb", ldb.max(1)),
                ("lda", lda.max(1)),
                ("batch", batch),
            ],
        )?;
        // SAFETY: as in `gemm_rm`; every batch entry was checked to lie
        // inside its buffer.
        unsafe {
            result::set_stream(self.handle, stream.raw() as _)
                .map_err(blas_err("cublasSetStream"))?;
            result::sgemm_strided_batched(
                self.handle,
                op_b,
                op_a,
                ni,
                mi,
                ki,
                &alpha,
                (b.buf.dptr() + (b.offset * 4) as u64) as *const f32,
                ldbi,
                b.stride as i64,
                (a.buf.dptr() + (a.offset * 4) as u64) as *const f32,
                ldai,
                a.stride as i64,
                &beta,
                dst.dptr() as *mut f32,
                ni,
                dst_stride as i64,
                bi,
            )
            .map_err(blas_err("cublasSgemmStridedBatched"))
        }
    }
}

/// One row-major matrix operand of [`Blas::gemm_ex`]: a device buffer
/// (f32 or bf16), its leading dimension (elements between stored rows),
/// whether it is used transposed, and the stride between batch entries.
#[derive(Debug, Clone, Copy)]
pub struct Mat {
    pub(crate) ptr: u64,
    pub(crate) len: usize,
    pub(crate) ty: DType,
    pub(crate) ld: usize,
    pub(crate) transposed: bool,
    pub(crate) stride: usize,
}

impl Mat {
    /// The matrix stored in `buf` with `ld` elements per stored row.
    pub fn of<T: Element>(buf: &impl DeviceMem<T>, ld: usize) -> Mat {
        Mat {
            ptr: buf.dptr(),
            len: buf.dlen(),
            ty: T::DTYPE,
            ld,
            transposed: false,
            stride: 0,
        }
    }

    /// Where it starts on the device and how many elements it may span
    /// from there.
    pub fn storage(&self) -> (u64, usize) {
        (self.ptr, self.len)
    }

    /// Its element type.
    pub fn dtype(&self) -> DType {
        self.ty
    }

    /// Elements between stored rows.
    pub fn ld(&self) -> usize {
        self.ld
    }

    /// Whether it is stored whole and in order: untransposed, unbatched.
    pub fn plain(&self) -> bool {
        !self.transposed && self.stride == 0
    }

    /// Rows `r` of a matrix stored untransposed, unbatched (a block of
    /// rows of a row-major operand, `ld` elements apart). `None` for a
    /// transposed or batched one, or rows past its storage.
    pub fn rows(self, r: std::ops::Range<usize>) -> Option<Mat> {
        let len = r.len().checked_mul(self.ld)?;
        let start = r.start.checked_mul(self.ld)?;
        if self.transposed || self.stride != 0 || start.checked_add(len)? > self.len {
            return None;
        }
        Some(Mat {
            ptr: self.ptr + (start * self.ty.size()) as u64,
            len,
            ..self
        })
    }

    /// The same matrix used transposed.
    pub fn t(mut self) -> Mat {
        self.transposed = true;
        self
    }

    /// With `stride` elements between batch entries.
    pub fn batched(mut self, stride: usize) -> Mat {
        self.stride = stride;
        self
    }

    /// Elements the operand spans for `batch` entries of `rows × cols`
    /// (as used; stored transposed when `transposed`).
    pub(crate) fn span(&self, rows: usize, cols: usize, batch: usize) -> usize {
        let (r, c) = if self.transposed {
            (cols, rows)
        } else {
            (rows, cols)
        };
        (batch - 1) * self.stride + (r - 1) * self.ld + c
    }

    pub(crate) fn cuda(&self) -> Option<sys::cudaDataType> {
        match self.ty {
            DType::F32 => Some(sys::cudaDataType::CUDA_R_32F),
            DType::BF16 => Some(sys::cudaDataType::CUDA_R_16BF),
            _ => None,
        }
    }
}

/// A mixed-precision product `c[m,n] = alpha · a[m,k] · b[k,n] + beta · c`
/// over `batch` entries, all row-major; `a` and `b` share an element type,
/// `c` may be f32 or that type; accumulation is f32 (TF32 tensor cores for
/// f32 inputs when `tf32`).
#[derive(Debug, Clone, Copy)]
pub struct GemmEx {
    /// Rows of the result.
    pub m: usize,
    /// Columns of the result.
    pub n: usize,
    /// Inner dimension.
    pub k: usize,
    /// Left operand.
    pub a: Mat,
    /// Right operand.
    pub b: Mat,
    /// Result (never transposed).
    pub c: Mat,
    /// Scale of the product.
    pub alpha: f32,
    /// Scale of the existing result (0: overwrite).
    pub beta: f32,
    /// Products in the batch (1: a single product).
    pub batch: usize,
    /// Let f32 products use TF32 tensor cores.
    pub tf32: bool,
}

impl Blas {
    /// Runs `g` on `stream`, after checking that the element types fit
    /// together and that every operand's rows, leading dimension and batch
    /// stride stay inside its buffer.
    pub fn gemm_ex(&mut self, stream: &Stream, g: &GemmEx) -> Result<()> {
        let (m, n, k) = (g.m, g.n, g.k);
        if m == 0 || n == 0 || g.batch == 0 {
            return Ok(());
        }
        let stored_cols =
            |x: &Mat, rows: usize, cols: usize| if x.transposed { rows } else { cols };
        let bad = g.a.ty != g.b.ty
            || g.a.cuda().is_none()
            || g.c.cuda().is_none()
            || g.c.transposed
            || k == 0
            || g.a.ld < stored_cols(&g.a, m, k)
            || g.b.ld < stored_cols(&g.b, k, n)
            || g.c.ld < n
            || (g.c.ty != g.a.ty && g.c.ty != DType::F32)
            || g.a.span(m, k, g.batch) > g.a.len
            || g.b.span(k, n, g.batch) > g.b.len
            || g.c.span(m, n, g.batch) > g.c.len;
        if bad {
            return Err(CudaError::Invalid(format!(
                "gemm_ex: operands do not fit {} product(s) of {m}x{k} · {k}x{n}: {g:?}",
                g.batch
            )));
        }
        self.device.bind()?;
        let op = |t: bool| {
            if t {
                sys::cublasOperation_t::CUBLAS_OP_T
            } else {
                sys::cublasOperation_t::CUBLAS_OP_N
            }
        };
        let compute = if g.a.ty == DType::F32 && g.tf32 {
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32
        } else {
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F
        };
        let algo = sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT_TENSOR_OP;
        let (alpha, beta) = (g.alpha, g.beta);
        let [ni, mi, ki, ldb, lda, ldc, bi] = dims(
            "cublasGemmEx",
            [
                ("n", n),
                ("m", m),
                ("k", k),
                ("ldb", g.b.ld),
                ("lda", g.a.ld),
                ("ldc", g.c.ld),
                ("batch", g.batch),
            ],
        )?;
        // SAFETY: the handle is ours; every operand was checked to lie
        // inside its buffer; row-major C = A·B is column-major Cᵀ = Bᵀ·Aᵀ,
        // so the operands are swapped.
        unsafe {
            result::set_stream(self.handle, stream.raw() as _)
                .map_err(blas_err("cublasSetStream"))?;
            // Row-major C = A·B is column-major Cᵀ = Bᵀ·Aᵀ: swap the operands.
            let (pb, pa, pc) = (g.b.ptr as *const _, g.a.ptr as *const _, g.c.ptr as *mut _);
            if g.batch == 1 {
                result::gemm_ex(
                    self.handle,
                    op(g.b.transposed),
                    op(g.a.transposed),
                    ni,
                    mi,
                    ki,
                    &alpha as *const f32 as *const _,
                    pb,
                    g.b.cuda().expect("checked"),
                    ldb,
                    pa,
                    g.a.cuda().expect("checked"),
                    lda,
                    &beta as *const f32 as *const _,
                    pc,
                    g.c.cuda().expect("checked"),
                    ldc,
                    compute,
                    algo,
                )
                .map_err(blas_err("cublasGemmEx"))
            } else {
                result::gemm_strided_batched_ex(
                    self.handle,
                    op(g.b.transposed),
                    op(g.a.transposed),
                    ni,
                    mi,
                    ki,
                    &alpha as *const f32 as *const _,
                    pb,
                    g.b.cuda().expect("checked"),
                    ldb,
                    g.b.stride as i64,
                    pa,
                    g.a.cuda().expect("checked"),
                    lda,
                    g.a.stride as i64,
                    &beta as *const f32 as *const _,
                    pc,
                    g.c.cuda().expect("checked"),
                    ldc,
                    g.c.stride as i64,
                    bi,
                    compute,
                    algo,
                )
                .map_err(blas_err("cublasGemmStridedBatchedEx"))
            }
        }
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        if self.device.bind().is_ok() {
            // SAFETY: created in `new`, destroyed once.
            let _ = unsafe { result::destroy_handle(self.handle) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_of_rows_starts_rows_times_ld_elements_in() {
        let m = Mat {
            ptr: 0x1000,
            len: 8 * 6,
            ty: DType::BF16,
            ld: 6,
            transposed: false,
            stride: 0,
        };
        let r = m.rows(2..5).unwrap();
        assert_eq!((r.ptr, r.len, r.ld), (0x1000 + 2 * 6 * 2, 3 * 6, 6));
        assert!(m.rows(6..8).is_some());
        assert!(m.rows(6..9).is_none(), "past the storage");
        assert!(m.t().rows(0..1).is_none(), "transposed");
        assert!(m.batched(48).rows(0..1).is_none(), "batched");
    }
}
