//! The lock-record table's memory format (DESIGN.md §4, "Lock-record table
//! rules"): fixed-size slots in lock-server memory that clients claim,
//! write, read and free with one-sided verbs only.
//!
//! # A table block
//!
//! A file's table is a chain of blocks; the first is found through the
//! file's lock area, each names the next. A block is a 64-byte header and
//! [`SLOTS_PER_BLOCK`] slots of [`SLOT_BYTES`]:
//!
//! | offset | word | meaning |
//! |---|---|---|
//! | 0 | magic + capacity | [`BLOCK_MAGIC`] in the high 32 bits, slots in the low 32 |
//! | 8 | next block | a packed [`RemoteAddr`] ([`pack_addr`]); 0 = last block |
//! | 16 | token holder | first block only: the client holding the file's lock token ([`super::token`]); 0 = none |
//! | 24 | token mailbox | first block only: where the holder hears revocations (node / mailbox id) |
//! | 32 | token asked | first block only: nonzero once another client asked for the token |
//! | 40..64 | reserved | zero |
//!
//! # A slot
//!
//! | word | bits | field |
//! |---|---|---|
//! | 0 | 0..2 | state: [`FREE`], [`CLAIMED`], [`HELD`], [`WAITING`] |
//! | 0 | 2 | mode: 1 = write ([`MODE_WRITE`]) |
//! | 0 | 3..5 | flavour: 0 POSIX, 1 OFD, 2 flock |
//! | 0 | 5 | a waiter's mailbox is in word 6 ([`HAS_MAILBOX`]) |
//! | 0 | 8..32 | while `CLAIMED`: the claiming client's id (low 24 bits), so the slots a dead client claimed can be freed |
//! | 0 | 32..64 | generation: +1 at every claim and every rewrite |
//! | 1 | 0..64 | lock owner (the kernel's `lock_owner`) |
//! | 2 | 0..32 / 32..64 | client id / pid of the locking process on its node |
//! | 3 | 0..64 | first byte |
//! | 4 | 0..64 | last byte (inclusive; `OFFSET_MAX` = to end of file) |
//! | 5 | 0..64 | the file handle the lock was taken through (flock and OFD release) |
//! | 6 | 0..32 / 32..64 | a waiter's mailbox: node / mailbox id ([`HAS_MAILBOX`]); a held lock's [`ListSeq`] |
//! | 7 | 0..64 | checksum of words 0..7 |
//!
//! # Why a checksum
//!
//! A record is changed only under a range lock covering the whole record,
//! old and new extent (the table rules), so a reader holding a range lock
//! that overlaps a record can never see it change. A record that changes
//! while a reader reads the table therefore does not overlap the reader's
//! range, and the reader may ignore it — if it can tell that it is torn.
//! RDMA reads are not atomic beyond 8 bytes, so every record carries a
//! checksum of its words, and a slot whose checksum does not match is
//! treated as not there. The generation changes with every write of a slot,
//! so a mix of two versions cannot match by having equal fields.

use citron_lock::rdma::{ClientAddr, MailboxId, NodeId, RegionId, RemoteAddr};

use super::types::{ByteRange, LockFlavor, LockMode, LockOwner, OwnerKey};
use crate::types::ClientId;

pub const SLOT_BYTES: u64 = 64;
pub const SLOT_WORDS: usize = 8;
pub const BLOCK_HEADER_BYTES: u64 = 64;
/// 31 slots and the header make a block of exactly 2 KiB, which the
/// meta-server's power-of-two lock-memory allocator holds without waste.
pub const SLOTS_PER_BLOCK: u32 = 31;
/// Bytes of one table block.
pub const BLOCK_BYTES: u64 = BLOCK_HEADER_BYTES + SLOT_BYTES * SLOTS_PER_BLOCK as u64;
/// "CLKT" in the header's high half: a block is recognisable in a dump.
pub const BLOCK_MAGIC: u32 = 0x434c_4b54;

