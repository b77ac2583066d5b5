//! Typed addresses of the verbs layer.
//!
//! A verb names its target memory with a [`RemoteAddr`]: a registered region
//! ([`RegionId`]) and a byte offset in it. Two-sided messages go to a
//! [`ClientAddr`]: the node (one process attached to the fabric) and one of its
//! mailboxes. Keeping these as newtypes stops an offset from being passed where
//! a region id or a node id is meant.

use std::fmt;

use serde::{Deserialize, Serialize};

/// The id of a region of registered memory on a host.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RegionId(pub u32);

/// A byte address in a registered region: what a one-sided verb targets.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RemoteAddr {
    pub region: RegionId,
    pub offset: u64,
}

impl RemoteAddr {
    pub const fn new(region: RegionId, offset: u64) -> Self {
        Self { region, offset }
    }

    /// The address `bytes` further into the same region (also `addr + bytes`).
    ///
    /// # Panics
    /// If the offset overflows `u64`: that is a bug in the caller's layout
    /// arithmetic, never a consequence of remote input.
    #[inline]
    pub fn offset_by(self, bytes: u64) -> Self {
        let offset = self.offset.checked_add(bytes).expect("remote address offset overflow");
        Self { region: self.region, offset }
    }

    /// Whether the offset is a multiple of `align` (a power of two).
    #[inline]
    pub fn is_aligned(self, align: u64) -> bool {
        debug_assert!(align.is_power_of_two());
        self.offset & (align - 1) == 0
    }
}

impl std::ops::Add<u64> for RemoteAddr {
    type Output = RemoteAddr;
    #[inline]
    fn add(self, bytes: u64) -> RemoteAddr {
        self.offset_by(bytes)
    }
}

impl fmt::Debug for RemoteAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "r{}+{:#x}", self.region.0, self.offset)
    }
}

impl fmt::Display for RemoteAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// A process attached to a fabric. Assigned by the fabric when the node joins;
/// never reused while the fabric lives.
///
/// A host may serve its memory both as a shm fabric and through its NIC
/// (the meta-server does), so that clients on its host and clients far away
/// share its locks; the lock words then hold node ids of both. The two
/// fabrics hand out ids from disjoint ranges — the NIC below
/// [`NodeId::FIRST_SHM`], shm from it up — so a message addressed to a node
/// of the other fabric finds no such node (an error the protocols leave to
/// their recovery) instead of reaching whichever node of this fabric has
/// the same number. Both stay within the 16 bits the lock words keep.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct NodeId(pub u32);

impl NodeId {
    /// The first id of a shm fabric; a NIC's ids stay below it.
    pub const FIRST_SHM: u32 = 0x8000;
}

/// One receive queue of a node. Each endpoint owns one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct MailboxId(pub u32);

/// Where a two-sided message is delivered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ClientAddr {
    pub node: NodeId,
    pub mailbox: MailboxId,
}

impl fmt::Display for ClientAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "n{}.m{}", self.node.0, self.mailbox.0)
    }
}
