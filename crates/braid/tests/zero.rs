//! ZeRO (stages 1 and 2) through the real binary: worker processes over
//! shared memory or TCP, each owning a shard of the optimizer, checked
//! against data parallelism and one process on the whole batch.

mod common;

use common::{braid, max_diff, params, run, Finished, TempDir};
use std::path::PathBuf;
use std::time::Duration;

/// Stated tolerance, as for data parallelism: after 20 AdamW steps at lr
/// 3e-3 (parameters move by up to ~0.06) ZeRO's parameters agree with one
/// process's within this. Against data parallelism over the same ranks
/// the sums are the collective's in both, so the tolerance is the same
/// (the norm's sum over shards is the one difference in order).
const TOLERANCE: f32 = 1e-4;

/// `braid train` on the tiny model with clipping (the norm is summed
/// over the shards), saving the parameters.
fn train(dir: &TempDir, name: &str, args: &[&str], env: &[(&str, &str)]) -> (PathBuf, Finished) {
    common::train(dir, name, &[&["--grad-clip", "1.0"], args].concat(), env)
}

/// `got` within [`TOLERANCE`] of one process's parameters and, where
/// given, data parallelism's.
fn assert_close(name: &str, got: &[f32], one: &[f32], ddp: Option<&[f32]>) {
    let d = max_diff(one, got);
    assert!(
        d <= TOLERANCE,
        "{name}: parameters differ from one process by {d} (tolerance {TOLERANCE})"
    );
    if let Some(ddp) = ddp {
        let d = max_diff(ddp, got);
        assert!(
            d <= TOLERANCE,
            "{name}: parameters differ from data parallelism by {d} (tolerance {TOLERANCE})"
        );
    }
}

#[test]
fn zero_1_and_2_match_data_parallel_and_one_process_on_shm_and_tcp() {
    let dir = TempDir::new("zero-equal");
    let (one, _) = train(&dir, "one", &["--batch", "8"], &[]);
    let reference = params(&one);
    let (ddp, _) = train(&dir, "ddp2", &["--nproc", "2", "--batch", "4"], &[]);
    let ddp = params(&ddp);
    for (name, args, env) in [
        (
            "z1-shm2",
            &["--nproc", "2", "--batch", "4", "--zero", "1"][..],
            &[][..],
        ),
        (
            // Many small buckets: blocks in and out of launch order.
            "z2-shm2",
            &["--nproc", "2", "--batch", "4", "--zero", "2"][..],
            &[][..],
        ),
        (
            "z2-tcp2",
            &["--nproc", "2", "--batch", "4", "--zero", "2"][..],
            &[("BRAID_BACKEND", "tcp")][..],
        ),
        (
            "z1-shm4",
            &[
                "--nproc",
                "4",
                "--batch",
                "2",
                "--zero",
                "1",
                "--bucket-mb",
                "0.05",
            ][..],
            &[][..],
        ),
        (
            "z2-tcp4",
            &["--nproc", "4", "--batch", "2", "--zero", "2"][..],
            &[("BRAID_BACKEND", "tcp")][..],
        ),
        (
            "z2-shm4-hsdp",
            &[
                "--nproc",
                "4",
                "--batch",
                "2",
                "--zero",
                "2",
                "--shard-group",
                "2",
            ][..],
            &[][..],
        ),
    ] {
        let (path, f) = train(&dir, name, args, env);
        let (stage, backend, n) = (&name[1..2], &name[3..6], &name[6..7]);
        if name.ends_with("hsdp") {
            assert!(
                f.stdout.contains("hybrid: shard groups of 2, 2 replicas"),
                "{name}: {}",
                f.stdout
            );
        }
        if stage == "1" {
            // f32 on the CPU: the parameters are the master weights, and
            // stage 1 holds exactly 8Ψ + 8Ψ/N (plus the padding).
            assert!(
                f.stdout.contains("(measured / formula 1.0"),
                "{name}: {}",
                f.stdout
            );
        }
        assert!(
            f.stdout
                .contains(&format!("ZeRO stage {stage} over {n} ranks ({backend})")),
            "{name}: {}",
            f.stdout
        );
        let ddp = (n == "2").then_some(&ddp[..]);
        assert_close(name, &params(&path), &reference, ddp);
    }
}

