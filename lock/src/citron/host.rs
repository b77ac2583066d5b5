//! The lock host's part in scaling a Citron tree (citron-fast23.md §3.9.1,
//! Algorithm 4 lines 3 and 9): allocating zeroed lock memory and keeping each
//! instance's configuration. The host CPU never takes part in acquiring or
//! releasing; it answers a scaling client's two RPCs (allocate, publish) and
//! the configuration queries of clients that find a newer tree.
//!
//! [`TreeHost`] is the interface a client needs, per instance, so that the
//! file system's meta-server can implement it over its own RPC. This crate
//! has one implementation, [`LockMemoryHost`]: an allocator over a range of
//! one registered region plus a table of instances, usable in-process
//! ([`LocalTreeHost`]) or over the framed tcp RPC of [`crate::rdma::tcp::rpc`]
//! ([`TreeHostServer`], [`RemoteTreeHost`]).
//!
//! Bad input (an unknown instance, a free of memory the instance does not
//! own or still uses, a malformed or conflicting configuration) is refused
//! with a [`TreeHostError`] and changes nothing.
//!
//! The allocator is a first-fit free list with coalescing (a `BTreeMap` of
//! free extents), written here because lock memory is small, 16-byte
//! granular, and freed rarely (scale-down, instance destruction).
//!
//! # Scale-ups run by the host ([`LockMemoryHost::with_scaler`])
//!
//! In the paper (Alg. 4) the client that finds the maximizer set scales the
//! tree itself, with two RPCs to the host (allocate, line 3; publish, line
//! 9) around its own verbs. A client that dies between its first mark and
//! the publication leaves the instance superseded without a successor, and
//! nobody can tell how many units its marks read (the carried counters,
//! lines 6–8, existed only in its memory). A host built
//! [`LockMemoryHost::with_scaler`] closes that gap by running Algorithm 4
//! itself, as one more client of its own memory: a client asks with one
//! RPC ([`TreeHost::scale_up`], [`TreeHostRequest::ScaleUp`]) and gets the
//! new configuration back; [`super::lock::CitronClient::scale_up`]
//! delegates whenever its host [`TreeHost::runs_scale_ups`]. The host's
//! thread takes the instance's spillover mutex like any scaler (the
//! mutex's word is registered with [`LockMemoryHost::enable_scaling`]),
//! through verbs on its own endpoint (CPU atomics on shm, its own NIC on
//! tcp), so its marks are atomic with every client's verbs. A client that
//! dies while asking changes nothing: the host finishes. A client that dies
//! holding the spillover mutex delays the host by DSLR's lease recovery.
//! Such a host refuses remote `Create`, `Destroy`, `Allocate`, `Free` and
//! `Publish`: only its owner (in process) and its own scaler change an
//! instance, so no half-done scale-up by a client can exist. Scale-ups of
//! one instance are serialised by a per-instance turn in the host (a second
//! asker waits for the first and then finds nothing left to do), and an
//! instance destroyed during its scale-up keeps its memory until the
//! scale-up has ended (no verb ever lands in memory given to another).
//! The host CPU still never takes part in acquiring or releasing a range.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use super::geometry::{CitronLayout, TreeGeometry};
use super::lock::{CitronClient, CitronConfig, ScalePolicy, ScaleUp};
use super::tree::{TreeShape, MAX_DEPTH};
use crate::dslr::{DslrConfig, DslrLock};
use crate::rdma::tcp::{RpcClient, RpcServer, RpcService};
use crate::rdma::{Endpoint, Node, RegionId, RegionTable, RemoteAddr};
use crate::rwlock::LockError;

/// A Citron instance on a lock host.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct InstanceId(pub u64);

/// Why the lock host refused or failed a request.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum TreeHostError {
    #[error("no lock memory left for {requested} bytes")]
    OutOfMemory { requested: u64 },
    #[error("unknown Citron instance {0:?}")]
    UnknownInstance(InstanceId),
    #[error("configuration version {found} is not the expected {expected}")]
    VersionConflict { expected: u64, found: u64 },
    #[error("refused: {0}")]
    Refused(String),
    #[error("cannot reach the lock host: {0}")]
    Transport(String),
}

impl From<TreeHostError> for LockError {
    fn from(e: TreeHostError) -> Self {
        LockError::Host(e.to_string())
    }
}

/// The lock host as one Citron instance's client sees it.
pub trait TreeHost: Send + Sync {
    /// Allocates `bytes` of zeroed lock memory for this instance (8-aligned).
    fn allocate(&self, bytes: u64) -> Result<RemoteAddr, TreeHostError>;
    /// Gives back an allocation of this instance that its configuration no
    /// longer uses.
    fn free(&self, addr: RemoteAddr, bytes: u64) -> Result<(), TreeHostError>;
    /// The current configuration.
    fn configuration(&self) -> Result<TreeGeometry, TreeHostError>;
    /// Installs `next` if the current configuration's version is still
    /// `expected`; `next.version` must be greater.
    fn publish(&self, expected: u64, next: &TreeGeometry) -> Result<(), TreeHostError>;
    /// Whether the host runs scale-ups itself ([`TreeHost::scale_up`]);
    /// its clients then never allocate or publish.
    fn runs_scale_ups(&self) -> bool {
        false
    }
    /// Algorithm 4 run by the host: grows the tree (at least 4×) to cover
    /// the maximizer and `at_least` units, within the instance's depth cap.
    /// Answers the configuration after the call, and what the scale-up did
    /// (`None` if nothing was needed).
    fn scale_up(&self, at_least: u64) -> Result<HostScaleUp, TreeHostError> {
        let _ = at_least;
        Err(TreeHostError::Refused("this lock host does not run scale-ups".into()))
    }
}

