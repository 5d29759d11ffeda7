//! Tensor parallelism against the whole model: the ranks of a
//! [`LocalGroup`] (threads) each run their share of the model; their loss
//! and gradients, put back at their places, must be the whole model's.

use super::*;
use crate::config::GptConfig;
use crate::layout::TensorShard;
use crate::params::Params;
use crate::place::Place;
use crate::tensor_comm::LocalGroup;
use std::sync::Arc;

/// One rank's loss, its layout and its gradients (f64).
type RankRun = (f64, Arc<Layout>, Vec<f64>);

/// Forward + backward of every rank of an `n`-way split of `cfg`, in f64.
fn tensor_parallel_run(
    cfg: &GptConfig,
    n: usize,
    sequence: bool,
    checkpointing: bool,
    batch: (usize, usize, &[u32], &[u32]),
) -> Vec<RankRun> {
    let (b, t, toks, tg) = batch;
    LocalGroup::run(n, |g| {
        let shard = TensorShard {
            rank: g.rank(),
            size: n,
        };
        let l = Arc::new(Layout::tensor_parallel(cfg, shard, 4).unwrap());
        let init = Params::init_gpt2(l.clone(), 5);
        let p: Vec<f64> = init.data.iter().map(|&x| x as f64 * 10.0 + 0.01).collect();
        let m = Gpt::tensor_parallel(l.clone(), Arc::new(g), sequence).unwrap();
        let mut acts = m.activations::<f64>(b, t, checkpointing).unwrap();
        let mut grads = vec![0.0; p.len()];
        let loss = m
            .forward_backward(&p, &mut grads, &mut acts, toks, tg, &mut |_, _| {})
            .unwrap();
        (loss, l, grads)
    })
}

#[test]
fn tensor_parallel_ranks_compute_the_whole_models_loss_and_gradients() {
    // 4 heads, an uneven vocabulary (37 over 2 and 4 ranks).
    let cfg = GptConfig::parse("L2-H4-C16-V37-T6").unwrap();
    let whole = Arc::new(Layout::new(&cfg));
    let init = Params::init_gpt2(whole.clone(), 5);
    let p: Vec<f64> = init.data.iter().map(|&x| x as f64 * 10.0 + 0.01).collect();
    let (b, t) = (2, 6);
    let mut r = crate::rng::Rng::new(3);
    let toks: Vec<u32> = (0..b * t).map(|_| r.below(37) as u32).collect();
    let mut tg: Vec<u32> = (0..b * t).map(|_| r.below(37) as u32).collect();
    tg[4] = u32::MAX;
    let m = Gpt::new(whole.clone());
    let mut acts = Activations::<f64>::new(&whole, b, t, false);
    let mut want = vec![0.0; p.len()];
    let want_loss = m
        .forward_backward(&p, &mut want, &mut acts, &toks, &tg, &mut |_, _| {})
        .unwrap();
    for (n, sequence, checkpointing) in [
        (2, false, false),
        (2, true, false),
        (4, false, true),
        (4, true, true),
        (4, true, false),
    ] {
        let runs = tensor_parallel_run(&cfg, n, sequence, checkpointing, (b, t, &toks, &tg));
        let case =
            format!("{n} ranks, sequence parallel {sequence}, checkpointing {checkpointing}");
        for (loss, ..) in &runs {
            assert!(
                (loss - want_loss).abs() < 1e-12,
                "{case}: loss {loss} vs {want_loss}"
            );
        }
        let mut held = vec![0u32; p.len()];
        for (_, l, grads) in &runs {
            for spec in &l.params {
                let at = whole.get(&spec.name).unwrap().offset;
                let place = spec
                    .place
                    .clone()
                    .unwrap_or_else(|| Place::whole(&spec.shape));
                for run in place.full_runs(0..spec.len) {
                    for k in 0..run.len {
                        let (g, w) = (grads[spec.offset + run.local + k], want[at + run.full + k]);
                        let err = (g - w).abs() / w.abs().max(1e-3);
                        assert!(
                            err < 1e-9,
                            "{case}: {} [{}]: {g} vs {w}",
                            spec.name,
                            run.full + k
                        );
                        held[at + run.full + k] += 1;
                    }
                }
            }
        }
        // Every gradient element came from some rank.
        assert!(
            held.iter().all(|&k| k >= 1),
            "{case}: an element no rank holds"
        );
    }
}

#[test]
fn sequence_parallelism_needs_rows_that_split() {
    let cfg = GptConfig::parse("L1-H2-C8-V11-T5").unwrap();
    let l = Arc::new(Layout::tensor_parallel(&cfg, TensorShard { rank: 0, size: 2 }, 1).unwrap());
    let g = LocalGroup::new(2).swap_remove(0);
    let m = Gpt::tensor_parallel(l.clone(), Arc::new(g), true).unwrap();
    let e = m.activations::<f32>(1, 5, false).unwrap_err();
    assert!(e.to_string().contains("divides by 2"), "{e}");
    // A share without its group is refused, not run as if whole.
    let alone = Gpt::new(l.clone());
    let p = Params::init_gpt2(l.clone(), 1);
    let mut acts = Activations::<f32>::new(&l, 1, 4, false);
    let e = alone
        .forward(&p.data, &mut acts, &[1, 2, 3, 4], &[1, 2, 3, 4])
        .unwrap_err();
    assert!(matches!(e, StepError::Group(_)), "{e}");
}
