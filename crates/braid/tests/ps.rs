//! The parameter server (`braid train --ps N`) through the real binary,
//! on CPU processes: synchronous runs with one and two servers, either
//! side updating, reach the parameters of data parallelism over the same
//! workers after 10 f32 steps; what it cannot do yet is refused at start.

mod common;

use common::{braid_args, max_diff, params, train, TempDir};

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
        (
            &[
                "--ps",
                "1",
                "--nproc-per-node",
                "3",
                "--ckpt-dir",
                "/tmp/braid-ps-ck-refused",
            ],
            "--ps-update worker checkpoints",
        ),
    ] {
        let mut full = vec!["train", "--steps", "2"];
        full.extend(args);
        let (ok, out, err) = braid_args(&full);
        assert!(!ok, "{args:?} was accepted:\n{out}");
        assert!(err.contains(want), "{args:?}: expected {want:?} in\n{err}");
    }
}
