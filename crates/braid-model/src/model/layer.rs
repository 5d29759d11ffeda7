//! One transformer block's forward and backward passes:
//! `resid2 = x + proj(attn(qkv(ln1(x))))`, `out = resid2 +
//! fcproj(gelu(fc(ln2(resid2))))`, at the rank's [`Widths`].

use super::acts::{LayerActs, LayerDy, LayerGrads, Scratch, Widths};
use super::{two_mut, Gpt, StepError};
use crate::cpu::attention::{attention_backward, attention_forward, AttnShape};
use crate::cpu::gelu::{gelu_backward, gelu_forward};
use crate::cpu::matmul::{
    linear_backward, linear_backward_input, linear_backward_weight, linear_forward,
};
use crate::cpu::norm::{layernorm_backward, layernorm_forward};
use crate::cpu::Real;
use crate::layout::{Block, Layout};
use std::ops::Range;

/// Ranges of one layer's parameters in the layer's block.
#[derive(Debug, Clone)]
pub(super) struct LayerParams {
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

impl LayerParams {
    pub fn of(layout: &Layout, i: usize) -> LayerParams {
        let base = layout.block_range(Block::Layer(i)).start;
        let r = |s: &str| {
            let at = layout
                .get(&format!("h.{i}.{s}"))
                .expect("layout has every layer parameter")
                .range();
            at.start - base..at.end - base
        };
        LayerParams {
            ln1_w: r("ln_1.weight"),
            ln1_b: r("ln_1.bias"),
            qkv_w: r("attn.c_attn.weight"),
            qkv_b: r("attn.c_attn.bias"),
            proj_w: r("attn.c_proj.weight"),
            proj_b: r("attn.c_proj.bias"),
            ln2_w: r("ln_2.weight"),
            ln2_b: r("ln_2.bias"),
            fc_w: r("mlp.c_fc.weight"),
            fc_b: r("mlp.c_fc.bias"),
            fcproj_w: r("mlp.c_proj.weight"),
            fcproj_b: r("mlp.c_proj.bias"),
        }
    }
}

impl Gpt {
    /// The attention's shape at this rank's widths.
    pub(super) fn attn_shape(&self, b: usize, t: usize) -> AttnShape {
        AttnShape {
            b,
            t,
            c: self.widths.attn,
            nh: self.widths.heads,
        }
    }

    /// A LayerNorm of this rank's rows of `x` into `out` (all rows):
    /// under sequence parallelism through the local scratch and an
    /// all-gather.
    #[allow(clippy::too_many_arguments)]
    fn norm_forward<T: Real>(
        &self,
        out: &mut [T],
        mean: &mut [T],
        rstd: &mut [T],
        x: &[T],
        w: &[T],
        bias: &[T],
        local: &mut [T],
        what: &str,
    ) -> Result<(), StepError> {
        let c = self.widths.c;
        match self.sequence_parallel() {
            false => layernorm_forward(out, mean, rstd, x, w, bias, c),
            true => {
                layernorm_forward(local, mean, rstd, x, w, bias, c);
                self.gather_rows(local, out, what)?;
            }
        }
        Ok(())
    }

    /// A row-split product's output: `out` (this rank's rows) becomes
    /// `resid + bias + Σ_ranks inp · w` (`inp` `n × k`, this rank's share
    /// of the inner dimension). In one process the product and its bias
    /// are one call, as always.
    #[allow(clippy::too_many_arguments)]
    fn row_split_forward<T: Real>(
        &self,
        out: &mut [T],
        inp: &[T],
        w: &[T],
        bias: &[T],
        resid: &[T],
        full: &mut [T],
        n: usize,
        k: usize,
        what: &str,
    ) -> Result<(), StepError> {
        let c = self.widths.c;
        match (self.group()?.is_some(), self.sequence_parallel()) {
            (false, _) => linear_forward(out, inp, w, Some(bias), n, k, c),
            (true, false) => {
                linear_forward(out, inp, w, None, n, k, c);
                self.all_reduce(out, what)?;
            }
            (true, true) => {
                linear_forward(full, inp, w, None, n, k, c);
                self.scatter_rows(full, out, what)?;
            }
        }
        let with_bias = self.group.is_some();
        for (row, r) in out.chunks_exact_mut(c).zip(resid.chunks_exact(c)) {
            for ((o, &x), &bb) in row.iter_mut().zip(r).zip(bias) {
                *o = match with_bias {
                    true => *o + bb + x,
                    false => *o + x,
                };
            }
        }
        Ok(())
    }

