//! Masked atomics emulated with compare-and-swap, for devices without the
//! vendor's extended ("masked") atomics.
//!
//! Standard verbs have an 8-byte CAS and an 8-byte FAA, nothing else. The
//! masked-CAS and masked-FAA of the Citron paper §2.1 (citron-fast23.md
//! lines 67–71) are computed here by the client and applied with a CAS loop:
//!
//! ```text
//! old ← guess, or READ(word)                         1 round trip without a guess
//! loop:
//!     new ← arith(old)                                 the same rdma::arith as every backend
//!     compare fails on a value we read, or new = old → return old      (no write)
//!     seen ← CAS(word, old, new)                       1 round trip
//!     seen = old → return old
//!     old ← seen                                       the CAS returned what is there now
//! ```
//!
//! Linearisation: a successful CAS is the point at which the masked verb
//! took effect; a failed compare (or a no-op) takes effect at the READ or
//! failed CAS that returned the value it was decided on. A guess (the value
//! the endpoint last saw there) is never trusted to *decide* a failure or a
//! no-op: only to save the READ when it is right.
//!
//! Cost, which the endpoint's verb counters show as round trips: 2 without
//! contention (READ + CAS), 1 with a right guess or when the compare fails on
//! the first READ, plus one CAS per concurrent change of the word between our
//! READ and our CAS. It is lock-free (some CAS always succeeds), not
//! wait-free: under heavy contention on one word a client can retry, which a
//! device with masked atomics never does.
//!
//! Only 8-byte words: a 16-byte masked atomic cannot be built from 8-byte CAS
//! (ShiftLock's release compares `TailPtr` in one half and swaps `RelCnt` in
//! the other, and every 16-byte verb returns the whole old entry, which no
//! pair of 8-byte verbs reads atomically). See [`super::plan`] for where
//! those go.
//!
//! The loop is written against [`WordVerbs`], so the same code runs on the
//! wire (the `ib` queue pair) and in tests against the shm backend and an
//! in-memory model with injected interference.

use crate::rdma::arith;

/// The two primitive verbs the emulation needs, on one 8-byte word.
pub trait WordVerbs {
    type Addr: Copy;
    type Error;
    /// An 8-byte READ.
    fn read_word(&mut self, at: Self::Addr) -> Result<u64, Self::Error>;
    /// An 8-byte CAS; returns the old value.
    fn cas_word(&mut self, at: Self::Addr, expect: u64, new: u64) -> Result<u64, Self::Error>;
}

/// What an emulated verb returned and what it cost.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Emulated {
    /// The old value, as the native verb would have returned it.
    pub old: u64,
    /// READs and CASes issued (each one round trip).
    pub reads: u64,
    pub cases: u64,
}

impl Emulated {
    pub fn round_trips(&self) -> u64 {
        self.reads + self.cases
    }
}

/// Applies `step` (old → new, or `None` when the compare fails) with a CAS
/// loop, starting from `guess` if given.
pub fn emulate<V: WordVerbs>(
    v: &mut V,
    at: V::Addr,
    guess: Option<u64>,
    step: impl Fn(u64) -> Option<u64>,
) -> Result<Emulated, V::Error> {
    let mut cost = Emulated { old: 0, reads: 0, cases: 0 };
    // `trusted`: `old` was returned by a verb of this call, so it may decide
    // a failed compare or a no-op.
    let (mut old, mut trusted) = match guess {
        Some(g) => (g, false),
        None => {
            cost.reads += 1;
            (v.read_word(at)?, true)
        }
    };
    loop {
        let new = match step(old) {
            Some(new) if new != old => new,
            // A failed compare or a no-op: done if we know the word held
            // `old`; otherwise learn what it holds.
            _ if trusted => {
                cost.old = old;
                return Ok(cost);
            }
            _ => {
                cost.reads += 1;
                old = v.read_word(at)?;
                trusted = true;
                continue;
            }
        };
        cost.cases += 1;
        let seen = v.cas_word(at, old, new)?;
        if seen == old {
            cost.old = old;
            return Ok(cost);
        }
        old = seen;
        trusted = true;
    }
}

/// Masked compare-and-swap ([`arith::masked_cas_u64`]) by a CAS loop.
pub fn masked_cas<V: WordVerbs>(
    v: &mut V,
    at: V::Addr,
    guess: Option<u64>,
    cmp: u64,
    cmp_mask: u64,
    swap: u64,
    swap_mask: u64,
) -> Result<Emulated, V::Error> {
    emulate(v, at, guess, |old| arith::masked_cas_u64(old, cmp, cmp_mask, swap, swap_mask))
}

