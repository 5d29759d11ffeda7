//! What a ZeRO-3 (or ZeRO-2) rank holds once started ([`Sharded`]): its
//! slices of every block (master weights, reduced gradients), the blocks
//! gathered now and their gradients, the spare buffers kept for reuse, and
//! the f32 tensors of bf16-gathered blocks refreshed from every rank's
//! shard ([`SideRefresh`]); with the block-level steps of a pass: gather
//! or reduce-scatter one block, run one unit, put its blocks back.

use crate::collective::{Collective, GatherPart, ScatterPart};
use crate::engine::{ParamUnits, ShardedParams};
use crate::space::Space;
use crate::strategy::CommStep;
use crate::Result;
use std::ops::Range;
use std::sync::Arc;

/// What a ZeRO-3 rank holds once started.
pub(super) struct Sharded<C: Collective> {
    /// Shared, so that a pass can hold its lists while it changes the
    /// rest.
    pub(super) units: Arc<ParamUnits>,
    /// For every block, its elements of the master shard (and of the
    /// shard's gradients): the rank's slices of the blocks, in order.
    pub(super) slots: Vec<Range<usize>>,
    /// The same slices as elements of the flat buffer (what the
    /// optimizer owns; what a checkpoint stores them as).
    pub(super) shard: Vec<Range<usize>>,
    /// For every block, the backward units after which its gradients are
    /// reduce-scattered into the shard (in order; the last: once final).
    pub(super) reduce_after: Vec<Vec<usize>>,
    /// Per block: some of its gradients reached the shard in this
    /// backward pass (the next part adds to them).
    pub(super) reduced: Vec<bool>,
    /// The lengths a new buffer is allocated with when one is within
    /// 1.5 times of what is asked ([`Sharded::room_for`]); empty: each
    /// buffer as long as asked.
    pub(super) sizes: Vec<usize>,
    /// The rank's f32 master weights.
    pub(super) master: Flat2<C>,
    /// The shard's reduced gradients, laid out like `master`.
    pub(super) grads: Flat2<C>,
    /// The blocks gathered now.
    pub(super) gathered: Vec<Option<Flat2<C>>>,
    /// The blocks' gradients during a backward pass.
    pub(super) block_grads: Vec<Option<Flat2<C>>>,
    /// Freed block buffers kept for the next block of the same length,
    /// or of one they have room for (at most [`SPARES`]): fresh memory
    /// costs a page fault per page, which on the CPU took as long as the
    /// passes themselves.
    pub(super) spare: Vec<Flat2<C>>,
    /// Every freed block buffer is kept as a spare, none given back: the
    /// collectives' block buffers are costly to make
    /// ([`Collective::block_buffers_kept`]).
    pub(super) keep_spares: bool,
    /// What was asked of [`keep_spares`](Self::keep_spares)
    /// ([`Zero3::with_kept_spares`](super::Zero3::with_kept_spares)).
    pub(super) spares_asked: Option<bool>,
    /// Block buffers made in this step, and in the steps before it.
    pub(super) made: (u64, u64),
    /// Bytes of gathered blocks, block gradients and spares held now,
    /// and the most held at once.
    pub(super) held: u64,
    pub(super) peak: u64,
    /// Micro-batches whose gradients reached the shard this step.
    pub(super) micro: usize,
    /// Bytes of the engine's saved activations in the shard's gradient
    /// memory.
    pub(super) lent: usize,
    /// Those activations' elements of the gradient shard, each with the
    /// first forward unit that writes them.
    pub(super) lent_runs: Vec<(Range<usize>, usize)>,
    /// Per block: gathered in bf16 (half the elements).
    pub(super) half: Vec<bool>,
    /// The f32 tensors of the bf16 blocks, kept whole on every rank.
    pub(super) side: Option<SideRefresh<C>>,
    /// "ZeRO-3", or "ZeRO-2" (stage 2), for messages.
    pub(super) label: &'static str,
}

