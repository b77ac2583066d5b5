//! The oracle of the ALock tests: a lock shared by the host's own threads
//! (CPU atomics on the mapped region) and remote clients (verbs), checked
//! even when remote RMWs are not atomic with the host's atomics
//! ([`RemoteAtomicity::NicOnly`](citron_lock::rdma::RemoteAtomicity::NicOnly)).
//!
//! The trick: no oracle word is read-modify-written by both sides. Each
//! cohort counts its holders inside in its own word with its own RMWs and
//! *reads* the other cohort's word, which is atomic in every mode. A holder
//! adds itself to its word, then reads both: of two holders that overlap,
//! the later to enter sees the earlier (every access is sequentially
//! consistent), so "someone else inside" is never missed.
//!
//! Words at `base` (8 bytes each):
//!
//! | offset | word | updated by |
//! |---|---|---|
//! | 0  | local holders inside | local RMW |
//! | 8  | remote holders inside | remote RMW |
//! | 16 | local critical sections done | local RMW |
//! | 24 | remote critical sections done | remote RMW |
//! | 32 | last entry: cohort (low byte) and its streak (above) | under the lock |
//! | 40 | longest local streak | under the lock |
//! | 48 | longest remote streak | under the lock |
//! | 56 | entries that followed the other cohort's | under the lock |
//! | 64 | local entries while the remote queue was not empty | under the lock |
//! | 72 | remote entries while the local queue was not empty | under the lock |
//! | 80 | local entries that found someone inside | local RMW |
//! | 88 | remote entries that found someone inside | remote RMW |
//!
//! A *streak* is a run of consecutive entries of one cohort made while the
//! other cohort's queue tail was not zero (it waited): ALock's budget bounds
//! it (see `citron_lock::alock`, "Budgets").

use std::sync::atomic::Ordering::SeqCst;

use citron_lock::alock::Cohort;
use citron_lock::rdma::{Endpoint, RegionMemory, RemoteAddr, Verb};

use crate::TEST_REGION;

pub const INSIDE_LOCAL: u64 = 0;
pub const INSIDE_REMOTE: u64 = 8;
pub const DONE_LOCAL: u64 = 16;
pub const DONE_REMOTE: u64 = 24;
pub const LAST: u64 = 32;
pub const MAX_STREAK_LOCAL: u64 = 40;
pub const MAX_STREAK_REMOTE: u64 = 48;
pub const SWITCHES: u64 = 56;
pub const CONTENDED_LOCAL: u64 = 64;
pub const CONTENDED_REMOTE: u64 = 72;
pub const VIOLATIONS_LOCAL: u64 = 80;
pub const VIOLATIONS_REMOTE: u64 = 88;
/// Bytes of the oracle.
pub const ORACLE_BYTES: u64 = 96;

/// Time between two critical sections of a stress thread (iteration `i`):
/// none, a yield, or a short sleep, so that queues also drain and leaders
/// meet empty and busy queues of the other cohort (the fast paths), not only
/// a lock that is always contended.
pub fn think(i: u64) {
    match i % 3 {
        0 => {}
        1 => std::thread::yield_now(),
        _ => std::thread::sleep(std::time::Duration::from_micros(10 + i % 40)),
    }
}

/// The words kept under the lock, read and written as one block.
const BOOK: u64 = LAST;
const BOOK_WORDS: usize = 6;

/// How one side reaches the oracle: the host's threads through the mapped
/// region, clients through an endpoint.
pub enum Access<'a> {
    Local(&'a RegionMemory),
    Remote(&'a Endpoint),
}

impl Access<'_> {
    pub fn cohort(&self) -> Cohort {
        match self {
            Access::Local(_) => Cohort::Local,
            Access::Remote(_) => Cohort::Remote,
        }
    }

    fn at(off: u64) -> RemoteAddr {
        RemoteAddr::new(TEST_REGION, off)
    }

    /// An RMW on a word of this side's own.
    fn add(&self, off: u64, v: u64) -> u64 {
        match self {
            Access::Local(m) => m.word(Self::at(off)).expect("oracle word").fetch_add(v, SeqCst),
            Access::Remote(ep) => ep.faa(Self::at(off), v).expect("oracle faa"),
        }
    }

    pub fn read(&self, off: u64) -> u64 {
        match self {
            Access::Local(m) => m.word(Self::at(off)).expect("oracle word").load(SeqCst),
            Access::Remote(ep) => ep.read_u64(Self::at(off)).expect("oracle read"),
        }
    }

    fn read_block(&self, off: u64) -> [u64; BOOK_WORDS] {
        let mut out = [0u64; BOOK_WORDS];
        match self {
            Access::Local(_) => {
                for (i, w) in out.iter_mut().enumerate() {
                    *w = self.read(off + 8 * i as u64);
                }
            }
            Access::Remote(ep) => {
                let mut b = [0u8; 8 * BOOK_WORDS];
                ep.read(Self::at(off), &mut b).expect("oracle read");
                for (w, c) in out.iter_mut().zip(b.chunks_exact(8)) {
                    *w = u64::from_le_bytes(c.try_into().unwrap());
                }
            }
        }
        out
    }

    fn write_block(&self, off: u64, words: &[u64; BOOK_WORDS]) {
        match self {
            Access::Local(m) => {
                for (i, w) in words.iter().enumerate() {
                    m.word(Self::at(off + 8 * i as u64)).expect("oracle word").store(*w, SeqCst);
                }
            }
            Access::Remote(ep) => {
                let data: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
                ep.write(Self::at(off), &data).expect("oracle write");
            }
        }
    }

    /// The other cohort's queue tail of the ALock at `lock` (read only;
    /// the remote one without its epoch and entry count): 0 when empty.
    pub fn other_tail(&self, lock: u64) -> u64 {
        use citron_lock::alock::{RemoteTail, TAIL_LOCAL, TAIL_REMOTE};
        match self {
            Access::Local(_) => self.read(lock + TAIL_REMOTE) & RemoteTail::CLIENT,
            Access::Remote(_) => self.read(lock + TAIL_LOCAL),
        }
    }
}

