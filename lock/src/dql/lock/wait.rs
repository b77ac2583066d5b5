//! Waiting in a DQL queue for the grant (§4.3): the beats to our
//! successor, the reads of the tail, the reset of a lock whose
//! predecessor fell silent, and the restart after a reset.

use std::time::Instant;

use super::{DqlLock, DqlStats, Holding, Queued, State, Successor};
use crate::dql::message::Wire;
use crate::dql::word::{DqlId, TailWord};
use crate::postbox::{Letter, Verdict};
use crate::rdma::{ClientAddr, Endpoint};
use crate::rwlock::LockError;

impl DqlLock {
    /// Waits until a [`DqlLock::begin`] that returned `false` holds the
    /// lock: the grant from the predecessor (§4.3), with the beats, tail
    /// reads and resets of the failure handling, and restarts after resets.
    #[cold]
    pub fn complete(&mut self, ep: &Endpoint) -> Result<(), LockError> {
        let mut q = match std::mem::replace(&mut self.state, State::Idle) {
            State::Queued(q) => q,
            held @ State::Holding(_) => {
                self.state = held;
                return Ok(());
            }
            State::Idle => return Err(LockError::Misuse("complete without begin")),
        };
        let me_id = q.me.id();
        loop {
            let now = Instant::now();
            if now >= q.give_up_at {
                // Our token stays in the queue; our successor will find us
                // silent and reset the lock.
                return Err(LockError::Timeout(self.config.give_up));
            }
            let suspect_at = q.last_sign + self.config.silence();
            let mut deadline = q.next_poll.min(suspect_at).min(q.give_up_at);
            if q.successor.is_some() {
                deadline = deadline.min(q.next_beat);
            }
            let me = q.me;
            let stats = &mut self.stats;
            let letter = self.postbox.receive(ep, self.addr, deadline, |l| judge(l, me, stats));
            let rejoined = match letter {
                Some(Letter { wire: Wire::Grant { .. }, .. }) => {
                    // The freshness rule: enter only if a read posted within
                    // X showed our era open; else read again.
                    let stale = q.fresh.elapsed() > self.config.fresh_window();
                    if stale {
                        self.stats.freshness_reads += 1;
                        q.fresh = Instant::now();
                    }
                    if stale && !self.read_tail(ep)?.is_open_in(me.era()) {
                        // A reset began since: the grant is from a wiped queue.
                        self.restart(ep, me_id, q.give_up_at)?
                    } else {
                        self.enter(q);
                        return Ok(());
                    }
                }
                Some(Letter { wire: Wire::Alive { .. }, .. }) => {
                    q.last_sign = Instant::now();
                    continue;
                }
                Some(Letter { from, wire: Wire::Alert { succ, .. } }) => {
                    // Our successor. It counts its silence from its alert, so
                    // the first beat is due one beat from now: a handover
                    // stays the paper's two messages (alert, grant).
                    q.successor = Some(Successor { token: succ, addr: from });
                    q.next_beat = Instant::now() + self.config.beat();
                    continue;
                }
                None => {
                    let now = Instant::now();
                    if let Some(s) = q.successor {
                        if now >= q.next_beat {
                            self.beat(ep, s.token, s.addr);
                            q.next_beat = now + self.config.beat();
                        }
                    }
                    if now < q.next_poll && now < suspect_at {
                        continue;
                    }
                    let posted = Instant::now();
                    let seen = self.read_tail(ep)?;
                    self.stats.tail_polls += 1;
                    q.next_poll = Instant::now() + self.config.beat();
                    if !seen.is_open_in(me.era()) {
                        // A reset began or ended: our queue is gone.
                        self.restart(ep, me_id, q.give_up_at)?
                    } else {
                        q.fresh = posted;
                        if now < suspect_at {
                            continue;
                        }
                        log::warn!(
                            "DQL {}: predecessor {:?} silent for {:?}; resetting the lock",
                            self.addr,
                            q.pred,
                            q.last_sign.elapsed()
                        );
                        self.reset(ep, seen)?;
                        self.restart(ep, me_id, q.give_up_at)?
                    }
                }
            };
            match rejoined {
                None => return Ok(()),
                Some(next) => q = next,
            }
        }
    }

    /// Holds the lock on a grant. The lease starts no later than X after
    /// the fresh read (what the reset's wait R relies on).
    fn enter(&mut self, q: Queued) {
        self.stats.grants_received += 1;
        self.stats.acquisitions += 1;
        self.state = State::Holding(Holding {
            me: q.me,
            pred: Some(q.pred),
            position: q.position,
            lease_start: Instant::now().min(q.fresh + self.config.fresh_window()),
            successor: q.successor,
        });
    }

    fn beat(&mut self, ep: &Endpoint, to: TailWord, addr: ClientAddr) {
        self.stats.alive_sent += 1;
        self.send(ep, addr, Wire::Alive { lock: self.addr, to });
    }

    /// Joins again after a reset wiped our queue (§ "failures" of the
    /// module comment of [`dql`](crate::dql)). `None` if that made us the
    /// holder.
    #[cold]
    fn restart(
        &mut self,
        ep: &Endpoint,
        me: DqlId,
        give_up_at: Instant,
    ) -> Result<Option<Queued>, LockError> {
        log::info!("DQL {}: reset while queued; joining again", self.addr);
        self.stats.restarts += 1;
        let joined = self.join(ep, me, give_up_at)?;
        Ok(self.settle(ep, joined, give_up_at))
    }

    /// The failure reset: close the tail of our era (nobody joins any
    /// more), keep it closed for R, so every holder of the era has left,
    /// then open the next era, free. A CAS that fails because someone
    /// joined is retried; one that finds the tail closed or of another era
    /// leaves the reset to whoever made it.
    #[cold]
    fn reset(&mut self, ep: &Endpoint, mut seen: TailWord) -> Result<(), LockError> {
        let era = seen.era();
        while seen.is_open_in(era) {
            let closed = seen.closed();
            let got = TailWord(ep.cas(self.tail(), seen.0, closed.0)?);
            if got == seen {
                self.stats.resets += 1;
                std::thread::sleep(self.config.reset_wait());
                let open = closed.reopened(self.config.variant);
                // Fails only if a waiter took the reset over meanwhile.
                let _ = ep.cas(self.tail(), closed.0, open.0)?;
                log::warn!("DQL {}: reset {seen:?} to {open:?}", self.addr);
                return Ok(());
            }
            seen = got;
        }
        Ok(())
    }
}

/// What a queued client takes: messages for its current token; every other
/// message about this lock is from an earlier acquisition (of ours, or of a
/// queue a reset wiped) and is dropped.
fn judge(letter: &Letter<Wire>, me: TailWord, stats: &mut DqlStats) -> Verdict {
    match letter.wire {
        Wire::Grant { to, .. } | Wire::Alive { to, .. } if to == me => Verdict::Take,
        Wire::Alert { pred, .. } if pred == me => Verdict::Take,
        _ => {
            stats.stale_messages += 1;
            Verdict::Discard
        }
    }
}