    /// Forward pass of layer `l` (`p`: its block) from `x` into `out`
    /// (this rank's rows of the residual stream), keeping its internals
    /// in `a`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn layer_forward<T: Real>(
        &self,
        l: usize,
        p: &[T],
        x: &[T],
        out: &mut [T],
        a: &mut LayerActs<T>,
        s: &mut Scratch<T>,
        b: usize,
        t: usize,
    ) -> Result<(), StepError> {
        let Widths { c, attn, mlp, .. } = self.widths;
        let n = b * t;
        let lp = &self.layers[l];
        self.norm_forward(
            &mut a.ln1,
            &mut a.ln1_mean,
            &mut a.ln1_rstd,
            x,
            &p[lp.ln1_w.clone()],
            &p[lp.ln1_b.clone()],
            &mut s.local,
            "layer forward: gathering ln_1's rows",
        )?;
        linear_forward(
            &mut a.qkv,
            &a.ln1,
            &p[lp.qkv_w.clone()],
            Some(&p[lp.qkv_b.clone()]),
            n,
            c,
            3 * attn,
        );
        attention_forward(&mut a.atty, &mut a.att, &a.qkv, self.attn_shape(b, t));
        self.row_split_forward(
            &mut a.resid2,
            &a.atty,
            &p[lp.proj_w.clone()],
            &p[lp.proj_b.clone()],
            x,
            &mut s.full,
            n,
            attn,
            "layer forward: summing attn.c_proj",
        )?;
        self.norm_forward(
            &mut a.ln2,
            &mut a.ln2_mean,
            &mut a.ln2_rstd,
            &a.resid2,
            &p[lp.ln2_w.clone()],
            &p[lp.ln2_b.clone()],
            &mut s.local,
            "layer forward: gathering ln_2's rows",
        )?;
        linear_forward(
            &mut a.fch,
            &a.ln2,
            &p[lp.fc_w.clone()],
            Some(&p[lp.fc_b.clone()]),
            n,
            c,
            mlp,
        );
        gelu_forward(&mut a.fch_gelu, &a.fch);
        self.row_split_forward(
            out,
            &a.fch_gelu,
            &p[lp.fcproj_w.clone()],
            &p[lp.fcproj_b.clone()],
            &a.resid2,
            &mut s.full,
            n,
            mlp,
            "layer forward: summing mlp.c_proj",
        )
    }