/// What a scale-up run by the host answers ([`TreeHost::scale_up`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostScaleUp {
    /// The instance's configuration after the call.
    pub geometry: TreeGeometry,
    /// What the host did, with its own verbs and time (waiting for the
    /// instance's turn and the spillover mutex included); `None` if the
    /// tree already covered what was asked (or is at its depth cap).
    pub report: Option<ScaleUp>,
    /// The instance's depth cap: a client whose tree has reached it need
    /// not ask again ([`super::lock::CitronClient::set_max_depth`]).
    pub max_depth: u32,
}

/// A first-fit allocator over `[start, end)` of one region.
#[derive(Debug)]
struct Arena {
    /// Free extents: start offset -> length.
    free: BTreeMap<u64, u64>,
}

/// Allocation granule: 16 bytes keeps every block 8- (and 16-) aligned.
const GRANULE: u64 = 16;

impl Arena {
    fn new(start: u64, end: u64) -> Self {
        let start = start.next_multiple_of(GRANULE);
        let mut free = BTreeMap::new();
        if end > start {
            free.insert(start, (end - start) / GRANULE * GRANULE);
        }
        Self { free }
    }

    fn allocate(&mut self, bytes: u64) -> Option<u64> {
        let want = bytes.max(1).checked_next_multiple_of(GRANULE)?;
        let (&start, &len) = self.free.iter().find(|(_, &len)| len >= want)?;
        self.free.remove(&start);
        if len > want {
            self.free.insert(start + want, len - want);
        }
        Some(start)
    }

    fn release(&mut self, start: u64, bytes: u64) {
        let mut start = start;
        let mut len = bytes.next_multiple_of(GRANULE);
        if let Some((&next, &next_len)) = self.free.range(start + len..).next() {
            if next == start + len {
                self.free.remove(&next);
                len += next_len;
            }
        }
        if let Some((&prev, &prev_len)) = self.free.range(..start).next_back() {
            if prev + prev_len == start {
                self.free.remove(&prev);
                start = prev;
                len += prev_len;
            }
        }
        self.free.insert(start, len);
    }

    fn free_bytes(&self) -> u64 {
        self.free.values().sum()
    }
}

#[derive(Debug)]
struct Instance {
    geometry: TreeGeometry,
    /// Allocations owned: offset -> bytes (as asked, before rounding).
    blocks: BTreeMap<u64, u64>,
    /// Set by [`LockMemoryHost::enable_scaling`].
    scaling: Option<Scaling>,
}

/// What the host needs to scale an instance itself.
#[derive(Clone, Debug)]
struct Scaling {
    /// The instance's spillover mutex (DSLR), which a scaler holds.
    spillover: RemoteAddr,
    /// Deepest tree the host grows it to.
    max_depth: u32,
    /// One scale-up of the instance at a time; held for its whole run.
    turn: Arc<Mutex<()>>,
}

#[derive(Debug)]
struct HostState {
    arena: Arena,
    instances: HashMap<InstanceId, Instance>,
    next_id: u64,
    /// Blocks of instances destroyed while the host was scaling them: freed
    /// once that scale-up has ended (its turn is free again).
    retired: Vec<Retired>,
}

/// An instance destroyed during its scale-up: its blocks, and the turn that
/// scale-up holds.
#[derive(Debug)]
struct Retired {
    turn: Arc<Mutex<()>>,
    blocks: BTreeMap<u64, u64>,
}

impl HostState {
    /// Frees the blocks of retired instances whose scale-up has ended.
    fn sweep_retired(&mut self) {
        let mut i = 0;
        while i < self.retired.len() {
            if self.retired[i].turn.try_lock().is_some() {
                let Retired { blocks, .. } = self.retired.swap_remove(i);
                for (offset, bytes) in blocks {
                    self.arena.release(offset, bytes);
                }
            } else {
                i += 1;
            }
        }
    }
}

/// The allocator and the instance table, shared with the scaler's clients.
struct HostCore {
    regions: Arc<RegionTable>,
    region: RegionId,
    state: Mutex<HostState>,
}

/// How a host runs scale-ups: its own membership of the fabric that serves
/// its region, and the timing every client of its instances shares.
struct HostScaler {
    node: Node,
    citron: CitronConfig,
    dslr: DslrConfig,
    /// Endpoints of finished scale-ups, reused (one per concurrent scale-up).
    endpoints: Mutex<Vec<Endpoint>>,
    stats: Mutex<HostScaleStats>,
}

/// What a host's scaler has done ([`LockMemoryHost::scale_stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostScaleStats {
    /// Scale-ups asked for.
    pub asked: u64,
    /// Asks that grew a tree.
    pub grew: u64,
    pub failed: u64,
    /// Host time of the asks that grew a tree (turn and spillover waits included).
    pub grew_time: Duration,
    /// The last scale-up that grew a tree.
    pub last: Option<ScaleUp>,
}

