//! The FUSE requests: `impl Filesystem for CitronFuse`, each request one
//! call of [`FsClient`] answered with its errno ([`crate::errno`]): entries
//! and attributes, files and their I/O, directories, extended attributes
//! and locks.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::time::{Instant, SystemTime};

use citronfs_core::client::{Looked, WriteMode};
use citronfs_core::locks::LockMode;
use citronfs_core::proto::{Delegated, RenameMode, XattrMode};
use citronfs_core::types::{FileKind, Ino, SetAttr, Timestamp};
use fuser::{
    AccessFlags, Errno, FileHandle, Filesystem, FopenFlags, Generation, INodeNo, InitFlags, KernelConfig,
    LockOwner, OpenFlags, RenameFlags, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory, ReplyDirectoryPlus,
    ReplyEmpty, ReplyEntry, ReplyLock, ReplyOpen, ReplyStatfs, ReplyWrite, ReplyXattr, Request, TimeOrNow,
    WriteFlags,
};

use crate::delegation::Ttls;
use crate::locking::lock;
use crate::{
    absent_attr, access, caller, data, done, errno, fuse_attr, kind_of_mode, name, setid, time, CitronFuse,
    FuseOp, LOCKS_XATTR, META_XATTR,
};

/// The largest piece of a write the kernel sends: a chunk, so that a big
/// write costs one request, one set of locks and one allocation per chunk.
/// The kernel sends the pieces of one write(2) one after the other (for a
/// direct-I/O file, whatever FUSE_ASYNC_DIO says), so smaller pieces only
/// add requests: 1 MiB direct writes of new space ran 688-766 MB/s with
/// 1 MiB pieces, 669-754 with 256 KiB and 605-671 with 128 KiB, in one
/// sitting (`citronfs bench io`, three rounds).
pub const MAX_WRITE: u32 = 1 << 20;

