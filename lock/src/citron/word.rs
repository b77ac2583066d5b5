//! The 64-bit words of the lock tree (Citron paper §3.4, Fig. 3).
//!
//! A leaf is a bitmap: bit i set = unit i of the leaf's 64 is locked. It is
//! changed only with masked-CAS.
//!
//! An internal node has two flags and four 15-bit counters, changed only with
//! masked-FAA. The paper fixes the fields but not their order; ours keeps
//! every field's top bit a masked-FAA boundary so no carry or borrow ever
//! leaks into a neighbour:
//!
//! | bits | field | meaning |
//! |---|---|---|
//! | 0..15 | TCnt | bakery "now serving" of requests at this node |
//! | 15 | Occ | a request holds (or is waiting in 2(d) for) this node |
//! | 16..31 | TMax | bakery next ticket at this node |
//! | 31 | Exp | a scale-up copied this node's DCnt/DMax to its new ancestors |
//! | 32..47 | DCnt | requests at descendants that have released |
//! | 47 | HB | heartbeat: toggled by the node's live floor holder while it waits |
//! | 48..63 | DMax | requests at descendants that have notified |
//! | 63 | Sup | this node was the root of a tree that has been scaled up |
//!
//! Counters wrap at 2^15; they are only compared for equality, which is
//! exact while fewer than 32767 clients use one lock (§3.4).
//!
//! **Exp and Sup** (§3.9.1; our split of the paper's single Exp flag, argued
//! in [`super::scale`]). The paper sets Exp on every node of the old tree's
//! top m levels and reads it both as "this tree generation is superseded" (at
//! the root, Alg. 2 line 15) and as "this node's counters were carried to its
//! new ancestors" (at the highest notified node, line 33 and Alg. 3 line 10).
//! With a scale-up factor below 4^m a node stays in the top m levels for
//! several scale-ups, so one bit cannot say which of them carried what. Here
//! each bit is set at most once in a node's life (until a scale-down), by a
//! masked-CAS that also returns the word it marks:
//! * Sup, on the old root, by every scale-up (its first verb);
//! * Exp, on a node whose counters a scale-up carries, i.e. once the node
//!   is m or more levels below the new root.
//!
//! Both live in 1-bit fields of [`BOUNDARIES`], so no masked-FAA on a
//! counter ever changes them.
//!
//! **Progress marks** (§3.10; why, in `lock::recovery`). A waiter takes a
//! word for a dead client's when it stops moving for a lease, so a live
//! client that waits longer than that must keep it moving without changing
//! what it means: the client whose ticket a node serves toggles HB
//! ([`HEARTBEAT`]), and a client in Step 2(d) adds one to both DCnt and DMax
//! of each node it notified ([`TICK_BELOW`]), which leaves every pending
//! count as it was.

use crate::rdma::arith::{field_boundaries, field_delta};

pub const COUNTER_BITS: u32 = 15;
const COUNTER_MASK: u64 = (1 << COUNTER_BITS) - 1;

pub const TCNT_SHIFT: u32 = 0;
pub const OCC_SHIFT: u32 = 15;
pub const TMAX_SHIFT: u32 = 16;
pub const EXP_SHIFT: u32 = 31;
pub const DCNT_SHIFT: u32 = 32;
pub const DMAX_SHIFT: u32 = 48;

pub const HEARTBEAT_SHIFT: u32 = 47;
pub const SUP_SHIFT: u32 = 63;

pub const OCC_BIT: u64 = 1 << OCC_SHIFT;
pub const EXP_BIT: u64 = 1 << EXP_SHIFT;
pub const SUP_BIT: u64 = 1 << SUP_SHIFT;
pub const HEARTBEAT_BIT: u64 = 1 << HEARTBEAT_SHIFT;
/// The DCnt and DMax fields.
pub const DCNT_FIELD: u64 = COUNTER_MASK << DCNT_SHIFT;
pub const DMAX_FIELD: u64 = COUNTER_MASK << DMAX_SHIFT;

