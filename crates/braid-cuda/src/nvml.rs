//! A thin binding of NVML (`libnvidia-ml.so.1`), opened at run time.
//!
//! Only the calls braid uses are bound. Every call's status is checked and
//! turned into an error carrying NVML's own description.

use libloading::{Library, Symbol};
use std::ffi::{c_char, c_uint, c_ulong, CStr};

/// Why NVML could not be used.
#[derive(Debug, Clone)]
pub struct NvmlError(pub String);

impl std::fmt::Display for NvmlError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for NvmlError {}

/// NVML's opaque device handle.
#[derive(Debug, Clone, Copy)]
#[repr(transparent)]
pub struct Device(*mut std::ffi::c_void);

/// `nvmlPciInfo_t` (version 3 of the call).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct PciInfo {
    bus_id_legacy: [c_char; 16],
    /// PCI domain.
    pub domain: c_uint,
    /// PCI bus.
    pub bus: c_uint,
    /// PCI device.
    pub device: c_uint,
    /// Device and vendor id.
    pub pci_device_id: c_uint,
    /// Subsystem id.
    pub pci_sub_system_id: c_uint,
    bus_id: [c_char; 32],
}

impl PciInfo {
    fn zeroed() -> PciInfo {
        PciInfo {
            bus_id_legacy: [0; 16],
            domain: 0,
            bus: 0,
            device: 0,
            pci_device_id: 0,
            pci_sub_system_id: 0,
            bus_id: [0; 32],
        }
    }

    /// The bus id as NVML prints it, e.g. `00000000:18:00.0`.
    pub fn bus_id(&self) -> String {
        let bytes: Vec<u8> = self
            .bus_id
            .iter()
            .take_while(|c| **c != 0)
            .map(|c| *c as u8)
            .collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

#[repr(C)]
struct Memory {
    total: u64,
    free: u64,
    used: u64,
}

/// NVML's topology levels (`nvmlGpuTopologyLevel_t`), as `nvidia-smi topo
/// -m` names them.
pub fn topology_level_name(level: c_uint) -> &'static str {
    match level {
        0 => "INT",
        10 => "PIX",
        20 => "PXB",
        30 => "PHB",
        40 => "NODE",
        50 => "SYS",
        _ => "?",
    }
}

/// Most NVLink links a device can have.
pub const MAX_NVLINKS: c_uint = 18;

/// An initialised NVML library.
pub struct Nvml {
    lib: Library,
}

/// Library names tried, in order.
const NAMES: [&str; 2] = ["libnvidia-ml.so.1", "libnvidia-ml.so"];

impl Nvml {
    /// Opens and initialises NVML.
    pub fn open() -> Result<Nvml, NvmlError> {
        let mut last = String::new();
        for name in NAMES {
            // SAFETY: loading NVML runs only its library constructors, which
            // have no preconditions.
            match unsafe { Library::new(name) } {
                Ok(lib) => {
                    let nvml = Nvml { lib };
                    nvml.check("nvmlInit_v2", {
                        let f: Symbol<unsafe extern "C" fn() -> c_uint> =
                            nvml.sym("nvmlInit_v2")?;
                        // SAFETY: nvmlInit_v2 takes no arguments.
                        unsafe { f() }
                    })?;
                    return Ok(nvml);
                }
                Err(e) => last = e.to_string(),
            }
        }
        Err(NvmlError(format!(
            "NVML could not be loaded ({last}): no NVIDIA driver on this machine, so no GPU is usable here"
        )))
    }

    fn sym<T>(&self, name: &str) -> Result<Symbol<'_, T>, NvmlError> {
        // SAFETY: every symbol is looked up with the C signature NVML's
        // header declares for it (see the call sites).
        unsafe { self.lib.get(name.as_bytes()) }
            .map_err(|e| NvmlError(format!("this NVML lacks {name}: {e} (driver too old?)")))
    }

    fn check(&self, call: &str, status: c_uint) -> Result<(), NvmlError> {
        if status == 0 {
            return Ok(());
        }
        let text = self
            .sym::<unsafe extern "C" fn(c_uint) -> *const c_char>("nvmlErrorString")
            .ok()
            .map(|f| {
                // SAFETY: nvmlErrorString returns a static NUL-terminated string.
                unsafe { CStr::from_ptr(f(status)) }
                    .to_string_lossy()
                    .into_owned()
            })
            .unwrap_or_default();
        Err(NvmlError(format!(
            "{call} failed: {text} (NVML status {status})"
        )))
    }

    /// Number of GPUs.
    pub fn device_count(&self) -> Result<u32, NvmlError> {
        let f: Symbol<unsafe extern "C" fn(*mut c_uint) -> c_uint> =
            self.sym("nvmlDeviceGetCount_v2")?;
        let mut n = 0;
        // SAFETY: `n` is a valid out-pointer.
        self.check("nvmlDeviceGetCount_v2", unsafe { f(&mut n) })?;
        Ok(n)
    }

    /// Handle of GPU `index`.
    pub fn device(&self, index: u32) -> Result<Device, NvmlError> {
        let f: Symbol<unsafe extern "C" fn(c_uint, *mut Device) -> c_uint> =
            self.sym("nvmlDeviceGetHandleByIndex_v2")?;
        let mut d = Device(std::ptr::null_mut());
        // SAFETY: `d` is a valid out-pointer.
        self.check("nvmlDeviceGetHandleByIndex_v2", unsafe { f(index, &mut d) })?;
        Ok(d)
    }

