//! The FUSE adapter of CitronFS over `fuser` (DESIGN.md §2, §5, §7).
//!
//! Each FUSE request becomes one call of [`FsClient`]; errors become errno in
//! exactly one place ([`errno`]). Files are opened with direct I/O so every
//! read and write reaches the daemon (and from there the data servers'
//! memory, uncached). Attributes and entries are not cached by default; with
//! [`MountOptions::cache_ttl`] the kernel caches what the meta-server grants
//! and the meta-server calls every other mount back before a change answers
//! ([`invalidation`]), so mounts stay strictly coherent either way; a
//! directory the mount made is delegated to it, and it answers lookups and
//! stats there itself ([`delegation`]). Shared
//! mappings are the one use of the page cache, kept coherent across mounts
//! through locks ([`coherence`]). The session is multi-threaded.

mod access;
mod attr_cache;
pub mod caller;
mod coherence;
mod delegation;
mod filesystem;
mod invalidation;
pub mod io_errors;
mod late_changes;
mod listing;
mod locking;
mod moved_dirs;
mod requests;
mod session;
mod setid;

pub use filesystem::MAX_WRITE;
pub use invalidation::InvalidationControl;
pub use requests::{FuseCounters, FuseCounts, FuseOp};
pub use session::{new_session, session_config, spawn_mount, spawn_mount_with, BackgroundSession};

use std::collections::HashMap;
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use citronfs_core::client::FsClient;
use citronfs_core::types::{Attr, Caller, FileKind, Ino, SetAttr, Timestamp};
use citronfs_core::FsError;
use fuser::{
    Errno, FileAttr, FileHandle, FileType, Generation, INodeNo, ReplyData, ReplyEmpty, ReplyEntry, Request,
    TimeOrNow,
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
/// An error that becomes EIO is logged with its cause ([`io_errors`]).
pub fn errno(e: &FsError) -> Errno {
    let errno = match e {
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
        FsError::Io(_)
        | FsError::Fenced
        | FsError::OtherFileSystem { .. }
        | FsError::MetaRestarted
        | FsError::Grace
        | FsError::MetaServerDown
        | FsError::DataServerDown(_) => Errno::EIO,
    };
    if errno == Errno::EIO {
        io_errors::report(e);
    }
    errno
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

/// What a `LOOKUP` answer carries for a name that is not there: node id
/// zero, which the kernel caches as a negative entry for the entry TTL
/// (no attributes are read from it).
fn absent_attr() -> FileAttr {
    FileAttr {
        ino: INodeNo(0),
        size: 0,
        blocks: 0,
        atime: SystemTime::UNIX_EPOCH,
        mtime: SystemTime::UNIX_EPOCH,
        ctime: SystemTime::UNIX_EPOCH,
        crtime: SystemTime::UNIX_EPOCH,
        kind: fuser::FileType::RegularFile,
        perm: 0,
        nlink: 0,
        uid: 0,
        gid: 0,
        rdev: 0,
        blksize: 4096,
        flags: 0,
    }
}

/// What a listing carries for `.` and `..` (directory `ino`): the kernel
/// installs neither from a `READDIRPLUS`, so reads no attribute of them.
fn dot_attr(ino: Ino) -> FileAttr {
    FileAttr { ino: INodeNo(ino.0), kind: fuser::FileType::Directory, ..absent_attr() }
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
    /// The kernel's old entries of directories other mounts moved.
    moved_dirs: moved_dirs::MovedDirs,
    /// The invalidation thread of coherent caching, and its counters.
    invalidations: InvalidationControl,
    /// Entries the kernel's last full `READDIRPLUS` buffer took (see
    /// [`listing`]).
    plus_fit: listing::PlusFit,
    /// Whether this mount's `fsync` flushes data servers (decided at the
    /// first one: see `fsync` in [`filesystem`]).
    fsync_flushes: std::sync::OnceLock<bool>,
}

impl Drop for CitronFuse {
    fn drop(&mut self) {
        self.invalidations.stop();
    }
}

impl CitronFuse {
    pub fn new(client: FsClient, options: MountOptions) -> Self {
        client.set_caching(options.cache_ttl);
        let invalidations = InvalidationControl::default();
        if !options.cache_ttl.is_zero() {
            // Releases go after the close (`FsClient::release_later`); what
            // their answers hold again is kept with the delegations.
            let control = invalidations.clone();
            client.on_held_again(Box::new(move |dir, attr, sent| {
                control.delegations().held_again(dir, attr, sent)
            }));
            let control = invalidations.clone();
            // An unlink answered first and refused after all
            // (`late_changes`): what is known here of its directory goes,
            // so that the name shows again.
            client.on_late_change_failed(Box::new(move |dir| {
                control.delegations().unsure(dir);
                control.attrs().invalidate(dir);
            }));
        }
        Self {
            client: Arc::new(client),
            options,
            open_files: Mutex::new(HashMap::new()),
            next_fh: AtomicU64::new(1),
            posix_owners: Mutex::new(HashMap::new()),
            syscalls: caller::SyscallFiles::default(),
            coherence: coherence::Coherence::start().expect("start the coherence threads"),
            requests: FuseCounters::default(),
            moved_dirs: moved_dirs::MovedDirs::default(),
            invalidations,
            plus_fit: listing::PlusFit::default(),
            fsync_flushes: std::sync::OnceLock::new(),
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

    /// Before a `LOOKUP` answers `a`: if it is a directory, the kernel
    /// drops the entries it holds of it under a name it may have had
    /// before ([`moved_dirs`]).
    fn before_answering(&self, a: &Attr) {
        if a.kind == FileKind::Dir {
            self.moved_dirs.prune(a.ino);
        }
    }

    fn entry(&self, reply: ReplyEntry, r: Result<Attr, FsError>) {
        self.entry_for(reply, r, delegation::Ttls::both(self.options.attr_ttl))
    }

    /// [`Self::entry`] with `ttls` for the entry and its attributes.
    fn entry_for(&self, reply: ReplyEntry, r: Result<Attr, FsError>, ttls: delegation::Ttls) {
        match r {
            Ok(a) => reply.entry_with_ttls(&ttls.attr, &ttls.entry, &fuse_attr(&a), Generation(0)),
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

    /// `r`, the answer of a call through `fh`, unless it failed because
    /// `fh`'s registration ended during the call (the open was dropped
    /// under it: "not open"): then EIO, as for a call that began after.
    fn through_handle<T>(&self, fh: FileHandle, r: Result<T, FsError>) -> Result<T, FsError> {
        match r {
            Err(_) if self.check_handle(fh).is_err() => Err(FsError::Fenced),
            r => r,
        }
    }

    /// Whether `fh` opened for append; EIO if it belongs to a registration
    /// the meta-server has fenced.
    fn check_handle(&self, fh: FileHandle) -> Result<bool, Errno> {
        match self.open_files.lock().get(&fh.0) {
            Some(f) if f.registration != self.client.registration() => Err(errno(&FsError::Fenced)),
            Some(f) => Ok(f.append),
            None => Ok(false),
        }
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
