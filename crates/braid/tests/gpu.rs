//! GPU collectives through the real binary. On a machine with GPUs (the
//! device machines) these run NCCL for real; without a GPU (CI) the GPU
//! tests say "skipped: no GPU" and the tests of the no-GPU behaviour run
//! instead.

mod common;

use common::gpu::{
    assert_windows_track, figure, run_saving, token_batch, train_and_eval_losses, train_gpu,
    train_gpu_env, GPU_TOLERANCE,
};
use common::{braid, gpus, run};
use std::io::Write;
use std::time::Duration;

fn no_gpu() -> bool {
    braid_cuda::device_count().unwrap_or(0) == 0
}

#[test]
fn every_gpu_collective_is_verified_on_two_gpus() {
    if gpus(2).is_none() {
        return;
    }
    let mut cmd = braid();
    cmd.args(["verify", "--device", "cuda", "--np", "2"])
        .env("NCCL_NVLS_ENABLE", "0");
    let f = run(cmd, Duration::from_secs(120));
    assert_eq!(f.code, Some(0), "{f:?}");
    assert!(f.stdout.contains("every GPU collective verified"), "{f:?}");
}

#[test]
fn gpu_bench_checks_every_element_with_graphs() {
    if gpus(2).is_none() {
        return;
    }
    let mut cmd = braid();
    cmd.args([
        "bench",
        "all_reduce,all_gather",
        "--device",
        "cuda",
        "--np",
        "2",
        "--graph",
        "--check",
        "-b",
        "1K",
        "-e",
        "1M",
        "-f",
        "32",
        "-n",
        "3",
    ])
    .env("NCCL_NVLS_ENABLE", "0");
    let f = run(cmd, Duration::from_secs(120));
    assert_eq!(f.code, Some(0), "{f:?}");
    assert!(f.stdout.contains("# Out of bounds values : 0 OK"), "{f:?}");
}

#[test]
fn without_a_gpu_the_gpu_path_fails_with_one_clear_message() {
    if !no_gpu() {
        let _ = writeln!(std::io::stderr(), "skipped: this machine has a GPU");
        return;
    }
    for args in [
        &["bench", "all_reduce", "--device", "cuda", "--np", "2"][..],
        &["verify", "--device", "cuda", "--np", "2"][..],
    ] {
        let mut cmd = braid();
        cmd.args(args);
        let f = run(cmd, Duration::from_secs(60));
        assert_ne!(f.code, Some(0), "{args:?} succeeded without a GPU: {f:?}");
        let all = format!("{}{}", f.stdout, f.stderr);
        assert!(
            all.contains("--device cuda: no GPU to use here") && all.contains("--device cpu"),
            "{args:?}: no clear message:\n{all}"
        );
        assert!(!all.contains("[rank"), "{args:?}: said by a worker:\n{all}");
    }
    // The CPU backends keep working in the same binary.
    let mut cmd = braid();
    cmd.args(["bench", "all_reduce", "--np", "2", "-e", "1K", "--check"]);
    let f = run(cmd, Duration::from_secs(60));
    assert_eq!(f.code, Some(0), "{f:?}");
}

/// The fused attention's measuring knob, given a bad value, is refused
/// once before any worker starts (with or without a GPU), naming the value.
#[test]
fn a_bad_attention_kernel_knob_is_refused_before_any_worker_starts() {
    let mut cmd = braid();
    cmd.args([
        "train",
        "--device",
        "cuda",
        "--nproc-per-node",
        "2",
        "--steps",
        "1",
    ])
    .env("BRAID_FLASH128_BLOCKS", "2,2");
    let f = run(cmd, Duration::from_secs(60));
    assert_eq!(f.code, Some(2), "{f:?}");
    assert!(
        f.stderr
            .contains("BRAID_FLASH128_BLOCKS=2,2: expected three"),
        "{}",
        f.stderr
    );
    assert!(
        !f.stderr.contains("[rank"),
        "said by a worker: {}",
        f.stderr
    );
}

#[test]
fn gpu_flags_are_rejected_on_the_cpu_path() {
    let mut cmd = braid();
    cmd.args(["bench", "all_reduce", "--graph", "--np", "2"]);
    let f = run(cmd, Duration::from_secs(30));
    assert_ne!(f.code, Some(0));
    assert!(f.stderr.contains("--device cuda"), "{f:?}");
    let mut cmd = braid();
    cmd.args(["bench", "all_reduce", "--device", "tpu"]);
    let f = run(cmd, Duration::from_secs(30));
    assert_ne!(f.code, Some(0));
    assert!(f.stderr.contains("expected cpu or cuda"), "{f:?}");
    // A GPU memory budget: GPU runs only (`--device` chooses the GPU by
    // default where there is one), positive.
    for (extra, says) in [
        (
            &["--gpu-memory", "40", "--device", "cpu"][..],
            "a budget for GPU memory",
        ),
        (
            &["--gpu-memory=-3", "--device", "cuda"][..],
            "expected a positive number",
        ),
    ] {
        let mut cmd = braid();
        cmd.args(["train", "--steps", "1"]).args(extra);
        let f = run(cmd, Duration::from_secs(30));
        assert_ne!(f.code, Some(0), "{extra:?}");
        assert!(f.stderr.contains(says), "{extra:?}: {f:?}");
    }
}

