//! The locked data path (DESIGN.md §4, "Write and read paths"):
//!
//! * a read or write takes the file's inode mutex shared and a range lock
//!   over the bytes it touches, for the duration of the transfer, so
//!   overlapping I/O from different mounts never tears;
//! * truncate, a size-changing `setattr`, `fallocate` and `O_APPEND` writes
//!   take the inode mutex exclusive (the size cannot move under them);
//! * a write that extends the file updates the size and mtime words of its
//!   attribute slot under the file's ALock, which the meta-server's own
//!   threads take locally when they change those words (truncate,
//!   fallocate, utimens); it gives its range lock back first, so a wait
//!   for the ALock never counts against the range's lease. Readers clip to
//!   the published size, so the bytes of a write past the end appear with
//!   its size; a write that also overwrites bytes below the old end (it
//!   crosses the end) takes the inode mutex exclusive instead, so no read
//!   sees those bytes before the new size.
//!
//! * a write that reaches past its chunk's extent (DESIGN.md §5) asks the
//!   meta-server to move the chunk to a bigger extent, which frees the old
//!   one: it lets go of its locks and writes again with the inode mutex
//!   exclusive, so no I/O anywhere uses the old extent (every I/O reads the
//!   layout epoch under the mutex and refetches the layout when it moved).
//!
//! * the data verbs go out only within the range hold's lease H (the lock
//!   lease, from the acquisition): before each batch one clock read checks
//!   it, and a hold past H posts nothing more, is given back (late, which is
//!   fine) and the whole operation is done again under a fresh acquisition
//!   ([`Attempt::HoldExpired`]): rewriting the same bytes is idempotent, and
//!   re-reading is harmless, so the caller never sees it. This is half of
//!   the lease ordering (no takeover before a fence); the other half is the fence
//!   delay every takeover waits (see
//!   [`fence_delay_for`](crate::locks::guard::fence_delay_for)).
//!
//! * on the wire, an I/O posts as few batches as its locks allow (each is
//!   one round trip on tcp): the attribute slot read and the range lock's
//!   first reads ride on the inode mutex's acquisition, and the range
//!   hold, the mtime store and the inode mutex go back in one batch
//!   ([`FsClient::with_inode_lock_io`]); an extending write reads the size
//!   with the attribute ALock's acquisition and stores it with its release.
//!   Every verb keeps its place in the order of the one endpoint's verbs,
//!   which is what each lock's argument rests on.
//!
//! Lock order, the same everywhere: inode mutex, then range lock, then the
//! attribute ALock. Lock-record operations (fcntl) take only range locks, and
//! truncate takes no range lock, so no cycle can form.
//!
//! I/O needs the file open on this client: the lock memory it uses is lent
//! by the open ([`super::opens`]).

use citron_lock::lock_host::open_lock;
use std::time::Instant;

use citron_lock::rdma::{Verb, VerbError, VerbReply};
use citron_lock::rwlock::{execute_all, Algorithm, Mode, Riders, RwLockClient};

use super::layouts::{SlotWords, WriteUnder};
use super::opens::Pinned;
use super::{Endpoints, FsClient, Written};
use crate::error::FsError;
use crate::locks::guard::{RangeHold, RangePlan, Released};
use crate::locks::{ByteRange, LockArea};
use crate::proto::{AttrSlot, MAX_AHEAD_CHUNKS};
use crate::types::{
    perm_without_setid, Attr, Caller, ChunkIndex, Ino, SetAttr, Timestamp, MAX_FILE_SIZE, S_ISGID, S_ISUID,
};

/// How a write was asked for.
#[derive(Clone, Copy, Default)]
pub struct WriteMode<'a> {
    /// At the end of the file, whatever the offset (`O_APPEND`).
    pub append: bool,
    /// The writer lacks `CAP_FSETID` (`FUSE_WRITE_KILL_SUIDGID`): set-ID
    /// bits go before the data is written. Gives the writer's groups
    /// (filesystem gid and supplementary groups), asked for only when the
    /// file has a set-ID bit.
    pub unprivileged: Option<&'a dyn Fn() -> Vec<u32>>,
}

