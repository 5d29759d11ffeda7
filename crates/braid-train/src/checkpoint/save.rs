//! [`Checkpointer`]: writing sharded checkpoints while training goes on.
//!
//! A save copies the rank's part of the state into host memory (the only
//! stall), hands it to a background thread that writes the rank's two
//! files into the checkpoint's temporary directory and flushes them, and
//! returns. At every later step the ranks agree (a mean over the ranks of
//! "my files are on the disk" and "my write failed") whether all are done;
//! once they are, rank 0 commits: it reads every rank's header, checks
//! that the pieces cover every tensor exactly once, writes the index and
//! the manifest, renames the directory to `step-NNNNNNNN`, updates
//! `latest` and removes checkpoints beyond `--keep`. A crash at any point
//! leaves the previous checkpoint whole; the next save waits for the
//! previous one.

use super::format::{self, Entry, PieceName};
use super::names::{FORMAT, INDEX, LATEST, MANIFEST};
use super::staging::Staging;
use super::state::StatePart;
use crate::engine::NamedTensor;
use crate::Result;
use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;
use std::time::Instant;

/// How long a rank waits for its own background write when `BRAID_TIMEOUT`
/// does not say (as every other wait).
const DEFAULT_WRITE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(300);

/// The manifest of a committed checkpoint (`braid-checkpoint.json`).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Manifest {
    /// [`FORMAT`].
    pub format: String,
    /// Optimizer steps done when it was written.
    pub step: u64,
    /// Ranks that wrote it.
    pub world_size: usize,
    /// The strategy that wrote it (as its header line describes it).
    pub strategy: String,
    /// The engine (model, precision) that wrote it.
    pub engine: String,
    /// Every tensor of the model: name and shape.
    pub tensors: Vec<TensorInfo>,
    /// The optimizer: kind and moments.
    pub optimizer: OptimizerInfo,
    /// Every rank's files and the pieces it wrote.
    pub ranks: Vec<RankFiles>,
    /// Where training stood.
    pub trainer: TrainerState,
    /// What the run was (model, data, seed, schedule, batch: the command
    /// line's choices), compared when resuming.
    pub run: serde_json::Value,
}

/// A tensor's name and shape.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TensorInfo {
    /// Its name.
    pub name: String,
    /// Its shape.
    pub shape: Vec<usize>,
}

/// The optimizer of a checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct OptimizerInfo {
    /// `adamw` or `sgd`.
    pub kind: String,
    /// Its moments' names (each stored as `<name>/<piece key>`).
    pub moments: Vec<String>,
}

/// One rank's files.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RankFiles {
    /// The rank.
    pub rank: usize,
    /// Its parameters' file.
    pub model: String,
    /// Its optimizer state's file.
    pub optimizer: String,
    /// The runs of tensors it holds (the shard ranges of the layout that
    /// wrote it, by tensor).
    pub pieces: Vec<PieceName>,
}

/// Where training stood at a checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TrainerState {
    /// Optimizer steps done (the learning-rate schedule's position).
    pub step: u64,
    /// Micro-batches each rank's sampler had handed out (the data
    /// position; every rank's is the same).
    pub micro_batches: u64,
    /// Random draws made by the training loop: none (braid draws at
    /// initialisation and shuffles by `seed + epoch`; there is no dropout),
    /// recorded so that a format that adds some can tell.
    pub rng_draws: u64,
}

/// Where and how often to save.
#[derive(Debug, Clone)]
pub struct SaveOptions {
    /// The checkpoint root (`--ckpt-dir`).
    pub root: PathBuf,
    /// Save after every this many steps (0: only at the end).
    pub every: usize,
    /// Keep this many newest checkpoints (0: all).
    pub keep: usize,
    /// Also save after the last step.
    pub at_end: bool,
}

/// Where a save's stall went before its write started.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Stall {
    /// Seconds waiting for the previous save to be written.
    pub waited_s: f64,
    /// Seconds copying the state into host memory.
    pub copied_s: f64,
}

/// What one save cost.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SaveReport {
    /// Optimizer steps done at the save.
    pub step: u64,
    /// Seconds training stood still: waiting for the previous save,
    /// copying the state to host memory, and (written synchronously) the
    /// write.
    pub stall_s: f64,
    /// Of which waiting and copying.
    pub stall: Stall,
    /// Of which committing it (rank 0: index, manifest, rename, `--keep`).
    pub commit_s: f64,
    /// Seconds the background write of this rank's files took.
    pub write_s: f64,
    /// Bytes this rank wrote.
    pub bytes: u64,
}

