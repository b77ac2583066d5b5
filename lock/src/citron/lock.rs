//! Acquiring and releasing a range on a Citron instance (citron-fast23.md
//! Algorithms 1–3, §3.5–3.6).
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
//!   the parent, then zero any bits left in the leaf).
//!
//! Not yet here: scale-up (Algorithm 4) and the handling of `Exp` in release.
//! A wait that exceeds `give_up` still ends with [`LockError::Timeout`]
//! rather than hanging.

use std::time::{Duration, Instant};

use super::tree::{level_start, Cover, NodeIndex, TreeShape};
use super::word::{
    Internal, Ticket, BOUNDARIES, COUNTER_BITS, DCNT_SHIFT, DONE_BELOW, NOTIFY, OCCUPY, OCC_BIT, TAKE_TICKET,
    TCNT_SHIFT, VACATE,
};
use crate::rdma::arith::field_delta;
use crate::rdma::{Endpoint, RemoteAddr, Verb};
use crate::rwlock::{LockError, Mode, RwLockClient};

/// The TCnt field of an internal node.
const TCNT_FIELD: u64 = ((1 << COUNTER_BITS) - 1) << TCNT_SHIFT;

/// Give back a ticket of an internal node that was never occupied (TCnt + 1).
const PASS_TICKET: u64 = field_delta(super::word::TCNT_SHIFT, super::word::COUNTER_BITS, 1);

/// Where an instance lives: the maximizer, then the nodes in level order.
///
/// | offset | what |
/// |---|---|
/// | 0 | maximizer (OR of the right borders of out-of-tree requests) |
/// | 8 | reserved |
/// | 16 + 8 (x - 1) | node x |
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CitronLayout {
    pub base: RemoteAddr,
    pub shape: TreeShape,
}

impl CitronLayout {
    const NODES: u64 = 16;

    /// Bytes of lock memory for a tree of `shape` (zeroed memory is an idle lock).
    pub fn bytes(shape: TreeShape) -> u64 {
        Self::NODES + 8 * shape.node_count()
    }

    pub fn maximizer(self) -> RemoteAddr {
        self.base
    }

    pub fn node(self, x: NodeIndex) -> RemoteAddr {
        self.base + (Self::NODES + 8 * (x.0 - 1))
    }
}

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

/// One node held for a request, and what its release must undo.
#[derive(Clone, Debug, PartialEq, Eq)]
struct HeldNode {
    node: NodeIndex,
    /// The leaf bits taken, or `None` for an internal node.
    leaf_mask: Option<u64>,
    notified: Vec<NodeIndex>,
    /// All four child leaves were taken whole (§3.8 shortcut).
    children: bool,
}

/// A range held on a Citron instance; give it back with [`CitronClient::release`].
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a held range must be released"]
pub struct HeldRange {
    pub start: u64,
    pub end: u64,
    nodes: Vec<HeldNode>,
    spillover: bool,
}

impl HeldRange {
    /// The tree nodes held, for tests and diagnostics.
    pub fn nodes(&self) -> Vec<NodeIndex> {
        self.nodes.iter().map(|n| n.node).collect()
    }
}

/// Counters of one client's activity.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CitronStats {
    pub acquisitions: u64,
    /// Node acquisitions aborted (Inequation (1) or a scale-up) and retried.
    pub aborts: u64,
    /// Multi-node requests started over rather than wait while holding.
    pub restarts: u64,
    /// Leaves given up for their parents (starvation avoidance).
    pub leaf_escalations: u64,
    /// Words repaired after a dead client (§3.10).
    pub recoveries: u64,
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

/// The nodes a request holds while it locks its next one.
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

enum Attempt {
    Acquired(HeldNode),
    Aborted,
    /// Leaf starvation (Line 24): lock the parent instead.
    MoveToParent,
    /// A stalled occupied ancestor (§3.10, Line 18): lock it instead.
    MoveTo(NodeIndex),
}

/// What Step 2(b) found.
enum Ancestors {
    /// No occupied ancestor; the oldest t1 (Inequation (1)).
    Clear(Instant),
    /// The root's Exp is set: a scale-up is under way (line 15).
    Expanded,
    /// An occupied ancestor made no progress for T_lease (§3.10).
    Stalled(NodeIndex),
}

/// How a watched wait ended.
enum Watch {
    Done(Instant),
    /// The watched bits did not move for the given time; the last word seen.
    Stalled(u64),
}

/// One client's handle to one Citron instance.
pub struct CitronClient {
    layout: CitronLayout,
    config: CitronConfig,
    spillover: Box<dyn RwLockClient>,
    stats: CitronStats,
    /// Recoveries made from `&self` paths; folded into `stats`.
    recoveries: std::cell::Cell<u64>,
}

