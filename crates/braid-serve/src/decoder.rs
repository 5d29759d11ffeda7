//! [`Decoder`]: what the batcher asks of a model — one step over rows of
//! many sequences (their keys and values kept in the decoder's paged
//! cache), and the copies a write into a shared block needs — with
//! [`CpuDecoder`], the CPU's, over `braid_model`'s [`Gpt::decode`], and
//! [`CudaDecoder`], one GPU's in f32, over `braid_model`'s
//! [`GpuDecoder`].

use braid_cuda::Device;
use braid_model::cuda::decode::{GpuDecoder, GpuKvPages, KvDtype};
use braid_model::paged::BlockCopy;
use braid_model::{DecodeRow, Gpt, KvPages, Layout, Logits, Params};

/// A model that decodes rows of many sequences over a paged KV cache.
pub trait Decoder {
    /// The model's context: positions a sequence may hold.
    fn context(&self) -> usize;
    /// Its vocabulary (the logits' length).
    fn vocab(&self) -> usize;
    /// Blocks in its KV cache.
    fn blocks(&self) -> usize;
    /// Positions per block.
    fn block_size(&self) -> usize;
    /// Copies blocks before they are written (copy on write).
    fn copy_blocks(&mut self, copies: &[BlockCopy]);
    /// One step: every row's key and value written, the logits after each
    /// row that asks for them, in row order, into `out` (kept by the
    /// caller from step to step).
    fn decode(&mut self, rows: &[DecodeRow<'_>], out: &mut Logits) -> Result<(), String>;
    /// What it runs on, for the banner (`cpu, f32`).
    fn describe(&self) -> String;
    /// The row counts of steady steps (every row a sequence's next token)
    /// it prepares once, on first use (a GPU's CUDA graphs), and a warm-up
    /// should therefore run; none by default.
    fn prepared_rows(&self) -> Vec<usize> {
        Vec::new()
    }
}

/// A decoder chosen at run time (`Box<dyn Decoder + Send>`: the CPU's, a
/// GPU's by `--device`, or rank 0's of a tensor-parallel server) is a
/// decoder.
impl<D: Decoder + ?Sized> Decoder for Box<D> {
    fn context(&self) -> usize {
        (**self).context()
    }

    fn vocab(&self) -> usize {
        (**self).vocab()
    }

    fn blocks(&self) -> usize {
        (**self).blocks()
    }

    fn block_size(&self) -> usize {
        (**self).block_size()
    }

    fn copy_blocks(&mut self, copies: &[BlockCopy]) {
        (**self).copy_blocks(copies)
    }

    fn decode(&mut self, rows: &[DecodeRow<'_>], out: &mut Logits) -> Result<(), String> {
        (**self).decode(rows, out)
    }

    fn describe(&self) -> String {
        (**self).describe()
    }

    fn prepared_rows(&self) -> Vec<usize> {
        (**self).prepared_rows()
    }
}

/// The CPU decoder: f32, the model's own block description walked over
/// the decode backend.
pub struct CpuDecoder {
    gpt: Gpt,
    params: Vec<f32>,
    kv: KvPages<f32>,
}

impl CpuDecoder {
    /// A decoder of `params` with a cache of `blocks` blocks of
    /// `block_size` positions.
    pub fn new(params: Params, blocks: usize, block_size: usize) -> Result<CpuDecoder, String> {
        if params.layout.shard.size > 1 {
            return Err(
                "serving runs the whole model: consolidate a tensor-parallel checkpoint first \
                 (braid ckpt consolidate)"
                    .into(),
            );
        }
        CpuDecoder::of(
            Gpt::new(params.layout.clone()),
            params.data,
            blocks,
            block_size,
        )
    }

    /// A decoder of `gpt` (the whole model, or a tensor-parallel share
    /// built with its group: its pages then hold its heads' keys and
    /// values) over `params`, its layout's.
    pub fn of(
        gpt: Gpt,
        params: Vec<f32>,
        blocks: usize,
        block_size: usize,
    ) -> Result<CpuDecoder, String> {
        if params.len() != gpt.layout().len {
            return Err(format!(
                "{} parameters for a model (or share) of {}",
                params.len(),
                gpt.layout().len
            ));
        }
        if blocks == 0 || block_size == 0 {
            return Err(format!(
                "a KV cache of {blocks} block(s) of {block_size} position(s) holds nothing"
            ));
        }
        let kv = KvPages::new(gpt.layout(), blocks, block_size);
        Ok(CpuDecoder { gpt, params, kv })
    }

    /// Blocks of `block_size` positions that `bytes` of memory hold for
    /// the model (or tensor-parallel share) `layout` lays out.
    pub fn blocks_in(layout: &Layout, bytes: u64, block_size: usize) -> usize {
        let per = KvPages::<f32>::bytes_per_block(layout, block_size) as u64;
        (bytes / per.max(1)) as usize
    }
}

impl Decoder for CpuDecoder {
    fn context(&self) -> usize {
        self.gpt.layout().config.context
    }

    fn vocab(&self) -> usize {
        self.gpt.layout().config.vocab_size
    }

    fn blocks(&self) -> usize {
        self.kv.blocks()
    }

    fn block_size(&self) -> usize {
        self.kv.block_size()
    }

    fn copy_blocks(&mut self, copies: &[BlockCopy]) {
        self.kv.copy(copies);
    }

    fn decode(&mut self, rows: &[DecodeRow<'_>], out: &mut Logits) -> Result<(), String> {
        let logits = self
            .gpt
            .decode(&self.params, &mut self.kv, rows)
            .map_err(|e| e.to_string())?;
        out.set(&logits);
        Ok(())
    }

    fn describe(&self) -> String {
        format!(
            "cpu, f32, KV cache {} blocks of {}",
            self.kv.blocks(),
            self.kv.block_size()
        )
    }
}

/// The GPU decoder: on one GPU with f32 or bf16 products, braid-model's
/// [`GpuDecoder`] (the model and its paged KV cache in device memory),
/// its errors said as
/// text. A block copy that fails is said by the next step (the copies are
/// queued before it on the same stream; the batcher then fails the
/// running requests, as for a failed step).
pub struct CudaDecoder {
    gpu: GpuDecoder,
    /// A failed block copy, not yet said.
    failed: Option<String>,
}

impl CudaDecoder {
    /// A decoder of `params` on `device` with a cache of `blocks` blocks
    /// of `block_size` positions, room for `rows` rows a step (more grow
    /// it), its products in `dtype` (f32 or bf16), its KV cache in `kv`.
    pub fn new(
        device: &Device,
        params: &Params,
        (blocks, block_size, rows): (usize, usize, usize),
        dtype: braid_core::DType,
        kv: KvDtype,
    ) -> Result<CudaDecoder, String> {
        let gpu = GpuDecoder::with_kv(device, params, blocks, block_size, rows, dtype, kv)
            .map_err(|e| e.to_string())?;
        Ok(CudaDecoder { gpu, failed: None })
    }

    /// Blocks of `block_size` positions that `bytes` of GPU memory hold
    /// for the model `layout` lays out: keys and values in `kv`, `2 ×
    /// layers × block_size × width × 4` (or 2, in bf16) bytes a block.
    pub fn blocks_in(layout: &Layout, bytes: u64, block_size: usize, kv: KvDtype) -> usize {
        let per = GpuKvPages::bytes_per_block(layout, block_size, kv) as u64;
        (bytes / per.max(1)) as usize
    }
}

impl Decoder for CudaDecoder {
    fn context(&self) -> usize {
        self.gpu.context()
    }

    fn vocab(&self) -> usize {
        self.gpu.vocab()
    }

    fn blocks(&self) -> usize {
        self.gpu.blocks()
    }

    fn block_size(&self) -> usize {
        self.gpu.block_size()
    }

    fn copy_blocks(&mut self, copies: &[BlockCopy]) {
        if self.failed.is_some() {
            return;
        }
        if let Err(e) = self.gpu.copy_blocks(copies) {
            self.failed = Some(format!("copying KV blocks on the GPU: {e}"));
        }
    }

    fn decode(&mut self, rows: &[DecodeRow<'_>], out: &mut Logits) -> Result<(), String> {
        if let Some(e) = self.failed.take() {
            return Err(e);
        }
        self.gpu.decode_into(rows, out).map_err(|e| e.to_string())
    }

    fn describe(&self) -> String {
        self.gpu.describe()
    }

    fn prepared_rows(&self) -> Vec<usize> {
        self.gpu.graph_rows()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use braid_model::{GptConfig, Layout};
    use std::sync::Arc;

    /// The engine thread takes its decoder: the GPU's must be `Send`.
    #[test]
    fn the_gpu_decoder_can_go_to_the_engine_thread() {
        fn send<T: Send>() {}
        send::<CudaDecoder>();
    }

    /// The GPU's cache is sized as the CPU's f32 cache: 2 (keys and
    /// values) × layers × block size × width × 4 bytes a block.
    #[test]
    fn a_gpu_cache_is_sized_from_its_byte_budget() {
        let cfg = GptConfig::parse("L2-H2-C16-V37-T24").unwrap();
        let params = Params::init_gpt2(Arc::new(Layout::new(&cfg)), 1);
        let per = 2 * 2 * 4 * 16 * 4;
        let f32 = KvDtype::F32;
        assert_eq!(
            CudaDecoder::blocks_in(&params.layout, 10 * per + 1, 4, f32),
            10
        );
        assert_eq!(
            CudaDecoder::blocks_in(&params.layout, 10 * per, 4, f32),
            CpuDecoder::blocks_in(&params.layout, 10 * per, 4)
        );
        assert_eq!(CudaDecoder::blocks_in(&params.layout, per - 1, 4, f32), 0);
    }
}
