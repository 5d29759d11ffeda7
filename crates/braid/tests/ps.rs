//! The parameter server (`braid train --ps N`) through the real binary,
//! on CPU processes: synchronous runs with one and two servers, either
//! side updating, reach the parameters of data parallelism over the same
//! workers after 10 f32 steps; checkpoints cross between the two; a
//! server or a worker killed with SIGKILL comes back and the run ends
//! where an uninterrupted one does; a worker killed under bounded
//! staleness rejoins while the other goes on; a stuck worker is named
//! within the timeout; what it cannot do yet is refused at start.

mod common;

use common::{braid, braid_args, max_diff, params, start, train, Marked, TempDir};
use std::path::Path;
use std::time::{Duration, Instant};

/// Every element of the parameters within this of data parallelism.
const TOL: f32 = 1e-5;

const MODEL: &str = "L2-H2-C32-V259-T32";

fn run_train(dir: &TempDir, name: &str, procs: usize, extra: &[&str]) -> Vec<f32> {
    let n = procs.to_string();
    let mut args = vec![
        "--model",
        MODEL,
        "--tokenizer",
        "bytes",
        "--steps",
        "10",
        "--nproc-per-node",
        &n,
    ];
    args.extend(extra);
    let (model, f) = train(dir, name, &args, &[]);
    if extra.contains(&"--ps") {
        // On a GPU host too: the workers are CPU engines.
        assert!(
            f.stdout.contains("device: cpu (--device auto with --ps"),
            "{name}: {}",
            f.stdout
        );
        assert!(
            f.stdout.contains("strategy: parameter server: ") && f.stdout.contains("update(s), "),
            "{name}: the strategy and the servers' report are printed\n{}",
            f.stdout
        );
    }
    params(&model)
}

#[test]
fn synchronous_servers_equal_data_parallelism_over_the_same_workers() {
    let dir = TempDir::new("ps-sync");
    for workers in [2usize, 3] {
        let dp = run_train(&dir, &format!("dp{workers}"), workers, &[]);
        for (servers, update) in [
            (1usize, "server"),
            (2, "worker"),
            (2, "server"),
            (1, "worker"),
        ] {
            if workers == 2 && (servers, update) == (1, "worker") {
                continue;
            }
            if workers == 3 && (servers, update) == (2, "worker") {
                continue;
            }
            let name = format!("ps{servers}-{update}-w{workers}");
            let s = servers.to_string();
            let got = run_train(
                &dir,
                &name,
                workers + servers,
                &["--ps", &s, "--ps-update", update],
            );
            let d = max_diff(&got, &dp);
            eprintln!("{name}: max diff {d} against data parallelism over {workers}");
            assert!(
                d < TOL,
                "{name}: max |diff| {d} against data parallelism over {workers}"
            );
        }
    }
}

#[test]
fn what_a_parameter_server_run_cannot_do_is_refused_at_start() {
    for (args, want) in [
        (
            &["--ps", "2", "--nproc-per-node", "2"][..],
            "leaves no worker",
        ),
        (&["--ps", "1"], "start them all"),
        (&["--ps-mode", "async"], "add --ps N"),
        (
            &["--ps", "1", "--nproc-per-node", "3", "--ps-mode", "ssp:x"],
            "ssp:S",
        ),
        (
            &[
                "--ps",
                "1",
                "--nproc-per-node",
                "3",
                "--ps-mode",
                "async",
                "--ps-update",
                "worker",
            ],
            "summation-only",
        ),
        (
            &["--ps", "1", "--nproc-per-node", "3", "--zero", "1"],
            "--ps with --zero",
        ),
        (&["--grad-comm", "topk:0.01"], "add --ps N"),
        (
            &[
                "--ps",
                "1",
                "--nproc-per-node",
                "3",
                "--grad-comm",
                "topk:2",
            ],
            "at most 1",
        ),
    ] {
        let mut full = vec!["train", "--steps", "2"];
        full.extend(args);
        let (ok, out, err) = braid_args(&full);
        assert!(!ok, "{args:?} was accepted:\n{out}");
        assert!(err.contains(want), "{args:?}: expected {want:?} in\n{err}");
    }
}

const MARK: &str = "BRAID_PS_TEST";

/// The live process doing rank `rank`'s role (the child its rank's
/// process keeps it in), among those carrying `mark`.
fn role_child(mark: &Marked, rank: usize) -> Option<u32> {
    let rank_var = format!("RANK={rank}");
    mark.survivors().into_iter().find(|pid| {
        std::fs::read(format!("/proc/{pid}/environ")).is_ok_and(|env| {
            let vars: Vec<&[u8]> = env.split(|b| *b == 0).collect();
            vars.iter().any(|v| v.starts_with(b"BRAID_PS_CHILD="))
                && vars.contains(&rank_var.as_bytes())
        })
    })
}