/// The first instance number of a new host. Clients cache configurations by
/// (host address, instance) ([`crate::range_lock::RangeLockContext`]), so
/// numbers must not repeat when a host restarts at the same address: they
/// start at a clock-drawn multiple of 2^24.
fn first_instance_id() -> u64 {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let epoch = (now.as_nanos() as u64 ^ u64::from(std::process::id())) & 0xffff_ffff;
    (epoch << 24) | 1
}

/// Lock memory and Citron configurations on a lock host.
pub struct LockMemoryHost {
    core: Arc<HostCore>,
    scaler: Option<HostScaler>,
}

impl std::fmt::Debug for LockMemoryHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LockMemoryHost")
            .field("region", &self.core.region)
            .field("scales", &self.scaler.is_some())
            .finish()
    }
}

impl LockMemoryHost {
    /// Serves lock memory from `[start, end)` of `region` (which `regions`
    /// must hold for as long as the host lives).
    pub fn new(regions: Arc<RegionTable>, region: RegionId, start: u64, end: u64) -> Self {
        Self {
            core: Arc::new(HostCore {
                regions,
                region,
                state: Mutex::new(HostState {
                    arena: Arena::new(start, end),
                    instances: HashMap::new(),
                    next_id: first_instance_id(),
                    retired: Vec::new(),
                }),
            }),
            scaler: None,
        }
    }

    /// Makes this host run the scale-ups of the instances given a spillover
    /// mutex with [`LockMemoryHost::enable_scaling`] (see the module
    /// comment): `node` reaches the region this host serves; `citron` and
    /// `dslr` must be the timing every client of the instances uses (the
    /// spillover's lease above all). Remote changes (create, destroy,
    /// allocate, free, publish) are refused from then on.
    pub fn with_scaler(mut self, node: Node, citron: CitronConfig, dslr: DslrConfig) -> Self {
        // One endpoint ready, so the first scale-up does not pay for a
        // connection (on tcp, milliseconds).
        let ready = match node.endpoint() {
            Ok(ep) => vec![ep],
            Err(e) => {
                log::warn!("the tree host's scaler has no endpoint yet: {e}");
                Vec::new()
            }
        };
        self.scaler = Some(HostScaler {
            node,
            citron,
            dslr,
            endpoints: Mutex::new(ready),
            stats: Mutex::new(HostScaleStats::default()),
        });
        self
    }

    /// Whether this host runs scale-ups ([`LockMemoryHost::with_scaler`]).
    pub fn runs_scale_ups(&self) -> bool {
        self.scaler.is_some()
    }

    /// What the scaler has done so far (zero without one).
    pub fn scale_stats(&self) -> HostScaleStats {
        self.scaler.as_ref().map_or_else(HostScaleStats::default, |s| *s.stats.lock())
    }

    /// Bytes not allocated.
    pub fn free_bytes(&self) -> u64 {
        let mut st = self.core.state.lock();
        st.sweep_retired();
        st.arena.free_bytes()
    }

    /// Number of live instances.
    pub fn instances(&self) -> usize {
        self.core.state.lock().instances.len()
    }

    /// Creates an instance with a tree of `shape`: one zeroed block.
    pub fn create(&self, shape: TreeShape) -> Result<(InstanceId, TreeGeometry), TreeHostError> {
        let bytes = CitronLayout::bytes(shape);
        let mut st = self.core.state.lock();
        st.sweep_retired();
        let offset = self.core.allocate_zeroed(&mut st.arena, bytes)?;
        let id = InstanceId(st.next_id);
        st.next_id += 1;
        let base = RemoteAddr::new(self.core.region, offset);
        let geometry = TreeGeometry::from_layout(CitronLayout { base, shape });
        st.instances.insert(
            id,
            Instance { geometry: geometry.clone(), blocks: BTreeMap::from([(offset, bytes)]), scaling: None },
        );
        Ok((id, geometry))
    }

    /// Lets this host scale `id` up itself ([`LockMemoryHost::with_scaler`]):
    /// `spillover` is the instance's spillover mutex (a DSLR word every
    /// client uses), and the host never grows the tree deeper than
    /// `max_depth` (what lies beyond stays with the spillover mutex).
    pub fn enable_scaling(
        &self,
        id: InstanceId,
        spillover: RemoteAddr,
        max_depth: u32,
    ) -> Result<(), TreeHostError> {
        if spillover.region != self.core.region || !spillover.is_aligned(8) {
            return Err(TreeHostError::Refused(format!(
                "spillover word {spillover:?} is not in this host's region"
            )));
        }
        if max_depth > MAX_DEPTH {
            return Err(TreeHostError::Refused(format!("depth cap {max_depth} above {MAX_DEPTH}")));
        }
        let mut st = self.core.state.lock();
        let inst = st.instances.get_mut(&id).ok_or(TreeHostError::UnknownInstance(id))?;
        inst.scaling = Some(Scaling { spillover, max_depth, turn: Arc::new(Mutex::new(())) });
        Ok(())
    }

