//! The cluster's waits-for table of blocked POSIX owners as the meta-server
//! grows it (no fixed cap on waiters). The layout, the
//! readers and the publishers are `citronfs_core::locks::waits_for`
//! ("Blocks"): a chain of blocks, the last entry of each the link to the
//! next. Clients ask for a block when they find the chain full
//! (`GrowWaitsFor`); the meta-server
//! * answers the block already linked after the one asked about (a
//!   publisher that lost the race gets the one another added), or that
//!   block itself while it has a free entry (only a full chain grows, so a
//!   client cannot make it grow for nothing);
//! * else allocates a zeroed block of lock memory, grants it to every
//!   admitted client ([`Access::extend_membership`]; clients admitted later
//!   get it with the membership), and only then writes the link that makes
//!   it reachable: whoever follows the link may use the block.
//!
//! Blocks are never freed: the chain is as long as the most owners that
//! ever waited at once.

use citron_lock::rdma::tcp::Extent;
use citron_lock::rdma::RemoteAddr;
use citronfs_core::locks::record::{pack_addr, unpack_addr};
use citronfs_core::locks::WaitsFor;
use citronfs_core::FsError;
use parking_lot::Mutex;

use crate::access::{Access, Class, Placed, ServerRef};
use crate::journal::Logged;

/// The table and its blocks in chain order (the first is `table.base`).
pub struct WaitsForChain {
    table: WaitsFor,
    /// Its lock orders growth.
    blocks: Mutex<Vec<RemoteAddr>>,
}

impl WaitsForChain {
    /// The table as the cluster made it: one block.
    pub fn new(table: WaitsFor) -> Self {
        Self { table, blocks: Mutex::new(vec![table.base]) }
    }

    /// After a restart that kept the lock region: takes the blocks the
    /// chain grew by back from `memory` (following the links from the
    /// first), and answers them. Their entries are as the waiting owners
    /// left them.
    pub fn readopt(&self, memory: &mut crate::lock_memory::LockMemory) -> Vec<RemoteAddr> {
        let bytes = WaitsFor::bytes(self.table.capacity);
        let mut chain = self.blocks.lock();
        let mut grown = Vec::new();
        loop {
            let last = *chain.last().expect("the chain has its first block");
            let link = self.table.link(last);
            let word = memory.memory().word(link).map(|w| w.load(std::sync::atomic::Ordering::SeqCst));
            let Some(next) = word.ok().and_then(unpack_addr) else { break };
            if chain.contains(&next) || !memory.claim(next, bytes) {
                log::error!(
                    "the waits-for table's link at {link} names {next}, which is not a free block; cut"
                );
                if let Ok(w) = memory.memory().word(link) {
                    w.store(0, std::sync::atomic::Ordering::SeqCst);
                }
                break;
            }
            chain.push(next);
            grown.push(next);
        }
        grown
    }

    /// Blocks now.
    pub fn blocks(&self) -> usize {
        self.blocks.lock().len()
    }

    /// The block after `last` (see the module comment); `ns` holds the lock
    /// memory, `access` the grants.
    pub fn grow(&self, last: RemoteAddr, ns: &Logged, access: &Access) -> Result<RemoteAddr, FsError> {
        let mut chain = self.blocks.lock();
        let at = chain
            .iter()
            .position(|b| *b == last)
            .ok_or_else(|| FsError::Invalid(format!("{last} is not a block of the waits-for table")))?;
        if let Some(next) = chain.get(at + 1) {
            return Ok(*next);
        }
        let has_room = {
            let ns = ns.lock();
            self.table.entry_heads(last).any(|e| ns.lock_memory_word(e).is_some_and(WaitsFor::is_free))
        };
        if has_room {
            return Ok(last);
        }
        let bytes = WaitsFor::bytes(self.table.capacity);
        let block = ns.lock().allocate_lock_memory(bytes)?;
        let packed = pack_addr(block)
            .ok_or_else(|| FsError::Io(format!("waits-for block address {block} does not pack")))?;
        access.extend_membership(vec![Placed::new(ServerRef::Meta, Extent::new(block, bytes), Class::Lock)]);
        ns.lock().store_lock_word(self.table.link(last), packed)?;
        chain.push(block);
        log::info!("waits-for table grew to {} blocks of {} entries", chain.len(), self.table.capacity);
        Ok(block)
    }
}
