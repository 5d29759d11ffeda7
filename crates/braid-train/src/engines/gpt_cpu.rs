//! [`CpuGpt`]: the CPU GPT model (`braid_model::Gpt`, f32) as an
//! [`Engine`]: parameters, activations and optimizer state in host memory
//! — the whole model, or one tensor-parallel rank's share of it
//! ([`CpuGpt::tensor_parallel`]), whose gradient norm is summed over its
//! tensor group (the tensors every rank holds whole counted once); with
//! its optimizer offloaded ([`CpuGpt::offloaded`]), AdamW's update runs
//! through the same chunked [`HostUpdate`] a GPU's offloaded optimizer
//! runs, over master weights of its own.

use super::describe::{gpt_describe, gpt_matrices};
use super::offload::HostUpdate;
use super::state::{copy_at, gpt_tensors, moment};
use super::units::{backward_unit_name, forward_unit_name, gpt_param_units, gpt_units};
use crate::engine::{
    check_shard, state_ranges, BlockGrads, Checkpointable, Engine, EngineInfo, LendsMemory, Matrix,
    NamedTensor, OptimizerState, ParamUnits, SavedBuffer, ShardedOptimizer, ShardedParams,
    StateBytes, Unit, UpdateStep,
};
use crate::space::{Host, HostWindow};
use crate::Result;
use braid_data::loader::TokenBatch;
use braid_model::optim::{sum_of_squares, AdamWConfig, Optimizer};
use braid_model::tensor_comm::{ReduceKind, TensorComm};
use braid_model::{Activations, Block, Gpt, Layout, Params};
use braid_trace::Cat;
use std::ops::Range;
use std::sync::Arc;

/// The GPT model on this machine's CPUs, sized for batches of `b × t`.
pub struct CpuGpt {
    model: Gpt,
    params: Params,
    acts: Activations<f32>,
    /// Built at the first update, for the shard owned by then (so that a
    /// sharded run never holds the whole buffer's state).
    opt: Option<Optimizer>,
    /// The elements of the flat buffer the optimizer owns.
    shard: Vec<Range<usize>>,
    optimizer: CpuOptimizer,
    /// Updates made (the optimizer may be sharded only before the first).
    updates: u64,
    b: usize,
    t: usize,
    /// The batch of the last forward pass with gradients (the backward
    /// units need its tokens and targets).
    last: TokenBatch,
    /// The parameter units (built once: the unit passes check against
    /// them every call).
    units: ParamUnits,
    /// The parameters were given up to a parameter-sharded strategy
    /// ([`ShardedParams::shard_params`]): `params.data` is empty and only the
    /// unit passes run.
    sharded: bool,
    /// The tensor group, when this is one rank's share of the model.
    group: Option<TensorGroup>,
    /// The optimizer offloaded (`--offload optimizer`): master weights
    /// and moments of its own, updated chunk by chunk; `opt` stays
    /// unused.
    offload: Option<HostUpdate>,
}

/// A tensor-parallel rank's group, for its gradient norm.
struct TensorGroup {
    comm: Arc<dyn TensorComm>,
    /// The flat ranges of the tensors every rank of the group holds whole
    /// (increasing): their squares count on the group's first rank only.
    whole: Vec<Range<usize>>,
}

impl TensorGroup {
    /// Σ x² of the elements at the flat positions `ranges`, held one
    /// range after another in `values`, each counted once over the group;
    /// summed over the group.
    fn sq_norm(&self, values: &[f32], ranges: &[Range<usize>]) -> Result<f64> {
        let skip: &[Range<usize>] = match self.comm.rank() {
            0 => &[],
            _ => &self.whole,
        };
        let mut sum = [0.0f64];
        let mut at = 0;
        for r in ranges {
            let mut from = r.start;
            for s in skip.iter().filter(|s| s.end > r.start && s.start < r.end) {
                let cut = s.start.max(r.start);
                sum[0] += sum_of_squares(&values[at + from - r.start..at + cut - r.start]);
                from = s.end.min(r.end);
            }
            sum[0] += sum_of_squares(&values[at + from - r.start..at + r.len()]);
            at += r.len();
        }
        self.comm
            .all_reduce_f64(&mut sum, ReduceKind::Sum)
            .map_err(|e| format!("the gradient norm over the tensor group: {e}"))?;
        Ok(sum[0])
    }
}

/// Which optimizer a [`CpuGpt`] steps with.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum CpuOptimizer {
    /// AdamW (β = 0.9, 0.95) with this weight decay.
    AdamW {
        /// Decoupled weight decay on matrices and embeddings.
        weight_decay: f32,
    },
    /// SGD with momentum 0.9 and this (coupled) weight decay.
    Sgd {
        /// Weight decay on matrices and embeddings.
        weight_decay: f32,
    },
}

