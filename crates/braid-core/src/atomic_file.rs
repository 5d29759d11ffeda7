//! Files written whole or not at all: the bytes go to a temporary file
//! beside the target, are flushed to the disk, and only then take the
//! target's name (a rename, atomic on one file system); the directory is
//! flushed too, so the rename survives a crash. A reader sees the old file
//! or the new one, never a part.

use std::io::Write;
use std::path::{Path, PathBuf};

/// Writes `bytes` to `path` atomically (see the module docs). The
/// temporary file ([`temp_path`] of this process) is removed if anything
/// fails.
pub fn write(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut pending = Pending::create(path)?;
    pending.write_all(bytes)?;
    pending.commit()
}

/// A file being written atomically, for a writer that wants its temporary
/// file to exist before it has the bytes (a flight record: whoever asked
/// for it sees it begun): [`Pending::create`] makes the temporary file,
/// [`Pending::write_all`] adds to it, [`Pending::commit`] flushes it and
/// gives it the target's name. Dropped uncommitted, it removes its
/// temporary file; the target is left as it was.
pub struct Pending {
    path: PathBuf,
    tmp: PathBuf,
    file: Option<std::fs::File>,
}

impl Pending {
    /// Creates the temporary file for `path` ([`temp_path`] of this
    /// process), empty.
    pub fn create(path: &Path) -> std::io::Result<Pending> {
        let tmp = temp_path(path, std::process::id());
        let file = std::fs::File::create(&tmp)?;
        Ok(Pending {
            path: path.to_path_buf(),
            tmp,
            file: Some(file),
        })
    }

    /// Appends `bytes`.
    pub fn write_all(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        match &mut self.file {
            Some(f) => f.write_all(bytes),
            None => Err(std::io::Error::other("already committed")),
        }
    }

    /// Flushes the bytes to the disk, renames the temporary file over the
    /// target and flushes the directory.
    pub fn commit(mut self) -> std::io::Result<()> {
        let Some(file) = self.file.take() else {
            return Err(std::io::Error::other("already committed"));
        };
        let flushed = file.sync_all();
        drop(file);
        flushed?;
        // On an error the temporary file is removed on drop.
        std::fs::rename(&self.tmp, &self.path)?;
        // Renamed: nothing of ours is left to remove on drop.
        self.tmp = PathBuf::new();
        sync_dir(self.path.parent().unwrap_or(Path::new(".")))
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if !self.tmp.as_os_str().is_empty() {
            // Best effort: any error being returned is the one that matters.
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
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

/// The temporary file process `pid` writes `path` through: hidden, beside
/// it, named by the process (two processes writing the same file do not
/// share one): `.NAME.PID.tmp`.
pub fn temp_path(path: &Path, pid: u32) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    path.with_file_name(format!(".{name}.{pid}.tmp"))
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

    #[test]
    fn a_pending_file_is_visible_as_its_temporary_until_committed() {
        let dir = std::env::temp_dir().join(format!("braid-pending-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("record.json");
        let tmp = temp_path(&path, std::process::id());
        assert_eq!(
            tmp.file_name().unwrap().to_str().unwrap(),
            format!(".record.json.{}.tmp", std::process::id())
        );
        let mut p = Pending::create(&path).unwrap();
        assert!(tmp.exists() && !path.exists());
        p.write_all(b"half, ").unwrap();
        p.write_all(b"whole").unwrap();
        assert_eq!(std::fs::metadata(&tmp).unwrap().len(), 11);
        p.commit().unwrap();
        assert!(!tmp.exists());
        assert_eq!(std::fs::read(&path).unwrap(), b"half, whole");
        // Dropped uncommitted: the temporary goes, the target stays.
        let mut p = Pending::create(&path).unwrap();
        p.write_all(b"cut").unwrap();
        drop(p);
        assert!(!tmp.exists());
        assert_eq!(std::fs::read(&path).unwrap(), b"half, whole");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
