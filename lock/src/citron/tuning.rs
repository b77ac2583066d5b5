//! One `T_wait` for the whole cluster, following its slowest client
//! (citron-fast23.md §3.5.5, "Tuning the parameters").
//!
//! Step 2(d)'s meet-in-the-middle is safe only if every holder of an
//! internal node waits at least as long as any notifier may take: a
//! notifier aborts when `t2 − t1 > (1 − δ)·T_wait` (Inequation (1)), and the
//! holder waits `T_wait` from `t0`. So `T_wait` is a cluster-wide parameter,
//! and it must cover the client with the longest round trip: a client whose
//! `t2 − t1` (two round trips here) exceeds it aborts every attempt. A fixed
//! value cannot serve a cluster that mixes mounts 10 µs and 5 ms away.
//!
//! # The published word
//!
//! The cluster manager (the meta-server) publishes `T_wait` in one word of
//! lock memory that every client reads with a one-sided verb:
//!
//! | bits | field | meaning |
//! |---|---|---|
//! | 0..24 | `a` | one value of `T_wait`, µs |
//! | 24..48 | `b` | the other value, µs (equal to `a` when committed) |
//! | 48..64 | version | bumped at every write (diagnostics) |
//!
//! Zero is "not published": clients use their configured `T_wait`. A word
//! with `a ≠ b` is the paper's transitional phase: a client then uses
//! `min(a, b)` to decide whether to abort ([`TWaitWord::budget`]) and
//! `max(a, b)` when it waits for descendants ([`TWaitWord::wait`]).
//!
//! # Two phases without acknowledgements
//!
//! The paper's cluster manager broadcasts `(T_old, T_new)`, collects an
//! acknowledgement from every client, then commits. Ours writes the word
//! instead (`(T_old, T_old)` → `(T_old, T_new)` → `(T_new, T_new)`), and
//! replaces the acknowledgements by time, which works because of *where*
//! clients read it: every node attempt reads the word in its Step 2(c)+(d)
//! batch, after its lock or occupy verb and its notifications, and uses
//! that one reading both for its abort budget and for its wait.
//!
//! *Claim*: if any two writes of the word are more than `T_max` apart (the
//! largest value either of them contains), no notification is ever missed.
//! Let Bob (a descendant) be late for Alice (an ancestor): his read of
//! Alice's node found it unoccupied (posted at his `t1`), Alice then
//! occupied it, read the word right after (same batch, RDMA orders the read
//! after the atomic), waited and checked her descendants before Bob's
//! notification landed, which lands before Bob reads the word (same batch,
//! after it) and before his `t2`. So both readings fall in `[t1, t2]`, and
//! Bob only keeps his lock if `t2 − t1 ≤ budget ≤ T_max`: at most one write
//! lies between the two readings, so Alice and Bob read the same state or
//! two consecutive ones. Consecutive states share a value `v` (`(a, a)`,
//! `(a, b)`, `(b, b)`), so Bob's budget ≤ `v` ≤ Alice's wait, whichever
//! read first: Alice waited at least as long as Bob allowed himself, and his
//! notification was in time after all — a contradiction. Decreases and
//! increases are alike. [`TWaitPublisher`] keeps the spacing
//! ([`TWaitPublisher::spacing`], twice `T_max` plus a margin for clock
//! drift and the write's own trip).
//!
//! # Why only `T_wait` and not `m`
//!
//! The paper tunes `m` the same way, to trade large ranges against small
//! ones. A far client needs no different `m`: all of a request's
//! notifications are one batch and all of a holder's descendant checks are
//! one batch, whatever `m` is, so `m` does not change the round trips that
//! `T_wait` has to cover. And `m` is part of the tree's scale-up contract
//! (a scale-up marks the old top `m` levels and carries counters along
//! `m`-spaced chains, [`super::scale`]), which a live change would have to
//! re-mark. So `m` stays a constant of the cluster.

use std::time::{Duration, Instant};

use crate::rdma::{Endpoint, RemoteAddr};
use crate::rwlock::LockError;

