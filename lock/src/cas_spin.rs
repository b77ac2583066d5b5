//! The CAS spin lock: the baseline every RDMA lock paper compares against
//! (the "Retry-on-Fail" lock of dslr-sigmod18.md §6.1 [15]): a reader-writer
//! lock word taken with compare-and-swap, retried after a truncated binary
//! exponential random backoff (the backoff of DSLR's Appendix A.3).
//!
//! # The lock word
//!
//! One 8-byte, 8-aligned word ([`CAS_SPIN_BYTES`], [`CAS_SPIN_ALIGN`]):
//!
//! | bits  | field     | constant        | meaning                        |
//! |-------|-----------|-----------------|--------------------------------|
//! | 63    | writer    | [`WRITER_BIT`]  | a writer holds the lock        |
//! | 0..63 | readers   | [`READER_MASK`] | readers holding the lock       |
//!
//! A zeroed word is a free lock. The word is never "writer with readers":
//! a writer CASes from 0 and readers CAS only from words without the
//! writer bit.
//!
//! # Protocol
//!
//! * Writer: `CAS(0 → WRITER_BIT)`; on failure back off and retry.
//! * Reader: `CAS(r → r + 1)` for a reader count `r` without the writer bit.
//!   The first attempt guesses the count this client last saw (0 at first);
//!   a failure returns the current word, so when it is only other readers
//!   that moved, the reader retries at once with the returned count (every
//!   failure of that kind is another reader's success); when a writer holds,
//!   it backs off.
//! * Release: one FAA that always succeeds — readers add −1; a writer adds
//!   `WRITER_BIT`, which clears bit 63 (the carry leaves the word).
//!
//! Uncontended, acquire + release is two verbs (a CAS and an FAA).
//!
//! Choices: backoff base = 1 RTT and cap = 128 RTT ([`CasSpinConfig::from_rtt`]),
//! so a waiter retries about as fast as a verb completes and never waits
//! much longer than a short critical section. As in the paper's baseline,
//! there is no fairness (readers can starve writers, fast clients slow ones)
//! and no lease: a holder that dies keeps the lock.

use std::time::Duration;

use crate::dslr::RandomBackoff;
use crate::rdma::{Endpoint, RemoteAddr};
use crate::rwlock::{LockError, Mode, RwLockClient};

/// Bytes of lock memory: one word.
pub const CAS_SPIN_BYTES: u64 = 8;
/// Alignment of the lock word.
pub const CAS_SPIN_ALIGN: u64 = 8;
pub const WRITER_SHIFT: u32 = 63;
/// Set while a writer holds the lock.
pub const WRITER_BIT: u64 = 1 << WRITER_SHIFT;
/// The reader count.
pub const READER_MASK: u64 = WRITER_BIT - 1;
/// Adding this to the word takes one reader out (two's complement of 1).
pub const READER_RELEASE: u64 = u64::MAX;
/// Adding this to a word that is exactly `WRITER_BIT` makes it zero.
pub const WRITER_RELEASE: u64 = WRITER_BIT;

/// A lock word, decoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CasSpinWord(pub u64);

impl CasSpinWord {
    pub const FREE: CasSpinWord = CasSpinWord(0);

    pub const fn writer(self) -> bool {
        self.0 & WRITER_BIT != 0
    }

    pub const fn readers(self) -> u64 {
        self.0 & READER_MASK
    }
}

/// Backoff of one client, from the transport's RTT.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CasSpinConfig {
    /// The first backoff window.
    pub backoff_base: Duration,
    /// The largest backoff window.
    pub backoff_cap: Duration,
}

impl CasSpinConfig {
    /// base = RTT, cap = 128 RTT.
    pub fn from_rtt(rtt: Duration) -> Self {
        let base = rtt.max(Duration::from_nanos(100));
        Self { backoff_base: base, backoff_cap: base * 128 }
    }
}

/// What one client did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CasSpinStats {
    pub acquisitions: u64,
    /// CASes that failed.
    pub failed_cas: u64,
    /// Backoff waits.
    pub backoffs: u64,
}

