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

use super::core::{Bucket, Collective, Drive, During, End, GatherPart, ScatterPart};
use super::exchange::{block_of, check_exchange, disjoint_mut};
use super::grad_comm::GradComm;
use super::powersgd::{self, HostOps, PowerSgdState};
use super::wire::{ring_half_wire_bytes, ring_wire_bytes};
use crate::space::{Host, HostWindow, Window};
use crate::strategy::CommStep;
use crate::Result;
use braid_comm::{Communicator, ReduceOp};
use half::{bf16, f16};
use rayon::prelude::*;
use std::ops::Range;

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

    fn hooks(&self, comm: GradComm, buckets: &[Bucket]) -> Result<HostHooks> {
        let len = buckets.iter().map(|b| b.range.end).max().unwrap_or(0);
        Ok(match comm {
            GradComm::Plain => HostHooks::Plain,
            GradComm::Bf16 => HostHooks::Bf16(vec![bf16::ZERO; len]),
            GradComm::Fp16 => HostHooks::Fp16(vec![f16::ZERO; len]),
            GradComm::PowerSgd(o) => HostHooks::PowerSgd(Box::new(PowerSgdState::new(o, buckets)?)),
            GradComm::TopK(_) => {
                return Err(
                    "--grad-comm topk compresses a parameter server's pushes (--ps N): \
                            an all-reduce sums dense buckets"
                        .into(),
                )
            }
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
                        step.add(powersgd::compress(&mut ops, state, i, part, n)?);
                    }
                } else {
                    reduce_plain(&self.comm, grads, drive, &mut step)?;
                }
                state.end_step();
            }
        }
        Ok(step)
    }

    fn reduce_scatter<'g>(
        &self,
        grads: HostWindow<'g>,
        buckets: &[Bucket],
        drive: &mut Drive<'_, 'g, Host>,
    ) -> Result<CommStep> {
        self.reduce_scatter_in_place(grads, buckets, drive)
    }

    fn zeros(&self, len: usize) -> Result<Vec<f32>> {
        Ok(vec![0.0; len])
    }

    fn all_gather_ranges(&self, flat: &mut Vec<f32>, ranges: &[Range<usize>]) -> Result<CommStep> {
        let (n, rank) = (self.comm.size(), self.comm.rank());
        let mut step = CommStep::default();
        let mut slots: Vec<&mut [f32]> = disjoint_mut(flat, ranges)?
            .into_iter()
            .map(|(_, s)| s)
            .collect();
        // A copy of this rank's block goes out while the range fills in:
        // in groups, so that the copies stay small.
        for group in in_groups(&mut slots, n, GROUP_BYTES) {
            let mut sends = Vec::with_capacity(group.len());
            for slot in group.iter() {
                sends.push(slot[block_of(&(0..slot.len()), rank, n)?].to_vec());
            }
            self.comm
                .scope(|s| {
                    for (send, slot) in sends.iter().zip(group.iter_mut()) {
                        count_half(&mut step, 4 * slot.len() as u64, n);
                        let _ = s.all_gather(send, slot);
                    }
                })
                .map_err(err)?;
        }
        Ok(step)
    }

    fn all_reduce_ranges(&self, flat: &mut Vec<f32>, ranges: &[Range<usize>]) -> Result<CommStep> {
        let n = self.comm.size();
        let mut step = CommStep::default();
        let slots = disjoint_mut(flat, ranges)?;
        self.comm
            .scope(|s| {
                for (_, slot) in slots {
                    count(&mut step, 4 * slot.len() as u64, n);
                    let _ = s.all_reduce(slot, ReduceOp::Sum);
                }
            })
            .map_err(err)?;
        Ok(step)
    }

    fn shard_exchange(
        &self,
        master: &Vec<f32>,
        gathers: &mut [GatherPart<'_, Vec<f32>>],
        shard_grads: &mut Vec<f32>,
        scatters: &mut [ScatterPart<'_, Vec<f32>>],
        during: &mut During<'_>,
    ) -> Result<CommStep> {
        let n = self.comm.size();
        check_exchange(
            n,
            master.len(),
            gathers,
            shard_grads.len(),
            scatters,
            Vec::len,
        )?;
        if gathers.iter().any(|g| g.half) {
            return Err(format!(
                "bf16 gathers over {} are not built (the host engine trains in f32)",
                self.backend()
            ));
        }
        let mut step = CommStep::default();
        let mut sums: Vec<Vec<f32>> = scatters.iter().map(|s| vec![0.0; s.to.len()]).collect();
        let computed = self
            .comm
            .scope(|s| {
                for g in gathers.iter_mut() {
                    let k = g.from.len();
                    count_half(&mut step, 4 * (n * k) as u64, n);
                    let _ = s.all_gather(&master[g.from.clone()], &mut g.into[g.at..g.at + n * k]);
                }
                for (part, sum) in scatters.iter().zip(sums.iter_mut()) {
                    count_half(&mut step, 4 * part.grads.len() as u64, n);
                    let _ = s.reduce_scatter(&part.grads[..], sum, ReduceOp::Sum);
                }
                during()
            })
            .map_err(err)?;
        computed?;
        for (part, sum) in scatters.iter().zip(&sums) {
            let to = &mut shard_grads[part.to.clone()];
            match part.add {
                true => to.iter_mut().zip(sum).for_each(|(g, s)| *g += s),
                false => to.copy_from_slice(sum),
            }
        }
        Ok(step)
    }

    fn split(&self, color: u32, key: usize) -> Result<HostCollective> {
        let comm = self
            .comm
            .split(Some(color), key as i64)
            .map_err(err)?
            .ok_or("split: this rank joined no communicator")?;
        Ok(HostCollective::new(comm))
    }
}

/// Bytes of copies (sums, own blocks) a group of host reduce-scatters or
/// all-gathers keeps at once ([`in_groups`]).
const GROUP_BYTES: usize = 64 << 20;

/// `parts` in consecutive groups whose blocks (a part over `n` ranks)
/// add up to at most `budget` bytes (at least one part each).
fn in_groups<T: AsRef<[f32]>>(parts: &mut [T], n: usize, budget: usize) -> Vec<&mut [T]> {
    let mut groups = Vec::new();
    let mut rest = parts;
    while !rest.is_empty() {
        let (mut end, mut bytes) = (0, 0);
        while end < rest.len() {
            let b = 4 * rest[end].as_ref().len() / n.max(1);
            if end > 0 && bytes + b > budget {
                break;
            }
            bytes += b;
            end += 1;
        }
        let (group, tail) = std::mem::take(&mut rest).split_at_mut(end);
        groups.push(group);
        rest = tail;
    }
    groups
}

impl HostCollective {
    /// The in-place reduce-scatter: the backward pass runs first (its
    /// buckets collected, nothing overlaps), then the buckets are reduced
    /// in groups, each bucket's sum landing in a small copy that goes
    /// into the rank's block once its group is done.
    fn reduce_scatter_in_place<'g>(
        &self,
        grads: HostWindow<'g>,
        buckets: &[Bucket],
        drive: &mut Drive<'_, 'g, Host>,
    ) -> Result<CommStep> {
        let (n, rank) = (self.comm.size(), self.comm.rank());
        let mut step = CommStep::default();
        let mut parts: Vec<&'g mut [f32]> = Vec::new();
        drive(grads, &mut |i, part| {
            let b = buckets
                .get(i)
                .ok_or_else(|| format!("bucket {i} was never planned"))?;
            block_of(&(0..part.len()), rank, n)
                .map_err(|e| format!("bucket {i} ({:?}): {e}", b.range))?;
            parts.push(part);
            Ok(())
        })?;
        for group in in_groups(&mut parts, n, GROUP_BYTES) {
            let mut sums: Vec<Vec<f32>> = group.iter().map(|p| vec![0.0; p.len() / n]).collect();
            self.comm
                .scope(|s| {
                    for (part, sum) in group.iter().zip(sums.iter_mut()) {
                        count_half(&mut step, 4 * part.len() as u64, n);
                        let _ = s.reduce_scatter(&part[..], sum, ReduceOp::Sum);
                    }
                })
                .map_err(err)?;
            for (part, sum) in group.iter_mut().zip(&sums) {
                let mine = block_of(&(0..part.len()), rank, n)?;
                part[mine].copy_from_slice(sum);
            }
        }
        Ok(step)
    }
}

/// Counts a reduce-scatter or all-gather of `bytes` over `n` ranks.
pub(crate) fn count_half(step: &mut CommStep, bytes: u64, n: usize) {
    step.payload_bytes += bytes;
    step.wire_bytes += ring_half_wire_bytes(bytes, n);
    step.collectives += 1;
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

#[cfg(test)]
mod tests {
    use super::in_groups;

    #[test]
    fn groups_keep_their_blocks_under_the_budget() {
        // Parts of 8, 8, 4, 20 and 4 elements over 2 ranks: blocks of 16,
        // 16, 8, 40 and 8 bytes; a budget of 32 bytes.
        let mut parts: Vec<Vec<f32>> = [8, 8, 4, 20, 4].iter().map(|&k| vec![0.0; k]).collect();
        let sizes: Vec<Vec<usize>> = in_groups(&mut parts, 2, 32)
            .iter()
            .map(|g| g.iter().map(|p| p.len()).collect())
            .collect();
        // The 20-element part is alone: over budget, but a group holds one.
        assert_eq!(sizes, vec![vec![8, 8], vec![4], vec![20], vec![4]]);
    }
}