impl Filesystem for CitronFuse {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        // Every file is opened for direct I/O (coherence across mounts), so
        // each write(2) reaches the daemon in pieces of at most MAX_WRITE,
        // one after the other.
        let _ = config.set_max_write(MAX_WRITE);
        // Shared writable mappings of files opened with direct I/O (kernel
        // >= 6.6); kept coherent across mounts through locks (`coherence`).
        if let Err(missing) = config.add_capabilities(InitFlags::FUSE_DIRECT_IO_ALLOW_MMAP) {
            log::warn!("the kernel does not offer {missing:?}: shared writable mappings fail with ENODEV");
        }
        // A caching mount lists with READDIRPLUS always, not where the
        // kernel guesses the names will be looked up (`listing`); one
        // without caching keeps plain READDIR.
        if !self.options.cache_ttl.is_zero() {
            let plus = InitFlags::FUSE_DO_READDIRPLUS;
            if let Err(missing) = config.add_capabilities(plus) {
                log::warn!("the kernel does not offer {missing:?}: listings cache no attributes");
            }
        }
        // Without these the kernel keeps fcntl and flock locks node-local
        // and the file system would silently not be distributed.
        config.add_capabilities(InitFlags::FUSE_POSIX_LOCKS | InitFlags::FUSE_FLOCK_LOCKS).map_err(
            |missing| {
                std::io::Error::other(format!(
                    "the kernel does not offer {missing:?}: locks would stay local to this node"
                ))
            },
        )?;
        Ok(())
    }

    fn lookup(&self, req: &Request, parent: INodeNo, n: &OsStr, reply: ReplyEntry) {
        self.requests.count(FuseOp::Lookup);
        if self.options.cache_ttl.is_zero() {
            let looked = self.client.lookup(caller(req), Ino(parent.0), name(n));
            if let Ok(a) = &looked {
                self.before_answering(a);
            }
            return self.entry(reply, looked);
        }
        // In a directory delegated to this mount: answered from its listing.
        let Some(reply) = self.lookup_delegated(Ino(parent.0), name(n), reply) else { return };
        let (sent, before) = (Instant::now(), self.invalidations.epochs().all());
        let looked = self.client.lookup_granted(caller(req), Ino(parent.0), name(n));
        let ttl = self.granted_ttl(sent, before, self.invalidations.epochs().all());
        match looked {
            Ok(Looked::Found(a, grant)) => {
                self.before_answering(&a);
                self.lookup_answered(Ino(parent.0), name(n), &a, &grant, sent);
                let entry_ttl = if grant.entry { ttl } else { self.options.attr_ttl };
                let attr_ttl = if grant.attr { ttl } else { self.options.attr_ttl };
                reply.entry_with_ttls(&attr_ttl, &entry_ttl, &fuse_attr(&a), Generation(0))
            }
            // A negative entry, cached by the kernel for the grant's time:
            // another mount's create of the name calls this one back first.
            Ok(Looked::Absent) => reply.entry_with_ttls(&ttl, &ttl, &absent_attr(), Generation(0)),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        self.requests.count(FuseOp::GetAttr);
        if self.options.cache_ttl.is_zero() {
            return match self.client.getattr(Ino(ino.0)) {
                Ok(a) => reply.attr(&self.options.attr_ttl, &fuse_attr(&a)),
                Err(e) => reply.error(errno(&e)),
            };
        }
        // A directory this mount changed itself: answered from the change's
        // granted answer (`attr_cache`).
        let Some(reply) = self.getattr_kept(Ino(ino.0), reply) else { return };
        let Some(reply) = self.getattr_delegated(Ino(ino.0), reply) else { return };
        let Some(reply) = self.getattr_live(Ino(ino.0), reply) else { return };
        let epochs = self.invalidations.epochs();
        let (sent, before) = (Instant::now(), epochs.of(Ino(ino.0)));
        let ticket = self.invalidations.attrs().ticket(Ino(ino.0));
        // After the ticket: a base is kept only if no last release of the
        // file here can have ended its grant ("Written files" in
        // `attr_cache`).
        let open_here = self.client.is_open_here(Ino(ino.0));
        match self.client.getattr_granted(Ino(ino.0)) {
            Ok((a, grant)) => {
                let ttl = match grant.attr {
                    true => self.granted_ttl(sent, before, epochs.of(Ino(ino.0))),
                    false => self.options.attr_ttl,
                };
                if grant.live && open_here {
                    self.invalidations.attrs().install_live(ticket, a.clone(), self.options.cache_ttl);
                }
                reply.attr(&ttl, &fuse_attr(&a))
            }
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn setattr(
        &self,
        req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        self.requests.count(FuseOp::SetAttr);
        let set = SetAttr {
            perm: mode.map(|m| (m & 0o7777) as u16),
            uid,
            gid,
            size,
            atime: atime.map(time),
            mtime: mtime.map(time),
            ctime: ctime.map(Timestamp::from),
        };
        let (who, ino) = (caller(req), Ino(ino.0));
        let sgid = setid::SgidCheck::before(size, uid, gid, || self.client.getattr(ino).ok());
        let r = self.client.setattr(who, ino, set).and_then(|a| {
            let creds = || access::Credentials::of(req.pid(), req.uid(), req.gid());
            match sgid.after(&a, req.gid(), creds) {
                Some(perm) => {
                    self.client.setattr(who, ino, SetAttr { perm: Some(perm), ..SetAttr::default() })
                }
                None => Ok(a),
            }
        });
        self.attrs_changed(&[ino]);
        if let Ok(a) = &r {
            self.setattr_answered(a);
        }
        match r {
            Ok(a) => reply.attr(&self.options.attr_ttl, &fuse_attr(&a)),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        self.requests.count(FuseOp::ReadLink);
        data(reply, self.client.readlink(Ino(ino.0)))
    }

    fn mknod(
        &self,
        req: &Request,
        parent: INodeNo,
        n: &OsStr,
        mode: u32,
        umask: u32,
        rdev: u32,
        reply: ReplyEntry,
    ) {
        self.requests.count(FuseOp::Mknod);
        let (ticket, making) = (self.dir_changing(Ino(parent.0)), self.making());
        let r = kind_of_mode(mode).and_then(|kind| {
            let perm = (mode & !umask & 0o7777) as u16;
            self.client.create_granted(caller(req), Ino(parent.0), name(n), kind, perm, rdev)
        });
        let ttls = self.made(making, Ino(parent.0), name(n), r.as_ref().map(|(a, g)| (a, g.delegated)));
        self.entry_for(reply, self.dir_changed_then(ticket, r), ttls)
    }

    fn mkdir(&self, req: &Request, parent: INodeNo, n: &OsStr, mode: u32, umask: u32, reply: ReplyEntry) {
        self.requests.count(FuseOp::Mkdir);
        let perm = (mode & !umask & 0o7777) as u16;
        let (ticket, making) = (self.dir_changing(Ino(parent.0)), self.making());
        let r = self.client.create_granted(caller(req), Ino(parent.0), name(n), FileKind::Dir, perm, 0);
        let ttls = self.made(making, Ino(parent.0), name(n), r.as_ref().map(|(a, g)| (a, g.delegated)));
        self.entry_for(reply, self.dir_changed_then(ticket, r), ttls)
    }

    fn unlink(&self, req: &Request, parent: INodeNo, n: &OsStr, reply: ReplyEmpty) {
        self.requests.count(FuseOp::Unlink);
        let Some(reply) = self.unlink_late(caller(req), Ino(parent.0), name(n), reply) else { return };
        let ticket = self.dir_changing(Ino(parent.0));
        let r = self.client.unlink_granted(caller(req), Ino(parent.0), name(n));
        self.removed(Ino(parent.0), name(n), &r);
        self.dir_changed(ticket, r.as_ref().ok().map(|(grant, _)| grant));
        // The removed inode's link count and ctime changed: what is kept of
        // it goes (of every new and written file, if it is not known).
        match &r {
            Ok((_, Some(victim))) => self.attrs_changed(&[*victim]),
            _ => self.forget_files(),
        }
        done(reply, r.map(drop))
    }

    fn rmdir(&self, req: &Request, parent: INodeNo, n: &OsStr, reply: ReplyEmpty) {
        self.requests.count(FuseOp::Rmdir);
        let ticket = self.dir_changing(Ino(parent.0));
        let r = self.client.rmdir_granted(caller(req), Ino(parent.0), name(n));
        self.removed(Ino(parent.0), name(n), &r);
        self.dir_changed(ticket, r.as_ref().ok());
        // The removed directory's attributes may be kept here (its number
        // is not in the request): everything goes.
        self.forget_all_attrs();
        done(reply, r.map(drop))
    }

    fn symlink(&self, req: &Request, parent: INodeNo, link: &OsStr, target: &Path, reply: ReplyEntry) {
        self.requests.count(FuseOp::Symlink);
        let target = target.as_os_str().as_bytes();
        let (ticket, making) = (self.dir_changing(Ino(parent.0)), self.making());
        let r = self.client.symlink_granted(caller(req), Ino(parent.0), name(link), target);
        let ttls = self.made(making, Ino(parent.0), name(link), r.as_ref().map(|(a, g)| (a, g.delegated)));
        self.entry_for(reply, self.dir_changed_then(ticket, r), ttls)
    }

    fn rename(
        &self,
        req: &Request,
        parent: INodeNo,
        n: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        self.requests.count(FuseOp::Rename);
        let mode = if flags.contains(RenameFlags::RENAME_EXCHANGE) {
            RenameMode::Exchange
        } else if flags.contains(RenameFlags::RENAME_NOREPLACE) {
            RenameMode::NoReplace
        } else if flags.is_empty() {
            RenameMode::Replace
        } else {
            return reply.error(Errno::EINVAL);
        };
        let r =
            self.client.rename(caller(req), Ino(parent.0), name(n), Ino(newparent.0), name(newname), mode);
        let (from, to) = ((Ino(parent.0), name(n)), (Ino(newparent.0), name(newname)));
        self.renamed(from, to, mode == RenameMode::Exchange, r.is_ok());
        self.forget_all_attrs();
        done(reply, r)
    }

    fn link(&self, req: &Request, ino: INodeNo, newparent: INodeNo, newname: &OsStr, reply: ReplyEntry) {
        self.requests.count(FuseOp::Link);
        let making = self.making();
        let r = self.client.link(caller(req), Ino(ino.0), Ino(newparent.0), name(newname));
        // Named here without its attributes: its link count changed.
        let _ =
            self.made(making, Ino(newparent.0), name(newname), r.as_ref().map(|a| (a, Delegated::default())));
        self.attrs_changed(&[Ino(ino.0), Ino(newparent.0)]);
        self.entry(reply, r)
    }

    fn open(&self, req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        self.requests.count(FuseOp::Open);
        self.file_changing(Ino(ino.0));
        // One round trip: the meta-server's Open refuses directories (EISDIR)
        // itself, and the kernel opens devices, fifos and sockets without us.
        match self.open_fh(caller(req), Ino(ino.0), flags.0) {
            Ok(fh) => reply.opened(fh, FopenFlags::FOPEN_DIRECT_IO),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        self.requests.count(FuseOp::Read);
        if let Err(e) = self.check_handle(fh) {
            return reply.error(e);
        }
        if lock_owner.is_none() {
            // Direct reads carry the caller's lock owner; page-cache reads
            // (a fault of a mapping) do not.
            self.coherence.cached(Ino(ino.0));
        }
        data(reply, self.through_handle(fh, self.client.read(Ino(ino.0), offset, size)))
    }

    fn write(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        self.requests.count(FuseOp::Write);
        let append = match self.check_handle(fh) {
            Ok(a) => a,
            Err(e) => return reply.error(e),
        };
        if write_flags.contains(WriteFlags::FUSE_WRITE_CACHE) {
            self.coherence.cached(Ino(ino.0)); // written back from a mapping
        }
        // Its size and times change one-sidedly.
        self.file_changing(Ino(ino.0));
        // The kernel sets this on every direct write by a process without
        // CAP_FSETID and clears nothing itself (see `setid`).
        let groups = || setid::groups_of(req.pid(), req.uid(), req.gid());
        let unprivileged = write_flags.contains(WriteFlags::FUSE_WRITE_KILL_SUIDGID);
        let how =
            WriteMode { append, unprivileged: unprivileged.then_some(&groups as &dyn Fn() -> Vec<u32>) };
        match self.through_handle(fh, self.client.write_as(Ino(ino.0), offset, data, how)) {
            Ok(_) => reply.written(data.len() as u32),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn flush(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, owner: LockOwner, reply: ReplyEmpty) {
        self.requests.count(FuseOp::Flush);
        // Data is in the data servers' memory when `write` answers. A close
        // by a POSIX lock owner releases all its locks on the file.
        done(reply, self.client.release_owner_locks(Ino(ino.0), citronfs_core::locks::LockOwner(owner.0)))
    }

    fn release(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        // Counted once done (the others as they arrive): the kernel sends a
        // release after close(2) returns, and whoever counts waits for it.
        let _counted = self.requests.on_drop(FuseOp::Release);
        // A new file's attributes are granted until the release reaches the
        // meta-server: no longer answered from here from now on.
        self.file_released(Ino(ino.0));
        let open = self.open_files.lock().remove(&fh.0);
        self.posix_owners.lock().remove(&fh.0);
        match open {
            Some(f) => {
                self.coherence.released(f.ino);
                // The last close of an open file: its OFD and flock locks go.
                let unlocked = self.client.release_handle_locks(f.ino, fh.0);
                if let Err(e) = &unlocked {
                    log::warn!("releasing the locks of handle {} of inode {}: {e}", fh.0, f.ino.0);
                }
                let released = if f.registration == self.client.registration() {
                    // Nobody waits for a release: the meta-server hears of
                    // it a moment later, with others.
                    self.client.release_later(f.ino)
                } else {
                    Ok(()) // the meta-server dropped this open with the old registration
                };
                // Again once queued: a getattr answered before the
                // meta-server has it keeps no base (`attr_cache`, "Written
                // files").
                self.file_released(f.ino);
                done(reply, unlocked.and(released))
            }
            None => reply.ok(),
        }
    }

    /// `fsync(2)` and `fdatasync(2)`, and what the kernel makes of
    /// `O_SYNC`/`O_DSYNC` writes and `msync(MS_SYNC)`: every write reached
    /// the data servers' memory before it answered (no cache here), and the
    /// kernel writes a shared mapping's dirty pages back before it asks.
    /// What is left is durability where a data server keeps its memory on
    /// a persistent path: the file's extents there are flushed
    /// ([`FsClient::fsync`](citronfs_core::client::FsClient::fsync)).
    ///
    /// With no such data server in the cluster at the first fsync, there is
    /// nothing to do, and ENOSYS tells the kernel so: it sends no FSYNC for
    /// this mount any more and answers fsync(2) itself after that
    /// write-back — a request fewer per fsync (SQLite sends three per
    /// transaction). A persistent data server that joins the cluster later
    /// is then not flushed through this mount until it is mounted again.
    fn fsync(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, _datasync: bool, reply: ReplyEmpty) {
        self.requests.count(FuseOp::Fsync);
        let flushes = *self.fsync_flushes.get_or_init(|| {
            self.client.any_durable_data_server().unwrap_or_else(|e| {
                log::warn!("cannot tell whether a data server keeps its memory on a disk ({e}): flushing");
                true
            })
        });
        if !flushes {
            return reply.error(Errno::ENOSYS);
        }
        crate::done(reply, self.client.fsync(Ino(ino.0)))
    }

    /// A directory keeps no open state here (listings are paged by
    /// cookie), yet OPENDIR is answered, with no flags. ENOSYS would make
    /// the kernel open directories itself from then on, with
    /// `FOPEN_CACHE_DIR` (`fuse_do_open`'s default without opendir): it
    /// would answer a directory stream kept open and rewound
    /// (`rewinddir`, a spool poller's loop) from its own copy of the
    /// listing, checked against an mtime it does not refresh, and another
    /// mount's create would stay unseen on either kind of mount
    /// (`a_directory_kept_open_sees_the_other_mounts_changes_at_each_rewind`).
    /// It costs an OPENDIR and a RELEASEDIR per stream, answered here
    /// without a round trip. `FSYNCDIR` is fuser's ENOSYS: a directory's
    /// fsync(2) — SQLite's after each journal it deletes — costs no
    /// request after the first.
    fn opendir(&self, _req: &Request, _ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        self.requests.count(FuseOp::OpenDir);
        reply.opened(FileHandle(0), FopenFlags::empty())
    }

    fn readdir(&self, req: &Request, ino: INodeNo, _fh: FileHandle, offset: u64, reply: ReplyDirectory) {
        self.requests.count(FuseOp::ReadDir);
        self.list(caller(req), Ino(ino.0), offset, reply)
    }

    /// Asked only by the kernel of a caching mount (`init`).
    fn readdirplus(
        &self,
        req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        reply: ReplyDirectoryPlus,
    ) {
        self.requests.count(FuseOp::ReadDirPlus);
        self.list_plus(caller(req), Ino(ino.0), offset, reply)
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        self.requests.count(FuseOp::StatFs);
        match self.client.statfs() {
            Ok(s) => {
                let (blocks, free) = (s.total_bytes / 4096, s.free_bytes / 4096);
                let free_inodes = s.max_inodes.saturating_sub(s.inodes);
                reply.statfs(blocks, free, free, s.max_inodes, free_inodes, 4096, 255, 4096)
            }
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn setxattr(
        &self,
        req: &Request,
        ino: INodeNo,
        n: &OsStr,
        value: &[u8],
        flags: i32,
        _position: u32,
        reply: ReplyEmpty,
    ) {
        self.requests.count(FuseOp::SetXattr);
        let mode = match flags {
            0 => XattrMode::Any,
            libc::XATTR_CREATE => XattrMode::Create,
            libc::XATTR_REPLACE => XattrMode::Replace,
            _ => return reply.error(Errno::EINVAL),
        };
        let r = self.client.set_xattr(caller(req), Ino(ino.0), name(n), value, mode);
        self.attrs_changed(&[Ino(ino.0)]);
        done(reply, r)
    }

    fn getxattr(&self, req: &Request, ino: INodeNo, n: &OsStr, size: u32, reply: ReplyXattr) {
        self.requests.count(FuseOp::GetXattr);
        let value = if name(n) == LOCKS_XATTR.as_bytes() {
            self.lock_listing(Ino(ino.0))
        } else if name(n) == META_XATTR.as_bytes() {
            Ok(self.client.meta_addr().to_string().into_bytes())
        } else {
            self.client.get_xattr(caller(req), Ino(ino.0), name(n))
        };
        match value {
            Ok(v) if size == 0 => reply.size(v.len() as u32),
            Ok(v) if v.len() > size as usize => reply.error(Errno::ERANGE),
            Ok(v) => reply.data(&v),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn listxattr(&self, req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        self.requests.count(FuseOp::ListXattr);
        match self.client.list_xattr(caller(req), Ino(ino.0)) {
            Ok(names) => {
                let mut buf = Vec::new();
                for n in names {
                    buf.extend_from_slice(&n);
                    buf.push(0);
                }
                if size == 0 {
                    reply.size(buf.len() as u32)
                } else if buf.len() > size as usize {
                    reply.error(Errno::ERANGE)
                } else {
                    reply.data(&buf)
                }
            }
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn removexattr(&self, req: &Request, ino: INodeNo, n: &OsStr, reply: ReplyEmpty) {
        self.requests.count(FuseOp::RemoveXattr);
        let r = self.client.remove_xattr(caller(req), Ino(ino.0), name(n));
        self.attrs_changed(&[Ino(ino.0)]);
        done(reply, r)
    }

    fn access(&self, _req: &Request, ino: INodeNo, _mask: AccessFlags, reply: ReplyEmpty) {
        self.requests.count(FuseOp::Access);
        // Only called without default_permissions; existence is what we know.
        done(reply, self.client.getattr(Ino(ino.0)).map(|_| ()))
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        n: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        self.requests.count(FuseOp::Create);
        let perm = (mode & !umask & 0o7777) as u16;
        let (who, parent, n) = (caller(req), Ino(parent.0), name(n));
        let Some(reply) = self.create_late(who, (parent, n), perm, flags, reply) else { return };
        let (ticket, new, making) = (self.dir_changing(parent), self.creating(), self.making());
        // Without O_EXCL, a name another mount created since our kernel
        // looked it up is opened, not refused.
        let exclusive = flags & libc::O_EXCL != 0;
        let opened = self.client.create_or_open(who, parent, n, perm, exclusive);
        let ttl: Ttls = match &opened {
            Ok(o) if o.created => self.made(making, parent, n, Ok((&o.attr, o.granted.delegated))),
            Ok(o) => {
                // Opened for writing: its attributes may change one-sidedly.
                self.file_changing(o.attr.ino);
                Ttls::both(self.options.attr_ttl)
            }
            Err(e) => self.made(making, parent, n, Err(e)),
        };
        self.dir_changed(ticket, opened.as_ref().ok().map(|o| &o.granted));
        // A new file's attributes are granted to this mount, its creator,
        // until its release (meta-server `grants`, "Creators"): kept here to
        // answer the kernel's GETATTR that follows (`attr_cache`), while
        // the kernel gets the ungranted TTL (it could not be told of the
        // release).
        let opened = opened.and_then(|o| match o.created {
            true => {
                self.created(new, &o.attr, &o.granted);
                Ok(o.attr)
            }
            false => self.open_existing_for_create(req, o.attr, flags),
        });
        let r = opened.map(|a| (self.track_open(a.ino, flags), a));
        match r {
            Ok((fh, a)) => {
                // One TTL for both: the entry's (a file's is short, `delegation`).
                reply.created(&ttl.entry, &fuse_attr(&a), Generation(0), fh, FopenFlags::FOPEN_DIRECT_IO)
            }
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn getlk(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        lock_owner: LockOwner,
        start: u64,
        end: u64,
        typ: i32,
        pid: u32,
        reply: ReplyLock,
    ) {
        self.requests.count(FuseOp::GetLk);
        let call = match self.lock_call(req, ino, fh, lock_owner, start, end, typ, pid) {
            Ok(c) => c,
            Err(e) => return reply.error(e),
        };
        match self.client.getlk(&call) {
            Ok(None) => reply.locked(start, end, libc::F_UNLCK, 0),
            Ok(Some(holder)) => {
                let typ = if holder.mode == LockMode::Write { libc::F_WRLCK } else { libc::F_RDLCK };
                reply.locked(holder.range.start, holder.range.last, typ, holder.pid)
            }
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn setlk(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        lock_owner: LockOwner,
        start: u64,
        end: u64,
        typ: i32,
        pid: u32,
        sleep: bool,
        reply: ReplyEmpty,
    ) {
        self.requests.count(FuseOp::SetLk);
        let call = match self.lock_call(req, ino, fh, lock_owner, start, end, typ, pid) {
            Ok(c) => c,
            Err(e) => return reply.error(e),
        };
        let tid = req.pid();
        if !self.coherence.is_cached(call.ino) {
            return lock(&self.client, call, sleep, tid, None, reply);
        }
        // This mount caches pages of the file (a mapping): write back and
        // drop the range before the change and again after a grant, on a
        // coherence thread (see `coherence`).
        let (client, inval) = (self.client.clone(), self.coherence.invalidator().clone());
        self.coherence.invalidator().run(Box::new(move || {
            inval.invalidate(call.ino, call.range);
            lock(&client, call, sleep, tid, Some(inval), reply)
        }));
    }

    fn fallocate(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        self.requests.count(FuseOp::Fallocate);
        self.file_changing(Ino(ino.0));
        let keep_size = match mode {
            0 => false,
            libc::FALLOC_FL_KEEP_SIZE => true,
            _ => return reply.error(Errno::EOPNOTSUPP),
        };
        let r = self.client.fallocate(Ino(ino.0), offset, length, keep_size);
        // The meta-server does not call this mount back for its own change.
        self.attrs_changed(&[Ino(ino.0)]);
        done(reply, r)
    }
}
