//! Acquiring and releasing a range on a Citron instance (citron-fast23.md
//! Algorithms 1–3, §3.5–3.6), and scaling its tree (Algorithm 4, §3.9).
//!
//! A range `[l, r)` of lock units is split into at most `k` tree nodes
//! (§3.5.1); each is locked in ascending order through the four phases of
//! Algorithm 2, and the part beyond the tree, `[N, ∞)`, through the spillover
//! mutex, taken first (Algorithm 1), with its right border OR-ed into the
//! maximizer (§3.9.1) so a client that scales the tree up knows how far.
//!
//! Choices where the paper leaves room, and why:
//! * `T_wait` is one value for the whole cluster (§3.5.5: a holder must wait
//!   as long as any notifier may take). Standalone clients derive it from
//!   the transport's measured round trip ([`CitronConfig::from_rtt`]: the
//!   paper reserves 5 µs per 2 µs RTT for the three round trips between t1
//!   and t2, so `3 × 2.5 × RTT`, with a floor of 2 µs because a thread can
//!   be preempted between reading a clock and posting a verb), and every
//!   client of one instance must be given the same. In a cluster the
//!   cluster manager publishes it in lock memory, following the slowest
//!   client, and changes it in two phases ([`super::tuning`]); each node
//!   attempt reads it in its 2(c)+(d) batch (one more read, no more round
//!   trips) and takes its abort budget and its wait from that reading.
//! * **Aborts back off, and are bounded.** An attempt that fails
//!   Inequation (1) undoes itself, sleeps a random time below a cap that
//!   starts at `T_wait` and doubles, and tries again. After
//!   [`CitronConfig::max_aborts`] aborts the request locks the root of the
//!   tree instead: the root has no ancestor to notify, so Inequation (1)
//!   does not apply to it and the attempt cannot abort; its bakery lock is
//!   starvation-free and its wait for descendants ends when the requests
//!   below finish or abort. So a client whose round trip exceeds `T_wait`
//!   (while the cluster manager has not caught up with it, or a thread the
//!   scheduler stalls between t1 and t2 again and again) still gets every
//!   lock, only with less concurrency.
//! * t1 is tracked per ancestor (the post time of the last read that found it
//!   unoccupied) and Inequation (1) is checked against the oldest, as §3.5.5
//!   requires ("record a t1 … for every ancestor"). Every Step 2(b) iteration
//!   re-reads all ancestors in one batch, which refreshes the t1 of those it
//!   finds unoccupied at no extra round trip.
//! * Notified ancestors are every m-th one from the parent, with those in the
//!   top m-1 levels replaced by the ancestor on level m-1 (the paper's "m-th
//!   level"), except the parent, which is always notified (§3.5.5).
//! * A leaf whose masked-CAS keeps failing (`leaf_patience` times) is given up
//!   for its parent (Line 24), whose bakery lock is starvation-free.
//! * **No hold-and-wait across the nodes of one request.** The paper locks a
//!   request's nodes one after another and its liveness argument (§3.7)
//!   considers one node at a time. With k ≥ 2 that admits a cycle: Bob holds
//!   leaf D and waits in 2(b) for node E under Alice's occupied ancestor A,
//!   while Alice waits in 2(d) for Bob's notification from D (our stress test
//!   found it). So before a request waits at any phase of a later node, it
//!   releases the nodes it already holds, finishes the node at hand (a bakery
//!   ticket cannot be abandoned), releases it too and starts the request
//!   over after a short randomised backoff. A request never waits while
//!   holding tree nodes, so no cycle can form; requests of one node (the
//!   common case) follow the paper exactly.
//!
//! * Lease recovery (§3.10) at the four places a waiter spins: Line 11 (a
//!   stalled bakery: after T_lease plus (Δ-1)·T_lease without TCnt or Occ
//!   moving, take over by setting TCnt to our ticket and clearing Occ, with a
//!   masked-CAS so a late holder's progress wins), Line 18 (a stalled occupied
//!   ancestor: lock that ancestor instead), Line 36 (a DCnt stalled for
//!   H·T_lease: set it to DMax) and Line 22 (a leaf that keeps refusing: lock
//!   the parent, then clear the bits left in the leaf; unlike the paper's
//!   line, only bits that stayed unchanged for T_lease, with a masked-CAS on
//!   exactly them, because a live client whose notification came too late
//!   may still roll its bits back, see `clear_dead_leaf_bits`).
//!
//! # Scale-up (Algorithm 4) and what it changes here
//!
//! The marking and carrying rules, and why they differ from Algorithm 4 as
//! printed, are in [`super::scale`]; node addresses after a scale-up in
//! [`super::geometry`]; the lock host's part in [`super::host`]. In this file:
//! * [`CitronClient::scale_up`]: holding the spillover mutex, the client asks
//!   the host for a zeroed segment (RPC), marks the old top m levels in one
//!   batch of masked-CAS verbs, old root first (lines 4–5), adds the pending
//!   DMax − DCnt of the marked words to their new ancestors in a second
//!   batch (lines 6–8; adding DCnt and DMax as the paper does is the same,
//!   since only their difference is ever tested), publishes the new
//!   configuration (RPC, line 9), clears the maximizer (line 10) and releases
//!   the spillover mutex (line 11). Five round trips and two RPCs (six with
//!   something to carry), tens of µs; it must end within the spillover
//!   mutex's lease (DSLR's, at least 1 s), which is what excludes a second
//!   scaler.
//! * **Who scales.** Any client with a [`TreeHost`]. [`ScalePolicy::AfterSpillover`]
//!   (the default with a host): after releasing a range that used the
//!   spillover mutex, the client reads the maximizer and, if it is set, runs
//!   the scale-up. [`CitronClient::scale_up_if_needed`] is the same check for
//!   a caller that polls instead (the paper's evaluation polls every 10 ms,
//!   §4.5). The tree grows at least 4× and enough to cover the maximizer.
//! * **Acquisition** (lines 15 and 33). Step 2(b) aborts when the root of the
//!   client's tree is superseded (Sup). In the 2(c)+(d) batch the reply of
//!   the verb on the request's anchor (its highest notified node, or the node
//!   itself when it is the root) says whether a scale-up had already read
//!   that word; if so the request's units were not carried, so it is undone
//!   and the request starts over under the new configuration, which the
//!   client fetches from the host (waiting, bounded by `give_up`, if the
//!   scale-up has not published it yet). The paper's extra read of the root
//!   in that batch is not needed for the decision and is dropped.
//! * **Spillover** (Algorithm 1). A request that waited for the spillover
//!   mutex while someone scaled the tree would lock `[N_old, …)` by the mutex
//!   although the tree now covers part of it. So after taking the mutex the
//!   client reads its root in the same batch as the maximizer OR, and starts
//!   over under the new configuration if the root is superseded.
//! * **Release** (lines 10–12). The verb on the anchor returns its old word;
//!   if the scale-up's mark appeared since acquisition, the units were
//!   carried and the release adds DCnt along the carried chain
//!   ([`super::scale::carried_to`]), repeatedly if a later scale-up carried
//!   the chain's top in turn. Ranges held across any number of scale-ups are
//!   released exactly.
//! * **Scale-down** (§3.9.2) under exclusive use, [`CitronClient::scale_down`].
//!
//! * **Scale-ups run by the host.** If the client's [`TreeHost`] says it
//!   [`TreeHost::runs_scale_ups`], [`CitronClient::scale_up`] asks it to
//!   (one RPC) and follows the configuration it answers; the host runs this
//!   same Algorithm 4 as a client of its own memory (see
//!   [`super::host`]). The file system does this.
//! * **Depth cap** ([`CitronClient::set_max_depth`]): scale-ups never grow
//!   the tree past it; beyond it the spillover mutex keeps `[N, ∞)`.
//! * **Ranges to infinity** ([`CitronClient::acquire_to_end`]): locked as
//!   `[l, max(l, N) + 1)`, but the border OR-ed into the maximizer is
//!   `l + 1`, and none when `l < N`, so such a lock never asks for a tree
//!   larger than its start needs.
//! * **Clients that know a configuration** ([`CitronClient::with_geometry`])
//!   start without asking the host; a stale one is found superseded and
//!   refreshed like any other.
//!
//! A wait that exceeds `give_up` ends with [`LockError::Timeout`] rather
//! than hanging; so does waiting for a configuration a scale-up never
//! publishes. Not handled here: a client-run scaler that dies between its
//! first mark and its publication leaves the instance superseded without a
//! successor; every client then fails with that timeout (or
//! [`LockError::Host`] when it next tries to scale) until the instance is
//! recreated. A host that runs the scale-ups itself
//! ([`super::host::LockMemoryHost::with_scaler`]) rules this out.

