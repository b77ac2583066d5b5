//! Multiplexed framed RPC: many calls in flight on one connection, each
//! answered whenever its service decides, from any thread, in any order.
//!
//! Same frames as [`crate::rpc`] (`[len][seq][bincode body]`, the sequence
//! number pairing a reply with its call), so an [`crate::rpc::RpcClient`]
//! that makes one call at a time can talk to a [`MuxServer`] too. What
//! differs:
//!
//! * The server gives each request to [`MuxService::handle`] with a [`Call`]
//!   that the service may answer at once or keep and answer later, e.g. when
//!   a lock is granted. A waiting call costs no thread: the connection's
//!   thread goes on reading requests, and whoever answers writes the reply
//!   (a connection's writer is shared behind a mutex; a write blocked by a
//!   client that reads nothing times out after [`WRITE_TIMEOUT`] and cuts
//!   that connection).
//! * The client ([`MuxClient`]) shares one connection among threads: each
//!   call registers its sequence number, a reader thread hands every reply
//!   to the call that waits for it, and a call can be waited for with a
//!   deadline and abandoned ([`PendingCall`]).
//!
//! Threads: the server runs one per connection and one acceptor; the client
//! one reader per connection. A body that does not decode gets
//! [`MuxService::malformed`]'s answer under its sequence number and the
//! connection goes on; an impossible length closes that connection only.

use std::collections::HashMap;
use std::io::{BufReader, BufWriter, Write};
use std::marker::PhantomData;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use parking_lot::Mutex;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::accept;
use crate::auth::{client_handshake, Authority, Credentials, Principal, Status};
use crate::codec;
use crate::error::RpcError;
use crate::frame::{self, FrameError};

/// How long a server thread may block writing one reply to a client that
/// does not read before the connection is cut.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

/// A connection's number, unique for the server's lifetime.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnectionId(pub u64);

/// The server's end of one client connection.
pub struct Connection {
    id: ConnectionId,
    peer: SocketAddr,
    /// Who the peer proved to be in the handshake.
    principal: Principal,
    /// For `shutdown` without waiting for the writer's lock.
    stream: TcpStream,
    writer: Mutex<BufWriter<TcpStream>>,
    closed: AtomicBool,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection").field("id", &self.id).field("peer", &self.peer).finish()
    }
}

impl Connection {
    pub fn id(&self) -> ConnectionId {
        self.id
    }

    pub fn peer(&self) -> SocketAddr {
        self.peer
    }

    pub fn principal(&self) -> &Principal {
        &self.principal
    }

    pub fn is_closed(&self) -> bool {
        // Acquire: pairs with the Release store in `close`; a thread that
        // sees the flag also sees what the closer did before.
        self.closed.load(Ordering::Acquire)
    }

    /// Cuts the connection, as a crash would: the client sees it closed,
    /// the connection's thread ends, and the service's `disconnected` runs.
    pub fn close(&self) {
        if !self.closed.swap(true, Ordering::AcqRel) {
            let _ = self.stream.shutdown(Shutdown::Both);
        }
    }

    /// Writes one reply; `false` if the connection is (now) closed.
    fn send<R: Serialize>(&self, seq: u64, response: &R) -> bool {
        if self.is_closed() {
            return false;
        }
        let body = codec::encode(response);
        let written = {
            let mut w = self.writer.lock();
            frame::write_frame(&mut *w, seq, &body).and_then(|()| w.flush())
        };
        if let Err(e) = written {
            log::debug!("connection {:?} to {}: reply {seq} not written: {e}", self.id, self.peer);
            self.close();
            return false;
        }
        true
    }
}

/// One request's right to an answer. Answer it at once or keep it; dropping
/// it unanswered leaves the caller waiting until its own timeout.
pub struct Call<R> {
    conn: Arc<Connection>,
    seq: u64,
    _reply: PhantomData<fn(R)>,
}

