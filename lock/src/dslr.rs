//! DSLR: the decentralized, starvation-free reader-writer lock of
//! dslr-sigmod18.md §4–5 — Lamport's bakery with one fetch-and-add per
//! acquisition. A selectable lock of its own (`--inode-lock dslr`), and
//! Citron's spillover mutex (through [`DslrLock::lock_exclusive`] /
//! [`DslrLock::unlock`] or the [`RwLockClient`] trait).
//!
//! # The lock word (§4.4, Fig. 3)
//!
//! One 8-byte, 8-aligned word ([`DSLR_BYTES`], [`DSLR_ALIGN`]) of four
//! 16-bit counters, `{n_X, n_S, max_X, max_S}`:
//!
//! | bits   | field   | constant        | meaning (bakery analogy)                 |
//! |--------|---------|-----------------|------------------------------------------|
//! | 48..64 | `n_X`   | [`N_X_SHIFT`]   | exclusive tickets served (released)      |
//! | 32..48 | `n_S`   | [`N_S_SHIFT`]   | shared tickets served (released)         |
//! | 16..32 | `max_X` | [`MAX_X_SHIFT`] | next exclusive ticket                    |
//! | 0..16  | `max_S` | [`MAX_S_SHIFT`] | next shared ticket                       |
//!
//! A zeroed word is a free lock. Every counter stays below `count_max`
//! (the paper's `COUNT_MAX` = 2^15, [`COUNT_MAX`]); bit 15 of a `max` field is
//! the canary of §4.9.
//!
//! # Protocol
//!
//! * **Acquire** (Alg. 1): one FA on `max_X` (exclusive) or `max_S` (shared)
//!   returns `prev`, whose `max` fields are the [`Ticket`]. A shared ticket
//!   may proceed once `n_X == prev.max_X`; an exclusive one once also
//!   `n_S == prev.max_S` (lines 12 and 26). Uncontended that is the only verb.
//! * **Conflict** (Alg. 2): poll with READ, waiting `wait_count × ω` between
//!   reads, where `wait_count` is the number of tickets still ahead (line 20).
//! * **Release** (Alg. 3): one FA on `n_X` or `n_S` within the lease (after
//!   it, see below).
//! * **Counter reset** (§4.9, Alg. 1 lines 4–11 / 18–25, Alg. 3 lines 6–7):
//!   the request whose ticket takes a `max` field to `count_max` becomes the
//!   resetter: after its release it CASes the fully drained word to zero.
//!   Requests that find a `max` field at `count_max` give their ticket back
//!   with a second FA and back off ([`RandomBackoff`], Appendix A.3).
//! * **Failures and deadlocks** (§4.7, Alg. 2 lines 11–19): a waiter that sees
//!   `n_X`/`n_S` unchanged for twice the lease resets the word with a CAS so
//!   that the stuck tickets before it count as served. A requester that finds
//!   the canary set and `n_X`/`n_S` unchanged for twice the lease (the
//!   resetter died) resets the word to zero (Alg. 1 lines 7–8).
//! * **Multi-slot leases** (§5.1): [`DslrLock::acquire_slots`] takes `k`
//!   consecutive tickets with one FA of `k` (its lease is `k` leases) and
//!   releases them with one FA of `k`.
//!
//! # Choices where the paper leaves room (and where it has to be corrected)
//!
//! * **Field-wise FA.** Every FA is a masked FAA with a boundary at the top
//!   bit of each field ([`FIELD_BOUNDARIES`]): still one verb that always
//!   succeeds, but a carry or borrow can never reach a neighbouring counter,
//!   even when a give-back FA lands on a word somebody has just reset.
//! * **Timing from the RTT** ([`DslrConfig::from_rtt`]): ω = 2.5 RTT and the
//!   lease = 5000 RTT, the paper's ratios (ω = 5 µs and a 10 ms lease on a
//!   ~2 µs fabric), with a 1 s floor on the lease because our holders are
//!   ordinary threads that a busy scheduler can stall. The random backoff uses
//!   R = 2ω and L = min(1000 R, lease) (the paper's 10 µs and 10 ms). A poll
//!   never sleeps longer than lease/16, so a waiter notices silence in time.
//! * **The failure timeout with multi-slot leases** is `2 × lease ×
//!   min(δ, max_slots)` of silence, where δ is the number of tickets ahead
//!   (§5.1 makes expiry proportional to δ; capping by [`DslrLimits`]'s
//!   `max_slots`, "the maximum value of k", keeps the paper's 2 × lease when
//!   multi-slot leases are not in use, the default).
//! * **Which tickets a lease reset consumes.** Alg. 2 line 3 reports
//!   "reset past us" when `n_X > prev.max_X` or `n_S > prev.max_S`. For an
//!   exclusive waiter both are exact (no later ticket can be served before
//!   it). For a shared waiter `n_S > prev.max_S` happens legitimately (readers
//!   behind it share its grant and may release before it polls), and a reader
//!   that then gave up its unreleased ticket would block every later writer;
//!   so a shared waiter only trusts `n_X > prev.max_X`. For the same reason
//!   the shared reset of line 13, `{prev.max_X, prev.max_S + 1}`, would let
//!   readers waiting beside it enter with tickets the reset counted as
//!   served; our shared waiter sets only `n_X = prev.max_X` (skipping the
//!   exclusive tickets that block it, whose waiters see `n_X` pass them) and
//!   proceeds holding its own ticket. The exclusive reset is the paper's
//!   (line 15, `{prev.max_X + k, prev.max_S}`, own ticket included, then a
//!   new ticket). Tickets a reset consumes are never released: their waiters
//!   see themselves passed and take a new ticket; their holders are past
//!   their lease (silence for 2 × lease implies it), and a release after the
//!   lease sees the reset and is not applied (Alg. 3 line 1, below).
//! * **Zero resets and waiters of the old numbering.** A waiter also counts
//!   itself passed if a `max` field is below its own ticket (impossible while
//!   its ticket is in the word: nobody takes back another's FA), so a waiter
//!   that sleeps through a reset to zero notices when it wakes — unless
//!   `count_max − (clients × k)` new tickets were taken within one poll
//!   interval (≤ lease/16), far out of reach with the paper's 2^15.
//! * **Alg. 2 lines 17–18** ("reset L to zero" when the reset word has the
//!   canary): only when the reset leaves the word drained, i.e. the waiter was
//!   the resetter and gave up its role; otherwise the resetter is still
//!   queued and resets as usual, or it is dead and Alg. 1 lines 7–8 apply.
//! * **Alg. 3 line 1** (no release after the lease) is refined: after the
//!   lease a holder READs the word and releases with a CAS only if no reset
//!   has passed its ticket (`n_X` still equals its `max_X`, and no zero
//!   reset); then nobody can have entered beside it and the release is an
//!   ordinary one (`late_releases` counts it). If a reset did pass it, it
//!   does not touch the word (the FA would push `n` past `max`) and returns
//!   [`LockError::Fenced`]: its critical section may have overlapped
//!   another's. The paper skips the late FA unconditionally, which makes
//!   every waiter pay 2 × lease for a holder that was merely slow. The
//!   resetter (which the paper lets release late) follows the same rule; if
//!   its word never drains, the stuck-canary reset (Alg. 1 lines 7–8)
//!   clears it.
//! * **The fence delay** ([`DslrConfig::fence_delay`], zero below a file
//!   system): every silence threshold above is `2 × lease × slots + fence
//!   delay`, so a holder whose whole process stopped after its last check
//!   of the lease is fenced at the servers (its late verbs refused) before
//!   anyone resets its tickets. The holder side is unchanged: Alg. 3 line 1
//!   still counts the lease from the acquisition, and a reset comes later
//!   than before, never sooner. Polls stay at most lease/16 apart, so the
//!   watch of the served counters sees every release.
//! * **Polling order.** Alg. 2 reads, then waits; we wait first (the `prev`
//!   of the FA already says how many tickets are ahead), then read.
//! * **Polling during silence.** The wait between polls is `wait_count × ω`
//!   (line 20) or, if longer, 1/16 of the time the counters have been silent:
//!   a holder that takes far longer than ω per ticket (a long critical
//!   section, a dead client) is then polled a few dozen times instead of
//!   once per ω (on shm, ω is a fraction of a microsecond), for at most 1/16
//!   of extra latency. Never longer than lease/16.

