//! The byte-range lock protocol over one file's lock-record table
//! (DESIGN.md §4): every change is made under a range lock over the bytes
//! concerned, with one-sided verbs only; waiters are records too, and the
//! client that weakens a lock wakes the waiters it finds with a message.
//!
//! A request, in order:
//! 1. range-lock its bytes widened by one ([`RangeHold`]): every record that
//!    overlaps or touches it is now stable (the table rules);
//! 2. read the table; [`plan`] decides;
//! 3. `Widen`: release, lock the wider range, go to 2;
//! 4. `Conflict`: refuse, or register a waiting record (after the deadlock
//!    check of [`WaitsFor`]) that names the waiter's mailbox;
//! 5. `Apply`: claim slots for new records (CAS), write every change in one
//!    ordered batch, free the request's own waiting record;
//! 6. release the range lock; then message every waiter whose range
//!    overlaps a lock that got weaker.
//!
//! No lost wakeup: a waiter registers under a range lock over its request,
//! and a releaser looks for waiters under a range lock over what it
//! releases. If the two overlap, the range locks order them: either the
//! releaser sees the waiting record and sends the message, or the waiter's
//! check already sees the lock gone. A message that is lost anyway (its
//! sender died between the two) is covered by the waiter's periodic retry.

use std::collections::BTreeSet;

use citron_lock::rdma::{ClientAddr, Endpoint, RemoteAddr, Verb, VerbReply};
use serde::{Deserialize, Serialize};

use super::area::LockArea;
use super::guard::{LockTiming, RangeHold};
use super::plan::{first_conflict, plan, unlock_reach, Changes, Located, Plan, Request, SlotIndex};
use super::record::{Generation, ListSeq, LockRecord, RecordState};
use super::table::{self, Snapshot, TableGrowth};
use super::token::TokenWord;
use super::types::{ByteRange, LockFlavor, LockMode, OwnerKey, OFFSET_MAX};
use super::waits_for::{Checker, Published, Waiting, WaitsFor};
use crate::error::FsError;
use crate::types::{ClientId, Ino};

/// Client-to-client messages of the lock protocol.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum LockMessage {
    /// A lock on this file got weaker where you wait: try again.
    Wake { ino: Ino },
    /// Another client asks for this file: give its lock token up
    /// ([`super::token`]).
    Revoke { ino: Ino },
}

impl LockMessage {
    pub fn encode(&self) -> Vec<u8> {
        bincode::serialize(self).expect("a lock message always serialises")
    }

    pub fn decode(bytes: &[u8]) -> Result<Self, String> {
        bincode::deserialize(bytes).map_err(|e| format!("bad lock message: {e}"))
    }
}

/// A waiting record (and waits-for entry) a blocked request left behind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Registration {
    pub slot: SlotIndex,
    pub gen: Generation,
    pub published: Option<Published>,
}

/// How a blocked request waits.
#[derive(Clone, Copy, Debug)]
pub struct WaitSpec {
    /// Where releasers send [`LockMessage::Wake`].
    pub mailbox: ClientAddr,
    /// Left by an earlier attempt of the same request.
    pub registered: Option<Registration>,
}

/// How a request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Granted,
    /// Blocked, and not asked to wait (`F_SETLK`, `LOCK_NB`).
    Refused(LockRecord),
    /// Blocked; registered as a waiter.
    Waiting {
        blocker: LockRecord,
        registration: Registration,
    },
}

/// One file's locks, as one thread of one client reaches them.
pub struct FileLocks<'a> {
    pub ep: &'a Endpoint,
    pub client: ClientId,
    pub ino: Ino,
    pub area: LockArea,
    /// The table's first block.
    pub table: RemoteAddr,
    pub timing: &'a LockTiming,
    pub waits_for: WaitsFor,
    pub growth: &'a dyn TableGrowth,
}

/// What one look at the table under a range lock decided.
enum Step {
    Widen(ByteRange),
    Done(Result<Outcome, FsError>, Vec<ClientAddr>),
}

