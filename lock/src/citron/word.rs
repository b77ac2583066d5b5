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
//! | 31 | Exp | the tree was scaled up past this node |
//! | 32..47 | DCnt | requests at descendants that have released |
//! | 47 | — | unused, always 0 |
//! | 48..63 | DMax | requests at descendants that have notified |
//! | 63 | — | unused, always 0 |
//!
//! Counters wrap at 2^15; they are only compared for equality, which is
//! exact while fewer than 32767 clients use one lock (§3.4).

use crate::rdma::arith::{field_boundaries, field_delta};

pub const COUNTER_BITS: u32 = 15;
const COUNTER_MASK: u64 = (1 << COUNTER_BITS) - 1;

pub const TCNT_SHIFT: u32 = 0;
pub const OCC_SHIFT: u32 = 15;
pub const TMAX_SHIFT: u32 = 16;
pub const EXP_SHIFT: u32 = 31;
pub const DCNT_SHIFT: u32 = 32;
pub const DMAX_SHIFT: u32 = 48;

pub const OCC_BIT: u64 = 1 << OCC_SHIFT;
pub const EXP_BIT: u64 = 1 << EXP_SHIFT;

/// The masked-FAA boundary mask of an internal node: the top bit of every
/// field (including the two unused 1-bit fields).
pub const BOUNDARIES: u64 = field_boundaries(&[
    (TCNT_SHIFT, COUNTER_BITS),
    (OCC_SHIFT, 1),
    (TMAX_SHIFT, COUNTER_BITS),
    (EXP_SHIFT, 1),
    (DCNT_SHIFT, COUNTER_BITS),
    (47, 1),
    (DMAX_SHIFT, COUNTER_BITS),
    (63, 1),
]);

/// Masked-FAA operands for the updates the protocol makes.
pub const TAKE_TICKET: u64 = field_delta(TMAX_SHIFT, COUNTER_BITS, 1);
pub const OCCUPY: u64 = field_delta(OCC_SHIFT, 1, 1);
/// Release of an internal node (Alg. 3 line 7): Occ - 1, TCnt + 1.
pub const VACATE: u64 = field_delta(OCC_SHIFT, 1, -1) | field_delta(TCNT_SHIFT, COUNTER_BITS, 1);
pub const NOTIFY: u64 = field_delta(DMAX_SHIFT, COUNTER_BITS, 1);
pub const DONE_BELOW: u64 = field_delta(DCNT_SHIFT, COUNTER_BITS, 1);

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
            if self.expanded() { " exp" } else { "" }
        )
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
}