    /// Frees every block of an instance. Its clients must be gone. If the
    /// host is scaling it right now, the blocks are freed when that ends.
    pub fn destroy(&self, id: InstanceId) -> Result<(), TreeHostError> {
        let mut st = self.core.state.lock();
        let inst = st.instances.remove(&id).ok_or(TreeHostError::UnknownInstance(id))?;
        let busy = inst.scaling.as_ref().is_some_and(|s| s.turn.try_lock().is_none());
        match inst.scaling {
            Some(s) if busy => st.retired.push(Retired { turn: s.turn, blocks: inst.blocks }),
            _ => {
                for (offset, bytes) in inst.blocks {
                    st.arena.release(offset, bytes);
                }
            }
        }
        st.sweep_retired();
        Ok(())
    }

    /// A handle for one instance, in this process.
    pub fn instance(self: &Arc<Self>, id: InstanceId) -> LocalTreeHost {
        LocalTreeHost { host: self.clone(), id }
    }

    /// Serves this host's instances over tcp.
    pub fn serve(self: &Arc<Self>, listen: SocketAddr) -> std::io::Result<TreeHostServer> {
        self.serve_with(listen, citron_rpc::auth::Authority::Open)
    }

    /// [`LockMemoryHost::serve`] letting in only whom `authority` does.
    pub fn serve_with(
        self: &Arc<Self>,
        listen: SocketAddr,
        authority: citron_rpc::auth::Authority,
    ) -> std::io::Result<TreeHostServer> {
        let server = RpcServer::spawn_with(listen, self.clone(), "tree-host", authority)?;
        log::info!("Citron tree host listening on {}", server.local_addr());
        Ok(TreeHostServer { server })
    }

    /// Algorithm 4 for `id`, run here ([`TreeHost::scale_up`]).
    pub fn scale_up(&self, id: InstanceId, at_least: u64) -> Result<HostScaleUp, TreeHostError> {
        let scaler = self
            .scaler
            .as_ref()
            .ok_or_else(|| TreeHostError::Refused("this lock host does not run scale-ups".into()))?;
        let started = Instant::now();
        let scaling = {
            let st = self.core.state.lock();
            let inst = st.instances.get(&id).ok_or(TreeHostError::UnknownInstance(id))?;
            inst.scaling.clone().ok_or_else(|| {
                TreeHostError::Refused(format!("{id:?} has no spillover mutex registered for scaling"))
            })?
        };
        // One scale-up of the instance at a time: a second asker waits for
        // the first and then finds the tree grown (nothing to do).
        let mut result = {
            let _turn = scaling.turn.lock();
            // Destroyed while we waited? Then nothing may touch its memory.
            let geometry = self.core.configuration(id)?;
            let ep = match scaler.endpoints.lock().pop() {
                Some(ep) => ep,
                None => scaler.node.endpoint().map_err(|e| TreeHostError::Transport(e.to_string()))?,
            };
            let host: Arc<dyn TreeHost> = Arc::new(CoreInstance { core: self.core.clone(), id });
            let spillover = Box::new(DslrLock::new(scaling.spillover, scaler.dslr));
            let outcome = CitronClient::with_geometry(host, geometry, scaler.citron, spillover)
                .map_err(|e| TreeHostError::Refused(e.to_string()))
                .and_then(|mut client| {
                    client.set_scale_policy(ScalePolicy::Manual);
                    client.set_max_depth(scaling.max_depth);
                    let report = client.scale_up(&ep, at_least).map_err(|e| match e {
                        LockError::Rdma(crate::rdma::RdmaError::Transport(t)) => {
                            TreeHostError::Transport(t.to_string())
                        }
                        other => TreeHostError::Refused(other.to_string()),
                    })?;
                    Ok(HostScaleUp {
                        geometry: client.geometry().clone(),
                        report,
                        max_depth: scaling.max_depth,
                    })
                });
            if !matches!(outcome, Err(TreeHostError::Transport(_))) {
                scaler.endpoints.lock().push(ep);
            }
            outcome
        };
        // Memory of an instance destroyed during the scale-up goes back now.
        self.core.state.lock().sweep_retired();
        let elapsed = started.elapsed();
        let mut stats = scaler.stats.lock();
        stats.asked += 1;
        match &mut result {
            Ok(HostScaleUp { report: Some(r), .. }) => {
                r.elapsed = elapsed;
                stats.grew += 1;
                stats.grew_time += elapsed;
                stats.last = Some(*r);
                log::debug!("host scaled {id:?} from depth {} to {} in {elapsed:?}", r.from_depth, r.to_depth)
            }
            Ok(_) => {}
            Err(e) => {
                stats.failed += 1;
                log::warn!("host scale-up of {id:?} failed: {e}")
            }
        }
        result
    }

    fn allocate(&self, id: InstanceId, bytes: u64) -> Result<RemoteAddr, TreeHostError> {
        self.core.allocate(id, bytes)
    }

    fn free(&self, id: InstanceId, addr: RemoteAddr, bytes: u64) -> Result<(), TreeHostError> {
        self.core.free(id, addr, bytes)
    }

    fn configuration(&self, id: InstanceId) -> Result<TreeGeometry, TreeHostError> {
        self.core.configuration(id)
    }

    fn publish(&self, id: InstanceId, expected: u64, next: &TreeGeometry) -> Result<(), TreeHostError> {
        self.core.publish(id, expected, next)
    }
}

