//! Helpers for tests that run the real `braid` binary.
#![allow(dead_code)]

pub mod gpu;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Every built-in pipeline schedule, as `--schedule` names it (the
/// every-schedule tests run each).
pub const SCHEDULES: [&str; 6] = [
    "gpipe",
    "1f1b",
    "interleaved",
    "zb",
    "zb-h2",
    "interleaved-zb",
];

/// The `braid` binary under test.
pub fn braid() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_braid"));
    c.env_remove("BRAID_STORE_TOKEN")
        .env_remove("SLURM_NNODES")
        .env_remove("SLURM_NODEID")
        .env_remove("SLURM_JOB_ID");
    c
}

/// `braid launch --standalone --nproc-per-node N -- sh -c SCRIPT`.
pub fn launch_sh(nproc: usize, script: &str) -> Command {
    let mut cmd = braid();
    cmd.args(["launch", "--standalone", "--nproc-per-node"])
        .arg(nproc.to_string())
        .args(["--", "sh", "-c", script]);
    cmd
}

/// An example program built alongside the tests.
pub fn example(name: &str) -> PathBuf {
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_braid"));
    bin.parent().unwrap().join("examples").join(name)
}

/// What a finished process left.
#[derive(Debug)]
pub struct Finished {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    pub elapsed: Duration,
}

/// A started process whose output is collected in the background.
pub struct Running {
    pub child: Child,
    started: Instant,
    out: std::thread::JoinHandle<String>,
    err: std::thread::JoinHandle<String>,
}

pub fn start(mut cmd: Command) -> Running {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut so = child.stdout.take().unwrap();
    let mut se = child.stderr.take().unwrap();
    let out = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = so.read_to_string(&mut s);
        s
    });
    let err = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = se.read_to_string(&mut s);
        s
    });
    Running {
        child,
        started: Instant::now(),
        out,
        err,
    }
}

impl Running {
    /// A child started by the test itself (its stdout may be taken
    /// already: then none is collected), waited for as [`start`]'s.
    pub fn adopt(mut child: Child) -> Running {
        let so = child.stdout.take();
        let se = child.stderr.take();
        let read = |s: Option<Box<dyn Read + Send>>| {
            std::thread::spawn(move || {
                let mut text = String::new();
                if let Some(mut s) = s {
                    let _ = s.read_to_string(&mut text);
                }
                text
            })
        };
        Running {
            child,
            started: Instant::now(),
            out: read(so.map(|s| Box::new(s) as Box<dyn Read + Send>)),
            err: read(se.map(|s| Box::new(s) as Box<dyn Read + Send>)),
        }
    }

