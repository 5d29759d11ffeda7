//! A decode step's buffers on the device, grown when a step has more rows
//! than any before.

use crate::block::Act;
use crate::model::Widths;
use braid_core::Element;
use braid_cuda::{Device, DeviceBuffer, Result};
use half::bf16;

/// `buf` made at least `len` elements long (a new zeroed buffer of at
/// least twice its length when it is shorter; contents not kept), and
/// whether it was reallocated.
pub(super) fn fit<T: Element>(buf: &mut DeviceBuffer<T>, len: usize) -> Result<bool> {
    if buf.len() < len {
        let device = buf.device().clone();
        *buf = DeviceBuffer::zeros(&device, len.max(2 * buf.len()))?;
        return Ok(true);
    }
    Ok(false)
}

/// The buffers of a step's rows, each at least as long as the step needs
/// (views of the front are used).
pub(super) struct Scratch {
    /// Rows the row-wide buffers hold.
    pub(super) rows: usize,
    /// The block's tensors by [`Act::index`]: [`Act::X`] and [`Act::Out`]
    /// are the residual stream entering and leaving a layer (swapped
    /// after each).
    pub(super) t: [DeviceBuffer<f32>; 9],
    /// A LayerNorm's row means and reciprocal deviations.
    pub(super) mean: DeviceBuffer<f32>,
    pub(super) rstd: DeviceBuffer<f32>,
    /// The rows wanting logits, gathered, and their final LayerNorm.
    pub(super) head: DeviceBuffer<f32>,
    pub(super) lnf: DeviceBuffer<f32>,
    /// Their logits.
    pub(super) logits: DeviceBuffer<f32>,
    /// The step's indices ([`StepPlan`]).
    pub(super) ints: DeviceBuffer<i32>,
    /// Each logits row's greedy token and its log-probability, on the
    /// device and brought back.
    pub(super) pick_token: DeviceBuffer<i32>,
    pub(super) pick_logprob: DeviceBuffer<f32>,
    pub(super) host_token: Vec<i32>,
    pub(super) host_logprob: Vec<f32>,
    /// In bf16 products: each block tensor a product reads, in bf16 (by
    /// [`Act::index`]; empty in f32), and the final LayerNorm's output.
    pub(super) tb: Vec<DeviceBuffer<bf16>>,
    pub(super) lnf_b: DeviceBuffer<bf16>,
}

impl Scratch {
    /// Buffers for `rows` rows; with `half`, the bf16 copies too.
    pub(super) fn new(device: &Device, w: &Widths, rows: usize, half: bool) -> Result<Scratch> {
        let z = |k: usize| DeviceBuffer::<f32>::zeros(device, k);
        let t = Act::ALL.map(|a| z(rows * a.width(w)));
        let [t0, t1, t2, t3, t4, t5, t6, t7, t8] = t;
        Ok(Scratch {
            rows,
            t: [t0?, t1?, t2?, t3?, t4?, t5?, t6?, t7?, t8?],
            mean: z(rows)?,
            rstd: z(rows)?,
            head: z(rows * w.c)?,
            lnf: z(rows * w.c)?,
            logits: z(w.vocab)?,
            ints: DeviceBuffer::zeros(device, 5 * rows)?,
            pick_token: DeviceBuffer::zeros(device, rows)?,
            pick_logprob: z(rows)?,
            host_token: Vec::new(),
            host_logprob: Vec::new(),
            tb: match half {
                true => Act::ALL
                    .iter()
                    .map(|a| DeviceBuffer::zeros(device, rows * a.width(w)))
                    .collect::<Result<_>>()?,
                false => Vec::new(),
            },
            lnf_b: DeviceBuffer::zeros(device, if half { rows * w.c } else { 1 })?,
        })
    }

    /// Room for `n` rows (at least twice as many as before when it
    /// grows), and whether any buffer was reallocated.
    pub(super) fn grow(&mut self, w: &Widths, n: usize) -> Result<bool> {
        if n <= self.rows {
            return Ok(false);
        }
        let rows = n.max(2 * self.rows);
        for (buf, a) in self.t.iter_mut().zip(Act::ALL) {
            fit(buf, rows * a.width(w))?;
        }
        for buf in [&mut self.mean, &mut self.rstd] {
            fit(buf, rows)?;
        }
        for buf in [&mut self.head, &mut self.lnf] {
            fit(buf, rows * w.c)?;
        }
        for (buf, a) in self.tb.iter_mut().zip(Act::ALL) {
            fit(buf, rows * a.width(w))?;
        }
        if !self.tb.is_empty() {
            fit(&mut self.lnf_b, rows * w.c)?;
        }
        self.rows = rows;
        Ok(true)
    }
}
