//! The mixed-precision kernels against the CPU engine on random inputs.
//! Inputs are rounded to bf16 on the host first, so the CPU reference sees
//! exactly what the GPU sees; the bounds then measure the kernel's own
//! arithmetic and the rounding of its bf16 outputs (about 2⁻⁹ relative).

use super::check::{bits_differ, rel_err, up, KernelCheck, ModelReference};
use super::flash::{FlashKernels, ScoreGrads};
use super::mixed::{AdamSegments, AdamStep, MixedKernels, ZeroRuns};
use super::mixed_attention::{self as attention, AttnPath, AttnSaved, AttnShared};
use crate::cpu;
use crate::rng::Rng;
use braid_cuda::blas::{Blas, GemmEx, Mat};
use braid_cuda::blaslt::{BlasLt, Epilogue, LtGemm};
use braid_cuda::memory::copy_async;
use braid_cuda::{Device, DeviceBuffer, DeviceMem, DevicePool, Result, Stream};
use half::bf16;

/// Bound for kernels whose outputs are bf16: a few output roundings.
const BF16_OUT: f64 = 1e-2;
/// Bound for kernels computing f32 outputs from bf16 inputs.
const F32_OUT: f64 = 1e-5;

fn randn(r: &mut Rng, n: usize, s: f64) -> Vec<f32> {
    (0..n)
        .map(|_| bf16::from_f64(r.normal() * s).to_f32())
        .collect()
}

/// ‖gpu − cpu‖ / ‖cpu‖ (for whole-model gradients, where single tiny
/// entries say little).
fn norm_err(gpu: &[f32], cpu: &[f32]) -> f64 {
    let (mut d, mut s) = (0.0f64, 0.0f64);
    for (&a, &b) in gpu.iter().zip(cpu) {
        d += (a as f64 - b as f64).powi(2);
        s += (b as f64).powi(2);
    }
    (d / s.max(1e-60)).sqrt()
}

fn up_bf(d: &Device, v: &[f32]) -> Result<DeviceBuffer<bf16>> {
    let h: Vec<bf16> = v.iter().map(|&x| bf16::from_f32(x)).collect();
    DeviceBuffer::from_host(d, &h)
}

fn down_bf(b: &DeviceBuffer<bf16>) -> Result<Vec<f32>> {
    Ok(b.to_vec()?.iter().map(|x| x.to_f32()).collect())
}

fn check(name: &'static str, shape: String, error: f64, bound: f64) -> KernelCheck {
    KernelCheck::new(name, shape, error, bound)
}

