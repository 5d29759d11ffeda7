//! What a forward pass keeps for its backward pass ([`Activations`]), and
//! the widths every buffer and product of one rank's passes have
//! ([`Widths`]).

use super::error::StepError;
use crate::block::{Act, Linear};
use crate::cpu::Real;
use crate::layout::Layout;

/// The widths one rank's passes run at. The residual stream is always the
/// model's width; the attention (its heads), the MLP's hidden layer and
/// the vocabulary are the whole model's in one process, and a slice of
/// them on a tensor-parallel rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Widths {
    /// The residual stream's width (`C`).
    pub c: usize,
    /// Attention heads run here.
    pub heads: usize,
    /// Their width: heads × head size (`qkv` is `3 ×` this, the output
    /// projection's input this).
    pub attn: usize,
    /// The MLP's hidden width here.
    pub mlp: usize,
    /// Vocabulary rows of the token embedding (and logits) here.
    pub vocab: usize,
    /// The first of them, in the whole vocabulary.
    pub vocab_start: usize,
}

impl Widths {
    /// The widths of `layout`'s passes.
    pub fn of(layout: &Layout) -> Widths {
        let (cfg, n) = (&layout.config, layout.shard.size);
        let (vocab_start, vocab) = layout.shard.vocab(cfg.vocab_size);
        Widths {
            c: cfg.n_embd,
            heads: cfg.n_head / n,
            attn: cfg.n_embd / n,
            mlp: 4 * cfg.n_embd / n,
            vocab,
            vocab_start,
        }
    }
}

/// One layer's saved activations: the block's tensors
/// ([`Act`], by index; its input and output are the residual stream's,
/// kept outside), each LayerNorm's statistics and the attention's
/// probabilities.
#[derive(Debug, Clone)]
pub(super) struct LayerActs<T> {
    pub t: [Vec<T>; 9],
    pub mean: [Vec<T>; 2],
    pub rstd: [Vec<T>; 2],
    pub att: Vec<T>,
}

impl<T: Real> LayerActs<T> {
    /// A layer's buffers; `nl` of the `b × t` rows are this rank's
    /// (sequence parallelism: the LayerNorms' statistics and the residual
    /// stream; the LayerNorms' outputs are gathered whole).
    fn new(b: usize, t: usize, nl: usize, w: Widths) -> Self {
        let n = b * t;
        let z = |k: usize| vec![T::ZERO; k];
        LayerActs {
            t: Act::ALL.map(|a| match a.inside() {
                false => Vec::new(),
                true => z(a.rows(n, nl) * a.width(&w)),
            }),
            mean: [z(nl), z(nl)],
            rstd: [z(nl), z(nl)],
            att: z(b * w.heads * t * t),
        }
    }

    fn elements(&self) -> usize {
        let all = self.t.iter().chain(&self.mean).chain(&self.rstd);
        all.map(Vec::len).sum::<usize>() + self.att.len()
    }
}

/// What a layer's split backward pass keeps from its input half for its
/// weight half: the output gradient each of its four products saw (whole
/// rows), by [`Linear`] index.
#[derive(Debug, Clone)]
pub(super) struct LayerDy<T> {
    pub dy: [Vec<T>; 4],
}

impl<T: Real> LayerDy<T> {
    fn new(n: usize, w: Widths) -> Self {
        LayerDy {
            dy: Linear::ALL.map(|k| vec![T::ZERO; n * k.widths(&w).1]),
        }
    }

    fn elements(&self) -> usize {
        self.dy.iter().map(Vec::len).sum()
    }
}

/// Gradient scratch shared by all layers: the gradients of the block's
/// tensors ([`Act`], by index; its input's and output's are the residual
/// stream's, kept outside).
#[derive(Debug, Clone)]
pub(super) struct LayerGrads<T> {
    pub d: [Vec<T>; 9],
}

impl<T> LayerGrads<T> {
    fn elements(&self) -> usize {
        self.d.iter().map(Vec::len).sum()
    }

    /// The gradient of one of the block's own tensors.
    pub fn of_mut(&mut self, a: Act) -> &mut Vec<T> {
        &mut self.d[a.index()]
    }
}

/// Buffers the passes of a sequence-parallel rank use between a
/// collective and the next step (empty otherwise).
#[derive(Debug, Clone)]
pub(super) struct Scratch<T> {
    /// All rows (`b × t × C`): a row-split product's partial sums before
    /// their reduce-scatter, a gathered gradient.
    pub full: Vec<T>,
    /// This rank's rows (`b × t / N × C`): a LayerNorm's output before its
    /// all-gather, a gradient after its reduce-scatter.
    pub local: Vec<T>,
}

/// Everything a forward pass keeps for its backward pass, sized for one
/// (batch, sequence) shape.
#[derive(Debug, Clone)]
pub struct Activations<T> {
    pub(super) b: usize,
    pub(super) t: usize,
    /// Ways the residual stream's rows are split (sequence parallelism).
    pub(super) split: usize,
    pub(super) checkpointing: bool,
    /// The first layer they are for (a pipeline stage's; 0 for the whole
    /// model): layer `l`'s buffers are at `l - first`.
    pub(super) first: usize,
    /// Residual stream entering each of the layers, and after the last
    /// (`L + 1` for the whole model).
    pub(super) resid: Vec<Vec<T>>,
    /// Saved internals per layer (one shared set when checkpointing).
    pub(super) layers: Vec<LayerActs<T>>,
    pub(super) lnf: Vec<T>,
    pub(super) lnf_mean: Vec<T>,
    pub(super) lnf_rstd: Vec<T>,
    pub(super) losses: Vec<T>,
    pub(super) logits: Vec<T>,
    pub(super) grads: LayerGrads<T>,
    pub(super) dresid: Vec<T>,
    pub(super) scratch: Scratch<T>,
    /// Per layer, where the backward pass is split in halves
    /// ([`split_backward`](Self::split_backward)); empty otherwise.
    pub(super) deferred: Vec<LayerDy<T>>,
}

