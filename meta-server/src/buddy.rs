//! A binary buddy allocator over a range of offsets (Knowlton 1965; Knuth,
//! TAOCP vol. 1 §2.5, "the buddy system"): the allocator behind data-server
//! extents ([`crate::extents`]) and the meta-server's lock memory
//! ([`crate::lock_memory`]).
//!
//! Blocks have power-of-two sizes from `2^min_order` to `2^max_order`; a
//! block of order `k` starts at a multiple of `2^k` from the range's base.
//! An allocation takes the lowest-addressed free block of the smallest order
//! that fits, splitting larger blocks on the way down; a free merges the
//! block with its buddy (`offset ^ 2^k`) for as long as the buddy is free at
//! the same order, so freeing everything gives back blocks of the largest
//! order. The range need not be a multiple of the largest block: its tail is
//! carved into the largest blocks that fit, which merge only among
//! themselves (a buddy that lies outside the range is never free).
//!
//! Each free block carries a `dirty` bit: whether its memory may hold old
//! bytes. Memory never handed out is clean (fresh anonymous or shm memory is
//! zero); a block freed dirty stays dirty, a merge of a clean and a dirty
//! block is dirty, and a split passes the bit to both halves. The caller
//! zeroes a dirty block before a client may read it, or cleans it when it
//! can do so cheaply ([`Buddy::mark_clean`] after giving the pages back).
//!
//! Costs: `O(max_order - min_order)` map operations per allocation and per
//! free, each `O(log n)` in the free blocks of one order.
//!
//! Hand-written rather than a crate: the buddy crates on crates.io
//! (`buddy_system_allocator`, `buddy-alloc`) manage this process's heap
//! through pointers (`GlobalAlloc`, intrusive free lists written into the
//! free memory itself); these offsets are in another process's memory (a
//! data server's region, served by its NIC) that the meta-server must not
//! write to keep books, and the dirty bit has no place in them.

use std::collections::BTreeMap;

/// An allocation: where it starts and whether its memory may hold old bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Block {
    pub offset: u64,
    pub order: u32,
    pub dirty: bool,
}

impl Block {
    pub fn bytes(&self) -> u64 {
        1 << self.order
    }
}

/// Free blocks of `[base, base + len)`.
#[derive(Debug)]
pub struct Buddy {
    base: u64,
    min_order: u32,
    max_order: u32,
    /// Free blocks by order (index `order - min_order`): offset -> dirty.
    free: Vec<BTreeMap<u64, bool>>,
    /// Bytes the range manages (a multiple of the smallest block).
    total: u64,
    free_bytes: u64,
}

impl Buddy {
    /// Manages `[base, base + len)` in blocks of `2^min_order ..= 2^max_order`
    /// bytes; bytes past the last whole smallest block are not used.
    pub fn new(base: u64, len: u64, min_order: u32, max_order: u32) -> Self {
        assert!(min_order <= max_order && max_order < 63, "orders {min_order}..={max_order}");
        let levels = (max_order - min_order + 1) as usize;
        let mut b =
            Self { base, min_order, max_order, free: vec![BTreeMap::new(); levels], total: 0, free_bytes: 0 };
        // Whole blocks of the largest order, then the tail in the largest
        // blocks that fit (each aligned, since every earlier block is a
        // larger power of two).
        let mut at = 0u64;
        let mut order = max_order;
        loop {
            while at + (1 << order) <= len {
                b.free[(order - min_order) as usize].insert(at, false);
                at += 1 << order;
            }
            if order == min_order {
                break;
            }
            order -= 1;
        }
        b.total = at;
        b.free_bytes = at;
        b
    }

    /// The order of the smallest block that holds `bytes` (at least the
    /// minimum), or `None` if it exceeds the largest.
    pub fn order_for(&self, bytes: u64) -> Option<u32> {
        let order = bytes.max(1).checked_next_power_of_two()?.trailing_zeros().max(self.min_order);
        (order <= self.max_order).then_some(order)
    }

    pub fn min_order(&self) -> u32 {
        self.min_order
    }

    pub fn max_order(&self) -> u32 {
        self.max_order
    }

    /// A block of `order`, or `None` if no free block is that large.
    pub fn allocate(&mut self, order: u32) -> Option<Block> {
        if order < self.min_order || order > self.max_order {
            return None;
        }
        let from = (order..=self.max_order).find(|&k| !self.level(k).is_empty())?;
        let (rel, dirty) = self.free[(from - self.min_order) as usize].pop_first()?;
        // Split down: keep the lower half, free the upper one.
        for k in (order..from).rev() {
            self.free[(k - self.min_order) as usize].insert(rel + (1 << k), dirty);
        }
        self.free_bytes -= 1 << order;
        Some(Block { offset: self.base + rel, order, dirty })
    }

