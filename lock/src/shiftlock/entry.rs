//! The 16-byte ShiftLock entry (shiftlock-fast25.md §3.7, Fig. 3) and the
//! operands of every extended atomic the protocol applies to it.
//!
//! The entry is one aligned `u128` in host memory, little-endian, so bits
//! 0..63 are the 8-byte word at the entry's address and bits 64..127 the word
//! after it:
//!
//! | bits | field | meaning |
//! |---|---|---|
//! | 0 | `Epoch` | flipped by the queue-head writer to admit waiting readers (§3.5.2) |
//! | 1..=23 | `RdrCnt` | readers that hold or wait for the lock (§3.4) |
//! | 24..=39 | `TailPtr.NodeId` | node of the queue's tail writer; 0 only in the null pointer |
//! | 40..=63 | `TailPtr.QueueId` | that writer's mailbox (the paper's DCT QP number, §3.2) |
//! | 64..=127 | `RelCnt` | releases so far; leaps by 2^63 at each recovery (§3.6) |
//!
//! The paper's `TailPtr` is (16-bit node id, 24-bit DCT QP number). Here a
//! writer is reached at its endpoint's [`ClientAddr`] = ([`NodeId`],
//! [`MailboxId`]), which are 32-bit ids: [`TailPtr::from_client`] checks that
//! the node id is in 1..=0xFFFF and the mailbox id in 0..=0xFF_FFFF and
//! refuses anything else ([`TailPtrError`]) instead of truncating it. Node
//! ids start at 1 on both backends, so the null pointer (all 40 bits zero,
//! Alg. 2 line 3) is never a real endpoint.
//!
//! Every field's top bit is an extended-FAA boundary ([`BOUNDARIES`]), so a
//! carry or borrow never leaks into a neighbour: decrementing `RdrCnt` cannot
//! touch `TailPtr`, incrementing `RelCnt` by 2^63 wraps inside `RelCnt`, and
//! adding 1 to the 1-bit `Epoch` flips it.

use crate::rdma::arith::{masked_cas_u128, masked_faa_u128};
use crate::rdma::{ClientAddr, MailboxId, NodeId};

/// Bytes of one entry.
pub const ENTRY_BYTES: u64 = 16;
/// Alignment the extended atomics require.
pub const ENTRY_ALIGN: u64 = 16;

pub const EPOCH_SHIFT: u32 = 0;
pub const EPOCH_BITS: u32 = 1;
pub const RDR_CNT_SHIFT: u32 = 1;
pub const RDR_CNT_BITS: u32 = 23;
pub const NODE_ID_SHIFT: u32 = 24;
pub const NODE_ID_BITS: u32 = 16;
pub const QUEUE_ID_SHIFT: u32 = 40;
pub const QUEUE_ID_BITS: u32 = 24;
pub const REL_CNT_SHIFT: u32 = 64;
pub const REL_CNT_BITS: u32 = 64;

/// The bits of a field of `bits` width starting at `shift`.
const fn field_mask(shift: u32, bits: u32) -> u128 {
    ((1u128 << bits) - 1) << shift
}

/// `delta` (possibly negative) as an extended-FAA operand of one field: its
/// field-wide two's complement, shifted into place.
const fn field_delta(shift: u32, bits: u32, delta: i128) -> u128 {
    ((delta as u128) & ((1u128 << bits) - 1)) << shift
}

pub const EPOCH_MASK: u128 = field_mask(EPOCH_SHIFT, EPOCH_BITS);
pub const RDR_CNT_MASK: u128 = field_mask(RDR_CNT_SHIFT, RDR_CNT_BITS);
pub const NODE_ID_MASK: u128 = field_mask(NODE_ID_SHIFT, NODE_ID_BITS);
pub const QUEUE_ID_MASK: u128 = field_mask(QUEUE_ID_SHIFT, QUEUE_ID_BITS);
pub const TAIL_PTR_MASK: u128 = NODE_ID_MASK | QUEUE_ID_MASK;
pub const REL_CNT_MASK: u128 = field_mask(REL_CNT_SHIFT, REL_CNT_BITS);
/// The first four fields: the 8-byte word at the entry's address.
pub const LOW_WORD_MASK: u128 = EPOCH_MASK | RDR_CNT_MASK | TAIL_PTR_MASK;

