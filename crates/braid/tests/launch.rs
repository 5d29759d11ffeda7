//! `braid launch` end to end: real launchers, real worker processes.

mod common;

use common::*;
use std::time::{Duration, Instant};

const LIMIT: Duration = Duration::from_secs(40);

#[test]
fn four_workers_get_torchrun_environment_and_prefixed_output() {
    let cmd = launch_sh(4, "echo $RANK/$WORLD_SIZE/$LOCAL_RANK");
    let f = run(cmd, LIMIT);
    assert_eq!(f.code, Some(0), "{f:?}");
    let mut lines: Vec<&str> = f.stdout.lines().collect();
    lines.sort();
    assert_eq!(
        lines,
        [
            "[rank 0] 0/4/0",
            "[rank 1] 1/4/1",
            "[rank 2] 2/4/2",
            "[rank 3] 3/4/3"
        ],
        "{f:?}"
    );
}

#[test]
fn every_contract_variable_is_set() {
    let script = "echo $LOCAL_WORLD_SIZE $GROUP_RANK $MASTER_ADDR $BRAID_RESTART_COUNT $BRAID_MAX_RESTARTS ${BRAID_RUN_ID:+run} ${MASTER_PORT:+port} ${BRAID_STORE_ADDR:+store} $OMP_NUM_THREADS";
    let mut cmd = braid();
    cmd.env_remove("OMP_NUM_THREADS").args([
        "launch",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "3",
        "--",
        "sh",
        "-c",
        script,
    ]);
    let f = run(cmd, LIMIT);
    assert_eq!(f.code, Some(0), "{f:?}");
    for line in f.stdout.lines() {
        assert!(
            line.ends_with("] 2 0 127.0.0.1 0 3 run port store 1"),
            "{line}"
        );
    }
}

#[test]
fn hello_example_all_reduces_ranks() {
    let mut cmd = braid();
    cmd.args(["launch", "--standalone", "--nproc-per-node", "4", "--"])
        .arg(example("hello"));
    let f = run(cmd, LIMIT);
    assert_eq!(f.code, Some(0), "{f:?}");
    assert_eq!(
        f.stdout
            .matches("after all_reduce: 6 (expected 6) ok")
            .count(),
        4,
        "{f:?}"
    );
}

#[test]
fn hello_example_runs_without_the_launcher() {
    let port = free_port().to_string();
    let ranks: Vec<_> = (0..3)
        .map(|r| {
            let mut cmd = std::process::Command::new(example("hello"));
            cmd.env("RANK", r.to_string())
                .env("WORLD_SIZE", "3")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                .env_remove("BRAID_STORE_ADDR")
                .env_remove("BRAID_STORE_PREFIX");
            start(cmd)
        })
        .collect();
    for r in ranks {
        let f = r.finish(LIMIT);
        assert_eq!(f.code, Some(0), "{f:?}");
        assert!(
            f.stdout.contains("after all_reduce: 3 (expected 3) ok"),
            "{f:?}"
        );
    }
}

/// A worker script that records its shell's and its child's pids in `dir`.
fn sleeper(dir: &TempDir, extra: &str) -> String {
    format!(
        "d={}; echo $$ > $d/pid.sh.$RANK; sleep 30 & echo $! > $d/pid.sleep.$RANK; {extra} wait",
        dir.path().display()
    )
}

#[test]
fn killed_worker_stops_the_others_and_is_named() {
    let dir = TempDir::new("sigkill");
    let script = sleeper(
        &dir,
        "if [ $RANK = 2 ]; then sleep 0.5; echo 'rank two dying' >&2; kill -9 $$; fi;",
    );
    let cmd = launch_sh(4, &script);
    let f = run(cmd, LIMIT);
    assert_ne!(f.code, Some(0), "{f:?}");
    assert_eq!(f.code, Some(128 + 9), "{f:?}");
    assert!(
        f.stderr.contains("root cause: rank 2") && f.stderr.contains("signal SIGKILL"),
        "{}",
        f.stderr
    );
    assert!(f.stderr.contains("| rank two dying"), "{}", f.stderr);
    // Started ~0.5 s in; the others must be gone within 5 s of the kill.
    assert!(
        f.elapsed < Duration::from_millis(5500),
        "took {:?}",
        f.elapsed
    );
    let pids = dir.pids();
    assert_eq!(pids.len(), 8, "every worker and child recorded its pid");
    for pid in pids {
        assert!(!alive(pid), "process {pid} outlived the launcher");
    }
}

