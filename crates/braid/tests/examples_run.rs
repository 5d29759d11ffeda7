//! Every command line README.md and the `--help` pages show runs as
//! written (issue 63): each is started in a sandbox that holds the files
//! the examples name (a text file, token shards, a training script, an
//! image folder, a schedule file) and what earlier examples would have
//! made (a saved model, a checkpoint, traces); it passes when it exits 0,
//! or is still running without an error when its time is up (a training
//! run that reached its first step, a server). The lines that need a GPU
//! (on a machine without one), several hosts or placeholders to fill in
//! are skipped, and said to be.

mod common;

use common::{braid, TempDir};
use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// How long an example may run before it counts as started as written.
const BOUND: Duration = Duration::from_secs(6);

/// A command line and where it was shown.
#[derive(Debug, Clone)]
struct Example {
    source: String,
    line: String,
}

/// The `braid …` lines of README.md's code blocks (continued lines
/// joined, trailing comments dropped).
fn readme_examples() -> Vec<Example> {
    let readme = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../README.md");
    let text = std::fs::read_to_string(&readme).unwrap();
    let mut out = Vec::new();
    let mut in_block = false;
    let mut pending: Option<(usize, String)> = None;
    for (i, raw) in text.lines().enumerate() {
        if raw.trim_start().starts_with("```") {
            in_block = !in_block;
            continue;
        }
        if !in_block {
            continue;
        }
        let line = raw.trim();
        let (n, joined) = match pending.take() {
            Some((n, before)) => (n, format!("{before} {line}")),
            None => (i + 1, line.to_string()),
        };
        if let Some(stripped) = joined.strip_suffix('\\') {
            pending = Some((n, stripped.trim_end().to_string()));
            continue;
        }
        if runs_braid(&joined) {
            out.push(Example {
                source: format!("README.md:{n}"),
                line: uncomment(&joined),
            });
        }
    }
    out
}

/// The example lines of every subcommand's `--help` (after `Examples:`).
fn help_examples() -> Vec<Example> {
    let mut out = Vec::new();
    for sub in [
        "launch", "bench", "store", "topo", "verify", "train", "scale", "generate", "serve",
        "kernels", "ckpt", "doctor", "report", "data",
    ] {
        let help = braid().args([sub, "--help"]).output().unwrap();
        let text = String::from_utf8_lossy(&help.stdout).into_owned();
        let mut in_examples = false;
        for line in text.lines() {
            if line.trim_start().starts_with("Example") {
                in_examples = true;
                continue;
            }
            let t = line.trim();
            if in_examples && runs_braid(t) {
                // `(runs python3 train.py twice, as torchrun)`: a note.
                let t = t.split("   (").next().unwrap_or(t);
                out.push(Example {
                    source: format!("braid {sub} --help"),
                    line: uncomment(t),
                });
            }
        }
    }
    out
}

/// Whether `line` is a command that runs braid (possibly after variables
/// or before `&&`), not a synopsis.
fn runs_braid(line: &str) -> bool {
    let first = line
        .split_whitespace()
        .find(|w| !w.contains('='))
        .unwrap_or("");
    (first == "braid" || first.ends_with("/braid")) && !line.contains(" [")
}

/// `line` without its trailing `# comment` (outside quotes).
fn uncomment(line: &str) -> String {
    let mut quote = None;
    for (i, c) in line.char_indices() {
        match (c, quote) {
            ('\'' | '"', None) => quote = Some(c),
            (q, Some(open)) if q == open => quote = None,
            ('#', None) if i > 0 && line[..i].ends_with(' ') => return line[..i].trim().into(),
            _ => {}
        }
    }
    line.trim().to_string()
}

/// Why `line` cannot run here, if it cannot (`gpu`: this machine has one;
/// `jpeg`: braid was built with its JPEG codec).
fn skip_reason(line: &str, gpu: bool, jpeg: bool) -> Option<&'static str> {
    if !jpeg && (line.contains("imgs.beton") || line.contains("--images")) {
        return Some("needs braid's JPEG codec (libjpeg-turbo at build time)");
    }
    let needs_gpu = [
        "--device cuda",
        "--device gpu",
        "--nproc-per-node gpu",
        " -g ",
        "kernels --check",
        "braid topo",
        "hello_gpu",
    ];
    if !gpu && needs_gpu.iter().any(|p| line.contains(p)) {
        return Some("needs a GPU");
    }
    let elsewhere = [
        "...",
        "<",
        "--node-rank",
        "--master-addr A",
        "10.0.0.1",
        "srun ",
        "--nnodes 2",
    ];
    if elsewhere.iter().any(|p| line.contains(p)) {
        return Some("runs across hosts, or names placeholders to fill in");
    }
    if line.contains("target/release/examples/") && !example_built(line) {
        return Some("needs the examples built (cargo build --examples)");
    }
    if line.contains("cargo ") {
        return Some("builds braid (CI runs the README's first command itself)");
    }
    if line.contains("bench serve") {
        return Some("loads a server that must be running (tests/serve.rs runs it against one)");
    }
    None
}

