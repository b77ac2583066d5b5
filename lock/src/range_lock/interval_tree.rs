//! An interval tree of half-open ranges `[start, end)` of lock units, each
//! with a request id: the data structure of the centralised RPC range lock
//! server ([`super::rpc`]), as Lustre's interval tree is for the paper's IT
//! baseline (citron-fast23.md Table 1).
//!
//! It is a treap (a binary search tree on the key `(start, id)` that is also
//! a heap on a priority derived from the id) augmented with the largest
//! `end` of each subtree, so "which intervals overlap `[l, r)`" visits only
//! subtrees that can hold one: O(log n + k) expected.
//!
//! **Hand-written, and why.** The server needs a *dynamic* set of possibly
//! overlapping, possibly identical intervals (two waiters may ask for the
//! same range) that are inserted and removed one by one, each identified by
//! its request. The crates at hand do not fit: `intervaltree` and
//! `rust-lapper` are built once and queried (a rebuild per lock request
//! would cost O(n log n)); `iset` keys its map by the interval itself, so two
//! requests for the same range collide (its duplicate mode cannot remove
//! one particular duplicate). A treap with split and merge is short, and the
//! property test below checks it against a brute-force model.
//!
//! Priorities are a hash of the id (splitmix64), so the shape is that of a
//! random treap (expected depth O(log n)) yet fully deterministic.

use std::cmp::Ordering;

/// One interval with its owner's id. `end` may be `u64::MAX` ("to infinity").
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Interval {
    pub start: u64,
    pub end: u64,
    pub id: u64,
}

impl Interval {
    /// Whether `[start, end)` and `[l, r)` share a unit.
    #[inline]
    pub fn overlaps(&self, l: u64, r: u64) -> bool {
        self.start < r && l < self.end
    }

    fn key(&self) -> (u64, u64) {
        (self.start, self.id)
    }
}

struct TreapNode {
    item: Interval,
    priority: u64,
    /// The largest `end` in this subtree.
    max_end: u64,
    left: Link,
    right: Link,
}

type Link = Option<Box<TreapNode>>;

impl TreapNode {
    fn new(item: Interval) -> Box<Self> {
        Box::new(Self { item, priority: splitmix64(item.id), max_end: item.end, left: None, right: None })
    }

    /// Recomputes `max_end` from the children.
    fn fix(&mut self) {
        let mut m = self.item.end;
        if let Some(l) = &self.left {
            m = m.max(l.max_end);
        }
        if let Some(r) = &self.right {
            m = m.max(r.max_end);
        }
        self.max_end = m;
    }
}

/// A hash with good avalanche, for treap priorities.
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Splits `t` into (keys `< key`, keys `>= key`).
fn split(t: Link, key: (u64, u64)) -> (Link, Link) {
    match t {
        None => (None, None),
        Some(mut n) => {
            if n.item.key() < key {
                let (l, r) = split(n.right.take(), key);
                n.right = l;
                n.fix();
                (Some(n), r)
            } else {
                let (l, r) = split(n.left.take(), key);
                n.left = r;
                n.fix();
                (l, Some(n))
            }
        }
    }
}

/// Joins two treaps whose keys are all `a < b`.
fn merge(a: Link, b: Link) -> Link {
    match (a, b) {
        (None, b) => b,
        (a, None) => a,
        (Some(mut a), Some(mut b)) => {
            if a.priority >= b.priority {
                a.right = merge(a.right.take(), Some(b));
                a.fix();
                Some(a)
            } else {
                b.left = merge(Some(a), b.left.take());
                b.fix();
                Some(b)
            }
        }
    }
}

/// A set of intervals, keyed by `(start, id)`.
#[derive(Default)]
pub struct IntervalTree {
    root: Link,
    len: usize,
}

impl std::fmt::Debug for IntervalTree {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl IntervalTree {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Adds `item`. Returns `false` (and changes nothing) if an interval with
    /// the same `(start, id)` is already there, or if `item` is empty.
    pub fn insert(&mut self, item: Interval) -> bool {
        if item.start >= item.end || self.contains(item.start, item.id) {
            return false;
        }
        let (l, r) = split(self.root.take(), item.key());
        self.root = merge(merge(l, Some(TreapNode::new(item))), r);
        self.len += 1;
        true
    }

