//! The lock server: FIFO reader-writer queues per lock, sessions with
//! leases, deferred grants (see [`super`] for the semantics).
//!
//! All state sits behind one mutex (the baseline's single serialisation
//! point, like the paper's Basecase server); answers are written after it
//! is released, so a slow client never holds up the table.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::{HolderId, RpcLockId, RpcLockRefusal, RpcLockRequest, RpcLockResponse};
use crate::rdma::tcp::{Call, Connection, ConnectionId, MuxServer, MuxService};
use crate::rwlock::Mode;

/// Timing of the server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RpcLockServerConfig {
    /// A session whose last request is older than this is dropped.
    pub lease: Duration,
}

impl RpcLockServerConfig {
    /// The floor of [`RpcLockServerConfig::from_rtt`]'s lease.
    pub const MIN_LEASE: Duration = Duration::from_secs(1);

    /// A lease of 5000 RTTs, at least 1 s (the other locks' ratio and floor).
    pub fn from_rtt(rtt: Duration) -> Self {
        Self { lease: (rtt * 5000).max(Self::MIN_LEASE) }
    }

    pub fn with_lease(self, lease: Duration) -> Self {
        Self { lease }
    }
}

/// What the server has done so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RpcLockServerStats {
    /// Sessions open now.
    pub sessions: u64,
    /// Locks the table knows (every id ever used).
    pub locks: u64,
    /// Requests waiting now.
    pub waiting: u64,
    pub grants: u64,
    /// Grants that a release (or a dropped session) made to a queued request.
    pub deferred_grants: u64,
    pub refusals: u64,
    /// Sessions dropped because their lease lapsed.
    pub expired: u64,
    /// Sessions dropped because their connection ended.
    pub disconnected: u64,
}

type Owner = (ConnectionId, HolderId);

struct Holder {
    owner: Owner,
    mode: Mode,
}

struct Waiter {
    owner: Owner,
    mode: Mode,
    arrival: u64,
    call: Call<RpcLockResponse>,
}

#[derive(Default)]
struct LockQueue {
    next_arrival: u64,
    holders: Vec<Holder>,
    waiting: VecDeque<Waiter>,
}

impl LockQueue {
    fn compatible(&self, mode: Mode) -> bool {
        match mode {
            Mode::Exclusive => self.holders.is_empty(),
            Mode::Shared => self.holders.iter().all(|h| h.mode == Mode::Shared),
        }
    }

    fn knows(&self, owner: Owner) -> bool {
        self.holders.iter().any(|h| h.owner == owner) || self.waiting.iter().any(|w| w.owner == owner)
    }

    /// Grants the head of the queue while it is compatible: a writer alone,
    /// or the readers up to the next writer.
    fn grant_waiting(&mut self, lock: RpcLockId, out: &mut Vec<(Call<RpcLockResponse>, RpcLockResponse)>) {
        while self.waiting.front().is_some_and(|w| self.compatible(w.mode)) {
            let w = self.waiting.pop_front().expect("checked above");
            self.holders.push(Holder { owner: w.owner, mode: w.mode });
            out.push((w.call, RpcLockResponse::Granted { lock, arrival: w.arrival, queued: true }));
        }
    }
}

struct Session {
    conn: Arc<Connection>,
    deadline: Instant,
    /// Holds and queued requests per lock, so a drop finds them.
    locks: HashMap<RpcLockId, u32>,
}

#[derive(Default)]
struct Tables {
    locks: HashMap<RpcLockId, LockQueue>,
    sessions: HashMap<ConnectionId, Session>,
}

#[derive(Default)]
struct Counters {
    grants: AtomicU64,
    deferred_grants: AtomicU64,
    refusals: AtomicU64,
    expired: AtomicU64,
    disconnected: AtomicU64,
}

/// The service behind the RPC server.
struct LockService {
    config: RpcLockServerConfig,
    tables: Mutex<Tables>,
    /// Wakes the reaper when a session opens or the server stops.
    reaper_wake: Condvar,
    stopping: AtomicBool,
    counters: Counters,
}

type Answers = Vec<(Call<RpcLockResponse>, RpcLockResponse)>;

fn deliver(answers: Answers) {
    for (call, response) in answers {
        // A caller that is gone has had its holds dropped with its session.
        call.answer(response);
    }
}

