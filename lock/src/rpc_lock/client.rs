//! The client of the lock server: a session (one multiplexed connection and
//! its lease) shared by lock handles, and the handles.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{RecvTimeoutError, Sender};

use super::{HolderId, RpcLockId, RpcLockRefusal, RpcLockRequest, RpcLockResponse};
use crate::rdma::tcp::{MuxChannel, MuxClient, RpcClient, RpcError};
use crate::rdma::{Endpoint, TransportError};
use crate::rwlock::{LockError, Mode, RwLockClient};

type Channel = MuxChannel<RpcLockRequest, RpcLockResponse>;

/// Timing of a client.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RpcLockConfig {
    /// Bound of a call that the server answers at once (connect, hello,
    /// release, renew): past it the server counts as unreachable.
    pub call_timeout: Duration,
    /// Longest an acquisition waits before it withdraws its request and
    /// fails with [`LockError::Timeout`].
    pub give_up: Duration,
}

impl RpcLockConfig {
    /// With the lease unit of the other locks, U = max(5000 RTT, 1 s): calls
    /// time out after 3 U, acquisitions give up after 60 U.
    pub fn from_rtt(rtt: Duration) -> Self {
        let unit = (rtt * 5000).max(Duration::from_secs(1));
        Self { call_timeout: unit * 3, give_up: unit * 60 }
    }
}

/// The median round trip of `samples` `Renew` calls to the server at
/// `server` (over a connection of its own, closed after).
pub fn measure_rtt(server: SocketAddr, samples: usize, timeout: Duration) -> Result<Duration, LockError> {
    let client: RpcClient<RpcLockRequest, RpcLockResponse> = RpcClient::new(server, timeout);
    let mut times = Vec::with_capacity(samples.max(1));
    for _ in 0..samples.max(1) {
        let t = Instant::now();
        match client.call(&RpcLockRequest::Renew)? {
            RpcLockResponse::Renewed => times.push(t.elapsed()),
            other => return Err(LockError::Host(format!("unexpected reply to renew: {other:?}"))),
        }
    }
    times.sort();
    Ok(times[times.len() / 2])
}

struct SessionInner {
    client: MuxClient<RpcLockRequest, RpcLockResponse>,
    config: RpcLockConfig,
    /// The server's lease, in nanoseconds (from its `Welcome`).
    lease_nanos: AtomicU64,
    next_holder: AtomicU64,
    calls: AtomicU64,
}

impl SessionInner {
    /// The open connection, or a new one with its `Hello` done.
    fn channel(&self) -> Result<Arc<Channel>, LockError> {
        let (channel, new) = self.client.channel()?;
        if new {
            self.count_call();
            match channel.call(&RpcLockRequest::Hello)? {
                RpcLockResponse::Welcome { lease } => {
                    // Relaxed: a value read by the heartbeat, no ordering needed.
                    self.lease_nanos.store(lease.as_nanos() as u64, Ordering::Relaxed);
                }
                other => {
                    channel.close();
                    return Err(LockError::Host(format!("unexpected reply to hello: {other:?}")));
                }
            }
        }
        Ok(channel)
    }

    fn lease(&self) -> Duration {
        Duration::from_nanos(self.lease_nanos.load(Ordering::Relaxed))
    }

    fn count_call(&self) {
        // Relaxed: statistics only.
        self.calls.fetch_add(1, Ordering::Relaxed);
    }
}

/// A connection to the lock server and its lease, shared by every
/// [`RpcLockClient`] of a process (or of a part of it): their calls are
/// multiplexed on it, and a thread renews the lease every lease/4. Dropping
/// the session closes the connection: the server drops its holds.
pub struct RpcLockSession {
    inner: Arc<SessionInner>,
    stop: Option<Sender<()>>,
    heartbeat: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for RpcLockSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RpcLockSession").field("server", &self.inner.client.server()).finish()
    }
}

impl RpcLockSession {
    /// Connects to the server at `server` and starts the lease heartbeat.
    pub fn connect(server: SocketAddr, config: RpcLockConfig) -> Result<Arc<Self>, LockError> {
        Self::connect_as(server, config, citron_rpc::auth::Credentials::anonymous())
    }