impl HostCore {
    fn allocate_zeroed(&self, arena: &mut Arena, bytes: u64) -> Result<u64, TreeHostError> {
        if bytes == 0 {
            return Err(TreeHostError::Refused("zero-byte allocation".into()));
        }
        let offset = arena.allocate(bytes).ok_or(TreeHostError::OutOfMemory { requested: bytes })?;
        if let Err(e) = self.zero(offset, bytes) {
            arena.release(offset, bytes);
            return Err(e);
        }
        Ok(offset)
    }

    fn zero(&self, offset: u64, bytes: u64) -> Result<(), TreeHostError> {
        let region = self.regions.get(self.region).map_err(|e| TreeHostError::Refused(e.to_string()))?;
        const CHUNK: u64 = 64 * 1024;
        // As large as one write needs: a file's lock area is a few hundred
        // bytes, and a 64 KiB buffer cost a 64 KiB memset per file opened,
        // under the state lock (seen in the meta-server's profile of a
        // create loop).
        let zeros = vec![0u8; bytes.min(CHUNK) as usize];
        let mut done = 0;
        while done < bytes {
            let n = (bytes - done).min(CHUNK);
            region
                .write_from(RemoteAddr::new(self.region, offset + done), &zeros[..n as usize])
                .map_err(|e| TreeHostError::Refused(e.to_string()))?;
            done += n;
        }
        Ok(())
    }

    fn allocate(&self, id: InstanceId, bytes: u64) -> Result<RemoteAddr, TreeHostError> {
        let mut st = self.state.lock();
        if !st.instances.contains_key(&id) {
            return Err(TreeHostError::UnknownInstance(id));
        }
        st.sweep_retired();
        let offset = self.allocate_zeroed(&mut st.arena, bytes)?;
        st.instances.get_mut(&id).expect("checked").blocks.insert(offset, bytes);
        Ok(RemoteAddr::new(self.region, offset))
    }

    fn free(&self, id: InstanceId, addr: RemoteAddr, bytes: u64) -> Result<(), TreeHostError> {
        let mut st = self.state.lock();
        let inst = st.instances.get_mut(&id).ok_or(TreeHostError::UnknownInstance(id))?;
        if addr.region != self.region || inst.blocks.get(&addr.offset) != Some(&bytes) {
            return Err(TreeHostError::Refused(format!("{addr:?} + {bytes} is not an allocation of {id:?}")));
        }
        if inst.geometry.blocks().iter().any(|&(a, _)| a == addr) {
            return Err(TreeHostError::Refused(format!("{addr:?} is still part of {id:?}'s configuration")));
        }
        if inst.scaling.as_ref().is_some_and(|s| s.spillover == addr) {
            return Err(TreeHostError::Refused(format!("{addr:?} is {id:?}'s spillover mutex")));
        }
        inst.blocks.remove(&addr.offset);
        st.arena.release(addr.offset, bytes);
        Ok(())
    }

    fn configuration(&self, id: InstanceId) -> Result<TreeGeometry, TreeHostError> {
        let st = self.state.lock();
        Ok(st.instances.get(&id).ok_or(TreeHostError::UnknownInstance(id))?.geometry.clone())
    }

    fn publish(&self, id: InstanceId, expected: u64, next: &TreeGeometry) -> Result<(), TreeHostError> {
        let mut st = self.state.lock();
        let inst = st.instances.get_mut(&id).ok_or(TreeHostError::UnknownInstance(id))?;
        if inst.geometry.version != expected {
            return Err(TreeHostError::VersionConflict { expected, found: inst.geometry.version });
        }
        if next.version <= expected {
            return Err(TreeHostError::Refused(format!(
                "new version {} is not above {expected}",
                next.version
            )));
        }
        if next.segments.len() > MAX_DEPTH as usize + 1 {
            return Err(TreeHostError::Refused(format!("{} segments", next.segments.len())));
        }
        next.validate().map_err(|e| TreeHostError::Refused(e.to_string()))?;
        // Every block of the new configuration must be one of the instance's
        // allocations, of exactly its size.
        for (addr, bytes) in next.blocks() {
            if addr.region != self.region || inst.blocks.get(&addr.offset) != Some(&bytes) {
                return Err(TreeHostError::Refused(format!(
                    "{addr:?} + {bytes} in the new configuration is not an allocation of {id:?}"
                )));
            }
        }
        inst.geometry = next.clone();
        Ok(())
    }
}

/// The host's own view of one instance, for its scaler's client: plain
/// allocation and publication (it runs Algorithm 4 itself, so it must not
/// delegate).
struct CoreInstance {
    core: Arc<HostCore>,
    id: InstanceId,
}

impl TreeHost for CoreInstance {
    fn allocate(&self, bytes: u64) -> Result<RemoteAddr, TreeHostError> {
        self.core.allocate(self.id, bytes)
    }
    fn free(&self, addr: RemoteAddr, bytes: u64) -> Result<(), TreeHostError> {
        self.core.free(self.id, addr, bytes)
    }
    fn configuration(&self) -> Result<TreeGeometry, TreeHostError> {
        self.core.configuration(self.id)
    }
    fn publish(&self, expected: u64, next: &TreeGeometry) -> Result<(), TreeHostError> {
        self.core.publish(self.id, expected, next)
    }
}

/// One instance of a [`LockMemoryHost`] in this process.
#[derive(Clone, Debug)]
pub struct LocalTreeHost {
    host: Arc<LockMemoryHost>,
    id: InstanceId,
}