impl CitronClient {
    /// `spillover` is the mutex for `[N, ∞)` (DSLR in the paper), used in
    /// exclusive mode.
    pub fn new(layout: CitronLayout, config: CitronConfig, spillover: Box<dyn RwLockClient>) -> Self {
        Self { layout, config, spillover, stats: CitronStats::default(), recoveries: std::cell::Cell::new(0) }
    }

    pub fn stats(&self) -> CitronStats {
        CitronStats { recoveries: self.stats.recoveries + self.recoveries.get(), ..self.stats }
    }

    pub fn layout(&self) -> CitronLayout {
        self.layout
    }

    /// Locks units `[l, r)` (Algorithm 1).
    pub fn acquire(&mut self, ep: &Endpoint, l: u64, r: u64) -> Result<HeldRange, LockError> {
        if l >= r {
            return Err(LockError::Misuse("empty range"));
        }
        let n = self.layout.shape.units();
        let mut held = HeldRange { start: l, end: r, nodes: Vec::new(), spillover: false };
        if r > n {
            self.spillover.acquire(ep, Mode::Exclusive)?;
            held.spillover = true;
            // OR the right border into the maximizer (masked-CAS with a zero
            // compare mask, §3.9.1).
            if let Err(e) = ep.masked_cas(self.layout.maximizer(), 0, 0, r, r) {
                let _ = self.release(ep, held);
                return Err(e.into());
            }
        }
        if l < n {
            let covers = self.layout.shape.split(l, r.min(n), self.config.k);
            let mut backoff = self.config.t_wait;
            loop {
                let mut others = Others { held: Vec::new(), restart: false };
                let mut failed = None;
                for &cover in &covers {
                    match self.lock_node(ep, cover, &mut others) {
                        Ok(h) => {
                            others.held.push(h);
                            if others.restart {
                                break;
                            }
                        }
                        Err(e) => {
                            failed = Some(e);
                            break;
                        }
                    }
                }
                if let Some(e) = failed {
                    held.nodes = others.held;
                    let _ = self.release(ep, held);
                    return Err(e);
                }
                if !others.restart {
                    held.nodes = others.held;
                    break;
                }
                // Gave way while holding: let go of everything and start over.
                self.yield_held(ep, &mut others)?;
                self.stats.restarts += 1;
                backoff_for(&mut backoff);
            }
        }
        self.stats.acquisitions += 1;
        Ok(held)
    }

    /// Before a wait: release the request's other nodes, so it never holds
    /// while waiting (see the module comment), and mark it for a restart.
    fn yield_held(&self, ep: &Endpoint, others: &mut Others) -> Result<(), LockError> {
        if others.held.is_empty() {
            return Ok(());
        }
        let mut verbs = Vec::new();
        for h in &others.held {
            self.release_verbs(h, &mut verbs);
        }
        others.held.clear();
        others.restart = true;
        for r in ep.execute(&verbs)? {
            r?;
        }
        Ok(())
    }

    /// Releases a range (Algorithm 3): every verb in one batch, then the
    /// spillover mutex.
    pub fn release(&mut self, ep: &Endpoint, held: HeldRange) -> Result<(), LockError> {
        let mut verbs = Vec::new();
        for h in &held.nodes {
            self.release_verbs(h, &mut verbs);
        }
        let result = ep
            .execute(&verbs)
            .map_err(LockError::from)
            .and_then(|replies| replies.into_iter().try_for_each(|r| r.map(|_| ()).map_err(LockError::from)));
        if held.spillover {
            self.spillover.release(ep)?;
        }
        result
    }

    fn release_verbs(&self, h: &HeldNode, verbs: &mut Vec<Verb>) {
        let shape = self.layout.shape;
        let addr = self.layout.node(h.node);
        match h.leaf_mask {
            Some(mask) => {
                verbs.push(Verb::MaskedCas { addr, cmp: mask, cmp_mask: mask, swap: 0, swap_mask: mask })
            }
            // A leaf whose bits were not taken (a failed masked-CAS being
            // rolled back): only its notifications are undone.
            None if shape.is_leaf(h.node) => {}
            None => verbs.push(Verb::MaskedFaa { addr, add: VACATE, boundary_mask: BOUNDARIES }),
        }
        if h.children {
            // The §3.8 shortcut took all four child leaves whole; they are ours.
            for i in 0..4 {
                let child = self.layout.node(h.node.child(i));
                verbs.push(Verb::Write { addr: child, data: 0u64.to_le_bytes().to_vec() });
            }
        }
        for &a in &h.notified {
            verbs.push(Verb::MaskedFaa {
                addr: self.layout.node(a),
                add: DONE_BELOW,
                boundary_mask: BOUNDARIES,
            });
        }
    }

