//! The extents that hold regular files' bytes ([`crate::extents`]): the
//! layout clients read, allocation and growth, truncation, `fallocate`,
//! `statfs`.
//!
//! Allocation is two-phase, so that the namespace lock is not held while
//! data-server memory is written: [`Namespace::plan_extents`] takes the
//! extents (under the lock), the service zeroes dirty memory and copies a
//! moving chunk's bytes (outside it), and [`Namespace::commit_extents`]
//! publishes them (under the lock again). No client can see an extent before
//! its commit, so none reads memory that is not yet zeroed; a commit that
//! finds the chunk changed meanwhile (another client's allocation won the
//! race, or the file went away) gives its extents back unused.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering::SeqCst;

use citronfs_core::proto::{Allocated, FileLayout};
use citronfs_core::types::{ChunkIndex, ChunkLoc, DataServerId, FsStats, Ino, Timestamp, MAX_FILE_SIZE};
use citronfs_core::FsError;

use super::Namespace;
use crate::extents::{extent_capacity, fitting_capacity, growth_capacity, AHEAD_RESERVE};
use crate::reclaim::Cause;

/// Memory of an extent that must be zeroed before the operation's answer is
/// given.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ZeroRange {
    pub loc: ChunkLoc,
    /// Where in the chunk (and so in the extent) the range starts.
    pub offset_in_chunk: u64,
    pub len: u64,
}

/// One chunk's new extent in an [`ExtentPlan`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExtentStep {
    pub chunk: ChunkIndex,
    /// The extent it replaces (a chunk that moves to a bigger one), or
    /// `None` for a chunk that had none.
    pub old: Option<ChunkLoc>,
    pub new: ChunkLoc,
    /// Bytes to copy from the start of `old` to the start of `new`.
    pub copy: u64,
    /// Whether `new`'s memory past `copy` may hold old bytes and must be
    /// zeroed before the commit.
    pub zero: bool,
    /// Allocated ahead of a sequential writer ([`Namespace::plan_ahead`]).
    pub ahead: bool,
}

/// Extents taken for one request, to be filled and then committed.
#[derive(Debug)]
pub struct ExtentPlan {
    pub ino: Ino,
    pub steps: Vec<ExtentStep>,
    /// Chunks asked for that keep the extent they have.
    pub ready: Vec<(ChunkIndex, ChunkLoc)>,
}

impl Namespace {
    /// The layout a client may cache. It carries the file's lock area only
    /// in the answer of an open (`with_locks`): a client holds lock
    /// addresses only while it has the file open ([`crate::lock_areas`]).
    pub(super) fn layout_for(&self, ino: Ino, with_locks: bool) -> Result<FileLayout, FsError> {
        let f = self.file(ino)?;
        if let Some(lost) = f.chunks.values().find(|l| self.lost_servers.contains(&l.server)) {
            return Err(FsError::Io(format!(
                "the data of inode {} was on data server {}, which is gone",
                ino.0, lost.server.0
            )));
        }
        Ok(FileLayout {
            ino,
            slot: f.slot,
            epoch: f.epoch,
            allocs: self.slots.word(f.slot.allocs()).load(SeqCst),
            chunks: f.chunks.iter().map(|(i, l)| (*i, *l)).collect(),
            locks: if with_locks { f.locks.as_ref().map(|l| l.area) } else { None },
        })
    }

    /// Data server `id` is gone with its memory: no extent is allocated on
    /// it any more, and the layout of every file with an extent there
    /// answers EIO; their epochs change, so clients holding a layout refetch
    /// it. Returns how many files lost data.
    pub fn lose_data_server(&mut self, id: DataServerId) -> usize {
        self.lost_servers.insert(id);
        self.server_changes.push(crate::journal::image::Change::LostServer(id));
        self.extents.set_available(id, false);
        self.bump_epochs_on(id)
    }

    /// Data server `id` came back with its memory (it re-adopted its data
    /// directory and registered under its identity): its extents are
    /// allocated from again, and if it had been lost its files answer
    /// again (their epochs change, so clients refetch their layouts).
    /// `discard` is how its pages are given back now. Returns how many
    /// files it had been lost for.
    pub fn rejoin_data_server(
        &mut self,
        id: DataServerId,
        discard: Option<crate::extents::Discard>,
    ) -> usize {
        self.extents.set_discard(id, discard);
        self.extents.set_available(id, true);
        if self.lost_servers.remove(&id) {
            self.server_changes.push(crate::journal::image::Change::FoundServer(id));
            self.bump_epochs_on(id)
        } else {
            0
        }
    }

