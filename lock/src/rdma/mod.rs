//! The one-sided verbs layer (DESIGN.md §3).
//!
//! Registered memory lives on a host in regions ([`RegionMemory`]). A process
//! joins a fabric as a [`Node`] and opens [`Endpoint`]s (one per thread, like
//! an RDMA queue pair) that execute verbs on remote memory — `read`, `write`,
//! `cas`, `faa`, the masked forms of Citron §2.1 and the 16-byte extended forms
//! ShiftLock §3.1 needs — one at a time or in ordered batches, and exchange
//! two-sided messages with other endpoints.
//!
//! Backends, chosen at run time by [`FabricAddr`]:
//! * `shm:NAME` — processes on one host map the region files and execute verbs
//!   with CPU atomics ([`shm`]);
//! * `tcp:HOST:PORT` — a software NIC on the host applies verbs that arrive
//!   over tcp, in order, pipelined ([`tcp`]);
//! * `ib:DEVICE@HOST:PORT` — RC queue pairs on the RDMA device `DEVICE` of
//!   this machine, set up over the host's control channel ([`ib`]; cargo
//!   feature `rdma`).
//!
//! Ordering rule (as RDMA RC): verbs of one endpoint are executed in the order
//! they were posted, so no verb overtakes an earlier write or atomic. Both
//! backends are in fact stricter (every verb completes before the next
//! starts), which is allowed.
//!
//! Test mode: a region registered with [`RemoteAtomicity::NicOnly`] executes
//! remote read-modify-write verbs as a real RNIC does, atomic among verbs but
//! not with the host CPU's atomics ([`atomicity`]).
//!
//! Every endpoint counts what it issues ([`VerbCounts`]): verbs by kind, round
//! trips and messages. Verbs per operation is the figure of merit the
//! benchmarks report, because it does not drift with the machine.

pub mod addr;
pub mod arith;
pub mod atomicity;
pub mod codec;
pub mod error;
pub mod ib;
mod mailbox;
pub mod memory;
pub mod shm;
pub mod shm_owner;
pub mod tcp;
pub mod verb;

use std::cell::Cell;
use std::fmt;
use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;

pub use addr::{ClientAddr, MailboxId, NodeId, RegionId, RemoteAddr};
pub use atomicity::RemoteAtomicity;
pub use error::{RdmaError, TransportError, VerbError};
pub use ib::{IbDevice, IbFabric, IbHost};
pub use mailbox::{Message, MAX_MESSAGE};
pub use memory::{RegionMemory, RegionTable};
pub use shm::ShmHost;
pub use tcp::{NodeCredentials, TcpHost, TcpOptions};
pub use verb::{Verb, VerbCounts, VerbKind, VerbReply, MAX_TRANSFER};

#[cfg(feature = "rdma")]
use ib::node::{IbNode, IbQp};
use mailbox::MailboxRouter;
use shm::{ShmNode, ShmQp};
use tcp::client::{TcpNode, TcpQp, VerbRef};

/// Which fabric to join: `shm:NAME`, `tcp:HOST:PORT` or `ib:DEVICE@HOST:PORT`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FabricAddr {
    Shm(String),
    Tcp(SocketAddr),
    Ib(ib::IbFabric),
}

impl FromStr for FabricAddr {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if let Some(name) = s.strip_prefix("shm:") {
            if name.is_empty() || name.contains('/') {
                return Err(format!("bad shm fabric name {name:?}"));
            }
            Ok(FabricAddr::Shm(name.to_string()))
        } else if let Some(addr) = s.strip_prefix("tcp:") {
            use std::net::ToSocketAddrs;
            let addr = addr
                .to_socket_addrs()
                .map_err(|e| format!("bad tcp address {addr:?}: {e}"))?
                .next()
                .ok_or_else(|| format!("{addr:?} resolves to nothing"))?;
            Ok(FabricAddr::Tcp(addr))
        } else if let Some(ib) = s.strip_prefix("ib:") {
            Ok(FabricAddr::Ib(ib.parse()?))
        } else {
            Err(format!("fabric address {s:?} must start with shm:, tcp: or ib:"))
        }
    }
}

