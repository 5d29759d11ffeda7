//! The paged KV cache's bookkeeping (serving, issue 66): the keys and
//! values of every sequence being decoded live in fixed-size blocks of
//! `block_size` token positions drawn from one pool, and each sequence
//! has a block table saying which block holds which of its positions
//! (vLLM's PagedAttention). Memory is taken a block at a time, so a
//! sequence wastes at most one partly filled block; a prompt prefix that
//! another sequence already holds is shared block by block instead of
//! computed and stored again (prefix caching); a shared block that a
//! sequence must write into is copied first (copy on write).
//!
//! This module decides which block every position goes to; it holds no
//! keys or values. A model's attention reads the pages through the block
//! tables ([`BlockTable::blocks`]), and the copies a write needs come back
//! as [`BlockCopy`] orders for the backend to run before it writes.
//!
//! Prefix caching: a full block is known by a hash of its tokens and of
//! every token before it (the hash of the block before it), so two
//! sequences share a block only when their whole prefixes up to it are
//! equal. A block whose last user released it keeps its contents and its
//! hash while it waits in the free list: a later sequence with the same
//! prefix takes it back instead of recomputing it, until the pool needs
//! the block for something else (the least recently freed goes first).

use std::collections::{HashMap, VecDeque};
use std::hash::{Hash, Hasher};

/// A block of the pool (its index).
pub type BlockId = u32;

/// The pool has no free block left for a sequence that needs one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutOfBlocks {
    /// Blocks the request needed.
    pub needed: usize,
    /// Free blocks there were.
    pub free: usize,
}

impl std::fmt::Display for OutOfBlocks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the KV cache has {} free block(s), {} needed (wait for a sequence to finish, or \
             give the cache more memory)",
            self.free, self.needed
        )
    }
}

/// Copy block `from`'s contents into block `to` before writing `to`: a
/// sequence is about to write into a block it shares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockCopy {
    pub from: BlockId,
    pub to: BlockId,
}

/// The hash a full block is known by: its tokens, after the hash of the
/// block before it (`None` for a sequence's first block).
pub fn block_hash(before: Option<u64>, tokens: &[u32]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    before.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

/// Every block of the cache: how many sequences hold each, which are
/// free (least recently freed first), and the full blocks known by their
/// prefix's hash.
#[derive(Debug)]
pub struct BlockPool {
    block_size: usize,
    /// Sequences holding each block (0: free).
    users: Vec<u32>,
    /// Free blocks, the least recently freed at the front.
    free: VecDeque<BlockId>,
    /// Full blocks by their prefix's hash (held or free).
    by_hash: HashMap<u64, BlockId>,
    /// Each block's hash, when it is a known full block.
    hash_of: Vec<Option<u64>>,
}

impl BlockPool {
    /// A pool of `blocks` blocks of `block_size` positions each.
    pub fn new(blocks: usize, block_size: usize) -> BlockPool {
        assert!(block_size > 0, "a block holds at least one position");
        BlockPool {
            block_size,
            users: vec![0; blocks],
            free: (0..blocks as BlockId).collect(),
            by_hash: HashMap::new(),
            hash_of: vec![None; blocks],
        }
    }

    /// Positions per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks in the pool.
    pub fn len(&self) -> usize {
        self.users.len()
    }

    /// Whether the pool has no blocks at all.
    pub fn is_empty(&self) -> bool {
        self.users.is_empty()
    }

    /// Blocks no sequence holds (some may still hold a cached prefix).
    pub fn free(&self) -> usize {
        self.free.len()
    }

    /// Blocks some sequence holds.
    pub fn used(&self) -> usize {
        self.len() - self.free()
    }

    /// Sequences holding `block`.
    pub fn users(&self, block: BlockId) -> u32 {
        self.users[block as usize]
    }

    /// A free block, emptied (its cached prefix forgotten), now held once.
    fn take(&mut self) -> Option<BlockId> {
        let b = self.free.pop_front()?;
        if let Some(h) = self.hash_of[b as usize].take() {
            self.by_hash.remove(&h);
        }
        self.users[b as usize] = 1;
        Some(b)
    }

    /// The full block known by `hash`, now held once more (taken back
    /// from the free list if nobody held it).
    fn reuse(&mut self, hash: u64) -> Option<BlockId> {
        let b = *self.by_hash.get(&hash)?;
        if self.users[b as usize] == 0 {
            self.free.retain(|&f| f != b);
        }
        self.users[b as usize] += 1;
        Some(b)
    }

    /// One sequence lets go of `block`; the last one returns it to the
    /// free list (its cached prefix kept until the block is taken).
    fn release(&mut self, block: BlockId) {
        let u = &mut self.users[block as usize];
        assert!(*u > 0, "block {block} released more often than held");
        *u -= 1;
        if *u == 0 {
            self.free.push_back(block);
        }
    }

    /// Makes `block`, full with the prefix hashed `hash`, known by it (a
    /// block already known by the same hash keeps the name).
    fn register(&mut self, block: BlockId, hash: u64) {
        if self.by_hash.contains_key(&hash) {
            return;
        }
        self.by_hash.insert(hash, block);
        self.hash_of[block as usize] = Some(hash);
    }
}

/// One sequence's blocks: position `p` is at offset `p % block_size` of
/// block `blocks[p / block_size]`.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct BlockTable {
    blocks: Vec<BlockId>,
    /// Positions written.
    len: usize,
    /// The hash of each full block, in order (the prefix so far).
    hashes: Vec<u64>,
    /// The tokens of the last, partly filled block.
    tail: Vec<u32>,
}

