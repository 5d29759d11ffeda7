//! One transformer block's forward and backward passes on the CPU: the
//! operations of [`crate::block`]'s description at the rank's
//! widths ([`CpuForward`], [`CpuBackward`]), the sequence walked by
//! [`block::forward`] and [`block::backward`].

use super::acts::{LayerActs, LayerDy, LayerGrads, Scratch};
use super::error::StepError;
use super::gpt::Gpt;
use super::split::two_mut;
use crate::block::{self, Act, BlockBackward, BlockForward, LayerRanges, Linear, Norm};
use crate::cpu::attention::{attention_backward, attention_forward, AttnShape};
use crate::cpu::gelu::{gelu_backward, gelu_forward};
use crate::cpu::matmul::{
    linear_backward, linear_backward_input, linear_backward_weight, linear_forward,
};
use crate::cpu::norm::{layernorm_backward, layernorm_forward};
use crate::cpu::Real;

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
    pub(super) fn row_split_forward<T: Real>(
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
        block::forward(&mut CpuForward {
            gpt: self,
            r: &self.layers[l],
            p,
            x,
            out,
            a,
            s,
            b,
            t,
        })
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
        defer: Option<&mut LayerDy<T>>,
    ) -> Result<(), StepError> {
        block::backward(&mut CpuBackward {
            gpt: self,
            r: &self.layers[l],
            p,
            grads,
            dx,
            x,
            a,
            g,
            s,
            shape,
            defer,
            before: Vec::new(),
        })
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
        for (k, input) in block::products_backward() {
            let (w, _) = self.layers[l].linear(k);
            let (ic, oc) = k.widths(&self.widths);
            let inp = &a.t[input.index()];
            linear_backward_weight(&mut grads[w], &dy.dy[k.index()], inp, n, ic, oc);
        }
    }
}

/// The block's tensors (or their gradients) but the one being written:
/// the residual stream's outside the block's buffers (`ext`: the block's
/// input in the forward pass, the gradient of its input or output in the
/// backward pass), the rest in the block's array around a hole.
pub(super) struct Others<'b, T> {
    ext: &'b [T],
    lo: &'b [Vec<T>],
    hi: &'b [Vec<T>],
    hole: usize,
}

impl<'b, T> Others<'b, T> {
    pub(super) fn get(&self, a: Act) -> &'b [T] {
        let i = a.index();
        match (a.inside(), i.cmp(&self.hole)) {
            (false, _) => self.ext,
            (true, std::cmp::Ordering::Less) => &self.lo[i],
            (true, std::cmp::Ordering::Greater) => &self.hi[i - self.hole - 1],
            (true, std::cmp::Ordering::Equal) => {
                unreachable!("an operation of the block reads the tensor it writes ({a:?})")
            }
        }
    }
}

/// The buffer of `o` to write — `ext_out` when it is outside the block's
/// array `t` — and every other tensor to read, `ext_in` for those outside.
pub(super) fn split<'b, T>(
    ext_in: &'b [T],
    ext_out: &'b mut [T],
    t: &'b mut [Vec<T>; 9],
    o: Act,
) -> (&'b mut [T], Others<'b, T>) {
    if !o.inside() {
        let all = Others {
            ext: ext_in,
            lo: &t[..],
            hi: &[],
            hole: t.len(),
        };
        return (ext_out, all);
    }
    let (lo, rest) = t.split_at_mut(o.index());
    let (mid, hi) = rest.split_first_mut().expect("the hole is in the array");
    let others = Others {
        ext: ext_in,
        lo,
        hi,
        hole: o.index(),
    };
    (mid, others)
}

/// The gradients of two different tensors of the block, both to write:
/// `dx` for the block's input's or output's, the rest in `d`.
fn pair<'b, T>(
    dx: &'b mut [T],
    d: &'b mut [Vec<T>; 9],
    a: Act,
    b: Act,
) -> (&'b mut [T], &'b mut [T]) {
    let (i, j) = (a.index(), b.index());
    match (a.inside(), b.inside()) {
        (false, true) => (dx, &mut d[j]),
        (true, false) => (&mut d[i], dx),
        (true, true) if i < j => {
            let (lo, hi) = d.split_at_mut(j);
            (&mut lo[i], &mut hi[0])
        }
        (true, true) if i > j => {
            let (lo, hi) = d.split_at_mut(i);
            (&mut hi[0], &mut lo[j])
        }
        _ => unreachable!("the block relates {a:?} and {b:?}, which share a buffer"),
    }
}

