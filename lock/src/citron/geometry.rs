//! Where the nodes of a lock tree live, before and after scale-ups
//! (citron-fast23.md §3.3 and §3.9.1, "Node index arithmetics").
//!
//! An instance starts as one block of lock memory ([`CitronLayout`]): the
//! maximizer, a reserved word, then the nodes of a tree of depth D0 in level
//! order. A scale-up does not move it: the old tree becomes the leftmost
//! subtree of the enlarged tree, and the nodes the enlarged tree adds are a
//! new *segment*, a separate allocation holding, in level order, every node
//! of the enlarged tree that the old tree lacks (the paper's "offsetting the
//! number of nodes in the old lock tree that lie ahead of x in the level
//! order"). After scale-ups to depths D1 < D2 < … there are segments 0, 1, 2,
//! …; segment g holds, for each level ℓ of the depth-Dg tree, the positions
//! `[4^(ℓ - s), 4^ℓ)` where `s = Dg - D(g-1)` (all of `[0, 4^ℓ)` when ℓ < s).
//! So on level L of the current tree the positions are cut into one
//! contiguous run per segment that reaches that level:
//!
//! ```text
//! level L:  [0, 4^(L-(D-D0))) in segment 0 | [.., 4^(L-(D-D1))) in segment 1 | … | [.., 4^L) in the last
//! ```
//!
//! A node's address depends on its segment; index arithmetic (CHILD, PARENT)
//! is unchanged. A node keeps its address for the life of its segment, which
//! is what lets a range held across a scale-up be released (§3.9.1).
//!
//! Reading the internal descendants of a node within m levels (Alg. 2 line
//! 35) is one read per run: on level i below the node its descendants are the
//! positions `[p·4^i, (p+1)·4^i)`, which cross a run boundary `4^j` only for
//! the leftmost nodes (p = 0, j < i), so at most `1 + 2 + … + m = m(m+1)/2`
//! reads in all, as §3.9.1 says.
//!
//! The configuration a client follows is a [`TreeGeometry`]: the maximizer's
//! address and the segments, with a version the lock host bumps on every
//! change (Alg. 4 line 9).

use serde::{Deserialize, Serialize};

use super::tree::{level_start, NodeIndex, NodeKey, TreeShape, MAX_DEPTH};
use crate::rdma::RemoteAddr;

/// Where an instance is created: the maximizer, then the nodes in level order.
///
/// | offset | what |
/// |---|---|
/// | 0 | maximizer (OR of the right borders of out-of-tree requests) |
/// | 8 | reserved |
/// | 16 + 8 (x - 1) | node x |
///
/// This is also segment 0 of every later [`TreeGeometry`] of the instance.
/// [`CitronLayout::node`] is the address of a node of *this* (unscaled) tree;
/// once the tree has been scaled up, addresses come from a [`SegmentedTree`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CitronLayout {
    pub base: RemoteAddr,
    pub shape: TreeShape,
}

impl CitronLayout {
    pub(crate) const NODES: u64 = 16;

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

/// One allocation of tree nodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TreeSegment {
    /// Address of the segment's first node.
    pub nodes: RemoteAddr,
    /// Depth of the tree this segment completes.
    pub depth: u32,
}

/// The configuration of a Citron instance: what a client must know to find
/// every node (Alg. 4 line 9, "renew the lock tree configuration").
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TreeGeometry {
    /// Bumped by every published change; clients compare versions.
    pub version: u64,
    pub maximizer: RemoteAddr,
    /// Segment 0 is the instance block's tree; depths strictly increase.
    pub segments: Vec<TreeSegment>,
}

/// Why a geometry cannot be used.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum GeometryError {
    #[error("a tree geometry needs at least one segment")]
    NoSegment,
    #[error("segment depths must increase and stay within {MAX_DEPTH}: {0:?}")]
    BadDepths(Vec<u32>),
    #[error("segment 0 must start 16 bytes after the maximizer ({maximizer:?}), not at {nodes:?}")]
    DetachedFirstSegment { maximizer: RemoteAddr, nodes: RemoteAddr },
    #[error("{0:?} is not 8-byte aligned")]
    Misaligned(RemoteAddr),
}

