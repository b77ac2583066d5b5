//! The cluster-wide "waiting for" entries of blocked POSIX lock owners, and
//! the deadlock check that follows them (DESIGN.md §4; Linux's
//! `posix_locks_deadlock`, fs/locks.c).
//!
//! Each POSIX owner blocked in `F_SETLKW` publishes one entry in a table in
//! lock-server memory: who waits, for which range of which file (the file is
//! named by its record table, so a follower can read who holds what there).
//! A requester about to wait first publishes its own entry, then follows the
//! chain from the owners that block it: for each, its entry says what it
//! waits for, and that file's records say who holds that; and so on, at most
//! [`MAX_DEPTH`] steps (Linux: `MAX_DEADLK_ITERATIONS`, 10). Reaching itself
//! means a cycle: the request fails with `EDEADLK` and withdraws its entry.
//!
//! Why one of two racing requesters always sees the cycle: each publishes
//! before it reads (every verb is linearisable at the lock server), so of two
//! owners that close a cycle at the same time, the one that reads second
//! sees the other's entry. Both may see it, and then both get `EDEADLK`
//! (POSIX allows the detection; Linux would refuse only one).
//!
//! Like Linux, only POSIX locks take part: OFD and flock waiters neither
//! publish nor are checked.
//!
//! # An entry (64 bytes)
//!
//! | word | meaning |
//! |---|---|
//! | 0 | bit 0: occupied; bits 32..64: client id |
//! | 1 | lock owner |
//! | 2 | packed address of the file's record table (first block) |
//! | 3, 4 | first and last byte waited for |
//! | 5 | bit 0: write mode |
//! | 6 | generation (changes at every publish) |
//! | 7 | checksum of words 0..7 |
//!
//! Entries are claimed with a CAS on word 0 and withdrawn with a write of 0.
//! The table is read whole (it is small: [`WaitsFor::capacity`] entries).

use citron_lock::rdma::{Endpoint, RemoteAddr, Verb};
use serde::{Deserialize, Serialize};

use super::record::{checksum, pack_addr, unpack_addr, SLOT_WORDS};
use super::table;
use super::types::{ByteRange, LockFlavor, LockMode, LockOwner, OwnerKey};
use crate::error::FsError;
use crate::types::ClientId;

/// Linux's bound on the chain it follows.
pub const MAX_DEPTH: usize = 10;
pub const ENTRY_BYTES: u64 = 64;
const OCCUPIED: u64 = 1;

/// Where the table is (from the cluster info).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WaitsFor {
    pub base: RemoteAddr,
    pub capacity: u32,
}

/// What one blocked owner waits for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Waiting {
    pub owner: OwnerKey,
    /// The file's record table (first block).
    pub table: RemoteAddr,
    pub range: ByteRange,
    pub mode: LockMode,
}

/// A published entry, to withdraw later.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Published {
    addr: RemoteAddr,
}

impl WaitsFor {
    pub fn bytes(capacity: u32) -> u64 {
        ENTRY_BYTES * u64::from(capacity)
    }

    fn entry(&self, i: u32) -> RemoteAddr {
        self.base + ENTRY_BYTES * u64::from(i)
    }

    fn encode(w: &Waiting, gen: u64) -> [u64; SLOT_WORDS] {
        let mut e = [0u64; SLOT_WORDS];
        e[0] = OCCUPIED | ((w.owner.client.0 & 0xffff_ffff) << 32);
        e[1] = w.owner.owner.0;
        e[2] = pack_addr(w.table).unwrap_or(0);
        e[3] = w.range.start;
        e[4] = w.range.last;
        e[5] = u64::from(w.mode == LockMode::Write);
        e[6] = gen;
        e[7] = checksum(&e);
        e
    }

    fn decode(e: &[u64; SLOT_WORDS]) -> Option<Waiting> {
        if e[0] & OCCUPIED == 0 || checksum(e) != e[7] {
            return None;
        }
        Some(Waiting {
            owner: OwnerKey { client: ClientId(e[0] >> 32), owner: LockOwner(e[1]) },
            table: unpack_addr(e[2])?,
            range: ByteRange::new(e[3], e[4])?,
            mode: if e[5] & 1 != 0 { LockMode::Write } else { LockMode::Read },
        })
    }

