//! The timing and tunables of a ShiftLock client ([`ShiftLockConfig`]):
//! T_lease and the stall timeout of §3.6, the polls, and the writer
//! threshold N of §3.5.2.

use std::time::Duration;

/// The paper's maximum number of consecutive writer handovers, N (§3.5.2, §4.7).
pub const DEFAULT_WRITER_THRESHOLD: u32 = 16;

/// Timing and tunables of the protocol.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ShiftLockConfig {
    /// T_lease (§3.6): the longest a client holds the lock, from acquisition
    /// to release. A waiter that sees `RelCnt` stand still for 3 × T_lease
    /// asks the lock host to recover the lock.
    pub lease: Duration,
    /// Bound of relative clock drift δ; every wait for T lasts (1 + δ) T.
    pub drift: f64,
    /// First interval between two polls of the entry (Alg. 2 lines 5, 18, 24).
    pub poll: Duration,
    /// Polls back off exponentially up to this interval.
    pub max_poll: Duration,
    /// N: a writer that has been handed the lock this many times in a row
    /// gives it to the readers instead (Alg. 3 line 15).
    pub writer_threshold: u32,
    /// Longest an acquisition may wait in all before it fails with
    /// [`LockError::Timeout`](crate::rwlock::LockError::Timeout) instead of
    /// hanging (a broken host, say).
    pub give_up: Duration,
    /// How long after a holder's lease ran out the cluster may still need
    /// to fence a silent holder at the servers. A waiter asks for the §3.6
    /// recovery only after `RelCnt` stood still for 3 × T_lease plus this,
    /// so no lock is recovered before its holder is fenced. The holders'
    /// guards (a release within T_lease of the lease start is an ordinary
    /// one) are unchanged: every waiter's stall timer still starts no
    /// earlier than the holder's lease did, and now runs longer. Zero (the
    /// default) below a file system.
    pub fence_delay: Duration,
}

impl ShiftLockConfig {
    /// The paper's parameters scaled to this transport's round-trip time.
    ///
    /// The paper's 10 ms lease is 5000 RTTs of 2 µs; we keep the ratio but
    /// never go below 1 s, because a holder here is a thread of an ordinary
    /// process that the scheduler may stall for many milliseconds (the same
    /// floor as Citron's lease). Polls start at one RTT apart, a waiter's
    /// read costing about one RTT itself, and back off to 64 RTTs.
    pub fn from_rtt(rtt: Duration) -> Self {
        let lease = (rtt * 5000).max(Duration::from_secs(1));
        Self {
            lease,
            drift: 1e-4,
            poll: rtt,
            max_poll: rtt * 64,
            writer_threshold: DEFAULT_WRITER_THRESHOLD,
            give_up: crate::rwlock::give_up_after(lease, Duration::ZERO),
            fence_delay: Duration::ZERO,
        }
    }

    /// The same with lease `lease` (and a give-up time scaled with it).
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self.give_up = crate::rwlock::give_up_after(self.lease, self.fence_delay);
        self
    }

    /// The same with a fence delay ([`ShiftLockConfig::fence_delay`]); the
    /// give-up time grows by [`GIVE_UP_FENCES`](crate::rwlock::GIVE_UP_FENCES)
    /// of them, so it stays far beyond a recovery (3 × T_lease + fence delay).
    pub fn with_fence_delay(mut self, fence_delay: Duration) -> Self {
        self.fence_delay = fence_delay;
        self.give_up = crate::rwlock::give_up_after(self.lease, self.fence_delay);
        self
    }

    /// `d` stretched by the clock drift bound (§3.6, "assumptions for timing").
    pub(super) fn stretched(&self, d: Duration) -> Duration {
        d.mul_f64(1.0 + self.drift)
    }

    /// How long `RelCnt` may stand still before a waiter suspects a failure:
    /// 3 × T_lease (§3.6), plus the fence delay.
    pub fn stall_timeout(&self) -> Duration {
        self.stretched(self.lease * 3 + self.fence_delay)
    }

    /// How often a waiter that is not polling anyway looks at `RelCnt`.
    pub(super) fn check_period(&self) -> Duration {
        self.lease / 2
    }
}