    /// Waits up to `limit`; a process still running then is killed and the
    /// test fails, so no test can hang.
    pub fn finish(mut self, limit: Duration) -> Finished {
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                let elapsed = self.started.elapsed();
                return Finished {
                    code: status.code(),
                    stdout: self.out.join().unwrap(),
                    stderr: self.err.join().unwrap(),
                    elapsed,
                };
            }
            if self.started.elapsed() > limit {
                let _ = self.child.kill();
                let _ = self.child.wait();
                panic!(
                    "process did not finish within {limit:?}\nstderr so far:\n{}",
                    self.err.join().unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

pub fn run(cmd: Command, limit: Duration) -> Finished {
    start(cmd).finish(limit)
}

/// Runs braid with `args` (killed, and the test failed, after two
/// minutes): whether it succeeded, its stdout and its stderr.
pub fn braid_args(args: &[&str]) -> (bool, String, String) {
    let mut cmd = braid();
    cmd.args(args);
    let f = run(cmd, Duration::from_secs(120));
    (f.code == Some(0), f.stdout, f.stderr)
}

/// The "model states" lines of `braid train ARGS --steps 2 --eval-every
/// 0` (what the rank held, then ZeRO's formula), joined; the run must
/// succeed (empty where it printed none).
pub fn model_states_line(args: &[&str]) -> String {
    let mut c = braid();
    c.arg("train")
        .args(args)
        .args(["--steps", "2", "--eval-every", "0"]);
    let f = run(c, Duration::from_secs(60));
    assert_eq!(f.code, Some(0), "{args:?}: {f:?}");
    f.stdout
        .lines()
        .filter(|l| l.contains("model states "))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Whether a process with this pid exists and is not a zombie.
pub fn alive(pid: u32) -> bool {
    braid_comm::health::process_alive(pid)
}

/// A port that is free on loopback right now, chosen below the kernel's
/// ephemeral range (32768+) so that no other test's client connection or
/// port-0 listener can be handed the same port before this test binds it.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let seed = std::process::id().wrapping_mul(7919);
    loop {
        let n = NEXT.fetch_add(1, Ordering::SeqCst);
        let port = 20_000 + (seed.wrapping_add(n.wrapping_mul(104_729)) % 12_000) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

/// A fresh temporary directory, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let p = std::env::temp_dir().join(format!("braid-test-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
    pub fn path(&self) -> &std::path::Path {
        &self.0
    }
    /// Pids written as files `pid.*` into the directory.
    pub fn pids(&self) -> Vec<u32> {
        let mut pids = Vec::new();
        for e in std::fs::read_dir(&self.0).unwrap() {
            let e = e.unwrap();
            if e.file_name().to_string_lossy().starts_with("pid.") {
                if let Ok(p) = std::fs::read_to_string(e.path()).unwrap().trim().parse() {
                    pids.push(p);
                }
            }
        }
        pids
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Waits until `n` pid files exist in `dir` (workers are up).
pub fn wait_for_pids(dir: &TempDir, n: usize, limit: Duration) {
    let start = Instant::now();
    while dir.pids().len() < n {
        assert!(
            start.elapsed() < limit,
            "only {} of {n} pid files after {limit:?}",
            dir.pids().len()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Starts `braid train ARGS` as 2 ranks under the launcher, lets it run
/// for `after` once both are up, kills rank 1 with SIGKILL and waits up to
/// `limit` for the job to end; returns what it left and how long after the
/// kill it ended.
pub fn kill_rank_one_of_two(
    dir: &TempDir,
    train_args: &str,
    env: &[(&str, &str)],
    after: Duration,
    limit: Duration,
) -> (Finished, Duration) {
    let exe = env!("CARGO_BIN_EXE_braid");
    let script = format!(
        "echo $$ > {d}/pid.$RANK; exec {exe} train {train_args}",
        d = dir.path().display()
    );
    let mut cmd = launch_sh(2, &script);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let running = start(cmd);
    wait_for_pids(dir, 2, Duration::from_secs(60));
    std::thread::sleep(after);
    let victim: i32 = std::fs::read_to_string(dir.path().join("pid.1"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let killed = Instant::now();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(victim),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let f = running.finish(limit);
    (f, killed.elapsed())
}

/// GPUs visible here, or `None` (after saying so past the test harness's
/// capture, so that it shows in the log) when there are fewer than `need`.
pub fn gpus(need: usize) -> Option<usize> {
    let n = braid_cuda::device_count().unwrap_or(0);
    if n < need {
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "skipped: no GPU (this test needs {need}, the CUDA driver shows {n})"
        );
        return None;
    }
    Some(n)
}

/// The largest absolute difference between two parameter vectors.
pub fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Every step's loss from a `braid train --json` record.
pub fn step_losses(doc: &serde_json::Value) -> Vec<f64> {
    doc["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["loss"].as_f64().unwrap())
        .collect()
}

/// `braid train` on the tiny model (20 steps unless `args` say, seed 11,
/// sequence 32), no evaluation, saving to
/// `dir/name.safetensors` and the JSON record to `dir/name.json`.
pub fn train(
    dir: &TempDir,
    name: &str,
    args: &[&str],
    env: &[(&str, &str)],
) -> (PathBuf, Finished) {
    let model = dir.path().join(format!("{name}.safetensors"));
    let json = dir.path().join(format!("{name}.json"));
    let mut cmd = braid();
    cmd.args(["train", "--seq", "32", "--eval-every", "0", "--seed", "11"]);
    if !args.contains(&"--steps") {
        cmd.args(["--steps", "20"]);
    }
    cmd.args(args)
        .arg("--save")
        .arg(&model)
        .arg("--json")
        .arg(&json);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let f = run(cmd, Duration::from_secs(120));
    assert_eq!(f.code, Some(0), "{name}: {f:?}");
    (model, f)
}

/// The flat parameters of a checkpoint.
pub fn params(path: &std::path::Path) -> Vec<f32> {
    braid_model::checkpoint::load(path)
        .expect("checkpoint")
        .0
        .data
}

/// A unique value of a marker variable that a test's launchers carry (their
/// workers inherit it): dropped, it SIGKILLs every live process carrying it,
/// stopped ones included, so a test leaves no process behind, passed or
/// failed.
pub struct Marked {
    var: &'static str,
    value: String,
}

impl Marked {
    /// A value of `var` unique to this test process and call.
    pub fn new(var: &'static str, tag: &str) -> Marked {
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Marked {
            var,
            value: format!("{tag}-{}-{n}", std::process::id()),
        }
    }

    /// Gives `cmd` the marker.
    pub fn mark<'c>(&self, cmd: &'c mut Command) -> &'c mut Command {
        cmd.env(self.var, &self.value)
    }

    /// Live (not zombie) processes carrying the marker.
    pub fn survivors(&self) -> Vec<u32> {
        let needle = format!("{}={}", self.var, self.value);
        proc_pids()
            .into_iter()
            .filter(|&pid| {
                std::fs::read(format!("/proc/{pid}/environ"))
                    .is_ok_and(|env| env.split(|b| *b == 0).any(|var| var == needle.as_bytes()))
            })
            .filter(|&pid| stat_of(pid).is_some_and(|(state, _)| state != 'Z'))
            .collect()
    }
}

impl Drop for Marked {
    fn drop(&mut self) {
        for _ in 0..50 {
            let left = self.survivors();
            if left.is_empty() {
                return;
            }
            for pid in left {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid as i32),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Every process id in /proc.
pub fn proc_pids() -> Vec<u32> {
    std::fs::read_dir("/proc")
        .map(|dir| {
            dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// A process's state letter and parent pid, from /proc/PID/stat.
pub fn stat_of(pid: u32) -> Option<(char, u32)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let mut rest = stat[stat.rfind(')')? + 1..].split_whitespace();
    let state = rest.next()?.chars().next()?;
    Some((state, rest.next()?.parse().ok()?))
}

/// `braid train` of the tiny model as ZeRO-3 on 4 CPU ranks (batch 4
/// each, 30 steps), a checkpoint every 10 steps in `ck`: the start of the
/// resharding tests. Returns the saved model (`dir/name.safetensors`).
pub fn zero3_on_4_ranks_with_checkpoints(dir: &TempDir, name: &str, ck: &Path) -> PathBuf {
    let ck = ck.to_str().unwrap();
    let args = [
        "--nproc",
        "4",
        "--batch",
        "4",
        "--zero",
        "3",
        "--steps",
        "30",
        "--save-every",
        "10",
        "--ckpt-dir",
        ck,
    ];
    train(dir, name, &args, &[]).0
}

/// Every step's loss from the JSON record `dir/name.json` of [`train`].
pub fn json_losses(dir: &TempDir, name: &str) -> Vec<f64> {
    let text = std::fs::read_to_string(dir.path().join(format!("{name}.json"))).unwrap();
    step_losses(&serde_json::from_str(&text).unwrap())
}

/// `braid ckpt consolidate CK -o OUT`, which must succeed.
pub fn consolidate(ck: &Path, out: &Path) {
    let mut c = braid();
    c.args(["ckpt", "consolidate"]).arg(ck).arg("-o").arg(out);
    let f = run(c, Duration::from_secs(60));
    assert_eq!(f.code, Some(0), "{f:?}");
}

/// `braid generate --load MODEL` (10 tokens), which must succeed.
pub fn generate_loads(model: &Path) {
    let mut c = braid();
    c.args(["generate", "--tokens", "10", "--prompt", "the ", "--load"])
        .arg(model);
    let f = run(c, Duration::from_secs(60));
    assert_eq!(f.code, Some(0), "{f:?}");
}
