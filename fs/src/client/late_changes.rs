//! Creates and unlinks answered before they are sent (for the
//! create and delete phases of mdtest and IO500; CephFS's asynchronous
//! create and unlink under its directory capabilities are the same idea).
//!
//! A caching mount that holds the delegation of a directory knows every
//! name in it, and no other client has looked into it since it was made:
//! the meta-server recalls the delegation before it serves any other
//! client's request that names the directory, a name in it or a child held
//! with it (meta-server `grants`, "Late changes"). So the mount may answer
//! the create of a regular file there, and the unlink of a file it made
//! there, at once and tell the meta-server a moment later
//! ([`FsClient::create_later`], [`FsClient::unlink_later`]); the mount
//! decides which qualify (`mount::late_changes`). Nobody can tell the
//! difference:
//!
//! * **this client's later calls**: every call sends the queued changes
//!   first and waits for their answer ([`FsClient::flush_late_changes`],
//!   from `FsClient::before_call`), so the meta-server sees this client's
//!   operations in the order its kernel was answered — a create of the
//!   name again, an rmdir of the directory, a statfs, a write's
//!   allocation or a release of a file created late;
//! * **other clients**: their request waits for the recall, and the mount
//!   acknowledges a recall in its next poll, which sends the queued
//!   changes first and is sent once they are applied (an idle poll,
//!   acknowledging nothing, sends nothing: `FsClient::await_invalidations`);
//! * **inode numbers**: a create is answered with an inode (and its
//!   listing cookie) the meta-server lent this client ahead, with an
//!   attribute slot kept for it, so the create cannot find the attribute
//!   region full when it arrives (meta-server `namespace::lending`); a
//!   loan is asked for when the last one is used up, one call per
//!   [`LOAN`] creates;
//! * **a file created late is open here**: its open is counted, and its
//!   lock memory and layout lent, by the create's answer. Until then the
//!   client's use of the file that needs them — a lock, a read, a write —
//!   sends the queue first ([`FsClient::pin`](super::FsClient)), and its
//!   release waits behind the queue (`releases`). A write that sends it
//!   names the extents it needs, which the meta-server allocates with the
//!   file's create ([`LateCreate::first_write`]): a create and its first
//!   write cost one call, as `CreateOpen` and `AllocChunks` cost two;
//! * **times**: each change carries the time the mount answered it, which
//!   its kernel shows as the file's times and the directory's mtime and
//!   ctime, and the meta-server sets those to it;
//! * **a batch not answered** (the meta-server unreachable, this client
//!   fenced until it registers again): put back in front of the queue and
//!   sent again, by the sender after a nap or by the client's next call.
//!   Each unlink names the inode it was answered for, so one sent twice or
//!   late removes nothing else (the meta-server answers `NotFound`, which
//!   is no failure: what it removed is gone); a create sent twice finds
//!   the file it made. Until then the client's calls fail as well
//!   (fenced, or the meta-server away), and each tries the queue first,
//!   so none overtakes them but one sent in the moment the meta-server
//!   comes back, between the queue's try and its own;
//! * **a change refused anyway** (the mount checks what the meta-server
//!   checks): logged, counted ([`FsClient::late_change_failures`]) and
//!   handed to the mount's hook ([`FsClient::on_late_change_failed`]),
//!   which drops what it knew of the directory so that it is asked again.
//!
//! What is not covered:
//! * a mount stopped (frozen, partitioned) between its answer and the
//!   batch, for longer than its delegation lasts. The other mounts stop
//!   waiting for its acknowledgement when the delegation expires and see
//!   the directory without those changes until it comes back and sends
//!   them. Each unlink names the inode it was answered for
//!   ([`LateUnlink::ino`]), so one that comes after another mount removed
//!   the file and made the name again removes nothing; a create of a name
//!   another mount made meanwhile is refused. A batch goes [`LINGER`]
//!   after its first change at the latest, against a delegation of the TTL
//!   (a second by default), so that takes a stop within those
//!   milliseconds;
//! * a client that loses its lease (fenced) with creates queued: its loan
//!   ended with its registration, so they are refused when it sends them
//!   under the new one (logged and counted). Its opens and locks were
//!   dropped with the lease as well.
//!
//! # When a batch goes
//!
//! At [`BATCH`] changes, at the client's next call of any kind, or after
//! the linger (`ClientConfig::late_linger`, by default [`LINGER`]) from
//! the first: a loop of creates or unlinks sends one `LateChanges` per
//! batch, which is what spares the meta-server a wake-up and the mount a
//! round trip per file.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use super::batches::Batches;
use super::{unexpected, FsClient, Shared};
use crate::error::FsError;
use crate::proto::{
    FileLayout, LateChange, LateCreate, LateDone, LateUnlink, LentInodes, MetaRequest, MetaResponse,
};
use crate::types::{ChunkIndex, Ino};

