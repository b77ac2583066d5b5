//! One client's handle to one DQL lock: acquisition (§4.2, §4.4), release
//! (§4.3, with the transient state of §4.3.1), and the failure handling the
//! paper leaves out (see the module comment of [`super`]).
//!
//! # Files
//!
//! * this file: the handle, its states and counters;
//! * `config`: [`DqlConfig`], the timing every wait of the protocol follows;
//! * `join`: joining the queue (§4.2, §4.4) and alerting the predecessor;
//! * `wait`: waiting for the grant (§4.3), with the beats, the silence that
//!   makes a waiter reset the lock, and restarts after resets;
//! * `release`: the release (§4.3) and its transient state (§4.3.1).

mod config;
mod join;
mod release;
mod wait;

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;
use std::time::Instant;

use super::message::Wire;
use super::word::{Era, Stamp, TailWord, COUNTER_OFFSET, DQL_ALIGN, TAIL_OFFSET};
use crate::postbox::Postbox;
use crate::rdma::{ClientAddr, Endpoint, RemoteAddr};
use crate::rwlock::{LockError, Mode, RwLockClient};

pub use config::DqlConfig;

/// The postbox every DQL handle used with one endpoint shares.
pub type DqlPostbox = Postbox<Wire>;

/// Counters of one handle.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DqlStats {
    pub acquisitions: u64,
    /// Acquisitions that found the lock free (the first CAS of §4.2 won).
    pub immediate: u64,
    /// Acquisitions that queued behind a predecessor.
    pub queued: u64,
    /// Tail CASes that failed (§4.2's retries; §4.4's contention).
    pub cas_failures: u64,
    /// Reads of the tail by a ticket waiting for its turn (§4.4).
    pub turn_polls: u64,
    /// Our ticket was passed over (a reset or a skip); we took another.
    pub passed: u64,
    /// Silent tickets we skipped over.
    pub skips: u64,
    pub alerts_sent: u64,
    pub grants_sent: u64,
    pub grants_received: u64,
    /// Releases whose CAS found a successor that had not alerted yet (§4.3.1).
    pub transient: u64,
    /// Of those, releases that gave up waiting for the alert.
    pub dropped: u64,
    pub alive_sent: u64,
    /// Reads of the tail while queued (every beat, and before suspecting).
    pub tail_polls: u64,
    /// Reads of the tail before entering on a grant older than X.
    pub freshness_reads: u64,
    /// Resets this handle made after its predecessor fell silent.
    pub resets: u64,
    /// Closed tails this handle reopened because their resetter vanished.
    pub takeovers: u64,
    /// Acquisitions started over because a reset wiped the queue.
    pub restarts: u64,
    /// Releases after the lease.
    pub late_releases: u64,
    /// Late releases during or after a reset: the critical section may
    /// have overlapped another's.
    pub fenced: u64,
    /// Messages discarded as for another acquisition.
    pub stale_messages: u64,
}

impl std::ops::AddAssign for DqlStats {
    fn add_assign(&mut self, o: Self) {
        self.acquisitions += o.acquisitions;
        self.immediate += o.immediate;
        self.queued += o.queued;
        self.cas_failures += o.cas_failures;
        self.turn_polls += o.turn_polls;
        self.passed += o.passed;
        self.skips += o.skips;
        self.alerts_sent += o.alerts_sent;
        self.grants_sent += o.grants_sent;
        self.grants_received += o.grants_received;
        self.transient += o.transient;
        self.dropped += o.dropped;
        self.alive_sent += o.alive_sent;
        self.tail_polls += o.tail_polls;
        self.freshness_reads += o.freshness_reads;
        self.resets += o.resets;
        self.takeovers += o.takeovers;
        self.restarts += o.restarts;
        self.late_releases += o.late_releases;
        self.fenced += o.fenced;
        self.stale_messages += o.stale_messages;
    }
}

/// A successor that alerted us (§4.2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Successor {
    token: TailWord,
    addr: ClientAddr,
}

/// What the tail CAS of an acquisition got us.
#[derive(Clone, Copy, Debug)]
enum Joined {
    /// The tail was free: the lock is ours since the CAS was posted.
    Holding { me: TailWord, posted: Instant, position: Option<u64> },
    /// We are behind `pred`. The CAS (posted at `posted`) showed the era open.
    Queued { me: TailWord, pred: TailWord, posted: Instant, position: Option<u64> },
}

#[derive(Clone, Copy, Debug)]
struct Queued {
    me: TailWord,
    pred: TailWord,
    /// The starvation-free ticket's FA result (tickets before ours).
    position: Option<u64>,
    /// When we last heard from the predecessor (or alerted it).
    last_sign: Instant,
    /// Post time of the last read of the tail that showed our era open.
    fresh: Instant,
    successor: Option<Successor>,
    next_beat: Instant,
    next_poll: Instant,
    give_up_at: Instant,
}

