//! The client side of the `ib` backend: a node (device context, protection
//! domain, directory membership, two-sided messages) and its queue pairs,
//! one per endpoint, which execute planned batches ([`super::plan`]).

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::addr::IbFabric;
use super::emulate::{self, WordVerbs};
use super::ffi::{self, CompletionQueue, Context, LocalBuffer, ProtectionDomain, QpSizes, QueuePair};
use super::handshake::{
    self, HostRequest, HostResponse, PeerRequest, PeerResponse, QpAddress, PROTOCOL_VERSION,
};
use super::plan::{self, DoorbellCompletion, EmulatedOp, Limits, Progress, Step, WrOp};
use super::remote::{RemoteRegions, Target};
use crate::rdma::addr::{ClientAddr, NodeId, RegionId};
use crate::rdma::codec;
use crate::rdma::error::{TransportError, VerbError};
use crate::rdma::mailbox::{Envelope, MailboxRouter, Message, MAX_MESSAGE};
use crate::rdma::tcp::{NodeCredentials, RpcClient, RpcServer, RpcService, TcpOptions};
use crate::rdma::verb::{Verb, VerbReply};
use citron_rpc::auth::Credentials;

type HostClient = RpcClient<HostRequest, HostResponse>;

fn ib_err(what: impl std::fmt::Display) -> TransportError {
    TransportError::Ib(what.to_string())
}

fn host_call(client: &HostClient, request: &HostRequest) -> Result<HostResponse, TransportError> {
    let response = client.call(request)?;
    handshake::check_host_response(&response)
        .map_err(|e| ib_err(format!("host {}: {e}", client.server())))?;
    Ok(response)
}

/// A process's membership of an `ib` fabric.
pub(crate) struct IbNode {
    pub id: NodeId,
    pub fabric: IbFabric,
    pub options: TcpOptions,
    /// What this node proves: `host` to the fabric's host, `peers` to other
    /// nodes' message listeners; its own listener lets in whom `mailbox` does.
    credentials: NodeCredentials,
    pd: Arc<ProtectionDomain>,
    /// Keeps the directory entry (the host drops it when this connection ends).
    control: HostClient,
    messages: Messenger,
}

impl IbNode {
    pub fn join(
        fabric: &IbFabric,
        options: TcpOptions,
        credentials: NodeCredentials,
        router: Arc<MailboxRouter>,
    ) -> Result<Self, TransportError> {
        let ctx = Context::open(&fabric.device)?;
        if !ctx.atomics {
            return Err(ib_err(format!("RDMA device {} has no atomic verbs", fabric.device)));
        }
        let pd = ProtectionDomain::new(&ctx)?;
        // Our peers reach us on the address the host sees us from.
        let local_ip = TcpStream::connect_timeout(&fabric.host, options.connect_timeout)?.local_addr()?.ip();
        let messages = Messenger::start(&pd, SocketAddr::new(local_ip, 0), router, options, &credentials)?;
        let control =
            HostClient::new(fabric.host, options.reply_timeout).with_credentials(credentials.host.clone());
        let join = HostRequest::Join { version: PROTOCOL_VERSION, peer_listen: messages.listen_addr() };
        let id = match host_call(&control, &join)? {
            HostResponse::Joined(id) => id,
            other => return Err(TransportError::Protocol(format!("unexpected reply to join: {other:?}"))),
        };
        messages.set_id(id);
        Ok(Self { id, fabric: fabric.clone(), options, credentials, pd, control, messages })
    }

    pub fn qp(self: &Arc<Self>) -> Result<IbQp, TransportError> {
        IbQp::connect(self.clone())
    }

    pub fn send(&self, to: ClientAddr, message: Message) -> Result<(), TransportError> {
        if message.payload.len() > MAX_MESSAGE {
            return Err(TransportError::Protocol(format!(
                "message of {} bytes exceeds {MAX_MESSAGE}",
                message.payload.len()
            )));
        }
        let envelope = Envelope { to: to.mailbox, message };
        if to.node == self.id {
            self.messages.router.deliver(envelope);
            return Ok(());
        }
        self.messages.send(to, &envelope, &self.control, &self.pd)
    }

    pub fn list_regions(&self) -> Result<Vec<(RegionId, u64)>, TransportError> {
        match host_call(&self.control, &HostRequest::Regions)? {
            HostResponse::Regions(g) => Ok(RemoteRegions::new(g).list()),
            other => Err(TransportError::Protocol(format!("unexpected reply: {other:?}"))),
        }
    }
}