impl LockService {
    fn count(&self, counter: &AtomicU64, n: u64) {
        // Relaxed: statistics only.
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// One request, under the table's lock; returns the answers to send.
    fn apply(&self, t: &mut Tables, request: RpcLockRequest, call: Call<RpcLockResponse>, out: &mut Answers) {
        let conn = call.connection().clone();
        let now = Instant::now();
        let new_session = !t.sessions.contains_key(&conn.id());
        let session = t.sessions.entry(conn.id()).or_insert_with(|| Session {
            conn: conn.clone(),
            deadline: now,
            locks: HashMap::new(),
        });
        // Every request renews the lease.
        session.deadline = now + self.config.lease;
        if new_session {
            self.reaper_wake.notify_one();
        }
        let refuse = |r: RpcLockRefusal| RpcLockResponse::Refused(r);
        let response = match request {
            RpcLockRequest::Hello => RpcLockResponse::Welcome { lease: self.config.lease },
            RpcLockRequest::Renew => RpcLockResponse::Renewed,
            RpcLockRequest::Acquire { lock, holder, mode } => {
                let owner = (conn.id(), holder);
                let q = t.locks.entry(lock).or_default();
                if q.knows(owner) {
                    refuse(RpcLockRefusal::AlreadyRequested { lock, holder })
                } else {
                    *session.locks.entry(lock).or_default() += 1;
                    let arrival = q.next_arrival;
                    q.next_arrival += 1;
                    if q.waiting.is_empty() && q.compatible(mode) {
                        q.holders.push(Holder { owner, mode });
                        RpcLockResponse::Granted { lock, arrival, queued: false }
                    } else {
                        // Answered by whoever grants it.
                        q.waiting.push_back(Waiter { owner, mode, arrival, call });
                        return;
                    }
                }
            }
            RpcLockRequest::Release { lock, holder } => {
                let owner = (conn.id(), holder);
                match t.locks.get_mut(&lock).and_then(|q| {
                    let i = q.holders.iter().position(|h| h.owner == owner)?;
                    q.holders.swap_remove(i);
                    Some(q)
                }) {
                    None => refuse(RpcLockRefusal::NotHeld { lock, holder }),
                    Some(q) => {
                        let before = out.len();
                        q.grant_waiting(lock, out);
                        self.count(&self.counters.deferred_grants, (out.len() - before) as u64);
                        forget(session, lock);
                        RpcLockResponse::Released { lock }
                    }
                }
            }
            RpcLockRequest::Cancel { lock, holder } => {
                let owner = (conn.id(), holder);
                let q = t.locks.entry(lock).or_default();
                if let Some(i) = q.waiting.iter().position(|w| w.owner == owner) {
                    // Its call stays unanswered: the client has let go of it.
                    q.waiting.remove(i);
                    forget(session, lock);
                    // A reader behind a cancelled writer may go now.
                    let before = out.len();
                    q.grant_waiting(lock, out);
                    self.count(&self.counters.deferred_grants, (out.len() - before) as u64);
                    RpcLockResponse::Cancelled { lock, was_granted: false }
                } else {
                    let held = q.holders.iter().any(|h| h.owner == owner);
                    RpcLockResponse::Cancelled { lock, was_granted: held }
                }
            }
        };
        out.push((call, response));
    }

    /// Drops a session's holds and queued requests; returns the grants
    /// that unblocks (and refusals for its own queued requests).
    fn drop_session(&self, t: &mut Tables, id: ConnectionId, out: &mut Answers) -> Option<Arc<Connection>> {
        let session = t.sessions.remove(&id)?;
        for lock in session.locks.keys() {
            let Some(q) = t.locks.get_mut(lock) else { continue };
            q.holders.retain(|h| h.owner.0 != id);
            let mut kept = VecDeque::with_capacity(q.waiting.len());
            for w in q.waiting.drain(..) {
                if w.owner.0 == id {
                    out.push((w.call, RpcLockResponse::Refused(RpcLockRefusal::SessionDropped)));
                } else {
                    kept.push_back(w);
                }
            }
            q.waiting = kept;
            let before = out.len();
            q.grant_waiting(*lock, out);
            self.count(&self.counters.deferred_grants, (out.len() - before) as u64);
        }
        Some(session.conn)
    }

    /// The reaper: sleeps until the earliest lease deadline, drops the
    /// sessions whose lease lapsed and cuts their connections.
    fn reap(&self) {
        let mut t = self.tables.lock();
        loop {
            if self.stopping.load(Ordering::SeqCst) {
                return;
            }
            let now = Instant::now();
            let expired: Vec<ConnectionId> =
                t.sessions.iter().filter(|(_, s)| s.deadline <= now).map(|(id, _)| *id).collect();
            if expired.is_empty() {
                let next = t.sessions.values().map(|s| s.deadline).min().unwrap_or(now + self.config.lease);
                self.reaper_wake.wait_until(&mut t, next);
                continue;
            }
            let mut out = Vec::new();
            let mut cut = Vec::new();
            for id in expired {
                if let Some(conn) = self.drop_session(&mut t, id, &mut out) {
                    log::warn!("RPC lock server: lease of {} lapsed; its locks are dropped", conn.peer());
                    cut.push(conn);
                }
            }
            self.count(&self.counters.expired, cut.len() as u64);
            self.count(&self.counters.grants, grants_in(&out));
            drop(t);
            deliver(out);
            for conn in cut {
                conn.close();
            }
            t = self.tables.lock();
        }
    }
}

fn forget(session: &mut Session, lock: RpcLockId) {
    if let Some(n) = session.locks.get_mut(&lock) {
        *n -= 1;
        if *n == 0 {
            session.locks.remove(&lock);
        }
    }
}

fn grants_in(out: &Answers) -> u64 {
    out.iter().filter(|(_, r)| matches!(r, RpcLockResponse::Granted { .. })).count() as u64
}

impl MuxService for LockService {
    type Request = RpcLockRequest;
    type Response = RpcLockResponse;

