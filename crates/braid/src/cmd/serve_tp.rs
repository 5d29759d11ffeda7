//! `braid serve --tp N`: tensor-parallel serving on CPU ranks. Started
//! alone, `braid serve` starts its N ranks through the launcher (as
//! `braid train --tp N` does); each rank joins the world, cuts its share
//! of the model from the loaded parameters, and rank 0 serves while the
//! others follow its steps (braid-serve's [`tensor_parallel`] module).

use braid_comm::CommOptions;
use braid_model::layout::TensorShard;
use braid_model::{Gpt, GptConfig, Params};
use braid_serve::tensor_parallel::StepBus;
use braid_train::tensor_parallel::HostTensorGroup;
use std::sync::Arc;

/// Where a `--tp` server process stands.
pub(super) enum Start {
    /// This process started the ranks; their launcher's exit code.
    Started(i32),
    /// This process is one of the ranks.
    Rank(Ranks),
}

/// One rank of a tensor-parallel server: its place and the two channels
/// of its group (rank 0's steps; the model's sums).
pub(super) struct Ranks {
    pub rank: usize,
    pub size: usize,
    pub bus: Arc<StepBus>,
    tensor: Arc<HostTensorGroup>,
}

/// Refuses what tensor-parallel serving cannot do, then starts the `tp`
/// ranks (started alone) or joins them (started as one). `cfg` is the
/// model's configuration when it can be read before loading.
pub(super) fn start(tp: usize, gpu: bool, cfg: Option<&GptConfig>) -> Result<Start, String> {
    if gpu {
        return Err(format!(
            "--tp {tp} with a GPU: tensor-parallel serving runs on CPU ranks for now (add \
             --device cpu); GPU ranks come with the GPU decoder's bf16 path"
        ));
    }
    if let Some(cfg) = cfg {
        TensorShard { rank: 0, size: tp }.check(cfg)?;
    }
    if !super::workers::launched() {
        return super::workers::relaunch_locally(tp, true).map(Start::Started);
    }
    let comm = super::workers::init(CommOptions::from_env().map_err(|e| e.to_string())?)?;
    let (rank, size) = (comm.rank(), comm.size());
    if size != tp {
        return Err(format!(
            "braid serve --tp {tp} in a world of {size} process(es): a tensor-parallel server \
             is exactly --tp ranks (start braid serve alone and it starts them)"
        ));
    }
    let tensor = comm
        .split(Some(0), rank as i64)
        .map_err(|e| format!("making the tensor group: {e}"))?
        .expect("every rank is in the tensor group");
    if rank != 0 {
        // The launcher's SIGTERM reaches every rank; a follower leaves
        // when rank 0, having finished its requests, says so.
        let ignored = Arc::new(std::sync::atomic::AtomicBool::new(false));
        for s in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
            let _ = signal_hook::flag::register(s, ignored.clone());
        }
    }
    Ok(Start::Rank(Ranks {
        rank,
        size,
        bus: StepBus::new(comm),
        tensor: Arc::new(HostTensorGroup::new(tensor)),
    }))
}

impl Ranks {
    /// This rank's share of the whole model's `params`, with its group.
    pub fn share(&self, params: &Params) -> Result<(Gpt, Vec<f32>), String> {
        let shard = TensorShard {
            rank: self.rank,
            size: self.size,
        };
        let share = params.tensor_share(shard)?;
        let gpt = Gpt::tensor_parallel(share.layout.clone(), self.tensor.clone(), false)?;
        Ok((gpt, share.data))
    }
}
