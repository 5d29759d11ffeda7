//! The decoder's KV cache in device memory: [`KvPages`]'s layout, per
//! layer a buffer of keys and one of values, in f32 (the CPU's) or bf16
//! ([`KvDtype`], `BRAID_DECODE_KV`).

use crate::cuda::kernels::PagedKv;
use crate::layout::Layout;
use crate::model::KvPages;
use crate::paged::{BlockCopy, BlockId};
use braid_cuda::memory::copy_async;
use braid_cuda::{CudaError, Device, DeviceBuffer, Result, Stream};
use half::bf16;

/// The element the cache holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvDtype {
    F32,
    /// Keys and values rounded to bf16 as they are written (to nearest,
    /// ties to even), widened exactly as the attention reads them.
    Bf16,
}

impl KvDtype {
    /// `BRAID_DECODE_KV`: `f32` or `bf16`; unset, the products' element
    /// (a bf16 cache under bf16 products, f32 under f32 ones).
    pub fn from_env(products: braid_core::DType) -> Result<KvDtype> {
        match std::env::var(braid_core::env::BRAID_DECODE_KV).as_deref() {
            Err(_) | Ok("") => Ok(match products {
                braid_core::DType::BF16 => KvDtype::Bf16,
                _ => KvDtype::F32,
            }),
            Ok("f32") => Ok(KvDtype::F32),
            Ok("bf16") => Ok(KvDtype::Bf16),
            Ok(other) => Err(CudaError::Invalid(format!(
                "BRAID_DECODE_KV={other}: expected f32 or bf16"
            ))),
        }
    }

    /// Bytes of one element.
    pub fn size(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::Bf16 => 2,
        }
    }
}

/// One layer's keys or values.
pub(super) enum KvBuf {
    F32(DeviceBuffer<f32>),
    Bf16(DeviceBuffer<bf16>),
}

impl KvBuf {
    fn zeros(device: &Device, len: usize, dtype: KvDtype) -> Result<KvBuf> {
        Ok(match dtype {
            KvDtype::F32 => KvBuf::F32(DeviceBuffer::zeros(device, len)?),
            KvDtype::Bf16 => KvBuf::Bf16(DeviceBuffer::zeros(device, len)?),
        })
    }

    fn dptr(&self) -> u64 {
        use braid_cuda::DeviceMem;
        match self {
            KvBuf::F32(b) => b.dptr(),
            KvBuf::Bf16(b) => b.dptr(),
        }
    }

    /// Queues a copy of elements `from` over `to` (the same length, apart).
    fn copy_within(
        &mut self,
        to: std::ops::Range<usize>,
        from: std::ops::Range<usize>,
        s: &Stream,
    ) -> Result<()> {
        match self {
            KvBuf::F32(b) => {
                let (mut dst, src) = b.views_mut2(to, from);
                copy_async(&mut dst, &src, s)
            }
            KvBuf::Bf16(b) => {
                let (mut dst, src) = b.views_mut2(to, from);
                copy_async(&mut dst, &src, s)
            }
        }
    }

    /// Its first `n` elements, widened to f32, on the host (waits).
    fn to_host(&self, n: usize) -> Result<Vec<f32>> {
        match self {
            KvBuf::F32(b) => {
                let mut h = vec![0.0; n];
                b.copy_range_to_host(0..n, &mut h)?;
                Ok(h)
            }
            KvBuf::Bf16(b) => {
                let mut h = vec![bf16::ZERO; n];
                b.copy_range_to_host(0..n, &mut h)?;
                Ok(h.into_iter().map(f32::from).collect())
            }
        }
    }
}

/// The keys and values of every sequence being decoded, per layer, in
/// device memory: [`KvPages`]'s layout (block `b`'s position `o` of layer
/// `l` holds `width` keys at `k[l][(b * block_size + o) * width..]`, the
/// same for values). One more block than the tables may name lies past
/// the last ([`trash`](Self::trash)): the padded rows of a captured
/// step write there.
pub struct GpuKvPages {
    k: Vec<KvBuf>,
    v: Vec<KvBuf>,
    pub(super) block_size: usize,
    pub(super) width: usize,
    pub(super) blocks: usize,
    dtype: KvDtype,
}

impl GpuKvPages {
    /// `blocks` blocks of `block_size` positions of `dtype` for every
    /// layer of `layout`'s model, zeroed, on `device`.
    pub fn new(
        device: &Device,
        layout: &Layout,
        blocks: usize,
        block_size: usize,
        dtype: KvDtype,
    ) -> Result<GpuKvPages> {
        let cfg = &layout.config;
        let width = cfg.n_embd;
        let per = (blocks + 1) * block_size * width;
        let z = || KvBuf::zeros(device, per, dtype);
        Ok(GpuKvPages {
            k: (0..cfg.n_layer).map(|_| z()).collect::<Result<_>>()?,
            v: (0..cfg.n_layer).map(|_| z()).collect::<Result<_>>()?,
            block_size,
            width,
            blocks,
            dtype,
        })
    }

    /// A cache of `blocks` blocks of `block_size` positions of `width`
    /// with no memory: its shape alone, for the step planner's tests.
    #[cfg(test)]
    pub(super) fn shape_only(block_size: usize, width: usize, blocks: usize) -> GpuKvPages {
        GpuKvPages {
            k: Vec::new(),
            v: Vec::new(),
            block_size,
            width,
            blocks,
            dtype: KvDtype::F32,
        }
    }

    /// Bytes one block of `dtype` takes over every layer (keys and
    /// values): in f32 the CPU's cache's.
    pub fn bytes_per_block(layout: &Layout, block_size: usize, dtype: KvDtype) -> usize {
        KvPages::<f32>::bytes_per_block(layout, block_size) / 4 * dtype.size()
    }

    /// The element it holds.
    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }

    /// Layer `l`'s keys and values as the decode kernels take them.
    pub(super) fn layer(&self, l: usize) -> PagedKv {
        PagedKv {
            k: self.k[l].dptr(),
            v: self.v[l].dptr(),
            len: (self.blocks + 1) * self.block_size * self.width,
            bf16: self.dtype == KvDtype::Bf16,
        }
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
                buf.copy_within(to * n..(to + 1) * n, from * n..(from + 1) * n, s)?;
            }
        }
        Ok(())
    }

    /// Layer `l`'s keys and values (the tables' blocks), copied to the
    /// host and widened to f32 (waits).
    pub fn layer_to_host(&self, l: usize) -> Result<(Vec<f32>, Vec<f32>)> {
        let n = self.blocks * self.block_size * self.width;
        match (self.k.get(l), self.v.get(l)) {
            (Some(k), Some(v)) => Ok((k.to_host(n)?, v.to_host(n)?)),
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
