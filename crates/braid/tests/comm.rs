//! Collectives in real processes: dead peers, shared-memory hygiene, and
//! `braid verify` through the launcher.

mod common;

use common::*;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Worker processes started directly (no launcher, so nobody stops the
/// survivors for us); killed on drop so a failing test leaves nothing.
struct Ranks(Vec<Child>);

impl Drop for Ranks {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn start_ranks(n: usize, backend: &str, run_id: &str, args: &[&str]) -> Ranks {
    let port = free_port().to_string();
    Ranks(
        (0..n)
            .map(|r| {
                Command::new(env!("CARGO_BIN_EXE_braid"))
                    .args(args)
                    .env("RANK", r.to_string())
                    .env("WORLD_SIZE", n.to_string())
                    .env("MASTER_ADDR", "127.0.0.1")
                    .env("MASTER_PORT", &port)
                    .env("BRAID_RUN_ID", run_id)
                    .env("BRAID_BACKEND", backend)
                    .env("BRAID_TIMEOUT", "60")
                    .env_remove("BRAID_STORE_ADDR")
                    .env_remove("BRAID_STORE_PREFIX")
                    .stdin(Stdio::null())
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect(),
    )
}

fn killed_rank_is_named(backend: &str) {
    let run_id = format!("kill-{backend}-{}", std::process::id());
    let mut ranks = start_ranks(
        4,
        backend,
        &run_id,
        &[
            "bench",
            "all_reduce",
            "-b",
            "256K",
            "-e",
            "256K",
            "-n",
            "100000000",
            "-w",
            "0",
        ],
    );
    // Let them get into the loop.
    std::thread::sleep(Duration::from_millis(1500));
    for (r, c) in ranks.0.iter_mut().enumerate() {
        assert!(c.try_wait().unwrap().is_none(), "rank {r} exited early");
    }
    let victim = ranks.0[2].id();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(victim as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let killed_at = Instant::now();
    for r in [0usize, 1, 3] {
        let child = &mut ranks.0[r];
        let status = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break s;
            }
            assert!(
                killed_at.elapsed() < Duration::from_secs(10),
                "{backend}: rank {r} still running 10 s after rank 2 died"
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        let mut stderr = String::new();
        use std::io::Read;
        child
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut stderr)
            .unwrap();
        assert!(!status.success(), "{backend}: rank {r} succeeded");
        assert!(
            stderr.contains("rank 2"),
            "{backend}: rank {r}'s error does not name rank 2:\n{stderr}"
        );
    }
    let leftovers = braid_comm::shm::segment::files_for_run(&run_id);
    assert!(
        leftovers.is_empty(),
        "shared-memory files outlived the run: {leftovers:?}"
    );
}

#[test]
fn killed_rank_is_named_by_every_other_rank_shm() {
    killed_rank_is_named("shm");
}

#[test]
fn killed_rank_is_named_by_every_other_rank_tcp() {
    killed_rank_is_named("tcp");
}

#[test]
fn stale_segments_are_swept_and_none_outlive_a_run() {
    let run_id = format!("sweep-{}", std::process::id());
    // A segment file left by a process that no longer exists.
    let mut dead = Command::new("true").spawn().unwrap();
    let dead_pid = dead.id();
    dead.wait().unwrap();
    let stale =
        braid_comm::shm::segment::shm_dir().join(format!("braid-{run_id}-world-{dead_pid}"));
    std::fs::write(&stale, b"left by a crash").unwrap();
    let mut cmd = braid();
    cmd.args(["verify", "--np", "3"])
        .env("BRAID_RUN_ID", &run_id);
    let f = run(cmd, Duration::from_secs(60));
    assert_eq!(f.code, Some(0), "{f:?}");
    assert!(!stale.exists(), "the stale segment was not swept");
    assert!(braid_comm::shm::segment::files_for_run(&run_id).is_empty());
}

#[test]
fn verify_passes_on_every_backend_through_the_launcher() {
    for backend in ["shm", "tcp", "hier"] {
        let mut cmd = braid();
        cmd.args(["launch", "--standalone", "--nproc-per-node", "3", "--"])
            .arg(env!("CARGO_BIN_EXE_braid"))
            .args(["verify", "--backend", backend]);
        let f = run(cmd, Duration::from_secs(60));
        assert_eq!(f.code, Some(0), "{f:?}");
        assert_eq!(
            f.stdout
                .matches(&format!(
                    "every collective verified on the {backend} backend"
                ))
                .count(),
            3,
            "{f:?}"
        );
    }
}

#[test]
fn bench_checks_every_operation() {
    for op in [
        "all_reduce",
        "reduce",
        "broadcast",
        "all_gather",
        "reduce_scatter",
        "all_to_all",
        "gather",
        "scatter",
        "sendrecv",
    ] {
        let mut cmd = braid();
        cmd.args([
            "bench", op, "--np", "3", "-b", "8", "-e", "300K", "-f", "16", "--check", "-n", "3",
            "-w", "1", "-d", "bf16",
        ]);
        let f = run(cmd, Duration::from_secs(60));
        assert_eq!(f.code, Some(0), "{op}: {f:?}");
        assert!(
            f.stdout.contains("# Out of bounds values : 0 OK"),
            "{op}: {}",
            f.stdout
        );
        assert!(f.stdout.contains("busbw"), "{op}: {}", f.stdout);
    }
}

#[test]
fn tcp_algorithms_can_be_forced_and_stay_correct() {
    for algo in ["ring", "tree"] {
        let mut cmd = braid();
        cmd.args([
            "bench",
            "all_reduce",
            "--np",
            "3",
            "--backend",
            "tcp",
            "--algo",
            algo,
        ])
        .args([
            "-b", "8", "-e", "2M", "-f", "32", "--check", "-n", "3", "-w", "1", "-o", "avg",
        ]);
        let f = run(cmd, Duration::from_secs(60));
        assert_eq!(f.code, Some(0), "{algo}: {f:?}");
        assert!(
            f.stdout.contains("backend tcp") && f.stdout.contains("# Out of bounds values : 0 OK"),
            "{algo}: {}",
            f.stdout
        );
    }
}
