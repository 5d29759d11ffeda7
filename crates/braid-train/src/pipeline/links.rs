//! [`HostLinks`]: a pipeline rank's messages over host communicators
//! (shared memory or TCP). A host send may wait for its receiver (a
//! message larger than a ring), and the schedules' checks assume that a
//! send never holds its rank up: so each rank's sends go out in order on
//! a thread of their own, over a communicator that only that rank sends
//! on — the pipeline group split once per rank, communicator `r` carrying
//! rank `r`'s messages — and every rank receives from `r` on its own
//! handle of that communicator, on its main thread. Each communicator
//! handle is so used by one thread only.

use super::exec::Links;
use crate::Result;
use braid_comm::Communicator;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

/// A message for the sending thread.
struct Job {
    to: usize,
    tag: u64,
    data: Vec<f32>,
}

/// Sends queued and not yet out, and the first error.
#[derive(Default)]
struct Outbox {
    queued: usize,
    error: Option<String>,
}

/// One pipeline rank's links to the others over host communicators.
pub struct HostLinks {
    rank: usize,
    /// Communicator `r` carries rank `r`'s sends (this rank's handle).
    by_sender: Vec<Communicator>,
    jobs: Option<Sender<Job>>,
    outbox: Arc<(Mutex<Outbox>, Condvar)>,
    thread: Option<JoinHandle<()>>,
}

impl HostLinks {
    /// Links over the pipeline group `group` (every rank of it calls this
    /// at the same point: it splits the group once per rank).
    pub fn new(group: &Communicator) -> Result<HostLinks> {
        let (rank, size) = (group.rank(), group.size());
        let mut by_sender = Vec::with_capacity(size);
        for r in 0..size {
            let c = group
                .split(Some(0), rank as i64)
                .map_err(|e| format!("the pipeline's link for rank {r}'s sends: {e}"))?
                .ok_or_else(|| format!("the pipeline's link for rank {r}'s sends: no group"))?;
            by_sender.push(c);
        }
        let (tx, rx) = channel::<Job>();
        let outbox = Arc::new((Mutex::new(Outbox::default()), Condvar::new()));
        let comm = by_sender[rank].clone();
        let out = outbox.clone();
        let thread = std::thread::Builder::new()
            .name(format!("braid-pipeline-send-{rank}"))
            .spawn(move || sender(comm, rx, out))
            .map_err(|e| format!("starting the pipeline's sending thread: {e}"))?;
        Ok(HostLinks {
            rank,
            by_sender,
            jobs: Some(tx),
            outbox,
            thread: Some(thread),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Outbox> {
        self.outbox.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The sending thread: each job in order, the first error kept (later
/// jobs are dropped: the step has failed).
fn sender(comm: Communicator, rx: Receiver<Job>, outbox: Arc<(Mutex<Outbox>, Condvar)>) {
    for job in rx {
        let failed = outbox.0.lock().map(|o| o.error.is_some()).unwrap_or(true);
        let r = match failed {
            true => Ok(()),
            false => comm
                .send(&job.data, job.to, job.tag)
                .map_err(|e| format!("sending to pipeline rank {}: {e}", job.to)),
        };
        let mut o = outbox.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Err(e) = r {
            o.error.get_or_insert(e);
        }
        o.queued -= 1;
        outbox.1.notify_all();
    }
}

impl Links<[f32]> for HostLinks {
    fn send(&mut self, to: usize, tag: u64, data: &[f32]) -> Result<()> {
        if let Some(e) = &self.lock().error {
            return Err(e.clone());
        }
        if to == self.rank || to >= self.by_sender.len() {
            return Err(format!(
                "pipeline rank {} sending to rank {to} of {}",
                self.rank,
                self.by_sender.len()
            ));
        }
        self.lock().queued += 1;
        let job = Job {
            to,
            tag,
            data: data.to_vec(),
        };
        self.jobs
            .as_ref()
            .and_then(|j| j.send(job).ok())
            .ok_or_else(|| "the pipeline's sending thread has stopped".to_string())
    }

    fn recv(&mut self, from: usize, tag: u64, into: &mut [f32]) -> Result<()> {
        let comm = self
            .by_sender
            .get(from)
            .filter(|_| from != self.rank)
            .ok_or_else(|| format!("pipeline rank {} receiving from rank {from}", self.rank))?;
        comm.recv(into, from, tag)
            .map_err(|e| format!("receiving from pipeline rank {from}: {e}"))
    }

    fn flush(&mut self) -> Result<()> {
        let (m, cv) = &*self.outbox;
        let mut o = m.lock().unwrap_or_else(|p| p.into_inner());
        // Each send ends within the communicator's timeout, with an error
        // if its receiver never came: this wait ends too.
        while o.queued > 0 {
            o = cv.wait(o).unwrap_or_else(|p| p.into_inner());
        }
        match o.error.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

impl Drop for HostLinks {
    fn drop(&mut self) {
        // Closing the queue ends the thread once its sends are out.
        self.jobs = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
