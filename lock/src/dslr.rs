//! DSLR: the decentralized reader-writer lock built on Lamport's bakery
//! algorithm with one fetch-and-add (dslr-sigmod18.md §4–5). Citron's
//! spillover mutex, and a selectable lock of its own.
//!
//! The lock word (§4.4, Fig. 3), four 16-bit counters:
//!
//! | bits | field | meaning |
//! |---|---|---|
//! | 48..64 | n_X | exclusive tickets served |
//! | 32..48 | n_S | shared tickets served |
//! | 16..32 | max_X | next exclusive ticket |
//! | 0..16 | max_S | next shared ticket |
//!
//! A client takes a ticket with one FA on max_X or max_S (Alg. 1); a shared
//! request waits until n_X reaches its ticket's max_X, an exclusive one until
//! both n_X and n_S reach its ticket's max_X and max_S (Alg. 2); release is one
//! FA on n_X or n_S (Alg. 3). Waiting polls at an interval proportional to the
//! tickets ahead (`wait_count × ω`, Alg. 2 line 20).
//!
//! Counters stay below COUNT_MAX = 2^15 (the 16th bit is a canary, §4.9):
//! the request whose ticket reaches COUNT_MAX - 1 resets the word to zero when
//! it releases, once everyone before it is done; requests arriving meanwhile
//! take their ticket back and back off (Alg. 1 lines 4–9, 18–23).
//!
//! Failures and deadlocks (§4.7): a waiter that sees n_X and n_S unchanged
//! for twice the lease skips the stuck tickets before its own with a CAS
//! (Alg. 2 lines 11–19; see `handle_conflict` for how we differ). A holder releases only within its lease
//! (Alg. 3 line 1), so a late release cannot corrupt a reset word.
//!
//! Choices where the paper leaves room:
//! * FA is a masked FAA with a boundary at every field's top bit: one verb
//!   like the paper's FA, and a borrow or carry can never cross into the
//!   neighbouring counter even in the overflow window.
//! * ω and the lease come from the measured RTT (the paper's 5 µs ω on a
//!   ~2 µs RTT is 2.5 RTT; its 10 ms lease is 5000 RTT), with floors (1 µs,
//!   1 s) because a holder here is an ordinary thread the scheduler can stall.
//! * Multi-slot leases (§5.1): [`DslrLock::acquire_slots`] takes `k`
//!   consecutive tickets and releases them together; a waiter's failure
//!   timeout scales with the tickets ahead of it (δ), so a long holder that
//!   announced itself is not mistaken for a dead one.

use std::time::{Duration, Instant};

use crate::rdma::arith::{field_boundaries, field_delta};
use crate::rdma::{Endpoint, RemoteAddr};
use crate::rwlock::{LockError, Mode, RwLockClient};

const NX: u32 = 48;
const NS: u32 = 32;
const MAXX: u32 = 16;
const MAXS: u32 = 0;
const FIELD: u32 = 16;
const COUNTER: u64 = 0xFFFF;
/// Counters stay below this (§4.9).
pub const COUNT_MAX: u64 = 1 << 15;
const BOUNDARIES: u64 = field_boundaries(&[(MAXS, FIELD), (MAXX, FIELD), (NS, FIELD), (NX, FIELD)]);

/// Bytes of lock memory: one 8-aligned word.
pub const DSLR_BYTES: u64 = 8;

/// A decoded lock word.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DslrWord(pub u64);

impl DslrWord {
    pub fn nx(self) -> u64 {
        (self.0 >> NX) & COUNTER
    }
    pub fn ns(self) -> u64 {
        (self.0 >> NS) & COUNTER
    }
    pub fn maxx(self) -> u64 {
        (self.0 >> MAXX) & COUNTER
    }
    pub fn maxs(self) -> u64 {
        (self.0 >> MAXS) & COUNTER
    }
    pub fn pack(nx: u64, ns: u64, maxx: u64, maxs: u64) -> u64 {
        (nx << NX) | (ns << NS) | (maxx << MAXX) | (maxs << MAXS)
    }
    /// The served counters, whose movement is progress.
    fn served(self) -> u64 {
        self.0 >> NS
    }
}

/// Timing of one DSLR client.
#[derive(Clone, Copy, Debug)]
pub struct DslrConfig {
    /// ω: the polling interval per ticket ahead.
    pub omega: Duration,
    pub lease: Duration,
}

impl DslrConfig {
    pub fn from_rtt(rtt: Duration) -> Self {
        Self {
            omega: (rtt * 5 / 2).max(Duration::from_micros(1)),
            lease: (rtt * 5000).max(Duration::from_secs(1)),
        }
    }
}

struct Held {
    mode: Mode,
    slots: u64,
    since: Instant,
    /// Set when our ticket reached COUNT_MAX - 1: reset the word from this
    /// value to zero on release (Alg. 3 lines 6–7).
    reset_from: Option<u64>,
}