/// Offset, in a table's first block, of the lock token's holder
/// ([`super::token`]).
pub const TOKEN_HOLDER_OFFSET: u64 = 16;
/// Offset, in a table's first block, of the token holder's mailbox.
pub const TOKEN_MAILBOX_OFFSET: u64 = 24;
/// Offset, in a table's first block, of the word a client that asks for
/// the token sets (for a holder its message cannot reach).
pub const TOKEN_ASKED_OFFSET: u64 = 32;

pub const STATE_MASK: u64 = 0b11;
pub const FREE: u64 = 0;
/// Taken by a writer that has not finished writing it: readers skip it.
pub const CLAIMED: u64 = 1;
pub const HELD: u64 = 2;
pub const WAITING: u64 = 3;
pub const MODE_WRITE: u64 = 1 << 2;
const FLAVOUR_SHIFT: u32 = 3;
const FLAVOUR_MASK: u64 = 0b11 << FLAVOUR_SHIFT;
pub const HAS_MAILBOX: u64 = 1 << 5;
const GEN_SHIFT: u32 = 32;

/// The 32-bit generation in a slot's header word.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Generation(pub u32);

impl Generation {
    pub fn next(self) -> Generation {
        Generation(self.0.wrapping_add(1))
    }
}

/// A header word of a free slot of generation `gen`.
pub fn free_header(gen: Generation) -> u64 {
    FREE | (u64::from(gen.0) << GEN_SHIFT)
}

const CLAIMER_SHIFT: u32 = 8;
const CLAIMER_MASK: u64 = 0xff_ffff;

/// A header word of a slot claimed at generation `gen` by `client`.
pub fn claimed_header(gen: Generation, client: ClientId) -> u64 {
    CLAIMED | ((client.0 & CLAIMER_MASK) << CLAIMER_SHIFT) | (u64::from(gen.0) << GEN_SHIFT)
}

/// Whether a `CLAIMED` header was claimed by `client`.
pub fn claimed_by(header: u64, client: ClientId) -> bool {
    header_state(header) == CLAIMED && (header >> CLAIMER_SHIFT) & CLAIMER_MASK == client.0 & CLAIMER_MASK
}

pub fn header_generation(header: u64) -> Generation {
    Generation((header >> GEN_SHIFT) as u32)
}

pub fn header_state(header: u64) -> u64 {
    header & STATE_MASK
}

/// Where the owner of a held lock stands in the file's lock list, which
/// decides the lock `F_GETLK` reports ([`super::plan::first_conflict`]).
///
/// Linux keeps an inode's POSIX and OFD locks in one list grouped by owner:
/// an owner's group goes to the end of the list when it takes a lock while
/// holding none there, and stays where it is for as long as the owner
/// holds any; within the group, locks are in start order. `F_GETLK`
/// reports the first conflicting lock in the list. A record carries its
/// owner's place as a number: every record of one owner the same, a new
/// owner one more than any in the table.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ListSeq(pub u64);

/// Whether a lock record holds the range or waits for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RecordState {
    Held,
    /// A blocked `F_SETLKW` / `LOCK_EX` waiting to be woken at `mailbox`.
    Waiting,
}

/// A lock (or a wait for one) as a slot records it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LockRecord {
    pub state: RecordState,
    pub mode: LockMode,
    pub flavor: LockFlavor,
    pub owner: OwnerKey,
    pub range: ByteRange,
    pub pid: u32,
    pub fh: u64,
    /// Where to wake a waiter.
    pub mailbox: Option<ClientAddr>,
    /// A held lock's owner's place in the file's lock list (0 for a
    /// waiting record: its word holds the mailbox).
    pub listed: ListSeq,
}

impl LockRecord {
    /// Whether this held record blocks `mode` on `range` for `owner` of
    /// `flavor`: another owner, the same domain, overlapping, not both read.
    pub fn blocks(&self, owner: OwnerKey, flavor: LockFlavor, mode: LockMode, range: ByteRange) -> bool {
        self.state == RecordState::Held
            && self.owner != owner
            && self.flavor.same_domain(flavor)
            && self.range.overlaps(range)
            && !self.mode.compatible(mode)
    }

    /// Whether this is one of `owner`'s held locks in `flavor`'s domain
    /// (the records its requests merge with and split).
    pub fn is_own(&self, owner: OwnerKey, flavor: LockFlavor) -> bool {
        self.state == RecordState::Held && self.owner == owner && self.flavor.same_domain(flavor)
    }
}

