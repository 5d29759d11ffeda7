//! Flight records through the real binary: a rank stopped with SIGSTOP in
//! an all-reduce loop (and in data-parallel training) is named — with the operation it did not reach — by
//! the rank waiting for it, by the launcher and by `braid doctor`, and
//! everything ends within BRAID_TIMEOUT + 10 s; SIGUSR1 writes a running
//! rank's record; `braid doctor` on a directory without records says so;
//! a record slow to write (3 s) is waited for, and a restarted job keeps
//! each attempt's records, which `braid doctor` reads.
//!
//! Every launcher here runs with a unique marker variable that its workers
//! inherit; a guard SIGKILLs every process carrying it (the stopped one
//! included) when the test ends, passed or failed. The tests take turns
//! (a lock), so that their timing does not depend on each other's load.

mod common;

use common::*;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use std::sync::Mutex;
use std::time::{Duration, Instant};

const MARKER_VAR: &str = "BRAID_FLIGHT_TEST_MARKER";
const TIMEOUT_S: u64 = 4;

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// `braid launch` of 2 ranks running an endless all-reduce loop, each
/// writing its pid to `pids/pid.RANK`, logs and flight records in `logs`.
fn all_reduce_loop(marked: &Marked, pids: &TempDir, logs: &TempDir) -> std::process::Command {
    two_ranks(
        marked,
        pids,
        logs,
        "bench all_reduce -b 256K -e 256K -n 100000000 -w 0",
    )
}

/// `braid launch` of 2 ranks each running `braid ARGS`, each writing its
/// pid to `pids/pid.RANK`, logs and flight records in `logs`, with the
/// tests' timeout.
fn two_ranks(marked: &Marked, pids: &TempDir, logs: &TempDir, args: &str) -> std::process::Command {
    let exe = env!("CARGO_BIN_EXE_braid");
    let script = format!(
        "echo $$ > {d}/pid.$RANK; exec {exe} {args}",
        d = pids.path().display()
    );
    let mut cmd = braid();
    marked
        .mark(&mut cmd)
        .env("BRAID_TIMEOUT", TIMEOUT_S.to_string())
        .env_remove("BRAID_LOG_DIR")
        .env_remove("BRAID_FLIGHT_RECORDS")
        .args([
            "launch",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--log-dir",
        ])
        .arg(logs.path())
        .args(["--", "sh", "-c", &script]);
    cmd
}

