//! `braid train`'s sharded checkpoints: `--ckpt-dir`, `--save-every`,
//! `--keep` and `--resume` turned into braid-train's [`Checkpointer`] and
//! [`CheckpointReader`], the run's description saved in every manifest
//! (and compared when resuming), and the check that every output path can
//! be written before the first step.

use braid_train::checkpoint::load::resolve;
use braid_train::checkpoint::save::SaveOptions;
use braid_train::checkpoint::{CheckpointReader, Checkpointer, StateSource};
use braid_train::Checkpoints;
use std::path::{Path, PathBuf};

/// The checkpoint flags.
pub struct CkptFlags<'a> {
    /// `--ckpt-dir`.
    pub dir: Option<&'a Path>,
    /// `--save-every` (0: only at the end).
    pub every: usize,
    /// `--keep` (0: all).
    pub keep: usize,
    /// `--resume DIR|auto`.
    pub resume: Option<&'a str>,
    /// `--ckpt-sync`: write each checkpoint before training goes on.
    pub sync: bool,
}

/// A rank's checkpointing: what it resumes from and what saves it.
#[derive(Default)]
pub struct CkptSetup {
    /// The checkpoint to resume from.
    pub reader: Option<CheckpointReader>,
    /// The saver.
    pub saver: Option<Checkpointer>,
}

impl CkptSetup {
    /// The saver's agreements over every rank of the run (`world`) rather
    /// than the strategy's (see [`Checkpointer::agree_over`]).
    pub fn agree_over(&mut self, world: &braid_comm::Communicator) {
        if let Some(s) = &mut self.saver {
            s.agree_over(world.clone());
        }
    }

    /// The loop's view of it.
    pub fn loop_view(&mut self) -> Checkpoints<'_> {
        Checkpoints {
            resume: self.reader.as_ref().map(|r| r as &dyn StateSource),
            save: self.saver.as_mut(),
        }
    }
}

/// Sets checkpointing up for rank `rank` of `ranks` (every rank calls it),
/// `run` describing the run (compared with a resumed checkpoint's, and
/// saved in new ones); the lead rank prints what it resumes.
pub fn setup(
    f: &CkptFlags<'_>,
    rank: usize,
    ranks: usize,
    strategy: &str,
    run: serde_json::Value,
    lead: bool,
) -> Result<CkptSetup, String> {
    if f.dir.is_none() && (f.every > 0 || f.keep > 0) {
        return Err(
            "--save-every and --keep need --ckpt-dir DIR (where the checkpoints go)".into(),
        );
    }
    let reader = match f.resume {
        None => None,
        Some("auto") => {
            let dir = f.dir.ok_or(
                "--resume auto resumes from --ckpt-dir's newest checkpoint: give --ckpt-dir DIR",
            )?;
            resolve(dir)?
        }
        Some(path) => {
            let p = PathBuf::from(path);
            match resolve(&p)? {
                Some(d) => Some(d),
                None => {
                    return Err(format!(
                        "--resume {path}: no checkpoint there (expected a checkpoint directory or a --ckpt-dir with one; --resume auto starts afresh when there is none)"
                    ))
                }
            }
        }
    };
    let reader = match reader {
        None => {
            if lead && f.resume == Some("auto") {
                println!("--resume auto: no checkpoint yet, starting afresh");
            }
            None
        }
        Some(dir) => {
            let r = CheckpointReader::open(&dir)?;
            if lead {
                let m = r.manifest();
                println!(
                    "resuming from {} (step {}, written by {} rank{} under {})",
                    dir.display(),
                    m.step,
                    m.world_size,
                    if m.world_size == 1 { "" } else { "s" },
                    m.strategy
                );
                for note in differences(&m.run, &run) {
                    println!("note: {note}");
                }
            }
            Some(r)
        }
    };
    let saver = match f.dir {
        None => None,
        Some(dir) => Some(Checkpointer::new(
            SaveOptions {
                root: dir.to_path_buf(),
                every: f.every,
                keep: f.keep,
                at_end: true,
            },
            rank,
            ranks,
            strategy.to_string(),
            run,
            lead,
        )?),
    };
    let saver = saver.map(|mut s| {
        s.write_synchronously(f.sync);
        s
    });
    Ok(CkptSetup { reader, saver })
}

/// What differs between the run that wrote a checkpoint and this one, as
/// notes (a resumed run with other data, seed, schedule or global batch
/// does not continue the first exactly).
fn differences(saved: &serde_json::Value, now: &serde_json::Value) -> Vec<String> {
    let (Some(a), Some(b)) = (saved.as_object(), now.as_object()) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for (k, v) in b {
        // One process has no transport; another transport sums the same
        // numbers (the ranks' change is noted as resharded).
        if k == "backend" {
            continue;
        }
        match a.get(k) {
            Some(old) if old != v => out.push(format!(
                "{k} was {old} when the checkpoint was written, now {v}{}",
                match k.as_str() {
                    "ranks" | "batch_per_rank" | "strategy" | "data_parallel"
                    | "tensor_parallel" | "sequence_parallel" => " (resharded)",
                    _ => " (the run will not continue the first exactly)",
                }
            )),
            _ => {}
        }
    }
    out
}

/// Checks, before training, that every output file can be written: its
/// directory exists and a file can be created there.
pub fn check_outputs(outputs: &[(&str, Option<&Path>)]) -> Result<(), String> {
    for (flag, path) in outputs {
        let Some(path) = path else { continue };
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        if !dir.is_dir() {
            return Err(format!(
                "{flag} {}: the directory {} does not exist (create it first)",
                path.display(),
                dir.display()
            ));
        }
        let probe = dir.join(format!(".braid-probe-{}", std::process::id()));
        std::fs::write(&probe, b"")
            .and_then(|_| std::fs::remove_file(&probe))
            .map_err(|e| {
                format!(
                    "{flag} {}: could not be written ({e}); pick a writable place",
                    path.display()
                )
            })?;
        if path.is_dir() {
            return Err(format!(
                "{flag} {}: is a directory, expected a file",
                path.display()
            ));
        }
    }
    Ok(())
}
