//! What `citronfs status` shows: the cluster's clients, data servers, files
//! and lock memory, gathered from the meta-server's state.

use std::time::Instant;

use citronfs_core::proto::DataServerInfo;
use citronfs_core::status::{
    ClientStatus, ClusterStatus, DataServerStatus, FenceStatus, FileStatus, LockMemoryStatus, ReclaimStatus,
    StateStatus,
};

use super::MetaService;

impl MetaService {
    /// The cluster as `citronfs status` shows it.
    pub(super) fn status(&self) -> ClusterStatus {
        let (space, counts, usage, by_client, areas_in_use) = {
            let ns = self.ns.lock();
            (
                ns.extents.servers(),
                ns.file_counts(),
                ns.lock_usage(),
                ns.opens_by_client(),
                ns.lock_memory_in_use(),
            )
        };
        let infos: Vec<(DataServerInfo, Option<u64>)> = self
            .data_servers
            .lock()
            .iter()
            .map(|l| (l.info.clone(), l.unanswered_for().map(|d| d.as_millis() as u64)))
            .collect();
        let data_servers = space
            .iter()
            .filter_map(|s| {
                let (info, unanswered_ms) = infos.iter().find(|(i, _)| i.id == s.id)?;
                Some(DataServerStatus {
                    id: s.id,
                    nic: info.nic,
                    shm: info.shm.clone(),
                    capacity: s.capacity,
                    used: s.capacity - s.free,
                    free: s.free,
                    extents: s.extents,
                    largest_free: s.largest_free,
                    unanswered_ms: *unanswered_ms,
                })
            })
            .collect();
        let trees_in_use = self.trees_in_use();
        let now = Instant::now();
        let mut clients: Vec<ClientStatus> = self
            .clients
            .lock()
            .iter()
            .map(|(id, l)| ClientStatus {
                id: *id,
                hostname: l.hostname.clone(),
                pid: l.pid,
                renewed_ms_ago: now.duration_since(l.renewed).as_millis() as u64,
                lease_ms: self.lease.as_millis() as u64,
                opens: by_client.get(id).copied().unwrap_or(0),
            })
            .collect();
        clients.sort_by_key(|c| c.id);
        let r = self.reclaim.stats();
        ClusterStatus {
            chunk_size: self.chunk_size,
            data_servers,
            files: FileStatus {
                inodes: counts.inodes,
                regular_files: counts.regular_files,
                open_files: counts.open_files,
                opens: counts.opens,
                max_files: counts.max_files,
                allocated: counts.allocated,
                lost_data: counts.lost_data,
            },
            lock_memory: LockMemoryStatus {
                in_use: areas_in_use + trees_in_use,
                limit: self.lock_bytes,
                files: usage.files,
                peak_files: usage.peak_files,
                refused_opens: usage.refused_opens,
                areas_in_use,
                areas: usage.area_bytes,
                trees_in_use,
                trees: self.tree_bytes,
            },
            clients,
            reclaim: ReclaimStatus {
                fences: r.fences,
                revoked: r.revoked,
                lock_memory_frees: r.lock_memory_frees,
                extent_frees: r.extent_frees,
                extent_bytes_freed: r.extent_bytes_freed,
                last_fence: r.last_fence.map(|(client, at)| FenceStatus {
                    client,
                    ms_ago: now.duration_since(at).as_millis() as u64,
                }),
            },
            state: self.state_status(),
        }
    }

    fn state_status(&self) -> StateStatus {
        let unix =
            |t: std::time::SystemTime| t.duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let journal = self.ns.journal().status();
        StateStatus {
            fs: self.identity.fs,
            born_unix_s: self.identity.born.as_nanos() / 1_000_000_000,
            started_unix_s: unix(self.identity.started),
            incarnation: self.access.incarnation(),
            replay_ms: self.identity.replay.as_millis() as u64,
            state_dir: journal.dir.display().to_string(),
            journal_segments: journal.segments as u64,
            journal_bytes: journal.segment_bytes,
            snapshot: journal.snapshot.map(|(n, bytes, at)| (n, bytes, unix(at))),
            grace: self.grace.ends().map(|end| {
                let left = end.saturating_duration_since(std::time::Instant::now());
                (left.as_millis() as u64, self.grace.awaited() as u64)
            }),
        }
    }

    /// Bytes of the tree host's arena in use.
    pub(super) fn trees_in_use(&self) -> u64 {
        self.trees.as_ref().map_or(0, |h| self.tree_bytes.saturating_sub(h.free_bytes()))
    }
}
