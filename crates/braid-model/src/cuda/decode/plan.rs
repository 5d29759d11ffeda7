//! A decode step's indices, worked out on the host: the rows checked as
//! the CPU checks them, each row's slot, and the block tables flattened
//! into one array of `i32`s uploaded at once.

use super::pages::GpuKvPages;
use crate::model::DecodeRow;
use crate::paged::BlockId;
use std::ops::Range;

/// One step's indices, worked out on the host and uploaded as one array
/// of `i32`s ([`StepPlan::ints`]), in this order: each row's token,
/// position, slot (`block * block_size + offset`, where its key and
/// value go) and table offset (where its table starts among the tables),
/// then the rows that want logits, then the tables (block ids).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct StepPlan {
    /// Rows.
    pub(super) n: usize,
    /// Rows that want logits.
    pub(super) m: usize,
    /// The array: `4n + m +` the tables' length.
    pub(super) ints: Vec<i32>,
}

impl StepPlan {
    /// Checks `rows` against a model of `context` positions and `vocab`
    /// tokens and a cache `kv` — the CPU's checks in its order, with its
    /// messages — and lays out their indices. A run of consecutive rows
    /// whose tables are the same slice shares one copy of it.
    pub(super) fn new(
        rows: &[DecodeRow<'_>],
        context: usize,
        vocab: usize,
        kv: &GpuKvPages,
    ) -> std::result::Result<StepPlan, String> {
        for r in rows {
            if r.pos >= context {
                return Err(format!(
                    "position {} is past the model's context of {context}",
                    r.pos
                ));
            }
            if r.token as usize >= vocab {
                return Err(format!(
                    "token {} is outside the vocabulary of {vocab}",
                    r.token
                ));
            }
        }
        // Every row's slot first (the CPU writes every row's key and
        // value before any row attends), then the blocks each row reads.
        let slots = rows
            .iter()
            .map(|r| kv.slot(r.table, r.pos))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        for r in rows {
            for &b in &r.table[..=r.pos / kv.block_size] {
                kv.check_block(b)?;
            }
        }
        let n = rows.len();
        let picked: Vec<i32> = (0..n)
            .filter(|&i| rows[i].logits)
            .map(|i| i as i32)
            .collect();
        let m = picked.len();
        let mut ints = Vec::with_capacity(5 * n);
        ints.extend(rows.iter().map(|r| r.token as i32));
        ints.extend(rows.iter().map(|r| r.pos as i32));
        ints.extend(slots.iter().map(|&s| s as i32));
        let mut tabs: Vec<i32> = Vec::new();
        let mut offsets = Vec::with_capacity(n);
        let mut last: Option<&[BlockId]> = None;
        for r in rows {
            let same = last.is_some_and(|t| std::ptr::eq(t, r.table));
            if !same {
                last = Some(r.table);
                offsets.push(tabs.len() as i32);
                tabs.extend(r.table.iter().map(|&b| b as i32));
            } else {
                offsets.push(*offsets.last().expect("a row before"));
            }
        }
        ints.extend(offsets);
        ints.extend(picked);
        ints.extend(tabs);
        if ints.len() > i32::MAX as usize {
            return Err(format!("a step of {} indices", ints.len()));
        }
        Ok(StepPlan { n, m, ints })
    }

    /// The same step laid out for a captured graph of `rows` rows (at
    /// least `self.n`; every row wants logits): each part `rows` long, row
    /// `i`'s table at `i * table_len` (its blocks up to its position's),
    /// and the rows past `self.n` decoding token 0 at position 0 into
    /// slot 0 of block `trash` (outside every table), their logits left
    /// unread. The array's layout then depends on `rows` and `table_len`
    /// alone, so one graph serves every step of that many rows.
    pub(super) fn padded(
        &self,
        rows: usize,
        table_len: usize,
        block_size: usize,
        trash: BlockId,
    ) -> StepPlan {
        let n = self.n;
        debug_assert!(rows >= n && self.m == n);
        let mut ints = Vec::with_capacity(5 * rows + rows * table_len);
        let pad = |ints: &mut Vec<i32>, part: usize, fill: i32| {
            ints.extend_from_slice(&self.ints[self.part(part)]);
            ints.extend(std::iter::repeat_n(fill, rows - n));
        };
        pad(&mut ints, 0, 0);
        pad(&mut ints, 1, 0);
        pad(&mut ints, 2, (trash as usize * block_size) as i32);
        ints.extend((0..rows).map(|i| (i * table_len) as i32));
        ints.extend((0..rows).map(|i| i as i32));
        let offsets = &self.ints[self.part(3)];
        let tabs = &self.ints[self.part(5)];
        let positions = &self.ints[self.part(1)];
        for i in 0..rows {
            let used = match i < n {
                true => {
                    let from = offsets[i] as usize;
                    let len = positions[i] as usize / block_size + 1;
                    ints.extend_from_slice(&tabs[from..from + len]);
                    len
                }
                false => 0,
            };
            ints.extend(std::iter::repeat_n(trash as i32, table_len - used));
        }
        StepPlan {
            n: rows,
            m: rows,
            ints,
        }
    }

    pub(super) fn part(&self, i: usize) -> Range<usize> {
        let n = self.n;
        match i {
            0..=3 => i * n..(i + 1) * n,
            4 => 4 * n..4 * n + self.m,
            _ => 4 * n + self.m..self.ints.len(),
        }
    }
}
