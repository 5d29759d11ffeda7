//! Tensor-parallel serving (`braid serve --tp N`): the model's heads and
//! MLP columns split over N ranks, each holding its share's weights and
//! its heads' pages of the KV cache. Rank 0 serves HTTP and batches; at
//! every step it sends the step (the rows, or the block copies) to the
//! other ranks over a host communicator ([`StepBus`]), and every rank
//! runs the same decode, the model summing its products over the tensor
//! group ([`braid_model::Gpt::tensor_parallel`]). Rank 0's decoder is
//! [`TensorParallelDecoder`]; the others run [`follow`] until rank 0 says
//! stop.
//!
//! A follower waits for the next step as long as the server is idle, but
//! never without a bound: while no step goes out, rank 0 sends a
//! keep-alive every [`StepBus::keep_alive_every`], so a follower whose
//! leader died times out (the communicator's timeout, naming rank 0)
//! instead of hanging.

use crate::decoder::{CpuDecoder, Decoder};
use braid_comm::Communicator;
use braid_model::paged::{BlockCopy, BlockId};
use braid_model::{DecodeRow, Gpt, Logits};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What rank 0 sends the other ranks.
#[derive(Debug, Clone, PartialEq)]
pub enum Message {
    /// Decode these rows (tokens, positions, block tables, which rows
    /// want logits).
    Step(Vec<OwnedRow>),
    /// Copy these blocks (copy on write) before the next step.
    Copies(Vec<BlockCopy>),
    /// Nothing to do yet: the leader is alive.
    KeepAlive,
    /// The server stopped: leave.
    Stop,
}

/// A [`DecodeRow`] that owns its block table (what crosses the bus).
#[derive(Debug, Clone, PartialEq)]
pub struct OwnedRow {
    pub token: u32,
    pub pos: usize,
    pub table: Vec<BlockId>,
    pub logits: bool,
}

impl OwnedRow {
    fn row(&self) -> DecodeRow<'_> {
        DecodeRow {
            token: self.token,
            pos: self.pos,
            table: &self.table,
            logits: self.logits,
        }
    }
}

const STEP: i64 = 1;
const COPIES: i64 = 2;
const KEEP_ALIVE: i64 = 3;
const STOP: i64 = 4;

/// A step of `rows` as words ([`Message::Step`]'s encoding), straight
/// from the batcher's rows: rank 0 sends this every step.
fn step_words<'a>(rows: impl ExactSizeIterator<Item = DecodeRow<'a>>) -> Vec<i64> {
    let mut w = vec![STEP, rows.len() as i64];
    for r in rows {
        w.extend([
            i64::from(r.token),
            r.pos as i64,
            i64::from(r.logits),
            r.table.len() as i64,
        ]);
        w.extend(r.table.iter().map(|&b| i64::from(b)));
    }
    w
}

impl Message {
    /// The message as words: its kind, then its body.
    fn encode(&self) -> Vec<i64> {
        match self {
            Message::Step(rows) => step_words(rows.iter().map(OwnedRow::row)),
            Message::Copies(copies) => {
                let mut w = vec![COPIES, copies.len() as i64];
                for c in copies {
                    w.extend([i64::from(c.from), i64::from(c.to)]);
                }
                w
            }
            Message::KeepAlive => vec![KEEP_ALIVE],
            Message::Stop => vec![STOP],
        }
    }

    /// The message `words` encode; a malformed one is said.
    fn decode(words: &[i64]) -> Result<Message, String> {
        let bad = || format!("a malformed step message of {} words", words.len());
        let mut it = words.iter().copied();
        let mut next = || it.next().ok_or_else(bad);
        let kind = next()?;
        let count = |n: i64| usize::try_from(n).map_err(|_| bad());
        let id = |n: i64| BlockId::try_from(n).map_err(|_| bad());
        let msg = match kind {
            STEP => {
                let n = count(next()?)?;
                let mut rows = Vec::with_capacity(n.min(words.len()));
                for _ in 0..n {
                    let token = u32::try_from(next()?).map_err(|_| bad())?;
                    let pos = count(next()?)?;
                    let logits = next()? != 0;
                    let t = count(next()?)?;
                    let table = (0..t)
                        .map(|_| next().and_then(id))
                        .collect::<Result<_, _>>()?;
                    rows.push(OwnedRow {
                        token,
                        pos,
                        table,
                        logits,
                    });
                }
                Message::Step(rows)
            }
            COPIES => {
                let n = count(next()?)?;
                let mut copies = Vec::with_capacity(n.min(words.len()));
                for _ in 0..n {
                    let from = id(next()?)?;
                    let to = id(next()?)?;
                    copies.push(BlockCopy { from, to });
                }
                Message::Copies(copies)
            }
            KEEP_ALIVE => Message::KeepAlive,
            STOP => Message::Stop,
            _ => return Err(bad()),
        };
        match next() {
            Err(_) => Ok(msg),
            Ok(_) => Err(bad()),
        }
    }
}

