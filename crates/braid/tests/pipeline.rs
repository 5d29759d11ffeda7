//! Pipeline parallelism (`braid train --pp N`) through the real binary, on
//! CPU worker processes: every built-in schedule at 2 and 4 stages
//! reaches the parameters of one process after 10 f32 steps, as do a
//! pipeline under ZeRO-1, 2 and 3 over its data dimension and the 3-D
//! mesh with ZeRO-3, and a pipeline with its optimizer offloaded; a
//! pipeline of 2 × data parallel 2 those of data
//! parallelism over 4, the 3-D mesh 2 × 2 × 2 those of data parallelism
//! over 2; a pipeline's checkpoint resumes under other pipeline, tensor
//! and data degrees; a schedule file that would hang or skip a backward
//! pass is refused with the action named; what cannot work is refused at
//! start.

mod common;

use common::{braid, max_diff, params, run, train, TempDir};
use std::time::Duration;

/// Every element of the parameters within this of the reference.
const TOL: f32 = 1e-4;

/// 4 layers: up to 4 stages, or 2 ranks of 2 interleaved stages.
const MODEL: &str = "L4-H4-C32-V259-T32";

fn run_train(dir: &TempDir, name: &str, extra: &[&str]) -> Vec<f32> {
    let mut args = vec!["--model", MODEL, "--tokenizer", "bytes", "--steps", "10"];
    args.extend(extra);
    let (model, f) = train(dir, name, &args, &[]);
    if extra.contains(&"--pp") {
        assert!(
            f.stdout.contains("pipeline: ") && f.stdout.contains("mesh: "),
            "{name}: the stages and the mesh are printed\n{}",
            f.stdout
        );
        // The last step's chart, a row per pipeline rank, and the
        // measured idle fraction beside the theory's.
        let pp: usize = extra[extra.iter().position(|a| *a == "--pp").unwrap() + 1]
            .parse()
            .unwrap();
        let rows = f
            .stdout
            .lines()
            .filter(|l| l.contains("  rank ") && l.ends_with('|'));
        assert_eq!(
            rows.count(),
            pp,
            "{name}: a chart row per rank\n{}",
            f.stdout
        );
        let line = f
            .stdout
            .lines()
            .find(|l| l.contains("pipeline bubble: measured "))
            .unwrap_or_else(|| panic!("{name}: no bubble line\n{}", f.stdout));
        let measured: f64 = line
            .split("measured ")
            .nth(1)
            .and_then(|s| s.split('%').next())
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("{name}: {line}"));
        assert!((0.0..100.0).contains(&measured), "{name}: {line}");
        // Under 1F1B (the default) the first stage holds at most N
        // micro-batches' activations at once.
        let one_f_one_b = match extra.iter().position(|a| *a == "--schedule") {
            Some(i) => extra[i + 1] == "1f1b",
            None => true,
        };
        let held = f
            .stdout
            .lines()
            .find(|l| l.contains("held at once, at most: stage 0: "))
            .and_then(|l| l.split("stage 0: ").nth(1))
            .and_then(|s| s.split(|c: char| !c.is_ascii_digit()).next())
            .and_then(|s| s.parse::<usize>().ok())
            .unwrap_or_else(|| panic!("{name}: no activations line\n{}", f.stdout));
        if one_f_one_b {
            assert!(
                held <= pp,
                "{name}: the first stage held {held} micro-batches"
            );
        }
        // The same in the --json record: the timeline of the last step, a
        // row per rank, and the bubbles.
        let json = dir.path().join(format!("{name}.json"));
        let doc: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        let p = &doc["pipeline"];
        assert_eq!(p["ranks"].as_u64(), Some(pp as u64), "{name}: {p}");
        let rows = p["last_step"]["ranks"].as_array().unwrap();
        assert_eq!(rows.len(), pp, "{name}: {p}");
        assert!(rows
            .iter()
            .all(|r| !r["spans"].as_array().unwrap().is_empty()));
        let m = p["bubble_measured"].as_f64().unwrap();
        assert!(
            (m - measured / 100.0).abs() < 1e-3,
            "{name}: {m} against {measured}%"
        );
        assert!(p["bubble_on_paper"].as_f64().is_some(), "{name}: {p}");
        assert_eq!(
            p["in_flight"][0]["micro_batches"].as_u64(),
            Some(held as u64),
            "{name}: {p}"
        );
    }
    params(&model)
}