/// How long a queued change waits for others when nothing else sends it:
/// a few ms, well within a delegation's TTL (see the module header).
pub const LINGER: Duration = Duration::from_millis(2);
/// Changes that go at once, without waiting out the linger.
pub const BATCH: usize = 256;
/// Inodes asked for in one loan.
pub const LOAN: u32 = 256;
/// How long the sender waits before it tries a batch again that was not
/// answered (the meta-server away, or this client fenced).
const RETRY_NAP: Duration = Duration::from_millis(100);

/// Where the directory of a change the meta-server refused goes (the
/// mount's delegations).
pub type FailedHook = Box<dyn Fn(Ino) + Send + Sync>;

/// The inodes lent to this client and not used yet.
#[derive(Default)]
struct Loan {
    /// Each with its cookie; the next one to use last.
    free: Vec<(Ino, u64)>,
    /// The registration they were lent under (they end with it).
    registration: u64,
}

/// The changes of a client waiting to be sent, and what became of them.
pub(super) struct LateChanges {
    batches: Batches<LateChange>,
    failures: AtomicU64,
    hook: parking_lot::RwLock<Option<FailedHook>>,
    loan: Mutex<Loan>,
    /// Layouts of files created late and open here, from their answers,
    /// until the client's next use of each installs it
    /// ([`FsClient::settle_late`], [`FsClient::created_layout`]) or their
    /// last close drops it.
    layouts: Mutex<HashMap<Ino, FileLayout>>,
}

impl LateChanges {
    pub(super) fn new(linger: Duration) -> Self {
        Self {
            batches: Batches::new(linger, BATCH),
            failures: AtomicU64::new(0),
            hook: parking_lot::RwLock::new(None),
            loan: Mutex::new(Loan::default()),
            layouts: Mutex::new(HashMap::new()),
        }
    }

    pub(super) fn stop(&self) {
        self.batches.stop()
    }

    /// Sends what is queued and waits for its answer (and for any batch
    /// already on its way).
    pub(super) fn flush(&self, shared: &Shared) -> bool {
        self.batches.flush(|batch| {
            send(shared, batch);
        })
    }
}

/// The sender thread: batches until the client stops; after a batch that
/// could not be sent, a nap before it tries again.
pub(super) fn run(shared: Arc<Shared>) {
    shared.late_changes.batches.serve(|batch| (!send(&shared, batch)).then_some(RETRY_NAP))
}

