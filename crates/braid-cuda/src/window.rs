//! [`DeviceWindow`]: a writable part of a flat device buffer that keeps the
//! buffer's own indices.
//!
//! A training engine addresses its gradients by their offsets in the flat
//! gradient buffer. While a data-parallel backward pass runs, the buffer's
//! finished parts are handed one by one to communication; what is left for
//! the engine is a window `[start, end)` of the buffer. Asking a window for
//! elements outside it is an error naming both ranges, so an engine that
//! writes gradients it already declared final is caught instead of racing
//! with the reduction.
//!
//! A window can also be made of several separate buffers, each standing
//! for its own range of the flat indices ([`DeviceWindow::of_pieces`]):
//! under ZeRO stage 3 no whole gradient buffer exists, and a unit writes
//! into the block-sized gradient buffers of the blocks it touches, still
//! addressed by the flat buffer's indices.

use crate::error::{CudaError, Result};
use crate::memory::{DeviceBuffer, DeviceView, DeviceViewMut};
use braid_core::Element;
use std::ops::Range;

/// Elements of a flat device buffer, writable, indexed by the buffer's own
/// indices: one contiguous range `[start, start + len)`, or several
/// ranges each held by its own memory.
pub struct DeviceWindow<'a, T: Element> {
    /// (first index, memory), increasing and not overlapping; one piece
    /// unless made by [`of_pieces`](Self::of_pieces).
    pieces: Vec<(usize, DeviceViewMut<'a, T>)>,
}

impl<T: Element> DeviceBuffer<T> {
    /// The whole buffer as a window.
    pub fn window(&mut self) -> DeviceWindow<'_, T> {
        let len = self.len();
        DeviceWindow::new(0, self.view_mut(0..len))
    }
}

impl<'a, T: Element> DeviceWindow<'a, T> {
    /// A window over `view`, whose first element has index `start`.
    pub fn new(start: usize, view: DeviceViewMut<'a, T>) -> Self {
        DeviceWindow {
            pieces: vec![(start, view)],
        }
    }

    /// A window of separate pieces: each `(start, view)` holds the indices
    /// `start..start + view.len()`. Pieces must not overlap (in indices);
    /// they may come in any order.
    pub fn of_pieces(mut pieces: Vec<(usize, DeviceViewMut<'a, T>)>) -> Result<Self> {
        pieces.sort_by_key(|(s, _)| *s);
        for w in pieces.windows(2) {
            let end = w[0].0 + w[0].1.len();
            if end > w[1].0 {
                return Err(CudaError::Invalid(format!(
                    "window pieces {:?} and {:?} overlap",
                    w[0].0..end,
                    w[1].0..w[1].0 + w[1].1.len()
                )));
            }
        }
        Ok(DeviceWindow { pieces })
    }

    /// The indices this window covers (from its first piece's start to
    /// its last piece's end).
    pub fn range(&self) -> Range<usize> {
        match (self.pieces.first(), self.pieces.last()) {
            (Some((s, _)), Some((ls, lv))) => *s..ls + lv.len(),
            _ => 0..0,
        }
    }

    fn piece_range(&self, i: usize) -> Range<usize> {
        let (s, v) = &self.pieces[i];
        *s..s + v.len()
    }

    /// The piece holding all of `r` and `r` in its own indices.
    fn local(&self, r: &Range<usize>) -> Result<(usize, Range<usize>)> {
        let found = (0..self.pieces.len()).find(|&i| {
            let p = self.piece_range(i);
            r.start <= r.end && r.start >= p.start && r.end <= p.end
        });
        match found {
            Some(i) => {
                let s = self.pieces[i].0;
                Ok((i, r.start - s..r.end - s))
            }
            None => {
                let have: Vec<Range<usize>> = (0..self.pieces.len())
                    .map(|i| self.piece_range(i))
                    .collect();
                let what = match have.len() {
                    1 => format!("the window {:?}", have[0]),
                    _ => format!("the window's pieces {have:?}"),
                };
                Err(CudaError::Invalid(format!(
                    "elements {r:?} are outside {what} still being written (a range outside \
                     it was already handed on, or is not held here)"
                )))
            }
        }
    }

    /// Elements `r` (buffer indices), read-only.
    pub fn view(&self, r: Range<usize>) -> Result<DeviceView<'_, T>> {
        let (i, l) = self.local(&r)?;
        Ok(self.pieces[i].1.sub(l))
    }

