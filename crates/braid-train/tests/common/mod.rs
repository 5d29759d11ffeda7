//! What the strategy tests share: a tiny GPT on the CPU engine (f32), a
//! small byte corpus, the one-process reference run (`Single`), a world of
//! ranks as threads of this test process over the host collectives (a
//! store on an ephemeral port; the TCP backend — which checks that every
//! rank numbers its operations alike — unless a test asks for shared
//! memory), and one rank's run of any mesh, data × pipeline × tensor,
//! assembled as `braid train` assembles it (`crates/braid/src/cmd/`
//! `train_cpu_run.rs`, `train_pipeline_run.rs`, `train_strategy.rs`), the
//! whole model put together afterwards and compared with the reference
//! tensor by tensor.
#![allow(dead_code)]

use braid_comm::{BackendKind, CommOptions, Communicator};
use braid_data::tokens::{synthetic_text, Dataset, Tokenizer};
use braid_model::layout::TensorShard;
use braid_model::optim::Schedule;
use braid_model::{GptConfig, Layout, Params};
use braid_store::{ClientOptions, ServerOptions, StoreClient, StoreServer};
use braid_train::assemble::{strategy, DataStrategy, ShardChoice, TensorSide};
use braid_train::collective::{Collective, HostCollective};
use braid_train::ddp::DdpOptions;
use braid_train::engine::Checkpointable;
use braid_train::engines::{CpuGpt, CpuOptimizer, CpuStage};
use braid_train::loader::TokenWindows;
use braid_train::mesh::{Degrees, Mesh};
use braid_train::pipeline::assign::{assign, head_cost};
use braid_train::schedule::build::ScheduleKind;
use braid_train::schedule::check::Checked;
use braid_train::tensor_parallel::HostTensorGroup;
use braid_train::{engines::TokenBatch, train};
use braid_train::{Engine, LoopOptions, RunReport, Single, Strategy};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// 4 layers (a pipeline of 2 ranks runs 2 stages each when interleaved),
/// 2 heads (one per rank of a tensor group of 2), 32 channels, a
/// vocabulary of 259 rows that splits unevenly over 2 ranks (the byte
/// corpus uses 256 of them), a context of 16.
pub const MODEL: &str = "L4-H2-C32-V259-T16";
/// Tokens per row.
pub const SEQ: usize = 16;
/// Optimizer steps of every run.
pub const STEPS: usize = 6;
/// Parameters, data order.
pub const SEED: u64 = 17;
/// AdamW's peak learning rate (cosine to a tenth over the steps, no
/// warmup): each parameter moves by up to about `STEPS × LR`.
pub const LR: f32 = 3e-3;
/// Clipping on: every strategy's gradient norm decides the update.
pub const GRAD_CLIP: f64 = 0.5;

/// Stated tolerance on the parameters: after [`STEPS`] AdamW steps every
/// element within this of the one-process run's (absolute; the
/// parameters move by up to ~1e-2, checked by [`MOVED_AT_LEAST`]). The
/// runs differ only in the order of sums (per-rank partial gradients
/// summed over ranks, partial products summed over a tensor group), and
/// AdamW's normalisation enlarges such differences where a gradient is
/// small: measured up to 5.4e-6 on the runs here (batch 4), 2.4e-5 on
/// a global batch of 8.
pub const PARAM_TOL: f32 = 5e-5;
/// The one-process run must move some parameter by at least this (so
/// that [`PARAM_TOL`] is under 1 % of the movement: a strategy that
/// trained nothing, or trained wrongly, fails).
pub const MOVED_AT_LEAST: f32 = 100.0 * PARAM_TOL;
/// Stated tolerance on the parameters as a whole: the Euclidean norm of
/// the difference from the one-process run's parameters within this
/// fraction of the norm of that run's movement from the initialisation
/// (measured: up to 5.4e-6 here, 2.2e-5 on a global batch of 8).
pub const PARAM_L2_TOL: f64 = 1e-4;
/// Stated tolerance on each step's loss and gradient norm, relative
/// (measured: up to 9.4e-8 here, 2.0e-7 on a global batch of 8).
pub const STEP_TOL: f64 = 1e-6;

