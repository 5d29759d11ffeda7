//! Pipeline parallelism on GPUs through the real binary (activations and
//! their gradients over NCCL point-to-point): in f32 every schedule at
//! `--pp 2` (and `--pp 4` where there are 4 GPUs) reaches one GPU's
//! parameters after 10 steps within the GPU tolerance, a pipeline of 2 ×
//! data parallel 2 those of data parallelism over 4, and TP 2 × PP 2
//! those of one GPU; in bf16 every
//! schedule reaches them within the bf16 tolerance (the same
//! micro-batches' arithmetic; the gradients add up in another order) and
//! 1F1B tracks one GPU's loss over 60 steps. Without the GPUs a test says
//! "skipped".

mod common;

use common::gpu::{train_gpu, GPU_TOLERANCE};
use common::{gpus, max_diff, TempDir};
use std::io::Write;

/// 8 layers (4 stages of 2, or 8 of 1 interleaved over 4 GPUs), on the
/// byte corpus.
const MODEL: [&str; 4] = ["--model", "L8-H4-C64-V259-T32", "--tokenizer", "bytes"];

/// bf16 parameters after 10 steps at the small model's learning rate
/// (3e-3): the same products on the same rows, their sums in another order
/// (a step's micro-batches add up in a stage's buffer). A gradient near
/// zero can change sign with its last bit, and AdamW moves such a
/// parameter by up to the learning rate either way: a few such steps.
const BF16_TOLERANCE: f32 = 1.5e-2;

/// Each step's loss (bf16).
const LOSS_TOLERANCE: f64 = 5e-3;

fn args<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    let mut a: Vec<&str> = MODEL.to_vec();
    a.extend(["--batch", "8"]);
    a.extend(extra);
    a
}

/// f32: every schedule at `--pp 2` and `--pp 4` against one GPU, 10
/// steps; `--pp 2` × data parallel 2 against data parallelism over 4 and
/// `--tp 2 --pp 2` against one GPU (4 GPUs).
#[test]
fn gpu_pp_f32_every_schedule_matches_one_gpu() {
    if gpus(2).is_none() {
        return;
    }
    let dir = TempDir::new("gpu-pp-f32");
    // (A global batch of 16 throughout.)
    let f32_args = |extra: &[&'static str]| {
        let mut a: Vec<&str> = MODEL.to_vec();
        a.extend([
            "--precision",
            "f32",
            "--steps",
            "10",
            "--global-batch",
            "16",
        ]);
        a.extend(extra);
        a
    };
    let (one, _) = train_gpu(&dir, "one", &f32_args(&[]));
    let sizes: &[&str] = match gpus(4) {
        Some(_) => &["2", "4"],
        None => &["2"],
    };
    for &n in sizes {
        for schedule in common::SCHEDULES {
            let name = format!("f32-pp{n}-{schedule}");
            let (pp, _) = train_gpu(
                &dir,
                &name,
                &f32_args(&[
                    "--pp",
                    n,
                    "--nproc-per-node",
                    n,
                    "--micro-batches",
                    "4",
                    "--schedule",
                    schedule,
                ]),
            );
            let d = max_diff(&one, &pp);
            let _ = writeln!(
                std::io::stderr(),
                "f32, --pp {n} --schedule {schedule} vs one GPU after 10 steps: max |diff| {d:e}"
            );
            assert!(d <= GPU_TOLERANCE, "{name}: max |diff| {d} against one GPU");
        }
    }
    if gpus(4).is_none() {
        return;
    }
    let (dp, _) = train_gpu(&dir, "dp4", &f32_args(&["--nproc-per-node", "4"]));
    let (ppdp, _) = train_gpu(
        &dir,
        "pp2-dp2",
        &f32_args(&["--nproc-per-node", "4", "--pp", "2", "--micro-batches", "4"]),
    );
    let d = max_diff(&dp, &ppdp);
    let _ = writeln!(
        std::io::stderr(),
        "f32, --pp 2 x data 2 vs data parallelism over 4 after 10 steps: max |diff| {d:e}"
    );
    assert!(d <= GPU_TOLERANCE, "pp2 x dp2: max |diff| {d} against dp4");
    // ZeRO-1 over the data dimension.
    let (z1, _) = train_gpu(
        &dir,
        "pp2-zero1",
        &f32_args(&[
            "--nproc-per-node",
            "4",
            "--pp",
            "2",
            "--micro-batches",
            "4",
            "--zero",
            "1",
        ]),
    );
    let d = max_diff(&dp, &z1);
    let _ = writeln!(
        std::io::stderr(),
        "f32, --pp 2 x ZeRO-1 over 2 vs data parallelism over 4 after 10 steps: max |diff| {d:e}"
    );
    assert!(
        d <= GPU_TOLERANCE,
        "pp2 x zero1: max |diff| {d} against dp4"
    );
    // Tensor parallelism inside the stages: TP 2 x PP 2 on 4 GPUs.
    let (tppp, _) = train_gpu(
        &dir,
        "tp2-pp2",
        &f32_args(&[
            "--nproc-per-node",
            "4",
            "--tp",
            "2",
            "--no-sp",
            "--pp",
            "2",
            "--micro-batches",
            "4",
        ]),
    );
    let d = max_diff(&one, &tppp);
    let _ = writeln!(
        std::io::stderr(),
        "f32, --tp 2 x --pp 2 vs one GPU after 10 steps: max |diff| {d:e}"
    );
    assert!(
        d <= GPU_TOLERANCE,
        "tp2 x pp2: max |diff| {d} against one GPU"
    );
}

