//! Capacity planning: the bytes each link of a layout carries in a step,
//! as one GPU sends them, and the bandwidth it needs for that traffic to
//! stay hidden under the computation it overlaps ([`capacity`]) — the
//! course's "bandwidth requirements", from the same volumes the cost
//! model times.
//!
//! - The data dimension's reduction (and ZeRO-3's gathers) overlaps the
//!   backward pass (and, for the gathers, the forward): it is hidden when
//!   the link moves it within that window. Hybrid sharding's two rows
//!   (the shard group's, the sum across the groups) are each set against
//!   the whole window, though they share it: their times add.
//! - A pipeline's sends overlap the next micro-batch's pass on the stage.
//! - The tensor group's all-reduces sit inside the passes, on the
//!   critical path: no window hides them, so the bandwidth given is the
//!   one that keeps them to a tenth of the computation.

use super::cost::{
    data_collectives, data_window, link_for, pipeline_send, tensor_all_reduce, Layout, Prediction,
    Workload,
};
use super::hardware::Hardware;
use serde::Serialize;

/// The tensor group's traffic is held to this share of the computation.
pub const TENSOR_SHARE: f64 = 0.1;

/// One mesh dimension's traffic in a step.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LinkLoad {
    /// `tensor`, `pipe` or `data`.
    pub dimension: &'static str,
    /// Ranks in its groups.
    pub ranks: usize,
    /// Whether its groups span nodes (the inter-node link) or not.
    pub across_nodes: bool,
    /// The link's bus bandwidth, GB/s.
    pub link_gbps: f64,
    /// Bytes one GPU sends on it per step.
    pub wire_bytes: f64,
    /// Seconds that traffic takes on the link (the cost model's).
    pub seconds: f64,
    /// The computation it can hide under, seconds (the tensor group's:
    /// a tenth of the step's computation, which it adds to).
    pub window_s: f64,
    /// The bandwidth that keeps it within that window, GB/s.
    pub needed_gbps: f64,
    /// Whether the link as described is fast enough.
    pub enough: bool,
}