/// Work requests per doorbell and staging bytes of an endpoint's QP.
const SEND_DEPTH: u32 = 64;
const STAGING: usize = 256 << 10;
const MAX_INLINE: u32 = 64;
/// Polls of an empty CQ before the thread yields its core between polls.
const SPINS_BEFORE_YIELD: u32 = 2000;
/// How many "last seen" words an endpoint remembers as guesses for emulated
/// masked atomics.
const GUESSES: usize = 1024;

struct Connected {
    qp: QueuePair,
    cq: Arc<CompletionQueue>,
    staging: LocalBuffer,
}

/// One endpoint's queue pair to the host.
pub(crate) struct IbQp {
    node: Arc<IbNode>,
    /// The control connection that is this QP's lease on the host.
    control: HostClient,
    conn: RefCell<Option<Connected>>,
    regions: RefCell<RemoteRegions>,
    limits: Cell<Limits>,
    next_wr: Cell<u64>,
    guesses: RefCell<HashMap<Target, u64>>,
}

impl IbQp {
    fn connect(node: Arc<IbNode>) -> Result<Self, TransportError> {
        let control = HostClient::new(node.fabric.host, node.options.reply_timeout)
            .with_credentials(node.credentials.host.clone());
        let qp = Self {
            node,
            control,
            conn: RefCell::new(None),
            regions: RefCell::new(RemoteRegions::default()),
            limits: Cell::new(Limits {
                max_wrs: SEND_DEPTH as usize,
                staging: STAGING,
                max_inline: MAX_INLINE as usize,
            }),
            next_wr: Cell::new(1),
            guesses: RefCell::new(HashMap::new()),
        };
        qp.ensure_connected()?;
        Ok(qp)
    }

    fn ensure_connected(&self) -> Result<(), TransportError> {
        if self.conn.borrow().is_some() {
            return Ok(());
        }
        let pd = &self.node.pd;
        let cq = CompletionQueue::new(&pd.ctx, SEND_DEPTH * 2, false)?;
        let qp = QueuePair::new(pd, &cq, &cq, QpSizes { send: SEND_DEPTH, recv: 1, max_inline: MAX_INLINE })?;
        let staging = LocalBuffer::new(pd, STAGING)?;
        let hello = HostRequest::Connect { version: PROTOCOL_VERSION, qp: qp.address() };
        let (remote, grants) = match host_call(&self.control, &hello)? {
            HostResponse::Connected { qp, regions } => (qp, regions),
            other => return Err(TransportError::Protocol(format!("unexpected reply to connect: {other:?}"))),
        };
        qp.connect(&remote)?;
        // The device may grant less inline room than asked (or none).
        let mut limits = self.limits.get();
        limits.max_inline = qp.max_inline as usize;
        self.limits.set(limits);
        self.regions.borrow_mut().update(grants);
        *self.conn.borrow_mut() = Some(Connected { qp, cq, staging });
        Ok(())
    }

    /// After a failed completion or a timeout the QP is in an unknown state:
    /// drop it (the next call connects a new one).
    fn break_connection(&self) {
        *self.conn.borrow_mut() = None;
    }

    fn refresh_regions(&self) -> Result<(), TransportError> {
        match host_call(&self.control, &HostRequest::Regions)? {
            HostResponse::Regions(g) => {
                self.regions.borrow_mut().update(g);
                Ok(())
            }
            other => Err(TransportError::Protocol(format!("unexpected reply: {other:?}"))),
        }
    }