/// The masked-FAA boundary mask of an internal node: the top bit of every
/// field (including the two unused 1-bit fields).
pub const BOUNDARIES: u64 = field_boundaries(&[
    (TCNT_SHIFT, COUNTER_BITS),
    (OCC_SHIFT, 1),
    (TMAX_SHIFT, COUNTER_BITS),
    (EXP_SHIFT, 1),
    (DCNT_SHIFT, COUNTER_BITS),
    (HEARTBEAT_SHIFT, 1),
    (DMAX_SHIFT, COUNTER_BITS),
    (SUP_SHIFT, 1),
]);

/// Masked-FAA operands for the updates the protocol makes.
pub const TAKE_TICKET: u64 = field_delta(TMAX_SHIFT, COUNTER_BITS, 1);
pub const OCCUPY: u64 = field_delta(OCC_SHIFT, 1, 1);
/// Release of an internal node (Alg. 3 line 7): Occ - 1, TCnt + 1.
pub const VACATE: u64 = field_delta(OCC_SHIFT, 1, -1) | field_delta(TCNT_SHIFT, COUNTER_BITS, 1);
pub const NOTIFY: u64 = field_delta(DMAX_SHIFT, COUNTER_BITS, 1);
pub const DONE_BELOW: u64 = field_delta(DCNT_SHIFT, COUNTER_BITS, 1);
/// Toggles HB (a 1-bit field: adding one flips it, the carry stops at its
/// boundary).
pub const HEARTBEAT: u64 = field_delta(HEARTBEAT_SHIFT, 1, 1);
/// DCnt + 1 and DMax + 1: the count of pending descendants stays, both
/// counters move (a notifier's progress mark).
pub const TICK_BELOW: u64 = NOTIFY | DONE_BELOW;

/// The masked-FAA operand that adds `dcnt` to DCnt and `dmax` to DMax
/// (each modulo 2^15): how a scale-up carries counters (Alg. 4 line 8).
pub const fn carry_counters(dcnt: u64, dmax: u64) -> u64 {
    ((dcnt & COUNTER_MASK) << DCNT_SHIFT) | ((dmax & COUNTER_MASK) << DMAX_SHIFT)
}

/// A decoded internal node.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Internal(pub u64);

impl std::fmt::Debug for Internal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "T{}/{} D{}/{}{}{}",
            self.tcnt(),
            self.tmax(),
            self.dcnt(),
            self.dmax(),
            if self.occupied() { " occ" } else { "" },
            if self.expanded() { " exp" } else { "" },
        )?;
        if self.superseded() {
            write!(f, " sup")?;
        }
        Ok(())
    }
}

impl Internal {
    pub fn tcnt(self) -> u64 {
        (self.0 >> TCNT_SHIFT) & COUNTER_MASK
    }
    pub fn tmax(self) -> u64 {
        (self.0 >> TMAX_SHIFT) & COUNTER_MASK
    }
    pub fn dcnt(self) -> u64 {
        (self.0 >> DCNT_SHIFT) & COUNTER_MASK
    }
    pub fn dmax(self) -> u64 {
        (self.0 >> DMAX_SHIFT) & COUNTER_MASK
    }
    pub fn occupied(self) -> bool {
        self.0 & OCC_BIT != 0
    }
    pub fn expanded(self) -> bool {
        self.0 & EXP_BIT != 0
    }
    pub fn superseded(self) -> bool {
        self.0 & SUP_BIT != 0
    }
    /// Idle: nobody holds, waits at, or is notified below this node.
    pub fn idle(self) -> bool {
        !self.occupied() && self.tcnt() == self.tmax() && self.descendants_quiet()
    }
    /// No request at a descendant is between notifying and releasing.
    pub fn descendants_quiet(self) -> bool {
        self.dcnt() == self.dmax()
    }
}

/// A bakery ticket taken at an internal node (its TMax before the FAA).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ticket(pub u64);

impl Ticket {
    pub fn from_old_word(old: u64) -> Self {
        Ticket(Internal(old).tmax())
    }

