//! The client side of the file system: what a mount does.
//!
//! Metadata operations are RPCs to the meta-server. File data never goes
//! through a server's CPU: a client opens a file once (learning where its
//! chunks live, [`FileLayout`]) and then reads and writes chunk memory on the
//! data servers with one-sided verbs, and the file's size and mtime in its
//! attribute slot on the meta-server with one-sided atomics (Octopus's
//! client-active I/O; Citron paper §4.3's cacheless I/O: no data is cached).
//!
//! Verbs per operation, with the layout cached:
//! * read: 1 read of the slot (size, epoch) + 1 batch per data server touched;
//! * write: 1 read of the slot + 1 batch per data server + 1 batch on the
//!   slot (size CAS when the file grows, mtime store).
//!
//! A layout is refetched when the slot's epoch differs from the cached one
//! (the meta-server bumps it whenever extents are freed). A chunk's extent
//! may hold only the chunk's first bytes (`ChunkLoc::capacity`, DESIGN.md
//! §5): reads past it are zeros, and a write past it asks the meta-server
//! to move the chunk to a bigger extent under the inode mutex exclusive
//! ([`io`]).
//!
//! Lock addresses are used only while the file is open here ([`opens`]).

mod holds;
mod identity;
mod io;
mod locks;
mod opens;
mod renewal_priority;
pub mod stop_hook;
mod tuning;

pub use io::WriteMode;
pub use locks::LockCall;

use std::collections::HashMap;
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use citron_lock::range_lock::RangeLockSite;
use citron_lock::rdma::tcp::{RpcClient, RpcError};
use citron_lock::rdma::{Endpoint, IbDevice, IbFabric, Node, TcpOptions, Verb, VerbCounts, VerbReply};
use citron_rpc::auth::{HandshakeError, Status};
use parking_lot::{Mutex, RwLock};

use crate::error::FsError;
use crate::layout::ChunkGeometry;
use crate::locks::waiter::Waiters;
use crate::locks::{LockArea, LockTiming, WaitsFor};
use crate::proto::{
    AttrSlot, ClusterInfo, DataServerInfo, EntryPlus, FileLayout, Grant, Invalidation, MetaRequest,
    MetaResponse, RenameMode, XattrMode,
};
use crate::rpc_counts::{RpcCounters, RpcCounts};
use crate::types::{
    Attr, Caller, ChunkIndex, ChunkLoc, ClientId, DataServerId, DirEntry, FileKind, FsStats, Ino,
};

/// A regular file that [`FsClient::open_or_create`] opened.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Opened {
    pub attr: Attr,
    /// Whether it was created; `false`: the name existed and the existing
    /// file was opened.
    pub created: bool,
}

/// How long a last release waits for the calls that use the file's lock
/// memory (they are bounded by the locks' own give-up times).
const RELEASE_WAIT: Duration = Duration::from_secs(60);

/// How a client reaches server memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    /// The shm backend for servers on this host that publish a shm fabric,
    /// tcp for the others.
    Auto,
    /// Always the tcp software NIC (as a client on another host would).
    Tcp,
    /// Every server through its RDMA NIC (the `ib` backend), with
    /// [`ClientConfig::ib_device`] on this machine; a server that does not
    /// serve ib is an error.
    Ib,
}

/// How to reach a cluster and how long to wait for it.
#[derive(Clone, Debug)]
pub struct ClientConfig {
    pub meta: SocketAddr,
    /// Bound on every wait for a server: an unreachable one is an error
    /// (EIO at the mount) after this, never a hang.
    pub timeout: Duration,
    pub transport: Transport,
    /// The RDMA device of this machine, for [`Transport::Ib`].
    pub ib_device: Option<IbDevice>,
    /// The key this client proves (`--key-file`); `None` in a cluster
    /// without keys.
    pub key: Option<citron_rpc::auth::Key>,
    /// **Test only**: time added to every round trip to the servers (verbs
    /// and metadata calls), as if this client were that much farther away
    /// (see [`TcpOptions::added_rtt`]). A client with a delay never uses the
    /// shm backend.
    pub added_rtt: Duration,
}

impl ClientConfig {
    pub fn new(meta: SocketAddr) -> Self {
        Self {
            meta,
            timeout: Duration::from_secs(5),
            transport: Transport::Auto,
            ib_device: None,
            key: None,
            added_rtt: Duration::ZERO,
        }
    }

    fn tcp_options(&self) -> TcpOptions {
        TcpOptions { added_rtt: self.added_rtt, ..TcpOptions::with_timeouts(self.timeout, self.timeout) }
    }
}

/// How a server's memory can be reached, as the meta-server reported it.
struct ServerAddrs<'a> {
    nic: SocketAddr,
    shm: Option<&'a str>,
    ib: Option<SocketAddr>,
}

/// Joins a server's memory: its shm fabric when allowed and present on this
/// host, its NIC otherwise; with [`Transport::Ib`], its RDMA control channel.
fn join_server(
    server: ServerAddrs<'_>,
    transport: Transport,
    ib_device: Option<&IbDevice>,
    options: TcpOptions,
    credentials: citron_lock::rdma::NodeCredentials,
) -> Result<Node, FsError> {
    let ServerAddrs { nic, shm, ib } = server;
    if transport == Transport::Ib {
        let device = ib_device
            .ok_or_else(|| FsError::Invalid("--transport ib needs the RDMA device of this machine".into()))?;
        let host = ib.ok_or_else(|| {
            FsError::Io(format!(
                "the server at {nic} does not serve RDMA clients (start it with --ib DEVICE)"
            ))
        })?;
        return Ok(Node::join_ib(&IbFabric { device: device.clone(), host }, options, credentials)?);
    }
    // A client made far away for a test must not take the shortcut.
    if let (Transport::Auto, Some(name), true) = (transport, shm, options.added_rtt.is_zero()) {
        if citron_lock::rdma::shm::fabric_dir(name).exists() {
            match Node::join_shm_as(name, credentials.clone()) {
                Ok(node) => return Ok(node),
                Err(e) => log::warn!("shm fabric {name} present but unusable ({e}); using tcp"),
            }
        }
    }
    Ok(Node::join_tcp_as(nic, options, credentials)?)
}

