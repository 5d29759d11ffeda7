//! `braid train`'s place in its world: this rank, its place in the mesh,
//! the data-parallel ranks and their shard groups, the node's GPUs and
//! cores, and the batch each rank takes.

use super::train::{share_cores, TrainArgs};
use super::train_check::Choices;
use braid_train::place::Place;

/// Where this process trains, and on what share of the batch.
pub struct Placement {
    /// The ranks of the world, and this one's.
    pub world_size: usize,
    pub rank: usize,
    /// This rank's place in the mesh (data x tensor x pipeline).
    pub place: Place,
    /// Data-parallel replicas: what gradients are averaged over and what
    /// the batch is dealt to (every rank of a tensor group sees one batch).
    pub ranks: usize,
    /// The ranks each ZeRO shard group holds (`--shard-group`, else all).
    pub shard_group: usize,
    /// Whether this rank leads (prints, writes the JSON and `--save`).
    pub lead: bool,
    /// Sequences per micro-batch on each rank.
    pub batch: usize,
}

/// This process's place in the run `c` describes: the mesh and the shard
/// groups checked, standard output claimed for `--json` by the lead, the
/// node's GPUs checked and its cores shared, and the batch per rank.
pub fn placed(a: &TrainArgs, c: &Choices) -> Result<Placement, String> {
    let world_size = c.world.as_ref().map_or(1, |w| w.world_size);
    let rank = c.world.as_ref().map_or(0, |w| w.rank);
    let place = Place {
        world: world_size,
        rank,
        tensor: a.tp,
        pipe: a.pp,
        sequence: c.sequence,
        shard_group: a.shard_group,
    };
    place.check(c.world.as_ref().map_or(world_size, |w| w.local_world_size))?;
    // Data-parallel replicas: what gradients are averaged over and what
    // the batch is dealt to (every rank of a tensor group sees one batch).
    let ranks = place.data();
    let shard_group = shard_group_of(a, c, ranks)?;
    let lead = rank == 0;
    if let (true, Some(j)) = (lead, &a.json) {
        j.claim_stdout()?;
    }
    node_checked(c, rank)?;
    let batch = batch_per_rank(a, ranks)?;
    Ok(Placement {
        world_size,
        rank,
        place,
        ranks,
        shard_group,
        lead,
        batch,
    })
}

/// The ranks of a ZeRO shard group over `ranks` data-parallel ranks
/// (`--shard-group`, else all of them), refused where it does not divide
/// them, or where a lone process asks for a stage.
fn shard_group_of(a: &TrainArgs, c: &Choices, ranks: usize) -> Result<usize, String> {
    // A launched world of one rank may run a stage (over itself: what the
    // sharding machinery costs on one GPU); a lone process is told.
    if let (Some(stage), 1, None) = (c.zero, ranks, &c.world) {
        return Err(format!(
            "--zero {stage} shards over the ranks, and this run has one: start several \
             (--nproc N, or braid launch; --nproc 1 runs the stage over one rank)"
        ));
    }
    let shard_group = a.shard_group.unwrap_or(ranks);
    if c.zero.is_some() && (shard_group == 0 || ranks % shard_group != 0) {
        return Err(format!(
            "--shard-group {shard_group} does not divide the {ranks} {}ranks: pick a divisor of \
             {ranks} (the ranks form groups of that many, each holding one copy of the sharded \
             state)",
            if a.tp > 1 { "data-parallel " } else { "" }
        ));
    }
    Ok(shard_group)
}

/// A launched worker's node: a GPU for each of its workers (with
/// `--device cuda`), and its cores shared between them where they compute
/// on the CPU.
fn node_checked(c: &Choices, rank: usize) -> Result<(), String> {
    let Some(w) = &c.world else {
        return Ok(());
    };
    if c.cuda {
        let gpus =
            braid_cuda::device_count().map_err(|e| format!("rank {rank}: --device cuda: {e}"))?;
        if w.local_world_size > gpus {
            return Err(format!(
                "rank {rank}: {} workers on this node but only {gpus} GPU(s): one GPU per process \
                 (start at most {gpus} workers per node)",
                w.local_world_size
            ));
        }
    }
    if !c.cuda || c.offload {
        // The CPU engine's passes, or the offloaded optimizers' updates.
        share_cores(w.local_world_size);
    }
    Ok(())
}

/// Sequences per micro-batch on each of `ranks` ranks: `--batch`, or
/// `--global-batch` dealt out (refused where it does not divide).
fn batch_per_rank(a: &TrainArgs, ranks: usize) -> Result<usize, String> {
    match a.global_batch {
        None => Ok(a.batch),
        Some(g) => {
            let per = ranks * a.accum;
            if g == 0 || g % per != 0 {
                return Err(format!(
                    "--global-batch {g} does not divide into {ranks} rank(s) x {} micro-batch(es): \
                     pick a multiple of {per}",
                    a.accum
                ));
            }
            Ok(g / per)
        }
    }
}