/// Extended-FAA boundary mask: the top bit of each of the five fields.
pub const BOUNDARIES: u128 = (1 << (EPOCH_SHIFT + EPOCH_BITS - 1))
    | (1 << (RDR_CNT_SHIFT + RDR_CNT_BITS - 1))
    | (1 << (NODE_ID_SHIFT + NODE_ID_BITS - 1))
    | (1 << (QUEUE_ID_SHIFT + QUEUE_ID_BITS - 1))
    | (1 << (REL_CNT_SHIFT + REL_CNT_BITS - 1));

/// Largest node id a `TailPtr` holds.
pub const MAX_NODE_ID: u32 = (1 << NODE_ID_BITS) - 1;
/// Largest mailbox id a `TailPtr` holds.
pub const MAX_QUEUE_ID: u32 = (1 << QUEUE_ID_BITS) - 1;
/// Most readers `RdrCnt` counts at once (8 million, §3.4).
pub const MAX_READERS: u32 = (1 << RDR_CNT_BITS) - 1;

/// What a recovery adds to `RelCnt` (§3.6): a leap that normal releases would
/// take centuries to make.
pub const RECOVERY_LEAP: u64 = 1 << 63;
/// A `RelCnt` difference of at least this much is a recovery leap, not
/// releases: normal progress between two observations stays far below it.
pub const LEAP_THRESHOLD: u64 = 1 << 62;

/// Alg. 2 line 2: `RdrCnt + 1`.
pub const READER_ENTER: u128 = field_delta(RDR_CNT_SHIFT, RDR_CNT_BITS, 1);
/// Alg. 3 line 2: `RdrCnt - 1, RelCnt + 1`.
pub const READER_LEAVE: u128 =
    field_delta(RDR_CNT_SHIFT, RDR_CNT_BITS, -1) | field_delta(REL_CNT_SHIFT, REL_CNT_BITS, 1);

/// Why an endpoint cannot be a `TailPtr`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TailPtrError {
    #[error("node id {0:?} does not fit the 16-bit TailPtr.NodeId (1..=65535)")]
    Node(NodeId),
    #[error("mailbox id {0:?} does not fit the 24-bit TailPtr.QueueId (0..=16777215)")]
    Mailbox(MailboxId),
}

/// The queue's tail writer (Alg. 2 line 9): a node id and a mailbox id in 40
/// bits, or null.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct TailPtr(u64);

impl std::fmt::Debug for TailPtr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.client() {
            Some(c) => write!(f, "TailPtr({c})"),
            None => f.write_str("TailPtr(null)"),
        }
    }
}

impl TailPtr {
    pub const NULL: TailPtr = TailPtr(0);

    /// The pointer to the endpoint at `addr`, if its ids fit the fields.
    pub fn from_client(addr: ClientAddr) -> Result<TailPtr, TailPtrError> {
        if addr.node.0 == 0 || addr.node.0 > MAX_NODE_ID {
            return Err(TailPtrError::Node(addr.node));
        }
        if addr.mailbox.0 > MAX_QUEUE_ID {
            return Err(TailPtrError::Mailbox(addr.mailbox));
        }
        Ok(TailPtr(u64::from(addr.node.0) | u64::from(addr.mailbox.0) << NODE_ID_BITS))
    }

    pub fn is_null(self) -> bool {
        self.0 == 0
    }

    /// The endpoint pointed at; `None` for null.
    pub fn client(self) -> Option<ClientAddr> {
        if self.is_null() {
            return None;
        }
        let node = (self.0 & u64::from(MAX_NODE_ID)) as u32;
        let mailbox = (self.0 >> NODE_ID_BITS) as u32 & MAX_QUEUE_ID;
        Some(ClientAddr { node: NodeId(node), mailbox: MailboxId(mailbox) })
    }