//!
//! # Files
//!
//! The client is split along the paper's parts, as the other lock modules
//! are:
//! * this file: the client's state, configuration and counters;
//! * [`acquire`]: Algorithms 1 and 2 (§3.5, §3.8), with the no-hold-and-wait
//!   rule across a request's nodes;
//! * [`waits`]: Steps 2(b) and 2(d) of Algorithm 2 and the notified levels;
//! * [`release`]: Algorithm 3 (§3.6), with lines 10–12 after scale-ups;
//! * [`recovery`]: the lease recovery of §3.10 at the places a waiter spins;
//! * [`own`]: what this client holds, so that a second range it asks for
//!   never waits for its first;
//! * [`resize`]: scale-up (Algorithm 4, §3.9.1) and scale-down (§3.9.2).

mod acquire;
mod own;
mod recovery;
mod release;
mod resize;
mod waits;

use std::cell::Cell;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use super::geometry::CitronLayout;
use super::geometry::{SegmentedTree, TreeGeometry};
use super::host::TreeHost;
use super::scale::Anchor;
use super::tree::{NodeIndex, NodeKey, TreeShape, MAX_DEPTH};
use super::word::{Internal, COUNTER_BITS, TCNT_SHIFT};
use crate::rdma::arith::field_delta;
use crate::rdma::{RemoteAddr, Verb, VerbReply};
use crate::rwlock::{LockError, Riders, RwLockClient};

