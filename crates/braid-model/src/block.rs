//! The transformer block, described once: its operations in order, the
//! tensors each reads and writes, and the parameters each owns.
//!
//! `resid2 = x + proj(attention(qkv(ln_1(x))))`,
//! `out = resid2 + fcproj(gelu(fc(ln_2(resid2))))` — as [`BLOCK`], a
//! sequence of [`Op`]s over the block's tensors ([`Act`]). A backend (the
//! CPU model, the reference in f32 and f64; the GPU model in f32; the GPU
//! model in bf16 with its fused kernels) implements the operations
//! ([`BlockForward`], [`BlockBackward`]), not the sequence: [`forward`] and [`backward`] walk
//! [`BLOCK`] over it, so a change to the block is made here once and in
//! one operation per backend.
//!
//! Tensor and sequence parallelism follow from the operations' kinds
//! (Megatron's split): an [`Op::Column`] product's output columns and an
//! [`Op::Row`] product's input rows are a tensor-parallel rank's share, a
//! row product's output is summed over the group (reduce-scattered into
//! the rank's rows under sequence parallelism), and an [`Op::Norm`]'s
//! output, read by a column product, is gathered whole under sequence
//! parallelism — its gradient summed back over the group.
//!
//! The per-layer parameter ranges ([`LayerRanges`]) are named from the
//! same description.

use crate::layout::{Block, Layout};
use crate::model::Widths;
use std::ops::Range;

/// A tensor of one block's passes — in the backward pass, also its
/// gradient. [`Act::X`] is the block's input (the residual stream
/// entering it) and [`Act::Out`] its output (the residual stream leaving
/// it): a backend keeps those outside the block's own buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Act {
    /// The residual stream entering the block (this rank's rows).
    X,
    /// `ln_1(x)`, every row.
    Ln1,
    /// The query, key and value projections, every row.
    Qkv,
    /// The attention's output, every row.
    Atty,
    /// The residual stream after the attention (this rank's rows).
    Resid2,
    /// `ln_2(resid2)`, every row.
    Ln2,
    /// The MLP's hidden layer before its GELU.
    Fch,
    /// The MLP's hidden layer after its GELU.
    Gelu,
    /// The residual stream leaving the block (this rank's rows).
    Out,
}

impl Act {
    /// Every tensor, in [`index`](Self::index) order.
    pub const ALL: [Act; 9] = [
        Act::X,
        Act::Ln1,
        Act::Qkv,
        Act::Atty,
        Act::Resid2,
        Act::Ln2,
        Act::Fch,
        Act::Gelu,
        Act::Out,
    ];

    /// Its place in [`ALL`](Self::ALL): backends keep their buffers in
    /// arrays indexed by it.
    pub const fn index(self) -> usize {
        self as usize
    }

    /// Whether it is the residual stream: this rank's rows under sequence
    /// parallelism, every row otherwise (the other tensors always hold
    /// every row).
    pub const fn residual(self) -> bool {
        matches!(self, Act::X | Act::Resid2 | Act::Out)
    }

    /// Its rows: `nl` (this rank's) for the residual stream, `n` (every
    /// row) for the rest.
    pub const fn rows(self, n: usize, nl: usize) -> usize {
        match self.residual() {
            true => nl,
            false => n,
        }
    }

    /// Its width at a rank's widths.
    pub const fn width(self, w: &Widths) -> usize {
        match self {
            Act::X | Act::Ln1 | Act::Resid2 | Act::Ln2 | Act::Out => w.c,
            Act::Qkv => 3 * w.attn,
            Act::Atty => w.attn,
            Act::Fch | Act::Gelu => w.mlp,
        }
    }

    /// Whether a backend keeps it among the block's own buffers (every
    /// tensor but the block's input and output).
    pub const fn inside(self) -> bool {
        !matches!(self, Act::X | Act::Out)
    }

    /// Its place among the block's own tensors ([`INSIDE`]), if it is one.
    pub const fn inner(self) -> Option<usize> {
        match self {
            Act::X | Act::Out => None,
            a => Some(a.index() - 1),
        }
    }
}

/// The block's own tensors (all but its input and output), in
/// [`Act::inner`] order.
pub const INSIDE: [Act; 7] = [
    Act::Ln1,
    Act::Qkv,
    Act::Atty,
    Act::Resid2,
    Act::Ln2,
    Act::Fch,
    Act::Gelu,
];

