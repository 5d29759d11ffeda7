//! Where every parameter lives in the flat buffer.
//!
//! All parameters of a model are one contiguous `f32` buffer (likewise the
//! gradients), laid out block by block so that a block's parameters — and
//! so its gradients — are one slice: the unit that data-parallel buckets
//! and sharded training cut. Names and shapes are those of the Hugging Face
//! GPT-2 checkpoint (`wte.weight`, `h.0.attn.c_attn.weight` [C, 3C], …), so
//! its safetensors file loads directly.

use crate::config::GptConfig;
use crate::place::Place;
use std::ops::Range;

/// What a parameter is (decides weight decay and initialisation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Token or position embedding.
    Embedding,
    /// A matrix of a linear layer (`[in, out]`, as GPT-2's Conv1D).
    Weight,
    /// The output projection of attention or MLP (initialised scaled by
    /// `1/sqrt(2 * layers)`, as GPT-2 does).
    ResidualWeight,
    /// A bias.
    Bias,
    /// A LayerNorm gain.
    NormWeight,
    /// A LayerNorm bias.
    NormBias,
}

impl Kind {
    /// Whether AdamW's decoupled weight decay applies (not to biases and
    /// norms).
    pub fn decays(self) -> bool {
        matches!(self, Kind::Embedding | Kind::Weight | Kind::ResidualWeight)
    }
}

/// One named parameter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Param {
    /// Hugging Face GPT-2 name.
    pub name: String,
    /// Shape.
    pub shape: Vec<usize>,
    /// Offset in the flat buffer, in elements.
    pub offset: usize,
    /// Number of elements.
    pub len: usize,
    /// What it is.
    pub kind: Kind,
    /// Where its elements sit in the whole model's tensor, when this
    /// layout holds only part of it (a tensor-parallel shard); `None`:
    /// held whole.
    pub place: Option<Place>,
}

impl Param {
    /// Its elements' range in the flat buffer.
    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.len
    }

    /// The whole model's shape of this tensor.
    pub fn full_shape(&self) -> &[usize] {
        match &self.place {
            Some(p) => &p.full,
            None => &self.shape,
        }
    }
}

/// Which share of the model a layout holds: a tensor-parallel rank's
/// (`rank` of `size`), or all of it (`size` 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorShard {
    /// This rank among the tensor-parallel group.
    pub rank: usize,
    /// Ranks in the group.
    pub size: usize,
}

impl TensorShard {
    /// The whole model, in one process.
    pub const WHOLE: TensorShard = TensorShard { rank: 0, size: 1 };

    /// This rank's rows of a vocabulary of `v`: (first, count). The
    /// vocabulary splits into near-equal runs, the first `v % size` ranks
    /// one row more: no padding, no row held twice.
    pub fn vocab(&self, v: usize) -> (usize, usize) {
        let (base, extra) = (v / self.size, v % self.size);
        (
            self.rank * base + self.rank.min(extra),
            base + usize::from(self.rank < extra),
        )
    }

    /// Why `config` cannot be split over `size` ranks, if it cannot: each
    /// rank runs whole attention heads.
    pub fn check(&self, config: &GptConfig) -> Result<(), String> {
        if self.size == 0 || self.rank >= self.size {
            return Err(format!(
                "tensor-parallel rank {} of {}",
                self.rank, self.size
            ));
        }
        if config.n_head % self.size != 0 {
            return Err(format!(
                "the model's {} attention heads do not split over {} tensor-parallel ranks \
                 (each rank runs whole heads): use a --tp that divides {}",
                config.n_head, self.size, config.n_head
            ));
        }
        if config.vocab_size < self.size {
            return Err(format!(
                "a vocabulary of {} cannot be split over {} ranks",
                config.vocab_size, self.size
            ));
        }
        Ok(())
    }
}

/// Which part of the model a block of parameters belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Block {
    /// Token and position embeddings (the token embedding is also the LM
    /// head: its gradient is final only after the embedding backward).
    Embedding,
    /// Transformer block `i`.
    Layer(usize),
    /// The final LayerNorm.
    FinalNorm,
}

