//! The units of a [`GpuGpt`] whose parameters a ZeRO-3 strategy holds:
//! the blocks it takes in bf16, the upload of its shard and the return of
//! the whole parameters, the forward, recompute and backward units over
//! the blocks the strategy gathered, and the update of the master shard.
//! The `Engine` methods of the same jobs call these.

use super::err::e;
use super::state::{GpuGpt, HalfBlocks, Step};
use super::units::{block_window, lent_bf16, pieces, plan, unit_f32_params, unit_pieces};
use crate::engine::{Engine, ShardedOptimizer, UpdateStep};
use crate::engines::units::{backward_unit_name, forward_unit_name};
use crate::Result;
use braid_cuda::memory::copy_async;
use braid_cuda::DeviceBuffer;
use braid_model::cuda::f32_params::{F32Params, SideMap};
use braid_model::Block;
use braid_trace::{scope, Cat};
use std::ops::Range;

impl GpuGpt {
    /// Takes the layers in bf16 under ZeRO-3 (`ShardedParams::start_half_blocks`):
    /// the blocks it takes and the f32 tensors inside them, kept whole in
    /// `HalfBlocks`.
    pub(super) fn take_half_blocks(&mut self) -> Result<(Vec<usize>, Vec<Range<usize>>)> {
        self.in_units("start_half_blocks")?;
        if !self.model.streams_weights() {
            // The f32 model reads its parameters in f32.
            return Ok((Vec::new(), Vec::new()));
        }
        let layers: Vec<Range<usize>> = self
            .layout
            .blocks
            .iter()
            .filter(|(b, _)| matches!(b, Block::Layer(_)))
            .map(|(_, r)| r.clone())
            .collect();
        let taken: Vec<bool> = self
            .units
            .blocks
            .iter()
            .map(|r| layers.contains(r))
            .collect();
        let map = SideMap::for_mixed_within(&self.layout, &layers);
        let tensors: Vec<Range<usize>> = self
            .layout
            .params
            .iter()
            .map(|t| t.range())
            .filter(|r| map.locate(r).is_some())
            .collect();
        let side = DeviceBuffer::zeros(self.model.stream().device(), map.len()).map_err(e)?;
        let blocks = (0..taken.len()).filter(|&b| taken[b]).collect();
        self.half = Some(HalfBlocks { taken, side, map });
        Ok((blocks, tensors))
    }

    /// Keeps only this rank's shard of the master weights on the GPU
    /// (`ShardedParams::shard_params`), from host memory where the parameters wait
    /// there.
    pub(super) fn upload_shard(&mut self, shard: &[Range<usize>]) -> Result<DeviceBuffer<f32>> {
        if self.sharded {
            return Err("shard_params: the parameters are sharded already".into());
        }
        if self.offload.is_some() {
            return Err(
                "ZeRO-3 with an optimizer offloaded to host memory is not built (the master \
                 shard lives on the GPU)"
                    .into(),
            );
        }
        if self.steps != plan(&self.layout, 0) {
            return Err(
                "ZeRO-3 gathers whole layers for their backward pass: layers that defer their \
                 weight gradients do not go with it (drop --defer-layers)"
                    .into(),
            );
        }
        if self.model.weights_bf16().is_some() {
            return Err(
                "ZeRO-3 on the GPU casts each gathered layer to bf16 as it runs: build the bf16 \
                 engine with streamed weights (MixedOptions::streamed_weights), not a full bf16 \
                 copy"
                    .into(),
            );
        }
        self.shard_optimizer(shard)?;
        let len = self.state_len();
        let mut master = DeviceBuffer::zeros(self.p.device(), len).map_err(e)?;
        match self.pending.take() {
            // Only this rank's shard comes up from host memory.
            Some(host) => {
                for (r, at, _) in &self.shard {
                    master
                        .copy_range_from_host(*at..at + r.len(), &host[r.clone()])
                        .map_err(e)?;
                }
            }
            None => {
                let s = self.compute_stream();
                for (r, at, _) in &self.shard {
                    copy_async(
                        &mut master.view_mut(*at..at + r.len()),
                        &self.p.view(r.clone()),
                        s,
                    )
                    .map_err(e)?;
                }
                s.synchronize().map_err(e)?;
            }
        }
        self.start_bias_carry()?;
        self.p = DeviceBuffer::zeros(self.p.device(), 0).map_err(e)?;
        self.sharded = true;
        Ok(master)
    }

    /// One forward unit over the blocks the strategy gathered
    /// (`ShardedParams::forward_unit`).
    pub(super) fn run_forward_unit(
        &mut self,
        unit: usize,
        params: &[&DeviceBuffer<f32>],
    ) -> Result<Option<f32>> {
        let layers = self.layout.config.n_layer;
        let _t = scope::start(self.stream(), Cat::Compute, || {
            forward_unit_name(unit, layers)
        });
        self.in_units("forward_unit")?;
        let blocks = self.units.forward.get(unit).map_or(&[][..], |b| b);
        let lens = self.given_lens(blocks, params);
        let want = self.units.forward_given(unit, &lens)?;
        let n_layer = self.layout.config.n_layer;
        if let Some(l) = self.half_layer(want, params)? {
            let Some(h) = &self.half else {
                unreachable!("a layer is taken in bf16 only after take_half_blocks");
            };
            let pf = F32Params::packed(&h.side, &h.map);
            // SAFETY: see `half_layer`.
            let w = unsafe { lent_bf16(params[0]) }?;
            let m = &mut self.model;
            m.give_layer_weights(Some((l, w))).map_err(e)?;
            let r = m.forward_block(l, pf).map_err(e);
            m.give_layer_weights(None).map_err(e)?;
            return r.map(|_| None);
        }
        let pieces = pieces(&self.units, want, params);
        let pf = F32Params::blocks(&pieces);
        let grad = self.forward_grad;
        let m = &mut self.model;
        match unit {
            0 => m.forward_encoder(pf).map(|_| None),
            u if u <= n_layer => m.forward_block(u - 1, pf).map(|_| None),
            _ => m.forward_head(pf, grad).map(Some),
        }
        .map_err(e)
    }

