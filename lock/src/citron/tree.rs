//! The lock tree's shape (Citron paper §3.3–3.5.1): a quaternary segment
//! tree stored as a flat array in level order, and the splitting of a range
//! into at most `k` tree nodes.
//!
//! Indices are 1-based as in the paper (Fig. 2): the root is 1, and
//!
//! ```text
//! CHILD(x, i) = 4x - 2 + i   (i = 0..4)      PARENT(x) = floor((x + 2) / 4)
//! ```
//!
//! Level `d` (the root is level 0) starts at index `(4^d + 2) / 3`. A tree of
//! `depth` D has its leaves on level D; a leaf covers 64 lock units (one bit
//! each), so the tree covers `N = 64 * 4^D` units. All of this is arithmetic
//! on the client: locating a node costs no network traffic.

/// The index of a node of the lock tree (1 = root).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeIndex(pub u64);

impl NodeIndex {
    pub const ROOT: NodeIndex = NodeIndex(1);

    /// Child `i` (0..4) — paper §3.3.
    pub fn child(self, i: u64) -> NodeIndex {
        debug_assert!(i < 4);
        NodeIndex(4 * self.0 - 2 + i)
    }

    /// The parent; the root has none.
    pub fn parent(self) -> Option<NodeIndex> {
        (self.0 > 1).then(|| NodeIndex((self.0 + 2) / 4))
    }
}

/// A node named independently of the tree's depth: its height above the
/// leaves (0 = leaf) and its position on its level (0 = leftmost).
///
/// A scale-up makes the old tree the leftmost subtree of the enlarged one
/// (§3.9.1), so a node keeps its key, and its memory, across scale-ups while
/// its [`NodeIndex`] changes. Held nodes are remembered by key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeKey {
    pub height: u32,
    pub pos: u64,
}

impl NodeKey {
    /// The ancestor at `height` (at least this node's own).
    pub fn ancestor_at(self, height: u32) -> NodeKey {
        debug_assert!(height >= self.height);
        NodeKey { height, pos: self.pos >> (2 * (height - self.height)) }
    }
}

/// Units covered by one leaf: one bit of its 64-bit bitmap each.
pub const LEAF_UNITS: u64 = 64;

/// Deepest tree supported: 64 * 4^24 = 2^54 units, far more than any file.
pub const MAX_DEPTH: u32 = 24;

/// Index of the first node of level `d`: 1 + (4^0 + ... + 4^(d-1)) =
/// (4^d + 2) / 3, which is ceil(4^d / 3) since 4^d = 1 (mod 3).
pub const fn level_start(d: u32) -> u64 {
    (1u64 << (2 * d)).div_ceil(3)
}

/// The shape of a lock tree of a given depth.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TreeShape {
    depth: u32,
}

/// One node chosen to cover part of a requested range, and the units of the
/// request it covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cover {
    pub node: NodeIndex,
    /// The requested units inside the node's range: `[start, end)`.
    pub start: u64,
    pub end: u64,
}

impl TreeShape {
    pub fn new(depth: u32) -> Self {
        assert!(depth <= MAX_DEPTH, "lock tree depth {depth} exceeds {MAX_DEPTH}");
        Self { depth }
    }

    /// The smallest tree covering `units` units.
    pub fn covering(units: u64) -> Self {
        let mut depth = 0;
        while LEAF_UNITS << (2 * depth) < units && depth < MAX_DEPTH {
            depth += 1;
        }
        Self { depth }
    }

    pub fn depth(self) -> u32 {
        self.depth
    }

    /// N: the units the tree covers.
    pub fn units(self) -> u64 {
        LEAF_UNITS << (2 * self.depth)
    }

    /// Number of nodes, i.e. the length of the flat array.
    pub fn node_count(self) -> u64 {
        level_start(self.depth + 1) - 1
    }