/// Waits (at most a minute) for `ck` to hold the checkpoint of `step`
/// while the run goes on; a run that ends first fails the test with its
/// output (why it ended), not a bare timeout.
fn wait_for_checkpoint(ck: &Path, step: usize, running: common::Running) -> common::Running {
    let want = ck.join(format!("step-{step:08}"));
    let start = Instant::now();
    let mut running = running;
    while !want.exists() {
        if running.child.try_wait().unwrap().is_some() {
            let f = running.finish(Duration::from_secs(1));
            panic!("the run ended before {}: {f:?}", want.display());
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "no {}",
            want.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    running
}

/// A parameter-server run of 24 steps (2 workers, 1 server, a checkpoint
/// every 4 steps in `ck`, each worker's step slowed 60 ms) during which
/// rank `victim`'s role gets `signal` once checkpoint 8 is there; its
/// output and model.
fn run_with_a_fault(
    dir: &TempDir,
    name: &str,
    extra: &[&str],
    env: &[(&str, &str)],
    victim: usize,
    signal: nix::sys::signal::Signal,
) -> (common::Finished, std::path::PathBuf) {
    let mark = Marked::new(MARK, name);
    let ck = dir.path().join(format!("{name}-ck"));
    let model = dir.path().join(format!("{name}.safetensors"));
    let mut cmd = braid();
    cmd.args([
        "train",
        "--model",
        MODEL,
        "--tokenizer",
        "bytes",
        "--seq",
        "32",
        "--seed",
        "11",
    ])
    .args([
        "--eval-every",
        "0",
        "--steps",
        "24",
        "--nproc-per-node",
        "3",
        "--ps",
        "1",
    ])
    .args(["--save-every", "4"])
    .arg("--ckpt-dir")
    .arg(&ck)
    .arg("--save")
    .arg(&model)
    .args(extra)
    .env("BRAID_TEST_DELAY", "0:compute:60,1:compute:60");
    for (k, v) in env {
        cmd.env(k, v);
    }
    mark.mark(&mut cmd);
    let running = wait_for_checkpoint(&ck, 8, start(cmd));
    let pid = role_child(&mark, victim).expect("the victim's process");
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), signal).unwrap();
    (running.finish(Duration::from_secs(120)), model)
}

#[test]
fn a_killed_server_or_worker_comes_back_and_the_run_ends_where_an_uninterrupted_one_does() {
    let dir = TempDir::new("ps-faults");
    // Data parallelism over the same 2 workers: what a synchronous
    // parameter-server run equals.
    let want = {
        let args = [
            "--model",
            MODEL,
            "--tokenizer",
            "bytes",
            "--steps",
            "24",
            "--nproc-per-node",
            "2",
        ];
        params(&train(&dir, "dp", &args, &[]).0)
    };
    let kill = nix::sys::signal::Signal::SIGKILL;
    // The server (rank 2): restored from checkpoint 8 or later, brought
    // level by the workers' logs.
    let (f, model) = run_with_a_fault(&dir, "server", &[], &[], 2, kill);
    assert_eq!(f.code, Some(0), "{f:?}");
    let out = format!("{}{}", f.stdout, f.stderr);
    for said in [
        "parameter server 0 was killed by signal 9: starting it again",
        "restarted, its shard from",
        "is back at",
        "replaying steps",
    ] {
        assert!(out.contains(said), "{said:?} not said:\n{out}");
    }
    let d = max_diff(&params(&model), &want);
    eprintln!("server killed: max |diff| {d} against the uninterrupted run");
    assert!(
        d < TOL,
        "server killed: max |diff| {d} against the uninterrupted run"
    );
    // A worker (rank 1): its replacement joins at the servers' step.
    let (f, model) = run_with_a_fault(&dir, "worker", &[], &[], 1, kill);
    assert_eq!(f.code, Some(0), "{f:?}");
    let out = format!("{}{}", f.stdout, f.stderr);
    assert!(
        out.contains("worker 1 was killed by signal 9")
            && out.contains("worker 1: joined the running servers at step"),
        "{out}"
    );
    let d = max_diff(&params(&model), &want);
    eprintln!("worker killed: max |diff| {d} against the uninterrupted run");
    assert!(
        d < TOL,
        "worker killed: max |diff| {d} against the uninterrupted run"
    );
}

#[test]
fn under_bounded_staleness_a_killed_worker_rejoins_and_a_stuck_one_is_named_in_sync() {
    let dir = TempDir::new("ps-ssp-fault");
    let kill = nix::sys::signal::Signal::SIGKILL;
    let (f, _) = run_with_a_fault(
        &dir,
        "ssp",
        &["--ps-mode", "ssp:2"],
        &[("BRAID_TIMEOUT", "30")],
        1,
        kill,
    );
    assert_eq!(f.code, Some(0), "{f:?}");
    let out = format!("{}{}", f.stdout, f.stderr);
    assert!(
        out.contains("worker 1: joined the running servers at step"),
        "{out}"
    );
    assert!(
        out.contains("staleness of the"),
        "the server says the pushes' staleness\n{out}"
    );
    // A stuck worker (stopped) in a synchronous run: named by the server
    // within BRAID_TIMEOUT, and the run ends. (10 s: at 4 a run on a
    // loaded two-core machine once timed out before its checkpoint 8.)
    let t = Instant::now();
    let stop = nix::sys::signal::Signal::SIGSTOP;
    let (f, _) = run_with_a_fault(&dir, "stuck", &[], &[("BRAID_TIMEOUT", "10")], 1, stop);
    assert_ne!(f.code, Some(0), "{f:?}");
    assert!(t.elapsed() < Duration::from_secs(60));
    let out = format!("{}{}", f.stdout, f.stderr);
    assert!(
        out.contains("waited 10 s for step") && out.contains("from worker 1"),
        "the stuck worker is named\n{out}"
    );
}