pub use resize::{ScaleDown, ScaleUp};
pub use waits::notify_levels;

/// The TCnt field of an internal node.
const TCNT_FIELD: u64 = ((1 << COUNTER_BITS) - 1) << TCNT_SHIFT;

/// Give back a ticket of an internal node that was never occupied (TCnt + 1).
const PASS_TICKET: u64 = field_delta(super::word::TCNT_SHIFT, super::word::COUNTER_BITS, 1);

/// Tunables of the protocol (§3.5).
#[derive(Clone, Copy, Debug)]
pub struct CitronConfig {
    /// Most nodes a range is split into.
    pub k: usize,
    /// Meet-in-the-middle distance.
    pub m: u32,
    /// `T_wait` when none is published (or no word is configured).
    pub t_wait: Duration,
    /// Where the cluster manager publishes the cluster's `T_wait`
    /// ([`super::tuning`]); every node attempt reads it in its 2(c)+(d)
    /// batch. `None`: `t_wait` is the cluster's value.
    pub published_t_wait: Option<RemoteAddr>,
    /// Aborts (Inequation (1)) one request may suffer before it locks the
    /// root instead, which notifies nobody and so never aborts.
    pub max_aborts: u32,
    /// Bound of clock drift (Sundial's 10^-4).
    pub drift: f64,
    /// Failed masked-CAS attempts on a leaf before locking its parent.
    pub leaf_patience: u32,
    /// T_lease (§3.10): every holder releases within it, so a wait that sees
    /// no progress for (a multiple of) it has found a dead client.
    pub lease: Duration,
    /// How long after a holder's lease ran out the cluster may still need
    /// to fence a silent holder at the servers (so that its late verbs are
    /// refused there). Every takeover of a silent holder (§3.10, Lines 11,
    /// 18, 22 and 36) waits this much longer than the paper's thresholds,
    /// so no lock is recovered before its holder is fenced; the holder's own
    /// bound (T_lease, and the late-release guard) does not change. Zero
    /// (the default) below a file system: the paper's thresholds exactly.
    pub fence_delay: Duration,
    /// Longest any single wait may last before the acquisition gives up.
    pub give_up: Duration,
}

