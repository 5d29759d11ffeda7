//! The process cache: a `.beton` file's pages read into a bounded pool of
//! buffers (FFCV's `os_cache=False`), for files larger than memory or
//! nodes where the OS page cache should be left alone. A page is read
//! when a sample on it is first needed and released when the epoch's
//! order has no more samples on it, so with the quasi-random order each
//! page is read once per epoch and at most the open pages are resident:
//! resident bytes stay under `capacity × page size`.
//!
//! (The OS cache is [`crate::beton::Beton`]'s memory mapping: the kernel
//! keeps the pages, shared by every rank of the node.)

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;

use crate::beton::{Index, Value};

/// Pages read into memory as an epoch's order needs them.
pub struct PageCache {
    index: Arc<Index>,
    reader: PageReader,
    capacity: usize,
    resident: HashMap<u64, Arc<Vec<u8>>>,
    /// Samples of the current epoch still to come, per page.
    remaining: HashMap<u64, usize>,
    loads: u64,
    peak: usize,
}

impl PageCache {
    /// Opens `path` with room for `capacity` pages.
    pub fn open(path: &Path, capacity: usize) -> Result<PageCache, String> {
        let (index, file) = Index::open(path)?;
        PageCache::from_index(Arc::new(index), file, capacity)
    }

    /// A pool over `file`, whose checked index is `index` (from
    /// [`Index::open`]).
    pub(crate) fn from_index(
        index: Arc<Index>,
        file: File,
        capacity: usize,
    ) -> Result<PageCache, String> {
        if capacity == 0 {
            return Err("a process cache needs room for at least one page".into());
        }
        Ok(PageCache {
            reader: PageReader {
                file: Arc::new(file),
                path: index.path.clone(),
                page_size: index.page_size(),
                end: index.header.alloc_table_ptr,
            },
            index,
            capacity,
            resident: HashMap::new(),
            remaining: HashMap::new(),
            loads: 0,
            peak: 0,
        })
    }

    /// The file's index.
    pub fn index(&self) -> &Index {
        &self.index
    }

    /// Begins an epoch that reads `order` (sample ids): pages are kept
    /// until their last sample in it has been read.
    pub fn start_epoch(&mut self, order: &[usize]) {
        self.remaining.clear();
        for &s in order {
            for p in self.index.pages_of(s).collect::<Vec<_>>() {
                *self.remaining.entry(p).or_default() += 1;
            }
        }
        self.resident.retain(|p, _| self.remaining.contains_key(p));
    }

