//! Point-to-point messages over shared memory: one byte ring per ordered
//! pair of ranks, carrying `tag (u64) | length (u64) | payload`. A receive
//! that meets a message with another tag keeps it for later.

use super::channel::Channel;
use super::flag;
use crate::backend::Ctx;
use crate::error::{CommError, Result};
use std::collections::VecDeque;

/// Messages received ahead of the receive that wants them, per source.
#[derive(Default)]
pub struct Pending {
    by_src: Vec<VecDeque<(u64, Vec<u8>)>>,
}

impl Pending {
    fn queue(&mut self, src: usize) -> &mut VecDeque<(u64, Vec<u8>)> {
        if self.by_src.len() <= src {
            self.by_src.resize_with(src + 1, VecDeque::new);
        }
        &mut self.by_src[src]
    }
}

/// Appends `bytes` to the ring from this rank to `dst`, waiting for space.
fn write(ch: &Channel, ctx: &Ctx, dst: usize, mut bytes: &[u8]) -> Result<()> {
    let (head, tail, data) = ch.ring(ch.rank, dst);
    let cap = ch.layout.ring as u64;
    let mut h = head.get();
    while !bytes.is_empty() {
        let t = tail.get();
        if h - t == cap {
            flag::wait(tail, h - cap + 1, ch.policy, ctx, dst)?;
            continue;
        }
        let free = (cap - (h - t)) as usize;
        let at = (h % cap) as usize;
        let n = free.min(bytes.len()).min(ch.layout.ring - at);
        // SAFETY: [at, at + n) lies inside this pair's ring; the receiver
        // does not read it until `head` is posted past it.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), data.add(at), n) };
        h += n as u64;
        head.post(h);
        bytes = &bytes[n..];
    }
    Ok(())
}

/// Takes exactly `out.len()` bytes from the ring from `src`.
fn read(ch: &Channel, ctx: &Ctx, src: usize, out: &mut [u8]) -> Result<()> {
    let (head, tail, data) = ch.ring(src, ch.rank);
    let cap = ch.layout.ring as u64;
    let mut t = tail.get();
    let mut done = 0;
    while done < out.len() {
        let h = head.get();
        if h == t {
            flag::wait(head, t + 1, ch.policy, ctx, src)?;
            continue;
        }
        let at = (t % cap) as usize;
        let n = ((h - t) as usize)
            .min(out.len() - done)
            .min(ch.layout.ring - at);
        // SAFETY: [at, at + n) was published by the sender (head > t) and is
        // not rewritten until `tail` is posted past it.
        unsafe { std::ptr::copy_nonoverlapping(data.add(at), out[done..].as_mut_ptr(), n) };
        t += n as u64;
        tail.post(t);
        done += n;
    }
    Ok(())
}

/// Sends a tagged message to `dst`.
pub fn send(ch: &Channel, ctx: &Ctx, dst: usize, tag: u64, payload: &[u8]) -> Result<()> {
    let mut header = [0u8; 16];
    header[..8].copy_from_slice(&tag.to_le_bytes());
    header[8..].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    write(ch, ctx, dst, &header)?;
    write(ch, ctx, dst, payload)
}

/// Receives the next message from `src` with `tag` into `out`.
pub fn recv(
    ch: &Channel,
    pending: &mut Pending,
    ctx: &Ctx,
    src: usize,
    tag: u64,
    out: &mut [u8],
) -> Result<()> {
    let q = pending.queue(src);
    if let Some(pos) = q.iter().position(|(t, _)| *t == tag) {
        let (_, data) = q.remove(pos).expect("position is valid");
        return check_len(ctx, src, data.len(), out.len()).map(|_| out.copy_from_slice(&data));
    }
    loop {
        let mut header = [0u8; 16];
        read(ch, ctx, src, &mut header)?;
        let mtag = u64::from_le_bytes(header[..8].try_into().expect("8 bytes"));
        let len = u64::from_le_bytes(header[8..].try_into().expect("8 bytes")) as usize;
        if mtag == tag {
            check_len(ctx, src, len, out.len())?;
            return read(ch, ctx, src, out);
        }
        let mut data = vec![0u8; len];
        read(ch, ctx, src, &mut data)?;
        pending.queue(src).push_back((mtag, data));
    }
}

fn check_len(ctx: &Ctx, src: usize, len: usize, want: usize) -> Result<()> {
    if len != want {
        return Err(CommError::Mismatch(format!(
            "rank {}: recv #{} expected {want} bytes but rank {src} sent {len}",
            ctx.rank, ctx.seq
        )));
    }
    Ok(())
}