/// A save in flight on this rank.
struct InFlight {
    step: u64,
    micro_batches: u64,
    tmp: PathBuf,
    tensors: Vec<NamedTensor>,
    engine: String,
    moments: (String, Vec<String>),
    stall: Stall,
    stall_s: f64,
    handle: Option<JoinHandle<Written>>,
    /// The background write's outcome once joined.
    outcome: Option<Result<(u64, f64)>>,
}

/// What the writer thread hands back: bytes written and seconds taken,
/// or why it failed; and the part's buffers, for the next save.
type Written = (Result<(u64, f64)>, Option<StatePart>);

/// Saves a rank's checkpoints (see the module docs).
pub struct Checkpointer {
    opts: SaveOptions,
    rank: usize,
    world: usize,
    strategy: String,
    run: serde_json::Value,
    inflight: Option<InFlight>,
    reports: Vec<SaveReport>,
    /// Rank 0 prints a line per committed checkpoint.
    announce: bool,
    /// Host memory for the parts, reused from save to save.
    staging: Option<Staging>,
    /// Write each save before training goes on (to compare with the
    /// background write).
    sync: bool,
    /// Every rank of the run, which the agreements go over when given
    /// ([`agree_over`](Checkpointer::agree_over)), rather than the
    /// strategy's ranks.
    world_comm: Option<braid_comm::Communicator>,
}

/// A piece of a rank's part: which tensor run, under which key and
/// shape, and where its values are in the part.
struct PieceAt {
    key: String,
    shape: Vec<usize>,
    at: Range<usize>,
}

/// Cuts the flat `ranges` of a part into runs of `tensors` (elements
/// between tensors are padding, not stored).
fn pieces_of(tensors: &[NamedTensor], ranges: &[Range<usize>]) -> Vec<PieceAt> {
    let mut out = Vec::new();
    let mut at = 0usize;
    for r in ranges {
        for t in tensors {
            let cut = r.start.max(t.range.start)..r.end.min(t.range.end);
            if cut.is_empty() || !t.stored {
                continue;
            }
            let name = PieceName {
                tensor: t.name.clone(),
                start: cut.start - t.range.start,
                end: cut.end - t.range.start,
                cut: t.place.as_ref().and_then(format::Cut::of),
            };
            let numel = t.range.len();
            let shape = match name.end - name.start == numel && name.cut.is_none() {
                true => t.shape.clone(),
                false => vec![cut.len()],
            };
            let from = at + (cut.start - r.start);
            out.push(PieceAt {
                key: name.key(numel),
                shape,
                at: from..from + cut.len(),
            });
        }
        at += r.len();
    }
    out
}

/// The name of step `step`'s checkpoint directory.
pub fn step_dir_name(step: u64) -> String {
    format!("step-{step:08}")
}

fn model_file(rank: usize, world: usize) -> String {
    format!("model-rank{rank:05}-of-{world:05}.safetensors")
}

fn optim_file(rank: usize, world: usize) -> String {
    format!("optim-rank{rank:05}-of-{world:05}.safetensors")
}

impl Checkpointer {
    /// Rank `rank` of `world` saving as `opts` says; `strategy` and `run`
    /// go into every manifest; with `announce`, rank 0 prints a line per
    /// committed checkpoint. The root is created (and checked to be
    /// writable) now, before training starts.
    pub fn new(
        opts: SaveOptions,
        rank: usize,
        world: usize,
        strategy: String,
        run: serde_json::Value,
        announce: bool,
    ) -> Result<Checkpointer> {
        let root = &opts.root;
        std::fs::create_dir_all(root)
            .map_err(|e| format!("--ckpt-dir {}: could not be created: {e}", root.display()))?;
        // A name of this call's own: a parameter server's workers all
        // check the root as rank 0, and two probes of one name race (one
        // removes the other's file).
        static PROBES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = PROBES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let probe = root.join(format!(".probe-rank{rank}-{}-{n}", std::process::id()));
        std::fs::write(&probe, b"")
            .and_then(|_| std::fs::remove_file(&probe))
            .map_err(|e| format!("--ckpt-dir {}: could not be written: {e}", root.display()))?;
        Ok(Checkpointer {
            opts,
            rank,
            world,
            strategy,
            run,
            inflight: None,
            reports: Vec::new(),
            announce,
            staging: None,
            sync: false,
            world_comm: None,
        })
    }

