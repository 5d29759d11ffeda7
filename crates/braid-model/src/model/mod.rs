//! The GPT model on the CPU: forward and backward block by block, with a
//! callback the moment a block's gradients are final (where data-parallel
//! and sharded training attach).
//!
//! Each block's pass reads and writes only that block's slices of the flat
//! parameter and gradient buffers (the embeddings, a layer, the final
//! norm; the head reads the token embedding too, as GPT-2 ties them), so
//! a caller can hand it a block kept anywhere — a sharded strategy's
//! gathered copy. [`Gpt::forward`] and [`Gpt::forward_backward`] take the
//! whole flat buffers and slice them.
//!
//! A model may be one tensor-parallel rank's share ([`Gpt::tensor_parallel`]
//! over a [`Layout::tensor_parallel`] layout): Megatron's split, with its
//! collectives through the group's [`TensorComm`] — one all-reduce after
//! each row-split product forward and one after each column-split product
//! backward (`g` and `f`), a vocabulary-parallel embedding and
//! cross-entropy (no rank holds all the logits). With sequence
//! parallelism the LayerNorms, residual adds and the position embedding
//! run on a slice of the rows; an all-gather comes before each column-split
//! product and a reduce-scatter after each row-split one instead.
//!
//! Generic over the element type: f32 trains, f64 checks the whole
//! model's gradients by finite differences. Activations are allocated once
//! per (batch, sequence) shape in [`Activations`]; with activation
//! checkpointing only each layer's input is kept and the layer is
//! recomputed just before its backward pass.

use crate::block::{Act, LayerRanges};
use crate::cpu::Real;
use crate::layout::{Block, Layout};
use crate::tensor_comm::{ReduceKind, TensorComm};
use std::ops::Range;
use std::sync::Arc;

mod acts;
mod decode;
mod ends;
mod error;
mod gpt;
mod layer;
mod split;
mod stage;
#[cfg(test)]
mod tp_decode_tests;
#[cfg(test)]
mod tp_tests;

pub use acts::{Activations, Widths};
pub use decode::{log_softmax_at, DecodeRow, KvPages, Logits, Pick};
pub use error::StepError;
pub use gpt::Gpt;
use gpt::Group;

/// A block's slice of a flat buffer (parameters or gradients).
fn block_of<'a, T>(layout: &Layout, flat: &'a [T], block: Block) -> &'a [T] {
    &flat[layout.block_range(block)]
}

impl Gpt {
    /// The model of `layout` (the whole model: a tensor-parallel share is
    /// made by [`tensor_parallel`](Self::tensor_parallel)).
    pub fn new(layout: std::sync::Arc<Layout>) -> Gpt {
        // Where each tensor sits inside its block: the same in every
        // layout of this share (a pipeline stage's holds only some blocks).
        let template = match layout.is_whole() {
            true => (*layout).clone(),
            false => Layout::tensor_parallel(&layout.config, layout.shard, 1)
                .expect("a stage's share is a valid share"),
        };
        let layers = (0..layout.config.n_layer)
            .map(|i| LayerRanges::in_block(&template, i))
            .collect();
        let within = |name: &str, block: Block| {
            let base = template.block_range(block).start;
            let r = template.get(name).expect("layout names").range();
            r.start - base..r.end - base
        };
        Gpt {
            wte: within("wte.weight", Block::Embedding),
            wpe: within("wpe.weight", Block::Embedding),
            lnf_w: within("ln_f.weight", Block::FinalNorm),
            lnf_b: within("ln_f.bias", Block::FinalNorm),
            widths: Widths::of(&layout),
            group: None,
            layers,
            layout,
        }
    }

    /// Tensor-parallel rank `comm.rank()`'s share of the model, `layout`
    /// that rank's [`Layout::tensor_parallel`] layout; with `sequence`,
    /// sequence parallelism too.
    pub fn tensor_parallel(
        layout: std::sync::Arc<Layout>,
        comm: Arc<dyn TensorComm>,
        sequence: bool,
    ) -> Result<Gpt, String> {
        let shard = layout.shard;
        if (comm.rank(), comm.size()) != (shard.rank, shard.size) {
            return Err(format!(
                "a layout of tensor-parallel rank {} of {} over a group where this is rank {} of {}",
                shard.rank,
                shard.size,
                comm.rank(),
                comm.size()
            ));
        }
        let mut m = Gpt::new(layout);
        m.group = Some(Group { comm, sequence });
        Ok(m)
    }

