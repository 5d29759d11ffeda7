//! [`Transport`]: point-to-point message passing between the ranks of a
//! communicator, what the algorithms of [`crate::p2p_backend`] are written
//! against. Two implementations: TCP connections ([`crate::tcp::TcpMesh`])
//! and shared-memory rings ([`crate::shm::rings::ShmRings`]).

use crate::backend::Ctx;
use crate::error::Result;

/// One pending send in an [`exchange`](Transport::exchange).
pub struct Send<'a> {
    /// Destination rank.
    pub peer: usize,
    /// Bytes to send.
    pub data: &'a [u8],
}

/// One pending receive in an [`exchange`](Transport::exchange).
pub struct Recv<'a> {
    /// Source rank.
    pub peer: usize,
    /// Exactly this many bytes are expected.
    pub data: &'a mut [u8],
}

/// Point-to-point messages between ranks.
pub trait Transport: std::marker::Send {
    /// This rank.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn size(&self) -> usize;
    /// Runs the collective sends and receives of operation `ctx.seq`
    /// concurrently to completion (never deadlocking on each other).
    fn exchange(&mut self, ctx: &Ctx, sends: &mut [Send], recvs: &mut [Recv]) -> Result<()>;
    /// Point-to-point send with a user tag.
    fn send_tagged(&mut self, ctx: &Ctx, peer: usize, tag: u64, data: &[u8]) -> Result<()>;
    /// Point-to-point receive of the next message from `peer` with `tag`.
    fn recv_tagged(&mut self, ctx: &Ctx, peer: usize, tag: u64, data: &mut [u8]) -> Result<()>;
    /// A send and a receive with a user tag, progressed together.
    fn send_recv_tagged(
        &mut self,
        ctx: &Ctx,
        to: usize,
        send: &[u8],
        from: usize,
        recv: &mut [u8],
        tag: u64,
    ) -> Result<()>;
}