/// The blocks a pipeline stage holds: a range of layers; the embeddings
/// on the first stage, and on the last too (its head reads the token
/// embedding, tied to the input's: the two copies' gradients are summed
/// every step); the final norm on the last.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stage {
    /// Its layers.
    pub layers: Range<usize>,
    /// The first stage: it embeds the tokens.
    pub first: bool,
    /// The last stage: the final norm, the head and the loss.
    pub last: bool,
}

impl Stage {
    /// The whole model (no pipeline).
    pub fn whole(config: &GptConfig) -> Stage {
        Stage {
            layers: 0..config.n_layer,
            first: true,
            last: true,
        }
    }

    /// Whether it holds `block`.
    pub fn holds(&self, block: Block) -> bool {
        match block {
            Block::Embedding => self.first || self.last,
            Block::Layer(i) => self.layers.contains(&i),
            Block::FinalNorm => self.last,
        }
    }

    /// Whether it is the whole model.
    pub fn is_whole(&self, config: &GptConfig) -> bool {
        *self == Stage::whole(config)
    }
}

/// The layout of a model's flat parameter buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// The model's configuration.
    pub config: GptConfig,
    /// Every parameter, in buffer order.
    pub params: Vec<Param>,
    /// Element ranges of the blocks: embedding, layers 0.., final norm.
    pub blocks: Vec<(Block, Range<usize>)>,
    /// The share of the model it holds.
    pub shard: TensorShard,
    /// The pipeline stages whose blocks it holds (one rank's: several
    /// when interleaved), in order; the whole model without a pipeline.
    pub stages: Vec<Stage>,
    /// Total number of elements.
    pub len: usize,
}

impl Layout {
    /// The layout of `config`: every tensor right after the previous one.
    pub fn new(config: &GptConfig) -> Layout {
        Self::padded(config, 1)
    }

    /// The layout of `config` with every block (the embeddings, each
    /// layer, the final norm) starting and ending at a multiple of
    /// `multiple` elements: zeros fill the gaps, each block's range
    /// includes the gap after it, and `len` is a multiple too. Sharded
    /// strategies split blocks into equal, aligned slices this way.
    /// `multiple` 1 is [`Layout::new`]'s.
    pub fn padded(config: &GptConfig, multiple: usize) -> Layout {
        Self::tensor_parallel(config, TensorShard::WHOLE, multiple)
            .expect("the whole model is always one shard")
    }

