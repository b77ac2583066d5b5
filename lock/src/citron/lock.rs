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
//! * `T_wait` is derived from the transport's measured round trip: the paper
//!   reserves 5 µs per 2 µs RTT for the three round trips between t1 and t2
//!   (§3.5.5), so `T_wait = 3 × 2.5 × RTT`, with a floor of 2 µs because a
//!   thread can be preempted between reading a clock and posting a verb.
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

use std::cell::Cell;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use super::geometry::CitronLayout;
use super::geometry::{nodes_of_depth, SegmentedTree, TreeGeometry, TreeSegment};
use super::host::TreeHost;
use super::scale::{carried_to, expansion_plan, Anchor, MIN_SCALE_LEVELS};
use super::tree::{level_start, Cover, NodeIndex, NodeKey, TreeShape, MAX_DEPTH};
use super::word::{
    carry_counters, Internal, Ticket, BOUNDARIES, COUNTER_BITS, DCNT_SHIFT, DONE_BELOW, EXP_BIT, NOTIFY,
    OCCUPY, OCC_BIT, SUP_BIT, TAKE_TICKET, TCNT_SHIFT, VACATE,
};
use crate::rdma::arith::field_delta;
use crate::rdma::{Endpoint, RemoteAddr, Verb, VerbCounts, VerbReply};
use crate::rwlock::{LockError, Mode, RwLockClient};

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
    pub t_wait: Duration,
    /// Bound of clock drift (Sundial's 10^-4).
    pub drift: f64,
    /// Failed masked-CAS attempts on a leaf before locking its parent.
    pub leaf_patience: u32,
    /// T_lease (§3.10): every holder releases within it, so a wait that sees
    /// no progress for (a multiple of) it has found a dead client.
    pub lease: Duration,
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
        Self { k: 2, m: 4, t_wait, drift: 1e-4, leaf_patience: 64, lease, give_up: Duration::from_secs(120) }
    }
}

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
    /// Multi-node requests started over rather than wait while holding.
    pub restarts: u64,
    /// Leaves given up for their parents (starvation avoidance).
    pub leaf_escalations: u64,
    /// Words repaired after a dead client (§3.10).
    pub recoveries: u64,
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

/// What one scale-up did and cost. For a scale-up the host ran
/// ([`TreeHost::runs_scale_ups`]), `verbs` are the host's (the work of
/// Algorithm 4 wherever it ran), `host_calls` is the one RPC that asked for
/// it, and `elapsed` is what the asking client waited.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ScaleUp {
    pub from_depth: u32,
    pub to_depth: u32,
    /// Words of the old tree marked (Alg. 4 line 5).
    pub marked: usize,
    /// New ancestors that received pending counters (line 8).
    pub carried: usize,
    /// Verbs and round trips, the spillover mutex included.
    pub verbs: VerbCounts,
    /// RPCs to the lock host (allocate, publish).
    pub host_calls: u32,
    pub elapsed: Duration,
}

/// What one scale-down did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScaleDown {
    pub from_depth: u32,
    pub to_depth: u32,
    pub freed_bytes: u64,
    pub allocated_bytes: u64,
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

/// The nodes a request holds while it locks its next one.
#[derive(Default)]
struct Others {
    held: Vec<HeldNode>,
    /// It gave way while holding: start the request over once this node is done.
    restart: bool,
}

/// Sleeps a random time up to `*cap` and doubles the cap (up to 1 ms).
fn backoff_for(cap: &mut Duration) {
    let nanos = cap.as_nanos().max(1) as u64;
    // A cheap random draw: the clock's nanoseconds, mixed.
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let jitter = (u64::from(now.subsec_nanos()) ^ u64::from(std::process::id()))
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        >> 16;
    std::thread::sleep(Duration::from_nanos(jitter % nanos));
    *cap = (*cap * 2).min(Duration::from_millis(1));
}

/// Where a requested range ends.
#[derive(Clone, Copy, Debug)]
enum RangeEnd {
    At(u64),
    /// To infinity ([`CitronClient::acquire_to_end`]).
    Infinite,
}

enum Attempt {
    Acquired(HeldNode),
    Aborted,
    /// The tree was scaled up under us (lines 15 and 33): start the request
    /// over under the new configuration.
    Superseded,
    /// Leaf starvation (Line 24): lock the parent instead.
    MoveToParent,
    /// A stalled occupied ancestor (§3.10, Line 18): lock it instead.
    MoveTo(NodeIndex),
}

/// What Step 2(b) found.
enum Ancestors {
    /// No occupied ancestor; the oldest t1 (Inequation (1)).
    Clear(Instant),
    /// The root is superseded: a scale-up has begun (line 15).
    Superseded,
    /// An occupied ancestor made no progress for T_lease (§3.10).
    Stalled(NodeIndex),
}

/// How a watched wait ended.
enum Watch {
    Done(Instant),
    /// The watched bits did not move for the given time; the last word seen.
    Stalled(u64),
}

/// The configuration a client follows, ready for address arithmetic.
struct Current {
    geometry: TreeGeometry,
    tree: SegmentedTree,
}

