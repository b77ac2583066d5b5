//! One client's handle to one ShiftLock: Algorithms 2 and 3 with the
//! failure detection of §3.6 that the paper's listings omit.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::entry::{
    Entry, Epoch, ExtCas, RelCnt, TailPtr, BOUNDARIES, ENTRY_ALIGN, MAX_READERS, RDR_CNT_MASK, READER_ENTER,
    READER_LEAVE, REL_CNT_MASK,
};
use super::message::{Letter, PeerMessage, Postbox, RecoveryReply, RecoveryRequest, Verdict, Wire};
use super::recovery::RecoveryLocator;
use crate::rdma::{ClientAddr, Endpoint, RemoteAddr};
use crate::rwlock::{LockError, Mode, RwLockClient};

/// The paper's maximum number of consecutive writer handovers, N (§3.5.2, §4.7).
pub const DEFAULT_WRITER_THRESHOLD: u32 = 16;

/// Timing and tunables of the protocol.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ShiftLockConfig {
    /// T_lease (§3.6): the longest a client holds the lock, from acquisition
    /// to release. A waiter that sees `RelCnt` stand still for 3 × T_lease
    /// asks the lock host to recover the lock.
    pub lease: Duration,
    /// Bound of relative clock drift δ; every wait for T lasts (1 + δ) T.
    pub drift: f64,
    /// First interval between two polls of the entry (Alg. 2 lines 5, 18, 24).
    pub poll: Duration,
    /// Polls back off exponentially up to this interval.
    pub max_poll: Duration,
    /// N: a writer that has been handed the lock this many times in a row
    /// gives it to the readers instead (Alg. 3 line 15).
    pub writer_threshold: u32,
    /// Longest an acquisition may wait in all before it fails with
    /// [`LockError::Timeout`] instead of hanging (a broken host, say).
    pub give_up: Duration,
    /// How long after a holder's lease ran out the cluster may still need
    /// to fence a silent holder at the servers. A waiter asks for the §3.6
    /// recovery only after `RelCnt` stood still for 3 × T_lease plus this,
    /// so no lock is recovered before its holder is fenced. The holders'
    /// guards (a release within T_lease of the lease start is an ordinary
    /// one) are unchanged: every waiter's stall timer still starts no
    /// earlier than the holder's lease did, and now runs longer. Zero (the
    /// default) below a file system.
    pub fence_delay: Duration,
}

impl ShiftLockConfig {
    /// The paper's parameters scaled to this transport's round-trip time.
    ///
    /// The paper's 10 ms lease is 5000 RTTs of 2 µs; we keep the ratio but
    /// never go below 1 s, because a holder here is a thread of an ordinary
    /// process that the scheduler may stall for many milliseconds (the same
    /// floor as Citron's lease). Polls start at one RTT apart, a waiter's
    /// read costing about one RTT itself, and back off to 64 RTTs.
    pub fn from_rtt(rtt: Duration) -> Self {
        let lease = (rtt * 5000).max(Duration::from_secs(1));
        Self {
            lease,
            drift: 1e-4,
            poll: rtt,
            max_poll: rtt * 64,
            writer_threshold: DEFAULT_WRITER_THRESHOLD,
            give_up: crate::rwlock::give_up_after(lease, Duration::ZERO),
            fence_delay: Duration::ZERO,
        }
    }

