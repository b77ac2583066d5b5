//! Metadata operations: RPCs to the meta-server (lookups, attributes,
//! directory entries, links, renames, extended attributes), and the
//! coherent caching grants a mount may ask for with them (meta-server
//! `grants`).

use std::sync::atomic::Ordering;
use std::time::Duration;

use super::{change_answer, granted, unexpected, ChangeGrant, FsClient};
use crate::error::FsError;
use crate::proto::{EntryPlus, Grant, Invalidation, MetaRequest, MetaResponse, RenameMode, XattrMode};
use crate::types::{Attr, Caller, ClientId, DirEntry, FileKind, FsStats, Ino};

/// An answer to [`FsClient::await_invalidations`].
#[derive(Debug)]
pub struct Polled {
    /// The registration it polled as.
    pub client: ClientId,
    /// The number of the last invalidation in `items` (the next `acked`).
    pub through: u64,
    pub items: Vec<Invalidation>,
    /// The client's delegations were renewed when the poll arrived, and
    /// `items` holds every invalidation queued before the answer.
    pub renewed: bool,
}

/// What [`FsClient::lookup_granted`] found.
#[derive(Debug)]
pub enum Looked {
    /// The name's inode, its attributes, and what of them is granted.
    Found(Attr, Grant),
    /// No such name, and its absence is granted: the kernel may cache it
    /// for the TTL (whoever makes the name calls this client back first).
    Absent,
}

