//! Typed device memory ([`DeviceBuffer`]) and page-locked host memory
//! ([`PinnedBuffer`]), with copies between them and ordinary host slices.
//!
//! Copies from and to host slices are synchronous on the device's main
//! stream, so they are ordered after any collective whose work handle was
//! waited on or dropped (dropping orders the main stream after it).

use crate::driver::{check, Device, Stream};
use crate::error::{driver, CudaError, Result};
use crate::pool::{count_alloc, count_free, PoolSlot};
use braid_core::Element;
use cudarc::driver::{result, sys};
use std::marker::PhantomData;

/// `len` elements of `T` in one GPU's memory.
pub struct DeviceBuffer<T: Element> {
    ptr: sys::CUdeviceptr,
    len: usize,
    device: Device,
    /// Who frees the memory when the buffer is dropped.
    owner: Owner,
    _t: PhantomData<T>,
}

/// Where a [`DeviceBuffer`]'s memory goes when it is dropped.
enum Owner {
    /// Its own allocation of `bytes` bytes: freed.
    Driver { bytes: usize },
    /// A pool block: given back to the pool.
    Pool(PoolSlot),
    /// Bytes of another buffer ([`DeviceBuffer::lent_from`]): nothing.
    Lent,
    /// NCCL's memory registered as a symmetric window of `bytes` bytes
    /// ([`DeviceBuffer::symmetric_zeros`]): deregistered and freed.
    Symmetric {
        bytes: usize,
        /// (Boxed: every buffer carries an `Owner`.)
        mem: Option<Box<crate::nccl::SymmetricMemory>>,
    },
}

// SAFETY: the buffer is plain device memory owned by this value.
unsafe impl<T: Element> Send for DeviceBuffer<T> {}
// SAFETY: shared references only read the pointer value.
unsafe impl<T: Element> Sync for DeviceBuffer<T> {}

impl<T: Element> DeviceBuffer<T> {
    /// `len` zeroed elements on `device`.
    pub fn zeros(device: &Device, len: usize) -> Result<Self> {
        let buf = Self::uninit(device, len)?;
        let stream = device.main_stream();
        if buf.byte_len() > 0 {
            // SAFETY: the allocation holds `byte_len` bytes; zero bytes are a
            // valid value of every `Element`.
            unsafe { result::memset_d8_async(buf.ptr, 0, buf.byte_len(), stream.raw()) }
                .map_err(driver("cuMemsetD8Async"))?;
            stream.synchronize()?;
        }
        Ok(buf)
    }

    /// `len` zeroed elements of NCCL's memory registered as a symmetric
    /// window of `comm` ([`NcclComm::symmetric_alloc`](crate::nccl::NcclComm::symmetric_alloc)):
    /// with NCCL's zero-CTA policy, all-gathers into it run on the copy
    /// engines. Collective, like the registration: every rank calls it at
    /// the same point with the same `len`.
    pub fn symmetric_zeros(comm: &crate::nccl::NcclComm, len: usize) -> Result<Self> {
        let device = comm.device().clone();
        let bytes = len.checked_mul(T::DTYPE.size()).ok_or_else(|| {
            CudaError::Invalid(format!("{len} elements of {} overflow", T::DTYPE))
        })?;
        let mem = comm.symmetric_alloc(bytes.max(1))?;
        let stream = device.main_stream();
        // SAFETY: the allocation holds at least `bytes` bytes; zero bytes
        // are a valid value of every `Element`.
        let zeroed = unsafe { result::memset_d8_async(mem.dptr(), 0, bytes, stream.raw()) }
            .map_err(driver("cuMemsetD8Async"))
            .and_then(|_| stream.synchronize());
        if let Err(e) = zeroed {
            // SAFETY: nothing else has seen the memory.
            unsafe { mem.release() };
            return Err(e);
        }
        count_alloc(bytes);
        Ok(DeviceBuffer {
            ptr: mem.dptr(),
            len,
            device,
            owner: Owner::Symmetric {
                bytes,
                mem: Some(Box::new(mem)),
            },
            _t: PhantomData,
        })
    }

    /// A copy of `data` on `device`.
    pub fn from_host(device: &Device, data: &[T]) -> Result<Self> {
        let mut buf = Self::uninit(device, data.len())?;
        buf.copy_from_host(data)?;
        Ok(buf)
    }

