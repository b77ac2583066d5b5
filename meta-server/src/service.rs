//! The meta-server process: the namespace behind an RPC service, its own
//! software NIC serving attribute slots (and, with the lock issues, lock
//! memory), the registry of data servers, and client leases.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use citron_lock::rdma::tcp::{RpcServer, RpcService};
use citron_lock::rdma::{Endpoint, Node, RegionId, RegionMemory, RegionTable, ShmHost, TcpHost, TcpOptions};
use citronfs_core::proto::{ClusterInfo, DataServerInfo, MetaRequest, MetaResponse};
use citronfs_core::types::{Caller, ClientId, DataServerId, FileKind};
use citronfs_core::FsError;
use parking_lot::Mutex;

use crate::chunks::ChunkAllocator;
use crate::namespace::{Namespace, NewInode, ZeroRange};

/// The region of the meta-server's NIC that holds attribute slots.
pub const SLOT_REGION: RegionId = RegionId(1);

#[derive(Clone, Debug)]
pub struct MetaServerConfig {
    /// Where the RPC service listens.
    pub listen: SocketAddr,
    /// Where the meta-server's own software NIC listens (port 0: any).
    pub nic_listen: SocketAddr,
    pub chunk_size: u64,
    /// Bytes of attribute slots (32 per regular file).
    pub slot_bytes: u64,
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
    clients: Mutex<HashMap<ClientId, Instant>>,
    next_client: AtomicU64,
}

impl MetaService {
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

    fn expire_clients(&self) {
        let now = Instant::now();
        let expired: Vec<ClientId> = {
            let mut clients = self.clients.lock();
            let dead: Vec<ClientId> = clients
                .iter()
                .filter(|(_, t)| now.duration_since(**t) > self.lease)
                .map(|(c, _)| *c)
                .collect();
            for c in &dead {
                clients.remove(c);
            }
            dead
        };
        for c in expired {
            log::warn!("client {} missed its lease; dropping its opens", c.0);
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
                self.clients.lock().insert(client, Instant::now());
                log::info!("client {} registered: {hostname} pid {pid}", client.0);
                A::Registered(ClusterInfo {
                    client,
                    chunk_size: self.chunk_size,
                    meta_nic: self.nic,
                    meta_shm: self.shm.clone(),
                    data_servers: self.data_servers.lock().iter().map(|l| l.info.clone()).collect(),
                    lease_ms: self.lease.as_millis() as u64,
                })
            }
            R::DataServers => {
                A::DataServers(self.data_servers.lock().iter().map(|l| l.info.clone()).collect())
            }
            R::Heartbeat { client } => {
                let mut clients = self.clients.lock();
                match clients.get_mut(&client) {
                    Some(t) => *t = Instant::now(),
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
                let (attr, zero) = self.ns.lock().setattr(ino, &set)?;
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
            R::AllocChunks { ino, chunks } => {
                let allocation = self.with_space(|ns| ns.alloc_chunks(ino, &chunks))?;
                self.zero(&allocation.zero)?;
                A::Chunks(allocation.chunks)
            }
            R::Fallocate { ino, offset, len, keep_size } => {
                let zero = self.with_space(|ns| ns.fallocate(ino, offset, len, keep_size))?;
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

/// A running meta-server. Dropping it stops it.
pub struct MetaServer {
    rpc: RpcServer<Arc<MetaService>>,
    nic: TcpHost,
    _shm: Option<ShmHost>,
    stop: Arc<AtomicBool>,
    reaper: Option<JoinHandle<()>>,
}

impl MetaServer {
    pub fn start(config: MetaServerConfig) -> Result<Self, FsError> {
        let io = |e: std::io::Error| FsError::Io(e.to_string());
        let geometry_ok = citronfs_core::layout::ChunkGeometry::new(config.chunk_size);
        geometry_ok.map_err(FsError::Invalid)?;
        let slot_bytes = config.slot_bytes.next_multiple_of(4096);
        let (shm, regions, slots) = match &config.shm {
            Some(name) => {
                let host = ShmHost::create(name)?;
                let slots = host.add_region(SLOT_REGION, slot_bytes)?;
                let regions = host.regions().clone();
                (Some(host), regions, slots)
            }
            None => {
                let regions = Arc::new(RegionTable::new());
                let slots = regions
                    .insert(RegionMemory::anonymous(SLOT_REGION, slot_bytes).map_err(io)?)
                    .map_err(io)?;
                (None, regions, slots)
            }
        };
        let nic = TcpHost::spawn(config.nic_listen, regions).map_err(io)?;
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
        });
        let rpc = RpcServer::spawn(config.listen, service.clone(), "meta").map_err(io)?;
        let stop = Arc::new(AtomicBool::new(false));
        let reaper = {
            let stop = stop.clone();
            let service = service.clone();
            let tick = (config.lease / 4).max(Duration::from_millis(20));
            std::thread::Builder::new()
                .name("meta-leases".into())
                .spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        std::thread::sleep(tick);
                        service.expire_clients();
                    }
                })
                .map_err(io)?
        };
        log::info!("meta-server on {} (nic {})", rpc.local_addr(), nic.local_addr());
        Ok(Self { rpc, nic, _shm: shm, stop, reaper: Some(reaper) })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.rpc.local_addr()
    }

    pub fn nic_addr(&self) -> SocketAddr {
        self.nic.local_addr()
    }

    /// Cuts every connection and stops serving, as a crash would.
    pub fn shutdown(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        self.rpc.shutdown();
        self.nic.shutdown();
        if let Some(r) = self.reaper.take() {
            let _ = r.join();
        }
    }
}

impl Drop for MetaServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}