impl fmt::Display for FabricAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FabricAddr::Shm(n) => write!(f, "shm:{n}"),
            FabricAddr::Tcp(a) => write!(f, "tcp:{a}"),
            FabricAddr::Ib(i) => write!(f, "ib:{i}"),
        }
    }
}

enum NodeKind {
    Shm(Arc<ShmNode>),
    Tcp(Arc<TcpNode>),
    #[cfg(feature = "rdma")]
    Ib(Arc<IbNode>),
}

struct NodeInner {
    id: NodeId,
    router: Arc<MailboxRouter>,
    kind: NodeKind,
    credentials: NodeCredentials,
}

/// This process's membership of a fabric. Cheap to clone; endpoints keep it
/// alive.
#[derive(Clone)]
pub struct Node {
    inner: Arc<NodeInner>,
}

impl fmt::Debug for Node {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Node").field("id", &self.inner.id).finish()
    }
}

impl Node {
    pub fn join(fabric: &FabricAddr) -> Result<Node, TransportError> {
        match fabric {
            FabricAddr::Shm(name) => Self::join_shm(name),
            FabricAddr::Tcp(addr) => Self::join_tcp(*addr, TcpOptions::default()),
            FabricAddr::Ib(ib) => Self::join_ib(ib, TcpOptions::default(), NodeCredentials::default()),
        }
    }

    /// Joins an `ib` fabric: opens the device, joins the host's directory.
    /// `options` bound the control channel's waits and every completion wait.
    /// Its control channels prove `credentials` as tcp connections do.
    /// Without the `rdma` feature, an error that says so.
    pub fn join_ib(
        fabric: &ib::IbFabric,
        options: TcpOptions,
        credentials: NodeCredentials,
    ) -> Result<Node, TransportError> {
        #[cfg(feature = "rdma")]
        {
            let router = Arc::new(MailboxRouter::default());
            let node = Arc::new(IbNode::join(fabric, options, credentials.clone(), router.clone())?);
            Ok(Node {
                inner: Arc::new(NodeInner { id: node.id, router, kind: NodeKind::Ib(node), credentials }),
            })
        }
        #[cfg(not(feature = "rdma"))]
        {
            let _ = (options, credentials);
            Err(ib::no_backend(&fabric.device))
        }
    }

    pub fn join_shm(name: &str) -> Result<Node, TransportError> {
        Self::join_shm_as(name, NodeCredentials::default())
    }

    /// Joins a shm fabric (where nothing is checked: processes map the
    /// memory); `credentials` are what the node proves to the lock services
    /// it calls over tcp ([`Node::credentials`]).
    pub fn join_shm_as(name: &str, credentials: NodeCredentials) -> Result<Node, TransportError> {
        let router = Arc::new(MailboxRouter::default());
        let shm = Arc::new(ShmNode::join(name, router.clone())?);
        Ok(Node { inner: Arc::new(NodeInner { id: shm.id, router, kind: NodeKind::Shm(shm), credentials }) })
    }

    pub fn join_tcp(host: SocketAddr, options: TcpOptions) -> Result<Node, TransportError> {
        Self::join_tcp_as(host, options, NodeCredentials::default())
    }

    /// Joins the tcp fabric of the NIC at `host`, proving `credentials`.
    pub fn join_tcp_as(
        host: SocketAddr,
        options: TcpOptions,
        credentials: NodeCredentials,
    ) -> Result<Node, TransportError> {
        let router = Arc::new(MailboxRouter::default());
        let tcp = Arc::new(TcpNode::join(host, options, credentials.clone(), router.clone())?);
        Ok(Node { inner: Arc::new(NodeInner { id: tcp.id, router, kind: NodeKind::Tcp(tcp), credentials }) })
    }

    /// What this node proves to hosts, lock services and other nodes.
    pub fn credentials(&self) -> &NodeCredentials {
        &self.inner.credentials
    }

    pub fn id(&self) -> NodeId {
        self.inner.id
    }

