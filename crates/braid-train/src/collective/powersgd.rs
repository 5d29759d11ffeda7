//! PowerSGD gradient compression (Vogels, Karimireddy and Jaggi, 2019),
//! as PyTorch's `powerSGD_hook` does it, written once over [`MatOps`]
//! (host slices, or device views on the GPU's communication stream).
//!
//! Per bucket, after `start_iter` plain steps: add the previous step's
//! error (error feedback) and keep a copy; all-reduce the small
//! parameters as they are; for each matrix `M` (`n × m`) worth
//! compressing (`(n + m)·r · min_compression_rate < n·m`): `P = M Q`
//! (`Q` from the previous step, orthogonalised: warm start; random the
//! first time, the same on every rank), all-reduce the `P`s, orthogonalise
//! them, `Q = Mᵀ P`, all-reduce the `Q`s, `M = P Qᵀ`. Unlike PyTorch's hook
//! the result is the *sum* over ranks (the training loop divides once);
//! the error kept for the next step is `before − result / ranks`, over the
//! whole bucket, as PyTorch keeps it.

use super::core::Bucket;
use super::wire::ring_wire_bytes;
use crate::strategy::CommStep;
use crate::Result;
use braid_model::rng::Rng;
use std::ops::Range;

/// PowerSGD's settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PowerSgdOptions {
    /// Rank of the approximation (PyTorch's `matrix_approximation_rank`).
    pub rank: usize,
    /// Plain all-reduce for this many steps first (`start_powerSGD_iter`).
    pub start_iter: usize,
    /// Compress a matrix only if that shrinks it at least this much.
    pub min_compression_rate: f64,
    /// Added to column norms when orthogonalising (PyTorch's default is
    /// 0, which turns a vanishing column into NaNs; this keeps it finite).
    pub eps: f32,
    /// Seed of the first `Q`s (the same on every rank).
    pub seed: u64,
}

impl Default for PowerSgdOptions {
    /// PyTorch's defaults: rank 1, PowerSGD from step 1000, minimum
    /// compression rate 2.
    fn default() -> Self {
        PowerSgdOptions {
            rank: 1,
            start_iter: 1000,
            min_compression_rate: 2.0,
            eps: 1e-8,
            seed: 0,
        }
    }
}

/// The few operations PowerSGD needs, on one memory space. Offsets are in
/// elements; matrices are row-major; `g` is one bucket's gradients.
pub(crate) trait MatOps {
    /// An owned f32 buffer.
    type Buf;
    /// A bucket's gradients.
    type Grad;
    /// `n` zeros.
    fn alloc(&mut self, n: usize) -> Result<Self::Buf>;
    /// `g += e`.
    fn add_into(&mut self, g: &mut Self::Grad, e: &Self::Buf) -> Result<()>;
    /// `dst = g`.
    fn copy_from(&mut self, dst: &mut Self::Buf, g: &Self::Grad) -> Result<()>;
    /// Sum-all-reduce of `g[span]`.
    fn reduce_span(&mut self, g: &mut Self::Grad, span: Range<usize>) -> Result<()>;
    /// `dst[off..off + values.len()] = values`.
    fn set(&mut self, dst: &mut Self::Buf, off: usize, values: &[f32]) -> Result<()>;
    /// Orthonormalises the columns of the `rows × cols` matrix at `off`.
    fn orthogonalize(
        &mut self,
        m: &mut Self::Buf,
        off: usize,
        rows: usize,
        cols: usize,
        eps: f32,
    ) -> Result<()>;
    /// `p = M q` for the `n × m` matrix `M` at `g[mo..]`, `q`: `m × r`.
    #[allow(clippy::too_many_arguments)]
    fn m_q(
        &mut self,
        p: &mut Self::Buf,
        po: usize,
        g: &Self::Grad,
        mo: usize,
        q: &Self::Buf,
        qo: usize,
        n: usize,
        m: usize,
        r: usize,
    ) -> Result<()>;
    /// `q = Mᵀ p`.
    #[allow(clippy::too_many_arguments)]
    fn mt_p(
        &mut self,
        q: &mut Self::Buf,
        qo: usize,
        g: &Self::Grad,
        mo: usize,
        p: &Self::Buf,
        po: usize,
        n: usize,
        m: usize,
        r: usize,
    ) -> Result<()>;
    /// `M = p qᵀ`.
    #[allow(clippy::too_many_arguments)]
    fn p_qt(
        &mut self,
        g: &mut Self::Grad,
        mo: usize,
        p: &Self::Buf,
        po: usize,
        q: &Self::Buf,
        qo: usize,
        n: usize,
        m: usize,
        r: usize,
    ) -> Result<()>;
    /// Sum-all-reduce of the whole of `b`.
    fn all_reduce(&mut self, b: &mut Self::Buf) -> Result<()>;
    /// `e = before − g · scale`.
    fn residual(
        &mut self,
        e: &mut Self::Buf,
        before: &Self::Buf,
        g: &Self::Grad,
        scale: f32,
    ) -> Result<()>;
}

