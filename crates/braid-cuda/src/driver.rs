//! Devices, streams, events and CUDA graphs over the CUDA driver API, loaded
//! at run time through cudarc's `result` layer.
//!
//! Every handle keeps the device it belongs to and makes that device's
//! primary context current before each driver call, so handles can be used
//! from any thread. Nothing here panics when the driver is missing:
//! [`init`] checks for `libcuda` before cudarc would try to load it.

use crate::error::{driver, CudaError, Result};
use cudarc::driver::{result, sys};
use std::sync::{Arc, OnceLock};

/// Loads the CUDA driver and initialises it, once per process.
pub fn init() -> Result<()> {
    static INIT: OnceLock<Result<(), String>> = OnceLock::new();
    INIT.get_or_init(|| {
        // SAFETY: only probes whether the library can be opened.
        if !unsafe { sys::is_culib_present() } {
            return Err(
                "the CUDA driver library (libcuda.so) was not found: this machine has no \
                 NVIDIA driver"
                    .into(),
            );
        }
        result::init().map_err(|e| {
            format!("cuInit failed: {} (is a GPU visible to this process? check CUDA_VISIBLE_DEVICES and nvidia-smi)", driver("cuInit")(e))
        })
    })
    .clone()
    .map_err(CudaError::Unavailable)
}

/// Number of GPUs the driver shows this process.
pub fn device_count() -> Result<usize> {
    init()?;
    let n = result::device::get_count().map_err(driver("cuDeviceGetCount"))?;
    Ok(n.max(0) as usize)
}

struct DeviceInner {
    ordinal: usize,
    cu: sys::CUdevice,
    ctx: sys::CUcontext,
    /// The device's main stream: host↔device copies and the "caller's
    /// stream" that communication is ordered against.
    main: sys::CUstream,
}

// SAFETY: the context and stream handles are plain driver handles usable
// from any thread once the context is made current (which every method
// does first).
unsafe impl Send for DeviceInner {}
// SAFETY: as above; the driver's handles are thread-safe.
unsafe impl Sync for DeviceInner {}

impl Drop for DeviceInner {
    fn drop(&mut self) {
        // SAFETY: the context was retained in `Device::open`; the stream was
        // created in it. Errors at teardown are ignored on purpose.
        unsafe {
            let _ = result::ctx::set_current(self.ctx);
            let _ = result::stream::synchronize(self.main);
            let _ = result::stream::destroy(self.main);
            let _ = result::primary_ctx::release(self.cu);
        }
    }
}

/// One GPU, through its primary context (the one the runtime API and
/// NCCL use too). Cheap to clone.
#[derive(Clone)]
pub struct Device {
    inner: Arc<DeviceInner>,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "cuda:{}", self.inner.ordinal)
    }
}

impl Device {
    /// Opens GPU `ordinal` (as numbered under `CUDA_VISIBLE_DEVICES`).
    pub fn open(ordinal: usize) -> Result<Device> {
        let count = device_count()?;
        if ordinal >= count {
            return Err(CudaError::Invalid(format!(
                "GPU {ordinal} does not exist: this process sees {count} GPU(s) \
                 (check CUDA_VISIBLE_DEVICES and --nproc-per-node)"
            )));
        }
        let cu = result::device::get(ordinal as i32).map_err(driver("cuDeviceGet"))?;
        // SAFETY: `cu` is a valid device; the retained context is released
        // in `DeviceInner::drop`.
        let ctx = unsafe { result::primary_ctx::retain(cu) }
            .map_err(driver("cuDevicePrimaryCtxRetain"))?;
        // SAFETY: `ctx` was just retained.
        unsafe { result::ctx::set_current(ctx) }.map_err(driver("cuCtxSetCurrent"))?;
        // BRAID_MAIN_STREAM_PRIORITY (lower is more urgent; CUDA clamps it
        // to the device's range) lets the main stream's kernels take
        // free SMs before other streams' (the communication stream's).
        let main = match std::env::var(braid_core::env::BRAID_MAIN_STREAM_PRIORITY)
            .ok()
            .and_then(|v| v.trim().parse::<i32>().ok())
        {
            Some(p) => {
                result::stream::create_with_priority(result::stream::StreamKind::NonBlocking, p)
            }
            None => result::stream::create(result::stream::StreamKind::NonBlocking),
        }
        .map_err(driver("cuStreamCreate"))?;
        Ok(Device {
            inner: Arc::new(DeviceInner {
                ordinal,
                cu,
                ctx,
                main,
            }),
        })
    }

    /// This GPU's ordinal.
    pub fn ordinal(&self) -> usize {
        self.inner.ordinal
    }

