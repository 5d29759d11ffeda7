//! A rank's place in a training run and the communicators it trains
//! over: [`Place`] (the world, the tensor and pipeline degrees, hybrid
//! sharding), checked at start with one clear error, whose mesh
//! ([`Place::mesh`], [`crate::mesh::Mesh::training`]) every group is split
//! from — the host groups of a tensor-parallel rank ([`split`]) or a
//! pipeline rank ([`split_pipeline`]), the GPU groups ([`split_gpu`],
//! [`split_gpu_part`]).

use crate::collective::{Collective, HostCollective};
use crate::mesh::{Degrees, Mesh};
use crate::tensor_parallel::{DeviceTensorGroup, HostTensorGroup};
use crate::Result;
use braid_comm::gpu::GpuCommunicator;
use braid_comm::Communicator;
use braid_model::layout::TensorShard;
use std::sync::Arc;

/// Where this rank sits: the world, its tensor group and its data group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Place {
    /// Ranks in the world, and this one.
    pub world: usize,
    /// This rank in the world.
    pub rank: usize,
    /// Ranks per tensor group (`--tp`; 1: none).
    pub tensor: usize,
    /// Pipeline stages' ranks (`--pp`; 1: none).
    pub pipe: usize,
    /// Sequence parallelism in the tensor groups.
    pub sequence: bool,
    /// Hybrid sharding: data ranks per shard group (`--shard-group`).
    pub shard_group: Option<usize>,
}

impl Place {
    /// Data-parallel replicas: the world over the tensor and pipeline
    /// groups.
    pub fn data(&self) -> usize {
        self.world / (self.tensor * self.pipe)
    }

    /// This rank among its data group's (its replica's index).
    pub fn data_rank(&self) -> usize {
        self.rank / (self.tensor * self.pipe)
    }

    /// This rank's share of the model.
    pub fn shard(&self) -> TensorShard {
        TensorShard {
            rank: self.rank % self.tensor,
            size: self.tensor,
        }
    }

    /// The run's mesh, every group's source (data outermost — replicate
    /// × shard under hybrid sharding — then the pipeline where there is
    /// one, tensor groups consecutive ranks): [`Mesh::training`].
    pub fn mesh(&self) -> Result<Mesh> {
        let degrees = Degrees {
            tensor: self.tensor,
            pipe: self.pipe,
            shard_group: self.shard_group,
        };
        Mesh::training(self.world, self.rank, degrees)
    }

    /// Checks `--tp` against the world and the node at start: it divides
    /// the world, and a tensor group fits in one node (`local` workers).
    pub fn check(&self, local: usize) -> Result<()> {
        let n = self.tensor;
        if n == 0 {
            return Err("--tp 0: use 1 (no tensor parallelism) or more".into());
        }
        if self.pipe == 0 {
            return Err("--pp 0: use 1 (no pipeline) or more".into());
        }
        let both = n * self.pipe;
        if self.pipe > 1 && self.world % both != 0 {
            return Err(format!(
                "--tp {n} x --pp {} = {both} ranks per model does not divide the {} ranks: the \
                 rest of the world is data parallel over whole models (start a multiple of \
                 {both} ranks)",
                self.pipe, self.world
            ));
        }
        if self.world % n != 0 {
            return Err(format!(
                "--tp {n} does not divide the {} ranks: the ranks form tensor groups of {n}, the \
                 rest data parallel (use a --tp that divides {}, or start a multiple of {n} ranks)",
                self.world, self.world
            ));
        }
        if n > 1 && local % n != 0 {
            return Err(format!(
                "--tp {n}: a tensor group is consecutive ranks on one node, and this node has {local} \
                 worker(s) (its collectives run in every layer: keep them inside a node; use a --tp \
                 that divides {local})"
            ));
        }
        Ok(())
    }
}

/// The communicators of a tensor-parallel rank: its tensor group (as the
/// model's collectives) and its data group (what the strategy reduces
/// gradients over); the layout, printed at start.
pub struct Groups {
    /// The model's collectives.
    pub tensor: Arc<HostTensorGroup>,
    /// The strategy's.
    pub data: HostCollective,
    /// The mesh in one line.
    pub layout: String,
}