#[test]
fn workers_ignoring_sigterm_are_killed_after_the_grace_period() {
    let dir = TempDir::new("grace");
    let script = format!(
        "trap '' TERM; d={}; echo $$ > $d/pid.sh.$RANK; if [ $RANK = 0 ]; then sleep 0.3; exit 3; fi; while :; do sleep 0.1; done",
        dir.path().display()
    );
    let mut cmd = braid();
    cmd.args([
        "launch",
        "--standalone",
        "--nproc-per-node",
        "3",
        "--grace-period",
        "1",
        "--",
        "sh",
        "-c",
        &script,
    ]);
    let f = run(cmd, LIMIT);
    assert_eq!(f.code, Some(3), "{f:?}");
    assert!(
        f.stderr.contains("root cause: rank 0") && f.stderr.contains("exit code 3"),
        "{}",
        f.stderr
    );
    assert!(
        f.elapsed >= Duration::from_millis(1200) && f.elapsed < Duration::from_secs(5),
        "{:?}",
        f.elapsed
    );
    for pid in dir.pids() {
        assert!(!alive(pid), "process {pid} survived SIGKILL escalation");
    }
}

#[test]
fn group_restarts_and_workers_see_the_restart_count() {
    let dir = TempDir::new("restart");
    let script = format!(
        "if [ $BRAID_RESTART_COUNT = 0 ] && [ $RANK = 1 ]; then echo first attempt fails >&2; exit 1; fi; \
         if [ $BRAID_RESTART_COUNT = 0 ]; then sleep 30; fi; echo restart=$BRAID_RESTART_COUNT; touch {}/ran.$RANK",
        dir.path().display()
    );
    let mut cmd = braid();
    cmd.args([
        "launch",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "2",
        "--",
        "sh",
        "-c",
        &script,
    ]);
    let f = run(cmd, LIMIT);
    assert_eq!(f.code, Some(0), "{f:?}");
    assert!(
        f.stdout.contains("[rank 1] restart=1") && f.stdout.contains("[rank 0] restart=1"),
        "{f:?}"
    );
    assert!(
        f.stderr
            .contains("restarting the worker group (restart 1 of 2)"),
        "{}",
        f.stderr
    );
    assert!(dir.path().join("ran.0").exists() && dir.path().join("ran.1").exists());
}

#[test]
fn restarts_run_out() {
    let mut cmd = braid();
    cmd.args([
        "launch",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--",
        "sh",
        "-c",
        "exit 7",
    ]);
    let f = run(cmd, LIMIT);
    assert_eq!(f.code, Some(7), "{f:?}");
    assert!(
        f.stderr.contains("attempt 2 of 2") && f.stderr.contains("no restarts left"),
        "{}",
        f.stderr
    );
}

#[test]
fn ctrl_c_is_forwarded_and_leaves_no_orphans() {
    let dir = TempDir::new("sigint");
    let script = format!(
        "d={}; echo $$ > $d/pid.sh.$RANK; trap 'echo got INT; exit 0' INT; while :; do sleep 0.1; done",
        dir.path().display()
    );
    let cmd = launch_sh(2, &script);
    let running = start(cmd);
    wait_for_pids(&dir, 2, Duration::from_secs(10));
    std::thread::sleep(Duration::from_millis(200));
    let launcher = nix::unistd::Pid::from_raw(running.child.id() as i32);
    nix::sys::signal::kill(launcher, nix::sys::signal::Signal::SIGINT).unwrap();
    let f = running.finish(LIMIT);
    assert_eq!(f.code, Some(130), "{f:?}");
    assert_eq!(f.stdout.matches("got INT").count(), 2, "{f:?}");
    assert!(f.stderr.contains("received SIGINT"), "{}", f.stderr);
    for pid in dir.pids() {
        assert!(!alive(pid), "process {pid} outlived the launcher");
    }
}

