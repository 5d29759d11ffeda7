//! braid's JPEG codec (`braid_data::jpeg`) against the real ffcv: the
//! JPEGs in `tests/fixtures/ffcv/images.beton` were written by ffcv 1.0.2
//! (OpenCV's encoder) and `images.jpeg-decoded.bin` holds them decoded by
//! ffcv's own decoder (TurboJPEG, `TJFLAG_FASTDCT`). Also: windows and
//! scaled decodes against the full decode, an encode/decode round trip,
//! and corrupt data, which must give errors (never a panic or an abort).

mod common;
use common::ffcv_fixture;

use braid_data::beton::{Beton, ImageMode, Value};
use braid_data::jpeg::{decode, decode_crop, decode_crop_wide, encode, info, scaled_size};

/// Whether braid was built with libjpeg-turbo; says so when it was not
/// (`build.rs` turns JPEG support off, with a warning, without it).
fn libjpeg() -> bool {
    match info(&[]) {
        Err(e) if e.contains("built without libjpeg-turbo") => {
            eprintln!("skipped: {e}");
            false
        }
        _ => true,
    }
}

/// A stored image of the fixture: (sample, field name, width, height,
/// payload).
struct Stored {
    sample: usize,
    field: String,
    mode: ImageMode,
    width: u32,
    height: u32,
    data: Vec<u8>,
}

/// Every image of `images.beton`, in sample order then field order.
fn stored_images() -> Vec<Stored> {
    let b = Beton::open(&ffcv_fixture("images.beton")).unwrap();
    let fields: Vec<String> = b.index().fields.iter().map(|f| f.name.clone()).collect();
    let mut out = vec![];
    for s in 0..b.len() {
        for (f, name) in fields.iter().enumerate() {
            if let Value::Image(img) = b.value(s, f).unwrap() {
                out.push(Stored {
                    sample: s,
                    field: name.clone(),
                    mode: img.mode,
                    width: img.width as u32,
                    height: img.height as u32,
                    data: img.data.to_vec(),
                });
            }
        }
    }
    out
}

/// (max |a - b|, count of bytes that differ).
fn diff(a: &[u8], b: &[u8]) -> (u8, usize) {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).fold((0, 0), |(m, n), (&x, &y)| {
        let d = x.abs_diff(y);
        (m.max(d), n + (d != 0) as usize)
    })
}

fn mean_abs_diff(a: &[u8], b: &[u8]) -> f64 {
    assert_eq!(a.len(), b.len());
    let sum: u64 = a.iter().zip(b).map(|(&x, &y)| x.abs_diff(y) as u64).sum();
    sum as f64 / a.len() as f64
}

/// The `w` × `h` window at (`x`, `y`) of a `width`-wide RGB image.
fn window(rgb: &[u8], width: u32, x: u32, y: u32, w: u32, h: u32) -> Vec<u8> {
    let mut out = Vec::with_capacity((w * h * 3) as usize);
    for r in y..y + h {
        let start = ((r * width + x) * 3) as usize;
        out.extend_from_slice(&rgb[start..start + (w * 3) as usize]);
    }
    out
}

/// A smooth test picture with some texture, `width` × `height` RGB.
fn picture(width: u32, height: u32) -> Vec<u8> {
    let mut rgb = Vec::with_capacity((width * height * 3) as usize);
    for y in 0..height {
        for x in 0..width {
            let (fx, fy) = (x as f64, y as f64);
            rgb.push((128.0 + 100.0 * (fx / 23.0).sin() * (fy / 31.0).cos()) as u8);
            rgb.push((128.0 + 90.0 * ((fx + fy) / 40.0).cos()) as u8);
            rgb.push(((fx * 0.7 + fy * 0.4) % 256.0) as u8);
        }
    }
    rgb
}

