//! Placing buffers that live for part of a training step into memory
//! that is idle for that part.
//!
//! Under ZeRO-3 with one micro-batch per step, a rank's gradient shard
//! holds nothing between the optimizer step and the moment the backward
//! pass reduce-scatters each block's gradients into its slice — and the
//! activations a layer saves for its backward pass live exactly then:
//! written by the forward pass, read for the last time by the layer's
//! backward unit. A block's slice that is filled only after that unit can
//! hold them ([`place`]). One process that writes its whole gradient
//! buffer unit by unit has such memory too: a run of the buffer holds
//! nothing until the backward unit that writes it first
//! ([`regions_before_first_writes`]), and the layers below lend theirs to
//! the layers above. The engine's saved activations and the memory
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

/// Byte offsets (of the regions' allocation) for `wants`, none
/// overlapping, each inside memory idle through the buffer's last read:
/// one region, or regions that follow each other in the allocation (one
/// ends where the next starts) and are all idle long enough; `None` for a
/// buffer that fits nowhere (it keeps memory of its own).
///
/// Buffers read last latest go first (the least memory can take them),
/// each at the lowest address where it fits. Where the regions idle
/// longest come first in the allocation — ZeRO-3's gradient shard: the
/// embeddings' slice, then each layer's from the first, then the final
/// norm's — this packs the buffers one after another from the front,
/// each within the prefix of the allocation it may use, leaving no gaps
/// but alignment's.
///
/// That order can leave a large buffer read first (the head's) without a
/// gap long enough, where it could have run from a region that only such
/// buffers may use into the next: so each buffer of the shortest life
/// (one per size) is also tried at the front, the rest after it in the
/// order above, and the placement lending the most bytes kept (the first
/// of equals). At 12.85B under ZeRO-3 over 4 ranks with the attention's
/// state kept in the last 8 layers, the token embeddings' bf16 cast
/// (515 MB) first lends 316 MB more, the estimate 52.62 GiB against
/// 52.91 (`footprint`'s test `the_cast_embeddings_first_lend_more`).
pub fn place(wants: &[Want], regions: &[Region]) -> Vec<Option<u64>> {
    let mut order: Vec<usize> = (0..wants.len()).collect();
    order.sort_by_key(|&i| (std::cmp::Reverse(wants[i].last_read), i));
    let lent = |at: &[Option<u64>]| bytes_at(wants, at);
    let mut best = place_in_order(wants, regions, &order);
    let mut most = lent(&best);
    let shortest = wants.iter().map(|w| w.last_read).min();
    let mut sizes_tried = Vec::new();
    for first in (0..wants.len()).filter(|&i| Some(wants[i].last_read) == shortest) {
        if sizes_tried.contains(&wants[first].bytes) {
            continue;
        }
        sizes_tried.push(wants[first].bytes);
        let mut order_first = vec![first];
        order_first.extend(order.iter().copied().filter(|&i| i != first));
        let at = place_in_order(wants, regions, &order_first);
        let bytes = lent(&at);
        if bytes > most {
            (best, most) = (at, bytes);
        }
    }
    best
}

/// [`place`] taking the buffers in `order` (indices into `wants`).
fn place_in_order(wants: &[Want], regions: &[Region], order: &[usize]) -> Vec<Option<u64>> {
    let mut by_address: Vec<usize> = (0..regions.len()).collect();
    by_address.sort_by_key(|&k| (regions[k].start, k));
    let mut cursor: Vec<u64> = regions.iter().map(|r| r.start).collect();
    let mut out = vec![None; wants.len()];
    for &i in order {
        let w = wants[i];
        let idle = |r: &Region| r.free_through >= w.last_read;
        for (first, &k) in by_address.iter().enumerate() {
            let r = regions[k];
            let at = cursor[k].div_ceil(ALIGN) * ALIGN;
            if !idle(&r) || at > r.end {
                continue;
            }
            let Some(end) = at.checked_add(w.bytes) else {
                continue;
            };
            // Run on into the regions that follow, while they are untouched
            // and idle long enough.
            let (mut last, mut reach) = (first, r.end);
            while end > reach {
                let Some(&n) = by_address.get(last + 1) else {
                    break;
                };
                let next = regions[n];
                if next.start != reach || cursor[n] != next.start || !idle(&next) {
                    break;
                }
                (last, reach) = (last + 1, next.end);
            }
            if end > reach {
                continue;
            }
            for &m in &by_address[first..last] {
                cursor[m] = regions[m].end;
            }
            cursor[by_address[last]] = end;
            out[i] = Some(at);
            break;
        }
    }
    out
}

/// The regions of a whole f32 gradient buffer written unit by unit
/// (`first[u]`: the runs, in elements, that backward unit `u` writes
/// before any other unit): a run is idle through unit `u - 1` (unit 0's
/// never). In address order; adjacent runs idle as long are one region.
pub fn regions_before_first_writes(first: &[Vec<std::ops::Range<usize>>]) -> Vec<Region> {
    let mut regions: Vec<Region> = first
        .iter()
        .enumerate()
        .skip(1)
        .flat_map(|(u, runs)| {
            runs.iter().filter(|r| !r.is_empty()).map(move |r| Region {
                start: 4 * r.start as u64,
                end: 4 * r.end as u64,
                free_through: u - 1,
            })
        })
        .collect();
    regions.sort_by_key(|r| r.start);
    let mut merged: Vec<Region> = Vec::with_capacity(regions.len());
    for r in regions {
        match merged.last_mut() {
            Some(last) if last.end == r.start && last.free_through == r.free_through => {
                last.end = r.end
            }
            _ => merged.push(r),
        }
    }
    merged
}

