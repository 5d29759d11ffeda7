//! [`ParamServer`]: the worker's side of a parameter-server run, as a
//! strategy of the one loop. Each bucket of gradients goes to the servers
//! that own it as soon as the backward unit that completes it has run
//! (the buckets data parallelism would reduce), while the next units
//! compute; then, by the run's split of the work:
//!
//! - servers update ([`UpdateAt::Server`]): the gradient norm for clipping
//!   is the servers' (the sum of their shards' squared norms of the summed
//!   gradients, synchronous) or this worker's own (asynchronous), the
//!   update request carries the loop's learning rate and gradient scale,
//!   and its reply is the new parameters, written into the engine;
//! - workers update ([`UpdateAt::Worker`], BytePS's split): the servers'
//!   sum replaces the gradient buffer before the update, and the engine
//!   updates as under data parallelism.
//!
//! Written for engines in host memory (the CPU engine).

use crate::checkpoint::{self, Staging, StatePart, StateSource};
use crate::collective::Bucket;
use crate::ddp::buckets::{plan, BucketPlan};
use crate::ddp::mib;
use crate::engine::{Checkpointable, OptimizerState};
use crate::engine::{Engine, UpdateStep};
use crate::space::{Host, Window};
use crate::strategy::{CommStep, Strategy};
use crate::timeline::Timeline;
use crate::Result;
use braid_ps::wire::Encoding;
use braid_ps::{Client, Joined, Mode, UpdateAt, WholeState};
use std::ops::Range;

/// Top-k with error feedback: `values` plus what earlier steps did not
/// send (`residual`, the same elements), of which the largest `fraction`
/// by magnitude (at least one) is returned dense (zeros elsewhere) and the
/// rest left in `residual` for the next step.
pub fn top_k_with_feedback(values: &[f32], residual: &mut [f32], fraction: f32) -> Vec<f32> {
    let mut v: Vec<f32> = values
        .iter()
        .zip(residual.iter())
        .map(|(g, r)| g + r)
        .collect();
    // (Less a hair: 0.4 as f32 is a hair above 0.4.)
    let k = ((fraction as f64 * v.len() as f64 - 1e-6).ceil() as usize).clamp(1, v.len().max(1));
    if k >= v.len() {
        residual.fill(0.0);
        return v;
    }
    let mut order: Vec<usize> = (0..v.len()).collect();
    order.select_nth_unstable_by(k - 1, |a, b| v[*b].abs().total_cmp(&v[*a].abs()));
    let mut keep = vec![false; v.len()];
    for &i in &order[..k] {
        keep[i] = true;
    }
    for (i, (r, x)) in residual.iter_mut().zip(v.iter_mut()).enumerate() {
        match keep[i] {
            true => *r = 0.0,
            false => {
                *r = *x;
                *x = 0.0;
            }
        }
    }
    v
}

/// How a worker takes part in a parameter-server run.
pub struct PsOptions {
    /// This worker, and how many there are.
    pub worker: usize,
    pub workers: usize,
    pub mode: Mode,
    pub update_at: UpdateAt,
    /// Bucket caps (MiB): the first bucket's and the others'.
    pub first_bucket_mb: f64,
    pub bucket_mb: f64,
    /// How gradients travel.
    pub encoding: Encoding,
    /// Top-k: the fraction of each bucket's gradients sent (the largest by
    /// magnitude), the rest kept for the next step (error feedback).
    pub top_k: Option<f32>,
    /// What the servers said when this worker joined: whether they hold
    /// parameters already, and the step it goes on from (a restarted
    /// worker's).
    pub joined: Joined,
    /// The factor on every update's learning rate (asynchronous runs'
    /// compensation: braid_ps::Compensation).
    pub lr_scale: f32,
}

/// What a worker saw of the servers over the run.
#[derive(Debug, Clone, Default)]
pub struct WorkerStaleness {
    /// The staleness of each of its pushes, per step.
    pub per_step: Vec<u64>,
}

/// A worker of a parameter-server run.
pub struct ParamServer {
    client: Option<Client>,
    opts: PsOptions,
    plan: Option<BucketPlan>,
    /// The step being computed (its pushes carry it).
    step: u64,
    last: CommStep,
    staleness: WorkerStaleness,
    scratch: Vec<f32>,
    /// Top-k's error feedback: what was not sent yet, by flat element.
    residual: Vec<f32>,
}

impl ParamServer {
    /// A worker over `client` (connected to every server).
    pub fn new(client: Client, opts: PsOptions) -> ParamServer {
        ParamServer {
            step: opts.joined.clock,
            client: Some(client),
            opts,
            plan: None,
            last: CommStep::default(),
            staleness: WorkerStaleness::default(),
            scratch: Vec::new(),
            residual: Vec::new(),
        }
    }

    /// The staleness of this worker's pushes so far.
    pub fn staleness(&self) -> &WorkerStaleness {
        &self.staleness
    }

    fn client(&mut self) -> Result<&mut Client> {
        self.client
            .as_mut()
            .ok_or_else(|| "the parameter-server run has finished (its connections closed)".into())
    }