    pub fn backend_name(&self) -> &'static str {
        match self.inner.kind {
            NodeKind::Shm(_) => "shm",
            NodeKind::Tcp(_) => "tcp",
            #[cfg(feature = "rdma")]
            NodeKind::Ib(_) => "ib",
        }
    }

    /// Opens a new endpoint (queue pair and mailbox) for one thread.
    pub fn endpoint(&self) -> Result<Endpoint, TransportError> {
        let qp = match &self.inner.kind {
            NodeKind::Shm(shm) => Qp::Shm(ShmQp::new(shm.clone())),
            NodeKind::Tcp(tcp) => {
                Qp::Tcp(TcpQp::connect(tcp.host, tcp.options, tcp.credentials.host.clone())?)
            }
            #[cfg(feature = "rdma")]
            NodeKind::Ib(ib) => Qp::Ib(ib.qp()?),
        };
        let (mailbox, inbox) = self.inner.router.open();
        Ok(Endpoint {
            qp,
            node: self.clone(),
            addr: ClientAddr { node: self.inner.id, mailbox },
            inbox,
            counts: Cell::new(VerbCounts::default()),
        })
    }
}

enum Qp {
    Shm(ShmQp),
    Tcp(TcpQp),
    #[cfg(feature = "rdma")]
    Ib(IbQp),
}

/// One thread's access to the fabric: a queue pair for verbs, a mailbox for
/// two-sided messages, and the counters of both.
///
/// `Send` but not `Sync`: like a queue pair, an endpoint belongs to one thread
/// at a time. Methods take `&self`, so a lock guard can borrow the endpoint
/// while the critical section keeps using it.
pub struct Endpoint {
    qp: Qp,
    node: Node,
    addr: ClientAddr,
    inbox: Receiver<Message>,
    counts: Cell<VerbCounts>,
}

impl fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Endpoint").field("addr", &self.addr).finish()
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.node.inner.router.close(self.addr.mailbox);
    }
}

/// Executes one verb on the backend: direct calls on shm, a round trip on tcp.
macro_rules! one_verb {
    ($self:ident, $kind:expr, |$mem:ident| $shm:expr, $verb:expr, $reply:ident => $extract:expr) => {{
        match &$self.qp {
            Qp::Shm(q) => {
                $self.count($kind, 1);
                Ok(q.with_region($verb.addr().region, |$mem| $shm)?)
            }
            Qp::Tcp(_) => {
                $self.count($kind, 0);
                match $self.execute_tcp_one(&$verb)? {
                    $reply => $extract,
                }
            }
            #[cfg(feature = "rdma")]
            Qp::Ib(_) => {
                $self.count($kind, 0);
                match $self.execute_ib_one(&$verb)? {
                    $reply => $extract,
                }
            }
        }
    }};
}

impl Endpoint {
    /// This endpoint's address for two-sided messages.
    pub fn addr(&self) -> ClientAddr {
        self.addr
    }

    pub fn node(&self) -> &Node {
        &self.node
    }

    /// What this endpoint has issued so far.
    pub fn counts(&self) -> VerbCounts {
        self.counts.get()
    }

    pub fn reset_counts(&self) {
        self.counts.set(VerbCounts::default());
    }

    #[inline]
    fn count(&self, kind: VerbKind, round_trips: u64) {
        let mut c = self.counts.get();
        c.by_kind[kind as usize] += 1;
        c.round_trips += round_trips;
        self.counts.set(c);
    }

    fn count_bytes(&self, read: u64, written: u64) {
        let mut c = self.counts.get();
        c.bytes_read += read;
        c.bytes_written += written;
        self.counts.set(c);
    }

    pub fn read(&self, addr: RemoteAddr, buf: &mut [u8]) -> Result<(), RdmaError> {
        self.count_bytes(buf.len() as u64, 0);
        let len = u32::try_from(buf.len())
            .map_err(|_| VerbError::TooLarge { len: buf.len() as u64, max: MAX_TRANSFER })?;
        one_verb!(self, VerbKind::Read, |m| m.read_into(addr, buf), Verb::Read { addr, len },
        reply => match reply {
            VerbReply::Data(d) if d.len() == buf.len() => { buf.copy_from_slice(&d); Ok(()) }
            other => Err(unexpected(other)),
        })
    }

