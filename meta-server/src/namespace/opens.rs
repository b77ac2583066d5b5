//! Opens of regular files, counted per client, and the lock memory that
//! follows them ([`crate::lock_areas`]): a file gets lock memory at an open
//! when it has none, and gives it back when it is idle — no open left on any
//! client (the meta-server's own pins included) and no record in its table.

use std::sync::atomic::Ordering::SeqCst;

use citron_lock::citron::host::InstanceId;
use citron_lock::range_lock::RangeLockSite;
use citron_lock::rdma::RemoteAddr;
use citronfs_core::locks::LockArea;
use citronfs_core::proto::FileLayout;
use citronfs_core::types::{ClientId, Ino};
use citronfs_core::FsError;

use super::{Content, LockTableRef, Namespace, RegularFile};
use crate::lock_areas::LockAreaUsage;
use crate::lock_cleanup::META_CLIENT;
use crate::reclaim::Cause;

/// Counts of files for `status`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FileCounts {
    pub inodes: u64,
    pub regular_files: u64,
    /// Regular files open on some client.
    pub open_files: u64,
    /// Opens counted over all clients.
    pub opens: u64,
    /// Regular files the meta-server can hold (attribute slots).
    pub max_files: u64,
    /// Bytes of data-server memory the files' extents take.
    pub allocated: u64,
    /// Regular files with data on a data server that is gone.
    pub lost_data: u64,
}

impl Namespace {
    /// Opens `ino` for `client`: gives the file lock memory if it has none
    /// (`TooManyOpenFiles` when lock memory is full), counts the open, and
    /// answers the layout with the lock area.
    pub fn open(&mut self, client: ClientId, ino: Ino) -> Result<FileLayout, FsError> {
        if self.file(ino)?.locks.is_none() {
            let size = self.slots.word(self.file(ino)?.slot.size()).load(SeqCst);
            let mem = self.locks.create(ino, size)?;
            self.file_mut(ino)?.locks = Some(mem);
        }
        *self.file_mut(ino)?.opens.entry(client).or_insert(0) += 1;
        self.layout_for(ino, true)
    }

    /// Takes back `opens` of `client`'s opens of `ino` from before the
    /// meta-server restarted, with the lock memory it had then (`area`):
    /// the first client to reclaim the file brings its area and table back
    /// ([`crate::lock_areas::LockAreas::reclaim`]), later ones find them.
    pub fn reclaim_open(
        &mut self,
        client: ClientId,
        ino: Ino,
        opens: u32,
        area: LockArea,
    ) -> Result<FileLayout, FsError> {
        match &self.file(ino)?.locks {
            Some(mem) if mem.area.base == area.base => {}
            Some(mem) => {
                return Err(FsError::Invalid(format!(
                    "inode {} was reclaimed with lock area {}, not {}",
                    ino.0, mem.area.base, area.base
                )))
            }
            None => {
                let size = self.slots.word(self.file(ino)?.slot.size()).load(SeqCst);
                let mem = self.locks.reclaim(ino, size, area)?;
                self.file_mut(ino)?.locks = Some(mem);
            }
        }
        *self.file_mut(ino)?.opens.entry(client).or_insert(0) += opens.max(1);
        self.layout_for(ino, true)
    }

    /// While `true`, no lock memory is handed out (the grace period after a
    /// restart, see [`crate::lock_areas::LockAreas::set_frozen`]).
    pub fn freeze_lock_memory(&mut self, frozen: bool) {
        self.locks.set_frozen(frozen);
    }

    /// Whether lock memory is frozen now.
    pub fn lock_memory_frozen(&self) -> bool {
        self.locks.frozen()
    }

