//! [`CheckpointReader`]: a committed checkpoint as a [`StateSource`] —
//! the runs of tensors any layout needs, from whichever ranks' files hold
//! them, every tensor checked against its checksum; and the checks that
//! name what is wrong with a checkpoint (missing, truncated or corrupt
//! files, a different model).

use super::format::{self, Header, PieceName};
use super::names::{FORMAT, LATEST, MANIFEST};
use super::save::{committed, step_dir_name, Manifest};
use super::state::StateSource;
use crate::engine::NamedTensor;
use crate::Result;
use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// A committed checkpoint, open for reading.
pub struct CheckpointReader {
    dir: PathBuf,
    manifest: Manifest,
    /// For every tensor, the pieces that hold it and the rank of each.
    pieces: BTreeMap<String, Vec<(PieceName, usize)>>,
    /// Every tensor's whole shape.
    shapes: HashMap<String, Vec<usize>>,
    /// Headers read so far, by file.
    headers: Mutex<HashMap<String, Arc<Header>>>,
    /// For the tensors read so far, where their pieces' elements sit in
    /// the whole tensor.
    runs: Mutex<HashMap<String, Arc<Vec<StoredRun>>>>,
}

/// A run of a whole tensor's elements stored contiguously in one piece.
#[derive(Debug, Clone, Copy)]
struct StoredRun {
    /// First element in the whole tensor.
    full: usize,
    /// Elements.
    len: usize,
    /// The piece (index into the tensor's pieces).
    piece: usize,
    /// Where the run starts in the piece's stored values.
    at: usize,
}

/// The checkpoint `path` names: a checkpoint directory, or a root whose
/// `latest` names one (`None` when a root holds no checkpoint yet).
pub fn resolve(path: &Path) -> Result<Option<PathBuf>> {
    if path.join(MANIFEST).exists() {
        return Ok(Some(path.to_path_buf()));
    }
    let latest = path.join(LATEST);
    if latest.exists() {
        let name = std::fs::read_to_string(&latest)
            .map_err(|e| format!("{}: could not be read: {e}", latest.display()))?;
        let dir = path.join(name.trim());
        if dir.join(MANIFEST).exists() {
            return Ok(Some(dir));
        }
        // `latest` is written after the rename; a checkpoint removed by
        // hand since: fall back to the newest committed one.
    }
    match committed(path).into_iter().max() {
        Some(step) => Ok(Some(path.join(step_dir_name(step)))),
        // One look at the path: another rank may create the directory
        // between two (is_dir, then exists), which read as neither.
        None => match std::fs::metadata(path) {
            Ok(m) if m.is_dir() => Ok(None),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Ok(_) => Err(format!("{}: not a checkpoint directory", path.display())),
            Err(e) => Err(format!("{}: cannot be read: {e}", path.display())),
        },
    }
}