    pub fn read_u64(&self, addr: RemoteAddr) -> Result<u64, RdmaError> {
        let mut b = [0u8; 8];
        self.read(addr, &mut b)?;
        Ok(u64::from_le_bytes(b))
    }

    pub fn read_u128(&self, addr: RemoteAddr) -> Result<u128, RdmaError> {
        let mut b = [0u8; 16];
        self.read(addr, &mut b)?;
        Ok(u128::from_le_bytes(b))
    }

    pub fn write(&self, addr: RemoteAddr, data: &[u8]) -> Result<(), RdmaError> {
        self.count_bytes(0, data.len() as u64);
        match &self.qp {
            Qp::Shm(q) => {
                self.count(VerbKind::Write, 1);
                Ok(q.with_region(addr.region, |m| m.write_from(addr, data))?)
            }
            // The bytes go from `data` straight into the frame.
            Qp::Tcp(q) => {
                self.count(VerbKind::Write, 0);
                let mut out = Vec::with_capacity(1);
                let trips = q.execute_refs(&[VerbRef::Write { addr, data }], &mut out)?;
                let mut c = self.counts.get();
                c.round_trips += trips;
                self.counts.set(c);
                match out.pop().ok_or_else(|| TransportError::Protocol("no reply".into()))?? {
                    VerbReply::Written => Ok(()),
                    other => Err(unexpected(other)),
                }
            }
            #[cfg(feature = "rdma")]
            Qp::Ib(_) => {
                self.count(VerbKind::Write, 0);
                let verb = Verb::Write { addr, data: data.to_vec() };
                match self.execute_ib_one(&verb)? {
                    VerbReply::Written => Ok(()),
                    other => Err(unexpected(other)),
                }
            }
        }
    }

    pub fn write_u64(&self, addr: RemoteAddr, value: u64) -> Result<(), RdmaError> {
        self.write(addr, &value.to_le_bytes())
    }

    /// Compare-and-swap; returns the old value (success iff it equals `expect`).
    pub fn cas(&self, addr: RemoteAddr, expect: u64, new: u64) -> Result<u64, RdmaError> {
        one_verb!(self, VerbKind::Cas, |m| m.cas(addr, expect, new), Verb::Cas { addr, expect, new },
            reply => old64(reply))
    }

    pub fn faa(&self, addr: RemoteAddr, add: u64) -> Result<u64, RdmaError> {
        one_verb!(self, VerbKind::Faa, |m| m.faa(addr, add), Verb::Faa { addr, add }, reply => old64(reply))
    }

    /// Masked compare-and-swap ([`arith::masked_cas_u64`]); returns the old value.
    pub fn masked_cas(
        &self,
        addr: RemoteAddr,
        cmp: u64,
        cmp_mask: u64,
        swap: u64,
        swap_mask: u64,
    ) -> Result<u64, RdmaError> {
        one_verb!(self, VerbKind::MaskedCas, |m| m.masked_cas(addr, cmp, cmp_mask, swap, swap_mask),
            Verb::MaskedCas { addr, cmp, cmp_mask, swap, swap_mask }, reply => old64(reply))
    }

    /// Masked fetch-and-add ([`arith::masked_faa_u64`]); returns the old value.
    pub fn masked_faa(&self, addr: RemoteAddr, add: u64, boundary_mask: u64) -> Result<u64, RdmaError> {
        one_verb!(self, VerbKind::MaskedFaa, |m| m.masked_faa(addr, add, boundary_mask),
            Verb::MaskedFaa { addr, add, boundary_mask }, reply => old64(reply))
    }

    /// 16-byte masked compare-and-swap; returns the old value.
    pub fn ext_cas(
        &self,
        addr: RemoteAddr,
        cmp: u128,
        cmp_mask: u128,
        swap: u128,
        swap_mask: u128,
    ) -> Result<u128, RdmaError> {
        one_verb!(self, VerbKind::ExtCas, |m| m.ext_cas(addr, cmp, cmp_mask, swap, swap_mask),
            Verb::ExtCas { addr, cmp, cmp_mask, swap, swap_mask }, reply => old128(reply))
    }

