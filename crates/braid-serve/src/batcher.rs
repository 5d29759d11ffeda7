//! [`Batcher`]: continuous batching over one paged KV cache.
//!
//! Every [`step`](Batcher::step) runs one decode of the model over rows
//! of many sequences: first one row for each running sequence past its
//! prompt (its last token), then prompt chunks of sequences still in
//! their prefill, in arrival order, while the step's token budget lasts
//! (chunked prefill: a long prompt does not stall the decodes). A request
//! joins at the first step with room for it and leaves at the step that
//! finishes it; its blocks go back at once.
//!
//! Admission reserves the blocks a request may ever need (its prompt and
//! `max_tokens`, within the context), so a running sequence never waits
//! for a block: when the cache is full, requests wait in a bounded queue
//! in arrival order (and beyond the bound are refused as busy). A prompt
//! prefix that another sequence's blocks already hold is read from them
//! (prefix caching, [`braid_model::paged`]): a block becomes known only
//! once the step that computes it has been given its rows, and every
//! layer writes the step's keys and values before any row attends, so a
//! block shared within its own step is read after it is written.

use crate::decoder::Decoder;
use crate::request::{Event, Finish, Request, RequestError, TokenOut, Usage};
use crate::text::TextStream;
use braid_data::tokens::Tokenizer;
use braid_model::paged::{BlockPool, BlockTable};
use braid_model::sample::Sampler;
use braid_model::{log_softmax_at, DecodeRow, Logits};
use std::collections::VecDeque;

/// How the batcher shares out a step.
#[derive(Debug, Clone, Copy)]
pub struct BatcherOptions {
    /// Rows (tokens) one step runs at most: every running sequence's
    /// decode row, then prompt chunks.
    pub step_tokens: usize,
    /// Sequences running at once at most.
    pub max_running: usize,
    /// Requests waiting at most; more are refused as busy.
    pub max_waiting: usize,
}

impl Default for BatcherOptions {
    /// The CPU's: steps of up to 512 tokens.
    fn default() -> Self {
        BatcherOptions {
            step_tokens: 512,
            max_running: 64,
            max_waiting: 256,
        }
    }
}

impl BatcherOptions {
    /// The defaults of a GPU (`gpu`) or the CPU. A GPU's steps take up to
    /// 2048 tokens (a prefill's fixed costs per step shared by more prompt
    /// rows; on an H100 at 64 requests in flight, 124M, 40.8 K output
    /// tokens/s against 35.0 K at 512).
    pub fn for_device(gpu: bool) -> Self {
        match gpu {
            true => BatcherOptions {
                step_tokens: 2048,
                ..Self::default()
            },
            false => Self::default(),
        }
    }
}

/// What the batcher holds now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Stats {
    pub waiting: usize,
    pub running: usize,
    pub blocks_used: usize,
    pub blocks: usize,
}

/// One sequence.
struct Seq {
    id: u64,
    prompt: Vec<u32>,
    table: BlockTable,
    /// Prompt positions whose keys and values are in the cache.
    prefilled: usize,
    /// Of those, read from the prefix cache.
    cached: usize,
    generated: Vec<u32>,
    sampler: Sampler,
    max_tokens: usize,
    logprobs: bool,
    text: TextStream,
    /// Blocks reserved for it at admission.
    reserved: usize,
}

/// A row to run and whose sequence it is.
struct Planned {
    seq: usize,
    token: u32,
    pos: usize,
    logits: bool,
}

/// Continuous batching of requests over a [`Decoder`].
pub struct Batcher<D> {
    decoder: D,
    pool: BlockPool,
    tokenizer: Tokenizer,
    options: BatcherOptions,
    waiting: VecDeque<(u64, Request)>,
    running: Vec<Seq>,
    /// The last step's logits (their memory kept for the next step).
    logits: Logits,
    /// Blocks reserved by the running sequences.
    reserved: usize,
    /// Tokens that may be chosen: the tokenizer's (a model's vocabulary
    /// may be padded past it).
    writable: usize,
    /// The end-of-text token, if the tokenizer has one.
    eos: Option<u32>,
}

impl<D: Decoder> Batcher<D> {
    pub fn new(decoder: D, tokenizer: Tokenizer, options: BatcherOptions) -> Batcher<D> {
        let pool = BlockPool::new(decoder.blocks(), decoder.block_size());
        let writable = tokenizer.vocab_size().min(decoder.vocab());
        let eos = match tokenizer {
            Tokenizer::Gpt2 => Some(50256),
            Tokenizer::Bytes => None,
        };
        Batcher {
            decoder,
            pool,
            tokenizer,
            options: BatcherOptions {
                step_tokens: options.step_tokens.max(1),
                max_running: options.max_running.max(1),
                ..options
            },
            waiting: VecDeque::new(),
            running: Vec::new(),
            logits: {
                let mut l = Logits::new();
                l.pick_among(writable);
                l
            },
            reserved: 0,
            writable,
            eos,
        }
    }