    /// The pointer in place in an entry.
    pub const fn bits(self) -> u128 {
        (self.0 as u128) << NODE_ID_SHIFT
    }
}

/// A value of the `RelCnt` field (§3.4).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct RelCnt(pub u64);

impl RelCnt {
    /// `self + n`, wrapping as the field does.
    pub fn plus(self, n: u64) -> RelCnt {
        RelCnt(self.0.wrapping_add(n))
    }

    /// Whether `self` lies in the same era as the `earlier` value and not
    /// before it: the difference is small and non-negative. A value from
    /// across a recovery (§3.6) is ~2^63 away in either direction.
    pub fn same_era_since(self, earlier: RelCnt) -> bool {
        self.0.wrapping_sub(earlier.0) < LEAP_THRESHOLD
    }

    /// Whether a recovery happened between observing `earlier` and `self`.
    pub fn leaped_from(self, earlier: RelCnt) -> bool {
        !self.same_era_since(earlier)
    }

    /// The field in place in an entry.
    pub const fn bits(self) -> u128 {
        (self.0 as u128) << REL_CNT_SHIFT
    }
}

/// The 1-bit `Epoch` (§3.5.2).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Epoch(pub bool);

impl Epoch {
    /// `1 - epoch` (Alg. 2 line 20, Alg. 3 line 9).
    pub fn flipped(self) -> Epoch {
        Epoch(!self.0)
    }

    pub const fn bits(self) -> u128 {
        (self.0 as u128) << EPOCH_SHIFT
    }
}

/// A decoded entry.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Entry(pub u128);

impl std::fmt::Debug for Entry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Entry")
            .field("epoch", &u8::from(self.epoch().0))
            .field("rdr_cnt", &self.rdr_cnt())
            .field("tail", &self.tail())
            .field("rel_cnt", &self.rel_cnt().0)
            .finish()
    }
}

impl Entry {
    pub fn new(epoch: Epoch, rdr_cnt: u32, tail: TailPtr, rel_cnt: RelCnt) -> Entry {
        debug_assert!(rdr_cnt <= MAX_READERS);
        Entry(epoch.bits() | (u128::from(rdr_cnt) << RDR_CNT_SHIFT) | tail.bits() | rel_cnt.bits())
    }

    pub fn from_le_bytes(bytes: [u8; 16]) -> Entry {
        Entry(u128::from_le_bytes(bytes))
    }

    pub fn epoch(self) -> Epoch {
        Epoch(self.0 & EPOCH_MASK != 0)
    }

    pub fn rdr_cnt(self) -> u32 {
        ((self.0 & RDR_CNT_MASK) >> RDR_CNT_SHIFT) as u32
    }

    pub fn tail(self) -> TailPtr {
        TailPtr(((self.0 & TAIL_PTR_MASK) >> NODE_ID_SHIFT) as u64)
    }

    pub fn rel_cnt(self) -> RelCnt {
        RelCnt((self.0 >> REL_CNT_SHIFT) as u64)
    }

    /// What the recovery service writes (§3.6): every field zero except
    /// `RelCnt`, which leaps by 2^63.
    pub fn recovered(self) -> Entry {
        Entry(self.rel_cnt().plus(RECOVERY_LEAP).bits())
    }
}

/// Operands of one extended CAS ([`crate::rdma::Endpoint::ext_cas`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExtCas {
    pub cmp: u128,
    pub cmp_mask: u128,
    pub swap: u128,
    pub swap_mask: u128,
}

impl ExtCas {
    /// Alg. 2 lines 7–10: a FETCHANDSTORE of `TailPtr ← me` (compare mask ∅, §3.3).
    pub fn enqueue(me: TailPtr) -> ExtCas {
        ExtCas { cmp: 0, cmp_mask: 0, swap: me.bits(), swap_mask: TAIL_PTR_MASK }
    }