/// How long a collective waits for a peer (a rank that failed makes the
/// others fail within this, not hang).
const TIMEOUT: Duration = Duration::from_secs(60);

pub fn config() -> GptConfig {
    GptConfig::parse(MODEL).expect("the test model parses")
}

/// 64 KiB of the synthetic corpus, byte tokens (the last tenth held out).
pub fn data() -> &'static Dataset {
    static DATA: OnceLock<Dataset> = OnceLock::new();
    DATA.get_or_init(|| {
        Dataset::from_tokens(Tokenizer::Bytes.encode(&synthetic_text(SEED, 64 << 10)))
            .expect("the corpus holds enough tokens")
    })
}

/// The loop's settings: [`STEPS`] updates of `accum` micro-batches each,
/// no evaluation, nothing timed apart.
pub fn options(accum: usize) -> LoopOptions {
    LoopOptions {
        steps: STEPS,
        accum,
        schedule: Schedule {
            max_lr: LR,
            min_lr: LR * 0.1,
            warmup: 0,
            total: STEPS,
        },
        grad_clip: GRAD_CLIP,
        eval_every: 0,
        eval_batches: 1,
        update: true,
        profile_warmup: 0,
        measure_unoverlapped: false,
        saved_in_grads: false,
        keep_first_grads: false,
    }
}

pub const OPTIMIZER: CpuOptimizer = CpuOptimizer::AdamW { weight_decay: 0.1 };

/// GPT-2's initialisation from [`SEED`], drawn straight into `layout`
/// (the same values by tensor whatever the layout: padded, or a tensor
/// rank's share).
pub fn init(layout: Layout) -> Params {
    Params::init_gpt2(Arc::new(layout), SEED)
}

/// What one rank's run gives back.
pub struct Trained {
    /// The whole model (plain layout or padded: compared by name), where
    /// this rank holds it after the run: see [`Spec::holders`].
    pub whole: Option<Params>,
    /// Every step's loss and gradient norm, as the loop reported them.
    pub losses: Vec<f32>,
    pub norms: Vec<f64>,
}

fn trained(run: &RunReport, whole: Option<Params>) -> Trained {
    Trained {
        whole,
        losses: run.steps.iter().map(|s| s.loss).collect(),
        norms: run.steps.iter().map(|s| s.grad_norm).collect(),
    }
}

/// `engine` under `strategy` for [`STEPS`] steps, batches of `rows` ×
/// [`SEQ`] as data rank `data_rank` of `data_ranks`.
pub fn train_rank<E, S>(
    engine: &mut E,
    strategy: &mut S,
    rows: usize,
    accum: usize,
    data_rank: usize,
    data_ranks: usize,
) -> RunReport
where
    E: Checkpointable + Engine<Batch = TokenBatch>,
    S: Strategy<E> + ?Sized,
{
    let mut loader = TokenWindows::new(data(), rows, SEQ, data_rank, data_ranks, SEED)
        .expect("the corpus holds a global batch");
    let mut batch = TokenBatch::new(rows, SEQ);
    train(
        engine,
        strategy,
        &mut loader,
        &mut batch,
        &options(accum),
        &mut |_| {},
    )
    .unwrap_or_else(|e| panic!("training failed: {e}"))
}

/// The reference: one process, `Single`, the whole model, batches of
/// `rows` in `accum` micro-batches.
pub fn single(rows: usize, accum: usize) -> Trained {
    let mut engine = CpuGpt::new(init(Layout::new(&config())), rows, SEQ, false, OPTIMIZER);
    let run = train_rank(&mut engine, &mut Single, rows, accum, 0, 1);
    trained(&run, Some(engine.into_params()))
}

static WORLDS: AtomicUsize = AtomicUsize::new(0);

