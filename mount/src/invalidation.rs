//! The mount's side of coherent caching (issue 13; the meta-server's
//! `grants` module has the protocol): the invalidation thread, and what
//! lets a lookup or getattr answer tell whether an invalidation overtook
//! it.
//!
//! # The invalidation thread
//!
//! One thread per caching mount long-polls the meta-server
//! (`AwaitInvalidations`), tells the kernel to drop what each invalidation
//! names — `notify inval_entry(parent, name)` for an entry,
//! `notify inval_inode(ino, -1, 0)` for attributes only (a negative offset
//! touches no page: no write-back, no page lock) — and acknowledges them
//! all in its next poll. Never from a FUSE worker: `inval_entry` takes the
//! directory's inode lock, which a request of this mount in that directory
//! may hold while its worker waits (see [`crate::coherence`] for the
//! general rule). While the thread waits for such a lock, the change that
//! sent the invalidation waits for its acknowledgement or for the grant to
//! expire, whichever comes first: two mounts changing names the other has
//! cached in one directory at once may each wait out the other's grant
//! (at most a TTL); nothing waits longer.
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
    /// poll, so the mount's end drops it) and notifies through `notifier`.
    pub(crate) fn spawn(
        &self,
        client: Weak<FsClient>,
        notifier: fuser::Notifier,
    ) -> std::io::Result<std::thread::JoinHandle<()>> {
        let control = self.clone();
        std::thread::Builder::new().name("citronfs-inval".into()).spawn(move || control.run(client, notifier))
    }

    fn run(&self, client: Weak<FsClient>, notifier: fuser::Notifier) {
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
                        self.deliver(&notifier, item);
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
    fn deliver(&self, notifier: &fuser::Notifier, item: &Invalidation) {
        let result = match item {
            Invalidation::Attr(ino) => {
                self.0.epochs.bump(*ino);
                notifier.inval_inode(fuser::INodeNo(ino.0), -1, 0)
            }
            Invalidation::Entry { parent, name } => {
                self.0.epochs.bump(*parent);
                use std::os::unix::ffi::OsStrExt;
                notifier.inval_entry(fuser::INodeNo(parent.0), std::ffi::OsStr::from_bytes(name))
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