    /// Gives back `opens` of `client`'s opens of `ino` (a client releases
    /// all it counted at its last close); the last one cluster-wide gives
    /// the file's lock memory back if its table is empty.
    pub fn release(&mut self, client: ClientId, ino: Ino, opens: u32) -> Result<(), FsError> {
        let f = self.file_mut(ino)?;
        if let Some(n) = f.opens.get_mut(&client) {
            *n = n.saturating_sub(opens.max(1));
            if *n == 0 {
                f.opens.remove(&client);
            }
        }
        self.maybe_idle(ino, Cause::Idle);
        self.trim_ahead(ino, Cause::Idle);
        self.maybe_free(ino);
        Ok(())
    }

    /// Ends one [`Namespace::pin_attr_lock`]; the last gives the lock memory
    /// back if the file went idle meanwhile.
    pub fn unpin_attr_lock(&mut self, ino: Ino) {
        let Some(pins) = self.attr_pins.get_mut(&ino) else {
            log::error!("unpinning the attribute ALock of inode {}, which is not pinned", ino.0);
            return;
        };
        *pins -= 1;
        if *pins == 0 {
            self.attr_pins.remove(&ino);
            self.maybe_idle(ino, Cause::Idle);
        }
    }

    /// Gives back the lock memory of `ino` if no one has it open and its
    /// table holds no record (see [`crate::lock_areas`] for why no client
    /// can still use the addresses).
    fn maybe_idle(&mut self, ino: Ino, cause: Cause) {
        if self.attr_pins.contains_key(&ino) {
            // A request uses its attribute ALock: `unpin_attr_lock` frees it.
            return;
        }
        let Ok(f) = self.file(ino) else { return };
        let Some(mem) = f.locks.as_ref().filter(|_| f.opens.is_empty()) else { return };
        if self.locks.holds_records(mem) {
            log::debug!("inode {} is closed everywhere but holds lock records: its lock memory stays", ino.0);
            return;
        }
        let mem = self.file_mut(ino).ok().and_then(|f| f.locks.take()).expect("checked above");
        self.reclaim.lock_memory(&mut self.locks, ino, mem, cause);
    }

    /// Forgets every open of a client that was fenced
    /// ([`crate::reclaim::Reclamation::fence`]); files it leaves idle give
    /// their lock memory back.
    pub fn drop_client(&mut self, client: ClientId) {
        self.forget_loan(client);
        let inos: Vec<Ino> = self
            .inodes
            .iter()
            .filter(|(_, i)| matches!(&i.content, Content::File(f) if f.opens.contains_key(&client)))
            .map(|(ino, _)| *ino)
            .collect();
        for ino in inos {
            if let Ok(f) = self.file_mut(ino) {
                f.opens.remove(&client);
            }
            self.maybe_idle(ino, Cause::Fenced(client));
            self.trim_ahead(ino, Cause::Fenced(client));
            self.maybe_free(ino);
        }
    }

    /// Every file with a lock-record table, each pinned — counted as an open
    /// of the meta-server's own ([`META_CLIENT`]) — so that its lock memory
    /// stays while the caller works on it with verbs; [`Namespace::unpin`]
    /// each afterwards.
    pub fn pin_lock_tables(&mut self) -> Vec<LockTableRef> {
        let tables: Vec<LockTableRef> = self
            .inodes
            .iter()
            .filter_map(|(ino, i)| match &i.content {
                Content::File(RegularFile { locks: Some(l), .. }) => {
                    l.blocks.first().map(|&first_block| LockTableRef { ino: *ino, area: l.area, first_block })
                }
                _ => None,
            })
            .collect();
        for t in &tables {
            if let Ok(f) = self.file_mut(t.ino) {
                *f.opens.entry(META_CLIENT).or_insert(0) += 1;
            }
        }
        tables
    }

    /// Ends a pin of [`Namespace::pin_lock_tables`]; `cause` is why the pin
    /// was taken (a fence's cleanup: its frees are the fence's).
    pub fn unpin(&mut self, ino: Ino, cause: Cause) {
        let Ok(f) = self.file_mut(ino) else { return };
        if let Some(n) = f.opens.get_mut(&META_CLIENT) {
            *n -= 1;
            if *n == 0 {
                f.opens.remove(&META_CLIENT);
            }
        }
        self.maybe_idle(ino, cause);
        self.trim_ahead(ino, cause);
        self.maybe_free(ino);
    }

