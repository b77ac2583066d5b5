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
//!
//! [`TreeHostServer`]: citron_lock::citron::host::TreeHostServer
//! [`LockMemory`]: crate::lock_memory::LockMemory
//! [`RangeLockSite::CitronHosted`]: citron_lock::range_lock::RangeLockSite::CitronHosted

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use citron_lock::alock::AlockHost;
use citron_lock::citron::host::LockMemoryHost;
use citron_lock::lock_host::LockHostInfo;
use citron_lock::rdma::tcp::{Connections, Peer, RpcService};
use citron_lock::rdma::{IbDevice, NodeCredentials, RegionId, RemoteAddr};
use citron_rpc::auth::{Authority, Credential, Credentials, Keyring, Principal, Status};
use citronfs_core::locks::area::LockChoice;
use citronfs_core::locks::table::TableGrowth;
use citronfs_core::locks::waits_for::WaitsForGrowth;
use citronfs_core::locks::{ClusterLockParams, WaitsFor};
use citronfs_core::proto::{AttrSlot, MetaRequest, MetaResponse};
use citronfs_core::types::{Caller, ClientId, Ino};
use citronfs_core::FsError;
use parking_lot::Mutex;

use crate::access::Access;
use crate::data_link::DataServerLink;
use crate::grants::Grants;
use crate::identity::{self, Asker};
use crate::journal::Logged;
use crate::lock_tuning::LockTuning;
use crate::reclaim::Reclamation;
use crate::waits_for_chain::WaitsForChain;

mod data_servers;
mod dispatch;
mod grace;
mod held_answers;
mod leases;
mod once;
mod server;
mod stable_ports;
mod status;

use leases::{ClientLease, NicRevocation};
pub use server::{CitronTreeState, MetaServer};

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
    /// How long attributes that clients change in turn stay ungranted
    /// (`grants`, "Contended attributes").
    pub contended_for: Duration,
    /// Where the namespace's journal, snapshots and attribute slots live
    /// (`--state-dir`; [`crate::journal`]). `None`: a scratch directory
    /// removed when the meta-server stops (a file system that ends with
    /// its meta-server, as tests and benchmarks want).
    pub state_dir: Option<std::path::PathBuf>,
    /// A journal segment's length before a snapshot replaces it.
    pub journal_segment_bytes: u64,
    /// After a restart, how long the clients of the previous process have
    /// to reclaim their opens and locks (`service::grace`); `None`: twice
    /// the lease.
    pub grace: Option<Duration>,
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
            contended_for: crate::grants::CONTENDED_FOR,
            state_dir: None,
            journal_segment_bytes: crate::journal::DEFAULT_SEGMENT_BYTES,
            grace: None,
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

pub struct MetaService {
    /// The namespace, journaled ([`crate::journal`]).
    ns: Logged,
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
    /// The file system served, and this process's start.
    identity: FsIdentity,
    /// After a restart: the clients of the previous process reclaim.
    grace: grace::Grace,
    /// A test hook: answers never sent ([`held_answers`]).
    held_answers: held_answers::HeldAnswers,
}

/// Which file system this is and since when, as registration and
/// `citronfs status` give it.
#[derive(Clone, Debug)]
pub struct FsIdentity {
    pub fs: citronfs_core::types::FsId,
    /// When the file system was made.
    pub born: citronfs_core::types::Timestamp,
    /// When this meta-server process started serving it.
    pub started: std::time::SystemTime,
    /// How long the start's replay of the journal took.
    pub replay: Duration,
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
        // Pinned: the file's lock memory (the lock's words) is not freed
        // until we are done with it, whoever closes the file meanwhile.
        let Some(lock) = self.ns.lock().pin_attr_lock(ino) else { return op() };
        let lock_err = |e: citron_lock::rwlock::LockError| {
            FsError::Io(format!("attribute lock of inode {}: {e}", ino.0))
        };
        let locked = || {
            let mut local = self.attr_host.local().map_err(lock_err)?;
            let guard = local.lock(lock).map_err(lock_err)?;
            self.ns.lock().attr_held.insert(ino);
            let result = op();
            self.ns.lock().attr_held.remove(&ino);
            if let Err(e) = guard.unlock() {
                log::error!("releasing the attribute ALock of inode {}: {e}", ino.0);
            }
            result
        };
        let result = locked();
        self.ns.lock().unpin_attr_lock(ino);
        result
    }
}

