//! Every strategy of braid-train against one process: the training loop
//! (`trainer::train`) runs the CPU engine (`CpuGpt`, f32, a 4-layer GPT of
//! 32 channels) on ranks that are threads of this process, over the host
//! collectives (`HostCollective`, TCP), for 6 AdamW steps with clipping;
//! every run's whole model, put together from its ranks, must match the
//! one-process run (`Single`) on the same global batch within 5e-5 per
//! parameter (absolute; the reference moves some parameter by at least
//! 100× that) and within 1e-4 of the reference's movement as a whole
//! (Euclidean norms), and every rank's loss and gradient norm at each step
//! within 1e-6 relative. Tolerances: `common::PARAM_TOL`,
//! `common::PARAM_L2_TOL`, `common::STEP_TOL`.

mod common;

use braid_comm::BackendKind;
use common::{assert_matches, check, single, Over, Spec};

/// The comparison itself: accumulating 2 micro-batches of 2 rows in one
/// process matches one batch of 4 (the loop's `accumulate` path), and a
/// run on half the batch does not (the check can fail).
#[test]
fn one_process_accumulation_matches_and_a_different_batch_is_caught() {
    let want = single(4, 1);
    assert_matches("accumulated 2 x 2", &[single(2, 2)], &want);
    let half = single(2, 1);
    let caught = std::panic::catch_unwind(|| assert_matches("batch 2", &[half], &want));
    assert!(
        caught.is_err(),
        "a run on half the batch passed as the same run"
    );
}

/// Data parallelism (`DataParallel`, several buckets overlapping the
/// backward pass) over 2 and 4 ranks, and over 2 with 2 micro-batches per
/// step (only the last communicates).
#[test]
fn data_parallel_matches_one_process() {
    check("ddp 2 x 2 rows", Spec::data(2, Over::Ddp, 2));
    check("ddp 4 x 1 row", Spec::data(4, Over::Ddp, 1));
    check(
        "ddp 2 x 1 row x 2 micro-batches",
        Spec {
            accum: 2,
            ..Spec::data(2, Over::Ddp, 1)
        },
    );
}

/// ZeRO-1 (`Zero`): the optimizer sharded over 2 ranks, gradients
/// reduce-scattered bucket by bucket, parameters all-gathered.
#[test]
fn zero_1_matches_one_process() {
    check("zero-1 over 2", Spec::data(2, Over::Zero1, 2));
}

/// ZeRO-2 (`Zero3::stage_2`): gradients written block by block and
/// reduce-scattered into the shard, the optimizer sharded.
#[test]
fn zero_2_matches_one_process() {
    check("zero-2 over 2", Spec::data(2, Over::Zero2, 2));
    check(
        "zero-2 over 2, 2 micro-batches",
        Spec {
            accum: 2,
            ..Spec::data(2, Over::Zero2, 1)
        },
    );
}

/// ZeRO-3 (`Zero3`, FSDP): parameters sharded too and gathered unit by
/// unit — freed after the forward pass, or kept for the backward with 2
/// micro-batches per step (each reduce-scattered), or with the engine
/// recomputing its activations — and the whole model gathered back on the
/// first rank at the end.
#[test]
fn zero_3_matches_one_process() {
    check(
        "zero-3 over 2",
        Spec::data(
            2,
            Over::Zero3 {
                reshard_after_forward: true,
            },
            2,
        ),
    );
    check(
        "zero-3 over 2, kept from forward to backward, 2 micro-batches",
        Spec {
            accum: 2,
            ..Spec::data(
                2,
                Over::Zero3 {
                    reshard_after_forward: false,
                },
                1,
            )
        },
    );
    check(
        "zero-3 over 2, activation checkpointing",
        Spec {
            checkpointing: true,
            ..Spec::data(
                2,
                Over::Zero3 {
                    reshard_after_forward: true,
                },
                2,
            )
        },
    );
}

/// Hybrid sharding (HSDP): 4 ranks in shard groups of 2, replicated
/// across the groups — ZeRO-3 and ZeRO-1.
#[test]
fn hybrid_sharding_matches_one_process() {
    let z3 = Over::Zero3 {
        reshard_after_forward: true,
    };
    for (name, over) in [
        ("hsdp zero-3 2 x 2", z3),
        ("hybrid zero-1 2 x 2", Over::Zero1),
    ] {
        check(
            name,
            Spec {
                shard_group: Some(2),
                ..Spec::data(4, over, 1)
            },
        );
    }
}

