//! Lock memory that follows use (DESIGN.md §4): a file's lock memory — its
//! lock area (record-table head, attribute ALock, inode mutex), its range
//! lock (a Citron tree instance on the meta-server's tree host, or the words
//! of a fixed tree or of the segments) and the blocks of its lock-record
//! table — exists while the file is open on some mount or holds lock
//! records, and goes back to the meta-server when the file is idle: at the
//! last release cluster-wide, when its table holds no record.
//!
//! So lock memory bounds only how many files are open at once in the
//! cluster, never how many were ever opened: a mount may open, write and
//! close millions of files one after another. An open that finds lock
//! memory full fails with [`FsError::TooManyOpenFiles`] (ENFILE, as a
//! kernel's full file table does), and the meta-server logs that
//! `--lock-memory` is the limit to raise.
//!
//! # Why reuse is safe
//!
//! The meta-server frees a file's lock memory and may hand the same bytes to
//! another file at once. That is safe because every client touches a file's
//! lock memory only while it has the file open, and gives up the addresses
//! before its last release reaches the meta-server:
//! * the addresses come only with an open's answer (`Open`, `CreateOpen`);
//!   a `Layout` answer carries none;
//! * the client keeps them with its count of the file's opens and forgets
//!   them at its last release, before it sends `Release`
//!   (`citronfs_core::client`); FUSE sends a handle's release only after
//!   the last I/O on it has answered, and I/O without an open handle is
//!   refused;
//! * a blocked `F_SETLKW` of the mount keeps a table address in its waiter
//!   thread: the client cancels the file's waits, and waits for the
//!   cancellation, before its last `Release` (`Waiters::cancel_file`);
//! * the meta-server counts opens per client, so "idle" means every client
//!   has sent its last release; its own cleanup of a fenced client's
//!   records pins the files it visits as an open of its own
//!   ([`crate::lock_cleanup`]);
//! * a file whose table still holds records (a lock that outlived every
//!   open, or a fenced client's that the cleanup has not removed yet)
//!   keeps its memory until they are gone.
//!
//! What remains is a client that stops being one without telling: fenced
//! (its lease expired, the meta-server dropped its opens) or stalled in the
//! middle of an operation, which may resume and issue verbs with the old
//! addresses. A fenced client refuses new operations on what it had open
//! (its opens belong to an old registration), but an operation already
//! past that check cannot be stopped by the client itself: only the server
//! can refuse its verbs. Every fence and every free therefore passes the
//! reclamation point ([`crate::reclaim`]), where revoking a fenced client's
//! access at the NICs plugs in.
//!
//! Freed lock memory is zeroed (an idle lock, an empty table) before it is
//! handed out again: by [`LockMemory::free`], and by the tree host at
//! allocation.

use std::time::{Duration, Instant};

use citron_lock::citron::host::{InstanceId, TreeHost, TreeHostError};
use citron_lock::citron::tree::TreeShape;
use citron_lock::dslr::DSLR_BYTES;
use citron_lock::range_lock::{RangeAlgorithm, RangeLockSite};
use citron_lock::rdma::RemoteAddr;
use citronfs_core::locks::area::LockChoice;
use citronfs_core::locks::record::{
    block_header, header_state, pack_addr, unpack_addr, BLOCK_BYTES, SLOTS_PER_BLOCK,
};
use citronfs_core::locks::record::{BLOCK_HEADER_BYTES, FREE, SLOT_BYTES};
use citronfs_core::locks::LockArea;
use citronfs_core::types::Ino;
use citronfs_core::FsError;

use crate::lock_memory::LockMemory;
use crate::namespace::TreeHosting;

/// How often at most the meta-server repeats that lock memory is full.
const FULL_WARNING_EVERY: Duration = Duration::from_secs(10);

/// One file's lock memory: its area and the blocks of its lock-record table.
#[derive(Debug)]
pub struct FileLockMemory {
    pub area: LockArea,
    pub blocks: Vec<RemoteAddr>,
}

impl FileLockMemory {
    /// The hosted Citron tree, if the file's range lock is one.
    pub fn hosted_tree(&self) -> Option<(InstanceId, RangeLockSite)> {
        match self.area.range {
            site @ RangeLockSite::CitronHosted { instance, .. } => Some((instance, site)),
            _ => None,
        }
    }
}