impl BlockTable {
    /// An empty sequence.
    pub fn new() -> BlockTable {
        BlockTable::default()
    }

    /// The blocks in position order.
    pub fn blocks(&self) -> &[BlockId] {
        &self.blocks
    }

    /// Positions written so far.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is written yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The block and offset of position `p` (written or about to be).
    pub fn slot(&self, pool: &BlockPool, p: usize) -> Option<(BlockId, usize)> {
        let bs = pool.block_size();
        self.blocks.get(p / bs).map(|&b| (b, p % bs))
    }

    /// Starts the sequence with the prompt `tokens`: the longest run of
    /// full blocks some sequence already computed is shared (its
    /// positions need no computing: the returned count), the rest gets
    /// new blocks. Nothing is taken when the pool cannot hold it all.
    pub fn start(&mut self, pool: &mut BlockPool, tokens: &[u32]) -> Result<usize, OutOfBlocks> {
        assert!(self.is_empty(), "a sequence starts once");
        let bs = pool.block_size();
        // The cached full blocks, in order, while they match.
        let mut shared = Vec::new();
        let mut before = None;
        for chunk in tokens.chunks_exact(bs) {
            let h = block_hash(before, chunk);
            match pool.by_hash.get(&h) {
                Some(&b) => shared.push((b, h)),
                None => break,
            }
            before = Some(h);
        }
        // Keep the last position to compute: the model needs at least one
        // to produce the next token's logits.
        if shared.len() * bs == tokens.len() && !shared.is_empty() {
            shared.pop();
        }
        let rest = tokens.len() - shared.len() * bs;
        // Shared blocks sitting in the free list leave it: count them too.
        let revived = shared.iter().filter(|(b, _)| pool.users(*b) == 0).count();
        let needed = rest.div_ceil(bs);
        if needed + revived > pool.free() {
            return Err(OutOfBlocks {
                needed: needed + revived,
                free: pool.free(),
            });
        }
        for &(_, h) in &shared {
            let b = pool.reuse(h).expect("found above");
            self.blocks.push(b);
            self.hashes.push(h);
        }
        self.len = shared.len() * bs;
        let cached = self.len;
        self.append(pool, &tokens[cached..]).expect("counted above");
        Ok(cached)
    }