    /// The layout of tensor-parallel rank `shard.rank`'s share of
    /// `config`, blocks padded to `multiple` as [`padded`](Self::padded)
    /// does: Megatron's split of every layer — `c_attn` by whole heads
    /// (its query, key and value columns of this rank's heads), the MLP's
    /// `c_fc` by columns, both `c_proj` by rows, the token embedding by
    /// vocabulary rows ([`TensorShard::vocab`]); LayerNorms, biases after
    /// a row split and the position embedding whole. Names stay the
    /// whole model's; each cut tensor records its [`Place`].
    pub fn tensor_parallel(
        config: &GptConfig,
        shard: TensorShard,
        multiple: usize,
    ) -> Result<Layout, String> {
        shard.check(config)?;
        let multiple = multiple.max(1);
        let (c, v, t) = (config.n_embd, config.vocab_size, config.context);
        let (n, r) = (shard.size, shard.rank);
        let (ca, f) = (c / n, 4 * c / n);
        let (v0, vl) = shard.vocab(v);
        let mut params = Vec::new();
        let mut blocks = Vec::new();
        let offset = std::cell::Cell::new(0usize);
        // Adds a tensor of the whole shape `full`, cut along `dim` into
        // `slices` (none: whole).
        let add = |params: &mut Vec<Param>,
                   name: String,
                   full: Vec<usize>,
                   kind: Kind,
                   cut: Option<(usize, Vec<(usize, usize)>)>| {
            let place = match (n, cut) {
                (1, _) | (_, None) => None,
                (_, Some((dim, slices))) => Some(Place {
                    full: full.clone(),
                    dim,
                    slices,
                }),
            };
            let shape = place.as_ref().map_or(full, Place::local_shape);
            let len = shape.iter().product();
            params.push(Param {
                name,
                shape,
                offset: offset.get(),
                len,
                kind,
                place,
            });
            offset.set(offset.get() + len);
        };
        // This rank's query, key and value columns of a [.., 3C] tensor.
        let qkv_cols = || vec![(r * ca, ca), (c + r * ca, ca), (2 * c + r * ca, ca)];
        // Ends the block begun at `first`: the offset moves up to the next
        // multiple, and the block's range takes the gap.
        let end_block = |first: usize| {
            offset.set(offset.get().div_ceil(multiple) * multiple);
            first..offset.get()
        };
        let start = 0;
        add(
            &mut params,
            "wte.weight".into(),
            vec![v, c],
            Kind::Embedding,
            Some((0, vec![(v0, vl)])),
        );
        add(
            &mut params,
            "wpe.weight".into(),
            vec![t, c],
            Kind::Embedding,
            None,
        );
        blocks.push((Block::Embedding, end_block(start)));
        for i in 0..config.n_layer {
            let p = |s: &str| format!("h.{i}.{s}");
            let first = offset.get();
            add(
                &mut params,
                p("ln_1.weight"),
                vec![c],
                Kind::NormWeight,
                None,
            );
            add(&mut params, p("ln_1.bias"), vec![c], Kind::NormBias, None);
            add(
                &mut params,
                p("attn.c_attn.weight"),
                vec![c, 3 * c],
                Kind::Weight,
                Some((1, qkv_cols())),
            );
            add(
                &mut params,
                p("attn.c_attn.bias"),
                vec![3 * c],
                Kind::Bias,
                Some((0, qkv_cols())),
            );
            add(
                &mut params,
                p("attn.c_proj.weight"),
                vec![c, c],
                Kind::ResidualWeight,
                Some((0, vec![(r * ca, ca)])),
            );
            add(
                &mut params,
                p("attn.c_proj.bias"),
                vec![c],
                Kind::Bias,
                None,
            );
            add(
                &mut params,
                p("ln_2.weight"),
                vec![c],
                Kind::NormWeight,
                None,
            );
            add(&mut params, p("ln_2.bias"), vec![c], Kind::NormBias, None);
            add(
                &mut params,
                p("mlp.c_fc.weight"),
                vec![c, 4 * c],
                Kind::Weight,
                Some((1, vec![(r * f, f)])),
            );
            add(
                &mut params,
                p("mlp.c_fc.bias"),
                vec![4 * c],
                Kind::Bias,
                Some((0, vec![(r * f, f)])),
            );
            add(
                &mut params,
                p("mlp.c_proj.weight"),
                vec![4 * c, c],
                Kind::ResidualWeight,
                Some((0, vec![(r * f, f)])),
            );
            add(&mut params, p("mlp.c_proj.bias"), vec![c], Kind::Bias, None);
            blocks.push((Block::Layer(i), end_block(first)));
        }
        let first = offset.get();
        add(
            &mut params,
            "ln_f.weight".into(),
            vec![c],
            Kind::NormWeight,
            None,
        );
        add(
            &mut params,
            "ln_f.bias".into(),
            vec![c],
            Kind::NormBias,
            None,
        );
        blocks.push((Block::FinalNorm, end_block(first)));
        let len = offset.get();
        Ok(Layout {
            config: *config,
            params,
            blocks,
            shard,
            stages: vec![Stage::whole(config)],
            len,
        })
    }

    /// Whether it holds the whole model (no pipeline).
    pub fn is_whole(&self) -> bool {
        self.stages.len() == 1 && self.stages[0].is_whole(&self.config)
    }

    /// The part of this layout pipeline stage `stage` holds: its blocks
    /// only, one after another from element 0 (each keeps its padding), the
    /// tensors' names and places unchanged. Refused where it is not a
    /// stage of a whole layout: layers outside the model, or none.
    pub fn pipeline_stage(&self, stage: Stage) -> Result<Layout, String> {
        self.pipeline_stages(vec![stage])
    }