/// The endpoints one thread uses: one to the meta-server's NIC (lock memory
/// and attribute slots) with the state its lock handles share, and one per
/// data server. Checked out of a pool for the duration of an operation.
struct Endpoints {
    meta: Endpoint,
    locks: citron_lock::lock_host::LockContext,
    data: HashMap<DataServerId, Endpoint>,
}

impl Endpoints {
    fn new(meta: Endpoint) -> Self {
        let locks = citron_lock::lock_host::LockContext::new(&meta);
        Self { meta, locks, data: HashMap::new() }
    }
}

struct CachedLayout {
    slot: AttrSlot,
    epoch: u64,
    allocs: u64,
    chunks: HashMap<ChunkIndex, ChunkLoc>,
}

/// A regular file's attribute slot as one read saw it (see [`AttrSlot`]).
#[derive(Clone, Copy, Debug)]
struct SlotWords {
    size: u64,
    epoch: u64,
    allocs: u64,
    perm: u16,
    gid: u32,
}

struct Shared {
    rpc: RpcClient<MetaRequest, MetaResponse>,
    /// What our connections prove (key, then session).
    identity: identity::Identity,
    client: AtomicU64,
    fenced: AtomicBool,
    /// Bumped at every registration after the first: locks and opens of an
    /// older registration are gone.
    registration: AtomicU64,
    /// When the last renewal that the meta-server acknowledged was sent.
    renewed: Mutex<std::time::Instant>,
    stop: AtomicBool,
    /// A test hook: while set, the lease is not renewed (the client is
    /// fenced a lease later, as if it were cut off).
    renewal_paused: AtomicBool,
    lease: Duration,
    hostname: String,
    /// The files open here and the lock memory lent with them.
    opens: opens::OpenFiles,
    /// Calls to the meta-server by kind.
    rpc_counts: RpcCounters,
    /// The TTL of the cache grants this client asks for, in ms (0: it does
    /// not cache; see [`FsClient::set_caching`]).
    caching_ms: AtomicU64,
}

impl Shared {
    /// One call to the meta-server, counted by kind.
    fn call(&self, request: &MetaRequest) -> Result<MetaResponse, RpcError> {
        self.rpc_counts.count(request.inner().kind());
        self.rpc.call(request)
    }

    /// Whether this client must stop acting: its lease was refused, or it
    /// has not renewed it for 3/4 of the lease (the meta-server fences at
    /// a whole lease after it last heard from us, which is later, so we stop
    /// writing before anyone may take our locks).
    fn fenced(&self) -> bool {
        self.fenced.load(Ordering::Relaxed) || self.renewed.lock().elapsed() > self.lease * 3 / 4
    }
}

pub struct FsClient {
    shared: Arc<Shared>,
    geometry: ChunkGeometry,
    transport: Transport,
    ib_device: Option<IbDevice>,
    /// How data servers are joined (timeouts, the test-only distance).
    tcp_options: TcpOptions,
    meta_node: Node,
    data_nodes: RwLock<HashMap<DataServerId, (DataServerInfo, Node)>>,
    pool: Mutex<Vec<Endpoints>>,
    layouts: RwLock<HashMap<Ino, Arc<RwLock<CachedLayout>>>>,
    /// Verbs of endpoints returned to the pool and dropped, for statistics.
    retired_counts: Mutex<VerbCounts>,
    heartbeat: Option<std::thread::JoinHandle<()>>,
    /// Reports the Citron T_wait this client needs ([`tuning`]).
    tuning: Option<std::thread::JoinHandle<()>>,
    timing: LockTiming,
    waits_for: WaitsFor,
    /// The lock host's services (inode mutex recovery, RPC lock server).
    lock_host: citron_lock::lock_host::LockHostInfo,
    /// The thread that serves blocked lock requests (`None` only while
    /// connecting).
    waiters: Option<Waiters>,
    /// (file, owner) pairs that may hold locks: a close by anyone else
    /// costs no verbs.
    may_hold: Arc<holds::Holds>,
}

fn answer(r: Result<MetaResponse, citron_lock::rdma::tcp::RpcError>) -> Result<MetaResponse, FsError> {
    match r? {
        MetaResponse::Failed(e) => Err(e),
        ok => Ok(ok),
    }
}

fn granted(r: MetaResponse) -> Result<(Attr, Grant), FsError> {
    match r {
        MetaResponse::Granted(a, g) => Ok((a, g)),
        MetaResponse::Attr(a) => Ok((a, Grant::default())),
        other => Err(unexpected(other)),
    }
}

fn unexpected(r: MetaResponse) -> FsError {
    FsError::Io(format!("unexpected answer from the meta-server: {r:?}"))
}

/// A server address the meta-server reported, with an unspecified IP
/// replaced by the one we reach the meta-server at.
fn reachable(addr: SocketAddr, meta: SocketAddr) -> SocketAddr {
    if addr.ip().is_unspecified() {
        SocketAddr::new(meta.ip(), addr.port())
    } else {
        addr
    }
}

