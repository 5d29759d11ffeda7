//! `braid launch` with very many workers: a count far above the host's
//! cores is refused unless forced, exited workers are reaped while others
//! are still being started, and SIGTERM stops the launcher mid-spawn.
//!
//! Every launcher here runs with a unique marker variable that its workers
//! inherit; a guard kills every process carrying the marker when the test
//! ends, passed or failed.

mod common;

use common::*;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use std::time::{Duration, Instant};

/// The variable that marks a test's launcher and workers.
const MARKER_VAR: &str = "BRAID_LAUNCH_FAULTS_MARKER";

/// A test's marker, with the launcher command that carries it.
fn marked(tag: &str) -> Marked {
    Marked::new(MARKER_VAR, tag)
}

/// `braid launch --standalone` carrying `marked`'s marker.
fn launch(marked: &Marked, args: &[&str]) -> std::process::Command {
    let mut cmd = braid();
    marked
        .mark(&mut cmd)
        .args(["launch", "--standalone"])
        .args(args);
    cmd
}

/// (zombie children, all children) of `parent` right now.
fn children(parent: u32) -> (usize, usize) {
    let mut zombies = 0;
    let mut all = 0;
    for pid in proc_pids() {
        if let Some((state, ppid)) = stat_of(pid) {
            if ppid == parent {
                all += 1;
                zombies += usize::from(state == 'Z');
            }
        }
    }
    (zombies, all)
}

fn host_cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

#[test]
fn a_worker_count_far_above_the_cores_is_refused_unless_forced() {
    let marked = marked("refuse");
    let mut cmd = launch(&marked, &["--nproc-per-node", "100000", "--", "/bin/true"]);
    let f = run(cmd, Duration::from_secs(20));
    assert_eq!(f.code, Some(2), "{f:?}");
    assert!(
        f.elapsed < Duration::from_secs(5),
        "refusal took {:?}",
        f.elapsed
    );
    let cores = host_cores();
    for want in [
        "100000 workers".to_string(),
        format!("{cores} CPU core"),
        "--force-nproc".to_string(),
    ] {
        assert!(f.stderr.contains(&want), "missing {want:?}: {}", f.stderr);
    }
    assert!(f.stdout.is_empty(), "no worker may start: {f:?}");

    // A count within the limit needs no force.
    cmd = launch(&marked, &["--nproc-per-node", "2", "--", "/bin/true"]);
    let f = run(cmd, Duration::from_secs(20));
    assert_eq!(f.code, Some(0), "{f:?}");
}

#[test]
fn exited_workers_are_reaped_while_others_are_still_starting() {
    const N: usize = 200;
    let marked = marked("reap");
    let n = N.to_string();
    // Every worker but rank 0 exits at once; rank 0 keeps the job going.
    let cmd = launch(
        &marked,
        &[
            "--force-nproc",
            "--nproc-per-node",
            &n,
            "--",
            "sh",
            "-c",
            "if [ $LOCAL_RANK = 0 ]; then sleep 2; fi",
        ],
    );
    let running = start(cmd);
    let launcher = running.child.id();
    let started = Instant::now();
    let (mut most_zombies, mut most_children, mut samples) = (0, 0, 0);
    while started.elapsed() < Duration::from_secs(45)
        && stat_of(launcher).is_some_and(|(state, _)| state != 'Z')
    {
        let (zombies, all) = children(launcher);
        most_zombies = most_zombies.max(zombies);
        most_children = most_children.max(all);
        samples += 1;
        std::thread::sleep(Duration::from_millis(2));
    }
    let f = running.finish(Duration::from_secs(50));
    eprintln!("{N} workers: at most {most_zombies} zombies and {most_children} children in {samples} samples, {:?}", f.elapsed);
    assert_eq!(f.code, Some(0), "{f:?}");
    assert!(
        most_children >= 1 && samples >= 10,
        "the launcher's children were never seen ({samples} samples)"
    );
    // Unreaped, they would pile up to nearly N while the rest start.
    assert!(
        most_zombies <= N / 10,
        "up to {most_zombies} of {N} workers were left as zombies ({most_children} children at most, {samples} samples)"
    );
    assert!(marked.survivors().is_empty());
}

#[test]
fn sigterm_while_spawning_stops_the_launcher_and_every_worker() {
    const N: usize = 1000;
    let marked = marked("sigterm");
    let dir = TempDir::new("faults-sigterm");
    let script = format!(
        "echo $$ > {}/pid.$RANK; exec sleep 30",
        dir.path().display()
    );
    let n = N.to_string();
    let cmd = launch(
        &marked,
        &[
            "--force-nproc",
            "--grace-period",
            "1",
            "--nproc-per-node",
            &n,
            "--",
            "sh",
            "-c",
            &script,
        ],
    );
    let running = start(cmd);
    wait_for_pids(&dir, 10, Duration::from_secs(30));
    let signalled = Instant::now();
    kill(Pid::from_raw(running.child.id() as i32), Signal::SIGTERM).unwrap();
    let f = running.finish(Duration::from_secs(50));
    let took = signalled.elapsed();
    eprintln!(
        "stopped {took:?} after SIGTERM; {} of {N} workers had started",
        dir.pids().len()
    );
    assert_eq!(f.code, Some(128 + 15), "{f:?}");
    assert!(f.stderr.contains("received SIGTERM"), "{}", f.stderr);
    // Grace period 1 s, plus a margin for a loaded machine.
    assert!(
        took < Duration::from_secs(4),
        "the launcher took {took:?} to stop after SIGTERM"
    );
    let pids = dir.pids();
    assert!(
        pids.len() < N / 2,
        "{} of {N} workers started after SIGTERM: spawning went on",
        pids.len()
    );
    for pid in pids {
        assert!(!alive(pid), "worker {pid} outlived the launcher");
    }
    let left = marked.survivors();
    assert!(left.is_empty(), "processes {left:?} outlived the launcher");
}