/// A request that takes longer is logged (at info) with what it was.
const SLOW_REQUEST: Duration = Duration::from_secs(1);

impl MetaService {
    /// Whether `request` is made for a client of the previous process
    /// that has not reclaimed yet (`service::grace`).
    fn awaits_reclaim(&self, request: &MetaRequest, caching: Option<ClientId>) -> bool {
        caching.or_else(|| grace::client_of(request)).is_some_and(|c| self.grace.awaits(c))
    }
}

impl RpcService for MetaService {
    type Request = MetaRequest;
    type Response = MetaResponse;

    fn handle(&self, request: MetaRequest, peer: SocketAddr) -> MetaResponse {
        self.handle_from(request, &Peer { addr: peer, principal: Principal::Anonymous, connection: 0 })
    }

    fn handle_from(&self, request: MetaRequest, peer: &Peer) -> MetaResponse {
        let key_of = |name: &str| self.access.keyring().and_then(|r| r.get(name).cloned());
        let options = |c: ClientId| self.clients.lock().get(&c).map(|l| l.options);
        let (mut request, once) = once::OnceChange::unwrap(request);
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
            Ok(Asker::Client(me, _)) if once.is_some_and(|o| o.client != me) => {
                log::warn!("client {} sent a change as client {}; refused", me.0, once.unwrap().client.0);
                MetaResponse::Failed(FsError::Perm)
            }
            Ok(_) if self.awaits_reclaim(&request, caching.map(|(c, _)| c).or(once.map(|o| o.client))) => {
                match request {
                    // How a client of the previous process notices the restart.
                    MetaRequest::Heartbeat { .. } => MetaResponse::Failed(FsError::Io(
                        "lease unknown: the meta-server restarted; reclaim it".into(),
                    )),
                    _ => MetaResponse::Failed(FsError::Grace),
                }
            }
            Ok(asker) => {
                let (kind, started) = (request.kind(), std::time::Instant::now());
                let answer = match once {
                    Some(change) => self.answer_once(change, &asker, caching, request),
                    None => self.dispatch(&asker, caching, request).unwrap_or_else(MetaResponse::Failed),
                };
                // No answer leaves before what it could have seen is durable.
                let answer = match self.ns.commit_seen() {
                    Ok(()) => answer,
                    Err(e) => MetaResponse::Failed(FsError::Io(e.to_string())),
                };
                self.held_answers.hold(kind);
                // What a request waited for (grants, recalls, locks, the
                // journal) shows here: a client waits on while this server
                // is alive, and its log says only that it waited.
                let took = started.elapsed();
                if took > SLOW_REQUEST {
                    log::info!("a {kind:?} of {:?} took {took:?}", peer.principal);
                }
                answer
            }
            Err(e) => {
                log::warn!("meta: {} ({:?}) may not ask {request:?}: {e}", peer.addr, peer.principal);
                MetaResponse::Failed(e)
            }
        }
    }

    fn malformed(&self, error: String) -> MetaResponse {
        MetaResponse::Failed(FsError::Invalid(format!("malformed request: {error}")))
    }

    /// No polling: a mount's calls spread over a pool of connections (one
    /// per FUSE thread at work), so the thread of the connection that just
    /// answered seldom gets the next request, and on 2 cores the polls took
    /// the core the callers needed. Measured in `bench meta` (four
    /// processes on two mounts, one directory): lookups at 20k/s in some
    /// runs against 100k/s in others with polling, 93-102k/s in every run
    /// without. One process's creates lose what polling gave them in its
    /// fast runs (about 7k/s against 7-14k/s), and one `sqlite3` process
    /// stays in the same range (582-753 tx/s against 545-870). With both
    /// cores busy, polling took metadata down to a few hundred operations
    /// per second. (The mount's calls poll no more either:
    /// `FsClient::connect`.)
    fn poll_budget(&self) -> Duration {
        Duration::ZERO
    }

    /// A session (proved, or claimed without keys) may connect while its
    /// client is registered (not fenced) with this incarnation; mailbox
    /// members never.
    fn admit(&self, principal: &Principal) -> Result<(), Status> {
        match principal {
            Principal::Session(s) | Principal::Claimed(s) => {
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
