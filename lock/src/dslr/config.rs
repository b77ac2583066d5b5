//! What a DSLR client is tuned with: its timing ([`DslrConfig`]: ω, the
//! lease and the fence delay, derived from the RTT) and the limits every
//! client of one lock must agree on ([`DslrLimits`]: §4.9's `COUNT_MAX`,
//! §5.1's largest `k`).

use std::time::Duration;

use super::backoff::RandomBackoff;
use super::word::COUNT_MAX;
use crate::rwlock::LockError;

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

    /// ω = 2.5 RTT, lease = max(5000 RTT, 1 s): see the module comment of
    /// [`super`].
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
    pub(super) fn poll_cap(&self) -> Duration {
        self.lease / 16
    }

    /// Appendix A.3's R and L.
    pub(super) fn backoff(&self) -> RandomBackoff {
        let base = self.omega * 2;
        RandomBackoff::new(base, (base * 1000).min(self.lease))
    }
}

/// What every client of one lock must agree on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DslrLimits {
    pub(super) count_max: u16,
    pub(super) max_slots: u16,
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