/// Runs every mixed-precision check on `device`.
pub fn run(device: &Device) -> Result<Vec<KernelCheck>> {
    let mut mk = MixedKernels::load(device)?;
    let s = Stream::new(device)?;
    let mut blas = Blas::new(device)?;
    let mut r = Rng::new(2027);
    let mut out = Vec::new();
    let (n, c) = (301usize, 768usize);
    let shape = format!("N={n} C={c}");

    // LayerNorm forward and backward at each kind of width: fused pairs
    // of warps (768), a block per row (1600, with a partial last column
    // group, 2560 and 5120), and the generic warp per row (100).
    for width in [768, 1600, 2560, 5120, 100] {
        out.extend(check_layernorm(device, &mk, &s, &mut r, n, width)?);
    }
    let dout = randn(&mut r, n * c, 1.0);
    let gdout = up_bf(device, &dout)?;
    let len = MixedKernels::partial_len(n, 4 * c, 2).max(MixedKernels::partial_len(n, c, 3));
    let mut partial = DeviceBuffer::zeros(device, len)?;

    // Bias gradients from f32 and bf16 rows.
    let mut cbias = vec![0.0f32; c];
    for row in dout.chunks(c) {
        for (a, b) in cbias.iter_mut().zip(row) {
            *a += b;
        }
    }
    let gdout32 = up(device, &dout)?;
    let (mut gb1, mut gb2) = (
        DeviceBuffer::zeros(device, c)?,
        DeviceBuffer::zeros(device, c)?,
    );
    mk.bias_backward_f32(&s, &mut gb1, &mut partial, &gdout32, n, c)?;
    mk.bias_backward_bf(&s, &mut gb2, &mut partial, &gdout, n, c)?;
    // A width that is not a multiple of 8 takes the one-column kernel.
    let odd = 100;
    let rows_odd = down_bf(&gdout)?[..n * odd].to_vec();
    let mut cbias_odd = vec![0.0f32; odd];
    for row in rows_odd.chunks(odd) {
        for (a, b) in cbias_odd.iter_mut().zip(row) {
            *a += b;
        }
    }
    let mut gb3 = DeviceBuffer::zeros(device, odd)?;
    mk.bias_backward_bf(
        &s,
        &mut gb3,
        &mut partial,
        &up_bf(device, &rows_odd)?,
        n,
        odd,
    )?;
    s.synchronize()?;
    out.push(check(
        "bias_backward (f32, bf16 rows; bf16 at width 100)",
        shape.clone(),
        rel_err(&gb1.to_vec()?, &cbias)
            .max(rel_err(&gb2.to_vec()?, &cbias))
            .max(rel_err(&gb3.to_vec()?, &cbias_odd)),
        F32_OUT,
    ));

    // The residual and bias added to a row-split product summed in bf16:
    // (x + bias) + part, bit for bit.
    let x = randn(&mut r, n * c, 1.0);
    let bias = randn(&mut r, c, 0.1);
    let part = randn(&mut r, n * c, 0.5);
    let mut sum = DeviceBuffer::zeros(device, n * c)?;
    mk.residual_bias_add(
        &s,
        &mut sum,
        &up(device, &x)?,
        &up(device, &bias)?,
        &up_bf(device, &part)?,
        n,
        c,
    )?;
    s.synchronize()?;
    let want: Vec<f32> = (0..n * c)
        .map(|i| (x[i] + bias[i % c]) + bf16::from_f32(part[i]).to_f32())
        .collect();
    out.push(check(
        "residual_bias_add_bf (elements whose bits differ)",
        shape.clone(),
        bits_differ(&sum.to_vec()?, &want) as f64,
        0.0,
    ));

    // Runs of a buffer zeroed in one launch; the rest untouched.
    let len = 50_000;
    let before = randn(&mut r, len, 1.0);
    let runs = [0..3, 10..10, 17..2_065, 9_999..40_000, 49_990..50_000];
    let mut g = up(device, &before)?;
    let z = ZeroRuns::new(device, &runs, len)?;
    mk.zero_runs(&s, &mut g, &z)?;
    s.synchronize()?;
    let mut want = before.clone();
    for run in &runs {
        want[run.clone()].iter_mut().for_each(|x| *x = 0.0);
    }
    out.push(check(
        "zero_runs (elements whose bits differ)",
        format!("{} runs in {len}", runs.len()),
        bits_differ(&g.to_vec()?, &want) as f64,
        0.0,
    ));

    // Bias + GELU forward, GELU backward.
    let h = randn(&mut r, n * 4 * c, 2.0);
    let hb = randn(&mut r, 4 * c, 0.5);
    let pre: Vec<f32> = h
        .iter()
        .enumerate()
        .map(|(i, &v)| bf16::from_f32(v + hb[i % (4 * c)]).to_f32())
        .collect();
    let mut cg = vec![0.0f32; pre.len()];
    cpu::gelu::gelu_forward(&mut cg, &pre);
    let mut gpre = up_bf(device, &h)?;
    let mut gg = DeviceBuffer::<bf16>::zeros(device, h.len())?;
    mk.bias_gelu(&s, &mut gpre, &mut gg, &up(device, &hb)?, n, 4 * c)?;
    s.synchronize()?;
    let e = rel_err(&down_bf(&gpre)?, &pre).max(rel_err(&down_bf(&gg)?, &cg));
    out.push(check(
        "bias_gelu (bf16)",
        format!("{} elements", h.len()),
        e,
        BF16_OUT,
    ));
    let dh = randn(&mut r, h.len(), 1.0);
    let mut cdh = vec![0.0f32; h.len()];
    cpu::gelu::gelu_backward(&mut cdh, &pre, &dh);
    // The fused bias gradient sums the bf16 values the products then use.
    let mut cdb = vec![0.0f32; 4 * c];
    for (i, v) in cdh.iter().enumerate() {
        cdb[i % (4 * c)] += bf16::from_f32(*v).to_f32();
    }
    let mut gdh = up_bf(device, &dh)?;
    let mut gdb = DeviceBuffer::<f32>::zeros(device, 4 * c)?;
    let mut regelu = DeviceBuffer::<bf16>::zeros(device, h.len())?;
    mk.gelu_backward_bias(
        &s,
        &mut gdh,
        &gpre,
        &mut gdb,
        &mut partial,
        Some(&mut regelu),
        n,
        4 * c,
    )?;
    s.synchronize()?;
    out.push(check(
        "gelu_backward + bias grad + recomputed gelu (bf16)",
        format!("N={n} C={}", 4 * c),
        rel_err(&down_bf(&gdh)?, &cdh)
            .max(rel_err(&gdb.to_vec()?, &cdb))
            .max(rel_err(&down_bf(&regelu)?, &cg)),
        BF16_OUT,
    ));
    // The recomputed GELU written over the pre-activation: the same bits.
    let mut over = up_bf(device, &dh)?;
    let mut over_db = DeviceBuffer::<f32>::zeros(device, 4 * c)?;
    let mut over_pre = DeviceBuffer::<bf16>::zeros(device, h.len())?;
    copy_async(&mut over_pre, &gpre, &s)?;
    mk.gelu_backward_bias_over_pre(
        &s,
        &mut over,
        &mut over_pre,
        &mut over_db,
        &mut partial,
        n,
        4 * c,
    )?;
    s.synchronize()?;
    let same = over.to_vec()? == gdh.to_vec()?
        && over_pre.to_vec()? == regelu.to_vec()?
        && over_db.to_vec()? == gdb.to_vec()?;
    out.push(check(
        "gelu_backward, gelu over the pre-activation (bit-exact)",
        format!("N={n} C={}", 4 * c),
        if same { 0.0 } else { 1.0 },
        0.0,
    ));

    // Mixed products: bf16 inputs, f32 and bf16 results, transposes and a
    // padded leading dimension.
    let (m, nn, kk, ld) = (200usize, 333usize, 192usize, 384usize);
    let (mut e32, mut e16): (f64, f64) = (0.0, 0.0);
    for (a_t, b_t) in [(false, false), (true, false), (false, true), (true, true)] {
        let a = randn(&mut r, m * kk, 1.0);
        let bm = randn(&mut r, kk * nn, 1.0);
        let mut cpu_c = vec![0.0f32; m * nn];
        cpu::matmul::gemm_rm(&mut cpu_c, &a, a_t, &bm, b_t, m, nn, kk, false);
        let (ga, gbm) = (up_bf(device, &a)?, up_bf(device, &bm)?);
        let gc = DeviceBuffer::<f32>::zeros(device, m * ld)?;
        let gc16 = DeviceBuffer::<bf16>::zeros(device, m * ld)?;
        let am = |t| {
            let x = Mat::of(&ga, if t { m } else { kk });
            if t {
                x.t()
            } else {
                x
            }
        };
        let bmat = |t| {
            let x = Mat::of(&gbm, if t { kk } else { nn });
            if t {
                x.t()
            } else {
                x
            }
        };
        for cm in [Mat::of(&gc, ld), Mat::of(&gc16, ld)] {
            blas.gemm_ex(
                &s,
                &GemmEx {
                    m,
                    n: nn,
                    k: kk,
                    a: am(a_t),
                    b: bmat(b_t),
                    c: cm,
                    alpha: 1.0,
                    beta: 0.0,
                    batch: 1,
                    tf32: false,
                },
            )?;
        }
        s.synchronize()?;
        let (g32, g16) = (gc.to_vec()?, down_bf(&gc16)?);
        let unpad =
            |v: &[f32]| -> Vec<f32> { v.chunks(ld).flat_map(|row| row[..nn].to_vec()).collect() };
        e32 = e32.max(rel_err(&unpad(&g32), &cpu_c));
        e16 = e16.max(rel_err(&unpad(&g16), &cpu_c));
    }
    let gshape = format!("{m}x{kk} · {kk}x{nn}, ld {ld}, all transposes");
    out.push(check(
        "gemm bf16 -> f32 (cuBLAS)",
        gshape.clone(),
        e32,
        F32_OUT,
    ));
    out.push(check("gemm bf16 -> bf16 (cuBLAS)", gshape, e16, BF16_OUT));

    // Softmax + cross-entropy on bf16 logits with a padded row stride: the
    // warp-per-row kernel, then the block-per-row one (`BRAID_CE=rows`) at
    // the same rows and at GPT-2's vocabulary (each thread holding several
    // chunks), whatever the environment chose.
    for (rows_kernel, name, shapes) in [
        (
            false,
            "softmax_cross_entropy (bf16)",
            &[(64, 997, 1024)][..],
        ),
        (
            true,
            "softmax_cross_entropy (bf16, a block a row)",
            &[(64, 997, 1024), (8, 50257, 50304)][..],
        ),
    ] {
        mk.set_ce_rows(rows_kernel);
        for &shape in shapes {
            let e = softmax_ce_case(device, &s, &mk, &mut r, shape)?;
            let (rows, v, vld) = shape;
            out.push(check(name, format!("N={rows} V={v} ld={vld}"), e, BF16_OUT));
        }
    }
    mk.set_ce_rows(std::env::var(braid_core::env::BRAID_CE).is_ok_and(|v| v.trim() == "rows"));

    out.extend(fused_bias_checks(device, &s, &mut r)?);
    out.extend(tuning_offer_checks(device, &s, &mut r)?);

    // Attention forward and backward against the CPU kernel, on both
    // paths (the fused one at several head sizes, with a sequence that is
    // not a multiple of its 64-row tiles).
    let shape = |b, t, c, nh| cpu::attention::AttnShape { b, t, c, nh };
    out.extend(attention_checks(
        device,
        &mk,
        &mut blas,
        &s,
        &mut r,
        AttnPath::Batched,
        shape(2, 64, 256, 4),
    )?);
    if mk.flash.is_some() {
        for sh in [
            shape(2, 200, 128, 2),
            shape(1, 64, 64, 4),
            shape(3, 72, 96, 3),
            // The wider heads of the billion-parameter models.
            shape(2, 136, 160, 2),
            shape(1, 100, 192, 2),
            shape(2, 72, 256, 2),
            // Head size 128 over three 128-row blocks, the last with rows
            // for one warpgroup of the Hopper forward kernel only.
            shape(1, 300, 256, 2),
        ] {
            out.extend(attention_checks(
                device,
                &mk,
                &mut blas,
                &s,
                &mut r,
                AttnPath::Fused,
                sh,
            )?);
        }
    }

    // Fused multi-tensor AdamW (with the bf16 copy) against the CPU
    // optimizer; gradient scaling against pre-scaled gradients.
    let cfg = crate::config::GptConfig::parse("L1-H2-C64-V100-T16").expect("valid config");
    let layout = std::sync::Arc::new(crate::layout::Layout::new(&cfg));
    let mut params = crate::params::Params::init_gpt2(layout.clone(), 3);
    let p0 = params.clone();
    let grads: Vec<f32> = (0..layout.len).map(|_| r.normal() as f32).collect();
    let gscale = 0.5f32;
    let scaled: Vec<f32> = grads.iter().map(|g| g * gscale).collect();
    let acfg = crate::optim::AdamWConfig::default();
    let mut opt = crate::optim::Optimizer::adamw(&layout, acfg);
    for _ in 0..3 {
        opt.step(&mut params, &scaled, 1e-3);
    }
    let segs = AdamSegments::new(device, &layout, acfg.weight_decay)?;
    // The GPU steps' hyperparameters: the CPU optimizer's, and the scale.
    let adam = |step| AdamStep {
        lr: 1e-3,
        beta1: acfg.beta1,
        beta2: acfg.beta2,
        step,
        eps: acfg.eps,
        grad_scale: gscale,
    };
    let mut gp = up(device, &p0.data)?;
    let mut gpb = DeviceBuffer::<bf16>::zeros(device, layout.len)?;
    let gg = up(device, &grads)?;
    let (mut gm, mut gv) = (
        DeviceBuffer::zeros(device, layout.len)?,
        DeviceBuffer::zeros(device, layout.len)?,
    );
    for step in 1..=3 {
        mk.adamw_multi(
            &s,
            &mut gp,
            Some(&mut gpb),
            &gg,
            &mut gm,
            &mut gv,
            &segs,
            adam(step),
        )?;
    }
    s.synchronize()?;
    let e = rel_err(&gp.to_vec()?, &params.data);
    out.push(check(
        "adamw_multi (one launch, clip scale)",
        format!("{} parameters, 3 steps", layout.len),
        e,
        1e-6,
    ));
    out.push(check(
        "adamw_multi bf16 copy",
        format!("{} parameters", layout.len),
        rel_err(&down_bf(&gpb)?, &params.data),
        BF16_OUT,
    ));
    // The same steps on views one element in (not 16-byte aligned: the
    // one-element-per-thread kernel) against the CPU optimizer too. (The
    // two kernels' results may differ in the last bit: the compiler
    // contracts multiply-adds differently in each.)
    let shifted = |x: &[f32]| [&[0.0f32][..], x].concat();
    let len = layout.len;
    let mut sp = up(device, &shifted(&p0.data))?;
    let sg = up(device, &shifted(&grads))?;
    let mut spb = DeviceBuffer::<bf16>::zeros(device, len + 1)?;
    let (mut sm, mut sv) = (
        DeviceBuffer::<f32>::zeros(device, len + 1)?,
        DeviceBuffer::<f32>::zeros(device, len + 1)?,
    );
    for step in 1..=3 {
        mk.adamw_multi(
            &s,
            &mut sp.view_mut(1..len + 1),
            Some(&mut spb.view_mut(1..len + 1)),
            &sg.view(1..len + 1),
            &mut sm.view_mut(1..len + 1),
            &mut sv.view_mut(1..len + 1),
            &segs,
            adam(step),
        )?;
    }
    s.synchronize()?;
    out.push(check(
        "adamw_multi unaligned (one element per thread)",
        format!("{len} parameters, 3 steps"),
        rel_err(&sp.to_vec()?[1..], &params.data),
        1e-6,
    ));

    // The whole mixed model against the CPU model (f32): loss and every
    // gradient tensor (norm-relative).
    let m = ModelReference::new(&mut r)?;
    let (layout, params, closs, cg) = (&m.layout, &m.params, m.loss, &m.grads);
    let (mb, mt) = (ModelReference::B, ModelReference::T);
    let mut gpu = super::model_mixed::GpuGptMixed::new(device, layout.clone(), mb, mt)?;
    let gparams = up(device, &params.data)?;
    let gpb = up_bf(device, &params.data)?;
    let mut ggr = DeviceBuffer::zeros(device, layout.len)?;
    let gloss = gpu.forward(&gparams, Some(&gpb), &m.tokens, &m.targets, true)?;
    gpu.backward(&gparams, Some(&gpb), &mut ggr)?;
    let ggv = ggr.to_vec()?;
    let mut e = ((gloss - closs) as f64).abs() / (closs as f64).abs();
    let mut worst = String::new();
    for spec in &layout.params {
        let t = norm_err(&ggv[spec.range()], &cg[spec.range()]);
        if t > e {
            e = t;
            worst = spec.name.clone();
        }
    }
    out.push(check(
        "model fwd+bwd (bf16 vs CPU f32)",
        format!("{}, B={mb}; worst {worst}", ModelReference::CONFIG),
        e,
        5e-2,
    ));
    // The forward products in FP8 (e4m3, per-tensor scales; Ada and
    // Hopper): the loss and gradients against the CPU's f32, within what
    // e4m3's 3 mantissa bits allow (each input and weight rounded to about
    // 6 % at worst, 2 % typically).
    let (major, minor) = device.compute_capability()?;
    use super::model_mixed::Fp8Use;
    let fp8 = major * 10 + minor >= 89 && super::fp8::Fp8Kernels::load(device).is_ok();
    for (what, twice, twice_delayed, use_) in [
        (
            "model fwd+bwd, FP8 forward products (vs CPU f32)",
            "model fwd+bwd, FP8 forward products, a second pass (bit-exact)",
            "model fwd+bwd, FP8 forward products, a second pass, delayed scaling (vs CPU f32)",
            Fp8Use::Forward,
        ),
        (
            "model fwd+bwd, FP8 products (vs CPU f32)",
            "model fwd+bwd, FP8 products, a second pass (bit-exact)",
            "model fwd+bwd, FP8 products, a second pass, delayed scaling (vs CPU f32)",
            Fp8Use::All,
        ),
    ] {
        if !fp8 {
            break;
        }
        let mut f8 = super::model_mixed::GpuGptMixed::new(device, layout.clone(), mb, mt)?;
        f8.set_fp8(use_)?;
        let mut fgr = DeviceBuffer::zeros(device, layout.len)?;
        let floss = f8.forward(&gparams, Some(&gpb), &m.tokens, &m.targets, true)?;
        f8.backward(&gparams, Some(&gpb), &mut fgr)?;
        let fgv = fgr.to_vec()?;
        let mut e = ((floss - closs) as f64).abs() / (closs as f64).abs();
        let mut worst = String::from("the loss");
        for spec in &layout.params {
            let t = norm_err(&fgv[spec.range()], &cg[spec.range()]);
            if t > e {
                e = t;
                worst = spec.name.clone();
            }
        }
        out.push(check(
            what,
            format!("{}, B={mb}; worst {worst}", ModelReference::CONFIG),
            e,
            0.2,
        ));
        // The same pass again on the same engine (its rooms, plans and
        // switches as the first left them): the same loss and gradients,
        // bit for bit (training's second step was NaN on an H100) — or,
        // under BRAID_FP8_SCALING=delayed, where the second pass scales by
        // the first's amaxes, within the same bound of the CPU's.
        let delayed =
            std::env::var(braid_core::env::BRAID_FP8_SCALING).is_ok_and(|v| v.trim() == "delayed");
        let again = f8.forward(&gparams, Some(&gpb), &m.tokens, &m.targets, true)?;
        let mut agr = DeviceBuffer::zeros(device, layout.len)?;
        f8.backward(&gparams, Some(&gpb), &mut agr)?;
        let agv = agr.to_vec()?;
        let differing = agv
            .iter()
            .zip(&fgv)
            .filter(|(x, y)| x.to_bits() != y.to_bits())
            .count();
        let finite = again.is_finite() && agv.iter().all(|x| x.is_finite());
        let said = format!(
            "loss {again} then {floss}; {differing} of {} gradients differ{}",
            agv.len(),
            if finite { "" } else { "; NOT FINITE" }
        );
        if delayed {
            let mut e = ((again - closs) as f64).abs() / (closs as f64).abs();
            for spec in &layout.params {
                e = e.max(norm_err(&agv[spec.range()], &cg[spec.range()]));
            }
            out.push(check(
                twice_delayed,
                said,
                if finite { e } else { f64::INFINITY },
                0.2,
            ));
            continue;
        }
        out.push(check(
            twice,
            said,
            if again.to_bits() == floss.to_bits() && differing == 0 && finite {
                0.0
            } else {
                1.0
            },
            0.0,
        ));
    }
    // Deferring every layer's weight gradients reorders the work only:
    // the gradients must be the same bit for bit.
    gpu.defer_weight_grads(layout.config.n_layer)?;
    let mut dgr = DeviceBuffer::zeros(device, layout.len)?;
    let dloss = gpu.forward(&gparams, Some(&gpb), &m.tokens, &m.targets, true)?;
    gpu.backward(&gparams, Some(&gpb), &mut dgr)?;
    let same = dloss == gloss && dgr.to_vec()? == ggv;
    out.push(check(
        "model bwd, weight gradients deferred (bit-exact)",
        format!("{}, B={mb}, all layers deferred", ModelReference::CONFIG),
        if same { 0.0 } else { 1.0 },
        0.0,
    ));
    // Checkpointing recomputes the blocks' activations (all, from the
    // attention's output on, or the attention's output too), streamed bf16 weights cast each layer as it
    // is needed, and stored score gradients spare the attention's dQ
    // kernel their recomputation, all in the same arithmetic: the same
    // gradients bit for bit, with the weight gradients in place or
    // deferred.
    use super::model_mixed::{GpuGptMixed, MixedOptions};
    let n_layer = layout.config.n_layer;
    let plain = MixedOptions::default();
    let ckpt = MixedOptions {
        checkpointing: true,
        ..plain
    };
    let all = MixedOptions {
        checkpointing: true,
        streamed_weights: true,
        stored_score_grads: true,
        kept_attention: usize::MAX,
        recompute_attention_output: false,
        sequence_parallel: false,
    };
    let no_output = MixedOptions {
        recompute_attention_output: true,
        ..ckpt
    };
    for (what, options, defer) in [
        ("model bwd, checkpointing (bit-exact)", ckpt, 0),
        ("model bwd, checkpointing (bit-exact)", ckpt, n_layer),
        (
            "model bwd, checkpointing keeping the attention (bit-exact)",
            MixedOptions {
                kept_attention: usize::MAX,
                ..ckpt
            },
            0,
        ),
        (
            "model bwd, checkpointing keeping the attention in the last layer (bit-exact)",
            MixedOptions {
                kept_attention: 1,
                ..ckpt
            },
            0,
        ),
        (
            "model bwd, checkpointing recomputing the attention's output (bit-exact)",
            no_output,
            0,
        ),
        (
            "model bwd, checkpointing recomputing the attention's output (bit-exact)",
            no_output,
            n_layer,
        ),
        (
            "model bwd, streamed bf16 weights (bit-exact)",
            MixedOptions {
                streamed_weights: true,
                ..plain
            },
            0,
        ),
        (
            "model bwd, stored attention score gradients (bit-exact)",
            MixedOptions {
                stored_score_grads: true,
                ..plain
            },
            0,
        ),
        ("model bwd, all four (bit-exact)", all, n_layer),
    ] {
        let streamed_weights = options.streamed_weights;
        let mut ck = GpuGptMixed::with_options(device, layout.clone(), mb, mt, options)?;
        ck.defer_weight_grads(defer)?;
        let pb = (!streamed_weights).then_some(&gpb);
        let mut cgr = DeviceBuffer::zeros(device, layout.len)?;
        let closs = ck.forward(&gparams, pb, &m.tokens, &m.targets, true)?;
        ck.backward(&gparams, pb, &mut cgr)?;
        let same = closs == gloss && cgr.to_vec()? == ggv;
        out.push(check(
            what,
            format!(
                "{}, B={mb}, {defer} layers deferred, {:?} attention",
                ModelReference::CONFIG,
                ck.attention_path()
            ),
            if same { 0.0 } else { 1.0 },
            0.0,
        ));
    }
    Ok(out)
}

