//! Every CUDA kernel against its CPU counterpart on random inputs: the
//! largest error relative to the output's scale must stay within a bound
//! per kernel (f32 on both sides; the GPU sums in another order and uses
//! its own `tanhf`/`expf`).

use super::kernels::{token_buckets, Kernels};
use crate::cpu;
use crate::rng::Rng;
use braid_cuda::{Device, DeviceBuffer, Result, Stream};

/// One kernel's comparison.
#[derive(Debug, Clone)]
pub struct KernelCheck {
    /// Kernel name.
    pub name: &'static str,
    /// Shapes used.
    pub shape: String,
    /// Largest |gpu − cpu| / max|cpu|.
    pub error: f64,
    /// Allowed.
    pub bound: f64,
}

impl KernelCheck {
    /// A check of `name` on `shape`: `error` against `bound`.
    pub fn new(name: &'static str, shape: String, error: f64, bound: f64) -> KernelCheck {
        KernelCheck {
            name,
            shape,
            error,
            bound,
        }
    }

    /// Whether the error is within the bound.
    pub fn ok(&self) -> bool {
        self.error <= self.bound
    }
}

fn randn(r: &mut Rng, n: usize, s: f64) -> Vec<f32> {
    (0..n).map(|_| (r.normal() * s) as f32).collect()
}

/// Largest |gpu − cpu| relative to max|cpu|.
/// How many elements of `a` and `b` differ in their bits (the measure of
/// the checks that must match bit for bit).
pub fn bits_differ(a: &[f32], b: &[f32]) -> usize {
    a.iter()
        .zip(b)
        .filter(|(x, y)| x.to_bits() != y.to_bits())
        .count()
}

pub(super) fn rel_err(gpu: &[f32], cpu: &[f32]) -> f64 {
    let scale = cpu
        .iter()
        .fold(0.0f64, |m, &x| m.max(x.abs() as f64))
        .max(1e-30);
    gpu.iter()
        .zip(cpu)
        .map(|(&a, &b)| (a as f64 - b as f64).abs())
        .fold(0.0, f64::max)
        / scale
}

pub(super) fn up(d: &Device, v: &[f32]) -> Result<DeviceBuffer<f32>> {
    DeviceBuffer::from_host(d, v)
}