    fn servers_update(&self) -> bool {
        self.opts.update_at == UpdateAt::Server
    }

    fn push_bucket(&mut self, bucket: &Bucket, values: &[f32]) -> Result<()> {
        let (step, encoding) = (self.step, self.opts.encoding);
        let r = bucket.range.clone();
        let sent = match self.opts.top_k {
            None => {
                self.client()?.push(step, r, values, encoding)?;
                values.len() as u64
            }
            Some(fraction) => {
                let kept = top_k_with_feedback(values, &mut self.residual[r.clone()], fraction);
                self.client()?.push(step, r, &kept, Encoding::Sparse)?;
                // An index and a value each.
                2 * kept.iter().filter(|v| **v != 0.0).count() as u64
            }
        };
        self.last.payload_bytes += 4 * values.len() as u64;
        self.last.wire_bytes += match encoding {
            Encoding::F16 => 2,
            _ => 4,
        } * sent;
        self.last.collectives += 1;
        Ok(())
    }
}

impl<E: Engine<Space = Host>> Strategy<E> for ParamServer {
    fn describe(&self) -> String {
        let o = &self.opts;
        let servers = self.client.as_ref().map_or(0, |c| c.shards().len());
        format!(
            "parameter server: {servers} server(s), {} worker(s), {} steps, {}, gradients pushed \
             in {} (buckets {} MiB, first {} MiB)",
            o.workers,
            o.mode,
            match o.update_at {
                UpdateAt::Server => "the servers update (they hold the optimizer state)",
                UpdateAt::Worker => "servers only sum, workers update (BytePS's split)",
            },
            match (o.top_k, o.encoding) {
                (Some(f), _) => format!("top-k {f} with error feedback"),
                (None, Encoding::F16) => "f16".to_string(),
                (None, _) => "f32".to_string(),
            },
            o.bucket_mb,
            o.first_bucket_mb
        )
    }

    fn rank(&self) -> usize {
        self.opts.worker
    }

    fn replicas(&self) -> usize {
        match self.opts.mode {
            Mode::Sync => self.opts.workers,
            // Each push is applied alone: its gradient is one worker's.
            Mode::Async | Mode::Ssp(_) => 1,
        }
    }

    fn start(&mut self, engine: &mut E) -> Result<()> {
        let len = engine.params().len();
        if self.opts.worker == 0 && !self.opts.joined.initialized {
            let params = engine.params().clone();
            self.client()?.init(&params)?;
        }
        let mut fresh = vec![0f32; len];
        self.client()?.get_params(&mut fresh)?;
        engine.params_mut().copy_from_slice(&fresh);
        engine.params_changed()?;
        if self.opts.top_k.is_some() {
            self.residual = vec![0.0; len];
        }
        let units = engine.units();
        self.plan = Some(plan(
            &units,
            len,
            mib(self.opts.first_bucket_mb),
            mib(self.opts.bucket_mb),
            &[],
        )?);
        Ok(())
    }

    fn joined_at(&self) -> Option<usize> {
        let j = &self.opts.joined;
        (j.initialized && j.clock > 0).then_some(j.clock as usize)
    }

    fn backward(
        &mut self,
        engine: &mut E,
        grads: &mut Vec<f32>,
        timeline: &mut Timeline,
    ) -> Result<usize> {
        self.step += 1;
        self.last = CommStep {
            via: "parameter servers (TCP)",
            ..CommStep::default()
        };
        let plan = self
            .plan
            .take()
            .ok_or("the parameter-server strategy was not started")?;
        let result = (|| {
            let mut w = <Host as crate::space::Space>::window(grads);
            for u in 0..plan.after_unit.len() {
                engine.backward_unit(u, &mut w)?;
                for &b in &plan.after_unit[u] {
                    let bucket = &plan.buckets[b];
                    let part = match bucket.end {
                        crate::collective::End::Back => w.split_off_back(bucket.range.start)?,
                        crate::collective::End::Front => w.split_off_front(bucket.range.end)?,
                    };
                    self.push_bucket(bucket, part)?;
                }
            }
            timeline.mark(engine.stream())
        })();
        self.plan = Some(plan);
        result
    }

    fn before_update(&mut self, _engine: &mut E, grads: &mut Vec<f32>) -> Result<()> {
        if !self.servers_update() {
            let step = self.step;
            self.client()?.get_sum(step, grads)?;
            self.last.payload_bytes += 4 * grads.len() as u64;
            self.last.wire_bytes += 4 * grads.len() as u64;
        }
        Ok(())
    }

    fn grad_sq_norm(&mut self, engine: &mut E, grads: &Vec<f32>) -> Result<f64> {
        match (self.opts.update_at, self.opts.mode) {
            (UpdateAt::Server, Mode::Sync) => {
                let step = self.step;
                self.client()?.get_norm(step)
            }
            // The workers' own gradients: the summed ones (BytePS), or this
            // worker's alone (each push is applied alone).
            _ => engine.grad_sq_norm(grads),
        }
    }

