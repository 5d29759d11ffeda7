//! A full mesh of TCP connections between the ranks of a communicator, and
//! the progress engine that moves framed messages over it.
//!
//! Every message is `kind (u8) | tag (u64 LE) | length (u64 LE) | payload`.
//! Collective messages carry the operation's sequence number as their tag,
//! so a rank that runs ahead or calls a different operation is caught;
//! point-to-point messages carry the user's tag. Messages that arrive
//! before anyone asks for them are kept in a per-peer inbox.
//!
//! [`TcpMesh::exchange`] drives any number of sends and receives at once
//! with `poll(2)` on non-blocking sockets, draining every peer that has data
//! even while only sending to it, so two ranks sending large messages to
//! each other never deadlock.

use crate::backend::Ctx;
use crate::error::{CommError, Result};
use crate::transport::{Recv, Send, Transport};
use braid_store::StoreClient;
use std::collections::VecDeque;
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

const HEADER: usize = 17;
/// Message kinds.
const KIND_COLL: u8 = 0;
const KIND_P2P: u8 = 1;
const MAGIC: &[u8; 8] = b"braidtcp";

struct Msg {
    kind: u8,
    tag: u64,
    data: Vec<u8>,
}

/// Where the bytes of the message being read from a peer go.
enum Dest {
    /// Into the receive with this index in the current `exchange`.
    User(usize),
    /// Into the inbox.
    Inbox(Vec<u8>),
}

enum ReadState {
    Header {
        buf: [u8; HEADER],
        got: usize,
    },
    Payload {
        kind: u8,
        tag: u64,
        len: usize,
        got: usize,
        dest: Dest,
    },
}

struct Peer {
    stream: TcpStream,
    read: ReadState,
    inbox: VecDeque<Msg>,
    closed: Option<String>,
}

/// The mesh of one communicator.
pub struct TcpMesh {
    rank: usize,
    size: usize,
    peers: Vec<Option<Peer>>,
}

