//! Requests run to the end without a server ([`complete`]): what `braid
//! generate` uses, one prompt or a file of them decoded together; and the
//! burst `braid serve` runs on a GPU before it listens ([`warm_up`]).

use crate::batcher::Batcher;
use crate::decoder::Decoder;
use crate::request::{Event, Finish, Request, RequestError};
use std::time::{Duration, Instant};

/// One request's completion.
#[derive(Debug, Clone)]
pub struct Completion {
    pub tokens: Vec<u32>,
    pub text: String,
    pub finish: Finish,
    /// From the start of the run to its first token.
    pub time_to_first: Option<Duration>,
    /// From the start of the run to its end.
    pub elapsed: Duration,
}

/// Runs `requests` on `batcher` together, in their order; a request it
/// refuses is said with its index.
pub fn complete<D: Decoder>(
    batcher: &mut Batcher<D>,
    requests: Vec<Request>,
) -> Result<Vec<Completion>, String> {
    let n = requests.len();
    let mut pending = requests.into_iter().enumerate().peekable();
    let mut out: Vec<Option<Completion>> = vec![None; n];
    let mut partial: Vec<(Vec<u32>, String, Option<Duration>)> =
        vec![(Vec::new(), String::new(), None); n];
    let start = Instant::now();
    let mut left = n;
    while left > 0 {
        // Queue what the batcher's queue takes now.
        while let Some((i, r)) = pending.peek() {
            match batcher.submit(*i as u64, r.clone()) {
                Ok(()) => {
                    pending.next();
                }
                Err(RequestError::Busy(_)) => break,
                Err(e) => return Err(format!("prompt {}: {e}", i + 1)),
            }
        }
        let events = batcher.step();
        if events.is_empty() && batcher.idle() && pending.peek().is_none() {
            return Err(
                "the batcher stopped with requests unfinished (a bug: please report it)".into(),
            );
        }
        for (id, e) in events {
            let i = id as usize;
            match e {
                Event::Token(t) => {
                    let p = &mut partial[i];
                    p.0.push(t.token);
                    p.1 += &t.text;
                    p.2.get_or_insert_with(|| start.elapsed());
                }
                Event::Done { text, finish, .. } => {
                    let (tokens, mut all, first) = std::mem::take(&mut partial[i]);
                    all += &text;
                    out[i] = Some(Completion {
                        tokens,
                        text: all,
                        finish,
                        time_to_first: first,
                        elapsed: start.elapsed(),
                    });
                    left -= 1;
                }
                Event::Failed(e) => return Err(format!("prompt {}: {e}", i + 1)),
            }
        }
    }
    Ok(out
        .into_iter()
        .map(|c| c.expect("every request ended"))
        .collect())
}

/// What [`warm_up`] ran.
#[derive(Debug, Clone, Copy)]
pub struct WarmUp {
    /// The full burst: requests and each one's prompt tokens.
    pub requests: usize,
    pub prompt_tokens: usize,
    /// The smaller bursts, one per row count the decoder prepares below
    /// the full one.
    pub smaller: usize,
    pub elapsed: Duration,
}

/// A burst shaped like a full load, run before a server takes requests,
/// so that the first clients do not pay for what a decoder does once per
/// shape (the scratch grown to a full step's rows, CUDA graphs captured
/// for the steady steps of every running sequence, the products' plans):
/// as many requests as run at once, with distinct prompts (the prefix
/// cache shares none) that together fill a step's tokens, three greedy
/// tokens each; then, for each row count below that which the decoder
/// prepares once ([`Decoder::prepared_rows`]), a burst of that many
/// one-token prompts, so a first client at any concurrency finds its
/// steps ready. Prompt tokens are ids below `vocab`, each prompt shorter
/// than `context`.
pub fn warm_up<D: Decoder>(
    batcher: &mut Batcher<D>,
    vocab: usize,
    context: usize,
) -> Result<WarmUp, String> {
    let o = batcher.options();
    let n = o.max_running.max(1);
    let len = o
        .step_tokens
        .div_ceil(n)
        .clamp(1, context.saturating_sub(4).max(1));
    let burst = |count: usize, len: usize, salt: usize| -> Vec<Request> {
        (0..count)
            .map(|i| Request {
                prompt: (0..len)
                    .map(|j| ((salt + i * 7919 + j * 104_729 + 1) % vocab.max(1)) as u32)
                    .collect(),
                max_tokens: 3,
                sampling: braid_model::sample::Sampling {
                    temperature: 0.0,
                    top_k: 0,
                    top_p: 1.0,
                    seed: 0,
                },
                stop: Vec::new(),
                logprobs: false,
            })
            .collect()
    };
    let start = Instant::now();
    complete(batcher, burst(n, len, 0)).map_err(|e| format!("warming up: {e}"))?;
    let smaller: Vec<usize> = batcher
        .decoder()
        .prepared_rows()
        .into_iter()
        .filter(|&b| b > 0 && b < n)
        .collect();
    for &b in &smaller {
        complete(batcher, burst(b, 1, 31 * b)).map_err(|e| format!("warming up: {e}"))?;
    }
    Ok(WarmUp {
        requests: n,
        prompt_tokens: len,
        smaller: smaller.len(),
        elapsed: start.elapsed(),
    })
}
