//! Tests of the flight records and their diagnosis.

use super::*;

fn rec(seq: u64, op: &str, count: u64, state: OpState) -> OpRecord {
    OpRecord {
        comm: "world".into(),
        seq: Some(seq),
        op: op.into(),
        dtype: Some("f32".into()),
        count: Some(count),
        state,
        enqueued_us: seq * 10,
        started_us: Some(seq * 10),
        ended_us: (state != OpState::Started).then_some(seq * 10 + 5),
    }
}

/// Records of a rank that completed all_reduce #1..=done and is in
/// `current` (if any).
fn history(done: u64, current: Option<OpRecord>) -> Vec<OpRecord> {
    let mut v: Vec<OpRecord> = (1..=done)
        .map(|s| rec(s, "all_reduce", 1024, OpState::Completed))
        .collect();
    v.extend(current);
    v
}

fn input(rank: usize, records: Vec<OpRecord>, liveness: Liveness) -> RankInput {
    RankInput {
        rank,
        world_rank: Some(rank),
        known: liveness != Liveness::Unknown,
        records,
        liveness,
    }
}

fn alive() -> Liveness {
    Liveness::Alive {
        heartbeat_age_s: Some(0.2),
    }
}

#[test]
fn a_stopped_rank_behind_the_others_is_named_with_where_it_stopped() {
    let ranks = [
        input(
            0,
            history(41, Some(rec(42, "all_reduce", 1024, OpState::Failed))),
            alive(),
        ),
        input(
            1,
            history(41, None),
            liveness(
                Some(Duration::from_millis(19_800)),
                1000,
                ProcessState::Running,
            ),
        ),
        input(
            2,
            history(41, Some(rec(42, "all_reduce", 1024, OpState::Started))),
            alive(),
        ),
    ];
    let d = diagnose("world", 3, &ranks);
    assert_eq!(d.suspects(), vec![1]);
    assert_eq!(d.findings[0].kind, FindingKind::Stopped);
    assert_eq!(d.waiting, vec![0, 2]);
    assert_eq!(
        d.summary,
        "rank 1 stopped after all_reduce #41 and did not reach all_reduce #42 \
         (no heartbeat for 19.8 s: stopped or hung, not dead); \
         ranks 0, 2 waiting in all_reduce #42"
    );
    let text = d.render("", 8);
    assert!(
        text.contains("rank 1: stopped, after all_reduce #41"),
        "{text}"
    );
    assert!(
        text.contains("rank 0: waiting, in all_reduce #42 (failed)"),
        "{text}"
    );
}

#[test]
fn an_alive_rank_behind_is_behind_not_stopped() {
    let ranks = [
        input(
            0,
            history(3, Some(rec(4, "all_reduce", 1024, OpState::Failed))),
            alive(),
        ),
        input(1, history(2, None), alive()),
    ];
    let d = diagnose("world", 2, &ranks);
    assert_eq!(d.findings.len(), 1);
    assert_eq!(d.findings[0].kind, FindingKind::Behind);
    assert!(
        d.summary.starts_with(
            "rank 1 is behind, after joining all_reduce #3, and has not reached all_reduce #4 (alive"
        ),
        "{}",
        d.summary
    );
}

#[test]
fn a_stopped_rank_inside_the_front_operation_is_still_the_suspect() {
    let ranks = [
        input(
            0,
            history(7, Some(rec(8, "all_reduce", 1024, OpState::Failed))),
            alive(),
        ),
        input(
            1,
            history(7, Some(rec(8, "all_reduce", 1024, OpState::Started))),
            liveness(Some(Duration::from_secs(6)), 1000, ProcessState::Stopped),
        ),
    ];
    let d = diagnose("world", 2, &ranks);
    assert_eq!(d.suspects(), vec![1]);
    assert!(
        d.summary.starts_with(
            "rank 1 stopped in all_reduce #8 (no heartbeat for 6.0 s; process stopped (state T"
        ),
        "{}",
        d.summary
    );
}

