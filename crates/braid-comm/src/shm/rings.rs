//! Point-to-point messages over shared memory: one byte ring per ordered
//! pair of ranks, carrying `tag (u64) | length (u64) | payload`.
//!
//! [`ShmRings`] is a [`Transport`]: any number of sends and receives are
//! progressed together, a piece at a time, so ranks that all send to each
//! other never deadlock on full rings. Collective messages carry the
//! operation's sequence number with the top bit set; user tags must stay
//! below 2^63. A receive that meets a message with another tag keeps it for
//! the receive that wants it.

use super::channel::{self, Layout};
use super::flag::WaitPolicy;
use super::segment::Segment;
use crate::backend::Ctx;
use crate::error::{CommError, Result};
use crate::transport::{Recv, Send, Transport};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Tag bit marking collective traffic.
pub const COLLECTIVE: u64 = 1 << 63;

/// The rings of one rank.
pub struct ShmRings {
    seg: Arc<Segment>,
    layout: Layout,
    rank: usize,
    policy: WaitPolicy,
    /// Messages that arrived before the receive that wants them, per source.
    pending: Vec<VecDeque<(u64, Vec<u8>)>>,
}

struct Out<'a> {
    peer: usize,
    header: [u8; 16],
    moved: usize,
    payload: &'a [u8],
}

impl Out<'_> {
    fn done(&self) -> bool {
        self.moved == 16 + self.payload.len()
    }
}

struct In<'a> {
    peer: usize,
    tag: u64,
    out: &'a mut [u8],
    header: [u8; 16],
    header_got: usize,
    /// The message being read: its tag, a buffer when it is not ours.
    body: Option<(u64, Option<Vec<u8>>)>,
    got: usize,
    done: bool,
}

impl ShmRings {
    /// Rings of `rank` in `seg`.
    pub fn new(seg: Arc<Segment>, layout: Layout, rank: usize, policy: WaitPolicy) -> ShmRings {
        ShmRings {
            seg,
            layout,
            rank,
            policy,
            pending: (0..layout.n).map(|_| VecDeque::new()).collect(),
        }
    }

    /// Moves as many bytes of `o` as its ring has room for.
    fn try_write(&self, o: &mut Out) -> usize {
        let (head, tail, data) = channel::ring(&self.seg, &self.layout, self.rank, o.peer);
        let cap = self.layout.ring as u64;
        let mut h = head.get();
        let t = tail.get();
        let mut total = 0;
        while !o.done() && h - t < cap {
            let free = (cap - (h - t)) as usize;
            let at = (h % cap) as usize;
            let src: &[u8] = if o.moved < 16 {
                &o.header[o.moved..]
            } else {
                &o.payload[o.moved - 16..]
            };
            let n = free.min(src.len()).min(self.layout.ring - at);
            // SAFETY: [at, at + n) is free space of this ring (the reader
            // has moved `tail` past it) and inside the mapping.
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), data.add(at), n) };
            h += n as u64;
            o.moved += n;
            total += n;
        }
        if total > 0 {
            head.post(h);
        }
        total
    }

    /// Takes up to `out.len()` available bytes from the ring from `src`.
    fn try_read(&self, src: usize, out: &mut [u8]) -> usize {
        let (head, tail, data) = channel::ring(&self.seg, &self.layout, src, self.rank);
        let cap = self.layout.ring as u64;
        let mut t = tail.get();
        let h = head.get();
        let mut done = 0;
        while done < out.len() && h > t {
            let at = (t % cap) as usize;
            let n = ((h - t) as usize)
                .min(out.len() - done)
                .min(self.layout.ring - at);
            // SAFETY: these bytes were published by the sender (head > t)
            // and are not rewritten until `tail` moves past them.
            unsafe { std::ptr::copy_nonoverlapping(data.add(at), out[done..].as_mut_ptr(), n) };
            t += n as u64;
            done += n;
        }
        if done > 0 {
            tail.post(t);
        }
        done
    }

    /// Reads what is available towards `i`; returns bytes moved.
    fn try_receive(&mut self, ctx: &Ctx, i: &mut In) -> Result<usize> {
        let mut moved = 0;
        loop {
            if i.body.is_none() {
                let n = self.try_read(i.peer, &mut i.header[i.header_got..]);
                i.header_got += n;
                moved += n;
                if i.header_got < 16 {
                    return Ok(moved);
                }
                let tag = u64::from_le_bytes(i.header[..8].try_into().expect("8 bytes"));
                let len = u64::from_le_bytes(i.header[8..].try_into().expect("8 bytes")) as usize;
                if tag == i.tag {
                    check(ctx, i.peer, i.tag, tag, len, i.out.len())?;
                    i.body = Some((tag, None));
                } else {
                    if tag & COLLECTIVE != 0 && i.tag & COLLECTIVE != 0 {
                        // Collective traffic arrives in order: a different
                        // sequence number means the ranks diverged.
                        check(ctx, i.peer, i.tag, tag, len, i.out.len())?;
                    }
                    i.body = Some((tag, Some(vec![0u8; len])));
                }
                i.got = 0;
            }
            let (tag, buf) = i.body.as_mut().expect("set above");
            let target: &mut [u8] = match buf {
                None => &mut i.out[i.got..],
                Some(b) => &mut b[i.got..],
            };
            let want = target.len();
            let n = self.try_read(i.peer, target);
            i.got += n;
            moved += n;
            if n < want {
                return Ok(moved);
            }
            let (tag, buf) = (*tag, buf.take());
            i.body = None;
            i.header_got = 0;
            match buf {
                None => {
                    i.done = true;
                    return Ok(moved);
                }
                Some(data) => self.pending[i.peer].push_back((tag, data)),
            }
        }
    }

    fn run(&mut self, ctx: &Ctx, outs: &mut [Out], ins: &mut [In]) -> Result<()> {
        for i in ins.iter_mut() {
            if let Some(pos) = self.pending[i.peer].iter().position(|(t, _)| *t == i.tag) {
                let (_, data) = self.pending[i.peer].remove(pos).expect("position is valid");
                check(ctx, i.peer, i.tag, i.tag, data.len(), i.out.len())?;
                i.out.copy_from_slice(&data);
                i.done = true;
            }
        }
        let mut idle = 0u32;
        let mut idle_since: Option<Instant> = None;
        loop {
            if outs.iter().all(|o| o.done()) && ins.iter().all(|i| i.done) {
                return Ok(());
            }
            let mut moved = 0;
            for o in outs.iter_mut().filter(|o| !o.done()) {
                moved += self.try_write(o);
            }
            for i in ins.iter_mut().filter(|i| !i.done) {
                moved += self.try_receive(ctx, i)?;
            }
            if moved > 0 {
                idle = 0;
                idle_since = None;
                continue;
            }
            idle += 1;
            if idle < self.policy.spin {
                std::hint::spin_loop();
                continue;
            }
            let since = *idle_since.get_or_insert_with(Instant::now);
            if since.elapsed() < self.policy.yield_for {
                std::thread::yield_now();
            } else {
                let waiting: Vec<usize> = ins
                    .iter()
                    .filter(|i| !i.done)
                    .map(|i| i.peer)
                    .chain(outs.iter().filter(|o| !o.done()).map(|o| o.peer))
                    .collect();
                ctx.check(|| waiting)?;
                std::thread::sleep(Duration::from_micros(50));
            }
            if idle % 1024 == 0 && ctx.health.is_aborted() {
                return Err(ctx.aborted());
            }
        }
    }

    fn out<'a>(&self, peer: usize, tag: u64, payload: &'a [u8]) -> Out<'a> {
        let mut header = [0u8; 16];
        header[..8].copy_from_slice(&tag.to_le_bytes());
        header[8..].copy_from_slice(&(payload.len() as u64).to_le_bytes());
        Out {
            peer,
            header,
            moved: 0,
            payload,
        }
    }

    fn inn<'a>(peer: usize, tag: u64, out: &'a mut [u8]) -> In<'a> {
        In {
            peer,
            tag,
            out,
            header: [0; 16],
            header_got: 0,
            body: None,
            got: 0,
            done: false,
        }
    }

    fn check_peer(&self, ctx: &Ctx, peer: usize) -> Result<()> {
        if peer >= self.layout.n || peer == self.rank {
            return Err(ctx.peer_failed(
                peer,
                "is not a peer of this rank (rank out of range or self)",
            ));
        }
        Ok(())
    }
}