/// One compressed matrix of a bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Compressed {
    /// First element, relative to the bucket.
    off: usize,
    rows: usize,
    cols: usize,
    rank: usize,
    /// Where its `P` (`rows × rank`) and `Q` (`cols × rank`) start.
    p_off: usize,
    q_off: usize,
}

/// How one bucket is compressed.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Plan {
    len: usize,
    compressed: Vec<Compressed>,
    /// Spans reduced as they are (relative to the bucket).
    plain: Vec<Range<usize>>,
    p_len: usize,
    q_len: usize,
}

fn plan(b: &Bucket, o: &PowerSgdOptions) -> Plan {
    let start = b.range.start;
    let len = b.range.len();
    let mut compressed = Vec::new();
    let (mut p_len, mut q_len) = (0, 0);
    let mut covered: Vec<Range<usize>> = Vec::new();
    for m in &b.matrices {
        let r = o.rank.min(m.rows).min(m.cols);
        let full = (m.rows * m.cols) as f64;
        let small = ((m.rows + m.cols) * r) as f64;
        if r == 0 || small * o.min_compression_rate >= full {
            continue;
        }
        let off = m.offset - start;
        compressed.push(Compressed {
            off,
            rows: m.rows,
            cols: m.cols,
            rank: r,
            p_off: p_len,
            q_off: q_len,
        });
        covered.push(off..off + m.rows * m.cols);
        p_len += m.rows * r;
        q_len += m.cols * r;
    }
    covered.sort_by_key(|r| r.start);
    let mut plain = Vec::new();
    let mut at = 0;
    for c in &covered {
        if c.start > at {
            plain.push(at..c.start);
        }
        at = c.end;
    }
    if at < len {
        plain.push(at..len);
    }
    Plan {
        len,
        compressed,
        plain,
        p_len,
        q_len,
    }
}

/// One bucket's buffers, made at its first compressed step.
struct Buffers<B> {
    p: B,
    q: B,
    error: B,
    before: B,
}

/// PowerSGD's state over every bucket.
pub struct PowerSgdState<B> {
    o: PowerSgdOptions,
    iter: usize,
    plans: Vec<Plan>,
    buffers: Vec<Option<Buffers<B>>>,
}

impl<B> PowerSgdState<B> {
    /// The state for `buckets`; buffers come at the first compressed step.
    pub(crate) fn new(o: PowerSgdOptions, buckets: &[Bucket]) -> Result<Self> {
        Ok(PowerSgdState {
            o,
            iter: 0,
            plans: buckets.iter().map(|b| plan(b, &o)).collect(),
            buffers: buckets.iter().map(|_| None).collect(),
        })
    }

    /// Whether this step compresses (past the plain warm-up steps).
    pub fn compressing(&self) -> bool {
        self.iter >= self.o.start_iter
    }

    /// Counts a step.
    pub fn end_step(&mut self) {
        self.iter += 1;
    }

    /// Elements sent per step for bucket `i` when compressing (the plain
    /// spans, the `P`s and the `Q`s).
    pub fn sent_elements(&self, i: usize) -> usize {
        let p = &self.plans[i];
        p.plain.iter().map(|r| r.len()).sum::<usize>() + p.p_len + p.q_len
    }
}