    /// Executes `verbs` in order; appends a result per verb to `out` and
    /// returns the round trips taken.
    pub fn execute(
        &self,
        verbs: &[Verb],
        out: &mut Vec<Result<VerbReply, VerbError>>,
    ) -> Result<u64, TransportError> {
        self.ensure_connected()?;
        let mut p = plan::plan(verbs, &self.regions.borrow(), self.limits.get());
        if p.refused.iter().any(|(_, e)| matches!(e, VerbError::UnknownRegion(_))) {
            // The host may have registered it since we connected.
            self.refresh_regions()?;
            p = plan::plan(verbs, &self.regions.borrow(), self.limits.get());
        }
        let mut results: Vec<Option<Result<VerbReply, VerbError>>> = vec![None; verbs.len()];
        let mut data: Vec<Option<Vec<u8>>> = verbs
            .iter()
            .map(|v| match v {
                Verb::Read { len, .. } => Some(vec![0u8; *len as usize]),
                _ => None,
            })
            .collect();
        for (i, e) in p.refused {
            results[i] = Some(Err(e));
        }
        let mut round_trips = 0;
        for step in &p.steps {
            round_trips += 1;
            match step {
                Step::Doorbell(wrs) => {
                    let r = self.ring(verbs, wrs);
                    if r.is_err() {
                        self.break_connection();
                    }
                    r?;
                    let conn = self.conn.borrow();
                    let staging = conn.as_ref().expect("connected").staging.bytes();
                    for w in wrs {
                        let at = w.staging_at;
                        match (w.op, &verbs[w.verb]) {
                            (WrOp::Read { data_at, len }, Verb::Read { .. }) => {
                                let (d, l) = (data_at as usize, len as usize);
                                data[w.verb].as_mut().expect("read buffer")[d..d + l]
                                    .copy_from_slice(&staging[at..at + l]);
                            }
                            (WrOp::Read { .. }, _) | (WrOp::Cas { .. }, _) | (WrOp::Faa { .. }, _) => {
                                let old =
                                    u64::from_ne_bytes(staging[at..at + 8].try_into().expect("8 bytes"));
                                self.guesses_note(w.remote, &w.op, old);
                                results[w.verb] = Some(Ok(VerbReply::Old(old)));
                            }
                            (WrOp::Write { .. }, _) => results[w.verb] = Some(Ok(VerbReply::Written)),
                        }
                    }
                }
                Step::Emulate { verb, remote, op } => {
                    let guess = self.guesses.borrow().get(remote).copied();
                    let mut words = QpWords { qp: self };
                    let r = match *op {
                        EmulatedOp::MaskedCas { cmp, cmp_mask, swap, swap_mask } => {
                            emulate::masked_cas(&mut words, *remote, guess, cmp, cmp_mask, swap, swap_mask)
                        }
                        EmulatedOp::MaskedFaa { add, boundary_mask } => {
                            emulate::masked_faa(&mut words, *remote, guess, add, boundary_mask)
                        }
                    };
                    let r = r.inspect_err(|_| self.break_connection())?;
                    // The step counted one already.
                    round_trips += r.round_trips().saturating_sub(1);
                    results[*verb] = Some(Ok(VerbReply::Old(r.old)));
                }
                Step::Host { verb } => {
                    match host_call(&self.control, &HostRequest::Execute(verbs[*verb].clone()))? {
                        HostResponse::Executed(r) => results[*verb] = Some(r),
                        other => {
                            return Err(TransportError::Protocol(format!("unexpected reply: {other:?}")))
                        }
                    }
                }
            }
        }
        for (i, r) in results.into_iter().enumerate() {
            out.push(match (r, data[i].take()) {
                (Some(r), _) => r,
                (None, Some(d)) => Ok(VerbReply::Data(d)),
                (None, None) => Err(VerbError::Malformed("verb not executed".into())),
            });
        }
        Ok(round_trips)
    }

    fn guesses_note(&self, at: Target, op: &WrOp, old: u64) {
        let mut g = self.guesses.borrow_mut();
        if g.len() >= GUESSES {
            g.clear();
        }
        let now = match *op {
            WrOp::Cas { expect, new } if old == expect => new,
            WrOp::Faa { add } => old.wrapping_add(add),
            _ => old,
        };
        g.insert(at, now);
    }