/// Layer `l`'s forward pass on the CPU: the block's tensors in `a`, its
/// input `x` and output `out` (this rank's rows of the residual stream).
struct CpuForward<'a, T> {
    gpt: &'a Gpt,
    r: &'a LayerRanges,
    p: &'a [T],
    x: &'a [T],
    out: &'a mut [T],
    a: &'a mut LayerActs<T>,
    s: &'a mut Scratch<T>,
    b: usize,
    t: usize,
}

impl<T: Real> BlockForward for CpuForward<'_, T> {
    type Error = StepError;

    fn norm_forward(&mut self, norm: Norm, input: Act, out: Act) -> Result<(), StepError> {
        let (w, b) = self.r.norm(norm);
        let i = norm.index();
        let (o, t) = split(self.x, self.out, &mut self.a.t, out);
        self.gpt.norm_forward(
            o,
            &mut self.a.mean[i],
            &mut self.a.rstd[i],
            t.get(input),
            &self.p[w],
            &self.p[b],
            &mut self.s.local,
            match norm {
                Norm::Ln1 => "layer forward: gathering ln_1's rows",
                Norm::Ln2 => "layer forward: gathering ln_2's rows",
            },
        )
    }

    fn column_forward(&mut self, linear: Linear, input: Act, out: Act) -> Result<(), StepError> {
        let (w, b) = self.r.linear(linear);
        let (ic, oc) = linear.widths(&self.gpt.widths);
        let (o, t) = split(self.x, self.out, &mut self.a.t, out);
        let p = self.p;
        linear_forward(o, t.get(input), &p[w], Some(&p[b]), self.b * self.t, ic, oc);
        Ok(())
    }

    fn attention_forward(&mut self, input: Act, out: Act) -> Result<(), StepError> {
        let shape = self.gpt.attn_shape(self.b, self.t);
        let (o, t) = split(self.x, self.out, &mut self.a.t, out);
        attention_forward(o, &mut self.a.att, t.get(input), shape);
        Ok(())
    }

    fn gelu_forward(&mut self, input: Act, out: Act) -> Result<(), StepError> {
        let (o, t) = split(self.x, self.out, &mut self.a.t, out);
        gelu_forward(o, t.get(input));
        Ok(())
    }

    fn row_forward(
        &mut self,
        linear: Linear,
        input: Act,
        residual: Act,
        out: Act,
    ) -> Result<(), StepError> {
        let (w, b) = self.r.linear(linear);
        let (k, _) = linear.widths(&self.gpt.widths);
        let (o, t) = split(self.x, self.out, &mut self.a.t, out);
        self.gpt.row_split_forward(
            o,
            t.get(input),
            &self.p[w],
            &self.p[b],
            t.get(residual),
            &mut self.s.full,
            self.b * self.t,
            k,
            match linear {
                Linear::Proj => "layer forward: summing attn.c_proj",
                _ => "layer forward: summing mlp.c_proj",
            },
        )
    }
}

/// Layer `l`'s backward pass on the CPU: `dx` the gradient of the block's
/// output on entry and of its input on return (this rank's rows), the
/// other tensors' gradients in `g`, the parameters' in `grads` (the
/// layer's block); with `defer`, the products' output gradients kept
/// there instead of their weight gradients.
struct CpuBackward<'a, T> {
    gpt: &'a Gpt,
    r: &'a LayerRanges,
    p: &'a [T],
    grads: &'a mut [T],
    dx: &'a mut [T],
    x: &'a [T],
    a: &'a LayerActs<T>,
    g: &'a mut LayerGrads<T>,
    s: &'a mut Scratch<T>,
    shape: AttnShape,
    defer: Option<&'a mut LayerDy<T>>,
    /// Under sequence parallelism, the LayerNorms' gradients before this
    /// layer's rows added theirs (summed over the group at the end).
    before: Vec<T>,
}

/// A saved tensor of the block: its input `x`, or one of its own in `a`.
fn saved<'a, T>(a: &'a LayerActs<T>, x: &'a [T], t: Act) -> &'a [T] {
    match t.inside() {
        true => &a.t[t.index()],
        false => x,
    }
}

