//! Acquiring a range (citron-fast23.md Algorithms 1 and 2, §3.5, with the
//! fast paths of §3.8): the spillover mutex and the maximizer for the part
//! past the tree, then each node of the split through phases 2(a)–2(d), with
//! Inequation (1) deciding whether a node's notifications came in time. The
//! rule that a request never waits while holding tree nodes, and why, is in
//! the module comment of [`super`].

use std::time::{Duration, Instant};

use super::recovery::Progress;
use super::waits::Ancestors;
use super::{read_words, CitronClient, Early, HeldNode, HeldRange, Riding, PASS_TICKET};
use crate::citron::geometry::SegmentedTree;
use crate::citron::scale::Anchor;
use crate::citron::tree::{Cover, NodeIndex, TreeShape};
use crate::citron::tuning::{TWaitWord, WaitWindow};
use crate::citron::word::{Internal, Ticket, BOUNDARIES, NOTIFY, OCCUPY, TAKE_TICKET};
use crate::rdma::{Endpoint, Verb, VerbError, VerbReply};
use crate::rwlock::{LockError, Mode, Riders};

/// The nodes a request holds while it locks its next one.
#[derive(Default)]
pub(super) struct Others {
    pub(super) held: Vec<HeldNode>,
    /// It gave way while holding: start the request over once this node is done.
    pub(super) restart: bool,
}

/// Sleeps a random time up to `*cap` and doubles the cap (up to `max`).
fn backoff_for(cap: &mut Duration, max: Duration) {
    let nanos = cap.as_nanos().max(1) as u64;
    // A cheap random draw: the clock's nanoseconds, mixed.
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let jitter = (u64::from(now.subsec_nanos()) ^ u64::from(std::process::id()))
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        >> 16;
    std::thread::sleep(Duration::from_nanos(jitter % nanos));
    *cap = (*cap * 2).min(max);
}

/// The longest backoff between two attempts of one request, restarts and
/// aborts alike: 1 ms, or 16 `T_wait` if that is longer (a far client's
/// attempts take several ms each, and so may its backoff).
fn max_backoff(t_wait: Duration) -> Duration {
    (t_wait * 16).max(Duration::from_millis(1))
}

/// Waits until `deadline`: sleeps while more than a timer slack is left
/// (a published `T_wait` can be tens of ms, which must not be spun away on
/// a loaded machine), then spins. Waiting longer than asked is always safe
/// here.
fn wait_until(deadline: Instant) {
    const SLACK: Duration = Duration::from_micros(100);
    loop {
        let now = Instant::now();
        if now >= deadline {
            return;
        }
        let left = deadline - now;
        if left > SLACK {
            std::thread::sleep(left - SLACK / 2);
        } else {
            std::hint::spin_loop();
        }
    }
}

/// How locking one node of a request ended.
enum NodeOutcome {
    Held(HeldNode),
    /// The tree changed (scale-up): start the request over.
    Superseded,
    /// Too many aborts: lock the root instead of the request's nodes; and
    /// the leaf that kept refusing its bits on the way, if any, whose
    /// leftovers the root's holder clears (Line 22 from the root).
    ToRoot(Option<NodeIndex>),
}

/// Where a requested range ends.
#[derive(Clone, Copy, Debug)]
enum RangeEnd {
    At(u64),
    /// To infinity ([`CitronClient::acquire_to_end`]).
    Infinite,
}

/// The aborts of one node of a request, and the backoff between them.
struct Aborts {
    count: u32,
    limit: u32,
    cap: Duration,
    max: Duration,
}

impl Aborts {
    fn new(config: &super::CitronConfig) -> Self {
        Self { count: 0, limit: config.max_aborts, cap: config.t_wait, max: max_backoff(config.t_wait) }
    }

    /// Counts an abort of an attempt at `node`; `true` if the request
    /// should lock the root now, else after backing off.
    fn one_more(&mut self, node: NodeIndex) -> bool {
        self.count += 1;
        if self.count >= self.limit && node != NodeIndex::ROOT {
            return true;
        }
        backoff_for(&mut self.cap, self.max);
        false
    }
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

impl CitronClient {
    /// Locks units `[l, r)` (Algorithm 1).
    pub fn acquire(&mut self, ep: &Endpoint, l: u64, r: u64) -> Result<HeldRange, LockError> {
        if l >= r {
            return Err(LockError::Misuse("empty range"));
        }
        self.acquire_until(ep, l, RangeEnd::At(r))
    }