    /// Posts one doorbell and waits for its signalled completion.
    fn ring(&self, verbs: &[Verb], wrs: &[plan::WorkRequest]) -> Result<(), TransportError> {
        if self.conn.borrow().is_none() {
            return Err(TransportError::Disconnected);
        }
        let base = self.next_wr.get();
        self.next_wr.set(base + wrs.len() as u64);
        let done = DoorbellCompletion::new(base, wrs.len());
        let mut sges = Vec::with_capacity(wrs.len());
        let mut chain = Vec::with_capacity(wrs.len());
        // Copy non-inline write data into staging first (nothing is outstanding).
        {
            let mut conn_mut = self.conn.borrow_mut();
            let staging = conn_mut.as_mut().expect("connected").staging.bytes_mut();
            for w in wrs {
                // Only WRITEs look at their verb: the emulation's one-request
                // doorbells pass no verbs at all.
                if let WrOp::Write { data_at, len, inline: false } = w.op {
                    let Verb::Write { data, .. } = &verbs[w.verb] else {
                        unreachable!("a write WR of another verb")
                    };
                    let (d, l) = (data_at as usize, len as usize);
                    staging[w.staging_at..w.staging_at + l].copy_from_slice(&data[d..d + l]);
                }
            }
        }
        let conn_ref = self.conn.borrow();
        let conn = conn_ref.as_ref().expect("connected");
        let (saddr, lkey) = (conn.staging.addr(), conn.staging.lkey());
        for (i, w) in wrs.iter().enumerate() {
            let (addr, len) = match w.op {
                WrOp::Write { data_at, len, inline: true } => {
                    let Verb::Write { data, .. } = &verbs[w.verb] else {
                        unreachable!("a write WR of another verb")
                    };
                    (data[data_at as usize..].as_ptr() as u64, len)
                }
                WrOp::Write { len, .. } | WrOp::Read { len, .. } => (saddr + w.staging_at as u64, len),
                WrOp::Cas { .. } | WrOp::Faa { .. } => (saddr + w.staging_at as u64, 8),
            };
            sges.push(ffi::ibv_sge { addr, length: len, lkey });
            let mut wr = ffi::send_wr();
            wr.wr_id = done.wr_id(i);
            wr.num_sge = 1;
            let mut flags = ffi::ibv_send_flags(0);
            if w.fence {
                flags |= ffi::ibv_send_flags::IBV_SEND_FENCE;
            }
            if w.signaled {
                flags |= ffi::ibv_send_flags::IBV_SEND_SIGNALED;
            }
            match w.op {
                WrOp::Read { .. } => {
                    wr.opcode = ffi::ibv_wr_opcode::IBV_WR_RDMA_READ;
                    wr.wr.rdma = rdma_sys::rdma_t { remote_addr: w.remote.addr, rkey: w.remote.rkey };
                }
                WrOp::Write { inline, .. } => {
                    wr.opcode = ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE;
                    wr.wr.rdma = rdma_sys::rdma_t { remote_addr: w.remote.addr, rkey: w.remote.rkey };
                    if inline {
                        flags |= ffi::ibv_send_flags::IBV_SEND_INLINE;
                    }
                }
                WrOp::Cas { expect, new } => {
                    wr.opcode = ffi::ibv_wr_opcode::IBV_WR_ATOMIC_CMP_AND_SWP;
                    wr.wr.atomic = rdma_sys::atomic_t {
                        remote_addr: w.remote.addr,
                        compare_add: expect,
                        swap: new,
                        rkey: w.remote.rkey,
                    };
                }
                WrOp::Faa { add } => {
                    wr.opcode = ffi::ibv_wr_opcode::IBV_WR_ATOMIC_FETCH_AND_ADD;
                    wr.wr.atomic = rdma_sys::atomic_t {
                        remote_addr: w.remote.addr,
                        compare_add: add,
                        swap: 0,
                        rkey: w.remote.rkey,
                    };
                }
            }
            wr.send_flags = flags.0;
            chain.push(wr);
        }
        // Link the chain only now: `sges` and `chain` no longer move.
        for i in 0..chain.len() {
            chain[i].sg_list = &mut sges[i];
            chain[i].next =
                if i + 1 < chain.len() { &mut chain[i + 1] as *mut _ } else { std::ptr::null_mut() };
        }
        // SAFETY: the chain and its SGEs live until this function returns,
        // after the doorbell's completion (or its failure, after which the
        // QP is dropped). Local addresses are in the registered staging
        // buffer, which nobody touches until then (we hold a shared borrow
        // and are the only thread using this endpoint), or inline data
        // (copied by the post call itself).
        unsafe { conn.qp.post_send(chain.as_mut_ptr())? };
        self.wait(&conn.cq, &done)
    }