    /// The same with lease `lease` (and a give-up time scaled with it).
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self.give_up = crate::rwlock::give_up_after(self.lease, self.fence_delay);
        self
    }

    /// The same with a fence delay ([`ShiftLockConfig::fence_delay`]); the
    /// give-up time grows by [`GIVE_UP_FENCES`](crate::rwlock::GIVE_UP_FENCES)
    /// of them, so it stays far beyond a recovery (3 × T_lease + fence delay).
    pub fn with_fence_delay(mut self, fence_delay: Duration) -> Self {
        self.fence_delay = fence_delay;
        self.give_up = crate::rwlock::give_up_after(self.lease, self.fence_delay);
        self
    }

    /// `d` stretched by the clock drift bound (§3.6, "assumptions for timing").
    fn stretched(&self, d: Duration) -> Duration {
        d.mul_f64(1.0 + self.drift)
    }

    /// How long `RelCnt` may stand still before a waiter suspects a failure:
    /// 3 × T_lease (§3.6), plus the fence delay.
    pub fn stall_timeout(&self) -> Duration {
        self.stretched(self.lease * 3 + self.fence_delay)
    }

    /// How often a waiter that is not polling anyway looks at `RelCnt`.
    fn check_period(&self) -> Duration {
        self.lease / 2
    }
}

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

/// Watches `RelCnt` for the stall that means a failed client (§3.6).
struct Stall {
    last: RelCnt,
    since: Instant,
    /// A rejected or unanswered request is repeated only after T_lease.
    not_before: Instant,
}

impl Stall {
    fn new(last: RelCnt) -> Self {
        let now = Instant::now();
        Self { last, since: now, not_before: now }
    }

    fn observe(&mut self, rel: RelCnt) {
        if rel != self.last {
            self.last = rel;
            self.since = Instant::now();
        }
    }

    fn due(&self, config: &ShiftLockConfig) -> bool {
        let now = Instant::now();
        now.duration_since(self.since) >= config.stall_timeout() && now >= self.not_before
    }
}

/// Pauses between polls that start at `poll` and double up to `max_poll`.
/// A pause shorter than [`SLEEP_AT_LEAST`] yields the CPU until it has
/// passed instead of sleeping: the kernel's timer slack (50 µs by default)
/// stretches any sleep to at least that, which on shm (an RTT of tens of
/// ns) made every waiting reader notice the epoch flip some 55 µs late.
/// Yielding keeps the CPU for the holder on a busy machine, and the polls
/// still back off, so the reads per acquisition (Fig. 6's figure of merit)
/// stay bounded by the doubling.
struct Backoff {
    next: Duration,
}

/// Pauses at least this long sleep; shorter ones yield.
const SLEEP_AT_LEAST: Duration = Duration::from_micros(50);

impl Backoff {
    fn new(config: &ShiftLockConfig) -> Self {
        Self { next: config.poll }
    }

    fn pause(&mut self, config: &ShiftLockConfig) {
        if self.next >= SLEEP_AT_LEAST {
            std::thread::sleep(self.next);
        } else {
            let until = Instant::now() + self.next;
            loop {
                std::thread::yield_now();
                if Instant::now() >= until {
                    break;
                }
            }
        }
        self.next = (self.next * 2).min(config.max_poll);
    }
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

    /// The first verb of an acquisition (Alg. 2 line 2 or lines 7–15):
    /// `true` if the lock is held already, `false` if [`Self::complete`] must
    /// wait for it. `acquire` is `begin` then, if needed, `complete`; the two
    /// halves let a caller observe the moment it joined the lock.
    pub fn begin(&mut self, ep: &Endpoint, mode: Mode) -> Result<bool, LockError> {
        if self.state != State::Idle {
            return Err(LockError::Misuse("acquire while this handle holds or waits for the lock"));
        }
        if self.poisoned {
            return Err(LockError::Misuse("this ShiftLock handle gave up an acquisition"));
        }
        if !self.postbox.bind(ep) {
            return Err(LockError::Misuse("a ShiftLock postbox serves one endpoint only"));
        }
        let held = match mode {
            Mode::Shared => self.reader_begin(ep)?,
            Mode::Exclusive => self.writer_begin(ep)?,
        };
        if held {
            self.count_held();
        } else {
            self.stats.waited += 1;
        }
        Ok(held)
    }