    /// How steps are shared out.
    pub fn options(&self) -> BatcherOptions {
        self.options
    }

    /// The model decoding.
    pub fn decoder(&self) -> &D {
        &self.decoder
    }

    /// The tokenizer requests are written in.
    pub fn tokenizer(&self) -> Tokenizer {
        self.tokenizer
    }

    /// Blocks a request reserves: its prompt and `max_tokens` within the
    /// context, and one for a copy on write.
    fn blocks_for(&self, r: &Request) -> usize {
        let positions = (r.prompt.len() + r.max_tokens).min(self.decoder.context());
        positions.div_ceil(self.decoder.block_size()) + 1
    }

    /// Checks a request against the model and the cache, without queuing
    /// it.
    pub fn check(&self, r: &Request) -> Result<(), RequestError> {
        let context = self.decoder.context();
        if r.prompt.is_empty() {
            return Err(RequestError::EmptyPrompt);
        }
        if r.max_tokens == 0 {
            return Err(RequestError::NoTokens);
        }
        if r.prompt.len() >= context {
            return Err(RequestError::PromptTooLong {
                prompt: r.prompt.len(),
                context,
            });
        }
        if let Some(&token) = r
            .prompt
            .iter()
            .find(|&&t| t as usize >= self.decoder.vocab())
        {
            return Err(RequestError::Token {
                token,
                vocab: self.decoder.vocab(),
            });
        }
        r.sampling
            .check()
            .map_err(|e| RequestError::Sampling(e.to_string()))?;
        let needed = self.blocks_for(r);
        if needed > self.pool.len() {
            return Err(RequestError::TooBig {
                needed,
                blocks: self.pool.len(),
            });
        }
        Ok(())
    }

    /// Queues request `id` (checked first).
    pub fn submit(&mut self, id: u64, r: Request) -> Result<(), RequestError> {
        self.check(&r)?;
        // (A queue of 0 still takes a request while nothing else waits:
        // every request passes through it on its way in.)
        if self.waiting.len() >= self.options.max_waiting.max(1) {
            return Err(RequestError::Busy(self.waiting.len()));
        }
        if self.waiting.iter().any(|w| w.0 == id) || self.running.iter().any(|s| s.id == id) {
            return Err(RequestError::Duplicate(id));
        }
        self.waiting.push_back((id, r));
        Ok(())
    }

    /// Drops request `id` wherever it is (its blocks go back); whether it
    /// was there.
    pub fn cancel(&mut self, id: u64) -> bool {
        if let Some(i) = self.waiting.iter().position(|w| w.0 == id) {
            self.waiting.remove(i);
            return true;
        }
        match self.running.iter().position(|s| s.id == id) {
            Some(i) => {
                self.retire(i);
                true
            }
            None => false,
        }
    }

    /// Whether nothing waits or runs.
    pub fn idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    pub fn stats(&self) -> Stats {
        Stats {
            waiting: self.waiting.len(),
            running: self.running.len(),
            blocks_used: self.pool.used(),
            blocks: self.pool.len(),
        }
    }

    /// Removes running sequence `i`, its blocks and reservation back.
    fn retire(&mut self, i: usize) -> Seq {
        let mut s = self.running.swap_remove(i);
        s.table.release(&mut self.pool);
        self.reserved -= s.reserved;
        s
    }

    /// Moves waiting requests in, in arrival order, while their
    /// reservations fit.
    fn admit(&mut self) {
        while self.running.len() < self.options.max_running {
            let Some((_, r)) = self.waiting.front() else {
                break;
            };
            let need = self.blocks_for(r);
            if self.reserved + need > self.pool.len() {
                break;
            }
            let (id, r) = self.waiting.pop_front().expect("looked at above");
            let sampler = Sampler::new(r.sampling).expect("checked at submit");
            self.reserved += need;
            self.running.push(Seq {
                id,
                prompt: r.prompt,
                table: BlockTable::new(),
                prefilled: 0,
                cached: 0,
                generated: Vec::new(),
                sampler,
                max_tokens: r.max_tokens,
                logprobs: r.logprobs,
                text: TextStream::new(self.tokenizer, r.stop),
                reserved: need,
            });
        }
    }