impl CpuOptimizer {
    /// The optimizer for the elements `shard` of `layout`'s flat buffer.
    pub fn over(self, layout: &Layout, shard: &[Range<usize>]) -> Optimizer {
        self.with_momentum(layout, shard, 0.9)
    }

    /// [`over`](Self::over) with its momentum (AdamW's β₁, SGD's
    /// momentum) set to `momentum` — lowered where asynchronous updates
    /// already act as momentum (a parameter server's).
    pub fn with_momentum(
        self,
        layout: &Layout,
        shard: &[Range<usize>],
        momentum: f32,
    ) -> Optimizer {
        match self {
            CpuOptimizer::AdamW { weight_decay } => Optimizer::adamw_shard(
                layout,
                AdamWConfig {
                    weight_decay,
                    beta1: momentum,
                    ..Default::default()
                },
                shard,
            ),
            CpuOptimizer::Sgd { weight_decay } => {
                Optimizer::sgd_shard(layout, momentum, weight_decay, shard)
            }
        }
    }
}

impl CpuGpt {
    /// Gives back the activations this engine's own passes would use (a
    /// pipeline stage keeps one set per micro-batch in flight instead and
    /// never runs these passes): none are kept from now on.
    pub(crate) fn release_activations(&mut self) {
        self.acts = Activations::new(&self.params.layout, 0, 0, false);
    }

    /// An engine over `params` for batches of `b × t`, recomputing
    /// activations in the backward pass when `checkpointing`.
    pub fn new(
        params: Params,
        b: usize,
        t: usize,
        checkpointing: bool,
        optimizer: CpuOptimizer,
    ) -> CpuGpt {
        let layout = params.layout.clone();
        CpuGpt {
            model: Gpt::new(layout.clone()),
            acts: Activations::new(&layout, b, t, checkpointing),
            opt: None,
            shard: std::slice::from_ref(&(0..layout.len)).to_vec(),
            optimizer,
            updates: 0,
            params,
            b,
            t,
            last: TokenBatch::new(b, t),
            units: gpt_param_units(&layout),
            sharded: false,
            group: None,
            offload: None,
        }
    }

    /// This engine with its optimizer offloaded, as `--offload optimizer`
    /// does on a GPU: AdamW's master weights and moments held apart from
    /// the weights the passes read, and each update run chunk by chunk
    /// through [`HostUpdate`], the weights rewritten from the master
    /// copy. On the CPU both copies are in host memory already, so
    /// nothing is saved: it is there so that a pipeline stage or a
    /// tensor-parallel share runs the offloaded update on any machine
    /// (and equals the update in place, bit for bit). AdamW only, before
    /// the first update, and not under ZeRO.
    pub fn offloaded(mut self) -> Result<CpuGpt> {
        let CpuOptimizer::AdamW { weight_decay } = self.optimizer else {
            return Err(
                "--offload optimizer offloads AdamW (SGD's momentum stays with the model)".into(),
            );
        };
        if self.updates > 0 || self.sharded || self.shard.len() != 1 {
            return Err(
                "the optimizer is offloaded before the first update, and not with ZeRO".into(),
            );
        }
        let cfg = AdamWConfig {
            weight_decay,
            ..Default::default()
        };
        self.offload = Some(HostUpdate::new(
            &self.params.layout,
            self.params.data.clone(),
            cfg,
        )?);
        self.opt = None;
        Ok(self)
    }

    /// Refuses a sharded optimizer's or sharded parameters' call with the
    /// optimizer offloaded.
    fn not_offloaded(&self, what: &str) -> Result<()> {
        match self.offload {
            None => Ok(()),
            Some(_) => Err(format!(
                "{what}: the optimizer is offloaded, and an offloaded optimizer is not sharded \
                 (ZeRO with --offload optimizer is not built)"
            )),
        }
    }

    /// Tensor-parallel rank `comm.rank()`'s share of the model: `params`
    /// laid out by [`Layout::tensor_parallel`] for that rank, its
    /// collectives through `comm`; with `sequence`, sequence parallelism
    /// (`b × t` must split over the group).
    pub fn tensor_parallel(
        params: Params,
        b: usize,
        t: usize,
        checkpointing: bool,
        optimizer: CpuOptimizer,
        comm: Arc<dyn TensorComm>,
        sequence: bool,
    ) -> Result<CpuGpt> {
        let layout = params.layout.clone();
        let model = Gpt::tensor_parallel(layout.clone(), comm.clone(), sequence)?;
        let acts = model
            .activations(b, t, checkpointing)
            .map_err(|e| e.to_string())?;
        let whole = layout
            .params
            .iter()
            .filter(|p| p.place.is_none())
            .map(|p| p.range())
            .collect();
        let mut e = CpuGpt::new(params, b, t, checkpointing, optimizer);
        e.model = model;
        e.acts = acts;
        e.group = Some(TensorGroup { comm, whole });
        Ok(e)
    }

