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
//! tables, the waits-for table). A file's first open creates an instance
//! (the tree [`citronfs_core::locks::LockArea::plan`] would have sized, and
//! its DSLR spillover word, allocated from the instance so it goes with it)
//! and the open reply names it ([`RangeLockSite::CitronHosted`]); freeing
//! the inode destroys it with every segment its scale-ups added.
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
//! scale-down requires (§3.9.2); a truncated file keeps its tree until the
//! inode is freed.

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
use citron_lock::range_lock::rpc::{spawn_range_server, RangeLockServer, RangeServerConfig};
use citron_lock::range_lock::RangeAlgorithm;
use citron_lock::range_lock::RangeLockSite;
use citron_lock::rdma::tcp::{RpcServer, RpcService};
use citron_lock::rdma::{
    Endpoint, FabricAddr, Node, RegionId, RegionMemory, RegionTable, RemoteAddr, ShmHost, TcpHost, TcpOptions,
};
use citronfs_core::locks::area::LockChoice;
use citronfs_core::locks::table::TableGrowth;
use citronfs_core::locks::{ClusterLockParams, LockTiming, WaitsFor};
use citronfs_core::proto::{ClientInfo, ClusterInfo, DataServerInfo, MetaRequest, MetaResponse};
use citronfs_core::types::{Caller, ClientId, DataServerId, FileKind, Ino};
use citronfs_core::FsError;
use parking_lot::Mutex;

use crate::chunks::ChunkAllocator;
use crate::lock_cleanup;
use crate::lock_memory::LockMemory;
use crate::lock_tuning::LockTuning;
use crate::namespace::{FileLocking, Namespace, NewInode, TreeHosting, ZeroRange};

/// The region of the meta-server's NIC that holds attribute slots.
pub const SLOT_REGION: RegionId = RegionId(1);
/// The region that holds lock memory (lock areas, record tables, waits-for,
/// and at its top the Citron tree host's arena).
pub const LOCK_REGION: RegionId = RegionId(2);
/// Default cap of a file's Citron tree: 2^22 units (16 GiB of 4 KiB
/// granules), a depth-8 tree of 700 KB of lock memory.
pub const DEFAULT_MAX_TREE_UNITS: u64 = 1 << 22;

#[derive(Clone, Debug)]
pub struct MetaServerConfig {
    /// Where the RPC service listens.
    pub listen: SocketAddr,
    /// Where the meta-server's own software NIC listens (port 0: any).
    pub nic_listen: SocketAddr,
    pub chunk_size: u64,
    /// Bytes of attribute slots (32 per regular file).
    pub slot_bytes: u64,
    /// Bytes of lock memory (a few hundred bytes per open file, 2 KiB per
    /// lock-record table block).
    pub lock_bytes: u64,
    /// How files are locked: `--range-lock`, `--inode-lock`, the granule.
    pub lock_choice: LockChoice,
    /// Most POSIX owners blocked at once, cluster-wide (deadlock checks).
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
}

impl MetaServerConfig {
    pub fn new(listen: SocketAddr) -> Self {
        Self {
            listen,
            nic_listen: SocketAddr::new(listen.ip(), 0),
            chunk_size: 1 << 20,
            slot_bytes: 64 << 20,
            lock_bytes: 64 << 20,
            lock_choice: LockChoice::default(),
            max_waiting_owners: 256,
            lock_params: ClusterLockParams::default(),
            grow_trees: true,
            tree_bytes: 0,
            max_tree_units: DEFAULT_MAX_TREE_UNITS,
            lease: Duration::from_secs(5),
            root_owner: Caller::ROOT,
            shm: None,
        }
    }
}

struct DataServerLink {
    info: DataServerInfo,
    /// The meta-server's own endpoint to it, for zeroing recycled memory.
    endpoint: Mutex<Endpoint>,
}

pub struct MetaService {
    ns: Mutex<Namespace>,
    chunk_size: u64,
    lease: Duration,
    nic: SocketAddr,
    shm: Option<String>,
    data_servers: Mutex<Vec<Arc<DataServerLink>>>,
    clients: Mutex<HashMap<ClientId, ClientLease>>,
    next_client: AtomicU64,
    waits_for: WaitsFor,
    lock_params: ClusterLockParams,
    lock_host: LockHostInfo,
    /// Citron's cluster-wide T_wait: the clients' needs.
    tuning: Arc<LockTuning>,
    /// Our cohort of the files' attribute ALocks.
    attr_host: AlockHost,
}

