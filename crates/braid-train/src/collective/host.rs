//! [`HostCollective`]: reduction sessions over host memory through a
//! [`Communicator`] (shm inside a host, tcp between hosts).
//!
//! A session is one [`Communicator::scope`]: each bucket's all-reduce
//! starts on the communicator's progress thread the moment it is launched
//! and the scope returns when all have finished. The half-precision hooks
//! cast a bucket into its slot of a half-precision copy of the gradient
//! buffer, reduce that, and cast back once the scope is done. PowerSGD
//! runs bucket by bucket after the backward pass (its two dependent
//! all-reduces per bucket block on the CPU).

use super::powersgd::{self, HostOps, PowerSgdState};
use super::{ring_wire_bytes, Bucket, Collective, Drive, End, GradComm};
use crate::space::{Host, HostWindow, Window};
use crate::strategy::CommStep;
use crate::Result;
use braid_comm::{Communicator, ReduceOp};
use half::{bf16, f16};
use rayon::prelude::*;

/// Host-memory collectives over a [`Communicator`].
pub struct HostCollective {
    comm: Communicator,
}

impl HostCollective {
    /// Collectives over `comm`.
    pub fn new(comm: Communicator) -> HostCollective {
        HostCollective { comm }
    }
}

/// The host hooks' state.
pub enum HostHooks {
    /// Nothing to keep.
    Plain,
    /// A bf16 copy of the whole gradient buffer (each bucket its slot).
    Bf16(Vec<bf16>),
    /// An fp16 copy of the whole gradient buffer.
    Fp16(Vec<f16>),
    /// PowerSGD's per-bucket state.
    PowerSgd(Box<PowerSgdState<Vec<f32>>>),
}

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// Counts an all-reduce of `bytes` over `n` ranks.
pub(crate) fn count(step: &mut CommStep, bytes: u64, n: usize) {
    step.payload_bytes += bytes;
    step.wire_bytes += ring_wire_bytes(bytes, n);
    step.collectives += 1;
}

/// A window over a half-precision copy of the gradient buffer, split in
/// step with the gradient window.
fn split_like<'h, T: Send>(w: &mut HostWindow<'h, T>, b: &Bucket) -> Result<&'h mut [T]> {
    match b.end {
        End::Back => w.split_off_back(b.range.start),
        End::Front => w.split_off_front(b.range.end),
    }
}

impl Collective for HostCollective {
    type Space = Host;
    type Hooks = HostHooks;

    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn size(&self) -> usize {
        self.comm.size()
    }

    fn host(&self) -> &Communicator {
        &self.comm
    }

    fn backend(&self) -> String {
        self.comm.backend_name().to_string()
    }

    fn broadcast(&self, flat: &mut Vec<f32>, root: usize) -> Result<()> {
        self.comm.broadcast(flat, root).map_err(err)
    }

    fn to_host(&self, flat: &Vec<f32>) -> Result<Vec<f32>> {
        Ok(flat.clone())
    }

    fn hooks(&self, comm: GradComm, buckets: &[Bucket]) -> Result<HostHooks> {
        let len = buckets.iter().map(|b| b.range.end).max().unwrap_or(0);
        Ok(match comm {
            GradComm::Plain => HostHooks::Plain,
            GradComm::Bf16 => HostHooks::Bf16(vec![bf16::ZERO; len]),
            GradComm::Fp16 => HostHooks::Fp16(vec![f16::ZERO; len]),
            GradComm::PowerSgd(o) => HostHooks::PowerSgd(Box::new(PowerSgdState::new(o, buckets)?)),
        })
    }