/// f32: a checkpoint of a pipeline of 2 GPUs resumes under the same
/// pipeline and on one GPU, the next steps' losses those of the run that
/// never stopped.
#[test]
fn gpu_pp_checkpoint_resumes_on_one_gpu_and_the_same_pipeline() {
    if gpus(2).is_none() {
        return;
    }
    let dir = TempDir::new("gpu-pp-ckpt");
    let ck = dir.path().join("ck").display().to_string();
    let pp2 = ["--pp", "2", "--nproc-per-node", "2", "--micro-batches", "4"];
    let go = |name: &str, extra: &[&str]| {
        let mut c = common::braid();
        c.args([
            "train",
            "--device",
            "cuda",
            "--seq",
            "32",
            "--eval-every",
            "0",
            "--seed",
            "11",
        ])
        .args(MODEL)
        .args(["--precision", "f32", "--steps", "6", "--global-batch", "8"])
        .args(extra);
        let (_, doc) = common::gpu::run_saving(&dir, name, c, &[]);
        // Each step's loss, by step.
        doc["steps"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| (s["step"].as_u64().unwrap(), s["loss"].as_f64().unwrap()))
            .collect::<std::collections::BTreeMap<u64, f64>>()
    };
    let full = go("full", &pp2);
    let mut saving = pp2.to_vec();
    saving.extend(["--ckpt-dir", &ck, "--save-every", "3"]);
    go("saving", &saving);
    let from = format!("{ck}/step-00000003");
    for (name, how) in [("pp2", &pp2[..]), ("one", &[][..])] {
        let mut a = how.to_vec();
        a.extend(["--resume", &from]);
        let got = go(name, &a);
        for step in [4, 5] {
            let (x, y) = (full[&step], got[&step]);
            let _ = writeln!(
                std::io::stderr(),
                "f32, pp2 checkpoint resumed as {name}: step {step} {y} against {x}"
            );
            assert!(
                (x - y).abs() <= 1e-5,
                "resumed as {name}: step {step} {y} against {x}"
            );
        }
    }
}