    /// A data server that is down (silent, not lost): allocation cannot use
    /// its memory until it comes back.
    pub fn down_server(&self) -> Option<DataServerId> {
        self.extents.unavailable().into_iter().find(|id| !self.lost_servers.contains(id))
    }

    /// Moves the layout epoch of every file with an extent on `id`;
    /// returns how many there are.
    fn bump_epochs_on(&mut self, id: DataServerId) -> usize {
        let holding: Vec<Ino> = self
            .inodes
            .values()
            .filter(|i| matches!(&i.content, super::Content::File(f) if f.chunks.values().any(|l| l.server == id)))
            .map(|i| i.attr.ino)
            .collect();
        for ino in &holding {
            if let Ok(f) = self.file_mut(*ino) {
                f.epoch += 1;
                let (slot, epoch) = (f.slot, f.epoch);
                self.slots.word(slot.epoch()).store(epoch, SeqCst);
            }
        }
        holding.len()
    }

    /// The layout without lock addresses (`MetaRequest::Layout`).
    pub fn layout(&self, ino: Ino) -> Result<FileLayout, FsError> {
        self.layout_for(ino, false)
    }

    /// Takes extents so that each `(chunk, end)` of `wants` has one holding
    /// bytes `[0, end)` of the chunk: a chunk without an extent gets one
    /// ([`extent_capacity`]); a chunk whose extent is too small is moved to
    /// a bigger one only with `may_move` — the caller holds the file's inode
    /// mutex exclusive, so no I/O uses the old extent ([`crate::reclaim`]) —
    /// and is otherwise answered as it is (the client then asks again with
    /// the mutex exclusive). All or nothing: `NoSpace` takes nothing.
    pub fn plan_extents(
        &mut self,
        ino: Ino,
        wants: &[(ChunkIndex, u64)],
        may_move: bool,
    ) -> Result<ExtentPlan, FsError> {
        let cs = self.geometry.chunk_size();
        let max_chunk = MAX_FILE_SIZE / cs;
        let mut merged: BTreeMap<ChunkIndex, u64> = BTreeMap::new();
        for &(c, end) in wants {
            if c.0 >= max_chunk {
                return Err(FsError::FileTooBig);
            }
            if end == 0 || end > cs {
                return Err(FsError::Invalid(format!("extent end {end} outside a chunk of {cs}")));
            }
            let e = merged.entry(c).or_insert(0);
            *e = (*e).max(end);
        }
        let mut plan = ExtentPlan { ino, steps: Vec::new(), ready: Vec::new() };
        for (c, end) in merged {
            let current = self.file(ino)?.chunks.get(&c).copied();
            let (old, near) = match current {
                Some(loc) if loc.capacity >= end || !may_move => {
                    plan.ready.push((c, loc));
                    continue;
                }
                Some(loc) => (Some(loc), Some(loc.server)),
                None => (None, None),
            };
            let want = match old {
                Some(_) => growth_capacity(end, cs),
                None => extent_capacity(c, end, cs),
            };
            let Some(e) = self.extents.allocate(want, fitting_capacity(end, cs), near) else {
                self.abandon_extents(plan);
                return Err(FsError::NoSpace);
            };
            let copy = old.map_or(0, |o| o.capacity);
            plan.steps.push(ExtentStep { chunk: c, old, new: e.loc, copy, zero: e.dirty, ahead: false });
        }
        Ok(plan)
    }

    /// Adds to `plan` whole extents for the chunks of `ahead` that have
    /// none, while the data servers keep [`AHEAD_RESERVE`] of their memory
    /// free after it: a sequential writer's next chunks, taken in the same
    /// request as the one it needs now (see "Allocation ahead" in
    /// [`crate::extents`]). Best effort: stops at the first chunk that
    /// does not fit, and never fails. The dispatcher refuses more than
    /// `MAX_AHEAD_CHUNKS` before anything is planned.
    pub fn plan_ahead(&mut self, plan: &mut ExtentPlan, ahead: &[ChunkIndex]) {
        let cs = self.geometry.chunk_size();
        let max_chunk = MAX_FILE_SIZE / cs;
        let reserve = (self.extents.total_bytes() as f64 * AHEAD_RESERVE) as u64;
        for &c in ahead {
            let planned = plan.ready.iter().any(|(r, _)| *r == c) || plan.steps.iter().any(|s| s.chunk == c);
            let has = self.file(plan.ino).map_or(true, |f| f.chunks.contains_key(&c));
            if c.0 >= max_chunk || planned || has {
                continue;
            }
            if self.extents.free_bytes() < reserve + cs {
                break;
            }
            let Some(e) = self.extents.allocate(cs, cs, None) else { break };
            plan.steps.push(ExtentStep {
                chunk: c,
                old: None,
                new: e.loc,
                copy: 0,
                zero: e.dirty,
                ahead: true,
            });
        }
    }

