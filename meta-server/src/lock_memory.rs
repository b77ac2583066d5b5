//! The meta-server's lock memory (DESIGN.md §4): one region of its NIC in
//! which it places every file's lock area, lock-record table blocks and the
//! cluster's waits-for table. Clients reach all of it with one-sided verbs;
//! the meta-server only allocates, zeroes and frees.
//!
//! A buddy allocator ([`crate::buddy`]): requests are rounded up to a power
//! of two of at least [`MIN_BLOCK`] bytes (so every allocation is
//! 64-aligned), and freed blocks merge with their buddies, so memory that
//! held the lock areas of many small files can later hold one big file's.
//! Freed memory is zeroed before it goes back, so an allocation is always
//! zero (an idle lock, an empty table). Every free of a file's lock memory
//! goes through the reclamation point ([`crate::reclaim`]).
//!
//! The region is a file of the state directory, so a restarted meta-server
//! finds every lock word as its clients left it. It then knows only the
//! cluster's fixed structures: every other block is free but *dirty* (it
//! may hold a file's lock area that a client will reclaim, or old bytes),
//! the blocks clients reclaim are taken out with [`LockMemory::claim`], and
//! a dirty block is zeroed when it is handed out.

use std::sync::Arc;

use citron_lock::rdma::{RegionMemory, RemoteAddr};
use citronfs_core::FsError;

use crate::buddy::Buddy;

/// Smallest allocation, and the alignment of all of them.
pub const MIN_BLOCK: u64 = 64;

pub struct LockMemory {
    memory: Arc<RegionMemory>,
    /// Free blocks of `[0, limit)`: allocations stay below `limit` (the rest
    /// of the region may belong to another allocator: the Citron tree host).
    blocks: Buddy,
}

impl LockMemory {
    pub fn new(memory: Arc<RegionMemory>) -> Self {
        let limit = memory.len();
        Self::below(memory, limit)
    }

    /// Allocates only from `[0, limit)` of the region.
    pub fn below(memory: Arc<RegionMemory>, limit: u64) -> Self {
        let limit = limit.min(memory.len());
        let min = MIN_BLOCK.trailing_zeros();
        let max = if limit < MIN_BLOCK { min } else { 63 - limit.leading_zeros() };
        Self { memory, blocks: Buddy::new(0, limit, min, max) }
    }

    /// `bytes` of zeroed memory, 64-aligned; `NoLocks` when no free block is
    /// that large.
    pub fn allocate(&mut self, bytes: u64) -> Result<RemoteAddr, FsError> {
        let order = self.blocks.order_for(bytes).ok_or(FsError::NoLocks)?;
        let block = self.blocks.allocate(order).ok_or(FsError::NoLocks)?;
        let addr = RemoteAddr::new(self.memory.id(), block.offset);
        if block.dirty {
            if let Err(e) = self.memory.write_from(addr, &vec![0u8; 1 << order]) {
                self.blocks.free(block.offset, order, true);
                return Err(FsError::Io(format!("cannot zero lock memory at {addr}: {e}")));
            }
        }
        Ok(addr)
    }

    /// Takes `bytes` at `addr` out of the free memory as they are (a lock
    /// area or table block a client reclaims after a restart); `false` if
    /// they are not one whole free block.
    pub fn claim(&mut self, addr: RemoteAddr, bytes: u64) -> bool {
        addr.region == self.memory.id()
            && self.blocks.order_for(bytes).is_some_and(|order| self.blocks.claim(addr.offset, order))
    }

    /// Marks all free memory as holding old bytes (a restart that keeps
    /// the region): each block is zeroed when it is handed out.
    pub fn mark_free_dirty(&mut self) {
        self.blocks.mark_all_dirty();
    }

    /// Gives back what [`LockMemory::allocate`] returned for `bytes`.
    pub fn free(&mut self, addr: RemoteAddr, bytes: u64) {
        let Some(order) = self.blocks.order_for(bytes).filter(|&o| self.blocks.owns(addr.offset, o)) else {
            log::error!("freeing lock memory that was never allocated: {addr} ({bytes} bytes)");
            return;
        };
        if let Err(e) = self.memory.write_from(addr, &vec![0u8; 1 << order]) {
            log::error!("cannot zero freed lock memory at {addr}: {e}");
            return;
        }
        self.blocks.free(addr.offset, order, false);
    }

    pub fn memory(&self) -> &Arc<RegionMemory> {
        &self.memory
    }

    /// Bytes handed out and not freed.
    pub fn in_use(&self) -> u64 {
        self.blocks.total_bytes() - self.blocks.free_bytes()
    }

    /// Bytes this allocator manages.
    pub fn capacity(&self) -> u64 {
        self.blocks.total_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use citron_lock::rdma::RegionId;

    #[test]
    fn allocations_are_aligned_zeroed_and_reused() {
        let mem = Arc::new(RegionMemory::anonymous(RegionId(2), 4096).unwrap());
        let mut m = LockMemory::new(mem.clone());
        let a = m.allocate(10).unwrap();
        let b = m.allocate(100).unwrap();
        assert_eq!((a.offset, b.offset), (0, 128), "aligned to their size, packed");
        assert_eq!(m.in_use(), 64 + 128);
        mem.write_from(a, &[7u8; 64]).unwrap();
        m.free(a, 10);
        let c = m.allocate(64).unwrap();
        assert_eq!(c, a);
        let mut buf = [1u8; 64];
        mem.read_into(c, &mut buf).unwrap();
        assert_eq!(buf, [0u8; 64], "reused memory is zero");
        assert!(m.allocate(4096).is_err(), "full");
        m.free(b, 100);
        m.free(c, 64);
        assert_eq!(m.in_use(), 0);
        assert!(m.allocate(4096).is_ok(), "freed blocks merge back into the whole region");
        // A restart: what clients reclaim keeps its bytes, the rest is
        // zeroed as it is handed out.
        mem.write_from(RemoteAddr::new(RegionId(2), 256), &[5u8; 64]).unwrap();
        mem.write_from(RemoteAddr::new(RegionId(2), 512), &[6u8; 64]).unwrap();
        let mut again = LockMemory::new(mem.clone());
        again.mark_free_dirty();
        assert!(again.claim(RemoteAddr::new(RegionId(2), 256), 64));
        assert!(!again.claim(RemoteAddr::new(RegionId(2), 256), 64), "claimed twice");
        assert!(!again.claim(RemoteAddr::new(RegionId(3), 512), 64), "another region");
        let mut kept = [0u8; 64];
        mem.read_into(RemoteAddr::new(RegionId(2), 256), &mut kept).unwrap();
        assert_eq!(kept, [5u8; 64]);
        while let Ok(a) = again.allocate(64) {
            mem.read_into(a, &mut buf).unwrap();
            assert_eq!(buf, [0u8; 64], "dirty memory at {a} is zero when handed out");
        }
        let mut low = LockMemory::below(mem, 1024);
        assert!(low.allocate(1024).is_ok());
        assert!(low.allocate(64).is_err(), "nothing above the limit");
    }
}
