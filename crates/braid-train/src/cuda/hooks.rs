//! The hook kernels' source ([`SOURCES`]), loaded ([`HookKernels`]) and
//! launched, each launch's buffers checked against its lengths first.

use braid_core::{DType, Element};
use braid_cuda::nvrtc::{Function, KernelArg, Module};
use braid_cuda::{CudaError, Device, DeviceMem, Result, Stream};

/// Every kernel source of this crate, as (name, CUDA C).
pub const SOURCES: [(&str, &str); 1] = [("braid_comm_hooks", include_str!("hooks.cu"))];

/// The kernels' code for a half type: 0 bf16, 1 fp16.
fn half_kind<H: Element>(what: &str) -> Result<i32> {
    match H::DTYPE {
        DType::BF16 => Ok(0),
        DType::F16 => Ok(1),
        other => Err(CudaError::Invalid(format!(
            "{what}: {other} is not a half-precision type"
        ))),
    }
}

/// The loaded hook kernels.
pub struct HookKernels {
    pack_half: Function,
    unpack_half: Function,
    add_into: Function,
    add_parts_into: Function,
    residual_error: Function,
    orthogonalize: Function,
    _module: Module,
}

const BLOCK: u32 = 256;

fn grid(n: usize) -> (u32, u32, u32) {
    // Grid-stride loops: enough blocks to fill the GPU, 64-bit indices.
    (n.div_ceil(BLOCK as usize).clamp(1, 4096) as u32, 1, 1)
}

fn same(what: &str, a: usize, b: usize) -> Result<()> {
    if a != b {
        return Err(CudaError::Invalid(format!(
            "{what}: {a} elements against {b}"
        )));
    }
    Ok(())
}

impl HookKernels {
    /// Compiles (through the cache) and loads the kernels on `device`.
    pub fn load(device: &Device) -> Result<HookKernels> {
        let module = Module::compile(device, SOURCES[0].0, SOURCES[0].1)?;
        let f = |n: &str| module.function(n);
        Ok(HookKernels {
            pack_half: f("pack_half")?,
            unpack_half: f("unpack_half")?,
            add_into: f("add_into")?,
            add_parts_into: f("add_parts_into")?,
            residual_error: f("residual_error")?,
            orthogonalize: f("orthogonalize")?,
            _module: module,
        })
    }

    fn go(f: &Function, s: &Stream, n: usize, mut args: Vec<KernelArg>) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        // SAFETY: each caller passes the kernel's parameters in order, with
        // buffer lengths checked against `n`.
        unsafe { f.launch_args(grid(n), (BLOCK, 1, 1), 0, s, &mut args) }
    }

    /// `out = half(x * scale)` (bf16 or fp16, by `H`).
    pub fn pack<H: Element>(
        &self,
        s: &Stream,
        out: &mut impl DeviceMem<H>,
        x: &impl DeviceMem<f32>,
        scale: f32,
    ) -> Result<()> {
        let kind = half_kind::<H>("pack_half")?;
        same("pack_half", out.dlen(), x.dlen())?;
        let n = x.dlen();
        Self::go(
            &self.pack_half,
            s,
            n,
            vec![
                KernelArg::Ptr(out.dptr()),
                KernelArg::Ptr(x.dptr()),
                KernelArg::I64(n as i64),
                KernelArg::F32(scale),
                KernelArg::I32(kind),
            ],
        )
    }

    /// `x = float(h) * scale`.
    pub fn unpack<H: Element>(
        &self,
        s: &Stream,
        x: &mut impl DeviceMem<f32>,
        h: &impl DeviceMem<H>,
        scale: f32,
    ) -> Result<()> {
        let kind = half_kind::<H>("unpack_half")?;
        same("unpack_half", x.dlen(), h.dlen())?;
        let n = x.dlen();
        Self::go(
            &self.unpack_half,
            s,
            n,
            vec![
                KernelArg::Ptr(x.dptr()),
                KernelArg::Ptr(h.dptr()),
                KernelArg::I64(n as i64),
                KernelArg::F32(scale),
                KernelArg::I32(kind),
            ],
        )
    }

    /// `x += y`.
    pub fn add_into(
        &self,
        s: &Stream,
        x: &mut impl DeviceMem<f32>,
        y: &impl DeviceMem<f32>,
    ) -> Result<()> {
        same("add_into", x.dlen(), y.dlen())?;
        let n = x.dlen();
        Self::go(
            &self.add_into,
            s,
            n,
            vec![
                KernelArg::Ptr(x.dptr()),
                KernelArg::Ptr(y.dptr()),
                KernelArg::I64(n as i64),
            ],
        )
    }

    /// `x += y[0] + y[1] + …`: `parts` spans of `x`'s length in `y`, the
    /// `k`-th from element `k · stride`, added to `x` one after another in
    /// that order (bit for bit `parts` calls of
    /// [`add_into`](Self::add_into), in one pass over memory).
    pub fn add_parts_into(
        &self,
        s: &Stream,
        x: &mut impl DeviceMem<f32>,
        y: &impl DeviceMem<f32>,
        stride: usize,
        parts: usize,
    ) -> Result<()> {
        let n = x.dlen();
        if parts == 0 {
            return Ok(());
        }
        if stride < n || (parts - 1) * stride + n > y.dlen() {
            return Err(CudaError::Invalid(format!(
                "add_parts_into: {parts} parts of {n} elements {stride} apart do not fit {} \
                 elements",
                y.dlen()
            )));
        }
        let parts = i32::try_from(parts)
            .map_err(|_| CudaError::Invalid(format!("add_parts_into: {parts} parts")))?;
        Self::go(
            &self.add_parts_into,
            s,
            n,
            vec![
                KernelArg::Ptr(x.dptr()),
                KernelArg::Ptr(y.dptr()),
                KernelArg::I64(n as i64),
                KernelArg::I64(stride as i64),
                KernelArg::I32(parts),
            ],
        )
    }

    /// `e = before - x * scale`.
    pub fn residual_error(
        &self,
        s: &Stream,
        e: &mut impl DeviceMem<f32>,
        before: &impl DeviceMem<f32>,
        x: &impl DeviceMem<f32>,
        scale: f32,
    ) -> Result<()> {
        same("residual_error", e.dlen(), before.dlen())?;
        same("residual_error", e.dlen(), x.dlen())?;
        let n = e.dlen();
        Self::go(
            &self.residual_error,
            s,
            n,
            vec![
                KernelArg::Ptr(e.dptr()),
                KernelArg::Ptr(before.dptr()),
                KernelArg::Ptr(x.dptr()),
                KernelArg::I64(n as i64),
                KernelArg::F32(scale),
            ],
        )
    }

    /// Orthonormalises the columns of the row-major `rows × cols` matrix
    /// `m` in place (Gram-Schmidt; `eps` keeps a zero column finite).
    pub fn orthogonalize(
        &self,
        s: &Stream,
        m: &mut impl DeviceMem<f32>,
        rows: usize,
        cols: usize,
        eps: f32,
    ) -> Result<()> {
        same("orthogonalize", m.dlen(), rows * cols)?;
        if rows == 0 || cols == 0 {
            return Ok(());
        }
        let mut args = vec![
            KernelArg::Ptr(m.dptr()),
            KernelArg::I64(rows as i64),
            KernelArg::I32(cols as i32),
            KernelArg::F32(eps),
        ];
        // SAFETY: parameters in order; `m` holds rows × cols elements.
        unsafe {
            self.orthogonalize
                .launch_args((1, 1, 1), (1024, 1, 1), 0, s, &mut args)
        }
    }
}