/// Nodes of a tree of `depth` (also the level-order index of its last node).
pub fn nodes_of_depth(depth: u32) -> u64 {
    level_start(depth + 1) - 1
}

impl TreeGeometry {
    /// The configuration of an instance that has never been scaled.
    pub fn from_layout(layout: CitronLayout) -> Self {
        Self {
            version: 0,
            maximizer: layout.maximizer(),
            segments: vec![TreeSegment {
                nodes: layout.base + CitronLayout::NODES,
                depth: layout.shape.depth(),
            }],
        }
    }

    pub fn shape(&self) -> TreeShape {
        TreeShape::new(self.segments.last().map_or(0, |s| s.depth))
    }

    /// The depths of the tree's generations, oldest first.
    pub fn depths(&self) -> Vec<u32> {
        self.segments.iter().map(|s| s.depth).collect()
    }

    pub fn validate(&self) -> Result<(), GeometryError> {
        let first = self.segments.first().ok_or(GeometryError::NoSegment)?;
        let depths = self.depths();
        if depths.windows(2).any(|w| w[0] >= w[1]) || depths.iter().any(|&d| d > MAX_DEPTH) {
            return Err(GeometryError::BadDepths(depths));
        }
        if first.nodes != self.maximizer.offset_by(CitronLayout::NODES) {
            return Err(GeometryError::DetachedFirstSegment {
                maximizer: self.maximizer,
                nodes: first.nodes,
            });
        }
        for a in std::iter::once(self.maximizer).chain(self.segments.iter().map(|s| s.nodes)) {
            if !a.is_aligned(8) {
                return Err(GeometryError::Misaligned(a));
            }
        }
        Ok(())
    }

    /// Nodes held by segment `i`.
    pub fn segment_nodes(&self, i: usize) -> u64 {
        let below = if i == 0 { 0 } else { nodes_of_depth(self.segments[i - 1].depth) };
        nodes_of_depth(self.segments[i].depth) - below
    }

    /// The allocations the instance is made of, as `(start, bytes)`: the
    /// instance block (maximizer and segment 0), then one per later segment.
    pub fn blocks(&self) -> Vec<(RemoteAddr, u64)> {
        (0..self.segments.len())
            .map(|i| {
                if i == 0 {
                    (self.maximizer, CitronLayout::NODES + 8 * self.segment_nodes(0))
                } else {
                    (self.segments[i].nodes, 8 * self.segment_nodes(i))
                }
            })
            .collect()
    }

    /// Total bytes of lock memory.
    pub fn bytes(&self) -> u64 {
        self.blocks().iter().map(|b| b.1).sum()
    }
}

/// A contiguous run of one level's positions inside one segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Run {
    /// First position of the run on its level.
    pub first: u64,
    pub count: u64,
    /// Address of the node at `first`.
    pub addr: RemoteAddr,
}

/// A [`TreeGeometry`] prepared for address arithmetic: per level, the runs
/// of positions each segment holds.
#[derive(Clone, Debug)]
pub struct SegmentedTree {
    shape: TreeShape,
    /// `levels[L]`: the runs of level L, by increasing position, covering `[0, 4^L)`.
    levels: Vec<Vec<Run>>,
}

impl SegmentedTree {
    pub fn new(geometry: &TreeGeometry) -> Result<Self, GeometryError> {
        geometry.validate()?;
        let shape = geometry.shape();
        let depth = shape.depth();
        let mut levels = vec![Vec::new(); depth as usize + 1];
        let mut previous: Option<u32> = None;
        for seg in &geometry.segments {
            // Levels the segment's tree is below the current root.
            let shift = depth - seg.depth;
            let added = previous.map(|p| seg.depth - p);
            let mut offset = 0u64;
            for l in 0..=seg.depth {
                let width = 1u64 << (2 * l);
                let skip = match added {
                    Some(s) if l >= s => 1u64 << (2 * (l - s)),
                    _ => 0,
                };
                levels[(l + shift) as usize].push(Run {
                    first: skip,
                    count: width - skip,
                    addr: seg.nodes + 8 * offset,
                });
                offset += width - skip;
            }
            previous = Some(seg.depth);
        }
        Ok(Self { shape, levels })
    }

