//! The reclamation point: the one place where server memory that clients
//! address with one-sided verbs becomes reusable, and where every fence of a
//! client begins.
//!
//! Two kinds of memory are lent to clients by address: a file's lock memory
//! ([`crate::lock_areas`]: lock area, Citron tree, record table) and the
//! extents of file data on the data servers ([`crate::extents`]). Both are
//! given back only through [`Reclamation::lock_memory`] and
//! [`Reclamation::extent`], and a client whose lease expired is fenced
//! through [`Reclamation::fence`] before anything of it is released.
//!
//! # The contract of a free
//!
//! Memory passed here may be handed to another file at once. The caller
//! promises that no client can still use the old address, except clients
//! already passed to [`Reclamation::fence`]:
//! * lock memory is freed when its file is idle: no client has it open and
//!   its table holds no record (see [`crate::lock_areas`] for why a client
//!   that has sent its last release no longer holds the addresses);
//! * an extent is freed when its inode is freed (no link, no open, past the
//!   orphan grace — or early under space pressure, when no one has it
//!   open either), when a truncate cuts it off, or when its chunk moves to a
//!   bigger extent. The last two happen while the client that asked holds
//!   the file's inode mutex exclusive; every read and write holds it shared
//!   and reads the file's layout epoch (bumped by both) under it, so no I/O
//!   that started before is still running and none that starts after uses
//!   the old extent.
//!
//! No fixed-time quarantine: memory that no client can address is reused at
//! once (`rm -rf` followed by rewriting the same bytes fits at once).
//!
//! # The contract of a fence, and where revocation plugs in
//!
//! [`Reclamation::fence`] is called when a client's lease has expired,
//! before the meta-server removes its lock records and drops its opens
//! (whose frees then come here with [`Cause::Fenced`]). A fenced client
//! refuses new operations on what it had open (they belong to an old
//! registration), but it may have been stalled in the middle of one and
//! resume it with addresses that now belong to another file: only the
//! servers can refuse those verbs.
//!
//! That is what a [`Revocation`] does ([`Reclamation::set_revocation`]; the
//! per-client grants of the software NIC, with cluster keys): `revoke_client` must
//! return only once every NIC of the cluster — the meta-server's (lock
//! memory, attribute slots) and every data server's — refuses the client's
//! verbs, and in-flight verbs of it have been executed or dropped. Then the
//! frees that follow the fence are safe as well. Until one is installed,
//! `fence` revokes nothing and memory freed because of a fence is reused at
//! once like any other; [`ReclaimStats::unrevoked_frees`] counts the frees
//! a stalled fenced client could still write into. Clients on the shm
//! backend map server memory directly and no NIC stands between them and
//! it: a revocation cannot cover them (they are processes of the server's
//! own host).

use std::sync::Arc;

use citronfs_core::types::{ChunkLoc, ClientId, Ino};
use citronfs_core::FsError;
use parking_lot::{Mutex, RwLock};

use citron_lock::rdma::tcp::Extent;
use citronfs_core::locks::record::BLOCK_BYTES;

use crate::access::{Class, Placed, ServerRef};
use crate::extents::ExtentAllocator;
use crate::lock_areas::{FileLockMemory, LockAreas};

/// Why memory is given back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cause {
    /// The file's last open closed (lock memory, chunks allocated ahead
    /// of a writer and left past the end).
    Idle,
    /// The inode was freed (unlinked, closed everywhere).
    InodeFreed,
    /// A truncate cut the extent off.
    Truncated,
    /// The chunk moved to another extent (grown or shrunk).
    Moved,
    /// Taken for a request but never published (lost a race, or the
    /// request failed): no client ever saw it.
    Unused,
    /// The client's fence dropped its opens or records.
    Fenced(ClientId),
}

/// Stops server NICs from executing a client's verbs (see the module
/// comment for the contract).
pub trait Revocation: Send + Sync {
    /// Returns once every NIC of the cluster refuses verbs of `client`.
    fn revoke_client(&self, client: ClientId) -> Result<(), FsError>;
    /// Returns once no client keeps a grant on `memory` at any NIC: it is
    /// about to be reused. Honest clients no longer use it (the contract of
    /// a free); this keeps a client that kept the address from touching
    /// what the memory will hold next.
    fn revoke_memory(&self, memory: &[Placed]) -> Result<(), FsError>;
}

/// What the reclamation point has done.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReclaimStats {
    pub fences: u64,
    /// Fences whose revocation was confirmed by every NIC.
    pub revoked: u64,
    pub lock_memory_frees: u64,
    pub extent_frees: u64,
    pub extent_bytes_freed: u64,
    /// Frees caused by a fence that no revocation covered.
    pub unrevoked_frees: u64,
    /// The last client fenced, and when.
    pub last_fence: Option<(ClientId, std::time::Instant)>,
}

