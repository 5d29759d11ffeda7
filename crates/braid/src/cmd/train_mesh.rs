//! `braid train`'s mesh: the world's ranks as data × pipeline × tensor
//! groups from `--pp` and `--tp` (tensor groups of consecutive ranks,
//! inside a node; pipeline groups over them), every choice checked at
//! start with one clear error; and the communicators a rank of such a
//! mesh trains over.

use braid_comm::Communicator;
use braid_model::layout::TensorShard;
use braid_train::collective::HostCollective;
use braid_train::mesh::{Degrees, Mesh};
use braid_train::tensor_parallel::HostTensorGroup;
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
    pub fn mesh(&self) -> Result<Mesh, String> {
        let degrees = Degrees {
            tensor: self.tensor,
            pipe: self.pipe,
            shard_group: self.shard_group,
        };
        Mesh::training(self.world, self.rank, degrees)
    }

    /// Checks `--tp` against the world and the node at start: it divides
    /// the world, and a tensor group fits in one node (`local` workers).
    pub fn check(&self, local: usize) -> Result<(), String> {
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
pub fn split(world: &Communicator, place: &Place) -> Result<Groups, String> {
    let mesh = place.mesh()?;
    let all = HostCollective::new(world.clone());
    let tensor = mesh.split(&all, "tensor")?;
    let data = mesh.split(&all, "data")?;
    use braid_train::collective::Collective;
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
pub fn split_pipeline(world: &Communicator, place: &Place) -> Result<PipeGroups, String> {
    let mesh = place.mesh()?;
    let all = HostCollective::new(world.clone());
    let pipe = mesh.split(&all, "pipe")?;
    let tensor = match place.tensor {
        1 => None,
        _ => Some(mesh.split(&all, "tensor")?),
    };
    let data = mesh.split(&all, "data")?;
    use braid_train::collective::Collective;
    Ok(PipeGroups {
        pipe: pipe.host().clone(),
        tensor: tensor.map(|t| Arc::new(HostTensorGroup::new(t.host().clone()))),
        data,
    })
}

/// This rank's group of the mesh's dimension `name` over GPUs (every
/// rank calls it).
pub fn split_gpu_part(
    world: &braid_comm::gpu::GpuCommunicator,
    mesh: &braid_train::mesh::Mesh,
    name: &str,
) -> Result<braid_comm::gpu::GpuCommunicator, String> {
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
    pub tensor: Arc<braid_train::tensor_parallel::DeviceTensorGroup>,
    /// The tensor group on the host.
    pub tensor_host: Arc<HostTensorGroup>,
    /// The strategy's.
    pub data: braid_comm::gpu::GpuCommunicator,
    /// The mesh in one line.
    pub layout: String,
}

/// Splits the world's GPU communicator as `place` says (every rank calls
/// it).
pub fn split_gpu(
    world: &braid_comm::gpu::GpuCommunicator,
    place: &Place,
) -> Result<GpuGroups, String> {
    let mesh = place.mesh()?;
    let part = |name: &str| split_gpu_part(world, &mesh, name);
    let tensor = part("tensor")?;
    let data = part("data")?;
    Ok(GpuGroups {
        tensor_host: Arc::new(HostTensorGroup::new(tensor.host().clone())),
        tensor: Arc::new(braid_train::tensor_parallel::DeviceTensorGroup::new(tensor)),
        data,
        layout: mesh.describe(),
    })
}

/// `BRAID_TP_OVERLAP=K`: the bf16 engine's row-split products run in K
/// row blocks, each block's sum over the tensor group beside the next
/// block's product; unset or 1, the whole product then its sum (to be
/// chosen by measurement: `bash bench/device/tp.sh overlap`).
pub fn tensor_overlap_blocks() -> Result<usize, String> {
    match std::env::var(braid_core::env::BRAID_TP_OVERLAP).as_deref() {
        Err(_) | Ok("") => Ok(1),
        Ok(v) => match v.parse::<usize>() {
            Ok(k) if (1..=64).contains(&k) => Ok(k),
            _ => Err(format!(
                "BRAID_TP_OVERLAP={v}: expected a number of row blocks from 1 to 64"
            )),
        },
    }
}

/// `BRAID_TP_GRAD_OVERLAP=on|off`: the bf16 engine's backward pass sums
/// each column-split product's input gradient (qkv's, the MLP's first)
/// over the tensor group on the group's stream while its weight gradient
/// runs (`on`, the default: Megatron's overlap, the LayerNorm's output
/// recomputed for it first), or sums first (`off`). The same bits either
/// way; on 4 H100s `--tp 4` measured 206.8 / 206.4 against 211.1 / 210.4
/// ms a step at 2.65B and 447.0 against 451.9 ms at 12.85B (`bash
/// bench/device/tp.sh grads`).
pub fn tensor_grad_sums_beside() -> Result<bool, String> {
    match std::env::var(braid_core::env::BRAID_TP_GRAD_OVERLAP).as_deref() {
        Err(_) | Ok("") | Ok("on") => Ok(true),
        Ok("off") => Ok(false),
        Ok(v) => Err(format!("BRAID_TP_GRAD_OVERLAP={v}: expected on or off")),
    }
}

/// `BRAID_TP_SUMS=f32|bf16`: the dtype in which the bf16 engine sums its
/// row-split products (the attention's output projection, the MLP's
/// second product) over the tensor group — `bf16` (the default,
/// Megatron's: half the bytes, the sum rounded to bf16 once before every
/// rank adds the residual and bias in f32) or `f32` (the f32 partial
/// products, the residual and bias added by the group's first rank
/// before the sum). bf16 measured faster on 4 H100s, `--tp 4`: 214.8
/// against 231.4 ms a step at 2.65B, 477.8 against 503.8 ms at 12.85B
/// (`bash bench/device/tp.sh sums`), and tracks one GPU as closely.
pub fn tensor_sums_in_bf16() -> Result<bool, String> {
    match std::env::var(braid_core::env::BRAID_TP_SUMS).as_deref() {
        Ok("f32") => Ok(false),
        Err(_) | Ok("") | Ok("bf16") => Ok(true),
        Ok(v) => Err(format!("BRAID_TP_SUMS={v}: expected f32 or bf16")),
    }
}

/// The tensor-group knobs that sequence parallelism in the bf16 engine
/// does not take, refused with the way out: its row-split products are
/// always summed in bf16 (a reduce-scatter onto each rank's rows), whole.
/// (`BRAID_TP_GRAD_OVERLAP` is allowed and does nothing there: the input
/// gradients' reductions run in order.)
pub fn sequence_knobs(bf16_sequence: bool) -> Result<(), String> {
    if !bf16_sequence {
        return Ok(());
    }
    if tensor_overlap_blocks()? > 1 {
        return Err(
            "BRAID_TP_OVERLAP: row blocks are not built with sequence parallelism in the bf16 \
             engine (unset it, or add --no-sp)"
                .into(),
        );
    }
    if !tensor_sums_in_bf16()? {
        return Err(
            "BRAID_TP_SUMS=f32: sequence parallelism in the bf16 engine reduce-scatters in bf16 \
             (unset it, or add --no-sp)"
                .into(),
        );
    }
    Ok(())
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