/// The channel from rank 0 to the other ranks of a tensor-parallel
/// server: one broadcast of a message's length, then of its words, over
/// a host communicator of its own (the model's sums run on another).
pub struct StepBus {
    /// Ranks on the bus (the tensor group's).
    pub size: usize,
    comm: Mutex<Communicator>,
    last_sent: Mutex<Instant>,
    stopped: AtomicBool,
}

impl StepBus {
    /// The bus over `comm` (every rank of the tensor group, rank 0 the
    /// leader).
    pub fn new(comm: Communicator) -> Arc<StepBus> {
        Arc::new(StepBus {
            size: comm.size(),
            comm: Mutex::new(comm),
            last_sent: Mutex::new(Instant::now()),
            stopped: AtomicBool::new(false),
        })
    }

    /// How often an idle leader says it is alive: a quarter of the
    /// communicator's timeout, at most 10 s.
    pub fn keep_alive_every(&self) -> Duration {
        let timeout = self.lock().timeout();
        (timeout / 4).min(Duration::from_secs(10))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Communicator> {
        // A thread that panicked holding it left the communicator whole.
        self.comm.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sends `msg` (rank 0), holding the bus through `then` so that no
    /// keep-alive comes between a step and the work that follows it.
    fn send_then<R>(&self, msg: &Message, then: impl FnOnce() -> R) -> Result<R, String> {
        self.send_words_then(msg.encode(), then)
    }

    /// [`send_then`](Self::send_then) of a message already encoded.
    fn send_words_then<R>(
        &self,
        mut words: Vec<i64>,
        then: impl FnOnce() -> R,
    ) -> Result<R, String> {
        let comm = self.lock();
        let mut len = [words.len() as i64];
        comm.broadcast(&mut len, 0)
            .and_then(|()| comm.broadcast(&mut words, 0))
            .map_err(|e| format!("sending a step to the other tensor-parallel ranks: {e}"))?;
        *self.last_sent.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
        Ok(then())
    }

    /// Waits for rank 0's next message (the other ranks).
    fn receive(&self) -> Result<Message, String> {
        let comm = self.lock();
        let mut len = [0i64];
        comm.broadcast(&mut len, 0)
            .map_err(|e| format!("waiting for rank 0's next step: {e}"))?;
        let n = usize::try_from(len[0])
            .ok()
            .filter(|&n| n > 0 && n <= 1 << 30)
            .ok_or_else(|| format!("rank 0 announced a step of {} words", len[0]))?;
        let mut words = vec![0i64; n];
        comm.broadcast(&mut words, 0)
            .map_err(|e| format!("receiving rank 0's step: {e}"))?;
        Message::decode(&words)
    }

    /// Starts rank 0's keep-alive thread: while no message went out for
    /// [`keep_alive_every`](Self::keep_alive_every), it sends one, until
    /// [`stop`](Self::stop).
    pub fn keep_alive(self: &Arc<StepBus>) -> std::thread::JoinHandle<()> {
        let bus = self.clone();
        let every = self.keep_alive_every();
        std::thread::Builder::new()
            .name("braid-tp-keepalive".into())
            .spawn(move || {
                while !bus.stopped.load(Ordering::Acquire) {
                    std::thread::sleep((every / 8).max(Duration::from_millis(10)));
                    let idle = bus
                        .last_sent
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .elapsed();
                    if idle < every || bus.stopped.load(Ordering::Acquire) {
                        continue;
                    }
                    if let Err(e) = bus.send_then(&Message::KeepAlive, || ()) {
                        eprintln!("braid serve: {e}");
                        return;
                    }
                }
            })
            .expect("a thread for the keep-alives")
    }

    /// Tells the other ranks to leave (rank 0, once the server stopped);
    /// the keep-alives end too.
    pub fn stop(&self) -> Result<(), String> {
        if self.stopped.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        self.send_then(&Message::Stop, || ())
    }
}

/// Rank 0's decoder: each step sent to the other ranks, then decoded
/// here over this rank's share (the model's sums meet the others').
pub struct TensorParallelDecoder {
    share: CpuDecoder,
    bus: Arc<StepBus>,
    /// A block copy that could not be sent, said by the next step.
    failed: Option<String>,
}

impl TensorParallelDecoder {
    /// Rank 0's decoder over its share `gpt` (built with its tensor
    /// group) and `params`, with pages of `blocks` blocks of
    /// `block_size` positions.
    pub fn new(
        gpt: Gpt,
        params: Vec<f32>,
        blocks: usize,
        block_size: usize,
        bus: Arc<StepBus>,
    ) -> Result<TensorParallelDecoder, String> {
        Ok(TensorParallelDecoder {
            share: CpuDecoder::of(gpt, params, blocks, block_size)?,
            bus,
            failed: None,
        })
    }
}

impl Decoder for TensorParallelDecoder {
    fn context(&self) -> usize {
        self.share.context()
    }

    fn vocab(&self) -> usize {
        self.share.vocab()
    }

    fn blocks(&self) -> usize {
        self.share.blocks()
    }

    fn block_size(&self) -> usize {
        self.share.block_size()
    }

    fn copy_blocks(&mut self, copies: &[BlockCopy]) {
        let share = &mut self.share;
        if let Err(e) = self.bus.send_then(&Message::Copies(copies.to_vec()), || {
            share.copy_blocks(copies)
        }) {
            self.failed.get_or_insert(e);
        }
    }

    fn decode(&mut self, rows: &[DecodeRow<'_>], out: &mut Logits) -> Result<(), String> {
        if let Some(e) = self.failed.take() {
            return Err(e);
        }
        let step = step_words(rows.iter().copied());
        let share = &mut self.share;
        self.bus.send_words_then(step, || share.decode(rows, out))?
    }

    fn describe(&self) -> String {
        format!(
            "cpu, f32, tensor-parallel over {} ranks, KV cache {} blocks of {} (each rank its \
             heads')",
            self.bus.size,
            self.share.blocks(),
            self.share.block_size()
        )
    }
}

/// What a rank other than 0 runs: each step rank 0 sends decoded over
/// this rank's share (its logits dropped: rank 0 samples), until rank 0
/// says stop. A step the model refuses was refused on rank 0 too, at the
/// same place (every rank runs the same rows); it is said and the next
/// one waited for.
pub fn follow(
    bus: &StepBus,
    gpt: Gpt,
    params: Vec<f32>,
    blocks: usize,
    block_size: usize,
) -> Result<(), String> {
    let mut share = CpuDecoder::of(gpt, params, blocks, block_size)?;
    let mut logits = Logits::new();
    loop {
        match bus.receive()? {
            Message::Step(rows) => {
                let rows: Vec<DecodeRow<'_>> = rows.iter().map(OwnedRow::row).collect();
                if let Err(e) = share.decode(&rows, &mut logits) {
                    eprintln!("braid serve: a step refused (as on rank 0): {e}");
                }
            }
            Message::Copies(copies) => share.copy_blocks(&copies),
            Message::KeepAlive => {}
            Message::Stop => return Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_cross_as_words_and_back() {
        let msgs = [
            Message::Step(vec![
                OwnedRow {
                    token: 50256,
                    pos: 0,
                    table: vec![3],
                    logits: false,
                },
                OwnedRow {
                    token: 7,
                    pos: 17,
                    table: vec![0, 9],
                    logits: true,
                },
            ]),
            Message::Step(Vec::new()),
            Message::Copies(vec![BlockCopy { from: 4, to: 1 }]),
            Message::KeepAlive,
            Message::Stop,
        ];
        for m in msgs {
            assert_eq!(Message::decode(&m.encode()).unwrap(), m);
        }
    }

    #[test]
    fn a_malformed_message_is_said() {
        let mut w = Message::Step(vec![OwnedRow {
            token: 1,
            pos: 2,
            table: vec![0, 1],
            logits: true,
        }])
        .encode();
        for cut in [w.len() - 1, 1, 0] {
            let e = Message::decode(&w[..cut]).unwrap_err();
            assert!(e.contains("malformed step message"), "{e}");
        }
        w.push(0);
        assert!(Message::decode(&w).is_err(), "a trailing word is refused");
        assert!(
            Message::decode(&[99]).is_err(),
            "an unknown kind is refused"
        );
        assert!(Message::decode(&[STEP, 1, -1, 0, 0, 0]).is_err());
    }
}
