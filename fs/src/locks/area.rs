//! A file's lock memory on the lock server (DESIGN.md §4): allocated by the
//! meta-server when the file is opened and has none, freed when it is closed
//! everywhere and holds no lock record, and reached by clients with
//! one-sided verbs only, while they have the file open.
//!
//! | offset | bytes | what |
//! |---|---|---|
//! | 0 | 8 | record-table head: packed address of the first block (0: none yet; written once, by the meta-server) |
//! | 8 | 24 | the ALock over the attribute slot's size and mtime (meta-server threads and clients) |
//! | 32 | 32 | the inode mutex (16-aligned; the words of the cluster's `--inode-lock` algorithm) |
//! | 64 | per algorithm | the range lock's memory (`--range-lock`): a Citron tree and its spillover, or one DSLR word per segment, or nothing for the RPC server or a hosted Citron tree |
//!
//! Zeroed memory is an idle area: no table, every lock free.
//!
//! A Citron tree that grows (the meta-server's default, DESIGN.md §4 "Tree
//! growth") is not in the area: the meta-server's tree host owns it and its
//! later segments, and the area's [`RangeLockSite::CitronHosted`] names it
//! ([`LockArea::with_range`]).

use std::net::SocketAddr;

use citron_lock::range_lock::rpc::RangeInstanceId;
use citron_lock::range_lock::{RangeAlgorithm, RangeLockSite};
use citron_lock::rdma::RemoteAddr;
use citron_lock::rwlock::{Algorithm, LockError};
use serde::{Deserialize, Serialize};

use super::types::{ByteRange, OFFSET_MAX};
use crate::types::Ino;

/// Bytes of file per range-lock unit unless configured otherwise.
pub const DEFAULT_GRANULE: u64 = 4096;
/// Bytes reserved for the inode mutex (the largest algorithm needs 24).
pub const INODE_MUTEX_BYTES: u64 = 32;
/// Units a file's range lock covers at least (what lies beyond goes through
/// Citron's spillover or the segments' overflow mutex).
pub const MIN_UNITS: u64 = 1024;
/// Units a new range lock covers at most (1 GiB of 4 KiB granules); a
/// bigger file starts with this and its tail is locked through the
/// spillover.
pub const MAX_INITIAL_UNITS: u64 = 1 << 18;

/// How a cluster locks its files (chosen at the meta-server; every client
/// follows what a file's area says).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LockChoice {
    pub range: RangeAlgorithm,
    pub inode: Algorithm,
    /// Bytes of file per range-lock unit (a power of two).
    pub granule: u64,
}

impl Default for LockChoice {
    fn default() -> Self {
        Self { range: RangeAlgorithm::Citron, inode: Algorithm::ShiftLock, granule: DEFAULT_GRANULE }
    }
}

/// Where one file's lock memory is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LockArea {
    /// Start of the area (64-aligned) and its size, for freeing.
    pub base: RemoteAddr,
    pub bytes: u64,
    /// Bytes of file per range-lock unit.
    pub granule: u64,
    /// The file's range lock (data I/O and lock records).
    pub range: RangeLockSite,
    /// The inode mutex's algorithm; its words are at [`LockArea::inode_mutex`].
    pub inode_lock: Algorithm,
}

impl LockArea {
    const TABLE_HEAD: u64 = 0;
    const ATTR_LOCK: u64 = 8;
    const INODE_MUTEX: u64 = 32;
    const RANGE: u64 = 64;

    /// Units a new file's range lock covers: its size in granules, within
    /// [`MIN_UNITS`] and [`MAX_INITIAL_UNITS`].
    pub fn initial_units(choice: LockChoice, size: u64) -> u64 {
        (size / choice.granule).clamp(MIN_UNITS, MAX_INITIAL_UNITS)
    }

    /// Bytes of an area made by [`LockArea::with_range`].
    pub const fn bytes_for_hosted() -> u64 {
        Self::RANGE
    }

    /// The area at `base` of a file whose range lock lives elsewhere
    /// (`range` uses no memory of the area: a hosted Citron tree, or the RPC
    /// server).
    pub fn with_range(base: RemoteAddr, choice: LockChoice, range: RangeLockSite) -> Result<Self, LockError> {
        if range.bytes() != 0 {
            return Err(LockError::Misuse("this range lock needs memory in the file's area"));
        }
        Ok(Self { base, bytes: Self::RANGE, granule: choice.granule, range, inode_lock: choice.inode })
    }