    /// [`CitronClient::acquire`], with `riders` (reads of memory behind
    /// the same endpoint) riding on the batch of Steps 2(c)+(d) that takes
    /// the request's node, right after its lock and notify verbs: their
    /// replies if that batch took the node and nothing was waited for
    /// after it, else `None` (the caller reads them again).
    ///
    /// Why the replies are read under the lock: the verbs of one endpoint
    /// execute in order, so the reads ran after our bits or our Occ and
    /// our notifications were in place. If Inequation (1) then holds (we
    /// are not aborting), any holder of an ancestor that occupied it after
    /// our ancestor read waits for our notification and then for our
    /// release; one that occupied it before, we saw occupied and waited
    /// for. Conflicting requests on the node itself are excluded by its
    /// leaf bits or its bakery. So nobody changes our units between the
    /// batch and our release, exactly as for reads posted after the
    /// acquisition returned. Only a request of one node carries them (a
    /// later node of a request may yet make it start over), and not an
    /// internal node that still waits for descendants after its batch.
    pub fn acquire_with_reads(
        &mut self,
        ep: &Endpoint,
        l: u64,
        r: u64,
        riders: &[Verb],
    ) -> Result<(HeldRange, Riders), LockError> {
        let early = std::mem::take(&mut self.riding.early);
        self.riding = Riding { early, verbs: riders.to_vec(), armed: false, replies: None };
        let held = self.acquire(ep, l, r);
        let replies = std::mem::take(&mut self.riding).replies;
        Ok((held?, replies))
    }

    /// Reads to post ahead of acquiring `[l, r)`, in a batch of the
    /// caller's own on the same endpoint (one that must be waited for
    /// anyway before the acquisition): the Step 2(b) read of the ancestors
    /// of the request's node, when that is one leaf, since a leaf takes no
    /// ticket first (Step 2(a) is for internal nodes). Their replies go to
    /// [`CitronClient::early_replies`]; the next acquisition of that leaf
    /// then starts from them instead of reading, with t1 the post time of
    /// the caller's batch: earlier than its own read would have been, so
    /// Inequation (1) only gets stricter. Empty when there is nothing to
    /// read early.
    pub fn early_reads(&mut self, l: u64, r: u64) -> Vec<Verb> {
        self.riding.early = Early::None;
        let cur = self.current.clone();
        let shape = cur.tree.shape();
        if l >= r || r > shape.units() || self.own.overlapping(l, r).is_some() {
            return Vec::new();
        }
        let covers = shape.split(l, r, self.config.k);
        let [cover] = covers.as_slice() else { return Vec::new() };
        if !shape.is_leaf(cover.node) || self.own.container(shape.key(cover.node), self.on_time()).is_some() {
            return Vec::new();
        }
        self.riding.early = Early::Planned { leaf: cover.node, version: cur.geometry.version };
        shape.ancestors(cover.node).map(|a| Verb::Read { addr: cur.tree.node(a), len: 8 }).collect()
    }