/// cuBLASLt products with a fused bias: f32 results with a separate
/// residual input (`d = a·b + residual + bias`) and bf16 results
/// (`d = a·b + bias`), every transpose, a padded leading dimension.
/// GEMM tuning picks among cuBLASLt's offers of one kernel family without
/// split-K, on the claim that they all compute the same bits (see
/// `braid_cuda::blaslt::Tuning`): every such offer runs the 2.65B model's
/// attention projection (f32 result, residual and bias: the product where
/// tuning picked another offer on an H200) and its qkv product (bf16 with
/// bias), and the check counts the offers whose result differs from the
/// first's (bound 0).
fn tuning_offer_checks(device: &Device, s: &Stream, r: &mut Rng) -> Result<Vec<KernelCheck>> {
    let mut lt = BlasLt::new(device)?;
    let (n, c) = (8192usize, 2560usize);
    let x = up_bf(device, &randn(r, n * c, 1.0))?;
    let w = up_bf(device, &randn(r, c * 3 * c, 0.02))?;
    let resid = up(device, &randn(r, n * c, 1.0))?;
    let bias = up(device, &randn(r, 3 * c, 0.1))?;
    let bias16 = up_bf(device, &randn(r, 3 * c, 0.1))?;
    let d32 = DeviceBuffer::<f32>::zeros(device, n * c)?;
    let d16 = DeviceBuffer::<bf16>::zeros(device, n * 3 * c)?;
    let bytes32 =
        || -> Result<Vec<u8>> { Ok(d32.to_vec()?.iter().flat_map(|v| v.to_le_bytes()).collect()) };
    let bytes16 = || -> Result<Vec<u8>> {
        Ok(d16
            .to_vec()?
            .iter()
            .flat_map(|v| v.to_bits().to_le_bytes())
            .collect())
    };
    let proj = LtGemm {
        m: n,
        n: c,
        k: c,
        a: Mat::of(&x, c),
        b: Mat::of(&w, c),
        c: Mat::of(&resid, c),
        d: Mat::of(&d32, c),
        epilogue: Epilogue::Bias {
            bias: (bias.dptr(), c),
        },
        alpha: 1.0,
        beta: 1.0,
    };
    let qkv = LtGemm {
        m: n,
        n: 3 * c,
        k: c,
        a: Mat::of(&x, c),
        b: Mat::of(&w, 3 * c),
        c: Mat::of(&d16, 3 * c),
        d: Mat::of(&d16, 3 * c),
        epilogue: Epilogue::Bias {
            bias: (bias16.dptr(), 3 * c),
        },
        alpha: 1.0,
        beta: 0.0,
    };
    let mut out = Vec::new();
    for (name, g, read) in [
        (
            "gemm tuning offers, f32 + residual (same bits)",
            &proj,
            &bytes32 as &dyn Fn() -> Result<Vec<u8>>,
        ),
        (
            "gemm tuning offers, bf16 + bias (same bits)",
            &qkv,
            &bytes16,
        ),
    ] {
        let (offers, differing) = lt.alike_offers_agree(s, g, read)?;
        let shape = format!("{}x{}x{}, {offers} offers", g.m, g.n, g.k);
        out.push(check(name, shape, differing as f64, 0.0));
    }
    Ok(out)
}

