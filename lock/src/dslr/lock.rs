//! One client's handle to one DSLR lock word, [`DslrLock`]: acquisition
//! (Alg. 1), the wait on a conflict with its lease resets (Alg. 2), the
//! release (Alg. 3) and the counter resets of §4.9, with the refinements
//! the module comment of [`super`] explains.

use std::fmt;
use std::time::Instant;

use super::backoff::pause;
use super::config::{DslrConfig, DslrLimits};
use super::word::{
    DslrWord, Ticket, FIELD_BITS, FIELD_BOUNDARIES, MAX_S_SHIFT, MAX_X_SHIFT, N_S_SHIFT, N_X_SHIFT,
};
use crate::rdma::arith::{field_delta, masked_faa_u64};
use crate::rdma::{Endpoint, RemoteAddr};
use crate::rwlock::{LockError, Mode, RwLockClient};

/// What one client did, for tests and diagnostics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DslrStats {
    pub acquisitions: u64,
    /// Acquisitions that had to wait (Alg. 2 ran).
    pub conflicts: u64,
    /// READs of Alg. 2.
    pub polls: u64,
    /// Tickets given back because a reset was pending (Alg. 1 lines 4–6).
    pub canary_backoffs: u64,
    /// Our ticket was passed by a reset; we took a new one.
    pub passed: u64,
    /// Lease resets we made for silent tickets (§4.7).
    pub lease_resets: u64,
    /// Counter resets we made as the ticket that reached count_max (§4.9).
    pub overflow_resets: u64,
    /// Zero resets of a canary word whose resetter never came (Alg. 1 l. 7–8).
    pub stuck_resets: u64,
    /// Releases after the lease (Alg. 3 line 1).
    pub late_releases: u64,
    /// Late releases that a reset had passed: not applied, `Fenced`.
    pub fenced: u64,
}

impl std::ops::AddAssign for DslrStats {
    fn add_assign(&mut self, o: Self) {
        self.acquisitions += o.acquisitions;
        self.conflicts += o.conflicts;
        self.polls += o.polls;
        self.canary_backoffs += o.canary_backoffs;
        self.passed += o.passed;
        self.lease_resets += o.lease_resets;
        self.overflow_resets += o.overflow_resets;
        self.stuck_resets += o.stuck_resets;
        self.late_releases += o.late_releases;
        self.fenced += o.fenced;
    }
}

struct Held {
    ticket: Ticket,
    since: Instant,
    /// Set when our ticket reached count_max: reset the word from this value
    /// to zero after releasing (Alg. 3 lines 6–7).
    reset_from: Option<DslrWord>,
}

enum Waited {
    Granted,
    /// Our ticket was consumed by a reset (ours or another's): take a new one.
    Passed,
}

/// One client's handle to one DSLR lock word.
pub struct DslrLock {
    addr: RemoteAddr,
    config: DslrConfig,
    limits: DslrLimits,
    held: Option<Held>,
    stats: DslrStats,
}

impl fmt::Debug for DslrLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DslrLock")
            .field("addr", &self.addr)
            .field("held", &self.held.as_ref().map(|h| h.ticket))
            .finish()
    }
}

impl DslrLock {
    /// A handle with the paper's limits ([`DslrLimits::PAPER`]).
    pub fn new(addr: RemoteAddr, config: DslrConfig) -> Self {
        Self::with_limits(addr, config, DslrLimits::PAPER)
    }

    pub fn with_limits(addr: RemoteAddr, config: DslrConfig, limits: DslrLimits) -> Self {
        Self { addr, config, limits, held: None, stats: DslrStats::default() }
    }

    pub fn addr(&self) -> RemoteAddr {
        self.addr
    }

    pub fn config(&self) -> DslrConfig {
        self.config
    }

    pub fn stats(&self) -> DslrStats {
        self.stats
    }

    /// The ticket held now, if any.
    pub fn ticket(&self) -> Option<Ticket> {
        self.held.as_ref().map(|h| h.ticket)
    }

    /// The plain mutex (Citron's spillover): exclusive, one slot.
    #[inline]
    pub fn lock_exclusive(&mut self, ep: &Endpoint) -> Result<(), LockError> {
        self.acquire_slots(ep, Mode::Exclusive, 1)
    }

    /// Releases what [`DslrLock::lock_exclusive`] (or any acquire) took.
    #[inline]
    pub fn unlock(&mut self, ep: &Endpoint) -> Result<(), LockError> {
        let held = self.held.take().ok_or(LockError::Misuse("DSLR unlock without a lock"))?;
        let t = held.ticket;
        let shift = if t.mode == Mode::Shared { N_S_SHIFT } else { N_X_SHIFT };
        let add = field_delta(shift, FIELD_BITS, i64::from(t.slots));
        // Alg. 3 line 1: within the lease (k leases for k slots) ...
        let released = if held.since.elapsed() < self.config.lease * u32::from(t.slots) {
            // ... lines 3 / 5: one FA on n_S or n_X.
            ep.masked_faa(self.addr, add, FIELD_BOUNDARIES)?;
            true
        } else {
            self.release_late(ep, t, add)?
        };
        if let Some(from) = held.reset_from {
            // Lines 6–7.
            self.reset_overflow(ep, from)?;
        }
        if released {
            Ok(())
        } else {
            log::warn!("DSLR {}: released after its lease, which a reset had passed", self.addr);
            Err(LockError::Fenced)
        }
    }

