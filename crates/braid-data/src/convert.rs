//! Making `.beton` files from other data (`braid data write`): token
//! streams into GPT windows, JSON lines into a JSON field, image folders
//! into image and label fields. Samples are encoded in parallel (rayon)
//! in chunks and written in order, so the output is the same on any
//! number of cores; `progress` hears after each chunk.

use std::path::{Path, PathBuf};

use rayon::prelude::*;

use braid_core::rng::Rng;

use crate::beton::{DType, FieldType, FieldValue, ImageMode, Writer, Written};
use crate::tokens::Dataset;

/// Samples encoded between two progress reports.
const CHUNK: usize = 256;

/// Called with (samples written, samples in all) after each chunk.
pub type Progress<'a> = dyn FnMut(u64, u64) + 'a;

/// Writes `n` samples whose values `make(i)` builds (in parallel) into
/// `out`. A thread of its own lays the samples out in pages and writes
/// them while the next chunk is being made (at most two chunks are held
/// at once); `progress` hears of each chunk once it is made.
pub fn write_samples(
    out: &Path,
    fields: &[(String, FieldType)],
    n: u64,
    page_size: u64,
    make: &(dyn Fn(u64) -> Result<Vec<FieldValue>, String> + Sync),
    progress: &mut Progress,
) -> Result<Written, String> {
    let mut w = Writer::create(out, fields, n, page_size)?;
    let step = CHUNK as u64 * rayon::current_num_threads() as u64;
    std::thread::scope(|scope| {
        // A rendezvous channel: a chunk is handed over only when the
        // writer has finished the one before.
        let (tx, rx) = std::sync::mpsc::sync_channel::<Vec<Vec<FieldValue>>>(0);
        let writer = scope.spawn(move || -> Result<Writer, String> {
            for chunk in rx {
                for s in &chunk {
                    w.push(s)?;
                }
            }
            Ok(w)
        });
        let mut at = 0u64;
        let made = (|| -> Result<(), String> {
            while at < n {
                let end = (at + step).min(n);
                let chunk: Vec<Vec<FieldValue>> = (at..end)
                    .into_par_iter()
                    .map(make)
                    .collect::<Result<_, _>>()?;
                if tx.send(chunk).is_err() {
                    // The writer stopped; its error is told below.
                    return Ok(());
                }
                at = end;
                progress(at, n);
            }
            Ok(())
        })();
        drop(tx);
        let w = writer
            .join()
            .map_err(|_| "the .beton writer thread panicked".to_string())?;
        made?;
        w?.finish()
    })
}

/// GPT training windows of `dataset`: `t + 1` tokens per sample (a
/// window's inputs and the token after them), side by side at stride `t`;
/// the training part's windows first, then the held-out part's, told
/// apart by the int field `split` (0: train, 1: held out). Tokens are u16
/// when the vocabulary allows, else u32.
pub fn token_windows(
    out: &Path,
    dataset: &Dataset,
    t: usize,
    vocab: usize,
    page_size: u64,
    progress: &mut Progress,
) -> Result<Written, String> {
    let (train, held) = (dataset.windows(t, false), dataset.windows(t, true));
    if train == 0 || held == 0 {
        return Err(format!(
            "the data holds {train} training and {held} held-out windows of {t} tokens: use more data or a shorter --seq"
        ));
    }
    let dtype = if vocab <= 1 << 16 && (dataset.max_token() as usize) < 1 << 16 {
        DType::U16
    } else {
        DType::U32
    };
    let fields = vec![
        (
            "tokens".to_string(),
            FieldType::Tokens {
                dtype,
                window: t as u64 + 1,
                vocab: vocab as u64,
            },
        ),
        ("split".to_string(), FieldType::Int),
    ];
    let make = |i: u64| -> Result<Vec<FieldValue>, String> {
        let (i, eval) = if (i as usize) < train {
            (i as usize, false)
        } else {
            (i as usize - train, true)
        };
        let (mut x, mut y) = (vec![0u32; t], vec![0u32; t]);
        dataset.window(i, t, eval, &mut x, &mut y)?;
        x.push(y[t - 1]);
        Ok(vec![FieldValue::Tokens(x), FieldValue::Int(eval as i64)])
    };
    write_samples(
        out,
        &fields,
        (train + held) as u64,
        page_size,
        &make,
        progress,
    )
}