/// One client's handle to one DSLR lock word.
pub struct DslrLock {
    addr: RemoteAddr,
    config: DslrConfig,
    held: Option<Held>,
    /// Resets made by this client (failures, deadlocks, overflow), for tests.
    pub resets: u64,
}

enum Outcome {
    Acquired(Option<u64>),
    /// The word was reset past us, or by us: take a new ticket.
    Retry,
}

impl DslrLock {
    pub fn new(addr: RemoteAddr, config: DslrConfig) -> Self {
        Self { addr, config, held: None, resets: 0 }
    }

    /// Acquires with `slots` consecutive tickets (§5.1; 1 is the usual lease).
    pub fn acquire_slots(&mut self, ep: &Endpoint, mode: Mode, slots: u64) -> Result<(), LockError> {
        if self.held.is_some() {
            return Err(LockError::Misuse("DSLR lock acquired twice"));
        }
        if slots == 0 || slots >= COUNT_MAX / 2 {
            return Err(LockError::Misuse("DSLR slots must be in 1..16384"));
        }
        let mut backoff = self.config.omega;
        let mut blocked_since: Option<(u64, Instant)> = None;
        loop {
            match self.try_acquire(ep, mode, slots, &mut backoff, &mut blocked_since)? {
                Outcome::Acquired(reset_from) => {
                    self.held = Some(Held { mode, slots, since: Instant::now(), reset_from });
                    return Ok(());
                }
                Outcome::Retry => {}
            }
        }
    }

    fn try_acquire(
        &mut self,
        ep: &Endpoint,
        mode: Mode,
        slots: u64,
        backoff: &mut Duration,
        blocked_since: &mut Option<(u64, Instant)>,
    ) -> Result<Outcome, LockError> {
        let shift = if mode == Mode::Shared { MAXS } else { MAXX };
        // Alg. 1 lines 3 / 17: the ticket.
        let prev = DslrWord(ep.masked_faa(self.addr, field_delta(shift, FIELD, slots as i64), BOUNDARIES)?);
        if prev.maxs() >= COUNT_MAX || prev.maxx() >= COUNT_MAX {
            // Lines 4–9 / 18–23: a reset is pending; give the ticket back.
            ep.masked_faa(self.addr, field_delta(shift, FIELD, -(slots as i64)), BOUNDARIES)?;
            random_backoff(backoff);
            // If the resetter died, nobody moves n_X/n_S: reset to zero.
            let now = Instant::now();
            match *blocked_since {
                Some((served, since)) if served == prev.served() => {
                    if now.duration_since(since) > 2 * self.config.lease {
                        if ep.cas(self.addr, prev.0, 0)? == prev.0 {
                            log::warn!(
                                "DSLR {}: resetting a word whose overflow reset never came",
                                self.addr
                            );
                            self.resets += 1;
                        }
                        *blocked_since = None;
                    }
                }
                _ => *blocked_since = Some((prev.served(), now)),
            }
            return Ok(Outcome::Retry);
        }
        let mine = if mode == Mode::Shared { prev.maxs() } else { prev.maxx() };
        // Our tickets are mine..mine+slots; the last reaching COUNT_MAX - 1
        // makes us the resetter (lines 10–11 / 24–25).
        let reset_from = (mine + slots >= COUNT_MAX).then(|| match mode {
            Mode::Shared => DslrWord::pack(prev.maxx(), mine + slots, prev.maxx(), mine + slots),
            Mode::Exclusive => DslrWord::pack(mine + slots, prev.maxs(), mine + slots, prev.maxs()),
        });
        if ready(prev, prev, mode) {
            return Ok(Outcome::Acquired(reset_from));
        }
        self.handle_conflict(ep, prev, mode).map(|ok| {
            if ok {
                Outcome::Acquired(reset_from)
            } else {
                Outcome::Retry
            }
        })
    }

    /// Alg. 2: poll until our turn; detect failures and deadlocks.
    #[cold]
    fn handle_conflict(&mut self, ep: &Endpoint, prev: DslrWord, mode: Mode) -> Result<bool, LockError> {
        let mut last_served = None;
        let mut since = Instant::now();
        // §5.1: the failure timeout grows with the tickets ahead (δ).
        let ahead = (prev.maxx() - prev.nx().min(prev.maxx())) + (prev.maxs() - prev.ns().min(prev.maxs()));
        let expire = 2 * self.config.lease * (ahead.max(1) as u32);
        loop {
            let val = DslrWord(ep.read_u64(self.addr)?);
            // Line 3: the counters were reset past our ticket. Only counters
            // that cannot pass us without a reset count: n_X for everyone
            // (exclusive tickets after ours wait for us), n_S only for an
            // exclusive waiter (readers release in any order, so n_S can pass
            // a waiting reader's ticket legitimately).
            let passed = prev.maxx() < val.nx() || (mode == Mode::Exclusive && prev.maxs() < val.ns());
            if passed {
                return Ok(false);
            }
            if ready(prev, val, mode) {
                return Ok(true);
            }
            if last_served != Some(val.served()) {
                last_served = Some(val.served());
                since = Instant::now();
            } else if since.elapsed() > expire {
                // Lines 11–19: skip the stuck tickets before ours. Unlike the
                // paper (which resets past its own ticket too and retries)
                // we make our own ticket the one being served and proceed:
                // a retry would take a second ticket and leave the first one
                // unreleased, which blocks every later writer for good.
                let reset = match mode {
                    Mode::Shared => DslrWord::pack(prev.maxx(), val.ns(), val.maxx(), val.maxs()),
                    Mode::Exclusive => DslrWord::pack(prev.maxx(), prev.maxs(), val.maxx(), val.maxs()),
                };
                if ep.cas(self.addr, val.0, reset)? == val.0 {
                    log::warn!("DSLR {}: holder silent for {expire:?}; skipped its tickets", self.addr);
                    self.resets += 1;
                    return Ok(true);
                }
            }
            // Line 20: wait in proportion to the tickets ahead.
            let wait_count = (prev.maxx().saturating_sub(val.nx())) + (prev.maxs().saturating_sub(val.ns()));
            let wait = self.config.omega * wait_count.max(1) as u32;
            if wait < Duration::from_micros(50) {
                let t = Instant::now();
                while t.elapsed() < wait {
                    std::thread::yield_now();
                }
            } else {
                std::thread::sleep(wait);
            }
        }
    }