/// Elements of the block's own tensors ([`INSIDE`]) at a rank's widths
/// over `n` rows (`nl` of them this rank's, for the residual stream): what
/// a backend that keeps each of them holds per layer, and again for their
/// gradients — the memory estimate counts from here.
pub fn inside_elements(w: &Widths, n: usize, nl: usize) -> u128 {
    INSIDE
        .iter()
        .map(|a| a.rows(n, nl) as u128 * a.width(w) as u128)
        .sum()
}

/// One of the block's LayerNorms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Norm {
    /// Before the attention.
    Ln1,
    /// Before the MLP.
    Ln2,
}

impl Norm {
    /// Both, in [`index`](Self::index) order.
    pub const ALL: [Norm; 2] = [Norm::Ln1, Norm::Ln2];

    /// Its place in [`ALL`](Self::ALL).
    pub const fn index(self) -> usize {
        self as usize
    }

    /// Its name in a GPT-2 checkpoint (`h.{l}.` before it).
    pub const fn name(self) -> &'static str {
        match self {
            Norm::Ln1 => "ln_1",
            Norm::Ln2 => "ln_2",
        }
    }
}

/// One of the block's four products (each with its bias).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Linear {
    /// `ln_1 → qkv`, split by whole heads (column-split).
    Qkv,
    /// The attention's output projection (row-split).
    Proj,
    /// The MLP's first product (column-split).
    Fc,
    /// The MLP's output projection (row-split).
    FcProj,
}

impl Linear {
    /// All four, in [`index`](Self::index) order.
    pub const ALL: [Linear; 4] = [Linear::Qkv, Linear::Proj, Linear::Fc, Linear::FcProj];

    /// Its place in [`ALL`](Self::ALL).
    pub const fn index(self) -> usize {
        self as usize
    }

    /// Its name in a GPT-2 checkpoint (`h.{l}.` before it).
    pub const fn name(self) -> &'static str {
        match self {
            Linear::Qkv => "attn.c_attn",
            Linear::Proj => "attn.c_proj",
            Linear::Fc => "mlp.c_fc",
            Linear::FcProj => "mlp.c_proj",
        }
    }

    /// Its input and output widths at a rank's widths.
    pub const fn widths(self, w: &Widths) -> (usize, usize) {
        match self {
            Linear::Qkv => (w.c, 3 * w.attn),
            Linear::Proj => (w.attn, w.c),
            Linear::Fc => (w.c, w.mlp),
            Linear::FcProj => (w.mlp, w.c),
        }
    }
}

/// One operation of the block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// `out = LayerNorm(input)` over the residual stream's rows (this
    /// rank's under sequence parallelism, then gathered whole for the
    /// column product that reads `out`); its backward pass first sums
    /// `out`'s gradient over the group (that product's input gradient is
    /// each rank's share) and adds to `input`'s.
    Norm { norm: Norm, input: Act, out: Act },
    /// `out = input · W + b`, a column-split product: every row, this
    /// rank's output columns.
    Column {
        linear: Linear,
        input: Act,
        out: Act,
    },
    /// Causal multi-head attention of this rank's heads.
    Attention { input: Act, out: Act },
    /// `out = GELU(input)`, elementwise (tanh approximation).
    Gelu { input: Act, out: Act },
    /// `out = residual + b + Σ_group input · W`, a row-split product
    /// (`input` this rank's share of the inner dimension) with its bias
    /// and the residual connection; its backward pass begins `residual`'s
    /// gradient with `out`'s.
    Row {
        linear: Linear,
        input: Act,
        residual: Act,
        out: Act,
    },
}

/// The block, in forward order.
pub const BLOCK: [Op; 8] = [
    Op::Norm {
        norm: Norm::Ln1,
        input: Act::X,
        out: Act::Ln1,
    },
    Op::Column {
        linear: Linear::Qkv,
        input: Act::Ln1,
        out: Act::Qkv,
    },
    Op::Attention {
        input: Act::Qkv,
        out: Act::Atty,
    },
    Op::Row {
        linear: Linear::Proj,
        input: Act::Atty,
        residual: Act::X,
        out: Act::Resid2,
    },
    Op::Norm {
        norm: Norm::Ln2,
        input: Act::Resid2,
        out: Act::Ln2,
    },
    Op::Column {
        linear: Linear::Fc,
        input: Act::Ln2,
        out: Act::Fch,
    },
    Op::Gelu {
        input: Act::Fch,
        out: Act::Gelu,
    },
    Op::Row {
        linear: Linear::FcProj,
        input: Act::Gelu,
        residual: Act::Resid2,
        out: Act::Out,
    },
];

