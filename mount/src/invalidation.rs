//! The mount's side of coherent caching (the meta-server's
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
//! * entries: one `FUSE_NOTIFY_INC_EPOCH` per batch (kernel 6.16 and
//!   later), which makes every dentry of the mount older than the new
//!   epoch revalidate at its next use (a `LOOKUP` from `d_revalidate`), so
//!   the named entries are as good as dropped, and takes no lock. The
//!   precise `inval_entry(parent, name)` takes the directory's inode lock
//!   (on 6.18 even with `FUSE_EXPIRE_ONLY`), which a request of this mount
//!   in that directory may hold while it waits for *another* mount's
//!   acknowledgement: two mounts unlinking in one directory names the
//!   other had looked up would each wait out the other's grant (seen in
//!   `concurrent_unlinks_in_one_directory_on_two_mounts_wait_for_no_grant`).
//!   The price: after another mount removes or renames a name this mount
//!   had looked up, each path component costs one `LOOKUP` again, once.
//!   fuser does not offer the notification, so it is written to a
//!   descriptor of the session's `/dev/fuse` here ([`Device`]); a kernel
//!   that refuses it gets the precise, locking ones.
//!
//! An attribute invalidation also drops what the mount keeps itself of the
//! inode ([`crate::attr_cache`]), first: before the kernel is told and
//! the meta-server hears the acknowledgement. A delegation's revocation
//! drops its listing and held attributes ([`crate::delegation`]), then
//! the kernel is told of the held attributes and, if it may still cache
//! one of the listing's entries, of the names. A poll that renewed this
//! mount's delegations renews them here once its revocations are
//! processed.
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

use std::borrow::Cow;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use citronfs_core::client::FsClient;
use citronfs_core::proto::Invalidation;
use citronfs_core::types::{ClientId, Ino};

