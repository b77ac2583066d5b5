//! Scaling the lock tree (citron-fast23.md §3.9, Algorithm 4) and what a
//! release owes after one (Algorithm 3 lines 10–12).
//!
//! This module holds the arithmetic, as pure functions: which words of the
//! old tree a scale-up marks and where it carries their counters
//! ([`expansion_plan`]), and where a holder's notification or occupancy was
//! carried ([`carried_to`]). The verbs are in [`super::lock`].
//!
//! # The rule, and where it departs from the paper
//!
//! Every request at a node x leaves units in the DMax of some of x's
//! ancestors (Alg. 2 line 31): its parent and every m-th ancestor above it,
//! those in the top m-1 levels replaced by level m-1 (§3.5.5); exactly one of
//! them, the highest, lies in the top m levels. That is what lets a request
//! higher up meet it within m levels (meet-in-the-middle). A scale-up puts s
//! new levels above the old root, and the nodes there must meet the old
//! tree's requests too, so it extends each request's notifications upwards
//! (Alg. 4 lines 4–8): it reads each node v of the old top m levels and adds
//! v's DCnt and DMax to v's ancestors at distances m, 2m, … in the new tree.
//! Those are always new nodes (v is less than m below the old root).
//!
//! Two gaps in Algorithm 4 as printed, and what we do instead:
//!
//! 1. **The old root's occupant.** A request at the old root notified nobody
//!    (the root has no ancestors). The paper adds the root's Occ to its
//!    m-th, 2m-th, … ancestors, but a request at the old root's *parent*
//!    checks the old root (within its m levels) by DCnt = DMax, which ignores
//!    Occ, so it would not see the occupant. We carry the old root's Occ to
//!    its ancestors at distances 1, 1+m, 1+2m, …: its parent and every m-th
//!    above, which is exactly the set it would have notified had the new
//!    levels existed. Occ of the other top nodes is not carried: their
//!    occupants' highest notified node already is carried.
//!
//! 2. **One Exp bit for two meanings.** With a scale-up factor below 4^m a
//!    node stays in the top m levels for several scale-ups, so "Exp is set"
//!    cannot tell a client *which* scale-up read the node, i.e. whether its
//!    own unit was carried. We mark each node at most once with each of two
//!    bits (see [`super::word`]): Sup on the old root, set by every scale-up
//!    (a tree generation is superseded: Alg. 2 line 15), and Exp on a node
//!    whose counters are carried, set by the one scale-up that first puts the
//!    node m or more levels below the new root (a node that is still in the
//!    new tree's top m levels has no ancestor at distance m, so nothing is
//!    carried and nothing is marked; it will be marked by a later scale-up).
//!    Each mark is a masked-CAS with a zero compare mask that returns the
//!    word it marks, so a word's counters are read at the instant of its mark.
//!
//! With these, a request's units always sit on one chain: its highest
//! notified node w and w's ancestors at distances m, 2m, … in the current
//! tree (for the old root's occupant: the old root's ancestors at 1, 1+m, …),
//! and only the highest node of the chain is in the top m levels. A release
//! adds DCnt along the chain it knows; the old word that the verb on the
//! chain's top returns says whether a scale-up had read that node first
//! (its Exp, or the old root's Sup). If one had, the unit went on to the new
//! ancestors and the release follows it ([`carried_to`]), possibly waiting
//! for the scale-up to publish its configuration. A mark that was already
//! there when the request notified means the scale-up read the node before
//! the request's unit arrived: nothing was carried, and the request aborts
//! as stale (Alg. 2 line 33). The property test below checks both claims
//! (meet-in-the-middle across the new levels, and exactly balanced chains)
//! over random trees, requests and sequences of scale-ups.
//!
//! # Minimum factor
//!
//! 4× (one level), the paper's minimum. The marking rule above is what
//! makes factors below 4^m safe; the cost of a small factor is more descendant
//! reads in Step 2(d) for the leftmost nodes (at most m(m+1)/2 = 10 for
//! m = 4, see [`super::geometry`]).

