//! The batcher against the model decoding one request at a time: a
//! request's tokens do not depend on what else runs beside it, chunked
//! prefill and prefix caching change nothing, and every block comes back.

use braid_data::tokens::Tokenizer;
use braid_model::sample::Sampling;
use braid_model::{Gpt, GptConfig, Layout, Params};
use braid_serve::{Batcher, BatcherOptions, CpuDecoder, Event, Finish, Request, RequestError};
use std::collections::HashMap;
use std::sync::Arc;

fn params(spec: &str, seed: u64) -> Params {
    let l = Arc::new(Layout::new(&GptConfig::parse(spec).unwrap()));
    let mut p = Params::init_gpt2(l, seed);
    // Larger-than-GPT-2 weights: far from uniform, so greedy choices are
    // clear.
    p.data.iter_mut().for_each(|x| *x *= 6.0);
    p
}

fn greedy(prompt: &[u32], max_tokens: usize) -> Request {
    Request {
        prompt: prompt.to_vec(),
        max_tokens,
        sampling: Sampling {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 1,
        },
        stop: vec![],
        logprobs: false,
    }
}

/// Greedy by recomputing the whole window for every token (the path
/// `braid generate` took before the cache).
fn recomputed(p: &Params, prompt: &[u32], n: usize) -> Vec<u32> {
    let m = Gpt::new(p.layout.clone());
    let mut t = prompt.to_vec();
    for _ in 0..n {
        let l = m.next_token_logits(&p.data, &t).unwrap();
        let best = (0..l.len()).fold(0, |b, i| if l[i] > l[b] { i } else { b });
        t.push(best as u32);
    }
    t.split_off(prompt.len())
}

/// Runs the batcher until idle: each request's tokens and finish.
fn drain(b: &mut Batcher<CpuDecoder>) -> HashMap<u64, (Vec<u32>, Finish)> {
    drain_after(b, Vec::new())
}

/// The same, `first` the events of steps already run.
fn drain_after(
    b: &mut Batcher<CpuDecoder>,
    first: Vec<(u64, Event)>,
) -> HashMap<u64, (Vec<u32>, Finish)> {
    let mut toks: HashMap<u64, Vec<u32>> = HashMap::new();
    let mut out = HashMap::new();
    let mut steps = 0;
    let mut events = first;
    loop {
        for (id, e) in events {
            match e {
                Event::Token(t) => toks.entry(id).or_default().push(t.token),
                Event::Done { finish, .. } => {
                    out.insert(id, (toks.remove(&id).unwrap_or_default(), finish));
                }
                Event::Failed(e) => panic!("request {id} failed: {e}"),
            }
        }
        if b.idle() {
            return out;
        }
        events = b.step();
        steps += 1;
        assert!(steps < 10_000, "the batcher does not finish");
    }
}

#[test]
fn batched_greedy_equals_each_request_alone_and_the_recomputed_window() {
    let p = params("L2-H2-C16-V64-T48", 4);
    let prompts: Vec<Vec<u32>> = vec![
        (0..13).map(|i| (i * 7 % 64) as u32).collect(),
        vec![3, 1, 4, 1, 5],
        vec![9],
        (0..20).map(|i| (i * 5 % 64) as u32).collect(),
        // Shares the first prompt's first 8 positions (two blocks of 4).
        (0..8)
            .map(|i| (i * 7 % 64) as u32)
            .chain([40, 41])
            .collect(),
    ];
    let n = 12;
    let want: Vec<Vec<u32>> = prompts.iter().map(|pr| recomputed(&p, pr, n)).collect();
    // Small steps: prompts prefilled in chunks beside running decodes.
    for step_tokens in [3, 7, 512] {
        let d = CpuDecoder::new(p.clone(), 64, 4).unwrap();
        let opts = BatcherOptions {
            step_tokens,
            ..Default::default()
        };
        let mut b = Batcher::new(d, Tokenizer::Bytes, opts);
        for (i, pr) in prompts.iter().enumerate() {
            b.submit(i as u64, greedy(pr, n)).unwrap();
        }
        let got = drain(&mut b);
        for (i, w) in want.iter().enumerate() {
            let (toks, finish) = &got[&(i as u64)];
            assert_eq!(toks, w, "request {i}, step budget {step_tokens}");
            assert_eq!(*finish, Finish::Length);
        }
        let s = b.stats();
        assert_eq!((s.running, s.waiting, s.blocks_used), (0, 0, 0));
    }
}

#[test]
fn a_full_cache_queues_requests_and_every_one_finishes() {
    let p = params("L1-H2-C8-V40-T32", 2);
    // 12 blocks of 4: each request reserves (5 + 10) / 4 + 1 = 5 blocks,
    // so two run at a time.
    let d = CpuDecoder::new(p.clone(), 12, 4).unwrap();
    let mut b = Batcher::new(d, Tokenizer::Bytes, BatcherOptions::default());
    let prompt = [1u32, 2, 3, 4, 5];
    for id in 0..7 {
        b.submit(id, greedy(&prompt, 10)).unwrap();
    }
    let first = b.step();
    assert_eq!((b.stats().running, b.stats().waiting), (2, 5));
    let got = drain_after(&mut b, first);
    let want = recomputed(&p, &prompt, 10);
    assert_eq!(got.len(), 7);
    for (toks, _) in got.values() {
        assert_eq!(toks, &want);
    }
    assert_eq!(b.stats().blocks_used, 0);
}

