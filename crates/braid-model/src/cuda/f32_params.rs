//! [`F32Params`]: where the GPU models read the parameters they use in
//! f32 — for the mixed-precision model the embeddings (the encoder's
//! lookup), the LayerNorms and the biases (and the weights it casts when it
//! streams them); for the f32 model all of them. Either the whole flat f32
//! buffer (the master weights on the GPU); or a compact buffer holding only
//! the mixed model's f32 tensors, packed as a [`SideMap`] says (when the
//! master weights live elsewhere: in host memory under an offloaded
//! optimizer); or some blocks of the flat buffer, each in its own buffer
//! (a ZeRO-3 unit's gathered parameters). The models address all three by
//! the flat buffer's indices.

use crate::layout::{Kind, Layout};
use braid_cuda::{CudaError, DeviceBuffer, DeviceView, Result};
use std::ops::Range;

/// The tensors the mixed-precision model reads in f32, packed one after
/// another: every tensor but the layers' four weight matrices (read in
/// bf16 only).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SideMap {
    /// Each packed tensor: its range of the flat buffer and where it
    /// starts in the compact buffer; increasing in both.
    parts: Vec<(Range<usize>, usize)>,
    len: usize,
}

impl SideMap {
    /// The f32-read tensors of `layout`.
    pub fn for_mixed(layout: &Layout) -> SideMap {
        Self::for_mixed_within(layout, std::slice::from_ref(&(0..layout.len)))
    }

    /// The f32-read tensors of `layout` that lie inside `within` (ranges
    /// of the flat buffer, e.g. the layers a ZeRO-3 rank gathers in bf16).
    pub fn for_mixed_within(layout: &Layout, within: &[Range<usize>]) -> SideMap {
        let mut parts: Vec<(Range<usize>, usize)> = Vec::new();
        let mut len = 0;
        for t in &layout.params {
            // The layers' matrices are read in bf16 only.
            if matches!(t.kind, Kind::Weight | Kind::ResidualWeight) {
                continue;
            }
            let r = t.range();
            if !within.iter().any(|w| w.start <= r.start && r.end <= w.end) {
                continue;
            }
            match parts.last_mut() {
                // Tensors next to each other become one part.
                Some((last, _)) if last.end == r.start => last.end = r.end,
                _ => parts.push((r.clone(), len)),
            }
            len += r.len();
        }
        SideMap { parts, len }
    }

    /// Elements of the compact buffer.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is packed.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The packed ranges of the flat buffer, each with its start in the
    /// compact buffer.
    pub fn parts(&self) -> &[(Range<usize>, usize)] {
        &self.parts
    }

    /// Where the flat elements `r` lie in the compact buffer, if packed.
    pub fn locate(&self, r: &Range<usize>) -> Option<Range<usize>> {
        let i = self.parts.partition_point(|(p, _)| p.end <= r.start);
        let (p, at) = self.parts.get(i)?;
        (p.start <= r.start && r.end <= p.end).then(|| {
            let from = at + (r.start - p.start);
            from..from + r.len()
        })
    }
}

/// One block of parameters in its own buffer: the flat elements
/// `start..start + buf.len()`.
#[derive(Clone, Copy)]
pub struct Piece<'a> {
    /// Its first element's index in the flat buffer.
    pub start: usize,
    /// Its elements.
    pub buf: &'a DeviceBuffer<f32>,
}

/// Where the f32 parameters are.
#[derive(Clone, Copy)]
enum Source<'a> {
    /// The whole flat buffer.
    Whole(&'a DeviceBuffer<f32>),
    /// A compact buffer of the tensors a [`SideMap`] packs.
    Packed(&'a DeviceBuffer<f32>, &'a SideMap),
    /// Some blocks, each in its own buffer (a ZeRO-3 unit's gathered
    /// parameters): only the tensors inside them can be read.
    Blocks(&'a [Piece<'a>]),
}

/// The f32 parameters the models read: see the module's doc.
#[derive(Clone, Copy)]
pub struct F32Params<'a> {
    src: Source<'a>,
}

impl<'a> F32Params<'a> {
    /// The whole flat buffer.
    pub fn whole(buf: &'a DeviceBuffer<f32>) -> Self {
        F32Params {
            src: Source::Whole(buf),
        }
    }

