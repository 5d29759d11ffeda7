//! CUDA C kernels compiled at run time by NVRTC (loaded dynamically, like
//! the driver), cached on disk, and loaded as modules.
//!
//! [`compile_ptx`] turns a source into PTX for a virtual architecture
//! (`compute_90`, ...), reusing an earlier result from the cache directory
//! when the source, options and NVRTC version are the same:
//! `BRAID_KERNEL_CACHE`, else `$XDG_CACHE_HOME/braid/kernels`, else
//! `~/.cache/braid/kernels` (an unwritable cache only costs recompiling).
//! [`Module`] loads PTX on a device; [`Function::launch`] runs a kernel.

use crate::driver::{Device, Stream};
use crate::error::{driver, CudaError, Result};
use cudarc::driver::{result as dresult, sys as dsys};
use cudarc::nvrtc::{result as nresult, sys as nsys};
use std::ffi::{c_void, CString};
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

/// NVRTC's version, or why it cannot be used.
pub fn version() -> Result<(i32, i32)> {
    static V: OnceLock<std::result::Result<(i32, i32), String>> = OnceLock::new();
    V.get_or_init(|| {
        // SAFETY: only probes whether the library can be opened.
        if !unsafe { nsys::is_culib_present() } {
            return Err(
                "the NVRTC library (libnvrtc.so.13) was not found; it ships with the CUDA toolkit \
                 or the nvidia-cuda-nvrtc wheel (put its lib directory on LD_LIBRARY_PATH)"
                    .into(),
            );
        }
        let (mut major, mut minor) = (0, 0);
        // SAFETY: valid out pointers.
        unsafe { nsys::nvrtcVersion(&mut major, &mut minor) }
            .result()
            .map_err(|e| format!("nvrtcVersion failed: {e:?}"))?;
        Ok((major, minor))
    })
    .clone()
    .map_err(CudaError::Unavailable)
}

/// The virtual architecture for `device`, e.g. `compute_90`.
pub fn arch_of(device: &Device) -> Result<String> {
    let (major, minor) = device.compute_capability()?;
    Ok(format!("compute_{major}{minor}"))
}

fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for &b in *p {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        // Separate the parts so ("ab", "c") and ("a", "bc") differ.
        h ^= 0xff;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// Where compiled kernels are cached.
pub fn cache_dir() -> Option<PathBuf> {
    if let Ok(d) = std::env::var(braid_core::env::BRAID_KERNEL_CACHE) {
        return (!d.is_empty()).then(|| PathBuf::from(d));
    }
    if let Ok(d) = std::env::var(braid_core::env::XDG_CACHE_HOME) {
        return Some(PathBuf::from(d).join("braid/kernels"));
    }
    std::env::var(braid_core::env::HOME)
        .ok()
        .map(|h| PathBuf::from(h).join(".cache/braid/kernels"))
}

/// Options every braid kernel is compiled with (besides the architecture).
pub const OPTIONS: [&str; 3] = ["--std=c++17", "-default-device", "--fmad=true"];

/// Compiles `src` (named `name` in messages) to PTX for `arch`, through
/// the disk cache. Errors carry NVRTC's log.
pub fn compile_ptx(name: &str, src: &str, arch: &str) -> Result<String> {
    let (major, minor) = version()?;
    let ver = format!("{major}.{minor}");
    let opts: Vec<String> = OPTIONS
        .iter()
        .map(|s| s.to_string())
        .chain([format!("--gpu-architecture={arch}")])
        .collect();
    let key = fnv1a(&[src.as_bytes(), opts.join(" ").as_bytes(), ver.as_bytes()]);
    let file = cache_dir().map(|d| d.join(format!("{name}-{arch}-{key:016x}.ptx")));
    if let Some(f) = &file {
        if let Ok(ptx) = std::fs::read_to_string(f) {
            if ptx.contains(".entry") {
                return Ok(ptx);
            }
        }
    }
    let ptx = compile_uncached(name, src, &opts)?;
    if let Some(f) = &file {
        // Best effort: write atomically, ignore a read-only cache.
        if let Some(dir) = f.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        let tmp = f.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::write(&tmp, &ptx).is_ok() {
            let _ = std::fs::rename(&tmp, f);
        }
    }
    Ok(ptx)
}

fn compile_uncached(name: &str, src: &str, opts: &[String]) -> Result<String> {
    let c_src = CString::new(src)
        .map_err(|_| CudaError::Invalid(format!("{name}: source holds a NUL byte")))?;
    let c_name = CString::new(format!("{name}.cu")).expect("no NUL in names");
    let nvrtc_err = |call: &'static str| {
        move |e: nresult::NvrtcError| CudaError::Driver {
            call,
            name: format!("{:?}", e.0),
            text: String::new(),
        }
    };
    let prog =
        nresult::create_program(&c_src, Some(&c_name)).map_err(nvrtc_err("nvrtcCreateProgram"))?;
    // SAFETY: `prog` is live until destroyed below; options are valid C strings.
    let compiled = unsafe { nresult::compile_program(prog, opts) };
    let log = || {
        // SAFETY: `prog` is live.
        unsafe { nresult::get_program_log(prog) }
            .map(|l| {
                let bytes: Vec<u8> = l.iter().map(|&c| c as u8).take_while(|&b| b != 0).collect();
                String::from_utf8_lossy(&bytes).into_owned()
            })
            .unwrap_or_default()
    };
    let result = match compiled {
        Err(_) => Err(CudaError::Invalid(format!(
            "kernel source {name}.cu does not compile:\n{}",
            log()
        ))),
        // SAFETY: compiled successfully; `prog` is live.
        Ok(()) => unsafe { nresult::get_ptx(prog) }
            .map(|p| {
                let bytes: Vec<u8> = p.iter().map(|&c| c as u8).take_while(|&b| b != 0).collect();
                String::from_utf8_lossy(&bytes).into_owned()
            })
            .map_err(nvrtc_err("nvrtcGetPTX")),
    };
    // SAFETY: destroyed once.
    let _ = unsafe { nresult::destroy_program(prog) };
    result
}