#[test]
fn missing_nccl_names_what_was_tried_and_the_override() {
    match braid_cuda::nccl::version() {
        Ok((v, path)) => {
            let _ = writeln!(std::io::stderr(), "skipped: NCCL {v} loads here ({path})");
        }
        Err(e) => {
            let msg = e.to_string();
            assert!(msg.contains("NCCL library was not found"), "{msg}");
            assert!(msg.contains("BRAID_NCCL_LIB"), "{msg}");
            assert!(msg.contains("libnccl.so.2"), "{msg}");
        }
    }
}

#[test]
fn kernel_sources_compile_to_ptx_where_nvrtc_exists() {
    if let Err(e) = braid_cuda::nvrtc::version() {
        let _ = writeln!(std::io::stderr(), "skipped: kernel PTX check ({e})");
        return;
    }
    let dir = common::TempDir::new("ptx");
    let mut cmd = braid();
    cmd.args(["kernels", "--ptx", "compute_90"])
        .env("BRAID_KERNEL_CACHE", dir.path());
    let f = run(cmd, Duration::from_secs(120));
    assert_eq!(f.code, Some(0), "{f:?}");
    assert!(f.stdout.contains("every kernel compiles"), "{}", f.stdout);
}

/// Set in the child process of the NCCL-initialisation test below.
const NCCL_INIT_CHILD: &str = "BRAID_TEST_NCCL_INIT_CHILD";

/// The body of `nccl_init_without_its_peer_fails_in_time`, run in a child
/// process: NCCL's blocking initialisation cannot be interrupted, so the
/// abandoned init threads stay behind and the child leaves with `_exit`.
fn nccl_init_child() {
    use braid_cuda::nccl::{unique_id, NcclComm};
    let dev = braid_cuda::Device::open(0).expect("GPU 0");
    let report = |what: &str, r: braid_cuda::Result<Vec<NcclComm>>, t: std::time::Instant| {
        let text = match r {
            Ok(_) => "joined".to_string(),
            Err(e) => e.to_string(),
        };
        println!("{what} after {:.1}s: {text}", t.elapsed().as_secs_f64());
    };
    // Rank 0 of 2; rank 1 never comes.
    let id = unique_id().expect("NCCL loads");
    let t = std::time::Instant::now();
    let r = NcclComm::init_ranks_bounded(
        std::slice::from_ref(&dev),
        2,
        &id,
        0,
        Duration::from_secs(2),
        || None,
    );
    report("timeout", r, t);
    // The same, given up as soon as the caller learns of a dead peer.
    let id = unique_id().expect("NCCL loads");
    let t = std::time::Instant::now();
    let r = NcclComm::init_ranks_bounded(&[dev], 2, &id, 0, Duration::from_secs(60), || {
        Some("rank 1 (pid 4242) died".into())
    });
    report("abandon", r, t);
    let _ = std::io::stdout().flush();
    // SAFETY: ends this child process at once, skipping exit handlers that
    // could wait on the abandoned NCCL threads.
    unsafe { libc::_exit(0) };
}