    /// Reads sample `s` (next in the epoch's order), handing its values to
    /// `use_it`, then releases pages it was the last sample of.
    pub fn with_sample<R>(
        &mut self,
        s: usize,
        use_it: impl FnOnce(&[Value<'_>]) -> R,
    ) -> Result<R, String> {
        let pinned = self.pin(s)?;
        let values: Vec<Value<'_>> = (0..self.index.fields.len())
            .map(|f| pinned.value(&self.index, s, f))
            .collect();
        let out = use_it(&values);
        drop(values);
        self.done(s);
        Ok(out)
    }

    /// The pages of sample `s` (next in the epoch's order), read if they
    /// are not resident. They stay valid while the [`Pinned`] lives, even
    /// if the pool evicts them meanwhile (so with `k` samples pinned at
    /// once, up to `capacity + k × pages per sample` are resident). Call
    /// [`done`](Self::done) when the sample has been used.
    pub fn pin(&mut self, s: usize) -> Result<Pinned, String> {
        let mut held = Vec::new();
        loop {
            match self.try_pin(s, &held)? {
                Ok(pinned) => return Ok(pinned),
                Err(p) => {
                    let buf = self.reader.read(p)?;
                    held.push((p, self.insert(p, buf)));
                }
            }
        }
    }

    /// Sample `s` has been used: its pages are released if the epoch has
    /// no more samples on them.
    pub fn done(&mut self, s: usize) {
        if s >= self.index.len() {
            return;
        }
        for p in self.index.pages_of(s).collect::<Vec<_>>() {
            if let Some(left) = self.remaining.get_mut(&p) {
                *left = left.saturating_sub(1);
                if *left == 0 {
                    self.remaining.remove(&p);
                    self.resident.remove(&p);
                }
            }
        }
    }

    /// Sample `s`'s pages if all are resident or in `held` (pages the
    /// caller already has), else the first that is neither (for a caller
    /// that reads it with a [`PageReader`], outside whatever lock guards
    /// this pool, and [`insert`](Self::insert)s it).
    pub fn try_pin(
        &mut self,
        s: usize,
        held: &[(u64, Arc<Vec<u8>>)],
    ) -> Result<Result<Pinned, u64>, String> {
        if s >= self.index.len() {
            return Err(format!(
                "{}: sample {s} of {}",
                self.index.path,
                self.index.len()
            ));
        }
        let mut pages: Vec<(u64, Arc<Vec<u8>>)> = Vec::with_capacity(2);
        for p in self.index.pages_of(s) {
            if pages.iter().any(|h| h.0 == p) {
                continue;
            }
            match self
                .resident
                .get(&p)
                .or_else(|| held.iter().find(|h| h.0 == p).map(|h| &h.1))
            {
                Some(b) => pages.push((p, b.clone())),
                None => return Ok(Err(p)),
            }
        }
        Ok(Ok(Pinned { pages }))
    }

    /// Reads pages of this file without the pool.
    pub fn reader(&self) -> PageReader {
        self.reader.clone()
    }

    /// The file's index, to read values with outside the pool's lock.
    pub fn shared_index(&self) -> Arc<Index> {
        self.index.clone()
    }

    /// Adds page `p`, read by a [`PageReader`], to the pool (evicting the
    /// page with the fewest samples still to come when it is full), and
    /// counts the read.
    pub fn insert(&mut self, p: u64, buf: Vec<u8>) -> Arc<Vec<u8>> {
        if let Some(b) = self.resident.get(&p) {
            return b.clone();
        }
        if self.resident.len() >= self.capacity {
            let victim = *self
                .resident
                .keys()
                .min_by_key(|k| self.remaining.get(k).copied().unwrap_or(0))
                .expect("a full pool has pages");
            self.resident.remove(&victim);
        }
        let buf = Arc::new(buf);
        self.resident.insert(p, buf.clone());
        self.loads += 1;
        self.peak = self.peak.max(self.resident.len());
        buf
    }

    /// Pages read from the file so far.
    pub fn loads(&self) -> u64 {
        self.loads
    }

    /// The most pages resident at once so far.
    pub fn peak_pages(&self) -> usize {
        self.peak
    }

    /// The bound on resident page bytes.
    pub fn bound_bytes(&self) -> u64 {
        self.capacity as u64 * self.index.page_size()
    }
}

/// The pages of one sample, held in memory.
pub struct Pinned {
    pages: Vec<(u64, Arc<Vec<u8>>)>,
}

impl Pinned {
    /// Sample `s`'s value of field `f` (`s` the pinned sample, `f` in
    /// bounds).
    pub fn value<'a>(&'a self, index: &'a Index, s: usize, f: usize) -> Value<'a> {
        let page_size = index.page_size();
        let payload: &[u8] = match index.extent(s, f) {
            Some(e) if e.size > 0 => {
                let buf = &self
                    .pages
                    .iter()
                    .find(|h| h.0 == e.ptr / page_size)
                    .expect("the sample's pages are pinned")
                    .1;
                let at = (e.ptr % page_size) as usize;
                &buf[at..at + e.size as usize]
            }
            _ => &[],
        };
        index.value_with(s, f, payload)
    }
}

/// Reads whole pages of a `.beton` file, independently of its pool.
#[derive(Clone)]
pub struct PageReader {
    file: Arc<File>,
    path: String,
    page_size: u64,
    end: u64,
}

impl PageReader {
    /// Page `p`: `page_size` bytes (the last page, which may end early at
    /// the allocation table, padded with zeros).
    pub fn read(&self, p: u64) -> Result<Vec<u8>, String> {
        let start = p * self.page_size;
        let end = (start + self.page_size).min(self.end);
        let mut buf = vec![0u8; end.saturating_sub(start) as usize];
        self.file
            .read_exact_at(&mut buf, start)
            .map_err(|e| format!("{}: reading page {p}: {e}", self.path))?;
        buf.resize(self.page_size as usize, 0);
        Ok(buf)
    }
}
