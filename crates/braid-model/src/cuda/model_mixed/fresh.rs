//! Fresh gradients: a step's first backward pass of a [`GpuGptMixed`]
//! overwrites the weight matrices' gradients instead of adding to a
//! zeroed buffer.
//!
//! The products that form the weight gradients (four per layer, and the
//! classifier's token-embedding gradient where the vocabulary needs no
//! padding) run with `beta = 0` in that pass, so only the rest of the
//! buffer — biases, LayerNorms, position embeddings, the tensors the
//! kernels add into — is zeroed first: at 2.65B parameters 10.6 GB of
//! memset per step (2.7 ms on an H200, 1 % of the step) become a few MB.
//! `x·0 + y` and `y` are the same number, so the values are those of
//! zeroing the whole buffer (up to the sign of zeros). Under ZeRO-3 and
//! stage 2 every backward unit writes its blocks' buffers afresh, and
//! [`GpuGptMixed::begin_block_grads`] does the same for one block.
//!
//! Unit by unit ([`GpuGptMixed::begin_grads_by_unit`]), nothing is zeroed
//! when the step starts: each backward unit first zeroes what it adds into
//! of the runs it writes first ([`first_writes`]), so that until then the
//! memory of those runs holds nothing the step needs (one process lends it
//! to the activations saved for the backward pass: [`crate::placement`]).

use super::state::GpuGptMixed;
use crate::cuda::mixed::ZeroRuns;
use crate::layout::Layout;
use braid_cuda::memory::zero_async;
use braid_cuda::{CudaError, DeviceBuffer, DeviceWindow, Result};
use std::collections::HashMap;
use std::ops::Range;

/// Whether the next backward pass overwrites the weight gradients.
#[derive(Debug, Default)]
pub(super) struct FreshGrads {
    /// [`GpuGptMixed::begin_grads`] was called and no backward pass has
    /// run since.
    on: bool,
    /// A backward pass started while `on` (the next forward pass ends
    /// it: a second micro-batch adds).
    ran: bool,
    /// [`GpuGptMixed::added_runs`], worked out at the first use.
    runs: Option<Vec<Range<usize>>>,
    /// Per parameter block (its elements), the runs
    /// [`GpuGptMixed::begin_block_grads`] zeroes, on the device.
    zeroing: HashMap<(usize, usize), ZeroRuns>,
}

impl FreshGrads {
    /// `beta` for a weight gradient's product: 0 in a fresh pass.
    pub(super) fn beta(&self) -> f32 {
        match self.on {
            true => 0.0,
            false => 1.0,
        }
    }

    /// A backward pass starts.
    pub(super) fn backward_starts(&mut self) {
        self.ran = self.on;
    }

    /// A forward pass starts: after a fresh backward pass, the next ones
    /// add.
    pub(super) fn forward_starts(&mut self) {
        if self.ran {
            (self.on, self.ran) = (false, false);
        }
    }
}

impl GpuGptMixed {
    /// Prepares `g` (the whole gradient buffer) for a step: the next
    /// backward pass overwrites the weight matrices' gradients, and the
    /// rest of `g` is zeroed now. Same values as zeroing all of `g`.
    pub fn begin_grads(&mut self, g: &mut DeviceBuffer<f32>) -> Result<()> {
        self.begin_block_grads(0..self.layout.len, g)?;
        self.fresh.ran = false;
        Ok(())
    }