    /// The layout.
    pub fn layout(&self) -> &std::sync::Arc<Layout> {
        &self.layout
    }

    /// The widths of its passes.
    pub fn widths(&self) -> Widths {
        self.widths
    }

    /// Whether its residual stream's rows are split (sequence parallelism).
    pub fn sequence_parallel(&self) -> bool {
        self.group.as_ref().is_some_and(|g| g.sequence)
    }

    /// Activations for batches of `b × t` on this model (a
    /// sequence-parallel rank holds its rows of the residual stream:
    /// `b × t` must split over the group).
    pub fn activations<T: Real>(
        &self,
        b: usize,
        t: usize,
        checkpointing: bool,
    ) -> Result<Activations<T>, StepError> {
        let stage = self.layout.stages[0].clone();
        self.stage_activations(&stage, b, t, checkpointing)
    }

    /// [`activations`](Self::activations) for pipeline stage `stage` of
    /// those this model's layout holds (its layers only; the head's
    /// buffers on the last stage).
    pub fn stage_activations<T: Real>(
        &self,
        stage: &crate::layout::Stage,
        b: usize,
        t: usize,
        checkpointing: bool,
    ) -> Result<Activations<T>, StepError> {
        let split = match &self.group {
            Some(g) if g.sequence => g.comm.size(),
            _ => 1,
        };
        if (b * t) % split != 0 {
            return Err(StepError::Shape(format!(
                "sequence parallelism over {split} ranks splits the batch's {b} x {t} = {} tokens \
                 into equal slices: use a batch or --seq whose product divides by {split}",
                b * t
            )));
        }
        Ok(Activations::sharded(
            &self.layout,
            stage,
            b,
            t,
            checkpointing,
            split,
        ))
    }

    /// The group, when the passes need one (a share of the model without
    /// its group is refused).
    fn group(&self) -> Result<Option<&Group>, StepError> {
        match (&self.group, self.layout.shard.size) {
            (None, 1) => Ok(None),
            (None, n) => Err(StepError::Group(format!(
                "this is one of {n} tensor-parallel shares of the model, built without its group"
            ))),
            (Some(g), _) => Ok(Some(g)),
        }
    }

    /// Sums `x` over the group (a partial sum of each rank's share).
    fn all_reduce<T: Real>(&self, x: &mut [T], what: &str) -> Result<(), StepError> {
        match self.group()? {
            None => Ok(()),
            Some(g) => T::all_reduce(&*g.comm, x, ReduceKind::Sum)
                .map_err(|e| StepError::Group(format!("{what}: {e}"))),
        }
    }

    /// The group's rows: every rank's `local` into `full`.
    fn gather_rows<T: Real>(
        &self,
        local: &[T],
        full: &mut [T],
        what: &str,
    ) -> Result<(), StepError> {
        let g = self.group()?.expect("rows are split only in a group");
        T::all_gather(&*g.comm, local, full).map_err(|e| StepError::Group(format!("{what}: {e}")))
    }

    /// This rank's rows of the sum of every rank's `full`.
    fn scatter_rows<T: Real>(
        &self,
        full: &[T],
        local: &mut [T],
        what: &str,
    ) -> Result<(), StepError> {
        let g = self.group()?.expect("rows are split only in a group");
        T::reduce_scatter(&*g.comm, full, local)
            .map_err(|e| StepError::Group(format!("{what}: {e}")))
    }

    /// Under sequence parallelism, each rank's LayerNorm gradients are
    /// those of its rows: adds the other ranks' share of what this pass
    /// added to `grads[ranges]` since `before` (their values then).
    fn sum_row_grads<T: Real>(
        &self,
        grads: &mut [T],
        ranges: &[Range<usize>],
        before: &[T],
        what: &str,
    ) -> Result<(), StepError> {
        let mut delta: Vec<T> = ranges
            .iter()
            .flat_map(|r| grads[r.clone()].to_vec())
            .collect();
        for (d, &b) in delta.iter_mut().zip(before) {
            *d -= b;
        }
        self.all_reduce(&mut delta, what)?;
        let mut at = 0;
        for r in ranges {
            for (g, (&b, &d)) in grads[r.clone()]
                .iter_mut()
                .zip(before[at..].iter().zip(&delta[at..]))
            {
                *g = b + d;
            }
            at += r.len();
        }
        Ok(())
    }

