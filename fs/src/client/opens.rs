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
//!   call pins the entry for as long as it uses them ([`Pinned`]), and one
//!   on a file not open here is refused;
//! * the last release waits until no call has the entry pinned (FUSE sends
//!   a release after the handle's I/O, but a lock request of a process the
//!   kernel abandoned may still be running on another worker), forgets the
//!   addresses, cancels the file's blocked lock requests (the waiter thread
//!   holds a table address) and drops the cached layout, all before it sends
//!   `Release` — holding the entry, so an open of the same file on another
//!   thread waits until the meta-server has seen the release;
//! * closes other than the last are not sent at all (the entry counts
//!   them in `deferred`); the last one's `Release` gives back every open the
//!   meta-server counted for this client, so to the meta-server the file is
//!   open here from the first open to the last close, as it is;
//! * after a lost lease the meta-server forgot this client's opens: entries
//!   of an older registration answer EIO and are dropped when the client
//!   registers again;
//! * after a restart of the meta-server the client reclaims every entry,
//!   naming the lock memory it was lent ([`OpenFiles::reclaimable`]); the
//!   meta-server takes the memory back where it is, and the entry keeps its
//!   registration with the area the answer names (a new range lock, the
//!   same table) ([`OpenFiles::reclaimed`]).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use citron_lock::rdma::RemoteAddr;
use parking_lot::{Condvar, Mutex, MutexGuard};

use crate::error::FsError;
use crate::locks::LockArea;
use crate::proto::ReclaimedOpen;
use crate::types::Ino;

/// This client's opens of one file.
#[derive(Debug, Default)]
pub(super) struct OpenFile {
    /// Opens of the file here now.
    pub count: u32,
    /// Opens closed here that the meta-server has not been told of: only
    /// the last close sends `Release`, handing back `deferred + 1` opens.
    pub deferred: u32,
    /// The client registration they belong to.
    pub registration: u64,
    /// The file's lock memory, lent by the meta-server for as long as the
    /// file is open here.
    pub area: Option<LockArea>,
    /// The first block of its lock-record table, once seen.
    pub table: Option<RemoteAddr>,
    /// Calls using the addresses now ([`Pinned`]).
    pub users: u32,
    /// Set when the last open went: the entry is out of the map, and a
    /// thread that was waiting for it takes a fresh one.
    pub closed: bool,
    /// Created here and answered before the create was sent
    /// ([`late_changes`](super::late_changes)): the create's answer brings
    /// its lock memory and layout.
    pub late: bool,
    /// Some open of it was for writing (told to a restarted meta-server
    /// when this client reclaims it).
    pub write: bool,
    /// A restarted meta-server could not take the open back: calls on it
    /// answer EIO until it is closed.
    pub lost: bool,
}

impl OpenFile {
    /// Forgets the opens and the addresses (calls that still have them
    /// pinned keep their count).
    pub fn reset(&mut self, closed: bool) {
        *self = OpenFile { users: self.users, closed, ..OpenFile::default() };
    }
}

/// One file's entry: its state, and a condition the last release waits on
/// for the calls that use its addresses to end.
#[derive(Debug, Default)]
pub(super) struct Entry {
    state: Mutex<OpenFile>,
    unpinned: Condvar,
}

/// What ending one open of a file here found ([`Entry::end_one`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Ending {
    /// The open was an older registration's (the meta-server dropped it),
    /// or the entry had already gone: nothing to tell.
    Stale,
    /// Other opens of the file remain here: counted as deferred.
    Kept,
    /// The last open here, and no call uses the addresses any more (or
    /// the wait for them ran out): the caller ends the entry.
    Last,
}

impl Entry {
    pub fn lock(&self) -> MutexGuard<'_, OpenFile> {
        self.state.lock()
    }

    /// Ends one open of the file, holding its state `e`: counted as
    /// deferred while others remain; at the last one, waits (up to
    /// `limit`) for the calls still using its addresses. The wait lets the
    /// entry's lock go, and an open of the file may be counted meanwhile
    /// (it finds the entry open and joins it): so the state is looked at
    /// again after it, and an open that came makes this one not the last.
    pub fn end_one(&self, e: &mut MutexGuard<'_, OpenFile>, current: u64, limit: Duration) -> Ending {
        loop {
            if e.closed || e.registration != current {
                return Ending::Stale;
            }
            if e.count > 1 {
                e.count -= 1;
                e.deferred += 1;
                return Ending::Kept;
            }
            if e.users == 0 {
                return Ending::Last;
            }
            if !self.wait_unpinned(e, limit) {
                return Ending::Last;
            }
        }
    }

    /// Waits (up to `limit`) until no call has the entry pinned; `false` if
    /// some still do.
    pub fn wait_unpinned(&self, e: &mut MutexGuard<'_, OpenFile>, limit: Duration) -> bool {
        let deadline = std::time::Instant::now() + limit;
        while e.users > 0 {
            if self.unpinned.wait_until(e, deadline).timed_out() {
                return e.users == 0;
            }
        }
        true
    }
}

pub(super) type OpenEntry = Arc<Entry>;

