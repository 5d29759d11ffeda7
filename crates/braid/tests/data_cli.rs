//! `braid data write` and `braid data inspect` as a user runs them: token
//! windows and JSON lines written, inspected as text and as JSON, contact
//! sheets drawn, and bad input refused with a message.

/// braid-data's ffcv fixtures (`ffcv_fixture`).
#[path = "../../braid-data/tests/common/mod.rs"]
mod ffcv;
use ffcv::ffcv_fixture;

mod common;

use common::{braid_args as braid, TempDir};

#[test]
fn token_windows_are_written_and_inspected() {
    let tmp = TempDir::new("data-cli-tokens");
    let out = tmp.path().join("syn.beton");
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
    let tmp = TempDir::new("data-cli-jsonl");
    let d = tmp.path().to_path_buf();
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
    let tmp = TempDir::new("data-cli-imgs");
    let d = tmp.path().join("imgs");
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

/// A PNG's size and 8-bit RGB pixels.
fn read_png(path: &std::path::Path) -> (u32, u32, Vec<u8>) {
    let file = std::io::BufReader::new(std::fs::File::open(path).unwrap());
    let mut r = png::Decoder::new(file).read_info().unwrap();
    let mut buf = vec![0; r.output_buffer_size().unwrap()];
    let info = r.next_frame(&mut buf).unwrap();
    assert_eq!(
        (info.color_type, info.bit_depth),
        (png::ColorType::Rgb, png::BitDepth::Eight)
    );
    buf.truncate(info.buffer_size());
    (info.width, info.height, buf)
}

#[test]
fn contact_sheets_show_the_first_images() {
    let tmp = TempDir::new("data-cli-sheets");
    let d = tmp.path().join("sheets");
    std::fs::create_dir_all(&d).unwrap();
    let images = ffcv_fixture("images.beton");
    let i = images.to_str().unwrap();
    let out = d.join("raw.png");
    let o = out.to_str().unwrap();
    // Field 'raw' (the first image field): 10 thumbnails, 8 to a row.
    let (ok, text, err) = braid(&["data", "inspect", i, "--sheet", o, "--sheet-count", "10"]);
    assert!(ok, "{err}");
    assert!(
        text.contains(o) && text.contains("field 'raw'") && text.contains("8 x 2 grid"),
        "{text}"
    );
    // 8 boxes of 128 + 6 across, 2 of 128 + 18 (caption) + 6 down, and a
    // 6-pixel margin.
    let (w, h, rgb) = read_png(&out);
    assert_eq!((w, h), (1078, 310));
    let background = |x0: usize, y0: usize, side: usize| {
        let mut n = 0;
        for y in y0..y0 + side {
            for x in x0..x0 + side {
                let at = (y * w as usize + x) * 3;
                n += (rgb[at..at + 3] == [32, 32, 32]) as usize;
            }
        }
        n as f64 / (side * side) as f64
    };
    for s in 0..16 {
        let (x, y) = (6 + s % 8 * 134, 6 + s / 8 * 152);
        let bg = background(x, y, 128);
        if s < 10 {
            // Each image fills its box across or down (the narrowest of
            // these, 26x64, a 52x128 thumbnail).
            assert!(bg < 0.6, "box {s}: {bg} of it background");
        } else {
            assert_eq!(bg, 1.0, "box {s} is empty");
        }
    }
    // JPEGs are decoded.
    let jpg = d.join("jpg.png");
    let (ok, text, err) = braid(&[
        "data",
        "inspect",
        i,
        "--sheet",
        jpg.to_str().unwrap(),
        "--sheet-field",
        "jpg",
        "--sheet-count",
        "3",
    ]);
    assert!(ok && text.contains("3 x 1 grid"), "{text}{err}");
    assert_eq!(read_png(&jpg).0, 408);

    // Not an image field; no image field at all; a damaged JPEG.
    let (ok, _, err) = braid(&["data", "inspect", i, "--sheet", o, "--sheet-field", "label"]);
    assert!(!ok && err.contains("not RGB images"), "{err}");
    let lines = d.join("x.jsonl");
    std::fs::write(&lines, "{\"a\": 1}\n").unwrap();
    let plain = d.join("plain.beton");
    let p = plain.to_str().unwrap();
    let (ok, _, err) = braid(&["data", "write", p, "--jsonl", lines.to_str().unwrap()]);
    assert!(ok, "{err}");
    let none = d.join("none.png");
    let (ok, _, err) = braid(&["data", "inspect", p, "--sheet", none.to_str().unwrap()]);
    assert!(
        !ok && err.contains("plain.beton has no image field") && err.contains("data (json)"),
        "{err}"
    );
    let mut bytes = std::fs::read(&images).unwrap();
    let b = braid_data::beton::Beton::open(&images).unwrap();
    let e = b
        .index()
        .extent(2, b.index().field("jpg").unwrap())
        .unwrap();
    bytes[e.ptr as usize..e.ptr as usize + 2].fill(0);
    let damaged = d.join("damaged.beton");
    std::fs::write(&damaged, &bytes).unwrap();
    let bad = d.join("bad.png");
    let (ok, _, err) = braid(&[
        "data",
        "inspect",
        damaged.to_str().unwrap(),
        "--sheet",
        bad.to_str().unwrap(),
        "--sheet-field",
        "jpg",
    ]);
    assert!(
        !ok && err.contains("sample 2, field 'jpg'") && err.contains("not a readable JPEG"),
        "{err}"
    );
    assert!(
        !none.exists() && !bad.exists(),
        "a failed sheet must leave no file"
    );
    let mut left: Vec<_> = std::fs::read_dir(&d)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    assert_eq!(
        left,
        [
            "damaged.beton",
            "jpg.png",
            "plain.beton",
            "raw.png",
            "x.jsonl"
        ]
    );
    std::fs::remove_dir_all(&d).unwrap();
}
