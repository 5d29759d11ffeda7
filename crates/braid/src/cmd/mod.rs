//! The subcommands of `braid`, one module each.

pub mod bench;
pub mod bench_gpu;
pub mod bench_serve;
pub mod ckpt;
pub mod data;
pub mod data_load;
pub mod doctor;
pub mod generate;
pub mod json_out;
pub mod kernels;
pub mod launch;
pub mod plan;
pub mod plan_calibrate;
pub mod plot;
pub mod preflight;
#[cfg(test)]
mod preflight_plan_tests;
pub mod progress;
pub mod report;
pub mod report_html;
pub mod scale;
pub mod serve;
mod serve_tp;
pub mod store;
pub mod svg;
pub mod topo;
pub mod train;
pub mod train_banner;
pub mod train_check;
pub mod train_ckpt;
pub mod train_cpu_run;
pub mod train_gpu_run;
pub mod train_layout;
pub mod train_mesh;
pub mod train_model;
pub mod train_output;
pub mod train_params;
pub mod train_pipeline;
pub mod train_pipeline_run;
pub mod train_place;
pub mod train_plan;
pub mod train_ps;
pub mod train_ps_restart;
pub mod train_relaunch;
pub mod train_setup;
pub mod train_strategy;
pub mod train_summary;
pub mod train_trace;
pub mod unknown_flag;
pub mod verify;
pub mod verify_gpu;
pub mod workers;

/// Parses a positive number of seconds (`30`, `2.5`) into a duration.
pub fn parse_seconds(s: &str) -> Result<std::time::Duration, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(std::time::Duration::from_secs_f64(v)),
        _ => Err(format!("{s:?} is not a number of seconds")),
    }
}

/// Parses `--device`: `Ok(false)` for cpu, `Ok(true)` for cuda (or gpu).
pub fn wants_cuda(device: &str) -> Result<bool, String> {
    match device {
        "cpu" => Ok(false),
        "cuda" | "gpu" => Ok(true),
        other => Err(format!("--device {other:?}: expected cpu or cuda")),
    }
}

/// The GPUs `--device DEVICE` (cuda or gpu) may use here, or an error
/// pointing at `--device cpu` on a machine without one. Called where the
/// GPUs are first needed, after the flags are checked (so that a bad flag
/// is named on any machine).
pub fn gpus_for(device: &str) -> Result<usize, String> {
    let why = match braid_cuda::device_count() {
        Ok(0) => "the driver shows no GPU".to_string(),
        Ok(n) => return Ok(n),
        Err(e) => e.to_string(),
    };
    Err(format!(
        "--device {device}: no GPU to use here ({why}); --device cpu runs on the CPU"
    ))
}

/// Where a command runs, `--device auto|cpu|cuda` resolved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Device {
    /// On GPUs.
    pub cuda: bool,
    /// With `auto`: what was chosen and why, to say at start.
    pub chosen: Option<String>,
}

impl Device {
    /// Resolves `--device` for `workers` processes on this node (one GPU
    /// each): `auto` takes the GPUs when there are enough of them.
    pub fn resolve(device: &str, workers: usize) -> Result<Device, String> {
        if device != "auto" {
            let cuda = wants_cuda(device)
                .map_err(|_| format!("--device {device:?}: expected auto, cpu or cuda"))?;
            return Ok(Device { cuda, chosen: None });
        }
        let gpus = braid_cuda::device_count().unwrap_or(0);
        let (cuda, why) = match gpus {
            0 => (false, "no GPU here".to_string()),
            g if g < workers => (
                false,
                format!("{g} GPU(s) here, fewer than the {workers} workers; --device cuda with fewer workers uses them"),
            ),
            g => (true, format!("{g} GPU(s) here; --device cpu trains on the CPU")),
        };
        Ok(Device {
            cuda,
            chosen: Some(format!(
                "device: {} (--device auto: {why})",
                if cuda { "cuda" } else { "cpu" }
            )),
        })
    }
}

/// A worker count as torchrun's `--nproc-per-node` takes it: a number, or
/// `auto` (the GPUs here, else the CPU cores), `gpu` (the GPUs) or `cpu`
/// (the cores).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Nproc {
    /// That many workers.
    Count(usize),
    /// One per GPU if there are GPUs, else one per core.
    Auto,
    /// One per GPU.
    Gpu,
    /// One per CPU core.
    Cpu,
}

/// Parses `--nproc-per-node`.
pub fn parse_nproc(s: &str) -> Result<Nproc, String> {
    match s.trim() {
        "auto" => Ok(Nproc::Auto),
        "gpu" => Ok(Nproc::Gpu),
        "cpu" => Ok(Nproc::Cpu),
        n => match n.parse::<usize>() {
            Ok(0) => Err("0 workers: use at least 1".into()),
            Ok(v) => Ok(Nproc::Count(v)),
            Err(_) => Err(format!(
                "{s:?}: expected a number of workers, or auto, gpu or cpu"
            )),
        },
    }
}

impl Nproc {
    /// The number of workers this means on this machine.
    pub fn count(self) -> Result<usize, String> {
        let cores = || std::thread::available_parallelism().map_or(1, |n| n.get());
        match self {
            Nproc::Count(n) => Ok(n),
            Nproc::Cpu => Ok(cores()),
            Nproc::Gpu => match braid_cuda::device_count() {
                Ok(n) if n > 0 => Ok(n),
                Ok(_) => Err(
                    "--nproc-per-node gpu: this machine has no GPU (use a number, or cpu)".into(),
                ),
                Err(e) => Err(format!("--nproc-per-node gpu: {e}")),
            },
            Nproc::Auto => Ok(match braid_cuda::device_count() {
                Ok(n) if n > 0 => n,
                _ => cores(),
            }),
        }
    }
}

/// The seed every command starts from unless told otherwise (`train`,
/// `data write`, `data load`, `generate`): one default, so that `braid
/// data write --tokens synthetic` writes the corpus `braid train --data
/// synthetic` trains on.
pub const DEFAULT_SEED: u64 = 1337;