/// Mean |difference| between `scaled`, a `width` × `height` RGB image
/// decoded at 1/`denom` scale, and averages of `denom` × `denom` boxes of
/// `full`, its full decode: over the whole boxes only (libjpeg's partial
/// blocks at the right and bottom edges also average the padding the
/// encoder added).
fn mean_abs_diff_from_boxes(
    scaled: &[u8],
    full: &[u8],
    width: u32,
    height: u32,
    denom: u32,
) -> f64 {
    let (sw, _) = scaled_size(width, height, denom);
    let (mut sum, mut n) = (0.0, 0);
    for by in 0..height / denom {
        for bx in 0..width / denom {
            for c in 0..3 {
                let mut total = 0u32;
                for y in by * denom..(by + 1) * denom {
                    for x in bx * denom..(bx + 1) * denom {
                        total += full[((y * width + x) * 3 + c) as usize] as u32;
                    }
                }
                let mean = total as f64 / (denom * denom) as f64;
                sum += (scaled[((by * sw + bx) * 3 + c) as usize] as f64 - mean).abs();
                n += 1;
            }
        }
    }
    sum / n as f64
}

#[test]
fn decodes_ffcv_jpegs_to_ffcvs_pixels() {
    if !libjpeg() {
        return;
    }
    let want = std::fs::read(ffcv_fixture("images.jpeg-decoded.bin")).unwrap();
    let (mut at, mut images, mut max, mut differing) = (0, 0, 0u8, 0usize);
    for img in stored_images() {
        if img.mode != ImageMode::Jpeg {
            continue;
        }
        let (inf, rgb) = decode(&img.data).unwrap_or_else(|e| {
            panic!("sample {} field {}: {e}", img.sample, img.field);
        });
        assert_eq!(
            (inf.width, inf.height, inf.components),
            (img.width, img.height, 3),
            "sample {} field {}",
            img.sample,
            img.field
        );
        let theirs = &want[at..at + rgb.len()];
        at += rgb.len();
        let (m, n) = diff(&rgb, theirs);
        max = max.max(m);
        differing += n;
        images += 1;
    }
    assert_eq!(at, want.len(), "ffcv decoded more images than braid found");
    eprintln!(
        "{images} ffcv JPEGs, {at} bytes: max |braid - ffcv| = {max}, {differing} bytes differ"
    );
    assert!(images > 20, "only {images} JPEG images in the fixture");
    // The same library (libjpeg-turbo 2.1.5), IDCT, upsampling and colour
    // conversion as ffcv's loader: the same bytes.
    assert_eq!((max, differing), (0, 0));
}

#[test]
fn encodes_the_bytes_ffcv_wrote() {
    if !libjpeg() {
        return;
    }
    // ffcv's `jpg` field (quality 75) and its `raw` field hold the same
    // pixels (both resized to max_resolution 64 by the same code): braid's
    // encoder, given the raw pixels, writes the JPEG ffcv wrote.
    let images = stored_images();
    let mut checked = 0;
    for raw in images.iter().filter(|i| i.field == "raw") {
        let jpg = images
            .iter()
            .find(|i| i.field == "jpg" && i.sample == raw.sample)
            .unwrap();
        assert_eq!(raw.mode, ImageMode::Raw);
        assert_eq!(jpg.mode, ImageMode::Jpeg);
        assert_eq!((raw.width, raw.height), (jpg.width, jpg.height));
        let ours = encode(&raw.data, raw.width, raw.height, 75).unwrap();
        assert!(
            ours == jpg.data,
            "sample {}: braid's JPEG ({} bytes) is not ffcv's ({} bytes)",
            raw.sample,
            ours.len(),
            jpg.data.len()
        );
        checked += 1;
    }
    assert!(checked > 20);
}