/// The meta-server's lock memory for files: the lock region's allocator and
/// the Citron tree host.
pub struct LockAreas {
    memory: LockMemory,
    /// How files are locked (range and inode-mutex algorithms, granule).
    choice: LockChoice,
    /// The RPC range lock server, when files use it.
    range_server: Option<std::net::SocketAddr>,
    /// Where files' Citron trees live when they grow.
    trees: Option<TreeHosting>,
    /// Files that have lock memory now.
    files: u64,
    /// The largest `files` has been.
    peak_files: u64,
    /// Opens refused because lock memory was full.
    refused: u64,
    last_warning: Option<Instant>,
    /// Bytes of lock memory the meta-server was configured with
    /// (`--lock-memory`), for messages and status.
    configured: u64,
    /// Allocations wait ([`LockAreas::set_frozen`]).
    frozen: bool,
}

impl LockAreas {
    pub fn new(
        memory: LockMemory,
        choice: LockChoice,
        range_server: Option<std::net::SocketAddr>,
        trees: Option<TreeHosting>,
        configured: u64,
    ) -> Self {
        let trees = trees.filter(|_| choice.range == RangeAlgorithm::Citron);
        Self {
            memory,
            choice,
            range_server,
            trees,
            files: 0,
            peak_files: 0,
            refused: 0,
            last_warning: None,
            configured,
            frozen: false,
        }
    }

    /// Lock memory for a file of `size` bytes that is being opened;
    /// [`FsError::TooManyOpenFiles`] when lock memory is full.
    pub fn create(&mut self, ino: Ino, size: u64) -> Result<FileLockMemory, FsError> {
        self.unfrozen()?;
        let made = match self.trees.clone() {
            Some(trees) => self.hosted_area(&trees, size),
            None => {
                let bad = |e: citron_lock::rwlock::LockError| FsError::Io(format!("lock area: {e}"));
                let bytes = LockArea::bytes_for(self.choice, size).map_err(bad)?;
                let base = self.memory.allocate(bytes)?;
                LockArea::plan(base, self.choice, size, ino, self.range_server).map_err(|e| {
                    self.memory.free(base, bytes);
                    bad(e)
                })
            }
        };
        match made {
            Ok(area) => {
                self.files += 1;
                self.peak_files = self.peak_files.max(self.files);
                Ok(FileLockMemory { area, blocks: Vec::new() })
            }
            Err(FsError::NoLocks) => {
                self.refused += 1;
                if self.last_warning.is_none_or(|t| t.elapsed() >= FULL_WARNING_EVERY) {
                    self.last_warning = Some(Instant::now());
                    log::warn!(
                        "lock memory is full: {} files are open cluster-wide ({} bytes of lock memory in \
                         use of --lock-memory {}); opens answer ENFILE until files close. Raise \
                         --lock-memory to keep more files open at once ({} opens refused so far)",
                        self.files,
                        self.in_use(),
                        self.configured,
                        self.refused
                    );
                }
                Err(FsError::TooManyOpenFiles)
            }
            Err(e) => Err(e),
        }
    }

    /// A lock area whose range lock is a new instance of the tree host
    /// ([`LockAreas::hosted_site`]); the area itself holds the other locks.
    fn hosted_area(&mut self, trees: &TreeHosting, size: u64) -> Result<LockArea, FsError> {
        let site = self.hosted_site(trees, size)?;
        let made = (|| {
            let base = self.memory.allocate(LockArea::bytes_for_hosted())?;
            LockArea::with_range(base, self.choice, site).map_err(|e| {
                self.memory.free(base, LockArea::bytes_for_hosted());
                FsError::Io(format!("lock area: {e}"))
            })
        })();
        if made.is_err() {
            Self::destroy_site(trees, site);
        }
        made
    }