impl LocalTreeHost {
    pub fn id(&self) -> InstanceId {
        self.id
    }
}

impl TreeHost for LocalTreeHost {
    fn allocate(&self, bytes: u64) -> Result<RemoteAddr, TreeHostError> {
        self.host.allocate(self.id, bytes)
    }
    fn free(&self, addr: RemoteAddr, bytes: u64) -> Result<(), TreeHostError> {
        self.host.free(self.id, addr, bytes)
    }
    fn configuration(&self) -> Result<TreeGeometry, TreeHostError> {
        self.host.configuration(self.id)
    }
    fn publish(&self, expected: u64, next: &TreeGeometry) -> Result<(), TreeHostError> {
        self.host.publish(self.id, expected, next)
    }
    fn runs_scale_ups(&self) -> bool {
        self.host.runs_scale_ups()
    }
    fn scale_up(&self, at_least: u64) -> Result<HostScaleUp, TreeHostError> {
        self.host.scale_up(self.id, at_least)
    }
}

/// Requests of the tree-host RPC.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum TreeHostRequest {
    Create {
        depth: u32,
    },
    Destroy {
        instance: InstanceId,
    },
    Allocate {
        instance: InstanceId,
        bytes: u64,
    },
    Free {
        instance: InstanceId,
        addr: RemoteAddr,
        bytes: u64,
    },
    Configuration {
        instance: InstanceId,
    },
    Publish {
        instance: InstanceId,
        expected: u64,
        next: TreeGeometry,
    },
    /// Whether the host runs scale-ups ([`TreeHost::runs_scale_ups`]).
    RunsScaleUps,
    /// Algorithm 4, run by the host ([`TreeHost::scale_up`]).
    ScaleUp {
        instance: InstanceId,
        at_least: u64,
    },
}

/// Answers of the tree-host RPC.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum TreeHostResponse {
    Created { instance: InstanceId, geometry: TreeGeometry },
    Allocated(RemoteAddr),
    Done,
    Configuration(TreeGeometry),
    RunsScaleUps(bool),
    Scaled(HostScaleUp),
    Error(TreeHostError),
}

impl RpcService for LockMemoryHost {
    type Request = TreeHostRequest;
    type Response = TreeHostResponse;

    fn handle(&self, request: TreeHostRequest, _peer: SocketAddr) -> TreeHostResponse {
        let changes = matches!(
            request,
            TreeHostRequest::Create { .. }
                | TreeHostRequest::Destroy { .. }
                | TreeHostRequest::Allocate { .. }
                | TreeHostRequest::Free { .. }
                | TreeHostRequest::Publish { .. }
        );
        if changes && self.runs_scale_ups() {
            // Only the owner and the host's own scaler change instances here,
            // so no client can leave a scale-up half done.
            return TreeHostResponse::Error(TreeHostError::Refused(
                "this lock host scales its trees itself; ask it with ScaleUp".into(),
            ));
        }
        let answer = match request {
            TreeHostRequest::Create { depth } if depth <= MAX_DEPTH => self
                .create(TreeShape::new(depth))
                .map(|(instance, geometry)| TreeHostResponse::Created { instance, geometry }),
            TreeHostRequest::Create { depth } => Err(TreeHostError::Refused(format!("depth {depth}"))),
            TreeHostRequest::Destroy { instance } => self.destroy(instance).map(|()| TreeHostResponse::Done),
            TreeHostRequest::Allocate { instance, bytes } => {
                self.allocate(instance, bytes).map(TreeHostResponse::Allocated)
            }
            TreeHostRequest::Free { instance, addr, bytes } => {
                self.free(instance, addr, bytes).map(|()| TreeHostResponse::Done)
            }
            TreeHostRequest::Configuration { instance } => {
                self.configuration(instance).map(TreeHostResponse::Configuration)
            }
            TreeHostRequest::Publish { instance, expected, next } => {
                self.publish(instance, expected, &next).map(|()| TreeHostResponse::Done)
            }
            TreeHostRequest::RunsScaleUps => Ok(TreeHostResponse::RunsScaleUps(self.runs_scale_ups())),
            TreeHostRequest::ScaleUp { instance, at_least } => {
                self.scale_up(instance, at_least).map(TreeHostResponse::Scaled)
            }
        };
        answer.unwrap_or_else(TreeHostResponse::Error)
    }

    fn malformed(&self, error: String) -> TreeHostResponse {
        TreeHostResponse::Error(TreeHostError::Refused(format!("malformed request: {error}")))
    }
}

/// A [`LockMemoryHost`] served over tcp. Dropping it stops the service.
pub struct TreeHostServer {
    server: RpcServer<Arc<LockMemoryHost>>,
}

impl TreeHostServer {
    pub fn local_addr(&self) -> SocketAddr {
        self.server.local_addr()
    }

    pub fn shutdown(&mut self) {
        self.server.shutdown();
    }

