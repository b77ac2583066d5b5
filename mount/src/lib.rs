//! The FUSE adapter of CitronFS over `fuser` (DESIGN.md §2, §5, §7).
//!
//! Each FUSE request becomes one call of [`FsClient`]; errors become errno in
//! exactly one place ([`errno`]). Files are opened with direct I/O so every
//! read and write reaches the daemon (and from there the data servers'
//! memory, uncached). Attributes and entries are not cached by default; with
//! [`MountOptions::cache_ttl`] the kernel caches what the meta-server grants
//! and the meta-server calls every other mount back before a change answers
//! ([`invalidation`]), so mounts stay strictly coherent either way. Shared
//! mappings are the one use of the page cache, kept coherent across mounts
//! through locks ([`coherence`]). The session is multi-threaded.

mod access;
pub mod caller;
mod coherence;
mod invalidation;
mod listing;
mod requests;
mod setid;

pub use invalidation::InvalidationControl;
pub use requests::{FuseCounters, FuseCounts, FuseOp};

use std::collections::HashMap;
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use citronfs_core::client::{FsClient, LockCall, WriteMode};
use citronfs_core::locks::{ByteRange, LockFlavor, LockMode, OFFSET_MAX};
use citronfs_core::proto::{RenameMode, XattrMode};
use citronfs_core::types::{Attr, Caller, FileKind, Ino, SetAttr, Timestamp};
use citronfs_core::FsError;
use fuser::{
    AccessFlags, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo,
    InitFlags, KernelConfig, LockOwner, OpenFlags, RenameFlags, ReplyAttr, ReplyCreate, ReplyData,
    ReplyDirectory, ReplyDirectoryPlus, ReplyEmpty, ReplyEntry, ReplyLock, ReplyOpen, ReplyStatfs,
    ReplyWrite, ReplyXattr, Request, TimeOrNow, WriteFlags,
};
use parking_lot::Mutex;

/// Mount settings.
#[derive(Clone, Debug)]
pub struct MountOptions {
    /// How long the kernel may cache attributes and entries without asking
    /// anyone (0: never). Not coherent across mounts unless zero; see
    /// `cache_ttl` for caching that is.
    pub attr_ttl: Duration,
    /// Coherent caching (0: off): lookups, getattrs and listings
    /// (READDIRPLUS, [`listing`]) are granted for this long by the
    /// meta-server, which invalidates them on this mount before
    /// another mount's change answers ([`invalidation`]).
    pub cache_ttl: Duration,
    /// FUSE worker threads.
    pub threads: usize,
}

impl Default for MountOptions {
    fn default() -> Self {
        Self { attr_ttl: Duration::ZERO, cache_ttl: Duration::ZERO, threads: 4 }
    }
}

/// A virtual extended attribute (never listed) whose value is the
/// cluster-wide list of the file's lock holders and waiters, one per line,
/// for `citronfs locks` (and `getfattr`): `state flavour mode first last pid
/// client host`, `last` being `EOF` for a lock to the end of the file.
pub const LOCKS_XATTR: &str = "user.citronfs.locks";

/// A virtual extended attribute (never listed) of every file of a mount
/// whose value is the address of its cluster's meta-server, for
/// `citronfs status MOUNTPOINT`.
pub const META_XATTR: &str = "user.citronfs.meta";

