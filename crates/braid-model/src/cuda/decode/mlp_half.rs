//! A layer's MLP half gathered for one kernel (`MixedKernels::nt_mlp`,
//! `BRAID_DECODE_MLP_KERNEL`): the decode forward pass's operations come
//! one at a time in the block's order; from the attention's projection on,
//! the five of the MLP half are held back while each reads the one before,
//! then run as one kernel, or as they came where it does not apply.

use super::forward::GpuDecodeForward;
use crate::block::{Linear, Op};
use crate::cuda::mixed::{NtMlp, SKINNY_ROWS};
use braid_core::Element;
use braid_cuda::{DeviceMem, Result};
use std::ops::Range;

/// A buffer as the few-rows kernels take it: (device address, elements).
fn span<T: Element>(b: &impl DeviceMem<T>) -> (u64, usize) {
    (b.dptr(), b.dlen())
}

/// The operations of a layer's MLP half ([`GpuDecodeForward::offer_or_run`]).
const MLP_OPS: usize = 5;

/// Whether `op` comes next in a layer's MLP half after `got`: the
/// attention's projection (with the residual), a LayerNorm of its output,
/// the MLP's first product of that, the GELU of that, and the second
/// product of that with the projection's output as its residual.
fn mlp_follows(got: &[Op], op: Op) -> bool {
    let out_of = |i: usize| match got[i] {
        Op::Row { out, .. } | Op::Norm { out, .. } | Op::Column { out, .. } => out,
        Op::Gelu { out, .. } | Op::Attention { out, .. } => out,
    };
    match (got.len(), op) {
        (0, Op::Row { linear, .. }) => linear == Linear::Proj,
        (1, Op::Norm { input, .. }) => input == out_of(0),
        (2, Op::Column { linear, input, .. }) => linear == Linear::Fc && input == out_of(1),
        (3, Op::Gelu { input, .. }) => input == out_of(2),
        (
            4,
            Op::Row {
                linear,
                input,
                residual,
                ..
            },
        ) => linear == Linear::FcProj && input == out_of(3) && residual == out_of(0),
        _ => false,
    }
}

impl GpuDecodeForward<'_> {
    /// `op` gathered into the layer's MLP half where the one-kernel MLP
    /// is on and it comes next in the half's order (projection, LayerNorm,
    /// first product, GELU, second product, each reading the one before);
    /// else what was gathered runs as it came, then `op`.
    pub(super) fn offer_or_run(&mut self, op: Op) -> Result<()> {
        if !self.mlp_kernel_on() {
            return self.run_op(op);
        }
        if !mlp_follows(&self.mlp, op) {
            self.flush_mlp()?;
            if !mlp_follows(&self.mlp, op) {
                return self.run_op(op);
            }
        }
        self.mlp.push(op);
        if self.mlp.len() == MLP_OPS && !self.run_mlp()? {
            self.flush_mlp()?;
        }
        Ok(())
    }

    /// Whether the one-kernel MLP may run this step: bf16 NT products with
    /// the GELU in the first product, its counters, at most a few rows.
    fn mlp_kernel_on(&self) -> bool {
        self.n <= SKINNY_ROWS
            && self
                .half
                .as_ref()
                .is_some_and(|h| h.nt && h.mlp_barrier.is_some() && *h.gelu_fused)
    }

    /// Runs what was gathered of the MLP half as it came.
    fn flush_mlp(&mut self) -> Result<()> {
        for op in std::mem::take(&mut self.mlp) {
            self.run_op(op)?;
        }
        Ok(())
    }

    /// After the block: anything still put off or gathered runs; whether
    /// the layer's last product also wrote the next layer's first
    /// LayerNorm ([`GpuDecodeForward::flush_row`]).
    pub(super) fn finish(&mut self) -> Result<bool> {
        self.flush_mlp()?;
        self.flush_norm()?;
        self.flush_row()
    }

    /// The gathered MLP half as one kernel; false, launching nothing,
    /// where it does not apply (the caller runs the operations instead).
    fn run_mlp(&mut self) -> Result<bool> {
        let [Op::Row {
            linear: Linear::Proj,
            input: att,
            residual: x,
            out: x2,
        }, Op::Norm { norm, .. }, _, Op::Gelu { out: g, .. }, Op::Row {
            linear: Linear::FcProj,
            out,
            ..
        }] = self.mlp[..]
        else {
            return Ok(false);
        };
        self.flush_norm()?;
        let (c, f, n) = (self.w.c, self.w.mlp, self.n);
        if self.w.attn != c {
            return Ok(false);
        }
        let Some(h) = &self.half else {
            return Ok(false);
        };
        let Some(barrier) = h.mlp_barrier else {
            return Ok(false);
        };
        let param = |r: Range<usize>| span(&self.p.view(r));
        let weight = |r: Range<usize>| span(&h.wb.view(r));
        let ((wp, bp), (wf, bf), (wo, bo)) = (
            self.r.linear(Linear::Proj),
            self.r.linear(Linear::Fc),
            self.r.linear(Linear::FcProj),
        );
        let (lw, lb) = self.r.norm(norm);
        let mlp = NtMlp {
            x2: span(&self.t[x2.index()]),
            h: span(&h.tb[g.index()]),
            out: span(&self.t[out.index()]),
            att: span(&h.tb[att.index()]),
            x: span(&self.t[x.index()]),
            wp: weight(wp),
            bp: param(bp),
            lw: param(lw),
            lb: param(lb),
            wf: weight(wf),
            bf: param(bf),
            wo: weight(wo),
            bo: param(bo),
        };
        if !h.mk.nt_mlp(self.s, &mlp, barrier, (n, c, f))? {
            return Ok(false);
        }
        self.mlp.clear();
        self.prof.mark(self.s, "mlp kernel")?;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::{mlp_follows, MLP_OPS};
    use crate::block::{Act, Linear, Op, BLOCK};

    /// In the block's order the MLP half is its last five operations,
    /// taken one after another from its projection on, and nothing before
    /// the projection starts it.
    #[test]
    fn the_mlp_half_is_the_blocks_last_five_operations() {
        let start = BLOCK.len() - MLP_OPS;
        let mut got: Vec<Op> = Vec::new();
        for (i, &op) in BLOCK.iter().enumerate() {
            assert_eq!(mlp_follows(&got, op), i >= start, "{i}: {op:?}");
            if i >= start {
                got.push(op);
            }
        }
        assert_eq!(got.len(), MLP_OPS);
        // A second product whose residual is not the projection's output,
        // or a GELU of something else, breaks the half.
        let wrong_residual = Op::Row {
            linear: Linear::FcProj,
            input: Act::Gelu,
            residual: Act::X,
            out: Act::Out,
        };
        assert!(!mlp_follows(&got[..4], wrong_residual));
        let wrong_gelu = Op::Gelu {
            input: Act::Ln2,
            out: Act::Gelu,
        };
        assert!(!mlp_follows(&got[..3], wrong_gelu));
    }
}
