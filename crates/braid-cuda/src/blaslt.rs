//! Matrix products with fused epilogues through cuBLASLt (loaded at run
//! time), in the same row-major terms as [`crate::blas::Blas::gemm_ex`]:
//! `d[m,n] = alpha · a[m,k] · b[k,n] + beta · c`, bf16 or f32 operands,
//! f32 accumulation, then one of the [`Epilogue`]s: a bias broadcast over
//! rows, bias + GELU (tanh form) keeping the pre-activation, or the GELU
//! backward with the bias gradient. `c` may be a different buffer from `d`
//! (a residual input), which saves the pass that would otherwise copy it.
//!
//! Each distinct shape gets a plan (descriptors and the algorithm cuBLASLt's
//! heuristic picks, given the operands' actual alignment), made on first
//! use and kept.

use crate::blas::Mat;
use crate::driver::{Device, Stream};
use crate::error::{CudaError, Result};
use crate::memory::{DeviceBuffer, DeviceMem};
use braid_core::DType;
use cudarc::cublaslt::{result, sys};
use std::collections::HashMap;
use std::ffi::c_void;

/// Workspace handed to cuBLASLt for split-k and similar algorithms.
const WORKSPACE: usize = 32 << 20;

/// What happens to the product before it is stored. Vectors are
/// `(device address, elements)`; `aux` is a matrix of `d`'s type and
/// shape with `aux_ld` elements per row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Epilogue {
    /// `d = product + bias[n]` (bias of `d`'s type).
    Bias { bias: (u64, usize) },
    /// `aux = product + bias[n]`, `d = gelu(aux)` (bias of `d`'s type).
    GeluAuxBias {
        bias: (u64, usize),
        aux: (u64, usize),
        aux_ld: usize,
    },
    /// `d = product · gelu'(aux)`, and `bgrad[n]` (of `d`'s type) = the
    /// column sums of `d` (overwritten). Correct, but on an H200 with
    /// cuBLAS 13 it ran 2.4× slower than the plain product plus separate
    /// GELU-backward and bias-gradient passes, so the GPT engine does not
    /// use it.
    DGeluBGrad {
        aux: (u64, usize),
        aux_ld: usize,
        bgrad: (u64, usize),
    },
}

impl Epilogue {
    /// 0, 1, 2 for `Bias`, `GeluAuxBias`, `DGeluBGrad`.
    pub fn kind(&self) -> u8 {
        match self {
            Epilogue::Bias { .. } => 0,
            Epilogue::GeluAuxBias { .. } => 1,
            Epilogue::DGeluBGrad { .. } => 2,
        }
    }

    fn aux_ld(&self) -> usize {
        match *self {
            Epilogue::Bias { .. } => 0,
            Epilogue::GeluAuxBias { aux_ld, .. } | Epilogue::DGeluBGrad { aux_ld, .. } => aux_ld,
        }
    }
}

/// One fused product; see the module docs.
#[derive(Debug, Clone, Copy)]
pub struct LtGemm {
    /// Rows of the result.
    pub m: usize,
    /// Columns of the result.
    pub n: usize,
    /// The shared dimension.
    pub k: usize,
    /// `[m,k]` (stored `[k,m]` when transposed).
    pub a: Mat,
    /// `[k,n]` (stored `[n,k]` when transposed); same type as `a`.
    pub b: Mat,
    /// The addend scaled by `beta` (same type and shape as `d`).
    pub c: Mat,
    /// The result.
    pub d: Mat,
    /// What is applied before storing.
    pub epilogue: Epilogue,
    pub alpha: f32,
    pub beta: f32,
}

#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct Key {
    mnk: (usize, usize, usize),
    ab: (DType, bool, bool, usize, usize),
    cd: (DType, usize, usize),
    epilogue: (u8, usize),
    align: [u32; 5],
}

/// Descriptors and algorithm for one shape.
struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    layouts: [sys::cublasLtMatrixLayout_t; 4],
    algo: sys::cublasLtMatmulAlgo_t,
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: created in `BlasLt::plan`, destroyed once.
        unsafe {
            let _ = result::destroy_matmul_desc(self.desc);
            for l in self.layouts {
                let _ = result::destroy_matrix_layout(l);
            }
        }
    }
}