impl CitronConfig {
    /// The paper's parameters with `T_wait` scaled to this transport's RTT.
    pub fn from_rtt(rtt: Duration) -> Self {
        let t_wait = (rtt * 15 / 2).max(Duration::from_micros(2));
        // The paper's 10 ms lease is 5000 RTTs of 2 µs; we keep the ratio but
        // never go below 1 s, because a holder here is a thread of an
        // ordinary process that the scheduler may stall for many ms.
        let lease = (rtt * 5000).max(Duration::from_secs(1));
        Self {
            k: 2,
            m: 4,
            t_wait,
            published_t_wait: None,
            max_aborts: DEFAULT_MAX_ABORTS,
            drift: 1e-4,
            leaf_patience: 64,
            lease,
            fence_delay: Duration::ZERO,
            give_up: Duration::from_secs(120),
        }
    }

    /// The same with a fence delay ([`CitronConfig::fence_delay`]) instead
    /// of the current one; the give-up time grows by [`GIVE_UP_FENCES`] of
    /// them, so a wait through that many takeovers still fits.
    ///
    /// [`GIVE_UP_FENCES`]: crate::rwlock::GIVE_UP_FENCES
    pub fn with_fence_delay(mut self, fence_delay: Duration) -> Self {
        self.give_up = self.give_up.saturating_sub(self.fence_delay * crate::rwlock::GIVE_UP_FENCES)
            + fence_delay * crate::rwlock::GIVE_UP_FENCES;
        self.fence_delay = fence_delay;
        self
    }

    /// How long a word must stand still before a waiter takes it for a
    /// dead client's (Lines 11, 18, 22): 3/2 T_lease (see the recovery
    /// module), plus the fence delay.
    pub fn takeover_stall(&self) -> Duration {
        self.lease * 3 / 2 + self.fence_delay
    }

    /// Line 36 at height `height`: notifications that do not move for
    /// H·T_lease + T_lease/2 (plus the fence delay) are a dead client's.
    pub fn descendants_stall(&self, height: u32) -> Duration {
        self.lease * height + self.lease / 2 + self.fence_delay
    }

    /// Line 11's extra wait with `ahead` tickets before ours, after the
    /// first stall: (Δ − 1)·T_lease, plus the fence delay (a ticket ahead
    /// that takes the bakery over meanwhile is a holder like any other, and
    /// may be a stopped process that must be fenced first).
    pub fn bakery_extra(&self, ahead: u32) -> Duration {
        self.lease * ahead.saturating_sub(1) + self.fence_delay
    }
}

/// [`CitronConfig::max_aborts`] by default: after this many aborts, each
/// preceded by a randomised backoff that doubles, a request is far more
/// likely to face a round trip longer than `T_wait` than bad luck.
pub const DEFAULT_MAX_ABORTS: u32 = 8;

/// When a client scales the tree up on its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScalePolicy {
    /// Only when the caller calls [`CitronClient::scale_up_if_needed`] or
    /// [`CitronClient::scale_up`] (e.g. from a poller, as in §4.5).
    Manual,
    /// After releasing a range that used the spillover mutex, if the
    /// maximizer is set (one read when it is not).
    AfterSpillover,
}

/// One node held for a request, and what its release must undo.
#[derive(Clone, Debug, PartialEq, Eq)]
struct HeldNode {
    key: NodeKey,
    leaf: bool,
    /// The leaf bits taken, or `None` (an internal node, or a leaf whose
    /// masked-CAS failed and whose notifications are being rolled back).
    leaf_mask: Option<u64>,
    notified: Vec<NodeKey>,
    /// All four child leaves were taken whole (§3.8 shortcut).
    children: bool,
    /// Where the request's units end (Alg. 3 lines 10–12).
    anchor: Option<Anchor>,
    /// The anchor already bore its scale-up mark when we notified or
    /// occupied it: a scale-up had read it first and carried nothing of ours.
    anchor_marked: bool,
    /// The ticket served to us (an internal node): what a release after the
    /// lease compares before it vacates ([`recovery`]).
    ticket: Option<super::word::Ticket>,
    /// When the node's acquisition returned: its lease starts here.
    acquired_at: Instant,
}

