//! Wrong but plausible input to every subcommand, as a new user types it
//! (issue 63: "look for more of the same kind while there"): each is
//! refused at once with an error that names the input and what to do —
//! not a panic, a hang, a raw OS error, a flag silently ignored, nor an
//! error found only after the work it spoils.

mod common;

use common::{braid, free_port, run, Finished, TempDir};
use std::path::Path;
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(60);

/// `braid ARGS` in `dir`.
fn braid_in(dir: &Path, args: &[&str]) -> Finished {
    let mut cmd = braid();
    cmd.current_dir(dir).args(args);
    run(cmd, LIMIT)
}

/// Asserts that `f` was refused (exit 2) with every phrase of `want` in
/// its stderr and none of `not` in its output.
#[track_caller]
fn refused(f: &Finished, want: &[&str], not: &[&str]) {
    assert_eq!(f.code, Some(2), "{f:?}");
    for w in want {
        assert!(f.stderr.contains(w), "wanted {w:?} in:\n{}", f.stderr);
    }
    for n in not {
        assert!(
            !f.stderr.contains(n) && !f.stdout.contains(n),
            "did not want {n:?} in:\n{}\n{}",
            f.stdout,
            f.stderr
        );
    }
}

/// The launcher's report of a failed worker: what a check made in the
/// worker instead of before it says.
const LAUNCHER_NOISE: &str = "flight records of attempt";

#[test]
fn bench_refuses_a_sweep_it_cannot_run_before_starting_ranks() {
    let dir = TempDir::new("wrong-bench");
    let d = dir.path();
    // No timed iteration: the table would read "inf".
    let f = braid_in(d, &["bench", "all_reduce", "-n", "0", "-e", "64"]);
    refused(&f, &["-n 0", "at least 1"], &["inf"]);
    // Buffers larger than any host's memory: refused, not an aborted
    // allocation with a backtrace.
    let f = braid_in(d, &["bench", "all_reduce", "-b", "16384G", "-e", "16384G"]);
    refused(
        &f,
        &["-e ", "GiB of memory is available", "lower -e"],
        &["memory allocation", LAUNCHER_NOISE],
    );
    // A size past the address space is not wrapped round to a small one.
    let f = braid_in(d, &["bench", "all_reduce", "-e", "99999999999G"]);
    refused(&f, &["99999999999G", "too large"], &[]);
    // A root outside the world: said by the command, not by a failed rank.
    let f = braid_in(d, &["bench", "all_reduce", "-r", "5", "-e", "64"]);
    refused(&f, &["--root 5", "world size 1"], &[LAUNCHER_NOISE]);
    // A JSON file that cannot be written: refused before the sweep.
    let f = braid_in(d, &["bench", "all_reduce", "-e", "64", "--json", "."]);
    refused(&f, &["--json .", "is a directory"], &["Avg bus bandwidth"]);
    let f = braid_in(
        d,
        &["bench", "all_reduce", "-e", "64", "--json", "no/x.json"],
    );
    refused(
        &f,
        &["--json no/x.json", "does not exist"],
        &["Avg bus bandwidth"],
    );
    // --algo is the tcp backend's: refused with shm, noted where auto
    // chose shm.
    let f = braid_in(
        d,
        &["bench", "all_reduce", "--backend", "shm", "--algo", "tree"],
    );
    refused(
        &f,
        &["--algo tree with --backend shm", "--backend tcp"],
        &[],
    );
    let f = braid_in(
        d,
        &[
            "bench",
            "all_reduce",
            "--algo",
            "tree",
            "-e",
            "64",
            "-n",
            "2",
            "-w",
            "0",
        ],
    );
    assert_eq!(f.code, Some(0), "{f:?}");
    assert!(f.stderr.contains("--algo tree is not used"), "{}", f.stderr);
    // A trace directory that is a file.
    std::fs::write(d.join("afile"), "x").unwrap();
    let f = braid_in(d, &["bench", "all_reduce", "--trace", "afile", "-e", "64"]);
    refused(&f, &["--trace afile", "a file"], &[LAUNCHER_NOISE]);
}

