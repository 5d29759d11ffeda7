//! A pipeline stage's passes over one micro-batch ([`Gpt::stage_forward`],
//! [`Gpt::stage_backward`]): the model of a [`Layout::pipeline_stages`]
//! layout runs one of its stages' blocks (a rank of an interleaved
//! pipeline holds several stages). The first stage embeds the tokens, the
//! others start from the previous stage's output written into their
//! activations' input; the last ends in the head and the loss, the others
//! hand their output on. Backward mirrors it: the last stage starts from
//! the loss, the others from the gradient of their output (the next
//! stage's input gradient) written into their activations; each leaves
//! its input's gradient there for the previous stage. One
//! [`Activations`] per micro-batch in flight.

use super::acts::Activations;
use super::error::StepError;
use super::gpt::Gpt;
use crate::cpu::Real;
use crate::layout::{Block, Stage};

impl Gpt {
    /// The pipeline stages this model's layout holds (the whole model
    /// without a pipeline).
    pub fn stages(&self) -> &[Stage] {
        &self.layout.stages
    }

    /// Refuses a stage the layout does not hold.
    fn held(&self, st: &Stage) -> Result<(), StepError> {
        self.layout.check_stage(st).map_err(StepError::Shape)
    }

    /// One micro-batch through stage `st` (`p`: the layout's flat
    /// parameters; `acts` made by [`Gpt::stage_activations`] for `st`).
    /// Returns the mean loss on the last stage; elsewhere the output is
    /// [`Activations::output`]. `tokens` are read on the first stage,
    /// `targets` on the last.
    pub fn stage_forward<T: Real>(
        &self,
        st: &Stage,
        p: &[T],
        acts: &mut Activations<T>,
        tokens: &[u32],
        targets: &[u32],
    ) -> Result<Option<T>, StepError> {
        self.held(st)?;
        let ly = &*self.layout;
        let emb = &p[ly.block_range(Block::Embedding)];
        match st.first {
            true => self.embedding_forward(emb, acts, tokens, targets)?,
            // The batch is checked where the embeddings would.
            false => self.check(acts, tokens, targets)?,
        }
        for l in st.layers.clone() {
            let _t = braid_trace::scope::start(None, braid_trace::Cat::Compute, || {
                format!("forward layer {l}")
            });
            self.layer_forward_at(l, &p[ly.block_range(Block::Layer(l))], acts)?;
        }
        match st.last {
            true => {
                let norm = &p[ly.block_range(Block::FinalNorm)];
                self.head_forward(norm, emb, acts, targets).map(Some)
            }
            false => Ok(None),
        }
    }

    /// The backward pass of the micro-batch `acts` last went forward with:
    /// accumulates into `grads` (the stage's layout) and calls
    /// `ready(block, its gradients)` as each block's are final for this
    /// micro-batch — the final norm, the layers from the last down, the
    /// embeddings (on the last stage not also the first: the head's share
    /// of the tied token embedding). Leaves the gradient of the stage's
    /// input in [`Activations::residual_grad`].
    #[allow(clippy::too_many_arguments)]
    pub fn stage_backward<T: Real>(
        &self,
        st: &Stage,
        p: &[T],
        grads: &mut [T],
        acts: &mut Activations<T>,
        tokens: &[u32],
        targets: &[u32],
        ready: &mut dyn FnMut(Block, &mut [T]),
    ) -> Result<(), StepError> {
        self.held(st)?;
        let ly = &*self.layout;
        let er = ly.block_range(Block::Embedding);
        if st.last {
            let nr = ly.block_range(Block::FinalNorm);
            // The embeddings come first in the layout, the final norm last.
            let (front, back) = grads.split_at_mut(nr.start);
            let g_norm = &mut back[..nr.len()];
            self.head_backward(
                &p[nr.clone()],
                &p[er.clone()],
                g_norm,
                &mut front[er.clone()],
                acts,
                targets,
            )?;
            ready(Block::FinalNorm, g_norm);
        }
        for l in st.layers.clone().rev() {
            let r = ly.block_range(Block::Layer(l));
            self.layer_backward_at(l, &p[r.clone()], &mut grads[r.clone()], acts)?;
            ready(Block::Layer(l), &mut grads[r]);
        }
        if st.first {
            self.embedding_backward(&mut grads[er.clone()], acts, tokens)?;
        }
        if st.first || st.last {
            ready(Block::Embedding, &mut grads[er]);
        }
        Ok(())
    }
}

