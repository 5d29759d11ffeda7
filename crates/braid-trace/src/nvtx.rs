//! NVTX ranges for Nsight Systems and Nsight Compute, with no build-time
//! CUDA and no NVTX library to link: braid speaks NVTX's injection
//! protocol itself. A tool that profiles a process (`nsys profile`,
//! `ncu --nvtx`) names its injection library in `NVTX_INJECTION64_PATH`;
//! [`init`] loads it, calls its `InitializeInjectionNvtx2` with braid's
//! export table, and the tool writes the functions it implements into
//! braid's function slots. [`range`] then pushes a named range and pops
//! it when the guard drops, on the calling thread.
//!
//! Off — no tool attached, or nobody asked ([`init`] not called with
//! `want`) — a range costs one atomic load and names nothing.
//!
//! The protocol (NVTX v3, as the tools implement it): the export table
//! function answers id 1 with the callbacks table (its size, then a
//! function that hands out each module's function table) and id 3 with
//! the version table (its size, the NVTX version 3, a reserved word, a
//! function the tool may call). A module's function table is an array of
//! pointers to function slots: entry 0 and the entry after the last unused
//! (null), the callback ids numbering the rest (the core module's: 9
//! `nvtxRangePushA`, 11 `nvtxRangePop`). Tables are handed out for every
//! module the tools know, so that a tool finds each where it looks; braid
//! calls only the core module's push and pop.

use std::ffi::{c_char, c_int, c_uint, c_void, CString};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::OnceLock;

/// Slots per module (the callback ids' count, id 0 unused), indexed by
/// module: none, core, CUDA driver, OpenCL, CUDA runtime, core 2 (domains),
/// synchronization.
const MODULE_SLOTS: [usize; 7] = [0, 16, 9, 15, 7, 16, 7];
/// The most slots of a module, and its table's length (a null after).
const MOST: usize = 16;

/// The core module and its callback ids braid calls.
const CORE: usize = 1;
const RANGE_PUSH_A: usize = 9;
const RANGE_POP: usize = 11;

/// The function slots the tool fills, per module (a slot holds a function
/// pointer, or 0).
static SLOTS: [[AtomicUsize; MOST]; 7] = [const { [const { AtomicUsize::new(0) }; MOST] }; 7];

/// Per module, the table handed to the tool: the slots' addresses (entry
/// 0 and the entry after the last 0), filled once by [`tables`].
static TABLES: OnceLock<[[usize; MOST + 1]; 7]> = OnceLock::new();

static ON: AtomicBool = AtomicBool::new(false);

/// The library the tool named, kept loaded for the process's life.
static LIBRARY: OnceLock<libloading::Library> = OnceLock::new();

fn tables() -> &'static [[usize; MOST + 1]; 7] {
    TABLES.get_or_init(|| {
        let mut t = [[0usize; MOST + 1]; 7];
        for (m, slots) in MODULE_SLOTS.iter().enumerate() {
            for id in 1..*slots {
                t[m][id] = &SLOTS[m][id] as *const AtomicUsize as usize;
            }
        }
        t
    })
}

/// The callbacks export table (NVTX's `NvtxExportTableCallbacks`).
#[repr(C)]
struct Callbacks {
    struct_size: usize,
    get_module_function_table:
        unsafe extern "C" fn(module: c_int, table: *mut *const usize, size: *mut c_uint) -> c_int,
}

/// The version export table (NVTX's `NvtxExportTableVersionInfo`).
#[repr(C)]
struct VersionInfo {
    struct_size: usize,
    version: u32,
    reserved0: u32,
    set_injection_nvtx_version: unsafe extern "C" fn(version: u32),
}

static CALLBACKS: Callbacks = Callbacks {
    struct_size: std::mem::size_of::<Callbacks>(),
    get_module_function_table,
};

static VERSION_INFO: VersionInfo = VersionInfo {
    struct_size: std::mem::size_of::<VersionInfo>(),
    version: 3,
    reserved0: 0,
    set_injection_nvtx_version,
};

/// Hands the tool module `module`'s table and its slot count.
///
/// # Safety
/// Called by the tool with writable `table` and `size`, or null ones.
unsafe extern "C" fn get_module_function_table(
    module: c_int,
    table: *mut *const usize,
    size: *mut c_uint,
) -> c_int {
    let Some(&slots) = usize::try_from(module)
        .ok()
        .filter(|&m| m > 0)
        .and_then(|m| MODULE_SLOTS.get(m))
    else {
        return 0;
    };
    let m = module as usize;
    if !size.is_null() {
        // SAFETY: the tool passes a valid pointer or null (checked).
        unsafe { *size = slots as c_uint };
    }
    if !table.is_null() {
        // SAFETY: as above; the table is static and lives forever.
        unsafe { *table = tables()[m].as_ptr() };
    }
    1
}

/// The tool's version, for tools that report it: braid ignores it.
unsafe extern "C" fn set_injection_nvtx_version(_version: u32) {}

/// NVTX's `nvtxGetExportTable`, handed to the tool.
unsafe extern "C" fn get_export_table(id: u32) -> *const c_void {
    match id {
        1 => &CALLBACKS as *const Callbacks as *const c_void,
        3 => &VERSION_INFO as *const VersionInfo as *const c_void,
        _ => std::ptr::null(),
    }
}

type InitializeInjection =
    unsafe extern "C" fn(get_export_table: unsafe extern "C" fn(u32) -> *const c_void) -> c_int;

/// Whether ranges go to a tool.
#[inline]
pub fn on() -> bool {
    ON.load(Ordering::Relaxed)
}