#[test]
fn sigterm_to_the_launcher_stops_everything() {
    let dir = TempDir::new("sigterm");
    let script = sleeper(&dir, "");
    let cmd = launch_sh(3, &script);
    let running = start(cmd);
    wait_for_pids(&dir, 6, Duration::from_secs(10));
    let launcher = nix::unistd::Pid::from_raw(running.child.id() as i32);
    nix::sys::signal::kill(launcher, nix::sys::signal::Signal::SIGTERM).unwrap();
    let f = running.finish(LIMIT);
    assert_eq!(f.code, Some(128 + 15), "{f:?}");
    for pid in dir.pids() {
        assert!(!alive(pid), "process {pid} outlived the launcher");
    }
}

#[test]
fn log_dir_gets_one_file_per_rank() {
    let dir = TempDir::new("logs");
    let logs = dir.path().join("logs");
    let mut cmd = braid();
    cmd.args([
        "launch",
        "--standalone",
        "--nproc-per-node",
        "3",
        "--log-dir",
    ])
    .arg(&logs)
    .args(["--", "sh", "-c", "echo out-$RANK; echo err-$RANK >&2"]);
    let f = run(cmd, LIMIT);
    assert_eq!(f.code, Some(0), "{f:?}");
    for r in 0..3 {
        let text = std::fs::read_to_string(logs.join(format!("rank{r}.log"))).unwrap();
        assert!(
            text.contains(&format!("out-{r}")) && text.contains(&format!("err-{r}")),
            "{text}"
        );
        assert!(
            f.stderr.contains(&format!("[rank {r}] err-{r}")),
            "{}",
            f.stderr
        );
    }
}

#[test]
fn missing_program_is_a_clear_error() {
    let mut cmd = braid();
    cmd.args([
        "launch",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--",
        "/nonexistent/program",
    ]);
    let f = run(cmd, LIMIT);
    assert_ne!(f.code, Some(0));
    assert!(
        f.stderr
            .contains("could not start \"/nonexistent/program\" for rank 0"),
        "{}",
        f.stderr
    );
}

#[test]
fn busy_master_port_is_a_clear_error() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let mut cmd = braid();
    cmd.args(["launch", "--master-port", &port, "--", "true"]);
    let f = run(cmd, LIMIT);
    assert_eq!(f.code, Some(2), "{f:?}");
    assert!(
        f.stderr.contains("already in use") && f.stderr.contains(&port),
        "{}",
        f.stderr
    );
}

/// One node's launcher; `extra` flags go before the program. Unless given,
/// the rendezvous timeout is 20 s.
fn node(
    port: &str,
    nnodes: &str,
    rank: usize,
    nproc: &str,
    extra: &[&str],
    script: &str,
) -> std::process::Command {
    let mut extra = extra.to_vec();
    if !extra.contains(&"--rdzv-timeout") {
        extra.extend(["--rdzv-timeout", "20"]);
    }
    let mut cmd = braid();
    cmd.args([
        "launch",
        "--nnodes",
        nnodes,
        "--node-rank",
        &rank.to_string(),
        "--master-addr",
        "127.0.0.1",
    ])
    .args(["--master-port", port, "--nproc-per-node", nproc])
    .args(extra)
    .args(["--", "sh", "-c", script]);
    cmd
}

#[test]
fn two_launchers_form_one_world() {
    let port = free_port().to_string();
    let script = "echo $RANK/$WORLD_SIZE/$LOCAL_RANK/$GROUP_RANK";
    // Node 1 first: it must wait for node 0.
    let n1 = start(node(&port, "2", 1, "3", &[], script));
    std::thread::sleep(Duration::from_millis(300));
    let n0 = start(node(&port, "2", 0, "3", &[], script));
    let (f0, f1) = (n0.finish(LIMIT), n1.finish(LIMIT));
    assert_eq!((f0.code, f1.code), (Some(0), Some(0)), "{f0:?}\n{f1:?}");
    let mut l0: Vec<&str> = f0.stdout.lines().collect();
    let mut l1: Vec<&str> = f1.stdout.lines().collect();
    l0.sort();
    l1.sort();
    assert_eq!(
        l0,
        ["[rank 0] 0/6/0/0", "[rank 1] 1/6/1/0", "[rank 2] 2/6/2/0"]
    );
    assert_eq!(
        l1,
        ["[rank 3] 3/6/0/1", "[rank 4] 4/6/1/1", "[rank 5] 5/6/2/1"]
    );
}

