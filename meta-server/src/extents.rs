//! Space for file data (DESIGN.md §5): extents of data-server memory, sized
//! near what a file holds.
//!
//! # The design
//!
//! A file is still cut into chunks (1 MiB by default), and chunk `i` of a
//! file is still one contiguous piece of one data server's memory, read and
//! written with one-sided verbs. What changed is that the piece need not be
//! a whole chunk: it is an *extent* of a power-of-two capacity (4 KiB up to
//! the chunk size) that holds bytes `[0, capacity)` of the chunk; the
//! chunk's bytes past it read zero ([`citronfs_core::types::ChunkLoc`]).
//! Each data server's region is managed by a buddy allocator
//! ([`crate::buddy`]) whose largest block is a chunk, so
//! * a file of 4 KiB takes 4 KiB (262,144 files per GiB instead of 1,024),
//!   a file of 5 KiB takes 8 KiB, a file of a chunk or more takes whole
//!   chunks as before, and a full chunk is exactly the chunk it used to be:
//!   large I/O keeps one verb per chunk and its bandwidth;
//! * free space coalesces: deleting small files gives back whole chunks.
//!
//! Sizing ([`extent_capacity`]): the first chunk of a file gets the smallest
//! extent that holds what is written into it; any later chunk gets a whole
//! chunk (a file past one chunk is a big file, and growing its every chunk
//! through 4 KiB, 8 KiB, … would copy each one eight times), falling back to
//! the smallest extent that fits when no whole chunk is free
//! ([`ExtentAllocator::allocate`]). Waste is under half of a small file
//! written at once and under one chunk of a big one.
//!
//! Growth: a write past its extent's capacity, inside the chunk, moves the
//! chunk to a bigger extent — allocate, copy, swap in the file's map, bump
//! the file's layout epoch, free the old one — while the writer holds the
//! file's inode mutex exclusive, so no I/O anywhere uses the old extent (every
//! I/O takes the mutex shared and reads the epoch under it;
//! `citronfs_core::client::io`). The new extent has room for twice what the
//! write needs ([`growth_capacity`]): a chunk that grew once is being
//! appended to, and a database's journal written in a few pieces then moves
//! once, not once per power of two it crosses (a file grown by appends
//! wastes under three quarters of its extent). The meta-server does the
//! copy (one RPC for the writer; the growth of one chunk copies less than
//! the chunk, and a file that grows by doubling copies less than its final
//! size in total).
//!
//! Why not the alternatives: packing small files into shared chunks would
//! need a sub-chunk allocator anyway plus per-file offsets, and would tie
//! unrelated files' space together (a chunk is freed only when all its files
//! are); size classes without coalescing (slabs) cannot give back whole
//! chunks after small files are deleted, so a data server that once held
//! many small files could no longer hold a big one. Small chunk sizes for
//! everything would multiply the verbs of large I/O.
//!
//! Dirty memory: a block never handed out is zero (fresh memory); a freed
//! block is dirty and is zeroed before a client may read it
//! ([`Extent::dirty`]), except where the meta-server can give its pages back
//! instead ([`Discard`]: punching a hole in a shm-published region, which
//! returns the memory to the host and reads zero after) — done when a freed
//! block has merged into a whole chunk.
//!
//! Allocation ahead: a writer that extends a file chunk by chunk would
//! make one meta-server call per chunk, each paid in the write's latency
//! (1 GiB in 1 MiB O_DIRECT writes through a shm mount: 745 MB/s with a
//! call per chunk, 930–950 MB/s with the calls below). Its client asks
//! for the chunks it expects to fill next along with the one it needs
//! (`AllocChunks::ahead`, as many as the file already has, up to
//! `MAX_AHEAD_CHUNKS`), so calls grow logarithmically up to one per 16
//! chunks. The meta-server takes them only while [`AHEAD_RESERVE`] of the
//! data servers' memory stays free (a nearly full cluster gives its last
//! memory to writes, not guesses), marks them, and at the file's last close
//! frees those still wholly past its end. So the speculation never
//! outlives the writer: a file closed everywhere holds what its size needs
//! (and what `fallocate` asked for), as without it. While it is open, its
//! allocated bytes (`st_blocks`) include the chunks ahead, as XFS's
//! speculative preallocation does.
//!
//! Every free goes through the reclamation point ([`crate::reclaim`]).

use citron_lock::rdma::{RegionId, RemoteAddr};
use citronfs_core::types::{ChunkIndex, ChunkLoc, DataServerId};

