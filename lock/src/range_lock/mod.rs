//! One interface for exclusive range locks, so the file system
//! (`--range-lock citron|segments|rpc`, one lock instance per file) and the
//! benchmarks (`citronfs bench ranges`, citron-fast23.md §4.2) can switch
//! algorithms by name:
//!
//! | algorithm | [`RangeAlgorithm`] | paper | server CPU on the lock path |
//! |---|---|---|---|
//! | Citron's lock tree | `citron` | §3 | no (one-sided verbs) |
//! | static segmentation, a DSLR mutex per segment ([`segments`]) | `segments` | SS, §2.2 / Table 1 | no |
//! | centralised server with an interval tree ([`rpc`]) | `rpc` | type I, §4.1 | yes |
//!
//! Ranges are `[start, end)` of abstract lock units (the file system's
//! granules); `end = u64::MAX` means "to infinity" and works with every
//! algorithm. Ranges are exclusive. A client (one per thread and lock
//! instance, like [`crate::rwlock::RwLockClient`]) may hold several disjoint
//! ranges at once; each `acquire` returns a [`HeldRangeToken`] that its
//! `release` consumes.
//!
//! ```text
//!   let ctx = RangeLockContext::from_rtt(rtt);           // once per process
//!   let mut lock = ctx.client(&site)?;                    // site: where the file's lock lives
//!   {
//!       let _g = RangeGuard::acquire(&mut *lock, &ep, first_granule, end_granule)?;
//!       ... I/O on the granules ...
//!   }                                                     // released on drop
//! ```
//!
//! Where an instance lives is a [`RangeLockSite`] (serialisable, for the
//! open reply): its lock memory for the one-sided algorithms, the server and
//! instance id for `rpc`. [`RangeLockSite::bytes`] says how much lock memory
//! the host must allocate (zeroed memory is an idle lock).
//!
//! Choices:
//! * **Citron and "to infinity".** A range reaching past the tree's `N` takes
//!   the spillover mutex, which guards all of `[N, ∞)`, so `[s, ∞)` is locked
//!   by asking Citron for `[s, max(s, N) + 1)`: the same mutual exclusion,
//!   but the right border OR-ed into the maximizer (§3.9.1) is "one unit past
//!   the tree" instead of `u64::MAX`, which a scale-up would read as a demand
//!   for the largest tree there is.
//! * **Citron's spillover** is a DSLR word (the paper's choice, §3.3); a
//!   Citron client holds at most one range that crosses `N` at a time (one
//!   DSLR handle), which is what one file-system operation needs.
//! * **Citron trees that grow** ([`RangeLockSite::CitronHosted`]): the tree
//!   lives on a lock host ([`crate::citron::host::LockMemoryHost`] behind a
//!   [`crate::citron::host::TreeHostServer`]) that runs its scale-ups; the
//!   site names the tree as created (address, depth), its spillover word,
//!   the host and the instance. Clients scale up after spillover
//!   acquisitions ([`ScalePolicy::AfterSpillover`]), which the host does for
//!   them (one RPC), up to the site's depth cap. Opening a client costs no
//!   RPC: the context keeps the newest configuration any of its clients has
//!   seen for each scaled instance ([`RangeLockContext`]), and a client
//!   that starts from an older one (or from the site's unscaled tree) finds
//!   its root superseded and asks the host once (Alg. 2 lines 15 and 33).

pub mod interval_tree;
pub mod rpc;
pub mod segments;

use std::collections::HashMap;
use std::fmt;
use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::citron::geometry::TreeGeometry;
use crate::citron::host::{InstanceId, RemoteTreeHost, TreeHost, TreeHostRpc};
use crate::citron::lock::{CitronClient, CitronConfig, CitronLayout, HeldRange, ScalePolicy};
use crate::citron::tree::TreeShape;
use crate::dslr::{DslrConfig, DslrLock, DSLR_BYTES};
use crate::rdma::{Endpoint, RemoteAddr, Verb, VerbError, VerbReply};
use crate::rwlock::{LockError, Riders};
use rpc::{RangeInstanceId, RangeRpc, RpcGrant, RpcRangeClient, RpcRangeConfig};
use segments::{SegmentClient, SegmentLayout, SegmentsHeld};

