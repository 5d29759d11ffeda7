//! [`Engine`]: what the training loop and every parallel strategy need from
//! a model — flat parameters, a flat gradient buffer, a forward pass, a
//! backward pass in units that each declare which gradients they finish,
//! the gradient norm and an optimizer step.
//!
//! Nothing here is GPT-specific: the GPT engines ([`crate::engines`]) and
//! the course's MLP (`examples/ddp_mlp`) implement the same trait, and
//! data-parallel training works on anything that does.

use crate::space::Space;
use crate::Result;
use std::ops::Range;

/// The flat buffer type of an engine's space.
pub type Flat<E> = <<E as Engine>::Space as Space>::Flat;

/// The gradient window type of an engine's space.
pub type Window<'a, E> = <<E as Engine>::Space as Space>::Window<'a>;

/// One step of the backward pass and the gradients it finishes.
///
/// Units run in order; after unit `i`, the elements `finalizes` of the
/// gradient buffer never change again this step (an empty range: nothing
/// final yet). Each finished range must lie at one end of what is still
/// being written, so that it can be handed to a reduction while the engine
/// goes on (the GPT engines finish the final norm, then the layers from
/// the last, from the buffer's end; the embeddings last).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unit {
    /// For messages and traces (`layer 3`).
    pub name: String,
    /// Gradient elements final after this unit.
    pub finalizes: Range<usize>,
}

/// A two-dimensional parameter inside the flat buffer: `rows × cols`
/// elements, row-major, from `offset` (gradient compression by low-rank
/// approximation works on these).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Matrix {
    /// First element.
    pub offset: usize,
    /// Rows.
    pub rows: usize,
    /// Columns.
    pub cols: usize,
}

impl Matrix {
    /// Its elements in the flat buffer.
    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.rows * self.cols
    }
}

/// A buffer an engine's forward pass saves for its backward pass
/// ([`Engine::saved_buffers`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SavedBuffer {
    /// Its size.
    pub bytes: usize,
    /// The backward unit that reads it for the last time.
    pub last_read: usize,
    /// The first forward unit that writes it (no unit before it does).
    pub first_write: usize,
}

/// One optimizer update.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct UpdateStep {
    /// Learning rate.
    pub lr: f32,
    /// 1-based step number (Adam's bias correction).
    pub step: u32,
    /// Every gradient is multiplied by this before use: the loop's
    /// averaging over ranks and micro-batches and the clipping factor,
    /// folded into the update instead of a pass over the gradients.
    pub grad_scale: f32,
}

/// Bytes of model state one rank holds, by part, from what was allocated
/// (ZeRO's accounting: parameters, gradients, optimizer state).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StateBytes {
    /// The parameters the passes read: f32, or the bf16 copy under mixed
    /// precision (0 when the engine casts them layer by layer).
    pub params: u64,
    /// f32 master weights kept beside a bf16 copy (0 when the parameters
    /// are the master weights).
    pub master: u64,
    /// The gradient buffer (the loop's).
    pub grads: u64,
    /// The optimizer's state (AdamW's two moments, SGD's momentum).
    pub optimizer: u64,
    /// How much of the above lives in host memory instead of the
    /// engine's device (an offloaded optimizer's master weights, moments
    /// and transfer buffers); 0 where everything is in one place.
    pub offloaded: u64,
}

impl StateBytes {
    /// All of it.
    pub fn total(&self) -> u64 {
        self.params + self.master + self.grads + self.optimizer
    }
}

/// Device memory a parameter-sharded strategy holds besides model state
/// ([`crate::Strategy::sharded_bytes`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ShardedBytes {
    /// The most bytes of whole blocks (gathered parameters, block
    /// gradients, freed buffers kept for reuse) held at once.
    pub units_peak: u64,
    /// Bytes of the engine's saved activations living in the gradient
    /// shard's memory.
    pub saved_in_grads: u64,
    /// Block buffers made (none of the spares fitted) in the last step,
    /// and in all steps before it: each costs an allocation, and on GPUs a
    /// wait for the engine's stream (or, for copy-engine gathers, a
    /// window registration on every rank).
    pub buffers_made: (u64, u64),
}