use crate::attr_cache::AttrCache;
use crate::delegation::Delegations;

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
    /// Directory and new files' attributes the mount answers `GETATTR`
    /// with itself.
    attrs: AttrCache,
    /// Directories delegated to this mount: the `LOOKUP`s and `GETATTR`s
    /// it answers itself.
    delegations: Delegations,
    /// Test hook: the thread polls and notifies nothing while set, as if
    /// the mount's process were stopped.
    stalled: AtomicBool,
    /// Test hook: the thread acknowledges every invalidation and acts on
    /// none, a deliberately stale mount.
    ignoring: AtomicBool,
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

    /// **Test only** (hidden from the docs; nothing else may call it):
    /// while set, the thread keeps polling and acknowledges every
    /// invalidation but drops nothing, neither in the kernel nor in the
    /// mount's own caches: changes elsewhere answer at once and this mount
    /// keeps answering from what it cached, for up to its TTL. A
    /// deliberately stale mount, which a coherence checker must catch.
    #[doc(hidden)]
    pub fn test_only_ignore_invalidations(&self, ignoring: bool) {
        self.0.ignoring.store(ignoring, Ordering::SeqCst);
    }

    /// Invalidations told to the kernel so far.
    pub fn delivered(&self) -> u64 {
        self.0.delivered.load(Ordering::Relaxed)
    }

    pub(crate) fn epochs(&self) -> &Epochs {
        &self.0.epochs
    }

    pub(crate) fn attrs(&self) -> &AttrCache {
        &self.0.attrs
    }

    pub(crate) fn delegations(&self) -> &Delegations {
        &self.0.delegations
    }

    /// Directories delegated to this mount now (tests, diagnostics).
    pub fn delegated_dirs(&self) -> usize {
        self.0.delegations.len()
    }

    /// Directories and new files whose attributes the mount answers
    /// `GETATTR` with itself now, expired ones included (tests,
    /// diagnostics).
    pub fn local_attrs(&self) -> usize {
        self.0.attrs.len()
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
        let notify = Notify { notifier, epochs: Some(Device(device)) };
        // The registration the mount serves under from now on: the
        // delegations its requests take before the thread's first turn (a
        // busy machine may run that late) are this one's, not an old one's.
        let registration = client.upgrade().map(|c| (c.client_id(), c.reclaims()));
        std::thread::Builder::new()
            .name("citronfs-inval".into())
            .spawn(move || control.run(client, notify, registration))
    }

    fn run(&self, client: Weak<FsClient>, mut notifier: Notify, mut registration: Option<(ClientId, u64)>) {
        let mut acked = 0;
        loop {
            self.wait_while_stalled();
            if self.0.stop.load(Ordering::SeqCst) {
                return;
            }
            let Some(c) = client.upgrade() else { return };
            if c.is_shut_down() {
                return;
            }
            // A new registration, or one reclaimed from a restarted
            // meta-server, numbers its invalidations afresh.
            let me = (c.client_id(), c.reclaims());
            if registration != Some(me) {
                let reclaimed = registration.is_some_and(|(id, _)| id == me.0);
                registration = Some(me);
                acked = 0;
                // The delegations were the old registration's: the new
                // one's polls renew none of them.
                self.0.delegations.clear();
                if reclaimed {
                    // Nor does a restarted meta-server know what it granted.
                    self.0.attrs.invalidate_all();
                }
            }
            let (sent, ttl) = (Instant::now(), c.caching());
            let polled = c.await_invalidations(acked);
            drop(c);
            match polled {
                Ok(polled) => {
                    self.wait_while_stalled();
                    self.deliver(&mut notifier, &polled.items);
                    acked = polled.through;
                    // After the revocations it carries (see `delegation`),
                    // and only if it renewed this registration's.
                    if polled.renewed && polled.client == me.0 {
                        self.0.delegations.renew(sent, ttl);
                    }
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
    fn deliver(&self, notify: &mut Notify, items: &[Invalidation]) {
        if self.0.ignoring.load(Ordering::SeqCst) {
            return;
        }
        let mut entries: Vec<(Ino, Cow<[u8]>)> = Vec::new();
        let mut inodes = Vec::new();
        for item in items {
            match item {
                Invalidation::Attr(ino) => {
                    self.0.epochs.bump(*ino);
                    self.0.attrs.invalidate(*ino);
                    inodes.push(*ino);
                }
                Invalidation::Entry { parent, name } => {
                    self.0.epochs.bump(*parent);
                    entries.push((*parent, Cow::Borrowed(name)));
                }
                // What the mount answered from the delegation, with the
                // delegation's time as TTL: every name and held attribute.
                Invalidation::Listing(dir) => {
                    self.0.epochs.bump(*dir);
                    let dropped = self.0.delegations.revoked(*dir);
                    for ino in dropped.held {
                        self.0.epochs.bump(ino);
                        inodes.push(ino);
                    }
                    entries.extend(dropped.names.into_iter().map(|name| (*dir, Cow::Owned(name))));
                }
                // Another mount looked into a directory delegated here: no
                // more unlinks answered first there (the poll that
                // acknowledges sends those queued, `crate::late_changes`).
                // The kernel keeps what it has.
                Invalidation::Shared(dir) => self.0.delegations.shared(*dir),
            }
        }
        for ino in inodes {
            let result = notify.notifier.inval_inode(fuser::INodeNo(ino.0), -1, 0);
            warn_failed(&Invalidation::Attr(ino), result);
        }
        if !entries.is_empty() {
            let named: Vec<(Ino, &[u8])> = entries.iter().map(|(p, n)| (*p, n.as_ref())).collect();
            notify.entries(&named);
        }
        self.0.delivered.fetch_add(items.len() as u64, Ordering::Relaxed);
    }
}

/// Logs a failed notify; the kernel answers ENOENT for what it does not
/// cache, which is no failure.
fn warn_failed(item: &Invalidation, result: std::io::Result<()>) {
    match result {
        Err(e) if e.raw_os_error() != Some(libc::ENOENT) => {
            log::warn!("invalidating {item:?} in the kernel: {e}")
        }
        _ => {}
    }
}

/// How the thread tells the kernel.
struct Notify {
    notifier: fuser::Notifier,
    /// `None` once the kernel refused `FUSE_NOTIFY_INC_EPOCH`.
    epochs: Option<Device>,
}

impl Notify {
    /// Invalidates the entries `(parent, name)`.
    fn entries(&mut self, entries: &[(Ino, &[u8])]) {
        if let Some(device) = &self.epochs {
            match device.inc_epoch() {
                Ok(()) => return,
                Err(e) => {
                    log::warn!(
                        "the kernel refuses FUSE_NOTIFY_INC_EPOCH ({e}; before 6.16?): entry invalidations \
                         take the directory's lock, and changes in one directory on two mounts may wait out \
                         a grant"
                    );
                    self.epochs = None;
                }
            }
        }
        use std::os::unix::ffi::OsStrExt;
        for (parent, name) in entries {
            let result =
                self.notifier.inval_entry(fuser::INodeNo(parent.0), std::ffi::OsStr::from_bytes(name));
            warn_failed(&Invalidation::Entry { parent: *parent, name: name.to_vec() }, result);
        }
    }
}

/// A descriptor of the session's `/dev/fuse`, for the notification fuser
/// does not offer.
struct Device(OwnedFd);

/// `fuse_notify_code::FUSE_NOTIFY_INC_EPOCH`.
const FUSE_NOTIFY_INC_EPOCH: i32 = 8;

impl Device {
    /// `FUSE_NOTIFY_INC_EPOCH`: every dentry of the mount revalidates at its
    /// next use.
    fn inc_epoch(&self) -> std::io::Result<()> {
        // fuse_out_header { len, error: the notify code, unique: 0 }, and
        // no body.
        let len: u32 = 16;
        let mut buf = Vec::with_capacity(len as usize);
        buf.extend_from_slice(&len.to_ne_bytes());
        buf.extend_from_slice(&FUSE_NOTIFY_INC_EPOCH.to_ne_bytes());
        buf.extend_from_slice(&0u64.to_ne_bytes());
        // SAFETY: `buf` is a live, initialised buffer of `buf.len()` bytes
        // and the descriptor is ours (a duplicate of the session's) for as
        // long as `self` lives.
        let n = unsafe { libc::write(self.0.as_raw_fd(), buf.as_ptr().cast(), buf.len()) };
        match n {
            n if n < 0 => Err(std::io::Error::last_os_error()),
            n if n as usize == buf.len() => Ok(()),
            n => Err(std::io::Error::other(format!("short notify write: {n} of {} bytes", buf.len()))),
        }
    }
}
