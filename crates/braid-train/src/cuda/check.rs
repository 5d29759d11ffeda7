//! The hook kernels against their CPU counterparts on random inputs
//! (`braid kernels --check` runs these with the engine's checks): the
//! half-precision casts must round exactly as the `half` crate does, the
//! element-wise passes must match exactly, and the orthogonalisation must
//! match the CPU's Gram-Schmidt to float precision.

use super::hooks::HookKernels;
use crate::collective::powersgd::orthogonalize_host;
use braid_cuda::{Device, DeviceBuffer, Result, Stream};
use braid_model::cuda::check::{bits_differ, KernelCheck};
use braid_model::rng::Rng;
use half::{bf16, f16};

fn max_abs(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() as f64)
        .fold(0.0, f64::max)
}

fn check(name: &'static str, shape: String, error: f64, bound: f64) -> KernelCheck {
    KernelCheck::new(name, shape, error, bound)
}

/// Runs every hook-kernel check on `device`.
pub fn run(device: &Device) -> Result<Vec<KernelCheck>> {
    let k = HookKernels::load(device)?;
    let s = Stream::new(device)?;
    let mut r = Rng::new(31);
    let n = 100_003;
    let x: Vec<f32> = (0..n).map(|_| (r.normal() * 3.0) as f32).collect();
    let gx = DeviceBuffer::from_host(device, &x)?;
    let shape = format!("n={n}");
    let mut out = Vec::new();

    // bf16 and fp16 round trips with scales, element for element.
    let mut hb = DeviceBuffer::<bf16>::zeros(device, n)?;
    k.pack(&s, &mut hb, &gx, 0.5)?;
    let mut back = DeviceBuffer::<f32>::zeros(device, n)?;
    k.unpack(&s, &mut back, &hb, 4.0)?;
    s.synchronize()?;
    let want: Vec<f32> = x
        .iter()
        .map(|&v| bf16::from_f32(v * 0.5).to_f32() * 4.0)
        .collect();
    out.push(check(
        "hook pack/unpack bf16",
        shape.clone(),
        max_abs(&back.to_vec()?, &want),
        0.0,
    ));
    let mut hh = DeviceBuffer::<f16>::zeros(device, n)?;
    k.pack(&s, &mut hh, &gx, 0.25)?;
    k.unpack(&s, &mut back, &hh, 2.0)?;
    s.synchronize()?;
    let want: Vec<f32> = x
        .iter()
        .map(|&v| f16::from_f32(v * 0.25).to_f32() * 2.0)
        .collect();
    out.push(check(
        "hook pack/unpack fp16",
        shape.clone(),
        max_abs(&back.to_vec()?, &want),
        0.0,
    ));

    // x += y; e = before - x * scale.
    let y: Vec<f32> = (0..n).map(|_| r.normal() as f32).collect();
    let gy = DeviceBuffer::from_host(device, &y)?;
    let mut sum = DeviceBuffer::from_host(device, &x)?;
    k.add_into(&s, &mut sum, &gy)?;
    let mut e = DeviceBuffer::<f32>::zeros(device, n)?;
    k.residual_error(&s, &mut e, &gx, &gy, 0.5)?;
    s.synchronize()?;
    let want_sum: Vec<f32> = x.iter().zip(&y).map(|(a, b)| a + b).collect();
    let want_e: Vec<f32> = x.iter().zip(&y).map(|(a, b)| a - b * 0.5).collect();
    let err = max_abs(&sum.to_vec()?, &want_sum).max(max_abs(&e.to_vec()?, &want_e));
    out.push(check("hook add / residual error", shape.clone(), err, 0.0));

    // x += y0 + y1 + y2 in one pass, against three add passes: bit for bit.
    let stride = n + 17;
    let parts: Vec<f32> = (0..3 * stride).map(|_| r.normal() as f32).collect();
    let gp = DeviceBuffer::from_host(device, &parts)?;
    let mut fused = DeviceBuffer::from_host(device, &x)?;
    k.add_parts_into(&s, &mut fused, &gp, stride, 3)?;
    let mut passes = DeviceBuffer::from_host(device, &x)?;
    for j in 0..3 {
        k.add_into(&s, &mut passes, &gp.view(j * stride..j * stride + n))?;
    }
    s.synchronize()?;
    let differ = bits_differ(&fused.to_vec()?, &passes.to_vec()?);
    out.push(check(
        "hook add parts (against add passes, bits)",
        shape,
        differ as f64,
        0.0,
    ));

    // Gram-Schmidt on tall matrices (PowerSGD's P and Q).
    let mut worst = 0.0f64;
    for (rows, cols) in [(3072, 1), (50_257, 4), (777, 8)] {
        let m: Vec<f32> = (0..rows * cols).map(|_| r.normal() as f32).collect();
        let mut gm = DeviceBuffer::from_host(device, &m)?;
        k.orthogonalize(&s, &mut gm, rows, cols, 1e-8)?;
        s.synchronize()?;
        let mut cpu = m.clone();
        orthogonalize_host(&mut cpu, rows, cols, 1e-8);
        worst = worst.max(max_abs(&gm.to_vec()?, &cpu));
    }
    out.push(check(
        "hook orthogonalize",
        "3072x1, 50257x4, 777x8".into(),
        worst,
        1e-5,
    ));
    Ok(out)
}
