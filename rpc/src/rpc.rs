//! Framed request/response over tcp, shared by every server of the project:
//! the software NIC (`citron_lock::rdma::tcp::host`), the meta-server,
//! lock-host services.
//!
//! Frames are those of [`crate::frame`] with a bincode body. The server runs a
//! thread per connection, answers in arrival order, and flushes when no
//! further request is already buffered (so a pipelined burst costs one write
//! each way). A body that does not decode gets [`RpcService::malformed`]'s
//! answer under its sequence number and the connection goes on; an impossible
//! length or a stream ending inside a frame closes that connection only.
//! Nothing a client sends can panic the server.

use std::collections::HashMap;
use std::io::{BufReader, BufWriter, ErrorKind, Write};
use std::marker::PhantomData;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::Mutex;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::accept;
use crate::auth::{client_handshake, Authority, Credentials, Principal, Status};
use crate::codec;
use crate::error::RpcError;
use crate::frame::{self, FrameError};

/// How long a thread busy-polls its socket before blocking in `read`
/// (see [`frame::poll_readable`]), unless its service or client says
/// otherwise ([`RpcService::poll_budget`], [`RpcClient::with_poll_budget`]).
pub const POLL_BUDGET: Duration = Duration::from_micros(50);

/// Who sent a request: the connection's address, number and what its
/// handshake proved.
#[derive(Clone, Debug)]
pub struct Peer {
    pub addr: SocketAddr,
    pub principal: Principal,
    /// The connection's number, unique for the server's lifetime.
    pub connection: u64,
}

/// What a server does with requests.
pub trait RpcService: Send + Sync + 'static {
    type Request: DeserializeOwned;
    type Response: Serialize;
    /// Answers one request from `peer`.
    fn handle(&self, request: Self::Request, peer: SocketAddr) -> Self::Response;
    /// Answers one request from `peer`, for services that care who it is
    /// (the default asks [`RpcService::handle`]).
    fn handle_from(&self, request: Self::Request, peer: &Peer) -> Self::Response {
        self.handle(request, peer.addr)
    }
    /// The answer to a request that could not be decoded.
    fn malformed(&self, error: String) -> Self::Response;
    /// Whether a peer that proved `principal` may connect (the default:
    /// everyone the server's [`Authority`] lets in).
    fn admit(&self, _principal: &Principal) -> Result<(), Status> {
        Ok(())
    }
    /// Called once when a connection from `peer` ends, however it ends.
    fn disconnected(&self, _peer: SocketAddr) {}
    /// How long a connection's thread busy-polls for the next request after
    /// each answer before it blocks ([`frame::poll_readable`]). Worth it
    /// where one client sends request after request on one connection (a
    /// NIC's verbs: 6 µs against 66 µs a round trip on loopback); a waste
    /// of a core where requests spread over many connections.
    fn poll_budget(&self) -> Duration {
        POLL_BUDGET
    }
}

/// A service shared with other owners (the server holds one `Arc`, the
/// owner another, e.g. for a background thread).
impl<S: RpcService> RpcService for Arc<S> {
    type Request = S::Request;
    type Response = S::Response;
    fn handle(&self, request: Self::Request, peer: SocketAddr) -> Self::Response {
        (**self).handle(request, peer)
    }
    fn handle_from(&self, request: Self::Request, peer: &Peer) -> Self::Response {
        (**self).handle_from(request, peer)
    }
    fn malformed(&self, error: String) -> Self::Response {
        (**self).malformed(error)
    }
    fn admit(&self, principal: &Principal) -> Result<(), Status> {
        (**self).admit(principal)
    }
    fn disconnected(&self, peer: SocketAddr) {
        (**self).disconnected(peer)
    }
    fn poll_budget(&self) -> Duration {
        (**self).poll_budget()
    }
}

/// The open connections of a server, by number, with who each one is: a
/// handle the service may keep to cut connections (a fenced client's).
#[derive(Clone, Default)]
pub struct Connections(Arc<Mutex<HashMap<u64, (TcpStream, Principal)>>>);

impl Connections {
    /// Cuts every connection whose principal `cut` selects, as a crash
    /// would; returns how many.
    pub fn close_where(&self, cut: impl Fn(&Principal) -> bool) -> usize {
        let mut n = 0;
        for (stream, principal) in self.0.lock().values() {
            if cut(principal) {
                let _ = stream.shutdown(Shutdown::Both);
                n += 1;
            }
        }
        n
    }