/// 45x37 progressive 4:2:2 JPEG (OpenCV's encoder, optimised Huffman tables).
const PROGRESSIVE_422: &str =
    "ffd8ffe000104a46494600010100000100010000ffdb0043000d090a0b0a080d0b0a0b0e0e0d0f1320151312\
    1213271c1e17202e2931302e292d2c333a4a3e333646372c2d405741464c4e525352323e5a615a50604a5152\
    4fffdb0043010e0e0e131113261515264f352d354f4f4f4f4f4f4f4f4f4f4f4f4f4f4f4f4f4f4f4f4f4f4f4f\
    4f4f4f4f4f4f4f4f4f4f4f4f4f4f4f4f4f4f4f4f4f4f4f4f4f4fffc20011080025002d030121000211010311\
    01ffc400190001010101010100000000000000000000040302050601ffc40018010003010100000000000000\
    00000000000203040500ffda000c03010002100310000001dca9ca21c3574b451b353992d76825b28f2a2d5d\
    18c6b53327ccfd2733a06b6692af2a83a1ee045a625fffc40019100003010101000000000000000000000000\
    0102101121ffda0008010100010502e95453c4899f1d0eb122645253c4889264486244491225b28844e33fff\
    c4001a110003010003000000000000000000000000010203102131ffda0008010301013f01ca4c646cc609e8\
    a665236364f85b1714668fffc4001a110002030101000000000000000000000000020103112131ffda000801\
    0201013f01abc2d817824e0fd1b86e113a5c59e95b1716fa2c8e7fffc4001410010000000000000000000000\
    0000000040ffda0008010100063f0277ffc400191000030101010000000000000000000000000111102120ff\
    da0008010100013f21e345f4b7814dd2b9f3c6d2dafc46a5b427890b1226374fffda000c0301000200030000\
    0010bdc52c62c243dc3fffc4001811010101010100000000000000000000000111001021ffda000801030101\
    3f10aba0691c047189a46ab8ce3f6e58675c0effc40018110003010100000000000000000000000000011121\
    10ffda0008010201013f10e53d124120d07624303c180f79390f4fffc4001a10010101010101010000000000\
    0000000001002111314151ffda0008010100013f1040b076efdd9aa75e5f8ae5f6e9f64532f2dccb979b5765\
    a995d399710c80f122915dd32ccc80793c225ba0b24605e12cffd9";

/// JPEGs to crop, named: ffcv's (OpenCV's encoder, 4:2:0), braid's own,
/// of sizes that are not multiples of the 16-pixel iMCU, a progressive
/// 4:2:2 one and a grayscale one.
fn crop_subjects() -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<(String, Vec<u8>)> = stored_images()
        .into_iter()
        .filter(|i| i.mode == ImageMode::Jpeg)
        .take(12)
        .map(|i| (format!("ffcv sample {} {}", i.sample, i.field), i.data))
        .collect();
    for (w, h) in [(203, 157), (64, 48), (17, 33), (400, 300)] {
        let jpeg = encode(&picture(w, h), w, h, 85).unwrap();
        out.push((format!("braid {w}x{h}"), jpeg));
    }
    out.push(("progressive 4:2:2".into(), unhex(PROGRESSIVE_422)));
    out.push(("grayscale".into(), unhex(GRAY)));
    out
}

/// A small deterministic generator (xorshift) for crop windows.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u32) -> u32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as u32
    }
}

/// Windows of a `w` × `h` image: edges, corners, iMCU boundaries and
/// pixels beside them, single pixels, the whole image, and random ones.
fn windows(w: u32, h: u32, rng: &mut Rng) -> Vec<(u32, u32, u32, u32)> {
    let mut v = vec![(0, 0, w, h), (0, 0, 1, 1), (w - 1, h - 1, 1, 1)];
    for x in [0, 1, 7, 8, 15, 16, 17, 31, 32, 33] {
        for y in [0, 1, 8, 15, 16, 17] {
            if x < w && y < h {
                v.push((x, y, (w - x).min(13), (h - y).min(9)));
                v.push((x, y, w - x, h - y));
                v.push((x, y, 1, 1));
            }
        }
    }
    for _ in 0..40 {
        let (x, y) = (rng.below(w), rng.below(h));
        v.push((x, y, 1 + rng.below(w - x), 1 + rng.below(h - y)));
    }
    v
}

