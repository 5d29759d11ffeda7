//! `braid train --device cuda` without `--pp`: the GPU run once `braid
//! train` has set it up — the run's communicator on the GPUs and the
//! tensor and data groups, the device and its memory pre-flight (the
//! plan said at start), the engine (sharded, offloaded or whole; a
//! tensor-parallel share), the strategy, the loop, and for `--save` the
//! whole model back on the host.

use super::preflight::Shape;
use super::train::LoopParts;
use braid_comm::gpu::GpuCommunicator;
use braid_comm::Communicator;
use braid_model::{GptConfig, Params};
use braid_train::assemble::{strategy, ShardChoice, TensorSide};
use braid_train::collective::DeviceCollective;
use braid_train::ddp::DdpOptions;
use braid_train::engines::{GpuGpt, Precision};
use braid_train::place::Place;
use braid_train::{train_lending, EngineInfo, RunReport};
use std::time::Instant;

/// What a GPU run takes from `braid train`'s set-up.
pub struct GpuRun<'r> {
    /// The world's communicator, where the run has several ranks (or
    /// shards over one).
    pub comm: Option<&'r Communicator>,
    pub cfg: GptConfig,
    /// The whole model's parameters: moved to the GPU (the host copy is
    /// dropped unless offloaded), and with `save` back on the host at the
    /// end where this rank saves.
    pub params: &'r mut Params,
    /// The memory pre-flight's view of the run.
    pub shape: &'r Shape<'r>,
    /// A rank's rows per micro-batch, and the sequence length.
    pub batch: usize,
    pub seq: usize,
    pub place: &'r Place,
    /// Data-parallel ranks.
    pub ranks: usize,
    pub precision: Precision,
    pub zero: Option<u8>,
    pub offload: bool,
    /// Layers deferring their weight gradients.
    pub defer: usize,
    pub weight_decay: f32,
    pub checkpointing: bool,
    /// `--save`.
    pub save: bool,
    pub shard_choice: ShardChoice,
    pub ddp: DdpOptions,
}