    /// Every entry that reads whole, with its index.
    fn read_all(&self, ep: &Endpoint) -> Result<Vec<(u32, [u64; SLOT_WORDS])>, FsError> {
        let mut buf = vec![0u8; Self::bytes(self.capacity) as usize];
        ep.read(self.base, &mut buf)?;
        Ok(buf
            .chunks_exact(ENTRY_BYTES as usize)
            .enumerate()
            .map(|(i, c)| {
                let mut e = [0u64; SLOT_WORDS];
                for (j, w) in e.iter_mut().enumerate() {
                    *w = u64::from_le_bytes(c[j * 8..j * 8 + 8].try_into().expect("8 bytes"));
                }
                (i as u32, e)
            })
            .collect())
    }

    /// Every published wait, for diagnostics.
    pub fn list(&self, ep: &Endpoint) -> Result<Vec<Waiting>, FsError> {
        Ok(self.read_all(ep)?.iter().filter_map(|(_, e)| Self::decode(e)).collect())
    }

    /// Publishes `w`. `ENOLCK` when the table is full.
    pub fn publish(&self, ep: &Endpoint, w: &Waiting) -> Result<Published, FsError> {
        for attempt in 0..4 {
            for (i, e) in self.read_all(ep)? {
                if e[0] & OCCUPIED != 0 {
                    continue;
                }
                let addr = self.entry(i);
                let gen = e[6].wrapping_add(1);
                let words = Self::encode(w, gen);
                // Claim with a CAS of word 0 (it names the owner), then
                // write the rest: until the body lands the checksum does not
                // match and readers skip the entry, and the publisher reads
                // nobody's entry before its own is whole.
                if ep.cas(addr, e[0], words[0])? != e[0] {
                    continue;
                }
                let body: Vec<u8> = words[1..].iter().flat_map(|x| x.to_le_bytes()).collect();
                table::execute(ep, &[Verb::Write { addr: addr + 8, data: body }])?;
                return Ok(Published { addr });
            }
            log::debug!("waits-for table full (attempt {attempt})");
        }
        Err(FsError::NoLocks)
    }

    /// Withdraws an entry.
    pub fn withdraw(&self, ep: &Endpoint, p: Published) -> Result<(), FsError> {
        ep.write_u64(p.addr, 0)?;
        Ok(())
    }

    /// Withdraws every entry of `client` (a client that died: the
    /// meta-server's cleanup).
    pub fn withdraw_client(&self, ep: &Endpoint, client: ClientId) -> Result<usize, FsError> {
        let mut n = 0;
        for (i, e) in self.read_all(ep)? {
            if Self::decode(&e).is_some_and(|w| w.owner.client == client) {
                ep.cas(self.entry(i), e[0], 0)?;
                n += 1;
            }
        }
        Ok(n)
    }

    /// Whether `me`, blocked by `blockers`, would close a cycle of waiting
    /// POSIX owners. `me`'s own entry must already be published.
    pub fn closes_cycle(&self, ep: &Endpoint, me: OwnerKey, blockers: &[OwnerKey]) -> Result<bool, FsError> {
        let mut frontier: Vec<OwnerKey> = blockers.to_vec();
        let mut seen: Vec<OwnerKey> = Vec::new();
        for _ in 0..MAX_DEPTH {
            if frontier.contains(&me) {
                return Ok(true);
            }
            if frontier.is_empty() {
                return Ok(false);
            }
            let waits = self.list(ep)?;
            let mut next = Vec::new();
            for b in frontier.drain(..) {
                if seen.contains(&b) {
                    continue;
                }
                seen.push(b);
                for w in waits.iter().filter(|w| w.owner == b) {
                    // Who holds what `b` waits for: read that file's table
                    // without a range lock (a snapshot, as Linux's check is
                    // a snapshot under its global lock); torn records are
                    // skipped.
                    let snapshot = table::read(ep, w.table)?;
                    for l in snapshot.records() {
                        if l.record.flavor == LockFlavor::Posix
                            && l.record.blocks(b, LockFlavor::Posix, w.mode, w.range)
                            && !next.contains(&l.record.owner)
                        {
                            next.push(l.record.owner);
                        }
                    }
                }
            }
            frontier = next;
        }
        Ok(frontier.contains(&me))
    }
}
