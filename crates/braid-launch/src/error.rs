//! [`LaunchError`]: why a launch could not go ahead.

use braid_store::StoreError;

/// A launch that could not start or could not be supervised.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// The options contradict each other or are out of range.
    #[error("{0}")]
    Config(String),
    /// The rendezvous store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The nodes could not agree on the world.
    #[error("rendezvous failed: {0}")]
    Rendezvous(String),
    /// A worker process could not be started.
    #[error(
        "could not start {program:?} for rank {rank}: {source}{}",
        spawn_hint(program, source)
    )]
    Spawn {
        /// Rank that was being started.
        rank: usize,
        /// The program.
        program: String,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// Any other operating-system failure of the launcher itself.
    #[error("{what}: {source}")]
    Io {
        /// What the launcher was doing.
        what: String,
        /// The error.
        source: std::io::Error,
    },
}

/// What to do about a program that could not be started, where the cause
/// is a common one: a program in the current directory named without
/// `./` (looked up on `PATH` instead), or an interpreter that is missing.
fn spawn_hint(program: &str, source: &std::io::Error) -> String {
    use std::os::unix::fs::PermissionsExt as _;
    let path = std::path::Path::new(program);
    // Named with a path, or found beside us without one: what it is.
    let here = program.contains('/') || source.kind() == std::io::ErrorKind::NotFound;
    if here && path.is_dir() {
        return " (that is a directory, not a program: name the program inside it)".into();
    }
    let runnable = |p: &std::path::Path| {
        p.metadata()
            .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    if source.kind() == std::io::ErrorKind::PermissionDenied && path.is_file() && !runnable(path) {
        return format!(
            " (the file is not executable: `chmod +x {program}`, or name its interpreter, e.g. \
             `sh {program}` or `python3 {program}`)"
        );
    }
    if source.kind() != std::io::ErrorKind::NotFound || program.contains('/') {
        return String::new();
    }
    if program == crate::config::PYTHON {
        return format!(
            " (a .py program runs under {program}, which is not on PATH: install Python 3 or \
             name the interpreter yourself with --no-python)"
        );
    }
    if path.is_file() && !runnable(path) {
        return format!(
            " (a program named without a / is looked up on PATH; ./{program} in this directory \
             is not executable: `chmod +x {program}`, or name its interpreter, e.g. `sh \
             {program}`)"
        );
    }
    if path.exists() {
        return format!(
            " (a program named without a / is looked up on PATH; the one in this directory is \
             ./{program})"
        );
    }
    " (not on PATH; name it with its path)".into()
}
