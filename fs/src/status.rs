//! The cluster as an operator sees it (`citronfs status`, the meta-server's
//! `Status` answer): space per data server, files and opens, lock memory,
//! clients and their leases. Plain data (serde), so the command can print it
//! as tables or as JSON and later sections can be added beside these.
//!
//! [`ClusterStatus::problems`] reads it as an operator would: what, if
//! anything, needs one (a data server that does not answer or is gone with
//! files' data, clients that lag or were fenced, space, files or lock
//! memory near their limits).

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

use crate::types::{ClientId, DataServerId, FsId};

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterStatus {
    /// Bytes per chunk (the largest extent).
    pub chunk_size: u64,
    pub data_servers: Vec<DataServerStatus>,
    pub files: FileStatus,
    pub lock_memory: LockMemoryStatus,
    pub clients: Vec<ClientStatus>,
    pub reclaim: ReclaimStatus,
    /// Which file system, which meta-server process, and its journal.
    pub state: StateStatus,
}

/// The file system's identity and how its state is kept.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StateStatus {
    pub fs: FsId,
    /// When the file system was made and when this meta-server process
    /// started serving it (seconds since the Unix epoch), and its
    /// incarnation (a new one at every start).
    pub born_unix_s: u64,
    pub started_unix_s: u64,
    pub incarnation: u64,
    /// How long the start's replay of the journal took.
    pub replay_ms: u64,
    pub state_dir: String,
    pub journal_segments: u64,
    pub journal_bytes: u64,
    /// The newest snapshot: its number, bytes and when it was written.
    pub snapshot: Option<(u64, u64, u64)>,
    /// The grace period after a restart, while it lasts: milliseconds left
    /// at most, and clients of the previous process not back yet.
    pub grace: Option<(u64, u64)>,
}

/// One data server's memory for file data.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataServerStatus {
    pub id: DataServerId,
    pub nic: SocketAddr,
    pub shm: Option<String>,
    pub capacity: u64,
    pub used: u64,
    pub free: u64,
    /// Extents handed out.
    pub extents: u64,
    /// The largest extent an allocation could get now.
    pub largest_free: u64,
    /// Milliseconds it has failed the meta-server's probes for, if its last
    /// probe failed (at a lease it is taken for gone).
    #[serde(default)]
    pub unanswered_ms: Option<u64>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileStatus {
    pub inodes: u64,
    pub regular_files: u64,
    /// Regular files open on at least one client.
    pub open_files: u64,
    /// Opens over all clients.
    pub opens: u64,
    /// The most regular files there can be (`--max-files`).
    pub max_files: u64,
    /// Bytes of extents the files take.
    pub allocated: u64,
    /// Regular files whose data was on a data server that is gone: they
    /// answer EIO until removed or truncated.
    #[serde(default)]
    pub lost_data: u64,
}

/// The meta-server's lock memory (`--lock-memory`): what bounds how many
/// files can be open at once cluster-wide.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LockMemoryStatus {
    /// Bytes in use and the configured limit.
    pub in_use: u64,
    pub limit: u64,
    /// Files that have lock memory now (open somewhere or holding records),
    /// and the most there have been at once.
    pub files: u64,
    pub peak_files: u64,
    /// Opens answered ENFILE because lock memory was full.
    pub refused_opens: u64,
    /// The lock areas' allocator (areas, record tables, the cluster's lock
    /// services): bytes in use of its share.
    pub areas_in_use: u64,
    pub areas: u64,
    /// The Citron tree host's arena: bytes in use of its share.
    pub trees_in_use: u64,
    pub trees: u64,
}

/// A registered client (a mount) and its lease.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClientStatus {
    pub id: ClientId,
    pub hostname: String,
    pub pid: u32,
    /// Milliseconds since its lease was last renewed, and the lease.
    pub renewed_ms_ago: u64,
    pub lease_ms: u64,
    /// Files it has open (counted opens).
    pub opens: u64,
}

/// What the meta-server's reclamation point has done.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReclaimStatus {
    /// Clients fenced (lease expired), and how many of those fences were
    /// enforced at every NIC.
    pub fences: u64,
    pub revoked: u64,
    pub lock_memory_frees: u64,
    pub extent_frees: u64,
    pub extent_bytes_freed: u64,
    /// The last client fenced, if any was.
    #[serde(default)]
    pub last_fence: Option<FenceStatus>,
}

/// A fence: the client whose lease ran out, and how long ago.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FenceStatus {
    pub client: ClientId,
    pub ms_ago: u64,
}

/// A share of a limit at which it needs an operator, in percent.
pub const NEARLY_FULL_PERCENT: u64 = 90;

/// How long a fence stays news: a fenced client lost its locks and opens,
/// and its applications saw errors.
pub const RECENT_FENCE_MS: u64 = 10 * 60 * 1000;

fn nearly_full(part: u64, whole: u64) -> bool {
    whole > 0 && u128::from(part) * 100 >= u128::from(whole) * u128::from(NEARLY_FULL_PERCENT)
}

fn percent(part: u64, whole: u64) -> u64 {
    (u128::from(part) * 100 / u128::from(whole.max(1))) as u64
}