use std::collections::hash_map::RandomState;
use std::fmt;
use std::hash::{BuildHasher, Hasher};
use std::time::{Duration, Instant};

use crate::rdma::arith::{field_boundaries, field_delta, masked_faa_u64};
use crate::rdma::{Endpoint, RemoteAddr};
use crate::rwlock::{LockError, Mode, RwLockClient};

/// Bytes of lock memory: one word.
pub const DSLR_BYTES: u64 = 8;
/// Alignment of the lock word (an 8-byte atomic).
pub const DSLR_ALIGN: u64 = 8;
/// Width of each counter.
pub const FIELD_BITS: u32 = 16;
/// A counter's bits, before shifting.
pub const FIELD_MASK: u64 = (1 << FIELD_BITS) - 1;
pub const N_X_SHIFT: u32 = 48;
pub const N_S_SHIFT: u32 = 32;
pub const MAX_X_SHIFT: u32 = 16;
pub const MAX_S_SHIFT: u32 = 0;
/// Masked-FAA boundaries: the top bit of every counter.
pub const FIELD_BOUNDARIES: u64 = field_boundaries(&[
    (MAX_S_SHIFT, FIELD_BITS),
    (MAX_X_SHIFT, FIELD_BITS),
    (N_S_SHIFT, FIELD_BITS),
    (N_X_SHIFT, FIELD_BITS),
]);
/// The paper's COUNT_MAX (§4.9): counters are reset before a `max` field
/// reaches it; its bit is the canary.
pub const COUNT_MAX: u16 = 1 << 15;