    /// The area for a file of `size` bytes at `base` under `choice`; the
    /// RPC range lock server (if that is the choice) is at `range_server`
    /// and the file's instance there is its inode number.
    pub fn plan(
        base: RemoteAddr,
        choice: LockChoice,
        size: u64,
        ino: Ino,
        range_server: Option<SocketAddr>,
    ) -> Result<Self, LockError> {
        let units = Self::initial_units(choice, size);
        let at = base + Self::RANGE;
        let range = match choice.range {
            RangeAlgorithm::Citron => RangeLockSite::citron(at, units),
            // Segments of one granule: the static segmentation a file system
            // would pick (the paper's SS-4KB of Table 2).
            RangeAlgorithm::Segments => RangeLockSite::segments(at, units, 1)?,
            RangeAlgorithm::Rpc => RangeLockSite::rpc(
                range_server.ok_or(LockError::Misuse("the RPC range lock needs its server"))?,
                RangeInstanceId(ino.0),
            ),
        };
        Ok(Self {
            base,
            bytes: Self::RANGE + range.bytes(),
            granule: choice.granule,
            range,
            inode_lock: choice.inode,
        })
    }

    /// Bytes of the area [`LockArea::plan`] makes.
    pub fn bytes_for(choice: LockChoice, size: u64) -> Result<u64, LockError> {
        let probe = RemoteAddr::new(citron_lock::rdma::RegionId(0), 0);
        let server = SocketAddr::from(([127, 0, 0, 1], 0));
        Ok(Self::plan(probe, choice, size, Ino(0), Some(server))?.bytes)
    }

    pub fn table_head(&self) -> RemoteAddr {
        self.base + Self::TABLE_HEAD
    }

    pub fn attr_lock(&self) -> RemoteAddr {
        self.base + Self::ATTR_LOCK
    }

    pub fn inode_mutex(&self) -> RemoteAddr {
        self.base + Self::INODE_MUTEX
    }

    /// The lock units `[l, r)` covering `bytes`; `r = u64::MAX` (to
    /// infinity) for a range to the end of every file.
    pub fn units(&self, bytes: ByteRange) -> (u64, u64) {
        let end = if bytes.last == OFFSET_MAX { u64::MAX } else { bytes.last / self.granule + 1 };
        (bytes.start / self.granule, end)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use citron_lock::rdma::RegionId;

    #[test]
    fn layout_and_units() {
        let base = RemoteAddr::new(RegionId(2), 4096);
        let a = LockArea::plan(base, LockChoice::default(), 0, Ino(5), None).unwrap();
        assert_eq!(a.table_head().offset, 4096);
        assert_eq!(a.attr_lock().offset, 4096 + 8);
        assert!(a.attr_lock().is_aligned(citron_lock::alock::AlockLayout::LOCK_ALIGN));
        assert!(a.inode_mutex().is_aligned(16));
        for alg in Algorithm::ALL {
            assert!(alg.lock_bytes() <= INODE_MUTEX_BYTES && alg.lock_align() <= 16, "{alg}");
        }
        const {
            assert!(
                citron_lock::alock::AlockLayout::LOCK_BYTES <= LockArea::INODE_MUTEX - LockArea::ATTR_LOCK
            )
        };
        // Citron over 1024 units: depth 2, 21 nodes + header + spillover.
        assert_eq!(a.bytes, 64 + 16 + 21 * 8 + 8);
        assert_eq!(LockArea::bytes_for(LockChoice::default(), 0).unwrap(), a.bytes);
        assert_eq!(a.units(ByteRange::new(0, 0).unwrap()), (0, 1));
        assert_eq!(a.units(ByteRange::new(4095, 4096).unwrap()), (0, 2));
        assert_eq!(a.units(ByteRange::whole_file()), (0, u64::MAX));
        // A 1 TiB file starts with the largest initial tree.
        let big = LockArea::plan(base, LockChoice::default(), 1 << 40, Ino(5), None).unwrap();
        match big.range {
            RangeLockSite::Citron { depth, .. } => assert_eq!(depth, 6),
            other => panic!("{other:?}"),
        }
        let seg = LockChoice { range: RangeAlgorithm::Segments, ..LockChoice::default() };
        assert_eq!(LockArea::bytes_for(seg, 0).unwrap(), 64 + 8 * (1024 + 1));
        let rpc = LockChoice { range: RangeAlgorithm::Rpc, ..LockChoice::default() };
        assert!(LockArea::plan(base, rpc, 0, Ino(5), None).is_err(), "needs its server");
        assert_eq!(LockArea::bytes_for(rpc, 0).unwrap(), 64);
    }
}
