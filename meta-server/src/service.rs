//! The meta-server process: the namespace behind an RPC service, its own
//! software NIC serving attribute slots (and, with the lock issues, lock
//! memory), the registry of data servers, and client leases.
//!
//! # Citron trees that grow (DESIGN.md §4 "Tree growth", citron-fast23.md §3.9)
//!
//! The meta-server is the lock host of every file's Citron tree. With
//! [`MetaServerConfig::grow_trees`] (the default when files use Citron) the
//! top of the lock region (`tree_bytes`, half of it by default) is the arena
//! of a [`LockMemoryHost`], served by a [`TreeHostServer`] on the
//! meta-server's IP; the rest stays with [`LockMemory`] (lock areas, record
//! tables, the waits-for table). An open of a file that has no lock memory
//! creates an instance (the tree [`citronfs_core::locks::LockArea::plan`]
//! would have sized, and its DSLR spillover word, allocated from the
//! instance so it goes with it) and the open reply names it
//! ([`RangeLockSite::CitronHosted`]); when the file is idle again (closed
//! everywhere, no lock record; [`crate::lock_areas`]) the instance is
//! destroyed with every segment its scale-ups added.
//!
//! Why a `LockMemoryHost` behind its own RPC service rather than `TreeHost`
//! over [`MetaRequest`]: the lock crate's host already keeps versioned
//! configurations and refuses a publication that is stale, malformed or
//! not made of the instance's own allocations, and the lock crate's range
//! lock layer can then open a client from the site alone
//! ([`citron_lock::range_lock::RangeLockContext::client`], its own
//! connections to the host), with no file-system code on that path; and a
//! scale-up that waits for a spillover mutex holds a tree-host connection
//! thread, not one of the metadata service's.
//!
//! Why the host runs the scale-ups ([`LockMemoryHost::with_scaler`]) rather
//! than the client whose release found the maximizer set, as Algorithm 4
//! has it: a client that died between its first mark and its publication
//! would leave the file's tree superseded without a successor, which no
//! one can repair (the counters its marks read are gone with it), and
//! every later I/O on the file would fail after the lock's give-up time.
//! Run by the host, a scale-up finishes whatever happens to the client that
//! asked; a client that dies holding the spillover mutex delays it by
//! DSLR's lease recovery (twice the cluster's lease). The host's thread is a
//! client of its own memory like any other (shm or its own NIC), takes the
//! spillover mutex like any scaler, and costs the asking client one RPC
//! instead of two RPCs and five round trips. The host CPU never takes part
//! in acquiring or releasing a range; remote changes to instances are
//! refused.
//!
//! Growth policy (what the lock layer does for the file system): a write or
//! lock past the tree takes the spillover mutex and ORs its right border
//! into the maximizer; its release asks for a scale-up if the maximizer is
//! set (`ScalePolicy::AfterSpillover`); the tree grows at least 4× and to
//! cover the border, never past [`MetaServerConfig::max_tree_units`]
//! (default [`DEFAULT_MAX_TREE_UNITS`]; beyond it the spillover mutex keeps
//! serialising). A lock to end of file asks for growth only to reach its
//! start (none if it starts inside the tree). Clients open a range lock per
//! operation without an RPC: the process's `RangeLockContext` keeps the
//! newest configuration it has seen per instance.
//!
//! No scale-down: fcntl range locks are taken without the inode mutex, so
//! the file system has no moment of exclusive use of a tree, which Citron's
//! scale-down requires (§3.9.2); a truncated file keeps its tree until it is
//! closed everywhere (the next open sizes a new tree to the file).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use citron_lock::alock::{AlockConfig, AlockHost, AlockLayout};
use citron_lock::citron::geometry::TreeGeometry;
use citron_lock::citron::host::{HostScaleStats, InstanceId, LockMemoryHost, TreeHost, TreeHostServer};
use citron_lock::citron::tree::TreeShape;
use citron_lock::lock_host::{LockHost, LockHostConfig, LockHostInfo};
use citron_lock::range_lock::rpc::{spawn_range_server_with, RangeLockServer, RangeServerConfig};
use citron_lock::range_lock::RangeAlgorithm;
use citron_lock::range_lock::RangeLockSite;
use citron_lock::rdma::tcp::{AccessTable, Connections, Extent, Peer, RpcServer, RpcService};
use citron_lock::rdma::{
    Endpoint, FabricAddr, IbDevice, IbHost, Node, NodeCredentials, RegionId, RegionMemory, RegionTable,
    RemoteAddr, ShmHost, TcpHost, TcpOptions,
};
use citron_rpc::auth::{Authority, Credential, Credentials, KeyOptions, Keyring, Principal, Status};
use citronfs_core::locks::area::LockChoice;
use citronfs_core::locks::table::TableGrowth;
use citronfs_core::locks::waits_for::WaitsForGrowth;
use citronfs_core::locks::{ClusterLockParams, LockTiming, WaitsFor};
use citronfs_core::proto::{AttrSlot, DataServerInfo, MetaRequest, MetaResponse};
use citronfs_core::status::{
    ClientStatus, ClusterStatus, DataServerStatus, FileStatus, LockMemoryStatus, ReclaimStatus,
};
use citronfs_core::types::{Caller, ChunkIndex, ChunkLoc, ClientId, DataServerId, Ino};
use citronfs_core::FsError;
use parking_lot::Mutex;

