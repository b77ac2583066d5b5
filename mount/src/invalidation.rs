//! The mount's side of coherent caching (issue 13; the meta-server's
//! `grants` module has the protocol): the invalidation thread, and what
//! lets a lookup or getattr answer tell whether an invalidation overtook
//! it.
//!
//! # The invalidation thread
//!
//! One thread per caching mount long-polls the meta-server
//! (`AwaitInvalidations`), tells the kernel to drop what each invalidation
//! names and acknowledges them all in its next poll:
//!
//! * attributes: `notify inval_inode(ino, -1, 0)` (a negative offset
//!   touches no page: no write-back, no page lock);
//! * an entry: `notify inval_entry(parent, name)` with `FUSE_EXPIRE_ONLY`
//!   (kernel 6.2 and later), which only expires the dentry — its next use
//!   asks the daemon (`LOOKUP` from `d_revalidate`), so it is as good as
//!   dropped — and takes no lock. A plain `inval_entry` takes the
//!   directory's inode lock, which a request of this mount in that
//!   directory (an unlink waiting for *another* mount's acknowledgement)
//!   may hold: two mounts unlinking in one directory names the other had
//!   looked up would each wait out the other's grant. fuser does not offer
//!   the flag, so the notification is written to a descriptor of the
//!   session's `/dev/fuse` here ([`ExpireOnly`]); a kernel that refuses it
//!   gets the plain one.
//!
//! Never from a FUSE worker (see [`crate::coherence`] for the general
//! rule). Whatever the thread waits for, the change that sent the
//! invalidation waits only until its acknowledgement or the grant's
//! expiry, whichever comes first.
//!
//! # Replies overtaken by an invalidation
//!
//! A lookup or getattr answer made before a change may reach the kernel
//! after the change's invalidation did, and the kernel would then cache a
//! stale answer for a whole TTL:
//!
//! * attributes of an inode the kernel knows: the kernel itself drops the
//!   answer (an `inval_inode` bumps the inode's `attr_version`, and a reply
//!   to a request that sampled an older version is not installed);
//! * an entry found by a lookup under the directory's lock: `inval_entry`
//!   takes that lock, so it runs after the entry is installed, and drops
//!   it;
//! * what neither covers — an entry revalidated without the directory's
//!   lock (an expired entry's `LOOKUP` from `d_revalidate`), an inode new
//!   to the kernel — is covered here: every invalidation first bumps
//!   counters ([`Epochs`]: one per stripe of inodes, and one for all), a
//!   worker samples a counter before its RPC — a getattr its inode's, a
//!   lookup the one for all (the inode it finds is not known before) — and
//!   compares it when the answer is back, and answers with TTL zero if it
//!   moved.
//!
//! What remains is the moment between a worker's comparison and the
//! kernel's installation of its answer (a wake-up of the requesting task,
//! microseconds, and only for the two cases of the last point): an
//! invalidation processed exactly then leaves the stale answer cached until
//! its TTL.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use citronfs_core::client::FsClient;
use citronfs_core::proto::Invalidation;
use citronfs_core::types::Ino;

/// Counters per stripe of inodes: a collision only makes a reply
/// uncached.
const STRIPES: usize = 1024;

/// How long the thread naps after a failed poll (the meta-server away, or
/// this client fenced until it registers again).
const RETRY_NAP: Duration = Duration::from_millis(100);

/// How often a stalled thread looks whether it may go on.
const STALL_NAP: Duration = Duration::from_millis(5);

/// Invalidations processed, per stripe of inodes and in all (see the
/// module header).
pub struct Epochs {
    stripes: [AtomicU64; STRIPES],
    all: AtomicU64,
}

impl Default for Epochs {
    fn default() -> Self {
        Self { stripes: std::array::from_fn(|_| AtomicU64::new(0)), all: AtomicU64::new(0) }
    }
}

/// A counter of [`Epochs`], sampled before an RPC.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sample(u64);

