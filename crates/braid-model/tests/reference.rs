//! braid's GPT against an independent implementation: loss and every
//! gradient on fixed weights and tokens, compared with PyTorch's (computed
//! once in float64 by `bench/make_gpt_reference.py` and kept as a fixture).

use braid_model::{Gpt, GptConfig, Layout};
use safetensors::tensor::{Dtype, SafeTensors};
use std::sync::Arc;

fn f64s(st: &SafeTensors, name: &str) -> Vec<f64> {
    let t = st
        .tensor(name)
        .unwrap_or_else(|_| panic!("fixture lacks {name}"));
    assert_eq!(t.dtype(), Dtype::F64, "{name}");
    t.data()
        .chunks_exact(8)
        .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn ints(st: &SafeTensors, name: &str) -> Vec<u32> {
    let t = st.tensor(name).unwrap();
    assert_eq!(t.dtype(), Dtype::I64, "{name}");
    t.data()
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32)
        .collect()
}

#[test]
fn loss_and_gradients_match_pytorch() {
    let bytes = std::fs::read(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/gpt_reference.safetensors"
    ))
    .unwrap();
    let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
    let meta = meta.metadata().clone().unwrap();
    let cfg: GptConfig = serde_json::from_str(&meta["braid.config"]).unwrap();
    let b: usize = meta["batch"].parse().unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let layout = Arc::new(Layout::new(&cfg));
    let mut p = vec![0.0f64; layout.len];
    let mut want_grad = vec![0.0f64; layout.len];
    for spec in &layout.params {
        p[spec.range()].copy_from_slice(&f64s(&st, &format!("param.{}", spec.name)));
        want_grad[spec.range()].copy_from_slice(&f64s(&st, &format!("grad.{}", spec.name)));
    }
    let tokens = ints(&st, "tokens");
    let targets = ints(&st, "targets");
    let want_loss = f64s(&st, "loss")[0];

    let model = Gpt::new(layout.clone());
    for checkpointing in [false, true] {
        let mut acts = braid_model::Activations::<f64>::new(&layout, b, cfg.context, checkpointing);
        let mut g = vec![0.0f64; layout.len];
        let loss = model
            .forward_backward(&p, &mut g, &mut acts, &tokens, &targets, &mut |_, _| {})
            .unwrap();
        assert!(
            (loss - want_loss).abs() < 1e-10 * want_loss.abs(),
            "loss {loss} vs PyTorch {want_loss}"
        );
        for spec in &layout.params {
            let (got, want) = (&g[spec.range()], &want_grad[spec.range()]);
            let scale = want.iter().fold(0.0f64, |m, x| m.max(x.abs())).max(1e-12);
            let worst = got
                .iter()
                .zip(want)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f64::max);
            assert!(
                worst < 1e-9 * scale,
                "{}: gradient differs by {worst:e} (scale {scale:e})",
                spec.name
            );
        }
    }
}
