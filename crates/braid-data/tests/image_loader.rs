//! The image loader on a file of real JPEG and raw images spread over
//! many small pages: every sample exactly once per epoch across 1, 2 and
//! 4 ranks with the same number of batches on each; pixels reproducible
//! by seed and independent of the thread count; the process cache reads
//! each page once per epoch in quasi-random order; a reduced-scale
//! decode looks like the full-size one; a corrupt JPEG is an error naming
//! its sample.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use braid_data::augment::{Augment, Crop, Layout, Pixels, Scratch};
use braid_data::beton::{FieldType, FieldValue, ImageMode, Writer};
use braid_data::images::{Cache, ImageLoader, ImageLoaderOptions};
use braid_data::jpeg;
use braid_data::order::Order;
use braid_data::resize::resize_area_crop;

/// A smooth, textured test picture.
fn picture(w: usize, h: usize, s: usize) -> Vec<u8> {
    let mut px = Vec::with_capacity(w * h * 3);
    for y in 0..h {
        for x in 0..w {
            let (fx, fy) = (x as f32 / w as f32, y as f32 / h as f32);
            let r = 128.0 + 100.0 * (fx * 6.0 + s as f32).sin() * (fy * 3.0).cos();
            let g = 255.0 * fy;
            let b = ((x / 8 + y / 8 + s) % 2) as f32 * 200.0 + 20.0;
            px.extend([r as u8, g as u8, b as u8]);
        }
    }
    px
}

const PAGE: u64 = 128 << 10;

struct TempFile(PathBuf);
impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// `n` samples: every fifth image raw, the rest JPEG, of varied sizes;
/// label = sample index; small pages.
fn dataset(name: &str, n: usize) -> TempFile {
    let path =
        std::env::temp_dir().join(format!("braid-imgload-{name}-{}.beton", std::process::id()));
    let fields = vec![
        ("image".to_string(), FieldType::RgbImage),
        ("label".to_string(), FieldType::Int),
    ];
    let mut w = Writer::create(&path, &fields, n as u64, PAGE).unwrap();
    for s in 0..n {
        let (iw, ih) = (48 + (s * 37) % 150, 40 + (s * 53) % 120);
        let px = picture(iw, ih, s);
        let (mode, data) = if s % 5 == 0 {
            (ImageMode::Raw, px)
        } else {
            (
                ImageMode::Jpeg,
                jpeg::encode(&px, iw as u32, ih as u32, 90).unwrap(),
            )
        };
        w.push(&[
            FieldValue::Image {
                mode,
                width: iw as u16,
                height: ih as u16,
                data,
            },
            FieldValue::Int(s as i64),
        ])
        .unwrap();
    }
    w.finish().unwrap();
    TempFile(path)
}

fn options(batch: usize) -> ImageLoaderOptions {
    let mut o = ImageLoaderOptions::new(
        batch,
        Augment {
            crop: Crop::RANDOM_RESIZED,
            width: 32,
            height: 32,
            flip: true,
            pixels: Pixels::U8,
            layout: Layout::Nhwc,
        },
    );
    o.threads = 2;
    o.prefetch = 3;
    o.seed = 11;
    o
}

/// (samples, labels, pixels) of each batch of one epoch.
fn epoch(path: &Path, o: ImageLoaderOptions, e: u64) -> Vec<(Vec<usize>, Vec<i64>, Vec<u8>)> {
    let mut l = ImageLoader::open(path, o).unwrap();
    l.set_epoch(e);
    let batches = l.epoch();
    let n = batches.total();
    let out: Vec<_> = batches
        .map(|b| {
            let b = b.unwrap();
            (b.samples.clone(), b.labels.clone(), b.pixels().to_vec())
        })
        .collect();
    assert_eq!(out.len(), n);
    out
}

#[test]
fn every_sample_once_per_epoch_across_ranks_and_the_same_batch_count() {
    let f = dataset("ranks", 203);
    for ranks in [1, 2, 4] {
        for order in [Order::Sequential, Order::Random, Order::QuasiRandom] {
            let mut all = Vec::new();
            let mut counts = BTreeSet::new();
            for rank in 0..ranks {
                let mut o = options(8);
                (o.rank, o.ranks, o.order) = (rank, ranks, order);
                let batches = epoch(&f.0, o, 1);
                counts.insert(batches.len());
                for (samples, labels, pixels) in batches {
                    let want: Vec<i64> = samples.iter().map(|&s| s as i64).collect();
                    assert_eq!(labels, want, "labels follow their samples");
                    assert_eq!(pixels.len(), samples.len() * 32 * 32 * 3);
                    all.extend(samples);
                }
            }
            all.sort_unstable();
            assert_eq!(
                all,
                (0..203).collect::<Vec<_>>(),
                "{ranks} ranks, {order:?}"
            );
            assert_eq!(counts.len(), 1, "every rank the same number of batches");
        }
    }
}

