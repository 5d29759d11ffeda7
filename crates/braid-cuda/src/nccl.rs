//! A thin run-time binding of NCCL: the library is found and opened when
//! first needed, and every call's result is checked and named.
//!
//! Where the library comes from, in order: `BRAID_NCCL_LIB` (a path, when
//! set: an explicit choice wins), the system library (`libnccl.so.2`,
//! `libnccl.so` on the loader's path), then the `libnccl.so.2` shipped in a
//! PyTorch installation's `nvidia-nccl` wheel (found under the usual Python
//! site-packages directories, `VIRTUAL_ENV` and `CONDA_PREFIX`).
//!
//! [`NcclComm`] owns one NCCL communicator; enqueueing functions take raw
//! device addresses and streams — typed, checked wrappers live in
//! `braid-comm`'s GPU communicator.

use crate::driver::{Device, Stream};
use crate::error::{CudaError, Result};
use braid_core::{DType, ReduceOp};
use libloading::Library;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

/// The variable naming an NCCL library to load instead of the system one.
pub const NCCL_LIB_VAR: &str = braid_core::env::BRAID_NCCL_LIB;

type Comm = *mut c_void;
type Res = c_int;

/// NCCL's 128-byte bootstrap id; rank 0 makes it, the others receive it
/// through the rendezvous store.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct UniqueId {
    /// Opaque bytes.
    pub internal: [c_char; 128],
}

impl UniqueId {
    /// The id's bytes (what goes through the store).
    pub fn to_bytes(&self) -> Vec<u8> {
        self.internal.iter().map(|&c| c as u8).collect()
    }

    /// An id from bytes received through the store.
    pub fn from_bytes(b: &[u8]) -> Result<UniqueId> {
        if b.len() != 128 {
            return Err(CudaError::Invalid(format!(
                "an NCCL unique id has 128 bytes, got {}",
                b.len()
            )));
        }
        let mut id = UniqueId { internal: [0; 128] };
        for (d, s) in id.internal.iter_mut().zip(b) {
            *d = *s as c_char;
        }
        Ok(id)
    }
}

struct Api {
    _lib: Library,
    path: String,
    get_version: unsafe extern "C" fn(*mut c_int) -> Res,
    get_unique_id: unsafe extern "C" fn(*mut UniqueId) -> Res,
    comm_init_rank: unsafe extern "C" fn(*mut Comm, c_int, UniqueId, c_int) -> Res,
    comm_init_all: unsafe extern "C" fn(*mut Comm, c_int, *const c_int) -> Res,
    comm_split: unsafe extern "C" fn(Comm, c_int, c_int, *mut Comm, *mut c_void) -> Res,
    comm_destroy: unsafe extern "C" fn(Comm) -> Res,
    comm_abort: unsafe extern "C" fn(Comm) -> Res,
    comm_get_async_error: unsafe extern "C" fn(Comm, *mut Res) -> Res,
    comm_count: unsafe extern "C" fn(Comm, *mut c_int) -> Res,
    comm_user_rank: unsafe extern "C" fn(Comm, *mut c_int) -> Res,
    get_error_string: unsafe extern "C" fn(Res) -> *const c_char,
    get_last_error: unsafe extern "C" fn(Comm) -> *const c_char,
    #[allow(clippy::type_complexity)]
    all_reduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        Comm,
        *mut c_void,
    ) -> Res,
    #[allow(clippy::type_complexity)]
    reduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        c_int,
        Comm,
        *mut c_void,
    ) -> Res,
    #[allow(clippy::type_complexity)]
    broadcast: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        Comm,
        *mut c_void,
    ) -> Res,
    #[allow(clippy::type_complexity)]
    all_gather:
        unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, Comm, *mut c_void) -> Res,
    #[allow(clippy::type_complexity)]
    reduce_scatter: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        Comm,
        *mut c_void,
    ) -> Res,
    send: unsafe extern "C" fn(*const c_void, usize, c_int, c_int, Comm, *mut c_void) -> Res,
    recv: unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, Comm, *mut c_void) -> Res,
    group_start: unsafe extern "C" fn() -> Res,
    group_end: unsafe extern "C" fn() -> Res,
    /// Symmetric memory (NCCL 2.27 and later; `None` before).
    symmetric: Option<SymmetricApi>,
}