fn pid_of(pids: &TempDir, rank: usize) -> u32 {
    std::fs::read_to_string(pids.path().join(format!("pid.{rank}")))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// The sequence number in `... all_reduce #N timed out ...`.
fn timed_out_seq(text: &str) -> u64 {
    let at = text
        .find(" timed out after")
        .unwrap_or_else(|| panic!("no timeout in:\n{text}"));
    let head = &text[..at];
    let hash = head.rfind('#').expect("a sequence number");
    head[hash + 1..].parse().expect("a number")
}

#[test]
fn a_stopped_rank_is_named_by_the_waiting_rank_the_launcher_and_doctor() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let marked = Marked::new(MARKER_VAR, "sigstop");
    let pids = TempDir::new("flight-pids");
    let logs = TempDir::new("flight-logs");
    let running = start(all_reduce_loop(&marked, &pids, &logs));
    wait_for_pids(&pids, 2, Duration::from_secs(30));
    // Let the loop run (and heartbeats flow), then stop rank 1 in it.
    std::thread::sleep(Duration::from_millis(1500));
    let (rank0, rank1) = (pid_of(&pids, 0), pid_of(&pids, 1));
    assert!(alive(rank0) && alive(rank1), "a rank ended before the stop");
    kill(Pid::from_raw(rank1 as i32), Signal::SIGSTOP).unwrap();
    let stopped = Instant::now();
    let limit = Duration::from_secs(TIMEOUT_S + 10);
    let f = running.finish(limit + Duration::from_secs(5));
    let ended = stopped.elapsed();
    assert!(
        ended <= limit,
        "the launcher ended {ended:?} after the stop (limit {limit:?})\n{}",
        f.stderr
    );
    assert!(
        !alive(rank0) && !alive(rank1),
        "a rank outlived the launcher"
    );
    assert_ne!(f.code, Some(0), "{f:?}");

    // Rank 0's own error names rank 1 and the operation it waits in.
    let err0 = f
        .stderr
        .lines()
        .find(|l| l.starts_with("[rank 0] braid: error:"))
        .unwrap_or_else(|| panic!("no error from rank 0:\n{}", f.stderr));
    let seq = timed_out_seq(err0);
    let not_reached = format!("did not reach all_reduce #{seq}");
    assert!(
        err0.contains("rank 1 stopped") && err0.contains(&not_reached),
        "{err0}"
    );
    assert!(err0.contains("SIGSTOP"), "{err0}");

    // The launcher's diagnosis says the same.
    let diagnosis = f
        .stderr
        .lines()
        .find(|l| l.starts_with("  world (2 ranks): "))
        .unwrap_or_else(|| panic!("no diagnosis from the launcher:\n{}", f.stderr));
    assert!(
        diagnosis.contains("rank 1 stopped") && diagnosis.contains(&not_reached),
        "{diagnosis}"
    );
    assert!(
        diagnosis.contains(&format!("rank 0 waiting in all_reduce #{seq}")),
        "{diagnosis}"
    );
    assert!(
        f.stderr
            .contains("braid launch: flight records of attempt 1"),
        "{}",
        f.stderr
    );

    // Rank 0 wrote its record (the failed operation last); the launcher
    // wrote rank 1's last heartbeat in its place.
    let dump: serde_json::Value = serde_json::from_slice(
        &std::fs::read(logs.path().join("flight-rank00000-attempt1.json"))
            .expect("rank 0's record"),
    )
    .unwrap();
    let records = dump["records"].as_array().unwrap();
    assert!(!records.is_empty() && records.len() <= 2048, "{dump}");
    let last = records.last().unwrap();
    assert_eq!(last["seq"], seq, "{last}");
    assert_eq!(last["state"], "failed", "{last}");
    assert_eq!(last["op"], "all_reduce", "{last}");
    assert_eq!(last["dtype"], "f32", "{last}");
    assert_eq!(last["count"], 65536, "{last}");
    let stand_in: serde_json::Value = serde_json::from_slice(
        &std::fs::read(logs.path().join("flight-rank00001-attempt1.json"))
            .expect("rank 1's stand-in"),
    )
    .unwrap();
    assert_eq!(stand_in["kind"], "heartbeat", "{stand_in}");
    assert_eq!(stand_in["observed"]["state"], "stopped", "{stand_in}");

    // `braid doctor` prints it again from the files alone.
    let mut doctor = braid();
    doctor.arg("doctor").arg(logs.path());
    let d = run(doctor, Duration::from_secs(20));
    assert_eq!(d.code, Some(0), "{d:?}");
    assert!(
        d.stdout.contains("rank 1 stopped") && d.stdout.contains(&not_reached),
        "{}",
        d.stdout
    );
    let mut doctor = braid();
    doctor.arg("doctor").arg(logs.path()).arg("--json");
    let d = run(doctor, Duration::from_secs(20));
    assert_eq!(d.code, Some(0), "{d:?}");
    let doc: serde_json::Value = serde_json::from_str(&d.stdout).unwrap();
    let world = &doc["diagnoses"][0];
    assert_eq!(world["comm"], "world", "{doc}");
    assert_eq!(world["findings"][0]["kind"], "stopped", "{doc}");
    assert_eq!(
        world["findings"][0]["ranks"],
        serde_json::json!([1]),
        "{doc}"
    );
    assert_eq!(world["front"]["seq"], seq, "{doc}");
    drop(marked);
}