    /// [`RpcLockSession::connect`] proving `credentials`.
    pub fn connect_as(
        server: SocketAddr,
        config: RpcLockConfig,
        credentials: citron_rpc::auth::Credentials,
    ) -> Result<Arc<Self>, LockError> {
        let inner = Arc::new(SessionInner {
            client: MuxClient::new(server, config.call_timeout).with_credentials(credentials),
            config,
            lease_nanos: AtomicU64::new(0),
            next_holder: AtomicU64::new(1),
            calls: AtomicU64::new(0),
        });
        inner.channel()?;
        let (stop, stopped) = crossbeam_channel::bounded::<()>(0);
        let heartbeat = {
            let inner = inner.clone();
            std::thread::Builder::new()
                .name("rpc-lock-lease".into())
                .spawn(move || loop {
                    let period = (inner.lease() / 4).max(Duration::from_millis(1));
                    match stopped.recv_timeout(period) {
                        Err(RecvTimeoutError::Timeout) => {}
                        _ => return,
                    }
                    // Only an open connection has a session to renew; a new
                    // one is opened by the next lock call.
                    if let Some(channel) = inner.client.current() {
                        inner.count_call();
                        if let Err(e) = channel.call(&RpcLockRequest::Renew) {
                            log::warn!("RPC lock session: lease renewal failed: {e}");
                        }
                    }
                })
                .map_err(|e| LockError::Host(format!("cannot start the lease thread: {e}")))?
        };
        Ok(Arc::new(Self { inner, stop: Some(stop), heartbeat: Some(heartbeat) }))
    }

    /// The server's lease for this session.
    pub fn lease(&self) -> Duration {
        self.inner.lease()
    }

    pub fn config(&self) -> RpcLockConfig {
        self.inner.config
    }

    /// Calls made so far (lock calls, hellos and renewals).
    pub fn calls(&self) -> u64 {
        self.inner.calls.load(Ordering::Relaxed)
    }

    /// Cuts the connection, as a crash would: the server drops this
    /// session's holds and queued requests; calls in flight fail. The next
    /// lock call opens a new session.
    pub fn disconnect(&self) {
        if let Some(c) = self.inner.client.current() {
            c.close();
        }
    }

    fn next_holder(&self) -> HolderId {
        // Relaxed: distinct numbers only.
        HolderId(self.inner.next_holder.fetch_add(1, Ordering::Relaxed))
    }
}

impl Drop for RpcLockSession {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(h) = self.heartbeat.take() {
            let _ = h.join();
        }
        if let Some(c) = self.inner.client.current() {
            c.close();
        }
    }
}

/// Counters of one handle.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RpcLockStats {
    pub acquisitions: u64,
    /// Acquisitions the server queued before granting.
    pub queued: u64,
    /// Calls this handle made (acquire, release, cancel).
    pub calls: u64,
    pub timeouts: u64,
    /// Releases that found the hold dropped (lease lapse, lost connection).
    pub fenced: u64,
}

struct Held {
    channel: Arc<Channel>,
    arrival: u64,
}

/// One handle to one lock of the server (a reader-writer lock: `Shared`
/// holders overlap). The `Endpoint` of the [`RwLockClient`] calls is not
/// used: the lock lives on the server, not in fabric memory.
pub struct RpcLockClient {
    session: Arc<RpcLockSession>,
    lock: RpcLockId,
    holder: HolderId,
    held: Option<Held>,
    stats: RpcLockStats,
}

impl std::fmt::Debug for RpcLockClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RpcLockClient")
            .field("lock", &self.lock)
            .field("holder", &self.holder)
            .field("held", &self.held.is_some())
            .finish()
    }
}

impl RpcLockClient {
    /// A handle with a session of its own.
    pub fn new(server: SocketAddr, lock: RpcLockId, config: RpcLockConfig) -> Result<Self, LockError> {
        Ok(Self::with_session(&RpcLockSession::connect(server, config)?, lock))
    }

    /// A handle on `lock` in `session` (shared with other handles).
    pub fn with_session(session: &Arc<RpcLockSession>, lock: RpcLockId) -> Self {
        Self {
            session: session.clone(),
            lock,
            holder: session.next_holder(),
            held: None,
            stats: RpcLockStats::default(),
        }
    }