/// The reclamation point of one meta-server (shared by its namespace, which
/// frees, and its lease reaper, which fences).
#[derive(Default)]
pub struct Reclamation {
    revocation: RwLock<Option<Arc<dyn Revocation>>>,
    stats: Mutex<ReclaimStats>,
    /// Clients fenced without a confirmed revocation.
    unrevoked: Mutex<std::collections::HashSet<ClientId>>,
}

impl Reclamation {
    pub fn new() -> Self {
        Self::default()
    }

    /// Installs how fenced clients' access is revoked at the NICs.
    pub fn set_revocation(&self, revocation: Arc<dyn Revocation>) {
        *self.revocation.write() = Some(revocation);
    }

    /// Fences `client` (its lease expired): revokes its access at every NIC
    /// if a [`Revocation`] is installed. Called before its records and
    /// opens are released.
    pub fn fence(&self, client: ClientId) {
        let revocation = self.revocation.read().clone();
        let revoked = match revocation {
            Some(r) => match r.revoke_client(client) {
                Ok(()) => true,
                Err(e) => {
                    log::error!("revoking the access of fenced client {}: {e}", client.0);
                    false
                }
            },
            None => false,
        };
        let mut stats = self.stats.lock();
        stats.fences += 1;
        stats.last_fence = Some((client, std::time::Instant::now()));
        if revoked {
            stats.revoked += 1;
        } else {
            self.unrevoked.lock().insert(client);
        }
    }

    /// Gives back a file's lock memory, first revoking every grant on it
    /// (lock memory is on the meta-server's own NIC: that is local).
    pub fn lock_memory(&self, areas: &mut LockAreas, ino: Ino, mem: FileLockMemory, cause: Cause) {
        self.count(cause, |s| s.lock_memory_frees += 1);
        if let Some(r) = self.revocation.read().clone() {
            let lock = |start, len| Placed::new(ServerRef::Meta, Extent::new(start, len), Class::Lock);
            let mut memory = vec![lock(mem.area.base, mem.area.bytes)];
            memory.extend(mem.blocks.iter().map(|b| lock(*b, BLOCK_BYTES)));
            if let Err(e) = r.revoke_memory(&memory) {
                log::error!("revoking the grants on the lock memory of inode {}: {e}", ino.0);
            }
        }
        areas.release(ino, mem);
    }

    /// Gives back a data extent.
    pub fn extent(&self, extents: &mut ExtentAllocator, loc: ChunkLoc, cause: Cause) {
        self.count(cause, |s| {
            s.extent_frees += 1;
            s.extent_bytes_freed += loc.capacity;
        });
        extents.free(loc);
    }

    fn count(&self, cause: Cause, f: impl FnOnce(&mut ReclaimStats)) {
        let mut stats = self.stats.lock();
        f(&mut stats);
        if let Cause::Fenced(c) = cause {
            if self.unrevoked.lock().contains(&c) {
                stats.unrevoked_frees += 1;
            }
        }
    }

    pub fn stats(&self) -> ReclaimStats {
        *self.stats.lock()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Refuses;
    impl Revocation for Refuses {
        fn revoke_client(&self, client: ClientId) -> Result<(), FsError> {
            if client.0 == 2 {
                Err(FsError::Io("no".into()))
            } else {
                Ok(())
            }
        }
        fn revoke_memory(&self, _: &[Placed]) -> Result<(), FsError> {
            Ok(())
        }
    }

    #[test]
    fn fences_count_what_revocation_covered() {
        let r = Reclamation::new();
        r.fence(ClientId(1));
        assert_eq!(r.stats().revoked, 0, "nothing revokes before a revocation is installed");
        r.set_revocation(Arc::new(Refuses));
        r.fence(ClientId(3));
        r.fence(ClientId(2));
        let s = r.stats();
        assert_eq!((s.fences, s.revoked), (3, 1));
        let mut extents = ExtentAllocator::new(1 << 20);
        extents.add_server(
            citronfs_core::types::DataServerId(1),
            citron_lock::rdma::RegionId(1),
            1 << 20,
            None,
        );
        let a = extents.allocate(4096, 4096, None).unwrap().loc;
        let b = extents.allocate(4096, 4096, None).unwrap().loc;
        r.extent(&mut extents, a, Cause::Fenced(ClientId(3)));
        r.extent(&mut extents, b, Cause::Fenced(ClientId(2)));
        let s = r.stats();
        assert_eq!((s.extent_frees, s.extent_bytes_freed, s.unrevoked_frees), (2, 8192, 1));
        assert_eq!(extents.free_bytes(), 1 << 20);
    }
}