    /// Removes the interval with this `(start, id)`; returns it if present.
    pub fn remove(&mut self, start: u64, id: u64) -> Option<Interval> {
        let (l, rest) = split(self.root.take(), (start, id));
        // `rest` starts with the key if present; peel off its minimum.
        let (found, r) = match id.checked_add(1) {
            Some(next) => split(rest, (start, next)),
            None => match start.checked_add(1) {
                Some(s) => split(rest, (s, 0)),
                None => (rest, None),
            },
        };
        self.root = merge(l, r);
        let found = found.map(|n| {
            debug_assert!(n.left.is_none() && n.right.is_none(), "one key, one node");
            n.item
        });
        if found.is_some() {
            self.len -= 1;
        }
        found
    }

    /// Whether an interval with this `(start, id)` is present.
    pub fn contains(&self, start: u64, id: u64) -> bool {
        let mut cur = &self.root;
        while let Some(n) = cur {
            match (start, id).cmp(&n.item.key()) {
                Ordering::Equal => return true,
                Ordering::Less => cur = &n.left,
                Ordering::Greater => cur = &n.right,
            }
        }
        false
    }

    /// Calls `visit` with every interval overlapping `[l, r)`, in key order,
    /// until it returns `false`.
    pub fn visit_overlapping(&self, l: u64, r: u64, mut visit: impl FnMut(&Interval) -> bool) {
        fn walk(t: &Link, l: u64, r: u64, visit: &mut dyn FnMut(&Interval) -> bool) -> bool {
            let Some(n) = t else { return true };
            // Nothing in this subtree ends after l: no overlap.
            if n.max_end <= l {
                return true;
            }
            if !walk(&n.left, l, r, visit) {
                return false;
            }
            // Keys to the right start at or after this one.
            if n.item.start >= r {
                return true;
            }
            if n.item.overlaps(l, r) && !visit(&n.item) {
                return false;
            }
            walk(&n.right, l, r, visit)
        }
        if l < r {
            walk(&self.root, l, r, &mut visit);
        }
    }

    /// Every interval overlapping `[l, r)`, in key order.
    pub fn overlapping(&self, l: u64, r: u64) -> Vec<Interval> {
        let mut out = Vec::new();
        self.visit_overlapping(l, r, |i| {
            out.push(*i);
            true
        });
        out
    }

    /// Whether any interval overlaps `[l, r)`.
    pub fn overlaps_any(&self, l: u64, r: u64) -> bool {
        let mut found = false;
        self.visit_overlapping(l, r, |_| {
            found = true;
            false
        });
        found
    }

    /// All intervals in key order.
    pub fn iter(&self) -> impl Iterator<Item = Interval> + '_ {
        let mut stack: Vec<&TreapNode> = Vec::new();
        let mut cur = self.root.as_deref();
        std::iter::from_fn(move || {
            while let Some(n) = cur {
                stack.push(n);
                cur = n.left.as_deref();
            }
            let n = stack.pop()?;
            cur = n.right.as_deref();
            Some(n.item)
        })
    }

