//! The locked data path (DESIGN.md §4, "Write and read paths"):
//!
//! * a read or write takes the file's inode mutex shared and a range lock
//!   over the bytes it touches, for the duration of the transfer, so
//!   overlapping I/O from different mounts never tears;
//! * truncate, a size-changing `setattr`, `fallocate` and `O_APPEND` writes
//!   take the inode mutex exclusive (the size cannot move under them);
//! * a write that extends the file updates the size and mtime words of its
//!   attribute slot under the file's ALock, which the meta-server's own
//!   threads take locally when they change those words (truncate,
//!   fallocate, utimens).
//!
//! Lock order, the same everywhere: inode mutex, then range lock, then the
//! attribute ALock. Lock-record operations (fcntl) take only range locks, and
//! truncate takes no range lock, so no cycle can form.
//!
//! A file whose layout carries no lock area (never opened by anyone) has no
//! writer to exclude, and is read without locks.

use citron_lock::lock_host::open_lock;
use citron_lock::rdma::Verb;
use citron_lock::rwlock::{Algorithm, Mode, RwLockClient};

use super::{Endpoints, FsClient};
use crate::error::FsError;
use crate::locks::guard::RangeHold;
use crate::locks::{ByteRange, LockArea};
use crate::proto::AttrSlot;
use crate::types::{Attr, Caller, Ino, SetAttr, Timestamp, MAX_FILE_SIZE};

/// An inode mutex held for one operation.
struct InodeHold {
    lock: Box<dyn RwLockClient>,
}

impl FsClient {
    /// The file's lock area, if it has one (where its locks live: also for
    /// diagnostics and tests).
    pub fn lock_area(&self, ino: Ino) -> Result<Option<LockArea>, FsError> {
        Ok(self.layout(ino)?.read().locks)
    }

    /// Takes the inode mutex of `area` in `mode`.
    fn lock_inode(&self, eps: &Endpoints, area: &LockArea, mode: Mode) -> Result<InodeHold, FsError> {
        let mut lock = open_lock(
            area.inode_lock,
            &eps.meta,
            &self.lock_host,
            area.inode_mutex(),
            self.timing.mutex,
            &eps.locks,
        )?;
        lock.acquire(&eps.meta, mode)?;
        Ok(InodeHold { lock })
    }

    fn unlock_inode(&self, eps: &Endpoints, hold: Option<InodeHold>) -> Result<(), FsError> {
        match hold {
            Some(mut h) => Ok(h.lock.release(&eps.meta)?),
            None => Ok(()),
        }
    }

    /// Runs `f` holding the inode mutex of `ino` (if it has lock memory) in
    /// `mode`, and releases it whatever `f` returns.
    fn with_inode_lock<R>(
        &self,
        eps: &mut Endpoints,
        area: Option<LockArea>,
        mode: Mode,
        f: impl FnOnce(&mut Endpoints) -> Result<R, FsError>,
    ) -> Result<R, FsError> {
        let hold = match &area {
            Some(a) => Some(self.lock_inode(eps, a, mode)?),
            None => None,
        };
        let result = f(eps);
        let released = self.unlock_inode(eps, hold);
        let r = result?;
        released?;
        Ok(r)
    }

    /// Reads up to `len` bytes at `offset`; short at end of file; holes read
    /// as zeros.
    pub fn read(&self, ino: Ino, offset: u64, len: u32) -> Result<Vec<u8>, FsError> {
        let area = self.lock_area(ino)?;
        self.with_endpoints(|eps| {
            self.with_inode_lock(eps, area, Mode::Shared, |eps| {
                let (layout, size) = self.current_layout(eps, ino)?;
                let end = offset.saturating_add(len.into()).min(size);
                if offset >= end {
                    return Ok(Vec::new());
                }
                let range = match &area {
                    Some(a) => {
                        Some(RangeHold::acquire(&eps.meta, a, &self.timing, byte_range(offset, end)?)?)
                    }
                    None => None,
                };
                let data = self.read_data(eps, &layout, offset, end);
                if let Some(r) = range {
                    r.release(&eps.meta)?;
                }
                data
            })
        })
    }

