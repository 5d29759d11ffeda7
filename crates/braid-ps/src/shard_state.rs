//! One server's shard and what its workers have sent, as a state machine
//! without sockets: each request either answers now or says it must wait
//! ([`Answer::Wait`]); the server ([`crate::server`]) waits on a condition
//! variable, bounded, and asks again.
//!
//! Synchronous steps collect every worker's gradients of a step in a slot
//! of its own and sum them in worker order once all are in, so the sum is
//! the same whatever order the pushes arrived in. Asynchronous and
//! bounded-staleness pushes are applied one worker at a time, as each
//! worker's update request comes; the staleness of each (how many updates
//! other workers made since this worker last read the parameters) is
//! counted.

use crate::consistency::{Adaptive, Compensation, Mode, UpdateAt};
use braid_model::optim::Optimizer;
use std::collections::BTreeMap;
use std::time::Instant;

/// What a request gets.
#[derive(Debug, PartialEq)]
pub enum Answer<T> {
    /// The reply, now.
    Ready(T),
    /// Not yet: what it waits for (for the timeout's message).
    Wait(String),
}

/// A worker as the server sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Presence {
    /// Not connected yet.
    #[default]
    Expected,
    /// Connected.
    Live,
    /// Its connection closed without a goodbye, after its step `.0`.
    Gone(u64),
    /// Said goodbye.
    Done,
}

/// Staleness of the applied pushes: how many other updates landed between
/// a worker's read of the parameters and its push being applied.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Staleness {
    /// Pushes applied.
    pub pushes: u64,
    /// Sum of their staleness (for the mean).
    pub total: u64,
    /// The largest.
    pub max: u64,
    /// Count by staleness, 0 to 15 and a last bucket for 16 or more.
    pub histogram: [u64; 17],
}

impl Staleness {
    fn record(&mut self, s: u64) {
        self.pushes += 1;
        self.total += s;
        self.max = self.max.max(s);
        self.histogram[(s as usize).min(16)] += 1;
    }

    /// Mean staleness (0 with no pushes).
    pub fn mean(&self) -> f64 {
        match self.pushes {
            0 => 0.0,
            n => self.total as f64 / n as f64,
        }
    }

    /// Adds `other`'s counts (servers' figures summed).
    pub fn add(&mut self, other: &Staleness) {
        self.pushes += other.pushes;
        self.total += other.total;
        self.max = self.max.max(other.max);
        for (a, b) in self.histogram.iter_mut().zip(other.histogram) {
            *a += b;
        }
    }
}

/// A shard's whole state, for a checkpoint or from one.
#[derive(Debug, Clone, PartialEq)]
pub struct Snapshot {
    /// The parameters.
    pub params: Vec<f32>,
    /// The optimizer's moments (AdamW: the first and second; SGD: the
    /// momentum; none where workers update).
    pub moments: Vec<Vec<f32>>,
    /// The optimizer's update count (AdamW's bias correction).
    pub updates: u64,
    /// The shard's version (updates applied; a synchronous run's step).
    pub version: u64,
}

/// One synchronous step's gradients: a slot per worker, then their sum.
#[derive(Debug, Default)]
struct StepSum {
    slots: Vec<Vec<f32>>,
    covered: Vec<usize>,
    sum: Option<Vec<f32>>,
    norm: Option<f64>,
    /// The update applied: its learning rate and scale.
    applied: Option<(f64, f64)>,
    served: Vec<bool>,
}

/// One worker's gradients of its current step (asynchronous modes).
#[derive(Debug, Default)]
struct Pending {
    step: u64,
    grads: Vec<f32>,
    covered: usize,
}

/// The shard: its parameters, optimizer state and what is in flight.
pub struct ShardState {
    mode: Mode,
    update_at: UpdateAt,
    len: usize,
    params: Option<Vec<f32>>,
    optimizer: Option<Optimizer>,
    version: u64,
    steps: BTreeMap<u64, StepSum>,
    pending: Vec<Pending>,
    /// Each worker's last committed step.
    clocks: Vec<u64>,
    /// The version each worker last read.
    read_at: Vec<u64>,
    presence: Vec<Presence>,
    staleness: Staleness,
    per_worker: Vec<Staleness>,
    /// Seconds spent in optimizer updates.
    update_s: f64,
    pushed_bytes: u64,
    /// The last synchronous step every worker was served.
    served_through: u64,
    /// The staleness of each worker's last applied push.
    last_staleness: Vec<u64>,
    /// The momentum and learning rate following the pushes' staleness
    /// (asynchronous and bounded-staleness training; `None`: as given).
    compensation: Option<Adaptive>,
    /// Pushes applied so far by the version they were computed from (the
    /// versions some worker may still push from).
    applied_from: BTreeMap<u64, u64>,
}

