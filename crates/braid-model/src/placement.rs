//! Placing buffers that live for part of a training step into memory
//! that is idle for that part.
//!
//! Under ZeRO-3 with one micro-batch per step, a rank's gradient shard
//! holds nothing between the optimizer step and the moment the backward
//! pass reduce-scatters each block's gradients into its slice — and the
//! activations a layer saves for its backward pass live exactly then:
//! written by the forward pass, read for the last time by the layer's
//! backward unit. A block's slice that is filled only after that unit can
//! hold them ([`place`]). The engine's saved activations and the memory
//! estimate ([`crate::footprint`]) use the same placement.

/// Memory idle until a point of the backward pass: bytes `start..end`
/// (of one allocation) that no one writes before backward unit
/// `free_through` has run to its end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Region {
    /// First byte.
    pub start: u64,
    /// One past the last byte.
    pub end: u64,
    /// The last backward unit that may still read a buffer placed here.
    pub free_through: usize,
}

/// A buffer to place: `bytes` long, read for the last time by backward
/// unit `last_read`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Want {
    /// Its size.
    pub bytes: u64,
    /// The last backward unit that reads it.
    pub last_read: usize,
}

/// Where placed buffers start: a multiple of this many bytes (what the
/// GPU's vector loads and cuBLAS want).
pub const ALIGN: u64 = 256;

/// Byte offsets (of the regions' allocation) for `wants`, each inside one
/// region whose memory stays idle through the buffer's last read, none
/// overlapping; `None` for a buffer that fits nowhere (it keeps memory of
/// its own). Buffers read last latest go first (the fewest regions can
/// take them), each into the region idle for the shortest time that still
/// has room, so that the regions idle longest stay open for the rest.
pub fn place(wants: &[Want], regions: &[Region]) -> Vec<Option<u64>> {
    let mut cursor: Vec<u64> = regions.iter().map(|r| r.start).collect();
    let mut order: Vec<usize> = (0..wants.len()).collect();
    order.sort_by_key(|&i| (std::cmp::Reverse(wants[i].last_read), i));
    let mut out = vec![None; wants.len()];
    for i in order {
        let w = wants[i];
        let best = regions
            .iter()
            .enumerate()
            .filter(|(_, r)| r.free_through >= w.last_read)
            .filter_map(|(k, r)| {
                let at = cursor[k].div_ceil(ALIGN) * ALIGN;
                (at.checked_add(w.bytes)? <= r.end).then_some((r.free_through, k, at))
            })
            .min();
        if let Some((_, k, at)) = best {
            cursor[k] = at + w.bytes;
            out[i] = Some(at);
        }
    }
    out
}

/// Bytes of `wants` that [`place`] puts into `regions`.
pub fn placed_bytes(wants: &[Want], regions: &[Region]) -> u64 {
    place(wants, regions)
        .iter()
        .zip(wants)
        .filter(|(at, _)| at.is_some())
        .map(|(_, w)| w.bytes)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use braid_core::rng::Rng;

    /// Every placed buffer lies inside a region idle through its last
    /// read, aligned, and overlaps no other.
    fn check(wants: &[Want], regions: &[Region], at: &[Option<u64>]) {
        let mut spans: Vec<(u64, u64)> = Vec::new();
        for (w, a) in wants.iter().zip(at) {
            let Some(a) = *a else { continue };
            assert_eq!(a % ALIGN, 0, "offset {a} not aligned");
            let inside = regions
                .iter()
                .any(|r| r.start <= a && a + w.bytes <= r.end && r.free_through >= w.last_read);
            assert!(inside, "{w:?} at {a} is in no region idle long enough");
            spans.push((a, a + w.bytes));
        }
        spans.sort();
        for p in spans.windows(2) {
            assert!(p[0].1 <= p[1].0, "{:?} and {:?} overlap", p[0], p[1]);
        }
    }

    #[test]
    fn each_layer_goes_into_its_own_slot_and_the_head_into_the_embeddings() {
        // Four layers' slots (1000 bytes each) idle through their own
        // backward units (head = unit 0, layer l = unit 4 - l), the
        // embeddings' (3000 bytes) through the last unit.
        let mut regions = vec![Region {
            start: 0,
            end: 3000,
            free_through: 5,
        }];
        for l in 0..4u64 {
            regions.push(Region {
                start: 3000 + 1000 * l,
                end: 4000 + 1000 * l,
                free_through: 4 - l as usize,
            });
        }
        let mut wants: Vec<Want> = (0..4)
            .map(|l| Want {
                bytes: 700,
                last_read: 4 - l,
            })
            .collect();
        wants.push(Want {
            bytes: 500,
            last_read: 0,
        });
        let at = place(&wants, &regions);
        check(&wants, &regions, &at);
        // Layer l's slot starts at 3000 + 1000 l, rounded up to 256.
        let own: Vec<Option<u64>> = (0..4u64)
            .map(|l| Some((3000 + 1000 * l).div_ceil(ALIGN) * ALIGN))
            .collect();
        assert_eq!(&at[..4], &own[..]);
        // 300 bytes are left in each layer slot: the head's 500 go into
        // the embeddings'.
        assert_eq!(at[4], Some(0));
        assert_eq!(placed_bytes(&wants, &regions), 4 * 700 + 500);
    }

    #[test]
    fn a_buffer_read_after_a_region_fills_is_not_placed_there() {
        let regions = [Region {
            start: 0,
            end: 1 << 20,
            free_through: 2,
        }];
        let wants = [
            Want {
                bytes: 100,
                last_read: 3,
            },
            Want {
                bytes: 100,
                last_read: 2,
            },
            Want {
                bytes: 2 << 20,
                last_read: 0,
            },
        ];
        assert_eq!(place(&wants, &regions), vec![None, Some(0), None]);
    }

    #[test]
    fn random_placements_never_overlap_or_outlive_their_regions() {
        let mut rng = Rng::new(7);
        for _ in 0..200 {
            let mut regions = Vec::new();
            let mut at = 0u64;
            for _ in 0..1 + rng.below(8) {
                let len = rng.below(5000) as u64;
                regions.push(Region {
                    start: at,
                    end: at + len,
                    free_through: rng.below(6),
                });
                at += len;
            }
            let wants: Vec<Want> = (0..rng.below(12))
                .map(|_| Want {
                    bytes: rng.below(2000) as u64,
                    last_read: rng.below(6),
                })
                .collect();
            let placed = place(&wants, &regions);
            check(&wants, &regions, &placed);
        }
    }
}