// Orderings: SeqCst throughout. A worker's sample after its answer must
// see a bump the invalidation thread made before its notify, so a sample
// that still equals the one taken before the RPC means no invalidation of
// what it covers was told to the kernel in between.
impl Epochs {
    fn stripe(&self, ino: Ino) -> &AtomicU64 {
        &self.stripes[(ino.0 as usize) % STRIPES]
    }

    /// The counter of `ino`'s stripe (a getattr).
    pub fn of(&self, ino: Ino) -> Sample {
        Sample(self.stripe(ino).load(Ordering::SeqCst))
    }

    /// The counter of every invalidation (a lookup).
    pub fn all(&self) -> Sample {
        Sample(self.all.load(Ordering::SeqCst))
    }

    fn bump(&self, ino: Ino) {
        self.stripe(ino).fetch_add(1, Ordering::SeqCst);
        self.all.fetch_add(1, Ordering::SeqCst);
    }
}

/// What the invalidation thread and the workers share.
#[derive(Default)]
struct Shared {
    epochs: Epochs,
    /// Test hook: the thread polls and notifies nothing while set, as if
    /// the mount's process were stopped.
    stalled: AtomicBool,
    /// Invalidations told to the kernel.
    delivered: AtomicU64,
    stop: AtomicBool,
}

/// A handle on a mount's invalidation thread, usable while it serves.
#[derive(Clone, Default)]
pub struct InvalidationControl(Arc<Shared>);

impl InvalidationControl {
    /// **Test only**: stops (`true`) or resumes the thread's polls and
    /// notifies, as a stopped process would; invalidations wait on the
    /// meta-server meanwhile, and changes wait out this mount's grants.
    pub fn stall(&self, stalled: bool) {
        self.0.stalled.store(stalled, Ordering::SeqCst);
    }

    /// Invalidations told to the kernel so far.
    pub fn delivered(&self) -> u64 {
        self.0.delivered.load(Ordering::Relaxed)
    }

    pub(crate) fn epochs(&self) -> &Epochs {
        &self.0.epochs
    }

    /// Ends the thread at its next turn.
    pub(crate) fn stop(&self) {
        self.0.stop.store(true, Ordering::SeqCst);
    }

    fn wait_while_stalled(&self) {
        while self.0.stalled.load(Ordering::SeqCst) && !self.0.stop.load(Ordering::SeqCst) {
            std::thread::sleep(STALL_NAP);
        }
    }

    /// Starts the thread: it polls through `client` (held only during a
    /// poll, so the mount's end drops it) and notifies through `notifier`
    /// and `device` (a descriptor of the session's `/dev/fuse`).
    pub(crate) fn spawn(
        &self,
        client: Weak<FsClient>,
        notifier: fuser::Notifier,
        device: OwnedFd,
    ) -> std::io::Result<std::thread::JoinHandle<()>> {
        let control = self.clone();
        let notify = Notify { notifier, expire_only: Some(ExpireOnly(device)) };
        std::thread::Builder::new().name("citronfs-inval".into()).spawn(move || control.run(client, notify))
    }

    fn run(&self, client: Weak<FsClient>, mut notifier: Notify) {
        let mut acked = 0;
        let mut registration = None;
        loop {
            self.wait_while_stalled();
            if self.0.stop.load(Ordering::SeqCst) {
                return;
            }
            let Some(c) = client.upgrade() else { return };
            if c.is_shut_down() {
                return;
            }
            // A new registration numbers its invalidations afresh.
            let me = c.client_id();
            if registration != Some(me) {
                registration = Some(me);
                acked = 0;
            }
            let polled = c.await_invalidations(acked);
            drop(c);
            match polled {
                Ok((through, items)) => {
                    self.wait_while_stalled();
                    for item in &items {
                        self.deliver(&mut notifier, item);
                    }
                    acked = through;
                }
                Err(e) => {
                    log::debug!("polling for invalidations: {e}");
                    std::thread::sleep(RETRY_NAP);
                }
            }
        }
    }

