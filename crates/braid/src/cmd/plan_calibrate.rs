//! `braid plan calibrate`: times the kernels a training step runs on this
//! machine's GPU (braid-model's `cuda::rates`: the block's products at
//! the widths of 124M to 12.85B, the fused attention, a device copy) and
//! the host's offloaded AdamW, fits the planner's hardware description
//! to them (`braid_train::plan::calibrate`) and writes it as a JSON file
//! that `braid plan --hardware FILE` reads. The links between GPUs stay
//! those of the base description: one GPU cannot time them (`braid bench
//! --device cuda` can, on several).

use braid_model::cpu::attention::AttnShape;
use braid_model::cuda::rates;
use braid_train::plan::calibrate::{
    attention_forward_flops, attention_shapes, calibrated, host_update_gbps, product_shapes,
    AttentionTimed, Measured, WIDTHS,
};
use braid_train::plan::{Hardware, ProductRate};
use clap::Args;
use std::path::PathBuf;

/// Time this machine's kernels and write a hardware description.
#[derive(Args)]
#[command(
    about = "Time this GPU's products, attention, memory and the host's optimizer, and write a hardware description for braid plan",
    after_help = "Examples:
  braid plan calibrate                          # writes calibrated.json
  braid plan calibrate --out h200-here.json --name h200-here
  braid plan --model 1558M --gpus 1 --global-batch 8 --hardware h200-here.json"
)]
pub struct CalibrateArgs {
    /// Where the description goes.
    #[arg(long, default_value = "calibrated.json")]
    out: PathBuf,
    /// Its short name (default: the base's, with "-calibrated").
    #[arg(long)]
    name: Option<String>,
    /// What is not timed here (the links, GPUs per node) comes from this
    /// description: h100, h200, a100 or a file (default: the one the
    /// GPU's name matches, else h100).
    #[arg(long)]
    base: Option<String>,
    /// The GPU's dense bf16 tensor-core peak, TFLOP/s (default: the
    /// base's).
    #[arg(long)]
    peak: Option<f64>,
    /// Fewer shapes (one token count, two widths): a rougher fit in
    /// seconds.
    #[arg(long)]
    quick: bool,
}

/// The built-in description a GPU's name matches.
fn base_for(gpu: &str) -> &'static str {
    let g = gpu.to_ascii_uppercase();
    if g.contains("H200") {
        "h200"
    } else if g.contains("A100") {
        "a100"
    } else {
        "h100"
    }
}