    /// Writes `data` at `offset` (or at the end of the file with `append`)
    /// and returns the offset written at.
    pub fn write(&self, ino: Ino, offset: u64, data: &[u8], append: bool) -> Result<u64, FsError> {
        let area = self.lock_area(ino)?;
        let mode = if append { Mode::Exclusive } else { Mode::Shared };
        self.with_endpoints(|eps| {
            self.with_inode_lock(eps, area, mode, |eps| {
                let (layout, size) = self.current_layout(eps, ino)?;
                let offset = if append { size } else { offset };
                let end = offset
                    .checked_add(data.len() as u64)
                    .filter(|e| *e <= MAX_FILE_SIZE)
                    .ok_or(FsError::FileTooBig)?;
                if data.is_empty() {
                    return Ok(offset);
                }
                // Under the exclusive inode mutex no other I/O runs: no
                // range lock needed.
                let range = match (&area, append) {
                    (Some(a), false) => {
                        Some(RangeHold::acquire(&eps.meta, a, &self.timing, byte_range(offset, end)?)?)
                    }
                    _ => None,
                };
                let written = self.write_data(eps, ino, layout, offset, data);
                let published =
                    written.and_then(|l| self.publish(eps, area.as_ref(), l.read().slot, end, size));
                if let Some(r) = range {
                    r.release(&eps.meta)?;
                }
                published?;
                Ok(offset)
            })
        })
    }

    /// After a write that ended at `end`: the size grows to `end` if it was
    /// below (under the attribute ALock), and the mtime becomes now.
    fn publish(
        &self,
        eps: &mut Endpoints,
        area: Option<&LockArea>,
        slot: AttrSlot,
        end: u64,
        size_seen: u64,
    ) -> Result<(), FsError> {
        let now = Timestamp::now().as_nanos().to_le_bytes().to_vec();
        if end <= size_seen {
            // The size only ever grows under shared I/O, so it still covers
            // us: the mtime is one 8-byte store.
            eps.meta.write(slot.mtime(), &now)?;
            return Ok(());
        }
        let Some(area) = area else {
            // No lock memory: a CAS loop up to `end` (nothing else to exclude).
            let mut seen = size_seen;
            while seen < end {
                let old = eps.meta.cas(slot.size(), seen, end)?;
                if old == seen {
                    break;
                }
                seen = old;
            }
            eps.meta.write(slot.mtime(), &now)?;
            return Ok(());
        };
        let mut alock = open_lock(
            Algorithm::ALock,
            &eps.meta,
            &self.lock_host,
            area.attr_lock(),
            self.timing.mutex,
            &eps.locks,
        )?;
        alock.acquire(&eps.meta, Mode::Exclusive)?;
        let updated = (|| -> Result<(), FsError> {
            let current = eps.meta.read_u64(slot.size())?;
            let mut verbs = Vec::with_capacity(2);
            if end > current {
                verbs.push(Verb::Write { addr: slot.size(), data: end.to_le_bytes().to_vec() });
            }
            verbs.push(Verb::Write { addr: slot.mtime(), data: now });
            for r in eps.meta.execute(&verbs)? {
                r.map_err(|e| FsError::Io(format!("attribute slot: {e}")))?;
            }
            Ok(())
        })();
        let released = alock.release(&eps.meta);
        updated?;
        Ok(released?)
    }

    /// `setattr`; a size change (truncate) holds the inode mutex exclusive.
    pub fn setattr(&self, caller: Caller, ino: Ino, set: SetAttr) -> Result<Attr, FsError> {
        let request = crate::proto::MetaRequest::SetAttr { caller, ino, set: set.clone() };
        if set.size.is_none() {
            return self.call_attr(&request);
        }
        // Only regular files have lock memory (and a size to change).
        let area = self.layout(ino).ok().and_then(|l| l.read().locks);
        self.with_endpoints(|eps| {
            self.with_inode_lock(eps, area, Mode::Exclusive, |_| self.call_attr(&request))
        })
    }

    /// Allocates the chunks of `[offset, offset + len)` and, unless
    /// `keep_size`, grows the size to cover it; under the inode mutex
    /// exclusive.
    pub fn fallocate(&self, ino: Ino, offset: u64, len: u64, keep_size: bool) -> Result<(), FsError> {
        let area = self.lock_area(ino)?;
        self.with_endpoints(|eps| {
            self.with_inode_lock(eps, area, Mode::Exclusive, |_| {
                self.call_done(&crate::proto::MetaRequest::Fallocate { ino, offset, len, keep_size })
            })
        })?;
        self.refresh_layout(ino)?;
        Ok(())
    }
}

/// The bytes `offset..end` as an inclusive range (`end > offset`).
fn byte_range(offset: u64, end: u64) -> Result<ByteRange, FsError> {
    ByteRange::new(offset, end - 1).ok_or_else(|| FsError::Invalid(format!("bad byte range {offset}..{end}")))
}