#[test]
fn nccl_init_without_its_peer_fails_in_time() {
    if std::env::var_os(NCCL_INIT_CHILD).is_some() {
        nccl_init_child();
        return;
    }
    if gpus(1).is_none() {
        return;
    }
    let mut cmd = std::process::Command::new(std::env::current_exe().expect("test binary"));
    cmd.args([
        "--exact",
        "nccl_init_without_its_peer_fails_in_time",
        "--nocapture",
    ])
    .env(NCCL_INIT_CHILD, "1")
    .env("NCCL_NVLS_ENABLE", "0");
    let f = run(cmd, Duration::from_secs(60));
    let line = |tag: &str| {
        f.stdout
            .lines()
            .find(|l| l.starts_with(tag))
            .unwrap_or_else(|| panic!("no {tag} line: {f:?}"))
            .to_string()
    };
    let secs = |l: &str| -> f64 {
        l.split("after ")
            .nth(1)
            .unwrap()
            .split('s')
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    let timeout = line("timeout");
    assert!(
        timeout.contains("rank 0: NCCL initialisation (2 ranks) did not finish within 2s"),
        "{timeout}"
    );
    assert!((2.0..6.0).contains(&secs(&timeout)), "{timeout}");
    let abandon = line("abandon");
    assert!(
        abandon.contains("rank 0: NCCL initialisation (2 ranks) abandoned: rank 1 (pid 4242) died"),
        "{abandon}"
    );
    assert!(secs(&abandon) < 2.0, "{abandon}");
}

/// Set in the worker processes of the GPU mismatch test below.
const GPU_MISMATCH_CHILD: &str = "BRAID_TEST_GPU_MISMATCH_CHILD";

/// A worker of `gpu_mismatch_under_debug_is_reported_on_every_rank`: each
/// rank all-reduces a different count on its GPU.
fn gpu_mismatch_child() {
    use braid_comm::gpu::GpuCommunicator;
    use braid_comm::{Communicator, ReduceOp};
    let comm = Communicator::init_from_env().expect("host communicator");
    let gpu = GpuCommunicator::init_from_env(&comm).expect("GPU communicator");
    let mut ok = gpu.buffer_from_host(&[1.0f32; 64]).expect("buffer");
    gpu.all_reduce(&mut ok, ReduceOp::Sum)
        .expect("same call")
        .wait()
        .expect("done");
    let mut buf = gpu
        .buffer_from_host(&vec![1.0f32; 1000 + comm.rank()])
        .expect("buffer");
    match gpu.all_reduce(&mut buf, ReduceOp::Sum) {
        Ok(w) => println!("no mismatch reported: {:?}", w.wait().err()),
        Err(e) => println!("{e}"),
    }
    let _ = std::io::stdout().flush();
    // SAFETY: ends the worker at once (its NCCL communicator is aborted).
    unsafe { libc::_exit(0) };
}

#[test]
fn gpu_mismatch_under_debug_is_reported_on_every_rank() {
    if std::env::var_os(GPU_MISMATCH_CHILD).is_some() {
        gpu_mismatch_child();
        return;
    }
    if gpus(2).is_none() {
        return;
    }
    let exe = std::env::current_exe().expect("test binary");
    let mut cmd = braid();
    cmd.args(["launch", "--standalone", "--nproc-per-node", "2", "--"])
        .arg(exe)
        .args([
            "--exact",
            "gpu_mismatch_under_debug_is_reported_on_every_rank",
            "--nocapture",
        ])
        .env(GPU_MISMATCH_CHILD, "1")
        .env("BRAID_DEBUG", "detail")
        .env("NCCL_NVLS_ENABLE", "0");
    let f = run(cmd, Duration::from_secs(120));
    for r in 0..2 {
        let report = format!("[rank {r}] rank {r}: collective mismatch at operation #2");
        assert!(f.stdout.contains(&report), "no report from rank {r}: {f:?}");
    }
    assert!(
        f.stdout
            .contains("all_reduce(#2: count=1000, dtype=f32, op=sum)"),
        "{f:?}"
    );
    assert!(
        f.stdout
            .contains("all_reduce(#2: count=1001, dtype=f32, op=sum)"),
        "{f:?}"
    );
}

#[test]
fn gpu_data_parallel_matches_one_gpu_and_bf16_tracks_f32() {
    if gpus(2).is_none() {
        return;
    }
    let dir = common::TempDir::new("gpu-ddp");
    let f32_args = ["--precision", "f32", "--steps", "20"];
    let (one, _) = train_gpu(&dir, "one", &[&f32_args[..], &["--batch", "8"]].concat());
    let (two, _) = train_gpu(
        &dir,
        "two",
        &[&f32_args[..], &["--nproc", "2", "--batch", "4"]].concat(),
    );
    let d = common::max_diff(&one, &two);
    let _ = writeln!(std::io::stderr(), "f32, 2 GPUs vs 1: max |diff| {d:e}");
    assert!(d <= GPU_TOLERANCE, "2 GPUs differ from one by {d}");
    // bf16 (with deferred weight gradients) tracks f32 on 2 GPUs: means
    // over 20-step windows within 0.05.
    let run = ["--nproc", "2", "--batch", "8", "--steps", "100"];
    let (_, f) = train_gpu(&dir, "f32", &[&run[..], &["--precision", "f32"]].concat());
    let (_, b) = train_gpu(&dir, "bf16", &[&run[..], &["--precision", "bf16"]].concat());
    assert_windows_track(&f, &b, 0.05, ("f32", "bf16"));
}

/// The copy-engine all-reduce beyond 2 ranks: over 3 GPUs (parts of
/// uneven length) and 4, in f32, data parallelism reaches one GPU's
/// parameters after 20 steps, as over NCCL, and says which path it took.
#[test]
fn gpu_copy_engine_all_reduce_over_3_and_4_matches_one_gpu_and_nccl() {
    if gpus(4).is_none() {
        return;
    }
    let dir = common::TempDir::new("gpu-ce-n");
    let f32_args = ["--precision", "f32", "--steps", "20"];
    for (n, per_rank) in [(3, "2"), (4, "2")] {
        let whole = (2 * n).to_string();
        let (one, _) = train_gpu(
            &dir,
            &format!("one-{n}"),
            &[&f32_args[..], &["--batch", &whole]].concat(),
        );
        let ranks = n.to_string();
        let run = [&f32_args[..], &["--nproc", &ranks, "--batch", per_rank]].concat();
        let mut nccl = None;
        for via in ["ce", "nccl"] {
            let env = [("BRAID_GPU_ALLREDUCE", via)];
            let (params, doc) = train_gpu_env(&dir, &format!("{via}-{n}"), &run, &env);
            let path = doc["summary"]["collectives_via"]
                .as_str()
                .unwrap_or("")
                .to_string();
            let d = common::max_diff(&one, &params);
            let _ = writeln!(
                std::io::stderr(),
                "f32, {n} GPUs via {via} ({path}) vs 1: max |diff| {d:e}"
            );
            assert!(
                d <= GPU_TOLERANCE,
                "{n} GPUs via {via} differ from one by {d}"
            );
            assert_eq!(via == "ce", path.contains("copy engines"), "{via}: {path}");
            match &nccl {
                None => nccl = Some(params),
                Some(other) => {
                    let d = common::max_diff(other, &params);
                    assert!(d <= GPU_TOLERANCE, "{n} GPUs: ce and nccl differ by {d}");
                }
            }
        }
    }
}

/// `--checkpointing` on the GPU recomputes the blocks' activations (all,
/// or with `BRAID_CKPT_ATTENTION=kept` from the attention's output on, or
/// so in the last 2 of 3 layers with `BRAID_CKPT_ATTENTION=2`, or with
/// `BRAID_CKPT_ATTENTION_OUTPUT=recomputed` from each layer's input),
/// streamed bf16 weights (`BRAID_BF16_WEIGHTS=streamed`) cast each layer
/// as it is needed, and the fused attention's dQ kernel recomputes the
/// score gradients (`BRAID_SCORE_GRADS=recomputed`) rather than reading
/// them, all in the same arithmetic as the forward pass and the
/// optimizer: after 8 steps the parameters are the same bit for bit as
/// when everything is kept, with the fused attention (log-sum-exp kept)
/// and with the batched one (run again).
#[test]
fn gpu_checkpointing_and_streamed_weights_train_bit_for_bit_alike() {
    if gpus(1).is_none() {
        return;
    }
    let dir = common::TempDir::new("gpu-ckpt");
    let args = [
        "--model",
        "L3-H4-C128-V256-T64",
        "--data",
        "random",
        "--batch",
        "6",
        "--steps",
        "8",
    ];
    let ckpt = [&args[..], &["--checkpointing"]].concat();
    for path in ["fused", "batched"] {
        // (fused only: stored score gradients and the attention kept
        // under checkpointing; the batched path takes neither.)
        let fused = path == "fused";
        let (stored, kept_attn, lean) = match fused {
            true => ("stored", "kept", "recomputed"),
            false => ("auto", "auto", "auto"),
        };
        let env_out = |weights, scores, ckpt_attn, output| {
            [
                ("BRAID_ATTENTION", path),
                ("BRAID_BF16_WEIGHTS", weights),
                ("BRAID_SCORE_GRADS", scores),
                ("BRAID_CKPT_ATTENTION", ckpt_attn),
                ("BRAID_CKPT_ATTENTION_OUTPUT", output),
            ]
        };
        let env = |weights, scores, ckpt_attn| env_out(weights, scores, ckpt_attn, "auto");
        let (kept, a) = train_gpu_env(
            &dir,
            &format!("{path}-kept"),
            &args,
            &env("resident", stored, "auto"),
        );
        let mut runs = vec![
            ("checkpointing", &ckpt[..], env("resident", stored, lean)),
            (
                "streamed weights",
                &args[..],
                env("streamed", stored, "auto"),
            ),
        ];
        if fused {
            let attn = env("resident", stored, kept_attn);
            runs.push(("checkpointing, attention kept", &ckpt[..], attn));
            let some = env("resident", stored, "2");
            runs.push(("checkpointing, attention kept in 2 layers", &ckpt[..], some));
            let scores = env("resident", lean, "auto");
            runs.push(("recomputed scores", &args[..], scores));
        }
        runs.push(("all", &ckpt[..], env("streamed", lean, lean)));
        // Each layer saving its input alone: the attention's output and
        // log-sum-exp recomputed too (the batched path runs the attention
        // again either way).
        let inputs = env_out("resident", stored, lean, "recomputed");
        runs.push((
            "checkpointing, attention output recomputed",
            &ckpt[..],
            inputs,
        ));
        for (name, run, env) in runs {
            let tag = name.replace([' ', ','], "-");
            let (again, b) = train_gpu_env(&dir, &format!("{path}-{tag}"), run, &env);
            let differ = kept
                .iter()
                .zip(&again)
                .filter(|(x, y)| x.to_bits() != y.to_bits())
                .count();
            let _ = writeln!(
                std::io::stderr(),
                "{path} attention, {name}: {differ} of {} parameters differ",
                kept.len()
            );
            assert_eq!(differ, 0, "{path}, {name}: the parameters changed");
            assert_eq!(common::step_losses(&a), common::step_losses(&b));
        }
    }
}

#[test]
fn gpu_hooks_send_less_and_still_train() {
    if gpus(2).is_none() {
        return;
    }
    let dir = common::TempDir::new("gpu-hooks");
    let run = ["--nproc", "2", "--batch", "8", "--steps", "60"];
    let (_, plain) = train_gpu(&dir, "plain", &run);
    let (_, bf16) = train_gpu(&dir, "bf16", &[&run[..], &["--grad-comm", "bf16"]].concat());
    let (_, psgd) = train_gpu(
        &dir,
        "psgd",
        &[&run[..], &["--grad-comm", "powersgd:4:10"]].concat(),
    );
    let bytes = |d: &serde_json::Value| d["summary"]["payload_bytes_per_step"].as_u64().unwrap();
    assert_eq!(bytes(&bf16) * 2, bytes(&plain));
    assert!(
        bytes(&psgd) * 2 < bytes(&plain),
        "{} vs {}",
        bytes(&psgd),
        bytes(&plain)
    );
    let tail = |d: &serde_json::Value| {
        let l = common::step_losses(d);
        l[l.len() - 10..].iter().sum::<f64>() / 10.0
    };
    assert!(
        (tail(&bf16) - tail(&plain)).abs() < 0.05,
        "{} vs {}",
        tail(&bf16),
        tail(&plain)
    );
    assert!(
        tail(&psgd) < common::step_losses(&psgd)[0] - 1.0,
        "PowerSGD did not learn"
    );
}

#[test]
fn a_killed_gpu_rank_is_named_within_30_seconds() {
    if gpus(2).is_none() {
        return;
    }
    let dir = common::TempDir::new("gpu-kill");
    let (f, took) = common::kill_rank_one_of_two(
        &dir,
        "--device cuda --model 124M --data random --batch 8 --seq 256 --steps 100000 --eval-every 0",
        &[("NCCL_NVLS_ENABLE", "0")],
        Duration::from_secs(20),
        Duration::from_secs(90),
    );
    assert!(
        took < Duration::from_secs(30),
        "stopped {took:?} after the kill"
    );
    assert!(f.stderr.contains("root cause: rank 1"), "{}", f.stderr);
    assert!(
        f.stderr.contains("[rank 0] braid: error:") && f.stderr.contains("rank 1"),
        "rank 0 did not name rank 1:\n{}",
        f.stderr
    );
}

/// A model past 2^31 parameters (wide and shallow, to stay quick) trains
/// on one GPU in bf16 with its loss falling; its checkpoint (bf16, above
/// 4 GiB) is written, read back, and training resumes from it.
#[test]
fn a_model_past_2_31_parameters_trains_and_resumes_from_its_checkpoint() {
    if gpus(1).is_none() {
        return;
    }
    let have = braid_cuda::Device::open(0)
        .and_then(|d| d.total_memory())
        .unwrap_or(0);
    if have < 60 << 30 {
        let _ = writeln!(
            std::io::stderr(),
            "skipped: needs 60 GiB of GPU memory, GPU 0 has {have} bytes"
        );
        return;
    }
    let dir = common::TempDir::new("gpu-big");
    let model = dir.path().join("big.safetensors");
    let train = |tag: &str, extra: &[&str]| {
        let json = dir.path().join(format!("{tag}.json"));
        let mut cmd = braid();
        cmd.args([
            "train",
            "--device",
            "cuda",
            "--model",
            "L3-H128-C8192-V256-T128",
        ])
        .args([
            "--batch", "4", "--seq", "128", "--lr", "1e-6", "--warmup", "1",
        ])
        .args(["--eval-every", "0", "--log-every", "1", "--seed", "3"])
        .args(extra)
        .arg("--json")
        .arg(&json)
        .env("NCCL_NVLS_ENABLE", "0");
        let f = run(cmd, Duration::from_secs(300));
        assert_eq!(f.code, Some(0), "{tag}: {f:?}");
        let doc: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        common::step_losses(&doc)
    };
    let save = model.to_str().unwrap();
    let first = train(
        "first",
        &["--steps", "8", "--save", save, "--save-dtype", "bf16"],
    );
    let _ = writeln!(std::io::stderr(), "losses past 2^31 parameters: {first:?}");
    // (With one warm-up step, a width of 8192 jumps from 7.2 to 11.9 at
    // 1e-5 and to 40.8 at 3e-4 — in f32 as in bf16 — while a width of
    // 4096 falls steadily at 1e-6.)
    assert!(
        first[7] < first[0] - 0.1,
        "the loss did not fall: {first:?}"
    );
    let bytes = std::fs::metadata(&model).unwrap().len();
    assert!(bytes > 4 << 30, "checkpoint of {bytes} bytes");
    let (params, _) = braid_model::checkpoint::load(&model).expect("checkpoint");
    assert!(
        params.data.len() > 1 << 31,
        "{} parameters",
        params.data.len()
    );
    let resumed = train("resumed", &["--steps", "2", "--load", save]);
    assert!(
        resumed[0] < first[0] - 0.1,
        "resumed at {resumed:?}, the first run started at {}",
        first[0]
    );
}

/// The GPU memory pre-flight: its estimate is within 5 % of what a run
/// then allocates at its peak, and a model too large for the GPU is
/// refused at start (exit 2) with the estimate and what would fit.
#[test]
fn the_gpu_memory_estimate_matches_the_peak_and_refuses_what_cannot_fit() {
    if gpus(1).is_none() {
        return;
    }
    let mut peaks = Vec::new();
    for (model, batch, seq, ckpt) in [
        ("124M", "4", "256", false),
        ("L12-H10-C1280-V50304-T1024", "8", "1024", false),
        ("L12-H10-C1280-V50304-T1024", "8", "1024", true),
    ] {
        let mut cmd = braid();
        cmd.args([
            "train", "--device", "cuda", "--model", model, "--data", "random",
        ])
        .args([
            "--batch",
            batch,
            "--seq",
            seq,
            "--steps",
            "3",
            "--eval-every",
            "0",
        ])
        .args(ckpt.then_some("--checkpointing"))
        .env("NCCL_NVLS_ENABLE", "0");
        let f = run(cmd, Duration::from_secs(120));
        assert_eq!(f.code, Some(0), "{f:?}");
        let est = figure(&f.stdout, "GPU memory estimate:");
        let peak = figure(&f.stdout, "peak device memory");
        let _ = writeln!(
            std::io::stderr(),
            "{model} B{batch} T{seq} checkpointing {ckpt}: estimate {est} GiB, peak {peak} GiB"
        );
        peaks.push(peak);
        assert!(
            (est - peak).abs() <= 0.05 * peak,
            "{model}: estimate {est} GiB, peak {peak} GiB"
        );
        // The run names the part of the step where the memory peaked.
        let parts = ["forward", "backward", "update", "between steps"];
        let named = f
            .stdout
            .split_once("device memory: peak reached in ")
            .is_some_and(|(_, at)| parts.iter().any(|p| at.starts_with(p)));
        assert!(named, "no part named for the peak: {}", f.stdout);
    }
    assert!(
        peaks[2] < peaks[1] - 1.0,
        "checkpointing saved too little: {} GiB against {} GiB",
        peaks[2],
        peaks[1]
    );
    let mut cmd = braid();
    cmd.args(["train", "--device", "cuda", "--model", "L56-H32-C4096"])
        .args([
            "--data", "random", "--batch", "4", "--seq", "1024", "--steps", "1",
        ])
        .env("NCCL_NVLS_ENABLE", "0");
    let f = run(cmd, Duration::from_secs(60));
    assert_eq!(f.code, Some(2), "{f:?}");
    assert!(f.stderr.contains("needs about"), "{f:?}");
    // Where the GPU could hold it with the optimizer in host memory, the
    // hint says so.
    assert!(
        f.stderr.contains("pick a model of at most") || f.stderr.contains("--offload optimizer"),
        "{f:?}"
    );
}

/// An optimizer offloaded to host memory (`--offload optimizer`: master
/// weights and AdamW's moments there, the update on the CPU) trains as
/// the one on the GPU: in f32 the parameters after 20 steps agree within
/// [`GPU_TOLERANCE`] (the CPU's AdamW is the GPU's arithmetic but for
/// fused multiply-adds); in bf16 the loss means over 20-step windows
/// agree within 0.02; the GPU holds no optimizer state; and on 2 GPUs
/// (where there are 2) data parallel with the offload matches one GPU.
#[test]
fn gpu_offloaded_optimizer_matches_the_gpu_one() {
    if gpus(1).is_none() {
        return;
    }
    let dir = common::TempDir::new("gpu-offload");
    let f32_args = ["--precision", "f32", "--steps", "20", "--batch", "8"];
    let offload = ["--offload", "optimizer"];
    let (gpu, _) = train_gpu(&dir, "gpu", &f32_args);
    let (host, doc) = train_gpu(&dir, "host", &[&f32_args[..], &offload].concat());
    let d = common::max_diff(&gpu, &host);
    let _ = writeln!(
        std::io::stderr(),
        "f32, optimizer on the host vs the GPU: max |diff| {d:e}"
    );
    assert!(d <= GPU_TOLERANCE, "the offloaded optimizer differs by {d}");
    let state = &doc["model_state_bytes"];
    let n = host.len() as u64;
    assert!(state["offloaded"].as_u64().unwrap() >= 12 * n, "{state}");
    let run = ["--steps", "100", "--batch", "8"];
    let (_, plain) = train_gpu(&dir, "bf16", &run);
    let (_, off) = train_gpu(&dir, "bf16-host", &[&run[..], &offload].concat());
    assert_windows_track(&plain, &off, 0.02, ("optimizer on the GPU", "on the host"));
    if gpus(2).is_some() {
        let two = [
            "--precision",
            "f32",
            "--steps",
            "20",
            "--nproc",
            "2",
            "--batch",
            "4",
        ];
        let (two, _) = train_gpu(&dir, "two", &[&two[..], &offload].concat());
        let d = common::max_diff(&host, &two);
        let _ = writeln!(
            std::io::stderr(),
            "f32 offloaded, 2 GPUs vs 1: max |diff| {d:e}"
        );
        assert!(
            d <= GPU_TOLERANCE,
            "2 GPUs with the offload differ from one by {d}"
        );
    }
}

/// The GPU engine on a layout padded for ZeRO's shards (gaps after every
/// block) trains like on the plain layout: three AdamW steps in f32 and
/// in bf16, every tensor compared by name (products may take other
/// algorithms at other alignments, so within a stated tolerance: 1e-6 in
/// f32, 1e-3 in bf16), and the gaps stay zero.
#[test]
fn the_gpu_engine_trains_a_padded_layout_like_the_plain_one() {
    use braid_model::cuda::model_mixed::MixedOptions;
    use braid_model::{GptConfig, Layout, Params};
    use braid_train::engines::{GpuGpt, Precision};
    use braid_train::{Engine, UpdateStep};
    use std::sync::Arc;
    if gpus(1).is_none() {
        return;
    }
    let dev = braid_cuda::Device::open(0).expect("GPU 0");
    let cfg = GptConfig::parse("L3-H4-C128-V256-T64").unwrap();
    let (b, t) = (4, 64);
    let batch = token_batch(b, t, 7, 11);
    let train = |layout: Layout, precision: Precision| -> Params {
        let init = Params::init_gpt2(Arc::new(layout), 3);
        let opts = MixedOptions::default();
        let mut e = GpuGpt::new(&dev, &init, (b, t), precision, opts, 0.1).unwrap();
        let mut g = e.new_grads().unwrap();
        for step in 1..=3 {
            e.zero_grads(&mut g).unwrap();
            e.forward(&batch, true).unwrap();
            braid_train::engine::backward_local(&mut e, &mut g).unwrap();
            let s = UpdateStep {
                lr: 1e-3,
                step,
                grad_scale: 1.0,
            };
            e.update(&g, s).unwrap();
        }
        e.synchronize().unwrap();
        let mut out = init.clone();
        e.copy_params_to(&mut out).unwrap();
        out
    };
    for (precision, tol) in [(Precision::F32, 1e-6f32), (Precision::Bf16, 1e-3)] {
        let plain = train(Layout::new(&cfg), precision);
        let padded = train(Layout::padded(&cfg, 2 * 64), precision);
        let mut worst = 0f32;
        for p in &plain.layout.params {
            let d = common::max_diff(plain.view(&p.name), padded.view(&p.name));
            worst = worst.max(d);
        }
        let mut named = vec![false; padded.data.len()];
        for p in &padded.layout.params {
            named[p.range()].iter_mut().for_each(|x| *x = true);
        }
        let gaps = padded
            .data
            .iter()
            .zip(&named)
            .filter(|(x, n)| !**n && **x != 0.0)
            .count();
        let _ = writeln!(
            std::io::stderr(),
            "{}: padded vs plain layout, max |diff| {worst:e}, {gaps} nonzero gap elements",
            precision.name()
        );
        assert!(worst <= tol, "{}: {worst} > {tol}", precision.name());
        assert_eq!(gaps, 0, "{}: the gaps changed", precision.name());
    }
}

/// One process in bf16 lends its gradient buffer's memory to the
/// activations the forward pass saves, until the backward pass writes
/// it (`BRAID_SAVED_IN_GRADS`, on by default with one micro-batch per
/// step): the same saved model and every training and evaluation loss,
/// bit for bit, against keeping them apart — fused attention (head size
/// 32) and batched attention with a vocabulary padded to 64, with and
/// without checkpointing, evaluation passes between steps; the record
/// says how much was lent; the peak is lower and the estimate within 5 %
/// of it; two micro-batches lend nothing, and asking for it then is
/// refused.
#[test]
fn gpu_one_process_saved_activations_in_the_gradient_buffer_change_no_bits() {
    if gpus(1).is_none() {
        return;
    }
    let dir = common::TempDir::new("gpu-one-lend");
    let off = [("BRAID_SAVED_IN_GRADS", "off")];
    for (model, ckpt) in [
        ("L4-H4-C128-V50304-T64", false),
        ("L4-H4-C128-V50304-T64", true),
        ("L3-H2-C96-V50257-T64", false),
        ("L3-H2-C96-V50257-T64", true),
    ] {
        let run_with = |name: &str, env: &[(&str, &str)]| {
            let mut cmd = braid();
            cmd.args(["train", "--device", "cuda", "--model", model])
                .args(["--seq", "64", "--batch", "8", "--steps", "8", "--seed", "3"])
                .args(["--eval-every", "2", "--grad-clip", "1.0"])
                .args(if ckpt { &["--checkpointing"][..] } else { &[] });
            let (path, doc) = run_saving(&dir, name, cmd, env);
            let losses = train_and_eval_losses(&doc);
            let lent = doc["saved_in_grads_bytes"].as_u64().unwrap();
            (std::fs::read(&path).unwrap(), losses, lent)
        };
        let name = format!("one-{model}-{ckpt}");
        let (a, la, lent) = run_with(&format!("{name}-default"), &[]);
        let (b, lb, lent_off) = run_with(&format!("{name}-off"), &off);
        let _ = writeln!(
            std::io::stderr(),
            "{name}: {lent} bytes of saved activations in the gradient buffer"
        );
        assert!(
            lent > 0 && lent_off == 0,
            "{name}: lent {lent} / {lent_off}"
        );
        assert!(la.iter().filter(|l| l.1.is_some()).count() >= 3, "{la:?}");
        assert_eq!(la, lb, "{name}: losses differ with {off:?}");
        assert!(a == b, "{name}: the saved models differ with {off:?}");
    }
    // A model large enough for the saving to show, and the estimate.
    let l12 = |env: &[(&str, &str)], extra: &[&str]| {
        let mut cmd = braid();
        cmd.args(["train", "--device", "cuda", "--model"])
            .arg("L12-H10-C1280-V50304-T1024")
            .args(["--data", "random", "--batch", "8", "--seq", "1024"])
            .args(["--eval-every", "0", "--steps", "3"])
            .args(extra)
            .env("NCCL_NVLS_ENABLE", "0")
            .envs(env.iter().copied());
        run(cmd, Duration::from_secs(180))
    };
    let figures = |f: &common::Finished| {
        assert_eq!(f.code, Some(0), "{f:?}");
        [
            figure(&f.stdout, "GPU memory estimate:"),
            figure(&f.stdout, "peak device memory"),
        ]
    };
    let [est, peak] = figures(&l12(&[], &[]));
    let [est_off, peak_off] = figures(&l12(&off, &[]));
    let _ = writeln!(
        std::io::stderr(),
        "L12-H10-C1280 B8 T1024: saved activations in the gradient buffer: estimate {est} GiB, \
         peak {peak} GiB; apart: estimate {est_off} GiB, peak {peak_off} GiB"
    );
    for (e, p) in [(est, peak), (est_off, peak_off)] {
        assert!((e - p).abs() <= 0.05 * p, "estimate {e} GiB, peak {p} GiB");
    }
    assert!(
        peak < peak_off - 0.5,
        "peak {peak} GiB against {peak_off} GiB apart"
    );
    // Two micro-batches: nothing lent by default, refused when asked for.
    let accum = ["--accum", "2"];
    let c = l12(&[], &accum);
    assert_eq!(c.code, Some(0), "{c:?}");
    assert!(!c.stdout.contains("gradient buffer's memory"), "{c:?}");
    let d = l12(&[("BRAID_SAVED_IN_GRADS", "on")], &accum);
    assert_eq!(d.code, Some(2), "{d:?}");
    assert!(d.stderr.contains("one micro-batch per step"), "{d:?}");
}

/// A bounded stream sync (what the training loop waits on at the end of
/// every step) gives up on work that never finishes — here a stream
/// waiting for a flag nobody raises, as a stopped peer's copy engine
/// would leave it — with an error naming the wait, instead of hanging;
/// released, the stream finishes.
#[test]
fn a_bounded_stream_sync_times_out_instead_of_hanging() {
    use braid_cuda::ipc::{wait_flag_async, write_flag_async};
    use std::time::Instant;
    if gpus(1).is_none() {
        return;
    }
    let dev = braid_cuda::Device::open(0).expect("GPU 0");
    let flag = braid_cuda::DeviceBuffer::<i32>::zeros(&dev, 1).expect("flag");
    let stuck = braid_cuda::Stream::new(&dev).expect("stream");
    // SAFETY: the flag outlives both streams' use of it (released and
    // synchronised below, before it drops).
    unsafe { wait_flag_async(flag.device_ptr(), 1, &stuck) }.expect("wait");
    let t0 = Instant::now();
    let err = stuck
        .synchronize_within(Duration::from_millis(200), "the test's stuck stream")
        .expect_err("a stream that never finishes must time out");
    let waited = t0.elapsed();
    assert!(
        waited >= Duration::from_millis(200) && waited < Duration::from_secs(5),
        "{waited:?}"
    );
    let text = err.to_string();
    assert!(
        text.contains("the test's stuck stream") && text.contains("did not finish within"),
        "{text}"
    );
    let other = braid_cuda::Stream::new(&dev).expect("stream");
    // SAFETY: as above.
    unsafe { write_flag_async(flag.device_ptr(), 1, &other) }.expect("release");
    stuck
        .synchronize_within(Duration::from_secs(10), "the released stream")
        .expect("released, it finishes");
}
