//! `braid ckpt`: look into sharded checkpoints (`inspect`) and turn one
//! into a single safetensors file (`consolidate`) that `braid generate`,
//! `braid train --load` and Hugging Face load. The whole model assembled
//! in memory from the ranks' pieces ([`whole_model`]) is also what
//! `braid generate --load CKPT_DIR` samples from.

use braid_model::{checkpoint, GptConfig, Layout, Params};
use braid_train::checkpoint::load::resolve;
use braid_train::checkpoint::{CheckpointReader, StateSource};
use braid_train::engine::NamedTensor;
use braid_train::engines::gpt_tensors;
use clap::{Args, Subcommand};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Inspect or consolidate sharded checkpoints.
#[derive(Args)]
#[command(
    about = "Inspect a sharded checkpoint (braid train --ckpt-dir) or consolidate it into one file",
    after_help = "Examples:\n  braid ckpt inspect ck                        # the newest checkpoint in ck\n  braid ckpt inspect ck/step-00000100 --verify  # and read every tensor, checking its checksum\n  braid ckpt consolidate ck -o model.safetensors"
)]
pub struct CkptArgs {
    #[command(subcommand)]
    what: CkptCommand,
}

#[derive(Subcommand)]
enum CkptCommand {
    /// What a checkpoint holds: step, world, strategy, model, files, and
    /// how its tensors are split over the ranks.
    Inspect {
        /// A checkpoint directory, or a --ckpt-dir (its newest).
        dir: PathBuf,
        /// Also read every tensor and check it against its checksum.
        #[arg(long)]
        verify: bool,
        /// The manifest as JSON.
        #[arg(long, value_name = "FILE", num_args = 0..=1, default_missing_value = "-",
              value_parser = super::json_out::parse, help = super::json_out::HELP)]
        json: Option<super::json_out::JsonOut>,
    },
    /// One safetensors file of the whole model's parameters (f32 or
    /// bf16), with braid's configuration in its header.
    Consolidate {
        /// A checkpoint directory, or a --ckpt-dir (its newest).
        dir: PathBuf,
        /// The file to write.
        #[arg(short, long)]
        output: PathBuf,
        /// f32 or bf16.
        #[arg(long, default_value = "f32")]
        dtype: String,
    },
}

/// Runs `braid ckpt`.
pub fn run(a: CkptArgs) -> Result<i32, String> {
    match a.what {
        CkptCommand::Inspect { dir, verify, json } => inspect(&dir, verify, json.as_ref()),
        CkptCommand::Consolidate { dir, output, dtype } => consolidate(&dir, &output, &dtype),
    }
}

fn open(dir: &Path) -> Result<CheckpointReader, String> {
    match resolve(dir)? {
        Some(d) => CheckpointReader::open(&d),
        None => Err(format!("{}: no checkpoint there", dir.display())),
    }
}

/// The model configuration a checkpoint's run recorded.
pub(super) fn config_of(r: &CheckpointReader) -> Result<GptConfig, String> {
    let cfg = r.manifest().run.get("config").cloned().ok_or_else(|| {
        format!(
            "{}: the manifest records no model configuration",
            r.dir().display()
        )
    })?;
    serde_json::from_value(cfg)
        .map_err(|e| format!("{}: bad model configuration: {e}", r.dir().display()))
}

fn inspect(
    dir: &Path,
    verify: bool,
    json: Option<&super::json_out::JsonOut>,
) -> Result<i32, String> {
    if let Some(out) = json {
        out.check()?;
    }
    let r = open(dir)?;
    let m = r.manifest();
    if let Some(out) = json {
        out.write(&serde_json::to_string_pretty(m).expect("json"))?;
    }
    if !json.is_some_and(|j| j.is_stdout()) {
        let elements: usize = m
            .tensors
            .iter()
            .map(|t| t.shape.iter().product::<usize>())
            .sum();
        println!("checkpoint {}", r.dir().display());
        println!(
            "  step {} (micro-batches per rank {})",
            m.step, m.trainer.micro_batches
        );
        println!("  written by {} rank(s) under {}", m.world_size, m.strategy);
        println!("  engine: {}", m.engine);
        println!(
            "  {} tensors, {} parameters; optimizer {} ({})",
            m.tensors.len(),
            elements,
            m.optimizer.kind,
            m.optimizer.moments.join(", ")
        );
        for rf in &m.ranks {
            let held: usize = rf.pieces.iter().map(|p| p.end - p.start).sum();
            let partial = rf
                .pieces
                .iter()
                .filter(|p| {
                    let n: usize = m
                        .tensors
                        .iter()
                        .find(|t| t.name == p.tensor)
                        .map(|t| t.shape.iter().product())
                        .unwrap_or(0);
                    p.end - p.start != n
                })
                .count();
            let size = |f: &str| {
                std::fs::metadata(r.dir().join(f))
                    .map(|m| m.len())
                    .unwrap_or(0)
            };
            println!(
                "  rank {}: {} pieces ({} of them parts of a tensor), {} elements; {} {:.1} MB, {} {:.1} MB",
                rf.rank,
                rf.pieces.len(),
                partial,
                held,
                rf.model,
                size(&rf.model) as f64 / 1e6,
                rf.optimizer,
                size(&rf.optimizer) as f64 / 1e6
            );
        }
    }
    if verify {
        let cfg = config_of(&r)?;
        let layout = Layout::new(&cfg);
        let tensors = gpt_tensors(&layout);
        let all = 0..layout.len;
        let t0 = std::time::Instant::now();
        r.read("params", &tensors, std::slice::from_ref(&all))?;
        for moment in &m.optimizer.moments {
            r.read(moment, &tensors, std::slice::from_ref(&all))?;
        }
        println!(
            "verified: every tensor of the parameters and the optimizer's {} read and matches its checksum ({:.2} s)",
            m.optimizer.moments.join(", "),
            t0.elapsed().as_secs_f64()
        );
    }
    Ok(0)
}