    fn check<T: Real>(
        &self,
        acts: &Activations<T>,
        tokens: &[u32],
        targets: &[u32],
    ) -> Result<(), StepError> {
        let n = acts.b * acts.t;
        let cfg = &self.layout.config;
        if tokens.len() != n || targets.len() != n {
            return Err(StepError::Shape(format!(
                "{} tokens and {} targets for a batch of {} x {}",
                tokens.len(),
                targets.len(),
                acts.b,
                acts.t
            )));
        }
        if acts.t > cfg.context {
            return Err(StepError::Shape(format!(
                "sequence length {} exceeds the model's context {}",
                acts.t, cfg.context
            )));
        }
        if acts.split != self.sequence_split() {
            return Err(StepError::Shape(format!(
                "activations made for rows split {} ways, the model splits them {} (make them \
                 with Gpt::activations)",
                acts.split,
                self.sequence_split()
            )));
        }
        for (pos, &tok) in tokens.iter().enumerate() {
            if tok as usize >= cfg.vocab_size {
                return Err(StepError::Token {
                    token: tok,
                    pos,
                    vocab: cfg.vocab_size,
                });
            }
        }
        for (pos, &tok) in targets.iter().enumerate() {
            if tok != u32::MAX && tok as usize >= cfg.vocab_size {
                return Err(StepError::Token {
                    token: tok,
                    pos,
                    vocab: cfg.vocab_size,
                });
            }
        }
        Ok(())
    }

    /// Ways the residual stream's rows are split (1 without sequence
    /// parallelism).
    fn sequence_split(&self) -> usize {
        match &self.group {
            Some(g) if g.sequence => g.comm.size(),
            _ => 1,
        }
    }

    /// Forward pass: returns the mean loss over positions whose target is
    /// not `u32::MAX` (0 when there are none). `tokens` and `targets` are
    /// `b × t`, row-major. The same as [`embedding_forward`](Self::embedding_forward),
    /// [`layer_forward_at`](Self::layer_forward_at) for every layer, then
    /// [`head_forward`](Self::head_forward).
    pub fn forward<T: Real>(
        &self,
        p: &[T],
        acts: &mut Activations<T>,
        tokens: &[u32],
        targets: &[u32],
    ) -> Result<T, StepError> {
        let ly = &*self.layout;
        let emb = block_of(ly, p, Block::Embedding);
        let span = |name: &dyn Fn() -> String| {
            braid_trace::scope::start(None, braid_trace::Cat::Compute, name)
        };
        let t = span(&|| "forward embedding".into());
        self.embedding_forward(emb, acts, tokens, targets)?;
        drop(t);
        for l in 0..ly.config.n_layer {
            let _t = span(&|| format!("forward layer {l}"));
            self.layer_forward_at(l, block_of(ly, p, Block::Layer(l)), acts)?;
        }
        let norm = block_of(ly, p, Block::FinalNorm);
        let _t = span(&|| "forward head".into());
        self.head_forward(norm, emb, acts, targets)
    }

    /// Transformer block `l` (`p`: its parameters, the layer's block):
    /// residual stream `l` → `l + 1`, keeping what its backward pass needs
    /// (or only its input, when checkpointing).
    pub fn layer_forward_at<T: Real>(
        &self,
        l: usize,
        p: &[T],
        acts: &mut Activations<T>,
    ) -> Result<(), StepError> {
        let (b, t) = (acts.b, acts.t);
        let i = acts.index(l)?;
        let (before, after) = acts.resid.split_at_mut(i + 1);
        let slot = if acts.checkpointing { 0 } else { i };
        self.layer_forward(
            l,
            p,
            &before[i],
            &mut after[0],
            &mut acts.layers[slot],
            &mut acts.scratch,
            b,
            t,
        )
    }

    /// Logits of the token after `tokens` (the last `context` of them).
    pub fn next_token_logits<T: Real>(&self, p: &[T], tokens: &[u32]) -> Result<Vec<T>, StepError> {
        let cfg = &self.layout.config;
        let (c, v) = (cfg.n_embd, cfg.vocab_size);
        if self.layout.shard.size > 1 {
            return Err(StepError::Group(
                "sampling runs on the whole model (consolidate the checkpoint first)".into(),
            ));
        }
        if tokens.is_empty() {
            return Err(StepError::Shape("no tokens to continue".into()));
        }
        let toks = &tokens[tokens.len().saturating_sub(cfg.context)..];
        let t = toks.len();
        let mut acts = Activations::new(&self.layout, 1, t, true);
        self.forward(p, &mut acts, toks, &vec![u32::MAX; t])?;
        let x = &acts.lnf[(t - 1) * c..t * c];
        let wte = &block_of(&self.layout, p, Block::Embedding)[self.wte.clone()];
        Ok((0..v)
            .map(|j| {
                let w = &wte[j * c..(j + 1) * c];
                let mut s = T::ZERO;
                for k in 0..c {
                    s += x[k] * w[k];
                }
                s
            })
            .collect())
    }