    /// [`pipeline_stage`](Self::pipeline_stage) for the stages one rank
    /// runs (interleaving gives it several): the blocks any of them holds,
    /// in the whole layout's order, each once — except on the first stage's
    /// rank where no stage is the last: there the embeddings come after
    /// the layers, so that a bf16 copy of the parameters can leave them
    /// out ([`bf16_len`](Self::bf16_len)).
    pub fn pipeline_stages(&self, stages: Vec<Stage>) -> Result<Layout, String> {
        self.pipeline_stages_ordered(stages, true)
    }

    /// [`pipeline_stages`](Self::pipeline_stages), with the first stage's
    /// embeddings after its layers only where `embeddings_last` (else in
    /// the whole layout's order, and a bf16 copy covers them).
    pub fn pipeline_stages_ordered(
        &self,
        stages: Vec<Stage>,
        embeddings_last: bool,
    ) -> Result<Layout, String> {
        let n = self.config.n_layer;
        if !self.is_whole() {
            return Err("a pipeline stage is cut from the whole model's layout".into());
        }
        for stage in &stages {
            if stage.layers.is_empty() || stage.layers.end > n {
                return Err(format!(
                    "a pipeline stage of layers {:?} in a model of {n}: each stage holds at \
                     least one of its layers",
                    stage.layers
                ));
            }
        }
        let mut params = Vec::new();
        let mut blocks = Vec::new();
        let mut at = 0;
        for (block, range) in self.stages_blocks(&stages, embeddings_last) {
            let shift = range.start;
            for p in self.params.iter().filter(|p| range.contains(&p.offset)) {
                params.push(Param {
                    offset: p.offset - shift + at,
                    ..p.clone()
                });
            }
            blocks.push((*block, at..at + range.len()));
            at += range.len();
        }
        Ok(Layout {
            config: self.config,
            params,
            blocks,
            shard: self.shard,
            stages,
            len: at,
        })
    }