impl<R> std::fmt::Debug for Call<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Call").field("conn", &self.conn.id).field("seq", &self.seq).finish()
    }
}

impl<R: Serialize> Call<R> {
    /// The connection the request came on.
    pub fn connection(&self) -> &Arc<Connection> {
        &self.conn
    }

    /// Sends the answer; `false` if the caller's connection is gone.
    pub fn answer(self, response: R) -> bool {
        self.conn.send(self.seq, &response)
    }
}

/// What a multiplexed server does with requests.
pub trait MuxService: Send + Sync + 'static {
    type Request: DeserializeOwned;
    type Response: Serialize;
    /// Handles one request, on its connection's thread, in arrival order.
    /// Must not block for long: the connection's next requests wait.
    fn handle(&self, request: Self::Request, call: Call<Self::Response>);
    /// The answer to a request that could not be decoded.
    fn malformed(&self, error: String) -> Self::Response;
    /// Whether a peer that proved `principal` may connect (the default:
    /// everyone the server's [`Authority`] lets in).
    fn admit(&self, _principal: &Principal) -> Result<(), Status> {
        Ok(())
    }
    /// Called once when a connection ends, however it ends.
    fn disconnected(&self, _conn: &Arc<Connection>) {}
}

impl<S: MuxService> MuxService for Arc<S> {
    type Request = S::Request;
    type Response = S::Response;
    fn handle(&self, request: Self::Request, call: Call<Self::Response>) {
        (**self).handle(request, call)
    }
    fn malformed(&self, error: String) -> Self::Response {
        (**self).malformed(error)
    }
    fn admit(&self, principal: &Principal) -> Result<(), Status> {
        (**self).admit(principal)
    }
    fn disconnected(&self, conn: &Arc<Connection>) {
        (**self).disconnected(conn)
    }
}

struct Shared<S> {
    service: S,
    stopping: AtomicBool,
    open: Mutex<HashMap<ConnectionId, Arc<Connection>>>,
}

/// A running multiplexed server. Dropping it stops accepting and cuts every
/// connection.
pub struct MuxServer<S: MuxService> {
    addr: SocketAddr,
    shared: Arc<Shared<S>>,
    acceptor: Option<JoinHandle<()>>,
}

impl<S: MuxService> MuxServer<S> {
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
        let shared =
            Arc::new(Shared { service, stopping: AtomicBool::new(false), open: Mutex::new(HashMap::new()) });
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

    /// Connections open now.
    pub fn connections(&self) -> usize {
        self.shared.open.lock().len()
    }

    /// Stops accepting and cuts every open connection.
    pub fn shutdown(&mut self) {
        if self.shared.stopping.swap(true, Ordering::SeqCst) {
            return;
        }
        // Wake the acceptor; it sees `stopping` and returns.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        if let Some(h) = self.acceptor.take() {
            let _ = h.join();
        }
        let open: Vec<_> = self.shared.open.lock().values().cloned().collect();
        for c in open {
            c.close();
        }
    }
}

impl<S: MuxService> Drop for MuxServer<S> {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl<S: MuxService> accept::Accepting for Shared<S> {
    fn admit(&self, principal: &Principal) -> Result<(), Status> {
        self.service.admit(principal)
    }

