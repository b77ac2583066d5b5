//! DQL's lock memory: the tail word and the ticket counter (dql-icpp05.md
//! §4.2 and §4.4), and the identities and stamps packed into the tail.
//!
//! # Lock memory ([`DQL_BYTES`] = 16, [`DQL_ALIGN`] = 8; zeroed = a free lock)
//!
//! | offset | word | meaning |
//! |---|---|---|
//! | 0 ([`TAIL_OFFSET`]) | tail | the queue's tail: who joined last, or free (§3.2.1) |
//! | 8 ([`COUNTER_OFFSET`]) | counter | tickets taken so far (§4.4; the starvation-free variant only) |
//!
//! # The tail word
//!
//! | bits | field | constant | meaning |
//! |---|---|---|---|
//! | 0..16 | mailbox | [`MAILBOX_SHIFT`] | the tail client's mailbox id |
//! | 16..32 | node | [`NODE_SHIFT`] | the tail client's node id; with the mailbox the [`DqlId`], 0 = nobody |
//! | 32..56 | stamp | [`STAMP_SHIFT`] | [`Stamp`]: the tail client's ticket (starvation-free) or nonce (distributed) |
//! | 56..63 | era | [`ERA_SHIFT`] | [`Era`]: advanced by each failure reset |
//! | 63 | closed | [`CLOSED_BIT`] | a failure reset is under way: nobody may join |
//!
//! A word with a client is that client's *token* for one acquisition: the
//! stamp makes it unique per acquisition, so a message naming a token (DQL's
//! alerts and grants) can never be taken for a later acquisition of the same
//! client. The paper's tail holds the client's identity (§4.2), and in the
//! starvation-free variant a 32-bit counter next to a 32-bit identity (§4.4);
//! we keep the 32-bit identity and give 8 of the counter's bits to the era
//! and the closed flag, so the ticket is the counter's low 24 bits.

use serde::{Deserialize, Serialize};

use crate::rdma::{ClientAddr, MailboxId, NodeId};

/// Bytes of lock memory: the tail word and the ticket counter.
pub const DQL_BYTES: u64 = 16;
/// Alignment of the lock memory (two 8-byte atomic words).
pub const DQL_ALIGN: u64 = 8;
/// Where the tail word is.
pub const TAIL_OFFSET: u64 = 0;
/// Where the ticket counter is (starvation-free variant).
pub const COUNTER_OFFSET: u64 = 8;

pub const MAILBOX_SHIFT: u32 = 0;
pub const MAILBOX_BITS: u32 = 16;
pub const NODE_SHIFT: u32 = 16;
pub const NODE_BITS: u32 = 16;
pub const ID_MASK: u64 = (1 << 32) - 1;
pub const STAMP_SHIFT: u32 = 32;
pub const STAMP_BITS: u32 = 24;
pub const STAMP_MASK: u64 = ((1 << STAMP_BITS) - 1) << STAMP_SHIFT;
pub const ERA_SHIFT: u32 = 56;
pub const ERA_BITS: u32 = 7;
pub const ERA_MASK: u64 = ((1 << ERA_BITS) - 1) << ERA_SHIFT;
pub const CLOSED_SHIFT: u32 = 63;
pub const CLOSED_BIT: u64 = 1 << CLOSED_SHIFT;

/// Largest node id a [`DqlId`] holds.
pub const MAX_NODE: u32 = (1 << NODE_BITS) - 1;
/// Largest mailbox id a [`DqlId`] holds.
pub const MAX_MAILBOX: u32 = (1 << MAILBOX_BITS) - 1;

/// Why an endpoint cannot be a DQL client.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DqlIdError {
    #[error("node id {0:?} does not fit DQL's 16-bit node field (1..=65535)")]
    Node(NodeId),
    #[error("mailbox id {0:?} does not fit DQL's 16-bit mailbox field (0..=65535)")]
    Mailbox(MailboxId),
}