    /// 16-byte masked fetch-and-add; returns the old value.
    pub fn ext_faa(&self, addr: RemoteAddr, add: u128, boundary_mask: u128) -> Result<u128, RdmaError> {
        one_verb!(self, VerbKind::ExtFaa, |m| m.ext_faa(addr, add, boundary_mask),
            Verb::ExtFaa { addr, add, boundary_mask }, reply => old128(reply))
    }

    /// Makes `[addr, addr + len)` durable where the host keeps it
    /// ([`Verb::Flush`]).
    pub fn flush(&self, addr: RemoteAddr, len: u64) -> Result<(), RdmaError> {
        let verb = Verb::Flush { addr, len };
        match self.execute(std::slice::from_ref(&verb))?.pop() {
            Some(Ok(_)) => Ok(()),
            Some(Err(e)) => Err(e.into()),
            None => Err(RdmaError::Transport(TransportError::Protocol("no answer to a flush".into()))),
        }
    }

    fn execute_tcp_one(&self, verb: &Verb) -> Result<VerbReply, RdmaError> {
        let Qp::Tcp(q) = &self.qp else { unreachable!("tcp path on a shm endpoint") };
        let mut out = Vec::with_capacity(1);
        let trips = q.execute(std::slice::from_ref(verb), &mut out)?;
        let mut c = self.counts.get();
        c.round_trips += trips;
        self.counts.set(c);
        Ok(out.pop().ok_or_else(|| TransportError::Protocol("no reply".into()))??)
    }

    /// One verb on the ib queue pair; counts the round trips it took (more
    /// than one for an emulated masked atomic, see [`ib::emulate`]).
    #[cfg(feature = "rdma")]
    fn execute_ib_one(&self, verb: &Verb) -> Result<VerbReply, RdmaError> {
        let Qp::Ib(q) = &self.qp else { unreachable!("ib path on another endpoint") };
        let mut out = Vec::with_capacity(1);
        let trips = q.execute(std::slice::from_ref(verb), &mut out)?;
        let mut c = self.counts.get();
        c.round_trips += trips;
        self.counts.set(c);
        Ok(out.pop().ok_or_else(|| TransportError::Protocol("no reply".into()))??)
    }