    fn wait(&self, cq: &CompletionQueue, done: &DoorbellCompletion) -> Result<(), TransportError> {
        let timeout = self.node.options.reply_timeout;
        let start = Instant::now();
        let mut polled = Vec::with_capacity(16);
        let mut spins = 0u32;
        loop {
            polled.clear();
            cq.poll(&mut polled, 16)?;
            for c in &polled {
                match done.on_completion(c.wr_id, c.status) {
                    Progress::Done => return Ok(()),
                    Progress::Failed { index, status } => {
                        return Err(ib_err(format!(
                            "work request {index} of a batch failed: {}",
                            ffi::status_text(status)
                        )))
                    }
                    Progress::Foreign => {}
                }
            }
            if polled.is_empty() {
                spins += 1;
                if spins > SPINS_BEFORE_YIELD {
                    if start.elapsed() > timeout {
                        return Err(TransportError::Timeout(timeout));
                    }
                    std::thread::yield_now();
                }
            }
        }
    }
}

/// The two primitive verbs of the emulation, as one-request doorbells.
struct QpWords<'a> {
    qp: &'a IbQp,
}

impl QpWords<'_> {
    fn one(&mut self, op: WrOp, at: Target) -> Result<u64, TransportError> {
        let wr = plan::WorkRequest { verb: 0, op, remote: at, staging_at: 0, fence: false, signaled: true };
        // The verb list only matters for writes; none here.
        self.qp.ring(&[], std::slice::from_ref(&wr))?;
        let conn = self.qp.conn.borrow();
        let s = conn.as_ref().expect("connected").staging.bytes();
        let old = u64::from_ne_bytes(s[0..8].try_into().expect("8 bytes"));
        self.qp.guesses_note(at, &op, old);
        Ok(old)
    }
}

impl WordVerbs for QpWords<'_> {
    type Addr = Target;
    type Error = TransportError;
    fn read_word(&mut self, at: Target) -> Result<u64, TransportError> {
        self.one(WrOp::Read { data_at: 0, len: 8 }, at)
    }
    fn cas_word(&mut self, at: Target, expect: u64, new: u64) -> Result<u64, TransportError> {
        self.one(WrOp::Cas { expect, new }, at)
    }
}

// ---- two-sided messages ----

/// Receive buffers posted per incoming message QP, and their size.
const RECV_BUFFERS: usize = 16;
const MESSAGE_BUFFER: usize = MAX_MESSAGE + 1024;

/// The receive side of one peer's message QP.
struct Inbound {
    qp: QueuePair,
    buffers: LocalBuffer,
}

/// The send side of a message QP to one peer.
struct Outbound {
    qp: QueuePair,
    cq: Arc<CompletionQueue>,
    buffer: LocalBuffer,
    next_wr: u64,
    /// Our lease on the peer's QP: the connection that asked for it.
    _control: RpcClient<PeerRequest, PeerResponse>,
}

struct MessengerShared {
    pd: Arc<ProtectionDomain>,
    recv_cq: Arc<CompletionQueue>,
    /// Incoming QPs by QP number, and which peer connection made each.
    inbound: Mutex<HashMap<u32, (SocketAddr, Inbound)>>,
    router: Arc<MailboxRouter>,
    id: Mutex<NodeId>,
}

impl RpcService for MessengerShared {
    type Request = PeerRequest;
    type Response = PeerResponse;

    fn handle(&self, request: PeerRequest, peer: SocketAddr) -> PeerResponse {
        if let Err(e) = handshake::check_peer_request(&request) {
            return PeerResponse::Refused(e);
        }
        let PeerRequest::Connect { qp: remote, from, .. } = request;
        match self.accept(&remote, peer) {
            Ok(qp) => {
                log::debug!("ib: message QP from node {} accepted", from.0);
                PeerResponse::Accepted { qp }
            }
            Err(e) => PeerResponse::Refused(handshake::HandshakeError::Refused(e.to_string())),
        }
    }

    fn malformed(&self, error: String) -> PeerResponse {
        PeerResponse::Refused(handshake::HandshakeError::Malformed(error))
    }

    fn disconnected(&self, peer: SocketAddr) {
        self.inbound.lock().retain(|_, (p, _)| *p != peer);
    }
}