    /// Forward then backward: accumulates the mean loss's gradient into
    /// `grads` (same layout as `p`) and calls `ready(block, grads_of_block)`
    /// as soon as each block's gradients are final — the final norm first,
    /// then the layers from last to first, the embeddings last. Returns the
    /// mean loss. The same as [`forward`](Self::forward), then
    /// [`head_backward`](Self::head_backward),
    /// [`layer_backward_at`](Self::layer_backward_at) from the last layer
    /// down, and [`embedding_backward`](Self::embedding_backward).
    pub fn forward_backward<T: Real>(
        &self,
        p: &[T],
        grads: &mut [T],
        acts: &mut Activations<T>,
        tokens: &[u32],
        targets: &[u32],
        ready: &mut dyn FnMut(Block, &mut [T]),
    ) -> Result<T, StepError> {
        let loss = self.forward(p, acts, tokens, targets)?;
        let ly = &*self.layout;
        let block = |b: Block| ly.block_range(b);
        let emb_p = block_of(ly, p, Block::Embedding);
        // The embedding block comes first in the layout and the final norm
        // last: their gradients are disjoint slices.
        let (front, back) = grads.split_at_mut(block(Block::FinalNorm).start);
        let g_emb = &mut front[block(Block::Embedding)];
        let g_norm = &mut back[..block(Block::FinalNorm).len()];
        let norm_p = block_of(ly, p, Block::FinalNorm);
        self.head_backward(norm_p, emb_p, g_norm, g_emb, acts, targets)?;
        ready(Block::FinalNorm, g_norm);
        for l in (0..ly.config.n_layer).rev() {
            let r = block(Block::Layer(l));
            self.layer_backward_at(l, &p[r.clone()], &mut front[r.clone()], acts)?;
            ready(Block::Layer(l), &mut front[r]);
        }
        let g_emb = &mut front[block(Block::Embedding)];
        self.embedding_backward(g_emb, acts, tokens)?;
        ready(Block::Embedding, g_emb);
        Ok(loss)
    }

