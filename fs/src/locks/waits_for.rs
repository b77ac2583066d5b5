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
//! # Never a spurious `EDEADLK`
//!
//! Linux follows the chain under one global lock, so what it sees is one
//! moment. Here the entries and tables are read one after another while
//! other owners come and go, so a chain put together from those reads may
//! never have existed at any one moment (an owner that waited when its
//! entry was read was granted before the next table was read). So a cycle
//! found is checked again before it is answered (a double collect): every
//! entry and every holder's record on it is read a second time, and only if
//! each is word for word what the first pass read is the cycle reported.
//! Every entry and record carries a generation that changes at each
//! publish, withdrawal-and-reuse, claim and rewrite, so "unchanged" means
//! "there all along" between its two reads; every first read precedes every
//! second read, so at the moment between the two passes every edge of the
//! cycle existed together. The first edge (the requester is blocked by its
//! blockers) is fixed while it holds the range lock over its request, and
//! its own entry is its own. A cycle that does not survive the second pass
//! is looked for again a few times, then the request waits: it checks again
//! at its next retry (every wake-up and every periodic sweep), so a real
//! cycle — whose owners are all blocked, so whose edges stand still — is
//! still reported.
//!
//! Why one of two racing requesters always sees the cycle: each publishes
//! before it reads (every verb is linearisable at the lock server), so of two
//! owners that close a cycle at the same time, the one that reads second
//! sees the other's entry. Both may see it, and then both get `EDEADLK`
//! (POSIX allows the detection; Linux would refuse only one).
//!
//! # Only the requester that closes a cycle is refused
//!
//! A requester's entry is visible from its publish until it withdraws it
//! after finding a cycle, and an owner already waiting checks again at
//! every retry. Were that check like a requester's, the established
//! waiter would see the newcomer's entry in that window and be refused
//! too, though Linux (one lock over the check) refuses only the newcomer;
//! an application that then gave up its locks for nothing would see a
//! spurious failure (a CI failure of `waits_for_chain`, and on a far
//! client the window is many round trips long). So an owner already
//! waiting ([`Checker::Waiting`]) follows only owners that are registered
//! waiters too: whose file's table holds their waiting record, written
//! after their own check found no cycle. A requester still in its check
//! has no record yet, and it sees the cycle itself (it reads after every
//! established entry was published). If it cannot confirm the cycle, it
//! registers, and the next retry of any owner on the cycle follows it: a
//! cycle is still reported once its owners all wait.
//!
//! Like Linux, only POSIX locks take part: OFD and flock waiters neither
//! publish nor are checked.
//!
//! # An entry (64 bytes)
//!
//! | word | meaning |
//! |---|---|
//! | 0 | bit 0: occupied; bits 1..32: generation; bits 32..64: client id |
//! | 1 | lock owner |
//! | 2 | packed address of the file's record table (first block) |
//! | 3, 4 | first and last byte waited for |
//! | 5 | bit 0: write mode |
//! | 6 | reserved (0) |
//! | 7 | checksum of words 0..7 |
//!
//! An entry is claimed with a CAS on word 0 from free at generation `g` to
//! occupied at `g + 1`, then its body is written; it is withdrawn with a
//! write of word 0 that clears "occupied" and keeps the generation. The
//! generation is what makes a withdrawn body dead: before, withdrawing
//! zeroed word 0, so a publisher of the same client that claimed the slot
//! again produced the very same word 0, and until it wrote its body the
//! old body's checksum matched again — a reader followed a wait that had
//! ended. With the generation in word 0, the old checksum never matches a
//! newer claim.
//!
//! # Blocks (no fixed cap on waiters)
//!
//! The table is a chain of blocks of [`WaitsFor::capacity`] entries each.
//! The first block is made with the cluster; the last entry of every block
//! is its link, not an entry: its word 0 is the packed address of the next
//! block (0: none yet). A publisher that finds every entry of the chain
//! occupied asks the meta-server for the block after the last one it saw
//! ([`WaitsForGrowth`]; idempotent: a publisher that lost the race gets the
//! block another one added) and looks again. The meta-server grants a new
//! block to every admitted client before it writes the link that makes it
//! reachable, so a client that follows the link may use it; a client
//! admitted later gets it with the membership. Blocks are never freed (the
//! chain is as long as the most owners that ever waited at once).
//!
//! The chain is read whole, block after block (one read per block).

use std::collections::HashMap;

use citron_lock::rdma::{Endpoint, RemoteAddr, Verb};
use serde::{Deserialize, Serialize};

