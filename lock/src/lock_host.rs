//! One factory over every lock algorithm of this crate: what a lock host
//! runs for them, what its clients are told, and how a client opens any
//! lock by [`Algorithm`].
//!
//! Three parts, one per role:
//!
//! * **Memory.** A lock is [`Algorithm::lock_bytes`] bytes of host memory at
//!   an address aligned to [`Algorithm::lock_align`]; zeroed memory is an
//!   idle lock. Whoever owns the memory (the meta-server for inode mutexes)
//!   allocates it; this module never allocates locks.
//! * **Host.** A host process (meta-server, `citronfs region-host`, the
//!   benchmarks' host) starts one [`LockHost`] over its [`Node`], giving it
//!   [`LockHostConfig::area_bytes`] of zeroed memory for the services'
//!   own words. It runs whatever host-side services the algorithms need —
//!   today ShiftLock's era recovery (shiftlock-fast25.md §3.6:
//!   [`RecoveryService`] over an [`EraTable`] in that area) — and yields a
//!   [`LockHostInfo`], serialisable, that clients receive (in an open reply,
//!   on a worker's command line).
//! * **Client.** Per endpoint (one thread), a client measures its
//!   [`LockTiming`] once (from [`Endpoint::measure_rtt`], never hard-coded:
//!   the papers' timeouts are multiples of their 2 µs RTT) and makes one
//!   [`LockContext`] (state every handle on that endpoint shares: ShiftLock's
//!   [`Postbox`]). Then [`open_lock`] gives a `Box<dyn RwLockClient>` for any
//!   lock, once per (endpoint, lock).
//!
//! ```text
//!   // host, once:
//!   let host = LockHost::start(&node, area, LockHostConfig::default())?;
//!   let info: LockHostInfo = host.info().clone();            // to every client
//!   // host, per lock (e.g. per file's inode mutex):
//!   let addr = allocate(Algorithm::ShiftLock.lock_bytes(), Algorithm::ShiftLock.lock_align());
//!   // client, per endpoint:
//!   let timing = LockTiming::measure(&ep, &info)?;
//!   let ctx = LockContext::new(&ep);
//!   // client, per lock:
//!   let mut mutex = open_lock(Algorithm::ShiftLock, &ep, &info, addr, timing, &ctx)?;
//!   let _g = RwLockGuard::acquire(&mut *mutex, &ep, Mode::Exclusive)?;
//! ```
//!
//! Choices:
//! * The host needs only a [`Node`], not its `RegionTable`: the recovery
//!   service works with verbs through its own endpoint (CPU atomics on shm,
//!   the local software NIC on tcp), so a `LockHost` can also serve memory of
//!   a fabric another process hosts (the benchmark with `--fabric`).
//! * The RTT probe is the first era counter: host memory that exists
//!   whenever a lock host does, and that clients only read.
//! * [`LockHostInfo`] travels as bincode ([`LockHostInfo::encode`]); a text
//!   form (hex of the same bytes) is [`LockHostInfo::to_hex`], for command
//!   lines.
//!
//! # Not built yet
//!
//! DQL, the centralised RPC lock server and ALock are being written on
//! other branches. Until they are merged, [`open_lock`] answers
//! [`LockError::NotBuilt`] for them. Plugging one in touches only the lines
//! marked `NOT BUILT YET` here and in `rwlock.rs`: its layout in
//! `Algorithm::layout`, `true` in `Algorithm::is_built` (and a place in
//! `Algorithm::BUILT`), its arm in [`open_lock`], and — if it has a
//! host-side part (the RPC server's thread) — a field of [`LockHostInfo`]
//! set in [`LockHost::start`], or per-endpoint state (a DQL postbox) in
//! [`LockContext`].

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::alock::{AlockClient, AlockConfig, AlockPostbox};
use crate::cas_spin::{CasSpinConfig, CasSpinLock};
use crate::dql::{DqlConfig, DqlLock, DqlPostbox};
use crate::dslr::{DslrConfig, DslrLock};
use crate::postbox::ForeignMessages;
use crate::rdma::{ClientAddr, Endpoint, Node, RemoteAddr};
use crate::rpc_lock::{
    RpcLockClient, RpcLockConfig, RpcLockId, RpcLockServer, RpcLockServerConfig, RpcLockServerStats,
    RpcLockSession,
};
use crate::rwlock::{Algorithm, LockError, RwLockClient};
use crate::shiftlock::{
    EraTable, Postbox, RecoveryLocator, RecoveryService, RecoveryStats, ShiftLockClient, ShiftLockConfig,
    ShiftLockRef,
};