#[test]
fn store_bench_and_serve_refuse_bad_counts_and_addresses_at_once() {
    let dir = TempDir::new("wrong-store");
    let d = dir.path();
    for flag in ["--clients", "--ops"] {
        let f = braid_in(d, &["store", "bench", flag, "0"]);
        refused(&f, &[&format!("{flag} 0"), "at least 1"], &["ops/s"]);
    }
    let f = braid_in(d, &["store", "bench", "--clients", "100000"]);
    refused(&f, &["--clients 100000", "at most"], &["panicked"]);
    // No store at the address: said in seconds, not after a silent minute.
    let addr = format!("127.0.0.1:{}", free_port());
    let f = braid_in(d, &["store", "bench", "--addr", &addr, "--ops", "10"]);
    refused(
        &f,
        &[
            &format!("--addr {addr}: no store answers there"),
            "braid store serve",
        ],
        &[],
    );
    assert!(f.elapsed < Duration::from_secs(20), "{:?}", f.elapsed);
    let f = braid_in(d, &["store", "bench", "--addr", "127.0.0.1", "--ops", "10"]);
    refused(&f, &["--addr 127.0.0.1: expected HOST:PORT"], &[]);
    assert!(f.elapsed < Duration::from_secs(20), "{:?}", f.elapsed);
    let f = braid_in(d, &["store", "serve", "--addr", ":29999"]);
    refused(&f, &["--addr :29999: no host", "0.0.0.0:29999"], &[]);
    let f = braid_in(d, &["store", "serve", "--addr", "127.0.0.1"]);
    refused(&f, &["expected HOST:PORT"], &["invalid socket address"]);
}

#[test]
fn train_refuses_bad_numbers_and_paths_before_it_trains() {
    let dir = TempDir::new("wrong-train");
    let d = dir.path();
    let train = |args: &[&str]| {
        let mut all = vec!["train", "--eval-every", "0"];
        all.extend_from_slice(args);
        braid_in(d, &all)
    };
    // Numbers that would train the model away from the data, or into NaN.
    for (flag, value) in [
        ("--lr", "-1"),
        ("--lr", "nan"),
        ("--weight-decay", "-0.1"),
        ("--grad-clip", "-1"),
    ] {
        let f = train(&[&format!("{flag}={value}"), "--steps", "2"]);
        refused(&f, &[flag, "expected a finite number >= 0"], &["step "]);
    }
    // The flag that is zero is the one named.
    let f = train(&["--steps", "0"]);
    refused(&f, &["--steps 0"], &["--batch 0"]);
    let f = train(&["--global-batch", "0"]);
    refused(&f, &["--global-batch 0"], &["multiple of"]);
    let f = train(&["--lr-steps", "0"]);
    refused(&f, &["--lr-steps 0"], &["step "]);
    // --save-dtype: checked before training, not after it (the model lost),
    // and not ignored without --save.
    let f = train(&[
        "--steps",
        "2",
        "--save",
        "m.safetensors",
        "--save-dtype",
        "f16",
    ]);
    refused(&f, &["--save-dtype \"f16\"", "f32 or bf16"], &["step "]);
    let f = train(&["--steps", "2", "--save-dtype", "bf16"]);
    refused(&f, &["--save-dtype bf16", "add --save FILE"], &["step "]);
    // A --seq past the context is the cause, not the memory it would take.
    let f = train(&["--seq", "100000"]);
    refused(&f, &["exceeds the model's context 64"], &["host memory"]);
    // Paths of the wrong kind, named before the run's banner.
    std::fs::create_dir(d.join("adir")).unwrap();
    std::fs::write(d.join("afile"), "x").unwrap();
    let f = train(&["--load", "adir"]);
    refused(
        &f,
        &["--load adir: a directory", "--resume adir"],
        &["os error"],
    );
    let f = train(&["--load", "nothing.safetensors"]);
    refused(&f, &["--load nothing.safetensors: no such file"], &[]);
    for flag in ["--trace", "--ckpt-dir"] {
        let f = train(&[flag, "afile", "--steps", "1"]);
        refused(
            &f,
            &[&format!("{flag} afile"), "a file is there"],
            &["braid train: model"],
        );
    }
    let f = train(&["--keep", "3", "--steps", "1"]);
    refused(&f, &["--keep need --ckpt-dir"], &["braid train: model"]);
    // Text too short to train on: the file is named.
    std::fs::write(d.join("empty.txt"), "").unwrap();
    let f = train(&["--data", "empty.txt"]);
    refused(&f, &["empty.txt: only 0 tokens"], &[]);
}