impl Op {
    /// The tensor it writes.
    pub const fn out(&self) -> Act {
        match *self {
            Op::Norm { out, .. }
            | Op::Column { out, .. }
            | Op::Attention { out, .. }
            | Op::Gelu { out, .. }
            | Op::Row { out, .. } => out,
        }
    }

    /// The tensors it reads.
    pub fn inputs(&self) -> Vec<Act> {
        match *self {
            Op::Norm { input, .. }
            | Op::Column { input, .. }
            | Op::Attention { input, .. }
            | Op::Gelu { input, .. } => vec![input],
            Op::Row {
                input, residual, ..
            } => vec![input, residual],
        }
    }

    /// Its product, if it has one.
    pub const fn linear(&self) -> Option<Linear> {
        match *self {
            Op::Column { linear, .. } | Op::Row { linear, .. } => Some(linear),
            _ => None,
        }
    }

    fn forward<P: BlockForward + ?Sized>(&self, p: &mut P) -> Result<(), P::Error> {
        match *self {
            Op::Norm { norm, input, out } => p.norm_forward(norm, input, out),
            Op::Column { linear, input, out } => p.column_forward(linear, input, out),
            Op::Attention { input, out } => p.attention_forward(input, out),
            Op::Gelu { input, out } => p.gelu_forward(input, out),
            Op::Row {
                linear,
                input,
                residual,
                out,
            } => p.row_forward(linear, input, residual, out),
        }
    }

    fn backward<P: BlockBackward + ?Sized>(&self, p: &mut P) -> Result<(), P::Error> {
        match *self {
            Op::Norm { norm, input, out } => p.norm_backward(norm, input, out),
            Op::Column { linear, input, out } => p.column_backward(linear, input, out),
            Op::Attention { input, out } => p.attention_backward(input, out),
            Op::Gelu { input, out } => p.gelu_backward(input, out),
            Op::Row {
                linear,
                input,
                residual,
                out,
            } => p.row_backward(linear, input, residual, out),
        }
    }
}

/// The block's products in backward order, each with the tensor it reads
/// (its weight gradient's input): what a split backward pass's weight
/// half computes.
pub fn products_backward() -> impl Iterator<Item = (Linear, Act)> {
    BLOCK.iter().rev().filter_map(|op| match *op {
        Op::Column { linear, input, .. } | Op::Row { linear, input, .. } => Some((linear, input)),
        _ => None,
    })
}

/// A backend's forward operations over one block's tensors: what
/// [`forward`] calls, in [`BLOCK`]'s order.
pub trait BlockForward {
    /// What an operation's failure is (a collective's, a kernel's).
    type Error;

    /// [`Op::Norm`]'s forward pass.
    fn norm_forward(&mut self, norm: Norm, input: Act, out: Act) -> Result<(), Self::Error>;
    /// [`Op::Column`]'s forward pass.
    fn column_forward(&mut self, linear: Linear, input: Act, out: Act) -> Result<(), Self::Error>;
    /// [`Op::Attention`]'s forward pass.
    fn attention_forward(&mut self, input: Act, out: Act) -> Result<(), Self::Error>;
    /// [`Op::Gelu`]'s forward pass.
    fn gelu_forward(&mut self, input: Act, out: Act) -> Result<(), Self::Error>;
    /// [`Op::Row`]'s forward pass.
    fn row_forward(
        &mut self,
        linear: Linear,
        input: Act,
        residual: Act,
        out: Act,
    ) -> Result<(), Self::Error>;
}

/// A backend's backward operations over one block's tensors: what
/// [`backward`] calls, in [`BLOCK`]'s reverse order.
///
/// The gradients follow one rule: the first operation (in backward
/// order) to produce a tensor's gradient sets it, the later ones add to
/// it — a [`Op::Row`] product sets its residual's and a [`Op::Norm`] adds
/// to its input's. The block's input and output gradients may share one
/// buffer: [`BLOCK`] reads `out`'s gradient (in its last operation's
/// backward pass) before anything writes `x`'s.
pub trait BlockBackward {
    /// What an operation's failure is (a collective's, a kernel's).
    type Error;