    /// A file's lock area, while it has lock memory (diagnostics, tests).
    pub fn lock_area(&self, ino: Ino) -> Option<LockArea> {
        self.file(ino).ok()?.locks.as_ref().map(|l| l.area)
    }

    /// The hosted Citron tree of a file, if it has one: its instance.
    pub fn hosted_tree(&self, ino: Ino) -> Option<(InstanceId, RangeLockSite)> {
        self.file(ino).ok()?.locks.as_ref()?.hosted_tree()
    }

    /// Creates the lock-record table of an open file, or appends a block
    /// after `last` if that is still the last one; returns the first block.
    pub fn grow_lock_table(&mut self, ino: Ino, last: Option<RemoteAddr>) -> Result<RemoteAddr, FsError> {
        let Namespace { inodes, locks, .. } = self;
        let mem = match inodes.get_mut(&ino).map(|i| &mut i.content) {
            Some(Content::File(RegularFile { locks: Some(mem), .. })) => mem,
            Some(Content::File(_)) => {
                return Err(FsError::Invalid(format!("lock table of inode {}, which is not open", ino.0)))
            }
            Some(_) => return Err(FsError::Invalid("not a regular file".into())),
            None => return Err(FsError::NotFound),
        };
        locks.grow_table(mem, last)
    }

    /// A word of the lock region (diagnostics).
    pub fn lock_memory_word(&self, addr: RemoteAddr) -> Option<u64> {
        self.locks.word(addr)
    }

    /// Lock memory allocated and not freed in the lock region's allocator,
    /// in bytes (not the tree host's arena).
    pub fn lock_memory_in_use(&self) -> u64 {
        self.locks.in_use()
    }

    /// What the files' lock memory is doing.
    pub fn lock_usage(&self) -> LockAreaUsage {
        self.locks.usage()
    }

    /// Allocates lock memory outside any file (the waits-for table's
    /// blocks). Zeroed: the allocator zeroes what it is given back.
    pub fn allocate_lock_memory(&mut self, bytes: u64) -> Result<RemoteAddr, FsError> {
        self.locks.allocate_shared(bytes)
    }

    /// Stores a word of the lock region (a link to a new block).
    pub fn store_lock_word(&self, addr: RemoteAddr, value: u64) -> Result<(), FsError> {
        self.locks.store_word(addr, value)
    }

    /// Opens per client (the meta-server's own pins left out).
    pub fn opens_by_client(&self) -> std::collections::HashMap<ClientId, u64> {
        let mut by = std::collections::HashMap::new();
        for i in self.inodes.values() {
            if let Content::File(f) = &i.content {
                for (c, n) in f.opens.iter().filter(|(c, _)| **c != META_CLIENT) {
                    *by.entry(*c).or_insert(0) += u64::from(*n);
                }
            }
        }
        by
    }

    /// Counts of files and opens.
    pub fn file_counts(&self) -> FileCounts {
        let mut c = FileCounts {
            inodes: self.inodes.len() as u64,
            max_files: self.slots.capacity(),
            ..FileCounts::default()
        };
        for i in self.inodes.values() {
            if let Content::File(f) = &i.content {
                c.regular_files += 1;
                c.allocated += f.allocated;
                let opens: u64 =
                    f.opens.iter().filter(|(k, _)| **k != META_CLIENT).map(|(_, n)| u64::from(*n)).sum();
                c.opens += opens;
                c.open_files += u64::from(opens > 0);
                c.lost_data += u64::from(f.chunks.values().any(|l| self.lost_servers.contains(&l.server)));
            }
        }
        c
    }
}
