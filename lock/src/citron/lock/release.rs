//! Releasing a range (citron-fast23.md Algorithm 3, §3.6): every verb of
//! the held nodes in one batch, then the spillover mutex; and lines 10–12,
//! following units a scale-up carried to new ancestors since acquisition.
//!
//! A node released after its lease ([`CitronClient::release_late`]) is
//! guarded: the paper's Algorithm 3 applies a release whenever it comes,
//! and a late one then undoes what a recovery set up (it clears the Occ of
//! the client that took the node over and serves the next ticket while that
//! one holds; it raises a DCnt that Line 36 already levelled).

use super::{old_word, CitronClient, HeldNode, HeldRange, ScalePolicy, TCNT_FIELD};
use crate::citron::geometry::SegmentedTree;
use crate::citron::scale::{carried_to, Anchor};
use crate::citron::word::{Internal, BOUNDARIES, COUNTER_BITS, DONE_BELOW, OCC_BIT, TCNT_SHIFT, VACATE};
use crate::rdma::{Endpoint, Verb, VerbReply};
use crate::rwlock::LockError;

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

impl CitronClient {
    /// Releases a range (Algorithm 3): every verb in one batch, then the
    /// spillover mutex; then, under [`ScalePolicy::AfterSpillover`], a
    /// scale-up if the range reached past the tree.
    pub fn release(&mut self, ep: &Endpoint, held: HeldRange) -> Result<(), LockError> {
        self.release_around(ep, held, Vec::new(), Vec::new())
    }

    /// [`CitronClient::release`] with the caller's verbs in Algorithm 3's
    /// batch: `before` (writes made under the range) first, so they
    /// execute before the release verbs and are visible to the next holder
    /// of any unit of the range, as if they had been waited for before the
    /// release; `after` (verbs the caller would post next, such as the
    /// release of another lock) last, so they execute once the range is
    /// released, as if posted after this call returned. When a node is
    /// released late, or the range held the spillover mutex, `after` waits
    /// for those releases instead. A refused verb of either fails the call;
    /// the range is released all the same.
    pub fn release_around(
        &mut self,
        ep: &Endpoint,
        held: HeldRange,
        before: Vec<Verb>,
        after: Vec<Verb>,
    ) -> Result<(), LockError> {
        let spilled = held.spillover;
        let result = self.release_range(ep, held, before, after);
        if spilled && result.is_ok() && self.policy == ScalePolicy::AfterSpillover && self.host.is_some() {
            if let Err(e) = self.scale_up_if_needed(ep) {
                log::warn!("scale-up after a spillover acquisition failed: {e}");
                self.stats.failed_scale_ups += 1;
            }
        }
        result
    }

    fn release_range(
        &mut self,
        ep: &Endpoint,
        held: HeldRange,
        before: Vec<Verb>,
        after: Vec<Verb>,
    ) -> Result<(), LockError> {
        // Nodes another held range still uses (it rode on them, see
        // [`super::own`]) stay held.
        let free = self.own.remove(held.start, held.units_end, &held.nodes);
        if !held.spillover {
            return self.release_nodes_around(ep, &free, before, after);
        }
        let result = self.release_nodes(ep, &free, before);
        let spillover = self.spillover.release(ep);
        let posted = crate::rwlock::execute_all(ep, &after);
        result.and(spillover).and(posted)
    }

    /// Algorithm 3 for `nodes`, after the verbs in `verbs`, in one batch;
    /// then lines 10–12: follow units a scale-up carried since acquisition.
    /// Nodes held past their lease are released by
    /// [`CitronClient::release_late`] instead, and the result is then
    /// [`LockError::Fenced`].
    pub(super) fn release_nodes(
        &mut self,
        ep: &Endpoint,
        nodes: &[HeldNode],
        verbs: Vec<Verb>,
    ) -> Result<(), LockError> {
        self.release_nodes_around(ep, nodes, verbs, Vec::new())
    }

    /// [`CitronClient::release_nodes`] with `after` last in the batch, or,
    /// when some node is late, posted after its late release.
    fn release_nodes_around(
        &mut self,
        ep: &Endpoint,
        nodes: &[HeldNode],
        before: Vec<Verb>,
        mut after: Vec<Verb>,
    ) -> Result<(), LockError> {
        let on_time = self.on_time();
        let (late, prompt): (Vec<&HeldNode>, Vec<&HeldNode>) =
            nodes.iter().partition(|h| h.acquired_at.elapsed() >= on_time);
        if late.is_empty() {
            return self.release_prompt(ep, &prompt, before, after);
        }
        let released = self.release_prompt(ep, &prompt, before, Vec::new());
        let late = self.release_late(ep, &late);
        let posted = crate::rwlock::execute_all(ep, &std::mem::take(&mut after));
        // A refused verb of the caller's says more than the late release's
        // `Fenced`, which the caller may take as no failure.
        match (released.and(late), posted) {
            (Err(LockError::Fenced), Err(e)) => Err(e),
            (released, posted) => released.and(posted),
        }
    }

    fn release_prompt(
        &mut self,
        ep: &Endpoint,
        nodes: &[&HeldNode],
        mut verbs: Vec<Verb>,
        after: Vec<Verb>,
    ) -> Result<(), LockError> {
        let cur = self.current.clone();
        let mut anchors = Vec::new();
        for h in nodes {
            if let Some(slot) = release_verbs(&cur.tree, h, &mut verbs) {
                anchors.push((slot, h.anchor.expect("a slot implies an anchor")));
            }
        }
        verbs.extend(after);
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

    /// Releases nodes held past their lease (§3.10), where recovery may have
    /// taken them over. Only what can be told to be still ours is changed:
    /// an internal node is vacated with a masked-CAS that compares our
    /// ticket in TCnt and Occ (a Line 11 takeover changed them, and the CAS
    /// then changes nothing), and the child leaves the §3.8 shortcut took
    /// are cleared only after it succeeded. Leaf bits and notifications are
    /// left alone: whether Line 22 cleared the bits (and someone took them
    /// since) or Line 36 levelled the notifications cannot be read from the
    /// words, and the recoveries that would have repaired them after a dead
    /// client repair them now. Always [`LockError::Fenced`]: exclusion may
    /// have ended while we held.
    pub(super) fn release_late(&mut self, ep: &Endpoint, nodes: &[&HeldNode]) -> Result<(), LockError> {
        let cur = self.current.clone();
        let field = TCNT_FIELD | OCC_BIT;
        for h in nodes {
            self.stats.late_releases += 1;
            let Some(ticket) = h.ticket else { continue };
            let addr = cur.tree.key(h.key);
            let ours = (ticket.0 << TCNT_SHIFT) | OCC_BIT;
            let next = ((ticket.0 + 1) & ((1 << COUNTER_BITS) - 1)) << TCNT_SHIFT;
            let old = ep.masked_cas(addr, ours, field, next, field)?;
            if old & field != ours {
                log::warn!("node {:?} was taken over after our lease ran out; left as it is", h.key);
                continue;
            }
            if h.children {
                let shape = cur.tree.shape();
                let x = shape.index(h.key);
                let clear: Vec<Verb> = (0..4)
                    .map(|i| Verb::Write {
                        addr: cur.tree.node(x.child(i)),
                        data: 0u64.to_le_bytes().to_vec(),
                    })
                    .collect();
                for r in ep.execute(&clear)? {
                    r?;
                }
            }
        }
        log::warn!("a Citron range was released after its lease ({:?})", self.config.lease);
        Err(LockError::Fenced)
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
}
