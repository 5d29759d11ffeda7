//! The training loop on one GPU in f32 (`braid train --device cuda`): the
//! CPU trainer's batches, schedule, clipping and AdamW, with parameters,
//! gradients and optimizer state in device memory.

use super::model::GpuGpt;
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

/// Trains `params` on `device`; the trained values are copied back into
/// `params` at the end.
pub fn train_gpu(
    device: &Device,
    params: &mut Params,
    data: &Dataset,
    o: &TrainOptions,
    progress: &mut dyn FnMut(&StepReport),
) -> Result<Vec<StepReport>, String> {
    let layout = params.layout.clone();
    let cfg = layout.config;
    if o.optimizer != OptimizerKind::AdamW {
        return Err("--device cuda trains with adamw only (so far)".into());
    }
    o.check_fits(&cfg, data)?;
    let mut model = GpuGpt::new(device, layout.clone(), o.batch, o.seq).map_err(e)?;
    let mut p = DeviceBuffer::from_host(device, &params.data).map_err(e)?;
    let mut g = DeviceBuffer::<f32>::zeros(device, layout.len).map_err(e)?;
    let mut m = DeviceBuffer::<f32>::zeros(device, layout.len).map_err(e)?;
    let mut v = DeviceBuffer::<f32>::zeros(device, layout.len).map_err(e)?;
    let adam = AdamWConfig {
        weight_decay: o.weight_decay,
        ..Default::default()
    };
    let sched = o.schedule();
    let (mut rng, mut eval_rng) = o.samplers();
    let n = o.batch * o.seq;
    let (mut tokens, mut targets) = (vec![0u32; n], vec![0u32; n]);
    let start = Instant::now();
    let mut reports = Vec::with_capacity(o.steps);
    for step in 0..o.steps {
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
            grad_norm = model
                .kernels()
                .global_norm(model.stream(), &g, device)
                .map_err(e)?;
            if o.grad_clip > 0.0 && grad_norm > o.grad_clip {
                let s = (o.grad_clip / (grad_norm + 1e-6)) as f32;
                model
                    .kernels()
                    .scale(model.stream(), &mut g, s)
                    .map_err(e)?;
            }
            for spec in &layout.params {
                let r = spec.range();
                let wd = if spec.kind.decays() {
                    adam.weight_decay
                } else {
                    0.0
                };
                model
                    .kernels()
                    .adamw(
                        model.stream(),
                        &mut p.view_mut(r.clone()),
                        &g.view(r.clone()),
                        &mut m.view_mut(r.clone()),
                        &mut v.view_mut(r),
                        lr,
                        adam.beta1,
                        adam.beta2,
                        step as i32 + 1,
                        adam.eps,
                        wd,
                    )
                    .map_err(e)?;
            }
        }
        model.stream().synchronize().map_err(e)?;
        let dt = t0.elapsed().as_secs_f64();
        let eval_loss =
            if o.eval_every > 0 && ((step + 1) % o.eval_every == 0 || step + 1 == o.steps) {
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
    p.copy_to_host(&mut params.data).map_err(e)?;
    Ok(reports)
}
