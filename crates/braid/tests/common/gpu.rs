//! Helpers of the GPU tests (`gpu.rs`, `gpu_zero.rs`): `braid train
//! --device cuda` runs that save their model and record, the figures a run
//! prints, a fixed token batch.

use super::{braid, run};
use std::time::Duration;

/// The number after `key` in `text` (a figure a run printed).
pub fn figure(text: &str, key: &str) -> f64 {
    let at = text
        .find(key)
        .unwrap_or_else(|| panic!("no {key:?} in {text}"))
        + key.len();
    text[at..]
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

/// `braid train --device cuda` on the tiny model, no evaluation, saving
/// the model and the JSON record under `dir` as `name.*`.
pub fn train_gpu(dir: &super::TempDir, name: &str, args: &[&str]) -> (Vec<f32>, serde_json::Value) {
    train_gpu_env(dir, name, args, &[])
}

/// `braid train --device cuda` on the tiny model (sequences of 32, seed
/// 11, no evaluation): the command [`train_gpu`] runs, for more arguments.
pub fn tiny_gpu_train() -> std::process::Command {
    let mut cmd = braid();
    cmd.args(["train", "--device", "cuda", "--seq", "32"])
        .args(["--eval-every", "0", "--seed", "11"]);
    cmd
}

/// [`train_gpu`] with extra environment variables.
pub fn train_gpu_env(
    dir: &super::TempDir,
    name: &str,
    args: &[&str],
    env: &[(&str, &str)],
) -> (Vec<f32>, serde_json::Value) {
    let mut cmd = tiny_gpu_train();
    cmd.args(args);
    let (model, doc) = run_saving(dir, name, cmd, env);
    let params = braid_model::checkpoint::load(&model)
        .expect("checkpoint")
        .0
        .data;
    (params, doc)
}

/// Runs `cmd` (a `braid train`) with `env`, saving the model to
/// `dir/name.safetensors` and the JSON record to `dir/name.json`; it must
/// succeed within 3 minutes. Returns the model's path and the record.
pub fn run_saving(
    dir: &super::TempDir,
    name: &str,
    mut cmd: std::process::Command,
    env: &[(&str, &str)],
) -> (std::path::PathBuf, serde_json::Value) {
    let model = dir.path().join(format!("{name}.safetensors"));
    let json = dir.path().join(format!("{name}.json"));
    cmd.arg("--save")
        .arg(&model)
        .arg("--json")
        .arg(&json)
        .env("NCCL_NVLS_ENABLE", "0")
        .envs(env.iter().copied());
    let f = run(cmd, Duration::from_secs(180));
    assert_eq!(f.code, Some(0), "{name}: {f:?}");
    let doc = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    (model, doc)
}

/// Every step's training loss and evaluation loss (if it evaluated) from
/// a run's JSON record.
pub fn train_and_eval_losses(doc: &serde_json::Value) -> Vec<(f64, Option<f64>)> {
    doc["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| (s["loss"].as_f64().unwrap(), s["eval_loss"].as_f64()))
        .collect()
}

/// Stated tolerance of the GPU equivalence: f32 on 2 GPUs against one GPU
/// with the whole batch, parameters after 20 AdamW steps (lr 3e-3).
pub const GPU_TOLERANCE: f32 = 1e-4;

/// A fixed batch of `b × t` byte tokens: token `i` is `i · a mod 256`,
/// its target `i · c mod 256`.
pub fn token_batch(b: usize, t: usize, a: usize, c: usize) -> braid_train::engines::TokenBatch {
    let mut batch = braid_train::engines::TokenBatch::new(b, t);
    for (i, x) in batch.tokens.iter_mut().enumerate() {
        *x = (i * a % 256) as u32;
    }
    for (i, x) in batch.targets.iter_mut().enumerate() {
        *x = (i * c % 256) as u32;
    }
    batch
}

/// Asserts that two runs' loss curves track each other: the mean loss of
/// every 20-step window of record `a` within `tol` of record `b`'s
/// (`names` say which run is which in the message).
pub fn assert_windows_track(
    a: &serde_json::Value,
    b: &serde_json::Value,
    tol: f64,
    names: (&str, &str),
) {
    let (la, lb) = (super::step_losses(a), super::step_losses(b));
    assert_eq!(
        la.len(),
        lb.len(),
        "{} and {}: step counts",
        names.0,
        names.1
    );
    assert!(la.len() >= 20, "fewer than 20 steps to compare");
    for w in 0..la.len() / 20 {
        let mean = |l: &[f64]| l[w * 20..(w + 1) * 20].iter().sum::<f64>() / 20.0;
        assert!(
            (mean(&la) - mean(&lb)).abs() < tol,
            "window {w}: {} {} {} {}",
            names.0,
            mean(&la),
            names.1,
            mean(&lb)
        );
    }
}
