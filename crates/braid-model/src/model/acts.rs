//! What a forward pass keeps for its backward pass ([`Activations`]), and
//! the widths every buffer and product of one rank's passes have
//! ([`Widths`]).

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

/// One layer's saved activations.
#[derive(Debug, Clone)]
pub(super) struct LayerActs<T> {
    pub ln1: Vec<T>,
    pub ln1_mean: Vec<T>,
    pub ln1_rstd: Vec<T>,
    pub qkv: Vec<T>,
    pub att: Vec<T>,
    pub atty: Vec<T>,
    pub resid2: Vec<T>,
    pub ln2: Vec<T>,
    pub ln2_mean: Vec<T>,
    pub ln2_rstd: Vec<T>,
    pub fch: Vec<T>,
    pub fch_gelu: Vec<T>,
}

impl<T: Real> LayerActs<T> {
    /// A layer's buffers; `nl` of the `b × t` rows are this rank's
    /// (sequence parallelism: the LayerNorms' statistics and the residual
    /// stream; the LayerNorms' outputs are gathered whole).
    fn new(b: usize, t: usize, nl: usize, w: Widths) -> Self {
        let n = b * t;
        let z = |k: usize| vec![T::ZERO; k];
        LayerActs {
            ln1: z(n * w.c),
            ln1_mean: z(nl),
            ln1_rstd: z(nl),
            qkv: z(n * 3 * w.attn),
            att: z(b * w.heads * t * t),
            atty: z(n * w.attn),
            resid2: z(nl * w.c),
            ln2: z(n * w.c),
            ln2_mean: z(nl),
            ln2_rstd: z(nl),
            fch: z(n * w.mlp),
            fch_gelu: z(n * w.mlp),
        }
    }

    fn elements(&self) -> usize {
        [
            &self.ln1,
            &self.ln1_mean,
            &self.ln1_rstd,
            &self.qkv,
            &self.att,
            &self.atty,
            &self.resid2,
            &self.ln2,
            &self.ln2_mean,
            &self.ln2_rstd,
            &self.fch,
            &self.fch_gelu,
        ]
        .iter()
        .map(|v| v.len())
        .sum()
    }
}

/// What a layer's split backward pass keeps from its input half for its
/// weight half: the output gradient each of its four products saw (whole
/// rows).
#[derive(Debug, Clone)]
pub(super) struct LayerDy<T> {
    pub fcproj: Vec<T>,
    pub fc: Vec<T>,
    pub proj: Vec<T>,
    pub qkv: Vec<T>,
}

impl<T: Real> LayerDy<T> {
    fn new(n: usize, w: Widths) -> Self {
        let z = |k: usize| vec![T::ZERO; k];
        LayerDy {
            fcproj: z(n * w.c),
            fc: z(n * w.mlp),
            proj: z(n * w.c),
            qkv: z(n * 3 * w.attn),
        }
    }
}

/// Gradient scratch shared by all layers.
#[derive(Debug, Clone)]
pub(super) struct LayerGrads<T> {
    pub dresid2: Vec<T>,
    pub dln2: Vec<T>,
    pub dfch: Vec<T>,
    pub dgelu: Vec<T>,
    pub datty: Vec<T>,
    pub dqkv: Vec<T>,
    pub dln1: Vec<T>,
}

impl<T> LayerGrads<T> {
    fn elements(&self) -> usize {
        [
            &self.dresid2,
            &self.dln2,
            &self.dfch,
            &self.dgelu,
            &self.datty,
            &self.dqkv,
            &self.dln1,
        ]
        .iter()
        .map(|v| v.len())
        .sum()
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
            grads: LayerGrads {
                dresid2: z(nl * w.c),
                dln2: z(n * w.c),
                dfch: z(n * w.mlp),
                dgelu: z(n * w.mlp),
                datty: z(n * w.attn),
                dqkv: z(n * 3 * w.attn),
                dln1: z(n * w.c),
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
            + self
                .deferred
                .iter()
                .map(|d| d.fcproj.len() + d.fc.len() + d.proj.len() + d.qkv.len())
                .sum::<usize>()
    }

    /// Each position's loss from the last forward pass (0 where the target
    /// was masked).
    pub fn losses(&self) -> &[T] {
        &self.losses
    }

    /// Where layer `l`'s buffers are (its index among these layers).
    pub(super) fn index(&self, l: usize) -> Result<usize, super::StepError> {
        match l.checked_sub(self.first) {
            Some(i) if i + 1 < self.resid.len() => Ok(i),
            _ => Err(super::StepError::Shape(format!(
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
