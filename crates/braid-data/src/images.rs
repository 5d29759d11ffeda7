//! The image loader: batches of augmented images (and their labels) from
//! a `.beton` file's image field, made ahead of the consumer by a pool of
//! threads.
//!
//! - Order: sequential, random or FFCV's quasi-random ([`crate::order`]),
//!   seeded per epoch, this rank's share of every global batch.
//! - Memory: the OS cache (the file memory-mapped, its pages kept by the
//!   kernel and shared by every rank of the node) or the process cache
//!   ([`crate::cache::PageCache`]: pages read into a bounded pool and
//!   released after the epoch's last sample on them).
//! - Work: each worker thread makes whole batches ([`crate::augment`]:
//!   crop, JPEG decode of the window at reduced scale, resize, flip,
//!   u8/bf16, NHWC/NCHW); at most `prefetch` batches are made ahead of the
//!   one the consumer waits for, and they come out in order.
//! - Waiting: the consumer waits at most `timeout` for a batch, then gets
//!   an error naming it, never a hang; a worker's error (a corrupt JPEG)
//!   names the file and the sample.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::augment::{sample_rng, Augment, Scratch};
use crate::beton::{Beton, FieldType, Image, Index, Value};
use crate::cache::{PageCache, PageReader, Pinned};
use crate::order::{EpochPlan, Order};

/// Where pages live while an epoch reads them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cache {
    /// Memory-mapped: the kernel's page cache, shared across processes.
    Os,
    /// Read into a pool of at most this many pages (0: as many as the
    /// order's window of open pages plus two per thread).
    Process {
        /// Pool size in pages.
        pages: usize,
    },
}

/// How an [`ImageLoader`] reads and what it makes.
#[derive(Debug, Clone)]
pub struct ImageLoaderOptions {
    /// The RGB image field.
    pub image_field: String,
    /// An int field to return beside each image (`None`: no labels).
    pub label_field: Option<String>,
    /// Images per batch on this rank.
    pub batch: usize,
    /// What each image becomes.
    pub augment: Augment,
    /// Sample order.
    pub order: Order,
    /// Seed of the order and of the augmentations.
    pub seed: u64,
    /// This rank.
    pub rank: usize,
    /// Ranks sharing each global batch.
    pub ranks: usize,
    /// Drop the incomplete last global batch.
    pub drop_last: bool,
    /// Worker threads.
    pub threads: usize,
    /// Batches made ahead of the consumer.
    pub prefetch: usize,
    /// Memory management.
    pub cache: Cache,
    /// The longest the consumer waits for one batch.
    pub timeout: Duration,
}

impl ImageLoaderOptions {
    /// Defaults: fields `image` and `label`, quasi-random order, one
    /// rank, every core, two batches ahead per thread, the OS cache.
    pub fn new(batch: usize, augment: Augment) -> ImageLoaderOptions {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        ImageLoaderOptions {
            image_field: "image".into(),
            label_field: Some("label".into()),
            batch,
            augment,
            order: Order::QuasiRandom,
            seed: 0,
            rank: 0,
            ranks: 1,
            drop_last: false,
            threads,
            prefetch: 2 * threads,
            cache: Cache::Os,
            timeout: Duration::from_secs(120),
        }
    }
}

/// Host memory a batch is made in: a `Vec<u8>` by default, or what
/// [`ImageLoader::set_allocator`] makes (page-locked memory that can be
/// copied to a GPU asynchronously).
pub trait HostBuffer: Send + std::any::Any {
    /// All its bytes.
    fn bytes(&self) -> &[u8];
    /// All its bytes, writable.
    fn bytes_mut(&mut self) -> &mut [u8];
    /// Itself, for a caller that knows its type.
    fn as_any(&self) -> &dyn std::any::Any;
}