    /// Prepares `g`, the gradients of the layout's elements `block` (one
    /// parameter block), for the backward unit that writes them: the
    /// next backward pass overwrites the weight matrices' gradients, and
    /// the rest of `g` is zeroed now.
    pub fn begin_block_grads(
        &mut self,
        block: Range<usize>,
        g: &mut DeviceBuffer<f32>,
    ) -> Result<()> {
        if g.len() != block.len() || block.end > self.layout.len {
            return Err(CudaError::Invalid(format!(
                "begin_block_grads: {} gradients for the block of elements {block:?} (a model \
                 of {})",
                g.len(),
                self.layout.len
            )));
        }
        // The block's runs, as the block's elements, zeroed in one launch
        // (a memset per run costs the host a call each: ~50 at 124M,
        // 0.2 ms of an idle GPU at a step's start).
        let key = (block.start, block.end);
        if !self.fresh.zeroing.contains_key(&key) {
            let runs: Vec<Range<usize>> = self
                .added_within(std::slice::from_ref(&block))
                .into_iter()
                .map(|r| r.start - block.start..r.end - block.start)
                .collect();
            let z = ZeroRuns::new(self.stream.device(), &runs, block.len())?;
            self.fresh.zeroing.insert(key, z);
        }
        let z = &self.fresh.zeroing[&key];
        self.mk.zero_runs(&self.stream, g, z)?;
        self.fresh.on = true;
        Ok(())
    }

    /// Prepares the whole gradient buffer for a step written unit by unit:
    /// nothing is zeroed now; the next backward pass overwrites the weight
    /// matrices' gradients, and each of its units first zeroes the rest of
    /// what it writes first ([`zero_unit_grads`](Self::zero_unit_grads)).
    /// Same values as [`begin_grads`](Self::begin_grads).
    pub fn begin_grads_by_unit(&mut self) {
        self.fresh.on = true;
        self.fresh.ran = false;
    }

    /// Before a backward unit of a step begun by
    /// [`begin_grads_by_unit`](Self::begin_grads_by_unit): zeroes, of
    /// `runs` (the gradient buffer's elements that unit writes first,
    /// [`first_writes`]), what its products add into rather than
    /// overwrite. Nothing in later micro-batches (they add).
    pub fn zero_unit_grads(
        &mut self,
        runs: &[Range<usize>],
        g: &mut DeviceWindow<'_, f32>,
    ) -> Result<()> {
        if !self.fresh.on {
            return Ok(());
        }
        for r in self.added_within(runs) {
            zero_async(&mut g.view_mut(r)?, &self.stream)?;
        }
        Ok(())
    }

    /// The elements of `ranges` (in layout order, not overlapping) that a
    /// fresh pass's products do not overwrite, as runs.
    fn added_within(&mut self, ranges: &[Range<usize>]) -> Vec<Range<usize>> {
        let added = self.added_runs();
        let within = ranges
            .iter()
            .flat_map(|r| {
                added.iter().filter_map(|a| {
                    let (from, to) = (r.start.max(a.start), r.end.min(a.end));
                    (from < to).then_some(from..to)
                })
            })
            .collect();
        self.fresh.runs = Some(added);
        within
    }

    /// The elements of the gradient buffer outside what a fresh pass's
    /// products overwrite, as runs in layout order (fixed by the model's
    /// shapes: worked out once; the caller puts them back in
    /// `self.fresh.runs`).
    fn added_runs(&mut self) -> Vec<Range<usize>> {
        if let Some(runs) = self.fresh.runs.take() {
            return runs;
        }
        let mut written: Vec<Range<usize>> = self
            .ranges
            .iter()
            .flatten()
            .flat_map(|r| {
                [
                    r.qkv_w.clone(),
                    r.proj_w.clone(),
                    r.fc_w.clone(),
                    r.fcproj_w.clone(),
                ]
            })
            .collect();
        if self.pad.is_none() {
            written.push(self.range("wte.weight"));
        }
        complement(written, self.layout.len)
    }
}