fn fused_bias_checks(device: &Device, s: &Stream, r: &mut Rng) -> Result<[KernelCheck; 4]> {
    let mut lt = BlasLt::new(device)?;
    let (m, nn, kk, ld) = (200usize, 333usize, 192usize, 384usize);
    let (mut e32, mut e16): (f64, f64) = (0.0, 0.0);
    for (a_t, b_t) in [(false, false), (true, false), (false, true), (true, true)] {
        let a = randn(r, m * kk, 1.0);
        let bm = randn(r, kk * nn, 1.0);
        let bias = randn(r, nn, 1.0);
        let resid = randn(r, m * ld, 1.0);
        let mut prod = vec![0.0f32; m * nn];
        cpu::matmul::gemm_rm(&mut prod, &a, a_t, &bm, b_t, m, nn, kk, false);
        let want16: Vec<f32> = (0..m * nn).map(|i| prod[i] + bias[i % nn]).collect();
        let want32: Vec<f32> = (0..m * nn)
            .map(|i| want16[i] + resid[(i / nn) * ld + i % nn])
            .collect();
        let (ga, gbm) = (up_bf(device, &a)?, up_bf(device, &bm)?);
        let (gbias, gbias16, gres) = (
            up(device, &bias)?,
            up_bf(device, &bias)?,
            up(device, &resid)?,
        );
        let gd = DeviceBuffer::<f32>::zeros(device, m * ld)?;
        let gd16 = DeviceBuffer::<bf16>::zeros(device, m * ld)?;
        let am = Mat::of(&ga, if a_t { m } else { kk });
        let bmat = Mat::of(&gbm, if b_t { kk } else { nn });
        let (am, bmat) = (
            if a_t { am.t() } else { am },
            if b_t { bmat.t() } else { bmat },
        );
        let g = |c, d, bias: (u64, usize), beta| LtGemm {
            m,
            n: nn,
            k: kk,
            a: am,
            b: bmat,
            c,
            d,
            epilogue: Epilogue::Bias { bias },
            alpha: 1.0,
            beta,
        };
        let d32 = Mat::of(&gd, ld);
        lt.gemm(s, &g(Mat::of(&gres, ld), d32, (gbias.dptr(), nn), 1.0))?;
        let d16 = Mat::of(&gd16, ld);
        lt.gemm(s, &g(d16, d16, (gbias16.dptr(), nn), 0.0))?;
        s.synchronize()?;
        let unpad =
            |v: &[f32]| -> Vec<f32> { v.chunks(ld).flat_map(|row| row[..nn].to_vec()).collect() };
        // The bf16 result adds the bf16-rounded bias.
        let want16: Vec<f32> = (0..m * nn)
            .map(|i| prod[i] + bf16::from_f32(bias[i % nn]).to_f32())
            .collect();
        e32 = e32.max(rel_err(&unpad(&gd.to_vec()?), &want32));
        e16 = e16.max(rel_err(&unpad(&down_bf(&gd16)?), &want16));
    }
    let shape = format!("{m}x{kk} · {kk}x{nn}, ld {ld}, all transposes");
    let (eg, eaux, edg, ebg) = gelu_epilogue_errors(device, &mut lt, s, r)?;
    let gshape = format!("{m}x{kk} · {kk}x{nn}, ld {ld}");
    Ok([
        check(
            "gemm + residual + bias -> f32 (cuBLASLt)",
            shape.clone(),
            e32,
            F32_OUT,
        ),
        check("gemm + bias -> bf16 (cuBLASLt)", shape, e16, BF16_OUT),
        check(
            "gemm + bias + gelu -> bf16 (cuBLASLt)",
            gshape.clone(),
            eg.max(eaux),
            BF16_OUT,
        ),
        check(
            "gemm + gelu backward + bias grad (cuBLASLt)",
            gshape,
            edg.max(ebg),
            BF16_OUT,
        ),
    ])
}

