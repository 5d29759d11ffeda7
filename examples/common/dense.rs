//! A tiny dense network (linear layers with ReLU between them, softmax
//! cross-entropy on top, Adam) written for the examples, with nothing from
//! braid's GPT engine: it only implements braid-train's `Engine` — flat
//! parameters, flat gradients, and a backward pass in units (one per layer,
//! the last layer first) that say which gradients they finish — and
//! `EngineInfo` with nothing to add. That is all data parallelism needs.

use braid_model::cpu::matmul::gemm_rm;
use braid_model::rng::Rng;
use braid_train::space::{Host, HostWindow};
use braid_train::{Engine, EngineInfo, Unit, UpdateStep};
use std::ops::Range;

/// Inputs (`rows × inputs`, row-major) and class labels.
pub struct Batch {
    pub x: Vec<f32>,
    pub labels: Vec<usize>,
}

/// One linear layer's place in the flat buffer: weights `[inp, out]`
/// (row-major, `x · W`), then the bias.
struct Layer {
    inp: usize,
    out: usize,
    w: Range<usize>,
    b: Range<usize>,
}

/// The network and its Adam state.
pub struct Dense {
    layers: Vec<Layer>,
    params: Vec<f32>,
    m: Vec<f32>,
    v: Vec<f32>,
    /// Each layer's input from the last forward pass (activations after
    /// ReLU), then the gradient of the loss with respect to the logits.
    inputs: Vec<Vec<f32>>,
    dlogits: Vec<f32>,
    rows: usize,
}

impl Dense {
    /// Layers `sizes[0] → sizes[1] → …`, weights N(0, 1/fan-in) from
    /// `seed`, biases 0, trained by Adam.
    pub fn new(sizes: &[usize], seed: u64) -> Dense {
        let mut layers = Vec::new();
        let mut at = 0;
        for w in sizes.windows(2) {
            let (inp, out) = (w[0], w[1]);
            layers.push(Layer {
                inp,
                out,
                w: at..at + inp * out,
                b: at + inp * out..at + inp * out + out,
            });
            at += inp * out + out;
        }
        let mut rng = Rng::new(seed);
        let mut params = vec![0.0f32; at];
        for l in &layers {
            let std = (1.0 / l.inp as f64).sqrt();
            for p in &mut params[l.w.clone()] {
                *p = (rng.normal() * std) as f32;
            }
        }
        Dense {
            layers,
            m: vec![0.0; at],
            v: vec![0.0; at],
            params,
            inputs: Vec::new(),
            dlogits: Vec::new(),
            rows: 0,
        }
    }

    /// Number of parameters.
    pub fn parameters(&self) -> usize {
        self.params.len()
    }
}

impl Engine for Dense {
    type Space = Host;
    type Batch = Batch;

    fn describe(&self) -> String {
        let sizes: Vec<String> = self
            .layers
            .iter()
            .map(|l| format!("{}x{}", l.inp, l.out))
            .collect();
        format!("dense {}", sizes.join(" "))
    }

    fn params(&self) -> &Vec<f32> {
        &self.params
    }

    fn params_mut(&mut self) -> &mut Vec<f32> {
        &mut self.params
    }

    fn params_changed(&mut self) -> Result<(), String> {
        Ok(())
    }

    fn new_grads(&self) -> Result<Vec<f32>, String> {
        Ok(vec![0.0; self.params.len()])
    }

    fn zero_grads(&mut self, grads: &mut Vec<f32>) -> Result<(), String> {
        grads.fill(0.0);
        Ok(())
    }

    fn units(&self) -> Vec<Unit> {
        (0..self.layers.len())
            .rev()
            .map(|i| Unit {
                name: format!("layer {i}"),
                finalizes: self.layers[i].w.start..self.layers[i].b.end,
            })
            .collect()
    }

