//! Building a [`GpuGpt`]: the f32 or bf16 model on its device, the
//! parameters copied up (or kept in host memory for ZeRO-3's shards, or
//! with an offloaded optimizer), AdamW's state and the units' plan.

use super::err::e;
use super::precision::Precision;
use super::ranges::optimizer_ranges;
use super::state::{GpuGpt, Master, Offload};
use super::units::{head_reads_cast_embeddings, plan};
use crate::engines::offload::HostOptimizer;
use crate::engines::units::gpt_param_units;
use crate::Result;
use braid_cuda::{Device, DeviceBuffer};
use braid_model::cuda::f32_params::SideMap;
use braid_model::cuda::gpu_model::GpuModel;
use braid_model::cuda::mixed::{AdamSegments, MixedKernels};
use braid_model::cuda::model::GpuGpt as GpuGptF32;
use braid_model::cuda::model_mixed::Fp8Use;
use braid_model::cuda::model_mixed::{GpuGptMixed, MixedOptions};
use braid_model::optim::AdamWConfig;
use braid_model::Params;

impl GpuGpt {
    /// An engine on `device` starting from `params`, for batches of
    /// `(b, t)`, with AdamW's decoupled `weight_decay`; `options` (bf16
    /// only): activation checkpointing, streamed bf16 weights.
    pub fn new(
        device: &Device,
        params: &Params,
        shape: (usize, usize),
        precision: Precision,
        options: MixedOptions,
        weight_decay: f32,
    ) -> Result<GpuGpt> {
        Self::build(
            device,
            params,
            shape,
            precision,
            options,
            weight_decay,
            Master::OnGpu,
        )
    }

    /// [`new`](Self::new) for ZeRO-3: the parameters stay in host memory
    /// (taken from `params.data` without a copy, leaving it empty) until
    /// the strategy shards them, and the GPU receives only this rank's
    /// shard ([`ShardedParams::shard_params`]). Until then the engine runs no
    /// pass; its ranks compare the parameters' checksums instead of
    /// broadcasting them ([`EngineInfo::pending_params`]).
    ///
    /// [`ShardedParams::shard_params`]: crate::ShardedParams::shard_params
    /// [`EngineInfo::pending_params`]: crate::EngineInfo::pending_params
    pub fn for_sharding(
        device: &Device,
        params: &mut Params,
        shape: (usize, usize),
        precision: Precision,
        options: MixedOptions,
        weight_decay: f32,
    ) -> Result<GpuGpt> {
        if precision.mixed() && !options.streamed_weights {
            return Err(
                "ZeRO-3 on the GPU casts each gathered layer to bf16 as it runs: build the bf16 \
                 engine with streamed weights (MixedOptions::streamed_weights)"
                    .into(),
            );
        }
        let host = std::mem::take(&mut params.data);
        Self::build(
            device,
            params,
            shape,
            precision,
            options,
            weight_decay,
            Master::Pending(host),
        )
    }

    /// [`new`](Self::new) with the optimizer offloaded to host memory: the
    /// f32 master weights and AdamW's moments there (12 bytes per
    /// parameter), the update on the CPU, and on the GPU only the weights
    /// the passes read (bf16: 2 bytes per parameter and the f32
    /// embeddings, LayerNorms and biases; f32: 4) besides the gradients.
    /// Not with streamed weights (they are cast from f32 master weights on
    /// the GPU). Takes `params.data` as its master weights without a copy,
    /// leaving it empty ([`copy_params_to`](Self::copy_params_to) fills it
    /// again).
    pub fn offloaded(
        device: &Device,
        params: &mut Params,
        shape: (usize, usize),
        precision: Precision,
        options: MixedOptions,
        weight_decay: f32,
    ) -> Result<GpuGpt> {
        let master = std::mem::take(&mut params.data);
        Self::build(
            device,
            params,
            shape,
            precision,
            options,
            weight_decay,
            Master::Offloaded(master),
        )
    }