/// A range held on a Citron instance; give it back with [`CitronClient::release`].
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a held range must be released"]
pub struct HeldRange {
    pub start: u64,
    /// One past the last unit locked; for [`CitronClient::acquire_to_end`],
    /// `max(start, N) + 1` in the tree it was acquired in (the spillover
    /// mutex holds all of `[N, ∞)`).
    pub end: u64,
    nodes: Vec<HeldNode>,
    /// Where the requested units end (`u64::MAX`: to infinity), as the
    /// client's own record has it ([`own`]).
    units_end: u64,
    spillover: bool,
    /// The tree the range was acquired in (for [`HeldRange::nodes`]).
    shape: TreeShape,
}

impl HeldRange {
    /// The tree nodes held, as indices of the tree the range was acquired in
    /// (for tests and diagnostics).
    pub fn nodes(&self) -> Vec<NodeIndex> {
        self.nodes.iter().map(|n| self.shape.index(n.key)).collect()
    }

    /// Whether the range reached past the tree and holds the spillover mutex.
    pub fn used_spillover(&self) -> bool {
        self.spillover
    }
}

/// Counters of one client's activity.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CitronStats {
    pub acquisitions: u64,
    /// Node acquisitions aborted (Inequation (1)) and retried.
    pub aborts: u64,
    /// Requests that aborted [`CitronConfig::max_aborts`] times and locked
    /// the root instead.
    pub root_escalations: u64,
    /// Multi-node requests started over rather than wait while holding.
    pub restarts: u64,
    /// Leaves given up for their parents (starvation avoidance).
    pub leaf_escalations: u64,
    /// Words repaired after a dead client (§3.10).
    pub recoveries: u64,
    /// Nodes released after their lease (guarded, and `Fenced`).
    pub late_releases: u64,
    /// Requests started over because the tree had been scaled up.
    pub superseded: u64,
    /// Newer configurations learnt from the host.
    pub refreshes: u64,
    /// Releases that followed their units to a scale-up's new nodes.
    pub carried_releases: u64,
    pub scale_ups: u64,
    pub scale_downs: u64,
    /// Scale-ups attempted by [`ScalePolicy::AfterSpillover`] that failed
    /// (logged; the release itself succeeded).
    pub failed_scale_ups: u64,
}

/// Decodes the replies of a batch of 8-byte reads of internal nodes.
fn read_words(
    replies: &[Result<crate::rdma::VerbReply, crate::rdma::VerbError>],
) -> Result<Vec<Internal>, LockError> {
    replies
        .iter()
        .map(|r| match r {
            Ok(crate::rdma::VerbReply::Data(d)) if d.len() == 8 => {
                Ok(Internal(u64::from_le_bytes(d.as_slice().try_into().expect("8 bytes"))))
            }
            Ok(other) => Err(LockError::Host(format!("unexpected read reply {other:?}"))),
            Err(e) => Err(e.clone().into()),
        })
        .collect()
}

/// The old value an atomic returned.
fn old_word(reply: Result<VerbReply, crate::rdma::VerbError>) -> Result<u64, LockError> {
    match reply? {
        VerbReply::Old(v) => Ok(v),
        other => Err(LockError::Host(format!("unexpected atomic reply {other:?}"))),
    }
}

/// The configuration a client follows, ready for address arithmetic.
struct Current {
    geometry: TreeGeometry,
    tree: SegmentedTree,
}

/// One client's handle to one Citron instance.
pub struct CitronClient {
    current: Arc<Current>,
    config: CitronConfig,
    spillover: Box<dyn RwLockClient>,
    host: Option<Arc<dyn TreeHost>>,
    policy: ScalePolicy,
    /// Deepest tree a scale-up may make ([`CitronClient::set_max_depth`]).
    max_depth: u32,
    stats: CitronStats,
    /// Recoveries made from `&self` paths; folded into `stats`.
    recoveries: Cell<u64>,
    /// The ranges and nodes this client holds ([`own`]).
    own: own::Own,
    /// Reads riding on the acquisition under way
    /// ([`CitronClient::acquire_with_reads`]).
    riding: Riding,
}