use crate::access::{Access, Class, Placed, ServerRef};
use crate::data_link::DataServerLink;
use crate::extents::ExtentAllocator;
use crate::grants::Grants;
use crate::identity::{self, Asker};
use crate::lock_areas::LockAreas;
use crate::lock_cleanup;
use crate::lock_memory::LockMemory;
use crate::lock_tuning::LockTuning;
use crate::namespace::{ExtentPlan, FileLocking, Namespace, TreeHosting, ZeroRange};
use crate::reclaim::{Cause, Reclamation, Revocation};
use crate::waits_for_chain::WaitsForChain;

mod dispatch;

/// The region of the meta-server's NIC that holds attribute slots.
pub const SLOT_REGION: RegionId = RegionId(1);
/// The region that holds lock memory (lock areas, record tables, waits-for,
/// and at its top the Citron tree host's arena).
pub const LOCK_REGION: RegionId = RegionId(2);
/// Default cap of a file's Citron tree: 2^22 units (16 GiB of 4 KiB
/// granules), a depth-8 tree of 700 KB of lock memory.
pub const DEFAULT_MAX_TREE_UNITS: u64 = 1 << 22;
/// Default lock memory: about 270 bytes per file open in the cluster at
/// once (a hosted Citron tree and a lock area) and 2 KiB per file with
/// fcntl/flock locks, so some 600,000 open files; touched only as it is used.
pub const DEFAULT_LOCK_BYTES: u64 = 256 << 20;
/// Default most regular files: 4 Mi attribute slots (160 MiB of the
/// meta-server's memory, touched only as files are created).
pub const DEFAULT_MAX_FILES: u64 = 4 << 20;
/// Longest cache grant a client may ask for (an hour): a bound on how long
/// a silent client can delay a change.
pub const MAX_GRANT_MS: u64 = 3_600_000;

#[derive(Clone, Debug)]
pub struct MetaServerConfig {
    /// Where the RPC service listens.
    pub listen: SocketAddr,
    /// Where the meta-server's own software NIC listens (port 0: any).
    pub nic_listen: SocketAddr,
    pub chunk_size: u64,
    /// Bytes of attribute slots (40 per regular file: the most regular
    /// files there can be; `--max-files`). Touched only as files are made.
    pub slot_bytes: u64,
    /// Bytes of lock memory (a few hundred bytes per file open somewhere in
    /// the cluster, 4 KiB per lock-record table block): the most files open
    /// at once cluster-wide.
    pub lock_bytes: u64,
    /// How files are locked: `--range-lock`, `--inode-lock`, the granule.
    pub lock_choice: LockChoice,
    /// Entries per block of the waits-for table of blocked POSIX owners
    /// (deadlock checks), its link included: the table starts with one
    /// block and grows by blocks as more owners wait at once.
    pub max_waiting_owners: u32,
    /// Lock parameters every client must share (Citron's T_wait, leases).
    pub lock_params: ClusterLockParams,
    /// Citron trees grow (DESIGN.md §4 "Tree growth"): each file's tree is
    /// an instance of the meta-server's tree host, which runs its scale-ups.
    /// `false`: a fixed tree in the file's lock area, beyond which ranges
    /// are serialised by the spillover mutex.
    pub grow_trees: bool,
    /// Bytes of `lock_bytes` the tree host serves (0: half of them).
    pub tree_bytes: u64,
    /// Units a file's tree grows to cover at most (rounded up to a tree's
    /// size); ranges beyond go through the spillover mutex.
    pub max_tree_units: u64,
    /// A client that has not renewed its lease for this long is dropped.
    pub lease: Duration,
    /// Owner of the root directory.
    pub root_owner: Caller,
    /// Also publish the meta-server's memory as this shm fabric, for
    /// clients on this host.
    pub shm: Option<String>,
    /// Also serve the meta-server's memory to RDMA clients on this device
    /// (the `ib` backend; its control channel listens beside the NIC).
    pub ib: Option<IbDevice>,
    /// The cluster's keys (`--key-file`); `None`: no keys, anyone who
    /// reaches the ports is let in (loopback clusters, tests).
    pub keyring: Option<Arc<Keyring>>,
    /// How long a NIC holds a verb that arrives before its grant (or a
    /// session before its admission) before refusing it.
    pub grant_hold: Duration,
}

impl MetaServerConfig {
    pub fn new(listen: SocketAddr) -> Self {
        Self {
            listen,
            nic_listen: SocketAddr::new(listen.ip(), 0),
            chunk_size: 1 << 20,
            slot_bytes: DEFAULT_MAX_FILES * AttrSlot::BYTES,
            lock_bytes: DEFAULT_LOCK_BYTES,
            lock_choice: LockChoice::default(),
            max_waiting_owners: 256,
            lock_params: ClusterLockParams::default(),
            grow_trees: true,
            tree_bytes: 0,
            max_tree_units: DEFAULT_MAX_TREE_UNITS,
            lease: Duration::from_secs(5),
            root_owner: Caller::ROOT,
            shm: None,
            ib: None,
            keyring: None,
            grant_hold: citron_lock::rdma::tcp::access::DEFAULT_HOLD,
        }
    }
}

/// Who a keyed meta-server's own connections prove: the cluster key to
/// NICs and lock services, the members' secret to clients' mailboxes.
fn server_credentials(access: &Access) -> NodeCredentials {
    let (Some(ring), Some(member)) = (access.keyring(), access.member_secret()) else {
        return NodeCredentials::default();
    };
    let Some(key) = ring.cluster_key() else { return NodeCredentials::default() };
    NodeCredentials {
        host: Credentials::new(Credential::Key(key.clone())),
        peers: Credentials::new(Credential::Member { incarnation: access.incarnation(), secret: member }),
        mailbox: Authority::Keyring(ring.clone()),
    }
}