impl CheckpointReader {
    /// Opens the checkpoint in `dir` (with its manifest), checking that
    /// every file it lists is there.
    pub fn open(dir: &Path) -> Result<CheckpointReader> {
        let path = dir.join(MANIFEST);
        let text = std::fs::read_to_string(&path)
            .map_err(|e| format!("{}: could not be read: {e}", path.display()))?;
        let manifest: Manifest = serde_json::from_str(&text)
            .map_err(|e| format!("{}: corrupt manifest: {e}", path.display()))?;
        if manifest.format != FORMAT {
            return Err(format!(
                "{}: format {:?}, this braid reads {FORMAT:?}",
                path.display(),
                manifest.format
            ));
        }
        let shapes: HashMap<String, Vec<usize>> = manifest
            .tensors
            .iter()
            .map(|t| (t.name.clone(), t.shape.clone()))
            .collect();
        let mut pieces: BTreeMap<String, Vec<(PieceName, usize)>> = BTreeMap::new();
        for (i, r) in manifest.ranks.iter().enumerate() {
            for f in [&r.model, &r.optimizer] {
                if !dir.join(f).exists() {
                    return Err(format!(
                        "{}: shard file {f} (rank {}) is missing",
                        dir.display(),
                        r.rank
                    ));
                }
            }
            for p in &r.pieces {
                let shape = shapes.get(p.tensor.as_str()).ok_or_else(|| {
                    format!("{}: piece of unknown tensor {}", path.display(), p.tensor)
                })?;
                // Elements of the tensor as its writer held it.
                let n = match &p.cut {
                    None => shape.iter().product(),
                    Some(c) => c
                        .place(shape)
                        .map_err(|e| format!("{}: piece of {}: {e}", path.display(), p.tensor))?
                        .local_numel(),
                };
                if p.start >= p.end || p.end > n {
                    return Err(format!(
                        "{}: piece {}..{} of {} ({n} elements)",
                        path.display(),
                        p.start,
                        p.end,
                        p.tensor
                    ));
                }
                pieces
                    .entry(p.tensor.clone())
                    .or_default()
                    .push((p.clone(), i));
            }
        }
        Ok(CheckpointReader {
            dir: dir.to_path_buf(),
            manifest,
            pieces,
            shapes,
            headers: Mutex::new(HashMap::new()),
            runs: Mutex::new(HashMap::new()),
        })
    }

    /// The checkpoint's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Its manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// Checks that a model of `tensors` is the one the checkpoint holds:
    /// the same tensors in the same shapes, or an error naming the first
    /// that differs.
    pub fn check_model(&self, tensors: &[NamedTensor]) -> Result<()> {
        let show = self.dir.display();
        let theirs: HashMap<&str, &Vec<usize>> = self
            .manifest
            .tensors
            .iter()
            .map(|t| (t.name.as_str(), &t.shape))
            .collect();
        for t in tensors {
            match theirs.get(t.name.as_str()) {
                None => {
                    return Err(format!(
                        "{show}: a checkpoint of a different model: it has no tensor {} (it was written by {})",
                        t.name, self.manifest.engine
                    ))
                }
                Some(s) if **s != t.shape => {
                    return Err(format!(
                        "{show}: a checkpoint of a different model: tensor {} is {:?} there, {:?} here (it was written by {})",
                        t.name, s, t.shape, self.manifest.engine
                    ))
                }
                _ => {}
            }
        }
        if theirs.len() != tensors.len() {
            let ours: Vec<&str> = tensors.iter().map(|t| t.name.as_str()).collect();
            let extra = theirs
                .keys()
                .find(|n| !ours.contains(n))
                .copied()
                .unwrap_or("?");
            return Err(format!(
                "{show}: a checkpoint of a different model: it has tensor {extra}, this model does not"
            ));
        }
        Ok(())
    }

    /// Where the pieces of `tensor` put its elements in the whole
    /// tensor, sorted (built once per tensor).
    fn stored_runs(&self, tensor: &str) -> Result<Arc<Vec<StoredRun>>> {
        if let Some(r) = self.runs.lock().expect("runs").get(tensor) {
            return Ok(r.clone());
        }
        let shape = self.shapes.get(tensor).map(Vec::as_slice).unwrap_or(&[]);
        let mut runs = Vec::new();
        for (k, (p, _)) in self.pieces.get(tensor).into_iter().flatten().enumerate() {
            let place = match &p.cut {
                Some(c) => c.place(shape)?,
                None => braid_model::place::Place::whole(shape),
            };
            runs.extend(
                place
                    .full_runs(p.start..p.end)
                    .into_iter()
                    .map(|r| StoredRun {
                        full: r.full,
                        len: r.len,
                        piece: k,
                        at: r.local,
                    }),
            );
        }
        runs.sort_unstable_by_key(|r| r.full);
        let runs = Arc::new(runs);
        self.runs
            .lock()
            .expect("runs")
            .insert(tensor.to_string(), runs.clone());
        Ok(runs)
    }