    /// Refuses the whole-buffer passes once the parameters are sharded.
    pub(crate) fn whole(&self, what: &str) -> Result<()> {
        match self.sharded {
            false => Ok(()),
            true => Err(format!(
                "{what}: the parameters are sharded (the strategy hands them to the unit \
                 passes); this call needs them whole"
            )),
        }
    }

    /// Refuses the unit passes until the parameters are sharded.
    pub(crate) fn in_units(&self, what: &str) -> Result<()> {
        match self.sharded {
            true => Ok(()),
            false => Err(format!(
                "{what}: the unit passes run after shard_params (the engine holds its whole \
                 parameters)"
            )),
        }
    }

    /// The parameters with their layout (the trained model).
    pub fn into_params(self) -> Params {
        self.params
    }

    /// The parameters' layout.
    /// The model (a tensor-parallel rank's share, with its group).
    pub fn model(&self) -> &Gpt {
        &self.model
    }

    /// The parameters' layout.
    pub fn layout(&self) -> &Arc<Layout> {
        &self.params.layout
    }

    /// The optimizer and the parameters it updates (the optimizer built
    /// for the shard on first use).
    fn stepping(&mut self) -> (&mut Optimizer, &mut Params) {
        let (how, layout, shard) = (self.optimizer, &self.params.layout, &self.shard);
        let opt = self.opt.get_or_insert_with(|| how.over(layout, shard));
        (opt, &mut self.params)
    }

    fn grads_prefix<'w>(g: &'w mut HostWindow<'_>) -> Result<&'w mut [f32]> {
        g.prefix_mut()
    }
}

impl Engine for CpuGpt {
    type Space = Host;
    type Batch = TokenBatch;

    fn describe(&self) -> String {
        let shard = self.params.layout.shard;
        let how = match (&self.group, self.model.sequence_parallel()) {
            (None, _) => "f32 on the CPU".to_string(),
            (Some(_), sp) => format!(
                "f32 on the CPU, tensor-parallel rank {} of {}{}",
                shard.rank,
                shard.size,
                if sp { ", sequence parallel" } else { "" }
            ),
        };
        gpt_describe(&self.params.layout.config, self.b, self.t, &how)
    }

    fn params(&self) -> &Vec<f32> {
        &self.params.data
    }

    fn params_mut(&mut self) -> &mut Vec<f32> {
        &mut self.params.data
    }

    fn params_changed(&mut self) -> Result<()> {
        // In f32 the weights are the master weights exactly.
        match &mut self.offload {
            Some(h) => h.set_master(&self.params.data),
            None => Ok(()),
        }
    }

    fn new_grads(&self) -> Result<Vec<f32>> {
        Ok(vec![0.0; self.params.data.len()])
    }

    fn zero_grads(&mut self, grads: &mut Vec<f32>) -> Result<()> {
        grads.fill(0.0);
        Ok(())
    }

    fn units(&self) -> Vec<Unit> {
        gpt_units(&self.params.layout)
    }

    fn unit_count(&self) -> usize {
        // The head, every layer, the embeddings.
        self.params.layout.config.n_layer + 2
    }

    fn forward(&mut self, batch: &TokenBatch, grad: bool) -> Result<f32> {
        self.whole("forward")?;
        let loss = self
            .model
            .forward(
                &self.params.data,
                &mut self.acts,
                &batch.tokens,
                &batch.targets,
            )
            .map_err(|e| e.to_string())?;
        if grad {
            self.last.tokens.clone_from(&batch.tokens);
            self.last.targets.clone_from(&batch.targets);
        }
        Ok(loss)
    }

