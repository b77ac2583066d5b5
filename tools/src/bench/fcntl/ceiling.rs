//! The FUSE ceiling of `bench fcntl`: a trivial fuser daemon with one file
//! whose `setlk` answers at once, with no lock logic at all, mounted the
//! same way as citronfs (same options, same session configuration, POSIX
//! lock capability on so the kernel sends every lock to the daemon). What
//! it reaches is what the kernel, `/dev/fuse` and fuser cost per lock call
//! on this machine: no file system that locks through FUSE can go faster.

use std::ffi::OsStr;
use std::path::Path;
use std::time::{Duration, SystemTime};

use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, InitFlags,
    KernelConfig, LockOwner, OpenFlags, ReplyAttr, ReplyEmpty, ReplyEntry, ReplyLock, ReplyOpen, Request,
};

/// The one file's name in the root.
pub const FILE_NAME: &str = "lockfile";
const FILE_INO: INodeNo = INodeNo(2);

/// No caching, as citronfs's default (`--attr-ttl 0`).
const TTL: Duration = Duration::ZERO;

fn attr(ino: INodeNo) -> FileAttr {
    let (kind, perm, nlink) = if ino == INodeNo::ROOT {
        (FileType::Directory, 0o755, 2)
    } else {
        (FileType::RegularFile, 0o666, 1)
    };
    let t = SystemTime::UNIX_EPOCH;
    FileAttr {
        ino,
        size: 0,
        blocks: 0,
        atime: t,
        mtime: t,
        ctime: t,
        crtime: t,
        kind,
        perm,
        nlink,
        uid: 0,
        gid: 0,
        rdev: 0,
        blksize: 4096,
        flags: 0,
    }
}

/// A root directory holding [`FILE_NAME`]; every lock request succeeds.
pub struct CeilingFs;

impl Filesystem for CeilingFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        // As citronfs does: without it the kernel keeps locks to itself and
        // never asks the daemon.
        config
            .add_capabilities(InitFlags::FUSE_POSIX_LOCKS)
            .map_err(|missing| std::io::Error::other(format!("the kernel does not offer {missing:?}")))?;
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        if parent == INodeNo::ROOT && name == FILE_NAME {
            reply.entry(&TTL, &attr(FILE_INO), Generation(0))
        } else {
            reply.error(Errno::ENOENT)
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        if ino == INodeNo::ROOT || ino == FILE_INO {
            reply.attr(&TTL, &attr(ino))
        } else {
            reply.error(Errno::ENOENT)
        }
    }

    fn open(&self, _req: &Request, _ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        reply.opened(FileHandle(0), FopenFlags::FOPEN_DIRECT_IO)
    }

    fn flush(&self, _req: &Request, _ino: INodeNo, _fh: FileHandle, _owner: LockOwner, reply: ReplyEmpty) {
        reply.ok()
    }

    fn getlk(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        start: u64,
        end: u64,
        _typ: i32,
        _pid: u32,
        reply: ReplyLock,
    ) {
        reply.locked(start, end, libc::F_UNLCK, 0)
    }

    fn setlk(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        _start: u64,
        _end: u64,
        _typ: i32,
        _pid: u32,
        _sleep: bool,
        reply: ReplyEmpty,
    ) {
        reply.ok()
    }
}

/// Mounts the ceiling daemon at `dir`, served by `threads` FUSE workers.
pub fn mount(dir: &Path, threads: usize) -> std::io::Result<fuser::BackgroundSession> {
    fuser::spawn_mount(CeilingFs, dir, &citronfs_mount::session_config("fuse-ceiling", threads))
}
