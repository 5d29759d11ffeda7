//! The plan beside the run: after a bf16 run on GPUs whose kind braid
//! has a description of (`h100`, `h200`), the step time `braid plan`
//! predicts for the run's own layout, next to the one measured — in the
//! summary, in `--json` (`plan`) and in the run's description, which
//! traces carry to `braid report`.

use super::train::TrainArgs;
use super::train_check::Choices;
use super::train_model::ModelData;
use super::train_place::Placement;
use braid_model::GptConfig;
use braid_train::plan::{predict, Hardware, Layout, Prediction, Workload};
use braid_train::schedule::build::ScheduleKind;
use serde::{Deserialize, Serialize};

/// A run's layout, as `braid plan` describes layouts, and the GPU it ran
/// on (recorded in the run's description).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunLayout {
    pub cfg: GptConfig,
    pub seq: usize,
    /// Data-parallel replicas, tensor and pipeline degrees.
    pub dp: usize,
    pub tp: usize,
    pub pp: usize,
    pub zero: u8,
    pub shard_group: Option<usize>,
    pub offload: bool,
    pub checkpointing: bool,
    /// Sequences per micro-batch, and micro-batches per step per replica
    /// (a pipeline's, else `--accum`).
    pub micro_batch: usize,
    pub micro_batches: usize,
    /// A pipeline's schedule by name.
    pub schedule: Option<String>,
    /// Whether the run split the sequence over its tensor groups (`None`
    /// in descriptions written before it was recorded: braid's default
    /// for its `--tp` and `--pp` then).
    #[serde(default)]
    pub sequence_parallel: Option<bool>,
    /// The GPU's name, on a bf16 GPU run (`None`: no prediction).
    pub gpu: Option<String>,
}

impl RunLayout {
    /// The layout of the run the flags `a` and the choices `c` set up.
    pub fn of(a: &TrainArgs, c: &Choices, p: &Placement, m: &ModelData) -> RunLayout {
        let piped = a.pp > 1;
        let micro_batches = match piped {
            true => a.micro_batches.unwrap_or(2 * a.pp),
            false => a.accum,
        };
        let gpu = match c.cuda && c.precision.mixed() {
            true => {
                let local = braid_core::world::local_rank_from_env().unwrap_or(0);
                braid_cuda::Device::open(local)
                    .ok()
                    .and_then(|d| d.name().ok())
            }
            false => None,
        };
        RunLayout {
            cfg: m.cfg,
            seq: m.seq,
            dp: p.ranks,
            tp: a.tp,
            pp: a.pp,
            zero: c.zero.unwrap_or(0),
            shard_group: a.shard_group,
            offload: c.offload,
            checkpointing: a.checkpointing,
            micro_batch: match piped {
                true => p.batch / micro_batches.max(1),
                false => p.batch,
            },
            micro_batches,
            schedule: a.schedule.clone(),
            sequence_parallel: Some(c.sequence),
            gpu,
        }
    }
}

/// The built-in description for a GPU named `device` (`NVIDIA H100 80GB
/// HBM3` → `h100`), if braid has one.
pub fn hardware_for(device: &str) -> Option<&'static str> {
    let d = device.to_ascii_uppercase();
    if d.contains("H200") {
        Some("h200")
    } else if d.contains("H100") {
        Some("h100")
    } else {
        None
    }
}

/// The prediction of `braid plan` for `run` on the description `hardware`.
pub fn predicted(run: &RunLayout, hardware: &str) -> Result<Prediction, String> {
    let hw = Hardware::named_or_file(hardware)?;
    let schedule = match (&run.schedule, run.pp) {
        (_, 1) => None,
        (Some(s), _) => Some(ScheduleKind::parse(s)?),
        (None, _) => Some(ScheduleKind::OneFOneB),
    };
    let global_batch = run.dp * run.micro_batch * run.micro_batches;
    let w = Workload::of(&run.cfg, run.seq, global_batch);
    let l = Layout {
        dp: run.dp,
        tp: run.tp,
        pp: run.pp,
        zero: run.zero,
        micro_batch: run.micro_batch,
        micro_batches: run.micro_batches,
        schedule,
        checkpointing: run.checkpointing,
        overlap_data: true,
        sequence_parallel: run
            .sequence_parallel
            .unwrap_or_else(|| Layout::braid_sequence_parallel(run.tp, run.pp)),
        shard_group: run.shard_group,
        offload: run.offload,
    };
    predict(&w, &l, &hw)
}