    /// The recomputation that starts a layer's backward unit under
    /// checkpointing (`ShardedParams::recompute_unit_of`).
    pub(super) fn run_recompute_unit(
        &mut self,
        unit: usize,
        params: &[&DeviceBuffer<f32>],
    ) -> Result<bool> {
        self.in_units("recompute_unit_of")?;
        let step = self
            .steps
            .get(unit)
            .map(|s| s.1)
            .ok_or_else(|| format!("backward unit {unit} does not exist"))?;
        // (The strategy asks only where `recomputes_unit` said so.)
        let (Step::Layer(l), true) = (step, self.model.recomputes()) else {
            return Ok(false);
        };
        let layers = self.layout.config.n_layer;
        let _t = scope::start(self.stream(), Cat::Compute, || {
            format!("{} (recompute)", backward_unit_name(unit, layers))
        });
        let blocks = self.units.backward_reads.get(unit).map_or(&[][..], |b| b);
        let lens = self.given_lens(blocks, params);
        let reads = self.units.backward_reads_given(unit, &lens)?.to_vec();
        let half_layer = self.half_layer(&reads, params)?;
        let pieces = unit_pieces(&self.units, half_layer, &reads, params);
        let pf = unit_f32_params(self.half.as_ref(), half_layer, &pieces);
        let m = &mut self.model;
        let Some(hl) = half_layer else {
            return m.recompute_layer(l, pf).map_err(e);
        };
        // SAFETY: see `half_layer`.
        let w = unsafe { lent_bf16(params[0]) }?;
        m.give_layer_weights(Some((hl, w))).map_err(e)?;
        let r = m.recompute_layer(l, pf).map_err(e);
        m.give_layer_weights(None).map_err(e)?;
        r
    }

    /// One backward unit over gathered blocks, writing block gradient buffers
    /// (`ShardedParams::backward_unit_of`).
    pub(super) fn run_backward_unit(
        &mut self,
        unit: usize,
        params: &[&DeviceBuffer<f32>],
        grads: &mut [&mut DeviceBuffer<f32>],
    ) -> Result<()> {
        let layers = self.layout.config.n_layer;
        let _t = scope::start(self.stream(), Cat::Compute, || {
            backward_unit_name(unit, layers)
        });
        self.in_units("backward_unit_of")?;
        let blocks = self.units.backward_reads.get(unit).map_or(&[][..], |b| b);
        let lens = self.given_lens(blocks, params);
        let grad_lens: Vec<usize> = grads.iter().map(|g| g.len()).collect();
        let (reads, writes) = self.units.backward_given(unit, &lens, &grad_lens)?;
        let reads = reads.to_vec();
        let writes = writes.to_vec();
        let step = self.steps[unit].1;
        let half_layer = self.half_layer(&reads, params)?;
        let pieces = unit_pieces(&self.units, half_layer, &reads, params);
        let pf = unit_f32_params(self.half.as_ref(), half_layer, &pieces);
        let mut window = block_window(
            &self.layout,
            &self.units,
            &mut self.carry,
            self.model.stream(),
            unit,
            step,
            &writes,
            grads,
        )?;
        let m = &mut self.model;
        let Some(l) = half_layer else {
            return m.backward_part(step, pf, &mut window).map_err(e);
        };
        // SAFETY: see `half_layer`.
        let w = unsafe { lent_bf16(params[0]) }?;
        m.give_layer_weights(Some((l, w))).map_err(e)?;
        let r = m.backward_part(step, pf, &mut window).map_err(e);
        m.give_layer_weights(None).map_err(e)?;
        r
    }

    /// Takes the whole parameters back from the strategy into host memory, to
    /// be saved (`ShardedParams::unshard_params`).
    pub(super) fn keep_whole_params(&mut self, full: Vec<f32>) -> Result<()> {
        self.in_units("unshard_params")?;
        if full.len() != self.layout.len {
            return Err(format!(
                "unshard_params: {} parameters for a model of {}",
                full.len(),
                self.layout.len
            ));
        }
        // The whole model stays in host memory: it is there to be saved.
        self.pending = Some(full);
        self.sharded = false;
        Ok(())
    }

    /// AdamW on the shard's master weights from the shard's reduced gradients
    /// (`ShardedParams::update_compact`).
    pub(super) fn update_master_shard(
        &mut self,
        params: &mut DeviceBuffer<f32>,
        grads: &DeviceBuffer<f32>,
        step: UpdateStep,
    ) -> Result<()> {
        self.in_units("update_compact")?;
        self.check_compact(params, grads)?;
        self.adamw(Some(params), grads, true, step)
    }

    /// Refuses a master shard or its gradients of other lengths than the
    /// optimizer's shard.
    pub(super) fn check_compact(
        &self,
        params: &DeviceBuffer<f32>,
        grads: &DeviceBuffer<f32>,
    ) -> Result<()> {
        let len = self.state_len();
        if grads.len() != len || params.len() != len {
            return Err(format!(
                "{} shard parameters and {} gradients for an optimizer shard of {len} elements",
                params.len(),
                grads.len()
            ));
        }
        Ok(())
    }
}