    fn handle(&self, request: RpcLockRequest, call: Call<RpcLockResponse>) {
        if call.connection().is_closed() {
            // The session was dropped (lease lapse) and its connection is
            // being cut: do not open a new session on it.
            call.answer(RpcLockResponse::Refused(RpcLockRefusal::SessionDropped));
            return;
        }
        let mut out = Vec::with_capacity(2);
        self.apply(&mut self.tables.lock(), request, call, &mut out);
        self.count(&self.counters.grants, grants_in(&out));
        self.count(
            &self.counters.refusals,
            out.iter().filter(|(_, r)| matches!(r, RpcLockResponse::Refused(_))).count() as u64,
        );
        deliver(out);
    }

    fn malformed(&self, error: String) -> RpcLockResponse {
        self.count(&self.counters.refusals, 1);
        RpcLockResponse::Refused(RpcLockRefusal::Malformed(error))
    }

    fn disconnected(&self, conn: &Arc<Connection>) {
        let mut out = Vec::new();
        let dropped = self.drop_session(&mut self.tables.lock(), conn.id(), &mut out).is_some();
        if dropped {
            self.count(&self.counters.disconnected, 1);
            log::info!("RPC lock server: {} disconnected; its locks are dropped", conn.peer());
        }
        self.count(&self.counters.grants, grants_in(&out));
        deliver(out);
    }
}

/// The running lock server. Dropping it stops it and cuts every client.
pub struct RpcLockServer {
    service: Arc<LockService>,
    server: MuxServer<Arc<LockService>>,
    reaper: Option<JoinHandle<()>>,
}

impl RpcLockServer {
    /// Serves on `listen` (port 0 picks one; see [`RpcLockServer::local_addr`]).
    pub fn spawn(listen: SocketAddr, config: RpcLockServerConfig) -> std::io::Result<Self> {
        Self::spawn_with(listen, config, citron_rpc::auth::Authority::Open)
    }

    /// [`RpcLockServer::spawn`] letting in only whom `authority` does.
    pub fn spawn_with(
        listen: SocketAddr,
        config: RpcLockServerConfig,
        authority: citron_rpc::auth::Authority,
    ) -> std::io::Result<Self> {
        let service = Arc::new(LockService {
            config,
            tables: Mutex::new(Tables::default()),
            reaper_wake: Condvar::new(),
            stopping: AtomicBool::new(false),
            counters: Counters::default(),
        });
        let server = MuxServer::spawn_with(listen, service.clone(), "rpc-lock", authority)?;
        let reaper = {
            let service = service.clone();
            std::thread::Builder::new().name("rpc-lock-reaper".into()).spawn(move || service.reap())?
        };
        log::info!("RPC lock server on {} (lease {:?})", server.local_addr(), config.lease);
        Ok(Self { service, server, reaper: Some(reaper) })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.server.local_addr()
    }

    pub fn config(&self) -> RpcLockServerConfig {
        self.service.config
    }

    pub fn stats(&self) -> RpcLockServerStats {
        let t = self.service.tables.lock();
        let c = &self.service.counters;
        RpcLockServerStats {
            sessions: t.sessions.len() as u64,
            locks: t.locks.len() as u64,
            waiting: t.locks.values().map(|q| q.waiting.len() as u64).sum(),
            grants: c.grants.load(Ordering::Relaxed),
            deferred_grants: c.deferred_grants.load(Ordering::Relaxed),
            refusals: c.refusals.load(Ordering::Relaxed),
            expired: c.expired.load(Ordering::Relaxed),
            disconnected: c.disconnected.load(Ordering::Relaxed),
        }
    }