impl TcpMesh {
    /// Connects every pair of ranks: each rank listens on `ip`, publishes its
    /// address under `tcp/{rank}` in `store`, connects to lower ranks and
    /// accepts higher ones.
    pub fn connect(
        rank: usize,
        size: usize,
        store: &StoreClient,
        ip: IpAddr,
        timeout: Duration,
    ) -> Result<TcpMesh> {
        let setup = |m: String| CommError::Setup(format!("rank {rank}: tcp mesh: {m}"));
        let listener = TcpListener::bind(SocketAddr::new(ip, 0))
            .map_err(|e| setup(format!("cannot listen on {ip}: {e}")))?;
        let addr = listener.local_addr().map_err(|e| setup(e.to_string()))?;
        store.set(&format!("tcp/{rank}"), addr.to_string())?;
        let deadline = Instant::now() + timeout;
        let mut peers: Vec<Option<Peer>> = (0..size).map(|_| None).collect();
        for (j, slot) in peers.iter_mut().enumerate().take(rank) {
            let remaining = deadline.saturating_duration_since(Instant::now());
            let raw = store.get_timeout(&format!("tcp/{j}"), remaining)?;
            let text = String::from_utf8_lossy(&raw).into_owned();
            let target: SocketAddr = text
                .parse()
                .map_err(|_| setup(format!("rank {j} published a bad address {text:?}")))?;
            let mut stream = connect_retry(target, deadline)
                .map_err(|e| setup(format!("cannot connect to rank {j} at {target}: {e}")))?;
            let mut hello = MAGIC.to_vec();
            hello.extend_from_slice(&(rank as u64).to_le_bytes());
            stream
                .write_all(&hello)
                .map_err(|e| setup(format!("handshake with rank {j}: {e}")))?;
            *slot = Some(new_peer(stream));
        }
        listener
            .set_nonblocking(true)
            .map_err(|e| setup(e.to_string()))?;
        let mut missing = size - rank - 1;
        while missing > 0 {
            match listener.accept() {
                Ok((mut stream, _)) => {
                    stream.set_nonblocking(false).ok();
                    stream.set_read_timeout(Some(Duration::from_secs(10))).ok();
                    let mut hello = [0u8; 16];
                    stream
                        .read_exact(&mut hello)
                        .map_err(|e| setup(format!("handshake from a peer: {e}")))?;
                    if &hello[..8] != MAGIC {
                        continue; // not one of ours
                    }
                    let j = u64::from_le_bytes(hello[8..].try_into().expect("8 bytes")) as usize;
                    if j <= rank || j >= size || peers[j].is_some() {
                        return Err(setup(format!("unexpected handshake from rank {j}")));
                    }
                    peers[j] = Some(new_peer(stream));
                    missing -= 1;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        let absent: Vec<usize> =
                            (rank + 1..size).filter(|j| peers[*j].is_none()).collect();
                        return Err(setup(format!(
                            "rank(s) {absent:?} did not connect within {timeout:?}"
                        )));
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(e) => return Err(setup(format!("accept: {e}"))),
            }
        }
        for p in peers.iter().flatten() {
            p.stream.set_read_timeout(None).ok();
            p.stream
                .set_nonblocking(true)
                .map_err(|e| setup(e.to_string()))?;
        }
        Ok(TcpMesh { rank, size, peers })
    }

    fn peer(&mut self, ctx: &Ctx, j: usize) -> Result<&mut Peer> {
        match self.peers.get_mut(j) {
            Some(Some(p)) => Ok(p),
            _ => Err(ctx.peer_failed(j, "is not a peer of this rank (rank out of range or self)")),
        }
    }

    fn run(
        &mut self,
        ctx: &Ctx,
        kind: u8,
        tag: u64,
        sends: &mut [Send],
        recvs: &mut [Recv],
    ) -> Result<()> {
        // Sends: (header, bytes written so far incl. header)
        let mut send_state: Vec<([u8; HEADER], usize)> = sends
            .iter()
            .map(|s| (header(kind, tag, s.data.len()), 0))
            .collect();
        let mut recv_done = vec![false; recvs.len()];
        // Messages already in an inbox satisfy receives at once.
        for (i, r) in recvs.iter_mut().enumerate() {
            let peer = self.peer(ctx, r.peer)?;
            if let Some(pos) = peer
                .inbox
                .iter()
                .position(|m| m.kind == kind && (kind == KIND_COLL || m.tag == tag))
            {
                let msg = peer.inbox.remove(pos).expect("position is valid");
                check_message(
                    ctx,
                    r.peer,
                    kind,
                    tag,
                    msg.tag,
                    msg.data.len(),
                    r.data.len(),
                )?;
                r.data.copy_from_slice(&msg.data);
                recv_done[i] = true;
            }
        }
        let mut fds: Vec<libc::pollfd> = Vec::with_capacity(self.size);
        let mut fd_peer: Vec<usize> = Vec::with_capacity(self.size);
        loop {
            let sends_left = send_state
                .iter()
                .zip(sends.iter())
                .any(|((_, w), s)| *w < HEADER + s.data.len());
            if !sends_left && recv_done.iter().all(|d| *d) {
                return Ok(());
            }
            ctx.check(|| {
                let mut w: Vec<usize> = recvs
                    .iter()
                    .zip(&recv_done)
                    .filter(|(_, d)| !**d)
                    .map(|(r, _)| r.peer)
                    .collect();
                w.extend(
                    sends
                        .iter()
                        .zip(&send_state)
                        .filter(|(s, st)| st.1 < HEADER + s.data.len())
                        .map(|(s, _)| s.peer),
                );
                w.sort_unstable();
                w.dedup();
                w
            })?;
            fds.clear();
            fd_peer.clear();
            for (j, p) in self.peers.iter().enumerate() {
                let Some(p) = p else { continue };
                if p.closed.is_some() {
                    let owed = recvs
                        .iter()
                        .zip(&recv_done)
                        .any(|(r, d)| r.peer == j && !*d);
                    let owing = sends
                        .iter()
                        .zip(&send_state)
                        .any(|(s, st)| s.peer == j && st.1 < HEADER + s.data.len());
                    if owed || owing {
                        let why = p.closed.clone().unwrap_or_default();
                        return Err(
                            ctx.peer_failed(j, format!("{why} (the process exited or was killed)"))
                        );
                    }
                    continue;
                }
                let wants_write = sends
                    .iter()
                    .zip(&send_state)
                    .any(|(s, st)| s.peer == j && st.1 < HEADER + s.data.len());
                let wants_read = recvs
                    .iter()
                    .zip(&recv_done)
                    .any(|(r, d)| r.peer == j && !*d);
                // Drain peers we send to as well, so neither side blocks.
                if wants_read || wants_write {
                    let mut events = libc::POLLIN;
                    if wants_write {
                        events |= libc::POLLOUT;
                    }
                    fds.push(libc::pollfd {
                        fd: p.stream.as_raw_fd(),
                        events,
                        revents: 0,
                    });
                    fd_peer.push(j);
                }
            }
            let wait_ms = ctx
                .remaining()
                .min(Duration::from_millis(100))
                .as_millis()
                .max(1) as libc::c_int;
            // SAFETY: `fds` is a valid, initialised array of pollfd whose
            // length is passed alongside; poll only writes `revents`.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, wait_ms) };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == ErrorKind::Interrupted {
                    continue;
                }
                return Err(CommError::Setup(format!(
                    "rank {}: poll failed: {e}",
                    self.rank
                )));
            }
            for (k, pfd) in fds.iter().enumerate() {
                if pfd.revents == 0 {
                    continue;
                }
                let j = fd_peer[k];
                if pfd.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0 {
                    self.read_from(ctx, j, kind, tag, recvs, &mut recv_done)?;
                }
                if pfd.revents & libc::POLLOUT != 0 {
                    for (i, s) in sends.iter().enumerate() {
                        if s.peer == j && send_state[i].1 < HEADER + s.data.len() {
                            let (hdr, written) = &mut send_state[i];
                            let peer = self.peers[j].as_mut().expect("polled peers exist");
                            write_some(ctx, j, peer, hdr, s.data, written)?;
                            if *written < HEADER + s.data.len() {
                                break; // socket full; keep order of sends
                            }
                        }
                    }
                }
            }
        }
    }

    /// Reads whatever peer `j` has sent, delivering into matching receives
    /// or its inbox.
    fn read_from(
        &mut self,
        ctx: &Ctx,
        j: usize,
        kind: u8,
        tag: u64,
        recvs: &mut [Recv],
        done: &mut [bool],
    ) -> Result<()> {
        let peer = self.peers[j].as_mut().expect("polled peers exist");
        loop {
            match &mut peer.read {
                ReadState::Header { buf, got } => {
                    match peer.stream.read(&mut buf[*got..]) {
                        Ok(0)
                            if *got == 0
                                && !recvs
                                    .iter()
                                    .zip(done.iter())
                                    .any(|(r, d)| r.peer == j && !*d) =>
                        {
                            // A clean close between messages from a peer that
                            // owes us nothing: it has finished and left.
                            peer.closed = Some("closed its connection".into());
                            return Ok(());
                        }
                        Ok(0) => return Err(closed(ctx, j, peer)),
                        Ok(n) => *got += n,
                        Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(()),
                        Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                        Err(e) => return Err(broken(ctx, j, peer, e)),
                    }
                    if *got < HEADER {
                        continue;
                    }
                    let mkind = buf[0];
                    let mtag = u64::from_le_bytes(buf[1..9].try_into().expect("8 bytes"));
                    let len = u64::from_le_bytes(buf[9..17].try_into().expect("8 bytes")) as usize;
                    // The first pending receive from this peer of our kind
                    // (collectives arrive in order; p2p must match the tag).
                    let target = recvs.iter().enumerate().position(|(i, r)| {
                        r.peer == j
                            && !done[i]
                            && mkind == kind
                            && (kind == KIND_COLL || mtag == tag)
                    });
                    let dest = match target {
                        Some(i) => {
                            check_message(ctx, j, kind, tag, mtag, len, recvs[i].data.len())?;
                            Dest::User(i)
                        }
                        None => {
                            if len > (1usize << 40) {
                                return Err(ctx.peer_failed(
                                    j,
                                    format!("sent an implausible message of {len} bytes"),
                                ));
                            }
                            Dest::Inbox(vec![0u8; len])
                        }
                    };
                    peer.read = ReadState::Payload {
                        kind: mkind,
                        tag: mtag,
                        len,
                        got: 0,
                        dest,
                    };
                }
                ReadState::Payload {
                    kind: mkind,
                    tag: mtag,
                    len,
                    got,
                    dest,
                } => {
                    if *got < *len {
                        let target: &mut [u8] = match dest {
                            Dest::User(i) => &mut recvs[*i].data[*got..],
                            Dest::Inbox(v) => &mut v[*got..],
                        };
                        match peer.stream.read(target) {
                            Ok(0) => return Err(closed(ctx, j, peer)),
                            Ok(n) => *got += n,
                            Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(()),
                            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                            Err(e) => return Err(broken(ctx, j, peer, e)),
                        }
                    }
                    if *got == *len {
                        let (k, t) = (*mkind, *mtag);
                        let finished = std::mem::replace(
                            &mut peer.read,
                            ReadState::Header {
                                buf: [0; HEADER],
                                got: 0,
                            },
                        );
                        if let ReadState::Payload { dest, .. } = finished {
                            match dest {
                                Dest::User(i) => done[i] = true,
                                Dest::Inbox(data) => {
                                    // A message that began arriving during an
                                    // earlier exchange may be the one a
                                    // receive of this exchange waits for.
                                    let wanted = recvs.iter().enumerate().position(|(i, r)| {
                                        r.peer == j
                                            && !done[i]
                                            && k == kind
                                            && (kind == KIND_COLL || t == tag)
                                    });
                                    match wanted {
                                        Some(i) => {
                                            check_message(
                                                ctx,
                                                j,
                                                kind,
                                                tag,
                                                t,
                                                data.len(),
                                                recvs[i].data.len(),
                                            )?;
                                            recvs[i].data.copy_from_slice(&data);
                                            done[i] = true;
                                        }
                                        None => peer.inbox.push_back(Msg {
                                            kind: k,
                                            tag: t,
                                            data,
                                        }),
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

fn new_peer(stream: TcpStream) -> Peer {
    let _ = stream.set_nodelay(true);
    Peer {
        stream,
        read: ReadState::Header {
            buf: [0; HEADER],
            got: 0,
        },
        inbox: VecDeque::new(),
        closed: None,
    }
}

fn connect_retry(target: SocketAddr, deadline: Instant) -> std::io::Result<TcpStream> {
    let mut backoff = Duration::from_millis(5);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match TcpStream::connect_timeout(
            &target,
            left.max(Duration::from_millis(10))
                .min(Duration::from_secs(5)),
        ) {
            Ok(s) => return Ok(s),
            Err(e) if Instant::now() + backoff >= deadline => return Err(e),
            Err(_) => {
                std::thread::sleep(backoff);
                backoff = (backoff * 2).min(Duration::from_millis(200));
            }
        }
    }
}

fn header(kind: u8, tag: u64, len: usize) -> [u8; HEADER] {
    let mut h = [0u8; HEADER];
    h[0] = kind;
    h[1..9].copy_from_slice(&tag.to_le_bytes());
    h[9..17].copy_from_slice(&(len as u64).to_le_bytes());
    h
}

/// A received message must be the one this rank is waiting for.
fn check_message(
    ctx: &Ctx,
    peer: usize,
    kind: u8,
    want_tag: u64,
    tag: u64,
    len: usize,
    want_len: usize,
) -> Result<()> {
    if kind == KIND_COLL && tag != want_tag {
        return Err(CommError::Mismatch(format!(
            "rank {}: {} #{}: rank {peer} sent data for operation #{tag}; the ranks have called different sequences of operations",
            ctx.rank, ctx.op, ctx.seq
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

fn write_some(
    ctx: &Ctx,
    j: usize,
    peer: &mut Peer,
    hdr: &[u8; HEADER],
    data: &[u8],
    written: &mut usize,
) -> Result<()> {
    while *written < HEADER + data.len() {
        let chunk: &[u8] = if *written < HEADER {
            &hdr[*written..]
        } else {
            &data[*written - HEADER..]
        };
        match peer.stream.write(chunk) {
            Ok(0) => return Err(closed(ctx, j, peer)),
            Ok(n) => *written += n,
            Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(()),
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return Err(broken(ctx, j, peer, e)),
        }
    }
    Ok(())
}

fn closed(ctx: &Ctx, j: usize, peer: &mut Peer) -> CommError {
    let why = "closed its connection (the process exited or was killed)".to_string();
    peer.closed = Some(why.clone());
    ctx.peer_failed(j, why)
}

fn broken(ctx: &Ctx, j: usize, peer: &mut Peer, e: std::io::Error) -> CommError {
    let why = format!("is unreachable: connection error {e}");
    peer.closed = Some(why.clone());
    ctx.peer_failed(j, why)
}

impl Transport for TcpMesh {
    /// This rank.
    fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    fn size(&self) -> usize {
        self.size
    }

    /// Runs collective sends and receives (tagged with `ctx.seq`) to completion.
    fn exchange(&mut self, ctx: &Ctx, sends: &mut [Send], recvs: &mut [Recv]) -> Result<()> {
        self.run(ctx, KIND_COLL, ctx.seq, sends, recvs)
    }

    /// Point-to-point send with a user tag.
    fn send_tagged(&mut self, ctx: &Ctx, peer: usize, tag: u64, data: &[u8]) -> Result<()> {
        self.run(ctx, KIND_P2P, tag, &mut [Send { peer, data }], &mut [])
    }

    /// Point-to-point receive of a message with a user tag.
    fn recv_tagged(&mut self, ctx: &Ctx, peer: usize, tag: u64, data: &mut [u8]) -> Result<()> {
        self.run(ctx, KIND_P2P, tag, &mut [], &mut [Recv { peer, data }])
    }

    /// Point-to-point send and receive with a user tag, progressed together.
    fn send_recv_tagged(
        &mut self,
        ctx: &Ctx,
        to: usize,
        send: &[u8],
        from: usize,
        recv: &mut [u8],
        tag: u64,
    ) -> Result<()> {
        self.run(
            ctx,
            KIND_P2P,
            tag,
            &mut [Send {
                peer: to,
                data: send,
            }],
            &mut [Recv {
                peer: from,
                data: recv,
            }],
        )
    }
}
