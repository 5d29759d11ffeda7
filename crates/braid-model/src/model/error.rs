//! [`StepError`]: why a step of the CPU model cannot run.

/// Why a step cannot run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StepError {
    /// Token or target counts do not match the activations' shape.
    #[error("{0}")]
    Shape(String),
    /// A token id is outside the vocabulary.
    #[error("token {token} at position {pos} is not below the vocabulary size {vocab}")]
    Token {
        /// The id.
        token: u32,
        /// Where.
        pos: usize,
        /// Vocabulary size.
        vocab: usize,
    },
    /// A tensor-parallel collective failed.
    #[error("tensor parallelism: {0}")]
    Group(String),
}