    /// Frees the chunks of `ino` allocated ahead of a writer that are still
    /// past the end of the file, once no client has it open (`cause`: why
    /// the last open ended). Nobody holds the file's layout then, so no
    /// I/O can use those extents; the epoch still moves, as for a truncate.
    pub(super) fn trim_ahead(&mut self, ino: Ino, cause: Cause) {
        let cs = self.geometry.chunk_size();
        let Ok(f) = self.file(ino) else { return };
        if !f.opens.is_empty() || f.ahead.is_empty() {
            return;
        }
        let size = self.slots.word(f.slot.size()).load(SeqCst);
        let f = self.file_mut(ino).expect("found above");
        let past: Vec<ChunkLoc> = std::mem::take(&mut f.ahead)
            .into_iter()
            .filter(|c| c.0 * cs >= size)
            .filter_map(|c| f.chunks.remove(&c))
            .collect();
        if !past.is_empty() {
            self.give_back_chunks(ino, past, cause).expect("found above");
        }
    }

    /// Gives back `freed`, extents already taken out of `ino`'s chunks (a
    /// truncate's, or chunks ahead left past the end), and moves the
    /// layout epoch so that clients refetch the layout.
    fn give_back_chunks(&mut self, ino: Ino, freed: Vec<ChunkLoc>, cause: Cause) -> Result<(), FsError> {
        let f = self.file_mut(ino)?;
        f.allocated -= freed.iter().map(|l| l.capacity).sum::<u64>();
        f.epoch += 1;
        let (slot, epoch) = (f.slot, f.epoch);
        for loc in freed {
            self.reclaim.extent(&mut self.extents, loc, cause);
        }
        self.slots.word(slot.epoch()).store(epoch, SeqCst);
        Ok(())
    }

    /// Gives back the extents of a plan that will not be committed.
    pub fn abandon_extents(&mut self, plan: ExtentPlan) {
        for s in plan.steps {
            self.reclaim.extent(&mut self.extents, s.new, Cause::Unused);
        }
    }

    /// Publishes a plan whose memory is ready (zeroed, copied): each step's
    /// extent replaces the one it planned to, if that is still the chunk's;
    /// a moved chunk's old extent goes back and the layout epoch moves.
    /// Answers every chunk of the plan as it now is.
    pub fn commit_extents(&mut self, plan: ExtentPlan) -> Result<Allocated, FsError> {
        let ExtentPlan { ino, steps, ready } = plan;
        if self.file(ino).is_err() {
            for s in steps {
                self.reclaim.extent(&mut self.extents, s.new, Cause::Unused);
            }
            return Err(FsError::NotFound);
        }
        // A chunk asked for by name is no longer speculative.
        let f = self.file_mut(ino).expect("checked above");
        for (c, _) in &ready {
            f.ahead.remove(c);
        }
        let mut out = ready;
        let (mut grew, mut moved) = (false, false);
        for s in steps {
            let f = self.file_mut(ino).expect("checked above");
            let current = f.chunks.get(&s.chunk).copied();
            if current != s.old {
                // Lost a race (another allocation of the chunk committed
                // first): ours was never seen.
                out.extend(current.map(|c| (s.chunk, c)));
                self.reclaim.extent(&mut self.extents, s.new, Cause::Unused);
                continue;
            }
            f.chunks.insert(s.chunk, s.new);
            f.allocated += s.new.capacity;
            if s.ahead {
                f.ahead.insert(s.chunk);
            } else {
                f.ahead.remove(&s.chunk);
            }
            grew = true;
            out.push((s.chunk, s.new));
            if let Some(old) = s.old {
                f.allocated -= old.capacity;
                moved = true;
                self.reclaim.extent(&mut self.extents, old, Cause::Moved);
            }
        }
        let f = self.file_mut(ino).expect("checked above");
        let slot = f.slot;
        let epoch_before = f.epoch;
        if moved {
            f.epoch += 1;
        }
        let epoch = f.epoch;
        if moved {
            // Clients with an older layout refetch it (see `AttrSlot`).
            self.slots.word(slot.epoch()).store(epoch, SeqCst);
        }
        let allocs = self.slots.word(slot.allocs());
        // Under the namespace mutex, like every other change of the
        // generation, so no commit falls between the two values.
        let allocs_before = match grew {
            true => allocs.fetch_add(1, SeqCst),
            false => allocs.load(SeqCst),
        };
        out.sort_by_key(|(c, _)| *c);
        Ok(Allocated {
            chunks: out,
            epoch_before,
            epoch,
            allocs_before,
            allocs_after: allocs_before + u64::from(grew),
        })
    }

