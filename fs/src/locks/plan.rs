//! What a lock request does to a file's records: the POSIX rules (conflict,
//! replace, split, merge) as a pure function of the records a requester can
//! trust. No I/O here; [`super::protocol`] reads the table, calls
//! [`plan`], and writes what it says.
//!
//! The rules, as POSIX and Linux define them:
//! * A request conflicts with a held lock of another owner in the same
//!   domain (POSIX/OFD together, flock apart) that overlaps it, unless both
//!   are read locks. Waiting records never conflict.
//! * An owner's new lock replaces whatever of its own locks it overlaps
//!   (conversion, split), and merges with its own same-mode locks that
//!   overlap or touch it. A refused request changes nothing — except a
//!   flock conversion, which Linux performs as "drop the old lock, then take
//!   the new one" (flock(2): "not guaranteed to be atomic"), so a refused
//!   flock upgrade or downgrade has dropped the old lock.
//! * Unlocking removes the owner's locks from the range, splitting any that
//!   reach beyond it; unlocking what is not locked succeeds.
//! * `F_GETLK` reports the first conflicting lock of the file's lock list,
//!   which Linux keeps grouped by owner, owners in the order they came to
//!   hold locks there, each owner's locks in start order
//!   ([`first_conflict`], [`ListSeq`]).
//!
//! Stability (DESIGN.md §4): a requester holds a range lock over its
//! request widened by one byte each side ([`ByteRange::widened`]), so every
//! record that overlaps or touches the request is stable while it looks.
//! If one of its own touching records reaches beyond what it holds, it must
//! widen its range lock to cover that record before changing it:
//! [`Plan::Widen`].

use super::record::{Generation, ListSeq, LockRecord, RecordState};
use super::types::{ByteRange, LockFlavor, LockMode, OwnerKey};

/// A slot of a file's table: its index across the block chain.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SlotIndex(pub u32);

/// A record as read, with where it lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Located {
    pub slot: SlotIndex,
    pub gen: Generation,
    pub record: LockRecord,
}

/// A request as the plan sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    pub owner: OwnerKey,
    pub flavor: LockFlavor,
    /// `None` unlocks.
    pub mode: Option<LockMode>,
    pub range: ByteRange,
    pub pid: u32,
    pub fh: u64,
}

/// Writes to the table that carry out a decision.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Changes {
    /// Slots to rewrite with a new record (same slot, next generation).
    pub rewrite: Vec<(Located, LockRecord)>,
    /// Records to write into newly claimed slots.
    pub add: Vec<LockRecord>,
    /// Slots to free.
    pub free: Vec<Located>,
    /// Bytes whose locks got weaker (released or downgraded): waiters there
    /// must be woken.
    pub weakened: Vec<ByteRange>,
}

impl Changes {
    pub fn is_empty(&self) -> bool {
        self.rewrite.is_empty() && self.add.is_empty() && self.free.is_empty()
    }
}

/// What to do with a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Plan {
    /// Another owner's held lock blocks it. `drop_own` is what a refused
    /// flock conversion releases first (see the module comment).
    Conflict {
        blocker: LockRecord,
        drop_own: Changes,
    },
    /// The range lock must grow to this before anything can be changed.
    Widen(ByteRange),
    Apply(Changes),
}

/// Decides `req` given `records`, all the valid records of the table (the
/// caller skips torn and free slots), while the caller holds a range lock
/// over `guard` ⊇ `req.range.widened()`.
pub fn plan(req: &Request, records: &[Located], guard: ByteRange) -> Plan {
    debug_assert!(guard.contains(req.range.widened()));
    let own: Vec<&Located> = records
        .iter()
        .filter(|l| l.record.is_own(req.owner, req.flavor) && l.record.range.touches(req.range))
        .collect();
    if let Some(reach) = own.iter().map(|l| l.record.range).reduce(ByteRange::hull) {
        let need = guard.hull(reach.widened());
        if need != guard {
            return Plan::Widen(need);
        }
    }
    if let Some(mode) = req.mode {
        let blocker = records
            .iter()
            .find(|l| l.record.blocks(req.owner, req.flavor, mode, req.range))
            .map(|l| l.record);
        if let Some(blocker) = blocker {
            let drop_own = if req.flavor == LockFlavor::Flock {
                let mut c = Changes::default();
                for l in own.iter().filter(|l| l.record.range.overlaps(req.range)) {
                    c.free.push(**l);
                    c.weakened.push(l.record.range);
                }
                c
            } else {
                Changes::default()
            };
            return Plan::Conflict { blocker, drop_own };
        }
    }
    Plan::Apply(changes(req, &own, list_position(req, records)))
}