impl ShardState {
    /// Updates made with `c`'s compensation from now on.
    pub fn compensate(&mut self, c: Option<Adaptive>) {
        self.compensation = c;
    }

    /// The compensation as it stands (its staleness average, momentum and
    /// learning-rate scale), where there is one.
    pub fn compensation(&self) -> Option<(f64, Compensation)> {
        self.compensation.as_ref().map(|a| (a.mean(), a.now()))
    }

    /// A shard of `len` elements for `workers` workers; `optimizer` (over
    /// the shard's elements, compact) where the servers update.
    pub fn new(
        mode: Mode,
        update_at: UpdateAt,
        workers: usize,
        len: usize,
        optimizer: Option<Optimizer>,
    ) -> Result<ShardState, String> {
        if update_at == UpdateAt::Server && optimizer.is_none() {
            return Err("a server that updates needs its shard's optimizer".into());
        }
        if update_at == UpdateAt::Worker && mode != Mode::Sync {
            return Err(format!(
                "--ps-update worker with --ps-mode {mode}: summation-only servers serve \
                 synchronous steps (every worker updates from the same sum); use --ps-update \
                 server for asynchronous or bounded-staleness training"
            ));
        }
        Ok(ShardState {
            mode,
            update_at,
            len,
            params: None,
            optimizer,
            version: 0,
            steps: BTreeMap::new(),
            pending: (0..workers).map(|_| Pending::default()).collect(),
            clocks: vec![0; workers],
            read_at: vec![0; workers],
            presence: vec![Presence::Expected; workers],
            staleness: Staleness::default(),
            per_worker: vec![Staleness::default(); workers],
            update_s: 0.0,
            pushed_bytes: 0,
            served_through: 0,
            last_staleness: vec![0; workers],
            compensation: None,
            applied_from: BTreeMap::new(),
        })
    }

    /// Number of workers.
    pub fn workers(&self) -> usize {
        self.presence.len()
    }

    /// The shard's length.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the shard is empty (never for a built run).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Updates applied.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Whether the parameters have been given.
    pub fn initialized(&self) -> bool {
        self.params.is_some()
    }

    /// The staleness of every applied push, and per worker.
    pub fn staleness(&self) -> (&Staleness, &[Staleness]) {
        (&self.staleness, &self.per_worker)
    }

    /// Seconds spent in optimizer updates, and gradient bytes received.
    pub fn work(&self) -> (f64, u64) {
        (self.update_s, self.pushed_bytes)
    }

    /// Worker `w`'s presence.
    pub fn presence(&self, w: usize) -> Presence {
        self.presence[w]
    }

    /// Worker `w` connected (again: a replacement takes the slot of one
    /// that is gone; it joins at the slowest live worker's clock).
    pub fn join(&mut self, w: usize) -> Result<(), String> {
        self.check_worker(w)?;
        match self.presence[w] {
            Presence::Live => {
                return Err(format!(
                    "worker {w} is already connected: two processes claim the same worker rank"
                ))
            }
            Presence::Done => return Err(format!("worker {w} already finished this run")),
            Presence::Gone(_) => {
                let slowest = self.slowest_live().unwrap_or(self.clocks[w]);
                self.clocks[w] = slowest;
                self.pending[w] = Pending::default();
                // A replacement pushes the step it died in again, whole.
                for s in self.steps.values_mut().filter(|s| s.sum.is_none()) {
                    s.covered[w] = 0;
                }
            }
            Presence::Expected => {}
        }
        self.presence[w] = Presence::Live;
        Ok(())
    }

    /// The step worker `w` goes on from when it (re)joins: a synchronous
    /// run's version where servers update, else its clock.
    pub fn clock(&self, w: usize) -> u64 {
        match (self.mode, self.update_at) {
            (Mode::Sync, UpdateAt::Server) => self.version,
            (Mode::Sync, UpdateAt::Worker) => self.served_through,
            _ => self.clocks.get(w).copied().unwrap_or(0),
        }
    }

    /// The shard's whole state (after the parameters were given).
    pub fn snapshot(&self) -> Result<Snapshot, String> {
        let params = self
            .params
            .clone()
            .ok_or("the shard's parameters were never given")?;
        let (moments, updates) = match &self.optimizer {
            Some(Optimizer::AdamW { m, v, t, .. }) => (vec![m.clone(), v.clone()], *t as u64),
            Some(Optimizer::Sgd { buf, .. }) => (vec![buf.clone()], self.version),
            None => (Vec::new(), 0),
        };
        Ok(Snapshot {
            params,
            moments,
            updates,
            version: self.version,
        })
    }