/// Reads of the probe whose median is the RTT.
pub const RTT_SAMPLES: usize = 16;

/// Timing of one client's locks: the transport's measured round-trip time,
/// from which every algorithm derives its waits and leases (each module's
/// `from_rtt`), and optionally a lease to use instead of the derived one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LockTiming {
    pub rtt: Duration,
    /// Overrides the lease of the algorithms that have one (ShiftLock's
    /// T_lease, DSLR's lease); `None` keeps their RTT-derived default.
    pub lease: Option<Duration>,
    /// The fence delay of the algorithms that recover silent holders
    /// (ShiftLock, DSLR, DQL, ALock): how long after a holder's lease ran
    /// out its cluster may still need to fence it at the servers; each
    /// waits that much longer before it takes a silent holder for dead.
    /// Zero unless a file system sets it (see each config's `fence_delay`).
    #[serde(default)]
    pub fence_delay: Duration,
}

impl LockTiming {
    pub fn from_rtt(rtt: Duration) -> Self {
        Self { rtt, lease: None, fence_delay: Duration::ZERO }
    }

    pub fn with_lease(self, lease: Duration) -> Self {
        Self { lease: Some(lease), ..self }
    }

    pub fn with_fence_delay(self, fence_delay: Duration) -> Self {
        Self { fence_delay, ..self }
    }

    /// Measures the RTT from `ep` to the lock host (median of
    /// [`RTT_SAMPLES`] reads of its probe word).
    pub fn measure(ep: &Endpoint, host: &LockHostInfo) -> Result<Self, LockError> {
        Ok(Self::from_rtt(ep.measure_rtt(host.rtt_probe(), RTT_SAMPLES)?))
    }
}

/// What a lock host's clients need to know to use its locks.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LockHostInfo {
    /// ShiftLock's recovery service and era counters (§3.6).
    pub shiftlock: RecoveryLocator,
    /// The centralised RPC lock server (the `rpc` baseline).
    pub rpc_server: std::net::SocketAddr,
}

impl LockHostInfo {
    /// A word of host memory clients may read to measure the RTT.
    pub fn rtt_probe(&self) -> RemoteAddr {
        self.shiftlock.eras.base
    }

    pub fn encode(&self) -> Vec<u8> {
        bincode::serialize(self).expect("a LockHostInfo always serialises")
    }

    pub fn decode(bytes: &[u8]) -> Result<Self, LockError> {
        bincode::deserialize(bytes).map_err(|e| LockError::Host(format!("malformed lock host info: {e}")))
    }

    /// [`LockHostInfo::encode`] as lowercase hex, for a command line.
    pub fn to_hex(&self) -> String {
        self.encode().iter().map(|b| format!("{b:02x}")).collect()
    }

    pub fn from_hex(s: &str) -> Result<Self, LockError> {
        let bad = || LockError::Host(format!("lock host info {s:?} is not hex"));
        if !s.len().is_multiple_of(2) || !s.is_ascii() {
            return Err(bad());
        }
        let bytes: Vec<u8> = (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).map_err(|_| bad()))
            .collect::<Result<_, _>>()?;
        Self::decode(&bytes)
    }
}

/// How a lock host is set up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LockHostConfig {
    /// ShiftLock era counters: locks hash onto them, and recoveries of locks
    /// under different counters never reject each other's requests (§3.6,
    /// "improving recovery performance").
    pub era_counters: u32,
    /// Where the RPC lock server listens (port 0: any).
    pub rpc_listen: std::net::SocketAddr,
    /// The RPC lock server's client lease; `None` derives it from the RTT
    /// (1 s on a fast fabric). The default is 5 s, a cluster's client lease:
    /// a session renews every quarter lease, and on a loaded host a 1 s lease
    /// can lapse under a live client.
    pub rpc_lease: Option<Duration>,
}