    pub fn shape(&self) -> TreeShape {
        self.shape
    }

    /// The address of the node at `pos` on `level`.
    #[inline]
    pub fn at(&self, level: u32, pos: u64) -> RemoteAddr {
        let runs = &self.levels[level as usize];
        // Later segments hold the higher positions; most nodes are there.
        for run in runs.iter().rev() {
            if pos >= run.first {
                debug_assert!(pos < run.first + run.count, "position {pos} beyond level {level}");
                return run.addr + 8 * (pos - run.first);
            }
        }
        unreachable!("the runs of a level start at position 0")
    }

    #[inline]
    pub fn node(&self, x: NodeIndex) -> RemoteAddr {
        let level = self.shape.level_of(x);
        self.at(level, x.0 - level_start(level))
    }

    #[inline]
    pub fn key(&self, k: NodeKey) -> RemoteAddr {
        debug_assert!(self.shape.contains(k), "{k:?} is not in a depth-{} tree", self.shape.depth());
        self.at(self.shape.depth() - k.height, k.pos)
    }

    /// The runs holding positions `[first, first + count)` of `level`, each
    /// cut to that interval: one read each.
    pub fn runs(&self, level: u32, first: u64, count: u64) -> Vec<Run> {
        let end = first + count;
        self.levels[level as usize]
            .iter()
            .filter_map(|run| {
                let a = run.first.max(first);
                let b = (run.first + run.count).min(end);
                (a < b).then(|| Run { first: a, count: b - a, addr: run.addr + 8 * (a - run.first) })
            })
            .collect()
    }

