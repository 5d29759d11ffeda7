//! One batch on the GPU, shared by both GPU models: tokens and targets
//! checked against the model's shape and uploaded, the loss-gradient scale
//! and mean loss over the counted targets (`u32::MAX` = not counted), and
//! the embedding backward pass over positions grouped by token.
//!
//! The uploads are asynchronous, from pinned memory, on the device's main
//! stream (the models' stream): the host does not wait for them, and the
//! grouping by token is worked out and uploaded at the embedding backward
//! pass — while the GPU still runs the layers' backward passes queued
//! before it — rather than before the forward pass could start.

use super::kernels::{token_buckets, Kernels, VocabRows};
use braid_cuda::memory::PinnedBuffer;
use braid_cuda::{CudaError, Device, DeviceBuffer, DeviceMem, Event, Result, Stream};

/// Device and host copies of one batch.
pub struct DeviceBatch {
    tokens: DeviceBuffer<i32>,
    targets: DeviceBuffer<i32>,
    host_tokens: Vec<u32>,
    host_targets: Vec<u32>,
    bucket_order: DeviceBuffer<i32>,
    bucket_starts: DeviceBuffer<i32>,
    vocab: usize,
    /// Pinned host memory the uploads go from: the tokens, the targets,
    /// the grouping's order (`n` each) and its starts (`vocab + 1`).
    staging: PinnedBuffer<i32>,
    /// Recorded after the last copies of the tokens and targets out of
    /// `staging`, and after those of the grouping: the host waits for
    /// each before writing that part again.
    copied: [Event; 2],
    /// Whether this batch's grouping by token is on the device.
    grouped: bool,
}

impl DeviceBatch {
    /// Buffers for `n` positions over a vocabulary of `vocab`.
    pub fn new(device: &Device, n: usize, vocab: usize) -> Result<DeviceBatch> {
        Ok(DeviceBatch {
            tokens: DeviceBuffer::zeros(device, n)?,
            targets: DeviceBuffer::zeros(device, n)?,
            host_tokens: vec![0; n],
            host_targets: vec![0; n],
            bucket_order: DeviceBuffer::zeros(device, n)?,
            bucket_starts: DeviceBuffer::zeros(device, vocab + 1)?,
            vocab,
            staging: PinnedBuffer::zeros(device, 3 * n + vocab + 1)?,
            copied: [Event::new(device)?, Event::new(device)?],
            grouped: false,
        })
    }

    /// Checks a batch of `b × t` (context `context`) and uploads it.
    pub fn upload(
        &mut self,
        tokens: &[u32],
        targets: &[u32],
        b: usize,
        t: usize,
        context: usize,
    ) -> Result<()> {
        let n = self.host_tokens.len();
        if tokens.len() != n || targets.len() != n || t > context {
            return Err(CudaError::Invalid(format!(
                "{} tokens / {} targets for a batch of {b} x {t} (context {context})",
                tokens.len(),
                targets.len(),
            )));
        }
        if let Some(&bad) = tokens.iter().find(|&&x| x as usize >= self.vocab) {
            return Err(CudaError::Invalid(format!(
                "token {bad} is not below the vocabulary size {}",
                self.vocab
            )));
        }
        self.host_tokens.copy_from_slice(tokens);
        self.host_targets.copy_from_slice(targets);
        // The last batch's copies out of this part of the staging memory
        // are done (the step that used it waited for its loss long ago).
        self.copied[0].synchronize()?;
        let s = self.tokens.device().main_stream();
        let staged = self.staging.as_mut_slice();
        for (d, &x) in staged[..n].iter_mut().zip(tokens) {
            *d = x as i32;
        }
        for (d, &x) in staged[n..2 * n].iter_mut().zip(targets) {
            *d = x as i32;
        }
        self.staging.copy_out_async(0, &mut self.tokens, &s)?;
        self.staging.copy_out_async(n, &mut self.targets, &s)?;
        self.copied[0].record(&s)?;
        self.grouped = false;
        Ok(())
    }

