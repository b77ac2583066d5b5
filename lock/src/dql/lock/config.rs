//! The timing of a DQL client ([`DqlConfig`]): the lease, and every wait
//! of the failure handling derived from it (the beat, X, S, R; see the
//! module comment of [`dql`](crate::dql), "Failures").

use std::time::Duration;

use crate::dql::word::DqlVariant;

/// Timing of one DQL client, derived from the transport's RTT. Every
/// client of one lock must use the same lease.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DqlConfig {
    pub variant: DqlVariant,
    /// The longest a client holds the lock, from acquisition to release.
    /// Every failure timeout below is a fraction or multiple of it.
    pub lease: Duration,
    /// Bound of relative clock drift δ; a wait that others rely on lasts
    /// (1 + δ) times its nominal length.
    pub drift: f64,
    /// First interval between two reads of the tail by a starvation-free
    /// ticket waiting for its turn.
    pub poll: Duration,
    /// Those reads back off exponentially up to this interval.
    pub max_poll: Duration,
    /// Longest an acquisition waits in all before it fails with
    /// [`LockError::Timeout`](crate::rwlock::LockError::Timeout) instead of
    /// hanging (a broken host, say).
    pub give_up: Duration,
    /// How long after a holder's lease ran out the cluster may still need
    /// to fence a silent holder at the servers: the silence S after which
    /// a waiter resets the lock grows by it (see [`dql`](crate::dql),
    /// "Failures"). Zero (the default) below a file system.
    pub fence_delay: Duration,
}

impl DqlConfig {
    /// The floor of [`DqlConfig::from_rtt`]'s lease.
    pub const MIN_LEASE: Duration = Duration::from_secs(1);

    /// The starvation-free variant (§4.4) with a lease of 5000 RTTs (the
    /// ratio of the other locks of this crate: 10 ms on a 2 µs fabric), at
    /// least 1 s because holders are ordinary threads that a busy scheduler
    /// can stall. Turn polls start one RTT apart and back off to 64 RTTs.
    pub fn from_rtt(rtt: Duration) -> Self {
        let lease = (rtt * 5000).max(Self::MIN_LEASE);
        Self {
            variant: DqlVariant::StarvationFree,
            lease,
            drift: 1e-4,
            poll: rtt.max(Duration::from_nanos(100)),
            max_poll: (rtt * 64).max(Duration::from_micros(10)),
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

    /// The same with a fence delay ([`DqlConfig::fence_delay`]); the
    /// give-up time grows by [`GIVE_UP_FENCES`](crate::rwlock::GIVE_UP_FENCES)
    /// of them.
    pub fn with_fence_delay(mut self, fence_delay: Duration) -> Self {
        self.fence_delay = fence_delay;
        self.give_up = crate::rwlock::give_up_after(self.lease, self.fence_delay);
        self
    }

    pub fn with_variant(mut self, variant: DqlVariant) -> Self {
        self.variant = variant;
        self
    }

    fn stretched(&self, d: Duration) -> Duration {
        d.mul_f64(1.0 + self.drift)
    }

    /// How often a waiting client tells its successor it is alive, and
    /// reads the tail to see whether a reset began.
    pub fn beat(&self) -> Duration {
        self.lease / 4
    }

    /// X: a client handed the lock enters only if a read of the tail posted
    /// within X before showed its era open (else it reads again first).
    pub fn fresh_window(&self) -> Duration {
        self.lease / 2
    }

    /// S: how long a waiter hears nothing from its predecessor before it
    /// takes it for dead. A waiting predecessor beats every `beat`; a
    /// holding one releases within its lease; plus a quarter lease for
    /// delivery and scheduling; plus the fence delay, so a holder whose
    /// process stopped is fenced before the reset lets anyone in.
    pub fn silence(&self) -> Duration {
        self.stretched(self.lease + self.beat()) + self.lease / 4 + self.fence_delay
    }

    /// R: how long a reset keeps the tail closed. Every client that entered
    /// before the close leaves within X + lease of it (see
    /// [`dql`](crate::dql)).
    pub fn reset_wait(&self) -> Duration {
        self.stretched(self.fresh_window() + self.lease) + self.lease / 16
    }

    /// How often a client reads a closed tail.
    pub fn closed_poll(&self) -> Duration {
        self.lease / 16
    }

    /// A tail seen closed for this long has lost its resetter: reopen it.
    pub fn abandoned_close(&self) -> Duration {
        self.reset_wait() + self.silence()
    }

    /// A starvation-free ticket that has not swapped into the tail this long
    /// after its turn came is taken for dead and skipped (per ticket).
    pub fn gap(&self) -> Duration {
        self.stretched(self.lease)
    }

    /// The bound the module comment of [`dql`](crate::dql) documents: a
    /// waiter whose predecessor died is back in a fresh queue within this
    /// time of hearing from it last (or of joining behind it).
    pub fn recovery_bound(&self) -> Duration {
        self.silence() + self.reset_wait() + self.closed_poll()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timing_follows_the_lease() {
        let c = DqlConfig::from_rtt(Duration::from_micros(2));
        assert_eq!(c.lease, DqlConfig::MIN_LEASE);
        assert_eq!(c.variant, DqlVariant::StarvationFree);
        assert_eq!(DqlConfig::from_rtt(Duration::from_millis(1)).lease, Duration::from_secs(5));
        let c = c.with_lease(Duration::from_millis(400));
        assert_eq!(c.give_up, Duration::from_secs(24));
        // The waits the safety argument relies on.
        assert!(c.beat() < c.fresh_window());
        assert!(c.silence() > c.lease + c.beat());
        assert!(c.reset_wait() > c.fresh_window() + c.lease);
        assert!(c.abandoned_close() > c.reset_wait());
        // The documented bound: about 3.1 leases.
        let b = c.recovery_bound().as_secs_f64() / c.lease.as_secs_f64();
        assert!((3.0..3.3).contains(&b), "{b}");
    }

    #[test]
    fn the_reset_waits_the_fence_delay() {
        let c = DqlConfig::from_rtt(Duration::from_micros(2)).with_lease(Duration::from_millis(400));
        assert_eq!(c.fence_delay, Duration::ZERO);
        let f = c.with_fence_delay(Duration::from_secs(3));
        assert_eq!(f.silence(), c.silence() + Duration::from_secs(3));
        assert_eq!(f.recovery_bound(), c.recovery_bound() + Duration::from_secs(3));
        // What the holder and the reset rely on does not move.
        assert_eq!(
            (f.beat(), f.fresh_window(), f.reset_wait()),
            (c.beat(), c.fresh_window(), c.reset_wait())
        );
        assert!(f.give_up > f.recovery_bound() * 4, "{f:?}");
        assert_eq!(f, c.with_lease(Duration::from_millis(400)).with_fence_delay(Duration::from_secs(3)));
    }
}