use crate::buddy::Buddy;

/// The share of the data servers' memory that chunks allocated ahead of a
/// writer never take (see the module comment).
pub const AHEAD_RESERVE: f64 = 0.25;

/// The smallest extent: one page.
pub const MIN_EXTENT: u64 = 4096;

/// The capacity an extent of chunk `chunk` should have to hold bytes
/// `[0, end_in_chunk)` of it (see the module comment): the first chunk of a
/// file grows by powers of two from [`MIN_EXTENT`], later ones are whole.
pub fn extent_capacity(chunk: ChunkIndex, end_in_chunk: u64, chunk_size: u64) -> u64 {
    if chunk.0 > 0 {
        return chunk_size;
    }
    fitting_capacity(end_in_chunk, chunk_size)
}

/// The capacity a chunk moves to when a write needs bytes `[0,
/// end_in_chunk)` of it and its extent holds fewer (see "Growth" in the
/// module comment): room for twice that, up to the whole chunk.
pub fn growth_capacity(end_in_chunk: u64, chunk_size: u64) -> u64 {
    fitting_capacity(end_in_chunk.saturating_mul(2), chunk_size)
}

/// The smallest extent capacity that holds `[0, end_in_chunk)`.
pub fn fitting_capacity(end_in_chunk: u64, chunk_size: u64) -> u64 {
    end_in_chunk.max(MIN_EXTENT).next_power_of_two().min(chunk_size)
}

/// Gives the pages of `[offset, offset + len)` of a server's region back to
/// the host so that they read zero; `false` if it could not.
pub type Discard = Box<dyn FnMut(u64, u64) -> bool + Send>;

/// An extent handed out, and whether its memory must be zeroed before a
/// client may read it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    pub loc: ChunkLoc,
    pub dirty: bool,
}

struct ServerSpace {
    id: DataServerId,
    region: RegionId,
    buddy: Buddy,
    extents: u64,
    discard: Option<Discard>,
    /// Whether new extents may go there: not while the server is down
    /// (it stopped answering) or lost ([`ExtentAllocator::set_available`]).
    available: bool,
}

/// One data server's space ([`ExtentAllocator::servers`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DataServerSpace {
    pub id: DataServerId,
    pub capacity: u64,
    pub free: u64,
    pub extents: u64,
    /// The largest extent an allocation could get now.
    pub largest_free: u64,
}

/// Extents over every registered data server.
pub struct ExtentAllocator {
    chunk_size: u64,
    servers: Vec<ServerSpace>,
    /// Round-robin start, so new files spread over servers.
    cursor: usize,
}

impl ExtentAllocator {
    pub fn new(chunk_size: u64) -> Self {
        assert!(chunk_size.is_power_of_two() && chunk_size >= MIN_EXTENT, "chunk size {chunk_size}");
        Self { chunk_size, servers: Vec::new(), cursor: 0 }
    }

    /// Adds a server offering `capacity` bytes of `region` from offset 0;
    /// `discard`, if it can give pages back (see the module comment).
    pub fn add_server(
        &mut self,
        id: DataServerId,
        region: RegionId,
        capacity: u64,
        discard: Option<Discard>,
    ) {
        let min = MIN_EXTENT.trailing_zeros();
        let max = self.chunk_size.trailing_zeros();
        let buddy = Buddy::new(0, capacity, min, max);
        self.servers.push(ServerSpace { id, region, buddy, extents: 0, discard, available: true });
    }

    /// Whether new extents may go to server `id`. A server that is down
    /// or lost keeps its extents, in use and free, and their bookkeeping
    /// (freeing one works as ever), so that it can come back as it was;
    /// only allocation skips it, and its space does not count in
    /// [`ExtentAllocator::total_bytes`] and [`ExtentAllocator::free_bytes`].
    pub fn set_available(&mut self, id: DataServerId, available: bool) {
        if let Some(s) = self.servers.iter_mut().find(|s| s.id == id) {
            s.available = available;
        }
    }

    /// The servers allocation skips ([`ExtentAllocator::set_available`]).
    pub fn unavailable(&self) -> Vec<DataServerId> {
        self.servers.iter().filter(|s| !s.available).map(|s| s.id).collect()
    }

    /// The region and capacity of server `id`, if it was ever added.
    pub fn server_memory(&self, id: DataServerId) -> Option<(RegionId, u64)> {
        self.servers.iter().find(|s| s.id == id).map(|s| (s.region, s.buddy.total_bytes()))
    }

