//! Sharded checkpoints: every rank writes the part of the model state it
//! holds — parameters and optimizer state, as runs of named tensors — into
//! its own safetensors files; rank 0 then commits the checkpoint with a
//! manifest of the layout that wrote it and Hugging Face's
//! `model.safetensors.index.json`. Loading reads, for whatever a rank
//! holds under the strategy and world it runs in now, the runs that cover
//! it: a checkpoint written by N ranks under one strategy loads under M
//! ranks and another (resharding).
//!
//! - [`format`](mod@format): the files (safetensors with a CRC-32 per tensor, headers
//!   read without trusting a length, piece names);
//! - [`save`]: [`Checkpointer`] — the background writer, the agreement
//!   that every rank's files are on the disk, rank 0's atomic commit
//!   (temporary directory, `fsync`, rename), `latest`, `--keep`;
//! - [`load`]: [`CheckpointReader`] — a committed checkpoint as a
//!   [`StateSource`], every tensor checked against its checksum;
//!
//! A checkpoint directory `DIR` holds `step-00000100/` (one per save),
//! each with `model-rank00000-of-00002.safetensors`,
//! `optim-rank00000-of-00002.safetensors`, …, `model.safetensors.index.json`
//! and `braid-checkpoint.json`, and `DIR/latest` names the newest. The
//! directory must be shared by every rank (one host, or a shared file
//! system).

pub mod format;
pub mod load;
mod names;
pub mod save;
pub mod staging;
mod state;

pub use load::CheckpointReader;
pub use names::{FORMAT, INDEX, LATEST, MANIFEST};
pub use save::{Checkpointer, SaveReport};
pub use staging::{HostBuf, Staging};
pub use state::{StatePart, StateSource};

use crate::engine::{Checkpointable, NamedTensor, OptimizerState};
use crate::engines::copy_at;
use crate::space::Space;
use crate::Result;
use std::ops::Range;

/// The optimizer state of the elements `ranges` (each inside one range
/// the optimizer owns), into buffers from `staging`.
pub fn moments_part<E: Checkpointable>(
    engine: &mut E,
    ranges: &[Range<usize>],
    staging: &mut Staging,
) -> Result<(String, Vec<(String, HostBuf)>)> {
    let (kind, names) = engine.optimizer_moments()?;
    let len = ranges.iter().map(|r| r.len()).sum();
    let mut moments = Vec::with_capacity(names.len());
    for (i, name) in names.into_iter().enumerate() {
        let mut buf = staging.take(len)?;
        engine.read_moment(i, ranges, &mut buf)?;
        moments.push((name, buf));
    }
    Ok((kind, moments))
}

/// The optimizer state for `ranges` read from `from`.
pub fn read_optimizer(
    from: &dyn StateSource,
    tensors: &[NamedTensor],
    ranges: &[Range<usize>],
) -> Result<OptimizerState> {
    let (kind, names) = from.optimizer();
    let mut moments = Vec::with_capacity(names.len());
    for n in names {
        let v = from.read(&n, tensors, ranges)?;
        moments.push((n, v));
    }
    Ok(OptimizerState { kind, moments })
}

/// The engine's named tensors, or why it cannot be checkpointed.
pub fn tensors_of<E: Checkpointable>(engine: &E) -> Result<Vec<NamedTensor>> {
    let t = engine.tensors();
    match t.is_empty() {
        true => Err("this engine cannot be checkpointed (it names no tensors)".into()),
        false => Ok(t),
    }
}

/// The part a rank holding whole parameters writes: the elements
/// `ranges` of its parameters and optimizer state, into buffers from
/// `staging`.
pub fn whole_part<E: Checkpointable>(
    engine: &mut E,
    ranges: Vec<Range<usize>>,
    staging: &mut Staging,
) -> Result<StatePart> {
    engine.synchronize()?;
    let mut params = staging.take(ranges.iter().map(|r| r.len()).sum())?;
    match engine.host_params() {
        // An offloaded optimizer's master weights, in host memory.
        Some(host) => copy_at(host, &ranges, &mut params)?,
        None => E::Space::read_ranges_into(engine.params(), &ranges, &mut params)?,
    }
    let (kind, moments) = moments_part(engine, &ranges, staging)?;
    Ok(StatePart {
        ranges,
        params,
        kind,
        moments,
    })
}

/// The elements of an engine's whole flat buffer: its master weights',
/// which live in host memory when the optimizer is offloaded (the GPU's
/// buffer then holds only what its passes read in f32).
pub fn whole_len<E: Checkpointable>(engine: &E) -> usize {
    match engine.host_params() {
        Some(host) => host.len(),
        None => E::Space::len(engine.params()),
    }
}

/// Loads whole parameters from `from` into `engine`.
pub fn restore_whole_params<E: Checkpointable>(
    engine: &mut E,
    from: &dyn StateSource,
) -> Result<()> {
    let tensors = tensors_of(engine)?;
    let whole = 0..whole_len(engine);
    let p = from.read("params", &tensors, std::slice::from_ref(&whole))?;
    engine.load_params(&p)
}

/// Loads the optimizer state of the elements `shard` (all the optimizer
/// owns) from `from` into `engine`.
pub fn restore_optimizer<E: Checkpointable>(
    engine: &mut E,
    from: &dyn StateSource,
    shard: &[Range<usize>],
) -> Result<()> {
    let tensors = tensors_of(engine)?;
    let state = read_optimizer(from, &tensors, shard)?;
    engine.set_optimizer_state(&state, from.step())
}

/// Rank `rank`'s share of a model replicated on `ranks` ranks, for
/// writing: consecutive whole tensors, about an equal number of elements
/// per rank (so each rank writes whole tensors, and every rank writes).
pub fn replica_share(tensors: &[NamedTensor], rank: usize, ranks: usize) -> Vec<Range<usize>> {
    let total: usize = tensors.iter().map(|t| t.range.len()).sum();
    let mut out: Vec<Range<usize>> = Vec::new();
    let mut before = 0usize;
    for t in tensors {
        // The tensor goes to the rank whose equal share holds its middle.
        let mid = before + t.range.len() / 2;
        let owner = (mid * ranks).checked_div(total).unwrap_or(0).min(ranks - 1);
        before += t.range.len();
        if owner != rank {
            continue;
        }
        match out.last_mut() {
            Some(last) if last.end == t.range.start => last.end = t.range.end,
            _ => out.push(t.range.clone()),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replica_shares_cover_every_tensor_once() {
        let tensors: Vec<NamedTensor> = [(0, 10), (10, 11), (16, 40), (40, 41), (41, 100)]
            .iter()
            .enumerate()
            .map(|(i, &(a, b))| NamedTensor::whole(format!("t{i}"), vec![b - a], a..b))
            .collect();
        for ranks in 1..=7 {
            let mut all: Vec<Range<usize>> = (0..ranks)
                .flat_map(|r| replica_share(&tensors, r, ranks))
                .collect();
            all.sort_by_key(|r| r.start);
            let covered: usize = all.iter().map(|r| r.len()).sum();
            assert_eq!(covered, 10 + 1 + 24 + 1 + 59, "{ranks} ranks: {all:?}");
            for w in all.windows(2) {
                assert!(w[0].end <= w[1].start, "{all:?}");
            }
        }
        // Two ranks: the big last tensor alone on rank 1.
        assert_eq!(replica_share(&tensors, 1, 2), vec![41..100]);
    }
}
