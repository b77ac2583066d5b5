//! The DSLR lock word (§4.4, Fig. 3) and a request's place in it, the
//! [`Ticket`] (§4.5): the field layout, and the arithmetic Alg. 1–3 do on
//! a decoded word (ready, passed, tickets ahead, the words a reset writes).
//! No verbs here.

use std::fmt;

use crate::rdma::arith::field_boundaries;
use crate::rwlock::Mode;

/// Bytes of lock memory: one word.
pub const DSLR_BYTES: u64 = 8;
/// Alignment of the lock word (an 8-byte atomic).
pub const DSLR_ALIGN: u64 = 8;
/// Width of each counter.
pub const FIELD_BITS: u32 = 16;
/// A counter's bits, before shifting.
pub const FIELD_MASK: u64 = (1 << FIELD_BITS) - 1;
pub const N_X_SHIFT: u32 = 48;
pub const N_S_SHIFT: u32 = 32;
pub const MAX_X_SHIFT: u32 = 16;
pub const MAX_S_SHIFT: u32 = 0;
/// Masked-FAA boundaries: the top bit of every counter.
pub const FIELD_BOUNDARIES: u64 = field_boundaries(&[
    (MAX_S_SHIFT, FIELD_BITS),
    (MAX_X_SHIFT, FIELD_BITS),
    (N_S_SHIFT, FIELD_BITS),
    (N_X_SHIFT, FIELD_BITS),
]);
/// The paper's COUNT_MAX (§4.9): counters are reset before a `max` field
/// reaches it; its bit is the canary.
pub const COUNT_MAX: u16 = 1 << 15;

/// A lock word, decoded.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct DslrWord(pub u64);

impl fmt::Debug for DslrWord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{{n_X {}, n_S {}, max_X {}, max_S {}}}", self.nx(), self.ns(), self.maxx(), self.maxs())
    }
}

impl DslrWord {
    pub const FREE: DslrWord = DslrWord(0);

    pub const fn new(nx: u16, ns: u16, maxx: u16, maxs: u16) -> Self {
        DslrWord(
            (nx as u64) << N_X_SHIFT
                | (ns as u64) << N_S_SHIFT
                | (maxx as u64) << MAX_X_SHIFT
                | (maxs as u64) << MAX_S_SHIFT,
        )
    }

    const fn field(self, shift: u32) -> u16 {
        ((self.0 >> shift) & FIELD_MASK) as u16
    }

    pub const fn nx(self) -> u16 {
        self.field(N_X_SHIFT)
    }

    pub const fn ns(self) -> u16 {
        self.field(N_S_SHIFT)
    }

    pub const fn maxx(self) -> u16 {
        self.field(MAX_X_SHIFT)
    }

    pub const fn maxs(self) -> u16 {
        self.field(MAX_S_SHIFT)
    }

    /// `{n_X, n_S}`: what moves when anybody releases, i.e. progress (§4.6).
    pub const fn served(self) -> u32 {
        (self.0 >> N_S_SHIFT) as u32
    }

    /// A `max` field has reached `count_max`: a reset is pending (§4.9).
    pub const fn canary(self, count_max: u16) -> bool {
        self.maxx() >= count_max || self.maxs() >= count_max
    }

    /// Every ticket taken has been served: nobody holds or waits.
    pub const fn drained(self) -> bool {
        self.nx() == self.maxx() && self.ns() == self.maxs()
    }
}

/// A place in the bakery's queue: the `max_X` and `max_S` the request's FA
/// returned (§4.5, Fig. 4 (b)), with its mode and number of slots (§5.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ticket {
    /// Exclusive tickets before this one.
    pub x: u16,
    /// Shared tickets before this one.
    pub s: u16,
    pub mode: Mode,
    /// Consecutive tickets taken at once (1 unless a multi-slot lease).
    pub slots: u16,
}

impl Ticket {
    /// The ticket an FA that returned `prev` obtained.
    pub const fn taken(prev: DslrWord, mode: Mode, slots: u16) -> Self {
        Ticket { x: prev.maxx(), s: prev.maxs(), mode, slots }
    }

    /// Tickets (slots) taken before this one since the last reset: the order
    /// of arrival that DSLR serves in (Appendix A.2, Lemma 2).
    pub const fn position(self) -> u32 {
        self.x as u32 + self.s as u32
    }

    /// May proceed (Alg. 1 lines 12, 26; Alg. 2 lines 6, 9).
    pub fn ready(self, val: DslrWord) -> bool {
        match self.mode {
            Mode::Shared => val.nx() == self.x,
            Mode::Exclusive => val.nx() == self.x && val.ns() == self.s,
        }
    }

