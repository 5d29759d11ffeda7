//! Where an engine keeps its flat buffers — host memory ([`Host`]) or one
//! GPU ([`Gpu`]) — and the window of the gradient buffer a backward pass may
//! still write.
//!
//! Strategies are written once against [`Space`]: a flat `f32` buffer type
//! and a [`Window`] into it that hands finished parts on (to a reduction)
//! from either end. A window keeps the buffer's own indices, so an engine
//! addresses its gradients the same way whatever was handed on, and asking
//! for a part that was handed on is an error instead of a race.

use crate::Result;
use braid_cuda::{DeviceBuffer, DeviceViewMut, DeviceWindow};
use std::ops::Range;

/// A memory space: the flat buffer type and its windows.
pub trait Space: 'static {
    /// A flat `f32` buffer (parameters, gradients).
    type Flat: Send;
    /// A writable part of a flat buffer, indexed by the buffer's indices.
    type Window<'a>: Window<'a>;
    /// Number of elements of `flat`.
    fn len(flat: &Self::Flat) -> usize;
    /// Elements `flat` has room for without a new allocation.
    fn capacity(flat: &Self::Flat) -> usize;
    /// Makes `flat` `len` elements long within its capacity, keeping the
    /// elements both lengths have (the others: unspecified).
    fn set_len(flat: &mut Self::Flat, len: usize) -> Result<()>;
    /// Sets every element of `flat` to 0 (a GPU's memset queued on its
    /// main stream, after what is queued there).
    fn zero(flat: &mut Self::Flat) -> Result<()>;
    /// The whole of `flat` as a window.
    fn window(flat: &mut Self::Flat) -> Self::Window<'_>;
    /// Short name for messages (`host`, `cuda`).
    fn name() -> &'static str;
    /// Copies the elements `ranges` of `flat` into `out`, one range after
    /// another (checkpoints; a GPU's copy waits for its main stream only:
    /// synchronise the engine first).
    fn read_ranges_into(flat: &Self::Flat, ranges: &[Range<usize>], out: &mut [f32]) -> Result<()>;
    /// Overwrites the elements `ranges` of `flat` with `values` (the
    /// ranges one after another).
    fn write_ranges(flat: &mut Self::Flat, ranges: &[Range<usize>], values: &[f32]) -> Result<()>;
    /// Copies runs of elements from `from` into `to`: each `(a, b, len)`
    /// the elements `a..a + len` of `from` into `b..b + len` of `to` (a
    /// GPU's copies are queued on its main stream, after what is queued
    /// there).
    fn copy_runs(
        from: &Self::Flat,
        to: &mut Self::Flat,
        runs: &[(usize, usize, usize)],
    ) -> Result<()>;
}

/// Checks that `runs` lie inside buffers of `from` and `to` elements.
fn check_runs(from: usize, to: usize, runs: &[(usize, usize, usize)]) -> Result<()> {
    match runs
        .iter()
        .find(|(a, b, n)| a.checked_add(*n).is_none_or(|e| e > from) || b + n > to)
    {
        Some((a, b, n)) => Err(format!(
            "a copy of {n} elements from {a} of {from} to {b} of {to}: outside the buffers"
        )),
        None => Ok(()),
    }
}

/// Checks that `ranges` lie inside `len` elements and hold `values`
/// together.
fn check_ranges(len: usize, ranges: &[Range<usize>], values: usize) -> Result<()> {
    let total: usize = ranges.iter().map(|r| r.len()).sum();
    match ranges.iter().find(|r| r.start > r.end || r.end > len) {
        Some(r) => Err(format!("elements {r:?} of a buffer of {len}")),
        None if total != values => Err(format!("{values} values for ranges of {total} elements")),
        None => Ok(()),
    }
}

/// A window of a flat buffer during a backward pass: the elements the
/// engine may still write. Finished parts are split off at either end.
pub trait Window<'a>: Send {
    /// A part split off the window (to be reduced while the engine goes on).
    type Part: Send + 'a;
    /// The buffer indices the window covers.
    fn range(&self) -> Range<usize>;
    /// Splits off `[at, end)`; the window keeps `[start, at)`.
    fn split_off_back(&mut self, at: usize) -> Result<Self::Part>;
    /// Splits off `[start, at)`; the window keeps `[at, end)`.
    fn split_off_front(&mut self, at: usize) -> Result<Self::Part>;
}

/// Host memory: `Vec<f32>` buffers, slices as parts.
pub struct Host;

