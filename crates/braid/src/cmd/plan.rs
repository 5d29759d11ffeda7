//! `braid plan`: the course's parallelism decision guide as a tool —
//! every layout braid can run for a model over some GPUs, its memory per
//! GPU and step time predicted by braid-train's planner
//! (`braid_train::plan`), ranked, with where the time goes and why the
//! others were refused.

use braid_model::GptConfig;
use braid_train::plan::{candidates, Candidate, Hardware, Workload};
use clap::Args;

/// Rank every layout of a model over some GPUs.
#[derive(Args)]
#[command(
    about = "Predict and rank every parallel layout of a model over some GPUs (memory, step time, where the time goes)",
    after_help = "Examples:
  braid plan --model 1558M --gpus 4 --global-batch 32 --seq 1024
  braid plan --model L40-H40-C5120 --gpus 8 --global-batch 16 --seq 1024 --hardware h200
  braid plan --model 1558M --gpus 16 --nodes 4 --global-batch 64 --seq 1024
  braid plan --model L96-H128-C16384-V51200 --gpus 1920 --global-batch 2160 --seq 2048 --hardware a100 --json plan.json
  braid plan calibrate --out here.json          # on a GPU: this machine's rates, for --hardware here.json",
    subcommand_negates_reqs = true,
    args_conflicts_with_subcommands = true
)]
pub struct PlanArgs {
    #[command(subcommand)]
    command: Option<PlanCommand>,
    /// The model: a named size (124M ... 1558M) or L<layers>-H<heads>-C<width>[-V<vocab>].
    #[arg(long, required = true)]
    model: Option<String>,
    /// GPUs in all.
    #[arg(long, required = true)]
    gpus: Option<usize>,
    /// Nodes they sit on, evenly (default: as many as the machine's GPUs
    /// per node make): which groups cross the inter-node link.
    #[arg(long)]
    nodes: Option<usize>,
    /// Sequences per step over every replica.
    #[arg(long, required = true)]
    global_batch: Option<usize>,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 1024)]
    seq: usize,
    /// Sequences per micro-batch (default: every power of two that divides a replica's batch).
    #[arg(long)]
    micro_batch: Option<usize>,
    /// The machine: h100, h200, a100, or a JSON file of the same fields.
    #[arg(long, default_value = "h100")]
    hardware: String,
    /// Layouts shown (fastest first).
    #[arg(long, default_value_t = 10)]
    top: usize,
    /// Every layout, predicted or refused, as JSON.
    #[arg(long, value_name = "FILE", num_args = 0..=1, default_missing_value = "-",
          value_parser = super::json_out::parse, help = super::json_out::HELP)]
    json: Option<super::json_out::JsonOut>,
}

/// What `braid plan` does besides ranking layouts.
#[derive(clap::Subcommand)]
enum PlanCommand {
    Calibrate(super::plan_calibrate::CalibrateArgs),
}

/// A layout in braid train's flags.
pub(super) fn flags(c: &Candidate) -> String {
    let l = &c.layout;
    let mut f = Vec::new();
    if l.tp > 1 {
        f.push(format!("--tp {}", l.tp));
    }
    if l.pp > 1 {
        f.push(format!("--pp {}", l.pp));
        if let Some(s) = &c.schedule {
            f.push(format!("--schedule {s}"));
        }
        f.push(format!("--micro-batches {}", l.micro_batches));
    }
    if l.zero > 0 {
        f.push(format!("--zero {}", l.zero));
    }
    if let Some(g) = l.shard_group {
        f.push(format!("--shard-group {g}"));
    }
    if l.offload {
        f.push("--offload optimizer".into());
    }
    if l.checkpointing {
        f.push("--checkpointing".into());
    }
    let replicas = match l.dp {
        1 => String::new(),
        d => format!("data {d} x "),
    };
    format!(
        "{replicas}batch {}{}: {}",
        l.micro_batch,
        if l.pp == 1 && l.micro_batches > 1 {
            format!(" --accum {}", l.micro_batches)
        } else {
            String::new()
        },
        if f.is_empty() {
            "(data parallel)".to_string()
        } else {
            f.join(" ")
        }
    )
}

/// The first choice's links: what each carries per step and the
/// bandwidth that keeps it hidden (capacity planning).
fn print_capacity(c: &Candidate) {
    if c.capacity.is_empty() {
        println!("  no traffic between GPUs (one GPU)");
        return;
    }
    println!(
        "  {:<8} {:>5}  {:<22} {:>10} {:>9} {:>12} {:>11}",
        "link", "ranks", "over", "per step", "at link", "hides under", "needs"
    );
    for d in &c.capacity {
        let over = format!(
            "{} {:.0} GB/s",
            if d.across_nodes {
                "inter-node"
            } else {
                "in-node"
            },
            d.link_gbps
        );
        let under = match d.dimension {
            "tensor" => "10 % compute".to_string(),
            _ => format!("{:.1} ms", 1e3 * d.window_s),
        };
        println!(
            "  {:<8} {:>5}  {:<22} {:>8.2}GB {:>7.1}ms {:>12} {:>6} GB/s{}",
            d.dimension,
            d.ranks,
            over,
            d.wire_bytes / 1e9,
            1e3 * d.seconds,
            under,
            match d.needed_gbps {
                g if g < 10.0 => format!("{g:.1}"),
                g => format!("{g:.0}"),
            },
            if d.enough { "" } else { "  (short: exposed)" }
        );
    }
}