    /// Replaces the shard's state by `snap` (a resumed run, or a server
    /// restarted from a checkpoint). Pushes of the steps after it, which
    /// other workers may have sent before the state arrived, are kept.
    pub fn restore(&mut self, snap: Snapshot) -> Result<(), String> {
        let len = self.len;
        let bad = |what: &str, n: usize| {
            format!("a restored shard's {what} has {n} elements, the shard {len}")
        };
        if snap.params.len() != len {
            return Err(bad("parameters", snap.params.len()));
        }
        match &mut self.optimizer {
            Some(Optimizer::AdamW { m, v, t, .. }) => {
                let [a, b] = snap.moments.as_slice() else {
                    return Err(format!(
                        "AdamW's state is two moments, not {}",
                        snap.moments.len()
                    ));
                };
                for x in [a, b] {
                    if x.len() != len {
                        return Err(bad("moment", x.len()));
                    }
                }
                m.copy_from_slice(a);
                v.copy_from_slice(b);
                *t =
                    u32::try_from(snap.updates).map_err(|_| format!("{} updates", snap.updates))?;
            }
            Some(Optimizer::Sgd { buf, .. }) => {
                let [a] = snap.moments.as_slice() else {
                    return Err(format!(
                        "SGD's state is one moment, not {}",
                        snap.moments.len()
                    ));
                };
                if a.len() != len {
                    return Err(bad("moment", a.len()));
                }
                buf.copy_from_slice(a);
            }
            None => {}
        }
        self.params = Some(snap.params);
        self.version = snap.version;
        self.served_through = snap.version;
        self.steps.retain(|step, _| *step > snap.version);
        for c in &mut self.clocks {
            *c = snap.version;
        }
        for r in &mut self.read_at {
            *r = snap.version;
        }
        Ok(())
    }

    /// Worker `w`'s connection closed; `bye`: it said goodbye first.
    pub fn leave(&mut self, w: usize, bye: bool) {
        if w < self.presence.len() {
            self.presence[w] = match bye {
                true => Presence::Done,
                false => Presence::Gone(self.clocks[w]),
            };
        }
    }

    /// Whether every worker has said goodbye.
    pub fn all_done(&self) -> bool {
        self.presence.iter().all(|p| *p == Presence::Done)
    }

    fn check_worker(&self, w: usize) -> Result<(), String> {
        match w < self.presence.len() {
            true => Ok(()),
            false => Err(format!(
                "worker {w} in a run of {} workers (is it from another run?)",
                self.presence.len()
            )),
        }
    }

    /// The shard's initial parameters (the first given win; later ones
    /// must have the shard's length and are ignored).
    pub fn init(&mut self, values: Vec<f32>) -> Result<(), String> {
        if values.len() != self.len {
            return Err(format!(
                "{} initial parameters for a shard of {}",
                values.len(),
                self.len
            ));
        }
        if self.params.is_none() {
            self.params = Some(values);
        }
        Ok(())
    }

    /// The parameters, once given, for worker `w` (its read is recorded
    /// for staleness).
    pub fn get_params(&mut self, w: usize) -> Result<Answer<(u64, Vec<f32>)>, String> {
        self.check_worker(w)?;
        match &self.params {
            None => Ok(Answer::Wait(
                "the initial parameters (from worker 0)".into(),
            )),
            Some(p) => {
                self.read_at[w] = self.version;
                Ok(Answer::Ready((self.version, p.clone())))
            }
        }
    }

