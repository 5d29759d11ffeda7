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

/// Whether this machine has no usable GPU (the no-GPU messages are only
/// checked there).
fn no_gpu() -> bool {
    common::gpus(1).is_none()
}

/// Point 3: errors name the real cause, the most basic first — the layers
/// a pipeline's stages need before the micro-batches, the launcher for a
/// launcher's flag, `--device cpu` where there is no GPU, a custom model
/// whose context follows `--seq`.
#[test]
fn errors_name_the_real_cause_first() {
    let dir = TempDir::new("first2-errors");
    let f = braid_in(dir.path(), &["train", "--pp", "3", "--steps", "1"]);
    assert_eq!(f.code, Some(2), "{f:?}");
    assert!(
        f.stderr
            .contains("3 pipeline stages for a model of 2 layers")
            && f.stderr.contains("--model L4-H4-C64"),
        "{}",
        f.stderr
    );
    assert!(!f.stderr.contains("--micro-batches"), "{}", f.stderr);

    let f = braid_in(dir.path(), &["train", "--nnodes", "2"]);
    assert_eq!(f.code, Some(2), "{f:?}");
    assert!(f.stderr.contains("braid launch --nnodes"), "{}", f.stderr);
    assert!(!f.stderr.contains("--no-sp"), "{}", f.stderr);

    let f = braid_in(dir.path(), &["train", "--nproc-per-node", "100000"]);
    assert_eq!(f.code, Some(2), "{f:?}");
    assert!(
        f.stderr.contains("braid launch --force-nproc"),
        "{}",
        f.stderr
    );
    assert!(!f.stderr.contains("starts ranks"), "{}", f.stderr);

    if no_gpu() {
        for args in [
            &["train", "--device", "cuda", "--steps", "1"][..],
            &[
                "train",
                "--device",
                "cuda",
                "--nproc-per-node",
                "2",
                "--steps",
                "1",
            ][..],
            &["bench", "all_reduce", "--device", "cuda"][..],
        ] {
            let f = braid_in(dir.path(), args);
            assert_ne!(f.code, Some(0), "{args:?}: {f:?}");
            assert!(
                f.stderr.contains("no GPU to use here") && f.stderr.contains("--device cpu"),
                "{args:?}: {}",
                f.stderr
            );
            assert!(!f.stderr.contains("shm, tcp"), "{}", f.stderr);
            assert!(
                !f.stderr.contains("[rank"),
                "said by a worker: {}",
                f.stderr
            );
        }
    }

    // A custom model without -T takes its context from --seq (and says so);
    // a named model's context is its own, and the error says what to do.
    let f = braid_in(
        dir.path(),
        &[
            "train",
            "--model",
            "L2-H2-C32",
            "--seq",
            "512",
            "--batch",
            "1",
            "--steps",
            "1",
            "--eval-every",
            "0",
            "--device",
            "cpu",
        ],
    );
    assert_eq!(f.code, Some(0), "{f:?}");
    assert!(f.stdout.contains("context 512 from --seq"), "{}", f.stdout);
    let f = braid_in(dir.path(), &["train", "--seq", "128", "--device", "cpu"]);
    assert_eq!(f.code, Some(2), "{f:?}");
    assert!(
        f.stderr.contains("exceeds the model's context 64") && f.stderr.contains("--seq 64"),
        "{}",
        f.stderr
    );
}

/// Point 4: a pipeline's flags without `--pp` are refused, not ignored.
#[test]
fn pipeline_flags_need_a_pipeline() {
    let dir = TempDir::new("first2-pipe-flags");
    for (args, flag) in [
        (&["train", "--schedule", "zb"][..], "--schedule zb"),
        (&["train", "--micro-batches", "0"][..], "--micro-batches 0"),
        (
            &["train", "--stage-layers", "1,1"][..],
            "--stage-layers 1,1",
        ),
    ] {
        let f = braid_in(dir.path(), args);
        assert_eq!(f.code, Some(2), "{args:?}: {f:?}");
        assert!(
            f.stderr.contains(flag) && f.stderr.contains("add --pp N"),
            "{args:?}: {}",
            f.stderr
        );
        assert!(
            !f.stdout.contains("step "),
            "{args:?} trained: {}",
            f.stdout
        );
    }
}