    /// A compact buffer of the tensors `map` packs.
    pub fn packed(buf: &'a DeviceBuffer<f32>, map: &'a SideMap) -> Self {
        F32Params {
            src: Source::Packed(buf, map),
        }
    }

    /// Blocks of the flat buffer, each in its own buffer: a pass reading
    /// anything outside them fails, naming the range.
    pub fn blocks(pieces: &'a [Piece<'a>]) -> Self {
        F32Params {
            src: Source::Blocks(pieces),
        }
    }

    /// Whether the buffer holds what a model of `len` parameters reads
    /// (blocks: whether each lies inside the model).
    pub fn check(&self, len: usize) -> Result<()> {
        let (have, want, what) = match self.src {
            Source::Whole(b) => (b.len(), len, ""),
            Source::Packed(b, m) => (b.len(), m.len(), " (packed)"),
            Source::Blocks(pieces) => {
                return match pieces.iter().find(|p| p.start + p.buf.len() > len) {
                    None => Ok(()),
                    Some(p) => Err(CudaError::Invalid(format!(
                        "f32 parameters: a block of elements {:?} in a model of {len}",
                        p.start..p.start + p.buf.len()
                    ))),
                };
            }
        };
        match have == want {
            true => Ok(()),
            false => Err(CudaError::Invalid(format!(
                "f32 parameters: {have} elements where the model reads {want}{what}"
            ))),
        }
    }

    /// The flat elements `r`.
    pub fn view(&self, r: Range<usize>) -> Result<DeviceView<'a, f32>> {
        match self.src {
            Source::Whole(buf) => match r.start <= r.end && r.end <= buf.len() {
                true => Ok(buf.view(r)),
                false => Err(CudaError::Invalid(format!(
                    "parameters {r:?} of a buffer of {}",
                    buf.len()
                ))),
            },
            Source::Packed(buf, m) => match m.locate(&r) {
                Some(at) => Ok(buf.view(at)),
                None => Err(CudaError::Invalid(format!(
                    "parameters {r:?} are not among the f32 tensors kept on the GPU (only \
                     embeddings, LayerNorms and biases are)"
                ))),
            },
            Source::Blocks(pieces) => {
                let inside = pieces.iter().find(|p| {
                    r.start <= r.end && p.start <= r.start && r.end <= p.start + p.buf.len()
                });
                match inside {
                    Some(p) => Ok(p.buf.view(r.start - p.start..r.end - p.start)),
                    None => Err(CudaError::Invalid(format!(
                        "parameters {r:?} are not in the blocks this pass was given ({:?})",
                        pieces
                            .iter()
                            .map(|p| p.start..p.start + p.buf.len())
                            .collect::<Vec<_>>()
                    ))),
                }
            }
        }
    }
}

impl<'a> From<&'a DeviceBuffer<f32>> for F32Params<'a> {
    fn from(buf: &'a DeviceBuffer<f32>) -> Self {
        F32Params::whole(buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::GptConfig;

    #[test]
    fn the_side_map_packs_everything_but_the_layer_matrices() {
        let layout = Layout::new(&GptConfig::parse("L2-H2-C16-V50-T8").unwrap());
        let map = SideMap::for_mixed(&layout);
        let c = 16;
        let matrices = 2 * (3 * c * c + c * c + 4 * c * c + 4 * c * c);
        assert_eq!(map.len(), layout.len - matrices);
        let cfg = layout.config;
        assert_eq!(map.len() as u128, crate::footprint::side_params(&cfg));
        for t in &layout.params {
            let r = t.range();
            let packed = map.locate(&r);
            let matrix =
                t.name.starts_with("h.") && t.name.ends_with(".weight") && !t.name.contains("ln_");
            assert_eq!(packed.is_none(), matrix, "{}", t.name);
            if let Some(at) = packed {
                assert_eq!(at.len(), r.len());
                assert!(at.end <= map.len());
            }
        }
        // A range straddling a packed tensor and a matrix is refused.
        let qkv = layout.get("h.0.attn.c_attn.weight").unwrap().offset;
        assert_eq!(map.locate(&(qkv - 1..qkv + 1)), None);
    }
}
