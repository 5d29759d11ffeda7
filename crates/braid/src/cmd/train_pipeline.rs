//! `braid train --pp N`: a rank's pipeline stages on CPUs or a GPU — the
//! schedule (`--schedule`, a built-in or a file, checked), the stages'
//! layers (`--stage-layers` or balanced), the rank's part of the model
//! cut from the whole, and the engine that runs its stages.

use super::preflight::Room;
use braid_model::cuda::model_mixed::MixedOptions;
use braid_model::footprint::Sharding;
use braid_model::tensor_comm::TensorComm;
use braid_model::{GptConfig, Layout, Params, Stage};
use braid_train::engines::{CpuGpt, CpuOptimizer, CpuStage, GpuGpt, GpuStage, Precision};
use braid_train::pipeline::assign::{assign, head_cost};
use braid_train::pipeline::memory::{
    stage_activations, stage_states, StageActivations, StageStates,
};
use braid_train::schedule::build::ScheduleKind;
use braid_train::schedule::check::Checked;
use braid_train::schedule::Schedule;
use std::sync::Arc;

/// What `--pp`, `--micro-batches`, `--schedule` and `--stage-layers` ask.
pub struct PipeFlags<'a> {
    /// Pipeline ranks.
    pub ranks: usize,
    /// Micro-batches per step.
    pub micro: usize,
    /// A built-in schedule's name, or a schedule file's path.
    pub schedule: &'a str,
    /// Each stage's layer count, comma-separated.
    pub stage_layers: Option<&'a str>,
}

/// The schedule `flags` ask for (built, or read from a file), checked.
pub fn schedule(flags: &PipeFlags<'_>) -> Result<Checked, String> {
    let s = match ScheduleKind::parse(flags.schedule) {
        Ok(kind) => kind.build(flags.ranks, flags.micro)?,
        Err(e) => {
            let path = std::path::Path::new(flags.schedule);
            if !path.exists() {
                return Err(e);
            }
            let text = std::fs::read_to_string(path)
                .map_err(|x| format!("--schedule {}: {x}", path.display()))?;
            let s = braid_train::schedule::text::parse(&path.display().to_string(), &text)?;
            if (s.ranks, s.micro_batches) != (flags.ranks, flags.micro) {
                return Err(format!(
                    "--schedule {}: a schedule for {} ranks and {} micro-batches, this run has \
                     --pp {} and --micro-batches {}",
                    path.display(),
                    s.ranks,
                    s.micro_batches,
                    flags.ranks,
                    flags.micro
                ));
            }
            s
        }
    };
    Checked::new(s)
}

/// The schedule `flags` ask for, checked with the run's other settings in
/// one order, the most basic first: the schedule itself, then the stages
/// against the model's layers (`cfg`, when known before loading; `model`
/// names it in advice), then the micro-batches against the batch per rank
/// (`batch`, when known).
pub fn checked(
    flags: &PipeFlags<'_>,
    cfg: Option<&GptConfig>,
    model: &str,
    batch: Option<usize>,
) -> Result<Checked, String> {
    let s = schedule(flags)?;
    if let Some(cfg) = cfg {
        stages(cfg, &s, flags).map_err(|e| deeper_model_advice(e, cfg, model, s.stages()))?;
    }
    if let Some(b) = batch {
        check_micro(b, flags.micro)?;
    }
    Ok(s)
}

/// `why` (a split the model's layers cannot make), with a model deep
/// enough named where the model has fewer layers than stages.
fn deeper_model_advice(why: String, cfg: &GptConfig, model: &str, stages: usize) -> String {
    if cfg.n_layer >= stages {
        return why;
    }
    format!(
        "{why}; the model {model} has {} layers: one with a layer per stage, e.g. --model \
         L{}-H{}-C{}, runs this schedule",
        cfg.n_layer,
        stages.max(4),
        cfg.n_head,
        cfg.n_embd
    )
}