    fn uninit(device: &Device, len: usize) -> Result<Self> {
        device.bind()?;
        let bytes = len.checked_mul(T::DTYPE.size()).ok_or_else(|| {
            CudaError::Invalid(format!("{len} elements of {} overflow", T::DTYPE))
        })?;
        let ptr = if bytes == 0 {
            0
        } else {
            // SAFETY: plain allocation in the bound context; freed in Drop.
            unsafe { result::malloc_sync(bytes) }.map_err(|e| {
                let mut err = driver("cuMemAlloc")(e);
                if let CudaError::Driver { text, .. } = &mut err {
                    text.push_str(&format!(
                        "; asked for {bytes} bytes on GPU {}",
                        device.ordinal()
                    ));
                }
                err
            })?
        };
        count_alloc(bytes);
        Ok(DeviceBuffer {
            ptr,
            len,
            device: device.clone(),
            owner: Owner::Driver { bytes },
            _t: PhantomData,
        })
    }

    /// A buffer over a pool block.
    ///
    /// # Safety
    /// `ptr` must be a device allocation of at least `len` elements on
    /// `device` that nothing else uses until `slot` gets it back.
    pub(crate) unsafe fn from_pool(
        device: &Device,
        ptr: sys::CUdeviceptr,
        len: usize,
        slot: PoolSlot,
    ) -> Self {
        count_alloc(len * T::DTYPE.size());
        DeviceBuffer {
            ptr,
            len,
            device: device.clone(),
            owner: Owner::Pool(slot),
            _t: PhantomData,
        }
    }

    /// `len` elements of `T` over the bytes of `parent` from byte
    /// `offset` (a multiple of 256), owned by `parent`: dropping the
    /// result frees nothing, and the process's allocation counters do not
    /// count it twice. Lets one allocation serve two uses at different
    /// times (a training step's saved activations in the memory its
    /// gradient shard fills only later).
    ///
    /// # Safety
    /// `parent`'s memory must outlive every use of the result (the caller
    /// drops or stops using it before `parent` is dropped), and the caller
    /// orders the two uses of the bytes (on one stream, or by events).
    pub unsafe fn lent_from<U: Element>(
        parent: &DeviceBuffer<U>,
        offset: usize,
        len: usize,
    ) -> Result<Self> {
        let bytes = len.checked_mul(T::DTYPE.size());
        let end = bytes.and_then(|b| b.checked_add(offset));
        if end.is_none_or(|e| e > parent.byte_len()) || offset % 256 != 0 {
            return Err(CudaError::Invalid(format!(
                "lent memory: {len} elements of {} at byte {offset} do not fit {} bytes (or \
                 the offset is not a multiple of 256)",
                T::DTYPE,
                parent.byte_len()
            )));
        }
        Ok(DeviceBuffer {
            ptr: if len == 0 {
                0
            } else {
                parent.ptr + offset as u64
            },
            len,
            device: parent.device.clone(),
            owner: Owner::Lent,
            _t: PhantomData,
        })
    }