/// The lock addresses of an open file, held for one call: the file's last
/// release waits until they are dropped.
pub(super) struct Pinned {
    entry: OpenEntry,
    pub area: Option<LockArea>,
    pub table: Option<RemoteAddr>,
    /// The client's registration the open belongs to: its lock memory is
    /// this client's only while that registration lasts
    /// ([`FsClient::with_pinned_endpoints`](super::FsClient)).
    pub registration: u64,
    /// The file was created here by a create not answered yet
    /// ([`OpenFile::late`]): `area` is still to come.
    pub late: bool,
}

impl Pinned {
    /// Remembers the first block of the file's table, if the entry still
    /// lends the same area.
    pub fn set_table(&self, table: RemoteAddr) {
        let mut e = self.entry.lock();
        if e.area == self.area && !e.closed {
            e.table = Some(table);
        }
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        let mut e = self.entry.lock();
        e.users -= 1;
        if e.users == 0 {
            self.entry.unpinned.notify_all();
        }
    }
}
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

    /// The lock addresses of `ino`, pinned for one call; an error if the
    /// file is not open here, or was opened by an older registration.
    pub fn pin(&self, ino: Ino, registration: u64) -> Result<Pinned, FsError> {
        let entry = self.get(ino).ok_or_else(|| not_open(ino))?;
        let (area, table, late) = {
            let mut e = entry.lock();
            let area = area_of(&e, ino, registration)?;
            e.users += 1;
            (area, e.table, e.late)
        };
        Ok(Pinned { entry, area, table, registration, late })
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
                e.reset(true);
                self.forget(ino, &entry);
            }
        }
    }

    /// What to reclaim from a restarted meta-server: each open file with
    /// the lock memory it was lent (a late create's file, whose create is
    /// still queued, has none yet: its create counts its open).
    pub fn reclaimable(&self) -> Vec<ReclaimedOpen> {
        let entries: Vec<(Ino, OpenEntry)> = self.map.lock().iter().map(|(i, e)| (*i, e.clone())).collect();
        entries
            .into_iter()
            .filter_map(|(ino, entry)| {
                let e = entry.lock();
                let area = e.area.filter(|_| !e.closed && !e.lost && e.count > 0)?;
                Some(ReclaimedOpen { ino, opens: e.count + e.deferred, write: e.write, area })
            })
            .collect()
    }

    /// A restarted meta-server took the open of `ino` back, lending `area`
    /// (the same memory; its range lock may be new).
    pub fn reclaimed(&self, ino: Ino, area: Option<LockArea>) {
        if let Some(entry) = self.get(ino) {
            let mut e = entry.lock();
            if !e.closed {
                e.area = area;
            }
        }
    }

    /// A restarted meta-server could not take the open of `ino` back.
    pub fn lost(&self, ino: Ino) {
        if let Some(entry) = self.get(ino) {
            entry.lock().lost = true;
        }
    }

    /// Runs `f` unless `ino` is open here or being opened, holding the
    /// map: an open that starts after it sees what `f` did.
    pub fn unless_open(&self, ino: Ino, f: impl FnOnce()) {
        let map = self.map.lock();
        if !map.contains_key(&ino) {
            f();
        }
    }

    /// Files open here.
    pub fn len(&self) -> usize {
        self.map.lock().len()
    }
}

/// The lock area of an open entry, checked against the client's current
/// registration.
fn area_of(e: &OpenFile, ino: Ino, registration: u64) -> Result<Option<LockArea>, FsError> {
    if e.closed || e.count == 0 {
        return Err(not_open(ino));
    }
    if e.lost {
        return Err(FsError::Io(format!(
            "inode {} was open when the meta-server restarted, and it could not be taken back; open it again",
            ino.0
        )));
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

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;

    /// An open counted while the last release waits for a call that still
    /// uses the file's addresses (it joins the entry, which is not closed
    /// yet) makes that release not the last: the entry stays, with the
    /// new open, and a call through it finds the file open.
    #[test]
    fn an_open_counted_while_the_last_release_waits_keeps_the_file_open() {
        let files = Arc::new(OpenFiles::default());
        let (ino, registration) = (Ino(7), 1);
        files.with_entry(ino, |e| {
            e.registration = registration;
            e.count = 1;
        });
        let in_flight = files.pin(ino, registration).expect("the file is open");
        let waiting = Arc::new(AtomicBool::new(false));
        let release = {
            let (files, waiting) = (files.clone(), waiting.clone());
            std::thread::spawn(move || {
                let entry = files.get(ino).expect("the file is open");
                let mut e = entry.lock();
                waiting.store(true, Ordering::SeqCst);
                entry.end_one(&mut e, registration, Duration::from_secs(60))
            })
        };
        while !waiting.load(Ordering::SeqCst) {
            std::thread::yield_now();
        }
        // The release holds the entry until it waits, which lets it go:
        // this open is counted while it waits.
        files.with_entry(ino, |e| {
            assert!(!e.closed);
            e.count += 1;
        });
        drop(in_flight);
        assert_eq!(release.join().unwrap(), Ending::Kept, "the release took the new open's entry with it");
        let pinned = files.pin(ino, registration);
        assert!(pinned.is_ok(), "a call through the new open found the file not open");
    }
}
