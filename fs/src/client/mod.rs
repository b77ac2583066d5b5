//! The client side of the file system: what a mount does.
//!
//! Metadata operations are RPCs to the meta-server. File data never goes
//! through a server's CPU: a client opens a file once (learning where its
//! chunks live, [`FileLayout`](crate::proto::FileLayout)) and then reads and writes chunk memory on the
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

mod batches;
mod endpoints;
mod holds;
mod identity;
mod io;
mod late_changes;
mod layouts;
mod lease;
mod locks;
mod metadata;
mod once;
mod opening;
mod opens;
mod releases;
mod renewal_priority;
pub mod stop_hook;
mod tokens;
mod tuning;

pub use io::WriteMode;
pub use locks::LockCall;
pub use metadata::{Looked, Polled};
pub use tokens::TokenCounts;

use endpoints::{join_server, Endpoints, ServerAddrs};
use layouts::{CachedLayout, Written};
use lease::Heartbeat;

use std::collections::HashMap;
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use citron_lock::rdma::tcp::{RpcClient, RpcError};
use citron_lock::rdma::{IbDevice, Node, TcpOptions, VerbCounts};
use citron_rpc::auth::{HandshakeError, Status};
use parking_lot::{Mutex, RwLock};

use crate::error::FsError;
use crate::layout::ChunkGeometry;
use crate::locks::waiter::Waiters;
use crate::locks::{LockTiming, WaitsFor};
use crate::proto::{ClusterInfo, DataServerInfo, Delegated, Grant, MetaRequest, MetaResponse};
use crate::rpc_counts::{RpcCounters, RpcCounts};
use crate::types::{Attr, ClientId, DataServerId, FsId, Ino};

/// A regular file that [`FsClient::open_or_create`] opened.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Opened {
    pub attr: Attr,
    /// Whether it was created; `false`: the name existed and the existing
    /// file was opened.
    pub created: bool,
    /// What a caching client was granted with it.
    pub granted: ChangeGrant,
}

/// What the meta-server granted a caching client with its change of a
/// directory's entries (`MetaResponse::ParentGranted`; nothing for a client
/// that does not cache).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ChangeGrant {
    /// The directory's attributes after the change, granted for the
    /// client's TTL from about when the request was sent.
    pub parent: Option<Attr>,
    /// A created regular file's attributes (in the answer) are granted
    /// until this client's last release of the file, or a callback of
    /// them, and for the TTL at most (meta-server `grants`, "Creators").
    pub created: bool,
    /// What the client holds as delegations (meta-server `grants`,
    /// "Delegations").
    pub delegated: Delegated,
}

/// The longest a call to the meta-server waits for its answer while the
/// meta-server is alive ([`Shared::call`]): longer than any wait of its
/// own, which a cache grant bounds (a mount's TTL, seconds, plus a margin).
const PATIENCE: Duration = Duration::from_secs(60);

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
    /// How long a release queued at a close waits for others to go to the
    /// meta-server with it (`client::releases`); tests hold them longer.
    pub release_linger: Duration,
    /// How long a create or unlink answered before it was sent waits for
    /// others when no call sends it (`client::late_changes`); tests hold
    /// them longer.
    pub late_linger: Duration,
    /// How long calls wait for a meta-server that stopped answering — it
    /// crashed or restarts — before they answer EIO ([`DEFAULT_META_WAIT`]).
    /// A restart within it costs applications a pause, not an error.
    pub meta_wait: Duration,
    /// Whether a client that is the only one locking a file takes and
    /// releases its fcntl, OFD and flock locks locally, under a lock token
    /// (`client::tokens`). On by default.
    pub lock_tokens: bool,
}

/// [`ClientConfig::meta_wait`] by default: a restart replays the journal
/// (seconds for millions of files) and waits half a lease before it takes
/// its clients back.
pub const DEFAULT_META_WAIT: Duration = Duration::from_secs(60);

