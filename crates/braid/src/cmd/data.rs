//! `braid data`: make FFCV-compatible `.beton` datasets (`write`), look
//! into them (`inspect`), and read images through the loader (`load`, in
//! `data_load`).

use std::path::{Path, PathBuf};
use std::time::Instant;

use braid_data::beton::layout::DEFAULT_PAGE_SIZE;
use braid_data::beton::{Beton, FieldType, Value, Written};
use braid_data::convert;
use braid_data::sheet;
use braid_data::tokens::{Dataset, Source, Tokenizer};
use clap::{Args, Subcommand};
use serde_json::Value as Json;

/// Write or inspect `.beton` datasets.
#[derive(Args)]
#[command(
    about = "Write FFCV-compatible .beton datasets, inspect them, and load images from them",
    after_help = format!("Examples:\n  braid data write train.beton --tokens shards/ --seq 1024     # GPT windows for braid train --data\n  braid data write docs.beton --jsonl docs.jsonl\n  braid data write train.beton --images imagenet/train --max-resolution 256 --mode jpg --quality 90\n  braid data inspect train.beton\n  braid data inspect train.beton --json --samples all\n  braid data inspect imgs.beton --sheet imgs.png --sheet-count 64\n  braid data load imgs.beton --res 160 --epochs 3 --device cuda   # the image loader's images/s\n\n{}", braid_data::jpeg::support_note())
)]
pub struct DataArgs {
    #[command(subcommand)]
    what: DataCommand,
}

#[derive(Subcommand)]
enum DataCommand {
    /// Write a .beton file from tokens, JSON lines or an image folder.
    Write(WriteArgs),
    /// What a .beton file holds: header, fields, pages, bytes per field,
    /// the first samples.
    Inspect(InspectArgs),
    /// Read an image .beton through braid's loader (crop, flip, decode at
    /// reduced scale) and print images/s: the loader's benchmark.
    Load(super::data_load::LoadArgs),
}

/// `braid data write`.
#[derive(Args)]
pub struct WriteArgs {
    /// The .beton file to write (it appears only when complete); with
    /// --tokens, a .bin name writes the token stream instead, as an llm.c
    /// shard (u16 tokens after a 1 KiB header) that braid train --data and
    /// numpy read.
    output: PathBuf,
    /// GPT token windows from `synthetic`, a text file, or u16 .bin
    /// shards (a file or a directory): fields `tokens` (--seq + 1 tokens)
    /// and `split` (0 train, 1 held out).
    #[arg(long, value_name = "SOURCE", group = "input")]
    tokens: Option<String>,
    /// One JSON field per line of this JSON-lines file.
    #[arg(long, value_name = "FILE", group = "input")]
    jsonl: Option<PathBuf>,
    /// An ImageNet-style image folder, DIR/<class>/<image>.jpg: fields
    /// `image` and `label` (the class's index among the sorted class
    /// folders), as FFCV writes torchvision's ImageFolder. JPEG files
    /// only; others are skipped.
    #[arg(long, value_name = "DIR", group = "input")]
    images: Option<PathBuf>,
    /// Shrink images whose longer side exceeds N pixels to about N (with
    /// --images; FFCV's max_resolution: the same output sizes). An image
    /// that shrinks by 4 or more is first decoded at 1/2, 1/4 or 1/8
    /// scale by the JPEG decoder (the smallest still twice the output
    /// size), then area-averaged to its size: faster, pixels a little
    /// different from FFCV's (see --exact-resize).
    #[arg(long, value_name = "N")]
    max_resolution: Option<u32>,
    /// With --max-resolution: decode every image at full size before
    /// shrinking it, as FFCV does, so the pixels are FFCV's (slower for
    /// images 4x or more over N).
    #[arg(long)]
    exact_resize: bool,
    /// How images are stored (with --images): jpg, raw, proportion (JPEG
    /// with --compress-probability) or smart (JPEG when the raw pixels
    /// exceed --smart-threshold bytes).
    #[arg(long, default_value = "jpg", value_parser = ["jpg", "raw", "proportion", "smart"])]
    mode: String,
    /// JPEG quality, 1 to 100 (with --images).
    #[arg(long, default_value_t = 90, value_parser = clap::value_parser!(u8).range(1..=100))]
    quality: u8,
    /// The chance each image is stored as JPEG (with --mode proportion).
    #[arg(long, default_value_t = 0.5)]
    compress_probability: f64,
    /// Raw-pixel bytes above which --mode smart stores JPEG.
    #[arg(long, value_name = "BYTES")]
    smart_threshold: Option<u64>,
    /// Tokens per training window (with --tokens).
    #[arg(long, default_value_t = 1024)]
    seq: usize,
    /// bytes or gpt2 (with --tokens; default gpt2 for shards and text).
    #[arg(long)]
    tokenizer: Option<String>,
    /// The JSON field's name (with --jsonl).
    #[arg(long, default_value = "data")]
    field: String,
    /// Bytes per page: a power of two from 4 KiB (FFCV's writer insists
    /// on 2 MiB or more; its reader takes any).
    #[arg(long, default_value_t = DEFAULT_PAGE_SIZE)]
    page_size: u64,
    /// Threads encoding samples (default: every core).
    #[arg(long, alias = "workers", value_name = "N")]
    threads: Option<usize>,
    /// Seed of the synthetic corpus (the one `braid train --data synthetic` trains on for the
    /// same seed), and of --mode proportion's draws.
    #[arg(long, default_value_t = super::DEFAULT_SEED)]
    seed: u64,
}

