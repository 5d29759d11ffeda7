//! The names a checkpoint goes by on the disk: its manifest's format tag
//! and file name, Hugging Face's index of the weight files, and the file
//! naming the newest checkpoint.

/// The manifest's format tag.
pub const FORMAT: &str = "braid-checkpoint/1";
/// The manifest's file name inside a checkpoint.
pub const MANIFEST: &str = "braid-checkpoint.json";
/// Hugging Face's index of the weight files.
pub const INDEX: &str = "model.safetensors.index.json";
/// The file in the checkpoint root naming the newest checkpoint.
pub const LATEST: &str = "latest";
