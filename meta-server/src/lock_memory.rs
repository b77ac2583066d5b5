//! The meta-server's lock memory (DESIGN.md §4): one region of its NIC in
//! which it places every file's lock area, lock-record table blocks and the
//! cluster's waits-for table. Clients reach all of it with one-sided verbs;
//! the meta-server only allocates, zeroes and frees.
//!
//! A size-class allocator: requests are rounded up to a power of two of at
//! least [`MIN_BLOCK`] bytes (so every allocation is 64-aligned) and served
//! from that class's free list or from the untouched top of the region.
//! Freed memory is zeroed before it goes back on a list, so an allocation
//! is always zero (an idle lock, an empty table). Hand-written rather than a
//! crate: it manages offsets in memory that other processes map, not this
//! process's heap, and it is forty lines.

use std::sync::Arc;

use citron_lock::rdma::{RegionMemory, RemoteAddr};
use citronfs_core::FsError;

/// Smallest allocation, and the alignment of all of them.
pub const MIN_BLOCK: u64 = 64;

pub struct LockMemory {
    memory: Arc<RegionMemory>,
    /// Untouched memory starts here.
    top: u64,
    /// Allocations stay below this (the rest of the region may belong to
    /// another allocator: the Citron tree host).
    limit: u64,
    /// Free offsets by class (index: log2 of the size).
    free: Vec<Vec<u64>>,
    in_use: u64,
}

impl LockMemory {
    pub fn new(memory: Arc<RegionMemory>) -> Self {
        let limit = memory.len();
        Self::below(memory, limit)
    }

    /// Allocates only from `[0, limit)` of the region.
    pub fn below(memory: Arc<RegionMemory>, limit: u64) -> Self {
        let limit = limit.min(memory.len());
        Self { memory, top: 0, limit, free: vec![Vec::new(); 64], in_use: 0 }
    }

    fn class(bytes: u64) -> (usize, u64) {
        let size = bytes.max(MIN_BLOCK).next_power_of_two();
        (size.trailing_zeros() as usize, size)
    }

    /// `bytes` of zeroed memory, 64-aligned; `ENOLCK`-like `NoLocks` when
    /// the region is full.
    pub fn allocate(&mut self, bytes: u64) -> Result<RemoteAddr, FsError> {
        let (class, size) = Self::class(bytes);
        let offset = match self.free[class].pop() {
            Some(off) => off,
            None if self.top + size <= self.limit => {
                self.top += size;
                self.top - size
            }
            None => return Err(FsError::NoLocks),
        };
        self.in_use += size;
        Ok(RemoteAddr::new(self.memory.id(), offset))
    }

    /// Gives back what [`LockMemory::allocate`] returned for `bytes`.
    pub fn free(&mut self, addr: RemoteAddr, bytes: u64) {
        let (class, size) = Self::class(bytes);
        if let Err(e) = self.memory.write_from(addr, &vec![0u8; size as usize]) {
            log::error!("cannot zero freed lock memory at {addr}: {e}");
            return;
        }
        self.in_use -= size;
        self.free[class].push(addr.offset);
    }

    pub fn memory(&self) -> &Arc<RegionMemory> {
        &self.memory
    }

    /// Bytes handed out and not freed.
    pub fn in_use(&self) -> u64 {
        self.in_use
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
        assert_eq!((a.offset, b.offset), (0, 64), "64-aligned, packed");
        assert_eq!(m.in_use(), 64 + 128);
        mem.write_from(a, &[7u8; 64]).unwrap();
        m.free(a, 10);
        let c = m.allocate(64).unwrap();
        assert_eq!(c, a);
        let mut buf = [1u8; 64];
        mem.read_into(c, &mut buf).unwrap();
        assert_eq!(buf, [0u8; 64], "reused memory is zero");
        assert!(m.allocate(4096).is_err(), "full");
        let mut low = LockMemory::below(mem, 1024);
        assert!(low.allocate(1024).is_ok());
        assert!(low.allocate(64).is_err(), "nothing above the limit");
    }
}
