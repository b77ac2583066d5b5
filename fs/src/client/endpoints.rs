//! How this client reaches server memory: joining the meta-server's and the
//! data servers' NICs (shm, tcp or RDMA, [`Transport`]), the pool of
//! per-thread [`Endpoints`] an operation checks out, and the data servers'
//! endpoints that batches of verbs run on.
//!
//! # A data server that does not answer
//!
//! A data server restarts (a crash, an upgrade) and comes back with its
//! memory, maybe at another address. A batch of data verbs or a connection
//! to it that fails in transport (refused, reset, timed out) is
//! [`FsError::DataServerDown`]; the operation ([`FsClient::riding_through`])
//! lets go of everything it holds, forgets the connection, and waits for
//! the server: it asks the meta-server where the server is now and
//! connects there, again and again, up to the client's timeout, and then
//! does the whole operation again (rewriting the same bytes, or reading
//! them again, is harmless). Only a server still away after the timeout
//! costs the application an error (EIO).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use citron_lock::range_lock::RangeLockSite;
use citron_lock::rdma::{
    Endpoint, IbDevice, IbFabric, Node, RemoteAddr, TcpOptions, TransportError, Verb, VerbCounts, VerbError,
    VerbReply,
};

use super::opens::Pinned;
use super::{reachable, unexpected, FsClient, Shared, Transport};
use crate::error::FsError;
use crate::locks::LockArea;
use crate::proto::{DataServerInfo, MetaRequest, MetaResponse};
use crate::types::DataServerId;

/// How a server's memory can be reached, as the meta-server reported it.
pub(super) struct ServerAddrs<'a> {
    pub(super) nic: SocketAddr,
    pub(super) shm: Option<&'a str>,
    pub(super) ib: Option<SocketAddr>,
}

/// Joins a server's memory: its shm fabric when allowed and present on this
/// host, its NIC otherwise; with [`Transport::Ib`], its RDMA control channel.
pub(super) fn join_server(
    server: ServerAddrs<'_>,
    transport: Transport,
    ib_device: Option<&IbDevice>,
    options: TcpOptions,
    credentials: citron_lock::rdma::NodeCredentials,
) -> Result<Node, FsError> {
    let ServerAddrs { nic, shm, ib } = server;
    if transport == Transport::Ib {
        let device = ib_device
            .ok_or_else(|| FsError::Invalid("--transport ib needs the RDMA device of this machine".into()))?;
        let host = ib.ok_or_else(|| {
            FsError::Io(format!(
                "the server at {nic} does not serve RDMA clients (start it with --ib DEVICE)"
            ))
        })?;
        return Ok(Node::join_ib(&IbFabric { device: device.clone(), host }, options, credentials)?);
    }
    // A client made far away for a test must not take the shortcut.
    if let (Transport::Auto, Some(name), true) = (transport, shm, options.added_rtt.is_zero()) {
        if citron_lock::rdma::shm::fabric_dir(name).exists() {
            match Node::join_shm_as(name, credentials.clone()) {
                Ok(node) => return Ok(node),
                Err(e) => log::warn!("shm fabric {name} present but unusable ({e}); using tcp"),
            }
        }
    }
    Ok(Node::join_tcp_as(nic, options, credentials)?)
}

/// The endpoints one thread uses: one to the meta-server's NIC (lock memory
/// and attribute slots) with the state its lock handles share, and one per
/// data server. Checked out of a pool for the duration of an operation.
///
/// # One identity per set
///
/// A set belongs to the identity the client's nodes proved when it was
/// made ([`Identity::nic_version`](super::identity::Identity)): its
/// connections were opened under it, and an operation that checked the set
/// out runs under it. A client that registers anew must not carry such an
/// operation on under its new identity: in a cluster without keys a NIC
/// would let the new session write where the old one, fenced, may not
/// (and with keys, the new one holds other grants). So a set of an older
/// identity is dropped at checkout, and a data server's endpoint opened
/// during an operation, and every batch of data verbs, first checks that
/// the identity is still the set's. Ordering:
/// the version is read before any connection of the set is opened, and
/// checked after; a connection that proved the new identity was opened
/// after the identity changed, so the check after it sees the change.
pub(super) struct Endpoints {
    pub(super) meta: Endpoint,
    pub(super) locks: citron_lock::lock_host::LockContext,
    pub(super) data: HashMap<DataServerId, Endpoint>,
    /// The identity version the set was made under.
    identity: u64,
}

impl Endpoints {
    pub(super) fn new(meta: Endpoint, identity: u64) -> Self {
        let locks = citron_lock::lock_host::LockContext::new(&meta);
        Self { meta, locks, data: HashMap::new(), identity }
    }
}