    /// A new instance of the tree host for a file of `size` bytes: the tree
    /// as [`LockArea::plan`] would size it, its spillover word (an
    /// allocation of the instance, freed with it), scaled by the host up to
    /// `trees.max_depth`.
    fn hosted_site(&mut self, trees: &TreeHosting, size: u64) -> Result<RangeLockSite, FsError> {
        let tree_err = |e: TreeHostError| match e {
            TreeHostError::OutOfMemory { .. } => FsError::NoLocks,
            other => FsError::Io(format!("Citron tree host: {other}")),
        };
        let shape = TreeShape::covering(LockArea::initial_units(self.choice, size));
        let (instance, geometry) = trees.host.create(shape).map_err(tree_err)?;
        let made = (|| {
            let spillover = trees.host.instance(instance).allocate(DSLR_BYTES).map_err(tree_err)?;
            trees.host.enable_scaling(instance, spillover, trees.max_depth).map_err(tree_err)?;
            Ok(RangeLockSite::CitronHosted {
                tree: geometry.maximizer,
                depth: shape.depth(),
                spillover,
                host: trees.addr,
                instance,
                max_depth: trees.max_depth,
            })
        })();
        if made.is_err() {
            let _ = trees.host.destroy(instance);
        }
        made
    }

    fn destroy_site(trees: &TreeHosting, site: RangeLockSite) {
        if let RangeLockSite::CitronHosted { instance, .. } = site {
            let _ = trees.host.destroy(instance);
        }
    }

    /// While `true`, nothing is allocated: a restarted meta-server's free
    /// lock memory may still hold lock areas its clients have not reclaimed
    /// yet (the grace period). Allocations answer [`FsError::Grace`].
    pub fn set_frozen(&mut self, frozen: bool) {
        self.frozen = frozen;
    }

    pub fn frozen(&self) -> bool {
        self.frozen
    }

    fn unfrozen(&self) -> Result<(), FsError> {
        match self.frozen {
            true => Err(FsError::Grace),
            false => Ok(()),
        }
    }

    /// The lock memory a client had for file `ino` (of `size` bytes)
    /// before the meta-server restarted: its area and record table are
    /// taken back where they are, with every lock word and record in them
    /// (the region is a file that outlived the process). A range lock the
    /// old process kept state for (a hosted Citron tree, the RPC range lock
    /// server) is made anew: a range is held only for one I/O, and every
    /// client reclaims before it does I/O again.
    pub fn reclaim(&mut self, ino: Ino, size: u64, old: LockArea) -> Result<FileLockMemory, FsError> {
        let refused = |why: &str| {
            FsError::Invalid(format!("inode {}: cannot reclaim lock area {}: {why}", ino.0, old.base))
        };
        let range = match old.range {
            RangeLockSite::CitronHosted { .. } => {
                let trees =
                    self.trees.clone().ok_or_else(|| refused("this meta-server hosts no Citron trees"))?;
                self.hosted_site(&trees, size)?
            }
            RangeLockSite::Rpc { instance, .. } => RangeLockSite::Rpc {
                server: self
                    .range_server
                    .ok_or_else(|| refused("this meta-server runs no range lock server"))?,
                instance,
            },
            kept => kept,
        };
        let area = LockArea { range, ..old };
        if !self.memory.claim(old.base, old.bytes) {
            if let Some(trees) = &self.trees {
                Self::destroy_site(trees, range);
            }
            return Err(refused("its memory is not free"));
        }
        // The record table: the chain of blocks from the area's head.
        let mut blocks = Vec::new();
        let mut link = area.table_head();
        while let Some(block) = self.word(link).and_then(unpack_addr) {
            if blocks.len() as u64 > self.memory.capacity() / BLOCK_BYTES
                || !self.memory.claim(block, BLOCK_BYTES)
            {
                log::error!(
                    "inode {}: the lock table's block {block} is not free; the table ends before it",
                    ino.0
                );
                if let Err(e) = self.store(link, 0) {
                    log::error!("cutting the lock table of inode {}: {e}", ino.0);
                }
                break;
            }
            blocks.push(block);
            link = block + 8;
        }
        self.files += 1;
        self.peak_files = self.peak_files.max(self.files);
        Ok(FileLockMemory { area, blocks })
    }