/// The f32 tensors inside the blocks gathered in bf16 (the engine's
/// [`ShardedParams::half_side`]), refreshed on every rank from every rank's
/// master shard after the master weights change.
pub(super) struct SideRefresh<C: Collective> {
    /// `n × per_rank` elements: rank `r`'s elements of the tensors in
    /// block `r`, all-gathered.
    pub(super) exchange: Flat2<C>,
    pub(super) per_rank: usize,
    /// This rank's runs: (master shard element, exchange element, count).
    pub(super) mine: Vec<(usize, usize, usize)>,
    /// Every rank's runs: (exchange element, packed element, count).
    pub(super) all: Vec<(usize, usize, usize)>,
    /// The master weights changed since the last refresh.
    pub(super) stale: bool,
}

/// The runs of a side refresh over `n` ranks for `rank`: the tensors
/// `side` (flat ranges, increasing, each inside a block, packed one after
/// another in that order), split where the ranks' slices of their blocks
/// split them. `slots[b]` is block `b`'s slice in every rank's master
/// shard (the same on every rank). Returns (this rank's runs, every
/// rank's runs, elements per rank) as [`SideRefresh`] keeps them.
#[allow(clippy::type_complexity)]
pub(super) fn side_runs(
    blocks: &[Range<usize>],
    slots: &[Range<usize>],
    side: &[Range<usize>],
    rank: usize,
    n: usize,
) -> Result<(
    Vec<(usize, usize, usize)>,
    Vec<(usize, usize, usize)>,
    usize,
)> {
    // Per rank: (master element, packed element, count).
    let mut per: Vec<Vec<(usize, usize, usize)>> = vec![Vec::new(); n];
    let mut packed = 0;
    for t in side {
        let b = blocks
            .iter()
            .position(|b| b.start <= t.start && t.end <= b.end)
            .ok_or_else(|| format!("ZeRO-3: the f32 tensor {t:?} lies in no single block"))?;
        let k = slots[b].len();
        for (r, runs) in per.iter_mut().enumerate() {
            let slice = blocks[b].start + r * k..blocks[b].start + (r + 1) * k;
            let (a, e) = (t.start.max(slice.start), t.end.min(slice.end));
            if a < e {
                let (from, to) = (slots[b].start + (a - slice.start), packed + (a - t.start));
                match runs.last_mut() {
                    // Runs next to each other in both become one copy.
                    Some(last) if last.0 + last.2 == from && last.1 + last.2 == to => {
                        last.2 += e - a
                    }
                    _ => runs.push((from, to, e - a)),
                }
            }
        }
        packed += t.len();
    }
    let per_rank = per
        .iter()
        .map(|r| r.iter().map(|x| x.2).sum())
        .max()
        .unwrap_or(0);
    let mut mine = Vec::new();
    let mut all = Vec::new();
    for (r, runs) in per.iter().enumerate() {
        let mut at = r * per_rank;
        for &(master, to, len) in runs {
            if r == rank {
                mine.push((master, at, len));
            }
            all.push((at, to, len));
            at += len;
        }
    }
    Ok((mine, all, per_rank))
}

/// Freed block buffers a ZeRO-3 rank keeps for reuse: the blocks in
/// flight at once (a unit's and the prefetched unit's parameters, a
/// gradient being written and one being reduced).
const SPARES: usize = 4;

type Flat2<C> = <<C as Collective>::Space as Space>::Flat;

impl<C: Collective> Sharded<C> {
    /// Refreshes the engine's f32 tensors of the bf16 blocks from every
    /// rank's master shard, if the master weights changed since.
    pub(super) fn refresh_side<E: ShardedParams<Space = C::Space>>(
        &mut self,
        group: &C,
        engine: &mut E,
    ) -> Result<CommStep> {
        let Some(sr) = self.side.as_mut().filter(|sr| sr.stale) else {
            return Ok(CommStep::default());
        };
        <C::Space as Space>::copy_runs(&self.master, &mut sr.exchange, &sr.mine)?;
        let all = 0..group.size() * sr.per_rank;
        let step = group
            .all_gather_ranges(&mut sr.exchange, &[all])
            .map_err(|e| format!("ZeRO-3: the f32 tensors of the bf16 layers: {e}"))?;
        let side = engine
            .half_side()
            .ok_or("ZeRO-3: the engine keeps no f32 tensors for the blocks it takes in bf16")?;
        <C::Space as Space>::copy_runs(&sr.exchange, side, &sr.all)?;
        sr.stale = false;
        Ok(step)
    }

