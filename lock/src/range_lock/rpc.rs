//! The centralised RPC range lock server: the paper's type-I baseline
//! (citron-fast23.md §2.2, §4.1 Table 1: "server-side CPUs are fully
//! responsible for acquiring and releasing locks", e.g. Lustre's interval
//! tree, IT). The lock host runs it over the project's framed RPC
//! ([`crate::rdma::tcp::rpc`]); clients never touch lock memory.
//!
//! # State, per lock instance
//!
//! * `held`: an [`IntervalTree`] of the granted ranges (disjoint, since every
//!   range is exclusive);
//! * `waiting`: an [`IntervalTree`] of the queued requests, which may overlap
//!   each other.
//!
//! Request ids grow with arrival, so they are also the queue order.
//!
//! # Grant rule (FIFO among conflicting requests, starvation-free)
//!
//! A request is granted iff its range overlaps no held range **and no
//! earlier waiting request**. A new request therefore queues behind every
//! earlier one it conflicts with, even if the unit it wants is free now, so
//! no later conflicting request ever overtakes it (zero bypass); requests
//! that conflict with nothing go at once. When a range leaves the server
//! (release, cancel, a dropped connection), only the waiters overlapping it
//! can become grantable; they are examined in arrival order.
//!
//! # Blocking without a thread per waiter
//!
//! `Acquire` either answers `Granted` at once, or queues the request and
//! waits for its grant on a condition variable for up to `wait_slice`; a
//! grant in that time is answered at once. If the slice passes, the answer
//! is `Queued(id)` and the client asks again with `Wait(id)` (keeping its
//! place). The slice bounds how long a connection's thread is away from its
//! socket, so a client that vanishes while queued is noticed within it.
//!
//! # Ownership and failures
//!
//! Each request belongs to the connection that sent its `Acquire`. When a
//! connection ends (the client died, or dropped it after an error), the
//! server drops every range held and every request queued through it, and
//! grants what that frees. `Release` and `Cancel` name the request id and may
//! come through any connection of the same client.
//!
//! Bad input — an empty range, an unknown or foreign id, releasing a request
//! that still waits, more requests than the server admits, a malformed
//! frame — gets `Refused(reason)` and changes nothing.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, MutexGuard};
use serde::{Deserialize, Serialize};

use super::interval_tree::{Interval, IntervalTree};
use crate::rdma::tcp::rpc::{RpcClient, RpcServer, RpcService};
use crate::rwlock::LockError;
use citron_rpc::auth::{Authority, Credentials};

/// Which lock instance (e.g. one per file) a request is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RangeInstanceId(pub u64);

