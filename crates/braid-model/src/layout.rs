//! Where every parameter lives in the flat buffer.
//!
//! All parameters of a model are one contiguous `f32` buffer (likewise the
//! gradients), laid out block by block so that a block's parameters — and
//! so its gradients — are one slice: the unit that data-parallel buckets
//! and sharded training cut. Names and shapes are those of the Hugging Face
//! GPT-2 checkpoint (`wte.weight`, `h.0.attn.c_attn.weight` [C, 3C], …), so
//! its safetensors file loads directly.

use crate::config::GptConfig;
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
}

impl Param {
    /// Its elements' range in the flat buffer.
    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.len
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

/// The layout of a model's flat parameter buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// The model's configuration.
    pub config: GptConfig,
    /// Every parameter, in buffer order.
    pub params: Vec<Param>,
    /// Element ranges of the blocks: embedding, layers 0.., final norm.
    pub blocks: Vec<(Block, Range<usize>)>,
    /// Total number of elements.
    pub len: usize,
}

impl Layout {
    /// The layout of `config`.
    pub fn new(config: &GptConfig) -> Layout {
        let (c, v, t) = (config.n_embd, config.vocab_size, config.context);
        let mut params = Vec::new();
        let mut blocks = Vec::new();
        let mut offset = 0;
        let mut add = |params: &mut Vec<Param>, name: String, shape: Vec<usize>, kind: Kind| {
            let len = shape.iter().product();
            params.push(Param {
                name,
                shape,
                offset,
                len,
                kind,
            });
            offset += len;
        };
        let start = 0;
        add(
            &mut params,
            "wte.weight".into(),
            vec![v, c],
            Kind::Embedding,
        );
        add(
            &mut params,
            "wpe.weight".into(),
            vec![t, c],
            Kind::Embedding,
        );
        blocks.push((
            Block::Embedding,
            start..params.last().map_or(0, |p| p.offset + p.len),
        ));
        for i in 0..config.n_layer {
            let p = |s: &str| format!("h.{i}.{s}");
            let first = params.last().map_or(0, |p| p.offset + p.len);
            add(&mut params, p("ln_1.weight"), vec![c], Kind::NormWeight);
            add(&mut params, p("ln_1.bias"), vec![c], Kind::NormBias);
            add(
                &mut params,
                p("attn.c_attn.weight"),
                vec![c, 3 * c],
                Kind::Weight,
            );
            add(&mut params, p("attn.c_attn.bias"), vec![3 * c], Kind::Bias);
            add(
                &mut params,
                p("attn.c_proj.weight"),
                vec![c, c],
                Kind::ResidualWeight,
            );
            add(&mut params, p("attn.c_proj.bias"), vec![c], Kind::Bias);
            add(&mut params, p("ln_2.weight"), vec![c], Kind::NormWeight);
            add(&mut params, p("ln_2.bias"), vec![c], Kind::NormBias);
            add(
                &mut params,
                p("mlp.c_fc.weight"),
                vec![c, 4 * c],
                Kind::Weight,
            );
            add(&mut params, p("mlp.c_fc.bias"), vec![4 * c], Kind::Bias);
            add(
                &mut params,
                p("mlp.c_proj.weight"),
                vec![4 * c, c],
                Kind::ResidualWeight,
            );
            add(&mut params, p("mlp.c_proj.bias"), vec![c], Kind::Bias);
            let end = params.last().map_or(0, |p| p.offset + p.len);
            blocks.push((Block::Layer(i), first..end));
        }
        let first = params.last().map_or(0, |p| p.offset + p.len);
        add(&mut params, "ln_f.weight".into(), vec![c], Kind::NormWeight);
        add(&mut params, "ln_f.bias".into(), vec![c], Kind::NormBias);
        let len = params.last().map_or(0, |p| p.offset + p.len);
        blocks.push((Block::FinalNorm, first..len));
        Layout {
            config: *config,
            params,
            blocks,
            len,
        }
    }

    /// The parameter called `name`.
    pub fn get(&self, name: &str) -> Option<&Param> {
        self.params.iter().find(|p| p.name == name)
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
