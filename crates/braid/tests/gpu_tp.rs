//! Tensor parallelism on GPUs through the real binary (NCCL in the
//! passes): `--tp 2` and `--tp 4`, with sequence parallelism and without,
//! reach one GPU's parameters after 10 f32 steps, and `--tp 2` x data
//! parallel 2 on 4 GPUs data parallelism over 4, within the GPU
//! tolerance; sequence parallelism shrinks the activations by the group's
//! size; in bf16 `--tp 2` tracks one GPU. Without the GPUs a test says
//! "skipped".

mod common;

use common::gpu::{train_gpu, GPU_TOLERANCE};
use common::{gpus, max_diff, TempDir};
use std::io::Write;

/// 4 heads and a vocabulary of 259 (uneven over 2 ranks), on the byte
/// corpus.
const MODEL: [&str; 6] = [
    "--model",
    "L2-H4-C64-V259-T32",
    "--tokenizer",
    "bytes",
    "--precision",
    "f32",
];

fn args<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    let mut a: Vec<&str> = MODEL.to_vec();
    a.extend(["--steps", "10"]);
    a.extend(extra);
    a
}

/// `--tp 2` (and `--tp 4` where there are 4 GPUs), with sequence
/// parallelism and without, against one GPU after 10 f32 steps.
#[test]
fn gpu_tp_matches_one_gpu_with_and_without_sp() {
    if gpus(2).is_none() {
        return;
    }
    let dir = TempDir::new("gpu-tp");
    let (one, _) = train_gpu(&dir, "one", &args(&["--batch", "8"]));
    let sizes: &[&str] = match gpus(4) {
        Some(_) => &["2", "4"],
        None => &["2"],
    };
    for &n in sizes {
        for sp in ["--sp", "--no-sp"] {
            let (tp, doc) = train_gpu(
                &dir,
                &format!("tp{n}{sp}"),
                &args(&["--batch", "8", "--tp", n, sp, "--nproc-per-node", n]),
            );
            let d = max_diff(&one, &tp);
            let _ = writeln!(
                std::io::stderr(),
                "f32, --tp {n} {sp} vs one GPU after 10 steps: max |diff| {d:e}; tensor traffic {} B \
                 per step",
                doc["summary"]["tensor_payload_bytes_per_step"]
            );
            assert!(
                d <= GPU_TOLERANCE,
                "--tp {n} {sp} differs from one GPU by {d}"
            );
        }
    }
}

/// Sequence parallelism's point: the activations a rank holds. The
/// model's buffers (activations and the passes' scratch, by the
/// allocator's counters) under `--tp N --sp` are within 10 % of one
/// GPU's over N; without sequence parallelism the residual stream and
/// the LayerNorms stay whole on every rank.
#[test]
fn gpu_tp_sequence_parallel_activations_shrink_by_n() {
    if gpus(2).is_none() {
        return;
    }
    let dir = TempDir::new("gpu-tp-memory");
    let shape = [
        "--model",
        "L4-H8-C256-V259-T128",
        "--tokenizer",
        "bytes",
        "--precision",
        "f32",
        "--batch",
        "16",
        "--steps",
        "2",
    ];
    let bytes = |name: &str, extra: &[&str]| -> f64 {
        let a: Vec<&str> = shape.iter().chain(extra).copied().collect();
        let (_, doc) = train_gpu(&dir, name, &a);
        doc["model_buffer_bytes"]
            .as_f64()
            .expect("model_buffer_bytes in the run's JSON")
    };
    let one = bytes("one", &[]);
    let sizes: &[usize] = match gpus(4) {
        Some(_) => &[2, 4],
        None => &[2],
    };
    for &n in sizes {
        let ns = n.to_string();
        let group = ["--tp", &ns, "--nproc-per-node", &ns];
        let with: Vec<&str> = group.iter().copied().chain(["--sp"]).collect();
        let without: Vec<&str> = group.iter().copied().chain(["--no-sp"]).collect();
        let (sp, no_sp) = (
            bytes(&format!("sp{n}"), &with),
            bytes(&format!("nosp{n}"), &without),
        );
        let share = one / n as f64;
        let _ = writeln!(
            std::io::stderr(),
            "activations and pass buffers per GPU: one GPU {:.2} MB; --tp {n}: with sequence \
             parallelism {:.2} MB ({:.3} of one GPU's / {n}), without {:.2} MB ({:.3})",
            one / 1e6,
            sp / 1e6,
            sp / share,
            no_sp / 1e6,
            no_sp / share
        );
        assert!(
            sp <= 1.10 * share,
            "--tp {n} --sp holds {sp} bytes, one GPU's / {n} is {share}"
        );
        assert!(
            sp < no_sp,
            "sequence parallelism did not shrink the activations"
        );
    }
}