/// bf16: every schedule at `--pp 2` and `--pp 4` against one GPU, 10
/// steps.
#[test]
fn gpu_pp_every_schedule_matches_one_gpu() {
    if gpus(2).is_none() {
        return;
    }
    let dir = TempDir::new("gpu-pp");
    let (one, one_doc) = train_gpu(&dir, "one", &args(&["--steps", "10"]));
    let one_losses = common::step_losses(&one_doc);
    let sizes: &[&str] = match gpus(4) {
        Some(_) => &["2", "4"],
        None => &["2"],
    };
    for &n in sizes {
        for schedule in common::SCHEDULES {
            let (pp, doc) = train_gpu(
                &dir,
                &format!("pp{n}-{schedule}"),
                &args(&[
                    "--steps",
                    "10",
                    "--pp",
                    n,
                    "--nproc-per-node",
                    n,
                    "--micro-batches",
                    "4",
                    "--schedule",
                    schedule,
                ]),
            );
            let d = max_diff(&one, &pp);
            let losses = common::step_losses(&doc);
            let worst = one_losses
                .iter()
                .zip(&losses)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f64, f64::max);
            let _ = writeln!(
                std::io::stderr(),
                "bf16, --pp {n} --schedule {schedule} vs one GPU after 10 steps: max |diff| {d:e}, \
                 losses within {worst:e} (one GPU {:.4} -> {:.4}, pipeline {:.4} -> {:.4})",
                one_losses[0],
                one_losses[9],
                losses[0],
                losses[9]
            );
            assert!(
                worst <= LOSS_TOLERANCE,
                "--pp {n} --schedule {schedule}: a step's loss differs from one GPU's by {worst}"
            );
            assert!(
                d <= BF16_TOLERANCE,
                "--pp {n} --schedule {schedule} differs from one GPU by {d}"
            );
        }
    }
}

/// 1F1B over 2 GPUs tracks one GPU over 60 steps (mean loss of every
/// 20-step window within 0.02), with activation checkpointing too.
#[test]
fn gpu_pp_2_tracks_one_gpu() {
    if gpus(2).is_none() {
        return;
    }
    let dir = TempDir::new("gpu-pp-track");
    for ckpt in [false, true] {
        let mut extra = vec!["--steps", "60"];
        if ckpt {
            extra.push("--checkpointing");
        }
        let (_, a) = train_gpu(&dir, &format!("one-{ckpt}"), &args(&extra));
        extra.extend(["--pp", "2", "--nproc-per-node", "2"]);
        let (_, b) = train_gpu(&dir, &format!("pp2-{ckpt}"), &args(&extra));
        let (la, lb) = (common::step_losses(&a), common::step_losses(&b));
        let _ = writeln!(
            std::io::stderr(),
            "bf16, checkpointing {ckpt}: one GPU {:.4} -> {:.4}, --pp 2 {:.4} -> {:.4}",
            la[0],
            la[59],
            lb[0],
            lb[59]
        );
        common::gpu::assert_windows_track(&a, &b, 0.02, ("one GPU", "--pp 2"));
    }
}

/// bf16 tensor parallelism inside the stages, with sequence parallelism
/// (Megatron's layout of the 3-D mesh: a stage's input, output and their
/// gradients are each rank's rows of the residual stream): `--tp 2 --sp
/// --pp 2` on 4 GPUs tracks one GPU over 60 steps (mean loss of every
/// 20-step window within 0.02) under 1F1B, with and without
/// checkpointing, interleaved 1F1B and ZB-H1 (its split backward pass);
/// and so does `--no-sp` under 1F1B.
#[test]
fn gpu_pp_tp_2_sequence_parallel_tracks_one_gpu() {
    if gpus(4).is_none() {
        return;
    }
    let dir = TempDir::new("gpu-pp-tp-sp");
    let (_, one) = train_gpu(&dir, "one", &args(&["--steps", "60"]));
    let (_, one_ckpt) = train_gpu(
        &dir,
        "one-ckpt",
        &args(&["--steps", "60", "--checkpointing"]),
    );
    let runs: [(&str, &[&str]); 5] = [
        ("1f1b", &["--sp", "--schedule", "1f1b"]),
        (
            "1f1b-ckpt",
            &["--sp", "--schedule", "1f1b", "--checkpointing"],
        ),
        ("interleaved", &["--sp", "--schedule", "interleaved"]),
        ("zb", &["--sp", "--schedule", "zb"]),
        ("1f1b-no-sp", &["--no-sp", "--schedule", "1f1b"]),
    ];
    for (name, extra) in runs {
        let mut a = vec![
            "--steps",
            "60",
            "--nproc-per-node",
            "4",
            "--tp",
            "2",
            "--pp",
            "2",
        ];
        a.extend(["--micro-batches", "4"]);
        a.extend(extra);
        let (_, b) = train_gpu(&dir, &format!("tp2-pp2-{name}"), &args(&a));
        let base = if extra.contains(&"--checkpointing") {
            &one_ckpt
        } else {
            &one
        };
        let (la, lb) = (common::step_losses(base), common::step_losses(&b));
        let _ = writeln!(
            std::io::stderr(),
            "bf16 --tp 2 --pp 2 {name}: one GPU {:.4} -> {:.4}, 3-D {:.4} -> {:.4}",
            la[0],
            la[59],
            lb[0],
            lb[59]
        );
        common::gpu::assert_windows_track(base, &b, 0.02, ("one GPU", name));
    }
}

