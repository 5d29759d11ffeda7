//! The order in which ZeRO-3 updates its master shard when the update
//! runs beside the next forward pass ([`Zero3::with_update_beside`]).
//!
//! The forward pass meets the update at a few points, in order: the
//! refresh of the bf16 blocks' f32 tensors and the first gather, then
//! before each unit the prefetch of the next unit's blocks and the
//! unit's own saved activations written into the gradient shard's
//! memory (the update reads those gradients). Point `k` needs some
//! elements of the shard updated; part `k` of the update is what point
//! `k` needs and no earlier point did, so that the engine's stream waits
//! at point `k` for parts `..=k` only, and the rest of the update runs
//! under the units before it.
//!
//! [`Zero3::with_update_beside`]: super::Zero3::with_update_beside

use std::ops::Range;

/// The parts of an update for a forward pass whose unit `u` reads the
/// blocks `forward[u]` (block `b`: elements `slots[b]` of the shard), after
/// a refresh that reads `side`, and writes first the lent runs of
/// `lent` whose unit (the second of each pair) is `u`: point 0 the refresh
/// and unit 0's gather, point `u + 1` (before unit `u` runs, while unit
/// `u + 1`'s gather is queued) unit `u + 1`'s blocks and unit `u`'s lent
/// runs.
pub(crate) fn forward_order(
    forward: &[Vec<usize>],
    slots: &[Range<usize>],
    side: &[Range<usize>],
    lent: &[(Range<usize>, usize)],
) -> Vec<Vec<Range<usize>>> {
    let slots_of = |blocks: Option<&Vec<usize>>| -> Vec<Range<usize>> {
        blocks
            .map(|bs| bs.iter().map(|&b| slots[b].clone()).collect())
            .unwrap_or_default()
    };
    let mut needs = Vec::with_capacity(forward.len() + 1);
    let mut first = slots_of(forward.first());
    first.extend(side.iter().cloned());
    needs.push(first);
    for u in 0..forward.len() {
        let mut need = slots_of(forward.get(u + 1));
        need.extend(lent.iter().filter(|(_, w)| *w == u).map(|(r, _)| r.clone()));
        needs.push(need);
    }
    let len = slots.last().map_or(0, |s| s.end);
    parts_in_need_order(len, &needs)
}

/// Part `k` of the update: the elements of `needs[k]` (ranges of the
/// shard, `len` elements) that no earlier part holds, as increasing
/// disjoint runs; then one last part with every element no point needs.
/// Parts may be empty; together they hold each element once.
pub(crate) fn parts_in_need_order(
    len: usize,
    needs: &[Vec<Range<usize>>],
) -> Vec<Vec<Range<usize>>> {
    let mut taken: Vec<Range<usize>> = Vec::new();
    let mut parts = Vec::with_capacity(needs.len() + 1);
    for need in needs {
        let want = merged(need.iter().map(|r| r.start.min(len)..r.end.min(len)));
        let part = without(&want, &taken);
        taken = merged(taken.iter().chain(&part).cloned());
        parts.push(part);
    }
    parts.push(without(std::slice::from_ref(&(0..len)), &taken));
    parts
}

/// `ranges` sorted and merged where they touch or overlap, empty ones
/// dropped.
fn merged(ranges: impl Iterator<Item = Range<usize>>) -> Vec<Range<usize>> {
    let mut all: Vec<Range<usize>> = ranges.filter(|r| r.start < r.end).collect();
    all.sort_by_key(|r| r.start);
    let mut out: Vec<Range<usize>> = Vec::with_capacity(all.len());
    for r in all {
        match out.last_mut() {
            Some(last) if r.start <= last.end => last.end = last.end.max(r.end),
            _ => out.push(r),
        }
    }
    out
}

/// The elements of `want` (sorted, disjoint) outside `taken` (sorted,
/// disjoint), as sorted disjoint runs.
fn without(want: &[Range<usize>], taken: &[Range<usize>]) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    for w in want {
        let mut at = w.start;
        for t in taken.iter().filter(|t| t.end > w.start && t.start < w.end) {
            if t.start > at {
                out.push(at..t.start);
            }
            at = at.max(t.end);
        }
        if at < w.end {
            out.push(at..w.end);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A part of one run.
    fn one(r: Range<usize>) -> Vec<Range<usize>> {
        std::iter::once(r).collect()
    }

    #[test]
    fn each_point_gets_what_it_needs_first_and_every_element_once() {
        // Points: side pieces and block 0, then block 1 with a lent run
        // inside block 3, then block 2 (overlapping what point 1 took).
        let needs = vec![
            vec![12..14, 0..4, 30..31],
            vec![4..8, 26..29],
            vec![8..12, 6..9],
        ];
        let parts = parts_in_need_order(32, &needs);
        assert_eq!(
            parts,
            vec![
                vec![0..4, 12..14, 30..31],
                vec![4..8, 26..29],
                vec![8..12],
                vec![14..26, 29..30, 31..32],
            ]
        );
        let mut seen = vec![0; 32];
        for r in parts.iter().flatten() {
            for i in r.clone() {
                seen[i] += 1;
            }
        }
        assert!(seen.iter().all(|&c| c == 1), "every element once: {seen:?}");
    }

    #[test]
    fn a_gpt_forward_pass_gets_its_blocks_and_lent_runs_in_time() {
        // Blocks: embeddings 0..10, layer 0 10..20, layer 1 20..30, the
        // final norm 30..32; units: embeddings, layer 0, layer 1, head
        // (which reads the tied embeddings again).
        let slots = vec![0..10, 10..20, 20..30, 30..32];
        let forward = vec![vec![0], vec![1], vec![2], vec![0, 3]];
        // Side tensors inside the layers; lent runs: scratch written from
        // unit 0 in layer 1's slice, layer 1's input written by unit 1
        // in the norm's and layer 0's slices.
        let side = vec![18..20, 28..30];
        let lent = vec![(24..27, 0), (31..32, 1), (12..14, 1)];
        let parts = forward_order(&forward, &slots, &side, &lent);
        assert_eq!(
            parts,
            vec![
                vec![0..10, 18..20, 28..30],
                vec![10..18, 24..27],
                vec![20..24, 27..28, 31..32],
                vec![30..31],
                vec![],
                vec![],
            ]
        );
    }

    #[test]
    fn a_point_with_nothing_new_gets_an_empty_part() {
        let needs: Vec<Vec<Range<usize>>> = vec![one(0..10), one(2..5), Vec::new()];
        let parts = parts_in_need_order(10, &needs);
        assert_eq!(parts, vec![one(0..10), vec![], vec![], vec![]]);
        // Needs past the shard's end are cut there.
        let parts = parts_in_need_order(4, &[one(3..9)]);
        assert_eq!(parts, vec![one(3..4), one(0..3)]);
    }
}
