//! Lease recovery (citron-fast23.md §3.10): what a waiter does when the
//! word it spins on stops moving for long enough — Line 11 (a stalled
//! bakery), Line 22 (a leaf that keeps refusing, with its parent held), and
//! the watched wait that Lines 18 and 36 use (their takeovers are made where
//! they wait, in [`super::acquire`]) — and the rules that keep it from ever
//! taking over a client that is alive.
//!
//! # Leases, and live clients that wait
//!
//! The paper's contract is that a range lock is released within T_lease, so
//! a word that does not move for T_lease belongs to a dead client. But a
//! client also occupies words *before* its lock is granted: the node whose
//! ticket it is served while it waits in 2(b) for an occupied ancestor, the
//! node it occupies and the ancestors it notified while it waits in 2(d) for
//! its descendants — and that wait alone lasts H·T_lease when a descendant
//! died and has to be levelled (Line 36). A waiter at Line 18 or Line 11
//! would take such a client for dead and take over its node (the paper's
//! thresholds allow it; the tests show both then holding). So:
//!
//! * **Progress marks.** While a client waits holding words, it marks
//!   progress on them every [`tick`](CitronClient::tick) = T_lease/4: the
//!   node whose ticket it is served gets its HB bit toggled ([`HEARTBEAT`]),
//!   the nodes it notified get DCnt and DMax raised together
//!   ([`TICK_BELOW`]); neither changes what the words mean. Watchers count
//!   a stall only while those do not move: Lines 11 and 18 watch TCnt, Occ
//!   and HB, Line 36 watches DCnt and DMax. So a waiting client is never
//!   taken over, however long it waits.
//! * **The lease of a held node** starts when its acquisition returns, the
//!   last progress mark having been made at most a tick before. Its holder
//!   must release within T_lease of that; recovery acts on a word only after
//!   it stood still for [`stall`](CitronClient::stall) = 3/2 T_lease (Line 36:
//!   H·T_lease + T_lease/2), which leaves T_lease/4 for the release to land,
//!   and clock drift.
//! * **A stall is only counted over reads close together** (at most half a
//!   tick apart): HB is one bit, and a watcher that was descheduled
//!   could otherwise see it back where it was and take two toggles for none.
//! * **A release after the lease is guarded** (Alg. 3 has none; DSLR's Alg. 3
//!   line 1 is the model, see `release`): it changes a word only where it
//!   can tell that no recovery took it over, and says
//!   [`LockError::Fenced`].
//!
//! # The fence delay: no takeover before the holder is fenced
//!
//! A holder acts under its lock only within T_lease of its acquisition (the
//! holder bound H; the file system checks it before each batch of data
//! verbs). But a *process* can stop right after such a check (SIGSTOP, a
//! descheduled VM) and resume later with its verbs still to send. Its
//! cluster fences it (the servers refuse its verbs) some time after its
//! lease at the cluster manager lapsed: [`super::CitronConfig::fence_delay`]
//! bounds how long after H that can take. So every takeover threshold here
//! is the paper's plus the fence delay: Lines 11, 18 and 22 after 3/2
//! T_lease + fence delay of stillness ([`CitronClient::stall`]), Line 36
//! after H·T_lease + T_lease/2 + fence delay, and Line 11's extra wait per
//! ticket ahead grows by it too. A stopped holder's verbs therefore reach
//! the servers either before the takeover (it resumed before its fence) or
//! not at all (refused). Ordering of the marks, the holder's on-time bound
//! (9/8 T_lease) and the late-release guard are unchanged: the argument
//! that "a holder within its on-time bound cannot have been recovered
//! against" needs only stall ≥ on-time + tick, which a later takeover
//! keeps; waiters' progress marks every tick keep moving the watched words
//! however long the threshold. A holder thread that stalls while its
//! process keeps renewing its lease is not fenced, and not covered: that
//! is what T_lease itself bounds.
//!
//! [`HEARTBEAT`]: crate::citron::word::HEARTBEAT
//! [`TICK_BELOW`]: crate::citron::word::TICK_BELOW