impl HostBuffer for Vec<u8> {
    fn bytes(&self) -> &[u8] {
        self
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        self
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// Makes a buffer of the given number of bytes.
pub type Allocator = dyn Fn(usize) -> Result<Box<dyn HostBuffer>, String> + Send + Sync;

/// One batch.
pub struct ImageBatch {
    /// The epoch it belongs to.
    pub epoch: u64,
    /// Its place in the epoch (0-based).
    pub index: usize,
    /// The samples it holds, in order.
    pub samples: Vec<usize>,
    /// The buffer it was made in (`batch × sample_bytes` bytes; the
    /// first [`pixels`](Self::pixels) hold the images).
    pub buffer: Box<dyn HostBuffer>,
    /// Bytes of images in `buffer`.
    pub bytes: usize,
    /// The label of each sample (empty without a label field).
    pub labels: Vec<i64>,
}

impl ImageBatch {
    /// Images in the batch.
    pub fn len(&self) -> usize {
        self.samples.len()
    }

    /// Whether it holds none (a short last batch on some ranks).
    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }

    /// `len() × sample_bytes` bytes: u8 pixels, or bf16 bits
    /// little-endian, in the loader's layout.
    pub fn pixels(&self) -> &[u8] {
        &self.buffer.bytes()[..self.bytes]
    }
}

struct ProcessCache {
    pool: Mutex<Pool>,
    loaded: Condvar,
    index: Arc<Index>,
    reader: PageReader,
}

struct Pool {
    cache: PageCache,
    loading: std::collections::HashSet<u64>,
}

impl ProcessCache {
    /// Sample `s`'s pages, read if they are not resident: each missing
    /// page by one worker, outside the lock, while the others wait for it.
    fn pin(&self, s: usize, timeout: Duration, who: &str) -> Result<Pinned, String> {
        let deadline = Instant::now() + timeout;
        let mut pool = lock(&self.pool);
        // Pages this call read, kept even if the pool evicts them before
        // the sample's other page is in.
        let mut held = Vec::new();
        loop {
            let p = match pool.cache.try_pin(s, &held)? {
                Ok(pinned) => return Ok(pinned),
                Err(p) => p,
            };
            if pool.loading.insert(p) {
                drop(pool);
                let read = self.reader.read(p);
                pool = lock(&self.pool);
                pool.loading.remove(&p);
                self.loaded.notify_all();
                held.push((p, pool.cache.insert(p, read?)));
                continue;
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(format!(
                    "{}: image loader ({who}): reading sample {s}, page {p} not read after {:.0} s by the loader thread reading it",
                    self.index.path,
                    timeout.as_secs_f64()
                ));
            }
            pool = self
                .loaded
                .wait_timeout(pool, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

enum Source {
    Os(Beton),
    /// The pool, a copy of the file's index to read values with outside
    /// its lock, and the pages being read (by one worker each, outside
    /// the lock; the others wait on the condition variable).
    Process(Box<ProcessCache>),
}

impl Source {
    fn index(&self) -> &Index {
        match self {
            Source::Os(b) => b.index(),
            Source::Process(p) => &p.index,
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A worker that panicked is reported through its batch; the data
    // under the lock stays consistent (every update is a whole step).
    m.lock().unwrap_or_else(|p| p.into_inner())
}

struct Shared {
    path: String,
    source: Source,
    augment: Augment,
    image: usize,
    label: Option<usize>,
    seed: u64,
    timeout: Duration,
    /// "rank R of N", for messages.
    who: String,
}

/// Batches of augmented images from a `.beton` file.
pub struct ImageLoader {
    shared: Arc<Shared>,
    plan: EpochPlan,
    next_epoch: u64,
    threads: usize,
    prefetch: usize,
    timeout: Duration,
    free: Arc<Mutex<Vec<Box<dyn HostBuffer>>>>,
    allocate: Arc<Allocator>,
    batch: usize,
}

impl ImageLoader {
    /// Opens `path` for `o`.
    pub fn open(path: &Path, o: ImageLoaderOptions) -> Result<ImageLoader, String> {
        let name = path.display().to_string();
        if o.threads == 0 || o.batch == 0 {
            return Err(
                "the image loader needs at least one thread and a batch of at least one".into(),
            );
        }
        if o.augment.width == 0 || o.augment.height == 0 {
            return Err("the image loader's output size must be at least 1x1".into());
        }
        let (index, file) = Index::open(path)?;
        let field = |want: &str, image: bool| -> Result<usize, String> {
            let f = index.field(want)?;
            let ok = match index.fields[f].ty {
                FieldType::RgbImage => image,
                FieldType::Int => !image,
                _ => false,
            };
            if !ok {
                return Err(format!(
                    "{name}: field {want:?} is {:?}; the image loader needs {}",
                    index.fields[f].ty,
                    if image {
                        "an RGB image field"
                    } else {
                        "an int field for labels"
                    }
                ));
            }
            Ok(f)
        };
        let image = field(&o.image_field, true)?;
        let label = match &o.label_field {
            Some(l) => Some(field(l, false)?),
            None => None,
        };
        let pages: Vec<u64> = (0..index.len())
            .map(|s| index.pages_of(s).next().unwrap_or(0))
            .collect();
        let plan = EpochPlan::new(
            o.order,
            index.len(),
            pages,
            o.batch,
            o.rank,
            o.ranks,
            o.seed,
            o.drop_last,
        )?;
        let source = match o.cache {
            Cache::Os => Source::Os(Beton::from_index(index, &file)?),
            Cache::Process { pages } => {
                let window = 2 * o.batch;
                let capacity = if pages == 0 {
                    (window.min(index.pages() as usize) + 2 * o.threads).max(1)
                } else {
                    pages
                };
                let cache = PageCache::from_index(Arc::new(index), file, capacity)?;
                Source::Process(Box::new(ProcessCache {
                    reader: cache.reader(),
                    index: cache.shared_index(),
                    pool: Mutex::new(Pool {
                        cache,
                        loading: Default::default(),
                    }),
                    loaded: Condvar::new(),
                }))
            }
        };
        Ok(ImageLoader {
            shared: Arc::new(Shared {
                path: name,
                source,
                augment: o.augment,
                image,
                label,
                seed: o.seed,
                timeout: o.timeout,
                who: format!("rank {} of {}", o.rank, o.ranks),
            }),
            plan,
            next_epoch: 0,
            threads: o.threads,
            prefetch: o.prefetch.max(1),
            timeout: o.timeout,
            free: Arc::new(Mutex::new(Vec::new())),
            allocate: Arc::new(|n| Ok(Box::new(vec![0u8; n]) as Box<dyn HostBuffer>)),
            batch: o.batch,
        })
    }

    /// Samples in the file.
    pub fn samples(&self) -> usize {
        self.shared.source.index().len()
    }

    /// Batches this rank gets per epoch.
    pub fn batches_per_epoch(&self) -> usize {
        self.plan.batches_per_epoch()
    }

    /// Bytes of one image in a batch.
    pub fn sample_bytes(&self) -> usize {
        self.shared.augment.sample_bytes()
    }

    /// Makes batches in buffers from `allocate` (called with the bytes of
    /// a full batch, at most once per batch in flight: buffers handed
    /// back through [`Batches::recycle`] are reused).
    pub fn set_allocator(&mut self, allocate: Box<Allocator>) {
        self.allocate = Arc::from(allocate);
        lock(&self.free).clear();
    }

    /// Makes the next [`epoch`](Self::epoch) call read `epoch` (like
    /// PyTorch's `DistributedSampler.set_epoch`).
    pub fn set_epoch(&mut self, epoch: u64) {
        self.next_epoch = epoch;
    }

    /// The batches of the next epoch (0 first, then 1, ...; or the one
    /// [`set_epoch`](Self::set_epoch) chose), made by the worker threads.
    pub fn epoch(&mut self) -> Batches {
        let epoch = self.next_epoch;
        self.next_epoch += 1;
        let batches = self.plan.batches(epoch);
        if let Source::Process(p) = &self.shared.source {
            let order: Vec<usize> = batches.iter().flatten().copied().collect();
            lock(&p.pool).cache.start_epoch(&order);
        }
        let total = batches.len();
        let state = Arc::new((
            Mutex::new(State {
                jobs: batches.into_iter().map(Some).collect(),
                next_job: 0,
                consumed: 0,
                ready: BTreeMap::new(),
                stop: false,
            }),
            Condvar::new(),
        ));
        let workers = (0..self.threads.min(total.max(1)))
            .map(|_| {
                let (shared, state) = (self.shared.clone(), state.clone());
                let (free, allocate) = (self.free.clone(), self.allocate.clone());
                let (prefetch, batch) = (self.prefetch, self.batch);
                std::thread::spawn(move || {
                    work(&shared, &state, (&free, &*allocate), epoch, prefetch, batch)
                })
            })
            .collect();
        Batches {
            state,
            workers,
            next: 0,
            total,
            epoch,
            timeout: self.timeout,
            free: self.free.clone(),
            who: self.shared.who.clone(),
        }
    }

    /// Pages read from the file so far (the process cache; `None` with
    /// the OS cache).
    pub fn page_loads(&self) -> Option<u64> {
        match &self.shared.source {
            Source::Os(_) => None,
            Source::Process(p) => Some(lock(&p.pool).cache.loads()),
        }
    }

    /// The process cache's bound on resident page bytes, and the most
    /// pages it held at once (`None` with the OS cache).
    pub fn cache_bound(&self) -> Option<(u64, usize)> {
        match &self.shared.source {
            Source::Os(_) => None,
            Source::Process(p) => {
                let c = &lock(&p.pool).cache;
                Some((c.bound_bytes(), c.peak_pages()))
            }
        }
    }
}

struct State {
    jobs: Vec<Option<Vec<usize>>>,
    next_job: usize,
    consumed: usize,
    ready: BTreeMap<usize, Result<ImageBatch, String>>,
    stop: bool,
}

type Shelf = (Mutex<State>, Condvar);

type Buffers<'a> = (&'a Mutex<Vec<Box<dyn HostBuffer>>>, &'a Allocator);

fn work(
    shared: &Shared,
    state: &Shelf,
    (free, allocate): Buffers<'_>,
    epoch: u64,
    prefetch: usize,
    batch: usize,
) {
    let mut scratch = Scratch::default();
    loop {
        let (k, samples) = {
            let mut st = lock(&state.0);
            loop {
                if st.stop || st.next_job >= st.jobs.len() {
                    return;
                }
                if st.next_job < st.consumed + prefetch {
                    break;
                }
                st = state.1.wait(st).unwrap_or_else(|p| p.into_inner());
            }
            let k = st.next_job;
            st.next_job += 1;
            (k, st.jobs[k].take().expect("each job taken once"))
        };
        let full = batch * shared.augment.sample_bytes();
        let reused = lock(free).pop().filter(|b| b.bytes().len() >= full);
        let buffer = match reused {
            Some(b) => Ok(b),
            None => allocate(full),
        };
        let made = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut buffer = buffer?;
            let labels = make(shared, epoch, &samples, &mut scratch, buffer.bytes_mut())?;
            Ok((buffer, labels))
        }))
        .unwrap_or_else(|p| {
            Err(format!(
                "{}: a loader thread panicked on batch {k}: {}",
                shared.path,
                p.downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| p.downcast_ref::<String>().cloned())
                    .unwrap_or_default()
            ))
        });
        let bytes = samples.len() * shared.augment.sample_bytes();
        let result = made.map(|(buffer, labels)| ImageBatch {
            epoch,
            index: k,
            samples,
            buffer,
            bytes,
            labels,
        });
        let failed = result.is_err();
        let mut st = lock(&state.0);
        st.ready.insert(k, result);
        if failed {
            st.stop = true;
        }
        state.1.notify_all();
    }
}

/// Fills `pixels` with the batch's images; returns the labels.
fn make(
    shared: &Shared,
    epoch: u64,
    samples: &[usize],
    scratch: &mut Scratch,
    pixels: &mut [u8],
) -> Result<Vec<i64>, String> {
    let sb = shared.augment.sample_bytes();
    let mut labels = Vec::with_capacity(if shared.label.is_some() {
        samples.len()
    } else {
        0
    });
    let index = shared.source.index();
    for (i, &s) in samples.iter().enumerate() {
        let out = &mut pixels[i * sb..(i + 1) * sb];
        let mut rng = sample_rng(shared.seed, epoch, s);
        let named = |e: String| format!("{}: sample {s}: {e}", shared.path);
        match &shared.source {
            Source::Os(b) => {
                let img = image_of(b.value(s, shared.image)?).map_err(named)?;
                shared
                    .augment
                    .apply(&img, &mut rng, scratch, out)
                    .map_err(named)?;
                if let Some(l) = shared.label {
                    labels.push(int_of(b.value(s, l)?));
                }
            }
            Source::Process(p) => {
                let pinned = p.pin(s, shared.timeout, &shared.who)?;
                let img = image_of(pinned.value(index, s, shared.image)).map_err(named);
                let done = img.and_then(|img| {
                    shared
                        .augment
                        .apply(&img, &mut rng, scratch, out)
                        .map_err(named)
                });
                if let Some(l) = shared.label {
                    labels.push(int_of(pinned.value(index, s, l)));
                }
                drop(pinned);
                lock(&p.pool).cache.done(s);
                done?;
            }
        }
    }
    Ok(labels)
}

fn image_of(v: Value<'_>) -> Result<Image<'_>, String> {
    match v {
        Value::Image(img) => Ok(img),
        other => Err(format!("expected an image, found {other:?}")),
    }
}

fn int_of(v: Value<'_>) -> i64 {
    match v {
        Value::Int(i) => i,
        _ => 0,
    }
}

/// One epoch's batches, in order. Dropping it stops the workers.
pub struct Batches {
    state: Arc<Shelf>,
    workers: Vec<JoinHandle<()>>,
    next: usize,
    total: usize,
    epoch: u64,
    timeout: Duration,
    free: Arc<Mutex<Vec<Box<dyn HostBuffer>>>>,
    who: String,
}

impl Batches {
    /// Batches in this epoch.
    pub fn total(&self) -> usize {
        self.total
    }

    /// Hands a used batch's buffer back for a later batch to reuse.
    pub fn recycle(&self, batch: ImageBatch) {
        lock(&self.free).push(batch.buffer);
    }
}

impl Iterator for Batches {
    type Item = Result<ImageBatch, String>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.next >= self.total {
            return None;
        }
        let k = self.next;
        let deadline = Instant::now() + self.timeout;
        let (m, cv) = &*self.state;
        let mut st = lock(m);
        loop {
            if let Some(r) = st.ready.remove(&k) {
                st.consumed += 1;
                cv.notify_all();
                self.next += 1;
                if r.is_err() {
                    // Nothing after a failed batch.
                    self.next = self.total;
                }
                return Some(r);
            }
            if st.stop {
                // Another batch failed first; its error comes in order.
                if let Some((&j, _)) = st.ready.iter().find(|(_, r)| r.is_err()) {
                    let r = st.ready.remove(&j).expect("present");
                    self.next = self.total;
                    return Some(r);
                }
            }
            let now = Instant::now();
            if now >= deadline {
                st.stop = true;
                cv.notify_all();
                self.next = self.total;
                return Some(Err(format!(
                    "image loader ({}): batch {k} of epoch {} not ready after {:.0} s (the loader threads are stuck or too slow; \
                     more --threads or a longer timeout may help)",
                    self.who,
                    self.epoch,
                    self.timeout.as_secs_f64()
                )));
            }
            st = cv
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

impl Drop for Batches {
    fn drop(&mut self) {
        {
            let (m, cv) = &*self.state;
            lock(m).stop = true;
            cv.notify_all();
        }
        for w in self.workers.drain(..) {
            // A worker finishes the batch in hand (bounded work) and exits.
            let _ = w.join();
        }
    }
}