#[test]
fn sigusr1_writes_the_record_of_a_running_rank() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let marked = Marked::new(MARKER_VAR, "sigusr1");
    let pids = TempDir::new("flight-usr1-pids");
    let logs = TempDir::new("flight-usr1-logs");
    let mut cmd = all_reduce_loop(&marked, &pids, &logs);
    cmd.env("BRAID_FLIGHT_RECORDS", "16");
    let running = start(cmd);
    wait_for_pids(&pids, 2, Duration::from_secs(30));
    std::thread::sleep(Duration::from_millis(1000));
    let rank0 = pid_of(&pids, 0);
    let path = logs.path().join("flight-rank00000-attempt1.json");
    kill(Pid::from_raw(rank0 as i32), Signal::SIGUSR1).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !path.exists() {
        assert!(Instant::now() < deadline, "no record after SIGUSR1");
        std::thread::sleep(Duration::from_millis(20));
    }
    let dump: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    assert_eq!(dump["kind"], "dump", "{dump}");
    assert!(
        dump["reason"].as_str().unwrap().contains("SIGUSR1"),
        "{dump}"
    );
    let records = dump["records"].as_array().unwrap();
    assert_eq!(records.len(), 16, "BRAID_FLIGHT_RECORDS=16: {dump}");
    let seqs: Vec<u64> = records.iter().map(|r| r["seq"].as_u64().unwrap()).collect();
    assert!(
        seqs.windows(2).all(|w| w[1] == w[0] + 1),
        "not the last 16 in order: {seqs:?}"
    );
    assert_eq!(dump["comms"][0]["id"], "world", "{dump}");
    assert_eq!(dump["comms"][0]["world_ranks"], serde_json::json!([0, 1]));
    // The rank keeps running: SIGUSR1 only asked for a record.
    std::thread::sleep(Duration::from_millis(300));
    assert!(alive(rank0), "SIGUSR1 ended the rank");
    // Stopping the launcher stops the job and still explains it.
    let launcher = running.child.id();
    kill(Pid::from_raw(launcher as i32), Signal::SIGTERM).unwrap();
    let f = running.finish(Duration::from_secs(20));
    assert_ne!(f.code, Some(0), "{f:?}");
    assert!(
        f.stderr
            .contains("braid launch: flight records of attempt 1"),
        "{}",
        f.stderr
    );
    drop(marked);
}

#[test]
fn doctor_on_a_directory_without_records_says_so() {
    let empty = TempDir::new("flight-empty");
    let mut cmd = braid();
    cmd.arg("doctor").arg(empty.path());
    let f = run(cmd, Duration::from_secs(20));
    assert_eq!(f.code, Some(2), "{f:?}");
    assert!(f.stderr.contains("no flight records"), "{}", f.stderr);
}

#[test]
fn a_killed_rank_is_diagnosed_from_its_last_heartbeat() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let marked = Marked::new(MARKER_VAR, "sigkill");
    let pids = TempDir::new("flight-kill-pids");
    let logs = TempDir::new("flight-kill-logs");
    let running = start(all_reduce_loop(&marked, &pids, &logs));
    wait_for_pids(&pids, 2, Duration::from_secs(30));
    std::thread::sleep(Duration::from_millis(1500));
    kill(Pid::from_raw(pid_of(&pids, 1) as i32), Signal::SIGKILL).unwrap();
    let f = running.finish(Duration::from_secs(TIMEOUT_S + 10));
    assert_ne!(f.code, Some(0), "{f:?}");
    let diagnosis = f
        .stderr
        .lines()
        .find(|l| l.starts_with("  world (2 ranks): "))
        .unwrap_or_else(|| panic!("no diagnosis from the launcher:\n{}", f.stderr));
    assert!(
        diagnosis.contains("rank 1 exited") && diagnosis.contains("(signal SIGKILL)"),
        "{diagnosis}"
    );
    // A dead rank writes nothing: the launcher wrote its last heartbeat,
    // with how it ended, in its place.
    let stand_in: serde_json::Value = serde_json::from_slice(
        &std::fs::read(logs.path().join("flight-rank00001-attempt1.json"))
            .expect("rank 1's stand-in"),
    )
    .unwrap();
    assert_eq!(stand_in["kind"], "heartbeat", "{stand_in}");
    assert_eq!(stand_in["observed"]["state"], "exited", "{stand_in}");
    assert_eq!(stand_in["observed"]["how"], "signal SIGKILL", "{stand_in}");
    drop(marked);
}