    /// Gives back a block that [`Buddy::allocate`] returned, `dirty` if its
    /// memory may now hold bytes a client wrote. Returns the free block it
    /// merged into.
    pub fn free(&mut self, offset: u64, order: u32, dirty: bool) -> Block {
        debug_assert!(self.owns(offset, order), "free of {offset:#x} order {order} outside the range");
        let mut rel = offset - self.base;
        let mut order = order;
        let mut dirty = dirty;
        self.free_bytes += 1 << order;
        while order < self.max_order {
            let buddy = rel ^ (1 << order);
            match self.free[(order - self.min_order) as usize].remove(&buddy) {
                Some(d) => {
                    dirty |= d;
                    rel = rel.min(buddy);
                    order += 1;
                }
                None => break,
            }
        }
        let previous = self.free[(order - self.min_order) as usize].insert(rel, dirty);
        debug_assert!(previous.is_none(), "double free of {offset:#x}");
        Block { offset: self.base + rel, order, dirty }
    }

    /// Takes the block `[offset, offset + 2^order)` out of the free space,
    /// splitting the free block that holds it; `false` (and nothing taken)
    /// if it is not wholly free.
    pub fn claim(&mut self, offset: u64, order: u32) -> bool {
        if !self.owns(offset, order) {
            return false;
        }
        let rel = offset - self.base;
        let Some((from, start, dirty)) = (order..=self.max_order).find_map(|k| {
            let start = rel >> k << k;
            self.level(k).get(&start).map(|&d| (k, start, d))
        }) else {
            return false;
        };
        self.free[(from - self.min_order) as usize].remove(&start);
        // Split down towards the block: free the half that does not hold it.
        for k in (order..from).rev() {
            let half = rel >> k << k;
            self.free[(k - self.min_order) as usize].insert(half ^ (1 << k), dirty);
        }
        self.free_bytes -= 1 << order;
        true
    }

    /// Marks every free block as possibly holding old bytes.
    pub fn mark_all_dirty(&mut self) {
        for level in &mut self.free {
            level.values_mut().for_each(|d| *d = true);
        }
    }

    /// Whether `[offset, offset + 2^order)` is an aligned block of the range.
    pub fn owns(&self, offset: u64, order: u32) -> bool {
        offset >= self.base
            && order >= self.min_order
            && order <= self.max_order
            && (offset - self.base).is_multiple_of(1 << order)
            && offset - self.base + (1 << order) <= self.total
    }

    /// Marks one free block clean if it is a free block of exactly `order`
    /// at `offset` (after the caller cleaned its memory).
    pub fn mark_clean(&mut self, offset: u64, order: u32) -> bool {
        if order < self.min_order || order > self.max_order || offset < self.base {
            return false;
        }
        match self.free[(order - self.min_order) as usize].get_mut(&(offset - self.base)) {
            Some(d) => {
                *d = false;
                true
            }
            None => false,
        }
    }

    fn level(&self, order: u32) -> &BTreeMap<u64, bool> {
        &self.free[(order - self.min_order) as usize]
    }

    /// Bytes managed.
    pub fn total_bytes(&self) -> u64 {
        self.total
    }

    /// Bytes in free blocks.
    pub fn free_bytes(&self) -> u64 {
        self.free_bytes
    }

    /// The largest block an allocation could get now, in bytes (0 if full).
    pub fn largest_free(&self) -> u64 {
        (self.min_order..=self.max_order).rev().find(|&k| !self.level(k).is_empty()).map_or(0, |k| 1 << k)
    }