/// Where an early read of a leaf's ancestors stands.
#[derive(Default)]
enum Early {
    #[default]
    None,
    /// Asked for, for this leaf of the tree of this configuration version.
    Planned { leaf: NodeIndex, version: u64 },
    /// Read: the words of its ancestors (parent first), and when the read
    /// was posted (its t1 where it found an ancestor unoccupied).
    Read { leaf: NodeIndex, version: u64, posted: Instant, words: Vec<Internal> },
}

/// The caller's reads that ride on the batch of Steps 2(c)+(d) of a
/// request's one node, and their replies once that batch took the node.
#[derive(Default)]
struct Riding {
    /// An early Step 2(b) read of the ancestors of a request's one leaf,
    /// posted by the caller ahead of the acquisition
    /// ([`CitronClient::early_reads`]).
    early: Early,
    verbs: Vec<Verb>,
    /// This attempt's batch carries them: the request is one node of the
    /// tree (no spillover mutex, no node it rides on), so taking that node
    /// is taking the whole range.
    armed: bool,
    /// Their replies, from the batch that took the node without a wait
    /// after it; `None` otherwise.
    replies: Riders,
}

impl CitronClient {
    /// A client of a tree that is never scaled: `layout` is where it lives,
    /// `spillover` the mutex for `[N, ∞)` (DSLR in the paper), used in
    /// exclusive mode. It cannot scale, and it fails with
    /// [`LockError::Host`] if someone else scales the tree.
    pub fn new(layout: CitronLayout, config: CitronConfig, spillover: Box<dyn RwLockClient>) -> Self {
        let geometry = TreeGeometry::from_layout(layout);
        let tree = SegmentedTree::new(&geometry).expect("a layout is a valid one-segment geometry");
        Self {
            current: Arc::new(Current { geometry, tree }),
            config,
            spillover,
            host: None,
            policy: ScalePolicy::Manual,
            max_depth: MAX_DEPTH,
            stats: CitronStats::default(),
            recoveries: Cell::new(0),
            own: own::Own::default(),
            riding: Riding::default(),
        }
    }

    /// A client of the instance `host` keeps the configuration of (one RPC
    /// to fetch it). It follows scale-ups, can scale up and down, and scales
    /// up after spillover acquisitions ([`ScalePolicy::AfterSpillover`]).
    pub fn with_host(
        host: Arc<dyn TreeHost>,
        config: CitronConfig,
        spillover: Box<dyn RwLockClient>,
    ) -> Result<Self, LockError> {
        let geometry = host.configuration()?;
        Self::with_geometry(host, geometry, config, spillover)
    }

    /// As [`CitronClient::with_host`], but following `geometry`, a
    /// configuration of the instance the caller already knows (cached from
    /// an earlier client, or the unscaled tree of a [`CitronLayout`]): no
    /// RPC. It need not be current: a superseded root sends the client to
    /// the host for the newer one when it first matters (Alg. 2 lines 15
    /// and 33), exactly as a long-lived client that missed scale-ups.
    pub fn with_geometry(
        host: Arc<dyn TreeHost>,
        geometry: TreeGeometry,
        config: CitronConfig,
        spillover: Box<dyn RwLockClient>,
    ) -> Result<Self, LockError> {
        let tree =
            SegmentedTree::new(&geometry).map_err(|e| LockError::Host(format!("bad configuration: {e}")))?;
        Ok(Self {
            current: Arc::new(Current { geometry, tree }),
            config,
            spillover,
            host: Some(host),
            policy: ScalePolicy::AfterSpillover,
            max_depth: MAX_DEPTH,
            stats: CitronStats::default(),
            recoveries: Cell::new(0),
            own: own::Own::default(),
            riding: Riding::default(),
        })
    }

    pub fn stats(&self) -> CitronStats {
        CitronStats { recoveries: self.stats.recoveries + self.recoveries.get(), ..self.stats }
    }

    /// Where the instance lives and the shape of the tree this client
    /// currently follows. `base` is the instance block (maximizer first);
    /// after a scale-up, node addresses are not `layout().node(x)`: see
    /// [`CitronClient::geometry`].
    pub fn layout(&self) -> CitronLayout {
        CitronLayout { base: self.current.geometry.maximizer, shape: self.current.tree.shape() }
    }

