//! Releases sent after the close, in batches (metadata cost: no RPC at
//! flush or release where nothing changed).
//!
//! A mount's last close of a file does everything the file's release needs
//! here at once: it stops the use of the file's lock memory and forgets its
//! addresses and layout ([`opens`](super::opens)). What is left is telling
//! the meta-server, and nobody waits for that: the kernel sends `RELEASE`
//! after close(2) has returned. So the mount queues it here
//! ([`FsClient::release_later`]), and one thread sends what has queued up
//! as one `ReleaseMany` (see "When a batch goes"). A create loop then pays
//! one round trip per file (its `CreateOpen`) instead of two, and the
//! meta-server one message per batch.
//!
//! # When a batch goes
//!
//! * at once when [`BATCH`] files are waiting;
//! * at once when the client makes any call of a file-system operation
//!   but a create's, an open's or a write's allocation
//!   ([`Releases::send_now`]): a loop of creates or opens, with their
//!   writes and closes, is what batching is for, and any other call means
//!   it ended or is mixed with other work;
//! * else after the linger (`ClientConfig::release_linger`, by default
//!   [`LINGER`]), for a client that went quiet.
//!
//! So while a client works, its batches go by count or at its next call
//! of another kind, not by a clock. An earlier form sent every batch 1 ms
//! after its first release. On this project's 2-vCPU test machine (a
//! virtual machine), four processes' stats right after their creates
//! (`bench meta`, one directory on two mounts) then ran at 22–60k/s
//! against 79–94k/s without batching, in 8 of 8 interleaved runs; this
//! form measured 57–87k/s against 67–86k/s. Sending each release at once
//! kept the stats but batched nothing for a single process.
//!
//! # What a late release can change, and what keeps it right
//!
//! Until its release arrives, the meta-server counts the file open here:
//! * **a reopen here** reaches the meta-server before the queued release.
//!   Opens are counted, not flagged, and a release hands back the number of
//!   opens it ends, so the count stays right in either order; the file's
//!   lock memory is reused only when no client has it open, so it is not
//!   reused under the reopen either;
//! * **an unlink or rename** (here or on another mount) of a file counted
//!   open leaves its data until the release, as for any open file. An
//!   unlink or rename *here* sends what is queued beside it and returns
//!   once both are answered ([`FsClient::flush_releases`]), so a program
//!   that closes and deletes a file gets its space back when the unlink
//!   answers, as before, without a round trip more; `statfs` sends the
//!   queue first, and a create, open or write refused for want of space or
//!   lock memory sends it and asks again (files closed here and unlinked
//!   elsewhere hold their space until their releases arrive);
//! * **caching**: while a written file is counted open, other mounts read
//!   its attributes from the meta-server rather than cache them, which is
//!   coherent, only not cached for that while (at most the linger);
//! * **a lost lease**: the meta-server forgot the opens of the old
//!   registration; releases queued under it are dropped.
//!
//! A file past its first chunk is released at once, as before: chunks
//! taken ahead of its writer go back at its release, and a stat, du or df
//! right after its close should not count them (a create loop's files are
//! small, and they are what batching is for).
//!
//! A release the meta-server answers with a file's attributes held again
//! (`HeldAgain`, a file made in a directory delegated to this mount) is
//! handed to the mount's hook ([`FsClient::on_held_again`]) only if the
//! file has not been opened here again since: checked and handed under
//! the open-files map's lock, which every open takes first, so an open
//! either sees the attributes held (and drops them as any open for writing
//! does) or is seen. The hook is told when the release was sent: an own
//! change of the file that answered after that (a link, a chmod on
//! another thread) may have been made after the meta-server read the
//! attributes, and the mount keeps them only if none did.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::batches::Batches;
use super::{unexpected, FsClient, Shared};
use crate::error::FsError;
use crate::proto::{FileRelease, HeldAgain, MetaRequest, MetaResponse};
use crate::types::{Attr, Ino};

/// How long a queued release waits, by default, when nothing else sends
/// it (`ClientConfig::release_linger`; see "When a batch goes").
pub const LINGER: Duration = Duration::from_millis(50);
/// Releases that are sent at once, without waiting out the linger.
pub const BATCH: usize = 128;

/// Where a released file's attributes held again go (the mount's
/// delegations): the delegated directory, the attributes, and when the
/// release that brought them was sent.
pub type HeldHook = Box<dyn Fn(Ino, &Attr, Instant) + Send + Sync>;

/// One file's queued release.
#[derive(Clone, Copy, Debug)]
struct Queued {
    release: FileRelease,
    /// The registration its opens were counted under.
    registration: u64,
}