/// An inode mutex held for one operation.
struct InodeHold {
    lock: Box<dyn RwLockClient>,
}

/// What an I/O leaves for the batch that gives its inode mutex back
/// ([`FsClient::with_inode_lock_io`]).
#[derive(Default)]
struct Leftovers {
    /// A range hold whose data verbs all went out, to give back first.
    range: Option<RangeHold>,
    /// Writes to the meta-server's memory still to be made under the
    /// mutex (after the range went back, as the mtime of a write is).
    writes: Vec<Verb>,
}

/// What an I/O's inode mutex acquisition read ahead for it
/// ([`FsClient::with_inode_lock_io`]).
struct Ahead {
    /// The attribute slot (its address and words), read under the mutex.
    slot: Option<(AttrSlot, SlotWords)>,
    /// The range lock opened for the bytes the I/O was asked for, and the
    /// replies of its early reads with when they were posted.
    range: Option<(RangePlan, Option<EarlyReplies>)>,
}

/// Replies of a range lock's early reads, and when their batch was posted.
type EarlyReplies = (Instant, Vec<Result<VerbReply, VerbError>>);

impl Ahead {
    /// Takes the range lock of `area` over `bytes`, through the plan made
    /// ahead if there is one (the early reads are used only if they are
    /// those of `bytes`: the range lock checks).
    fn range_hold(
        &mut self,
        eps: &Endpoints,
        area: &LockArea,
        timing: &crate::locks::LockTiming,
        bytes: ByteRange,
    ) -> Result<RangeHold, FsError> {
        match self.range.take() {
            Some((plan, early)) => {
                let early = early.as_ref().map(|(posted, replies)| (*posted, replies.as_slice()));
                RangeHold::acquire_planned(&eps.meta, area, timing, bytes, plan, early)
            }
            None => RangeHold::acquire(&eps.meta, area, timing, bytes),
        }
    }
}

/// Bytes of one word of an attribute slot.
const WORD_BYTES: u32 = 8;

/// One attempt of a read or write under a range hold.
enum Attempt<T> {
    Done(T),
    /// The hold ran past its lease H before (some of) the data verbs; it
    /// was given back and the operation must be done again.
    HoldExpired,
}

/// Attempts one operation may make whose range holds all run past their
/// lease before it fails with EIO: each costs at least a lock lease, so
/// only a client that keeps stalling for that long gets there.
const HOLD_ATTEMPTS: u32 = 8;

/// Runs `attempt` until it is done, at most [`HOLD_ATTEMPTS`] times.
fn retrying_late_holds<T>(
    ino: Ino,
    what: &str,
    mut attempt: impl FnMut() -> Result<Attempt<T>, FsError>,
) -> Result<T, FsError> {
    for n in 1..=HOLD_ATTEMPTS {
        match attempt()? {
            Attempt::Done(t) => return Ok(t),
            Attempt::HoldExpired => {
                log::warn!(
                    "inode {}: a {what} held its range lock past its lease (attempt {n}); again",
                    ino.0
                )
            }
        }
    }
    Err(FsError::Io(format!(
        "inode {}: a {what} held its range lock past its lease {HOLD_ATTEMPTS} times",
        ino.0
    )))
}

/// Gives back a range hold after the data verbs: late is fine when every
/// verb went out within H (see [`RangeHold::release_after_verbs`]), and
/// when none must count (the operation is done again) any failure is only
/// logged: the next attempt's acquisition meets what caused it.
fn release_range(ep: &citron_lock::rdma::Endpoint, hold: RangeHold, verbs_sent: bool) -> Result<(), FsError> {
    release_range_then(ep, hold, verbs_sent, &[])
}

