//! Sets of time intervals (sorted, disjoint): union, intersection, gaps
//! and their lengths — what the temporal breakdown is computed with.

/// A set of disjoint intervals `[start, end)`, sorted.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Intervals(Vec<(f64, f64)>);

impl Intervals {
    /// The union of `spans` (`(start, end)` pairs, any order, empty and
    /// reversed ones ignored).
    pub fn union(spans: impl IntoIterator<Item = (f64, f64)>) -> Intervals {
        let mut v: Vec<(f64, f64)> = spans.into_iter().filter(|(a, b)| b > a).collect();
        v.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
        let mut out: Vec<(f64, f64)> = Vec::with_capacity(v.len());
        for (a, b) in v {
            match out.last_mut() {
                Some(last) if a <= last.1 => last.1 = last.1.max(b),
                _ => out.push((a, b)),
            }
        }
        Intervals(out)
    }

    /// The intervals.
    pub fn spans(&self) -> &[(f64, f64)] {
        &self.0
    }

    /// Total length.
    pub fn len(&self) -> f64 {
        self.0.iter().map(|(a, b)| b - a).sum()
    }

    /// Whether there is nothing.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The part inside `[start, end)`.
    pub fn clip(&self, start: f64, end: f64) -> Intervals {
        Intervals(
            self.0
                .iter()
                .map(|&(a, b)| (a.max(start), b.min(end)))
                .filter(|(a, b)| b > a)
                .collect(),
        )
    }

    /// Both sets together.
    pub fn or(&self, other: &Intervals) -> Intervals {
        Intervals::union(self.0.iter().chain(other.0.iter()).copied())
    }

    /// The part also in `other`.
    pub fn and(&self, other: &Intervals) -> Intervals {
        let (mut i, mut j, mut out) = (0, 0, Vec::new());
        while i < self.0.len() && j < other.0.len() {
            let (a, b) = self.0[i];
            let (c, d) = other.0[j];
            let (lo, hi) = (a.max(c), b.min(d));
            if hi > lo {
                out.push((lo, hi));
            }
            if b < d {
                i += 1;
            } else {
                j += 1;
            }
        }
        Intervals(out)
    }

    /// Length of the part also in `other`.
    pub fn overlap_len(&self, other: &Intervals) -> f64 {
        let (mut i, mut j, mut sum) = (0, 0, 0.0);
        while i < self.0.len() && j < other.0.len() {
            let (a, b) = self.0[i];
            let (c, d) = other.0[j];
            let lo = a.max(c);
            let hi = b.min(d);
            if hi > lo {
                sum += hi - lo;
            }
            if b < d {
                i += 1;
            } else {
                j += 1;
            }
        }
        sum
    }

    /// The gaps of this set inside `[start, end)`.
    pub fn gaps(&self, start: f64, end: f64) -> Intervals {
        let mut out = Vec::new();
        let mut at = start;
        for &(a, b) in self.clip(start, end).spans() {
            if a > at {
                out.push((at, a));
            }
            at = at.max(b);
        }
        if end > at {
            out.push((at, end));
        }
        Intervals(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn union_overlap_and_gaps() {
        let a = Intervals::union([(5.0, 7.0), (0.0, 2.0), (1.0, 3.0), (4.0, 4.0)]);
        assert_eq!(a.spans(), &[(0.0, 3.0), (5.0, 7.0)]);
        assert_eq!(a.len(), 5.0);
        let b = Intervals::union([(2.0, 6.0)]);
        assert_eq!(a.overlap_len(&b), 2.0);
        assert_eq!(a.and(&b).spans(), &[(2.0, 3.0), (5.0, 6.0)]);
        assert_eq!(a.and(&b).len(), a.overlap_len(&b));
        assert_eq!(a.or(&b).spans(), &[(0.0, 7.0)]);
        assert_eq!(
            a.gaps(-1.0, 8.0).spans(),
            &[(-1.0, 0.0), (3.0, 5.0), (7.0, 8.0)]
        );
        assert_eq!(a.clip(1.0, 6.0).len(), 3.0);
        assert!(Intervals::union([]).is_empty());
    }
}
