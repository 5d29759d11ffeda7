//! The end of `braid train`'s run: the first step's gradients where
//! `BRAID_DUMP_GRADS` asks for them, and on the lead the summary, the
//! model states, the JSON, the forward+backward benchmark's median and
//! `--save`.

use super::train::{write_first_grads, TrainArgs};
use super::train_check::Choices;
use super::train_model::ModelData;
use super::train_output::{print_state, print_summary, write_json};
use super::train_place::Placement;
use braid_model::checkpoint;
use braid_model::{GptConfig, Params};
use braid_train::RunReport;
use std::path::Path;

/// What a run ends with, besides its flags, choices, place and data.
pub struct Finished<'r> {
    /// The loop's report.
    pub run: RunReport,
    /// The model's configuration as trained, and its parameters after the
    /// run.
    pub cfg: &'r GptConfig,
    pub params: &'r Params,
    /// The parameters this rank holds: its pipeline stages', or its
    /// tensor-parallel share (`None`: the whole model's).
    pub held: Option<u64>,
    /// A pipeline's timeline, for the JSON.
    pub pipeline_json: Option<serde_json::Value>,
    /// Where `BRAID_DUMP_GRADS` writes the first step's gradients.
    pub dump_grads: Option<&'r Path>,
    /// The run's layout in braid plan's terms.
    pub layout: &'r super::train_plan::RunLayout,
}

/// Ends the run: the first step's gradients written where asked, and on
/// the lead the summary and the model states printed, the JSON written,
/// the benchmark's median printed and the model saved.
pub fn finish(
    a: &TrainArgs,
    c: &Choices,
    p: &Placement,
    m: &ModelData,
    done: Finished<'_>,
) -> Result<(), String> {
    let Finished {
        run,
        cfg,
        params,
        held,
        pipeline_json,
        dump_grads,
        layout,
    } = done;
    let tokens_per_step = (p.batch * m.seq * a.accum * p.ranks) as f64;
    if let (Some(path), Some(grads)) = (dump_grads, &run.first_grads) {
        write_first_grads(path, &params.layout, grads)?;
    }
    if !p.lead {
        return Ok(());
    }
    let summary = print_summary(
        &run,
        cfg,
        m.seq,
        tokens_per_step,
        c.cuda.then_some(c.precision),
        p.world_size,
    );
    print_state(&run, cfg, held, c.zero.unwrap_or(0), p.shard_group);
    let plan = summary
        .as_ref()
        .and_then(|s| super::train_plan::beside(layout, s.median_step));
    if let Some((line, _)) = &plan {
        println!("{line}");
    }
    if let Some(out) = &a.json {
        let plan = plan.map(|(_, json)| json);
        write_json(
            out,
            &run,
            summary.as_ref(),
            cfg.n_layer,
            pipeline_json,
            plan,
        )?;
    }
    if a.fwd_bwd_only && run.steps.len() > 1 {
        print_fwd_bwd_median(&run);
    }
    if let Some(path) = &a.save {
        let dtype = braid_core::DType::parse(&a.save_dtype)?;
        checkpoint::save_as(
            params,
            path,
            dtype,
            &[("braid.tokenizer", m.tokenizer.name())],
        )
        .map_err(|e| e.to_string())?;
        println!("saved {}", path.display());
    }
    Ok(())
}

/// `--fwd-bwd-only`: the median throughput of the steps after the first.
fn print_fwd_bwd_median(run: &RunReport) {
    let mut tps: Vec<f64> = run.steps[1..].iter().map(|r| r.tokens_per_s).collect();
    tps.sort_by(|x, y| x.partial_cmp(y).expect("finite"));
    println!(
        "forward+backward: median {:.1} tokens/s over {} steps (first step not counted)",
        tps[tps.len() / 2],
        tps.len()
    );
}