    /// Writes `tokens` at the next positions, taking blocks as they are
    /// needed; a shared last block is copied first (the [`BlockCopy`] orders
    /// returned). Nothing is taken when the pool cannot hold it all.
    pub fn append(
        &mut self,
        pool: &mut BlockPool,
        tokens: &[u32],
    ) -> Result<Vec<BlockCopy>, OutOfBlocks> {
        let bs = pool.block_size();
        let in_tail = self.len % bs;
        let shared_tail = in_tail > 0 && pool.users(*self.blocks.last().expect("a tail")) > 1;
        let room = if in_tail > 0 { bs - in_tail } else { 0 };
        let needed = tokens.len().saturating_sub(room).div_ceil(bs)
            + usize::from(shared_tail && !tokens.is_empty());
        if needed > pool.free() {
            return Err(OutOfBlocks {
                needed,
                free: pool.free(),
            });
        }
        let mut copies = Vec::new();
        if shared_tail && !tokens.is_empty() {
            let from = self.blocks.pop().expect("a tail");
            let to = pool.take().expect("counted above");
            pool.release(from);
            self.blocks.push(to);
            copies.push(BlockCopy { from, to });
        }
        for &t in tokens {
            if self.len % bs == 0 {
                self.blocks.push(pool.take().expect("counted above"));
            }
            self.tail.push(t);
            self.len += 1;
            if self.len % bs == 0 {
                // A full block: known by its prefix from now on.
                let h = block_hash(self.hashes.last().copied(), &self.tail);
                self.tail.clear();
                pool.register(*self.blocks.last().expect("just filled"), h);
                self.hashes.push(h);
            }
        }
        Ok(copies)
    }

    /// A second sequence continuing from this one's positions (parallel
    /// sampling, beam search): every block shared, copied on its first
    /// write.
    pub fn fork(&self, pool: &mut BlockPool) -> BlockTable {
        for &b in &self.blocks {
            pool.users[b as usize] += 1;
        }
        self.clone()
    }

