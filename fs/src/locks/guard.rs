//! The range lock that protects a file's lock records and data (DESIGN.md
//! §4): the cluster's `--range-lock` algorithm (Citron by default) over the
//! file's lock units, opened per operation from the file's [`LockArea`], with
//! timing derived from the transport's RTT under the cluster's shared
//! parameters. Opening one costs no RPC: for a Citron tree that grows, the
//! client's `RangeLockContext` keeps the newest configuration of each tree
//! it has seen, and a stale one is found stale by the lock itself.

use std::sync::Arc;
use std::time::{Duration, Instant};

use citron_lock::lock_host;
use citron_lock::range_lock::{HeldRangeToken, RangeLockClient, RangeLockContext};
use citron_lock::rdma::{Endpoint, Verb, VerbError, VerbReply};
use citron_lock::rwlock::Riders;

use super::area::LockArea;
use super::types::ByteRange;
use crate::error::FsError;

/// Timing and connections of a client's locks.
#[derive(Clone)]
pub struct LockTiming {
    /// Range locks: Citron and DSLR timing, RPC range server connections.
    pub ranges: Arc<RangeLockContext>,
    /// The inode mutex (and other mutexes opened through the factory).
    pub mutex: lock_host::LockTiming,
    /// The cluster's shared parameters these derive from.
    pub cluster: ClusterLockParams,
    pub rtt: Duration,
}

impl std::fmt::Debug for LockTiming {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LockTiming").field("rtt", &self.rtt).field("cluster", &self.cluster).finish()
    }
}

/// Lock parameters every client of a cluster must share (the paper's
/// "globally consistent parameter", §3.5.5): Citron's meet-in-the-middle is
/// only safe if the holder of an internal node waits at least as long as
/// any notifier may take (`T_wait`), and lease-based recovery only if every
/// client agrees on the lease. The meta-server chooses them and hands them
/// to every client at registration; `T_wait` it then follows the slowest
/// client with (see `citron_lock::citron::tuning`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ClusterLockParams {
    /// Citron's `T_wait`, in microseconds: the floor of the published one,
    /// and the value itself when none is published.
    pub t_wait_us: u64,
    /// The lease of Citron nodes and DSLR tickets, in milliseconds.
    pub lease_ms: u64,
    /// How long after a holder's lock lease ran out the meta-server may
    /// still need to fence that holder, in milliseconds: every lock waits
    /// this much longer before it takes a silent holder over (see
    /// [`fence_delay_for`]). The meta-server sets it from its client lease.
    pub fence_delay_ms: u64,
    /// Where the meta-server publishes the cluster's `T_wait` (lock memory).
    pub published_t_wait: Option<citron_lock::rdma::RemoteAddr>,
}

/// How often the meta-server's reaper looks for clients whose lease ran
/// out (and fences them), for a client lease `client_lease`.
pub fn reaper_tick(client_lease: Duration) -> Duration {
    (client_lease / 4).max(Duration::from_millis(20))
}

/// The fence delay of a cluster whose client lease is `client_lease`:
/// the client lease, plus one tick of the reaper that fences, plus a
/// margin of a quarter lease (a renewal in flight, the fence's own work,
/// clock drift).
///
/// # Why no lock is recovered before its holder is fenced
///
/// Two deadlines where each lock algorithm had one lease:
///
/// 1. **The holder bound H = the lock lease.** A holder acts under its lock
///    only while the lease since its acquisition has not run out: the lock
///    algorithms' late-release guards, and the file system's data paths,
///    which check the age of their range hold before each batch of data
///    verbs ([`RangeHold::within_lease`]) and, past H, let it go and do the
///    operation again under a fresh acquisition.
/// 2. **The takeover threshold = the algorithm's own + the fence delay.**
///    A waiter takes a silent holder over only after the algorithm's
///    multiple of the lease (Citron 3/2, DSLR 2, ShiftLock 3, ...) *plus*
///    this delay.
///
/// A holder checks H at time t ≤ acq + H, then its whole process stops (a
/// SIGSTOP, a descheduled VM). Its last lease renewal reached the
/// meta-server no later than about t, so the reaper fences it (every NIC
/// of a keyed cluster then refuses its verbs, and its lock records go) by
/// t + client lease + tick ≤ acq + H + fence delay − margin. Takeovers
/// come no earlier than acq + H + fence delay (the algorithms' thresholds
/// already leave H, and more, after the holder's last sign of life). So
/// the stopped holder's verbs reach the servers either before anyone
/// takes the lock over (it resumed before its fence) or never (refused):
/// they never land inside another holder's critical section.
///
/// Not covered: a *thread* that stalls between its check and its verbs
/// while its process keeps renewing the lease. Nothing fences it, and its
/// verbs would land late; H is then the only bound, as before. Nor is the
/// shm backend, where a client stores into mapped server memory that no
/// server can revoke (and an unkeyed tcp cluster, whose NICs enforce no
/// grants).
///
/// The price: a dead holder's lock is taken over that much later (with
/// the defaults, 1.5 s + 5 + 1.25 + 1.25 s ≈ 9 s for Citron instead of
/// 1.5 s; with the tests' 2 s client lease, 1.5 + 2 + 0.5 + 0.5 = 4.5 s).
pub fn fence_delay_for(client_lease: Duration) -> Duration {
    client_lease + reaper_tick(client_lease) + client_lease / 4
}

