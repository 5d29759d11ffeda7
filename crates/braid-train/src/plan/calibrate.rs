//! `braid plan calibrate`'s arithmetic: from the times of the kernels a
//! training step runs on the machine at hand (products by shape, the
//! fused attention, a device copy, the host's optimizer), the fields of a
//! [`Hardware`] description that the cost model reads — so a prediction
//! rests on this machine's rates, not on figures read elsewhere. Which
//! shapes to time ([`product_shapes`], [`attention_shapes`]), the fits
//! ([`calibrated`]) and the host's update rate ([`host_update_gbps`]).
//! The GPU's timings come from `braid_model::cuda::rates`.

use super::hardware::{AttentionRate, Hardware, ProductRate};
use crate::engine::UpdateStep;
use crate::engines::offload::update::HostUpdate;
use braid_model::optim::AdamWConfig;
use braid_model::{GptConfig, Layout};
use half::bf16;
use std::time::Instant;

/// Widths of the models whose products are timed: GPT-2 124M, 1558M,
/// the 2.65B (`L32-H32-C2560`) and 12.85B (`L40-H40-C5120`) widths.
pub const WIDTHS: [usize; 4] = [768, 1600, 2560, 5120];

/// The forward shapes `(tokens, in, out)` of one block's four products
/// (QKV, the attention's projection, the MLP's two) at each width and
/// token count: what the cost model asks the product rate of.
pub fn product_shapes(widths: &[usize], tokens: &[usize]) -> Vec<(usize, usize, usize)> {
    let mut out = Vec::new();
    for &c in widths {
        for &t in tokens {
            out.extend([(t, c, 3 * c), (t, c, c), (t, c, 4 * c), (t, 4 * c, c)]);
        }
    }
    out
}

/// The attention shapes timed: batch 8 of 1,024 tokens at each width,
/// with GPT-2's head size of 64 (124M, 1558M) or the width's own (80 at
/// 2.65B, 128 at 12.85B) — `(batch, tokens, width, heads)`.
pub fn attention_shapes() -> Vec<(usize, usize, usize, usize)> {
    vec![
        (8, 1024, 768, 12),
        (8, 1024, 1600, 25),
        (8, 1024, 2560, 32),
        (8, 1024, 5120, 40),
    ]
}

/// The FLOPs the cost model counts for a causal attention's forward pass
/// (half of 4 b s² C); its backward pass counts twice that.
pub fn attention_forward_flops(batch: usize, tokens: usize, width: usize) -> f64 {
    2.0 * (batch * tokens * tokens * width) as f64
}

/// The fused attention timed at one shape.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionTimed {
    pub width: usize,
    pub heads: usize,
    /// Forward FLOPs ([`attention_forward_flops`]).
    pub flops: f64,
    /// Seconds of the forward and backward passes together.
    pub seconds: f64,
}

/// What was timed on the machine.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Measured {
    /// Products: (FLOPs, seconds), every pass.
    pub products: Vec<(f64, f64)>,
    /// The same by shape, the three passes of each together (the
    /// description's table, [`Hardware::products`]).
    pub product_rates: Vec<ProductRate>,
    /// Attention by shape: forward FLOPs as [`attention_forward_flops`]
    /// counts them, seconds of the forward and backward passes together.
    pub attention: Vec<AttentionTimed>,
    /// A device-to-device copy's traffic, GB/s (read and write counted).
    pub hbm_gbps: f64,
    /// Memory of one GPU, GiB.
    pub memory_gib: f64,
    /// The host's AdamW over an offloaded optimizer, GB/s of traffic at
    /// 36 bytes a parameter (not timed: the base's figure stays).
    pub host_update_gbps: Option<f64>,
}

/// A calibrated description and how well its product curve fits.
#[derive(Debug, Clone, PartialEq)]
pub struct Calibration {
    pub hardware: Hardware,
    /// The largest relative error of the fitted product time against a
    /// timed product.
    pub product_fit_worst: f64,
}