/// Refuses `micro` micro-batches that do not split a rank's `batch`.
pub fn check_micro(batch: usize, micro: usize) -> Result<(), String> {
    if micro == 0 || batch % micro != 0 {
        return Err(format!(
            "--micro-batches {micro}: the batch of {batch} per rank does not split into {micro} \
             micro-batches (pick --micro-batches dividing {batch}, or a --batch or \
             --global-batch that {micro} divides)"
        ));
    }
    Ok(())
}

/// Every stage's layers for a model of `cfg` under `s`.
pub fn stages(cfg: &GptConfig, s: &Schedule, flags: &PipeFlags<'_>) -> Result<Vec<Stage>, String> {
    let given = match flags.stage_layers {
        None => None,
        Some(text) => Some(
            text.split(',')
                .map(|n| {
                    n.trim().parse::<usize>().map_err(|_| {
                        format!("--stage-layers {text}: expected layer counts like 3,5,5,3")
                    })
                })
                .collect::<Result<Vec<_>, _>>()?,
        ),
    };
    let head = head_cost(cfg.n_embd, cfg.vocab_size, cfg.context);
    assign(cfg.n_layer, s.stages(), given.as_deref(), head)
}

/// Each stage's estimated time, in layers (the head counted on the last,
/// as the split by time counts it): the timeline's paper bubble with the
/// stages as split.
pub fn stage_costs(cfg: &GptConfig, all: &[Stage]) -> Vec<f64> {
    let head = head_cost(cfg.n_embd, cfg.vocab_size, cfg.context);
    all.iter()
        .map(|st| st.layers.len() as f64 + if st.last { head } else { 0.0 })
        .collect()
}

/// The layout of pipeline rank `rank`'s stages, for every rank.
/// (`BRAID_PP_EMBEDDINGS=first` keeps the first stage's embeddings in the
/// whole model's order, and in its bf16 copy; `last`, the default, puts
/// them after its layers and out of the copy: `Layout::bf16_len`.)
pub fn layouts(whole: &Layout, s: &Schedule, all: &[Stage]) -> Result<Vec<Arc<Layout>>, String> {
    let last = super::preflight::env_choice(braid_core::env::BRAID_PP_EMBEDDINGS, "last", "first")?
        != Some(false);
    (0..s.ranks)
        .map(|r| {
            let mine = s.stages_of(r).into_iter().map(|i| all[i].clone()).collect();
            whole.pipeline_stages_ordered(mine, last).map(Arc::new)
        })
        .collect()
}

/// Pipeline rank `rank`'s part of `whole` (the whole model's parameters):
/// its stages' blocks, and the stages by global index.
fn part(
    whole: &Params,
    s: &Schedule,
    all: &[Stage],
    rank: usize,
) -> Result<(Params, Vec<(usize, Stage)>), String> {
    let layout = layouts(&whole.layout, s, all)?.swap_remove(rank);
    let mut data = vec![0.0f32; layout.len];
    for (block, range) in &layout.blocks {
        data[range.clone()].copy_from_slice(&whole.data[whole.layout.block_range(*block)]);
    }
    let mine = s
        .stages_of(rank)
        .into_iter()
        .map(|i| (i, all[i].clone()))
        .collect();
    Ok((Params { layout, data }, mine))
}

/// Pipeline rank `group.rank()`'s engine on the CPU: its stages'
/// parameters cut out of `whole` (a tensor-parallel rank's share under
/// `--tp`, whose group and sequence parallelism `tensor` gives), for
/// micro-batches of `b × t`, stepping with `how` (offloaded with the
/// second of the pair: `--offload optimizer`).
#[allow(clippy::too_many_arguments)]
pub fn engine(
    whole: &Params,
    s: Checked,
    all: &[Stage],
    group: braid_comm::Communicator,
    tensor: Option<(Arc<dyn TensorComm>, bool)>,
    (how, offload): (CpuOptimizer, bool),
    b: usize,
    t: usize,
    checkpointing: bool,
) -> Result<CpuStage, String> {
    let (params, mine) = part(whole, &s, all, group.rank())?;
    let inner = match tensor {
        None => CpuGpt::new(params, b, t, checkpointing, how),
        Some((comm, sequence)) => {
            CpuGpt::tensor_parallel(params, b, t, checkpointing, how, comm, sequence)?
        }
    };
    let inner = match offload {
        true => inner.offloaded()?,
        false => inner,
    };
    CpuStage::new(inner, mine, s, group, b, t, checkpointing)
}