    /// Creates the lock-record table of `mem` (`last: None`), or appends a
    /// block after `last` if that is still the last one; returns the first
    /// block. Idempotent: a request that lost a race gets the table as it is.
    pub fn grow_table(
        &mut self,
        mem: &mut FileLockMemory,
        last: Option<RemoteAddr>,
    ) -> Result<RemoteAddr, FsError> {
        let (first, tail) = (mem.blocks.first().copied(), mem.blocks.last().copied());
        let wanted = match (first, last) {
            (None, _) => true,
            (Some(_), Some(l)) => Some(l) == tail,
            (Some(_), None) => false,
        };
        if !wanted {
            return first.ok_or_else(|| FsError::Io("lock table vanished".into()));
        }
        self.unfrozen()?;
        let block = self.memory.allocate(BLOCK_BYTES)?;
        let packed = match pack_addr(block) {
            Some(p) => p,
            None => {
                self.memory.free(block, BLOCK_BYTES);
                return Err(FsError::Io("lock block address does not pack".into()));
            }
        };
        // The header first, then the link that makes the block reachable
        // (SeqCst stores: a client that reads the link sees the header).
        self.store(block, block_header(SLOTS_PER_BLOCK))?;
        match tail {
            None => self.store(mem.area.table_head(), packed)?,
            Some(t) => self.store(t + 8, packed)?,
        }
        mem.blocks.push(block);
        Ok(mem.blocks[0])
    }

    fn store(&self, addr: RemoteAddr, value: u64) -> Result<(), FsError> {
        let word = self
            .memory
            .memory()
            .word(addr)
            .map_err(|e| FsError::Io(format!("lock memory at {addr}: {e}")))?;
        word.store(value, std::sync::atomic::Ordering::SeqCst);
        Ok(())
    }

    /// Whether `mem`'s table holds a record (held, waiting, or a slot being
    /// written), read from the meta-server's own memory.
    pub fn holds_records(&self, mem: &FileLockMemory) -> bool {
        mem.blocks.iter().any(|&block| {
            (0..u64::from(SLOTS_PER_BLOCK)).any(|i| {
                let slot = block + BLOCK_HEADER_BYTES + i * SLOT_BYTES;
                self.memory
                    .memory()
                    .word(slot)
                    .map_or(true, |w| header_state(w.load(std::sync::atomic::Ordering::SeqCst)) != FREE)
            })
        })
    }

    /// Frees a file's lock memory: its area, its table blocks (zeroed) and
    /// its hosted tree. Only the reclamation point calls this.
    pub(crate) fn release(&mut self, ino: Ino, mem: FileLockMemory) {
        let hosted = mem.hosted_tree();
        self.memory.free(mem.area.base, mem.area.bytes);
        for b in mem.blocks {
            self.memory.free(b, BLOCK_BYTES);
        }
        if let (Some((instance, _)), Some(t)) = (hosted, &self.trees) {
            if let Err(e) = t.host.destroy(instance) {
                log::error!("freeing the Citron tree of inode {}: {e}", ino.0);
            }
        }
        self.files -= 1;
    }

    /// A word of the lock region (diagnostics).
    pub fn word(&self, addr: RemoteAddr) -> Option<u64> {
        self.memory.memory().word(addr).ok().map(|w| w.load(std::sync::atomic::Ordering::SeqCst))
    }

    /// Stores `value` at `addr` of the lock region (SeqCst: what was stored
    /// before is seen by whoever reads this word and follows it).
    pub fn store_word(&self, addr: RemoteAddr, value: u64) -> Result<(), FsError> {
        self.store(addr, value)
    }

    /// Allocates lock memory outside any file (the waits-for table, the lock
    /// services' areas).
    pub fn allocate_shared(&mut self, bytes: u64) -> Result<RemoteAddr, FsError> {
        self.unfrozen()?;
        self.memory.allocate(bytes)
    }

    /// Bytes of the lock region's allocator in use (areas, tables, shared
    /// structures; not the tree host's arena).
    pub fn in_use(&self) -> u64 {
        self.memory.in_use()
    }

    /// What `status` reports.
    pub fn usage(&self) -> LockAreaUsage {
        LockAreaUsage {
            files: self.files,
            peak_files: self.peak_files,
            refused_opens: self.refused,
            area_bytes_in_use: self.memory.in_use(),
            area_bytes: self.memory.capacity(),
            configured: self.configured,
        }
    }
}

/// The lock region's use ([`LockAreas::usage`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LockAreaUsage {
    /// Files that have lock memory (open somewhere, or holding records).
    pub files: u64,
    pub peak_files: u64,
    /// Opens refused with ENFILE.
    pub refused_opens: u64,
    pub area_bytes_in_use: u64,
    pub area_bytes: u64,
    /// `--lock-memory`.
    pub configured: u64,
}
