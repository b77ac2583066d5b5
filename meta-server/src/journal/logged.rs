//! The namespace behind its lock, journaled: every hold of the lock ends
//! by appending what it changed ([`crate::namespace::Namespace::take_changes`]),
//! and notes on the holding thread the newest batch it could have seen,
//! which the request's answer then waits for ([`Logged::commit_seen`]).
//! A hold made for a change a client asks at most once
//! ([`Logged::for_change`]) names that change in its batch
//! ([`super::kept_answers`]).

use std::cell::Cell;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use parking_lot::{Mutex, MutexGuard};

use citronfs_core::types::{ChangeSeq, ClientId};

use super::image::Change;
use super::{Journal, JournalError};
use crate::namespace::Namespace;

thread_local! {
    /// The newest batch this thread's namespace holds appended or could
    /// have read, since its last [`Logged::commit_seen`], and of which
    /// journal (its address: a process that runs several meta-servers, as
    /// tests do, must not wait in one for a number of another).
    static SEEN: Cell<(usize, u64)> = const { Cell::new((0, 0)) };
    /// The change this thread's request makes, if the client asks it at
    /// most once, and whether a hold made for it changed anything yet.
    static CHANGE: Cell<Option<(ClientId, ChangeSeq, bool)>> = const { Cell::new(None) };
}

fn journal_key(journal: &Journal) -> usize {
    std::ptr::from_ref(journal) as usize
}

pub struct Logged {
    ns: Mutex<Namespace>,
    journal: Arc<Journal>,
}

pub struct LoggedGuard<'a> {
    guard: MutexGuard<'a, Namespace>,
    journal: &'a Journal,
}

impl Logged {
    pub fn new(ns: Namespace, journal: Arc<Journal>) -> Self {
        Self { ns: Mutex::new(ns), journal }
    }

    pub fn lock(&self) -> LoggedGuard<'_> {
        LoggedGuard { guard: self.ns.lock(), journal: &self.journal }
    }

    pub fn journal(&self) -> &Arc<Journal> {
        &self.journal
    }

    /// Runs `make` (a request's handling) with every namespace hold it makes
    /// naming change `seq` of `client` in its batch; returns what `make`
    /// returned and whether any hold changed something.
    pub fn for_change<R>(&self, client: ClientId, seq: ChangeSeq, make: impl FnOnce() -> R) -> (R, bool) {
        struct Reset;
        impl Drop for Reset {
            fn drop(&mut self) {
                CHANGE.with(|c| c.set(None));
            }
        }
        CHANGE.with(|c| c.set(Some((client, seq, false))));
        let _reset = Reset;
        let made = make();
        let applied = CHANGE.with(|c| c.get()).is_some_and(|(_, _, applied)| applied);
        (made, applied)
    }

    /// Waits until every batch this thread appended or could have seen is
    /// durable: called before a request's answer leaves, so no answer
    /// reveals a change that a crash could still take back.
    pub fn commit_seen(&self) -> Result<(), JournalError> {
        let (of, seen) = SEEN.with(|s| s.replace((0, 0)));
        if seen == 0 || of != journal_key(&self.journal) {
            return Ok(());
        }
        self.journal.commit(seen)
    }
}

impl Deref for LoggedGuard<'_> {
    type Target = Namespace;
    fn deref(&self) -> &Namespace {
        &self.guard
    }
}

impl DerefMut for LoggedGuard<'_> {
    fn deref_mut(&mut self) -> &mut Namespace {
        &mut self.guard
    }
}

impl Drop for LoggedGuard<'_> {
    fn drop(&mut self) {
        // Appended before the lock is let go, so batches are in the order
        // in which the holds changed the namespace.
        let seq = match self.guard.take_changes() {
            Some(mut batch) => {
                if let Some((client, change, _)) = CHANGE.with(|c| c.get()) {
                    if self.guard.kept_answers_mut().applied(client, change) {
                        batch.changes.push(Change::Applied { client, seq: change });
                    }
                    CHANGE.with(|c| c.set(Some((client, change, true))));
                }
                self.journal.append(&batch)
            }
            // A batch another hold appended is visible here: it was
            // appended before that hold let the lock go, and the lock's
            // release and our acquire order it before this load.
            None => self.journal.appended(),
        };
        let key = journal_key(self.journal);
        SEEN.with(|s| {
            let (of, seen) = s.get();
            s.set((key, if of == key { seen.max(seq) } else { seq }));
        });
    }
}