/// [`release_range`], with `after` (what the caller posts next on `ep`)
/// in the release's batch where the range lock allows.
fn release_range_then(
    ep: &citron_lock::rdma::Endpoint,
    hold: RangeHold,
    verbs_sent: bool,
    after: &[Verb],
) -> Result<(), FsError> {
    let bytes = hold.bytes();
    match hold.release_after_verbs_then(ep, after) {
        Ok(Released::OnTime) => Ok(()),
        Ok(Released::Late) if verbs_sent => {
            log::warn!(
                "a range lock over {bytes:?} was released after its lease; its verbs went out within it"
            );
            Ok(())
        }
        Ok(Released::Late) => Ok(()),
        Err(e) if !verbs_sent => {
            log::warn!("releasing a range lock over {bytes:?} held past its lease: {e}");
            Ok(())
        }
        Err(e) => Err(e),
    }
}

impl FsClient {
    /// The file's lock addresses, lent by this client's open of it and
    /// pinned for one call (its `area` is `None` only if the meta-server
    /// gave it none); an error if the file is not open here.
    /// A file created here by a create not sent yet gets them from its
    /// answer: the queue is sent first ([`super::late_changes`]).
    pub(super) fn pin(&self, ino: Ino) -> Result<Pinned, FsError> {
        self.pin_for(ino, None)
    }

    /// [`Self::pin`] for a write of `len` bytes at `offset` (`append`: at
    /// the end, which is 0 while the file's create is queued: every call
    /// that could change its size sends the queue first). A file whose
    /// create is still queued has the write's extents allocated with it
    /// (`LateCreate::first_write`): a create and its first write cost one
    /// call, not two.
    fn pin_for_write(&self, ino: Ino, offset: u64, len: u64, append: bool) -> Result<Pinned, FsError> {
        self.pin_for(ino, Some((if append { 0 } else { offset }, len)))
    }

    fn pin_for(&self, ino: Ino, write: Option<(u64, u64)>) -> Result<Pinned, FsError> {
        let pin = self.shared.opens.pin(ino, self.registration())?;
        if !pin.late {
            return Ok(pin);
        }
        drop(pin);
        let first_write = write.map_or_else(Vec::new, |(offset, len)| self.extents_of_write(offset, len));
        self.settle_late(ino, first_write);
        self.shared.opens.pin(ino, self.registration())
    }

    /// The extents a write of `len` bytes at `offset` needs (each chunk,
    /// and the bytes of it up to the write's end), as `AllocChunks` asks
    /// for them; none if the write is empty, past the largest file, or
    /// spans more chunks than one request may ask for.
    fn extents_of_write(&self, offset: u64, len: u64) -> Vec<(ChunkIndex, u64)> {
        if len == 0 || offset.saturating_add(len) > MAX_FILE_SIZE {
            return Vec::new();
        }
        let pieces = self.geometry.split(offset, len).take(MAX_AHEAD_CHUNKS + 1);
        let needs: Vec<_> = pieces.map(|p| (p.chunk, p.offset_in_chunk + p.len)).collect();
        if needs.len() > MAX_AHEAD_CHUNKS {
            return Vec::new();
        }
        needs
    }

    /// The lock area of a file open here (where its locks live), if it has
    /// one: for diagnostics and tests.
    pub fn lock_area(&self, ino: Ino) -> Result<Option<LockArea>, FsError> {
        Ok(self.pin(ino)?.area)
    }

    /// Takes the inode mutex of `area` in `mode`, with `riders` (reads of
    /// the meta-server's memory) riding on its acquisition: their replies
    /// if they ran under it ([`RwLockClient::acquire_with_reads`]).
    fn lock_inode(
        &self,
        eps: &Endpoints,
        area: &LockArea,
        mode: Mode,
        riders: &[Verb],
    ) -> Result<(InodeHold, Riders), FsError> {
        let mut lock = open_lock(
            area.inode_lock,
            &eps.meta,
            &self.lock_host,
            area.inode_mutex(),
            self.timing.mutex,
            &eps.locks,
        )?;
        let replies = lock.acquire_with_reads(&eps.meta, mode, riders)?;
        if mode == Mode::Exclusive {
            super::stop_hook::holding(super::stop_hook::Holding::InodeExclusive);
        }
        Ok((InodeHold { lock }, replies))
    }