/// A registered client and when it last renewed its lease.
struct ClientLease {
    renewed: Instant,
    hostname: String,
    pid: u32,
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

    fn zero(&self, ranges: &[ZeroRange]) -> Result<(), FsError> {
        if ranges.is_empty() {
            return Ok(());
        }
        let links = self.data_servers.lock().clone();
        for r in ranges {
            let link = links
                .iter()
                .find(|l| l.info.id == r.loc.server)
                .ok_or_else(|| FsError::Io(format!("unknown data server {:?}", r.loc.server)))?;
            let zeros = vec![0u8; r.len as usize];
            link.endpoint.lock().write(r.loc.addr + r.offset_in_chunk, &zeros)?;
        }
        Ok(())
    }

    fn register_data_server(
        &self,
        nic: SocketAddr,
        shm: Option<String>,
        region: u32,
        capacity: u64,
    ) -> Result<MetaResponse, FsError> {
        let node = Node::join_tcp(nic, TcpOptions::default())?;
        let endpoint = node.endpoint()?;
        let mut links = self.data_servers.lock();
        let id = DataServerId(links.len() as u32 + 1);
        self.ns.lock().chunks.add_server(id, RegionId(region), capacity);
        links.push(Arc::new(DataServerLink {
            info: DataServerInfo { id, nic, shm },
            endpoint: Mutex::new(endpoint),
        }));
        log::info!("data server {} at {nic}: {capacity} bytes", id.0);
        Ok(MetaResponse::DataServerRegistered(id))
    }

    /// Runs an allocation; when the data servers are full but freed chunks
    /// are in quarantine, waits for them (outside the namespace lock) rather
    /// than answer ENOSPC for space that is about to return.
    fn with_space<T>(&self, mut op: impl FnMut(&mut Namespace) -> Result<T, FsError>) -> Result<T, FsError> {
        loop {
            let wait = {
                let mut ns = self.ns.lock();
                ns.sweep_orphans();
                match op(&mut ns) {
                    Err(FsError::NoSpace) => match ns.next_space_event() {
                        Some(wait) => wait,
                        None => return Err(FsError::NoSpace),
                    },
                    other => return other,
                }
            };
            std::thread::sleep(wait.max(Duration::from_millis(1)));
        }
    }

    /// Fences clients whose lease ran out: their lock records and waits go
    /// (their waiters are woken), then their opens. `ep` is the
    /// meta-server's own endpoint on its lock memory.
    fn expire_clients(&self, ep: &Endpoint, timing: &LockTiming) {
        let now = Instant::now();
        let expired: Vec<ClientId> = {
            let mut clients = self.clients.lock();
            let dead: Vec<ClientId> = clients
                .iter()
                .filter(|(_, l)| now.duration_since(l.renewed) > self.lease)
                .map(|(c, _)| *c)
                .collect();
            for c in &dead {
                clients.remove(c);
                self.tuning.forget(*c);
            }
            dead
        };
        for c in expired {
            log::warn!("client {} missed its lease; releasing its locks and opens", c.0);
            let tables = self.ns.lock().lock_tables();
            let growth = |ino| NamespaceGrowth { service: self, ino };
            match lock_cleanup::release_client(ep, timing, &tables, self.waits_for, c, &growth) {
                Ok(n) if n > 0 => log::warn!("released {n} lock records of client {}", c.0),
                Ok(_) => {}
                Err(e) => log::error!("releasing the locks of client {}: {e}", c.0),
            }
            self.ns.lock().drop_client(c);
        }
        self.ns.lock().sweep_orphans();
    }

