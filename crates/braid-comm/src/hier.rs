//! The hierarchical backend: shared memory among the ranks of each host,
//! tcp among one leader per host.
//!
//! All-reduce, reduce, broadcast and barrier run in three stages (inside the
//! host, between leaders, inside the host again), so only one rank per host
//! puts data on the network. The other collectives use a tcp mesh of all
//! ranks, which is correct everywhere and simpler than staging them.

use crate::backend::{Backend, Ctx, Data};
use crate::error::Result;
use crate::p2p_backend::P2pBackend;
use crate::setup::{PeerInfo, SetupCtx};
use crate::shm::ShmBackend;
use crate::tcp::TcpMesh;
use crate::tuning::Algo;
use braid_core::reduce;
use braid_core::{DType, ReduceOp};

/// Hierarchical backend of one rank.
pub struct HierBackend {
    n: usize,
    /// Host index of every rank.
    host_of: Vec<usize>,
    /// Leader (lowest rank) of every host.
    leaders: Vec<usize>,
    /// Local rank of every rank within its host.
    local_rank_of: Vec<usize>,
    my_host: usize,
    local: ShmBackend,
    leader: Option<P2pBackend>,
    global: P2pBackend,
}

impl HierBackend {
    /// Sets up the local, leader and global parts.
    pub fn create(s: &SetupCtx, forced: Option<Algo>) -> Result<HierBackend> {
        let n = s.peers.len();
        let mut hosts: Vec<&str> = Vec::new();
        let mut host_of = Vec::with_capacity(n);
        for p in s.peers {
            let h = match hosts.iter().position(|x| *x == p.host) {
                Some(h) => h,
                None => {
                    hosts.push(&p.host);
                    hosts.len() - 1
                }
            };
            host_of.push(h);
        }
        let leaders: Vec<usize> = (0..hosts.len())
            .map(|h| {
                host_of
                    .iter()
                    .position(|x| *x == h)
                    .expect("every host has a rank")
            })
            .collect();
        let local_rank_of: Vec<usize> = (0..n)
            .map(|r| (0..r).filter(|q| host_of[*q] == host_of[r]).count())
            .collect();
        let my_host = host_of[s.rank];
        let local_peers: Vec<PeerInfo> = (0..n)
            .filter(|r| host_of[*r] == my_host)
            .map(|r| s.peers[r].clone())
            .collect();
        let local_store = s.store.with_prefix(&format!("local{my_host}/"));
        let local_id = format!("{}.h{my_host}", s.id);
        let local = ShmBackend::create(&SetupCtx {
            rank: local_rank_of[s.rank],
            peers: &local_peers,
            store: &local_store,
            id: &local_id,
            run_id: s.run_id,
            timeout: s.timeout,
            shm_half: s.shm_half,
        })?;
        let leader = if leaders[my_host] == s.rank {
            let store = s.store.with_prefix("leaders/");
            let mesh = TcpMesh::connect(
                my_host,
                leaders.len(),
                &store,
                s.peers[s.rank].ip,
                s.timeout,
            )?;
            Some(P2pBackend::new(mesh, forced))
        } else {
            None
        };
        let global_store = s.store.with_prefix("global/");
        let global = P2pBackend::new(
            TcpMesh::connect(s.rank, n, &global_store, s.peers[s.rank].ip, s.timeout)?,
            forced,
        );
        Ok(HierBackend {
            n,
            host_of,
            leaders,
            local_rank_of,
            my_host,
            local,
            leader,
            global,
        })
    }

    /// Sum (or min/max/prod) across all ranks of `buf`, in place, staged.
    fn staged_all_reduce(
        &mut self,
        ctx: &Ctx,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        let stage_op = if op == ReduceOp::Avg {
            ReduceOp::Sum
        } else {
            op
        };
        self.local
            .reduce(ctx, Data::InPlace(buf), dtype, stage_op, 0)?;
        if let Some(leader) = &mut self.leader {
            leader.all_reduce(ctx, Data::InPlace(buf), dtype, stage_op)?;
        }
        self.local.broadcast(ctx, Data::InPlace(buf), 0)?;
        if op == ReduceOp::Avg {
            reduce::divide(dtype, buf, self.n);
        }
        Ok(())
    }
}

