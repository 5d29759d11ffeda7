//! The update of a ZeRO-3 master shard queued on a stream beside the
//! engine's ([`Engine::update_compact_beside`]), part by part, so that the
//! next forward pass waits for the parts its units read and no more.
//! AdamW is bound by memory bandwidth (about 34 ms a step for a 12.85B
//! model's quarter on an H100) and the forward pass's products by
//! arithmetic: beside each other both go on.
//!
//! The same launches as [`GpuGpt::update_master_shard`] with each range
//! cut where a part ends: AdamW is elementwise, so the bits are the same.

use super::*;
use braid_cuda::Event;

/// One AdamW launch of an update beside the stream: elements of the
/// master shard (and of the gradients and moments, laid out alike), the
/// flat parameters they are, and those parameters' weight-decay segments.
type Launch = (Range<usize>, Range<usize>, AdamSegments);

/// An update that runs beside the engine's stream, and its plan.
pub(super) struct UpdateBeside {
    stream: Stream,
    /// The parts it was planned for (element ranges of the master shard).
    parts: Vec<Vec<Range<usize>>>,
    /// Per part, its launches.
    launches: Vec<Vec<Launch>>,
    /// Recorded on the engine's stream when the update is queued: the
    /// gradients (and the norm that scales them) are ready.
    ready: Event,
    /// Per part: recorded on `stream` once the part is updated.
    done: Vec<Event>,
    /// The first part the engine's stream has not waited for; `None`:
    /// no update in flight.
    unawaited: Option<usize>,
}

impl GpuGpt {
    /// [`Engine::update_compact_beside`] for a ZeRO-3 rank (`params` its
    /// master shard).
    pub(super) fn update_master_beside(
        &mut self,
        params: &mut DeviceBuffer<f32>,
        grads: &DeviceBuffer<f32>,
        step: UpdateStep,
        parts: &[Vec<Range<usize>>],
    ) -> Result<bool> {
        self.in_units("update_compact_beside")?;
        if self.offload.is_some() {
            return Ok(false);
        }
        self.check_compact(params, grads)?;
        // A previous update is through before this one starts.
        self.await_beside(None)?;
        if self.beside.as_ref().is_none_or(|b| b.parts != parts) {
            let planned = self.plan_beside(parts)?;
            self.beside = Some(planned);
        }
        self.moments_ready()?;
        let h = self.adam_step(step);
        let Some(b) = self.beside.as_ref() else {
            unreachable!("planned above");
        };
        b.ready.record(self.compute_stream()).map_err(e)?;
        b.stream.wait_event(&b.ready).map_err(e)?;
        for (launches, done) in b.launches.iter().zip(&b.done) {
            for (at, r, segs) in launches {
                let mut p = params.view_mut(at.clone());
                let g = grads.view(at.clone());
                let mut m = self.m.view_mut(at.clone());
                let mut v = self.v.view_mut(at.clone());
                let views = (&mut p, &g, &mut m, &mut v);
                adamw_launch(
                    &self.mk,
                    &mut self.model,
                    Some(&b.stream),
                    views,
                    r,
                    segs,
                    h,
                )?;
            }
            done.record(&b.stream).map_err(e)?;
        }
        if let Some(b) = self.beside.as_mut() {
            b.unawaited = Some(0);
        }
        self.updates += 1;
        Ok(true)
    }

    /// [`Engine::await_update`]: the engine's stream waits for parts
    /// `..=part` (all: `None`) of the update in flight, if any.
    pub(super) fn await_beside(&mut self, part: Option<usize>) -> Result<()> {
        let Some(b) = self.beside.as_ref() else {
            return Ok(());
        };
        let (Some(from), Some(last)) = (b.unawaited, b.done.len().checked_sub(1)) else {
            return Ok(());
        };
        let upto = part.map_or(last, |p| p.min(last));
        if upto < from {
            return Ok(());
        }
        self.compute_stream().wait_event(&b.done[upto]).map_err(e)?;
        if let Some(b) = self.beside.as_mut() {
            b.unawaited = (upto < last).then_some(upto + 1);
        }
        Ok(())
    }

    /// The launches of `parts`: each range cut where the optimizer's
    /// ranges end, with its parameters' weight-decay segments (made once
    /// per plan: the parts stay the same from step to step).
    fn plan_beside(&self, parts: &[Vec<Range<usize>>]) -> Result<UpdateBeside> {
        let device = self.p.device().clone();
        let len = self.state_len();
        let mut seen = 0;
        let mut launches = Vec::with_capacity(parts.len());
        for part in parts {
            let mut these = Vec::new();
            for want in part {
                if want.end > len {
                    return Err(format!(
                        "update beside: elements {want:?} of a master shard of {len}"
                    ));
                }
                seen += want.len();
                for (r, at, _) in &self.shard {
                    let (lo, hi) = (want.start.max(*at), want.end.min(at + r.len()));
                    if lo >= hi {
                        continue;
                    }
                    let flat = r.start + (lo - at)..r.start + (hi - at);
                    let segs = AdamSegments::shard(
                        &device,
                        &self.layout,
                        self.adam.weight_decay,
                        flat.clone(),
                    )
                    .map_err(e)?;
                    these.push((lo..hi, flat, segs));
                }
            }
            launches.push(these);
        }
        if seen != len {
            return Err(format!(
                "update beside: parts of {seen} elements for a master shard of {len} (each \
                 element once)"
            ));
        }
        Ok(UpdateBeside {
            stream: Stream::new(&device).map_err(e)?,
            parts: parts.to_vec(),
            launches,
            ready: Event::new(&device).map_err(e)?,
            done: (0..parts.len())
                .map(|_| Event::new(&device).map_err(e))
                .collect::<Result<_>>()?,
            unawaited: None,
        })
    }
}