#[test]
fn every_schedule_at_2_and_4_stages_matches_one_process() {
    let dir = TempDir::new("pp-one");
    let one = run_train(&dir, "one", &["--batch", "8"]);
    for (pp, micro) in [("2", "4"), ("4", "4")] {
        for schedule in common::SCHEDULES {
            // Interleaving 4 ranks needs 8 stages: the model has 4 layers.
            if pp == "4" && schedule.starts_with("interleaved") {
                continue;
            }
            let name = format!("pp{pp}-{schedule}");
            let got = run_train(
                &dir,
                &name,
                &[
                    "--batch",
                    "8",
                    "--pp",
                    pp,
                    "--micro-batches",
                    micro,
                    "--schedule",
                    schedule,
                ],
            );
            let d = max_diff(&one, &got);
            assert!(d <= TOL, "{name}: max |diff| {d} against one process");
        }
    }
}

#[test]
fn a_pipeline_of_2_times_data_parallel_2_matches_data_parallelism_over_4() {
    let dir = TempDir::new("pp-dp");
    let common = ["--nproc-per-node", "4", "--global-batch", "16"];
    let dp = run_train(&dir, "dp4", &common);
    let args: Vec<&str> = common
        .iter()
        .chain(&["--pp", "2", "--micro-batches", "2"])
        .copied()
        .collect();
    let got = run_train(&dir, "pp2-dp2", &args);
    let d = max_diff(&dp, &got);
    assert!(
        d <= TOL,
        "pp2 x dp2: max |diff| {d} against data parallelism over 4"
    );
}

/// ZeRO over a pipeline's data dimension: each stage's optimizer state
/// (ZeRO-1), also its gradients (ZeRO-2), also its parameters (ZeRO-3)
/// sharded over the stage's replicas; pipeline 2 x data 2 on 4 ranks, and
/// ZeRO-3 under the interleaved schedule (a rank holding the first and
/// the third of four stages), reach one process's parameters.
#[test]
fn a_pipeline_under_zero_1_2_and_3_over_its_data_dimension_matches_one_process() {
    let dir = TempDir::new("pp-zero");
    let one = run_train(&dir, "one", &["--batch", "16"]);
    let common = ["--nproc-per-node", "4", "--global-batch", "16", "--pp", "2"];
    for (name, extra) in [
        ("pp2-zero1", &["--micro-batches", "2", "--zero", "1"][..]),
        ("pp2-zero2", &["--micro-batches", "2", "--zero", "2"]),
        ("pp2-zero3", &["--micro-batches", "2", "--zero", "3"]),
        (
            "pp2-interleaved-zero3",
            &[
                "--micro-batches",
                "4",
                "--schedule",
                "interleaved:2",
                "--fsdp",
            ],
        ),
    ] {
        let args: Vec<&str> = common.iter().chain(extra).copied().collect();
        let got = run_train(&dir, name, &args);
        let d = max_diff(&one, &got);
        assert!(d <= TOL, "{name}: max |diff| {d} against one process");
    }
}

/// A pipeline with its optimizer offloaded (`--offload optimizer`: each
/// stage's AdamW through the offloaded update, master weights and
/// moments of its own, as on a GPU): 2 stages reach one process's
/// parameters, and 2 stages × data parallel 2 on 4 ranks too (the
/// replicas compare their master weights at the start instead of
/// broadcasting); a checkpoint of it taken halfway resumes bit-identical.
#[test]
fn a_pipeline_with_its_optimizer_offloaded_matches_one_process() {
    let dir = TempDir::new("pp-offload");
    let one = run_train(&dir, "one", &["--batch", "16"]);
    let off = [
        "--offload",
        "optimizer",
        "--pp",
        "2",
        "--micro-batches",
        "2",
    ];
    let ck = dir.path().join("ck").display().to_string();
    let saving = ["--batch", "16", "--ckpt-dir", &ck, "--save-every", "5"];
    for (name, extra) in [
        ("pp2-offload", &saving[..]),
        (
            "pp2-dp2-offload",
            &["--nproc-per-node", "4", "--global-batch", "16"],
        ),
    ] {
        let args: Vec<&str> = extra.iter().chain(&off).copied().collect();
        let got = run_train(&dir, name, &args);
        let d = max_diff(&one, &got);
        assert!(d <= TOL, "{name}: max |diff| {d} against one process");
    }
    // The offloaded moments saved at step 5 and read back.
    let whole = params(&dir.path().join("pp2-offload.safetensors"));
    let from = dir.path().join("ck/step-00000005").display().to_string();
    let resuming: Vec<&str> = ["--batch", "16", "--resume", &from]
        .iter()
        .chain(&off)
        .copied()
        .collect();
    let resumed = run_train(&dir, "pp2-offload-resumed", &resuming);
    assert_eq!(
        max_diff(&whole, &resumed),
        0.0,
        "resumed from step 5: not bit-identical to the run that went on"
    );
}