    /// Sets the size (truncate). Shrinking frees the extents of chunks past
    /// the end, returns the tail of the last one to zero, and bumps the epoch
    /// so clients refetch their layouts.
    pub(super) fn set_size(&mut self, ino: Ino, size: u64) -> Result<Vec<ZeroRange>, FsError> {
        self.with_attr_lock(ino, |ns| ns.set_size_locked(ino, size))
    }

    fn set_size_locked(&mut self, ino: Ino, size: u64) -> Result<Vec<ZeroRange>, FsError> {
        if size > MAX_FILE_SIZE {
            return Err(FsError::FileTooBig);
        }
        let cs = self.geometry.chunk_size();
        let f = self.file(ino)?;
        let slot = f.slot;
        let old = self.slots.word(slot.size()).load(SeqCst);
        let mut zero = Vec::new();
        if size < old {
            let keep = self.geometry.chunks_for_size(size);
            let f = self.file_mut(ino)?;
            let freed: Vec<ChunkLoc> = f.chunks.split_off(&ChunkIndex(keep)).into_values().collect();
            f.ahead.retain(|c| c.0 < keep);
            if !size.is_multiple_of(cs) {
                if let Some(loc) = f.chunks.get(&ChunkIndex(size / cs)) {
                    let from = size % cs;
                    if from < loc.capacity {
                        zero.push(ZeroRange { loc: *loc, offset_in_chunk: from, len: loc.capacity - from });
                    }
                }
            }
            self.give_back_chunks(ino, freed, Cause::Truncated)?;
        }
        self.slots.word(slot.size()).store(size, SeqCst);
        self.slots.word(slot.mtime()).store(Timestamp::now().as_nanos(), SeqCst);
        Ok(zero)
    }

    /// The extents `fallocate` of `[offset, offset + len)` needs (the
    /// caller holds the inode mutex exclusive, so chunks may move).
    pub fn plan_fallocate(&mut self, ino: Ino, offset: u64, len: u64) -> Result<ExtentPlan, FsError> {
        let end = offset.checked_add(len).filter(|e| *e <= MAX_FILE_SIZE).ok_or(FsError::FileTooBig)?;
        if len == 0 {
            return Err(FsError::Invalid("fallocate of zero bytes".into()));
        }
        let cs = self.geometry.chunk_size();
        let wants: Vec<(ChunkIndex, u64)> = (self.geometry.chunk_of(offset).0
            ..=self.geometry.chunk_of(end - 1).0)
            .map(|c| (ChunkIndex(c), (end - c * cs).min(cs)))
            .collect();
        self.plan_extents(ino, &wants, true)
    }

    /// After `fallocate`'s extents are committed: the size grows to cover
    /// `[offset, offset + len)` unless `keep_size`.
    pub fn fallocate_size(
        &mut self,
        ino: Ino,
        offset: u64,
        len: u64,
        keep_size: bool,
    ) -> Result<(), FsError> {
        if !keep_size {
            let end = offset + len;
            let slot = self.file(ino)?.slot;
            self.with_attr_lock(ino, |ns| ns.slots.word(slot.size()).fetch_max(end, SeqCst));
        }
        Ok(())
    }

    /// `statfs`: an orphan's extents count as free, since an allocation
    /// that needs them frees the orphan at once.
    pub fn stats(&self) -> FsStats {
        FsStats {
            chunk_size: self.geometry.chunk_size(),
            total_bytes: self.extents.total_bytes(),
            free_bytes: self.extents.free_bytes() + self.orphan_bytes(),
            inodes: self.inodes.len() as u64,
            max_inodes: self.inodes.len() as u64 - self.slots.in_use() + self.slots.capacity(),
        }
    }
}