/// A client's identity in the tail (§4.2): the endpoint whose mailbox
/// receives its alerts and grants, as (16-bit node, 16-bit mailbox).
/// Zero is nobody (node ids start at 1 on both backends).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct DqlId(u32);

impl std::fmt::Debug for DqlId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.client() {
            Some(c) => write!(f, "DqlId({c})"),
            None => f.write_str("DqlId(nobody)"),
        }
    }
}

impl DqlId {
    pub const NOBODY: DqlId = DqlId(0);

    /// The identity of the endpoint at `addr`, if its ids fit (refused,
    /// never truncated).
    pub fn from_client(addr: ClientAddr) -> Result<DqlId, DqlIdError> {
        if addr.node.0 == 0 || addr.node.0 > MAX_NODE {
            return Err(DqlIdError::Node(addr.node));
        }
        if addr.mailbox.0 > MAX_MAILBOX {
            return Err(DqlIdError::Mailbox(addr.mailbox));
        }
        Ok(DqlId(addr.node.0 << NODE_SHIFT | addr.mailbox.0 << MAILBOX_SHIFT))
    }

    pub fn is_nobody(self) -> bool {
        self.0 == 0
    }

    /// Where to send this client's messages; `None` for nobody.
    pub fn client(self) -> Option<ClientAddr> {
        if self.is_nobody() {
            return None;
        }
        Some(ClientAddr {
            node: NodeId(self.0 >> NODE_SHIFT),
            mailbox: MailboxId(self.0 >> MAILBOX_SHIFT & MAX_MAILBOX),
        })
    }
}

/// The 24-bit stamp of a token: a ticket (starvation-free) or a nonce
/// (distributed). Arithmetic wraps modulo 2^24.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Stamp(u32);

impl Stamp {
    pub const MODULUS: u32 = 1 << STAMP_BITS;

    pub const fn new(v: u32) -> Self {
        Stamp(v & (Self::MODULUS - 1))
    }

    pub const fn get(self) -> u32 {
        self.0
    }

    /// The ticket of the FA that returned `position` (§4.4: the counter's
    /// new value, keeping its low bits).
    pub const fn ticket_of(position: u64) -> Self {
        Stamp::new(position.wrapping_add(1) as u32)
    }

    pub const fn next(self) -> Self {
        Stamp::new(self.0.wrapping_add(1))
    }

    pub const fn prev(self) -> Self {
        Stamp::new(self.0.wrapping_sub(1))
    }

    /// How many steps `self` is ahead of `earlier`, modulo 2^24.
    pub const fn since(self, earlier: Stamp) -> u32 {
        self.0.wrapping_sub(earlier.0) & (Self::MODULUS - 1)
    }
}

/// Where a starvation-free ticket stands against the tail's stamp (§4.4).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Turn {
    /// The tail holds the previous ticket: ours may swap in now.
    Now,
    /// This many tickets before ours have not swapped in yet.
    Ahead(u32),
    /// The tail is at or past our ticket: a reset or a skip passed it over
    /// (tickets never go back), so it will never be served; take another.
    Passed,
}

impl Turn {
    pub fn of(ticket: Stamp, tail: Stamp) -> Turn {
        match ticket.prev().since(tail) {
            0 => Turn::Now,
            n if n < Stamp::MODULUS / 2 => Turn::Ahead(n),
            _ => Turn::Passed,
        }
    }
}

/// The failure-reset generation of a lock (7 bits, wraps).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Era(u8);

impl Era {
    pub const fn new(v: u8) -> Self {
        Era(v & ((1 << ERA_BITS) - 1) as u8)
    }

    pub const fn get(self) -> u8 {
        self.0
    }

    pub const fn next(self) -> Self {
        Era::new(self.0.wrapping_add(1))
    }
}

/// The two variants of the paper (§5.1's "Distributed" and "Starvation-free").
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum DqlVariant {
    /// §4.2: CAS the tail until it holds us; no bound on retries.
    Distributed,
    /// §4.4: a ticket from the counter first; only the next ticket may swap
    /// into the tail, so clients join in ticket order.
    StarvationFree,
}

