//! Acquiring a ShiftLock (Algorithm 2): a reader's FAA or a writer's
//! enqueue, then the wait for the epoch flip, the predecessor's message or
//! the readers ahead to drain, with the §3.6 stall watch (`stall`).

use std::time::{Duration, Instant};

use super::stall::Stall;
use super::{ShiftLockClient, ShiftLockConfig, ShiftLockStats, State};
use crate::rdma::{Endpoint, Verb, VerbReply};
use crate::rwlock::{LockError, Mode, Riders};
use crate::shiftlock::entry::{Entry, ExtCas, RelCnt, TailPtr, BOUNDARIES, MAX_READERS, READER_ENTER};
use crate::shiftlock::message::{Letter, PeerMessage, Verdict, Wire};

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

impl ShiftLockClient {
    /// The first verb of an acquisition (Alg. 2 line 2 or lines 7–15):
    /// `true` if the lock is held already, `false` if [`Self::complete`] must
    /// wait for it. `acquire` is `begin` then, if needed, `complete`; the two
    /// halves let a caller observe the moment it joined the lock.
    pub fn begin(&mut self, ep: &Endpoint, mode: Mode) -> Result<bool, LockError> {
        Ok(self.begin_with_reads(ep, mode, &[])?.0)
    }

    /// [`Self::begin`] with `riders` (reads) posted in the same ordered
    /// batch right after its first verb; their replies, if the lock was
    /// held at once (see [`crate::rwlock::RwLockClient::acquire_with_reads`]).
    /// Without riders the first verb goes alone, as in the paper.
    pub fn begin_with_reads(
        &mut self,
        ep: &Endpoint,
        mode: Mode,
        riders: &[Verb],
    ) -> Result<(bool, Riders), LockError> {
        if self.state != State::Idle {
            return Err(LockError::Misuse("acquire while this handle holds or waits for the lock"));
        }
        if self.poisoned {
            return Err(LockError::Misuse("this ShiftLock handle gave up an acquisition"));
        }
        if !self.postbox.bind(ep) {
            return Err(LockError::Misuse("a ShiftLock postbox serves one endpoint only"));
        }
        let (held, replies) = match mode {
            Mode::Shared => self.reader_begin_with(ep, riders)?,
            Mode::Exclusive => self.writer_begin_with(ep, riders)?,
        };
        if held {
            self.count_held();
        } else {
            self.stats.waited += 1;
        }
        Ok((held, replies.filter(|_| held)))
    }

    /// The first verb of an acquisition, and after it in the same batch
    /// the `riders`: the verb's old entry and, if there were riders, their
    /// replies.
    fn first_verb(&self, ep: &Endpoint, verb: Verb, riders: &[Verb]) -> Result<(Entry, Riders), LockError> {
        if riders.is_empty() {
            let old = match verb {
                Verb::ExtFaa { addr, add, boundary_mask } => ep.ext_faa(addr, add, boundary_mask)?,
                Verb::ExtCas { addr, cmp, cmp_mask, swap, swap_mask } => {
                    ep.ext_cas(addr, cmp, cmp_mask, swap, swap_mask)?
                }
                _ => return Err(LockError::Misuse("a ShiftLock acquisition starts with an extended atomic")),
            };
            return Ok((Entry(old), None));
        }
        let mut batch = ep.batch();
        batch.push(verb);
        for r in riders {
            batch.push(r.clone());
        }
        let mut replies = batch.submit()?.into_vec();
        let rest = replies.split_off(1);
        let old = match replies.pop() {
            Some(Ok(VerbReply::Old128(v))) => v,
            Some(Err(e)) => return Err(e.into()),
            other => {
                return Err(LockError::Host(format!("unexpected reply to a ShiftLock atomic: {other:?}")))
            }
        };
        Ok((Entry(old), Some(rest)))
    }

    /// Alg. 2 lines 2–4.
    pub(super) fn reader_begin(&mut self, ep: &Endpoint) -> Result<bool, LockError> {
        Ok(self.reader_begin_with(ep, &[])?.0)
    }

    /// [`Self::reader_begin`] with riders after its FAA.
    fn reader_begin_with(&mut self, ep: &Endpoint, riders: &[Verb]) -> Result<(bool, Riders), LockError> {
        let posted = Instant::now();
        let faa = Verb::ExtFaa { addr: self.lock.entry, add: READER_ENTER, boundary_mask: BOUNDARIES };
        let (old, replies) = self.first_verb(ep, faa, riders)?;
        if old.rdr_cnt() == MAX_READERS {
            log::error!("ShiftLock {}: RdrCnt overflowed ({old:?})", self.lock.entry);
        }
        let since = old.rel_cnt();
        self.state = if old.tail().is_null() {
            State::ReaderHolding { since, lease_start: posted }
        } else {
            State::ReaderWaiting { epoch: old.epoch(), since, posted }
        };
        Ok((old.tail().is_null(), replies))
    }

    /// Alg. 2 lines 7–15 and 23–26.
    pub(super) fn writer_begin(&mut self, ep: &Endpoint) -> Result<bool, LockError> {
        Ok(self.writer_begin_with(ep, &[])?.0)
    }

    /// [`Self::writer_begin`] with riders after its enqueue.
    fn writer_begin_with(&mut self, ep: &Endpoint, riders: &[Verb]) -> Result<(bool, Riders), LockError> {
        let me = TailPtr::from_client(ep.addr()).map_err(|e| {
            log::error!("ShiftLock {}: {e}", self.lock.entry);
            LockError::Misuse("this endpoint's address does not fit a ShiftLock TailPtr")
        })?;
        let cas = ExtCas::enqueue(me);
        let enqueue = Verb::ExtCas {
            addr: self.lock.entry,
            cmp: cas.cmp,
            cmp_mask: cas.cmp_mask,
            swap: cas.swap,
            swap_mask: cas.swap_mask,
        };
        let (old, replies) = self.first_verb(ep, enqueue, riders)?;
        let enqueued_at = old.rel_cnt();
        if let Some(pred) = old.tail().client() {
            // Line 15. A failed send means the predecessor is gone; the
            // stall it causes is resolved by recovery.
            if pred == ep.addr() {
                log::warn!("ShiftLock {}: enqueued behind our own endpoint", self.lock.entry);
            }
            self.send(ep, pred, PeerMessage::Successor { enqueued_at });
            self.state = State::WriterQueued { me, enqueued_at };
            Ok((false, None))
        } else if old.rdr_cnt() != 0 {
            // Line 24: wait for the readers ahead of us.
            let target = enqueued_at.plus(u64::from(old.rdr_cnt()));
            self.state = State::WriterDraining { me, enqueued_at, target, epoch: old.epoch() };
            Ok((false, None))
        } else {
            self.state =
                State::WriterHolding { me, enqueued_at, cur: enqueued_at, cons_wrt: 0, epoch: old.epoch() };
            Ok((true, replies))
        }
    }

    pub(super) fn count_held(&mut self) {
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