/// Bits of each `T_wait` value (µs): up to 16.7 s.
const VALUE_BITS: u32 = 24;
const VALUE_MASK: u64 = (1 << VALUE_BITS) - 1;
const B_SHIFT: u32 = VALUE_BITS;
const VERSION_SHIFT: u32 = 2 * VALUE_BITS;

/// Largest `T_wait` the word can carry.
pub const MAX_T_WAIT: Duration = Duration::from_micros(VALUE_MASK);

/// Bytes of lock memory the word needs (8-aligned, zero is "not published").
pub const TWAIT_WORD_BYTES: u64 = 8;

/// The published word (see the module comment).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TWaitWord(pub u64);

/// Whole microseconds, rounded up (a published value never falls short of
/// the duration it was made from), at least 1 (zero reads as "not
/// published").
fn micros(d: Duration) -> u64 {
    d.as_nanos().div_ceil(1000).clamp(1, u128::from(VALUE_MASK)) as u64
}

impl TWaitWord {
    /// A committed value.
    pub fn committed(t: Duration, version: u16) -> Self {
        Self::pair(t, t, version)
    }

    /// The transitional phase from `old` to `new`.
    pub fn pair(a: Duration, b: Duration, version: u16) -> Self {
        TWaitWord(micros(a) | micros(b) << B_SHIFT | u64::from(version) << VERSION_SHIFT)
    }

    fn values(self) -> Option<(Duration, Duration)> {
        let a = self.0 & VALUE_MASK;
        let b = (self.0 >> B_SHIFT) & VALUE_MASK;
        (a != 0 && b != 0).then(|| (Duration::from_micros(a), Duration::from_micros(b)))
    }

    /// Whether the word says anything (a zeroed word is "not published").
    pub fn is_published(self) -> bool {
        self.values().is_some()
    }

    /// The abort budget of Inequation (1): the smaller value.
    pub fn budget(self) -> Option<Duration> {
        self.values().map(|(a, b)| a.min(b))
    }

    /// How long a holder waits for descendants: the larger value.
    pub fn wait(self) -> Option<Duration> {
        self.values().map(|(a, b)| a.max(b))
    }

    /// Whether the two values agree (no change in progress).
    pub fn is_committed(self) -> bool {
        self.values().is_some_and(|(a, b)| a == b)
    }

    pub fn version(self) -> u16 {
        (self.0 >> VERSION_SHIFT) as u16
    }
}

/// What one node attempt may allow itself and must wait: from the word it
/// read, or from the client's configured `T_wait` when none is published.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WaitWindow {
    /// Inequation (1): `t2 − t1` may be at most `(1 − δ)` of this.
    pub budget: Duration,
    /// A holder of an internal node waits this long from `t0`.
    pub wait: Duration,
}

impl WaitWindow {
    pub fn fixed(t_wait: Duration) -> Self {
        Self { budget: t_wait, wait: t_wait }
    }

    /// The window a reading of the published word gives (`fallback` if it
    /// is not published).
    pub fn read(word: TWaitWord, fallback: Duration) -> Self {
        match (word.budget(), word.wait()) {
            (Some(budget), Some(wait)) => Self { budget, wait },
            _ => Self::fixed(fallback),
        }
    }
}

/// The cluster manager's side: writes the word, changing it in two phases
/// spaced so that the claim of the module comment holds. One per word; the
/// only writer of it.
pub struct TWaitPublisher {
    addr: RemoteAddr,
    current: Duration,
    version: u16,
    /// When the last write was posted, and the largest value it and the
    /// write before it held.
    last_write: Instant,
    last_max: Duration,
}

impl TWaitPublisher {
    /// Margin on top of twice the largest value between two writes: clock
    /// drift (10^-4 of it is far less), the write's own trip to the word, and
    /// a scheduler's delay between our clock read and the write.
    pub const MARGIN: Duration = Duration::from_millis(5);

    /// The least time between two writes whose values reach `t_max`.
    pub fn spacing(t_max: Duration) -> Duration {
        t_max * 2 + Self::MARGIN
    }