impl FsClient {
    /// From now on the kernel of this client's mount caches what the
    /// meta-server grants, for `ttl` (zero: nothing). Whoever sets it must
    /// run an invalidation thread ([`FsClient::await_invalidations`]), or
    /// every change elsewhere of what it was granted waits out the grant.
    pub fn set_caching(&self, ttl: Duration) {
        let ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX);
        self.shared.caching_ms.store(ms, Ordering::Relaxed);
    }

    /// The grant TTL this client asks for (zero: it does not cache).
    pub fn caching(&self) -> Duration {
        Duration::from_millis(self.shared.caching_ms.load(Ordering::Relaxed))
    }

    /// A lookup, and what of its answer the kernel may cache (nothing
    /// unless [`FsClient::set_caching`]; then a name that is not there is
    /// [`Looked::Absent`], not `FsError::NotFound`).
    pub fn lookup_granted(&self, caller: Caller, parent: Ino, name: &[u8]) -> Result<Looked, FsError> {
        match self.call(&MetaRequest::Lookup { caller, parent, name: name.to_vec() })? {
            MetaResponse::Absent => Ok(Looked::Absent),
            found => granted(found).map(|(attr, grant)| Looked::Found(attr, grant)),
        }
    }

    /// A getattr, and whether the kernel may cache its answer.
    pub fn getattr_granted(&self, ino: Ino) -> Result<(Attr, Grant), FsError> {
        granted(self.call(&MetaRequest::GetAttr { ino })?)
    }

    /// The long poll of the mount's invalidation thread: acknowledges the
    /// invalidations up to `acked` (the kernel has dropped what they name)
    /// and answers newer ones as soon as there are some (or none, after a
    /// while), with the number to acknowledge next and whether it renewed
    /// the client's delegations. Numbers start again at zero for a new
    /// registration ([`FsClient::client_id`]).
    ///
    /// A poll that acknowledges anything may acknowledge a recall, which
    /// tells the meta-server that this client answers no change there
    /// first and that what it answered is applied: it sends the queued
    /// changes first, as every file-system operation's call does
    /// (`late_changes`). An idle poll, one per `POLL_WAIT` while nothing
    /// happens, acknowledges nothing new and leaves the queues to their
    /// batching: a create queued at that moment still goes with the
    /// extents of the write that follows it.
    pub fn await_invalidations(&self, acked: u64) -> Result<Polled, FsError> {
        let client = self.client_id();
        let request = MetaRequest::AwaitInvalidations { client, acked };
        // Relaxed: one thread polls (the mount's invalidation thread), and
        // this orders nothing else.
        let acknowledges = self.poll_acked.swap(acked, Ordering::Relaxed) != acked;
        if acknowledges {
            self.before_call(&request);
        } else {
            self.add_distance();
        }
        match self.shared.call_plain(&request)? {
            MetaResponse::Invalidations { through, items, renewed } => {
                Ok(Polled { client, through, items, renewed })
            }
            other => Err(unexpected(other)),
        }
    }

    /// Whether the client has left the cluster ([`FsClient::shutdown`]).
    pub fn is_shut_down(&self) -> bool {
        self.shared.stop.load(Ordering::Relaxed)
    }

    pub fn lookup(&self, caller: Caller, parent: Ino, name: &[u8]) -> Result<Attr, FsError> {
        self.call_attr(&MetaRequest::Lookup { caller, parent, name: name.to_vec() })
    }

    pub fn getattr(&self, ino: Ino) -> Result<Attr, FsError> {
        self.call_attr(&MetaRequest::GetAttr { ino })
    }

    pub fn create(
        &self,
        caller: Caller,
        parent: Ino,
        name: &[u8],
        kind: FileKind,
        perm: u16,
        rdev: u32,
    ) -> Result<Attr, FsError> {
        Ok(self.create_granted(caller, parent, name, kind, perm, rdev)?.0)
    }

    /// [`FsClient::create`], and what a caching client was granted with it
    /// (the directory's new attributes).
    pub fn create_granted(
        &self,
        caller: Caller,
        parent: Ino,
        name: &[u8],
        kind: FileKind,
        perm: u16,
        rdev: u32,
    ) -> Result<(Attr, ChangeGrant), FsError> {
        self.call_change_attr(&MetaRequest::Create { caller, parent, name: name.to_vec(), kind, perm, rdev })
    }

    pub fn symlink(&self, caller: Caller, parent: Ino, name: &[u8], target: &[u8]) -> Result<Attr, FsError> {
        Ok(self.symlink_granted(caller, parent, name, target)?.0)
    }

    /// [`FsClient::symlink`], and what a caching client was granted with it.
    pub fn symlink_granted(
        &self,
        caller: Caller,
        parent: Ino,
        name: &[u8],
        target: &[u8],
    ) -> Result<(Attr, ChangeGrant), FsError> {
        let request = MetaRequest::Symlink { caller, parent, name: name.to_vec(), target: target.to_vec() };
        self.call_change_attr(&request)
    }

    pub fn readlink(&self, ino: Ino) -> Result<Vec<u8>, FsError> {
        match self.call(&MetaRequest::ReadLink { ino })? {
            MetaResponse::Target(t) => Ok(t),
            other => Err(unexpected(other)),
        }
    }

    pub fn link(&self, caller: Caller, ino: Ino, new_parent: Ino, new_name: &[u8]) -> Result<Attr, FsError> {
        self.call_attr(&MetaRequest::Link { caller, ino, new_parent, new_name: new_name.to_vec() })
    }

    pub fn unlink(&self, caller: Caller, parent: Ino, name: &[u8]) -> Result<(), FsError> {
        self.unlink_granted(caller, parent, name).map(drop)
    }

    /// [`FsClient::unlink`], what a caching client was granted with it, and
    /// the inode whose name it removed (if the meta-server could tell).
    pub fn unlink_granted(
        &self,
        caller: Caller,
        parent: Ino,
        name: &[u8],
    ) -> Result<(ChangeGrant, Option<Ino>), FsError> {
        let answer = self.call(&MetaRequest::Unlink { caller, parent, name: name.to_vec() });
        // A file closed here a moment ago: its queued release went to the
        // meta-server beside the call (any call but a create's or an open's
        // sends the queue), and its space is free once both are answered,
        // whichever came first there.
        self.flush_releases();
        match change_answer(answer?) {
            (MetaResponse::Removed(ino), grant) => Ok((grant, Some(ino))),
            (MetaResponse::Done, grant) => Ok((grant, None)),
            (other, _) => Err(unexpected(other)),
        }
    }

    pub fn rmdir(&self, caller: Caller, parent: Ino, name: &[u8]) -> Result<(), FsError> {
        self.call_done(&MetaRequest::Rmdir { caller, parent, name: name.to_vec() })
    }

    /// [`FsClient::rmdir`], and what a caching client was granted with it.
    pub fn rmdir_granted(&self, caller: Caller, parent: Ino, name: &[u8]) -> Result<ChangeGrant, FsError> {
        self.call_change_done(&MetaRequest::Rmdir { caller, parent, name: name.to_vec() })
    }

    pub fn rename(
        &self,
        caller: Caller,
        parent: Ino,
        name: &[u8],
        new_parent: Ino,
        new_name: &[u8],
        flags: RenameMode,
    ) -> Result<(), FsError> {
        let done = self.call_done(&MetaRequest::Rename {
            caller,
            parent,
            name: name.to_vec(),
            new_parent,
            new_name: new_name.to_vec(),
            flags,
        });
        // A replaced target closed here a moment ago: as for an unlink.
        self.flush_releases();
        done
    }

    /// Entries after cookie `after` (0: from the start).
    pub fn readdir(&self, caller: Caller, ino: Ino, after: u64, max: u32) -> Result<Vec<DirEntry>, FsError> {
        match self.call(&MetaRequest::ReadDir { caller, ino, after, max })? {
            MetaResponse::Entries(e) => Ok(e),
            other => Err(unexpected(other)),
        }
    }

    /// Entries after cookie `after` with their attributes, and what of each
    /// the kernel may cache (nothing unless [`FsClient::set_caching`]).
    pub fn readdir_plus(
        &self,
        caller: Caller,
        ino: Ino,
        after: u64,
        max: u32,
    ) -> Result<Vec<EntryPlus>, FsError> {
        match self.call(&MetaRequest::ReadDirPlus { caller, ino, after, max })? {
            MetaResponse::EntriesPlus(e) => Ok(e),
            other => Err(unexpected(other)),
        }
    }

    pub fn statfs(&self) -> Result<FsStats, FsError> {
        // What queued releases give back (chunks taken ahead) is counted.
        self.flush_releases();
        match self.call(&MetaRequest::StatFs)? {
            MetaResponse::Stats(s) => Ok(s),
            other => Err(unexpected(other)),
        }
    }

    pub fn set_xattr(
        &self,
        caller: Caller,
        ino: Ino,
        name: &[u8],
        value: &[u8],
        mode: XattrMode,
    ) -> Result<(), FsError> {
        self.call_done(&MetaRequest::SetXattr {
            caller,
            ino,
            name: name.to_vec(),
            value: value.to_vec(),
            mode,
        })
    }

    pub fn get_xattr(&self, caller: Caller, ino: Ino, name: &[u8]) -> Result<Vec<u8>, FsError> {
        match self.call(&MetaRequest::GetXattr { caller, ino, name: name.to_vec() })? {
            MetaResponse::Xattr(v) => Ok(v),
            other => Err(unexpected(other)),
        }
    }

    pub fn list_xattr(&self, caller: Caller, ino: Ino) -> Result<Vec<Vec<u8>>, FsError> {
        match self.call(&MetaRequest::ListXattr { caller, ino })? {
            MetaResponse::XattrNames(v) => Ok(v),
            other => Err(unexpected(other)),
        }
    }

    pub fn remove_xattr(&self, caller: Caller, ino: Ino, name: &[u8]) -> Result<(), FsError> {
        self.call_done(&MetaRequest::RemoveXattr { caller, ino, name: name.to_vec() })
    }
}