    /// The master weights changed: the bf16 blocks' f32 tensors are
    /// refreshed before the next pass.
    pub(super) fn master_changed(&mut self) {
        if let Some(sr) = &mut self.side {
            sr.stale = true;
        }
    }

    pub(super) fn hold(&mut self, bytes: u64) {
        self.held += bytes;
        self.peak = self.peak.max(self.held);
    }

    /// Frees block `b`'s gathered parameters.
    pub(super) fn release(&mut self, b: usize) {
        if let Some(p) = self.gathered[b].take() {
            self.recycle(p);
        }
    }

    /// Frees block `b`'s gradient buffer.
    pub(super) fn drop_grads(&mut self, b: usize) {
        if let Some(g) = self.block_grads[b].take() {
            self.recycle(g);
        }
    }

    /// Frees the gradient buffers of `blocks` (whose reduce-scatter is
    /// queued), emptying the list.
    pub(super) fn drop_all_grads(&mut self, blocks: &mut Vec<usize>) {
        for b in blocks.drain(..) {
            self.drop_grads(b);
        }
    }

    /// Reduce-scatters the gradients of `blocks` with no unit beside it,
    /// then frees their buffers (emptying the list).
    pub(super) fn reduce_alone(&mut self, group: &C, blocks: &mut Vec<usize>) -> Result<CommStep> {
        let step = self.exchange(group, &[], blocks, &mut || Ok(()))?;
        self.drop_all_grads(blocks);
        Ok(step)
    }

    /// Keeps `buf` as a spare, or frees it (the oldest spare goes when
    /// there are enough, unless [`keep_spares`](Self::keep_spares)).
    pub(super) fn recycle(&mut self, buf: Flat2<C>) {
        self.spare.push(buf);
        if !self.keep_spares && self.spare.len() > SPARES {
            let old = self.spare.remove(0);
            self.held -= 4 * <C::Space as Space>::capacity(&old) as u64;
        }
    }

    /// The elements a buffer of `len` is allocated with: the longest of
    /// [`sizes`](Self::sizes) from `len` to 1.5 × `len` (so that one
    /// allocation can serve blocks of near lengths in turn), else `len`.
    pub(super) fn room_for(&self, len: usize) -> usize {
        self.sizes
            .iter()
            .copied()
            .filter(|&s| s >= len && 2 * s <= 3 * len)
            .max()
            .unwrap_or(len)
    }

    /// A buffer of `len` elements: the spare with the least room that
    /// has room for them, within [`room_for`](Self::room_for) (its
    /// contents left over), or a new zeroed one.
    pub(super) fn buffer(&mut self, group: &C, len: usize) -> Result<(Flat2<C>, bool)> {
        let room = self.room_for(len);
        let fit = self
            .spare
            .iter()
            .enumerate()
            .map(|(i, s)| (i, <C::Space as Space>::capacity(s)))
            .filter(|&(_, c)| c >= len && c <= room)
            .min_by_key(|&(_, c)| c)
            .map(|(i, _)| i);
        let (mut buf, fresh) = match fit {
            Some(i) => (self.spare.swap_remove(i), false),
            None => {
                let buf = group.block_buffer(room)?;
                self.made.0 += 1;
                // Windows must be asked for alike on every rank: with
                // them, every buffer is kept, whatever a rank was told.
                let costly = group.block_buffers_kept();
                if costly && self.spares_asked == Some(false) {
                    return Err(format!(
                        "{}: BRAID_ZERO3_SPARES=capped: with copy-engine gathers every block \
                         buffer is kept (each is a window registered on every rank); unset it",
                        self.label
                    ));
                }
                self.keep_spares = costly || self.spares_asked == Some(true);
                self.hold(4 * room as u64);
                (buf, true)
            }
        };
        <C::Space as Space>::set_len(&mut buf, len)
            .map_err(|e| format!("{}: a block buffer: {e}", self.label))?;
        Ok((buf, fresh))
    }