    /// The driver's device handle.
    pub fn raw(&self) -> sys::CUdevice {
        self.inner.cu
    }

    /// Makes this device's context current on the calling thread.
    pub fn bind(&self) -> Result<()> {
        // SAFETY: the context stays retained while `self` lives.
        unsafe { result::ctx::set_current(self.inner.ctx) }.map_err(driver("cuCtxSetCurrent"))
    }

    /// The device's name, e.g. "NVIDIA H200".
    pub fn name(&self) -> Result<String> {
        result::device::get_name(self.inner.cu).map_err(driver("cuDeviceGetName"))
    }

    /// Streaming multiprocessors (132 on an H100/H200).
    pub fn multiprocessors(&self) -> Result<usize> {
        use sys::CUdevice_attribute as A;
        // SAFETY: valid device handle and attribute.
        let n = unsafe {
            result::device::get_attribute(
                self.inner.cu,
                A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
        }
        .map_err(driver("cuDeviceGetAttribute"))?;
        Ok(n.max(1) as usize)
    }

    /// Compute capability `(major, minor)`, e.g. `(9, 0)` for an H100/H200.
    pub fn compute_capability(&self) -> Result<(i32, i32)> {
        use sys::CUdevice_attribute as A;
        // SAFETY: valid device handle and attributes.
        let major = unsafe {
            result::device::get_attribute(
                self.inner.cu,
                A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
            )
        }
        .map_err(driver("cuDeviceGetAttribute"))?;
        // SAFETY: as above.
        let minor = unsafe {
            result::device::get_attribute(
                self.inner.cu,
                A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
            )
        }
        .map_err(driver("cuDeviceGetAttribute"))?;
        Ok((major, minor))
    }

    /// Total device memory in bytes.
    pub fn total_memory(&self) -> Result<usize> {
        // SAFETY: valid device handle.
        unsafe { result::device::total_mem(self.inner.cu) }.map_err(driver("cuDeviceTotalMem"))
    }

    /// Bytes of device memory free now (what this and every other process
    /// have not taken), with this device's context bound.
    pub fn free_memory(&self) -> Result<usize> {
        self.bind()?;
        result::mem_get_info()
            .map(|(free, _)| free)
            .map_err(driver("cuMemGetInfo"))
    }

    /// The device's main stream (copies, and the stream collectives are
    /// ordered after).
    pub fn main_stream(&self) -> Stream {
        Stream {
            raw: self.inner.main,
            owned: false,
            device: self.clone(),
        }
    }

    /// Waits for all work on the device.
    pub fn synchronize(&self) -> Result<()> {
        self.bind()?;
        result::ctx::synchronize().map_err(driver("cuCtxSynchronize"))
    }

    /// Whether this device can map `peer`'s memory directly.
    pub fn can_access_peer(&self, peer: &Device) -> Result<bool> {
        let mut can = 0;
        // SAFETY: both handles are valid devices; `can` is a valid out slot.
        unsafe { sys::cuDeviceCanAccessPeer(&mut can, self.inner.cu, peer.inner.cu) }
            .result()
            .map_err(driver("cuDeviceCanAccessPeer"))?;
        Ok(can != 0)
    }

    /// Lets this device's kernels and copies reach `peer`'s memory directly
    /// (NVLink or PCIe peer-to-peer). Enabling twice is not an error.
    pub fn enable_peer_access(&self, peer: &Device) -> Result<()> {
        self.bind()?;
        // SAFETY: the peer context is retained by `peer`.
        let r = unsafe { sys::cuCtxEnablePeerAccess(peer.inner.ctx, 0) };
        match r {
            sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {
                Ok(())
            }
            e => Err(driver("cuCtxEnablePeerAccess")(result::DriverError(e))),
        }
    }

    /// Turns direct access to `peer` off again (copies then go through the
    /// host). Disabling when not enabled is not an error.
    pub fn disable_peer_access(&self, peer: &Device) -> Result<()> {
        self.bind()?;
        // SAFETY: the peer context is retained by `peer`.
        let r = unsafe { sys::cuCtxDisablePeerAccess(peer.inner.ctx) };
        match r {
            sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_NOT_ENABLED => {
                Ok(())
            }
            e => Err(driver("cuCtxDisablePeerAccess")(result::DriverError(e))),
        }
    }

    pub(crate) fn ctx(&self) -> sys::CUcontext {
        self.inner.ctx
    }
}

/// The longest a plain [`Stream::synchronize`] waits: `BRAID_TIMEOUT`
/// (read once; a value that does not parse leaves the default, and the
/// communicators report it), else 300 s.
pub fn wait_limit() -> std::time::Duration {
    static LIMIT: std::sync::OnceLock<std::time::Duration> = std::sync::OnceLock::new();
    *LIMIT.get_or_init(|| {
        let default = std::time::Duration::from_secs(300);
        braid_core::WorldInfo::timeout_from_env(default).unwrap_or(default)
    })
}

/// A CUDA stream. Streams made with [`Stream::new`] are non-blocking and
/// destroyed on drop; [`Device::main_stream`] is a view of the device's own.
pub struct Stream {
    raw: sys::CUstream,
    owned: bool,
    device: Device,
}

// SAFETY: stream handles may be used from any thread with the context bound.
unsafe impl Send for Stream {}
// SAFETY: as above.
unsafe impl Sync for Stream {}

impl Stream {
    /// A new non-blocking stream on `device`.
    pub fn new(device: &Device) -> Result<Stream> {
        device.bind()?;
        let raw = result::stream::create(result::stream::StreamKind::NonBlocking)
            .map_err(driver("cuStreamCreate"))?;
        Ok(Stream {
            raw,
            owned: true,
            device: device.clone(),
        })
    }