/// The bytes an unlock `req` must range-lock: the part of `req.range`
/// where its owner holds locks in `records` (the hull of those), or `None`
/// if it holds none there and the unlock changes nothing. An unlock does
/// nothing where its owner holds nothing, so the narrowed request is the
/// same request; but a whole-file unlock (SQLite's at the end of every
/// transaction) would otherwise range-lock the whole file — the Citron
/// tree's root, which waits T_wait before it looks at its descendants
/// (Citron Algorithm 1, line 34) — to drop a lock on a few bytes.
///
/// `records` may be read without any range lock: only the owner's own
/// requests change its records, and one of another thread of the owner
/// that is not written yet is one this unlock comes before.
pub fn unlock_reach(req: &Request, records: &[Located]) -> Option<ByteRange> {
    debug_assert!(req.mode.is_none(), "only an unlock can be narrowed");
    records
        .iter()
        .filter(|l| l.record.is_own(req.owner, req.flavor) && l.record.range.overlaps(req.range))
        .map(|l| l.record.range)
        .reduce(ByteRange::hull)
        .and_then(|reach| reach.intersection(req.range))
}

/// Where `req.owner`'s locks stand in the file's lock list: where its held
/// locks are (the earliest, should two of its records disagree after a
/// race between its own threads), or, if it holds none, after every owner
/// in the table.
fn list_position(req: &Request, records: &[Located]) -> ListSeq {
    let held = || records.iter().filter(|l| l.record.state == RecordState::Held);
    held()
        .filter(|l| l.record.is_own(req.owner, req.flavor))
        .map(|l| l.record.listed)
        .min()
        .unwrap_or_else(|| ListSeq(held().map(|l| l.record.listed.0).max().unwrap_or(0) + 1))
}

/// The lock `F_GETLK` reports for `mode` on `range` by `owner` of `flavor`:
/// of the held locks that block it, the first in the file's lock list as
/// Linux keeps it — owners by [`ListSeq`], each owner's locks by start.
/// Owners that became holders concurrently (one place) are ordered by
/// their keys, so every mount reports the same one.
pub fn first_conflict(
    records: &[Located],
    owner: OwnerKey,
    flavor: LockFlavor,
    mode: LockMode,
    range: ByteRange,
) -> Option<LockRecord> {
    let place = |who: OwnerKey, domain: LockFlavor| {
        records
            .iter()
            .filter(|l| l.record.state == RecordState::Held && l.record.is_own(who, domain))
            .map(|l| l.record.listed)
            .min()
            .unwrap_or_default()
    };
    records
        .iter()
        .map(|l| l.record)
        .filter(|r| r.blocks(owner, flavor, mode, range))
        .min_by_key(|r| (place(r.owner, r.flavor), r.owner.client, r.owner.owner, r.range.start))
}

/// The owner's records after the request, as (range, mode) pieces in order.
fn pieces_after(req: &Request, own: &[&Located]) -> Vec<(ByteRange, LockMode)> {
    let mut pieces: Vec<(ByteRange, LockMode)> = Vec::new();
    for l in own {
        for piece in l.record.range.minus(req.range).into_iter().flatten() {
            pieces.push((piece, l.record.mode));
        }
    }
    if let Some(mode) = req.mode {
        pieces.push((req.range, mode));
    }
    pieces.sort_by_key(|(r, _)| r.start);
    // Merge same-mode neighbours; pieces of one owner never overlap here
    // (its records do not overlap one another, and the request's piece was
    // cut out of them), but they may touch.
    let mut merged: Vec<(ByteRange, LockMode)> = Vec::with_capacity(pieces.len());
    for (r, m) in pieces {
        match merged.last_mut() {
            Some((last, lm)) if *lm == m && last.touches(r) => *last = last.hull(r),
            _ => merged.push((r, m)),
        }
    }
    merged
}