/// Runs training on the GPUs; `parts` is what the loop takes
/// besides the engine and the strategy.
pub fn run(r: GpuRun<'_>, parts: &mut LoopParts<'_, '_>) -> Result<RunReport, String> {
    let GpuRun {
        comm,
        cfg,
        params,
        shape,
        batch,
        seq,
        place,
        ranks,
        precision,
        zero,
        offload,
        defer,
        weight_decay,
        checkpointing,
        save,
        mut shard_choice,
        ddp,
    } = r;
    let lead = parts.lead;
    let gpu = match comm {
        Some(c) => Some(GpuCommunicator::init_from_env(c).map_err(|e| e.to_string())?),
        None => None,
    };
    // Under --tp: the tensor and data groups, split from the world.
    let groups = match (&gpu, place.tensor) {
        (Some(g), n) if n > 1 => Some(braid_train::place::split_gpu(g, place)?),
        _ => None,
    };
    if let (true, Some(g)) = (lead, &groups) {
        println!("mesh: {}", g.layout);
    }
    let dev = match &gpu {
        Some(g) => g.device().clone(),
        None => {
            let local = braid_core::world::local_rank_from_env().unwrap_or(0);
            braid_cuda::Device::open(local).map_err(|e| format!("--device cuda: {e}"))?
        }
    };
    if lead {
        println!(
            "training on GPU {} ({}), {}{}{}",
            dev.ordinal(),
            dev.name().unwrap_or_default(),
            precision.name(),
            match offload {
                true => ", optimizer offloaded to host memory",
                false => "",
            },
            if ranks > 1 { ", one GPU per rank" } else { "" }
        );
    }
    let plan = super::preflight::device(shape, &cfg, &dev, precision, batch, defer)?;
    if lead && plan.estimate > 0 {
        let mut lean: Vec<String> = Vec::new();
        if plan.streamed_weights {
            lean.push("bf16 weights cast layer by layer instead of a full copy".into());
        }
        if plan.fused_attention && !plan.stored_score_grads {
            lean.push("attention score gradients recomputed, not stored".into());
        }
        if plan.fused_attention && checkpointing {
            match plan.kept_attention {
                0 if plan.recompute_attention_output => lean.push(
                    "the attention recomputed with its output: each layer saves its input alone"
                        .into(),
                ),
                0 => lean.push("the attention recomputed too".into()),
                k if k < cfg.n_layer => lean.push(format!(
                    "the attention's state kept in the last {k} of {} layers, recomputed \
                     in the rest",
                    cfg.n_layer
                )),
                _ => {}
            }
        }
        match (plan.saved_in_grads, zero) {
            (true, Some(_)) => {
                lean.push("saved activations in the gradient shard until it fills".into())
            }
            (true, None) => lean.push(
                "saved activations in the gradient buffer until the backward pass writes it".into(),
            ),
            (false, _) => {}
        }
        if plan.half_gathers {
            lean.push("layers gathered in bf16".into());
        }
        if plan.split_embeddings {
            lean.push("the embeddings' gradients reduce-scattered in two parts".into());
        }
        println!(
            "GPU memory estimate: {:.2} GiB{}",
            braid_model::footprint::gib(plan.estimate),
            match lean.is_empty() {
                true => String::new(),
                false => format!(" ({})", lean.join("; ")),
            }
        );
        if !plan.per_ranks.is_empty() {
            let at: Vec<String> = plan
                .per_ranks
                .iter()
                .map(|(n, b)| format!("{n} ranks {:.2} GiB", braid_model::footprint::gib(*b)))
                .collect();
            println!(
                "GPU memory estimate per rank under ZeRO-3 at: {}",
                at.join(", ")
            );
        }
    }
    shard_choice.saved_in_grads = plan.saved_in_grads;
    parts.opts.saved_in_grads = plan.saved_in_grads && zero.is_none();
    shard_choice.half_gathers = plan.half_gathers;
    shard_choice.split_reduce = plan.split_embeddings;
    braid_cuda::pool::reset_peak();
    // The bf16 engine sizes its rows for sequence parallelism when built.
    let bf16_sequence = place.sequence && groups.is_some() && precision.mixed();
    super::train_mesh::sequence_knobs(bf16_sequence)?;
    let options = braid_model::cuda::model_mixed::MixedOptions {
        checkpointing,
        streamed_weights: plan.streamed_weights,
        stored_score_grads: plan.stored_score_grads,
        kept_attention: plan.kept_attention,
        recompute_attention_output: plan.recompute_attention_output,
        sequence_parallel: bf16_sequence,
    };
    let shape = (batch, seq);
    let started = Instant::now();
    // ZeRO-3 uploads only each rank's shard: the whole model never
    // sits on one GPU (the parameters wait in host memory until then).
    let sharded_start = zero == Some(3) && !offload;
    let mut engine = match offload {
        false if sharded_start => {
            GpuGpt::for_sharding(&dev, params, shape, precision, options, weight_decay)?
        }
        false => GpuGpt::new(&dev, params, shape, precision, options, weight_decay)?,
        // The master weights move into the engine (host memory holds
        // them once).
        true => GpuGpt::offloaded(&dev, params, shape, precision, options, weight_decay)?,
    };
    if lead {
        let what = match sharded_start {
            // Each rank's shard goes up when the strategy starts.
            true => "engine built (the parameters wait in host memory for their shards)",
            false => "model copied to the GPU",
        };
        super::train::slow_note(what, started, cfg.num_params());
    }
    if !offload {
        // The engine holds the parameters now; a --save makes the host
        // copy again at the end (at billions of parameters it is tens
        // of GB per worker).
        params.data = Vec::new();
    }
    engine.defer_weight_grads(defer)?;
    let mut engine = match &groups {
        Some(g) => engine
            .tensor_parallel(g.tensor.clone(), place.sequence)?
            .overlap_tensor_sums(super::train_mesh::tensor_overlap_blocks()?)
            .sum_tensor_products_in_bf16(super::train_mesh::tensor_sums_in_bf16()?)
            .sum_input_grads_beside_weight_grads(super::train_mesh::tensor_grad_sums_beside()?),
        None => engine,
    };
    let tensor_host = groups.as_ref().map(|g| g.tensor_host.clone());
    let several = gpu.is_some();
    let (data, tensor) = match (gpu, groups) {
        (None, _) => (None, None),
        (Some(g), None) => (Some(DeviceCollective::new(g)?), None),
        (Some(g), Some(gr)) => (
            Some(DeviceCollective::new(gr.data)?),
            Some(TensorSide {
                world: g.host().clone(),
                tensor: place.tensor,
                sequence: place.sequence,
                mesh: gr.layout,
                traffic: gr.tensor.traffic(),
            }),
        ),
    };
    let mut s = strategy(data, &place.mesh()?, tensor, shard_choice, ddp)?;
    let run = super::train::run_loop(parts, &mut engine, &mut *s, several, train_lending);
    drop(s);
    let mut run = run?;
    run.model_buffer_bytes = engine.model_bytes() as u64;
    if lead {
        println!(
            "device memory of the model's activations and pass buffers: {:.1} MB per GPU",
            engine.model_bytes() as f64 / 1e6
        );
        if let Some(report) = engine.profile_report() {
            println!("{report}");
        }
        if let Some(cpu) = engine.offload_cpu_seconds() {
            println!(
                "offloaded optimizer: the last update took {cpu:.2} s on the CPU ({} threads)",
                rayon::current_num_threads()
            );
        }
    }
    // Under --tp every rank of the first data group holds a share.
    let saves = lead || (tensor_host.is_some() && place.data_rank() == 0);
    if saves && save {
        // Ends the engine first: an offloaded optimizer's master
        // weights move over instead of being copied.
        engine.into_params(params)?;
        if let Some(g) = &tensor_host {
            *params = braid_train::tensor_parallel::gather_whole(params, &**g)?;
        }
    }
    Ok(run)
}
