//! The wait-for graph of a deadlock stress, kept by the test, to judge every
//! `EDEADLK` the file system answers: one is justified only if the waiter
//! was on a cycle of waiting POSIX owners at some moment of its call.
//!
//! The test cannot see the exact moment a lock is granted or a wait is
//! registered, so the oracle keeps a graph that contains the true one at
//! every moment (an over-approximation):
//! * an owner counts as waiting from just before its request is made until
//!   its answer is seen (it really waits only inside that span);
//! * the lock it asks for counts as held by it over the same span ("maybe
//!   held": it may be granted at any moment of it), and then as held until
//!   the unlock of it has returned.
//!
//! Edges are added only when a request begins, so a cycle through an owner
//! that exists at some moment of its call was formed by some request that
//! began during the call (its own or a later one); at each begin the oracle
//! marks every waiting owner that is now on a cycle. An `EDEADLK` for an
//! owner never marked is spurious: no cycle through it existed, even in the
//! over-approximated graph.

use std::collections::BTreeSet;

use citronfs_core::locks::LockMode;
use std::sync::Mutex;

/// A lockable spot: (file, slot) of the stress.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Spot {
    pub file: usize,
    pub slot: usize,
}

/// One owner's entry in the graph.
#[derive(Clone, Debug, Default)]
struct OwnerState {
    held: BTreeSet<(Spot, bool)>,
    /// The request in flight: (spot, write).
    waiting: Option<(Spot, bool)>,
    /// Whether it has been on a cycle since its request began.
    cycle_seen: bool,
}

/// The graph, shared by every owner thread of the stress.
pub struct WaitGraph {
    owners: Mutex<Vec<OwnerState>>,
}

fn conflicts(a_write: bool, b_write: bool) -> bool {
    a_write || b_write
}

impl WaitGraph {
    pub fn new(owners: usize) -> Self {
        Self { owners: Mutex::new(vec![OwnerState::default(); owners]) }
    }

    /// Owner `o` is about to ask for `spot` in `mode`.
    pub fn begin(&self, o: usize, spot: Spot, mode: LockMode) {
        let mut owners = self.owners.lock().expect("oracle lock");
        let want = (spot, mode == LockMode::Write);
        owners[o].waiting = Some(want);
        owners[o].cycle_seen = false;
        for w in 0..owners.len() {
            if owners[w].waiting.is_some() && on_cycle(&owners, w) {
                owners[w].cycle_seen = true;
            }
        }
    }

    /// Owner `o`'s request was granted.
    pub fn granted(&self, o: usize) {
        let mut owners = self.owners.lock().expect("oracle lock");
        let want = owners[o].waiting.take().expect("a request in flight");
        owners[o].held.insert(want);
    }

    /// Owner `o`'s request ended without a grant; returns whether an
    /// `EDEADLK` for it is justified (it was on a cycle during its call).
    pub fn refused(&self, o: usize) -> bool {
        let mut owners = self.owners.lock().expect("oracle lock");
        owners[o].waiting = None;
        owners[o].cycle_seen
    }

    /// Owner `o` has unlocked `spot` (after the unlock returned).
    pub fn released(&self, o: usize, spot: Spot) {
        self.owners.lock().expect("oracle lock")[o].held.retain(|(s, _)| *s != spot);
    }

    /// The graph as text, for a failure message.
    pub fn dump(&self) -> String {
        let owners = self.owners.lock().expect("oracle lock");
        owners
            .iter()
            .enumerate()
            .map(|(i, o)| format!("owner {i}: holds {:?}, waits {:?}\n", o.held, o.waiting))
            .collect()
    }
}

/// Whether `w` (waiting) reaches itself through waits-for edges.
fn on_cycle(owners: &[OwnerState], w: usize) -> bool {
    let blockers = |x: usize| -> Vec<usize> {
        let Some((spot, write)) = owners[x].waiting else { return Vec::new() };
        (0..owners.len())
            .filter(|&y| y != x)
            .filter(|&y| {
                let o = &owners[y];
                o.held.iter().chain(o.waiting.iter()).any(|&(s, wr)| s == spot && conflicts(write, wr))
            })
            .collect()
    };
    let mut seen = vec![false; owners.len()];
    let mut stack = blockers(w);
    while let Some(x) = stack.pop() {
        if x == w {
            return true;
        }
        if !std::mem::replace(&mut seen[x], true) {
            stack.extend(blockers(x));
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_two_owner_cycle_is_seen_by_both() {
        let g = WaitGraph::new(3);
        let (a, b, c) = (Spot { file: 0, slot: 0 }, Spot { file: 1, slot: 0 }, Spot { file: 1, slot: 1 });
        g.begin(0, a, LockMode::Write);
        g.granted(0);
        g.begin(0, c, LockMode::Read);
        g.granted(0);
        g.begin(1, b, LockMode::Write);
        g.granted(1);
        g.begin(0, b, LockMode::Write);
        g.begin(2, c, LockMode::Write);
        g.begin(1, a, LockMode::Write);
        assert!(g.refused(1));
        assert!(g.refused(0));
        assert!(!g.refused(2), "owner 2 waits for the cycle but is not on it");
    }

    #[test]
    fn readers_do_not_block_readers() {
        let g = WaitGraph::new(2);
        let (a, b) = (Spot { file: 0, slot: 0 }, Spot { file: 0, slot: 1 });
        g.begin(0, a, LockMode::Read);
        g.granted(0);
        g.begin(1, b, LockMode::Write);
        g.granted(1);
        g.begin(0, b, LockMode::Read);
        g.begin(1, a, LockMode::Read);
        assert!(!g.refused(1));
    }
}