    fn dispatch(&self, request: MetaRequest) -> Result<MetaResponse, FsError> {
        use MetaRequest as R;
        use MetaResponse as A;
        Ok(match request {
            R::RegisterClient { hostname, pid } => {
                let client = ClientId(self.next_client.fetch_add(1, Ordering::Relaxed));
                if client.0 >= 1 << 24 {
                    // Claimed lock slots carry 24 bits of the claimer.
                    return Err(FsError::Invalid("client ids are exhausted; restart the meta-server".into()));
                }
                self.clients
                    .lock()
                    .insert(client, ClientLease { renewed: Instant::now(), hostname: hostname.clone(), pid });
                log::info!("client {} registered: {hostname} pid {pid}", client.0);
                A::Registered(ClusterInfo {
                    client,
                    chunk_size: self.chunk_size,
                    meta_nic: self.nic,
                    meta_shm: self.shm.clone(),
                    data_servers: self.data_servers.lock().iter().map(|l| l.info.clone()).collect(),
                    lease_ms: self.lease.as_millis() as u64,
                    waits_for: self.waits_for,
                    lock_params: self.lock_params,
                    lock_host: self.lock_host.clone(),
                })
            }
            R::DataServers => {
                A::DataServers(self.data_servers.lock().iter().map(|l| l.info.clone()).collect())
            }
            R::Heartbeat { client } => {
                let mut clients = self.clients.lock();
                match clients.get_mut(&client) {
                    Some(l) => l.renewed = Instant::now(),
                    // Fenced: its opens are gone; it must register again.
                    None => return Err(FsError::Io("lease expired: client was fenced".into())),
                }
                A::Done
            }
            R::RegisterDataServer { nic, shm, region, capacity } => {
                self.register_data_server(nic, shm, region, capacity)?
            }
            R::Lookup { parent, name, .. } => A::Attr(self.ns.lock().lookup(parent, &name)?),
            R::GetAttr { ino } => A::Attr(self.ns.lock().attr(ino)?),
            R::SetAttr { ino, set, .. } => {
                let (attr, zero) = if set.size.is_some() || set.mtime.is_some() {
                    self.with_attr_locked(ino, || self.ns.lock().setattr(ino, &set))?
                } else {
                    self.ns.lock().setattr(ino, &set)?
                };
                self.zero(&zero)?;
                A::Attr(attr)
            }
            R::Create { caller, parent, name, kind, perm, rdev } => {
                if kind == FileKind::Symlink {
                    return Err(FsError::Invalid("symlinks are made with Symlink".into()));
                }
                let new = NewInode { kind, perm, rdev, symlink_target: None };
                A::Attr(self.ns.lock().create(caller, parent, &name, new)?)
            }
            R::Symlink { caller, parent, name, target } => {
                let new =
                    NewInode { kind: FileKind::Symlink, perm: 0o777, rdev: 0, symlink_target: Some(target) };
                A::Attr(self.ns.lock().create(caller, parent, &name, new)?)
            }
            R::ReadLink { ino } => A::Target(self.ns.lock().readlink(ino)?),
            R::Link { ino, new_parent, new_name, .. } => {
                A::Attr(self.ns.lock().link(ino, new_parent, &new_name)?)
            }
            R::Unlink { parent, name, .. } => {
                self.ns.lock().unlink(parent, &name)?;
                A::Done
            }
            R::Rmdir { parent, name, .. } => {
                self.ns.lock().rmdir(parent, &name)?;
                A::Done
            }
            R::Rename { parent, name, new_parent, new_name, flags, .. } => {
                self.ns.lock().rename(parent, &name, new_parent, &new_name, flags)?;
                A::Done
            }
            R::ReadDir { ino, after, max, .. } => {
                A::Entries(self.ns.lock().readdir(ino, after, max.min(4096))?)
            }
            R::Access { ino, .. } => {
                // Permission checks are the kernel's (default_permissions);
                // this answers existence.
                self.ns.lock().attr(ino)?;
                A::Done
            }
            R::CreateOpen { caller, client, parent, name, perm } => {
                let new = NewInode { kind: FileKind::File, perm, rdev: 0, symlink_target: None };
                let mut ns = self.ns.lock();
                let attr = ns.create(caller, parent, &name, new)?;
                let layout = ns.open(client, attr.ino)?;
                A::Opened(attr, layout)
            }
            R::Open { client, ino } => A::Layout(self.ns.lock().open(client, ino)?),
            R::Layout { ino } => A::Layout(self.ns.lock().layout(ino)?),
            R::Release { client, ino } => {
                self.ns.lock().release(client, ino)?;
                A::Done
            }
            R::GrowLockTable { ino, last } => A::LockTable(self.ns.lock().grow_lock_table(ino, last)?),
            R::Clients => A::Clients(
                self.clients
                    .lock()
                    .iter()
                    .map(|(id, l)| ClientInfo { id: *id, hostname: l.hostname.clone(), pid: l.pid })
                    .collect(),
            ),
            R::AllocChunks { ino, chunks } => {
                let allocation = self.with_space(|ns| ns.alloc_chunks(ino, &chunks))?;
                self.zero(&allocation.zero)?;
                A::Chunks(allocation.chunks)
            }
            R::Fallocate { ino, offset, len, keep_size } => {
                let fallocate = || self.with_space(|ns| ns.fallocate(ino, offset, len, keep_size));
                let zero = if keep_size { fallocate()? } else { self.with_attr_locked(ino, fallocate)? };
                self.zero(&zero)?;
                A::Done
            }
            R::StatFs => A::Stats(self.ns.lock().stats()),
            R::SetXattr { ino, name, value, mode, .. } => {
                self.ns.lock().set_xattr(ino, &name, &value, mode)?;
                A::Done
            }
            R::GetXattr { ino, name, .. } => A::Xattr(self.ns.lock().get_xattr(ino, &name)?),
            R::ListXattr { ino, .. } => A::XattrNames(self.ns.lock().list_xattr(ino)?),
            R::RemoveXattr { ino, name, .. } => {
                self.ns.lock().remove_xattr(ino, &name)?;
                A::Done
            }
            R::ReportLockTiming { client, t_wait_us } => {
                if !self.clients.lock().contains_key(&client) {
                    return Err(FsError::Io("lease expired: client was fenced".into()));
                }
                self.tuning.report(client, Duration::from_micros(t_wait_us));
                A::Done
            }
        })
    }
}