    /// Checks the treap's invariants (BST order, heap order, `max_end`,
    /// length); for tests.
    pub fn check_invariants(&self) -> Result<(), String> {
        fn walk(t: &Link, count: &mut usize) -> Result<Option<u64>, String> {
            let Some(n) = t else { return Ok(None) };
            *count += 1;
            let mut m = n.item.end;
            for (child, left) in [(&n.left, true), (&n.right, false)] {
                if let Some(c) = child {
                    if c.priority > n.priority {
                        return Err(format!("heap order broken under {:?}", n.item));
                    }
                    let ordered =
                        if left { c.item.key() < n.item.key() } else { c.item.key() > n.item.key() };
                    if !ordered {
                        return Err(format!("key order broken under {:?}", n.item));
                    }
                }
                if let Some(cm) = walk(child, count)? {
                    m = m.max(cm);
                }
            }
            if m != n.max_end {
                return Err(format!("max_end of {:?} is {} not {m}", n.item, n.max_end));
            }
            Ok(Some(m))
        }
        let mut count = 0;
        walk(&self.root, &mut count)?;
        let keys: Vec<_> = self.iter().map(|i| i.key()).collect();
        if keys.windows(2).any(|w| w[0] >= w[1]) {
            return Err("in-order walk is not strictly increasing".into());
        }
        if count != self.len {
            return Err(format!("len {} but {count} nodes", self.len));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn small_example() {
        let mut t = IntervalTree::new();
        assert!(t.insert(Interval { start: 0, end: 10, id: 1 }));
        assert!(t.insert(Interval { start: 5, end: 15, id: 2 }));
        assert!(t.insert(Interval { start: 5, end: 15, id: 3 }), "identical ranges, other ids");
        assert!(t.insert(Interval { start: 20, end: u64::MAX, id: 4 }));
        assert!(!t.insert(Interval { start: 5, end: 99, id: 2 }), "duplicate key");
        assert!(!t.insert(Interval { start: 7, end: 7, id: 9 }), "empty");
        let ids = |v: Vec<Interval>| v.into_iter().map(|i| i.id).collect::<Vec<_>>();
        assert_eq!(ids(t.overlapping(9, 10)), vec![1, 2, 3]);
        assert_eq!(ids(t.overlapping(10, 20)), vec![2, 3]);
        assert_eq!(ids(t.overlapping(15, 20)), Vec::<u64>::new());
        assert_eq!(ids(t.overlapping(u64::MAX - 1, u64::MAX)), vec![4]);
        assert!(!t.overlaps_any(15, 20));
        assert_eq!(t.remove(5, 2).map(|i| i.end), Some(15));
        assert_eq!(t.remove(5, 2), None);
        assert_eq!(ids(t.overlapping(0, u64::MAX)), vec![1, 3, 4]);
        t.check_invariants().unwrap();
    }

    #[test]
    fn extreme_keys_are_removable() {
        let mut t = IntervalTree::new();
        let a = Interval { start: u64::MAX - 1, end: u64::MAX, id: u64::MAX };
        let b = Interval { start: 3, end: 4, id: u64::MAX };
        assert!(t.insert(a) && t.insert(b));
        assert_eq!(t.remove(a.start, a.id), Some(a));
        assert_eq!(t.remove(b.start, b.id), Some(b));
        assert!(t.is_empty());
    }

    #[derive(Clone, Debug)]
    enum Op {
        Insert(u64, u64, u64),
        Remove(usize),
        Query(u64, u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        // A small universe so that overlaps, identical ranges and reuse of
        // keys are common; `end` may be "infinity".
        let end = prop_oneof![9 => 1u64..40, 1 => Just(u64::MAX)];
        prop_oneof![
            4 => (0u64..40, end, 0u64..30).prop_map(|(s, e, id)| Op::Insert(s, e, id)),
            2 => any::<usize>().prop_map(Op::Remove),
            3 => (0u64..45, 0u64..45).prop_map(|(a, b)| Op::Query(a.min(b), a.max(b) + 1)),
        ]
    }

    proptest! {
        /// Against a brute-force model: the same set after every operation,
        /// the same answer to every query, and the invariants hold.
        #[test]
        fn behaves_like_a_list(ops in proptest::collection::vec(op(), 1..200)) {
            let mut tree = IntervalTree::new();
            let mut model: Vec<Interval> = Vec::new();
            for op in ops {
                match op {
                    Op::Insert(s, e, id) => {
                        let item = Interval { start: s, end: e, id };
                        let fresh = s < e && !model.iter().any(|m| m.key() == item.key());
                        prop_assert_eq!(tree.insert(item), fresh);
                        if fresh {
                            model.push(item);
                        }
                    }
                    Op::Remove(pick) => {
                        if model.is_empty() {
                            prop_assert_eq!(tree.remove(3, 3), None);
                        } else {
                            let m = model.swap_remove(pick % model.len());
                            prop_assert_eq!(tree.remove(m.start, m.id), Some(m));
                        }
                    }
                    Op::Query(l, r) => {
                        let mut want: Vec<Interval> =
                            model.iter().copied().filter(|m| m.overlaps(l, r)).collect();
                        want.sort_by_key(|m| m.key());
                        prop_assert_eq!(tree.overlaps_any(l, r), !want.is_empty());
                        prop_assert_eq!(tree.overlapping(l, r), want);
                    }
                }
                prop_assert_eq!(tree.len(), model.len());
                tree.check_invariants().map_err(TestCaseError::fail)?;
            }
            let mut all = model.clone();
            all.sort_by_key(|m| m.key());
            prop_assert_eq!(tree.iter().collect::<Vec<_>>(), all);
        }
    }
}
