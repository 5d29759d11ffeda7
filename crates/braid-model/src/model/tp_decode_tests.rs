//! Decoding by tensor-parallel shares against the whole model: the ranks
//! of a [`LocalGroup`] (threads) each decode their share over their own
//! pages; the logits every rank returns must be the whole model's.

use super::*;
use crate::config::GptConfig;
use crate::layout::TensorShard;
use crate::paged::{BlockPool, BlockTable};
use crate::params::Params;
use crate::tensor_comm::LocalGroup;
use std::sync::Arc;

/// `params` in f64, larger than GPT-2's so the attention is far from
/// uniform.
fn wide(params: &Params) -> Vec<f64> {
    params.data.iter().map(|&x| x as f64 * 8.0).collect()
}

/// Parameters of `layout` (a share or the whole).
fn params(layout: &Arc<Layout>) -> Vec<f64> {
    wide(&Params::init_gpt2(layout.clone(), 7))
}

/// Two sequences prefilled in one step (one forked from the other's
/// prefix), then `steps` greedy decode steps of both: every step's logits.
fn decode_run(m: &Gpt, p: &[f64], steps: usize) -> Vec<Vec<Vec<f64>>> {
    let mut pool = BlockPool::new(16, 4);
    let mut kv = KvPages::<f64>::new(&m.layout, 16, 4);
    let prompts: [&[u32]; 2] = [&[5, 9, 1, 30, 2, 2, 17], &[36, 0, 4]];
    let mut tables: Vec<BlockTable> = Vec::new();
    let mut tokens: Vec<Vec<u32>> = Vec::new();
    for prompt in prompts {
        let mut t = BlockTable::new();
        t.start(&mut pool, prompt).unwrap();
        tables.push(t);
        tokens.push(prompt.to_vec());
    }
    let mut every = Vec::new();
    let mut rows_of = |tokens: &[Vec<u32>], tables: &[BlockTable], from: &[usize]| {
        let mut rows = Vec::new();
        for (s, (toks, table)) in tokens.iter().zip(tables).enumerate() {
            for (pos, &token) in toks.iter().enumerate().skip(from[s]) {
                rows.push(DecodeRow {
                    token,
                    pos,
                    table: table.blocks(),
                    logits: pos + 1 == toks.len(),
                });
            }
        }
        m.decode(p, &mut kv, &rows).unwrap()
    };
    let mut logits = rows_of(&tokens, &tables, &[0, 0]);
    for _ in 0..steps {
        let from: Vec<usize> = tokens.iter().map(Vec::len).collect();
        for ((toks, table), l) in tokens.iter_mut().zip(&mut tables).zip(&logits) {
            let best = (0..l.len()).fold(0, |b, i| if l[i] > l[b] { i } else { b });
            toks.push(best as u32);
            let copies = table.append(&mut pool, &[best as u32]).unwrap();
            assert!(copies.is_empty(), "no block is shared here");
        }
        every.push(logits);
        logits = rows_of(&tokens, &tables, &from);
    }
    every.push(logits);
    every
}

#[test]
fn tensor_parallel_shares_decode_the_whole_models_logits() {
    // 4 heads; a vocabulary of 37 splits unevenly over 2 and 4 ranks.
    let cfg = GptConfig::parse("L2-H4-C16-V37-T24").unwrap();
    let whole = Params::init_gpt2(Arc::new(Layout::new(&cfg)), 7);
    let want = decode_run(&Gpt::new(whole.layout.clone()), &wide(&whole), 6);
    let whole = &whole;
    for n in [2, 4] {
        let runs = LocalGroup::run(n, |g| {
            let shard = TensorShard {
                rank: g.rank(),
                size: n,
            };
            // Cut from the whole model's parameters: the same values as
            // drawn straight into the share.
            let share = whole.tensor_share(shard).unwrap();
            let l = share.layout.clone();
            assert_eq!(share.data, Params::init_gpt2(l.clone(), 7).data);
            let m = Gpt::tensor_parallel(l, Arc::new(g), false).unwrap();
            decode_run(&m, &wide(&share), 6)
        });
        for (rank, got) in runs.iter().enumerate() {
            assert_eq!(got.len(), want.len());
            for (step, (g, w)) in got.iter().zip(&want).enumerate() {
                for (gs, ws) in g.iter().zip(w) {
                    let d = gs
                        .iter()
                        .zip(ws)
                        .map(|(a, b)| (a - b).abs())
                        .fold(0.0, f64::max);
                    assert!(
                        d < 1e-9,
                        "{n} ranks, rank {rank}, step {step}: max |diff| {d}"
                    );
                }
            }
        }
    }
}

#[test]
fn a_share_without_its_group_or_with_split_rows_is_refused() {
    let cfg = GptConfig::parse("L1-H2-C8-V11-T8").unwrap();
    let shard = TensorShard { rank: 0, size: 2 };
    let l = Arc::new(Layout::tensor_parallel(&cfg, shard, 1).unwrap());
    let p = params(&l);
    let mut kv = KvPages::<f64>::new(&l, 2, 4);
    let table = [0u32];
    let row = DecodeRow {
        token: 1,
        pos: 0,
        table: &table,
        logits: true,
    };
    let alone = Gpt::new(l.clone());
    let e = alone.decode(&p, &mut kv, &[row]).unwrap_err().to_string();
    assert!(e.contains("built without its group"), "{e}");
    let g = LocalGroup::new(2).swap_remove(0);
    let split = Gpt::tensor_parallel(l.clone(), Arc::new(g), true).unwrap();
    let e = split.decode(&p, &mut kv, &[row]).unwrap_err().to_string();
    assert!(e.contains("decoding splits no rows"), "{e}");
}
