//! The order a loader reads a `.beton` file's samples in, epoch by epoch,
//! and each rank's share of it.
//!
//! - [`Order::Sequential`]: sample order;
//! - [`Order::Random`]: a permutation seeded by `seed` and the epoch;
//! - [`Order::QuasiRandom`]: FFCV's algorithm — samples shuffled within
//!   their page, pages in a random order, and each next sample drawn from
//!   one of at most `window` open pages, a page closing when its samples
//!   are used up — so that each page is read once per epoch while the
//!   order stays random within that window.
//!
//! Ranks deal the epoch's order out by global batches (`ranks × batch`):
//! rank `r` takes the `r`-th `batch` of each. With `drop_last` the
//! incomplete last global batch is dropped (every batch full, every rank
//! the same count); without it it is split over the ranks as evenly as it
//! goes, so each sample is read exactly once per epoch across the world
//! and every rank still has the same number of batches (the last may be
//! short, even empty, on some ranks). Every rank computes the same global
//! order from the seed: no communication.

use braid_core::rng::Rng;

/// How samples are ordered within an epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Order {
    /// In file order.
    Sequential,
    /// A uniform permutation.
    Random,
    /// Random within a window of open pages; each page read once.
    QuasiRandom,
}

impl Order {
    /// `sequential`, `random` or `quasi-random` (`quasi_random`).
    pub fn parse(s: &str) -> Result<Order, String> {
        match s {
            "sequential" => Ok(Order::Sequential),
            "random" => Ok(Order::Random),
            "quasi-random" | "quasi_random" => Ok(Order::QuasiRandom),
            _ => Err(format!(
                "order {s:?}: expected sequential, random or quasi-random"
            )),
        }
    }
}

/// One rank's view of the epochs of a dataset.
#[derive(Debug, Clone)]
pub struct EpochPlan {
    order: Order,
    /// Each sample's page (QuasiRandom).
    pages: Vec<u64>,
    samples: usize,
    batch: usize,
    rank: usize,
    ranks: usize,
    seed: u64,
    drop_last: bool,
    /// Open pages to draw from (QuasiRandom; FFCV uses 2 × batch).
    window: usize,
}

impl EpochPlan {
    /// A plan over `samples` samples (`pages[i]`: sample i's page, needed
    /// for QuasiRandom), batches of `batch` on rank `rank` of `ranks`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        order: Order,
        samples: usize,
        pages: Vec<u64>,
        batch: usize,
        rank: usize,
        ranks: usize,
        seed: u64,
        drop_last: bool,
    ) -> Result<EpochPlan, String> {
        if batch == 0 || ranks == 0 || rank >= ranks {
            return Err(format!(
                "batch {batch}, rank {rank} of {ranks}: need batch >= 1 and rank < ranks"
            ));
        }
        if order == Order::QuasiRandom && pages.len() != samples {
            return Err("quasi-random order needs every sample's page".into());
        }
        if drop_last && samples < batch * ranks {
            return Err(format!(
                "{samples} samples make no full global batch of {} ({ranks} ranks x batch {batch}); use fewer ranks, a smaller batch, or keep the last batch",
                batch * ranks
            ));
        }
        Ok(EpochPlan {
            order,
            pages,
            samples,
            batch,
            rank,
            ranks,
            seed,
            drop_last,
            window: 2 * batch,
        })
    }

    /// Sets QuasiRandom's window of open pages.
    pub fn with_window(mut self, window: usize) -> EpochPlan {
        self.window = window.max(1);
        self
    }

    /// Batches each rank reads per epoch.
    pub fn batches_per_epoch(&self) -> usize {
        let global = self.batch * self.ranks;
        if self.drop_last {
            self.samples / global
        } else {
            self.samples.div_ceil(global)
        }
    }

    /// The whole world's order for `epoch` (the same on every rank).
    pub fn global_order(&self, epoch: u64) -> Vec<usize> {
        let seed = self.seed ^ epoch.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        match self.order {
            Order::Sequential => (0..self.samples).collect(),
            Order::Random => {
                let mut v: Vec<usize> = (0..self.samples).collect();
                shuffle(&mut v, &mut Rng::new(seed));
                v
            }
            Order::QuasiRandom => quasi_random(&self.pages, self.window, &mut Rng::new(seed)),
        }
    }

    /// This rank's batches for `epoch`, in order.
    pub fn batches(&self, epoch: u64) -> Vec<Vec<usize>> {
        let order = self.global_order(epoch);
        let (b, r, n) = (self.batch, self.ranks, self.batches_per_epoch());
        let global = b * r;
        (0..n)
            .map(|k| {
                let start = k * global;
                let end = (start + global).min(order.len());
                let len = end - start;
                if len == global {
                    order[start + self.rank * b..start + (self.rank + 1) * b].to_vec()
                } else {
                    // The short last global batch: ranks take len / r, the
                    // first len % r one more.
                    let (each, extra) = (len / r, len % r);
                    let from = start + self.rank * each + self.rank.min(extra);
                    let take = each + (self.rank < extra) as usize;
                    order[from..from + take].to_vec()
                }
            })
            .collect()
    }
}

