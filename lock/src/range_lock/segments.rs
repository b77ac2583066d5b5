//! Static segmentation: the paper's SS baseline (citron-fast23.md §2.2,
//! Table 1, after pNOVA [35]). The address space is cut into fixed segments
//! of `S` lock units, each guarded by a DSLR mutex ([`crate::dslr`], as the
//! paper's SS uses DSLR); a range takes every segment it touches, in
//! ascending order, so two ranges never wait for each other in a cycle.
//!
//! # Memory layout
//!
//! For `covered` units and segment size `S`, an instance is an array of
//! `segments = ceil(covered / S)` DSLR words followed by one overflow word:
//!
//! | offset | word | guards units |
//! |---|---|---|
//! | `8 i` (i < segments) | DSLR word of segment i | `[i S, (i + 1) S)` |
//! | `8 segments` | DSLR word of the overflow mutex | `[segments S, ∞)` |
//!
//! so it takes **`8 (ceil(covered / S) + 1)` bytes** ([`SegmentLayout::bytes`]),
//! 8-aligned, zeroed = idle. Citron's tree takes about `8 (4/3) covered / 64`
//! bytes for the same `covered` (a bit per unit in the leaves), i.e. SS with
//! `S = 1` needs ~48× Citron's memory and SS with `S = 48` about the same.
//!
//! The overflow mutex plays the role of Citron's spillover (§3.3): the part
//! of a range beyond the array, or a range "to infinity" (`end = u64::MAX`),
//! takes it after the segments, i.e. it is the last lock in the global order.
//!
//! # Cost
//!
//! Uncontended, a range touching `t` segments (plus the overflow) costs `t`
//! masked-FAAs in `t` round trips to acquire (the bakery tickets must be
//! taken one after another: taking them in one batch could order two
//! requests differently on two segments and deadlock) and `t` masked-FAAs in
//! `t` round trips to release (DSLR's release checks its lease per word).

use serde::{Deserialize, Serialize};

use crate::dslr::{DslrConfig, DslrLock, DSLR_BYTES};
use crate::rdma::{Endpoint, RemoteAddr};
use crate::rwlock::LockError;

/// The index of one segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct SegmentIndex(pub u64);

/// Most segments one instance may have (2^32 words = 32 GiB of lock memory).
pub const MAX_SEGMENTS: u64 = 1 << 32;

/// Where a static-segmentation instance lives and how it cuts the space.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct SegmentLayout {
    pub base: RemoteAddr,
    /// S: lock units per segment.
    pub segment_units: u64,
    /// Segments in the array (the overflow mutex is extra).
    pub segments: u64,
}

/// The locks a range `[start, end)` needs: segments `first..last` (half-open,
/// possibly empty) and maybe the overflow mutex.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SegmentSpan {
    pub first: SegmentIndex,
    /// One past the last segment taken.
    pub last: SegmentIndex,
    pub overflow: bool,
}

impl SegmentSpan {
    /// Mutexes to take, the overflow included.
    pub fn mutexes(&self) -> u64 {
        (self.last.0 - self.first.0) + u64::from(self.overflow)
    }
}

impl SegmentLayout {
    /// An instance covering `covered` units with segments of `segment_units`.
    pub fn new(base: RemoteAddr, covered: u64, segment_units: u64) -> Result<Self, LockError> {
        if segment_units == 0 {
            return Err(LockError::Misuse("segment size must be at least one unit"));
        }
        if !base.is_aligned(DSLR_BYTES) {
            return Err(LockError::Misuse("segment array must be 8-byte aligned"));
        }
        let segments = covered.div_ceil(segment_units);
        if segments > MAX_SEGMENTS {
            return Err(LockError::Misuse(
                "too many segments (more than 2^32): choose a larger segment size",
            ));
        }
        Ok(Self { base, segment_units, segments })
    }