#[test]
fn ckpt_consolidate_checks_its_output_before_reading_and_spares_the_checkpoint() {
    let dir = TempDir::new("wrong-ckpt");
    let d = dir.path();
    let f = braid_in(
        d,
        &[
            "train",
            "--steps",
            "1",
            "--eval-every",
            "0",
            "--ckpt-dir",
            "ck",
        ],
    );
    assert_eq!(f.code, Some(0), "{f:?}");
    let step = std::fs::read_dir(d.join("ck"))
        .unwrap()
        .flatten()
        .find(|e| e.file_name().to_string_lossy().starts_with("step-"))
        .unwrap()
        .path();
    let manifest = step.join("braid-checkpoint.json");
    let before = std::fs::read(&manifest).unwrap();
    // Onto the checkpoint's own files: refused, the checkpoint intact.
    for out in [manifest.clone(), d.join("ck/latest")] {
        let o = out.to_str().unwrap();
        let f = braid_in(d, &["ckpt", "consolidate", "ck", "-o", o]);
        refused(
            &f,
            &["--output", "would replace the checkpoint's own files"],
            &[],
        );
    }
    assert_eq!(std::fs::read(&manifest).unwrap(), before);
    let f = braid_in(d, &["ckpt", "inspect", "ck", "--verify"]);
    assert_eq!(f.code, Some(0), "{f:?}");
    // Outputs that cannot be written, and a type a checkpoint does not
    // store: refused before the model is read.
    for (args, want) in [
        (
            &["-o", "no/x.safetensors"][..],
            "--output no/x.safetensors: the directory no does not exist",
        ),
        (&["-o", "ck"][..], "--output ck: is a directory"),
        (
            &["-o", "x.safetensors", "--dtype", "f16"][..],
            "--dtype \"f16\": expected f32 or bf16",
        ),
    ] {
        let mut all = vec!["ckpt", "consolidate", "ck"];
        all.extend_from_slice(args);
        let f = braid_in(d, &all);
        refused(&f, &[want], &["consolidating", ".tmp", "os error"]);
    }
    let f = braid_in(d, &["ckpt", "inspect", "ck", "--json", "ck"]);
    refused(&f, &["--json ck: is a directory"], &["os error"]);
}

/// A JPEG of `w` x `h` pixels.
fn jpeg(w: usize, h: usize) -> Vec<u8> {
    let rgb: Vec<u8> = (0..w * h * 3).map(|k| (k * 7 % 251) as u8).collect();
    braid_data::jpeg::encode(&rgb, w as u32, h as u32, 90).unwrap()
}