/// Below this a wait spins (yielding); above it the thread sleeps.
const SPIN_LIMIT: Duration = Duration::from_micros(50);

/// A lock word, decoded.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct DslrWord(pub u64);

impl fmt::Debug for DslrWord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{{n_X {}, n_S {}, max_X {}, max_S {}}}", self.nx(), self.ns(), self.maxx(), self.maxs())
    }
}

impl DslrWord {
    pub const FREE: DslrWord = DslrWord(0);

    pub const fn new(nx: u16, ns: u16, maxx: u16, maxs: u16) -> Self {
        DslrWord(
            (nx as u64) << N_X_SHIFT
                | (ns as u64) << N_S_SHIFT
                | (maxx as u64) << MAX_X_SHIFT
                | (maxs as u64) << MAX_S_SHIFT,
        )
    }

    const fn field(self, shift: u32) -> u16 {
        ((self.0 >> shift) & FIELD_MASK) as u16
    }

    pub const fn nx(self) -> u16 {
        self.field(N_X_SHIFT)
    }

    pub const fn ns(self) -> u16 {
        self.field(N_S_SHIFT)
    }

    pub const fn maxx(self) -> u16 {
        self.field(MAX_X_SHIFT)
    }

    pub const fn maxs(self) -> u16 {
        self.field(MAX_S_SHIFT)
    }

    /// `{n_X, n_S}`: what moves when anybody releases, i.e. progress (§4.6).
    pub const fn served(self) -> u32 {
        (self.0 >> N_S_SHIFT) as u32
    }

    /// A `max` field has reached `count_max`: a reset is pending (§4.9).
    pub const fn canary(self, count_max: u16) -> bool {
        self.maxx() >= count_max || self.maxs() >= count_max
    }

    /// Every ticket taken has been served: nobody holds or waits.
    pub const fn drained(self) -> bool {
        self.nx() == self.maxx() && self.ns() == self.maxs()
    }
}

/// A place in the bakery's queue: the `max_X` and `max_S` the request's FA
/// returned (§4.5, Fig. 4 (b)), with its mode and number of slots (§5.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ticket {
    /// Exclusive tickets before this one.
    pub x: u16,
    /// Shared tickets before this one.
    pub s: u16,
    pub mode: Mode,
    /// Consecutive tickets taken at once (1 unless a multi-slot lease).
    pub slots: u16,
}

impl Ticket {
    /// The ticket an FA that returned `prev` obtained.
    pub const fn taken(prev: DslrWord, mode: Mode, slots: u16) -> Self {
        Ticket { x: prev.maxx(), s: prev.maxs(), mode, slots }
    }

    /// Tickets (slots) taken before this one since the last reset: the order
    /// of arrival that DSLR serves in (Appendix A.2, Lemma 2).
    pub const fn position(self) -> u32 {
        self.x as u32 + self.s as u32
    }

    /// May proceed (Alg. 1 lines 12, 26; Alg. 2 lines 6, 9).
    pub fn ready(self, val: DslrWord) -> bool {
        match self.mode {
            Mode::Shared => val.nx() == self.x,
            Mode::Exclusive => val.nx() == self.x && val.ns() == self.s,
        }
    }

