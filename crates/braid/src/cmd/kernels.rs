//! `braid kernels`: the training engine's CUDA kernels — compile them to
//! PTX (no GPU needed, only NVRTC), or check each against the CPU engine
//! on a GPU.

use clap::Args;

/// Compile or check the CUDA kernels.
#[derive(Args)]
#[command(
    about = "Compile the model's CUDA kernels with NVRTC, or check them against the CPU engine on a GPU",
    after_help = "Examples:\n  braid kernels --ptx compute_90     # compile only (CI; needs libnvrtc.so.13)\n  braid kernels --check              # on a GPU: every kernel vs the CPU kernels"
)]
pub struct KernelsArgs {
    /// Compile every kernel source to PTX for this virtual architecture.
    #[arg(long, value_name = "ARCH")]
    ptx: Option<String>,
    /// Run every kernel on GPU 0 and compare it with the CPU engine.
    #[arg(long)]
    check: bool,
}

/// Checks `--ptx`'s architecture's form (`compute_90`, `compute_90a`, ...)
/// before NVRTC is loaded, so that a typo is named on any machine.
fn arch_checked(arch: &str) -> Result<(), String> {
    let number = |prefix: &str| {
        arch.strip_prefix(prefix)
            .map(|n| n.trim_end_matches(|c: char| c.is_ascii_lowercase()))
            .filter(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
    };
    if number("sm_").is_some() {
        return Err(format!(
            "--ptx {arch}: a real architecture (machine code); PTX is made for a virtual one: \
             --ptx compute_{}",
            &arch["sm_".len()..]
        ));
    }
    match number("compute_") {
        Some(_) => Ok(()),
        None => Err(format!(
            "--ptx {arch}: expected a GPU architecture as NVRTC names it: compute_ and the compute \
             capability without its dot, e.g. compute_90 (H100), compute_80 (A100), compute_90a"
        )),
    }
}

/// Runs `braid kernels`.
pub fn run(a: KernelsArgs) -> Result<i32, String> {
    if a.ptx.is_none() && !a.check {
        return Err("nothing to do: pass --ptx ARCH and/or --check".into());
    }
    if let Some(arch) = &a.ptx {
        arch_checked(arch)?;
    }
    if let Some(arch) = &a.ptx {
        let t = std::time::Instant::now();
        let mut done = braid_model::cuda::compile_all(arch).map_err(|e| e.to_string())?;
        done.extend(braid_train::cuda::compile_all(arch).map_err(|e| e.to_string())?);
        for (name, bytes) in &done {
            println!("{name}.cu -> {bytes} bytes of PTX for {arch}");
        }
        let hopper = braid_model::cuda::compile_hopper().map_err(|e| e.to_string())?;
        let harch = braid_model::cuda::flash::HOPPER_ARCH;
        println!("flash.cu + flash_wgmma.cu -> {hopper} bytes of PTX for {harch} (compute capability 9.0's attention)");
        let (maj, min) = braid_cuda::nvrtc::version().map_err(|e| e.to_string())?;
        println!(
            "every kernel compiles (NVRTC {maj}.{min}, {:.1?})",
            t.elapsed()
        );
    }
    if a.check {
        let device = braid_cuda::Device::open(0).map_err(|e| e.to_string())?;
        let mut results = braid_model::cuda::check::run(&device).map_err(|e| e.to_string())?;
        results.extend(braid_model::cuda::check_mixed::run(&device).map_err(|e| e.to_string())?);
        results.extend(braid_train::cuda::check::run(&device).map_err(|e| e.to_string())?);
        let cc = device.compute_capability().map_err(|e| e.to_string())?;
        let (fwd, bwd) =
            braid_model::cuda::flash::Products::chosen(cc).map_err(|e| e.to_string())?;
        let mut bad = 0;
        for r in &results {
            println!(
                "{:<36} {:<36} max rel err {:>9.2e} (bound {:.0e}) {}",
                r.name,
                r.shape,
                r.error,
                r.bound,
                if r.ok() { "ok" } else { "FAIL" }
            );
            bad += usize::from(!r.ok());
        }
        println!(
            "{} of {} kernels within their bounds on {} (attention's products: forward {}, backward {})",
            results.len() - bad,
            results.len(),
            device.name().unwrap_or_default(),
            fwd.name(),
            bwd.name()
        );
        if bad > 0 {
            return Ok(1);
        }
    }
    Ok(0)
}