/// ZeRO-3 (parameters gathered unit by unit, gradients reduce-scattered
/// per unit) reaches the parameters of data parallelism and of one
/// process: on shm and tcp, 2 and 4 ranks, with gradient accumulation
/// (reduce-scattered per micro-batch), with the parameters kept from the
/// forward pass to the backward, and hybrid (2 groups × 2); its model
/// state is the formula's 16Ψ/N.
#[test]
fn zero_3_matches_data_parallel_and_one_process() {
    let dir = TempDir::new("zero3-equal");
    let (one, _) = train(&dir, "one", &["--batch", "8"], &[]);
    let reference = params(&one);
    let (ddp, _) = train(&dir, "ddp2", &["--nproc", "2", "--batch", "4"], &[]);
    let ddp = params(&ddp);
    let z3 = ["--zero", "3"];
    for (name, args, env) in [
        // A world of one rank sharded over itself.
        ("shm1", &["--nproc", "1", "--batch", "8"][..], &[][..]),
        ("shm2", &["--nproc", "2", "--batch", "4"][..], &[][..]),
        (
            "tcp2",
            &["--nproc", "2", "--batch", "4", "--no-reshard-after-forward"][..],
            &[("BRAID_BACKEND", "tcp")][..],
        ),
        (
            "shm4-accum",
            &["--nproc", "4", "--batch", "1", "--accum", "2"][..],
            &[][..],
        ),
        (
            "shm4-hsdp",
            &["--nproc", "4", "--batch", "2", "--shard-group", "2"][..],
            &[][..],
        ),
    ] {
        let (path, f) = train(&dir, name, &[&z3[..], args].concat(), env);
        let n = &name[3..4];
        let backend = &name[..3];
        assert!(
            f.stdout
                .contains(&format!("ZeRO stage 3 over {n} ranks ({backend})")),
            "{name}: {}",
            f.stdout
        );
        if name.ends_with("hsdp") {
            assert!(f.stdout.contains("hybrid: shard groups of 2, 2 replicas"));
        } else {
            // Parameters, gradients and AdamW's moments: 16Ψ/N exactly
            // (plus the padding).
            assert!(
                f.stdout.contains("16Ψ/N") && f.stdout.contains("(measured / formula 1.0"),
                "{name}: {}",
                f.stdout
            );
        }
        let ddp = (n == "2").then_some(&ddp[..]);
        assert_close(name, &params(&path), &reference, ddp);
    }
}

#[test]
fn zero_3_reducing_the_embeddings_in_two_parts_matches_data_parallel() {
    // A model whose embeddings' block is a little shorter than a layer's
    // (664 × 64 against 12 × 64² + 13 × 64), so that one buffer serves
    // both; and the tiny model, whose embeddings' block is far longer.
    let dir = TempDir::new("zero3-split");
    for (model, shares) in [("L2-H2-C64-V600-T64", true), ("tiny", false)] {
        let m = ["--model", model, "--tokenizer", "bytes"];
        let (one, _) = train(&dir, "one", &[&m[..], &["--batch", "8"]].concat(), &[]);
        let reference = params(&one);
        let (ddp, _) = train(
            &dir,
            "ddp2",
            &[&m[..], &["--nproc", "2", "--batch", "4"]].concat(),
            &[],
        );
        let ddp = params(&ddp);
        let on = [("BRAID_SPLIT_REDUCE", "on")];
        for (name, args, env) in [
            // Checkpointing chooses it where one buffer serves both.
            (
                "shm2-ckpt",
                &["--nproc", "2", "--batch", "4", "--checkpointing"][..],
                &[][..],
            ),
            ("tcp2", &["--nproc", "2", "--batch", "4"][..], &on[..]),
            (
                "shm4-accum",
                &["--nproc", "4", "--batch", "1", "--accum", "2"][..],
                &on[..],
            ),
        ] {
            let forced = !env.is_empty();
            let env = match name {
                "tcp2" => [env, &[("BRAID_BACKEND", "tcp")][..]].concat(),
                _ => env.to_vec(),
            };
            let args = [&m[..], &["--zero", "3"], args].concat();
            let (path, f) = train(&dir, name, &args, &env);
            let split = f.stdout.contains("the tied embeddings' in two parts");
            assert_eq!(split, shares || forced, "{model} {name}: {}", f.stdout);
            let ddp = name.contains('2').then_some(&ddp[..]);
            assert_close(&format!("{model} {name}"), &params(&path), &reference, ddp);
        }
    }
    // Only ZeRO-3 reduces per block.
    let mut cmd = braid();
    cmd.args(["train", "--nproc", "2", "--zero", "2", "--steps", "1"])
        .env("BRAID_SPLIT_REDUCE", "on");
    let f = run(cmd, Duration::from_secs(60));
    assert_ne!(f.code, Some(0), "{f:?}");
    assert!(
        f.stderr.contains("BRAID_SPLIT_REDUCE=on: only --zero 3"),
        "{}",
        f.stderr
    );
}

/// ZeRO-3 keeping every freed block buffer for reuse
/// (`BRAID_ZERO3_SPARES=kept`) makes none after its first steps and
/// trains to the same bits as the default, which on CPUs keeps at most a
/// few and makes some every step; a bad value is refused.
#[test]
fn zero_3_keeping_every_spare_changes_no_bits() {
    let dir = TempDir::new("zero3-spares");
    let args = ["--zero", "3", "--nproc", "2", "--batch", "4"];
    let made = |f: &Finished| -> u64 {
        let line = f
            .stdout
            .lines()
            .find_map(|l| l.split("block buffers made: ").nth(1))
            .unwrap_or_else(|| panic!("no block-buffer line: {}", f.stdout));
        line.split(' ').next().unwrap().parse().unwrap()
    };
    let (capped, f) = train(&dir, "capped", &args, &[]);
    assert!(made(&f) > 0, "{}", f.stdout);
    let (kept, f) = train(&dir, "kept", &args, &[("BRAID_ZERO3_SPARES", "kept")]);
    assert_eq!(made(&f), 0, "{}", f.stdout);
    let d = max_diff(&params(&capped), &params(&kept));
    assert!(d == 0.0, "kept spares changed the parameters by {d}");
    let mut cmd = braid();
    cmd.args(["train", "--nproc", "2", "--zero", "3", "--steps", "1"])
        .env("BRAID_ZERO3_SPARES", "all");
    let f = run(cmd, Duration::from_secs(60));
    assert_ne!(f.code, Some(0), "{f:?}");
    assert!(
        f.stderr
            .contains("BRAID_ZERO3_SPARES=all: expected kept, capped or auto"),
        "{}",
        f.stderr
    );
}