/// The selectable range lock algorithms (`--range-lock`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum RangeAlgorithm {
    Citron,
    Segments,
    Rpc,
}

impl RangeAlgorithm {
    pub const ALL: [RangeAlgorithm; 3] =
        [RangeAlgorithm::Citron, RangeAlgorithm::Segments, RangeAlgorithm::Rpc];

    pub fn name(self) -> &'static str {
        match self {
            RangeAlgorithm::Citron => "citron",
            RangeAlgorithm::Segments => "segments",
            RangeAlgorithm::Rpc => "rpc",
        }
    }
}

impl fmt::Display for RangeAlgorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for RangeAlgorithm {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        RangeAlgorithm::ALL
            .into_iter()
            .find(|a| a.name() == s)
            .ok_or_else(|| format!("unknown range lock algorithm {s:?}; one of citron, segments, rpc"))
    }
}

/// What the algorithm holds for one granted range.
#[derive(Debug)]
enum HeldBy {
    Citron(HeldRange),
    Segments(SegmentsHeld),
    Rpc(RpcGrant),
}

/// A range held through a [`RangeLockClient`]; give it back with
/// [`RangeLockClient::release`] on the same client (or use [`RangeGuard`]).
#[derive(Debug)]
#[must_use = "a held range must be released"]
pub struct HeldRangeToken {
    start: u64,
    end: u64,
    held: HeldBy,
}

impl HeldRangeToken {
    pub fn start(&self) -> u64 {
        self.start
    }

    /// One past the last unit; `u64::MAX` for "to infinity".
    pub fn end(&self) -> u64 {
        self.end
    }

    pub fn algorithm(&self) -> RangeAlgorithm {
        match self.held {
            HeldBy::Citron(_) => RangeAlgorithm::Citron,
            HeldBy::Segments(_) => RangeAlgorithm::Segments,
            HeldBy::Rpc(_) => RangeAlgorithm::Rpc,
        }
    }
}

/// What a client did, in terms every algorithm can fill (zero where a field
/// does not apply).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RangeLockStats {
    pub acquisitions: u64,
    /// Citron: node acquisitions aborted by Inequation (1) or a scale-up and
    /// retried (§4.7's abort count).
    pub aborts: u64,
    /// Citron: multi-node requests started over rather than wait holding.
    pub restarts: u64,
    /// Segments: mutexes taken. Citron: leaves escalated to their parents.
    pub mutexes: u64,
    /// Segments: mutexes that had to wait. RPC: acquisitions whose wait
    /// outlasted one call.
    pub waits: u64,
    /// RPC: calls to the server (round trips; no verbs are used).
    pub rpc_calls: u64,
}

impl std::ops::AddAssign for RangeLockStats {
    fn add_assign(&mut self, o: Self) {
        self.acquisitions += o.acquisitions;
        self.aborts += o.aborts;
        self.restarts += o.restarts;
        self.mutexes += o.mutexes;
        self.waits += o.waits;
        self.rpc_calls += o.rpc_calls;
    }
}

/// One client's handle to one exclusive range lock instance.
///
/// Used by one thread at a time (`Send`, not shared). Verbs go through the
/// caller's [`Endpoint`], so they are counted there (the `rpc` algorithm uses
/// none; it counts its calls in [`RangeLockStats::rpc_calls`]).
pub trait RangeLockClient: Send {
    fn algorithm(&self) -> RangeAlgorithm;
    /// Blocks (bounded by the algorithm's give-up time) until units
    /// `[start, end)` are held; `end = u64::MAX` is "to infinity".
    fn acquire(&mut self, ep: &Endpoint, start: u64, end: u64) -> Result<HeldRangeToken, LockError>;
    /// Releases a range this client acquired.
    fn release(&mut self, ep: &Endpoint, held: HeldRangeToken) -> Result<(), LockError>;
    fn stats(&self) -> RangeLockStats;