    /// The embedding backward's grouping of positions by token, worked out
    /// and queued on `s` once per batch, before the first kernel that reads
    /// it: the host is ahead of the GPU by then.
    fn group_by_token(&mut self, s: &Stream) -> Result<()> {
        if self.grouped {
            return Ok(());
        }
        let n = self.host_tokens.len();
        let (order, starts) = token_buckets(&self.host_tokens, self.vocab);
        self.copied[1].synchronize()?;
        let staged = self.staging.as_mut_slice();
        staged[2 * n..3 * n].copy_from_slice(&order);
        staged[3 * n..].copy_from_slice(&starts);
        self.staging
            .copy_out_async(2 * n, &mut self.bucket_order, s)?;
        self.staging
            .copy_out_async(3 * n, &mut self.bucket_starts, s)?;
        self.copied[1].record(s)?;
        self.grouped = true;
        Ok(())
    }

    /// The tokens on the device.
    pub fn tokens(&self) -> &DeviceBuffer<i32> {
        &self.tokens
    }

    /// The targets on the device.
    pub fn targets(&self) -> &DeviceBuffer<i32> {
        &self.targets
    }

    fn counted(&self) -> usize {
        self.host_targets.iter().filter(|&&x| x != u32::MAX).count()
    }

    /// The factor the loss gradient is scaled by: 1 / counted targets with
    /// `grad`, 0 (no gradient) without.
    pub fn loss_scale(&self, grad: bool) -> f32 {
        match self.counted() {
            c if grad && c > 0 => 1.0 / c as f32,
            _ => 0.0,
        }
    }

    /// Mean of the per-position `losses` (after the stream is done) over the
    /// counted targets.
    pub fn mean_loss(&self, losses: &DeviceBuffer<f32>) -> Result<f32> {
        let losses = losses.to_vec()?;
        let mut sum = 0.0f64;
        for (l, &tg) in losses.iter().zip(&self.host_targets) {
            if tg != u32::MAX {
                sum += *l as f64;
            }
        }
        let counted = self.counted();
        Ok(if counted == 0 {
            0.0
        } else {
            (sum / counted as f64) as f32
        })
    }

    /// Embedding gradients from `dout` (f32 rows of `c`): positions grouped
    /// by token (uploaded with the batch), so nothing here waits.
    #[allow(clippy::too_many_arguments)]
    pub fn embedding_backward(
        &mut self,
        k: &Kernels,
        s: &Stream,
        dwte: &mut impl DeviceMem<f32>,
        dwpe: &mut impl DeviceMem<f32>,
        dout: &impl DeviceMem<f32>,
        t: usize,
        c: usize,
    ) -> Result<()> {
        self.group_by_token(s)?;
        k.encoder_backward(
            s,
            dwte,
            dwpe,
            dout,
            &self.bucket_order,
            &self.bucket_starts,
            self.host_tokens.len(),
            t,
            c,
            self.vocab,
        )
    }

    /// [`embedding_backward`](Self::embedding_backward) of a
    /// tensor-parallel rank: `dwte` holds the vocabulary's `rows` only
    /// (the tokens of other rows add nothing here); `dwpe` whole.
    #[allow(clippy::too_many_arguments)]
    pub fn embedding_backward_rows(
        &mut self,
        k: &Kernels,
        s: &Stream,
        dwte: &mut impl DeviceMem<f32>,
        dwpe: &mut impl DeviceMem<f32>,
        dout: &impl DeviceMem<f32>,
        t: usize,
        c: usize,
        rows: VocabRows,
    ) -> Result<()> {
        self.group_by_token(s)?;
        if rows.first + rows.v > self.vocab {
            return Err(CudaError::Invalid(format!(
                "vocabulary rows {}..{} of {}",
                rows.first,
                rows.first + rows.v,
                self.vocab
            )));
        }
        // The buckets of this rank's tokens: `starts` from its first row.
        let starts = self.bucket_starts.view(rows.first..rows.first + rows.v + 1);
        k.encoder_backward(
            s,
            dwte,
            dwpe,
            dout,
            &self.bucket_order,
            &starts,
            self.host_tokens.len(),
            t,
            c,
            rows.v,
        )
    }
}