    /// The engine, its master weights where `master` says (`params.data`
    /// is not read unless they go on the GPU).
    fn build(
        device: &Device,
        params: &Params,
        (b, t): (usize, usize),
        precision: Precision,
        options: MixedOptions,
        weight_decay: f32,
        master: Master,
    ) -> Result<GpuGpt> {
        let (master, pending) = match master {
            Master::OnGpu => (None, None),
            Master::Offloaded(m) => (Some(m), None),
            Master::Pending(h) => (None, Some(h)),
        };
        let offload = master.is_some();
        if offload && options.streamed_weights {
            return Err(
                "an offloaded optimizer keeps the bf16 weights whole on the GPU: streamed \
                 weights (cast from f32 master weights on the GPU) do not go with it"
                    .into(),
            );
        }
        if options != MixedOptions::default() && !precision.mixed() {
            return Err(format!(
                "checkpointing and streamed weights are bf16-only in the GPU engine, not {}",
                precision.name()
            ));
        }
        let layout = params.layout.clone();
        let adam = AdamWConfig {
            weight_decay,
            ..Default::default()
        };
        let data = master
            .as_deref()
            .or(pending.as_deref())
            .unwrap_or(&params.data);
        if data.len() != layout.len {
            return Err(format!(
                "{} parameter values for a model of {}",
                data.len(),
                layout.len
            ));
        }
        let side = (offload && precision.mixed()).then(|| SideMap::for_mixed(&layout));
        let p = match &side {
            // This rank's shard comes up when the strategy shards.
            None if pending.is_some() => DeviceBuffer::zeros(device, 0).map_err(e)?,
            None => DeviceBuffer::from_host(device, data).map_err(e)?,
            Some(map) => {
                let mut packed = vec![0f32; map.len()];
                for (r, at) in map.parts() {
                    packed[*at..at + r.len()].copy_from_slice(&data[r.clone()]);
                }
                DeviceBuffer::from_host(device, &packed).map_err(e)?
            }
        };
        let mk = MixedKernels::load(device).map_err(e)?;
        let before = braid_cuda::pool::allocated_bytes();
        let model_bytes;
        let mut model: Box<dyn GpuModel> = match precision {
            Precision::F32 => {
                let m = GpuGptF32::new(device, layout.clone(), b, t).map_err(e)?;
                model_bytes = braid_cuda::pool::allocated_bytes().saturating_sub(before);
                Box::new(m)
            }
            Precision::Bf16 | Precision::Fp8 => {
                let mut m =
                    GpuGptMixed::with_options(device, layout.clone(), b, t, options).map_err(e)?;
                // The products in FP8 under --precision fp8, all of them
                // unless `BRAID_FP8` says (`forward`, `off`: experiments).
                let fp8 = Fp8Use::of_run(precision == Precision::Fp8)?;
                m.set_fp8(fp8).map_err(e)?;
                model_bytes = braid_cuda::pool::allocated_bytes().saturating_sub(before);
                // (A pipeline's first stage leaves its embeddings out.)
                let bf16_len = layout.bf16_len();
                let pb = match options.streamed_weights {
                    true => None,
                    // Filled from the host below.
                    false if offload => Some(DeviceBuffer::zeros(device, layout.len).map_err(e)?),
                    false => {
                        let mut pb = DeviceBuffer::zeros(device, bf16_len).map_err(e)?;
                        mk.to_bf16(m.stream(), &mut pb, &p.view(0..bf16_len))
                            .map_err(e)?;
                        Some(pb)
                    }
                };
                m.keep_weights_bf16(pb);
                Box::new(m)
            }
        };
        let mut p = p;
        // (`side` is there exactly when the bf16 model's optimizer is
        // offloaded.)
        let offload = match (master, side) {
            (None, _) => None,
            (Some(master), None) => Some(Offload::F32(HostOptimizer::new(
                device, &layout, master, adam, None,
            )?)),
            (Some(master), Some(map)) => {
                let mut host =
                    HostOptimizer::new(device, &layout, master, adam, Some(map.clone()))?;
                let (s, pb) = model.stream_and_weights_bf16();
                let pb = pb.expect("offload keeps the bf16 weights whole");
                host.upload(pb, Some(&mut p), s)?;
                Some(Offload::Bf16(host, map))
            }
        };
        Ok(GpuGpt {
            // AdamW's moments come at the first update (for the shard the
            // optimizer owns by then), so that a sharded run never holds
            // the whole buffer's.
            m: DeviceBuffer::zeros(device, 0).map_err(e)?,
            v: DeviceBuffer::zeros(device, 0).map_err(e)?,
            steps: plan(&layout, 0),
            carry: None,
            by_unit: None,
            half: None,
            sync_limit: braid_core::world::WorldInfo::timeout_from_env(
                braid_comm::communicator::DEFAULT_TIMEOUT,
            )
            .map_err(e)?,
            group: None,
            units: match model.streams_weights() {
                // The head's backward pass reads the bf16 token embeddings
                // its forward pass cast, not the f32 ones.
                true => head_reads_cast_embeddings(gpt_param_units(&layout)),
                false => gpt_param_units(&layout),
            },
            sharded: false,
            forward_grad: false,
            released: false,
            shard: optimizer_ranges(std::slice::from_ref(&(0..layout.len)), layout.bf16_len())
                .into_iter()
                .map(|(r, at)| {
                    let segs = AdamSegments::shard(device, &layout, adam.weight_decay, r.clone());
                    Ok((r, at, segs.map_err(e)?))
                })
                .collect::<Result<_>>()?,
            updates: 0,
            layout,
            model,
            precision,
            mk,
            p,
            offload,
            pending,
            adam,
            b,
            t,
            model_bytes,
        })
    }
}
