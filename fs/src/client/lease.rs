//! The client's lease: the heartbeat thread that renews it, reclaiming it
//! from a restarted meta-server (opens, locks and loans go on), registering
//! again after it was lost (older opens and locks are gone then), fencing,
//! and leaving the cluster (DESIGN.md §4).
//!
//! While the meta-server does not answer, or has restarted and this client
//! has not reclaimed yet, the client is *away*: calls wait
//! ([`Shared::wait_while_away`]) up to [`ClientConfig::meta_wait`] instead
//! of failing, so a restart costs applications a pause, not an error.
//!
//! [`ClientConfig::meta_wait`]: super::ClientConfig::meta_wait

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use citron_lock::rdma::tcp::RpcError;
use citron_rpc::auth::{HandshakeError, Status};

use super::{answer, renewal_priority, FsClient, Shared};
use crate::error::FsError;
use crate::proto::{ClusterInfo, MetaRequest, MetaResponse};
use crate::types::ClientId;

/// The thread that renews the lease, running from the registration on: a
/// client far from the meta-server spends many round trips joining the
/// cluster (the RTT probes alone are 32), and a lease that waited for them
/// expired before the first renewal (a client 80 ms away with a 2 s
/// lease). Dropping it stops and joins the thread, so a `connect` that
/// fails half-way leaves no thread behind.
pub(super) struct Heartbeat {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl Heartbeat {
    pub(super) fn start(shared: &Arc<Shared>) -> Result<Self, FsError> {
        let renewing = shared.clone();
        let thread = std::thread::Builder::new()
            .name("citronfs-lease".into())
            .spawn(move || heartbeat_loop(&renewing))
            .map_err(|e| FsError::Io(e.to_string()))?;
        Ok(Self { shared: shared.clone(), thread: Some(thread) })
    }
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        // Relaxed: a flag the thread polls (as `FsClient::shutdown` sets it).
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl FsClient {
    /// How many times this client has had to register again after its
    /// lease was lost. Opens and locks of an older registration are gone.
    pub fn registration(&self) -> u64 {
        self.shared.registration.load(Ordering::Relaxed)
    }

    /// How many times this client reclaimed its registration from a
    /// restarted meta-server: what it was granted to cache before is
    /// unknown there, and must be dropped.
    pub fn reclaims(&self) -> u64 {
        self.shared.reclaims.load(Ordering::SeqCst)
    }

    /// Whether the client is fenced right now (lease lost or not renewed
    /// in time): every lock and I/O call fails with EIO.
    pub fn is_fenced(&self) -> bool {
        self.shared.fenced()
    }

    /// A test hook: stops (`true`) or resumes renewing the lease, so a test
    /// gets this client fenced and registered again while its other
    /// threads go on (as a mount cut off from the network and back). Its
    /// lock token thread hears no revocation meanwhile (`client::tokens`).
    #[doc(hidden)]
    pub fn pause_lease_renewal(&self, paused: bool) {
        // Relaxed: a flag the heartbeat thread polls; nothing is published
        // with it.
        self.shared.renewal_paused.store(paused, Ordering::Relaxed);
    }
}

fn heartbeat_loop(shared: &Shared) {
    renewal_priority::raise_calling_thread();
    let tick = (shared.lease / 4).max(Duration::from_millis(10));
    let mut last = std::time::Instant::now();
    while !shared.stop.load(Ordering::Relaxed) {
        // Short naps, so dropping the client does not wait a whole tick.
        std::thread::sleep(Duration::from_millis(20).min(tick));
        // Away (the meta-server stopped answering, or restarted and we
        // reclaim): ask again soon, not a tick later.
        let away = shared.meta_away.load(Ordering::SeqCst);
        let due = if away { AWAY_RETRY.min(tick) } else { tick };
        if last.elapsed() < due || shared.renewal_paused.load(Ordering::Relaxed) {
            continue;
        }
        if shared.detached.lock().is_some() {
            // Nothing to renew: this client must be mounted again.
            continue;
        }
        last = std::time::Instant::now();
        let sent = last;
        let client = ClientId(shared.client.load(Ordering::Relaxed));
        match shared.call(&MetaRequest::Heartbeat { client }) {
            Ok(MetaResponse::Done) => {
                *shared.renewed.lock() = sent;
                shared.back(client);
            }
            Ok(MetaResponse::Failed(_))
            | Err(RpcError::Handshake(HandshakeError::Refused(Status::NotAdmitted))) => {
                if !away {
                    log::warn!("lease of client {} lost", client.0);
                }
                // SeqCst, here and below: set before the identity changes,
                // cleared only after the registration count moved
                // (`FsClient::with_pinned_endpoints`).
                shared.fenced.store(true, Ordering::SeqCst);
                shared.identity.registering(&shared.rpc);
                match reclaim(shared, client) {
                    Reclaim::Done(info) => {
                        // The same registration goes on: opens, locks and
                        // loans are the meta-server's again.
                        *shared.renewed.lock() = sent;
                        shared.incarnation.store(info.incarnation, Ordering::SeqCst);
                        shared.reclaims.fetch_add(1, Ordering::SeqCst);
                        shared.fenced.store(false, Ordering::SeqCst);
                        shared.back(client);
                        log::warn!(
                            "the meta-server restarted; client {} reclaimed its opens and locks",
                            client.0
                        );
                    }
                    // Asked again at the next turn; calls wait meanwhile.
                    Reclaim::Later => shared.meta_away.store(true, Ordering::SeqCst),
                    Reclaim::NotRemembered => register_again(shared, sent),
                    Reclaim::Detached => {}
                }
            }
            Ok(other) => log::warn!("unexpected heartbeat answer {other:?}"),
            Err(e) => {
                if !away {
                    log::warn!("heartbeat failed: {e}; calls wait for the meta-server");
                }
                shared.meta_away.store(true, Ordering::SeqCst);
            }
        }
    }
}

/// How often a client whose meta-server is away asks again.
const AWAY_RETRY: Duration = Duration::from_millis(100);

/// What came of asking a meta-server to take this client back.
enum Reclaim {
    /// Taken back under its id, with its opens and locks.
    Done(Box<ClusterInfo>),
    /// Not yet (the meta-server is in its quiet start, or away).
    Later,
    /// The meta-server does not remember this client (same process: its
    /// lease ran out; or a restart after the grace period).
    NotRemembered,
    /// Another file system, or one this client cannot rejoin: every call
    /// fails from now on.
    Detached,
}

/// Asks the meta-server to take `client` back with its opens (the
/// meta-server restarted under it: `citronfs_meta_server`'s grace period).
fn reclaim(shared: &Shared, client: ClientId) -> Reclaim {
    let opens = shared.opens.reclaimable();
    let request = MetaRequest::ReclaimClient {
        client,
        hostname: shared.hostname.clone(),
        pid: std::process::id(),
        opens,
    };
    let (info, layouts) = match shared.call(&request) {
        Ok(MetaResponse::Reclaimed(info, layouts)) => (info, layouts),
        Ok(MetaResponse::Failed(FsError::MetaRestarted)) => return Reclaim::NotRemembered,
        Ok(MetaResponse::Failed(FsError::Grace)) => return Reclaim::Later,
        Ok(other) => {
            log::warn!("reclaim of client {} answered {other:?}", client.0);
            return Reclaim::Later;
        }
        Err(e) => {
            log::warn!("reclaim of client {}: {e}", client.0);
            return Reclaim::Later;
        }
    };
    if info.fs != shared.fs {
        let why = FsError::OtherFileSystem { was: shared.fs, now: info.fs };
        detach(shared, why, "its state was lost, or it is another cluster's");
        return Reclaim::Detached;
    }
    if info.meta_nic.port() != shared.meta_nic.port() {
        // Our lock memory is reached through the NIC we joined.
        detach(shared, FsError::MetaRestarted, "its NIC moved to another port; mount it again to go on");
        return Reclaim::Detached;
    }
    if let Err(e) = shared.identity.registered(&shared.rpc, &info) {
        log::warn!("cannot use the reclaimed registration: {e}");
        return Reclaim::Later;
    }
    let mut lost = 0;
    for (ino, layout) in layouts {
        match layout {
            Ok(layout) => shared.opens.reclaimed(ino, layout.locks.map(|a| shared.reachable_area(a))),
            Err(e) => {
                lost += 1;
                log::error!("inode {}: its open could not be reclaimed ({e}); its calls answer EIO", ino.0);
                shared.opens.lost(ino);
            }
        }
    }
    if lost > 0 {
        log::error!("{lost} open files of client {} were not taken back", client.0);
    }
    Reclaim::Done(Box::new(info))
}

/// Registers anew, as a new client: what this client had open and locked
/// is gone (its lease ran out), or, if the meta-server restarted, the mount
/// must be mounted again.
fn register_again(shared: &Shared, sent: std::time::Instant) {
    let again = shared
        .call(&MetaRequest::RegisterClient { hostname: shared.hostname.clone(), pid: std::process::id() });
    let registered = match again {
        Ok(MetaResponse::Registered(info)) if info.fs != shared.fs => {
            // Never show another file system in place of ours: stay
            // fenced, and every call fails.
            let why = FsError::OtherFileSystem { was: shared.fs, now: info.fs };
            detach(shared, why, "its state was lost, or it is another cluster's");
            None
        }
        Ok(MetaResponse::Registered(info))
            if info.incarnation != shared.incarnation.load(Ordering::SeqCst) =>
        {
            // The same file system from a new meta-server process that
            // could not take us back (we came after its grace period, or
            // it kept no lock memory): our opens and locks are gone.
            detach(shared, FsError::MetaRestarted, "mount it again to go on");
            None
        }
        Ok(MetaResponse::Registered(info)) => match shared.identity.registered(&shared.rpc, &info) {
            Ok(()) => Some(info),
            Err(e) => {
                log::warn!("cannot use the new registration: {e}");
                None
            }
        },
        _ => None,
    };
    if let Some(info) = registered {
        shared.client.store(info.client.0, Ordering::Relaxed);
        let now = shared.registration.fetch_add(1, Ordering::SeqCst) + 1;
        shared.opens.drop_older_than(now);
        *shared.renewed.lock() = sent;
        shared.fenced.store(false, Ordering::SeqCst);
        shared.back(info.client);
        log::warn!("re-registered as client {}", info.client.0);
    }
}

impl FsClient {
    /// Runs `op` (a call that uses lock memory: a lock, an unlock, an I/O);
    /// if it failed because the meta-server went away under it — its verbs
    /// found the meta-server's NIC gone, or not knowing this client, which
    /// a restart does — waits until this client is back (reclaimed), and
    /// runs it once more from the start, with the lock memory as it was
    /// reclaimed. Each of these calls may be run twice: a lock or unlock
    /// set again is the same lock, and an I/O writes the same bytes.
    pub(super) fn riding_out_restarts<R>(
        &self,
        mut op: impl FnMut() -> Result<R, FsError>,
    ) -> Result<R, FsError> {
        let reclaims = self.reclaims();
        match op() {
            Err(e) if e.may_break_endpoints() && self.meta_server_went_away(reclaims) => {
                log::info!("a call that failed while the meta-server was away is made again: {e}");
                op()
            }
            r => r,
        }
    }