fn flavor_bits(f: LockFlavor) -> u64 {
    (match f {
        LockFlavor::Posix => 0,
        LockFlavor::Ofd => 1,
        LockFlavor::Flock => 2,
    }) << FLAVOUR_SHIFT
}

/// The checksum of a slot's first seven words (word 7 holds it).
pub fn checksum(words: &[u64]) -> u64 {
    // FNV-1a over the words, finished with a 64-bit avalanche (splitmix64's
    // finaliser) so a change in any bit flips about half the result.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for w in &words[..SLOT_WORDS - 1] {
        h ^= *w;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h ^= h >> 30;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

/// A slot's words for `record` at generation `gen`.
pub fn encode(record: &LockRecord, gen: Generation) -> [u64; SLOT_WORDS] {
    let state = match record.state {
        RecordState::Held => HELD,
        RecordState::Waiting => WAITING,
    };
    let mode = if record.mode == LockMode::Write { MODE_WRITE } else { 0 };
    let mailbox = if record.mailbox.is_some() { HAS_MAILBOX } else { 0 };
    let mut w = [0u64; SLOT_WORDS];
    w[0] = state | mode | flavor_bits(record.flavor) | mailbox | (u64::from(gen.0) << GEN_SHIFT);
    w[1] = record.owner.owner.0;
    w[2] = (record.owner.client.0 & 0xffff_ffff) | (u64::from(record.pid) << 32);
    w[3] = record.range.start;
    w[4] = record.range.last;
    w[5] = record.fh;
    w[6] = match record.mailbox {
        Some(m) => u64::from(m.node.0) | (u64::from(m.mailbox.0) << 32),
        None => record.listed.0,
    };
    w[7] = checksum(&w);
    w
}

/// What a slot holds, as far as a reader can trust it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotView {
    Free(Generation),
    /// Claimed, being written, or torn by a concurrent writer: skip it.
    Busy,
    Record(LockRecord, Generation),
}

/// Decodes a slot read from the table.
pub fn decode(w: &[u64; SLOT_WORDS]) -> SlotView {
    let gen = header_generation(w[0]);
    let state = match header_state(w[0]) {
        FREE => return SlotView::Free(gen),
        CLAIMED => return SlotView::Busy,
        HELD => RecordState::Held,
        _ => RecordState::Waiting,
    };
    if checksum(w) != w[7] {
        return SlotView::Busy;
    }
    let flavor = match (w[0] & FLAVOUR_MASK) >> FLAVOUR_SHIFT {
        0 => LockFlavor::Posix,
        1 => LockFlavor::Ofd,
        2 => LockFlavor::Flock,
        _ => return SlotView::Busy,
    };
    let Some(range) = ByteRange::new(w[3], w[4]) else { return SlotView::Busy };
    let record = LockRecord {
        state,
        mode: if w[0] & MODE_WRITE != 0 { LockMode::Write } else { LockMode::Read },
        flavor,
        owner: OwnerKey { client: ClientId(w[2] & 0xffff_ffff), owner: LockOwner(w[1]) },
        range,
        pid: (w[2] >> 32) as u32,
        fh: w[5],
        mailbox: (w[0] & HAS_MAILBOX != 0)
            .then(|| ClientAddr { node: NodeId(w[6] as u32), mailbox: MailboxId((w[6] >> 32) as u32) }),
        listed: ListSeq(if w[0] & HAS_MAILBOX != 0 { 0 } else { w[6] }),
    };
    SlotView::Record(record, gen)
}

/// Packs an address into one word: region in the top 16 bits, offset in the
/// low 48. `None` if it does not fit (the lock region is far smaller).
pub fn pack_addr(addr: RemoteAddr) -> Option<u64> {
    (addr.region.0 < 1 << 16 && addr.offset < 1 << 48).then(|| (u64::from(addr.region.0) << 48) | addr.offset)
}

/// The address a word packed by [`pack_addr`] names; `None` for 0.
pub fn unpack_addr(word: u64) -> Option<RemoteAddr> {
    (word != 0).then(|| RemoteAddr::new(RegionId((word >> 48) as u32), word & ((1 << 48) - 1)))
}