    /// The word was reset past this ticket, so it will never be served
    /// (Alg. 2 line 3, restricted as the module comment of [`super`]
    /// explains), or it was reset to zero under it (a `max` field below this
    /// ticket's own FA).
    pub fn passed(self, val: DslrWord) -> bool {
        let (x, s, k) = (u32::from(self.x), u32::from(self.s), u32::from(self.slots));
        let (nx, ns, maxx, maxs) =
            (u32::from(val.nx()), u32::from(val.ns()), u32::from(val.maxx()), u32::from(val.maxs()));
        match self.mode {
            Mode::Shared => nx > x || maxs < s + k || maxx < x,
            Mode::Exclusive => nx > x || ns > s || maxx < x + k || maxs < s,
        }
    }

    /// Tickets ahead of this one not yet served: Alg. 2 line 20's
    /// `wait_count`, and §5.1's δ.
    pub fn ahead(self, val: DslrWord) -> u32 {
        u32::from(self.x.saturating_sub(val.nx())) + u32::from(self.s.saturating_sub(val.ns()))
    }

    /// The word once this ticket and every ticket before it are served and
    /// no later one was taken: Alg. 1 lines 11 and 25's `ResetFrom`.
    pub const fn drained_word(self) -> DslrWord {
        match self.mode {
            Mode::Shared => {
                let s = self.s + self.slots;
                DslrWord::new(self.x, s, self.x, s)
            }
            Mode::Exclusive => {
                let x = self.x + self.slots;
                DslrWord::new(x, self.s, x, self.s)
            }
        }
    }

    /// This ticket took its `max` field to `count_max`: its holder resets
    /// the word after releasing (Alg. 1 lines 10–11, 24–25).
    pub fn resets_counters(self, count_max: u16) -> bool {
        let mine = match self.mode {
            Mode::Shared => self.s,
            Mode::Exclusive => self.x,
        };
        u32::from(mine) + u32::from(self.slots) >= u32::from(count_max)
    }