#[test]
fn two_launchers_run_hello_across_nodes() {
    let port = free_port().to_string();
    let hello = example("hello");
    let hello = hello.to_str().unwrap();
    let n0 = start(node(&port, "2", 0, "2", &[], hello));
    let n1 = start(node(&port, "2", 1, "2", &[], hello));
    for f in [n0.finish(LIMIT), n1.finish(LIMIT)] {
        assert_eq!(f.code, Some(0), "{f:?}");
        assert_eq!(
            f.stdout
                .matches("after all_reduce: 6 (expected 6) ok")
                .count(),
            2,
            "{f:?}"
        );
    }
}

#[test]
fn failure_on_one_node_stops_the_other() {
    let port = free_port().to_string();
    let dir = TempDir::new("multinode-fail");
    let script = sleeper(
        &dir,
        "if [ $RANK = 3 ]; then sleep 0.5; echo node one breaks >&2; exit 5; fi;",
    );
    let n0 = start(node(&port, "2", 0, "2", &[], &script));
    let n1 = start(node(&port, "2", 1, "2", &[], &script));
    let (f0, f1) = (n0.finish(LIMIT), n1.finish(LIMIT));
    assert_eq!((f0.code, f1.code), (Some(5), Some(5)), "{f0:?}\n{f1:?}");
    for f in [&f0, &f1] {
        assert!(
            f.stderr
                .contains("root cause: rank 3 (local rank 1, node 1"),
            "{}",
            f.stderr
        );
        assert!(f.stderr.contains("| node one breaks"), "{}", f.stderr);
    }
    assert!(
        f0.elapsed < Duration::from_secs(8),
        "node 0 took {:?}",
        f0.elapsed
    );
    for pid in dir.pids() {
        assert!(!alive(pid), "process {pid} outlived the launchers");
    }
}

#[test]
fn restart_spans_both_nodes() {
    let port = free_port().to_string();
    let script = "if [ $BRAID_RESTART_COUNT = 0 ] && [ $RANK = 0 ]; then exit 1; fi; \
                  if [ $BRAID_RESTART_COUNT = 0 ]; then sleep 30; fi; echo ok-$BRAID_RESTART_COUNT";
    let n0 = start(node(&port, "2", 0, "1", &["--max-restarts", "1"], script));
    let n1 = start(node(&port, "2", 1, "1", &["--max-restarts", "1"], script));
    let (f0, f1) = (n0.finish(LIMIT), n1.finish(LIMIT));
    assert_eq!((f0.code, f1.code), (Some(0), Some(0)), "{f0:?}\n{f1:?}");
    assert!(
        f0.stdout.contains("[rank 0] ok-1") && f1.stdout.contains("[rank 1] ok-1"),
        "{f0:?}\n{f1:?}"
    );
}

#[test]
fn missing_node_is_named_at_rendezvous_timeout() {
    let port = free_port().to_string();
    // Node 1 joins, node 2 never does.
    let n0 = start(node(&port, "3", 0, "1", &["--rdzv-timeout", "1"], "true"));
    let n1 = start(node(&port, "3", 1, "1", &["--rdzv-timeout", "10"], "true"));
    let (f0, f1) = (n0.finish(LIMIT), n1.finish(LIMIT));
    assert_eq!((f0.code, f1.code), (Some(2), Some(2)), "{f0:?}\n{f1:?}");
    assert!(
        f0.stderr.contains("node rank(s) [2] did not join"),
        "{}",
        f0.stderr
    );
    assert!(
        f1.stderr.contains("node rank(s) [2] did not join"),
        "{}",
        f1.stderr
    );
}

#[test]
fn missing_node_zero_is_named() {
    let port = free_port().to_string();
    let f = run(
        node(&port, "2", 1, "1", &["--rdzv-timeout", "1"], "true"),
        LIMIT,
    );
    assert_eq!(f.code, Some(2), "{f:?}");
    assert!(f.stderr.contains("node 0 did not arrive"), "{}", f.stderr);
}