/// One JSON field (`field`) per line of a JSON-lines file (blank lines
/// skipped); a line that is not JSON is an error naming it.
pub fn json_lines(
    out: &Path,
    input: &Path,
    field: &str,
    page_size: u64,
    progress: &mut Progress,
) -> Result<Written, String> {
    let bytes =
        std::fs::read(input).map_err(|e| format!("cannot read {}: {e}", input.display()))?;
    let text = crate::tokens::utf8_text(&bytes)
        .map_err(|e| format!("cannot read {}: {e}", input.display()))?;
    let lines: Vec<(usize, &str)> = text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .collect();
    if lines.is_empty() {
        return Err(format!("{}: no JSON lines", input.display()));
    }
    let fields = vec![(field.to_string(), FieldType::Json)];
    let make = |i: u64| -> Result<Vec<FieldValue>, String> {
        let (no, line) = lines[i as usize];
        serde_json::from_str::<serde::de::IgnoredAny>(line)
            .map_err(|e| format!("{}:{}: not JSON ({e})", input.display(), no + 1))?;
        Ok(vec![FieldValue::Json(line.trim().to_string())])
    };
    write_samples(out, &fields, lines.len() as u64, page_size, &make, progress)
}

/// How [`image_folder`] stores each image: FFCV's `RGBImageField`
/// `write_mode`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum WriteMode {
    /// Every image as JPEG.
    Jpg,
    /// Every image as raw RGB pixels.
    Raw,
    /// JPEG with this probability, else raw. The draw is a deterministic
    /// function of [`ImageOptions::seed`] and the sample's index (FFCV
    /// draws from numpy's global generator, so which images it
    /// compresses differs).
    Proportion(f64),
    /// JPEG when the raw pixels (width × height × 3 bytes) exceed the
    /// threshold, else raw; all raw without one (FFCV's `smart` rule).
    Smart(Option<u64>),
}

/// How [`image_folder`] encodes images.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ImageOptions {
    /// JPEG, raw, or a mix.
    pub mode: WriteMode,
    /// Images whose longer side exceeds this are shrunk (area averaging)
    /// so that it is about this, as FFCV's `max_resolution`.
    pub max_resolution: Option<u32>,
    /// JPEG quality, 1 to 100.
    pub quality: u8,
    /// Seeds [`WriteMode::Proportion`]'s draws.
    pub seed: u64,
    /// Shrink from the whole decoded image, as FFCV does, so the pixels
    /// are FFCV's. Otherwise (faster) an image that shrinks by 4 or more
    /// is decoded at 1/2, 1/4 or 1/8 scale by the JPEG decoder (its DCT),
    /// the smallest that is still twice the output size, and shrunk from
    /// there: the same output size, pixels a little different.
    pub exact_resize: bool,
}

/// The images of a torchvision `ImageFolder` layout, `root/<class>/...`:
/// classes are the sorted subdirectory names, each image labelled with
/// its class's index; within a class, files (found recursively) sorted
/// as torchvision sorts them.
#[derive(Debug, Clone, PartialEq)]
pub struct ImageFolder {
    /// Class names; a class's label is its index.
    pub classes: Vec<String>,
    /// Each image and its label, in the order they are written.
    pub images: Vec<(PathBuf, u32)>,
    /// Files passed over: not `.jpg` or `.jpeg` (any case).
    pub skipped: usize,
}