/// Splits the world's communicator as `place` says (every rank calls it).
pub fn split(world: &Communicator, place: &Place) -> Result<Groups> {
    let mesh = place.mesh()?;
    let all = HostCollective::new(world.clone());
    let tensor = mesh.split(&all, "tensor")?;
    let data = mesh.split(&all, "data")?;
    Ok(Groups {
        tensor: Arc::new(HostTensorGroup::new(tensor.host().clone())),
        data,
        layout: mesh.describe(),
    })
}

/// The communicators of a pipeline rank: its pipeline group, its tensor
/// group under `--tp` (the model's collectives) and its data group.
pub struct PipeGroups {
    /// The stages' ranks of this rank's model.
    pub pipe: Communicator,
    /// The model's collectives, under `--tp`.
    pub tensor: Option<Arc<HostTensorGroup>>,
    /// The strategy's.
    pub data: HostCollective,
}

/// Splits the world's communicator into pipeline and data groups (every
/// rank calls it).
pub fn split_pipeline(world: &Communicator, place: &Place) -> Result<PipeGroups> {
    let mesh = place.mesh()?;
    let all = HostCollective::new(world.clone());
    let pipe = mesh.split(&all, "pipe")?;
    let tensor = match place.tensor {
        1 => None,
        _ => Some(mesh.split(&all, "tensor")?),
    };
    let data = mesh.split(&all, "data")?;
    Ok(PipeGroups {
        pipe: pipe.host().clone(),
        tensor: tensor.map(|t| Arc::new(HostTensorGroup::new(t.host().clone()))),
        data,
    })
}

/// This rank's group of the mesh's dimension `name` over GPUs (every
/// rank calls it).
pub fn split_gpu_part(world: &GpuCommunicator, mesh: &Mesh, name: &str) -> Result<GpuCommunicator> {
    world
        .split(Some(mesh.color(name)), mesh.coord(name) as i64)
        .map_err(|e| format!("splitting the {name} groups: {e}"))?
        .ok_or_else(|| format!("splitting the {name} groups: this rank joined none"))
}

/// The groups of a tensor-parallel rank on GPUs: its tensor group's NCCL
/// collectives (as the model's), the same group's host communicator (to
/// put the whole model together for --save), and its data group (the
/// strategy's).
pub struct GpuGroups {
    /// The model's collectives.
    pub tensor: Arc<DeviceTensorGroup>,
    /// The tensor group on the host.
    pub tensor_host: Arc<HostTensorGroup>,
    /// The strategy's.
    pub data: GpuCommunicator,
    /// The mesh in one line.
    pub layout: String,
}

/// Splits the world's GPU communicator as `place` says (every rank calls
/// it).
pub fn split_gpu(world: &GpuCommunicator, place: &Place) -> Result<GpuGroups> {
    let mesh = place.mesh()?;
    let part = |name: &str| split_gpu_part(world, &mesh, name);
    let tensor = part("tensor")?;
    let data = part("data")?;
    Ok(GpuGroups {
        tensor_host: Arc::new(HostTensorGroup::new(tensor.host().clone())),
        tensor: Arc::new(DeviceTensorGroup::new(tensor)),
        data,
        layout: mesh.describe(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensor_groups_must_divide_the_world_and_fit_a_node() {
        let p = |world, tensor| Place {
            world,
            rank: 0,
            tensor,
            pipe: 1,
            sequence: true,
            shard_group: None,
        };
        assert!(p(4, 2).check(4).is_ok());
        assert!(p(6, 4)
            .check(6)
            .unwrap_err()
            .contains("does not divide the 6 ranks"));
        assert!(p(8, 4).check(2).unwrap_err().contains("one node"));
        assert_eq!((p(8, 2).data(), p(8, 2).shard().size), (4, 2));
        let q = Place { rank: 5, ..p(8, 2) };
        assert_eq!((q.data_rank(), q.shard().rank), (2, 1));
        // data 2 x pipe 2 x tensor 2: rank 5 is data 1, stage 0, tensor 1.
        let r = Place { pipe: 2, ..q };
        assert_eq!((r.data(), r.data_rank()), (2, 1));
        assert_eq!(r.mesh().unwrap().coord("pipe"), 0);
        assert!(Place { pipe: 4, ..p(6, 1) }
            .check(6)
            .unwrap_err()
            .contains("does not divide"));
    }
}