impl MessengerShared {
    fn accept(&self, remote: &QpAddress, peer: SocketAddr) -> Result<QpAddress, TransportError> {
        let qp = QueuePair::new(
            &self.pd,
            &self.recv_cq,
            &self.recv_cq,
            QpSizes { send: 1, recv: RECV_BUFFERS as u32, max_inline: 0 },
        )?;
        let buffers = LocalBuffer::new(&self.pd, RECV_BUFFERS * MESSAGE_BUFFER)?;
        for i in 0..RECV_BUFFERS {
            // SAFETY: buffer `i` is inside `buffers`, which lives with the QP
            // in `inbound` and is only read after its receive completed.
            unsafe {
                qp.post_recv(
                    i as u64,
                    buffers.addr() + (i * MESSAGE_BUFFER) as u64,
                    MESSAGE_BUFFER as u32,
                    buffers.lkey(),
                )?
            };
        }
        qp.connect(remote)?;
        let address = qp.address();
        self.inbound.lock().insert(qp.qpn(), (peer, Inbound { qp, buffers }));
        Ok(address)
    }

    /// Takes what arrived, delivers it and reposts the buffers.
    fn drain(&self) -> Result<usize, TransportError> {
        let mut polled = Vec::with_capacity(16);
        self.recv_cq.poll(&mut polled, 16)?;
        let inbound = self.inbound.lock();
        for c in &polled {
            let Some((_, conn)) = inbound.get(&c.qp_num) else { continue };
            if c.status != 0 {
                log::warn!("ib: a message receive failed: {}", ffi::status_text(c.status));
                continue;
            }
            let i = c.wr_id as usize;
            let at = i * MESSAGE_BUFFER;
            let bytes = &conn.buffers.bytes()[at..at + (c.byte_len as usize).min(MESSAGE_BUFFER)];
            match codec::decode::<Envelope>(bytes) {
                Ok(env) => self.router.deliver(env),
                Err(e) => log::warn!("ib: dropping malformed message ({} bytes): {e}", bytes.len()),
            }
            // SAFETY: the buffer's message was copied out (decoded) above.
            if let Err(e) = unsafe {
                conn.qp.post_recv(
                    c.wr_id,
                    conn.buffers.addr() + at as u64,
                    MESSAGE_BUFFER as u32,
                    conn.buffers.lkey(),
                )
            } {
                log::warn!("ib: cannot repost a receive buffer: {e}");
            }
        }
        Ok(polled.len())
    }
}

struct Messenger {
    shared: Arc<MessengerShared>,
    server: RpcServer<Arc<MessengerShared>>,
    outbound: Mutex<HashMap<NodeId, Arc<Mutex<Outbound>>>>,
    router: Arc<MailboxRouter>,
    options: TcpOptions,
    /// What our message connections to other nodes prove.
    peers: Credentials,
    stopping: Arc<AtomicBool>,
}

impl Messenger {
    fn start(
        pd: &Arc<ProtectionDomain>,
        listen: SocketAddr,
        router: Arc<MailboxRouter>,
        options: TcpOptions,
        credentials: &NodeCredentials,
    ) -> Result<Self, TransportError> {
        // Room for every posted receive of 256 source nodes.
        let recv_cq = CompletionQueue::new(&pd.ctx, (256 * RECV_BUFFERS) as u32, true)?;
        let shared = Arc::new(MessengerShared {
            pd: pd.clone(),
            recv_cq,
            inbound: Mutex::new(HashMap::new()),
            router: router.clone(),
            id: Mutex::new(NodeId(0)),
        });
        let server = RpcServer::spawn_with(listen, shared.clone(), "ib-peer", credentials.mailbox.clone())?;
        let stopping = Arc::new(AtomicBool::new(false));
        {
            let shared = shared.clone();
            let stopping = stopping.clone();
            std::thread::Builder::new().name("ib-mbox".into()).spawn(move || {
                while !stopping.load(Ordering::Relaxed) {
                    match shared.drain() {
                        Ok(0) => {
                            // Arm, look once more (a completion that came
                            // before arming raises no event), then sleep on
                            // the channel (bounded, to see `stopping`).
                            let slept = shared.recv_cq.arm().and_then(|()| match shared.drain()? {
                                0 => shared.recv_cq.wait_armed(Duration::from_millis(100)),
                                _ => Ok(true),
                            });
                            if let Err(e) = slept {
                                log::warn!("ib: message receiver stops: {e}");
                                return;
                            }
                        }
                        Ok(_) => {}
                        Err(e) => {
                            log::warn!("ib: message receiver stops: {e}");
                            return;
                        }
                    }
                }
            })?;
        }
        Ok(Self {
            shared,
            server,
            outbound: Mutex::new(HashMap::new()),
            router,
            options,
            peers: credentials.peers.clone(),
            stopping,
        })
    }