#[test]
fn gpu_tp_2_times_data_2_and_zero_3_match_data_parallel_over_4() {
    if gpus(4).is_none() {
        return;
    }
    let dir = TempDir::new("gpu-tp-dp");
    let common = ["--nproc-per-node", "4", "--global-batch", "16"];
    let (dp, _) = train_gpu(&dir, "dp4", &args(&common));
    for sp in ["--sp", "--no-sp"] {
        let with_tp: Vec<&str> = common.iter().copied().chain(["--tp", "2", sp]).collect();
        let (tp, _) = train_gpu(&dir, &format!("tp2-dp2{sp}"), &args(&with_tp));
        let d = max_diff(&dp, &tp);
        let _ = writeln!(
            std::io::stderr(),
            "f32, --tp 2 {sp} x data 2 vs data parallel over 4 GPUs: max |diff| {d:e}"
        );
        assert!(d <= GPU_TOLERANCE, "--tp 2 {sp} x data 2 differs by {d}");
    }
    // ZeRO-3 over the data dimension: each tensor rank's share sharded
    // over its data group.
    let zero: Vec<&str> = common
        .iter()
        .copied()
        .chain(["--tp", "2", "--zero", "3"])
        .collect();
    let (z3, _) = train_gpu(&dir, "tp2-zero3", &args(&zero));
    let d = max_diff(&dp, &z3);
    let _ = writeln!(
        std::io::stderr(),
        "f32, --tp 2 x ZeRO-3 over data 2 vs data parallel over 4 GPUs: max |diff| {d:e}"
    );
    assert!(d <= GPU_TOLERANCE, "--tp 2 x ZeRO-3 2 differs by {d}");
}

/// The bf16 tests' model (4 layers, 4 heads, on the byte corpus) and batch.
const BF16_MODEL: [&str; 6] = [
    "--model",
    "L4-H4-C128-V259-T64",
    "--tokenizer",
    "bytes",
    "--batch",
    "8",
];

/// bf16 (the mixed engine: fused attention, cuBLASLt epilogues, its
/// all-reduces of bf16 input gradients): `--tp 2` tracks one GPU over 60
/// steps (mean loss of every 20-step window within 0.02), with and
/// without activation checkpointing (whose recomputation sums the
/// attention's output projection over the group again) — with the
/// row-split products summed in bf16 (the default: Megatron's sums, the
/// residual and bias added by every rank after them), whole and in 4 row
/// blocks beside the products, and in f32 (`BRAID_TP_SUMS=f32`).
#[test]
fn gpu_tp_2_bf16_tracks_one_gpu() {
    if gpus(2).is_none() {
        return;
    }
    let dir = TempDir::new("gpu-tp-bf16");
    let base: Vec<&str> = BF16_MODEL
        .iter()
        .copied()
        .chain(["--steps", "60"])
        .collect();
    let sums: [(&str, &[(&str, &str)]); 3] = [
        ("f32 sums", &[("BRAID_TP_SUMS", "f32")]),
        ("bf16 sums", &[]),
        ("bf16 sums in 4 blocks", &[("BRAID_TP_OVERLAP", "4")]),
    ];
    for ckpt in [false, true] {
        let extra: &[&str] = if ckpt { &["--checkpointing"] } else { &[] };
        let one: Vec<&str> = base.iter().chain(extra).copied().collect();
        let (_, a) = train_gpu(&dir, &format!("one-{ckpt}"), &one);
        let tp: Vec<&str> = one
            .iter()
            .copied()
            .chain(["--tp", "2", "--no-sp", "--nproc-per-node", "2"])
            .collect();
        for (i, (how, env)) in sums.iter().enumerate() {
            let name = format!("tp2-{ckpt}-{i}");
            let (_, b) = common::gpu::train_gpu_env(&dir, &name, &tp, env);
            let (la, lb) = (common::step_losses(&a), common::step_losses(&b));
            let _ = writeln!(
                std::io::stderr(),
                "bf16, {how}, checkpointing {ckpt}: one GPU {:.4} -> {:.4}, --tp 2 {:.4} -> {:.4}",
                la[0],
                la[59],
                lb[0],
                lb[59]
            );
            common::gpu::assert_windows_track(&a, &b, 0.02, ("one GPU", "--tp 2"));
        }
    }
}

