//! The client side of the tcp backend: queue pairs (one connection each) and
//! the node's mailbox listener and peer connections for two-sided messages.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::io::{BufReader, BufWriter, ErrorKind, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use citron_rpc::auth::{client_handshake, server_handshake, Authority, Credentials, HandshakeGate, Status};
use parking_lot::Mutex;
use serde::Serialize;

use super::wire::{self, FrameError, Response};
use crate::rdma::addr::{ClientAddr, NodeId, RegionId, RemoteAddr};
use crate::rdma::codec;
use crate::rdma::error::{TransportError, VerbError};
use crate::rdma::mailbox::{Envelope, MailboxRouter, Message, MAX_MESSAGE};
use crate::rdma::verb::{Verb, VerbReply};

/// Timeouts of the tcp backend.
#[derive(Clone, Copy, Debug)]
pub struct TcpOptions {
    /// How long to wait for a host to accept a connection.
    pub connect_timeout: Duration,
    /// How long to wait for a reply before declaring the host gone. A
    /// vanished host must give an error, never a hang.
    pub reply_timeout: Duration,
    /// **Test only**: time added to every round trip of this node's queue
    /// pairs (and half of it to every message it sends), as if the host were
    /// that much farther away. Zero (the default) adds nothing. The reply
    /// timeout is not extended.
    pub added_rtt: Duration,
}

impl Default for TcpOptions {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(3),
            reply_timeout: Duration::from_secs(10),
            added_rtt: Duration::ZERO,
        }
    }
}

impl TcpOptions {
    /// The defaults with these timeouts (no added delay).
    pub fn with_timeouts(connect_timeout: Duration, reply_timeout: Duration) -> Self {
        Self { connect_timeout, reply_timeout, ..Self::default() }
    }

    /// Sleeps `added_rtt × num / den` (the test-only distance), if any.
    fn travel(&self, num: u32, den: u32) {
        if !self.added_rtt.is_zero() {
            std::thread::sleep(self.added_rtt * num / den);
        }
    }
}

/// What a node proves, and to whom it listens: its queue pairs prove
/// `host` to hosts' NICs (and, through [`crate::rdma::Node::credentials`],
/// to the lock services it calls); its connections to other nodes'
/// mailboxes prove `peers`; its own mailbox listener lets in whom
/// `mailbox` does. The default is a cluster without keys.
#[derive(Clone, Debug, Default)]
pub struct NodeCredentials {
    pub host: Credentials,
    pub peers: Credentials,
    pub mailbox: Authority,
}

/// Replies of at most this many bytes may be outstanding while we are still
/// sending: far below a loopback socket's buffers, so the host can always
/// finish writing the replies we have not read yet and never blocks on us
/// while we block on it.
const REPLY_WINDOW: usize = 64 * 1024;

/// A request, borrowed: encodes exactly as [`wire::Request`] (same variants,
/// same order), so a large write is not copied to be sent.
#[derive(Serialize)]
pub(crate) enum RequestRef<'a> {
    Join { mailbox: SocketAddr },
    Resolve(NodeId),
    ListRegions,
    Verb(VerbRef<'a>),
}

/// A verb to send, borrowed: a [`Verb`], or a write whose bytes stay in the
/// caller's buffer until they are encoded (it encodes exactly as
/// [`Verb::Write`] of the same bytes).
#[derive(Clone, Copy, Debug)]
pub(crate) enum VerbRef<'a> {
    Verb(&'a Verb),
    Write { addr: RemoteAddr, data: &'a [u8] },
}

/// The position of [`Verb::Write`] among the variants of [`Verb`]: what
/// its encoding starts with.
const WRITE_VARIANT: u32 = 1;

/// Bytes that encode as one byte string (as [`crate::rdma::codec::bytes`]).
struct ByteString<'a>(&'a [u8]);

impl Serialize for ByteString<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_bytes(self.0)
    }
}