impl FsClient {
    /// Joins data server `info` at the addresses it gives (its NIC and ib
    /// channel as this client reaches them, its shm fabric).
    fn join_data_server(&self, info: &DataServerInfo) -> Result<Node, FsError> {
        let meta = self.shared.rpc.server();
        let addrs = ServerAddrs {
            nic: reachable(info.nic, meta),
            shm: info.shm.as_deref(),
            ib: info.ib.map(|a| reachable(a, meta)),
        };
        join_server(
            addrs,
            self.transport,
            self.ib_device.as_ref(),
            self.tcp_options,
            self.shared.identity.node_credentials(),
        )
    }

    pub(super) fn add_data_servers(&self, servers: Vec<DataServerInfo>) -> Result<(), FsError> {
        let mut nodes = self.data_nodes.write();
        for info in servers {
            if nodes.contains_key(&info.id) {
                continue;
            }
            let node = self.join_data_server(&info)?;
            nodes.insert(info.id, (info, node));
        }
        Ok(())
    }

    /// [`FsClient::with_endpoints`] for a call through an open of this
    /// client, `pin`: fails with [`FsError::Fenced`] unless the open's
    /// registration is still the client's once the endpoints are taken.
    ///
    /// Why: the heartbeat thread may register anew (after a fence, with the
    /// open's lock memory given to another file) between the pin and the
    /// endpoints, which would then be of the new identity and pass every
    /// identity check of the call. The heartbeat sets `fenced` before it
    /// changes the identity, and clears it only after the registration
    /// count moved (all `SeqCst`); the endpoints' identity is read before
    /// this check. So if they are of the new identity, the check sees
    /// `fenced` or the new count; if of the old one, the identity check
    /// before each batch of data verbs fails once it changes.
    pub(super) fn with_pinned_endpoints<R>(
        &self,
        pin: &Pinned,
        f: impl FnOnce(&mut Endpoints) -> Result<R, FsError>,
    ) -> Result<R, FsError> {
        self.with_endpoints(|eps| {
            if self.shared.fenced() || self.shared.registration.load(Ordering::SeqCst) != pin.registration {
                return Err(FsError::Fenced);
            }
            f(eps)
        })
    }

    pub(super) fn with_endpoints<R>(
        &self,
        f: impl FnOnce(&mut Endpoints) -> Result<R, FsError>,
    ) -> Result<R, FsError> {
        // Lock memory is the meta-server's: while it is away (restarting),
        // verbs on it wait as calls do.
        self.shared.wait_while_away(Instant::now())?;
        if self.shared.fenced() {
            return Err(FsError::Io(
                "this client's lease expired; it is fenced until it re-registers".into(),
            ));
        }
        let identity = self.shared.identity.nic_version();
        let pooled = self.pool.lock().pop();
        let mut eps = match pooled {
            Some(e) if e.identity == identity => e,
            stale => {
                if let Some(old) = stale {
                    // Of an earlier registration: its connections prove an
                    // identity that is gone.
                    self.retire(&old);
                }
                let fresh = Endpoints::new(self.meta_node.endpoint()?, identity);
                // Its connection was opened after `identity` was read.
                self.same_identity(identity)?;
                fresh
            }
        };
        let result = f(&mut eps);
        // Expected errors (a refused lock, a missing file) leave the
        // endpoints as they were: keep them, so refusals open no connection
        // and use up no id. Only a failure may have broken them.
        if !result.as_ref().is_err_and(FsError::may_break_endpoints) {
            self.pool.lock().push(eps);
        } else {
            self.retire(&eps);
        }
        result
    }

    /// Keeps the verb counts of a set that is dropped.
    fn retire(&self, eps: &Endpoints) {
        let mut c = eps.meta.counts();
        for e in eps.data.values() {
            c += e.counts();
        }
        *self.retired_counts.lock() += c;
    }

    /// Fails with [`FsError::Fenced`] if the client's identity is no longer
    /// `identity`, the one a set of endpoints was made under (see
    /// [`Endpoints`]).
    fn same_identity(&self, identity: u64) -> Result<(), FsError> {
        if self.shared.identity.nic_version() == identity {
            Ok(())
        } else {
            Err(FsError::Fenced)
        }
    }

    /// Runs one batch per data server; `verbs` are tagged with their server.
    ///
    /// Under a range hold whose lease runs out at `until` (the holder bound H, see
    /// [`fence_delay_for`](crate::locks::guard::fence_delay_for)): before
    /// each batch, one clock read; a batch that would go out after `until`
    /// is not posted, nor any after it, and the answer is `None` (the
    /// caller releases and does the operation again). With `until`,
    /// `stop_point` is where the stalled-mount tests may stop the process:
    /// after the check, just before the batch.
    pub(super) fn execute_grouped(
        &self,
        eps: &mut Endpoints,
        verbs: Vec<(DataServerId, Verb, usize)>,
        until: Option<Instant>,
        stop_point: Option<super::stop_hook::Holding>,
    ) -> Result<Option<Vec<(usize, VerbReply)>>, FsError> {
        self.post_grouped(eps, verbs, until, stop_point, |ep, verbs| ep.execute(verbs))
    }