/// Sends `batch` as one `LateChanges` and reports each change it refused.
/// A batch the meta-server did not answer (unreachable, or this client
/// fenced until it registers again) goes back in front of the queue, to be
/// sent again (see the module header). Returns whether it was answered.
fn send(shared: &Shared, batch: Vec<LateChange>) -> bool {
    let request = MetaRequest::LateChanges { client: shared.client_id(), changes: batch.clone() };
    let outcomes = match shared.call_as_client(&request) {
        Ok(MetaResponse::LateApplied(outcomes)) if outcomes.len() == batch.len() => outcomes,
        Ok(other) => vec![Err(unexpected(other)); batch.len()],
        Err(e) => {
            log::warn!("{} changes answered before they were sent wait to be sent again: {e}", batch.len());
            shared.late_changes.batches.requeue(batch);
            return false;
        }
    };
    let hook = shared.late_changes.hook.read();
    for (change, outcome) in batch.into_iter().zip(outcomes) {
        let dir = change.parent();
        let name = || String::from_utf8_lossy(change.name());
        match (&change, outcome) {
            (LateChange::Create(c), Ok(LateDone::Created(layout))) => created(shared, c.ino, layout),
            (_, Ok(_)) => {}
            // What this mount removed is not there any more (another mount
            // removed it while this one was stopped past its delegation):
            // nothing is left to do, and nothing of another's is touched.
            (LateChange::Unlink(_), Err(FsError::NotFound)) => {
                log::info!("{:?} in directory {} was gone when its late unlink came", name(), dir.0)
            }
            (change, Err(e)) => {
                shared.late_changes.failures.fetch_add(1, Ordering::Relaxed);
                let what = if matches!(change, LateChange::Create(_)) { "a create" } else { "an unlink" };
                log::error!(
                    "{what} answered before it was sent failed: {:?} in directory {}: {e}",
                    name(),
                    dir.0
                );
                if let Some(hook) = hook.as_ref() {
                    hook(dir);
                }
            }
        }
    }
    true
}

/// A file this client created late was created and opened for it: the
/// answer's layout, with the lock memory it lends, waits for the client's
/// next use of the file ([`FsClient::settle_late`]) — if it is still open
/// here (a release since gave them back: the meta-server hears of it
/// after this answer). The file's entry is not locked here: a call made
/// while holding it (an open's, a release's) sends the queue first.
fn created(shared: &Shared, ino: Ino, layout: FileLayout) {
    let mut layouts = shared.late_changes.layouts.lock();
    // Checked under the layouts' lock, which the last close takes after
    // the entry went (`FsClient::end_opens`): a layout is kept only for a
    // file whose last close will drop it.
    if shared.opens.get(ino).is_some() {
        layouts.insert(ino, layout);
    }
}

impl FsClient {
    /// An inode and its listing cookie for a create answered before it is
    /// sent, from this client's loan (asked for when it is used up);
    /// `None` if the meta-server lends none (its attribute slots are
    /// nearly all used: the create goes at once and is answered ENOSPC if
    /// it must).
    pub fn lent_inode(&self) -> Option<(Ino, u64)> {
        let registration = self.registration();
        let mut loan = self.shared.late_changes.loan.lock();
        if loan.registration != registration {
            // Lent to an older registration of this client: gone with it.
            *loan = Loan { free: Vec::new(), registration };
        }
        if loan.free.is_empty() {
            let request = MetaRequest::LendInodes { client: self.client_id(), count: LOAN };
            match self.call(&request) {
                Ok(MetaResponse::Lent(lent)) => loan.free = lent_in_order(lent),
                Ok(other) => log::warn!("a loan of inodes answered {other:?}"),
                Err(e) => log::warn!("a loan of inodes failed: {e}"),
            }
        }
        loan.free.pop()
    }

    /// Gives back an inode of [`Self::lent_inode`] the mount did not use.
    pub fn unused_inode(&self, lent: (Ino, u64)) {
        let mut loan = self.shared.late_changes.loan.lock();
        if loan.registration == self.registration() {
            loan.free.push(lent);
        }
    }

    /// Opens `ino`, lent for a create about to be answered before it is
    /// sent ([`Self::create_later`]): counted here from now on, its open
    /// counted at the meta-server by the create's answer. Taken before the
    /// mount queues the create (under its delegations' lock, which must not
    /// be held while the open files are: a release's answer is handed to
    /// the delegations under the open files' lock).
    pub fn open_late(&self, ino: Ino) {
        let registration = self.registration();
        self.shared.opens.with_entry(ino, |e| {
            e.reset(false);
            e.registration = registration;
            e.count = 1;
            e.late = true;
            e.write = true;
        });
    }

    /// Undoes [`Self::open_late`]: the create was not answered after all.
    pub fn unopen_late(&self, ino: Ino) {
        self.shared.opens.with_entry(ino, |e| e.reset(false));
    }

