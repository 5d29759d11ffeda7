//! `braid data write` and `braid data inspect` as a user runs them: token
//! windows and JSON lines written, inspected as text and as JSON, and bad
//! input refused with a message.

use std::path::PathBuf;
use std::process::Command;

fn braid(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_braid"))
        .args(args)
        .output()
        .expect("braid runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn dir() -> PathBuf {
    let d = std::env::temp_dir().join(format!("braid-data-cli-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn token_windows_are_written_and_inspected() {
    let out = dir().join("syn.beton");
    let o = out.to_str().unwrap();
    let (ok, _, err) = braid(&[
        "data",
        "write",
        o,
        "--tokens",
        "synthetic",
        "--seq",
        "16",
        "--page-size",
        "65536",
        "--workers",
        "2",
    ]);
    assert!(ok, "{err}");
    assert!(err.contains("samples/s"), "{err}");
    let (ok, text, err) = braid(&["data", "inspect", o]);
    assert!(ok, "{err}");
    assert!(
        text.contains("tokens <u2 [17]") && text.contains("first 3 samples"),
        "{text}"
    );
    let (ok, json, err) = braid(&["data", "inspect", o, "--json", "--samples", "2"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["page_size"], 65536);
    assert_eq!(v["fields"]["split"], "int");
    assert_eq!(v["samples"].as_array().unwrap().len(), 2);
    assert_eq!(v["samples"][0]["tokens"].as_array().unwrap().len(), 17);
    // Window 1 starts where window 0's inputs end: its first token is
    // window 0's last (the target of its last input).
    assert_eq!(v["samples"][1]["tokens"][0], v["samples"][0]["tokens"][16]);
    std::fs::remove_file(&out).unwrap();
}

#[test]
fn json_lines_are_written_and_bad_input_is_refused() {
    let d = dir();
    let lines = d.join("x.jsonl");
    std::fs::write(&lines, "{\"a\": 1}\n\n[1, 2]\n").unwrap();
    let out = d.join("lines.beton");
    let (ok, _, err) = braid(&[
        "data",
        "write",
        out.to_str().unwrap(),
        "--jsonl",
        lines.to_str().unwrap(),
        "--page-size",
        "4096",
    ]);
    assert!(ok, "{err}");
    let (_, json, _) = braid(&[
        "data",
        "inspect",
        out.to_str().unwrap(),
        "--json",
        "--samples",
        "all",
    ]);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(
        v["samples"],
        serde_json::json!([{"data": {"a": 1}}, {"data": [1, 2]}])
    );

    std::fs::write(&lines, "{\"a\": 1}\n{oops\n").unwrap();
    let bad = d.join("bad.beton");
    let (ok, _, err) = braid(&[
        "data",
        "write",
        bad.to_str().unwrap(),
        "--jsonl",
        lines.to_str().unwrap(),
    ]);
    assert!(!ok && err.contains("x.jsonl:2: not JSON"), "{err}");
    assert!(!bad.exists(), "a failed write must leave no file");
    let (ok, _, err) = braid(&["data", "inspect", lines.to_str().unwrap()]);
    assert!(!ok && err.contains("not a valid .beton file"), "{err}");
    let (ok, _, err) = braid(&[
        "data",
        "write",
        bad.to_str().unwrap(),
        "--tokens",
        "synthetic",
        "--page-size",
        "1000",
    ]);
    assert!(!ok && err.contains("power of two"), "{err}");
    let leftovers: Vec<_> = std::fs::read_dir(&d)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().contains("bad.beton"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    std::fs::remove_file(&out).unwrap();
}

#[test]
fn image_folders_are_written_as_ffcv_writes_them() {
    let d = dir().join("imgs");
    let root = d.join("train");
    for (c, class) in ["cat", "dog"].iter().enumerate() {
        std::fs::create_dir_all(root.join(class)).unwrap();
        for (i, (w, h)) in [(300usize, 200usize), (150, 220), (300, 200)]
            .iter()
            .enumerate()
        {
            let rgb: Vec<u8> = (0..w * h * 3)
                .map(|k| ((k / 3 % w) * 255 / w + (k / 3 / w) + c * 40 + k % 3 * 70) as u8)
                .collect();
            let jpeg = braid_data::jpeg::encode(&rgb, *w as u32, *h as u32, 90).unwrap();
            std::fs::write(root.join(class).join(format!("{i}.jpg")), jpeg).unwrap();
        }
    }
    std::fs::write(root.join("cat").join("notes.txt"), "not an image").unwrap();
    let r = root.to_str().unwrap();
    for mode in ["jpg", "raw"] {
        let out = d.join(format!("{mode}.beton"));
        let o = out.to_str().unwrap();
        let (ok, _, err) = braid(&[
            "data",
            "write",
            o,
            "--images",
            r,
            "--max-resolution",
            "128",
            "--mode",
            mode,
            "--workers",
            "2",
        ]);
        assert!(ok, "{err}");
        assert!(
            err.contains("6 images of 2 classes") && err.contains("1 files not .jpg"),
            "{err}"
        );
        let (ok, json, err) = braid(&["data", "inspect", o, "--json", "--samples", "all"]);
        assert!(ok, "{err}");
        let v: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(v["num_samples"], 6);
        assert_eq!(v["fields"]["label"], "int");
        let samples = v["samples"].as_array().unwrap();
        let labels: Vec<i64> = samples
            .iter()
            .map(|s| s["label"].as_i64().unwrap())
            .collect();
        assert_eq!(labels, [0, 0, 0, 1, 1, 1]);
        for (s, (w, h)) in samples
            .iter()
            .zip([(128, 85), (87, 128), (128, 85)].iter().cycle())
        {
            assert_eq!(s["image"]["mode"], mode, "{s}");
            assert_eq!(
                (s["image"]["width"].as_u64(), s["image"]["height"].as_u64()),
                (Some(*w), Some(*h)),
                "{s}"
            );
        }
        let b = braid_data::beton::Beton::open(&out).unwrap();
        for s in 0..b.len() {
            let braid_data::beton::Value::Image(img) = b.value(s, 0).unwrap() else {
                panic!("sample {s}: not an image");
            };
            let raw = img.width as usize * img.height as usize * 3;
            if mode == "raw" {
                assert_eq!(img.data.len(), raw);
            } else {
                let (info, _) = braid_data::jpeg::decode(img.data).unwrap();
                assert_eq!(
                    (info.width, info.height),
                    (img.width as u32, img.height as u32)
                );
            }
        }
        std::fs::remove_file(&out).unwrap();
    }
    let empty = d.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let bad = d.join("bad.beton");
    let (ok, _, err) = braid(&[
        "data",
        "write",
        bad.to_str().unwrap(),
        "--images",
        empty.to_str().unwrap(),
    ]);
    assert!(!ok && err.contains("no class folders"), "{err}");
    assert!(!bad.exists());
    std::fs::remove_dir_all(&d).unwrap();
}
