//! Releasing a ShiftLock (Algorithm 3): a reader's FAA, a writer's release
//! without a successor, the handover to a successor or the mode change to
//! the readers; after the lease, only while no recovery has passed us.

use std::time::Instant;

use super::ShiftLockClient;
use crate::rdma::{ClientAddr, Endpoint, Verb, VerbReply};
use crate::rwlock::LockError;
use crate::shiftlock::entry::{
    Entry, Epoch, ExtCas, RelCnt, TailPtr, BOUNDARIES, RDR_CNT_MASK, READER_LEAVE, REL_CNT_MASK,
};
use crate::shiftlock::message::{PeerMessage, Verdict, Wire};

impl ShiftLockClient {
    /// A reader's release within its lease (Alg. 3 line 2).
    pub(super) fn reader_leave_verb(&self) -> Verb {
        Verb::ExtFaa { addr: self.lock.entry, add: READER_LEAVE, boundary_mask: BOUNDARIES }
    }

    /// Alg. 3 line 2 within the lease; after it, the conditional form.
    /// `before`: the caller's writes under the lock, posted first (in the
    /// same batch as the FAA within the lease: they execute before it, so
    /// a writer that gets the lock after our FAA sees them).
    pub(super) fn release_reader(
        &mut self,
        ep: &Endpoint,
        since: RelCnt,
        lease_start: Instant,
        before: &[Verb],
    ) -> Result<(), LockError> {
        if lease_start.elapsed() < self.config.lease {
            // No recovery can have happened: every waiter's 3 × T_lease
            // started no earlier than our lease did (§3.6).
            let leave = self.reader_leave_verb();
            let old = if before.is_empty() {
                Entry(ep.ext_faa(self.lock.entry, READER_LEAVE, BOUNDARIES)?)
            } else {
                let mut verbs = before.to_vec();
                verbs.push(leave);
                let mut replies = ep.execute(&verbs)?;
                let old = match replies.pop() {
                    Some(Ok(VerbReply::Old128(v))) => Entry(v),
                    Some(Err(e)) => return Err(e.into()),
                    other => {
                        return Err(LockError::Host(format!(
                            "unexpected reply to a ShiftLock release: {other:?}"
                        )))
                    }
                };
                // The FAA went: the lock is released whatever the writes did.
                for r in replies {
                    r?;
                }
                old
            };
            if old.rel_cnt().leaped_from(since) {
                log::error!(
                    "ShiftLock {}: a reader within its lease released into a recovered entry",
                    self.lock.entry
                );
            }
            return Ok(());
        }
        let posted = crate::rwlock::execute_all(ep, before);
        let released = self.release_reader_slow(ep, since);
        posted.and(released)
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
    pub(super) fn release_writer(
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