impl FsClient {
    /// Registers with the meta-server and joins its NIC and every data server.
    pub fn connect(config: ClientConfig) -> Result<Self, FsError> {
        // Fail fast with a clear message if nobody listens there.
        TcpStream::connect_timeout(&config.meta, config.timeout)
            .map_err(|e| FsError::Io(format!("cannot reach the meta-server at {}: {e}", config.meta)))?;
        let identity = identity::Identity::new(config.key.clone());
        let rpc =
            RpcClient::new(config.meta, config.timeout).with_credentials(identity.credentials().clone());
        let hostname =
            std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default().trim().to_string();
        let info = match answer(
            rpc.call(&MetaRequest::RegisterClient { hostname: hostname.clone(), pid: std::process::id() }),
        )? {
            MetaResponse::Registered(info) => info,
            other => return Err(unexpected(other)),
        };
        identity.registered(&rpc, &info)?;
        let ClusterInfo {
            client,
            chunk_size,
            meta_nic,
            meta_shm,
            meta_ib,
            data_servers,
            lease_ms,
            waits_for,
            lock_params,
            lock_host,
            session: _,
        } = info;
        let geometry = ChunkGeometry::new(chunk_size).map_err(FsError::Invalid)?;
        let options = config.tcp_options();
        let meta_addrs = ServerAddrs {
            nic: reachable(meta_nic, config.meta),
            shm: meta_shm.as_deref(),
            ib: meta_ib.map(|a| reachable(a, config.meta)),
        };
        let meta_node = join_server(
            meta_addrs,
            config.transport,
            config.ib_device.as_ref(),
            options,
            identity.node_credentials(),
        )?;
        let shared = Arc::new(Shared {
            rpc,
            identity,
            client: AtomicU64::new(client.0),
            fenced: AtomicBool::new(false),
            registration: AtomicU64::new(0),
            renewed: Mutex::new(std::time::Instant::now()),
            stop: AtomicBool::new(false),
            renewal_paused: AtomicBool::new(false),
            lease: Duration::from_millis(lease_ms),
            hostname,
            opens: opens::OpenFiles::default(),
            rpc_counts: RpcCounters::default(),
            caching_ms: AtomicU64::new(0),
        });
        // Timing of the lock algorithms comes from this fabric's RTT.
        let probe = meta_node.endpoint()?;
        let rtt = probe.measure_rtt(waits_for.base, 32)?;
        let timing = LockTiming::new_as(rtt, lock_params, meta_node.credentials().host.clone());
        log::info!("lock-server RTT {rtt:?}");
        let mut c = Self {
            shared: shared.clone(),
            geometry,
            transport: config.transport,
            ib_device: config.ib_device.clone(),
            tcp_options: options,
            meta_node,
            data_nodes: RwLock::new(HashMap::new()),
            pool: Mutex::new(Vec::new()),
            layouts: RwLock::new(HashMap::new()),
            retired_counts: Mutex::new(VerbCounts::default()),
            heartbeat: None,
            tuning: None,
            timing,
            waits_for,
            lock_host,
            waiters: None,
            may_hold: Arc::default(),
        };
        c.add_data_servers(data_servers)?;
        let site = tuning::TuningSite { probe: waits_for.base, word: lock_params.published_t_wait };
        tuning::join(&shared, &probe, site, rtt)?;
        let reporter = {
            let (shared, ep) = (shared.clone(), c.meta_node.endpoint()?);
            std::thread::Builder::new()
                .name("citronfs-t-wait".into())
                .spawn(move || tuning::run(shared, ep, site, rtt))
                .map_err(|e| FsError::Io(e.to_string()))?
        };
        c.tuning = Some(reporter);
        c.start_waiters(probe)?;
        c.heartbeat = Some(
            std::thread::Builder::new()
                .name("citronfs-lease".into())
                .spawn(move || heartbeat_loop(&shared))
                .map_err(|e| FsError::Io(e.to_string()))?,
        );
        Ok(c)
    }

    /// How many times this client has had to register again after its
    /// lease was lost. Opens and locks of an older registration are gone.
    pub fn registration(&self) -> u64 {
        self.shared.registration.load(Ordering::Relaxed)
    }

    /// Whether the client is fenced right now (lease lost or not renewed
    /// in time): every lock and I/O call fails with EIO.
    pub fn is_fenced(&self) -> bool {
        self.shared.fenced()
    }

    /// A test hook: stops (`true`) or resumes renewing the lease, so a test
    /// gets this client fenced and registered again while its other
    /// threads go on (as a mount cut off from the network and back).
    #[doc(hidden)]
    pub fn pause_lease_renewal(&self, paused: bool) {
        // Relaxed: a flag the heartbeat thread polls; nothing is published
        // with it.
        self.shared.renewal_paused.store(paused, Ordering::Relaxed);
    }

    /// The meta-server's RPC address.
    pub fn meta_addr(&self) -> SocketAddr {
        self.shared.rpc.server()
    }

    /// What `citronfs status` shows.
    pub fn status(&self) -> Result<crate::status::ClusterStatus, FsError> {
        match self.call(&MetaRequest::Status)? {
            MetaResponse::Status(s) => Ok(*s),
            other => Err(unexpected(other)),
        }
    }

    pub fn client_id(&self) -> ClientId {
        ClientId(self.shared.client.load(Ordering::Relaxed))
    }

    pub fn chunk_size(&self) -> u64 {
        self.geometry.chunk_size()
    }

