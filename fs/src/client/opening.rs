//! Opening and releasing regular files: an open is counted by the
//! meta-server and lends the file's lock memory and layout; the last
//! release here gives them back ([`opens`](super::opens)).

use super::{change_answer, opens, unexpected, FsClient, Opened, RELEASE_WAIT};
use crate::error::FsError;
use crate::proto::{FileLayout, MetaRequest, MetaResponse};
use crate::types::{Attr, Caller, Ino};

impl FsClient {
    /// Opens a regular file for reading and writing as root (counted by the
    /// meta-server until [`FsClient::release`]); the answer lends the
    /// file's lock memory.
    pub fn open(&self, ino: Ino) -> Result<(), FsError> {
        self.open_as(Caller::ROOT, ino, libc::O_RDWR)
    }

    /// Opens a regular file for I/O as `caller` with open(2) `flags` (the
    /// meta-server checks the caller may).
    pub fn open_as(&self, caller: Caller, ino: Ino, flags: i32) -> Result<(), FsError> {
        self.shared.opens.with_entry(ino, |e| {
            let registration = self.registration();
            match self.call(&MetaRequest::Open { caller, client: self.client_id(), ino, flags })? {
                MetaResponse::Layout(l) => {
                    let write = flags & libc::O_ACCMODE != libc::O_RDONLY || flags & libc::O_TRUNC != 0;
                    self.count_open(e, registration, &l, write);
                    self.install_layout(l);
                    Ok(())
                }
                other => Err(unexpected(other)),
            }
        })
    }

    /// Creates a regular file and opens it for I/O, in one round trip;
    /// [`FsError::Exists`] if the name exists (`O_CREAT | O_EXCL`).
    pub fn create_open(&self, caller: Caller, parent: Ino, name: &[u8], perm: u16) -> Result<Attr, FsError> {
        let opened = self.create_or_open(caller, parent, name, perm, true)?;
        debug_assert!(opened.created);
        Ok(opened.attr)
    }

    /// `O_CREAT` without `O_EXCL`: creates a regular file, or opens the
    /// regular file of that name if there is one, in one round trip
    /// (counted by the meta-server until [`FsClient::release`]). Whoever
    /// opens an existing file checks the caller's access to it itself.
    pub fn open_or_create(
        &self,
        caller: Caller,
        parent: Ino,
        name: &[u8],
        perm: u16,
    ) -> Result<Opened, FsError> {
        self.create_or_open(caller, parent, name, perm, false)
    }

    /// [`FsClient::create_open`] (`exclusive`) or
    /// [`FsClient::open_or_create`], with what a caching client was
    /// granted ([`Opened::granted`]).
    pub fn create_or_open(
        &self,
        caller: Caller,
        parent: Ino,
        name: &[u8],
        perm: u16,
        exclusive: bool,
    ) -> Result<Opened, FsError> {
        let client = self.client_id();
        let registration = self.registration();
        let request =
            MetaRequest::CreateOpen { caller, client, parent, name: name.to_vec(), perm, exclusive };
        let (answer, granted) = change_answer(self.call(&request)?);
        let (attr, layout, created) = match answer {
            MetaResponse::Opened(attr, layout) => (attr, layout, true),
            MetaResponse::OpenedExisting(attr, layout) => (attr, layout, false),
            other => return Err(unexpected(other)),
        };
        self.shared.opens.with_entry(attr.ino, |e| self.count_open(e, registration, &layout, true));
        self.install_layout(layout);
        Ok(Opened { attr, created, granted })
    }

    /// Records an open the meta-server counted, and the lock memory it lent.
    pub(super) fn count_open(&self, e: &mut opens::OpenFile, registration: u64, l: &FileLayout, write: bool) {
        if e.registration != registration {
            // Opens of an older registration died with it.
            e.reset(false);
        }
        e.registration = registration;
        e.count += 1;
        e.write |= write;
        // An open's answer lends the lock memory a late create's would.
        e.late = false;
        let area = l.locks.map(|a| self.shared.reachable_area(a));
        if e.area != area {
            e.table = None;
        }
        e.area = area;
    }

    /// Ends one open of `ino`. Only the last one here reaches the
    /// meta-server, handing back every open of the file this client made
    /// (the meta-server needs to know whether a client has a file open, not
    /// how often: grants, lock memory and an unlinked file's data all
    /// follow the last close). It first stops every use of the file's lock
    /// memory ([`opens`]): its blocked lock requests are cancelled and its
    /// addresses forgotten before the meta-server, which may then reuse the
    /// memory, hears of the release.
    pub fn release(&self, ino: Ino) -> Result<(), FsError> {
        self.release_held(ino).map(drop)
    }

    /// [`FsClient::release`], and the file's attributes with the directory
    /// whose delegation holds them again, if the meta-server did
    /// (`MetaResponse::Held`).
    pub fn release_held(&self, ino: Ino) -> Result<Option<(Ino, Attr)>, FsError> {
        let client = self.client_id();
        // Still holding the entry: an open of the file by another thread
        // reaches the meta-server after this release.
        let sent =
            self.end_opens(ino, |opens| self.call_release(&MetaRequest::Release { client, ino, opens }))?;
        Ok(sent.flatten())
    }

    /// Ends one open of `ino` here; at the last one, runs `tell` with the
    /// number of opens to hand back to the meta-server, still holding the
    /// file's entry (`None`: nothing to tell).
    pub(super) fn end_opens<R>(
        &self,
        ino: Ino,
        tell: impl FnOnce(u32) -> Result<R, FsError>,
    ) -> Result<Option<R>, FsError> {
        let current = self.registration();
        let Some(entry) = self.shared.opens.get(ino) else {
            return tell(1).map(Some);
        };
        let mut e = entry.lock();
        // Calls still using the addresses end first (a lock request of a
        // process the kernel abandoned may be running on another worker,
        // an I/O that answered early releasing its range lock), then the
        // waits they may have handed to the waiter thread go. An open
        // counted while the last release waited makes it not the last.
        match entry.end_one(&mut e, current, RELEASE_WAIT) {
            // The meta-server dropped it with an older registration.
            opens::Ending::Stale => return Ok(None),
            opens::Ending::Kept => return Ok(None),
            opens::Ending::Last if e.users > 0 => {
                log::error!("inode {}: calls still use its lock memory after {RELEASE_WAIT:?}", ino.0);
            }
            opens::Ending::Last => {}
        }
        if let Some(w) = self.waiters.as_ref() {
            w.cancel_file(ino);
        }
        self.drop_token(ino);
        let opens = e.deferred + 1;
        e.reset(true);
        self.shared.opens.forget(ino, &entry);
        self.layouts.write().remove(&ino);
        // After the entry went (see `late_changes::created`).
        self.created_layout(ino);
        tell(opens).map(Some)
    }

    fn call_release(&self, request: &MetaRequest) -> Result<Option<(Ino, Attr)>, FsError> {
        match self.call(request)? {
            MetaResponse::Done => Ok(None),
            MetaResponse::Held { dir, attr } => Ok(Some((dir, attr))),
            other => Err(unexpected(other)),
        }
    }

    /// Files open on this client (each counted once).
    pub fn open_files(&self) -> usize {
        self.shared.opens.len()
    }
}