/// The reclamation point's revocation ([`Revocation`]): the grants at every
/// NIC ([`Access`]) and the client's connections to the meta-server's RPC
/// service.
struct NicRevocation {
    access: Arc<Access>,
    connections: Arc<std::sync::OnceLock<Connections>>,
}

impl Revocation for NicRevocation {
    fn revoke_client(&self, client: ClientId) -> Result<(), FsError> {
        // Its grants end and its connections are cut everywhere before
        // anything it held is handed to others.
        self.access.fence(client).map_err(|e| FsError::Io(e.to_string()))?;
        if let Some(conns) = self.connections.get() {
            conns.close_where(|p| matches!(p, Principal::Session(s) if s.client == client.0));
        }
        Ok(())
    }

    fn revoke_memory(&self, memory: &[Placed]) -> Result<(), FsError> {
        self.access.revoke_everyone(memory).map_err(|e| FsError::Io(e.to_string()))
    }
}

pub struct MetaService {
    ns: Mutex<Namespace>,
    /// Where memory lent to clients comes back and fences begin.
    reclaim: Arc<Reclamation>,
    /// `--lock-memory`, and the tree host's share of it.
    lock_bytes: u64,
    tree_bytes: u64,
    trees: Option<Arc<LockMemoryHost>>,
    chunk_size: u64,
    lease: Duration,
    nic: SocketAddr,
    shm: Option<String>,
    ib: Option<SocketAddr>,
    data_servers: Mutex<Vec<Arc<DataServerLink>>>,
    /// Ids of data servers ever registered (a server that left keeps its id).
    next_data_server: AtomicU64,
    /// Wakes the lease reaper at once (a client left).
    reaper_wake: Mutex<std::sync::mpsc::Sender<()>>,
    clients: Mutex<HashMap<ClientId, ClientLease>>,
    next_client: AtomicU64,
    waits_for: WaitsFor,
    /// The waits-for table's blocks, grown on demand.
    waits_for_chain: WaitsForChain,
    lock_params: ClusterLockParams,
    lock_host: LockHostInfo,
    /// Who may touch which server memory (grants at every NIC).
    access: Arc<Access>,
    /// The RPC service's connections, to cut a fenced client's.
    connections: Arc<std::sync::OnceLock<Connections>>,
    /// Citron's cluster-wide T_wait: the clients' needs.
    tuning: Arc<LockTuning>,
    /// Our cohort of the files' attribute ALocks.
    attr_host: AlockHost,
    /// What caching clients' kernels hold, and their invalidations.
    grants: Grants,
}

/// A registered client and when it last renewed its lease.
struct ClientLease {
    renewed: Instant,
    /// The client said it leaves: fenced at the reaper's next turn.
    leaving: bool,
    hostname: String,
    pid: u32,
    /// The options of the key it registered with (root squash).
    options: KeyOptions,
}

/// Grows a file's lock-record table from inside the meta-server.
struct NamespaceGrowth<'a> {
    service: &'a MetaService,
    ino: Ino,
}

impl TableGrowth for NamespaceGrowth<'_> {
    fn grow(&self, last: Option<RemoteAddr>) -> Result<RemoteAddr, FsError> {
        self.service.ns.lock().grow_lock_table(self.ino, last)
    }
}

impl WaitsForGrowth for NamespaceGrowth<'_> {
    fn grow_waits_for(&self, last: RemoteAddr) -> Result<RemoteAddr, FsError> {
        self.service.waits_for_chain.grow(last, &self.service.ns, &self.service.access)
    }
}

impl MetaService {
    /// A word of lock memory, as the meta-server's CPU sees it.
    fn lock_word(&self, addr: RemoteAddr) -> Option<u64> {
        let ns = self.ns.lock();
        ns.lock_memory_word(addr)
    }

    /// Runs `op` with `ino`'s attribute ALock held, taken *before* the
    /// namespace mutex (which `op` locks as it needs): waiting for the lock
    /// — a client holds it, or died holding it and is being recovered —
    /// never holds up the other requests.
    fn with_attr_locked<T>(&self, ino: Ino, op: impl FnOnce() -> Result<T, FsError>) -> Result<T, FsError> {
        let Some(lock) = self.ns.lock().attr_lock_of(ino) else { return op() };
        let lock_err = |e: citron_lock::rwlock::LockError| {
            FsError::Io(format!("attribute lock of inode {}: {e}", ino.0))
        };
        let mut local = self.attr_host.local().map_err(lock_err)?;
        let guard = local.lock(lock).map_err(lock_err)?;
        self.ns.lock().attr_held.insert(ino);
        let result = op();
        self.ns.lock().attr_held.remove(&ino);
        if let Err(e) = guard.unlock() {
            log::error!("releasing the attribute ALock of inode {}: {e}", ino.0);
        }
        result
    }

    fn link(&self, server: DataServerId) -> Result<Arc<DataServerLink>, FsError> {
        let links = self.data_servers.lock();
        links
            .iter()
            .find(|l| l.info.id == server)
            .cloned()
            .ok_or_else(|| FsError::Io(format!("unknown data server {}", server.0)))
    }

    fn zero(&self, ranges: &[ZeroRange]) -> Result<(), FsError> {
        for r in ranges {
            self.link(r.loc.server)?.zero(r.loc.addr + r.offset_in_chunk, r.len)?;
        }
        Ok(())
    }