impl Serialize for VerbRef<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStructVariant;
        match self {
            VerbRef::Verb(v) => v.serialize(serializer),
            VerbRef::Write { addr, data } => {
                let mut v = serializer.serialize_struct_variant("Verb", WRITE_VARIANT, "Write", 2)?;
                v.serialize_field("addr", addr)?;
                v.serialize_field("data", &ByteString(data))?;
                v.end()
            }
        }
    }
}

impl VerbRef<'_> {
    /// Bytes of reply the host will send for this verb, at most.
    fn expected_reply_bytes(&self) -> usize {
        match self {
            VerbRef::Verb(v) => expected_reply_bytes(v),
            VerbRef::Write { .. } => SMALL_REPLY_BYTES,
        }
    }
}

struct Conn {
    reader: BufReader<TcpStream>,
    writer: BufWriter<TcpStream>,
    body: Vec<u8>,
    out: Vec<u8>,
}

/// One connection to the host: the tcp backend's queue pair. Verbs on it are
/// executed by the host in the order they were sent.
pub(crate) struct TcpQp {
    host: SocketAddr,
    options: TcpOptions,
    credentials: Credentials,
    conn: RefCell<Option<Conn>>,
    next_seq: Cell<u64>,
}

impl TcpQp {
    pub fn connect(
        host: SocketAddr,
        options: TcpOptions,
        credentials: Credentials,
    ) -> Result<Self, TransportError> {
        let qp = Self { host, options, credentials, conn: RefCell::new(None), next_seq: Cell::new(1) };
        qp.ensure_connected()?;
        Ok(qp)
    }

    /// Our address as the host sees it: where peers can reach this machine.
    pub fn local_ip(&self) -> Result<std::net::IpAddr, TransportError> {
        self.ensure_connected()?;
        let conn = self.conn.borrow();
        let conn = conn.as_ref().ok_or(TransportError::Disconnected)?;
        Ok(conn.writer.get_ref().local_addr()?.ip())
    }

    fn ensure_connected(&self) -> Result<(), TransportError> {
        if self.conn.borrow().is_some() {
            return Ok(());
        }
        let mut stream = TcpStream::connect_timeout(&self.host, self.options.connect_timeout)?;
        stream.set_nodelay(true)?;
        stream.set_write_timeout(Some(self.options.reply_timeout))?;
        client_handshake(&mut stream, &self.credentials.get(), self.options.reply_timeout).map_err(|e| {
            if e.is_timeout() {
                TransportError::Timeout(self.options.reply_timeout)
            } else {
                e.into()
            }
        })?;
        stream.set_read_timeout(Some(self.options.reply_timeout))?;
        let reader = BufReader::with_capacity(256 * 1024, stream.try_clone()?);
        let writer = BufWriter::with_capacity(256 * 1024, stream);
        *self.conn.borrow_mut() = Some(Conn { reader, writer, body: Vec::new(), out: Vec::new() });
        Ok(())
    }

    /// Runs `f` on the connection; any transport failure drops the
    /// connection (its stream position is unknown), and the next call
    /// reconnects.
    fn with_conn<R>(
        &self,
        f: impl FnOnce(&mut Conn, &Cell<u64>) -> Result<R, TransportError>,
    ) -> Result<R, TransportError> {
        self.ensure_connected()?;
        let mut slot = self.conn.borrow_mut();
        let conn = slot.as_mut().ok_or(TransportError::Disconnected)?;
        let result = f(conn, &self.next_seq);
        if result.is_err() {
            *slot = None;
        }
        result
    }

    /// Sends one request and waits for its response.
    pub fn request(&self, request: &RequestRef<'_>) -> Result<Response, TransportError> {
        let timeout = self.options.reply_timeout;
        self.with_conn(|conn, seq| {
            let s = send(conn, seq, request)?;
            self.options.travel(1, 1);
            conn.writer.flush()?;
            receive(conn, s, timeout)
        })
    }