/// `braid data inspect`.
#[derive(Args)]
pub struct InspectArgs {
    /// The .beton file.
    file: PathBuf,
    /// One JSON object: {"num_samples", "page_size", "fields": {name: type}, "samples":
    /// [{field: value}]}.
    #[arg(long, value_name = "FILE", num_args = 0..=1, default_missing_value = "-",
          value_parser = super::json_out::parse, help = super::json_out::HELP)]
    json: Option<super::json_out::JsonOut>,
    /// How many samples to show: a number or `all` (default: 3; with
    /// --json, 3 too).
    #[arg(long, default_value = "3")]
    samples: String,
    /// Write a PNG contact sheet of the first images instead: thumbnails
    /// fitted into 128x128, 8 to a row, each with its sample index (and
    /// label, if the file has an int field `label`).
    #[arg(long, value_name = "OUT.png", conflicts_with = "json")]
    sheet: Option<PathBuf>,
    /// Images on the contact sheet, from sample 0 (with --sheet; at most
    /// 1024).
    #[arg(long, value_name = "N", default_value_t = 32, requires = "sheet")]
    sheet_count: usize,
    /// The RGB image field of the contact sheet (with --sheet; default:
    /// the file's first).
    #[arg(long, value_name = "NAME", requires = "sheet")]
    sheet_field: Option<String>,
}

/// Runs `braid data`.
pub fn run(a: DataArgs) -> Result<i32, String> {
    match a.what {
        DataCommand::Write(w) => write(w),
        DataCommand::Inspect(i) => inspect(i),
        DataCommand::Load(l) => super::data_load::run(l),
    }
}

/// Refuses the flags of one input given with another (they would be
/// ignored), and sizes that make no file, before anything is read.
fn write_flags_checked(a: &WriteArgs) -> Result<(), String> {
    let (input, takes): (&str, &[&str]) = if a.tokens.is_some() {
        ("--tokens", &["--seq", "--tokenizer"])
    } else if a.jsonl.is_some() {
        ("--jsonl", &["--field"])
    } else if a.images.is_some() {
        (
            "--images",
            &[
                "--max-resolution",
                "--exact-resize",
                "--mode",
                "--quality",
                "--compress-probability",
                "--smart-threshold",
            ],
        )
    } else {
        return Ok(());
    };
    let given = [
        ("--seq", a.seq != 1024),
        ("--tokenizer", a.tokenizer.is_some()),
        ("--field", a.field != "data"),
        ("--max-resolution", a.max_resolution.is_some()),
        ("--exact-resize", a.exact_resize),
        ("--mode", a.mode != "jpg"),
        ("--quality", a.quality != 90),
        ("--compress-probability", a.compress_probability != 0.5),
        ("--smart-threshold", a.smart_threshold.is_some()),
    ];
    if let Some((flag, _)) = given
        .iter()
        .find(|(flag, set)| *set && !takes.contains(flag))
    {
        let owner = match *flag {
            "--seq" | "--tokenizer" => "--tokens",
            "--field" => "--jsonl",
            _ => "--images",
        };
        return Err(format!(
            "{flag} is for {owner}, and this file is written from {input}: drop {flag}"
        ));
    }
    if a.tokens.is_some() && a.seq == 0 {
        return Err("--seq 0: a window needs at least 1 token (e.g. --seq 1024)".into());
    }
    if a.exact_resize && a.max_resolution.is_none() {
        return Err(
            "--exact-resize changes how --max-resolution shrinks images, and no \
             --max-resolution is given: add it, or drop --exact-resize"
                .into(),
        );
    }
    if a.mode != "proportion" && a.compress_probability != 0.5 {
        return Err(format!(
            "--compress-probability is for --mode proportion (this file's mode is {}): add \
             --mode proportion, or drop it",
            a.mode
        ));
    }
    if a.mode != "smart" && a.smart_threshold.is_some() {
        return Err(format!(
            "--smart-threshold is for --mode smart (this file's mode is {}): add --mode smart, \
             or drop it",
            a.mode
        ));
    }
    Ok(())
}

