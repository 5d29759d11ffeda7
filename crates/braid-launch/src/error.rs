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
    #[error("could not start {program:?} for rank {rank}: {source}")]
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