/// Masked fetch-and-add ([`arith::masked_faa_u64`]) by a CAS loop.
pub fn masked_faa<V: WordVerbs>(
    v: &mut V,
    at: V::Addr,
    guess: Option<u64>,
    add: u64,
    boundary_mask: u64,
) -> Result<Emulated, V::Error> {
    emulate(v, at, guess, |old| Some(arith::masked_faa_u64(old, add, boundary_mask)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::convert::Infallible;

    /// One word in memory, plus interference: before the CAS numbers listed
    /// in `interfere`, another client adds `noise` to the word.
    struct Model {
        word: u64,
        interfere: Vec<u64>,
        noise: u64,
        cas_seen: u64,
    }

    impl WordVerbs for Model {
        type Addr = ();
        type Error = Infallible;
        fn read_word(&mut self, _: ()) -> Result<u64, Infallible> {
            Ok(self.word)
        }
        fn cas_word(&mut self, _: (), expect: u64, new: u64) -> Result<u64, Infallible> {
            self.cas_seen += 1;
            if self.interfere.contains(&self.cas_seen) {
                self.word = self.word.wrapping_add(self.noise);
            }
            let old = self.word;
            if old == expect {
                self.word = new;
            }
            Ok(old)
        }
    }

    fn model(word: u64) -> Model {
        Model { word, interfere: vec![], noise: 0, cas_seen: 0 }
    }

    #[test]
    fn uncontended_costs_a_read_and_a_cas() {
        let mut m = model(0b1000);
        let r = masked_cas(&mut m, (), None, 0, 0b11, 0b01, 0b11).unwrap();
        assert_eq!((r.old, r.reads, r.cases), (0b1000, 1, 1));
        assert_eq!(m.word, 0b1001);
    }

    #[test]
    fn a_failed_compare_costs_only_the_read() {
        let mut m = model(0b1);
        let r = masked_cas(&mut m, (), None, 0, 0b1, 0b1, 0b1).unwrap();
        assert_eq!((r.old, r.reads, r.cases), (1, 1, 0));
        assert_eq!(m.word, 1);
    }

    #[test]
    fn a_right_guess_saves_the_read_and_a_wrong_one_costs_a_cas() {
        let mut m = model(40);
        let r = masked_faa(&mut m, (), Some(40), 2, 0).unwrap();
        assert_eq!((r.old, r.reads, r.cases, m.word), (40, 0, 1, 42));
        let r = masked_faa(&mut m, (), Some(40), 2, 0).unwrap();
        assert_eq!((r.old, r.reads, r.cases, m.word), (42, 0, 2, 44), "the failed CAS returned 42");
    }

    #[test]
    fn a_stale_guess_never_decides_a_failure() {
        // The guess says the bit is set (compare fails), the word says it is clear.
        let mut m = model(0);
        let r = masked_cas(&mut m, (), Some(1), 0, 1, 1, 1).unwrap();
        assert_eq!((r.old, r.reads, r.cases, m.word), (0, 1, 1, 1));
    }

    #[test]
    fn interference_retries_and_the_result_includes_it() {
        // Two fields of 32 bits; another client adds to the high field
        // before our first and second CAS.
        let mask = arith::field_boundaries(&[(0, 32), (32, 32)]);
        let mut m = Model { word: 0xFFFF_FFFF, interfere: vec![1, 2], noise: 1 << 32, cas_seen: 0 };
        let r = masked_faa(&mut m, (), None, 1, mask).unwrap();
        assert_eq!((r.reads, r.cases), (1, 3));
        assert_eq!(r.old, 2 << 32 | 0xFFFF_FFFF, "the old value of the CAS that succeeded");
        assert_eq!(m.word, 2 << 32, "the carry stayed in the low field; both foreign adds kept");
    }

    proptest! {
        /// Against the pure arithmetic: whatever the guess and the
        /// interference, the emulation returns the word as it was when it
        /// took effect and leaves arith's result behind.
        #[test]
        fn agrees_with_the_arithmetic(word: u64, guess: Option<u64>, cmp: u64, cmp_mask: u64, swap: u64,
                                      swap_mask: u64, add: u64, boundary: u64, noise: u64,
                                      interfere in proptest::collection::vec(1u64..4, 0..3)) {
            let mut m = Model { word, interfere: interfere.clone(), noise, cas_seen: 0 };
            let r = masked_cas(&mut m, (), guess, cmp, cmp_mask, swap, swap_mask).unwrap();
            let expect = arith::masked_cas_u64(r.old, cmp, cmp_mask, swap, swap_mask).unwrap_or(r.old);
            prop_assert_eq!(m.word, expect);
            let mut m = Model { word, interfere, noise, cas_seen: 0 };
            let r = masked_faa(&mut m, (), guess, add, boundary).unwrap();
            prop_assert_eq!(m.word, arith::masked_faa_u64(r.old, add, boundary));
        }
    }
}
