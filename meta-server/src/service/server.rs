//! Starting the meta-server: its NIC (tcp, shm, ib) and regions, lock
//! memory and the Citron tree host, the RPC service, and the threads that
//! reap leases, probe data servers and publish Citron's T_wait; and the
//! [`MetaServer`] handle a process or a test keeps (statistics, shutdown).

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
use citron_lock::lock_host::{LockHost, LockHostConfig};
use citron_lock::range_lock::rpc::{spawn_range_server_with, RangeLockServer, RangeServerConfig};
use citron_lock::range_lock::RangeAlgorithm;
use citron_lock::range_lock::RangeLockSite;
use citron_lock::rdma::tcp::{AccessTable, Extent, RpcServer};
use citron_lock::rdma::{
    FabricAddr, IbHost, Node, RegionMemory, RegionTable, RemoteAddr, ShmHost, TcpHost, TcpOptions,
};
use citron_rpc::auth::Authority;
use citronfs_core::locks::guard::reaper_tick;
use citronfs_core::locks::{ClusterLockParams, LockTiming, WaitsFor};
use citronfs_core::status::ClusterStatus;
use citronfs_core::types::Ino;
use citronfs_core::FsError;
use parking_lot::Mutex;

use crate::access::{Access, Class, Placed, ServerRef};
use crate::extents::ExtentAllocator;
use crate::grants::Grants;
use crate::journal::{Journal, JournalConfig, Logged, ScratchDir};
use crate::lock_areas::LockAreas;
use crate::lock_memory::LockMemory;
use crate::lock_tuning::LockTuning;
use crate::namespace::{FileLocking, Namespace, TreeHosting};
use crate::reclaim::Reclamation;
use crate::waits_for_chain::WaitsForChain;

use super::grace::Grace;
use super::stable_ports::{self, StablePorts};
use super::{
    server_credentials, FsIdentity, MetaServerConfig, MetaService, NicRevocation, LOCK_REGION, SLOT_REGION,
};

/// Slots of the meta-server's cohort of the files' attribute ALocks.
const ATTR_POOL_SLOTS: u32 = 64;