    /// The gradient of a row-split product's output for its backward
    /// pass: all rows (`d`, this rank's rows, gathered under sequence
    /// parallelism into `full`).
    fn rows_of<'a, T: Real>(
        &self,
        d: &'a [T],
        full: &'a mut [T],
        what: &str,
    ) -> Result<&'a [T], StepError> {
        match self.sequence_parallel() {
            false => Ok(d),
            true => {
                self.gather_rows(d, full, what)?;
                Ok(full)
            }
        }
    }

    /// A column-split product's input gradient `d` (all rows, this rank's
    /// share of the sum): the whole sum, or this rank's rows of it (in
    /// `local`) under sequence parallelism.
    fn sum_input_grad<'a, T: Real>(
        &self,
        d: &'a mut [T],
        local: &'a mut [T],
        what: &str,
    ) -> Result<&'a [T], StepError> {
        match self.sequence_parallel() {
            false => {
                self.all_reduce(d, what)?;
                Ok(d)
            }
            true => {
                self.scatter_rows(d, local, what)?;
                Ok(local)
            }
        }
    }

    /// Backward of layer `l`: `dx` holds the gradient of the layer's
    /// output on entry and of its input on return (this rank's rows).
    /// With `defer`, its input half only: the four products' weight
    /// gradients are left to [`layer_backward_weights`](Self::layer_backward_weights),
    /// their output gradients kept in `defer`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn layer_backward<T: Real>(
        &self,
        l: usize,
        p: &[T],
        grads: &mut [T],
        dx: &mut [T],
        x: &[T],
        a: &LayerActs<T>,
        g: &mut LayerGrads<T>,
        s: &mut Scratch<T>,
        shape: AttnShape,
        mut defer: Option<&mut LayerDy<T>>,
    ) -> Result<(), StepError> {
        let Widths { c, attn, mlp, .. } = self.widths;
        let n = shape.b * shape.t;
        let lp = &self.layers[l];
        // Under sequence parallelism each rank's LayerNorm gradients are
        // its rows' share: summed over the group at the end.
        let norms = [lp.ln1_w.start..lp.ln1_b.end, lp.ln2_w.start..lp.ln2_b.end];
        let before: Vec<T> = match self.sequence_parallel() {
            true => norms
                .iter()
                .flat_map(|r| grads[r.clone()].to_vec())
                .collect(),
            false => Vec::new(),
        };
        // MLP: out = resid2 + fcproj(gelu(fc(ln2(resid2)))).
        g.dresid2.copy_from_slice(dx);
        g.dgelu.fill(T::ZERO);
        {
            let dout = self.rows_of(dx, &mut s.full, "layer backward: gathering rows")?;
            let (gw, gb) = two_mut(grads, lp.fcproj_w.clone(), lp.fcproj_b.clone());
            linear_backward_or_keep(
                defer.as_mut().map(|d| &mut d.fcproj),
                &mut g.dgelu,
                gw,
                Some(gb),
                dout,
                &a.fch_gelu,
                &p[lp.fcproj_w.clone()],
                n,
                mlp,
                c,
            );
        }
        g.dfch.fill(T::ZERO);
        gelu_backward(&mut g.dfch, &a.fch, &g.dgelu);
        g.dln2.fill(T::ZERO);
        {
            let (gw, gb) = two_mut(grads, lp.fc_w.clone(), lp.fc_b.clone());
            linear_backward_or_keep(
                defer.as_mut().map(|d| &mut d.fc),
                &mut g.dln2,
                gw,
                Some(gb),
                &g.dfch,
                &a.ln2,
                &p[lp.fc_w.clone()],
                n,
                c,
                mlp,
            );
        }
        {
            let dln2 = self.sum_input_grad(
                &mut g.dln2,
                &mut s.local,
                "layer backward: summing ln_2's gradient",
            )?;
            let (gw, gb) = two_mut(grads, lp.ln2_w.clone(), lp.ln2_b.clone());
            layernorm_backward(
                &mut g.dresid2,
                gw,
                gb,
                dln2,
                &a.resid2,
                &p[lp.ln2_w.clone()],
                &a.ln2_mean,
                &a.ln2_rstd,
                c,
            );
        }
        // Attention: resid2 = x + proj(attn(qkv(ln1(x)))).
        dx.copy_from_slice(&g.dresid2);
        g.datty.fill(T::ZERO);
        {
            let dout = self.rows_of(&g.dresid2, &mut s.full, "layer backward: gathering rows")?;
            let (gw, gb) = two_mut(grads, lp.proj_w.clone(), lp.proj_b.clone());
            linear_backward_or_keep(
                defer.as_mut().map(|d| &mut d.proj),
                &mut g.datty,
                gw,
                Some(gb),
                dout,
                &a.atty,
                &p[lp.proj_w.clone()],
                n,
                attn,
                c,
            );
        }
        g.dqkv.fill(T::ZERO);
        attention_backward(&mut g.dqkv, &g.datty, &a.qkv, &a.att, shape);
        g.dln1.fill(T::ZERO);
        {
            let (gw, gb) = two_mut(grads, lp.qkv_w.clone(), lp.qkv_b.clone());
            linear_backward_or_keep(
                defer.as_mut().map(|d| &mut d.qkv),
                &mut g.dln1,
                gw,
                Some(gb),
                &g.dqkv,
                &a.ln1,
                &p[lp.qkv_w.clone()],
                n,
                c,
                3 * attn,
            );
        }
        {
            let dln1 = self.sum_input_grad(
                &mut g.dln1,
                &mut s.local,
                "layer backward: summing ln_1's gradient",
            )?;
            let (gw, gb) = two_mut(grads, lp.ln1_w.clone(), lp.ln1_b.clone());
            layernorm_backward(
                dx,
                gw,
                gb,
                dln1,
                x,
                &p[lp.ln1_w.clone()],
                &a.ln1_mean,
                &a.ln1_rstd,
                c,
            );
        }
        if self.sequence_parallel() {
            self.sum_row_grads(
                grads,
                &norms,
                &before,
                "layer backward: LayerNorm gradients",
            )?;
        }
        Ok(())
    }

    /// The weight half of layer `l`'s split backward pass: the four
    /// products' weight gradients into `grads` (the layer's block) from
    /// the output gradients its input half kept (`dy`) and its saved
    /// inputs (`a`), for `n` rows.
    pub(super) fn layer_backward_weights<T: Real>(
        &self,
        l: usize,
        grads: &mut [T],
        a: &LayerActs<T>,
        dy: &LayerDy<T>,
        n: usize,
    ) {
        let Widths { c, attn, mlp, .. } = self.widths;
        let lp = &self.layers[l];
        let products = [
            (lp.fcproj_w.clone(), &dy.fcproj, &a.fch_gelu, mlp, c),
            (lp.fc_w.clone(), &dy.fc, &a.ln2, c, mlp),
            (lp.proj_w.clone(), &dy.proj, &a.atty, attn, c),
            (lp.qkv_w.clone(), &dy.qkv, &a.ln1, c, 3 * attn),
        ];
        for (w, dout, inp, ic, oc) in products {
            linear_backward_weight(&mut grads[w], dout, inp, n, ic, oc);
        }
    }
}

/// [`linear_backward`], or with `keep` its input half only, `dout` kept
/// there for the weight half.
#[allow(clippy::too_many_arguments)]
fn linear_backward_or_keep<T: Real>(
    keep: Option<&mut Vec<T>>,
    dinp: &mut [T],
    dw: &mut [T],
    dbias: Option<&mut [T]>,
    dout: &[T],
    inp: &[T],
    w: &[T],
    rows: usize,
    ic: usize,
    oc: usize,
) {
    match keep {
        Some(k) => {
            linear_backward_input(dinp, dbias, dout, w, rows, ic, oc);
            k.copy_from_slice(dout);
        }
        None => linear_backward(dinp, dw, dbias, dout, inp, w, rows, ic, oc),
    }
}