impl<T: Real> BlockBackward for CpuBackward<'_, T> {
    type Error = StepError;

    fn backward_begin(&mut self) -> Result<(), StepError> {
        // Under sequence parallelism each rank's LayerNorm gradients are
        // its rows' share: summed over the group at the end.
        if self.gpt.sequence_parallel() {
            let grads = &*self.grads;
            self.before = self
                .r
                .norms()
                .iter()
                .flat_map(|r| grads[r.clone()].to_vec())
                .collect();
        }
        Ok(())
    }

    fn norm_backward(&mut self, norm: Norm, input: Act, out: Act) -> Result<(), StepError> {
        let (w, b) = self.r.norm(norm);
        let i = norm.index();
        let x = saved(self.a, self.x, input);
        let (din, dout) = pair(self.dx, &mut self.g.d, input, out);
        let what = match norm {
            Norm::Ln1 => "layer backward: summing ln_1's gradient",
            Norm::Ln2 => "layer backward: summing ln_2's gradient",
        };
        let dln = self.gpt.sum_input_grad(dout, &mut self.s.local, what)?;
        let (gw, gb) = two_mut(self.grads, w.clone(), b.clone());
        layernorm_backward(
            din,
            gw,
            gb,
            dln,
            x,
            &self.p[w],
            &self.a.mean[i],
            &self.a.rstd[i],
            self.gpt.widths.c,
        );
        Ok(())
    }

    fn column_backward(&mut self, linear: Linear, input: Act, out: Act) -> Result<(), StepError> {
        let (w, b) = self.r.linear(linear);
        let (ic, oc) = linear.widths(&self.gpt.widths);
        let n = self.shape.b * self.shape.t;
        let inp = saved(self.a, self.x, input);
        let (din, dout) = pair(self.dx, &mut self.g.d, input, out);
        din.fill(T::ZERO);
        let (gw, gb) = two_mut(self.grads, w.clone(), b);
        let keep = self.defer.as_deref_mut().map(|d| &mut d.dy[linear.index()]);
        linear_backward_or_keep(keep, din, gw, Some(gb), dout, inp, &self.p[w], n, ic, oc);
        Ok(())
    }

    fn attention_backward(&mut self, input: Act, out: Act) -> Result<(), StepError> {
        let inp = saved(self.a, self.x, input);
        let (din, dout) = pair(self.dx, &mut self.g.d, input, out);
        din.fill(T::ZERO);
        attention_backward(din, dout, inp, &self.a.att, self.shape);
        Ok(())
    }

    fn gelu_backward(&mut self, input: Act, out: Act) -> Result<(), StepError> {
        let inp = saved(self.a, self.x, input);
        let (din, dout) = pair(self.dx, &mut self.g.d, input, out);
        din.fill(T::ZERO);
        gelu_backward(din, inp, dout);
        Ok(())
    }

    fn row_backward(
        &mut self,
        linear: Linear,
        input: Act,
        residual: Act,
        out: Act,
    ) -> Result<(), StepError> {
        let (w, b) = self.r.linear(linear);
        let (ic, oc) = linear.widths(&self.gpt.widths);
        let n = self.shape.b * self.shape.t;
        // The residual's gradient begins as the output's.
        let (dres, dout) = pair(self.dx, &mut self.g.d, residual, out);
        dres.copy_from_slice(dout);
        let inp = saved(self.a, self.x, input);
        let (din, dout) = pair(self.dx, &mut self.g.d, input, out);
        din.fill(T::ZERO);
        let dout = self
            .gpt
            .rows_of(dout, &mut self.s.full, "layer backward: gathering rows")?;
        let (gw, gb) = two_mut(self.grads, w.clone(), b);
        let keep = self.defer.as_deref_mut().map(|d| &mut d.dy[linear.index()]);
        linear_backward_or_keep(keep, din, gw, Some(gb), dout, inp, &self.p[w], n, ic, oc);
        Ok(())
    }

    fn backward_end(&mut self) -> Result<(), StepError> {
        if self.gpt.sequence_parallel() {
            let norms = self.r.norms();
            let what = "layer backward: LayerNorm gradients";
            self.gpt
                .sum_row_grads(self.grads, &norms, &self.before, what)?;
        }
        Ok(())
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