/// Writes zeros over a whole region (lock memory whose old contents are
/// not kept: an idle lock and an empty table everywhere).
fn zero_region(memory: &RegionMemory) -> std::io::Result<()> {
    const CHUNK: u64 = 1 << 20;
    let zeros = vec![0u8; CHUNK as usize];
    let mut at = 0;
    while at < memory.len() {
        let n = CHUNK.min(memory.len() - at);
        memory
            .write_from(RemoteAddr::new(memory.id(), at), &zeros[..n as usize])
            .map_err(|e| std::io::Error::other(e.to_string()))?;
        at += n;
    }
    Ok(())
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
    /// The state directory when none was given; removed after the rest
    /// stopped (declared last among what is dropped, see `Drop`).
    _scratch: Option<ScratchDir>,
    /// Stopped before the NIC in [`MetaServer::shutdown`]: its ShiftLock
    /// recovery thread has a mailbox on the NIC, through which it is told
    /// to stop.
    lock_host: Option<LockHost>,
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
        // The state first: a damaged journal stops the start before
        // anything is served.
        let scratch = match config.state_dir {
            Some(_) => None,
            None => Some(ScratchDir::new().map_err(io)?),
        };
        let state_dir =
            config.state_dir.clone().unwrap_or_else(|| scratch.as_ref().expect("made above").path().into());
        let journal_config = JournalConfig { dir: state_dir, segment_bytes: config.journal_segment_bytes };
        let (journal, recovered) = Journal::open(&journal_config).map_err(|e| FsError::Io(e.to_string()))?;
        let journal = Arc::new(journal);
        // The attribute slots are a file of the state: sizes and mtimes
        // that clients wrote one-sidedly survive with it.
        let slot_path = journal.dir().join(crate::journal::files::SLOTS);
        drop(journal.slot_file(slot_bytes).map_err(|e| FsError::Io(e.to_string()))?);
        // So is the lock region: every lock word, record and waiting owner
        // is found again by a restart, for the clients to reclaim
        // (`grace`).
        let lock_path = journal.dir().join(crate::journal::files::LOCKS);
        let (lock_file, mut locks_kept) = journal
            .lock_file(&lock_path, lock_bytes, !recovered.fresh)
            .map_err(|e| FsError::Io(e.to_string()))?;
        let (shm, regions, slots, locks) = match &config.shm {
            Some(name) => {
                let host = ShmHost::create(name)?;
                let slots = host.add_region_file(SLOT_REGION, &slot_path)?;
                let locks = host.add_region_file(LOCK_REGION, &lock_path)?;
                let regions = host.regions().clone();
                (Some(host), regions, slots, locks)
            }
            None => {
                let regions = Arc::new(RegionTable::new());
                let slot_file =
                    std::fs::OpenOptions::new().read(true).write(true).open(&slot_path).map_err(io)?;
                let slots = regions
                    .insert(RegionMemory::from_file(SLOT_REGION, &slot_file).map_err(io)?)
                    .map_err(io)?;
                let locks = regions
                    .insert(RegionMemory::from_file(LOCK_REGION, &lock_file).map_err(io)?)
                    .map_err(io)?;
                (None, regions, slots, locks)
            }
        };
        drop(lock_file);
        // The tree host's arena is the top of the lock region.
        let grow = config.grow_trees && config.lock_choice.range == RangeAlgorithm::Citron;
        let tree_bytes = match (grow, config.tree_bytes) {
            (false, _) => 0,
            (true, 0) => lock_bytes / 2,
            (true, b) => b.min(lock_bytes / 4 * 3),
        } / 4096
            * 4096;
        let tree_start = lock_bytes - tree_bytes;
        // The cluster's fixed lock structures land where they did before
        // the restart only with the same lock configuration; with another,
        // the old locks cannot be read, and none is kept.
        let layout = format!(
            "{lock_bytes} {tree_start} {} {} {} {}\n",
            WaitsFor::bytes(config.max_waiting_owners),
            citron_lock::citron::tuning::TWAIT_WORD_BYTES,
            LockHostConfig::default().area_bytes(),
            AlockLayout::pool_bytes(ATTR_POOL_SLOTS),
        );
        let layout_path = journal.dir().join(crate::journal::files::LOCK_LAYOUT);
        if locks_kept && std::fs::read_to_string(&layout_path).ok().as_deref() != Some(layout.as_str()) {
            log::warn!(
                "the lock configuration changed since the last start (--lock-memory, tree memory or waiting \
                 owners): the locks of the previous process are not kept, and its mounts must be mounted again"
            );
            locks_kept = false;
            zero_region(&locks).map_err(io)?;
        }
        std::fs::write(&layout_path, &layout).map_err(io)?;
        if config.keyring.as_ref().is_some_and(|r| r.cluster_key().is_none()) {
            return Err(FsError::Invalid(
                "the meta-server's key file has no cluster key (role=server)".into(),
            ));
        }
        let authority = Authority::from_keyring(config.keyring.clone());
        let nic_access = Arc::new(AccessTable::default());
        let access = Arc::new(Access::new(config.keyring.clone(), nic_access.clone(), config.grant_hold));
        // The NIC binds the port it had before a restart: clients'
        // connections name it.
        let mut ports = StablePorts::load(journal.dir());
        let nic = ports
            .bind(
                stable_ports::NIC,
                config.nic_listen,
                |at| TcpHost::spawn_with(at, regions.clone(), authority.clone(), nic_access.clone()),
                |nic| nic.local_addr().port(),
            )
            .map_err(io)?;
        if let Err(e) = ports.save() {
            log::warn!("cannot remember the NIC's port in {}: {e}", journal.dir().display());
        }
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
        // Every lock waits the fence delay past its own threshold before it
        // takes a silent holder over: our client lease, a reaper tick and a
        // margin (`fence_delay_for`), so no lock is recovered before we
        // have fenced its holder (the lease ordering). Clients get these
        // parameters at registration; our own lock users below take the
        // same ones.
        let lock_params = ClusterLockParams { published_t_wait: Some(tuning.word()), ..config.lock_params }
            .fenced_within(config.lease);
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
        let pool = fixed(AlockLayout::pool_bytes(ATTR_POOL_SLOTS))?;
        // Clients hold it for one batch of verbs, within the cluster's lock
        // lease; one that dies holding or queued is recovered by our threads
        // through an endpoint of our own (ALock's "Recovery").
        let alock_config = AlockConfig::from_rtt(Duration::from_micros(1))
            .with_lease(Duration::from_millis(lock_params.lease_ms))
            .with_fence_delay(lock_params.fence_delay());
        let attr_host = AlockHost::new(locks, pool, ATTR_POOL_SLOTS, alock_config)
            .map_err(lock_err)?
            .with_recovery(node.endpoint()?);
        let waits_for_chain = WaitsForChain::new(waits_for);
        if locks_kept {
            // Every other block may hold an area a client reclaims.
            lock_memory.mark_free_dirty();
            let grown = waits_for_chain.readopt(&mut lock_memory);
            access.extend_membership(
                grown
                    .into_iter()
                    .map(|b| lock_extent(b, WaitsFor::bytes(config.max_waiting_owners)))
                    .collect(),
            );
        }
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
        let identity = FsIdentity {
            fs: recovered.image.fs,
            born: recovered.image.born,
            started: std::time::SystemTime::now(),
            replay: recovered.took,
        };
        let files = recovered.image.files();
        let next_data_server = recovered.image.data_servers.keys().last().map_or(1, |id| u64::from(id.0) + 1);
        let fresh = recovered.fresh;
        // The lookup-then-open window an orphan's grace covers is
        // microseconds; a second is ample.
        let orphan_grace = config.lease.min(Duration::from_secs(1));
        let locking = FileLocking { areas, attr_host: attr_host.clone() };
        let extents = ExtentAllocator::new(config.chunk_size);
        let mut namespace = if fresh {
            Namespace::new(slots, extents, locking, reclaim.clone(), config.root_owner, orphan_grace)
        } else {
            Namespace::restore(recovered.image, slots, extents, locking, reclaim.clone(), orphan_grace)
        };
        // The clients of the previous process come back to reclaim their
        // opens and locks (`grace`): lock memory waits for them.
        let grace_length = config.grace.unwrap_or(config.lease * 2);
        let remembered = namespace.registered_clients();
        let grace = if locks_kept && !remembered.is_empty() {
            log::info!(
                "grace period of {grace_length:?}: waiting for {} clients of the previous process to reclaim \
                 their opens and locks",
                remembered.len()
            );
            namespace.freeze_lock_memory(true);
            namespace.keep_orphans_until(Instant::now() + grace_length);
            Grace::start(remembered, config.lease / 2, grace_length)
        } else {
            if !remembered.is_empty() {
                log::warn!(
                    "{} clients of the previous process cannot reclaim (its locks were not kept); they \
                     must be mounted again",
                    remembered.len()
                );
            }
            remembered.into_iter().for_each(|c| namespace.client_gone(c));
            Grace::none()
        };
        if fresh {
            log::info!("new file system {} in {}", identity.fs, journal.dir().display());
        } else {
            log::info!(
                "file system {} ({files} files) restored from {} in {:?}: snapshot {:?}, {} segments, {} batches{}",
                identity.fs,
                journal.dir().display(),
                recovered.took,
                recovered.snapshot,
                recovered.segments,
                recovered.batches,
                match &recovered.torn {
                    Some((file, at)) => format!(", torn tail cut at byte {at} of {}", file.display()),
                    None => String::new(),
                }
            );
        }
        let service = Arc::new(MetaService {
            // The lookup-then-open window an orphan's grace covers is
            // microseconds; a second is ample.
            ns: Logged::new(namespace, journal),
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
            next_data_server: AtomicU64::new(next_data_server),
            reaper_wake: Mutex::new(reaper_wake.clone()),
            clients: Mutex::new(HashMap::new()),
            waits_for,
            waits_for_chain,
            lock_params,
            lock_host: lock_host.info().clone(),
            access,
            connections,
            tuning: tuning.clone(),
            attr_host,
            grants: Grants::with_contention(config.contended_for),
            identity,
            grace,
            held_answers: super::held_answers::HeldAnswers::from_env(),
        });
        if !fresh {
            service.relink_known_data_servers();
        }
        // A new file system's root is durable before anyone is answered.
        drop(service.ns.lock());
        service.ns.commit_seen().map_err(|e| FsError::Io(e.to_string()))?;
        let rpc = RpcServer::spawn_with(config.listen, service.clone(), "meta", authority).map_err(io)?;
        let _ = service.connections.set(rpc.connections());
        let stop = Arc::new(AtomicBool::new(false));
        let tuner = tuning.spawn(node.endpoint()?, stop.clone()).map_err(io)?;
        let reaper = {
            let stop = stop.clone();
            let service = service.clone();
            let tick = reaper_tick(config.lease);
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
                        service.end_grace_if_due();
                        service.expire_clients(&ep, &timing);
                    }
                })
                .map_err(io)?
        };
        let prober = {
            let stop = stop.clone();
            let service = service.clone();
            let tick = reaper_tick(config.lease);
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
            _scratch: scratch,
            nic,
            _shm: shm,
            _ib: ib,
            stop,
            reaper_wake,
            reaper: Some(reaper),
            prober: Some(prober),
            tuner: Some(tuner),
            lock_host: Some(lock_host),
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
        drop(self.lock_host.take());
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
        if let Err(e) = self.rpc.service().ns.journal().flush() {
            log::error!("the journal's last changes: {e}");
        }
    }
}

impl Drop for MetaServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}