/// A cuBLASLt handle bound to one device, with its workspace and plans.
pub struct BlasLt {
    handle: sys::cublasLtHandle_t,
    device: Device,
    workspace: DeviceBuffer<u8>,
    plans: HashMap<Key, Plan>,
}

// SAFETY: the handle may be used from any thread, one call at a time
// (`&mut self`).
unsafe impl Send for BlasLt {}

fn lt_err(call: &'static str) -> impl FnOnce(result::CublasError) -> CudaError {
    move |e| CudaError::Driver {
        call,
        name: format!("{:?}", e.0),
        text: String::new(),
    }
}

fn lt_type(t: DType) -> Option<sys::cudaDataType> {
    match t {
        DType::F32 => Some(sys::cudaDataType::CUDA_R_32F),
        DType::BF16 => Some(sys::cudaDataType::CUDA_R_16BF),
        _ => None,
    }
}

/// The largest power of two (up to 256) dividing `ptr`.
fn alignment(ptr: u64) -> u32 {
    if ptr == 0 {
        256
    } else {
        1u32 << ptr.trailing_zeros().min(8)
    }
}

/// cuBLAS's `CUBLAS_OP_T` / `CUBLAS_OP_N`, as the descriptor stores them.
fn op(t: bool) -> i32 {
    if t {
        1
    } else {
        0
    }
}

impl BlasLt {
    /// A handle on `device`, or why cuBLASLt cannot be used.
    pub fn new(device: &Device) -> Result<BlasLt> {
        // SAFETY: only probes whether the library can be opened.
        if !unsafe { sys::is_culib_present() } {
            return Err(CudaError::Unavailable(
                "fused-bias products are unavailable: libcublasLt.so.13 was not found".into(),
            ));
        }
        device.bind()?;
        let handle = result::create_handle().map_err(lt_err("cublasLtCreate"))?;
        Ok(BlasLt {
            handle,
            device: device.clone(),
            workspace: DeviceBuffer::zeros(device, WORKSPACE)?,
            plans: HashMap::new(),
        })
    }

    fn key(g: &LtGemm) -> Key {
        Key {
            mnk: (g.m, g.n, g.k),
            ab: (g.a.ty, g.a.transposed, g.b.transposed, g.a.ld, g.b.ld),
            cd: (g.d.ty, g.c.ld, g.d.ld),
            epilogue: (g.epilogue.kind(), g.epilogue.aux_ld()),
            align: [
                alignment(g.b.ptr),
                alignment(g.a.ptr),
                alignment(g.c.ptr),
                alignment(g.d.ptr),
                match g.epilogue {
                    Epilogue::Bias { .. } => 256,
                    Epilogue::GeluAuxBias { aux, .. } | Epilogue::DGeluBGrad { aux, .. } => {
                        alignment(aux.0)
                    }
                },
            ],
        }
    }

    fn check(g: &LtGemm) -> Result<()> {
        let (m, n, k) = (g.m, g.n, g.k);
        let stored_cols = |x: &Mat, rows, cols| if x.transposed { rows } else { cols };
        let bad = m == 0
            || n == 0
            || k == 0
            || g.a.ty != g.b.ty
            || lt_type(g.a.ty).is_none()
            || lt_type(g.d.ty).is_none()
            || g.c.ty != g.d.ty
            || g.c.transposed
            || g.d.transposed
            || g.a.ld < stored_cols(&g.a, m, k)
            || g.b.ld < stored_cols(&g.b, k, n)
            || g.c.ld < n
            || g.d.ld < n
            || g.a.span(m, k, 1) > g.a.len
            || g.b.span(k, n, 1) > g.b.len
            || g.c.span(m, n, 1) > g.c.len
            || g.d.span(m, n, 1) > g.d.len
            || match g.epilogue {
                Epilogue::Bias { bias } => bias.1 < n,
                Epilogue::GeluAuxBias { bias, aux, aux_ld } => {
                    bias.1 < n || aux_ld < n || (m - 1) * aux_ld + n > aux.1
                }
                Epilogue::DGeluBGrad { aux, aux_ld, bgrad } => {
                    bgrad.1 < n || aux_ld < n || (m - 1) * aux_ld + n > aux.1
                }
            };
        if bad {
            return Err(CudaError::Invalid(format!(
                "lt gemm: operands do not fit a product of {m}x{k} · {k}x{n}: {g:?}"
            )));
        }
        Ok(())
    }

