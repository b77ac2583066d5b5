//! ShiftLock: a reader-writer lock over one-sided verbs whose writers queue
//! MCS-style and hand the lock to each other with two-sided messages
//! (shiftlock-fast25.md §3; Algorithms 2 and 3; the recovery of §3.6).
//!
//! * [`entry`]: the 16-byte entry (Fig. 3) and the operands of every
//!   extended atomic applied to it.
//! * [`message`]: `Successor` / `Handover` / `ModeChanged` and the recovery
//!   request and reply, as serde enums; the [`Postbox`] that sorts them.
//! * [`client`]: [`ShiftLockClient`], the [`crate::rwlock::RwLockClient`]
//!   (Shared = reader, Exclusive = writer).
//! * [`recovery`]: the lock host's [`RecoveryService`] and era counters.
//!
//! Memory: one 16-aligned 16-byte entry per lock ([`ENTRY_BYTES`],
//! [`ENTRY_ALIGN`]; zero is idle), plus per lock host an [`EraTable`] of
//! 8-byte era counters (zero at start) that its recovery service owns.
//!
//! A writer's `TailPtr` is the [`ClientAddr`](crate::rdma::ClientAddr) of the
//! endpoint it acquires with: messages for it arrive in that endpoint's
//! mailbox, so a lock must be released through the endpoint it was acquired
//! with, one endpoint must not hold two handles of the same lock, and every
//! ShiftLock handle used with one endpoint must share one [`Postbox`].
//! An acquisition that exceeds [`ShiftLockConfig::give_up`] fails with
//! [`LockError::Timeout`](crate::rwlock::LockError::Timeout) and leaves its
//! handle unusable: its part of the entry stays until a recovery.
//!
//! # Choices where the paper leaves room, and why
//!
//! * **The epoch travels in `Handover`.** Alg. 2 line 22 takes only
//!   `(curRelCnt, consWrt)` from a `Handover` and keeps the epoch its own
//!   enqueue returned (line 26). If a writer further ahead in the queue
//!   flipped `Epoch` with a `ModeChanged` after we enqueued, that epoch is
//!   stale, and our release without successor (Alg. 3 line 9, `Epoch ← 1 -
//!   epoch`) would write the current value instead of flipping it, leaving
//!   the readers that wait for the flip stuck until a recovery. The holder
//!   always knows the current epoch, so it sends it; `ModeChanged` likewise
//!   carries the epoch after the flip, taken from the atomic's return value.
//! * **Writers change `RelCnt` with a CAS on `RelCnt = curRelCnt`** (Alg. 3
//!   lines 16 and 20 use an FAA; line 6 compares `TailPtr` only). While a
//!   writer holds, `RelCnt` equals its `curRelCnt` exactly (no reader holds,
//!   and every earlier release is counted in it), so the CAS always
//!   succeeds, with the same one atomic, and its returned value gives line
//!   17's `RdrCnt`. It fails only if a recovery took the lock from a writer
//!   that overran its lease: then the late writer changes nothing and its
//!   release returns [`LockError::Fenced`](crate::rwlock::LockError::Fenced)
//!   instead of corrupting the new era.
//! * **A reader releases with the paper's FAA only within its lease**, timed
//!   from a conservative start (the post time of its last poll that still
//!   saw the old epoch, or of its FAA). A reader past its lease releases with
//!   a CAS loop conditional on `RelCnt` being of its era, so a recovered-from
//!   reader never decrements the new era's `RdrCnt`.
//! * **Stale messages.** Every message names its lock and carries a
//!   `RelCnt` value of the sender's era: `Successor` the `RelCnt` its
//!   sender's enqueue returned, `Handover` / `ModeChanged` the value the
//!   receiver will hold with. A receiver accepts it only if that value is
//!   in its own era and not before its own enqueue ([`RelCnt::same_era_since`]),
//!   so a message sent before a recovery to an acquisition that restarted
//!   after it is discarded.
//! * **Consecutive writers.** `consWrt` counts handovers in a row; a writer
//!   whose `consWrt` has reached N (default 16) sends `ModeChanged` (Alg. 3
//!   line 15), so at most N + 1 writers hold in a row while readers wait.
//! * **Recovery** (§3.6) by a [`RecoveryService`] thread in the lock-host
//!   process: one recovery per era, several era counters chosen by hashing
//!   the lock's address. A waiter reads the era *before* re-reading the
//!   entry to confirm the stall, and the service resets the entry *before*
//!   advancing the era; the recovery module shows why that rules out a
//!   second reset for one stall. A rejected request is repeated only after
//!   T_lease, as the paper says. Beyond the paper's (lock, era), a request
//!   carries the `RelCnt` value seen stuck, and the service resets only if it
//!   is still there: a release that races with the reset then either
//!   prevents it or is fenced, so no handover crosses a reset.
//! * **Timing** from the measured RTT ([`ShiftLockConfig::from_rtt`]): T_lease,
//!   the drift bound δ = 10^-4 stretching every timeout, a `RelCnt` check
//!   every T_lease / 2 while waiting for a message, polls that start one RTT
//!   apart and back off to 64 RTTs.
//! * A releasing writer whose CAS found a successor waits T_lease for its
//!   `Successor` message, then drops the lock to recovery (§3.6).
//!
//! Not done, and why: RNIC receive timestamps for the start of a lease (a
//! local clock is read instead, which starts the lease later, on the safe
//! side for the holder's own check and the same for waiters); the
//! intra-node compensation delay of §4.1 (an evaluation device); the
//! optimisation for `RdrCnt = 0` that the paper leaves as future work; DC
//! QP reset after RNR errors (no such state in our fabric: a message to a
//! dead endpoint fails or is lost, and the stall it leaves is recovered).
//!
//! Limits: two recoveries of one lock add 2^64 to `RelCnt` and cancel out,
//! so a waiter that does not look at the entry for longer than the second
//! stall's 3 × T_lease would miss both; waiters look at least every
//! T_lease / 2. `RdrCnt` counts up to 2^23 - 1 readers, mailbox ids must stay
//! below 2^24 and node ids below 2^16 ([`TailPtrError`]).