/// The number before `pat` in `text` (`14745 training windows`).
fn count_before(text: &str, pat: &str) -> usize {
    let at = text
        .find(pat)
        .unwrap_or_else(|| panic!("no {pat:?} in:\n{text}"));
    text[..at]
        .split(|c: char| !c.is_ascii_digit())
        .rfind(|w| !w.is_empty())
        .and_then(|w| w.parse().ok())
        .unwrap_or_else(|| panic!("no number before {pat:?} in:\n{text}"))
}

/// Point 5: `data write` with its defaults, then `train --data` with its
/// defaults, trains on the whole corpus (the shorter sequences cut from
/// every stored window), and says how.
#[test]
fn a_beton_written_with_defaults_trains_on_the_whole_corpus() {
    let dir = TempDir::new("first2-beton");
    let f = braid_in(
        dir.path(),
        &["data", "write", "--tokens", "synthetic", "X.beton"],
    );
    assert_eq!(f.code, Some(0), "{f:?}");
    let common = [
        "train",
        "--steps",
        "1",
        "--eval-every",
        "0",
        "--device",
        "cpu",
    ];
    let f = braid_in(
        dir.path(),
        &[&common[..], &["--data", "synthetic"]].concat(),
    );
    assert_eq!(f.code, Some(0), "{f:?}");
    let flat = count_before(&f.stdout, " training windows of 64 tokens");
    let f = braid_in(dir.path(), &[&common[..], &["--data", "X.beton"]].concat());
    assert_eq!(f.code, Some(0), "{f:?}");
    let beton = count_before(&f.stdout, " training and ");
    assert!(
        beton * 100 >= flat * 99 && beton <= flat,
        "the .beton gives {beton} windows, the flat corpus {flat}: {}",
        f.stdout
    );
    assert!(
        f.stdout
            .contains("16 cut from each of the file's windows of 1024"),
        "{}",
        f.stdout
    );
}