impl ClusterLockParams {
    /// The fence delay as a duration.
    pub fn fence_delay(&self) -> Duration {
        Duration::from_millis(self.fence_delay_ms)
    }

    /// The same parameters with a fence delay of at least
    /// [`fence_delay_for`]`(client_lease)`.
    pub fn fenced_within(self, client_lease: Duration) -> Self {
        let needed = fence_delay_for(client_lease).as_millis() as u64;
        Self { fence_delay_ms: self.fence_delay_ms.max(needed), ..self }
    }
}

/// The Citron `T_wait` a client `rtt` away needs: the two round trips
/// between t1 and t2 (the read of the ancestors, then the batch that locks
/// and notifies), with 2.5 round trips reserved for each, as the paper
/// reserves 5 µs per 2 µs RTT (§3.5.5).
pub fn needed_t_wait(rtt: Duration) -> Duration {
    rtt * 5
}

impl Default for ClusterLockParams {
    /// `T_wait` must cover three round trips plus the client's own work
    /// between t1 and t2. The paper's 15 µs is for a 2 µs RDMA RTT; the tcp
    /// software NIC on a loaded host takes tens of µs per round trip, and a
    /// thread can be descheduled between two verbs, so 200 µs: it costs only
    /// requests that must wait for descendants (internal nodes whose child
    /// leaves were busy). The lease is the floor the lock crate already uses.
    fn default() -> Self {
        Self { t_wait_us: 200, lease_ms: 1000, fence_delay_ms: 0, published_t_wait: None }
    }
}

impl LockTiming {
    /// Timing for a client whose round trip to lock memory is `rtt`, under
    /// the cluster's shared parameters.
    pub fn new(rtt: Duration, cluster: ClusterLockParams) -> Self {
        Self::new_as(rtt, cluster, citron_rpc::auth::Credentials::anonymous())
    }

    /// [`LockTiming::new`] for a client whose connections to range lock
    /// servers prove `credentials` (its node's).
    pub fn new_as(
        rtt: Duration,
        cluster: ClusterLockParams,
        credentials: citron_rpc::auth::Credentials,
    ) -> Self {
        let lease = Duration::from_millis(cluster.lease_ms);
        let fence = cluster.fence_delay();
        let mut ranges = RangeLockContext::from_rtt(rtt).with_credentials(credentials);
        ranges.citron.t_wait = Duration::from_micros(cluster.t_wait_us);
        ranges.citron.published_t_wait = cluster.published_t_wait;
        ranges.citron.lease = lease;
        ranges.citron = ranges.citron.with_fence_delay(fence);
        ranges.dslr = ranges.dslr.with_lease(lease).with_fence_delay(fence);
        Self {
            ranges: Arc::new(ranges),
            mutex: lock_host::LockTiming::from_rtt(rtt).with_lease(lease).with_fence_delay(fence),
            cluster,
            rtt,
        }
    }

    /// H: how long after its acquisition a range hold may still issue data
    /// verbs (the lock lease; see [`fence_delay_for`]).
    pub fn hold_lease(&self) -> Duration {
        Duration::from_millis(self.cluster.lease_ms)
    }
}