    /// Another handle on this stream that does not destroy it when
    /// dropped: valid only while this one lives (a span that ends on the
    /// stream at the end of a scope holds one).
    pub fn borrowed(&self) -> Stream {
        Stream {
            raw: self.raw,
            owned: false,
            device: self.device.clone(),
        }
    }

    /// The driver handle (what NCCL calls take as `cudaStream_t`).
    pub fn raw(&self) -> sys::CUstream {
        self.raw
    }

    /// The device this stream runs on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Blocks until everything queued on the stream has run, at most the
    /// process's wait limit (`BRAID_TIMEOUT`, else 300 s): work that never
    /// ends (a kernel waiting on a stopped peer's flag, a driver fault)
    /// is an error naming the limit, not a hang.
    pub fn synchronize(&self) -> Result<()> {
        self.synchronize_within(wait_limit(), "waiting for a GPU stream")
    }

    /// [`synchronize`](Self::synchronize), bounded: waits at most `limit`
    /// for what is queued now, then fails naming `what` (a kernel or a
    /// copy that never ends must not hang the process). Polls an event:
    /// spinning for the first 100 ms (as a blocking sync does), then
    /// yielding, then sleeping 50 µs between polls.
    pub fn synchronize_within(&self, limit: std::time::Duration, what: &str) -> Result<()> {
        let done = Event::new(&self.device)?;
        done.record(self)?;
        let start = std::time::Instant::now();
        loop {
            if done.query()? {
                return Ok(());
            }
            let waited = start.elapsed();
            if waited > limit {
                return Err(CudaError::Timeout(format!(
                    "{what}: the GPU's queued work did not finish within {limit:?} (a kernel or \
                     copy that never ends: a stopped peer's, a driver fault; BRAID_TIMEOUT sets \
                     the limit)"
                )));
            }
            if waited < std::time::Duration::from_millis(100) {
                std::hint::spin_loop();
            } else if waited < std::time::Duration::from_millis(200) {
                std::thread::yield_now();
            } else {
                std::thread::sleep(std::time::Duration::from_micros(50));
            }
        }
    }