    /// A release after the lease: applied with a CAS only while no reset
    /// has passed `t` (see the module comment of [`super`]). Returns
    /// whether it was.
    #[cold]
    fn release_late(&mut self, ep: &Endpoint, t: Ticket, add: u64) -> Result<bool, LockError> {
        self.stats.late_releases += 1;
        let mut val = DslrWord(ep.read_u64(self.addr)?);
        loop {
            if t.passed(val) || val.nx() != t.x {
                self.stats.fenced += 1;
                return Ok(false);
            }
            let new = masked_faa_u64(val.0, add, FIELD_BOUNDARIES);
            let old = ep.cas(self.addr, val.0, new)?;
            if old == val.0 {
                return Ok(true);
            }
            val = DslrWord(old);
        }
    }

    /// Acquires with `slots` consecutive tickets, a lease of `slots` leases
    /// (§5.1; 1 is the usual lock).
    #[inline]
    pub fn acquire_slots(&mut self, ep: &Endpoint, mode: Mode, slots: u16) -> Result<(), LockError> {
        if self.held.is_some() {
            return Err(LockError::Misuse("DSLR lock acquired twice"));
        }
        if slots == 0 || slots > self.limits.max_slots {
            return Err(LockError::Misuse("DSLR slots must be in 1..=max_slots"));
        }
        // Alg. 1 line 3 / 17: the ticket.
        let prev = self.take_ticket(ep, mode, slots)?;
        if !prev.canary(self.limits.count_max) {
            let ticket = Ticket::taken(prev, mode, slots);
            if ticket.ready(prev) {
                // Lines 12–13 / 26–27.
                self.grant(ticket);
                return Ok(());
            }
        }
        self.acquire_slow(ep, mode, slots, prev)
    }

    #[inline]
    fn take_ticket(&self, ep: &Endpoint, mode: Mode, slots: u16) -> Result<DslrWord, LockError> {
        let shift = if mode == Mode::Shared { MAX_S_SHIFT } else { MAX_X_SHIFT };
        let add = field_delta(shift, FIELD_BITS, i64::from(slots));
        Ok(DslrWord(ep.masked_faa(self.addr, add, FIELD_BOUNDARIES)?))
    }

    #[inline]
    fn grant(&mut self, ticket: Ticket) {
        let reset_from = ticket.resets_counters(self.limits.count_max).then(|| ticket.drained_word());
        self.held = Some(Held { ticket, since: Instant::now(), reset_from });
        self.stats.acquisitions += 1;
    }

    /// Alg. 1 past its first FA: a pending reset, or a conflict.
    #[cold]
    fn acquire_slow(
        &mut self,
        ep: &Endpoint,
        mode: Mode,
        slots: u16,
        first: DslrWord,
    ) -> Result<(), LockError> {
        let mut backoff = self.config.backoff();
        // The served counters seen at the first of consecutive canary hits,
        // and when (Alg. 1 line 7: "has not changed ... since last failure").
        let mut canary_watch: Option<(u32, Instant)> = None;
        let mut prev = first;
        loop {
            if prev.canary(self.limits.count_max) {
                // Lines 4–6 / 18–20: give the ticket back and back off.
                let back = if mode == Mode::Shared { MAX_S_SHIFT } else { MAX_X_SHIFT };
                ep.masked_faa(self.addr, field_delta(back, FIELD_BITS, -i64::from(slots)), FIELD_BOUNDARIES)?;
                self.stats.canary_backoffs += 1;
                match canary_watch {
                    Some((served, since)) if served == prev.served() => {
                        let silence = self.config.silence(u32::from(self.limits.max_slots));
                        if since.elapsed() > silence {
                            // Lines 7–9: the resetter never came.
                            self.reset_stuck(ep, served)?;
                            canary_watch = None;
                        }
                    }
                    _ => canary_watch = Some((prev.served(), Instant::now())),
                }
                backoff.wait();
            } else {
                canary_watch = None;
                let ticket = Ticket::taken(prev, mode, slots);
                if ticket.ready(prev) {
                    self.grant(ticket);
                    return Ok(());
                }
                self.stats.conflicts += 1;
                match self.handle_conflict(ep, ticket, prev)? {
                    Waited::Granted => {
                        self.grant(ticket);
                        return Ok(());
                    }
                    Waited::Passed => self.stats.passed += 1,
                }
            }
            prev = self.take_ticket(ep, mode, slots)?;
        }
    }