    /// Elements `r` (buffer indices), writable.
    pub fn view_mut(&mut self, r: Range<usize>) -> Result<DeviceViewMut<'_, T>> {
        let (i, l) = self.local(&r)?;
        Ok(self.pieces[i].1.sub_mut(l))
    }

    /// `K` pairwise disjoint writable ranges (buffer indices); empty ranges
    /// are allowed anywhere.
    pub fn views_mut_n<const K: usize>(
        &mut self,
        ranges: [Range<usize>; K],
    ) -> Result<[DeviceViewMut<'_, T>; K]> {
        let mut local = Vec::with_capacity(K);
        for r in &ranges {
            local.push(if r.is_empty() {
                None
            } else {
                Some(self.local(r)?)
            });
        }
        // Ranges in different pieces are disjoint memory; those in one
        // piece are disjoint memory when disjoint in indices.
        for (i, a) in ranges.iter().enumerate() {
            for b in &ranges[i + 1..] {
                if !a.is_empty() && !b.is_empty() && a.start < b.end && b.start < a.end {
                    return Err(CudaError::Invalid(format!("views {a:?} and {b:?} overlap")));
                }
            }
        }
        let pieces = &self.pieces;
        let out: Vec<DeviceViewMut<'_, T>> = local
            .into_iter()
            .map(|l| match l {
                None => DeviceViewMut::empty(),
                Some((i, r)) => pieces[i].1.alias_sub(r),
            })
            .collect();
        out.try_into()
            .map_err(|_| CudaError::Invalid("K ranges".into()))
    }

    /// Splits off the elements from index `at` to the end of the window
    /// (buffer index; `start <= at <= end`). One-piece windows only.
    pub fn split_off_back(&mut self, at: usize) -> Result<DeviceViewMut<'a, T>> {
        let (front, back) = self.split(at)?;
        self.pieces[0].1 = front;
        Ok(back)
    }

    /// Splits off the elements before index `at` (buffer index;
    /// `start <= at <= end`); the window then starts at `at`. One-piece
    /// windows only.
    pub fn split_off_front(&mut self, at: usize) -> Result<DeviceViewMut<'a, T>> {
        let (front, back) = self.split(at)?;
        self.pieces[0] = (at, back);
        Ok(front)
    }

    /// The window's view cut at buffer index `at` (the window is left
    /// empty until the caller puts a part back).
    fn split(&mut self, at: usize) -> Result<(DeviceViewMut<'a, T>, DeviceViewMut<'a, T>)> {
        if self.pieces.len() != 1 {
            return Err(CudaError::Invalid(format!(
                "a window of {} separate pieces cannot be split",
                self.pieces.len()
            )));
        }
        let r = self.range();
        if at < r.start || at > r.end {
            return Err(CudaError::Invalid(format!(
                "cannot split the window {r:?} at {at}"
            )));
        }
        let view = std::mem::replace(&mut self.pieces[0].1, DeviceViewMut::empty());
        Ok(view.split_at(at - r.start))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::DeviceMem;

    #[test]
    fn windows_keep_buffer_indices_and_refuse_what_they_gave_away() {
        // Views are address arithmetic: no GPU is needed to check them.
        let base = 0x1000u64;
        let view = DeviceViewMut::<f32>::from_raw_parts_for_test(base, 100);
        let mut w = DeviceWindow::new(0, view);
        let back = w.split_off_back(60).unwrap();
        assert_eq!((back.dptr(), back.dlen()), (base + 240, 40));
        assert_eq!(w.range(), 0..60);
        let front = w.split_off_front(10).unwrap();
        assert_eq!((front.dptr(), front.dlen()), (base, 10));
        assert_eq!(w.range(), 10..60);
        let v = w.view_mut(20..30).unwrap();
        assert_eq!((v.dptr(), v.dlen()), (base + 80, 10));
        let e = w.view_mut(55..61).err().unwrap().to_string();
        assert!(e.contains("55..61") && e.contains("10..60"), "{e}");
        assert!(w.view(0..5).is_err());
        let [a, b, c] = w.views_mut_n([10..20, 0..0, 40..60]).unwrap();
        assert_eq!((a.dptr(), b.dlen(), c.dptr()), (base + 40, 0, base + 160));
        assert!(w.split_off_back(61).is_err());
    }

    #[test]
    fn windows_of_pieces_address_each_piece_by_buffer_indices() {
        let (a, b) = (0x1000u64, 0x9000u64);
        let lo = DeviceViewMut::<f32>::from_raw_parts_for_test(a, 10);
        let hi = DeviceViewMut::<f32>::from_raw_parts_for_test(b, 20);
        // Indices 100..110 in `lo`, 200..220 in `hi`, given in any order.
        let mut w = DeviceWindow::of_pieces(vec![(200, hi), (100, lo)]).unwrap();
        assert_eq!(w.range(), 100..220);
        let v = w.view_mut(205..210).unwrap();
        assert_eq!((v.dptr(), v.dlen()), (b + 20, 5));
        let [x, y, z] = w.views_mut_n([102..104, 0..0, 200..220]).unwrap();
        assert_eq!((x.dptr(), y.dlen(), z.dptr()), (a + 8, 0, b));
        // Between the pieces, across them, and overlapping: refused.
        let e = w.view(150..151).err().unwrap().to_string();
        assert!(
            e.contains("150..151") && e.contains("[100..110, 200..220]"),
            "{e}"
        );
        assert!(w.view(105..205).is_err());
        assert!(w.views_mut_n([102..104, 103..105]).is_err());
        assert!(w.split_off_back(210).is_err());
        let p = DeviceViewMut::<f32>::from_raw_parts_for_test(a, 10);
        let q = DeviceViewMut::<f32>::from_raw_parts_for_test(b, 10);
        assert!(DeviceWindow::of_pieces(vec![(0, p), (5, q)]).is_err());
    }
}