    /// Alg. 2 lines 2–4.
    fn reader_begin(&mut self, ep: &Endpoint) -> Result<bool, LockError> {
        let posted = Instant::now();
        let old = Entry(ep.ext_faa(self.lock.entry, READER_ENTER, BOUNDARIES)?);
        if old.rdr_cnt() == MAX_READERS {
            log::error!("ShiftLock {}: RdrCnt overflowed ({old:?})", self.lock.entry);
        }
        let since = old.rel_cnt();
        self.state = if old.tail().is_null() {
            State::ReaderHolding { since, lease_start: posted }
        } else {
            State::ReaderWaiting { epoch: old.epoch(), since, posted }
        };
        Ok(old.tail().is_null())
    }

    /// Alg. 2 lines 7–15 and 23–26.
    fn writer_begin(&mut self, ep: &Endpoint) -> Result<bool, LockError> {
        let me = TailPtr::from_client(ep.addr()).map_err(|e| {
            log::error!("ShiftLock {}: {e}", self.lock.entry);
            LockError::Misuse("this endpoint's address does not fit a ShiftLock TailPtr")
        })?;
        let cas = ExtCas::enqueue(me);
        let old = Entry(ep.ext_cas(self.lock.entry, cas.cmp, cas.cmp_mask, cas.swap, cas.swap_mask)?);
        let enqueued_at = old.rel_cnt();
        if let Some(pred) = old.tail().client() {
            // Line 15. A failed send means the predecessor is gone; the
            // stall it causes is resolved by recovery.
            if pred == ep.addr() {
                log::warn!("ShiftLock {}: enqueued behind our own endpoint", self.lock.entry);
            }
            self.send(ep, pred, PeerMessage::Successor { enqueued_at });
            self.state = State::WriterQueued { me, enqueued_at };
            Ok(false)
        } else if old.rdr_cnt() != 0 {
            // Line 24: wait for the readers ahead of us.
            let target = enqueued_at.plus(u64::from(old.rdr_cnt()));
            self.state = State::WriterDraining { me, enqueued_at, target, epoch: old.epoch() };
            Ok(false)
        } else {
            self.state =
                State::WriterHolding { me, enqueued_at, cur: enqueued_at, cons_wrt: 0, epoch: old.epoch() };
            Ok(true)
        }
    }

    fn count_held(&mut self) {
        match self.state {
            State::ReaderHolding { .. } => self.stats.shared += 1,
            State::WriterHolding { cons_wrt, .. } => {
                self.stats.exclusive += 1;
                self.stats.max_cons_wrt = self.stats.max_cons_wrt.max(cons_wrt);
            }
            _ => {}
        }
    }

