//! The chunk layouts of the files open here, cached and refetched when the
//! attribute slot's epoch or allocation generation moves, and the data
//! verbs that read and write chunk memory through them (Octopus's
//! client-active I/O, DESIGN.md §5).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use citron_lock::rdma::{Verb, VerbReply};
use parking_lot::RwLock;

use super::endpoints::Endpoints;
use super::{unexpected, FsClient};
use crate::error::FsError;
use crate::proto::{Allocated, AttrSlot, FileLayout, MetaRequest, MetaResponse, MAX_AHEAD_CHUNKS};
use crate::types::{Attr, ChunkIndex, ChunkLoc, DataServerId, Ino, Timestamp};

pub(super) struct CachedLayout {
    pub(super) slot: AttrSlot,
    pub(super) epoch: u64,
    pub(super) allocs: u64,
    pub(super) chunks: HashMap<ChunkIndex, ChunkLoc>,
}

impl CachedLayout {
    /// Puts in the extents an allocation of this client answered. When the
    /// cache was exactly the layout the allocation committed on (its epoch
    /// and generation just before the commit), it is now exactly the one
    /// after it, and the next I/O does not refetch the layout because of
    /// this client's own allocation: a writer that extends a file alone
    /// makes one RPC per new chunk instead of two, never fetches its whole
    /// (growing) chunk list, and a growth of the first chunk's extent costs
    /// one RPC instead of two. Otherwise the cache keeps its date, gains
    /// the new extents only if the commit moved nothing, and the next I/O
    /// refetches as before (the writer itself uses what it was given).
    pub(super) fn add_allocated(&mut self, allocated: &Allocated) {
        let exact = self.epoch == allocated.epoch_before && self.allocs == allocated.allocs_before;
        if exact {
            self.chunks.extend(allocated.chunks.iter().copied());
            self.epoch = allocated.epoch;
            self.allocs = allocated.allocs_after;
        } else if self.epoch == allocated.epoch {
            self.chunks.extend(allocated.chunks.iter().copied());
        }
    }
}

/// A regular file's attribute slot as one read saw it (see [`AttrSlot`]).
#[derive(Clone, Copy, Debug)]
pub(super) struct SlotWords {
    pub(super) size: u64,
    /// Nanoseconds since the epoch; zero until anyone wrote or set it.
    pub(super) mtime: u64,
    pub(super) epoch: u64,
    pub(super) allocs: u64,
    pub(super) perm: u16,
    pub(super) gid: u32,
}

/// What the caller of [`FsClient::write_data`] holds.
#[derive(Clone, Copy, Debug)]
pub(super) enum WriteUnder {
    /// The inode mutex exclusive: no other I/O runs, and a chunk's extent
    /// may move to a bigger one here.
    Exclusive,
    /// The inode mutex shared, and a range hold whose lease H runs out at
    /// `until` (`None`: the file has no lock memory, so no range lock).
    Shared { until: Option<Instant> },
}

/// What [`FsClient::write_data`] did.
pub(super) enum Written {
    Done(Arc<RwLock<CachedLayout>>),
    /// Nothing: a chunk's extent is too small and must move to a bigger one
    /// under the inode mutex exclusive.
    NeedsGrowth,
    /// The range hold's lease ran out before a batch of data verbs: that
    /// batch and the later ones were not posted (earlier ones were, within
    /// the lease); the write must be done again under a fresh hold.
    HoldExpired,
}

