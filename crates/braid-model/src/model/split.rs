//! [`two_mut`]: two disjoint ranges of one slice, both writable at once.

use std::ops::Range;

/// Two disjoint ranges of one slice, mutably (the first must come first).
pub(super) fn two_mut<T>(v: &mut [T], a: Range<usize>, b: Range<usize>) -> (&mut [T], &mut [T]) {
    assert!(
        a.end <= b.start,
        "ranges {a:?} and {b:?} overlap or are out of order"
    );
    let (lo, hi) = v.split_at_mut(b.start);
    (&mut lo[a], &mut hi[..b.end - b.start])
}