/// One client's handle to one CAS spin lock word.
#[derive(Debug)]
pub struct CasSpinLock {
    addr: RemoteAddr,
    backoff: RandomBackoff,
    held: Option<Mode>,
    /// The reader count a reader's first CAS expects.
    guess: u64,
    stats: CasSpinStats,
}

impl CasSpinLock {
    pub fn new(addr: RemoteAddr, config: CasSpinConfig) -> Self {
        Self {
            addr,
            backoff: RandomBackoff::new(config.backoff_base, config.backoff_cap),
            held: None,
            guess: 0,
            stats: CasSpinStats::default(),
        }
    }

    pub fn stats(&self) -> CasSpinStats {
        self.stats
    }

    #[inline]
    fn acquire_mode(&mut self, ep: &Endpoint, mode: Mode) -> Result<(), LockError> {
        if self.held.is_some() {
            return Err(LockError::Misuse("CAS spin lock acquired twice"));
        }
        let expect = if mode == Mode::Shared { self.guess } else { 0 };
        let new = if mode == Mode::Shared { expect + 1 } else { WRITER_BIT };
        let old = ep.cas(self.addr, expect, new)?;
        if old == expect {
            self.granted(mode, expect);
            return Ok(());
        }
        self.acquire_slow(ep, mode, CasSpinWord(old))
    }

    #[cold]
    fn acquire_slow(&mut self, ep: &Endpoint, mode: Mode, mut seen: CasSpinWord) -> Result<(), LockError> {
        loop {
            self.stats.failed_cas += 1;
            let expect = match mode {
                Mode::Shared if !seen.writer() => seen.readers(),
                Mode::Shared => 0,
                Mode::Exclusive => 0,
            };
            // Another reader's success is no reason to wait; anything else is.
            if mode == Mode::Exclusive || seen.writer() {
                self.backoff.wait();
                self.stats.backoffs += 1;
            }
            let new = if mode == Mode::Shared { expect + 1 } else { WRITER_BIT };
            let old = ep.cas(self.addr, expect, new)?;
            if old == expect {
                self.granted(mode, expect);
                return Ok(());
            }
            seen = CasSpinWord(old);
        }
    }

    #[inline]
    fn granted(&mut self, mode: Mode, expect: u64) {
        self.held = Some(mode);
        self.backoff.reset();
        self.stats.acquisitions += 1;
        if mode == Mode::Shared {
            // Most likely we are the last reader out: guess the count we saw.
            self.guess = expect;
        }
    }
}

impl RwLockClient for CasSpinLock {
    #[inline]
    fn acquire(&mut self, ep: &Endpoint, mode: Mode) -> Result<(), LockError> {
        self.acquire_mode(ep, mode)
    }

    #[inline]
    fn release(&mut self, ep: &Endpoint) -> Result<(), LockError> {
        let add = match self.held.take().ok_or(LockError::Misuse("CAS spin lock release without acquire"))? {
            Mode::Shared => READER_RELEASE,
            Mode::Exclusive => WRITER_RELEASE,
        };
        ep.faa(self.addr, add)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn word_bits() {
        assert_eq!(WRITER_BIT, 0x8000_0000_0000_0000);
        assert_eq!(READER_MASK & WRITER_BIT, 0);
        assert_eq!(READER_MASK | WRITER_BIT, u64::MAX);
        let w = CasSpinWord(WRITER_BIT);
        assert!(w.writer() && w.readers() == 0);
        let r = CasSpinWord(3);
        assert!(!r.writer() && r.readers() == 3);
        assert_eq!(CasSpinWord::FREE, CasSpinWord(0));
    }

    #[test]
    fn releases_are_plain_additions() {
        // A writer's FAA clears bit 63; the carry leaves the word.
        assert_eq!(WRITER_BIT.wrapping_add(WRITER_RELEASE), 0);
        // A reader's FAA takes one reader out and never touches bit 63.
        assert_eq!(5u64.wrapping_add(READER_RELEASE), 4);
        assert_eq!(1u64.wrapping_add(READER_RELEASE), 0);
    }

    #[test]
    fn backoff_follows_the_rtt() {
        let c = CasSpinConfig::from_rtt(Duration::from_micros(3));
        assert_eq!((c.backoff_base, c.backoff_cap), (Duration::from_micros(3), Duration::from_micros(384)));
    }
}