    /// The whole layout's blocks that `stages` hold, in the order
    /// [`pipeline_stages_ordered`](Self::pipeline_stages_ordered) packs
    /// them.
    fn stages_blocks<'a>(
        &'a self,
        stages: &'a [Stage],
        embeddings_last: bool,
    ) -> impl Iterator<Item = &'a (Block, Range<usize>)> + 'a {
        let embeddings_last =
            embeddings_last && stages.iter().any(|s| s.first) && !stages.iter().any(|s| s.last);
        let embeddings = move |b: &Block| embeddings_last && *b == Block::Embedding;
        self.blocks
            .iter()
            .filter(move |(b, _)| !embeddings(b))
            .chain(self.blocks.iter().filter(move |(b, _)| embeddings(b)))
            .filter(move |(b, _)| stages.iter().any(|s| s.holds(*b)))
    }

    /// The `len` and [`bf16_len`](Self::bf16_len) of
    /// [`pipeline_stages_ordered`](Self::pipeline_stages_ordered)`(stages,
    /// embeddings_last)`, without building it (a planner sizes thousands).
    pub fn pipeline_stages_len(&self, stages: &[Stage], embeddings_last: bool) -> (usize, usize) {
        let (mut len, mut bf16_len) = (0, 0);
        let holds_head = stages.iter().any(|s| s.holds(Block::FinalNorm));
        for (block, range) in self.stages_blocks(stages, embeddings_last) {
            // As bf16_len: the embeddings packed last, without the head,
            // need no bf16 copy.
            bf16_len = match (*block == Block::Embedding, holds_head) {
                (true, false) => len,
                _ => len + range.len(),
            };
            len += range.len();
        }
        (len, bf16_len)
    }

    /// Refuses a pipeline stage this layout does not hold, naming those
    /// it does.
    pub fn check_stage(&self, st: &Stage) -> Result<(), String> {
        match self.stages.contains(st) {
            true => Ok(()),
            false => Err(format!(
                "pipeline stage of layers {:?}: this model's layout holds {:?}",
                st.layers,
                self.stages
                    .iter()
                    .map(|s| s.layers.clone())
                    .collect::<Vec<_>>()
            )),
        }
    }

    /// Whether it holds `block` (a pipeline stage's layout holds some).
    pub fn holds(&self, block: Block) -> bool {
        self.blocks.iter().any(|(b, _)| *b == block)
    }

    /// The parameter called `name`.
    pub fn get(&self, name: &str) -> Option<&Param> {
        self.params.iter().find(|p| p.name == name)
    }

    /// The elements (from 0) that a bf16 copy of the parameters needs:
    /// all, except where the layout holds the embeddings but not the head
    /// (a pipeline's first stage, not also its last). There the embedding
    /// lookup reads the f32 weights, no product reads them in bf16, and
    /// the embeddings come last ([`pipeline_stages`](Self::pipeline_stages)):
    /// up to them.
    pub fn bf16_len(&self) -> usize {
        match self.blocks.last() {
            Some((Block::Embedding, r)) if !self.holds(Block::FinalNorm) => r.start,
            _ => self.len,
        }
    }

    /// The element range of `block`.
    pub fn block_range(&self, block: Block) -> Range<usize> {
        self.blocks
            .iter()
            .find(|(b, _)| *b == block)
            .map(|(_, r)| r.clone())
            .unwrap_or(0..0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The sizes alone, as the layouts built have them: every rank of
    /// plain and interleaved cuts, embeddings last or in order.
    #[test]
    fn a_pipeline_ranks_sizes_are_its_layouts() {
        let cfg = GptConfig::parse("L6-H2-C8-V32-T16").unwrap();
        let whole = Layout::padded(&cfg, 8);
        let st = |layers: Range<usize>| Stage {
            first: layers.start == 0,
            last: layers.end == 6,
            layers,
        };
        let ranks = [
            vec![st(0..6)],
            vec![st(0..2)],
            vec![st(2..4)],
            vec![st(4..6)],
            vec![st(0..1), st(3..4)],
            vec![st(2..3), st(5..6)],
            vec![st(0..1), st(5..6)],
        ];
        for stages in ranks {
            for last in [true, false] {
                let l = whole.pipeline_stages_ordered(stages.clone(), last).unwrap();
                assert_eq!(
                    whole.pipeline_stages_len(&stages, last),
                    (l.len, l.bf16_len()),
                    "{stages:?}, embeddings last: {last}"
                );
            }
        }
    }

    #[test]
    fn a_pipeline_stage_holds_its_blocks_packed() {
        let cfg = GptConfig::parse("L4-H2-C8-V32-T16").unwrap();
        let whole = Layout::padded(&cfg, 8);
        let stage = |layers: Range<usize>, first, last| {
            whole
                .pipeline_stage(Stage {
                    layers,
                    first,
                    last,
                })
                .unwrap()
        };
        let middle = stage(1..3, false, false);
        assert_eq!(
            middle.blocks.iter().map(|(b, _)| *b).collect::<Vec<_>>(),
            [Block::Layer(1), Block::Layer(2)]
        );
        assert_eq!(
            middle.block_range(Block::Layer(1)),
            0..whole.block_range(Block::Layer(1)).len()
        );
        assert!(middle.get("wte.weight").is_none());
        let p = middle.get("h.2.ln_1.weight").unwrap();
        assert_eq!(p.offset, middle.block_range(Block::Layer(2)).start);
        let last = stage(3..4, false, true);
        assert!(last.get("wte.weight").is_some() && last.get("ln_f.bias").is_some());
        let first = stage(0..1, true, false);
        // The first stage's embeddings after its layers, left out of a
        // bf16 copy; the last stage's head reads them in bf16.
        assert_eq!(
            first.blocks.iter().map(|(b, _)| *b).collect::<Vec<_>>(),
            [Block::Layer(0), Block::Embedding]
        );
        assert_eq!(first.bf16_len(), first.block_range(Block::Embedding).start);
        assert_eq!(first.get("h.0.ln_1.weight").unwrap().offset, 0);
        assert_eq!(
            first.get("wte.weight").unwrap().offset,
            first.block_range(Block::Layer(0)).end
        );
        assert_eq!((last.bf16_len(), middle.bf16_len()), (last.len, middle.len));
        assert_eq!(whole.bf16_len(), whole.len);
        // Kept in the whole layout's order on request.
        let kept = whole
            .pipeline_stages_ordered(vec![first.stages[0].clone()], false)
            .unwrap();
        assert_eq!(kept.blocks[0].0, Block::Embedding);
        assert_eq!(kept.bf16_len(), kept.len);
        let parts = first.len + middle.len + last.len;
        // The tied embeddings, twice.
        assert_eq!(parts, whole.len + whole.block_range(Block::Embedding).len());
        assert!(whole
            .pipeline_stage(Stage {
                layers: 4..4,
                first: false,
                last: true
            })
            .is_err());
        // Interleaved: one rank's two stages, their blocks once each.
        let st = |layers: Range<usize>, first| Stage {
            layers,
            first,
            last: false,
        };
        let two = whole
            .pipeline_stages(vec![st(0..1, true), st(2..3, false)])
            .unwrap();
        assert_eq!(
            two.blocks.iter().map(|(b, _)| *b).collect::<Vec<_>>(),
            [Block::Layer(0), Block::Layer(2), Block::Embedding]
        );
        assert!(middle
            .pipeline_stage(Stage {
                layers: 1..2,
                first: false,
                last: false
            })
            .is_err());
    }

    #[test]
    fn the_buffer_is_contiguous_block_by_block_and_matches_the_count() {
        for (_, cfg) in crate::config::NAMED {
            let l = Layout::new(&cfg);
            assert_eq!(l.len, cfg.num_params());
            let mut next = 0;
            for p in &l.params {
                assert_eq!(p.offset, next, "{}", p.name);
                next += p.len;
            }
            let mut next = 0;
            for (_, r) in &l.blocks {
                assert_eq!(r.start, next);
                next = r.end;
            }
            assert_eq!(next, l.len);
            assert_eq!(l.blocks.len(), cfg.n_layer + 2);
        }
    }

    #[test]
    fn names_and_shapes_follow_the_hugging_face_checkpoint() {
        let l = Layout::new(&crate::config::GptConfig::parse("124M").unwrap());
        assert_eq!(l.get("wte.weight").unwrap().shape, vec![50257, 768]);
        assert_eq!(
            l.get("h.11.attn.c_attn.weight").unwrap().shape,
            vec![768, 2304]
        );
        assert_eq!(
            l.get("h.0.mlp.c_proj.weight").unwrap().shape,
            vec![3072, 768]
        );
        assert_eq!(l.get("ln_f.bias").unwrap().shape, vec![768]);
        assert!(!l.get("h.3.ln_2.weight").unwrap().kind.decays());
        assert!(l.get("h.3.mlp.c_fc.weight").unwrap().kind.decays());
    }
}

#[cfg(test)]
mod tensor_parallel_tests {
    use super::*;
    use crate::params::Params;
    use std::sync::Arc;

    /// The ranks' shares of every tensor, put back at their places, are
    /// the whole model's initial values, every element held by exactly
    /// one rank (cut tensors) or by all (whole ones); the vocabulary
    /// splits unevenly without padding.
    #[test]
    fn shards_put_together_are_the_whole_model() {
        let cfg = GptConfig::parse("L2-H4-C16-V37-T8").unwrap();
        let whole = Params::init_gpt2(Arc::new(Layout::new(&cfg)), 3);
        for n in [2, 4] {
            let mut seen: std::collections::HashMap<String, Vec<u32>> = Default::default();
            for r in 0..n {
                let shard = TensorShard { rank: r, size: n };
                let l = Arc::new(Layout::tensor_parallel(&cfg, shard, 8).unwrap());
                assert_eq!(l.len % 8, 0);
                let p = Params::init_gpt2(l.clone(), 3);
                for spec in &l.params {
                    let want = whole.view(&spec.name);
                    let count = seen
                        .entry(spec.name.clone())
                        .or_insert_with(|| vec![0; want.len()]);
                    let place = spec
                        .place
                        .clone()
                        .unwrap_or_else(|| crate::place::Place::whole(&spec.shape));
                    assert_eq!(place.local_shape(), spec.shape, "{}", spec.name);
                    for run in place.full_runs(0..spec.len) {
                        for k in 0..run.len {
                            let (f, x) = (run.full + k, p.data[spec.offset + run.local + k]);
                            assert_eq!(x.to_bits(), want[f].to_bits(), "{} [{f}]", spec.name);
                            count[f] += 1;
                        }
                    }
                }
            }
            for (name, count) in seen {
                let cut = name.contains("c_attn")
                    || name.contains("c_fc")
                    || name.contains("c_proj.weight")
                    || name == "wte.weight";
                let want = if cut { 1 } else { n as u32 };
                assert!(
                    count.iter().all(|&k| k == want),
                    "{name} over {n}: {count:?}"
                );
            }
        }
        let shard = |r| TensorShard { rank: r, size: 4 };
        assert_eq!(
            (0..4).map(|r| shard(r).vocab(37)).collect::<Vec<_>>(),
            vec![(0, 10), (10, 9), (19, 9), (28, 9)]
        );
        let err = Layout::tensor_parallel(&cfg, TensorShard { rank: 0, size: 3 }, 1).unwrap_err();
        assert!(err.contains("4 attention heads"), "{err}");
    }
}

#[cfg(test)]
mod padded_tests {
    use super::*;
    use crate::model::{Activations, Gpt};
    use crate::optim::{AdamWConfig, Optimizer};
    use crate::params::Params;
    use std::sync::Arc;

    /// Blocks of a padded layout start and end at the multiple, keep
    /// their tensors in order, and the tensors keep their shapes.
    #[test]
    fn padded_blocks_start_and_end_at_the_multiple() {
        let cfg = GptConfig::parse("L3-H2-C24-V37-T7").unwrap();
        let (plain, l) = (Layout::new(&cfg), Layout::padded(&cfg, 96));
        assert_eq!(l.len % 96, 0);
        assert!(l.len > plain.len);
        for (_, r) in &l.blocks {
            assert_eq!((r.start % 96, r.end % 96), (0, 0), "{r:?}");
        }
        for (a, b) in plain.params.iter().zip(&l.params) {
            assert_eq!((&a.name, &a.shape, a.len), (&b.name, &b.shape, b.len));
            let (_, block) = l
                .blocks
                .iter()
                .find(|(_, r)| r.contains(&b.offset))
                .unwrap();
            assert!(b.range().end <= block.end, "{} leaves its block", b.name);
        }
        assert_eq!(Layout::padded(&cfg, 1), plain);
    }

    /// Training on a padded layout computes what it does on the plain one:
    /// after three AdamW steps every tensor is the same bit for bit, and
    /// the gaps are still zero.
    #[test]
    fn a_padded_layout_trains_bit_for_bit_like_the_plain_one() {
        let cfg = GptConfig::parse("L2-H2-C16-V31-T8").unwrap();
        let (b, t) = (2, 8);
        let tokens: Vec<u32> = (0..b * t).map(|i| (i * 7 % 31) as u32).collect();
        let targets: Vec<u32> = (0..b * t).map(|i| (i * 11 % 31) as u32).collect();
        let train = |layout: Layout| {
            let layout = Arc::new(layout);
            let mut p = Params::init_gpt2(layout.clone(), 9);
            let model = Gpt::new(layout.clone());
            let mut acts = Activations::new(&layout, b, t, false);
            let mut opt = Optimizer::adamw(&layout, AdamWConfig::default());
            for _ in 0..3 {
                let mut g = vec![0.0f32; layout.len];
                model
                    .forward_backward(
                        &p.data,
                        &mut g,
                        &mut acts,
                        &tokens,
                        &targets,
                        &mut |_, _| {},
                    )
                    .unwrap();
                opt.step(&mut p, &g, 1e-2);
            }
            p
        };
        let (plain, padded) = (train(Layout::new(&cfg)), train(Layout::padded(&cfg, 160)));
        for spec in &plain.layout.params {
            let (x, y) = (plain.view(&spec.name), padded.view(&spec.name));
            let differ = x.iter().zip(y).filter(|(a, b)| a.to_bits() != b.to_bits());
            assert_eq!(differ.count(), 0, "{} differs", spec.name);
        }
        let mut used = vec![false; padded.layout.len];
        for spec in &padded.layout.params {
            used[spec.range()].iter_mut().for_each(|u| *u = true);
        }
        let gaps = used.iter().zip(&padded.data).filter(|(u, _)| !**u);
        assert!(gaps.clone().count() > 0);
        assert!(gaps.into_iter().all(|(_, &x)| x == 0.0), "a gap moved");
    }
}