impl ClientConfig {
    pub fn new(meta: SocketAddr) -> Self {
        Self {
            meta,
            timeout: Duration::from_secs(5),
            transport: Transport::Auto,
            ib_device: None,
            key: None,
            added_rtt: Duration::ZERO,
            release_linger: releases::LINGER,
            late_linger: late_changes::LINGER,
            meta_wait: DEFAULT_META_WAIT,
            lock_tokens: true,
        }
    }

    fn tcp_options(&self) -> TcpOptions {
        TcpOptions { added_rtt: self.added_rtt, ..TcpOptions::with_timeouts(self.timeout, self.timeout) }
    }
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
    /// The lock tokens this client holds ([`tokens`]).
    tokens: tokens::Tokens,
    /// Calls to the meta-server by kind.
    rpc_counts: RpcCounters,
    /// The TTL of the cache grants this client asks for, in ms (0: it does
    /// not cache; see [`FsClient::set_caching`]).
    caching_ms: AtomicU64,
    /// Releases queued to go to the meta-server in batches ([`releases`]).
    releases: releases::Releases,
    /// Creates and unlinks answered and queued to go in batches
    /// ([`late_changes`]).
    late_changes: late_changes::LateChanges,
    /// The options of the key this client registered with (how the
    /// meta-server squashes its callers), if it has one.
    key_options: Option<citron_rpc::auth::KeyOptions>,
    /// The file system this client mounted, and the meta-server process
    /// (incarnation) it is registered with.
    fs: FsId,
    incarnation: AtomicU64,
    /// The meta-server's NIC this client joined (its lock memory is reached
    /// there, across restarts of the meta-server too).
    meta_nic: SocketAddr,
    /// The meta-server does not answer, or restarted and this client has
    /// not reclaimed yet ([`lease`]): calls wait.
    meta_away: AtomicBool,
    /// How long calls wait for an away meta-server ([`ClientConfig::meta_wait`]).
    meta_wait: Duration,
    /// The client is shutting down: nothing waits for an away meta-server.
    leaving: AtomicBool,
    /// Times this client reclaimed its registration from a restarted
    /// meta-server (which knows nothing of the caches it granted before).
    reclaims: AtomicU64,
    /// The numbers of the changes this client asks ([`once`]).
    changes: once::ChangeNumbers,
    /// Why every call fails from now on, if one does: another file system,
    /// or another process of the meta-server, found after a reconnection.
    detached: Mutex<Option<FsError>>,
}

impl Shared {
    fn client_id(&self) -> ClientId {
        ClientId(self.client.load(Ordering::Relaxed))
    }

    /// One call to the meta-server on behalf of a file-system operation;
    /// from a caching client, wrapped as [`MetaRequest::Caching`] so the
    /// meta-server knows whose kernel caches what.
    fn call_as_client(&self, request: &MetaRequest) -> Result<MetaResponse, FsError> {
        let ttl_ms = self.caching_ms.load(Ordering::Relaxed);
        if ttl_ms == 0 {
            return self.call_plain(request);
        }
        let inner = Box::new(request.clone());
        self.call_plain(&MetaRequest::Caching { client: self.client_id(), ttl_ms, request: inner })
    }

    /// One call as it is, refused once the client is fenced. While the
    /// meta-server is away (not answering, or restarted and not reclaimed
    /// from yet) or in its grace period, the call waits and is asked again,
    /// up to [`Shared::meta_wait`]: a request that found no server was not
    /// sent, and one refused for the grace period changed nothing.
    /// A change ([`MetaRequest::asked_once`]) goes numbered ([`once`]):
    /// one whose connection broke as the meta-server went away is sent
    /// again once it is back, and is applied at most once.
    fn call_plain(&self, request: &MetaRequest) -> Result<MetaResponse, FsError> {
        let mut numbered = request.asked_once().then(|| self.changes.number(self.client_id(), request));
        let began = Instant::now();
        loop {
            self.wait_while_away(began)?;
            if self.fenced() {
                return Err(FsError::Io(
                    "this client's lease expired; it is fenced until it re-registers".into(),
                ));
            }
            // A call that failed says which it was: "no reply within 5s"
            // alone does not tell a slow allocation from a slow create.
            let sending = numbered.as_ref().map_or(request, |n| n.request());
            let answered = answer(self.call(sending));
            if let Some(numbered) = &mut numbered {
                numbered.sent();
            }
            match answered {
                Err(FsError::MetaServerDown) => {
                    // Before the heartbeat notices: the others wait too.
                    self.meta_away.store(true, Ordering::SeqCst);
                }
                // Its connection broke under it (the meta-server stopped
                // while it was on its way): a request that only reads, or a
                // numbered change, is asked again once the meta-server is
                // back; any other may have been applied, and fails.
                Err(FsError::Io(_)) if (request.only_reads() || numbered.is_some()) && self.away_now() => {}
                Err(FsError::Grace) if began.elapsed() < self.meta_wait => std::thread::sleep(AWAY_NAP),
                r => {
                    return r.map_err(|e| match e {
                        FsError::Io(why) => FsError::Io(format!("{:?}: {why}", request.inner().kind())),
                        e => e,
                    })
                }
            }
        }
    }

