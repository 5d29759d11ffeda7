//! A reusable barrier built from store keys.
//!
//! Generation `g` of barrier `name` uses the keys
//! `barrier/{name}/{g}/arrived/{rank}`, `.../count` and `.../done`. Each
//! rank marks its arrival and bumps the counter; the rank that brings it to
//! the world size sets `done`, which releases everyone. Because no rank can
//! reach generation `g` before every rank has left `g - 1`, that same last
//! rank deletes generation `g - 1`'s keys, so repeated barriers keep the
//! store small. On timeout the error names the ranks that never arrived.

use crate::client::StoreClient;
use crate::error::StoreError;
use std::time::{Duration, Instant};

impl StoreClient {
    /// Blocks until all `world_size` ranks have called `barrier` with the
    /// same `name` (as many times), or fails after `timeout` naming the
    /// missing ranks.
    pub fn barrier(
        &self,
        name: &str,
        rank: usize,
        world_size: usize,
        timeout: Duration,
    ) -> Result<(), StoreError> {
        if rank >= world_size {
            return Err(StoreError::Invalid(format!(
                "barrier {name:?}: rank {rank} is not below world size {world_size}"
            )));
        }
        let generation = {
            let mut gens = self
                .barrier_generations
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            let g = gens.entry(name.to_string()).or_insert(0);
            *g += 1;
            *g
        };
        let base = format!("barrier/{name}/{generation}/");
        let start = Instant::now();
        self.set(&format!("{base}arrived/{rank}"), b"")?;
        let arrived = self.add(&format!("{base}count"), 1)?;
        if arrived as usize == world_size {
            self.set(&format!("{base}done"), b"")?;
            if generation > 1 {
                self.delete_prefix(&format!("barrier/{name}/{}/", generation - 1))?;
            }
        }
        let remaining = timeout.saturating_sub(start.elapsed());
        match self.get_timeout(&format!("{base}done"), remaining) {
            Ok(_) => Ok(()),
            Err(StoreError::Timeout { .. }) => {
                let keys: Vec<String> = (0..world_size)
                    .map(|r| format!("{base}arrived/{r}"))
                    .collect();
                let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
                let missing: Vec<usize> = match self.check(&refs) {
                    Ok(present) => (0..world_size).filter(|r| !present[*r]).collect(),
                    Err(_) => Vec::new(),
                };
                let what = format!(
                    "barrier {:?} (generation {generation}, rank {rank}): {} of {world_size} ranks arrived; missing ranks: {missing:?}",
                    self.full_name(&format!("barrier/{name}")),
                    world_size - missing.len(),
                );
                Err(self.timeout_error(what, start.elapsed()))
            }
            Err(e) => Err(e),
        }
    }
}