fn changes(req: &Request, own: &[&Located], listed: ListSeq) -> Changes {
    let after = pieces_after(req, own);
    let mut c = Changes::default();
    // Bytes that lost a lock or went from write to read.
    for l in own {
        let before = l.record.range;
        let Some(cut) = before.intersection(req.range) else { continue };
        match req.mode {
            None => c.weakened.push(cut),
            Some(LockMode::Read) if l.record.mode == LockMode::Write => c.weakened.push(cut),
            _ => {}
        }
    }
    // Keep records that are unchanged; reuse the other slots for the new
    // pieces, in order; free what is left; claim slots for the rest.
    let template = |range: ByteRange, mode: LockMode, like: Option<&LockRecord>| LockRecord {
        state: RecordState::Held,
        mode,
        flavor: req.flavor,
        owner: req.owner,
        range,
        // A piece of an old lock keeps its pid and handle; the new lock
        // carries the requester's.
        pid: like.map_or(req.pid, |r| r.pid),
        fh: like.map_or(req.fh, |r| r.fh),
        mailbox: None,
        listed,
    };
    let mut reusable: Vec<&Located> = Vec::new();
    let mut fresh: Vec<(ByteRange, LockMode)> = Vec::new();
    for l in own {
        if !after.contains(&(l.record.range, l.record.mode)) {
            reusable.push(l);
        }
    }
    for &(r, m) in &after {
        if !own.iter().any(|l| l.record.range == r && l.record.mode == m) {
            fresh.push((r, m));
        }
    }
    let mut reusable = reusable.into_iter();
    for (r, m) in fresh {
        // The old lock this piece came from, if it is a remainder of one.
        let origin =
            own.iter().find(|l| l.record.range.contains(r) && l.record.mode == m && !req.range.overlaps(r));
        let record = template(r, m, origin.map(|l| &l.record));
        match reusable.next() {
            Some(slot) => c.rewrite.push((*slot, record)),
            None => c.add.push(record),
        }
    }
    c.free.extend(reusable.copied());
    c
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::locks::types::{LockOwner, OFFSET_MAX};
    use crate::types::ClientId;
    use proptest::prelude::*;
    use std::collections::{BTreeMap, BTreeSet};

    fn key(o: u64) -> OwnerKey {
        OwnerKey { client: ClientId(1 + o % 2), owner: LockOwner(o) }
    }

    fn r(s: u64, l: u64) -> ByteRange {
        ByteRange::new(s, l).unwrap()
    }

    fn req(owner: u64, mode: Option<LockMode>, range: ByteRange) -> Request {
        Request { owner: key(owner), flavor: LockFlavor::Posix, mode, range, pid: 100 + owner as u32, fh: 1 }
    }

    /// A table in memory that applies plans the way the protocol does.
    #[derive(Clone, Default)]
    struct Table {
        slots: BTreeMap<u32, Located>,
        next: u32,
    }

    impl Table {
        fn records(&self) -> Vec<Located> {
            self.slots.values().copied().collect()
        }

        fn apply(&mut self, c: &Changes) {
            for (l, rec) in &c.rewrite {
                let slot = self.slots.get_mut(&l.slot.0).expect("rewrite of a live slot");
                assert_eq!(slot.gen, l.gen, "rewrite of a slot that changed");
                *slot = Located { slot: l.slot, gen: l.gen.next(), record: *rec };
            }
            for l in &c.free {
                assert!(self.slots.remove(&l.slot.0).is_some(), "double free");
            }
            for rec in &c.add {
                self.next += 1;
                self.slots.insert(
                    self.next,
                    Located { slot: SlotIndex(self.next), gen: Generation(0), record: *rec },
                );
            }
        }

        /// Runs a request to completion the way the protocol does (widening
        /// as told); returns whether it was granted.
        fn request(&mut self, q: &Request) -> Result<(), LockRecord> {
            let mut guard = q.range.widened();
            loop {
                match plan(q, &self.records(), guard) {
                    Plan::Widen(g) => {
                        assert!(g.contains(guard) && g != guard);
                        guard = g;
                    }
                    Plan::Conflict { blocker, drop_own } => {
                        self.apply(&drop_own);
                        return Err(blocker);
                    }
                    Plan::Apply(c) => {
                        self.apply(&c);
                        return Ok(());
                    }
                }
            }
        }
    }

    #[test]
    fn lock_split_merge_and_convert() {
        let mut t = Table::default();
        t.request(&req(1, Some(LockMode::Write), r(0, 99))).unwrap();
        // Unlocking the middle splits it.
        t.request(&req(1, None, r(40, 59))).unwrap();
        let mut ranges: Vec<_> = t.records().iter().map(|l| l.record.range).collect();
        ranges.sort_by_key(|x| x.start);
        assert_eq!(ranges, vec![r(0, 39), r(60, 99)]);
        // Re-locking the hole merges all three.
        t.request(&req(1, Some(LockMode::Write), r(40, 59))).unwrap();
        assert_eq!(t.records().len(), 1);
        assert_eq!(t.records()[0].record.range, r(0, 99));
        // Converting the middle to read splits into three of two modes.
        t.request(&req(1, Some(LockMode::Read), r(10, 19))).unwrap();
        let mut got: Vec<_> = t.records().iter().map(|l| (l.record.range, l.record.mode)).collect();
        got.sort_by_key(|x| x.0.start);
        assert_eq!(
            got,
            vec![(r(0, 9), LockMode::Write), (r(10, 19), LockMode::Read), (r(20, 99), LockMode::Write)]
        );
        // Another owner: reads overlap reads, not writes.
        assert!(t.request(&req(2, Some(LockMode::Read), r(12, 15))).is_ok());
        let blocker = t.request(&req(2, Some(LockMode::Write), r(15, 25))).unwrap_err();
        assert_eq!(blocker.owner, key(1));
        // A refused POSIX request changed nothing.
        assert_eq!(t.records().len(), 4);
    }

    #[test]
    fn adjacent_locks_merge_and_widening_is_asked_for() {
        let mut t = Table::default();
        t.request(&req(1, Some(LockMode::Read), r(0, 9))).unwrap();
        let q = req(1, Some(LockMode::Read), r(10, 19));
        // The guard of [10, 19] is [9, 20]: the record [0, 9] touches the
        // request and reaches outside, so the plan asks for [0, 20].
        assert_eq!(plan(&q, &t.records(), q.range.widened()), Plan::Widen(r(0, 20)));
        t.request(&q).unwrap();
        assert_eq!(t.records().len(), 1);
        assert_eq!(t.records()[0].record.range, r(0, 19));
    }

    #[test]
    fn to_end_of_file_and_whole_file() {
        let mut t = Table::default();
        t.request(&req(1, Some(LockMode::Write), ByteRange::to_eof(100))).unwrap();
        t.request(&req(1, None, r(200, 299))).unwrap();
        let mut ranges: Vec<_> = t.records().iter().map(|l| l.record.range).collect();
        ranges.sort_by_key(|x| x.start);
        assert_eq!(ranges, vec![r(100, 199), r(300, OFFSET_MAX)]);
        t.request(&req(1, None, ByteRange::whole_file())).unwrap();
        assert!(t.records().is_empty());
    }

    #[test]
    fn a_refused_flock_conversion_drops_the_old_lock() {
        let mut t = Table::default();
        let flock =
            |owner, mode| Request { flavor: LockFlavor::Flock, ..req(owner, mode, ByteRange::whole_file()) };
        t.request(&flock(1, Some(LockMode::Read))).unwrap();
        t.request(&flock(2, Some(LockMode::Read))).unwrap();
        // Owner 1's upgrade is refused by owner 2's shared lock, and owner 1
        // has lost its shared lock (Linux flock semantics).
        assert!(t.request(&flock(1, Some(LockMode::Write))).is_err());
        assert_eq!(t.records().len(), 1);
        assert_eq!(t.records()[0].record.owner, key(2));
        // flock and POSIX locks do not conflict.
        t.request(&req(3, Some(LockMode::Write), ByteRange::whole_file())).unwrap();
    }

    /// The owners' steps of the tmpfs run in `mount_semantics.rs`
    /// (`getlk_reports_the_lock_linux_reports`), with what Linux reported
    /// after each: the owner that came to hold locks first is reported
    /// first, an owner that dropped all its locks goes to the back, and
    /// within an owner the lowest start wins.
    #[test]
    fn getlk_reports_the_first_conflict_in_linux_list_order() {
        let mut t = Table::default();
        let getlk = |t: &Table| {
            let r = first_conflict(
                &t.records(),
                key(9),
                LockFlavor::Posix,
                LockMode::Write,
                ByteRange::whole_file(),
            )
            .expect("a conflict");
            (r.owner.owner.0, r.range.start, r.range.last - r.range.start + 1)
        };
        let (w, rd, un) = (Some(LockMode::Write), Some(LockMode::Read), None);
        let (p, q, o) = (1, 2, 3);
        // (owner, mode, first, last) requests, then F_GETLK's (owner, start, len).
        type Step<'a> = (&'a [(u64, Option<LockMode>, u64, u64)], (u64, u64, u64));
        let steps: &[Step] = &[
            (&[(p, w, 10, 14), (p, rd, 1, 5)], (p, 1, 5)),
            (&[(q, rd, 50, 54)], (p, 1, 5)),
            (&[(q, w, 0, 0)], (p, 1, 5)),
            (&[(p, un, 0, OFFSET_MAX)], (q, 0, 1)),
            (&[(p, w, 60, 60)], (q, 0, 1)),
            (&[(q, un, 50, 54)], (q, 0, 1)),
            (&[(q, un, 0, OFFSET_MAX), (q, w, 90, 90)], (p, 60, 1)),
            (&[(o, rd, 95, 95), (p, un, 0, OFFSET_MAX), (p, w, 70, 70)], (q, 90, 1)),
            (&[(q, w, 91, 91), (q, un, 90, 90)], (q, 91, 1)),
        ];
        for (i, (ops, want)) in steps.iter().enumerate() {
            for &(owner, mode, first, last) in *ops {
                t.request(&req(owner, mode, r(first, last))).unwrap();
            }
            assert_eq!(getlk(&t), *want, "after step {i}");
        }
        // Every record of one owner carries one place.
        for a in t.records() {
            for b in t.records() {
                if a.record.owner == b.record.owner {
                    assert_eq!(a.record.listed, b.record.listed);
                }
            }
        }
    }

    #[test]
    fn weakened_ranges_cover_releases_and_downgrades() {
        let mut t = Table::default();
        t.request(&req(1, Some(LockMode::Write), r(0, 99))).unwrap();
        let Plan::Apply(c) = plan(&req(1, Some(LockMode::Read), r(10, 19)), &t.records(), r(0, 100)) else {
            panic!()
        };
        assert_eq!(c.weakened, vec![r(10, 19)]);
        let Plan::Apply(c) = plan(&req(1, Some(LockMode::Write), r(0, 99)), &t.records(), r(0, 100)) else {
            panic!()
        };
        assert!(c.weakened.is_empty() && c.is_empty(), "re-locking what is held changes nothing: {c:?}");
        let Plan::Apply(c) = plan(&req(1, None, r(50, 200)), &t.records(), r(0, 201)) else { panic!() };
        assert_eq!(c.weakened, vec![r(50, 99)]);
    }

    /// The byte-level model: per owner, a map from byte to mode.
    type Model = BTreeMap<(u64, u64), LockMode>;

    fn model_apply(m: &mut Model, owner: u64, mode: Option<LockMode>, range: ByteRange) -> bool {
        if let Some(mode) = mode {
            for b in range.start..=range.last {
                for o in 0..4u64 {
                    if o != owner && m.get(&(o, b)).is_some_and(|held| !held.compatible(mode)) {
                        return false;
                    }
                }
            }
        }
        for b in range.start..=range.last {
            match mode {
                Some(mode) => m.insert((owner, b), mode),
                None => m.remove(&(owner, b)),
            };
        }
        true
    }

    proptest! {
        /// Any sequence of requests on small ranges leaves exactly the locks
        /// the byte-level model says, as non-overlapping, fully merged
        /// records; and a request is refused exactly when the model refuses it.
        #[test]
        fn matches_a_byte_level_model(ops in proptest::collection::vec((0u64..4, 0u8..3, 0u64..40, 0u64..12), 1..60)) {
            let mut t = Table::default();
            let mut model = Model::new();
            for (owner, m, start, len) in ops {
                let mode = match m { 0 => None, 1 => Some(LockMode::Read), _ => Some(LockMode::Write) };
                let range = r(start, start + len);
                let granted = t.request(&req(owner, mode, range)).is_ok();
                prop_assert_eq!(granted, model_apply(&mut model, owner, mode, range));
                // Records match the model byte for byte.
                let mut from_records = Model::new();
                for l in t.records() {
                    let o = l.record.owner.owner.0;
                    for b in l.record.range.start..=l.record.range.last {
                        prop_assert!(from_records.insert((o, b), l.record.mode).is_none(), "overlap");
                    }
                }
                prop_assert_eq!(&from_records, &model);
                // Fully merged: no two same-mode records of one owner touch.
                let recs = t.records();
                for a in &recs {
                    for b in &recs {
                        if a.slot != b.slot && a.record.owner == b.record.owner && a.record.mode == b.record.mode {
                            prop_assert!(!a.record.range.touches(b.record.range), "{:?} and {:?} not merged", a, b);
                        }
                    }
                }
            }
        }
    }

    /// The held locks of a table, by owner, range and mode.
    fn held(t: &Table) -> BTreeSet<(u64, u64, u64, bool)> {
        t.records()
            .iter()
            .map(|l| {
                (
                    l.record.owner.owner.0,
                    l.record.range.start,
                    l.record.range.last,
                    l.record.mode == LockMode::Write,
                )
            })
            .collect()
    }

    proptest! {
        /// An unlock to the end of the file narrowed to its owner's reach
        /// (as the protocol sends it) leaves exactly the locks the whole
        /// unlock leaves, and is skipped exactly when that changes nothing.
        #[test]
        fn a_narrowed_unlock_to_the_end_is_the_whole_unlock(
            ops in proptest::collection::vec((0u64..4, 0u8..3, 0u64..40, 0u64..12), 1..40),
            owner in 0u64..4,
            start in 0u64..50,
        ) {
            let mut t = Table::default();
            for (o, m, s, len) in ops {
                let mode = match m { 0 => None, 1 => Some(LockMode::Read), _ => Some(LockMode::Write) };
                let _ = t.request(&req(o, mode, r(s, s + len)));
            }
            let whole = req(owner, None, ByteRange::to_eof(start));
            let mut expected = t.clone();
            expected.request(&whole).unwrap();
            let mut narrowed = t.clone();
            match unlock_reach(&whole, &t.records()) {
                None => prop_assert_eq!(held(&t), held(&expected), "skipped, yet the whole unlock changed something"),
                Some(reach) => {
                    prop_assert!(whole.range.contains(reach));
                    prop_assert!(reach.last < OFFSET_MAX, "narrowed to what the owner holds");
                    narrowed.request(&Request { range: reach, ..whole }).unwrap();
                }
            }
            prop_assert_eq!(held(&narrowed), held(&expected));
        }
    }
}