/// Runs `f(comm)` on `n` ranks, each a thread of this process with its
/// own world communicator (on `backend`, set up through a store on an
/// ephemeral port of 127.0.0.1), and returns the ranks' results in rank
/// order. Every rank's thread is joined, and the store closed, before it
/// returns (the communicators' own helper threads end once their last
/// handle has gone, within a few hundred milliseconds).
pub fn world<R: Send>(
    n: usize,
    backend: BackendKind,
    f: impl Fn(Communicator) -> R + Sync,
) -> Vec<R> {
    let server = StoreServer::bind("127.0.0.1:0", ServerOptions::default()).expect("a store");
    let addr = server.local_addr().to_string();
    let run = format!(
        "ttests-{}-{}",
        std::process::id(),
        WORLDS.fetch_add(1, Ordering::SeqCst)
    );
    let out = std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|rank| {
                let (addr, run, f) = (addr.clone(), run.clone(), &f);
                std::thread::Builder::new()
                    .name(format!("rank {rank}"))
                    .spawn_scoped(s, move || {
                        let store = StoreClient::connect(&addr, ClientOptions::default())
                            .expect("the store")
                            .with_prefix(&format!("{run}/"));
                        let options = CommOptions {
                            timeout: TIMEOUT,
                            backend,
                            // (One host: shared memory between the threads.)
                            host_id: Some(run.clone()),
                            debug: false,
                            run_id: run.clone(),
                            shm_half: None,
                        };
                        let comm = Communicator::init(rank, n, store, options)
                            .unwrap_or_else(|e| panic!("rank {rank}: communicator: {e}"));
                        f(comm)
                    })
                    .expect("a rank's thread")
            })
            .collect();
        let results: Vec<_> = handles.into_iter().map(|h| h.join()).collect();
        results
            .into_iter()
            .enumerate()
            .map(|(rank, r)| r.unwrap_or_else(|_| panic!("rank {rank} panicked")))
            .collect()
    });
    drop(server);
    out
}

/// What the data dimension runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Over {
    /// Data parallelism (`DataParallel`).
    Ddp,
    /// ZeRO-1 (`Zero`).
    Zero1,
    /// ZeRO-2 (`Zero3::stage_2`).
    Zero2,
    /// ZeRO-3 (`Zero3`), freeing gathered blocks after the forward pass
    /// or keeping them for the backward.
    Zero3 { reshard_after_forward: bool },
}

/// A run over a mesh: data (outermost) × pipeline × tensor ranks.
#[derive(Debug, Clone, Copy)]
pub struct Spec {
    pub data: usize,
    pub pipe: usize,
    pub tensor: usize,
    /// Sequence parallelism in the tensor groups.
    pub sequence: bool,
    pub over: Over,
    /// Hybrid sharding: ZeRO's shard groups of this many data ranks.
    pub shard_group: Option<usize>,
    /// Rows per micro-batch of a data replica (a pipeline's whole step).
    pub rows: usize,
    /// Micro-batches per step (gradient accumulation; 1 under a pipeline).
    pub accum: usize,
    /// A pipeline's schedule and its micro-batches (which split `rows`).
    pub schedule: &'static str,
    pub micro: usize,
    /// Activation checkpointing in the engine (recomputed in the
    /// backward pass).
    pub checkpointing: bool,
    /// The communicators' backend (TCP unless a test says).
    pub backend: BackendKind,
}

impl Spec {
    /// Data parallelism (`over`) over `data` ranks, `rows` each.
    pub fn data(data: usize, over: Over, rows: usize) -> Spec {
        Spec {
            data,
            pipe: 1,
            tensor: 1,
            sequence: false,
            over,
            shard_group: None,
            rows,
            accum: 1,
            schedule: "1f1b",
            micro: 1,
            checkpointing: false,
            backend: BackendKind::Tcp,
        }
    }

    pub fn ranks(&self) -> usize {
        self.data * self.pipe * self.tensor
    }

    /// Rows of the one-process run that sees the same global batch.
    pub fn global_rows(&self) -> usize {
        self.data * self.rows * self.accum
    }

    fn sharded(&self) -> bool {
        self.over != Over::Ddp
    }

