//! Lease recovery (citron-fast23.md §3.10): what a waiter does when the
//! word it spins on stops moving for T_lease — Line 11 (a stalled bakery),
//! Line 22 (a leaf that keeps refusing, with its parent held), and the
//! watched wait that Lines 18 and 36 use (their takeovers are made where
//! they wait, in [`super::acquire`]).

use std::time::{Duration, Instant};

use super::{CitronClient, TCNT_FIELD};
use crate::citron::tree::NodeIndex;
use crate::citron::word::{Internal, Ticket, COUNTER_BITS, OCC_BIT, TCNT_SHIFT};
use crate::rdma::{Endpoint, RemoteAddr};
use crate::rwlock::LockError;

/// How a watched wait ended.
pub(super) enum Watch {
    Done(Instant),
    /// The watched bits did not move for the given time; the last word seen.
    Stalled(u64),
}

impl CitronClient {
    /// §3.10, Line 22, with the leaf's parent held. No client can take bits
    /// of the leaf any more, and every holder that notified the parent in
    /// time has released (2(d)); bits still set belong to a dead client, or
    /// to a live one whose notification came too late (Inequation (1)) and
    /// which is about to roll back with a masked-CAS on exactly its bits.
    /// Zeroing the word at once, as the paper's line does, would let that
    /// late roll-back clear bits a later holder of the leaf took after we
    /// release the parent. So the leaf is watched: bits that leave were a
    /// live client's; a word unchanged for T_lease holds a dead client's
    /// bits (every holder releases within T_lease), and only those bits are
    /// cleared, by a masked-CAS that compares them.
    pub(super) fn clear_dead_leaf_bits(
        &mut self,
        ep: &Endpoint,
        addr: RemoteAddr,
        leaf: NodeIndex,
    ) -> Result<(), LockError> {
        let mut word = ep.read_u64(addr)?;
        let mut unchanged_since = Instant::now();
        while word != 0 {
            if unchanged_since.elapsed() >= self.config.lease {
                if ep.masked_cas(addr, word, word, 0, word)? & word == word {
                    log::warn!("cleared bits {word:#x} of leaf {} left by a dead client", leaf.0);
                    self.stats.recoveries += 1;
                }
            } else {
                std::thread::sleep(self.config.t_wait);
            }
            let now = ep.read_u64(addr)?;
            if now != word {
                word = now;
                unchanged_since = Instant::now();
            }
        }
        Ok(())
    }

    /// Reads `addr` until `done` holds, or until `progress(word)` has not
    /// changed for `stall` (a dead client, §3.10).
    pub(super) fn watch(
        &self,
        ep: &Endpoint,
        addr: RemoteAddr,
        done: impl Fn(u64) -> bool,
        progress: impl Fn(u64) -> u64,
        stall: Duration,
    ) -> Result<Watch, LockError> {
        let start = Instant::now();
        let mut last: Option<(u64, Instant)> = None;
        let mut spins = 0u32;
        loop {
            let posted = Instant::now();
            let w = ep.read_u64(addr)?;
            if done(w) {
                return Ok(Watch::Done(posted));
            }
            match last {
                Some((key, since)) if key == progress(w) => {
                    if since.elapsed() >= stall {
                        return Ok(Watch::Stalled(w));
                    }
                }
                _ => last = Some((progress(w), posted)),
            }
            if start.elapsed() > self.config.give_up {
                return Err(LockError::Timeout(self.config.give_up));
            }
            spins += 1;
            if spins > 16 {
                std::thread::yield_now();
            }
        }
    }

    /// Line 11 with its recovery (§3.10): wait until `ticket` is served; if
    /// TCnt and Occ stall for T_lease, wait (Δ - 1)·T_lease more (Δ: tickets
    /// ahead of ours), then take over with a masked-CAS on exactly the stalled
    /// TCnt and Occ, so any progress in the meantime makes it fail harmlessly.
    pub(super) fn wait_for_ticket(
        &self,
        ep: &Endpoint,
        addr: RemoteAddr,
        ticket: Ticket,
    ) -> Result<(), LockError> {
        let key = |w: u64| w & (TCNT_FIELD | OCC_BIT);
        loop {
            let w = match self.watch(ep, addr, |w| ticket.is_served(Internal(w)), key, self.config.lease)? {
                Watch::Done(_) => return Ok(()),
                Watch::Stalled(w) => w,
            };
            let ahead = ticket.0.wrapping_sub(Internal(w).tcnt()) & ((1 << COUNTER_BITS) - 1);
            if ahead > 1 {
                let more = self.config.lease * (ahead as u32 - 1);
                if let Watch::Done(_) = self.watch(ep, addr, |w| ticket.is_served(Internal(w)), key, more)? {
                    return Ok(());
                }
            }
            log::warn!("taking over a bakery stalled at ticket {} by a dead client", Internal(w).tcnt());
            let swap = ticket.0 << TCNT_SHIFT;
            ep.masked_cas(addr, w, TCNT_FIELD | OCC_BIT, swap, TCNT_FIELD | OCC_BIT)?;
            self.stats_recovered();
        }
    }

    pub(super) fn stats_recovered(&self) {
        self.recoveries.set(self.recoveries.get() + 1);
    }
}