    /// Alg. 3 lines 6–10: if `TailPtr = me`, set `TailPtr ← null`,
    /// `RelCnt ← cur + 1`, `Epoch ← 1 - epoch`. We also compare `RelCnt =
    /// cur`: a holder's `cur` always equals `RelCnt`, except after a recovery
    /// took the lock from under it (then the CAS must fail, see the module
    /// comment of [`super`]).
    pub fn release_last(me: TailPtr, cur: RelCnt, epoch: Epoch) -> ExtCas {
        ExtCas {
            cmp: me.bits() | cur.bits(),
            cmp_mask: TAIL_PTR_MASK | REL_CNT_MASK,
            swap: TailPtr::NULL.bits() | cur.plus(1).bits() | epoch.flipped().bits(),
            swap_mask: TAIL_PTR_MASK | REL_CNT_MASK | EPOCH_MASK,
        }
    }

    /// Alg. 3 line 20 (`RelCnt + 1` before a Handover), as a CAS on
    /// `RelCnt = cur` so a recovered-against holder changes nothing.
    pub fn hand_over(cur: RelCnt) -> ExtCas {
        ExtCas { cmp: cur.bits(), cmp_mask: REL_CNT_MASK, swap: cur.plus(1).bits(), swap_mask: REL_CNT_MASK }
    }

    /// Alg. 3 line 16 (`Epoch + 1, RelCnt + 1` before a ModeChanged), as a
    /// CAS on `RelCnt = cur`; the old value it returns carries `RdrCnt`
    /// (line 17) as the FAA's would.
    pub fn change_mode(cur: RelCnt, epoch: Epoch) -> ExtCas {
        ExtCas {
            cmp: cur.bits(),
            cmp_mask: REL_CNT_MASK,
            swap: cur.plus(1).bits() | epoch.flipped().bits(),
            swap_mask: REL_CNT_MASK | EPOCH_MASK,
        }
    }

    /// A reader's release after its lease ran out (Alg. 3 line 2 made
    /// conditional): `RdrCnt - 1, RelCnt + 1` only if both still hold the
    /// values seen in `seen`.
    pub fn reader_leave_if(seen: Entry) -> ExtCas {
        let after = masked_faa_u128(seen.0, READER_LEAVE, BOUNDARIES);
        ExtCas {
            cmp: seen.0,
            cmp_mask: RDR_CNT_MASK | REL_CNT_MASK,
            swap: after,
            swap_mask: RDR_CNT_MASK | REL_CNT_MASK,
        }
    }

    /// §3.6: the recovery service's reset of an entry last seen as `seen`.
    pub fn recover(seen: Entry) -> ExtCas {
        ExtCas { cmp: seen.0, cmp_mask: u128::MAX, swap: seen.recovered().0, swap_mask: u128::MAX }
    }

    /// The entry this CAS leaves behind when applied to `old` (the verbs
    /// layer's semantics), or `None` if the compare fails.
    pub fn apply(self, old: Entry) -> Option<Entry> {
        masked_cas_u128(old.0, self.cmp, self.cmp_mask, self.swap, self.swap_mask).map(Entry)
    }
}