    /// How many ranks hold the whole model after the run: under ZeRO-3
    /// the data dimension's first rank (it gathers the shards back), else
    /// every data rank; of those, every rank of a tensor group (the
    /// shares are put together on all), and a pipeline's first rank
    /// (the stages are sent to it).
    pub fn holders(&self) -> usize {
        let data = match self.over {
            Over::Zero3 { .. } => 1,
            _ => self.data,
        };
        data * self.tensor
    }
}

/// The run's strategy as `braid train` assembles it
/// ([`braid_train::assemble::strategy`]): over the data group `data`
/// (none: one replica) as `spec.over` says, hybrid sharding's groups from
/// `mesh`, wrapped for the tensor groups where `tensor` says; buckets
/// small enough that several overlap the backward pass.
fn strategy_of<E>(
    spec: &Spec,
    data: Option<HostCollective>,
    mesh: &Mesh,
    tensor: Option<TensorSide>,
) -> Box<dyn Strategy<E>>
where
    E: DataStrategy<HostCollective>,
{
    let (stage, keep_params) = match spec.over {
        Over::Ddp => (None, false),
        Over::Zero1 => (Some(1), false),
        Over::Zero2 => (Some(2), false),
        Over::Zero3 {
            reshard_after_forward,
        } => (Some(3), !reshard_after_forward),
    };
    let choice = ShardChoice {
        stage,
        keep_params,
        saved_in_grads: false,
        half_gathers: true,
        final_gather: true,
        split_reduce: false,
        kept_spares: None,
    };
    let ddp = DdpOptions {
        bucket_cap_mb: 0.02,
        first_bucket_mb: 0.01,
        ..DdpOptions::default()
    };
    strategy(data, mesh, tensor, choice, ddp).unwrap_or_else(|e| panic!("the strategy: {e}"))
}

/// A tensor group's model collectives.
fn tensor_group(t: &HostCollective) -> Arc<HostTensorGroup> {
    Arc::new(HostTensorGroup::new(t.host().clone()))
}

/// Runs `spec` on its ranks (threads) and returns every rank's outcome.
pub fn run(spec: Spec) -> Vec<Trained> {
    assert!(
        spec.pipe == 1 || spec.accum == 1,
        "a pipeline's step is its micro-batches"
    );
    world(spec.ranks(), spec.backend, |comm| rank(&spec, comm))
}

