//! braid-data: where training batches come from.
//!
//! - [`tokens`]: tokenizers (bytes, GPT-2 BPE) and token datasets — the
//!   built-in synthetic corpus, UTF-8 text files, pre-tokenized u16
//!   shards — with the windows a GPT trains on;
//! - [`beton`]: FFCV's `.beton` dataset files, read and written;
//! - [`cache`]: the process cache, pages read into a bounded pool;
//! - [`convert`]: `.beton` files from token streams, JSON lines and
//!   image folders;
//! - [`jpeg`]: JPEG decoding (whole or a scaled window) and encoding;
//! - [`augment`]: one image's crop, reduced-scale JPEG decode, resize,
//!   flip and output form;
//! - [`images`]: the image loader, batches made ahead by a thread pool
//!   from the OS cache or the process cache;
//! - [`resize`]: RGB resizing as OpenCV's `INTER_AREA` (area averaging);
//! - [`order`]: sequential, random and FFCV's quasi-random epoch orders,
//!   dealt out to ranks;
//! - [`sampler`]: [`sampler::DistributedSampler`], each rank's share of
//!   an epoch as PyTorch's `DistributedSampler` decides it;
//! - [`sheet`]: contact sheets, a grid of a `.beton` file's first images
//!   as thumbnails (`braid data inspect --sheet`);
//! - [`token_beton`]: GPT windows from a `.beton` file's token field;
//! - [`loader`]: the [`loader::Loader`] interface the training loop takes
//!   every batch through, and [`loader::TokenWindows`].
//!
//! It depends on nothing of braid's but `braid-core` (its random number
//! generator), so the model, the trainer and the CLI all read data
//! through it.

pub mod augment;
pub mod beton;
pub mod cache;
pub mod convert;
pub mod images;
pub mod jpeg;
pub mod loader;
pub mod order;
pub mod resize;
pub mod sampler;
pub mod sheet;
pub mod token_beton;
pub mod tokens;
