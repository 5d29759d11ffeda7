//! Bucket planning: which gradient elements are reduced together, and
//! after which backward unit each bucket starts.
//!
//! Units finish ranges at either end of what is still being written
//! ([`Unit`]). Buckets follow PyTorch DDP's rule in that order: finished
//! ranges join the open bucket while they are adjacent to it (same end of
//! the window) and the bucket is below its cap; the first bucket's cap is
//! small (1 MiB by default) so that communication starts early, the others
//! 25 MiB. A bucket starts as soon as the unit that completes it has run;
//! every rank plans the same buckets and starts them in the same order.

use crate::collective::{Bucket, End};
use crate::engine::{Matrix, Unit};
use crate::Result;
use std::ops::Range;

/// The buckets of a backward pass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BucketPlan {
    /// In launch order.
    pub buckets: Vec<Bucket>,
    /// For each unit, the buckets to start after it (in order).
    pub after_unit: Vec<Vec<usize>>,
}

/// Plans buckets for `units` over a gradient buffer of `len` f32s, with
/// caps in bytes; `matrices` are assigned to the bucket holding them.
pub fn plan(
    units: &[Unit],
    len: usize,
    first_cap: usize,
    cap: usize,
    matrices: &[Matrix],
) -> Result<BucketPlan> {
    let mut window = 0..len;
    let mut buckets: Vec<Bucket> = Vec::new();
    let mut after_unit = vec![Vec::new(); units.len()];
    // The open bucket and the last unit that joined it.
    let mut open: Option<(Range<usize>, End, usize)> = None;
    let close =
        |b: (Range<usize>, End, usize), buckets: &mut Vec<Bucket>, after: &mut Vec<Vec<usize>>| {
            after[b.2].push(buckets.len());
            buckets.push(Bucket {
                range: b.0,
                end: b.1,
                matrices: Vec::new(),
            });
        };
    for (u, unit) in units.iter().enumerate() {
        let r = unit.finalizes.clone();
        if r.is_empty() {
            continue;
        }
        let end = if r.end == window.end && r.start >= window.start {
            End::Back
        } else if r.start == window.start && r.end <= window.end {
            End::Front
        } else {
            return Err(format!(
                "backward unit {u} ({}) finishes gradients {r:?}, which are not at either end \
                 of the {window:?} still being written: units must finish the buffer from its ends",
                unit.name
            ));
        };
        match end {
            End::Back => window.end = r.start,
            End::Front => window.start = r.end,
        }
        let joins = matches!(&open, Some((b, e, _)) if *e == end
            && match end { End::Back => r.end == b.start, End::Front => r.start == b.end });
        if joins {
            let (b, e, _) = open.take().expect("checked");
            let b = match e {
                End::Back => r.start..b.end,
                End::Front => b.start..r.end,
            };
            open = Some((b, e, u));
        } else {
            if let Some(b) = open.take() {
                close(b, &mut buckets, &mut after_unit);
            }
            open = Some((r, end, u));
        }
        let limit = if buckets.is_empty() { first_cap } else { cap };
        if open.as_ref().is_some_and(|(b, _, _)| 4 * b.len() >= limit) {
            close(open.take().expect("checked"), &mut buckets, &mut after_unit);
        }
    }
    if let Some(b) = open.take() {
        close(b, &mut buckets, &mut after_unit);
    }
    if !window.is_empty() {
        return Err(format!(
            "the backward units never finish gradients {window:?} (every element must belong to a unit)"
        ));
    }
    for m in matrices {
        let r = m.range();
        let b = buckets
            .iter_mut()
            .find(|b| b.range.start <= r.start && r.end <= b.range.end)
            .ok_or_else(|| format!("matrix at {r:?} is split between buckets"))?;
        b.matrices.push(*m);
    }
    Ok(BucketPlan {
        buckets,
        after_unit,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unit(r: Range<usize>) -> Unit {
        Unit {
            name: format!("{r:?}"),
            finalizes: r,
        }
    }

    #[test]
    fn gpt_order_makes_small_first_bucket_then_capped_ones() {
        // Embedding 0..100, layers 100..160, 160..220, final norm 220..230,
        // finished as the GPT engines do: norm, layers from the last,
        // embedding.
        let units = [unit(220..230), unit(160..220), unit(100..160), unit(0..100)];
        // Caps of 16 and 400 bytes: 4 and 100 elements.
        let p = plan(&units, 230, 16, 400, &[]).unwrap();
        let ranges: Vec<_> = p.buckets.iter().map(|b| b.range.clone()).collect();
        assert_eq!(ranges, vec![220..230, 100..220, 0..100]);
        assert_eq!(p.after_unit, vec![vec![0], vec![], vec![1], vec![2]]);
        assert!(p.buckets.iter().all(|b| b.end == End::Back));
    }

    #[test]
    fn ranges_finished_at_the_front_leave_from_the_front() {
        // The embedding (0..100) before the first layer (100..160).
        let units = [unit(160..230), unit(100..100), unit(0..100), unit(100..160)];
        let p = plan(&units, 230, 1 << 20, 1 << 20, &[]).unwrap();
        let got: Vec<_> = p.buckets.iter().map(|b| (b.range.clone(), b.end)).collect();
        assert_eq!(
            got,
            vec![
                (160..230, End::Back),
                (0..100, End::Front),
                (100..160, End::Back)
            ]
        );
        assert_eq!(p.after_unit, vec![vec![0], vec![], vec![1], vec![2]]);
    }

    #[test]
    fn bad_units_are_explained() {
        let e = plan(&[unit(10..20)], 30, 4, 4, &[]).unwrap_err();
        assert!(e.contains("not at either end"), "{e}");
        let e = plan(&[unit(20..30)], 30, 4, 4, &[]).unwrap_err();
        assert!(e.contains("never finish gradients 0..20"), "{e}");
        let m = Matrix {
            offset: 5,
            rows: 2,
            cols: 5,
        };
        let e = plan(&[unit(10..30), unit(0..10)], 30, 4, 4, &[m]).unwrap_err();
        assert!(e.contains("split between buckets"), "{e}");
    }
}
