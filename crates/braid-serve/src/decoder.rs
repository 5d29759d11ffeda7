//! [`Decoder`]: what the batcher asks of a model — one step over rows of
//! many sequences (their keys and values kept in the decoder's paged
//! cache), and the copies a write into a shared block needs — and
//! [`CpuDecoder`], the CPU's, over `braid_model`'s [`Gpt::decode`].

use braid_model::paged::BlockCopy;
use braid_model::{DecodeRow, Gpt, KvPages, Layout, Params};

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
    /// row that asks for them, in row order.
    fn decode(&mut self, rows: &[DecodeRow<'_>]) -> Result<Vec<Vec<f32>>, String>;
    /// What it runs on, for the banner (`cpu, f32`).
    fn describe(&self) -> String;
}

/// A decoder chosen at run time (the CPU's, or rank 0's of a
/// tensor-parallel server) is a decoder.
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

    fn decode(&mut self, rows: &[DecodeRow<'_>]) -> Result<Vec<Vec<f32>>, String> {
        (**self).decode(rows)
    }

    fn describe(&self) -> String {
        (**self).describe()
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

    fn decode(&mut self, rows: &[DecodeRow<'_>]) -> Result<Vec<Vec<f32>>, String> {
        self.gpt
            .decode(&self.params, &mut self.kv, rows)
            .map_err(|e| e.to_string())
    }

    fn describe(&self) -> String {
        format!(
            "cpu, f32, KV cache {} blocks of {}",
            self.kv.blocks(),
            self.kv.block_size()
        )
    }
}