/// Sequence parallelism in bf16 (each rank's rows of the residual stream
/// and the LayerNorms; bf16 all-gathers before the products that read
/// every row, reduce-scatters after the row-split products and the
/// column-split input gradients; the LayerNorms' parameter gradients
/// summed over the group): `--tp 2 --sp` (and `--tp 4` on 4 GPUs) tracks
/// one GPU over 60 steps (mean loss of every 20-step window within 0.02),
/// with and without checkpointing, and with two layers deferring their
/// weight gradients; and it holds fewer bytes than `--no-sp`.
#[test]
fn gpu_tp_bf16_sequence_parallel_tracks_one_gpu() {
    if gpus(2).is_none() {
        return;
    }
    let dir = TempDir::new("gpu-tp-bf16-sp");
    let base: Vec<&str> = BF16_MODEL
        .iter()
        .copied()
        .chain(["--steps", "60"])
        .collect();
    let sizes: &[&str] = match gpus(4) {
        Some(_) => &["2", "4"],
        None => &["2"],
    };
    for ckpt in [false, true] {
        let extra: &[&str] = if ckpt { &["--checkpointing"] } else { &[] };
        let one: Vec<&str> = base.iter().chain(extra).copied().collect();
        let (_, a) = train_gpu(&dir, &format!("one-{ckpt}"), &one);
        for &n in sizes {
            for defer in ["0", "2"] {
                let tp: Vec<&str> = one
                    .iter()
                    .copied()
                    .chain(["--tp", n, "--sp", "--nproc-per-node", n])
                    .chain(["--defer-layers", defer])
                    .collect();
                let name = format!("tp{n}-sp-{ckpt}-{defer}");
                let (_, b) = train_gpu(&dir, &name, &tp);
                let (la, lb) = (common::step_losses(&a), common::step_losses(&b));
                let _ = writeln!(
                    std::io::stderr(),
                    "bf16 --tp {n} --sp, checkpointing {ckpt}, {defer} layers deferred: one GPU \
                     {:.4} -> {:.4}, --tp {n} {:.4} -> {:.4}; model buffers {:.2} MB",
                    la[0],
                    la[59],
                    lb[0],
                    lb[59],
                    b["model_buffer_bytes"].as_f64().unwrap_or(0.0) / 1e6
                );
                common::gpu::assert_windows_track(&a, &b, 0.02, ("one GPU", "--tp --sp"));
            }
        }
    }
    // What sequence parallelism is for: fewer bytes per rank.
    let bytes = |name: &str, sp: &str| -> f64 {
        let a: Vec<&str> = BF16_MODEL
            .iter()
            .copied()
            .chain(["--steps", "2", "--tp", "2", sp, "--nproc-per-node", "2"])
            .collect();
        let (_, doc) = train_gpu(&dir, name, &a);
        doc["model_buffer_bytes"]
            .as_f64()
            .expect("model_buffer_bytes in the run's JSON")
    };
    let (sp, no_sp) = (bytes("mem-sp", "--sp"), bytes("mem-nosp", "--no-sp"));
    let _ = writeln!(
        std::io::stderr(),
        "bf16 --tp 2 model buffers per GPU: with sequence parallelism {:.2} MB, without {:.2} MB",
        sp / 1e6,
        no_sp / 1e6
    );
    assert!(
        sp < no_sp,
        "sequence parallelism did not shrink the bf16 buffers"
    );
}

/// bf16 sequence parallelism composed with data parallelism: `--tp 2
/// --sp` × data 2 on 4 GPUs, plain and under ZeRO-3, tracks data
/// parallelism over 2 GPUs at the same global batch over 60 steps.
#[test]
fn gpu_tp_bf16_sequence_parallel_times_data_tracks_data_parallel() {
    if gpus(4).is_none() {
        return;
    }
    let dir = TempDir::new("gpu-tp-bf16-sp-dp");
    let base: Vec<&str> = BF16_MODEL
        .iter()
        .copied()
        .chain(["--steps", "60"])
        .collect();
    let dp: Vec<&str> = base
        .iter()
        .copied()
        .chain(["--nproc-per-node", "2"])
        .collect();
    let (_, a) = train_gpu(&dir, "dp2", &dp);
    for zero in [&[][..], &["--zero", "3"]] {
        let tp: Vec<&str> = base
            .iter()
            .copied()
            .chain(["--tp", "2", "--sp", "--nproc-per-node", "4"])
            .chain(zero.iter().copied())
            .collect();
        let (_, b) = train_gpu(&dir, &format!("tp2-sp-dp2-{}", zero.len()), &tp);
        let (la, lb) = (common::step_losses(&a), common::step_losses(&b));
        let _ = writeln!(
            std::io::stderr(),
            "bf16 --tp 2 --sp x data 2 {zero:?}: data parallel {:.4} -> {:.4}, with --tp {:.4} -> {:.4}",
            la[0],
            la[59],
            lb[0],
            lb[59]
        );
        common::gpu::assert_windows_track(&a, &b, 0.02, ("data parallel", "--tp 2 --sp x data 2"));
    }
}