    /// Block `b`'s gradient buffer, prepared (by `zero`: the engine
    /// zeroes what the unit writing the block first adds into) when new.
    /// A later part of a block reduced in parts is zeroed whole: the
    /// units writing it then only add.
    pub(super) fn grad_block(
        &mut self,
        group: &C,
        b: usize,
        zero: &mut dyn FnMut(&mut Flat2<C>) -> Result<()>,
    ) -> Result<()> {
        if self.block_grads[b].is_none() {
            let (mut buf, zeroed) = self.buffer(group, self.units.blocks[b].len())?;
            match (zeroed, self.reduced[b]) {
                (true, _) => {}
                (false, false) => zero(&mut buf)?,
                (false, true) => <C::Space as Space>::zero(&mut buf)?,
            }
            self.block_grads[b] = Some(buf);
        }
        Ok(())
    }

    /// Gathers the blocks of `want` not held yet and reduce-scatters the
    /// gradients of `scatter`, while `during` runs.
    pub(super) fn exchange(
        &mut self,
        group: &C,
        want: &[usize],
        scatter: &[usize],
        during: &mut crate::collective::During<'_>,
    ) -> Result<CommStep> {
        let mut fresh: Vec<(usize, Flat2<C>)> = Vec::new();
        for &b in want {
            if self.gathered[b].is_none() && !fresh.iter().any(|(x, _)| *x == b) {
                // The gather overwrites every element (bf16: two to one).
                let len = self.units.blocks[b].len();
                let len = if self.half[b] { len / 2 } else { len };
                let (buf, _) = self.buffer(group, len)?;
                fresh.push((b, buf));
            }
        }
        let (slots, micro, half, reduced) = (&self.slots, self.micro, &self.half, &self.reduced);
        let mut gathers: Vec<GatherPart<'_, Flat2<C>>> = fresh
            .iter_mut()
            .map(|(b, buf)| GatherPart {
                from: slots[*b].clone(),
                into: buf,
                at: 0,
                half: half[*b],
            })
            .collect();
        if let Some(&b) = scatter.iter().find(|&&b| self.block_grads[b].is_none()) {
            return Err(format!(
                "{}: block {b}'s gradients are not there",
                self.label
            ));
        }
        let mut scatters: Vec<ScatterPart<'_, Flat2<C>>> = self
            .block_grads
            .iter_mut()
            .enumerate()
            .filter(|(b, _)| scatter.contains(b))
            .filter_map(|(b, g)| {
                g.as_mut().map(|grads| ScatterPart {
                    grads,
                    to: slots[b].clone(),
                    // A step's first part overwrites the shard's gradients.
                    add: micro > 0 || reduced[b],
                })
            })
            .collect();
        let step = group.shard_exchange(
            &self.master,
            &mut gathers,
            &mut self.grads,
            &mut scatters,
            during,
        )?;
        drop(scatters);
        drop(gathers);
        for &b in scatter {
            self.reduced[b] = true;
        }
        for (b, buf) in fresh {
            self.gathered[b] = Some(buf);
        }
        Ok(step)
    }

    /// Runs one unit (`work`, given the parameters of `reads` and the
    /// gradient buffers of `writes`, in those orders) while the blocks of
    /// `next` are gathered and the gradients of `scatter` reduce-scattered.
    #[allow(clippy::type_complexity)]
    pub(super) fn run_unit(
        &mut self,
        group: &C,
        reads: &[usize],
        writes: &[usize],
        next: &[usize],
        scatter: &[usize],
        work: &mut dyn FnMut(&[&Flat2<C>], Vec<&mut Flat2<C>>) -> Result<Option<f32>>,
    ) -> Result<(Option<f32>, CommStep)> {
        // The unit's own blocks must be here (gathered by the previous
        // exchange); the prefetch fills fresh buffers, never these.
        let mut params: Vec<Flat2<C>> = Vec::with_capacity(reads.len());
        for &b in reads {
            params.push(self.gathered[b].take().ok_or_else(|| {
                format!("ZeRO-3: parameter block {b} was not gathered before its unit")
            })?);
        }
        let mut writing: Vec<(usize, Flat2<C>)> = Vec::with_capacity(writes.len());
        for &b in writes {
            let g = match scatter.contains(&b) {
                true => None,
                false => self.block_grads[b].take(),
            };
            let g = g.ok_or_else(|| {
                format!(
                    "{}: block {b}'s gradient buffer is not there for its unit",
                    self.label
                )
            });
            match g {
                Ok(g) => writing.push((b, g)),
                Err(e) => {
                    self.put_back(reads, params, writing);
                    return Err(e);
                }
            }
        }
        let next: Vec<usize> = next
            .iter()
            .copied()
            .filter(|b| !reads.contains(b))
            .collect();
        let mut out = None;
        let result = {
            let refs: Vec<&Flat2<C>> = params.iter().collect();
            let (params_ref, writing_ref) = (&refs, &mut writing);
            self.exchange(group, &next, scatter, &mut || {
                let grads: Vec<&mut Flat2<C>> = writing_ref.iter_mut().map(|(_, g)| g).collect();
                out = work(params_ref, grads)?;
                Ok(())
            })
        };
        self.put_back(reads, params, writing);
        Ok((out, result?))
    }

