//! The vocabulary of byte-range locks: who owns a lock, its mode and flavour,
//! and the inclusive byte ranges the kernel speaks in.

use serde::{Deserialize, Serialize};

use crate::types::ClientId;

/// The lock owner as the kernel names it through FUSE (`lock_owner`): a
/// process's file table for POSIX locks, an open file description for OFD
/// and flock locks. Opaque; only compared for equality.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct LockOwner(pub u64);

/// A lock owner cluster-wide: the mount (client) it locks through and the
/// kernel's owner on that mount. Owner values of different mounts are
/// unrelated, so the client is part of the identity.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct OwnerKey {
    pub client: ClientId,
    pub owner: LockOwner,
}

/// Shared (`F_RDLCK`, `LOCK_SH`) or exclusive (`F_WRLCK`, `LOCK_EX`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum LockMode {
    Read,
    Write,
}

impl LockMode {
    /// Whether a lock of this mode and one of `other` may overlap.
    pub fn compatible(self, other: LockMode) -> bool {
        self == LockMode::Read && other == LockMode::Read
    }
}

/// Which interface took a lock. As on Linux, POSIX (`F_SETLK`) and OFD
/// (`F_OFD_SETLK`) locks conflict with each other, flock locks only with
/// flock locks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum LockFlavor {
    /// Owned by a process; released by any close of the file by it.
    Posix,
    /// Owned by an open file description; released at its last close.
    Ofd,
    /// `flock(2)`: whole file, owned by an open file description.
    Flock,
}

impl LockFlavor {
    /// Whether locks of the two flavours can conflict at all.
    pub fn same_domain(self, other: LockFlavor) -> bool {
        (self == LockFlavor::Flock) == (other == LockFlavor::Flock)
    }
}

/// Largest byte offset of a lock (`OFFSET_MAX`): a lock "to end of file"
/// ends here, as the kernel sends it.
pub const OFFSET_MAX: u64 = i64::MAX as u64;

/// Bytes `start..=last` (inclusive, as FUSE and the kernel's `file_lock`
/// carry them). Never empty.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ByteRange {
    pub start: u64,
    pub last: u64,
}

impl ByteRange {
    /// `start..=last`; `None` if empty or beyond [`OFFSET_MAX`].
    pub fn new(start: u64, last: u64) -> Option<Self> {
        (start <= last && last <= OFFSET_MAX).then_some(Self { start, last })
    }

    /// From `start` to the end of every file.
    pub fn to_eof(start: u64) -> Self {
        Self { start: start.min(OFFSET_MAX), last: OFFSET_MAX }
    }

    pub fn whole_file() -> Self {
        Self::to_eof(0)
    }

    pub fn overlaps(self, other: ByteRange) -> bool {
        self.start <= other.last && other.start <= self.last
    }

    /// Overlapping or adjacent: the two could merge into one range.
    pub fn touches(self, other: ByteRange) -> bool {
        self.start <= other.last.saturating_add(1) && other.start <= self.last.saturating_add(1)
    }

    pub fn contains(self, other: ByteRange) -> bool {
        self.start <= other.start && other.last <= self.last
    }

    pub fn contains_byte(self, b: u64) -> bool {
        self.start <= b && b <= self.last
    }

    /// The smallest range covering both.
    pub fn hull(self, other: ByteRange) -> ByteRange {
        ByteRange { start: self.start.min(other.start), last: self.last.max(other.last) }
    }

    pub fn intersection(self, other: ByteRange) -> Option<ByteRange> {
        ByteRange::new(self.start.max(other.start), self.last.min(other.last))
    }

    /// What is left of `self` once `cut` is removed: up to two pieces.
    pub fn minus(self, cut: ByteRange) -> [Option<ByteRange>; 2] {
        if !self.overlaps(cut) {
            return [Some(self), None];
        }
        let left = (cut.start > self.start).then(|| ByteRange { start: self.start, last: cut.start - 1 });
        let right = (cut.last < self.last).then(|| ByteRange { start: cut.last + 1, last: self.last });
        [left, right]
    }

    /// The range widened by one byte on each side (within `0..=OFFSET_MAX`),
    /// so locks adjacent to it overlap the result.
    pub fn widened(self) -> ByteRange {
        ByteRange { start: self.start.saturating_sub(1), last: (self.last + 1).min(OFFSET_MAX) }
    }

    /// Length in bytes; `None` for a range to end of file (`l_len` = 0).
    pub fn byte_count(self) -> Option<u64> {
        (self.last != OFFSET_MAX).then(|| self.last - self.start + 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(s: u64, l: u64) -> ByteRange {
        ByteRange::new(s, l).unwrap()
    }

    #[test]
    fn range_algebra() {
        assert!(r(0, 9).overlaps(r(9, 20)));
        assert!(!r(0, 9).overlaps(r(10, 20)));
        assert!(r(0, 9).touches(r(10, 20)));
        assert!(!r(0, 9).touches(r(11, 20)));
        assert_eq!(r(0, 9).minus(r(3, 4)), [Some(r(0, 2)), Some(r(5, 9))]);
        assert_eq!(r(0, 9).minus(r(0, 4)), [None, Some(r(5, 9))]);
        assert_eq!(r(0, 9).minus(r(0, 9)), [None, None]);
        assert_eq!(r(0, 9).minus(r(20, 30)), [Some(r(0, 9)), None]);
        assert_eq!(ByteRange::whole_file().widened(), ByteRange::whole_file());
        assert_eq!(r(5, 5).widened(), r(4, 6));
        assert_eq!(ByteRange::to_eof(7).byte_count(), None);
        assert_eq!(r(7, 7).byte_count(), Some(1));
        assert!(ByteRange::new(5, 4).is_none());
        assert!(ByteRange::new(0, OFFSET_MAX + 1).is_none());
        assert!(ByteRange::whole_file().touches(r(OFFSET_MAX, OFFSET_MAX)));
    }

    #[test]
    fn flavours_and_modes() {
        assert!(LockFlavor::Posix.same_domain(LockFlavor::Ofd));
        assert!(!LockFlavor::Posix.same_domain(LockFlavor::Flock));
        assert!(LockFlavor::Flock.same_domain(LockFlavor::Flock));
        assert!(LockMode::Read.compatible(LockMode::Read));
        assert!(!LockMode::Read.compatible(LockMode::Write));
        assert!(!LockMode::Write.compatible(LockMode::Write));
    }
}