impl FsClient {
    /// Caches a layout fetched from the meta-server, never going back in
    /// time: threads of this client fetch concurrently, and a fetch sent
    /// before another thread's allocation may arrive after that thread
    /// added its chunks to the cache. Chunks are freed only with an epoch
    /// bump, so within one epoch the union of the cached and fetched maps is
    /// exact up to the larger allocation generation; a fetch of an older
    /// epoch than the cache's is stale and dropped.
    pub(super) fn install_layout(&self, l: FileLayout) -> Arc<RwLock<CachedLayout>> {
        let mut layouts = self.layouts.write();
        let mut chunks: HashMap<ChunkIndex, ChunkLoc> = l.chunks.into_iter().collect();
        let mut allocs = l.allocs;
        if let Some(old) = layouts.get(&l.ino) {
            let o = old.read();
            if o.epoch > l.epoch {
                return old.clone();
            }
            if o.epoch == l.epoch {
                for (c, loc) in &o.chunks {
                    chunks.entry(*c).or_insert(*loc);
                }
                allocs = allocs.max(o.allocs);
            }
        }
        let cached = Arc::new(RwLock::new(CachedLayout { slot: l.slot, epoch: l.epoch, allocs, chunks }));
        // Only open files' layouts are kept (the last release drops one).
        if self.shared.opens.get(l.ino).is_some() {
            layouts.insert(l.ino, cached.clone());
        }
        cached
    }

    pub(super) fn refresh_layout(&self, ino: Ino) -> Result<Arc<RwLock<CachedLayout>>, FsError> {
        match self.call(&MetaRequest::Layout { ino })? {
            MetaResponse::Layout(l) => Ok(self.install_layout(l)),
            other => Err(unexpected(other)),
        }
    }

    pub(super) fn layout(&self, ino: Ino) -> Result<Arc<RwLock<CachedLayout>>, FsError> {
        if let Some(l) = self.layouts.read().get(&ino) {
            return Ok(l.clone());
        }
        if let Some(l) = self.created_layout(ino) {
            return Ok(self.install_layout(l));
        }
        self.refresh_layout(ino)
    }

    /// Whether the cached layout of `ino` shows that writing `len` bytes at
    /// `offset` must move a chunk to a bigger extent (a hint: the layout
    /// may be stale either way, and [`FsClient::write_data`] decides).
    pub(super) fn must_grow(&self, ino: Ino, offset: u64, len: u64) -> bool {
        let Some(layout) = self.layouts.read().get(&ino).cloned() else { return false };
        let l = layout.read();
        self.geometry
            .split(offset, len)
            .any(|p| l.chunks.get(&p.chunk).is_some_and(|loc| loc.capacity < p.offset_in_chunk + p.len))
    }

    /// Reads the slot. One verb.
    pub(super) fn read_slot(eps: &Endpoints, slot: AttrSlot) -> Result<SlotWords, FsError> {
        let mut b = [0u8; AttrSlot::BYTES as usize];
        eps.meta.read(slot.0, &mut b)?;
        SlotWords::decode(&b)
    }

    /// The verb [`FsClient::read_slot`] posts, for a batch that carries it
    /// (see [`FsClient::cached_slot`]).
    pub(super) fn slot_read_verb(slot: AttrSlot) -> Verb {
        Verb::Read { addr: slot.0, len: AttrSlot::BYTES as u32 }
    }

    /// The attribute slot of `ino` if its layout is cached (a slot stays
    /// where it is for the inode's life), so that the slot read of an I/O
    /// can ride on its inode mutex acquisition; `None` costs nothing but
    /// that round trip.
    pub(super) fn cached_slot(&self, ino: Ino) -> Option<AttrSlot> {
        self.layouts.read().get(&ino).map(|l| l.read().slot)
    }

    /// [`FsClient::current_layout`] where the slot may have been read
    /// already, under the same locks, as `read` (its address and the words
    /// it answered): used only if it is the slot of the layout found now.
    pub(super) fn current_layout_read(
        &self,
        eps: &Endpoints,
        ino: Ino,
        read: Option<(AttrSlot, SlotWords)>,
    ) -> Result<(Arc<RwLock<CachedLayout>>, SlotWords), FsError> {
        let layout = self.layout(ino)?;
        let (slot, epoch, allocs) = {
            let l = layout.read();
            (l.slot, l.epoch, l.allocs)
        };
        let now = match read {
            Some((at, words)) if at == slot => words,
            _ => Self::read_slot(eps, slot)?,
        };
        if now.epoch != epoch || now.allocs != allocs {
            return Ok((self.refresh_layout(ino)?, now));
        }
        Ok((layout, now))
    }
}

