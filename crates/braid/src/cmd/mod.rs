//! The subcommands of `braid`, one module each.

pub mod bench;
pub mod bench_gpu;
pub mod ckpt;
pub mod data;
pub mod data_load;
pub mod doctor;
pub mod generate;
pub mod kernels;
pub mod launch;
pub mod preflight;
pub mod report;
pub mod report_html;
pub mod scale;
pub mod store;
pub mod svg;
pub mod topo;
pub mod train;
pub mod train_ckpt;
pub mod train_output;
pub mod train_strategy;
pub mod train_trace;
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