    /// Returns once the meta-server is back (or was never away); an error
    /// once the client is detached, stops, or has waited since `began` for
    /// [`Shared::meta_wait`].
    fn wait_while_away(&self, began: Instant) -> Result<(), FsError> {
        loop {
            if let Some(why) = &*self.detached.lock() {
                return Err(why.clone());
            }
            if !self.meta_away.load(Ordering::SeqCst) {
                return Ok(());
            }
            if began.elapsed() >= self.meta_wait || self.leaving.load(Ordering::Relaxed) {
                return Err(FsError::MetaServerDown);
            }
            std::thread::sleep(AWAY_NAP);
        }
    }

    /// The meta-server answered this client's renewal (or took it back):
    /// calls go on.
    fn back(&self, client: ClientId) {
        if self.meta_away.swap(false, Ordering::SeqCst) {
            log::info!("the meta-server answers client {} again", client.0);
        }
    }

    /// One call to the meta-server, counted by kind. An answer later than
    /// the RPC timeout is waited for as long as the meta-server shows it
    /// is alive: it answered a lease renewal sent after this call, and
    /// this client is not fenced. The meta-server's own waits (a cache
    /// grant's holder that acknowledges late, or not at all until the
    /// grant expires; an attribute lock) last as long as a loaded machine
    /// makes them, and are no failure of the server: only a server that
    /// stopped answering is, and that fails the call (EIO) a timeout
    /// after the last renewal it answered. At most [`PATIENCE`].
    fn call(&self, request: &MetaRequest) -> Result<MetaResponse, RpcError> {
        let kind = request.inner().kind();
        self.rpc_counts.count(kind);
        let sent = Instant::now();
        self.rpc.call_patiently(request, &mut |waited| {
            let alive = *self.renewed.lock() > sent && !self.fenced.load(Ordering::SeqCst);
            let waits = alive && waited < PATIENCE;
            if waits {
                log::warn!("{kind:?}: no answer after {waited:?}; the meta-server renews the lease, so still waiting");
            } else {
                log::warn!("{kind:?}: no answer after {waited:?}, and the meta-server answered no renewal since it was sent");
            }
            waits
        })
    }

    /// Whether this client must stop acting: its lease was refused, or it
    /// has not renewed it for 3/4 of the lease (the meta-server fences at
    /// a whole lease after it last heard from us, which is later, so we stop
    /// writing before anyone may take our locks).
    fn fenced(&self) -> bool {
        // SeqCst: `with_pinned_endpoints`'s argument orders this load
        // after the identity its endpoints were made under.
        self.fenced.load(Ordering::SeqCst) || self.renewed.lock().elapsed() > self.lease * 3 / 4
    }
}