    /// Free blocks per order, smallest first (diagnostics, tests).
    pub fn free_blocks(&self) -> Vec<(u32, usize)> {
        (self.min_order..=self.max_order).map(|k| (k, self.level(k).len())).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn splits_then_merges_back_to_whole_blocks() {
        let mut b = Buddy::new(0, 1 << 20, 12, 20);
        assert_eq!(b.free_blocks().last(), Some(&(20, 1)));
        let small = b.allocate(12).unwrap();
        assert_eq!(small, Block { offset: 0, order: 12, dirty: false });
        // One block of each order from 4 KiB to 512 KiB is left over.
        assert!(b.free_blocks().iter().all(|&(k, n)| n == usize::from(k < 20)));
        let next = b.allocate(12).unwrap();
        assert_eq!(next.offset, 4096, "lowest address first");
        b.free(small.offset, 12, true);
        b.free(next.offset, 12, false);
        assert_eq!(b.free_blocks().last(), Some(&(20, 1)), "merged back to one chunk");
        assert_eq!(b.free_bytes(), 1 << 20);
        let whole = b.allocate(20).unwrap();
        assert!(whole.dirty, "a merge with a dirty block is dirty");
        assert!(b.allocate(12).is_none(), "full");
    }

    #[test]
    fn a_tail_that_is_not_a_whole_block_is_used_and_never_merged_out_of_range() {
        // 2.75 blocks of 64 KiB: two whole ones, then 32 KiB and 16 KiB.
        let len = 2 * 65536 + 32768 + 16384 + 100;
        let mut b = Buddy::new(4096, len, 12, 16);
        assert_eq!(b.total_bytes(), 2 * 65536 + 32768 + 16384);
        let mut got = Vec::new();
        while let Some(x) = b.allocate(12) {
            assert!(b.owns(x.offset, 12));
            got.push(x.offset);
        }
        assert_eq!(got.len() as u64 * 4096, b.total_bytes());
        assert!(got.iter().all(|o| (o - 4096) % 4096 == 0), "aligned to the base");
        for o in got {
            b.free(o, 12, false);
        }
        assert_eq!(b.free_bytes(), b.total_bytes());
        assert_eq!(b.free_blocks(), vec![(12, 0), (13, 0), (14, 1), (15, 1), (16, 2)]);
    }

    #[test]
    fn claimed_blocks_are_taken_once_and_merge_back_when_freed() {
        let mut b = Buddy::new(0, 1 << 20, 12, 20);
        assert!(b.claim(3 << 12, 12));
        assert!(b.claim(1 << 16, 16));
        assert!(!b.claim(3 << 12, 12), "a block is claimed once");
        assert!(!b.claim(1 << 16, 12), "a block inside a claimed one is not free");
        assert_eq!(b.free_bytes(), (1 << 20) - (1 << 12) - (1 << 16));
        let got = b.allocate(12).unwrap();
        assert_ne!(got.offset, 3 << 12);
        b.free(got.offset, 12, false);
        b.free(3 << 12, 12, false);
        b.free(1 << 16, 16, false);
        let blocks = b.free_blocks();
        assert!(blocks.iter().all(|&(k, n)| n == usize::from(k == 20)), "everything merged back: {blocks:?}");
    }

    #[test]
    fn orders_and_cleaning() {
        let mut b = Buddy::new(0, 3 << 20, 12, 20);
        assert_eq!(b.order_for(1), Some(12));
        assert_eq!(b.order_for(4097), Some(13));
        assert_eq!(b.order_for(1 << 20), Some(20));
        assert_eq!(b.order_for((1 << 20) + 1), None);
        let x = b.allocate(20).unwrap();
        let y = b.allocate(13).unwrap();
        assert_eq!(y.offset, 1 << 20);
        let merged = b.free(x.offset, 20, true);
        assert_eq!(merged, Block { offset: x.offset, order: 20, dirty: true });
        let merged = b.free(y.offset, 13, true);
        assert_eq!(merged, Block { offset: 1 << 20, order: 20, dirty: true }, "merged up to a chunk");
        assert!(b.mark_clean(x.offset, 20));
        assert!(!b.mark_clean(x.offset + 4096, 12), "not a free block");
        let again = b.allocate(20).unwrap();
        assert_eq!((again.offset, again.dirty), (x.offset, false));
        let dirty = b.allocate(20).unwrap();
        assert_eq!((dirty.offset, dirty.dirty), (1 << 20, true));
        assert_eq!(b.largest_free(), 1 << 20);
    }

    proptest! {
        /// Any sequence of allocations and frees: blocks never overlap, stay
        /// in range and aligned, the free-byte count is exact, and freeing
        /// everything gives back the initial blocks.
        #[test]
        fn never_overlaps_and_always_coalesces(
            ops in proptest::collection::vec((any::<bool>(), 12u32..=16, any::<prop::sample::Index>()), 1..300),
            extra in 0u64..(1 << 16),
        ) {
            let len = 5 * (1 << 16) + extra;
            let mut b = Buddy::new(1 << 20, len, 12, 16);
            let initial = b.free_blocks();
            let mut live: Vec<Block> = Vec::new();
            for (alloc, order, pick) in ops {
                if alloc || live.is_empty() {
                    if let Some(x) = b.allocate(order) {
                        prop_assert!(b.owns(x.offset, x.order));
                        for y in &live {
                            let disjoint = x.offset + x.bytes() <= y.offset || y.offset + y.bytes() <= x.offset;
                            prop_assert!(disjoint, "{x:?} overlaps {y:?}");
                        }
                        live.push(x);
                    } else {
                        prop_assert!(b.largest_free() < 1 << order);
                    }
                } else {
                    let x = live.swap_remove(pick.index(live.len()));
                    b.free(x.offset, x.order, true);
                }
                let used: u64 = live.iter().map(Block::bytes).sum();
                prop_assert_eq!(b.free_bytes() + used, b.total_bytes());
            }
            for x in live.drain(..) {
                b.free(x.offset, x.order, false);
            }
            prop_assert_eq!(b.free_blocks(), initial);
        }
    }
}