/// How a range hold was given back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Released {
    /// Within the lock's lease, as usual.
    OnTime,
    /// After the lock's own on-time bound: the lock cannot tell whether a
    /// recovery took it over meanwhile ([`LockError::Fenced`]), and changed
    /// only what it could tell was still its own.
    ///
    /// [`LockError::Fenced`]: citron_lock::rwlock::LockError::Fenced
    Late,
}

/// A range lock opened ahead of its acquisition ([`RangeHold::plan`]).
pub struct RangePlan {
    client: Box<dyn RangeLockClient>,
    /// The reads to post ahead (none: nothing to gain).
    pub early: Vec<Verb>,
}

/// A held range lock over some bytes of one file.
pub struct RangeHold {
    client: Box<dyn RangeLockClient>,
    held: Option<HeldRangeToken>,
    bytes: ByteRange,
    /// When the hold's lease H runs out: H after the acquisition returned.
    /// The lock's own lease starts a little earlier (inside the
    /// acquisition), which the fence delay's margin covers.
    until: Instant,
}

impl RangeHold {
    /// Locks the units covering `bytes` (blocking until granted).
    pub fn acquire(
        ep: &Endpoint,
        area: &LockArea,
        timing: &LockTiming,
        bytes: ByteRange,
    ) -> Result<Self, FsError> {
        Ok(Self::acquire_with_reads(ep, area, timing, bytes, &[])?.0)
    }

    /// [`RangeHold::acquire`], with `riders` (reads of lock memory behind
    /// `ep`) in the batch that takes the range where the range lock can
    /// ([`RangeLockClient::acquire_with_reads`]): their replies, as if read
    /// under the hold, or `None`: read them again.
    pub fn acquire_with_reads(
        ep: &Endpoint,
        area: &LockArea,
        timing: &LockTiming,
        bytes: ByteRange,
        riders: &[Verb],
    ) -> Result<(Self, Riders), FsError> {
        let client = timing.ranges.client(&area.range)?;
        Self::acquire_on(client, ep, area, timing, bytes, riders)
    }

    fn acquire_on(
        mut client: Box<dyn RangeLockClient>,
        ep: &Endpoint,
        area: &LockArea,
        timing: &LockTiming,
        bytes: ByteRange,
        riders: &[Verb],
    ) -> Result<(Self, Riders), FsError> {
        let (l, r) = area.units(bytes);
        let (held, replies) = client.acquire_with_reads(ep, l, r, riders)?;
        let until = Instant::now() + timing.hold_lease();
        Ok((Self { client, held: Some(held), bytes, until }, replies))
    }

    /// Opens the range lock of `area` for an acquisition of about `bytes`
    /// to come, with the reads it would make first
    /// ([`RangeLockClient::early_reads`]) for the caller to post ahead.
    pub fn plan(area: &LockArea, timing: &LockTiming, bytes: ByteRange) -> Result<RangePlan, FsError> {
        let mut client = timing.ranges.client(&area.range)?;
        let (l, r) = area.units(bytes);
        let early = client.early_reads(l, r);
        Ok(RangePlan { client, early })
    }

    /// [`RangeHold::acquire`] of `bytes` through `plan`, whose early reads
    /// answered `early` (posted at the instant given), if the caller's
    /// batch carried them.
    pub fn acquire_planned(
        ep: &Endpoint,
        area: &LockArea,
        timing: &LockTiming,
        bytes: ByteRange,
        mut plan: RangePlan,
        early: Option<(Instant, &[Result<VerbReply, VerbError>])>,
    ) -> Result<Self, FsError> {
        plan.client.early_replies(early);
        Ok(Self::acquire_on(plan.client, ep, area, timing, bytes, &[])?.0)
    }

    /// The bytes this hold covers (the request; the units may cover more).
    pub fn bytes(&self) -> ByteRange {
        self.bytes
    }

    /// When the hold's lease H runs out; no data verb may be posted under
    /// it after that ([`fence_delay_for`]).
    pub fn until(&self) -> Instant {
        self.until
    }

    /// Whether the hold is still within its lease H (one clock read).
    pub fn within_lease(&self) -> bool {
        Instant::now() < self.until
    }

    pub fn release(self, ep: &Endpoint) -> Result<(), FsError> {
        self.release_after(ep, &[])
    }