impl ImageFolder {
    /// Lists `root`'s classes and JPEG images; no class, or a class with
    /// no JPEG image, is an error.
    pub fn scan(root: &Path) -> Result<ImageFolder, String> {
        let read = |d: &Path| -> Result<Vec<std::fs::DirEntry>, String> {
            std::fs::read_dir(d)
                .and_then(|r| r.collect::<Result<Vec<_>, _>>())
                .map_err(|e| format!("cannot read {}: {e}", d.display()))
        };
        let mut classes: Vec<String> = read(root)?
            .into_iter()
            .filter(|e| e.path().is_dir())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        classes.sort();
        if classes.is_empty() {
            return Err(format!(
                "{}: no class folders (an image folder holds one subdirectory per class, images inside)",
                root.display()
            ));
        }
        let (mut images, mut skipped) = (Vec::new(), 0);
        for (label, class) in classes.iter().enumerate() {
            // (directory, file name) pairs, sorted as torchvision sorts
            // os.walk's output.
            let mut files: Vec<(String, String)> = Vec::new();
            let mut dirs = vec![root.join(class)];
            while let Some(d) = dirs.pop() {
                for e in read(&d)? {
                    let path = e.path();
                    if path.is_dir() {
                        dirs.push(path);
                    } else {
                        let name = e.file_name().to_string_lossy().into_owned();
                        let ext = name.rsplit_once('.').map(|(_, x)| x.to_ascii_lowercase());
                        if matches!(ext.as_deref(), Some("jpg" | "jpeg")) {
                            files.push((d.to_string_lossy().into_owned(), name));
                        } else {
                            skipped += 1;
                        }
                    }
                }
            }
            if files.is_empty() {
                return Err(format!(
                    "{}: class '{class}' holds no JPEG images (.jpg or .jpeg; {skipped} other files skipped so far)",
                    root.display()
                ));
            }
            files.sort();
            images.extend(
                files
                    .into_iter()
                    .map(|(d, f)| (Path::new(&d).join(f), label as u32)),
            );
        }
        Ok(ImageFolder {
            classes,
            images,
            skipped,
        })
    }
}

/// An image folder (see [`ImageFolder`]) as FFCV's `DatasetWriter` writes
/// torchvision's `ImageFolder`: fields `image` (RGB image) and `label`
/// (int).
pub fn image_folder(
    out: &Path,
    root: &Path,
    opts: &ImageOptions,
    page_size: u64,
    progress: &mut Progress,
) -> Result<Written, String> {
    write_images(out, &ImageFolder::scan(root)?, opts, page_size, progress)
}

/// Writes `folder`'s images (see [`image_folder`]).
pub fn write_images(
    out: &Path,
    folder: &ImageFolder,
    opts: &ImageOptions,
    page_size: u64,
    progress: &mut Progress,
) -> Result<Written, String> {
    if folder.images.is_empty() {
        return Err("no images to write".into());
    }
    if !(1..=100).contains(&opts.quality) {
        return Err(format!("JPEG quality {}: use 1 to 100", opts.quality));
    }
    if opts.max_resolution == Some(0) {
        return Err("max resolution 0: use at least 1".into());
    }
    let fields = vec![
        ("image".to_string(), FieldType::RgbImage),
        ("label".to_string(), FieldType::Int),
    ];
    let make = |i: u64| -> Result<Vec<FieldValue>, String> {
        let (path, label) = &folder.images[i as usize];
        let image = encode_image(path, i, opts).map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(vec![image, FieldValue::Int(*label as i64)])
    };
    write_samples(
        out,
        &fields,
        folder.images.len() as u64,
        page_size,
        &make,
        progress,
    )
}

/// Buffers one thread reuses from image to image.
#[derive(Default)]
struct Scratch {
    file: Vec<u8>,
    decoded: Vec<u8>,
    small: Vec<u8>,
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::default();
}