    fn serve(&self, n: u64, stream: TcpStream, principal: Principal) {
        let (conn, reader) = match open_connection(stream, ConnectionId(n), principal) {
            Ok(c) => c,
            Err(e) => {
                log::warn!("cannot set up connection {n}: {e}");
                return;
            }
        };
        self.open.lock().insert(conn.id, conn.clone());
        if let Err(e) = serve(reader, &conn, self) {
            log::debug!("connection {:?} from {} ended: {e}", conn.id, conn.peer);
        }
        conn.close();
        self.open.lock().remove(&conn.id);
        self.service.disconnected(&conn);
    }
}

fn open_connection(
    stream: TcpStream,
    id: ConnectionId,
    principal: Principal,
) -> std::io::Result<(Arc<Connection>, TcpStream)> {
    stream.set_nodelay(true)?;
    stream.set_write_timeout(Some(WRITE_TIMEOUT))?;
    let peer = stream.peer_addr()?;
    let conn = Arc::new(Connection {
        id,
        peer,
        principal,
        stream: stream.try_clone()?,
        writer: Mutex::new(BufWriter::with_capacity(16 * 1024, stream.try_clone()?)),
        closed: AtomicBool::new(false),
    });
    Ok((conn, stream))
}

fn serve<S: MuxService>(
    stream: TcpStream,
    conn: &Arc<Connection>,
    shared: &Shared<S>,
) -> std::io::Result<()> {
    let mut reader = BufReader::with_capacity(64 * 1024, stream);
    let mut body = Vec::new();
    while !conn.is_closed() {
        let seq = match frame::read_frame(&mut reader, &mut body) {
            Ok(seq) => seq,
            Err(FrameError::Closed) => return Ok(()),
            Err(FrameError::Io(e)) => return Err(e),
            Err(FrameError::BadLength(len)) => {
                // The next frame boundary cannot be found: say why, hang up.
                conn.send(0, &shared.service.malformed(format!("impossible frame length {len}")));
                return Err(std::io::Error::other(format!("bad frame length {len}")));
            }
        };
        let call = Call { conn: conn.clone(), seq, _reply: PhantomData };
        match codec::decode::<S::Request>(&body) {
            Ok(request) => shared.service.handle(request, call),
            Err(e) => {
                call.answer(shared.service.malformed(e));
            }
        }
    }
    Ok(())
}

type Waiters<Resp> = Mutex<HashMap<u64, Sender<Result<Resp, RpcError>>>>;

/// The client's end of one connection, shared by the threads that call.
pub struct MuxChannel<Req, Resp> {
    stream: TcpStream,
    writer: Mutex<BufWriter<TcpStream>>,
    waiting: Arc<Waiters<Resp>>,
    open: Arc<AtomicBool>,
    next_seq: AtomicU64,
    timeout: Duration,
    _request: PhantomData<fn(Req)>,
}

impl<Req, Resp> std::fmt::Debug for MuxChannel<Req, Resp> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MuxChannel").field("open", &self.is_open()).finish()
    }
}

impl<Req, Resp> MuxChannel<Req, Resp> {
    pub fn is_open(&self) -> bool {
        // Acquire: pairs with the reader's Release store when it stops.
        self.open.load(Ordering::Acquire)
    }

    /// Cuts the connection; calls in flight fail with `Disconnected`.
    pub fn close(&self) {
        let _ = self.stream.shutdown(Shutdown::Both);
    }
}

impl<Req: Serialize, Resp: DeserializeOwned + Send + 'static> MuxChannel<Req, Resp> {
    fn connect(
        server: SocketAddr,
        timeout: Duration,
        credentials: &Credentials,
    ) -> Result<Arc<Self>, RpcError> {
        let mut stream = TcpStream::connect_timeout(&server, timeout)?;
        stream.set_nodelay(true)?;
        stream.set_write_timeout(Some(timeout))?;
        client_handshake(&mut stream, &credentials.get(), timeout).map_err(|e| {
            if e.is_timeout() {
                RpcError::Timeout(timeout)
            } else {
                e.into()
            }
        })?;
        let waiting: Arc<Waiters<Resp>> = Arc::new(Mutex::new(HashMap::new()));
        let open = Arc::new(AtomicBool::new(true));
        {
            let reader = BufReader::with_capacity(16 * 1024, stream.try_clone()?);
            let (waiting, open) = (waiting.clone(), open.clone());
            std::thread::Builder::new()
                .name("mux-reader".into())
                .spawn(move || read_replies(reader, &waiting, &open))?;
        }
        Ok(Arc::new(Self {
            writer: Mutex::new(BufWriter::with_capacity(16 * 1024, stream.try_clone()?)),
            stream,
            waiting,
            open,
            next_seq: AtomicU64::new(1),
            timeout,
            _request: PhantomData,
        }))
    }

    /// Sends `request`; its answer arrives through the returned call.
    pub fn start(&self, request: &Req) -> Result<PendingCall<Resp>, RpcError> {
        if !self.is_open() {
            return Err(RpcError::Disconnected);
        }
        // Relaxed: the counter only hands out distinct numbers.
        let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = crossbeam_channel::bounded(1);
        // Registered before the request leaves, so the reply finds it.
        self.waiting.lock().insert(seq, tx);
        let body = codec::encode(request);
        let written = {
            let mut w = self.writer.lock();
            frame::write_frame(&mut *w, seq, &body).and_then(|()| w.flush())
        };
        if let Err(e) = written {
            self.waiting.lock().remove(&seq);
            self.close();
            return Err(RpcError::Io(e));
        }
        Ok(PendingCall { seq, rx, waiting: self.waiting.clone() })
    }

    /// Sends `request` and waits for its answer, at most the client's timeout.
    pub fn call(&self, request: &Req) -> Result<Resp, RpcError> {
        self.start(request)?.wait(self.timeout)
    }
}