    /// Returns what [`run_unit`](Self::run_unit) took out.
    pub(super) fn put_back(
        &mut self,
        reads: &[usize],
        params: Vec<Flat2<C>>,
        writing: Vec<(usize, Flat2<C>)>,
    ) {
        for (&b, p) in reads.iter().zip(params) {
            self.gathered[b] = Some(p);
        }
        for (b, g) in writing {
            self.block_grads[b] = Some(g);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rank `r`'s master shard of a flat buffer `flat` split into `blocks`
    /// over `n` ranks (each block's `r`th slice, one after another).
    fn master_of(flat: &[f32], blocks: &[Range<usize>], r: usize, n: usize) -> Vec<f32> {
        blocks
            .iter()
            .flat_map(|b| {
                let k = b.len() / n;
                flat[b.start + r * k..b.start + (r + 1) * k].to_vec()
            })
            .collect()
    }

    #[test]
    fn side_runs_rebuild_the_packed_tensors_on_every_rank() {
        // Three blocks, f32 tensors inside them at awkward places (one
        // across a rank boundary, two adjacent across a block boundary).
        let blocks = vec![0..24, 24..72, 72..96];
        let side = vec![2..5, 10..14, 22..24, 24..27, 40..52, 70..72, 90..96];
        let flat: Vec<f32> = (0..96).map(|i| i as f32).collect();
        for n in [1usize, 2, 4] {
            let mut slots = Vec::new();
            let mut at = 0;
            for b in &blocks {
                slots.push(at..at + b.len() / n);
                at += b.len() / n;
            }
            let want: Vec<f32> = side.iter().flat_map(|t| flat[t.clone()].to_vec()).collect();
            // Every rank's exchange part, as the all-gather assembles it.
            let mut per_rank = 0;
            let mut exchange = Vec::new();
            let mut everyone = Vec::new();
            for r in 0..n {
                let (mine, all, k) = side_runs(&blocks, &slots, &side, r, n).unwrap();
                per_rank = k;
                if exchange.is_empty() {
                    exchange = vec![f32::NAN; n * k];
                }
                let master = master_of(&flat, &blocks, r, n);
                for (m, x, len) in mine {
                    assert!(
                        x >= r * k && x + len <= (r + 1) * k,
                        "rank {r} writes outside its part"
                    );
                    exchange[x..x + len].copy_from_slice(&master[m..m + len]);
                }
                everyone.push(all);
            }
            // Every rank unpacks the same runs into the same tensors.
            for all in &everyone {
                assert_eq!(all, &everyone[0]);
                let mut packed = vec![f32::NAN; want.len()];
                for &(x, to, len) in all {
                    packed[to..to + len].copy_from_slice(&exchange[x..x + len]);
                }
                assert_eq!(packed, want, "{n} ranks");
            }
            assert!(per_rank * n >= want.len());
        }
        // A tensor across two blocks is refused.
        let slots = vec![0..24, 24..72, 72..96];
        let across = 20..30;
        assert!(side_runs(&blocks, &slots, std::slice::from_ref(&across), 0, 1).is_err());
    }
}