    /// Whether the buffer's memory belongs to another buffer
    /// ([`lent_from`](Self::lent_from)).
    pub fn is_lent(&self) -> bool {
        matches!(self.owner, Owner::Lent)
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Size in bytes.
    pub fn byte_len(&self) -> usize {
        self.len * T::DTYPE.size()
    }

    /// Elements its own allocation has room for: its length, or more
    /// after [`set_len`](Self::set_len) shortened it (pool blocks and
    /// lent memory: its length).
    pub fn capacity(&self) -> usize {
        match self.owner {
            Owner::Driver { bytes } | Owner::Symmetric { bytes, .. } => bytes / T::DTYPE.size(),
            _ => self.len,
        }
    }

    /// Makes the buffer `len` elements long within its own allocation
    /// (`len <= capacity()`), keeping the contents of the elements both
    /// lengths have: one allocation serves blocks of different lengths
    /// in turn. Refused for pool blocks and lent memory.
    pub fn set_len(&mut self, len: usize) -> Result<()> {
        match self.owner {
            Owner::Driver { .. } | Owner::Symmetric { .. } if len <= self.capacity() => {
                self.len = len;
                Ok(())
            }
            _ => Err(CudaError::Invalid(format!(
                "a device buffer of {} elements ({} room) cannot be made {len} long",
                self.len,
                self.capacity()
            ))),
        }
    }

    /// The device address of element 0.
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// The device address of element `index` (`index <= len`).
    pub fn ptr_at(&self, index: usize) -> u64 {
        assert!(
            index <= self.len,
            "index {index} past {} elements",
            self.len
        );
        self.ptr + (index * T::DTYPE.size()) as u64
    }

    /// The GPU holding the buffer.
    pub fn device(&self) -> &Device {
        &self.device
    }

    fn check_len(&self, what: &str, n: usize) -> Result<()> {
        if n != self.len {
            return Err(CudaError::Invalid(format!(
                "{what}: host slice has {n} elements but the device buffer has {}",
                self.len
            )));
        }
        Ok(())
    }

    /// Overwrites the buffer with `data` (same length); returns when done.
    pub fn copy_from_host(&mut self, data: &[T]) -> Result<()> {
        self.check_len("copy_from_host", data.len())?;
        if data.is_empty() {
            return Ok(());
        }
        let stream = self.device.main_stream();
        self.device.bind()?;
        // SAFETY: both sides hold `len` elements; the host slice outlives the
        // copy because we synchronise before returning.
        unsafe { result::memcpy_htod_async(self.ptr, data, stream.raw()) }
            .map_err(driver("cuMemcpyHtoDAsync"))?;
        stream.synchronize()
    }

    /// Copies the buffer into `out` (same length); returns when done.
    pub fn copy_to_host(&self, out: &mut [T]) -> Result<()> {
        self.check_len("copy_to_host", out.len())?;
        if out.is_empty() {
            return Ok(());
        }
        let stream = self.device.main_stream();
        self.device.bind()?;
        // SAFETY: as in `copy_from_host`.
        unsafe { result::memcpy_dtoh_async(out, self.ptr, stream.raw()) }
            .map_err(driver("cuMemcpyDtoHAsync"))?;
        stream.synchronize()
    }

    /// Copies the elements `range` into `out` (as long); returns when
    /// done.
    pub fn copy_range_to_host(&self, range: std::ops::Range<usize>, out: &mut [T]) -> Result<()> {
        self.check_host_range("copy_range_to_host", &range, out.len())?;
        if out.is_empty() {
            return Ok(());
        }
        let stream = self.device.main_stream();
        self.device.bind()?;
        // SAFETY: `range` lies inside the buffer and `out` holds its
        // elements (checked); we synchronise before returning.
        unsafe { result::memcpy_dtoh_async(out, self.ptr_at(range.start), stream.raw()) }
            .map_err(driver("cuMemcpyDtoHAsync"))?;
        stream.synchronize()
    }

    /// Overwrites the elements `range` with `data` (as long); returns when
    /// done.
    pub fn copy_range_from_host(
        &mut self,
        range: std::ops::Range<usize>,
        data: &[T],
    ) -> Result<()> {
        self.check_host_range("copy_range_from_host", &range, data.len())?;
        if data.is_empty() {
            return Ok(());
        }
        let stream = self.device.main_stream();
        self.device.bind()?;
        // SAFETY: as in `copy_range_to_host`.
        unsafe { result::memcpy_htod_async(self.ptr_at(range.start), data, stream.raw()) }
            .map_err(driver("cuMemcpyHtoDAsync"))?;
        stream.synchronize()
    }

    fn check_host_range(&self, what: &str, range: &std::ops::Range<usize>, n: usize) -> Result<()> {
        if range.start > range.end || range.end > self.len || range.len() != n {
            return Err(CudaError::Invalid(format!(
                "{what}: elements {range:?} with a host slice of {n}, in a buffer of {}",
                self.len
            )));
        }
        Ok(())
    }

    /// The buffer's contents as a vector.
    pub fn to_vec(&self) -> Result<Vec<T>> {
        let mut v = vec![T::zeroed(); self.len];
        self.copy_to_host(&mut v)?;
        Ok(v)
    }

    /// Queues a copy of `src` (same length, any device) into this buffer on
    /// `stream`.
    pub fn copy_from_device_async(&mut self, src: &DeviceBuffer<T>, stream: &Stream) -> Result<()> {
        if src.len != self.len {
            return Err(CudaError::Invalid(format!(
                "device copy: source has {} elements, destination {}",
                src.len, self.len
            )));
        }
        copy_peer_async(
            self.ptr,
            &self.device,
            src.ptr,
            &src.device,
            self.byte_len(),
            stream,
        )
    }
}

/// Device memory a kernel or library call can address: a whole
/// [`DeviceBuffer`] or a [`DeviceView`]/[`DeviceViewMut`] of part of one
/// (a parameter inside the flat parameter buffer, say).
pub trait DeviceMem<T: Element> {
    /// Device address of the first element.
    fn dptr(&self) -> u64;
    /// Number of elements.
    fn dlen(&self) -> usize;
}

impl<T: Element> DeviceMem<T> for DeviceBuffer<T> {
    fn dptr(&self) -> u64 {
        self.ptr
    }
    fn dlen(&self) -> usize {
        self.len
    }
}

/// A read-only window of a device buffer.
pub struct DeviceView<'a, T: Element> {
    ptr: u64,
    len: usize,
    _borrow: PhantomData<&'a DeviceBuffer<T>>,
}