    /// Posts `verbs` (writes made under the range, on lock memory of the
    /// same endpoint) and then releases the range
    /// ([`RangeLockClient::release_around`] with nothing after).
    fn release_after(
        &mut self,
        ep: &Endpoint,
        held: HeldRangeToken,
        verbs: &[Verb],
    ) -> Result<(), LockError> {
        self.release_around(ep, held, verbs, &[])
    }

    /// Posts `before` (writes made under the range, on lock memory of the
    /// same endpoint), releases the range, then posts `after` (what the
    /// caller does next on that endpoint, such as releasing another
    /// lock). An algorithm whose release is one batch of verbs puts
    /// `before` first in that batch and `after` last: one endpoint's verbs
    /// execute in order, so whoever gets the range next sees `before`, and
    /// `after` runs once the range is released, exactly as with the three
    /// waited for one after another, which the default does. A refused verb
    /// fails the call; the range is released all the same.
    fn release_around(
        &mut self,
        ep: &Endpoint,
        held: HeldRangeToken,
        before: &[Verb],
        after: &[Verb],
    ) -> Result<(), LockError> {
        let posted = crate::rwlock::execute_all(ep, before);
        let released = self.release(ep, held);
        let then = crate::rwlock::execute_all(ep, after);
        posted.and(released).and(then)
    }

    /// [`RangeLockClient::acquire`], with `riders` (reads of memory behind
    /// the same endpoint) posted in the batch that takes the range where
    /// the algorithm can tell that batch took it: their replies then,
    /// `None` otherwise (the default), and the caller reads them itself.
    /// The replies are as reads posted after the acquisition would have
    /// answered (the argument is the algorithm's).
    fn acquire_with_reads(
        &mut self,
        ep: &Endpoint,
        start: u64,
        end: u64,
        riders: &[Verb],
    ) -> Result<(HeldRangeToken, Riders), LockError> {
        let _ = riders;
        Ok((self.acquire(ep, start, end)?, None))
    }

    /// Reads the algorithm would make first when acquiring `[start, end)`,
    /// for the caller to post ahead, in a batch it waits for anyway on the
    /// same endpoint; their replies go to [`RangeLockClient::early_replies`]
    /// before the acquisition. Empty (the default) when there are none.
    fn early_reads(&mut self, start: u64, end: u64) -> Vec<Verb> {
        let _ = (start, end);
        Vec::new()
    }

    /// The replies of [`RangeLockClient::early_reads`] and when their
    /// batch was posted; `None`: they were not answered.
    fn early_replies(&mut self, early: Option<(Instant, &[Result<VerbReply, VerbError>])>) {
        let _ = early;
    }
}

fn check_range(start: u64, end: u64) -> Result<(), LockError> {
    if start >= end {
        return Err(LockError::Misuse("empty range: start must be below end"));
    }
    Ok(())
}

/// Citron (§3) behind the interface.
pub struct CitronRangeClient {
    inner: CitronClient,
    /// Where to leave newer configurations for the next client.
    cache: Option<CachedTree>,
}

/// A client's link to its context's cache entry for its instance.
struct CachedTree {
    cache: Arc<TreeGeometries>,
    key: TreeKey,
    /// The version the cache holds (as far as this client knows).
    version: u64,
}

impl CitronRangeClient {
    pub fn new(inner: CitronClient) -> Self {
        Self { inner, cache: None }
    }

    pub fn inner(&self) -> &CitronClient {
        &self.inner
    }

    /// After an acquisition or release: a configuration newer than the one
    /// the cache had goes there, for the next client of the instance.
    fn remember(&mut self) {
        if let Some(c) = &mut self.cache {
            let g = self.inner.geometry();
            if g.version > c.version {
                c.version = g.version;
                c.cache.store(c.key, g);
            }
        }
    }
}

impl RangeLockClient for CitronRangeClient {
    fn algorithm(&self) -> RangeAlgorithm {
        RangeAlgorithm::Citron
    }