    /// How server `id` gives pages back now (a server that came back
    /// publishes its region anew).
    pub fn set_discard(&mut self, id: DataServerId, discard: Option<Discard>) {
        if let Some(s) = self.servers.iter_mut().find(|s| s.id == id) {
            s.discard = discard;
        }
    }

    /// Takes the extent `loc` out of the free space of its server (an
    /// extent a file held before a restart); `false` if it is not free
    /// there (it overlaps another, or the server is unknown).
    pub fn claim(&mut self, loc: ChunkLoc) -> bool {
        let Some(s) = self.servers.iter_mut().find(|s| s.id == loc.server) else { return false };
        let order = loc.capacity.trailing_zeros();
        if loc.addr.region != s.region
            || !loc.capacity.is_power_of_two()
            || !s.buddy.claim(loc.addr.offset, order)
        {
            return false;
        }
        s.extents += 1;
        true
    }

    /// Every free block of server `id` may hold old bytes (its memory was
    /// used before a restart), so each is zeroed before it is handed out.
    pub fn mark_free_dirty(&mut self, id: DataServerId) {
        if let Some(s) = self.servers.iter_mut().find(|s| s.id == id) {
            s.buddy.mark_all_dirty();
        }
    }

    pub fn chunk_size(&self) -> u64 {
        self.chunk_size
    }

    /// An extent of `capacity` bytes, or if none is free anywhere, of the
    /// smallest capacity at least `at_least`; `None` when not even that
    /// fits. `near` is tried first (a chunk that moves stays on its server).
    pub fn allocate(&mut self, capacity: u64, at_least: u64, near: Option<DataServerId>) -> Option<Extent> {
        let want = fitting_capacity(capacity, self.chunk_size);
        let least = fitting_capacity(at_least, self.chunk_size).min(want);
        for size in [want, least] {
            if let Some(e) = self.allocate_exactly(size, near) {
                return Some(e);
            }
            if size == least {
                break;
            }
        }
        None
    }

    fn allocate_exactly(&mut self, capacity: u64, near: Option<DataServerId>) -> Option<Extent> {
        let order = capacity.trailing_zeros();
        let n = self.servers.len();
        let first = near.and_then(|id| self.servers.iter().position(|s| s.id == id));
        let order_of_visit = first.into_iter().chain((0..n).map(|i| (self.cursor + i) % n));
        for idx in order_of_visit {
            let s = &mut self.servers[idx];
            if !s.available {
                continue;
            }
            let Some(block) = s.buddy.allocate(order) else { continue };
            s.extents += 1;
            if first != Some(idx) {
                self.cursor = (idx + 1) % n;
            }
            let loc = ChunkLoc { server: s.id, addr: RemoteAddr::new(s.region, block.offset), capacity };
            return Some(Extent { loc, dirty: block.dirty });
        }
        None
    }

    /// Gives back an extent (only the reclamation point calls this). When
    /// it merges into a whole free chunk and its server can discard pages,
    /// they go back to the host and the chunk is clean.
    pub fn free(&mut self, loc: ChunkLoc) {
        let chunk_order = self.chunk_size.trailing_zeros();
        let Some(s) = self.servers.iter_mut().find(|s| s.id == loc.server) else {
            log::error!("freeing an extent of unknown data server {}", loc.server.0);
            return;
        };
        let order = loc.capacity.trailing_zeros();
        if loc.addr.region != s.region || !s.buddy.owns(loc.addr.offset, order) {
            log::error!("freeing an extent that is not one: {loc:?}");
            return;
        }
        s.extents -= 1;
        let merged = s.buddy.free(loc.addr.offset, order, true);
        if merged.order == chunk_order {
            if let Some(discard) = s.discard.as_mut() {
                if discard(merged.offset, merged.bytes()) {
                    s.buddy.mark_clean(merged.offset, merged.order);
                }
            }
        }
    }

    /// Bytes of data-server memory managed.
    pub fn total_bytes(&self) -> u64 {
        self.servers.iter().filter(|s| s.available).map(|s| s.buddy.total_bytes()).sum()
    }

    pub fn free_bytes(&self) -> u64 {
        self.servers.iter().filter(|s| s.available).map(|s| s.buddy.free_bytes()).sum()
    }