#[test]
fn duplicate_node_rank_is_refused() {
    let port = free_port().to_string();
    let n0 = start(node(
        &port,
        "2",
        0,
        "1",
        &["--rdzv-timeout", "5"],
        "sleep 2",
    ));
    std::thread::sleep(Duration::from_millis(300));
    let dup = run(node(&port, "2", 0, "1", &[], "true"), LIMIT);
    assert_eq!(dup.code, Some(2), "{dup:?}");
    assert!(dup.stderr.contains("already in use"), "{}", dup.stderr);
    let n1 = start(node(
        &port,
        "2",
        1,
        "1",
        &["--rdzv-timeout", "5"],
        "sleep 2",
    ));
    std::thread::sleep(Duration::from_millis(500));
    let dup1 = run(node(&port, "2", 1, "1", &[], "true"), LIMIT);
    assert_eq!(dup1.code, Some(2), "{dup1:?}");
    assert!(
        dup1.stderr.contains("node rank 1 is already taken"),
        "{}",
        dup1.stderr
    );
    let (f0, f1) = (n0.finish(LIMIT), n1.finish(LIMIT));
    assert_eq!((f0.code, f1.code), (Some(0), Some(0)), "{f0:?}\n{f1:?}");
}

#[test]
fn store_token_is_enforced_between_nodes() {
    let port = free_port().to_string();
    let mut c0 = node(&port, "2", 0, "1", &["--rdzv-timeout", "5"], "true");
    c0.env("BRAID_STORE_TOKEN", "secret-a");
    let n0 = start(c0);
    let mut c1 = node(&port, "2", 1, "1", &[], "true");
    c1.env("BRAID_STORE_TOKEN", "secret-b");
    let f1 = run(c1, LIMIT);
    assert_eq!(f1.code, Some(2), "{f1:?}");
    assert!(
        f1.stderr.contains("refused") && f1.stderr.contains("BRAID_STORE_TOKEN"),
        "{}",
        f1.stderr
    );
    let _ = n0.finish(LIMIT);
}

#[test]
fn help_has_purpose_and_example() {
    for sub in [
        &["--help"][..],
        &["launch", "--help"],
        &["store", "--help"],
        &["store", "bench", "--help"],
        &["store", "serve", "--help"],
        &["bench", "--help"],
        &["verify", "--help"],
        &["topo", "--help"],
    ] {
        let mut cmd = braid();
        cmd.args(sub);
        let f = run(cmd, LIMIT);
        assert_eq!(f.code, Some(0), "{sub:?}");
        assert!(
            f.stdout.contains("Example"),
            "{sub:?} help lacks an example:\n{}",
            f.stdout
        );
    }
    let start = Instant::now();
    let mut cmd = braid();
    cmd.args(["launch", "--nproc-per-node", "2"]);
    let f = run(cmd, LIMIT);
    assert_eq!(f.code, Some(2));
    assert!(start.elapsed() < Duration::from_secs(5));
}

#[test]
fn profile_comm_example_reports_every_size() {
    let mut cmd = braid();
    cmd.args(["launch", "--standalone", "--nproc-per-node", "2", "--"])
        .arg(example("profile_comm"));
    let f = run(cmd, LIMIT);
    assert_eq!(f.code, Some(0), "{f:?}");
    for size in ["1000 |", "10000 |", "100000 |", "1000000 |", "10000000 |"] {
        assert!(f.stdout.contains(size), "missing size {size}: {}", f.stdout);
    }
}

#[test]
fn topo_explains_a_machine_without_gpus() {
    let mut cmd = braid();
    cmd.arg("topo");
    let f = run(cmd, LIMIT);
    match f.code {
        // A GPU machine prints its GPUs.
        Some(0) => assert!(f.stdout.contains("PCI bus id"), "{f:?}"),
        _ => {
            assert_eq!(f.code, Some(1), "{f:?}");
            assert!(
                f.stderr.contains("GPU collectives are unavailable here"),
                "{}",
                f.stderr
            );
        }
    }
}