pub struct FsClient {
    shared: Arc<Shared>,
    geometry: ChunkGeometry,
    transport: Transport,
    ib_device: Option<IbDevice>,
    /// How data servers are joined (timeouts, the test-only distance).
    tcp_options: TcpOptions,
    /// How long an operation waits for a data server that does not answer
    /// to come back ([`ClientConfig::timeout`]).
    timeout: Duration,
    /// Times an operation waited for a data server that did not answer
    /// ([`FsClient::data_server_waits`]).
    data_server_waits: AtomicU64,
    meta_node: Node,
    data_nodes: RwLock<HashMap<DataServerId, (DataServerInfo, Node)>>,
    pool: Mutex<Vec<Endpoints>>,
    layouts: RwLock<HashMap<Ino, Arc<RwLock<CachedLayout>>>>,
    /// Held around an allocation's RPC, so that concurrent writes into the
    /// same new chunk ask for it once ([`FsClient::write_data`]).
    allocating: Mutex<()>,
    /// What the last invalidation poll acknowledged
    /// ([`FsClient::await_invalidations`]); `u64::MAX` before the first.
    poll_acked: AtomicU64,
    /// Verbs of endpoints returned to the pool and dropped, for statistics.
    retired_counts: Mutex<VerbCounts>,
    heartbeat: Option<Heartbeat>,
    /// Sends queued releases ([`releases`]).
    releaser: Option<std::thread::JoinHandle<()>>,
    /// Sends queued creates and unlinks ([`late_changes`]).
    late_sender: Option<std::thread::JoinHandle<()>>,
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

/// A create's or an open's call, or a write's allocation: the calls a loop
/// of creates or opens makes, which leave queued releases queued
/// (`releases`, "When a batch goes"), and which change nothing when they
/// are refused.
fn opens_or_allocates(request: &MetaRequest) -> bool {
    use MetaRequest::{AllocChunks, CreateOpen, GrowExtents, Open};
    matches!(request.inner(), CreateOpen { .. } | Open { .. } | AllocChunks { .. } | GrowExtents { .. })
}

fn answer(r: Result<MetaResponse, citron_lock::rdma::tcp::RpcError>) -> Result<MetaResponse, FsError> {
    match r {
        // Not sent: no server listens (it stopped, or restarts), or it does
        // not know this client (it restarted, or fenced it): the client is
        // away until its heartbeat reclaims or registers again.
        Err(RpcError::Unreachable(_) | RpcError::Handshake(HandshakeError::Refused(Status::NotAdmitted))) => {
            Err(FsError::MetaServerDown)
        }
        Err(e) => Err(e.into()),
        Ok(MetaResponse::Failed(e)) => Err(e),
        Ok(ok) => Ok(ok),
    }
}

/// How often a call waiting for an away meta-server looks again.
const AWAY_NAP: Duration = Duration::from_millis(20);

fn granted(r: MetaResponse) -> Result<(Attr, Grant), FsError> {
    match r {
        MetaResponse::Granted(a, g) => Ok((a, g)),
        MetaResponse::Attr(a) => Ok((a, Grant::default())),
        other => Err(unexpected(other)),
    }
}

/// A change's answer out of its [`MetaResponse::ParentGranted`] wrapper,
/// and what it granted.
fn change_answer(r: MetaResponse) -> (MetaResponse, ChangeGrant) {
    match r {
        MetaResponse::ParentGranted { answer, parent, created, delegated } => {
            (*answer, ChangeGrant { parent, created, delegated })
        }
        other => (other, ChangeGrant::default()),
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
        // No polling for the meta-server's answers (see its service's
        // `poll_budget`).
        let rpc = RpcClient::new(config.meta, config.timeout)
            .with_credentials(identity.credentials().clone())
            .with_poll_budget(Duration::ZERO);
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
            incarnation,
            fs,
        } = info;
        let geometry = ChunkGeometry::new(chunk_size).map_err(FsError::Invalid)?;
        let options = config.tcp_options();
        let meta_nic_joined = reachable(meta_nic, config.meta);
        let meta_addrs = ServerAddrs {
            nic: meta_nic_joined,
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
            tokens: tokens::Tokens::default(),
            rpc_counts: RpcCounters::default(),
            caching_ms: AtomicU64::new(0),
            releases: releases::Releases::new(config.release_linger),
            late_changes: late_changes::LateChanges::new(config.late_linger),
            key_options: config.key.as_ref().map(|k| k.options),
            fs,
            incarnation: AtomicU64::new(incarnation),
            meta_nic: meta_nic_joined,
            meta_away: AtomicBool::new(false),
            meta_wait: config.meta_wait,
            reclaims: AtomicU64::new(0),
            leaving: AtomicBool::new(false),
            changes: Default::default(),
            detached: Mutex::new(None),
        });
        shared.tokens.set_enabled(config.lock_tokens);
        let heartbeat = Heartbeat::start(&shared)?;
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
            timeout: config.timeout,
            data_server_waits: AtomicU64::new(0),
            meta_node,
            data_nodes: RwLock::new(HashMap::new()),
            pool: Mutex::new(Vec::new()),
            layouts: RwLock::new(HashMap::new()),
            allocating: Mutex::new(()),
            poll_acked: AtomicU64::new(u64::MAX),
            retired_counts: Mutex::new(VerbCounts::default()),
            heartbeat: Some(heartbeat),
            releaser: None,
            late_sender: None,
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
        let sender = |name: &str, run: fn(Arc<Shared>)| {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name(name.into())
                .spawn(move || run(shared))
                .map_err(|e| FsError::Io(e.to_string()))
        };
        c.releaser = Some(sender("citronfs-release", releases::run)?);
        c.late_sender = Some(sender("citronfs-late", late_changes::run)?);
        Ok(c)
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