/// A named tensor of the flat parameter buffer: checkpoints store the
/// model by these names and element offsets, so that a checkpoint written
/// under one layout of the flat buffer (padded for sharding, or not)
/// loads under another.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamedTensor {
    /// Its name (Hugging Face's, for the GPT engines).
    pub name: String,
    /// The whole model's shape of it (row-major).
    pub shape: Vec<usize>,
    /// Its elements of the flat buffer.
    pub range: Range<usize>,
    /// Where those elements sit in the whole tensor when the buffer holds
    /// only part of it (a tensor-parallel rank's); `None`: all of it.
    pub place: Option<braid_model::place::Place>,
    /// Whether this rank's checkpoints store it: a tensor that every
    /// tensor-parallel rank holds whole is stored by the first only.
    pub stored: bool,
}

impl NamedTensor {
    /// A tensor held whole.
    pub fn whole(name: impl Into<String>, shape: Vec<usize>, range: Range<usize>) -> NamedTensor {
        NamedTensor {
            name: name.into(),
            shape,
            range,
            place: None,
            stored: true,
        }
    }

    /// A tensor of the model that another rank holds (a pipeline's other
    /// stages): listed so that a checkpoint names the whole model and
    /// checks every tensor is covered; no elements here, never stored by
    /// this rank.
    pub fn elsewhere(name: impl Into<String>, shape: Vec<usize>) -> NamedTensor {
        NamedTensor {
            name: name.into(),
            shape,
            range: 0..0,
            place: None,
            stored: false,
        }
    }

    /// Its place: the one it records, or the whole tensor.
    pub fn place(&self) -> braid_model::place::Place {
        self.place
            .clone()
            .unwrap_or_else(|| braid_model::place::Place::whole(&self.shape))
    }
}

/// An optimizer's state copied to host memory (for a checkpoint): each
/// moment holds the elements asked for, their ranges one after another.
#[derive(Debug, Clone, PartialEq)]
pub struct OptimizerState {
    /// `adamw` or `sgd`.
    pub kind: String,
    /// The moments by PyTorch's names (`exp_avg` and `exp_avg_sq` for
    /// AdamW, `momentum_buffer` for SGD) and their values.
    pub moments: Vec<(String, Vec<f32>)>,
}

/// Where the elements `want` (flat ranges, each inside one range of
/// `shard`) sit in state laid out like `shard` (its ranges one after
/// another), or which one is outside it.
pub fn state_ranges(shard: &[Range<usize>], want: &[Range<usize>]) -> Result<Vec<Range<usize>>> {
    let mut starts = Vec::with_capacity(shard.len());
    let mut at = 0;
    for s in shard {
        starts.push(at);
        at += s.len();
    }
    want.iter()
        .map(|w| {
            shard
                .iter()
                .zip(&starts)
                .find(|(s, _)| s.start <= w.start && w.end <= s.end)
                .map(|(s, at)| at + (w.start - s.start)..at + (w.end - s.start))
                .ok_or_else(|| {
                    format!("elements {w:?} are not inside one range of the optimizer's shard")
                })
        })
        .collect()
}

/// How a model's parameters split into the units a parameter-sharded
/// strategy (ZeRO stage 3, FSDP) gathers one at a time, and which units
/// of each pass read and write which of them.
///
/// Blocks are numbered by their place in [`blocks`](Self::blocks); the
/// forward units run in the order listed, the backward units are those of
/// [`Engine::units`], in order. A block's gradient is final after the last
/// backward unit that writes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamUnits {
    /// The parameter blocks: ranges of the flat buffer, increasing,
    /// together covering it.
    pub blocks: Vec<Range<usize>>,
    /// For each forward unit, the blocks whose parameters it reads.
    pub forward: Vec<Vec<usize>>,
    /// For each backward unit, the blocks whose parameters it reads.
    pub backward_reads: Vec<Vec<usize>>,
    /// For each backward unit, the blocks whose gradients it adds to.
    pub backward_writes: Vec<Vec<usize>>,
}