/// One rank of `spec`.
fn rank(spec: &Spec, comm: Communicator) -> Trained {
    let cfg = config();
    let rank = comm.rank();
    let degrees = Degrees {
        tensor: spec.tensor,
        pipe: spec.pipe,
        shard_group: spec.shard_group,
    };
    let mesh = Mesh::training(spec.ranks(), rank, degrees).expect("the mesh");
    let all = HostCollective::new(comm.clone());
    let split = |name| mesh.split(&all, name).expect("a mesh group");
    // Every rank splits the same dimensions in the same order.
    let pipe = (spec.pipe > 1).then(|| split("pipe"));
    let tensor = (spec.tensor > 1).then(|| split("tensor"));
    let data = split("data");
    let data_rank = mesh.coord("data");
    // ZeRO's blocks split into equal, aligned slices over a shard group.
    let multiple = match spec.sharded() {
        true => 64 * spec.shard_group.unwrap_or(spec.data),
        false => 1,
    };
    let shard = TensorShard {
        rank: mesh.coord("tensor"),
        size: spec.tensor,
    };
    let whole_share = init(Layout::tensor_parallel(&cfg, shard, multiple).expect("a share"));
    let groups = tensor.as_ref().map(tensor_group);
    let make = |params: Params, rows: usize| match &groups {
        None => CpuGpt::new(params, rows, SEQ, spec.checkpointing, OPTIMIZER),
        Some(g) => CpuGpt::tensor_parallel(
            params,
            rows,
            SEQ,
            spec.checkpointing,
            OPTIMIZER,
            g.clone(),
            spec.sequence,
        )
        .expect("a tensor-parallel share"),
    };
    let (run, share) = match pipe {
        None => {
            let mut engine = make(whole_share, spec.rows);
            let tensor = groups.as_ref().map(|g| TensorSide {
                world: comm.clone(),
                tensor: spec.tensor,
                sequence: spec.sequence,
                mesh: mesh.describe(),
                traffic: g.traffic(),
            });
            let mut s: Box<dyn Strategy<CpuGpt>> = strategy_of(spec, Some(data), &mesh, tensor);
            let run = train_rank(
                &mut engine,
                &mut *s,
                spec.rows,
                spec.accum,
                data_rank,
                spec.data,
            );
            drop(s);
            let params = engine.into_params();
            // (ZeRO-3 gathers the whole model on its first rank only.)
            (run, (!params.data.is_empty()).then_some(params))
        }
        Some(pipe) => {
            let pipe = pipe.host().clone();
            let kind = ScheduleKind::parse(spec.schedule).expect("a schedule");
            let schedule = kind.build(spec.pipe, spec.micro).expect("the schedule");
            let schedule = Checked::new(schedule).expect("a schedule that passes its checks");
            let head = head_cost(cfg.n_embd, cfg.vocab_size, cfg.context);
            let stages = assign(cfg.n_layer, schedule.stages(), None, head).expect("stages");
            let layouts: Vec<Arc<Layout>> = (0..spec.pipe)
                .map(|r| {
                    let mine = schedule.stages_of(r).into_iter().map(|i| stages[i].clone());
                    Arc::new(
                        whole_share
                            .layout
                            .pipeline_stages(mine.collect())
                            .expect("a stage layout"),
                    )
                })
                .collect();
            let me = pipe.rank();
            let part = cut(&whole_share, layouts[me].clone());
            let mine = schedule
                .stages_of(me)
                .into_iter()
                .map(|i| (i, stages[i].clone()))
                .collect();
            let micro_rows = spec.rows / spec.micro;
            let inner = make(part, micro_rows);
            let mut engine = CpuStage::new(
                inner,
                mine,
                schedule,
                pipe.clone(),
                micro_rows,
                SEQ,
                spec.checkpointing,
            )
            .expect("a pipeline stage");
            let data = match spec.data {
                1 => {
                    engine = engine.owning_grads();
                    None
                }
                _ => Some(data),
            };
            let mut s: Box<dyn Strategy<CpuStage>> = strategy_of(spec, data, &mesh, None);
            let run = train_rank(&mut engine, &mut *s, spec.rows, 1, data_rank, spec.data);
            drop(s);
            let mine = engine.into_params();
            // (Under ZeRO-3 the data dimension's first ranks hold their
            // stages whole: every rank of their pipeline, or none.)
            let whole = match mine.data.is_empty() {
                true => None,
                false => braid_train::pipeline::gather::gather_whole(
                    &mine,
                    whole_share.layout.clone(),
                    &layouts,
                    &pipe,
                )
                .expect("the stages gathered"),
            };
            (run, whole)
        }
    };
    // A tensor group's shares put together (every rank of the group
    // holds its share here, or none does).
    let whole = match (share, &groups) {
        (Some(p), Some(g)) => {
            Some(braid_train::tensor_parallel::gather_whole(&p, &**g).expect("the shares"))
        }
        (p, _) => p,
    };
    trained(&run, whole)
}

/// The part of `whole` (a whole model's parameters, or a tensor rank's
/// share of it) that `layout`, a pipeline rank's stages cut from its
/// layout, holds: each block copied to its place (what `braid train`'s
/// `train_pipeline::part` does; the binary's is private).
fn cut(whole: &Params, layout: Arc<Layout>) -> Params {
    let mut data = vec![0.0f32; layout.len];
    for (block, range) in &layout.blocks {
        data[range.clone()].copy_from_slice(&whole.data[whole.layout.block_range(*block)]);
    }
    Params { layout, data }
}

/// How far two models are apart: the largest |a - b| over every tensor
/// (by name; the layouts may differ in padding), the tensor where it is,
/// and the Euclidean norm of the whole difference.
pub struct Diff {
    pub max: f32,
    pub at: String,
    pub l2: f64,
}