pub mod client;
pub mod entry;
pub mod message;
pub mod recovery;

pub use client::{ShiftLockClient, ShiftLockConfig, ShiftLockRef, ShiftLockStats, DEFAULT_WRITER_THRESHOLD};
pub use entry::{Entry, Epoch, RelCnt, TailPtr, TailPtrError, ENTRY_ALIGN, ENTRY_BYTES};
pub use message::{PeerMessage, Postbox, RecoveryReply, RecoveryRequest, Wire};
pub use recovery::{EraTable, RecoveryLocator, RecoveryService, RecoveryStats};

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::ShiftLockConfig;

    #[test]
    fn recovery_waits_the_fence_delay_and_giving_up_waits_longer() {
        let c = ShiftLockConfig::from_rtt(Duration::from_micros(2)).with_lease(Duration::from_millis(300));
        assert_eq!(c.fence_delay, Duration::ZERO, "below a file system: the paper's 3 x T_lease");
        assert_eq!(c.stall_timeout(), Duration::from_millis(900).mul_f64(1.0 + c.drift));
        assert_eq!(c.give_up, Duration::from_secs(18));
        let f = c.with_fence_delay(Duration::from_secs(3));
        assert_eq!(f.stall_timeout(), Duration::from_millis(3900).mul_f64(1.0 + c.drift));
        assert!(f.give_up > f.stall_timeout() * 4, "a waiter outlasts several recoveries: {f:?}");
        // The order of the builders does not matter.
        let g = ShiftLockConfig::from_rtt(Duration::from_micros(2))
            .with_fence_delay(Duration::from_secs(3))
            .with_lease(Duration::from_millis(300));
        assert_eq!(g, f);
    }
}
