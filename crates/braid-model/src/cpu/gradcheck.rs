//! Every kernel's backward against central finite differences in f64.
//! The scalar checked is `L = Σ out · g` for fixed random `g`, so the
//! analytic gradient is the backward pass fed `dout = g`.

use super::attention::{attention_backward, attention_forward, AttnShape};
use super::classifier::{classifier, ClassifierIo};
use super::embed::{embed_backward, embed_forward};
use super::gelu::{gelu_backward, gelu_forward};
use super::matmul::{linear_backward, linear_forward};
use super::norm::{layernorm_backward, layernorm_forward};
use crate::rng::Rng;

/// Relative error allowed between analytic and numerical gradients.
const TOL: f64 = 1e-6;
const EPS: f64 = 1e-6;

fn randn(rng: &mut Rng, n: usize, s: f64) -> Vec<f64> {
    (0..n).map(|_| rng.normal() * s).collect()
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Compares `analytic` with the numerical gradient of `loss` with respect
/// to `inputs[which]` at every element.
fn compare(
    name: &str,
    inputs: &mut [Vec<f64>],
    which: usize,
    analytic: &[f64],
    loss: &dyn Fn(&[Vec<f64>]) -> f64,
) {
    let mut worst: f64 = 0.0;
    for i in 0..inputs[which].len() {
        let x0 = inputs[which][i];
        inputs[which][i] = x0 + EPS;
        let up = loss(inputs);
        inputs[which][i] = x0 - EPS;
        let down = loss(inputs);
        inputs[which][i] = x0;
        let num = (up - down) / (2.0 * EPS);
        let err = (num - analytic[i]).abs() / (num.abs() + analytic[i].abs()).max(1e-3);
        worst = worst.max(err);
    }
    assert!(
        worst < TOL,
        "{name}: gradient {which} off by relative {worst:e}"
    );
}

#[test]
fn linear_backward_matches_finite_differences() {
    let (rows, ic, oc) = (5, 7, 3);
    let mut r = Rng::new(1);
    let mut inputs = vec![
        randn(&mut r, rows * ic, 1.0),
        randn(&mut r, ic * oc, 1.0),
        randn(&mut r, oc, 1.0),
    ];
    let g = randn(&mut r, rows * oc, 1.0);
    let loss = |x: &[Vec<f64>]| {
        let mut out = vec![0.0; rows * oc];
        linear_forward(&mut out, &x[0], &x[1], Some(&x[2]), rows, ic, oc);
        dot(&out, &g)
    };
    let (mut di, mut dw, mut db) = (vec![0.0; rows * ic], vec![0.0; ic * oc], vec![0.0; oc]);
    linear_backward(
        &mut di,
        &mut dw,
        Some(&mut db),
        &g,
        &inputs[0],
        &inputs[1],
        rows,
        ic,
        oc,
    );
    compare("linear dinp", &mut inputs, 0, &di, &loss);
    compare("linear dw", &mut inputs, 1, &dw, &loss);
    compare("linear dbias", &mut inputs, 2, &db, &loss);
}

#[test]
fn linear_handles_products_big_enough_to_run_in_parallel() {
    let (rows, ic, oc) = (96, 80, 72);
    let mut r = Rng::new(9);
    let x = randn(&mut r, rows * ic, 1.0);
    let w = randn(&mut r, ic * oc, 1.0);
    let mut out = vec![0.0; rows * oc];
    linear_forward(&mut out, &x, &w, None, rows, ic, oc);
    for (i, j) in [(0, 0), (95, 71), (40, 13)] {
        let want: f64 = (0..ic).map(|k| x[i * ic + k] * w[k * oc + j]).sum();
        assert!((out[i * oc + j] - want).abs() < 1e-9);
    }
}

#[test]
fn layernorm_backward_matches_finite_differences() {
    let (rows, c) = (4, 6);
    let mut r = Rng::new(2);
    let mut inputs = vec![
        randn(&mut r, rows * c, 1.0),
        randn(&mut r, c, 1.0),
        randn(&mut r, c, 1.0),
    ];
    let g = randn(&mut r, rows * c, 1.0);
    let loss = |x: &[Vec<f64>]| {
        let (mut out, mut m, mut s) = (vec![0.0; rows * c], vec![0.0; rows], vec![0.0; rows]);
        layernorm_forward(&mut out, &mut m, &mut s, &x[0], &x[1], &x[2], c);
        dot(&out, &g)
    };
    let (mut out, mut m, mut s) = (vec![0.0; rows * c], vec![0.0; rows], vec![0.0; rows]);
    layernorm_forward(
        &mut out, &mut m, &mut s, &inputs[0], &inputs[1], &inputs[2], c,
    );
    let (mut di, mut dw, mut db) = (vec![0.0; rows * c], vec![0.0; c], vec![0.0; c]);
    layernorm_backward(
        &mut di, &mut dw, &mut db, &g, &inputs[0], &inputs[1], &m, &s, c,
    );
    compare("layernorm dinp", &mut inputs, 0, &di, &loss);
    compare("layernorm dw", &mut inputs, 1, &dw, &loss);
    compare("layernorm db", &mut inputs, 2, &db, &loss);
}

#[test]
fn gelu_backward_matches_finite_differences() {
    let mut r = Rng::new(3);
    let mut inputs = vec![randn(&mut r, 50, 2.0)];
    let g = randn(&mut r, 50, 1.0);
    let loss = |x: &[Vec<f64>]| {
        let mut out = vec![0.0; 50];
        gelu_forward(&mut out, &x[0]);
        dot(&out, &g)
    };
    let mut d = vec![0.0; 50];
    gelu_backward(&mut d, &inputs[0], &g);
    compare("gelu", &mut inputs, 0, &d, &loss);
}

#[test]
fn attention_backward_matches_finite_differences() {
    let s = AttnShape {
        b: 2,
        t: 5,
        c: 8,
        nh: 2,
    };
    let mut r = Rng::new(4);
    let mut inputs = vec![randn(&mut r, s.b * s.t * 3 * s.c, 1.0)];
    let g = randn(&mut r, s.b * s.t * s.c, 1.0);
    let loss = |x: &[Vec<f64>]| {
        let mut out = vec![0.0; s.b * s.t * s.c];
        let mut att = vec![0.0; s.b * s.nh * s.t * s.t];
        attention_forward(&mut out, &mut att, &x[0], s);
        dot(&out, &g)
    };
    let mut out = vec![0.0; s.b * s.t * s.c];
    let mut att = vec![0.0; s.b * s.nh * s.t * s.t];
    attention_forward(&mut out, &mut att, &inputs[0], s);
    let mut d = vec![0.0; inputs[0].len()];
    attention_backward(&mut d, &g, &inputs[0], &att, s);
    compare("attention dqkv", &mut inputs, 0, &d, &loss);
    // Causality: the first position's output depends on nothing later.
    let mut shifted = inputs[0].clone();
    let last = (s.t - 1) * 3 * s.c;
    shifted[last] += 1.0;
    let mut out2 = vec![0.0; s.b * s.t * s.c];
    attention_forward(&mut out2, &mut att, &shifted, s);
    assert_eq!(out[..s.c], out2[..s.c]);
}

#[test]
fn classifier_gradients_match_finite_differences_and_skip_masked_rows() {
    let (rows, c, v) = (6, 5, 11);
    let mut r = Rng::new(5);
    let mut inputs = vec![randn(&mut r, rows * c, 1.0), randn(&mut r, v * c, 1.0)];
    let targets: Vec<u32> = vec![3, 0, 10, u32::MAX, 7, 7];
    let scale = 1.0 / 5.0;
    let loss = |x: &[Vec<f64>]| {
        let io = ClassifierIo {
            x: &x[0],
            wte: &x[1],
            targets: &targets,
            rows,
            c,
            v,
        };
        let mut l = vec![0.0; rows];
        classifier(&io, &mut l, None, &mut Vec::new());
        l.iter().sum::<f64>() * scale
    };
    let (mut dx, mut dw) = (vec![0.0; rows * c], vec![0.0; v * c]);
    let mut l = vec![0.0; rows];
    let io = ClassifierIo {
        x: &inputs[0],
        wte: &inputs[1],
        targets: &targets,
        rows,
        c,
        v,
    };
    classifier(
        &io,
        &mut l,
        Some((&mut dx, &mut dw, scale)),
        &mut Vec::new(),
    );
    assert_eq!(l[3], 0.0);
    assert!(dx[3 * c..4 * c].iter().all(|&g| g == 0.0));
    compare("classifier dx", &mut inputs, 0, &dx, &loss);
    compare("classifier dwte", &mut inputs, 1, &dw, &loss);
}

#[test]
fn embedding_backward_matches_finite_differences() {
    let (t, c, v) = (3, 4, 5);
    let tokens = vec![1u32, 4, 1, 0, 2, 1];
    let mut r = Rng::new(6);
    let mut inputs = vec![randn(&mut r, v * c, 1.0), randn(&mut r, t * c, 1.0)];
    let g = randn(&mut r, tokens.len() * c, 1.0);
    let loss = |x: &[Vec<f64>]| {
        let mut out = vec![0.0; tokens.len() * c];
        embed_forward(&mut out, &tokens, &x[0], &x[1], t, c);
        dot(&out, &g)
    };
    let (mut dwte, mut dwpe) = (vec![0.0; v * c], vec![0.0; t * c]);
    embed_backward(&mut dwte, &mut dwpe, &g, &tokens, t, c);
    compare("embedding dwte", &mut inputs, 0, &dwte, &loss);
    compare("embedding dwpe", &mut inputs, 1, &dwpe, &loss);
}