use std::time::{Duration, Instant};

use super::{CitronClient, HeldNode, TCNT_FIELD};
use crate::citron::geometry::SegmentedTree;
use crate::citron::tree::{NodeIndex, NodeKey};
use crate::citron::word::{
    Internal, Ticket, BOUNDARIES, COUNTER_BITS, HEARTBEAT, HEARTBEAT_BIT, OCC_BIT, TCNT_SHIFT, TICK_BELOW,
};
use crate::rdma::{Endpoint, RemoteAddr, Verb};
use crate::rwlock::LockError;

/// How a watched wait ended.
pub(super) enum Watch {
    Done(Instant),
    /// The watched bits did not move for the given time; the last word seen.
    Stalled(u64),
}

/// What a waiting client keeps moving (the progress marks of the module
/// comment), and when it last did.
pub(super) struct Progress {
    marks: Vec<Verb>,
    every: Duration,
    last: Instant,
}

impl Progress {
    /// A client that holds nothing while it waits.
    pub fn none() -> Self {
        Self { marks: Vec::new(), every: Duration::MAX, last: Instant::now() }
    }

    /// A client waiting with `floor` (the node whose ticket it is served,
    /// if internal) and the nodes it has notified.
    pub fn holding(floor: Option<RemoteAddr>, notified: &[RemoteAddr], every: Duration) -> Self {
        let mut marks: Vec<Verb> = floor
            .into_iter()
            .map(|addr| Verb::MaskedFaa { addr, add: HEARTBEAT, boundary_mask: BOUNDARIES })
            .collect();
        marks.extend(notified.iter().map(|&addr| Verb::MaskedFaa {
            addr,
            add: TICK_BELOW,
            boundary_mask: BOUNDARIES,
        }));
        Self { marks, every, last: Instant::now() }
    }

    /// The marks of a held node of `tree` (its floor, its notifications).
    pub fn of_held(tree: &SegmentedTree, held: &HeldNode, every: Duration) -> Self {
        let floor = (!held.leaf).then(|| tree.key(held.key));
        let notified: Vec<RemoteAddr> = held.notified.iter().map(|&k| tree.key(k)).collect();
        Self::holding(floor, &notified, every)
    }

    /// Makes the marks if a tick has passed since the last ones.
    fn due(&mut self, ep: &Endpoint) -> Result<(), LockError> {
        if self.marks.is_empty() || self.last.elapsed() < self.every {
            return Ok(());
        }
        for r in ep.execute(&self.marks)? {
            r?;
        }
        self.last = Instant::now();
        Ok(())
    }
}

impl CitronClient {
    /// How often a waiting client marks progress: T_lease / 4.
    pub(super) fn tick(&self) -> Duration {
        self.config.lease / 4
    }

    /// How long a word must stand still before a waiter takes it for a dead
    /// client's (Lines 11, 18, 22): 3/2 T_lease plus the fence delay
    /// ([`super::CitronConfig::takeover_stall`]).
    pub(super) fn stall(&self) -> Duration {
        self.config.takeover_stall()
    }

    /// How long after its acquisition a holder may still release a node as
    /// usual: 9/8 T_lease, a safe margin inside [`CitronClient::stall`]
    /// after the last progress mark (at most a tick before).
    pub(super) fn on_time(&self) -> Duration {
        self.config.lease * 9 / 8
    }