/// Fits the product curve `t = f / (peak × e × f / (f + h))` — that is,
/// `t = a f + b` with `e = 1 / (a × peak)` and `h = b / a` — to the timed
/// products by least squares on relative error; `h` is held at 0 where
/// the free fit would make it negative. Returns `(e, h)`.
fn fit_products(points: &[(f64, f64)], peak_flops: f64) -> Result<(f64, f64), String> {
    if points.len() < 2 {
        return Err("calibration: fewer than two products timed".into());
    }
    if let Some((f, t)) = points
        .iter()
        .find(|(f, t)| !(f.is_finite() && t.is_finite() && *f > 0.0 && *t > 0.0))
    {
        return Err(format!(
            "calibration: a product of {f} FLOPs timed at {t} s: not a measurement"
        ));
    }
    // Weighted by 1/t², so that each point's relative error counts alike.
    let (mut sw, mut sf, mut st, mut sff, mut sft) = (0.0, 0.0, 0.0, 0.0, 0.0);
    for &(f, t) in points {
        let w = 1.0 / (t * t);
        sw += w;
        sf += w * f;
        st += w * t;
        sff += w * f * f;
        sft += w * f * t;
    }
    let det = sw * sff - sf * sf;
    let (mut a, mut b) = ((sw * sft - sf * st) / det, (sff * st - sf * sft) / det);
    if det.is_nan() || det <= 0.0 || b < 0.0 || a <= 0.0 {
        // Through the origin: no fixed cost.
        a = sft / sff;
        b = 0.0;
    }
    Ok((1.0 / (a * peak_flops), b / a))
}

/// `base` with the fields `m` measured, named `name`, its product peak
/// `peak_tflops` (a bf16 tensor-core peak is a datasheet figure, not a
/// measurement); the links stay the base's (one GPU cannot time them).
/// Errors where a measurement is missing or impossible (a rate above the
/// peak: the peak given is too low).
pub fn calibrated(
    base: &Hardware,
    name: &str,
    peak_tflops: f64,
    m: &Measured,
) -> Result<Calibration, String> {
    let peak = peak_tflops * 1e12;
    let (gemm_efficiency, gemm_half_flops) = fit_products(&m.products, peak)?;
    if m.attention.is_empty() {
        return Err("calibration: no attention shape was timed".into());
    }
    let (flops, seconds) = m
        .attention
        .iter()
        .fold((0.0, 0.0), |(f, s), a| (f + 3.0 * a.flops, s + a.seconds));
    let attention_efficiency = flops / seconds / peak;
    let mut hardware = Hardware {
        name: name.to_string(),
        peak_tflops,
        gemm_efficiency,
        gemm_half_flops,
        attention_efficiency,
        memory_gib: m.memory_gib,
        hbm_gbps: m.hbm_gbps,
        host_update_gbps: m.host_update_gbps.unwrap_or(base.host_update_gbps),
        products: m.product_rates.clone(),
        attention: m
            .attention
            .iter()
            .map(|a| AttentionRate {
                width: a.width,
                heads: a.heads,
                efficiency: 3.0 * a.flops / a.seconds / peak,
            })
            .collect(),
        ..base.clone()
    };
    if gemm_efficiency > 1.0 || attention_efficiency > 1.0 {
        return Err(format!(
            "calibration: the products reached {:.0} % and the attention {:.0} % of the {} \
             TFLOP/s given as the peak: give the GPU's dense bf16 peak with --peak",
            100.0 * gemm_efficiency,
            100.0 * attention_efficiency,
            peak_tflops
        ));
    }
    hardware = hardware.checked()?;
    let product_fit_worst = m
        .products
        .iter()
        .map(|&(f, t)| (hardware.gemm_s(f) / t - 1.0).abs())
        .fold(0.0, f64::max);
    Ok(Calibration {
        hardware,
        product_fit_worst,
    })
}

