//! [`InFlight`]: the buffers a pipeline rank keeps for its micro-batches
//! between their forward and backward passes (a stage's activations on
//! CPUs, its saved buffers on GPUs), by (stage, micro-batch). A set comes
//! from the stage's pool, or is made when the pool is empty — so the sets
//! made are the most micro-batches in flight at once — and goes back
//! when the micro-batch is done with: after its input gradient went out
//! ([`InFlight::hand_out`], back at the next call), or when the schedule's
//! last use of it ran. A split backward pass keeps the set until its
//! weight half ([`InFlight::defer`], [`InFlight::undefer`]).

use crate::Result;
use std::collections::{HashMap, HashSet};

/// One pipeline rank's in-flight sets of `S`.
pub struct InFlight<S> {
    /// This rank's stages, by global index.
    stages: Vec<usize>,
    /// Pipeline ranks.
    ranks: usize,
    /// Per stage of this rank: sets not in use.
    free: Vec<Vec<S>>,
    /// The micro-batches' sets in use, by (stage, micro).
    live: HashMap<(usize, usize), S>,
    /// Per stage of this rank: sets made.
    made: Vec<usize>,
    /// A set whose input gradient went out: back to the pool at the next
    /// call.
    done: Option<(usize, usize)>,
    /// Sets whose weight half has not run yet.
    pending: HashSet<(usize, usize)>,
}

impl<S> InFlight<S> {
    /// Sets for the stages `stages` (global indices) of a pipeline of
    /// `ranks` ranks.
    pub fn new(stages: Vec<usize>, ranks: usize) -> InFlight<S> {
        let n = stages.len();
        InFlight {
            stages,
            ranks,
            free: (0..n).map(|_| Vec::new()).collect(),
            live: HashMap::new(),
            made: vec![0; n],
            done: None,
            pending: HashSet::new(),
        }
    }

    /// Where `stage` is among this rank's.
    pub fn local(&self, stage: usize) -> Result<usize> {
        self.stages
            .iter()
            .position(|s| *s == stage)
            .ok_or_else(|| format!("stage {stage} does not run on this pipeline rank"))
    }

    /// Whether stages `a` and `b` run on this rank (a hand-over without a
    /// message).
    pub fn both_here(&self, a: usize, b: usize) -> bool {
        a % self.ranks == b % self.ranks
    }

    /// Per stage of this rank: the sets made (the most micro-batches in
    /// flight at once).
    pub fn made(&self) -> &[usize] {
        &self.made
    }

    /// Returns the set handed out last to the pool.
    pub fn tidy(&mut self) -> Result<()> {
        if let Some((s, m)) = self.done.take() {
            self.release(s, m)?;
        }
        Ok(())
    }

    /// Returns (`stage`, `m`)'s set to the pool, unless its weight half is
    /// still to run.
    pub fn release(&mut self, stage: usize, m: usize) -> Result<()> {
        let i = self.local(stage)?;
        if self.pending.contains(&(stage, m)) {
            return Ok(());
        }
        if let Some(a) = self.live.remove(&(stage, m)) {
            self.free[i].push(a);
        }
        Ok(())
    }

    /// The set of (`stage`, `m`): from the pool, or `make(local index)`
    /// when the pool is empty.
    pub fn get(
        &mut self,
        stage: usize,
        m: usize,
        make: impl FnOnce(usize) -> Result<S>,
    ) -> Result<&mut S> {
        let i = self.local(stage)?;
        if !self.live.contains_key(&(stage, m)) {
            let a = match self.free[i].pop() {
                Some(a) => a,
                None => {
                    let a = make(i)?;
                    self.made[i] += 1;
                    a
                }
            };
            self.live.insert((stage, m), a);
        }
        Ok(self.live.get_mut(&(stage, m)).expect("inserted"))
    }

    /// The set of (`stage`, `m`) if it is in use.
    pub fn get_live(&mut self, stage: usize, m: usize) -> Option<&mut S> {
        self.live.get_mut(&(stage, m))
    }

    /// Takes (`stage`, `m`)'s set out (to run a pass with it), or why not.
    pub fn take(&mut self, stage: usize, m: usize) -> Result<S> {
        self.live.remove(&(stage, m)).ok_or_else(|| {
            format!(
                "stage {stage}: micro-batch {m} has no buffers (its forward pass did not run here)"
            )
        })
    }

    /// Puts (`stage`, `m`)'s set back after [`take`](Self::take).
    pub fn put(&mut self, stage: usize, m: usize, set: S) {
        self.live.insert((stage, m), set);
    }

    /// (`stage`, `m`)'s input gradient is going out: its set goes back at
    /// the next call.
    pub fn hand_out(&mut self, stage: usize, m: usize) {
        self.done = Some((stage, m));
    }

    /// (`stage`, `m`)'s backward pass was split: its set stays until
    /// [`undefer`](Self::undefer).
    pub fn defer(&mut self, stage: usize, m: usize) {
        self.pending.insert((stage, m));
    }

    /// (`stage`, `m`)'s weight half runs now: whether it was deferred.
    pub fn undefer(&mut self, stage: usize, m: usize) -> bool {
        self.pending.remove(&(stage, m))
    }

    /// Ends the step: every set back in the pool.
    pub fn end_step(&mut self) -> Result<()> {
        self.done = None;
        self.pending.clear();
        let keys: Vec<(usize, usize)> = self.live.keys().copied().collect();
        for (s, m) in keys {
            self.release(s, m)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sets_are_reused_and_kept_for_a_deferred_weight_half() {
        let mut f: InFlight<u32> = InFlight::new(vec![1, 3], 2);
        let mut n = 0;
        let mut make = |_| {
            n += 1;
            Ok(n)
        };
        assert_eq!(*f.get(1, 0, &mut make).unwrap(), 1);
        assert_eq!(*f.get(1, 1, &mut make).unwrap(), 2);
        f.release(1, 0).unwrap();
        // Reused: nothing new made.
        assert_eq!(*f.get(1, 2, |_| Ok(99)).unwrap(), 1);
        assert_eq!(f.made(), &[2, 0]);
        // A deferred weight half keeps its set past the hand-out.
        f.defer(1, 1);
        f.hand_out(1, 1);
        f.tidy().unwrap();
        assert!(f.get_live(1, 1).is_some());
        assert!(f.undefer(1, 1));
        f.release(1, 1).unwrap();
        assert!(f.get_live(1, 1).is_none());
        assert!(f.local(2).is_err());
        assert!(f.both_here(1, 3) && !f.both_here(1, 2));
        f.end_step().unwrap();
        assert!(f.get_live(1, 2).is_none());
    }
}