#[test]
fn mismatched_operations_at_one_sequence_number_are_reported() {
    let ranks = [
        input(
            0,
            history(4, Some(rec(5, "all_reduce", 1024, OpState::Failed))),
            alive(),
        ),
        input(
            1,
            history(4, Some(rec(5, "broadcast", 8, OpState::Started))),
            alive(),
        ),
        input(
            2,
            history(4, Some(rec(5, "all_reduce", 1000, OpState::Started))),
            alive(),
        ),
    ];
    let d = diagnose("world", 3, &ranks);
    let m = d
        .findings
        .iter()
        .find(|f| f.kind == FindingKind::Mismatch)
        .expect("a mismatch");
    assert_eq!(
        m.text,
        "ranks called different operations at #5: all_reduce (1024 x f32) on rank 0; \
         broadcast (8 x f32) on rank 1; all_reduce (1000 x f32) on rank 2"
    );
    assert_eq!(m.ranks, vec![1, 2]);
    // Point-to-point pairs are not a mismatch.
    let p2p = [
        input(0, vec![rec(1, "send", 8, OpState::Started)], alive()),
        input(1, vec![rec(1, "recv", 8, OpState::Started)], alive()),
    ];
    assert!(!diagnose("world", 2, &p2p).has_problem());
}

#[test]
fn ranks_never_heard_from_are_never_arrived() {
    let ranks = [
        input(
            0,
            history(0, Some(rec(1, "barrier", 0, OpState::Failed))),
            alive(),
        ),
        input(
            2,
            history(0, Some(rec(1, "barrier", 0, OpState::Started))),
            alive(),
        ),
    ];
    let d = diagnose("world", 4, &ranks);
    let never = d
        .findings
        .iter()
        .find(|f| f.kind == FindingKind::NeverArrived)
        .expect("never arrived");
    assert_eq!(never.ranks, vec![1, 3]);
    assert!(
        never.text.starts_with("ranks 1, 3 never arrived"),
        "{}",
        never.text
    );
    assert!(
        d.summary.ends_with("ranks 0, 2 waiting in barrier #1"),
        "{}",
        d.summary
    );
}

#[test]
fn a_stale_heartbeat_is_moved_up_to_what_the_others_completed() {
    // Rank 1's last heartbeat says all_reduce #40; rank 0 completed #90
    // (which needs every rank) and waits in #91.
    let ranks = [
        input(
            0,
            history(90, Some(rec(91, "all_reduce", 1024, OpState::Failed))),
            alive(),
        ),
        input(
            1,
            history(39, Some(rec(40, "all_reduce", 1024, OpState::Started))),
            liveness(Some(Duration::from_secs(5)), 1000, ProcessState::Stopped),
        ),
        // Rank 2 left nothing at all, but must have joined #90 too.
        input(2, vec![], Liveness::Unknown),
    ];
    let d = diagnose("world", 3, &ranks);
    assert_eq!(d.suspects(), vec![1, 2]);
    assert!(
        d.summary.starts_with(
            "rank 1 stopped after joining all_reduce #90 and did not reach all_reduce #91 (no heartbeat for 5.0 s; process stopped"
        ),
        "{}",
        d.summary
    );
    assert!(
        d.summary.contains(
            "rank 2 is behind, after joining all_reduce #90, and has not reached all_reduce #91 (it left no heartbeat or flight record)"
        ),
        "{}",
        d.summary
    );
    // A broadcast's root may finish alone: nothing is inferred from it.
    let rooted = [
        input(0, vec![rec(1, "broadcast", 8, OpState::Completed)], alive()),
        input(1, vec![], alive()),
    ];
    let d = diagnose("world", 2, &rooted);
    assert!(
        d.summary
            .starts_with("rank 1 is behind, before its first operation"),
        "{}",
        d.summary
    );
}