    /// The word was reset past this ticket, so it will never be served
    /// (Alg. 2 line 3, restricted as the module comment explains), or it was
    /// reset to zero under it (a `max` field below this ticket's own FA).
    pub fn passed(self, val: DslrWord) -> bool {
        let (x, s, k) = (u32::from(self.x), u32::from(self.s), u32::from(self.slots));
        let (nx, ns, maxx, maxs) =
            (u32::from(val.nx()), u32::from(val.ns()), u32::from(val.maxx()), u32::from(val.maxs()));
        match self.mode {
            Mode::Shared => nx > x || maxs < s + k || maxx < x,
            Mode::Exclusive => nx > x || ns > s || maxx < x + k || maxs < s,
        }
    }

    /// Tickets ahead of this one not yet served: Alg. 2 line 20's
    /// `wait_count`, and §5.1's δ.
    pub fn ahead(self, val: DslrWord) -> u32 {
        u32::from(self.x.saturating_sub(val.nx())) + u32::from(self.s.saturating_sub(val.ns()))
    }

    /// The word once this ticket and every ticket before it are served and
    /// no later one was taken: Alg. 1 lines 11 and 25's `ResetFrom`.
    pub const fn drained_word(self) -> DslrWord {
        match self.mode {
            Mode::Shared => {
                let s = self.s + self.slots;
                DslrWord::new(self.x, s, self.x, s)
            }
            Mode::Exclusive => {
                let x = self.x + self.slots;
                DslrWord::new(x, self.s, x, self.s)
            }
        }
    }

    /// This ticket took its `max` field to `count_max`: its holder resets
    /// the word after releasing (Alg. 1 lines 10–11, 24–25).
    pub fn resets_counters(self, count_max: u16) -> bool {
        let mine = match self.mode {
            Mode::Shared => self.s,
            Mode::Exclusive => self.x,
        };
        u32::from(mine) + u32::from(self.slots) >= u32::from(count_max)
    }

    /// The word a waiter that found `val` silent for too long writes (Alg. 2
    /// lines 12–15; see the module comment for the shared case).
    pub fn skip_word(self, val: DslrWord) -> DslrWord {
        match self.mode {
            Mode::Shared => DslrWord::new(self.x, val.ns(), val.maxx(), val.maxs()),
            Mode::Exclusive => DslrWord::new(self.x + self.slots, self.s, val.maxx(), val.maxs()),
        }
    }
}

/// Timing of one DSLR client, derived from the transport's RTT.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DslrConfig {
    /// ω: the polling wait per ticket ahead (Alg. 2 line 20).
    pub omega: Duration,
    /// The lease of one ticket (slot): a holder releases within it; a waiter
    /// resets after twice it of silence (§4.7), plus the fence delay.
    pub lease: Duration,
    /// How long after a holder's lease ran out the cluster may still need
    /// to fence a silent holder at the servers. Every reset of silent
    /// tickets (Alg. 1 lines 7–9, Alg. 2 line 11, the overflow resetter's
    /// wait) waits this much longer than the paper's 2 × lease × slots, so
    /// no ticket is reset before its holder is fenced; the release guard
    /// (Alg. 3 line 1, within the lease) is unchanged, and only gets safer.
    /// Zero (the default) below a file system.
    pub fence_delay: Duration,
}

impl DslrConfig {
    /// The floor of [`DslrConfig::from_rtt`]'s lease.
    pub const MIN_LEASE: Duration = Duration::from_secs(1);

    /// ω = 2.5 RTT, lease = max(5000 RTT, 1 s): see the module comment.
    pub fn from_rtt(rtt: Duration) -> Self {
        Self {
            omega: (rtt * 5 / 2).max(Duration::from_nanos(100)),
            lease: (rtt * 5000).max(Self::MIN_LEASE),
            fence_delay: Duration::ZERO,
        }
    }

    pub fn with_lease(self, lease: Duration) -> Self {
        Self { lease, ..self }
    }

    /// The same with a fence delay ([`DslrConfig::fence_delay`]).
    pub fn with_fence_delay(self, fence_delay: Duration) -> Self {
        Self { fence_delay, ..self }
    }

    /// How long the served counters must stay silent, with `slots` leases
    /// ahead of the waiter (§5.1's δ-proportional expiry), before it takes
    /// their holders for dead: 2 × lease × slots (§4.7), plus the fence
    /// delay.
    pub fn silence(&self, slots: u32) -> Duration {
        self.lease * 2 * slots + self.fence_delay
    }

