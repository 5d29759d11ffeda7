//! [`DeviceLinks`]: a pipeline rank's messages between GPUs over NCCL
//! point-to-point. Each direction between two ranks that the schedule
//! sends on is a two-rank NCCL communicator of its own (split from the
//! pipeline group once), so each has its own stream and its own order:
//! the schedule's check proves every link's sends and receives pair up in
//! order, and a send waiting for its receiver holds up nothing but later
//! sends on the same link — never the rank's compute, which is what the
//! check assumes (as [`super::links::HostLinks`]' sending thread gives on
//! CPUs).
//!
//! A send copies the activation (or gradient) into a buffer of the link
//! whose last send has gone out (a new one where none has: no send waits
//! for an earlier one's buffer, and the link keeps as many as were out at
//! once), queues `ncclSend` after the compute stream's work so far and
//! returns; the compute stream never waits for it. A receive queues
//! `ncclRecv` into the stage's buffer and the compute stream waits for
//! it (on the GPU: the host goes on queueing). The end of a step waits,
//! within the communicators' timeout, for every send to have gone out.
//! Messages carry no tag on the wire: a link's order is the tag. The
//! links are kept (and so destroyed, which NCCL does together with the
//! peer) in the same order on every rank.

use super::exec::Links;
use crate::Result;
use braid_comm::gpu::GpuCommunicator;
use braid_cuda::memory::copy_async;
use braid_cuda::{DeviceBuffer, Event, Stream};
use std::time::Duration;

/// One direction between two pipeline ranks.
struct Link {
    /// Its sending and receiving pipeline ranks.
    from: usize,
    to: usize,
    /// The two-rank communicator.
    comm: GpuCommunicator,
    /// The other rank's index in it.
    peer: usize,
    /// Send buffers (outgoing links only), each with an event recorded
    /// once its last send went out.
    staging: Vec<(DeviceBuffer<f32>, Event)>,
}

/// One pipeline rank's links to the others over NCCL.
pub struct DeviceLinks {
    rank: usize,
    /// This rank's links, by (from, to): the same order on every rank.
    links: Vec<Link>,
    /// The compute stream (the device's main stream).
    main: Stream,
    /// Where the sends' completion is ordered (nothing else runs there).
    sent: Stream,
    timeout: Duration,
}

impl DeviceLinks {
    /// Links over the pipeline group `group` for the directed pairs
    /// `(from, to)` of pipeline ranks that messages go between (every
    /// rank of the group calls this with the same pairs: it splits the
    /// group once per pair).
    pub fn new(group: &GpuCommunicator, pairs: &[(usize, usize)]) -> Result<DeviceLinks> {
        let (rank, size) = (group.rank(), group.size());
        let mut pairs = pairs.to_vec();
        pairs.sort_unstable();
        pairs.dedup();
        let mut links = Vec::new();
        for &(from, to) in &pairs {
            if from == to || from >= size || to >= size {
                return Err(format!(
                    "a pipeline link from rank {from} to rank {to} in a group of {size}"
                ));
            }
            let member = rank == from || rank == to;
            let named = |e: String| format!("the pipeline's link from rank {from} to {to}: {e}");
            let comm = group
                .split(member.then_some(0), rank as i64)
                .map_err(|e| named(e.to_string()))?;
            let Some(comm) = comm.filter(|_| member) else {
                continue;
            };
            let other = if rank == from { to } else { from };
            links.push(Link {
                from,
                to,
                comm,
                // Ordered by pipeline rank: the lower is 0.
                peer: usize::from(other > rank),
                staging: Vec::new(),
            });
        }
        let device = group.device().clone();
        Ok(DeviceLinks {
            rank,
            links,
            main: device.main_stream(),
            sent: Stream::new(&device).map_err(|e| e.to_string())?,
            timeout: group.timeout(),
        })
    }
}

impl Links<DeviceBuffer<f32>> for DeviceLinks {
    fn send(&mut self, to: usize, _tag: u64, data: &DeviceBuffer<f32>) -> Result<()> {
        let rank = self.rank;
        let link = self
            .links
            .iter_mut()
            .find(|l| (l.from, l.to) == (rank, to))
            .ok_or_else(|| format!("pipeline rank {rank} has no link to rank {to}"))?;
        let e = |x: String| format!("sending to pipeline rank {to}: {x}");
        // A buffer of the right size whose last send has gone out.
        let mut free = None;
        for (i, (buf, done)) in link.staging.iter().enumerate() {
            if buf.len() == data.len() && done.query().map_err(|x| e(x.to_string()))? {
                free = Some(i);
                break;
            }
        }
        let i = match free {
            Some(i) => i,
            None => {
                let device = link.comm.device();
                let buf = DeviceBuffer::zeros(device, data.len()).map_err(|x| e(x.to_string()))?;
                let done = Event::new(device).map_err(|x| e(x.to_string()))?;
                link.staging.push((buf, done));
                link.staging.len() - 1
            }
        };
        let (slot, done) = &mut link.staging[i];
        copy_async(slot, data, &self.main).map_err(|x| e(x.to_string()))?;
        link.comm
            .send(slot, link.peer)
            .and_then(|w| w.then_on(&self.sent))
            .map_err(|x| e(x.to_string()))?;
        done.record(&self.sent).map_err(|x| e(x.to_string()))
    }

    fn recv(&mut self, from: usize, _tag: u64, into: &mut DeviceBuffer<f32>) -> Result<()> {
        let rank = self.rank;
        let link = self
            .links
            .iter_mut()
            .find(|l| (l.from, l.to) == (from, rank))
            .ok_or_else(|| format!("pipeline rank {rank} has no link from rank {from}"))?;
        // Dropped: the compute stream waits for it.
        drop(
            link.comm
                .recv(into, link.peer)
                .map_err(|x| format!("receiving from pipeline rank {from}: {x}"))?,
        );
        Ok(())
    }

    fn flush(&mut self) -> Result<()> {
        self.sent
            .synchronize_within(self.timeout, "the pipeline's sends of the step")
            .map_err(|e| {
                format!(
                    "pipeline rank {}: {e} (a receiving rank stopped or never came)",
                    self.rank
                )
            })
    }
}