#[test]
fn checkpoints_cross_between_data_parallelism_and_a_parameter_server() {
    let dir = TempDir::new("ps-ckpt");
    let base = ["--model", MODEL, "--tokenizer", "bytes", "--nproc-per-node"];
    let want = {
        let mut a = base.to_vec();
        a.extend(["2", "--steps", "20"]);
        params(&train(&dir, "dp20", &a, &[]).0)
    };
    for (first, then, name) in [
        (&["2"][..], &["3", "--ps", "1"][..], "dp-then-ps"),
        (&["3", "--ps", "1"], &["2"], "ps-then-dp"),
        (
            &["3", "--ps", "1", "--ps-update", "worker"],
            &["4", "--ps", "2"],
            "psw-then-ps",
        ),
    ] {
        let ck = dir.path().join(format!("{name}-ck"));
        let from = ck.join("step-00000010");
        let (ck, from) = (ck.to_str().unwrap(), from.to_str().unwrap());
        let mut a = base.to_vec();
        a.extend(first);
        a.extend(["--steps", "20", "--ckpt-dir", ck, "--save-every", "10"]);
        train(&dir, &format!("{name}-1"), &a, &[]);
        // The second half again, from step 10's checkpoint.
        let mut b = base.to_vec();
        b.extend(then);
        b.extend(["--steps", "20", "--resume", from]);
        let (model, f) = train(&dir, &format!("{name}-2"), &b, &[]);
        assert!(f.stdout.contains("resuming from"), "{name}: {}", f.stdout);
        let d = max_diff(&params(&model), &want);
        assert!(
            d < TOL,
            "{name}: max |diff| {d} against 20 uninterrupted steps"
        );
    }
}

#[test]
fn the_staleness_of_each_push_is_said_traced_and_reported() {
    let dir = TempDir::new("ps-staleness");
    let tr = dir.path().join("trace");
    let tr = tr.to_str().unwrap();
    let (_, f) = train(
        &dir,
        "ssp",
        &[
            "--model",
            MODEL,
            "--tokenizer",
            "bytes",
            "--steps",
            "12",
            "--nproc-per-node",
            "3",
            "--ps",
            "1",
            "--ps-mode",
            "ssp:1",
            "--trace",
            tr,
        ],
        &[("BRAID_TEST_DELAY", "1:compute:30")],
    );
    for w in 0..2 {
        assert!(
            f.stdout
                .contains(&format!("worker {w}: staleness of its 12 pushes: mean ")),
            "{}",
            f.stdout
        );
    }
    assert!(
        f.stdout.contains("staleness of the 24 push(es)"),
        "{}",
        f.stdout
    );
    let (ok, out, err) = braid_args(&["report", tr]);
    assert!(ok, "{err}");
    assert!(out.contains("-- parameter server: staleness"), "{out}");
    for w in 0..2 {
        assert!(
            out.contains(&format!("worker {w}: 12 pushes, mean ")),
            "{out}"
        );
    }
}

#[test]
fn one_asynchronous_worker_trains_as_one_process() {
    // Nothing is stale with one worker: no compensation, the same steps.
    let dir = TempDir::new("ps-one-async");
    let one = params(
        &train(
            &dir,
            "one",
            &["--model", MODEL, "--tokenizer", "bytes", "--steps", "10"],
            &[],
        )
        .0,
    );
    let got = run_train(&dir, "async1", 2, &["--ps", "1", "--ps-mode", "async"]);
    let d = max_diff(&got, &one);
    assert!(
        d < TOL,
        "one async worker: max |diff| {d} against one process"
    );
}

#[test]
fn top_k_pushes_with_error_feedback_train() {
    let dir = TempDir::new("ps-topk");
    let (_, f) = train(
        &dir,
        "topk",
        &[
            "--model",
            MODEL,
            "--tokenizer",
            "bytes",
            "--steps",
            "30",
            "--nproc-per-node",
            "3",
            "--ps",
            "1",
            "--grad-comm",
            "topk:0.05",
        ],
        &[],
    );
    assert!(
        f.stdout
            .contains("gradients pushed in top-k 0.05 with error feedback"),
        "{}",
        f.stdout
    );
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("topk.json")).unwrap())
            .unwrap();
    let losses = common::step_losses(&doc);
    let (first, last) = (losses[0], *losses.last().unwrap());
    assert!(
        last < first - 1.0,
        "top-k training moved the loss from {first} to {last}"
    );
}