    fn update(&mut self, engine: &mut E, grads: &Vec<f32>, step: UpdateStep) -> Result<()> {
        if !self.servers_update() {
            return engine.update(grads, step);
        }
        let id = self.step;
        let mut fresh = std::mem::take(&mut self.scratch);
        fresh.resize(grads.len(), 0.0);
        let mut span = braid_trace::span(
            braid_trace::staleness::SPAN,
            braid_trace::Cat::Comm,
            braid_trace::recorder::track::HOST,
        );
        let lr = step.lr * self.opts.lr_scale;
        let (_, staleness) = self.client()?.update(id, lr, step.grad_scale, &mut fresh)?;
        span.arg("staleness", staleness);
        span.arg("step", id);
        drop(span);
        engine.params_mut().copy_from_slice(&fresh);
        self.scratch = fresh;
        engine.params_changed()?;
        self.staleness.per_step.push(staleness);
        self.last.payload_bytes += 4 * grads.len() as u64;
        self.last.wire_bytes += 4 * grads.len() as u64;
        Ok(())
    }

    fn after_update(&mut self, _engine: &mut E) -> Result<()> {
        Ok(())
    }

    /// Each worker's own: the workers share no collective, so that one
    /// dying stops no other (the lead prints its own losses).
    fn mean(&mut self, _values: &mut [f64]) -> Result<()> {
        Ok(())
    }

    fn finish(&mut self, _engine: &mut E) -> Result<()> {
        let seen = &self.staleness.per_step;
        if self.opts.mode != Mode::Sync && !seen.is_empty() {
            println!(
                "worker {}: staleness of its {} pushes: mean {:.2}, max {}",
                self.opts.worker,
                seen.len(),
                seen.iter().sum::<u64>() as f64 / seen.len() as f64,
                seen.iter().max().unwrap_or(&0)
            );
        }
        match self.client.take() {
            Some(c) => c.bye(),
            None => Ok(()),
        }
    }

    fn last_step(&self) -> CommStep {
        self.last
    }

    /// Worker 0 writes the whole model (the only worker that saves): the
    /// workers share no collective to agree on a checkpoint over.
    fn save_ranges(&mut self, engine: &mut E) -> Result<Vec<Range<usize>>>
    where
        E: Checkpointable,
    {
        let tensors = checkpoint::tensors_of(engine)?;
        Ok(checkpoint::replica_share(&tensors, 0, 1))
    }

    /// Where servers update, their optimizer state is gathered into the
    /// engine's first, so that the checkpoint is data parallelism's.
    fn save_part(&mut self, engine: &mut E, staging: &mut Staging) -> Result<StatePart>
    where
        E: Checkpointable,
    {
        if self.servers_update() {
            let state = self.client()?.get_state()?;
            let (kind, names) = engine.optimizer_moments()?;
            if names.len() != state.moments.len() {
                return Err(format!(
                    "the servers hold {} optimizer moment(s), this worker's {kind} {}",
                    state.moments.len(),
                    names.len()
                ));
            }
            let moments = names.into_iter().zip(state.moments).collect();
            engine.set_optimizer_state(&OptimizerState { kind, moments }, state.updates)?;
            let step = self.step;
            self.client()?.checkpointed(step);
        }
        let ranges = <Self as Strategy<E>>::save_ranges(self, engine)?;
        checkpoint::whole_part(engine, ranges, staging)
    }

    /// Every worker loads the checkpoint whole; where servers update,
    /// worker 0 then gives them their shards of it.
    fn restore(&mut self, engine: &mut E, from: &dyn StateSource) -> Result<()>
    where
        E: Checkpointable,
    {
        checkpoint::restore_whole_params(engine, from)?;
        let len = engine.params().len();
        checkpoint::restore_optimizer(engine, from, std::slice::from_ref(&(0..len)))?;
        self.step = from.step();
        if self.servers_update() && self.opts.worker == 0 {
            let (_, names) = engine.optimizer_moments()?;
            let mut moments = Vec::with_capacity(names.len());
            for i in 0..names.len() {
                let mut m = vec![0f32; len];
                engine.read_moment(i, std::slice::from_ref(&(0..len)), &mut m)?;
                moments.push(m);
            }
            let state = WholeState {
                params: engine.params().clone(),
                moments,
                updates: from.step(),
                version: from.step(),
            };
            self.client()?.set_state(&state)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::top_k_with_feedback;

    #[test]
    fn top_k_sends_the_largest_and_keeps_the_rest_for_later() {
        let mut residual = vec![0.0f32; 5];
        let sent = top_k_with_feedback(&[0.1, -3.0, 0.2, 2.0, -0.05], &mut residual, 0.4);
        assert_eq!(sent, vec![0.0, -3.0, 0.0, 2.0, 0.0]);
        assert_eq!(residual, vec![0.1, 0.0, 0.2, 0.0, -0.05]);
        // What was kept back adds up until it is sent: nothing is lost.
        let sent2 = top_k_with_feedback(&[0.1, 0.0, 0.25, 0.0, 0.0], &mut residual, 0.2);
        assert_eq!(sent2, vec![0.0, 0.0, 0.45, 0.0, 0.0]);
        assert_eq!(residual, vec![0.2, 0.0, 0.0, 0.0, -0.05]);
    }
}