/// Runs `braid plan calibrate`.
pub fn run(a: CalibrateArgs) -> Result<i32, String> {
    if let Some(p) = a.peak {
        if !(p.is_finite() && p > 0.0) {
            return Err(format!(
                "--peak {p}: give the GPU's bf16 peak in TFLOP/s, above 0"
            ));
        }
    }
    let gpus = braid_cuda::device_count().map_err(|e| {
        format!(
            "braid plan calibrate times this machine's GPU kernels, and no GPU can be used here \
             ({e}); on a machine without one, give braid plan a built-in --hardware (h100, h200, \
             a100) or a file of its fields"
        )
    })?;
    if gpus == 0 {
        return Err("braid plan calibrate times this machine's GPU kernels: no GPU found".into());
    }
    let gpu = braid_core::world::local_rank_from_env().unwrap_or(0);
    if gpu >= gpus {
        return Err(format!(
            "LOCAL_RANK={gpu} asks for GPU {gpu}, and this machine shows {gpus}"
        ));
    }
    let cuda = |e: braid_cuda::CudaError| format!("GPU {gpu}: {e}");
    let device = braid_cuda::Device::open(gpu).map_err(cuda)?;
    let gpu_name = device.name().map_err(cuda)?;
    let base_name = a
        .base
        .clone()
        .unwrap_or_else(|| base_for(&gpu_name).to_string());
    let base = Hardware::named_or_file(&base_name)?;
    let peak = a.peak.unwrap_or(base.peak_tflops);
    let name = a
        .name
        .clone()
        .unwrap_or_else(|| format!("{}-calibrated", base.name));
    println!("calibrating on GPU {gpu} ({gpu_name}), base {base_name}, peak {peak} TFLOP/s");

    let (widths, tokens): (&[usize], &[usize]) = match a.quick {
        true => (&WIDTHS[..2], &[2048]),
        false => (&WIDTHS, &[2048, 8192, 16384]),
    };
    let shapes = product_shapes(widths, tokens);
    println!("  products: {} shapes x 3 passes ...", shapes.len());
    let timed = rates::products(&device, &shapes, 10).map_err(cuda)?;
    let products: Vec<(f64, f64)> = timed.iter().map(|p| (p.flops(), p.seconds)).collect();
    // Each shape's three passes (forward, then its two gradients) together.
    let product_rates = shapes
        .iter()
        .zip(timed.chunks(3))
        .map(|(&(tokens, inputs, outputs), passes)| {
            let flops: f64 = passes.iter().map(|p| p.flops()).sum();
            let seconds: f64 = passes.iter().map(|p| p.seconds).sum();
            ProductRate {
                tokens,
                inputs,
                outputs,
                tflops: flops / seconds / 1e12,
            }
        })
        .collect();

    let attn: Vec<AttnShape> = attention_shapes()
        .into_iter()
        .filter(|s| widths.contains(&s.2))
        .map(|(b, t, c, nh)| AttnShape { b, t, c, nh })
        .collect();
    println!(
        "  attention: {} shapes, forward and backward ...",
        attn.len()
    );
    let attention = rates::attention(&device, &attn, 5)
        .map_err(cuda)?
        .iter()
        .map(|t| {
            let s = t.shape;
            AttentionTimed {
                width: s.c,
                heads: s.nh,
                flops: attention_forward_flops(s.b, s.t, s.c),
                seconds: t.forward_s + t.backward_s,
            }
        })
        .collect();
    println!("  memory bandwidth (a 1 GiB device copy) ...");
    let hbm_gbps = rates::copy_gbps(&device, 1 << 30, 20).map_err(cuda)?;
    let memory_gib = device.total_memory().map_err(cuda)? as f64 / (1u64 << 30) as f64;
    println!("  the host's offloaded AdamW (a 1558M-wide model of 8 layers) ...");
    let host = host_update_gbps(8, 1600, 3)?;
    let m = Measured {
        products,
        product_rates,
        attention,
        hbm_gbps,
        memory_gib,
        host_update_gbps: Some(host),
    };
    let c = calibrated(&base, &name, peak, &m)?;
    let h = &c.hardware;
    println!();
    println!("  {:<22} {:>12} {:>12}", "", base.name, h.name);
    let rows = [
        (
            "products, of peak",
            base.gemm_efficiency,
            h.gemm_efficiency,
            100.0,
            "%",
        ),
        (
            "half rate at, GFLOP",
            base.gemm_half_flops,
            h.gemm_half_flops,
            1e-9,
            "",
        ),
        (
            "attention, of peak",
            base.attention_efficiency,
            h.attention_efficiency,
            100.0,
            "%",
        ),
        ("memory, GB/s", base.hbm_gbps, h.hbm_gbps, 1.0, ""),
        ("memory, GiB", base.memory_gib, h.memory_gib, 1.0, ""),
        (
            "host AdamW, GB/s",
            base.host_update_gbps,
            h.host_update_gbps,
            1.0,
            "",
        ),
    ];
    for (what, b, n, scale, unit) in rows {
        println!(
            "  {what:<22} {:>11.1}{unit:<1} {:>11.1}{unit:<1}",
            b * scale,
            n * scale
        );
    }
    println!(
        "  the product curve fits every timed product within {:.1} %, and the {} shapes' own \
         rates correct it (the description's table); links kept from {}",
        100.0 * c.product_fit_worst,
        h.products.len(),
        base.name
    );
    let text = serde_json::to_string_pretty(h).map_err(|e| e.to_string())?;
    std::fs::write(&a.out, text + "\n")
        .map_err(|e| format!("--out {}: could not be written ({e})", a.out.display()))?;
    println!(
        "wrote {} (use it with braid plan --hardware {})",
        a.out.display(),
        a.out.display()
    );
    Ok(0)
}
