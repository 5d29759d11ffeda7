//! `braid train --pp N`: a rank's pipeline stages on CPUs or a GPU — the
//! schedule (`--schedule`, a built-in or a file, checked), the stages'
//! layers (`--stage-layers` or balanced), the rank's part of the model
//! cut from the whole, and the engine that runs its stages.

use braid_model::cuda::model_mixed::MixedOptions;
use braid_model::tensor_comm::TensorComm;
use braid_model::{GptConfig, Layout, Params, Stage};
use braid_train::engines::{CpuGpt, CpuOptimizer, CpuStage, GpuGpt, GpuStage, Precision};
use braid_train::pipeline::assign::{assign, head_cost};
use braid_train::schedule::build::ScheduleKind;
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
pub fn schedule(flags: &PipeFlags<'_>) -> Result<Schedule, String> {
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
    braid_train::schedule::check::check(&s)?;
    Ok(s)
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

/// The layout of pipeline rank `rank`'s stages, for every rank.
pub fn layouts(whole: &Layout, s: &Schedule, all: &[Stage]) -> Result<Vec<Arc<Layout>>, String> {
    (0..s.ranks)
        .map(|r| {
            let mine = s.stages_of(r).into_iter().map(|i| all[i].clone()).collect();
            whole.pipeline_stages(mine).map(Arc::new)
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
/// micro-batches of `b × t`.
#[allow(clippy::too_many_arguments)]
pub fn engine(
    whole: &Params,
    s: Schedule,
    all: &[Stage],
    group: braid_comm::Communicator,
    tensor: Option<(Arc<dyn TensorComm>, bool)>,
    how: CpuOptimizer,
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
    CpuStage::new(inner, mine, s, group, b, t, checkpointing)
}

/// Pipeline rank `group.rank()`'s engine on its GPU: as [`engine`], in
/// `precision` with the bf16 engine's `options`; under `--tp` a share of
/// the stages over the tensor group `tensor`.
#[allow(clippy::too_many_arguments)]
pub fn gpu_engine(
    whole: &Params,
    s: Schedule,
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
        Precision::Bf16 => options,
        Precision::F32 => MixedOptions::default(),
    };
    let inner = GpuGpt::new(&device, &params, (b, t), precision, options, weight_decay)?;
    // A tensor-parallel rank's share, without sequence parallelism.
    let inner = match tensor {
        Some(comm) => inner.tensor_parallel(comm, false)?,
        None => inner,
    };
    GpuStage::new(inner, mine, s, group, b, t)
}

/// Refuses, before anything is allocated, a pipeline rank whose stages'
/// model states alone (the parameters of `layout`: f32 weights, the bf16
/// copy unless `streamed` — of all but a first stage's embeddings —, the
/// stage's gradients and, with `reduced`, the strategy's, AdamW's two
/// moments) exceed the GPU's free memory; returns those bytes.
/// Activations are not estimated for stages yet.
pub fn check_stage_fits(
    dev: &braid_cuda::Device,
    rank: usize,
    layout: &braid_model::Layout,
    precision: Precision,
    streamed: bool,
    reduced: bool,
) -> Result<u64, String> {
    let held = layout.len;
    let bf16 = match precision {
        Precision::Bf16 if !streamed => layout.bf16_len(),
        _ => 0,
    };
    let per = 4 + 4 + 8 + if reduced { 4 } else { 0 };
    let need = (held * per + bf16 * 2) as u64;
    let per = per + if bf16 > 0 { 2 } else { 0 };
    let Ok(free) = dev.free_memory() else {
        return Ok(need);
    };
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    if need as u128 + super::preflight::DEVICE_MARGIN > free as u128 {
        return Err(format!(
            "pipeline rank {rank}'s stages hold {held} parameters: their model states need {:.2} \
             GiB (up to {per} bytes a parameter: weights, {}gradients, AdamW's moments) of the {:.2} GiB \
             free on this GPU, before activations. Use more pipeline stages (--pp), move layers \
             off this stage (--stage-layers){}",
            gib(need),
            match precision {
                Precision::Bf16 if !streamed => "their bf16 copy, ",
                _ => "",
            },
            gib(free as u64),
            match precision {
                Precision::Bf16 if !streamed => {
                    ", or cast the bf16 weights layer by layer (BRAID_BF16_WEIGHTS=streamed)"
                }
                _ => "",
            }
        ));
    }
    Ok(need)
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
