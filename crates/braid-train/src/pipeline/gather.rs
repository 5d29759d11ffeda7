//! The whole model put together from a pipeline's stages (for `--save`):
//! every pipeline rank sends its stages' parameters to rank 0, which
//! copies each block to its place in the whole layout.

use crate::Result;
use braid_comm::Communicator;
use braid_model::{Layout, Params};
use std::sync::Arc;

/// On pipeline rank 0 of `group`, the whole model's parameters laid out
/// as `whole`, from every rank's `mine` (laid out for its stages, which
/// `layouts` gives by rank); `None` on the other ranks. Every rank of the
/// group calls it.
pub fn gather_whole(
    mine: &Params,
    whole: Arc<Layout>,
    layouts: &[Arc<Layout>],
    group: &Communicator,
) -> Result<Option<Params>> {
    const TAG: u64 = 7;
    let rank = group.rank();
    if rank != 0 {
        group
            .send(&mine.data, 0, TAG)
            .map_err(|e| format!("sending pipeline rank {rank}'s stages for --save: {e}"))?;
        return Ok(None);
    }
    let mut data = vec![0.0f32; whole.len];
    for (r, layout) in layouts.iter().enumerate() {
        let theirs = match r {
            0 => mine.data.clone(),
            _ => {
                let mut buf = vec![0.0f32; layout.len];
                group
                    .recv(&mut buf, r, TAG)
                    .map_err(|e| format!("receiving pipeline rank {r}'s stages for --save: {e}"))?;
                buf
            }
        };
        for (block, range) in &layout.blocks {
            data[whole.block_range(*block)].copy_from_slice(&theirs[range.clone()]);
        }
    }
    Ok(Some(Params {
        layout: whole,
        data,
    }))
}