    /// The longest single wait between two polls.
    fn poll_cap(&self) -> Duration {
        self.lease / 16
    }

    /// Appendix A.3's R and L.
    fn backoff(&self) -> RandomBackoff {
        let base = self.omega * 2;
        RandomBackoff::new(base, (base * 1000).min(self.lease))
    }
}

/// What every client of one lock must agree on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DslrLimits {
    count_max: u16,
    max_slots: u16,
}

impl Default for DslrLimits {
    fn default() -> Self {
        Self::PAPER
    }
}

impl DslrLimits {
    /// COUNT_MAX = 2^15, single-slot leases.
    pub const PAPER: DslrLimits = DslrLimits { count_max: COUNT_MAX, max_slots: 1 };

    /// `count_max`: where counters are reset (§4.9; at most [`COUNT_MAX`]
    /// so a `max` field never leaves its 16 bits). `max_slots`: the largest
    /// `k` of a multi-slot lease (§5.1), which also scales the failure
    /// timeout.
    pub fn new(count_max: u16, max_slots: u16) -> Result<Self, LockError> {
        if !(4..=COUNT_MAX).contains(&count_max) {
            return Err(LockError::Misuse("DSLR count_max must be in 4..=32768"));
        }
        if max_slots == 0 || max_slots > count_max / 4 {
            return Err(LockError::Misuse("DSLR max_slots must be in 1..=count_max/4"));
        }
        Ok(Self { count_max, max_slots })
    }

    pub fn count_max(&self) -> u16 {
        self.count_max
    }

    pub fn max_slots(&self) -> u16 {
        self.max_slots
    }
}

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
    /// has passed `t` (see the module comment). Returns whether it was.
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
            // Line 20 (before the read: see the module comment), stretched
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

/// Waits `d`: yielding spin for short waits, sleep for long ones.
pub fn pause(d: Duration) {
    if d >= SPIN_LIMIT {
        std::thread::sleep(d);
    } else {
        let t = Instant::now();
        while t.elapsed() < d {
            std::thread::yield_now();
        }
    }
}

/// Truncated binary exponential random backoff (Appendix A.3): after the
/// c-th consecutive failure wait W uniform in `[0, min(R · 2^(c−1), L)]`.
#[derive(Debug)]
pub struct RandomBackoff {
    base: Duration,
    cap: Duration,
    failures: u32,
    rng: u64,
}

impl RandomBackoff {
    pub fn new(base: Duration, cap: Duration) -> Self {
        let mut h = RandomState::new().build_hasher();
        h.write_u64(base.as_nanos() as u64);
        Self { base, cap: cap.max(base), failures: 0, rng: h.finish() | 1 }
    }

    /// The window the next wait is drawn from.
    pub fn window(&self) -> Duration {
        let doublings = self.failures.saturating_sub(1).min(30);
        self.base.saturating_mul(1 << doublings).min(self.cap)
    }

    /// Records a failure and waits; returns the wait.
    pub fn wait(&mut self) -> Duration {
        self.failures += 1;
        let window = self.window().as_nanos() as u64;
        // xorshift64*: plenty for spreading retries.
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        let r = self.rng.wrapping_mul(0x2545_F491_4F6C_DD1D);
        let w = Duration::from_nanos(r % (window + 1));
        pause(w);
        w
    }