    /// Makes later work on this stream wait for `event` (no host wait).
    pub fn wait_event(&self, event: &Event) -> Result<()> {
        self.device.bind()?;
        // SAFETY: valid stream and event.
        unsafe {
            result::stream::wait_event(
                self.raw,
                event.raw,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .map_err(driver("cuStreamWaitEvent"))
    }

    /// Starts capturing this stream's work into a graph (thread-local mode,
    /// so other threads' CUDA calls are unaffected).
    pub fn begin_capture(&self) -> Result<()> {
        self.device.bind()?;
        // SAFETY: valid stream.
        unsafe {
            result::stream::begin_capture(
                self.raw,
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
        }
        .map_err(driver("cuStreamBeginCapture"))
    }

    /// Ends a capture begun with [`begin_capture`](Self::begin_capture).
    /// Instantiate the result only after every capture on this thread has
    /// ended (the driver refuses while one is still open).
    pub fn end_capture(&self) -> Result<CapturedGraph> {
        self.device.bind()?;
        // SAFETY: valid stream in capture mode.
        let graph = unsafe { result::stream::end_capture(self.raw) }
            .map_err(driver("cuStreamEndCapture"))?;
        Ok(CapturedGraph {
            graph,
            device: self.device.clone(),
        })
    }
}

/// A captured, not yet instantiated, CUDA graph.
pub struct CapturedGraph {
    graph: sys::CUgraph,
    device: Device,
}

// SAFETY: graph handles may be used from any thread with the context bound.
unsafe impl Send for CapturedGraph {}

impl CapturedGraph {
    /// Instantiates the graph for replay.
    pub fn instantiate(self) -> Result<Graph> {
        self.device.bind()?;
        // SAFETY: `graph` came from a finished capture.
        let exec =
            unsafe { result::graph::instantiate(self.graph, sys::CUgraphInstantiate_flags(0)) }
                .map_err(driver("cuGraphInstantiate"))?;
        let this = std::mem::ManuallyDrop::new(self);
        Ok(Graph {
            graph: this.graph,
            exec,
            // SAFETY: `this` is never dropped; the device moves out once.
            device: unsafe { std::ptr::read(&this.device) },
        })
    }
}

impl Drop for CapturedGraph {
    fn drop(&mut self) {
        if self.device.bind().is_ok() {
            // SAFETY: we own the graph; it was never instantiated.
            let _ = unsafe { result::graph::destroy(self.graph) };
        }
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if self.owned && self.device.bind().is_ok() {
            // SAFETY: we created the stream; pending work completes first
            // (cuStreamDestroy does not wait, so synchronise explicitly).
            unsafe {
                let _ = result::stream::synchronize(self.raw);
                let _ = result::stream::destroy(self.raw);
            }
        }
    }
}

/// A CUDA event: a point in a stream that other streams and the host can
/// wait for.
pub struct Event {
    raw: sys::CUevent,
    device: Device,
}

// SAFETY: event handles may be used from any thread with the context bound.
unsafe impl Send for Event {}
// SAFETY: as above.
unsafe impl Sync for Event {}

impl Event {
    /// An event without timing (cheapest to record and wait on).
    pub fn new(device: &Device) -> Result<Event> {
        Self::with_flags(device, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
    }

    /// An event that records a timestamp, for [`elapsed_ms`](Self::elapsed_ms).
    pub fn timed(device: &Device) -> Result<Event> {
        Self::with_flags(device, sys::CUevent_flags::CU_EVENT_DEFAULT)
    }

    fn with_flags(device: &Device, flags: sys::CUevent_flags) -> Result<Event> {
        device.bind()?;
        let raw = result::event::create(flags).map_err(driver("cuEventCreate"))?;
        Ok(Event {
            raw,
            device: device.clone(),
        })
    }

    /// The device the event belongs to.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Records the event at the current end of `stream`.
    pub fn record(&self, stream: &Stream) -> Result<()> {
        self.device.bind()?;
        // SAFETY: valid event and stream of the same context.
        unsafe { result::event::record(self.raw, stream.raw) }.map_err(driver("cuEventRecord"))
    }

    /// Whether the work before the event has completed (never blocks).
    pub fn query(&self) -> Result<bool> {
        self.device.bind()?;
        // SAFETY: valid event.
        match unsafe { sys::cuEventQuery(self.raw) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            e => Err(driver("cuEventQuery")(result::DriverError(e))),
        }
    }

    /// Blocks until the event has completed.
    pub fn synchronize(&self) -> Result<()> {
        self.device.bind()?;
        // SAFETY: valid event.
        unsafe { result::event::synchronize(self.raw) }.map_err(driver("cuEventSynchronize"))
    }

    /// Milliseconds between `start` and this event (both [`timed`](Self::timed)
    /// and completed).
    pub fn elapsed_ms(&self, start: &Event) -> Result<f32> {
        self.device.bind()?;
        // SAFETY: both events are valid timing events.
        unsafe { result::event::elapsed(start.raw, self.raw) }.map_err(driver("cuEventElapsedTime"))
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if self.device.bind().is_ok() {
            // SAFETY: we created the event; the driver defers destruction
            // until it completes.
            let _ = unsafe { result::event::destroy(self.raw) };
        }
    }
}

/// An instantiated CUDA graph, replayed with [`launch`](Self::launch).
pub struct Graph {
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
    device: Device,
}

// SAFETY: graph handles may be used from any thread with the context bound.
unsafe impl Send for Graph {}

impl Graph {
    /// Queues one replay of the graph on `stream`.
    pub fn launch(&self, stream: &Stream) -> Result<()> {
        self.device.bind()?;
        // SAFETY: valid executable graph and stream.
        unsafe { result::graph::launch(self.exec, stream.raw) }.map_err(driver("cuGraphLaunch"))
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        if self.device.bind().is_ok() {
            // SAFETY: we own both handles.
            unsafe {
                let _ = result::graph::exec_destroy(self.exec);
                let _ = result::graph::destroy(self.graph);
            }
        }
    }
}

/// Checks that a CUDA call's status is success (for raw `sys` calls).
pub(crate) fn check(call: &'static str, r: sys::CUresult) -> Result<()> {
    r.result().map_err(driver(call))
}
