//! [`DistributedSampler`]: which samples each rank sees in an epoch, as
//! PyTorch's `DistributedSampler` decides it — a permutation of the
//! dataset seeded by `seed + epoch` (`set_epoch`), padded by repeating its
//! first indices (or truncated, with `drop_last`) to a multiple of the
//! number of ranks, rank `r` taking every `ranks`-th index from `r`. The
//! ranks' shares are disjoint (but for the padding) and equally long.

use braid_core::rng::Rng;

/// One rank's view of a dataset of `len` samples.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistributedSampler {
    len: usize,
    ranks: usize,
    rank: usize,
    shuffle: bool,
    seed: u64,
    drop_last: bool,
    epoch: u64,
}

impl DistributedSampler {
    /// Rank `rank` of `ranks` over `len` samples.
    pub fn new(
        len: usize,
        ranks: usize,
        rank: usize,
        shuffle: bool,
        seed: u64,
        drop_last: bool,
    ) -> Result<Self, String> {
        if ranks == 0 || rank >= ranks {
            return Err(format!("sampler: rank {rank} of {ranks} ranks"));
        }
        if len == 0 {
            return Err("sampler: the dataset has no samples".into());
        }
        if drop_last && len < ranks {
            return Err(format!(
                "sampler: {len} samples cannot be shared by {ranks} ranks without padding"
            ));
        }
        Ok(DistributedSampler {
            len,
            ranks,
            rank,
            shuffle,
            seed,
            drop_last,
            epoch: 0,
        })
    }

    /// Chooses the epoch (and so the shuffle) of the next [`indices`](Self::indices).
    pub fn set_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
    }

    /// The epoch set.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Samples each rank gets per epoch.
    pub fn num_samples(&self) -> usize {
        if self.drop_last {
            self.len / self.ranks
        } else {
            self.len.div_ceil(self.ranks)
        }
    }

    /// The whole dataset's order this epoch, before it is dealt out.
    pub fn permutation(&self) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.len).collect();
        if self.shuffle {
            let mut rng = Rng::new(self.seed.wrapping_add(self.epoch) ^ 0x5A3C_9E11_D00D_F00D);
            for i in (1..order.len()).rev() {
                order.swap(i, rng.below(i + 1));
            }
        }
        order
    }

    /// This rank's samples this epoch, in order.
    pub fn indices(&self) -> Vec<usize> {
        let mut order = self.permutation();
        let total = self.num_samples() * self.ranks;
        if total <= order.len() {
            order.truncate(total);
        } else {
            let mut k = 0;
            while order.len() < total {
                order.push(order[k % self.len]);
                k += 1;
            }
        }
        order
            .into_iter()
            .skip(self.rank)
            .step_by(self.ranks)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_get_disjoint_equal_shares_that_cover_the_epoch() {
        for (len, ranks) in [(10, 2), (11, 3), (7, 4), (100, 8)] {
            let shares: Vec<Vec<usize>> = (0..ranks)
                .map(|r| {
                    DistributedSampler::new(len, ranks, r, true, 5, false)
                        .unwrap()
                        .indices()
                })
                .collect();
            let n = len.div_ceil(ranks);
            assert!(shares.iter().all(|s| s.len() == n));
            let mut all: Vec<usize> = shares.concat();
            all.sort();
            all.dedup();
            assert_eq!(
                all,
                (0..len).collect::<Vec<_>>(),
                "len {len}, {ranks} ranks"
            );
            // drop_last: disjoint, no padding.
            let dropped: Vec<usize> = (0..ranks)
                .flat_map(|r| {
                    DistributedSampler::new(len, ranks, r, true, 5, true)
                        .unwrap()
                        .indices()
                })
                .collect();
            let mut d = dropped.clone();
            d.sort();
            d.dedup();
            assert_eq!(d.len(), dropped.len());
            assert_eq!(dropped.len(), len / ranks * ranks);
        }
    }

    #[test]
    fn the_epoch_reshuffles_and_interleaving_matches_one_rank() {
        let mut s = DistributedSampler::new(1000, 1, 0, true, 9, false).unwrap();
        let e0 = s.indices();
        s.set_epoch(1);
        assert_ne!(e0, s.indices());
        s.set_epoch(0);
        assert_eq!(e0, s.indices());
        // Rank r of 4 takes every 4th sample of the one-rank order from r.
        let r2 = DistributedSampler::new(1000, 4, 2, true, 9, false)
            .unwrap()
            .indices();
        assert_eq!(r2[..3], [e0[2], e0[6], e0[10]]);
        let plain = DistributedSampler::new(5, 1, 0, false, 9, false).unwrap();
        assert_eq!(plain.indices(), vec![0, 1, 2, 3, 4]);
        assert!(DistributedSampler::new(5, 2, 2, true, 0, false).is_err());
    }
}