    /// Agrees over `world` (every rank of the run) instead of through the
    /// mean the loop passes in, which spans the strategy's ranks only — a
    /// pipeline's data group holds one stage, and rank 0 must not commit
    /// before the other stages' files are written. `braid train` agrees
    /// over the world whenever it has one.
    pub fn agree_over(&mut self, world: braid_comm::Communicator) {
        self.world_comm = Some(world);
    }

    /// Whether a save is due after `steps_done` optimizer steps of
    /// `total`.
    pub fn due(&self, steps_done: usize, total: usize) -> bool {
        (self.opts.every > 0 && steps_done % self.opts.every == 0)
            || (self.opts.at_end && steps_done == total)
    }

    /// What every save cost so far.
    pub fn reports(&self) -> &[SaveReport] {
        &self.reports
    }

    /// Makes every save write its files before training goes on (the
    /// stall then includes the write: what the background write saves is
    /// measured against this).
    pub fn write_synchronously(&mut self, sync: bool) {
        self.sync = sync;
    }

    /// The host memory the next part goes into: page-locked for state on
    /// `device` (made at the first save; the device cannot change).
    pub fn staging(&mut self, device: Option<&braid_cuda::Device>) -> &mut Staging {
        self.staging
            .get_or_insert_with(|| Staging::new(device.cloned()))
    }

    /// Starts saving `part` (this rank's, after `step` optimizer steps and
    /// `micro_batches` micro-batches) in the background, after the
    /// previous save is committed; `stall` is what waiting for it and
    /// producing the part cost. `agree` is the mean over every rank (all
    /// ranks call this at the same step).
    #[allow(clippy::too_many_arguments)]
    pub fn save(
        &mut self,
        step: u64,
        micro_batches: u64,
        part: StatePart,
        tensors: Vec<NamedTensor>,
        engine: String,
        stall: Stall,
        agree: &mut dyn FnMut(&mut [f64]) -> Result<()>,
    ) -> Result<()> {
        self.wait(agree)?;
        let t0 = Instant::now();
        let tmp = self.opts.root.join(format!(".{}.tmp", step_dir_name(step)));
        std::fs::create_dir_all(&tmp)
            .map_err(|e| format!("checkpoint {}: could not be created: {e}", tmp.display()))?;
        let moments = (
            part.kind.clone(),
            part.moments.iter().map(|(n, _)| n.clone()).collect(),
        );
        let pieces = pieces_of(&tensors, &part.ranges);
        let (model, optim) = (
            tmp.join(model_file(self.rank, self.world)),
            tmp.join(optim_file(self.rank, self.world)),
        );
        let meta = vec![
            ("format".to_string(), "pt".to_string()),
            ("braid.rank".to_string(), self.rank.to_string()),
            ("braid.step".to_string(), step.to_string()),
        ];
        let rank = self.rank;
        let handle = std::thread::Builder::new()
            .name("braid-ckpt-writer".into())
            .spawn(move || -> Written {
                crate::test_delay::apply(rank, "write");
                let t = Instant::now();
                let write = || -> Result<u64> {
                    let entries: Vec<Entry<'_>> = pieces
                        .iter()
                        .map(|p| Entry {
                            key: p.key.clone(),
                            shape: p.shape.clone(),
                            values: &part.params[p.at.clone()],
                        })
                        .collect();
                    format::write_safetensors(&model, &entries, &meta)?;
                    let mut entries = Vec::new();
                    for (name, values) in &part.moments {
                        for p in &pieces {
                            entries.push(Entry {
                                key: format!("{name}/{}", p.key),
                                shape: vec![p.at.len()],
                                values: &values[p.at.clone()],
                            });
                        }
                    }
                    format::write_safetensors(&optim, &entries, &meta)?;
                    Ok(4 * part.params.len() as u64 * (1 + part.moments.len() as u64))
                };
                let r = write().map(|bytes| (bytes, t.elapsed().as_secs_f64()));
                (r, Some(part))
            })
            .map_err(|e| format!("checkpoint: could not start the writer thread: {e}"))?;
        self.inflight = Some(InFlight {
            step,
            micro_batches,
            tmp,
            tensors,
            engine,
            moments,
            stall,
            stall_s: stall.waited_s + stall.copied_s + t0.elapsed().as_secs_f64(),
            handle: Some(handle),
            outcome: None,
        });
        if self.sync {
            let t = Instant::now();
            self.wait(agree)?;
            if let Some(r) = self.reports.last_mut() {
                // (The commit is in both: counted once.)
                r.stall_s += t.elapsed().as_secs_f64() - r.commit_s;
            }
            self.announce_last();
        }
        Ok(())
    }