    fn add_data_servers(&self, servers: Vec<DataServerInfo>) -> Result<(), FsError> {
        let options = self.tcp_options;
        let mut nodes = self.data_nodes.write();
        for info in servers {
            if nodes.contains_key(&info.id) {
                continue;
            }
            let meta = self.shared.rpc.server();
            let addrs = ServerAddrs {
                nic: reachable(info.nic, meta),
                shm: info.shm.as_deref(),
                ib: info.ib.map(|a| reachable(a, meta)),
            };
            let node = join_server(
                addrs,
                self.transport,
                self.ib_device.as_ref(),
                options,
                self.shared.identity.node_credentials(),
            )?;
            nodes.insert(info.id, (info, node));
        }
        Ok(())
    }

    /// One call to the meta-server on behalf of a file-system operation;
    /// from a caching client, wrapped as [`MetaRequest::Caching`] so the
    /// meta-server knows whose kernel caches what.
    fn call(&self, request: &MetaRequest) -> Result<MetaResponse, FsError> {
        let ttl_ms = self.shared.caching_ms.load(Ordering::Relaxed);
        if ttl_ms == 0 {
            return self.call_plain(request);
        }
        let inner = Box::new(request.clone());
        let wrapped = MetaRequest::Caching { client: self.client_id(), ttl_ms, request: inner };
        self.call_plain(&wrapped)
    }

    fn call_plain(&self, request: &MetaRequest) -> Result<MetaResponse, FsError> {
        if self.shared.fenced() {
            return Err(FsError::Io(
                "this client's lease expired; it is fenced until it re-registers".into(),
            ));
        }
        if !self.tcp_options.added_rtt.is_zero() {
            std::thread::sleep(self.tcp_options.added_rtt);
        }
        answer(self.shared.call(request))
    }

    fn call_attr(&self, request: &MetaRequest) -> Result<Attr, FsError> {
        match self.call(request)? {
            // A caching client's lookups and getattrs are answered with a
            // grant; callers that do not hand the answer to the kernel
            // ignore it (the meta-server may call back for nothing).
            MetaResponse::Attr(a) | MetaResponse::Granted(a, _) => Ok(a),
            other => Err(unexpected(other)),
        }
    }

    fn call_done(&self, request: &MetaRequest) -> Result<(), FsError> {
        match self.call(request)? {
            MetaResponse::Done => Ok(()),
            other => Err(unexpected(other)),
        }
    }

    // ---- coherent caching (meta-server `grants`) ----