    /// Tells the kernel to drop what `item` names. The kernel answers
    /// ENOENT for what it does not cache, which is no failure.
    fn deliver(&self, notify: &mut Notify, item: &Invalidation) {
        let result = match item {
            Invalidation::Attr(ino) => {
                self.0.epochs.bump(*ino);
                notify.notifier.inval_inode(fuser::INodeNo(ino.0), -1, 0)
            }
            Invalidation::Entry { parent, name } => {
                self.0.epochs.bump(*parent);
                notify.entry(*parent, name)
            }
        };
        self.0.delivered.fetch_add(1, Ordering::Relaxed);
        match result {
            Err(e) if e.raw_os_error() != Some(libc::ENOENT) => {
                log::warn!("invalidating {item:?} in the kernel: {e}")
            }
            _ => {}
        }
    }
}

/// How the thread tells the kernel.
struct Notify {
    notifier: fuser::Notifier,
    /// `None` once the kernel refused an expire-only invalidation.
    expire_only: Option<ExpireOnly>,
}

impl Notify {
    fn entry(&mut self, parent: Ino, name: &[u8]) -> std::io::Result<()> {
        if let Some(e) = &self.expire_only {
            match e.expire_entry(parent, name) {
                Err(err) if err.raw_os_error() == Some(libc::EINVAL) => {
                    log::warn!(
                        "the kernel refuses FUSE_EXPIRE_ONLY (before 6.2?): entry invalidations take the \
                         directory's lock, and changes in one directory on two mounts may wait out a grant"
                    );
                    self.expire_only = None;
                }
                done => return done,
            }
        }
        use std::os::unix::ffi::OsStrExt;
        self.notifier.inval_entry(fuser::INodeNo(parent.0), std::ffi::OsStr::from_bytes(name))
    }
}

/// `FUSE_NOTIFY_INVAL_ENTRY` with `FUSE_EXPIRE_ONLY`, written to the
/// session's `/dev/fuse` (the kernel's `fuse_notify_inval_entry`).
struct ExpireOnly(OwnedFd);

/// `fuse_notify_code::FUSE_NOTIFY_INVAL_ENTRY`.
const FUSE_NOTIFY_INVAL_ENTRY: i32 = 3;
/// `fuse_notify_inval_entry_out.flags`: only expire the entry.
const FUSE_EXPIRE_ONLY: u32 = 1;

impl ExpireOnly {
    fn expire_entry(&self, parent: Ino, name: &[u8]) -> std::io::Result<()> {
        let namelen =
            u32::try_from(name.len()).map_err(|_| std::io::Error::from_raw_os_error(libc::E2BIG))?;
        // fuse_out_header { len, error: the notify code, unique: 0 }, then
        // fuse_notify_inval_entry_out { parent, namelen, flags }, then the
        // name and its NUL.
        let len = 16 + 16 + name.len() + 1;
        let mut buf = Vec::with_capacity(len);
        buf.extend_from_slice(&(len as u32).to_ne_bytes());
        buf.extend_from_slice(&FUSE_NOTIFY_INVAL_ENTRY.to_ne_bytes());
        buf.extend_from_slice(&0u64.to_ne_bytes());
        buf.extend_from_slice(&parent.0.to_ne_bytes());
        buf.extend_from_slice(&namelen.to_ne_bytes());
        buf.extend_from_slice(&FUSE_EXPIRE_ONLY.to_ne_bytes());
        buf.extend_from_slice(name);
        buf.push(0);
        // SAFETY: `buf` is a live, initialised buffer of `buf.len()` bytes
        // and the descriptor is ours (a duplicate of the session's) for as
        // long as `self` lives.
        let n = unsafe { libc::write(self.0.as_raw_fd(), buf.as_ptr().cast(), buf.len()) };
        match n {
            n if n < 0 => match std::io::Error::last_os_error() {
                e if e.raw_os_error() == Some(libc::ENOENT) => Ok(()),
                e => Err(e),
            },
            n if n as usize == buf.len() => Ok(()),
            n => Err(std::io::Error::other(format!("short notify write: {n} of {} bytes", buf.len()))),
        }
    }
}
