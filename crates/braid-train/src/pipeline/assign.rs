//! Which layers each pipeline stage holds: consecutive ranges balanced by
//! estimated time, or as `--stage-layers` says; a split that leaves a
//! stage empty, or drops or repeats a layer, is refused. The estimate
//! counts a layer as one and the head (the classifier's product over the
//! vocabulary, on the last stage) as [`head_cost`] layers: the last
//! stage takes as many layers as keeps the slowest stage fastest, the
//! others split the rest evenly (the first taking a layer fewer where
//! they do not divide: it also embeds the tokens).

use crate::Result;
use braid_model::Stage;

/// The head's forward arithmetic in layers' (per token: `2·C·V` against
/// a layer's `24·C² + 4·T·C`), for a model of width `c`, vocabulary `v`
/// and context `t`.
pub fn head_cost(c: usize, v: usize, t: usize) -> f64 {
    let (c, v, t) = (c as f64, v as f64, t as f64);
    2.0 * c * v / (24.0 * c * c + 4.0 * t * c)
}

/// Layer counts of `stages` stages over `layers` layers (`stages` ≤
/// `layers`), the last also running a head of `head` layers' time: the
/// split whose slowest stage is fastest (of equals, the last stage's
/// largest).
fn balanced(layers: usize, stages: usize, head: f64) -> Vec<usize> {
    if stages == 1 {
        return vec![layers];
    }
    let rest_of = |last: usize| (layers - last).div_ceil(stages - 1) as f64;
    let slowest = |last: usize| rest_of(last).max(last as f64 + head);
    let last = (1..=layers - (stages - 1))
        .rev()
        .min_by(|&a, &b| slowest(a).total_cmp(&slowest(b)))
        .expect("a stage holds at least one layer");
    let others = stages - 1;
    let (base, extra) = ((layers - last) / others, (layers - last) % others);
    // The extra layers go to the later stages first: the first embeds.
    let mut c = vec![base; others];
    for s in c.iter_mut().rev().take(extra) {
        *s += 1;
    }
    c.push(last);
    c
}

/// The `stages` stages of a model of `layers` layers, first to last, the
/// last with a head of `head` layers' time ([`head_cost`]); `given`: each
/// stage's layer count (`--stage-layers`).
pub fn assign(
    layers: usize,
    stages: usize,
    given: Option<&[usize]>,
    head: f64,
) -> Result<Vec<Stage>> {
    if stages == 0 {
        return Err("a pipeline of 0 stages".into());
    }
    if stages > layers {
        return Err(format!(
            "{stages} pipeline stages for a model of {layers} layers: each stage holds at least \
             one layer (use a smaller --pp, or fewer stages per rank)"
        ));
    }
    let counts: Vec<usize> =
        match given {
            Some(c) => {
                if c.len() != stages {
                    return Err(format!(
                        "--stage-layers gives {} stages' layers, the pipeline has {stages} stages",
                        c.len()
                    ));
                }
                let total: usize = c.iter().sum();
                if c.contains(&0) || total != layers {
                    return Err(format!(
                    "--stage-layers {}: every stage needs at least one layer and they must add \
                     up to the model's {layers} (they add up to {total})",
                    c.iter().map(|n| n.to_string()).collect::<Vec<_>>().join(",")
                ));
                }
                c.to_vec()
            }
            None => balanced(layers, stages, head),
        };
    let mut at = 0;
    Ok(counts
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            let s = Stage {
                layers: at..at + n,
                first: i == 0,
                last: i + 1 == stages,
            };
            at += n;
            s
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts(layers: usize, stages: usize, head: f64) -> Vec<usize> {
        assign(layers, stages, None, head)
            .unwrap()
            .iter()
            .map(|s| s.layers.len())
            .collect()
    }

    #[test]
    fn layers_split_by_time_the_head_counted() {
        let s = assign(10, 4, None, 0.5).unwrap();
        let n: Vec<usize> = s.iter().map(|s| s.layers.len()).collect();
        assert_eq!(n, [2, 3, 3, 2]);
        assert!(s[0].first && s[3].last && !s[1].first && !s[1].last);
        assert_eq!(s[3].layers, 8..10);
        // The 2.65B model's head is 1.54 layers: the last stage takes 7 of
        // 32 (slowest 9 instead of 9.54); the 12.85B model's 0.79 keeps
        // 10 each (11 would be slower).
        let h = head_cost(2560, 50304, 1024);
        assert!((h - 1.54).abs() < 0.01, "{h}");
        assert_eq!(counts(32, 4, h), [8, 8, 9, 7]);
        assert_eq!(
            counts(40, 4, head_cost(5120, 50304, 1024)),
            [10, 10, 10, 10]
        );
        // Interleaved over 4 ranks: 8 stages.
        assert_eq!(counts(32, 8, h), [4, 4, 4, 4, 4, 4, 5, 3]);
        assert_eq!(counts(8, 2, 0.0), [4, 4]);
        assert_eq!(assign(4, 1, None, 1.0).unwrap()[0].layers, 0..4);
        let e = assign(2, 4, None, 0.0).unwrap_err();
        assert!(
            e.contains("4 pipeline stages for a model of 2 layers"),
            "{e}"
        );
        let e = assign(4, 2, Some(&[3, 2]), 0.0).unwrap_err();
        assert!(e.contains("add up to the model's 4"), "{e}");
        assert_eq!(assign(4, 2, Some(&[3, 1]), 0.0).unwrap()[1].layers, 3..4);
    }
}