    /// The replies of [`CitronClient::early_reads`], and when their batch
    /// was posted; `None` if it did not answer them (they are read then).
    pub fn early_replies(&mut self, early: Option<(Instant, &[Result<VerbReply, VerbError>])>) {
        let planned = std::mem::take(&mut self.riding.early);
        let (Early::Planned { leaf, version }, Some((posted, replies))) = (planned, early) else { return };
        if let Ok(words) = read_words(replies) {
            self.riding.early = Early::Read { leaf, version, posted, words };
        }
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
        let units_end = match end {
            RangeEnd::At(r) => r,
            RangeEnd::Infinite => u64::MAX,
        };
        if self.own.overlapping(l, units_end).is_some() {
            return Err(LockError::Misuse(
                "a Citron client asked for a range that overlaps one it holds (it would wait for itself)",
            ));
        }
        loop {
            let version = self.current.geometry.version;
            if let Some(held) = self.acquire_once(ep, l, end)? {
                self.stats.acquisitions += 1;
                self.own.add(l, units_end, &held.nodes);
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
        let units_end = match end {
            RangeEnd::At(r) => r,
            RangeEnd::Infinite => u64::MAX,
        };
        let mut held = HeldRange { start: l, end: r, nodes: Vec::new(), units_end, spillover: false, shape };
        self.riding.replies = None;
        self.riding.armed = false;
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
            // A cover inside an internal node this client holds for another
            // range rides on it (see [`super::own`]): locking it would wait
            // for ourselves in Step 2(a) or 2(b).
            let on_time = self.on_time();
            let mut riding: Vec<HeldNode> = Vec::new();
            let mut covers = Vec::new();
            for c in shape.split(l, r.min(n), self.config.k) {
                match self.own.container(shape.key(c.node), on_time) {
                    Some(h) if !riding.contains(h) => riding.push(h.clone()),
                    Some(_) => {}
                    None => covers.push(c),
                }
            }
            self.riding.armed =
                !self.riding.verbs.is_empty() && !held.spillover && riding.is_empty() && covers.len() == 1;
            if !covers.is_empty() {
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
            held.nodes.extend(riding);
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
        let max = max_backoff(self.config.t_wait);
        // Once the request has aborted too often, the root alone (the bounded
        // path of the module comment).
        let root = [Cover {
            node: NodeIndex::ROOT,
            start: covers.iter().map(|c| c.start).min().unwrap_or(0),
            end: covers.iter().map(|c| c.end).max().unwrap_or(0),
        }];
        let mut covers = covers;
        let mut refusing_leaf = None;
        loop {
            let mut others = Others::default();
            let mut outcome = Ok(true);
            for &cover in covers {
                match self.lock_node(ep, cover, shape, &mut others) {
                    Ok(NodeOutcome::Held(h)) => {
                        others.held.push(h);
                        if others.restart {
                            break;
                        }
                    }
                    Ok(NodeOutcome::ToRoot(leaf)) => {
                        self.stats.root_escalations += 1;
                        refusing_leaf = refusing_leaf.or(leaf);
                        covers = &root;
                        others.restart = true;
                        break;
                    }
                    Ok(NodeOutcome::Superseded) => {
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
                Ok(true) if !others.restart => {
                    if let (Some(leaf), [held]) = (refusing_leaf, others.held.as_mut_slice()) {
                        // Holding the root is holding the leaf's parent and
                        // more: Line 22 applies as from the parent.
                        let cur = self.current.clone();
                        let addr = cur.tree.key(shape.key(leaf));
                        let mut marks = Progress::of_held(&cur.tree, held, self.tick());
                        self.clear_dead_leaf_bits(ep, addr, (leaf, shape.key(leaf)), &mut marks)?;
                        held.acquired_at = Instant::now();
                        self.riding.replies = None;
                    }
                    return Ok(Some(others.held));
                }
                Ok(true) => {
                    // Gave way while holding: let go of everything, start over.
                    self.yield_held(ep, &mut others)?;
                    self.stats.restarts += 1;
                    backoff_for(&mut backoff, max);
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
    pub(super) fn yield_held(&mut self, ep: &Endpoint, others: &mut Others) -> Result<(), LockError> {
        if others.held.is_empty() {
            return Ok(());
        }
        let nodes = std::mem::take(&mut others.held);
        others.restart = true;
        self.release_nodes(ep, &nodes, Vec::new())
    }

    fn lock_node(
        &mut self,
        ep: &Endpoint,
        mut cover: Cover,
        shape: TreeShape,
        others: &mut Others,
    ) -> Result<NodeOutcome, LockError> {
        let mut aborts = Aborts::new(&self.config);
        loop {
            // A release on the way may have followed a newer configuration:
            // `cover` is an index of the old tree, so start the request over.
            if self.current.tree.shape() != shape {
                return Ok(NodeOutcome::Superseded);
            }
            match self.try_lock_node(ep, cover, others)? {
                Attempt::Acquired(h) => return Ok(NodeOutcome::Held(h)),
                Attempt::Superseded => return Ok(NodeOutcome::Superseded),
                Attempt::Aborted => {
                    self.stats.aborts += 1;
                    if aborts.one_more(cover.node) {
                        return Ok(NodeOutcome::ToRoot(None));
                    }
                }
                Attempt::MoveToParent => {
                    self.stats.leaf_escalations += 1;
                    let leaf = cover.node;
                    cover.node = leaf.parent().expect("a leaf below the root has a parent");
                    let held = loop {
                        if self.current.tree.shape() != shape {
                            return Ok(NodeOutcome::Superseded);
                        }
                        match self.try_lock_node(ep, cover, others)? {
                            Attempt::Acquired(h) => break h,
                            Attempt::Superseded => return Ok(NodeOutcome::Superseded),
                            Attempt::Aborted => {
                                self.stats.aborts += 1;
                                if aborts.one_more(cover.node) {
                                    // The leaf's bits, if a dead client's,
                                    // are cleared once the root is held.
                                    return Ok(NodeOutcome::ToRoot(Some(leaf)));
                                }
                            }
                            Attempt::MoveTo(a) => cover.node = a,
                            Attempt::MoveToParent => unreachable!("only leaves escalate"),
                        }
                    };
                    let mut held = held;
                    // Held through the parent: the riders are read again.
                    self.riding.replies = None;
                    if !held.children {
                        let cur = self.current.clone();
                        let addr = cur.tree.key(shape.key(leaf));
                        let mut marks = Progress::of_held(&cur.tree, &held, self.tick());
                        self.clear_dead_leaf_bits(ep, addr, (leaf, shape.key(leaf)), &mut marks)?;
                        held.acquired_at = Instant::now();
                    }
                    return Ok(NodeOutcome::Held(held));
                }
                Attempt::MoveTo(ancestor) => cover.node = ancestor,
            }
        }
    }

    /// Algorithm 2, lines 8–37, for one node.
    fn try_lock_node(
        &mut self,
        ep: &Endpoint,
        cover: Cover,
        others: &mut Others,
    ) -> Result<Attempt, LockError> {
        self.riding.replies = None;
        let cur = self.current.clone();
        let tree = &cur.tree;
        let shape = tree.shape();
        let node = cover.node;
        let addr = tree.node(node);
        let leaf = shape.is_leaf(node);
        let ancestors: Vec<NodeIndex> = shape.ancestors(node).collect();
        // A leaf whose ancestors the caller read early (for this tree)
        // starts from that reading.
        let early = match std::mem::take(&mut self.riding.early) {
            Early::Read { leaf: l, version, posted, words }
                if leaf && l == node && version == cur.geometry.version && words.len() == ancestors.len() =>
            {
                Some((posted, words))
            }
            _ => None,
        };
        if let Some(prefetched) = early {
            return self.lock_node_from(ep, cover, others, None, Some(prefetched));
        }
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
        let mut ticket = None;
        if let Some(slot) = ticket_slot {
            // Phase 2(a) (lines 10–11): the bakery lock of an internal node.
            let old = replies.old(slot)?;
            let mine = Ticket::from_old_word(old);
            if !mine.is_served(Internal(old)) {
                // Not served at once: the ancestors read before we were is stale.
                prefetched = None;
                self.yield_held(ep, others)?;
                self.wait_for_ticket(ep, addr, mine)?;
            }
            ticket = Some(mine);
        }
        self.lock_node_from(ep, cover, others, ticket, prefetched)
    }

    /// Algorithm 2 from Step 2(b) on, for `cover`'s node with its
    /// `ticket` (an internal node's, served) and a reading of its
    /// ancestors already made (`prefetched`: when it was posted, and the
    /// words).
    fn lock_node_from(
        &mut self,
        ep: &Endpoint,
        cover: Cover,
        others: &mut Others,
        ticket: Option<Ticket>,
        mut prefetched: Option<(Instant, Vec<Internal>)>,
    ) -> Result<Attempt, LockError> {
        let cur = self.current.clone();
        let tree = &cur.tree;
        let shape = tree.shape();
        let node = cover.node;
        let key = shape.key(node);
        let addr = tree.node(node);
        let leaf = shape.is_leaf(node);
        let ancestors: Vec<NodeIndex> = shape.ancestors(node).collect();
        // While we wait in 2(b) with our ticket served, the node's waiters
        // must see us alive (the recovery module's progress marks).
        let floor = ticket.map(|_| addr);
        let mut cas_failures = 0;
        loop {
            // Phase 2(b): wait for occupied ancestors (lines 12–19).
            let t1 = match self.wait_for_ancestors(ep, tree, &ancestors, others, prefetched.take(), floor)? {
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
            // The cluster's T_wait, read after our lock verb and our
            // notifications: both our budget and our wait come from this
            // reading (the argument is in `tuning`).
            let tuning_slot =
                self.config.published_t_wait.map(|word| batch.push(Verb::Read { addr: word, len: 8 }));
            // The caller's reads, last (see `acquire_with_reads`).
            let riders = self.riding.armed.then(|| {
                let first = batch.len();
                for v in &self.riding.verbs {
                    batch.push(v.clone());
                }
                first..batch.len()
            });
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
                ticket,
                acquired_at: t2,
            };
            if let Some(e) = replies.first_error() {
                let e = e.clone();
                self.undo_partial(ep, tree, &held, &children_taken)?;
                return Err(e.into());
            }
            let window = match tuning_slot {
                Some(slot) => WaitWindow::read(TWaitWord(replies.u64(slot)?), self.config.t_wait),
                None => WaitWindow::fixed(self.config.t_wait),
            };
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
            // ancestor's holder could have stopped waiting for us. A node
            // that notifies nobody (the root) has nothing to be late for.
            let budget = window.budget.mul_f64(1.0 - self.config.drift);
            if !notified.is_empty() && t2.duration_since(t1) > budget {
                self.undo_partial(ep, tree, &held, &children_taken)?;
                return Ok(Attempt::Aborted);
            }
            if !leaf && !held.children {
                // Some child bits were busy: give back those we took, then
                // the regular path. Line 34: t0 is after our Occ is visible
                // (the batch completed), so waiting from it is conservative.
                self.clear_children(ep, tree, node, &children_taken)?;
                let t0 = t2;
                wait_until(t0 + window.wait);
                let mut marks = Progress::of_held(tree, &held, self.tick());
                self.wait_for_descendants(ep, tree, node, others, &mut marks)?;
                held.acquired_at = Instant::now();
            } else if let Some(riders) = riders {
                self.riding.replies = Some(replies.as_slice()[riders].to_vec());
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
}