impl Backend for HierBackend {
    fn name(&self) -> &'static str {
        "hier"
    }

    fn all_reduce(&mut self, ctx: &Ctx, data: Data, dtype: DType, op: ReduceOp) -> Result<()> {
        let buf = data.into_in_place();
        crate::backend::with_f32_accumulation(buf, dtype, |b, d| {
            self.staged_all_reduce(ctx, b, d, op)
        })
    }

    fn reduce(
        &mut self,
        ctx: &Ctx,
        data: Data,
        dtype: DType,
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        let mut tmp = data.input().to_vec();
        crate::backend::with_f32_accumulation(&mut tmp, dtype, |b, d| {
            self.staged_all_reduce(ctx, b, d, op)
        })?;
        if ctx.rank == root {
            match data {
                Data::InPlace(b) => b.copy_from_slice(&tmp),
                Data::OutOfPlace { recv, .. } => recv.copy_from_slice(&tmp),
            }
        }
        Ok(())
    }

    fn broadcast(&mut self, ctx: &Ctx, data: Data, root: usize) -> Result<()> {
        let buf = if ctx.rank == root {
            data.into_in_place()
        } else {
            match data {
                Data::InPlace(b) => b,
                Data::OutOfPlace { recv, .. } => recv,
            }
        };
        let root_host = self.host_of[root];
        if self.my_host == root_host {
            self.local
                .broadcast(ctx, Data::InPlace(buf), self.local_rank_of[root])?;
        }
        if let Some(leader) = &mut self.leader {
            leader.broadcast(ctx, Data::InPlace(buf), root_host)?;
        }
        if self.my_host != root_host {
            self.local.broadcast(ctx, Data::InPlace(buf), 0)?;
        }
        let _ = &self.leaders;
        Ok(())
    }

    fn all_gather_v(
        &mut self,
        ctx: &Ctx,
        send: &[u8],
        recv: &mut [u8],
        counts: &[usize],
    ) -> Result<()> {
        self.global.all_gather_v(ctx, send, recv, counts)
    }

    fn reduce_scatter(
        &mut self,
        ctx: &Ctx,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        self.global.reduce_scatter(ctx, send, recv, dtype, op)
    }

    fn all_to_all_v(
        &mut self,
        ctx: &Ctx,
        send: &[u8],
        sc: &[usize],
        recv: &mut [u8],
        rc: &[usize],
    ) -> Result<()> {
        self.global.all_to_all_v(ctx, send, sc, recv, rc)
    }

    fn gather(&mut self, ctx: &Ctx, send: &[u8], recv: &mut [u8], root: usize) -> Result<()> {
        self.global.gather(ctx, send, recv, root)
    }

    fn scatter(&mut self, ctx: &Ctx, send: &[u8], recv: &mut [u8], root: usize) -> Result<()> {
        self.global.scatter(ctx, send, recv, root)
    }

    fn send(&mut self, ctx: &Ctx, buf: &[u8], peer: usize, tag: u64) -> Result<()> {
        self.global.send(ctx, buf, peer, tag)
    }

    fn recv(&mut self, ctx: &Ctx, buf: &mut [u8], peer: usize, tag: u64) -> Result<()> {
        self.global.recv(ctx, buf, peer, tag)
    }

    fn send_recv(
        &mut self,
        ctx: &Ctx,
        send: &[u8],
        to: usize,
        recv: &mut [u8],
        from: usize,
        tag: u64,
    ) -> Result<()> {
        self.global.send_recv(ctx, send, to, recv, from, tag)
    }

    fn barrier(&mut self, ctx: &Ctx) -> Result<()> {
        self.local.barrier(ctx)?;
        if let Some(leader) = &mut self.leader {
            leader.barrier(ctx)?;
        }
        self.local.barrier(ctx)
    }
}
