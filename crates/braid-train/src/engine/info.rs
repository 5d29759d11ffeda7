//! [`EngineInfo`]: what an engine may say about itself beyond the core —
//! which parameters are matrices, where its master weights live when not
//! in its own space, the bytes of its model state, its own per-phase
//! profile. Each has a default that says nothing (no matrices, nothing in
//! host memory, zero bytes, no profile), so an engine with nothing to add
//! implements it empty. The strategies read it (data parallelism's
//! low-rank compression and start, ZeRO's refusal of an offloaded
//! optimizer), as do the loop (the state account, the profile) and
//! checkpoints (master weights in host memory).

use super::core::Engine;
use std::ops::Range;

/// A two-dimensional parameter inside the flat buffer: `rows × cols`
/// elements, row-major, from `offset` (gradient compression by low-rank
/// approximation works on these).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Matrix {
    /// First element.
    pub offset: usize,
    /// Rows.
    pub rows: usize,
    /// Columns.
    pub cols: usize,
}

impl Matrix {
    /// Its elements in the flat buffer.
    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.rows * self.cols
    }
}

/// Bytes of model state one rank holds, by part, from what was allocated
/// (ZeRO's accounting: parameters, gradients, optimizer state).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StateBytes {
    /// The parameters the passes read: f32, or the bf16 copy under mixed
    /// precision (0 when the engine casts them layer by layer).
    pub params: u64,
    /// f32 master weights kept beside a bf16 copy (0 when the parameters
    /// are the master weights).
    pub master: u64,
    /// The gradient buffer (the loop's).
    pub grads: u64,
    /// The optimizer's state (AdamW's two moments, SGD's momentum).
    pub optimizer: u64,
    /// How much of the above lives in host memory instead of the
    /// engine's device (an offloaded optimizer's master weights, moments
    /// and transfer buffers); 0 where everything is in one place.
    pub offloaded: u64,
}

impl StateBytes {
    /// All of it.
    pub fn total(&self) -> u64 {
        self.params + self.master + self.grads + self.optimizer
    }
}

/// Optional information about an engine, and its profile's hooks; every
/// method has a default that says nothing.
pub trait EngineInfo: Engine {
    /// The parameters, when their master copy lives in host memory
    /// instead of the engine's space (an optimizer offloaded to the host):
    /// then [`params`](Engine::params) may be empty, and strategies
    /// compare these across ranks instead of broadcasting. `None` by
    /// default.
    fn host_params(&self) -> Option<&[f32]> {
        None
    }

    /// The parameters, while they wait in host memory for a ZeRO-3
    /// strategy to upload its shard of them (an engine built for
    /// sharding): [`params`](Engine::params) is empty meanwhile, no pass
    /// runs, and ranks compare these instead of broadcasting. `None` by
    /// default.
    fn pending_params(&self) -> Option<&[f32]> {
        None
    }

    /// The two-dimensional parameters (low-rank gradient compression
    /// applies to those; everything else is reduced as it is). None by
    /// default.
    fn matrices(&self) -> Vec<Matrix> {
        Vec::new()
    }

    /// The model state the engine holds (all but the gradients, which the
    /// loop allocates); zeros where an engine does not say.
    fn state_bytes(&self) -> StateBytes {
        StateBytes::default()
    }

    /// Starts any per-phase profile afresh (after warm-up steps).
    fn profile_reset(&mut self) {}

    /// The engine's own per-phase profile, if it keeps one.
    fn profile_report(&self) -> Option<String> {
        None
    }
}