    /// The level of `x`: the d with `level_start(d) <= x < level_start(d + 1)`,
    /// i.e. `4^d <= 3x - 2 < 4^(d+1)`, so half the bit length of `3x - 2`.
    #[inline]
    pub fn level_of(self, x: NodeIndex) -> u32 {
        debug_assert!(x.0 >= 1 && x.0 <= self.node_count(), "{x:?} outside a depth-{} tree", self.depth);
        (63 - (3 * x.0 - 2).leading_zeros()) / 2
    }

    pub fn is_leaf(self, x: NodeIndex) -> bool {
        self.level_of(x) == self.depth
    }

    /// Units covered by a node of level `d`.
    pub fn span(self, d: u32) -> u64 {
        LEAF_UNITS << (2 * (self.depth - d))
    }

    /// The units `[start, end)` a node covers.
    pub fn range(self, x: NodeIndex) -> (u64, u64) {
        let d = self.level_of(x);
        let span = self.span(d);
        let pos = x.0 - level_start(d);
        (pos * span, (pos + 1) * span)
    }

    /// The node of level `d` covering unit `u`.
    pub fn node_at(self, d: u32, u: u64) -> NodeIndex {
        NodeIndex(level_start(d) + u / self.span(d))
    }

    /// The depth-independent name of `x`.
    pub fn key(self, x: NodeIndex) -> NodeKey {
        let level = self.level_of(x);
        NodeKey { height: self.depth - level, pos: x.0 - level_start(level) }
    }

    /// Whether a node called `k` exists in this tree.
    pub fn contains(self, k: NodeKey) -> bool {
        k.height <= self.depth && k.pos < 1u64 << (2 * (self.depth - k.height))
    }

    /// The index in this tree of the node called `k`.
    pub fn index(self, k: NodeKey) -> NodeIndex {
        debug_assert!(self.contains(k), "{k:?} is not in a depth-{} tree", self.depth);
        NodeIndex(level_start(self.depth - k.height) + k.pos)
    }

    /// Ancestors from the parent up to the root.
    pub fn ancestors(self, x: NodeIndex) -> impl Iterator<Item = NodeIndex> {
        std::iter::successors(x.parent(), |p| p.parent())
    }

    /// The bits of a leaf that `[start, end)` covers.
    pub fn leaf_mask(self, leaf: NodeIndex, start: u64, end: u64) -> u64 {
        let (a, b) = self.range(leaf);
        let (lo, hi) = (start.max(a) - a, end.min(b) - a);
        debug_assert!(lo < hi, "range does not meet the leaf");
        let width = hi - lo;
        let ones = if width == 64 { u64::MAX } else { (1u64 << width) - 1 };
        ones << lo
    }

    /// Splits `[l, r)` into at most `k` nodes that together cover it, choosing
    /// the nodes that cover the fewest unrequested units (§3.5.1: a tree
    /// knapsack; a leaf covers exactly the requested bits, so it wastes
    /// nothing). Ties go to fewer nodes. The result is in ascending order, the
    /// order in which the nodes must be locked.
    ///
    /// Only nodes on the two boundary paths are partially covered, so the
    /// dynamic program visits O(log N) nodes with O(k²) work each.
    pub fn split(self, l: u64, r: u64, k: usize) -> Vec<Cover> {
        assert!(l < r && r <= self.units(), "[{l}, {r}) is not a non-empty range of [0, {})", self.units());
        assert!((1..=MAX_SPLIT).contains(&k), "k must be in 1..={MAX_SPLIT}, not {k}");
        // The common case: inside one leaf, which covers exactly the
        // requested bits with one node; nothing can beat it.
        let leaf = self.node_at(self.depth, l);
        if leaf == self.node_at(self.depth, r - 1) {
            return vec![Cover { node: leaf, start: l, end: r }];
        }
        let best = self.best_cover(NodeIndex::ROOT, l, r, k);
        let choice = best[..k].iter().flatten().min_by_key(|c| (c.waste, c.len)).expect("the root covers");
        let mut nodes = choice.nodes;
        let nodes = &mut nodes[..choice.len];
        nodes.sort_by_key(|n| self.range(*n).0);
        nodes
            .iter()
            .map(|&node| {
                let (a, b) = self.range(node);
                Cover { node, start: a.max(l), end: b.min(r) }
            })
            .collect()
    }