fn write(mut a: WriteArgs) -> Result<i32, String> {
    write_flags_checked(&a)?;
    super::train_ckpt::check_outputs(&[("braid data write", Some(&a.output))])?;
    if let Some(n) = a.threads.take() {
        if n == 0 {
            return Err("--threads 0: use at least 1".into());
        }
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build()
            .map_err(|e| format!("cannot start {n} threads: {e}"))?;
        return pool.install(|| write(a));
    }
    let start = Instant::now();
    let mut bar = super::progress::Progress::new("writing", "samples");
    let written = if let Some(src) = &a.tokens {
        let source = Source::parse(src)?;
        let tokenizer = match (&a.tokenizer, &source) {
            (Some(t), _) => Tokenizer::parse(t)?,
            (None, Source::Synthetic) => Tokenizer::Bytes,
            (None, _) => Tokenizer::Gpt2,
        };
        eprintln!(
            "braid data: reading tokens from {src} ({} tokenizer)",
            tokenizer.name()
        );
        let dataset = Dataset::load(&source, tokenizer, a.seed)?;
        if a.output.extension().is_some_and(|e| e == "bin") {
            // A flat token stream (llm.c's shard) instead of windows.
            let bytes = dataset.write_shard(&a.output)?;
            eprintln!(
                "braid data: wrote {} ({} tokens, {:.1} MiB, the last tenth held out when read) \
                 in {:.1} s",
                a.output.display(),
                dataset.len(),
                bytes as f64 / (1u64 << 20) as f64,
                start.elapsed().as_secs_f64()
            );
            return Ok(0);
        }
        convert::token_windows(
            &a.output,
            &dataset,
            a.seq,
            tokenizer.vocab_size(),
            a.page_size,
            &mut |d, n| bar.show(d, n),
        )?
    } else if let Some(jsonl) = &a.jsonl {
        convert::json_lines(&a.output, jsonl, &a.field, a.page_size, &mut |d, n| {
            bar.show(d, n)
        })?
    } else if let Some(root) = &a.images {
        let mode = match a.mode.as_str() {
            "raw" => convert::WriteMode::Raw,
            "proportion" => {
                if !(0.0..=1.0).contains(&a.compress_probability) {
                    return Err(format!(
                        "--compress-probability {}: use 0 to 1",
                        a.compress_probability
                    ));
                }
                convert::WriteMode::Proportion(a.compress_probability)
            }
            "smart" => convert::WriteMode::Smart(a.smart_threshold),
            _ => convert::WriteMode::Jpg,
        };
        let folder = convert::ImageFolder::scan(root)?;
        eprintln!(
            "braid data: {} images of {} classes in {}{}",
            folder.images.len(),
            folder.classes.len(),
            root.display(),
            match folder.skipped {
                0 => String::new(),
                n => format!(" ({n} files not .jpg or .jpeg skipped)"),
            }
        );
        let opts = convert::ImageOptions {
            mode,
            max_resolution: a.max_resolution,
            quality: a.quality,
            seed: a.seed,
            exact_resize: a.exact_resize,
        };
        convert::write_images(&a.output, &folder, &opts, a.page_size, &mut |d, n| {
            bar.show(d, n)
        })?
    } else {
        return Err("say what to write from: --tokens SOURCE, --jsonl FILE or --images DIR".into());
    };
    bar.finish();
    report_written(&a.output, &written, start.elapsed().as_secs_f64());
    Ok(0)
}

fn report_written(out: &Path, w: &Written, secs: f64) {
    eprintln!(
        "braid data: wrote {} ({} samples, {} pages, {:.1} MiB) in {secs:.1} s, {:.0} samples/s",
        out.display(),
        w.samples,
        w.pages,
        w.bytes as f64 / (1 << 20) as f64,
        w.samples as f64 / secs.max(1e-9)
    );
}