    fn lock_node(
        &mut self,
        ep: &Endpoint,
        mut cover: Cover,
        others: &mut Others,
    ) -> Result<HeldNode, LockError> {
        loop {
            match self.try_lock_node(ep, cover, others)? {
                Attempt::Acquired(h) => return Ok(h),
                Attempt::Aborted => self.stats.aborts += 1,
                Attempt::MoveToParent => {
                    self.stats.leaf_escalations += 1;
                    let leaf = cover.node;
                    cover.node = leaf.parent().expect("a leaf below the root has a parent");
                    let held = loop {
                        match self.try_lock_node(ep, cover, others)? {
                            Attempt::Acquired(h) => break h,
                            Attempt::Aborted => self.stats.aborts += 1,
                            Attempt::MoveTo(a) => cover.node = a,
                            Attempt::MoveToParent => unreachable!("only leaves escalate"),
                        }
                    };
                    // §3.10, Line 22: holding the parent, no live client can
                    // hold bits of the leaf; any left belong to a dead one.
                    let addr = self.layout.node(leaf);
                    if ep.read_u64(addr)? != 0 && !held.children {
                        log::warn!("zeroing leaf {} left locked by a dead client", leaf.0);
                        ep.write_u64(addr, 0)?;
                        self.stats.recoveries += 1;
                    }
                    return Ok(held);
                }
                Attempt::MoveTo(ancestor) => cover.node = ancestor,
            }
        }
    }