    fn register_data_server(
        &self,
        nic: SocketAddr,
        shm: Option<String>,
        ib: Option<SocketAddr>,
        region: u32,
        capacity: u64,
    ) -> Result<MetaResponse, FsError> {
        let mut links = self.data_servers.lock();
        let id = DataServerId(self.next_data_server.fetch_add(1, Ordering::Relaxed) as u32);
        let credentials = server_credentials(&self.access);
        let link =
            DataServerLink::connect(DataServerInfo { id, nic, shm, ib }, RegionId(region), credentials)?;
        self.access.add_data_server(id, nic);
        self.ns.lock().extents.add_server(id, RegionId(region), capacity, link.discard());
        links.push(Arc::new(link));
        log::info!("data server {} at {nic}: {capacity} bytes", id.0);
        Ok(MetaResponse::DataServerRegistered(id))
    }

    /// Data server `id` is gone (it left, or stopped answering), and the
    /// file data in its memory with it. New extents go to the others; files
    /// that had extents there keep their names and attributes, and opening
    /// them or doing I/O answers EIO (their epochs change, so clients with
    /// a layout refetch it and learn); truncating or removing them works.
    fn lose_data_server(&self, id: DataServerId, why: &str) {
        let gone = {
            let mut links = self.data_servers.lock();
            let before = links.len();
            links.retain(|l| l.info.id != id);
            links.len() < before
        };
        if gone {
            let files = self.ns.lock().lose_data_server(id);
            log::warn!("data server {} is gone ({why}): {files} files lost data on it", id.0);
        }
    }

    /// Probes every data server through its NIC ([`DataServerLink::probe`]).
    /// A server that has not answered for a whole lease is lost
    /// ([`MetaService::lose_data_server`]): the lease is the bound a busy
    /// machine gets before anyone is declared dead, as for clients. Clients
    /// reaching it over tcp see errors before that; clients on its shm
    /// fabric learn from the epochs.
    fn probe_data_servers(&self) {
        let links = self.data_servers.lock().clone();
        let wait = (self.lease / 4).max(Duration::from_millis(100));
        for link in links {
            if link.probe(wait, self.lease) {
                self.lose_data_server(link.info.id, "it stopped answering for a lease");
            }
        }
    }

    /// Takes extents with `plan` (under the namespace lock), fills them
    /// outside it (zeroes old bytes, copies a moving chunk) and commits them.
    /// When the data servers are full, orphans still in their grace are
    /// freed at once and the plan is tried again: no wait, no quarantine.
    fn with_extents(
        &self,
        ino: Ino,
        plan: impl Fn(&mut Namespace) -> Result<ExtentPlan, FsError>,
    ) -> Result<Vec<(ChunkIndex, ChunkLoc)>, FsError> {
        let plan = {
            let mut ns = self.ns.lock();
            ns.sweep_orphans();
            match plan(&mut ns) {
                Err(FsError::NoSpace) if ns.free_orphans_now() => plan(&mut ns)?,
                other => other?,
            }
        };
        if let Err(e) = self.fill(&plan) {
            log::error!("preparing extents of inode {}: {e}", ino.0);
            self.ns.lock().abandon_extents(plan);
            return Err(e);
        }
        let mut ns = self.ns.lock();
        let chunks = ns.commit_extents(plan)?;
        if self.access.enforcing() {
            // Openers gain the new extents and lose a moved chunk's old one.
            let memory = ns.file_memory(ino);
            drop(ns);
            self.access.file_changed(ino, memory);
        }
        Ok(chunks)
    }

    /// Makes a plan's new extents ready for clients: a moving chunk's bytes
    /// copied, memory that may hold old bytes zeroed. Memory that held
    /// another file's bytes may still be granted to its former openers, so
    /// first nobody keeps a grant on it, as its NIC confirms (one round trip
    /// per data server, and only in a keyed cluster).
    fn fill(&self, plan: &ExtentPlan) -> Result<(), FsError> {
        let reused: Vec<Placed> =
            plan.steps.iter().filter(|s| s.zero).map(|s| crate::namespace::extent_memory(s.new)).collect();
        self.access.revoke_everyone(&reused).map_err(|e| FsError::Io(e.to_string()))?;
        for step in &plan.steps {
            let dest = self.link(step.new.server)?;
            if let Some(old) = step.old {
                self.link(old.server)?.copy(old.addr, step.copy, &dest, step.new.addr)?;
            }
            if step.zero && step.copy < step.new.capacity {
                dest.zero(step.new.addr + step.copy, step.new.capacity - step.copy)?;
            }
        }
        Ok(())
    }

    /// Fences clients whose lease ran out: the reclamation point first (it
    /// revokes their access where it can), then their lock records and waits
    /// go (their waiters are woken), then their opens. `ep` is the
    /// meta-server's own endpoint on its lock memory.
    fn expire_clients(&self, ep: &Endpoint, timing: &LockTiming) {
        let now = Instant::now();
        let expired: Vec<(ClientId, bool)> = {
            let mut clients = self.clients.lock();
            let dead: Vec<(ClientId, bool)> = clients
                .iter()
                .filter(|(_, l)| l.leaving || now.duration_since(l.renewed) > self.lease)
                .map(|(c, l)| (*c, l.leaving))
                .collect();
            for (c, _) in &dead {
                clients.remove(c);
                self.tuning.forget(*c);
            }
            dead
        };
        for (c, left) in expired {
            if left {
                log::info!("client {} left; releasing its locks and opens", c.0);
            } else {
                log::warn!("client {} missed its lease; releasing its locks and opens", c.0);
            }
            self.reclaim.fence(c);
            // Pinned, so no file's lock memory goes while we work on it.
            let tables = self.ns.lock().pin_lock_tables();
            let growth = |ino| NamespaceGrowth { service: self, ino };
            match lock_cleanup::release_client(ep, timing, &tables, self.waits_for, c, &growth) {
                Ok(n) if n > 0 => log::warn!("released {n} lock records of client {}", c.0),
                Ok(_) => {}
                Err(e) => log::error!("releasing the locks of client {}: {e}", c.0),
            }
            let mut ns = self.ns.lock();
            for t in &tables {
                ns.unpin(t.ino, Cause::Fenced(c));
            }
            ns.drop_client(c);
            self.grants.drop_client(c);
        }
        self.ns.lock().sweep_orphans();
        self.grants.prune();
    }