/// The verbs of Algorithm 3 for one held node, appended to `verbs`; returns
/// the position of the verb whose old word tells whether the anchor was
/// marked since acquisition (`None` if that cannot matter).
fn release_verbs(tree: &SegmentedTree, h: &HeldNode, verbs: &mut Vec<Verb>) -> Option<usize> {
    let addr = tree.key(h.key);
    let mut anchor_slot = None;
    match h.leaf_mask {
        Some(mask) => {
            verbs.push(Verb::MaskedCas { addr, cmp: mask, cmp_mask: mask, swap: 0, swap_mask: mask })
        }
        // A leaf whose bits were not taken (a failed masked-CAS being
        // rolled back): only its notifications are undone.
        None if h.leaf => {}
        None => {
            if matches!(h.anchor, Some(Anchor::Occupied(_))) {
                anchor_slot = Some(verbs.len());
            }
            verbs.push(Verb::MaskedFaa { addr, add: VACATE, boundary_mask: BOUNDARIES });
        }
    }
    if h.children {
        // The §3.8 shortcut took all four child leaves whole; they are ours.
        let shape = tree.shape();
        let x = shape.index(h.key);
        for i in 0..4 {
            verbs.push(Verb::Write { addr: tree.node(x.child(i)), data: 0u64.to_le_bytes().to_vec() });
        }
    }
    for &a in &h.notified {
        if h.notified.last() == Some(&a) && matches!(h.anchor, Some(Anchor::Notified(_))) {
            anchor_slot = Some(verbs.len());
        }
        verbs.push(Verb::MaskedFaa { addr: tree.key(a), add: DONE_BELOW, boundary_mask: BOUNDARIES });
    }
    if h.anchor_marked {
        None
    } else {
        anchor_slot
    }
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

    /// Locks units `[l, r)` (Algorithm 1).
    pub fn acquire(&mut self, ep: &Endpoint, l: u64, r: u64) -> Result<HeldRange, LockError> {
        if l >= r {
            return Err(LockError::Misuse("empty range"));
        }
        self.acquire_until(ep, l, RangeEnd::At(r))
    }

    /// Locks units `[l, ∞)`: the tree's part `[l, N)`, if any, and the
    /// spillover mutex, which guards all of `[N, ∞)`. The border this OR-s
    /// into the maximizer (§3.9.1) is where the range *starts*, `l + 1`, and
    /// only if `l ≥ N`: a lock to infinity asks the tree to grow to reach
    /// its start, never to the largest tree there is (nor 4× per lock).
    pub fn acquire_to_end(&mut self, ep: &Endpoint, l: u64) -> Result<HeldRange, LockError> {
        if l == u64::MAX {
            return Err(LockError::Misuse("empty range"));
        }
        self.acquire_until(ep, l, RangeEnd::Infinite)
    }

    fn acquire_until(&mut self, ep: &Endpoint, l: u64, end: RangeEnd) -> Result<HeldRange, LockError> {
        loop {
            let version = self.current.geometry.version;
            if let Some(held) = self.acquire_once(ep, l, end)? {
                self.stats.acquisitions += 1;
                return Ok(held);
            }
            // Superseded; nothing is held. Follow the new configuration
            // unless a release on the way already did.
            self.stats.superseded += 1;
            if self.current.geometry.version == version {
                self.await_newer_configuration()?;
            }
        }
    }

    /// One try under the configuration followed now; `None` (holding
    /// nothing) if the tree turned out to be superseded.
    fn acquire_once(&mut self, ep: &Endpoint, l: u64, end: RangeEnd) -> Result<Option<HeldRange>, LockError> {
        let cur = self.current.clone();
        let shape = cur.tree.shape();
        let n = shape.units();
        // The right border for this tree, and the one to OR into the
        // maximizer (0: none).
        let (r, border) = match end {
            RangeEnd::At(r) => (r, r),
            RangeEnd::Infinite => (l.max(n) + 1, if l >= n { l + 1 } else { 0 }),
        };
        let mut held = HeldRange { start: l, end: r, nodes: Vec::new(), spillover: false, shape };
        if r > n {
            self.spillover.acquire(ep, Mode::Exclusive)?;
            held.spillover = true;
            // No scale-up can start while we hold the mutex, but one may have
            // finished while we waited for it: is our root still current? And
            // OR the right border into the maximizer (masked-CAS with a zero
            // compare mask, §3.9.1). One round trip.
            let mut batch = ep.batch();
            let root = batch.push(Verb::Read { addr: cur.tree.node(NodeIndex::ROOT), len: 8 });
            let or = batch.push(Verb::MaskedCas {
                addr: cur.geometry.maximizer,
                cmp: 0,
                cmp_mask: 0,
                swap: border,
                swap_mask: border,
            });
            let superseded = batch.submit().map_err(LockError::from).and_then(|replies| {
                if let Some(e) = replies.first_error() {
                    return Err(e.clone().into());
                }
                let stale = Internal(replies.u64(root)?).superseded();
                Ok(if stale { Some(replies.old(or)?) } else { None })
            });
            match superseded {
                Ok(None) => {}
                Ok(Some(before)) => {
                    // Our border was meant for the old tree. Only holders of
                    // the spillover mutex write the maximizer, so put back
                    // what it held.
                    let restored = if before | border != before {
                        ep.write_u64(cur.geometry.maximizer, before).map_err(LockError::from)
                    } else {
                        Ok(())
                    };
                    self.spillover.release(ep)?;
                    restored?;
                    return Ok(None);
                }
                Err(e) => {
                    let _ = self.spillover.release(ep);
                    return Err(e);
                }
            }
        }
        if l < n {
            let covers = shape.split(l, r.min(n), self.config.k);
            match self.lock_covers(ep, shape, &covers) {
                Ok(Some(nodes)) => held.nodes = nodes,
                outcome => {
                    if held.spillover {
                        self.spillover.release(ep)?;
                    }
                    return outcome.map(|_| None);
                }
            }
        }
        Ok(Some(held))
    }

    /// Locks `covers` (nodes of a tree of `shape`) in order. On `None` or an
    /// error nothing of them is held.
    fn lock_covers(
        &mut self,
        ep: &Endpoint,
        shape: TreeShape,
        covers: &[Cover],
    ) -> Result<Option<Vec<HeldNode>>, LockError> {
        let mut backoff = self.config.t_wait;
        loop {
            let mut others = Others::default();
            let mut outcome = Ok(true);
            for &cover in covers {
                match self.lock_node(ep, cover, shape, &mut others) {
                    Ok(Some(h)) => {
                        others.held.push(h);
                        if others.restart {
                            break;
                        }
                    }
                    Ok(None) => {
                        outcome = Ok(false);
                        break;
                    }
                    Err(e) => {
                        outcome = Err(e);
                        break;
                    }
                }
            }
            match outcome {
                Ok(true) if !others.restart => return Ok(Some(others.held)),
                Ok(true) => {
                    // Gave way while holding: let go of everything, start over.
                    self.yield_held(ep, &mut others)?;
                    self.stats.restarts += 1;
                    backoff_for(&mut backoff);
                }
                Ok(false) => {
                    self.yield_held(ep, &mut others)?;
                    return Ok(None);
                }
                Err(e) => {
                    let _ = self.yield_held(ep, &mut others);
                    return Err(e);
                }
            }
        }
    }

    /// Before a wait: release the request's other nodes, so it never holds
    /// while waiting (see the module comment), and mark it for a restart.
    fn yield_held(&mut self, ep: &Endpoint, others: &mut Others) -> Result<(), LockError> {
        if others.held.is_empty() {
            return Ok(());
        }
        let nodes = std::mem::take(&mut others.held);
        others.restart = true;
        self.release_nodes(ep, &nodes, Vec::new())
    }

    /// Releases a range (Algorithm 3): every verb in one batch, then the
    /// spillover mutex; then, under [`ScalePolicy::AfterSpillover`], a
    /// scale-up if the range reached past the tree.
    pub fn release(&mut self, ep: &Endpoint, held: HeldRange) -> Result<(), LockError> {
        let spilled = held.spillover;
        let result = self.release_range(ep, held);
        if spilled && result.is_ok() && self.policy == ScalePolicy::AfterSpillover && self.host.is_some() {
            if let Err(e) = self.scale_up_if_needed(ep) {
                log::warn!("scale-up after a spillover acquisition failed: {e}");
                self.stats.failed_scale_ups += 1;
            }
        }
        result
    }

    fn release_range(&mut self, ep: &Endpoint, held: HeldRange) -> Result<(), LockError> {
        let result = self.release_nodes(ep, &held.nodes, Vec::new());
        if held.spillover {
            self.spillover.release(ep)?;
        }
        result
    }

    /// Algorithm 3 for `nodes`, after the verbs in `verbs`, in one batch;
    /// then lines 10–12: follow units a scale-up carried since acquisition.
    fn release_nodes(
        &mut self,
        ep: &Endpoint,
        nodes: &[HeldNode],
        mut verbs: Vec<Verb>,
    ) -> Result<(), LockError> {
        let cur = self.current.clone();
        let mut anchors = Vec::new();
        for h in nodes {
            if let Some(slot) = release_verbs(&cur.tree, h, &mut verbs) {
                anchors.push((slot, h.anchor.expect("a slot implies an anchor")));
            }
        }
        if verbs.is_empty() {
            return Ok(());
        }
        let replies = ep.execute(&verbs)?;
        let first_error = replies.iter().find_map(|r| r.as_ref().err().cloned());
        let carried: Vec<Anchor> = anchors
            .into_iter()
            .filter(
                |&(slot, anchor)| matches!(replies[slot], Ok(VerbReply::Old(w)) if w & anchor.mark() != 0),
            )
            .map(|(_, anchor)| anchor)
            .collect();
        for anchor in carried {
            self.follow_carried(ep, anchor)?;
        }
        match first_error {
            Some(e) => Err(e.into()),
            None => Ok(()),
        }
    }

    /// Adds DCnt along the chain a scale-up carried `anchor`'s unit to, and
    /// on up while the chain's top was carried again (Alg. 3 lines 10–12).
    fn follow_carried(&mut self, ep: &Endpoint, mut anchor: Anchor) -> Result<(), LockError> {
        loop {
            let chain = loop {
                if let Some(chain) = carried_to(anchor, &self.current.geometry.depths(), self.config.m) {
                    break chain;
                }
                // The scale-up has marked but not published yet.
                self.await_newer_configuration()?;
            };
            let cur = self.current.clone();
            let verbs: Vec<Verb> = chain
                .iter()
                .map(|&k| Verb::MaskedFaa {
                    addr: cur.tree.key(k),
                    add: DONE_BELOW,
                    boundary_mask: BOUNDARIES,
                })
                .collect();
            let mut top = 0;
            for r in ep.execute(&verbs)? {
                top = old_word(r)?;
            }
            self.stats.carried_releases += 1;
            // Only the chain's top can be in the top m levels, so only its
            // word can bear a later scale-up's Exp.
            if !Internal(top).expanded() {
                return Ok(());
            }
            anchor = Anchor::Notified(*chain.last().expect("a carried chain is not empty"));
        }
    }

    fn lock_node(
        &mut self,
        ep: &Endpoint,
        mut cover: Cover,
        shape: TreeShape,
        others: &mut Others,
    ) -> Result<Option<HeldNode>, LockError> {
        loop {
            // A release on the way may have followed a newer configuration:
            // `cover` is an index of the old tree, so start the request over.
            if self.current.tree.shape() != shape {
                return Ok(None);
            }
            match self.try_lock_node(ep, cover, others)? {
                Attempt::Acquired(h) => return Ok(Some(h)),
                Attempt::Superseded => return Ok(None),
                Attempt::Aborted => self.stats.aborts += 1,
                Attempt::MoveToParent => {
                    self.stats.leaf_escalations += 1;
                    let leaf = cover.node;
                    cover.node = leaf.parent().expect("a leaf below the root has a parent");
                    let held = loop {
                        if self.current.tree.shape() != shape {
                            return Ok(None);
                        }
                        match self.try_lock_node(ep, cover, others)? {
                            Attempt::Acquired(h) => break h,
                            Attempt::Superseded => return Ok(None),
                            Attempt::Aborted => self.stats.aborts += 1,
                            Attempt::MoveTo(a) => cover.node = a,
                            Attempt::MoveToParent => unreachable!("only leaves escalate"),
                        }
                    };
                    if !held.children {
                        let addr = self.current.tree.key(shape.key(leaf));
                        self.clear_dead_leaf_bits(ep, addr, leaf)?;
                    }
                    return Ok(Some(held));
                }
                Attempt::MoveTo(ancestor) => cover.node = ancestor,
            }
        }
    }

    /// §3.10, Line 22, with the leaf's parent held. No client can take bits
    /// of the leaf any more, and every holder that notified the parent in
    /// time has released (2(d)); bits still set belong to a dead client, or
    /// to a live one whose notification came too late (Inequation (1)) and
    /// which is about to roll back with a masked-CAS on exactly its bits.
    /// Zeroing the word at once, as the paper's line does, would let that
    /// late roll-back clear bits a later holder of the leaf took after we
    /// release the parent. So the leaf is watched: bits that leave were a
    /// live client's; a word unchanged for T_lease holds a dead client's
    /// bits (every holder releases within T_lease), and only those bits are
    /// cleared, by a masked-CAS that compares them.
    fn clear_dead_leaf_bits(
        &mut self,
        ep: &Endpoint,
        addr: RemoteAddr,
        leaf: NodeIndex,
    ) -> Result<(), LockError> {
        let mut word = ep.read_u64(addr)?;
        let mut unchanged_since = Instant::now();
        while word != 0 {
            if unchanged_since.elapsed() >= self.config.lease {
                if ep.masked_cas(addr, word, word, 0, word)? & word == word {
                    log::warn!("cleared bits {word:#x} of leaf {} left by a dead client", leaf.0);
                    self.stats.recoveries += 1;
                }
            } else {
                std::thread::sleep(self.config.t_wait);
            }
            let now = ep.read_u64(addr)?;
            if now != word {
                word = now;
                unchanged_since = Instant::now();
            }
        }
        Ok(())
    }

    /// Algorithm 2, lines 8–37, for one node.
    fn try_lock_node(
        &mut self,
        ep: &Endpoint,
        cover: Cover,
        others: &mut Others,
    ) -> Result<Attempt, LockError> {
        let cur = self.current.clone();
        let tree = &cur.tree;
        let shape = tree.shape();
        let node = cover.node;
        let key = shape.key(node);
        let addr = tree.node(node);
        let leaf = shape.is_leaf(node);
        let ancestors: Vec<NodeIndex> = shape.ancestors(node).collect();
        // Round trip 1 (§3.8: Steps 2(a) and 2(b) optimistically batched):
        // take the ticket of an internal node and read every ancestor.
        let mut batch = ep.batch();
        let ticket_slot = (!leaf)
            .then(|| batch.push(Verb::MaskedFaa { addr, add: TAKE_TICKET, boundary_mask: BOUNDARIES }));
        for &a in &ancestors {
            batch.push(Verb::Read { addr: tree.node(a), len: 8 });
        }
        let posted = Instant::now();
        let replies = batch.submit()?;
        let mut prefetched = Some((posted, read_words(&replies.as_slice()[usize::from(!leaf)..])?));
        if let Some(slot) = ticket_slot {
            // Phase 2(a) (lines 10–11): the bakery lock of an internal node.
            let old = replies.old(slot)?;
            let ticket = Ticket::from_old_word(old);
            if !ticket.is_served(Internal(old)) {
                // Not served at once: the ancestors read before we were is stale.
                prefetched = None;
                self.yield_held(ep, others)?;
                self.wait_for_ticket(ep, addr, ticket)?;
            }
        }
        let mut cas_failures = 0;
        loop {
            // Phase 2(b): wait for occupied ancestors (lines 12–19).
            let t1 = match self.wait_for_ancestors(ep, tree, &ancestors, others, prefetched.take())? {
                Ancestors::Clear(t1) => t1,
                outcome => {
                    if !leaf {
                        ep.masked_faa(addr, PASS_TICKET, BOUNDARIES)?;
                    }
                    return Ok(match outcome {
                        Ancestors::Stalled(a) => Attempt::MoveTo(a),
                        _ => Attempt::Superseded,
                    });
                }
            };
            // Round trip 2 (§3.8: Steps 2(c) and 2(d) batched): lock the
            // leaf's bits or occupy the node, notify the ancestors; and, for
            // a node whose children are leaves, try to take all their bits so
            // no wait for descendants is needed.
            let notified = self.notify_set(shape, node);
            let leaf_mask = leaf.then(|| shape.leaf_mask(node, cover.start, cover.end));
            let children_are_leaves = !leaf && shape.level_of(node) + 1 == shape.depth();
            let mut batch = ep.batch();
            let lock_slot = match leaf_mask {
                Some(mask) => {
                    batch.push(Verb::MaskedCas { addr, cmp: 0, cmp_mask: mask, swap: mask, swap_mask: mask })
                }
                None => batch.push(Verb::MaskedFaa { addr, add: OCCUPY, boundary_mask: BOUNDARIES }),
            };
            let child_slots: Vec<_> = if children_are_leaves {
                (0..4)
                    .map(|i| {
                        let c = tree.node(node.child(i));
                        batch.push(Verb::MaskedCas { addr: c, cmp: 0, cmp_mask: !0, swap: !0, swap_mask: !0 })
                    })
                    .collect()
            } else {
                Vec::new()
            };
            let notify_slots: Vec<_> = notified
                .iter()
                .map(|&a| {
                    batch.push(Verb::MaskedFaa { addr: tree.node(a), add: NOTIFY, boundary_mask: BOUNDARIES })
                })
                .collect();
            let replies = batch.submit()?;
            let t2 = Instant::now();
            let children_taken: Vec<bool> =
                child_slots.iter().map(|&s| replies.old(s).map(|old| old == 0)).collect::<Result<_, _>>()?;
            // The anchor: the highest notified node, or the node itself when
            // it is the root (nothing to notify; its Occ is what a scale-up
            // carries). Its old word says whether a scale-up read it first.
            let (anchor, anchor_slot) = match (notified.last(), notify_slots.last()) {
                (Some(&w), Some(&slot)) => (Some(Anchor::Notified(shape.key(w))), Some(slot)),
                _ if !leaf => (Some(Anchor::Occupied(key)), Some(lock_slot)),
                _ => (None, None),
            };
            let anchor_marked = match (anchor, anchor_slot) {
                (Some(a), Some(slot)) => replies.old(slot).is_ok_and(|w| w & a.mark() != 0),
                _ => false,
            };
            let mut held = HeldNode {
                key,
                leaf,
                leaf_mask,
                notified: notified.iter().map(|&a| shape.key(a)).collect(),
                children: children_taken.iter().all(|&t| t) && children_are_leaves,
                anchor,
                anchor_marked,
            };
            if let Some(e) = replies.first_error() {
                let e = e.clone();
                self.undo_partial(ep, tree, &held, &children_taken)?;
                return Err(e.into());
            }
            if let Some(mask) = leaf_mask {
                if replies.old(lock_slot)? & mask != 0 {
                    // Line 26: the bits are taken. Roll back the notification
                    // (§3.8) and go back to 2(b).
                    held.leaf_mask = None;
                    self.undo_partial(ep, tree, &held, &[])?;
                    self.yield_held(ep, others)?;
                    cas_failures += 1;
                    if cas_failures >= self.config.leaf_patience && node != NodeIndex::ROOT {
                        return Ok(Attempt::MoveToParent);
                    }
                    continue;
                }
            }
            // Line 33: a scale-up read our anchor before our unit reached
            // it, so nothing of ours was carried to the new levels: this
            // tree is superseded for us.
            if anchor_marked {
                self.undo_partial(ep, tree, &held, &children_taken)?;
                return Ok(Attempt::Superseded);
            }
            // Inequation (1) (line 32): we finished notifying before any
            // ancestor's holder could have stopped waiting for us.
            let budget = self.config.t_wait.mul_f64(1.0 - self.config.drift);
            if t2.duration_since(t1) > budget {
                self.undo_partial(ep, tree, &held, &children_taken)?;
                return Ok(Attempt::Aborted);
            }
            if !leaf && !held.children {
                // Some child bits were busy: give back those we took, then
                // the regular path. Line 34: t0 is after our Occ is visible
                // (the batch completed), so waiting from it is conservative.
                self.clear_children(ep, tree, node, &children_taken)?;
                let t0 = t2;
                while t0.elapsed() < self.config.t_wait {
                    std::hint::spin_loop();
                }
                self.wait_for_descendants(ep, tree, node, others)?;
            }
            return Ok(Attempt::Acquired(held));
        }
    }

    /// Writes that clear the child leaves the §3.8 shortcut took (`taken[i]`).
    fn clear_children_verbs(tree: &SegmentedTree, node: NodeIndex, taken: &[bool]) -> Vec<Verb> {
        taken
            .iter()
            .enumerate()
            .filter(|(_, t)| **t)
            .map(|(i, _)| Verb::Write {
                addr: tree.node(node.child(i as u64)),
                data: 0u64.to_le_bytes().to_vec(),
            })
            .collect()
    }

    fn clear_children(
        &self,
        ep: &Endpoint,
        tree: &SegmentedTree,
        node: NodeIndex,
        taken: &[bool],
    ) -> Result<(), LockError> {
        for r in ep.execute(&Self::clear_children_verbs(tree, node, taken))? {
            r?;
        }
        Ok(())
    }

    /// Undoes an attempt (whose children shortcut may have taken some
    /// leaves) in one batch.
    fn undo_partial(
        &mut self,
        ep: &Endpoint,
        tree: &SegmentedTree,
        held: &HeldNode,
        children_taken: &[bool],
    ) -> Result<(), LockError> {
        let clear = if held.children {
            Vec::new() // its release clears all four
        } else {
            Self::clear_children_verbs(tree, tree.shape().index(held.key), children_taken)
        };
        self.release_nodes(ep, std::slice::from_ref(held), clear)
    }

    /// Step 2(b). Returns the oldest t1 over all ancestors, or whether the
    /// root says the tree is being scaled up (abort, line 15).
    fn wait_for_ancestors(
        &mut self,
        ep: &Endpoint,
        tree: &SegmentedTree,
        ancestors: &[NodeIndex],
        others: &mut Others,
        mut prefetched: Option<(Instant, Vec<Internal>)>,
    ) -> Result<Ancestors, LockError> {
        if ancestors.is_empty() {
            return Ok(Ancestors::Clear(Instant::now())); // the root has no ancestors
        }
        // t1 of each ancestor: post time of the last read finding it unoccupied.
        let mut t1: Vec<Option<Instant>> = vec![None; ancestors.len()];
        // ancestors[cleared..] are the ancestors of `cleared` (line 12: node).
        let mut cleared = 0;
        loop {
            let (posted, words) = match prefetched.take() {
                Some(p) => p,
                None => {
                    let posted = Instant::now();
                    let verbs: Vec<Verb> =
                        ancestors.iter().map(|&a| Verb::Read { addr: tree.node(a), len: 8 }).collect();
                    (posted, read_words(&ep.execute(&verbs)?)?)
                }
            };
            // Line 15: the root of our tree is superseded.
            if words.last().is_some_and(|w| w.superseded()) {
                return Ok(Ancestors::Superseded);
            }
            for (i, w) in words.iter().enumerate() {
                if !w.occupied() {
                    t1[i] = Some(posted);
                }
            }
            // Line 16: the lowest occupied ancestor of `cleared`.
            let Some(next) = (cleared..ancestors.len()).find(|&i| words[i].occupied()) else {
                let oldest = t1.iter().flatten().min().copied();
                return Ok(Ancestors::Clear(oldest.unwrap_or(posted)));
            };
            // Line 18: wait for it to be released.
            self.yield_held(ep, others)?;
            let addr = tree.node(ancestors[next]);
            let tcnt = |w: u64| Internal(w).tcnt();
            match self.watch(ep, addr, |w| !Internal(w).occupied(), tcnt, self.config.lease)? {
                Watch::Done(seen) => {
                    t1[next] = Some(seen);
                    cleared = next + 1;
                }
                // §3.10: its holder may be dead; lock it ourselves (its
                // bakery wait then recovers it, Line 11).
                Watch::Stalled(_) => return Ok(Ancestors::Stalled(ancestors[next])),
            }
        }
    }

    /// The ancestors to notify: every m-th from the parent, the top m-1
    /// levels replaced by level m-1, the parent always (§3.5.5).
    fn notify_set(&self, shape: TreeShape, node: NodeIndex) -> Vec<NodeIndex> {
        let level = shape.level_of(node);
        notify_levels(level, self.config.m)
            .into_iter()
            .map(|lvl| {
                let (start, _) = shape.range(node);
                shape.node_at(lvl, start)
            })
            .collect()
    }

    /// Lines 35–36: `node` and its internal descendants within m levels must
    /// have no request between notifying and releasing. One read per run of
    /// a level in one segment (at most m(m+1)/2 after scale-ups, §3.9.1).
    fn wait_for_descendants(
        &mut self,
        ep: &Endpoint,
        tree: &SegmentedTree,
        node: NodeIndex,
        others: &mut Others,
    ) -> Result<(), LockError> {
        let shape = tree.shape();
        let level = shape.level_of(node);
        let pos = node.0 - level_start(level);
        let mut pending = Vec::new();
        let mut runs = Vec::new();
        for i in 0..self.config.m {
            let lvl = level + i;
            if lvl >= shape.depth() {
                break; // leaves carry no counters
            }
            for run in tree.runs(lvl, pos << (2 * i), 1u64 << (2 * i)) {
                runs.push((lvl, run));
            }
        }
        let verbs: Vec<Verb> =
            runs.iter().map(|(_, run)| Verb::Read { addr: run.addr, len: (8 * run.count) as u32 }).collect();
        for ((lvl, run), r) in runs.iter().zip(ep.execute(&verbs)?) {
            let crate::rdma::VerbReply::Data(d) = r? else {
                return Err(LockError::Host("unexpected read reply".into()));
            };
            for (j, w) in d.chunks_exact(8).enumerate() {
                let w = Internal(u64::from_le_bytes(w.try_into().expect("8 bytes")));
                if !w.descendants_quiet() {
                    pending.push(NodeIndex(level_start(*lvl) + run.first + j as u64));
                }
            }
        }
        if !pending.is_empty() {
            self.yield_held(ep, others)?;
        }
        // §3.10, Line 36: a DCnt that does not move for H·T_lease (H: our
        // height) belongs to dead clients; level it with DMax.
        let height = shape.depth() - level;
        let stall = self.config.lease * height;
        for desc in pending {
            let addr = tree.node(desc);
            loop {
                let dcnt = |w: u64| Internal(w).dcnt();
                match self.watch(ep, addr, |w| Internal(w).descendants_quiet(), dcnt, stall)? {
                    Watch::Done(_) => break,
                    Watch::Stalled(w) => {
                        let seen = Internal(w);
                        log::warn!("levelling DCnt of node {} left behind by a dead client", desc.0);
                        let field = ((1u64 << COUNTER_BITS) - 1) << DCNT_SHIFT;
                        ep.masked_cas(addr, w, field, seen.dmax() << DCNT_SHIFT, field)?;
                        self.stats_recovered();
                    }
                }
            }
        }
        Ok(())
    }

    /// Scales up if an out-of-tree request raised the maximizer (the check
    /// of [`ScalePolicy::AfterSpillover`] and of a poller): one read when
    /// nothing is needed, else [`CitronClient::scale_up`].
    pub fn scale_up_if_needed(&mut self, ep: &Endpoint) -> Result<Option<ScaleUp>, LockError> {
        self.host()?;
        if self.current.tree.shape().depth() >= self.max_depth {
            return Ok(None); // at the cap: [N, ∞) stays with the spillover mutex
        }
        if ep.read_u64(self.current.geometry.maximizer)? == 0 {
            return Ok(None);
        }
        self.scale_up(ep, 0)
    }

    /// Algorithm 4: grows the tree (at least 4×) to cover the maximizer and
    /// `at_least` units, within the depth cap; `None` if it already does.
    /// If the host runs scale-ups ([`TreeHost::runs_scale_ups`]) this asks
    /// it to (one RPC) and follows the configuration it answers.
    pub fn scale_up(&mut self, ep: &Endpoint, at_least: u64) -> Result<Option<ScaleUp>, LockError> {
        let host = self.host()?;
        let (started, before) = (Instant::now(), ep.counts());
        if host.runs_scale_ups() {
            let answer = host.scale_up(at_least)?;
            self.max_depth = self.max_depth.min(answer.max_depth);
            if answer.geometry.version > self.current.geometry.version {
                self.install(answer.geometry)?;
                self.stats.refreshes += 1;
            }
            let mut report = answer.report;
            if let Some(r) = report.as_mut() {
                r.host_calls = 1;
                r.elapsed = started.elapsed();
                self.stats.scale_ups += 1;
                log::debug!("Citron tree scaled up by its host: {r:?}");
            }
            return Ok(report);
        }
        // Line 2: the spillover mutex keeps out-of-tree requests and other
        // scalers away.
        self.spillover.acquire(ep, Mode::Exclusive)?;
        let result = self.scale_up_locked(ep, &*host, at_least);
        let released = self.spillover.release(ep); // line 11
        let mut report = result?;
        released?;
        if let Some(r) = report.as_mut() {
            r.verbs = ep.counts() - before;
            r.elapsed = started.elapsed();
            self.stats.scale_ups += 1;
            log::debug!("Citron tree scaled up: {r:?}");
        }
        Ok(report)
    }

    /// Under the spillover mutex: reads the maximizer and checks our root.
    /// A superseded root means we missed a scale-up; the host's configuration
    /// is then current (scalers publish before releasing the mutex).
    fn sync_under_spillover(&mut self, ep: &Endpoint, host: &dyn TreeHost) -> Result<u64, LockError> {
        for _ in 0..2 {
            let cur = self.current.clone();
            let mut batch = ep.batch();
            let max = batch.push(Verb::Read { addr: cur.geometry.maximizer, len: 8 });
            let root = batch.push(Verb::Read { addr: cur.tree.node(NodeIndex::ROOT), len: 8 });
            let replies = batch.submit()?;
            if let Some(e) = replies.first_error() {
                return Err(e.clone().into());
            }
            if !Internal(replies.u64(root)?).superseded() {
                return Ok(replies.u64(max)?);
            }
            let g = host.configuration()?;
            if g.version == cur.geometry.version {
                return Err(LockError::Host(
                    "the tree's root is superseded but the host has no newer configuration: \
                     a scale-up died before publishing"
                        .into(),
                ));
            }
            self.install(g)?;
            self.stats.refreshes += 1;
        }
        Err(LockError::Host("the host's configuration is superseded too".into()))
    }

    fn scale_up_locked(
        &mut self,
        ep: &Endpoint,
        host: &dyn TreeHost,
        at_least: u64,
    ) -> Result<Option<ScaleUp>, LockError> {
        let maximizer = self.sync_under_spillover(ep, host)?;
        let cur = self.current.clone();
        let old = cur.tree.shape();
        let want = maximizer.max(at_least);
        if want <= old.units() {
            if maximizer != 0 {
                // A border raised under an older configuration, now covered.
                ep.write_u64(cur.geometry.maximizer, 0)?;
            }
            return Ok(None);
        }
        if old.depth() == 0 {
            return Err(LockError::Misuse("a one-leaf tree (depth 0) cannot be scaled up: create it deeper"));
        }
        let cap = self.max_depth;
        let to = TreeShape::covering(want).depth().max(old.depth() + MIN_SCALE_LEVELS).min(cap);
        if to <= old.depth() {
            log::info!("Citron tree at its maximum depth {cap}; the spillover mutex keeps [N, ∞)");
            ep.write_u64(cur.geometry.maximizer, 0)?;
            return Ok(None);
        }
        // Line 3: zeroed memory for the nodes the enlarged tree adds.
        let bytes = 8 * (nodes_of_depth(to) - nodes_of_depth(old.depth()));
        let segment = host.allocate(bytes)?;
        let mut next = cur.geometry.clone();
        next.version += 1;
        next.segments.push(TreeSegment { nodes: segment, depth: to });
        let next_tree = match SegmentedTree::new(&next) {
            Ok(t) => t,
            Err(e) => {
                let _ = host.free(segment, bytes);
                return Err(LockError::Host(format!("bad scaled configuration: {e}")));
            }
        };
        // Lines 4–5: mark the old top levels, old root first, each mark
        // returning the word it marked. From here on the instance cannot be
        // rolled back; a failure leaves it superseded without a successor.
        let plan = expansion_plan(old.depth(), to, self.config.m);
        let marks: Vec<Verb> = plan
            .iter()
            .map(|p| Verb::MaskedCas {
                addr: next_tree.key(p.node),
                cmp: 0,
                cmp_mask: 0,
                swap: p.bits,
                swap_mask: p.bits,
            })
            .collect();
        let replies = ep.execute(&marks)?;
        // Lines 6–8: the pending units of each marked word, summed per new
        // ancestor (DMax − DCnt, modulo 2^15).
        let mut pending: BTreeMap<NodeKey, u64> = BTreeMap::new();
        for (p, r) in plan.iter().zip(replies) {
            let w = Internal(old_word(r)?);
            if w.0 & p.bits != 0 {
                log::error!(
                    "node {:?} was already marked ({w:?}): an earlier scale-up died half-way",
                    p.node
                );
            }
            let units = w.dmax().wrapping_sub(w.dcnt());
            for t in &p.counters_to {
                *pending.entry(*t).or_default() += units;
            }
            if w.occupied() {
                for t in &p.occupancy_to {
                    *pending.entry(*t).or_default() += 1;
                }
            }
        }
        let carries: Vec<Verb> = pending
            .iter()
            .filter(|(_, &units)| units & ((1 << COUNTER_BITS) - 1) != 0)
            .map(|(&t, &units)| Verb::MaskedFaa {
                addr: next_tree.key(t),
                add: carry_counters(0, units),
                boundary_mask: BOUNDARIES,
            })
            .collect();
        for r in ep.execute(&carries)? {
            r?;
        }
        // Line 9: publish; line 10: clear the maximizer.
        host.publish(cur.geometry.version, &next)?;
        ep.write_u64(next.maximizer, 0)?;
        let report = ScaleUp {
            from_depth: old.depth(),
            to_depth: to,
            marked: plan.len(),
            carried: carries.len(),
            verbs: VerbCounts::default(),
            host_calls: 2,
            elapsed: Duration::ZERO,
        };
        self.install(next)?;
        Ok(Some(report))
    }

    /// Scale-down (§3.9.2): shrinks the tree to the smallest one (depth 1 at
    /// least) covering `[0, units)`, and hands the memory it no longer uses
    /// back to the host. `None` if the tree is not larger.
    ///
    /// **Contract: exclusive use.** No other client may hold, wait for, or
    /// acquire any range of this instance, nor scale it, from the call until
    /// it has called [`CitronClient::refresh`] afterwards (the file system
    /// holds the file's inode mutex exclusively, and every other client
    /// refreshes when it next takes it). A client that skips the refresh
    /// would use freed lock memory. The call checks what it can cheaply: the
    /// top m levels, where every request in flight leaves a unit or an
    /// occupancy, must be idle, else it fails with [`LockError::Misuse`]
    /// having changed nothing (a dead client's leftovers there are cleared
    /// by acquiring and releasing `[0, N)` first, which recovers them).
    ///
    /// The smaller tree is the leftmost subtree. If its depth is one the tree
    /// had before (an older generation), its segments are kept and the later
    /// ones freed; otherwise the part of it that a kept segment does not
    /// hold is allocated fresh (zeroed is idle), and if it is smaller than
    /// the original tree the whole instance moves to a new block (maximizer
    /// included). Sup and Exp bits in the new top m levels are cleared.
    pub fn scale_down(&mut self, ep: &Endpoint, units: u64) -> Result<Option<ScaleDown>, LockError> {
        let host = self.host()?;
        self.spillover.acquire(ep, Mode::Exclusive)?;
        let result = self.scale_down_locked(ep, &*host, units);
        let released = self.spillover.release(ep);
        let report = result?;
        released?;
        if report.is_some() {
            self.stats.scale_downs += 1;
        }
        Ok(report)
    }

    fn scale_down_locked(
        &mut self,
        ep: &Endpoint,
        host: &dyn TreeHost,
        units: u64,
    ) -> Result<Option<ScaleDown>, LockError> {
        let g = host.configuration()?;
        if g != self.current.geometry {
            self.install(g)?;
        }
        let cur = self.current.clone();
        let from = cur.tree.shape().depth();
        let to = TreeShape::covering(units).depth().max(1);
        if to >= from {
            return Ok(None);
        }
        self.check_top_idle(ep, &cur.tree)?;
        let depths = cur.geometry.depths();
        let version = cur.geometry.version + 1;
        let mut fresh = None;
        let next = if to >= depths[0] {
            let keep = depths.iter().rposition(|&d| d <= to).expect("depths[0] <= to");
            let mut segments = cur.geometry.segments[..=keep].to_vec();
            if depths[keep] < to {
                let bytes = 8 * (nodes_of_depth(to) - nodes_of_depth(depths[keep]));
                let nodes = host.allocate(bytes)?;
                fresh = Some((nodes, bytes));
                segments.push(TreeSegment { nodes, depth: to });
            }
            TreeGeometry { version, maximizer: cur.geometry.maximizer, segments }
        } else {
            let shape = TreeShape::new(to);
            let bytes = CitronLayout::bytes(shape);
            let base = host.allocate(bytes)?;
            fresh = Some((base, bytes));
            TreeGeometry { version, ..TreeGeometry::from_layout(CitronLayout { base, shape }) }
        };
        let installed = self.install_smaller(ep, host, cur.geometry.version, &next);
        if let Err(e) = installed {
            if let Some((a, b)) = fresh {
                let _ = host.free(a, b);
            }
            return Err(e);
        }
        // Hand back what the smaller tree does not use.
        let kept = next.blocks();
        let mut freed = 0;
        for block in cur.geometry.blocks() {
            if !kept.contains(&block) {
                host.free(block.0, block.1)?;
                freed += block.1;
            }
        }
        self.install(next)?;
        Ok(Some(ScaleDown {
            from_depth: from,
            to_depth: to,
            freed_bytes: freed,
            allocated_bytes: fresh.map_or(0, |f| f.1),
        }))
    }

    /// Clears the marks of the smaller tree's top m levels, zeroes its
    /// maximizer and publishes it.
    fn install_smaller(
        &mut self,
        ep: &Endpoint,
        host: &dyn TreeHost,
        expected: u64,
        next: &TreeGeometry,
    ) -> Result<(), LockError> {
        let tree =
            SegmentedTree::new(next).map_err(|e| LockError::Host(format!("bad configuration: {e}")))?;
        let shape = tree.shape();
        let mut verbs = Vec::new();
        for level in 0..self.config.m.min(shape.depth()) {
            for run in tree.level_runs(level) {
                for j in 0..run.count {
                    let addr = run.addr + 8 * j;
                    verbs.push(Verb::MaskedCas {
                        addr,
                        cmp: 0,
                        cmp_mask: 0,
                        swap: 0,
                        swap_mask: SUP_BIT | EXP_BIT,
                    });
                }
            }
        }
        verbs.push(Verb::Write { addr: next.maximizer, data: 0u64.to_le_bytes().to_vec() });
        for r in ep.execute(&verbs)? {
            r?;
        }
        host.publish(expected, next)?;
        Ok(())
    }

    /// The exclusive-use check of a scale-down: no occupied node and no
    /// pending ticket or notification in the top m levels.
    fn check_top_idle(&self, ep: &Endpoint, tree: &SegmentedTree) -> Result<(), LockError> {
        let shape = tree.shape();
        let mut verbs = Vec::new();
        for level in 0..self.config.m.min(shape.depth()) {
            for run in tree.level_runs(level) {
                verbs.push(Verb::Read { addr: run.addr, len: (8 * run.count) as u32 });
            }
        }
        for r in ep.execute(&verbs)? {
            let VerbReply::Data(d) = r? else {
                return Err(LockError::Host("unexpected read reply".into()));
            };
            for w in d.chunks_exact(8) {
                if !Internal(u64::from_le_bytes(w.try_into().expect("8 bytes"))).idle() {
                    return Err(LockError::Misuse("scale-down needs exclusive use, but the tree is in use"));
                }
            }
        }
        Ok(())
    }

    /// Reads `addr` until `done` holds, or until `progress(word)` has not
    /// changed for `stall` (a dead client, §3.10).
    fn watch(
        &self,
        ep: &Endpoint,
        addr: RemoteAddr,
        done: impl Fn(u64) -> bool,
        progress: impl Fn(u64) -> u64,
        stall: Duration,
    ) -> Result<Watch, LockError> {
        let start = Instant::now();
        let mut last: Option<(u64, Instant)> = None;
        let mut spins = 0u32;
        loop {
            let posted = Instant::now();
            let w = ep.read_u64(addr)?;
            if done(w) {
                return Ok(Watch::Done(posted));
            }
            match last {
                Some((key, since)) if key == progress(w) => {
                    if since.elapsed() >= stall {
                        return Ok(Watch::Stalled(w));
                    }
                }
                _ => last = Some((progress(w), posted)),
            }
            if start.elapsed() > self.config.give_up {
                return Err(LockError::Timeout(self.config.give_up));
            }
            spins += 1;
            if spins > 16 {
                std::thread::yield_now();
            }
        }
    }

    /// Line 11 with its recovery (§3.10): wait until `ticket` is served; if
    /// TCnt and Occ stall for T_lease, wait (Δ - 1)·T_lease more (Δ: tickets
    /// ahead of ours), then take over with a masked-CAS on exactly the stalled
    /// TCnt and Occ, so any progress in the meantime makes it fail harmlessly.
    fn wait_for_ticket(&self, ep: &Endpoint, addr: RemoteAddr, ticket: Ticket) -> Result<(), LockError> {
        let key = |w: u64| w & (TCNT_FIELD | OCC_BIT);
        loop {
            let w = match self.watch(ep, addr, |w| ticket.is_served(Internal(w)), key, self.config.lease)? {
                Watch::Done(_) => return Ok(()),
                Watch::Stalled(w) => w,
            };
            let ahead = ticket.0.wrapping_sub(Internal(w).tcnt()) & ((1 << COUNTER_BITS) - 1);
            if ahead > 1 {
                let more = self.config.lease * (ahead as u32 - 1);
                if let Watch::Done(_) = self.watch(ep, addr, |w| ticket.is_served(Internal(w)), key, more)? {
                    return Ok(());
                }
            }
            log::warn!("taking over a bakery stalled at ticket {} by a dead client", Internal(w).tcnt());
            let swap = ticket.0 << TCNT_SHIFT;
            ep.masked_cas(addr, w, TCNT_FIELD | OCC_BIT, swap, TCNT_FIELD | OCC_BIT)?;
            self.stats_recovered();
        }
    }

    fn stats_recovered(&self) {
        self.recoveries.set(self.recoveries.get() + 1);
    }
}

