//! braid's own runs on four H100s (BENCHMARKS.md, `bench/results/`) set
//! beside the planner's predictions from the shipped `h100` description:
//! the table issue 68 asks for, and a guard on how far off it is today.
//! The target is 10 % (15 % must). With the H100 as `braid plan
//! calibrate` measured it (2026-12-07) 124M's data parallelism lands
//! within 4 %, 2.65B `--tp 4` within 9 % and the 12.85B layouts within
//! 12 %, but `--tp 2` × data 2 is 17 % and the 2.65B pipelines 11-24 %
//! too fast: with micro-batches of 2 rows the schedules idle longer than
//! simulated (1F1B measured 31 % idle against 24 % predicted), and these
//! runs are from late November, before the engine changes since. Issue 70
//! runs them again. The guard keeps the model from drifting further.

use super::cost::{predict, Layout};
use super::hardware::Hardware;
use super::testing::{gpt, plain};
use crate::schedule::build::ScheduleKind;

/// One recorded run: what it was, its layout and its measured tokens/s.
struct Run {
    what: &'static str,
    /// Layers, heads, width.
    model: (usize, usize, usize),
    global_batch: usize,
    layout: Layout,
    tokens_per_s: f64,
}

fn runs() -> Vec<Run> {
    let pp = |kind, ckpt| Layout {
        schedule: Some(kind),
        checkpointing: ckpt,
        ..plain(1, 1, 4, 2, 8)
    };
    let (small, mid, big) = ((12, 12, 768), (32, 32, 2560), (40, 40, 5120));
    vec![
        Run {
            what: "124M, data 4, batch 16 each (x4.sh scale, 2026-11-27)",
            model: small,
            global_batch: 64,
            layout: plain(4, 1, 1, 16, 1),
            tokens_per_s: 1_713_692.0,
        },
        Run {
            what: "2.65B, --tp 4 (tp.sh bench, 2026-11-28)",
            model: mid,
            global_batch: 16,
            layout: plain(1, 4, 1, 16, 1),
            tokens_per_s: 77_343.0,
        },
        Run {
            what: "2.65B, --tp 2 x data 2 (tp.sh bench, 2026-11-28)",
            model: mid,
            global_batch: 16,
            layout: plain(2, 2, 1, 8, 1),
            tokens_per_s: 87_900.0,
        },
        Run {
            what: "12.85B, --tp 4, checkpointing (2026-11-27)",
            model: big,
            global_batch: 8,
            layout: Layout {
                checkpointing: true,
                ..plain(1, 4, 1, 8, 1)
            },
            tokens_per_s: 17_949.0,
        },
        Run {
            what: "2.65B, --pp 4 1F1B, 8 micro-batches of 2 (pp.sh, 2026-11-27)",
            model: mid,
            global_batch: 16,
            layout: pp(ScheduleKind::OneFOneB, false),
            tokens_per_s: 73_028.0,
        },
        Run {
            what: "2.65B, --pp 4 interleaved:2 (pp.sh, 2026-11-27)",
            model: mid,
            global_batch: 16,
            layout: pp(ScheduleKind::Interleaved(2), false),
            tokens_per_s: 79_360.0,
        },
        Run {
            what: "2.65B, --pp 4 GPipe, stages by time (pp.sh, 2026-11-27)",
            model: mid,
            global_batch: 16,
            layout: pp(ScheduleKind::GPipe, false),
            tokens_per_s: 75_584.0,
        },
        Run {
            what: "2.65B, --pp 4 ZB-H1, stages by time (pp.sh, 2026-11-27)",
            model: mid,
            global_batch: 16,
            layout: pp(ScheduleKind::ZeroBubble, false),
            tokens_per_s: 89_232.0,
        },
        Run {
            what: "12.85B, --pp 4 1F1B, checkpointing (pp.sh big, 2026-11-27)",
            model: big,
            global_batch: 16,
            layout: pp(ScheduleKind::OneFOneB, true),
            tokens_per_s: 16_378.0,
        },
    ]
}

