//! What `braid train` says about its run before it starts: the lead's
//! banner (the notes on what was chosen, the model, the data, the loss
//! to expect), the strategy's name, and the run's description (the JSON
//! that checkpoints and traces carry).

use super::train::TrainArgs;
use super::train_check::Choices;
use super::train_model::ModelData;
use super::train_place::Placement;
use braid_comm::Communicator;
use braid_model::GptConfig;
use braid_train::collective::GradComm;
use braid_train::schedule::check::Checked as PipeSchedule;

/// Prints the lead's banner: the notes on what was chosen (the device,
/// the model, its vocabulary and context, sequence parallelism), the
/// model (`cfg`) and its learning rate `lr`, the data (`data_desc`) and
/// batch, and the loss a fresh model starts near.
pub fn print_banner(
    a: &TrainArgs,
    c: &Choices,
    p: &Placement,
    m: &ModelData,
    cfg: &GptConfig,
    lr: f32,
    data_desc: &str,
) {
    for note in c
        .device_note
        .iter()
        .chain(&c.model_note)
        .chain(&m.vocab_note)
        .chain(&m.context_note)
        .chain(&c.sequence_note)
    {
        println!("{note}");
    }
    println!(
        "braid train: model {} ({} layers, {} heads, width {}, vocab {}, context {}; {:.2}M \
         parameters), {}, lr {}, seed {}",
        c.model,
        cfg.n_layer,
        cfg.n_head,
        cfg.n_embd,
        cfg.vocab_size,
        cfg.context,
        cfg.num_params() as f64 / 1e6,
        braid_core::words::count(a.steps, "step"),
        lr,
        a.seed,
    );
    println!(
        "data: {} ({}, {}), batch {} x {} per rank{}, {}{}",
        a.data,
        data_desc,
        m.tokenizer.name(),
        p.batch,
        m.seq,
        if a.accum > 1 {
            format!(" x {} micro-batches", a.accum)
        } else {
            String::new()
        },
        braid_core::words::count(rayon::current_num_threads(), "thread"),
        if p.ranks > 1 {
            format!(" per rank, {} ranks", p.ranks)
        } else {
            String::new()
        },
    );
    println!(
        "initial loss should be about ln({}) = {:.3}",
        cfg.vocab_size,
        (cfg.vocab_size as f64).ln()
    );
}

/// The run's strategy in words: one process, data parallel or ZeRO,
/// within tensor parallelism under `--tp`; under `--pp` the whole mesh.
pub fn strategy_name(
    a: &TrainArgs,
    c: &Choices,
    p: &Placement,
    pipe_schedule: Option<&PipeSchedule>,
) -> String {
    let (zero, ranks, place) = (c.zero, p.ranks, &p.place);
    if let Some(ps) = &c.ps {
        return format!(
            "parameter server ({} server(s), {} worker(s), {}, updates on the {})",
            ps.servers, ps.workers, ps.mode, ps.update_at
        );
    }
    let strategy_name = match (zero, a.shard_group) {
        (None, _) if ranks > 1 => "data parallel".to_string(),
        (None, _) => "one process".to_string(),
        (Some(z), None) => format!("ZeRO-{z}"),
        (Some(z), Some(g)) => format!("ZeRO-{z}, shard groups of {g}"),
    };
    let strategy_name = match (place.tensor, zero.is_none() && ranks == 1) {
        (1, _) => strategy_name,
        (n, one_replica) => format!(
            "tensor parallel {n}{}{}",
            if place.sequence {
                " (sequence parallel)"
            } else {
                ""
            },
            match one_replica {
                true => String::new(),
                false => format!(" x {strategy_name}"),
            }
        ),
    };
    // Under --pp the whole mesh names the strategy.
    match pipe_schedule {
        Some(s) => super::train_pipeline_run::strategy_name(s, place, zero, a.shard_group),
        None => strategy_name,
    }
}

/// Says (on the lead) that a resumed run's compressed gradients start
/// their state afresh: it is not in checkpoints.
pub fn grad_comm_note(a: &TrainArgs, c: &Choices, lead: bool) {
    if a.resume.is_some() && c.grad_comm != GradComm::Plain && lead {
        println!(
            "note: --grad-comm {}: its state (error feedback) is not in checkpoints; a resumed run starts it afresh",
            a.grad_comm
        );
    }
}

/// What the run's description takes besides the flags, the choices, the
/// place and the model and data.
pub struct RunFacts<'r> {
    /// The model's configuration as trained.
    pub cfg: &'r GptConfig,
    /// The peak learning rate and its warmup steps.
    pub lr: f32,
    pub warmup: usize,
    /// The world's communicator, where the run has one.
    pub comm: Option<&'r Communicator>,
    /// The strategy in words.
    pub strategy: &'r str,
    /// The run's layout in braid plan's terms.
    pub layout: &'r super::train_plan::RunLayout,
}

/// The run's description: model, data, batch, mesh, strategy and
/// optimizer, as checkpoints and traces record it.
pub fn run_description(
    a: &TrainArgs,
    c: &Choices,
    p: &Placement,
    m: &ModelData,
    f: &RunFacts<'_>,
) -> serde_json::Value {
    let (cfg, place) = (f.cfg, &p.place);
    serde_json::json!({
        "model": c.model,
        "config": cfg,
        "params": cfg.num_params(),
        "backend": match (f.comm, c.cuda) {
            (Some(_), true) => "nccl".to_string(),
            (Some(comm), false) => comm.backend_name().to_string(),
            (None, _) => String::new(),
        },
        "tokenizer": m.tokenizer.name(),
        "data": a.data,
        "seed": a.seed,
        "seq": m.seq,
        "batch_per_rank": p.batch,
        "accum": a.accum,
        "ranks": p.world_size,
        "data_parallel": p.ranks,
        "tensor_parallel": place.tensor,
        "sequence_parallel": place.sequence,
        "global_batch": p.batch * p.ranks * a.accum,
        "strategy": f.strategy,
        "optimizer": a.optimizer,
        "lr": f.lr,
        "warmup": f.warmup,
        "steps": a.steps,
        "weight_decay": a.weight_decay,
        "grad_clip": a.grad_clip,
        "precision": c.precision.name(),
        // braid plan's terms, for `braid report`'s prediction.
        "layout": f.layout,
    })
}
