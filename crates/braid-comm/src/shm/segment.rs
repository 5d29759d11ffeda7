//! The shared-memory segment of one communicator: creation, mapping by every
//! rank, and removal.
//!
//! Rank 0 creates `braid-{run}-{comm}-{pid}` in `/dev/shm` (or
//! `BRAID_SHM_DIR`), every rank maps it, and as soon as all have mapped it
//! rank 0 unlinks the file: the memory lives on in the mappings and
//! disappears with the last process, so no segment outlives a run even if
//! it crashes. Files left by a crash before that point are swept when the
//! next segment is created (their creator pid is dead).

use crate::error::{CommError, Result};
use braid_store::StoreClient;
use std::ffi::CString;
use std::path::PathBuf;
use std::time::Duration;

/// A mapping of a shared segment.
pub struct Segment {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain memory shared between processes; all
// concurrent access to it goes through atomics or is ordered by them
// (see `channel`).
unsafe impl Send for Segment {}
// SAFETY: as above.
unsafe impl Sync for Segment {}

impl Segment {
    /// Base address.
    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the mapping is empty (never true for a created segment).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are exactly what mmap returned, unmapped once.
        unsafe {
            libc::munmap(self.ptr as *mut libc::c_void, self.len);
        }
    }
}

/// Directory for segments.
pub fn shm_dir() -> PathBuf {
    if let Ok(d) = std::env::var(braid_core::env::BRAID_SHM_DIR) {
        if !d.is_empty() {
            return PathBuf::from(d);
        }
    }
    let dev = PathBuf::from("/dev/shm");
    if dev.is_dir() {
        dev
    } else {
        std::env::temp_dir()
    }
}

/// Removes segment files whose creating process no longer exists.
pub fn sweep_stale() -> usize {
    let Ok(entries) = std::fs::read_dir(shm_dir()) else {
        return 0;
    };
    let mut removed = 0;
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.starts_with("braid-") {
            continue;
        }
        let Some(pid) = name.rsplit('-').next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if !crate::health::process_alive(pid) && std::fs::remove_file(e.path()).is_ok() {
            removed += 1;
        }
    }
    removed
}

/// The segment files of a run that exist now (for tests and tools).
pub fn files_for_run(run_id: &str) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(shm_dir()) else {
        return vec![];
    };
    let prefix = format!("braid-{}-", sanitize(run_id));
    entries
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
        .map(|e| e.path())
        .collect()
}

fn sanitize(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '.' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

fn map(path: &std::path::Path, len: usize, create: bool) -> Result<Segment> {
    let setup = |m: String| CommError::Setup(format!("shared memory {}: {m}", path.display()));
    let cpath =
        CString::new(path.as_os_str().as_encoded_bytes()).map_err(|e| setup(e.to_string()))?;
    let flags = if create {
        libc::O_RDWR | libc::O_CREAT | libc::O_EXCL
    } else {
        libc::O_RDWR
    };
    // SAFETY: `cpath` is a valid NUL-terminated string; the fd is closed below.
    let fd = unsafe { libc::open(cpath.as_ptr(), flags | libc::O_CLOEXEC, 0o600) };
    if fd < 0 {
        return Err(setup(format!("open: {}", std::io::Error::last_os_error())));
    }
    let result = (|| {
        if create {
            // SAFETY: `fd` is an open file descriptor we own.
            if unsafe { libc::ftruncate(fd, len as libc::off_t) } != 0 {
                return Err(setup(format!(
                    "cannot size it to {len} bytes: {} (is {} full? set BRAID_SHM_DIR)",
                    std::io::Error::last_os_error(),
                    shm_dir().display()
                )));
            }
        }
        // SAFETY: mapping `len` bytes of an open fd, shared, read-write; the
        // result is checked against MAP_FAILED.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(setup(format!(
                "mmap of {len} bytes: {}",
                std::io::Error::last_os_error()
            )));
        }
        Ok(Segment {
            ptr: ptr as *mut u8,
            len,
        })
    })();
    // SAFETY: closing the fd we opened; the mapping stays valid.
    unsafe {
        libc::close(fd);
    }
    result
}

/// Creates (rank 0) or opens (others) the communicator's segment of `len`
/// bytes and unlinks it once every one of `size` ranks has mapped it.
pub fn establish(
    store: &StoreClient,
    rank: usize,
    size: usize,
    run_id: &str,
    comm_id: &str,
    len: usize,
    timeout: Duration,
) -> Result<Segment> {
    if rank == 0 {
        sweep_stale();
        let path = shm_dir().join(format!(
            "braid-{}-{}-{}",
            sanitize(run_id),
            sanitize(comm_id),
            std::process::id()
        ));
        let _ = std::fs::remove_file(&path);
        let seg = map(&path, len, true)?;
        store.set("shm/path", path.to_string_lossy().as_bytes())?;
        let keys: Vec<String> = (1..size).map(|r| format!("shm/mapped/{r}")).collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let waited = store.wait(&refs, timeout);
        let _ = std::fs::remove_file(&path);
        waited.map_err(|e| {
            CommError::Setup(format!(
                "rank 0: not every rank mapped the shared segment: {e}"
            ))
        })?;
        Ok(seg)
    } else {
        let raw = store.get_timeout("shm/path", timeout)?;
        let path = PathBuf::from(String::from_utf8_lossy(&raw).into_owned());
        let seg = map(&path, len, false)?;
        store.set(&format!("shm/mapped/{rank}"), b"")?;
        Ok(seg)
    }
}