    /// Executes `verbs` in order, pipelined, and appends one result per verb
    /// to `out`. Returns the number of round trips it took (more than one only
    /// when the replies would not fit the reply window).
    pub fn execute(
        &self,
        verbs: &[Verb],
        out: &mut Vec<Result<VerbReply, VerbError>>,
    ) -> Result<u64, TransportError> {
        let refs: Vec<VerbRef<'_>> = verbs.iter().map(VerbRef::Verb).collect();
        self.execute_refs(&refs, out)
    }

    /// [`TcpQp::execute`] of borrowed verbs: the bytes of a write go from
    /// the caller's buffer straight into the frame.
    pub fn execute_refs(
        &self,
        verbs: &[VerbRef<'_>],
        out: &mut Vec<Result<VerbReply, VerbError>>,
    ) -> Result<u64, TransportError> {
        let timeout = self.options.reply_timeout;
        self.with_conn(|conn, seq| {
            let mut round_trips = 0;
            let mut in_flight: Vec<u64> = Vec::with_capacity(verbs.len());
            let mut window = 0usize;
            for verb in verbs {
                let reply_bytes = verb.expected_reply_bytes();
                if !in_flight.is_empty() && window + reply_bytes > REPLY_WINDOW {
                    self.options.travel(1, 1);
                    conn.writer.flush()?;
                    drain(conn, &mut in_flight, out, timeout)?;
                    round_trips += 1;
                    window = 0;
                }
                in_flight.push(send(conn, seq, &RequestRef::Verb(*verb))?);
                window += reply_bytes;
            }
            if !in_flight.is_empty() {
                self.options.travel(1, 1);
                conn.writer.flush()?;
                drain(conn, &mut in_flight, out, timeout)?;
                round_trips += 1;
            }
            Ok(round_trips)
        })
    }
}

/// Bytes of the reply to a verb that answers no data, at most (framing
/// included).
const SMALL_REPLY_BYTES: usize = 48;

/// Bytes of framing around the data a read answers.
const DATA_REPLY_OVERHEAD: usize = 32;

fn expected_reply_bytes(verb: &Verb) -> usize {
    match verb {
        Verb::Read { len, .. } => *len as usize + DATA_REPLY_OVERHEAD,
        _ => SMALL_REPLY_BYTES,
    }
}

fn send(conn: &mut Conn, seq: &Cell<u64>, request: &RequestRef<'_>) -> Result<u64, TransportError> {
    let s = seq.get();
    seq.set(s + 1);
    conn.out.clear();
    codec::encode_into(&mut conn.out, request);
    wire::write_frame(&mut conn.writer, s, &conn.out)?;
    Ok(s)
}

fn receive(conn: &mut Conn, expect_seq: u64, timeout: Duration) -> Result<Response, TransportError> {
    if conn.reader.buffer().is_empty() {
        wire::poll_readable(conn.reader.get_ref(), super::rpc::POLL_BUDGET);
    }
    let seq = match wire::read_frame(&mut conn.reader, &mut conn.body) {
        Ok(seq) => seq,
        Err(FrameError::Closed) => return Err(TransportError::Disconnected),
        Err(FrameError::Io(e)) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
            return Err(TransportError::Timeout(timeout))
        }
        Err(FrameError::Io(e)) if e.kind() == ErrorKind::UnexpectedEof => {
            return Err(TransportError::Disconnected)
        }
        Err(FrameError::Io(e)) => return Err(TransportError::Io(e)),
        Err(FrameError::BadLength(n)) => {
            return Err(TransportError::Protocol(format!("reply frame length {n}")))
        }
    };
    let response: Response =
        codec::decode(&conn.body).map_err(|e| TransportError::Protocol(format!("undecodable reply: {e}")))?;
    if seq != expect_seq {
        return Err(TransportError::Protocol(format!("reply {seq} where {expect_seq} was due")));
    }
    Ok(response)
}

fn drain(
    conn: &mut Conn,
    in_flight: &mut Vec<u64>,
    out: &mut Vec<Result<VerbReply, VerbError>>,
    timeout: Duration,
) -> Result<(), TransportError> {
    for s in in_flight.drain(..) {
        match receive(conn, s, timeout)? {
            Response::Verb(r) => out.push(r),
            Response::Refused(e) => out.push(Err(e)),
            other => return Err(TransportError::Protocol(format!("unexpected reply to a verb: {other:?}"))),
        }
    }
    Ok(())
}

