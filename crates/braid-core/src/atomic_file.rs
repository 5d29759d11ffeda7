//! Files written whole or not at all: the bytes go to a temporary file
//! beside the target, are flushed to the disk, and only then take the
//! target's name (a rename, atomic on one file system); the directory is
//! flushed too, so the rename survives a crash. A reader sees the old file
//! or the new one, never a part.

use std::io::Write;
use std::path::{Path, PathBuf};

/// Writes `bytes` to `path` atomically (see the module docs). The
/// temporary file (`.NAME.PID.tmp` beside `path`) is removed if anything
/// fails.
pub fn write(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = temp_beside(path);
    let written = std::fs::File::create(&tmp)
        .and_then(|mut f| {
            f.write_all(bytes)?;
            f.sync_all()
        })
        .and_then(|()| std::fs::rename(&tmp, path));
    if written.is_err() {
        // Best effort: the error being returned is the one that matters.
        let _ = std::fs::remove_file(&tmp);
    }
    written?;
    sync_dir(path.parent().unwrap_or(Path::new(".")))
}

/// Flushes the directory `dir` to the disk (so that a rename inside it
/// survives a crash).
pub fn sync_dir(dir: &Path) -> std::io::Result<()> {
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    std::fs::File::open(dir).and_then(|d| d.sync_all())
}

/// The temporary file [`write`] uses for `path`: hidden, beside it, named
/// by this process (two processes writing the same file do not share one).
fn temp_beside(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    path.with_file_name(format!(".{name}.{}.tmp", std::process::id()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_write_replaces_the_file_whole_and_leaves_no_temporary() {
        let dir = std::env::temp_dir().join(format!("braid-atomic-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("state.json");
        write(&path, b"first").unwrap();
        write(&path, b"second, longer").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"second, longer");
        let left: Vec<_> = std::fs::read_dir(&dir).unwrap().collect();
        assert_eq!(left.len(), 1, "{left:?}");
        // A directory that does not exist: an error, and nothing written.
        let missing = dir.join("no-such-dir").join("x");
        assert!(write(&missing, b"x").is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