    /// One call to the meta-server on behalf of a file-system operation
    /// ([`Shared::call_as_client`]), after [`FsClient::before_call`]; asked
    /// once more, after the queued releases, if lock memory or space was
    /// short.
    fn call(&self, request: &MetaRequest) -> Result<MetaResponse, FsError> {
        self.before_call(request);
        match self.shared.call_as_client(request) {
            // Files closed here a moment ago keep their lock memory and,
            // unlinked elsewhere, their space until their queued releases
            // arrive: a create, open or allocation refused for want of
            // either sends them and asks once more. Those requests change
            // nothing when they are refused, so asking again is safe.
            Err(FsError::NoSpace | FsError::TooManyOpenFiles)
                if opens_or_allocates(request) && self.flush_releases() =>
            {
                self.shared.call_as_client(request)
            }
            answer => answer,
        }
    }

    /// Before a file-system operation's call: the test-only distance, the
    /// queued creates and unlinks applied (`late_changes`: the meta-server
    /// sees this client's operations in the order they were answered), the
    /// queued releases sent now unless the call is a create's, an open's
    /// or a write's allocation (`releases`, "When a batch goes").
    fn before_call(&self, request: &MetaRequest) {
        self.add_distance();
        self.flush_late_changes();
        if !opens_or_allocates(request) {
            self.shared.releases.send_now();
        }
    }

    /// The test-only distance to the meta-server (`TcpOptions::added_rtt`).
    fn add_distance(&self) {
        if !self.tcp_options.added_rtt.is_zero() {
            std::thread::sleep(self.tcp_options.added_rtt);
        }
    }

    fn call_attr(&self, request: &MetaRequest) -> Result<Attr, FsError> {
        Ok(self.call_change_attr(request)?.0)
    }

    /// A change answered with attributes, and what a caching client was
    /// granted with it.
    fn call_change_attr(&self, request: &MetaRequest) -> Result<(Attr, ChangeGrant), FsError> {
        let (answer, grant) = change_answer(self.call(request)?);
        let attr = match answer {
            // A caching client's lookups and getattrs are answered with a
            // grant; callers that do not hand the answer to the kernel
            // ignore it (the meta-server may call back for nothing).
            MetaResponse::Attr(a) | MetaResponse::Granted(a, _) => a,
            MetaResponse::Absent => return Err(FsError::NotFound),
            other => return Err(unexpected(other)),
        };
        Ok((attr, grant))
    }

    fn call_done(&self, request: &MetaRequest) -> Result<(), FsError> {
        self.call_change_done(request).map(drop)
    }

    /// A change answered `Done`, and what a caching client was granted
    /// with it.
    fn call_change_done(&self, request: &MetaRequest) -> Result<ChangeGrant, FsError> {
        match change_answer(self.call(request)?) {
            (MetaResponse::Done, grant) => Ok(grant),
            (other, _) => Err(unexpected(other)),
        }
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
}
