//! `braid data load`: reads a `.beton` image dataset through braid's image
//! loader for a few epochs (random-resized-crop, flip, the chosen output
//! form) and prints images/s per epoch — the loader's benchmark, set up
//! like `ffcv_loader_bench.py`'s FFCV and PyTorch runs so that the three
//! compare. Every epoch is checked: each sample of this rank's share
//! exactly once, labels present, pixels not blank. With `--device cuda`
//! batches are made in page-locked memory and copied to the GPU
//! asynchronously.

use std::path::PathBuf;
use std::time::Instant;

use braid_data::augment::{Augment, Crop, Layout, Pixels};
use braid_data::images::{Cache, HostBuffer, ImageBatch, ImageLoader, ImageLoaderOptions};
use braid_data::order::Order;
use clap::Args;

/// `braid data load`.
#[derive(Args)]
pub struct LoadArgs {
    /// The .beton file (an RGB image field, and an int label field).
    file: PathBuf,
    /// Output side in pixels (square; --width/--height for others).
    #[arg(long, default_value_t = 160)]
    res: usize,
    /// Output width (default --res).
    #[arg(long)]
    width: Option<usize>,
    /// Output height (default --res).
    #[arg(long)]
    height: Option<usize>,
    /// Images per batch.
    #[arg(long, default_value_t = 128)]
    batch: usize,
    /// Epochs to read (images/s: the best after the first, as the peers
    /// report it).
    #[arg(long, default_value_t = 3)]
    epochs: u64,
    /// Loader threads (default: every core).
    #[arg(long)]
    threads: Option<usize>,
    /// Batches made ahead (default: 2 per thread).
    #[arg(long)]
    prefetch: Option<usize>,
    /// sequential, random or quasi-random.
    #[arg(long, default_value = "quasi-random")]
    order: String,
    /// os (memory-mapped, shared by the node's processes) or process
    /// (pages read into a bounded pool).
    #[arg(long, default_value = "os", value_parser = ["os", "process"])]
    cache: String,
    /// Pages in the process cache (default: the order's window plus two
    /// per thread).
    #[arg(long)]
    cache_pages: Option<usize>,
    /// random-resized (torchvision's RandomResizedCrop) or center (224/256
    /// of the shorter side).
    #[arg(long, default_value = "random-resized", value_parser = ["random-resized", "center"])]
    crop: String,
    /// No random horizontal flip.
    #[arg(long)]
    no_flip: bool,
    /// u8, or bf16 normalised with ImageNet's mean and std.
    #[arg(long, default_value = "u8", value_parser = ["u8", "bf16"])]
    dtype: String,
    /// nhwc (FFCV's memory order) or nchw.
    #[arg(long, default_value = "nhwc", value_parser = ["nhwc", "nchw"])]
    layout: String,
    /// The image field.
    #[arg(long, default_value = "image")]
    image_field: String,
    /// The label field (`none`: no labels).
    #[arg(long, default_value = "label")]
    label_field: String,
    /// Seed of the order and the augmentations.
    #[arg(long, default_value_t = super::DEFAULT_SEED)]
    seed: u64,
    /// This rank (of --ranks) for a distributed share (default: RANK
    /// from `braid launch`, else 0).
    #[arg(long)]
    rank: Option<usize>,
    /// Ranks sharing each global batch (default: WORLD_SIZE from `braid
    /// launch`, else 1).
    #[arg(long)]
    ranks: Option<usize>,
    /// Write each epoch's samples, batch by batch, to
    /// DIR/samples-rank<R>.txt (to check what each rank read).
    #[arg(long, value_name = "DIR")]
    record: Option<PathBuf>,
    /// Drop the incomplete last global batch.
    #[arg(long)]
    drop_last: bool,
    /// cpu, or cuda: batches in page-locked memory, copied to GPU 0.
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda"])]
    device: String,
    /// One JSON object at the end.
    #[arg(long, value_name = "FILE", num_args = 0..=1, default_missing_value = "-",
          value_parser = super::json_out::parse, help = super::json_out::HELP)]
    json: Option<super::json_out::JsonOut>,
}