/// One GPU's memory: device buffers, device views as parts.
pub struct Gpu;

impl Space for Host {
    type Flat = Vec<f32>;
    type Window<'a> = HostWindow<'a>;
    fn len(flat: &Vec<f32>) -> usize {
        flat.len()
    }
    fn capacity(flat: &Vec<f32>) -> usize {
        flat.capacity()
    }
    fn set_len(flat: &mut Vec<f32>, len: usize) -> Result<()> {
        if len > flat.capacity() {
            return Err(format!(
                "a host buffer with room for {} elements cannot be made {len} long",
                flat.capacity()
            ));
        }
        // Within the capacity: no new allocation.
        flat.resize(len, 0.0);
        Ok(())
    }
    fn zero(flat: &mut Vec<f32>) -> Result<()> {
        flat.fill(0.0);
        Ok(())
    }
    fn window(flat: &mut Vec<f32>) -> HostWindow<'_> {
        HostWindow {
            start: 0,
            slice: flat.as_mut_slice(),
        }
    }
    fn name() -> &'static str {
        "host"
    }
    fn read_ranges_into(flat: &Vec<f32>, ranges: &[Range<usize>], out: &mut [f32]) -> Result<()> {
        check_ranges(flat.len(), ranges, out.len())?;
        let mut at = 0;
        for r in ranges {
            out[at..at + r.len()].copy_from_slice(&flat[r.clone()]);
            at += r.len();
        }
        Ok(())
    }
    fn write_ranges(flat: &mut Vec<f32>, ranges: &[Range<usize>], values: &[f32]) -> Result<()> {
        check_ranges(flat.len(), ranges, values.len())?;
        let mut at = 0;
        for r in ranges {
            flat[r.clone()].copy_from_slice(&values[at..at + r.len()]);
            at += r.len();
        }
        Ok(())
    }
    fn copy_runs(from: &Vec<f32>, to: &mut Vec<f32>, runs: &[(usize, usize, usize)]) -> Result<()> {
        check_runs(from.len(), to.len(), runs)?;
        for &(a, b, n) in runs {
            to[b..b + n].copy_from_slice(&from[a..a + n]);
        }
        Ok(())
    }
}

impl Space for Gpu {
    type Flat = DeviceBuffer<f32>;
    type Window<'a> = DeviceWindow<'a, f32>;
    fn len(flat: &DeviceBuffer<f32>) -> usize {
        flat.len()
    }
    fn capacity(flat: &DeviceBuffer<f32>) -> usize {
        flat.capacity()
    }
    fn set_len(flat: &mut DeviceBuffer<f32>, len: usize) -> Result<()> {
        flat.set_len(len).map_err(|e| e.to_string())
    }
    fn zero(flat: &mut DeviceBuffer<f32>) -> Result<()> {
        let main = flat.device().main_stream();
        braid_cuda::memory::zero_async(flat, &main).map_err(|e| e.to_string())
    }
    fn window(flat: &mut DeviceBuffer<f32>) -> DeviceWindow<'_, f32> {
        flat.window()
    }
    fn name() -> &'static str {
        "cuda"
    }
    fn read_ranges_into(
        flat: &DeviceBuffer<f32>,
        ranges: &[Range<usize>],
        out: &mut [f32],
    ) -> Result<()> {
        check_ranges(flat.len(), ranges, out.len())?;
        let mut at = 0;
        for r in ranges {
            flat.copy_range_to_host(r.clone(), &mut out[at..at + r.len()])
                .map_err(|e| e.to_string())?;
            at += r.len();
        }
        Ok(())
    }
    fn write_ranges(
        flat: &mut DeviceBuffer<f32>,
        ranges: &[Range<usize>],
        values: &[f32],
    ) -> Result<()> {
        check_ranges(flat.len(), ranges, values.len())?;
        let mut at = 0;
        for r in ranges {
            flat.copy_range_from_host(r.clone(), &values[at..at + r.len()])
                .map_err(|e| e.to_string())?;
            at += r.len();
        }
        Ok(())
    }
    fn copy_runs(
        from: &DeviceBuffer<f32>,
        to: &mut DeviceBuffer<f32>,
        runs: &[(usize, usize, usize)],
    ) -> Result<()> {
        check_runs(from.len(), to.len(), runs)?;
        let main = to.device().main_stream();
        for &(a, b, n) in runs {
            braid_cuda::memory::copy_async(&mut to.view_mut(b..b + n), &from.view(a..a + n), &main)
                .map_err(|e| e.to_string())?;
        }
        Ok(())
    }
}

