//! The buffers of a [`GpuGptMixed`] that hold nothing between steps —
//! what its forward pass saves for its backward pass, and the scratch
//! both passes share — listed by the part of the backward pass that reads
//! each for the last time, so that a strategy can lend them memory that
//! is idle while they live (ZeRO-3's gradient shard, or one process's
//! gradient buffer written unit by unit: [`crate::placement`]).
//!
//! Lent buffers ([`GpuGptMixed::place_saved`]) are views of the lender's
//! allocation; [`GpuGptMixed::own_saved`] drops them before the lender's
//! memory goes, and the next forward pass allocates them again.
//! [`GpuGptMixed::drop_saved`] gives all of them back before the lender's
//! memory is allocated, so that it can take their room.

use super::state::GpuGptMixed;
use crate::cuda::mixed_attention::{AttnSaved, AttnShared};
use braid_cuda::{CudaError, DeviceBuffer, DevicePool, Result, Stream};
use half::bf16;

/// The part of the backward pass that reads a buffer for the last time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SavedFor {
    /// The head (the final LayerNorm and the classifier).
    Head,
    /// Layer `l`'s block.
    Layer(usize),
    /// The embeddings' backward pass (the last part).
    Embedding,
}

/// One saved buffer, mutably.
enum SavedMut<'a> {
    F32(&'a mut DeviceBuffer<f32>),
    Bf16(&'a mut DeviceBuffer<bf16>),
}

impl SavedMut<'_> {
    fn len(&self) -> usize {
        match self {
            SavedMut::F32(b) => b.len(),
            SavedMut::Bf16(b) => b.len(),
        }
    }

    fn elem_size(&self) -> usize {
        match self {
            SavedMut::F32(_) => 4,
            SavedMut::Bf16(_) => 2,
        }
    }

    fn bytes(&self) -> usize {
        self.len() * self.elem_size()
    }

    fn is_lent(&self) -> bool {
        match self {
            SavedMut::F32(b) => b.is_lent(),
            SavedMut::Bf16(b) => b.is_lent(),
        }
    }

    /// Replaces the buffer by `len` elements over `memory` from byte `at`.
    ///
    /// # Safety
    /// As [`DeviceBuffer::lent_from`].
    unsafe fn lend(&mut self, memory: &DeviceBuffer<f32>, at: usize, len: usize) -> Result<()> {
        match self {
            // SAFETY: passed on to the caller.
            SavedMut::F32(b) => **b = unsafe { DeviceBuffer::lent_from(memory, at, len)? },
            // SAFETY: passed on to the caller.
            SavedMut::Bf16(b) => **b = unsafe { DeviceBuffer::lent_from(memory, at, len)? },
        }
        Ok(())
    }

    /// Replaces the buffer by an empty one (what it held is not needed).
    fn empty(&mut self, pool: &DevicePool) -> Result<()> {
        match self {
            SavedMut::F32(b) => **b = pool.uninit(0)?,
            SavedMut::Bf16(b) => **b = pool.uninit(0)?,
        }
        Ok(())
    }

    /// Replaces the buffer by `len` zeroed elements of its own.
    fn own(&mut self, pool: &DevicePool, s: &Stream, len: usize) -> Result<()> {
        match self {
            SavedMut::F32(b) => **b = pool.zeros(len, s)?,
            SavedMut::Bf16(b) => **b = pool.zeros(len, s)?,
        }
        Ok(())
    }
}

fn attn_saved<'a>(a: &'a mut AttnSaved, out: &mut Vec<SavedMut<'a>>) {
    match a {
        AttnSaved::Fused { qkv, lse } => {
            out.push(SavedMut::Bf16(qkv));
            out.push(SavedMut::F32(lse));
        }
        AttnSaved::Batched { q, k, v, att } => {
            out.push(SavedMut::Bf16(q));
            out.push(SavedMut::Bf16(k));
            out.push(SavedMut::Bf16(v));
            out.push(SavedMut::Bf16(att));
        }
    }
}