impl FileLocks<'_> {
    /// Takes, converts or releases (`req.mode == None`) a lock.
    pub fn set(&self, req: &Request, wait: Option<WaitSpec>) -> Result<Outcome, FsError> {
        // An unlock to the end of the file range-locks only where its owner
        // holds locks ([`unlock_reach`]): one table read first, instead of
        // a lock on the whole file.
        let narrowed;
        let req = match req.mode {
            None if wait.is_none() && req.range.last == OFFSET_MAX => {
                match unlock_reach(req, &table::read(self.ep, self.table)?.records()) {
                    None => return Ok(Outcome::Granted),
                    Some(range) => {
                        narrowed = Request { range, ..*req };
                        &narrowed
                    }
                }
            }
            _ => req,
        };
        let mut guard = req.range.widened();
        loop {
            let (hold, first_block) = self.acquire_reading_table(guard)?;
            let mut tail = Vec::new();
            let step = self.set_holding(req, wait, guard, first_block, &mut tail);
            let released = hold.release_after(self.ep, &tail);
            match step {
                Err(e) => return Err(e),
                Ok(Step::Widen(g)) => {
                    released?;
                    guard = g;
                }
                Ok(Step::Done(outcome, wakes)) => {
                    released?;
                    self.wake(&wakes);
                    return outcome;
                }
            }
        }
    }

    /// One look at the table under the range lock over `guard`. The table
    /// writes that end a decision are left in `tail`, for the batch that
    /// releases the range lock (they execute before its release verbs, so
    /// the next holder of any byte of `guard` reads them, as when they
    /// were waited for first); writes that other verbs under the lock must
    /// follow (a deadlock's withdrawal, a waiter's own) are made here.
    fn set_holding(
        &self,
        req: &Request,
        wait: Option<WaitSpec>,
        guard: ByteRange,
        first_block: Option<Vec<u8>>,
        tail: &mut Vec<Verb>,
    ) -> Result<Step, FsError> {
        let mut snapshot = table::read_from(self.ep, self.table, first_block)?;
        let records = snapshot.records();
        let mine = wait.and_then(|w| w.registered).filter(|r| self.still_registered(&records, req, r));
        match plan(req, &records, guard) {
            Plan::Widen(g) => Ok(Step::Widen(g)),
            Plan::Conflict { blocker, drop_own } => {
                let mut verbs = Vec::new();
                self.change_verbs(&mut snapshot, &drop_own, &mut verbs)?;
                let wakes = self.waiters_of(&records, &drop_own.weakened, mine.map(|m| m.slot));
                let Some(spec) = wait else {
                    *tail = verbs;
                    return Ok(Step::Done(Ok(Outcome::Refused(blocker)), wakes));
                };
                // A POSIX waiter checks for a deadlock before it waits
                // (published first: see `waits_for`).
                let published = match (req.flavor, mine.and_then(|m| m.published)) {
                    (LockFlavor::Posix, Some(p)) => Some(p),
                    (LockFlavor::Posix, None) => Some(self.waits_for.publish(
                        self.ep,
                        &Waiting {
                            owner: req.owner,
                            table: self.table,
                            range: req.range,
                            mode: mode_of(req),
                        },
                        self.growth,
                    )?),
                    _ => None,
                };
                if let Some(p) = published {
                    let blockers: Vec<OwnerKey> = records
                        .iter()
                        .filter(|l| l.record.blocks(req.owner, req.flavor, mode_of(req), req.range))
                        .map(|l| l.record.owner)
                        .collect::<BTreeSet<_>>()
                        .into_iter()
                        .collect();
                    let checker = if mine.is_some() { Checker::Waiting } else { Checker::Requesting };
                    if self.waits_for.closes_cycle(self.ep, req.owner, &blockers, checker)? {
                        if let Some(m) = mine {
                            verbs.push(table::free_verb(&snapshot, m.slot, m.gen)?);
                        }
                        table::execute(self.ep, &verbs)?;
                        self.waits_for.withdraw(self.ep, p)?;
                        return Ok(Step::Done(Err(FsError::Deadlock), wakes));
                    }
                }
                let registration = match mine {
                    Some(m) => Registration { published, ..m },
                    None => {
                        let record = LockRecord {
                            state: RecordState::Waiting,
                            mode: mode_of(req),
                            flavor: req.flavor,
                            owner: req.owner,
                            range: req.range,
                            pid: req.pid,
                            fh: req.fh,
                            mailbox: Some(spec.mailbox),
                            listed: ListSeq::default(),
                        };
                        let (slot, gen) = self.claim(&mut snapshot, &[])?;
                        table::write_verbs(&snapshot, slot, gen, &record, &mut verbs)?;
                        Registration { slot, gen, published }
                    }
                };
                *tail = verbs;
                Ok(Step::Done(Ok(Outcome::Waiting { blocker, registration }), wakes))
            }
            Plan::Apply(changes) => {
                let mut verbs = Vec::new();
                self.change_verbs(&mut snapshot, &changes, &mut verbs)?;
                if let Some(m) = mine {
                    verbs.push(table::free_verb(&snapshot, m.slot, m.gen)?);
                }
                match mine.and_then(|m| m.published) {
                    Some(p) => {
                        table::execute(self.ep, &verbs)?;
                        self.waits_for.withdraw(self.ep, p)?;
                    }
                    None => *tail = verbs,
                }
                let wakes = self.waiters_of(&records, &changes.weakened, mine.map(|m| m.slot));
                Ok(Step::Done(Ok(Outcome::Granted), wakes))
            }
        }
    }

    /// Range-locks `guard`, with the read of the table's first block
    /// riding on the acquisition where the range lock can carry it: its
    /// bytes, as read under the lock, or `None` (read it then).
    ///
    /// A lock token another client holds on the file ([`super::token`]) is
    /// revoked first, holding no range lock, and the range lock taken
    /// again: the table then holds every record of the file.
    fn acquire_reading_table(&self, guard: ByteRange) -> Result<(RangeHold, Option<Vec<u8>>), FsError> {
        loop {
            let (hold, first_block) = self.acquire_raw(guard)?;
            match TokenWord::of_block(&first_block) {
                Some(token) if token.holder != self.client => {
                    hold.release(self.ep)?;
                    self.await_revocation(token)?;
                }
                _ => return Ok((hold, Some(first_block))),
            }
        }
    }

    /// Range-locks `guard` and reads the table's first block under it
    /// (riding on the acquisition where the range lock can carry it).
    pub(super) fn acquire_raw(&self, guard: ByteRange) -> Result<(RangeHold, Vec<u8>), FsError> {
        let riders = [table::first_block_read(self.table)];
        let (hold, replies) =
            RangeHold::acquire_with_reads(self.ep, &self.area, self.timing, guard, &riders)?;
        let first_block = match replies.as_deref() {
            Some([Ok(VerbReply::Data(bytes))]) => bytes.clone(),
            _ => match table::read_first_block(self.ep, self.table) {
                Ok(bytes) => bytes,
                Err(e) => {
                    let _ = hold.release(self.ep);
                    return Err(e);
                }
            },
        };
        Ok((hold, first_block))
    }

    /// Whether `reg` still names the waiting record of this request.
    fn still_registered(&self, records: &[Located], req: &Request, reg: &Registration) -> bool {
        records.iter().any(|l| {
            l.slot == reg.slot
                && l.gen == reg.gen
                && l.record.state == RecordState::Waiting
                && l.record.owner == req.owner
                && l.record.range == req.range
        })
    }

    /// Claims a free slot, growing the table when none is left.
    fn claim(
        &self,
        snapshot: &mut Snapshot,
        taken: &[SlotIndex],
    ) -> Result<(SlotIndex, Generation), FsError> {
        for _ in 0..8 {
            if let Some(c) = table::claim(self.ep, snapshot, self.client, taken)? {
                return Ok(c);
            }
            // Full (or every free slot was taken meanwhile): one more block.
            self.growth.grow(snapshot.last_block())?;
            *snapshot = table::read(self.ep, self.table)?;
        }
        Err(FsError::NoLocks)
    }

    /// The verbs that carry out `changes` (claiming slots for new records).
    pub(super) fn change_verbs(
        &self,
        snapshot: &mut Snapshot,
        changes: &Changes,
        verbs: &mut Vec<Verb>,
    ) -> Result<(), FsError> {
        let mut taken = Vec::new();
        let mut claimed = Vec::new();
        for record in &changes.add {
            let (slot, gen) = self.claim(snapshot, &taken)?;
            taken.push(slot);
            claimed.push((slot, gen, *record));
        }
        for (l, record) in &changes.rewrite {
            table::write_verbs(snapshot, l.slot, l.gen.next(), record, verbs)?;
        }
        for (slot, gen, record) in &claimed {
            table::write_verbs(snapshot, *slot, *gen, record, verbs)?;
        }
        for l in &changes.free {
            verbs.push(table::free_verb(snapshot, l.slot, l.gen)?);
        }
        Ok(())
    }

    /// The mailboxes of waiters (other than `skip`) whose range overlaps one
    /// of `weakened`.
    fn waiters_of(
        &self,
        records: &[Located],
        weakened: &[ByteRange],
        skip: Option<SlotIndex>,
    ) -> Vec<ClientAddr> {
        let mut out: Vec<ClientAddr> = records
            .iter()
            .filter(|l| l.record.state == RecordState::Waiting && Some(l.slot) != skip)
            .filter(|l| weakened.iter().any(|w| w.overlaps(l.record.range)))
            .filter_map(|l| l.record.mailbox)
            .collect();
        out.sort();
        out.dedup();
        out
    }

    fn wake(&self, mailboxes: &[ClientAddr]) {
        let message = LockMessage::Wake { ino: self.ino }.encode();
        for &m in mailboxes {
            if let Err(e) = self.ep.send(m, &message) {
                // The waiter's periodic retry covers a lost wake-up.
                log::debug!("waking {m} for inode {}: {e}", self.ino.0);
            }
        }
    }

    /// The held lock that blocks `mode` on `range` for `owner` that Linux
    /// would report (`F_GETLK`: the first in the file's lock list, see
    /// [`first_conflict`]), under a range lock over `range`.
    pub fn get(
        &self,
        owner: OwnerKey,
        flavor: LockFlavor,
        mode: LockMode,
        range: ByteRange,
    ) -> Result<Option<LockRecord>, FsError> {
        let (hold, first_block) = self.acquire_reading_table(range)?;
        let found = table::read_from(self.ep, self.table, first_block)
            .map(|s| first_conflict(&s.records(), owner, flavor, mode, range));
        hold.release(self.ep)?;
        found
    }

    /// Withdraws a waiting request (interrupted, cancelled, or its owner
    /// went away): frees its waiting record if it is still there.
    pub fn cancel(&self, req: &Request, reg: Registration) -> Result<(), FsError> {
        let (hold, first_block) = self.acquire_reading_table(req.range)?;
        // The free goes in the release's batch (see `set_holding`).
        let free = (|| {
            let snapshot = table::read_from(self.ep, self.table, first_block)?;
            if self.still_registered(&snapshot.records(), req, &reg) {
                return Ok(vec![table::free_verb(&snapshot, reg.slot, reg.gen)?]);
            }
            Ok(Vec::new())
        })();
        let (result, tail) = match free {
            Ok(tail) => (Ok(()), tail),
            Err(e) => (Err(e), Vec::new()),
        };
        hold.release_after(self.ep, &tail)?;
        if let Some(p) = reg.published {
            self.waits_for.withdraw(self.ep, p)?;
        }
        result
    }

    /// Releases every held lock that `matches` (close of a POSIX owner,
    /// last close of an open file, a dead client) by unlocking each one's
    /// range for its owner; frees waiting records that match too. Returns
    /// how many records were released.
    pub fn release_matching(&self, matches: impl Fn(&LockRecord) -> bool) -> Result<usize, FsError> {
        let snapshot = table::read(self.ep, self.table)?;
        let mut released = 0;
        for l in snapshot.records().into_iter().filter(|l| matches(&l.record)) {
            let r = l.record;
            let req = Request {
                owner: r.owner,
                flavor: r.flavor,
                mode: None,
                range: r.range,
                pid: r.pid,
                fh: r.fh,
            };
            match r.state {
                RecordState::Held => {
                    self.set(&req, None)?;
                }
                RecordState::Waiting => {
                    self.cancel(&req, Registration { slot: l.slot, gen: l.gen, published: None })?;
                }
            }
            released += 1;
        }
        Ok(released)
    }
}

fn mode_of(req: &Request) -> LockMode {
    req.mode.unwrap_or(LockMode::Read)
}