    /// §3.10, Line 22, with the leaf's parent `held` (and its progress
    /// marks). No client can take bits of the leaf any more, and every
    /// holder that notified the parent in time has released (2(d)); bits
    /// still set belong to a dead client, or to a live one whose
    /// notification came too late (Inequation (1)) and which is about to
    /// roll back with a masked-CAS on exactly its bits. Zeroing the word at
    /// once, as the paper's line does, would let that late roll-back clear
    /// bits a later holder of the leaf took after we release the parent. So
    /// the leaf is watched: bits that leave were a live client's; a word
    /// unchanged for [`CitronClient::stall`] holds a dead client's bits
    /// (every holder releases within T_lease), and only those bits are
    /// cleared, by a masked-CAS that compares them.
    ///
    /// Bits of this client's own held ranges (on time) are neither waited
    /// for nor cleared ([`super::own`]).
    pub(super) fn clear_dead_leaf_bits(
        &mut self,
        ep: &Endpoint,
        addr: RemoteAddr,
        (leaf, key): (NodeIndex, NodeKey),
        progress: &mut Progress,
    ) -> Result<(), LockError> {
        let on_time = self.on_time();
        let others = |w: u64, own: &super::own::Own| w & !own.leaf_bits(key, on_time);
        let mut word = others(ep.read_u64(addr)?, &self.own);
        let mut unchanged_since = Instant::now();
        while word != 0 {
            progress.due(ep)?;
            if unchanged_since.elapsed() >= self.stall() {
                if ep.masked_cas(addr, word, word, 0, word)? & word == word {
                    log::warn!("cleared bits {word:#x} of leaf {} left by a dead client", leaf.0);
                    self.stats.recoveries += 1;
                }
            } else {
                std::thread::sleep(self.config.t_wait.min(self.tick() / 4));
            }
            let now = others(ep.read_u64(addr)?, &self.own);
            if now != word {
                word = now;
                unchanged_since = Instant::now();
            }
        }
        Ok(())
    }

    /// Reads `addr` until `done` holds, or until `progress(word)` has not
    /// changed for `stall` (a dead client, §3.10), counted only over reads
    /// at most half a tick apart; makes `marks` meanwhile.
    pub(super) fn watch(
        &self,
        ep: &Endpoint,
        addr: RemoteAddr,
        done: impl Fn(u64) -> bool,
        progress: impl Fn(u64) -> u64,
        stall: Duration,
        marks: &mut Progress,
    ) -> Result<Watch, LockError> {
        let start = Instant::now();
        let gap = self.tick() / 2;
        let mut last: Option<(u64, Instant)> = None;
        let mut previous_read: Option<Instant> = None;
        let mut spins = 0u32;
        loop {
            marks.due(ep)?;
            let posted = Instant::now();
            let w = ep.read_u64(addr)?;
            if done(w) {
                return Ok(Watch::Done(posted));
            }
            let watched_closely = previous_read.is_some_and(|p| posted.duration_since(p) <= gap);
            previous_read = Some(posted);
            match last {
                Some((key, since)) if key == progress(w) && watched_closely => {
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
    /// TCnt, Occ and HB stall for [`CitronClient::stall`], wait (Δ −
    /// 1)·T_lease more (Δ: tickets ahead of ours), then take over with a
    /// masked-CAS that compares exactly the stalled TCnt, Occ and HB, so any
    /// progress in the meantime makes it fail harmlessly.
    pub(super) fn wait_for_ticket(
        &self,
        ep: &Endpoint,
        addr: RemoteAddr,
        ticket: Ticket,
    ) -> Result<(), LockError> {
        let watched = TCNT_FIELD | OCC_BIT | HEARTBEAT_BIT;
        let key = |w: u64| w & watched;
        let served = |w: u64| ticket.is_served(Internal(w));
        loop {
            let w = match self.watch(ep, addr, served, key, self.stall(), &mut Progress::none())? {
                Watch::Done(_) => return Ok(()),
                Watch::Stalled(w) => w,
            };
            let ahead = ticket.0.wrapping_sub(Internal(w).tcnt()) & ((1 << COUNTER_BITS) - 1);
            if ahead > 1 {
                let more = self.config.bakery_extra(ahead as u32);
                if let Watch::Done(_) = self.watch(ep, addr, served, key, more, &mut Progress::none())? {
                    return Ok(());
                }
            }
            log::warn!("taking over a bakery stalled at ticket {} by a dead client", Internal(w).tcnt());
            let swap = ticket.0 << TCNT_SHIFT;
            ep.masked_cas(addr, w, watched, swap, TCNT_FIELD | OCC_BIT)?;
            self.stats_recovered();
        }
    }

    pub(super) fn stats_recovered(&self) {
        self.recoveries.set(self.recoveries.get() + 1);
    }
}