/// The whole model of the checkpoint `r` (in the configuration its run
/// recorded), assembled in memory from every rank's pieces, each tensor
/// checked against its checksum. Progress goes to stderr as `verb: …%`:
/// every second, and at the end when `always` or when a line was printed
/// before (a quick read then prints nothing).
pub(super) fn whole_model(
    r: &CheckpointReader,
    verb: &str,
    always: bool,
) -> Result<Params, String> {
    let cfg = config_of(r)?;
    let layout = Arc::new(Layout::new(&cfg));
    let tensors = gpt_tensors(&layout);
    let mut params = Params::zeros(layout.clone());
    params.data = read_with_progress(r, &tensors, layout.len, verb, always)?;
    Ok(params)
}

/// The tokenizer the checkpoint's run trained with, when it recorded one.
pub(super) fn tokenizer_of(r: &CheckpointReader) -> Option<String> {
    r.manifest()
        .run
        .get("tokenizer")
        .and_then(|t| t.as_str())
        .filter(|t| !t.is_empty())
        .map(str::to_string)
}

/// Every parameter (`len` of them) of `r`, read a run of whole tensors at
/// a time (about a twentieth of the model), with progress on stderr (see
/// [`whole_model`]).
fn read_with_progress(
    r: &CheckpointReader,
    tensors: &[NamedTensor],
    len: usize,
    verb: &str,
    always: bool,
) -> Result<Vec<f32>, String> {
    let started = std::time::Instant::now();
    let mut out = Vec::with_capacity(len);
    let mut last_print = started;
    let mut printed = false;
    // Cut the flat buffer at tensor boundaries (in buffer order), so each
    // stored tensor is read once.
    let mut cuts: Vec<usize> = tensors.iter().map(|t| t.range.end).collect();
    cuts.sort_unstable();
    let mut start = 0;
    for (k, &cut) in cuts.iter().enumerate() {
        if cut - start < len / 20 && k + 1 < cuts.len() {
            continue;
        }
        let end = cut.max(start);
        out.extend(r.read("params", tensors, std::slice::from_ref(&(start..end)))?);
        start = end;
        let secs = started.elapsed().as_secs_f64();
        if last_print.elapsed().as_secs_f64() >= 1.0 || (out.len() == len && (always || printed)) {
            last_print = std::time::Instant::now();
            printed = true;
            eprintln!(
                "{verb}: {:.0}% ({:.2} of {:.2} GB read, {:.2} GB/s, {secs:.1} s)",
                100.0 * out.len() as f64 / len.max(1) as f64,
                4.0 * out.len() as f64 / 1e9,
                4.0 * len as f64 / 1e9,
                4.0 * out.len() as f64 / 1e9 / secs.max(1e-9)
            );
        }
    }
    if out.len() != len {
        return Err(format!(
            "{}: the tensors cover {} of the model's {len} parameters",
            r.dir().display(),
            out.len()
        ));
    }
    Ok(out)
}

/// Refuses an output that would replace a file of the checkpoint `r`
/// reads: one inside its step directory, or its --ckpt-dir's `latest`.
fn outside_checkpoint(r: &CheckpointReader, output: &Path) -> Result<(), String> {
    let parent = match output.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let (Ok(parent), Ok(step)) = (parent.canonicalize(), r.dir().canonicalize()) else {
        return Ok(());
    };
    let latest = output.file_name().is_some_and(|n| n == "latest");
    let what = if parent == step {
        format!(
            "inside the checkpoint {} that it is made from",
            r.dir().display()
        )
    } else if latest && step.parent() == Some(parent.as_path()) {
        "the checkpoint directory's pointer to its newest checkpoint".to_string()
    } else {
        return Ok(());
    };
    Err(format!(
        "--output {}: {what}: writing there would replace the checkpoint's own files; pick a \
         path outside it (e.g. model.safetensors)",
        output.display()
    ))
}

fn consolidate(dir: &Path, output: &Path, dtype: &str) -> Result<i32, String> {
    // Checked before the model is read: its type, and where it goes.
    let dtype = match braid_core::DType::parse(dtype) {
        Ok(d @ (braid_core::DType::F32 | braid_core::DType::BF16)) => d,
        _ => {
            return Err(format!(
                "--dtype {dtype:?}: expected f32 or bf16 (what a checkpoint stores)"
            ))
        }
    };
    super::train_ckpt::check_outputs(&[("--output", Some(output))])?;
    let r = open(dir)?;
    outside_checkpoint(&r, output)?;
    let params = whole_model(&r, "consolidating", true)?;
    let mut extra = vec![("braid.step", r.manifest().step.to_string())];
    if let Some(tokenizer) = tokenizer_of(&r) {
        extra.push(("braid.tokenizer", tokenizer));
    }
    let extra: Vec<(&str, &str)> = extra.iter().map(|(k, v)| (*k, v.as_str())).collect();
    checkpoint::save_as(&params, output, dtype, &extra).map_err(|e| e.to_string())?;
    println!(
        "consolidated {} (step {}, {} parameters, written by {} rank(s)) into {}",
        r.dir().display(),
        r.manifest().step,
        params.layout.len,
        r.manifest().world_size,
        output.display()
    );
    Ok(0)
}