/// Every dimension of `l` with more than one rank: its traffic per step
/// and the bandwidth it needs (`p`: `l`'s prediction on `hw`).
pub fn capacity(w: &Workload, l: &Layout, hw: &Hardware, p: &Prediction) -> Vec<LinkLoad> {
    let ring = |n: usize| 2.0 * (n as f64 - 1.0) / n as f64;
    let layers = (w.layers as f64 / l.pp as f64).ceil();
    let m = l.micro_batches as f64;
    let mut out = Vec::new();
    let mut push = |dimension, ranks, span: usize, wire_bytes: f64, seconds, window_s: f64| {
        let link = link_for(hw, span);
        let needed_gbps = wire_bytes / window_s.max(1e-12) / 1e9;
        out.push(LinkLoad {
            dimension,
            ranks,
            across_nodes: span > hw.gpus_per_node,
            link_gbps: link.busbw_gbps,
            wire_bytes,
            seconds,
            window_s,
            needed_gbps,
            enough: needed_gbps <= link.busbw_gbps,
        });
    };
    if l.tp > 1 {
        let (payload, per_layer) = tensor_all_reduce(w, l);
        let wire = ring(l.tp) * payload * per_layer * layers * m;
        push(
            "tensor",
            l.tp,
            l.tp,
            wire,
            p.tensor_comm_s,
            TENSOR_SHARE * p.compute_s,
        );
    }
    if l.pp > 1 {
        let v = l.schedule.map_or(1, |k| k.virtual_stages().max(1)) as f64;
        // Each micro-batch's activation forward and gradient back, at
        // each of the rank's stages.
        let sends = 2.0 * m * v;
        let payload = pipeline_send(w, l);
        let link = link_for(hw, l.tp * l.pp);
        push(
            "pipe",
            l.pp,
            l.tp * l.pp,
            sends * payload,
            sends * link.send_s(payload),
            // Each send hides under the next pass of a micro-batch.
            sends * p.forward_s / v,
        );
    }
    // The data dimension's collectives, by the groups they run over (a
    // hybrid layout's shard group and its replicas apart).
    let window = data_window(l, p.forward_s, p.backward_s);
    let collectives = data_collectives(w, l);
    for dimension in ["data", "replicas"] {
        let those: Vec<_> = collectives
            .iter()
            .filter(|c| c.dimension == dimension)
            .collect();
        if let Some(first) = those.first() {
            let wire = those.iter().map(|c| c.wire_bytes()).sum();
            let seconds = those.iter().map(|c| c.seconds(hw)).sum();
            push(dimension, first.ranks, first.span, wire, seconds, window);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::predict;
    use crate::plan::testing::{gpt, plain};

    fn gpt2_1558m(global_batch: usize) -> Workload {
        gpt(48, 25, 1600, global_batch)
    }

    fn layout(dp: usize, tp: usize, pp: usize, zero: u8, b: usize, m: usize) -> Layout {
        Layout {
            zero,
            schedule: (pp > 1).then_some(crate::schedule::build::ScheduleKind::OneFOneB),
            ..plain(dp, tp, pp, b, m)
        }
    }

    /// The data dimension's bytes are the ring's: 2 (n-1)/n of the f32
    /// gradients, plus ZeRO-3's two gathers of the bf16 parameters; the
    /// time is the cost model's, so the two cannot disagree.
    #[test]
    fn data_parallel_traffic_is_the_rings_and_the_models() {
        let hw = Hardware::builtin("h100").unwrap();
        let w = gpt2_1558m(32);
        for zero in [0, 3] {
            let l = layout(4, 1, 1, zero, 8, 1);
            let p = predict(&w, &l, &hw).unwrap();
            let c = capacity(&w, &l, &hw, &p);
            assert_eq!(c.len(), 1);
            let d = c[0];
            let mut want = 1.5 * 4.0 * w.params();
            if zero == 3 {
                want += 2.0 * 0.75 * 2.0 * w.params();
            }
            assert!((d.wire_bytes / want - 1.0).abs() < 1e-12, "{d:?}");
            assert_eq!((d.dimension, d.ranks, d.across_nodes), ("data", 4, false));
            assert_eq!(d.seconds, p.data_comm_s);
            assert!(d.needed_gbps > 0.0 && d.needed_gbps.is_finite());
        }
    }

    /// Across nodes the data dimension needs the inter-node link, and a
    /// slow one is said to be not enough; inside a node NVLink is.
    #[test]
    fn a_slow_inter_node_link_is_said_to_be_short() {
        let mut hw = Hardware::builtin("h100").unwrap();
        let w = gpt2_1558m(64);
        let l = layout(16, 1, 1, 0, 4, 1);
        hw.inter.busbw_gbps = 1.0;
        let p = predict(&w, &l, &hw).unwrap();
        let d = capacity(&w, &l, &hw, &p)[0];
        assert!(d.across_nodes && !d.enough, "{d:?}");
        let l = layout(4, 1, 1, 0, 16, 1);
        let p = predict(&w, &l, &hw).unwrap();
        let d = capacity(&w, &l, &hw, &p)[0];
        assert!(!d.across_nodes && d.enough, "{d:?}");
    }

    /// Each dimension of a 3-D layout is listed; the tensor group's bytes
    /// are its all-reduces' (four per layer per micro-batch, ring
    /// volume), the pipe's two sends per micro-batch of the activation
    /// split over the tensor group.
    #[test]
    fn a_3d_layout_lists_every_dimension() {
        let hw = Hardware::builtin("h100").unwrap();
        // (32 heads of 50: the tensor group of 2 splits them.)
        let w = Workload {
            heads: 32,
            ..gpt2_1558m(32)
        };
        let l = layout(2, 2, 2, 0, 4, 4);
        let p = predict(&w, &l, &hw).unwrap();
        let c = capacity(&w, &l, &hw, &p);
        let dims: Vec<&str> = c.iter().map(|d| d.dimension).collect();
        assert_eq!(dims, ["tensor", "pipe", "data"]);
        let act = 2.0 * 4.0 * 1024.0 * 1600.0;
        let tensor = 1.0 * act * 4.0 * 24.0 * 4.0;
        assert!((c[0].wire_bytes / tensor - 1.0).abs() < 1e-12, "{:?}", c[0]);
        let pipe = 2.0 * 4.0 * act / 2.0;
        assert!((c[1].wire_bytes / pipe - 1.0).abs() < 1e-12, "{:?}", c[1]);
    }
}