    /// For j = 1..=k, at j - 1: the cheapest way to cover
    /// `[l, r) ∩ range(x)` with at most j nodes of x's subtree (`None` where
    /// impossible). Fixed-size arrays, so a split allocates nothing but its
    /// result: it runs on every acquisition.
    fn best_cover(self, x: NodeIndex, l: u64, r: u64, k: usize) -> [Option<Choice>; MAX_SPLIT] {
        let (a, b) = self.range(x);
        let wanted = b.min(r) - a.max(l);
        let leaf = self.is_leaf(x);
        let this = Choice::one(x, if leaf { 0 } else { (b - a) - wanted });
        let mut best = [None; MAX_SPLIT];
        best[..k].fill(Some(this));
        if leaf || (l <= a && b <= r) {
            // A leaf is exact, and so is a node inside the range.
            return best;
        }
        // Or cover through the children that meet the range. combined[n]:
        // the best cover of the children seen so far with n nodes.
        let mut combined = [None; MAX_SPLIT + 1];
        combined[0] = Some(Choice::NONE);
        for child in (0..4).map(|i| x.child(i)) {
            let (ca, cb) = self.range(child);
            if !(ca < r && l < cb) {
                continue;
            }
            let child_best = self.best_cover(child, l, r, k);
            let mut next = [None; MAX_SPLIT + 1];
            for (used, acc) in combined.iter().enumerate() {
                let Some(acc) = acc else { continue };
                for (extra, c) in child_best[..k].iter().enumerate() {
                    let Some(c) = c else { continue };
                    let n = used + extra + 1;
                    if n > k {
                        break;
                    }
                    let cand = acc.joined(c);
                    if next[n].as_ref().is_none_or(|cur| cand.better_than(cur)) {
                        next[n] = Some(cand);
                    }
                }
            }
            combined = next;
        }
        let mut running: Option<Choice> = None;
        for j in 1..=k {
            if let Some(c) = combined[j] {
                if running.as_ref().is_none_or(|cur| c.better_than(cur)) {
                    running = Some(c);
                }
            }
            if let Some(run) = running {
                if best[j - 1].as_ref().is_none_or(|cur| run.better_than(cur)) {
                    best[j - 1] = Some(run);
                }
            }
        }
        best
    }
}

/// Most nodes a range may be split into (the paper evaluates k ≤ 5).
pub const MAX_SPLIT: usize = 8;

/// A set of at most [`MAX_SPLIT`] nodes and the units they cover without
/// being asked for.
#[derive(Clone, Copy, Debug)]
struct Choice {
    waste: u64,
    len: usize,
    nodes: [NodeIndex; MAX_SPLIT],
}

impl Choice {
    const NONE: Choice = Choice { waste: 0, len: 0, nodes: [NodeIndex::ROOT; MAX_SPLIT] };

    fn one(x: NodeIndex, waste: u64) -> Choice {
        let mut c = Choice { waste, ..Choice::NONE };
        c.nodes[0] = x;
        c.len = 1;
        c
    }

    /// Both sets together; the caller keeps the total within k ≤ MAX_SPLIT.
    fn joined(&self, other: &Choice) -> Choice {
        let mut c = *self;
        c.nodes[self.len..self.len + other.len].copy_from_slice(&other.nodes[..other.len]);
        c.len += other.len;
        c.waste += other.waste;
        c
    }