impl ParamUnits {
    /// Whether the blocks cover `0..len` in order and every unit names
    /// blocks that exist, or what is wrong.
    pub fn check(&self, len: usize, backward_units: usize) -> Result<()> {
        let mut at = 0;
        for (i, b) in self.blocks.iter().enumerate() {
            if b.start != at || b.end < b.start {
                return Err(format!(
                    "parameter block {i} is {b:?}: blocks must follow one another from 0"
                ));
            }
            at = b.end;
        }
        if at != len {
            return Err(format!(
                "the parameter blocks cover {at} of the {len} parameters"
            ));
        }
        if self.backward_reads.len() != backward_units
            || self.backward_writes.len() != backward_units
        {
            return Err(format!(
                "the parameter units describe {} / {} backward units, the engine runs {backward_units}",
                self.backward_reads.len(),
                self.backward_writes.len()
            ));
        }
        let lists = self
            .forward
            .iter()
            .chain(&self.backward_reads)
            .chain(&self.backward_writes);
        for list in lists {
            if let Some(b) = list.iter().find(|&&b| b >= self.blocks.len()) {
                return Err(format!(
                    "a unit names parameter block {b} of {}",
                    self.blocks.len()
                ));
            }
        }
        Ok(())
    }

    /// Forward unit `unit`'s blocks, checked against the lengths of the
    /// buffers given for them (`lens`, in order).
    pub fn forward_given(&self, unit: usize, lens: &[usize]) -> Result<&[usize]> {
        self.reads_given("forward", &self.forward, unit, lens)
    }

    /// Backward unit `unit`'s blocks read, checked against the lengths of
    /// the parameter buffers given for them.
    pub fn backward_reads_given(&self, unit: usize, lens: &[usize]) -> Result<&[usize]> {
        self.reads_given("backward", &self.backward_reads, unit, lens)
    }

    /// Unit `unit`'s blocks of `lists` (the `pass`'s reads), checked
    /// against the lengths of the buffers given for them.
    fn reads_given<'a>(
        &self,
        pass: &str,
        lists: &'a [Vec<usize>],
        unit: usize,
        lens: &[usize],
    ) -> Result<&'a [usize]> {
        let what = format!("{pass} unit {unit}");
        let want = lists
            .get(unit)
            .ok_or_else(|| format!("{what} does not exist"))?;
        self.check_lens(&what, want, lens)?;
        Ok(want)
    }

    /// Backward unit `unit`'s blocks, read and written, checked against
    /// the lengths of the parameter and gradient buffers given for them.
    pub fn backward_given(
        &self,
        unit: usize,
        params: &[usize],
        grads: &[usize],
    ) -> Result<(&[usize], &[usize])> {
        let what = format!("backward unit {unit}");
        let (reads, writes) = match (
            self.backward_reads.get(unit),
            self.backward_writes.get(unit),
        ) {
            (Some(r), Some(w)) => (r, w),
            _ => return Err(format!("{what} does not exist")),
        };
        self.check_lens(&what, reads, params)?;
        self.check_lens(&what, writes, grads)?;
        Ok((reads, writes))
    }

    /// Whether buffers of `lens` elements are the blocks `want`, in order,
    /// or what `what` was given instead.
    fn check_lens(&self, what: &str, want: &[usize], lens: &[usize]) -> Result<()> {
        let blocks: Vec<usize> = want.iter().map(|&b| self.blocks[b].len()).collect();
        match blocks == lens {
            true => Ok(()),
            false => Err(format!(
                "{what}: got buffers of {lens:?} elements for parameter blocks {want:?} \
                 ({blocks:?} elements)"
            )),
        }
    }

    /// For each block, the backward units after which its gradients are
    /// reduced, in order (none: no unit writes it): the last unit writing
    /// it (then its gradient is final) and, when `split`, also the last
    /// unit of every earlier run of consecutive units writing it — the
    /// tied embeddings, written by the head first and by the embedding
    /// unit last, are reduced in two parts, and no buffer holds their
    /// gradients in between.
    pub fn reduce_after(&self, split: bool) -> Vec<Vec<usize>> {
        let mut after: Vec<Vec<usize>> = vec![Vec::new(); self.blocks.len()];
        let units = self.backward_writes.len();
        for (u, writes) in self.backward_writes.iter().enumerate() {
            for &b in writes {
                let written_next = u + 1 < units && self.backward_writes[u + 1].contains(&b);
                let written_later = self.backward_writes[u + 1..].iter().any(|w| w.contains(&b));
                if !written_later || (split && !written_next) {
                    after[b].push(u);
                }
            }
        }
        after
    }
}