#[test]
fn cancelling_gives_the_blocks_back_and_the_rest_run_on() {
    let p = params("L1-H2-C8-V40-T32", 3);
    let d = CpuDecoder::new(p.clone(), 32, 4).unwrap();
    let mut b = Batcher::new(d, Tokenizer::Bytes, BatcherOptions::default());
    for id in 0..3 {
        b.submit(id, greedy(&[7, 8, 9], 20)).unwrap();
    }
    b.step();
    b.step();
    assert!(b.stats().blocks_used > 0);
    assert!(b.cancel(1));
    assert!(!b.cancel(1), "cancelled twice");
    let got = drain(&mut b);
    assert_eq!(got.len(), 2);
    assert!(!got.contains_key(&1));
    assert_eq!(b.stats().blocks_used, 0);
}

#[test]
fn requests_that_cannot_run_are_refused_with_the_reason() {
    let p = params("L1-H2-C8-V40-T16", 1);
    let d = CpuDecoder::new(p, 6, 4).unwrap();
    let opts = BatcherOptions {
        max_waiting: 2,
        ..Default::default()
    };
    let mut b = Batcher::new(d, Tokenizer::Bytes, opts);
    let e = b.submit(0, greedy(&[], 3)).unwrap_err();
    assert_eq!(e, RequestError::EmptyPrompt);
    let e = b.submit(0, greedy(&[1; 16], 3)).unwrap_err();
    assert!(e.to_string().contains("at most 15 tokens"), "{e}");
    let e = b.submit(0, greedy(&[1, 41], 3)).unwrap_err();
    assert!(e.to_string().contains("token 41"), "{e}");
    let e = b.submit(0, greedy(&[1], 0)).unwrap_err();
    assert_eq!(e, RequestError::NoTokens);
    // 15 positions at most in a 16 context: 4 blocks + 1 of 6 fit; a
    // cache of 6 blocks takes it, but not two at once.
    b.submit(0, greedy(&[1], 14)).unwrap();
    let e = b.submit(0, greedy(&[1], 2)).unwrap_err();
    assert_eq!(e, RequestError::Duplicate(0));
    b.submit(1, greedy(&[1], 14)).unwrap();
    let e = b.submit(2, greedy(&[1], 14)).unwrap_err();
    assert!(matches!(e, RequestError::Busy(2)), "{e}");
    let mut bad = greedy(&[1], 2);
    bad.sampling.top_p = 0.0;
    let e = b.submit(3, bad).unwrap_err();
    assert!(e.to_string().contains("top-p"), "{e}");
}

#[test]
fn a_stop_string_ends_the_completion_and_logprobs_are_log_probabilities() {
    let p = params("L1-H2-C8-V256-T64", 5);
    let d = CpuDecoder::new(p.clone(), 32, 4).unwrap();
    let mut b = Batcher::new(d, Tokenizer::Bytes, BatcherOptions::default());
    let prompt = [104u32, 105];
    let want = recomputed(&p, &prompt, 30);
    // Stop at the text of the third generated token.
    let stop = Tokenizer::Bytes.decode(&want[2..3]);
    let mut r = greedy(&prompt, 30);
    r.stop = vec![stop.clone()];
    r.logprobs = true;
    b.submit(0, r).unwrap();
    let mut text = String::new();
    let mut finish = None;
    while !b.idle() {
        for (_, e) in b.step() {
            match e {
                Event::Token(t) => {
                    let lp = t.logprob.unwrap();
                    assert!(lp <= 0.0 && lp.is_finite(), "{lp}");
                    text += &t.text;
                }
                Event::Done {
                    text: rest,
                    finish: f,
                    ..
                } => {
                    text += &rest;
                    finish = Some(f);
                }
                Event::Failed(e) => panic!("{e}"),
            }
        }
    }
    assert_eq!(finish, Some(Finish::Stop));
    let full = Tokenizer::Bytes.decode(&want);
    assert_eq!(text, full[..full.find(&stop).unwrap()]);
}

