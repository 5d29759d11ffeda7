//! Matrix products on the GPU through cuBLAS (loaded at run time), in the
//! same row-major terms as the CPU engine's `gemm_rm`.

use crate::driver::{Device, Stream};
use crate::error::{CudaError, Result};
use crate::memory::DeviceMem;
use cudarc::cublas::{result, sys};

/// A cuBLAS handle bound to one device.
pub struct Blas {
    handle: sys::cublasHandle_t,
    device: Device,
}

// SAFETY: a cuBLAS handle may be used from any thread, one call at a time
// (braid serialises calls per handle through `&mut self`/ownership).
unsafe impl Send for Blas {}

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
                n as i32,
                m as i32,
                k.max(1) as i32,
                &alpha,
                b.dptr() as *const f32,
                ldb.max(1) as i32,
                a.dptr() as *const f32,
                lda.max(1) as i32,
                &beta,
                dst.dptr() as *mut f32,
                n as i32,
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
        // SAFETY: as in `gemm_rm`; every batch entry was checked to lie
        // inside its buffer.
        unsafe {
            result::set_stream(self.handle, stream.raw() as _)
                .map_err(blas_err("cublasSetStream"))?;
            result::sgemm_strided_batched(
                self.handle,
                op_b,
                op_a,
                n as i32,
                m as i32,
                k.max(1) as i32,
                &alpha,
                (b.buf.dptr() + (b.offset * 4) as u64) as *const f32,
                ldb.max(1) as i32,
                b.stride as i64,
                (a.buf.dptr() + (a.offset * 4) as u64) as *const f32,
                lda.max(1) as i32,
                a.stride as i64,
                &beta,
                dst.dptr() as *mut f32,
                n as i32,
                dst_stride as i64,
                batch as i32,
            )
            .map_err(blas_err("cublasSgemmStridedBatched"))
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
