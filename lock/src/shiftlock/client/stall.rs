//! §3.6 at the waiter: [`Stall`] watches `RelCnt` for the standstill of
//! 3 × T_lease that means a failed client; the waiter then asks the lock
//! host's recovery service to recover the lock, and starts its
//! acquisition over once it sees the leap a recovery leaves.

use std::time::Instant;

use super::{ShiftLockClient, ShiftLockConfig, State};
use crate::rdma::Endpoint;
use crate::rwlock::{LockError, Mode};
use crate::shiftlock::entry::RelCnt;
use crate::shiftlock::message::{RecoveryReply, RecoveryRequest, Verdict, Wire};

/// Watches `RelCnt` for the stall that means a failed client (§3.6).
pub(super) struct Stall {
    last: RelCnt,
    since: Instant,
    /// A rejected or unanswered request is repeated only after T_lease.
    not_before: Instant,
}

impl Stall {
    pub(super) fn new(last: RelCnt) -> Self {
        let now = Instant::now();
        Self { last, since: now, not_before: now }
    }

    pub(super) fn observe(&mut self, rel: RelCnt) {
        if rel != self.last {
            self.last = rel;
            self.since = Instant::now();
        }
    }

    pub(super) fn due(&self, config: &ShiftLockConfig) -> bool {
        let now = Instant::now();
        now.duration_since(self.since) >= config.stall_timeout() && now >= self.not_before
    }
}

impl ShiftLockClient {
    /// Starts an acquisition over after a recovery wiped our part of the
    /// entry (§3.6: "restart lock acquisition once observing the leap").
    pub(super) fn restart(
        &mut self,
        ep: &Endpoint,
        mode: Mode,
        stall: &mut Stall,
    ) -> Result<bool, LockError> {
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
    pub(super) fn ask_recovery(&mut self, ep: &Endpoint, stall: &mut Stall) -> Result<bool, LockError> {
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
}
