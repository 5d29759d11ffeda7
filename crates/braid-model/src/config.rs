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
            if let Some(near) = nearest_name(name) {
                return format!("unknown model {name:?}: did you mean {near}?");
            }
            let names: Vec<&str> = NAMED.iter().map(|(n, _)| *n).collect();
            format!(
                "unknown model {name:?} ({why}): expected one of {} (or gpt2, gpt2-medium, gpt2-large, gpt2-xl), or a custom L<layers>-H<heads>-C<width>[-V<vocab>][-T<context>]",
                names.join(", ")
            )
        })
    }

    /// Whether the model `name` sets its vocabulary itself (a custom
    /// configuration with a `-V` part); a named model, or a custom one
    /// without it, may take its data's vocabulary instead.
    pub fn names_vocab(name: &str) -> bool {
        NAMED.iter().all(|(n, _)| !n.eq_ignore_ascii_case(name))
            && name
                .split('-')
                .any(|p| p.len() > 1 && (p.starts_with('V') || p.starts_with('v')))
    }

    /// Whether the model `name` sets its context itself (a named model, or
    /// a custom one with a `-T` part); a custom one without it may take
    /// its context from the run's sequence length instead.
    pub fn names_context(name: &str) -> bool {
        Self::parse_custom(name).is_err()
            || name
                .split('-')
                .any(|p| p.len() > 1 && (p.starts_with('T') || p.starts_with('t')))
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

/// The named model a mistyped name most likely meant: a size such as
/// `125M` or `1.5B` goes to the named size nearest it (within a factor of
/// 1.5), anything else to a name or alias within two edits.
fn nearest_name(name: &str) -> Option<&'static str> {
    const ALIASES: [&str; 4] = ["gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"];
    let lower = name.to_ascii_lowercase();
    let size = |s: &str| -> Option<f64> {
        let (num, mult) = match s.chars().last()? {
            'm' => (&s[..s.len() - 1], 1e6),
            'b' => (&s[..s.len() - 1], 1e9),
            _ => return None,
        };
        num.parse::<f64>()
            .ok()
            .filter(|v| *v > 0.0)
            .map(|v| v * mult)
    };
    if let Some(want) = size(&lower) {
        return NAMED
            .iter()
            .filter_map(|(n, _)| size(&n.to_ascii_lowercase()).map(|v| (*n, (v / want).ln().abs())))
            .filter(|(_, d)| *d < 1.5f64.ln())
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .map(|(n, _)| n);
    }
    NAMED
        .iter()
        .map(|(n, _)| *n)
        .chain(ALIASES)
        .map(|n| (n, edit_distance(&lower, &n.to_ascii_lowercase())))
        .filter(|(_, d)| *d <= 2)
        .min_by_key(|(_, d)| *d)
        .map(|(n, _)| n)
}

/// Levenshtein distance between two short strings.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let here = row[j + 1];
            row[j + 1] = (prev + usize::from(ca != *cb))
                .min(row[j] + 1)
                .min(here + 1);
            prev = here;
        }
    }
    row[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mistyped_names_get_the_nearest_model() {
        let err = |m: &str| GptConfig::parse(m).unwrap_err();
        assert!(
            err("125M").contains("did you mean 124M?"),
            "{}",
            err("125M")
        );
        assert!(
            err("1.5B").contains("did you mean 1558M?"),
            "{}",
            err("1.5B")
        );
        assert!(
            err("gtp2").contains("did you mean gpt2?"),
            "{}",
            err("gtp2")
        );
        assert!(
            err("tinyy").contains("did you mean tiny?"),
            "{}",
            err("tinyy")
        );
        assert!(!err("7B").contains("did you mean"), "{}", err("7B"));
        assert!(!err("L2-H3-C64").contains("did you mean"));
    }

    #[test]
    fn only_a_custom_v_part_pins_the_vocabulary() {
        assert!(!GptConfig::names_vocab("tiny"));
        assert!(!GptConfig::names_vocab("124M"));
        assert!(!GptConfig::names_vocab("L2-H4-C64"));
        assert!(GptConfig::names_vocab("L2-H4-C64-V512"));
        for named in ["tiny", "124M", "gpt2-xl", "L2-H4-C64-T128"] {
            assert!(GptConfig::names_context(named), "{named}");
        }
        assert!(!GptConfig::names_context("L2-H4-C64-V512"));
    }

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