/// The queue of releases of a client ([`Batches`] decides when each batch
/// goes) and where what their answers hold again goes.
pub(super) struct Releases {
    batches: Batches<Queued>,
    hook: parking_lot::RwLock<Option<HeldHook>>,
}

impl Releases {
    pub(super) fn new(linger: Duration) -> Self {
        Self { batches: Batches::new(linger, BATCH), hook: parking_lot::RwLock::new(None) }
    }

    /// Has what is queued sent as soon as no batch is in flight.
    pub(super) fn send_now(&self) {
        self.batches.send_now()
    }

    pub(super) fn stop(&self) {
        self.batches.stop()
    }
}

/// The sender thread: batches until the client stops.
pub(super) fn run(shared: Arc<Shared>) {
    shared.releases.batches.serve(|batch| {
        send(&shared, batch);
        None
    })
}

/// Sends `batch` as one `ReleaseMany` (what the current registration
/// counted of it) and hands on what came back held.
fn send(shared: &Shared, batch: Vec<Queued>) {
    // A file created late is released after its create (`late_changes`).
    shared.late_changes.flush(shared);
    let current = shared.registration.load(std::sync::atomic::Ordering::Relaxed);
    let files: Vec<FileRelease> =
        batch.iter().filter(|q| q.registration == current).map(|q| q.release).collect();
    if files.is_empty() {
        return;
    }
    let count = files.len();
    let request = MetaRequest::ReleaseMany { client: shared.client_id(), files };
    let sent = Instant::now();
    let held = match shared.call_as_client(&request) {
        Ok(MetaResponse::HeldAgain(held)) => held,
        Ok(other) => {
            log::warn!("releases of {count} files: {}", unexpected(other));
            return;
        }
        Err(e) => {
            // As a release that failed at the close: the meta-server keeps
            // counting those opens until this client leaves or is fenced.
            log::warn!("releases of {count} files: {e}");
            return;
        }
    };
    hand_held_again(shared, held, sent);
}

/// Hands what releases' answers held again to the mount's hook, for each
/// file not opened here again since, with when the releases were `sent`
/// (see the module comment).
fn hand_held_again(shared: &Shared, held: impl IntoIterator<Item = HeldAgain>, sent: Instant) {
    let hook = shared.releases.hook.read();
    let Some(hook) = hook.as_ref() else { return };
    for HeldAgain { dir, attr } in held {
        shared.opens.unless_open(attr.ino, || hook(dir, &attr, sent));
    }
}

impl FsClient {
    /// [`FsClient::release`] whose message to the meta-server goes later,
    /// with others (see the module comment): for a mount's `RELEASE`, which
    /// nobody waits for. Everything here is done when it returns.
    pub fn release_later(&self, ino: Ino) -> Result<(), FsError> {
        if self.may_hold_chunks_ahead(ino) {
            // Chunks taken ahead of the file's writer go back at its
            // release: told at once, so that a stat, du or df right after
            // the close counts them gone. Only files past their first
            // chunk, which a create loop does not make.
            let sent = Instant::now();
            let held = self.release_held(ino)?;
            hand_held_again(&self.shared, held.map(|(dir, attr)| HeldAgain { dir, attr }), sent);
            return Ok(());
        }
        let registration = self.registration();
        let releases = &self.shared.releases;
        self.end_opens(ino, |opens| {
            releases.batches.push(Queued { release: FileRelease { ino, opens }, registration });
            Ok(())
        })
        .map(drop)
    }

    /// Whether `ino` may hold chunks taken ahead of a writer here: the
    /// meta-server takes them only for a write past a file's first chunk
    /// (`layouts::chunks_ahead`).
    fn may_hold_chunks_ahead(&self, ino: Ino) -> bool {
        self.layouts.read().get(&ino).is_some_and(|l| l.read().chunks.len() > 1)
    }

    /// Sends the releases queued so far and waits until the meta-server
    /// has them (and any batch already on its way); whether there were
    /// any.
    pub fn flush_releases(&self) -> bool {
        self.shared.releases.batches.flush(|batch| send(&self.shared, batch))
    }

    /// Where the attributes of files released later and held again go
    /// ([`MetaResponse::HeldAgain`]).
    pub fn on_held_again(&self, hook: HeldHook) {
        *self.shared.releases.hook.write() = Some(hook);
    }

    /// Releases queued and not yet sent (tests, diagnostics).
    pub fn queued_releases(&self) -> usize {
        self.shared.releases.batches.len()
    }
}