/// Whether the example programs `line` runs (`…/examples/NAME`) were
/// built beside the braid under test.
fn example_built(line: &str) -> bool {
    line.split_whitespace()
        .filter_map(|w| w.split("target/release/examples/").nth(1))
        .all(|name| common::example(name).exists())
}

/// The files the examples name, and what earlier examples make, in `dir`.
fn fixtures(dir: &Path) {
    let run = |args: &[&str]| {
        let out = braid().current_dir(dir).args(args).output().unwrap();
        assert!(
            out.status.success(),
            "fixture {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let text: String = (0..6000)
        .map(|i| format!("line {i}: the quick brown fox jumps over the lazy dog.\n"))
        .collect();
    for name in ["notes.txt", "text.txt"] {
        std::fs::write(dir.join(name), &text).unwrap();
    }
    // u16 token shards, GPT-2's vocabulary.
    std::fs::create_dir_all(dir.join("shards")).unwrap();
    let tokens: Vec<u8> = (0..120_000u32)
        .flat_map(|i| ((i * 7919 % 50_000) as u16).to_le_bytes())
        .collect();
    std::fs::write(dir.join("shards/train_000.bin"), tokens).unwrap();
    std::fs::write(
        dir.join("train.py"),
        "import os\nprint('rank', os.environ['RANK'])\n",
    )
    .unwrap();
    std::fs::write(dir.join("train"), "#!/bin/sh\necho rank $RANK\n").unwrap();
    let mut perms = std::fs::metadata(dir.join("train")).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o755);
    std::fs::set_permissions(dir.join("train"), perms).unwrap();
    std::fs::write(
        dir.join("docs.jsonl"),
        "{\"text\": \"a\", \"n\": 1}\n{\"text\": \"b\", \"n\": 2}\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("my.txt"),
        "rank 0: 0F0 0SF0 0F1 0SF1 0RB0 0B0 0RB1 0B1\n\
         rank 1: 1RF0 1F0 1RF1 1F1 1B0 1SB0 1B1 1SB1\n",
    )
    .unwrap();
    // An image folder (JPEG), where braid has a JPEG codec.
    for class in ["cat", "dog"] {
        std::fs::create_dir_all(dir.join("imagenet/train").join(class)).unwrap();
        for i in 0..3 {
            let (w, h) = (96usize, 64usize);
            let rgb: Vec<u8> = (0..w * h * 3).map(|k| (k * 7 % 251) as u8).collect();
            if let Ok(jpeg) = braid_data::jpeg::encode(&rgb, w as u32, h as u32, 90) {
                let file = dir
                    .join("imagenet/train")
                    .join(class)
                    .join(format!("{i}.jpg"));
                std::fs::write(file, jpeg).unwrap();
            }
        }
    }
    std::fs::write(dir.join("prompts.txt"), "the quick\nonce upon a time\n").unwrap();
    std::fs::create_dir_all(dir.join("logs")).unwrap();
    std::fs::write(
        dir.join("logs/scaling.tsv"),
        "series\tgpus\ttokens_per_s\nbraid\t1\t500\nbraid\t2\t950\n",
    )
    .unwrap();
    // What earlier examples make: a saved model (under its names), a
    // checkpoint directory with a step 100, traces and bench results, a
    // token .beton and an image .beton.
    run(&[
        "train",
        "--model",
        "L4-H4-C128",
        "--steps",
        "2",
        "--eval-every",
        "0",
        "--save",
        "m.safetensors",
    ]);
    for copy in [
        "tiny.safetensors",
        "model.safetensors",
        "gpt2/model.safetensors",
    ] {
        if let Some(parent) = dir.join(copy).parent() {
            std::fs::create_dir_all(parent).unwrap();
        }
        std::fs::copy(dir.join("m.safetensors"), dir.join(copy)).unwrap();
    }
    run(&[
        "train",
        "--steps",
        "100",
        "--save-every",
        "100",
        "--eval-every",
        "0",
        "--ckpt-dir",
        "ck",
    ]);
    for (trace, n) in [("tr", "2"), ("tr1", "1"), ("tr2", "2"), ("tr4", "4")] {
        run(&[
            "train",
            "--nproc-per-node",
            n,
            "--steps",
            "8",
            "--eval-every",
            "0",
            "--trace",
            trace,
        ]);
    }
    run(&[
        "bench",
        "all_reduce",
        "--np",
        "2",
        "-e",
        "64K",
        "--json",
        "shm.json",
    ]);
    run(&[
        "bench",
        "all_reduce",
        "--np",
        "2",
        "-e",
        "64K",
        "--backend",
        "tcp",
        "--json",
        "tcp.json",
    ]);
    run(&[
        "data",
        "write",
        "train.beton",
        "--tokens",
        "shards/",
        "--seq",
        "1024",
    ]);
    if dir.join("imagenet/train/cat/0.jpg").exists() {
        run(&[
            "data",
            "write",
            "imgs.beton",
            "--images",
            "imagenet/train/",
            "--max-resolution",
            "64",
        ]);
    }
    // The examples built beside braid, where the README names them.
    std::fs::create_dir_all(dir.join("target/release/examples")).unwrap();
    for ex in [
        "hello",
        "hello_gpu",
        "profile_comm",
        "ddp_mlp",
        "grad_accumulation",
    ] {
        let built = common::example(ex);
        if built.exists() {
            std::os::unix::fs::symlink(built, dir.join("target/release/examples").join(ex))
                .unwrap();
        }
    }
    // A failed run's flight records in logs/: rank 1 killed once rank 0
    // has trained a few steps.
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_braid"));
    let mut failing = braid();
    failing
        .current_dir(dir)
        .env(
            "PATH",
            format!(
                "{}:{}",
                bin.parent().unwrap().display(),
                std::env::var("PATH").unwrap_or_default()
            ),
        )
        .args([
            "launch",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--log-dir",
            "logs",
            "--",
            "sh",
            "-c",
            "braid train --steps 100000 --eval-every 0 --log-every 1 > out.$RANK 2>&1 & p=$!; \
             if [ $RANK = 1 ]; then \
               for i in $(seq 300); do grep -q 'step  *3/' out.0 && break; sleep 0.1; done; \
               kill -9 $p; \
             fi; wait $p",
        ]);
    let f = common::run(failing, Duration::from_secs(90));
    assert_ne!(f.code, Some(0), "{f:?}");
    assert!(
        dir.join("logs/flight-rank00000-attempt1.json").exists(),
        "{f:?}"
    );
}

/// The parts of the examples (the tests below).
const PARTS: usize = 4;

/// The fixtures, made once for all parts (each works in a copy); the
/// last part to finish removes them.
fn shared_fixtures() -> &'static Path {
    FIXTURES
        .get_or_init(|| {
            let dir = std::env::temp_dir().join(format!("braid-examples-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            fixtures(&dir);
            dir
        })
        .as_path()
}

static FIXTURES: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();

/// Counts a part done; the last one removes the shared fixtures.
fn part_done() {
    static DONE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    if DONE.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1 == PARTS {
        if let Some(dir) = FIXTURES.get() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// Copies the tree `from` into `to` (symlinks as symlinks).
fn copy_tree(from: &Path, to: &Path) {
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let (src, dst) = (entry.path(), to.join(entry.file_name()));
        let kind = entry.file_type().unwrap();
        if kind.is_symlink() {
            std::os::unix::fs::symlink(std::fs::read_link(&src).unwrap(), &dst).unwrap();
        } else if kind.is_dir() {
            std::fs::create_dir_all(&dst).unwrap();
            copy_tree(&src, &dst);
        } else {
            std::fs::copy(&src, &dst).unwrap();
        }
    }
}

/// How an example ended.
enum Outcome {
    /// Exited 0, or still running without an error at the bound (or at
    /// its first training step).
    Ran,
    /// Failed: its exit code and output.
    Failed(String),
}

/// Whether a long-running example's output shows it past its start: a
/// training run that built its model and data, a benchmark's first row, a
/// store that is serving.
fn started_up(output: &str) -> bool {
    output.lines().any(|l| {
        l.contains("initial loss should be about")
            || l.contains("braid store: serving on")
            || (l.starts_with("  ") && l.split_whitespace().count() > 8 && !l.contains(':'))
    })
}

/// Runs `line` with `sh -c` in `dir` (`braid` on the path), in a
/// process group of its own that is killed at the end.
fn run_example(dir: &Path, line: &str) -> Outcome {
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_braid"));
    let path = format!(
        "{}:{}",
        bin.parent().unwrap().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut child = Command::new("sh")
        .args(["-c", line])
        .current_dir(dir)
        .env("PATH", path)
        .env_remove("BRAID_STORE_TOKEN")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()
        .unwrap();
    let pgid = nix::unistd::Pid::from_raw(child.id() as i32);
    let read = |mut s: Box<dyn Read + Send>| {
        let buf = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let b = buf.clone();
        std::thread::spawn(move || {
            let mut chunk = [0u8; 4096];
            while let Ok(n) = s.read(&mut chunk) {
                if n == 0 {
                    break;
                }
                b.lock()
                    .unwrap()
                    .push_str(&String::from_utf8_lossy(&chunk[..n]));
            }
        });
        buf
    };
    let out = read(Box::new(child.stdout.take().unwrap()));
    let err = read(Box::new(child.stderr.take().unwrap()));
    let started = Instant::now();
    let outcome = loop {
        if let Some(status) = child.try_wait().unwrap() {
            // Let the readers take the last words.
            std::thread::sleep(Duration::from_millis(50));
            break match status.success() {
                true => Outcome::Ran,
                false => Outcome::Failed(format!(
                    "{status}\nstdout:\n{}\nstderr:\n{}",
                    out.lock().unwrap(),
                    err.lock().unwrap()
                )),
            };
        }
        let so_far = format!("{}{}", out.lock().unwrap(), err.lock().unwrap());
        if started_up(&so_far) || started.elapsed() > BOUND {
            break match so_far.contains("error:") {
                true => Outcome::Failed(format!("still running, after an error:\n{so_far}")),
                false => Outcome::Ran,
            };
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let _ = nix::sys::signal::killpg(pgid, nix::sys::signal::Signal::SIGKILL);
    let _ = child.wait();
    outcome
}

/// Which of `of` parts example `i` runs in: those that bind a fixed port
/// (a store on 29500, metrics on 9400, a launcher without `--standalone`)
/// all in part 0, one at a time; the rest by turns.
fn part_of(i: usize, ex: &Example, of: usize) -> usize {
    let fixed_port = ex.line.contains(":29500")
        || ex.line.contains(":9400")
        || (ex.line.starts_with("braid launch") && !ex.line.contains("--standalone"));
    match fixed_port {
        true => 0,
        false => i % of,
    }
}

/// Runs part `part` of `of` of the examples (shared out between a few
/// tests, each well under a minute).
fn run_part(part: usize, of: usize) {
    let dir = TempDir::new(&format!("examples-{part}"));
    copy_tree(shared_fixtures(), dir.path());
    let gpu = common::gpus(1).is_some();
    let jpeg = dir.path().join("imgs.beton").exists();
    let mut all = readme_examples();
    all.extend(help_examples());
    assert!(all.len() > 40, "only {} examples found", all.len());
    let mut failed = Vec::new();
    for (i, ex) in all
        .iter()
        .enumerate()
        .filter(|(i, ex)| part_of(*i, ex, of) == part)
    {
        if let Some(why) = skip_reason(&ex.line, gpu, jpeg) {
            eprintln!("skipped ({why}): {}: {}", ex.source, ex.line);
            continue;
        }
        let started = Instant::now();
        match run_example(dir.path(), &ex.line) {
            Outcome::Ran => eprintln!(
                "ran in {:.1} s: {}: {}",
                started.elapsed().as_secs_f64(),
                ex.source,
                ex.line
            ),
            Outcome::Failed(why) => {
                // NVRTC is optional (CI unpacks it): without it the PTX
                // example says so, which is right.
                if ex.line.contains("kernels --ptx") && why.contains("NVRTC") {
                    eprintln!("skipped (no NVRTC here): {}: {}", ex.source, ex.line);
                    continue;
                }
                failed.push(format!("{} (example {i}): {}\n{why}", ex.source, ex.line));
            }
        }
    }
    part_done();
    assert!(
        failed.is_empty(),
        "examples that do not run as written:\n{}",
        failed.join("\n\n")
    );
}

#[test]
fn examples_part_0() {
    run_part(0, PARTS);
}

#[test]
fn examples_part_1() {
    run_part(1, PARTS);
}

#[test]
fn examples_part_2() {
    run_part(2, PARTS);
}

#[test]
fn examples_part_3() {
    run_part(3, PARTS);
}

#[test]
fn comments_and_continuations_are_read_as_a_shell_would() {
    assert_eq!(uncomment("braid train   # tiny"), "braid train");
    assert_eq!(
        uncomment("braid generate --prompt 'a # b' --tokens 3"),
        "braid generate --prompt 'a # b' --tokens 3"
    );
    assert!(runs_braid("BRAID_BACKEND=tcp braid train"));
    assert!(!runs_braid("braid launch [--nproc-per-node N]"));
    assert!(!runs_braid("cargo test --workspace"));
    assert_eq!(
        skip_reason("braid train --device cuda", false, true),
        Some("needs a GPU")
    );
    assert_eq!(skip_reason("braid train --device cuda", true, true), None);
    assert!(skip_reason("braid doctor /tmp/braid-<run id>", true, true).is_some());
    assert!(skip_reason("braid data load imgs.beton", true, false).is_some());
}
