//! Resizing the tree: scale-up (citron-fast23.md Algorithm 4, §3.9.1) by
//! the client or, through [`TreeHost::runs_scale_ups`], by the lock host;
//! and scale-down under exclusive use (§3.9.2). The rules of marking and
//! carrying are in [`crate::citron::scale`].

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use super::{old_word, CitronClient, CitronLayout};
use crate::citron::geometry::{nodes_of_depth, SegmentedTree, TreeGeometry, TreeSegment};
use crate::citron::host::TreeHost;
use crate::citron::scale::{expansion_plan, MIN_SCALE_LEVELS};
use crate::citron::tree::{NodeIndex, NodeKey, TreeShape};
use crate::citron::word::{carry_counters, Internal, BOUNDARIES, COUNTER_BITS, EXP_BIT, SUP_BIT};
use crate::rdma::{Endpoint, Verb, VerbCounts, VerbReply};
use crate::rwlock::{LockError, Mode};

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

impl CitronClient {
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
}
