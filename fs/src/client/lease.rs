//! The client's lease: the heartbeat thread that renews it, registering
//! again after it was lost (older opens and locks are gone then), fencing,
//! and leaving the cluster (DESIGN.md §4).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use citron_lock::rdma::tcp::RpcError;
use citron_rpc::auth::{HandshakeError, Status};

use super::{answer, renewal_priority, FsClient, Shared};
use crate::error::FsError;
use crate::proto::{MetaRequest, MetaResponse};
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
        if shared.detached.lock().is_some() {
            // Nothing to renew: this client must be mounted again.
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
                // SeqCst, here and below: set before the identity changes,
                // cleared only after the registration count moved
                // (`FsClient::with_pinned_endpoints`).
                shared.fenced.store(true, Ordering::SeqCst);
                shared.identity.registering(&shared.rpc);
                let again = shared.call(&MetaRequest::RegisterClient {
                    hostname: shared.hostname.clone(),
                    pid: std::process::id(),
                });
                let registered = match again {
                    Ok(MetaResponse::Registered(info)) if info.fs != shared.fs => {
                        // Never show another file system in place of ours:
                        // stay fenced, and every call fails.
                        let why = FsError::OtherFileSystem { was: shared.fs, now: info.fs };
                        detach(shared, why, "its state was lost, or it is another cluster's");
                        None
                    }
                    Ok(MetaResponse::Registered(info)) if info.incarnation != shared.incarnation => {
                        // The same file system from a new meta-server
                        // process: our opens, locks and the lock memory we
                        // map belong to the old one.
                        detach(shared, FsError::MetaRestarted, "mount it again to go on");
                        None
                    }
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
                    let now = shared.registration.fetch_add(1, Ordering::SeqCst) + 1;
                    shared.opens.drop_older_than(now);
                    *shared.renewed.lock() = sent;
                    shared.fenced.store(false, Ordering::SeqCst);
                    log::warn!("re-registered as client {}", info.client.0);
                }
            }
            Ok(other) => log::warn!("unexpected heartbeat answer {other:?}"),
            Err(e) => log::warn!("heartbeat failed: {e}"),
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