fn shuffle(v: &mut [usize], rng: &mut Rng) {
    for i in (1..v.len()).rev() {
        v.swap(i, rng.below(i + 1));
    }
}

/// FFCV's quasi-random order over samples on `pages`.
fn quasi_random(pages: &[u64], window: usize, rng: &mut Rng) -> Vec<usize> {
    let mut by_page: std::collections::BTreeMap<u64, Vec<usize>> = Default::default();
    for (s, &p) in pages.iter().enumerate() {
        by_page.entry(p).or_default().push(s);
    }
    let mut groups: Vec<Vec<usize>> = by_page.into_values().collect();
    for g in &mut groups {
        shuffle(g, rng);
    }
    let mut page_order: Vec<usize> = (0..groups.len()).collect();
    shuffle(&mut page_order, rng);
    let mut next_page = 0;
    let mut open: Vec<(usize, usize)> = Vec::new(); // (group, consumed)
    let mut out = Vec::with_capacity(pages.len());
    while out.len() < pages.len() {
        while next_page < page_order.len() && open.len() < window {
            open.push((page_order[next_page], 0));
            next_page += 1;
        }
        let k = rng.below(open.len());
        let (g, used) = &mut open[k];
        out.push(groups[*g][*used]);
        *used += 1;
        if *used == groups[*g].len() {
            open.swap_remove(k);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(order: Order, n: usize, b: usize, rank: usize, ranks: usize, drop: bool) -> EpochPlan {
        let pages = (0..n as u64).map(|s| s / 7).collect();
        EpochPlan::new(order, n, pages, b, rank, ranks, 42, drop).unwrap()
    }

    #[test]
    fn every_sample_once_per_epoch_across_the_world() {
        for order in [Order::Sequential, Order::Random, Order::QuasiRandom] {
            for ranks in [1, 2, 4] {
                for n in [1000, 1001, 37] {
                    let mut seen = vec![0u32; n];
                    let mut counts = Vec::new();
                    for rank in 0..ranks {
                        let batches = plan(order, n, 8, rank, ranks, false).batches(3);
                        counts.push(batches.len());
                        for b in batches {
                            assert!(b.len() <= 8);
                            for s in b {
                                seen[s] += 1;
                            }
                        }
                    }
                    assert!(
                        seen.iter().all(|&c| c == 1),
                        "{order:?} ranks {ranks} n {n}"
                    );
                    assert!(counts.windows(2).all(|c| c[0] == c[1]), "{counts:?}");
                }
            }
        }
    }

    #[test]
    fn drop_last_gives_full_batches_and_orders_follow_the_seed() {
        let p = plan(Order::Random, 1001, 8, 1, 4, true);
        let b = p.batches(0);
        assert_eq!(b.len(), 1001 / 32);
        assert!(b.iter().all(|x| x.len() == 8));
        assert_eq!(p.batches(0), b, "the same epoch, the same order");
        assert_ne!(p.batches(1), b, "another epoch, another order");
        let other = EpochPlan::new(Order::Random, 1001, vec![], 8, 1, 4, 43, true).unwrap();
        assert_ne!(other.batches(0), b, "another seed, another order");
        assert!(EpochPlan::new(Order::Random, 10, vec![], 8, 0, 2, 0, true).is_err());
    }

    #[test]
    fn quasi_random_keeps_at_most_window_pages_open_and_is_random() {
        // 50 pages of 20 samples; window 4: the order never has more than
        // 4 pages begun and not finished at once.
        let n = 1000;
        let pages: Vec<u64> = (0..n as u64).map(|s| s / 20).collect();
        let p = EpochPlan::new(Order::QuasiRandom, n, pages.clone(), 8, 0, 1, 1, false)
            .unwrap()
            .with_window(4);
        let order = p.global_order(0);
        let mut left: Vec<usize> = vec![20; 50];
        let mut open = std::collections::BTreeSet::new();
        for &s in &order {
            let pg = pages[s] as usize;
            open.insert(pg);
            assert!(open.len() <= 4);
            left[pg] -= 1;
            if left[pg] == 0 {
                open.remove(&pg);
            }
        }
        assert_ne!(order, (0..n).collect::<Vec<_>>());
        assert_ne!(order, p.global_order(1));
    }
}
