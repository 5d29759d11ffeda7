//! [`Place`]: where the elements a rank holds of a tensor sit in the whole
//! tensor — all of it, or slices of one dimension (a tensor-parallel
//! rank's columns of `c_attn`, rows of `c_proj`, its part of the
//! vocabulary). Checkpoints store pieces by their place in the whole
//! tensor, so that a run with another tensor-parallel degree (or none)
//! finds the elements it needs wherever they were written.
//!
//! A tensor is seen as `[outer, d, inner]` around its cut dimension `d`;
//! a slice `(start, len)` of `d` is stored at the next free index of the
//! local tensor's `d`, slices one after another in the order listed.

use std::ops::Range;

/// Where a local tensor's elements sit in the whole tensor.
#[derive(Debug, Clone, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Place {
    /// The whole tensor's shape.
    pub full: Vec<usize>,
    /// The dimension cut (the others are whole here).
    pub dim: usize,
    /// The slices of `dim` held here, in local order: (first index in the
    /// whole tensor, length).
    pub slices: Vec<(usize, usize)>,
}

/// A run of whole-tensor elements that a run of local elements maps to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FullRun {
    /// First element in the whole tensor (row-major flat index).
    pub full: usize,
    /// First element in the local run (offset from its start).
    pub local: usize,
    /// Elements.
    pub len: usize,
}

impl Place {
    /// The whole tensor of `shape`, held whole.
    pub fn whole(shape: &[usize]) -> Place {
        Place {
            full: shape.to_vec(),
            dim: 0,
            slices: vec![(0, shape.first().copied().unwrap_or(1))],
        }
    }

    /// Whether this is the whole tensor.
    pub fn is_whole(&self) -> bool {
        let d = self.full.get(self.dim).copied().unwrap_or(1);
        self.slices.len() == 1 && self.slices[0] == (0, d)
    }

    /// The local tensor's shape.
    pub fn local_shape(&self) -> Vec<usize> {
        let mut s = self.full.clone();
        if let Some(d) = s.get_mut(self.dim) {
            *d = self.slices.iter().map(|&(_, l)| l).sum();
        }
        s
    }

    /// Elements of the whole tensor.
    pub fn full_numel(&self) -> usize {
        self.full.iter().product()
    }

    /// Elements held here.
    pub fn local_numel(&self) -> usize {
        self.local_shape().iter().product()
    }

    /// Fills `local` (the elements held here, in local order) from
    /// `whole` (the whole tensor, row-major).
    pub fn take_from<T: Copy>(&self, whole: &[T], local: &mut [T]) {
        for r in self.full_runs(0..local.len()) {
            local[r.local..r.local + r.len].copy_from_slice(&whole[r.full..r.full + r.len]);
        }
    }

    /// Writes `local` (the elements held here) at their places in
    /// `whole`.
    pub fn put_into<T: Copy>(&self, local: &[T], whole: &mut [T]) {
        for r in self.full_runs(0..local.len()) {
            whole[r.full..r.full + r.len].copy_from_slice(&local[r.local..r.local + r.len]);
        }
    }

    /// Checks that the slices lie inside the cut dimension and do not
    /// overlap, or says what is wrong.
    pub fn check(&self) -> Result<(), String> {
        let Some(&d) = self.full.get(self.dim) else {
            return Err(format!(
                "place cuts dimension {} of a {}-dimensional tensor",
                self.dim,
                self.full.len()
            ));
        };
        let mut sorted = self.slices.clone();
        sorted.sort_unstable();
        let mut end = 0;
        for &(s, l) in &sorted {
            if l == 0 || s < end || s + l > d {
                return Err(format!(
                    "slices {:?} of a dimension of {d}: empty, overlapping or outside",
                    self.slices
                ));
            }
            end = s + l;
        }
        Ok(())
    }

    /// `(outer, d, inner)` of the whole tensor and the local `d`.
    fn dims(&self) -> (usize, usize, usize, usize) {
        let outer: usize = self.full[..self.dim].iter().product();
        let inner: usize = self.full[self.dim + 1..].iter().product();
        let d = self.full[self.dim];
        let dl: usize = self.slices.iter().map(|&(_, l)| l).sum();
        (outer, d, inner, dl)
    }

    /// The whole-tensor runs the local elements `run` map to, in local
    /// order (adjacent runs that continue each other in the whole tensor
    /// are merged).
    pub fn full_runs(&self, run: Range<usize>) -> Vec<FullRun> {
        let mut out: Vec<FullRun> = Vec::new();
        if run.is_empty() {
            return out;
        }
        let (_, d, inner, dl) = self.dims();
        let row = dl * inner; // local elements per outer index
        let mut push = |full: usize, local: usize, len: usize| match out.last_mut() {
            Some(last) if last.full + last.len == full && last.local + last.len == local => {
                last.len += len
            }
            _ => out.push(FullRun { full, local, len }),
        };
        let mut e = run.start;
        while e < run.end {
            let (o, within) = (e / row, e % row);
            let mut local_d = 0;
            for &(start, len) in &self.slices {
                let seg = local_d * inner..(local_d + len) * inner;
                local_d += len;
                if within >= seg.end {
                    continue;
                }
                // The part of this slice from `within` to the run's end.
                let from = within.max(seg.start);
                let to = seg.end.min(within + (run.end - e));
                if from >= to {
                    break;
                }
                let full = o * d * inner + start * inner + (from - seg.start);
                push(full, e + (from - within) - run.start, to - from);
            }
            e = (o + 1) * row;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The whole-tensor index of every local element, one by one.
    fn naive(p: &Place) -> Vec<usize> {
        let (outer, d, inner, _) = p.dims();
        let mut out = Vec::new();
        for o in 0..outer {
            for &(s, l) in &p.slices {
                for k in s..s + l {
                    for i in 0..inner {
                        out.push((o * d + k) * inner + i);
                    }
                }
            }
        }
        out
    }

    #[test]
    fn full_runs_match_element_by_element_mapping() {
        let places = [
            Place {
                full: vec![4, 12],
                dim: 1,
                slices: vec![(2, 2), (6, 2), (10, 2)],
            },
            Place {
                full: vec![6, 5],
                dim: 0,
                slices: vec![(3, 3)],
            },
            Place {
                full: vec![9],
                dim: 0,
                slices: vec![(4, 5)],
            },
            Place::whole(&[3, 4]),
        ];
        for p in &places {
            p.check().unwrap();
            let want = naive(p);
            assert_eq!(want.len(), p.local_numel());
            for a in 0..want.len() {
                for b in a..=want.len() {
                    let mut got = vec![usize::MAX; b - a];
                    for r in p.full_runs(a..b) {
                        for k in 0..r.len {
                            got[r.local + k] = r.full + k;
                        }
                    }
                    assert_eq!(got, want[a..b], "{p:?} run {a}..{b}");
                }
            }
        }
        // A row-sliced tensor's runs merge across rows; a whole one is one run.
        assert_eq!(places[1].full_runs(0..15).len(), 1);
        assert_eq!(places[3].full_runs(0..12).len(), 1);
        assert!(places[3].is_whole() && !places[1].is_whole());
    }

    #[test]
    fn bad_slices_are_refused() {
        let p = |slices: Vec<(usize, usize)>| Place {
            full: vec![4, 8],
            dim: 1,
            slices,
        };
        assert!(p(vec![(0, 4), (2, 2)]).check().is_err());
        assert!(p(vec![(6, 4)]).check().is_err());
        assert!(p(vec![(1, 0)]).check().is_err());
        assert!(p(vec![(4, 4), (0, 4)]).check().is_ok());
    }
}