/// A call whose answer has not been taken yet. Dropping it abandons the
/// call: a late answer is discarded by the reader.
pub struct PendingCall<Resp> {
    seq: u64,
    rx: Receiver<Result<Resp, RpcError>>,
    waiting: Arc<Waiters<Resp>>,
}

impl<Resp> PendingCall<Resp> {
    /// Waits up to `timeout` for the answer.
    pub fn wait(&self, timeout: Duration) -> Result<Resp, RpcError> {
        match self.rx.recv_timeout(timeout) {
            Ok(r) => r,
            Err(RecvTimeoutError::Timeout) => Err(RpcError::Timeout(timeout)),
            Err(RecvTimeoutError::Disconnected) => Err(RpcError::Disconnected),
        }
    }
}

impl<Resp> Drop for PendingCall<Resp> {
    fn drop(&mut self) {
        self.waiting.lock().remove(&self.seq);
    }
}

fn read_replies<Resp: DeserializeOwned>(
    mut reader: BufReader<TcpStream>,
    waiting: &Waiters<Resp>,
    open: &AtomicBool,
) {
    let mut body = Vec::new();
    let why = loop {
        let seq = match frame::read_frame(&mut reader, &mut body) {
            Ok(seq) => seq,
            Err(FrameError::Closed) => break RpcError::Disconnected,
            Err(FrameError::Io(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                break RpcError::Disconnected
            }
            Err(FrameError::Io(e)) => break RpcError::Io(e),
            Err(FrameError::BadLength(n)) => break RpcError::Protocol(format!("reply length {n}")),
        };
        let reply = codec::decode(&body).map_err(|e| RpcError::Protocol(format!("undecodable reply: {e}")));
        match waiting.lock().remove(&seq) {
            // A full or closed channel means the caller gave up meanwhile.
            Some(tx) => {
                let _ = tx.try_send(reply);
            }
            None => log::debug!("reply {seq} for a call nobody waits for"),
        }
    };
    log::debug!("mux connection ended: {why}");
    // Release: whoever sees the channel closed sees the waiters failed.
    open.store(false, Ordering::Release);
    for (_, tx) in waiting.lock().drain() {
        let _ = tx.try_send(Err(RpcError::Disconnected));
    }
}

/// A client of a [`MuxServer`]: one connection shared by every thread,
/// opened on first use and again after it broke.
pub struct MuxClient<Req, Resp> {
    server: SocketAddr,
    timeout: Duration,
    credentials: Credentials,
    current: Mutex<Option<Arc<MuxChannel<Req, Resp>>>>,
}

impl<Req: Serialize, Resp: DeserializeOwned + Send + 'static> MuxClient<Req, Resp> {
    /// `timeout` bounds connecting, writing, and [`MuxChannel::call`].
    pub fn new(server: SocketAddr, timeout: Duration) -> Self {
        Self { server, timeout, credentials: Credentials::anonymous(), current: Mutex::new(None) }
    }

    /// Connections prove `credentials` in their handshake.
    pub fn with_credentials(mut self, credentials: Credentials) -> Self {
        self.credentials = credentials;
        self
    }

    pub fn server(&self) -> SocketAddr {
        self.server
    }

    /// The open connection, or a new one; `true` with a new one.
    pub fn channel(&self) -> Result<(Arc<MuxChannel<Req, Resp>>, bool), RpcError> {
        let mut current = self.current.lock();
        if let Some(c) = current.as_ref() {
            if c.is_open() {
                return Ok((c.clone(), false));
            }
        }
        let c = MuxChannel::connect(self.server, self.timeout, &self.credentials)?;
        *current = Some(c.clone());
        Ok((c, true))
    }

    /// The connection if one is open.
    pub fn current(&self) -> Option<Arc<MuxChannel<Req, Resp>>> {
        self.current.lock().as_ref().filter(|c| c.is_open()).cloned()
    }
}