/// `shard` for [`Engine::shard_optimizer`] over `len` parameters, or why
/// not: ranges must be non-empty, increasing, not overlapping, inside.
pub fn check_shard(shard: &[Range<usize>], len: usize) -> Result<()> {
    let mut after = 0;
    for r in shard {
        if r.is_empty() || r.start < after || r.end > len {
            return Err(format!(
                "optimizer shard {shard:?}: ranges must be non-empty and increase without \
                 overlap inside the {len} parameters"
            ));
        }
        after = r.end;
    }
    Ok(())
}

/// A model that can be trained by [`crate::trainer::train`] under any
/// [`crate::strategy::Strategy`].
pub trait Engine {
    /// Where parameters and gradients live.
    type Space: Space;
    /// One micro-batch of input.
    type Batch;

    /// What must agree across data-parallel ranks (model configuration,
    /// shapes, precision); compared at start, and a rank that differs is
    /// named.
    fn describe(&self) -> String;

    /// The flat parameters (f32; master weights under mixed precision).
    fn params(&self) -> &Flat<Self>;

    /// The flat parameters, writable (rank 0's are broadcast into them).
    /// Call [`params_changed`](Self::params_changed) after writing.
    fn params_mut(&mut self) -> &mut Flat<Self>;

    /// Refreshes whatever derives from the parameters (a bf16 copy) after
    /// they were overwritten.
    fn params_changed(&mut self) -> Result<()>;

    /// Replaces the whole parameters by `values` (a resumed run's): by
    /// default written into [`params_mut`](Self::params_mut), then
    /// [`params_changed`](Self::params_changed). An engine whose master
    /// weights live elsewhere (an offloaded optimizer's, in host memory)
    /// puts them there.
    fn load_params(&mut self, values: &[f32]) -> Result<()> {
        let whole = 0..<Self::Space as Space>::len(self.params());
        <Self::Space as Space>::write_ranges(
            self.params_mut(),
            std::slice::from_ref(&whole),
            values,
        )?;
        self.params_changed()
    }

    /// The parameters, when their master copy lives in host memory
    /// instead of the engine's space (an optimizer offloaded to the host):
    /// then [`params`](Self::params) may be empty, and strategies compare
    /// these across ranks instead of broadcasting. `None` by default.
    fn host_params(&self) -> Option<&[f32]> {
        None
    }

    /// The parameters, while they wait in host memory for a ZeRO-3
    /// strategy to upload its shard of them (an engine built for
    /// sharding): [`params`](Self::params) is empty meanwhile, no pass
    /// runs, and ranks compare these instead of broadcasting. `None` by
    /// default.
    fn pending_params(&self) -> Option<&[f32]> {
        None
    }

    /// A zeroed gradient buffer the size of the parameters.
    fn new_grads(&self) -> Result<Flat<Self>>;

    /// Sets `grads` to zero (queued, on a GPU), or, where the engine's
    /// next backward pass overwrites part of it, zeroes the rest: either
    /// way that pass's gradients come out as if added to zeros.
    fn zero_grads(&mut self, grads: &mut Flat<Self>) -> Result<()>;

