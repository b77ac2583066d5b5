//! One client's handle to one ShiftLock: Algorithms 2 and 3 with the
//! failure detection of §3.6 that the paper's listings omit.
//!
//! # Files
//!
//! * this file: the handle, where its lock lives, its states and counters;
//! * `config`: [`ShiftLockConfig`], the timing and tunables;
//! * `acquire`: Algorithm 2, from the first verb to holding the lock;
//! * `stall`: §3.6 at the waiter: a `RelCnt` that stands still, the
//!   recovery request, and the restart after a recovery;
//! * `release`: Algorithm 3, with the guards of a release after the lease.

mod acquire;
mod config;
mod release;
mod stall;

use std::sync::Arc;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use super::entry::{Entry, Epoch, RelCnt, TailPtr, ENTRY_ALIGN};
use super::message::{PeerMessage, Postbox, Wire};
use super::recovery::RecoveryLocator;
use crate::rdma::{ClientAddr, Endpoint, RemoteAddr, Verb};
use crate::rwlock::{LockError, Mode, Riders, RwLockClient};

pub use config::{ShiftLockConfig, DEFAULT_WRITER_THRESHOLD};

/// Where a ShiftLock lives: its 16-byte entry (zeroed memory is an idle
/// lock) and the recovery service of the lock host that holds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ShiftLockRef {
    pub entry: RemoteAddr,
    pub recovery: RecoveryLocator,
}

/// Counters of one handle.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ShiftLockStats {
    pub shared: u64,
    pub exclusive: u64,
    /// Acquisitions that had to wait after their first verb.
    pub waited: u64,
    pub handovers_sent: u64,
    pub handovers_received: u64,
    pub mode_changes_sent: u64,
    pub mode_changes_received: u64,
    /// Largest consecutive-writer count this handle held the lock with.
    pub max_cons_wrt: u32,
    /// Reads of the entry by readers waiting for the epoch to change (Alg. 2 line 5).
    pub reader_polls: u64,
    /// Reads of the entry by writers waiting for `RelCnt` (lines 18, 24) or
    /// checking for a stall while they wait for a message.
    pub writer_polls: u64,
    /// Acquisitions started over after a recovery leap of `RelCnt`.
    pub restarts: u64,
    pub recovery_requests: u64,
    /// Requests the service answered by recovering.
    pub recoveries: u64,
    /// Requests the service rejected as stale.
    pub stale_recoveries: u64,
    /// Releases that gave up waiting for a successor's message (§3.6).
    pub dropped: u64,
    /// Messages discarded as from before a recovery.
    pub stale_messages: u64,
    /// Releases that found the lock recovered from under them.
    pub fenced: u64,
}

/// Where the handle stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Idle,
    /// Alg. 2 line 5: counted in `RdrCnt`, waiting for `Epoch` to change.
    /// `since` is the `RelCnt` the FAA returned.
    /// `posted` is when that FAA was posted.
    ReaderWaiting {
        epoch: Epoch,
        since: RelCnt,
        posted: Instant,
    },
    /// Alg. 2 line 16: enqueued behind a writer, waiting for its message.
    WriterQueued {
        me: TailPtr,
        enqueued_at: RelCnt,
    },
    /// Alg. 2 lines 18 and 24: waiting for `RelCnt` to reach `target`.
    WriterDraining {
        me: TailPtr,
        enqueued_at: RelCnt,
        target: RelCnt,
        epoch: Epoch,
    },
    /// `lease_start` is no later than the moment the lock became ours.
    ReaderHolding {
        since: RelCnt,
        lease_start: Instant,
    },
    /// Alg. 2 line 26's (curRelCnt, consWrt, epoch), and our enqueue's `RelCnt`.
    WriterHolding {
        me: TailPtr,
        enqueued_at: RelCnt,
        cur: RelCnt,
        cons_wrt: u32,
        epoch: Epoch,
    },
}

/// One client's handle to one ShiftLock. Shared = reader, Exclusive = writer.
pub struct ShiftLockClient {
    lock: ShiftLockRef,
    config: ShiftLockConfig,
    postbox: Arc<Postbox>,
    state: State,
    stats: ShiftLockStats,
    /// An acquisition gave up: the entry may still count it.
    poisoned: bool,
}