/// A writable window of a device buffer.
pub struct DeviceViewMut<'a, T: Element> {
    ptr: u64,
    len: usize,
    _borrow: PhantomData<&'a mut DeviceBuffer<T>>,
}

impl<T: Element> DeviceMem<T> for DeviceView<'_, T> {
    fn dptr(&self) -> u64 {
        self.ptr
    }
    fn dlen(&self) -> usize {
        self.len
    }
}

impl<T: Element> DeviceMem<T> for DeviceViewMut<'_, T> {
    fn dptr(&self) -> u64 {
        self.ptr
    }
    fn dlen(&self) -> usize {
        self.len
    }
}

impl<'a, T: Element> DeviceViewMut<'a, T> {
    /// A view of no elements.
    pub fn empty() -> Self {
        DeviceViewMut {
            ptr: 0,
            len: 0,
            _borrow: PhantomData,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the view holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn check_sub(&self, r: &std::ops::Range<usize>) {
        assert!(
            r.start <= r.end && r.end <= self.len,
            "view {r:?} of a view of {} elements",
            self.len
        );
    }

    fn at(&self, index: usize) -> u64 {
        self.ptr + (index * T::DTYPE.size()) as u64
    }

    /// Elements `r` of this view, read-only. Panics if out of bounds.
    pub fn sub(&self, r: std::ops::Range<usize>) -> DeviceView<'_, T> {
        self.check_sub(&r);
        DeviceView {
            ptr: self.at(r.start),
            len: r.len(),
            _borrow: PhantomData,
        }
    }

    /// Elements `r` of this view, writable. Panics if out of bounds.
    pub fn sub_mut(&mut self, r: std::ops::Range<usize>) -> DeviceViewMut<'_, T> {
        self.check_sub(&r);
        DeviceViewMut {
            ptr: self.at(r.start),
            len: r.len(),
            _borrow: PhantomData,
        }
    }

    /// `K` pairwise disjoint writable parts of this view (empty ranges never
    /// overlap anything). Errors if two overlap or one is out of bounds.
    pub fn subs_mut<const K: usize>(
        &mut self,
        ranges: [std::ops::Range<usize>; K],
    ) -> Result<[DeviceViewMut<'_, T>; K]> {
        for (i, a) in ranges.iter().enumerate() {
            if a.start > a.end || a.end > self.len {
                return Err(CudaError::Invalid(format!(
                    "view {a:?} of a view of {} elements",
                    self.len
                )));
            }
            for b in &ranges[i + 1..] {
                if !a.is_empty() && !b.is_empty() && a.start < b.end && b.start < a.end {
                    return Err(CudaError::Invalid(format!("views {a:?} and {b:?} overlap")));
                }
            }
        }
        Ok(ranges.map(|r| DeviceViewMut {
            ptr: self.at(r.start),
            len: r.len(),
            _borrow: PhantomData,
        }))
    }

    /// Splits the view into `[0, mid)` and `[mid, len)`. Panics if
    /// `mid > len`.
    pub fn split_at(self, mid: usize) -> (DeviceViewMut<'a, T>, DeviceViewMut<'a, T>) {
        assert!(mid <= self.len, "split at {mid} of {} elements", self.len);
        let back = DeviceViewMut {
            ptr: self.at(mid),
            len: self.len - mid,
            _borrow: PhantomData,
        };
        let front = DeviceViewMut {
            ptr: self.ptr,
            len: mid,
            _borrow: PhantomData,
        };
        (front, back)
    }