    /// Prepares `grads`, the gradient buffer of parameter block `block`
    /// of [`param_units`](Self::param_units), for a backward unit that
    /// writes it: zeroes it (the default), or, where the engine's next
    /// backward pass overwrites some of it, the rest.
    fn zero_block_grads(&mut self, block: usize, grads: &mut Flat<Self>) -> Result<()> {
        let _ = block;
        self.zero_grads(grads)
    }

    /// The backward pass's units, in the order they run.
    fn units(&self) -> Vec<Unit>;

    /// How many units [`units`](Self::units) lists (asked every step: an
    /// engine can answer without building the list).
    fn unit_count(&self) -> usize {
        self.units().len()
    }

    /// The two-dimensional parameters (low-rank gradient compression
    /// applies to those; everything else is reduced as it is). None by
    /// default.
    fn matrices(&self) -> Vec<Matrix> {
        Vec::new()
    }

    /// Forward pass on `batch`; with `grad`, keeps what the backward pass
    /// needs. Returns the mean loss over the batch.
    fn forward(&mut self, batch: &Self::Batch, grad: bool) -> Result<f32>;

    /// Runs backward unit `unit` (after those before it, following a
    /// forward pass with `grad`), adding its gradients into `grads`, which
    /// holds the buffer elements not yet handed on.
    fn backward_unit(&mut self, unit: usize, grads: &mut Window<'_, Self>) -> Result<()>;

    /// The sum of squares of `grads` (waits for queued work).
    fn grad_sq_norm(&mut self, grads: &Flat<Self>) -> Result<f64>;

    /// The sum of squares of the elements `ranges` of `grads` (a sharded
    /// strategy's part of the gradient norm; waits for queued work).
    /// Engines without it refuse.
    fn grad_sq_norm_of(&mut self, _grads: &Flat<Self>, ranges: &[Range<usize>]) -> Result<f64> {
        Err(format!(
            "this engine cannot sum the squares of part of its gradients (asked for {} ranges)",
            ranges.len()
        ))
    }

    /// The sum of squares of `compact`, the gradients of the flat elements
    /// `ranges` one after another (a ZeRO-3 rank's reduce-scattered
    /// shard). By default that of `compact` alone; an engine whose norm
    /// weighs elements by where they sit (a tensor-parallel rank counts
    /// the tensors its whole group holds once) looks at `ranges`.
    fn grad_sq_norm_compact(
        &mut self,
        compact: &Flat<Self>,
        _ranges: &[Range<usize>],
    ) -> Result<f64> {
        self.grad_sq_norm(compact)
    }

    /// One optimizer update of the parameters from `grads` (of the
    /// optimizer's shard only, after [`shard_optimizer`](Self::shard_optimizer)).
    fn update(&mut self, grads: &Flat<Self>, step: UpdateStep) -> Result<()>;

    /// One optimizer update of the optimizer's shard from `grads`, which
    /// holds only the shard's gradients: its ranges one after another (a
    /// ZeRO rank's reduce-scattered blocks). Engines without a sharded
    /// optimizer refuse.
    fn update_shard(&mut self, grads: &Flat<Self>, step: UpdateStep) -> Result<()> {
        let _ = (grads, step);
        Err("this engine cannot update from its shard's gradients alone".into())
    }

    /// Makes the optimizer own only the elements `shard` of the flat
    /// buffer (ranges, increasing, not overlapping), as a ZeRO rank owns
    /// its slice of each bucket: its state shrinks to them and
    /// [`update`](Self::update) reads `grads` and changes parameters only
    /// there, with the same arithmetic per element. Before the first
    /// update. Engines without it refuse.
    fn shard_optimizer(&mut self, shard: &[Range<usize>]) -> Result<()> {
        Err(format!(
            "this engine cannot shard its optimizer (asked for {} ranges)",
            shard.len()
        ))
    }

    /// The model state the engine holds (all but the gradients, which the
    /// loop allocates); zeros where an engine does not say.
    fn state_bytes(&self) -> StateBytes {
        StateBytes::default()
    }

    /// The parameter units, for strategies that shard the parameters
    /// themselves (see [`ParamUnits`]). Engines whose passes cannot take
    /// their parameters unit by unit refuse.
    fn param_units(&self) -> Result<ParamUnits> {
        Err(
            "this engine cannot run with sharded parameters (its passes read one whole \
             parameter buffer)"
                .into(),
        )
    }

    /// Gives up the whole parameter buffer: returns the elements `shard`
    /// of it, one range after another (a ZeRO-3 rank's master weights),
    /// and from then on runs only the unit passes
    /// ([`forward_begin`](Self::forward_begin),
    /// [`forward_unit`](Self::forward_unit),
    /// [`backward_unit_of`](Self::backward_unit_of)), which take their
    /// parameters as arguments, and [`update_compact`](Self::update_compact).
    /// The optimizer is sharded to `shard` as by
    /// [`shard_optimizer`](Self::shard_optimizer).
    fn shard_params(&mut self, shard: &[Range<usize>]) -> Result<Flat<Self>> {
        let _ = shard;
        Err("this engine cannot shard its parameters".into())
    }

    /// Takes whole parameters back (`full`, the flat parameters in host
    /// memory), after [`shard_params`](Self::shard_params): the engine's
    /// parameters are whole again (a GPU engine keeps them in host memory,
    /// to be saved, and runs no further pass).
    fn unshard_params(&mut self, full: Vec<f32>) -> Result<()> {
        let _ = full;
        Err("this engine cannot shard its parameters".into())
    }

    /// Takes some blocks in bf16 from now on (after
    /// [`shard_params`](Self::shard_params); a strategy whose collectives
    /// gather in bf16 asks once, before the first pass): returns those
    /// blocks and the flat ranges of the tensors in them that the passes
    /// still read in f32, in the order [`half_side`](Self::half_side)
    /// packs them. Such a block reaches [`forward_unit`](Self::forward_unit)
    /// and [`backward_unit_of`](Self::backward_unit_of) as bf16 values
    /// packed two to an element (a buffer of half the block's length),
    /// rounded to nearest even from the f32 master weights — what the
    /// engine's own cast would give. None by default.
    fn start_half_blocks(&mut self) -> Result<(Vec<usize>, Vec<Range<usize>>)> {
        Ok((Vec::new(), Vec::new()))
    }

    /// The f32 tensors of the blocks taken in bf16, packed in the order
    /// [`start_half_blocks`](Self::start_half_blocks) gave: the strategy
    /// fills it from the master weights whenever they change, before the
    /// next pass. `None` before then.
    fn half_side(&mut self) -> Option<&mut Flat<Self>> {
        None
    }

    /// Starts a forward pass in units on `batch` (after
    /// [`shard_params`](Self::shard_params)); with `grad`, keeps what the
    /// backward pass needs.
    fn forward_begin(&mut self, batch: &Self::Batch, grad: bool) -> Result<()> {
        let _ = (batch, grad);
        Err("this engine has no forward pass in units".into())
    }

    /// Forward unit `unit` (in order), given the parameters of the blocks
    /// [`ParamUnits::forward`] names for it, in that order, each a buffer
    /// of its block's length. After the last unit, returns the mean loss.
    fn forward_unit(&mut self, unit: usize, params: &[&Flat<Self>]) -> Result<Option<f32>> {
        let _ = (unit, params);
        Err("this engine has no forward pass in units".into())
    }

    /// Backward unit `unit` of a whole-parameter engine (in order, after
    /// [`forward`](Self::forward) with `grad`), reading its own
    /// parameters and adding the unit's gradients into `grads`: the blocks
    /// [`ParamUnits::backward_writes`] names for it, each its block's
    /// length, in that order (ZeRO stage 2: no whole gradient buffer).
    /// Engines without it refuse.
    fn backward_unit_into(&mut self, unit: usize, grads: &mut [&mut Flat<Self>]) -> Result<()> {
        let _ = (unit, grads);
        Err("this engine cannot write its gradients block by block".into())
    }

    /// The part of backward unit `unit` that writes no gradient (under
    /// activation checkpointing, the recomputation of a layer's
    /// activations), run on its own before
    /// [`backward_unit_of`](Self::backward_unit_of) of the same unit,
    /// which then goes on from there: `params` as that takes them.
    /// `false`, with nothing run, where the unit has no such part (the
    /// default).
    fn recompute_unit_of(&mut self, unit: usize, params: &[&Flat<Self>]) -> Result<bool> {
        let _ = (unit, params);
        Ok(false)
    }

    /// Whether backward unit `unit` has a part that
    /// [`recompute_unit_of`](Self::recompute_unit_of) runs (false by
    /// default).
    fn recomputes_unit(&self, unit: usize) -> bool {
        let _ = unit;
        false
    }

    /// Backward unit `unit` (in order, after a forward pass in units with
    /// `grad`): `params` are the blocks [`ParamUnits::backward_reads`]
    /// names, `grads` those [`ParamUnits::backward_writes`] names (each
    /// its block's length), in that order; adds the unit's gradients into
    /// them.
    fn backward_unit_of(
        &mut self,
        unit: usize,
        params: &[&Flat<Self>],
        grads: &mut [&mut Flat<Self>],
    ) -> Result<()> {
        let _ = (unit, params, grads);
        Err("this engine has no backward pass in units".into())
    }

    /// One optimizer update of the master weights `params` (the shard's,
    /// as [`shard_params`](Self::shard_params) returned them) from the
    /// shard's gradients `grads`, laid out alike.
    fn update_compact(
        &mut self,
        params: &mut Flat<Self>,
        grads: &Flat<Self>,
        step: UpdateStep,
    ) -> Result<()> {
        let _ = (params, grads, step);
        Err("this engine cannot update sharded parameters".into())
    }

    /// Has the whole gradient buffer written unit by unit from the next
    /// step on: [`zero_grads`](Self::zero_grads) then clears nothing, and
    /// each backward unit of a step's first micro-batch first clears what
    /// it adds into of the runs it writes before any other unit does — so
    /// that a run's memory holds nothing the step needs from the step's
    /// start until that unit. The saved buffers
    /// ([`saved_buffers`](Self::saved_buffers)) give their memory back
    /// until [`place_saved`](Self::place_saved) or the next forward pass
    /// makes them. Returns those runs (flat elements) for each backward
    /// unit, or `None` where the engine cannot (it goes on clearing the
    /// whole buffer in `zero_grads`). None by default.
    fn grads_by_unit(&mut self) -> Result<Option<Vec<Vec<Range<usize>>>>> {
        Ok(None)
    }

    /// The buffers a forward pass in units with `grad` saves for the
    /// backward pass, each with the backward unit that reads it last: a
    /// parameter-sharded strategy, or one process writing its gradients
    /// unit by unit ([`grads_by_unit`](Self::grads_by_unit)), may lend
    /// them memory that is idle while they live
    /// ([`place_saved`](Self::place_saved)). None by default.
    fn saved_buffers(&mut self) -> Result<Vec<SavedBuffer>> {
        Ok(Vec::new())
    }

    /// Moves saved buffer `i` (of [`saved_buffers`](Self::saved_buffers))
    /// into `memory` from byte `at[i]` (`None`: it keeps its own memory)
    /// and returns the bytes moved.
    ///
    /// # Safety
    /// `memory` must outlive the engine's use of it: the caller calls
    /// [`own_saved`](Self::own_saved) (or
    /// [`drop_saved`](Self::drop_saved)) before it drops or replaces
    /// `memory`, and writes the lent bytes only after the backward unit
    /// that reads them last, ordered after the engine's work.
    unsafe fn place_saved(&mut self, memory: &Flat<Self>, at: &[Option<usize>]) -> Result<usize> {
        let _ = memory;
        match at.iter().all(Option::is_none) {
            true => Ok(0),
            false => Err("this engine cannot place its saved buffers in lent memory".into()),
        }
    }

    /// Gives back the memory of the saved buffers now (they hold nothing
    /// between steps): [`place_saved`](Self::place_saved) lends them
    /// memory without making their own first, and the next forward pass
    /// makes what was not lent — so that the lender's memory can be
    /// allocated in their room. Nothing by default.
    fn drop_saved(&mut self) -> Result<()> {
        Ok(())
    }

    /// Stops using memory lent by [`place_saved`](Self::place_saved): the
    /// saved buffers get memory of their own again (by the next forward
    /// pass at the latest).
    fn own_saved(&mut self) -> Result<()> {
        Ok(())
    }

    /// Frees the optimizer's state after the last update (training is
    /// over: a parameter-sharded strategy gathers the whole parameters
    /// into the room); an update after this is refused. Nothing by
    /// default.
    fn release_optimizer_state(&mut self) -> Result<()> {
        Ok(())
    }

    /// The named tensors of the flat buffer (what checkpoints store the
    /// model by). None by default: such an engine cannot be checkpointed.
    fn tensors(&self) -> Vec<NamedTensor> {
        Vec::new()
    }

    /// The optimizer's kind (`adamw`, `sgd`) and the names of its moments
    /// (PyTorch's: `exp_avg`, `exp_avg_sq`; `momentum_buffer`). Engines
    /// that cannot checkpoint their optimizer refuse.
    fn optimizer_moments(&self) -> Result<(String, Vec<String>)> {
        Err("this engine cannot copy its optimizer state for a checkpoint".into())
    }

    /// Copies moment `moment` (its place in
    /// [`optimizer_moments`](Self::optimizer_moments)) of the flat
    /// elements `ranges` (each inside one range the optimizer owns) into
    /// `out`, one range after another (zeros before the first update).
    fn read_moment(
        &mut self,
        moment: usize,
        ranges: &[Range<usize>],
        out: &mut [f32],
    ) -> Result<()> {
        let _ = (moment, ranges, out);
        Err("this engine cannot copy its optimizer state for a checkpoint".into())
    }

    /// Replaces the optimizer's state by `state` (every range it owns,
    /// one after another), as after `updates` updates (a resumed run).
    /// Engines without it refuse.
    fn set_optimizer_state(&mut self, state: &OptimizerState, updates: u64) -> Result<()> {
        let _ = (state, updates);
        Err("this engine cannot load optimizer state from a checkpoint".into())
    }

    /// Waits for everything queued (a GPU's stream); nothing on the CPU.
    fn synchronize(&mut self) -> Result<()>;

    /// The GPU stream the engine queues its work on (none on the CPU):
    /// timelines record their events there.
    fn stream(&self) -> Option<&braid_cuda::Stream> {
        None
    }

    /// Starts any per-phase profile afresh (after warm-up steps).
    fn profile_reset(&mut self) {}

    /// The engine's own per-phase profile, if it keeps one.
    fn profile_report(&self) -> Option<String> {
        None
    }
}

/// Runs every backward unit of `engine` into `grads` with nothing handed
/// on (one process, or a micro-batch that does not communicate).
pub fn backward_local<E: Engine>(engine: &mut E, grads: &mut Flat<E>) -> Result<()> {
    let units = engine.unit_count();
    let mut w = E::Space::window(grads);
    for u in 0..units {
        engine.backward_unit(u, &mut w)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_reduced_after_their_last_writer_or_after_each_run_of_writers() {
        // The embeddings (block 0) written by the head (unit 0) and the
        // embedding unit (3); layer 1 (block 2) by units 1 and 2 in a row.
        let units = ParamUnits {
            blocks: vec![0..4, 4..8, 8..12, 12..14],
            forward: vec![vec![0], vec![1], vec![2], vec![3, 0]],
            backward_reads: vec![vec![3, 0], vec![2], vec![2, 1], vec![0]],
            backward_writes: vec![vec![3, 0], vec![2], vec![2, 1], vec![0]],
        };
        assert_eq!(
            units.reduce_after(false),
            vec![vec![3], vec![2], vec![2], vec![0]]
        );
        assert_eq!(
            units.reduce_after(true),
            vec![vec![0, 3], vec![2], vec![2], vec![0]]
        );
    }
}
