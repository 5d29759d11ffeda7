//! [`layer_weights`]: the bf16 weights a layer's passes read, from the
//! full bf16 copy or cast into the streamed layer buffer.

use super::errors::no_weights;
use super::state::StreamedWeights;
use crate::cuda::f32_params::F32Params;
use crate::cuda::mixed::MixedKernels;
use braid_cuda::{CudaError, DeviceBuffer, DevicePool, Result, Stream};
use half::bf16;
use std::ops::Range;

/// Layer `l`'s bf16 weights (`block`, its range of the layout): the full
/// copy `pb`, or the streamed layer buffer, cast from `p` now unless it
/// holds the layer already. Returns the buffer and the layout index of
/// its first element.
#[allow(clippy::too_many_arguments)]
pub(super) fn layer_weights<'a>(
    mk: &MixedKernels,
    s: &Stream,
    pool: &DevicePool,
    streamed: &'a mut Option<StreamedWeights>,
    pb: Option<&'a DeviceBuffer<bf16>>,
    p: F32Params<'_>,
    l: usize,
    block: Range<usize>,
) -> Result<(&'a DeviceBuffer<bf16>, usize)> {
    match (pb, streamed) {
        (Some(pb), _) => Ok((pb, 0)),
        (None, Some(st)) => {
            if let Some((given, w)) = &st.given {
                return match *given == l {
                    true => Ok((w, block.start)),
                    false => Err(CudaError::Invalid(format!(
                        "layer {l}'s pass was given layer {given}'s bf16 weights"
                    ))),
                };
            }
            let len = block.len();
            if st.layer.is_none() {
                st.layer = Some(pool.zeros(len, s)?);
            }
            let layer = st.layer.as_mut().expect("allocated above");
            if st.holds != Some(l) {
                mk.to_bf16(s, &mut layer.view_mut(0..len), &p.view(block.clone())?)?;
                st.holds = Some(l);
            }
            Ok((layer, block.start))
        }
        (None, None) => Err(no_weights()),
    }
}