#[test]
fn impossible_zero_setups_are_refused_at_start() {
    for (args, want) in [
        (&["--zero", "3"][..], "start several"),
        (
            &["--zero", "2", "--nproc", "2", "--no-reshard-after-forward"][..],
            "use --zero 3",
        ),
        (
            &["--nproc", "2", "--no-reshard-after-forward"][..],
            "add --zero 3",
        ),
        (&["--zero", "7"][..], "expected 1, 2 or 3"),
        (
            &["--zero", "2", "--nproc", "2", "--bucket-mb", "4"][..],
            "reduce-scatters each parameter block",
        ),
        (&["--zero", "1", "--fsdp"][..], "--fsdp means --zero 3"),
        (&["--zero", "2"][..], "start several"),
        (
            &["--nproc", "2", "--shard-group", "2"][..],
            "add --zero 1, 2 or 3",
        ),
        (
            &["--zero", "2", "--nproc", "4", "--shard-group", "3"][..],
            "does not divide the 4 ranks",
        ),
        (
            &["--zero", "2", "--nproc", "2", "--grad-comm", "bf16"][..],
            "drop --grad-comm",
        ),
        (
            &["--zero", "1", "--nproc", "2", "--defer-layers", "1"][..],
            "drop --defer-layers",
        ),
    ] {
        let mut cmd = braid();
        cmd.arg("train").args(args);
        let f = run(cmd, Duration::from_secs(60));
        assert_ne!(f.code, Some(0), "{args:?}: {f:?}");
        assert!(f.stderr.contains(want), "{args:?}: {}", f.stderr);
    }
    // ZeRO-3's update beside the forward pass: removed, and said so; its
    // copy-engine gathers: on GPUs only, and a bad value named.
    let (beside, via) = ("BRAID_UPDATE_BESIDE", "BRAID_ZERO3_GATHER_VIA");
    for (args, var, value, want) in [
        (
            &["--zero", "3", "--nproc", "2"][..],
            beside,
            "on",
            "BRAID_UPDATE_BESIDE=on: ZeRO-3's update beside the forward pass was removed",
        ),
        (
            &["--zero", "3", "--nproc", "2"][..],
            via,
            "ce",
            "copy-engine gathers are ZeRO-3's on GPUs",
        ),
        (
            &["--zero", "3", "--nproc", "2"][..],
            via,
            "kernels",
            "BRAID_ZERO3_GATHER_VIA=\"kernels\": expected auto, ce or nccl",
        ),
    ] {
        let mut cmd = braid();
        cmd.arg("train").args(args).env(var, value);
        let f = run(cmd, Duration::from_secs(60));
        assert_eq!(f.code, Some(2), "{args:?} {var}={value}: {f:?}");
        assert!(
            f.stderr.contains(want),
            "{args:?} {var}={value}: {}",
            f.stderr
        );
        assert!(
            !f.stderr.contains("[rank"),
            "said by a worker: {}",
            f.stderr
        );
    }
}

/// Workers on one host share its memory: a data-parallel run of a model
/// that only fits with its optimizer sharded is refused before anything
/// is allocated, naming each worker's share and `--zero 1`. (The model is
/// sized from this machine's available memory: 14 bytes per parameter of
/// each worker's share, between ZeRO-1's 12 and data parallelism's 16.)
#[test]
fn data_parallel_that_only_fits_sharded_is_told_to_use_zero() {
    let meminfo = std::fs::read_to_string("/proc/meminfo").expect("/proc/meminfo");
    let kb: u64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("MemAvailable");
    let share = kb * 1024 / 2;
    let params = share / 14;
    // Width 1024, byte vocabulary: 12.6M parameters a layer.
    let layers = (params / (12 * 1024 * 1024 + 13 * 1024)).max(1);
    let model = format!("L{layers}-H16-C1024");
    let mut cmd = braid();
    cmd.args([
        "train", "--model", &model, "--nproc", "2", "--seq", "32", "--batch", "1",
    ]);
    let f = run(cmd, Duration::from_secs(60));
    assert_ne!(f.code, Some(0), "{model}: {f:?}");
    assert!(
        f.stderr.contains("for each of the 2 workers on this host")
            && f.stderr.contains("what would fit: --zero 1"),
        "{model}: {}",
        f.stderr
    );
}