/// A process's attachment to a tcp fabric.
pub(crate) struct TcpNode {
    pub id: NodeId,
    listen: SocketAddr,
    control: Mutex<TcpQp>,
    peers: Mutex<HashMap<NodeId, Arc<Mutex<TcpStream>>>>,
    router: Arc<MailboxRouter>,
    stopping: Arc<AtomicBool>,
    pub host: SocketAddr,
    pub options: TcpOptions,
    pub credentials: NodeCredentials,
}

impl TcpNode {
    pub fn join(
        host: SocketAddr,
        options: TcpOptions,
        credentials: NodeCredentials,
        router: Arc<MailboxRouter>,
    ) -> Result<Self, TransportError> {
        let control = TcpQp::connect(host, options, credentials.host.clone())?;
        let listener = TcpListener::bind(SocketAddr::new(control.local_ip()?, 0))?;
        let listen = listener.local_addr()?;
        let id = match control.request(&RequestRef::Join { mailbox: listen })? {
            Response::Joined(id) => id,
            other => return Err(TransportError::Protocol(format!("unexpected reply to join: {other:?}"))),
        };
        let stopping = Arc::new(AtomicBool::new(false));
        {
            let router = router.clone();
            let stopping = stopping.clone();
            let authority = credentials.mailbox.clone();
            std::thread::Builder::new()
                .name(format!("tcp-mbox-{}", id.0))
                .spawn(move || listen_loop(listener, router, stopping, authority))?;
        }
        Ok(Self {
            id,
            listen,
            control: Mutex::new(control),
            peers: Mutex::new(HashMap::new()),
            router,
            stopping,
            host,
            options,
            credentials,
        })
    }

    pub fn list_regions(&self) -> Result<Vec<(RegionId, u64)>, TransportError> {
        match self.control.lock().request(&RequestRef::ListRegions)? {
            Response::Regions(r) => Ok(r),
            other => Err(TransportError::Protocol(format!("unexpected reply: {other:?}"))),
        }
    }

    fn peer(&self, node: NodeId) -> Result<Arc<Mutex<TcpStream>>, TransportError> {
        if let Some(p) = self.peers.lock().get(&node) {
            return Ok(p.clone());
        }
        let addr = match self.control.lock().request(&RequestRef::Resolve(node))? {
            Response::Resolved(Some(addr)) => addr,
            Response::Resolved(None) => {
                return Err(TransportError::UnknownClient(ClientAddr {
                    node,
                    mailbox: crate::rdma::MailboxId(0),
                }))
            }
            other => return Err(TransportError::Protocol(format!("unexpected reply to resolve: {other:?}"))),
        };
        let mut stream = TcpStream::connect_timeout(&addr, self.options.connect_timeout)?;
        stream.set_nodelay(true)?;
        stream.set_write_timeout(Some(self.options.reply_timeout))?;
        client_handshake(&mut stream, &self.credentials.peers.get(), self.options.reply_timeout)?;
        let stream = Arc::new(Mutex::new(stream));
        self.peers.lock().insert(node, stream.clone());
        Ok(stream)
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
            self.router.deliver(envelope);
            return Ok(());
        }
        let body = codec::encode(&envelope);
        self.options.travel(1, 2);
        // One retry on a fresh connection: the peer may have restarted.
        for attempt in 0..2 {
            let peer = self.peer(to.node).map_err(|e| match e {
                TransportError::UnknownClient(_) => TransportError::UnknownClient(to),
                e => e,
            })?;
            let result = {
                let mut stream = peer.lock();
                let mut frame = Vec::with_capacity(body.len() + wire::HEADER_LEN);
                wire::write_frame(&mut frame, 0, &body)?;
                stream.write_all(&frame)
            };
            match result {
                Ok(()) => return Ok(()),
                Err(e) => {
                    self.peers.lock().remove(&to.node);
                    if attempt == 1 {
                        return Err(TransportError::Io(e));
                    }
                }
            }
        }
        unreachable!("the loop returns on its second attempt")
    }
}