/// Pipeline rank `group.rank()`'s engine on its GPU: as [`engine`], in
/// `precision` with the bf16 engine's `options`; under `--tp` a share of
/// the stages over the tensor group `tensor`.
#[allow(clippy::too_many_arguments)]
pub fn gpu_engine(
    whole: &Params,
    s: Checked,
    all: &[Stage],
    group: braid_comm::gpu::GpuCommunicator,
    tensor: Option<Arc<dyn braid_model::tensor_comm::DeviceTensorComm>>,
    precision: Precision,
    options: MixedOptions,
    weight_decay: f32,
    b: usize,
    t: usize,
) -> Result<GpuStage, String> {
    let (params, mine) = part(whole, &s, all, group.rank())?;
    let device = group.device().clone();
    // (The f32 engine takes no bf16 options.)
    let options = match precision {
        Precision::Bf16 | Precision::Fp8 => options,
        Precision::F32 => MixedOptions::default(),
    };
    let inner = GpuGpt::new(&device, &params, (b, t), precision, options, weight_decay)?;
    // A tensor-parallel rank's share (with sequence parallelism where the
    // bf16 model was built for it).
    let inner = match tensor {
        Some(comm) => inner
            .tensor_parallel(comm, options.sequence_parallel)?
            .overlap_tensor_sums(super::train_mesh::tensor_overlap_blocks()?)
            .sum_tensor_products_in_bf16(super::train_mesh::tensor_sums_in_bf16()?)
            .sum_input_grads_beside_weight_grads(super::train_mesh::tensor_grad_sums_beside()?),
        None => inner,
    };
    GpuStage::new(inner, mine, s, group, b, t)
}

/// What a pipeline rank's stages are sized by, for [`fitting_form`].
pub struct StageFit<'a> {
    pub cfg: &'a GptConfig,
    pub schedule: &'a Schedule,
    pub all: &'a [Stage],
    /// Each pipeline rank's layout.
    pub layouts: &'a [Arc<Layout>],
    /// A micro-batch's rows and tokens.
    pub rows: (usize, usize),
    pub precision: Precision,
    /// The fused attention runs (bf16).
    pub fused: bool,
    /// Ranks per tensor group.
    pub tensor: usize,
    /// The data dimension: its replicas and ZeRO stage (1 shards AdamW's
    /// moments over them).
    pub data: Sharding,
    /// The forms to try, fastest first: the bf16 weights streamed or
    /// not, then the score gradients stored or not.
    pub weights: Vec<bool>,
    pub scores: Vec<bool>,
    /// The options the forms leave as they are.
    pub base: MixedOptions,
}

/// The fastest form of pipeline rank `rank`'s stages that fits `space`
/// (`None`: the free memory unknown and no budget, the first form), with
/// its activations (the bf16 engine's, from the sizes it allocates) and
/// its model states' bytes; else the leanest form's refusal.
pub(super) fn fitting_form(
    f: &StageFit<'_>,
    rank: usize,
    space: Option<&Room>,
) -> Result<(MixedOptions, Option<StageActivations>, u64), String> {
    let mixed = f.precision.mixed();
    let mut refusal = String::from("no memory form to try");
    for &streamed_weights in &f.weights {
        for &stored_score_grads in &f.scores {
            let options = MixedOptions {
                streamed_weights,
                stored_score_grads,
                ..f.base
            };
            let acts = mixed.then(|| {
                stage_activations(
                    f.cfg, f.schedule, f.all, rank, f.rows, &options, f.fused, f.tensor,
                )
            });
            let layout = &f.layouts[rank];
            let streamed = options.streamed_weights;
            match check_stage_fits(
                space,
                rank,
                layout,
                f.precision,
                streamed,
                f.data,
                acts.as_ref(),
            ) {
                Ok(states) => return Ok((options, acts, states)),
                Err(e) => refusal = e,
            }
        }
    }
    Err(refusal)
}

