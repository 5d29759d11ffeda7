//! `braid train --pp N`: the pipeline's run once `braid train` has set it
//! up — the stages and their layouts, the mesh's pipeline, tensor and data
//! groups, the engine on GPUs (the memory pre-flight of this rank's stages
//! first) or on CPUs, the training loop, the timeline, and for `--save`
//! the whole model gathered from every stage. Before it, the strategy's
//! name with the whole mesh in it, and the layout (stages, layers, the
//! schedule and its bubble on paper) the trace records for `braid
//! report`.

use super::train::LoopParts;
use super::train_pipeline::PipeFlags;
use braid_comm::gpu::GpuCommunicator;
use braid_comm::Communicator;
use braid_core::env;
use braid_model::{GptConfig, Params};
use braid_train::assemble::{strategy, ShardChoice};
use braid_train::collective::DeviceCollective;
use braid_train::ddp::DdpOptions;
use braid_train::engines::Precision;
use braid_train::place::Place;
use braid_train::schedule::check::Checked;
use braid_train::schedule::Schedule;
use braid_train::{train_with, RunReport};
use std::sync::Arc;

/// What a pipeline run takes from `braid train`'s set-up.
pub struct PipelineRun<'r> {
    /// The world's communicator (a pipeline runs over several ranks).
    pub comm: Option<Communicator>,
    pub cfg: GptConfig,
    pub schedule: Checked,
    pub pipe_flags: &'r PipeFlags<'r>,
    /// The whole model's parameters; with `save`, the whole trained model
    /// afterwards on the lead (on GPUs the host copy is dropped first).
    pub params: &'r mut Params,
    /// A rank's rows per step, and the sequence length.
    pub batch: usize,
    pub seq: usize,
    pub place: &'r Place,
    pub cuda: bool,
    pub precision: Precision,
    pub optimizer: super::train::OptimizerKind,
    pub weight_decay: f32,
    pub checkpointing: bool,
    /// `--save`: gather the whole model at the end.
    pub save: bool,
    /// `--gpu-memory`, in bytes: what each rank's stages must fit.
    pub gpu_memory: Option<u128>,
    /// `--offload optimizer` (the CPU stages: AdamW through the
    /// offloaded update).
    pub offload: bool,
    pub shard_choice: ShardChoice,
    pub ddp: DdpOptions,
}

/// What a pipeline run gives back.
pub struct PipelineDone {
    pub report: RunReport,
    /// Parameters of this rank's stages.
    pub stage_params: u64,
    /// The timeline as JSON (for `--json`).
    pub timeline_json: Option<serde_json::Value>,
}