/// The errno of every file-system error: the one place they are mapped.
pub fn errno(e: &FsError) -> Errno {
    match e {
        FsError::NotFound => Errno::ENOENT,
        FsError::Exists => Errno::EEXIST,
        FsError::NotEmpty => Errno::ENOTEMPTY,
        FsError::IsDir => Errno::EISDIR,
        FsError::NotDir => Errno::ENOTDIR,
        FsError::Access => Errno::EACCES,
        FsError::Perm => Errno::EPERM,
        FsError::NameTooLong => Errno::ENAMETOOLONG,
        FsError::Invalid(_) => Errno::EINVAL,
        FsError::NoSpace => Errno::ENOSPC,
        FsError::FileTooBig => Errno::EFBIG,
        FsError::NoAttr => Errno::NO_XATTR,
        FsError::Range => Errno::ERANGE,
        FsError::NotSupported(_) => Errno::EOPNOTSUPP,
        FsError::Loop => Errno::ELOOP,
        FsError::WouldBlock => Errno::EAGAIN,
        FsError::Deadlock => Errno::EDEADLK,
        FsError::Interrupted => Errno::EINTR,
        FsError::NoLocks => Errno::ENOLCK,
        FsError::TooManyOpenFiles => Errno::ENFILE,
        FsError::Io(_) => Errno::EIO,
    }
}

fn file_type(k: FileKind) -> FileType {
    match k {
        FileKind::File => FileType::RegularFile,
        FileKind::Dir => FileType::Directory,
        FileKind::Symlink => FileType::Symlink,
        FileKind::Fifo => FileType::NamedPipe,
        FileKind::Socket => FileType::Socket,
        FileKind::CharDevice => FileType::CharDevice,
        FileKind::BlockDevice => FileType::BlockDevice,
    }
}

fn kind_of_mode(mode: u32) -> Result<FileKind, FsError> {
    Ok(match mode & libc::S_IFMT {
        libc::S_IFREG | 0 => FileKind::File,
        libc::S_IFDIR => FileKind::Dir,
        libc::S_IFIFO => FileKind::Fifo,
        libc::S_IFSOCK => FileKind::Socket,
        libc::S_IFCHR => FileKind::CharDevice,
        libc::S_IFBLK => FileKind::BlockDevice,
        _ => return Err(FsError::Invalid(format!("mknod of mode {mode:o}"))),
    })
}

fn fuse_attr(a: &Attr) -> FileAttr {
    FileAttr {
        ino: INodeNo(a.ino.0),
        size: a.size,
        blocks: a.allocated.div_ceil(512),
        atime: a.atime.into(),
        mtime: a.mtime.into(),
        ctime: a.ctime.into(),
        crtime: a.crtime.into(),
        kind: file_type(a.kind),
        perm: a.perm,
        nlink: a.nlink,
        uid: a.uid,
        gid: a.gid,
        rdev: a.rdev,
        blksize: 4096,
        flags: 0,
    }
}

fn caller(req: &Request) -> Caller {
    Caller { uid: req.uid(), gid: req.gid(), pid: req.pid() }
}

fn time(t: TimeOrNow) -> Timestamp {
    match t {
        TimeOrNow::Now => Timestamp::now(),
        TimeOrNow::SpecificTime(t) => Timestamp::from(t),
    }
}

/// An open file: what `write` needs to know of the open.
struct OpenFile {
    ino: Ino,
    append: bool,
    /// The client registration it was opened under: after a lost lease the
    /// meta-server forgot the open and the locks taken through it, so the
    /// handle answers EIO until the file is opened again.
    registration: u64,
}

/// The FUSE file system: a [`FsClient`] and the open-file table.
pub struct CitronFuse {
    client: Arc<FsClient>,
    options: MountOptions,
    open_files: Mutex<HashMap<u64, OpenFile>>,
    next_fh: AtomicU64,
    /// Lock owners known to make POSIX (`F_SETLK`) calls through a file
    /// handle, so their calls skip the `/proc` read (see
    /// [`CitronFuse::lock_flavor`]).
    posix_owners: Mutex<HashMap<u64, std::collections::HashSet<u64>>>,
    /// Open `/proc/<tid>/syscall` files of callers.
    syscalls: caller::SyscallFiles,
    /// Page-cache coherence of shared mappings through locks.
    coherence: coherence::Coherence,
    /// Requests answered, by kind.
    requests: FuseCounters,
    /// The invalidation thread of coherent caching, and its counters.
    invalidations: InvalidationControl,
}

impl Drop for CitronFuse {
    fn drop(&mut self) {
        self.invalidations.stop();
    }
}

