//! What one client holds, so that it never waits for itself.
//!
//! The paper's client holds one range at a time; ours may hold several
//! disjoint ones ([`crate::range_lock`]: one client per thread and
//! instance). The tree cannot tell whose a lock word's marks are, and a
//! split (§3.5.1) covers a range with nodes that may reach past it, so a
//! second range of one client can meet the first one's marks in three ways,
//! and before this module it waited for them until lease recovery (§3.10)
//! took its own first range over, whose release then answered `Fenced`:
//!
//! * **Step 2(d), Lines 35–36** (a node *above* a held one: an over-covering
//!   split, a leaf given up for its parent (Line 24), the root taken after
//!   too many aborts): the held range's notifications sit in the DMax of
//!   the new node or of its descendants within m levels, and DCnt = DMax
//!   never holds. The paper's wait is for requests that notified before the
//!   holder's window closed and have not released; our own held range is
//!   exactly such a request, but one that cannot release while we wait. Its
//!   units are disjoint from the new range, so the exclusion that 2(d)
//!   protects is not at stake: a word is quiet for us when DMax − DCnt is
//!   the number of our own pending notifications on it ([`Own::pending`]).
//!   They are counted on the words the release would raise DCnt on: the
//!   notified nodes, and the chain a scale-up carried the anchor to
//!   ([`carried_to`], Alg. 3 lines 10–12), so this holds after scale-ups.
//!   Line 36 levels a stalled word to DMax minus ours, not to DMax.
//! * **Line 22** (a leaf refusing its bits, cleared from the parent): our
//!   own bits in that leaf are not a dead client's; only the other bits are
//!   watched and cleared ([`Own::leaf_bits`]).
//! * **Steps 2(a) and 2(b)** (a node *inside* a held internal node: the
//!   held node's split reached over the new range): we would queue on our
//!   own bakery or wait for our own occupied ancestor. Every unit under a
//!   held internal node is already excluded from every other client (2(b)
//!   makes them wait for it, and its 2(d) waited for those below), so the
//!   new range *rides* on it: no verb, one more user of the held node, which
//!   goes back to the tree when its last range is released
//!   ([`Own::remove`]). A ride keeps the held node's lease: a range that
//!   rides is due when the node is.
//!
//! Only nodes still within their lease count ([`CitronClient::on_time`]): a
//! late one is released without undoing its notifications or bits (see
//! `release`), so recovery may and must level and clear them, as for a dead
//! client; and no recovery acts on a word before our node on it is late
//! (its stall starts after our own mark moved the word).

use std::time::{Duration, Instant};

use super::HeldNode;
use crate::citron::scale::{carried_to, Anchor};
use crate::citron::tree::NodeKey;

/// A held node and how many of the client's ranges use it.
#[derive(Debug)]
struct Owned {
    node: HeldNode,
    users: u32,
}

/// The nodes and ranges one client holds.
#[derive(Debug, Default)]
pub(super) struct Own {
    nodes: Vec<Owned>,
    /// The ranges held, `[start, end)` (`end = u64::MAX`: to infinity).
    ranges: Vec<(u64, u64)>,
}

/// Whether node `inner` lies inside node `outer` (or is it).
fn inside(inner: NodeKey, outer: NodeKey) -> bool {
    inner.height <= outer.height && inner.ancestor_at(outer.height) == outer
}

/// Words where one held node's release adds DCnt, given the tree's
/// generations (`depths`, oldest first): its notified nodes and, when a
/// scale-up has carried its anchor, the carried chain, followed on while
/// its top was carried again (as `release::follow_carried` does).
fn pending_words(h: &HeldNode, depths: &[u32], m: u32) -> Vec<NodeKey> {
    let mut words = h.notified.clone();
    let Some(mut anchor) = h.anchor else { return words };
    if h.anchor_marked {
        return words; // a scale-up read the anchor first: nothing was carried
    }
    while let Some(chain) = carried_to(anchor, depths, m) {
        let Some(&top) = chain.last() else { break };
        words.extend(chain);
        anchor = Anchor::Notified(top);
    }
    words
}