    /// Builds (or finds) the plan for `g`; errors when cuBLASLt has no
    /// algorithm for it (callers may then fall back to plain products).
    fn plan(&mut self, g: &LtGemm) -> Result<&Plan> {
        let key = Self::key(g);
        if self.plans.contains_key(&key) {
            return Ok(&self.plans[&key]);
        }
        let ab = lt_type(g.a.ty).expect("checked");
        let cd = lt_type(g.d.ty).expect("checked");
        // Row-major D = A·B is column-major Dᵀ = Bᵀ·Aᵀ: cuBLASLt's A is
        // our b, its B our a, and its m, n are our n, m.
        let (lm, ln) = (g.n as u64, g.m as u64);
        let k = g.k as u64;
        let stored = |t: bool, rows: u64, cols: u64| if t { (cols, rows) } else { (rows, cols) };
        let (ar, ac) = stored(g.b.transposed, lm, k);
        let (br, bc) = stored(g.a.transposed, k, ln);
        let mk = |ty, r, c, ld: usize| {
            result::create_matrix_layout(ty, r, c, ld as i64)
                .map_err(lt_err("cublasLtMatrixLayoutCreate"))
        };
        let layouts = [
            mk(ab, ar, ac, g.b.ld)?,
            mk(ab, br, bc, g.a.ld)?,
            mk(cd, lm, ln, g.c.ld)?,
            mk(cd, lm, ln, g.d.ld)?,
        ];
        let desc = result::create_matmul_desc(
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cudaDataType::CUDA_R_32F,
        )
        .map_err(lt_err("cublasLtMatmulDescCreate"))?;
        // The plan owns the descriptors from here on (freed on drop,
        // including on the error paths below).
        let mut plan = Plan {
            desc,
            layouts,
            // SAFETY: plain-old-data, overwritten by the heuristic below.
            algo: unsafe { std::mem::zeroed() },
        };
        let set = |attr, v: *const c_void, size| {
            // SAFETY: `desc` is live; `v` points at `size` readable bytes.
            unsafe { result::set_matmul_desc_attribute(desc, attr, v, size) }
                .map_err(lt_err("cublasLtMatmulDescSetAttribute"))
        };
        use sys::cublasLtMatmulDescAttributes_t as D;
        let (ta, tb) = (op(g.b.transposed), op(g.a.transposed));
        set(D::CUBLASLT_MATMUL_DESC_TRANSA, &ta as *const _ as _, 4)?;
        set(D::CUBLASLT_MATMUL_DESC_TRANSB, &tb as *const _ as _, 4)?;
        use sys::cublasLtEpilogue_t as E;
        let epilogue = match g.epilogue {
            Epilogue::Bias { .. } => E::CUBLASLT_EPILOGUE_BIAS,
            Epilogue::GeluAuxBias { .. } => E::CUBLASLT_EPILOGUE_GELU_AUX_BIAS,
            Epilogue::DGeluBGrad { .. } => E::CUBLASLT_EPILOGUE_DGELU_BGRAD,
        };
        set(
            D::CUBLASLT_MATMUL_DESC_EPILOGUE,
            &epilogue as *const _ as _,
            4,
        )?;
        if let Epilogue::GeluAuxBias { aux_ld, .. } | Epilogue::DGeluBGrad { aux_ld, .. } =
            g.epilogue
        {
            let ld = aux_ld as i64;
            set(
                D::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD,
                &ld as *const _ as _,
                8,
            )?;
        }
        let pref =
            result::create_matmul_pref().map_err(lt_err("cublasLtMatmulPreferenceCreate"))?;
        let picked = (|| {
            use sys::cublasLtMatmulPreferenceAttributes_t as P;
            let setp = |attr, v: *const c_void, size| {
                // SAFETY: `pref` is live; `v` points at `size` readable bytes.
                unsafe { result::set_matmul_pref_attribute(pref, attr, v, size) }
                    .map_err(lt_err("cublasLtMatmulPreferenceSetAttribute"))
            };
            let ws = WORKSPACE as u64;
            setp(
                P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &ws as *const _ as _,
                8,
            )?;
            let attrs = [
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
            ];
            for (attr, a) in attrs.into_iter().zip(key.align) {
                setp(attr, &a as *const u32 as _, 4)?;
            }
            // SAFETY: every descriptor is live.
            unsafe {
                result::get_matmul_algo_heuristic(
                    self.handle,
                    desc,
                    layouts[0],
                    layouts[1],
                    layouts[2],
                    layouts[3],
                    pref,
                )
            }
            .map_err(lt_err("cublasLtMatmulAlgoGetHeuristic"))
        })();
        // SAFETY: created above, destroyed once.
        let _ = unsafe { result::destroy_matmul_pref(pref) };
        let picked = picked?;
        if picked.workspaceSize > WORKSPACE {
            return Err(CudaError::Invalid(format!(
                "lt gemm: the picked algorithm wants {} bytes of workspace",
                picked.workspaceSize
            )));
        }
        plan.algo = picked.algo;
        Ok(self.plans.entry(key).or_insert(plan))
    }