    /// The runs of every level, for scans of the whole tree.
    pub fn level_runs(&self, level: u32) -> &[Run] {
        &self.levels[level as usize]
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::*;
    use crate::rdma::RegionId;

    /// A geometry with the given depths, segment i at region offset 2^40 · i
    /// (far enough apart for any depth).
    fn geometry(depths: &[u32]) -> TreeGeometry {
        let base = RemoteAddr::new(RegionId(1), 4096);
        let mut segments = vec![TreeSegment { nodes: base + 16, depth: depths[0] }];
        for (i, &d) in depths.iter().enumerate().skip(1) {
            segments.push(TreeSegment { nodes: RemoteAddr::new(RegionId(1), (i as u64) << 40), depth: d });
        }
        TreeGeometry { version: depths.len() as u64, maximizer: base, segments }
    }

    #[test]
    fn one_segment_is_the_flat_layout() {
        let layout = CitronLayout { base: RemoteAddr::new(RegionId(1), 4096), shape: TreeShape::new(3) };
        let g = TreeGeometry::from_layout(layout);
        let t = SegmentedTree::new(&g).unwrap();
        for x in 1..=layout.shape.node_count() {
            assert_eq!(t.node(NodeIndex(x)), layout.node(NodeIndex(x)));
        }
        assert_eq!(g.blocks(), vec![(layout.base, CitronLayout::bytes(layout.shape))]);
    }

    #[test]
    fn a_scale_up_by_4_adds_a_root_and_three_siblings_per_level() {
        // Depth 1 (5 nodes) to depth 2 (21): the old root becomes node 2.
        let g = geometry(&[1, 2]);
        let t = SegmentedTree::new(&g).unwrap();
        let seg1 = g.segments[1].nodes;
        let old = g.segments[0].nodes;
        assert_eq!(t.node(NodeIndex(1)), seg1, "the new root comes first in the new segment");
        assert_eq!(t.node(NodeIndex(2)), old, "the old root is the new root's first child");
        assert_eq!(t.node(NodeIndex(3)), seg1 + 8);
        assert_eq!(t.node(NodeIndex(6)), old + 8, "old leaves stay where they were");
        assert_eq!(t.node(NodeIndex(9)), old + 32);
        assert_eq!(t.node(NodeIndex(10)), seg1 + 32);
        assert_eq!(g.segment_nodes(1), 16);
        // Node 2's descendants two levels down: positions 0..4 of level 2 are old.
        assert_eq!(t.runs(2, 0, 4), vec![Run { first: 0, count: 4, addr: old + 8 }]);
        // The root's: one run per segment on each level.
        assert_eq!(t.runs(1, 0, 4).len(), 2);
        assert_eq!(t.runs(2, 0, 16).len(), 2);
    }

    #[test]
    fn geometry_errors_are_reported() {
        let mut g = geometry(&[2, 3]);
        g.segments[1].depth = 2;
        assert!(matches!(g.validate(), Err(GeometryError::BadDepths(_))));
        let mut g = geometry(&[2]);
        g.segments[0].nodes = g.maximizer + 8;
        assert!(matches!(g.validate(), Err(GeometryError::DetachedFirstSegment { .. })));
        let g = TreeGeometry { version: 0, maximizer: RemoteAddr::new(RegionId(1), 0), segments: vec![] };
        assert_eq!(g.validate(), Err(GeometryError::NoSegment));
    }

    fn depth_history() -> impl Strategy<Value = Vec<u32>> {
        // Up to depth 8 (87381 nodes), so that every node can be visited.
        (1u32..=2, prop::collection::vec(1u32..=2, 0..4)).prop_map(|(d0, steps)| {
            let mut v = vec![d0];
            for s in steps {
                v.push(v.last().unwrap() + s);
            }
            v
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Every node of the current tree has its own address, inside its
        /// segment; nodes of an older generation keep theirs.
        #[test]
        fn addresses_are_distinct_inside_their_segments_and_stable(depths in depth_history()) {
            let g = geometry(&depths);
            let t = SegmentedTree::new(&g).unwrap();
            let shape = t.shape();
            let blocks = g.blocks();
            let mut seen: HashMap<RemoteAddr, NodeIndex> = HashMap::new();
            for x in 1..=shape.node_count() {
                let a = t.node(NodeIndex(x));
                prop_assert!(seen.insert(a, NodeIndex(x)).is_none(), "{a:?} twice");
                prop_assert!(a.is_aligned(8));
                let inside = blocks.iter().enumerate().any(|(i, &(start, bytes))| {
                    let first = if i == 0 { start.offset + 16 } else { start.offset };
                    a.offset >= first && a.offset + 8 <= start.offset + bytes
                });
                prop_assert!(inside, "{a:?} outside every block {blocks:?}");
            }
            prop_assert_eq!(seen.len() as u64, g.blocks().iter().map(|b| b.1).sum::<u64>() / 8 - 2);
            // Every prefix of the history is an older generation of the same tree.
            for n in 1..depths.len() {
                let older = TreeGeometry { segments: g.segments[..n].to_vec(), ..g.clone() };
                let ot = SegmentedTree::new(&older).unwrap();
                for x in 1..=ot.shape().node_count() {
                    let k = ot.shape().key(NodeIndex(x));
                    prop_assert_eq!(ot.node(NodeIndex(x)), t.key(k), "node {:?} moved", k);
                }
            }
        }

        /// The runs of a node's descendants within m levels are exactly its
        /// descendants, and there are at most m(m+1)/2 of them.
        #[test]
        fn descendant_runs_cover_exactly(depths in depth_history(), pick in 0u64..1000, m in 1u32..=5) {
            let g = geometry(&depths);
            let t = SegmentedTree::new(&g).unwrap();
            let shape = t.shape();
            let x = NodeIndex(1 + pick % shape.node_count());
            let level = shape.level_of(x);
            let pos = x.0 - level_start(level);
            let mut reads = 0;
            for i in 0..m {
                let lvl = level + i;
                if lvl > shape.depth() {
                    break;
                }
                let (first, count) = (pos << (2 * i), 1u64 << (2 * i));
                let runs = t.runs(lvl, first, count);
                reads += runs.len();
                let mut next = first;
                for r in &runs {
                    prop_assert_eq!(r.first, next);
                    for j in 0..r.count {
                        prop_assert_eq!(r.addr + 8 * j, t.at(lvl, r.first + j));
                    }
                    next += r.count;
                }
                prop_assert_eq!(next, first + count);
            }
            prop_assert!(reads as u32 <= m * (m + 1) / 2, "{} reads", reads);
        }
    }
}