/// NCCL's allocator and window registration (nccl.h, 2.27 and later).
struct SymmetricApi {
    mem_alloc: unsafe extern "C" fn(*mut *mut c_void, usize) -> Res,
    mem_free: unsafe extern "C" fn(*mut c_void) -> Res,
    window_register: unsafe extern "C" fn(Comm, *mut c_void, usize, *mut *mut c_void, c_int) -> Res,
    window_deregister: unsafe extern "C" fn(Comm, *mut c_void) -> Res,
}

/// `NCCL_WIN_COLL_SYMMETRIC` (nccl.h): every rank passes buffers at the
/// same offset into its window.
const WIN_COLL_SYMMETRIC: c_int = 0x01;

/// `ncclConfig_t` as nccl.h declares it from 2.28 (`ncclConfig_v22800`).
/// NCCL reads `size` bytes of it at most and ignores the fields newer than
/// `version`, so an older 2.27 library takes it too.
#[repr(C)]
struct Config {
    size: usize,
    magic: std::ffi::c_uint,
    version: std::ffi::c_uint,
    blocking: c_int,
    cga_cluster_size: c_int,
    min_ctas: c_int,
    max_ctas: c_int,
    net_name: *const c_char,
    split_share: c_int,
    traffic_class: c_int,
    comm_name: *const c_char,
    collnet_enable: c_int,
    cta_policy: c_int,
    shrink_share: c_int,
    nvls_ctas: c_int,
    n_channels_per_net_peer: c_int,
    nvlink_centric_sched: c_int,
}

/// `NCCL_CONFIG_UNDEF_INT`: a field NCCL fills with its default.
const CONFIG_UNDEF: c_int = c_int::MIN;

/// `NCCL_CTA_POLICY_ZERO`: collectives that can run on the copy engines
/// (all-gathers into symmetric windows, one node) do, using no SMs.
const CTA_POLICY_ZERO: c_int = 0x02;

/// The first NCCL version that all-gathers on the copy engines (2.28.0).
const COPY_ENGINE_GATHERS_VERSION: c_int = 22800;

impl Config {
    /// `NCCL_CONFIG_INITIALIZER` with the CTA policy set to `policy`.
    fn with_cta_policy(policy: c_int) -> Config {
        Config {
            size: std::mem::size_of::<Config>(),
            magic: 0xcafe_beef,
            version: COPY_ENGINE_GATHERS_VERSION as std::ffi::c_uint,
            blocking: CONFIG_UNDEF,
            cga_cluster_size: CONFIG_UNDEF,
            min_ctas: CONFIG_UNDEF,
            max_ctas: CONFIG_UNDEF,
            net_name: std::ptr::null(),
            split_share: CONFIG_UNDEF,
            traffic_class: CONFIG_UNDEF,
            comm_name: std::ptr::null(),
            collnet_enable: CONFIG_UNDEF,
            cta_policy: policy,
            shrink_share: CONFIG_UNDEF,
            nvls_ctas: CONFIG_UNDEF,
            n_channels_per_net_peer: CONFIG_UNDEF,
            nvlink_centric_sched: CONFIG_UNDEF,
        }
    }
}

// SAFETY: the table holds function pointers into a library that stays
// loaded for the life of the process.
unsafe impl Send for Api {}
// SAFETY: as above.
unsafe impl Sync for Api {}

fn candidate_paths() -> Vec<String> {
    let mut out = Vec::new();
    if let Ok(p) = std::env::var(NCCL_LIB_VAR) {
        if !p.is_empty() {
            out.push(p);
        }
    }
    out.push("libnccl.so.2".into());
    out.push("libnccl.so".into());
    out.extend(wheel_paths().into_iter().map(|p| p.display().to_string()));
    out
}

/// `nvidia/nccl/lib/libnccl.so.2` under the Python site-packages
/// directories this process can see.
fn wheel_paths() -> Vec<PathBuf> {
    let mut roots: Vec<PathBuf> = Vec::new();
    for var in [braid_core::env::VIRTUAL_ENV, braid_core::env::CONDA_PREFIX] {
        if let Ok(v) = std::env::var(var) {
            roots.push(PathBuf::from(v).join("lib"));
        }
    }
    if let Ok(home) = std::env::var(braid_core::env::HOME) {
        roots.push(PathBuf::from(home).join(".local/lib"));
    }
    for r in ["/usr/local/lib", "/usr/lib", "/opt/conda/lib"] {
        roots.push(PathBuf::from(r));
    }
    let mut found = Vec::new();
    for root in roots {
        let Ok(entries) = std::fs::read_dir(&root) else {
            continue;
        };
        for e in entries.flatten() {
            let name = e.file_name();
            if !name.to_string_lossy().starts_with("python3") {
                continue;
            }
            for pkgs in ["site-packages", "dist-packages"] {
                let p = e.path().join(pkgs).join("nvidia/nccl/lib/libnccl.so.2");
                if p.exists() {
                    found.push(p);
                }
            }
        }
    }
    found
}