#[test]
fn windows_equal_the_full_decodes() {
    if !libjpeg() {
        return;
    }
    let mut rng = Rng(0x9e3779b97f4a7c15);
    let mut crops = 0;
    for (name, jpeg) in crop_subjects() {
        let (inf, full) = decode(&jpeg).unwrap();
        for (x, y, w, h) in windows(inf.width, inf.height, &mut rng) {
            let mut out = vec![0u8; (w * h * 3) as usize];
            decode_crop(&jpeg, 1, x, y, w, h, &mut out).unwrap();
            let want = window(&full, inf.width, x, y, w, h);
            let (m, n) = diff(&out, &want);
            assert!(
                n == 0,
                "{name}: window {w}x{h} at ({x}, {y}): {n} bytes differ, by up to {m}"
            );
            // The same window left in libjpeg's wider rows.
            let mut wide = vec![0u8; (inf.width * h * 3) as usize];
            let (rx, rw) = decode_crop_wide(&jpeg, 1, x, y, w, h, &mut wide).unwrap();
            assert!(
                rx <= x && x + w <= rx + rw && rx + rw <= inf.width,
                "{name}: row {rx}+{rw} for {x}+{w}"
            );
            assert_eq!(
                window(&wide, rw, x - rx, 0, w, h),
                want,
                "{name}: wide window {w}x{h} at ({x}, {y})"
            );
            crops += 1;
        }
    }
    eprintln!("{crops} windows equal the full decode's");
}

#[test]
fn scaled_decodes_are_downscaled_images() {
    if !libjpeg() {
        return;
    }
    let mut rng = Rng(12345);
    let mut worst = 0.0f64;
    for (name, jpeg) in crop_subjects() {
        let (inf, full) = decode(&jpeg).unwrap();
        for denom in [2, 4, 8] {
            let (sw, sh) = scaled_size(inf.width, inf.height, denom);
            let mut scaled = vec![0u8; (sw * sh * 3) as usize];
            decode_crop(&jpeg, denom, 0, 0, sw, sh, &mut scaled).unwrap();
            // Close to a box filter of the full decode (the scaled IDCT
            // filters differently; measured: at most ~1.8).
            // Not for 4:2:2 at 1/4 and 1/8: libjpeg scales a component's
            // IDCT alike across and down, so it cannot give 4:2:2 chroma
            // back its full width there, and box-upsamples chroma of half
            // the width (TurboJPEG, ffcv's decoder, gives the same bytes).
            let mad = mean_abs_diff_from_boxes(&scaled, &full, inf.width, inf.height, denom);
            if !(name.contains("4:2:2") && denom > 2) {
                worst = worst.max(mad);
                assert!(
                    mad < 3.0,
                    "{name} at 1/{denom}: mean |scaled - box filtered| = {mad:.2}"
                );
            }
            // Windows of the scaled image equal the scaled full decode's.
            for (x, y, w, h) in windows(sw, sh, &mut rng) {
                let mut out = vec![0u8; (w * h * 3) as usize];
                decode_crop(&jpeg, denom, x, y, w, h, &mut out).unwrap();
                let (m, n) = diff(&out, &window(&scaled, sw, x, y, w, h));
                assert!(
                    n == 0,
                    "{name} at 1/{denom}, window {w}x{h} at ({x}, {y}): {n} bytes differ, by up to {m}"
                );
            }
            // Outside the scaled image is outside.
            let e = decode_crop(&jpeg, denom, 0, 0, sw + 1, sh, &mut vec![0; 1 << 20]).unwrap_err();
            assert!(e.contains("does not lie inside"), "{e}");
        }
    }
    eprintln!("scaled decodes: mean |scaled - box filtered| up to {worst:.2}");
}