/// The 3-D mesh with sharded data parallelism (torchtitan's FSDP x TP x
/// PP): tensor 2 x pipeline 2 x ZeRO-3 over 2 on 8 ranks reaches one
/// process's parameters, and a checkpoint of it taken halfway resumes
/// bit-identical to the run that went on.
#[test]
fn tensor_2_x_pipeline_2_x_zero_3_on_8_ranks_matches_one_process_and_resumes() {
    let dir = TempDir::new("pp-3d-zero3");
    let one = run_train(&dir, "one", &["--batch", "16"]);
    let ck = dir.path().join("ck").display().to_string();
    let mesh = [
        "--nproc-per-node",
        "8",
        "--global-batch",
        "16",
        "--tp",
        "2",
        "--pp",
        "2",
        "--zero",
        "3",
    ];
    let saving: Vec<&str> = mesh
        .iter()
        .chain(&["--ckpt-dir", &ck, "--save-every", "5"])
        .copied()
        .collect();
    let whole = run_train(&dir, "3d-zero3", &saving);
    let d = max_diff(&one, &whole);
    assert!(
        d <= TOL,
        "tp2 x pp2 x zero3: max |diff| {d} against one process"
    );
    let from = dir.path().join("ck/step-00000005").display().to_string();
    let resuming: Vec<&str> = mesh.iter().chain(&["--resume", &from]).copied().collect();
    let resumed = run_train(&dir, "3d-zero3-resumed", &resuming);
    assert_eq!(
        max_diff(&whole, &resumed),
        0.0,
        "resumed from step 5: not bit-identical to the run that went on"
    );
}

