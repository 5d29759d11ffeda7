//! Which JPEG decoder should the image loader use? Measures, on one
//! thread, how fast three decoders turn real JPEG files into RGB bytes:
//! braid's own `braid_data::jpeg::decode` (libjpeg-turbo, linked in
//! statically, fast integer IDCT), `zune-jpeg` and `jpeg-decoder` (both
//! pure Rust, dev-dependencies only).
//!
//! The files (every `.jpg`/`.jpeg` under a directory, recursively, sorted
//! by path, the first N) are read into memory first, so no disk I/O is
//! timed. One untimed pass decodes every file with every decoder: a file
//! any of them cannot decode is left out of the timings, and on the first
//! 50 files each Rust decoder's pixels are compared with libjpeg-turbo's
//! (the IDCTs and chroma upsampling differ, so small differences are
//! expected). Then, per decoder, one warm-up pass over all files and 3
//! timed passes; the median pass gives images/s, MB/s of JPEG data in and
//! megapixels/s out.
//!
//! Everything runs inside a one-thread rayon pool: `jpeg-decoder` would
//! otherwise spread an image's colour components over threads.
//!
//!     cargo run --release -p braid-data --example jpeg_decoders -- [DIR] [N]
//!
//! DIR defaults to /work/imagenet-like/train, N to 1000.

use std::hint::black_box;
use std::path::{Path, PathBuf};
use std::time::Instant;

use zune_jpeg::zune_core::bytestream::ZCursor;
use zune_jpeg::zune_core::colorspace::ColorSpace;
use zune_jpeg::zune_core::options::DecoderOptions;

/// Width, height and height × width × 3 RGB bytes.
type Decoded = (u32, u32, Vec<u8>);

const PASSES: usize = 3;
const COMPARED: usize = 50;

fn turbo(jpeg: &[u8]) -> Result<Decoded, String> {
    let (info, rgb) = braid_data::jpeg::decode(jpeg)?;
    Ok((info.width, info.height, rgb))
}

fn zune(jpeg: &[u8]) -> Result<Decoded, String> {
    let options = DecoderOptions::default().jpeg_set_out_colorspace(ColorSpace::RGB);
    let mut decoder = zune_jpeg::JpegDecoder::new_with_options(ZCursor::new(jpeg), options);
    let rgb = decoder.decode().map_err(|e| format!("{e:?}"))?;
    let info = decoder.info().ok_or("zune-jpeg: no header info")?;
    let (w, h) = (u32::from(info.width), u32::from(info.height));
    if rgb.len() != w as usize * h as usize * 3 {
        return Err(format!(
            "zune-jpeg: {} bytes for {w}x{h} (colour space {:?})",
            rgb.len(),
            decoder.output_colorspace()
        ));
    }
    Ok((w, h, rgb))
}

fn jpeg_decoder(jpeg: &[u8]) -> Result<Decoded, String> {
    use jpeg_decoder::PixelFormat;
    let mut decoder = jpeg_decoder::Decoder::new(jpeg);
    let pixels = decoder.decode().map_err(|e| e.to_string())?;
    let info = decoder.info().ok_or("jpeg-decoder: no header info")?;
    let (w, h) = (u32::from(info.width), u32::from(info.height));
    let rgb = match info.pixel_format {
        PixelFormat::RGB24 => pixels,
        // Grey to RGB, as libjpeg-turbo's decode does it.
        PixelFormat::L8 => pixels.iter().flat_map(|&l| [l, l, l]).collect(),
        other => return Err(format!("jpeg-decoder: {other:?} pixels, not RGB")),
    };
    Ok((w, h, rgb))
}

/// A decoder: JPEG bytes to RGB.
type Decode = fn(&[u8]) -> Result<Decoded, String>;

const DECODERS: [(&str, Decode); 3] = [
    ("libjpeg-turbo (braid_data::jpeg)", turbo),
    ("zune-jpeg 0.5.15", zune),
    ("jpeg-decoder 0.3.2", jpeg_decoder),
];

fn collect(dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            collect(&path, out)?;
        } else if path
            .extension()
            .and_then(|e| e.to_str())
            .is_some_and(|e| e.eq_ignore_ascii_case("jpg") || e.eq_ignore_ascii_case("jpeg"))
        {
            out.push(path);
        }
    }
    Ok(())
}

/// Sum of |a − b| over the bytes, and the largest |a − b|.
fn abs_diff(a: &[u8], b: &[u8]) -> (u64, u8) {
    a.iter().zip(b).fold((0, 0), |(sum, max), (&x, &y)| {
        let d = x.abs_diff(y);
        (sum + u64::from(d), max.max(d))
    })
}

