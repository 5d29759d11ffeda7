//! How a run's updates relate to its workers' steps: synchronous,
//! asynchronous or bounded staleness ([`Mode`]), and where the optimizer
//! runs ([`UpdateAt`]).

use std::fmt;

/// When a server applies gradients and when a worker may go on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Each step's update is made from every worker's gradients of that
    /// step (data parallelism through servers).
    Sync,
    /// A server applies each worker's push as it comes; nobody waits.
    Async,
    /// Bounded staleness: as asynchronous, but a worker may run at most
    /// this many steps ahead of the slowest live worker.
    Ssp(u64),
}

impl Mode {
    /// `sync`, `async` or `ssp:S`.
    pub fn parse(s: &str) -> Result<Mode, String> {
        match s {
            "sync" => Ok(Mode::Sync),
            "async" => Ok(Mode::Async),
            _ => match s.strip_prefix("ssp:").map(str::parse::<u64>) {
                Some(Ok(bound)) => Ok(Mode::Ssp(bound)),
                _ => Err(format!(
                    "--ps-mode {s:?}: expected sync, async or ssp:S (S, a whole number of steps a \
                     worker may run ahead of the slowest, e.g. ssp:2)"
                )),
            },
        }
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Mode::Sync => write!(f, "sync"),
            Mode::Async => write!(f, "async"),
            Mode::Ssp(s) => write!(f, "ssp:{s}"),
        }
    }
}

/// What asynchronous updates change in the optimizer: a push lands after
/// about W − 1 other workers' updates, and that staleness acts as momentum
/// of its own (Mitliagkas et al. 2016, "Asynchrony begets momentum"), on
/// top of the optimizer's. So asynchronous and bounded-staleness runs
/// lower the optimizer's momentum (AdamW's β₁, SGD's momentum) by the
/// asynchrony's, 1 − 1/W, and scale the learning rate by min(1, 2/W);
/// synchronous runs (and one worker) keep both.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Compensation {
    /// The optimizer's momentum to use.
    pub momentum: f32,
    /// The factor on each update's learning rate.
    pub lr_scale: f32,
}

impl Mode {
    /// The compensation for `workers` workers of an optimizer whose
    /// momentum is `momentum`.
    pub fn compensation(self, workers: usize, momentum: f32) -> Compensation {
        let w = workers.max(1) as f32;
        match self {
            Mode::Sync => Compensation {
                momentum,
                lr_scale: 1.0,
            },
            Mode::Async | Mode::Ssp(_) => Compensation {
                momentum: (momentum - (1.0 - 1.0 / w)).max(0.0),
                lr_scale: (2.0 / w).min(1.0),
            },
        }
    }
}

/// Compensation that follows the staleness the pushes actually have. A
/// server keeps moving averages of its pushes' staleness τ̄ and of their
/// *spread* staleness σ̄ — the updates between a worker's read and its
/// push that were not computed from the same read (a gate that releases
/// workers together makes bursts of pushes from one version: their
/// staleness counts one another, but they hold the same information, as a
/// synchronous step's gradients do). It updates with the momentum lowered
/// by the implicit momentum of the spread staleness, σ̄ / (1 + σ̄) (1 − 1/W
/// for asynchronous training, whose σ̄ ≈ W − 1), and the learning rate
/// scaled by min(1, 2 / (1 + τ̄)). Measured on the 2-core machine (100
/// steps, eval at step 50): 2 workers in lockstep (`ssp:0`) 2.77 with the
/// asynchronous cut, 1.68 without; 4 in lockstep 2.85 with a cut by τ̄,
/// 2.00 without, sync 1.77.
#[derive(Debug, Clone, PartialEq)]
pub struct Adaptive {
    /// The optimizer's own momentum.
    base: f32,
    /// The moving averages of the staleness and of its spread part.
    mean: f64,
    spread: f64,
}

/// The moving averages' weight on each new push.
const STALENESS_WEIGHT: f64 = 0.05;

impl Adaptive {
    /// Starting from `prior`, the staleness expected before any push
    /// (all of it spread).
    pub fn new(base_momentum: f32, prior: f64) -> Adaptive {
        Adaptive {
            base: base_momentum,
            mean: prior.max(0.0),
            spread: prior.max(0.0),
        }
    }

    /// Takes one push into the averages — its staleness, and how many of
    /// the updates it counts were computed from the same read as it
    /// (`siblings`) — and returns the compensation to update with.
    pub fn record(&mut self, staleness: u64, siblings: u64) -> Compensation {
        let spread = staleness.saturating_sub(siblings) as f64;
        self.mean += STALENESS_WEIGHT * (staleness as f64 - self.mean);
        self.spread += STALENESS_WEIGHT * (spread - self.spread);
        self.now()
    }

    /// The compensation at the present averages.
    pub fn now(&self) -> Compensation {
        let (t, s) = (self.mean, self.spread);
        Compensation {
            momentum: (self.base - (s / (1.0 + s)) as f32).max(0.0),
            lr_scale: ((2.0 / (1.0 + t)) as f32).min(1.0),
        }
    }