/// Levels of the ancestors a node on `level` notifies (§3.5.5): the parent,
/// then every m-th ancestor above it, those in the top m-1 levels replaced by
/// level m-1.
pub fn notify_levels(level: u32, m: u32) -> Vec<u32> {
    if level == 0 {
        return Vec::new();
    }
    let mut out = vec![level - 1];
    let mut raw = level - 1;
    while raw >= m {
        raw -= m;
        let lvl = raw.max(m - 1);
        if out.last() != Some(&lvl) {
            out.push(lvl);
        }
        if raw < m - 1 {
            break;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whatever levels Alice (at `a`) checks, `a..a+m` (internal only), she
    /// meets one that Bob (at `b > a`) notifies: the meet-in-the-middle rule.
    #[test]
    fn every_ancestor_meets_a_notified_level() {
        for m in 1..=5u32 {
            for b in 1..=20u32 {
                let notified = notify_levels(b, m);
                assert_eq!(notified[0], b - 1, "the parent is always notified");
                assert!(notified.windows(2).all(|w| w[0] > w[1]), "{notified:?}");
                for a in 0..b {
                    let checked = a..(a + m);
                    assert!(
                        notified.iter().any(|l| checked.contains(l) && *l < b),
                        "m={m} b={b} a={a}: {notified:?} misses {checked:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn top_levels_are_replaced_by_level_m_minus_1() {
        assert_eq!(notify_levels(10, 4), vec![9, 5, 3]);
        assert_eq!(notify_levels(8, 4), vec![7, 3]);
        assert_eq!(notify_levels(3, 4), vec![2]);
        assert_eq!(notify_levels(1, 4), vec![0]);
    }

    #[test]
    fn layout_offsets() {
        let l =
            CitronLayout { base: RemoteAddr::new(crate::rdma::RegionId(1), 4096), shape: TreeShape::new(2) };
        assert_eq!(l.maximizer().offset, 4096);
        assert_eq!(l.node(NodeIndex::ROOT).offset, 4096 + 16);
        assert_eq!(l.node(NodeIndex(21)).offset, 4096 + 16 + 160);
        assert_eq!(CitronLayout::bytes(TreeShape::new(2)), 16 + 21 * 8);
    }
}