    /// Waits until a [`Self::begin`] that returned `false` holds the lock:
    /// Alg. 2 lines 5, 16–22 and 24, with the §3.6 stall detection, recovery
    /// requests and restarts after a recovery.
    #[cold]
    pub fn complete(&mut self, ep: &Endpoint) -> Result<(), LockError> {
        let give_up_at = Instant::now() + self.config.give_up;
        let mut stall = match self.state {
            State::ReaderWaiting { since, .. } => Stall::new(since),
            State::WriterQueued { enqueued_at, .. } | State::WriterDraining { enqueued_at, .. } => {
                Stall::new(enqueued_at)
            }
            State::ReaderHolding { .. } | State::WriterHolding { .. } => return Ok(()),
            State::Idle => return Err(LockError::Misuse("complete without begin")),
        };
        let mut backoff = Backoff::new(&self.config);
        // When the last poll that still saw the old epoch was posted.
        let mut previous_post = None;
        // Set after a recovery request: look at the entry again at once.
        let mut look_now = false;
        loop {
            if Instant::now() >= give_up_at {
                // Our RdrCnt increment or TailPtr stays in the entry (undoing
                // either could admit someone too early), so the lock stalls
                // until the host recovers it, and this handle is not reused.
                self.poisoned = true;
                self.state = State::Idle;
                return Err(LockError::Timeout(self.config.give_up));
            }
            match self.state {
                State::ReaderWaiting { epoch, since, posted: joined } => {
                    if !std::mem::take(&mut look_now) {
                        backoff.pause(&self.config);
                    }
                    let posted = Instant::now();
                    self.stats.reader_polls += 1;
                    let e = self.read_entry(ep)?;
                    if e.rel_cnt().leaped_from(since) {
                        // Recovered: our RdrCnt increment is gone.
                        if self.restart(ep, Mode::Shared, &mut stall)? {
                            return Ok(());
                        }
                        backoff = Backoff::new(&self.config);
                        previous_post = None;
                    } else if e.epoch() != epoch {
                        // The flip happened after our previous read was
                        // posted (or our FAA): a conservative lease start.
                        let lease_start = previous_post.unwrap_or(joined);
                        self.state = State::ReaderHolding { since, lease_start };
                        self.count_held();
                        return Ok(());
                    } else {
                        previous_post = Some(posted);
                        stall.observe(e.rel_cnt());
                        if stall.due(&self.config) {
                            look_now = self.ask_recovery(ep, &mut stall)?;
                        }
                    }
                }
                State::WriterQueued { me, enqueued_at } => {
                    let deadline = if std::mem::take(&mut look_now) {
                        Instant::now()
                    } else {
                        (Instant::now() + self.config.check_period()).min(give_up_at)
                    };
                    let stats = &mut self.stats;
                    let got = self
                        .postbox
                        .receive(ep, self.lock.entry, deadline, |l| judge_for_queued(l, enqueued_at, stats));
                    match got.map(|l| l.wire) {
                        Some(Wire::Peer {
                            message: PeerMessage::Handover { rel_cnt, cons_wrt, epoch },
                            ..
                        }) => {
                            // Line 22.
                            self.stats.handovers_received += 1;
                            self.state =
                                State::WriterHolding { me, enqueued_at, cur: rel_cnt, cons_wrt, epoch };
                            self.count_held();
                            return Ok(());
                        }
                        Some(Wire::Peer {
                            message: PeerMessage::ModeChanged { expected, epoch }, ..
                        }) => {
                            // Lines 17–20: wait for the readers the flip admitted.
                            self.stats.mode_changes_received += 1;
                            self.state = State::WriterDraining { me, enqueued_at, target: expected, epoch };
                            look_now = true;
                        }
                        _ => {
                            self.stats.writer_polls += 1;
                            let e = self.read_entry(ep)?;
                            if e.rel_cnt().leaped_from(enqueued_at) {
                                if self.restart(ep, Mode::Exclusive, &mut stall)? {
                                    return Ok(());
                                }
                            } else {
                                stall.observe(e.rel_cnt());
                                if stall.due(&self.config) {
                                    look_now = self.ask_recovery(ep, &mut stall)?;
                                }
                            }
                        }
                    }
                }
                State::WriterDraining { me, enqueued_at, target, epoch } => {
                    if !std::mem::take(&mut look_now) {
                        backoff.pause(&self.config);
                    }
                    self.stats.writer_polls += 1;
                    let e = self.read_entry(ep)?;
                    if e.rel_cnt() == target {
                        self.state =
                            State::WriterHolding { me, enqueued_at, cur: target, cons_wrt: 0, epoch };
                        self.count_held();
                        return Ok(());
                    }
                    if e.rel_cnt().leaped_from(enqueued_at) {
                        if self.restart(ep, Mode::Exclusive, &mut stall)? {
                            return Ok(());
                        }
                        backoff = Backoff::new(&self.config);
                    } else {
                        stall.observe(e.rel_cnt());
                        if stall.due(&self.config) {
                            look_now = self.ask_recovery(ep, &mut stall)?;
                        }
                    }
                }
                State::Idle | State::ReaderHolding { .. } | State::WriterHolding { .. } => {
                    unreachable!("complete() leaves the loop when the lock is held")
                }
            }
        }
    }

