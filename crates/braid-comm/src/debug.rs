//! The consistency check of `BRAID_DEBUG=detail`: before each operation the
//! ranks exchange a small descriptor (operation, count, dtype, reduce op,
//! root, sequence number) and every rank reports any disagreement.

use braid_core::{DType, ReduceOp};

/// What one rank is about to call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpDesc {
    /// Operation code (index into [`OP_NAMES`]).
    pub op: u8,
    /// Element count (per rank, as passed by the caller).
    pub count: u64,
    /// dtype code, or 255 when the operation has no dtype.
    pub dtype: u8,
    /// Reduce-op code, or 255.
    pub redop: u8,
    /// Root or peer rank, or u32::MAX.
    pub root: u32,
    /// Sequence number on the communicator.
    pub seq: u64,
}

/// Names of the operations, indexed by [`OpDesc::op`].
pub const OP_NAMES: [&str; 13] = [
    "all_reduce",
    "reduce",
    "broadcast",
    "all_gather",
    "all_gather_v",
    "reduce_scatter",
    "all_to_all",
    "all_to_all_v",
    "gather",
    "scatter",
    "send",
    "recv",
    "barrier",
];

/// Size of an encoded descriptor.
pub const DESC_LEN: usize = 24;

impl OpDesc {
    /// Builds a descriptor.
    pub fn new(
        op: &str,
        count: usize,
        dtype: Option<DType>,
        redop: Option<ReduceOp>,
        root: Option<usize>,
        seq: u64,
    ) -> OpDesc {
        OpDesc {
            op: OP_NAMES.iter().position(|n| *n == op).unwrap_or(255) as u8,
            count: count as u64,
            dtype: dtype.map(|d| d.code()).unwrap_or(255),
            redop: redop.map(|r| r.code()).unwrap_or(255),
            root: root.map(|r| r as u32).unwrap_or(u32::MAX),
            seq,
        }
    }

    /// Fixed-size encoding.
    pub fn encode(&self) -> [u8; DESC_LEN] {
        let mut b = [0u8; DESC_LEN];
        b[0] = self.op;
        b[1] = self.dtype;
        b[2] = self.redop;
        b[4..8].copy_from_slice(&self.root.to_le_bytes());
        b[8..16].copy_from_slice(&self.count.to_le_bytes());
        b[16..24].copy_from_slice(&self.seq.to_le_bytes());
        b
    }

    /// Inverse of [`encode`](Self::encode).
    pub fn decode(b: &[u8]) -> OpDesc {
        OpDesc {
            op: b[0],
            dtype: b[1],
            redop: b[2],
            root: u32::from_le_bytes(b[4..8].try_into().expect("4 bytes")),
            count: u64::from_le_bytes(b[8..16].try_into().expect("8 bytes")),
            seq: u64::from_le_bytes(b[16..24].try_into().expect("8 bytes")),
        }
    }

    /// Human-readable form, e.g. `all_reduce(count=1024, dtype=f32, op=sum)`.
    pub fn describe(&self) -> String {
        let name = OP_NAMES.get(self.op as usize).copied().unwrap_or("unknown");
        let mut parts = vec![format!("count={}", self.count)];
        if let Some(d) = DType::from_code(self.dtype) {
            parts.push(format!("dtype={d}"));
        }
        if let Some(r) = ReduceOp::ALL.get(self.redop as usize) {
            parts.push(format!("op={r}"));
        }
        if self.root != u32::MAX {
            parts.push(format!("root={}", self.root));
        }
        format!("{name}(#{}: {})", self.seq, parts.join(", "))
    }
}

/// Compares every rank's descriptor; `None` when they agree, else a report
/// listing what each rank called. Point-to-point operations are exempt
/// from count and root comparison (they pair up rather than agree).
pub fn compare(descs: &[OpDesc], my_rank: usize) -> Option<String> {
    let first = descs[0];
    let p2p = |d: &OpDesc| matches!(OP_NAMES.get(d.op as usize), Some(&"send") | Some(&"recv"));
    let agree = descs.iter().all(|d| {
        if p2p(d) || p2p(&first) {
            d.seq == first.seq
        } else {
            d == &first
        }
    });
    if agree {
        return None;
    }
    let lines: Vec<String> = descs
        .iter()
        .enumerate()
        .map(|(r, d)| format!("  rank {r}: {}", d.describe()))
        .collect();
    Some(format!(
        "rank {my_rank}: collective mismatch at operation #{} (BRAID_DEBUG=detail): the ranks called\n{}",
        descs[my_rank].seq,
        lines.join("\n")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptors_roundtrip_and_mismatches_are_described() {
        let a = OpDesc::new(
            "all_reduce",
            1024,
            Some(DType::F32),
            Some(ReduceOp::Sum),
            None,
            7,
        );
        assert_eq!(OpDesc::decode(&a.encode()), a);
        let b = OpDesc::new(
            "all_reduce",
            1000,
            Some(DType::F32),
            Some(ReduceOp::Sum),
            None,
            7,
        );
        assert!(compare(&[a, a], 0).is_none());
        let report = compare(&[a, b], 1).unwrap();
        assert!(
            report.contains("rank 0: all_reduce(#7: count=1024, dtype=f32, op=sum)"),
            "{report}"
        );
        assert!(
            report.contains("rank 1: all_reduce(#7: count=1000"),
            "{report}"
        );
    }
}