/// Reads one symbol as a function pointer of type `F`.
///
/// # Safety
/// `F` must be the symbol's true C signature.
unsafe fn sym<F: Copy>(lib: &Library, name: &str) -> std::result::Result<F, String> {
    lib.get::<F>(name.as_bytes())
        .map(|s| *s)
        .map_err(|e| format!("symbol {name} missing: {e}"))
}

fn load() -> std::result::Result<Api, String> {
    let mut tried = Vec::new();
    for path in candidate_paths() {
        // SAFETY: opening a shared library runs its initialisers; NCCL's
        // are benign.
        let lib = match unsafe { Library::new(&path) } {
            Ok(l) => l,
            Err(e) => {
                tried.push(format!("{path}: {e}"));
                continue;
            }
        };
        // SAFETY: each type below is the function's C prototype from nccl.h
        // (2.19 and later).
        let api = unsafe {
            Api {
                get_version: sym(&lib, "ncclGetVersion")?,
                get_unique_id: sym(&lib, "ncclGetUniqueId")?,
                comm_init_rank: sym(&lib, "ncclCommInitRank")?,
                comm_init_all: sym(&lib, "ncclCommInitAll")?,
                comm_split: sym(&lib, "ncclCommSplit")?,
                comm_destroy: sym(&lib, "ncclCommDestroy")?,
                comm_abort: sym(&lib, "ncclCommAbort")?,
                comm_get_async_error: sym(&lib, "ncclCommGetAsyncError")?,
                comm_count: sym(&lib, "ncclCommCount")?,
                comm_user_rank: sym(&lib, "ncclCommUserRank")?,
                get_error_string: sym(&lib, "ncclGetErrorString")?,
                get_last_error: sym(&lib, "ncclGetLastError")?,
                all_reduce: sym(&lib, "ncclAllReduce")?,
                reduce: sym(&lib, "ncclReduce")?,
                broadcast: sym(&lib, "ncclBroadcast")?,
                all_gather: sym(&lib, "ncclAllGather")?,
                reduce_scatter: sym(&lib, "ncclReduceScatter")?,
                send: sym(&lib, "ncclSend")?,
                recv: sym(&lib, "ncclRecv")?,
                group_start: sym(&lib, "ncclGroupStart")?,
                group_end: sym(&lib, "ncclGroupEnd")?,
                symmetric: (|| -> std::result::Result<SymmetricApi, String> {
                    Ok(SymmetricApi {
                        mem_alloc: sym(&lib, "ncclMemAlloc")?,
                        mem_free: sym(&lib, "ncclMemFree")?,
                        window_register: sym(&lib, "ncclCommWindowRegister")?,
                        window_deregister: sym(&lib, "ncclCommWindowDeregister")?,
                    })
                })()
                .ok(),
                path: path.clone(),
                _lib: lib,
            }
        };
        return Ok(api);
    }
    Err(format!(
        "the NCCL library was not found (tried: {}); install NCCL (libnccl2), \
         or point {NCCL_LIB_VAR} at a libnccl.so.2 (e.g. from the nvidia-nccl-cu12 wheel)",
        tried.join("; ")
    ))
}

fn api() -> Result<&'static Api> {
    static API: OnceLock<std::result::Result<Api, String>> = OnceLock::new();
    API.get_or_init(load)
        .as_ref()
        .map_err(|e| CudaError::Unavailable(e.clone()))
}

/// Whether NCCL can be loaded here, with its version and path, or why not.
pub fn version() -> Result<(i32, String)> {
    let a = api()?;
    let mut v = 0;
    // SAFETY: valid out pointer.
    check(
        a,
        "ncclGetVersion",
        unsafe { (a.get_version)(&mut v) },
        None,
    )?;
    Ok((v, a.path.clone()))
}

fn result_name(r: Res) -> &'static str {
    match r {
        0 => "ncclSuccess",
        1 => "ncclUnhandledCudaError",
        2 => "ncclSystemError",
        3 => "ncclInternalError",
        4 => "ncclInvalidArgument",
        5 => "ncclInvalidUsage",
        6 => "ncclRemoteError",
        7 => "ncclInProgress",
        _ => "ncclResult(unknown)",
    }
}

