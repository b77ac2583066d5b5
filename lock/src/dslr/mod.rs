//! DSLR: the decentralized, starvation-free reader-writer lock of
//! dslr-sigmod18.md §4–5 — Lamport's bakery with one fetch-and-add per
//! acquisition. A selectable lock of its own (`--inode-lock dslr`), and
//! Citron's spillover mutex (through [`DslrLock::lock_exclusive`] /
//! [`DslrLock::unlock`] or the [`RwLockClient`](crate::rwlock::RwLockClient) trait).
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
//!   [`LockError::Fenced`](crate::rwlock::LockError::Fenced): its critical
//!   section may have overlapped another's. The paper skips the late FA
//!   unconditionally, which makes every waiter pay 2 × lease for a holder
//!   that was merely slow. The resetter (which the paper lets release late)
//!   follows the same rule; if its word never drains, the stuck-canary
//!   reset (Alg. 1 lines 7–8) clears it.
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
//!
//! # Files
//!
//! * `word`: the lock word's layout and the ticket arithmetic on it
//!   ([`DslrWord`], [`Ticket`]);
//! * `config`: timing from the RTT and the limits every client shares
//!   ([`DslrConfig`], [`DslrLimits`]);
//! * `lock`: the handle, [`DslrLock`]: Alg. 1–3, lease and counter resets;
//! * `backoff`: [`pause`] and Appendix A.3's [`RandomBackoff`].

mod backoff;
mod config;
mod lock;
mod word;

pub use backoff::{pause, RandomBackoff};
pub use config::{DslrConfig, DslrLimits};
pub use lock::{DslrLock, DslrStats};
pub use word::{
    DslrWord, Ticket, COUNT_MAX, DSLR_ALIGN, DSLR_BYTES, FIELD_BITS, FIELD_BOUNDARIES, FIELD_MASK,
    MAX_S_SHIFT, MAX_X_SHIFT, N_S_SHIFT, N_X_SHIFT,
};