/// Every buffer that holds nothing between steps, in a fixed order:
/// each layer's saved ones (its input from the residual stream,
/// LayerNorm statistics, attention output, and what else it keeps); the
/// head's (its input, the final LayerNorm's output and statistics, the
/// logits, which its forward pass turns into the loss's gradient for its
/// backward pass, and with streamed weights the token embeddings it cast
/// to bf16); the scratch the layers share (read last by the
/// embeddings' backward pass, which reads `dresid`); checkpointing's
/// one block of activations and the fused attention's scratch (read last
/// by layer 0's). With them, the model's pool and stream (to allocate or
/// free them).
fn saved_of(m: &mut GpuGptMixed) -> (Vec<(SavedFor, SavedMut<'_>)>, &DevicePool, &Stream) {
    let GpuGptMixed {
        layers,
        resid,
        lnf,
        lnf_mean,
        lnf_rstd,
        logits,
        ln,
        wide,
        dresid,
        dresid_bf,
        dln,
        work,
        attn,
        streamed,
        pool,
        stream,
        ..
    } = m;
    let (inputs, head) = resid.split_at_mut(layers.len());
    let mut out = Vec::new();
    for (l, (layer, input)) in layers.iter_mut().zip(inputs).enumerate() {
        // (A pipeline stage's layout holds some of the layers.)
        let (Some(layer), Some(input)) = (layer, input) else {
            continue;
        };
        let mut bufs = vec![
            SavedMut::F32(input),
            SavedMut::F32(&mut layer.ln1_mean),
            SavedMut::F32(&mut layer.ln1_rstd),
            SavedMut::F32(&mut layer.ln2_mean),
            SavedMut::F32(&mut layer.ln2_rstd),
        ];
        if let Some(atty) = &mut layer.atty {
            bufs.push(SavedMut::Bf16(atty));
        }
        if let Some(lse) = &mut layer.lse {
            bufs.push(SavedMut::F32(lse));
        }
        if let Some(a) = &mut layer.attn {
            attn_saved(a, &mut bufs);
        }
        if let Some(acts) = &mut layer.acts {
            if let Some(a) = &mut acts.attn {
                attn_saved(a, &mut bufs);
            }
            bufs.push(SavedMut::F32(&mut acts.resid2));
            bufs.push(SavedMut::Bf16(&mut acts.fch));
        }
        out.extend(bufs.into_iter().map(|b| (SavedFor::Layer(l), b)));
    }
    let mut bufs: Vec<SavedMut<'_>> = head.iter_mut().flatten().map(SavedMut::F32).collect();
    bufs.extend([
        SavedMut::Bf16(lnf),
        SavedMut::F32(lnf_mean),
        SavedMut::F32(lnf_rstd),
        SavedMut::Bf16(logits),
    ]);
    if let Some(st) = streamed {
        // The token embeddings cast for the classifier: its backward pass
        // reads them last.
        bufs.push(SavedMut::Bf16(&mut st.wte));
    }
    out.extend(bufs.into_iter().map(|b| (SavedFor::Head, b)));
    let scratch = [
        SavedMut::Bf16(wide),
        SavedMut::F32(dresid),
        SavedMut::Bf16(ln),
        SavedMut::Bf16(dresid_bf),
        SavedMut::Bf16(dln),
    ];
    out.extend(scratch.map(|b| (SavedFor::Embedding, b)));
    let mut bufs = Vec::new();
    if let Some(acts) = work {
        if let Some(a) = &mut acts.attn {
            attn_saved(a, &mut bufs);
        }
        bufs.push(SavedMut::F32(&mut acts.resid2));
        bufs.push(SavedMut::Bf16(&mut acts.fch));
        if let Some(atty) = &mut acts.atty {
            bufs.push(SavedMut::Bf16(atty));
        }
    }
    if let AttnShared::Fused { dsum, score_grads } = attn {
        bufs.push(SavedMut::F32(dsum));
        if let Some(sg) = score_grads {
            bufs.push(SavedMut::Bf16(sg));
        }
    }
    out.extend(bufs.into_iter().map(|b| (SavedFor::Layer(0), b)));
    (out, pool, stream)
}

impl GpuGptMixed {
    /// The buffers the forward pass saves for the backward pass: which
    /// part reads each last, and its bytes, in the order
    /// [`place_saved`](Self::place_saved) takes offsets.
    pub fn saved_buffers(&mut self) -> Vec<(SavedFor, usize)> {
        let lens = self.unowned_saved.clone();
        saved_of(self)
            .0
            .iter()
            .enumerate()
            .map(|(i, (f, b))| {
                let bytes = match lens.get(i) {
                    Some(&len) if len > 0 => len * b.elem_size(),
                    _ => b.bytes(),
                };
                (*f, bytes)
            })
            .collect()
    }

    /// Moves saved buffer `i` into `memory` at byte `at[i]` (one entry per
    /// [`saved_buffers`](Self::saved_buffers) entry; `None`: keep its own
    /// memory) and gives the memory it had back to the device. Returns
    /// the bytes moved.
    ///
    /// # Safety
    /// `memory` must outlive the lent buffers: call
    /// [`own_saved`](Self::own_saved) before it is dropped. The caller
    /// writes the lent bytes only where the model no longer reads them (ZeRO-3:
    /// a gradient block's slice after the backward unit that reads its
    /// buffers last), in the order of the model's stream.
    pub unsafe fn place_saved(
        &mut self,
        memory: &DeviceBuffer<f32>,
        at: &[Option<usize>],
    ) -> Result<usize> {
        let count = saved_of(self).0.len();
        if at.len() != count {
            return Err(CudaError::Invalid(format!(
                "place_saved: {} offsets for {count} saved buffers",
                at.len(),
            )));
        }
        // Buffers given back by `drop_saved` are lent without being made
        // first, or made if they are not lent.
        let missing = std::mem::take(&mut self.unowned_saved);
        let (mut saved, pool, s) = saved_of(self);
        let mut moved = 0;
        for (i, ((_, buf), at)) in saved.iter_mut().zip(at).enumerate() {
            let missing = missing.get(i).copied().filter(|&len| len > 0);
            let len = missing.unwrap_or_else(|| buf.len());
            match *at {
                Some(at) => {
                    moved += len * buf.elem_size();
                    // SAFETY: passed on to the caller.
                    unsafe { buf.lend(memory, at, len)? };
                }
                None => {
                    if let Some(len) = missing {
                        buf.own(pool, s, len)?;
                    }
                }
            }
        }
        // What the pool cached of the old buffers goes back to the driver.
        self.stream.synchronize()?;
        self.pool.release()?;
        Ok(moved)
    }

    /// Gives the memory of every saved buffer back to the device (they
    /// hold nothing between steps): the next forward pass allocates them
    /// again, or [`place_saved`](Self::place_saved) lends them memory
    /// without their own being made first — so that the lender's memory
    /// can be allocated in their room.
    pub fn drop_saved(&mut self) -> Result<()> {
        let missing = std::mem::take(&mut self.unowned_saved);
        let (saved, pool, _) = saved_of(self);
        let mut lens = vec![0; saved.len()];
        for (i, (_, mut buf)) in saved.into_iter().enumerate() {
            lens[i] = match missing.get(i).copied().filter(|&len| len > 0) {
                Some(len) => len,
                None => buf.len(),
            };
            buf.empty(pool)?;
        }
        self.unowned_saved = lens;
        self.stream.synchronize()?;
        self.pool.release()
    }

    /// Drops the buffers lent by [`place_saved`](Self::place_saved) (their
    /// contents are not needed between steps); the next forward pass
    /// allocates them again from the model's own memory.
    pub fn own_saved(&mut self) -> Result<()> {
        // Buffers still missing (given back by `drop_saved`) stay so.
        let mut lens = std::mem::take(&mut self.unowned_saved);
        let (saved, pool, _) = saved_of(self);
        lens.resize(saved.len(), 0);
        for (i, (_, mut buf)) in saved.into_iter().enumerate() {
            if buf.is_lent() {
                lens[i] = buf.len();
                buf.empty(pool)?;
            }
        }
        if lens.iter().any(|&l| l > 0) {
            self.unowned_saved = lens;
        }
        Ok(())
    }

    /// Allocates the saved buffers [`own_saved`](Self::own_saved) dropped.
    pub(super) fn own_missing(&mut self) -> Result<()> {
        if self.unowned_saved.is_empty() {
            return Ok(());
        }
        let lens = std::mem::take(&mut self.unowned_saved);
        let (saved, pool, s) = saved_of(self);
        for ((_, mut buf), len) in saved.into_iter().zip(lens) {
            if len > 0 {
                buf.own(pool, s, len)?;
            }
        }
        Ok(())
    }
}