    /// The values of `what` for the elements `local` of tensor `t` as
    /// this run holds it (its place in the whole tensor), from whichever
    /// pieces hold them: each piece read once.
    fn tensor_run(
        &self,
        what: &str,
        t: &NamedTensor,
        local: Range<usize>,
        out: &mut [f32],
    ) -> Result<()> {
        let stored = self.stored_runs(&t.name)?;
        // For each piece: (offset in its values, offset in `out`, length).
        let mut copies: BTreeMap<usize, Vec<(usize, usize, usize)>> = BTreeMap::new();
        let mut filled = 0;
        for w in t.place().full_runs(local.clone()) {
            let (ws, we) = (w.full, w.full + w.len);
            let mut k = stored.partition_point(|s| s.full + s.len <= ws);
            while let Some(s) = stored.get(k).filter(|s| s.full < we) {
                let (a, b) = (ws.max(s.full), we.min(s.full + s.len));
                copies.entry(s.piece).or_default().push((
                    s.at + (a - s.full),
                    w.local + (a - ws),
                    b - a,
                ));
                filled += b - a;
                k += 1;
            }
        }
        if filled != local.len() {
            return Err(format!(
                "{}: elements {local:?} of tensor {} (as held here) are not all in the checkpoint",
                self.dir.display(),
                t.name
            ));
        }
        let pieces = &self.pieces[&t.name];
        let numel: usize = t.shape.iter().product();
        for (k, list) in copies {
            let (p, rank) = &pieces[k];
            let r = &self.manifest.ranks[*rank];
            let key = p.key(numel);
            let (file, key) = match what {
                "params" => (&r.model, key),
                moment => (&r.optimizer, format!("{moment}/{key}")),
            };
            let values = self.read_stored(file, &key)?;
            if values.len() != p.end - p.start {
                return Err(format!(
                    "{}: tensor {key:?} holds {} elements, the manifest says {}",
                    self.dir.join(file).display(),
                    values.len(),
                    p.end - p.start
                ));
            }
            for (from, to, len) in list {
                out[to..to + len].copy_from_slice(&values[from..from + len]);
            }
        }
        Ok(())
    }

    /// Stored tensor `key` of `file`, checked against its checksum.
    fn read_stored(&self, file: &str, key: &str) -> Result<Vec<f32>> {
        let path = self.dir.join(file);
        let header = {
            let mut h = self.headers.lock().expect("headers");
            if !h.contains_key(file) {
                h.insert(file.to_string(), Arc::new(format::read_header(&path)?));
            }
            h[file].clone()
        };
        format::read_tensor(&path, &header, key)
    }
}

impl StateSource for CheckpointReader {
    fn read(
        &self,
        what: &str,
        tensors: &[NamedTensor],
        ranges: &[Range<usize>],
    ) -> Result<Vec<f32>> {
        self.check_model(tensors)?;
        if what != "params" && !self.manifest.optimizer.moments.iter().any(|m| m == what) {
            return Err(format!(
                "{}: the checkpoint's optimizer ({}) has no {what}",
                self.dir.display(),
                self.manifest.optimizer.kind
            ));
        }
        let total: usize = ranges.iter().map(|r| r.len()).sum();
        let mut out = vec![0.0f32; total];
        let mut at = 0;
        for r in ranges {
            for t in tensors {
                let cut = r.start.max(t.range.start)..r.end.min(t.range.end);
                if cut.is_empty() {
                    continue;
                }
                let dst = at + (cut.start - r.start);
                let want = cut.start - t.range.start..cut.end - t.range.start;
                self.tensor_run(what, t, want, &mut out[dst..dst + cut.len()])?;
            }
            at += r.len();
        }
        Ok(out)
    }

    fn optimizer(&self) -> (String, Vec<String>) {
        (
            self.manifest.optimizer.kind.clone(),
            self.manifest.optimizer.moments.clone(),
        )
    }

    fn step(&self) -> u64 {
        self.manifest.step
    }
}