    /// Gives the inode mutex back after `tail` (writes to the meta-server's
    /// memory made under it), in one batch where the lock can
    /// ([`RwLockClient::release_after`]); without a mutex, `tail` alone.
    fn unlock_inode(&self, eps: &Endpoints, hold: Option<InodeHold>, tail: &[Verb]) -> Result<(), FsError> {
        match hold {
            Some(mut h) => Ok(h.lock.release_after(&eps.meta, tail)?),
            None => Ok(execute_all(&eps.meta, tail)?),
        }
    }

    /// Gives back what an I/O holds, in the order of its locks' releases
    /// one after another: its range hold, then its writes, then the inode
    /// mutex; as one batch on the meta-server's endpoint where the locks
    /// allow (Citron's release batch ends with the rest, and a ShiftLock
    /// reader's release is one verb:
    /// [`RwLockClient::release_verbs`]). Each verb of the batch executes
    /// after the ones before it, so every lock still goes back only after
    /// what it guarded is done.
    fn unlock_io(
        &self,
        eps: &Endpoints,
        mut hold: Option<InodeHold>,
        left: Leftovers,
    ) -> Result<(), FsError> {
        let Some(range) = left.range else { return self.unlock_inode(eps, hold, &left.writes) };
        let mut after = left.writes;
        let inode_verbs = hold.as_mut().and_then(|h| h.lock.release_verbs());
        let detached = inode_verbs.is_some();
        after.extend(inode_verbs.unwrap_or_default());
        let released = release_range_then(&eps.meta, range, true, &after);
        let inode = if detached { Ok(()) } else { self.unlock_inode(eps, hold, &[]) };
        released.and(inode)
    }

    /// Runs `f` holding the inode mutex of `ino` (if it has lock memory) in
    /// `mode`, and releases it whatever `f` returns.
    fn with_inode_lock<R>(
        &self,
        eps: &mut Endpoints,
        area: Option<LockArea>,
        mode: Mode,
        f: impl FnOnce(&mut Endpoints) -> Result<R, FsError>,
    ) -> Result<R, FsError> {
        let hold = match &area {
            Some(a) => Some(self.lock_inode(eps, a, mode, &[])?.0),
            None => None,
        };
        let result = f(eps);
        let released = self.unlock_inode(eps, hold, &[]);
        let r = result?;
        released?;
        Ok(r)
    }