    /// Publishes `initial` as committed. The word must be zero or hold a
    /// word of an earlier publisher that is gone (a meta-server restarting
    /// over its own memory): the first write waits out the spacing of
    /// whatever it held.
    pub fn start(ep: &Endpoint, addr: RemoteAddr, initial: Duration) -> Result<Self, LockError> {
        let initial = initial.min(MAX_T_WAIT);
        let old = TWaitWord(ep.read_u64(addr)?);
        if let Some(w) = old.wait() {
            std::thread::sleep(Self::spacing(w.max(initial)));
        }
        let version = old.version().wrapping_add(1);
        ep.write_u64(addr, TWaitWord::committed(initial, version).0)?;
        Ok(Self { addr, current: initial, version, last_write: Instant::now(), last_max: initial })
    }

    /// The committed value.
    pub fn current(&self) -> Duration {
        self.current
    }

    pub fn addr(&self) -> RemoteAddr {
        self.addr
    }

    /// Moves the committed value to `target` (two writes, each after the
    /// spacing since the previous one). Blocks for about four times the
    /// larger value; a no-op if `target` is the current value.
    pub fn set(&mut self, ep: &Endpoint, target: Duration) -> Result<(), LockError> {
        let target = target.min(MAX_T_WAIT);
        if target == self.current {
            return Ok(());
        }
        let old = self.current;
        self.write(ep, TWaitWord::pair(old, target, self.version.wrapping_add(1)), old.max(target))?;
        self.write(ep, TWaitWord::committed(target, self.version.wrapping_add(1)), old.max(target))?;
        self.current = target;
        Ok(())
    }

    fn write(&mut self, ep: &Endpoint, word: TWaitWord, t_max: Duration) -> Result<(), LockError> {
        let t_max = t_max.max(self.last_max);
        let ready = self.last_write + Self::spacing(t_max);
        let now = Instant::now();
        if ready > now {
            std::thread::sleep(ready - now);
        }
        ep.write_u64(self.addr, word.0)?;
        self.last_write = Instant::now();
        self.last_max = word.wait().unwrap_or(t_max);
        self.version = word.version();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn us(n: u64) -> Duration {
        Duration::from_micros(n)
    }

    #[test]
    fn the_word_round_trips_and_zero_is_unpublished() {
        assert!(!TWaitWord(0).is_published());
        assert_eq!(WaitWindow::read(TWaitWord(0), us(200)), WaitWindow::fixed(us(200)));
        let w = TWaitWord::pair(us(300), us(40_000), 7);
        assert_eq!((w.budget(), w.wait(), w.version()), (Some(us(300)), Some(us(40_000)), 7));
        assert!(!w.is_committed());
        let c = TWaitWord::committed(us(40_000), 8);
        assert!(c.is_committed() && c.is_published());
        assert_eq!(WaitWindow::read(c, us(1)), WaitWindow { budget: us(40_000), wait: us(40_000) });
        // Values are clamped into the field, never to zero.
        let z = TWaitWord::committed(Duration::ZERO, 1);
        assert_eq!(z.budget(), Some(us(1)));
        assert_eq!(TWaitWord::committed(Duration::from_secs(100), 1).wait(), Some(MAX_T_WAIT));
    }

    /// The states a publisher moves through, and the property the module
    /// comment's claim rests on: whatever two consecutive (or equal) states
    /// a notifier and a holder read, in either order, the notifier's budget
    /// is at most the holder's wait.
    #[test]
    fn consecutive_states_are_compatible_in_either_order() {
        let values = [1u64, 200, 201, 5_000, 37_500, 100_000];
        for &a in &values {
            for &b in &values {
                let states = [
                    TWaitWord::committed(us(a), 0),
                    TWaitWord::pair(us(a), us(b), 1),
                    TWaitWord::committed(us(b), 2),
                ];
                for i in 0..states.len() {
                    for j in i.saturating_sub(1)..=(i + 1).min(states.len() - 1) {
                        let (notifier, holder) = (states[i], states[j]);
                        assert!(
                            notifier.budget() <= holder.wait(),
                            "{a}->{b}: budget of {notifier:?} above the wait of {holder:?}"
                        );
                    }
                }
                // Two writes apart (what the spacing rules out) a decrease is
                // unsafe: the reason for the spacing.
                if b < a {
                    assert!(states[0].budget() > states[2].wait());
                }
            }
        }
    }
}