    pub fn is_served(self, now: Internal) -> bool {
        now.tcnt() == self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rdma::arith::masked_faa_u64;

    #[test]
    fn fields_are_independent_under_masked_faa() {
        let mut w = 0u64;
        w = masked_faa_u64(w, TAKE_TICKET, BOUNDARIES);
        w = masked_faa_u64(w, OCCUPY, BOUNDARIES);
        w = masked_faa_u64(w, NOTIFY, BOUNDARIES);
        let n = Internal(w);
        assert_eq!((n.tmax(), n.tcnt(), n.dmax(), n.dcnt()), (1, 0, 1, 0));
        assert!(n.occupied() && !n.expanded() && !n.descendants_quiet());
        w = masked_faa_u64(w, VACATE, BOUNDARIES);
        w = masked_faa_u64(w, DONE_BELOW, BOUNDARIES);
        let n = Internal(w);
        assert_eq!((n.tmax(), n.tcnt(), n.dmax(), n.dcnt()), (1, 1, 1, 1));
        assert!(!n.occupied() && n.descendants_quiet());
    }

    #[test]
    fn counters_wrap_inside_their_fields() {
        // TMax at its maximum: the next ticket wraps to 0 without touching Exp.
        let w = (COUNTER_MASK << TMAX_SHIFT) | (COUNTER_MASK << TCNT_SHIFT) | OCC_BIT;
        let after = masked_faa_u64(w, TAKE_TICKET, BOUNDARIES);
        assert_eq!(Internal(after).tmax(), 0);
        assert!(!Internal(after).expanded());
        // Vacate: TCnt wraps to 0, Occ clears, TMax untouched.
        let after = masked_faa_u64(after, VACATE, BOUNDARIES);
        assert_eq!(
            (Internal(after).tcnt(), Internal(after).occupied(), Internal(after).tmax()),
            (0, false, 0)
        );
        // DMax wraps without reaching the spare top bit.
        let w = COUNTER_MASK << DMAX_SHIFT;
        assert_eq!(masked_faa_u64(w, NOTIFY, BOUNDARIES), 0);
        let t = Ticket::from_old_word(COUNTER_MASK << TMAX_SHIFT);
        assert!(t.is_served(Internal(COUNTER_MASK)));
    }

    #[test]
    fn flags_survive_counter_arithmetic() {
        // Sup and Exp set, every counter at its maximum: any carry or borrow
        // would reach a flag if the boundaries were wrong.
        let w = SUP_BIT | EXP_BIT | DCNT_FIELD | DMAX_FIELD | (COUNTER_MASK << TMAX_SHIFT) | COUNTER_MASK;
        for op in [TAKE_TICKET, NOTIFY, DONE_BELOW, VACATE, carry_counters(COUNTER_MASK, COUNTER_MASK)] {
            let after = Internal(masked_faa_u64(w, op, BOUNDARIES));
            assert!(after.superseded() && after.expanded(), "{op:#x}: {after:?}");
        }
        // Carrying wraps each counter inside its field.
        let w = Internal(masked_faa_u64(DCNT_FIELD, carry_counters(3, 5), BOUNDARIES));
        assert_eq!((w.dcnt(), w.dmax(), w.superseded()), (2, 5, false));
        assert!(Internal(0).idle() && !Internal(OCC_BIT).idle() && !Internal(NOTIFY).idle());
    }

    #[test]
    fn progress_marks_move_the_word_and_change_nothing_it_means() {
        let w = SUP_BIT
            | EXP_BIT
            | OCC_BIT
            | (5 << TMAX_SHIFT)
            | 4
            | (COUNTER_MASK << DCNT_SHIFT)
            | (2 << DMAX_SHIFT);
        let beat = masked_faa_u64(w, HEARTBEAT, BOUNDARIES);
        assert_eq!(beat ^ w, HEARTBEAT_BIT, "only HB flips");
        assert_eq!(masked_faa_u64(beat, HEARTBEAT, BOUNDARIES), w, "and flips back");
        let tick = Internal(masked_faa_u64(w, TICK_BELOW, BOUNDARIES));
        let was = Internal(w);
        assert_ne!(tick, was);
        assert_eq!(
            tick.dmax().wrapping_sub(tick.dcnt()) & COUNTER_MASK,
            (was.dmax().wrapping_sub(was.dcnt())) & COUNTER_MASK
        );
        assert_eq!(
            (tick.tcnt(), tick.tmax(), tick.occupied(), tick.expanded(), tick.superseded()),
            (4, 5, true, true, true)
        );
        assert!(Internal(masked_faa_u64(0, TICK_BELOW, BOUNDARIES)).idle(), "a tick keeps an idle word idle");
        assert!(Internal(HEARTBEAT_BIT).idle(), "HB says nothing about use");
    }
}