/// Runs the pipeline; `parts` is what the loop takes besides
/// the engine and the strategy.
pub fn run(r: PipelineRun<'_>, parts: &mut LoopParts<'_, '_>) -> Result<PipelineDone, String> {
    let PipelineRun {
        comm,
        cfg,
        schedule,
        pipe_flags,
        params,
        batch,
        seq,
        place,
        cuda,
        precision,
        optimizer,
        weight_decay,
        checkpointing,
        save,
        gpu_memory,
        offload,
        shard_choice,
        ddp,
    } = r;
    let lead = parts.lead;
    let c = comm.ok_or("a pipeline runs over several ranks")?;
    let all = super::train_pipeline::stages(&cfg, &schedule, pipe_flags)?;
    let layouts = super::train_pipeline::layouts(&params.layout, &schedule, &all)?;
    let whole = params.layout.clone();
    let micro = batch / schedule.micro_batches;
    let mesh = place.mesh()?;
    // The world ranks of this rank's pipeline, in stage order (the
    // timeline's rows are named by them).
    let pipe_members = mesh
        .groups("pipe")
        .into_iter()
        .find(|g| g.contains(&place.rank))
        .unwrap_or_default();
    if lead {
        println!("mesh: {}", mesh.describe());
        super::train_pipeline::print_plan(&all, &schedule, batch, seq);
    }
    // Under --tp: the tensor group, for --save.
    let mut tensor_host = None;
    let pipeline_json;
    let (run, mine, pipe) = if cuda {
        let gpu = GpuCommunicator::init_from_env(&c).map_err(|e| e.to_string())?;
        let part = |name: &str| braid_train::place::split_gpu_part(&gpu, &mesh, name);
        let (pipe, data) = (part("pipe")?, part("data")?);
        let pipe_host = pipe.host().clone();
        // Under --tp: the tensor group (the model's collectives; on
        // the host for --save).
        let tensor = match place.tensor {
            1 => None,
            _ => {
                let t = part("tensor")?;
                tensor_host = Some(Arc::new(
                    braid_train::tensor_parallel::HostTensorGroup::new(t.host().clone()),
                ));
                let comm: Arc<dyn braid_model::tensor_comm::DeviceTensorComm> =
                    Arc::new(braid_train::tensor_parallel::DeviceTensorGroup::new(t));
                Some(comm)
            }
        };
        if lead {
            let dev = gpu.device();
            println!(
                "training on GPU {} ({}), bf16, one GPU per rank",
                dev.ordinal(),
                dev.name().unwrap_or_default()
            );
        }
        // The fastest form that fits this rank's stages (in the free
        // memory, or `--gpu-memory`): the bf16 weights whole, then cast
        // layer by layer; the score gradients stored, then recomputed.
        // Each rank chooses for its own stages (the same results either
        // way); the environment may decide instead.
        use super::preflight::env_choice;
        let kept_attention = match super::preflight::kept_attention_choice(cfg.n_layer)? {
            None | Some(0) => 0,
            Some(k) if k == cfg.n_layer => usize::MAX,
            Some(k) => {
                return Err(format!(
                    "BRAID_CKPT_ATTENTION={k}: a pipeline's layers keep the attention's state \
                     all (kept) or none (recomputed)"
                ))
            }
        };
        // Each micro-batch in flight keeps its layers' inputs only: the
        // attention runs again in the backward pass.
        let recompute_attention_output =
            env_choice(env::BRAID_CKPT_ATTENTION_OUTPUT, "recomputed", "kept")? != Some(false);
        let mixed = precision.mixed();
        let weights = match env_choice(env::BRAID_BF16_WEIGHTS, "streamed", "resident")? {
            Some(streamed) => vec![streamed],
            None if mixed => vec![false, true],
            None => vec![false],
        };
        let scores = match env_choice(env::BRAID_SCORE_GRADS, "stored", "recomputed")? {
            Some(stored) => vec![stored],
            None => vec![true, false],
        };
        let fused = mixed && super::preflight::fused_attention(&cfg, gpu.device());
        // The bf16 stages size their rows for sequence parallelism when built.
        let bf16_sequence = mixed && place.sequence && tensor.is_some();
        super::train_mesh::sequence_knobs(bf16_sequence)?;
        let fit = super::train_pipeline::StageFit {
            cfg: &cfg,
            schedule: &schedule,
            all: &all,
            layouts: &layouts,
            rows: (micro, seq),
            precision,
            fused,
            tensor: place.tensor,
            data: braid_model::footprint::Sharding {
                stage: shard_choice.stage.unwrap_or(0),
                ranks: data.size(),
            },
            weights,
            scores,
            base: braid_model::cuda::model_mixed::MixedOptions {
                checkpointing,
                kept_attention,
                recompute_attention_output,
                sequence_parallel: bf16_sequence,
                ..Default::default()
            },
        };
        let space = super::preflight::Room::new(gpu.device(), gpu_memory);
        let (options, acts, states) =
            super::train_pipeline::fitting_form(&fit, pipe.rank(), space.as_ref())?;
        let mut lean = Vec::new();
        if mixed && options.streamed_weights {
            lean.push("bf16 weights cast layer by layer instead of a full copy");
        }
        if fused && !options.stored_score_grads {
            lean.push("attention score gradients recomputed, not stored");
        }
        if !lean.is_empty() && lead {
            println!("pipeline rank 0's stages: {}", lean.join("; "));
        }
        if lead {
            let gib = |b: u128| b as f64 / (1u64 << 30) as f64;
            match &acts {
                Some(x) => println!(
                    "GPU memory estimate: {:.2} GiB on this rank = model states {:.2} GiB + \
                     activations {:.2} GiB (up to {} micro-batches in flight, {:.1} MB each \
                     on its first stage{}) + scratch {:.2} GiB",
                    gib(states as u128 + x.total()),
                    gib(states as u128),
                    gib(x.held),
                    x.in_flight,
                    x.per_micro_batch as f64 / 1e6,
                    match checkpointing && options.recompute_attention_output {
                        true => ": each layer's input, the attention runs again",
                        false => "",
                    },
                    gib(x.shared),
                ),
                None => println!(
                    "GPU memory: this rank's stages' model states {:.2} GiB (activations \
                     not estimated for f32 stages)",
                    gib(states as u128)
                ),
            }
        }
        braid_cuda::pool::reset_peak();
        let mut engine = super::train_pipeline::gpu_engine(
            params,
            schedule,
            &all,
            pipe,
            tensor,
            precision,
            options,
            weight_decay,
            micro,
            seq,
        )?
        .with_stage_costs(super::train_pipeline::stage_costs(&cfg, &all))
        .with_world_ranks(pipe_members.clone());
        params.data = Vec::new();
        // One replica: nothing reduces the gradients, and the stage's
        // buffer is the step's (one gradient buffer on the GPU). Several:
        // data parallelism or ZeRO-1 (a GPU pipeline refuses --zero 2 and 3).
        let data = match data.size() {
            1 => {
                engine = engine.owning_grads();
                None
            }
            _ => Some(DeviceCollective::new(data)?),
        };
        let mut s = strategy(data, &mesh, None, shard_choice, ddp)?;
        let run = super::train::run_loop(parts, &mut engine, &mut *s, true, train_with)?;
        if let (true, Some(r)) = (lead, engine.timeline_report()) {
            println!("{r}");
        }
        pipeline_json = engine.timeline_json();
        (run, engine.into_params()?, pipe_host)
    } else {
        let how = super::train::cpu_optimizer(optimizer, weight_decay);
        let groups = braid_train::place::split_pipeline(&c, place)?;
        let pipe = groups.pipe.clone();
        tensor_host = groups.tensor.clone();
        let tensor = groups.tensor.clone().map(|g| {
            let comm: Arc<dyn braid_model::tensor_comm::TensorComm> = g;
            (comm, place.sequence)
        });
        let mut engine = super::train_pipeline::engine(
            params,
            schedule,
            &all,
            groups.pipe,
            tensor,
            (how, offload),
            micro,
            seq,
            checkpointing,
        )?
        .with_stage_costs(super::train_pipeline::stage_costs(&cfg, &all))
        .with_world_ranks(pipe_members.clone());
        // One replica: nothing reduces the gradients, and the stage's
        // buffer is the step's (as on GPUs). Several: data parallelism or
        // ZeRO-1, 2 or 3 over the data dimension.
        let data = match braid_train::collective::Collective::size(&groups.data) {
            1 => {
                engine = engine.owning_grads();
                None
            }
            _ => Some(groups.data),
        };
        let mut s = strategy(data, &mesh, None, shard_choice, ddp)?;
        let run = super::train::run_loop(parts, &mut engine, &mut *s, true, train_with)?;
        if let (true, Some(r)) = (lead, engine.timeline_report()) {
            println!("{r}");
        }
        pipeline_json = engine.timeline_json();
        (run, engine.into_params(), pipe)
    };
    let stage_params = layouts[pipe.rank()].len as u64;
    if save && place.data_rank() == 0 {
        // The whole model, from every stage (pipeline rank 0 of the
        // first data group is the lead).
        if let Some(p) = braid_train::pipeline::gather::gather_whole(&mine, whole, &layouts, &pipe)?
        {
            // Pipeline rank 0 of each tensor rank holds its share of
            // the whole model: the tensor group puts them together.
            *params = match &tensor_host {
                Some(g) => braid_train::tensor_parallel::gather_whole(&p, &**g)?,
                None => p,
            };
        }
    }
    Ok(PipelineDone {
        report: run,
        stage_params,
        timeline_json: pipeline_json,
    })
}

