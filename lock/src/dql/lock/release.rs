//! Releasing a DQL lock (§4.3): hand it to the successor that alerted us,
//! or swap ourselves out of the tail, waiting for a late alert in the
//! transient state (§4.3.1); a release after the lease checks for a reset.

use std::time::Instant;

use super::{DqlLock, State, Successor};
use crate::dql::message::Wire;
use crate::dql::word::{DqlId, TailWord};
use crate::postbox::Verdict;
use crate::rdma::Endpoint;
use crate::rwlock::LockError;

impl DqlLock {
    /// Releases the lock (§4.3): hand it to a successor that alerted us, or
    /// swap ourselves out of the tail; if that CAS finds a successor that
    /// has not alerted yet, wait for its alert (§4.3.1).
    pub fn unlock(&mut self, ep: &Endpoint) -> Result<(), LockError> {
        let h = match self.state {
            State::Holding(h) => h,
            _ => return Err(LockError::Misuse("release without a held DQL lock")),
        };
        if DqlId::from_client(ep.addr()) != Ok(h.me.id()) {
            return Err(LockError::Misuse("release through another endpoint than the acquisition"));
        }
        self.state = State::Idle;
        let late = h.lease_start.elapsed() >= self.config.lease;
        if late {
            self.stats.late_releases += 1;
            if !self.read_tail(ep)?.is_open_in(h.me.era()) {
                // A waiter reset the lock while we held it past our lease:
                // someone may have entered beside us.
                self.stats.fenced += 1;
                log::warn!("DQL {}: held past the lease through a reset", self.addr);
                return Err(LockError::Fenced);
            }
        }
        // §4.3: "it looks for its successor message".
        let successor = match h.successor {
            Some(s) => Some(s),
            None => self.take_alert(ep, h.me, Instant::now()),
        };
        if let Some(s) = successor {
            self.hand_over(ep, s);
            return Ok(());
        }
        // "it tries to get an update on the tail by swapping itself out with
        // some value that stands for the unlocked state".
        let free = h.me.released(self.config.variant);
        let got = TailWord(ep.cas(self.tail(), h.me.0, free.0)?);
        if got == h.me || !got.is_open_in(h.me.era()) {
            // Released; or a reset closed the tail after we left the
            // critical section: its waiters start over, nothing to hand.
            return Ok(());
        }
        self.release_transient(ep, h.me)
    }

    /// §4.3.1: "Since B is no longer at the tail of the queue, it waits for
    /// a message from its successor ... As soon as it gets an alert, it
    /// sends an alert back to it." The wait is bounded by the silence S: a
    /// successor that died between its CAS and its alert never alerts, and
    /// its own successor (or the next client to join) resets the lock.
    #[cold]
    fn release_transient(&mut self, ep: &Endpoint, me: TailWord) -> Result<(), LockError> {
        self.stats.transient += 1;
        match self.take_alert(ep, me, Instant::now() + self.config.silence()) {
            Some(s) => self.hand_over(ep, s),
            None => {
                self.stats.dropped += 1;
                log::warn!(
                    "DQL {}: our successor never alerted us; leaving the lock to its reset",
                    self.addr
                );
            }
        }
        Ok(())
    }

    /// §4.3: the grant ("sends an alert to the successor ... transferring
    /// the lock").
    fn hand_over(&mut self, ep: &Endpoint, s: Successor) {
        self.stats.grants_sent += 1;
        self.send(ep, s.addr, Wire::Grant { lock: self.addr, to: s.token });
    }

    /// The alert of our successor for token `me`, waiting until `deadline`.
    fn take_alert(&mut self, ep: &Endpoint, me: TailWord, deadline: Instant) -> Option<Successor> {
        let stats = &mut self.stats;
        let letter = self.postbox.receive(ep, self.addr, deadline, |l| match l.wire {
            Wire::Alert { pred, .. } if pred == me => Verdict::Take,
            _ => {
                stats.stale_messages += 1;
                Verdict::Discard
            }
        })?;
        match letter.wire {
            Wire::Alert { succ, .. } => Some(Successor { token: succ, addr: letter.from }),
            _ => None,
        }
    }
}