/// Runs `braid data load`.
pub fn run(a: LoadArgs) -> Result<i32, String> {
    let env = |k: &str| -> Result<Option<usize>, String> {
        std::env::var(k)
            .ok()
            .map(|v| v.parse().map_err(|_| format!("{k}={v:?} is not a number")))
            .transpose()
    };
    let rank = match a.rank {
        Some(r) => r,
        None => env(braid_core::env::RANK)?.unwrap_or(0),
    };
    let ranks = match a.ranks {
        Some(r) => r,
        None => env(braid_core::env::WORLD_SIZE)?.unwrap_or(1),
    };
    flags_checked(&a, rank, ranks)?;
    let threads = a
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let augment = Augment {
        crop: if a.crop == "center" {
            Crop::Center {
                ratio: 224.0 / 256.0,
            }
        } else {
            Crop::RANDOM_RESIZED
        },
        width: a.width.unwrap_or(a.res),
        height: a.height.unwrap_or(a.res),
        flip: !a.no_flip,
        pixels: if a.dtype == "bf16" {
            Pixels::IMAGENET_BF16
        } else {
            Pixels::U8
        },
        layout: if a.layout == "nchw" {
            Layout::Nchw
        } else {
            Layout::Nhwc
        },
    };
    let mut o = ImageLoaderOptions::new(a.batch, augment);
    o.image_field = a.image_field.clone();
    o.label_field = (a.label_field != "none").then(|| a.label_field.clone());
    o.order = Order::parse(&a.order)?;
    o.seed = a.seed;
    o.rank = rank;
    o.ranks = ranks;
    o.drop_last = a.drop_last;
    o.threads = threads;
    o.prefetch = a.prefetch.unwrap_or(2 * threads);
    o.cache = if a.cache == "process" {
        Cache::Process {
            pages: a.cache_pages.unwrap_or(0),
        }
    } else {
        Cache::Os
    };
    let mut loader = ImageLoader::open(&a.file, o)?;
    let gpu = if a.device == "cuda" {
        Some(Gpu::open(&mut loader, a.batch * augment.sample_bytes())?)
    } else {
        None
    };
    eprintln!(
        "loading {}: {} samples, {} batches of {} per epoch on rank {} of {}, {}x{} {} {}, {} threads, {} cache{}",
        a.file.display(),
        loader.samples(),
        loader.batches_per_epoch(),
        a.batch,
        rank,
        ranks,
        augment.width,
        augment.height,
        a.dtype,
        a.layout,
        threads,
        a.cache,
        if gpu.is_some() { ", copied to GPU 0" } else { "" }
    );
    let mut record = String::new();
    let mut rates = Vec::new();
    for e in 0..a.epochs {
        let t = Instant::now();
        let mut check = EpochCheck::new(loader.samples());
        let mut batches = loader.epoch();
        let total = batches.total();
        let mut k = 0;
        let mut bar = super::progress::Progress::new(format!("  epoch {e}"), "batches");
        let mut line = format!("epoch {e} batches {total}:");
        while let Some(b) = batches.next() {
            let b = b?;
            if a.record.is_some() {
                line.push_str(" |");
                for s in &b.samples {
                    line.push_str(&format!(" {s}"));
                }
            }
            check.add(&b, augment.sample_bytes())?;
            match &gpu {
                // The copy runs while the next batch is taken; the batch's
                // buffer is reused only once its copy has finished.
                Some(g) => {
                    if let Some(done) = g.copy(b)? {
                        batches.recycle(done);
                    }
                }
                None => batches.recycle(b),
            }
            k += 1;
            bar.show(k as u64, total as u64);
        }
        if let Some(done) = gpu.as_ref().map(|g| g.finish()).transpose()?.flatten() {
            batches.recycle(done);
        }
        drop(batches);
        bar.finish();
        let secs = t.elapsed().as_secs_f64();
        record.push_str(&line);
        record.push('\n');
        check.finish(ranks, a.drop_last)?;
        let rate = check.images as f64 / secs;
        eprintln!(
            "  epoch {e}: {} images, {rate:.0} images/s, {:.2} s, mean first byte {:.1}{}",
            check.images,
            secs,
            check.mean_first_byte(),
            loader
                .page_loads()
                .map(|l| format!(", {l} page reads so far"))
                .unwrap_or_default()
        );
        rates.push(rate);
    }
    if let Some(dir) = &a.record {
        let path = dir.join(format!("samples-rank{rank}.txt"));
        std::fs::create_dir_all(dir)
            .and_then(|_| std::fs::write(&path, &record))
            .map_err(|e| format!("--record: {}: {e}", path.display()))?;
    }
    let best = rates
        .iter()
        .skip(if rates.len() > 1 { 1 } else { 0 })
        .fold(0.0f64, |m, &r| m.max(r));
    if let Some(out) = &a.json {
        out.write(
            &serde_json::json!({
                "peer": "braid", "images_per_s": best.round(), "epochs": a.epochs,
                "threads": threads, "width": augment.width, "height": augment.height,
                "cache": a.cache, "device": a.device, "per_epoch": rates,
                "cache_bound_bytes": loader.cache_bound().map(|b| b.0),
            })
            .to_string(),
        )?;
    }
    if !a.json.as_ref().is_some_and(|j| j.is_stdout()) {
        println!(
            "braid images/s {best:.0} epochs {} workers {threads} res {} os_cache {}",
            a.epochs,
            augment.width,
            (a.cache == "os") as u8
        );
    }
    Ok(0)
}