/// A block header word 0 for a block of `capacity` slots.
pub fn block_header(capacity: u32) -> u64 {
    (u64::from(BLOCK_MAGIC) << 32) | u64::from(capacity)
}

/// The slot capacity a block header names; `None` if it is not a block.
pub fn block_capacity(header: u64) -> Option<u32> {
    ((header >> 32) as u32 == BLOCK_MAGIC).then_some(header as u32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::locks::types::OFFSET_MAX;
    use proptest::prelude::*;

    fn record() -> LockRecord {
        LockRecord {
            state: RecordState::Waiting,
            mode: LockMode::Write,
            flavor: LockFlavor::Ofd,
            owner: OwnerKey { client: ClientId(7), owner: LockOwner(0xdead_beef_0123_4567) },
            range: ByteRange::to_eof(4096),
            pid: 4242,
            fh: 99,
            mailbox: Some(ClientAddr { node: NodeId(3), mailbox: MailboxId(17) }),
            listed: ListSeq(0),
        }
    }

    #[test]
    fn a_record_survives_encoding() {
        let r = record();
        assert_eq!(decode(&encode(&r, Generation(5))), SlotView::Record(r, Generation(5)));
        let held = LockRecord {
            state: RecordState::Held,
            mailbox: None,
            mode: LockMode::Read,
            listed: ListSeq(77),
            ..r
        };
        assert_eq!(
            decode(&encode(&held, Generation(u32::MAX))),
            SlotView::Record(held, Generation(u32::MAX))
        );
        assert_eq!(record().range.last, OFFSET_MAX);
    }

    #[test]
    fn free_and_claimed_slots_are_not_records() {
        let mut w = [0u64; SLOT_WORDS];
        assert_eq!(decode(&w), SlotView::Free(Generation(0)));
        w[0] = free_header(Generation(9));
        assert_eq!(decode(&w), SlotView::Free(Generation(9)));
        w[0] = claimed_header(Generation(10), ClientId(5));
        assert_eq!(decode(&w), SlotView::Busy);
        assert!(claimed_by(w[0], ClientId(5)));
        assert!(!claimed_by(w[0], ClientId(6)));
        assert_eq!(header_generation(w[0]), Generation(10));
    }

    #[test]
    fn addresses_pack_into_a_word() {
        let a = RemoteAddr::new(RegionId(2), 0x1234_5678);
        assert_eq!(unpack_addr(pack_addr(a).unwrap()), Some(a));
        assert_eq!(unpack_addr(0), None);
        assert_eq!(pack_addr(RemoteAddr::new(RegionId(1 << 16), 0)), None);
        assert_eq!(pack_addr(RemoteAddr::new(RegionId(1), 1 << 48)), None);
        assert_eq!(block_capacity(block_header(32)), Some(32));
        assert_eq!(block_capacity(0), None);
    }

    proptest! {
        /// A slot read half from one version and half from another (a torn
        /// read) is never taken for a record, however the words mix.
        #[test]
        fn torn_slots_are_detected(mask in 1u8..255, owner in any::<u64>(), start in 0u64..1 << 40, len in 1u64..1 << 20) {
            let old = encode(&record(), Generation(41));
            let new_record = LockRecord {
                state: RecordState::Held,
                mode: LockMode::Read,
                owner: OwnerKey { client: ClientId(8), owner: LockOwner(owner) },
                range: ByteRange::new(start, start + len - 1).unwrap(),
                mailbox: None,
                listed: ListSeq(owner % 1000),
                ..record()
            };
            let new = encode(&new_record, Generation(42));
            let mut mixed = [0u64; SLOT_WORDS];
            for i in 0..SLOT_WORDS {
                mixed[i] = if mask & (1 << i) != 0 { new[i] } else { old[i] };
            }
            let whole = mixed == old || mixed == new;
            match decode(&mixed) {
                SlotView::Record(r, _) => prop_assert!(whole, "torn slot accepted as {r:?}"),
                SlotView::Busy => prop_assert!(!whole),
                SlotView::Free(_) => prop_assert!(false, "a written slot decoded as free"),
            }
        }
    }
}
