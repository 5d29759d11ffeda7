//! Grouping: several operations issued as one. All-reduces in a group that
//! share a dtype and reduce operator are packed into one buffer and reduced
//! in a single exchange, which is what makes many small all-reduces (one
//! per parameter tensor) cheap.

use crate::communicator::Communicator;
use crate::error::Result;
use braid_core::{DType, Element, ReduceOp};

struct Pending<'a> {
    buf: &'a mut [u8],
    dtype: DType,
    op: ReduceOp,
}

/// Operations collected by [`Communicator::group`].
pub struct Group<'a> {
    all_reduces: Vec<Pending<'a>>,
}

impl<'a> Group<'a> {
    /// Adds an in-place all-reduce to the group.
    pub fn all_reduce<T: Element>(&mut self, buf: &'a mut [T], op: ReduceOp) {
        self.all_reduces.push(Pending {
            buf: bytemuck::cast_slice_mut(buf),
            dtype: T::DTYPE,
            op,
        });
    }

    /// Number of operations collected.
    pub fn len(&self) -> usize {
        self.all_reduces.len()
    }

    /// Whether nothing was collected.
    pub fn is_empty(&self) -> bool {
        self.all_reduces.is_empty()
    }
}

impl Communicator {
    /// Collects the all-reduces that `f` adds and runs them as one fused
    /// exchange per (dtype, reduce op), in order of first appearance. Every
    /// rank must add the same operations.
    pub fn group<'a>(&self, f: impl FnOnce(&mut Group<'a>)) -> Result<()> {
        let mut g = Group {
            all_reduces: Vec::new(),
        };
        f(&mut g);
        let mut keys: Vec<(DType, ReduceOp)> = Vec::new();
        for p in &g.all_reduces {
            if !keys.contains(&(p.dtype, p.op)) {
                keys.push((p.dtype, p.op));
            }
        }
        for (dtype, op) in keys {
            let members: Vec<&mut Pending> = g
                .all_reduces
                .iter_mut()
                .filter(|p| p.dtype == dtype && p.op == op)
                .collect();
            let total: usize = members.iter().map(|p| p.buf.len()).sum();
            // u64 storage keeps the packed buffer aligned for every dtype.
            let mut packed = vec![0u64; total.div_ceil(8)];
            let bytes: &mut [u8] = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut packed)[..total];
            let mut at = 0;
            for p in &members {
                bytes[at..at + p.buf.len()].copy_from_slice(p.buf);
                at += p.buf.len();
            }
            self.all_reduce_raw(bytes, dtype, op)?;
            let mut at = 0;
            for p in members {
                let n = p.buf.len();
                p.buf.copy_from_slice(&bytes[at..at + n]);
                at += n;
            }
        }
        Ok(())
    }

    fn all_reduce_raw(&self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
        let desc = crate::debug::OpDesc::new(
            "all_reduce",
            buf.len() / dtype.size(),
            Some(dtype),
            Some(op),
            None,
            0,
        );
        self.run_op(desc, move |b, c| {
            b.all_reduce(c, crate::backend::Data::InPlace(buf), dtype, op)
        })
    }
}
