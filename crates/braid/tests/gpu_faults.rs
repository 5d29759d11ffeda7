//! Faults in training on 2 GPUs, through the real binary (the GPU legs of
//! the fault-tolerance tests in `flight.rs` and `ckpt.rs`): a rank stopped
//! with SIGSTOP is named, with the operation it did not reach, and every
//! rank ends within BRAID_TIMEOUT + 10 s, over the copy engines and over
//! NCCL; a rank killed with SIGKILL under `--max-restarts 1 --resume auto`
//! ends with the parameters of an uninterrupted run (data parallel and
//! ZeRO-3); a ZeRO-3 checkpoint of 4 CPU ranks goes on under data
//! parallelism on 2 GPUs and then on one.
//!
//! Without 2 GPUs (CI) each test says "skipped". Launchers carry a marker
//! variable; a guard SIGKILLs every process carrying it when a test ends.

mod common;

use common::*;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

const MARKER_VAR: &str = "BRAID_GPU_FAULT_TEST_MARKER";
const TIMEOUT_S: u64 = 5;

/// Says `line` past the test harness's capture, so that the device log
/// keeps the measured figures.
fn say(line: &str) {
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// `braid launch` of 2 workers on this host, each writing its pid to
/// `pids/pid.RANK.RESTART` and then running `braid ARGS` on its GPU.
fn two_gpu_workers(
    marked: &Marked,
    pids: &Path,
    logs: &Path,
    restarts: &str,
    args: &str,
) -> std::process::Command {
    let exe = env!("CARGO_BIN_EXE_braid");
    let script = format!(
        "echo $$ > {d}/pid.$RANK.$BRAID_RESTART_COUNT; exec {exe} {args}",
        d = pids.display()
    );
    let mut cmd = braid();
    marked
        .mark(&mut cmd)
        .env("NCCL_NVLS_ENABLE", "0")
        .env_remove("BRAID_LOG_DIR")
        .args([
            "launch",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            restarts,
            "--log-dir",
        ])
        .arg(logs)
        .args(["--", "sh", "-c", &script]);
    cmd
}

/// The pid rank `rank` wrote in its `restart`th start.
fn pid_of(pids: &Path, rank: usize, restart: usize) -> i32 {
    std::fs::read_to_string(pids.join(format!("pid.{rank}.{restart}")))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// Waits (up to `limit`) until `path` exists.
fn wait_for(path: &Path, limit: Duration) {
    let t0 = Instant::now();
    while !path.exists() {
        assert!(
            t0.elapsed() < limit,
            "no {} after {limit:?}",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn gpu_a_stopped_rank_in_data_parallel_training_is_named_within_the_timeout() {
    if gpus(2).is_none() {
        return;
    }
    for via in ["ce", "nccl"] {
        let marked = Marked::new(MARKER_VAR, &format!("gpu-sigstop-{via}"));
        let dir = TempDir::new(&format!("gpu-sigstop-{via}"));
        let (pids, logs, ck) = (
            dir.path().join("pids"),
            dir.path().join("logs"),
            dir.path().join("ck"),
        );
        std::fs::create_dir_all(&pids).unwrap();
        let args = format!(
            "train --device cuda --steps 100000000 --batch 4 --seq 32 --eval-every 0 \
             --log-every 1000 --save-every 100 --keep 1 --ckpt-dir {}",
            ck.display()
        );
        let mut cmd = two_gpu_workers(&marked, &pids, &logs, "0", &args);
        cmd.env("BRAID_TIMEOUT", TIMEOUT_S.to_string())
            .env("BRAID_GPU_ALLREDUCE", via);
        let running = start(cmd);
        // Training runs once the first checkpoint is there.
        wait_for(&ck.join("step-00000100"), Duration::from_secs(90));
        std::thread::sleep(Duration::from_millis(300));
        let rank1 = pid_of(&pids, 1, 0);
        kill(Pid::from_raw(rank1), Signal::SIGSTOP).unwrap();
        let stopped = Instant::now();
        let limit = Duration::from_secs(TIMEOUT_S + 10);
        let f = running.finish(limit + Duration::from_secs(20));
        let ended = stopped.elapsed();
        let err0 = f
            .stderr
            .lines()
            .find(|l| l.starts_with("[rank 0] braid: error:"))
            .unwrap_or_else(|| panic!("{via}: no error from rank 0:\n{}", f.stderr))
            .to_string();
        let diagnosis: Vec<&str> = f
            .stderr
            .lines()
            .filter(|l| l.contains(" ranks): "))
            .collect();
        say(&format!(
            "{via}: ended {ended:.1?} after the stop (limit {limit:?})\n  rank 0: {err0}\n  launcher: {}",
            diagnosis.join("\n  launcher: ")
        ));
        assert!(
            ended <= limit,
            "{via}: ended {ended:?} after the stop\n{}",
            f.stderr
        );
        assert_ne!(f.code, Some(0), "{via}: {f:?}");
        // Rank 0 names rank 1 and the operation it did not reach; so
        // does the launcher.
        let at = err0
            .find(" timed out after")
            .unwrap_or_else(|| panic!("{via}: not a timeout: {err0}"));
        let seq: u64 = err0[..at][err0[..at].rfind('#').expect("a sequence number") + 1..]
            .parse()
            .expect("a number");
        let op = if err0[..at].contains("all_reduce #") {
            "all_reduce"
        } else {
            panic!("{via}: rank 0 timed out in something else than an all-reduce: {err0}")
        };
        assert!(
            err0.contains("rank 1 stopped") && err0.contains(&format!("did not reach {op} #{seq}")),
            "{via}: {err0}"
        );
        assert!(
            diagnosis.iter().any(|l| l.contains("rank 1 stopped")),
            "{via}: the launcher did not name rank 1:\n{}",
            f.stderr
        );
        drop(marked);
    }
}

/// The checkpointed training of the kill-and-restart runs: 600 steps of
/// the tiny model on 2 GPUs, a checkpoint every 40, resumed from the
/// newest.
const ELASTIC: &str = "train --device cuda --steps 600 --seq 32 --batch 4 --eval-every 0 \
                       --seed 11 --save-every 40 --resume auto";

#[test]
fn gpu_a_rank_killed_mid_run_restarts_from_the_checkpoint_and_ends_as_if_never_killed() {
    if gpus(2).is_none() {
        return;
    }
    for (name, extra) in [("ddp", ""), ("zero3", "--zero 3")] {
        let dir = TempDir::new(&format!("gpu-kill-{name}"));
        let marked = Marked::new(MARKER_VAR, &format!("gpu-kill-{name}"));
        let pids = dir.path().join("pids");
        std::fs::create_dir_all(&pids).unwrap();
        let d = dir.path().display();
        let reference = format!("{ELASTIC} {extra} --ckpt-dir {d}/ref --save {d}/ref.safetensors");
        let f = run(
            two_gpu_workers(
                &marked,
                &pids,
                &dir.path().join("logs-ref"),
                "0",
                &reference,
            ),
            Duration::from_secs(180),
        );
        assert_eq!(f.code, Some(0), "{name} uninterrupted: {f:?}");
        let killed = format!("{ELASTIC} {extra} --ckpt-dir {d}/ck --save {d}/killed.safetensors");
        let running = start(two_gpu_workers(
            &marked,
            &pids,
            &dir.path().join("logs"),
            "1",
            &killed,
        ));
        // Kill rank 1 past the third checkpoint, at a moment that varies
        // from run to run (the outcome must not depend on it).
        wait_for(
            &dir.path().join("ck").join("step-00000120"),
            Duration::from_secs(120),
        );
        let jitter = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_micros()
            % 300_000;
        std::thread::sleep(Duration::from_micros(jitter as u64));
        let _ = kill(Pid::from_raw(pid_of(&pids, 1, 0)), Signal::SIGKILL);
        let f = running.finish(Duration::from_secs(180));
        assert_eq!(f.code, Some(0), "{name} killed: {f:?}");
        let out = format!("{}{}", f.stdout, f.stderr);
        let restarted = out.contains("restarting the worker group");
        let resumed_from = out
            .lines()
            .find(|l| l.contains("resuming from"))
            .unwrap_or("")
            .to_string();
        if restarted {
            assert!(!resumed_from.is_empty(), "{name}: {out}");
        } else {
            // The kill came after the last step: nothing to restart.
            assert!(out.contains("saved"), "{name}: {out}");
        }
        let (a, b) = (
            params(&dir.path().join("ref.safetensors")),
            params(&dir.path().join("killed.safetensors")),
        );
        let diff = max_diff(&a, &b);
        say(&format!(
            "{name}: killed {jitter} us past step 120's checkpoint; restarted: {restarted} ({}); \
             max |diff| against the uninterrupted run {diff:e}",
            resumed_from.trim()
        ));
        // As the GPU resume test: the kernels are deterministic, so bit
        // for bit.
        assert!(
            a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
            "{name}: the restarted run's parameters differ by up to {diff}"
        );
        drop(marked);
    }
}

/// Stated tolerance of resharding from CPU ranks onto GPUs: after 20 more
/// AdamW steps (lr 3e-3) in f32 on other hardware (other kernels, other
/// summation orders), the losses agree with the CPU run's within this.
const CPU_TO_GPU_LOSS_TOLERANCE: f64 = 2e-3;

#[test]
fn gpu_zero3_on_4_cpu_ranks_resumes_data_parallel_on_2_gpus_then_on_one() {
    if gpus(2).is_none() {
        return;
    }
    let dir = TempDir::new("gpu-reshard");
    let ck = dir.path().join("ck");
    let ck2 = dir.path().join("ck2");
    // Global batch 16 throughout: 4 CPU ranks x 4, 2 GPUs x 8, 1 GPU x 16.
    let z3 = zero3_on_4_ranks_with_checkpoints(&dir, "z3", &ck);
    let gpu_env = [("NCCL_NVLS_ENABLE", "0")];
    let (ddp, f) = train(
        &dir,
        "ddp-gpu",
        &[
            "--device",
            "cuda",
            "--precision",
            "f32",
            "--nproc",
            "2",
            "--batch",
            "8",
            "--steps",
            "30",
            "--resume",
            ck.join("step-00000010").to_str().unwrap(),
            "--save-every",
            "10",
            "--ckpt-dir",
            ck2.to_str().unwrap(),
        ],
        &gpu_env,
    );
    assert!(
        f.stdout.contains("written by 4 ranks under ZeRO-3"),
        "{}",
        f.stdout
    );
    let (one, _) = train(
        &dir,
        "one-gpu",
        &[
            "--device",
            "cuda",
            "--precision",
            "f32",
            "--batch",
            "16",
            "--steps",
            "30",
            "--resume",
            ck2.join("step-00000020").to_str().unwrap(),
        ],
        &gpu_env,
    );
    let losses = |name: &str| json_losses(&dir, name);
    let (z3l, ddpl, onel) = (losses("z3"), losses("ddp-gpu"), losses("one-gpu"));
    assert_eq!((ddpl.len(), onel.len()), (20, 10));
    let worst = |resumed: &[f64], from: usize| {
        resumed
            .iter()
            .zip(&z3l[from..])
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max)
    };
    let (d_ddp, d_one) = (worst(&ddpl, 10), worst(&onel, 20));
    let (p_ddp, p_one) = (
        max_diff(&params(&z3), &params(&ddp)),
        max_diff(&params(&z3), &params(&one)),
    );
    say(&format!(
        "reshard: losses against ZeRO-3 on 4 CPU ranks: 2 GPUs (steps 11-30) max |diff| {d_ddp:e}, \
         1 GPU (steps 21-30) {d_one:e}; parameters at step 30: {p_ddp:e}, {p_one:e}"
    ));
    assert!(
        d_ddp <= CPU_TO_GPU_LOSS_TOLERANCE && d_one <= CPU_TO_GPU_LOSS_TOLERANCE,
        "the loss curve does not go on: {d_ddp} and {d_one}"
    );
    // Consolidated, the GPU run's checkpoint is a model braid generate
    // loads.
    let out = dir.path().join("consolidated.safetensors");
    consolidate(&ck2, &out);
    assert_eq!(
        params(&out),
        params(&ddp),
        "the newest checkpoint of the 2-GPU run is its end"
    );
    generate_loads(&out);
}