/// Runs every check on `device`.
pub fn run(device: &Device) -> Result<Vec<KernelCheck>> {
    let k = Kernels::load(device)?;
    let s = Stream::new(device)?;
    let mut r = Rng::new(2026);
    let mut out = Vec::new();
    let (b, t, c, v) = (4usize, 64usize, 768usize, 1000usize);
    let n = b * t;
    let shape = format!("B={b} T={t} C={c} V={v}");

    // Embeddings.
    let tokens: Vec<u32> = (0..n).map(|_| r.below(v) as u32).collect();
    let tokens_i: Vec<i32> = tokens.iter().map(|&x| x as i32).collect();
    let wte = randn(&mut r, v * c, 1.0);
    let wpe = randn(&mut r, t * c, 1.0);
    let mut cpu_out = vec![0.0f32; n * c];
    cpu::embed::embed_forward(&mut cpu_out, &tokens, &wte, &wpe, t, c);
    let dtok = DeviceBuffer::from_host(device, &tokens_i)?;
    let (dwte_in, dwpe_in) = (up(device, &wte)?, up(device, &wpe)?);
    let mut dout_buf = DeviceBuffer::zeros(device, n * c)?;
    k.encoder_forward(&s, &mut dout_buf, &dtok, &dwte_in, &dwpe_in, n, t, c)?;
    s.synchronize()?;
    out.push(KernelCheck {
        name: "encoder_forward",
        shape: shape.clone(),
        error: rel_err(&dout_buf.to_vec()?, &cpu_out),
        bound: 0.0,
    });

    let dout = randn(&mut r, n * c, 1.0);
    let (mut cpu_dwte, mut cpu_dwpe) = (vec![0.0f32; v * c], vec![0.0f32; t * c]);
    cpu::embed::embed_backward(&mut cpu_dwte, &mut cpu_dwpe, &dout, &tokens, t, c);
    let (order, starts) = token_buckets(&tokens, v);
    let (gorder, gstarts) = (
        DeviceBuffer::from_host(device, &order)?,
        DeviceBuffer::from_host(device, &starts)?,
    );
    let (mut gdwte, mut gdwpe) = (
        DeviceBuffer::zeros(device, v * c)?,
        DeviceBuffer::zeros(device, t * c)?,
    );
    let gdout = up(device, &dout)?;
    k.encoder_backward(
        &s, &mut gdwte, &mut gdwpe, &gdout, &gorder, &gstarts, n, t, c, v,
    )?;
    s.synchronize()?;
    let e = rel_err(&gdwte.to_vec()?, &cpu_dwte).max(rel_err(&gdwpe.to_vec()?, &cpu_dwpe));
    out.push(KernelCheck {
        name: "encoder_backward",
        shape: shape.clone(),
        error: e,
        bound: 1e-6,
    });

    // LayerNorm.
    let x = randn(&mut r, n * c, 2.0);
    let w = randn(&mut r, c, 1.0);
    let bb = randn(&mut r, c, 1.0);
    let (mut co, mut cm, mut cr) = (vec![0.0f32; n * c], vec![0.0f32; n], vec![0.0f32; n]);
    cpu::norm::layernorm_forward(&mut co, &mut cm, &mut cr, &x, &w, &bb, c);
    let (gx, gw, gb) = (up(device, &x)?, up(device, &w)?, up(device, &bb)?);
    let (mut go, mut gm, mut gr) = (
        DeviceBuffer::zeros(device, n * c)?,
        DeviceBuffer::zeros(device, n)?,
        DeviceBuffer::zeros(device, n)?,
    );
    k.layernorm_forward(&s, &mut go, &mut gm, &mut gr, &gx, &gw, &gb, n, c)?;
    s.synchronize()?;
    out.push(KernelCheck {
        name: "layernorm_forward",
        shape: shape.clone(),
        error: rel_err(&go.to_vec()?, &co),
        bound: 1e-5,
    });
    let (mut cdi, mut cdw, mut cdb) = (vec![0.0f32; n * c], vec![0.0f32; c], vec![0.0f32; c]);
    cpu::norm::layernorm_backward(&mut cdi, &mut cdw, &mut cdb, &dout, &x, &w, &cm, &cr, c);
    let (mut gdi, mut gdw, mut gdb) = (
        DeviceBuffer::zeros(device, n * c)?,
        DeviceBuffer::zeros(device, c)?,
        DeviceBuffer::zeros(device, c)?,
    );
    k.layernorm_backward(
        &s, &mut gdi, &mut gdw, &mut gdb, &gdout, &gx, &gw, &gm, &gr, n, c,
    )?;
    s.synchronize()?;
    let e = rel_err(&gdi.to_vec()?, &cdi)
        .max(rel_err(&gdw.to_vec()?, &cdw))
        .max(rel_err(&gdb.to_vec()?, &cdb));
    out.push(KernelCheck {
        name: "layernorm_backward",
        shape: shape.clone(),
        error: e,
        bound: 1e-5,
    });

    // GELU and the residual add.
    let h = randn(&mut r, n * 4 * c, 2.0);
    let mut cg = vec![0.0f32; h.len()];
    cpu::gelu::gelu_forward(&mut cg, &h);
    let gh = up(device, &h)?;
    let mut gg = DeviceBuffer::zeros(device, h.len())?;
    k.gelu_forward(&s, &mut gg, &gh)?;
    s.synchronize()?;
    out.push(KernelCheck {
        name: "gelu_forward",
        shape: format!("{} elements", h.len()),
        error: rel_err(&gg.to_vec()?, &cg),
        bound: 1e-6,
    });
    let dh = randn(&mut r, h.len(), 1.0);
    let mut cdh = vec![0.0f32; h.len()];
    cpu::gelu::gelu_backward(&mut cdh, &h, &dh);
    let gdh_in = up(device, &dh)?;
    let mut gdh = DeviceBuffer::zeros(device, h.len())?;
    k.gelu_backward(&s, &mut gdh, &gh, &gdh_in)?;
    s.synchronize()?;
    out.push(KernelCheck {
        name: "gelu_backward",
        shape: format!("{} elements", h.len()),
        error: rel_err(&gdh.to_vec()?, &cdh),
        bound: 1e-6,
    });
    let cres: Vec<f32> = x.iter().zip(&dout).map(|(a, b)| a + b).collect();
    let mut gres = DeviceBuffer::zeros(device, n * c)?;
    k.residual_forward(&s, &mut gres, &gx, &gdout)?;
    s.synchronize()?;
    out.push(KernelCheck {
        name: "residual_forward",
        shape: shape.clone(),
        error: rel_err(&gres.to_vec()?, &cres),
        bound: 0.0,
    });

    // Softmax + cross-entropy (the CPU classifier with an identity head:
    // x = one-hot rows make x · wteᵀ the logits themselves).
    let rows = 64usize;
    let logits = randn(&mut r, rows * v, 3.0);
    let mut targets: Vec<u32> = (0..rows).map(|_| r.below(v) as u32).collect();
    targets[5] = u32::MAX;
    let scale = 1.0 / 63.0;
    let (cpu_loss, cpu_grad) = cpu_softmax_ce(&logits, &targets, rows, v, scale);
    let mut gl = up(device, &logits)?;
    let mut glo = DeviceBuffer::zeros(device, rows)?;
    let gt = DeviceBuffer::from_host(
        device,
        &targets.iter().map(|&x| x as i32).collect::<Vec<_>>(),
    )?;
    k.softmax_cross_entropy(&s, &mut gl, &mut glo, &gt, rows, v, scale)?;
    s.synchronize()?;
    let e = rel_err(&glo.to_vec()?, &cpu_loss).max(rel_err(&gl.to_vec()?, &cpu_grad));
    out.push(KernelCheck {
        name: "softmax_cross_entropy",
        shape: format!("N={rows} V={v}"),
        error: e,
        bound: 1e-5,
    });

    // Matrix products (cuBLAS) in every transpose combination.
    let mut blas = braid_cuda::blas::Blas::new(device)?;
    let (m, nn, kk) = (256usize, 384usize, 192usize);
    let mut e: f64 = 0.0;
    for (a_t, b_t) in [(false, false), (true, false), (false, true), (true, true)] {
        let a = randn(&mut r, m * kk, 1.0);
        let bm = randn(&mut r, kk * nn, 1.0);
        let base = randn(&mut r, m * nn, 1.0);
        let mut cpu_c = base.clone();
        cpu::matmul::gemm_rm(&mut cpu_c, &a, a_t, &bm, b_t, m, nn, kk, true);
        let (ga, gb) = (up(device, &a)?, up(device, &bm)?);
        let mut gc = up(device, &base)?;
        blas.gemm_rm(&s, &mut gc, &ga, a_t, &gb, b_t, m, nn, kk, true)?;
        s.synchronize()?;
        e = e.max(rel_err(&gc.to_vec()?, &cpu_c));
    }
    out.push(KernelCheck {
        name: "gemm (cuBLAS)",
        shape: format!("{m}x{kk} · {kk}x{nn}, all transposes, +="),
        error: e,
        bound: 1e-5,
    });

    // Attention (permutes + batched cuBLAS + causal softmax) forward and
    // backward against the CPU kernel.
    let sh = cpu::attention::AttnShape {
        b: 2,
        t: 64,
        c: 256,
        nh: 4,
    };
    let qkv = randn(&mut r, sh.b * sh.t * 3 * sh.c, 1.0);
    let (mut co, mut catt) = (
        vec![0.0f32; sh.b * sh.t * sh.c],
        vec![0.0f32; sh.b * sh.nh * sh.t * sh.t],
    );
    cpu::attention::attention_forward(&mut co, &mut catt, &qkv, sh);
    let gq = up(device, &qkv)?;
    let mut scratch = super::attention::AttnScratch::new(device, sh)?;
    let mut go = DeviceBuffer::zeros(device, co.len())?;
    super::attention::attention_forward(&k, &mut blas, &s, &mut go, &gq, &mut scratch, sh)?;
    s.synchronize()?;
    let ashape = format!("B={} T={} C={} NH={}", sh.b, sh.t, sh.c, sh.nh);
    out.push(KernelCheck {
        name: "attention_forward",
        shape: ashape.clone(),
        error: rel_err(&go.to_vec()?, &co),
        bound: 1e-5,
    });
    let dy = randn(&mut r, co.len(), 1.0);
    let mut cd = vec![0.0f32; qkv.len()];
    cpu::attention::attention_backward(&mut cd, &dy, &qkv, &catt, sh);
    let gdy = up(device, &dy)?;
    let mut gd = DeviceBuffer::zeros(device, qkv.len())?;
    super::attention::attention_backward(&k, &mut blas, &s, &mut gd, &gdy, &mut scratch, sh)?;
    s.synchronize()?;
    out.push(KernelCheck {
        name: "attention_backward",
        shape: ashape,
        error: rel_err(&gd.to_vec()?, &cd),
        bound: 1e-5,
    });

    // Linear layer with bias: gemm + add_bias, and its backward.
    let (rows, ic, oc) = (256usize, 192usize, 320usize);
    let xin = randn(&mut r, rows * ic, 1.0);
    let wl = randn(&mut r, ic * oc, 0.1);
    let bl = randn(&mut r, oc, 1.0);
    let mut cy = vec![0.0f32; rows * oc];
    cpu::matmul::linear_forward(&mut cy, &xin, &wl, Some(&bl), rows, ic, oc);
    let (gx2, gw2, gb2) = (up(device, &xin)?, up(device, &wl)?, up(device, &bl)?);
    let mut gy = DeviceBuffer::zeros(device, rows * oc)?;
    blas.gemm_rm(&s, &mut gy, &gx2, false, &gw2, false, rows, oc, ic, false)?;
    k.add_bias(&s, &mut gy, &gb2, rows, oc)?;
    s.synchronize()?;
    let lshape = format!("{rows}x{ic} -> {oc}");
    out.push(KernelCheck {
        name: "linear_forward",
        shape: lshape.clone(),
        error: rel_err(&gy.to_vec()?, &cy),
        bound: 1e-5,
    });
    let dyl = randn(&mut r, rows * oc, 1.0);
    let (mut cdx, mut cdw, mut cdb) = (
        vec![0.0f32; rows * ic],
        vec![0.0f32; ic * oc],
        vec![0.0f32; oc],
    );
    cpu::matmul::linear_backward(
        &mut cdx,
        &mut cdw,
        Some(&mut cdb),
        &dyl,
        &xin,
        &wl,
        rows,
        ic,
        oc,
    );
    let gdyl = up(device, &dyl)?;
    let (mut gdx, mut gdw, mut gdb) = (
        DeviceBuffer::zeros(device, rows * ic)?,
        DeviceBuffer::zeros(device, ic * oc)?,
        DeviceBuffer::zeros(device, oc)?,
    );
    blas.gemm_rm(&s, &mut gdx, &gdyl, false, &gw2, true, rows, ic, oc, true)?;
    blas.gemm_rm(&s, &mut gdw, &gx2, true, &gdyl, false, ic, oc, rows, true)?;
    k.bias_backward(&s, &mut gdb, &gdyl, rows, oc)?;
    s.synchronize()?;
    let e = rel_err(&gdx.to_vec()?, &cdx)
        .max(rel_err(&gdw.to_vec()?, &cdw))
        .max(rel_err(&gdb.to_vec()?, &cdb));
    out.push(KernelCheck {
        name: "linear_backward",
        shape: lshape,
        error: e,
        bound: 1e-5,
    });

    // AdamW against the CPU engine's optimizer, per parameter range (decay
    // on matrices and embeddings only).
    let layout = std::sync::Arc::new(crate::layout::Layout::new(
        &crate::config::GptConfig::parse("L1-H2-C64-V100-T16").expect("valid config"),
    ));
    let mut params = crate::params::Params::init_gpt2(layout.clone(), 3);
    let p0 = params.clone();
    let grads = randn(&mut r, layout.len, 1.0);
    let cfg = crate::optim::AdamWConfig::default();
    let mut opt = crate::optim::Optimizer::adamw(&layout, cfg);
    for _ in 0..3 {
        opt.step(&mut params, &grads, 1e-3);
    }
    // The GPU engine's optimizer: one launch over the flat buffer, decay
    // per tensor from the layout (f32 mode: no bf16 copy, no clipping).
    let mk = super::mixed::MixedKernels::load(device)?;
    let segs = super::mixed::AdamSegments::new(device, &layout, cfg.weight_decay)?;
    let mut gp = up(device, &p0.data)?;
    let gg = up(device, &grads)?;
    let (mut gm, mut gv) = (
        DeviceBuffer::zeros(device, layout.len)?,
        DeviceBuffer::zeros(device, layout.len)?,
    );
    for step in 1..=3 {
        let h = super::mixed::AdamStep {
            lr: 1e-3,
            beta1: cfg.beta1,
            beta2: cfg.beta2,
            step,
            eps: cfg.eps,
            grad_scale: 1.0,
        };
        mk.adamw_multi(&s, &mut gp, None, &gg, &mut gm, &mut gv, &segs, h)?;
    }
    s.synchronize()?;
    let e = rel_err(&gp.to_vec()?, &params.data);
    out.push(KernelCheck {
        name: "adamw (one launch, f32)",
        shape: format!("{} parameters, 3 steps", layout.len),
        error: e,
        bound: 1e-6,
    });
    // The whole model: one forward + backward against the CPU model.
    let m = ModelReference::new(&mut r)?;
    let (layout, params, mtok, mtg, closs, cg) = (
        &m.layout, &m.params, &m.tokens, &m.targets, m.loss, &m.grads,
    );
    let (mb, mt) = (ModelReference::B, ModelReference::T);
    let mut gpu = super::model::GpuGpt::new(device, layout.clone(), mb, mt)?;
    let gparams = up(device, &params.data)?;
    let mut gg = DeviceBuffer::zeros(device, layout.len)?;
    let gloss = gpu.forward(&gparams, mtok, mtg, true)?;
    gpu.backward(&gparams, &mut gg)?;
    let ggv = gg.to_vec()?;
    let mut e = ((gloss - closs) as f64).abs() / (closs as f64).abs();
    for spec in &layout.params {
        e = e.max(rel_err(&ggv[spec.range()], &cg[spec.range()]));
    }
    out.push(KernelCheck {
        name: "model fwd+bwd (f32)",
        shape: format!("{}, B={mb}", ModelReference::CONFIG),
        error: e,
        bound: 1e-4,
    });
    Ok(out)
}