/// The output size of a `w` × `h` image under `max_resolution` (FFCV's
/// `resizer`: both sides times `max / longer side`, truncated), or
/// `None` where it is not shrunk.
fn shrunk_size(w: usize, h: usize, max: Option<u32>) -> Result<Option<(usize, usize)>, String> {
    let Some(max) = max else { return Ok(None) };
    let ratio = max as f64 / w.max(h) as f64;
    if ratio >= 1.0 {
        return Ok(None);
    }
    let (nw, nh) = ((ratio * w as f64) as usize, (ratio * h as f64) as usize);
    if nw == 0 || nh == 0 {
        return Err(format!(
            "{w}x{h} shrinks to {nw}x{nh} at --max-resolution {max}: use a larger one"
        ));
    }
    Ok(Some((nw, nh)))
}

/// The JPEG decoder's scale (1/`denom`) for an image of `w` × `h` that
/// is to become `target`: the largest of 8, 4 and 2 whose scaled image
/// is still at least twice the target on both sides, else 1. (Shrinking
/// by 2 or more by area averaging after the DCT's keeps the pixels close
/// to shrinking the whole image: on photos, the mean difference is
/// about 2 levels or less, where leaving less for the area averaging
/// makes it 3 to 5.)
fn decode_denom(w: u32, h: u32, target: Option<(usize, usize)>) -> u32 {
    let Some((nw, nh)) = target else { return 1 };
    [8, 4, 2]
        .into_iter()
        .find(|&d| {
            let (sw, sh) = crate::jpeg::scaled_size(w, h, d);
            sw as usize >= 2 * nw && sh as usize >= 2 * nh
        })
        .unwrap_or(1)
}

/// One image file, decoded, shrunk to `max_resolution` (see
/// [`shrunk_size`]; from a decode at reduced scale unless
/// `exact_resize`, see [`ImageOptions`]) and stored as `opts.mode` says.
fn encode_image(path: &Path, index: u64, opts: &ImageOptions) -> Result<FieldValue, String> {
    SCRATCH.with(|s| encode_image_with(&mut s.borrow_mut(), path, index, opts))
}