#[test]
fn data_commands_check_their_flags_and_outputs_first() {
    let dir = TempDir::new("wrong-data");
    let d = dir.path();
    // Text that is not ASCII, cut for the sample listing: no panic.
    let line = format!("{{\"data\": \"a{}\"}}\n", "é".repeat(100));
    std::fs::write(d.join("u.jsonl"), line.repeat(3)).unwrap();
    let f = braid_in(d, &["data", "write", "u.beton", "--jsonl", "u.jsonl"]);
    assert_eq!(f.code, Some(0), "{f:?}");
    let f = braid_in(d, &["data", "inspect", "u.beton"]);
    assert_eq!(f.code, Some(0), "{f:?}");
    assert!(f.stdout.contains("... (101 chars)"), "{}", f.stdout);
    // Outputs named wrongly: refused before anything is read.
    std::fs::create_dir(d.join("adir")).unwrap();
    std::fs::write(d.join("afile"), "x").unwrap();
    let write = |out: &str, more: &[&str]| {
        let mut all = vec!["data", "write", out, "--tokens", "synthetic"];
        all.extend_from_slice(more);
        braid_in(d, &all)
    };
    let f = write("no/o.beton", &["--seq", "8"]);
    refused(
        &f,
        &["no/o.beton: the directory no does not exist"],
        &["reading tokens", ".tmp"],
    );
    let f = write("adir", &["--seq", "8"]);
    refused(&f, &["adir: is a directory"], &["reading tokens", ".tmp"]);
    // A window of no tokens, and another input's flags.
    let f = write("o.beton", &["--seq", "0"]);
    refused(&f, &["--seq 0"], &["more data"]);
    let f = write("o.beton", &["--max-resolution", "64"]);
    refused(&f, &["--max-resolution is for --images", "--tokens"], &[]);
    let f = braid_in(
        d,
        &[
            "data", "write", "o.beton", "--jsonl", "u.jsonl", "--seq", "64",
        ],
    );
    refused(&f, &["--seq is for --tokens"], &[]);
    let f = braid_in(d, &["data", "inspect", "adir"]);
    refused(&f, &["adir: a directory, not a .beton file"], &["os error"]);

    // An image file for the loader.
    for class in ["cat", "dog"] {
        let c = d.join("imgs").join(class);
        std::fs::create_dir_all(&c).unwrap();
        std::fs::write(c.join("0.jpg"), jpeg(40, 30)).unwrap();
        std::fs::write(c.join("1.jpg"), jpeg(30, 40)).unwrap();
    }
    let f = braid_in(d, &["data", "write", "img.beton", "--images", "imgs"]);
    assert_eq!(f.code, Some(0), "{f:?}");
    let load = |more: &[&str]| {
        let mut all = vec!["data", "load", "img.beton", "--res", "8", "--threads", "1"];
        all.extend_from_slice(more);
        braid_in(d, &all)
    };
    for (flag, want) in [
        ("--epochs", "--epochs 0"),
        ("--batch", "--batch 0"),
        ("--ranks", "--ranks 0"),
    ] {
        let f = load(&[flag, "0"]);
        refused(&f, &[want], &["images/s"]);
    }
    let f = load(&["--cache-pages", "4"]);
    refused(&f, &["--cache-pages", "--cache process"], &["images/s"]);
    let f = load(&["--record", "afile"]);
    refused(&f, &["--record afile: a file"], &["images/s"]);
    let f = load(&["--json", "adir"]);
    refused(&f, &["--json adir: is a directory"], &["images/s"]);
    let f = braid_in(d, &["data", "load", "adir"]);
    refused(&f, &["adir: a directory, not a .beton file"], &["os error"]);
}