/// Refuses counts that read nothing and flags that would go unused,
/// naming the flag, before the file is opened; makes `--record`'s
/// directory and checks `--json`'s file, so that neither fails after the
/// epochs.
fn flags_checked(a: &LoadArgs, rank: usize, ranks: usize) -> Result<(), String> {
    for (flag, value) in [
        ("--res", Some(a.res)),
        ("--width", a.width),
        ("--height", a.height),
        ("--batch", Some(a.batch)),
        ("--epochs", Some(a.epochs as usize)),
        ("--threads", a.threads),
        ("--ranks", Some(ranks)),
        ("--cache-pages", a.cache_pages),
    ] {
        if value == Some(0) {
            return Err(format!("{flag} 0: use 1 or more"));
        }
    }
    if rank >= ranks {
        return Err(format!(
            "rank {rank} of {ranks} ranks (--rank, --ranks, or RANK and WORLD_SIZE from the \
             launcher): a rank is 0 to {}",
            ranks - 1
        ));
    }
    if a.cache_pages.is_some() && a.cache != "process" {
        return Err(
            "--cache-pages sizes the process cache (--cache process), and this run reads \
             through the OS cache: add --cache process, or drop --cache-pages"
                .into(),
        );
    }
    if a.file.is_dir() {
        return Err(format!(
            "{}: a directory, not a .beton file (`braid data write --images` makes one)",
            a.file.display()
        ));
    }
    if let Some(j) = &a.json {
        j.check()?;
    }
    if let Some(dir) = &a.record {
        if dir.exists() && !dir.is_dir() {
            return Err(format!(
                "--record {}: a file; --record names the directory samples-rank<R>.txt go to",
                dir.display()
            ));
        }
        std::fs::create_dir_all(dir).map_err(|e| {
            format!(
                "--record {}: cannot make the directory ({e}); --record names a directory",
                dir.display()
            )
        })?;
    }
    Ok(())
}

/// What one epoch must hold.
struct EpochCheck {
    seen: Vec<bool>,
    images: usize,
    first_bytes: u64,
}

impl EpochCheck {
    fn new(samples: usize) -> EpochCheck {
        EpochCheck {
            seen: vec![false; samples],
            images: 0,
            first_bytes: 0,
        }
    }

    fn add(&mut self, b: &ImageBatch, sample_bytes: usize) -> Result<(), String> {
        if !b.labels.is_empty() && b.labels.len() != b.len() {
            return Err(format!(
                "batch {}: {} labels for {} images",
                b.index,
                b.labels.len(),
                b.len()
            ));
        }
        if b.pixels().len() != b.len() * sample_bytes {
            return Err(format!(
                "batch {}: {} bytes for {} images",
                b.index,
                b.pixels().len(),
                b.len()
            ));
        }
        for &s in &b.samples {
            if std::mem::replace(&mut self.seen[s], true) {
                return Err(format!("sample {s} came twice in epoch {}", b.epoch));
            }
        }
        self.images += b.len();
        self.first_bytes += b
            .pixels()
            .chunks(sample_bytes)
            .map(|c| c[0] as u64)
            .sum::<u64>();
        Ok(())
    }

