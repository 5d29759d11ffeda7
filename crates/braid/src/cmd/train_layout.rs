//! `braid train --layout auto`: the layout `braid plan` ranks first for
//! the run's model, GPUs and global batch, among those `braid train`
//! takes, put into the run's flags before anything else reads them — the
//! choice printed with its predicted step and the runner-up.

use super::train::TrainArgs;
use super::train_check::{checked, Choices};
use braid_train::plan::{candidates, Candidate, Hardware, Workload};

/// The flags `--layout auto` chooses (none of them may be given with it).
const CHOSEN: &str = "--tp, --pp, --schedule, --micro-batches, --stage-layers, --zero, --fsdp, \
                      --shard-group, --offload, --checkpointing and --accum";

/// `a` with the layout filled in, where it asks for `--layout auto`;
/// unchanged otherwise.
pub fn resolved(a: TrainArgs) -> Result<TrainArgs, String> {
    match a.layout.as_deref() {
        None => return Ok(a),
        Some("auto") => {}
        Some(other) => {
            return Err(format!(
                "--layout {other}: expected auto (or leave it out and give the layout's flags)"
            ))
        }
    }
    let given = [
        ("--tp", a.tp != 1),
        ("--pp", a.pp != 1),
        ("--schedule", a.schedule.is_some()),
        ("--micro-batches", a.micro_batches.is_some()),
        ("--stage-layers", a.stage_layers.is_some()),
        ("--zero", a.zero.is_some()),
        ("--fsdp", a.fsdp),
        ("--shard-group", a.shard_group.is_some()),
        ("--offload", a.offload != "none"),
        ("--checkpointing", a.checkpointing),
        ("--accum", a.accum != 1),
    ];
    if let Some((flag, _)) = given.iter().find(|(_, g)| *g) {
        return Err(format!(
            "--layout auto chooses {CHOSEN} itself: drop {flag} (or drop --layout auto and \
             choose by hand; braid plan shows the ranking)"
        ));
    }
    let c = checked(&a)?;
    if !c.cuda {
        return Err(
            "--layout auto plans for GPUs (braid plan's hardware descriptions are GPUs'): on \
             CPUs give the layout's flags by hand"
                .into(),
        );
    }
    if c.world.is_none() && c.nproc.is_some() {
        // The launcher: its workers choose (each the same), on their GPUs.
        return Ok(a);
    }
    let gpus = gpus_of(&c);
    let device = first_gpu_name()?;
    let Some(name) = super::train_plan::hardware_for(&device) else {
        return Err(format!(
            "--layout auto: braid has no description of {device} (it has h100 and h200); run \
             braid plan --hardware FILE with one written for it and give its first choice's flags"
        ));
    };
    let hw = Hardware::named_or_file(name)?;
    let m = super::train_model::model_and_data(&a, &c)?;
    let global = a.global_batch.unwrap_or(a.batch * gpus);
    let w = Workload::of(&m.cfg, m.seq, global);
    let ranked: Vec<Candidate> = candidates(&w, gpus, &hw, None)
        .into_iter()
        .filter(|c| c.prediction.is_some())
        .collect();
    // The first that braid train's own checks take.
    let mut taken = ranked
        .iter()
        .filter_map(|cand| {
            let b = applied(&a, cand);
            checked(&b).ok().map(|_| (cand, b))
        })
        .take(2);
    let Some((first, b)) = taken.next() else {
        return Err(format!(
            "--layout auto: no layout of {} over {gpus} GPU(s) at a global batch of {global} \
             fits the {name} description (braid plan --model {} --gpus {gpus} --global-batch \
             {global} --seq {} --hardware {name} says why)",
            m.model_name, m.model_name, m.seq
        ));
    };
    if c.world.as_ref().is_none_or(|w| w.rank == 0) {
        let step = first.prediction.map_or(0.0, |p| p.step_s);
        let next = match taken.next() {
            Some((n, _)) => format!(
                "; the next: {} at {:.1} ms ({:+.1} %)",
                super::plan::flags(n),
                1e3 * n.prediction.map_or(0.0, |p| p.step_s),
                100.0 * (n.prediction.map_or(0.0, |p| p.step_s) / step - 1.0)
            ),
            None => String::new(),
        };
        println!(
            "layout auto: {} — braid plan's first choice of {} layouts that run for {} over {gpus} \
             GPU(s) ({name}), global batch {global}: {:.1} ms a step predicted{next}",
            super::plan::flags(first),
            ranked.len(),
            m.model_name,
            1e3 * step
        );
    }
    Ok(b)
}

/// The GPUs of the run: its world's size, or the workers it starts here.
fn gpus_of(c: &Choices) -> usize {
    c.world
        .as_ref()
        .map(|w| w.world_size)
        .or(c.nproc)
        .unwrap_or(1)
}

/// The first GPU's name (the one this process or its first worker uses).
fn first_gpu_name() -> Result<String, String> {
    let local = braid_core::world::local_rank_from_env().unwrap_or(0);
    braid_cuda::Device::open(local)
        .and_then(|d| d.name())
        .map_err(|e| format!("--layout auto: reading the GPU's name: {e}"))
}

/// `a` with `c`'s layout in its flags.
fn applied(a: &TrainArgs, c: &Candidate) -> TrainArgs {
    let l = &c.layout;
    let mut b = a.clone();
    b.layout = None;
    b.tp = l.tp;
    b.pp = l.pp;
    b.zero = (l.zero > 0).then_some(l.zero);
    b.shard_group = l.shard_group;
    b.offload = match l.offload {
        true => "optimizer".into(),
        false => "none".into(),
    };
    b.checkpointing = l.checkpointing;
    b.global_batch = None;
    if l.pp > 1 {
        b.schedule = c.schedule.clone();
        b.micro_batches = Some(l.micro_batches);
        b.batch = l.micro_batch * l.micro_batches;
        b.accum = 1;
    } else {
        b.batch = l.micro_batch;
        b.accum = l.micro_batches;
    }
    b
}
