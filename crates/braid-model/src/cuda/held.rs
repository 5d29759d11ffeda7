//! What both GPU models share for layouts that hold part of the model (a
//! pipeline stage's): per-layer vectors whose entries exist only for the
//! held layers, and the ends of a stage's residual stream (its input, its
//! output) in a micro-batch's buffers.

use crate::layout::Stage;
use braid_cuda::{CudaError, DeviceBuffer, Result};

/// A layer (or residual stream) this model's layout does not hold.
pub(crate) fn not_held(l: usize) -> CudaError {
    CudaError::Invalid(format!(
        "layer {l}: this model holds another part of the model (a pipeline stage's layout)"
    ))
}

/// Entry `l` of a per-layer vector, where the layout holds that layer.
pub(crate) fn held<T>(v: &[Option<T>], l: usize) -> Result<&T> {
    v.get(l).and_then(Option::as_ref).ok_or_else(|| not_held(l))
}

/// [`held`], to write.
pub(crate) fn held_mut<T>(v: &mut [Option<T>], l: usize) -> Result<&mut T> {
    v.get_mut(l)
        .and_then(Option::as_mut)
        .ok_or_else(|| not_held(l))
}

/// Buffers made for another stage than `st`.
fn other_stage(what: &str, st: &Stage) -> CudaError {
    CudaError::Invalid(format!(
        "the {what} of the pipeline stage of layers {:?}: these buffers were made for another stage",
        st.layers
    ))
}

/// Stage `st`'s input in the residual streams `resid` (by layer).
pub(crate) fn stage_input<'a>(
    resid: &'a mut [Option<DeviceBuffer<f32>>],
    st: &Stage,
) -> Result<&'a mut DeviceBuffer<f32>> {
    held_mut(resid, st.layers.start).map_err(|_| other_stage("input", st))
}

/// Stage `st`'s output in the residual streams `resid` (by layer).
pub(crate) fn stage_output<'a>(
    resid: &'a [Option<DeviceBuffer<f32>>],
    st: &Stage,
) -> Result<&'a DeviceBuffer<f32>> {
    held(resid, st.layers.end).map_err(|_| other_stage("output", st))
}

/// `dout`, checked to hold `len` elements: the gradient of stage `st`'s
/// output.
pub(crate) fn output_grad<'a>(
    dout: &'a DeviceBuffer<f32>,
    len: usize,
    st: &Stage,
) -> Result<&'a DeviceBuffer<f32>> {
    match dout.len() == len {
        true => Ok(dout),
        false => Err(other_stage("output gradient", st)),
    }
}