/// The plan beside the measured median step: one line, and its JSON
/// (`None` where the run was not on a GPU braid has a description of).
pub fn beside(run: &RunLayout, measured_s: f64) -> Option<(String, serde_json::Value)> {
    let name = hardware_for(run.gpu.as_deref()?)?;
    let p = match predicted(run, name) {
        Ok(p) => p,
        Err(e) => {
            let line =
                format!("plan: no prediction for this layout on the {name} description ({e})");
            return Some((line, serde_json::json!({ "hardware": name, "error": e })));
        }
    };
    let ratio = measured_s / p.step_s;
    let line = format!(
        "plan: this layout predicted at {:.1} ms a step on the {name} description (compute {:.1}, \
         tensor {:.1}, bubble {:.1}, exposed data {:.1}, optimizer {:.1} ms); measured {:.1} ms, \
         {:+.1} % (braid plan's calibration is checked against runs like this one)",
        1e3 * p.step_s,
        1e3 * p.compute_s,
        1e3 * p.tensor_comm_s,
        1e3 * p.bubble_s,
        1e3 * p.data_exposed_s,
        1e3 * p.optimizer_s,
        1e3 * measured_s,
        100.0 * (ratio - 1.0)
    );
    let json = serde_json::json!({
        "hardware": name,
        "predicted_step_s": p.step_s,
        "measured_step_s": measured_s,
        "measured_over_predicted": ratio,
        "compute_s": p.compute_s,
        "tensor_comm_s": p.tensor_comm_s,
        "bubble_s": p.bubble_s,
        "data_exposed_s": p.data_exposed_s,
        "optimizer_s": p.optimizer_s,
    });
    Some((line, json))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(dp: usize, tp: usize, pp: usize, zero: u8) -> RunLayout {
        RunLayout {
            cfg: GptConfig::parse("1558M").unwrap(),
            seq: 1024,
            dp,
            tp,
            pp,
            zero,
            shard_group: None,
            offload: false,
            checkpointing: false,
            micro_batch: 8,
            micro_batches: if pp > 1 { 2 * pp } else { 1 },
            schedule: None,
            sequence_parallel: None,
            gpu: Some("NVIDIA H100 80GB HBM3".into()),
        }
    }

    /// A `--tp` run's sequence parallelism as it ran: `--no-sp` predicted
    /// with the LayerNorms whole on every rank and no extra gathers, a
    /// description from before the field by braid's default.
    #[test]
    fn a_tensor_parallel_runs_sequence_split_is_predicted_as_it_ran() {
        let mut tp = run(1, 4, 1, 0);
        let default = predicted(&tp, "h100").unwrap();
        tp.sequence_parallel = Some(true);
        assert_eq!(predicted(&tp, "h100").unwrap().step_s, default.step_s);
        tp.sequence_parallel = Some(false);
        let whole = predicted(&tp, "h100").unwrap();
        assert_ne!(whole.step_s, default.step_s);
        assert!(whole.tensor_comm_s < default.tensor_comm_s);
        let old: RunLayout = serde_json::from_value({
            let mut v = serde_json::to_value(run(1, 4, 1, 0)).unwrap();
            v.as_object_mut().unwrap().remove("sequence_parallel");
            v
        })
        .unwrap();
        assert_eq!(old.sequence_parallel, None);
    }

    #[test]
    fn gpus_are_named_by_their_description_and_others_have_none() {
        assert_eq!(hardware_for("NVIDIA H100 80GB HBM3"), Some("h100"));
        assert_eq!(hardware_for("NVIDIA H200"), Some("h200"));
        assert_eq!(hardware_for("NVIDIA A10G"), None);
        let mut other = run(1, 1, 1, 0);
        other.gpu = Some("NVIDIA A10G".into());
        assert!(beside(&other, 0.1).is_none());
        other.gpu = None;
        assert!(beside(&other, 0.1).is_none());
    }

    /// The run's layout is the plan's own: one GPU's prediction equals
    /// `braid plan`'s for the same layout, and a pipeline's carries a
    /// bubble; the line says how far the measurement was.
    #[test]
    fn a_runs_layout_is_predicted_as_the_plan_predicts_it() {
        let one = predicted(&run(1, 1, 1, 0), "h100").unwrap();
        assert!(one.step_s > 0.0 && one.bubble_s == 0.0);
        let piped = predicted(&run(1, 1, 4, 0), "h100").unwrap();
        assert!(piped.bubble_s > 0.0);
        let (line, json) = beside(&run(1, 1, 1, 0), 1.1 * one.step_s).unwrap();
        assert!(line.contains("+10.0 %"), "{line}");
        assert!((json["measured_over_predicted"].as_f64().unwrap() - 1.1).abs() < 1e-9);
        let mut bad = run(1, 1, 2, 0);
        bad.schedule = Some("looped".into());
        let (line, _) = beside(&bad, 0.1).unwrap();
        assert!(line.contains("no prediction"), "{line}");
    }
}