    /// From now on the kernel of this client's mount caches what the
    /// meta-server grants, for `ttl` (zero: nothing). Whoever sets it must
    /// run an invalidation thread ([`FsClient::await_invalidations`]), or
    /// every change elsewhere of what it was granted waits out the grant.
    pub fn set_caching(&self, ttl: Duration) {
        let ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX);
        self.shared.caching_ms.store(ms, Ordering::Relaxed);
    }

    /// The grant TTL this client asks for (zero: it does not cache).
    pub fn caching(&self) -> Duration {
        Duration::from_millis(self.shared.caching_ms.load(Ordering::Relaxed))
    }

    /// A lookup, and what of its answer the kernel may cache (nothing
    /// unless [`FsClient::set_caching`]).
    pub fn lookup_granted(&self, caller: Caller, parent: Ino, name: &[u8]) -> Result<(Attr, Grant), FsError> {
        granted(self.call(&MetaRequest::Lookup { caller, parent, name: name.to_vec() })?)
    }

    /// A getattr, and whether the kernel may cache its answer.
    pub fn getattr_granted(&self, ino: Ino) -> Result<(Attr, Grant), FsError> {
        granted(self.call(&MetaRequest::GetAttr { ino })?)
    }

    /// The long poll of the mount's invalidation thread: acknowledges the
    /// invalidations up to `acked` (the kernel has dropped what they name)
    /// and answers newer ones as soon as there are some (or none, after a
    /// while), with the number to acknowledge next. Numbers start again
    /// at zero for a new registration ([`FsClient::client_id`]).
    pub fn await_invalidations(&self, acked: u64) -> Result<(u64, Vec<Invalidation>), FsError> {
        let request = MetaRequest::AwaitInvalidations { client: self.client_id(), acked };
        match self.call_plain(&request)? {
            MetaResponse::Invalidations { through, items } => Ok((through, items)),
            other => Err(unexpected(other)),
        }
    }

    /// Whether the client has left the cluster ([`FsClient::shutdown`]).
    pub fn is_shut_down(&self) -> bool {
        self.shared.stop.load(Ordering::Relaxed)
    }

    // ---- metadata ----

    pub fn lookup(&self, caller: Caller, parent: Ino, name: &[u8]) -> Result<Attr, FsError> {
        self.call_attr(&MetaRequest::Lookup { caller, parent, name: name.to_vec() })
    }

    pub fn getattr(&self, ino: Ino) -> Result<Attr, FsError> {
        self.call_attr(&MetaRequest::GetAttr { ino })
    }

    pub fn create(
        &self,
        caller: Caller,
        parent: Ino,
        name: &[u8],
        kind: FileKind,
        perm: u16,
        rdev: u32,
    ) -> Result<Attr, FsError> {
        self.call_attr(&MetaRequest::Create { caller, parent, name: name.to_vec(), kind, perm, rdev })
    }

    pub fn symlink(&self, caller: Caller, parent: Ino, name: &[u8], target: &[u8]) -> Result<Attr, FsError> {
        self.call_attr(&MetaRequest::Symlink { caller, parent, name: name.to_vec(), target: target.to_vec() })
    }

    pub fn readlink(&self, ino: Ino) -> Result<Vec<u8>, FsError> {
        match self.call(&MetaRequest::ReadLink { ino })? {
            MetaResponse::Target(t) => Ok(t),
            other => Err(unexpected(other)),
        }
    }

    pub fn link(&self, caller: Caller, ino: Ino, new_parent: Ino, new_name: &[u8]) -> Result<Attr, FsError> {
        self.call_attr(&MetaRequest::Link { caller, ino, new_parent, new_name: new_name.to_vec() })
    }

    pub fn unlink(&self, caller: Caller, parent: Ino, name: &[u8]) -> Result<(), FsError> {
        self.call_done(&MetaRequest::Unlink { caller, parent, name: name.to_vec() })
    }

    pub fn rmdir(&self, caller: Caller, parent: Ino, name: &[u8]) -> Result<(), FsError> {
        self.call_done(&MetaRequest::Rmdir { caller, parent, name: name.to_vec() })
    }

    pub fn rename(
        &self,
        caller: Caller,
        parent: Ino,
        name: &[u8],
        new_parent: Ino,
        new_name: &[u8],
        flags: RenameMode,
    ) -> Result<(), FsError> {
        self.call_done(&MetaRequest::Rename {
            caller,
            parent,
            name: name.to_vec(),
            new_parent,
            new_name: new_name.to_vec(),
            flags,
        })
    }

    /// Entries after cookie `after` (0: from the start).
    pub fn readdir(&self, caller: Caller, ino: Ino, after: u64, max: u32) -> Result<Vec<DirEntry>, FsError> {
        match self.call(&MetaRequest::ReadDir { caller, ino, after, max })? {
            MetaResponse::Entries(e) => Ok(e),
            other => Err(unexpected(other)),
        }
    }

    /// Entries after cookie `after` with their attributes, and what of each
    /// the kernel may cache (nothing unless [`FsClient::set_caching`]).
    pub fn readdir_plus(
        &self,
        caller: Caller,
        ino: Ino,
        after: u64,
        max: u32,
    ) -> Result<Vec<EntryPlus>, FsError> {
        match self.call(&MetaRequest::ReadDirPlus { caller, ino, after, max })? {
            MetaResponse::EntriesPlus(e) => Ok(e),
            other => Err(unexpected(other)),
        }
    }

    pub fn statfs(&self) -> Result<FsStats, FsError> {
        match self.call(&MetaRequest::StatFs)? {
            MetaResponse::Stats(s) => Ok(s),
            other => Err(unexpected(other)),
        }
    }

    pub fn set_xattr(
        &self,
        caller: Caller,
        ino: Ino,
        name: &[u8],
        value: &[u8],
        mode: XattrMode,
    ) -> Result<(), FsError> {
        self.call_done(&MetaRequest::SetXattr {
            caller,
            ino,
            name: name.to_vec(),
            value: value.to_vec(),
            mode,
        })
    }

    pub fn get_xattr(&self, caller: Caller, ino: Ino, name: &[u8]) -> Result<Vec<u8>, FsError> {
        match self.call(&MetaRequest::GetXattr { caller, ino, name: name.to_vec() })? {
            MetaResponse::Xattr(v) => Ok(v),
            other => Err(unexpected(other)),
        }
    }

    pub fn list_xattr(&self, caller: Caller, ino: Ino) -> Result<Vec<Vec<u8>>, FsError> {
        match self.call(&MetaRequest::ListXattr { caller, ino })? {
            MetaResponse::XattrNames(v) => Ok(v),
            other => Err(unexpected(other)),
        }
    }

    pub fn remove_xattr(&self, caller: Caller, ino: Ino, name: &[u8]) -> Result<(), FsError> {
        self.call_done(&MetaRequest::RemoveXattr { caller, ino, name: name.to_vec() })
    }

    // ---- data ----

    /// Opens a regular file for reading and writing as root (counted by the
    /// meta-server until [`FsClient::release`]); the answer lends the
    /// file's lock memory.
    pub fn open(&self, ino: Ino) -> Result<(), FsError> {
        self.open_as(Caller::ROOT, ino, libc::O_RDWR)
    }

    /// Opens a regular file for I/O as `caller` with open(2) `flags` (the
    /// meta-server checks the caller may).
    pub fn open_as(&self, caller: Caller, ino: Ino, flags: i32) -> Result<(), FsError> {
        self.shared.opens.with_entry(ino, |e| {
            let registration = self.registration();
            match self.call(&MetaRequest::Open { caller, client: self.client_id(), ino, flags })? {
                MetaResponse::Layout(l) => {
                    self.count_open(e, registration, &l);
                    self.install_layout(l);
                    Ok(())
                }
                other => Err(unexpected(other)),
            }
        })
    }

    /// Creates a regular file and opens it for I/O, in one round trip;
    /// [`FsError::Exists`] if the name exists (`O_CREAT | O_EXCL`).
    pub fn create_open(&self, caller: Caller, parent: Ino, name: &[u8], perm: u16) -> Result<Attr, FsError> {
        let opened = self.create_or_open(caller, parent, name, perm, true)?;
        debug_assert!(opened.created);
        Ok(opened.attr)
    }

    /// `O_CREAT` without `O_EXCL`: creates a regular file, or opens the
    /// regular file of that name if there is one, in one round trip
    /// (counted by the meta-server until [`FsClient::release`]). Whoever
    /// opens an existing file checks the caller's access to it itself.
    pub fn open_or_create(
        &self,
        caller: Caller,
        parent: Ino,
        name: &[u8],
        perm: u16,
    ) -> Result<Opened, FsError> {
        self.create_or_open(caller, parent, name, perm, false)
    }

    fn create_or_open(
        &self,
        caller: Caller,
        parent: Ino,
        name: &[u8],
        perm: u16,
        exclusive: bool,
    ) -> Result<Opened, FsError> {
        let client = self.client_id();
        let registration = self.registration();
        let request =
            MetaRequest::CreateOpen { caller, client, parent, name: name.to_vec(), perm, exclusive };
        let (attr, layout, created) = match self.call(&request)? {
            MetaResponse::Opened(attr, layout) => (attr, layout, true),
            MetaResponse::OpenedExisting(attr, layout) => (attr, layout, false),
            other => return Err(unexpected(other)),
        };
        self.shared.opens.with_entry(attr.ino, |e| self.count_open(e, registration, &layout));
        self.install_layout(layout);
        Ok(Opened { attr, created })
    }

    /// Records an open the meta-server counted, and the lock memory it lent.
    fn count_open(&self, e: &mut opens::OpenFile, registration: u64, l: &FileLayout) {
        if e.registration != registration {
            // Opens of an older registration died with it.
            e.reset(false);
        }
        e.registration = registration;
        e.count += 1;
        let area = l.locks.map(|a| self.reachable_area(a));
        if e.area != area {
            e.table = None;
        }
        e.area = area;
    }

    /// Ends one open of `ino`. Only the last one here reaches the
    /// meta-server, handing back every open of the file this client made
    /// (the meta-server needs to know whether a client has a file open, not
    /// how often: grants, lock memory and an unlinked file's data all
    /// follow the last close). It first stops every use of the file's lock
    /// memory ([`opens`]): its blocked lock requests are cancelled and its
    /// addresses forgotten before the meta-server, which may then reuse the
    /// memory, hears of the release.
    pub fn release(&self, ino: Ino) -> Result<(), FsError> {
        let current = self.registration();
        let Some(entry) = self.shared.opens.get(ino) else {
            return self.call_done(&MetaRequest::Release { client: self.client_id(), ino, opens: 1 });
        };
        let mut e = entry.lock();
        if e.closed || e.registration != current {
            // The meta-server dropped it with an older registration.
            return Ok(());
        }
        if e.count > 1 {
            e.count -= 1;
            e.deferred += 1;
            return Ok(());
        }
        // Calls still using the addresses end first (a lock request of a
        // process the kernel abandoned may be running on another worker),
        // then the waits they may have handed to the waiter thread go.
        if !entry.wait_unpinned(&mut e, RELEASE_WAIT) {
            log::error!("inode {}: calls still use its lock memory after {RELEASE_WAIT:?}", ino.0);
        }
        if let Some(w) = self.waiters.as_ref() {
            w.cancel_file(ino);
        }
        let opens = e.deferred + 1;
        e.reset(true);
        self.shared.opens.forget(ino, &entry);
        self.layouts.write().remove(&ino);
        // Still holding the entry: an open of the file by another thread
        // reaches the meta-server after this release.
        self.call_done(&MetaRequest::Release { client: self.client_id(), ino, opens })
    }

    /// Files open on this client (each counted once).
    pub fn open_files(&self) -> usize {
        self.shared.opens.len()
    }

    /// Caches a layout fetched from the meta-server, never going back in
    /// time: threads of this client fetch concurrently, and a fetch sent
    /// before another thread's allocation may arrive after that thread
    /// added its chunks to the cache. Chunks are freed only with an epoch
    /// bump, so within one epoch the union of the cached and fetched maps is
    /// exact up to the larger allocation generation; a fetch of an older
    /// epoch than the cache's is stale and dropped.
    fn install_layout(&self, l: FileLayout) -> Arc<RwLock<CachedLayout>> {
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

    /// A lock area whose lock servers (a hosted Citron tree's host, the RPC
    /// range server) listen on an unspecified address: reached at the IP we
    /// reach the meta-server at.
    fn reachable_area(&self, mut area: LockArea) -> LockArea {
        let meta = self.shared.rpc.server();
        area.range = match area.range {
            RangeLockSite::CitronHosted { tree, depth, spillover, host, instance, max_depth } => {
                RangeLockSite::CitronHosted {
                    tree,
                    depth,
                    spillover,
                    host: reachable(host, meta),
                    instance,
                    max_depth,
                }
            }
            RangeLockSite::Rpc { server, instance } => {
                RangeLockSite::Rpc { server: reachable(server, meta), instance }
            }
            other => other,
        };
        area
    }

    fn refresh_layout(&self, ino: Ino) -> Result<Arc<RwLock<CachedLayout>>, FsError> {
        match self.call(&MetaRequest::Layout { ino })? {
            MetaResponse::Layout(l) => Ok(self.install_layout(l)),
            other => Err(unexpected(other)),
        }
    }

    fn layout(&self, ino: Ino) -> Result<Arc<RwLock<CachedLayout>>, FsError> {
        if let Some(l) = self.layouts.read().get(&ino) {
            return Ok(l.clone());
        }
        self.refresh_layout(ino)
    }

    fn with_endpoints<R>(&self, f: impl FnOnce(&mut Endpoints) -> Result<R, FsError>) -> Result<R, FsError> {
        if self.shared.fenced() {
            return Err(FsError::Io(
                "this client's lease expired; it is fenced until it re-registers".into(),
            ));
        }
        let mut eps = match self.pool.lock().pop() {
            Some(e) => e,
            None => Endpoints::new(self.meta_node.endpoint()?),
        };
        let result = f(&mut eps);
        // Expected errors (a refused lock, a missing file) leave the
        // endpoints as they were: keep them, so refusals open no connection
        // and use up no id. Only a failure may have broken them.
        if !result.as_ref().is_err_and(FsError::may_break_endpoints) {
            self.pool.lock().push(eps);
        } else {
            let mut c = eps.meta.counts();
            for e in eps.data.values() {
                c += e.counts();
            }
            *self.retired_counts.lock() += c;
        }
        result
    }

    /// Reads the slot. One verb.
    fn read_slot(eps: &Endpoints, slot: AttrSlot) -> Result<SlotWords, FsError> {
        let mut b = [0u8; AttrSlot::BYTES as usize];
        eps.meta.read(slot.0, &mut b)?;
        let word =
            |off: u64| u64::from_le_bytes(b[off as usize..off as usize + 8].try_into().expect("8 bytes"));
        Ok(SlotWords {
            size: word(AttrSlot::SIZE),
            epoch: word(AttrSlot::EPOCH),
            allocs: word(AttrSlot::ALLOCS),
            perm: word(AttrSlot::PERM) as u16,
            gid: (word(AttrSlot::PERM) >> 32) as u32,
        })
    }

    /// The cached layout, refetched if chunks were freed (epoch) or
    /// allocated by anyone (allocation generation) since it was taken; and
    /// the slot as read.
    fn current_layout(
        &self,
        eps: &Endpoints,
        ino: Ino,
    ) -> Result<(Arc<RwLock<CachedLayout>>, SlotWords), FsError> {
        let layout = self.layout(ino)?;
        let (slot, epoch, allocs) = {
            let l = layout.read();
            (l.slot, l.epoch, l.allocs)
        };
        let now = Self::read_slot(eps, slot)?;
        if now.epoch != epoch || now.allocs != allocs {
            return Ok((self.refresh_layout(ino)?, now));
        }
        Ok((layout, now))
    }

    /// The size of a regular file as its slot says (one verb).
    pub fn file_size(&self, ino: Ino) -> Result<u64, FsError> {
        self.with_endpoints(|eps| Ok(self.current_layout(eps, ino)?.1.size))
    }

    /// Runs one batch per data server; `verbs` are tagged with their server.
    fn execute_grouped(
        &self,
        eps: &mut Endpoints,
        verbs: Vec<(DataServerId, Verb, usize)>,
    ) -> Result<Vec<(usize, VerbReply)>, FsError> {
        let mut by_server: HashMap<DataServerId, (Vec<Verb>, Vec<usize>)> = HashMap::new();
        for (s, v, tag) in verbs {
            let e = by_server.entry(s).or_default();
            e.0.push(v);
            e.1.push(tag);
        }
        let mut out = Vec::new();
        for (server, (verbs, tags)) in by_server {
            let ep = match eps.data.entry(server) {
                std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::hash_map::Entry::Vacant(e) => e.insert(self.data_endpoint(server)?),
            };
            let replies = ep.execute(&verbs)?;
            for (r, tag) in replies.into_iter().zip(tags) {
                out.push((tag, r.map_err(|e| FsError::Io(format!("data server {}: {e}", server.0)))?));
            }
        }
        Ok(out)
    }

    fn data_endpoint(&self, server: DataServerId) -> Result<Endpoint, FsError> {
        if let Some((_, node)) = self.data_nodes.read().get(&server) {
            return Ok(node.endpoint()?);
        }
        // A data server that joined after us.
        match self.call(&MetaRequest::DataServers)? {
            MetaResponse::DataServers(list) => self.add_data_servers(list)?,
            other => return Err(unexpected(other)),
        }
        let nodes = self.data_nodes.read();
        let (_, node) =
            nodes.get(&server).ok_or_else(|| FsError::Io(format!("unknown data server {}", server.0)))?;
        Ok(node.endpoint()?)
    }

    /// Reads bytes `offset..end` (within the size) with one batch per data
    /// server; holes, and the part of a chunk past its extent, read as
    /// zeros. The caller holds the locks.
    fn read_data(
        &self,
        eps: &mut Endpoints,
        layout: &Arc<RwLock<CachedLayout>>,
        offset: u64,
        end: u64,
    ) -> Result<Vec<u8>, FsError> {
        let mut buf = vec![0u8; (end - offset) as usize];
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
        for (i, reply) in self.execute_grouped(eps, verbs)? {
            let p = pieces[i];
            match reply {
                VerbReply::Data(d) if d.len() as u64 <= p.len => {
                    let at = p.buf_offset as usize;
                    buf[at..at + d.len()].copy_from_slice(&d)
                }
                other => return Err(FsError::Io(format!("unexpected read reply {other:?}"))),
            }
        }
        Ok(buf)
    }

    /// Writes `data` at `offset` into the chunks' extents with one batch per
    /// data server, first giving chunks without one an extent. A chunk whose
    /// extent is too small for the write must move to a bigger one, which
    /// needs the inode mutex exclusive: with `may_grow` (the caller holds
    /// it) the meta-server moves it here; without, nothing is written and
    /// the answer is [`Written::NeedsGrowth`]. The caller holds the locks
    /// and publishes the size and mtime.
    fn write_data(
        &self,
        eps: &mut Endpoints,
        ino: Ino,
        mut layout: Arc<RwLock<CachedLayout>>,
        offset: u64,
        data: &[u8],
        may_grow: bool,
    ) -> Result<Written, FsError> {
        let pieces: Vec<_> = self.geometry.split(offset, data.len() as u64).collect();
        let needs: Vec<(ChunkIndex, u64)> =
            pieces.iter().map(|p| (p.chunk, p.offset_in_chunk + p.len)).collect();
        let asks: Vec<(ChunkIndex, u64)> = {
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
        if !asks.is_empty() {
            let request = if may_grow {
                MetaRequest::GrowExtents { ino, chunks: asks }
            } else {
                MetaRequest::AllocChunks { ino, chunks: asks }
            };
            match self.call(&request)? {
                MetaResponse::Chunks(locs) => {
                    layout.write().chunks.extend(locs.iter().copied());
                    given.extend(locs);
                }
                other => return Err(unexpected(other)),
            }
            layout = self.layout(ino)?;
        }
        let mut verbs = Vec::with_capacity(pieces.len());
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
                verbs.push((
                    loc.server,
                    Verb::Write { addr: loc.addr + p.offset_in_chunk, data: bytes.to_vec() },
                    i,
                ));
            }
        }
        if !too_small.is_empty() {
            if may_grow {
                return Err(FsError::Io(format!("inode {}: extents did not grow for {too_small:?}", ino.0)));
            }
            return Ok(Written::NeedsGrowth);
        }
        self.execute_grouped(eps, verbs)?;
        Ok(Written::Done(layout))
    }

    /// Calls this client has sent to the meta-server so far, by kind (the
    /// registration of [`FsClient::connect`] excepted).
    pub fn rpc_counts(&self) -> RpcCounts {
        self.shared.rpc_counts.snapshot()
    }

    /// Calls this client has made to the RPC range lock server
    /// (`--range-lock rpc`): round trips of the range lock that use no
    /// verbs, so [`FsClient::verb_counts`] does not see them.
    pub fn range_lock_calls(&self) -> u64 {
        self.timing.ranges.rpc_calls()
    }

    /// Verbs issued so far by this client's I/O and lock calls (pooled and
    /// retired endpoints; not the lock waiter thread's retries of blocked
    /// requests).
    pub fn verb_counts(&self) -> VerbCounts {
        let mut c = *self.retired_counts.lock();
        for eps in self.pool.lock().iter() {
            c += eps.meta.counts();
            for e in eps.data.values() {
                c += e.counts();
            }
        }
        c
    }
}