impl<Req, Resp> Drop for MuxClient<Req, Resp> {
    fn drop(&mut self) {
        if let Some(c) = self.current.lock().take() {
            let _ = c.stream.shutdown(Shutdown::Both);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Echoes a number at once, or after the next `Release` (from another
    /// connection or thread).
    #[derive(Default)]
    struct Deferred {
        parked: Mutex<Vec<(u64, Call<u64>)>>,
    }

    impl MuxService for Deferred {
        type Request = (bool, u64);
        type Response = u64;
        fn handle(&self, (park, n): (bool, u64), call: Call<u64>) {
            if park {
                self.parked.lock().push((n, call));
            } else {
                for (m, c) in self.parked.lock().drain(..) {
                    c.answer(m + 1000);
                }
                call.answer(n);
            }
        }
        fn malformed(&self, _error: String) -> u64 {
            u64::MAX
        }
    }

    #[test]
    fn deferred_answers_reach_the_right_callers() {
        let server = MuxServer::spawn("127.0.0.1:0".parse().unwrap(), Deferred::default(), "t").unwrap();
        let client: MuxClient<(bool, u64), u64> = MuxClient::new(server.local_addr(), Duration::from_secs(5));
        let (ch, new) = client.channel().unwrap();
        assert!(new);
        let parked: Vec<_> = (0..5).map(|i| ch.start(&(true, i)).unwrap()).collect();
        // A parked call does not hold up the connection.
        assert_eq!(ch.call(&(false, 42)).unwrap(), 42);
        for (i, p) in parked.iter().enumerate() {
            assert_eq!(p.wait(Duration::from_secs(5)).unwrap(), 1000 + i as u64);
        }
        // A call abandoned before its answer: the answer is dropped.
        let gone = ch.start(&(true, 7)).unwrap();
        assert!(matches!(gone.wait(Duration::from_millis(20)), Err(RpcError::Timeout(_))));
        drop(gone);
        assert_eq!(ch.call(&(false, 1)).unwrap(), 1);
        let (same, new) = client.channel().unwrap();
        assert!(!new && Arc::ptr_eq(&same, &ch));
        // Malformed bodies get the service's answer; the connection lives.
        let raw: crate::rpc::RpcClient<u8, u64> =
            crate::rpc::RpcClient::new(server.local_addr(), Duration::from_secs(5));
        assert_eq!(raw.call(&3u8).unwrap(), u64::MAX);
        // The server going away fails calls in flight instead of hanging them.
        let waiting = ch.start(&(true, 9)).unwrap();
        drop(server);
        assert!(matches!(waiting.wait(Duration::from_secs(5)), Err(RpcError::Disconnected)));
        assert!(!ch.is_open());
        assert!(client.current().is_none());
    }
}