#[test]
fn a_stopped_rank_in_data_parallel_training_is_named_within_the_timeout() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let marked = Marked::new(MARKER_VAR, "sigstop-train");
    let pids = TempDir::new("flight-train-pids");
    let logs = TempDir::new("flight-train-logs");
    let cmd = two_ranks(
        &marked,
        &pids,
        &logs,
        "train --steps 100000000 --eval-every 0 --log-every 1000",
    );
    let running = start(cmd);
    wait_for_pids(&pids, 2, Duration::from_secs(30));
    std::thread::sleep(Duration::from_millis(2000));
    let rank1 = pid_of(&pids, 1);
    kill(Pid::from_raw(rank1 as i32), Signal::SIGSTOP).unwrap();
    let stopped = Instant::now();
    let limit = Duration::from_secs(TIMEOUT_S + 10);
    let f = running.finish(limit + Duration::from_secs(5));
    let ended = stopped.elapsed();
    assert!(
        ended <= limit,
        "ended {ended:?} after the stop\n{}",
        f.stderr
    );
    assert_ne!(f.code, Some(0), "{f:?}");
    // The gradients' all-reduce: rank 0 names rank 1 and the operation
    // it did not reach; so does the launcher.
    let err0 = f
        .stderr
        .lines()
        .find(|l| l.starts_with("[rank 0] braid: error:"))
        .unwrap_or_else(|| panic!("no error from rank 0:\n{}", f.stderr));
    let seq = timed_out_seq(err0);
    assert!(
        err0.contains("rank 1 stopped")
            && err0.contains(&format!("did not reach all_reduce #{seq}")),
        "{err0}"
    );
    assert!(
        f.stderr
            .lines()
            .any(|l| l.starts_with("  world (2 ranks): ") && l.contains("rank 1 stopped")),
        "{}",
        f.stderr
    );
    drop(marked);
}