    /// The sequence is done: its blocks go back (full ones stay known by
    /// their prefix until the pool takes them for something else).
    pub fn release(&mut self, pool: &mut BlockPool) {
        for b in self.blocks.drain(..) {
            pool.release(b);
        }
        self.len = 0;
        self.hashes.clear();
        self.tail.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokens(n: usize, from: u32) -> Vec<u32> {
        (from..from + n as u32).collect()
    }

    #[test]
    fn positions_fill_blocks_in_order_and_all_come_back() {
        let mut pool = BlockPool::new(8, 4);
        let mut s = BlockTable::new();
        assert_eq!(s.start(&mut pool, &tokens(6, 0)), Ok(0));
        assert_eq!((s.len(), s.blocks().len(), pool.used()), (6, 2, 2));
        assert_eq!(s.slot(&pool, 5), Some((s.blocks()[1], 1)));
        // Two more fill the second block; a third takes a new one.
        assert_eq!(s.append(&mut pool, &[7, 8]), Ok(vec![]));
        assert_eq!(pool.used(), 2);
        assert_eq!(s.append(&mut pool, &[9]), Ok(vec![]));
        assert_eq!(pool.used(), 3);
        s.release(&mut pool);
        assert_eq!((pool.used(), pool.free()), (0, 8));
    }

    #[test]
    fn a_shared_prompt_prefix_is_shared_block_by_block() {
        let mut pool = BlockPool::new(8, 4);
        let prompt = tokens(10, 100);
        let mut a = BlockTable::new();
        assert_eq!(a.start(&mut pool, &prompt), Ok(0));
        // The same first 8 tokens, then others: two blocks shared.
        let mut other = prompt[..8].to_vec();
        other.extend([1, 2, 3]);
        let mut b = BlockTable::new();
        assert_eq!(b.start(&mut pool, &other), Ok(8));
        assert_eq!(a.blocks()[..2], b.blocks()[..2]);
        assert_ne!(a.blocks()[2], b.blocks()[2]);
        assert_eq!(pool.users(a.blocks()[0]), 2);
        assert_eq!(pool.used(), 4);
        // A prefix that differs in its first block shares nothing, though
        // its second block's tokens are the same.
        let mut c_prompt = prompt.clone();
        c_prompt[0] = 7;
        let mut c = BlockTable::new();
        assert_eq!(c.start(&mut pool, &c_prompt), Ok(0));
        assert!(c.blocks().iter().all(|x| !a.blocks().contains(x)));
        for s in [&mut a, &mut b, &mut c] {
            s.release(&mut pool);
        }
        assert_eq!(pool.used(), 0);
    }

    #[test]
    fn a_whole_cached_prompt_leaves_its_last_position_to_compute() {
        let mut pool = BlockPool::new(4, 4);
        let prompt = tokens(8, 0);
        let mut a = BlockTable::new();
        a.start(&mut pool, &prompt).unwrap();
        let mut b = BlockTable::new();
        // One block shared, the last block's 4 positions computed again.
        assert_eq!(b.start(&mut pool, &prompt), Ok(4));
        assert_eq!(b.len(), 8);
    }

    #[test]
    fn a_released_prefix_is_taken_back_until_its_block_is_needed() {
        let mut pool = BlockPool::new(3, 4);
        let prompt = tokens(9, 0);
        let mut a = BlockTable::new();
        a.start(&mut pool, &prompt).unwrap();
        let first = a.blocks()[0];
        a.release(&mut pool);
        assert_eq!(pool.used(), 0);
        // Freed, still known: the same prompt takes the two full blocks
        // back.
        let mut b = BlockTable::new();
        assert_eq!(b.start(&mut pool, &prompt), Ok(8));
        assert_eq!(b.blocks()[0], first);
        b.release(&mut pool);
        // Another prompt needs every block: the cached ones are emptied.
        let mut c = BlockTable::new();
        assert_eq!(c.start(&mut pool, &tokens(12, 50)), Ok(0));
        c.release(&mut pool);
        let mut d = BlockTable::new();
        assert_eq!(d.start(&mut pool, &prompt), Ok(0), "the old prefix is gone");
    }

    #[test]
    fn writing_into_a_shared_block_copies_it_first() {
        let mut pool = BlockPool::new(8, 4);
        let mut a = BlockTable::new();
        a.start(&mut pool, &tokens(6, 0)).unwrap();
        let mut b = a.fork(&mut pool);
        assert_eq!(pool.used(), 2);
        let tail = a.blocks()[1];
        assert_eq!(pool.users(tail), 2);
        // b writes first: its half-full last block is copied.
        let copies = b.append(&mut pool, &[42]).unwrap();
        assert_eq!(copies.len(), 1);
        assert_eq!(copies[0].from, tail);
        assert_eq!(b.blocks()[1], copies[0].to);
        assert_eq!(pool.users(tail), 1);
        // a's block is its own again: no copy.
        assert_eq!(a.append(&mut pool, &[43]), Ok(vec![]));
        a.release(&mut pool);
        b.release(&mut pool);
        assert_eq!(pool.used(), 0);
    }

    #[test]
    fn a_request_the_pool_cannot_hold_takes_nothing() {
        let mut pool = BlockPool::new(2, 4);
        let mut a = BlockTable::new();
        let e = a.start(&mut pool, &tokens(9, 0)).unwrap_err();
        assert_eq!(e, OutOfBlocks { needed: 3, free: 2 });
        assert!(e.to_string().contains("2 free block(s), 3 needed"));
        assert_eq!((a.len(), pool.used()), (0, 0));
        a.start(&mut pool, &tokens(8, 0)).unwrap();
        assert_eq!(a.append(&mut pool, &[1]).unwrap_err().free, 0);
        assert_eq!(a.len(), 8);
    }
}