/// Tensor parallelism (`CpuGpt::tensor_parallel` under `TensorParallel`)
/// over 2 ranks with and without sequence parallelism, and 2 tensor × 2
/// data ranks under ZeRO-3 over the data dimension.
#[test]
fn tensor_parallel_matches_one_process() {
    for sequence in [true, false] {
        check(
            &format!("tp 2, sequence parallel {sequence}"),
            Spec {
                tensor: 2,
                sequence,
                ..Spec::data(1, Over::Ddp, 4)
            },
        );
    }
    check(
        "tp 2 x zero-3 over 2",
        Spec {
            tensor: 2,
            sequence: true,
            ..Spec::data(
                2,
                Over::Zero3 {
                    reshard_after_forward: true,
                },
                2,
            )
        },
    );
}

/// A pipeline of 2 ranks (`CpuStage`, 4 micro-batches of 1 row) under
/// every built-in schedule, one replica (`Single`, the stage's own
/// gradient buffer); and a split backward pass (ZB-H1) under activation
/// checkpointing, which runs whole at its input half.
#[test]
fn every_pipeline_schedule_matches_one_process() {
    for schedule in [
        "gpipe",
        "1f1b",
        "interleaved",
        "zb-h1",
        "zb-h2",
        "interleaved-zb",
    ] {
        check(&format!("pp 2, {schedule}"), pipeline(2, schedule));
    }
    check(
        "pp 2, zb-h1, activation checkpointing",
        Spec {
            checkpointing: true,
            ..pipeline(2, "zb-h1")
        },
    );
}

/// A pipeline of `stages` ranks under `schedule`: 4 micro-batches of 1
/// row, one replica.
fn pipeline(stages: usize, schedule: &'static str) -> Spec {
    Spec {
        pipe: stages,
        schedule,
        micro: 4,
        ..Spec::data(1, Over::Ddp, 4)
    }
}

/// A pipeline of 4 ranks (1F1B): the middle ranks hold neither end of
/// the tied embeddings. Over shared memory; over TCP see the next test.
#[test]
fn a_pipeline_of_4_stages_matches_one_process_over_shared_memory() {
    check(
        "pp 4 over shm",
        Spec {
            backend: BackendKind::Shm,
            ..pipeline(4, "1f1b")
        },
    );
}

/// The same over TCP, whose backend checks that every rank of a group
/// calls the same sequence of operations: the tied embeddings' gradients
/// are summed between the first and the last pipeline rank alone, point to
/// point, so that the middle ranks' numbering does not fall behind (it
/// did, when the sum was a `send_recv`, an operation of the whole group).
#[test]
fn a_pipeline_of_4_stages_matches_one_process_over_tcp() {
    check("pp 4 over tcp", pipeline(4, "1f1b"));
}

/// A pipeline of 2 under ZeRO-1, 2 and 3 over 2 data ranks (each stage's
/// optimizer state, also its gradients, also its parameters sharded over
/// the data dimension), and ZeRO-3 under the interleaved schedule.
#[test]
fn pipeline_times_zero_1_2_and_3_matches_one_process() {
    let zero3 = Over::Zero3 {
        reshard_after_forward: true,
    };
    for (name, over, schedule, micro) in [
        ("pp 2 x zero-1 over 2", Over::Zero1, "1f1b", 2),
        ("pp 2 x zero-2 over 2", Over::Zero2, "1f1b", 2),
        ("pp 2 x zero-3 over 2", zero3, "1f1b", 2),
        (
            "pp 2 interleaved x zero-3 over 2",
            zero3,
            "interleaved:2",
            4,
        ),
    ] {
        check(
            name,
            Spec {
                pipe: 2,
                micro,
                schedule,
                ..Spec::data(2, over, micro)
            },
        );
    }
}

/// The 3-D mesh with sharded data parallelism, FSDP × TP × PP: ZeRO-3 in
/// shard groups of 2 (hybrid, replicated twice) × pipeline 2 × tensor 2
/// on 16 ranks.
#[test]
fn the_3d_mesh_under_hybrid_zero_3_matches_one_process() {
    check(
        "hsdp 2x2 x pp 2 x tp 2",
        Spec {
            pipe: 2,
            tensor: 2,
            micro: 2,
            shard_group: Some(2),
            ..Spec::data(
                4,
                Over::Zero3 {
                    reshard_after_forward: true,
                },
                2,
            )
        },
    );
}

/// The 3-D mesh: data 2 × pipeline 2 × tensor 2 on 8 ranks (sequence
/// parallel tensor groups inside each stage, 1F1B, data parallelism over
/// the replicas).
#[test]
fn the_3d_mesh_matches_one_process() {
    check(
        "data 2 x pp 2 x tp 2",
        Spec {
            pipe: 2,
            tensor: 2,
            sequence: true,
            micro: 2,
            ..Spec::data(2, Over::Ddp, 2)
        },
    );
}