/// The host's AdamW over an offloaded optimizer (`--offload optimizer`:
/// f32 master weights and moments, bf16 weights written back), timed over
/// a model of `width` × `layers`: GB/s of traffic at 36 bytes a
/// parameter, the figure [`Hardware::host_update_gbps`] holds. The best
/// of `rounds` updates after one warm-up.
pub fn host_update_gbps(layers: usize, width: usize, rounds: usize) -> Result<f64, String> {
    let cfg = GptConfig {
        n_layer: layers,
        n_embd: width,
        n_head: (width / 64).max(1),
        vocab_size: 50304,
        context: 1024,
    };
    let layout = Layout::new(&cfg);
    let n = layout.len;
    let master: Vec<f32> = (0..n).map(|i| ((i % 97) as f32 - 48.0) * 1e-3).collect();
    let grads: Vec<f32> = (0..n).map(|i| ((i % 89) as f32 - 44.0) * 1e-4).collect();
    let mut weights = vec![bf16::ZERO; n];
    let mut update = HostUpdate::new(&layout, master, AdamWConfig::default())?;
    let step = UpdateStep {
        lr: 1e-4,
        step: 1,
        grad_scale: 1.0,
    };
    update.step(&grads, &mut weights, step)?;
    let mut best = f64::INFINITY;
    for _ in 0..rounds.max(1) {
        let t = Instant::now();
        update.step(&grads, &mut weights, step)?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(36.0 * n as f64 / best / 1e9)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The built-in `name` with its measured tables taken out: the curve
    /// and the one attention efficiency alone, what these tests correct.
    fn curve_only(name: &str) -> Hardware {
        let mut h = Hardware::builtin(name).unwrap();
        h.products.clear();
        h.attention.clear();
        h
    }

    /// Timings made from a known description, calibrated back.
    fn timed_by(hw: &Hardware) -> Measured {
        let products = product_shapes(&WIDTHS, &[1024, 8192])
            .iter()
            .map(|&(t, i, o)| {
                let f = 2.0 * (t * i * o) as f64;
                (f, hw.gemm_s(f))
            })
            .collect();
        let attention = attention_shapes()
            .iter()
            .map(|&(b, t, c, nh)| {
                let f = attention_forward_flops(b, t, c);
                AttentionTimed {
                    width: c,
                    heads: nh,
                    flops: f,
                    seconds: 3.0 * f / (hw.peak_tflops * 1e12 * hw.attention_efficiency),
                }
            })
            .collect();
        Measured {
            products,
            product_rates: Vec::new(),
            attention,
            hbm_gbps: hw.hbm_gbps,
            memory_gib: hw.memory_gib,
            host_update_gbps: None,
        }
    }

    #[test]
    fn timings_made_from_a_description_give_it_back() {
        let h100 = curve_only("h100");
        let c = calibrated(&h100, "here", h100.peak_tflops, &timed_by(&h100)).unwrap();
        let h = &c.hardware;
        assert!((h.gemm_efficiency / h100.gemm_efficiency - 1.0).abs() < 1e-9);
        assert!((h.gemm_half_flops / h100.gemm_half_flops - 1.0).abs() < 1e-6);
        assert!((h.attention_efficiency / h100.attention_efficiency - 1.0).abs() < 1e-9);
        assert!(c.product_fit_worst < 1e-9);
        assert_eq!(
            (h.name.as_str(), h.intra, h.gpus_per_node),
            ("here", h100.intra, 8)
        );
    }

    #[test]
    fn noisy_products_fit_within_their_noise_and_no_fixed_cost_goes_negative() {
        let h100 = curve_only("h100");
        let mut m = timed_by(&h100);
        for (i, p) in m.products.iter_mut().enumerate() {
            p.1 *= if i % 2 == 0 { 1.03 } else { 0.97 };
        }
        let c = calibrated(&h100, "noisy", 989.0, &m).unwrap();
        assert!(c.product_fit_worst < 0.07, "{}", c.product_fit_worst);
        // Products whose time grows slower than their FLOPs (a fit with a
        // negative fixed cost) are fitted through the origin instead.
        m.products = vec![(1e9, 1e-6), (1e12, 2e-3)];
        let c = calibrated(&h100, "origin", 989.0, &m).unwrap();
        assert_eq!(c.hardware.gemm_half_flops, 0.0);
    }

    /// The attention's rate by shape travels into the description; a
    /// model's attention runs at the measured shape nearest its head size,
    /// then its width; without a table, at the one efficiency; a file
    /// keeps the table and a bad rate is refused.
    #[test]
    fn attention_rates_by_shape_pick_the_nearest_head_size() {
        let h100 = curve_only("h100");
        let mut m = timed_by(&h100);
        // Head size 80 (2.65B's) timed at half the rate of the others.
        for a in m.attention.iter_mut().filter(|a| a.width == 2560) {
            a.seconds *= 2.0;
        }
        let h = calibrated(&h100, "attn", 989.0, &m).unwrap().hardware;
        assert_eq!(h.attention.len(), 4);
        let e = h100.attention_efficiency;
        let at = |c, nh| h.attention_efficiency_at(c, nh);
        assert!((at(2560, 32) - e / 2.0).abs() < 1e-12); // measured: 80
        assert!((at(5120, 64) - e / 2.0).abs() < 1e-12); // head size 80 too
        assert!((at(768, 12) - e).abs() < 1e-12); // 64
        assert!((at(2048, 16) - e).abs() < 1e-12); // 128 (12.85B's measured)
        assert!((at(1024, 16) - e).abs() < 1e-12); // 64, nearest width 768
                                                   // The average of the table is what the one efficiency says.
        assert!(h.attention_efficiency < e && h.attention_efficiency > e / 2.0);
        assert_eq!(h100.attention_efficiency_at(2560, 32), e);
        let back: Hardware = serde_json::from_str(&serde_json::to_string(&h).unwrap()).unwrap();
        assert_eq!(back.checked().unwrap(), h);
        let mut bad = h.clone();
        bad.attention[0].efficiency = 1.5;
        assert!(bad.checked().unwrap_err().contains("attention rate"));
    }

    /// The rates measured by shape travel into the description, and a
    /// product's time follows the nearest measured shape: exactly at a
    /// measured one, the curve scaled by its ratio at others, the curve
    /// alone without any.
    #[test]
    fn product_rates_by_shape_correct_the_curve() {
        let h100 = curve_only("h100");
        let mut m = timed_by(&h100);
        // 8192 x 1600 x 4800 measured at 400 TFLOP/s, 2048 x 768 x 768 at 100.
        m.product_rates = vec![
            ProductRate {
                tokens: 8192,
                inputs: 1600,
                outputs: 4800,
                tflops: 400.0,
            },
            ProductRate {
                tokens: 2048,
                inputs: 768,
                outputs: 768,
                tflops: 100.0,
            },
        ];
        let h = calibrated(&h100, "shapes", 989.0, &m).unwrap().hardware;
        assert_eq!(h.products, m.product_rates);
        let f = 2.0 * 8192.0 * 1600.0 * 4800.0;
        assert!((h.product_s(8192.0, 1600.0, 4800.0) - f / 400e12).abs() < 1e-12);
        // Near the first: its ratio to the curve.
        let ratio = (f / 400e12) / h.gemm_s(f);
        let g = 2.0 * 8192.0 * 1600.0 * 6400.0;
        assert!((h.product_s(8192.0, 1600.0, 6400.0) / h.gemm_s(g) - ratio).abs() < 1e-9);
        // None measured: the curve.
        assert_eq!(h100.product_s(8192.0, 1600.0, 6400.0), h100.gemm_s(g));
        // A description file keeps the table; a rate of 0 is refused.
        let text = serde_json::to_string(&h).unwrap();
        let back: Hardware = serde_json::from_str(&text).unwrap();
        assert_eq!(back.checked().unwrap(), h);
        let mut bad = h.clone();
        bad.products[1].tflops = 0.0;
        assert!(bad.checked().unwrap_err().contains("product rate"));
    }

    #[test]
    fn impossible_timings_are_refused_with_what_to_do() {
        let h100 = curve_only("h100");
        let m = timed_by(&h100);
        let e = calibrated(&h100, "x", 100.0, &m).unwrap_err();
        assert!(e.contains("--peak"), "{e}");
        let mut bad = m.clone();
        bad.products.truncate(1);
        assert!(calibrated(&h100, "x", 989.0, &bad)
            .unwrap_err()
            .contains("fewer than two"));
        let mut bad = m.clone();
        bad.products[0].1 = 0.0;
        assert!(calibrated(&h100, "x", 989.0, &bad)
            .unwrap_err()
            .contains("not a measurement"));
        let mut bad = m;
        bad.attention.clear();
        assert!(calibrated(&h100, "x", 989.0, &bad)
            .unwrap_err()
            .contains("attention"));
    }

    #[test]
    fn the_hosts_update_is_timed() {
        let gbps = host_update_gbps(1, 128, 1).unwrap();
        assert!(gbps.is_finite() && gbps > 0.0, "{gbps}");
    }
}