    fn acquire(&mut self, ep: &Endpoint, start: u64, end: u64) -> Result<HeldRangeToken, LockError> {
        check_range(start, end)?;
        // Nothing read early is used by a plain acquisition.
        self.inner.early_replies(None);
        // "To infinity": see the module comment.
        let held = if end == u64::MAX {
            self.inner.acquire_to_end(ep, start)
        } else {
            self.inner.acquire(ep, start, end)
        };
        self.remember();
        Ok(HeldRangeToken { start, end, held: HeldBy::Citron(held?) })
    }

    fn release(&mut self, ep: &Endpoint, held: HeldRangeToken) -> Result<(), LockError> {
        self.release_after(ep, held, &[])
    }

    /// The ancestors of a range of one leaf ([`CitronClient::early_reads`]).
    fn early_reads(&mut self, start: u64, end: u64) -> Vec<Verb> {
        if end == u64::MAX {
            return Vec::new();
        }
        self.inner.early_reads(start, end)
    }

    fn early_replies(&mut self, early: Option<(Instant, &[Result<VerbReply, VerbError>])>) {
        self.inner.early_replies(early);
    }

    /// Riders of a range of one tree node go in its Steps 2(c)+(d) batch
    /// ([`CitronClient::acquire_with_reads`]).
    fn acquire_with_reads(
        &mut self,
        ep: &Endpoint,
        start: u64,
        end: u64,
        riders: &[Verb],
    ) -> Result<(HeldRangeToken, Riders), LockError> {
        check_range(start, end)?;
        if end == u64::MAX {
            return Ok((self.acquire(ep, start, end)?, None));
        }
        let held = self.inner.acquire_with_reads(ep, start, end, riders);
        self.remember();
        let (held, replies) = held?;
        Ok((HeldRangeToken { start, end, held: HeldBy::Citron(held) }, replies))
    }

    /// Algorithm 3's batch, with `before` first in it and `after` last
    /// ([`CitronClient::release_around`]).
    fn release_around(
        &mut self,
        ep: &Endpoint,
        held: HeldRangeToken,
        before: &[Verb],
        after: &[Verb],
    ) -> Result<(), LockError> {
        let released = match held.held {
            HeldBy::Citron(h) => self.inner.release_around(ep, h, before.to_vec(), after.to_vec()),
            _ => Err(LockError::Misuse("a token of another range lock released on a Citron client")),
        };
        self.remember();
        released
    }

    fn stats(&self) -> RangeLockStats {
        let s = self.inner.stats();
        RangeLockStats {
            acquisitions: s.acquisitions,
            aborts: s.aborts,
            restarts: s.restarts,
            mutexes: s.leaf_escalations,
            ..Default::default()
        }
    }
}

impl RangeLockClient for SegmentClient {
    fn algorithm(&self) -> RangeAlgorithm {
        RangeAlgorithm::Segments
    }

    fn acquire(&mut self, ep: &Endpoint, start: u64, end: u64) -> Result<HeldRangeToken, LockError> {
        check_range(start, end)?;
        let held = SegmentClient::acquire(self, ep, start, end)?;
        Ok(HeldRangeToken { start, end, held: HeldBy::Segments(held) })
    }

    fn release(&mut self, ep: &Endpoint, held: HeldRangeToken) -> Result<(), LockError> {
        match held.held {
            HeldBy::Segments(h) => SegmentClient::release(self, ep, h),
            _ => Err(LockError::Misuse("a token of another range lock released on a segments client")),
        }
    }

    fn stats(&self) -> RangeLockStats {
        let s = SegmentClient::stats(self);
        RangeLockStats {
            acquisitions: s.acquisitions,
            mutexes: s.mutexes,
            waits: s.conflicts,
            ..Default::default()
        }
    }
}

impl RangeLockClient for RpcRangeClient {
    fn algorithm(&self) -> RangeAlgorithm {
        RangeAlgorithm::Rpc
    }