    /// Starts a batch: verbs posted to it are executed in order with one wait.
    pub fn batch(&self) -> Batch<'_> {
        Batch { endpoint: self, verbs: Vec::new() }
    }

    /// Executes `verbs` in order with one wait (one round trip unless the
    /// replies exceed the transport's window). One result per verb.
    pub fn execute(&self, verbs: &[Verb]) -> Result<Vec<Result<VerbReply, VerbError>>, TransportError> {
        let mut out = Vec::with_capacity(verbs.len());
        if verbs.is_empty() {
            return Ok(out);
        }
        let mut c = self.counts.get();
        for v in verbs {
            c.by_kind[v.kind() as usize] += 1;
            match v {
                Verb::Read { len, .. } => c.bytes_read += u64::from(*len),
                Verb::Write { data, .. } => c.bytes_written += data.len() as u64,
                _ => {}
            }
        }
        match &self.qp {
            Qp::Shm(q) => {
                c.round_trips += 1;
                for v in verbs {
                    out.push(q.with_region(v.addr().region, |m| m.execute(v)));
                }
            }
            Qp::Tcp(q) => c.round_trips += q.execute(verbs, &mut out)?,
            #[cfg(feature = "rdma")]
            Qp::Ib(q) => c.round_trips += q.execute(verbs, &mut out)?,
        }
        self.counts.set(c);
        Ok(out)
    }

    /// Writes each `(addr, bytes)` of `writes`, in order, with one wait, as
    /// [`Endpoint::execute`] of [`Verb::Write`]s would, without first
    /// copying the bytes into verbs where the transport does not need them
    /// owned: on shm they go from the caller's buffer straight into the
    /// region (a file system's data path), on tcp straight into the frames;
    /// the ib path posts owned verbs. One result per write.
    pub fn write_slices(
        &self,
        writes: &[(RemoteAddr, &[u8])],
    ) -> Result<Vec<Result<(), VerbError>>, TransportError> {
        if let Qp::Tcp(q) = &self.qp {
            if writes.is_empty() {
                return Ok(Vec::new());
            }
            let refs: Vec<VerbRef<'_>> =
                writes.iter().map(|(addr, data)| VerbRef::Write { addr: *addr, data }).collect();
            let mut out = Vec::with_capacity(writes.len());
            let trips = q.execute_refs(&refs, &mut out)?;
            let mut c = self.counts.get();
            c.by_kind[VerbKind::Write as usize] += writes.len() as u64;
            c.bytes_written += writes.iter().map(|(_, d)| d.len() as u64).sum::<u64>();
            c.round_trips += trips;
            self.counts.set(c);
            return Ok(out.into_iter().map(written).collect());
        }
        let Qp::Shm(q) = &self.qp else {
            let verbs: Vec<Verb> =
                writes.iter().map(|(addr, data)| Verb::Write { addr: *addr, data: data.to_vec() }).collect();
            let replies = self.execute(&verbs)?;
            return Ok(replies.into_iter().map(written).collect());
        };
        if writes.is_empty() {
            return Ok(Vec::new());
        }
        let mut c = self.counts.get();
        c.by_kind[VerbKind::Write as usize] += writes.len() as u64;
        c.bytes_written += writes.iter().map(|(_, d)| d.len() as u64).sum::<u64>();
        c.round_trips += 1;
        self.counts.set(c);
        Ok(writes
            .iter()
            .map(|(addr, data)| q.with_region(addr.region, |m| m.write_from(*addr, data)))
            .collect())
    }

    /// Sends a two-sided message to another endpoint (or to this one).
    pub fn send(&self, to: ClientAddr, payload: &[u8]) -> Result<(), TransportError> {
        let mut c = self.counts.get();
        c.messages_sent += 1;
        self.counts.set(c);
        let message = Message { from: self.addr, payload: payload.to_vec() };
        match &self.node.inner.kind {
            NodeKind::Shm(shm) => {
                if to.node == self.addr.node {
                    self.node.inner.router.deliver(mailbox::Envelope { to: to.mailbox, message });
                    Ok(())
                } else {
                    shm.send(to, message)
                }
            }
            NodeKind::Tcp(tcp) => tcp.send(to, message),
            #[cfg(feature = "rdma")]
            NodeKind::Ib(ib) => ib.send(to, message),
        }
    }

    /// Waits up to `timeout` for a message to this endpoint.
    pub fn recv_timeout(&self, timeout: Duration) -> Option<Message> {
        // Not the channel's `recv_timeout(ZERO)` for "what has arrived": it
        // spins and yields the CPU a few times before it looks at its
        // deadline, which cost a releasing ShiftLock writer (`try_recv`)
        // microseconds per release.
        let m = if timeout.is_zero() {
            self.inbox.try_recv().ok()
        } else {
            self.inbox.recv_timeout(timeout).ok()
        };
        if m.is_some() {
            let mut c = self.counts.get();
            c.messages_received += 1;
            self.counts.set(c);
        }
        m
    }

    /// This endpoint's receive queue, for a thread that waits on it together
    /// with other channels (`crossbeam_channel::select!`). Messages taken
    /// from it directly are not counted in [`Endpoint::counts`]; call
    /// [`Endpoint::count_received`] for each.
    pub fn inbox(&self) -> &Receiver<Message> {
        &self.inbox
    }

    /// Counts a message taken through [`Endpoint::inbox`].
    pub fn count_received(&self) {
        let mut c = self.counts.get();
        c.messages_received += 1;
        self.counts.set(c);
    }

    pub fn try_recv(&self) -> Option<Message> {
        self.recv_timeout(Duration::ZERO)
    }

    /// The regions the host serves (tcp) or this node has mapped (shm).
    pub fn list_regions(&self) -> Result<Vec<(RegionId, u64)>, TransportError> {
        match &self.node.inner.kind {
            NodeKind::Tcp(tcp) => tcp.list_regions(),
            #[cfg(feature = "rdma")]
            NodeKind::Ib(ib) => ib.list_regions(),
            NodeKind::Shm(_) => {
                Err(TransportError::Shm("regions of a shm fabric are files; list its directory".into()))
            }
        }
    }

    /// Median round-trip time of `samples` 8-byte reads of `probe`: the unit
    /// from which the lock algorithms derive their timing parameters (Citron's
    /// T_wait, DSLR's ω, leases) instead of hard-coding the paper's 2 µs.
    pub fn measure_rtt(&self, probe: RemoteAddr, samples: usize) -> Result<Duration, RdmaError> {
        let mut times = Vec::with_capacity(samples.max(1));
        for _ in 0..samples.max(1) {
            let t = Instant::now();
            self.read_u64(probe)?;
            times.push(t.elapsed());
        }
        times.sort();
        Ok(times[times.len() / 2])
    }
}