    /// [`FsClient::with_inode_lock`] for a read or write of `ino`, in as
    /// few round trips as the locks allow:
    ///
    /// * the read of the attribute slot every I/O makes rides on the
    ///   mutex's acquisition when the slot's address is known (the layout
    ///   is cached): `f` gets the slot as read under the mutex, or `None`
    ///   to read it itself;
    /// * `f` answers, beside its result, its [`Leftovers`]: a range hold
    ///   and writes to the meta-server's memory (the mtime of a write),
    ///   given back and posted in the batch that releases the mutex
    ///   ([`FsClient::unlock_io`]).
    ///
    /// Both keep the order of the verbs on the one endpoint of the
    /// meta-server (the slot read after the acquiring atomic, the writes
    /// before the releasing one), so `f` sees and leaves the same memory
    /// as with a verb of its own on either side.
    fn with_inode_lock_io<R>(
        &self,
        eps: &mut Endpoints,
        ino: Ino,
        area: Option<LockArea>,
        mode: Mode,
        range_guess: Option<ByteRange>,
        f: impl FnOnce(&mut Endpoints, Ahead) -> Result<(R, Leftovers), FsError>,
    ) -> Result<R, FsError> {
        let slot = area.and(self.cached_slot(ino));
        let mut riders: Vec<Verb> = slot.map(Self::slot_read_verb).into_iter().collect();
        // The range lock's first reads too, if it has some to make.
        let plan = match (&area, range_guess) {
            (Some(a), Some(bytes)) if mode == Mode::Shared && slot.is_some() => {
                Some(RangeHold::plan(a, &self.timing, bytes)?)
            }
            _ => None,
        };
        let early_at = riders.len();
        if let Some(p) = &plan {
            riders.extend(p.early.iter().cloned());
        }
        let posted = Instant::now();
        let (hold, replies) = match &area {
            Some(a) => {
                let (hold, replies) = self.lock_inode(eps, a, mode, &riders)?;
                (Some(hold), replies)
            }
            None => (None, None),
        };
        let read = match (slot, replies.as_deref()) {
            (Some(at), Some([Ok(VerbReply::Data(bytes)), ..])) => match SlotWords::decode(bytes) {
                Ok(words) => Some((at, words)),
                Err(_) => None,
            },
            _ => None,
        };
        let early = replies.filter(|r| r.len() > early_at).map(|mut r| (posted, r.split_off(early_at)));
        let ahead = Ahead { slot: read, range: plan.map(|p| (p, early)) };
        let (result, left) = match f(eps, ahead) {
            Ok((r, left)) => (Ok(r), left),
            Err(e) => (Err(e), Leftovers::default()),
        };
        let released = self.unlock_io(eps, hold, left);
        let r = result?;
        released?;
        Ok(r)
    }

    /// Reads up to `len` bytes at `offset`; short at end of file; holes read
    /// as zeros.
    pub fn read(&self, ino: Ino, offset: u64, len: u32) -> Result<Vec<u8>, FsError> {
        self.riding_out_restarts(|| {
            let pin = self.pin(ino)?;
            self.riding_through(|| self.read_once(&pin, ino, offset, len))
        })
    }

    /// One [`FsClient::read`], stopped by a data server that does not
    /// answer.
    fn read_once(&self, pin: &Pinned, ino: Ino, offset: u64, len: u32) -> Result<Vec<u8>, FsError> {
        let area = pin.area;
        retrying_late_holds(ino, "read", || {
            self.with_pinned_endpoints(pin, |eps| {
                // The bytes asked for: the range lock's early reads are
                // for them (the size may cut them short).
                let guess = guessed_range(offset, offset.saturating_add(len.into()));
                self.with_inode_lock_io(eps, ino, area, Mode::Shared, guess, |eps, mut ahead| {
                    let (layout, slot) = self.current_layout_read(eps, ino, ahead.slot)?;
                    let end = offset.saturating_add(len.into()).min(slot.size);
                    if offset >= end {
                        return Ok((Attempt::Done(Vec::new()), Leftovers::default()));
                    }
                    let range = match &area {
                        Some(a) => Some(ahead.range_hold(eps, a, &self.timing, byte_range(offset, end)?)?),
                        None => None,
                    };
                    let until = range.as_ref().map(RangeHold::until);
                    let data = self.read_data(eps, &layout, offset, end, until);
                    // A hold whose verbs all went out goes back with the
                    // inode mutex, in one batch.
                    let complete = matches!(data, Ok(Some(_)));
                    let range = match range {
                        Some(r) if !complete => {
                            release_range(&eps.meta, r, complete)?;
                            None
                        }
                        r => r,
                    };
                    let attempt = match data? {
                        Some(d) => Attempt::Done(d),
                        None => Attempt::HoldExpired,
                    };
                    Ok((attempt, Leftovers { range, writes: Vec::new() }))
                })
            })
        })
    }

    /// Writes `data` at `offset` (or at the end of the file with `append`)
    /// and returns the offset written at.
    pub fn write(&self, ino: Ino, offset: u64, data: &[u8], append: bool) -> Result<u64, FsError> {
        self.write_as(ino, offset, data, WriteMode { append, unprivileged: None })
    }

