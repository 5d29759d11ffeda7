//! `--json [FILE]`, the same in every command: `--json FILE` writes the
//! command's JSON to FILE beside its usual output; `--json` alone (or
//! `--json -`) prints the JSON on stdout instead of the usual output, so
//! that `braid ... --json | jq` works. Commands whose usual output runs
//! while they work (`train`, `bench`, `topo`) move it to stderr then
//! ([`JsonOut::claim_stdout`]).

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// Where a command's JSON goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JsonOut {
    /// Into this file (written whole).
    File(PathBuf),
    /// On stdout, instead of the usual output.
    Stdout,
}

/// `--json`'s help, the same in every command.
pub const HELP: &str = "JSON to FILE beside the usual output; alone (or -): JSON on stdout instead";

/// Parses `--json`'s value (`-`, the value clap gives a bare `--json`,
/// is stdout).
pub fn parse(s: &str) -> Result<JsonOut, String> {
    match s {
        "-" => Ok(JsonOut::Stdout),
        "" => {
            Err("--json: an empty file name (use --json FILE, or --json alone for stdout)".into())
        }
        path => Ok(JsonOut::File(PathBuf::from(path))),
    }
}

/// The process's original stdout once [`JsonOut::claim_stdout`] moved the
/// usual output to stderr.
static SAVED_STDOUT: OnceLock<std::fs::File> = OnceLock::new();

impl JsonOut {
    /// Whether the JSON goes to stdout.
    pub fn is_stdout(&self) -> bool {
        *self == JsonOut::Stdout
    }

    /// The file, when it is one.
    pub fn path(&self) -> Option<&Path> {
        match self {
            JsonOut::File(p) => Some(p),
            JsonOut::Stdout => None,
        }
    }

    /// Checks, before the command's work, that the file can be written:
    /// its directory exists, a file can be made there, and it is not a
    /// directory (stdout always can).
    pub fn check(&self) -> Result<(), String> {
        super::train_ckpt::check_outputs(&[("--json", self.path())])
    }

    /// For a command that prints as it works: with the JSON on stdout,
    /// everything else this process prints to stdout goes to stderr from
    /// now on, and [`write`](Self::write) alone reaches the real stdout.
    pub fn claim_stdout(&self) -> Result<(), String> {
        if !self.is_stdout() || SAVED_STDOUT.get().is_some() {
            return Ok(());
        }
        let _ = std::io::stdout().flush();
        // SAFETY: dup and dup2 act on this process's own descriptors 1 and
        // 2, which are open for its whole life; the duplicate is owned by
        // the File made from it below and nothing else closes it.
        let saved = unsafe {
            let fd = libc::dup(1);
            if fd < 0 || libc::dup2(2, 1) < 0 {
                return Err(format!(
                    "--json: cannot move the usual output to stderr: {}",
                    std::io::Error::last_os_error()
                ));
            }
            <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd)
        };
        let _ = SAVED_STDOUT.set(saved);
        Ok(())
    }

    /// Writes `text` (one JSON document) where it goes.
    pub fn write(&self, text: &str) -> Result<(), String> {
        match self {
            JsonOut::File(path) => std::fs::write(path, text)
                .map_err(|e| format!("cannot write {}: {e}", path.display())),
            JsonOut::Stdout => {
                let result = match SAVED_STDOUT.get() {
                    Some(mut f) => f
                        .write_all(text.as_bytes())
                        .and_then(|_| f.write_all(b"\n")),
                    None => {
                        let mut out = std::io::stdout().lock();
                        out.write_all(text.as_bytes())
                            .and_then(|_| out.write_all(b"\n"))
                            .and_then(|_| out.flush())
                    }
                };
                result.map_err(|e| format!("cannot write the JSON to stdout: {e}"))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dash_is_stdout_and_anything_else_a_file() {
        assert_eq!(parse("-").unwrap(), JsonOut::Stdout);
        assert_eq!(parse("a.json").unwrap(), JsonOut::File("a.json".into()));
        assert!(parse("").is_err());
    }
}