    fn backward_unit(&mut self, unit: usize, grads: &mut HostWindow<'_>) -> Result<()> {
        let layers = self.params.layout.config.n_layer;
        let _t = braid_trace::scope::start(None, Cat::Compute, || backward_unit_name(unit, layers));
        self.whole("backward")?;
        let n_layer = self.params.layout.config.n_layer;
        let g = Self::grads_prefix(grads)?;
        let p = &self.params.data;
        // Each unit writes its own block (the head also the token
        // embedding, which is finished last); the window covers `[0, end)`
        // of everything not yet handed on.
        let need = match unit {
            0 => self.params.layout.block_range(Block::FinalNorm).end,
            u if u <= n_layer => {
                self.params
                    .layout
                    .block_range(Block::Layer(n_layer - u))
                    .end
            }
            _ => self.params.layout.block_range(Block::Embedding).end,
        };
        if g.len() < need {
            return Err(format!(
                "backward unit {unit} writes gradients up to {need} but only {} are still being written",
                g.len()
            ));
        }
        let layout = &self.params.layout;
        let block = |b: Block| layout.block_range(b);
        match unit {
            0 => {
                // The embedding block is first in the layout, the final
                // norm's last: disjoint slices of the window's prefix.
                let (front, back) = g.split_at_mut(block(Block::FinalNorm).start);
                self.model.head_backward(
                    &p[block(Block::FinalNorm)],
                    &p[block(Block::Embedding)],
                    &mut back[..block(Block::FinalNorm).len()],
                    &mut front[block(Block::Embedding)],
                    &mut self.acts,
                    &self.last.targets,
                )
            }
            u if u <= n_layer => {
                let r = block(Block::Layer(n_layer - u));
                self.model
                    .layer_backward_at(n_layer - u, &p[r.clone()], &mut g[r], &mut self.acts)
            }
            u if u == n_layer + 1 => self.model.embedding_backward(
                &mut g[block(Block::Embedding)],
                &mut self.acts,
                &self.last.tokens,
            ),
            u => return Err(format!("backward unit {u} does not exist")),
        }
        .map_err(|e| e.to_string())
    }

    fn grad_sq_norm(&mut self, grads: &Vec<f32>) -> Result<f64> {
        match &self.group {
            None => Ok(sum_of_squares(grads)),
            Some(g) => g.sq_norm(grads, std::slice::from_ref(&(0..grads.len()))),
        }
    }

    fn update(&mut self, grads: &Vec<f32>, step: UpdateStep) -> Result<()> {
        self.whole("update")?;
        if let Some(h) = &mut self.offload {
            h.step(grads, &mut self.params.data, step)?;
            self.updates += 1;
            return Ok(());
        }
        let (opt, params) = self.stepping();
        opt.step_scaled(params, grads, step.lr, step.grad_scale);
        self.updates += 1;
        Ok(())
    }

    fn synchronize(&mut self) -> Result<()> {
        Ok(())
    }
}

impl EngineInfo for CpuGpt {
    fn host_params(&self) -> Option<&[f32]> {
        self.offload.as_ref().map(HostUpdate::master)
    }

    fn matrices(&self) -> Vec<Matrix> {
        gpt_matrices(&self.params.layout)
    }

    fn state_bytes(&self) -> StateBytes {
        if let Some(h) = &self.offload {
            let (master, optimizer) = h.bytes();
            return StateBytes {
                params: 4 * self.params.data.len() as u64,
                master,
                optimizer,
                offloaded: master + optimizer,
                ..Default::default()
            };
        }
        StateBytes {
            params: 4 * self.params.data.len() as u64,
            optimizer: match &self.opt {
                Some(o) => o.state_bytes() as u64,
                None => {
                    let len: usize = self.shard.iter().map(|r| r.len()).sum();
                    let moments = match self.optimizer {
                        CpuOptimizer::AdamW { .. } => 2,
                        CpuOptimizer::Sgd { .. } => 1,
                    };
                    4 * moments * len as u64
                }
            },
            ..Default::default()
        }
    }
}

impl ShardedOptimizer for CpuGpt {
    fn grad_sq_norm_compact(&mut self, compact: &Vec<f32>, ranges: &[Range<usize>]) -> Result<f64> {
        match &self.group {
            None => Ok(sum_of_squares(compact)),
            Some(g) => g.sq_norm(compact, ranges),
        }
    }

    fn grad_sq_norm_of(&mut self, grads: &Vec<f32>, ranges: &[Range<usize>]) -> Result<f64> {
        check_shard(ranges, grads.len())?;
        match &self.group {
            None => Ok(ranges
                .iter()
                .map(|r| sum_of_squares(&grads[r.clone()]))
                .sum()),
            Some(g) => {
                let values: Vec<f32> = ranges
                    .iter()
                    .flat_map(|r| grads[r.clone()].to_vec())
                    .collect();
                g.sq_norm(&values, ranges)
            }
        }
    }

