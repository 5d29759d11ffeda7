//! [`optimizer_ranges`]: the optimizer's ranges of the parameters, cut
//! where the bf16 copy ends.

use std::ops::Range;

/// The optimizer's ranges of the parameters (`shard`, in order), each cut
/// where the bf16 copy ends (`bf16_len`: a pipeline's first stage has none
/// of its embeddings, see `Layout::bf16_len`), so that one AdamW launch
/// writes bf16 for all of its range or none; with each range, where its
/// state starts (the moments hold the ranges one after another).
pub(super) fn optimizer_ranges(
    shard: &[Range<usize>],
    bf16_len: usize,
) -> Vec<(Range<usize>, usize)> {
    let mut out = Vec::new();
    let mut at = 0;
    for r in shard {
        let cuts = match r.start < bf16_len && bf16_len < r.end {
            true => vec![r.start..bf16_len, bf16_len..r.end],
            false => vec![r.clone()],
        };
        for c in cuts {
            let len = c.len();
            out.push((c, at));
            at += len;
        }
    }
    out
}