use super::plan::Located;
use super::record::{checksum, decode, pack_addr, unpack_addr, RecordState, SlotView, SLOT_WORDS};
use super::table;
use super::types::{ByteRange, LockFlavor, LockMode, LockOwner, OwnerKey};
use crate::error::FsError;
use crate::types::ClientId;

/// Linux's bound on the chain it follows.
pub const MAX_DEPTH: usize = 10;
pub const ENTRY_BYTES: u64 = 64;
const OCCUPIED: u64 = 1;
const GEN_SHIFT: u32 = 1;
const GEN_MASK: u64 = 0x7fff_ffff;
/// How often a cycle that did not survive its second read is looked for
/// again before the request waits (and checks again at its next retry).
const CONFIRM_TRIES: usize = 4;

/// Who asks whether it closes a cycle (module docs: "Only the requester
/// that closes a cycle is refused").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Checker {
    /// A request about to wait: every published entry counts.
    Requesting,
    /// An owner already registered as a waiter, retrying: only owners whose
    /// waiting record is in their file's table count.
    Waiting,
}

/// Where the table is (from the cluster info).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WaitsFor {
    /// The first block.
    pub base: RemoteAddr,
    /// Entries per block, the link included (at least 2).
    pub capacity: u32,
}

/// The meta-server's side of the chain: appends blocks.
pub trait WaitsForGrowth {
    /// The block after `last`: the one already linked, else a new zeroed
    /// block, granted to every client and then linked; or `last` itself
    /// while it has a free entry (nothing grows but for a full chain).
    /// Idempotent.
    fn grow_waits_for(&self, last: RemoteAddr) -> Result<RemoteAddr, FsError>;
}

/// How many blocks a publisher adds or walks past before it gives up with
/// `ENOLCK` (only a chain that others keep filling as fast as it grows).
const GROW_TRIES: usize = 64;

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
    /// Word 0 as claimed.
    claimed: u64,
}

/// One entry's words as read.
type Words = [u64; SLOT_WORDS];

/// An edge of the chain as the first pass read it: an owner's entry, and
/// the record (of the next owner) that blocks what the entry waits for.
#[derive(Clone, Copy, Debug)]
struct Edge {
    entry: RemoteAddr,
    entry_words: Words,
    holder_slot: RemoteAddr,
    holder: Located,
}

fn generation(word0: u64) -> u64 {
    (word0 >> GEN_SHIFT) & GEN_MASK
}

/// Word 0 of a free entry that keeps `word0`'s generation.
fn freed(word0: u64) -> u64 {
    generation(word0) << GEN_SHIFT
}

fn words_of(bytes: &[u8]) -> Words {
    let mut e = [0u64; SLOT_WORDS];
    for (j, w) in e.iter_mut().enumerate() {
        *w = u64::from_le_bytes(bytes[j * 8..j * 8 + 8].try_into().expect("8 bytes"));
    }
    e
}

impl WaitsFor {
    pub fn new(base: RemoteAddr, capacity: u32) -> Self {
        Self { base, capacity }
    }

    /// Bytes of one block of `capacity` entries.
    pub fn bytes(capacity: u32) -> u64 {
        ENTRY_BYTES * u64::from(capacity)
    }

    /// Entries of a block that hold waits (the last one is the link).
    fn entries_per_block(&self) -> u32 {
        self.capacity.saturating_sub(1)
    }

    /// Word 0 of every entry of `block` that holds waits.
    pub fn entry_heads(&self, block: RemoteAddr) -> impl Iterator<Item = RemoteAddr> {
        (0..u64::from(self.entries_per_block())).map(move |i| block + ENTRY_BYTES * i)
    }

    /// Whether an entry whose word 0 is `word0` is free.
    pub fn is_free(word0: u64) -> bool {
        word0 & OCCUPIED == 0
    }

    /// The link word of `block`.
    pub fn link(&self, block: RemoteAddr) -> RemoteAddr {
        block + ENTRY_BYTES * u64::from(self.entries_per_block())
    }

    fn encode(w: &Waiting, free_word0: u64) -> Words {
        let gen = (generation(free_word0) + 1) & GEN_MASK;
        let mut e = [0u64; SLOT_WORDS];
        e[0] = OCCUPIED | (gen << GEN_SHIFT) | ((w.owner.client.0 & 0xffff_ffff) << 32);
        e[1] = w.owner.owner.0;
        e[2] = pack_addr(w.table).unwrap_or(0);
        e[3] = w.range.start;
        e[4] = w.range.last;
        e[5] = u64::from(w.mode == LockMode::Write);
        e[7] = checksum(&e);
        e
    }

