//! FFCV's `.beton` dataset format, read and written byte for byte as the
//! `ffcv` 1.0 package does (its `types.py`, `writer.py`, `reader.py` and
//! `fields/` are the specification), with no Python at run time.
//!
//! - [`layout`]: the header, field table and allocation table;
//! - [`dtype`] and [`field`]: the field types (int, float, NDArray, bytes,
//!   JSON, RGB image, torch tensor, and braid's token windows) and their
//!   descriptors and metadata;
//! - [`index`]: opening a file and checking everything in it before use;
//! - [`reader`]: [`Beton`], samples through the OS page cache;
//! - [`value`]: a sample's values, and their JSON form;
//! - [`writer`]: [`Writer`], atomic, FFCV's page layout.

pub mod dtype;
pub mod field;
pub mod index;
pub mod layout;
pub mod reader;
pub mod value;
pub mod writer;

pub use dtype::DType;
pub use field::FieldType;
pub use index::{Extent, ImageMode, Index};
pub use reader::Beton;
pub use value::{Image, Value};
pub use writer::{FieldValue, Writer, Written};
