//! Unlinks answered before they are sent (issue 13: the delete phases of
//! mdtest and IO500; CephFS's asynchronous unlink under its directory
//! capabilities is the same idea).
//!
//! A caching mount that holds the delegation of a directory knows every
//! name in it, and no other client has looked into it since it was made:
//! the meta-server recalls the delegation before it serves any other
//! client's request that names the directory, a name in it or a child held
//! with it (meta-server `grants`, "Late unlinks"). So the mount may answer
//! the unlink of a file it made there at once and tell the meta-server a
//! moment later ([`FsClient::unlink_later`]); the mount decides which
//! unlinks qualify (`mount::late_unlinks`). Nobody can tell the difference:
//!
//! * **this client's later calls**: every call sends the queued unlinks
//!   first and waits for their answer ([`FsClient::flush_late_unlinks`],
//!   from `FsClient::before_call`), so the meta-server sees this client's
//!   operations in the order its kernel was answered — a create of the
//!   name again, an rmdir of the directory, a statfs;
//! * **other clients**: their request waits for the recall, and the mount
//!   acknowledges a recall in its next poll, which is a call like any
//!   other: the queued unlinks are applied before it is sent;
//! * **times**: each unlink carries the time the mount answered it, which
//!   its kernel shows as the directory's mtime and ctime, and the
//!   meta-server sets those (and the file's ctime) to it;
//! * **a batch not answered** (the meta-server unreachable, this client
//!   fenced until it registers again): put back in front of the queue and
//!   sent again, by the sender after a nap or by the client's next call;
//!   each unlink names the inode it was answered for, so one sent twice or
//!   late removes nothing else (the meta-server answers `NotFound`, which
//!   is no failure: what it removed is gone). Until then the client's
//!   calls fail as well (fenced, or the meta-server away), and each tries
//!   the queue first, so none overtakes them but one sent in the moment
//!   the meta-server comes back, between the queue's try and its own;
//! * **an unlink refused anyway** (the mount checks what the meta-server
//!   checks): logged, counted ([`FsClient::late_unlink_failures`]) and
//!   handed to the mount's hook ([`FsClient::on_late_unlink_failed`]),
//!   which drops what it knew of the directory so that the name shows
//!   again.
//!
//! What is not covered: a mount stopped (frozen, partitioned) between its
//! answer and the batch, for longer than its delegation lasts. The other
//! mounts stop waiting for its acknowledgement when the delegation expires
//! and see the names until it comes back and sends them. Each unlink names
//! the inode it was answered for ([`LateUnlink::ino`]), so one that comes
//! after another mount removed the file and made the name again removes
//! nothing (the meta-server answers `NotFound`, which is no failure: what
//! it removed is gone). A batch goes
//! [`LINGER`] after its first unlink at the latest, against a delegation of
//! the TTL (a second by default), so that takes a stop within those
//! milliseconds.
//!
//! # When a batch goes
//!
//! At [`BATCH`] unlinks, at the client's next call of any kind, or after
//! the linger (`ClientConfig::unlink_linger`, by default [`LINGER`]) from
//! the first: a loop of unlinks sends one `UnlinkMany` per batch, which is
//! what spares the meta-server a wake-up and the mount a round trip per
//! file.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::batches::Batches;
use super::{unexpected, FsClient, Shared};
use crate::error::FsError;
use crate::proto::{LateUnlink, MetaRequest, MetaResponse};
use crate::types::Ino;

/// How long a queued unlink waits for others when nothing else sends it:
/// a few ms, well within a delegation's TTL (see the module header).
pub const LINGER: Duration = Duration::from_millis(2);
/// Unlinks that go at once, without waiting out the linger.
pub const BATCH: usize = 256;
/// How long the sender waits before it tries a batch again that was not
/// answered (the meta-server away, or this client fenced).
const RETRY_NAP: Duration = Duration::from_millis(100);

/// Where the directory of an unlink the meta-server refused goes (the
/// mount's delegations).
pub type FailedHook = Box<dyn Fn(Ino) + Send + Sync>;

/// The unlinks of a client waiting to be sent, and what became of them.
pub(super) struct LateUnlinks {
    batches: Batches<LateUnlink>,
    failures: AtomicU64,
    hook: parking_lot::RwLock<Option<FailedHook>>,
}

