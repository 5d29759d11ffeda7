//! Data parallelism ([`DataParallel`]): every rank holds the whole model,
//! trains on its own share of each batch, and the gradients are summed
//! across ranks in buckets that overlap the backward pass.
//!
//! Written once over [`Collective`]: the same code runs over host memory
//! (shm, tcp) and GPUs (NCCL), for any [`Engine`] that says what
//! [`EngineInfo`] asks (an engine with nothing to add implements it
//! empty).
//!
//! - Start ([`Strategy::start`]): every rank's engine description must
//!   match rank 0's (an error names each rank that differs and how), then
//!   rank 0's parameters are broadcast and a checksum of every rank's copy
//!   compared (an error names any rank that disagrees).
//! - Backward ([`Strategy::backward`]): the engine's units run one by one;
//!   each bucket ([`buckets`]) is split off the gradient window and its
//!   all-reduce started the moment its last unit has run, through the
//!   communication hook ([`GradComm`]); the session returns once all are
//!   reduced (or ordered before the update, on a GPU).
//! - Averaging: buckets are summed; the loop divides by the number of
//!   ranks inside the update (no extra pass).

pub mod agree;
pub mod buckets;

use crate::collective::{Bucket, Collective, End, GradComm, Launch};
use crate::engine::{Engine, EngineInfo, Flat};
use crate::space::{Space, Window};
use crate::strategy::{CommStep, Strategy};
use crate::timeline::Timeline;
use crate::Result;
use braid_comm::ReduceOp;
use buckets::BucketPlan;

/// Data-parallel settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DdpOptions {
    /// Cap of every bucket after the first, in MiB (PyTorch: 25).
    pub bucket_cap_mb: f64,
    /// Cap of the first bucket, in MiB (PyTorch: 1).
    pub first_bucket_mb: f64,
    /// How gradients travel.
    pub grad_comm: GradComm,
    /// Start each bucket while the backward pass goes on (false: all
    /// buckets after the backward pass, to measure what overlap saves).
    pub overlap: bool,
}

impl Default for DdpOptions {
    fn default() -> Self {
        DdpOptions {
            bucket_cap_mb: 25.0,
            first_bucket_mb: 1.0,
            grad_comm: GradComm::Plain,
            overlap: true,
        }
    }
}

/// The data-parallel strategy over collectives `C`.
pub struct DataParallel<C: Collective> {
    comm: C,
    opts: DdpOptions,
    plan: Option<BucketPlan>,
    hooks: Option<C::Hooks>,
    last: CommStep,
}

/// Makes every rank's engine start from rank 0's parameters, after
/// checking that the engines describe the same model; then compares
/// checksums. Parameters held in host memory
/// ([`EngineInfo::host_params`]: an offloaded optimizer's master weights;
/// [`EngineInfo::pending_params`]: an engine's waiting for ZeRO-3 to shard
/// them) are compared only: every rank built them from the same seed or
/// checkpoint.
/// Returns the number of parameters.
pub(crate) fn replicate<C: Collective, E: EngineInfo<Space = C::Space>>(
    comm: &C,
    engine: &mut E,
) -> Result<usize> {
    agree::same_description(comm.host(), &engine.describe())?;
    // Parameters in host memory (an offloaded optimizer's master weights,
    // or an engine's waiting for ZeRO-3 to shard them) are compared, not
    // broadcast.
    if let Some(host) = engine.host_params().or_else(|| engine.pending_params()) {
        let when = "at the start (each rank's parameters in host memory come from its own \
                    initialisation or --load: give every rank the same --seed and file)";
        agree::same_checksum(comm.host(), agree::checksum(host), when)?;
        return Ok(host.len());
    }
    comm.broadcast(engine.params_mut(), 0)?;
    engine.params_changed()?;
    let params = engine.params();
    let len = <C::Space as Space>::len(params);
    let sum = agree::checksum_in_pieces(len, &mut |r, out| {
        <C::Space as Space>::read_ranges_into(params, std::slice::from_ref(&r), out)
    })?;
    agree::same_checksum(comm.host(), sum, "after the broadcast from rank 0")?;
    Ok(len)
}