    /// [`FsClient::execute_grouped`] of writes whose bytes stay in the
    /// caller's buffer ([`Endpoint::write_slices`]: not copied into verbs
    /// on shm). Each answer is [`VerbReply::Written`].
    pub(super) fn write_grouped(
        &self,
        eps: &mut Endpoints,
        writes: Vec<(DataServerId, DataWrite<'_>, usize)>,
        until: Option<Instant>,
        stop_point: Option<super::stop_hook::Holding>,
    ) -> Result<Option<Vec<(usize, VerbReply)>>, FsError> {
        self.post_grouped(eps, writes, until, stop_point, |ep, writes| {
            let written = ep.write_slices(writes)?;
            Ok(written.into_iter().map(|w| w.map(|()| VerbReply::Written)).collect())
        })
    }

    /// The batching, lease check and identity check of
    /// [`FsClient::execute_grouped`], for any kind of item `post` sends as
    /// one batch to one data server's endpoint.
    fn post_grouped<T>(
        &self,
        eps: &mut Endpoints,
        items: Vec<(DataServerId, T, usize)>,
        until: Option<Instant>,
        stop_point: Option<super::stop_hook::Holding>,
        post: impl Fn(&Endpoint, &[T]) -> Result<Vec<Result<VerbReply, VerbError>>, TransportError>,
    ) -> Result<Option<Vec<(usize, VerbReply)>>, FsError> {
        let mut by_server: HashMap<DataServerId, (Vec<T>, Vec<usize>)> = HashMap::new();
        for (s, item, tag) in items {
            let e = by_server.entry(s).or_insert_with(|| (Vec::new(), Vec::new()));
            e.0.push(item);
            e.1.push(tag);
        }
        let mut out = Vec::new();
        let identity = eps.identity;
        for (server, (batch, tags)) in by_server {
            let ep = match eps.data.entry(server) {
                std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::hash_map::Entry::Vacant(e) => e.insert(self.data_endpoint(server)?),
            };
            if let Some(until) = until {
                if Instant::now() >= until {
                    return Ok(None);
                }
                if let Some(point) = stop_point {
                    super::stop_hook::holding(point);
                }
            }
            // Last, after the endpoint's connection was opened and any stop
            // point, right before its verbs.
            self.same_identity(identity)?;
            let replies = match post(ep, &batch) {
                Ok(replies) => replies,
                Err(e) => {
                    eps.data.remove(&server);
                    return Err(data_transport_error(server, e));
                }
            };
            for (r, tag) in replies.into_iter().zip(tags) {
                out.push((tag, r.map_err(|e| data_verb_error(server, e))?));
            }
        }
        Ok(Some(out))
    }

    pub(super) fn data_endpoint(&self, server: DataServerId) -> Result<Endpoint, FsError> {
        let known = self.data_nodes.read().get(&server).map(|(_, node)| node.endpoint());
        if let Some(endpoint) = known {
            return endpoint.map_err(|e| data_transport_error(server, e));
        }
        // A data server that joined after us.
        match self.call(&MetaRequest::DataServers)? {
            MetaResponse::DataServers(list) => self.add_data_servers(list)?,
            other => return Err(unexpected(other)),
        }
        let nodes = self.data_nodes.read();
        let (_, node) =
            nodes.get(&server).ok_or_else(|| FsError::Io(format!("unknown data server {}", server.0)))?;
        node.endpoint().map_err(|e| data_transport_error(server, e))
    }

    /// Runs `op` until it is not stopped by a data server that does not
    /// answer, waiting for such a server to come back in between, all
    /// within the client's timeout (see the module header). `op` must hold
    /// nothing when it fails, and be harmless to do again.
    pub(super) fn riding_through<T>(&self, mut op: impl FnMut() -> Result<T, FsError>) -> Result<T, FsError> {
        let deadline = Instant::now() + self.timeout;
        let mut waits = 0u32;
        loop {
            match op() {
                // A fenced client's connections are cut by every NIC: that
                // is no data server going away, and nothing to wait for.
                Err(FsError::DataServerDown(server)) if self.shared.fenced() => {
                    return Err(FsError::Io(format!(
                        "data server {}: this client's lease expired; it is fenced until it re-registers",
                        server.0
                    )))
                }
                Err(FsError::DataServerDown(server)) => {
                    self.data_server_waits.fetch_add(1, Ordering::Relaxed);
                    log::warn!("data server {} does not answer; waiting for it", server.0);
                    if waits > 0 {
                        // It took a connection, yet the operation found it
                        // down again (its NIC serves before it has
                        // registered again): not a busy loop meanwhile.
                        let pause = Duration::from_millis(10 << waits.min(5));
                        std::thread::sleep(pause.min(deadline.saturating_duration_since(Instant::now())));
                    }
                    waits += 1;
                    if !self.await_data_server(server, deadline) {
                        return Err(FsError::Io(format!(
                            "data server {} did not answer within {:?}",
                            server.0, self.timeout
                        )));
                    }
                }
                other => return other,
            }
        }
    }

    /// Waits until data server `server` takes a connection again, at the
    /// address the meta-server has for it now, or until `deadline`;
    /// returns whether it did. The node it connected through replaces the
    /// old one.
    fn await_data_server(&self, server: DataServerId, deadline: Instant) -> bool {
        let mut pause = Duration::from_millis(20);
        loop {
            if self.shared.fenced() {
                return false;
            }
            match self.rejoin_data_server(server) {
                Ok(()) => {
                    log::info!("data server {} answers again", server.0);
                    return true;
                }
                Err(e) => log::debug!("data server {} still away: {e}", server.0),
            }
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            std::thread::sleep(pause.min(deadline - now));
            pause = (pause * 2).min(Duration::from_millis(500));
        }
    }

    /// Joins data server `server` anew, where the meta-server says it is,
    /// and checks that it takes a connection.
    fn rejoin_data_server(&self, server: DataServerId) -> Result<(), FsError> {
        let list = match self.call(&MetaRequest::DataServers)? {
            MetaResponse::DataServers(list) => list,
            other => return Err(unexpected(other)),
        };
        let info = list
            .into_iter()
            .find(|i| i.id == server)
            .ok_or_else(|| FsError::Io(format!("the meta-server knows no data server {}", server.0)))?;
        let node = self.join_data_server(&info)?;
        node.endpoint()?;
        self.data_nodes.write().insert(server, (info, node));
        Ok(())
    }

    /// How many times an operation of this client found a data server
    /// not answering and waited for it.
    pub fn data_server_waits(&self) -> u64 {
        self.data_server_waits.load(Ordering::Relaxed)
    }

    /// Verbs issued so far by this client's I/O and lock calls (pooled and
    /// retired endpoints; not the lock waiter thread's retries of blocked
    /// requests).
    pub fn verb_counts(&self) -> VerbCounts {
        let mut c = *self.retired_counts.lock();
        for eps in self.pool.lock().iter() {
            c += eps.meta.counts();
            for e in eps.data.values() {
                c += e.counts();
            }
        }
        c
    }
}

/// Bytes of the caller's buffer to write at an address of a data server
/// ([`FsClient::write_grouped`]).
pub(super) type DataWrite<'a> = (RemoteAddr, &'a [u8]);