impl Default for LockHostConfig {
    fn default() -> Self {
        Self {
            era_counters: 64,
            rpc_listen: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
            rpc_lease: Some(Duration::from_secs(5)),
        }
    }
}

impl LockHostConfig {
    /// Alignment of the area given to [`LockHost::start`].
    pub const AREA_ALIGN: u64 = 64;

    /// Bytes of zeroed host memory [`LockHost::start`] needs.
    pub const fn area_bytes(&self) -> u64 {
        EraTable::bytes(self.era_counters).next_multiple_of(Self::AREA_ALIGN)
    }
}

/// What a lock host's services have done.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LockHostStats {
    pub shiftlock_recovery: RecoveryStats,
    pub rpc_server: RpcLockServerStats,
}

/// The host-side services of every algorithm, for one lock host. Start one
/// per host process; dropping it stops the services.
pub struct LockHost {
    info: LockHostInfo,
    recovery: RecoveryService,
    rpc: RpcLockServer,
}

impl std::fmt::Debug for LockHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LockHost").field("info", &self.info).finish()
    }
}

impl LockHost {
    /// Starts the services on `node` (a node of the host process), with
    /// `area`: [`LockHostConfig::area_bytes`] of zeroed host memory, aligned
    /// to [`LockHostConfig::AREA_ALIGN`], that nothing else uses.
    pub fn start(node: &Node, area: RemoteAddr, config: LockHostConfig) -> Result<Self, LockError> {
        Self::start_with(node, area, config, citron_rpc::auth::Authority::Open)
    }

    /// [`LockHost::start`] whose RPC lock server lets in only whom
    /// `authority` does.
    pub fn start_with(
        node: &Node,
        area: RemoteAddr,
        config: LockHostConfig,
        authority: citron_rpc::auth::Authority,
    ) -> Result<Self, LockError> {
        Self::start_on(node, None, area, config, authority)
    }

    /// [`LockHost::start_with`] whose ShiftLock recovery service also has a
    /// mailbox on `nic`, a node of the host's NIC, when `node` is on another
    /// fabric (shm): clients that reach the host only through its NIC (tcp
    /// mounts) could not send to a shm mailbox, and a lock one of them
    /// waits for would never be recovered.
    pub fn start_on(
        node: &Node,
        nic: Option<&Node>,
        area: RemoteAddr,
        config: LockHostConfig,
        authority: citron_rpc::auth::Authority,
    ) -> Result<Self, LockError> {
        if !area.is_aligned(LockHostConfig::AREA_ALIGN) {
            return Err(LockError::Misuse("the lock host's area must be 64-aligned"));
        }
        let eras = EraTable { base: area, count: config.era_counters };
        let nodes: Vec<Node> = std::iter::once(node).chain(nic).cloned().collect();
        let recovery = RecoveryService::spawn_on(&nodes, eras)?;
        let mut rpc_config = RpcLockServerConfig::from_rtt(Duration::from_micros(10));
        if let Some(lease) = config.rpc_lease {
            rpc_config = rpc_config.with_lease(lease);
        }
        let rpc = RpcLockServer::spawn_with(config.rpc_listen, rpc_config, authority)
            .map_err(|e| LockError::Host(format!("cannot start the RPC lock server: {e}")))?;
        let info = LockHostInfo { shiftlock: recovery.locator(), rpc_server: rpc.local_addr() };
        log::info!(
            "lock host on {node:?}: area {area}, {} era counters, RPC lock server {}",
            config.era_counters,
            rpc.local_addr()
        );
        Ok(Self { info, recovery, rpc })
    }

    pub fn info(&self) -> &LockHostInfo {
        &self.info
    }

    pub fn stats(&self) -> LockHostStats {
        LockHostStats { shiftlock_recovery: self.recovery.stats(), rpc_server: self.rpc.stats() }
    }
}

