//! `braid plan` through the real binary: a ranked table with a first
//! choice and the bandwidth its links need, every layout as JSON
//! (predicted or refused, with why, with its links' traffic), a machine
//! from a file, and bad questions said.

mod common;

use common::{braid_args, TempDir};

#[test]
fn a_plan_ranks_layouts_and_says_why_the_rest_cannot_run() {
    let (ok, out, err) = braid_args(&[
        "plan",
        "--model",
        "L40-H40-C5120",
        "--gpus",
        "4",
        "--global-batch",
        "16",
        "--seq",
        "1024",
    ]);
    assert!(ok, "{err}");
    for said in [
        "layouts, ",
        "first choice: ",
        "refused:",
        "too large for a GPU's memory",
        "where the step goes",
        // The first choice's links: traffic and the bandwidth it needs.
        "hides under",
        "GB/s",
    ] {
        assert!(out.contains(said), "{said:?} not in\n{out}");
    }
    let (ok, json, err) = braid_args(&[
        "plan",
        "--model",
        "124M",
        "--gpus",
        "8",
        "--global-batch",
        "64",
        "--seq",
        "1024",
        "--hardware",
        "h200",
        "--json",
    ]);
    assert!(ok, "{err}");
    let doc: serde_json::Value = serde_json::from_str(&json).expect("JSON on stdout");
    let layouts = doc["layouts"].as_array().unwrap();
    assert!(layouts.len() > 20);
    let first = &layouts[0];
    assert!(
        first["prediction"]["step_s"].as_f64().unwrap() > 0.0,
        "{first}"
    );
    // Fastest first, refusals last with their reason.
    let steps: Vec<f64> = layouts
        .iter()
        .filter_map(|l| l["prediction"]["step_s"].as_f64())
        .collect();
    assert!(steps.windows(2).all(|w| w[0] <= w[1]));
    assert!(layouts.iter().any(|l| l["refused"].is_string()));
    assert_eq!(doc["hardware"]["name"], "h200");
    // Each predicted layout over several GPUs lists its links' traffic.
    let data = layouts
        .iter()
        .find(|l| l["layout"]["dp"] == 8)
        .expect("a data-parallel layout");
    let link = &data["capacity"][0];
    assert_eq!(link["dimension"], "data", "{data}");
    assert!(link["wire_bytes"].as_f64().unwrap() > 0.0, "{link}");
    assert!(link["needed_gbps"].as_f64().unwrap() > 0.0, "{link}");
}

#[test]
fn a_machine_from_a_file_and_bad_questions() {
    let dir = TempDir::new("plan-hw");
    let (ok, json, _) = braid_args(&[
        "plan",
        "--model",
        "124M",
        "--gpus",
        "2",
        "--global-batch",
        "8",
        "--json",
    ]);
    assert!(ok);
    let mut hw: serde_json::Value =
        serde_json::from_str::<serde_json::Value>(&json).unwrap()["hardware"].clone();
    hw["name"] = "pod".into();
    hw["gpus_per_node"] = 2.into();
    let file = dir.path().join("pod.json");
    std::fs::write(&file, hw.to_string()).unwrap();
    let (ok, out, err) = braid_args(&[
        "plan",
        "--model",
        "124M",
        "--gpus",
        "4",
        "--global-batch",
        "16",
        "--hardware",
        file.to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    assert!(out.contains("GPUs of pod (2 per node)"), "{out}");
    // --nodes: 16 GPUs over 4 nodes, whatever the machine's default.
    let (ok, out, err) = braid_args(&[
        "plan",
        "--model",
        "124M",
        "--gpus",
        "16",
        "--nodes",
        "4",
        "--global-batch",
        "64",
    ]);
    assert!(ok, "{err}");
    assert!(out.contains("16 GPUs of h100 (4 per node)"), "{out}");
    for (args, want) in [
        (&["--gpus", "0", "--global-batch", "8"][..], "at least 1"),
        (
            &["--gpus", "2", "--global-batch", "8", "--hardware", "v100"],
            "built-in machine",
        ),
        (
            &["--gpus", "2", "--global-batch", "8", "--micro-batch", "0"],
            "--micro-batch",
        ),
        (
            &["--gpus", "16", "--nodes", "3", "--global-batch", "8"],
            "split evenly over the nodes",
        ),
    ] {
        let mut full = vec!["plan", "--model", "124M"];
        full.extend(args);
        let (ok, _, err) = braid_args(&full);
        assert!(!ok && err.contains(want), "{args:?}: {err}");
    }
}

/// `braid plan calibrate` where no GPU can be used says so and what to
/// use instead; a bad --peak is refused before any GPU is looked for. (On
/// a GPU, bench/device/one.sh calibrate runs it.)
#[test]
fn calibrate_without_a_gpu_says_what_to_use_instead() {
    if braid_cuda::device_count().is_ok_and(|n| n > 0) {
        eprintln!("skipped: a GPU is here (one.sh calibrate covers it)");
        return;
    }
    let dir = TempDir::new("plan-calibrate");
    let out = dir.path().join("here.json");
    let (ok, _, err) = braid_args(&["plan", "calibrate", "--out", out.to_str().unwrap()]);
    assert!(!ok && err.contains("--hardware"), "{err}");
    assert!(!out.exists());
    let (ok, _, err) = braid_args(&["plan", "calibrate", "--peak", "0"]);
    assert!(!ok && err.contains("--peak 0"), "{err}");
    // A subcommand and the ranking's flags do not mix.
    let (ok, _, err) = braid_args(&["plan", "--model", "124M", "calibrate"]);
    assert!(!ok && !err.is_empty());
}
