//! [`GptConfig`]: the shape of a GPT-2 family model — named sizes and
//! custom ones — and the parameter count it implies.

use serde::{Deserialize, Serialize};

/// Layers, heads, width, vocabulary and context of a GPT model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct GptConfig {
    /// Transformer blocks.
    pub n_layer: usize,
    /// Attention heads per block.
    pub n_head: usize,
    /// Model width (embedding size); a multiple of `n_head`.
    pub n_embd: usize,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Longest sequence (position embeddings).
    pub context: usize,
}

/// GPT-2's vocabulary (its BPE tokenizer).
pub use braid_data::tokens::GPT2_VOCAB;

/// The named configurations, smallest first.
pub const NAMED: [(&str, GptConfig); 5] = [
    (
        "tiny",
        GptConfig {
            n_layer: 2,
            n_head: 4,
            n_embd: 64,
            vocab_size: 256,
            context: 64,
        },
    ),
    (
        "124M",
        GptConfig {
            n_layer: 12,
            n_head: 12,
            n_embd: 768,
            vocab_size: GPT2_VOCAB,
            context: 1024,
        },
    ),
    (
        "350M",
        GptConfig {
            n_layer: 24,
            n_head: 16,
            n_embd: 1024,
            vocab_size: GPT2_VOCAB,
            context: 1024,
        },
    ),
    (
        "774M",
        GptConfig {
            n_layer: 36,
            n_head: 20,
            n_embd: 1280,
            vocab_size: GPT2_VOCAB,
            context: 1024,
        },
    ),
    (
        "1558M",
        GptConfig {
            n_layer: 48,
            n_head: 25,
            n_embd: 1600,
            vocab_size: GPT2_VOCAB,
            context: 1024,
        },
    ),
];

impl GptConfig {
    /// A named configuration (`tiny`, `124M`, `350M`, `774M`, `1558M`;
    /// `gpt2`, `gpt2-medium`, `gpt2-large`, `gpt2-xl` as aliases) or a
    /// custom one written `L<layers>-H<heads>-C<width>[-V<vocab>][-T<context>]`,
    /// e.g. `L4-H4-C128-V256-T128`.
    pub fn parse(name: &str) -> Result<GptConfig, String> {
        let alias = match name {
            "gpt2" => "124M",
            "gpt2-medium" => "350M",
            "gpt2-large" => "774M",
            "gpt2-xl" => "1558M",
            other => other,
        };
        if let Some((_, c)) = NAMED.iter().find(|(n, _)| n.eq_ignore_ascii_case(alias)) {
            return Ok(*c);
        }
        Self::parse_custom(name).map_err(|why| {
            let names: Vec<&str> = NAMED.iter().map(|(n, _)| *n).collect();
            format!(
                "unknown model {name:?} ({why}): expected one of {} or a custom L<layers>-H<heads>-C<width>[-V<vocab>][-T<context>]",
                names.join(", ")
            )
        })
    }

    fn parse_custom(s: &str) -> Result<GptConfig, String> {
        let mut c = GptConfig {
            n_layer: 0,
            n_head: 0,
            n_embd: 0,
            vocab_size: 256,
            context: 256,
        };
        for part in s.split('-') {
            let (key, num) = part.split_at(part.chars().next().map_or(0, |ch| ch.len_utf8()));
            let v: usize = num
                .parse()
                .map_err(|_| format!("{part:?} is not a letter followed by a number"))?;
            match key {
                "L" | "l" => c.n_layer = v,
                "H" | "h" => c.n_head = v,
                "C" | "c" => c.n_embd = v,
                "V" | "v" => c.vocab_size = v,
                "T" | "t" => c.context = v,
                _ => return Err(format!("unknown field {key:?}")),
            }
        }
        c.validate()?;
        Ok(c)
    }

    /// Checks that the sizes fit together.
    pub fn validate(&self) -> Result<(), String> {
        if self.n_layer == 0 || self.n_head == 0 || self.n_embd == 0 {
            return Err("layers, heads and width must all be positive".into());
        }
        if self.n_embd % self.n_head != 0 {
            return Err(format!(
                "width {} is not a multiple of the {} heads",
                self.n_embd, self.n_head
            ));
        }
        if self.vocab_size == 0 || self.context == 0 {
            return Err("vocabulary and context must be positive".into());
        }
        // Bytes of every per-parameter buffer must stay addressable.
        if self.params_u128() > (usize::MAX / 32) as u128 {
            return Err(format!(
                "{:.3e} parameters: more than any machine can address",
                self.params_u128() as f64
            ));
        }
        Ok(())
    }

    /// Width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.n_embd / self.n_head
    }

    /// Total number of parameters (the LM head is tied to the token
    /// embedding, so it adds none). Fits `usize` for every validated
    /// configuration.
    pub fn num_params(&self) -> usize {
        self.params_u128() as usize
    }

    /// [`num_params`](Self::num_params) in arithmetic no configuration
    /// overflows (validation uses it to refuse the impossible ones).
    pub fn params_u128(&self) -> u128 {
        let c = self.n_embd as u128;
        self.vocab_size as u128 * c
            + self.context as u128 * c
            + self.n_layer as u128 * self.block_params_u128()
            + 2 * c
    }

    /// Parameters of one transformer block (two LayerNorms, the attention's
    /// two projections, the MLP's two).
    pub fn block_params_u128(&self) -> u128 {
        let c = self.n_embd as u128;
        2 * c + (c * 3 * c + 3 * c) + (c * c + c) + 2 * c + (c * 4 * c + 4 * c) + (4 * c * c + c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameter_counts_never_overflow_and_impossible_ones_are_refused() {
        let huge = GptConfig::parse("L99999-H64-C65536").unwrap();
        assert_eq!(huge.num_params() as u128, huge.params_u128());
        assert!(huge.num_params() > 5_000_000_000_000_000);
        let err = GptConfig::parse("L99999999-H64-C99999936").unwrap_err();
        assert!(err.contains("more than any machine can address"), "{err}");
    }

    #[test]
    fn gpt2_124m_has_its_published_parameter_count() {
        // The Hugging Face gpt2 checkpoint holds 124,439,808 parameters.
        assert_eq!(GptConfig::parse("124M").unwrap().num_params(), 124_439_808);
        assert_eq!(
            GptConfig::parse("gpt2-xl").unwrap().num_params(),
            1_557_611_200
        );
    }

    #[test]
    fn custom_configs_parse_and_bad_ones_are_explained() {
        let c = GptConfig::parse("L4-H4-C128-V300-T32").unwrap();
        assert_eq!(
            (c.n_layer, c.n_head, c.n_embd, c.vocab_size, c.context),
            (4, 4, 128, 300, 32)
        );
        let e = GptConfig::parse("L2-H3-C64").unwrap_err();
        assert!(e.contains("not a multiple"), "{e}");
        let e = GptConfig::parse("huge").unwrap_err();
        assert!(e.contains("tiny") && e.contains("124M"), "{e}");
    }
}
