//! The host side of the `ib` backend: registers a host's regions with its
//! RNIC and answers the connection setup of [`super::handshake`] on a tcp
//! control channel. After setup the host's CPU takes no part in one-sided
//! verbs; it only creates and destroys queue pairs, answers the node
//! directory, and executes 16-byte atomics where the device has none (see
//! [`super::plan`]).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use super::addr::IbDevice;
use super::ffi::{Access, CompletionQueue, Context, MemoryRegion, ProtectionDomain, QpSizes, QueuePair};
use super::handshake::{self, HandshakeError, HostRequest, HostResponse, RegionGrant, PROTOCOL_VERSION};
use crate::rdma::addr::{NodeId, RegionId};
use crate::rdma::error::{TransportError, VerbError};
use crate::rdma::memory::{RegionMemory, RegionTable};
use crate::rdma::tcp::{RpcServer, RpcService};
use crate::rdma::verb::Verb;
use citron_rpc::auth::Authority;

struct Registered {
    // Declared first: deregistered before the mapping may go.
    mr: MemoryRegion,
    memory: Arc<RegionMemory>,
}

struct HostService {
    pd: Arc<ProtectionDomain>,
    /// Every host QP's CQ. One-sided verbs complete at the requester, so the
    /// host never polls it.
    cq: Arc<CompletionQueue>,
    regions: Arc<RegionTable>,
    registered: Mutex<HashMap<RegionId, Registered>>,
    /// The QPs made for each control connection, destroyed when it ends.
    qps: Mutex<HashMap<SocketAddr, Vec<QueuePair>>>,
    directory: Mutex<HashMap<NodeId, (SocketAddr, SocketAddr)>>,
    next_node: AtomicU32,
}

impl HostService {
    /// Grants for every region, registering the ones added since last time.
    fn grants(&self) -> Result<Vec<RegionGrant>, TransportError> {
        let mut reg = self.registered.lock();
        let mut out = Vec::new();
        for (id, _) in self.regions.list() {
            if let std::collections::hash_map::Entry::Vacant(slot) = reg.entry(id) {
                let memory = self.regions.get(id).map_err(|e| TransportError::Ib(e.to_string()))?;
                // SAFETY: the mapping belongs to `memory`, which `Registered`
                // keeps alive for as long as the MR; remote peers access it
                // as the shm backend's clients do (atomics, or under locks).
                let mr = unsafe {
                    MemoryRegion::register(
                        &self.pd,
                        memory.base_ptr(),
                        memory.len() as usize,
                        Access::Remote,
                    )?
                };
                log::info!("ib: registered region {} ({} bytes, rkey {:#x})", id.0, memory.len(), mr.rkey());
                slot.insert(Registered { mr, memory });
            }
            let r = &reg[&id];
            out.push(RegionGrant {
                id,
                base: r.memory.base_ptr() as u64,
                len: r.memory.len(),
                rkey: r.mr.rkey(),
            });
        }
        Ok(out)
    }

    fn connect(
        &self,
        remote: &handshake::QpAddress,
        peer: SocketAddr,
    ) -> Result<HostResponse, TransportError> {
        let regions = self.grants()?;
        let qp = QueuePair::new(&self.pd, &self.cq, &self.cq, QpSizes { send: 1, recv: 1, max_inline: 0 })?;
        qp.connect(remote)?;
        let address = qp.address();
        self.qps.lock().entry(peer).or_default().push(qp);
        Ok(HostResponse::Connected { qp: address, regions })
    }
}

fn refused(e: impl std::fmt::Display) -> HostResponse {
    HostResponse::Refused(HandshakeError::Refused(e.to_string()))
}

impl RpcService for HostService {
    type Request = HostRequest;
    type Response = HostResponse;

    fn handle(&self, request: HostRequest, peer: SocketAddr) -> HostResponse {
        if let Err(e) = handshake::check_host_request(&request) {
            return HostResponse::Refused(e);
        }
        match request {
            HostRequest::Connect { qp, .. } => self.connect(&qp, peer).unwrap_or_else(refused),
            HostRequest::Regions => self.grants().map(HostResponse::Regions).unwrap_or_else(refused),
            HostRequest::Execute(verb) => HostResponse::Executed(match verb {
                Verb::ExtCas { .. } | Verb::ExtFaa { .. } | Verb::Flush { .. } => self.regions.execute(&verb),
                other => Err(VerbError::Malformed(format!(
                    "the ib host executes only 16-byte atomics and flushes, not {}",
                    other.kind().name()
                ))),
            }),
            HostRequest::Join { peer_listen, .. } => {
                let id = NodeId(self.next_node.fetch_add(1, Ordering::Relaxed));
                self.directory.lock().insert(id, (peer_listen, peer));
                HostResponse::Joined(id)
            }
            HostRequest::Resolve(node) => {
                HostResponse::Resolved(self.directory.lock().get(&node).map(|(listen, _)| *listen))
            }
        }
    }

    fn malformed(&self, error: String) -> HostResponse {
        HostResponse::Refused(HandshakeError::Malformed(error))
    }

    fn disconnected(&self, peer: SocketAddr) {
        // The connection is the lease of what it asked for.
        if let Some(qps) = self.qps.lock().remove(&peer) {
            log::debug!("ib: {peer} gone, destroying its {} queue pair(s)", qps.len());
        }
        self.directory.lock().retain(|_, (_, conn)| *conn != peer);
    }
}

/// A running `ib` host: the regions of a [`RegionTable`] registered with an
/// RNIC, and the control channel clients connect through. Dropping it stops
/// the channel and destroys every queue pair and registration.
pub struct IbHost {
    server: RpcServer<Arc<HostService>>,
    device: IbDevice,
}

impl IbHost {
    /// Opens `device`, registers `regions` (and, lazily, regions added
    /// later) and listens for connection setup on `listen`. The control
    /// channel lets in whom `authority` does, like the host's other
    /// connections: a queue pair (and so an rkey) is handed only to a peer
    /// that proved the cluster key.
    pub fn spawn(
        device: &IbDevice,
        listen: SocketAddr,
        regions: Arc<RegionTable>,
        authority: Authority,
    ) -> Result<Self, TransportError> {
        let ctx = Context::open(device)?;
        if !ctx.atomics {
            return Err(TransportError::Ib(format!("RDMA device {device} has no atomic verbs")));
        }
        if !ctx.atomics_with_cpu {
            log::warn!(
                "RDMA device {device}: its atomics are not atomic with CPU atomics (IBV_ATOMIC_HCA); \
                 every client that applies atomics to this host's memory must come through an RNIC \
                 (--transport ib), not shm or tcp"
            );
        }
        let pd = ProtectionDomain::new(&ctx)?;
        let cq = CompletionQueue::new(&ctx, 16, false)?;
        let service = Arc::new(HostService {
            pd,
            cq,
            regions,
            registered: Mutex::new(HashMap::new()),
            qps: Mutex::new(HashMap::new()),
            directory: Mutex::new(HashMap::new()),
            next_node: AtomicU32::new(1),
        });
        service.grants()?;
        let server = RpcServer::spawn_with(listen, service, "ib-ctl", authority)?;
        log::info!(
            "ib host on {device}, control channel {} (protocol {PROTOCOL_VERSION})",
            server.local_addr()
        );
        Ok(Self { server, device: device.clone() })
    }

    /// Where clients connect (`ib:DEVICE@` this).
    pub fn local_addr(&self) -> SocketAddr {
        self.server.local_addr()
    }

    pub fn device(&self) -> &IbDevice {
        &self.device
    }
}