impl CitronFuse {
    pub fn new(client: FsClient, options: MountOptions) -> Self {
        client.set_caching(options.cache_ttl);
        Self {
            client: Arc::new(client),
            options,
            open_files: Mutex::new(HashMap::new()),
            next_fh: AtomicU64::new(1),
            posix_owners: Mutex::new(HashMap::new()),
            syscalls: caller::SyscallFiles::default(),
            coherence: coherence::Coherence::start().expect("start the coherence threads"),
            requests: FuseCounters::default(),
            invalidations: InvalidationControl::default(),
        }
    }

    /// The mount's invalidation thread (coherent caching), reachable while
    /// it serves.
    pub fn invalidations(&self) -> InvalidationControl {
        self.invalidations.clone()
    }

    /// The TTL to hand the kernel for an answer the meta-server granted to
    /// a request sent at `sent`: the grant less the time since (the
    /// meta-server counts the grant from its answer), and zero if an
    /// invalidation was told to the kernel while the request was out
    /// (`before` and `after` differ; see [`invalidation`]).
    fn granted_ttl(
        &self,
        sent: Instant,
        before: invalidation::Sample,
        after: invalidation::Sample,
    ) -> Duration {
        if before != after {
            return Duration::ZERO;
        }
        self.options.cache_ttl.saturating_sub(sent.elapsed())
    }

    /// The mount's client, still reachable after this file system has moved
    /// into its session (e.g. to read [`FsClient::verb_counts`] while the
    /// mount serves). The client lives until the last handle is dropped.
    pub fn client(&self) -> Arc<FsClient> {
        self.client.clone()
    }

    /// The mount's request counters, readable while it serves.
    pub fn requests(&self) -> FuseCounters {
        self.requests.clone()
    }