#[derive(Clone, Copy, Debug)]
struct Holding {
    me: TailWord,
    pred: Option<TailWord>,
    position: Option<u64>,
    lease_start: Instant,
    successor: Option<Successor>,
}

#[derive(Clone, Copy, Debug)]
enum State {
    Idle,
    Queued(Queued),
    Holding(Holding),
}

/// One client's handle to one DQL lock (a mutex: `Shared` is `Exclusive`).
pub struct DqlLock {
    addr: RemoteAddr,
    config: DqlConfig,
    postbox: Arc<DqlPostbox>,
    state: State,
    /// The era this handle saw last: the first CAS's guess of the tail.
    era_hint: Era,
    /// The distributed variant's stamp: a per-handle counter from a random
    /// start, so tokens differ between acquisitions and between handles.
    nonce: Stamp,
    stats: DqlStats,
}

impl std::fmt::Debug for DqlLock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DqlLock").field("addr", &self.addr).field("state", &self.state).finish()
    }
}

impl DqlLock {
    /// A handle on the lock at `addr` ([`super::DQL_BYTES`] of zeroed host
    /// memory, 8-aligned) with a postbox of its own: use it only if no
    /// other DQL handle shares its endpoint ([`DqlLock::with_postbox`]).
    pub fn new(addr: RemoteAddr, config: DqlConfig) -> Result<Self, LockError> {
        Self::with_postbox(addr, config, Arc::new(DqlPostbox::new()))
    }

    /// A handle that shares `postbox` with the other DQL handles used with
    /// the same endpoint.
    pub fn with_postbox(
        addr: RemoteAddr,
        config: DqlConfig,
        postbox: Arc<DqlPostbox>,
    ) -> Result<Self, LockError> {
        if !addr.is_aligned(DQL_ALIGN) {
            return Err(LockError::Misuse("a DQL lock must be 8-aligned"));
        }
        let mut h = RandomState::new().build_hasher();
        h.write_u64(addr.offset);
        Ok(Self {
            addr,
            config,
            postbox,
            state: State::Idle,
            era_hint: Era::default(),
            nonce: Stamp::new(h.finish() as u32),
            stats: DqlStats::default(),
        })
    }

    pub fn addr(&self) -> RemoteAddr {
        self.addr
    }

    pub fn config(&self) -> &DqlConfig {
        &self.config
    }

    pub fn stats(&self) -> DqlStats {
        self.stats
    }

    pub fn is_held(&self) -> bool {
        matches!(self.state, State::Holding(_))
    }

    /// Our token while we hold the lock.
    pub fn token(&self) -> Option<TailWord> {
        match self.state {
            State::Holding(h) => Some(h.me),
            _ => None,
        }
    }

    /// While we hold the lock: the token of the predecessor that handed it
    /// to us, `None` if we found the lock free.
    pub fn predecessor(&self) -> Option<TailWord> {
        match self.state {
            State::Holding(h) => h.pred,
            _ => None,
        }
    }

    /// While we hold a starvation-free lock: how many tickets were taken
    /// before ours (the FA's result), i.e. our place in the FIFO order.
    pub fn position(&self) -> Option<u64> {
        match self.state {
            State::Holding(h) => h.position,
            _ => None,
        }
    }

    fn tail(&self) -> RemoteAddr {
        self.addr + TAIL_OFFSET
    }

    fn counter(&self) -> RemoteAddr {
        self.addr + COUNTER_OFFSET
    }

    fn read_tail(&self, ep: &Endpoint) -> Result<TailWord, LockError> {
        Ok(TailWord(ep.read_u64(self.tail())?))
    }

    fn send(&self, ep: &Endpoint, to: ClientAddr, wire: Wire) {
        // A failed send means the peer is gone; the silence it leaves is
        // what the failure handling acts on.
        if let Err(e) = ep.send(to, &wire.encode()) {
            log::warn!("DQL {}: cannot send {wire:?} to {to}: {e}", self.addr);
        }
    }
}

impl RwLockClient for DqlLock {
    /// Both modes take the mutex.
    #[inline]
    fn acquire(&mut self, ep: &Endpoint, _mode: Mode) -> Result<(), LockError> {
        if self.begin(ep)? {
            return Ok(());
        }
        self.complete(ep)
    }

    #[inline]
    fn release(&mut self, ep: &Endpoint) -> Result<(), LockError> {
        self.unlock(ep)
    }

    fn shares_readers(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn misaligned_lock_is_refused() {
        let c = DqlConfig::from_rtt(Duration::from_micros(1));
        assert!(DqlLock::new(RemoteAddr::new(crate::rdma::RegionId(1), 12), c).is_err());
        assert!(DqlLock::new(RemoteAddr::new(crate::rdma::RegionId(1), 16), c).is_ok());
    }
}
