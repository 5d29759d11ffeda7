//! A request ([`Request`]), the checks it must pass ([`RequestError`]),
//! and what the batcher says of it as it runs ([`Event`]).

use braid_model::sample::Sampling;

/// One completion to run.
#[derive(Debug, Clone)]
pub struct Request {
    /// The prompt's tokens (at least one).
    pub prompt: Vec<u32>,
    /// Tokens to generate at most (at least one).
    pub max_tokens: usize,
    /// How each token is chosen.
    pub sampling: Sampling,
    /// Texts that end the completion when generated (not included).
    pub stop: Vec<String>,
    /// Whether each token's log-probability comes back.
    pub logprobs: bool,
}

/// Why a request cannot run.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RequestError {
    /// No prompt tokens.
    #[error("the prompt is empty: give at least one token of text")]
    EmptyPrompt,
    /// `max_tokens` of 0.
    #[error("max_tokens is 0: ask for at least one token")]
    NoTokens,
    /// The prompt leaves no room in the context.
    #[error(
        "the prompt is {prompt} tokens and the model's context is {context}: shorten it to at most \
         {} tokens so that one can be generated",
        context - 1
    )]
    PromptTooLong { prompt: usize, context: usize },
    /// Sampling values out of range.
    #[error("{0}")]
    Sampling(String),
    /// A token the model does not have.
    #[error("prompt token {token} is outside the model's vocabulary of {vocab}")]
    Token { token: u32, vocab: usize },
    /// More than the whole cache.
    #[error(
        "the request needs {needed} KV blocks (prompt and max_tokens) and the cache has {blocks} \
         in all: lower max_tokens, or give the server more KV memory"
    )]
    TooBig { needed: usize, blocks: usize },
    /// The queue is full (back-pressure).
    #[error("the server is busy: {0} requests are queued already (retry later)")]
    Busy(usize),
    /// The id is taken.
    #[error("request id {0} is in use")]
    Duplicate(u64),
    /// The engine thread is gone.
    #[error("the serving engine has stopped (see the server's log): restart the server")]
    Stopped,
}

/// Why a completion ended (OpenAI's `finish_reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// `max_tokens` reached, or the context filled.
    Length,
    /// A stop string or the end-of-text token.
    Stop,
    /// Cancelled by its client.
    Cancelled,
}

impl Finish {
    /// OpenAI's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Length => "length",
            Finish::Stop => "stop",
            Finish::Cancelled => "cancelled",
        }
    }
}

/// One generated token.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenOut {
    pub token: u32,
    /// Its natural log-probability under the model (before temperature
    /// and filters), when asked for.
    pub logprob: Option<f32>,
    /// The text it adds (may be empty while a character or a possible
    /// stop string is unfinished).
    pub text: String,
}

/// Token counts of a finished request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt positions read from the prefix cache instead of computed.
    pub cached_tokens: usize,
}

/// What the batcher says of a request.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A new token.
    Token(TokenOut),
    /// The end: the last text held back (if any), why, and the counts.
    Done {
        text: String,
        finish: Finish,
        usage: Usage,
    },
    /// The step failed (the model's error): the request is dropped.
    Failed(String),
}