    fn reset_to_zero(&mut self, ep: &Endpoint, from: u64) -> Result<(), LockError> {
        // Alg. 3 line 7: repeat until it succeeds (everyone before us has
        // released; late comers only move max_* and back off).
        let mut backoff = self.config.omega;
        loop {
            let cur = ep.cas(self.addr, from, 0)?;
            if cur == from {
                return Ok(());
            }
            // Not yet `from`: holders before us are still inside (a shared
            // resetter does not wait for earlier readers), or arrivals that
            // saw the canary are taking their ticket back. Once the canary is
            // gone, someone else has reset the word.
            let c = DslrWord(cur);
            if c.maxx() < COUNT_MAX && c.maxs() < COUNT_MAX {
                return Ok(());
            }
            random_backoff(&mut backoff);
        }
    }
}

/// Whether the ticket `prev` may proceed given the current word `val`.
fn ready(prev: DslrWord, val: DslrWord, mode: Mode) -> bool {
    match mode {
        Mode::Shared => prev.maxx() == val.nx(),
        Mode::Exclusive => prev.maxx() == val.nx() && prev.maxs() == val.ns(),
    }
}

/// A random sleep up to `*cap`, doubling the cap up to 1 ms (Appendix A.3).
fn random_backoff(cap: &mut Duration) {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let r = (u64::from(now.subsec_nanos()) ^ u64::from(std::process::id()))
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        >> 16;
    let nanos = cap.as_nanos().max(1) as u64;
    std::thread::sleep(Duration::from_nanos(r % nanos));
    *cap = (*cap * 2).min(Duration::from_millis(1));
}

impl RwLockClient for DslrLock {
    fn acquire(&mut self, ep: &Endpoint, mode: Mode) -> Result<(), LockError> {
        self.acquire_slots(ep, mode, 1)
    }

    /// Alg. 3.
    fn release(&mut self, ep: &Endpoint) -> Result<(), LockError> {
        let held = self.held.take().ok_or(LockError::Misuse("DSLR release without acquire"))?;
        let in_lease = held.since.elapsed() < self.config.lease * held.slots as u32;
        if in_lease || held.reset_from.is_some() {
            let shift = if held.mode == Mode::Shared { NS } else { NX };
            ep.masked_faa(self.addr, field_delta(shift, FIELD, held.slots as i64), BOUNDARIES)?;
        } else {
            log::warn!("DSLR {}: released after its lease; others may have reset it", self.addr);
        }
        if let Some(from) = held.reset_from {
            self.reset_to_zero(ep, from)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn word_packing() {
        let w = DslrWord(DslrWord::pack(1, 2, 3, 4));
        assert_eq!((w.nx(), w.ns(), w.maxx(), w.maxs()), (1, 2, 3, 4));
        let old = DslrWord::pack(0, 0, 0, COUNTER);
        let after = crate::rdma::arith::masked_faa_u64(old, field_delta(MAXS, FIELD, 1), BOUNDARIES);
        assert_eq!(after, 0, "max_S wraps inside its field, max_X untouched");
    }

    #[test]
    fn readiness_follows_the_bakery_rules() {
        // Figure 4: L = {1,1,1,4}; an exclusive ticket {1,1,1,4} waits for n_S = 4.
        let prev = DslrWord(DslrWord::pack(1, 1, 1, 4));
        assert!(!ready(prev, prev, Mode::Exclusive));
        assert!(ready(prev, DslrWord(DslrWord::pack(1, 4, 2, 4)), Mode::Exclusive));
        // A shared ticket waits only for exclusive ones before it.
        assert!(ready(prev, prev, Mode::Shared));
        assert!(!ready(DslrWord(DslrWord::pack(1, 1, 2, 4)), prev, Mode::Shared));
    }
}