    fn reduce<'g>(
        &self,
        grads: HostWindow<'g>,
        buckets: &[Bucket],
        hooks: &mut HostHooks,
        drive: &mut Drive<'_, 'g, Host>,
    ) -> Result<CommStep> {
        let n = self.comm.size();
        let mut step = CommStep::default();
        match hooks {
            HostHooks::Plain => reduce_plain(&self.comm, grads, drive, &mut step)?,
            HostHooks::Bf16(copy) => {
                reduce_half(&self.comm, grads, buckets, copy, drive, &mut step, 1.0, 1.0)?
            }
            // Pre-divided by the ranks so the sum stays in fp16's range.
            HostHooks::Fp16(copy) => reduce_half(
                &self.comm,
                grads,
                buckets,
                copy,
                drive,
                &mut step,
                1.0 / n as f32,
                n as f32,
            )?,
            HostHooks::PowerSgd(state) => {
                if state.compressing() {
                    // The backward pass first; then bucket by bucket.
                    let mut parts: Vec<(usize, &'g mut [f32])> = Vec::new();
                    drive(grads, &mut |i, part| {
                        parts.push((i, part));
                        Ok(())
                    })?;
                    let mut ops = HostOps {
                        comm: &self.comm,
                        _grads: std::marker::PhantomData,
                    };
                    for (i, part) in parts {
                        let sent = powersgd::compress(&mut ops, state, i, part, n)?;
                        step.payload_bytes += sent.payload_bytes;
                        step.wire_bytes += sent.wire_bytes;
                        step.collectives += sent.collectives;
                    }
                } else {
                    reduce_plain(&self.comm, grads, drive, &mut step)?;
                }
                state.end_step();
            }
        }
        Ok(step)
    }
}

/// A plain session: each launched bucket is all-reduced (f32 sum).
fn reduce_plain<'g>(
    comm: &Communicator,
    grads: HostWindow<'g>,
    drive: &mut Drive<'_, 'g, Host>,
    step: &mut CommStep,
) -> Result<()> {
    let n = comm.size();
    comm.scope(|s| {
        drive(grads, &mut |_, part: &'g mut [f32]| {
            count(step, 4 * part.len() as u64, n);
            let _ = s.all_reduce(part, ReduceOp::Sum);
            Ok(())
        })
    })
    .map_err(err)?
}

/// The half-precision element types a hook sends.
trait HalfFloat: braid_core::Element + Send + Sync {
    fn from_f32(x: f32) -> Self;
    fn to_f32(self) -> f32;
}

impl HalfFloat for bf16 {
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
}

impl HalfFloat for f16 {
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
}

/// A half-precision session: each launched bucket, multiplied by `pre`,
/// is cast into its slot of `copy` and that slot all-reduced; once every
/// reduction has finished the sums come back, multiplied by `post`.
#[allow(clippy::too_many_arguments)]
fn reduce_half<'g, T: HalfFloat>(
    comm: &Communicator,
    grads: HostWindow<'g>,
    buckets: &[Bucket],
    copy: &mut [T],
    drive: &mut Drive<'_, 'g, Host>,
    step: &mut CommStep,
    pre: f32,
    post: f32,
) -> Result<()> {
    let n = comm.size();
    let mut parts = Vec::new();
    let mut halves = HostWindow::new(0, &mut copy[..]);
    comm.scope(|s| {
        drive(grads, &mut |i, part: &'g mut [f32]| {
            let b = buckets
                .get(i)
                .ok_or_else(|| format!("bucket {i} was never planned"))?;
            let h = split_like(&mut halves, b)?;
            if h.len() != part.len() {
                return Err(format!(
                    "bucket {i}: {} gradients against {} half-precision slots",
                    part.len(),
                    h.len()
                ));
            }
            h.par_iter_mut()
                .zip(part.par_iter())
                .for_each(|(h, &x)| *h = T::from_f32(x * pre));
            count(step, 2 * h.len() as u64, n);
            let _ = s.all_reduce(h, ReduceOp::Sum);
            parts.push((i, part));
            Ok(())
        })
    })
    .map_err(err)??;
    for (i, part) in parts {
        let h = &copy[buckets[i].range.clone()];
        part.par_iter_mut()
            .zip(h.par_iter())
            .for_each(|(x, &h)| *x = h.to_f32() * post);
    }
    Ok(())
}