    /// [`FsClient::write`] as the kernel asked for it: a writer without
    /// `CAP_FSETID` first clears set-user/group-ID bits, as a local file
    /// system's write does. The permission bits come with the slot read
    /// every write makes, so this costs an RPC only when there is a bit
    /// to clear.
    pub fn write_as(&self, ino: Ino, offset: u64, data: &[u8], how: WriteMode) -> Result<u64, FsError> {
        self.riding_out_restarts(|| self.write_once(ino, offset, data, how))
    }

    fn write_once(&self, ino: Ino, offset: u64, data: &[u8], how: WriteMode) -> Result<u64, FsError> {
        let pin = self.pin_for_write(ino, offset, data.len() as u64, how.append)?;
        // A write the cached layout already shows must grow an extent goes
        // straight to the exclusive mutex it will need, without a shared
        // attempt that could only find that out.
        let exclusive = how.append || self.must_grow(ino, offset, data.len() as u64);
        let mode = if exclusive { Mode::Exclusive } else { Mode::Shared };
        let write_under =
            |mode| retrying_late_holds(ino, "write", || self.write_under(&pin, ino, mode, offset, data, how));
        self.riding_through(|| match write_under(mode)? {
            Some(at) => Ok(at),
            // An extent must grow, or it crosses the end: again, alone on
            // the file.
            None => write_under(Mode::Exclusive)?
                .ok_or_else(|| FsError::Io(format!("inode {}: a write found its extent too small", ino.0))),
        })
    }

    /// One attempt of [`FsClient::write`] holding the inode mutex in `mode`;
    /// `None` if it must be alone on the file (the mutex exclusive): a
    /// chunk's extent must grow first, or it overwrites the last bytes and
    /// extends the file;
    /// [`Attempt::HoldExpired`] if its range hold ran past its lease first.
    fn write_under(
        &self,
        pin: &Pinned,
        ino: Ino,
        mode: Mode,
        offset: u64,
        data: &[u8],
        how: WriteMode,
    ) -> Result<Attempt<Option<u64>>, FsError> {
        let WriteMode { append, unprivileged } = how;
        let exclusive = mode == Mode::Exclusive;
        let area = pin.area;
        self.with_pinned_endpoints(pin, |eps| {
            // The bytes of a write at its offset (an append's end is known
            // only under the mutex, which it holds exclusive: no range).
            let guess = match append {
                true => None,
                false => offset.checked_add(data.len() as u64).and_then(|end| guessed_range(offset, end)),
            };
            self.with_inode_lock_io(eps, ino, area, mode, guess, |eps, mut ahead| {
                let (layout, slot) = self.current_layout_read(eps, ino, ahead.slot)?;
                if let Some(groups_of) = unprivileged.filter(|_| slot.perm & (S_ISUID | S_ISGID) != 0) {
                    let groups = std::cell::OnceCell::new();
                    let in_group = || groups.get_or_init(groups_of).contains(&slot.gid);
                    if perm_without_setid(slot.perm, in_group) != slot.perm {
                        self.kill_suidgid(ino, groups.get_or_init(groups_of).clone())?;
                    }
                }
                let size = slot.size;
                let offset = if append { size } else { offset };
                let end = offset
                    .checked_add(data.len() as u64)
                    .filter(|e| *e <= MAX_FILE_SIZE)
                    .ok_or(FsError::FileTooBig)?;
                if data.is_empty() {
                    return Ok((Attempt::Done(Some(offset)), Leftovers::default()));
                }
                if !exclusive && offset < size && end > size {
                    // Across the end: its bytes below the old size would be
                    // read once its range goes back, before the new size is
                    // published (a write seen in part). Alone on the file,
                    // nobody reads until both are done.
                    return Ok((Attempt::Done(None), Leftovers::default()));
                }
                // Under the exclusive inode mutex no other I/O runs: no
                // range lock needed.
                let range = match (&area, exclusive) {
                    (Some(a), false) => {
                        Some(ahead.range_hold(eps, a, &self.timing, byte_range(offset, end)?)?)
                    }
                    _ => None,
                };
                if range.is_some() {
                    super::stop_hook::holding(super::stop_hook::Holding::Range);
                }
                let under = match exclusive {
                    true => WriteUnder::Exclusive,
                    false => WriteUnder::Shared { until: range.as_ref().map(RangeHold::until) },
                };
                let written = self.write_data(eps, ino, layout, offset, data, under);
                // The range goes back before the size is published: that
                // may wait for the attribute ALock, up to its recovery from
                // a failed holder (3/2 of the lock lease plus the fence
                // delay), which must not count against this range's own
                // lease H (no takeover before a fence). Readers clip to the published size,
                // so they see the new bytes only after it.
                // A write within the size publishes with one store, no
                // wait: its range then goes back with the inode mutex, in
                // one batch after its data verbs.
                let complete = matches!(written, Ok(Written::Done(_)));
                let (released, range) = match range {
                    Some(r) if complete && end <= size => (Ok(()), Some(r)),
                    Some(r) => (release_range(&eps.meta, r, complete), None),
                    None => (Ok(()), None),
                };
                let published = written.and_then(|w| match w {
                    Written::Done(l) => {
                        let slot = l.read().slot;
                        self.publish(eps, area.as_ref(), slot, end, size)
                            .map(|writes| (Attempt::Done(Some(offset)), writes))
                    }
                    Written::NeedsGrowth => Ok((Attempt::Done(None), Vec::new())),
                    Written::HoldExpired => Ok((Attempt::HoldExpired, Vec::new())),
                });
                let ((attempt, writes), range) = match (published, range) {
                    (Ok(p), range) => (p, range),
                    (Err(e), Some(r)) => {
                        release_range(&eps.meta, r, true)?;
                        return Err(e);
                    }
                    (Err(e), None) => {
                        released?;
                        return Err(e);
                    }
                };
                released?;
                Ok((attempt, Leftovers { range, writes }))
            })
        })
    }

