//! Device memory shared between processes of one host (CUDA IPC), and the
//! few stream operations that move and signal through it: copies between
//! raw device addresses (the copy engines carry them over NVLink, no SMs
//! involved) and 32-bit flags written and awaited by streams. What a
//! copy-engine all-reduce between processes is built from.

use crate::driver::{check, Device, Stream};
use crate::error::{CudaError, Result};
use crate::memory::DeviceBuffer;
use braid_core::Element;
use cudarc::driver::sys;

/// An opaque handle other processes open to map a device allocation.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct IpcHandle(pub [u8; 64]);

impl std::fmt::Debug for IpcHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "IpcHandle({:02x}{:02x}…)", self.0[0], self.0[1])
    }
}

impl<T: Element> DeviceBuffer<T> {
    /// The IPC handle of this buffer's allocation (a buffer made by
    /// `zeros`/`from_host`, not a pool block).
    pub fn ipc_handle(&self) -> Result<IpcHandle> {
        ipc_handle(self.device(), self.device_ptr())
    }
}

/// The IPC handle of the device allocation starting at `ptr` on `device`
/// (an error if `ptr` is not the start of an allocation).
pub fn ipc_handle(device: &Device, ptr: u64) -> Result<IpcHandle> {
    device.bind()?;
    let mut h = sys::CUipcMemHandle_st { reserved: [0; 64] };
    // SAFETY: `h` is a valid out-parameter; the driver checks `ptr`.
    check("cuIpcGetMemHandle", unsafe {
        sys::cuIpcGetMemHandle(&mut h, ptr)
    })?;
    Ok(IpcHandle(h.reserved.map(|c| c as u8)))
}

/// Another process's device allocation, mapped into this one (peer
/// access enabled); unmapped on drop.
pub struct PeerMemory {
    ptr: u64,
    bytes: usize,
    device: Device,
}

// SAFETY: the mapping is a plain device address valid in the device's
// context from any thread.
unsafe impl Send for PeerMemory {}
// SAFETY: as above; `&self` only reads the address.
unsafe impl Sync for PeerMemory {}

impl PeerMemory {
    /// Maps the allocation behind `handle` (at least `bytes` long) on
    /// `device`.
    pub fn open(device: &Device, handle: &IpcHandle, bytes: usize) -> Result<PeerMemory> {
        device.bind()?;
        let h = sys::CUipcMemHandle_st {
            reserved: handle.0.map(|b| b as std::ffi::c_char),
        };
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: valid out-parameter and handle bytes from the exporter.
        check("cuIpcOpenMemHandle", unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut ptr,
                h,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        })
        .map_err(|e| {
            CudaError::Invalid(format!(
                "mapping another process's GPU memory failed ({e}); the GPUs need peer access (NVLink or a shared PCIe switch)"
            ))
        })?;
        Ok(PeerMemory {
            ptr,
            bytes,
            device: device.clone(),
        })
    }

    /// The mapped address of the allocation's first byte.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Bytes the mapping was opened for.
    pub fn len_bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for PeerMemory {
    fn drop(&mut self) {
        if self.device.bind().is_ok() {
            // SAFETY: we opened this mapping.
            let _ = unsafe { sys::cuIpcCloseMemHandle(self.ptr) };
        }
    }
}

/// Queues a copy of `bytes` from device address `src` to `dst` on
/// `stream` (across GPUs through a peer mapping: the copy engines).
///
/// # Safety
/// Both ranges must be valid device memory of `bytes` bytes for as long
/// as the copy runs, and nothing else may write them meanwhile.
pub unsafe fn copy_raw_async(dst: u64, src: u64, bytes: usize, stream: &Stream) -> Result<()> {
    if bytes == 0 {
        return Ok(());
    }
    stream.device().bind()?;
    // SAFETY: the caller vouches for both ranges.
    check("cuMemcpyDtoDAsync", unsafe {
        sys::cuMemcpyDtoDAsync_v2(dst, src, bytes, stream.raw())
    })
}

/// Queues, on `stream`, a write of `value` to the 32-bit flag at `addr`
/// (local or a peer mapping), after a memory fence: everything queued
/// before it on the stream is visible before the flag is.
///
/// # Safety
/// `addr` must be 4 aligned bytes of device memory valid until it runs.
pub unsafe fn write_flag_async(addr: u64, value: u32, stream: &Stream) -> Result<()> {
    stream.device().bind()?;
    // SAFETY: the caller vouches for the address.
    check("cuStreamWriteValue32", unsafe {
        sys::cuStreamWriteValue32_v2(
            stream.raw(),
            addr,
            value,
            sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32,
        )
    })
}

/// Makes later work on `stream` wait until the 32-bit flag at `addr` is
/// at least `value` (no host involvement).
///
/// # Safety
/// `addr` must be 4 aligned bytes of device memory valid until the wait
/// is over. A flag that never gets there stalls the stream for good:
/// whoever waits on the stream must bound that wait.
pub unsafe fn wait_flag_async(addr: u64, value: u32, stream: &Stream) -> Result<()> {
    stream.device().bind()?;
    // SAFETY: the caller vouches for the address.
    check("cuStreamWaitValue32", unsafe {
        sys::cuStreamWaitValue32_v2(
            stream.raw(),
            addr,
            value,
            sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32,
        )
    })
}
