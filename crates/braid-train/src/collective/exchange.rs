//! The ranges of a parameter-sharded exchange: a rank's block of a range
//! ([`block_of`]), the exchange's parts checked against their buffers
//! ([`check_exchange`]), and ranges of a buffer as disjoint writable
//! slices ([`disjoint_mut`]).

use super::core::{GatherPart, ScatterPart};
use crate::Result;
use std::ops::Range;

/// Whether a parameter-sharded exchange's parts fit their buffers over
/// `n` ranks (`len` gives a buffer's length), or which does not.
pub(crate) fn check_exchange<F>(
    n: usize,
    master_len: usize,
    gathers: &[GatherPart<'_, F>],
    grads_len: usize,
    scatters: &[ScatterPart<'_, F>],
    len: impl Fn(&F) -> usize,
) -> Result<()> {
    for (i, g) in gathers.iter().enumerate() {
        if g.half && g.from.len() % 2 != 0 {
            return Err(format!(
                "gather {i}: a bf16 gather of {} elements per rank (it packs two to an f32 \
                 element: an even number is needed)",
                g.from.len()
            ));
        }
        if g.from.start > g.from.end
            || g.from.end > master_len
            || g.at + g.into_len(n) > len(g.into)
        {
            return Err(format!(
                "gather {i}: elements {:?} of a master shard of {master_len}, {n} ranks' worth \
                 into {} elements from {}",
                g.from,
                len(g.into),
                g.at
            ));
        }
    }
    for (i, s) in scatters.iter().enumerate() {
        if s.to.start > s.to.end || s.to.end > grads_len || len(s.grads) != n * s.to.len() {
            return Err(format!(
                "reduce-scatter {i}: {} gradients over {n} ranks into elements {:?} of a shard \
                 of {grads_len}",
                len(s.grads),
                s.to
            ));
        }
    }
    Ok(())
}

/// Rank `rank`'s block of `range` split into `n` equal blocks, or why
/// not (the range does not split evenly).
pub fn block_of(range: &Range<usize>, rank: usize, n: usize) -> Result<Range<usize>> {
    if n == 0 || range.len() % n != 0 {
        return Err(format!(
            "elements {range:?} ({}) do not split into {n} equal blocks, one per rank (shard \
             groups need a layout padded to a multiple of their size)",
            range.len()
        ));
    }
    let k = range.len() / n;
    Ok(range.start + rank * k..range.start + (rank + 1) * k)
}

/// `ranges` of `flat` as disjoint writable slices, in increasing order of
/// their starts (with those starts), or why not.
pub(crate) fn disjoint_mut<'a, T>(
    flat: &'a mut [T],
    ranges: &[Range<usize>],
) -> Result<Vec<(usize, &'a mut [T])>> {
    let mut sorted: Vec<&Range<usize>> = ranges.iter().collect();
    sorted.sort_by_key(|r| r.start);
    let len = flat.len();
    let mut rest = flat;
    let mut cut = 0;
    let mut out = Vec::with_capacity(sorted.len());
    for r in sorted {
        if r.start < cut || r.start > r.end || r.end > len {
            return Err(format!(
                "ranges {ranges:?} overlap or leave the buffer of {len} elements"
            ));
        }
        let (_, tail) = std::mem::take(&mut rest).split_at_mut(r.start - cut);
        let (slot, tail) = tail.split_at_mut(r.len());
        rest = tail;
        cut = r.end;
        out.push((r.start, slot));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_split_evenly_or_say_why() {
        assert_eq!(block_of(&(100..220), 1, 4).unwrap(), 130..160);
        let e = block_of(&(0..10), 0, 4).unwrap_err();
        assert!(
            e.contains("do not split into 4") && e.contains("padded"),
            "{e}"
        );
    }

    #[test]
    fn disjoint_slices_come_sorted_and_overlaps_are_refused() {
        let mut v: Vec<u32> = (0..10).collect();
        let got = disjoint_mut(&mut v, &[6..9, 1..3]).unwrap();
        let starts: Vec<usize> = got.iter().map(|(s, _)| *s).collect();
        assert_eq!(starts, vec![1, 6]);
        assert_eq!(got[0].1, &[1, 2]);
        assert_eq!(got[1].1, &[6, 7, 8]);
        assert!(disjoint_mut(&mut v, &[1..5, 4..6]).is_err());
        assert!(disjoint_mut(&mut v, std::slice::from_ref(&(8..11))).is_err());
    }
}