/// The CPU model's loss and gradients on a small random batch: what both
/// GPU models are compared with.
pub(super) struct ModelReference {
    pub layout: std::sync::Arc<crate::layout::Layout>,
    pub params: crate::params::Params,
    pub tokens: Vec<u32>,
    pub targets: Vec<u32>,
    pub loss: f32,
    pub grads: Vec<f32>,
}

impl ModelReference {
    pub const CONFIG: &'static str = "L2-H4-C64-V256-T32";
    pub const B: usize = 2;
    pub const T: usize = 32;

    pub fn new(r: &mut Rng) -> Result<ModelReference> {
        let cfg = crate::config::GptConfig::parse(Self::CONFIG).expect("valid config");
        let layout = std::sync::Arc::new(crate::layout::Layout::new(&cfg));
        let mut params = crate::params::Params::init_gpt2(layout.clone(), 11);
        // GPT-2 starts its biases at zero; a trained model's are not, and a
        // bias read in the wrong type is invisible while it is zero (the
        // FP8 products' was, until their second step): every bias drawn
        // small and non-zero.
        for spec in layout.params.iter().filter(|p| p.name.ends_with(".bias")) {
            for x in &mut params.data[spec.range()] {
                *x = (r.normal() * 0.02) as f32;
            }
        }
        let n = Self::B * Self::T;
        let tokens: Vec<u32> = (0..n).map(|_| r.below(256) as u32).collect();
        let mut targets: Vec<u32> = (0..n).map(|_| r.below(256) as u32).collect();
        targets[3] = u32::MAX;
        let model = crate::model::Gpt::new(layout.clone());
        let mut acts = crate::model::Activations::<f32>::new(&layout, Self::B, Self::T, false);
        let mut grads = vec![0.0f32; layout.len];
        let loss = model
            .forward_backward(
                &params.data,
                &mut grads,
                &mut acts,
                &tokens,
                &targets,
                &mut |_, _| {},
            )
            .map_err(|e| braid_cuda::CudaError::Invalid(e.to_string()))?;
        Ok(ModelReference {
            layout,
            params,
            tokens,
            targets,
            loss,
            grads,
        })
    }
}