    /// After a success.
    pub fn reset(&mut self) {
        self.failures = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn silence_adds_the_fence_delay_to_the_papers_threshold() {
        let c = DslrConfig::from_rtt(Duration::from_micros(2)).with_lease(Duration::from_millis(300));
        assert_eq!(c.fence_delay, Duration::ZERO, "below a file system: the paper's thresholds");
        assert_eq!(c.silence(1), Duration::from_millis(600));
        assert_eq!(c.silence(3), Duration::from_millis(1800));
        let f = c.with_fence_delay(Duration::from_secs(3));
        assert_eq!(f.silence(1), Duration::from_millis(3600));
        assert_eq!(f.silence(3), Duration::from_millis(4800));
        assert_eq!(f.lease, c.lease, "the holder's bound does not move");
    }

    fn w(nx: u16, ns: u16, maxx: u16, maxs: u16) -> DslrWord {
        DslrWord::new(nx, ns, maxx, maxs)
    }

    fn fa(word: DslrWord, shift: u32, delta: i64) -> DslrWord {
        DslrWord(masked_faa_u64(word.0, field_delta(shift, FIELD_BITS, delta), FIELD_BOUNDARIES))
    }

    #[test]
    fn fields_pack_where_the_table_says() {
        let word = w(0x1234, 0x5678, 0x9abc, 0xdef0);
        assert_eq!(word.0, 0x1234_5678_9abc_def0);
        assert_eq!((word.nx(), word.ns(), word.maxx(), word.maxs()), (0x1234, 0x5678, 0x9abc, 0xdef0));
        assert_eq!(word.served(), 0x1234_5678);
        assert_eq!(FIELD_BOUNDARIES, 1 << 15 | 1 << 31 | 1 << 47 | 1 << 63);
        assert_eq!(DSLR_BYTES, 8);
        assert_eq!(DslrWord::FREE, w(0, 0, 0, 0));
    }

    #[test]
    fn every_fa_stays_in_its_field() {
        // A ticket and its give-back restore the word exactly.
        let word = w(3, 4, 5, 6);
        for shift in [N_X_SHIFT, N_S_SHIFT, MAX_X_SHIFT, MAX_S_SHIFT] {
            assert_eq!(fa(fa(word, shift, 7), shift, -7), word);
        }
        assert_eq!(fa(word, MAX_X_SHIFT, 1), w(3, 4, 6, 6));
        assert_eq!(fa(word, N_S_SHIFT, 2), w(3, 6, 5, 6));
        // Wrap-around (a give-back landing on a zeroed word) stays inside.
        assert_eq!(fa(DslrWord::FREE, MAX_S_SHIFT, -1), w(0, 0, 0, 0xFFFF));
        assert_eq!(fa(w(0, 0, 0xFFFF, 0), MAX_X_SHIFT, 1), DslrWord::FREE);
        assert_eq!(fa(w(0xFFFF, 0, 0, 0), N_X_SHIFT, 1), DslrWord::FREE);
    }

    #[test]
    fn figure_4_exclusive_waits_for_shared_tickets() {
        // L = {1,1,1,4}; T3's FA(max_X) gives ticket {1,4} and L = {1,1,2,4}.
        let prev = w(1, 1, 1, 4);
        let t = Ticket::taken(prev, Mode::Exclusive, 1);
        assert_eq!((t.x, t.s, t.position()), (1, 4, 5));
        let now = fa(prev, MAX_X_SHIFT, 1);
        assert_eq!(now, w(1, 1, 2, 4));
        assert!(!t.ready(now) && !t.passed(now));
        assert_eq!(t.ahead(now), 3, "three shared tickets ahead (Fig. 4 (c))");
        assert!(!t.ready(w(1, 3, 2, 4)));
        assert!(t.ready(w(1, 4, 2, 6)) && !t.passed(w(1, 4, 2, 6)));
    }

    #[test]
    fn shared_tickets_wait_only_for_exclusive_ones() {
        let t = Ticket::taken(w(1, 1, 2, 4), Mode::Shared, 1);
        assert!(!t.ready(w(1, 1, 2, 5)));
        assert!(t.ready(w(2, 1, 2, 5)), "earlier readers may still be inside");
        // Readers behind us may release before we poll: n_S > our ticket is
        // not a reset for a reader.
        assert!(!t.passed(w(2, 6, 2, 6)));
        assert!(t.ready(w(2, 6, 2, 6)));
        // n_X past our ticket is: the exclusive after us cannot have been
        // served before us.
        assert!(t.passed(w(3, 1, 3, 5)));
    }

    #[test]
    fn passed_detects_resets_past_and_to_zero() {
        let ex = Ticket::taken(w(0, 0, 5, 9), Mode::Exclusive, 1);
        // In the word after our FA: {.., max_X 6, max_S 9}.
        assert!(!ex.passed(w(4, 9, 6, 9)));
        assert!(ex.passed(w(6, 9, 6, 9)), "n_X past us");
        assert!(ex.passed(w(5, 10, 6, 10)), "n_S past us");
        // Reset to zero, new tickets not yet past ours.
        assert!(ex.passed(DslrWord::FREE));
        assert!(ex.passed(w(0, 0, 5, 12)), "max_X below our own FA");
        assert!(ex.passed(w(2, 3, 7, 8)), "max_S below our ticket");
        let sh = Ticket::taken(w(0, 0, 2, 9), Mode::Shared, 1);
        assert!(!sh.passed(w(1, 0, 2, 10)));
        assert!(sh.passed(w(0, 0, 2, 9)), "max_S below our own FA");
        assert!(sh.passed(w(0, 0, 1, 12)), "max_X below our ticket");
    }

    #[test]
    fn overflow_reset_is_armed_by_the_ticket_reaching_count_max() {
        // Fig. 6: prev = {29998, 32765, 30000, 32767}, shared.
        let prev = w(29998, 32765, 30000, 32767);
        let t = Ticket::taken(prev, Mode::Shared, 1);
        assert!(t.resets_counters(COUNT_MAX));
        assert_eq!(t.drained_word(), w(30000, 32768, 30000, 32768));
        let after = fa(prev, MAX_S_SHIFT, 1);
        assert!(after.canary(COUNT_MAX) && !prev.canary(COUNT_MAX));
        assert!(!Ticket::taken(w(0, 0, 0, 32766), Mode::Shared, 1).resets_counters(COUNT_MAX));
        // Exclusive, with a small threshold and two slots crossing it.
        let t = Ticket::taken(w(0, 0, 14, 3), Mode::Exclusive, 2);
        assert!(t.resets_counters(16) && !t.resets_counters(17));
        assert_eq!(t.drained_word(), w(16, 3, 16, 3));
        assert!(t.drained_word().drained() && t.drained_word().canary(16));
        // Arrivals after the canary back off.
        assert!(w(3, 3, 16, 3).canary(16) && !w(3, 3, 15, 3).canary(16));
    }

    #[test]
    fn lease_resets_consume_exactly_the_tickets_ahead() {
        // A dead exclusive holder (ticket x=0), a waiting exclusive (x=1),
        // a waiting reader (x=2, s=0) and us, exclusive (x=2, s=1).
        let val = w(0, 0, 3, 1);
        let e1 = Ticket { x: 1, s: 0, mode: Mode::Exclusive, slots: 1 };
        let r = Ticket { x: 2, s: 0, mode: Mode::Shared, slots: 1 };
        let us = Ticket { x: 2, s: 1, mode: Mode::Exclusive, slots: 1 };
        let reset = us.skip_word(val);
        assert_eq!(reset, w(3, 1, 3, 1), "Alg. 2 line 15: {{prev(max_X)+1, prev(max_S)}}");
        assert!(e1.passed(reset) && r.passed(reset), "both skipped tickets notice");
        // A later reader (x=3) may now go; the word is drained: we retry.
        assert!(Ticket { x: 3, s: 1, mode: Mode::Shared, slots: 1 }.ready(reset));
        assert!(reset.drained());
        // Had the reader timed out first: only the exclusive tickets before
        // it are skipped, and the reader holds its own ticket.
        let reset = r.skip_word(val);
        assert_eq!(reset, w(2, 0, 3, 1));
        assert!(e1.passed(reset) && !r.passed(reset) && r.ready(reset));
        assert!(!us.passed(reset) && !us.ready(reset), "the writer still waits for the reader");
    }

    #[test]
    fn backoff_window_doubles_up_to_the_cap() {
        let mut b = RandomBackoff::new(Duration::from_nanos(10), Duration::from_nanos(50));
        assert_eq!(b.window(), Duration::from_nanos(10));
        let mut windows = Vec::new();
        for _ in 0..5 {
            b.failures += 1;
            windows.push(b.window().as_nanos());
        }
        assert_eq!(windows, [10, 20, 40, 50, 50]);
        assert!(b.wait() <= Duration::from_nanos(50));
        b.reset();
        assert_eq!(b.window(), Duration::from_nanos(10));
    }

    #[test]
    fn limits_and_config() {
        assert!(DslrLimits::new(3, 1).is_err());
        assert!(DslrLimits::new(COUNT_MAX + 1, 1).is_err());
        assert!(DslrLimits::new(64, 0).is_err() && DslrLimits::new(64, 17).is_err());
        assert_eq!(DslrLimits::new(64, 16).unwrap().max_slots(), 16);
        let c = DslrConfig::from_rtt(Duration::from_micros(2));
        assert_eq!(c.omega, Duration::from_micros(5), "the paper's ω on its ~2 µs fabric");
        assert_eq!(c.lease, DslrConfig::MIN_LEASE);
        assert_eq!(DslrConfig::from_rtt(Duration::from_millis(1)).lease, Duration::from_secs(5));
    }
}
