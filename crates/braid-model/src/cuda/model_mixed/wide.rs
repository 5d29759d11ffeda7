//! [`Wide`]: where the wide scratch holds the attention's input and
//! output gradients.

use std::ops::Range;

/// Where the wide scratch ([`GpuGptMixed`]'s `wide`, `b·t × 4·width`)
/// holds its two parts that live at once in the attention's backward pass:
/// the attention's input gradient (or, in the forward pass, the unbiased
/// qkv product) and its output gradient.
///
/// [`GpuGptMixed`]: super::state::GpuGptMixed
pub(super) struct Wide;

impl Wide {
    /// The qkv product or its gradient: `n × 3c`, first.
    pub(super) fn qkv(n: usize, c: usize) -> Range<usize> {
        0..n * 3 * c
    }

    /// The attention's output gradient: `n × c`, last.
    pub(super) fn datty(n: usize, c: usize) -> Range<usize> {
        n * 3 * c..n * 4 * c
    }
}