fn cpu_softmax_ce(
    logits: &[f32],
    targets: &[u32],
    rows: usize,
    v: usize,
    scale: f32,
) -> (Vec<f32>, Vec<f32>) {
    // An identity head: x = I (rows ≤ v), wte = logitsᵀ gives x · wteᵀ = logits.
    let mut wte = vec![0.0f32; v * rows];
    for i in 0..rows {
        for j in 0..v {
            wte[j * rows + i] = logits[i * v + j];
        }
    }
    let mut x = vec![0.0f32; rows * rows];
    for i in 0..rows {
        x[i * rows + i] = 1.0;
    }
    let io = cpu::classifier::ClassifierIo {
        x: &x,
        wte: &wte,
        targets,
        rows,
        c: rows,
        v,
    };
    let mut losses = vec![0.0f32; rows];
    let (mut dx, mut dw) = (vec![0.0f32; rows * rows], vec![0.0f32; v * rows]);
    cpu::classifier::classifier(
        &io,
        &mut losses,
        Some((&mut dx, &mut dw, scale)),
        &mut Vec::new(),
    );
    // dwte = dlogitsᵀ · x = dlogitsᵀ: read the logits' gradient back out.
    let mut grad = vec![0.0f32; rows * v];
    for i in 0..rows {
        for j in 0..v {
            grad[i * v + j] = dw[j * rows + i];
        }
    }
    (losses, grad)
}