impl RpcService for MetaService {
    type Request = MetaRequest;
    type Response = MetaResponse;

    fn handle(&self, request: MetaRequest, _peer: SocketAddr) -> MetaResponse {
        self.dispatch(request).unwrap_or_else(MetaResponse::Failed)
    }

    fn malformed(&self, error: String) -> MetaResponse {
        MetaResponse::Failed(FsError::Invalid(format!("malformed request: {error}")))
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
    stop: Arc<AtomicBool>,
    reaper: Option<JoinHandle<()>>,
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
        let nic = TcpHost::spawn(config.nic_listen, regions.clone()).map_err(io)?;
        let mut lock_memory = LockMemory::below(locks.clone(), tree_start);
        let waits_for = WaitsFor {
            base: lock_memory.allocate(WaitsFor::bytes(config.max_waiting_owners))?,
            capacity: config.max_waiting_owners,
        };
        // Citron's T_wait, published for every client (lock_tuning).
        let tuning = Arc::new(LockTuning::new(
            lock_memory.allocate(citron_lock::citron::tuning::TWAIT_WORD_BYTES)?,
            Duration::from_micros(config.lock_params.t_wait_us),
        ));
        let lock_params = ClusterLockParams { published_t_wait: Some(tuning.word()), ..config.lock_params };
        let lock_err = |e: citron_lock::rwlock::LockError| FsError::Io(format!("lock host: {e}"));
        // The meta-server acts on its own lock memory as a client of its own
        // fabric (shm when published, else its NIC): the lease reaper's
        // cleanup, and the lock host's services.
        let own_fabric = match &config.shm {
            Some(name) => FabricAddr::Shm(name.clone()),
            None => FabricAddr::Tcp(nic.local_addr()),
        };
        let node = Node::join(&own_fabric)?;
        // The lock host: ShiftLock's recovery service and the RPC lock
        // server (`--inode-lock rpc`).
        let host_config = LockHostConfig {
            rpc_listen: SocketAddr::new(config.listen.ip(), 0),
            rpc_lease: Some(config.lease),
            ..LockHostConfig::default()
        };
        let host_area = lock_memory.allocate(host_config.area_bytes())?;
        let lock_host = LockHost::start(&node, host_area, host_config).map_err(lock_err)?;
        // The RPC range lock server, when files use it (`--range-lock rpc`).
        let range_server = match config.lock_choice.range {
            RangeAlgorithm::Rpc => Some(
                spawn_range_server(SocketAddr::new(config.listen.ip(), 0), RangeServerConfig::default())
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
                let timing = LockTiming::new(rtt, lock_params);
                let host =
                    Arc::new(
                        LockMemoryHost::new(regions.clone(), LOCK_REGION, tree_start, lock_bytes)
                            .with_scaler(node.clone(), timing.ranges.citron, timing.ranges.dslr),
                    );
                let server = host.serve(SocketAddr::new(config.listen.ip(), 0)).map_err(io)?;
                let arena = host.free_bytes();
                Some((host, server, arena))
            } else {
                None
            };
        let max_depth = TreeShape::covering(config.max_tree_units.max(1)).depth();
        let tree_hosting = trees.as_ref().map(|(host, server, _)| TreeHosting {
            host: host.clone(),
            addr: server.local_addr(),
            max_depth,
        });
        // The meta-server's cohort of every file's attribute ALock.
        let pool_slots = 64;
        let pool = lock_memory.allocate(AlockLayout::pool_bytes(pool_slots))?;
        // Clients hold it for one batch of verbs, within the cluster's lock
        // lease; one that dies holding or queued is recovered by our threads
        // through an endpoint of our own (ALock's "Recovery").
        let alock_config = AlockConfig::from_rtt(Duration::from_micros(1))
            .with_lease(Duration::from_millis(lock_params.lease_ms));
        let attr_host = AlockHost::new(locks, pool, pool_slots, alock_config)
            .map_err(lock_err)?
            .with_recovery(node.endpoint()?);
        // Freed chunks stay unused for a lease: a client whose I/O was in
        // flight when a truncate freed them finishes long before, and every
        // later I/O sees the epoch change first.
        let chunks = ChunkAllocator::new(config.chunk_size, config.lease);
        let service = Arc::new(MetaService {
            // The lookup-then-open window an orphan's grace covers is
            // microseconds; a second is ample.
            ns: Mutex::new(Namespace::new(
                slots,
                chunks,
                FileLocking {
                    memory: lock_memory,
                    choice: config.lock_choice,
                    range_server: range_server.as_ref().map(|r| r.local_addr()),
                    attr_host: attr_host.clone(),
                    trees: tree_hosting,
                },
                config.root_owner,
                config.lease.min(Duration::from_secs(1)),
            )),
            chunk_size: config.chunk_size,
            lease: config.lease,
            nic: nic.local_addr(),
            shm: config.shm.clone(),
            data_servers: Mutex::new(Vec::new()),
            clients: Mutex::new(HashMap::new()),
            next_client: AtomicU64::new(1),
            waits_for,
            lock_params,
            lock_host: lock_host.info().clone(),
            tuning: tuning.clone(),
            attr_host,
        });
        let rpc = RpcServer::spawn(config.listen, service.clone(), "meta").map_err(io)?;
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
                    let timing = LockTiming::new(rtt, lock_params);
                    while !stop.load(Ordering::Relaxed) {
                        std::thread::sleep(tick);
                        service.expire_clients(&ep, &timing);
                    }
                })
                .map_err(io)?
        };
        log::info!("meta-server on {} (nic {})", rpc.local_addr(), nic.local_addr());
        Ok(Self {
            rpc,
            nic,
            _shm: shm,
            stop,
            reaper: Some(reaper),
            tuner: Some(tuner),
            _lock_host: lock_host,
            _range_server: range_server,
            trees,
        })
    }

    /// Lock memory handed out and not freed, in bytes: files' lock areas and
    /// record tables, the waits-for table and the lock services' areas, and
    /// the Citron trees (with their later segments) on the tree host.
    pub fn lock_memory_in_use(&self) -> u64 {
        let areas = self.rpc.service().ns.lock().lock_memory_in_use();
        let trees = self.trees.as_ref().map_or(0, |(host, _, arena)| arena - host.free_bytes());
        areas + trees
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

    /// Cuts every connection and stops serving, as a crash would.
    pub fn shutdown(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        self.rpc.shutdown();
        if let Some((_, server, _)) = self.trees.as_mut() {
            server.shutdown();
        }
        self.nic.shutdown();
        if let Some(r) = self.reaper.take() {
            let _ = r.join();
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
