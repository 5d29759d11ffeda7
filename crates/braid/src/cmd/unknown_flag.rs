//! What `braid` says about a flag it does not know: the closest flag the
//! subcommand has, or — for a flag that belongs to another command or to
//! the tools braid replaces (torchrun, Megatron, DeepSpeed, nanoGPT) —
//! where it belongs and what braid calls it. clap's own suggestion picks by
//! string similarity alone (`--nnodes` → `--no-sp`), which misleads more
//! than it helps.

use clap::error::{ContextKind, ContextValue, ErrorKind};
use std::ffi::OsString;

/// Flags of `braid launch` that a user may give `braid train` (or `bench`,
/// `verify`), which start their workers on this machine only.
const LAUNCHER_FLAGS: [&str; 16] = [
    "nnodes",
    "node-rank",
    "master-addr",
    "master-port",
    "rdzv-endpoint",
    "rdzv-backend",
    "rdzv-id",
    "rdzv-conf",
    "max-restarts",
    "standalone",
    "tee",
    "redirects",
    "local-ranks-filter",
    "log-dir",
    "force-nproc",
    "run-id",
];

/// Other tools' names for what `braid train` calls otherwise.
const TRAIN_SYNONYMS: [(&str, &str); 30] = [
    (
        "batch-size",
        "--batch (sequences per rank) or --global-batch",
    ),
    (
        "micro-batch-size",
        "--batch (sequences per rank and micro-batch)",
    ),
    ("global-batch-size", "--global-batch"),
    ("gradient-accumulation-steps", "--accum"),
    ("grad-accum", "--accum"),
    ("learning-rate", "--lr"),
    ("max-steps", "--steps"),
    ("train-iters", "--steps"),
    ("iters", "--steps"),
    ("max-iters", "--steps"),
    ("epochs", "--steps (braid counts steps, not epochs)"),
    ("warmup-steps", "--warmup"),
    ("warmup-iters", "--warmup"),
    ("seq-len", "--seq"),
    ("seq-length", "--seq"),
    ("block-size", "--seq"),
    ("context-length", "--seq"),
    ("tensor-model-parallel-size", "--tp"),
    ("tensor-parallel-size", "--tp"),
    ("pipeline-model-parallel-size", "--pp"),
    ("pipeline-parallel-size", "--pp"),
    ("zero-stage", "--zero"),
    (
        "num-layers",
        "--model L<layers>-H<heads>-C<width> (e.g. L12-H12-C768)",
    ),
    (
        "hidden-size",
        "--model L<layers>-H<heads>-C<width> (e.g. L12-H12-C768)",
    ),
    (
        "num-attention-heads",
        "--model L<layers>-H<heads>-C<width> (e.g. L12-H12-C768)",
    ),
    (
        "gpus",
        "--nproc-per-node gpu (one worker per GPU) with --device cuda",
    ),
    (
        "output-dir",
        "--ckpt-dir (checkpoints) or --save FILE (the final model)",
    ),
    ("resume-from", "--resume DIR"),
    ("log-interval", "--log-every"),
    ("eval-interval", "--eval-every"),
];

/// Flags of `braid generate` a user may give `braid train`.
const GENERATE_FLAGS: [&str; 5] = ["temperature", "top-k", "top-p", "prompt", "tokens"];

/// A clearer message for an unknown flag in `argv` than clap's `err`, or
/// `None` to let clap's stand (other kinds of error).
pub fn explain(err: &clap::Error, cli: &clap::Command, argv: &[OsString]) -> Option<String> {
    if err.kind() != ErrorKind::UnknownArgument {
        return None;
    }
    let Some(ContextValue::String(given)) = err.get(ContextKind::InvalidArg) else {
        return None;
    };
    let (path, cmd) = subcommand_of(cli, argv);
    let name = format!("braid {}", path.join(" "));
    let name = name.trim_end();
    if given.parse::<f64>().is_ok() {
        return Some(format!(
            "{name}: unexpected value {given}: a flag's negative value goes after `=` \
             (--flag={given}); see `{name} --help`"
        ));
    }
    let flag = given.split('=').next().unwrap_or(given);
    let key = normalise(flag);
    let sub = path.first().map(String::as_str).unwrap_or("");
    let advice =
        foreign(sub, &key).or_else(|| closest(cmd, &key).map(|c| format!("did you mean --{c}?")));
    Some(match advice {
        Some(a) => format!("{name}: unknown flag {flag}: {a}\n(`{name} --help` lists every flag)"),
        None => format!("{name}: unknown flag {flag} (`{name} --help` lists every flag)"),
    })
}