/// A batch or a connection to data server `server` that failed in
/// transport: the server is down ([`FsError::DataServerDown`]) when the
/// connection broke, was refused or timed out; an error otherwise (a
/// refused handshake, a protocol violation).
fn data_transport_error(server: DataServerId, e: TransportError) -> FsError {
    match e {
        TransportError::Io(_) | TransportError::Disconnected | TransportError::Timeout(_) => {
            log::info!("data server {}: {e}", server.0);
            FsError::DataServerDown(server)
        }
        e => FsError::Io(format!("data server {}: {e}", server.0)),
    }
}

/// A data verb a data server refused: `ENOSPC` when its memory ran out
/// (its shm file system filled up under it), EIO otherwise.
fn data_verb_error(server: DataServerId, e: VerbError) -> FsError {
    match e {
        VerbError::NoMemory { .. } => {
            log::warn!("data server {}: {e}", server.0);
            FsError::NoSpace
        }
        e => FsError::Io(format!("data server {}: {e}", server.0)),
    }
}

impl Shared {
    /// A lock area whose lock servers (a hosted Citron tree's host, the RPC
    /// range server) listen on an unspecified address: reached at the IP we
    /// reach the meta-server at.
    pub(super) fn reachable_area(&self, mut area: LockArea) -> LockArea {
        let meta = self.rpc.server();
        area.range = match area.range {
            RangeLockSite::CitronHosted { tree, depth, spillover, host, instance, max_depth } => {
                RangeLockSite::CitronHosted {
                    tree,
                    depth,
                    spillover,
                    host: reachable(host, meta),
                    instance,
                    max_depth,
                }
            }
            RangeLockSite::Rpc { server, instance } => {
                RangeLockSite::Rpc { server: reachable(server, meta), instance }
            }
            other => other,
        };
        area
    }
}