/// Compresses, reduces and decompresses bucket `i` (gradients `g`) over
/// `ranks` ranks; returns what was sent.
pub(crate) fn compress<O: MatOps>(
    ops: &mut O,
    st: &mut PowerSgdState<O::Buf>,
    i: usize,
    mut g: O::Grad,
    ranks: usize,
) -> Result<CommStep> {
    let o = st.o;
    let seed = o.seed ^ (st.iter as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ i as u64;
    let plan = st
        .plans
        .get(i)
        .ok_or_else(|| format!("PowerSGD: bucket {i} was never planned"))?;
    let first = st.buffers[i].is_none();
    if first {
        st.buffers[i] = Some(Buffers {
            p: ops.alloc(plan.p_len)?,
            q: ops.alloc(plan.q_len)?,
            error: ops.alloc(plan.len)?,
            before: ops.alloc(plan.len)?,
        });
    }
    let b = st.buffers[i].as_mut().expect("made above");
    let mut sent = CommStep::default();
    let mut count = |elems: usize| {
        let bytes = 4 * elems as u64;
        sent.payload_bytes += bytes;
        sent.wire_bytes += ring_wire_bytes(bytes, ranks);
        sent.collectives += 1;
    };
    // Error feedback.
    ops.add_into(&mut g, &b.error)?;
    ops.copy_from(&mut b.before, &g)?;
    for span in &plan.plain {
        ops.reduce_span(&mut g, span.clone())?;
        count(span.len());
    }
    if plan.compressed.is_empty() {
        return finish(ops, b, &g, ranks).map(|_| sent);
    }
    if first {
        // The same normal Qs on every rank.
        let mut rng = Rng::new(seed);
        let q: Vec<f32> = (0..plan.q_len).map(|_| rng.normal() as f32).collect();
        ops.set(&mut b.q, 0, &q)?;
    }
    for c in &plan.compressed {
        ops.orthogonalize(&mut b.q, c.q_off, c.cols, c.rank, o.eps)?;
    }
    for c in &plan.compressed {
        ops.m_q(
            &mut b.p, c.p_off, &g, c.off, &b.q, c.q_off, c.rows, c.cols, c.rank,
        )?;
    }
    ops.all_reduce(&mut b.p)?;
    count(plan.p_len);
    for c in &plan.compressed {
        ops.orthogonalize(&mut b.p, c.p_off, c.rows, c.rank, o.eps)?;
    }
    for c in &plan.compressed {
        ops.mt_p(
            &mut b.q, c.q_off, &g, c.off, &b.p, c.p_off, c.rows, c.cols, c.rank,
        )?;
    }
    ops.all_reduce(&mut b.q)?;
    count(plan.q_len);
    for c in &plan.compressed {
        ops.p_qt(
            &mut g, c.off, &b.p, c.p_off, &b.q, c.q_off, c.rows, c.cols, c.rank,
        )?;
    }
    finish(ops, b, &g, ranks)?;
    Ok(sent)
}

/// The error for the next step: what this rank had minus its share of
/// the result.
fn finish<O: MatOps>(
    ops: &mut O,
    b: &mut Buffers<O::Buf>,
    g: &O::Grad,
    ranks: usize,
) -> Result<()> {
    ops.residual(&mut b.error, &b.before, g, 1.0 / ranks as f32)
}

/// [`MatOps`] on host slices, reducing through a host communicator
/// (blocking).
pub(crate) struct HostOps<'c, 'g> {
    pub(crate) comm: &'c braid_comm::Communicator,
    pub(crate) _grads: std::marker::PhantomData<&'g mut [f32]>,
}

impl<'g> MatOps for HostOps<'_, 'g> {
    type Buf = Vec<f32>;
    type Grad = &'g mut [f32];

    fn alloc(&mut self, n: usize) -> Result<Vec<f32>> {
        Ok(vec![0.0; n])
    }

    fn add_into(&mut self, g: &mut &'g mut [f32], e: &Vec<f32>) -> Result<()> {
        g.iter_mut().zip(e).for_each(|(x, e)| *x += e);
        Ok(())
    }

    fn copy_from(&mut self, dst: &mut Vec<f32>, g: &&'g mut [f32]) -> Result<()> {
        dst.copy_from_slice(g);
        Ok(())
    }

    fn reduce_span(&mut self, g: &mut &'g mut [f32], span: Range<usize>) -> Result<()> {
        self.comm
            .all_reduce(&mut g[span], braid_comm::ReduceOp::Sum)
            .map_err(|e| e.to_string())
    }

    fn set(&mut self, dst: &mut Vec<f32>, off: usize, values: &[f32]) -> Result<()> {
        dst[off..off + values.len()].copy_from_slice(values);
        Ok(())
    }

    fn orthogonalize(
        &mut self,
        m: &mut Vec<f32>,
        off: usize,
        rows: usize,
        cols: usize,
        eps: f32,
    ) -> Result<()> {
        orthogonalize_host(&mut m[off..off + rows * cols], rows, cols, eps);
        Ok(())
    }

    fn m_q(
        &mut self,
        p: &mut Vec<f32>,
        po: usize,
        g: &&'g mut [f32],
        mo: usize,
        q: &Vec<f32>,
        qo: usize,
        n: usize,
        m: usize,
        r: usize,
    ) -> Result<()> {
        gemm_rm(
            &mut p[po..po + n * r],
            &g[mo..mo + n * m],
            false,
            &q[qo..qo + m * r],
            false,
            n,
            r,
            m,
            false,
        );
        Ok(())
    }

    fn mt_p(
        &mut self,
        q: &mut Vec<f32>,
        qo: usize,
        g: &&'g mut [f32],
        mo: usize,
        p: &Vec<f32>,
        po: usize,
        n: usize,
        m: usize,
        r: usize,
    ) -> Result<()> {
        gemm_rm(
            &mut q[qo..qo + m * r],
            &g[mo..mo + n * m],
            true,
            &p[po..po + n * r],
            false,
            m,
            r,
            n,
            false,
        );
        Ok(())
    }

    fn p_qt(
        &mut self,
        g: &mut &'g mut [f32],
        mo: usize,
        p: &Vec<f32>,
        po: usize,
        q: &Vec<f32>,
        qo: usize,
        n: usize,
        m: usize,
        r: usize,
    ) -> Result<()> {
        gemm_rm(
            &mut g[mo..mo + n * m],
            &p[po..po + n * r],
            false,
            &q[qo..qo + m * r],
            true,
            n,
            m,
            r,
            false,
        );
        Ok(())
    }

    fn all_reduce(&mut self, b: &mut Vec<f32>) -> Result<()> {
        self.comm
            .all_reduce(b, braid_comm::ReduceOp::Sum)
            .map_err(|e| e.to_string())
    }

    fn residual(
        &mut self,
        e: &mut Vec<f32>,
        before: &Vec<f32>,
        g: &&'g mut [f32],
        scale: f32,
    ) -> Result<()> {
        for ((e, b), x) in e.iter_mut().zip(before).zip(g.iter()) {
            *e = b - x * scale;
        }
        Ok(())
    }
}