    fn update_shard(&mut self, grads: &Vec<f32>, step: UpdateStep) -> Result<()> {
        self.whole("update")?;
        self.not_offloaded("a sharded update")?;
        let len: usize = self.shard.iter().map(|r| r.len()).sum();
        if grads.len() != len {
            return Err(format!(
                "{} shard gradients for an optimizer shard of {len} elements",
                grads.len()
            ));
        }
        let (opt, params) = self.stepping();
        opt.step_shard_scaled(params, grads, step.lr, step.grad_scale);
        self.updates += 1;
        Ok(())
    }

    fn shard_optimizer(&mut self, shard: &[Range<usize>]) -> Result<()> {
        self.not_offloaded("sharding the optimizer")?;
        check_shard(shard, self.params.data.len())?;
        if self.updates > 0 {
            return Err("the optimizer can be sharded only before the first update".into());
        }
        self.opt = None;
        self.shard = shard.to_vec();
        Ok(())
    }
}

impl BlockGrads for CpuGpt {
    fn param_units(&self) -> Result<ParamUnits> {
        Ok(self.units.clone())
    }

    fn backward_unit_into(&mut self, unit: usize, grads: &mut [&mut Vec<f32>]) -> Result<()> {
        self.whole("backward")?;
        let reads = self
            .units
            .backward_reads
            .get(unit)
            .ok_or_else(|| format!("backward unit {unit} does not exist"))?;
        let data = &self.params.data;
        let params: Vec<&[f32]> = reads
            .iter()
            .map(|&b| &data[self.units.blocks[b].clone()])
            .collect();
        let layers = self.params.layout.config.n_layer;
        let _t = braid_trace::scope::start(None, Cat::Compute, || backward_unit_name(unit, layers));
        let lens: Vec<usize> = params.iter().map(|p| p.len()).collect();
        let grad_lens: Vec<usize> = grads.iter().map(|g| g.len()).collect();
        self.units.backward_given(unit, &lens, &grad_lens)?;
        let (model, acts, last) = (&self.model, &mut self.acts, &self.last);
        unit_backward(model, acts, last, layers, unit, &params, grads)
    }
}

impl ShardedParams for CpuGpt {
    fn shard_params(&mut self, shard: &[Range<usize>]) -> Result<Vec<f32>> {
        self.whole("shard_params")?;
        self.shard_optimizer(shard)?;
        let mut master = Vec::with_capacity(shard.iter().map(|r| r.len()).sum());
        for r in shard {
            master.extend_from_slice(&self.params.data[r.clone()]);
        }
        self.params.data = Vec::new();
        self.sharded = true;
        Ok(master)
    }

    fn unshard_params(&mut self, full: Vec<f32>) -> Result<()> {
        self.in_units("unshard_params")?;
        if full.len() != self.params.layout.len {
            return Err(format!(
                "unshard_params: {} parameters for a layout of {}",
                full.len(),
                self.params.layout.len
            ));
        }
        self.params.data = full;
        self.sharded = false;
        Ok(())
    }

    fn forward_begin(&mut self, batch: &TokenBatch, _grad: bool) -> Result<()> {
        self.in_units("forward")?;
        self.last.tokens.clone_from(&batch.tokens);
        self.last.targets.clone_from(&batch.targets);
        Ok(())
    }

    fn forward_unit(&mut self, unit: usize, params: &[&Vec<f32>]) -> Result<Option<f32>> {
        let layers = self.params.layout.config.n_layer;
        let _t = braid_trace::scope::start(None, Cat::Compute, || forward_unit_name(unit, layers));
        self.in_units("forward")?;
        let lens: Vec<usize> = params.iter().map(|p| p.len()).collect();
        self.units.forward_given(unit, &lens)?;
        let n_layer = self.params.layout.config.n_layer;
        let (acts, last) = (&mut self.acts, &self.last);
        let m = &self.model;
        match unit {
            0 => m
                .embedding_forward(params[0], acts, &last.tokens, &last.targets)
                .map(|_| None),
            u if u <= n_layer => m.layer_forward_at(u - 1, params[0], acts).map(|_| None),
            _ => m
                .head_forward(params[0], params[1], acts, &last.targets)
                .map(Some),
        }
        .map_err(|e| e.to_string())
    }

    fn backward_unit_of(
        &mut self,
        unit: usize,
        params: &[&Vec<f32>],
        grads: &mut [&mut Vec<f32>],
    ) -> Result<()> {
        let layers = self.params.layout.config.n_layer;
        let _t = braid_trace::scope::start(None, Cat::Compute, || backward_unit_name(unit, layers));
        self.in_units("backward")?;
        let lens: Vec<usize> = params.iter().map(|p| p.len()).collect();
        let grad_lens: Vec<usize> = grads.iter().map(|g| g.len()).collect();
        self.units.backward_given(unit, &lens, &grad_lens)?;
        let params: Vec<&[f32]> = params.iter().map(|p| p.as_slice()).collect();
        let (model, acts, last) = (&self.model, &mut self.acts, &self.last);
        unit_backward(model, acts, last, layers, unit, &params, grads)
    }

