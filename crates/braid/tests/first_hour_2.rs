//! A PyTorch user's first hour, second round (issue 63): one test per
//! finding — torchrun's whole flag set and its `PET_*` variables in `braid
//! launch`, examples that run on the default model, errors that name the
//! real cause in the right order, pipeline flags that need a pipeline,
//! `.beton` windows that cover the corpus, resuming a checkpoint's model,
//! and output that says what is true.

mod common;

use common::{braid, free_port, run, TempDir};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(120);

fn braid_in(dir: &Path, args: &[&str]) -> common::Finished {
    let mut cmd = braid();
    cmd.current_dir(dir).args(args);
    run(cmd, LIMIT)
}

/// A worker that says which rank it is on stdout and stderr, and its role.
const SAY: &str = "echo out-$RANK-$ROLE_NAME; echo err-$RANK >&2";

/// Point 1: a flag braid's launcher does not know is refused before any
/// rank starts, naming the closest one; every torchrun flag is accepted
/// (the ones braid has no use for with a note); `--tee`, `--redirects` and
/// `--local-ranks-filter` route the workers' streams as torchrun does;
/// `--rdzv-endpoint HOST:0` picks a free port on one node.
#[test]
fn launch_takes_torchruns_whole_flag_set_and_refuses_the_rest() {
    let dir = TempDir::new("first2-launch");
    // A typo: refused, the right flag named, nothing started.
    let f = braid_in(dir.path(), &["launch", "--nprocs", "2", "true"]);
    assert_eq!(f.code, Some(2), "{f:?}");
    assert!(
        f.stderr.contains("unknown flag --nprocs") && f.stderr.contains("--nproc-per-node"),
        "{}",
        f.stderr
    );
    assert!(
        !f.stderr.contains("starts ranks"),
        "a rank started: {}",
        f.stderr
    );
    let f = braid_in(dir.path(), &["launch", "--wat", "3", "true"]);
    assert_eq!(f.code, Some(2), "{f:?}");
    assert!(f.stderr.contains("unknown flag --wat"), "{}", f.stderr);

    // torchrun's flags, each spelling, with the ones braid needs not noted.
    let port = free_port().to_string();
    let f = braid_in(
        dir.path(),
        &[
            "launch",
            "--nproc_per_node=2",
            "--master_port",
            &port,
            "--monitor_interval",
            "1",
            "--start-method",
            "fork",
            "--role",
            "trainer",
            "--rdzv_conf",
            "join_timeout=60,read_timeout=5",
            "--event_log_handler",
            "null",
            "--local-addr",
            "127.0.0.1",
            "--logs_specs",
            "mine",
            "--numa-binding",
            "node",
            "--use_env",
            "--signals-to-handle",
            "SIGTERM,SIGINT,SIGUSR2",
            "sh",
            "-c",
            SAY,
        ],
    );
    assert_eq!(f.code, Some(0), "{f:?}");
    for want in ["out-0-trainer", "out-1-trainer"] {
        assert!(f.stdout.contains(want), "missing {want}: {f:?}");
    }
    for note in [
        "--monitor-interval 1",
        "--start-method fork",
        "read_timeout=5",
        "--local-addr",
        "--logs-specs mine",
        "--numa-binding node",
        "--use-env",
    ] {
        assert!(f.stderr.contains(note), "no note on {note}: {}", f.stderr);
    }
    assert!(!f.stderr.contains("join_timeout=60"), "{}", f.stderr);

    // --tee 3: both streams on the console and in the log files.
    let logs = dir.path().join("tee");
    let port = free_port().to_string();
    let logs_s = logs.to_string_lossy().into_owned();
    let f = braid_in(
        dir.path(),
        &[
            "launch",
            "--nproc-per-node",
            "2",
            "--master-port",
            &port,
            "--tee",
            "3",
            "--log_dir",
            &logs_s,
            "sh",
            "-c",
            SAY,
        ],
    );
    assert_eq!(f.code, Some(0), "{f:?}");
    assert!(
        f.stdout.contains("out-1") && f.stderr.contains("err-1"),
        "{f:?}"
    );
    let log1 = std::fs::read_to_string(logs.join("rank1.log")).unwrap();
    assert!(log1.contains("out-1") && log1.contains("err-1"), "{log1}");

    // --redirects 1 without --log-dir: stdout only in the run's log files
    // (their directory printed), stderr on the console.
    let port = free_port().to_string();
    let f = braid_in(
        dir.path(),
        &[
            "launch",
            "--nproc-per-node",
            "2",
            "--master-port",
            &port,
            "-r",
            "1",
            "sh",
            "-c",
            SAY,
        ],
    );
    assert_eq!(f.code, Some(0), "{f:?}");
    assert!(!f.stdout.contains("out-"), "stdout not redirected: {f:?}");
    assert!(f.stderr.contains("err-0"), "{f:?}");
    let shown = f
        .stderr
        .lines()
        .find_map(|l| l.split("logs (rank<N>.log) and flight records to ").nth(1))
        .unwrap_or_else(|| panic!("no log directory said: {}", f.stderr))
        .trim()
        .to_string();
    let log0 = std::fs::read_to_string(Path::new(&shown).join("rank0.log")).unwrap();
    assert!(log0.contains("out-0") && !log0.contains("err-0"), "{log0}");
    let _ = std::fs::remove_dir_all(&shown);

    // --local-ranks-filter 1: rank 0 off the console.
    let port = free_port().to_string();
    let f = braid_in(
        dir.path(),
        &[
            "launch",
            "--nproc-per-node",
            "2",
            "--master-port",
            &port,
            "--local_ranks_filter",
            "1",
            "sh",
            "-c",
            SAY,
        ],
    );
    assert_eq!(f.code, Some(0), "{f:?}");
    assert!(
        f.stdout.contains("out-1") && !f.stdout.contains("out-0"),
        "{f:?}"
    );
    assert!(!f.stderr.contains("err-0"), "{f:?}");

    // torchrun's --standalone by hand: an endpoint on port 0.
    let f = braid_in(
        dir.path(),
        &[
            "launch",
            "--rdzv_endpoint=localhost:0",
            "--nproc_per_node=2",
            "sh",
            "-c",
            SAY,
        ],
    );
    assert_eq!(f.code, Some(0), "{f:?}");
    assert!(f.stdout.contains("out-1"), "{f:?}");
    // A bad stream spec is refused, naming the flag.
    let f = braid_in(dir.path(), &["launch", "--tee", "7", "true"]);
    assert_eq!(f.code, Some(2), "{f:?}");
    assert!(f.stderr.contains("--tee \"7\""), "{}", f.stderr);
}