fn check(a: &Api, call: &'static str, r: Res, comm: Option<Comm>) -> Result<()> {
    if r == 0 {
        return Ok(());
    }
    // SAFETY: NCCL returns static or per-thread C strings.
    let text = unsafe {
        let last = (a.get_last_error)(comm.unwrap_or(std::ptr::null_mut()));
        let s = if last.is_null() || *last == 0 {
            (a.get_error_string)(r)
        } else {
            last
        };
        if s.is_null() {
            String::new()
        } else {
            CStr::from_ptr(s).to_string_lossy().into_owned()
        }
    };
    Err(CudaError::Nccl {
        call,
        name: result_name(r),
        text,
    })
}

/// NCCL's code for a braid dtype.
pub fn nccl_dtype(d: DType) -> c_int {
    match d {
        DType::U8 => 1,
        DType::I32 => 2,
        DType::I64 => 4,
        DType::F16 => 6,
        DType::F32 => 7,
        DType::F64 => 8,
        DType::BF16 => 9,
    }
}

/// NCCL's code for a braid reduce op.
pub fn nccl_op(op: ReduceOp) -> c_int {
    match op {
        ReduceOp::Sum => 0,
        ReduceOp::Prod => 1,
        ReduceOp::Max => 2,
        ReduceOp::Min => 3,
        ReduceOp::Avg => 4,
    }
}

/// A new bootstrap id (made by one rank, shared with the others).
pub fn unique_id() -> Result<UniqueId> {
    let a = api()?;
    let mut id = UniqueId { internal: [0; 128] };
    // SAFETY: valid out pointer.
    check(
        a,
        "ncclGetUniqueId",
        unsafe { (a.get_unique_id)(&mut id) },
        None,
    )?;
    Ok(id)
}

/// Starts an NCCL group: operations until [`group_end`] launch as one.
pub fn group_start() -> Result<()> {
    let a = api()?;
    // SAFETY: no arguments.
    check(a, "ncclGroupStart", unsafe { (a.group_start)() }, None)
}

/// Ends an NCCL group, launching its operations.
pub fn group_end() -> Result<()> {
    let a = api()?;
    // SAFETY: no arguments.
    check(a, "ncclGroupEnd", unsafe { (a.group_end)() }, None)
}

/// One NCCL communicator: this process's member on one GPU.
pub struct NcclComm {
    raw: Comm,
    device: Device,
    rank: usize,
    size: usize,
    aborted: bool,
    /// Cleared when the communicator is aborted or destroyed: the
    /// symmetric memory registered with it then skips deregistration.
    alive: Arc<AtomicBool>,
}

// SAFETY: an NCCL communicator may be used from any thread as long as calls
// on it are not concurrent; braid serialises them (one owner, `&mut` or a
// lock above).
unsafe impl Send for NcclComm {}

fn ptr(addr: u64) -> *mut c_void {
    addr as usize as *mut c_void
}

impl NcclComm {
    /// Joins the communicator identified by `id` as `rank` of `size` on
    /// `device`. Blocks until all ranks have joined.
    pub fn init_rank(device: &Device, size: usize, id: &UniqueId, rank: usize) -> Result<NcclComm> {
        let a = api()?;
        device.bind()?;
        let mut raw: Comm = std::ptr::null_mut();
        // SAFETY: valid out pointer; the id is passed by value as in nccl.h.
        let r = unsafe { (a.comm_init_rank)(&mut raw, size as c_int, *id, rank as c_int) };
        check(a, "ncclCommInitRank", r, None)?;
        Ok(NcclComm {
            raw,
            device: device.clone(),
            rank,
            size,
            aborted: false,
            alive: Arc::new(AtomicBool::new(true)),
        })
    }