/// The strategy's name under a pipeline, the whole mesh in it: "pipeline 2
/// (1f1b, 4 micro-batches)", "pipeline 2 (1f1b, 4 micro-batches) x tensor
/// 2 x data 2"; `zero` and `shard_group` as `--zero` and `--shard-group`
/// (over the data dimension).
pub fn strategy_name(
    s: &Schedule,
    place: &Place,
    zero: Option<u8>,
    shard_group: Option<usize>,
) -> String {
    let mut name = format!(
        "pipeline {} ({}, {} micro-batches{})",
        s.ranks,
        s.name,
        s.micro_batches,
        match s.virtual_stages {
            1 => String::new(),
            v => format!(", {v} stages per rank"),
        }
    );
    if place.tensor > 1 {
        name.push_str(&format!(" x tensor {}", place.tensor));
        if place.sequence {
            name.push_str(" (sequence parallel)");
        }
    }
    match (zero, shard_group) {
        (None, _) if place.data() > 1 => name.push_str(&format!(" x data {}", place.data())),
        (None, _) => {}
        (Some(z), None) => name.push_str(&format!(" x data {} (ZeRO-{z})", place.data())),
        (Some(z), Some(g)) => name.push_str(&format!(
            " x data {} (ZeRO-{z}, shard groups of {g})",
            place.data()
        )),
    }
    name
}