    /// Before the first backward operation (`out`'s gradient is in place).
    fn backward_begin(&mut self) -> Result<(), Self::Error>;
    /// [`Op::Norm`]'s backward pass.
    fn norm_backward(&mut self, norm: Norm, input: Act, out: Act) -> Result<(), Self::Error>;
    /// [`Op::Column`]'s backward pass.
    fn column_backward(&mut self, linear: Linear, input: Act, out: Act) -> Result<(), Self::Error>;
    /// [`Op::Attention`]'s backward pass.
    fn attention_backward(&mut self, input: Act, out: Act) -> Result<(), Self::Error>;
    /// [`Op::Gelu`]'s backward pass.
    fn gelu_backward(&mut self, input: Act, out: Act) -> Result<(), Self::Error>;
    /// [`Op::Row`]'s backward pass.
    fn row_backward(
        &mut self,
        linear: Linear,
        input: Act,
        residual: Act,
        out: Act,
    ) -> Result<(), Self::Error>;
    /// After the last backward operation (`x`'s gradient is final).
    fn backward_end(&mut self) -> Result<(), Self::Error>;
}

/// The block's forward pass over a backend: [`BLOCK`] in order.
pub fn forward<P: BlockForward + ?Sized>(p: &mut P) -> Result<(), P::Error> {
    BLOCK.iter().try_for_each(|op| op.forward(p))
}

/// The block's backward pass over a backend: [`BLOCK`] in reverse,
/// between [`BlockBackward::backward_begin`] and
/// [`BlockBackward::backward_end`].
pub fn backward<P: BlockBackward + ?Sized>(p: &mut P) -> Result<(), P::Error> {
    p.backward_begin()?;
    BLOCK.iter().rev().try_for_each(|op| op.backward(p))?;
    p.backward_end()
}

/// One layer's parameter ranges, named from the description: in the flat
/// buffer ([`LayerRanges::of`]) or within the layer's block
/// ([`LayerRanges::in_block`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerRanges {
    pub ln1_w: Range<usize>,
    pub ln1_b: Range<usize>,
    pub qkv_w: Range<usize>,
    pub qkv_b: Range<usize>,
    pub proj_w: Range<usize>,
    pub proj_b: Range<usize>,
    pub ln2_w: Range<usize>,
    pub ln2_b: Range<usize>,
    pub fc_w: Range<usize>,
    pub fc_b: Range<usize>,
    pub fcproj_w: Range<usize>,
    pub fcproj_b: Range<usize>,
}

impl LayerRanges {
    /// Layer `l`'s ranges in `layout`'s flat buffer.
    pub fn of(layout: &Layout, l: usize) -> LayerRanges {
        Self::from(layout, l, 0)
    }

    /// Layer `l`'s ranges within its block ([`Block::Layer`]).
    pub fn in_block(layout: &Layout, l: usize) -> LayerRanges {
        Self::from(layout, l, layout.block_range(Block::Layer(l)).start)
    }

    fn from(layout: &Layout, l: usize, base: usize) -> LayerRanges {
        let r = |part: &str, what: &str| {
            let at = layout
                .get(&format!("h.{l}.{part}.{what}"))
                .expect("the layout has every layer parameter the block names")
                .range();
            at.start - base..at.end - base
        };
        let norm = |n: Norm| (r(n.name(), "weight"), r(n.name(), "bias"));
        let linear = |k: Linear| (r(k.name(), "weight"), r(k.name(), "bias"));
        let ((ln1_w, ln1_b), (ln2_w, ln2_b)) = (norm(Norm::Ln1), norm(Norm::Ln2));
        let (qkv_w, qkv_b) = linear(Linear::Qkv);
        let (proj_w, proj_b) = linear(Linear::Proj);
        let (fc_w, fc_b) = linear(Linear::Fc);
        let (fcproj_w, fcproj_b) = linear(Linear::FcProj);
        LayerRanges {
            ln1_w,
            ln1_b,
            qkv_w,
            qkv_b,
            proj_w,
            proj_b,
            ln2_w,
            ln2_b,
            fc_w,
            fc_b,
            fcproj_w,
            fcproj_b,
        }
    }