/// Refuses, before anything is allocated, a pipeline rank whose stages'
/// model states (the parameters of `layout` over the data dimension
/// `data`, as `pipeline::memory::stage_states` counts them; the bf16 copy
/// unless `streamed`) and `activations` (where estimated: the bf16 engine's)
/// exceed `space` (the GPU's free memory, or `--gpu-memory`; `None`:
/// neither known); returns the model states' bytes.
fn check_stage_fits(
    space: Option<&Room>,
    rank: usize,
    layout: &braid_model::Layout,
    precision: Precision,
    streamed: bool,
    data: Sharding,
    activations: Option<&StageActivations>,
) -> Result<u64, String> {
    let held = layout.len;
    let StageStates {
        bytes: states,
        per_parameter: per,
    } = stage_states(
        (layout.len, layout.bf16_len()),
        precision.mixed() && !streamed,
        data,
    );
    let states = states as u64;
    let Some(space) = space else {
        return Ok(states);
    };
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let acts = activations.map_or(0, |a| a.total() as u64);
    if let Some(a) = activations {
        if space.fits(states as u128) && !space.fits(states as u128 + a.total()) {
            return Err(format!(
                "pipeline rank {rank}'s stages need about {:.2} GiB, but there is {}: model \
                 states {:.2} GiB, and activations {:.2} GiB ({} micro-batches in flight at once, \
                 {:.1} MB each on its first stage, and {:.2} GiB of scratch). Use \
                 --checkpointing, more micro-batches of fewer rows (--micro-batches), more \
                 pipeline stages (--pp), or move layers off this stage (--stage-layers)",
                gib(states + acts),
                space.said(),
                gib(states),
                gib(acts),
                a.in_flight,
                a.per_micro_batch as f64 / 1e6,
                gib(a.shared as u64),
            ));
        }
    }
    if !space.fits(states as u128) {
        return Err(format!(
            "pipeline rank {rank}'s stages hold {held} parameters: their model states need {:.2} \
             GiB ({per:.1} bytes a parameter: weights, {}gradients, AdamW's moments{}), but \
             there is {} before activations. Use more pipeline stages (--pp), move layers off \
             this stage (--stage-layers){}{}",
            gib(states),
            match precision {
                Precision::Bf16 | Precision::Fp8 if !streamed => "their bf16 copy, ",
                _ => "",
            },
            match data.stage {
                0 => "",
                _ => " sharded over the data dimension",
            },
            space.said(),
            match data.stage == 0 && data.ranks > 1 {
                true => ", shard AdamW's moments over the data dimension (--zero 1)",
                false => "",
            },
            match precision {
                Precision::Bf16 | Precision::Fp8 if !streamed => {
                    ", or cast the bf16 weights layer by layer (BRAID_BF16_WEIGHTS=streamed)"
                }
                _ => "",
            }
        ));
    }
    Ok(states)
}

/// Prints the stages' layers and the schedule (the lead rank, at start).
pub fn print_plan(all: &[Stage], s: &Schedule, batch: usize, seq: usize) {
    let shown: Vec<String> = all
        .iter()
        .enumerate()
        .map(|(i, st)| format!("{i}: layers {}..{}", st.layers.start, st.layers.end))
        .collect();
    println!(
        "pipeline: {} stages over {} ranks ({}), schedule {}, {} micro-batches of {} x {}",
        all.len(),
        s.ranks,
        shown.join(", "),
        s.name,
        s.micro_batches,
        batch / s.micro_batches,
        seq
    );
}
