//! The batcher on its own thread ([`spawn`]), and how the HTTP side
//! talks to it ([`EngineHandle`]): a request goes in with a channel for
//! its events, is checked at once (the answer comes back before any model
//! work), and runs at the batcher's next steps; a client that goes away
//! (its channel closed) has its request cancelled at the next event. The
//! thread sleeps while nothing waits or runs.

use crate::batcher::Batcher;
use crate::decoder::Decoder;
use crate::metrics::Metrics;
use crate::request::{Event, Request, RequestError};
use std::collections::HashMap;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::{mpsc as tmpsc, oneshot};

/// What the HTTP side sends the engine thread.
enum Command {
    Submit {
        request: Request,
        events: tmpsc::UnboundedSender<Event>,
        accepted: oneshot::Sender<Result<u64, RequestError>>,
    },
    Cancel(u64),
}

/// The engine thread's door, cloned into every handler.
#[derive(Clone)]
pub struct EngineHandle {
    commands: mpsc::Sender<Command>,
    metrics: Arc<Metrics>,
}

/// A request the engine took: its id and its events, ending with
/// `Event::Done` or `Event::Failed`.
pub struct Accepted {
    pub id: u64,
    pub events: tmpsc::UnboundedReceiver<Event>,
}

impl EngineHandle {
    /// Hands `request` to the engine: its events, or why it was refused.
    pub async fn submit(&self, request: Request) -> Result<Accepted, RequestError> {
        let (tx, events) = tmpsc::unbounded_channel();
        let (accepted, answer) = oneshot::channel();
        let gone = || RequestError::Stopped;
        self.commands
            .send(Command::Submit {
                request,
                events: tx,
                accepted,
            })
            .map_err(|_| gone())?;
        let id = answer.await.map_err(|_| gone())??;
        Ok(Accepted { id, events })
    }

    /// Cancels request `id` (a client that went away).
    pub fn cancel(&self, id: u64) {
        let _ = self.commands.send(Command::Cancel(id));
    }

    /// The serving figures.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }
}

/// Starts the engine thread over `batcher`.
pub fn spawn<D: Decoder + Send + 'static>(batcher: Batcher<D>) -> EngineHandle {
    let (commands, inbox) = mpsc::channel();
    let metrics = Arc::new(Metrics::new(batcher.stats()));
    let m = metrics.clone();
    std::thread::Builder::new()
        .name("braid-serve-engine".into())
        .spawn(move || run(batcher, inbox, &m))
        .expect("starting the engine thread");
    EngineHandle { commands, metrics }
}

/// A running request's channel and timings.
struct Live {
    events: tmpsc::UnboundedSender<Event>,
    arrived: Instant,
    first: Option<Instant>,
    last: Option<Instant>,
}

fn run<D: Decoder>(mut b: Batcher<D>, inbox: mpsc::Receiver<Command>, metrics: &Metrics) {
    let mut live: HashMap<u64, Live> = HashMap::new();
    let mut next_id = 0u64;
    loop {
        // Block for work when idle; otherwise take what came and step.
        let first = match b.idle() {
            true => match inbox.recv() {
                Ok(c) => Some(c),
                Err(_) => return,
            },
            false => None,
        };
        for c in first.into_iter().chain(inbox.try_iter()) {
            match c {
                Command::Submit {
                    request,
                    events,
                    accepted,
                } => {
                    next_id += 1;
                    let id = next_id;
                    let r = b.submit(id, request);
                    let ok = r.is_ok();
                    if accepted.send(r.map(|_| id)).is_err() && ok {
                        b.cancel(id);
                        continue;
                    }
                    match ok {
                        true => {
                            live.insert(
                                id,
                                Live {
                                    events,
                                    arrived: Instant::now(),
                                    first: None,
                                    last: None,
                                },
                            );
                        }
                        false => metrics.refused(),
                    }
                }
                Command::Cancel(id) => {
                    if b.cancel(id) {
                        live.remove(&id);
                        metrics.cancelled();
                    }
                }
            }
        }
        let t0 = Instant::now();
        let events = b.step();
        let rows = events
            .iter()
            .filter(|e| matches!(e.1, Event::Token(_)))
            .count();
        let now = Instant::now();
        if rows > 0 {
            metrics.step(rows, now - t0);
        }
        for (id, e) in events {
            let Some(l) = live.get_mut(&id) else {
                continue;
            };
            match &e {
                Event::Token(_) => {
                    match l.first {
                        None => metrics.first_token(now - l.arrived),
                        Some(_) => metrics.next_token(now - l.last.unwrap_or(now)),
                    }
                    l.first.get_or_insert(now);
                    l.last = Some(now);
                }
                Event::Done { finish, usage, .. } => {
                    metrics.finished(*finish, usage, now - l.arrived);
                }
                Event::Failed(_) => metrics.failed(),
            }
            let end = !matches!(e, Event::Token(_));
            if l.events.send(e).is_err() {
                // The client went away: its request stops here.
                if !end && b.cancel(id) {
                    metrics.cancelled();
                }
                live.remove(&id);
                continue;
            }
            if end {
                live.remove(&id);
            }
        }
        metrics.set_stats(b.stats());
    }
}