    fn decode(e: &Words) -> Option<Waiting> {
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

    /// Every entry of the chain as read, with its address, and the last
    /// block.
    fn read_chain(&self, ep: &Endpoint) -> Result<(Vec<(RemoteAddr, Words)>, RemoteAddr), FsError> {
        let mut entries = Vec::new();
        let mut block = self.base;
        let mut buf = vec![0u8; Self::bytes(self.capacity) as usize];
        loop {
            ep.read(block, &mut buf)?;
            let mut chunks = buf.chunks_exact(ENTRY_BYTES as usize).enumerate();
            for (i, c) in chunks.by_ref().take(self.entries_per_block() as usize) {
                entries.push((block + ENTRY_BYTES * i as u64, words_of(c)));
            }
            let link = chunks.next().map(|(_, c)| words_of(c)[0]).unwrap_or(0);
            match unpack_addr(link) {
                Some(next) => block = next,
                None => return Ok((entries, block)),
            }
        }
    }

    /// Every entry as read, with its address.
    fn read_all(&self, ep: &Endpoint) -> Result<Vec<(RemoteAddr, Words)>, FsError> {
        Ok(self.read_chain(ep)?.0)
    }

    /// Blocks in the chain now.
    pub fn blocks(&self, ep: &Endpoint) -> Result<usize, FsError> {
        let mut n = 1;
        let mut block = self.base;
        while let Some(next) = unpack_addr(ep.read_u64(self.link(block))?) {
            block = next;
            n += 1;
        }
        Ok(n)
    }

    /// Every published wait, for diagnostics.
    pub fn list(&self, ep: &Endpoint) -> Result<Vec<Waiting>, FsError> {
        Ok(self.read_all(ep)?.iter().filter_map(|(_, e)| Self::decode(e)).collect())
    }

    /// Publishes `w`, growing the chain through `grow` when it is full.
    /// `ENOLCK` only when no block can be added (lock memory is full).
    pub fn publish(
        &self,
        ep: &Endpoint,
        w: &Waiting,
        grow: &dyn WaitsForGrowth,
    ) -> Result<Published, FsError> {
        self.publish_with(ep, w, grow, || {})
    }

    /// As [`WaitsFor::publish`], running `between` after the entry is
    /// claimed and before its body is written (a test hook: a publisher
    /// that stalls there).
    #[doc(hidden)]
    pub fn publish_with(
        &self,
        ep: &Endpoint,
        w: &Waiting,
        grow: &dyn WaitsForGrowth,
        between: impl FnOnce(),
    ) -> Result<Published, FsError> {
        let mut between = Some(between);
        for attempt in 0..GROW_TRIES {
            let (entries, last) = self.read_chain(ep)?;
            for (addr, e) in entries {
                if e[0] & OCCUPIED != 0 {
                    continue;
                }
                let words = Self::encode(w, e[0]);
                // Claim with a CAS of word 0 (it names the owner and a new
                // generation), then write the rest: until the body lands the
                // checksum does not match (the old body was summed with an
                // older generation) and readers skip the entry, and the
                // publisher reads nobody's entry before its own is whole.
                if ep.cas(addr, e[0], words[0])? != e[0] {
                    continue;
                }
                if let Some(f) = between.take() {
                    f();
                }
                let body: Vec<u8> = words[1..].iter().flat_map(|x| x.to_le_bytes()).collect();
                table::execute(ep, &[Verb::Write { addr: addr + 8, data: body }])?;
                return Ok(Published { addr, claimed: words[0] });
            }
            // Every entry seen was taken: one more block (or the one that
            // another publisher added meanwhile), then look again.
            log::debug!("waits-for chain full at {} entries (attempt {attempt})", self.entries_per_block());
            grow.grow_waits_for(last)?;
        }
        Err(FsError::NoLocks)
    }

    /// Withdraws an entry: clears "occupied", keeps the generation.
    pub fn withdraw(&self, ep: &Endpoint, p: Published) -> Result<(), FsError> {
        ep.write_u64(p.addr, freed(p.claimed))?;
        Ok(())
    }

    /// Withdraws every entry of `client` (a client that died: the
    /// meta-server's cleanup).
    pub fn withdraw_client(&self, ep: &Endpoint, client: ClientId) -> Result<usize, FsError> {
        let mut n = 0;
        for (addr, e) in self.read_all(ep)? {
            if Self::decode(&e).is_some_and(|w| w.owner.client == client) {
                ep.cas(addr, e[0], freed(e[0]))?;
                n += 1;
            }
        }
        Ok(n)
    }

    /// Whether `me`, blocked by `blockers`, would close a cycle of waiting
    /// POSIX owners that existed at one moment (see the module comment).
    /// `me`'s own entry must already be published, and the records of
    /// `blockers` that block it must be held still (by the caller's range
    /// lock).
    pub fn closes_cycle(
        &self,
        ep: &Endpoint,
        me: OwnerKey,
        blockers: &[OwnerKey],
        checker: Checker,
    ) -> Result<bool, FsError> {
        for attempt in 0..CONFIRM_TRIES {
            let Some(path) = self.find_cycle(ep, me, blockers, checker)? else { return Ok(false) };
            if self.unchanged(ep, &path)? {
                return Ok(true);
            }
            log::debug!("a wait-for cycle of {me:?} changed before it was confirmed (attempt {attempt})");
        }
        Ok(false)
    }

    /// The first pass: a chain from one of `blockers` back to `me`, as read
    /// one entry and table after another.
    fn find_cycle(
        &self,
        ep: &Endpoint,
        me: OwnerKey,
        blockers: &[OwnerKey],
        checker: Checker,
    ) -> Result<Option<Vec<Edge>>, FsError> {
        // How each owner reached was reached: from which owner, by which
        // edge (`None` for the blockers themselves).
        let mut reached: HashMap<OwnerKey, Option<(OwnerKey, Edge)>> = HashMap::new();
        let mut frontier: Vec<OwnerKey> = Vec::new();
        for &b in blockers {
            if b == me {
                // Cannot happen (an owner never blocks itself); no edge to
                // confirm, so no cycle claimed.
                continue;
            }
            if reached.insert(b, None).is_none() {
                frontier.push(b);
            }
        }
        let path_to =
            |reached: &HashMap<OwnerKey, Option<(OwnerKey, Edge)>>, mut at: OwnerKey, last: Edge| {
                let mut path = vec![last];
                while let Some(Some((from, edge))) = reached.get(&at) {
                    path.push(*edge);
                    at = *from;
                }
                path
            };
        for _ in 0..MAX_DEPTH {
            if frontier.is_empty() {
                return Ok(None);
            }
            let entries: Vec<(RemoteAddr, Words, Waiting)> = self
                .read_all(ep)?
                .into_iter()
                .filter_map(|(addr, e)| Self::decode(&e).map(|w| (addr, e, w)))
                .collect();
            let mut next = Vec::new();
            for b in frontier.drain(..) {
                for (entry, entry_words, w) in entries.iter().filter(|(_, _, w)| w.owner == b) {
                    // Who holds what `b` waits for: that file's table, read
                    // without a range lock (torn records are skipped; the
                    // second pass confirms what is used).
                    let snapshot = table::read(ep, w.table)?;
                    let records = snapshot.records();
                    if checker == Checker::Waiting && !records.iter().any(|l| is_waiting_record_of(l, w)) {
                        // `b` is a requester still in its own check.
                        continue;
                    }
                    for l in records {
                        if l.record.flavor != LockFlavor::Posix
                            || !l.record.blocks(b, LockFlavor::Posix, w.mode, w.range)
                        {
                            continue;
                        }
                        let edge = Edge {
                            entry: *entry,
                            entry_words: *entry_words,
                            holder_slot: snapshot.slot_addr(l.slot)?,
                            holder: l,
                        };
                        let holder = l.record.owner;
                        if holder == me {
                            return Ok(Some(path_to(&reached, b, edge)));
                        }
                        if let std::collections::hash_map::Entry::Vacant(v) = reached.entry(holder) {
                            v.insert(Some((b, edge)));
                            next.push(holder);
                        }
                    }
                }
            }
            frontier = next;
        }
        Ok(None)
    }

    /// The second pass: whether every entry and holder record of `path`
    /// reads now exactly as the first pass read it.
    fn unchanged(&self, ep: &Endpoint, path: &[Edge]) -> Result<bool, FsError> {
        let mut buf = [0u8; ENTRY_BYTES as usize];
        for edge in path {
            ep.read(edge.entry, &mut buf)?;
            if words_of(&buf) != edge.entry_words {
                return Ok(false);
            }
            ep.read(edge.holder_slot, &mut buf)?;
            match decode(&words_of(&buf)) {
                SlotView::Record(record, gen) if record == edge.holder.record && gen == edge.holder.gen => {}
                _ => return Ok(false),
            }
        }
        Ok(true)
    }
}

/// Whether `l` is the waiting record that the owner of entry `w` registers
/// once its own check is done.
fn is_waiting_record_of(l: &Located, w: &Waiting) -> bool {
    l.record.state == RecordState::Waiting
        && l.record.owner == w.owner
        && l.record.range == w.range
        && l.record.mode == w.mode
}