/// The entry an extended FAA of `add` (with [`BOUNDARIES`]) leaves behind.
pub fn apply_faa(old: Entry, add: u128) -> Entry {
    Entry(masked_faa_u128(old.0, add, BOUNDARIES))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn me() -> TailPtr {
        TailPtr::from_client(ClientAddr { node: NodeId(0xBEEF), mailbox: MailboxId(0xAB_CDEF) }).unwrap()
    }

    fn arb_entry() -> impl Strategy<Value = Entry> {
        (any::<bool>(), 0..=MAX_READERS, 0..=MAX_NODE_ID, 0..=MAX_QUEUE_ID, any::<u64>()).prop_map(
            |(e, r, n, q, rel)| {
                let tail = if n == 0 {
                    TailPtr::NULL
                } else {
                    TailPtr::from_client(ClientAddr { node: NodeId(n), mailbox: MailboxId(q) }).unwrap()
                };
                Entry::new(Epoch(e), r, tail, RelCnt(rel))
            },
        )
    }

    #[test]
    fn fields_tile_the_128_bits() {
        let masks = [EPOCH_MASK, RDR_CNT_MASK, NODE_ID_MASK, QUEUE_ID_MASK, REL_CNT_MASK];
        let mut all = 0u128;
        for m in masks {
            assert_eq!(all & m, 0, "fields overlap");
            all |= m;
        }
        assert_eq!(all, u128::MAX);
        assert_eq!(LOW_WORD_MASK, u64::MAX as u128, "Epoch, RdrCnt and TailPtr fill 8 bytes (§3.7)");
        assert_eq!(BOUNDARIES, 1 | 1 << 23 | 1 << 39 | 1 << 63 | 1 << 127);
    }

    #[test]
    fn tail_ptr_round_trips_and_rejects_what_does_not_fit() {
        let c = ClientAddr { node: NodeId(0xFFFF), mailbox: MailboxId(0xFF_FFFF) };
        assert_eq!(TailPtr::from_client(c).unwrap().client(), Some(c));
        let c = ClientAddr { node: NodeId(1), mailbox: MailboxId(0) };
        let t = TailPtr::from_client(c).unwrap();
        assert!(!t.is_null(), "mailbox 0 of node 1 is not null");
        assert_eq!(t.client(), Some(c));
        assert_eq!(t.bits(), 1 << 24);
        assert_eq!(
            TailPtr::from_client(ClientAddr { node: NodeId(0x1_0000), mailbox: MailboxId(0) }),
            Err(TailPtrError::Node(NodeId(0x1_0000)))
        );
        assert_eq!(
            TailPtr::from_client(ClientAddr { node: NodeId(0), mailbox: MailboxId(5) }),
            Err(TailPtrError::Node(NodeId(0)))
        );
        assert_eq!(
            TailPtr::from_client(ClientAddr { node: NodeId(3), mailbox: MailboxId(0x100_0000) }),
            Err(TailPtrError::Mailbox(MailboxId(0x100_0000)))
        );
        assert_eq!(TailPtr::NULL.client(), None);
    }

    #[test]
    fn entry_packs_fields_where_the_table_says() {
        let e = Entry::new(Epoch(true), 5, me(), RelCnt(0x1234));
        assert_eq!(e.0 & 1, 1);
        assert_eq!((e.0 >> 1) & 0x7F_FFFF, 5);
        assert_eq!((e.0 >> 24) & 0xFFFF, 0xBEEF);
        assert_eq!((e.0 >> 40) & 0xFF_FFFF, 0xAB_CDEF);
        assert_eq!((e.0 >> 64) as u64, 0x1234);
        assert_eq!(Entry::from_le_bytes(e.0.to_le_bytes()), e);
        assert_eq!((e.epoch(), e.rdr_cnt(), e.tail(), e.rel_cnt()), (Epoch(true), 5, me(), RelCnt(0x1234)));
    }

    #[test]
    fn reader_enter_and_leave_touch_only_their_fields() {
        let e = Entry::new(Epoch(true), 0, me(), RelCnt(7));
        let entered = apply_faa(e, READER_ENTER);
        assert_eq!(entered, Entry::new(Epoch(true), 1, me(), RelCnt(7)));
        let left = apply_faa(entered, READER_LEAVE);
        assert_eq!(left, Entry::new(Epoch(true), 0, me(), RelCnt(8)));
        // A borrow out of RdrCnt (a leave too many) stays inside RdrCnt.
        let under = apply_faa(left, READER_LEAVE);
        assert_eq!(under, Entry::new(Epoch(true), MAX_READERS, me(), RelCnt(9)));
        // RelCnt wraps inside its field.
        let e = Entry::new(Epoch(false), 1, TailPtr::NULL, RelCnt(u64::MAX));
        assert_eq!(apply_faa(e, READER_LEAVE), Entry::new(Epoch(false), 0, TailPtr::NULL, RelCnt(0)));
        // RdrCnt full: the carry does not reach TailPtr.
        let e = Entry::new(Epoch(false), MAX_READERS, me(), RelCnt(0));
        assert_eq!(apply_faa(e, READER_ENTER), Entry::new(Epoch(false), 0, me(), RelCnt(0)));
    }

    #[test]
    fn enqueue_is_a_fetch_and_store_of_the_tail() {
        let other = TailPtr::from_client(ClientAddr { node: NodeId(2), mailbox: MailboxId(9) }).unwrap();
        for old in [
            Entry::new(Epoch(true), 3, TailPtr::NULL, RelCnt(10)),
            Entry::new(Epoch(false), 0, other, RelCnt(u64::MAX)),
        ] {
            let new = ExtCas::enqueue(me()).apply(old).expect("compare mask is empty");
            assert_eq!(new, Entry::new(old.epoch(), old.rdr_cnt(), me(), old.rel_cnt()));
        }
    }

    #[test]
    fn release_last_succeeds_only_for_the_tail_at_the_expected_rel_cnt() {
        let old = Entry::new(Epoch(false), 4, me(), RelCnt(99));
        let cas = ExtCas::release_last(me(), RelCnt(99), Epoch(false));
        // Readers that arrived meanwhile (RdrCnt 4) are kept; the epoch flips to admit them.
        assert_eq!(cas.apply(old), Some(Entry::new(Epoch(true), 4, TailPtr::NULL, RelCnt(100))));
        let other = TailPtr::from_client(ClientAddr { node: NodeId(2), mailbox: MailboxId(9) }).unwrap();
        assert_eq!(cas.apply(Entry::new(Epoch(false), 4, other, RelCnt(99))), None, "a successor enqueued");
        let recovered = Entry::new(Epoch(false), 0, TailPtr::NULL, RelCnt(99).plus(RECOVERY_LEAP));
        assert_eq!(cas.apply(recovered), None, "recovered from under us");
    }

    #[test]
    fn hand_over_and_change_mode() {
        let old = Entry::new(Epoch(true), 6, me(), RelCnt(41));
        assert_eq!(
            ExtCas::hand_over(RelCnt(41)).apply(old),
            Some(Entry::new(Epoch(true), 6, me(), RelCnt(42)))
        );
        assert_eq!(
            ExtCas::change_mode(RelCnt(41), Epoch(true)).apply(old),
            Some(Entry::new(Epoch(false), 6, me(), RelCnt(42)))
        );
        let recovered = old.recovered();
        assert_eq!(ExtCas::hand_over(RelCnt(41)).apply(recovered), None);
        assert_eq!(ExtCas::change_mode(RelCnt(41), Epoch(true)).apply(recovered), None);
    }

    #[test]
    fn recovery_zeroes_all_but_rel_cnt_and_leaps() {
        let old = Entry::new(Epoch(true), 17, me(), RelCnt(5));
        let new = ExtCas::recover(old).apply(old).unwrap();
        assert_eq!(new, Entry::new(Epoch(false), 0, TailPtr::NULL, RelCnt(5 + (1 << 63))));
        assert!(new.rel_cnt().leaped_from(old.rel_cnt()));
        assert!(old.rel_cnt().leaped_from(new.rel_cnt()), "a stale value is recognised from either side");
        // Two recoveries cancel out: the limit the module comment states.
        assert!(!new.recovered().rel_cnt().leaped_from(old.rel_cnt()));
        assert_eq!(ExtCas::recover(old).apply(new), None, "a reset of a changed entry fails");
    }

    #[test]
    fn same_era_window() {
        assert!(RelCnt(10).same_era_since(RelCnt(10)));
        assert!(RelCnt(11).same_era_since(RelCnt(10)));
        assert!(!RelCnt(9).same_era_since(RelCnt(10)), "before");
        assert!(RelCnt(2).same_era_since(RelCnt(u64::MAX - 1)), "across the wrap");
        assert!(!RelCnt(10 + (1 << 63)).same_era_since(RelCnt(10)));
    }

    /// The operands through the verbs layer's own execution on region
    /// memory: the same results, and the first four fields in the 8-byte
    /// word at the entry's address (the one readers poll).
    #[test]
    fn operands_on_region_memory() {
        use crate::rdma::{RegionId, RegionMemory, RemoteAddr};
        let mem = RegionMemory::anonymous(RegionId(1), 4096).unwrap();
        let at = RemoteAddr::new(RegionId(1), 32);
        let read = || {
            let mut b = [0u8; 16];
            mem.read_into(at, &mut b).unwrap();
            Entry::from_le_bytes(b)
        };
        let cas = |c: ExtCas| Entry(mem.ext_cas(at, c.cmp, c.cmp_mask, c.swap, c.swap_mask).unwrap());
        assert_eq!(Entry(mem.ext_faa(at, READER_ENTER, BOUNDARIES).unwrap()), Entry(0));
        assert_eq!(read(), Entry::new(Epoch(false), 1, TailPtr::NULL, RelCnt(0)));
        assert_eq!(cas(ExtCas::enqueue(me())), Entry::new(Epoch(false), 1, TailPtr::NULL, RelCnt(0)));
        assert_eq!(mem.word(at).unwrap().load(std::sync::atomic::Ordering::SeqCst), read().0 as u64);
        assert_eq!(
            mem.word(at + 8).unwrap().load(std::sync::atomic::Ordering::SeqCst),
            0,
            "RelCnt is the second word"
        );
        mem.ext_faa(at, READER_LEAVE, BOUNDARIES).unwrap();
        assert_eq!(read(), Entry::new(Epoch(false), 0, me(), RelCnt(1)));
        cas(ExtCas::change_mode(RelCnt(1), Epoch(false)));
        assert_eq!(read(), Entry::new(Epoch(true), 0, me(), RelCnt(2)));
        cas(ExtCas::hand_over(RelCnt(2)));
        cas(ExtCas::release_last(me(), RelCnt(3), Epoch(true)));
        assert_eq!(read(), Entry::new(Epoch(false), 0, TailPtr::NULL, RelCnt(4)));
        let seen = read();
        cas(ExtCas::recover(seen));
        assert_eq!(read(), Entry::new(Epoch(false), 0, TailPtr::NULL, RelCnt(4 + RECOVERY_LEAP)));
    }

    proptest! {
        #[test]
        fn faa_operands_change_exactly_their_fields(old in arb_entry()) {
            let entered = apply_faa(old, READER_ENTER);
            prop_assert_eq!(entered.rdr_cnt(), (old.rdr_cnt() + 1) & MAX_READERS);
            prop_assert_eq!(entered.0 & !RDR_CNT_MASK, old.0 & !RDR_CNT_MASK);
            let left = apply_faa(old, READER_LEAVE);
            prop_assert_eq!(left.rdr_cnt(), old.rdr_cnt().wrapping_sub(1) & MAX_READERS);
            prop_assert_eq!(left.rel_cnt(), old.rel_cnt().plus(1));
            prop_assert_eq!((left.epoch(), left.tail()), (old.epoch(), old.tail()));
        }

        #[test]
        fn conditional_reader_leave_is_the_faa_when_unchanged(old in arb_entry(), other in arb_entry()) {
            let cas = ExtCas::reader_leave_if(old);
            prop_assert_eq!(cas.apply(old), Some(apply_faa(old, READER_LEAVE)));
            let changed = other.rdr_cnt() != old.rdr_cnt() || other.rel_cnt() != old.rel_cnt();
            prop_assert_eq!(cas.apply(other).is_none(), changed);
            if let Some(new) = cas.apply(other) {
                prop_assert_eq!((new.epoch(), new.tail()), (other.epoch(), other.tail()));
            }
        }

        #[test]
        fn writer_cas_operands_keep_rdr_cnt(old in arb_entry()) {
            let cur = old.rel_cnt();
            let e = old.epoch();
            for cas in [ExtCas::hand_over(cur), ExtCas::change_mode(cur, e), ExtCas::release_last(old.tail(), cur, e)] {
                let new = cas.apply(old).expect("compares hold");
                prop_assert_eq!(new.rdr_cnt(), old.rdr_cnt());
                prop_assert_eq!(new.rel_cnt(), cur.plus(1));
            }
        }
    }
}
