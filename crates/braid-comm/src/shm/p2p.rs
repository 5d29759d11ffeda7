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

/// Progress state of one direction of a [`send_recv`].
struct Stream<'a> {
    header: [u8; 16],
    /// Bytes of header + payload moved so far.
    moved: usize,
    payload: &'a [u8],
}

/// Moves as many bytes as the ring to `dst` has room for; returns how many.
fn try_write(ch: &Channel, dst: usize, s: &mut Stream) -> usize {
    let (head, tail, data) = ch.ring(ch.rank, dst);
    let cap = ch.layout.ring as u64;
    let mut h = head.get();
    let t = tail.get();
    let mut total = 0;
    while s.moved < 16 + s.payload.len() && h - t < cap {
        let free = (cap - (h - t)) as usize;
        let at = (h % cap) as usize;
        let src: &[u8] = if s.moved < 16 {
            &s.header[s.moved..]
        } else {
            &s.payload[s.moved - 16..]
        };
        let n = free.min(src.len()).min(ch.layout.ring - at);
        // SAFETY: as in `write`: [at, at + n) is free space of this ring.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), data.add(at), n) };
        h += n as u64;
        s.moved += n;
        total += n;
    }
    if total > 0 {
        head.post(h);
    }
    total
}

/// Takes up to `out.len()` available bytes from the ring from `src`.
fn try_read(ch: &Channel, src: usize, out: &mut [u8]) -> usize {
    let (head, tail, data) = ch.ring(src, ch.rank);
    let cap = ch.layout.ring as u64;
    let mut t = tail.get();
    let h = head.get();
    let mut done = 0;
    while done < out.len() && h > t {
        let at = (t % cap) as usize;
        let n = ((h - t) as usize)
            .min(out.len() - done)
            .min(ch.layout.ring - at);
        // SAFETY: as in `read`: these bytes were published by the sender.
        unsafe { std::ptr::copy_nonoverlapping(data.add(at), out[done..].as_mut_ptr(), n) };
        t += n as u64;
        done += n;
    }
    if done > 0 {
        tail.post(t);
    }
    done
}

/// Sends `payload` to `dst` while receiving the message tagged `tag` from
/// `src` into `out`, interleaving both so that rings never deadlock.
#[allow(clippy::too_many_arguments)]
pub fn send_recv(
    ch: &Channel,
    pending: &mut Pending,
    ctx: &Ctx,
    dst: usize,
    payload: &[u8],
    src: usize,
    tag: u64,
    out: &mut [u8],
) -> Result<()> {
    let mut header = [0u8; 16];
    header[..8].copy_from_slice(&tag.to_le_bytes());
    header[8..].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    let mut tx = Stream {
        header,
        moved: 0,
        payload,
    };
    // Receive side: maybe already pending.
    let q = pending.queue(src);
    let mut rx_done = false;
    if let Some(pos) = q.iter().position(|(t, _)| *t == tag) {
        let (_, data) = q.remove(pos).expect("position is valid");
        check_len(ctx, src, data.len(), out.len())?;
        out.copy_from_slice(&data);
        rx_done = true;
    }
    let mut rx_header = [0u8; 16];
    let mut rx_header_got = 0;
    // Some(len) once a header is read: Ok(out) for ours, Err(buffer) for another tag.
    let mut rx_body: Option<(u64, Vec<u8>, bool)> = None;
    let mut rx_got = 0;
    let mut idle = 0u32;
    loop {
        let tx_done = tx.moved == 16 + payload.len();
        if tx_done && rx_done {
            return Ok(());
        }
        let mut progressed = 0;
        if !tx_done {
            progressed += try_write(ch, dst, &mut tx);
        }
        if !rx_done {
            if rx_header_got < 16 {
                let n = try_read(ch, src, &mut rx_header[rx_header_got..]);
                rx_header_got += n;
                progressed += n;
                if rx_header_got == 16 {
                    let mtag = u64::from_le_bytes(rx_header[..8].try_into().expect("8 bytes"));
                    let len =
                        u64::from_le_bytes(rx_header[8..].try_into().expect("8 bytes")) as usize;
                    if mtag == tag {
                        check_len(ctx, src, len, out.len())?;
                        rx_body = Some((mtag, Vec::new(), true));
                    } else {
                        rx_body = Some((mtag, vec![0u8; len], false));
                    }
                    rx_got = 0;
                }
            }
            if let Some((mtag, buf, ours)) = &mut rx_body {
                let target: &mut [u8] = if *ours {
                    &mut out[rx_got..]
                } else {
                    &mut buf[rx_got..]
                };
                let n = try_read(ch, src, target);
                rx_got += n;
                progressed += n;
                let want = if *ours { out.len() } else { buf.len() };
                if rx_got == want {
                    if *ours {
                        rx_done = true;
                    } else {
                        pending.queue(src).push_back((*mtag, std::mem::take(buf)));
                    }
                    rx_body = None;
                    rx_header_got = 0;
                }
            }
        }
        if progressed == 0 {
            idle += 1;
            if idle > 64 {
                ctx.check(|| vec![src, dst])?;
                std::thread::sleep(std::time::Duration::from_micros(20));
            } else {
                std::thread::yield_now();
            }
        } else {
            idle = 0;
        }
    }
}