/// braid's runs of 2.65B on four H200s, 2026-11-27
/// (`bench/results/2026-11-27-tp-gpu-h200x4/cross-*.txt`): ZeRO-3 and
/// `--tp 4` without sequence parallelism at global batches of 4 to 32.
fn runs_h200() -> Vec<Run> {
    let mid = (32, 32, 2560);
    let zero3 = |b: usize| Layout {
        zero: 3,
        ..plain(4, 1, 1, b / 4, 1)
    };
    let tp4 = |b: usize| Layout {
        sequence_parallel: false,
        ..plain(1, 4, 1, b, 1)
    };
    let run = |what, global_batch, layout, tokens_per_s| Run {
        what,
        model: mid,
        global_batch,
        layout,
        tokens_per_s,
    };
    vec![
        run("2.65B, ZeRO-3 over 4, batch 1 each", 4, zero3(4), 53_954.0),
        run("2.65B, ZeRO-3 over 4, batch 2 each", 8, zero3(8), 82_247.0),
        run(
            "2.65B, ZeRO-3 over 4, batch 4 each",
            16,
            zero3(16),
            99_870.0,
        ),
        run(
            "2.65B, ZeRO-3 over 4, batch 8 each",
            32,
            zero3(32),
            115_758.0,
        ),
        run("2.65B, --tp 4 --no-sp, batch 4", 4, tp4(4), 60_057.0),
        run("2.65B, --tp 4 --no-sp, batch 8", 8, tp4(8), 69_817.0),
        run("2.65B, --tp 4 --no-sp, batch 16", 16, tp4(16), 75_687.0),
        run("2.65B, --tp 4 --no-sp, batch 32", 32, tp4(32), 78_772.0),
    ]
}

/// Each run's predicted tokens/s and its error against the measured.
pub(crate) fn table() -> Vec<(&'static str, f64, f64, f64)> {
    table_of(runs(), "h100")
}

/// [`table`] of `runs` on the built-in description `hardware`.
fn table_of(runs: Vec<Run>, hardware: &str) -> Vec<(&'static str, f64, f64, f64)> {
    let hw = Hardware::builtin(hardware).expect("built in");
    runs.into_iter()
        .map(|r| {
            let (layers, heads, width) = r.model;
            let w = gpt(layers, heads, width, r.global_batch);
            let p = predict(&w, &r.layout, &hw).expect("a layout that divides");
            let got = (r.global_batch * 1024) as f64 / p.step_s;
            (r.what, got, r.tokens_per_s, got / r.tokens_per_s - 1.0)
        })
        .collect()
}

/// The rows as lines (`on` after each run's name), printed, and the
/// furthest any is off, with the lines.
#[cfg(test)]
fn printed(rows: &[(&str, f64, f64, f64)], on: &str) -> (f64, String) {
    let text: Vec<String> = rows
        .iter()
        .map(|(what, got, measured, off)| {
            format!(
                "{what}{on}: predicted {got:.0}, measured {measured:.0} ({:+.1} %)",
                100.0 * off
            )
        })
        .collect();
    let text = text.join("\n");
    eprintln!("{text}");
    let worst = rows.iter().map(|r| r.3.abs()).fold(0.0, f64::max);
    (worst, text)
}

#[test]
fn braids_four_gpu_runs_beside_their_predictions() {
    let rows = table();
    let (worst, text) = printed(&rows, "");
    // Today's bound (the target is 0.10): no run further off than this.
    // With the H100's measured tables (2026-12-07) the worst went from
    // +34.7 % to +24.2 %, but 12.85B's pipeline from -0.8 % to -11.8 %:
    // its products and attention are now timed as one H100 runs them,
    // and what is left is the pipeline's own modelling.
    assert!(worst <= 0.25, "{text}");
    // The 12.85B layouts are near the target; keep them there.
    for (what, _, _, off) in rows.iter().filter(|r| r.0.starts_with("12.85B")) {
        assert!(off.abs() <= 0.12, "{what}: {:+.1} %", 100.0 * off);
    }
}

/// The four-H200 runs beside the `h200` description's predictions. Today
/// ZeRO-3 at one sequence a GPU lands within 2 %, but with more the
/// predictions run 26-42 % fast (the gathers and reduce-scatters that
/// overlap the passes slow them more than modelled, and one H200 trains
/// 2.65B no faster than one H100, 29,954 against 29,550 tokens/s, where
/// the description expects 3 % more), and `--tp 4` without sequence
/// parallelism 18-23 % fast. The guard keeps the model from drifting
/// further.
#[test]
fn braids_four_h200_runs_beside_their_predictions() {
    let (worst, text) = printed(&table_of(runs_h200(), "h200"), " (4 H200s)");
    assert!(worst <= 0.45, "{text}");
}
