//! One transformer block's forward and backward passes:
//! `resid2 = x + proj(attn(qkv(ln1(x))))`, `out = resid2 +
//! fcproj(gelu(fc(ln2(resid2))))`, at the rank's [`Widths`].

use super::acts::{LayerActs, LayerGrads, Widths};
use super::{two_mut, Gpt};
use crate::cpu::attention::{attention_backward, attention_forward, AttnShape};
use crate::cpu::gelu::{gelu_backward, gelu_forward};
use crate::cpu::matmul::{linear_backward, linear_forward};
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

    /// Forward pass of layer `l` (`p`: its block) from `x` into `out`,
    /// keeping its internals in `a`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn layer_forward<T: Real>(
        &self,
        l: usize,
        p: &[T],
        x: &[T],
        out: &mut [T],
        a: &mut LayerActs<T>,
        b: usize,
        t: usize,
    ) {
        let Widths { c, attn, mlp, .. } = self.widths;
        let n = b * t;
        let lp = &self.layers[l];
        layernorm_forward(
            &mut a.ln1,
            &mut a.ln1_mean,
            &mut a.ln1_rstd,
            x,
            &p[lp.ln1_w.clone()],
            &p[lp.ln1_b.clone()],
            c,
        );
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
        linear_forward(
            &mut a.resid2,
            &a.atty,
            &p[lp.proj_w.clone()],
            Some(&p[lp.proj_b.clone()]),
            n,
            attn,
            c,
        );
        for (r, &xi) in a.resid2.iter_mut().zip(x) {
            *r += xi;
        }
        layernorm_forward(
            &mut a.ln2,
            &mut a.ln2_mean,
            &mut a.ln2_rstd,
            &a.resid2,
            &p[lp.ln2_w.clone()],
            &p[lp.ln2_b.clone()],
            c,
        );
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
        linear_forward(
            out,
            &a.fch_gelu,
            &p[lp.fcproj_w.clone()],
            Some(&p[lp.fcproj_b.clone()]),
            n,
            mlp,
            c,
        );
        for (o, &r) in out.iter_mut().zip(&a.resid2) {
            *o += r;
        }
    }

    /// Backward of layer `l`: `dx` holds the gradient of the layer's
    /// output on entry and of its input on return.
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
        s: AttnShape,
    ) {
        let Widths { c, attn, mlp, .. } = self.widths;
        let n = s.b * s.t;
        let lp = &self.layers[l];
        // MLP: out = resid2 + fcproj(gelu(fc(ln2(resid2)))).
        g.dresid2.copy_from_slice(dx);
        g.dgelu.fill(T::ZERO);
        {
            let (gw, gb) = two_mut(grads, lp.fcproj_w.clone(), lp.fcproj_b.clone());
            linear_backward(
                &mut g.dgelu,
                gw,
                Some(gb),
                dx,
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
            linear_backward(
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
            let (gw, gb) = two_mut(grads, lp.ln2_w.clone(), lp.ln2_b.clone());
            layernorm_backward(
                &mut g.dresid2,
                gw,
                gb,
                &g.dln2,
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
            let (gw, gb) = two_mut(grads, lp.proj_w.clone(), lp.proj_b.clone());
            linear_backward(
                &mut g.datty,
                gw,
                Some(gb),
                &g.dresid2,
                &a.atty,
                &p[lp.proj_w.clone()],
                n,
                attn,
                c,
            );
        }
        g.dqkv.fill(T::ZERO);
        attention_backward(&mut g.dqkv, &g.datty, &a.qkv, &a.att, s);
        g.dln1.fill(T::ZERO);
        {
            let (gw, gb) = two_mut(grads, lp.qkv_w.clone(), lp.qkv_b.clone());
            linear_backward(
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
            let (gw, gb) = two_mut(grads, lp.ln1_w.clone(), lp.ln1_b.clone());
            layernorm_backward(
                dx,
                gw,
                gb,
                &g.dln1,
                x,
                &p[lp.ln1_w.clone()],
                &a.ln1_mean,
                &a.ln1_rstd,
                c,
            );
        }
    }
}
