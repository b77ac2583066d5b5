//! The files this client has open, and the lock memory each open lends it
//! (DESIGN.md §4, "lock memory follows use").
//!
//! The meta-server hands a file's lock addresses (its [`LockArea`], and the
//! first block of its record table once it exists) only in the answer of an
//! open, and reuses that memory for another file as soon as the file is
//! closed on every client and holds no lock record. So this client uses the
//! addresses only while it has the file open, and gives them up before its
//! last release of the file reaches the meta-server:
//! * they live here, with the count of this client's opens of the file and
//!   the registration they were made under; a read, write, truncate or lock
//!   call looks them up here, and one on a file not open here is refused;
//! * the last release forgets them, cancels the file's blocked lock
//!   requests (the waiter thread holds a table address) and drops the cached
//!   layout, all before it sends `Release` — holding the entry, so an open
//!   of the same file on another thread waits until the meta-server has
//!   seen the release;
//! * after a lost lease the meta-server forgot this client's opens: entries
//!   of an older registration answer EIO and are dropped when the client
//!   registers again.

use std::collections::HashMap;
use std::sync::Arc;

use citron_lock::rdma::RemoteAddr;
use parking_lot::Mutex;

use crate::error::FsError;
use crate::locks::LockArea;
use crate::types::Ino;

/// This client's opens of one file.
#[derive(Debug, Default)]
pub(super) struct OpenFile {
    /// Opens the meta-server has counted for this client.
    pub count: u32,
    /// The client registration they belong to.
    pub registration: u64,
    /// The file's lock memory, lent by the meta-server for as long as the
    /// file is open here.
    pub area: Option<LockArea>,
    /// The first block of its lock-record table, once seen.
    pub table: Option<RemoteAddr>,
    /// Set when the last open went: the entry is out of the map, and a
    /// thread that was waiting for it takes a fresh one.
    pub closed: bool,
}

pub(super) type OpenEntry = Arc<Mutex<OpenFile>>;

/// The open files of a client.
#[derive(Default)]
pub(super) struct OpenFiles {
    map: Mutex<HashMap<Ino, OpenEntry>>,
}

impl OpenFiles {
    /// Runs `f` on the entry of `ino` (a fresh one if the file is not open
    /// here), holding it; an entry left with no open goes away.
    pub fn with_entry<R>(&self, ino: Ino, mut f: impl FnMut(&mut OpenFile) -> R) -> R {
        loop {
            let entry = self.map.lock().entry(ino).or_default().clone();
            let mut e = entry.lock();
            if e.closed {
                continue;
            }
            let r = f(&mut e);
            if e.count == 0 {
                e.closed = true;
                self.forget(ino, &entry);
            }
            return r;
        }
    }

    /// The entry of `ino`, if the file is open here.
    pub fn get(&self, ino: Ino) -> Option<OpenEntry> {
        self.map.lock().get(&ino).cloned()
    }

    /// Removes `entry` from the map if it is still the one for `ino`.
    pub fn forget(&self, ino: Ino, entry: &OpenEntry) {
        let mut map = self.map.lock();
        if map.get(&ino).is_some_and(|e| Arc::ptr_eq(e, entry)) {
            map.remove(&ino);
        }
    }

    /// Forgets every open of a registration older than `current` (the
    /// meta-server dropped them when it fenced this client).
    pub fn drop_older_than(&self, current: u64) {
        let entries: Vec<(Ino, OpenEntry)> = self.map.lock().iter().map(|(i, e)| (*i, e.clone())).collect();
        for (ino, entry) in entries {
            let mut e = entry.lock();
            if e.registration < current && !e.closed {
                *e = OpenFile { closed: true, ..OpenFile::default() };
                self.forget(ino, &entry);
            }
        }
    }

    /// Files open here.
    pub fn len(&self) -> usize {
        self.map.lock().len()
    }
}

/// The lock area of an open entry, checked against the client's current
/// registration.
pub(super) fn area_of(e: &OpenFile, ino: Ino, registration: u64) -> Result<Option<LockArea>, FsError> {
    if e.closed || e.count == 0 {
        return Err(not_open(ino));
    }
    if e.registration != registration {
        return Err(FsError::Io(format!(
            "inode {} was opened before this client lost its lease; open it again",
            ino.0
        )));
    }
    Ok(e.area)
}

pub(super) fn not_open(ino: Ino) -> FsError {
    FsError::Invalid(format!("inode {} is not open on this client", ino.0))
}
