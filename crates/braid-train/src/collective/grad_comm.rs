//! [`GradComm`]: how a bucket's gradients travel (DDP's communication
//! hook), and its command-line spelling.

use super::powersgd::PowerSgdOptions;
use crate::Result;

/// How a bucket's gradients travel (DDP's communication hook).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum GradComm {
    /// f32 all-reduce.
    Plain,
    /// Cast to bfloat16, all-reduce, cast back: half the bytes.
    Bf16,
    /// Cast to IEEE half (pre-divided by the number of ranks, against
    /// overflow), all-reduce, cast back: half the bytes.
    Fp16,
    /// PowerSGD low-rank compression of the matrices, with error feedback
    /// and warm start; everything else plain.
    PowerSgd(PowerSgdOptions),
    /// The largest fraction of each bucket's gradients (by magnitude) sent,
    /// the rest kept and added to the next step's (error feedback): a
    /// parameter server's pushes only (an all-reduce sums dense buckets).
    TopK(f32),
}

impl GradComm {
    /// `plain`, `bf16`, `fp16`, `powersgd[:RANK[:START_ITER]]` or
    /// `topk:FRACTION`.
    pub fn parse(s: &str) -> Result<GradComm> {
        let bad = || {
            format!(
                "--grad-comm {s:?}: expected plain, bf16, fp16, powersgd[:RANK[:START_ITER]] \
                 (e.g. powersgd:2:10) or topk:FRACTION (e.g. topk:0.01, with --ps)"
            )
        };
        match s {
            "plain" | "none" | "f32" => return Ok(GradComm::Plain),
            "bf16" => return Ok(GradComm::Bf16),
            "fp16" => return Ok(GradComm::Fp16),
            _ => {}
        }
        if let Some(f) = s.strip_prefix("topk:") {
            return match f.parse::<f32>() {
                Ok(f) if f > 0.0 && f <= 1.0 => Ok(GradComm::TopK(f)),
                _ => Err(format!(
                    "{}: the fraction kept must be above 0 and at most 1",
                    bad()
                )),
            };
        }
        let mut parts = s.split(':');
        if parts.next() != Some("powersgd") {
            return Err(bad());
        }
        let mut o = PowerSgdOptions::default();
        if let Some(r) = parts.next() {
            o.rank = r.parse().map_err(|_| bad())?;
            if o.rank == 0 {
                return Err(format!("{}: the rank must be at least 1", bad()));
            }
        }
        if let Some(k) = parts.next() {
            o.start_iter = k.parse().map_err(|_| bad())?;
        }
        if parts.next().is_some() {
            return Err(bad());
        }
        Ok(GradComm::PowerSgd(o))
    }

    /// The name for messages.
    pub fn name(&self) -> String {
        match self {
            GradComm::Plain => "plain f32".into(),
            GradComm::Bf16 => "bf16".into(),
            GradComm::Fp16 => "fp16".into(),
            GradComm::PowerSgd(o) => format!(
                "PowerSGD rank {} from step {} (error feedback, warm start)",
                o.rank, o.start_iter
            ),
            GradComm::TopK(f) => format!("top-k {f} (error feedback)"),
        }
    }
}