/// Replaces each of `values` by its mean over the ranks of `host`.
pub(crate) fn mean_over(host: &braid_comm::Communicator, values: &mut [f64]) -> Result<()> {
    host.all_reduce(values, ReduceOp::Avg)
        .map_err(|e| e.to_string())
}

/// `x` MiB in bytes (at least one f32).
pub(crate) fn mib(x: f64) -> usize {
    (x * (1u64 << 20) as f64).max(4.0) as usize
}

impl<C: Collective> DataParallel<C> {
    /// Data parallelism over `comm` with `opts`.
    pub fn new(comm: C, opts: DdpOptions) -> Self {
        DataParallel {
            comm,
            opts,
            plan: None,
            hooks: None,
            last: CommStep::default(),
        }
    }

    /// The collectives.
    pub fn collective(&self) -> &C {
        &self.comm
    }

    /// One line: ranks, backend, hook, buckets.
    pub fn describe(&self) -> String {
        if self.comm.size() == 1 {
            return "one data-parallel replica (no gradient reduction)".into();
        }
        format!(
            "data parallel over {} ranks ({}), gradients {}, buckets {} MiB (first {} MiB){}",
            self.comm.size(),
            self.comm.backend(),
            self.opts.grad_comm.name(),
            self.opts.bucket_cap_mb,
            self.opts.first_bucket_mb,
            if self.opts.overlap {
                ""
            } else {
                ", reduced after the backward pass (no overlap)"
            }
        )
    }

    /// Replaces each of `values` by its mean over the ranks.
    pub fn mean(&self, values: &mut [f64]) -> Result<()> {
        mean_over(self.comm.host(), values)
    }

    /// What the last backward pass communicated.
    pub fn last_step(&self) -> CommStep {
        self.last
    }

    /// The buckets (after [`Strategy::start`]).
    pub fn buckets(&self) -> &[Bucket] {
        self.plan.as_ref().map_or(&[], |p| &p.buckets)
    }

    /// The reduction session of one backward pass: the engine's units run
    /// (unless `compute` is false: the gradients are already there), each
    /// bucket starting after its last unit (or all after the pass, without
    /// overlap); `computed` marks the end of the computation.
    fn session<E: Engine<Space = C::Space>>(
        &mut self,
        engine: &mut E,
        grads: &mut Flat<E>,
        timeline: &mut Timeline,
        compute: bool,
    ) -> Result<usize> {
        let overlap = self.opts.overlap;
        let comm = &self.comm;
        let (plan, hooks) = match (&self.plan, &mut self.hooks) {
            (Some(p), Some(h)) => (p, h),
            _ => return Err("data parallel: backward before start (call start first)".into()),
        };
        let mut computed = None;
        let window = <E::Space as Space>::window(grads);
        if comm.size() == 1 {
            // One replica (a tensor group's data dimension of one): the
            // gradients are already the mean; nothing goes on the wire.
            let mut nothing = |_: usize, _| Ok(());
            let at = run_units(
                engine,
                plan,
                window,
                &mut nothing,
                timeline,
                compute,
                overlap,
            )?;
            self.last = CommStep::default();
            return Ok(at);
        }
        let step = comm.reduce(window, &plan.buckets, hooks, &mut |w, launch| {
            computed = Some(run_units(
                engine, plan, w, launch, timeline, compute, overlap,
            )?);
            Ok(())
        })?;
        self.last = step;
        computed.ok_or_else(|| "data parallel: the backward pass did not run".into())
    }
}