/// The pid rank `rank` of attempt `attempt` (`BRAID_RESTART_COUNT`) wrote
/// to `pids/pid.RANK.ATTEMPT`, waited for up to 30 s.
fn pid_of_attempt(pids: &TempDir, rank: usize, attempt: u32) -> u32 {
    let path = pids.path().join(format!("pid.{rank}.{attempt}"));
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(pid) = std::fs::read_to_string(&path)
            .ok()
            .and_then(|s| s.trim().parse().ok())
        {
            return pid;
        }
        assert!(
            Instant::now() < deadline,
            "no pid from rank {rank} of attempt {attempt} within 30 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_slow_record_is_waited_for_and_each_attempt_keeps_its_own() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let marked = Marked::new(MARKER_VAR, "slow-dump");
    let pids = TempDir::new("flight-slow-pids");
    let logs = TempDir::new("flight-slow-logs");
    let exe = env!("CARGO_BIN_EXE_braid");
    let script = format!(
        "echo $$ > {d}/pid.$RANK.$BRAID_RESTART_COUNT; exec {exe} bench all_reduce -b 256K -e 256K -n 100000000 -w 0",
        d = pids.path().display()
    );
    let mut cmd = braid();
    marked
        .mark(&mut cmd)
        .env("BRAID_TIMEOUT", TIMEOUT_S.to_string())
        // Rank 1 sleeps 3 s halfway through writing each flight record:
        // longer than the launcher used to wait (2 s) before stopping it.
        .env("BRAID_TEST_DELAY", "1:dump:3000")
        .env_remove("BRAID_LOG_DIR")
        .env_remove("BRAID_FLIGHT_RECORDS")
        .args([
            "launch",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            "--log-dir",
        ])
        .arg(logs.path())
        .args(["--", "sh", "-c", &script]);
    let running = start(cmd);
    // Each attempt: let the loop run (and heartbeats flow), then kill rank
    // 0; the launcher asks rank 1 for its record with SIGUSR1.
    for attempt in 0..2 {
        let rank0 = pid_of_attempt(&pids, 0, attempt);
        let rank1 = pid_of_attempt(&pids, 1, attempt);
        std::thread::sleep(Duration::from_millis(1200));
        assert!(
            alive(rank0) && alive(rank1),
            "a rank of attempt {attempt} ended before the kill"
        );
        kill(Pid::from_raw(rank0 as i32), Signal::SIGKILL).unwrap();
    }
    let f = running.finish(Duration::from_secs(50));
    assert_ne!(f.code, Some(0), "{f:?}");
    for attempt in [1, 2] {
        assert!(
            f.stderr.contains(&format!(
                "braid launch: flight records of attempt {attempt} "
            )),
            "{}",
            f.stderr
        );
    }
    assert!(
        f.stderr
            .contains("braid launch: waiting for the flight record of rank 1 (being written"),
        "{}",
        f.stderr
    );
    assert!(
        !f.stderr.contains("did not come"),
        "a record asked for did not come:\n{}",
        f.stderr
    );

    // Both attempts' records are there, under their own names: rank 1's
    // own (complete, though slow), rank 0's last heartbeat in its place.
    let read = |name: &str| -> serde_json::Value {
        let bytes = std::fs::read(logs.path().join(name))
            .unwrap_or_else(|e| panic!("{name}: {e}\n{}", f.stderr));
        serde_json::from_slice(&bytes).unwrap_or_else(|e| panic!("{name}: {e}"))
    };
    let mut writers = Vec::new();
    for attempt in [1u32, 2] {
        let own = read(&format!("flight-rank00001-attempt{attempt}.json"));
        assert_eq!(own["kind"], "dump", "attempt {attempt}: {own}");
        assert_eq!(own["attempt"], attempt - 1, "{own}");
        assert!(!own["records"].as_array().unwrap().is_empty(), "{own}");
        let reason = own["reason"].as_str().unwrap();
        assert!(
            reason.starts_with("SIGUSR1") || reason.starts_with("abort"),
            "{reason}"
        );
        writers.push(own["pid"].as_u64().unwrap());
        let stand_in = read(&format!("flight-rank00000-attempt{attempt}.json"));
        assert_eq!(stand_in["kind"], "heartbeat", "{stand_in}");
        assert_eq!(stand_in["attempt"], attempt - 1, "{stand_in}");
        assert_eq!(stand_in["observed"]["how"], "signal SIGKILL", "{stand_in}");
    }
    assert_ne!(
        writers[0], writers[1],
        "one process wrote both attempts' records"
    );
    let mut left: Vec<String> = std::fs::read_dir(logs.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("flight-") || n.ends_with(".tmp"))
        .collect();
    left.sort();
    assert_eq!(
        left,
        [
            "flight-rank00000-attempt1.json",
            "flight-rank00000-attempt2.json",
            "flight-rank00001-attempt1.json",
            "flight-rank00001-attempt2.json"
        ],
        "records, and no cut-off temporary file"
    );

    // `braid doctor` diagnoses both attempts, the newest last.
    let mut doctor = braid();
    doctor.arg("doctor").arg(logs.path());
    let d = run(doctor, Duration::from_secs(20));
    assert_eq!(d.code, Some(0), "{d:?}");
    let first = d
        .stdout
        .find("attempt 1: records of 2 of 2 rank(s)")
        .unwrap_or_else(|| panic!("{}", d.stdout));
    let second = d
        .stdout
        .find("attempt 2 (the newest): records of 2 of 2 rank(s)")
        .unwrap_or_else(|| panic!("{}", d.stdout));
    assert!(first < second, "{}", d.stdout);
    assert!(
        d.stdout.contains("2 attempt(s), oldest first"),
        "{}",
        d.stdout
    );
    for attempt in [1, 2] {
        let heading = format!("diagnosis of attempt {attempt}:\n");
        let at = d
            .stdout
            .find(&heading)
            .unwrap_or_else(|| panic!("{}", d.stdout));
        let section = &d.stdout[at + heading.len()..];
        let section = &section[..section.find("\nattempt ").unwrap_or(section.len())];
        assert!(
            section.contains("rank 0 exited") && section.contains("signal SIGKILL"),
            "attempt {attempt}: {section}"
        );
    }
    let mut doctor = braid();
    doctor.arg("doctor").arg(logs.path()).arg("--json");
    let d = run(doctor, Duration::from_secs(20));
    assert_eq!(d.code, Some(0), "{d:?}");
    let doc: serde_json::Value = serde_json::from_str(&d.stdout).unwrap();
    let attempts = doc["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 2, "{doc}");
    assert_eq!(attempts[0]["attempt"], 0, "{doc}");
    assert_eq!(attempts[1]["attempt"], 1, "{doc}");
    assert_eq!(doc["attempt"], 1, "{doc}");
    for a in attempts {
        assert_eq!(a["records"].as_array().unwrap().len(), 2, "{doc}");
    }
    drop(marked);
}