impl SlotWords {
    /// The words of an attribute slot read whole.
    pub(super) fn decode(b: &[u8]) -> Result<Self, FsError> {
        if b.len() != AttrSlot::BYTES as usize {
            return Err(FsError::Io(format!("an attribute slot read answered {} bytes", b.len())));
        }
        let word =
            |off: u64| u64::from_le_bytes(b[off as usize..off as usize + 8].try_into().expect("8 bytes"));
        Ok(SlotWords {
            size: word(AttrSlot::SIZE),
            mtime: word(AttrSlot::MTIME),
            epoch: word(AttrSlot::EPOCH),
            allocs: word(AttrSlot::ALLOCS),
            perm: word(AttrSlot::PERM) as u16,
            gid: (word(AttrSlot::PERM) >> 32) as u32,
        })
    }
}

impl FsClient {
    /// The cached layout, refetched if chunks were freed (epoch) or
    /// allocated by anyone (allocation generation) since it was taken; and
    /// the slot as read.
    pub(super) fn current_layout(
        &self,
        eps: &Endpoints,
        ino: Ino,
    ) -> Result<(Arc<RwLock<CachedLayout>>, SlotWords), FsError> {
        self.current_layout_read(eps, ino, None)
    }

    /// `fsync`/`fdatasync` of regular file `ino`: every extent of the file
    /// on a data server whose memory is on a persistent path
    /// ([`DataServerInfo::durable`](crate::proto::DataServerInfo)) is
    /// flushed there ([`Verb::Flush`](citron_lock::rdma::Verb::Flush):
    /// `msync(MS_SYNC)` of the extent's range; whole extents, as the
    /// client keeps no record of which bytes it wrote). Every write already
    /// reached the data servers' memory before it answered, so that is all
    /// durability needs. One batch per such data server, none when there
    /// are none. Waits for a data server that does not answer as I/O does.
    pub fn fsync(&self, ino: Ino) -> Result<(), FsError> {
        self.riding_through(|| {
            self.with_endpoints(|eps| {
                let (layout, _) = self.current_layout(eps, ino)?;
                let durable: std::collections::HashSet<DataServerId> = {
                    let nodes = self.data_nodes.read();
                    nodes.iter().filter(|(_, (info, _))| info.durable).map(|(id, _)| *id).collect()
                };
                let verbs: Vec<(DataServerId, Verb, usize)> = layout
                    .read()
                    .chunks
                    .values()
                    .filter(|loc| durable.contains(&loc.server))
                    .enumerate()
                    .map(|(i, loc)| (loc.server, Verb::Flush { addr: loc.addr, len: loc.capacity }, i))
                    .collect();
                if verbs.is_empty() {
                    return Ok(());
                }
                self.execute_grouped(eps, verbs, None, None)?;
                Ok(())
            })
        })
    }

    /// Whether any data server of the cluster, as the meta-server lists
    /// them now, keeps its memory on a persistent path (so that `fsync` has
    /// something to do).
    pub fn any_durable_data_server(&self) -> Result<bool, FsError> {
        match self.call(&MetaRequest::DataServers)? {
            MetaResponse::DataServers(list) => {
                let durable = list.iter().any(|i| i.durable);
                self.add_data_servers(list)?;
                Ok(durable)
            }
            other => Err(unexpected(other)),
        }
    }

    /// The size of a regular file as its slot says (one verb).
    pub fn file_size(&self, ino: Ino) -> Result<u64, FsError> {
        self.with_endpoints(|eps| Ok(self.current_layout(eps, ino)?.1.size))
    }