    /// The configuration this client follows.
    pub fn geometry(&self) -> &TreeGeometry {
        &self.current.geometry
    }

    pub fn set_scale_policy(&mut self, policy: ScalePolicy) {
        self.policy = policy;
    }

    /// Caps the depth scale-ups grow the tree to (at most [`MAX_DEPTH`]):
    /// ranges beyond a tree at the cap stay with the spillover mutex, and a
    /// client whose tree is at the cap no longer checks the maximizer after
    /// spillover acquisitions.
    pub fn set_max_depth(&mut self, depth: u32) {
        self.max_depth = depth.min(MAX_DEPTH);
    }

    /// Fetches the host's configuration; `true` if it differs from the one
    /// followed so far. After a scale-down every client must call this
    /// before its next acquisition (see [`CitronClient::scale_down`]).
    pub fn refresh(&mut self) -> Result<bool, LockError> {
        let host = self.host()?;
        let g = host.configuration()?;
        if g == self.current.geometry {
            return Ok(false);
        }
        self.install(g)?;
        self.stats.refreshes += 1;
        Ok(true)
    }

    fn host(&self) -> Result<Arc<dyn TreeHost>, LockError> {
        self.host.clone().ok_or(LockError::Misuse("scaling needs a TreeHost (CitronClient::with_host)"))
    }

    fn install(&mut self, geometry: TreeGeometry) -> Result<(), LockError> {
        let tree = SegmentedTree::new(&geometry)
            .map_err(|e| LockError::Host(format!("bad tree configuration: {e}")))?;
        self.current = Arc::new(Current { geometry, tree });
        Ok(())
    }

    /// Waits (bounded by `give_up`) until the host publishes a configuration
    /// newer than ours, and follows it: a scale-up we saw the mark of has
    /// not published yet, or has.
    fn await_newer_configuration(&mut self) -> Result<(), LockError> {
        let host = self.host.clone().ok_or_else(|| {
            LockError::Host("the tree was scaled up, but this client has no TreeHost to follow it".into())
        })?;
        let version = self.current.geometry.version;
        let start = Instant::now();
        let mut pause = Duration::from_micros(20);
        loop {
            let g = host.configuration()?;
            if g.version > version {
                self.install(g)?;
                self.stats.refreshes += 1;
                return Ok(());
            }
            if start.elapsed() > self.config.give_up {
                return Err(LockError::Timeout(self.config.give_up));
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(1));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_offsets() {
        let l =
            CitronLayout { base: RemoteAddr::new(crate::rdma::RegionId(1), 4096), shape: TreeShape::new(2) };
        assert_eq!(l.maximizer().offset, 4096);
        assert_eq!(l.node(NodeIndex::ROOT).offset, 4096 + 16);
        assert_eq!(l.node(NodeIndex(21)).offset, 4096 + 16 + 160);
        assert_eq!(CitronLayout::bytes(TreeShape::new(2)), 16 + 21 * 8);
    }

    #[test]
    fn every_takeover_threshold_adds_the_fence_delay() {
        let mut c = CitronConfig::from_rtt(Duration::from_micros(2));
        c.lease = Duration::from_millis(300);
        assert_eq!(c.fence_delay, Duration::ZERO, "below a file system: the paper's thresholds");
        assert_eq!(c.takeover_stall(), Duration::from_millis(450));
        assert_eq!(c.descendants_stall(3), Duration::from_millis(1050));
        assert_eq!(c.bakery_extra(3), Duration::from_millis(600));
        let f = c.with_fence_delay(Duration::from_secs(3));
        assert_eq!(f.takeover_stall(), Duration::from_millis(3450));
        assert_eq!(f.descendants_stall(3), Duration::from_millis(4050));
        assert_eq!(f.bakery_extra(1), Duration::from_secs(3));
        assert_eq!(f.bakery_extra(3), Duration::from_millis(3600));
        assert_eq!(f.lease, c.lease, "the holder's bound does not move");
        assert!(f.give_up >= c.give_up + f.takeover_stall(), "{f:?}");
        // Setting it again replaces it.
        assert_eq!(f.with_fence_delay(Duration::ZERO).give_up, c.give_up);
    }
}