use super::tree::NodeKey;
use super::word::{EXP_BIT, SUP_BIT};

/// Levels a scale-up adds at least: 4× the units.
pub const MIN_SCALE_LEVELS: u32 = 1;

/// What a scale-up does to one node of the old tree's top m levels.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mark {
    pub node: NodeKey,
    /// Bits to set ([`SUP_BIT`], [`EXP_BIT`]).
    pub bits: u64,
    /// New ancestors that receive the node's DCnt and DMax (Exp).
    pub counters_to: Vec<NodeKey>,
    /// New ancestors that receive one DMax unit if the node is occupied
    /// (the old root only; Sup).
    pub occupancy_to: Vec<NodeKey>,
}

/// Heights `from, from + step, …` up to `top`.
fn heights(from: u32, step: u32, top: u32) -> impl Iterator<Item = u32> {
    (0..).map(move |k| from + k * step).take_while(move |&h| h <= top)
}

/// The marks a scale-up from depth `old` to depth `new` makes, in index
/// order (the old root first), with where each node's units go.
pub fn expansion_plan(old: u32, new: u32, m: u32) -> Vec<Mark> {
    assert!(old >= 1 && new > old && m >= 1, "scale-up {old} -> {new} with m = {m}");
    let mut plan = Vec::new();
    // Leaves (level `old`) carry no counters.
    for level in 0..m.min(old) {
        let height = old - level;
        for pos in 0..1u64 << (2 * level) {
            let node = NodeKey { height, pos };
            let counters_to: Vec<NodeKey> =
                heights(height + m, m, new).map(|h| node.ancestor_at(h)).collect();
            let occupancy_to: Vec<NodeKey> = if level == 0 {
                heights(height + 1, m, new).map(|h| node.ancestor_at(h)).collect()
            } else {
                Vec::new()
            };
            let bits =
                if level == 0 { SUP_BIT } else { 0 } | if counters_to.is_empty() { 0 } else { EXP_BIT };
            if bits != 0 {
                plan.push(Mark { node, bits, counters_to, occupancy_to });
            }
        }
    }
    plan
}

/// The node where a holder's units end, and which mark says they moved on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Anchor {
    /// Its highest notified node (in the top m levels when it notified).
    Notified(NodeKey),
    /// The node itself, held while it was the tree's root.
    Occupied(NodeKey),
}

impl Anchor {
    /// The bit that, once set, says a scale-up carried this anchor's units.
    pub fn mark(self) -> u64 {
        match self {
            Anchor::Notified(_) => EXP_BIT,
            Anchor::Occupied(_) => SUP_BIT,
        }
    }

    pub fn node(self) -> NodeKey {
        match self {
            Anchor::Notified(k) | Anchor::Occupied(k) => k,
        }
    }
}