/// The GELU epilogues against the CPU: bias + GELU keeping the
/// pre-activation, and the GELU backward with the bias gradient (the MLP's
/// shapes: plain `a`, `b`; padded rows). Errors of (gelu, pre-activation,
/// gradient, bias gradient).
fn gelu_epilogue_errors(
    device: &Device,
    lt: &mut BlasLt,
    s: &Stream,
    r: &mut Rng,
) -> Result<(f64, f64, f64, f64)> {
    let (m, nn, kk, ld) = (200usize, 333usize, 192usize, 384usize);
    let a = randn(r, m * kk, 1.0);
    let bm = randn(r, kk * nn, 0.2);
    let bias = randn(r, nn, 0.5);
    let mut prod = vec![0.0f32; m * nn];
    cpu::matmul::gemm_rm(&mut prod, &a, false, &bm, false, m, nn, kk, false);
    let b16 = |x: f32| bf16::from_f32(x).to_f32();
    let pre: Vec<f32> = (0..m * nn).map(|i| prod[i] + b16(bias[i % nn])).collect();
    let mut gelu = vec![0.0f32; m * nn];
    cpu::gelu::gelu_forward(&mut gelu, &pre);
    let (ga, gbm, gbias) = (
        up_bf(device, &a)?,
        up_bf(device, &bm)?,
        up_bf(device, &bias)?,
    );
    let gd = DeviceBuffer::<bf16>::zeros(device, m * ld)?;
    let gaux = DeviceBuffer::<bf16>::zeros(device, m * ld)?;
    let (am, bmat, d) = (Mat::of(&ga, kk), Mat::of(&gbm, nn), Mat::of(&gd, ld));
    let g = |epilogue| LtGemm {
        m,
        n: nn,
        k: kk,
        a: am,
        b: bmat,
        c: d,
        d,
        epilogue,
        alpha: 1.0,
        beta: 0.0,
    };
    lt.gemm(
        s,
        &g(Epilogue::GeluAuxBias {
            bias: (gbias.dptr(), nn),
            aux: (gaux.dptr(), gaux.dlen()),
            aux_ld: ld,
        }),
    )?;
    s.synchronize()?;
    let unpad =
        |v: &[f32]| -> Vec<f32> { v.chunks(ld).flat_map(|row| row[..nn].to_vec()).collect() };
    let aux_back = unpad(&down_bf(&gaux)?);
    let (eg, eaux) = (
        rel_err(&unpad(&down_bf(&gd)?), &gelu),
        rel_err(&aux_back, &pre),
    );
    // Backward: d = product · gelu'(aux), with the aux the GPU kept.
    let mut dpre = vec![0.0f32; m * nn];
    cpu::gelu::gelu_backward(&mut dpre, &aux_back, &prod);
    let mut dbias = vec![0.0f32; nn];
    for (i, v) in dpre.iter().enumerate() {
        dbias[i % nn] += v;
    }
    let gbg = DeviceBuffer::<bf16>::zeros(device, nn)?;
    lt.gemm(
        s,
        &g(Epilogue::DGeluBGrad {
            aux: (gaux.dptr(), gaux.dlen()),
            aux_ld: ld,
            bgrad: (gbg.dptr(), nn),
        }),
    )?;
    s.synchronize()?;
    Ok((
        eg,
        eaux,
        rel_err(&unpad(&down_bf(&gd)?), &dpre),
        rel_err(&down_bf(&gbg)?, &dbias),
    ))
}