fn encode_image_with(
    s: &mut Scratch,
    path: &Path,
    index: u64,
    opts: &ImageOptions,
) -> Result<FieldValue, String> {
    use std::io::Read as _;
    s.file.clear();
    std::fs::File::open(path)
        .and_then(|mut f| f.read_to_end(&mut s.file))
        .map_err(|e| format!("cannot read: {e}"))?;
    let info = crate::jpeg::info(&s.file)?;
    let (w, h) = (info.width as usize, info.height as usize);
    let target = shrunk_size(w, h, opts.max_resolution)?;
    let denom = if opts.exact_resize {
        1
    } else {
        decode_denom(info.width, info.height, target)
    };
    let (dw, dh) = crate::jpeg::scaled_size(info.width, info.height, denom);
    let decoded = crate::jpeg::sized(&mut s.decoded, dw as usize * dh as usize * 3, || {
        format!("a {w}x{h} JPEG decoded at 1/{denom} scale")
    })?;
    crate::jpeg::decode_crop(&s.file, denom, 0, 0, dw, dh, decoded)?;
    let (dw, dh) = (dw as usize, dh as usize);
    let (rgb, w, h): (&[u8], usize, usize) = match target {
        Some((nw, nh)) if (nw, nh) != (dw, dh) => {
            let small =
                crate::jpeg::sized(&mut s.small, nw * nh * 3, || format!("a {nw}x{nh} image"))?;
            crate::resize::resize_area(&s.decoded[..dw * dh * 3], dw, dh, small, nw, nh);
            (&s.small[..nw * nh * 3], nw, nh)
        }
        _ => (&s.decoded[..dw * dh * 3], dw, dh),
    };
    if w > u16::MAX as usize || h > u16::MAX as usize {
        return Err(format!(
            "{w}x{h} pixels: a .beton image is at most 65535 on a side; shrink it with --max-resolution"
        ));
    }
    let jpeg = match opts.mode {
        WriteMode::Jpg => true,
        WriteMode::Raw => false,
        WriteMode::Proportion(p) => Rng::new(opts.seed ^ index).uniform() < p,
        WriteMode::Smart(threshold) => threshold.is_some_and(|t| (w * h * 3) as u64 > t),
    };
    let (mode, data) = if jpeg {
        (
            ImageMode::Jpeg,
            crate::jpeg::encode(rgb, w as u32, h as u32, opts.quality)?,
        )
    } else {
        (ImageMode::Raw, rgb.to_vec())
    };
    Ok(FieldValue::Image {
        mode,
        width: w as u16,
        height: h as u16,
        data,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::beton::Beton;

    #[test]
    fn image_modes_pick_jpeg_or_raw_as_ffcv_does() {
        let root = std::env::temp_dir().join(format!("braid-imgmodes-{}", std::process::id()));
        std::fs::create_dir_all(root.join("only")).unwrap();
        let rgb: Vec<u8> = (0..40 * 30 * 3).map(|k| (k * 7 % 251) as u8).collect();
        let jpeg = crate::jpeg::encode(&rgb, 40, 30, 90).unwrap();
        for i in 0..16 {
            std::fs::write(root.join("only").join(format!("{i:02}.JPEG")), &jpeg).unwrap();
        }
        let folder = ImageFolder::scan(&root).unwrap();
        assert_eq!(folder.images.len(), 16);
        let modes = |mode: WriteMode| -> Vec<bool> {
            let opts = ImageOptions {
                mode,
                max_resolution: None,
                quality: 90,
                seed: 3,
                exact_resize: false,
            };
            (0..16)
                .map(
                    |i| match encode_image(&folder.images[i].0, i as u64, &opts).unwrap() {
                        FieldValue::Image { mode, .. } => mode == ImageMode::Jpeg,
                        _ => unreachable!(),
                    },
                )
                .collect()
        };
        assert_eq!(modes(WriteMode::Smart(None)), [false; 16]);
        assert_eq!(modes(WriteMode::Smart(Some(40 * 30 * 3))), [false; 16]);
        assert_eq!(modes(WriteMode::Smart(Some(40 * 30 * 3 - 1))), [true; 16]);
        let mixed = modes(WriteMode::Proportion(0.5));
        assert!(mixed.contains(&true) && mixed.contains(&false), "{mixed:?}");
        assert_eq!(modes(WriteMode::Proportion(0.5)), mixed);
        assert_eq!(modes(WriteMode::Proportion(0.0)), [false; 16]);
        assert_eq!(modes(WriteMode::Proportion(1.0)), [true; 16]);
        std::fs::remove_dir_all(&root).unwrap();
    }

    /// A photo-like `w` × `h` image: smooth shading, a few hard edges,
    /// fine texture and a little noise.
    fn photo(w: usize, h: usize) -> Vec<u8> {
        let mut r = Rng::new(11);
        let mut rgb = Vec::with_capacity(w * h * 3);
        for y in 0..h {
            for x in 0..w {
                let (fx, fy) = (x as f64 / w as f64, y as f64 / h as f64);
                let disc = ((fx - 0.6).powi(2) + (fy - 0.4).powi(2)) < 0.05;
                let stripes = ((x / 97 + y / 71) % 2) as f64 * 40.0;
                let texture = 6.0 * ((x as f64 * 0.9).sin() * (y as f64 * 0.7).cos());
                for c in 0..3 {
                    let base = 60.0 + 120.0 * fx * (c as f64 + 1.0) / 3.0 + 50.0 * fy;
                    let v = base
                        + stripes
                        + texture
                        + if disc { 70.0 } else { 0.0 }
                        + (r.uniform() - 0.5) * 10.0;
                    rgb.push(v.clamp(0.0, 255.0) as u8);
                }
            }
        }
        rgb
    }

    #[test]
    fn reduced_scale_decoding_keeps_ffcv_sizes_and_nearly_its_pixels() {
        let dir = std::env::temp_dir().join(format!("braid-fastshrink-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (w, h) = (640, 481);
        let file = dir.join("photo.jpg");
        std::fs::write(
            &file,
            crate::jpeg::encode(&photo(w, h), w as u32, h as u32, 90).unwrap(),
        )
        .unwrap();
        let pixels = |v: FieldValue| match v {
            FieldValue::Image {
                width,
                height,
                data,
                ..
            } => (width as usize, height as usize, data),
            _ => unreachable!(),
        };
        // max_resolution, and the JPEG scale the fast path decodes at.
        for (max, denom) in [
            (400, 1),
            (200, 1),
            (150, 2),
            (100, 2),
            (80, 4),
            (60, 4),
            (40, 8),
            (20, 8),
        ] {
            // FFCV's sizes: both sides times max / longer side, truncated.
            let ratio = max as f64 / w.max(h) as f64;
            let want = ((ratio * w as f64) as usize, (ratio * h as f64) as usize);
            assert_eq!(shrunk_size(w, h, Some(max)).unwrap(), Some(want));
            assert_eq!(
                decode_denom(w as u32, h as u32, Some(want)),
                denom,
                "max {max}"
            );
            let run = |exact_resize: bool| {
                let opts = ImageOptions {
                    mode: WriteMode::Raw,
                    max_resolution: Some(max),
                    quality: 90,
                    seed: 0,
                    exact_resize,
                };
                pixels(encode_image(&file, 0, &opts).unwrap())
            };
            let (fast, exact) = (run(false), run(true));
            assert_eq!((fast.0, fast.1), want, "max {max}");
            assert_eq!((exact.0, exact.1), want, "max {max}");
            // The exact path is FFCV's: decode whole, then area-average.
            let (_, full) = crate::jpeg::decode(&std::fs::read(&file).unwrap()).unwrap();
            let mut ffcv = vec![0u8; want.0 * want.1 * 3];
            crate::resize::resize_area(&full, w, h, &mut ffcv, want.0, want.1);
            assert_eq!(exact.2, ffcv, "max {max}");
            let mad = fast
                .2
                .iter()
                .zip(&exact.2)
                .map(|(&a, &b)| a.abs_diff(b) as f64)
                .sum::<f64>()
                / fast.2.len() as f64;
            assert!(mad < 3.0, "max {max}: mean absolute difference {mad:.2}");
            if denom == 1 {
                assert_eq!(fast.2, exact.2);
            }
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn token_windows_hold_each_window_and_its_next_token() {
        let d = Dataset::from_tokens((0..1000).map(|x| x * 70).collect()).unwrap();
        let out = std::env::temp_dir().join(format!("braid-tokwin-{}.beton", std::process::id()));
        let mut calls = 0;
        let w = token_windows(&out, &d, 16, 70_000, 1 << 16, &mut |_, _| calls += 1).unwrap();
        assert!(calls >= 1);
        let b = Beton::open(&out).unwrap();
        std::fs::remove_file(&out).unwrap();
        assert_eq!(
            w.samples as usize,
            d.windows(16, false) + d.windows(16, true)
        );
        // Tokens up to 69930 need u32.
        assert_eq!(b.index().fields[0].ty.name(), "tokens <u4 [17]");
        let first = b.value(0, 0).unwrap().tokens().unwrap();
        assert_eq!(first, (0..17).map(|x| x * 70).collect::<Vec<u32>>());
        let last = b.len() - 1;
        assert_eq!(b.value(last, 1).unwrap(), crate::beton::Value::Int(1));
        assert_eq!(b.value(0, 1).unwrap(), crate::beton::Value::Int(0));
    }
}
