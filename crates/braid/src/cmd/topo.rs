//! `braid topo`: this host's GPUs and the links between them (NVML), then
//! measured copy bandwidth and latency between every pair and to the host.

use clap::Args;

/// GPU topology from NVML.
#[derive(Args)]
#[command(
    about = "Show this host's GPUs (name, memory, PCI, NUMA, CPU affinity), their NVLink/PCIe links, and measured copy bandwidth/latency",
    after_help = "Examples:\n  braid topo\n  braid topo --no-measure\n  braid topo --bytes 256M --json topo.json"
)]
pub struct TopoArgs {
    /// The topology (and measurements) as JSON.
    #[arg(long, value_name = "FILE", num_args = 0..=1, default_missing_value = "-",
          value_parser = super::json_out::parse, help = super::json_out::HELP)]
    json: Option<super::json_out::JsonOut>,
    /// Only list GPUs and links; skip the bandwidth and latency measurements.
    #[arg(long)]
    no_measure: bool,
    /// Bytes per bandwidth copy (K, M, G suffixes).
    #[arg(long, default_value = "64M", value_parser = parse_bytes)]
    bytes: usize,
    /// Timed copies per bandwidth figure.
    #[arg(long, default_value_t = 10)]
    reps: usize,
}

fn parse_bytes(s: &str) -> Result<usize, String> {
    match super::bench::parse_size(s)? {
        0 => Err(format!("{s:?}: the size must be positive")),
        n => Ok(n),
    }
}

/// Runs `braid topo`; exits 1 with the reason when no GPU can be seen.
pub fn run(args: TopoArgs) -> Result<i32, String> {
    // The flags first, on any machine.
    if args.reps == 0 {
        return Err("--reps 0: each figure needs at least 1 timed copy (default 10)".into());
    }
    if let Some(j) = &args.json {
        j.check()?;
        j.claim_stdout()?;
    }
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
    let mut measured = None;
    if !args.no_measure {
        match measure(&args) {
            Ok(m) => {
                print!("{}", braid_cuda::bandwidth::render(&m));
                measured = Some(m);
            }
            Err(e) => {
                eprintln!("braid topo: cannot measure copies: {e}");
                return Ok(1);
            }
        }
    }
    if let Some(out) = args.json {
        let mut value = serde_json::to_value(&topology).map_err(|e| e.to_string())?;
        if let (Some(m), Some(obj)) = (&measured, value.as_object_mut()) {
            obj.insert(
                "measured".into(),
                serde_json::to_value(m).map_err(|e| e.to_string())?,
            );
        }
        let text = serde_json::to_string_pretty(&value).map_err(|e| e.to_string())?;
        out.write(&text)?;
    }
    Ok(0)
}

fn measure(args: &TopoArgs) -> braid_cuda::Result<braid_cuda::bandwidth::Measured> {
    let n = braid_cuda::device_count()?;
    let devices = (0..n)
        .map(braid_cuda::Device::open)
        .collect::<braid_cuda::Result<Vec<_>>>()?;
    eprintln!(
        "measuring copies between {n} GPU(s): {} x {} per figure ...",
        braid_core::words::bytes(args.bytes as u64),
        args.reps
    );
    let opts = braid_cuda::bandwidth::MeasureOptions {
        bytes: args.bytes,
        reps: args.reps,
        ..Default::default()
    };
    braid_cuda::bandwidth::measure(&devices, &opts)
}
