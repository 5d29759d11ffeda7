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

use crate::error::{CudaError, Result};
use crate::memory::{DeviceBuffer, DeviceView, DeviceViewMut};
use braid_core::Element;
use std::ops::Range;

/// Elements `[start, start + len)` of a flat device buffer, writable,
/// indexed by the buffer's own indices.
pub struct DeviceWindow<'a, T: Element> {
    start: usize,
    view: DeviceViewMut<'a, T>,
}

impl<T: Element> DeviceBuffer<T> {
    /// The whole buffer as a window.
    pub fn window(&mut self) -> DeviceWindow<'_, T> {
        let len = self.len();
        DeviceWindow {
            start: 0,
            view: self.view_mut(0..len),
        }
    }
}

impl<'a, T: Element> DeviceWindow<'a, T> {
    /// A window over `view`, whose first element has index `start`.
    pub fn new(start: usize, view: DeviceViewMut<'a, T>) -> Self {
        DeviceWindow { start, view }
    }

    /// The indices this window covers.
    pub fn range(&self) -> Range<usize> {
        self.start..self.start + self.view.len()
    }

    /// The whole window as a view (consumes it).
    pub fn into_view(self) -> DeviceViewMut<'a, T> {
        self.view
    }

    fn local(&self, r: &Range<usize>) -> Result<Range<usize>> {
        let mine = self.range();
        if r.start > r.end || r.start < mine.start || r.end > mine.end {
            return Err(CudaError::Invalid(format!(
                "elements {r:?} are outside the window {mine:?} still being written \
                 (a range outside it was already handed on)"
            )));
        }
        Ok(r.start - self.start..r.end - self.start)
    }

    /// Elements `r` (buffer indices), read-only.
    pub fn view(&self, r: Range<usize>) -> Result<DeviceView<'_, T>> {
        let l = self.local(&r)?;
        Ok(self.view.sub(l))
    }

    /// Elements `r` (buffer indices), writable.
    pub fn view_mut(&mut self, r: Range<usize>) -> Result<DeviceViewMut<'_, T>> {
        let l = self.local(&r)?;
        Ok(self.view.sub_mut(l))
    }

    /// `K` pairwise disjoint writable ranges (buffer indices); empty ranges
    /// are allowed anywhere.
    pub fn views_mut_n<const K: usize>(
        &mut self,
        ranges: [Range<usize>; K],
    ) -> Result<[DeviceViewMut<'_, T>; K]> {
        let mut local = Vec::with_capacity(K);
        for r in &ranges {
            local.push(if r.is_empty() { 0..0 } else { self.local(r)? });
        }
        let local: [Range<usize>; K] = local.try_into().expect("K ranges");
        self.view.subs_mut(local)
    }

    /// Splits off the elements from index `at` to the end of the window
    /// (buffer index; `start <= at <= end`).
    pub fn split_off_back(&mut self, at: usize) -> Result<DeviceViewMut<'a, T>> {
        let (front, back) = self.split(at)?;
        self.view = front;
        Ok(back)
    }

    /// Splits off the elements before index `at` (buffer index;
    /// `start <= at <= end`); the window then starts at `at`.
    pub fn split_off_front(&mut self, at: usize) -> Result<DeviceViewMut<'a, T>> {
        let (front, back) = self.split(at)?;
        self.view = back;
        self.start = at;
        Ok(front)
    }

    /// The window's view cut at buffer index `at` (the window is left
    /// empty until the caller puts a part back).
    fn split(&mut self, at: usize) -> Result<(DeviceViewMut<'a, T>, DeviceViewMut<'a, T>)> {
        let r = self.range();
        if at < r.start || at > r.end {
            return Err(CudaError::Invalid(format!(
                "cannot split the window {r:?} at {at}"
            )));
        }
        let view = std::mem::replace(&mut self.view, DeviceViewMut::empty());
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
}