/// With `want` (a trace or `BRAID_NVTX=1` asked for ranges), attaches the
/// tool named by `NVTX_INJECTION64_PATH` once per process: `Ok(true)`
/// when ranges now go to it, `Ok(false)` when there is no tool (the
/// variable unset) or nobody asked. A tool that cannot be loaded or
/// refuses is an error naming the library; ranges stay off.
pub fn init(want: bool) -> Result<bool, String> {
    if !want {
        return Ok(on());
    }
    let Some(path) =
        std::env::var_os(braid_core::env::NVTX_INJECTION64_PATH).filter(|p| !p.is_empty())
    else {
        return Ok(false);
    };
    if LIBRARY.get().is_some() {
        return Ok(on());
    }
    let shown = path.to_string_lossy().into_owned();
    // SAFETY: loading the tool's library runs its initialisers, which is
    // what the tool that set the variable intends.
    let lib = unsafe { libloading::Library::new(&path) }
        .map_err(|e| format!("NVTX: cannot load the tool's injection library {shown}: {e}"))?;
    // SAFETY: NVTX's entry point has this signature (a function taking
    // the export-table function, returning nonzero on success).
    let entry = unsafe { lib.get::<InitializeInjection>(b"InitializeInjectionNvtx2\0") }
        .map_err(|e| format!("NVTX: {shown} has no InitializeInjectionNvtx2: {e}"))?;
    tables();
    // SAFETY: the tool reads the static export tables and writes into the
    // static slots through the pointers they hold, all alive forever.
    if unsafe { entry(get_export_table) } == 0 {
        return Err(format!(
            "NVTX: the tool's injection library {shown} refused to attach \
             (InitializeInjectionNvtx2 returned 0)"
        ));
    }
    let _ = LIBRARY.set(lib);
    let attached = slot(RANGE_PUSH_A) != 0 && slot(RANGE_POP) != 0;
    ON.store(attached, Ordering::Relaxed);
    Ok(attached)
}

fn slot(id: usize) -> usize {
    SLOTS[CORE][id].load(Ordering::Acquire)
}

/// Pushes a range named `name` on this thread (nothing when off). NULs in
/// the name end it there.
pub fn push(name: &str) {
    if !on() {
        return;
    }
    let f = slot(RANGE_PUSH_A);
    if f == 0 {
        return;
    }
    let name = name.split('\0').next().unwrap_or_default();
    let Ok(c) = CString::new(name) else {
        return;
    };
    // SAFETY: the tool wrote `nvtxRangePushA`'s implementation into this
    // slot: a function of a C string returning the nesting depth.
    let push: unsafe extern "C" fn(*const c_char) -> c_int = unsafe { std::mem::transmute(f) };
    // SAFETY: `c` is a NUL-terminated string alive for the call.
    unsafe { push(c.as_ptr()) };
}

/// Pops this thread's innermost range (nothing when off).
pub fn pop() {
    if !on() {
        return;
    }
    let f = slot(RANGE_POP);
    if f == 0 {
        return;
    }
    // SAFETY: the tool wrote `nvtxRangePop`'s implementation here: a
    // function of nothing returning the depth left.
    let pop: unsafe extern "C" fn() -> c_int = unsafe { std::mem::transmute(f) };
    // SAFETY: no arguments; the tool's function is alive (its library is
    // never unloaded).
    unsafe { pop() };
}

/// A range that ends when dropped ([`range`]).
#[must_use = "a range ends when dropped: bind it to a name"]
pub struct Range {
    live: bool,
}

/// Starts a range named `name()` on this thread, popped when the guard
/// drops; `name` is not called when off.
#[inline]
pub fn range(name: impl FnOnce() -> String) -> Range {
    if !on() {
        return Range { live: false };
    }
    push(&name());
    Range { live: true }
}

/// [`range`] for a name known in advance.
#[inline]
pub fn range_str(name: &str) -> Range {
    if !on() {
        return Range { live: false };
    }
    push(name);
    Range { live: true }
}

impl Drop for Range {
    fn drop(&mut self) {
        if self.live {
            pop();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_module_table_points_at_its_slots_between_two_nulls() {
        for (m, &n) in MODULE_SLOTS.iter().enumerate().skip(1) {
            let mut table: *const usize = std::ptr::null();
            let mut size: c_uint = 0;
            // SAFETY: valid out-pointers.
            let ok = unsafe { get_module_function_table(m as c_int, &mut table, &mut size) };
            assert_eq!((ok, size as usize), (1, n), "module {m}");
            // SAFETY: the table has MOST + 1 entries.
            let t = unsafe { std::slice::from_raw_parts(table, MOST + 1) };
            assert_eq!(t[0], 0);
            assert_eq!(t[n], 0, "module {m}: the entry after the last slot");
            for (id, &entry) in t.iter().enumerate().take(n).skip(1) {
                assert_eq!(entry, &SLOTS[m][id] as *const AtomicUsize as usize);
            }
        }
        // SAFETY: null out-pointers are allowed.
        unsafe {
            assert_eq!(
                get_module_function_table(0, std::ptr::null_mut(), std::ptr::null_mut()),
                0
            );
            assert_eq!(
                get_module_function_table(7, std::ptr::null_mut(), std::ptr::null_mut()),
                0
            );
            assert_eq!(
                get_module_function_table(-1, std::ptr::null_mut(), std::ptr::null_mut()),
                0
            );
            assert!(get_export_table(2).is_null());
            let v = &*(get_export_table(3) as *const VersionInfo);
            assert_eq!((v.struct_size, v.version), (24, 3));
            let c = &*(get_export_table(1) as *const Callbacks);
            assert_eq!(c.struct_size, 16);
        }
        // Without a tool nothing is on and ranges are inert.
        assert!(!on());
        let _r = range(|| unreachable!("no name is made when off"));
    }
}
