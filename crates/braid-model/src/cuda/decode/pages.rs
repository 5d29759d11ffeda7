//! The decoder's KV cache in device memory: [`KvPages`]'s layout, per
//! layer a buffer of keys and one of values.

use crate::layout::Layout;
use crate::model::KvPages;
use crate::paged::{BlockCopy, BlockId};
use braid_cuda::memory::copy_async;
use braid_cuda::{CudaError, Device, DeviceBuffer, Result, Stream};

/// The keys and values of every sequence being decoded, per layer, in
/// device memory: [`KvPages`]'s layout (block `b`'s position `o` of layer
/// `l` holds `width` keys at `k[l][(b * block_size + o) * width..]`, the
/// same for values). One more block than the tables may name lies past
/// the last ([`trash`](Self::trash)): the padded rows of a captured
/// step write there.
pub struct GpuKvPages {
    pub(super) k: Vec<DeviceBuffer<f32>>,
    pub(super) v: Vec<DeviceBuffer<f32>>,
    pub(super) block_size: usize,
    pub(super) width: usize,
    pub(super) blocks: usize,
}

impl GpuKvPages {
    /// `blocks` blocks of `block_size` positions for every layer of
    /// `layout`'s model, zeroed, on `device`.
    pub fn new(
        device: &Device,
        layout: &Layout,
        blocks: usize,
        block_size: usize,
    ) -> Result<GpuKvPages> {
        let cfg = &layout.config;
        let width = cfg.n_embd;
        let per = (blocks + 1) * block_size * width;
        let z = || DeviceBuffer::<f32>::zeros(device, per);
        Ok(GpuKvPages {
            k: (0..cfg.n_layer).map(|_| z()).collect::<Result<_>>()?,
            v: (0..cfg.n_layer).map(|_| z()).collect::<Result<_>>()?,
            block_size,
            width,
            blocks,
        })
    }

    /// Bytes one block takes over every layer (keys and values): the
    /// CPU's f32 cache's.
    pub fn bytes_per_block(layout: &Layout, block_size: usize) -> usize {
        KvPages::<f32>::bytes_per_block(layout, block_size)
    }

    /// Positions per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks per layer (the tables').
    pub fn blocks(&self) -> usize {
        self.blocks
    }

    /// The block past the tables' that padded rows write into.
    pub(super) fn trash(&self) -> BlockId {
        self.blocks as BlockId
    }

    /// Queues the copies a write into shared blocks asked for
    /// ([`crate::paged::BlockTable::append`]), in every layer, in order,
    /// on `s`.
    pub fn copy(&mut self, copies: &[BlockCopy], s: &Stream) -> Result<()> {
        let n = self.block_size * self.width;
        for c in copies {
            let (from, to) = (c.from as usize, c.to as usize);
            if from >= self.blocks || to >= self.blocks {
                return Err(CudaError::Invalid(format!(
                    "a copy of block {from} into block {to} in a cache of {} blocks",
                    self.blocks
                )));
            }
            if from == to {
                continue;
            }
            for buf in self.k.iter_mut().chain(self.v.iter_mut()) {
                let (mut dst, src) = buf.views_mut2(to * n..(to + 1) * n, from * n..(from + 1) * n);
                copy_async(&mut dst, &src, s)?;
            }
        }
        Ok(())
    }

    /// Layer `l`'s keys and values (the tables' blocks), copied to the
    /// host (waits).
    pub fn layer_to_host(&self, l: usize) -> Result<(Vec<f32>, Vec<f32>)> {
        let n = self.blocks * self.block_size * self.width;
        match (self.k.get(l), self.v.get(l)) {
            (Some(k), Some(v)) => {
                let (mut hk, mut hv) = (vec![0.0; n], vec![0.0; n]);
                k.copy_range_to_host(0..n, &mut hk)?;
                v.copy_range_to_host(0..n, &mut hv)?;
                Ok((hk, hv))
            }
            _ => Err(CudaError::Invalid(format!(
                "layer {l} of a cache of {} layers",
                self.k.len()
            ))),
        }
    }

    /// The slot of position `pos` of a sequence with blocks `table`: the
    /// CPU's checks and messages ([`KvPages`]).
    pub(super) fn slot(&self, table: &[BlockId], pos: usize) -> std::result::Result<usize, String> {
        let b = table.get(pos / self.block_size).ok_or_else(|| {
            format!(
                "position {pos} has no block in its sequence's table of {} block(s) of {}",
                table.len(),
                self.block_size
            )
        })?;
        self.check_block(*b)?;
        Ok(*b as usize * self.block_size + pos % self.block_size)
    }

    pub(super) fn check_block(&self, b: BlockId) -> std::result::Result<(), String> {
        match (b as usize) < self.blocks {
            true => Ok(()),
            false => Err(format!(
                "block {b} of a table is outside the cache's {} blocks",
                self.blocks
            )),
        }
    }
}