    /// Elements `r` of this view, writable, from a shared borrow: for a
    /// [`DeviceWindow`](crate::DeviceWindow) of several pieces handing out
    /// ranges it has checked to be disjoint. Panics if out of bounds.
    pub(crate) fn alias_sub(&self, r: std::ops::Range<usize>) -> DeviceViewMut<'_, T> {
        self.check_sub(&r);
        DeviceViewMut {
            ptr: self.at(r.start),
            len: r.len(),
            _borrow: PhantomData,
        }
    }

    /// A shorter-lived copy of this view.
    pub fn reborrow(&mut self) -> DeviceViewMut<'_, T> {
        DeviceViewMut {
            ptr: self.ptr,
            len: self.len,
            _borrow: PhantomData,
        }
    }

    /// A view over made-up addresses, for tests of view arithmetic (never
    /// passed to the device).
    #[cfg(test)]
    pub(crate) fn from_raw_parts_for_test(ptr: u64, len: usize) -> Self {
        DeviceViewMut {
            ptr,
            len,
            _borrow: PhantomData,
        }
    }
}

impl<T: Element> DeviceBuffer<T> {
    fn check_range(&self, r: &std::ops::Range<usize>) {
        assert!(
            r.start <= r.end && r.end <= self.len,
            "view {r:?} of {} elements",
            self.len
        );
    }

    /// Elements `range` as a read-only view. Panics if out of bounds.
    pub fn view(&self, range: std::ops::Range<usize>) -> DeviceView<'_, T> {
        self.check_range(&range);
        DeviceView {
            ptr: self.ptr_at(range.start),
            len: range.len(),
            _borrow: PhantomData,
        }
    }

    /// Elements `range` as a writable view. Panics if out of bounds.
    pub fn view_mut(&mut self, range: std::ops::Range<usize>) -> DeviceViewMut<'_, T> {
        self.check_range(&range);
        DeviceViewMut {
            ptr: self.ptr_at(range.start),
            len: range.len(),
            _borrow: PhantomData,
        }
    }

    /// The buffer's bytes as a writable view of `U` elements (as many
    /// whole ones as fit), so that memory idle for a while can hold values
    /// of another type (device memory holds plain values either way).
    pub fn bytes_as_mut<U: Element>(&mut self) -> DeviceViewMut<'_, U> {
        DeviceViewMut {
            ptr: self.device_ptr(),
            len: self.byte_len() / U::DTYPE.size(),
            _borrow: PhantomData,
        }
    }

    /// Two disjoint writable views. Panics if they overlap or are out of
    /// bounds.
    pub fn views_mut2(
        &mut self,
        a: std::ops::Range<usize>,
        b: std::ops::Range<usize>,
    ) -> (DeviceViewMut<'_, T>, DeviceViewMut<'_, T>) {
        let [a, b] = self.views_mut_n([a, b]);
        (a, b)
    }

    /// `K` pairwise disjoint writable views. Panics if two overlap or one
    /// is out of bounds.
    pub fn views_mut_n<const K: usize>(
        &mut self,
        ranges: [std::ops::Range<usize>; K],
    ) -> [DeviceViewMut<'_, T>; K] {
        for (i, a) in ranges.iter().enumerate() {
            self.check_range(a);
            for b in &ranges[i + 1..] {
                assert!(
                    a.end <= b.start || b.end <= a.start,
                    "views {a:?} and {b:?} overlap"
                );
            }
        }
        ranges.map(|r| DeviceViewMut {
            ptr: self.ptr_at(r.start),
            len: r.len(),
            _borrow: PhantomData,
        })
    }
}

/// Copies `out.len()` elements starting at device address `ptr` into
/// `out` once the work queued on `stream` has run; returns when done (for
/// diagnostics that read a view known only by its address).
///
/// # Safety
/// `ptr` must address that many live elements of `T` on `stream`'s device.
pub unsafe fn copy_raw_to_host<T: Element>(ptr: u64, out: &mut [T], stream: &Stream) -> Result<()> {
    if out.is_empty() {
        return Ok(());
    }
    stream.device().bind()?;
    // SAFETY: the caller vouches for the source; `out` is ours; we
    // synchronise before returning.
    unsafe { result::memcpy_dtoh_async(out, ptr, stream.raw()) }
        .map_err(driver("cuMemcpyDtoHAsync"))?;
    stream.synchronize()
}