    fn acquire(&mut self, _ep: &Endpoint, start: u64, end: u64) -> Result<HeldRangeToken, LockError> {
        check_range(start, end)?;
        let grant = RpcRangeClient::acquire(self, start, end)?;
        Ok(HeldRangeToken { start, end, held: HeldBy::Rpc(grant) })
    }

    fn release(&mut self, _ep: &Endpoint, held: HeldRangeToken) -> Result<(), LockError> {
        match held.held {
            HeldBy::Rpc(g) => RpcRangeClient::release(self, g),
            _ => Err(LockError::Misuse("a token of another range lock released on an rpc client")),
        }
    }

    fn stats(&self) -> RangeLockStats {
        let s = RpcRangeClient::stats(self);
        RangeLockStats {
            acquisitions: s.acquisitions,
            waits: s.queued,
            rpc_calls: s.calls,
            ..Default::default()
        }
    }
}

/// Holds a range until dropped. A release that fails on drop is logged (the
/// algorithms' own recovery frees what a vanished holder kept); call
/// [`RangeGuard::release`] to see the error.
pub struct RangeGuard<'a> {
    client: &'a mut dyn RangeLockClient,
    ep: &'a Endpoint,
    held: Option<HeldRangeToken>,
}

impl<'a> RangeGuard<'a> {
    pub fn acquire(
        client: &'a mut dyn RangeLockClient,
        ep: &'a Endpoint,
        start: u64,
        end: u64,
    ) -> Result<Self, LockError> {
        let held = client.acquire(ep, start, end)?;
        Ok(Self { client, ep, held: Some(held) })
    }

    pub fn range(&self) -> (u64, u64) {
        let h = self.held.as_ref().expect("held until dropped");
        (h.start, h.end)
    }

    pub fn release(mut self) -> Result<(), LockError> {
        let held = self.held.take().expect("held until released");
        self.client.release(self.ep, held)
    }
}

impl Drop for RangeGuard<'_> {
    fn drop(&mut self) {
        if let Some(held) = self.held.take() {
            if let Err(e) = self.client.release(self.ep, held) {
                log::warn!("releasing a range on drop failed: {e}");
            }
        }
    }
}

/// Where one range lock instance lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum RangeLockSite {
    /// A Citron tree of `depth` at `tree` ([`CitronLayout`]) and its DSLR
    /// spillover word.
    Citron {
        tree: RemoteAddr,
        depth: u32,
        spillover: RemoteAddr,
    },
    Segments(SegmentLayout),
    Rpc {
        server: SocketAddr,
        instance: RangeInstanceId,
    },
    /// A Citron tree that grows: created with `depth` at `tree` (its
    /// unscaled [`CitronLayout`]) on the lock host at `host`, which keeps
    /// its configuration as `instance` and runs its scale-ups (never past
    /// `max_depth`); `spillover` is its DSLR spillover word.
    CitronHosted {
        tree: RemoteAddr,
        depth: u32,
        spillover: RemoteAddr,
        host: SocketAddr,
        instance: InstanceId,
        max_depth: u32,
    },
}

impl RangeLockSite {
    /// Citron covering at least `units` units at `base`: the tree
    /// ([`CitronLayout::bytes`]) followed by the spillover word.
    pub fn citron(base: RemoteAddr, units: u64) -> Self {
        let shape = TreeShape::covering(units);
        let spillover = base + CitronLayout::bytes(shape);
        RangeLockSite::Citron { tree: base, depth: shape.depth(), spillover }
    }

    /// Bytes [`RangeLockSite::citron`] needs for `units`.
    pub fn citron_bytes(units: u64) -> u64 {
        CitronLayout::bytes(TreeShape::covering(units)) + DSLR_BYTES
    }

    /// Static segmentation over `units` with segments of `segment_units`.
    pub fn segments(base: RemoteAddr, units: u64, segment_units: u64) -> Result<Self, LockError> {
        Ok(RangeLockSite::Segments(SegmentLayout::new(base, units, segment_units)?))
    }

    pub fn rpc(server: SocketAddr, instance: RangeInstanceId) -> Self {
        RangeLockSite::Rpc { server, instance }
    }