    /// Bytes of lock memory: `8 (ceil(covered / S) + 1)`.
    pub fn bytes_for(covered: u64, segment_units: u64) -> u64 {
        DSLR_BYTES * (covered.div_ceil(segment_units.max(1)) + 1)
    }

    pub fn bytes(&self) -> u64 {
        DSLR_BYTES * (self.segments + 1)
    }

    /// Units the array covers: `segments × S` (saturating), at least the
    /// `covered` asked for.
    pub fn covered(&self) -> u64 {
        self.segments.saturating_mul(self.segment_units)
    }

    /// The DSLR word of segment `i`.
    pub fn segment(&self, i: SegmentIndex) -> RemoteAddr {
        debug_assert!(i.0 < self.segments);
        self.base + DSLR_BYTES * i.0
    }

    /// The DSLR word of the overflow mutex, `[covered, ∞)`.
    pub fn overflow(&self) -> RemoteAddr {
        self.base + DSLR_BYTES * self.segments
    }

    /// The mutexes `[start, end)` needs (`end = u64::MAX`: to infinity).
    pub fn span(&self, start: u64, end: u64) -> SegmentSpan {
        debug_assert!(start < end);
        let s = self.segment_units;
        let first = (start / s).min(self.segments);
        // ceil(end / S) without overflowing at end = u64::MAX.
        let last = ((end - 1) / s + 1).min(self.segments);
        let overflow = end == u64::MAX || end > self.covered();
        SegmentSpan { first: SegmentIndex(first), last: SegmentIndex(last.max(first)), overflow }
    }
}

/// Counters of one client.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SegmentStats {
    pub acquisitions: u64,
    /// Mutexes taken (segments and overflow).
    pub mutexes: u64,
    /// Mutexes that had to wait (DSLR's conflicts).
    pub conflicts: u64,
}

/// The mutexes a range holds; give it back with [`SegmentClient::release`].
#[derive(Debug)]
#[must_use = "a held range must be released"]
pub struct SegmentsHeld {
    pub span: SegmentSpan,
    /// In acquisition order (ascending, overflow last).
    locks: Vec<DslrLock>,
}

/// One client's handle to one static-segmentation instance.
pub struct SegmentClient {
    layout: SegmentLayout,
    config: DslrConfig,
    stats: SegmentStats,
}

impl SegmentClient {
    pub fn new(layout: SegmentLayout, config: DslrConfig) -> Self {
        Self { layout, config, stats: SegmentStats::default() }
    }

    pub fn layout(&self) -> SegmentLayout {
        self.layout
    }

    pub fn stats(&self) -> SegmentStats {
        self.stats
    }

    /// Takes every mutex `[start, end)` touches, in ascending order.
    pub fn acquire(&mut self, ep: &Endpoint, start: u64, end: u64) -> Result<SegmentsHeld, LockError> {
        if start >= end {
            return Err(LockError::Misuse("empty range"));
        }
        let span = self.layout.span(start, end);
        let mut held = SegmentsHeld { span, locks: Vec::with_capacity(span.mutexes() as usize) };
        let addrs = (span.first.0..span.last.0)
            .map(|i| self.layout.segment(SegmentIndex(i)))
            .chain(span.overflow.then(|| self.layout.overflow()));
        for addr in addrs {
            let mut lock = DslrLock::new(addr, self.config);
            if let Err(e) = lock.lock_exclusive(ep) {
                // Give back what was taken; the first error is the answer.
                let _ = self.release(ep, held);
                return Err(e);
            }
            self.stats.conflicts += lock.stats().conflicts;
            held.locks.push(lock);
        }
        self.stats.acquisitions += 1;
        self.stats.mutexes += span.mutexes();
        Ok(held)
    }