    pub fn session(&self) -> &Arc<RpcLockSession> {
        &self.session
    }

    pub fn lock_id(&self) -> RpcLockId {
        self.lock
    }

    pub fn stats(&self) -> RpcLockStats {
        self.stats
    }

    pub fn is_held(&self) -> bool {
        self.held.is_some()
    }

    /// While held: the request's arrival number (requests for this lock
    /// before it), the FIFO order the server grants in.
    pub fn arrival(&self) -> Option<u64> {
        self.held.as_ref().map(|h| h.arrival)
    }

    fn call(
        &mut self,
        channel: &Channel,
        request: &RpcLockRequest,
    ) -> Result<RpcLockResponse, TransportError> {
        self.stats.calls += 1;
        self.session.inner.count_call();
        channel.call(request).map_err(TransportError::from)
    }

    /// Acquires in `mode`: one call, answered when the server grants it.
    pub fn lock(&mut self, mode: Mode) -> Result<(), LockError> {
        if self.held.is_some() {
            return Err(LockError::Misuse("RPC lock acquired twice through one handle"));
        }
        let channel = self.session.inner.channel()?;
        self.stats.calls += 1;
        self.session.inner.count_call();
        let pending =
            channel.start(&RpcLockRequest::Acquire { lock: self.lock, holder: self.holder, mode })?;
        let give_up = self.session.inner.config.give_up;
        match pending.wait(give_up) {
            Ok(RpcLockResponse::Granted { arrival, queued, .. }) => {
                self.stats.acquisitions += 1;
                self.stats.queued += u64::from(queued);
                self.held = Some(Held { channel, arrival });
                Ok(())
            }
            Ok(RpcLockResponse::Refused(r)) => Err(LockError::Host(r.to_string())),
            Ok(other) => Err(LockError::Host(format!("unexpected reply to acquire: {other:?}"))),
            Err(RpcError::Timeout(_)) => {
                drop(pending);
                self.stats.timeouts += 1;
                self.withdraw(&channel)?;
                Err(LockError::Timeout(give_up))
            }
            Err(e) => Err(e.into()),
        }
    }

    /// After giving up: cancel the request, and release it if the grant
    /// crossed the cancel.
    #[cold]
    fn withdraw(&mut self, channel: &Channel) -> Result<(), LockError> {
        let cancel = RpcLockRequest::Cancel { lock: self.lock, holder: self.holder };
        if let RpcLockResponse::Cancelled { was_granted: true, .. } = self.call(channel, &cancel)? {
            let release = RpcLockRequest::Release { lock: self.lock, holder: self.holder };
            self.call(channel, &release)?;
        }
        Ok(())
    }

    /// Releases the lock: one call.
    pub fn unlock(&mut self) -> Result<(), LockError> {
        let held = self.held.take().ok_or(LockError::Misuse("RPC lock release without a hold"))?;
        let request = RpcLockRequest::Release { lock: self.lock, holder: self.holder };
        match self.call(&held.channel, &request) {
            Ok(RpcLockResponse::Released { .. }) => Ok(()),
            Ok(RpcLockResponse::Refused(RpcLockRefusal::NotHeld { .. } | RpcLockRefusal::SessionDropped))
            | Err(TransportError::Disconnected) => {
                // The server dropped our hold with our session: someone may
                // have held the lock beside us.
                self.stats.fenced += 1;
                log::warn!("RPC lock {:?}: the hold was dropped before its release", self.lock);
                Err(LockError::Fenced)
            }
            Ok(other) => Err(LockError::Host(format!("unexpected reply to release: {other:?}"))),
            Err(e) => Err(e.into()),
        }
    }
}

impl RwLockClient for RpcLockClient {
    #[inline]
    fn acquire(&mut self, _ep: &Endpoint, mode: Mode) -> Result<(), LockError> {
        self.lock(mode)
    }

    #[inline]
    fn release(&mut self, _ep: &Endpoint) -> Result<(), LockError> {
        self.unlock()
    }

    fn server_calls(&self) -> u64 {
        self.stats.calls
    }
}
