//! What a PyTorch user meets in their first hour with braid, one test per
//! finding of that trial (issue 45): torchrun's habits in `braid launch`,
//! defaults that agree between `data write` and `train`, a device chosen
//! and said, help that reads, output that parsers and logs can take, and
//! errors that point the right way. The report's own consistency is in
//! `report_truth.rs`, `bench/results/`'s in `bench_results.rs`.

mod common;

use common::{braid, free_port, run, TempDir};
use std::path::Path;
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(120);

fn braid_in(dir: &Path, args: &[&str]) -> common::Finished {
    let mut cmd = braid();
    cmd.current_dir(dir).args(args);
    run(cmd, LIMIT)
}

fn have_python() -> bool {
    std::process::Command::new("python3")
        .arg("-c")
        .arg("pass")
        .status()
        .is_ok_and(|s| s.success())
}

/// Finding 1: `--nproc_per_node` and the other torchrun spellings are flags, not
/// the program; a `.py` program runs under python3 with torchrun's
/// variables; `--no-python`, `-m` and the worker-count words work.
#[test]
fn launch_takes_torchrun_habits() {
    let dir = TempDir::new("first-launch");
    let f = braid_in(
        dir.path(),
        &[
            "launch",
            "--nproc_per_node",
            "2",
            "--master_port",
            &free_port().to_string(),
            "--",
            "true",
        ],
    );
    assert_eq!(f.code, Some(0), "{f:?}");
    if !have_python() {
        eprintln!("skipped the .py part: no python3 here");
        return;
    }
    std::fs::write(
        dir.path().join("train.py"),
        "import os\n\
         keys = ['RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'LOCAL_WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT']\n\
         open('seen.%s' % os.environ['RANK'], 'w').write(' '.join(os.environ[k] for k in keys))\n",
    )
    .unwrap();
    let port = free_port().to_string();
    let f = braid_in(
        dir.path(),
        &[
            "launch",
            "--nproc_per_node",
            "2",
            "--master_port",
            &port,
            "train.py",
        ],
    );
    assert_eq!(f.code, Some(0), "{f:?}");
    for rank in 0..2 {
        let seen = std::fs::read_to_string(dir.path().join(format!("seen.{rank}"))).unwrap();
        let v: Vec<&str> = seen.split(' ').collect();
        assert_eq!(v[0], rank.to_string());
        assert_eq!(&v[2..5], ["2", "2", "127.0.0.1"], "{seen}");
    }
    // --no-python runs the file itself (not executable here: a clear error).
    let f = braid_in(
        dir.path(),
        &["launch", "--standalone", "--no-python", "./train.py"],
    );
    assert_ne!(f.code, Some(0));
    assert!(
        f.stderr.contains("could not start \"./train.py\""),
        "{}",
        f.stderr
    );
    // -m runs a module; cpu is a worker count.
    let f = braid_in(
        dir.path(),
        &[
            "launch",
            "--standalone",
            "--nproc-per-node",
            "cpu",
            "-m",
            "platform",
        ],
    );
    assert_eq!(f.code, Some(0), "{f:?}");
    // A program in this directory named without ./ is found for the user.
    let f = braid_in(
        dir.path(),
        &["launch", "--standalone", "--no-python", "train.py"],
    );
    assert!(f.stderr.contains("./train.py"), "{}", f.stderr);
    // One name for the worker count, old names kept: data write's
    // threads are --threads (as data load's), --workers still taken.
    let out = dir.path().join("t.beton");
    let out = out.to_str().unwrap();
    for flag in ["--threads", "--workers"] {
        let f = braid_in(
            dir.path(),
            &[
                "data",
                "write",
                out,
                "--tokens",
                "synthetic",
                "--seq",
                "64",
                flag,
                "1",
            ],
        );
        assert_eq!(f.code, Some(0), "{flag}: {f:?}");
    }
}