/// A write's reply as [`Endpoint::write_slices`] answers it.
fn written(reply: Result<VerbReply, VerbError>) -> Result<(), VerbError> {
    match reply? {
        VerbReply::Written => Ok(()),
        other => Err(VerbError::Malformed(format!("a write answered {other:?}"))),
    }
}

fn unexpected(reply: VerbReply) -> RdmaError {
    RdmaError::Transport(TransportError::Protocol(format!("unexpected reply {reply:?}")))
}

fn old64(reply: VerbReply) -> Result<u64, RdmaError> {
    match reply {
        VerbReply::Old(v) => Ok(v),
        other => Err(unexpected(other)),
    }
}

fn old128(reply: VerbReply) -> Result<u128, RdmaError> {
    match reply {
        VerbReply::Old128(v) => Ok(v),
        other => Err(unexpected(other)),
    }
}

/// An ordered batch of verbs, submitted with one wait.
pub struct Batch<'a> {
    endpoint: &'a Endpoint,
    verbs: Vec<Verb>,
}

/// Index of a verb in a batch, to find its reply.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchSlot(usize);

impl Batch<'_> {
    pub fn push(&mut self, verb: Verb) -> BatchSlot {
        self.verbs.push(verb);
        BatchSlot(self.verbs.len() - 1)
    }

    pub fn len(&self) -> usize {
        self.verbs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.verbs.is_empty()
    }

    pub fn submit(self) -> Result<BatchReplies, TransportError> {
        Ok(BatchReplies(self.endpoint.execute(&self.verbs)?))
    }
}

/// The replies of a submitted batch.
#[derive(Debug)]
pub struct BatchReplies(Vec<Result<VerbReply, VerbError>>);

impl BatchReplies {
    pub fn get(&self, slot: BatchSlot) -> &Result<VerbReply, VerbError> {
        &self.0[slot.0]
    }

    /// The old value an 8-byte atomic in the batch returned.
    pub fn old(&self, slot: BatchSlot) -> Result<u64, RdmaError> {
        old64(self.get(slot).clone()?)
    }

    pub fn old128(&self, slot: BatchSlot) -> Result<u128, RdmaError> {
        old128(self.get(slot).clone()?)
    }

    /// The bytes a read in the batch returned.
    pub fn data(&self, slot: BatchSlot) -> Result<&[u8], RdmaError> {
        match self.get(slot) {
            Ok(VerbReply::Data(d)) => Ok(d),
            Ok(other) => Err(unexpected(other.clone())),
            Err(e) => Err(e.clone().into()),
        }
    }

    pub fn u64(&self, slot: BatchSlot) -> Result<u64, RdmaError> {
        let d = self.data(slot)?;
        let b: [u8; 8] =
            d.try_into().map_err(|_| TransportError::Protocol(format!("{}-byte read as u64", d.len())))?;
        Ok(u64::from_le_bytes(b))
    }

    /// The first failed verb's error, if any.
    pub fn first_error(&self) -> Option<&VerbError> {
        self.0.iter().find_map(|r| r.as_ref().err())
    }

    pub fn as_slice(&self) -> &[Result<VerbReply, VerbError>] {
        &self.0
    }

    pub fn into_vec(self) -> Vec<Result<VerbReply, VerbError>> {
        self.0
    }
}