    /// `ncclCommInitRank` for each of `devices` as ranks `first`,
    /// `first + 1`, … of `size` (inside one NCCL group when there are
    /// several), bounded: it fails after `timeout`, or as soon as
    /// `abandon` (polled every 50 ms) gives a reason, e.g. a peer known to
    /// be dead. NCCL's blocking initialisation cannot be interrupted, so it
    /// runs on a helper thread that is left behind on failure; the caller
    /// is expected to fail the process, which ends it.
    pub fn init_ranks_bounded(
        devices: &[Device],
        size: usize,
        id: &UniqueId,
        first: usize,
        timeout: std::time::Duration,
        abandon: impl Fn() -> Option<String>,
    ) -> Result<Vec<NcclComm>> {
        use std::sync::mpsc;
        let (tx, rx) = mpsc::channel();
        let (devices_owned, id) = (devices.to_vec(), *id);
        std::thread::Builder::new()
            .name(format!("nccl-init-{first}"))
            .spawn(move || {
                let _ = tx.send(Self::init_ranks(&devices_owned, size, &id, first));
            })
            .map_err(|e| CudaError::Invalid(format!("cannot start the NCCL init thread: {e}")))?;
        let ranks = if devices.len() == 1 {
            format!("rank {first}")
        } else {
            format!("ranks {first}..{}", first + devices.len() - 1)
        };
        let start = std::time::Instant::now();
        loop {
            match rx.recv_timeout(std::time::Duration::from_millis(50)) {
                Ok(r) => return r,
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(CudaError::Invalid(format!(
                        "{ranks}: the NCCL init thread ended without a result"
                    )))
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
            }
            if let Some(why) = abandon() {
                return Err(CudaError::Timeout(format!(
                    "{ranks}: NCCL initialisation ({size} ranks) abandoned: {why}"
                )));
            }
            if start.elapsed() >= timeout {
                return Err(CudaError::Timeout(format!(
                    "{ranks}: NCCL initialisation ({size} ranks) did not finish within {timeout:?}: \
                     a peer did not join (it died, or runs with another world size); \
                     raise BRAID_TIMEOUT if initialisation is just slow"
                )));
            }
        }
    }

    /// `ncclCommInitRank` for each of `devices` (one NCCL group when there
    /// are several); blocks until every rank has joined.
    fn init_ranks(
        devices: &[Device],
        size: usize,
        id: &UniqueId,
        first: usize,
    ) -> Result<Vec<Self>> {
        if devices.len() == 1 {
            return Ok(vec![Self::init_rank(&devices[0], size, id, first)?]);
        }
        group_start()?;
        let comms: Result<Vec<_>> = devices
            .iter()
            .enumerate()
            .map(|(k, d)| Self::init_rank(d, size, id, first + k))
            .collect();
        group_end()?;
        comms
    }

    /// One communicator per device, all in this process (the
    /// `ncclCommInitAll` pattern); element `i` is rank `i`.
    pub fn init_all(devices: &[Device]) -> Result<Vec<NcclComm>> {
        let a = api()?;
        if let Some(d) = devices.first() {
            d.bind()?;
        }
        let list: Vec<c_int> = devices.iter().map(|d| d.ordinal() as c_int).collect();
        let mut raws: Vec<Comm> = vec![std::ptr::null_mut(); devices.len()];
        // SAFETY: `raws` has one slot per listed device.
        let r = unsafe { (a.comm_init_all)(raws.as_mut_ptr(), list.len() as c_int, list.as_ptr()) };
        check(a, "ncclCommInitAll", r, None)?;
        Ok(raws
            .into_iter()
            .zip(devices)
            .enumerate()
            .map(|(rank, (raw, d))| NcclComm {
                raw,
                device: d.clone(),
                rank,
                size: devices.len(),
                aborted: false,
                alive: Arc::new(AtomicBool::new(true)),
            })
            .collect())
    }

    /// `ncclCommSplit`: ranks with the same `color` form a new communicator
    /// ordered by `key`; `None` takes part without joining one. Collective
    /// over this communicator.
    pub fn split(&self, color: Option<u32>, key: i64) -> Result<Option<NcclComm>> {
        self.split_with(color, key, None)
    }

    /// [`split`](Self::split) into a communicator under NCCL's zero-CTA
    /// policy (`NCCL_CTA_POLICY_ZERO`, NCCL 2.28 and later): its
    /// all-gathers into symmetric windows on one node run on the copy
    /// engines. The parent keeps its own policy. `NCCL_CTA_POLICY`, where
    /// set, overrides the policy asked for here (NCCL's rule).
    pub fn split_zero_cta(&self, color: Option<u32>, key: i64) -> Result<Option<NcclComm>> {
        if !Self::has_copy_engine_gathers() {
            return Err(CudaError::Unavailable(format!(
                "NCCL's zero-CTA policy needs NCCL 2.28 or later with symmetric memory (this \
                 is {})",
                version().map_or_else(|e| e.to_string(), |(v, p)| format!("{v} at {p}"))
            )));
        }
        let mut config = Config::with_cta_policy(CTA_POLICY_ZERO);
        self.split_with(color, key, Some(&mut config))
    }