    /// Posts `verbs` (writes to lock memory made under the hold, on the
    /// same endpoint) and releases, in the range lock's release batch
    /// where it has one ([`RangeLockClient::release_after`]): the writes
    /// execute before the release verbs, so the next holder sees them.
    pub fn release_after(mut self, ep: &Endpoint, verbs: &[Verb]) -> Result<(), FsError> {
        match self.held.take() {
            Some(h) => Ok(self.client.release_after(ep, h, verbs)?),
            None => Ok(citron_lock::rwlock::execute_all(ep, verbs)?),
        }
    }

    /// [`RangeHold::release`] for a hold whose data verbs all went out
    /// within its lease H: a release the lock calls late
    /// ([`LockError::Fenced`](citron_lock::rwlock::LockError::Fenced)) is
    /// then no failure of the operation, since with the fence delay no
    /// takeover can have come before those verbs landed (or were refused,
    /// see [`fence_delay_for`]); it says [`Released::Late`].
    pub fn release_after_verbs(self, ep: &Endpoint) -> Result<Released, FsError> {
        self.release_after_verbs_then(ep, &[])
    }

    /// [`RangeHold::release_after_verbs`], with `after` (what the caller
    /// posts next on `ep`) at the end of the release's batch where the
    /// range lock allows ([`RangeLockClient::release_around`]).
    pub fn release_after_verbs_then(mut self, ep: &Endpoint, after: &[Verb]) -> Result<Released, FsError> {
        let Some(h) = self.held.take() else {
            citron_lock::rwlock::execute_all(ep, after)?;
            return Ok(Released::OnTime);
        };
        match self.client.release_around(ep, h, &[], after) {
            Ok(()) => Ok(Released::OnTime),
            Err(citron_lock::rwlock::LockError::Fenced) => Ok(Released::Late),
            Err(e) => Err(e.into()),
        }
    }
}

impl Drop for RangeHold {
    fn drop(&mut self) {
        if self.held.is_some() {
            // Dropped on an error path without `release`: the lease recovery
            // of the range lock frees it; say so, since it costs waiters.
            log::warn!("a range lock over {:?} was dropped without release", self.bytes);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fence_delay_covers_the_client_lease_a_reaper_tick_and_a_margin() {
        // The tests' 2 s client lease: fenced within 2 + 0.5 s of the last
        // renewal, and 0.5 s of margin.
        assert_eq!(reaper_tick(Duration::from_secs(2)), Duration::from_millis(500));
        assert_eq!(fence_delay_for(Duration::from_secs(2)), Duration::from_secs(3));
        // The default 5 s lease.
        assert_eq!(fence_delay_for(Duration::from_secs(5)), Duration::from_millis(7500));
        // The reaper ticks at least every 20 ms.
        assert_eq!(reaper_tick(Duration::from_millis(40)), Duration::from_millis(20));
        assert_eq!(fence_delay_for(Duration::from_millis(40)), Duration::from_millis(70));
    }

    #[test]
    fn the_meta_server_fills_the_fence_delay_and_never_lowers_it() {
        let p = ClusterLockParams::default();
        assert_eq!(p.fence_delay(), Duration::ZERO, "lock crate defaults until a meta-server says");
        let f = p.fenced_within(Duration::from_secs(2));
        assert_eq!(f.fence_delay(), Duration::from_secs(3));
        assert_eq!(f.lease_ms, p.lease_ms, "the holder bound H is the lock lease, unchanged");
        let chosen = ClusterLockParams { fence_delay_ms: 10_000, ..p };
        assert_eq!(chosen.fenced_within(Duration::from_secs(2)).fence_delay_ms, 10_000);
    }

    #[test]
    fn lock_timing_hands_the_fence_delay_to_every_algorithm() {
        let p = ClusterLockParams { lease_ms: 1000, ..ClusterLockParams::default() }
            .fenced_within(Duration::from_secs(2));
        let t = LockTiming::new(Duration::from_micros(20), p);
        assert_eq!(t.hold_lease(), Duration::from_secs(1));
        assert_eq!(t.ranges.citron.fence_delay, Duration::from_secs(3));
        assert_eq!(t.ranges.citron.takeover_stall(), Duration::from_millis(4500));
        assert_eq!(t.ranges.dslr.fence_delay, Duration::from_secs(3));
        assert_eq!(t.ranges.dslr.silence(1), Duration::from_secs(5));
        assert_eq!(t.mutex.fence_delay, Duration::from_secs(3));
        assert_eq!(t.mutex.lease, Some(Duration::from_secs(1)));
    }
}