impl<T: Real> Activations<T> {
    /// Buffers for batches of `b` sequences of `t` tokens; with
    /// `checkpointing`, one layer's internals instead of all of them.
    pub fn new(layout: &Layout, b: usize, t: usize, checkpointing: bool) -> Self {
        Self::sharded(layout, &layout.stages[0], b, t, checkpointing, 1)
    }

    /// [`new`](Self::new) for a rank whose residual stream holds one of
    /// `split` equal slices of the `b × t` rows (sequence parallelism;
    /// [`crate::Gpt::activations`] checks that they split).
    pub(super) fn sharded(
        layout: &Layout,
        stage: &crate::layout::Stage,
        b: usize,
        t: usize,
        checkpointing: bool,
        split: usize,
    ) -> Self {
        let w = Widths::of(layout);
        // A pipeline stage's layers (the whole model's by default); the
        // head's buffers on the last stage only.
        let l = stage.layers.len();
        let n = b * t;
        let nl = n / split;
        let z = |k: usize| vec![T::ZERO; k];
        let head = |k: usize| if stage.last { z(k) } else { Vec::new() };
        let kept = if checkpointing { 1 } else { l };
        let split_only = |k: usize| if split > 1 { z(k) } else { Vec::new() };
        Activations {
            b,
            t,
            split,
            checkpointing,
            first: stage.layers.start,
            resid: (0..=l).map(|_| z(nl * w.c)).collect(),
            layers: (0..kept).map(|_| LayerActs::new(b, t, nl, w)).collect(),
            lnf: head(n * w.c),
            lnf_mean: head(nl),
            lnf_rstd: head(nl),
            losses: head(n),
            logits: Vec::new(),
            // The gradients' scratch: the residual stream's rows for the
            // residual stream, every row for the rest.
            grads: LayerGrads {
                d: Act::ALL.map(|a| match a.inside() {
                    false => Vec::new(),
                    true => z(a.rows(n, nl) * a.width(&w)),
                }),
            },
            dresid: z(nl * w.c),
            scratch: Scratch {
                full: split_only(n * w.c),
                local: split_only(nl * w.c),
            },
            deferred: Vec::new(),
        }
    }

    /// Splits the backward passes run with these activations in halves:
    /// the input half keeps each layer's output gradients and leaves its
    /// weight gradients to the weight half
    /// ([`crate::Gpt::stage_backward_weights`]), which reads the layer's
    /// saved internals — so not under activation checkpointing (there the
    /// passes stay whole; returns whether they split).
    pub fn split_backward(&mut self, layout: &Layout) -> bool {
        if self.checkpointing {
            return false;
        }
        let w = Widths::of(layout);
        let n = self.b * self.t;
        self.deferred = (0..self.layers.len()).map(|_| LayerDy::new(n, w)).collect();
        true
    }

    /// Elements held now (the classifier's chunk of logits counts once
    /// the first forward pass has sized it).
    pub fn elements(&self) -> usize {
        self.resid.iter().map(Vec::len).sum::<usize>()
            + self.layers.iter().map(LayerActs::elements).sum::<usize>()
            + self.lnf.len()
            + self.lnf_mean.len()
            + self.lnf_rstd.len()
            + self.losses.len()
            + self.logits.len()
            + self.grads.elements()
            + self.dresid.len()
            + self.scratch.full.len()
            + self.scratch.local.len()
            + self.deferred.iter().map(LayerDy::elements).sum::<usize>()
    }

    /// Each position's loss from the last forward pass (0 where the target
    /// was masked).
    pub fn losses(&self) -> &[T] {
        &self.losses
    }

    /// Where layer `l`'s buffers are (its index among these layers).
    pub(super) fn index(&self, l: usize) -> Result<usize, StepError> {
        match l.checked_sub(self.first) {
            Some(i) if i + 1 < self.resid.len() => Ok(i),
            _ => Err(StepError::Shape(format!(
                "layer {l}: these activations are for layers {}..{}",
                self.first,
                self.first + self.resid.len() - 1
            ))),
        }
    }

    /// The residual stream after the last of their layers: a pipeline
    /// stage's output.
    pub fn output(&self) -> &[T] {
        self.resid.last().expect("at least the input")
    }

    /// The residual stream entering the first of their layers: a pipeline
    /// stage's input, written by the previous stage's output.
    pub fn input_mut(&mut self) -> &mut [T] {
        &mut self.resid[0]
    }

    /// The gradient of the residual stream: of the output before a
    /// stage's backward pass (the next stage's input gradient), of the
    /// input after it.
    pub fn residual_grad(&self) -> &[T] {
        &self.dresid
    }

    /// [`residual_grad`](Self::residual_grad), to write.
    pub fn residual_grad_mut(&mut self) -> &mut [T] {
        &mut self.dresid
    }
}
