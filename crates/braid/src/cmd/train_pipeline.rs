//! `braid train --pp N`: a rank's pipeline stages on the CPU — the
//! schedule (`--schedule`, a built-in or a file, checked), the stages'
//! layers (`--stage-layers` or balanced), the rank's part of the model
//! cut from the whole, and the engine that runs its stages.

use braid_model::{Layout, Params, Stage};
use braid_train::engines::{CpuGpt, CpuOptimizer, CpuStage};
use braid_train::pipeline::assign::assign;
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

/// Every stage's layers for a model of `layers` layers under `s`.
pub fn stages(layers: usize, s: &Schedule, flags: &PipeFlags<'_>) -> Result<Vec<Stage>, String> {
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
    assign(layers, s.stages(), given.as_deref())
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

/// Pipeline rank `group.rank()`'s engine: its stages' parameters cut out
/// of `whole` (the whole model's), for micro-batches of `b × t`.
#[allow(clippy::too_many_arguments)]
pub fn engine(
    whole: &Params,
    s: Schedule,
    all: &[Stage],
    group: braid_comm::Communicator,
    how: CpuOptimizer,
    b: usize,
    t: usize,
    checkpointing: bool,
) -> Result<CpuStage, String> {
    let rank = group.rank();
    let layout = layouts(&whole.layout, &s, all)?.swap_remove(rank);
    let mut data = vec![0.0f32; layout.len];
    for (block, range) in &layout.blocks {
        data[range.clone()].copy_from_slice(&whole.data[whole.layout.block_range(*block)]);
    }
    let mine = s
        .stages_of(rank)
        .into_iter()
        .map(|i| (i, all[i].clone()))
        .collect();
    let inner = CpuGpt::new(Params { layout, data }, b, t, checkpointing, how);
    CpuStage::new(inner, mine, s, group, b, t, checkpointing)
}