    /// Queues `create`, already answered (see the module header), of a
    /// file opened with [`Self::open_late`]. The caller has checked that
    /// it qualifies.
    pub fn create_later(&self, create: LateCreate) {
        self.shared.late_changes.batches.push(LateChange::Create(create));
    }

    /// Queues `unlink`, already answered (see the module header); the
    /// caller has checked that it qualifies.
    pub fn unlink_later(&self, unlink: LateUnlink) {
        self.shared.late_changes.batches.push(LateChange::Unlink(unlink));
    }

    /// Sends the queued changes and waits until the meta-server has
    /// applied them (and any batch already on its way); whether there
    /// were any.
    pub fn flush_late_changes(&self) -> bool {
        self.shared.late_changes.flush(&self.shared)
    }

    /// The layout a late create's answer brought for `ino`, if it is
    /// waiting to be installed (taken).
    pub(super) fn created_layout(&self, ino: Ino) -> Option<FileLayout> {
        self.shared.late_changes.layouts.lock().remove(&ino)
    }

    /// Before a use of `ino`, created here late, that needs its lock
    /// memory or layout: the queue is sent and the create's answer gives
    /// its open here the lock memory it lent (none if the create was
    /// refused). A write's use names the extents it needs (`first_write`,
    /// empty otherwise): if the create is still queued, they are allocated
    /// with it and the write needs no call of its own. Called holding no
    /// file's entry.
    pub(super) fn settle_late(&self, ino: Ino, first_write: Vec<(ChunkIndex, u64)>) {
        if !first_write.is_empty() {
            self.shared.late_changes.batches.amend_waiting(|change| match change {
                LateChange::Create(c) if c.ino == ino && c.first_write.is_empty() => {
                    c.first_write = first_write.clone()
                }
                _ => {}
            });
        }
        self.flush_late_changes();
        let layout = self.shared.late_changes.layouts.lock().get(&ino).cloned();
        let Some(entry) = self.shared.opens.get(ino) else { return };
        let mut e = entry.lock();
        if e.late && !e.closed {
            e.late = false;
            e.area = layout.and_then(|l| l.locks).map(|a| self.shared.reachable_area(a));
        }
    }

    /// Changes answered before they were sent that the meta-server then
    /// refused, so far.
    pub fn late_change_failures(&self) -> u64 {
        self.shared.late_changes.failures.load(Ordering::Relaxed)
    }

    /// Whether this client has `ino` open (a file open here is unlinked
    /// the usual way: its opens are counted at the meta-server).
    pub fn is_open_here(&self, ino: Ino) -> bool {
        self.shared.opens.get(ino).is_some()
    }

    /// Changes queued and not yet sent (tests, diagnostics).
    pub fn queued_changes(&self) -> usize {
        self.shared.late_changes.batches.len()
    }

    /// Where the directory of each late change the meta-server refused
    /// goes.
    pub fn on_late_change_failed(&self, hook: FailedHook) {
        *self.shared.late_changes.hook.write() = Some(hook);
    }

    /// Whether `caller`'s ids reach the meta-server as they are: the key
    /// this client registered with squashes none of them. A late change is
    /// checked here with the ids the meta-server will check.
    pub fn squashes(&self, uid: u32, gid: u32) -> bool {
        self.shared.key_options.is_some_and(|o| o.squash_ids(uid, gid) != (uid, gid))
    }
}

/// A loan's inodes, the first to be used last in the vector (popped).
fn lent_in_order(lent: LentInodes) -> Vec<(Ino, u64)> {
    (0..lent.count).rev().filter_map(|i| lent.nth(i)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_loan_is_used_from_its_first_inode_on() {
        let lent = LentInodes { first_ino: Ino(100), first_cookie: 7, count: 3 };
        let mut free = lent_in_order(lent);
        assert_eq!(free.pop(), Some((Ino(100), 7)));
        assert_eq!(free.pop(), Some((Ino(101), 8)));
        assert_eq!(free.pop(), Some((Ino(102), 9)));
        assert_eq!(free.pop(), None);
        assert_eq!(lent.nth(3), None);
    }
}