impl Gpt {
    /// The weight half of stage `st`'s backward pass of the micro-batch of
    /// `acts` (made [`Activations::split_backward`], after
    /// [`stage_backward`](Self::stage_backward) ran the input half): each
    /// layer's weight gradients into `grads`.
    pub fn stage_backward_weights<T: Real>(
        &self,
        st: &Stage,
        grads: &mut [T],
        acts: &Activations<T>,
    ) -> Result<(), StepError> {
        self.held(st)?;
        let n = acts.b * acts.t;
        for l in st.layers.clone().rev() {
            let i = acts.index(l)?;
            let dy = acts.deferred.get(i).ok_or_else(|| {
                StepError::Shape(format!(
                    "layer {l}: its backward pass was not split (these activations keep no \
                     output gradients)"
                ))
            })?;
            let r = self.layout.block_range(Block::Layer(l));
            self.layer_backward_weights(l, &mut grads[r], &acts.layers[i], dy, n);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::config::GptConfig;
    use crate::layout::{Block, Layout, Stage};
    use crate::params::Params;
    use crate::Gpt;
    use std::sync::Arc;

    /// Three stages passing activations and gradients by hand give the
    /// whole model's loss and gradients (f64): every layer's exactly, the
    /// tied embeddings as the sum of the first and last stages' copies;
    /// with activation checkpointing too, and with the backward passes
    /// split in halves (the weight half after the input half went on).
    #[test]
    fn stages_in_a_row_are_the_whole_model() {
        let cfg = GptConfig::parse("L4-H2-C8-V29-T8").unwrap();
        let whole = Arc::new(Layout::padded(&cfg, 4));
        let init = Params::init_gpt2(whole.clone(), 7);
        let p: Vec<f64> = init.data.iter().map(|&x| x as f64 * 10.0 + 0.01).collect();
        let (b, t) = (2, 8);
        let mut r = crate::rng::Rng::new(5);
        let toks: Vec<u32> = (0..b * t).map(|_| (r.next_u64() % 29) as u32).collect();
        let tg: Vec<u32> = (0..b * t).map(|_| (r.next_u64() % 29) as u32).collect();
        // Whole backward passes, with checkpointing, and split in halves.
        for (ckpt, split) in [(false, false), (true, false), (false, true)] {
            let m = Gpt::new(whole.clone());
            let mut acts = m.activations::<f64>(b, t, ckpt).unwrap();
            let mut g = vec![0.0; p.len()];
            let loss = m
                .forward_backward(&p, &mut g, &mut acts, &toks, &tg, &mut |_, _| {})
                .unwrap();
            let cuts = [
                (0..1, true, false),
                (1..3, false, false),
                (3..4, false, true),
            ];
            let stages: Vec<(Arc<Layout>, Gpt, Stage)> = cuts
                .iter()
                .map(|(layers, first, last)| {
                    let st = Stage {
                        layers: layers.clone(),
                        first: *first,
                        last: *last,
                    };
                    let l = Arc::new(whole.pipeline_stage(st.clone()).unwrap());
                    (l.clone(), Gpt::new(l), st)
                })
                .collect();
            // Each stage's parameters: the whole model's blocks it holds.
            let part = |l: &Layout, flat: &[f64]| -> Vec<f64> {
                let mut out = vec![0.0; l.len];
                for (block, range) in &l.blocks {
                    out[range.clone()].copy_from_slice(&flat[whole.block_range(*block)]);
                }
                out
            };
            let ps: Vec<Vec<f64>> = stages.iter().map(|(l, _, _)| part(l, &p)).collect();
            let mut acts: Vec<_> = stages
                .iter()
                .map(|(l, m, st)| {
                    let mut a = m.stage_activations::<f64>(st, b, t, ckpt).unwrap();
                    if split {
                        assert!(a.split_backward(l));
                    }
                    a
                })
                .collect();
            let mut handed = Vec::new();
            let mut got = None;
            for (i, (_, m, st)) in stages.iter().enumerate() {
                if i > 0 {
                    acts[i].input_mut().copy_from_slice(&handed);
                }
                got = m
                    .stage_forward(st, &ps[i], &mut acts[i], &toks, &tg)
                    .unwrap();
                handed = acts[i].output().to_vec();
            }
            assert_eq!(got, Some(loss), "checkpointing {ckpt}");
            let mut gs: Vec<Vec<f64>> = ps.iter().map(|q| vec![0.0; q.len()]).collect();
            for i in (0..stages.len()).rev() {
                if i + 1 < stages.len() {
                    acts[i].residual_grad_mut().copy_from_slice(&handed);
                }
                let (_, m, st) = &stages[i];
                m.stage_backward(
                    st,
                    &ps[i],
                    &mut gs[i],
                    &mut acts[i],
                    &toks,
                    &tg,
                    &mut |_, _| {},
                )
                .unwrap();
                handed = acts[i].residual_grad().to_vec();
                if split {
                    // The weight half, after the input half went on.
                    m.stage_backward_weights(st, &mut gs[i], &acts[i]).unwrap();
                }
            }
            for (i, (l, _, _)) in stages.iter().enumerate() {
                for (block, range) in &l.blocks {
                    let want = &g[whole.block_range(*block)];
                    let mut have = gs[i][range.clone()].to_vec();
                    if *block == Block::Embedding {
                        // The other copy's share.
                        let other = if i == 0 { stages.len() - 1 } else { 0 };
                        let or = stages[other].0.block_range(Block::Embedding);
                        for (h, o) in have.iter_mut().zip(&gs[other][or]) {
                            *h += o;
                        }
                    }
                    let d = want
                        .iter()
                        .zip(&have)
                        .map(|(a, b)| (a - b).abs())
                        .fold(0.0, f64::max);
                    assert!(
                        d <= 1e-12,
                        "{block:?} on stage {i}, checkpointing {ckpt}: {d}"
                    );
                }
            }
        }
    }
}