    /// Stops accepting, cuts every connection (their sessions are dropped)
    /// and stops the reaper.
    pub fn shutdown(&mut self) {
        self.server.shutdown();
        self.service.stopping.store(true, Ordering::SeqCst);
        {
            let _t = self.service.tables.lock();
            self.service.reaper_wake.notify_all();
        }
        if let Some(r) = self.reaper.take() {
            let _ = r.join();
        }
    }
}

impl Drop for RpcLockServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rdma::tcp::RpcClient;
    use crate::rpc_lock::{RpcLockClient, RpcLockConfig, RpcLockSession};
    use crate::rwlock::LockError;

    fn server(lease: Duration) -> RpcLockServer {
        RpcLockServer::spawn("127.0.0.1:0".parse().unwrap(), RpcLockServerConfig { lease }).unwrap()
    }

    fn config() -> RpcLockConfig {
        RpcLockConfig { call_timeout: Duration::from_secs(10), give_up: Duration::from_secs(30) }
    }

    /// Waits (bounded) until `cond` holds of the server's statistics.
    fn until(server: &RpcLockServer, cond: impl Fn(&RpcLockServerStats) -> bool) {
        let t = Instant::now();
        while !cond(&server.stats()) {
            assert!(t.elapsed() < Duration::from_secs(20), "stuck at {:?}", server.stats());
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    #[test]
    fn readers_share_writers_wait_and_the_queue_is_fifo() {
        let server = server(Duration::from_secs(5));
        let session = RpcLockSession::connect(server.local_addr(), config()).unwrap();
        let lock = RpcLockId(5);
        let (mut r1, mut r2) =
            (RpcLockClient::with_session(&session, lock), RpcLockClient::with_session(&session, lock));
        r1.lock(Mode::Shared).unwrap();
        r2.lock(Mode::Shared).unwrap();
        assert_eq!((r1.arrival(), r2.arrival()), (Some(0), Some(1)));
        std::thread::scope(|s| {
            let w = s.spawn(|| {
                let mut w = RpcLockClient::with_session(&session, lock);
                w.lock(Mode::Exclusive).unwrap();
                let arrival = w.arrival();
                w.unlock().unwrap();
                (arrival, w.stats())
            });
            until(&server, |st| st.waiting == 1);
            // A reader behind a waiting writer waits too (FIFO, no overtaking).
            let r3 = s.spawn(|| {
                let mut r3 = RpcLockClient::with_session(&session, lock);
                r3.lock(Mode::Shared).unwrap();
                let arrival = r3.arrival();
                r3.unlock().unwrap();
                arrival
            });
            until(&server, |st| st.waiting == 2);
            r1.unlock().unwrap();
            assert_eq!(server.stats().waiting, 2, "the writer waits for the last reader");
            r2.unlock().unwrap();
            let (arrival, stats) = w.join().unwrap();
            assert_eq!(arrival, Some(2));
            assert_eq!((stats.acquisitions, stats.queued), (1, 1));
            assert_eq!(r3.join().unwrap(), Some(3));
        });
        let st = server.stats();
        assert_eq!((st.grants, st.deferred_grants, st.waiting, st.refusals), (4, 2, 0, 0), "{st:?}");
        // Different locks do not interfere.
        let mut other = RpcLockClient::with_session(&session, RpcLockId(6));
        r1.lock(Mode::Exclusive).unwrap();
        other.lock(Mode::Exclusive).unwrap();
        assert_eq!(other.arrival(), Some(0));
        other.unlock().unwrap();
        r1.unlock().unwrap();
    }

    #[test]
    fn bad_requests_are_refused_and_change_nothing() {
        let server = server(Duration::from_secs(5));
        let raw: RpcClient<RpcLockRequest, RpcLockResponse> =
            RpcClient::new(server.local_addr(), Duration::from_secs(5));
        let (lock, holder) = (RpcLockId(1), HolderId(1));
        let release = RpcLockRequest::Release { lock, holder };
        assert_eq!(
            raw.call(&release).unwrap(),
            RpcLockResponse::Refused(RpcLockRefusal::NotHeld { lock, holder })
        );
        let acquire = RpcLockRequest::Acquire { lock, holder, mode: Mode::Exclusive };
        assert!(matches!(
            raw.call(&acquire).unwrap(),
            RpcLockResponse::Granted { arrival: 0, queued: false, .. }
        ));
        assert_eq!(
            raw.call(&acquire).unwrap(),
            RpcLockResponse::Refused(RpcLockRefusal::AlreadyRequested { lock, holder })
        );
        // A body that is no request.
        let junk: RpcClient<(u8, u8, u8), RpcLockResponse> =
            RpcClient::new(server.local_addr(), Duration::from_secs(5));
        assert!(matches!(
            junk.call(&(250, 1, 2)).unwrap(),
            RpcLockResponse::Refused(RpcLockRefusal::Malformed(_))
        ));
        // The hold is intact, and the connection still works.
        assert_eq!(raw.call(&release).unwrap(), RpcLockResponse::Released { lock });
        assert_eq!(
            raw.call(&RpcLockRequest::Cancel { lock, holder }).unwrap(),
            RpcLockResponse::Cancelled { lock, was_granted: false }
        );
        assert_eq!(server.stats().refusals, 3);
        // Misuse on the client side is refused before it reaches the server.
        let session = RpcLockSession::connect(server.local_addr(), config()).unwrap();
        let mut c = RpcLockClient::with_session(&session, lock);
        assert!(matches!(c.unlock(), Err(LockError::Misuse(_))));
        c.lock(Mode::Shared).unwrap();
        assert!(matches!(c.lock(Mode::Shared), Err(LockError::Misuse(_))));
        c.unlock().unwrap();
    }

    #[test]
    fn a_dropped_or_silent_session_loses_its_locks() {
        let lease = Duration::from_millis(300);
        let server = server(lease);
        let lock = RpcLockId(3);
        // Disconnection: a session dropped while holding and while queued.
        let holder_session = RpcLockSession::connect(server.local_addr(), config()).unwrap();
        let mut holder = RpcLockClient::with_session(&holder_session, lock);
        holder.lock(Mode::Exclusive).unwrap();
        let queued_session = RpcLockSession::connect(server.local_addr(), config()).unwrap();
        std::thread::scope(|s| {
            let q = s.spawn(|| {
                let mut q = RpcLockClient::with_session(&queued_session, lock);
                q.lock(Mode::Exclusive)
            });
            until(&server, |st| st.waiting == 1);
            let survivor_session = RpcLockSession::connect(server.local_addr(), config()).unwrap();
            let survivor = s.spawn(move || {
                let mut c = RpcLockClient::with_session(&survivor_session, lock);
                c.lock(Mode::Exclusive).unwrap();
                let arrival = c.arrival();
                c.unlock().unwrap();
                arrival
            });
            until(&server, |st| st.waiting == 2);
            // Cut the queued session's connection under its waiting call.
            queued_session.disconnect();
            assert!(q.join().unwrap().is_err(), "a waiter whose connection broke gets an error");
            drop(holder_session);
            // The holder's handle keeps the session alive: close it too.
            holder.session().disconnect();
            assert_eq!(survivor.join().unwrap(), Some(2), "granted once both were dropped");
        });
        assert!(matches!(holder.unlock(), Err(LockError::Fenced)));
        until(&server, |st| st.disconnected >= 2);
        // A lease lapse: a raw client that holds and never renews.
        let raw: RpcClient<RpcLockRequest, RpcLockResponse> =
            RpcClient::new(server.local_addr(), Duration::from_secs(5));
        let holder_id = HolderId(1);
        let acquire = RpcLockRequest::Acquire { lock, holder: holder_id, mode: Mode::Shared };
        // Before the request: its lease ends no earlier than t + lease.
        let t = Instant::now();
        assert!(matches!(raw.call(&acquire).unwrap(), RpcLockResponse::Granted { .. }));
        let session = RpcLockSession::connect(server.local_addr(), config()).unwrap();
        let mut c = RpcLockClient::with_session(&session, lock);
        c.lock(Mode::Exclusive).unwrap();
        let waited = t.elapsed();
        assert!(waited >= lease && waited < lease * 10, "granted after {waited:?}");
        c.unlock().unwrap();
        assert_eq!(server.stats().expired, 1);
        // Our own session lives on: its heartbeat renews it.
        std::thread::sleep(lease * 2);
        c.lock(Mode::Exclusive).unwrap();
        c.unlock().unwrap();
        assert_eq!(server.stats().expired, 1);
        // Its connection was cut: the call goes on a new one, a session
        // that holds nothing.
        assert_eq!(
            raw.call(&RpcLockRequest::Release { lock, holder: holder_id }).unwrap(),
            RpcLockResponse::Refused(RpcLockRefusal::NotHeld { lock, holder: holder_id })
        );
    }
}