    /// Worker `w`'s gradients of `step` for the shard's elements from
    /// `offset`.
    pub fn push(
        &mut self,
        w: usize,
        step: u64,
        offset: usize,
        values: &[f32],
    ) -> Result<(), String> {
        self.check_worker(w)?;
        if offset + values.len() > self.len {
            return Err(format!(
                "worker {w} pushed elements {offset}..{} of a shard of {}",
                offset + values.len(),
                self.len
            ));
        }
        self.pushed_bytes += 4 * values.len() as u64;
        let workers = self.workers();
        let len = self.len;
        match self.mode {
            Mode::Sync => {
                if step <= self.finished_step() {
                    return Err(format!(
                        "worker {w} pushed gradients of step {step}, which is already over (the \
                         shard is at step {})",
                        self.finished_step()
                    ));
                }
                let s = self.steps.entry(step).or_default();
                if s.slots.is_empty() {
                    s.slots = vec![Vec::new(); workers];
                    s.covered = vec![0; workers];
                    s.served = vec![false; workers];
                }
                let slot = &mut s.slots[w];
                if slot.is_empty() {
                    *slot = vec![0.0; len];
                }
                slot[offset..offset + values.len()].copy_from_slice(values);
                s.covered[w] += values.len();
                if s.covered[w] > len {
                    return Err(format!(
                        "worker {w} pushed more than the shard's {len} gradients for step {step}"
                    ));
                }
                if s.covered.iter().all(|c| *c == len) {
                    let mut sum = std::mem::take(&mut s.slots[0]);
                    for slot in s.slots.iter_mut().skip(1) {
                        for (a, b) in sum.iter_mut().zip(slot.iter()) {
                            *a += *b;
                        }
                        *slot = Vec::new();
                    }
                    s.sum = Some(sum);
                }
                Ok(())
            }
            Mode::Async | Mode::Ssp(_) => {
                let p = &mut self.pending[w];
                if p.covered == 0 {
                    p.step = step;
                    if p.grads.len() != len {
                        p.grads = vec![0.0; len];
                    }
                } else if p.step != step {
                    return Err(format!(
                        "worker {w} pushed gradients of step {step} before committing step {}",
                        p.step
                    ));
                }
                p.grads[offset..offset + values.len()].copy_from_slice(values);
                p.covered += values.len();
                if p.covered > len {
                    return Err(format!(
                        "worker {w} pushed more than the shard's {len} gradients for step {step}"
                    ));
                }
                Ok(())
            }
        }
    }

    /// The last synchronous step every worker has been served.
    fn finished_step(&self) -> u64 {
        match self.update_at {
            UpdateAt::Server => self.version,
            UpdateAt::Worker => self.served_through,
        }
    }

    /// Which workers' gradients step `step` still waits for.
    fn missing(&self, step: u64) -> String {
        let s = self.steps.get(&step);
        let missing: Vec<String> = (0..self.workers())
            .filter(|w| s.is_none_or(|s| s.covered[*w] < self.len))
            .map(|w| match self.presence[w] {
                Presence::Gone(at) => format!("worker {w} (its connection closed after step {at})"),
                Presence::Expected => format!("worker {w} (never connected)"),
                _ => format!("worker {w}"),
            })
            .collect();
        format!("step {step}'s gradients from {}", missing.join(", "))
    }

    /// The sum over the workers of step `step`'s gradients (summation-only
    /// servers), for worker `w`.
    pub fn get_sum(&mut self, w: usize, step: u64) -> Result<Answer<Vec<f32>>, String> {
        self.check_worker(w)?;
        let missing = self.missing(step);
        let Some(s) = self.steps.get_mut(&step) else {
            return Ok(Answer::Wait(missing));
        };
        let Some(sum) = &s.sum else {
            return Ok(Answer::Wait(missing));
        };
        let out = sum.clone();
        s.served[w] = true;
        self.retire(step);
        Ok(Answer::Ready(out))
    }

    /// The squared norm of step `step`'s summed gradients (f64 sums).
    pub fn get_norm(&mut self, step: u64) -> Answer<f64> {
        let missing = self.missing(step);
        let Some(s) = self.steps.get_mut(&step) else {
            return Answer::Wait(missing);
        };
        let Some(sum) = &s.sum else {
            return Answer::Wait(missing);
        };
        let n = *s
            .norm
            .get_or_insert_with(|| sum.iter().map(|g| (*g as f64) * (*g as f64)).sum());
        Answer::Ready(n)
    }

    /// Worker `w` commits step `step` at learning rate `lr`, its gradients
    /// multiplied by `scale`: the update (applied once for a synchronous
    /// step, at once for each push otherwise), then the parameters, with
    /// the staleness of this worker's push.
    pub fn update(
        &mut self,
        w: usize,
        step: u64,
        lr: f64,
        scale: f64,
    ) -> Result<Answer<(u64, Vec<f32>, u64)>, String> {
        self.check_worker(w)?;
        if self.update_at == UpdateAt::Worker {
            return Err("summation-only servers do not update: pull the sum instead".into());
        }
        if self.params.is_none() {
            return Err(format!(
                "worker {w} asked for an update before the parameters were given"
            ));
        }
        match self.mode {
            Mode::Sync => self.update_sync(w, step, lr, scale),
            Mode::Async | Mode::Ssp(_) => self.update_async(w, step, lr, scale),
        }
    }

