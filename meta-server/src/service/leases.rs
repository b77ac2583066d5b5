//! Client leases: the registered clients and when they last renewed, the
//! reaper that fences a client whose lease ran out (reclamation first,
//! then its lock records, waits and opens), and how a fenced client's
//! access is revoked at every NIC.

use std::sync::Arc;
use std::time::Instant;

use citron_lock::rdma::tcp::Connections;
use citron_lock::rdma::Endpoint;
use citron_rpc::auth::{KeyOptions, Principal};
use citronfs_core::locks::LockTiming;
use citronfs_core::types::ClientId;
use citronfs_core::FsError;

use crate::access::{Access, Placed};
use crate::lock_cleanup;
use crate::reclaim::{Cause, Revocation};

use super::{MetaService, NamespaceGrowth};

/// The reclamation point's revocation ([`Revocation`]): the grants at every
/// NIC ([`Access`]) and the client's connections to the meta-server's RPC
/// service.
pub(super) struct NicRevocation {
    pub(super) access: Arc<Access>,
    pub(super) connections: Arc<std::sync::OnceLock<Connections>>,
}

impl Revocation for NicRevocation {
    fn revoke_client(&self, client: ClientId) -> Result<(), FsError> {
        // Its grants end and its connections are cut everywhere before
        // anything it held is handed to others.
        self.access.fence(client).map_err(|e| FsError::Io(e.to_string()))?;
        if let Some(conns) = self.connections.get() {
            conns.close_where(
                |p| matches!(p, Principal::Session(s) | Principal::Claimed(s) if s.client == client.0),
            );
        }
        Ok(())
    }

    fn revoke_memory(&self, memory: &[Placed]) -> Result<(), FsError> {
        self.access.revoke_everyone(memory).map_err(|e| FsError::Io(e.to_string()))
    }
}

/// A registered client and when it last renewed its lease.
pub(super) struct ClientLease {
    pub(super) renewed: Instant,
    /// The client said it leaves: fenced at the reaper's next turn.
    pub(super) leaving: bool,
    pub(super) hostname: String,
    pub(super) pid: u32,
    /// The options of the key it registered with (root squash).
    pub(super) options: KeyOptions,
}

impl MetaService {
    /// Ends the grace period after a restart when its time has come
    /// ([`super::grace`]): lock memory is handed out again, and the clients
    /// of the previous process that did not come back are fenced at the
    /// reaper's next turn (their records and waits go).
    pub(super) fn end_grace_if_due(&self) {
        let Some(ended) = self.grace.tick() else { return };
        self.ns.lock().freeze_lock_memory(false);
        if ended.missing.is_empty() {
            log::info!("grace period over: every client of the previous process reclaimed");
            return;
        }
        log::warn!(
            "grace period over: {} clients of the previous process did not come back; releasing their locks",
            ended.missing.len()
        );
        let mut clients = self.clients.lock();
        for c in ended.missing {
            clients.insert(
                c,
                ClientLease {
                    renewed: Instant::now(),
                    leaving: true,
                    hostname: "(a client of the previous process)".into(),
                    pid: 0,
                    options: KeyOptions::default(),
                },
            );
        }
    }

    /// Fences clients whose lease ran out: the reclamation point first (it
    /// revokes their access where it can), then their lock records and waits
    /// go (their waiters are woken), then their opens. `ep` is the
    /// meta-server's own endpoint on its lock memory.
    pub(super) fn expire_clients(&self, ep: &Endpoint, timing: &LockTiming) {
        let now = Instant::now();
        let expired: Vec<(ClientId, bool)> = {
            let mut clients = self.clients.lock();
            let dead: Vec<(ClientId, bool)> = clients
                .iter()
                .filter(|(_, l)| l.leaving || now.duration_since(l.renewed) > self.lease)
                .map(|(c, l)| (*c, l.leaving))
                .collect();
            for (c, _) in &dead {
                clients.remove(c);
                self.tuning.forget(*c);
            }
            dead
        };
        for (c, left) in expired {
            if left {
                log::info!("client {} left; releasing its locks and opens", c.0);
            } else {
                log::warn!("client {} missed its lease; releasing its locks and opens", c.0);
            }
            self.reclaim.fence(c);
            // Pinned, so no file's lock memory goes while we work on it.
            let tables = self.ns.lock().pin_lock_tables();
            let growth = |ino| NamespaceGrowth { service: self, ino };
            match lock_cleanup::release_client(ep, timing, &tables, self.waits_for, c, &growth) {
                Ok(n) if n > 0 => log::warn!("released {n} lock records of client {}", c.0),
                Ok(_) => {}
                Err(e) => log::error!("releasing the locks of client {}: {e}", c.0),
            }
            let mut ns = self.ns.lock();
            for t in &tables {
                ns.unpin(t.ino, Cause::Fenced(c));
            }
            ns.drop_client(c);
            ns.client_gone(c);
            self.grants.drop_client(c);
        }
        self.ns.lock().sweep_orphans();
        self.grants.prune();
    }
}