/// Elements `[start, start + len)` of a host buffer, indexed by the
/// buffer's indices.
pub struct HostWindow<'a, T = f32> {
    start: usize,
    slice: &'a mut [T],
}

impl<'a, T> HostWindow<'a, T> {
    /// A window over `slice`, whose first element has index `start`.
    pub fn new(start: usize, slice: &'a mut [T]) -> Self {
        HostWindow { start, slice }
    }

    /// The buffer indices the window covers.
    pub fn indices(&self) -> Range<usize> {
        self.start..self.start + self.slice.len()
    }

    fn local(&self, r: &Range<usize>) -> Result<Range<usize>> {
        let mine = self.indices();
        if r.start > r.end || r.start < mine.start || r.end > mine.end {
            return Err(format!(
                "gradient elements {r:?} are outside the window {mine:?} still being written \
                 (a range outside it was already handed to communication)"
            ));
        }
        Ok(r.start - self.start..r.end - self.start)
    }

    /// Elements `r` (buffer indices), writable.
    pub fn slice_mut(&mut self, r: Range<usize>) -> Result<&mut [T]> {
        let l = self.local(&r)?;
        Ok(&mut self.slice[l])
    }

    /// The elements `[0, end)` of the buffer: an engine that addresses its
    /// gradients by buffer index from 0 works on this (the window must
    /// start at 0, i.e. nothing was split off the front).
    pub fn prefix_mut(&mut self) -> Result<&mut [T]> {
        if self.start != 0 {
            return Err(format!(
                "the gradient window starts at {}: its front was handed on before the engine finished with it",
                self.start
            ));
        }
        Ok(self.slice)
    }
}

impl<'a, T> HostWindow<'a, T> {
    /// The window's slice cut at buffer index `at` (the window is left
    /// empty until the caller puts a part back).
    fn split(&mut self, at: usize) -> Result<(&'a mut [T], &'a mut [T])> {
        let r = self.indices();
        if at < r.start || at > r.end {
            return Err(format!("cannot split the gradient window {r:?} at {at}"));
        }
        let slice = std::mem::take(&mut self.slice);
        Ok(slice.split_at_mut(at - r.start))
    }
}

impl<'a, T: Send> Window<'a> for HostWindow<'a, T> {
    type Part = &'a mut [T];

    fn range(&self) -> Range<usize> {
        self.indices()
    }

    fn split_off_back(&mut self, at: usize) -> Result<&'a mut [T]> {
        let (front, back) = self.split(at)?;
        self.slice = front;
        Ok(back)
    }

    fn split_off_front(&mut self, at: usize) -> Result<&'a mut [T]> {
        let (front, back) = self.split(at)?;
        self.slice = back;
        self.start = at;
        Ok(front)
    }
}

impl<'a, T: braid_core::Element> Window<'a> for DeviceWindow<'a, T> {
    type Part = DeviceViewMut<'a, T>;

    fn range(&self) -> Range<usize> {
        DeviceWindow::range(self)
    }

    fn split_off_back(&mut self, at: usize) -> Result<DeviceViewMut<'a, T>> {
        DeviceWindow::split_off_back(self, at).map_err(|e| e.to_string())
    }

    fn split_off_front(&mut self, at: usize) -> Result<DeviceViewMut<'a, T>> {
        DeviceWindow::split_off_front(self, at).map_err(|e| e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_windows_hand_parts_on_from_both_ends() {
        let mut buf: Vec<f32> = (0..10).map(|x| x as f32).collect();
        let mut w = Host::window(&mut buf);
        let back = w.split_off_back(7).unwrap();
        assert_eq!(back, &[7.0, 8.0, 9.0]);
        back[0] = -7.0;
        let front = w.split_off_front(2).unwrap();
        assert_eq!(front, &[0.0, 1.0]);
        assert_eq!(w.range(), 2..7);
        w.slice_mut(3..5).unwrap()[0] = 30.0;
        let e = w.slice_mut(6..8).unwrap_err();
        assert!(e.contains("6..8") && e.contains("2..7"), "{e}");
        assert!(w.prefix_mut().unwrap_err().contains("starts at 2"));
        assert!(w.split_off_back(8).is_err());
        let _ = w;
        assert_eq!(buf[3], 30.0);
        assert_eq!(buf[7], -7.0);
    }
}
