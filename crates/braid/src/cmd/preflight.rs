//! The memory pre-flight of `braid train`: before the model is
//! allocated, its footprint (`braid_model::footprint`) against the host's
//! available memory and the GPU's capacity; a run that would not fit is
//! refused with the estimate, the capacity and what would fit.

use braid_model::GptConfig;

/// What the run asked for, as the messages name it.
pub struct Shape<'a> {
    /// `--model` as given.
    pub model: &'a str,
    /// `--seq`.
    pub seq: usize,
    /// `--checkpointing`.
    pub checkpointing: bool,
}
use braid_train::engines::Precision;

/// Refuses, before anything is allocated, a run whose host memory
/// (the CPU engine's parameters, gradients, optimizer state and
/// activations; the GPU engine's host copy of the parameters) exceeds
/// what this machine has available, naming the estimate and what would fit.
pub fn host(
    a: &Shape<'_>,
    cfg: &GptConfig,
    batch: usize,
    cuda: bool,
    adamw: bool,
) -> Result<(), String> {
    use braid_model::footprint::{self, gib, Footprint, Part};
    let Some(avail) = footprint::host_available() else {
        return Ok(());
    };
    let params = cfg.num_params() as u128;
    // AdamW keeps two moments, SGD with momentum one.
    let states = if adamw { 2 } else { 1 };
    let need = |b: usize, ckpt: bool| {
        if cuda {
            Footprint {
                parts: vec![Part {
                    name: "parameters (host copy)",
                    bytes: 4 * params,
                }],
            }
        } else {
            footprint::cpu_training(cfg, b, a.seq, ckpt, states)
        }
    };
    let f = need(batch, a.checkpointing);
    if f.total() <= avail {
        return Ok(());
    }
    let model = format!("model {} ({:.3e} parameters)", a.model, params as f64);
    let mut fits = Vec::new();
    if !cuda {
        if let Some(b) = footprint::largest_batch(avail, batch, |b| need(b, a.checkpointing)) {
            fits.push(format!("--batch {b}"));
        }
        if !a.checkpointing {
            match footprint::largest_batch(avail, batch, |b| need(b, true)) {
                Some(b) if b == batch => fits.push("--checkpointing".into()),
                Some(b) => fits.push(format!("--checkpointing --batch {b}")),
                None => {}
            }
        }
    }
    let per = if cuda { 4 } else { 4 * (2 + states as u128) };
    let hint = if per * params > avail {
        format!(
            "the model alone needs {per} bytes per parameter here; \
             a model of at most about {:.2e} parameters would fit",
            (avail / per) as f64
        )
    } else if fits.is_empty() {
        let one = need(1, true).total();
        format!(
            "even batch 1 with --checkpointing needs {:.2} GiB: shorten --seq or pick a smaller model",
            gib(one)
        )
    } else {
        format!("what would fit: {}", fits.join(" or "))
    };
    Err(format!(
        "{model} needs about {:.2} GiB of host memory{} ({}), but {:.2} GiB is available; {hint}",
        gib(f.total()),
        if cuda {
            String::new()
        } else {
            format!(" to train on the CPU at batch {batch} x {}", a.seq)
        },
        f.breakdown(),
        gib(avail)
    ))
}

/// Refuses a model whose states alone (parameters, gradients, AdamW's
/// two moments, and the bf16 copy in mixed precision) exceed the GPU's
/// memory. (Activations and workspace come on top; the full estimate is
/// issue 20's next step.)
pub fn device(
    a: &Shape<'_>,
    cfg: &GptConfig,
    dev: &braid_cuda::Device,
    precision: Precision,
) -> Result<(), String> {
    use braid_model::footprint::gib;
    let Ok(capacity) = dev.total_memory() else {
        return Ok(());
    };
    let params = cfg.num_params() as u128;
    let per: u128 = match precision {
        Precision::Bf16 => 18,
        _ => 16,
    };
    let need = per * params;
    if need <= capacity as u128 {
        return Ok(());
    }
    Err(format!(
        "model {} ({:.3e} parameters) needs at least {:.2} GiB on the GPU for its parameters, \
         gradients and AdamW state alone ({per} bytes per parameter in {}), but GPU {} has {:.2} GiB; \
         a model of at most about {:.2e} parameters would fit before activations",
        a.model,
        params as f64,
        gib(need),
        precision.name(),
        dev.ordinal(),
        gib(capacity as u128),
        (capacity as u128 / per) as f64
    ))
}