/// A request, and once granted, its grant. Unique per server; increasing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RangeRequestId(pub u64);

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum RangeRpcRequest {
    /// Lock units `[start, end)` of `instance` (`end = u64::MAX`: to infinity).
    Acquire {
        instance: RangeInstanceId,
        start: u64,
        end: u64,
    },
    /// Keep waiting for a request that was answered `Queued`.
    Wait {
        instance: RangeInstanceId,
        request: RangeRequestId,
    },
    /// Withdraw a request; if it was granted meanwhile, release it.
    Cancel {
        instance: RangeInstanceId,
        request: RangeRequestId,
    },
    Release {
        instance: RangeInstanceId,
        request: RangeRequestId,
    },
    /// How many ranges are held and waiting (diagnostics, tests).
    Status {
        instance: RangeInstanceId,
    },
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum RangeRpcResponse {
    Granted(RangeRequestId),
    Queued(RangeRequestId),
    Released,
    Cancelled,
    Status { held: u64, waiting: u64 },
    Refused(String),
}

/// Tunables of the server.
#[derive(Clone, Copy, Debug)]
pub struct RangeServerConfig {
    /// Longest a request waits for its grant inside one call.
    pub wait_slice: Duration,
    /// Most requests (held + waiting) over all instances.
    pub max_requests: usize,
}

impl Default for RangeServerConfig {
    fn default() -> Self {
        Self { wait_slice: Duration::from_millis(200), max_requests: 1 << 20 }
    }
}

enum RequestState {
    Waiting { wake: Arc<Condvar> },
    Held,
}

struct Request {
    instance: RangeInstanceId,
    start: u64,
    end: u64,
    owner: SocketAddr,
    state: RequestState,
}

#[derive(Default)]
struct Instance {
    held: IntervalTree,
    waiting: IntervalTree,
}

#[derive(Default)]
struct State {
    instances: HashMap<RangeInstanceId, Instance>,
    requests: HashMap<u64, Request>,
    by_owner: HashMap<SocketAddr, HashSet<u64>>,
    next_id: u64,
}

/// What the server did, for diagnostics and tests.
#[derive(Debug, Default)]
pub struct RangeServerStats {
    pub granted_at_once: AtomicU64,
    pub granted_after_wait: AtomicU64,
    pub released: AtomicU64,
    pub cancelled: AtomicU64,
    /// Held or waiting requests dropped because their connection ended.
    pub dropped: AtomicU64,
    pub refused: AtomicU64,
}

/// The lock server's logic; run it with [`spawn_range_server`].
pub struct RangeLockService {
    state: Mutex<State>,
    config: RangeServerConfig,
    stats: RangeServerStats,
}

impl RangeLockService {
    pub fn new(config: RangeServerConfig) -> Self {
        Self { state: Mutex::new(State::default()), config, stats: RangeServerStats::default() }
    }

    pub fn stats(&self) -> &RangeServerStats {
        &self.stats
    }

    /// Ranges held and requests waiting, over all instances.
    pub fn totals(&self) -> (u64, u64) {
        let st = self.state.lock();
        let held = st.requests.values().filter(|r| matches!(r.state, RequestState::Held)).count();
        (held as u64, (st.requests.len() - held) as u64)
    }

    fn refuse(&self, why: String) -> RangeRpcResponse {
        self.stats.refused.fetch_add(1, Ordering::Relaxed);
        RangeRpcResponse::Refused(why)
    }

    fn acquire(&self, instance: RangeInstanceId, start: u64, end: u64, peer: SocketAddr) -> RangeRpcResponse {
        if start >= end {
            return self.refuse(format!("empty range [{start}, {end})"));
        }
        let mut st = self.state.lock();
        if st.requests.len() >= self.config.max_requests {
            return self.refuse(format!("the server admits at most {} requests", self.config.max_requests));
        }
        st.next_id += 1;
        let id = st.next_id;
        let inst = st.instances.entry(instance).or_default();
        let item = Interval { start, end, id };
        // Free, and no earlier request waits for any of it (every waiter is earlier).
        let state = if !inst.held.overlaps_any(start, end) && !inst.waiting.overlaps_any(start, end) {
            inst.held.insert(item);
            RequestState::Held
        } else {
            inst.waiting.insert(item);
            RequestState::Waiting { wake: Arc::new(Condvar::new()) }
        };
        let granted = matches!(state, RequestState::Held);
        st.requests.insert(id, Request { instance, start, end, owner: peer, state });
        st.by_owner.entry(peer).or_default().insert(id);
        if granted {
            self.stats.granted_at_once.fetch_add(1, Ordering::Relaxed);
            return RangeRpcResponse::Granted(RangeRequestId(id));
        }
        self.wait(st, instance, id)
    }

    /// Waits up to the slice for request `id` to be granted.
    fn wait(&self, mut st: MutexGuard<'_, State>, instance: RangeInstanceId, id: u64) -> RangeRpcResponse {
        let deadline = Instant::now() + self.config.wait_slice;
        loop {
            let wake = match st.requests.get(&id) {
                None => {
                    return self.refuse(format!(
                        "no request {id} on this server (unknown, or dropped when its connection closed)"
                    ));
                }
                Some(r) if r.instance != instance => {
                    return self.refuse(format!("request {id} is not on instance {}", instance.0));
                }
                Some(Request { state: RequestState::Held, .. }) => {
                    return RangeRpcResponse::Granted(RangeRequestId(id));
                }
                Some(Request { state: RequestState::Waiting { wake }, .. }) => wake.clone(),
            };
            if Instant::now() >= deadline {
                return RangeRpcResponse::Queued(RangeRequestId(id));
            }
            wake.wait_until(&mut st, deadline);
        }
    }

    /// Takes request `id` out of the server; returns it.
    fn remove(st: &mut State, id: u64) -> Option<Request> {
        let req = st.requests.remove(&id)?;
        if let Some(ids) = st.by_owner.get_mut(&req.owner) {
            ids.remove(&id);
            if ids.is_empty() {
                st.by_owner.remove(&req.owner);
            }
        }
        if let Some(inst) = st.instances.get_mut(&req.instance) {
            match &req.state {
                RequestState::Held => inst.held.remove(req.start, id),
                RequestState::Waiting { wake } => {
                    // Anyone still waiting on it learns it is gone.
                    wake.notify_all();
                    inst.waiting.remove(req.start, id)
                }
            };
        }
        Some(req)
    }

    /// `[l, r)` of `instance` was freed: grant the waiters it may unblock,
    /// in arrival order.
    fn grant_freed(&self, st: &mut State, instance: RangeInstanceId, l: u64, r: u64) {
        let Some(inst) = st.instances.get_mut(&instance) else { return };
        let mut candidates = inst.waiting.overlapping(l, r);
        candidates.sort_by_key(|c| c.id);
        let mut granted = Vec::new();
        for c in candidates {
            if inst.held.overlaps_any(c.start, c.end) {
                continue;
            }
            let mut earlier = false;
            inst.waiting.visit_overlapping(c.start, c.end, |w| {
                earlier = w.id < c.id;
                !earlier
            });
            if earlier {
                continue;
            }
            inst.waiting.remove(c.start, c.id);
            inst.held.insert(c);
            granted.push(c.id);
        }
        if inst.held.is_empty() && inst.waiting.is_empty() {
            st.instances.remove(&instance);
        }
        for id in granted {
            if let Some(req) = st.requests.get_mut(&id) {
                if let RequestState::Waiting { wake } = std::mem::replace(&mut req.state, RequestState::Held)
                {
                    wake.notify_all();
                }
                self.stats.granted_after_wait.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    fn release(&self, instance: RangeInstanceId, id: u64, cancel: bool) -> RangeRpcResponse {
        let mut st = self.state.lock();
        let (held, req_instance) = match st.requests.get(&id) {
            None => {
                return self.refuse(format!(
                    "no request {id} on this server (released already, or dropped when its connection closed)"
                ))
            }
            Some(r) => (matches!(r.state, RequestState::Held), r.instance),
        };
        if req_instance != instance {
            return self.refuse(format!("request {id} is not on instance {}", instance.0));
        }
        if !held && !cancel {
            return self.refuse(format!("request {id} still waits: cancel it instead of releasing"));
        }
        let req = Self::remove(&mut st, id).expect("present");
        self.grant_freed(&mut st, instance, req.start, req.end);
        if held {
            self.stats.released.fetch_add(1, Ordering::Relaxed);
            RangeRpcResponse::Released
        } else {
            self.stats.cancelled.fetch_add(1, Ordering::Relaxed);
            RangeRpcResponse::Cancelled
        }
    }

    fn status(&self, instance: RangeInstanceId) -> RangeRpcResponse {
        let st = self.state.lock();
        match st.instances.get(&instance) {
            None => RangeRpcResponse::Status { held: 0, waiting: 0 },
            Some(i) => {
                RangeRpcResponse::Status { held: i.held.len() as u64, waiting: i.waiting.len() as u64 }
            }
        }
    }
}

impl RpcService for RangeLockService {
    type Request = RangeRpcRequest;
    type Response = RangeRpcResponse;

    fn handle(&self, request: RangeRpcRequest, peer: SocketAddr) -> RangeRpcResponse {
        match request {
            RangeRpcRequest::Acquire { instance, start, end } => self.acquire(instance, start, end, peer),
            RangeRpcRequest::Wait { instance, request } => self.wait(self.state.lock(), instance, request.0),
            RangeRpcRequest::Cancel { instance, request } => self.release(instance, request.0, true),
            RangeRpcRequest::Release { instance, request } => self.release(instance, request.0, false),
            RangeRpcRequest::Status { instance } => self.status(instance),
        }
    }

    fn malformed(&self, error: String) -> RangeRpcResponse {
        self.refuse(format!("malformed request: {error}"))
    }

    fn disconnected(&self, peer: SocketAddr) {
        let mut st = self.state.lock();
        let Some(ids) = st.by_owner.remove(&peer) else { return };
        let mut ids: Vec<u64> = ids.into_iter().collect();
        ids.sort_unstable();
        let mut freed = Vec::new();
        for id in ids {
            if let Some(req) = Self::remove(&mut st, id) {
                self.stats.dropped.fetch_add(1, Ordering::Relaxed);
                freed.push((req.instance, req.start, req.end));
            }
        }
        for (instance, l, r) in freed {
            self.grant_freed(&mut st, instance, l, r);
        }
        log::debug!("range lock server: connection {peer} ended, its requests dropped");
    }
}

/// A running range lock server.
pub type RangeLockServer = RpcServer<Arc<RangeLockService>>;

/// Starts a range lock server on `listen` (e.g. `127.0.0.1:0`).
pub fn spawn_range_server(listen: SocketAddr, config: RangeServerConfig) -> std::io::Result<RangeLockServer> {
    spawn_range_server_with(listen, config, Authority::Open)
}

/// [`spawn_range_server`] that lets in only whom `authority` does.
pub fn spawn_range_server_with(
    listen: SocketAddr,
    config: RangeServerConfig,
    authority: Authority,
) -> std::io::Result<RangeLockServer> {
    RpcServer::spawn_with(listen, Arc::new(RangeLockService::new(config)), "range-lock", authority)
}

/// A process's connections to one range lock server, shared by its threads
/// (each call takes an idle connection or opens one).
pub type RangeRpc = RpcClient<RangeRpcRequest, RangeRpcResponse>;

/// Timing of a client.
#[derive(Clone, Copy, Debug)]
pub struct RpcRangeConfig {
    /// Bound of one call (connect, send, answer); above the server's slice.
    pub call_timeout: Duration,
    /// Longest an acquisition waits in total before it gives up.
    pub give_up: Duration,
}

impl Default for RpcRangeConfig {
    fn default() -> Self {
        Self { call_timeout: Duration::from_secs(5), give_up: Duration::from_secs(120) }
    }
}

/// Counters of one client.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RpcRangeStats {
    pub acquisitions: u64,
    /// Calls made, i.e. round trips to the server.
    pub calls: u64,
    /// Acquisitions whose wait outlasted one call (answered `Queued`).
    pub queued: u64,
}

/// A range granted by the server; give it back with [`RpcRangeClient::release`].
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a held range must be released"]
pub struct RpcGrant {
    pub request: RangeRequestId,
}

/// One client's handle to one lock instance on a range lock server.
pub struct RpcRangeClient {
    rpc: Arc<RangeRpc>,
    instance: RangeInstanceId,
    config: RpcRangeConfig,
    stats: RpcRangeStats,
}

impl RpcRangeClient {
    pub fn new(rpc: Arc<RangeRpc>, instance: RangeInstanceId, config: RpcRangeConfig) -> Self {
        Self { rpc, instance, config, stats: RpcRangeStats::default() }
    }

    /// Connections to `server` with `config`'s call timeout.
    pub fn connect(server: SocketAddr, config: RpcRangeConfig) -> Arc<RangeRpc> {
        Self::connect_as(server, config, Credentials::anonymous())
    }

    /// [`RpcRangeClient::connect`] proving `credentials`.
    pub fn connect_as(server: SocketAddr, config: RpcRangeConfig, credentials: Credentials) -> Arc<RangeRpc> {
        Arc::new(RpcClient::new(server, config.call_timeout).with_credentials(credentials))
    }

    pub fn stats(&self) -> RpcRangeStats {
        self.stats
    }

    fn call(&mut self, request: &RangeRpcRequest) -> Result<RangeRpcResponse, LockError> {
        self.stats.calls += 1;
        Ok(self.rpc.call(request)?)
    }

    /// Locks `[start, end)`; blocks (bounded by `give_up`) until granted.
    pub fn acquire(&mut self, start: u64, end: u64) -> Result<RpcGrant, LockError> {
        if start >= end {
            return Err(LockError::Misuse("empty range"));
        }
        let instance = self.instance;
        let began = Instant::now();
        let mut answer = self.call(&RangeRpcRequest::Acquire { instance, start, end })?;
        let mut queued = false;
        loop {
            match answer {
                RangeRpcResponse::Granted(request) => {
                    self.stats.acquisitions += 1;
                    self.stats.queued += u64::from(queued);
                    return Ok(RpcGrant { request });
                }
                RangeRpcResponse::Queued(request) => {
                    queued = true;
                    if began.elapsed() > self.config.give_up {
                        // Withdraw; a grant that raced with us is released.
                        let _ = self.call(&RangeRpcRequest::Cancel { instance, request });
                        return Err(LockError::Timeout(self.config.give_up));
                    }
                    answer = match self.call(&RangeRpcRequest::Wait { instance, request }) {
                        Ok(a) => a,
                        Err(e) => {
                            let _ = self.call(&RangeRpcRequest::Cancel { instance, request });
                            return Err(e);
                        }
                    };
                }
                RangeRpcResponse::Refused(why) => return Err(LockError::Host(why)),
                other => return Err(LockError::Host(format!("unexpected answer {other:?}"))),
            }
        }
    }

    pub fn release(&mut self, grant: RpcGrant) -> Result<(), LockError> {
        let request = RangeRpcRequest::Release { instance: self.instance, request: grant.request };
        match self.call(&request)? {
            RangeRpcResponse::Released => Ok(()),
            RangeRpcResponse::Refused(why) => Err(LockError::Host(why)),
            other => Err(LockError::Host(format!("unexpected answer {other:?}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(port: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], port))
    }

    fn service() -> RangeLockService {
        RangeLockService::new(RangeServerConfig { wait_slice: Duration::from_millis(1), max_requests: 8 })
    }

    const I: RangeInstanceId = RangeInstanceId(7);

    fn acquire(s: &RangeLockService, start: u64, end: u64, p: u16) -> RangeRpcResponse {
        s.handle(RangeRpcRequest::Acquire { instance: I, start, end }, peer(p))
    }

    fn id(r: &RangeRpcResponse) -> RangeRequestId {
        match r {
            RangeRpcResponse::Granted(i) | RangeRpcResponse::Queued(i) => *i,
            other => panic!("no id in {other:?}"),
        }
    }

    fn release(s: &RangeLockService, r: RangeRequestId) -> RangeRpcResponse {
        s.handle(RangeRpcRequest::Release { instance: I, request: r }, peer(1))
    }

    fn wait(s: &RangeLockService, r: RangeRequestId) -> RangeRpcResponse {
        s.handle(RangeRpcRequest::Wait { instance: I, request: r }, peer(1))
    }

    #[test]
    fn disjoint_ranges_are_granted_at_once_and_overlapping_ones_queue() {
        let s = service();
        let a = acquire(&s, 0, 10, 1);
        assert!(matches!(a, RangeRpcResponse::Granted(_)));
        assert!(matches!(acquire(&s, 10, 20, 1), RangeRpcResponse::Granted(_)), "adjacent is disjoint");
        let b = acquire(&s, 5, 6, 2);
        assert!(matches!(b, RangeRpcResponse::Queued(_)));
        assert_eq!(release(&s, id(&a)), RangeRpcResponse::Released);
        assert_eq!(wait(&s, id(&b)), RangeRpcResponse::Granted(id(&b)));
    }

    /// No bypass: a later request that conflicts only with an earlier
    /// waiter queues behind it, and grants follow arrival order.
    #[test]
    fn later_requests_never_overtake_earlier_conflicting_waiters() {
        let s = service();
        let a = id(&acquire(&s, 0, 10, 1));
        let b = acquire(&s, 5, 20, 2);
        assert!(matches!(b, RangeRpcResponse::Queued(_)));
        // [15, 20) is free, but B (earlier) wants it.
        let c = acquire(&s, 15, 20, 3);
        assert!(matches!(c, RangeRpcResponse::Queued(_)), "{c:?}");
        // [30, ∞) conflicts with nobody.
        assert!(matches!(acquire(&s, 30, u64::MAX, 3), RangeRpcResponse::Granted(_)));
        release(&s, a);
        assert_eq!(wait(&s, id(&b)), RangeRpcResponse::Granted(id(&b)));
        assert!(matches!(wait(&s, id(&c)), RangeRpcResponse::Queued(_)), "C waits for B");
        release(&s, id(&b));
        assert_eq!(wait(&s, id(&c)), RangeRpcResponse::Granted(id(&c)));
    }

    #[test]
    fn a_closed_connection_drops_its_ranges_and_wakes_the_next() {
        let s = service();
        let a = id(&acquire(&s, 0, u64::MAX, 1));
        let queued_by_1 = id(&acquire(&s, 50, 60, 1));
        let b = id(&acquire(&s, 100, 200, 2));
        s.disconnected(peer(1));
        assert_eq!(s.stats().dropped.load(Ordering::Relaxed), 2);
        assert_eq!(wait(&s, b), RangeRpcResponse::Granted(b));
        assert!(matches!(release(&s, a), RangeRpcResponse::Refused(_)), "dropped with its connection");
        assert!(matches!(wait(&s, queued_by_1), RangeRpcResponse::Refused(_)));
        assert_eq!(s.totals(), (1, 0));
    }

    #[test]
    fn bad_input_is_refused_and_changes_nothing() {
        let s = service();
        assert!(matches!(acquire(&s, 5, 5, 1), RangeRpcResponse::Refused(_)));
        assert!(matches!(acquire(&s, 6, 5, 1), RangeRpcResponse::Refused(_)));
        assert!(matches!(release(&s, RangeRequestId(99)), RangeRpcResponse::Refused(_)));
        let a = id(&acquire(&s, 0, 10, 1));
        let b = id(&acquire(&s, 0, 10, 2));
        assert!(matches!(release(&s, b), RangeRpcResponse::Refused(_)), "still waiting");
        let other = RangeInstanceId(8);
        let r = s.handle(RangeRpcRequest::Release { instance: other, request: a }, peer(1));
        assert!(matches!(r, RangeRpcResponse::Refused(_)), "wrong instance");
        for p in 0..6 {
            acquire(&s, 100 + p, 101 + p, 3);
        }
        assert!(matches!(acquire(&s, 1000, 1001, 3), RangeRpcResponse::Refused(_)), "admission limit");
        assert!(matches!(s.malformed("x".into()), RangeRpcResponse::Refused(_)));
        assert_eq!(s.totals(), (7, 1));
        assert_eq!(release(&s, a), RangeRpcResponse::Released);
        assert_eq!(wait(&s, b), RangeRpcResponse::Granted(b));
    }

    #[test]
    fn cancel_withdraws_a_waiter_or_releases_a_late_grant() {
        let s = service();
        let a = id(&acquire(&s, 0, 10, 1));
        let b = id(&acquire(&s, 0, 10, 2));
        let c = id(&acquire(&s, 8, 12, 3));
        let cancel = |r| s.handle(RangeRpcRequest::Cancel { instance: I, request: r }, peer(2));
        assert_eq!(cancel(b), RangeRpcResponse::Cancelled);
        release(&s, a);
        assert_eq!(wait(&s, c), RangeRpcResponse::Granted(c), "B's withdrawal let C through");
        assert_eq!(cancel(c), RangeRpcResponse::Released);
        assert_eq!(s.totals(), (0, 0));
        assert!(s.state.lock().instances.is_empty(), "idle instances are forgotten");
    }
}