use braid_model::cpu::matmul::gemm_rm;

/// Gram-Schmidt on the columns of a row-major `rows × cols` matrix (the
/// same order of operations as the GPU kernel; sums in f64 here).
pub(crate) fn orthogonalize_host(m: &mut [f32], rows: usize, cols: usize, eps: f32) {
    for i in 0..cols {
        let norm = (0..rows)
            .map(|r| (m[r * cols + i] as f64).powi(2))
            .sum::<f64>()
            .sqrt() as f32;
        let inv = 1.0 / (norm + eps);
        for r in 0..rows {
            m[r * cols + i] *= inv;
        }
        for j in i + 1..cols {
            let dot = (0..rows)
                .map(|r| m[r * cols + i] as f64 * m[r * cols + j] as f64)
                .sum::<f64>() as f32;
            for r in 0..rows {
                m[r * cols + j] -= dot * m[r * cols + i];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collective::End;
    use crate::engine::Matrix;

    #[test]
    fn buckets_compress_only_matrices_that_shrink_enough() {
        // A 64×64 matrix between two vectors, and a 2×3 matrix that rank 1
        // would not shrink twofold.
        let b = Bucket {
            range: 100..100 + 10 + 4096 + 6 + 5,
            end: End::Back,
            matrices: vec![
                Matrix {
                    offset: 110,
                    rows: 64,
                    cols: 64,
                },
                Matrix {
                    offset: 110 + 4096,
                    rows: 2,
                    cols: 3,
                },
            ],
        };
        let p = plan(&b, &PowerSgdOptions::default());
        assert_eq!(p.compressed.len(), 1);
        assert_eq!((p.compressed[0].off, p.p_len, p.q_len), (10, 64, 64));
        assert_eq!(p.plain, vec![0..10, 4106..4117]);
    }

    #[test]
    fn orthogonalised_columns_are_orthonormal() {
        let mut rng = Rng::new(4);
        let (rows, cols) = (50, 3);
        let mut m: Vec<f32> = (0..rows * cols).map(|_| rng.normal() as f32).collect();
        orthogonalize_host(&mut m, rows, cols, 0.0);
        for i in 0..cols {
            for j in 0..cols {
                let d: f32 = (0..rows).map(|r| m[r * cols + i] * m[r * cols + j]).sum();
                let want = if i == j { 1.0 } else { 0.0 };
                assert!((d - want).abs() < 1e-5, "column {i}·{j} = {d}");
            }
        }
    }
}