    /// Alg. 2: poll until `ticket` may proceed, resetting silent tickets.
    #[cold]
    fn handle_conflict(
        &mut self,
        ep: &Endpoint,
        ticket: Ticket,
        prev: DslrWord,
    ) -> Result<Waited, LockError> {
        let mut val = prev;
        let mut watch = (prev.served(), Instant::now());
        loop {
            // Line 20 (before the read: see the `dslr` module comment), stretched
            // while the counters stay silent.
            let wait = self.config.omega.saturating_mul(ticket.ahead(val).max(1));
            pause(wait.max(watch.1.elapsed() / 16).min(self.config.poll_cap()));
            // Line 2.
            val = DslrWord(ep.read_u64(self.addr)?);
            self.stats.polls += 1;
            // Lines 3–4.
            if ticket.passed(val) {
                return Ok(Waited::Passed);
            }
            // Lines 5–10.
            if ticket.ready(val) {
                return Ok(Waited::Granted);
            }
            if val.served() != watch.0 {
                watch = (val.served(), Instant::now());
                continue;
            }
            // Line 11, with §5.1's δ-proportional expiry.
            let slots_ahead = ticket.ahead(val).clamp(1, u32::from(self.limits.max_slots));
            if watch.1.elapsed() <= self.config.silence(slots_ahead) {
                continue;
            }
            // Lines 12–16.
            let reset = ticket.skip_word(val);
            if ep.cas(self.addr, val.0, reset.0)? != val.0 {
                continue; // the word moved: judge it afresh
            }
            self.stats.lease_resets += 1;
            log::warn!(
                "DSLR {}: {} silent for {:?}; reset {val:?} to {reset:?}",
                self.addr,
                if ticket.mode == Mode::Shared { "exclusive tickets" } else { "tickets" },
                watch.1.elapsed()
            );
            return Ok(match ticket.mode {
                // Our own ticket is still ours and now served.
                Mode::Shared => Waited::Granted,
                // Line 19: our ticket was consumed with the others. If that
                // drained a canary word we were its resetter (lines 17–18).
                Mode::Exclusive => {
                    if reset.canary(self.limits.count_max) && reset.drained() {
                        self.reset_drained(ep, reset)?;
                    }
                    Waited::Passed
                }
            });
        }
    }

    /// Alg. 3 line 7: CAS the drained word `from` to zero, repeating while
    /// earlier holders finish or arrivals give their ticket back.
    #[cold]
    fn reset_overflow(&mut self, ep: &Endpoint, from: DslrWord) -> Result<(), LockError> {
        let mut backoff = self.config.backoff();
        let mut watch = (from.served(), Instant::now());
        loop {
            let cur = DslrWord(ep.cas(self.addr, from.0, 0)?);
            if cur == from {
                self.stats.overflow_resets += 1;
                return Ok(());
            }
            if !cur.canary(self.limits.count_max) {
                // Somebody reset it (a stuck reset after our lease ran out).
                return Ok(());
            }
            if cur.served() != watch.0 {
                watch = (cur.served(), Instant::now());
            } else if watch.1.elapsed() > self.config.silence(u32::from(self.limits.max_slots)) {
                // A holder before us died: nobody else will drain the word.
                return self.reset_stuck(ep, cur.served());
            }
            backoff.wait();
        }
    }

    /// Zeroes a drained canary word (Alg. 2 line 18).
    fn reset_drained(&mut self, ep: &Endpoint, from: DslrWord) -> Result<(), LockError> {
        if ep.cas(self.addr, from.0, 0)? == from.0 {
            self.stats.overflow_resets += 1;
        } else {
            // An arrival's FA is in flight; it gives the ticket back and
            // the word is drained again: the same loop as a resetter's.
            self.reset_overflow(ep, from)?;
        }
        Ok(())
    }

    /// Alg. 1 lines 7–8: the canary is set and the counters were silent
    /// for twice the lease since we first saw `served`: reset to zero.
    #[cold]
    fn reset_stuck(&mut self, ep: &Endpoint, served: u32) -> Result<(), LockError> {
        let val = DslrWord(ep.read_u64(self.addr)?);
        if !val.canary(self.limits.count_max) || val.served() != served {
            return Ok(()); // progress after all
        }
        if ep.cas(self.addr, val.0, 0)? == val.0 {
            self.stats.stuck_resets += 1;
            log::warn!("DSLR {}: counter reset never came; reset {val:?} to zero", self.addr);
        }
        Ok(())
    }
}

impl RwLockClient for DslrLock {
    #[inline]
    fn acquire(&mut self, ep: &Endpoint, mode: Mode) -> Result<(), LockError> {
        self.acquire_slots(ep, mode, 1)
    }

    #[inline]
    fn release(&mut self, ep: &Endpoint) -> Result<(), LockError> {
        self.unlock(ep)
    }
}
