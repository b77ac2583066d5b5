//! The two waits of Algorithm 2 (citron-fast23.md §3.5) and whom a node
//! notifies: Step 2(b), Lines 12–19 (occupied ancestors, with the Line 18
//! recovery of §3.10), and Step 2(d), Lines 35–36 (descendants that
//! notified, with the Line 36 recovery, not counting this client's own
//! held ranges: [`super::own`]); the notified levels of §3.5.5.

use std::time::Instant;

use super::acquire::Others;
use super::recovery::{Progress, Watch};
use super::{read_words, CitronClient};
use crate::citron::geometry::SegmentedTree;
use crate::citron::tree::{level_start, NodeIndex, TreeShape};
use crate::citron::word::{
    Internal, COUNTER_BITS, DCNT_FIELD, DCNT_SHIFT, DMAX_FIELD, HEARTBEAT_BIT, OCC_BIT,
};
use crate::rdma::{Endpoint, Verb};
use crate::rwlock::LockError;

/// What Step 2(b) found.
pub(super) enum Ancestors {
    /// No occupied ancestor; the oldest t1 (Inequation (1)).
    Clear(Instant),
    /// The root is superseded: a scale-up has begun (line 15).
    Superseded,
    /// An occupied ancestor made no progress for T_lease (§3.10).
    Stalled(NodeIndex),
}

impl CitronClient {
    /// Step 2(b). Returns the oldest t1 over all ancestors, or whether the
    /// root says the tree is being scaled up (abort, line 15).
    pub(super) fn wait_for_ancestors(
        &mut self,
        ep: &Endpoint,
        tree: &SegmentedTree,
        ancestors: &[NodeIndex],
        others: &mut Others,
        mut prefetched: Option<(Instant, Vec<Internal>)>,
        floor: Option<crate::rdma::RemoteAddr>,
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
            // Its holder's progress: TCnt, Occ, and HB while it waits.
            let key = |w: u64| w & (super::TCNT_FIELD | OCC_BIT | HEARTBEAT_BIT);
            let mut marks = Progress::holding(floor, &[], self.tick());
            let released = |w: u64| !Internal(w).occupied();
            match self.watch(ep, addr, released, key, self.stall(), &mut marks)? {
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
    pub(super) fn notify_set(&self, shape: TreeShape, node: NodeIndex) -> Vec<NodeIndex> {
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
    pub(super) fn wait_for_descendants(
        &mut self,
        ep: &Endpoint,
        tree: &SegmentedTree,
        node: NodeIndex,
        others: &mut Others,
        marks: &mut Progress,
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
                    pending.push((NodeIndex(level_start(*lvl) + run.first + j as u64), w.0));
                }
            }
        }
        if pending.is_empty() {
            return Ok(());
        }
        // Our own held ranges' notifications are not waited for, only the
        // others' (see [`super::own`]): quiet is DMax − DCnt = ours.
        let own = self.own.pending(&self.current.geometry.depths(), self.config.m);
        let on_time = self.on_time();
        let counter = (1u64 << COUNTER_BITS) - 1;
        // Pending notifications on word `w` other than our `ours`.
        let foreign = |w: u64, ours: u64| {
            Internal(w).dmax().wrapping_sub(Internal(w).dcnt()).wrapping_sub(ours) & counter
        };
        pending.retain(|&(desc, w)| foreign(w, own.on(shape.key(desc), on_time)) != 0);
        if pending.is_empty() {
            return Ok(());
        }
        self.yield_held(ep, others)?;
        // §3.10, Line 36: DCnt and DMax that do not move for H·T_lease (H:
        // our height; plus the half lease of the recovery module's margin,
        // plus the fence delay) belong to dead clients: a live notifier that
        // waits keeps them moving. Level DCnt with DMax (less our own
        // pending notifications).
        let height = shape.depth() - level;
        let stall = self.config.descendants_stall(height);
        for (desc, _) in pending {
            let addr = tree.node(desc);
            let key = shape.key(desc);
            loop {
                let counters = |w: u64| w & (DCNT_FIELD | DMAX_FIELD);
                let quiet = |w: u64| foreign(w, own.on(key, on_time)) == 0;
                match self.watch(ep, addr, quiet, counters, stall, marks)? {
                    Watch::Done(_) => break,
                    Watch::Stalled(w) => {
                        let seen = Internal(w);
                        log::warn!("levelling DCnt of node {} left behind by a dead client", desc.0);
                        let field = counter << DCNT_SHIFT;
                        let level_to = seen.dmax().wrapping_sub(own.on(key, on_time)) & counter;
                        ep.masked_cas(addr, w, field, level_to << DCNT_SHIFT, field)?;
                        self.stats_recovered();
                    }
                }
            }
        }
        Ok(())
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
}