pub fn diff(a: &Params, b: &Params) -> Diff {
    let mut d = Diff {
        max: 0.0,
        at: String::new(),
        l2: 0.0,
    };
    for p in &Layout::new(&config()).params {
        let (x, y) = (a.view(&p.name), b.view(&p.name));
        assert_eq!(x.len(), y.len(), "{}: lengths differ", p.name);
        for (u, v) in x.iter().zip(y) {
            // (A NaN anywhere counts as infinitely far.)
            let e = match (u - v).abs() {
                e if e.is_nan() => f32::INFINITY,
                e => e,
            };
            d.l2 += (e as f64) * (e as f64);
            if e > d.max {
                (d.max, d.at) = (e, p.name.clone());
            }
        }
    }
    d.l2 = d.l2.sqrt();
    d
}

/// Checks `got` (every rank's outcome of one run) against the reference:
/// the whole model within [`PARAM_TOL`] element by element and within
/// [`PARAM_L2_TOL`] of the reference's movement as a whole, on every
/// rank that holds it (at least one does); every rank's loss and gradient
/// norm at every step within [`STEP_TOL`] relative; and the reference
/// moved far enough from the initialisation for all this to mean
/// something.
pub fn assert_matches(name: &str, got: &[Trained], want: &Trained) {
    let reference = want.whole.as_ref().expect("the reference's parameters");
    let moved = diff(reference, &init(Layout::new(&config())));
    assert!(
        moved.max >= MOVED_AT_LEAST,
        "{name}: the one-process run moved the parameters by {} at most ({}): too little for \
         a tolerance of {PARAM_TOL}",
        moved.max,
        moved.at
    );
    assert_eq!(want.losses.len(), STEPS);
    let rel = |a: f64, b: f64| (a - b).abs() / b.abs().max(1e-12);
    let (mut held, mut worst, mut worst_step) = (0, 0.0f64, 0.0f64);
    for (rank, t) in got.iter().enumerate() {
        assert_eq!(t.losses.len(), STEPS, "{name}: rank {rank}'s steps");
        for (step, ((l, w), (g, v))) in t
            .losses
            .iter()
            .zip(&want.losses)
            .zip(t.norms.iter().zip(&want.norms))
            .enumerate()
        {
            let (dl, dg) = (rel(*l as f64, *w as f64), rel(*g, *v));
            worst_step = worst_step.max(dl).max(dg);
            assert!(
                dl <= STEP_TOL,
                "{name}: rank {rank}, step {step}: loss {l} against one process's {w}"
            );
            assert!(
                dg <= STEP_TOL,
                "{name}: rank {rank}, step {step}: gradient norm {g} against one process's {v}"
            );
        }
        if let Some(p) = &t.whole {
            held += 1;
            let d = diff(p, reference);
            let l2 = d.l2 / moved.l2;
            worst = worst.max(l2);
            assert!(
                d.max <= PARAM_TOL && l2 <= PARAM_L2_TOL,
                "{name}: rank {rank}'s parameters differ from one process's by up to {} (in {}; \
                 tolerance {PARAM_TOL}), by {l2:.2e} of the run's movement as a whole \
                 (tolerance {PARAM_L2_TOL:e})",
                d.max,
                d.at
            );
        }
    }
    assert!(held > 0, "{name}: no rank holds the whole model");
    // (Shown with --nocapture: the margins under the tolerances.)
    eprintln!(
        "{name}: parameters within {worst:.2e} of the movement, steps within {worst_step:.2e}; \
         {held} of {} ranks hold the whole model",
        got.len()
    );
}

/// Runs `spec` and checks it against one process on the same global
/// batch.
pub fn check(name: &str, spec: Spec) {
    let want = single(spec.global_rows(), 1);
    let got = run(spec);
    assert_eq!(got.len(), spec.ranks());
    let held = got.iter().filter(|t| t.whole.is_some()).count();
    assert_eq!(
        held,
        spec.holders(),
        "{name}: ranks holding the whole model after the run"
    );
    assert_matches(name, &got, &want);
}