    /// Requests answered so far (every RPC a client made).
    pub fn requests(&self) -> u64 {
        self.server.stats().requests.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// The tcp client of a [`TreeHostServer`], shared by the instances it serves.
pub type TreeHostRpc = RpcClient<TreeHostRequest, TreeHostResponse>;

/// One instance of a remote lock host.
#[derive(Clone)]
pub struct RemoteTreeHost {
    rpc: Arc<TreeHostRpc>,
    id: InstanceId,
    /// Whether the host runs scale-ups: known at construction, or asked
    /// once when first needed.
    scales: std::sync::OnceLock<bool>,
}

impl std::fmt::Debug for RemoteTreeHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteTreeHost").field("server", &self.rpc.server()).field("id", &self.id).finish()
    }
}

fn call(rpc: &TreeHostRpc, request: &TreeHostRequest) -> Result<TreeHostResponse, TreeHostError> {
    match rpc.call(request) {
        Ok(TreeHostResponse::Error(e)) => Err(e),
        Ok(r) => Ok(r),
        Err(e) => Err(TreeHostError::Transport(e.to_string())),
    }
}

fn unexpected(r: TreeHostResponse) -> TreeHostError {
    TreeHostError::Transport(format!("unexpected answer {r:?}"))
}

impl RemoteTreeHost {
    /// A client of the tree host at `server`; `timeout` bounds every call.
    pub fn connect(server: SocketAddr, timeout: Duration) -> Arc<TreeHostRpc> {
        Self::connect_as(server, timeout, citron_rpc::auth::Credentials::anonymous())
    }

    /// [`RemoteTreeHost::connect`] proving `credentials`.
    pub fn connect_as(
        server: SocketAddr,
        timeout: Duration,
        credentials: citron_rpc::auth::Credentials,
    ) -> Arc<TreeHostRpc> {
        Arc::new(RpcClient::new(server, timeout).with_credentials(credentials))
    }

    /// An existing instance. Whether the host runs scale-ups is asked (one
    /// RPC) the first time a scale-up is wanted.
    pub fn new(rpc: Arc<TreeHostRpc>, id: InstanceId) -> Self {
        Self { rpc, id, scales: std::sync::OnceLock::new() }
    }

    /// An existing instance of a host known to run its scale-ups
    /// ([`LockMemoryHost::with_scaler`]): no RPC to ask.
    pub fn host_scaled(rpc: Arc<TreeHostRpc>, id: InstanceId) -> Self {
        Self { rpc, id, scales: std::sync::OnceLock::from(true) }
    }

    /// Creates an instance with a tree of `depth` on the host.
    pub fn create(rpc: Arc<TreeHostRpc>, depth: u32) -> Result<(Self, TreeGeometry), TreeHostError> {
        match call(&rpc, &TreeHostRequest::Create { depth })? {
            TreeHostResponse::Created { instance, geometry } => Ok((Self::new(rpc, instance), geometry)),
            other => Err(unexpected(other)),
        }
    }

    pub fn id(&self) -> InstanceId {
        self.id
    }

    /// Frees the instance on the host.
    pub fn destroy(self) -> Result<(), TreeHostError> {
        match call(&self.rpc, &TreeHostRequest::Destroy { instance: self.id })? {
            TreeHostResponse::Done => Ok(()),
            other => Err(unexpected(other)),
        }
    }
}