    /// The cluster as `citronfs status` shows it.
    fn status(&self) -> ClusterStatus {
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
        let infos: Vec<DataServerInfo> = self.data_servers.lock().iter().map(|l| l.info.clone()).collect();
        let data_servers = space
            .iter()
            .filter_map(|s| {
                let info = infos.iter().find(|i| i.id == s.id)?;
                Some(DataServerStatus {
                    id: s.id,
                    nic: info.nic,
                    shm: info.shm.clone(),
                    capacity: s.capacity,
                    used: s.capacity - s.free,
                    free: s.free,
                    extents: s.extents,
                    largest_free: s.largest_free,
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
            },
        }
    }

    /// Bytes of the tree host's arena in use.
    fn trees_in_use(&self) -> u64 {
        self.trees.as_ref().map_or(0, |h| self.tree_bytes.saturating_sub(h.free_bytes()))
    }
}

impl RpcService for MetaService {
    type Request = MetaRequest;
    type Response = MetaResponse;

    fn handle(&self, request: MetaRequest, peer: SocketAddr) -> MetaResponse {
        self.handle_from(request, &Peer { addr: peer, principal: Principal::Anonymous, connection: 0 })
    }

    fn handle_from(&self, mut request: MetaRequest, peer: &Peer) -> MetaResponse {
        let key_of = |name: &str| self.access.keyring().and_then(|r| r.get(name).cloned());
        let options = |c: ClientId| self.clients.lock().get(&c).map(|l| l.options);
        let caching = match request {
            MetaRequest::Caching { client, ttl_ms, request: inner } => {
                request = *inner;
                Some((client, Duration::from_millis(ttl_ms.min(MAX_GRANT_MS))))
            }
            _ => None,
        };
        match identity::vet(&peer.principal, &mut request, key_of, options) {
            Ok(Asker::Client(me, _)) if caching.is_some_and(|(c, _)| c != me) => {
                log::warn!("client {} sent a request as client {}; refused", me.0, caching.unwrap().0 .0);
                MetaResponse::Failed(FsError::Perm)
            }
            Ok(asker) => self.dispatch(&asker, caching, request).unwrap_or_else(MetaResponse::Failed),
            Err(e) => {
                log::warn!("meta: {} ({:?}) may not ask {request:?}: {e}", peer.addr, peer.principal);
                MetaResponse::Failed(e)
            }
        }
    }

    fn malformed(&self, error: String) -> MetaResponse {
        MetaResponse::Failed(FsError::Invalid(format!("malformed request: {error}")))
    }

    /// A session may connect while its client is registered (not fenced)
    /// with this incarnation; mailbox members never.
    fn admit(&self, principal: &Principal) -> Result<(), Status> {
        match principal {
            Principal::Session(s) => {
                let live = s.incarnation == self.access.incarnation()
                    && self.clients.lock().contains_key(&ClientId(s.client));
                if live {
                    Ok(())
                } else {
                    Err(Status::NotAdmitted)
                }
            }
            Principal::Member { .. } => Err(Status::NotAdmitted),
            _ => Ok(()),
        }
    }
}

/// A file's hosted Citron tree as it is now ([`MetaServer::citron_tree`]).
#[derive(Clone, Debug)]
pub struct CitronTreeState {
    pub instance: InstanceId,
    /// The configuration the tree host keeps (depths, segments, version).
    pub geometry: TreeGeometry,
    /// The deepest tree its scale-ups may make.
    pub max_depth: u32,
    /// The maximizer word (0 when no range waits for a scale-up).
    pub maximizer: u64,
    /// The spillover mutex's DSLR word.
    pub spillover: u64,
}

/// A running meta-server. Dropping it stops it.
pub struct MetaServer {
    rpc: RpcServer<Arc<MetaService>>,
    _lock_host: LockHost,
    /// The Citron tree host and its RPC service (with `grow_trees`), and the
    /// bytes of its arena.
    trees: Option<(Arc<LockMemoryHost>, TreeHostServer, u64)>,
    _range_server: Option<RangeLockServer>,
    nic: TcpHost,
    _shm: Option<ShmHost>,
    _ib: Option<IbHost>,
    stop: Arc<AtomicBool>,
    reaper_wake: std::sync::mpsc::Sender<()>,
    reaper: Option<JoinHandle<()>>,
    prober: Option<JoinHandle<()>>,
    /// Publishes Citron's T_wait.
    tuner: Option<JoinHandle<()>>,
}

impl MetaServer {
    pub fn start(config: MetaServerConfig) -> Result<Self, FsError> {
        let io = |e: std::io::Error| FsError::Io(e.to_string());
        let geometry_ok = citronfs_core::layout::ChunkGeometry::new(config.chunk_size);
        geometry_ok.map_err(FsError::Invalid)?;
        let granule = config.lock_choice.granule;
        if !granule.is_power_of_two() {
            return Err(FsError::Invalid(format!("lock granule {granule} is not a power of two")));
        }
        let slot_bytes = config.slot_bytes.next_multiple_of(4096);
        let lock_bytes = config.lock_bytes.next_multiple_of(4096);
        let (shm, regions, slots, locks) = match &config.shm {
            Some(name) => {
                let host = ShmHost::create(name)?;
                let slots = host.add_region(SLOT_REGION, slot_bytes)?;
                let locks = host.add_region(LOCK_REGION, lock_bytes)?;
                let regions = host.regions().clone();
                (Some(host), regions, slots, locks)
            }
            None => {
                let regions = Arc::new(RegionTable::new());
                let slots = regions
                    .insert(RegionMemory::anonymous(SLOT_REGION, slot_bytes).map_err(io)?)
                    .map_err(io)?;
                let locks = regions
                    .insert(RegionMemory::anonymous(LOCK_REGION, lock_bytes).map_err(io)?)
                    .map_err(io)?;
                (None, regions, slots, locks)
            }
        };
        // The tree host's arena is the top of the lock region.
        let grow = config.grow_trees && config.lock_choice.range == RangeAlgorithm::Citron;
        let tree_bytes = match (grow, config.tree_bytes) {
            (false, _) => 0,
            (true, 0) => lock_bytes / 2,
            (true, b) => b.min(lock_bytes / 4 * 3),
        } / 4096
            * 4096;
        let tree_start = lock_bytes - tree_bytes;
        if config.keyring.as_ref().is_some_and(|r| r.cluster_key().is_none()) {
            return Err(FsError::Invalid(
                "the meta-server's key file has no cluster key (role=server)".into(),
            ));
        }
        let authority = Authority::from_keyring(config.keyring.clone());
        let nic_access = Arc::new(AccessTable::default());
        let access = Arc::new(Access::new(config.keyring.clone(), nic_access.clone(), config.grant_hold));
        let nic = TcpHost::spawn_with(config.nic_listen, regions.clone(), authority.clone(), nic_access)
            .map_err(io)?;
        let ib = match &config.ib {
            Some(device) => Some(IbHost::spawn(
                device,
                SocketAddr::new(config.nic_listen.ip(), 0),
                regions.clone(),
                authority.clone(),
            )?),
            None => None,
        };
        let mut lock_memory = LockMemory::below(locks.clone(), tree_start);
        // The cluster's own lock structures come first; a --lock-memory too
        // small for them is a configuration error, said as one.
        let mut fixed = |bytes: u64| {
            lock_memory.allocate(bytes).map_err(|_| {
                FsError::Invalid(format!(
                    "--lock-memory {lock_bytes} is too small for the cluster's lock services; give it at least 1MiB"
                ))
            })
        };
        let waits_for = WaitsFor {
            base: fixed(WaitsFor::bytes(config.max_waiting_owners))?,
            capacity: config.max_waiting_owners,
        };
        // Citron's T_wait, published for every client (lock_tuning).
        let tuning = Arc::new(LockTuning::new(
            fixed(citron_lock::citron::tuning::TWAIT_WORD_BYTES)?,
            Duration::from_micros(config.lock_params.t_wait_us),
        ));
        let lock_params = ClusterLockParams { published_t_wait: Some(tuning.word()), ..config.lock_params };
        let lock_err = |e: citron_lock::rwlock::LockError| FsError::Io(format!("lock host: {e}"));
        // The meta-server acts on its own lock memory as a client of its own
        // fabric (shm when published, else its NIC): the lease reaper's
        // cleanup, and the lock host's services. When it serves RDMA
        // clients, through its RNIC too: an RNIC's atomics are atomic only
        // with other RNIC atomics (ibv_atomic_cap HCA), not with the CPU's.
        let own_fabric = match (&ib, &config.shm) {
            (Some(h), _) => FabricAddr::Ib(citron_lock::rdma::IbFabric {
                device: h.device().clone(),
                host: match h.local_addr() {
                    a if a.ip().is_unspecified() => {
                        SocketAddr::new(std::net::Ipv4Addr::LOCALHOST.into(), a.port())
                    }
                    a => a,
                },
            }),
            (None, Some(name)) => FabricAddr::Shm(name.clone()),
            (None, None) => FabricAddr::Tcp(nic.local_addr()),
        };
        let node = match &own_fabric {
            FabricAddr::Shm(name) => Node::join_shm_as(name, server_credentials(&access))?,
            FabricAddr::Tcp(addr) => {
                Node::join_tcp_as(*addr, TcpOptions::default(), server_credentials(&access))?
            }
            ib => Node::join(ib)?,
        };
        // The lock host: ShiftLock's recovery service and the RPC lock
        // server (`--inode-lock rpc`).
        let host_config = LockHostConfig {
            rpc_listen: SocketAddr::new(config.listen.ip(), 0),
            rpc_lease: Some(config.lease),
            ..LockHostConfig::default()
        };
        let host_area = fixed(host_config.area_bytes())?;
        // Its ShiftLock recovery service must be reachable by clients of
        // every fabric: on shm, it gets a mailbox on our NIC too.
        let nic_node = match &own_fabric {
            FabricAddr::Shm(_) => {
                Some(Node::join_tcp_as(nic.local_addr(), TcpOptions::default(), server_credentials(&access))?)
            }
            _ => None,
        };
        let lock_host =
            LockHost::start_on(&node, nic_node.as_ref(), host_area, host_config, authority.clone())
                .map_err(lock_err)?;
        // The RPC range lock server, when files use it (`--range-lock rpc`).
        let range_server = match config.lock_choice.range {
            RangeAlgorithm::Rpc => Some(
                spawn_range_server_with(
                    SocketAddr::new(config.listen.ip(), 0),
                    RangeServerConfig::default(),
                    authority.clone(),
                )
                .map_err(io)?,
            ),
            _ => None,
        };
        // The Citron tree host: allocates and configures every file's tree
        // and runs its scale-ups as a client of this server's own memory,
        // with the timing every client derives from the cluster's shared
        // parameters (the spillover's lease above all).
        let trees =
            if grow {
                let probe = node.endpoint()?;
                let rtt = probe.measure_rtt(waits_for.base, 16).unwrap_or(Duration::from_micros(10));
                let timing = LockTiming::new_as(rtt, lock_params, node.credentials().host.clone());
                let host =
                    Arc::new(
                        LockMemoryHost::new(regions.clone(), LOCK_REGION, tree_start, lock_bytes)
                            .with_scaler(node.clone(), timing.ranges.citron, timing.ranges.dslr),
                    );
                let server =
                    host.serve_with(SocketAddr::new(config.listen.ip(), 0), authority.clone()).map_err(io)?;
                let arena = host.free_bytes();
                Some((host, server, arena))
            } else {
                None
            };
        // What every registered client may touch of lock memory: the
        // waits-for table, the lock host's area, the tree host's arena.
        let lock_extent =
            |start: RemoteAddr, len| Placed::new(ServerRef::Meta, Extent::new(start, len), Class::Lock);
        let mut membership = vec![
            lock_extent(waits_for.base, WaitsFor::bytes(config.max_waiting_owners)),
            lock_extent(tuning.word(), citron_lock::citron::tuning::TWAIT_WORD_BYTES),
            lock_extent(host_area, host_config.area_bytes()),
        ];
        if tree_bytes > 0 {
            membership.push(lock_extent(RemoteAddr::new(LOCK_REGION, tree_start), tree_bytes));
        }
        access.set_membership(membership);
        let max_depth = TreeShape::covering(config.max_tree_units.max(1)).depth();
        let tree_hosting = trees.as_ref().map(|(host, server, _)| TreeHosting {
            host: host.clone(),
            addr: server.local_addr(),
            max_depth,
        });
        // The meta-server's cohort of every file's attribute ALock.
        let pool_slots = 64;
        let pool = fixed(AlockLayout::pool_bytes(pool_slots))?;
        // Clients hold it for one batch of verbs, within the cluster's lock
        // lease; one that dies holding or queued is recovered by our threads
        // through an endpoint of our own (ALock's "Recovery").
        let alock_config = AlockConfig::from_rtt(Duration::from_micros(1))
            .with_lease(Duration::from_millis(lock_params.lease_ms));
        let attr_host = AlockHost::new(locks, pool, pool_slots, alock_config)
            .map_err(lock_err)?
            .with_recovery(node.endpoint()?);
        let areas = LockAreas::new(
            lock_memory,
            config.lock_choice,
            range_server.as_ref().map(|r| r.local_addr()),
            tree_hosting,
            lock_bytes,
        );
        let reclaim = Arc::new(Reclamation::new());
        let connections = Arc::new(std::sync::OnceLock::new());
        reclaim.set_revocation(Arc::new(NicRevocation {
            access: access.clone(),
            connections: connections.clone(),
        }));
        let (reaper_wake, reaper_woken) = std::sync::mpsc::channel();
        let service = Arc::new(MetaService {
            // The lookup-then-open window an orphan's grace covers is
            // microseconds; a second is ample.
            ns: Mutex::new(Namespace::new(
                slots,
                ExtentAllocator::new(config.chunk_size),
                FileLocking { areas, attr_host: attr_host.clone() },
                reclaim.clone(),
                config.root_owner,
                config.lease.min(Duration::from_secs(1)),
            )),
            reclaim,
            lock_bytes,
            tree_bytes: trees.as_ref().map_or(0, |(_, _, arena)| *arena),
            trees: trees.as_ref().map(|(host, _, _)| host.clone()),
            chunk_size: config.chunk_size,
            lease: config.lease,
            nic: nic.local_addr(),
            shm: config.shm.clone(),
            ib: ib.as_ref().map(IbHost::local_addr),
            data_servers: Mutex::new(Vec::new()),
            next_data_server: AtomicU64::new(1),
            reaper_wake: Mutex::new(reaper_wake.clone()),
            clients: Mutex::new(HashMap::new()),
            next_client: AtomicU64::new(1),
            waits_for,
            waits_for_chain: WaitsForChain::new(waits_for),
            lock_params,
            lock_host: lock_host.info().clone(),
            access,
            connections,
            tuning: tuning.clone(),
            attr_host,
            grants: Grants::default(),
        });
        let rpc = RpcServer::spawn_with(config.listen, service.clone(), "meta", authority).map_err(io)?;
        let _ = service.connections.set(rpc.connections());
        let stop = Arc::new(AtomicBool::new(false));
        let tuner = tuning.spawn(node.endpoint()?, stop.clone()).map_err(io)?;
        let reaper = {
            let stop = stop.clone();
            let service = service.clone();
            let tick = (config.lease / 4).max(Duration::from_millis(20));
            std::thread::Builder::new()
                .name("meta-leases".into())
                .spawn(move || {
                    let ep = match node.endpoint() {
                        Ok(ep) => ep,
                        Err(e) => {
                            log::error!("the lease reaper cannot reach lock memory: {e}");
                            return;
                        }
                    };
                    let rtt = ep.measure_rtt(waits_for.base, 16).unwrap_or(Duration::from_micros(10));
                    let timing = LockTiming::new_as(rtt, lock_params, node.credentials().host.clone());
                    while !stop.load(Ordering::Relaxed) {
                        // A tick, or sooner: a client left, or shutdown.
                        let _ = reaper_woken.recv_timeout(tick);
                        if stop.load(Ordering::Relaxed) {
                            break;
                        }
                        service.expire_clients(&ep, &timing);
                    }
                })
                .map_err(io)?
        };
        let prober = {
            let stop = stop.clone();
            let service = service.clone();
            let tick = (config.lease / 4).max(Duration::from_millis(20));
            std::thread::Builder::new()
                .name("meta-data-probe".into())
                .spawn(move || {
                    let mut last = Instant::now();
                    while !stop.load(Ordering::Relaxed) {
                        // Short naps, so shutdown does not wait a tick.
                        std::thread::sleep(Duration::from_millis(20).min(tick));
                        if last.elapsed() >= tick {
                            last = Instant::now();
                            service.probe_data_servers();
                        }
                    }
                })
                .map_err(io)?
        };
        log::info!("meta-server on {} (nic {})", rpc.local_addr(), nic.local_addr());
        Ok(Self {
            rpc,
            nic,
            _shm: shm,
            _ib: ib,
            stop,
            reaper_wake,
            reaper: Some(reaper),
            prober: Some(prober),
            tuner: Some(tuner),
            _lock_host: lock_host,
            _range_server: range_server,
            trees,
        })
    }

    /// Blocks of the waits-for table now (it grows as more owners wait).
    pub fn waits_for_blocks(&self) -> usize {
        self.rpc.service().waits_for_chain.blocks()
    }

    /// Lock memory handed out and not freed, in bytes: files' lock areas and
    /// record tables, the waits-for table and the lock services' areas, and
    /// the Citron trees (with their later segments) on the tree host.
    pub fn lock_memory_in_use(&self) -> u64 {
        let service = self.rpc.service();
        let areas = service.ns.lock().lock_memory_in_use();
        areas + service.trees_in_use()
    }

    /// The cluster as `citronfs status` shows it.
    pub fn status(&self) -> ClusterStatus {
        self.rpc.service().status()
    }

    /// The reclamation point, where NIC revocation of fenced clients plugs
    /// in ([`Reclamation::set_revocation`]).
    pub fn reclamation(&self) -> Arc<Reclamation> {
        self.rpc.service().reclaim.clone()
    }

    /// A file's lock area while it has lock memory (diagnostics, tests).
    pub fn lock_area(&self, ino: Ino) -> Option<citronfs_core::locks::LockArea> {
        self.rpc.service().ns.lock().lock_area(ino)
    }

    /// Citron instances alive on the tree host.
    pub fn tree_instances(&self) -> usize {
        self.trees.as_ref().map_or(0, |(host, _, _)| host.instances())
    }

    /// What the tree host's scale-ups have done and cost.
    pub fn tree_scale_stats(&self) -> HostScaleStats {
        self.trees.as_ref().map_or_else(HostScaleStats::default, |(host, _, _)| host.scale_stats())
    }

    /// RPCs the tree host has answered (configurations, scale-ups).
    pub fn tree_host_requests(&self) -> u64 {
        self.trees.as_ref().map_or(0, |(_, server, _)| server.requests())
    }

    /// A word of lock memory as the meta-server's CPU sees it (diagnostics
    /// and tests: e.g. a file's Citron tree words, in a keyed cluster whose
    /// NICs would not let a test process read them); `None` if `addr` is
    /// not in lock memory.
    pub fn lock_word(&self, addr: RemoteAddr) -> Option<u64> {
        self.rpc.service().lock_word(addr)
    }

    /// The state of a file's hosted Citron tree, read from lock memory
    /// (diagnostics and tests): `None` if the file has none.
    pub fn citron_tree(&self, ino: Ino) -> Option<CitronTreeState> {
        let (host, _, _) = self.trees.as_ref()?;
        let (instance, site) = self.rpc.service().ns.lock().hosted_tree(ino)?;
        let RangeLockSite::CitronHosted { spillover, max_depth, .. } = site else { return None };
        let geometry = host.instance(instance).configuration().ok()?;
        let word = |a| self.rpc.service().lock_word(a);
        Some(CitronTreeState {
            instance,
            maximizer: word(geometry.maximizer)?,
            spillover: word(spillover)?,
            geometry,
            max_depth,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.rpc.local_addr()
    }

    pub fn nic_addr(&self) -> SocketAddr {
        self.nic.local_addr()
    }

    /// Connections and requests the meta-server's NIC has served.
    pub fn nic_stats(&self) -> &citron_lock::rdma::tcp::ServerStats {
        self.nic.stats()
    }

    /// Who may touch which memory through the meta-server's own NIC.
    pub fn nic_access(&self) -> &Arc<AccessTable> {
        self.nic.access()
    }

    /// The grants of the whole cluster (diagnostics, tests).
    pub fn access(&self) -> &Arc<Access> {
        &self.rpc.service().access
    }

    /// Connections refused in the handshake by the meta-server's RPC
    /// service and its NIC.
    pub fn refused_handshakes(&self) -> u64 {
        let rpc = self.rpc.stats().refused_handshakes.load(Ordering::Relaxed);
        rpc + self.nic.stats().refused_handshakes.load(Ordering::Relaxed)
    }

    /// Cuts every connection and stops serving, as a crash would.
    pub fn shutdown(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.reaper_wake.send(());
        self.rpc.shutdown();
        if let Some((_, server, _)) = self.trees.as_mut() {
            server.shutdown();
        }
        self.nic.shutdown();
        if let Some(r) = self.reaper.take() {
            let _ = r.join();
        }
        if let Some(p) = self.prober.take() {
            let _ = p.join();
        }
        if let Some(t) = self.tuner.take() {
            let _ = t.join();
        }
    }
}

impl Drop for MetaServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}