impl Own {
    /// A request for `[l, end)` (`end = u64::MAX`: to infinity) that meets
    /// a range this client holds: it would wait for itself for ever.
    pub fn overlapping(&self, l: u64, end: u64) -> Option<(u64, u64)> {
        self.ranges.iter().copied().find(|&(a, b)| a < end && l < b)
    }

    /// The held internal node (on time, see the module comment) inside
    /// which node `k` lies, if any: a cover there rides on it.
    pub fn container(&self, k: NodeKey, on_time: Duration) -> Option<&HeldNode> {
        self.nodes
            .iter()
            .map(|o| &o.node)
            .find(|h| !h.leaf && h.acquired_at.elapsed() < on_time && inside(k, h.key))
    }

    /// Records a granted range and its nodes (one more user of each).
    pub fn add(&mut self, start: u64, end: u64, nodes: &[HeldNode]) {
        self.ranges.push((start, end));
        for n in nodes {
            match self.nodes.iter_mut().find(|o| o.node == *n) {
                Some(o) => o.users += 1,
                None => self.nodes.push(Owned { node: n.clone(), users: 1 }),
            }
        }
    }

    /// Forgets a range: one user less for each of its nodes; returns the
    /// nodes no held range uses any more, which the caller releases.
    pub fn remove(&mut self, start: u64, end: u64, nodes: &[HeldNode]) -> Vec<HeldNode> {
        if let Some(i) = self.ranges.iter().position(|&r| r == (start, end)) {
            self.ranges.swap_remove(i);
        }
        let mut free = Vec::new();
        for n in nodes {
            match self.nodes.iter().position(|o| o.node == *n) {
                Some(i) => {
                    self.nodes[i].users -= 1;
                    if self.nodes[i].users == 0 {
                        free.push(self.nodes.swap_remove(i).node);
                    }
                }
                // Not recorded (a range acquired before it was tracked
                // cannot exist; be safe and release it).
                None => free.push(n.clone()),
            }
        }
        free
    }

    /// Our bits in the leaf called `k` (of nodes on time).
    pub fn leaf_bits(&self, k: NodeKey, on_time: Duration) -> u64 {
        self.nodes
            .iter()
            .map(|o| &o.node)
            .filter(|h| h.key == k && h.acquired_at.elapsed() < on_time)
            .filter_map(|h| h.leaf_mask)
            .fold(0, |a, b| a | b)
    }

    /// Our pending notifications, per held node: when it was acquired and
    /// the words it has pending ([`pending_words`]). Count them with
    /// [`PendingOwn::on`].
    pub fn pending(&self, depths: &[u32], m: u32) -> PendingOwn {
        PendingOwn {
            nodes: self
                .nodes
                .iter()
                .map(|o| (o.node.acquired_at, pending_words(&o.node, depths, m)))
                .filter(|(_, words)| !words.is_empty())
                .collect(),
        }
    }
}

/// Our pending notifications, taken at the start of a Step 2(d) wait (the
/// configuration cannot change during it; the leases can, so they are
/// checked at each count).
pub(super) struct PendingOwn {
    nodes: Vec<(Instant, Vec<NodeKey>)>,
}

impl PendingOwn {
    /// How many of our nodes still on time have a notification pending on
    /// the word of node `k`.
    pub fn on(&self, k: NodeKey, on_time: Duration) -> u64 {
        self.nodes
            .iter()
            .filter(|(at, _)| at.elapsed() < on_time)
            .map(|(_, words)| words.iter().filter(|&&w| w == k).count() as u64)
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nodes_inside_nodes() {
        let root = NodeKey { height: 2, pos: 0 };
        let leaf = NodeKey { height: 0, pos: 9 };
        assert!(inside(leaf, root));
        assert!(inside(root, root));
        assert!(!inside(root, leaf));
        assert!(inside(leaf, NodeKey { height: 1, pos: 2 }));
        assert!(!inside(leaf, NodeKey { height: 1, pos: 1 }));
    }
}