    fn listen_addr(&self) -> SocketAddr {
        self.server.local_addr()
    }

    fn set_id(&self, id: NodeId) {
        *self.shared.id.lock() = id;
    }

    fn outbound(
        &self,
        to: NodeId,
        host: &HostClient,
        pd: &Arc<ProtectionDomain>,
    ) -> Result<Arc<Mutex<Outbound>>, TransportError> {
        if let Some(o) = self.outbound.lock().get(&to) {
            return Ok(o.clone());
        }
        let unknown =
            || TransportError::UnknownClient(ClientAddr { node: to, mailbox: crate::rdma::MailboxId(0) });
        let addr = match host_call(host, &HostRequest::Resolve(to))? {
            HostResponse::Resolved(Some(a)) => a,
            HostResponse::Resolved(None) => return Err(unknown()),
            other => return Err(TransportError::Protocol(format!("unexpected reply to resolve: {other:?}"))),
        };
        let cq = CompletionQueue::new(&pd.ctx, 64, false)?;
        let qp = QueuePair::new(pd, &cq, &cq, QpSizes { send: 16, recv: 1, max_inline: 0 })?;
        let buffer = LocalBuffer::new(pd, MESSAGE_BUFFER)?;
        let control = RpcClient::new(addr, self.options.reply_timeout).with_credentials(self.peers.clone());
        let me = *self.shared.id.lock();
        let remote = match control.call(&PeerRequest::Connect {
            version: PROTOCOL_VERSION,
            from: me,
            qp: qp.address(),
        })? {
            PeerResponse::Accepted { qp } => {
                qp.validate().map_err(|e| ib_err(format!("peer {}: {e}", to.0)))?;
                qp
            }
            PeerResponse::Refused(e) => {
                return Err(ib_err(format!("peer node {} refused a message QP: {e}", to.0)))
            }
        };
        qp.connect(&remote)?;
        let o = Arc::new(Mutex::new(Outbound { qp, cq, buffer, next_wr: 1, _control: control }));
        self.outbound.lock().insert(to, o.clone());
        Ok(o)
    }

    fn send(
        &self,
        to: ClientAddr,
        envelope: &Envelope,
        host: &HostClient,
        pd: &Arc<ProtectionDomain>,
    ) -> Result<(), TransportError> {
        let out = self.outbound(to.node, host, pd)?;
        let mut o = out.lock();
        let bytes = codec::encode(envelope);
        if bytes.len() > MESSAGE_BUFFER {
            return Err(TransportError::Protocol(format!("encoded message of {} bytes", bytes.len())));
        }
        o.buffer.bytes_mut()[..bytes.len()].copy_from_slice(&bytes);
        let wr_id = o.next_wr;
        o.next_wr += 1;
        let mut sge =
            ffi::ibv_sge { addr: o.buffer.addr(), length: bytes.len() as u32, lkey: o.buffer.lkey() };
        let mut wr = ffi::send_wr();
        wr.wr_id = wr_id;
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        wr.opcode = ffi::ibv_wr_opcode::IBV_WR_SEND;
        wr.send_flags = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
        // SAFETY: `wr` and `sge` live across the call; the buffer is
        // registered and not touched until the completion below (we hold
        // the peer's lock).
        let posted = unsafe { o.qp.post_send(&mut wr) };
        let result = posted.and_then(|()| {
            let done = DoorbellCompletion::new(wr_id, 1);
            let start = Instant::now();
            let mut polled = Vec::with_capacity(4);
            loop {
                polled.clear();
                o.cq.poll(&mut polled, 4)?;
                for c in &polled {
                    match done.on_completion(c.wr_id, c.status) {
                        Progress::Done => return Ok(()),
                        Progress::Failed { status, .. } => {
                            return Err(ib_err(format!(
                                "message to {to} failed: {}",
                                ffi::status_text(status)
                            )))
                        }
                        Progress::Foreign => {}
                    }
                }
                if start.elapsed() > self.options.reply_timeout {
                    return Err(TransportError::Timeout(self.options.reply_timeout));
                }
                std::thread::yield_now();
            }
        });
        if result.is_err() {
            drop(o);
            self.outbound.lock().remove(&to.node);
        }
        result
    }
}

impl Drop for Messenger {
    fn drop(&mut self) {
        self.stopping.store(true, Ordering::Relaxed);
        let _ = &self.router;
    }
}