/// The body of a reduction session: runs the engine's backward units into
/// the window `w` (unless `compute` is false: the gradients are already
/// there) and launches each bucket of `plan` after its last unit (or all
/// after the pass, without `overlap`). Returns the timeline's mark of the
/// end of the computation.
pub(crate) fn run_units<'g, E: Engine>(
    engine: &mut E,
    plan: &BucketPlan,
    mut w: <E::Space as Space>::Window<'g>,
    launch: &mut Launch<'_, 'g, E::Space>,
    timeline: &mut Timeline,
    compute: bool,
    overlap: bool,
) -> Result<usize> {
    for u in 0..plan.after_unit.len() {
        if compute {
            engine.backward_unit(u, &mut w)?;
        }
        if overlap {
            for &b in &plan.after_unit[u] {
                start_bucket::<E::Space>(&plan.buckets[b], b, &mut w, launch)?;
            }
        }
    }
    let computed = timeline.mark(engine.stream())?;
    if !overlap {
        for (b, bucket) in plan.buckets.iter().enumerate() {
            start_bucket::<E::Space>(bucket, b, &mut w, launch)?;
        }
    }
    Ok(computed)
}

/// The median of five runs of `session` (a reduction session over
/// gradients already computed) on the engine's clock, with nothing else
/// queued: what a strategy's communication costs when nothing overlaps it.
pub(crate) fn time_sessions<E: Engine>(
    engine: &mut E,
    session: &mut dyn FnMut(&mut E, &mut Timeline) -> Result<()>,
) -> Result<Option<f64>> {
    let mut times = Vec::new();
    for _ in 0..5 {
        engine.synchronize()?;
        let mut tl = Timeline::new();
        let a = tl.mark(engine.stream())?;
        session(engine, &mut tl)?;
        let b = tl.mark(engine.stream())?;
        engine.synchronize()?;
        times.push(tl.seconds(a, b)?);
    }
    times.sort_by(|x, y| x.partial_cmp(y).expect("finite"));
    Ok(Some(times[times.len() / 2]))
}

/// Splits bucket `b` off the window and starts its reduction.
fn start_bucket<'g, S: Space>(
    bucket: &Bucket,
    b: usize,
    w: &mut S::Window<'g>,
    launch: &mut Launch<'_, 'g, S>,
) -> Result<()> {
    let part = match bucket.end {
        End::Back => w.split_off_back(bucket.range.start)?,
        End::Front => w.split_off_front(bucket.range.end)?,
    };
    launch(b, part)
}

impl<C, E> Strategy<E> for DataParallel<C>
where
    C: Collective,
    E: EngineInfo<Space = C::Space>,
{
    fn describe(&self) -> String {
        DataParallel::describe(self)
    }

    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn replicas(&self) -> usize {
        self.comm.size()
    }

    fn start(&mut self, engine: &mut E) -> Result<()> {
        let len = replicate(&self.comm, engine)?;
        let plan = buckets::plan(
            &engine.units(),
            len,
            mib(self.opts.first_bucket_mb),
            mib(self.opts.bucket_cap_mb),
            &engine.matrices(),
        )?;
        self.hooks = Some(self.comm.hooks(self.opts.grad_comm, &plan.buckets)?);
        self.plan = Some(plan);
        Ok(())
    }

    fn backward(
        &mut self,
        engine: &mut E,
        grads: &mut Flat<E>,
        timeline: &mut Timeline,
    ) -> Result<usize> {
        self.session(engine, grads, timeline, true)
    }

    fn before_update(&mut self, _engine: &mut E, _grads: &mut Flat<E>) -> Result<()> {
        Ok(())
    }

    fn after_update(&mut self, _engine: &mut E) -> Result<()> {
        Ok(())
    }

    fn mean(&mut self, values: &mut [f64]) -> Result<()> {
        DataParallel::mean(self, values)
    }

    fn last_step(&self) -> CommStep {
        self.last
    }

    fn time_unoverlapped(&mut self, engine: &mut E, grads: &mut Flat<E>) -> Result<Option<f64>> {
        time_sessions(engine, &mut |engine, tl| {
            self.session(engine, grads, tl, false).map(|_| ())
        })
    }
}