/// The tail word, decoded.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TailWord(pub u64);

impl std::fmt::Debug for TailWord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{{era {}, stamp {}, {:?}{}}}",
            self.era().get(),
            self.stamp().get(),
            self.id(),
            if self.is_closed() { ", closed" } else { "" }
        )
    }
}

impl TailWord {
    /// Zeroed memory: era 0, stamp 0, free.
    pub const ZERO: TailWord = TailWord(0);

    pub const fn new(era: Era, stamp: Stamp, id: DqlId) -> Self {
        TailWord((era.0 as u64) << ERA_SHIFT | (stamp.0 as u64) << STAMP_SHIFT | id.0 as u64)
    }

    /// The free tail of the distributed variant in `era` (§4.3's "unlocked").
    pub const fn free(era: Era) -> Self {
        TailWord::new(era, Stamp(0), DqlId::NOBODY)
    }

    pub const fn id(self) -> DqlId {
        DqlId((self.0 & ID_MASK) as u32)
    }

    pub const fn stamp(self) -> Stamp {
        Stamp(((self.0 & STAMP_MASK) >> STAMP_SHIFT) as u32)
    }

    pub const fn era(self) -> Era {
        Era(((self.0 & ERA_MASK) >> ERA_SHIFT) as u8)
    }

    pub const fn is_closed(self) -> bool {
        self.0 & CLOSED_BIT != 0
    }

    /// Nobody holds or waits, and the lock is open.
    pub const fn is_free(self) -> bool {
        self.0 & (ID_MASK | CLOSED_BIT) == 0
    }

    /// Open and of `era`: the acquisitions of `era` are still valid.
    pub fn is_open_in(self, era: Era) -> bool {
        !self.is_closed() && self.era() == era
    }

    /// The word after its holder `self` released with nobody behind it
    /// (§4.3): the distributed variant's constant "unlocked" value; the
    /// starvation-free variant keeps the stamp, the ticket the next one
    /// waits for.
    pub const fn released(self, variant: DqlVariant) -> Self {
        match variant {
            DqlVariant::Distributed => TailWord::free(self.era()),
            DqlVariant::StarvationFree => TailWord::new(self.era(), self.stamp(), DqlId::NOBODY),
        }
    }

    /// The same word, closed (the first step of a failure reset).
    pub const fn closed(self) -> Self {
        TailWord(self.0 | CLOSED_BIT)
    }

