//! The range lock that protects a file's lock records and data (DESIGN.md
//! §4): the cluster's `--range-lock` algorithm (Citron by default) over the
//! file's lock units, opened per operation from the file's [`LockArea`], with
//! timing derived from the transport's RTT under the cluster's shared
//! parameters. Opening one costs no RPC: for a Citron tree that grows, the
//! client's `RangeLockContext` keeps the newest configuration of each tree
//! it has seen, and a stale one is found stale by the lock itself.

use std::sync::Arc;
use std::time::Duration;

use citron_lock::lock_host;
use citron_lock::range_lock::{HeldRangeToken, RangeLockClient, RangeLockContext};
use citron_lock::rdma::Endpoint;

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
    /// Where the meta-server publishes the cluster's `T_wait` (lock memory).
    pub published_t_wait: Option<citron_lock::rdma::RemoteAddr>,
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
        Self { t_wait_us: 200, lease_ms: 1000, published_t_wait: None }
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
        let mut ranges = RangeLockContext::from_rtt(rtt).with_credentials(credentials);
        ranges.citron.t_wait = Duration::from_micros(cluster.t_wait_us);
        ranges.citron.published_t_wait = cluster.published_t_wait;
        ranges.citron.lease = lease;
        ranges.dslr = ranges.dslr.with_lease(lease);
        Self {
            ranges: Arc::new(ranges),
            mutex: lock_host::LockTiming::from_rtt(rtt).with_lease(lease),
            cluster,
            rtt,
        }
    }
}

/// A held range lock over some bytes of one file.
pub struct RangeHold {
    client: Box<dyn RangeLockClient>,
    held: Option<HeldRangeToken>,
    bytes: ByteRange,
}

impl RangeHold {
    /// Locks the units covering `bytes` (blocking until granted).
    pub fn acquire(
        ep: &Endpoint,
        area: &LockArea,
        timing: &LockTiming,
        bytes: ByteRange,
    ) -> Result<Self, FsError> {
        let mut client = timing.ranges.client(&area.range)?;
        let (l, r) = area.units(bytes);
        let held = client.acquire(ep, l, r)?;
        Ok(Self { client, held: Some(held), bytes })
    }

    /// The bytes this hold covers (the request; the units may cover more).
    pub fn bytes(&self) -> ByteRange {
        self.bytes
    }

    pub fn release(mut self, ep: &Endpoint) -> Result<(), FsError> {
        match self.held.take() {
            Some(h) => Ok(self.client.release(ep, h)?),
            None => Ok(()),
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