    /// After a failure: whether the meta-server was away (and is back now,
    /// this client having reclaimed since `reclaims` was read).
    fn meta_server_went_away(&self, reclaims: u64) -> bool {
        let shared = &self.shared;
        if self.reclaims() == reclaims && !shared.away_now() {
            return false;
        }
        shared.wait_while_away(std::time::Instant::now()).is_ok() && self.reclaims() != reclaims
    }
}

impl Shared {
    /// Whether the meta-server is away: known to be, or found so by asking
    /// it now (one renewal) rather than waiting for the heartbeat.
    pub(super) fn away_now(&self) -> bool {
        if self.meta_away.load(Ordering::SeqCst) {
            return true;
        }
        match self.call(&MetaRequest::Heartbeat { client: self.client_id() }) {
            Ok(MetaResponse::Done) => false,
            _ => {
                self.meta_away.store(true, Ordering::SeqCst);
                true
            }
        }
    }
}

/// From now on every call of this client fails with `why`: what the
/// meta-server's address serves is not what this client mounted.
fn detach(shared: &Shared, why: FsError, advice: &str) {
    let mut detached = shared.detached.lock();
    if detached.is_none() {
        log::error!(
            "meta-server at {}: {why} ({advice}); every call of this mount fails with EIO",
            shared.rpc.server()
        );
    }
    *detached = Some(why);
    shared.meta_away.store(false, Ordering::SeqCst);
}

impl FsClient {
    /// Leaves the cluster ahead of the client's drop (a mount going away):
    /// lock requests still blocked are answered with an error (EIO), and the
    /// meta-server is told this client leaves, so it removes the client's
    /// lock records and opens now (waking whoever waits for them) instead
    /// of a lease later. Calls after this fail. Idempotent.
    pub fn shutdown(&self) {
        // An away meta-server is not waited for: a mount that goes away
        // while its meta-server is down goes now.
        self.shared.leaving.store(true, Ordering::Relaxed);
        if let Some(w) = &self.waiters {
            w.shutdown();
        }
        // Changes already answered must reach the meta-server before the
        // client leaves; releases still queued go with the client (leaving
        // ends every open of it at the meta-server).
        if !self.shared.stop.load(Ordering::Relaxed) && !self.shared.fenced() {
            self.flush_late_changes();
        }
        let unsent = self.queued_changes();
        if unsent > 0 {
            log::error!(
                "{unsent} creates and unlinks answered before they were sent are lost with the client"
            );
        }
        self.shared.late_changes.stop();
        self.shared.releases.stop();
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
        if let Some(h) = self.releaser.take() {
            let _ = h.join();
        }
        if let Some(h) = self.late_sender.take() {
            let _ = h.join();
        }
        self.heartbeat.take();
        if let Some(h) = self.tuning.take() {
            let _ = h.join();
        }
    }
}