    fn better_than(&self, other: &Choice) -> bool {
        (self.waste, self.len) < (other.waste, other.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn index_arithmetic_matches_figure_2() {
        // Root 1; its children 2..=5; the children of 2 are 6..=9, of 5 are 18..=21.
        assert_eq!((0..4).map(|i| NodeIndex::ROOT.child(i).0).collect::<Vec<_>>(), vec![2, 3, 4, 5]);
        assert_eq!(NodeIndex(2).child(0), NodeIndex(6));
        assert_eq!(NodeIndex(5).child(3), NodeIndex(21));
        for x in 2..2000u64 {
            let p = NodeIndex(x).parent().unwrap();
            assert!((0..4).any(|i| p.child(i) == NodeIndex(x)), "{x}");
        }
        assert_eq!(NodeIndex::ROOT.parent(), None);
        assert_eq!([level_start(0), level_start(1), level_start(2), level_start(3)], [1, 2, 6, 22]);
        let deep = TreeShape::new(MAX_DEPTH);
        for d in 0..=MAX_DEPTH {
            for x in [level_start(d), level_start(d) + 1, level_start(d + 1) - 1] {
                if x < level_start(d + 1) {
                    assert_eq!(deep.level_of(NodeIndex(x)), d, "node {x}");
                }
            }
        }
        let t = TreeShape::new(2);
        assert_eq!(t.units(), 1024);
        assert_eq!(t.node_count(), 21);
        assert_eq!(t.range(NodeIndex(1)), (0, 1024));
        assert_eq!(t.range(NodeIndex(3)), (256, 512));
        assert_eq!(t.range(NodeIndex(21)), (960, 1024));
        assert!(t.is_leaf(NodeIndex(6)) && !t.is_leaf(NodeIndex(5)));
        assert_eq!(t.node_at(2, 1000), NodeIndex(21));
        assert_eq!(t.ancestors(NodeIndex(21)).collect::<Vec<_>>(), vec![NodeIndex(5), NodeIndex(1)]);
        assert_eq!(TreeShape::covering(1).depth(), 0);
        assert_eq!(TreeShape::covering(65).depth(), 1);
        assert_eq!(TreeShape::covering(1 << 28).units(), 1 << 28);
    }

    #[test]
    fn keys_survive_a_deeper_tree() {
        // The depth-2 tree is the leftmost subtree of a depth-4 tree.
        let (small, big) = (TreeShape::new(2), TreeShape::new(4));
        for x in 1..=small.node_count() {
            let k = small.key(NodeIndex(x));
            assert_eq!(small.index(k), NodeIndex(x));
            let y = big.index(k);
            assert_eq!(big.key(y), k);
            assert_eq!(small.range(NodeIndex(x)), big.range(y), "same units at both depths");
            if let Some(p) = NodeIndex(x).parent() {
                assert_eq!(big.index(small.key(p)), y.parent().unwrap());
                assert_eq!(k.ancestor_at(k.height + 1), small.key(p));
            }
        }
        assert!(
            !small.contains(NodeKey { height: 3, pos: 0 }) && big.contains(NodeKey { height: 3, pos: 3 })
        );
        assert!(!big.contains(NodeKey { height: 3, pos: 4 }));
    }

    #[test]
    fn leaf_masks() {
        let t = TreeShape::new(1);
        assert_eq!(t.leaf_mask(NodeIndex(2), 0, 64), u64::MAX);
        assert_eq!(t.leaf_mask(NodeIndex(2), 3, 5), 0b11000);
        assert_eq!(t.leaf_mask(NodeIndex(3), 60, 70), 0b11_1111);
        assert_eq!(t.leaf_mask(NodeIndex(3), 100, 200), !0u64 << 36);
    }

    #[test]
    fn split_examples() {
        let t = TreeShape::new(2); // 1024 units, leaves of 64
                                   // Inside one leaf: that leaf, exactly.
        assert_eq!(t.split(10, 20, 2), vec![Cover { node: NodeIndex(6), start: 10, end: 20 }]);
        // Across two leaves: two leaves, no waste.
        let s = t.split(60, 70, 2);
        assert_eq!(s.iter().map(|c| c.node.0).collect::<Vec<_>>(), vec![6, 7]);
        // The paper's example: a small range around N/2 must not lock the root.
        let s = t.split(511, 513, 2);
        assert_eq!(s.iter().map(|c| c.node.0).collect::<Vec<_>>(), vec![13, 14]);
        // k = 1 forces one node: the lowest covering one.
        assert_eq!(t.split(511, 513, 1)[0].node, NodeIndex::ROOT);
        // A whole level-1 node.
        assert_eq!(t.split(256, 512, 2), vec![Cover { node: NodeIndex(3), start: 256, end: 512 }]);
        // The brute force agrees, and has teeth: with one node the root wastes 1022.
        assert_eq!(brute_force_min_waste(t, 511, 513, 1), 1022);
        assert_eq!(brute_force_min_waste(t, 511, 513, 2), 0);
        assert_eq!(brute_force_min_waste(t, 100, 700, 2), 1024 - 600);
        assert_eq!(brute_force_min_waste(t, 100, 700, 3), (256 - 156) + (256 - 188));
    }

    /// All sets of at most k pairwise unrelated nodes that cover the range.
    fn brute_force_min_waste(t: TreeShape, l: u64, r: u64, k: usize) -> u64 {
        let nodes: Vec<NodeIndex> = (1..=t.node_count()).map(NodeIndex).collect();
        let waste = |x: NodeIndex| {
            let (a, b) = t.range(x);
            if t.is_leaf(x) {
                0
            } else {
                (b - a) - (b.min(r).saturating_sub(a.max(l)))
            }
        };
        let meets = |x: NodeIndex| {
            let (a, b) = t.range(x);
            a < r && l < b
        };
        let candidates: Vec<NodeIndex> = nodes.into_iter().filter(|x| meets(*x)).collect();
        let mut best = u64::MAX;
        let mut stack: Vec<(usize, Vec<NodeIndex>)> = vec![(0, Vec::new())];
        while let Some((from, set)) = stack.pop() {
            let covered: u64 = set
                .iter()
                .map(|x| {
                    let (a, b) = t.range(*x);
                    b.min(r) - a.max(l)
                })
                .sum();
            if covered == r - l {
                best = best.min(set.iter().map(|x| waste(*x)).sum());
            }
            if set.len() == k {
                continue;
            }
            for (i, &c) in candidates.iter().enumerate().skip(from) {
                let related =
                    set.iter().any(|s| t.ancestors(c).any(|a| a == *s) || t.ancestors(*s).any(|a| a == c));
                if !related {
                    let mut next = set.clone();
                    next.push(c);
                    stack.push((i + 1, next));
                }
            }
        }
        best
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]
        #[test]
        fn split_is_optimal_and_covers_exactly(depth in 1u32..=3, a in 0u64..4096, len in 1u64..4096, k in 1usize..=3) {
            let t = TreeShape::new(depth);
            let l = a % t.units();
            let r = (l + len).min(t.units());
            prop_assume!(depth < 3 || k < 3); // keep the brute force small
            let s = t.split(l, r, k);
            prop_assert!(!s.is_empty() && s.len() <= k);
            // Ascending, disjoint, and exactly covering [l, r).
            let mut pos = l;
            for c in &s {
                prop_assert_eq!(c.start, pos);
                prop_assert!(c.end > c.start);
                let (a, b) = t.range(c.node);
                prop_assert!(a <= c.start && c.end <= b);
                pos = c.end;
            }
            prop_assert_eq!(pos, r);
            let waste: u64 = s.iter().filter(|c| !t.is_leaf(c.node)).map(|c| {
                let (a, b) = t.range(c.node);
                (b - a) - (c.end - c.start)
            }).sum();
            prop_assert_eq!(waste, brute_force_min_waste(t, l, r, k));
        }

        #[test]
        fn no_false_conflict_for_small_ranges_with_k2(depth in 1u32..=6, a in 0u64..(1 << 20), len in 1u64..=64) {
            // Any range of at most 64 units meets at most two leaves, so k = 2
            // covers it with leaves only: no unrequested unit is locked (§4.6).
            let t = TreeShape::new(depth);
            let l = a % (t.units() - len + 1);
            let s = t.split(l, l + len, 2);
            prop_assert!(s.iter().all(|c| t.is_leaf(c.node)));
        }
    }
}