    fn split_with(
        &self,
        color: Option<u32>,
        key: i64,
        config: Option<&mut Config>,
    ) -> Result<Option<NcclComm>> {
        let a = api()?;
        self.device.bind()?;
        let mut raw: Comm = std::ptr::null_mut();
        let c = match color {
            Some(c) => c as c_int,
            None => -1, // NCCL_SPLIT_NOCOLOR
        };
        let config = config.map_or(std::ptr::null_mut(), |c| c as *mut Config as *mut c_void);
        // SAFETY: valid communicator and out pointer; a null config
        // inherits the parent's, another is an `ncclConfig_t` NCCL reads
        // during the call (`size` bytes at most).
        let r = unsafe { (a.comm_split)(self.raw, c, key as c_int, &mut raw, config) };
        check(a, "ncclCommSplit", r, Some(self.raw))?;
        if raw.is_null() {
            return Ok(None);
        }
        let mut comm = NcclComm {
            raw,
            device: self.device.clone(),
            rank: 0,
            size: 0,
            aborted: false,
            alive: Arc::new(AtomicBool::new(true)),
        };
        comm.read_rank_size(a)?;
        Ok(Some(comm))
    }

    fn read_rank_size(&mut self, a: &Api) -> Result<()> {
        let (mut rank, mut size) = (0, 0);
        // SAFETY: valid communicator and out pointers.
        check(
            a,
            "ncclCommUserRank",
            unsafe { (a.comm_user_rank)(self.raw, &mut rank) },
            Some(self.raw),
        )?;
        // SAFETY: as above.
        check(
            a,
            "ncclCommCount",
            unsafe { (a.comm_count)(self.raw, &mut size) },
            Some(self.raw),
        )?;
        self.rank = rank as usize;
        self.size = size as usize;
        Ok(())
    }

    /// This member's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of members.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The GPU this member runs on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The communicator's asynchronous error, if any (NCCL sets it when a
    /// peer or network fails while kernels run).
    pub fn async_error(&self) -> Result<()> {
        let a = api()?;
        let mut e: Res = 0;
        // SAFETY: valid communicator and out pointer.
        let r = unsafe { (a.comm_get_async_error)(self.raw, &mut e) };
        check(a, "ncclCommGetAsyncError", r, Some(self.raw))?;
        if e == 0 || e == 7 {
            return Ok(());
        }
        check(a, "an NCCL kernel (asynchronous error)", e, Some(self.raw))
    }

    /// Aborts the communicator: its pending kernels stop and it can no
    /// longer be used. Idempotent.
    pub fn abort(&mut self) {
        if self.aborted {
            return;
        }
        self.aborted = true;
        self.alive.store(false, Ordering::SeqCst);
        if let Ok(a) = api() {
            let _ = self.device.bind();
            // SAFETY: valid communicator, aborted at most once.
            unsafe { (a.comm_abort)(self.raw) };
        }
    }

    /// Whether [`abort`](Self::abort) was called.
    pub fn is_aborted(&self) -> bool {
        self.aborted
    }

    fn usable(&self, call: &'static str) -> Result<&'static Api> {
        if self.aborted {
            return Err(CudaError::Invalid(format!(
                "{call} on an aborted NCCL communicator"
            )));
        }
        api()
    }

    /// Enqueues `ncclAllReduce` on `stream`.
    ///
    /// # Safety
    /// `send` and `recv` must be device addresses of at least `count`
    /// elements of `dtype`, valid until the stream passes this point.
    pub unsafe fn all_reduce(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DType,
        op: ReduceOp,
        stream: &Stream,
    ) -> Result<()> {
        let a = self.usable("ncclAllReduce")?;
        let r = (a.all_reduce)(
            ptr(send),
            ptr(recv),
            count,
            nccl_dtype(dtype),
            nccl_op(op),
            self.raw,
            stream.raw() as *mut c_void,
        );
        check(a, "ncclAllReduce", r, Some(self.raw))
    }

    /// Enqueues `ncclReduce` to `root`.
    ///
    /// # Safety
    /// As [`all_reduce`](Self::all_reduce).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn reduce(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DType,
        op: ReduceOp,
        root: usize,
        stream: &Stream,
    ) -> Result<()> {
        let a = self.usable("ncclReduce")?;
        let r = (a.reduce)(
            ptr(send),
            ptr(recv),
            count,
            nccl_dtype(dtype),
            nccl_op(op),
            root as c_int,
            self.raw,
            stream.raw() as *mut c_void,
        );
        check(a, "ncclReduce", r, Some(self.raw))
    }