/// State that every lock handle used with one endpoint shares: messages
/// that arrive for one lock while the thread waits on another must not be
/// lost (ShiftLock's [`Postbox`]). One per endpoint; handles opened with it
/// must be used with that endpoint only.
///
/// ShiftLock, DQL and ALock each sort their messages with a postbox of their
/// own, and the three share one queue of foreign messages, so a message of
/// one protocol that another's postbox takes from the mailbox is adopted by
/// its own postbox later ([`ForeignMessages`]): one endpoint can hold an
/// inode mutex and an attribute ALock at once.
pub struct LockContext {
    endpoint: ClientAddr,
    shiftlock: Arc<Postbox>,
    dql: Arc<DqlPostbox>,
    alock: Arc<AlockPostbox>,
    /// One connection to the RPC lock server, opened on first use.
    rpc: parking_lot::Mutex<Option<Arc<RpcLockSession>>>,
    /// What that connection proves (the endpoint's node's credentials).
    credentials: citron_rpc::auth::Credentials,
}

impl std::fmt::Debug for LockContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LockContext").field("endpoint", &self.endpoint).finish()
    }
}

impl LockContext {
    pub fn new(ep: &Endpoint) -> Self {
        let foreign = ForeignMessages::new();
        let shiftlock = Arc::new(Postbox::sharing(foreign.clone()));
        let dql = Arc::new(DqlPostbox::sharing(foreign.clone()));
        let alock = Arc::new(AlockPostbox::sharing(foreign));
        let bound = shiftlock.bind(ep) && dql.bind(ep) && alock.bind(ep);
        debug_assert!(bound, "a fresh postbox binds to any endpoint");
        Self {
            endpoint: ep.addr(),
            shiftlock,
            dql,
            alock,
            rpc: parking_lot::Mutex::new(None),
            credentials: ep.node().credentials().host.clone(),
        }
    }

    /// The session to the RPC lock server at `server` (connected once).
    fn rpc_session(
        &self,
        server: std::net::SocketAddr,
        config: RpcLockConfig,
    ) -> Result<Arc<RpcLockSession>, LockError> {
        let mut s = self.rpc.lock();
        if let Some(session) = s.as_ref() {
            return Ok(session.clone());
        }
        let session = RpcLockSession::connect_as(server, config, self.credentials.clone())?;
        *s = Some(session.clone());
        Ok(session)
    }

    /// The endpoint this context serves.
    pub fn endpoint(&self) -> ClientAddr {
        self.endpoint
    }

    /// ShiftLock's postbox of this endpoint (also where messages of other
    /// protocols that share the mailbox are kept: [`Postbox::take_foreign`]).
    pub fn shiftlock_postbox(&self) -> &Arc<Postbox> {
        &self.shiftlock
    }
}

