//! The software NIC: a host process serving its registered regions over tcp.
//!
//! One thread per connection reads frames in arrival order, executes each verb
//! on region memory and queues the reply; replies are flushed when no further
//! request is already buffered, so a pipelined batch costs one write system
//! call each way. The host knows nothing of locks: it applies verbs.
//!
//! Robustness: a body that does not decode is answered with
//! [`Response::Refused`] for its sequence number and the connection goes on; an
//! impossible length prefix or a stream that ends inside a frame closes that
//! connection only. Nothing a client sends can panic the host or touch memory
//! outside a region (every verb goes through [`RegionMemory`]'s checks).

use std::collections::HashMap;
use std::io::{BufReader, BufWriter, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use parking_lot::Mutex;

use super::wire::{self, FrameError, Request, Response};
use crate::rdma::addr::NodeId;
use crate::rdma::codec;
use crate::rdma::error::VerbError;
use crate::rdma::memory::RegionTable;

/// Statistics of a host, for `citronfs status` and tests.
#[derive(Debug, Default)]
pub struct HostStats {
    pub connections: AtomicU64,
    pub verbs: AtomicU64,
    pub refused_frames: AtomicU64,
    pub broken_connections: AtomicU64,
}

struct Shared {
    regions: Arc<RegionTable>,
    /// Node id -> where its mailbox listens.
    directory: Mutex<HashMap<NodeId, SocketAddr>>,
    next_node: AtomicU32,
    stopping: AtomicBool,
    /// Open connections, so that `shutdown` can cut them (a vanished host).
    open: Mutex<HashMap<u64, TcpStream>>,
    stats: HostStats,
}

/// A running software NIC. Dropping it stops accepting and closes every
/// connection.
pub struct TcpHost {
    addr: SocketAddr,
    shared: Arc<Shared>,
    acceptor: Option<JoinHandle<()>>,
}

impl TcpHost {
    /// Listens on `listen` (port 0 picks one) and serves `regions`.
    pub fn spawn(listen: SocketAddr, regions: Arc<RegionTable>) -> std::io::Result<Self> {
        let listener = TcpListener::bind(listen)?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            regions,
            directory: Mutex::new(HashMap::new()),
            next_node: AtomicU32::new(1),
            stopping: AtomicBool::new(false),
            open: Mutex::new(HashMap::new()),
            stats: HostStats::default(),
        });
        let acceptor = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name(format!("nic-accept-{}", addr.port()))
                .spawn(move || accept_loop(listener, shared))?
        };
        log::info!("software NIC listening on {addr}");
        Ok(Self { addr, shared, acceptor: Some(acceptor) })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn regions(&self) -> &Arc<RegionTable> {
        &self.shared.regions
    }

    pub fn stats(&self) -> &HostStats {
        &self.shared.stats
    }

    /// Stops accepting and cuts every open connection, as a crashed host would.
    pub fn shutdown(&mut self) {
        if self.shared.stopping.swap(true, Ordering::SeqCst) {
            return;
        }
        // Wake the acceptor; it sees `stopping` and returns.
        let _ = TcpStream::connect(self.addr);
        if let Some(h) = self.acceptor.take() {
            let _ = h.join();
        }
        for (_, s) in self.shared.open.lock().drain() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

impl Drop for TcpHost {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    let mut next_conn = 0u64;
    for stream in listener.incoming() {
        if shared.stopping.load(Ordering::SeqCst) {
            return;
        }
        let stream = match stream {
            Ok(s) => s,
            Err(e) => {
                log::warn!("accept failed: {e}");
                continue;
            }
        };
        next_conn += 1;
        let conn = next_conn;
        if let Ok(clone) = stream.try_clone() {
            shared.open.lock().insert(conn, clone);
        }
        shared.stats.connections.fetch_add(1, Ordering::Relaxed);
        let shared = shared.clone();
        let spawned = std::thread::Builder::new().name(format!("nic-conn-{conn}")).spawn(move || {
            let peer = stream.peer_addr().ok();
            if let Err(e) = serve(stream, &shared) {
                shared.stats.broken_connections.fetch_add(1, Ordering::Relaxed);
                log::debug!("connection {conn} from {peer:?} ended: {e}");
            }
            shared.open.lock().remove(&conn);
        });
        if let Err(e) = spawned {
            log::warn!("cannot start a connection thread: {e}");
        }
    }
}

fn serve(stream: TcpStream, shared: &Shared) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    let mut reader = BufReader::with_capacity(256 * 1024, stream.try_clone()?);
    let mut writer = BufWriter::with_capacity(256 * 1024, stream);
    let mut body = Vec::new();
    let mut out = Vec::new();
    loop {
        let seq = match wire::read_frame(&mut reader, &mut body) {
            Ok(seq) => seq,
            Err(FrameError::Closed) => return Ok(()),
            Err(FrameError::Io(e)) => return Err(e),
            Err(FrameError::BadLength(len)) => {
                shared.stats.refused_frames.fetch_add(1, Ordering::Relaxed);
                // We cannot find the next frame boundary: say why, then hang up.
                let refusal =
                    Response::Refused(VerbError::Malformed(format!("impossible frame length {len}")));
                out.clear();
                codec::encode_into(&mut out, &refusal);
                wire::write_frame(&mut writer, 0, &out)?;
                writer.flush()?;
                return Err(std::io::Error::other(format!("bad frame length {len}")));
            }
        };
        let response = match codec::decode::<Request>(&body) {
            Ok(request) => handle(request, shared),
            Err(e) => {
                shared.stats.refused_frames.fetch_add(1, Ordering::Relaxed);
                Response::Refused(VerbError::Malformed(e))
            }
        };
        out.clear();
        codec::encode_into(&mut out, &response);
        wire::write_frame(&mut writer, seq, &out)?;
        // Flush when the client has nothing more in flight that we already
        // hold: this batches the replies of a pipelined batch into one write.
        if reader.buffer().is_empty() {
            writer.flush()?;
        }
    }
}

fn handle(request: Request, shared: &Shared) -> Response {
    match request {
        Request::Verb(verb) => {
            shared.stats.verbs.fetch_add(1, Ordering::Relaxed);
            Response::Verb(shared.regions.execute(&verb))
        }
        Request::Join { mailbox } => {
            let id = NodeId(shared.next_node.fetch_add(1, Ordering::Relaxed));
            shared.directory.lock().insert(id, mailbox);
            Response::Joined(id)
        }
        Request::Resolve(node) => Response::Resolved(shared.directory.lock().get(&node).copied()),
        Request::ListRegions => Response::Regions(shared.regions.list()),
    }
}