    /// Plans this step's rows: decodes first, then prompt chunks.
    fn plan(&mut self) -> Vec<Planned> {
        let mut rows = Vec::new();
        let budget = self.options.step_tokens;
        for (i, s) in self.running.iter_mut().enumerate() {
            if rows.len() >= budget {
                break;
            }
            let Some(&token) = s.generated.last() else {
                continue;
            };
            let pos = s.table.len();
            let copies = s
                .table
                .append(&mut self.pool, &[token])
                .expect("the reservation holds every block");
            self.decoder.copy_blocks(&copies);
            rows.push(Planned {
                seq: i,
                token,
                pos,
                logits: true,
            });
        }
        for (i, s) in self.running.iter_mut().enumerate() {
            let left = budget.saturating_sub(rows.len());
            if left == 0 {
                break;
            }
            if s.prefilled == s.prompt.len() {
                continue;
            }
            let end = (s.prefilled + left).min(s.prompt.len());
            let from = match s.table.is_empty() {
                true => {
                    let cached = s
                        .table
                        .start(&mut self.pool, &s.prompt[..end])
                        .expect("the reservation holds every block");
                    s.cached = cached;
                    cached
                }
                false => {
                    let copies = s
                        .table
                        .append(&mut self.pool, &s.prompt[s.prefilled..end])
                        .expect("the reservation holds every block");
                    self.decoder.copy_blocks(&copies);
                    s.prefilled
                }
            };
            for pos in from..end {
                rows.push(Planned {
                    seq: i,
                    token: s.prompt[pos],
                    pos,
                    logits: pos + 1 == s.prompt.len(),
                });
            }
            s.prefilled = end;
        }
        rows
    }

    /// One step: admits what fits, runs one decode over the running
    /// sequences, and says what happened to each request. Nothing to run:
    /// no events.
    pub fn step(&mut self) -> Vec<(u64, Event)> {
        self.admit();
        let planned = self.plan();
        if planned.is_empty() {
            return Vec::new();
        }
        let rows: Vec<DecodeRow<'_>> = planned
            .iter()
            .map(|p| DecodeRow {
                token: p.token,
                pos: p.pos,
                table: self.running[p.seq].table.blocks(),
                logits: p.logits,
            })
            .collect();
        // A greedy row needs only its pick (made on the device by a GPU
        // decoder); a sampled one its whole vector.
        let logits = &mut self.logits;
        let running = &self.running;
        logits.want_whole(
            planned
                .iter()
                .filter(|p| p.logits)
                .map(|p| !running[p.seq].sampler.is_greedy()),
        );
        match self.decoder.decode(&rows, logits) {
            Ok(()) => {}
            Err(e) => {
                // The cache's state is unknown: every running request
                // fails; the waiting ones run on a clean start.
                let mut out = Vec::new();
                while !self.running.is_empty() {
                    let s = self.retire(self.running.len() - 1);
                    out.push((s.id, Event::Failed(format!("the model step failed: {e}"))));
                }
                return out;
            }
        };
        let samplers: Vec<usize> = planned.iter().filter(|p| p.logits).map(|p| p.seq).collect();
        let mut events = Vec::new();
        let mut done = Vec::new();
        let context = self.decoder.context();
        for (row, i) in samplers.into_iter().enumerate() {
            let s = &mut self.running[i];
            let (token, logprob) = if s.sampler.is_greedy() {
                let token = self.logits.token(row);
                (token, s.logprobs.then(|| self.logits.pick(row).logprob))
            } else {
                let l = &self.logits.row(row)[..self.writable];
                let token = s.sampler.pick(l) as u32;
                (token, s.logprobs.then(|| log_softmax_at(l, token as usize)))
            };
            s.generated.push(token);
            let eos = self.eos == Some(token);
            let (text, stopped) = match eos {
                true => (String::new(), true),
                false => s.text.push(token),
            };
            events.push((
                s.id,
                Event::Token(TokenOut {
                    token,
                    logprob,
                    text,
                }),
            ));
            // The next decode writes position table.len(): it must be in
            // the context.
            let finish = if stopped {
                Some(Finish::Stop)
            } else if s.generated.len() >= s.max_tokens || s.table.len() >= context {
                Some(Finish::Length)
            } else {
                None
            };
            if let Some(f) = finish {
                done.push((i, f));
            }
        }
        // Highest index first: retire swaps the last into the hole.
        done.sort_by_key(|d| std::cmp::Reverse(d.0));
        for (i, finish) in done {
            let mut s = self.retire(i);
            let text = match finish {
                Finish::Stop => String::new(),
                _ => s.text.rest(),
            };
            let usage = Usage {
                prompt_tokens: s.prompt.len(),
                completion_tokens: s.generated.len(),
                cached_tokens: s.cached,
            };
            events.push((
                s.id,
                Event::Done {
                    text,
                    finish,
                    usage,
                },
            ));
        }
        events
    }
}