#[test]
fn pixels_follow_the_seed_not_the_threads() {
    let f = dataset("seed", 60);
    let one = {
        let mut o = options(16);
        o.threads = 1;
        epoch(&f.0, o, 2)
    };
    let four = {
        let mut o = options(16);
        o.threads = 4;
        o.prefetch = 1;
        epoch(&f.0, o, 2)
    };
    assert_eq!(
        one, four,
        "same seed and epoch: same batches whatever the threads"
    );
    let next = epoch(&f.0, options(16), 3);
    assert_ne!(one, next, "another epoch: other crops and order");
    let other = {
        let mut o = options(16);
        o.seed = 12;
        epoch(&f.0, o, 2)
    };
    assert_ne!(one, other, "another seed");
    // Not blank, and not all alike.
    let px = &one[0].2;
    let mean = px.iter().map(|&v| v as f64).sum::<f64>() / px.len() as f64;
    assert!((30.0..220.0).contains(&mean), "mean pixel {mean}");
}

#[test]
fn the_process_cache_reads_each_page_once_per_epoch_in_quasi_random_order() {
    let f = dataset("pcache", 400);
    let pages = braid_data::beton::Beton::open(&f.0)
        .unwrap()
        .index()
        .pages();
    assert!(pages >= 10, "the file spans {pages} pages");
    let mut o = options(16);
    o.cache = Cache::Process { pages: 0 };
    let mut l = ImageLoader::open(&f.0, o).unwrap();
    let mut read = 0;
    for e in 0..2 {
        let mut seen = 0;
        for b in l.epoch() {
            seen += b.unwrap().len();
        }
        assert_eq!(seen, 400);
        let loads = l.page_loads().unwrap();
        assert_eq!(loads - read, pages, "epoch {e}: every page read once");
        read = loads;
    }
    let (bound, peak) = l.cache_bound().unwrap();
    assert!(
        peak as u64 * PAGE <= bound,
        "peak {peak} pages within {bound} bytes"
    );
    // The OS cache gives the same batches.
    let mut o = options(16);
    o.cache = Cache::Process { pages: 0 };
    let via_pool = epoch(&f.0, o, 5);
    let via_map = epoch(&f.0, options(16), 5);
    assert_eq!(via_pool, via_map);
}

#[test]
fn a_reduced_scale_decode_looks_like_the_full_one() {
    // A 640x480 JPEG, its centre 448x448 into 96x96: decoded at 1/4.
    let (w, h) = (640, 480);
    let jpg = jpeg::encode(&picture(w, h, 3), w as u32, h as u32, 90).unwrap();
    let img = braid_data::beton::Image {
        mode: ImageMode::Jpeg,
        width: w as u16,
        height: h as u16,
        data: &jpg,
    };
    let aug = Augment {
        crop: Crop::Center {
            ratio: 448.0 / 480.0,
        },
        width: 96,
        height: 96,
        flip: false,
        pixels: Pixels::U8,
        layout: Layout::Nhwc,
    };
    let mut fast = vec![0u8; 96 * 96 * 3];
    aug.apply(
        &img,
        &mut braid_core::rng::Rng::new(0),
        &mut Scratch::default(),
        &mut fast,
    )
    .unwrap();
    let (_, full) = jpeg::decode(&jpg).unwrap();
    let mut slow = vec![0u8; 96 * 96 * 3];
    resize_area_crop(&full, w, h, 96, 16, 448, 448, &mut slow, 96, 96);
    let mad = fast
        .iter()
        .zip(&slow)
        .map(|(&a, &b)| (a as f64 - b as f64).abs())
        .sum::<f64>()
        / fast.len() as f64;
    assert!(mad < 4.0, "mean absolute difference {mad}");
}

#[test]
fn a_corrupt_jpeg_names_its_sample_and_ends_the_epoch() {
    let f = dataset("corrupt", 50);
    // Damage sample 7's JPEG (its scan data): find it through the index.
    let (ptr, size) = {
        let b = braid_data::beton::Beton::open(&f.0).unwrap();
        let e = b.index().extent(7, 0).unwrap();
        (e.ptr as usize, e.size as usize)
    };
    let mut bytes = std::fs::read(&f.0).unwrap();
    for b in &mut bytes[ptr + size / 2..ptr + size - 2] {
        *b = 0xff;
    }
    std::fs::write(&f.0, &bytes).unwrap();
    let mut o = options(10);
    o.order = Order::Sequential;
    let mut l = ImageLoader::open(&f.0, o).unwrap();
    let results: Vec<_> = l.epoch().collect();
    let err = results
        .iter()
        .find_map(|r| r.as_ref().err())
        .expect("an error");
    assert!(err.contains("sample 7"), "{err}");
    assert!(results.last().unwrap().is_err(), "nothing after the error");
}
