//! The training loop on one GPU (`braid train --device cuda`): the CPU
//! trainer's batches, schedule, clipping and AdamW, with parameters,
//! gradients and optimizer state in device memory; f32 throughout
//! ([`GpuGpt`]) or mixed precision ([`GpuGptMixed`]: bf16 products and
//! activations, f32 master weights, gradients and optimizer state).

use super::mixed::{AdamSegments, AdamStep, MixedKernels};
use super::model::GpuGpt;
use super::model_mixed::GpuGptMixed;
use crate::data::Dataset;
use crate::optim::AdamWConfig;
use crate::params::Params;
use crate::trainer::{OptimizerKind, StepReport, TrainOptions};
use braid_cuda::memory::zero_async;
use braid_cuda::{Device, DeviceBuffer};
use std::time::Instant;

fn e(x: impl std::fmt::Display) -> String {
    x.to_string()
}

/// Arithmetic of the GPU engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precision {
    /// f32 everywhere (matches the CPU engine).
    F32,
    /// bf16 products and activations, f32 master weights and state.
    Bf16,
}

impl Precision {
    /// `f32` or `bf16`.
    pub fn parse(s: &str) -> Result<Precision, String> {
        match s {
            "f32" | "fp32" => Ok(Precision::F32),
            "bf16" | "mixed" => Ok(Precision::Bf16),
            other => Err(format!("--precision {other:?}: expected f32 or bf16")),
        }
    }

    /// The name used on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
        }
    }
}

/// Either model form.
enum Engine {
    F32(Box<GpuGpt>),
    Mixed(Box<GpuGptMixed>, DeviceBuffer<half::bf16>),
}

impl Engine {
    fn stream(&self) -> &braid_cuda::Stream {
        match self {
            Engine::F32(m) => m.stream(),
            Engine::Mixed(m, _) => m.stream(),
        }
    }

    fn kernels(&self) -> &super::Kernels {
        match self {
            Engine::F32(m) => m.kernels(),
            Engine::Mixed(m, _) => m.kernels(),
        }
    }

    fn forward(
        &mut self,
        p: &DeviceBuffer<f32>,
        x: &[u32],
        y: &[u32],
        grad: bool,
    ) -> braid_cuda::Result<f32> {
        match self {
            Engine::F32(m) => m.forward(p, x, y, grad),
            Engine::Mixed(m, pb) => m.forward(p, pb, x, y, grad),
        }
    }

    fn backward(
        &mut self,
        p: &DeviceBuffer<f32>,
        g: &mut DeviceBuffer<f32>,
    ) -> braid_cuda::Result<()> {
        match self {
            Engine::F32(m) => m.backward(p, g),
            Engine::Mixed(m, pb) => m.backward(p, pb, g),
        }
    }
}

/// Trains `params` on `device` in `precision`; the trained (f32 master)
/// values are copied back into `params` at the end.
pub fn train_gpu(
    device: &Device,
    params: &mut Params,
    data: &Dataset,
    o: &TrainOptions,
    precision: Precision,
    progress: &mut dyn FnMut(&StepReport),
) -> Result<Vec<StepReport>, String> {
    let layout = params.layout.clone();
    let cfg = layout.config;
    if o.optimizer != OptimizerKind::AdamW {
        return Err("--device cuda trains with adamw only (so far)".into());
    }
    o.check_fits(&cfg, data)?;
    let mut p = DeviceBuffer::from_host(device, &params.data).map_err(e)?;
    let mk = MixedKernels::load(device).map_err(e)?;
    let mut model = match precision {
        Precision::F32 => Engine::F32(Box::new(
            GpuGpt::new(device, layout.clone(), o.batch, o.seq).map_err(e)?,
        )),
        Precision::Bf16 => {
            let m = GpuGptMixed::new(device, layout.clone(), o.batch, o.seq).map_err(e)?;
            let mut pb = DeviceBuffer::zeros(device, layout.len).map_err(e)?;
            mk.to_bf16(m.stream(), &mut pb, &p).map_err(e)?;
            Engine::Mixed(Box::new(m), pb)
        }
    };
    let mut g = DeviceBuffer::<f32>::zeros(device, layout.len).map_err(e)?;
    let mut m = DeviceBuffer::<f32>::zeros(device, layout.len).map_err(e)?;
    let mut v = DeviceBuffer::<f32>::zeros(device, layout.len).map_err(e)?;
    let adam = AdamWConfig {
        weight_decay: o.weight_decay,
        ..Default::default()
    };
    let segments = AdamSegments::new(device, &layout, adam.weight_decay).map_err(e)?;
    let sched = o.schedule();
    let (mut rng, mut eval_rng) = o.samplers();
    let n = o.batch * o.seq;
    let (mut tokens, mut targets) = (vec![0u32; n], vec![0u32; n]);
    let start = Instant::now();
    let mut reports = Vec::with_capacity(o.steps);
    for step in 0..o.steps {
        if step == 5.min(o.steps / 2) {
            if let Engine::Mixed(m, _) = &mut model {
                m.profile_reset();
            }
        }
        let t0 = Instant::now();
        data.batch(&mut rng, o.batch, o.seq, false, &mut tokens, &mut targets)?;
        zero_async(&mut g, model.stream()).map_err(e)?;
        let loss = model.forward(&p, &tokens, &targets, true).map_err(e)?;
        if !loss.is_finite() {
            return Err(format!("step {step}: the loss is {loss} (lower --lr?)"));
        }
        let lr = sched.lr(step);
        let mut grad_norm = 0.0;
        model.backward(&p, &mut g).map_err(e)?;
        if o.update {
            grad_norm = model.kernels().global_norm(model.stream(), &g).map_err(e)?;
            let grad_scale = if o.grad_clip > 0.0 && grad_norm > o.grad_clip {
                (o.grad_clip / (grad_norm + 1e-6)) as f32
            } else {
                1.0
            };
            let h = AdamStep {
                lr,
                beta1: adam.beta1,
                beta2: adam.beta2,
                step: step as i32 + 1,
                eps: adam.eps,
                grad_scale,
            };
            match &mut model {
                Engine::Mixed(mm, pb) => mk.adamw_multi(
                    mm.stream(),
                    &mut p,
                    Some(pb),
                    &g,
                    &mut m,
                    &mut v,
                    &segments,
                    h,
                ),
                Engine::F32(mm) => {
                    mk.adamw_multi(mm.stream(), &mut p, None, &g, &mut m, &mut v, &segments, h)
                }
            }
            .map_err(e)?;
        }
        model.stream().synchronize().map_err(e)?;
        let dt = t0.elapsed().as_secs_f64();
        let eval_loss = if o.evaluates_after(step) {
            let (mut x, mut y) = (vec![0u32; n], vec![0u32; n]);
            let mut sum = 0.0f64;
            for _ in 0..o.eval_batches.max(1) {
                data.batch(&mut eval_rng, o.batch, o.seq, true, &mut x, &mut y)?;
                sum += model.forward(&p, &x, &y, false).map_err(e)? as f64;
            }
            Some((sum / o.eval_batches.max(1) as f64) as f32)
        } else {
            None
        };
        let r = StepReport {
            step,
            loss,
            grad_norm,
            lr,
            tokens_per_s: n as f64 / dt,
            eval_loss,
            elapsed: start.elapsed().as_secs_f64(),
        };
        progress(&r);
        reports.push(r);
    }
    if let Engine::Mixed(m, _) = &model {
        if let Some(report) = m.profile_report() {
            println!("{report}");
        }
    }
    p.copy_to_host(&mut params.data).map_err(e)?;
    Ok(reports)
}