fn main() -> Result<(), String> {
    let mut args = std::env::args().skip(1);
    let dir = PathBuf::from(
        args.next()
            .unwrap_or_else(|| "/work/imagenet-like/train".into()),
    );
    let n: usize = match args.next() {
        Some(s) => s.parse().map_err(|e| format!("N {s:?}: {e}"))?,
        None => 1000,
    };

    let mut paths = Vec::new();
    collect(&dir, &mut paths).map_err(|e| format!("{}: {e}", dir.display()))?;
    paths.sort();
    paths.truncate(n);
    if paths.is_empty() {
        return Err(format!("no .jpg/.jpeg files under {}", dir.display()));
    }
    let files: Vec<Vec<u8>> = paths
        .iter()
        .map(|p| std::fs::read(p).map_err(|e| format!("{}: {e}", p.display())))
        .collect::<Result<_, _>>()?;

    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .map_err(|e| e.to_string())?;
    pool.install(|| run(&dir, &paths, &files))
}

fn run(dir: &Path, paths: &[PathBuf], files: &[Vec<u8>]) -> Result<(), String> {
    // Untimed: which files every decoder decodes, and how alike the
    // pixels are on the first COMPARED of them.
    let mut ok = Vec::new();
    let mut grey = 0usize;
    // Per Rust decoder: byte |Δ| sum, bytes compared, worst image's mean
    // |Δ|, largest |Δ|, images compared, images bit-identical.
    let mut diffs = [(0u64, 0u64, 0f64, 0u8, 0usize, 0usize); DECODERS.len()];
    for (i, (path, jpeg)) in paths.iter().zip(files).enumerate() {
        let results: Vec<_> = DECODERS.iter().map(|(_, decode)| decode(jpeg)).collect();
        let mut all_ok = true;
        for ((name, _), r) in DECODERS.iter().zip(&results) {
            if let Err(e) = r {
                println!("{}: {name} failed: {e}", path.display());
                all_ok = false;
            }
        }
        if !all_ok {
            continue;
        }
        if braid_data::jpeg::info(jpeg)?.components == 1 {
            grey += 1;
        }
        let (tw, th, reference) = results[0].as_ref().unwrap();
        if i < COMPARED {
            for (d, r) in diffs.iter_mut().zip(&results).skip(1) {
                let (w, h, rgb) = r.as_ref().unwrap();
                if (w, h) != (tw, th) {
                    return Err(format!(
                        "{}: {w}x{h} against libjpeg-turbo's {tw}x{th}",
                        path.display()
                    ));
                }
                let (sum, max) = abs_diff(rgb, reference);
                d.0 += sum;
                d.1 += rgb.len() as u64;
                d.2 = d.2.max(sum as f64 / rgb.len() as f64);
                d.3 = d.3.max(max);
                d.4 += 1;
                d.5 += usize::from(sum == 0);
            }
        }
        ok.push(i);
    }
    let bytes: usize = ok.iter().map(|&i| files[i].len()).sum();
    let pixels: u64 = ok
        .iter()
        .map(|&i| {
            let info = braid_data::jpeg::info(&files[i]).unwrap();
            u64::from(info.width) * u64::from(info.height)
        })
        .sum();
    println!(
        "{} of {} files under {} decoded by all ({grey} greyscale): {:.1} MB of JPEG, \
         {:.0} KB and {:.0} kpixels a file on average",
        ok.len(),
        files.len(),
        dir.display(),
        bytes as f64 / 1e6,
        bytes as f64 / ok.len() as f64 / 1e3,
        pixels as f64 / ok.len() as f64 / 1e3,
    );

    println!("\npixels against libjpeg-turbo's (first {COMPARED} files):");
    for ((name, _), d) in DECODERS.iter().zip(&diffs).skip(1) {
        println!(
            "  {name:<34} mean |Δ| {:.3}, worst image's mean |Δ| {:.3}, max |Δ| {}, \
             {} of {} images identical",
            d.0 as f64 / d.1 as f64,
            d.2,
            d.3,
            d.5,
            d.4
        );
    }

    println!("\none thread, median of {PASSES} passes after one warm-up pass:");
    let mut baseline = None;
    for (name, decode) in DECODERS {
        let mut checksum = 0u64;
        let mut pass = || -> Result<f64, String> {
            let t = Instant::now();
            for &i in &ok {
                let (_, _, rgb) = decode(black_box(&files[i]))?;
                checksum = checksum.wrapping_add(u64::from(rgb[rgb.len() / 2]));
                black_box(rgb);
            }
            Ok(t.elapsed().as_secs_f64())
        };
        pass()?;
        let mut times: Vec<f64> = (0..PASSES).map(|_| pass()).collect::<Result<_, _>>()?;
        times.sort_by(f64::total_cmp);
        let median = times[PASSES / 2];
        let per_s = ok.len() as f64 / median;
        let ratio = *baseline.get_or_insert(per_s);
        println!(
            "  {name:<34} {per_s:7.1} images/s  {:6.1} MB/s  {:6.1} Mpixel/s  {:.2}x libjpeg-turbo  \
             (passes {:.3}..{:.3} s, checksum {checksum})",
            bytes as f64 / median / 1e6,
            pixels as f64 / median / 1e6,
            per_s / ratio,
            times[0],
            times[PASSES - 1],
        );
    }
    Ok(())
}