/// Compiles each `(name, CUDA C)` source to PTX for `arch` (no GPU
/// needed): each source's name and PTX size.
pub fn compile_sources(sources: &[(&str, &str)], arch: &str) -> Result<Vec<(String, usize)>> {
    sources
        .iter()
        .map(|(name, src)| compile_ptx(name, src, arch).map(|ptx| (name.to_string(), ptx.len())))
        .collect()
}

/// A loaded module of kernels on one device.
pub struct Module {
    loaded: Arc<Loaded>,
}

/// The driver's handle of a loaded module, unloaded when the last
/// [`Module`] or [`Function`] that shares it is dropped.
struct Loaded {
    raw: dsys::CUmodule,
    device: Device,
}

// SAFETY: module handles are usable from any thread with the context bound.
unsafe impl Send for Loaded {}
// SAFETY: as above.
unsafe impl Sync for Loaded {}

impl Drop for Loaded {
    fn drop(&mut self) {
        if self.device.bind().is_ok() {
            // SAFETY: we loaded the module, and no Function of it is left
            // (each holds this Arc).
            let _ = unsafe { dresult::module::unload(self.raw) };
        }
    }
}

impl Module {
    /// Loads PTX on `device` (the driver JIT-compiles it for the GPU).
    pub fn load(device: &Device, ptx: &str) -> Result<Module> {
        device.bind()?;
        let c = CString::new(ptx).map_err(|_| CudaError::Invalid("PTX holds a NUL byte".into()))?;
        // SAFETY: a NUL-terminated PTX image.
        let raw = unsafe { dresult::module::load_data(c.as_ptr() as *const c_void) }
            .map_err(driver("cuModuleLoadData"))?;
        Ok(Module {
            loaded: Arc::new(Loaded {
                raw,
                device: device.clone(),
            }),
        })
    }

    /// Compiles (through the cache) and loads `src` for `device`.
    pub fn compile(device: &Device, name: &str, src: &str) -> Result<Module> {
        Self::compile_for(device, name, src, &arch_of(device)?)
    }

    /// [`compile`](Self::compile) for the virtual architecture `arch`
    /// (e.g. `compute_90a`, whose PTX runs only on that exact GPU family
    /// and may use its own instructions).
    pub fn compile_for(device: &Device, name: &str, src: &str, arch: &str) -> Result<Module> {
        let ptx = compile_ptx(name, src, arch)?;
        Self::load(device, &ptx)
    }

    /// The kernel `name` (an `extern "C"` function). It keeps the module
    /// loaded for as long as it lives, so the module itself may be dropped.
    pub fn function(&self, name: &str) -> Result<Function> {
        self.loaded.device.bind()?;
        let c = CString::new(name).expect("no NUL in kernel names");
        // SAFETY: valid module; the function's handle stays valid while
        // the module is loaded, which the Function's Arc guarantees.
        let raw = unsafe { dresult::module::get_function(self.loaded.raw, c) }.map_err(|e| {
            let mut err = driver("cuModuleGetFunction")(e);
            if let CudaError::Driver { text, .. } = &mut err {
                text.push_str(&format!("; kernel {name:?}"));
            }
            err
        })?;
        Ok(Function {
            raw,
            device: self.loaded.device.clone(),
            _module: self.loaded.clone(),
        })
    }
}

/// One kernel of a [`Module`]; it keeps its module loaded.
#[derive(Clone)]
pub struct Function {
    raw: dsys::CUfunction,
    device: Device,
    _module: Arc<Loaded>,
}

// SAFETY: function handles are usable from any thread with the context bound.
unsafe impl Send for Function {}
// SAFETY: as above.
unsafe impl Sync for Function {}

/// One kernel argument, by value (the kernel's C parameter types:
/// pointers as device addresses, `int`, `long`, `float`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KernelArg {
    /// A device address.
    Ptr(u64),
    /// An `int`.
    I32(i32),
    /// A `long` (64-bit).
    I64(i64),
    /// A `float`.
    F32(f32),
}