    /// Connections open now.
    pub fn len(&self) -> usize {
        self.0.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Counters of a server.
#[derive(Debug, Default)]
pub struct ServerStats {
    pub connections: AtomicU64,
    pub requests: AtomicU64,
    pub refused_frames: AtomicU64,
    pub broken_connections: AtomicU64,
    /// Connections refused in the handshake (no key, wrong key, garbage,
    /// too many at once).
    pub refused_handshakes: AtomicU64,
}

struct Shared<S> {
    service: S,
    stopping: AtomicBool,
    open: Connections,
    stats: ServerStats,
}

/// A running server. Dropping it stops accepting and cuts every connection.
pub struct RpcServer<S: RpcService> {
    addr: SocketAddr,
    shared: Arc<Shared<S>>,
    acceptor: Option<JoinHandle<()>>,
}

impl<S: RpcService> RpcServer<S> {
    /// A server without keys ([`Authority::Open`]).
    pub fn spawn(listen: SocketAddr, service: S, name: &str) -> std::io::Result<Self> {
        Self::spawn_with(listen, service, name, Authority::Open)
    }

    /// A server that lets in whom `authority` does.
    pub fn spawn_with(
        listen: SocketAddr,
        service: S,
        name: &str,
        authority: Authority,
    ) -> std::io::Result<Self> {
        let listener = TcpListener::bind(listen)?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            service,
            stopping: AtomicBool::new(false),
            open: Connections::default(),
            stats: ServerStats::default(),
        });
        let acceptor = {
            let shared = shared.clone();
            let name = name.to_string();
            std::thread::Builder::new().name(format!("{name}-accept")).spawn(move || {
                accept::accept_connections(listener, &shared.stopping, &name, &authority, &shared)
            })?
        };
        Ok(Self { addr, shared, acceptor: Some(acceptor) })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn service(&self) -> &S {
        &self.shared.service
    }

    pub fn stats(&self) -> &ServerStats {
        &self.shared.stats
    }

    /// The open connections (to cut some of them).
    pub fn connections(&self) -> Connections {
        self.shared.open.clone()
    }

    /// Stops accepting and cuts every open connection, as a crash would.
    pub fn shutdown(&mut self) {
        if self.shared.stopping.swap(true, Ordering::SeqCst) {
            return;
        }
        // Wake the acceptor; it sees `stopping` and returns.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        if let Some(h) = self.acceptor.take() {
            let _ = h.join();
        }
        for (_, (s, _)) in self.shared.open.0.lock().drain() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

impl<S: RpcService> Drop for RpcServer<S> {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl<S: RpcService> accept::Accepting for Shared<S> {
    fn admit(&self, principal: &Principal) -> Result<(), Status> {
        self.service.admit(principal)
    }

    fn serve(&self, conn: u64, stream: TcpStream, principal: Principal) {
        let Ok(addr) = stream.peer_addr() else { return };
        if let Ok(clone) = stream.try_clone() {
            self.open.0.lock().insert(conn, (clone, principal.clone()));
        }
        self.stats.connections.fetch_add(1, Ordering::Relaxed);
        let peer = Peer { addr, principal, connection: conn };
        if let Err(e) = serve(stream, &peer, self) {
            self.stats.broken_connections.fetch_add(1, Ordering::Relaxed);
            log::debug!("connection {conn} from {addr} ended: {e}");
        }
        self.open.0.lock().remove(&conn);
        self.service.disconnected(addr);
    }

    fn refused(&self) {
        self.stats.refused_handshakes.fetch_add(1, Ordering::Relaxed);
    }
}

fn serve<S: RpcService>(stream: TcpStream, peer: &Peer, shared: &Shared<S>) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    let mut reader = BufReader::with_capacity(256 * 1024, stream.try_clone()?);
    let mut writer = BufWriter::with_capacity(256 * 1024, stream);
    let mut body = Vec::new();
    let mut out = Vec::new();
    let poll_budget = shared.service.poll_budget();
    loop {
        if reader.buffer().is_empty() {
            // Keep the thread on the CPU briefly: a pipelining client's next
            // request usually follows at once.
            frame::poll_readable(reader.get_ref(), poll_budget);
        }
        let seq = match frame::read_frame(&mut reader, &mut body) {
            Ok(seq) => seq,
            Err(FrameError::Closed) => return Ok(()),
            Err(FrameError::Io(e)) => return Err(e),
            Err(FrameError::BadLength(len)) => {
                shared.stats.refused_frames.fetch_add(1, Ordering::Relaxed);
                // The next frame boundary cannot be found: say why, hang up.
                out.clear();
                codec::encode_into(
                    &mut out,
                    &shared.service.malformed(format!("impossible frame length {len}")),
                );
                frame::write_frame(&mut writer, 0, &out)?;
                writer.flush()?;
                return Err(std::io::Error::other(format!("bad frame length {len}")));
            }
        };
        shared.stats.requests.fetch_add(1, Ordering::Relaxed);
        let response = match codec::decode::<S::Request>(&body) {
            Ok(request) => shared.service.handle_from(request, peer),
            Err(e) => {
                shared.stats.refused_frames.fetch_add(1, Ordering::Relaxed);
                shared.service.malformed(e)
            }
        };
        out.clear();
        codec::encode_into(&mut out, &response);
        frame::write_frame(&mut writer, seq, &out)?;
        if reader.buffer().is_empty() {
            writer.flush()?;
        }
    }
}

/// A client of an [`RpcServer`]: one request at a time per connection, with a
/// small pool of connections so several threads can call at once. A
/// connection that fails is dropped; the next call opens a new one.
pub struct RpcClient<Req, Resp> {
    server: SocketAddr,
    timeout: Duration,
    credentials: Credentials,
    idle: Mutex<Vec<Conn>>,
    next_seq: AtomicU64,
    /// How long a call busy-polls for its answer before it blocks.
    poll_budget: Duration,
    _types: PhantomData<fn(Req) -> Resp>,
}

struct Conn {
    reader: BufReader<TcpStream>,
    writer: BufWriter<TcpStream>,
    body: Vec<u8>,
    /// The version of the credentials its handshake proved.
    proved: u64,
}

impl<Req: Serialize, Resp: DeserializeOwned> RpcClient<Req, Resp> {
    /// A client of `server`; connects on first use. `timeout` bounds both
    /// connecting and waiting for an answer: an unreachable server is an
    /// error after it, never a hang.
    pub fn new(server: SocketAddr, timeout: Duration) -> Self {
        Self {
            server,
            timeout,
            credentials: Credentials::anonymous(),
            idle: Mutex::new(Vec::new()),
            next_seq: AtomicU64::new(1),
            poll_budget: POLL_BUDGET,
            _types: PhantomData,
        }
    }

    /// Calls busy-poll for their answer for `budget` before they block
    /// (zero: never; see [`RpcService::poll_budget`]).
    pub fn with_poll_budget(mut self, budget: Duration) -> Self {
        self.poll_budget = budget;
        self
    }

    /// Connections prove `credentials` in their handshake.
    pub fn with_credentials(mut self, credentials: Credentials) -> Self {
        self.credentials = credentials;
        self
    }

    pub fn credentials(&self) -> &Credentials {
        &self.credentials
    }

    /// Closes the idle connections: the next calls connect again (and
    /// prove the credentials as they are then).
    pub fn reset(&self) {
        self.idle.lock().clear();
    }

    pub fn server(&self) -> SocketAddr {
        self.server
    }

    /// Calls sent so far through this client (each one round trip; failed
    /// calls included).
    pub fn calls(&self) -> u64 {
        // `next_seq` starts at 1 and is taken once per call sent.
        self.next_seq.load(Ordering::Relaxed) - 1
    }

    fn connect(&self) -> Result<Conn, RpcError> {
        let mut stream =
            TcpStream::connect_timeout(&self.server, self.timeout).map_err(RpcError::Unreachable)?;
        stream.set_nodelay(true)?;
        stream.set_write_timeout(Some(self.timeout))?;
        let (credential, proved) = self.credentials.versioned();
        client_handshake(&mut stream, &credential, self.timeout).map_err(|e| {
            if e.is_timeout() {
                RpcError::Timeout(self.timeout)
            } else {
                e.into()
            }
        })?;
        stream.set_read_timeout(Some(self.timeout))?;
        Ok(Conn {
            reader: BufReader::with_capacity(64 * 1024, stream.try_clone()?),
            writer: BufWriter::with_capacity(64 * 1024, stream),
            body: Vec::new(),
            proved,
        })
    }

    /// Sends `request` and waits for its answer.
    pub fn call(&self, request: &Req) -> Result<Resp, RpcError> {
        self.call_waiting(request, None)
    }

    /// [`Self::call`] for a request the server may take longer than the
    /// timeout to answer because it waits for something else (a cache
    /// grant's holder, a lock): each time the timeout passes without an
    /// answer, `keep_waiting(waited)` says whether to wait another
    /// timeout (the caller knows the server is alive) or to give up with
    /// [`RpcError::Timeout`], as [`Self::call`] does at once.
    pub fn call_patiently(
        &self,
        request: &Req,
        keep_waiting: &mut dyn FnMut(Duration) -> bool,
    ) -> Result<Resp, RpcError> {
        self.call_waiting(request, Some(keep_waiting))
    }

    fn call_waiting(
        &self,
        request: &Req,
        keep_waiting: Option<&mut dyn FnMut(Duration) -> bool>,
    ) -> Result<Resp, RpcError> {
        // An idle connection the server closed meanwhile (it stopped, or
        // restarted) is dropped before anything is sent on it, so that a
        // request that finds the server gone fails as not sent.
        let pooled =
            std::iter::from_fn(|| self.idle.lock().pop()).find(|c| frame::idle_and_open(c.reader.get_ref()));
        let mut conn = match pooled {
            Some(c) => c,
            None => self.connect()?,
        };
        let result = self.call_on(&mut conn, request, keep_waiting);
        // A connection that proved replaced credentials is not reused.
        if result.is_ok() && conn.proved == self.credentials.version() {
            self.idle.lock().push(conn);
        }
        result
    }

    fn call_on(
        &self,
        conn: &mut Conn,
        request: &Req,
        keep_waiting: Option<&mut dyn FnMut(Duration) -> bool>,
    ) -> Result<Resp, RpcError> {
        let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
        frame::write_frame(&mut conn.writer, seq, &codec::encode(request))?;
        conn.writer.flush()?;
        if conn.reader.buffer().is_empty() && !frame::poll_readable(conn.reader.get_ref(), self.poll_budget) {
            if let Some(keep_waiting) = keep_waiting {
                // Wait for the answer's first byte a timeout at a time;
                // once it is there, the frame is read as usual.
                let sent = std::time::Instant::now();
                while !frame::wait_readable(conn.reader.get_ref(), self.timeout)? {
                    if !keep_waiting(sent.elapsed()) {
                        return Err(RpcError::Timeout(self.timeout));
                    }
                }
            }
        }
        let got = match frame::read_frame(&mut conn.reader, &mut conn.body) {
            Ok(s) => s,
            Err(FrameError::Closed) => return Err(RpcError::Disconnected),
            Err(FrameError::Io(e)) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return Err(RpcError::Timeout(self.timeout))
            }
            Err(FrameError::Io(e)) if e.kind() == ErrorKind::UnexpectedEof => {
                return Err(RpcError::Disconnected)
            }
            Err(FrameError::Io(e)) => return Err(RpcError::Io(e)),
            Err(FrameError::BadLength(n)) => return Err(RpcError::Protocol(format!("reply length {n}"))),
        };
        if got != seq {
            return Err(RpcError::Protocol(format!("reply {got} where {seq} was due")));
        }
        codec::decode(&conn.body).map_err(|e| RpcError::Protocol(format!("undecodable reply: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Answers each number after a nap longer than the clients' timeout.
    struct Slow(Duration);

    impl RpcService for Slow {
        type Request = u64;
        type Response = u64;
        fn handle(&self, request: u64, _peer: SocketAddr) -> u64 {
            std::thread::sleep(self.0);
            request + 1
        }
        fn malformed(&self, _error: String) -> u64 {
            0
        }
    }

    /// An answer later than the timeout fails a plain call, and a patient
    /// call waits for it as long as it is told to, asking once per timeout.
    #[test]
    fn a_patient_call_waits_past_the_timeout_while_told_to() {
        let (timeout, nap) = (Duration::from_millis(50), Duration::from_millis(400));
        let server = RpcServer::spawn("127.0.0.1:0".parse().unwrap(), Slow(nap), "slow").unwrap();
        let client: RpcClient<u64, u64> = RpcClient::new(server.local_addr(), timeout);
        assert!(matches!(client.call(&1), Err(RpcError::Timeout(_))), "a plain call waits one timeout");
        let mut asked = 0;
        let answer = client.call_patiently(&41, &mut |_| {
            asked += 1;
            true
        });
        assert_eq!(answer.unwrap(), 42);
        assert!(asked >= 1, "the answer came within the timeout, though the server napped {nap:?}");
        let refused = client.call_patiently(&1, &mut |_| false);
        assert!(matches!(refused, Err(RpcError::Timeout(_))), "told not to wait: {refused:?}");
    }
}
