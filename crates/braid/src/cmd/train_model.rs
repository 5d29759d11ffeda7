//! `braid train`'s model and data before anything is allocated: the
//! model's configuration (a loaded file's, or the named one, grown to the
//! data's vocabulary and the run's context where its name sets none), the
//! tokenizer, the data, the sequence length, and under `--pp` the
//! pipeline's schedule checked against them.

use super::train::{open_data, tokenizer_for, TrainArgs, TrainData};
use super::train_check::Choices;
use super::train_pipeline::PipeFlags;
use super::train_place::Placement;
use braid_data::tokens::Tokenizer;
use braid_model::checkpoint;
use braid_model::config::GPT2_VOCAB;
use braid_model::GptConfig;
use braid_train::schedule::check::Checked as PipeSchedule;

/// The model a run trains and the data it trains on.
pub struct ModelData {
    /// The model in the pre-flight's messages: a loaded file's path, else
    /// the model's name.
    pub model_name: String,
    /// The model's configuration (before its parameters are made).
    pub cfg: GptConfig,
    pub tokenizer: Tokenizer,
    pub data: TrainData,
    /// Tokens per sequence.
    pub seq: usize,
    /// Where the vocabulary or the context came from the data or `--seq`,
    /// a note saying so.
    pub vocab_note: Option<String>,
    pub context_note: Option<String>,
}

/// The model's configuration, tokenizer, data and sequence length for
/// the run `c` describes.
pub fn model_and_data(a: &TrainArgs, c: &Choices) -> Result<ModelData, String> {
    let model = &c.model;
    // A loaded model is named by its file in the pre-flight's messages.
    let model_name = match &a.load {
        Some(path) => path.display().to_string(),
        None => model.clone(),
    };
    let (mut cfg, saved_tok) = config_of(a, model)?;
    let mut tokenizer = tokenizer_for(a.tokenizer.as_deref(), saved_tok.as_ref(), cfg.vocab_size)?;
    let data = open_data(&a.data, tokenizer, a.seed)?;
    let vocab_note = vocab_from_data(a, model, &data, &mut cfg, &mut tokenizer)?;
    let seq = match (a.seq, data.window) {
        (Some(s), _) => s,
        (None, Some(w)) => w.min(cfg.context),
        (None, None) => 64.min(cfg.context),
    };
    let context_note = context_from_seq(a, model, seq, &mut cfg);
    Ok(ModelData {
        model_name,
        cfg,
        tokenizer,
        data,
        seq,
        vocab_note,
        context_note,
    })
}

/// The model's configuration before anything is allocated: a loaded
/// file's (and the tokenizer it names), or the named one, whose
/// vocabulary grows to the data's where the name sets none (as nanoGPT
/// takes its data's).
fn config_of(a: &TrainArgs, model: &str) -> Result<(GptConfig, Option<String>), String> {
    Ok(match &a.load {
        Some(path) => {
            let (cfg, meta) = checkpoint::header_of(path).map_err(|e| e.to_string())?;
            (cfg, meta.get("braid.tokenizer").cloned())
        }
        None => (GptConfig::parse(model)?, None),
    })
}

/// Grows a named model's vocabulary (`cfg`'s) to the data's, where the
/// name sets none and the data holds larger tokens, with the tokenizer
/// for it; a note saying so when it does.
fn vocab_from_data(
    a: &TrainArgs,
    model: &str,
    data: &TrainData,
    cfg: &mut GptConfig,
    tokenizer: &mut Tokenizer,
) -> Result<Option<String>, String> {
    let data_vocab = data.source.max_token() as usize + 1;
    if a.load.is_some() || GptConfig::names_vocab(model) || data_vocab <= cfg.vocab_size {
        return Ok(None);
    }
    let vocab = match data_vocab <= GPT2_VOCAB {
        true => GPT2_VOCAB,
        false => data_vocab,
    };
    let vocab_note = Some(format!(
        "vocabulary {vocab} from the data (it holds tokens up to {}; the model {} has {}: \
         name one with -V to choose)",
        data_vocab - 1,
        model,
        cfg.vocab_size
    ));
    cfg.vocab_size = vocab;
    cfg.validate()?;
    *tokenizer = tokenizer_for(a.tokenizer.as_deref(), None, vocab)?;
    Ok(vocab_note)
}

/// A custom model that names no context (-T) takes the run's (`seq`,
/// where longer than `cfg`'s); a note saying so when it does.
fn context_from_seq(a: &TrainArgs, model: &str, seq: usize, cfg: &mut GptConfig) -> Option<String> {
    if a.load.is_some() || seq <= cfg.context || GptConfig::names_context(model) {
        return None;
    }
    let context_note = Some(format!(
        "context {seq} from --seq (the model {} names none; -T<context> in its name sets it)",
        model
    ));
    cfg.context = seq;
    context_note
}

/// Under `--pp`: the schedule and the stages, checked (the most basic
/// first), and the micro-batches' rows; and under sequence parallelism,
/// a batch whose tokens split over the tensor group.
pub fn pipeline_schedule(
    a: &TrainArgs,
    flags: &PipeFlags<'_>,
    m: &ModelData,
    p: &Placement,
    sequence: bool,
) -> Result<Option<PipeSchedule>, String> {
    let (batch, seq) = (p.batch, m.seq);
    let pipe_schedule = match a.pp {
        1 => None,
        _ => Some(super::train_pipeline::checked(
            flags,
            Some(&m.cfg),
            &m.model_name,
            Some(batch),
        )?),
    };
    if let (Some(s), true) = (&pipe_schedule, sequence) {
        let rows = batch / s.micro_batches;
        if (rows * seq) % a.tp != 0 {
            return Err(format!(
                "sequence parallelism splits a micro-batch's {rows} x {seq} tokens over the {} \
                 ranks of a tensor group: pick a --batch, --micro-batches or --seq whose \
                 micro-batch divides by {} (or --no-sp)",
                a.tp, a.tp
            ));
        }
    }
    if p.place.sequence && (batch * seq) % a.tp != 0 {
        return Err(format!(
            "sequence parallelism splits a batch's {batch} x {seq} tokens over the {} ranks of a \
             tensor group: pick a --batch or --seq whose product divides by {} (or --no-sp)",
            a.tp, a.tp
        ));
    }
    Ok(pipe_schedule)
}