impl ClusterStatus {
    /// What needs an operator, one sentence each; empty when the cluster is
    /// healthy: every data server answers and none is gone with files'
    /// data, no client lags behind its lease or was fenced lately, and
    /// space, files and lock memory are below [`NEARLY_FULL_PERCENT`] of
    /// their limits.
    pub fn problems(&self) -> Vec<String> {
        let mut problems = Vec::new();
        if self.data_servers.is_empty() {
            problems.push("no data server: files can hold no data".to_string());
        }
        for d in &self.data_servers {
            if let Some(ms) = d.unanswered_ms {
                problems.push(format!("data server {} at {} has not answered for {ms} ms", d.id.0, d.nic));
            }
        }
        if self.files.lost_data > 0 {
            problems.push(format!(
                "{} files lost their data with a data server that is gone (they answer EIO until removed or \
                 truncated)",
                self.files.lost_data
            ));
        }
        let capacity: u64 = self.data_servers.iter().map(|d| d.capacity).sum();
        let used: u64 = self.data_servers.iter().map(|d| d.used).sum();
        if nearly_full(used, capacity) {
            problems.push(format!("the data servers are {}% full", percent(used, capacity)));
        }
        let f = &self.files;
        if nearly_full(f.regular_files, f.max_files) {
            problems.push(format!("{} regular files of at most {}", f.regular_files, f.max_files));
        }
        let l = &self.lock_memory;
        if nearly_full(l.in_use, l.limit) {
            problems.push(format!(
                "lock memory is {}% in use (opens fail with ENFILE when full)",
                percent(l.in_use, l.limit)
            ));
        }
        for c in &self.clients {
            // The client itself takes 3/4 of a lease without a renewal as
            // the point where it may be fenced.
            if c.renewed_ms_ago.saturating_mul(4) > c.lease_ms.saturating_mul(3) {
                problems.push(format!(
                    "client {} ({} pid {}) lags: last renewed {} ms ago, lease {} ms",
                    c.id.0, c.hostname, c.pid, c.renewed_ms_ago, c.lease_ms
                ));
            }
        }
        if let Some(fence) = self.reclaim.last_fence.filter(|f| f.ms_ago < RECENT_FENCE_MS) {
            problems.push(format!(
                "client {} was fenced {} s ago (its lease ran out; its locks and opens were dropped)",
                fence.client.0,
                fence.ms_ago / 1000
            ));
        }
        problems
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn healthy() -> ClusterStatus {
        ClusterStatus {
            chunk_size: 1 << 20,
            data_servers: vec![DataServerStatus {
                id: DataServerId(1),
                nic: "127.0.0.1:9000".parse().unwrap(),
                shm: None,
                capacity: 100,
                used: 10,
                free: 90,
                extents: 1,
                largest_free: 90,
                unanswered_ms: None,
            }],
            files: FileStatus {
                inodes: 2,
                regular_files: 1,
                open_files: 0,
                opens: 0,
                max_files: 100,
                allocated: 10,
                lost_data: 0,
            },
            lock_memory: LockMemoryStatus {
                in_use: 1,
                limit: 100,
                files: 0,
                peak_files: 0,
                refused_opens: 0,
                areas_in_use: 1,
                areas: 50,
                trees_in_use: 0,
                trees: 50,
            },
            clients: vec![ClientStatus {
                id: ClientId(3),
                hostname: "h".into(),
                pid: 7,
                renewed_ms_ago: 100,
                lease_ms: 5000,
                opens: 0,
            }],
            reclaim: ReclaimStatus::default(),
            state: StateStatus {
                fs: FsId(1),
                born_unix_s: 0,
                started_unix_s: 0,
                incarnation: 1,
                replay_ms: 0,
                state_dir: "/dev/shm/state".into(),
                journal_segments: 1,
                journal_bytes: 0,
                snapshot: None,
                grace: None,
            },
        }
    }

    #[test]
    fn a_healthy_cluster_has_no_problem() {
        assert_eq!(healthy().problems(), Vec::<String>::new());
    }

    #[test]
    fn each_problem_is_named() {
        type Spoil = Box<dyn Fn(&mut ClusterStatus)>;
        let cases: Vec<(&str, Spoil)> = vec![
            ("no data server", Box::new(|s| s.data_servers.clear())),
            ("has not answered for 700 ms", Box::new(|s| s.data_servers[0].unanswered_ms = Some(700))),
            ("3 files lost their data", Box::new(|s| s.files.lost_data = 3)),
            ("95% full", Box::new(|s| s.data_servers[0].used = 95)),
            ("90 regular files of at most 100", Box::new(|s| s.files.regular_files = 90)),
            ("lock memory is 99% in use", Box::new(|s| s.lock_memory.in_use = 99)),
            ("client 3 (h pid 7) lags", Box::new(|s| s.clients[0].renewed_ms_ago = 3800)),
            (
                "client 4 was fenced 2 s ago",
                Box::new(|s| s.reclaim.last_fence = Some(FenceStatus { client: ClientId(4), ms_ago: 2000 })),
            ),
        ];
        for (expected, spoil) in cases {
            let mut s = healthy();
            spoil(&mut s);
            let problems = s.problems();
            assert!(problems.len() == 1 && problems[0].contains(expected), "{expected}: {problems:?}");
        }
        let mut s = healthy();
        s.reclaim.last_fence = Some(FenceStatus { client: ClientId(4), ms_ago: RECENT_FENCE_MS });
        assert!(s.problems().is_empty(), "an old fence is no news");
    }
}
