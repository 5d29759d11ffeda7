//! The GPT engines' loaders: [`TokenWindows`] (from `braid-data`: a
//! dataset's windows dealt out by the distributed sampler) and
//! [`check_fits`], which checks a dataset against a model.

use crate::Result;
use braid_data::loader::WindowSource;

/// Checks that sequences of `seq` tokens from `data` fit a model of `cfg`.
pub fn check_fits(cfg: &braid_model::GptConfig, seq: usize, data: &dyn WindowSource) -> Result<()> {
    if seq > cfg.context {
        return Err(format!(
            "--seq {seq} exceeds the model's context {}: use --seq {} or less, or a model with a \
             longer context (a custom model without -T takes --seq's, e.g. --model \
             L{}-H{}-C{})",
            cfg.context, cfg.context, cfg.n_layer, cfg.n_head, cfg.n_embd
        ));
    }
    if data.max_token() as usize >= cfg.vocab_size {
        return Err(format!(
            "the data holds token {} but the model's vocabulary has {} (pick a model or tokenizer that match)",
            data.max_token(),
            cfg.vocab_size
        ));
    }
    Ok(())
}

pub use braid_data::loader::TokenWindows;