    /// After a write that ended at `end`: the size grows to `end` if it was
    /// below (under the attribute ALock), and the mtime becomes now. What
    /// is left to write under the inode mutex is answered, for the batch
    /// that releases it.
    fn publish(
        &self,
        eps: &mut Endpoints,
        area: Option<&LockArea>,
        slot: AttrSlot,
        end: u64,
        size_seen: u64,
    ) -> Result<Vec<Verb>, FsError> {
        let now = Timestamp::now().as_nanos().to_le_bytes().to_vec();
        if end <= size_seen {
            // The size only ever grows under shared I/O, so it still covers
            // us: the mtime is one 8-byte store, which needs no wait of its
            // own before the mutex goes back (no lock orders it against
            // other writers' mtimes: the last store wins, as before).
            return Ok(vec![Verb::Write { addr: slot.mtime(), data: now }]);
        }
        let Some(area) = area else {
            // No lock memory: a CAS loop up to `end` (nothing else to exclude).
            let mut seen = size_seen;
            while seen < end {
                let old = eps.meta.cas(slot.size(), seen, end)?;
                if old == seen {
                    break;
                }
                seen = old;
            }
            return Ok(vec![Verb::Write { addr: slot.mtime(), data: now }]);
        };
        let mut alock = open_lock(
            Algorithm::ALock,
            &eps.meta,
            &self.lock_host,
            area.attr_lock(),
            self.timing.mutex,
            &eps.locks,
        )?;
        // The size read rides on the ALock's acquisition, and the stores go
        // in the batch that releases it (each in order with the lock's own
        // verbs: see `acquire_with_reads` and `release_after`).
        let size_read = [Verb::Read { addr: slot.size(), len: WORD_BYTES }];
        let replies = alock.acquire_with_reads(&eps.meta, Mode::Exclusive, &size_read)?;
        super::stop_hook::holding(super::stop_hook::Holding::AttrLock);
        let stores = (|| -> Result<Vec<Verb>, FsError> {
            let current = match replies.as_deref() {
                Some([Ok(VerbReply::Data(b))]) if b.len() == WORD_BYTES as usize => {
                    u64::from_le_bytes(b[..].try_into().expect("8 bytes"))
                }
                _ => eps.meta.read_u64(slot.size())?,
            };
            let mut verbs = Vec::with_capacity(2);
            if end > current {
                verbs.push(Verb::Write { addr: slot.size(), data: end.to_le_bytes().to_vec() });
            }
            verbs.push(Verb::Write { addr: slot.mtime(), data: now });
            Ok(verbs)
        })();
        let released = match &stores {
            Ok(verbs) => alock.release_after(&eps.meta, verbs),
            Err(_) => alock.release(&eps.meta),
        };
        stores?;
        released?;
        Ok(Vec::new())
    }