#[test]
fn encode_then_decode_is_close() {
    if !libjpeg() {
        return;
    }
    let (w, h) = (203, 157);
    let rgb = picture(w, h);
    let jpeg = encode(&rgb, w, h, 90).unwrap();
    assert_eq!(&jpeg[..2], &[0xff, 0xd8]);
    let (inf, back) = decode(&jpeg).unwrap();
    assert_eq!((inf.width, inf.height, inf.components), (w, h, 3));
    let mad = mean_abs_diff(&rgb, &back);
    let (max, _) = diff(&rgb, &back);
    eprintln!(
        "{w}x{h} at quality 90: {} bytes, mean |error| {mad:.3}, max {max}",
        jpeg.len()
    );
    assert!(mad < 1.5, "mean |error| {mad}");
    assert!(max < 40, "max |error| {max}");
    // Lower quality, smaller file.
    assert!(encode(&rgb, w, h, 30).unwrap().len() < jpeg.len());
}

/// 12x10 grayscale JPEG, pixel (x, y) = 9x + 13y (written by libjpeg).
const GRAY: &str = "ffd8ffe000104a46494600010100000100010000ffdb0043000302020302020303030304030304050805050404050a070706080c0a0c0c0b0a0b0b0d0e12100d0e110e0b0b1016101113141515150c0f171816141812141514ffc0000b08000a000c01011100ffc4001500010100000000000000000000000000000805ffc40024100000030704030000000000000000000000030701020406232441152533425192a1ffda0008010100003f003ba5a84f0dbf8c0514bc84ed655bfc1612d86268d2731d581452f4313a59549cf560ffd9";

/// 8x8 CMYK JPEG (Adobe marker; written by libjpeg).
const CMYK: &str = "ffd8ffee000e41646f626500640000000000ffdb0043000302020302020303030304030304050805050404050a070706080c0a0c0c0b0a0b0b0d0e12100d0e110e0b0b1016101113141515150c0f171816141812141514ffc000140800080008044311004d11005911004b1100ffc400160001010100000000000000000000000000050304ffc40023100002020103040301000000000000000002030104050607120811132100142225ffda000e0443004d0059004b00003f00236dcd3d3e74b798ccafec56cee5d3180c29d46b10e0bb656622d068094ac92b16be2678f794c0c10910cfc9eea0d7d2db35a2f6bb1f67866b54dd4dec85458a59fcdaf3ca21b1332c5f3b309202118e5f59d1ca22244b7eece1d3abf7eb41e82a6baeeafa3b190db52286039576e78d86b222fc98c2154cc6423d4b4e24a67f22be80751dd6ea5f59eb4b790ae9d27887151a779d9317d1463e98f8e6c2dd3d8010c95b2cfafcc798e7b97b29ffd9";

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

#[test]
fn grayscale_decodes_to_gray_rgb_and_cmyk_is_refused() {
    if !libjpeg() {
        return;
    }
    let gray = unhex(GRAY);
    let (inf, rgb) = decode(&gray).unwrap();
    assert_eq!((inf.width, inf.height, inf.components), (12, 10, 1));
    let mut err = 0.0;
    for (i, px) in rgb.chunks_exact(3).enumerate() {
        assert!(px[0] == px[1] && px[1] == px[2], "pixel {i}: {px:?}");
        let (x, y) = (i as u32 % 12, i as u32 / 12);
        err += (px[0] as f64 - (9 * x + 13 * y) as f64).abs();
    }
    assert!(err / 120.0 < 3.0, "mean |error| {}", err / 120.0);

    let cmyk = unhex(CMYK);
    assert_eq!(info(&cmyk).unwrap().components, 4);
    let e = decode(&cmyk).unwrap_err();
    assert!(e.contains("CMYK"), "{e}");
}