    /// Runs `g` on `stream` (see [`LtGemm`]).
    pub fn gemm(&mut self, stream: &Stream, g: &LtGemm) -> Result<()> {
        Self::check(g)?;
        self.device.bind()?;
        let (handle, ws, ws_len) = (self.handle, self.workspace.dptr(), self.workspace.dlen());
        let plan = self.plan(g)?;
        let (bias, aux) = match g.epilogue {
            Epilogue::Bias { bias } => (bias.0, None),
            Epilogue::GeluAuxBias { bias, aux, .. } => (bias.0, Some(aux.0)),
            Epilogue::DGeluBGrad { aux, bgrad, .. } => (bgrad.0, Some(aux.0)),
        };
        use sys::cublasLtMatmulDescAttributes_t as D;
        for (attr, ptr) in [
            (D::CUBLASLT_MATMUL_DESC_BIAS_POINTER, Some(bias)),
            (D::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, aux),
        ] {
            let Some(ptr) = ptr else { continue };
            // SAFETY: the descriptor is live; the pointer value is copied.
            unsafe {
                result::set_matmul_desc_attribute(plan.desc, attr, &ptr as *const u64 as _, 8)
            }
            .map_err(lt_err("cublasLtMatmulDescSetAttribute"))?;
        }
        let (alpha, beta) = (g.alpha, g.beta);
        // SAFETY: every operand was checked to lie inside its buffer and
        // matches the plan's layouts (the plan key holds every dimension,
        // leading dimension, type and alignment); the workspace is ours.
        unsafe {
            result::matmul(
                handle,
                plan.desc,
                &alpha as *const f32 as _,
                &beta as *const f32 as _,
                g.b.ptr as *const c_void,
                plan.layouts[0],
                g.a.ptr as *const c_void,
                plan.layouts[1],
                g.c.ptr as *const c_void,
                plan.layouts[2],
                g.d.ptr as *mut c_void,
                plan.layouts[3],
                &plan.algo,
                ws as *mut c_void,
                ws_len,
                stream.raw() as _,
            )
        }
        .map_err(lt_err("cublasLtMatmul"))
    }
}

impl Drop for BlasLt {
    fn drop(&mut self) {
        self.plans.clear();
        if self.device.bind().is_ok() {
            // SAFETY: created in `new`, destroyed once.
            let _ = unsafe { result::destroy_handle(self.handle) };
        }
    }
}