    /// Clears set-user/group-ID bits as a write or truncate by a process
    /// without `CAP_FSETID` and with `groups` (its filesystem gid and
    /// supplementary groups) does ([`perm_without_setid`]).
    pub fn kill_suidgid(&self, ino: Ino, groups: Vec<u32>) -> Result<Attr, FsError> {
        self.call_attr(&crate::proto::MetaRequest::KillSuidGid { ino, groups })
    }

    /// `setattr`; a size change (truncate) holds the inode mutex exclusive,
    /// and so an open of the file: `truncate(2)` of a file not open here
    /// opens it for the call.
    pub fn setattr(&self, caller: Caller, ino: Ino, set: SetAttr) -> Result<Attr, FsError> {
        let request = crate::proto::MetaRequest::SetAttr { caller, ino, set: set.clone() };
        if set.size.is_none() {
            return self.call_attr(&request);
        }
        self.while_open(caller, ino, libc::O_WRONLY, |pin| {
            self.with_pinned_endpoints(pin, |eps| {
                self.with_inode_lock(eps, pin.area, Mode::Exclusive, |_| self.call_attr(&request))
            })
        })
    }

    /// Runs `f` with the file's lock addresses pinned, opening the file for
    /// the call as `caller` with open(2) `flags` if it is not open here (its
    /// lock memory exists only while it is open somewhere, and in a keyed
    /// cluster a client may touch only the memory of files it has open).
    pub(super) fn while_open<R>(
        &self,
        caller: Caller,
        ino: Ino,
        flags: i32,
        f: impl FnOnce(&Pinned) -> Result<R, FsError>,
    ) -> Result<R, FsError> {
        if let Ok(pin) = self.pin(ino) {
            return f(&pin);
        }
        self.open_as(caller, ino, flags)?;
        let result = self.pin(ino).and_then(|pin| f(&pin));
        let released = self.release(ino);
        let r = result?;
        released?;
        Ok(r)
    }

    /// Allocates the chunks of `[offset, offset + len)` and, unless
    /// `keep_size`, grows the size to cover it; under the inode mutex
    /// exclusive.
    pub fn fallocate(&self, ino: Ino, offset: u64, len: u64, keep_size: bool) -> Result<(), FsError> {
        let pin = self.pin(ino)?;
        let area = pin.area;
        self.with_pinned_endpoints(&pin, |eps| {
            self.with_inode_lock(eps, area, Mode::Exclusive, |_| {
                self.call_done(&crate::proto::MetaRequest::Fallocate { ino, offset, len, keep_size })
            })
        })?;
        self.refresh_layout(ino)?;
        Ok(())
    }
}

/// The bytes `offset..end` as an inclusive range (`end > offset`).
/// The bytes `offset..end` as a range if there are any: what an I/O is
/// asked for, before the size is known.
fn guessed_range(offset: u64, end: u64) -> Option<ByteRange> {
    (end > offset).then(|| ByteRange::new(offset, end - 1)).flatten()
}

fn byte_range(offset: u64, end: u64) -> Result<ByteRange, FsError> {
    ByteRange::new(offset, end - 1).ok_or_else(|| FsError::Invalid(format!("bad byte range {offset}..{end}")))
}
