//! The software NIC: a host process serving its registered regions over tcp.
//!
//! An [`RpcService`] on the shared framed server ([`super::rpc`]): one thread
//! per connection executes verbs in arrival order on region memory, and the
//! replies of a pipelined batch leave in one write. The host knows nothing of
//! locks: it applies verbs, each through [`RegionMemory`]'s bounds and
//! alignment checks, so nothing a client sends can touch memory outside a
//! region or panic the host (the framing's robustness is `rpc`'s).
//!
//! Who may touch what: a connection's handshake proves its principal
//! (the NIC's [`Authority`]), and every verb passes the NIC's
//! [`AccessTable`] (per-client grants, the software form of memory keys)
//! before it reaches region memory.
//!
//! [`RegionMemory`]: crate::rdma::memory::RegionMemory

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use citron_rpc::auth::{Authority, Principal, Status};
use citron_rpc::Peer;

use super::access::AccessTable;
use super::rpc::{RpcServer, RpcService, ServerStats};
use super::wire::{Request, Response};
use crate::rdma::addr::NodeId;
use crate::rdma::error::VerbError;
use crate::rdma::memory::RegionTable;

/// The NIC's side of the protocol.
pub struct NicService {
    regions: Arc<RegionTable>,
    access: Arc<AccessTable>,
    /// Node id -> where its mailbox listens.
    directory: Mutex<HashMap<NodeId, SocketAddr>>,
    next_node: AtomicU32,
    verbs: AtomicU64,
}

impl RpcService for NicService {
    type Request = Request;
    type Response = Response;

    fn handle(&self, request: Request, peer: SocketAddr) -> Response {
        self.handle_from(request, &Peer { addr: peer, principal: Principal::Anonymous, connection: 0 })
    }

    fn handle_from(&self, request: Request, peer: &Peer) -> Response {
        match request {
            Request::Verb(verb) => {
                self.verbs.fetch_add(1, Ordering::Relaxed);
                Response::Verb(self.access.execute(&peer.principal, &verb, |v| self.regions.execute(v)))
            }
            Request::Access(commands) => {
                if !peer.principal.is_server() {
                    log::warn!("nic: {} ({:?}) may not change access; refused", peer.addr, peer.principal);
                    return Response::Refused(VerbError::Malformed("only servers change access".into()));
                }
                for c in &commands {
                    self.access.apply(c);
                }
                Response::AccessApplied
            }
            Request::Join { mailbox } => {
                let id = NodeId(self.next_node.fetch_add(1, Ordering::Relaxed));
                if id.0 >= NodeId::FIRST_SHM {
                    // Shm ids start there (see `NodeId`).
                    return Response::Refused(VerbError::Malformed(
                        "node ids of this NIC are exhausted".into(),
                    ));
                }
                self.directory.lock().insert(id, mailbox);
                Response::Joined(id)
            }
            Request::Resolve(node) => Response::Resolved(self.directory.lock().get(&node).copied()),
            Request::ListRegions => Response::Regions(self.regions.list()),
        }
    }

    fn malformed(&self, error: String) -> Response {
        Response::Refused(VerbError::Malformed(error))
    }

    fn admit(&self, principal: &Principal) -> Result<(), Status> {
        self.access.admit(principal)
    }
}

/// A running software NIC. Dropping it stops accepting and closes every
/// connection.
pub struct TcpHost {
    server: RpcServer<NicService>,
}

impl TcpHost {
    /// Listens on `listen` (port 0 picks one) and serves `regions` to
    /// anyone (a NIC without keys).
    pub fn spawn(listen: SocketAddr, regions: Arc<RegionTable>) -> std::io::Result<Self> {
        Self::spawn_with(listen, regions, Authority::Open, Arc::new(AccessTable::default()))
    }

    /// Listens on `listen` and serves `regions` to whom `authority` lets
    /// in, each within what `access` grants it.
    pub fn spawn_with(
        listen: SocketAddr,
        regions: Arc<RegionTable>,
        authority: Authority,
        access: Arc<AccessTable>,
    ) -> std::io::Result<Self> {
        let service = NicService {
            regions,
            access: access.clone(),
            directory: Mutex::new(HashMap::new()),
            next_node: AtomicU32::new(1),
            verbs: AtomicU64::new(0),
        };
        let server = RpcServer::spawn_with(listen, service, "nic", authority)?;
        access.attach(server.connections());
        log::info!("software NIC listening on {}", server.local_addr());
        Ok(Self { server })
    }

    /// Who may touch which memory through this NIC.
    pub fn access(&self) -> &Arc<AccessTable> {
        &self.server.service().access
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.server.local_addr()
    }

    pub fn regions(&self) -> &Arc<RegionTable> {
        &self.server.service().regions
    }

    /// Connection and frame counters.
    pub fn stats(&self) -> &ServerStats {
        self.server.stats()
    }

    /// Verbs executed so far.
    pub fn verbs_executed(&self) -> u64 {
        self.server.service().verbs.load(Ordering::Relaxed)
    }

    /// Stops accepting and cuts every open connection, as a crashed host would.
    pub fn shutdown(&mut self) {
        self.server.shutdown();
    }
}