impl std::fmt::Debug for ShiftLockClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShiftLockClient").field("lock", &self.lock.entry).field("state", &self.state).finish()
    }
}

impl ShiftLockClient {
    /// A handle on `lock`. `postbox` must be shared by every ShiftLock handle
    /// used with the same endpoint (see [`Postbox`]).
    pub fn new(
        lock: ShiftLockRef,
        config: ShiftLockConfig,
        postbox: Arc<Postbox>,
    ) -> Result<Self, LockError> {
        if !lock.entry.is_aligned(ENTRY_ALIGN) {
            return Err(LockError::Misuse("a ShiftLock entry must be 16-aligned"));
        }
        Ok(Self {
            lock,
            config,
            postbox,
            state: State::Idle,
            stats: ShiftLockStats::default(),
            poisoned: false,
        })
    }

    pub fn stats(&self) -> ShiftLockStats {
        self.stats
    }

    pub fn config(&self) -> &ShiftLockConfig {
        &self.config
    }

    pub fn lock_ref(&self) -> ShiftLockRef {
        self.lock
    }

    /// Whether the lock is held through this handle.
    pub fn is_held(&self) -> bool {
        matches!(self.state, State::ReaderHolding { .. } | State::WriterHolding { .. })
    }

    fn read_entry(&self, ep: &Endpoint) -> Result<Entry, LockError> {
        Ok(Entry(ep.read_u128(self.lock.entry)?))
    }

    fn send(&mut self, ep: &Endpoint, to: ClientAddr, message: PeerMessage) {
        let wire = Wire::Peer { lock: self.lock.entry, message };
        if let Err(e) = ep.send(to, &wire.encode()) {
            log::warn!("ShiftLock {}: cannot send {message:?} to {to}: {e}", self.lock.entry);
        }
    }
}

impl RwLockClient for ShiftLockClient {
    #[inline]
    fn acquire(&mut self, ep: &Endpoint, mode: Mode) -> Result<(), LockError> {
        if self.begin(ep, mode)? {
            return Ok(());
        }
        self.complete(ep)
    }

    fn release(&mut self, ep: &Endpoint) -> Result<(), LockError> {
        self.release_after(ep, &[])
    }

    /// The riders go right after the reader's FAA or the writer's enqueue
    /// (Alg. 2 lines 2 and 7), in one batch.
    fn acquire_with_reads(
        &mut self,
        ep: &Endpoint,
        mode: Mode,
        riders: &[Verb],
    ) -> Result<Riders, LockError> {
        let (held, replies) = self.begin_with_reads(ep, mode, riders)?;
        if held {
            return Ok(replies);
        }
        self.complete(ep)?;
        Ok(None)
    }

    /// A reader within its lease releases with one FAA (Alg. 3 line 2)
    /// whose old entry serves only a diagnostic (a recovery within a
    /// reader's lease cannot happen): the caller may post it.
    fn release_verbs(&mut self) -> Option<Vec<Verb>> {
        let State::ReaderHolding { lease_start, .. } = self.state else { return None };
        if lease_start.elapsed() >= self.config.lease {
            return None;
        }
        self.state = State::Idle;
        Some(vec![self.reader_leave_verb()])
    }

    /// A reader within its lease posts `verbs` and its FAA (Alg. 3 line 2)
    /// in one batch; a writer, whose release may hand over or wait for a
    /// successor, posts them first on their own.
    fn release_after(&mut self, ep: &Endpoint, verbs: &[Verb]) -> Result<(), LockError> {
        match std::mem::replace(&mut self.state, State::Idle) {
            State::ReaderHolding { since, lease_start } => self.release_reader(ep, since, lease_start, verbs),
            State::WriterHolding { me, enqueued_at, cur, cons_wrt, epoch } => {
                if TailPtr::from_client(ep.addr()) != Ok(me) {
                    self.state = State::WriterHolding { me, enqueued_at, cur, cons_wrt, epoch };
                    return Err(LockError::Misuse("release through another endpoint than the acquisition"));
                }
                let posted = crate::rwlock::execute_all(ep, verbs);
                let released = self.release_writer(ep, me, enqueued_at, cur, cons_wrt, epoch);
                posted.and(released)
            }
            other => {
                self.state = other;
                Err(LockError::Misuse("release without a held lock"))
            }
        }
    }
}