impl Drop for TcpNode {
    fn drop(&mut self) {
        self.stopping.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect_timeout(&self.listen, Duration::from_millis(200));
    }
}

/// Accepts peers' message connections: each proves itself
/// ([`server_handshake`] under `authority`, at most
/// [`citron_rpc::auth::MAX_PENDING_HANDSHAKES`] at once), then its frames
/// are delivered to this node's mailboxes.
fn listen_loop(
    listener: TcpListener,
    router: Arc<MailboxRouter>,
    stopping: Arc<AtomicBool>,
    authority: Authority,
) {
    let gate = Arc::new(HandshakeGate::default());
    for stream in listener.incoming() {
        if stopping.load(Ordering::SeqCst) {
            return;
        }
        let Ok(mut stream) = stream else { continue };
        let peer = stream.peer_addr().map_or_else(|_| "an unknown peer".to_string(), |a| a.to_string());
        let Some(pass) = gate.enter() else {
            log::warn!("mailbox: refused connection from {peer}: {}", Status::Busy);
            continue;
        };
        let router = router.clone();
        let stopping = stopping.clone();
        let authority = authority.clone();
        let spawned = std::thread::Builder::new().name("tcp-mbox-peer".into()).spawn(move || {
            let proved = server_handshake(&mut stream, &authority, |_| Ok(()));
            drop(pass);
            if let Err(status) = proved {
                if status == Status::Broken {
                    log::info!("mailbox: refused connection from {peer}: {status}");
                } else {
                    log::warn!("mailbox: refused connection from {peer}: {status}");
                }
                return;
            }
            let mut reader = BufReader::new(stream);
            let mut body = Vec::new();
            while !stopping.load(Ordering::SeqCst) {
                match wire::read_frame(&mut reader, &mut body) {
                    Ok(_) => match codec::decode::<Envelope>(&body) {
                        Ok(env) => router.deliver(env),
                        Err(e) => log::warn!("dropping malformed message: {e}"),
                    },
                    Err(FrameError::Closed) => return,
                    Err(e) => {
                        log::debug!("peer message stream ended: {e:?}");
                        return;
                    }
                }
            }
        });
        if let Err(e) = spawned {
            log::warn!("cannot start a mailbox thread: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn borrowed_request_encodes_like_owned() {
        let verb = Verb::Write { addr: RemoteAddr::new(RegionId(3), 16), data: vec![1, 2, 3] };
        let owned = codec::encode(&wire::Request::Verb(verb.clone()));
        let borrowed = codec::encode(&RequestRef::Verb(VerbRef::Verb(&verb)));
        assert_eq!(owned, borrowed);
        let slice = VerbRef::Write { addr: RemoteAddr::new(RegionId(3), 16), data: &[1, 2, 3] };
        assert_eq!(
            owned,
            codec::encode(&RequestRef::Verb(slice)),
            "a borrowed write encodes as a Verb::Write"
        );
        let read = Verb::Read { addr: RemoteAddr::new(RegionId(3), 16), len: 9 };
        assert_eq!(
            codec::encode(&wire::Request::Verb(read.clone())),
            codec::encode(&RequestRef::Verb(VerbRef::Verb(&read)))
        );
        let mailbox: SocketAddr = "127.0.0.1:9".parse().unwrap();
        assert_eq!(
            codec::encode(&wire::Request::Join { mailbox }),
            codec::encode(&RequestRef::Join { mailbox })
        );
        assert_eq!(codec::encode(&wire::Request::ListRegions), codec::encode(&RequestRef::ListRegions));
        assert_eq!(
            codec::encode(&wire::Request::Resolve(NodeId(7))),
            codec::encode(&RequestRef::Resolve(NodeId(7)))
        );
    }
}
