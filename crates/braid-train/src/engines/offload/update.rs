//! [`HostUpdate`]: the part of an offloaded optimizer that lives in host
//! memory and knows nothing of devices — the f32 master weights, AdamW's
//! moments and the update of one chunk of the flat buffer at a time,
//! writing the new weights, narrowed to the compute dtype, where the
//! caller says. The GPU's [`HostOptimizer`](super::HostOptimizer) streams
//! chunks through pinned buffers around it; a CPU engine
//! ([`CpuGpt::offloaded`](crate::engines::CpuGpt::offloaded)) updates its
//! own weights through it directly, so a pipeline stage or a
//! tensor-parallel share with `--offload optimizer` runs the same update
//! on any machine.

use crate::engine::UpdateStep;
use crate::Result;
use braid_model::optim::{AdamWConfig, Optimizer};
use braid_model::Layout;
use half::bf16;
use std::ops::Range;

/// Elements per chunk: 16 Mi (64 MiB of f32 gradients), large enough for
/// a copy to run at the link's speed and small enough that filling and
/// draining the pipeline (one chunk's copy each way) takes milliseconds.
pub const CHUNK: usize = 1 << 24;

/// The element type of the weights the passes read.
pub trait Narrow: braid_core::Element + Send + Sync {
    /// `x` in this type (round to nearest even).
    fn narrow(x: f32) -> Self;
}

impl Narrow for f32 {
    fn narrow(x: f32) -> f32 {
        x
    }
}

impl Narrow for bf16 {
    fn narrow(x: f32) -> bf16 {
        bf16::from_f32(x)
    }
}

/// AdamW over f32 master weights in host memory, one chunk at a time.
pub struct HostUpdate {
    master: Vec<f32>,
    opt: Optimizer,
    /// Elements of the flat buffer in no tensor (a padded layout's).
    gaps: Vec<Range<usize>>,
}

impl HostUpdate {
    /// AdamW with `cfg` over `master` (the flat parameters of `layout`).
    pub fn new(layout: &Layout, master: Vec<f32>, cfg: AdamWConfig) -> Result<Self> {
        if master.len() != layout.len {
            return Err(format!(
                "offloaded optimizer: {} master weights for a model of {}",
                master.len(),
                layout.len
            ));
        }
        let mut gaps = Vec::new();
        let mut at = 0;
        for t in &layout.params {
            if t.offset > at {
                gaps.push(at..t.offset);
            }
            at = at.max(t.offset + t.len);
        }
        if at < layout.len {
            gaps.push(at..layout.len);
        }
        Ok(HostUpdate {
            opt: Optimizer::adamw(layout, cfg),
            gaps,
            master,
        })
    }

    /// The master weights.
    pub fn master(&self) -> &[f32] {
        &self.master
    }

    /// The number of master weights.
    pub fn len(&self) -> usize {
        self.master.len()
    }

    /// Whether there are no master weights.
    pub fn is_empty(&self) -> bool {
        self.master.is_empty()
    }

    /// The master weights, ending the optimizer (its other memory freed
    /// first).
    pub fn into_master(self) -> Vec<f32> {
        let HostUpdate { master, opt, .. } = self;
        drop(opt);
        master
    }

    /// AdamW's moment `i` (0: `exp_avg`, 1: `exp_avg_sq`), laid out like
    /// the master weights (zeros before the first update).
    pub fn moment(&self, i: usize) -> Result<&[f32]> {
        match (&self.opt, i) {
            (Optimizer::AdamW { m, .. }, 0) => Ok(m),
            (Optimizer::AdamW { v, .. }, 1) => Ok(v),
            _ => Err(format!("offloaded optimizer: AdamW has no moment {i}")),
        }
    }

    /// Replaces AdamW's moments by `m` and `v` (laid out like the master
    /// weights), as after `updates` updates: a resumed run's state.
    pub fn set_moments(&mut self, m: &[f32], v: &[f32], updates: u64) -> Result<()> {
        let n = self.master.len();
        let Optimizer::AdamW {
            m: om, v: ov, t, ..
        } = &mut self.opt
        else {
            return Err("offloaded optimizer: not AdamW".into());
        };
        if m.len() != n || v.len() != n {
            return Err(format!(
                "offloaded optimizer: moments of {} and {} elements for {n} master weights",
                m.len(),
                v.len()
            ));
        }
        *t = u32::try_from(updates).map_err(|_| format!("{updates} updates"))?;
        om.copy_from_slice(m);
        ov.copy_from_slice(v);
        Ok(())
    }

    /// Replaces the master weights by `values` (a resumed run's, or rank
    /// 0's broadcast); the compute weights follow by
    /// [`narrow_into`](Self::narrow_into).
    pub fn set_master(&mut self, values: &[f32]) -> Result<()> {
        if values.len() != self.master.len() {
            return Err(format!(
                "offloaded optimizer: {} values for {} master weights",
                values.len(),
                self.master.len()
            ));
        }
        self.master.copy_from_slice(values);
        Ok(())
    }

    /// Bytes of host memory it holds: the master weights, the moments.
    pub fn bytes(&self) -> (u64, u64) {
        (4 * self.master.len() as u64, self.opt.state_bytes() as u64)
    }

    /// The chunks of the flat buffer, in order.
    pub fn chunks(&self) -> Vec<Range<usize>> {
        let n = self.master.len();
        (0..n.div_ceil(CHUNK))
            .map(|k| k * CHUNK..((k + 1) * CHUNK).min(n))
            .collect()
    }

    /// Starts an update (Adam's step count); the chunks follow, each
    /// once, by [`update_chunk`](Self::update_chunk).
    pub fn begin_step(&mut self) {
        self.opt.begin_step();
    }

    /// Updates the master weights of chunk `r` from its gradients `g`
    /// and writes them, narrowed to `T`, into `out` (the chunk's compute
    /// weights); padding between tensors is narrowed as it is.
    pub fn update_chunk<T: Narrow>(
        &mut self,
        r: Range<usize>,
        g: &[f32],
        out: &mut [T],
        step: UpdateStep,
    ) {
        let p = &mut self.master[r.clone()];
        let hyper = (step.lr, step.grad_scale);
        self.opt
            .step_range_into(p, g, r.clone(), hyper, out, T::narrow);
        for gap in &self.gaps {
            let cut = gap.start.max(r.start)..gap.end.min(r.end);
            for i in cut {
                out[i - r.start] = T::narrow(self.master[i]);
            }
        }
    }

    /// One whole update of `weights` (the compute weights, laid out like
    /// the master weights) from `grads`, chunk by chunk: what an engine
    /// whose weights are in host memory runs.
    pub fn step<T: Narrow>(
        &mut self,
        grads: &[f32],
        weights: &mut [T],
        step: UpdateStep,
    ) -> Result<()> {
        let n = self.master.len();
        if grads.len() != n || weights.len() != n {
            return Err(format!(
                "offloaded optimizer over {n} parameters given {} weights and {} gradients",
                weights.len(),
                grads.len()
            ));
        }
        self.begin_step();
        for r in self.chunks() {
            self.update_chunk(r.clone(), &grads[r.clone()], &mut weights[r], step);
        }
        Ok(())
    }

    /// Narrows the master weights of `r` into `out`.
    pub fn narrow_into<T: Narrow>(&self, r: Range<usize>, out: &mut [T]) {
        use rayon::prelude::*;
        out.par_chunks_mut(1 << 14)
            .zip(self.master[r].par_chunks(1 << 14))
            .for_each(|(o, p)| {
                for (o, &p) in o.iter_mut().zip(p) {
                    *o = T::narrow(p);
                }
            });
    }
}