    /// Enqueues `ncclBroadcast` from `root`.
    ///
    /// # Safety
    /// As [`all_reduce`](Self::all_reduce).
    pub unsafe fn broadcast(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DType,
        root: usize,
        stream: &Stream,
    ) -> Result<()> {
        let a = self.usable("ncclBroadcast")?;
        let r = (a.broadcast)(
            ptr(send),
            ptr(recv),
            count,
            nccl_dtype(dtype),
            root as c_int,
            self.raw,
            stream.raw() as *mut c_void,
        );
        check(a, "ncclBroadcast", r, Some(self.raw))
    }

    /// Whether this NCCL has symmetric memory windows (2.27 and later).
    pub fn has_symmetric_memory() -> bool {
        api().is_ok_and(|a| a.symmetric.is_some())
    }

    /// Whether this NCCL all-gathers into symmetric windows on the copy
    /// engines under its zero-CTA policy (2.28 and later, with symmetric
    /// memory).
    pub fn has_copy_engine_gathers() -> bool {
        Self::has_symmetric_memory()
            && version().is_ok_and(|(v, _)| v >= COPY_ENGINE_GATHERS_VERSION)
    }

    /// `bytes` of device memory from NCCL's allocator (`ncclMemAlloc`:
    /// CUDA virtual memory), registered with this communicator as a
    /// symmetric window (`ncclCommWindowRegister`), so that a communicator
    /// under NCCL's zero-CTA policy ([`split_zero_cta`](Self::split_zero_cta))
    /// can all-gather into it with the copy engines. Collective: every rank calls it at the same
    /// point with the same `bytes`, and buffers meant to meet in one
    /// collective must come from the same call on every rank.
    pub fn symmetric_alloc(&self, bytes: usize) -> Result<SymmetricMemory> {
        let a = self.usable("ncclCommWindowRegister")?;
        let s = a.symmetric.as_ref().ok_or_else(|| {
            CudaError::Unavailable(format!(
                "NCCL at {} has no symmetric memory (ncclMemAlloc, ncclCommWindowRegister: \
                 NCCL 2.27 or later)",
                a.path
            ))
        })?;
        self.device.bind()?;
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid out pointer; the size is the caller's.
        check(
            a,
            "ncclMemAlloc",
            unsafe { (s.mem_alloc)(&mut p, bytes) },
            None,
        )?;
        let mut win: *mut c_void = std::ptr::null_mut();
        // SAFETY: `p` holds `bytes` bytes of NCCL's allocation on this
        // communicator's device; valid out pointer.
        let r = unsafe { (s.window_register)(self.raw, p, bytes, &mut win, WIN_COLL_SYMMETRIC) };
        if let Err(e) = check(a, "ncclCommWindowRegister", r, Some(self.raw)) {
            // SAFETY: allocated above, registered nowhere.
            unsafe { (s.mem_free)(p) };
            return Err(e);
        }
        Ok(SymmetricMemory {
            comm: self.raw,
            alive: self.alive.clone(),
            win,
            ptr: p as usize as u64,
        })
    }

    /// Enqueues `ncclAllGather` (`count` elements from each rank).
    ///
    /// # Safety
    /// `send` holds `count` elements, `recv` `count * size`.
    pub unsafe fn all_gather(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DType,
        stream: &Stream,
    ) -> Result<()> {
        let a = self.usable("ncclAllGather")?;
        let r = (a.all_gather)(
            ptr(send),
            ptr(recv),
            count,
            nccl_dtype(dtype),
            self.raw,
            stream.raw() as *mut c_void,
        );
        check(a, "ncclAllGather", r, Some(self.raw))
    }

    /// Enqueues `ncclReduceScatter` (`count` elements to each rank).
    ///
    /// # Safety
    /// `send` holds `count * size` elements, `recv` `count`.
    pub unsafe fn reduce_scatter(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DType,
        op: ReduceOp,
        stream: &Stream,
    ) -> Result<()> {
        let a = self.usable("ncclReduceScatter")?;
        let r = (a.reduce_scatter)(
            ptr(send),
            ptr(recv),
            count,
            nccl_dtype(dtype),
            nccl_op(op),
            self.raw,
            stream.raw() as *mut c_void,
        );
        check(a, "ncclReduceScatter", r, Some(self.raw))
    }