fn inspect(a: InspectArgs) -> Result<i32, String> {
    if let Some(j) = &a.json {
        j.check()?;
    }
    super::train_ckpt::check_outputs(&[("--sheet", a.sheet.as_deref())])?;
    let b = open_beton(&a.file)?;
    if let Some(out) = &a.sheet {
        let opts = sheet::SheetOptions {
            field: a.sheet_field.as_deref(),
            count: a.sheet_count,
            columns: 8,
        };
        let s = sheet::build(&b, &opts)?;
        write_png(out, &s)?;
        println!(
            "wrote {}: {} images of field '{}', {} x {} grid, {}x{} pixels",
            out.display(),
            s.images,
            s.field,
            s.columns,
            s.rows,
            s.width,
            s.height
        );
        return Ok(0);
    }
    let n = match a.samples.as_str() {
        "all" => b.len(),
        s => s
            .parse::<usize>()
            .map_err(|_| format!("--samples {s:?}: a number or `all`"))?
            .min(b.len()),
    };
    let json = b.to_json(n)?;
    if let Some(out) = &a.json {
        out.write(&json.to_string())?;
    }
    if a.json.as_ref().is_some_and(|j| j.is_stdout()) {
        return Ok(0);
    }
    let samples = json["samples"].as_array().cloned().unwrap_or_default();
    let idx = b.index();
    let h = &idx.header;
    println!("{}", a.file.display());
    println!(
        "  format      .beton version {} (FFCV 1.0), {} bytes",
        h.version, idx.file_len
    );
    println!(
        "  samples     {}\n  pages       {} of {} bytes (data from byte {}, allocation table at {}, {} entries)",
        b.len(),
        idx.pages(),
        idx.page_size(),
        idx.data_start,
        h.alloc_table_ptr,
        idx.allocations.len()
    );
    println!("  fields");
    for (f, field) in idx.fields.iter().enumerate() {
        let (bytes, extra) = field_bytes(&b, f);
        println!(
            "    {:<16} {:<28} {:>12} payload bytes{extra}",
            field.name,
            field.ty.name(),
            bytes
        );
    }
    if n > 0 {
        println!("  first {n} samples");
        for (s, row) in samples.iter().enumerate() {
            println!("    {s}: {}", shorten(row));
        }
    }
    Ok(0)
}

/// Opens a .beton file, a directory named as one refused in words.
pub(super) fn open_beton(file: &Path) -> Result<Beton, String> {
    if file.is_dir() {
        return Err(format!(
            "{}: a directory, not a .beton file (`braid data write` makes one)",
            file.display()
        ));
    }
    Beton::open(file)
}

/// Writes `s` to `out` as an 8-bit RGB PNG, atomically: under a
/// temporary name beside it, synced, then renamed over it.
fn write_png(out: &Path, s: &sheet::Sheet) -> Result<(), String> {
    let name = out
        .file_name()
        .ok_or_else(|| format!("{}: not a file name", out.display()))?
        .to_string_lossy();
    let temp = out.with_file_name(format!(".{name}.tmp-{}", std::process::id()));
    let write = || -> Result<(), String> {
        let what = |e: &dyn std::fmt::Display| format!("writing {}: {e}", temp.display());
        let file = std::fs::File::create(&temp)
            .map_err(|e| format!("cannot create {}: {e}", temp.display()))?;
        let mut buf = std::io::BufWriter::new(file);
        let mut enc = png::Encoder::new(&mut buf, s.width as u32, s.height as u32);
        enc.set_color(png::ColorType::Rgb);
        enc.set_depth(png::BitDepth::Eight);
        let mut w = enc.write_header().map_err(|e| what(&e))?;
        w.write_image_data(&s.rgb).map_err(|e| what(&e))?;
        w.finish().map_err(|e| what(&e))?;
        let file = buf.into_inner().map_err(|e| what(&e.into_error()))?;
        file.sync_all().map_err(|e| what(&e))?;
        std::fs::rename(&temp, out)
            .map_err(|e| format!("renaming {} to {}: {e}", temp.display(), out.display()))
    };
    write().inspect_err(|_| {
        let _ = std::fs::remove_file(&temp);
    })
}

/// Payload bytes of field `f` over the file, and for images how many
/// are JPEG.
fn field_bytes(b: &Beton, f: usize) -> (u64, String) {
    let idx = b.index();
    let (mut bytes, mut jpegs) = (0u64, 0usize);
    for s in 0..b.len() {
        if let Some(e) = idx.extent(s, f) {
            bytes += e.size;
        }
        if idx.fields[f].ty == FieldType::RgbImage {
            if let Ok(Value::Image(i)) = b.value(s, f) {
                jpegs += (i.mode == braid_data::beton::ImageMode::Jpeg) as usize;
            }
        }
    }
    let extra = if idx.fields[f].ty == FieldType::RgbImage {
        format!(", {jpegs} of {} images JPEG", b.len())
    } else {
        String::new()
    };
    (bytes, extra)
}

/// A sample's JSON on one line, long arrays and strings cut.
fn shorten(v: &Json) -> String {
    fn cut(v: &Json) -> Json {
        match v {
            Json::Array(a) if a.len() > 8 => {
                let mut head: Vec<Json> = a[..6].iter().map(cut).collect();
                head.push(Json::from(format!("... {} more", a.len() - 6)));
                Json::Array(head)
            }
            Json::Array(a) => Json::Array(a.iter().map(cut).collect()),
            Json::String(s) if s.chars().count() > 64 => Json::from(format!(
                "{}... ({} chars)",
                s.chars().take(48).collect::<String>(),
                s.chars().count()
            )),
            Json::Object(o) => Json::Object(o.iter().map(|(k, v)| (k.clone(), cut(v))).collect()),
            other => other.clone(),
        }
    }
    cut(v).to_string()
}