    /// Rank 0 (when announcing) prints the last save's line.
    fn announce_last(&self) {
        if let (0, true, Some(r)) = (self.rank, self.announce, self.reports.last()) {
            println!(
                "checkpoint {} saved in {} (training stalled {:.3} s: waiting for the previous save {:.3} s, copying {:.3} s, committing {:.3} s{}; rank 0 wrote {:.1} MB in {:.2} s)",
                step_dir_name(r.step),
                self.opts.root.display(),
                r.stall_s,
                r.stall.waited_s,
                r.stall.copied_s,
                r.commit_s,
                if self.sync { ", writing before going on" } else { "" },
                r.bytes as f64 / 1e6,
                r.write_s
            );
        }
    }

    /// Once per step: if a save is in flight, asks every rank whether its
    /// files are written, and commits when all are (never waits for the
    /// disk). A failed write on any rank is an error on every rank.
    pub fn poll(&mut self, agree: &mut dyn FnMut(&mut [f64]) -> Result<()>) -> Result<()> {
        let Some(f) = self.inflight.as_mut() else {
            return Ok(());
        };
        if f.outcome.is_none() && f.handle.as_ref().is_some_and(|h| h.is_finished()) {
            let h = f.handle.take().expect("handle");
            f.outcome = Some(join(h, &mut self.staging));
        }
        self.settle(agree, false)
    }

    /// Waits for the save in flight (if any) on every rank and commits it.
    pub fn wait(&mut self, agree: &mut dyn FnMut(&mut [f64]) -> Result<()>) -> Result<()> {
        let Some(f) = self.inflight.as_mut() else {
            return Ok(());
        };
        if let Some(h) = f.handle.take() {
            // The write is this rank's own disk: bounded like every wait
            // (a stuck file system would otherwise hang the run here).
            let limit = braid_core::WorldInfo::timeout_from_env(DEFAULT_WRITE_TIMEOUT)
                .unwrap_or(DEFAULT_WRITE_TIMEOUT);
            let t0 = Instant::now();
            while !h.is_finished() {
                if t0.elapsed() >= limit {
                    return Err(format!(
                        "rank {}: checkpoint at step {}: this rank's background write into {} has \
                         not finished after waiting {:.0?} (a stuck or very slow file system; \
                         raise BRAID_TIMEOUT if it is only slow)",
                        self.rank,
                        f.step,
                        f.tmp.display(),
                        limit
                    ));
                }
                std::thread::sleep(std::time::Duration::from_millis(2));
            }
            f.outcome = Some(join(h, &mut self.staging));
        }
        self.settle(agree, true)
    }

    /// The agreement round: commits when every rank is done; with
    /// `must`, every rank is (each waited for its writer).
    fn settle(
        &mut self,
        agree: &mut dyn FnMut(&mut [f64]) -> Result<()>,
        must: bool,
    ) -> Result<()> {
        let f = self.inflight.as_ref().expect("in flight");
        let (done, failed) = match &f.outcome {
            None => (0.0, 0.0),
            Some(Ok(_)) => (1.0, 0.0),
            Some(Err(_)) => (1.0, 1.0),
        };
        let mut v = [done, failed];
        match &self.world_comm {
            Some(c) => {
                c.all_reduce(&mut v, braid_comm::ReduceOp::Sum)
                    .map_err(|e| {
                        format!(
                            "checkpoint at step {}: agreeing with every rank that the files are \
                         written: {e}",
                            f.step
                        )
                    })?;
                let n = c.size() as f64;
                v.iter_mut().for_each(|x| *x /= n);
            }
            None => agree(&mut v)?,
        }
        if v[1] > 0.0 {
            let f = self.inflight.take().expect("in flight");
            let why = match f.outcome {
                Some(Err(e)) => e,
                _ => "another rank could not write its files".into(),
            };
            if self.rank == 0 {
                let _ = std::fs::remove_dir_all(&f.tmp);
            }
            return Err(format!(
                "checkpoint at step {} failed (the previous checkpoint is untouched): {why}",
                f.step
            ));
        }
        if v[0] < 1.0 {
            debug_assert!(!must, "every rank waited, yet not all are done");
            return Ok(());
        }
        let f = self.inflight.take().expect("in flight");
        let (bytes, write_s) = match f.outcome {
            Some(Ok(x)) => x,
            _ => unreachable!("agreed done"),
        };
        let t = Instant::now();
        if self.rank == 0 {
            self.commit(&f)?;
        }
        let commit_s = t.elapsed().as_secs_f64();
        self.reports.push(SaveReport {
            step: f.step,
            stall: f.stall,
            stall_s: f.stall_s + commit_s,
            commit_s,
            write_s,
            bytes,
        });
        if !self.sync {
            self.announce_last();
        }
        Ok(())
    }