    pub fn algorithm(&self) -> RangeAlgorithm {
        match self {
            RangeLockSite::Citron { .. } | RangeLockSite::CitronHosted { .. } => RangeAlgorithm::Citron,
            RangeLockSite::Segments(_) => RangeAlgorithm::Segments,
            RangeLockSite::Rpc { .. } => RangeAlgorithm::Rpc,
        }
    }

    /// Lock memory at the host, from the site's start (0 for `rpc`, and for
    /// a hosted Citron tree, whose memory the tree host owns).
    pub fn bytes(&self) -> u64 {
        match self {
            RangeLockSite::Citron { depth, .. } => CitronLayout::bytes(TreeShape::new(*depth)) + DSLR_BYTES,
            RangeLockSite::Segments(l) => l.bytes(),
            RangeLockSite::Rpc { .. } | RangeLockSite::CitronHosted { .. } => 0,
        }
    }
}

/// Names one hosted Citron instance in a [`RangeLockContext`]'s cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct TreeKey {
    host: SocketAddr,
    instance: InstanceId,
}

/// The newest configuration this process's clients have seen of each
/// scaled hosted instance (an unscaled one needs no entry: its site says
/// it). Bounded: beyond [`TreeGeometries::CAPACITY`] entries it forgets
/// them all, which costs each scaled instance one configuration RPC.
#[derive(Default)]
struct TreeGeometries {
    map: Mutex<HashMap<TreeKey, TreeGeometry>>,
}

impl TreeGeometries {
    const CAPACITY: usize = 4096;

    /// The cached configuration of `key`, if it belongs to the tree the site
    /// names (a stale entry of a host restarted with the same address and
    /// instance numbers is ignored).
    fn get(&self, key: TreeKey, tree: RemoteAddr, depth: u32) -> Option<TreeGeometry> {
        let map = self.map.lock();
        let g = map.get(&key)?;
        (g.maximizer == tree && g.segments.first().is_some_and(|s| s.depth == depth)).then(|| g.clone())
    }

    fn store(&self, key: TreeKey, g: &TreeGeometry) {
        let mut map = self.map.lock();
        if map.get(&key).is_some_and(|old| old.version >= g.version) {
            return;
        }
        if map.len() >= Self::CAPACITY && !map.contains_key(&key) {
            map.clear();
        }
        map.insert(key, g.clone());
    }
}

/// What a process needs to open range lock clients: the timing of the
/// one-sided algorithms (derived from the transport's RTT) and its
/// connections to range lock servers (shared by all its clients).
pub struct RangeLockContext {
    pub citron: CitronConfig,
    pub dslr: DslrConfig,
    pub rpc: RpcRangeConfig,
    servers: Mutex<HashMap<SocketAddr, Arc<RangeRpc>>>,
    /// Connections to Citron tree hosts, shared by all clients.
    tree_hosts: Mutex<HashMap<SocketAddr, Arc<TreeHostRpc>>>,
    /// Configurations of scaled hosted trees.
    geometries: Arc<TreeGeometries>,
    /// What connections to range lock servers and tree hosts prove.
    credentials: citron_rpc::auth::Credentials,
}

impl RangeLockContext {
    /// The papers' parameters scaled to `rtt` ([`CitronConfig::from_rtt`],
    /// [`DslrConfig::from_rtt`]).
    pub fn from_rtt(rtt: Duration) -> Self {
        Self {
            citron: CitronConfig::from_rtt(rtt),
            dslr: DslrConfig::from_rtt(rtt),
            rpc: RpcRangeConfig::default(),
            servers: Mutex::new(HashMap::new()),
            tree_hosts: Mutex::new(HashMap::new()),
            geometries: Arc::new(TreeGeometries::default()),
            credentials: citron_rpc::auth::Credentials::anonymous(),
        }
    }

    /// Connections to lock servers prove `credentials` (a node's
    /// [`crate::rdma::NodeCredentials::host`]).
    pub fn with_credentials(mut self, credentials: citron_rpc::auth::Credentials) -> Self {
        self.credentials = credentials;
        self
    }

