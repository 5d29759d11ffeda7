//! GPU collectives through the real binary. On a machine with GPUs (the
//! device machines) these run NCCL for real; without a GPU (CI) the GPU
//! tests say "skipped: no GPU" and the tests of the no-GPU behaviour run
//! instead.

mod common;

use common::{braid, run};
use std::io::Write;
use std::time::Duration;

/// GPUs visible here, or `None` (after saying so) when there are fewer
/// than `need`.
fn gpus(need: usize) -> Option<usize> {
    let n = braid_cuda::device_count().unwrap_or(0);
    if n < need {
        // Written past the test harness's capture so that it shows in the log.
        let _ = writeln!(
            std::io::stderr(),
            "skipped: no GPU (this test needs {need}, the CUDA driver shows {n})"
        );
        return None;
    }
    Some(n)
}

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
    assert!(f.stdout.contains("#wrong total: 0"), "{f:?}");
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
            all.contains("GPU collectives are unavailable"),
            "{args:?}: no clear message:\n{all}"
        );
    }
    // The CPU backends keep working in the same binary.
    let mut cmd = braid();
    cmd.args(["bench", "all_reduce", "--np", "2", "-e", "1K", "--check"]);
    let f = run(cmd, Duration::from_secs(60));
    assert_eq!(f.code, Some(0), "{f:?}");
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
