//! Which layers each pipeline stage holds: consecutive ranges, balanced by
//! count with the embeddings and the head counted (the first and last
//! stages take a layer fewer where the layers do not split evenly), or as
//! `--stage-layers` says; a split that leaves a stage empty, or drops or
//! repeats a layer, is refused.

use crate::Result;
use braid_model::Stage;

/// The `stages` stages of a model of `layers` layers, first to last;
/// `given`: each stage's layer count (`--stage-layers`).
pub fn assign(layers: usize, stages: usize, given: Option<&[usize]>) -> Result<Vec<Stage>> {
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
            None => {
                let (base, extra) = (layers / stages, layers % stages);
                // The extra layers go to the middle stages first: the first
                // and the last also run the embeddings and the head.
                let mut order: Vec<usize> = (1..stages.saturating_sub(1)).collect();
                order.extend([0, stages - 1]);
                order.dedup();
                let mut c = vec![base; stages];
                for &s in order.iter().take(extra) {
                    c[s] += 1;
                }
                c
            }
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

    #[test]
    fn layers_split_evenly_the_ends_lighter() {
        let s = assign(10, 4, None).unwrap();
        let n: Vec<usize> = s.iter().map(|s| s.layers.len()).collect();
        assert_eq!(n, [2, 3, 3, 2]);
        assert!(s[0].first && s[3].last && !s[1].first && !s[1].last);
        assert_eq!(s[3].layers, 8..10);
        assert_eq!(assign(4, 1, None).unwrap()[0].layers, 0..4);
        let e = assign(2, 4, None).unwrap_err();
        assert!(
            e.contains("4 pipeline stages for a model of 2 layers"),
            "{e}"
        );
        let e = assign(4, 2, Some(&[3, 2])).unwrap_err();
        assert!(e.contains("add up to the model's 4"), "{e}");
        assert_eq!(assign(4, 2, Some(&[3, 1])).unwrap()[1].layers, 3..4);
    }
}