/// Opens one client's handle on the lock of algorithm `alg` at `addr` (zeroed
/// or idle memory of [`Algorithm::lock_bytes`], hosted by the lock host
/// `host`). `ctx` must be `ep`'s context; every verb of the handle goes
/// through `ep`.
///
/// Fails with [`LockError::NotBuilt`] for an algorithm this binary lacks and
/// with [`LockError::Misuse`] for a misaligned address or a foreign context.
/// Opening issues no verb.
pub fn open_lock(
    alg: Algorithm,
    ep: &Endpoint,
    host: &LockHostInfo,
    addr: RemoteAddr,
    timing: LockTiming,
    ctx: &LockContext,
) -> Result<Box<dyn RwLockClient>, LockError> {
    if !alg.is_built() {
        return Err(LockError::NotBuilt(alg));
    }
    if !addr.is_aligned(alg.lock_align()) {
        log::error!("{alg} lock at {addr} is not {}-aligned", alg.lock_align());
        return Err(LockError::Misuse("lock address not aligned as its algorithm requires"));
    }
    if ctx.endpoint != ep.addr() {
        return Err(LockError::Misuse("a LockContext serves only the endpoint it was made for"));
    }
    Ok(match alg {
        Algorithm::ShiftLock => {
            let mut config = ShiftLockConfig::from_rtt(timing.rtt);
            if let Some(lease) = timing.lease {
                config = config.with_lease(lease);
            }
            let config = config.with_fence_delay(timing.fence_delay);
            let lock = ShiftLockRef { entry: addr, recovery: host.shiftlock };
            Box::new(ShiftLockClient::new(lock, config, ctx.shiftlock.clone())?)
        }
        Algorithm::Dslr => {
            let mut config = DslrConfig::from_rtt(timing.rtt);
            if let Some(lease) = timing.lease {
                config = config.with_lease(lease);
            }
            Box::new(DslrLock::new(addr, config.with_fence_delay(timing.fence_delay)))
        }
        // No lease: the baseline has no recovery (see cas_spin).
        Algorithm::Cas => Box::new(CasSpinLock::new(addr, CasSpinConfig::from_rtt(timing.rtt))),
        Algorithm::Dql => {
            let mut config = DqlConfig::from_rtt(timing.rtt);
            if let Some(lease) = timing.lease {
                config = config.with_lease(lease);
            }
            let config = config.with_fence_delay(timing.fence_delay);
            Box::new(DqlLock::with_postbox(addr, config, ctx.dql.clone())?)
        }
        Algorithm::Rpc => {
            // The lock is named by its address on the lock host; the server
            // keeps its state (the memory at `addr` stays unused).
            let session = ctx.rpc_session(host.rpc_server, RpcLockConfig::from_rtt(timing.rtt))?;
            Box::new(RpcLockClient::with_session(&session, RpcLockId::from_addr(addr)?))
        }
        // A remote client's handle; host threads use `alock::AlockHost`.
        Algorithm::ALock => {
            let mut config = AlockConfig::from_rtt(timing.rtt);
            if let Some(lease) = timing.lease {
                config = config.with_lease(lease);
            }
            let config = config.with_fence_delay(timing.fence_delay);
            Box::new(AlockClient::with_postbox(addr, config, ctx.alock.clone()))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rdma::{MailboxId, NodeId, RegionId};

    fn info() -> LockHostInfo {
        LockHostInfo {
            shiftlock: RecoveryLocator {
                service: ClientAddr { node: NodeId(3), mailbox: MailboxId(7) },
                also: None,
                eras: EraTable { base: RemoteAddr::new(RegionId(2), 4096), count: 64 },
            },
            rpc_server: "127.0.0.1:7070".parse().unwrap(),
        }
    }

    #[test]
    fn host_info_round_trips_as_bytes_and_hex() {
        let i = info();
        assert_eq!(LockHostInfo::decode(&i.encode()).unwrap(), i);
        let hex = i.to_hex();
        assert!(hex.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
        assert_eq!(LockHostInfo::from_hex(&hex).unwrap(), i);
        assert_eq!(i.rtt_probe(), RemoteAddr::new(RegionId(2), 4096));
    }

    #[test]
    fn malformed_host_info_is_an_error() {
        let hex = info().to_hex();
        for bad in [&hex[..hex.len() - 2], "zz", "abc", "", "éé"] {
            assert!(matches!(LockHostInfo::from_hex(bad), Err(LockError::Host(_))), "{bad:?} accepted");
        }
        assert!(LockHostInfo::decode(&[1, 2, 3]).is_err());
    }

    #[test]
    fn area_holds_the_era_table_and_keeps_its_alignment() {
        for count in [1, 7, 8, 64, 1000] {
            let c = LockHostConfig { era_counters: count, ..LockHostConfig::default() };
            assert!(c.area_bytes() >= EraTable::bytes(count));
            assert!(c.area_bytes().is_multiple_of(LockHostConfig::AREA_ALIGN));
        }
        assert_eq!(LockHostConfig::default().area_bytes(), 512);
    }

    #[test]
    fn timing_keeps_the_rtt_and_overrides_only_the_lease() {
        let t = LockTiming::from_rtt(Duration::from_micros(3));
        assert_eq!(t.lease, None);
        let l = t.with_lease(Duration::from_millis(400));
        assert_eq!((l.rtt, l.lease), (Duration::from_micros(3), Some(Duration::from_millis(400))));
        assert_eq!(l.fence_delay, Duration::ZERO);
        let f = l.with_fence_delay(Duration::from_secs(3));
        assert_eq!((f.lease, f.fence_delay), (l.lease, Duration::from_secs(3)));
    }
}