/// 3 steps of 1F1B over 2 GPUs in 8 micro-batches of the 8-layer model
/// whose activations are hundreds of MB, global batch 16 × 1024, with
/// `extra` arguments.
fn pp2_l8(extra: &[&str]) -> common::Finished {
    let mut cmd = common::braid();
    cmd.args([
        "train",
        "--device",
        "cuda",
        "--model",
        "L8-H8-C1024-V50304-T1024",
    ])
    .args(["--data", "random", "--global-batch", "16", "--seq", "1024"])
    .args(["--steps", "3", "--eval-every", "0", "--nproc-per-node", "2"])
    .args(["--pp", "2", "--micro-batches", "8"])
    .args(extra)
    .env("NCCL_NVLS_ENABLE", "0");
    common::run(cmd, std::time::Duration::from_secs(120))
}

/// The stage's memory estimate printed at start is within 10 % of the
/// first stage's measured peak (1F1B over 2 GPUs, a model whose
/// activations are hundreds of MB, with and without checkpointing).
#[test]
fn gpu_pp_stage_estimate_is_near_the_measured_peak() {
    use common::gpu::figure;
    if gpus(2).is_none() {
        return;
    }
    for ckpt in [false, true] {
        let f = pp2_l8(if ckpt { &["--checkpointing"] } else { &[] });
        assert_eq!(f.code, Some(0), "{f:?}");
        let est = figure(&f.stdout, "GPU memory estimate:");
        let peak = figure(&f.stdout, "peak device memory");
        let _ = writeln!(
            std::io::stderr(),
            "--pp 2, checkpointing {ckpt}: estimate {est} GiB, first stage's peak {peak} GiB"
        );
        assert!(
            (est - peak).abs() <= 0.1 * peak,
            "checkpointing {ckpt}: estimate {est} GiB, peak {peak} GiB"
        );
    }
}

/// `--gpu-memory` under `--pp`: each rank fits its stages in the budget,
/// casting the bf16 weights layer by layer where the whole copy does not
/// fit (its estimate then within the budget), and a budget below the
/// model states is refused at start, naming it. The first stage holds 6
/// of the 8 layers, so that it is the fuller rank (the lead prints its
/// estimate).
#[test]
fn gpu_pp_fits_its_stages_in_a_memory_budget() {
    use common::gpu::figure;
    if gpus(2).is_none() {
        return;
    }
    let train = |budget: Option<String>| match budget {
        Some(b) => pp2_l8(&["--stage-layers", "6,2", "--gpu-memory", &b]),
        None => pp2_l8(&["--stage-layers", "6,2"]),
    };
    let whole = train(None);
    assert_eq!(whole.code, Some(0), "{whole:?}");
    let est = figure(&whole.stdout, "GPU memory estimate:");
    assert!(!whole.stdout.contains("cast layer by layer"), "{whole:?}");
    // Just under the whole copy's estimate: the weights are cast instead.
    let budget = est - 0.01;
    let lean = train(Some(format!("{budget:.3}")));
    assert_eq!(lean.code, Some(0), "{lean:?}");
    assert!(
        lean.stdout
            .contains("pipeline rank 0's stages: bf16 weights cast layer by layer"),
        "{lean:?}"
    );
    let lean_est = figure(&lean.stdout, "GPU memory estimate:");
    let _ = writeln!(
        std::io::stderr(),
        "--pp 2: estimate {est} GiB whole, {lean_est} GiB within --gpu-memory {budget:.3}"
    );
    assert!(lean_est <= budget, "{lean_est} GiB over {budget}");
    let refused = train(Some("0.5".into()));
    assert_ne!(refused.code, Some(0), "{refused:?}");
    assert!(
        refused.stderr.contains("--gpu-memory allows 0.50 GiB"),
        "{refused:?}"
    );
}