    /// Each server's space.
    pub fn servers(&self) -> Vec<DataServerSpace> {
        self.servers
            .iter()
            .map(|s| DataServerSpace {
                id: s.id,
                capacity: s.buddy.total_bytes(),
                free: s.buddy.free_bytes(),
                extents: s.extents,
                largest_free: s.buddy.largest_free(),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    const CHUNK: u64 = 1 << 20;

    #[test]
    fn sizes_follow_the_policy() {
        assert_eq!(extent_capacity(ChunkIndex(0), 1, CHUNK), 4096);
        assert_eq!(extent_capacity(ChunkIndex(0), 4096, CHUNK), 4096);
        assert_eq!(extent_capacity(ChunkIndex(0), 4097, CHUNK), 8192);
        assert_eq!(extent_capacity(ChunkIndex(0), 3901, CHUNK), 4096);
        assert_eq!(extent_capacity(ChunkIndex(0), CHUNK, CHUNK), CHUNK);
        assert_eq!(extent_capacity(ChunkIndex(1), 1, CHUNK), CHUNK, "later chunks are whole");
        assert_eq!(growth_capacity(4612, CHUNK), 16384, "a journal's third piece");
        assert_eq!(growth_capacity(4096, CHUNK), 8192);
        assert_eq!(growth_capacity(CHUNK / 2 + 1, CHUNK), CHUNK, "never past the chunk");
        assert_eq!(growth_capacity(CHUNK, CHUNK), CHUNK);
    }

    #[test]
    fn small_files_fit_by_the_hundred_thousand_and_give_back_whole_chunks() {
        let mut a = ExtentAllocator::new(CHUNK);
        a.add_server(DataServerId(1), RegionId(1), 1 << 30, None);
        let mut got = Vec::new();
        while let Some(e) = a.allocate(4096, 4096, None) {
            assert_eq!(e.loc.capacity, 4096);
            assert!(!e.dirty, "fresh memory is clean");
            got.push(e.loc);
        }
        assert_eq!(got.len(), 262_144, "4 KiB extents in 1 GiB");
        assert_eq!(a.free_bytes(), 0);
        assert!(a.allocate(CHUNK, CHUNK, None).is_none());
        for loc in got {
            a.free(loc);
        }
        assert_eq!(a.free_bytes(), 1 << 30);
        let whole = a.allocate(CHUNK, CHUNK, None).unwrap();
        assert_eq!(whole.loc.capacity, CHUNK);
        assert!(whole.dirty, "memory a client wrote must be zeroed before reuse");
    }

    #[test]
    fn falls_back_to_what_fits_and_spreads_over_servers() {
        let mut a = ExtentAllocator::new(CHUNK);
        a.add_server(DataServerId(1), RegionId(1), CHUNK, None);
        a.add_server(DataServerId(2), RegionId(1), CHUNK, None);
        let x = a.allocate(4096, 4096, None).unwrap();
        let y = a.allocate(4096, 4096, None).unwrap();
        assert_ne!(x.loc.server, y.loc.server, "round robin");
        // No whole chunk is free: a later chunk takes what fits.
        assert!(a.allocate(CHUNK, CHUNK, None).is_none());
        let z = a.allocate(CHUNK, 100, Some(DataServerId(2))).unwrap();
        assert_eq!((z.loc.server, z.loc.capacity), (DataServerId(2), 4096));
        let space = a.servers();
        assert_eq!(space[1].extents, 2);
        assert_eq!(space[1].free, CHUNK - 8192);
        assert_eq!(space[1].largest_free, CHUNK / 2);
    }

    #[test]
    fn a_whole_free_chunk_is_discarded_and_clean() {
        let discarded = Arc::new(Mutex::new(Vec::new()));
        let seen = discarded.clone();
        let mut a = ExtentAllocator::new(CHUNK);
        let discard: Discard = Box::new(move |off, len| {
            seen.lock().unwrap().push((off, len));
            true
        });
        a.add_server(DataServerId(1), RegionId(1), 2 * CHUNK, Some(discard));
        let x = a.allocate(4096, 4096, None).unwrap();
        let y = a.allocate(8192, 8192, None).unwrap();
        a.free(x.loc);
        assert!(discarded.lock().unwrap().is_empty(), "not a whole chunk yet");
        a.free(y.loc);
        assert_eq!(*discarded.lock().unwrap(), vec![(0, CHUNK)]);
        let again = a.allocate(4096, 4096, None).unwrap();
        assert!(!again.dirty, "discarded pages read zero");
    }
}