    fn entry(&self, reply: ReplyEntry, r: Result<Attr, FsError>) {
        match r {
            Ok(a) => reply.entry(&self.options.attr_ttl, &fuse_attr(&a), Generation(0)),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn open_fh(&self, caller: Caller, ino: Ino, flags: i32) -> Result<FileHandle, FsError> {
        self.client.open_as(caller, ino, flags)?;
        Ok(self.track_open(ino, flags))
    }

    /// A file handle for an open the meta-server has counted.
    fn track_open(&self, ino: Ino, flags: i32) -> FileHandle {
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        let registration = self.client.registration();
        self.open_files
            .lock()
            .insert(fh, OpenFile { ino, append: flags & libc::O_APPEND != 0, registration });
        self.coherence.opened(ino);
        FileHandle(fh)
    }

    /// An `open(O_CREAT)` that found the file another mount created after
    /// our kernel's lookup: the kernel took it for a create and skips an
    /// open's permission check and `O_TRUNC`, so they are done here (see
    /// [`access`]). The meta-server has counted the open; a refusal gives
    /// it back.
    fn open_existing_for_create(&self, req: &Request, attr: Attr, flags: i32) -> Result<Attr, FsError> {
        let ino = attr.ino;
        let creds = access::Credentials::of(req.pid(), req.uid(), req.gid());
        let checked = if !creds.may_open(&attr, flags) {
            Err(FsError::Access)
        } else if flags & libc::O_TRUNC != 0 {
            // A truncating open by a process without CAP_FSETID clears
            // set-ID bits, as `handle_truncate` would have.
            let killed = match creds.has(access::Capability::Fsetid) {
                true => Ok(()),
                false => self.client.kill_suidgid(ino, creds.all_groups()).map(drop),
            };
            let truncate = SetAttr { size: Some(0), ..SetAttr::default() };
            killed.and_then(|()| self.client.setattr(caller(req), ino, truncate))
        } else {
            Ok(attr)
        };
        if checked.is_err() {
            if let Err(e) = self.client.release(ino) {
                log::warn!("giving back the refused open of inode {}: {e}", ino.0);
            }
        }
        checked
    }

    /// Whether `fh` opened for append; EIO if it belongs to a registration
    /// the meta-server has fenced.
    fn check_handle(&self, fh: FileHandle) -> Result<bool, Errno> {
        match self.open_files.lock().get(&fh.0) {
            Some(f) if f.registration != self.client.registration() => Err(Errno::EIO),
            Some(f) => Ok(f.append),
            None => Ok(false),
        }
    }

    /// The value of [`LOCKS_XATTR`] for `ino`: a snapshot of its lock
    /// records, each with the host and process of the mount that holds it.
    fn lock_listing(&self, ino: Ino) -> Result<Vec<u8>, FsError> {
        use citronfs_core::locks::record::RecordState;
        let records = self.client.lock_records(ino)?;
        let clients = self.client.clients()?;
        let mut out = String::new();
        for r in records {
            let host = clients
                .iter()
                .find(|c| c.id == r.owner.client)
                .map_or_else(|| "?".to_string(), |c| format!("{}:{}", c.hostname, c.pid));
            let last = if r.range.last == OFFSET_MAX { "EOF".to_string() } else { r.range.last.to_string() };
            out += &format!(
                "{} {} {} {} {} {} {} {}\n",
                if r.state == RecordState::Held { "held" } else { "waiting" },
                match r.flavor {
                    LockFlavor::Posix => "POSIX",
                    LockFlavor::Ofd => "OFDLCK",
                    LockFlavor::Flock => "FLOCK",
                },
                if r.mode == LockMode::Write { "WRITE" } else { "READ" },
                r.range.start,
                last,
                r.pid,
                r.owner.client.0,
                host,
            );
        }
        Ok(out.into_bytes())
    }

    /// The flavour of a lock call by thread `tid` through `fh` for `owner`.
    ///
    /// Reading `/proc/<tid>/syscall` costs about 15 µs to open and read (a
    /// third of a lock call; the file is kept open per thread, see
    /// [`caller::SyscallFiles`]), so POSIX calls are remembered per (handle,
    /// owner): a POSIX owner
    /// is a process's file table, while OFD and flock calls through a handle
    /// are owned by that handle's open file itself; the two are different
    /// live objects, so an owner seen making POSIX calls through a handle
    /// makes only POSIX calls through it until the handle is released (when
    /// the memory is forgotten). OFD and flock calls share their owner, so
    /// they are read every time. A call `/proc` cannot name is refused
    /// with `ENOLCK`, never guessed (see [`caller`]).
    fn lock_flavor(&self, tid: caller::Tid, fh: FileHandle, owner: LockOwner) -> Result<LockFlavor, Errno> {
        if self.posix_owners.lock().get(&fh.0).is_some_and(|o| o.contains(&owner.0)) {
            return Ok(LockFlavor::Posix);
        }
        let Some(flavor) = self.syscalls.lock_flavor(tid) else {
            log::warn!(
                "lock call of thread {} through handle {}: /proc does not say whether it is flock or fcntl \
                 (caller outside this daemon's pid namespace, or gone); refused with ENOLCK",
                tid.0,
                fh.0
            );
            return Err(Errno::ENOLCK);
        };
        if flavor == LockFlavor::Posix {
            self.posix_owners.lock().entry(fh.0).or_default().insert(owner.0);
        }
        Ok(flavor)
    }

    /// A lock request as the kernel sent it, with its flavour read from the
    /// caller's system call (see [`caller`]).
    #[allow(clippy::too_many_arguments)]
    fn lock_call(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        owner: LockOwner,
        start: u64,
        end: u64,
        typ: i32,
        pid: u32,
    ) -> Result<LockCall, Errno> {
        self.check_handle(fh)?;
        let mode = match typ {
            libc::F_RDLCK => Some(LockMode::Read),
            libc::F_WRLCK => Some(LockMode::Write),
            libc::F_UNLCK => None,
            _ => return Err(Errno::EINVAL),
        };
        let range = ByteRange::new(start, end.min(OFFSET_MAX)).ok_or(Errno::EINVAL)?;
        let flavor = self.lock_flavor(caller::Tid(req.pid()), fh, owner)?;
        Ok(LockCall {
            ino: Ino(ino.0),
            owner: citronfs_core::locks::LockOwner(owner.0),
            flavor,
            mode,
            range,
            pid,
            fh: fh.0,
        })
    }
}

/// Runs a lock call and answers it; a blocking one (`F_SETLKW`, blocking
/// `flock`) is answered by the waiter thread, never waited for here. With
/// `coherent`, a granted lock's range of the page cache is dropped on a
/// coherence thread before the answer.
fn lock(
    client: &FsClient,
    call: LockCall,
    sleep: bool,
    tid: u32,
    coherent: Option<coherence::Invalidator>,
    reply: ReplyEmpty,
) {
    let answer = move |r: Result<(), FsError>| match coherent {
        Some(inval) if r.is_ok() && call.mode.is_some() => inval.clone().run(Box::new(move || {
            inval.invalidate(call.ino, call.range);
            done(reply, r)
        })),
        _ => done(reply, r),
    };
    if sleep && call.mode.is_some() {
        client.setlkw(&call, Box::new(move || caller::interrupted(caller::Tid(tid))), Box::new(answer));
    } else {
        answer(client.setlk(&call))
    }
}

fn done(reply: ReplyEmpty, r: Result<(), FsError>) {
    match r {
        Ok(()) => reply.ok(),
        Err(e) => reply.error(errno(&e)),
    }
}

fn data(reply: ReplyData, r: Result<Vec<u8>, FsError>) {
    match r {
        Ok(d) => reply.data(&d),
        Err(e) => reply.error(errno(&e)),
    }
}

fn name(n: &OsStr) -> &[u8] {
    n.as_bytes()
}

impl Filesystem for CitronFuse {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        // Bigger writes: fewer round trips per MiB.
        let _ = config.set_max_write(1 << 20);
        // Shared writable mappings of files opened with direct I/O (kernel
        // >= 6.6); kept coherent across mounts through locks (`coherence`).
        if let Err(missing) = config.add_capabilities(InitFlags::FUSE_DIRECT_IO_ALLOW_MMAP) {
            log::warn!("the kernel does not offer {missing:?}: shared writable mappings fail with ENODEV");
        }
        // Without these the kernel keeps fcntl and flock locks node-local
        // and the file system would silently not be distributed.
        // A caching mount lists with READDIRPLUS, every time (`listing`);
        // one without caching keeps plain READDIR.
        if !self.options.cache_ttl.is_zero() {
            if let Err(missing) = config.add_capabilities(InitFlags::FUSE_DO_READDIRPLUS) {
                log::warn!("the kernel does not offer {missing:?}: listings cache no attributes");
            }
        }
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
            return self.entry(reply, self.client.lookup(caller(req), Ino(parent.0), name(n)));
        }
        let (sent, before) = (Instant::now(), self.invalidations.epochs().all());
        match self.client.lookup_granted(caller(req), Ino(parent.0), name(n)) {
            Ok((a, grant)) => {
                let ttl = self.granted_ttl(sent, before, self.invalidations.epochs().all());
                let entry_ttl = if grant.entry { ttl } else { self.options.attr_ttl };
                let attr_ttl = if grant.attr { ttl } else { self.options.attr_ttl };
                reply.entry_with_ttls(&attr_ttl, &entry_ttl, &fuse_attr(&a), Generation(0))
            }
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
        let epochs = self.invalidations.epochs();
        let (sent, before) = (Instant::now(), epochs.of(Ino(ino.0)));
        match self.client.getattr_granted(Ino(ino.0)) {
            Ok((a, grant)) => {
                let ttl = match grant.attr {
                    true => self.granted_ttl(sent, before, epochs.of(Ino(ino.0))),
                    false => self.options.attr_ttl,
                };
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
        let r = kind_of_mode(mode).and_then(|kind| {
            let perm = (mode & !umask & 0o7777) as u16;
            self.client.create(caller(req), Ino(parent.0), name(n), kind, perm, rdev)
        });
        self.entry(reply, r)
    }

    fn mkdir(&self, req: &Request, parent: INodeNo, n: &OsStr, mode: u32, umask: u32, reply: ReplyEntry) {
        self.requests.count(FuseOp::Mkdir);
        let perm = (mode & !umask & 0o7777) as u16;
        self.entry(reply, self.client.create(caller(req), Ino(parent.0), name(n), FileKind::Dir, perm, 0))
    }

    fn unlink(&self, req: &Request, parent: INodeNo, n: &OsStr, reply: ReplyEmpty) {
        self.requests.count(FuseOp::Unlink);
        done(reply, self.client.unlink(caller(req), Ino(parent.0), name(n)))
    }

    fn rmdir(&self, req: &Request, parent: INodeNo, n: &OsStr, reply: ReplyEmpty) {
        self.requests.count(FuseOp::Rmdir);
        done(reply, self.client.rmdir(caller(req), Ino(parent.0), name(n)))
    }

    fn symlink(&self, req: &Request, parent: INodeNo, link: &OsStr, target: &Path, reply: ReplyEntry) {
        self.requests.count(FuseOp::Symlink);
        let target = target.as_os_str().as_bytes();
        self.entry(reply, self.client.symlink(caller(req), Ino(parent.0), name(link), target))
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
        done(
            reply,
            self.client.rename(caller(req), Ino(parent.0), name(n), Ino(newparent.0), name(newname), mode),
        )
    }

    fn link(&self, req: &Request, ino: INodeNo, newparent: INodeNo, newname: &OsStr, reply: ReplyEntry) {
        self.requests.count(FuseOp::Link);
        self.entry(reply, self.client.link(caller(req), Ino(ino.0), Ino(newparent.0), name(newname)))
    }

    fn open(&self, req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        self.requests.count(FuseOp::Open);
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
        data(reply, self.client.read(Ino(ino.0), offset, size))
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
        // The kernel sets this on every direct write by a process without
        // CAP_FSETID and clears nothing itself (see `setid`).
        let groups = || setid::groups_of(req.pid(), req.uid(), req.gid());
        let unprivileged = write_flags.contains(WriteFlags::FUSE_WRITE_KILL_SUIDGID);
        let how =
            WriteMode { append, unprivileged: unprivileged.then_some(&groups as &dyn Fn() -> Vec<u32>) };
        match self.client.write_as(Ino(ino.0), offset, data, how) {
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
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        // Counted once done (the others as they arrive): the kernel sends a
        // release after close(2) returns, and whoever counts waits for it.
        let _counted = self.requests.on_drop(FuseOp::Release);
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
                    self.client.release(f.ino)
                } else {
                    Ok(()) // the meta-server dropped this open with the old registration
                };
                done(reply, unlocked.and(released))
            }
            None => reply.ok(),
        }
    }

    fn fsync(&self, _req: &Request, _ino: INodeNo, _fh: FileHandle, _datasync: bool, reply: ReplyEmpty) {
        self.requests.count(FuseOp::Fsync);
        reply.ok()
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
        done(reply, self.client.set_xattr(caller(req), Ino(ino.0), name(n), value, mode))
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
        done(reply, self.client.remove_xattr(caller(req), Ino(ino.0), name(n)))
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
        let opened = if flags & libc::O_EXCL != 0 {
            self.client.create_open(who, parent, n, perm)
        } else {
            // Without O_EXCL, a name another mount created since our kernel
            // looked it up is opened, not refused.
            self.client.open_or_create(who, parent, n, perm).and_then(|o| match o.created {
                true => Ok(o.attr),
                false => self.open_existing_for_create(req, o.attr, flags),
            })
        };
        let r = opened.map(|a| (self.track_open(a.ino, flags), a));
        match r {
            Ok((fh, a)) => reply.created(
                &self.options.attr_ttl,
                &fuse_attr(&a),
                Generation(0),
                fh,
                FopenFlags::FOPEN_DIRECT_IO,
            ),
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
        let keep_size = match mode {
            0 => false,
            libc::FALLOC_FL_KEEP_SIZE => true,
            _ => return reply.error(Errno::EOPNOTSUPP),
        };
        done(reply, self.client.fallocate(Ino(ino.0), offset, length, keep_size))
    }
}

/// A mounted session; unmounts when dropped.
pub use fuser::BackgroundSession;

/// Mounts `fs` at `mountpoint` and serves it on `MountOptions::threads`
/// workers until it is unmounted; returns the background session.
pub fn spawn_mount(fs: CitronFuse, mountpoint: &Path) -> std::io::Result<fuser::BackgroundSession> {
    spawn_mount_with(fs, mountpoint, "citronfs", &[])
}

/// As [`spawn_mount`], with `source` as the mount's source (what
/// `/proc/mounts` and `findmnt` show; mount(8) matches fstab lines by it)
/// and `extra` mount options (`ro`, `nosuid`, `nodev`, ...) that replace
/// the defaults they contradict.
pub fn spawn_mount_with(
    fs: CitronFuse,
    mountpoint: &Path,
    source: &str,
    extra: &[fuser::MountOption],
) -> std::io::Result<fuser::BackgroundSession> {
    use fuser::MountOption as O;
    let mut config = session_config("citronfs", fs.options.threads);
    let contradicted = |o: &O| match o {
        O::FSName(_) => true,
        O::Dev => extra.contains(&O::NoDev),
        O::Suid => extra.contains(&O::NoSuid),
        _ => false,
    };
    config.mount_options.retain(|o| !contradicted(o));
    config.mount_options.push(O::FSName(source.into()));
    config.mount_options.extend(extra.iter().cloned());
    new_session(fs, mountpoint, &config)?.spawn()
}

/// Mounts `fs` at `mountpoint` as a session not yet served (`run` or
/// `spawn` it), with the file system given the session's notifier: the
/// coherence of shared mappings across mounts invalidates the kernel's
/// pages through it (see [`coherence`]). Every citronfs session is made
/// here.
pub fn new_session(
    fs: CitronFuse,
    mountpoint: &Path,
    config: &fuser::Config,
) -> std::io::Result<fuser::Session<CitronFuse>> {
    let invalidator = fs.coherence.invalidator().clone();
    let caching = (!fs.options.cache_ttl.is_zero()).then(|| (fs.invalidations(), Arc::downgrade(&fs.client)));
    let session = fuser::Session::new(fs, mountpoint, config)?;
    invalidator.set_notifier(session.notifier());
    if let Some((control, client)) = caching {
        // Ends with the file system (its drop stops it) or the client.
        use std::os::fd::AsFd;
        let device = session.as_fd().try_clone_to_owned()?;
        control.spawn(client, session.notifier(), device)?;
    }
    Ok(session)
}

/// How every citronfs session is mounted and served (mount options, access,
/// `threads` workers each with its own cloned `/dev/fuse` descriptor), for
/// another FUSE file system that must be mounted the same way (the lock
/// benchmark's FUSE ceiling).
pub fn session_config(fsname: &str, threads: usize) -> fuser::Config {
    let mut config = fuser::Config::default();
    config.mount_options = vec![
        fuser::MountOption::FSName(fsname.into()),
        fuser::MountOption::Subtype(fsname.into()),
        // fuser gives the subtype only to fusermount; mounted directly (as
        // root) the kernel needs it as an option, or the type is plain
        // "fuse" and mount(8), findmnt and fstab lines cannot tell us apart.
        fuser::MountOption::CUSTOM(format!("subtype={fsname}")),
        fuser::MountOption::DefaultPermissions,
        fuser::MountOption::Dev,
        fuser::MountOption::Suid,
    ];
    config.acl = fuser::SessionACL::All;
    config.n_threads = Some(threads.max(1));
    config.clone_fd = true;
    config
}