/// Paged (blocks of 4) and contiguous (one block holding the whole
/// context) caches give the same tokens, and 64 requests decoded together
/// give each the tokens it gets alone (f32, greedy).
#[test]
fn sixty_four_requests_batched_equal_each_alone_paged_or_contiguous() {
    let p = params("L2-H2-C16-V64-T32", 8);
    let mut rng = braid_model::rng::Rng::new(3);
    let prompts: Vec<Vec<u32>> = (0..64)
        .map(|_| {
            let n = 1 + rng.below(12);
            (0..n).map(|_| rng.below(64) as u32).collect()
        })
        .collect();
    let run = |block_size: usize, batch: &[Vec<u32>]| {
        let blocks = batch.len() * (32 / block_size + 2);
        let d = CpuDecoder::new(p.clone(), blocks, block_size).unwrap();
        let opts = BatcherOptions {
            max_running: 64,
            step_tokens: 64,
            ..Default::default()
        };
        let mut b = Batcher::new(d, Tokenizer::Bytes, opts);
        for (i, pr) in batch.iter().enumerate() {
            b.submit(i as u64, greedy(pr, 10)).unwrap();
        }
        let got = drain(&mut b);
        (0..batch.len())
            .map(|i| got[&(i as u64)].0.clone())
            .collect::<Vec<_>>()
    };
    let together = run(4, &prompts);
    let contiguous = run(32, &prompts);
    assert_eq!(together, contiguous, "paged and contiguous differ");
    for (i, pr) in prompts.iter().enumerate() {
        let alone = run(4, std::slice::from_ref(pr));
        assert_eq!(together[i], alone[0], "request {i}");
    }
}

/// The warm-up burst `braid serve` runs on a GPU before it listens
/// (`offline::warm_up`): as many requests as run at once, their prompts
/// together a step's tokens (shorter than the context), every one
/// finished; the batcher idle after, and a request's tokens what a fresh
/// batcher gives.
#[test]
fn a_warm_up_burst_fills_a_step_and_leaves_the_batcher_as_it_found_it() {
    let p = params("L2-H2-C16-V64-T32", 5);
    let fresh = |step_tokens: usize| {
        let d = CpuDecoder::new(p.clone(), 8 * (32 / 4 + 2), 4).unwrap();
        let opts = BatcherOptions {
            max_running: 8,
            step_tokens,
            ..Default::default()
        };
        Batcher::new(d, Tokenizer::Bytes, opts)
    };
    let mut b = fresh(40);
    let w = braid_serve::offline::warm_up(&mut b, 64, 32).unwrap();
    // (The CPU's decoder prepares no row counts: no smaller bursts.)
    assert_eq!((w.requests, w.prompt_tokens, w.smaller), (8, 5, 0));
    let s = b.stats();
    assert_eq!((s.waiting, s.running), (0, 0));
    b.submit(1, greedy(&[3, 1, 4], 6)).unwrap();
    let after = drain(&mut b);
    let mut c = fresh(40);
    c.submit(1, greedy(&[3, 1, 4], 6)).unwrap();
    assert_eq!(after[&1], drain(&mut c)[&1]);
    // A step wider than the context: prompts cut to leave room for the
    // three new tokens.
    let mut d = fresh(8 * 40);
    let w = braid_serve::offline::warm_up(&mut d, 64, 32).unwrap();
    assert_eq!(w.prompt_tokens, 28);
}

/// The CPU's decoder, saying it prepares steady steps of 1, 2, 4 and 8
/// rows (as a GPU's graphs do), and counting the steady steps (every row
/// past its prompt's first position) it runs of each size.
struct Preparing {
    inner: CpuDecoder,
    steady: Vec<usize>,
}

impl braid_serve::Decoder for Preparing {
    fn context(&self) -> usize {
        self.inner.context()
    }
    fn vocab(&self) -> usize {
        self.inner.vocab()
    }
    fn blocks(&self) -> usize {
        self.inner.blocks()
    }
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }
    fn copy_blocks(&mut self, copies: &[braid_model::paged::BlockCopy]) {
        self.inner.copy_blocks(copies)
    }
    fn decode(
        &mut self,
        rows: &[braid_model::DecodeRow<'_>],
        out: &mut braid_model::Logits,
    ) -> Result<(), String> {
        if rows.iter().all(|r| r.pos > 0) {
            self.steady.push(rows.len());
        }
        self.inner.decode(rows, out)
    }
    fn describe(&self) -> String {
        self.inner.describe()
    }
    fn prepared_rows(&self) -> Vec<usize> {
        vec![1, 2, 4, 8, 16]
    }
}

/// With a decoder that prepares row counts, the warm-up runs a steady
/// step of each count up to the full burst's (16 is past it: not run).
#[test]
fn the_warm_up_runs_a_steady_step_of_each_prepared_row_count() {
    let p = params("L2-H2-C16-V64-T32", 6);
    let d = Preparing {
        inner: CpuDecoder::new(p, 8 * (32 / 4 + 2), 4).unwrap(),
        steady: Vec::new(),
    };
    let opts = BatcherOptions {
        max_running: 8,
        step_tokens: 40,
        ..Default::default()
    };
    let mut b = Batcher::new(d, Tokenizer::Bytes, opts);
    let w = braid_serve::offline::warm_up(&mut b, 64, 32).unwrap();
    assert_eq!(w.smaller, 3);
    let seen = &b.decoder().steady;
    for rows in [1, 2, 4, 8] {
        assert!(
            seen.contains(&rows),
            "no steady step of {rows} rows: {seen:?}"
        );
    }
    assert!(!seen.contains(&16), "{seen:?}");
}