    /// Rank 0: every rank's files are on the disk; makes the checkpoint.
    fn commit(&self, f: &InFlight) -> Result<()> {
        // Elements of each whole tensor (what a bare key stores).
        let numel: BTreeMap<&str, usize> = f
            .tensors
            .iter()
            .map(|t| (t.name.as_str(), t.shape.iter().product()))
            .collect();
        let shapes: BTreeMap<&str, &[usize]> = f
            .tensors
            .iter()
            .map(|t| (t.name.as_str(), t.shape.as_slice()))
            .collect();
        let mut ranks = Vec::with_capacity(self.world);
        let mut weight_map = BTreeMap::new();
        let mut total_size = 0u64;
        let mut covered: BTreeMap<&str, Vec<(usize, usize)>> = BTreeMap::new();
        for r in 0..self.world {
            let (model, optim) = (model_file(r, self.world), optim_file(r, self.world));
            let header = format::read_header(&f.tmp.join(&model))?;
            let mut pieces = Vec::with_capacity(header.tensors.len());
            for (key, t) in &header.tensors {
                let p = PieceName::parse(key, |n| numel.get(n).copied())?;
                weight_map.insert(key.clone(), model.clone());
                total_size += t.bytes.end - t.bytes.start;
                if let Some((name, shape)) = shapes.get_key_value(p.tensor.as_str()) {
                    // Where the piece's elements sit in the whole tensor.
                    let place = match &p.cut {
                        Some(c) => c.place(shape)?,
                        None => braid_model::place::Place::whole(shape),
                    };
                    let runs = place.full_runs(p.start..p.end);
                    covered
                        .entry(name)
                        .or_default()
                        .extend(runs.iter().map(|r| (r.full, r.full + r.len)));
                }
                pieces.push(p);
            }
            ranks.push(RankFiles {
                rank: r,
                model,
                optimizer: optim,
                pieces,
            });
        }
        // Every element of every tensor written exactly once.
        for t in &f.tensors {
            let mut runs = covered.remove(t.name.as_str()).unwrap_or_default();
            runs.sort();
            let mut at = 0;
            for (s, e) in runs {
                if s != at {
                    return Err(format!(
                        "checkpoint at step {}: tensor {} has elements {at}..{s} written {} (a bug: please report it)",
                        f.step,
                        t.name,
                        if s > at { "by no rank" } else { "twice" }
                    ));
                }
                at = e;
            }
            if at != numel[t.name.as_str()] {
                return Err(format!(
                    "checkpoint at step {}: tensor {} has elements {at}.. written by no rank (a bug: please report it)",
                    f.step, t.name
                ));
            }
        }
        let manifest = Manifest {
            format: FORMAT.into(),
            step: f.step,
            world_size: self.world,
            strategy: self.strategy.clone(),
            engine: f.engine.clone(),
            tensors: f
                .tensors
                .iter()
                .map(|t| TensorInfo {
                    name: t.name.clone(),
                    shape: t.shape.clone(),
                })
                .collect(),
            optimizer: OptimizerInfo {
                kind: f.moments.0.clone(),
                moments: f.moments.1.clone(),
            },
            ranks,
            trainer: TrainerState {
                step: f.step,
                micro_batches: f.micro_batches,
                rng_draws: 0,
            },
            run: self.run.clone(),
        };
        let index = serde_json::json!({
            "metadata": {"total_size": total_size},
            "weight_map": weight_map,
        });
        let pretty = |v: &serde_json::Value| serde_json::to_string_pretty(v).expect("json");
        format::write_atomic(&f.tmp.join(INDEX), &pretty(&index))?;
        format::write_atomic(
            &f.tmp.join(MANIFEST),
            &pretty(&serde_json::to_value(&manifest).expect("manifest")),
        )?;
        // Files no rank of this world wrote (a crashed attempt's) go.
        let keep: Vec<String> = manifest
            .ranks
            .iter()
            .flat_map(|r| [r.model.clone(), r.optimizer.clone()])
            .chain([INDEX.to_string(), MANIFEST.to_string()])
            .collect();
        if let Ok(entries) = std::fs::read_dir(&f.tmp) {
            for e in entries.flatten() {
                if !keep.iter().any(|k| *k == e.file_name().to_string_lossy()) {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
        let name = step_dir_name(f.step);
        let dest = self.opts.root.join(&name);
        let io = |e: std::io::Error| {
            format!("checkpoint {}: could not be committed: {e}", dest.display())
        };
        let old = self.opts.root.join(format!(".{name}.old"));
        if dest.exists() {
            let _ = std::fs::remove_dir_all(&old);
            std::fs::rename(&dest, &old).map_err(io)?;
        }
        std::fs::rename(&f.tmp, &dest).map_err(io)?;
        format::sync_dir(&self.opts.root)?;
        format::write_atomic(&self.opts.root.join(LATEST), &format!("{name}\n"))?;
        let _ = std::fs::remove_dir_all(&old);
        self.prune()
    }

    /// Removes committed checkpoints beyond the newest `keep`: each is
    /// renamed out of the way at once (`.step-N.deleting`, which resuming
    /// ignores) and deleted by a background thread (deleting gigabytes
    /// takes seconds that training need not wait for), with any such
    /// directory a crash left behind.
    fn prune(&self) -> Result<()> {
        if self.opts.keep == 0 {
            return Ok(());
        }
        let root = &self.opts.root;
        let mut steps = committed(root);
        steps.sort();
        let n = steps.len().saturating_sub(self.opts.keep);
        for s in &steps[..n] {
            let name = step_dir_name(*s);
            let (dir, gone) = (root.join(&name), root.join(format!(".{name}.deleting")));
            std::fs::rename(&dir, &gone)
                .map_err(|e| format!("--keep: could not remove {}: {e}", dir.display()))?;
        }
        let doomed: Vec<PathBuf> = std::fs::read_dir(root)
            .map(|d| {
                d.flatten()
                    .map(|e| e.path())
                    .filter(|p| p.to_string_lossy().ends_with(".deleting"))
                    .collect()
            })
            .unwrap_or_default();
        if !doomed.is_empty() {
            let _ = std::thread::Builder::new()
                .name("braid-ckpt-prune".into())
                .spawn(move || {
                    for d in doomed {
                        let _ = std::fs::remove_dir_all(d);
                    }
                });
        }
        Ok(())
    }
}

/// The steps of the committed checkpoints under `root`.
pub fn committed(root: &Path) -> Vec<u64> {
    let Ok(entries) = std::fs::read_dir(root) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().to_string();
            let step = name.strip_prefix("step-")?.parse::<u64>().ok()?;
            e.path().join(MANIFEST).exists().then_some(step)
        })
        .collect()
}

/// The writer's outcome; its buffers go back to `staging`.
fn join(h: JoinHandle<Written>, staging: &mut Option<Staging>) -> Result<(u64, f64)> {
    match h.join() {
        Ok((r, part)) => {
            if let (Some(s), Some(p)) = (staging.as_mut(), part) {
                s.give_back(p.into_bufs());
            }
            r
        }
        Err(_) => Err("the checkpoint writer thread panicked".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::{Checkpointer, SaveOptions};

    /// Many checkpointers opened at once on one root as the same rank (a
    /// parameter server's workers each check the root as rank 0): every
    /// one finds it writable, and no probe is left behind.
    #[test]
    fn checkpointers_of_one_rank_check_one_root_at_once() {
        let root = std::env::temp_dir().join(format!("braid-probe-race-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let opened: Vec<Result<(), String>> = std::thread::scope(|s| {
            let threads: Vec<_> = (0..8)
                .map(|_| {
                    s.spawn(|| {
                        for _ in 0..50 {
                            let opts = SaveOptions {
                                root: root.clone(),
                                every: 0,
                                keep: 0,
                                at_end: false,
                            };
                            Checkpointer::new(
                                opts,
                                0,
                                1,
                                "test".into(),
                                serde_json::Value::Null,
                                false,
                            )?;
                        }
                        Ok(())
                    })
                })
                .collect();
            threads.into_iter().map(|t| t.join().unwrap()).collect()
        });
        for r in opened {
            r.unwrap();
        }
        let left = std::fs::read_dir(&root).unwrap().count();
        std::fs::remove_dir_all(&root).unwrap();
        assert_eq!(left, 0, "probes left in the root");
    }
}