    /// Releases every mutex of `held`; all are released even if one fails,
    /// and the first error is returned.
    pub fn release(&mut self, ep: &Endpoint, held: SegmentsHeld) -> Result<(), LockError> {
        let mut first_error = None;
        for mut lock in held.locks {
            if let Err(e) = lock.unlock(ep) {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(()), Err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rdma::RegionId;
    use proptest::prelude::*;

    fn layout(covered: u64, s: u64) -> SegmentLayout {
        SegmentLayout::new(RemoteAddr::new(RegionId(1), 64), covered, s).unwrap()
    }

    #[test]
    fn layout_and_bytes() {
        let l = layout(1000, 16);
        assert_eq!(l.segments, 63, "ceil(1000 / 16)");
        assert_eq!(l.covered(), 1008);
        assert_eq!(l.bytes(), 8 * 64);
        assert_eq!(SegmentLayout::bytes_for(1000, 16), l.bytes());
        assert_eq!(l.segment(SegmentIndex(0)).offset, 64);
        assert_eq!(l.segment(SegmentIndex(62)).offset, 64 + 8 * 62);
        assert_eq!(l.overflow().offset, 64 + 8 * 63);
        assert_eq!(layout(1024, 1).bytes(), 8 * 1025);
        assert!(SegmentLayout::new(RemoteAddr::new(RegionId(1), 4), 10, 1).is_err(), "misaligned");
        assert!(SegmentLayout::new(RemoteAddr::new(RegionId(1), 0), 10, 0).is_err(), "S = 0");
        assert!(SegmentLayout::new(RemoteAddr::new(RegionId(1), 0), u64::MAX, 1).is_err(), "too many");
    }

    #[test]
    fn spans() {
        let l = layout(1024, 16);
        let span = |s, e| {
            let x = l.span(s, e);
            (x.first.0, x.last.0, x.overflow)
        };
        assert_eq!(span(0, 1), (0, 1, false));
        assert_eq!(span(15, 17), (0, 2, false), "straddles a border");
        assert_eq!(span(16, 32), (1, 2, false), "aligned: exactly one");
        assert_eq!(span(1020, 1024), (63, 64, false), "last segment, not beyond");
        assert_eq!(span(1020, 1025), (63, 64, true), "crosses into the overflow");
        assert_eq!(span(2000, 3000), (64, 64, true), "only the overflow");
        assert_eq!(span(5, u64::MAX), (0, 64, true), "to infinity");
        assert_eq!(span(u64::MAX - 1, u64::MAX), (64, 64, true));
        assert_eq!(l.span(15, 17).mutexes(), 2);
        assert_eq!(l.span(5, u64::MAX).mutexes(), 65);
    }

    proptest! {
        /// The span holds exactly the segments meeting the range, and the
        /// overflow iff the range reaches past the array: two ranges share a
        /// mutex whenever they share a unit.
        #[test]
        fn span_is_exactly_the_segments_met(
            covered in 1u64..600, s in 1u64..70, a in 0u64..700, len in 1u64..300, inf in any::<bool>()
        ) {
            let l = layout(covered, s);
            let end = if inf { u64::MAX } else { a + len };
            let span = l.span(a, end);
            for i in 0..l.segments {
                let (lo, hi) = (i * s, (i + 1) * s);
                let meets = lo < end && a < hi;
                prop_assert_eq!(span.first.0 <= i && i < span.last.0, meets, "segment {}", i);
            }
            prop_assert_eq!(span.overflow, end > l.covered());
        }

        #[test]
        fn sharing_a_unit_means_sharing_a_mutex(
            s in 1u64..40, a in 0u64..500, la in 1u64..100, b in 0u64..500, lb in 1u64..100
        ) {
            let l = layout(300, s);
            let (x, y) = (l.span(a, a + la), l.span(b, b + lb));
            let overlap = a < b + lb && b < a + la;
            let share_segment = x.first.0.max(y.first.0) < x.last.0.min(y.last.0);
            let share = share_segment || (x.overflow && y.overflow);
            if overlap {
                prop_assert!(share);
            }
        }
    }
}
