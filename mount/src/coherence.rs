//! Shared mappings, and their coherence across mounts through locks
//! (README "Mappings"; DESIGN.md §5, §7).
//!
//! Files are opened with direct I/O, so `read(2)` and `write(2)` always
//! reach the daemon and the data servers. With `FUSE_DIRECT_IO_ALLOW_MMAP`
//! (kernel ≥ 6.6) the kernel also maps such files `MAP_SHARED`, from the
//! mount's page cache: a fault reads the page (a `FUSE_READ` without lock
//! owner), and dirty pages are written back (`FUSE_WRITE` marked
//! `FUSE_WRITE_CACHE`) at `msync`, `fsync`, `munmap`, every `close` (the
//! kernel's flush writes the inode back first) and by the kernel's periodic
//! writeback. On one mount the kernel keeps mappings and direct I/O
//! coherent (a direct read or write first writes back the pages it covers).
//! Across mounts nothing would: each kernel's cache is its own. So, as NFS
//! ties its cache to locks, this module ties the page cache to fcntl and
//! flock locks:
//!
//! * before a lock request or an unlock is applied, this mount's pages of
//!   the range are written back and dropped (`notify inval_inode`: the
//!   kernel launders dirty pages — sends their `FUSE_WRITE` and waits — and
//!   unmaps and drops the rest), so a release publishes what was written
//!   through mappings under the lock, and a downgrade what was written
//!   under the write lock;
//! * after a lock is granted, the range is dropped again, so the holder's
//!   next access faults in what other mounts wrote under the lock (and
//!   nothing a fault cached between the two notifies survives).
//!
//! Only inodes this mount holds pages of pay for it: an inode is marked at
//! its first page-cache read (a fault, or readahead for one) and unmarked
//! at its last release on this mount — after which its pages cannot be
//! used again without an open or an mmap, each of which makes the kernel
//! drop them (no `FOPEN_KEEP_CACHE`). Other lock calls take the usual path
//! and cost nothing more.
//!
//! Deadlocks: a notify makes the kernel send requests to this daemon (the
//! launder's `FUSE_WRITE`) and wait for page locks that faults hold while
//! their `FUSE_READ` waits for a worker. So a notify is never sent from a
//! FUSE worker: the worker hands the request to the coherence threads and
//! returns. Workers never wait for these threads, so however few workers
//! there are, one is free for the requests a notify causes.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use citronfs_core::locks::{ByteRange, OFFSET_MAX};
use citronfs_core::types::Ino;
use crossbeam_channel::Sender;
use parking_lot::Mutex;

/// Work for a coherence thread: a lock call on a cached inode.
pub type Job = Box<dyn FnOnce() + Send>;

/// Coherence threads: notifies of different inodes (and ranges) need not
/// wait for each other's write-backs.
const THREADS: usize = 2;

/// What this mount holds of an inode.
#[derive(Default)]
struct InodeUse {
    /// Open file handles.
    opens: u32,
    /// The kernel has read pages of it into the page cache since it was
    /// opened here.
    cached: bool,
}

/// Invalidates this mount's pages and runs jobs on the coherence threads;
/// cheap to clone (the completions of blocked lock requests keep one).
#[derive(Clone)]
pub struct Invalidator {
    /// Set once the session exists (the file system moves into it first).
    notifier: Arc<OnceLock<fuser::Notifier>>,
    jobs: Sender<Job>,
}

impl Invalidator {
    /// Writes back and drops this mount's pages of `range` of `ino`.
    /// Failures are logged: the lock call goes on (the pages may be gone
    /// already, or the mount going away).
    pub fn invalidate(&self, ino: Ino, range: ByteRange) {
        let Some(notifier) = self.notifier.get() else {
            static WARNED: std::sync::Once = std::sync::Once::new();
            WARNED.call_once(|| {
                log::error!(
                    "no FUSE notifier: this session was not made by citronfs_mount::new_session, so shared \
                     mappings are not kept coherent across mounts"
                )
            });
            return;
        };
        let len = if range.last >= OFFSET_MAX { 0 } else { range.last - range.start + 1 };
        let (Ok(offset), Ok(len)) = (i64::try_from(range.start), i64::try_from(len)) else {
            return;
        };
        if let Err(e) = notifier.inval_inode(fuser::INodeNo(ino.0), offset, len) {
            log::warn!("invalidating the cached pages of inode {} at {offset}+{len}: {e}", ino.0);
        }
    }

    /// The session's notifier, once it exists.
    pub fn set_notifier(&self, notifier: fuser::Notifier) {
        let _ = self.notifier.set(notifier);
    }

    /// Runs `job` on a coherence thread.
    pub fn run(&self, job: Job) {
        if let Err(e) = self.jobs.send(job) {
            // No thread left (shutting down): run it here rather than drop a reply.
            (e.into_inner())();
        }
    }
}

/// The mount's page-cache bookkeeping and its coherence threads.
pub struct Coherence {
    inodes: Mutex<HashMap<Ino, InodeUse>>,
    invalidator: Invalidator,
}

impl Coherence {
    pub fn start() -> std::io::Result<Self> {
        let (jobs, incoming) = crossbeam_channel::unbounded::<Job>();
        for i in 0..THREADS {
            let incoming = incoming.clone();
            // Detached: a thread ends when every sender is gone (the file
            // system and the completions of blocked requests).
            std::thread::Builder::new().name(format!("citronfs-coherence-{i}")).spawn(move || {
                for job in incoming {
                    job();
                }
            })?;
        }
        Ok(Self {
            inodes: Mutex::new(HashMap::new()),
            invalidator: Invalidator { notifier: Arc::new(OnceLock::new()), jobs },
        })
    }

    pub fn invalidator(&self) -> &Invalidator {
        &self.invalidator
    }

    pub fn opened(&self, ino: Ino) {
        self.inodes.lock().entry(ino).or_default().opens += 1;
    }

    /// The last release of an inode on this mount forgets it: its pages
    /// are dropped by the kernel at the next open or mmap.
    pub fn released(&self, ino: Ino) {
        let mut inodes = self.inodes.lock();
        if let Some(u) = inodes.get_mut(&ino) {
            u.opens = u.opens.saturating_sub(1);
            if u.opens == 0 {
                inodes.remove(&ino);
            }
        }
    }

    /// The kernel read pages of `ino` into its cache (a fault).
    pub fn cached(&self, ino: Ino) {
        // Pages are read through an open file, so the inode is here.
        if let Some(u) = self.inodes.lock().get_mut(&ino) {
            u.cached = true;
        }
    }

    /// Whether lock calls on `ino` must keep the page cache coherent.
    pub fn is_cached(&self, ino: Ino) -> bool {
        self.inodes.lock().get(&ino).is_some_and(|u| u.cached)
    }
}