fn check(
    ctx: &Ctx,
    peer: usize,
    want_tag: u64,
    tag: u64,
    len: usize,
    want_len: usize,
) -> Result<()> {
    if tag != want_tag {
        return Err(CommError::Mismatch(format!(
            "rank {}: {} #{}: rank {peer} sent data for operation #{}; the ranks have called different sequences of operations",
            ctx.rank,
            ctx.op,
            ctx.seq,
            tag & !COLLECTIVE
        )));
    }
    if len != want_len {
        return Err(CommError::Mismatch(format!(
            "rank {}: {} #{}: rank {peer} sent {len} bytes where this rank expected {want_len} (do all ranks pass the same counts and dtype?)",
            ctx.rank, ctx.op, ctx.seq
        )));
    }
    Ok(())
}

impl Transport for ShmRings {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.layout.n
    }

    fn exchange(&mut self, ctx: &Ctx, sends: &mut [Send], recvs: &mut [Recv]) -> Result<()> {
        let tag = COLLECTIVE | ctx.seq;
        for p in sends
            .iter()
            .map(|s| s.peer)
            .chain(recvs.iter().map(|r| r.peer))
        {
            self.check_peer(ctx, p)?;
        }
        let mut outs: Vec<Out> = sends
            .iter()
            .map(|s| self.out(s.peer, tag, s.data))
            .collect();
        let mut ins: Vec<In> = recvs
            .iter_mut()
            .map(|r| Self::inn(r.peer, tag, r.data))
            .collect();
        self.run(ctx, &mut outs, &mut ins)
    }

    fn send_tagged(&mut self, ctx: &Ctx, peer: usize, tag: u64, data: &[u8]) -> Result<()> {
        self.check_peer(ctx, peer)?;
        let mut outs = [self.out(peer, tag, data)];
        self.run(ctx, &mut outs, &mut [])
    }

    fn recv_tagged(&mut self, ctx: &Ctx, peer: usize, tag: u64, data: &mut [u8]) -> Result<()> {
        self.check_peer(ctx, peer)?;
        self.run(ctx, &mut [], &mut [Self::inn(peer, tag, data)])
    }

    fn send_recv_tagged(
        &mut self,
        ctx: &Ctx,
        to: usize,
        send: &[u8],
        from: usize,
        recv: &mut [u8],
        tag: u64,
    ) -> Result<()> {
        self.check_peer(ctx, to)?;
        self.check_peer(ctx, from)?;
        let mut outs = [self.out(to, tag, send)];
        self.run(ctx, &mut outs, &mut [Self::inn(from, tag, recv)])
    }
}