/// Where the scale-up that marked `anchor` carried its units, lowest first,
/// given the depths of the tree's generations (oldest first). `None` if that
/// scale-up is not among them yet (it has not published its configuration).
pub fn carried_to(anchor: Anchor, depths: &[u32], m: u32) -> Option<Vec<NodeKey>> {
    let (node, first, wanted) = match anchor {
        // Marked by the first scale-up that puts it m levels below the root.
        Anchor::Notified(k) => (k, k.height + m, k.height + m),
        // Marked by the scale-up from the generation it was the root of.
        Anchor::Occupied(k) => (k, k.height + 1, k.height + 1),
    };
    let depth = depths.iter().copied().find(|&d| d >= wanted)?;
    Some(heights(first, m, depth).map(|h| node.ancestor_at(h)).collect())
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};

    use proptest::prelude::*;

    use super::*;
    use crate::citron::lock::notify_levels;
    use crate::citron::tree::{NodeIndex, TreeShape};

    #[test]
    fn plans_for_small_and_large_factors() {
        // 4x with m = 4: the old root gets Sup and sends its occupancy to the
        // new root; level 3 (64 nodes) is now 4 below the new root: Exp.
        let plan = expansion_plan(5, 6, 4);
        assert_eq!(plan.len(), 65);
        assert_eq!(plan[0].bits, SUP_BIT);
        assert_eq!(plan[0].occupancy_to, vec![NodeKey { height: 6, pos: 0 }]);
        assert!(plan[0].counters_to.is_empty());
        assert!(plan[1..]
            .iter()
            .all(|p| p.bits == EXP_BIT && p.node.height == 2 && p.counters_to.len() == 1));
        // 256x: every node of the top 4 levels is carried.
        let plan = expansion_plan(5, 9, 4);
        assert_eq!(plan.len(), 85);
        assert_eq!(plan[0].bits, SUP_BIT | EXP_BIT);
        assert_eq!(plan[0].counters_to, vec![NodeKey { height: 9, pos: 0 }]);
        assert_eq!(plan[0].occupancy_to, vec![NodeKey { height: 6, pos: 0 }]);
        // A shallow tree: only its internal levels.
        assert_eq!(expansion_plan(1, 2, 4).len(), 1);
    }

    #[test]
    fn carried_chains() {
        let k = NodeKey { height: 3, pos: 5 };
        assert_eq!(carried_to(Anchor::Notified(k), &[5, 6], 4), None, "not yet 4 below a root");
        assert_eq!(carried_to(Anchor::Notified(k), &[5, 6, 7], 4), Some(vec![k.ancestor_at(7)]));
        assert_eq!(
            carried_to(Anchor::Notified(k), &[5, 12], 4),
            Some(vec![k.ancestor_at(7), k.ancestor_at(11)])
        );
        let root = NodeKey { height: 5, pos: 0 };
        assert_eq!(carried_to(Anchor::Occupied(root), &[5], 4), None);
        assert_eq!(
            carried_to(Anchor::Occupied(root), &[5, 11], 4),
            Some(vec![root.ancestor_at(6), root.ancestor_at(10)])
        );
    }

    /// A request in flight: where it sits and the nodes its units are in.
    #[derive(Debug)]
    struct Request {
        node: NodeKey,
        anchor: Anchor,
    }

    /// Symbolic counters: per node, the requests counted in its DMax.
    type Units = BTreeMap<NodeKey, BTreeSet<usize>>;

    /// Notifies as Alg. 2 line 31 does under a tree of `depth`.
    fn notify(units: &mut Units, id: usize, x: NodeKey, depth: u32, m: u32) -> Option<Anchor> {
        let level = depth - x.height;
        let notified: Vec<NodeKey> =
            notify_levels(level, m).into_iter().map(|l| x.ancestor_at(depth - l)).collect();
        for &a in &notified {
            units.entry(a).or_default().insert(id);
        }
        match notified.last() {
            Some(&w) => Some(Anchor::Notified(w)),
            None if x.height > 0 => Some(Anchor::Occupied(x)),
            None => None,
        }
    }

    /// Applies a scale-up's plan to the symbolic counters.
    fn scale(units: &mut Units, occupied: &BTreeMap<NodeKey, usize>, old: u32, new: u32, m: u32) {
        for mark in expansion_plan(old, new, m) {
            let counted = units.get(&mark.node).cloned().unwrap_or_default();
            for t in &mark.counters_to {
                assert!(mark.bits & EXP_BIT != 0);
                units.entry(*t).or_default().extend(counted.iter().copied());
            }
            if let Some(&id) = occupied.get(&mark.node) {
                for t in &mark.occupancy_to {
                    units.entry(*t).or_default().insert(id);
                }
            }
        }
    }

    /// What a release adds DCnt to: its notified nodes, then the chains.
    fn release_chain(req: &Request, notified_at: u32, depths: &[u32], m: u32) -> BTreeSet<NodeKey> {
        let mut out = BTreeSet::new();
        let level = notified_at - req.node.height;
        for l in notify_levels(level, m) {
            out.insert(req.node.ancestor_at(notified_at - l));
        }
        // Follow the marks: the anchor was marked iff a later generation
        // carried it (the simulation has no concurrent scale-ups).
        let mut anchor = req.anchor;
        while let Some(chain) = carried_to(anchor, depths, m) {
            out.extend(chain.iter().copied());
            anchor = Anchor::Notified(*chain.last().unwrap());
        }
        out
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]

        /// Requests made under random generations, then scale-ups: every
        /// request is seen by every ancestor's window (meet-in-the-middle
        /// holds across the new levels), and the release chain of each
        /// request is exactly the set of nodes holding its units.
        #[test]
        fn carried_units_meet_every_ancestor_and_balance(
            d0 in 1u32..=5,
            steps in prop::collection::vec(1u32..=5, 1..4),
            m in 2u32..=5,
            picks in prop::collection::vec((0usize..4, 0u32..20, 0u64..1 << 20), 1..12),
        ) {
            let mut depths = vec![d0];
            for s in &steps {
                depths.push(depths.last().unwrap() + s);
            }
            let mut units = Units::new();
            // Occupied roots-or-internal nodes: node -> request.
            let mut requests: Vec<(Request, u32)> = Vec::new();
            let mut g = 0;
            for (when, h, p) in picks.iter().copied() {
                // Scale up to generation `when` (capped), then make a request.
                let target = when.min(depths.len() - 1);
                while g < target {
                    let occupied: BTreeMap<NodeKey, usize> = requests
                        .iter()
                        .enumerate()
                        .filter(|(_, (r, _))| r.node.height > 0)
                        .map(|(i, (r, _))| (r.node, i))
                        .collect();
                    scale(&mut units, &occupied, depths[g], depths[g + 1], m);
                    g += 1;
                }
                let depth = depths[g];
                let height = h % (depth + 1);
                let node = NodeKey { height, pos: p % (1u64 << (2 * (depth - height))) };
                if requests.iter().any(|(r, _)| r.node == node && height > 0) {
                    continue; // one occupant per internal node
                }
                let id = requests.len();
                if let Some(anchor) = notify(&mut units, id, node, depth, m) {
                    requests.push((Request { node, anchor }, depth));
                }
            }
            while g + 1 < depths.len() {
                let occupied: BTreeMap<NodeKey, usize> = requests
                    .iter()
                    .enumerate()
                    .filter(|(_, (r, _))| r.node.height > 0)
                    .map(|(i, (r, _))| (r.node, i))
                    .collect();
                scale(&mut units, &occupied, depths[g], depths[g + 1], m);
                g += 1;
            }
            let shape = TreeShape::new(*depths.last().unwrap());
            for (id, (req, at)) in requests.iter().enumerate() {
                // Meet-in-the-middle in the final tree: for every proper
                // ancestor a, some node within m levels of a (and above the
                // request's node) counts the request.
                let x = shape.index(req.node);
                for a in shape.ancestors(x) {
                    let ka = shape.key(a);
                    let seen = (0..m).filter_map(|i| ka.height.checked_sub(i))
                        .filter(|&hh| hh > req.node.height)
                        .any(|hh| units.get(&req.node.ancestor_at(hh)).is_some_and(|s| s.contains(&id)));
                    prop_assert!(seen, "request {id} at {:?} (made at depth {at}) unseen by {a:?} in {depths:?}", req.node);
                }
                // The release chain is exactly where its units are.
                let holding: BTreeSet<NodeKey> =
                    units.iter().filter(|(_, s)| s.contains(&id)).map(|(k, _)| *k).collect();
                prop_assert_eq!(&release_chain(req, *at, &depths, m), &holding, "request {} in {:?}", id, depths);
                let _ = NodeIndex::ROOT;
            }
        }
    }
}
