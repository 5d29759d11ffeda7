//! The flags that shard a run's model state over its ranks (`--zero`,
//! `--fsdp`, `--shard-group`), checked; the strategy itself is assembled
//! in braid-train ([`braid_train::assemble`]).

use braid_train::collective::GradComm;

/// The flags that choose how the optimizer is sharded.
pub struct ZeroFlags<'a> {
    /// `--zero`.
    pub zero: Option<u8>,
    /// `--fsdp`.
    pub fsdp: bool,
    /// `--shard-group`.
    pub shard_group: Option<usize>,
    /// `--grad-comm`, as given and parsed.
    pub grad_comm: (&'a str, GradComm),
    /// `--defer-layers`.
    pub defer_layers: Option<usize>,
    /// `--no-reshard-after-forward`.
    pub keep_params: bool,
    /// `--bucket-mb` or `--first-bucket-mb` given (not their defaults).
    pub buckets: bool,
}

/// The ZeRO stage asked for (`--zero`, `--fsdp`), checked against the
/// rest of the run.
pub fn zero_stage(a: &ZeroFlags<'_>) -> Result<Option<u8>, String> {
    let stage = match (a.zero, a.fsdp) {
        (None, false) if a.shard_group.is_some() => {
            return Err("--shard-group shards the optimizer: add --zero 1, 2 or 3".into())
        }
        (None, false) if a.keep_params => {
            return Err("--no-reshard-after-forward is ZeRO-3's: add --zero 3 (or --fsdp)".into())
        }
        (None, false) => return Ok(None),
        (Some(s), true) if s != 3 => {
            return Err(format!(
                "--zero {s} with --fsdp: --fsdp means --zero 3 (give one of them)"
            ))
        }
        (_, true) => 3,
        (Some(s), false) => s,
    };
    match stage {
        1..=3 => {}
        s => return Err(format!("--zero {s}: expected 1, 2 or 3")),
    }
    if a.keep_params && stage != 3 {
        return Err(format!(
            "--no-reshard-after-forward keeps ZeRO-3's gathered parameters; --zero {stage} \
             does not gather them (use --zero 3)"
        ));
    }
    if a.buckets && stage >= 2 {
        return Err(format!(
            "--zero {stage} reduce-scatters each parameter block (the embeddings, each layer, \
             the final norm) as soon as it is final: --bucket-mb and --first-bucket-mb size data \
             parallelism's and --zero 1's buckets (drop them)"
        ));
    }
    if a.grad_comm.1 != GradComm::Plain {
        return Err(format!(
            "--zero {stage} with --grad-comm {}: ZeRO reduce-scatters f32 gradients (drop --grad-comm)",
            a.grad_comm.0
        ));
    }
    if a.defer_layers.is_some_and(|n| n > 0) {
        return Err(format!(
            "--zero {stage} with --defer-layers: ZeRO's buckets hold whole layers (drop --defer-layers)"
        ));
    }
    Ok(Some(stage))
}

/// Under ZeRO every rank's block of a layout block starts at a multiple of
/// this many elements (256 bytes of f32).
pub const ZERO_ALIGN: usize = 64;
