//! [`StepTrace`]: the training loop's part of a trace — each step, its
//! data waits, forward and backward passes, the wait for reductions and
//! the optimizer, as spans. The passes are taken from the step's
//! [`Timeline`] points, so on a GPU they are timed on the engine's stream
//! (CUDA events) and placed on the host's clock from the step's first
//! point, which is marked on an idle stream. Off (no trace, no metrics),
//! nothing is marked or recorded.

use crate::timeline::Timeline;
use crate::Result;
use braid_cuda::Stream;
use braid_trace::recorder::{self, track, Cat};
use std::time::Instant;

/// One step's spans, collected while it runs.
pub(crate) struct StepTrace {
    on: bool,
    device: bool,
    spans: Vec<(&'static str, Cat, usize, usize, usize)>,
}

fn e(x: impl std::fmt::Display) -> String {
    x.to_string()
}

impl StepTrace {
    /// Starts a step on `stream` (idle: the previous step synchronized).
    pub(crate) fn begin(stream: Option<&Stream>) -> Result<StepTrace> {
        let on = recorder::active();
        if let (true, Some(s)) = (on, stream) {
            braid_trace::device::anchor(s).map_err(e)?;
        }
        Ok(StepTrace {
            on,
            device: stream.is_some(),
            spans: Vec::new(),
        })
    }

    /// Whether the step is traced.
    pub(crate) fn on(&self) -> bool {
        self.on
    }

    /// A point on the timeline (only while tracing).
    pub(crate) fn mark(&self, tl: &mut Timeline, stream: Option<&Stream>) -> Result<usize> {
        if self.on {
            tl.mark(stream)
        } else {
            Ok(0)
        }
    }

    /// The span `name` of micro-batch `micro` from point `a` to `b`.
    pub(crate) fn between(
        &mut self,
        name: &'static str,
        cat: Cat,
        a: usize,
        b: usize,
        micro: usize,
    ) {
        if self.on {
            self.spans.push((name, cat, a, b, micro));
        }
    }

    /// Records the step (`t0` its start, `total` seconds long) and its
    /// spans, once the engine has synchronized; `args` go on the step.
    pub(crate) fn finish(
        self,
        tl: &Timeline,
        step: usize,
        t0: Instant,
        total: f64,
        args: Vec<(&'static str, serde_json::Value)>,
    ) -> Result<()> {
        if !self.on {
            return Ok(());
        }
        let tid = if self.device {
            track::GPU_COMPUTE
        } else {
            track::HOST
        };
        for (name, cat, a, b, micro) in self.spans {
            let (start, end) = (tl.instant(a)?, tl.instant(b)?);
            recorder::record_between(
                name,
                cat,
                tid,
                start,
                end,
                vec![("micro_batch", micro.into())],
            );
        }
        let mut all = vec![
            ("step", serde_json::Value::from(step)),
            ("step_s", total.into()),
        ];
        all.extend(args);
        let end = t0 + std::time::Duration::from_secs_f64(total);
        recorder::record_between(format!("step {step}"), Cat::Step, track::HOST, t0, end, all);
        // The step's own spans have ended (the engine synchronized, its
        // collectives were waited for); anything still running (a
        // prefetch for the next step) is picked up by a later flush.
        braid_trace::device::flush(std::time::Duration::ZERO).map_err(e)?;
        Ok(())
    }
}