    fn update_sync(
        &mut self,
        w: usize,
        step: u64,
        lr: f64,
        scale: f64,
    ) -> Result<Answer<(u64, Vec<f32>, u64)>, String> {
        let missing = self.missing(step);
        let version = self.version;
        let Some(s) = self.steps.get_mut(&step) else {
            return Ok(Answer::Wait(missing));
        };
        let Some(sum) = &s.sum else {
            return Ok(Answer::Wait(missing));
        };
        match s.applied {
            None => {
                if step != version + 1 {
                    return Err(format!(
                        "worker {w} commits step {step}, and the shard is at step {version}"
                    ));
                }
                let t = Instant::now();
                let params = self.params.as_mut().expect("checked above");
                let opt = self
                    .optimizer
                    .as_mut()
                    .expect("a server that updates has one");
                opt.step_compact_scaled(params, sum, lr as f32, scale as f32);
                self.update_s += t.elapsed().as_secs_f64();
                self.version = step;
                s.applied = Some((lr, scale));
            }
            Some((l, sc)) if l != lr || sc != scale => {
                return Err(format!(
                    "worker {w} commits step {step} with learning rate {lr} and gradient scale \
                     {scale}, another worker with {l} and {sc}: the workers disagree (different \
                     flags?)"
                ))
            }
            Some(_) => {}
        }
        s.served[w] = true;
        let params = self.params.as_ref().expect("checked above").clone();
        self.read_at[w] = self.version;
        self.retire(step);
        Ok(Answer::Ready((self.version, params, 0)))
    }

    fn update_async(
        &mut self,
        w: usize,
        step: u64,
        lr: f64,
        scale: f64,
    ) -> Result<Answer<(u64, Vec<f32>, u64)>, String> {
        let len = self.len;
        let p = &mut self.pending[w];
        // Asked again while it waits for the slowest: applied already.
        let staleness = if self.clocks[w] == step && p.covered == 0 {
            self.last_staleness[w]
        } else {
            if p.covered != len || p.step != step {
                return Err(format!(
                    "worker {w} commits step {step} with {} of the shard's {len} gradients of \
                     step {} pushed",
                    p.covered, p.step
                ));
            }
            let t = Instant::now();
            let staleness = self.version - self.read_at[w];
            let params = self.params.as_mut().expect("checked by update");
            let opt = self
                .optimizer
                .as_mut()
                .expect("a server that updates has one");
            let read = self.read_at[w];
            let siblings = self.applied_from.get(&read).copied().unwrap_or(0);
            *self.applied_from.entry(read).or_insert(0) += 1;
            // No live worker pushes from before the oldest version read.
            let oldest = (0..self.read_at.len())
                .filter(|v| matches!(self.presence[*v], Presence::Live))
                .map(|v| self.read_at[v])
                .min()
                .unwrap_or(read);
            self.applied_from.retain(|v, _| *v >= oldest);
            let lr = match &mut self.compensation {
                Some(a) => {
                    let c = a.record(staleness, siblings);
                    opt.set_momentum(c.momentum);
                    lr as f32 * c.lr_scale
                }
                None => lr as f32,
            };
            opt.step_compact_scaled(params, &p.grads, lr, scale as f32);
            self.update_s += t.elapsed().as_secs_f64();
            p.covered = 0;
            self.version += 1;
            self.staleness.record(staleness);
            self.per_worker[w].record(staleness);
            self.clocks[w] = step;
            self.last_staleness[w] = staleness;
            staleness
        };
        if let Mode::Ssp(bound) = self.mode {
            if let Some(slowest) = self.slowest_live() {
                if slowest + bound < step {
                    return Ok(Answer::Wait(format!(
                        "the slowest worker to reach step {} (bounded staleness {bound}: it is at \
                         step {slowest})",
                        step - bound
                    )));
                }
            }
        }
        self.read_at[w] = self.version;
        let params = self.params.as_ref().expect("checked by update").clone();
        Ok(Answer::Ready((self.version, params, staleness)))
    }

    /// The slowest live worker's clock.
    fn slowest_live(&self) -> Option<u64> {
        (0..self.workers())
            .filter(|w| matches!(self.presence[*w], Presence::Live | Presence::Expected))
            .map(|w| self.clocks[w])
            .min()
    }

    /// Drops step `step` once every worker has been served it.
    fn retire(&mut self, step: u64) {
        let Some(s) = self.steps.get(&step) else {
            return;
        };
        if s.served.iter().all(|x| *x) {
            self.steps.remove(&step);
            self.served_through = self.served_through.max(step);
        }
    }
}