    fn update_compact(
        &mut self,
        params: &mut Vec<f32>,
        grads: &Vec<f32>,
        step: UpdateStep,
    ) -> Result<()> {
        self.in_units("update")?;
        let len: usize = self.shard.iter().map(|r| r.len()).sum();
        if grads.len() != len || params.len() != len {
            return Err(format!(
                "{} shard parameters and {} gradients for an optimizer shard of {len} elements",
                params.len(),
                grads.len()
            ));
        }
        let (opt, _) = self.stepping();
        opt.step_compact_scaled(params, grads, step.lr, step.grad_scale);
        self.updates += 1;
        Ok(())
    }
}

/// The CPU model's activations keep memory of their own: it saves no
/// buffer that another part could lend memory to (ZeRO-3 asks, and is
/// given none), and it clears the whole gradient buffer every step.
impl LendsMemory for CpuGpt {
    fn grads_by_unit(&mut self) -> Result<Option<Vec<Vec<Range<usize>>>>> {
        Ok(None)
    }

    fn saved_buffers(&mut self) -> Result<Vec<SavedBuffer>> {
        Ok(Vec::new())
    }

    unsafe fn place_saved(&mut self, memory: &Vec<f32>, at: &[Option<usize>]) -> Result<usize> {
        let _ = memory;
        match at.iter().all(Option::is_none) {
            true => Ok(0),
            false => Err("this engine cannot place its saved buffers in lent memory".into()),
        }
    }

    fn drop_saved(&mut self) -> Result<()> {
        Ok(())
    }

    fn own_saved(&mut self) -> Result<()> {
        Ok(())
    }
}

impl Checkpointable for CpuGpt {
    fn tensors(&self) -> Vec<NamedTensor> {
        gpt_tensors(&self.params.layout)
    }

    fn optimizer_moments(&self) -> Result<(String, Vec<String>)> {
        Ok(match self.optimizer {
            CpuOptimizer::AdamW { .. } => {
                ("adamw".into(), vec!["exp_avg".into(), "exp_avg_sq".into()])
            }
            CpuOptimizer::Sgd { .. } => ("sgd".into(), vec!["momentum_buffer".into()]),
        })
    }

    fn read_moment(
        &mut self,
        moment: usize,
        ranges: &[Range<usize>],
        out: &mut [f32],
    ) -> Result<()> {
        let at = state_ranges(&self.shard, ranges)?;
        if let Some(h) = &self.offload {
            return copy_at(h.moment(moment)?, &at, out);
        }
        let (opt, _) = self.stepping();
        let state: &[f32] = match (opt, moment) {
            (Optimizer::AdamW { m, .. }, 0) => m,
            (Optimizer::AdamW { v, .. }, 1) => v,
            (Optimizer::Sgd { buf, .. }, 0) => buf,
            _ => return Err(format!("the optimizer has no moment {moment}")),
        };
        copy_at(state, &at, out)
    }

    fn set_optimizer_state(&mut self, state: &OptimizerState, updates: u64) -> Result<()> {
        if let Some(h) = &mut self.offload {
            let len = h.len();
            let m = moment(state, "adamw", "exp_avg", len)?;
            let v = moment(state, "adamw", "exp_avg_sq", len)?;
            h.set_moments(m, v, updates)?;
            self.updates = updates;
            return Ok(());
        }
        let (opt, _) = self.stepping();
        match opt {
            Optimizer::AdamW { m, v, t, .. } => {
                let len = m.len();
                m.copy_from_slice(moment(state, "adamw", "exp_avg", len)?);
                v.copy_from_slice(moment(state, "adamw", "exp_avg_sq", len)?);
                *t = u32::try_from(updates).map_err(|_| format!("{updates} updates"))?;
            }
            Optimizer::Sgd { buf, .. } => {
                let len = buf.len();
                buf.copy_from_slice(moment(state, "sgd", "momentum_buffer", len)?);
            }
        }
        self.updates = updates;
        Ok(())
    }
}