    fn mean_first_byte(&self) -> f64 {
        self.first_bytes as f64 / self.images.max(1) as f64
    }

    fn finish(&self, ranks: usize, drop_last: bool) -> Result<(), String> {
        let n = self.seen.len();
        if ranks == 1 && !drop_last && self.images != n {
            return Err(format!("an epoch read {} of {n} samples", self.images));
        }
        if self.images > 0 && self.first_bytes == 0 {
            return Err("every image's first byte was 0: the loader made blank images".into());
        }
        Ok(())
    }
}

/// Page-locked batch buffers and the copy of each batch to GPU 0: two
/// device buffers used in turn, so that one batch's copy overlaps the
/// hand-off of the next.
struct Gpu {
    stream: braid_cuda::Stream,
    targets: [std::cell::RefCell<braid_cuda::DeviceBuffer<u8>>; 2],
    /// The batch whose copy was queued last, and its copy's event.
    in_flight: std::cell::RefCell<Option<(ImageBatch, braid_cuda::Event)>>,
    turn: std::cell::Cell<usize>,
}

struct PinnedBatch(braid_cuda::PinnedBuffer<u8>);

impl HostBuffer for PinnedBatch {
    fn bytes(&self) -> &[u8] {
        self.0.as_slice()
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        self.0.as_mut_slice()
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

fn cuda(e: braid_cuda::CudaError) -> String {
    format!("--device cuda: {e}")
}

impl Gpu {
    fn open(loader: &mut ImageLoader, batch_bytes: usize) -> Result<Gpu, String> {
        let device = braid_cuda::Device::open(0).map_err(cuda)?;
        let stream = braid_cuda::Stream::new(&device).map_err(cuda)?;
        let target = || {
            braid_cuda::DeviceBuffer::<u8>::zeros(&device, batch_bytes)
                .map(std::cell::RefCell::new)
                .map_err(cuda)
        };
        let targets = [target()?, target()?];
        let d = device.clone();
        loader.set_allocator(Box::new(move |n| {
            braid_cuda::PinnedBuffer::<u8>::zeros(&d, n)
                .map(|p| Box::new(PinnedBatch(p)) as Box<dyn HostBuffer>)
                .map_err(|e| format!("page-locked batch buffer of {n} bytes: {e}"))
        }));
        Ok(Gpu {
            stream,
            targets,
            in_flight: std::cell::RefCell::new(None),
            turn: std::cell::Cell::new(0),
        })
    }

    /// Queues the batch's copy to the GPU on the loader's stream, then
    /// waits for the previous batch's copy and hands that batch back.
    fn copy(&self, b: ImageBatch) -> Result<Option<ImageBatch>, String> {
        let pinned = b
            .buffer
            .as_any()
            .downcast_ref::<PinnedBatch>()
            .ok_or("a batch not in page-locked memory")?;
        let k = self.turn.get();
        self.turn.set(1 - k);
        let mut target = self.targets[k].borrow_mut();
        let n = b.pixels().len();
        let mut view = target.view_mut(0..n);
        pinned
            .0
            .copy_out_async(0, &mut view, &self.stream)
            .map_err(|e| format!("copying batch {} to the GPU: {e}", b.index))?;
        let event = braid_cuda::Event::new(self.stream.device()).map_err(cuda)?;
        event.record(&self.stream).map_err(cuda)?;
        let previous = self.in_flight.borrow_mut().replace((b, event));
        match previous {
            Some((p, e)) => {
                e.synchronize().map_err(cuda)?;
                Ok(Some(p))
            }
            None => Ok(None),
        }
    }

    /// Waits for the last copy and hands its batch back.
    fn finish(&self) -> Result<Option<ImageBatch>, String> {
        match self.in_flight.borrow_mut().take() {
            Some((b, e)) => {
                e.synchronize().map_err(cuda)?;
                Ok(Some(b))
            }
            None => Ok(None),
        }
    }
}