/// Attention forward and backward on `path` against the CPU kernel, with
/// a random bias on `qkv`; on the fused path the backward pass runs both
/// ways (dQ from stored score gradients, and recomputing them), which must
/// give the same bits.
fn attention_checks(
    device: &Device,
    mk: &MixedKernels,
    blas: &mut Blas,
    s: &Stream,
    r: &mut Rng,
    path: AttnPath,
    sh: cpu::attention::AttnShape,
) -> Result<Vec<KernelCheck>> {
    let qkv = randn(r, sh.b * sh.t * 3 * sh.c, 1.0);
    let bias = randn(r, 3 * sh.c, 0.5);
    // What the GPU attends over: qkv + bias, rounded to bf16.
    let biased: Vec<f32> = qkv
        .iter()
        .enumerate()
        .map(|(i, &x)| bf16::from_f32(x + bias[i % (3 * sh.c)]).to_f32())
        .collect();
    let (mut co, mut catt) = (
        vec![0.0f32; sh.b * sh.t * sh.c],
        vec![0.0f32; sh.b * sh.nh * sh.t * sh.t],
    );
    cpu::attention::attention_forward(&mut co, &mut catt, &biased, sh);
    let pool = DevicePool::new(device);
    let mut prof = super::profile::PhaseTimer::from_env(device);
    let mut saved = AttnSaved::new(&pool, s, sh, path)?;
    let mut shared = AttnShared::new(&pool, s, sh, path, false)?;
    let mut gy = DeviceBuffer::<bf16>::zeros(device, co.len())?;
    attention::forward(
        mk,
        blas,
        s,
        &mut gy,
        &up_bf(device, &qkv)?,
        &up(device, &bias)?,
        &mut saved,
        &mut shared,
        sh,
        &mut prof,
    )?;
    s.synchronize()?;
    let (fwd, bwd) = match path {
        AttnPath::Fused => (
            "attention_forward (bf16, fused)",
            "attention_backward (bf16, fused)",
        ),
        AttnPath::Batched => (
            "attention_forward (bf16, batched)",
            "attention_backward (bf16, batched)",
        ),
    };
    let ashape = format!("B={} T={} C={} NH={}", sh.b, sh.t, sh.c, sh.nh);
    let forward = check(fwd, ashape.clone(), rel_err(&down_bf(&gy)?, &co), BF16_OUT);
    let dy = randn(r, co.len(), 1.0);
    let mut cd = vec![0.0f32; qkv.len()];
    cpu::attention::attention_backward(&mut cd, &dy, &biased, &catt, sh);
    let gdy = up_bf(device, &dy)?;
    let mut backward = |shared: &mut AttnShared, idle: Option<ScoreGrads>| -> Result<Vec<f32>> {
        let mut gd = DeviceBuffer::<bf16>::zeros(device, qkv.len())?;
        attention::backward(
            mk, blas, s, &mut gd, &gdy, &gy, &saved, shared, idle, sh, &mut prof,
        )?;
        s.synchronize()?;
        down_bf(&gd)
    };
    let gd = backward(&mut shared, None)?;
    let mut out = vec![
        forward,
        check(bwd, ashape.clone(), rel_err(&gd, &cd), 2.0 * BF16_OUT),
    ];
    if path == AttnPath::Fused {
        let mut stored = AttnShared::new(&pool, s, sh, path, true)?;
        let same = backward(&mut stored, None)?
            .iter()
            .zip(&gd)
            .all(|(x, y)| x.to_bits() == y.to_bits());
        out.push(check(
            "attention_backward (bf16, fused, stored dS) = recomputed, bit for bit",
            ashape.clone(),
            if same { 0.0 } else { 1.0 },
            0.0,
        ));
        // The score gradients in two pieces of memory: the first heads'
        // in one (with room to spare that is not a whole head), the rest
        // in the other.
        let total = FlashKernels::score_grads_len(sh) as usize;
        let per = total / (sh.b * sh.nh);
        let first_heads = (sh.b * sh.nh).div_ceil(2);
        let mut first = DeviceBuffer::<bf16>::zeros(device, first_heads * per + per / 2)?;
        let mut rest = DeviceBuffer::<bf16>::zeros(device, total - first_heads * per)?;
        let idle = ScoreGrads {
            first: first.view_mut(0..first.len()),
            rest: rest.view_mut(0..rest.len()),
        };
        let mut plain = AttnShared::new(&pool, s, sh, path, false)?;
        let same = backward(&mut plain, Some(idle))?
            .iter()
            .zip(&gd)
            .all(|(x, y)| x.to_bits() == y.to_bits());
        out.push(check(
            "attention_backward (bf16, fused, stored dS in two pieces) = recomputed, bit for bit",
            ashape,
            if same { 0.0 } else { 1.0 },
            0.0,
        ));
    }
    Ok(out)
}

