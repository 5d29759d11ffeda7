//! `braid train` / `braid generate` through the real binary.

mod common;

use common::{braid, run, TempDir};
use std::time::Duration;

fn losses(path: &std::path::Path) -> Vec<(f64, Option<f64>)> {
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    doc["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (r["loss"].as_f64().unwrap(), r["eval_loss"].as_f64()))
        .collect()
}

#[test]
fn tiny_training_halves_the_loss_and_repeats_bit_for_bit() {
    let dir = TempDir::new("train");
    let mut runs = Vec::new();
    for k in 0..2 {
        let json = dir.path().join(format!("run{k}.json"));
        let model = dir.path().join("tiny.safetensors");
        let mut cmd = braid();
        cmd.args([
            "train",
            "--steps",
            "80",
            "--eval-every",
            "40",
            "--seed",
            "7",
            "--json",
        ])
        .arg(&json)
        .arg("--save")
        .arg(&model);
        let f = run(cmd, Duration::from_secs(120));
        assert_eq!(f.code, Some(0), "{f:?}");
        assert!(
            f.stdout.contains("initial loss should be about ln(256)"),
            "{}",
            f.stdout
        );
        runs.push(losses(&json));
    }
    assert_eq!(runs[0], runs[1], "two runs with the same seed differ");
    let first = runs[0][0].0;
    let last = runs[0].last().unwrap().0;
    let half_ln_v = (256f64).ln() / 2.0;
    assert!((first - (256f64).ln()).abs() < 0.2, "initial loss {first}");
    assert!(
        last < half_ln_v,
        "final loss {last} is not below ln(256)/2 = {half_ln_v}"
    );

    let mut cmd = braid();
    cmd.args(["generate", "--load"])
        .arg(dir.path().join("tiny.safetensors"))
        .args(["--prompt", "the ", "--tokens", "40", "--temperature", "0"]);
    let f = run(cmd, Duration::from_secs(60));
    assert_eq!(f.code, Some(0), "{f:?}");
    assert!(
        f.stdout.starts_with("the ") && f.stdout.len() > 20,
        "{}",
        f.stdout
    );
}

/// `--lr-steps` sets the schedule's span apart from the run's steps: past
/// it the learning rate stays at its floor, a tenth of the peak.
#[test]
fn the_schedule_spans_lr_steps_and_then_holds_its_floor() {
    let dir = TempDir::new("train-lr-steps");
    let json = dir.path().join("run.json");
    let mut cmd = braid();
    cmd.args([
        "train",
        "--steps",
        "6",
        "--lr-steps",
        "3",
        "--warmup",
        "1",
        "--lr",
        "0.001",
        "--eval-every",
        "0",
        "--json",
    ])
    .arg(&json);
    let f = run(cmd, Duration::from_secs(60));
    assert_eq!(f.code, Some(0), "{f:?}");
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let lrs: Vec<f64> = doc["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["lr"].as_f64().unwrap())
        .collect();
    // Warmup, the peak, half way down the cosine, then the floor.
    let want = [1e-3, 1e-3, 5.5e-4, 1e-4, 1e-4, 1e-4];
    assert_eq!(lrs.len(), want.len(), "{lrs:?}");
    for (got, want) in lrs.iter().zip(want) {
        assert!((got - want).abs() < 1e-7, "{lrs:?}");
    }
}

#[test]
fn bad_training_input_is_explained() {
    for (args, want) in [
        (&["train", "--model", "L2-H3-C64"][..], "not a multiple"),
        (
            &["train", "--data", "/nonexistent/corpus.txt"][..],
            "no such file",
        ),
        (
            &["train", "--seq", "100"][..],
            "exceeds the model's context 64",
        ),
        (&["train", "--model", "L1-H1-C8-V100"][..], "vocabulary"),
        (
            &["train", "--precision", "bf16", "--steps", "1"][..],
            "the CPU engine trains in f32",
        ),
        (
            &["train", "--device", "cuda", "--precision", "fp4"][..],
            "expected f32, bf16 or fp8",
        ),
        (
            &["generate", "--load", "/nonexistent.safetensors"][..],
            "nonexistent.safetensors",
        ),
        (
            &[
                "train",
                "--offload",
                "optimizer",
                "--optimizer",
                "sgd",
                "--steps",
                "1",
            ][..],
            "the offloaded optimizer is AdamW",
        ),
        (
            &["train", "--device", "cuda", "--offload", "gpu"][..],
            "expected none or optimizer",
        ),
        (
            &["train", "--layout", "auto", "--steps", "1"][..],
            "--layout auto plans for GPUs",
        ),
        (
            &["train", "--layout", "auto", "--zero", "3", "--steps", "1"][..],
            "drop --zero",
        ),
        (
            &["train", "--layout", "best"][..],
            "--layout best: expected auto",
        ),
        (
            &["train", "--device", "cuda", "--offload", "params"][..],
            "--offload params",
        ),
        (
            &[
                "train",
                "--device",
                "cuda",
                "--offload",
                "optimizer",
                "--zero",
                "2",
            ][..],
            "with --zero 2 is not built yet",
        ),
    ] {
        let mut cmd = braid();
        cmd.args(args);
        let f = run(cmd, Duration::from_secs(60));
        assert_ne!(f.code, Some(0), "{args:?}: {f:?}");
        assert!(
            f.stderr.contains(want),
            "{args:?}: expected {want:?} in:\n{}",
            f.stderr
        );
    }
}

/// A model too large for this machine is refused before anything is
/// allocated, with the estimate and what would fit — not an abort.
#[test]
fn a_model_that_cannot_fit_is_refused_with_the_estimate() {
    for (args, want) in [
        (
            &["train", "--model", "L99999-H64-C65536", "--steps", "1"][..],
            "a model of at most about",
        ),
        (
            &[
                "train",
                "--model",
                "L4-H4-C256",
                "--batch",
                "100000000",
                "--steps",
                "1",
            ][..],
            "what would fit: --batch",
        ),
    ] {
        let mut cmd = braid();
        cmd.args(args);
        let f = run(cmd, Duration::from_secs(30));
        assert_eq!(f.code, Some(2), "{args:?}: {f:?}");
        for part in [
            "of host memory",
            "parameters",
            "activations",
            "GiB is available",
            want,
        ] {
            assert!(
                f.stderr.contains(part),
                "{args:?}: expected {part:?} in:\n{}",
                f.stderr
            );
        }
    }
}

/// `--load` checks memory from the file's header before reading its
/// tensors: a file whose header names a model far too large for this
/// machine is refused with the estimate, naming the file (no tensors are
/// read: the file holds none). A real checkpoint loads under ZeRO-3
/// (read straight into its padded layout) and trains as data parallelism
/// does from it.
#[test]
fn a_loaded_model_is_checked_before_it_is_read_and_loads_into_zero_3() {
    let dir = TempDir::new("train-load");
    let huge = dir.path().join("huge.safetensors");
    let config =
        r#"{"n_layer":99999,"n_head":64,"n_embd":65536,"vocab_size":50304,"context":1024}"#;
    let header = serde_json::json!({ "__metadata__": { "braid.config": config } }).to_string();
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend(header.as_bytes());
    std::fs::write(&huge, bytes).unwrap();
    let mut cmd = braid();
    cmd.args(["train", "--steps", "1", "--load"]).arg(&huge);
    let f = run(cmd, Duration::from_secs(30));
    assert_eq!(f.code, Some(2), "{f:?}");
    for part in [
        "huge.safetensors",
        "of host memory",
        "a model of at most about",
    ] {
        assert!(
            f.stderr.contains(part),
            "expected {part:?} in:\n{}",
            f.stderr
        );
    }
    let (saved, _) = common::train(&dir, "tiny", &["--steps", "5"], &[]);
    let from = saved.to_str().unwrap();
    let (ddp, _) = common::train(
        &dir,
        "ddp",
        &[
            "--load", from, "--nproc", "2", "--batch", "4", "--steps", "3",
        ],
        &[],
    );
    let (z3, _) = common::train(
        &dir,
        "z3",
        &[
            "--load", from, "--nproc", "2", "--batch", "4", "--steps", "3", "--zero", "3",
        ],
        &[],
    );
    let d = common::max_diff(&common::params(&ddp), &common::params(&z3));
    assert!(d <= 1e-4, "ZeRO-3 from the loaded model differs by {d}");
}