    /// Product name.
    pub fn name(&self, d: Device) -> Result<String, NvmlError> {
        let f: Symbol<unsafe extern "C" fn(Device, *mut c_char, c_uint) -> c_uint> =
            self.sym("nvmlDeviceGetName")?;
        let mut buf = [0 as c_char; 96];
        // SAFETY: the buffer's real length is passed.
        self.check("nvmlDeviceGetName", unsafe {
            f(d, buf.as_mut_ptr(), buf.len() as c_uint)
        })?;
        // SAFETY: NVML NUL-terminates within the given length.
        Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }
            .to_string_lossy()
            .into_owned())
    }

    /// Total memory in bytes.
    pub fn memory_total(&self, d: Device) -> Result<u64, NvmlError> {
        let f: Symbol<unsafe extern "C" fn(Device, *mut Memory) -> c_uint> =
            self.sym("nvmlDeviceGetMemoryInfo")?;
        let mut m = Memory {
            total: 0,
            free: 0,
            used: 0,
        };
        // SAFETY: `m` is a valid out-pointer of the v1 layout.
        self.check("nvmlDeviceGetMemoryInfo", unsafe { f(d, &mut m) })?;
        Ok(m.total)
    }

    /// PCI information.
    pub fn pci(&self, d: Device) -> Result<PciInfo, NvmlError> {
        let f: Symbol<unsafe extern "C" fn(Device, *mut PciInfo) -> c_uint> =
            self.sym("nvmlDeviceGetPciInfo_v3")?;
        let mut p = PciInfo::zeroed();
        // SAFETY: `p` is a valid out-pointer of the v3 layout.
        self.check("nvmlDeviceGetPciInfo_v3", unsafe { f(d, &mut p) })?;
        Ok(p)
    }

    /// PCI bus ids of the peers at the other end of each active NVLink.
    pub fn nvlink_peers(&self, d: Device) -> Vec<String> {
        let (Ok(state), Ok(remote)) = (
            self.sym::<unsafe extern "C" fn(Device, c_uint, *mut c_uint) -> c_uint>(
                "nvmlDeviceGetNvLinkState",
            ),
            self.sym::<unsafe extern "C" fn(Device, c_uint, *mut PciInfo) -> c_uint>(
                "nvmlDeviceGetNvLinkRemotePciInfo_v2",
            ),
        ) else {
            return Vec::new();
        };
        let mut peers = Vec::new();
        for link in 0..MAX_NVLINKS {
            let mut active = 0;
            // SAFETY: valid out-pointer; unsupported links return an error.
            if unsafe { state(d, link, &mut active) } != 0 || active == 0 {
                continue;
            }
            let mut p = PciInfo::zeroed();
            // SAFETY: valid out-pointer of the v3 layout.
            if unsafe { remote(d, link, &mut p) } == 0 {
                peers.push(p.bus_id());
            }
        }
        peers
    }

    /// Whether `a` can reach `b`'s memory over NVLink
    /// (`nvmlDeviceGetP2PStatus` with the NVLink capability).
    pub fn p2p_over_nvlink(&self, a: Device, b: Device) -> bool {
        const NVLINK_CAPS_INDEX: c_uint = 3;
        let Ok(f) = self
            .sym::<unsafe extern "C" fn(Device, Device, c_uint, *mut c_uint) -> c_uint>(
                "nvmlDeviceGetP2PStatus",
            )
        else {
            return false;
        };
        let mut status = 1;
        // SAFETY: valid out-pointer; status 0 means NVML_P2P_STATUS_OK.
        let ret = unsafe { f(a, b, NVLINK_CAPS_INDEX, &mut status) };
        ret == 0 && status == 0
    }

    /// The closest common PCIe ancestor of two GPUs (NVML topology level).
    pub fn common_ancestor(&self, a: Device, b: Device) -> Result<c_uint, NvmlError> {
        let f: Symbol<unsafe extern "C" fn(Device, Device, *mut c_uint) -> c_uint> =
            self.sym("nvmlDeviceGetTopologyCommonAncestor")?;
        let mut level = 0;
        // SAFETY: valid out-pointer.
        self.check("nvmlDeviceGetTopologyCommonAncestor", unsafe {
            f(a, b, &mut level)
        })?;
        Ok(level)
    }

    /// CPUs ideal for this GPU (bitmask words, 64 CPUs each).
    pub fn cpu_affinity(&self, d: Device) -> Result<Vec<u64>, NvmlError> {
        let f: Symbol<unsafe extern "C" fn(Device, c_uint, *mut c_ulong) -> c_uint> =
            self.sym("nvmlDeviceGetCpuAffinity")?;
        let mut words = vec![0 as c_ulong; 16];
        // SAFETY: the buffer holds the number of words passed.
        self.check("nvmlDeviceGetCpuAffinity", unsafe {
            f(d, words.len() as c_uint, words.as_mut_ptr())
        })?;
        // c_ulong is u64 on 64-bit Linux but not on every target.
        #[allow(clippy::useless_conversion)]
        Ok(words.into_iter().map(u64::from).collect())
    }
}

impl Drop for Nvml {
    fn drop(&mut self) {
        if let Ok(f) = self.sym::<unsafe extern "C" fn() -> c_uint>("nvmlShutdown") {
            // SAFETY: balances the nvmlInit_v2 of `open`.
            unsafe {
                f();
            }
        }
    }
}