/// Finding 2: `data write` then `train --data` works with no other flag, from
/// the built-in corpus and from text (GPT-2 tokens into the tiny model),
/// and every command starts from one default seed.
#[test]
fn data_write_then_train_needs_no_other_flag() {
    let dir = TempDir::new("first-data");
    let text: String = (0..4000)
        .map(|i| format!("line {i}: the quick brown fox jumps over the lazy dog. "))
        .collect();
    std::fs::write(dir.path().join("notes.txt"), text).unwrap();
    for source in ["synthetic", "notes.txt"] {
        let f = braid_in(
            dir.path(),
            &["data", "write", "--tokens", source, "x.beton"],
        );
        assert_eq!(f.code, Some(0), "{source}: {f:?}");
        let f = braid_in(
            dir.path(),
            &[
                "train",
                "--data",
                "x.beton",
                "--steps",
                "2",
                "--eval-every",
                "0",
            ],
        );
        assert_eq!(f.code, Some(0), "{source}: {f:?}");
        assert!(f.stdout.contains("done: final loss"), "{}", f.stdout);
    }
    let f = braid_in(dir.path(), &["train", "--data", "x.beton", "--steps", "1"]);
    assert!(
        f.stdout.contains("vocabulary 50257 from the data"),
        "{}",
        f.stdout
    );
    for cmd in [
        &["train", "--help"][..],
        &["data", "write", "--help"],
        &["data", "load", "--help"],
        &["generate", "--help"],
    ] {
        let f = braid_in(dir.path(), cmd);
        let seed = f
            .stdout
            .split("--seed <SEED>")
            .nth(1)
            .unwrap_or_else(|| panic!("{cmd:?}: no --seed"));
        let default = seed.split("[default: ").nth(1).unwrap_or_default();
        assert!(default.starts_with("1337]"), "{cmd:?}: {seed}");
    }
}

/// Finding 3: `--device auto` is the default and says what it chose (no GPU on
/// this machine: the CPU, said so).
#[test]
fn the_device_is_chosen_and_said() {
    let dir = TempDir::new("first-device");
    let f = braid_in(dir.path(), &["train", "--steps", "1", "--eval-every", "0"]);
    assert_eq!(f.code, Some(0), "{f:?}");
    let gpus = common::gpus(1).is_some();
    let want = if gpus {
        "device: cuda (--device auto"
    } else {
        "device: cpu (--device auto"
    };
    assert!(f.stdout.contains(want), "{}", f.stdout);
}

/// Finding 4: `train -h` fits a screen, `--help` puts every option under a
/// heading, names every model, and `--json` reads the same everywhere.
#[test]
fn help_reads() {
    let dir = TempDir::new("first-help");
    let short = braid_in(dir.path(), &["train", "-h"]).stdout;
    assert!(
        short.lines().count() <= 40,
        "{} lines:\n{short}",
        short.lines().count()
    );
    let long = braid_in(dir.path(), &["train", "--help"]).stdout;
    assert!(long.lines().all(|l| l.len() <= 100), "{long}");
    for model in ["gpt2", "gpt2-xl", "124M", "1558M", "tiny"] {
        assert!(long.contains(model), "--help does not name {model}");
    }
    // Every option but --help sits under a heading of its own.
    let mut heading = "";
    for line in long.lines() {
        if !line.starts_with(' ') && line.ends_with(':') {
            heading = line;
        }
        let t = line.trim_start();
        if t.starts_with("--") && !t.starts_with("--help") && line.starts_with("      --") {
            assert!(
                !heading.is_empty() && heading != "Options:",
                "{t} is not under a heading"
            );
        }
    }
    let flags = long.matches("\n      --").count();
    assert!(flags >= 40, "only {flags} options listed");
    // --json takes an optional FILE in every command that has it.
    for cmd in [
        &["train", "--help"][..],
        &["bench", "--help"],
        &["topo", "--help"],
        &["report", "--help"],
        &["doctor", "--help"],
        &["ckpt", "inspect", "--help"],
        &["data", "inspect", "--help"],
        &["data", "load", "--help"],
    ] {
        let help = braid_in(dir.path(), cmd).stdout;
        assert!(help.contains("--json [<FILE>]"), "{cmd:?}:\n{help}");
    }
}