    /// Enqueues `ncclSend` to `peer`.
    ///
    /// # Safety
    /// `send` holds `count` elements.
    pub unsafe fn send(
        &self,
        send: u64,
        count: usize,
        dtype: DType,
        peer: usize,
        stream: &Stream,
    ) -> Result<()> {
        let a = self.usable("ncclSend")?;
        let r = (a.send)(
            ptr(send),
            count,
            nccl_dtype(dtype),
            peer as c_int,
            self.raw,
            stream.raw() as *mut c_void,
        );
        check(a, "ncclSend", r, Some(self.raw))
    }

    /// Enqueues `ncclRecv` from `peer`.
    ///
    /// # Safety
    /// `recv` holds `count` elements.
    pub unsafe fn recv(
        &self,
        recv: u64,
        count: usize,
        dtype: DType,
        peer: usize,
        stream: &Stream,
    ) -> Result<()> {
        let a = self.usable("ncclRecv")?;
        let r = (a.recv)(
            ptr(recv),
            count,
            nccl_dtype(dtype),
            peer as c_int,
            self.raw,
            stream.raw() as *mut c_void,
        );
        check(a, "ncclRecv", r, Some(self.raw))
    }
}

/// Device memory from NCCL's allocator registered as a symmetric window
/// of a communicator ([`NcclComm::symmetric_alloc`]). It is not freed on
/// drop: [`release`](Self::release) deregisters and frees it.
pub struct SymmetricMemory {
    comm: Comm,
    alive: Arc<AtomicBool>,
    win: *mut c_void,
    ptr: u64,
}

// SAFETY: plain device memory and handles; `release` is the only call
// into NCCL, made by the one owner.
unsafe impl Send for SymmetricMemory {}

impl SymmetricMemory {
    /// The device address of its first byte.
    pub fn dptr(&self) -> u64 {
        self.ptr
    }

    /// Deregisters the window (while the communicator lives) and frees
    /// the memory.
    ///
    /// # Safety
    /// No work that uses the memory may still be pending on any stream,
    /// and no NCCL call may run on the communicator concurrently.
    pub unsafe fn release(self) {
        let Ok(a) = api() else { return };
        let Some(s) = a.symmetric.as_ref() else {
            return;
        };
        if self.alive.load(Ordering::SeqCst) {
            (s.window_deregister)(self.comm, self.win);
        }
        (s.mem_free)(ptr(self.ptr));
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        self.alive.store(false, Ordering::SeqCst);
        if self.aborted {
            return;
        }
        if let Ok(a) = api() {
            let _ = self.device.bind();
            // SAFETY: valid communicator, destroyed once.
            unsafe { (a.comm_destroy)(self.raw) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_config_is_laid_out_as_nccl_h_declares_it() {
        // nccl.h 2.28, on a 64-bit target: CTAPolicy at byte 60 of 80.
        assert_eq!(std::mem::size_of::<Config>(), 80);
        assert_eq!(std::mem::offset_of!(Config, net_name), 32);
        assert_eq!(std::mem::offset_of!(Config, cta_policy), 60);
        let c = Config::with_cta_policy(CTA_POLICY_ZERO);
        assert_eq!((c.size, c.magic, c.cta_policy), (80, 0xcafe_beef, 2));
        assert_eq!(c.blocking, i32::MIN);
    }

    #[test]
    fn unique_ids_round_trip_through_bytes() {
        let mut id = UniqueId { internal: [0; 128] };
        for (i, c) in id.internal.iter_mut().enumerate() {
            *c = (i as u8).wrapping_mul(37) as c_char;
        }
        let back = UniqueId::from_bytes(&id.to_bytes()).unwrap();
        assert_eq!(back.to_bytes(), id.to_bytes());
        assert!(UniqueId::from_bytes(&[0; 127]).is_err());
    }

    #[test]
    fn every_dtype_and_op_has_its_own_nccl_code() {
        let mut d: Vec<c_int> = DType::ALL.iter().map(|&t| nccl_dtype(t)).collect();
        d.sort();
        d.dedup();
        assert_eq!(d.len(), DType::ALL.len());
        let mut o: Vec<c_int> = ReduceOp::ALL.iter().map(|&r| nccl_op(r)).collect();
        o.sort();
        o.dedup();
        assert_eq!(o, vec![0, 1, 2, 3, 4]);
    }
}
