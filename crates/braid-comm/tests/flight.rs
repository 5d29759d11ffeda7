//! The flight recorder inside one process (ranks as threads): what it
//! records for blocking, queued and split operations, and the timeout
//! error that names a rank which is alive but not calling.

mod common;

use braid_comm::{BackendKind, ReduceOp};
use braid_core::flight::OpState;
use common::{run_world, WorldSpec};
use std::time::{Duration, Instant};

#[test]
fn operations_are_recorded_with_sequence_state_shape_and_communicator() {
    let records = run_world(WorldSpec::new(2, BackendKind::Shm), |c| {
        let mut x = vec![1.0f32; 1000];
        c.all_reduce(&mut x, ReduceOp::Sum).unwrap();
        let mut y = vec![0u8; 7];
        let mut z = vec![0i64; 3];
        c.scope(|s| {
            let a = s.broadcast(&mut y, 0);
            let b = s.all_reduce(&mut z, ReduceOp::Max);
            a.wait().and(b.wait())
        })
        .unwrap()
        .unwrap();
        let split = c.split(Some(0), -(c.rank() as i64)).unwrap().unwrap();
        split.barrier().unwrap();
        c.flight_record()
    });
    for (rank, rec) in records.iter().enumerate() {
        assert_eq!(rec.rank, rank);
        assert_eq!(rec.world_size, 2);
        let world: Vec<_> = rec.records.iter().filter(|r| r.comm == "world").collect();
        let described: Vec<String> = world.iter().map(|r| r.describe()).collect();
        assert_eq!(
            described[..3],
            [
                "all_reduce #1 (1000 x f32)",
                "broadcast #2 (7 x u8)",
                "all_reduce #3 (3 x i64)"
            ],
            "rank {rank}: {described:?}"
        );
        // The split's member exchange is an all-gather on the world.
        assert_eq!(world[3].op, "all_gather", "rank {rank}");
        assert!(world.iter().all(|r| r.state == OpState::Completed));
        assert!(world
            .iter()
            .all(|r| r.started_us.is_some() && r.ended_us >= r.started_us));
        // The split (ordered by descending world rank) has its own numbers.
        let split = rec.comms.iter().find(|c| c.id == "world.s0c0").unwrap();
        assert_eq!(split.rank, 1 - rank);
        assert_eq!(split.world_ranks, vec![1, 0]);
        assert_eq!(split.last_completed.as_ref().unwrap().label(), "barrier #1");
        assert!(rec
            .records
            .iter()
            .any(|r| r.comm == "world.s0c0" && r.op == "barrier" && r.seq == Some(1)));
    }
}

#[test]
fn a_timeout_names_the_rank_that_is_alive_but_not_calling() {
    let spec = WorldSpec {
        timeout: Duration::from_secs(1),
        ..WorldSpec::new(3, BackendKind::Shm)
    };
    let results = run_world(spec, |c| {
        let mut x = vec![1.0f32; 100];
        c.all_reduce(&mut x, ReduceOp::Sum).unwrap();
        c.all_reduce(&mut x, ReduceOp::Sum).unwrap();
        if c.rank() == 2 {
            // Alive (its heartbeats go on) but busy elsewhere.
            std::thread::sleep(Duration::from_millis(2500));
            return None;
        }
        let start = Instant::now();
        let err = c.all_reduce(&mut x, ReduceOp::Sum).unwrap_err();
        Some((err.to_string(), start.elapsed(), c.flight_record()))
    });
    for (r, (msg, waited, rec)) in results.into_iter().flatten().enumerate() {
        assert!(waited < Duration::from_secs(3), "rank {r} took {waited:?}");
        assert!(
            msg.contains("all_reduce #3 timed out after"),
            "rank {r}: {msg}"
        );
        assert!(
            msg.contains("rank 2 is behind, after all_reduce #2, and has not reached all_reduce #3 (alive: heartbeat"),
            "rank {r}: {msg}"
        );
        let current = rec.comms[0].current.as_ref().unwrap();
        assert_eq!(current.label(), "all_reduce #3");
        assert_eq!(current.state, OpState::Failed);
    }
}

#[test]
fn a_timeout_reports_ranks_that_called_different_operations() {
    let spec = WorldSpec {
        timeout: Duration::from_secs(1),
        ..WorldSpec::new(2, BackendKind::Shm)
    };
    let errors = run_world(spec, |c| {
        let mut x = vec![1.0f32; 64];
        c.all_reduce(&mut x, ReduceOp::Sum).unwrap();
        // Rank 0 reduces, rank 1 waits for a message: neither can finish.
        let e = if c.rank() == 0 {
            c.all_reduce(&mut x, ReduceOp::Sum).unwrap_err()
        } else {
            c.recv(&mut x[..8], 0, 5).unwrap_err()
        };
        e.to_string()
    });
    for (r, e) in errors.iter().enumerate() {
        assert!(
            e.contains(
                "ranks called different operations at #2: all_reduce (64 x f32) on rank 0; recv (8 x f32) on rank 1"
            ),
            "rank {r}: {e}"
        );
    }
}

#[test]
fn in_a_large_communicator_one_rank_diagnoses_for_all() {
    // Above DIAGNOSE_EVERYWHERE_UP_TO ranks, one rank reads the
    // heartbeats; the others report its diagnosis through the abort.
    let n = braid_comm::flight::DIAGNOSE_EVERYWHERE_UP_TO + 2;
    let spec = WorldSpec {
        timeout: Duration::from_secs(2),
        ..WorldSpec::new(n, BackendKind::Shm)
    };
    let last = n - 1;
    let errors = run_world(spec, |c| {
        let mut x = vec![1.0f32; 4];
        c.barrier().unwrap();
        if c.rank() == last {
            std::thread::sleep(Duration::from_millis(4000));
            return None;
        }
        Some(c.all_reduce(&mut x, ReduceOp::Sum).unwrap_err().to_string())
    });
    let errors: Vec<String> = errors.into_iter().flatten().collect();
    let want =
        format!("rank {last} is behind, after barrier #1, and has not reached all_reduce #2");
    let diagnosed = errors.iter().filter(|e| e.contains(&want)).count();
    assert_eq!(diagnosed, errors.len(), "{errors:#?}");
    // One rank timed out with the diagnosis; the others were aborted with it.
    let first = errors
        .iter()
        .filter(|e| !e.contains("communicator aborted"))
        .count();
    assert_eq!(first, 1, "{errors:#?}");
}
