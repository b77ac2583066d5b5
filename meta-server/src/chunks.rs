//! Allocation of file chunks over the registered data servers.
//!
//! Each data server offers one region cut into chunks. A chunk never used is
//! known to be zero (fresh anonymous memory); a freed chunk is quarantined for
//! a while (so a client still holding an old layout cannot scribble into it
//! after it belongs to another file) and zeroed when it is handed out again.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use citron_lock::rdma::{RegionId, RemoteAddr};
use citronfs_core::types::{ChunkLoc, DataServerId};

struct Server {
    id: DataServerId,
    region: RegionId,
    /// Chunks never handed out: `next_fresh..total`.
    next_fresh: u64,
    total: u64,
    /// Freed chunks past quarantine, to be zeroed before reuse.
    recycled: Vec<u64>,
}

/// A chunk handed out, and whether its memory must be zeroed first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Allocated {
    pub loc: ChunkLoc,
    pub needs_zeroing: bool,
}

pub struct ChunkAllocator {
    chunk_size: u64,
    servers: Vec<Server>,
    quarantine: VecDeque<(Instant, ChunkLoc)>,
    quarantine_for: Duration,
    /// Round-robin start, so files spread over servers.
    cursor: usize,
}

impl ChunkAllocator {
    pub fn new(chunk_size: u64, quarantine_for: Duration) -> Self {
        Self { chunk_size, servers: Vec::new(), quarantine: VecDeque::new(), quarantine_for, cursor: 0 }
    }

    pub fn add_server(&mut self, id: DataServerId, region: RegionId, capacity: u64) {
        let total = capacity / self.chunk_size;
        self.servers.push(Server { id, region, next_fresh: 0, total, recycled: Vec::new() });
    }

    /// Takes a server that went away out of allocation; its chunks, in use
    /// or quarantined, are never handed out again.
    pub fn remove_server(&mut self, id: DataServerId) {
        self.servers.retain(|s| s.id != id);
    }

    fn release_quarantine(&mut self, now: Instant) {
        while let Some(&(t, loc)) = self.quarantine.front() {
            if now.duration_since(t) < self.quarantine_for {
                break;
            }
            self.quarantine.pop_front();
            if let Some(s) = self.servers.iter_mut().find(|s| s.id == loc.server) {
                s.recycled.push(loc.addr.offset / self.chunk_size);
            }
        }
    }

    /// One chunk, or `None` when every server is full.
    pub fn allocate(&mut self) -> Option<Allocated> {
        self.release_quarantine(Instant::now());
        let n = self.servers.len();
        for i in 0..n {
            let idx = (self.cursor + i) % n;
            let s = &mut self.servers[idx];
            let (chunk, needs_zeroing) = if s.next_fresh < s.total {
                s.next_fresh += 1;
                (s.next_fresh - 1, false)
            } else if let Some(c) = s.recycled.pop() {
                (c, true)
            } else {
                continue;
            };
            self.cursor = (idx + 1) % n;
            let addr = RemoteAddr::new(s.region, chunk * self.chunk_size);
            return Some(Allocated { loc: ChunkLoc { server: s.id, addr }, needs_zeroing });
        }
        None
    }

    /// Gives back a chunk; it is reused only after the quarantine.
    pub fn free(&mut self, loc: ChunkLoc) {
        self.quarantine.push_back((Instant::now(), loc));
    }

    /// Gives back a chunk that no client can still write: its file is gone
    /// (unlinked, released by every client, past the orphan grace), so it
    /// is reused at once (zeroed first). A client that lost its lease with
    /// the file open cannot write either: it fenced itself before the
    /// meta-server dropped its opens. Without this, a workload that creates
    /// and deletes files (SQLite's journals) waits a lease for every chunk.
    pub fn free_unreachable(&mut self, loc: ChunkLoc) {
        if let Some(s) = self.servers.iter_mut().find(|s| s.id == loc.server) {
            s.recycled.push(loc.addr.offset / self.chunk_size);
        }
    }

    pub fn total_chunks(&self) -> u64 {
        self.servers.iter().map(|s| s.total).sum()
    }

    pub fn free_chunks(&self) -> u64 {
        let now = Instant::now();
        let quarantined_ready =
            self.quarantine.iter().filter(|(t, _)| now.duration_since(*t) >= self.quarantine_for);
        self.servers.iter().map(|s| s.total - s.next_fresh + s.recycled.len() as u64).sum::<u64>()
            + quarantined_ready.count() as u64
    }

    /// How long until the oldest quarantined chunk can be reused, if any is
    /// quarantined: an allocation that found no free chunk waits this long
    /// instead of failing with ENOSPC.
    pub fn next_release(&self) -> Option<Duration> {
        self.quarantine.front().map(|(t, _)| self.quarantine_for.saturating_sub(t.elapsed()))
    }

    pub fn chunk_size(&self) -> u64 {
        self.chunk_size
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spreads_over_servers_then_runs_out() {
        let mut a = ChunkAllocator::new(4096, Duration::ZERO);
        a.add_server(DataServerId(1), RegionId(1), 2 * 4096);
        a.add_server(DataServerId(2), RegionId(1), 4096 + 100);
        let got: Vec<_> = std::iter::from_fn(|| a.allocate()).collect();
        assert_eq!(got.len(), 3);
        assert_eq!(got[0].loc.server, DataServerId(1));
        assert_eq!(got[1].loc.server, DataServerId(2));
        assert!(got.iter().all(|g| !g.needs_zeroing), "fresh chunks are zero");
        assert_eq!(a.free_chunks(), 0);
        a.free(got[1].loc);
        let again = a.allocate().unwrap();
        assert_eq!(again.loc, got[1].loc);
        assert!(again.needs_zeroing, "a recycled chunk must be zeroed");
    }

    #[test]
    fn chunks_of_a_freed_file_are_reused_at_once() {
        let mut a = ChunkAllocator::new(4096, Duration::from_secs(3600));
        a.add_server(DataServerId(1), RegionId(1), 4096);
        let c = a.allocate().unwrap();
        a.free_unreachable(c.loc);
        let again = a.allocate().unwrap();
        assert_eq!(again.loc, c.loc);
        assert!(again.needs_zeroing);
    }

    #[test]
    fn quarantine_delays_reuse() {
        let mut a = ChunkAllocator::new(4096, Duration::from_secs(3600));
        a.add_server(DataServerId(1), RegionId(1), 4096);
        let c = a.allocate().unwrap();
        a.free(c.loc);
        assert!(a.allocate().is_none(), "a freed chunk is not reused during quarantine");
    }
}