#[test]
fn report_and_doctor_name_a_file_given_for_their_directory_and_check_outputs_first() {
    let dir = TempDir::new("wrong-report");
    let d = dir.path();
    std::fs::create_dir(d.join("empty")).unwrap();
    std::fs::write(d.join("trace-rank00000.json"), "{}").unwrap();
    std::fs::write(d.join("flight-rank00000.json"), "{}").unwrap();
    let f = braid_in(d, &["report", "trace-rank00000.json"]);
    refused(
        &f,
        &[
            "a file; braid report reads a trace directory",
            "try `braid report",
        ],
        &["os error"],
    );
    let f = braid_in(d, &["doctor", "flight-rank00000.json"]);
    refused(
        &f,
        &[
            "a file; braid doctor reads a log directory",
            "try `braid doctor",
        ],
        &["os error"],
    );
    // The outputs are checked before the inputs are read.
    let f = braid_in(d, &["report", "empty", "--html", "no/r.html"]);
    refused(
        &f,
        &["--html no/r.html: the directory no does not exist"],
        &[],
    );
    let f = braid_in(d, &["report", "empty", "--json", "empty"]);
    refused(&f, &["--json empty: is a directory"], &[]);
    let f = braid_in(d, &["doctor", "empty", "--json", "empty"]);
    refused(&f, &["--json empty: is a directory"], &[]);
}

#[test]
fn scale_checks_its_counts_and_its_out_directory_before_any_run() {
    let dir = TempDir::new("wrong-scale");
    let d = dir.path();
    let train = ["--", "--steps", "1", "--eval-every", "0"];
    for counts in ["1,1", "1,4,2"] {
        let mut all = vec!["scale", "--nproc-per-node", counts];
        all.extend_from_slice(&train);
        let f = braid_in(d, &all);
        refused(
            &f,
            &["each count once, rising"],
            &["process(es): braid train"],
        );
    }
    std::fs::write(d.join("afile"), "x").unwrap();
    let mut all = vec!["scale", "--nproc-per-node", "1, 2", "--out", "afile"];
    all.extend_from_slice(&train);
    let f = braid_in(d, &all);
    refused(
        &f,
        &["--out afile: a file"],
        &["process(es): braid train", "invalid digit"],
    );
    let f = braid_in(d, &["scale", "--plot-only", "missing.tsv"]);
    refused(&f, &["--plot-only missing.tsv"], &[]);
}

#[test]
fn launch_refuses_ranks_not_on_the_node_and_says_what_a_program_path_is() {
    let dir = TempDir::new("wrong-launch");
    let d = dir.path();
    for flag in [&["--local-ranks-filter", "5"][..], &["--tee", "5:3"][..]] {
        let mut all = vec!["launch", "--nproc-per-node", "2"];
        all.extend_from_slice(flag);
        all.extend_from_slice(&["--", "true"]);
        let f = braid_in(d, &all);
        refused(
            &f,
            &[flag[0], "local rank 5 is not on this node"],
            &["starts ranks"],
        );
    }
    std::fs::create_dir(d.join("adir")).unwrap();
    std::fs::write(d.join("script.txt"), "echo hi\n").unwrap();
    let f = braid_in(d, &["launch", "--log-dir", "script.txt", "--", "true"]);
    refused(&f, &["--log-dir script.txt: a file"], &["starts ranks"]);
    let f = braid_in(d, &["launch", "--", "./adir"]);
    refused(&f, &["that is a directory, not a program"], &[]);
    let f = braid_in(d, &["launch", "--", "./script.txt"]);
    refused(
        &f,
        &["not executable", "chmod +x ./script.txt", "sh ./script.txt"],
        &[],
    );
}

#[test]
fn kernels_and_topo_name_a_bad_flag_on_any_machine() {
    let dir = TempDir::new("wrong-kernels");
    let d = dir.path();
    let f = braid_in(d, &["kernels", "--ptx", "hopper"]);
    refused(&f, &["--ptx hopper", "compute_90"], &["NVRTC library"]);
    let f = braid_in(d, &["kernels", "--ptx", "sm_90"]);
    refused(&f, &["--ptx sm_90", "--ptx compute_90"], &["NVRTC library"]);
    let f = braid_in(d, &["topo", "--reps", "0"]);
    refused(&f, &["--reps 0"], &["NVML"]);
    let f = braid_in(d, &["topo", "--no-measure", "--json", "."]);
    refused(&f, &["--json .: is a directory"], &["NVML"]);
}