    /// Sets the longest any acquisition waits before it gives up.
    pub fn with_give_up(mut self, give_up: Duration) -> Self {
        self.citron.give_up = give_up;
        self.rpc.give_up = give_up;
        self
    }

    /// Calls made so far to RPC range lock servers through this context
    /// (round trips that use no verbs, so endpoints do not count them).
    pub fn rpc_calls(&self) -> u64 {
        self.servers.lock().values().map(|rpc| rpc.calls()).sum()
    }

    /// A client of the instance at `site`.
    pub fn client(&self, site: &RangeLockSite) -> Result<Box<dyn RangeLockClient>, LockError> {
        Ok(match *site {
            RangeLockSite::Citron { tree, depth, spillover } => {
                if depth > crate::citron::tree::MAX_DEPTH {
                    return Err(LockError::Misuse("Citron tree deeper than the supported maximum"));
                }
                let layout = CitronLayout { base: tree, shape: TreeShape::new(depth) };
                let spill = DslrLock::new(spillover, self.dslr);
                Box::new(CitronRangeClient::new(CitronClient::new(layout, self.citron, Box::new(spill))))
            }
            RangeLockSite::CitronHosted { tree, depth, spillover, host, instance, max_depth } => {
                if depth > crate::citron::tree::MAX_DEPTH {
                    return Err(LockError::Misuse("Citron tree deeper than the supported maximum"));
                }
                let key = TreeKey { host, instance };
                let rpc = self
                    .tree_hosts
                    .lock()
                    .entry(host)
                    .or_insert_with(|| {
                        RemoteTreeHost::connect_as(host, self.rpc.call_timeout, self.credentials.clone())
                    })
                    .clone();
                let th: Arc<dyn TreeHost> = Arc::new(RemoteTreeHost::host_scaled(rpc, instance));
                // No RPC: the newest configuration seen here, else the tree
                // as created (a stale one is refreshed when found stale).
                let (geometry, version) = match self.geometries.get(key, tree, depth) {
                    Some(g) => {
                        let v = g.version;
                        (g, v)
                    }
                    None => {
                        let layout = CitronLayout { base: tree, shape: TreeShape::new(depth) };
                        (TreeGeometry::from_layout(layout), 0)
                    }
                };
                let spill = DslrLock::new(spillover, self.dslr);
                let mut inner = CitronClient::with_geometry(th, geometry, self.citron, Box::new(spill))?;
                inner.set_scale_policy(ScalePolicy::AfterSpillover);
                inner.set_max_depth(max_depth);
                Box::new(CitronRangeClient {
                    inner,
                    cache: Some(CachedTree { cache: self.geometries.clone(), key, version }),
                })
            }
            RangeLockSite::Segments(layout) => Box::new(SegmentClient::new(layout, self.dslr)),
            RangeLockSite::Rpc { server, instance } => {
                let rpc = self
                    .servers
                    .lock()
                    .entry(server)
                    .or_insert_with(|| RpcRangeClient::connect_as(server, self.rpc, self.credentials.clone()))
                    .clone();
                Box::new(RpcRangeClient::new(rpc, instance, self.rpc))
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rdma::RegionId;

    #[test]
    fn names_round_trip() {
        for a in RangeAlgorithm::ALL {
            assert_eq!(a.to_string().parse::<RangeAlgorithm>().unwrap(), a);
        }
        let err = "tree".parse::<RangeAlgorithm>().unwrap_err();
        assert!(err.contains("citron, segments, rpc"), "{err}");
    }

    #[test]
    fn sites_say_their_memory() {
        let base = RemoteAddr::new(RegionId(1), 4096);
        let c = RangeLockSite::citron(base, 1024);
        assert_eq!(c.bytes(), RangeLockSite::citron_bytes(1024));
        // Depth 2 (1024 units): 21 nodes, 16 bytes of header, then the spillover.
        assert_eq!(c.bytes(), 16 + 21 * 8 + 8);
        match c {
            RangeLockSite::Citron { spillover, .. } => assert_eq!(spillover.offset, 4096 + 16 + 21 * 8),
            _ => unreachable!(),
        }
        let s = RangeLockSite::segments(base, 1000, 16).unwrap();
        assert_eq!(s.bytes(), 8 * (63 + 1));
        assert_eq!(s.algorithm(), RangeAlgorithm::Segments);
        let r = RangeLockSite::rpc("127.0.0.1:1".parse().unwrap(), RangeInstanceId(3));
        assert_eq!((r.bytes(), r.algorithm()), (0, RangeAlgorithm::Rpc));
        let bytes = crate::rdma::codec::encode(&s);
        assert_eq!(crate::rdma::codec::decode::<RangeLockSite>(&bytes).unwrap(), s);
        let hosted = RangeLockSite::CitronHosted {
            tree: base,
            depth: 2,
            spillover: base + 4096,
            host: "127.0.0.1:9".parse().unwrap(),
            instance: InstanceId(4),
            max_depth: 8,
        };
        assert_eq!((hosted.bytes(), hosted.algorithm()), (0, RangeAlgorithm::Citron));
        let bytes = crate::rdma::codec::encode(&hosted);
        assert_eq!(crate::rdma::codec::decode::<RangeLockSite>(&bytes).unwrap(), hosted);
    }

    #[test]
    fn the_geometry_cache_keeps_the_newest_of_the_right_tree() {
        let base = RemoteAddr::new(RegionId(1), 4096);
        let cache = TreeGeometries::default();
        let key = TreeKey { host: "127.0.0.1:9".parse().unwrap(), instance: InstanceId(1) };
        let g0 = TreeGeometry::from_layout(CitronLayout { base, shape: TreeShape::new(2) });
        assert_eq!(cache.get(key, base, 2), None);
        let mut g1 = g0.clone();
        g1.version = 1;
        g1.segments.push(crate::citron::geometry::TreeSegment { nodes: base + 8192, depth: 3 });
        cache.store(key, &g1);
        cache.store(key, &g0);
        assert_eq!(cache.get(key, base, 2), Some(g1.clone()), "an older one never replaces a newer one");
        assert_eq!(cache.get(key, base + 64, 2), None, "another tree under the same name is ignored");
        assert_eq!(cache.get(key, base, 3), None);
        for i in 0..TreeGeometries::CAPACITY as u64 {
            cache.store(TreeKey { instance: InstanceId(100 + i), ..key }, &g1);
        }
        assert!(cache.map.lock().len() <= TreeGeometries::CAPACITY, "bounded");
    }

    /// The RPC range lock's round trips are counted by the context: one call
    /// per uncontended acquire and one per release, none for other sites.
    #[test]
    fn the_context_counts_rpc_calls() {
        let server =
            rpc::spawn_range_server("127.0.0.1:0".parse().unwrap(), rpc::RangeServerConfig::default())
                .unwrap();
        let ctx = RangeLockContext::from_rtt(Duration::from_micros(50));
        assert_eq!(ctx.rpc_calls(), 0);
        // The RPC lock takes an endpoint like every range lock but uses none
        // of it: a NIC without regions will do.
        let nic = crate::rdma::TcpHost::spawn(
            "127.0.0.1:0".parse().unwrap(),
            Arc::new(crate::rdma::RegionTable::new()),
        )
        .unwrap();
        let node = crate::rdma::Node::join_tcp(nic.local_addr(), Default::default()).unwrap();
        let ep = node.endpoint().unwrap();
        let site = RangeLockSite::rpc(server.local_addr(), RangeInstanceId(1));
        for round in 1..=3 {
            let mut client = ctx.client(&site).unwrap();
            let held = client.acquire(&ep, 0, 10).unwrap();
            client.release(&ep, held).unwrap();
            assert_eq!(ctx.rpc_calls(), 2 * round);
        }
        assert_eq!(ep.counts().verbs(), 0, "the RPC lock uses no verbs");
    }
}