/// `desc` (the run's description) with the pipeline's layout under
/// `"pipeline"`, for the trace (`braid report` reads it): the mesh's
/// degrees, the schedule, its micro-batches, every stage's layers and
/// pipeline rank, each pipeline rank's stages, each world rank's pipeline
/// rank, and the bubble on paper — `(N-1)/(V*M+N-1)`, the schedule's own
/// run on paper with equal stages and with these stages' estimated times
/// (the figures the pipeline's timeline prints at the end).
pub fn traced_desc(
    mut desc: serde_json::Value,
    cfg: &GptConfig,
    s: &Schedule,
    flags: &PipeFlags<'_>,
    place: &Place,
) -> Result<serde_json::Value, String> {
    use braid_train::pipeline::timeline;
    let all = super::train_pipeline::stages(cfg, s, flags)?;
    let costs = super::train_pipeline::stage_costs(cfg, &all);
    let (n, m, v) = (
        s.ranks as f64,
        s.micro_batches as f64,
        s.virtual_stages as f64,
    );
    let stages: Vec<serde_json::Value> = all
        .iter()
        .enumerate()
        .map(|(i, st)| {
            serde_json::json!({
                "stage": i,
                "pipe_rank": i % s.ranks,
                "layers": [st.layers.start, st.layers.end],
                "first": st.first,
                "last": st.last,
                "cost_layers": costs[i],
            })
        })
        .collect();
    let pipe_ranks: Vec<serde_json::Value> = (0..s.ranks)
        .map(|r| {
            let mine = s.stages_of(r);
            let layers: usize = mine.iter().map(|&i| all[i].layers.len()).sum();
            serde_json::json!({"pipe_rank": r, "stages": mine, "layers": layers})
        })
        .collect();
    // Data outermost, then the pipeline, tensor groups consecutive ranks
    // (`Place::mesh`).
    let rank_pipe: Vec<usize> = (0..place.world)
        .map(|r| (r / place.tensor) % place.pipe)
        .collect();
    desc["pipeline"] = serde_json::json!({
        "degree": s.ranks,
        "tensor": place.tensor,
        "data": place.data(),
        "schedule": s.name,
        "micro_batches": s.micro_batches,
        "virtual_stages": s.virtual_stages,
        "stages": stages,
        "pipe_ranks": pipe_ranks,
        "rank_pipe": rank_pipe,
        "bubble_formula": (n - 1.0) / (v * m + n - 1.0),
        "bubble_on_paper": timeline::on_paper(s).ok(),
        "bubble_on_paper_these_stages": timeline::on_paper_weighted(s, &costs).ok(),
    });
    Ok(desc)
}

#[cfg(test)]
mod tests {
    use super::*;
    use braid_train::schedule::build::ScheduleKind;

    fn place(world: usize, tensor: usize, sequence: bool) -> Place {
        Place {
            world,
            rank: 0,
            tensor,
            pipe: 2,
            sequence,
            shard_group: None,
        }
    }

    #[test]
    fn a_pipeline_s_strategy_names_its_mesh() {
        let s = ScheduleKind::OneFOneB.build(2, 4).unwrap();
        assert_eq!(
            strategy_name(&s, &place(2, 1, false), None, None),
            "pipeline 2 (1f1b, 4 micro-batches)"
        );
        assert_eq!(
            strategy_name(&s, &place(8, 2, false), None, None),
            "pipeline 2 (1f1b, 4 micro-batches) x tensor 2 x data 2"
        );
        assert_eq!(
            strategy_name(&s, &place(8, 1, false), Some(1), None),
            "pipeline 2 (1f1b, 4 micro-batches) x data 4 (ZeRO-1)"
        );
        let v = ScheduleKind::Interleaved(2).build(2, 4).unwrap();
        assert_eq!(
            strategy_name(&v, &place(4, 2, true), None, None),
            "pipeline 2 (interleaved:2, 4 micro-batches, 2 stages per rank) x tensor 2 (sequence parallel)"
        );
    }
}