#[test]
fn a_rank_behind_on_a_gpu_is_short_of_the_first_operation_it_misses() {
    let queued = |seq| OpRecord {
        comm: "world/gpu0".into(),
        ..rec(seq, "all_reduce", 1024, OpState::Enqueued)
    };
    // Rank 0 queued #4..#9 and waits (failed) in #5; rank 1 queued
    // only #4 when it stopped.
    let mut ahead = history(3, None);
    ahead.extend((4..=9).map(queued));
    ahead.push(OpRecord {
        comm: "world/gpu0".into(),
        ..rec(5, "all_reduce", 1024, OpState::Failed)
    });
    let mut behind = history(3, None);
    behind.push(queued(4));
    let ranks = [
        input(0, ahead, alive()),
        input(
            1,
            behind,
            liveness(Some(Duration::from_secs(9)), 1000, ProcessState::Stopped),
        ),
    ];
    let d = diagnose("world/gpu0", 2, &ranks);
    assert!(
        d.summary.starts_with(
            "rank 1 stopped after all_reduce #3 with all_reduce #4 queued on the GPU and did not reach all_reduce #5 ("
        ),
        "{}",
        d.summary
    );
    assert!(
        d.summary.ends_with("rank 0 waiting in all_reduce #5"),
        "{}",
        d.summary
    );
    assert_eq!(d.front.as_ref().unwrap().seq, Some(9));
}

#[test]
fn a_healthy_communicator_has_no_findings() {
    let ranks = [
        input(0, history(9, None), alive()),
        input(1, history(9, None), alive()),
    ];
    let d = diagnose("world", 2, &ranks);
    assert!(!d.has_problem());
    assert_eq!(
        d.summary,
        "every rank finished all_reduce #9 and none is inside an operation"
    );
}

#[test]
fn positions_prefer_the_failed_operation_and_queued_gpu_work() {
    let mut gpu = history(3, None);
    gpu.push(OpRecord {
        state: OpState::Enqueued,
        ..rec(4, "all_reduce", 1024, OpState::Enqueued)
    });
    gpu.push(OpRecord {
        state: OpState::Enqueued,
        ..rec(5, "all_reduce", 1024, OpState::Enqueued)
    });
    let p = Position::of(&gpu);
    assert_eq!(p.reach(), 5);
    assert_eq!(
        p.describe(),
        "after all_reduce #3 with all_reduce #5 queued on the GPU"
    );
    let mut failed = gpu.clone();
    failed.push(rec(4, "all_reduce", 1024, OpState::Failed));
    assert_eq!(
        Position::of(&failed).describe(),
        "in all_reduce #4 (failed)"
    );
}

#[test]
fn snapshots_round_trip_and_world_diagnosis_maps_splits() {
    let comm = |id: &str, rank, world_ranks: Vec<usize>, cur: Option<OpRecord>| CommInfo {
        id: id.into(),
        kind: "host".into(),
        rank,
        size: 2,
        world_ranks,
        last_completed: Some(OpRecord {
            comm: id.into(),
            ..rec(3, "all_reduce", 4, OpState::Completed)
        }),
        current: cur,
    };
    let snap = |rank, comms, records| Snapshot {
        version: FORMAT_VERSION,
        kind: SnapshotKind::Dump,
        rank,
        world_size: 2,
        pid: 1,
        host: "h".into(),
        run_id: "r".into(),
        attempt: Some(0),
        wall_us: 5,
        heartbeat_ms: 1000,
        reason: Some("test".into()),
        observed: None,
        comms,
        records,
    };
    let failed = OpRecord {
        comm: "world.s0c0".into(),
        ..rec(4, "all_reduce", 4, OpState::Failed)
    };
    // World rank 1 is comm rank 0 of the split; rank 0 is its rank 1.
    let a = snap(
        1,
        vec![
            comm("world", 1, vec![0, 1], None),
            comm("world.s0c0", 0, vec![1, 0], Some(failed.clone())),
        ],
        history(3, None),
    );
    let json = a.to_json();
    assert!(json.contains("\n  \"records\": [\n    {"), "{json}");
    assert_eq!(Snapshot::from_json(json.as_bytes()).unwrap(), a);
    let b = snap(
        0,
        vec![
            comm("world", 0, vec![0, 1], None),
            comm("world.s0c0", 1, vec![1, 0], None),
        ],
        vec![],
    );
    let ranks = [
        WorldRank {
            snapshot: Some(&b),
            liveness: Liveness::Stopped {
                heartbeat_age_s: None,
            },
        },
        WorldRank {
            snapshot: Some(&a),
            liveness: Liveness::Unknown,
        },
    ];
    let ds = diagnose_world(&ranks);
    assert_eq!(ds[0].comm, "world");
    let split = &ds[1];
    assert_eq!(split.comm, "world.s0c0");
    assert_eq!(split.suspects(), vec![1]);
    assert_eq!(split.ranks[1].world_rank, Some(0));
    assert!(
        split
            .summary
            .starts_with("rank 1 stopped after all_reduce #3 and did not reach all_reduce #4"),
        "{}",
        split.summary
    );
}