    /// The attributes of regular file `base.ino`, open here, with what
    /// changes one-sidedly read now: the size and mtime from its slot (the
    /// ctime moves with the mtime, as the meta-server answers it) and the
    /// allocated bytes from its layout, refetched if anyone allocated or
    /// freed since it was cached. One verb, unless refetched. `None` if the
    /// file is not open here. `base`: the rest, granted (`Grant::live`).
    pub fn live_attr(&self, base: &Attr) -> Result<Option<Attr>, FsError> {
        if self.shared.opens.get(base.ino).is_none() {
            return Ok(None);
        }
        let (layout, words) = self.with_endpoints(|eps| self.current_layout(eps, base.ino))?;
        let mut attr = base.clone();
        attr.size = words.size;
        if words.mtime != 0 {
            attr.mtime = Timestamp::from_nanos(words.mtime);
            attr.ctime = attr.ctime.max(attr.mtime);
        }
        attr.allocated = layout.read().chunks.values().map(|c| c.capacity).sum();
        Ok(Some(attr))
    }

    /// Reads bytes `offset..end` (within the size) with one batch per data
    /// server; holes, and the part of a chunk past its extent, read as
    /// zeros. The caller holds the locks; a range hold's lease runs out at
    /// `until`, after which no batch is posted and the answer is `None`.
    pub(super) fn read_data(
        &self,
        eps: &mut Endpoints,
        layout: &Arc<RwLock<CachedLayout>>,
        offset: u64,
        end: u64,
        until: Option<Instant>,
    ) -> Result<Option<Vec<u8>>, FsError> {
        let pieces: Vec<_> = self.geometry.split(offset, end - offset).collect();
        let mut verbs = Vec::new();
        {
            let l = layout.read();
            for (i, p) in pieces.iter().enumerate() {
                let Some(loc) = l.chunks.get(&p.chunk) else { continue };
                let len = (p.offset_in_chunk + p.len).min(loc.capacity).saturating_sub(p.offset_in_chunk);
                if len > 0 {
                    let verb = Verb::Read { addr: loc.addr + p.offset_in_chunk, len: len as u32 };
                    verbs.push((loc.server, verb, i));
                }
            }
        }
        let Some(mut replies) = self.execute_grouped(eps, verbs, until, None)? else {
            return Ok(None);
        };
        let len = (end - offset) as usize;
        // One read that answered every byte (the common case: the range
        // within one chunk's extent) is the answer itself, not copied.
        if matches!(replies.as_slice(), [(_, VerbReply::Data(d))] if d.len() == len) {
            if let Some((_, VerbReply::Data(d))) = replies.pop() {
                return Ok(Some(d));
            }
        }
        let mut buf = vec![0u8; len];
        for (i, reply) in replies {
            let p = pieces[i];
            match reply {
                VerbReply::Data(d) if d.len() as u64 <= p.len => {
                    let at = p.buf_offset as usize;
                    buf[at..at + d.len()].copy_from_slice(&d)
                }
                other => return Err(FsError::Io(format!("unexpected read reply {other:?}"))),
            }
        }
        Ok(Some(buf))
    }

