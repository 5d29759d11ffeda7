//! Sums over the tensor group, in f32 ([`sum_f32`]) or bf16
//! ([`sum_bf16`]); nothing without a group.

use super::state::Group;
use crate::tensor_comm::ReduceKind;
use braid_cuda::{CudaError, DeviceBuffer, Result, Stream};
use half::bf16;

/// Sums `x` (f32) over the group, on `s`; nothing without one.
pub(super) fn sum_f32(
    group: &Option<Group>,
    x: &mut DeviceBuffer<f32>,
    s: &Stream,
    what: &str,
) -> Result<()> {
    match group {
        None => Ok(()),
        Some(g) => g
            .comm
            .all_reduce_f32(x.view_mut(0..x.len()), ReduceKind::Sum, s)
            .map_err(|e| CudaError::Group(format!("{what}: {e}"))),
    }
}

/// Sums `x` (bf16) over the group, on `s`; nothing without one.
pub(super) fn sum_bf16(
    group: &Option<Group>,
    x: &mut DeviceBuffer<bf16>,
    s: &Stream,
    what: &str,
) -> Result<()> {
    match group {
        None => Ok(()),
        Some(g) => g
            .comm
            .all_reduce_bf16(x.view_mut(0..x.len()), s)
            .map_err(|e| CudaError::Group(format!("{what}: {e}"))),
    }
}
