//! `braid train`'s parameters: the model checked against a resumed
//! checkpoint and its tensor-parallel share, the memory pre-flight's
//! shape of the run, and the parameters loaded or initialised in the
//! layout the run trains on once the pre-flight says they fit.

use super::preflight::Shape;
use super::train::{
    defer_layers, same_model_as_checkpoint, slow_note, train_layout, OptimizerKind, TrainArgs,
};
use super::train_check::Choices;
use super::train_model::ModelData;
use super::train_place::Placement;
use braid_model::checkpoint;
use braid_model::cuda::model_mixed::Fp8Use;
use braid_model::footprint::Sharding;
use braid_model::{GptConfig, Params};
use braid_train::collective::GradComm;
use braid_train::engines::Precision;
use braid_train::loader::check_fits;
use std::sync::Arc;
use std::time::Instant;

/// A tensor-parallel rank's share of the parameters (what its model
/// states are measured against), after the model is checked against the
/// checkpoint it resumes; heads that do not split are refused here,
/// before any memory.
pub fn tensor_share(
    a: &TrainArgs,
    c: &Choices,
    p: &Placement,
    m: &ModelData,
) -> Result<Option<u64>, String> {
    same_model_as_checkpoint(&m.cfg, &c.model, c.resumed.as_ref())?;
    Ok(match a.tp {
        1 => None,
        _ => Some(
            braid_model::layout::Layout::tensor_parallel(&m.cfg, p.place.shard(), 1)?.len as u64,
        ),
    })
}

/// The run as the memory pre-flight sees it.
pub fn shape<'m>(a: &TrainArgs, c: &Choices, p: &Placement, m: &'m ModelData) -> Shape<'m> {
    Shape {
        model: &m.model_name,
        seq: m.seq,
        checkpointing: a.checkpointing,
        sharding: Sharding {
            stage: c.zero.unwrap_or(0),
            ranks: p.shard_group,
        },
        ranks: p.ranks,
        local_workers: c.world.as_ref().map_or(1, |w| w.local_world_size),
        offload: c.offload,
        accum: a.accum,
        tensor: a.tp,
        sequence: c.sequence,
        plain_grads: c.grad_comm == GradComm::Plain,
        gpu_memory: c.gpu_memory,
        // (A bad BRAID_FP8 is refused where the engine is built.)
        fp8: match c.precision {
            Precision::F32 => Fp8Use::Off,
            p => Fp8Use::of_run(p == Precision::Fp8).unwrap_or(Fp8Use::Off),
        },
    }
}

/// How many layers defer their weight gradients: none under ZeRO (its
/// buckets hold whole layers), else `--defer-layers` or its default.
pub fn deferred_layers(a: &TrainArgs, c: &Choices, ranks: usize, layers: usize) -> usize {
    // ZeRO's buckets hold whole layers: no deferred weight gradients.
    match c.zero {
        Some(_) => 0,
        None => defer_layers(a.defer_layers, c.precision, ranks, layers),
    }
}

/// The parameters, in the layout the run trains on: read from `--load`,
/// or initialised; each after the pre-flight (and a `--seq` past the
/// context refused before it).
pub fn parameters(
    a: &TrainArgs,
    c: &Choices,
    p: &Placement,
    m: &ModelData,
    shape: &Shape<'_>,
) -> Result<Params, String> {
    let cfg = &m.cfg;
    let tensor = p.place.shard();
    // Before the memory pre-flight: a --seq past the context is the
    // cause, not the memory it would take.
    check_fits(cfg, m.seq, &*m.data.source)?;
    if c.cuda && c.world.is_none() {
        super::gpus_for(&a.device)?;
    }
    // Both arms give the parameters in the layout the run trains on.
    Ok(match &a.load {
        Some(path) => {
            preflight(a, c, p, shape, cfg)?;
            // Read straight into that layout: one copy of the model.
            let layout = train_layout(cfg, c.zero, p.shard_group, tensor)?;
            checkpoint::load_as(path, |_| layout)
                .map_err(|e| e.to_string())?
                .0
        }
        None => {
            preflight(a, c, p, shape, cfg)?;
            let started = Instant::now();
            // Drawn straight into the layout the run trains on (values by
            // tensor and chunk, not by offset: the same either way).
            let params = Params::init_gpt2(
                Arc::new(train_layout(cfg, c.zero, p.shard_group, tensor)?),
                a.seed,
            );
            if p.lead {
                slow_note("parameters initialised", started, cfg.num_params());
            }
            params
        }
    })
}

/// The memory pre-flight, before the host spends time reading or
/// initialising a model it (or the GPU) cannot hold; the GPU is checked
/// again, with the same figures, once the run's device is set up.
fn preflight(
    a: &TrainArgs,
    c: &Choices,
    p: &Placement,
    shape: &Shape<'_>,
    cfg: &GptConfig,
) -> Result<(), String> {
    let adamw = c.optimizer == OptimizerKind::AdamW;
    super::preflight::host(shape, cfg, p.batch, c.cuda, c.precision, adamw)?;
    // (A pipeline rank holds its stages only: the whole model's
    // figures do not apply; not estimated yet.)
    if c.cuda && a.pp == 1 {
        let local = braid_core::world::local_rank_from_env().unwrap_or(0);
        let dev = braid_cuda::Device::open(local).map_err(|e| format!("--device cuda: {e}"))?;
        let defer = deferred_layers(a, c, p.ranks, cfg.n_layer);
        super::preflight::device(shape, cfg, &dev, c.precision, p.batch, defer)?;
    }
    Ok(())
}