/// What [`FsClient::write_data`] did.
enum Written {
    Done(Arc<RwLock<CachedLayout>>),
    /// Nothing: a chunk's extent is too small and must move to a bigger one
    /// under the inode mutex exclusive.
    NeedsGrowth,
}

fn heartbeat_loop(shared: &Shared) {
    renewal_priority::raise_calling_thread();
    let tick = (shared.lease / 4).max(Duration::from_millis(10));
    let mut last = std::time::Instant::now();
    while !shared.stop.load(Ordering::Relaxed) {
        // Short naps, so dropping the client does not wait a whole tick.
        std::thread::sleep(Duration::from_millis(20).min(tick));
        if last.elapsed() < tick || shared.renewal_paused.load(Ordering::Relaxed) {
            continue;
        }
        last = std::time::Instant::now();
        let sent = last;
        let client = ClientId(shared.client.load(Ordering::Relaxed));
        match shared.call(&MetaRequest::Heartbeat { client }) {
            Ok(MetaResponse::Done) => *shared.renewed.lock() = sent,
            Ok(MetaResponse::Failed(_))
            | Err(RpcError::Handshake(HandshakeError::Refused(Status::NotAdmitted))) => {
                log::warn!("lease of client {} lost", client.0);
                shared.fenced.store(true, Ordering::Relaxed);
                shared.identity.registering(&shared.rpc);
                let again = shared.call(&MetaRequest::RegisterClient {
                    hostname: shared.hostname.clone(),
                    pid: std::process::id(),
                });
                let registered = match again {
                    Ok(MetaResponse::Registered(info)) => {
                        match shared.identity.registered(&shared.rpc, &info) {
                            Ok(()) => Some(info),
                            Err(e) => {
                                log::warn!("cannot use the new registration: {e}");
                                None
                            }
                        }
                    }
                    _ => None,
                };
                if let Some(info) = registered {
                    shared.client.store(info.client.0, Ordering::Relaxed);
                    let now = shared.registration.fetch_add(1, Ordering::Relaxed) + 1;
                    shared.opens.drop_older_than(now);
                    *shared.renewed.lock() = sent;
                    shared.fenced.store(false, Ordering::Relaxed);
                    log::warn!("re-registered as client {}", info.client.0);
                }
            }
            Ok(other) => log::warn!("unexpected heartbeat answer {other:?}"),
            Err(e) => log::warn!("heartbeat failed: {e}"),
        }
    }
}

impl FsClient {
    /// Leaves the cluster ahead of the client's drop (a mount going away):
    /// lock requests still blocked are answered with an error (EIO), and the
    /// meta-server is told this client leaves, so it removes the client's
    /// lock records and opens now (waking whoever waits for them) instead
    /// of a lease later. Calls after this fail. Idempotent.
    pub fn shutdown(&self) {
        if let Some(w) = &self.waiters {
            w.shutdown();
        }
        if self.shared.stop.swap(true, Ordering::Relaxed) {
            return;
        }
        if !self.shared.fenced() {
            let client = ClientId(self.shared.client.load(Ordering::Relaxed));
            match answer(self.shared.call(&MetaRequest::ClientLeaves { client })) {
                Ok(_) => log::info!("client {} left the cluster", client.0),
                Err(e) => log::warn!("cannot tell the meta-server that client {} leaves: {e}", client.0),
            }
        }
        self.shared.fenced.store(true, Ordering::Relaxed);
    }
}

impl Drop for FsClient {
    fn drop(&mut self) {
        self.shutdown();
        self.waiters.take();
        if let Some(h) = self.heartbeat.take() {
            let _ = h.join();
        }
        if let Some(h) = self.tuning.take() {
            let _ = h.join();
        }
    }
}