impl Function {
    /// Lets launches of this kernel use up to `bytes` of dynamic shared
    /// memory (above the default 48 KiB, up to what the GPU has per block).
    pub fn set_max_dynamic_shared(&self, bytes: usize) -> Result<()> {
        self.device.bind()?;
        let value = i32::try_from(bytes)
            .map_err(|_| CudaError::Invalid(format!("{bytes} bytes of shared memory")))?;
        // SAFETY: a valid function handle of the bound context; the
        // attribute takes an int.
        unsafe {
            dresult::function::set_function_attribute(
                self.raw,
                dsys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                value,
            )
        }
        .map_err(driver("cuFuncSetAttribute"))
    }

    /// How many blocks of `threads` threads (and `dynamic_shared` bytes of
    /// dynamic shared memory) one multiprocessor runs at once: what its
    /// registers, shared memory and thread slots allow.
    pub fn max_active_blocks(&self, threads: u32, dynamic_shared: usize) -> Result<usize> {
        self.device.bind()?;
        let mut blocks: std::ffi::c_int = 0;
        // SAFETY: a valid function handle of the bound context and an
        // out-pointer to a live int.
        unsafe {
            dsys::cuOccupancyMaxActiveBlocksPerMultiprocessor(
                &mut blocks,
                self.raw,
                threads as std::ffi::c_int,
                dynamic_shared,
            )
            .result()
        }
        .map_err(driver("cuOccupancyMaxActiveBlocksPerMultiprocessor"))?;
        Ok(blocks.max(1) as usize)
    }

    /// Queues the kernel on `stream` with `args` in order.
    ///
    /// # Safety
    /// `args` must match the kernel's parameters in number and type, and
    /// every device address among them must address memory the kernel may
    /// touch, valid until it has run.
    pub unsafe fn launch_args(
        &self,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        shared: u32,
        stream: &Stream,
        args: &mut [KernelArg],
    ) -> Result<()> {
        let mut ptrs: Vec<*mut c_void> = args
            .iter_mut()
            .map(|a| match a {
                KernelArg::Ptr(x) => x as *mut u64 as *mut c_void,
                KernelArg::I32(x) => x as *mut i32 as *mut c_void,
                KernelArg::I64(x) => x as *mut i64 as *mut c_void,
                KernelArg::F32(x) => x as *mut f32 as *mut c_void,
            })
            .collect();
        // SAFETY: the pointers address `args`' values, alive for the call
        // (cuLaunchKernel copies them); the caller vouches for the rest.
        unsafe { self.launch(grid, block, shared, stream, &mut ptrs) }
    }

    /// Queues the kernel on `stream`.
    ///
    /// # Safety
    /// `args` must point at values matching the kernel's parameters, and
    /// every device address among them must stay valid until it has run.
    pub unsafe fn launch(
        &self,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        shared: u32,
        stream: &Stream,
        args: &mut [*mut c_void],
    ) -> Result<()> {
        self.device.bind()?;
        dresult::launch_kernel(self.raw, grid, block, shared, stream.raw(), args)
            .map_err(driver("cuLaunchKernel"))
    }

    /// Queues the kernel on `stream` allowed to start before the kernel
    /// ahead of it has finished (programmatic dependent launch, Hopper and
    /// later): its blocks may be scheduled once every block of that kernel
    /// has released its dependents (`griddepcontrol.launch_dependents`) or
    /// exited, and must pass `griddepcontrol.wait` — which returns when
    /// that kernel has finished and its writes are visible — before they
    /// read anything it wrote or write anything it reads. After work that
    /// is not such a kernel (a copy, an event, a library's kernel that
    /// never releases early) it runs as [`launch`](Self::launch) would.
    ///
    /// # Safety
    /// As [`launch`](Self::launch), and the kernel must wait as above
    /// before touching memory the work ahead of it in the stream touches
    /// (other than memory nobody writes, such as weights).
    pub unsafe fn launch_overlapping(
        &self,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        shared: u32,
        stream: &Stream,
        args: &mut [*mut c_void],
    ) -> Result<()> {
        self.device.bind()?;
        // SAFETY: a zeroed union is a valid value of the attribute's
        // payload; the one field the attribute reads is set below.
        let mut value: dsys::CUlaunchAttributeValue = unsafe { std::mem::zeroed() };
        value.programmaticStreamSerializationAllowed = 1;
        let mut attr = dsys::CUlaunchAttribute {
            id: dsys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value,
        };
        let config = dsys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block.0,
            blockDimY: block.1,
            blockDimZ: block.2,
            sharedMemBytes: shared,
            hStream: stream.raw(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        // SAFETY: config and its one attribute live through the call (the
        // driver copies them); the function handle is of the bound
        // context; the caller vouches for the arguments and the kernel's
        // waiting.
        unsafe {
            dsys::cuLaunchKernelEx(&config, self.raw, args.as_mut_ptr(), std::ptr::null_mut())
        }
        .result()
        .map_err(driver("cuLaunchKernelEx"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_keys_separate_their_parts() {
        assert_ne!(fnv1a(&[b"ab", b"c"]), fnv1a(&[b"a", b"bc"]));
        assert_eq!(fnv1a(&[b"x"]), fnv1a(&[b"x"]));
    }
}