    /// A LayerNorm's weight and bias.
    pub fn norm(&self, n: Norm) -> (Range<usize>, Range<usize>) {
        match n {
            Norm::Ln1 => (self.ln1_w.clone(), self.ln1_b.clone()),
            Norm::Ln2 => (self.ln2_w.clone(), self.ln2_b.clone()),
        }
    }

    /// A product's weight and bias.
    pub fn linear(&self, k: Linear) -> (Range<usize>, Range<usize>) {
        match k {
            Linear::Qkv => (self.qkv_w.clone(), self.qkv_b.clone()),
            Linear::Proj => (self.proj_w.clone(), self.proj_b.clone()),
            Linear::Fc => (self.fc_w.clone(), self.fc_b.clone()),
            Linear::FcProj => (self.fcproj_w.clone(), self.fcproj_b.clone()),
        }
    }

    /// Both LayerNorms' weights and biases (each norm's two are adjacent).
    pub fn norms(&self) -> [Range<usize>; 2] {
        [
            self.ln1_w.start..self.ln1_b.end,
            self.ln2_w.start..self.ln2_b.end,
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::GptConfig;
    use std::collections::HashSet;

    #[test]
    fn every_tensor_but_the_input_is_written_once_before_it_is_read() {
        let mut written: HashSet<Act> = [Act::X].into();
        for op in BLOCK {
            for i in op.inputs() {
                assert!(
                    written.contains(&i),
                    "{op:?} reads {i:?} before it is written"
                );
            }
            assert!(
                written.insert(op.out()),
                "{op:?} writes {:?} twice",
                op.out()
            );
        }
        assert_eq!(written.len(), Act::ALL.len());
        for (i, a) in INSIDE.iter().enumerate() {
            assert_eq!(a.inner(), Some(i));
        }
        assert_eq!(BLOCK.last().map(Op::out), Some(Act::Out));
    }

    #[test]
    fn the_output_gradient_is_read_before_the_input_gradient_is_written() {
        // Backends may keep x's and out's gradients in one buffer: only the
        // operation writing `out` reads its gradient, and it comes first in
        // backward order without writing x's.
        let writes_out: Vec<&Op> = BLOCK.iter().filter(|op| op.out() == Act::Out).collect();
        assert_eq!(writes_out, [BLOCK.last().expect("a block has operations")]);
        assert!(!writes_out[0].inputs().contains(&Act::X));
        // Nor does any operation relate the two.
        for op in BLOCK {
            let mut outside = op.inputs();
            outside.push(op.out());
            outside.retain(|a| !a.inside());
            assert!(outside.len() <= 1, "{op:?} relates x and out");
        }
    }

    #[test]
    fn each_product_and_norm_appears_once() {
        let linears: Vec<Linear> = BLOCK.iter().filter_map(Op::linear).collect();
        assert_eq!(linears, Linear::ALL.to_vec());
        let norms: Vec<Norm> = BLOCK
            .iter()
            .filter_map(|op| match op {
                Op::Norm { norm, .. } => Some(*norm),
                _ => None,
            })
            .collect();
        assert_eq!(norms, Norm::ALL.to_vec());
        let back: Vec<Linear> = products_backward().map(|(k, _)| k).collect();
        assert_eq!(
            back,
            [Linear::FcProj, Linear::Fc, Linear::Proj, Linear::Qkv]
        );
    }

    #[test]
    fn ranges_in_the_block_are_the_flat_ranges_less_the_blocks_start() {
        let layout = Layout::new(&GptConfig::parse("L3-H2-C8-V32-T16").unwrap());
        for l in 0..layout.config.n_layer {
            let (flat, local) = (
                LayerRanges::of(&layout, l),
                LayerRanges::in_block(&layout, l),
            );
            let base = layout.block_range(Block::Layer(l)).start;
            for k in Linear::ALL {
                let ((w, b), (lw, lb)) = (flat.linear(k), local.linear(k));
                assert_eq!((w.start - base, b.end - base), (lw.start, lb.end));
                let name = format!("h.{l}.{}.weight", k.name());
                assert_eq!(layout.get(&name).map(|p| p.range()), Some(w));
            }
            for n in Norm::ALL {
                let (w, b) = flat.norm(n);
                assert_eq!(w.end, b.start, "{n:?}'s weight and bias are adjacent");
            }
        }
    }
}