/// Bytes of `wants` that [`place`] puts into `regions`.
pub fn placed_bytes(wants: &[Want], regions: &[Region]) -> u64 {
    bytes_at(wants, &place(wants, regions))
}

/// Bytes of `wants` that offsets `at` place.
fn bytes_at(wants: &[Want], at: &[Option<u64>]) -> u64 {
    at.iter()
        .zip(wants)
        .filter(|(a, _)| a.is_some())
        .map(|(_, w)| w.bytes)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use braid_core::rng::Rng;

    #[test]
    fn a_gradient_run_is_idle_until_the_unit_that_writes_it_first() {
        // Unit 0 writes 0..10 and 40..42, unit 1 writes 30..40, unit 2
        // writes 10..20 and 42..50, unit 3 writes 20..30.
        let first = vec![
            vec![0..10, 40..42],
            vec![30..40],
            vec![10..20, 42..50],
            vec![20..30],
        ];
        let r = |start: u64, end: u64, free_through| Region {
            start: 4 * start,
            end: 4 * end,
            free_through,
        };
        assert_eq!(
            regions_before_first_writes(&first),
            vec![r(10, 20, 1), r(20, 30, 2), r(30, 40, 0), r(42, 50, 1)]
        );
        // Runs that follow each other and are idle as long are one.
        let first = vec![vec![], vec![0..4, 8..12], vec![4..8]];
        assert_eq!(
            regions_before_first_writes(&first),
            vec![r(0, 4, 0), r(4, 8, 1), r(8, 12, 0)]
        );
        let first = vec![vec![], vec![0..4, 4..8]];
        assert_eq!(regions_before_first_writes(&first), vec![r(0, 8, 0)]);
    }

    /// Every placed buffer lies inside memory idle through its last read
    /// (every byte of it in a region idle long enough), aligned, and
    /// overlaps no other.
    fn check(wants: &[Want], regions: &[Region], at: &[Option<u64>]) {
        let mut spans: Vec<(u64, u64)> = Vec::new();
        for (w, a) in wants.iter().zip(at) {
            let Some(a) = *a else { continue };
            assert_eq!(a % ALIGN, 0, "offset {a} not aligned");
            // Walk the buffer's bytes region by region.
            let mut from = a;
            while from < a + w.bytes {
                let r = regions
                    .iter()
                    .find(|r| r.start <= from && from < r.end)
                    .unwrap_or_else(|| panic!("{w:?} at {a}: byte {from} is in no region"));
                assert!(
                    r.free_through >= w.last_read,
                    "{w:?} at {a} lies in {r:?}, not idle long enough"
                );
                from = r.end;
            }
            spans.push((a, a + w.bytes));
        }
        spans.sort();
        for p in spans.windows(2) {
            assert!(p[0].1 <= p[1].0, "{:?} and {:?} overlap", p[0], p[1]);
        }
    }

    /// ZeRO-3's shard: the embeddings' slice (3000 bytes) idle through
    /// the last backward unit, then four layers' (1000 bytes each) idle
    /// through their own units (head = unit 0, layer l = unit 4 - l).
    fn shard_regions() -> Vec<Region> {
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
        regions
    }

    #[test]
    fn layers_pack_from_the_front_and_the_head_runs_across_slices() {
        let regions = shard_regions();
        let mut wants: Vec<Want> = (0..4)
            .map(|l| Want {
                bytes: 700,
                last_read: 4 - l,
            })
            .collect();
        // The head's buffer is larger than any one layer's slice.
        wants.push(Want {
            bytes: 1500,
            last_read: 0,
        });
        let at = place(&wants, &regions);
        check(&wants, &regions, &at);
        // Layer 0 (read last) first, each at the next aligned byte; layer
        // 3's runs from the embeddings' slice into layer 0's.
        assert_eq!(&at[..4], &[Some(0), Some(768), Some(1536), Some(2304)]);
        // The head's 1500 bytes run from layer 0's slice into layer 1's.
        assert_eq!(at[4], Some(3072));
        assert_eq!(placed_bytes(&wants, &regions), 4 * 700 + 1500);
    }

    #[test]
    fn a_buffer_runs_only_into_slices_idle_long_enough() {
        let regions = shard_regions();
        let wants = [
            // Read by the embeddings' unit (5): only their slice.
            Want {
                bytes: 2900,
                last_read: 5,
            },
            // Read by layer 2's unit (2): may run through the slices of
            // layers 0, 1 and 2, not into layer 3's.
            Want {
                bytes: 1900,
                last_read: 2,
            },
            // Read by layer 0's unit (4): the embeddings' slice and layer
            // 0's only, and 2900 bytes of the first are taken: from 3072
            // (aligned) it would end in layer 1's slice.
            Want {
                bytes: 1200,
                last_read: 4,
            },
            // Read by the head (0), larger than what is left.
            Want {
                bytes: 2000,
                last_read: 0,
            },
        ];
        let order = [0, 2, 1, 3];
        let at = place_in_order(&wants, &regions, &order);
        check(&wants, &regions, &at);
        assert_eq!(at[0], Some(0));
        assert_eq!(at[2], None);
        assert_eq!(at[1], Some(3072));
        // 4972..7000 is left, but 2000 bytes from 5120 would pass the end.
        assert_eq!(at[3], None);
        // The head's buffer first lends more (5100 bytes against 4800):
        // the embeddings' 2900 find no room, the rest runs on from 2048.
        let at = place(&wants, &regions);
        check(&wants, &regions, &at);
        assert_eq!(at, vec![None, Some(3328), Some(2048), Some(0)]);
        assert_eq!(placed_bytes(&wants, &regions), 5100);
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