/// `braid train | head`: a reader that stops reading ends braid quietly
/// (141, as SIGPIPE), not with a panic's backtrace.
#[test]
fn a_closed_stdout_ends_braid_quietly() {
    use std::io::{BufRead, BufReader};
    use std::process::Stdio;
    let mut child = braid()
        .args([
            "train",
            "--steps",
            "400",
            "--log-every",
            "1",
            "--device",
            "cpu",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut first = String::new();
    out.read_line(&mut first).unwrap();
    drop(out);
    let f = common::Running::adopt(child).finish(LIMIT);
    assert_eq!(f.code, Some(141), "{f:?}");
    assert!(!f.stderr.contains("panicked"), "{}", f.stderr);
}

/// Point 7: `--resume` takes the checkpoint's model (saying so) unless
/// `--model` names another, which is refused naming the checkpoint's; a
/// change of transport is not said to change the run.
#[test]
fn resume_takes_the_checkpoints_model() {
    let dir = TempDir::new("first2-resume");
    let base = [
        "train",
        "--steps",
        "4",
        "--eval-every",
        "0",
        "--device",
        "cpu",
    ];
    let f = braid_in(
        dir.path(),
        &[&base[..], &["--model", "L4-H4-C64", "--ckpt-dir", "ck4"]].concat(),
    );
    assert_eq!(f.code, Some(0), "{f:?}");
    let f = braid_in(
        dir.path(),
        &[
            "train",
            "--resume",
            "ck4",
            "--steps",
            "6",
            "--eval-every",
            "0",
            "--device",
            "cpu",
        ],
    );
    assert_eq!(f.code, Some(0), "{f:?}");
    assert!(
        f.stdout.contains("model L4-H4-C64 from the checkpoint")
            && f.stdout.contains("model L4-H4-C64 (4 layers"),
        "{}",
        f.stdout
    );
    assert!(!f.stdout.contains("config was"), "{}", f.stdout);
    let f = braid_in(
        dir.path(),
        &[
            "train", "--resume", "ck4", "--model", "tiny", "--device", "cpu",
        ],
    );
    assert_eq!(f.code, Some(2), "{f:?}");
    assert!(
        f.stderr.contains("--model L4-H4-C64") && f.stderr.contains("leave --model out"),
        "{}",
        f.stderr
    );
    assert!(
        !f.stdout.contains("note:"),
        "notes before the error: {}",
        f.stdout
    );

    // Two ranks over shared memory, resumed by one process: no note that
    // the transport changed the run.
    let f = braid_in(
        dir.path(),
        &[&base[..], &["--nproc-per-node", "2", "--ckpt-dir", "ck2"]].concat(),
    );
    assert_eq!(f.code, Some(0), "{f:?}");
    let f = braid_in(
        dir.path(),
        &[
            "train",
            "--resume",
            "ck2",
            "--steps",
            "5",
            "--eval-every",
            "0",
            "--device",
            "cpu",
        ],
    );
    assert_eq!(f.code, Some(0), "{f:?}");
    assert!(!f.stdout.contains("backend was"), "{}", f.stdout);
}

/// The longest line braid's training output may print (the issue found
/// summary lines of 260-330 characters).
const LONGEST: usize = 200;

fn no_long_lines(out: &str) {
    for l in out.lines() {
        let l = l.trim_start_matches("[rank 0] ");
        assert!(
            l.chars().count() <= LONGEST,
            "a line of {} characters: {l}",
            l.chars().count()
        );
    }
}

/// Point 8, pipelines: the strategy is named by the layout, not "one
/// process" (the run and `ckpt inspect`); 1F1B's first stage holds N
/// micro-batches' activations with evaluation in the run; the 3-D
/// timeline's rows are the pipe group's world ranks; no line is
/// hundreds of characters long.
#[test]
fn pipeline_output_says_what_is_true() {
    let dir = TempDir::new("first2-pp-output");
    let f = braid_in(
        dir.path(),
        &[
            "train",
            "--pp",
            "2",
            "--micro-batches",
            "8",
            "--steps",
            "4",
            "--eval-every",
            "2",
            "--device",
            "cpu",
            "--ckpt-dir",
            "ck",
        ],
    );
    assert_eq!(f.code, Some(0), "{f:?}");
    assert!(
        f.stdout
            .contains("strategy: pipeline 2 (1f1b, 8 micro-batches)"),
        "{}",
        f.stdout
    );
    assert!(!f.stdout.contains("one process"), "{}", f.stdout);
    assert!(
        f.stdout.contains("held at once, at most: stage 0: 2"),
        "{}",
        f.stdout
    );
    no_long_lines(&f.stdout);
    let f = braid_in(dir.path(), &["ckpt", "inspect", "ck"]);
    assert_eq!(f.code, Some(0), "{f:?}");
    assert!(f.stdout.contains("under pipeline 2"), "{}", f.stdout);

    let f = braid_in(
        dir.path(),
        &[
            "train",
            "--nproc-per-node",
            "4",
            "--tp",
            "2",
            "--pp",
            "2",
            "--global-batch",
            "8",
            "--model",
            "L4-H4-C64",
            "--steps",
            "2",
            "--eval-every",
            "0",
            "--device",
            "cpu",
        ],
    );
    assert_eq!(f.code, Some(0), "{f:?}");
    assert!(f.stdout.contains("pipe groups [0 2] [1 3]"), "{}", f.stdout);
    for row in ["  rank  0 |", "  rank  2 |"] {
        assert!(f.stdout.contains(row), "no row {row:?}: {}", f.stdout);
    }
    assert!(!f.stdout.contains("  rank  1 |"), "{}", f.stdout);
    no_long_lines(&f.stdout);
}

/// Point 8, the rest: the ETA after a resume counts only this run's
/// steps; counts in words; `braid bench` checks by default, as
/// nccl-tests, and its first row is warm; `braid doctor` reads the
/// directory the launcher announced for a failed Python job.
#[test]
fn progress_bench_and_doctor_say_what_is_true() {
    let dir = TempDir::new("first2-output");
    let base = [
        "train",
        "--eval-every",
        "0",
        "--device",
        "cpu",
        "--log-every",
        "1",
    ];
    let f = braid_in(
        dir.path(),
        &[&base[..], &["--steps", "6", "--ckpt-dir", "ck"]].concat(),
    );
    assert_eq!(f.code, Some(0), "{f:?}");
    assert!(
        f.stdout.contains("over 1 step (first 5 not counted)"),
        "{}",
        f.stdout
    );
    assert!(f.stdout.contains(", 6 steps,"), "{}", f.stdout);
    // Resumed at step 6 of 10, each step slowed to a second: after its
    // first step the ETA is about 3 x 1 s, not the 0.5 s a count from
    // step 0 would give.
    let mut cmd = braid();
    cmd.current_dir(dir.path())
        .args(base)
        .args(["--steps", "10", "--resume", "ck"])
        .env("BRAID_TEST_DELAY", "0:compute:1000");
    let f = run(cmd, LIMIT);
    assert_eq!(f.code, Some(0), "{f:?}");
    let first = f
        .stdout
        .lines()
        .find(|l| l.starts_with("step     7/10"))
        .unwrap_or_else(|| panic!("no step 7: {}", f.stdout));
    let eta: u64 = first
        .rsplit("eta 0:")
        .next()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or_else(|| panic!("{first}"));
    assert!((2..=5).contains(&eta), "{first}");

    // nccl-tests checks every result by default: so does braid bench.
    let f = braid_in(
        dir.path(),
        &["bench", "all_reduce", "--np", "2", "-e", "1K"],
    );
    assert_eq!(f.code, Some(0), "{f:?}");
    assert!(
        f.stdout.contains("# Out of bounds values : 0 OK"),
        "{}",
        f.stdout
    );
    // Every size is warmed up before it is timed (the first row was
    // 200-575 us against 0.34 us for the next ones). Timing it here would
    // make a test that a busy machine fails: the header says the warm-up
    // ran, and the rows are there.
    assert!(f.stdout.contains(", warmup 5,"), "{}", f.stdout);
    let rows = f.stdout.lines().filter(|l| !l.starts_with('#')).count();
    assert!(rows >= 4, "{}", f.stdout);
    let f = braid_in(
        dir.path(),
        &["bench", "all_reduce", "--np", "2", "-e", "64", "-c", "0"],
    );
    assert_eq!(f.code, Some(0), "{f:?}");
    assert!(f.stdout.contains("N/A (not checked: -c 0)"), "{}", f.stdout);

    // A failed job whose workers keep no flight records: the directory
    // the launcher announced is there, and doctor says why it is empty.
    let f = braid_in(
        dir.path(),
        &["launch", "--nproc-per-node", "2", "sh", "-c", "exit 3"],
    );
    assert_eq!(f.code, Some(3), "{f:?}");
    let logs = f
        .stderr
        .lines()
        .find_map(|l| l.split("flight records to ").nth(1))
        .unwrap_or_else(|| panic!("{}", f.stderr))
        .trim()
        .to_string();
    let d = braid_in(dir.path(), &["doctor", &logs]);
    assert!(!d.stderr.contains("cannot read"), "{}", d.stderr);
    assert!(
        d.stdout.contains("rank 0") || d.stderr.contains("keep none"),
        "{d:?}"
    );
    let _ = std::fs::remove_dir_all(&logs);
}
