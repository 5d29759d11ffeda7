//! Training and loading from `.beton` files as a user runs them:
//! `braid train --data X.beton` follows the same batches as the flat token
//! data it was written from (the same final loss, one process and two
//! data-parallel ranks), refuses a --seq its windows cannot hold, and
//! `braid data load` reads an image file for a few epochs through the OS
//! cache and the process cache.

/// braid-data's ffcv fixtures (`ffcv_fixture`).
#[path = "../../braid-data/tests/common/mod.rs"]
mod ffcv;
use ffcv::ffcv_fixture;

use std::collections::BTreeSet;

mod common;

use common::{braid_args as braid, TempDir};

fn final_loss(out: &str) -> String {
    out.lines()
        .find_map(|l| l.split("final loss ").nth(1))
        .and_then(|r| r.split_whitespace().next())
        .unwrap_or_else(|| panic!("no final loss in:\n{out}"))
        .to_string()
}

#[test]
fn training_from_a_beton_follows_the_flat_data_it_was_written_from() {
    let d = TempDir::new("data-loading-train");
    let file = d.0.join("syn.beton");
    let f = file.to_str().unwrap();
    let (ok, _, err) = braid(&[
        "data",
        "write",
        f,
        "--tokens",
        "synthetic",
        "--seq",
        "32",
        "--tokenizer",
        "bytes",
        "--seed",
        "5",
    ]);
    assert!(ok, "{err}");
    for nproc in ["1", "2"] {
        let common = [
            "train", "--steps", "12", "--seq", "32", "--batch", "8", "--seed", "5", "--nproc",
            nproc,
        ];
        let (ok, flat, err) = braid(&[&common[..], &["--data", "synthetic"]].concat());
        assert!(ok, "{err}");
        let (ok, beton, err) = braid(&[&common[..], &["--data", f]].concat());
        assert!(ok, "{err}");
        assert!(
            beton.contains("windows of 32 tokens, memory-mapped"),
            "{beton}"
        );
        assert_eq!(final_loss(&flat), final_loss(&beton), "--nproc {nproc}");
    }
    // Shorter sequences than the windows hold are cut from them; longer
    // ones are refused with what to do.
    let (ok, _, err) = braid(&[
        "train", "--steps", "2", "--seq", "16", "--batch", "4", "--data", f,
    ]);
    assert!(ok, "{err}");
    let (ok, _, err) = braid(&[
        "train", "--steps", "2", "--seq", "48", "--batch", "4", "--data", f,
    ]);
    assert!(!ok);
    assert!(
        err.contains("--seq 48") && err.contains("braid data write --seq 48"),
        "{err}"
    );
}

#[test]
fn a_beton_without_token_windows_is_refused_with_its_fields_named() {
    let images = ffcv_fixture("images.beton");
    let fixture = images.to_str().unwrap();
    let (ok, _, err) = braid(&["train", "--steps", "2", "--data", fixture]);
    assert!(!ok);
    assert!(
        err.contains("no field `tokens`") && err.contains("label (int)"),
        "{err}"
    );
}

#[test]
fn images_load_for_several_epochs_through_both_caches() {
    let images = ffcv_fixture("images.beton");
    let fixture = images.to_str().unwrap();
    for (field, cache) in [("jpg", "os"), ("mixed", "process")] {
        let (ok, out, err) = braid(&[
            "data",
            "load",
            fixture,
            "--image-field",
            field,
            "--res",
            "16",
            "--batch",
            "8",
            "--epochs",
            "2",
            "--threads",
            "2",
            "--cache",
            cache,
            "--json",
        ]);
        assert!(ok, "{err}");
        let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
        assert!(v["images_per_s"].as_f64().unwrap() > 0.0, "{v}");
        assert_eq!(v["per_epoch"].as_array().unwrap().len(), 2);
        assert!(err.contains("epoch 1: 40 images"), "{err}");
    }
    let (ok, _, err) = braid(&["data", "load", fixture, "--image-field", "label"]);
    assert!(!ok);
    assert!(err.contains("needs an RGB image field"), "{err}");
}

/// Each epoch's samples per rank from `braid data load --record`: for
/// every epoch, (batch count, samples).
fn recorded(dir: &std::path::Path, rank: usize) -> Vec<(usize, Vec<usize>)> {
    let text = std::fs::read_to_string(dir.join(format!("samples-rank{rank}.txt"))).unwrap();
    text.lines()
        .map(|l| {
            let (head, rest) = l.split_once(':').unwrap();
            let batches = head.rsplit(' ').next().unwrap().parse().unwrap();
            let samples = rest
                .split_whitespace()
                .filter(|w| *w != "|")
                .map(|w| w.parse().unwrap())
                .collect();
            (batches, samples)
        })
        .collect()
}

#[test]
fn launched_ranks_read_every_sample_once_per_epoch_between_them() {
    let images = ffcv_fixture("images.beton");
    let fixture = images.to_str().unwrap();
    for nproc in [1usize, 2, 4] {
        let d = TempDir::new(&format!("data-loading-ranks{nproc}"));
        let rec = d.0.join("rec");
        let n = nproc.to_string();
        let (ok, _, err) = braid(&[
            "launch",
            "--standalone",
            "--nproc-per-node",
            &n,
            "--",
            env!("CARGO_BIN_EXE_braid"),
            "data",
            "load",
            fixture,
            "--image-field",
            "jpg",
            "--res",
            "8",
            "--batch",
            "3",
            "--epochs",
            "2",
            "--threads",
            "1",
            "--record",
            rec.to_str().unwrap(),
        ]);
        assert!(ok, "{err}");
        let per_rank: Vec<_> = (0..nproc).map(|r| recorded(&rec, r)).collect();
        for e in 0..2 {
            let counts: BTreeSet<usize> = per_rank.iter().map(|p| p[e].0).collect();
            assert_eq!(
                counts.len(),
                1,
                "{nproc} ranks, epoch {e}: batch counts {counts:?}"
            );
            let mut all: Vec<usize> = per_rank.iter().flat_map(|p| p[e].1.clone()).collect();
            all.sort_unstable();
            assert_eq!(all, (0..40).collect::<Vec<_>>(), "{nproc} ranks, epoch {e}");
        }
        assert_ne!(
            per_rank[0][0].1, per_rank[0][1].1,
            "epochs are shuffled apart"
        );
    }
}