/// One side's view of the oracle at `base`.
pub struct Oracle<'a> {
    pub access: Access<'a>,
    pub base: u64,
}

impl Oracle<'_> {
    fn mine(&self, local: u64, remote: u64) -> u64 {
        self.base
            + match self.access.cohort() {
                Cohort::Local => local,
                Cohort::Remote => remote,
            }
    }

    fn theirs(&self, local: u64, remote: u64) -> u64 {
        self.base
            + match self.access.cohort() {
                Cohort::Local => remote,
                Cohort::Remote => local,
            }
    }

    /// Enters: returns how many other holders were inside (0 if the lock
    /// excludes). A remote holder's add and read go in one batch (in order).
    pub fn enter(&self) -> u64 {
        let (mine, theirs) =
            (self.mine(INSIDE_LOCAL, INSIDE_REMOTE), self.theirs(INSIDE_LOCAL, INSIDE_REMOTE));
        match &self.access {
            Access::Local(_) => {
                let before = self.access.add(mine, 1);
                before + self.access.read(theirs)
            }
            Access::Remote(ep) => {
                let r = ep
                    .execute(&[
                        Verb::Faa { addr: Access::at(mine), add: 1 },
                        Verb::Read { addr: Access::at(theirs), len: 8 },
                    ])
                    .expect("oracle batch");
                let before = match &r[0] {
                    Ok(citron_lock::rdma::VerbReply::Old(v)) => *v,
                    other => panic!("oracle faa: {other:?}"),
                };
                let other = match &r[1] {
                    Ok(citron_lock::rdma::VerbReply::Data(d)) => {
                        u64::from_le_bytes(d[..8].try_into().unwrap())
                    }
                    other => panic!("oracle read: {other:?}"),
                };
                before + other
            }
        }
    }

    /// Leaves and counts the critical section done.
    pub fn leave(&self) {
        self.access.add(self.mine(INSIDE_LOCAL, INSIDE_REMOTE), u64::MAX);
        self.access.add(self.mine(DONE_LOCAL, DONE_REMOTE), 1);
    }

    /// Counts an entry that found someone inside (for locks expected to fail).
    pub fn violation(&self) {
        self.access.add(self.mine(VIOLATIONS_LOCAL, VIOLATIONS_REMOTE), 1);
    }

    /// Books this entry under the lock: streaks and contention, given
    /// whether the other cohort's queue tail was set. Returns the streak.
    pub fn book(&self, other_waiting: bool) -> u64 {
        let cohort = self.access.cohort().word();
        let mut b = self.access.read_block(self.base + BOOK);
        let (last, streak) = (b[0] & 0xFF, b[0] >> 8);
        let streak = match (other_waiting, last == cohort) {
            (false, _) => 0,
            (true, true) => streak + 1,
            (true, false) => 1,
        };
        b[0] = cohort | streak << 8;
        let max = (self.mine(MAX_STREAK_LOCAL, MAX_STREAK_REMOTE) - self.base - BOOK) as usize / 8;
        b[max] = b[max].max(streak);
        if last != 0 && last != cohort {
            b[(SWITCHES - BOOK) as usize / 8] += 1;
        }
        if other_waiting {
            b[(self.mine(CONTENDED_LOCAL, CONTENDED_REMOTE) - self.base - BOOK) as usize / 8] += 1;
        }
        self.access.write_block(self.base + BOOK, &b);
        streak
    }
}