/// Backward unit `unit` of a model of `layers` layers: `params` are the
/// blocks the unit reads and `grads` those it writes
/// ([`ParamUnits`](crate::engine::ParamUnits)'s lists, checked by the
/// caller), `last` the batch of the forward pass.
fn unit_backward(
    model: &Gpt,
    acts: &mut Activations<f32>,
    last: &TokenBatch,
    layers: usize,
    unit: usize,
    params: &[&[f32]],
    grads: &mut [&mut Vec<f32>],
) -> Result<()> {
    match (unit, grads) {
        (0, [g_norm, g_emb]) => {
            model.head_backward(params[0], params[1], g_norm, g_emb, acts, &last.targets)
        }
        (u, [g]) if u <= layers => model.layer_backward_at(layers - u, params[0], g, acts),
        (_, [g_emb]) => model.embedding_backward(g_emb, acts, &last.tokens),
        _ => return Err(format!("backward unit {unit}: unexpected gradient blocks")),
    }
    .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use braid_model::{GptConfig, Layout};
    use std::sync::Arc;

    #[test]
    fn the_unit_count_is_the_length_of_the_unit_list() {
        let layout = Arc::new(Layout::new(&GptConfig::parse("L3-H2-C16-V50-T8").unwrap()));
        let engine = CpuGpt::new(
            Params::init_gpt2(layout, 1),
            2,
            8,
            false,
            CpuOptimizer::AdamW { weight_decay: 0.1 },
        );
        assert_eq!(engine.unit_count(), engine.units().len());
    }

    /// The unit passes on gathered block copies give the whole-buffer
    /// passes' loss and gradients bit for bit, and the compact update the
    /// whole optimizer's parameters; whole-buffer calls are refused once
    /// the parameters are sharded, unit calls before.
    #[test]
    fn unit_passes_match_the_whole_buffer_passes_bit_for_bit() {
        let layout = Arc::new(Layout::new(&GptConfig::parse("L2-H2-C16-V50-T8").unwrap()));
        let make = || {
            CpuGpt::new(
                Params::init_gpt2(layout.clone(), 3),
                2,
                8,
                false,
                CpuOptimizer::AdamW { weight_decay: 0.1 },
            )
        };
        let (mut whole, mut units) = (make(), make());
        let mut batch = TokenBatch::new(2, 8);
        for (i, (x, y)) in batch.tokens.iter_mut().zip(&mut batch.targets).enumerate() {
            (*x, *y) = ((i * 7 % 50) as u32, (i * 11 % 50) as u32);
        }
        assert!(
            units.forward_begin(&batch, true).is_err(),
            "before sharding"
        );
        let full = whole.params().clone();
        let all = 0..layout.len;
        let mut master = units.shard_params(std::slice::from_ref(&all)).unwrap();
        assert_eq!(master, full);
        assert!(units.forward(&batch, true).unwrap_err().contains("sharded"));
        let pu = units.param_units().unwrap();
        pu.check(layout.len, units.unit_count()).unwrap();
        let block = |b: usize| full[pu.blocks[b].clone()].to_vec();
        // Whole buffer.
        let want_loss = whole.forward(&batch, true).unwrap();
        let mut want = whole.new_grads().unwrap();
        crate::engine::backward_local(&mut whole, &mut want).unwrap();
        // Units.
        units.forward_begin(&batch, true).unwrap();
        let mut loss = None;
        for (u, reads) in pu.forward.iter().enumerate() {
            let bufs: Vec<Vec<f32>> = reads.iter().map(|&b| block(b)).collect();
            let refs: Vec<&Vec<f32>> = bufs.iter().collect();
            loss = units.forward_unit(u, &refs).unwrap();
        }
        assert_eq!(loss.unwrap().to_bits(), want_loss.to_bits());
        let mut grads: Vec<Vec<f32>> = pu.blocks.iter().map(|r| vec![0.0; r.len()]).collect();
        for u in 0..pu.backward_reads.len() {
            let bufs: Vec<Vec<f32>> = pu.backward_reads[u].iter().map(|&b| block(b)).collect();
            let refs: Vec<&Vec<f32>> = bufs.iter().collect();
            let mut taken: Vec<Vec<f32>> = pu.backward_writes[u]
                .iter()
                .map(|&b| std::mem::take(&mut grads[b]))
                .collect();
            let mut outs: Vec<&mut Vec<f32>> = taken.iter_mut().collect();
            units.backward_unit_of(u, &refs, &mut outs).unwrap();
            for (&b, g) in pu.backward_writes[u].iter().zip(taken) {
                grads[b] = g;
            }
        }
        let got: Vec<f32> = grads.concat();
        assert!(got
            .iter()
            .zip(&want)
            .all(|(a, b)| a.to_bits() == b.to_bits()));
        // The update.
        let step = UpdateStep {
            lr: 1e-2,
            step: 1,
            grad_scale: 0.5,
        };
        whole.update(&want, step).unwrap();
        units.update_compact(&mut master, &got, step).unwrap();
        assert!(master
            .iter()
            .zip(whole.params())
            .all(|(a, b)| a.to_bits() == b.to_bits()));
        assert!(units.update(&got, step).is_err());
        units.unshard_params(master).unwrap();
        assert!(units.forward(&batch, false).is_ok());
    }

    /// The offloaded update (master weights and moments of its own,
    /// chunk by chunk through `HostUpdate`) gives the update in place
    /// bit for bit over three steps, and its moments read back as the
    /// in-place optimizer's; a sharded optimizer and SGD are refused.
    #[test]
    fn the_offloaded_update_equals_the_update_in_place_bit_for_bit() {
        let layout = Arc::new(Layout::new(&GptConfig::parse("L2-H2-C16-V50-T8").unwrap()));
        let make = || {
            CpuGpt::new(
                Params::init_gpt2(layout.clone(), 4),
                2,
                8,
                false,
                CpuOptimizer::AdamW { weight_decay: 0.1 },
            )
        };
        let (mut plain, mut off) = (make(), make().offloaded().unwrap());
        assert_eq!(off.host_params().unwrap(), plain.params().as_slice());
        assert!(off.state_bytes().offloaded > 0);
        let mut batch = TokenBatch::new(2, 8);
        for (i, (x, y)) in batch.tokens.iter_mut().zip(&mut batch.targets).enumerate() {
            (*x, *y) = ((i * 5 % 50) as u32, (i * 3 % 50) as u32);
        }
        for k in 1..=3 {
            let step = UpdateStep {
                lr: 1e-2,
                step: k,
                grad_scale: 0.7,
            };
            for e in [&mut plain, &mut off] {
                e.forward(&batch, true).unwrap();
                let mut g = e.new_grads().unwrap();
                crate::engine::backward_local(e, &mut g).unwrap();
                e.update(&g, step).unwrap();
            }
            let same =
                |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same(plain.params(), off.params()), "step {k}");
            assert!(same(off.host_params().unwrap(), off.params()), "step {k}");
        }
        let whole = 0..layout.len;
        let all = std::slice::from_ref(&whole);
        for i in 0..2 {
            let (mut a, mut b) = (vec![0.0; layout.len], vec![0.0; layout.len]);
            plain.read_moment(i, all, &mut a).unwrap();
            off.read_moment(i, all, &mut b).unwrap();
            assert_eq!(a, b, "moment {i}");
        }
        assert!(off
            .shard_optimizer(std::slice::from_ref(&(0..4)))
            .unwrap_err()
            .contains("offloaded"));
        let sgd = CpuGpt::new(
            Params::init_gpt2(layout.clone(), 4),
            2,
            8,
            false,
            CpuOptimizer::Sgd { weight_decay: 0.0 },
        );
        assert!(sgd.offloaded().is_err());
    }

    /// A sharded optimizer changes its shard's parameters and no others,
    /// exactly as the whole one does there; a bad shard, or sharding after
    /// an update, is refused.
    #[test]
    fn a_sharded_optimizer_updates_only_its_shard() {
        let layout = Arc::new(Layout::new(&GptConfig::parse("L2-H2-C16-V50-T8").unwrap()));
        let make = || {
            CpuGpt::new(
                Params::init_gpt2(layout.clone(), 1),
                1,
                8,
                false,
                CpuOptimizer::AdamW { weight_decay: 0.1 },
            )
        };
        let (mut whole, mut part) = (make(), make());
        let n = layout.len;
        let shard = [3..40, n / 3..n / 2 + 5];
        assert!(part.shard_optimizer(&[0..4, 9..n + 1]).is_err());
        assert!(part.shard_optimizer(&[0..10, 5..20]).is_err());
        part.shard_optimizer(&shard).unwrap();
        let grads: Vec<f32> = (0..n).map(|i| (i % 13) as f32 * 0.01 - 0.06).collect();
        let step = UpdateStep {
            lr: 1e-2,
            step: 1,
            grad_scale: 1.0,
        };
        let before = whole.params().clone();
        whole.update(&grads, step).unwrap();
        part.update(&grads, step).unwrap();
        for (i, (&got, &was)) in part.params().iter().zip(&before).enumerate() {
            let mine = shard.iter().any(|r| r.contains(&i));
            let want = if mine { whole.params()[i] } else { was };
            assert_eq!(got.to_bits(), want.to_bits(), "element {i}");
        }
        assert!(
            part.shard_optimizer(&shard).is_err(),
            "sharded after an update"
        );
    }
}