/// Queues zeroing of `mem` on `stream`.
pub fn zero_async<T: Element>(mem: &mut impl DeviceMem<T>, stream: &Stream) -> Result<()> {
    let bytes = mem.dlen() * T::DTYPE.size();
    if bytes == 0 {
        return Ok(());
    }
    stream.device().bind()?;
    // SAFETY: `mem` covers `bytes` bytes of device memory; zero bytes are a
    // valid value of every element type.
    unsafe { result::memset_d8_async(mem.dptr(), 0, bytes, stream.raw()) }
        .map_err(driver("cuMemsetD8Async"))
}

/// Queues a device-to-device copy of `src` into `dst` (same length).
pub fn copy_async<T: Element>(
    dst: &mut impl DeviceMem<T>,
    src: &impl DeviceMem<T>,
    stream: &Stream,
) -> Result<()> {
    if dst.dlen() != src.dlen() {
        return Err(CudaError::Invalid(format!(
            "device copy: {} elements into {}",
            src.dlen(),
            dst.dlen()
        )));
    }
    let bytes = src.dlen() * T::DTYPE.size();
    if bytes == 0 {
        return Ok(());
    }
    stream.device().bind()?;
    // SAFETY: both cover `bytes` bytes; distinct borrows, so no overlap.
    unsafe { result::memcpy_dtod_async(dst.dptr(), src.dptr(), bytes, stream.raw()) }
        .map_err(driver("cuMemcpyDtoDAsync"))
}

/// Queues a copy of `bytes` from `src` on `src_dev` to `dst` on `dst_dev` on
/// `stream`: direct when peer access is enabled, staged by the driver
/// through host memory otherwise.
pub fn copy_peer_async(
    dst: u64,
    dst_dev: &Device,
    src: u64,
    src_dev: &Device,
    bytes: usize,
    stream: &Stream,
) -> Result<()> {
    if bytes == 0 {
        return Ok(());
    }
    stream.device().bind()?;
    // SAFETY: the caller passes device addresses with `bytes` valid bytes
    // in the given devices' contexts.
    let r = unsafe {
        sys::cuMemcpyPeerAsync(dst, dst_dev.ctx(), src, src_dev.ctx(), bytes, stream.raw())
    };
    check("cuMemcpyPeerAsync", r)
}

impl<T: Element> Drop for DeviceBuffer<T> {
    fn drop(&mut self) {
        if self.ptr == 0 || self.is_lent() {
            return;
        }
        count_free(match self.owner {
            Owner::Driver { bytes } | Owner::Symmetric { bytes, .. } => bytes,
            _ => self.byte_len(),
        });
        if let Owner::Symmetric { mem, .. } = &mut self.owner {
            let _ = self.device.bind();
            // SAFETY: work using the buffer was ordered on the main stream
            // (or waited for); finish it, then deregister and free.
            unsafe {
                let _ = result::stream::synchronize(self.device.main_stream().raw());
                if let Some(m) = mem.take() {
                    m.release();
                }
            }
            return;
        }
        if let Owner::Pool(slot) = &self.owner {
            // Stream-ordered reuse: the pool's users run on one stream.
            slot.give_back(self.ptr);
            return;
        }
        if self.device.bind().is_ok() {
            // SAFETY: work using the buffer was ordered on the main stream
            // (or waited for); finish it, then free our allocation.
            unsafe {
                let _ = result::stream::synchronize(self.device.main_stream().raw());
                let _ = result::free_sync(self.ptr);
            }
        }
    }
}

/// Page-locked host memory: what host↔device copies need to run at full
/// speed and asynchronously.
pub struct PinnedBuffer<T: Element> {
    ptr: *mut T,
    len: usize,
    device: Device,
}

// SAFETY: owned host memory.
unsafe impl<T: Element> Send for PinnedBuffer<T> {}