/// The input gradients' sums over the tensor group beside the weight
/// gradients (`BRAID_TP_GRAD_OVERLAP=on`: the LayerNorm's output
/// recomputed for the weight gradient while the sum runs) add the same
/// numbers in the same order as the sums first: `--tp 2` bf16, 10 steps,
/// with and without checkpointing, the same parameters and losses bit for
/// bit.
#[test]
fn gpu_tp_2_grad_sums_beside_weight_grads_change_no_bits() {
    if gpus(2).is_none() {
        return;
    }
    let dir = TempDir::new("gpu-tp-grad-beside");
    let base: Vec<&str> = BF16_MODEL
        .iter()
        .copied()
        .chain([
            "--steps",
            "10",
            "--tp",
            "2",
            "--no-sp",
            "--nproc-per-node",
            "2",
        ])
        .collect();
    for ckpt in [false, true] {
        let extra: &[&str] = if ckpt { &["--checkpointing"] } else { &[] };
        let args: Vec<&str> = base.iter().chain(extra).copied().collect();
        let (a, da) = common::gpu::train_gpu_env(&dir, &format!("first-{ckpt}"), &args, &[]);
        let (b, db) = common::gpu::train_gpu_env(
            &dir,
            &format!("beside-{ckpt}"),
            &args,
            &[("BRAID_TP_GRAD_OVERLAP", "on")],
        );
        let differ = a
            .iter()
            .zip(&b)
            .filter(|(x, y)| x.to_bits() != y.to_bits())
            .count();
        let _ = writeln!(
            std::io::stderr(),
            "bf16 --tp 2, checkpointing {ckpt}: {differ} of {} parameters differ with the sums beside",
            a.len()
        );
        assert_eq!(differ, 0, "checkpointing {ckpt}: the parameters changed");
        assert_eq!(
            common::step_losses(&da),
            common::step_losses(&db),
            "checkpointing {ckpt}"
        );
    }
}

/// The row-split products in row blocks whose sums over the tensor group
/// run beside the next block's product (`BRAID_TP_OVERLAP=4`) train as the
/// whole products do: `--tp 2` bf16, with and without checkpointing, 10
/// steps' losses within the bf16 tolerance of the unblocked run's (the
/// same numbers added; NCCL may add a block's in another order).
#[test]
fn gpu_tp_2_bf16_overlapped_sums_match() {
    if gpus(2).is_none() {
        return;
    }
    let dir = TempDir::new("gpu-tp-overlap");
    let base: Vec<&str> = BF16_MODEL
        .iter()
        .copied()
        .chain([
            "--steps",
            "10",
            "--tp",
            "2",
            "--no-sp",
            "--nproc-per-node",
            "2",
        ])
        .collect();
    for ckpt in [false, true] {
        let extra: &[&str] = if ckpt { &["--checkpointing"] } else { &[] };
        let args: Vec<&str> = base.iter().chain(extra).copied().collect();
        let (_, a) = train_gpu(&dir, &format!("whole-{ckpt}"), &args);
        let (_, b) = common::gpu::train_gpu_env(
            &dir,
            &format!("blocks-{ckpt}"),
            &args,
            &[("BRAID_TP_OVERLAP", "4")],
        );
        let (la, lb) = (common::step_losses(&a), common::step_losses(&b));
        let worst = la
            .iter()
            .zip(&lb)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f64::max);
        let _ = writeln!(
            std::io::stderr(),
            "bf16, checkpointing {ckpt}: whole {:.4} -> {:.4}, 4 blocks {:.4} -> {:.4}, worst step {worst:.2e}",
            la[0],
            la[9],
            lb[0],
            lb[9]
        );
        assert!(
            worst < 5e-3,
            "checkpointing {ckpt}: losses differ by {worst}"
        );
    }
}