/// For each backward unit of the bf16 model's whole-model plan (unit 0
/// the head, unit `n - l` layer `l`, unit `n + 1` the embeddings), the
/// runs of the gradient buffer it writes before any other unit does, in
/// layout order, adjacent runs merged: the head the token embeddings
/// (the tied classifier), the final norm and the last layer's output
/// bias (its LayerNorm backward's column sums); layer `l` the rest of its
/// block and the output bias of layer `l - 1`; the embeddings the
/// position embeddings. Together they are every parameter, once; a
/// padded layout's gaps are in none (nothing writes them).
pub fn first_writes(layout: &Layout) -> Vec<Vec<Range<usize>>> {
    let n = layout.config.n_layer;
    let bias = |l: usize| format!("h.{l}.mlp.c_proj.bias");
    let mut units: Vec<Vec<Range<usize>>> = vec![Vec::new(); n + 2];
    for p in &layout.params {
        let unit = match p.name.as_str() {
            "wte.weight" | "ln_f.weight" | "ln_f.bias" => 0,
            "wpe.weight" => n + 1,
            name => {
                let l: usize = name
                    .strip_prefix("h.")
                    .and_then(|r| r.split('.').next())
                    .and_then(|l| l.parse().ok())
                    .unwrap_or(n);
                match name == bias(l) {
                    // Written by the pass of the layer above (or the head).
                    true => n - l - 1,
                    false => n - l,
                }
            }
        };
        if let Some(runs) = units.get_mut(unit) {
            match runs.last_mut() {
                Some(last) if last.end == p.offset => last.end = p.offset + p.len,
                _ => runs.push(p.range()),
            }
        }
    }
    for runs in &mut units {
        runs.sort_by_key(|r| r.start);
    }
    units
}

/// The runs of `0..len` outside `ranges` (which do not overlap).
fn complement(mut ranges: Vec<Range<usize>>, len: usize) -> Vec<Range<usize>> {
    ranges.sort_by_key(|r| r.start);
    let mut out = Vec::new();
    let mut at = 0;
    for r in ranges {
        if r.start > at {
            out.push(at..r.start);
        }
        at = at.max(r.end);
    }
    if at < len {
        out.push(at..len);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::{complement, first_writes};
    use crate::{GptConfig, Layout};

    #[test]
    fn first_writes_cover_every_parameter_once_in_the_units_that_write_them() {
        for (name, multiple) in [("L3-H2-C16-V50-T8", 1), ("L12-H4-C32-V97-T16", 64)] {
            let layout = Layout::padded(&GptConfig::parse(name).unwrap(), multiple);
            let n = layout.config.n_layer;
            let units = first_writes(&layout);
            assert_eq!(units.len(), n + 2);
            let mut seen = vec![0u8; layout.len];
            for runs in &units {
                for r in runs {
                    seen[r.clone()].iter_mut().for_each(|s| *s += 1);
                }
            }
            for p in &layout.params {
                assert!(
                    seen[p.range()].iter().all(|&s| s == 1),
                    "{name}: {}",
                    p.name
                );
            }
            let params: usize = layout.params.iter().map(|p| p.len).sum();
            assert_eq!(seen.iter().filter(|&&s| s == 1).count(), params);
            // Layer l's unit: its block but its own output bias, and the
            // output bias of the layer below; the head: the token
            // embeddings, the last layer's output bias, the final norm.
            let range = |s: &str| layout.get(s).unwrap().range();
            let elems = |runs: &[std::ops::Range<usize>]| {
                let mut e: Vec<usize> = runs.iter().flat_map(|r| r.clone()).collect();
                e.sort();
                e
            };
            let l = 1;
            let block = layout.block_range(crate::Block::Layer(l));
            let own = range(&format!("h.{l}.mlp.c_proj.bias"));
            let below = range(&format!("h.{}.mlp.c_proj.bias", l - 1));
            assert_eq!(
                elems(&units[n - l]),
                elems(&[below, block.start..own.start])
            );
            let head = [
                range("wte.weight"),
                range(&format!("h.{}.mlp.c_proj.bias", n - 1)),
                range("ln_f.weight"),
                range("ln_f.bias"),
            ];
            assert_eq!(elems(&units[0]), elems(&head));
            assert_eq!(units[n + 1], vec![range("wpe.weight")]);
        }
    }

    #[test]
    fn complement_lists_the_gaps_in_order() {
        assert_eq!(complement(vec![4..6, 0..2], 9), vec![2..4, 6..9]);
        let whole: Vec<std::ops::Range<usize>> = std::iter::once(0..9).collect();
        assert!(complement(whole, 9).is_empty());
        assert_eq!(complement(vec![], 3), vec![0..3]);
    }
}