/// One softmax + cross-entropy case on the GPU (`rows` rows of `v` logits,
/// stored `vld` apart; row 5's target ignored) against the CPU's: the
/// worse of the losses' and the gradients' relative errors.
fn softmax_ce_case(
    device: &Device,
    s: &Stream,
    mk: &MixedKernels,
    r: &mut Rng,
    (rows, v, vld): (usize, usize, usize),
) -> Result<f64> {
    let scale = 1.0 / 63.0;
    let logits = randn(r, rows * v, 3.0);
    let mut targets: Vec<u32> = (0..rows).map(|_| r.below(v) as u32).collect();
    targets[5] = u32::MAX;
    let (cl, cgrad) = softmax_ce_ref(&logits, &targets, rows, v, scale);
    let mut padded = vec![0.0f32; rows * vld];
    for i in 0..rows {
        padded[i * vld..i * vld + v].copy_from_slice(&logits[i * v..(i + 1) * v]);
    }
    let mut gl = up_bf(device, &padded)?;
    let mut glo = DeviceBuffer::zeros(device, rows)?;
    let gt = DeviceBuffer::from_host(
        device,
        &targets.iter().map(|&x| x as i32).collect::<Vec<_>>(),
    )?;
    mk.softmax_cross_entropy(s, &mut gl, &mut glo, &gt, rows, v, vld, scale)?;
    s.synchronize()?;
    let gg: Vec<f32> = down_bf(&gl)?
        .chunks(vld)
        .flat_map(|row| row[..v].to_vec())
        .collect();
    Ok(rel_err(&glo.to_vec()?, &cl).max(rel_err(&gg, &cgrad)))
}