    /// The staleness's moving average.
    pub fn mean(&self) -> f64 {
        self.mean
    }
}

impl Mode {
    /// The servers' compensation for `workers` workers of an optimizer
    /// with momentum `base`: none in synchronous training; otherwise
    /// following the measured staleness, from the most the mode allows
    /// (W − 1, at most S under `ssp:S`).
    pub fn adaptive(self, workers: usize, base: f32) -> Option<Adaptive> {
        let most = workers.saturating_sub(1) as f64;
        match self {
            Mode::Sync => None,
            Mode::Async => Some(Adaptive::new(base, most)),
            Mode::Ssp(s) => Some(Adaptive::new(base, most.min(s as f64))),
        }
    }
}

/// Where the optimizer step runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpdateAt {
    /// Servers own their shard's optimizer state and update it; workers
    /// pull parameters (ps-lite, TensorFlow's ParameterServerStrategy).
    Server,
    /// Servers only sum; every worker pulls the sum and updates its own
    /// copy (BytePS's summation service).
    Worker,
}

impl UpdateAt {
    /// `server` or `worker`.
    pub fn parse(s: &str) -> Result<UpdateAt, String> {
        match s {
            "server" => Ok(UpdateAt::Server),
            "worker" => Ok(UpdateAt::Worker),
            _ => Err(format!(
                "--ps-update {s:?}: expected server (servers own the optimizer) or worker (servers \
                 only sum, as BytePS does)"
            )),
        }
    }
}

impl fmt::Display for UpdateAt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            UpdateAt::Server => write!(f, "server"),
            UpdateAt::Worker => write!(f, "worker"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_parse_and_print_back() {
        for s in ["sync", "async", "ssp:0", "ssp:4"] {
            assert_eq!(Mode::parse(s).unwrap().to_string(), s);
        }
        assert!(Mode::parse("ssp:x").unwrap_err().contains("ssp:S"));
        assert!(Mode::parse("bsp").is_err());
        assert_eq!(UpdateAt::parse("worker").unwrap(), UpdateAt::Worker);
        assert!(UpdateAt::parse("gpu").unwrap_err().contains("BytePS"));
    }

    /// The staleness-following compensation gives asynchronous
    /// training's static one at τ̄ = W − 1, none at τ̄ = 0, and follows the
    /// pushes: a run whose gate holds its workers in step drifts back
    /// towards the optimizer's own momentum.
    #[test]
    fn the_compensation_follows_the_measured_staleness() {
        let a = Mode::Async.adaptive(4, 0.9).unwrap();
        assert_eq!(a.now(), Mode::Async.compensation(4, 0.9));
        assert!(Mode::Sync.adaptive(4, 0.9).is_none());
        let mut s = Mode::Ssp(2).adaptive(4, 0.9).unwrap();
        assert!((s.mean() - 2.0).abs() < 1e-12);
        for _ in 0..400 {
            s.record(0, 0);
        }
        let c = s.now();
        assert!(s.mean() < 1e-6 && (c.momentum - 0.9).abs() < 1e-5 && c.lr_scale == 1.0);
        let mut half = Adaptive::new(0.9, 0.0);
        for i in 0..2000u64 {
            half.record(i % 2, 0);
        }
        let c = half.now();
        assert!((half.mean() - 0.5).abs() < 0.03, "{}", half.mean());
        assert!((c.momentum - (0.9 - 1.0 / 3.0)).abs() < 0.02, "{c:?}");
        // Bursts of 4 pushes from one read: staleness 0, 1, 2, 3, none of
        // it spread — the learning rate follows it, the momentum stays.
        let mut burst = Adaptive::new(0.9, 0.0);
        for i in 0..2000u64 {
            burst.record(i % 4, i % 4);
        }
        let c = burst.now();
        assert!((burst.mean() - 1.5).abs() < 0.1, "{}", burst.mean());
        assert!(
            (c.momentum - 0.9).abs() < 1e-6 && (c.lr_scale - 0.8).abs() < 0.03,
            "{c:?}"
        );
    }

    #[test]
    fn asynchrony_lowers_the_momentum_by_its_own() {
        let c = |m: Mode, w| m.compensation(w, 0.9);
        assert_eq!(
            c(Mode::Sync, 8),
            Compensation {
                momentum: 0.9,
                lr_scale: 1.0
            }
        );
        // One worker: nothing stale, nothing changed.
        assert_eq!(
            c(Mode::Async, 1),
            Compensation {
                momentum: 0.9,
                lr_scale: 1.0
            }
        );
        let two = c(Mode::Ssp(2), 2);
        assert!((two.momentum - 0.4).abs() < 1e-6 && two.lr_scale == 1.0);
        let four = c(Mode::Async, 4);
        assert!((four.momentum - 0.15).abs() < 1e-6 && four.lr_scale == 0.5);
        assert_eq!(c(Mode::Async, 16).momentum, 0.0);
    }
}