    /// Writes `data` at `offset` into the chunks' extents with one batch per
    /// data server, first giving chunks without one an extent. A chunk whose
    /// extent is too small for the write must move to a bigger one, which
    /// needs the inode mutex exclusive: [`WriteUnder::Exclusive`] (the
    /// caller holds it), the meta-server moves it here; else nothing is
    /// written and the answer is [`Written::NeedsGrowth`]. The caller holds
    /// the locks and publishes the size and mtime. Under a range hold whose
    /// lease runs out at `until`, no batch is posted after it (the extent
    /// RPCs above may take a while): the answer is [`Written::HoldExpired`].
    pub(super) fn write_data(
        &self,
        eps: &mut Endpoints,
        ino: Ino,
        mut layout: Arc<RwLock<CachedLayout>>,
        offset: u64,
        data: &[u8],
        under: WriteUnder,
    ) -> Result<Written, FsError> {
        let (may_grow, until) = match under {
            WriteUnder::Exclusive => (true, None),
            WriteUnder::Shared { until } => (false, until),
        };
        let pieces: Vec<_> = self.geometry.split(offset, data.len() as u64).collect();
        let needs: Vec<(ChunkIndex, u64)> =
            pieces.iter().map(|p| (p.chunk, p.offset_in_chunk + p.len)).collect();
        let asks_of = |layout: &Arc<RwLock<CachedLayout>>| -> Vec<(ChunkIndex, u64)> {
            let l = layout.read();
            needs
                .iter()
                .copied()
                .filter(|(c, end)| match l.chunks.get(c) {
                    None => true,
                    Some(loc) => may_grow && loc.capacity < *end,
                })
                .collect()
        };
        // The extents this write was given. Another thread of this client
        // may install a layout fetched before our allocation meanwhile (it
        // saw the allocation generation move), so they are not looked up
        // in the cache alone.
        let mut given: HashMap<ChunkIndex, ChunkLoc> = HashMap::new();
        if !asks_of(&layout).is_empty() {
            // One allocation of this client at a time: threads writing into
            // the same new chunk at once (ranks of a job sharing a file
            // through one mount) would each ask for it. The first asks; the
            // others find its extent in the cache once they get here.
            let _allocating = self.allocating.lock();
            layout = self.layout(ino)?;
            let asks = asks_of(&layout);
            if !asks.is_empty() {
                let request = if may_grow {
                    MetaRequest::GrowExtents { ino, chunks: asks }
                } else {
                    let ahead = chunks_ahead(&layout.read(), &asks);
                    MetaRequest::AllocChunks { ino, chunks: asks, ahead }
                };
                match self.call(&request)? {
                    MetaResponse::Chunks(allocated) => {
                        layout.write().add_allocated(&allocated);
                        given.extend(allocated.chunks);
                    }
                    other => return Err(unexpected(other)),
                }
                layout = self.layout(ino)?;
            }
        }
        let mut writes = Vec::with_capacity(pieces.len());
        let mut too_small = Vec::new();
        {
            let l = layout.read();
            for (i, (p, &(chunk, end))) in pieces.iter().zip(&needs).enumerate() {
                let loc = given
                    .get(&chunk)
                    .or_else(|| l.chunks.get(&chunk))
                    .ok_or_else(|| FsError::Io("chunk vanished".into()))?;
                if loc.capacity < end {
                    too_small.push((chunk, end));
                    continue;
                }
                let bytes = &data[p.buf_offset as usize..(p.buf_offset + p.len) as usize];
                writes.push((loc.server, (loc.addr + p.offset_in_chunk, bytes), i));
            }
        }
        if !too_small.is_empty() {
            if may_grow {
                return Err(FsError::Io(format!("inode {}: extents did not grow for {too_small:?}", ino.0)));
            }
            return Ok(Written::NeedsGrowth);
        }
        let stop_point = Some(super::stop_hook::Holding::RangeChecked);
        match self.write_grouped(eps, writes, until, stop_point)? {
            Some(_) => Ok(Written::Done(layout)),
            None => Ok(Written::HoldExpired),
        }
    }
}

/// The chunks to have allocated ahead of a writer that extends the file
/// chunk by chunk (see "Allocation ahead" in the meta-server's `extents`
/// module): when the last chunk `c` a write needs follows one the file
/// has (or the write also needs), the `min(c, MAX_AHEAD_CHUNKS)` chunks
/// after it, up to the first that has an extent. A writer thus calls for
/// chunks 1, 3, 7, 15, 31 and then one call per 17 chunks, instead of one
/// per chunk; a write into a hole far from the rest of the file asks for
/// nothing more.
fn chunks_ahead(layout: &CachedLayout, asks: &[(ChunkIndex, u64)]) -> Vec<ChunkIndex> {
    let Some(last) = asks.iter().map(|(c, _)| *c).max() else { return Vec::new() };
    let Some(before) = last.0.checked_sub(1).map(ChunkIndex) else { return Vec::new() };
    if !layout.chunks.contains_key(&before) && !asks.iter().any(|(c, _)| *c == before) {
        return Vec::new();
    }
    let n = last.0.min(MAX_AHEAD_CHUNKS as u64);
    (last.0 + 1..=last.0 + n).map(ChunkIndex).take_while(|c| !layout.chunks.contains_key(c)).collect()
}