/// Runs `braid plan`.
pub fn run(a: PlanArgs) -> Result<i32, String> {
    if let Some(PlanCommand::Calibrate(c)) = a.command {
        return super::plan_calibrate::run(c);
    }
    // (clap requires the three without a subcommand.)
    let (Some(model), Some(gpus), Some(global_batch)) = (&a.model, a.gpus, a.global_batch) else {
        return Err("braid plan needs --model, --gpus and --global-batch".into());
    };
    let cfg = GptConfig::parse(model)?;
    if gpus == 0 || global_batch == 0 || a.seq == 0 {
        return Err("--gpus, --global-batch and --seq must be at least 1".into());
    }
    if a.micro_batch == Some(0) {
        return Err("--micro-batch must be at least 1".into());
    }
    let mut hw = Hardware::named_or_file(&a.hardware)?;
    if let Some(k) = a.nodes {
        if k == 0 || gpus % k != 0 {
            return Err(format!(
                "--nodes {k}: the {} GPUs must split evenly over the nodes (give a --nodes that \
                 divides --gpus)",
                gpus
            ));
        }
        hw.gpus_per_node = gpus / k;
    }
    if let Some(j) = &a.json {
        j.check()?;
    }
    let w = Workload::of(&cfg, a.seq, global_batch);
    let all = candidates(&w, gpus, &hw, a.micro_batch);
    let json_only = a.json.as_ref().is_some_and(|j| j.is_stdout());
    if let Some(out) = &a.json {
        let doc = serde_json::json!({
            "model": model, "params": w.params(), "gpus": gpus, "global_batch": global_batch,
            "seq": a.seq, "hardware": hw, "layouts": all,
        });
        out.write(&serde_json::to_string_pretty(&doc).map_err(|e| e.to_string())?)?;
    }
    if json_only {
        return Ok(0);
    }
    let ok: Vec<&Candidate> = all.iter().filter(|c| c.prediction.is_some()).collect();
    let gib = |b: f64| b / (1u64 << 30) as f64;
    println!(
        "braid plan: {} ({:.2}B parameters), {} GPUs of {} ({} per node), global batch {} x {} tokens: {} layouts, {} that run",
        model,
        w.params() / 1e9,
        gpus,
        hw.name,
        hw.gpus_per_node,
        global_batch,
        a.seq,
        all.len(),
        ok.len()
    );
    if ok.is_empty() {
        println!("no layout fits; the closest:");
    } else {
        println!(
            "\n{:>3}  {:>9}  {:>12}  {:>9}  where the step goes (ms): compute | tensor comm | bubble | data comm exposed | optimizer",
            "#", "step ms", "tokens/s", "GiB/GPU"
        );
        let tokens = (global_batch * a.seq) as f64;
        for (i, c) in ok.iter().take(a.top).enumerate() {
            let p = c.prediction.expect("predicted");
            println!(
                "{:>3}  {:>9.1}  {:>12.0}  {:>9.1}  {:.0} | {:.0} | {:.0} | {:.0} of {:.0} | {:.1}",
                i + 1,
                1e3 * p.step_s,
                tokens / p.step_s,
                gib(c.memory_bytes()),
                1e3 * p.compute_s,
                1e3 * p.tensor_comm_s,
                1e3 * p.bubble_s,
                1e3 * p.data_exposed_s,
                1e3 * p.data_comm_s,
                1e3 * p.optimizer_s
            );
            println!("     {}", flags(c));
        }
    }
    // Why the rest cannot run, by reason.
    let mut reasons: std::collections::BTreeMap<String, usize> = Default::default();
    for c in all.iter().filter_map(|c| c.refused.as_deref()) {
        let kind = match c {
            r if r.contains("GiB per GPU") => "too large for a GPU's memory",
            r if r.contains("micro-batches for") => "fewer micro-batches than stages",
            r if r.contains("not built yet") => "not built yet (a pipeline under ZeRO-2/3 on GPUs)",
            r if r.contains("interleaving") => "layers do not divide into the interleaved stages",
            _ => "other",
        };
        *reasons.entry(kind.to_string()).or_default() += 1;
    }
    if !reasons.is_empty() {
        println!("\nrefused:");
        for (why, n) in reasons {
            println!("  {n} layout(s): {why}");
        }
    }
    if let Some(first) = ok.first() {
        println!("\nfirst choice: {}", flags(first));
        print_capacity(first);
    } else if let Some(closest) = all
        .iter()
        .filter(|c| {
            c.refused
                .as_deref()
                .is_some_and(|r| r.contains("GiB per GPU"))
        })
        .min_by(|a, b| a.memory_bytes().total_cmp(&b.memory_bytes()))
    {
        println!(
            "the smallest needs {:.1} GiB per GPU: {} (more GPUs, --checkpointing or a smaller batch)",
            gib(closest.memory_bytes()),
            flags(closest)
        );
    }
    println!(
        "(a model, not a measurement: memory as braid train's pre-flight counts it, step times from the {} description)",
        hw.name
    );
    Ok(0)
}