/// The subcommand path `argv` names (`["data", "write"]`) and its
/// command, as deep as the words go.
fn subcommand_of<'c>(
    cli: &'c clap::Command,
    argv: &[OsString],
) -> (Vec<String>, &'c clap::Command) {
    let mut cmd = cli;
    let mut path = Vec::new();
    for word in argv.iter().skip(1).map(|w| w.to_string_lossy()) {
        if word.starts_with('-') {
            break;
        }
        match cmd.find_subcommand(word.as_ref()) {
            Some(sub) => {
                path.push(sub.get_name().to_string());
                cmd = sub;
            }
            None => break,
        }
    }
    (path, cmd)
}

/// `--Some_Flag` → `some-flag`.
fn normalise(flag: &str) -> String {
    flag.trim_start_matches('-')
        .replace('_', "-")
        .to_ascii_lowercase()
}

/// Where a flag that is not `sub`'s belongs, for the flags users bring
/// from other commands and tools.
fn foreign(sub: &str, key: &str) -> Option<String> {
    let runs_workers = matches!(sub, "train" | "bench" | "verify" | "scale");
    if runs_workers && LAUNCHER_FLAGS.contains(&key) {
        return Some(format!(
            "--{key} is `braid launch`'s: --nproc-per-node starts workers on this machine only; \
             for more (several nodes, restarts, logs) start them under the launcher, e.g. \
             `braid launch --nnodes 2 --node-rank R --master-addr HOST --nproc-per-node N -- \
             braid {sub} ...`"
        ));
    }
    if sub == "train" {
        if let Some((_, ours)) = TRAIN_SYNONYMS.iter().find(|(theirs, _)| *theirs == key) {
            return Some(format!("braid train calls it {ours}"));
        }
        if GENERATE_FLAGS.contains(&key) {
            return Some(format!(
                "--{key} is `braid generate`'s (text from a trained model: braid generate --load \
                 FILE|CKPT_DIR --{key} ...)"
            ));
        }
        if matches!(key, "fp16" | "bf16" | "amp" | "mixed-precision") {
            return Some(
                "on a GPU braid trains in bf16 mixed precision by default (--precision bf16|f32)"
                    .into(),
            );
        }
    }
    None
}

/// The subcommand's flag (long name or alias) nearest to `key`, if one is
/// near enough to be what was meant.
fn closest(cmd: &clap::Command, key: &str) -> Option<String> {
    let mut best: Option<(usize, String)> = None;
    for arg in cmd.get_arguments() {
        let Some(long) = arg.get_long() else { continue };
        let names = std::iter::once(long).chain(arg.get_all_aliases().unwrap_or_default());
        for candidate in names {
            let d = distance(key, &normalise(candidate));
            let near = d <= 1 || (d <= 2 && key.len() >= 6);
            let prefix = key.len() >= 4 && long.starts_with(key);
            if (near || prefix) && best.as_ref().is_none_or(|(bd, _)| d < *bd) {
                // Name the flag by its main spelling.
                best = Some((d, long.to_string()));
            }
        }
    }
    best.map(|(_, long)| long)
}

/// Edit distance with transpositions (optimal string alignment).
fn distance(a: &str, b: &str) -> usize {
    let (a, b): (Vec<char>, Vec<char>) = (a.chars().collect(), b.chars().collect());
    let mut d = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for (i, row) in d.iter_mut().enumerate() {
        row[0] = i;
    }
    for (j, cell) in d[0].iter_mut().enumerate() {
        *cell = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            d[i][j] = (d[i - 1][j] + 1)
                .min(d[i][j - 1] + 1)
                .min(d[i - 1][j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                d[i][j] = d[i][j].min(d[i - 2][j - 2] + 1);
            }
        }
    }
    d[a.len()][b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distance_counts_edits_and_swaps() {
        assert_eq!(distance("nprocs", "nproc"), 1);
        assert_eq!(distance("stpes", "steps"), 1);
        assert_eq!(distance("nnodes", "no-sp"), 4);
        assert_eq!(distance("", "ab"), 2);
    }

    #[test]
    fn foreign_flags_say_where_they_belong() {
        let nnodes = foreign("train", "nnodes").unwrap();
        assert!(nnodes.contains("braid launch --nnodes"), "{nnodes}");
        assert!(foreign("train", "batch-size").unwrap().contains("--batch"));
        assert!(foreign("train", "temperature")
            .unwrap()
            .contains("braid generate"));
        assert!(foreign("launch", "nnodes").is_none());
        assert!(foreign("data", "batch-size").is_none());
    }
}