    /// Backward of transformer block `l` (after the blocks above it; `p`
    /// and `grads` the layer's blocks of the parameters and gradients):
    /// accumulates its parameters' gradients and turns the gradient of its
    /// output into that of its input. With checkpointing the block's
    /// forward is recomputed first.
    pub fn layer_backward_at<T: Real>(
        &self,
        l: usize,
        p: &[T],
        grads: &mut [T],
        acts: &mut Activations<T>,
    ) -> Result<(), StepError> {
        let (b, t) = (acts.b, acts.t);
        let i = acts.index(l)?;
        let slot = if acts.checkpointing { 0 } else { i };
        if acts.checkpointing {
            // Recompute this layer's internals from its saved input; the
            // output lands in a scratch buffer the backward refills anyway.
            let rows = acts.resid[i].len();
            let mut scratch_out = std::mem::take(acts.grads.of_mut(Act::Ln1));
            let r = self.layer_forward(
                l,
                p,
                &acts.resid[i],
                &mut scratch_out[..rows],
                &mut acts.layers[0],
                &mut acts.scratch,
                b,
                t,
            );
            *acts.grads.of_mut(Act::Ln1) = scratch_out;
            r?;
        }
        let shape = self.attn_shape(b, t);
        // Split backward passes keep this layer's output gradients.
        let defer = acts.deferred.get_mut(i);
        self.layer_backward(
            l,
            p,
            grads,
            &mut acts.dresid,
            &acts.resid[i],
            &acts.layers[slot],
            &mut acts.grads,
            &mut acts.scratch,
            shape,
            defer,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::GptConfig;
    use crate::params::Params;
    use std::sync::Arc;

    fn tiny() -> Arc<Layout> {
        Arc::new(Layout::new(&GptConfig::parse("L2-H2-C8-V11-T6").unwrap()))
    }

    fn batch(b: usize, t: usize, v: u32) -> (Vec<u32>, Vec<u32>) {
        let mut r = crate::rng::Rng::new(77);
        let toks: Vec<u32> = (0..b * t).map(|_| r.below(v as usize) as u32).collect();
        let mut tg: Vec<u32> = (0..b * t).map(|_| r.below(v as usize) as u32).collect();
        tg[1] = u32::MAX;
        (toks, tg)
    }

    #[test]
    fn loss_at_initialisation_is_about_ln_vocab() {
        let l = Arc::new(Layout::new(&GptConfig::parse("tiny").unwrap()));
        let p = Params::init_gpt2(l.clone(), 1);
        let m = Gpt::new(l.clone());
        let (b, t) = (4, 32);
        let mut acts = Activations::<f32>::new(&l, b, t, false);
        let (toks, tg) = batch(b, t, 256);
        let loss = m.forward(&p.data, &mut acts, &toks, &tg).unwrap();
        let want = (256f32).ln();
        assert!((loss - want).abs() < 0.05, "loss {loss}, ln(V) = {want}");
    }

    #[test]
    fn every_blocks_gradient_matches_finite_differences_in_f64() {
        let l = tiny();
        let m = Gpt::new(l.clone());
        let init = Params::init_gpt2(l.clone(), 5);
        // Larger-than-GPT-2 weights so every path carries signal.
        let p: Vec<f64> = init.data.iter().map(|&x| x as f64 * 10.0 + 0.01).collect();
        let (b, t) = (2, 5);
        let (toks, tg) = batch(b, t, 11);
        for checkpointing in [false, true] {
            let mut acts = Activations::<f64>::new(&l, b, t, checkpointing);
            let mut g = vec![0.0; p.len()];
            let mut order = Vec::new();
            m.forward_backward(&p, &mut g, &mut acts, &toks, &tg, &mut |blk, _| {
                order.push(blk)
            })
            .unwrap();
            assert_eq!(
                order,
                vec![
                    Block::FinalNorm,
                    Block::Layer(1),
                    Block::Layer(0),
                    Block::Embedding
                ]
            );
            let mut q = p.clone();
            // Central differences: truncation error ~eps², rounding error
            // ~1e-16·|loss|/eps; 1e-5 keeps both far below the bound.
            let eps = 1e-5;
            let mut worst: f64 = 0.0;
            // Every parameter of every block (the model is tiny).
            for i in 0..p.len() {
                q[i] = p[i] + eps;
                let up = m.forward(&q, &mut acts, &toks, &tg).unwrap();
                q[i] = p[i] - eps;
                let down = m.forward(&q, &mut acts, &toks, &tg).unwrap();
                q[i] = p[i];
                let num = (up - down) / (2.0 * eps);
                let err = (num - g[i]).abs() / (num.abs() + g[i].abs()).max(1e-4);
                if err > worst {
                    worst = err;
                }
            }
            assert!(
                worst < 1e-5,
                "checkpointing {checkpointing}: worst relative error {worst:e}"
            );
        }
    }

    #[test]
    fn checkpointing_gives_bit_identical_gradients() {
        let l = tiny();
        let m = Gpt::new(l.clone());
        let p = Params::init_gpt2(l.clone(), 9);
        let (toks, tg) = batch(3, 6, 11);
        let run = |ck: bool| {
            let mut acts = Activations::<f32>::new(&l, 3, 6, ck);
            let mut g = vec![0.0f32; p.data.len()];
            let loss = m
                .forward_backward(&p.data, &mut g, &mut acts, &toks, &tg, &mut |_, _| {})
                .unwrap();
            (loss, g)
        };
        assert_eq!(run(false), run(true));
    }

    #[test]
    fn bad_tokens_and_shapes_are_errors() {
        let l = tiny();
        let m = Gpt::new(l.clone());
        let p = Params::init_gpt2(l.clone(), 1);
        let mut acts = Activations::<f32>::new(&l, 1, 4, false);
        let e = m
            .forward(&p.data, &mut acts, &[1, 2, 11, 0], &[0, 0, 0, 0])
            .unwrap_err();
        assert!(e.to_string().contains("token 11 at position 2"), "{e}");
        let e = m.forward(&p.data, &mut acts, &[1, 2], &[0, 0]).unwrap_err();
        assert!(matches!(e, StepError::Shape(_)));
    }
}