    /// The open, free word a reset of the closed word `self` leaves: the
    /// next era. The starvation-free variant keeps the stamp, so tickets
    /// taken but not yet used keep their order.
    pub const fn reopened(self, variant: DqlVariant) -> Self {
        let era = self.era().next();
        match variant {
            DqlVariant::Distributed => TailWord::free(era),
            DqlVariant::StarvationFree => TailWord::new(era, self.stamp(), DqlId::NOBODY),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn client(node: u32, mailbox: u32) -> ClientAddr {
        ClientAddr { node: NodeId(node), mailbox: MailboxId(mailbox) }
    }

    #[test]
    fn fields_pack_where_the_table_says() {
        let id = DqlId::from_client(client(0xBEEF, 0xCAFE)).unwrap();
        let w = TailWord::new(Era::new(0x55), Stamp::new(0xAB_CDEF), id);
        assert_eq!(w.0, 0x55AB_CDEF_BEEF_CAFE);
        assert_eq!((w.era().get(), w.stamp().get(), w.id()), (0x55, 0xAB_CDEF, id));
        assert_eq!(w.id().client(), Some(client(0xBEEF, 0xCAFE)));
        assert!(!w.is_closed() && !w.is_free());
        assert_eq!(w.closed().0, 0xD5AB_CDEF_BEEF_CAFE);
        assert!(w.closed().is_closed() && w.closed().era() == w.era());
        assert_eq!(ID_MASK | STAMP_MASK | ERA_MASK | CLOSED_BIT, u64::MAX);
        assert_eq!(ID_MASK & STAMP_MASK, 0);
        assert_eq!(STAMP_MASK & ERA_MASK, 0);
        assert_eq!(ERA_MASK & CLOSED_BIT, 0);
        assert!(TailWord::ZERO.is_free() && TailWord::ZERO == TailWord::free(Era::default()));
    }

    #[test]
    fn identities_are_refused_not_truncated() {
        assert_eq!(DqlId::from_client(client(0, 5)), Err(DqlIdError::Node(NodeId(0))));
        assert_eq!(DqlId::from_client(client(0x1_0000, 5)), Err(DqlIdError::Node(NodeId(0x1_0000))));
        assert_eq!(DqlId::from_client(client(3, 0x1_0000)), Err(DqlIdError::Mailbox(MailboxId(0x1_0000))));
        for (n, m) in [(1, 0), (0xFFFF, 0xFFFF), (7, 300)] {
            let id = DqlId::from_client(client(n, m)).unwrap();
            assert!(!id.is_nobody());
            assert_eq!(id.client(), Some(client(n, m)));
        }
        assert_eq!(DqlId::NOBODY.client(), None);
    }

    #[test]
    fn tickets_wrap_and_judge_their_turn() {
        // The first FA returns 0: ticket 1 waits for the zeroed tail's stamp 0.
        assert_eq!(Stamp::ticket_of(0), Stamp::new(1));
        assert_eq!(Turn::of(Stamp::ticket_of(0), TailWord::ZERO.stamp()), Turn::Now);
        assert_eq!(Turn::of(Stamp::new(10), Stamp::new(9)), Turn::Now);
        assert_eq!(Turn::of(Stamp::new(10), Stamp::new(6)), Turn::Ahead(3));
        assert_eq!(Turn::of(Stamp::new(10), Stamp::new(10)), Turn::Passed);
        assert_eq!(Turn::of(Stamp::new(10), Stamp::new(200)), Turn::Passed);
        // Across the wrap of the 24-bit field.
        let last = Stamp::new(Stamp::MODULUS - 1);
        assert_eq!(last.next(), Stamp::new(0));
        assert_eq!(Stamp::new(0).prev(), last);
        assert_eq!(Stamp::ticket_of(u64::from(Stamp::MODULUS) - 1), Stamp::new(0));
        assert_eq!(Turn::of(Stamp::new(0), last), Turn::Now);
        assert_eq!(Turn::of(Stamp::new(2), last.prev()), Turn::Ahead(3));
        assert_eq!(Turn::of(last, Stamp::new(1)), Turn::Passed);
        assert_eq!(Stamp::new(3).since(last), 4);
    }

    #[test]
    fn release_and_reset_words() {
        let id = DqlId::from_client(client(2, 9)).unwrap();
        let era = Era::new(5);
        let holder = TailWord::new(era, Stamp::new(77), id);
        assert_eq!(holder.released(DqlVariant::Distributed), TailWord::free(era));
        let sf = holder.released(DqlVariant::StarvationFree);
        assert!(sf.is_free() && sf.stamp() == Stamp::new(77) && sf.era() == era);
        assert!(holder.is_open_in(era) && !holder.closed().is_open_in(era));
        let reopened = holder.closed().reopened(DqlVariant::StarvationFree);
        assert!(reopened.is_free() && reopened.era() == Era::new(6) && reopened.stamp() == Stamp::new(77));
        assert_eq!(holder.closed().reopened(DqlVariant::Distributed), TailWord::free(Era::new(6)));
        // The era wraps inside its 7 bits and never touches the closed bit.
        let top = TailWord::new(Era::new(127), Stamp::new(1), id);
        assert_eq!(top.closed().reopened(DqlVariant::Distributed), TailWord::free(Era::new(0)));
        assert_eq!(Era::new(200), Era::new(200 - 128));
    }
}
