//! The cluster as an operator sees it (`citronfs status`, the meta-server's
//! `Status` answer): space per data server, files and opens, lock memory,
//! clients and their leases. Plain data (serde), so the command can print it
//! as tables or as JSON and later sections can be added beside these.

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
}