#[test]
fn corrupt_jpegs_are_errors() {
    if !libjpeg() {
        return;
    }
    let (w, h) = (203, 157);
    let good = encode(&picture(w, h), w, h, 90).unwrap();
    let mut png = b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR".to_vec();
    png.extend_from_slice(&[0; 64]);
    let mut garbage = vec![0u8; 5000];
    let mut rng = Rng(99);
    for b in &mut garbage {
        *b = rng.below(256) as u8;
    }
    // The frame header (SOF0) says height and width after its marker,
    // length and precision.
    let mut huge = good.clone();
    let sof = good.windows(2).position(|m| m == [0xff, 0xc0]).unwrap();
    huge[sof + 5..sof + 9].copy_from_slice(&[0xff, 0xdc, 0xff, 0xdc]);
    assert_eq!(
        (info(&huge).unwrap().width, info(&huge).unwrap().height),
        (65500, 65500)
    );
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("empty", vec![], "Empty input file"),
        ("zero bytes", vec![0; 1000], "Not a JPEG file"),
        ("PNG", png, "Not a JPEG file: starts with 0x89 0x50"),
        ("garbage", garbage, "Not a JPEG file"),
        ("SOI only", good[..2].to_vec(), "Premature end of JPEG file"),
        (
            "header only",
            good[..300].to_vec(),
            "Premature end of JPEG file",
        ),
        (
            "half",
            good[..good.len() / 2].to_vec(),
            "Premature end of JPEG file",
        ),
        (
            "all but the end marker",
            good[..good.len() - 2].to_vec(),
            "Premature end of JPEG file",
        ),
        (
            "a header claiming 65500x65500",
            huge,
            "premature end of data segment",
        ),
    ];
    for (what, bytes, says) in &cases {
        let e = decode(bytes).unwrap_err();
        assert!(e.contains(says), "{what}: {e}");
        let mut out = vec![0u8; (w * h * 3) as usize];
        assert!(
            decode_crop(bytes, 2, 10, 50, 40, 40, &mut out).is_err(),
            "{what}"
        );
    }

    // Bytes changed at random in the entropy-coded data: an error or some
    // picture, never a crash.
    let mut rng = Rng(7);
    let (mut errors, mut pictures) = (0, 0);
    for _ in 0..300 {
        let mut bad = good.clone();
        for _ in 0..1 + rng.below(4) {
            let at = 2 + rng.below(bad.len() as u32 - 2) as usize;
            bad[at] = rng.below(256) as u8;
        }
        match decode(&bad) {
            Ok((inf, rgb)) => {
                assert_eq!(rgb.len(), (inf.width * inf.height * 3) as usize);
                pictures += 1;
            }
            Err(e) => {
                assert!(!e.is_empty());
                errors += 1;
            }
        }
    }
    eprintln!("300 damaged JPEGs: {errors} errors, {pictures} decoded");

    // Windows outside the image, and buffers too small.
    let mut out = vec![0u8; (w * h * 3) as usize];
    for (x, y, cw, ch) in [
        (0, 0, w + 1, 1),
        (0, 0, 1, h + 1),
        (w, 0, 1, 1),
        (0, h, 1, 1),
        (u32::MAX, 0, 2, 1),
        (0, 0, 0, 5),
    ] {
        let e = decode_crop(&good, 1, x, y, cw, ch, &mut out).unwrap_err();
        assert!(
            e.contains("does not lie inside"),
            "{cw}x{ch} at ({x}, {y}): {e}"
        );
    }
    let e = decode_crop(&good, 1, 0, 0, 10, 10, &mut [0u8; 299]).unwrap_err();
    assert!(
        e.contains("holds 299 bytes") && e.contains("needs 300"),
        "{e}"
    );
    let e = decode_crop(&good, 1, 0, 0, 10, 10, &mut []).unwrap_err();
    assert!(e.contains("holds 0 bytes"), "{e}");
}

#[test]
fn decodes_from_many_threads() {
    if !libjpeg() {
        return;
    }
    let jpegs: Vec<Vec<u8>> = crop_subjects().into_iter().map(|(_, j)| j).collect();
    let want: Vec<Vec<u8>> = jpegs.iter().map(|j| decode(j).unwrap().1).collect();
    std::thread::scope(|s| {
        for t in 0..8 {
            let (jpegs, want) = (&jpegs, &want);
            s.spawn(move || {
                for round in 0..20 {
                    let i = (t * 7 + round) % jpegs.len();
                    assert_eq!(decode(&jpegs[i]).unwrap().1, want[i]);
                }
            });
        }
    });
}