/// Point 11: Kubeflow's trainer passes torchrun's arguments as `PET_*`
/// variables; `braid launch` reads them as torchrun does, a flag beside
/// one wins, and the workers get torchrun's environment.
#[test]
fn launch_reads_torchruns_pet_variables() {
    let dir = TempDir::new("first2-pet");
    let keys = [
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "ROLE_RANK",
        "MASTER_ADDR",
        "TORCHELASTIC_RESTART_COUNT",
    ];
    let script = format!(
        "echo {} > seen.$RANK",
        keys.iter()
            .map(|k| format!("${k}"))
            .collect::<Vec<_>>()
            .join(" ")
    );
    let pet = |cmd: &mut Command| {
        cmd.current_dir(dir.path())
            .env("PET_NPROC_PER_NODE", "2")
            .env("PET_NNODES", "1")
            .env("PET_MASTER_ADDR", "127.0.0.1")
            .env("PET_MASTER_PORT", free_port().to_string());
    };
    let mut cmd = braid();
    pet(&mut cmd);
    cmd.args(["launch", "sh", "-c", &script]);
    let f = run(cmd, LIMIT);
    assert_eq!(f.code, Some(0), "{f:?}");
    assert!(f.stderr.contains("starts ranks 0..1 of 2"), "{}", f.stderr);
    for rank in 0..2 {
        let seen = std::fs::read_to_string(dir.path().join(format!("seen.{rank}"))).unwrap();
        let want = format!("{rank} {rank} 2 2 0 {rank} 127.0.0.1 0");
        assert_eq!(seen.trim(), want);
        std::fs::remove_file(dir.path().join(format!("seen.{rank}"))).unwrap();
    }
    // The flag wins over its variable.
    let mut cmd = braid();
    pet(&mut cmd);
    cmd.args(["launch", "--nproc-per-node", "1", "sh", "-c", &script]);
    let f = run(cmd, LIMIT);
    assert_eq!(f.code, Some(0), "{f:?}");
    assert!(f.stderr.contains("starts ranks 0..0 of 1"), "{}", f.stderr);
    assert!(!dir.path().join("seen.1").exists());
}