impl TreeHost for RemoteTreeHost {
    fn allocate(&self, bytes: u64) -> Result<RemoteAddr, TreeHostError> {
        match call(&self.rpc, &TreeHostRequest::Allocate { instance: self.id, bytes })? {
            TreeHostResponse::Allocated(a) => Ok(a),
            other => Err(unexpected(other)),
        }
    }
    fn free(&self, addr: RemoteAddr, bytes: u64) -> Result<(), TreeHostError> {
        match call(&self.rpc, &TreeHostRequest::Free { instance: self.id, addr, bytes })? {
            TreeHostResponse::Done => Ok(()),
            other => Err(unexpected(other)),
        }
    }
    fn configuration(&self) -> Result<TreeGeometry, TreeHostError> {
        match call(&self.rpc, &TreeHostRequest::Configuration { instance: self.id })? {
            TreeHostResponse::Configuration(g) => Ok(g),
            other => Err(unexpected(other)),
        }
    }
    fn publish(&self, expected: u64, next: &TreeGeometry) -> Result<(), TreeHostError> {
        let request = TreeHostRequest::Publish { instance: self.id, expected, next: next.clone() };
        match call(&self.rpc, &request)? {
            TreeHostResponse::Done => Ok(()),
            other => Err(unexpected(other)),
        }
    }
    fn runs_scale_ups(&self) -> bool {
        if let Some(&b) = self.scales.get() {
            return b;
        }
        match call(&self.rpc, &TreeHostRequest::RunsScaleUps) {
            Ok(TreeHostResponse::RunsScaleUps(b)) => *self.scales.get_or_init(|| b),
            other => {
                // Not remembered: the next scale-up asks again.
                log::warn!("cannot tell whether the tree host runs scale-ups ({other:?}); assuming not");
                false
            }
        }
    }
    fn scale_up(&self, at_least: u64) -> Result<HostScaleUp, TreeHostError> {
        match call(&self.rpc, &TreeHostRequest::ScaleUp { instance: self.id, at_least })? {
            TreeHostResponse::Scaled(s) => Ok(s),
            other => Err(unexpected(other)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::citron::geometry::TreeSegment;
    use crate::rdma::RegionMemory;

    fn host() -> Arc<LockMemoryHost> {
        let regions = Arc::new(RegionTable::new());
        regions.insert(RegionMemory::anonymous(RegionId(7), 1 << 16).unwrap()).unwrap();
        Arc::new(LockMemoryHost::new(regions, RegionId(7), 1024, 1 << 16))
    }

    #[test]
    fn arena_first_fit_and_coalescing() {
        let mut a = Arena::new(0, 160);
        let x = a.allocate(8).unwrap();
        let y = a.allocate(40).unwrap();
        let z = a.allocate(16).unwrap();
        assert_eq!((x, y, z), (0, 16, 64));
        assert_eq!(a.allocate(200), None);
        a.release(y, 40);
        assert_eq!(a.allocate(32), Some(16), "first fit reuses the hole");
        a.release(16, 32);
        a.release(x, 8);
        a.release(z, 16);
        assert_eq!(a.free, BTreeMap::from([(0, 160)]), "everything coalesced back");
    }

    #[test]
    fn memory_is_zeroed_owned_and_checked() {
        let h = host();
        let regions = h.core.regions.clone();
        let (id, g) = h.create(TreeShape::new(1)).unwrap();
        let inst = h.instance(id);
        let seg = inst.allocate(8 * 16).unwrap();
        // Dirty it, free it through a configuration that never used it, and
        // get it back zeroed.
        let region = regions.get(RegionId(7)).unwrap();
        region.write_from(seg, &[0xff; 128]).unwrap();
        inst.free(seg, 128).unwrap();
        assert!(inst.free(seg, 128).is_err(), "double free refused");
        let again = inst.allocate(128).unwrap();
        assert_eq!(again, seg);
        let mut buf = [1u8; 128];
        region.read_into(again, &mut buf).unwrap();
        assert_eq!(buf, [0u8; 128]);
        // Publishing: version, ownership and shape are checked.
        let mut next = g.clone();
        next.version = 1;
        next.segments.push(TreeSegment { nodes: again, depth: 2 });
        assert!(matches!(inst.publish(5, &next), Err(TreeHostError::VersionConflict { .. })));
        let mut foreign = next.clone();
        foreign.segments[1].nodes = RemoteAddr::new(RegionId(7), 60000);
        assert!(matches!(inst.publish(0, &foreign), Err(TreeHostError::Refused(_))));
        inst.publish(0, &next).unwrap();
        assert_eq!(inst.configuration().unwrap(), next);
        assert!(inst.free(again, 128).is_err(), "a block in use cannot be freed");
        // Another instance cannot free this one's memory.
        let (other, _) = h.create(TreeShape::new(1)).unwrap();
        assert!(h.instance(other).free(again, 128).is_err());
        let before = h.free_bytes();
        h.destroy(id).unwrap();
        assert!(h.free_bytes() > before);
        assert_eq!(inst.configuration(), Err(TreeHostError::UnknownInstance(id)));
    }

    #[test]
    fn an_instance_destroyed_while_scaling_keeps_its_memory_until_the_scale_up_ends() {
        let h = host();
        let free = h.free_bytes();
        let (id, _) = h.create(TreeShape::new(1)).unwrap();
        let spill = h.instance(id).allocate(8).unwrap();
        assert!(h.enable_scaling(id, RemoteAddr::new(RegionId(9), 0), 5).is_err(), "foreign region");
        assert!(h.enable_scaling(id, spill, MAX_DEPTH + 1).is_err(), "cap too deep");
        h.enable_scaling(id, spill, 5).unwrap();
        assert!(h.instance(id).free(spill, 8).is_err(), "the spillover word cannot be freed");
        // Without a scaler the host refuses to scale.
        assert!(!h.runs_scale_ups());
        assert!(matches!(h.instance(id).scale_up(0), Err(TreeHostError::Refused(_))));
        // A scale-up in progress holds the instance's turn.
        let turn = h.core.state.lock().instances[&id].scaling.as_ref().unwrap().turn.clone();
        let running = turn.lock();
        h.destroy(id).unwrap();
        assert!(h.free_bytes() < free, "its memory stays while the scale-up runs");
        assert_eq!(h.instance(id).configuration(), Err(TreeHostError::UnknownInstance(id)));
        assert_eq!(h.instances(), 0);
        drop(running);
        assert_eq!(h.free_bytes(), free, "and goes back once it has ended");
    }

    #[test]
    fn rpc_round_trip_and_bad_input() {
        let h = host();
        let server = h.serve("127.0.0.1:0".parse().unwrap()).unwrap();
        let rpc = RemoteTreeHost::connect(server.local_addr(), Duration::from_secs(5));
        let (remote, g) = RemoteTreeHost::create(rpc.clone(), 2).unwrap();
        assert_eq!(remote.configuration().unwrap(), g);
        let a = remote.allocate(64).unwrap();
        assert!(matches!(remote.free(a, 65), Err(TreeHostError::Refused(_))));
        remote.free(a, 64).unwrap();
        let ghost = RemoteTreeHost::new(rpc.clone(), InstanceId(999));
        assert_eq!(ghost.configuration(), Err(TreeHostError::UnknownInstance(InstanceId(999))));
        assert!(matches!(call(&rpc, &TreeHostRequest::Create { depth: 99 }), Err(TreeHostError::Refused(_))));
        remote.destroy().unwrap();
    }
}