    /// Starts an acquisition over after a recovery wiped our part of the
    /// entry (§3.6: "restart lock acquisition once observing the leap").
    fn restart(&mut self, ep: &Endpoint, mode: Mode, stall: &mut Stall) -> Result<bool, LockError> {
        log::info!("ShiftLock {}: recovered while waiting; starting over", self.lock.entry);
        self.stats.restarts += 1;
        self.state = State::Idle;
        let held = match mode {
            Mode::Shared => self.reader_begin(ep)?,
            Mode::Exclusive => self.writer_begin(ep)?,
        };
        if held {
            self.count_held();
        }
        let rel = match self.state {
            State::ReaderWaiting { since, .. } | State::ReaderHolding { since, .. } => since,
            State::WriterQueued { enqueued_at, .. }
            | State::WriterDraining { enqueued_at, .. }
            | State::WriterHolding { enqueued_at, .. } => enqueued_at,
            State::Idle => unreachable!("begin sets a state"),
        };
        *stall = Stall::new(rel);
        Ok(held)
    }

    /// §3.6: `RelCnt` stood still for 3 × T_lease. Read the lock's era, make
    /// sure `RelCnt` still has not moved, and ask the lock host to recover
    /// the lock under that era. Returns whether the host recovered it.
    #[cold]
    fn ask_recovery(&mut self, ep: &Endpoint, stall: &mut Stall) -> Result<bool, LockError> {
        let lock = self.lock.entry;
        // The era first, then the entry (see the recovery module's ordering argument).
        let era = ep.read_u64(self.lock.recovery.eras.era_of(lock))?;
        let e = self.read_entry(ep)?;
        if e.rel_cnt() != stall.last {
            stall.observe(e.rel_cnt());
            return Ok(true);
        }
        self.stats.recovery_requests += 1;
        stall.not_before = Instant::now() + self.config.stretched(self.config.lease);
        log::warn!(
            "ShiftLock {lock}: RelCnt stuck at {} for {:?}; asking for recovery in era {era}",
            e.rel_cnt().0,
            stall.since.elapsed()
        );
        let request = Wire::Request(RecoveryRequest::Recover { lock, era, stuck_at: stall.last });
        if let Err(e) = ep.send(self.lock.recovery.service_for(ep.addr()), &request.encode()) {
            log::warn!("ShiftLock {lock}: cannot reach the recovery service: {e}");
            return Ok(false);
        }
        let deadline = Instant::now() + self.config.lease;
        let reply = self.postbox.receive(ep, lock, deadline, |l| match &l.wire {
            Wire::Reply(RecoveryReply::Recovered { era: new, .. }) if *new == era + 1 => Verdict::Take,
            Wire::Reply(RecoveryReply::Stale { requested, .. }) if *requested == era => Verdict::Take,
            Wire::Reply(RecoveryReply::Progressed { era: asked, .. }) if *asked == era => Verdict::Take,
            Wire::Reply(RecoveryReply::Refused { .. }) => Verdict::Take,
            Wire::Reply(_) | Wire::Request(_) => Verdict::Discard,
            Wire::Peer { .. } => Verdict::Keep,
        });
        match reply.map(|l| l.wire) {
            Some(Wire::Reply(RecoveryReply::Recovered { .. })) => {
                self.stats.recoveries += 1;
                Ok(true)
            }
            Some(Wire::Reply(RecoveryReply::Stale { current, .. })) => {
                // "wait for T_lease ... then check RelCnt's value again" (§3.6).
                log::info!("ShiftLock {lock}: recovery for era {era} rejected (now {current})");
                self.stats.stale_recoveries += 1;
                Ok(false)
            }
            Some(Wire::Reply(RecoveryReply::Progressed { rel_cnt, .. })) => {
                // Someone released meanwhile: not a failure after all.
                stall.observe(rel_cnt);
                stall.not_before = Instant::now();
                Ok(true)
            }
            Some(Wire::Reply(RecoveryReply::Refused { reason, .. })) => Err(LockError::Host(reason)),
            _ => {
                log::warn!(
                    "ShiftLock {lock}: no answer from the recovery service within {:?}",
                    self.config.lease
                );
                Ok(false)
            }
        }
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

    /// Alg. 3 line 2 within the lease; after it, the conditional form.
    fn release_reader(
        &mut self,
        ep: &Endpoint,
        since: RelCnt,
        lease_start: Instant,
    ) -> Result<(), LockError> {
        if lease_start.elapsed() < self.config.lease {
            // No recovery can have happened: every waiter's 3 × T_lease
            // started no earlier than our lease did (§3.6).
            let old = Entry(ep.ext_faa(self.lock.entry, READER_LEAVE, BOUNDARIES)?);
            if old.rel_cnt().leaped_from(since) {
                log::error!(
                    "ShiftLock {}: a reader within its lease released into a recovered entry",
                    self.lock.entry
                );
            }
            return Ok(());
        }
        self.release_reader_slow(ep, since)
    }

    /// A reader past its lease may have been recovered against; an
    /// unconditional `RdrCnt - 1` would then corrupt the new era's count. So
    /// decrement only while `RelCnt` is still of our era.
    #[cold]
    fn release_reader_slow(&mut self, ep: &Endpoint, since: RelCnt) -> Result<(), LockError> {
        let mut seen = self.read_entry(ep)?;
        loop {
            if seen.rel_cnt().leaped_from(since) || seen.rdr_cnt() == 0 {
                log::warn!(
                    "ShiftLock {}: reader held past its lease and was recovered from",
                    self.lock.entry
                );
                self.stats.fenced += 1;
                return Err(LockError::Fenced);
            }
            let cas = ExtCas::reader_leave_if(seen);
            let old = Entry(ep.ext_cas(self.lock.entry, cas.cmp, cas.cmp_mask, cas.swap, cas.swap_mask)?);
            if (old.0 ^ seen.0) & (RDR_CNT_MASK | REL_CNT_MASK) == 0 {
                return Ok(());
            }
            seen = old;
        }
    }

    /// Alg. 3 lines 3–23.
    fn release_writer(
        &mut self,
        ep: &Endpoint,
        me: TailPtr,
        enqueued_at: RelCnt,
        cur: RelCnt,
        cons_wrt: u32,
        epoch: Epoch,
    ) -> Result<(), LockError> {
        // Line 4: a successor whose message has arrived already.
        let mut succ = self.take_successor(ep, enqueued_at, Instant::now());
        if succ.is_none() {
            // Lines 5–12.
            let cas = ExtCas::release_last(me, cur, epoch);
            let old = Entry(ep.ext_cas(self.lock.entry, cas.cmp, cas.cmp_mask, cas.swap, cas.swap_mask)?);
            if old.rel_cnt() != cur {
                return Err(self.fenced(old));
            }
            if old.tail() == me {
                return Ok(());
            }
            // Line 13: wait up to T_lease, then assume the successor failed.
            let deadline = Instant::now() + self.config.stretched(self.config.lease);
            succ = self.take_successor(ep, enqueued_at, deadline);
            if succ.is_none() {
                log::warn!(
                    "ShiftLock {}: no Successor message within the lease; dropping the lock to recovery",
                    self.lock.entry
                );
                self.stats.dropped += 1;
                return Ok(());
            }
        }
        let succ = succ.expect("checked above");
        self.hand_over_slow(ep, succ, cur, cons_wrt, epoch)
    }

    /// Alg. 3 lines 15–23: hand the lock to `succ`, or to the readers if
    /// `consWrt` reached the threshold.
    #[cold]
    fn hand_over_slow(
        &mut self,
        ep: &Endpoint,
        succ: ClientAddr,
        cur: RelCnt,
        cons_wrt: u32,
        epoch: Epoch,
    ) -> Result<(), LockError> {
        if cons_wrt >= self.config.writer_threshold {
            let cas = ExtCas::change_mode(cur, epoch);
            let old = Entry(ep.ext_cas(self.lock.entry, cas.cmp, cas.cmp_mask, cas.swap, cas.swap_mask)?);
            if old.rel_cnt() != cur {
                return Err(self.fenced(old));
            }
            // Line 17: we and the `RdrCnt` readers admitted by the flip release before succ.
            let expected = cur.plus(1 + u64::from(old.rdr_cnt()));
            self.stats.mode_changes_sent += 1;
            self.send(ep, succ, PeerMessage::ModeChanged { expected, epoch: epoch.flipped() });
        } else {
            let cas = ExtCas::hand_over(cur);
            let old = Entry(ep.ext_cas(self.lock.entry, cas.cmp, cas.cmp_mask, cas.swap, cas.swap_mask)?);
            if old.rel_cnt() != cur {
                return Err(self.fenced(old));
            }
            self.stats.handovers_sent += 1;
            self.send(
                ep,
                succ,
                PeerMessage::Handover { rel_cnt: cur.plus(1), cons_wrt: cons_wrt + 1, epoch },
            );
        }
        Ok(())
    }

    fn fenced(&mut self, seen: Entry) -> LockError {
        log::warn!(
            "ShiftLock {}: writer held past its lease and was recovered from ({seen:?})",
            self.lock.entry
        );
        self.stats.fenced += 1;
        LockError::Fenced
    }

    /// A `Successor` message for this acquisition, waiting until `deadline`.
    fn take_successor(
        &mut self,
        ep: &Endpoint,
        enqueued_at: RelCnt,
        deadline: Instant,
    ) -> Option<ClientAddr> {
        let stats = &mut self.stats;
        let letter = self.postbox.receive(ep, self.lock.entry, deadline, |l| match l.wire {
            Wire::Peer { message: PeerMessage::Successor { enqueued_at: theirs }, .. } => {
                // Our successor enqueued after us, in our era.
                if theirs.same_era_since(enqueued_at) {
                    Verdict::Take
                } else {
                    stats.stale_messages += 1;
                    Verdict::Discard
                }
            }
            // Nobody hands the lock to its holder: stale.
            Wire::Peer { .. } | Wire::Reply(_) => {
                stats.stale_messages += 1;
                Verdict::Discard
            }
            Wire::Request(_) => Verdict::Discard,
        });
        letter.map(|l| l.from)
    }
}

/// Alg. 2 line 16: what a queued writer does with a message about its lock.
fn judge_for_queued(letter: &Letter, enqueued_at: RelCnt, stats: &mut ShiftLockStats) -> Verdict {
    let sent_at = match letter.wire {
        Wire::Peer { message: PeerMessage::Handover { rel_cnt, .. }, .. } => rel_cnt,
        Wire::Peer { message: PeerMessage::ModeChanged { expected, .. }, .. } => expected,
        // A successor's message is for our release.
        Wire::Peer { message: PeerMessage::Successor { .. }, .. } => return Verdict::Keep,
        Wire::Reply(_) | Wire::Request(_) => return Verdict::Discard,
    };
    // Our predecessor released after we enqueued, in our era.
    if sent_at.same_era_since(enqueued_at) {
        Verdict::Take
    } else {
        stats.stale_messages += 1;
        Verdict::Discard
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
        match std::mem::replace(&mut self.state, State::Idle) {
            State::ReaderHolding { since, lease_start } => self.release_reader(ep, since, lease_start),
            State::WriterHolding { me, enqueued_at, cur, cons_wrt, epoch } => {
                if TailPtr::from_client(ep.addr()) != Ok(me) {
                    self.state = State::WriterHolding { me, enqueued_at, cur, cons_wrt, epoch };
                    return Err(LockError::Misuse("release through another endpoint than the acquisition"));
                }
                self.release_writer(ep, me, enqueued_at, cur, cons_wrt, epoch)
            }
            other => {
                self.state = other;
                Err(LockError::Misuse("release without a held lock"))
            }
        }
    }
}