#[test]
fn rank_lists_are_compact() {
    assert_eq!(rank_list(&[5, 0, 2, 3, 4, 9]), "0, 2-5, 9");
    assert_eq!(rank_list(&[1, 2]), "1, 2");
    assert_eq!(rank_list(&[]), "");
}

#[test]
fn liveness_tells_stale_from_fresh() {
    let ms = 1000;
    assert!(matches!(
        liveness(Some(Duration::from_millis(500)), ms, ProcessState::Unknown),
        Liveness::Alive { .. }
    ));
    assert_eq!(
        liveness(Some(Duration::from_secs(5)), ms, ProcessState::Unknown).note(),
        "no heartbeat for 5.0 s: stopped, hung or dead"
    );
    assert_eq!(
        liveness(None, ms, ProcessState::Gone("signal SIGKILL".into())),
        Liveness::Exited {
            how: "signal SIGKILL".into()
        }
    );
    assert_eq!(
        local_process_state(std::process::id()),
        ProcessState::Running
    );
}

#[test]
fn dump_names_carry_the_attempt_and_both_forms_are_read_back() {
    assert_eq!(dump_file_name(1, Some(0)), "flight-rank00001-attempt1.json");
    assert_eq!(
        dump_file_name(12, Some(4)),
        "flight-rank00012-attempt5.json"
    );
    assert_eq!(dump_file_name(3, None), "flight-rank00003.json");
    for (rank, attempt) in [
        (0, None),
        (1, Some(0)),
        (123456, Some(9)),
        (7, Some(u32::MAX - 1)),
    ] {
        assert_eq!(
            parse_dump_file_name(&dump_file_name(rank, attempt)),
            Some((rank, attempt)),
            "{rank} {attempt:?}"
        );
    }
    for other in [
        ".flight-rank00001-attempt1.json.77.tmp",
        "flight-rank00001-attempt0.json",
        "flight-rank00001-attempt.json",
        "flight-rank-1.json",
        "flight-rank00001.json.bak",
        "flight-rank.json",
        "rank1.log",
    ] {
        assert_eq!(parse_dump_file_name(other), None, "{other}");
    }

    // A directory with both forms, another attempt and a cut-off dump.
    let dir = std::env::temp_dir().join(format!("braid-flight-names-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let snap = |rank, attempt| Snapshot {
        version: FORMAT_VERSION,
        kind: SnapshotKind::Dump,
        rank,
        world_size: 2,
        pid: 1,
        host: "h".into(),
        run_id: "r".into(),
        attempt,
        wall_us: 5,
        heartbeat_ms: 1000,
        reason: None,
        observed: None,
        comms: vec![],
        records: vec![],
    };
    let written = [
        snap(0, None).write_atomic(&dir).unwrap(),
        snap(0, Some(0)).write_atomic(&dir).unwrap(),
        snap(1, Some(0)).write_atomic(&dir).unwrap(),
        snap(1, Some(1)).write_atomic(&dir).unwrap(),
    ];
    assert_eq!(written[1], dir.join("flight-rank00000-attempt1.json"));
    assert_eq!(written[3], dir.join("flight-rank00001-attempt2.json"));
    std::fs::write(dir.join(".flight-rank00000-attempt2.json.9.tmp"), "{ cut").unwrap();
    let all = load_dir(&dir).unwrap();
    assert_eq!(all.snapshots.len(), 4);
    assert!(all.problems.is_empty(), "{:?}", all.problems);
    let second = load_dir_where(&dir, |_, a| a.is_none() || a == Some(1)).unwrap();
    let got: Vec<(usize, Option<u32>)> = second
        .snapshots
        .iter()
        .map(|(_, s)| (s.rank, s.attempt))
        .collect();
    assert_eq!(got, [(0, None), (1, Some(1))]);
    std::fs::remove_dir_all(&dir).unwrap();
}