    fn forward(&mut self, batch: &Batch, grad: bool) -> Result<f32, String> {
        let rows = batch.labels.len();
        let first = &self.layers[0];
        if batch.x.len() != rows * first.inp {
            return Err(format!(
                "{} inputs for {rows} rows of {}",
                batch.x.len(),
                first.inp
            ));
        }
        self.rows = rows;
        self.inputs.clear();
        let mut h = batch.x.clone();
        let last = self.layers.len() - 1;
        for (i, l) in self.layers.iter().enumerate() {
            let mut z = vec![0.0f32; rows * l.out];
            gemm_rm(
                &mut z,
                &h,
                false,
                &self.params[l.w.clone()],
                false,
                rows,
                l.out,
                l.inp,
                false,
            );
            let b = &self.params[l.b.clone()];
            for row in z.chunks_mut(l.out) {
                for (x, bias) in row.iter_mut().zip(b) {
                    *x += bias;
                }
            }
            if i < last {
                z.iter_mut().for_each(|x| *x = x.max(0.0));
            }
            self.inputs.push(std::mem::replace(&mut h, z));
        }
        // h holds the logits: mean softmax cross-entropy and its gradient.
        let classes = self.layers[last].out;
        let mut loss = 0.0f64;
        self.dlogits = vec![0.0; rows * classes];
        for (r, &label) in batch.labels.iter().enumerate() {
            if label >= classes {
                return Err(format!("label {label} of {classes} classes"));
            }
            let z = &h[r * classes..(r + 1) * classes];
            let max = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let sum: f32 = z.iter().map(|x| (x - max).exp()).sum();
            loss += (sum.ln() + max - z[label]) as f64;
            if grad {
                let d = &mut self.dlogits[r * classes..(r + 1) * classes];
                for (j, dj) in d.iter_mut().enumerate() {
                    let p = (z[j] - max).exp() / sum;
                    *dj = (p - if j == label { 1.0 } else { 0.0 }) / rows as f32;
                }
            }
        }
        Ok((loss / rows as f64) as f32)
    }

    fn backward_unit(&mut self, unit: usize, grads: &mut HostWindow<'_>) -> Result<(), String> {
        let i = self.layers.len() - 1 - unit;
        let l = &self.layers[i];
        let rows = self.rows;
        let x = &self.inputs[i];
        // dW += xᵀ · dz ; db += Σ dz.
        gemm_rm(
            grads.slice_mut(l.w.clone())?,
            x,
            true,
            &self.dlogits,
            false,
            l.inp,
            l.out,
            rows,
            true,
        );
        let db = grads.slice_mut(l.b.clone())?;
        for row in self.dlogits.chunks(l.out) {
            for (g, d) in db.iter_mut().zip(row) {
                *g += d;
            }
        }
        if i > 0 {
            // dx = dz · Wᵀ, through the ReLU that made x.
            let mut dx = vec![0.0f32; rows * l.inp];
            gemm_rm(
                &mut dx,
                &self.dlogits,
                false,
                &self.params[l.w.clone()],
                true,
                rows,
                l.inp,
                l.out,
                false,
            );
            for (d, &xv) in dx.iter_mut().zip(x.iter()) {
                if xv <= 0.0 {
                    *d = 0.0;
                }
            }
            self.dlogits = dx;
        }
        Ok(())
    }

    fn grad_sq_norm(&mut self, grads: &Vec<f32>) -> Result<f64, String> {
        Ok(grads.iter().map(|&g| (g as f64) * (g as f64)).sum())
    }

    fn update(&mut self, grads: &Vec<f32>, s: UpdateStep) -> Result<(), String> {
        let (b1, b2, eps) = (0.9f32, 0.999f32, 1e-8f32);
        let c1 = 1.0 - b1.powi(s.step as i32);
        let c2 = 1.0 - b2.powi(s.step as i32);
        let state = self.params.iter_mut().zip(&mut self.m).zip(&mut self.v);
        for (((p, m), v), &g) in state.zip(grads) {
            let g = g * s.grad_scale;
            *m = b1 * *m + (1.0 - b1) * g;
            *v = b2 * *v + (1.0 - b2) * g * g;
            *p -= s.lr * (*m / c1) / ((*v / c2).sqrt() + eps);
        }
        Ok(())
    }

    fn synchronize(&mut self) -> Result<(), String> {
        Ok(())
    }
}

/// Nothing to add: no matrices singled out (no low-rank compression),
/// the parameters in its own memory, no state account, no profile.
impl EngineInfo for Dense {}

/// Fake data the network can learn: `n` standard-normal inputs of `dim`
/// values, labelled by a fixed random linear "teacher" (the same on every
/// rank for the same seed).
pub fn teacher_data(n: usize, dim: usize, classes: usize, seed: u64) -> (Vec<f32>, Vec<usize>) {
    let mut rng = Rng::new(seed);
    let x: Vec<f32> = (0..n * dim).map(|_| rng.normal() as f32).collect();
    let t: Vec<f32> = (0..dim * classes).map(|_| rng.normal() as f32).collect();
    let labels = (0..n)
        .map(|r| {
            let row = &x[r * dim..(r + 1) * dim];
            (0..classes)
                .map(|c| (0..dim).map(|k| row[k] * t[k * classes + c]).sum::<f32>())
                .enumerate()
                .fold((0, f32::NEG_INFINITY), |best, (c, s)| {
                    if s > best.1 {
                        (c, s)
                    } else {
                        best
                    }
                })
                .0
        })
        .collect();
    (x, labels)
}