impl<T: Element> PinnedBuffer<T> {
    /// `len` zeroed elements of pinned host memory, usable by `device`.
    pub fn zeros(device: &Device, len: usize) -> Result<Self> {
        device.bind()?;
        let bytes = (len * T::DTYPE.size()).max(1);
        // SAFETY: plain allocation; freed in Drop.
        let p = unsafe { result::malloc_host(bytes, 0) }.map_err(driver("cuMemHostAlloc"))?;
        // SAFETY: `p` holds `bytes` writable bytes.
        unsafe { std::ptr::write_bytes(p as *mut u8, 0, bytes) };
        Ok(PinnedBuffer {
            ptr: p as *mut T,
            len,
            device: device.clone(),
        })
    }

    /// The memory as a slice.
    pub fn as_slice(&self) -> &[T] {
        // SAFETY: `len` initialised elements owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The memory as a mutable slice.
    pub fn as_mut_slice(&mut self) -> &mut [T] {
        // SAFETY: as above, uniquely borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    /// Queues a copy of this memory into `dst` on `stream`.
    pub fn copy_to_device_async(&self, dst: &mut DeviceBuffer<T>, stream: &Stream) -> Result<()> {
        dst.check_len("copy_to_device_async", self.len)?;
        stream.device().bind()?;
        // SAFETY: pinned memory stays valid while `self` lives; the caller
        // synchronises the stream before dropping it.
        unsafe { result::memcpy_htod_async(dst.ptr, self.as_slice(), stream.raw()) }
            .map_err(driver("cuMemcpyHtoDAsync"))
    }

    /// Queues a copy of `src` into this memory on `stream`.
    pub fn copy_from_device_async(&mut self, src: &DeviceBuffer<T>, stream: &Stream) -> Result<()> {
        src.check_len("copy_from_device_async", self.len)?;
        stream.device().bind()?;
        // SAFETY: as above.
        unsafe { result::memcpy_dtoh_async(self.as_mut_slice(), src.ptr, stream.raw()) }
            .map_err(driver("cuMemcpyDtoHAsync"))
    }
}

impl<T: Element> PinnedBuffer<T> {
    /// Elements `at..at + n` of this memory, or an error naming `what`.
    fn part(&self, what: &str, at: usize, n: usize) -> Result<std::ops::Range<usize>> {
        match at.checked_add(n) {
            Some(end) if end <= self.len => Ok(at..end),
            _ => Err(CudaError::Invalid(format!(
                "{what}: elements {at}..{at}+{n} of pinned memory holding {}",
                self.len
            ))),
        }
    }

    /// Queues a copy of device memory `src` into this memory's elements
    /// from `at` on `stream` (the caller waits for the stream before
    /// reading them).
    pub fn copy_in_async(
        &mut self,
        at: usize,
        src: &impl DeviceMem<T>,
        stream: &Stream,
    ) -> Result<()> {
        let r = self.part("copy_in_async", at, src.dlen())?;
        stream.device().bind()?;
        // SAFETY: the range lies inside the pinned allocation, which stays
        // valid while `self` lives; the caller synchronises the stream
        // before reading it or dropping `self`.
        unsafe { result::memcpy_dtoh_async(&mut self.as_mut_slice()[r], src.dptr(), stream.raw()) }
            .map_err(driver("cuMemcpyDtoHAsync"))
    }

    /// Queues a copy of this memory's elements from `at` into device
    /// memory `dst` (its length) on `stream` (the caller leaves them
    /// unchanged until the stream is past it).
    pub fn copy_out_async(
        &self,
        at: usize,
        dst: &mut impl DeviceMem<T>,
        stream: &Stream,
    ) -> Result<()> {
        let r = self.part("copy_out_async", at, dst.dlen())?;
        stream.device().bind()?;
        // SAFETY: as above; `dst` is writable device memory of its length.
        unsafe { result::memcpy_htod_async(dst.dptr(), &self.as_slice()[r], stream.raw()) }
            .map_err(driver("cuMemcpyHtoDAsync"))
    }
}

impl<T: Element> Drop for PinnedBuffer<T> {
    fn drop(&mut self) {
        if self.device.bind().is_ok() {
            // SAFETY: allocated by cuMemHostAlloc in `zeros`.
            let _ = unsafe { result::free_host(self.ptr as *mut std::ffi::c_void) };
        }
    }
}