impl LateUnlinks {
    pub(super) fn new(linger: Duration) -> Self {
        Self {
            batches: Batches::new(linger, BATCH),
            failures: AtomicU64::new(0),
            hook: parking_lot::RwLock::new(None),
        }
    }

    pub(super) fn stop(&self) {
        self.batches.stop()
    }
}

/// The sender thread: batches until the client stops; after a batch that
/// could not be sent, a nap before it tries again.
pub(super) fn run(shared: Arc<Shared>) {
    shared.late_unlinks.batches.serve(|batch| (!send(&shared, batch)).then_some(RETRY_NAP))
}

/// Sends `batch` as one `UnlinkMany` and reports each unlink it refused.
/// A batch the meta-server did not answer (unreachable, or this client
/// fenced until it registers again) goes back in front of the queue, to be
/// sent again: each unlink names its inode, so sending one twice, or late,
/// removes nothing else. Returns whether it was answered.
fn send(shared: &Shared, batch: Vec<LateUnlink>) -> bool {
    let outcomes = match shared.call_as_client(&MetaRequest::UnlinkMany { unlinks: batch.clone() }) {
        Ok(MetaResponse::UnlinkedMany(outcomes)) if outcomes.len() == batch.len() => outcomes,
        Ok(other) => vec![Err(unexpected(other)); batch.len()],
        Err(e) => {
            log::warn!("{} unlinks answered before they were sent wait to be sent again: {e}", batch.len());
            shared.late_unlinks.batches.requeue(batch);
            return false;
        }
    };
    let hook = shared.late_unlinks.hook.read();
    for (LateUnlink { parent: dir, name, .. }, outcome) in batch.into_iter().zip(outcomes) {
        if let Err(FsError::NotFound) = outcome {
            // What this mount removed is not there any more (another
            // mount removed it while this one was stopped past its
            // delegation): nothing is left to do, and nothing of another's
            // is touched.
            let name = String::from_utf8_lossy(&name);
            log::info!("{name:?} in directory {} was gone when its late unlink came", dir.0);
        } else if let Err(e) = outcome {
            shared.late_unlinks.failures.fetch_add(1, Ordering::Relaxed);
            log::error!(
                "an unlink answered before it was sent failed: {:?} in directory {}: {e}",
                String::from_utf8_lossy(&name),
                dir.0
            );
            if let Some(hook) = hook.as_ref() {
                hook(dir);
            }
        }
    }
    true
}

impl FsClient {
    /// Queues `unlink`, already answered (see the module header); the
    /// caller has checked that it qualifies.
    pub fn unlink_later(&self, unlink: LateUnlink) {
        self.shared.late_unlinks.batches.push(unlink);
    }

    /// Sends the queued unlinks and waits until the meta-server has
    /// applied them (and any batch already on its way); whether there
    /// were any.
    pub fn flush_late_unlinks(&self) -> bool {
        self.shared.late_unlinks.batches.flush(|batch| {
            send(&self.shared, batch);
        })
    }

    /// Unlinks answered before they were sent that the meta-server then
    /// refused, so far.
    pub fn late_unlink_failures(&self) -> u64 {
        self.shared.late_unlinks.failures.load(Ordering::Relaxed)
    }

    /// Whether this client has `ino` open (a file open here is unlinked
    /// the usual way: its opens are counted at the meta-server).
    pub fn is_open_here(&self, ino: Ino) -> bool {
        self.shared.opens.get(ino).is_some()
    }

    /// Unlinks queued and not yet sent (tests, diagnostics).
    pub fn queued_unlinks(&self) -> usize {
        self.shared.late_unlinks.batches.len()
    }

    /// Where the directory of each late unlink the meta-server refused
    /// goes.
    pub fn on_late_unlink_failed(&self, hook: FailedHook) {
        *self.shared.late_unlinks.hook.write() = Some(hook);
    }

    /// Whether `caller`'s ids reach the meta-server as they are: the key
    /// this client registered with squashes none of them. A late unlink is
    /// checked here with the ids the meta-server will check.
    pub fn squashes(&self, uid: u32, gid: u32) -> bool {
        self.shared.key_options.is_some_and(|o| o.squash_ids(uid, gid) != (uid, gid))
    }
}