    /// The word a waiter that found `val` silent for too long writes (Alg. 2
    /// lines 12–15; see the module comment of [`super`] for the shared
    /// case).
    pub fn skip_word(self, val: DslrWord) -> DslrWord {
        match self.mode {
            Mode::Shared => DslrWord::new(self.x, val.ns(), val.maxx(), val.maxs()),
            Mode::Exclusive => DslrWord::new(self.x + self.slots, self.s, val.maxx(), val.maxs()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rdma::arith::{field_delta, masked_faa_u64};

    fn w(nx: u16, ns: u16, maxx: u16, maxs: u16) -> DslrWord {
        DslrWord::new(nx, ns, maxx, maxs)
    }

    fn fa(word: DslrWord, shift: u32, delta: i64) -> DslrWord {
        DslrWord(masked_faa_u64(word.0, field_delta(shift, FIELD_BITS, delta), FIELD_BOUNDARIES))
    }

    #[test]
    fn fields_pack_where_the_table_says() {
        let word = w(0x1234, 0x5678, 0x9abc, 0xdef0);
        assert_eq!(word.0, 0x1234_5678_9abc_def0);
        assert_eq!((word.nx(), word.ns(), word.maxx(), word.maxs()), (0x1234, 0x5678, 0x9abc, 0xdef0));
        assert_eq!(word.served(), 0x1234_5678);
        assert_eq!(FIELD_BOUNDARIES, 1 << 15 | 1 << 31 | 1 << 47 | 1 << 63);
        assert_eq!(DSLR_BYTES, 8);
        assert_eq!(DslrWord::FREE, w(0, 0, 0, 0));
    }

    #[test]
    fn every_fa_stays_in_its_field() {
        // A ticket and its give-back restore the word exactly.
        let word = w(3, 4, 5, 6);
        for shift in [N_X_SHIFT, N_S_SHIFT, MAX_X_SHIFT, MAX_S_SHIFT] {
            assert_eq!(fa(fa(word, shift, 7), shift, -7), word);
        }
        assert_eq!(fa(word, MAX_X_SHIFT, 1), w(3, 4, 6, 6));
        assert_eq!(fa(word, N_S_SHIFT, 2), w(3, 6, 5, 6));
        // Wrap-around (a give-back landing on a zeroed word) stays inside.
        assert_eq!(fa(DslrWord::FREE, MAX_S_SHIFT, -1), w(0, 0, 0, 0xFFFF));
        assert_eq!(fa(w(0, 0, 0xFFFF, 0), MAX_X_SHIFT, 1), DslrWord::FREE);
        assert_eq!(fa(w(0xFFFF, 0, 0, 0), N_X_SHIFT, 1), DslrWord::FREE);
    }

    #[test]
    fn figure_4_exclusive_waits_for_shared_tickets() {
        // L = {1,1,1,4}; T3's FA(max_X) gives ticket {1,4} and L = {1,1,2,4}.
        let prev = w(1, 1, 1, 4);
        let t = Ticket::taken(prev, Mode::Exclusive, 1);
        assert_eq!((t.x, t.s, t.position()), (1, 4, 5));
        let now = fa(prev, MAX_X_SHIFT, 1);
        assert_eq!(now, w(1, 1, 2, 4));
        assert!(!t.ready(now) && !t.passed(now));
        assert_eq!(t.ahead(now), 3, "three shared tickets ahead (Fig. 4 (c))");
        assert!(!t.ready(w(1, 3, 2, 4)));
        assert!(t.ready(w(1, 4, 2, 6)) && !t.passed(w(1, 4, 2, 6)));
    }

    #[test]
    fn shared_tickets_wait_only_for_exclusive_ones() {
        let t = Ticket::taken(w(1, 1, 2, 4), Mode::Shared, 1);
        assert!(!t.ready(w(1, 1, 2, 5)));
        assert!(t.ready(w(2, 1, 2, 5)), "earlier readers may still be inside");
        // Readers behind us may release before we poll: n_S > our ticket is
        // not a reset for a reader.
        assert!(!t.passed(w(2, 6, 2, 6)));
        assert!(t.ready(w(2, 6, 2, 6)));
        // n_X past our ticket is: the exclusive after us cannot have been
        // served before us.
        assert!(t.passed(w(3, 1, 3, 5)));
    }

    #[test]
    fn passed_detects_resets_past_and_to_zero() {
        let ex = Ticket::taken(w(0, 0, 5, 9), Mode::Exclusive, 1);
        // In the word after our FA: {.., max_X 6, max_S 9}.
        assert!(!ex.passed(w(4, 9, 6, 9)));
        assert!(ex.passed(w(6, 9, 6, 9)), "n_X past us");
        assert!(ex.passed(w(5, 10, 6, 10)), "n_S past us");
        // Reset to zero, new tickets not yet past ours.
        assert!(ex.passed(DslrWord::FREE));
        assert!(ex.passed(w(0, 0, 5, 12)), "max_X below our own FA");
        assert!(ex.passed(w(2, 3, 7, 8)), "max_S below our ticket");
        let sh = Ticket::taken(w(0, 0, 2, 9), Mode::Shared, 1);
        assert!(!sh.passed(w(1, 0, 2, 10)));
        assert!(sh.passed(w(0, 0, 2, 9)), "max_S below our own FA");
        assert!(sh.passed(w(0, 0, 1, 12)), "max_X below our ticket");
    }

    #[test]
    fn overflow_reset_is_armed_by_the_ticket_reaching_count_max() {
        // Fig. 6: prev = {29998, 32765, 30000, 32767}, shared.
        let prev = w(29998, 32765, 30000, 32767);
        let t = Ticket::taken(prev, Mode::Shared, 1);
        assert!(t.resets_counters(COUNT_MAX));
        assert_eq!(t.drained_word(), w(30000, 32768, 30000, 32768));
        let after = fa(prev, MAX_S_SHIFT, 1);
        assert!(after.canary(COUNT_MAX) && !prev.canary(COUNT_MAX));
        assert!(!Ticket::taken(w(0, 0, 0, 32766), Mode::Shared, 1).resets_counters(COUNT_MAX));
        // Exclusive, with a small threshold and two slots crossing it.
        let t = Ticket::taken(w(0, 0, 14, 3), Mode::Exclusive, 2);
        assert!(t.resets_counters(16) && !t.resets_counters(17));
        assert_eq!(t.drained_word(), w(16, 3, 16, 3));
        assert!(t.drained_word().drained() && t.drained_word().canary(16));
        // Arrivals after the canary back off.
        assert!(w(3, 3, 16, 3).canary(16) && !w(3, 3, 15, 3).canary(16));
    }

    #[test]
    fn lease_resets_consume_exactly_the_tickets_ahead() {
        // A dead exclusive holder (ticket x=0), a waiting exclusive (x=1),
        // a waiting reader (x=2, s=0) and us, exclusive (x=2, s=1).
        let val = w(0, 0, 3, 1);
        let e1 = Ticket { x: 1, s: 0, mode: Mode::Exclusive, slots: 1 };
        let r = Ticket { x: 2, s: 0, mode: Mode::Shared, slots: 1 };
        let us = Ticket { x: 2, s: 1, mode: Mode::Exclusive, slots: 1 };
        let reset = us.skip_word(val);
        assert_eq!(reset, w(3, 1, 3, 1), "Alg. 2 line 15: {{prev(max_X)+1, prev(max_S)}}");
        assert!(e1.passed(reset) && r.passed(reset), "both skipped tickets notice");
        // A later reader (x=3) may now go; the word is drained: we retry.
        assert!(Ticket { x: 3, s: 1, mode: Mode::Shared, slots: 1 }.ready(reset));
        assert!(reset.drained());
        // Had the reader timed out first: only the exclusive tickets before
        // it are skipped, and the reader holds its own ticket.
        let reset = r.skip_word(val);
        assert_eq!(reset, w(2, 0, 3, 1));
        assert!(e1.passed(reset) && !r.passed(reset) && r.ready(reset));
        assert!(!us.passed(reset) && !us.ready(reset), "the writer still waits for the reader");
    }
}