/// Softmax cross-entropy and its scaled gradient in f64 (reference).
fn softmax_ce_ref(
    logits: &[f32],
    targets: &[u32],
    rows: usize,
    v: usize,
    scale: f32,
) -> (Vec<f32>, Vec<f32>) {
    let mut losses = vec![0.0f32; rows];
    let mut grad = vec![0.0f32; rows * v];
    for i in 0..rows {
        let row = &logits[i * v..(i + 1) * v];
        let t = targets[i];
        if t as usize >= v {
            continue;
        }
        let mx = row.iter().fold(f64::MIN, |m, &x| m.max(x as f64));
        let sum: f64 = row.iter().map(|&x| (x as f64 - mx).exp()).sum();
        losses[i] = (-(row[t as usize] as f64 - mx - sum.ln())) as f32;
        for j in 0..v {
            let p = (row[j] as f64 - mx).exp() / sum;
            let oh = if j == t as usize { 1.0 } else { 0.0 };
            grad[i * v + j] = ((p - oh) * scale as f64) as f32;
        }
    }
    (losses, grad)
}

/// LayerNorm forward (f32 in, bf16 out) and backward at `n` rows of `c`
/// against the CPU engine; the backward's recomputed output must equal the
/// forward's bit for bit.
fn check_layernorm(
    device: &Device,
    mk: &MixedKernels,
    s: &Stream,
    r: &mut Rng,
    n: usize,
    c: usize,
) -> Result<Vec<KernelCheck>> {
    let mut out = Vec::new();
    let shape = format!("N={n} C={c}");
    let x = randn(r, n * c, 2.0);
    let (w, bb) = (randn(r, c, 1.0), randn(r, c, 1.0));
    let (mut co, mut cm, mut cr) = (vec![0.0f32; n * c], vec![0.0f32; n], vec![0.0f32; n]);
    cpu::norm::layernorm_forward(&mut co, &mut cm, &mut cr, &x, &w, &bb, c);
    let (gx, gw, gb) = (up(device, &x)?, up(device, &w)?, up(device, &bb)?);
    let mut go = DeviceBuffer::<bf16>::zeros(device, n * c)?;
    let (mut gm, mut gr) = (
        DeviceBuffer::zeros(device, n)?,
        DeviceBuffer::zeros(device, n)?,
    );
    mk.layernorm_forward(s, &mut go, &mut gm, &mut gr, &gx, &gw, &gb, n, c)?;
    s.synchronize()?;
    out.push(check(
        "layernorm_forward (bf16)",
        shape.clone(),
        rel_err(&down_bf(&go)?, &co),
        BF16_OUT,
    ));
    let dout = randn(r, n * c, 1.0);
    let base = randn(r, n * c, 1.0);
    let (mut cdi, mut cdw, mut cdb) = (vec![0.0f32; n * c], vec![0.0f32; c], vec![0.0f32; c]);
    cpu::norm::layernorm_backward(&mut cdi, &mut cdw, &mut cdb, &dout, &x, &w, &cm, &cr, c);
    let cres: Vec<f32> = cdi.iter().zip(&base).map(|(a, b)| a + b).collect();
    let mut gres = up(device, &base)?;
    let mut gres_bf = DeviceBuffer::<bf16>::zeros(device, n * c)?;
    let mut gln = DeviceBuffer::<bf16>::zeros(device, n * c)?;
    let (mut gdw, mut gdb) = (
        DeviceBuffer::zeros(device, c)?,
        DeviceBuffer::zeros(device, c)?,
    );
    let mut partial = DeviceBuffer::zeros(device, MixedKernels::partial_len(n, c, 3))?;
    let gdout = up_bf(device, &dout)?;
    // The column sums of the updated dres (the next bias gradient), added
    // to a nonzero start.
    let next0 = randn(r, c, 1.0);
    let mut gnext = up(device, &next0)?;
    let mut cnext = next0.clone();
    for (i, v) in cres.iter().enumerate() {
        cnext[i % c] += v;
    }
    mk.layernorm_backward(
        s,
        &mut gres,
        &mut gres_bf,
        Some(&mut gln),
        &mut gdw,
        &mut gdb,
        Some(&mut gnext),
        &mut partial,
        &gdout,
        &gx,
        &gw,
        &gb,
        &gm,
        &gr,
        n,
        c,
    )?;
    s.synchronize()?;
    let e = rel_err(&gres.to_vec()?, &cres)
        .max(rel_err(&gdw.to_vec()?, &cdw))
        .max(rel_err(&gdb.to_vec()?, &cdb))
        .max(rel_err(&gnext.to_vec()?, &cnext));
    out.push(check(
        "layernorm_backward + next bias grad",
        shape.clone(),
        e,
        F32_OUT,
    ));
    out.push(check(
        "layernorm_backward bf16 copy",
        shape.clone(),
        rel_err(&down_bf(&gres_bf)?, &cres),
        BF16_OUT,
    ));
    // A model's bottom layer: no bias gradient below to fold in (the
    // partial rows are still the kernel's full width).
    let mut gres = up(device, &base)?;
    let (mut gdw, mut gdb) = (
        DeviceBuffer::zeros(device, c)?,
        DeviceBuffer::zeros(device, c)?,
    );
    mk.layernorm_backward(
        s,
        &mut gres,
        &mut gres_bf,
        None,
        &mut gdw,
        &mut gdb,
        None,
        &mut partial,
        &gdout,
        &gx,
        &gw,
        &gb,
        &gm,
        &gr,
        n,
        c,
    )?;
    s.synchronize()?;
    let e = rel_err(&gres.to_vec()?, &cres)
        .max(rel_err(&gdw.to_vec()?, &cdw))
        .max(rel_err(&gdb.to_vec()?, &cdb));
    out.push(check(
        "layernorm_backward, no next bias grad",
        shape.clone(),
        e,
        F32_OUT,
    ));
    // Bit for bit: any difference counts fully.
    let (fwd, again) = (go.to_vec()?, gln.to_vec()?);
    let differ = fwd
        .iter()
        .zip(&again)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count();
    out.push(check(
        "layernorm_backward recomputed output",
        shape,
        differ as f64,
        0.0,
    ));
    Ok(out)
}