/// Finding 5: Output parsers and logs can take: no carriage returns in a piped
/// `data write`, nccl-tests' table without `[rank 0]` and with its
/// footer, and a size sweep that cannot run is refused.
#[test]
fn output_is_plain_where_it_is_read_by_programs() {
    let dir = TempDir::new("first-output");
    let f = braid_in(
        dir.path(),
        &[
            "data",
            "write",
            "--tokens",
            "synthetic",
            "--seq",
            "64",
            "x.beton",
        ],
    );
    assert_eq!(f.code, Some(0), "{f:?}");
    assert!(!f.stderr.contains('\r'), "{:?}", f.stderr);
    let f = braid_in(
        dir.path(),
        &[
            "bench",
            "all_reduce",
            "--nproc-per-node",
            "2",
            "-b",
            "8",
            "-e",
            "1K",
            "--check",
        ],
    );
    assert_eq!(f.code, Some(0), "{f:?}");
    assert!(!f.stdout.contains("[rank"), "{}", f.stdout);
    assert!(
        f.stdout.contains("# Avg bus bandwidth    : "),
        "{}",
        f.stdout
    );
    assert!(
        f.stdout.contains("# Out of bounds values : 0 OK"),
        "{}",
        f.stdout
    );
    let rows: Vec<&str> = f.stdout.lines().filter(|l| !l.starts_with('#')).collect();
    assert_eq!(rows.len(), 8, "{}", f.stdout);
    assert!(
        rows.iter().all(|r| r.split_whitespace().count() == 13),
        "{rows:?}"
    );
    let f = braid_in(dir.path(), &["bench", "all_reduce", "-b", "1G", "-e", "8"]);
    assert_ne!(f.code, Some(0));
    assert!(f.stderr.contains("larger than -e"), "{}", f.stderr);
    // --symmetric: NCCL's windows, for all_gather on GPUs only.
    for (args, want) in [
        (&["all_gather", "--symmetric"][..], "needs --device cuda"),
        (
            &["all_reduce", "--device", "cuda", "--symmetric"][..],
            "has no all_gather",
        ),
    ] {
        let f = braid_in(dir.path(), &[&["bench"][..], args].concat());
        assert_ne!(f.code, Some(0), "{args:?}");
        assert!(f.stderr.contains(want), "{args:?}: {}", f.stderr);
    }
    // JSON on stdout alone, the table moved to stderr.
    let f = braid_in(
        dir.path(),
        &[
            "bench",
            "all_reduce",
            "--nproc-per-node",
            "2",
            "-e",
            "64",
            "--json",
        ],
    );
    assert_eq!(f.code, Some(0), "{f:?}");
    let rows: serde_json::Value = serde_json::from_str(&f.stdout).expect("JSON alone on stdout");
    assert_eq!(rows.as_array().map(|r| r.len()), Some(4), "{}", f.stdout);
}

/// Finding 6: Errors that point the right way.
#[test]
fn errors_point_the_right_way() {
    let dir = TempDir::new("first-errors");
    let port = free_port();
    let _busy = std::net::TcpListener::bind(("127.0.0.1", port)).unwrap();
    let addr = format!("127.0.0.1:{port}");
    let f = braid_in(dir.path(), &["store", "serve", "--addr", &addr]);
    assert_ne!(f.code, Some(0));
    assert!(f.stderr.contains("--addr"), "{}", f.stderr);
    assert!(!f.stderr.contains("--master-port"), "{}", f.stderr);

    std::fs::write(
        dir.path().join("notes.safetensors"),
        "some notes, not a model\n",
    )
    .unwrap();
    let f = braid_in(dir.path(), &["train", "--load", "notes.safetensors"]);
    assert!(f.stderr.contains("not a safetensors file"), "{}", f.stderr);
    assert!(!f.stderr.contains("HeaderTooLarge"), "{}", f.stderr);

    let f = braid_in(dir.path(), &["train", "--model", "125M"]);
    assert!(f.stderr.contains("did you mean 124M?"), "{}", f.stderr);

    let f = braid_in(dir.path(), &["train", "--resume", "auto", "--steps", "1"]);
    assert_ne!(f.code, Some(0));
    assert!(f.stderr.contains("--ckpt-dir"), "{}", f.stderr);
    assert!(
        !f.stdout.contains("braid train: model"),
        "banner first:\n{}",
        f.stdout
    );

    let f = braid_in(dir.path(), &["data", "--help"]);
    assert!(f.stdout.contains("JPEG support: "), "{}", f.stdout);
}
