//! `braid topo`: this host's GPUs and the links between them.

use clap::Args;

/// GPU topology from NVML.
#[derive(Args)]
#[command(
    about = "Show this host's GPUs (name, memory, PCI, NUMA, CPU affinity) and their NVLink/PCIe links",
    after_help = "Examples:\n  braid topo\n  braid topo --json topo.json"
)]
pub struct TopoArgs {
    /// Also write the topology as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    json: Option<std::path::PathBuf>,
}

/// Runs `braid topo`; exits 1 with the reason when no GPU can be seen.
pub fn run(args: TopoArgs) -> Result<i32, String> {
    let topology = match braid_cuda::topo::discover() {
        Ok(t) => t,
        Err(e) => {
            eprintln!("braid topo: {e}. GPU collectives are unavailable here; the CPU backends (shm, tcp) work.");
            return Ok(1);
        }
    };
    if topology.gpus.is_empty() {
        eprintln!("braid topo: the NVIDIA driver is loaded but reports no GPU.");
        return Ok(1);
    }
    print!("{}", braid_cuda::topo::render(&topology));
    if let Some(path) = args.json {
        let text = serde_json::to_string_pretty(&topology).map_err(|e| e.to_string())?;
        std::fs::write(&path, text).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    }
    Ok(0)
}