/// Each step's loss of a `braid train --json` record, by step.
fn losses_by_step(path: &std::path::Path) -> std::collections::BTreeMap<u64, f64> {
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    doc["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| (s["step"].as_u64().unwrap(), s["loss"].as_f64().unwrap()))
        .collect()
}

/// A pipeline's checkpoint is committed once every stage's files are
/// written: the last stage's writer is held back (`BRAID_TEST_DELAY`
/// `1:write`), and rank 0 — alone in its data group — waits for it rather
/// than committing without its files (it did, and failed to read them).
#[test]
fn a_pipeline_checkpoint_waits_for_every_stage_s_files() {
    let dir = TempDir::new("pp-ckpt-wait");
    let ck = dir.path().join("ck").display().to_string();
    let mut c = braid();
    c.arg("train")
        .args(["--model", MODEL, "--tokenizer", "bytes", "--seq", "32"])
        .args(["--eval-every", "0", "--steps", "4", "--nproc-per-node", "2"])
        .args(["--pp", "2", "--global-batch", "8", "--ckpt-dir", &ck])
        .args(["--save-every", "2"])
        .env("BRAID_TEST_DELAY", "1:write:400");
    let f = run(c, Duration::from_secs(120));
    assert_eq!(f.code, Some(0), "{f:?}");
    for step in ["step-00000002", "step-00000004"] {
        let files: Vec<String> = std::fs::read_dir(format!("{ck}/{step}"))
            .unwrap_or_else(|e| panic!("{step}: {e}\n{f:?}"))
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        for rank in ["model-rank00000-of-00002", "model-rank00001-of-00002"] {
            assert!(
                files.iter().any(|n| n.starts_with(rank)),
                "{step}: no {rank} in {files:?}"
            );
        }
    }
}

/// A checkpoint of a pipeline of 2 (each rank writes its stages' tensors,
/// the last stage's copy of the tied embedding left out) resumes under 1,
/// 2 and 4 stages, data parallelism over 2 and a pipeline of 2 x data 2,
/// and a checkpoint of one process resumes under a pipeline: the next
/// steps' losses are those of the run that never stopped (global batch 8
/// throughout).
#[test]
fn a_pipeline_checkpoint_resumes_under_any_pipeline_and_data_degree() {
    let dir = TempDir::new("pp-ckpt");
    let base = [
        "--model",
        MODEL,
        "--tokenizer",
        "bytes",
        "--seq",
        "32",
        "--eval-every",
        "0",
        "--steps",
        "6",
    ];
    let go = |name: &str, extra: &[&str]| {
        let json = dir.path().join(format!("{name}.json"));
        let mut c = braid();
        c.arg("train")
            .args(base)
            .args(extra)
            .arg("--json")
            .arg(&json);
        let f = run(c, Duration::from_secs(120));
        assert_eq!(f.code, Some(0), "{name}: {f:?}");
        losses_by_step(&json)
    };
    let path = |p: &str| dir.path().join(p).display().to_string();
    let (ck, ck_one) = (path("ck"), path("ck-one"));
    let pp2 = ["--nproc-per-node", "2", "--pp", "2", "--global-batch", "8"];
    let full = go("full", &pp2);
    let save = |name: &str, how: &[&str], into: &str| {
        let mut a = how.to_vec();
        a.extend(["--ckpt-dir", into, "--save-every", "3"]);
        go(name, &a);
    };
    save("saving", &pp2, &ck);
    save("saving-one", &["--batch", "8"], &ck_one);
    let step3 = |root: &str| format!("{root}/step-00000003");
    let (from_pp, from_one) = (step3(&ck), step3(&ck_one));
    let cases: [(&str, &str, &[&str]); 7] = [
        ("pp2", &from_pp, &pp2),
        ("one", &from_pp, &["--batch", "8"]),
        (
            "pp4",
            &from_pp,
            &["--nproc-per-node", "4", "--pp", "4", "--global-batch", "8"],
        ),
        (
            "dp2",
            &from_pp,
            &["--nproc-per-node", "2", "--global-batch", "8"],
        ),
        (
            "pp2-dp2",
            &from_pp,
            &["--nproc-per-node", "4", "--pp", "2", "--global-batch", "8"],
        ),
        ("one-to-pp2", &from_one, &pp2),
        (
            "tp2-pp2",
            &from_pp,
            &[
                "--nproc-per-node",
                "4",
                "--tp",
                "2",
                "--pp",
                "2",
                "--global-batch",
                "8",
            ],
        ),
    ];
    for (name, from, how) in cases {
        let mut a = how.to_vec();
        a.extend(["--resume", from]);
        let got = go(name, &a);
        for step in [4, 5] {
            let (x, y) = (full[&step], got[&step]);
            assert!(
                (x - y).abs() <= 1e-5,
                "resumed as {name}: step {step}'s loss {y} against {x} without the stop"
            );
        }
    }
}

/// The 3-D mesh: data 2 × pipeline 2 × tensor 2 on 8 ranks (tensor
/// groups inside each stage, with sequence parallelism and without)
/// reaches the parameters of data parallelism over 2 at the same global
/// batch.
#[test]
fn the_3d_mesh_2x2x2_on_8_ranks_matches_data_parallelism_over_2() {
    let dir = TempDir::new("pp-3d");
    let dp = run_train(
        &dir,
        "dp2",
        &["--nproc-per-node", "2", "--global-batch", "16"],
    );
    for sp in ["--sp", "--no-sp"] {
        let name = format!("3d{sp}");
        let args = [
            "--nproc-per-node",
            "8",
            "--global-batch",
            "16",
            "--tp",
            "2",
            "--pp",
            "2",
            sp,
        ];
        let got = run_train(&dir, &name, &args);
        let d = max_diff(&dp, &got);
        assert!(
            d <= TOL,
            "{name}: max |diff| {d} against data parallelism over 2"
        );
    }
}

/// `braid train` with `args` fails at start with `want` in its error.
fn refused(args: &[&str], want: &str) {
    refused_with(args, &[], want);
}

/// [`refused`] with environment variables `env`; what the run printed.
fn refused_with(args: &[&str], env: &[(&str, &str)], want: &str) -> common::Finished {
    let mut c = braid();
    c.args([
        "train",
        "--model",
        MODEL,
        "--tokenizer",
        "bytes",
        "--steps",
        "1",
    ])
    .args(args)
    .envs(env.iter().copied());
    let f = run(c, Duration::from_secs(60));
    assert_ne!(f.code, Some(0), "{args:?} ran");
    assert!(f.stderr.contains(want), "{args:?}: {}", f.stderr);
    assert!(!f.stdout.contains("step     1"), "{args:?} trained first");
    f
}

#[test]
fn schedule_files_run_and_bad_ones_are_refused_with_the_action_named() {
    let dir = TempDir::new("pp-files");
    let write = |name: &str, text: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        p.display().to_string()
    };
    // GPipe for 2 ranks and 2 micro-batches, by hand: trains like one
    // process.
    let good = write(
        "gpipe.txt",
        "# by hand\nrank 0: 0F0 0SF0 0F1 0SF1 0RB0 0B0 0RB1 0B1\n\
         rank 1: 1RF0 1F0 1RF1 1F1 1B0 1SB0 1B1 1SB1\n",
    );
    let one = run_train(&dir, "one", &["--batch", "4"]);
    let got = run_train(
        &dir,
        "file",
        &[
            "--batch",
            "4",
            "--pp",
            "2",
            "--micro-batches",
            "2",
            "--schedule",
            &good,
        ],
    );
    let d = max_diff(&one, &got);
    assert!(d <= TOL, "the schedule file: max |diff| {d}");
    let flags = |path: &str| -> Vec<String> {
        [
            "--batch",
            "4",
            "--pp",
            "2",
            "--micro-batches",
            "2",
            "--schedule",
            path,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    // A deadlock: rank 0 waits for a gradient before it sends the
    // activation rank 1 waits for.
    let dead = write(
        "dead.txt",
        "rank 0: 0F0 0RB0 0B0 0SF0 0F1 0SF1 0RB1 0B1\n\
         rank 1: 1RF0 1F0 1B0 1SB0 1RF1 1F1 1B1 1SB1\n",
    );
    let a = flags(&dead);
    refused(
        &a.iter().map(String::as_str).collect::<Vec<_>>(),
        "deadlock",
    );
    // A missing backward.
    let short = write(
        "short.txt",
        "rank 0: 0F0 0SF0 0F1 0SF1 0RB0 0B0\nrank 1: 1RF0 1F0 1RF1 1F1 1B0 1SB0 1B1\n",
    );
    let a = flags(&short);
    refused(
        &a.iter().map(String::as_str).collect::<Vec<_>>(),
        "never runs 0B1 (the backward pass)",
    );
}

#[test]
fn what_cannot_work_is_refused_at_start() {
    refused(&["--pp", "8"], "8 pipeline stages for a model of 4 layers");
    refused(
        &["--pp", "2", "--batch", "6", "--micro-batches", "4"],
        "does not split into 4 micro-batches",
    );
    refused(
        &["--pp", "2", "--schedule", "looped"],
        "expected gpipe, 1f1b",
    );
    refused(
        &[
            "--pp",
            "4",
            "--schedule",
            "interleaved",
            "--batch",
            "8",
            "--micro-batches",
            "4",
        ],
        "8 pipeline stages for a model of 4 layers",
    );
    refused(
        &[
            "--pp",
            "2",
            "--schedule",
            "interleaved",
            "--micro-batches",
            "3",
            "--batch",
            "6",
        ],
        "must divide by the 2 pipeline ranks",
    );
    refused(
        &["--nproc-per-node", "3", "--pp", "2"],
        "does not divide the 3 ranks",
    );
    refused(
        &["--pp", "2", "--stage-layers", "3,2"],
        "add up to the model's 4",
    );
    refused(
        &["--pp", "2", "--accum", "2"],
        "a pipeline's step is its --micro-batches already",
    );
    refused(&["--pp", "0"], "--pp 0");
    // A bad pipeline choice in the environment: one error, before any
    // worker starts.
    let f = refused_with(
        &["--pp", "2"],
        &[("BRAID_PP_EMBEDDINGS", "middle")],
        "BRAID_PP_EMBEDDINGS=middle",
    );
    assert!(
        !f.stdout.contains("braid launch"),
        "workers started: {}",
        f.stdout
    );
}

/// One pipeline replica keeps one gradient buffer per stage (its passes
/// accumulate there and the update reads it): 16 bytes per parameter of
/// the rank's stages, as the formula says. With data parallelism the
/// strategy's buffer, which is reduced, comes beside it.
#[test]
fn one_pipeline_replica_holds_one_gradient_buffer() {
    for (extra, want) in [
        (
            &["--nproc-per-node", "2", "--pp", "2"][..],
            "16.00 bytes per parameter",
        ),
        (
            &["--nproc-per-node", "4", "--pp", "2"],
            "20.00 bytes per parameter",
        ),
    ] {
        let args = [
            &["--model", MODEL, "--tokenizer", "bytes", "--seq", "32"][..],
            extra,
        ]
        .concat();
        let line = common::model_states_line(&args);
        assert!(line.contains(want), "{extra:?}: {line}");
    }
}