    /// Algorithm 2, lines 8–37, for one node.
    fn try_lock_node(&self, ep: &Endpoint, cover: Cover, others: &mut Others) -> Result<Attempt, LockError> {
        let shape = self.layout.shape;
        let node = cover.node;
        let addr = self.layout.node(node);
        let leaf = shape.is_leaf(node);
        let ancestors: Vec<NodeIndex> = shape.ancestors(node).collect();
        // Round trip 1 (§3.8: Steps 2(a) and 2(b) optimistically batched):
        // take the ticket of an internal node and read every ancestor.
        let mut batch = ep.batch();
        let ticket_slot = (!leaf)
            .then(|| batch.push(Verb::MaskedFaa { addr, add: TAKE_TICKET, boundary_mask: BOUNDARIES }));
        for &a in &ancestors {
            batch.push(Verb::Read { addr: self.layout.node(a), len: 8 });
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
            let t1 = match self.wait_for_ancestors(ep, &ancestors, others, prefetched.take())? {
                Ancestors::Clear(t1) => t1,
                outcome => {
                    if !leaf {
                        ep.masked_faa(addr, PASS_TICKET, BOUNDARIES)?;
                    }
                    return Ok(match outcome {
                        Ancestors::Stalled(a) => Attempt::MoveTo(a),
                        _ => Attempt::Aborted,
                    });
                }
            };
            // Round trip 2 (§3.8: Steps 2(c) and 2(d) batched): lock the
            // leaf's bits or occupy the node, notify the ancestors, read the
            // root; and, for a node whose children are leaves, try to take
            // all their bits so no wait for descendants is needed.
            let notified = self.notify_set(node);
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
                        let c = self.layout.node(node.child(i));
                        batch.push(Verb::MaskedCas { addr: c, cmp: 0, cmp_mask: !0, swap: !0, swap_mask: !0 })
                    })
                    .collect()
            } else {
                Vec::new()
            };
            let notify_slots: Vec<_> = notified
                .iter()
                .map(|&a| {
                    batch.push(Verb::MaskedFaa {
                        addr: self.layout.node(a),
                        add: NOTIFY,
                        boundary_mask: BOUNDARIES,
                    })
                })
                .collect();
            let root = batch.push(Verb::Read { addr: self.layout.node(NodeIndex::ROOT), len: 8 });
            let replies = batch.submit()?;
            let t2 = Instant::now();
            let children_taken: Vec<bool> =
                child_slots.iter().map(|&s| replies.old(s).map(|old| old == 0)).collect::<Result<_, _>>()?;
            let mut held = HeldNode {
                node,
                leaf_mask,
                notified,
                children: children_taken.iter().all(|&t| t) && children_are_leaves,
            };
            if let Some(e) = replies.first_error() {
                let e = e.clone();
                self.undo_partial(ep, &held, &children_taken)?;
                return Err(e.into());
            }
            if let Some(mask) = leaf_mask {
                if replies.old(lock_slot)? & mask != 0 {
                    // Line 26: the bits are taken. Roll back the notification
                    // (§3.8) and go back to 2(b).
                    held.leaf_mask = None;
                    self.undo_partial(ep, &held, &[])?;
                    self.yield_held(ep, others)?;
                    cas_failures += 1;
                    if cas_failures >= self.config.leaf_patience && node != NodeIndex::ROOT {
                        return Ok(Attempt::MoveToParent);
                    }
                    continue;
                }
            }
            // Inequation (1): we finished notifying before any ancestor's
            // holder could have stopped waiting for us (line 32); and no
            // scale-up is under way (line 33).
            let budget = self.config.t_wait.mul_f64(1.0 - self.config.drift);
            let scaled = match notify_slots.last() {
                Some(&s) => Internal(replies.old(s)?).expanded() && Internal(replies.u64(root)?).expanded(),
                None => false,
            };
            if t2.duration_since(t1) > budget || scaled {
                self.undo_partial(ep, &held, &children_taken)?;
                return Ok(Attempt::Aborted);
            }
            if !leaf && !held.children {
                // Some child bits were busy: give back those we took, then
                // the regular path. Line 34: t0 is after our Occ is visible
                // (the batch completed), so waiting from it is conservative.
                self.clear_children(ep, node, &children_taken)?;
                let t0 = t2;
                while t0.elapsed() < self.config.t_wait {
                    std::hint::spin_loop();
                }
                self.wait_for_descendants(ep, node, others)?;
            }
            return Ok(Attempt::Acquired(held));
        }
    }

    /// Clears the child leaves taken by the §3.8 shortcut (`taken[i]`).
    fn clear_children(&self, ep: &Endpoint, node: NodeIndex, taken: &[bool]) -> Result<(), LockError> {
        let verbs: Vec<Verb> = taken
            .iter()
            .enumerate()
            .filter(|(_, t)| **t)
            .map(|(i, _)| Verb::Write {
                addr: self.layout.node(node.child(i as u64)),
                data: 0u64.to_le_bytes().to_vec(),
            })
            .collect();
        for r in ep.execute(&verbs)? {
            r?;
        }
        Ok(())
    }

    /// Undoes an attempt whose children shortcut may have taken some leaves.
    fn undo_partial(&self, ep: &Endpoint, held: &HeldNode, children_taken: &[bool]) -> Result<(), LockError> {
        if !held.children {
            self.clear_children(ep, held.node, children_taken)?;
        }
        self.undo(ep, held)
    }

    /// Releases what a failed attempt at one node took.
    fn undo(&self, ep: &Endpoint, held: &HeldNode) -> Result<(), LockError> {
        let mut verbs = Vec::new();
        self.release_verbs(held, &mut verbs);
        for r in ep.execute(&verbs)? {
            r?;
        }
        Ok(())
    }

    /// Step 2(b). Returns the oldest t1 over all ancestors, or `None` when the
    /// root says the tree is being scaled up (abort, line 15).
    fn wait_for_ancestors(
        &self,
        ep: &Endpoint,
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
                        ancestors.iter().map(|&a| Verb::Read { addr: self.layout.node(a), len: 8 }).collect();
                    (posted, read_words(&ep.execute(&verbs)?)?)
                }
            };
            if words.last().is_some_and(|w| w.expanded()) {
                return Ok(Ancestors::Expanded);
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
            let addr = self.layout.node(ancestors[next]);
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
    fn notify_set(&self, node: NodeIndex) -> Vec<NodeIndex> {
        let shape = self.layout.shape;
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
    /// have no request between notifying and releasing. One read per level.
    fn wait_for_descendants(
        &self,
        ep: &Endpoint,
        node: NodeIndex,
        others: &mut Others,
    ) -> Result<(), LockError> {
        let shape = self.layout.shape;
        let level = shape.level_of(node);
        let pos = node.0 - level_start(level);
        let mut pending = Vec::new();
        let mut blocks = Vec::new();
        for i in 0..self.config.m {
            let lvl = level + i;
            if lvl >= shape.depth() {
                break; // leaves carry no counters
            }
            let first = NodeIndex(level_start(lvl) + pos * (1u64 << (2 * i)));
            let count = 1u64 << (2 * i);
            blocks.push((first, count));
        }
        let verbs: Vec<Verb> = blocks
            .iter()
            .map(|&(first, count)| Verb::Read { addr: self.layout.node(first), len: (8 * count) as u32 })
            .collect();
        for ((first, _), r) in blocks.iter().zip(ep.execute(&verbs)?) {
            let crate::rdma::VerbReply::Data(d) = r? else {
                return Err(LockError::Host("unexpected read reply".into()));
            };
            for (j, w) in d.chunks_exact(8).enumerate() {
                let w = Internal(u64::from_le_bytes(w.try_into().expect("8 bytes")));
                if !w.descendants_quiet() {
                    pending.push(NodeIndex(first.0 + j as u64));
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
            let addr = self.layout.node(desc);
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
