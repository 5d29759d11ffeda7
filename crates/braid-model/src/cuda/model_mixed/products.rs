//! The bf16 matrix products: [`mm`] through cuBLAS, and a [`Product`]
//! run plain or with a fused epilogue (cuBLASLt), its bias given as a
//! [`span`].

use super::fp8_products::Fp8Products;
use super::state::FusedProducts;
use braid_cuda::blas::{Blas, GemmEx, Mat};
use braid_cuda::blaslt::{Epilogue, LtGemm};
use braid_cuda::{CudaError, DeviceMem, Result, Stream};

/// Row-major `c[m,n] = a · b + beta · c` through cuBLAS.
#[allow(clippy::too_many_arguments)]
pub(super) fn mm(
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
pub(super) struct Product {
    pub(super) m: usize,
    pub(super) n: usize,
    pub(super) k: usize,
    pub(super) a: Mat,
    pub(super) b: Mat,
}

impl Product {
    /// `c = a · b + beta · c` through cuBLAS.
    pub(super) fn plain(self, blas: &mut Blas, s: &Stream, c: Mat, beta: f32) -> Result<()> {
        mm(blas, s, self.m, self.n, self.k, self.a, self.b, c, beta)
    }

    /// `d = a · b (+ residual)` with `epilogue` in one cuBLASLt product
    /// (the residual may be another buffer than `d`). `false`, with
    /// nothing run, when there is no cuBLASLt or it has no algorithm for
    /// this epilogue here (the epilogue is then switched off with a note):
    /// the caller takes the unfused route.
    pub(super) fn fused(
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
        if let Some(fp8) = fused
            .fp8
            .as_mut()
            .filter(|f| !f.off[Fp8Products::slot(&epilogue, &d)] && Fp8Products::takes(&self))
        {
            match fp8.run(&mut fused.lt, s, &self, residual, d, epilogue) {
                Ok(()) => return Ok(true),
                Err(e) if !cublaslt_declined(&e) => return Err(e),
                Err(e) => {
                    eprintln!(
                        "note: cuBLASLt has no FP8 product for {} here ({e}); those run in bf16",
                        epilogue.name()
                    );
                    fp8.off[Fp8Products::slot(&epilogue, &d)] = true;
                }
            }
        }
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
            // Only cuBLASLt declining the epilogue sends it to a separate
            // pass; any other error is the run's.
            Err(e) if !cublaslt_declined(&e) => Err(e),
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

/// Address and length of a device vector (a bias for [`Product::fused`]).
pub(super) fn span<T: braid_core::Element>(v: &impl DeviceMem<T>) -> (u64, usize) {
    (v.dptr(), v.dlen())
}

/// Whether `e` is cuBLASLt declining a fused or FP8 product here (no
/// algorithm for the shape or epilogue, or no cuBLASLt at all), which
/// sends that product to the plain route (a separate pass, or bf16).
/// Anything else (a kernel that failed to launch, memory running out,
/// wrong sizes) is a real error and is returned, not hidden behind a
/// fallback.
pub(super) fn cublaslt_declined(e: &CudaError) -> bool {
    match e {
        CudaError::Unavailable(_) => true,
        CudaError::Driver { call, .. } => call.starts_with("cublasLt"),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_cublaslt_declining_sends_a_product_to_the_plain_route() {
        let driver = |call| CudaError::Driver {
            call,
            name: "x".into(),
            text: String::new(),
        };
        assert!(cublaslt_declined(&driver("cublasLtMatmulAlgoGetHeuristic")));
        assert!(cublaslt_declined(&driver("cublasLtMatmul")));
        assert!(cublaslt_declined(&CudaError::Unavailable("no lib".into())));
        // A cast kernel that failed to launch is an error, not a fallback
        // (the first FP8 runs on a GPU hid exactly that).
        assert!(!cublaslt_declined(&driver("cuLaunchKernel")));
        assert!(!cublaslt_declined(&driver("cuMemAlloc")));
        assert!(!cublaslt_declined(&CudaError::Invalid("sizes".into())));
    }
}
